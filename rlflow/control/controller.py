"""The controller: the run's control plane, a small async core over plain modules.

It starts the services (through a launcher), registers them (`replicas.admit`),
welcomes each with its peers (`topology`) and weight transfer (`rounds.Weights`),
then dispatches what they say to plain code: the ledger of prompt groups
(`ledger`: the credits within the staleness bound), the weights' rounds and
generations (`rounds`), the run statistics (`stats`) and the supervision
policy (`replicas.Supervisor`: deaths, silence, hangs, restarts with back-off).
It carries no sample data.

Every handler is synchronous: state changes only between awaits, in one
task at a time. What a handler decides to say goes into the addressee's
outbox (`outbox`), sent by a task of its own, so a slow peer delays only
itself. The launcher's blocking calls (kill, restart, failures) run in
threads, outside the handlers.
"""

from __future__ import annotations

import collections
import logging
import os
import secrets
import time
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import trio

from rlflow.config import Config, kind_of
from rlflow.control import status as build
from rlflow.control.agents_router import agents_router, write_agents
from rlflow.control import steps
from rlflow.control.ledger import NO_SIGNAL
from rlflow.control.record import resume as resume_record
from rlflow.control.metrics import Sink, open_sinks
from rlflow.control.outbox import INBOX, Door, Outboxes, farewell, take
from rlflow.control.replicas import (
    STATEFUL_ROLES, GiveUp, Policy, Refusal, Replica, Roster, State, Supervisor, evidence, probes_disagree,
    reported,
)
from rlflow.control.rounds import Weights
from rlflow.control.stats import RunStats, process_cpu
from rlflow.control.topology import Topology
from rlflow.data import transport
from rlflow.data.net import CurveKeys, bind_host
from rlflow.control.ending import describe, why_it_ended
from rlflow.errors import RunFailed
from rlflow.protocol import (
    REPLACED, SCHEMA_VERSION, WEIGHT_GROUP_BROKEN, WRONG_VERSION, Ack, Bye, Credits, Dropped, ErrorReport, EvalDone,
    Expired, Heartbeat, Hello, ProtocolError, Ready, SchemaVersionMismatch, Shutdown, Stage,
    StepDone, WeightsGroup, WeightsLoaded, WeightsReady, Welcome,
)
from rlflow.rundir import (
    ControllerInfo, Phase, RunDir, Status, Summary, append_jsonl, write_json,
)

log = logging.getLogger("rlflow.controller")

#: Warnings kept for the status.
WARNINGS_KEPT = 10


class Launcher(Protocol):
    """What places and starts the services (see `rlflow.control.placement`)."""

    def start(self, controller_address: str) -> None: ...

    def failures(self) -> list[Any]:
        """Replicas whose process ended since the last call (role, rank, incarnation, message)."""

    def kill(self, role: str, rank: int) -> None:
        """End a replica (one that hangs)."""

    def restart(self, role: str, rank: int, incarnation: int) -> None:
        """Start incarnation `incarnation` of a replica that has ended."""


class Controller:
    """Runs one training run's control plane until its last step."""

    def __init__(self, config: Config, run_dir: str | os.PathLike, run_id: str, launcher: Launcher, *,
                 on_status: Callable[[Status], None] | None = None, secret: str = "",
                 curve: CurveKeys | None = None):
        self.config, self.run_dir, self.run_id, self.launcher = config, RunDir(run_dir), run_id, launcher
        #: The run's secret (every hello and `rlflow down` show it) and CURVE keys (None: loopback).
        self.on_status, self.secret, self.curve = on_status, secret, curve
        run, cluster = config.run, config.cluster
        self.roster = Roster({(name, rank) for name, role in config.role_items() for rank in range(role.replicas)},
                             {(name, rank) for name, role in config.role_items() for rank in range(role.replicas)
                              if (name, role) not in config.launched_roles()})
        #: What is said to each replica goes through its outbox.
        self.outboxes = Outboxes()
        self.ledger, self.version = steps.start_ledger(run)
        #: The version a replica loads when it starts (the checkpoint resumed from, else the policy's start).
        self.start_version = self.version
        self.weights = Weights(self.version, max_rebuilds=cluster.max_weight_rebuilds)
        self.topology = Topology([name for name, _ in config.role_items()])
        self.supervisor = Supervisor(Policy.of(cluster), trio.current_time)
        self.stats = RunStats([name for name, _ in config.role_items()])
        if run.resume:  # the record goes on from the checkpoint: one run, one record
            self.stats.carry(resume_record(self.run_dir, self.ledger.steps_done, self.ledger.trained_count))
        self.state: Phase = Phase.STARTING
        self.error: str | None = None
        self.stop_reason = ""
        self.door = Door()  # peers turned away, and messages not acted on
        self.warnings: list[str] = []
        self.received_by_type: collections.Counter[str] = collections.Counter()
        self.started, self.cpu0 = time.monotonic(), process_cpu()
        self.training_started: float | None = None
        self.address: str | None = None
        self.router: transport.Router | None = None
        self.agents_url = ""  # the agents' router (agents.router)
        self.done, self._all_hello, self._all_ready, self._welcomed = trio.Event(), trio.Event(), trio.Event(), False
        self._changed = trio.Event()  # an evaluation or a weight round ended
        self._nursery: trio.Nursery | None = None
        self._sinks: list[Sink] = []

    # ------------------------------------------------------------------ run

    async def run(self) -> Summary:
        """Start the services, run every step, shut them down; the summary."""
        bind = transport.tcp_address(bind_host(self.config.cluster.host))
        self.run_dir.path.mkdir(parents=True, exist_ok=True)
        self._sinks = open_sinks(self.run_dir, self.config, first_step=self.ledger.steps_done)
        try:
            async with transport.open_router(bind=bind, curve=self.curve, name="controller") as router, \
                    agents_router(self.config, self.run_dir, lambda: self.stop_reason or self.error or "run ended") \
                    as self.agents_url:
                self.router = self.outboxes.router = router
                router.on_reject = self._on_reject
                self.address = transport.bound_address(router)
                write_json(self.run_dir.controller, ControllerInfo(
                    run_id=self.run_id, pid=os.getpid(), address=self.address, secret=self.secret, curve=self.curve),
                    private=True)
                if self.roster.external:
                    write_json(self.run_dir.join, build.join_info(self), private=True)
                try:
                    async with trio.open_nursery() as nursery:
                        self._nursery = self.outboxes.nursery = nursery
                        nursery.start_soon(self._receive)
                        nursery.start_soon(self._watch)
                        nursery.start_soon(self.outboxes.take_losses, self._lose)
                        nursery.start_soon(self.door.run, router)
                        await trio.to_thread.run_sync(self.launcher.start, self.address)
                        await self._handshake()
                        await self._train()
                        nursery.cancel_scope.cancel()
                except BaseException as exc:
                    self.state, error, raised = why_it_ended(exc)
                    self.error = self.error or error
                    raise raised
                finally:
                    self._nursery = None
                    with trio.CancelScope(shield=True):
                        await farewell(self.router, self.roster, self.stop_reason or self.error or "run ended",
                                       heard=lambda replica, beat: self.stats.heartbeat(replica.role, replica.rank,
                                                                                        beat))
                        if self.state.live:
                            self.state = Phase.STOPPED
        except BaseException as exc:
            # Whatever ended the run (a failure while shutting down too), status and summary say so.
            if self.state not in (Phase.FAILED, Phase.INTERRUPTED):
                self.state = Phase.INTERRUPTED if isinstance(exc, KeyboardInterrupt) else Phase.FAILED
            self.error = self.error or describe(exc)
            raise
        finally:
            for sink in self._sinks:
                sink.close()
            if self.state is Phase.STOPPED:
                self.ledger.end()
            self.run_dir.append_ledger(self.ledger.drain())
            self._write_status()
            summary = self.summary()
            write_json(self.run_dir.summary, summary)
        return summary

    async def _handshake(self) -> None:
        timeout = self.config.cluster.handshake_timeout_s
        await _within(self._all_hello, timeout, lambda: "no hello from " + ", ".join(
            sorted(f"{r}-{k}" for r, k in self.roster.expected - set(self.roster.replicas))))
        if (disagree := probes_disagree(self.roster)) is not None:
            raise RunFailed(disagree)
        trainer = self.roster.replicas[("trainer", 0)].hello
        self.weights.offered(trainer.weights, trainer.layout, len(self.roster.role("rollout")), trainer.adapter)
        self._welcomed = True
        for replica in self.roster:
            if replica.registered:
                self.outboxes.post(replica, welcome(self, replica))
        await _within(self._all_ready, timeout,
                      lambda: ", ".join(sorted(r.name for r in self.roster if not r.live)) + " not ready")
        log.info("[controller] all %d services ready", len(self.roster.replicas))

    async def _train(self) -> None:
        """Evaluate, grant until the last step is trained, evaluate again, shut down."""
        if self.config.eval.before and not self.stats.evaluated_at(self.ledger.steps_done):  # kept on resume
            self.state = Phase.EVALUATING
            await _unless(self.done, self._evaluated)  # a stop request ends it (agents may never play it)
        self.state = Phase.RUNNING
        self.training_started = time.monotonic()
        if not self.done.is_set():
            self._grant()
        await self.done.wait()
        if self.config.eval.after and self.ledger.steps_done >= self.config.run.steps:
            self.state = Phase.EVALUATING
            while any(r.version < self.weights.rounds.published for r in self.roster.role("rollout") if r.live):
                await self._wait_change()
            await self._evaluated()

    async def _wait_change(self) -> None:
        await self._changed.wait()
        self._changed = trio.Event()

    # --------------------------------------------------------------- messages

    async def _receive(self) -> None:
        """Handle messages in order, taken off the socket as they come (`take`); from taken to
        handled is `stats.latency` (the wait for the controller, and its work)."""
        assert self._nursery is not None and self.router is not None  # run() sets both before it starts this task
        send, messages = trio.open_memory_channel(INBOX)
        self._nursery.start_soon(take, self.router, send)
        async for identity, msg, taken in messages:
            self.received_by_type[type(msg).__name__] += 1
            self._handle(identity, msg)
            self.stats.latency.add(time.perf_counter() - taken)

    def _handle(self, identity: bytes, msg: Any) -> None:
        if isinstance(msg, Hello):
            return self._on_hello(identity, msg)
        if isinstance(msg, Shutdown):  # from `rlflow down`, not a service
            if not secrets.compare_digest(msg.secret, self.secret):
                return self.door.ignore("unauthenticated", "a shutdown without the run's secret")
            self.stop_reason = msg.reason or "stopped on request"
            log.info("[controller] stop requested: %s", self.stop_reason)
            return self.done.set()
        replica = self.roster.by_identity.get(identity)
        if replica is None:
            if identity in self.roster.retired:
                return self.door.refuse(identity, Refusal(REPLACED, f"{self.roster.retired[identity]} was presumed "
                                                                    "lost and replaced: it must exit"), every=True)
            return self.door.ignore("unknown_sender", f"a {type(msg).__name__} from a peer that said no hello")
        replica.last_seen = trio.current_time()
        receivers = self.roster.receivers()
        match msg:
            case Heartbeat():
                self.stats.heartbeat(replica.role, replica.rank, msg)
                replica.version = max(replica.version, msg.version)
            case Ready():
                self._on_ready(replica, msg)
            case Ack(stage=Stage.ROLLOUT_END, group_ids=ids):
                self.ledger.generated(replica.rank, ids)
                self._grant()
            case Ack(stage=Stage.TRAINER_RECEIVED, group_ids=ids):
                self.ledger.received(ids)
            case StepDone():
                self._on_step(msg)
            case Expired(group_ids=ids, reason=reason, errors=errors):
                again = self.ledger.expired(ids, reason, errors)
                log.info("[controller] %d groups to grant again (%s)", len(again), reason or "expired")
                self._grant()
            case Dropped(group_ids=ids, reason=reason):
                gone = self.ledger.drop(ids, reason)
                if reason != NO_SIGNAL:  # the signal filter's drops are its work, not faults
                    log.warning("[controller] %s dropped %d groups: %s", replica.name, len(gone), reason or "no reason")
                self._grant()
            case WeightsReady(version=version, checksum=checksum):
                self.version = replica.version = version
                self.outboxes.order(self.weights.publish(version, receivers, checksum), self.roster)
            case WeightsGroup(transfer=transfer):
                self.outboxes.order(self.weights.hosted(transfer, receivers), self.roster)
            case WeightsLoaded(version=version, seconds=seconds, checksum=checksum):
                replica.version = version
                self.stats.weights_loaded(seconds)
                self.outboxes.order(self.weights.loaded(replica.rank, version, receivers, checksum), self.roster)
                self.outboxes.order(self.weights.evaluation(), self.roster)
                self._grant()
                self._changed.set()
            case EvalDone():
                append_jsonl(self.run_dir.evals, self.stats.eval_done(msg, self.ledger.steps_done))
                self.outboxes.order(self.weights.release(receivers), self.roster)
                self._grant()
                self._changed.set()
            case ErrorReport(kind=kind):
                if (failed := reported(replica, msg)) is not None:
                    self.error = failed
                    raise RunFailed(failed)
                if kind == WEIGHT_GROUP_BROKEN:
                    self.outboxes.order(self.weights.broken(receivers), self.roster)
            case Bye():
                replica.state = State.GONE
            case _:
                self.door.ignore("unexpected", f"a {type(msg).__name__} from {replica.name}")

    def _on_hello(self, identity: bytes, msg: Hello) -> None:
        older = self.roster.superseded(msg, secret=self.secret, schema_version=SCHEMA_VERSION)
        if older is not None:  # its user restarted it before its death was seen
            self._lose(older, f"was replaced by its incarnation {msg.incarnation}")
        replica = self.roster.join(identity, msg, secret=self.secret, schema_version=SCHEMA_VERSION,
                                   now=trio.current_time(), samples_per_prompt=self.config.run.samples_per_prompt)
        if isinstance(replica, Refusal):
            return self.door.refuse(identity, replica)
        self.stats.forget(replica.role, replica.rank)  # a new incarnation counts afresh
        if "agents" in msg.endpoints:  # agents.json names where each rollout replica serves agents now
            write_agents(self.run_dir, self.roster, self.config, self.agents_url)
            log.info("[controller] %s serves agents at %s (the key: %s)", replica.name, msg.endpoints["agents"],
                     self.run_dir.agents)
        for problem in msg.problems:
            self._warn(f"{replica.name}: {problem}")
        if self.roster.complete:
            self._all_hello.set()
        self.outboxes.open(replica)
        if self._welcomed:  # a new incarnation: welcomed at once
            self.outboxes.post(replica, welcome(self, replica))

    def _on_ready(self, replica: Replica, msg: Ready) -> None:
        replica.state, replica.version = State.READY, msg.version
        replica.progressed = replica.last_seen = trio.current_time()
        if self.roster.ready:
            self._all_ready.set()
        if replica.restarts == 0:
            return
        log.info("[controller] %s is back (incarnation %d)", replica.name, replica.incarnation)
        self.outboxes.post_each(self.topology.upstream(replica.role, self.roster))
        if replica.role == "rollout":
            self.outboxes.order(self.weights.joined(replica.rank, self.roster.receivers()), self.roster)

    def _on_step(self, msg: StepDone) -> None:
        for text in steps.record(msg, self.ledger, self.stats, self.run_dir, self._sinks,
                                 time_s=time.monotonic() - (self.training_started or self.started),
                                 messages=sum(self.received_by_type.values()),
                                 paced=self.config.run.credits == "paced"):
            self._warn(text)
        if self.ledger.steps_done >= self.config.run.steps:
            self.stop_reason = f"{self.config.run.steps} steps done"
            return self.done.set()
        every = self.config.eval.every_steps
        if every and self.ledger.steps_done % every == 0:
            self._evaluate()
        self._grant()

    # ---------------------------------------------------------- saying things

    def _grant(self) -> None:
        """Hand the groups the staleness bound allows to the rollout replicas with room
        (after saying what the ledger has to say: groups given up on as poison, a run of groups
        without signal)."""
        for text in self.ledger.notices:
            self._warn(text)
        self.ledger.notices.clear()
        # (a reproducible run generates nothing beside a held-out evaluation: see RunConfig.deterministic)
        if self.training_started is None or not self.state.live or (self.config.run.deterministic
                                                                     and self.weights.rounds.held):
            return
        room = {r.rank: r.capacity for r in self.roster.role("rollout")
                if r.live and r.rank not in self.weights.catching_up}
        for rank, groups in self.ledger.grant(room, self.version).items():
            credits = Credits(group_ids=[g.group_id for g in groups], min_versions=[g.min_version for g in groups])
            self.outboxes.post(self.roster.replicas[("rollout", rank)], credits)

    def _evaluate(self) -> int | None:
        """Ask rollout 0 to evaluate the held-out set on one version: no weight round starts until it
        has (one moving ends first); the version it reads (None: no held-out set)."""
        if kind_of(self.config.task) == "sim":
            return None
        self.outboxes.order(self.weights.evaluate(self.config.eval.temperature), self.roster)
        return self.weights.rounds.moved

    async def _evaluated(self) -> None:
        """Evaluate, and wait for this evaluation (an earlier one may still be running); asked again of
        rollout 0's replacement, once it holds the current weights, if rollout 0 is lost meanwhile."""
        version, evaluator = self._evaluate(), self.roster.replicas[("rollout", 0)]
        asked = evaluator.incarnation
        while version is not None and not any(e.version >= version for e in self.stats.evals):
            await self._wait_change()
            if evaluator.incarnation != asked and evaluator.live and 0 not in self.weights.catching_up:
                version, asked = self._evaluate(), evaluator.incarnation

    def _warn(self, text: str) -> None:
        """Something a person should look at: logged, and the latest few in the status."""
        log.warning("[controller] %s", text)
        self.warnings.append(text)
        del self.warnings[:-WARNINGS_KEPT]

    def _on_reject(self, identity: bytes, exc: ProtocolError) -> None:
        """A peer of another schema version is told so, in this one's."""
        if isinstance(exc, SchemaVersionMismatch) and identity not in self.roster.by_identity:
            self.door.refuse(identity, Refusal(WRONG_VERSION, str(exc)))

    # ------------------------------------------------------- replica lives

    async def _watch(self) -> None:
        """Twice a second: replicas that died, went silent, hang or are due a
        restart; the ledger's changes written; the status too."""
        last_failures = 0.0
        while True:
            if trio.current_time() - last_failures > 1.0:
                last_failures = trio.current_time()
                for failure in await trio.to_thread.run_sync(self.launcher.failures):
                    if (replica := self.roster.died(failure)) is not None:
                        self._lose(replica, failure.message)
            holders = self.ledger.holders()
            for replica in self.roster:  # starting: the handshake judges silence; the lost are restarted
                if self.state.live or (self.state is Phase.STARTING and replica.lost):
                    self._supervise(replica, holders)
            self.run_dir.append_ledger(self.ledger.drain())
            self._write_status()
            await trio.sleep(0.5)

    def _supervise(self, replica: Replica, holders: collections.Counter[int]) -> None:
        """Judge `replica` (`holders`: the ledger's, the groups each rollout replica is generating)."""
        match self.supervisor.review(replica, *evidence(replica, self.stats.last(replica.role, replica.rank),
                                                        holders)):
            case ("lose", why):
                self._lose(replica, why, kill=True)
            case ("give_up", why):
                self._gave_up(replica, self.supervisor.give_up(replica, why))
            case ("restart", _):
                self.supervisor.restarting(replica)
                assert self._nursery is not None  # the watch runs in the nursery
                self._nursery.start_soon(self._restart, replica, replica.launched)

    def _lose(self, replica: Replica, why: str, *, kill: bool = False) -> None:
        """A replica died or hangs: retire the incarnation, give its work back,
        go on without it, and restart it after its back-off (or give up)."""
        if replica.state in (State.LOST, State.GIVEN_UP, State.GONE):
            return
        why += f" (it said: {replica.fatal})" if replica.fatal else ""
        text = f"{replica.name} {why}"
        if replica.role in STATEFUL_ROLES:
            self.error = f"{text}; the run stops (continue it with rlflow up --resume {self.run_dir.path})"
            raise RunFailed(self.error)
        was_registered = replica.registered
        verdict = self.supervisor.died(replica, why)
        self.roster.retire(replica)
        self.outboxes.close(replica)
        if kill and not replica.external:
            assert self._nursery is not None  # replicas are lost by the run's tasks, all in the nursery
            self._nursery.start_soon(trio.to_thread.run_sync, self.launcher.kill, replica.role, replica.rank)
        rollout = replica.role == "rollout"
        # An asked role (the env) holds no groups: the rollout gives back the episodes it loses.
        again = [] if not was_registered or not self.topology.streams(replica.role) else \
            self.ledger.lost(replica.rank) if rollout else self.ledger.lost_downstream(replica.name)
        self._warn(f"{text}; {len(again)} groups granted again")
        if rollout:
            self.outboxes.order(self.weights.left(replica.rank, self.roster.receivers()), self.roster)
        else:  # the role before it stops sending to it (until its replacement is ready)
            self.outboxes.post_each(self.topology.upstream(replica.role, self.roster))
        if isinstance(verdict, GiveUp):
            self._gave_up(replica, verdict)
        self._grant()

    def _gave_up(self, replica: Replica, verdict: GiveUp) -> None:
        self._warn(f"{replica.name} is given up on after {replica.restarts} restarts: {verdict.reason}; its last "
                   f"error: {replica.last_error}")
        if not any(r.state is not State.GIVEN_UP for r in self.roster.role(replica.role)):
            self.error = f"every {replica.role} replica is given up on; the last, {replica.name}: {replica.last_error}"
            raise RunFailed(self.error)

    async def _restart(self, replica: Replica, incarnation: int) -> None:
        """Start a replica's next incarnation (beside the watch: it may take a
        while); one that fails to start is lost again when overdue."""
        try:
            await trio.to_thread.run_sync(self.launcher.restart, replica.role, replica.rank, incarnation)
        except Exception as exc:
            replica.last_error = f"could not be restarted: {type(exc).__name__}: {exc}"
            log.warning("[controller] %s %s", replica.name, replica.last_error)

    # ---------------------------------------------------------------- the end

    def _write_status(self) -> None:
        status = build.run_status(self, trio.current_time())
        write_json(self.run_dir.status, status)
        if self.on_status is not None:
            self.on_status(status)

    def summary(self) -> Summary:
        return build.run_summary(self)


def welcome(controller: Controller, replica: Replica) -> Welcome:
    """What `replica` is welcomed with: who it streams to, the clock, and how
    weights reach it (a replacement loads the version it starts with, then catches up)."""
    first = replica.restarts == 0
    weights = controller.weights.welcome(replica.role, replica.rank, first=first,
                                         receivers=len(controller.roster.role("rollout")))
    peers = controller.topology.peers(replica.role, replica.rank, controller.roster)
    return Welcome(schema_version=SCHEMA_VERSION, run_id=controller.run_id,
                   version=controller.version if first else controller.start_version, peers=peers,
                   shm_peers=Topology.shm_peers(replica, peers, controller.roster),
                   text_peers=Topology.text_peers(peers, controller.roster),
                   heartbeat_s=heartbeat_s(controller.config.cluster, len(controller.roster.expected)), **weights)


#: Heartbeats a second, at most, the controller asks of all replicas together.
HEARTBEATS_PER_S = 100


def heartbeat_s(cluster: Any, replicas: int) -> float:
    """Seconds between a replica's heartbeats in a run of `replicas`: `cluster.heartbeat_s`, or longer
    where that would ask more than `HEARTBEATS_PER_S` of them all (never past a quarter of
    `cluster.heartbeat_timeout_s`). 82 replicas beating four times a second spent a fifth of a 2-core
    machine on it, and a simulated rollout replica a quarter of its time."""
    return max(cluster.heartbeat_s, min(replicas / HEARTBEATS_PER_S, cluster.heartbeat_timeout_s / 4))


async def _within(event: trio.Event, timeout: float, what: Callable[[], str]) -> None:
    """Wait for `event`; a `RunFailed` naming `what()` if it is not set within `timeout` seconds."""
    with trio.move_on_after(timeout):
        await event.wait()
    if not event.is_set():
        raise RunFailed(f"{what()} within {timeout:g} s; raise cluster.handshake_timeout_s if they are slow to start")


async def _unless(event: trio.Event, work: Callable[[], Awaitable[None]]) -> None:
    """`work()`, given up if `event` is set first."""

    async def cancel_when_set() -> None:
        await event.wait()
        nursery.cancel_scope.cancel()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(cancel_when_set)
        await work()
        nursery.cancel_scope.cancel()
