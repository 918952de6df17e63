"""The controller: the thin async shell around the run's ledger.

It registers the services (handshake), dispatches their messages to the
ledger of prompt groups (`ledger`), the weight rounds (`rounds`) and the run
statistics (`stats`), watches that every service is alive, and shuts them
down at the end. It carries no sample data; it keeps the policy-version
clock, grants prompt groups within the staleness bound (see `ledger`), and
tells the trainer when to send a new version and each rollout replica when
to load it.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import json
import logging
import math
import os
import pathlib
import secrets
import socket
import time
from collections.abc import Callable
from typing import Any, Protocol

import msgspec
import trio

from rlflow.config import Config, kind_of
from rlflow.control.ledger import GroupLedger, LedgerState
from rlflow.control.metrics import Sink, open_sinks
from rlflow.control.record import resume as resume_record
from rlflow.control.rounds import WeightRounds
from rlflow.control.stats import RunStats, process_cpu
from rlflow.data import transport
from rlflow.data.net import CurveKeys, bind_host
from rlflow.errors import RunFailed, leaves
from rlflow.protocol import (
    SCHEMA_VERSION,
    Ack,
    Bye,
    Credits,
    Dropped,
    WEIGHT_GROUP_BROKEN,
    ErrorReport,
    EvalDone,
    Evaluate,
    Expired,
    Heartbeat,
    Hello,
    ProtocolError,
    Peers,
    Ready,
    SchemaVersionMismatch,
    SendWeights,
    Shutdown,
    Stage,
    StepDone,
    UpdateWeights,
    WeightsGloo,
    WeightsLoaded,
    WeightsNccl,
    WeightsGroup,
    WeightsReady,
    Welcome,
)
from rlflow.rundir import (
    CONTROLLER_STATE,
    ControllerInfo,
    ControllerStats,
    EvalRow,
    GroupCounts,
    Placed,
    RoleStatus,
    RunDir,
    Status,
    Summary,
    append_jsonl,
    encode,
    read_json,
    write_json,
)

log = logging.getLogger("rlflow.controller")

#: Groups a rollout replica may hold, in multiples of what fills its slots.
HOLD = 16
#: Peers refused with an answer, at most (more are refused in silence).
MAX_REFUSED = 4096
#: Heartbeat counters whose growth means a replica is getting on with its work.
PROGRESS_COUNTERS = ("decode_steps", "samples", "groups", "tokens")
#: Teacher replicas whose probe log-probabilities differ by more (nats) do not run together.
PROBE_TOLERANCE = 1e-4
#: A step where a larger share of the samples' rewards failed is a warning.
FAILED_SHARE_WARNING = 0.05
#: Warnings kept for the status.
WARNINGS_KEPT = 10
#: Roles that hold the policy (and so can be behind the trainer).
POLICY_ROLES = ("rollout", "trainer")


class Launcher(Protocol):
    """What places and starts the services (see `rlflow.control.placement`)."""

    def start(self, controller_address: str) -> None: ...

    def failures(self) -> list[Any]:
        """Replicas whose process ended since the last call (role, rank, incarnation, message)."""

    def kill(self, role: str, rank: int) -> None:
        """End a replica (one that hangs)."""

    def restart(self, role: str, rank: int) -> int:
        """Start a new incarnation of a replica that has ended; its number."""


class ControllerState(msgspec.Struct, frozen=True, kw_only=True):
    """What a checkpoint keeps of the controller (beside the trainer's state)."""

    step: int
    version: int
    ledger: LedgerState


@dataclasses.dataclass
class Replica:
    role: str
    rank: int
    identity: bytes
    hello: Hello
    state: str = "hello"  # hello -> ready -> bye
    version: int = 0
    last_seen: float = dataclasses.field(default_factory=time.monotonic)
    capacity: int = 1
    """Groups it may hold (rollout)."""
    incarnation: int = 0
    """The incarnation that said hello last."""
    launched: int = 0
    """The newest incarnation started (ahead of `incarnation` while a restart comes up)."""
    started: float = dataclasses.field(default_factory=time.monotonic)
    """When this incarnation was started (or, the first, said hello)."""
    start_s: float = 0.0
    """How long the first incarnation took from hello to ready: what a restart may take, times a margin."""
    progress: float = 0.0
    """Its progress counters' sum at `progressed`."""
    progressed: float = dataclasses.field(default_factory=time.monotonic)
    restarts: int = 0
    last_error: str = ""
    caught_up: bool = True
    """A replacement is given work only once it holds the current weights."""

    @property
    def name(self) -> str:
        return f"{self.role}-{self.rank}"

    @property
    def live(self) -> bool:
        return self.state == "ready"


class Controller:
    """Runs one training run's control plane until its last step."""

    def __init__(
        self,
        config: Config,
        run_dir: str | os.PathLike,
        run_id: str,
        launcher: Launcher,
        *,
        on_status: Callable[[Status], None] | None = None,
        secret: str = "",
        curve: CurveKeys | None = None,
    ):
        self.config = config
        self.run_dir = RunDir(run_dir)
        self.run_id = run_id
        self.launcher = launcher
        self.on_status = on_status
        #: Shown by every service in its hello and by `rlflow down`; a
        #: message from outside the run without it is ignored.
        self.secret = secret
        #: The run's CURVE keys (None: the run stays on loopback).
        self.curve = curve
        run = config.run
        self.expected = {(name, rank) for name, role in config.role_items() for rank in range(role.replicas)}
        self.replicas: dict[tuple[str, int], Replica] = {}
        self.by_identity: dict[bytes, Replica] = {}
        self.ledger = GroupLedger(run.batch_size, run.staleness, run.steps)
        self.version = 0
        if run.resume:
            state = read_json(pathlib.Path(run.resume) / CONTROLLER_STATE, ControllerState)
            if state is None:
                raise RunFailed(f"{run.resume} has no readable {CONTROLLER_STATE}")
            self.ledger = GroupLedger.restore(state.ledger, run.batch_size, run.staleness, run.steps)
            self.version = state.version
            log.info("[controller] resumed at step %d, %d groups to grant again", state.step, len(self.ledger.groups))
        #: The version of the weights a replica loads when it starts (the
        #: checkpoint resumed from, else the policy's start).
        self.start_version = self.version
        self.rounds = WeightRounds(self.version)
        self.stats = RunStats([name for name, _ in config.role_items()])
        if run.resume:  # the sessions before wrote past the checkpoint: cut that, carry on (control.record)
            self.stats.carry(resume_record(self.run_dir, self.ledger.steps_done, self.ledger.trained_count))
        self.has_heldout = kind_of(config.task) != "sim"
        self.state = "starting"
        self.error: str | None = None
        self.stop_reason = ""
        self.ignored: collections.Counter[str] = collections.Counter()
        self.warnings: list[str] = []
        self.received_by_type: collections.Counter[str] = collections.Counter()
        self.started = time.monotonic()
        self.training_started: float | None = None
        self.address: str | None = None
        self._all_hello = trio.Event()
        self._all_ready = trio.Event()
        self._eval_done = trio.Event()
        self._round_done = trio.Event()
        self.done = trio.Event()
        self._router: transport.Router | None = None
        self._nursery: trio.Nursery | None = None
        self._refused: set[bytes] = set()
        self._refusals, self._refusals_out = trio.open_memory_channel(16)
        self._new_welcomes, self._new_welcomes_out = trio.open_memory_channel(len(self.expected))
        #: A collective weight group must be made anew before the next round.
        self._regroup = False
        self._generation = 0
        self._members: list[int] = []
        self._moving_version = 0
        self._sinks: list[Sink] = []
        self._cpu0 = process_cpu()

    # ------------------------------------------------------------------ run

    async def run(self) -> Summary:
        """Start the services, run every step, shut them down; the summary."""
        bind = transport.tcp_address(bind_host(self.config.cluster.host))
        self.run_dir.path.mkdir(parents=True, exist_ok=True)
        self._sinks = open_sinks(self.run_dir, first_step=self.ledger.steps_done)
        try:
            async with transport.open_router(bind=bind, curve=self.curve, name="controller") as router:
                self._router = router
                router.on_reject = self._on_reject
                self.address = transport.bound_address(router)
                info = ControllerInfo(
                    run_id=self.run_id, pid=os.getpid(), address=self.address, secret=self.secret, curve=self.curve
                )
                write_json(self.run_dir.controller, info, private=True)
                try:
                    async with trio.open_nursery() as nursery:
                        self._nursery = nursery
                        nursery.start_soon(self._receive)
                        nursery.start_soon(self._watch)
                        nursery.start_soon(self._send_refusals)
                        nursery.start_soon(self._welcome_replacements)
                        await trio.to_thread.run_sync(self.launcher.start, self.address)
                        await self._handshake()
                        await self._train()
                        nursery.cancel_scope.cancel()
                except BaseException as exc:
                    if _only_cancelled(exc):  # stopped from outside: not a failure of the run
                        self.state, self.error = "interrupted", "cancelled"
                        raise
                    cause = _unwrap(exc)
                    self.state = "interrupted" if isinstance(cause, KeyboardInterrupt) else "failed"
                    if self.error is None:
                        self.error = _describe(cause)
                    if isinstance(cause, (KeyboardInterrupt, RunFailed)):
                        raise cause from None
                    log.error("[controller] failed", exc_info=cause)
                    raise RunFailed(self.error) from cause
                finally:
                    self._nursery = None
                    with trio.CancelScope(shield=True):
                        await self._shutdown_services()
                        if self.state in ("running", "evaluating"):
                            self.state = "stopped"
        except BaseException as exc:
            # Whatever ended the run (also a failure while shutting down),
            # status and summary say that it failed, and why.
            if self.state not in ("failed", "interrupted"):
                self.state = "interrupted" if isinstance(exc, KeyboardInterrupt) else "failed"
            if self.error is None:
                self.error = _describe(exc)
            raise
        finally:
            for sink in self._sinks:
                sink.close()
            if self.state == "stopped":
                self.ledger.end()
            self._flush_journal()
            self._write_status()
            summary = self.summary()
            write_json(self.run_dir.summary, summary)
        return summary

    async def _train(self) -> None:
        """Evaluate, grant until the last step is trained, evaluate again."""
        if self.config.eval.before and not self.stats.evaluated_at(self.ledger.steps_done):  # kept on resume
            self.state = "evaluating"
            await self._evaluate(wait=True)
        self.state = "running"
        self.training_started = time.monotonic()
        await self._grant()
        await self.done.wait()
        if self.config.eval.after and self.ledger.steps_done >= self.config.run.steps:
            self.state = "evaluating"
            while any(r.version < self.rounds.published for r in self._role("rollout") if r.live):
                await self._round_done.wait()
            await self._evaluate(wait=True)

    async def _handshake(self) -> None:
        cluster = self.config.cluster
        with trio.move_on_after(cluster.handshake_timeout_s):
            await self._all_hello.wait()
        if not self._all_hello.is_set():
            missing = sorted(f"{r}-{k}" for r, k in self.expected - set(self.replicas))
            raise RunFailed(
                f"no hello from {', '.join(missing)} within {cluster.handshake_timeout_s:g} s; "
                "raise cluster.handshake_timeout_s if they are slow to start"
            )
        self._check_teachers()
        for replica in self.replicas.values():
            await self._send(replica, self._welcome(replica))
        with trio.move_on_after(cluster.handshake_timeout_s):
            await self._all_ready.wait()
        if not self._all_ready.is_set():
            missing = sorted(r.name for r in self.replicas.values() if r.state != "ready")
            raise RunFailed(
                f"{', '.join(missing)} not ready within {cluster.handshake_timeout_s:g} s of their welcome; "
                "raise cluster.handshake_timeout_s if they are slow to start"
            )
        log.info("[controller] all %d services ready", len(self.replicas))

    def _check_teachers(self) -> None:
        """Replicas of the teacher must score alike (each scored the same probe)."""
        probes = {r.name: json.loads(r.hello.info["probe"]) for r in self._role("teacher") if "probe" in r.hello.info}
        if len(probes) < 2:
            return
        (first, reference), *others = probes.items()
        for name, values in others:
            worst = max((abs(a - b) for a, b in zip(values, reference, strict=True)), default=0.0)
            if not worst <= PROBE_TOLERANCE:  # NaN fails too
                raise RunFailed(
                    f"teacher replicas disagree: {name} scores the probe sequence {worst:.2g} nats away from "
                    f"{first} (at most {PROBE_TOLERANCE:g}); they must load the same model and settings"
                )

    def _welcome(self, replica: Replica) -> Welcome:
        """Who it streams to, the clock, and how weights reach it."""
        trainer = self.replicas[("trainer", 0)].hello
        offer, weights, layout = trainer.weights, None, []
        receivers = len(self._role("rollout"))
        if isinstance(offer, (WeightsGloo, WeightsNccl)):
            group = msgspec.structs.replace(offer, world_size=1 + receivers)
            if replica.role == "trainer" and replica.rank == 0:
                weights = group
            elif replica.role == "rollout" and replica.incarnation == 0:
                weights, layout = msgspec.structs.replace(group, rank=1 + replica.rank), trainer.layout
            elif replica.role == "rollout":  # a replacement joins the next generation of the group
                layout = trainer.layout
        elif replica.role == "rollout":
            weights = offer
        return Welcome(
            schema_version=SCHEMA_VERSION,
            run_id=self.run_id,
            peers=self._peers(replica.role, replica.rank),
            # What it loads at start: a replacement catches up after its welcome.
            version=self.version if replica.incarnation == 0 else self.start_version,
            heartbeat_s=self.config.cluster.heartbeat_s,
            weights=weights,
            layout=layout,
        )

    def _peers(self, role: str, rank: int = 0) -> dict[str, list[str]]:
        """``out``: the ``in`` endpoint of every replica of the next role that
        takes a stream (of the trainer's ranks, rank 0); to trainer rank 0,
        ``shares``: the ``share`` endpoint of each other trainer rank, in rank order."""
        order = [name for name, _ in self.config.role_items()]
        i = order.index(role)
        if i + 1 == len(order):
            others = [r.hello.endpoints.get("share", "") for r in self._role(role) if r.rank > 0]
            return {"shares": others} if rank == 0 and others else {}
        return {"out": [r.hello.endpoints["in"] for r in self._role(order[i + 1])
                        if r.state in ("hello", "ready") and "in" in r.hello.endpoints]}

    def _role(self, role: str) -> list[Replica]:
        return sorted((r for r in self.replicas.values() if r.role == role), key=lambda r: r.rank)

    # --------------------------------------------------------------- messages

    async def _receive(self) -> None:
        assert self._router is not None
        while True:
            identity, msg = await self._router.recv()
            self.received_by_type[type(msg).__name__] += 1
            await self._handle(identity, msg)

    async def _handle(self, identity: bytes, msg: Any) -> None:
        if isinstance(msg, Hello):
            self._on_hello(identity, msg)
            return
        if isinstance(msg, Shutdown):  # from `rlflow down`, not a service
            if not secrets.compare_digest(msg.secret, self.secret):
                self._ignore("unauthenticated", "a shutdown without the run's secret")
                return
            self.stop_reason = msg.reason or "stopped on request"
            log.info("[controller] stop requested: %s", self.stop_reason)
            self.done.set()
            return
        replica = self.by_identity.get(identity)
        if replica is None:
            self._ignore("unknown_sender", f"a {type(msg).__name__} from a peer that said no hello")
            return
        replica.last_seen = time.monotonic()
        match msg:
            case Heartbeat():
                self.stats.heartbeat(replica.role, replica.rank, msg)
                replica.version = max(replica.version, msg.version)
            case Ready():
                await self._on_ready(replica, msg)
            case Ack(stage=Stage.ROLLOUT_END, group_ids=ids):
                self.ledger.generated(replica.rank, ids)
                await self._grant()
            case Ack(stage=Stage.TRAINER_RECEIVED, group_ids=ids):
                self.ledger.received(ids)
            case WeightsGroup(transfer=transfer):
                await self._join_group(transfer)
            case StepDone():
                await self._on_step(msg)
            case Expired(group_ids=ids, reason=reason):
                again = self.ledger.expired(ids)
                log.info("[controller] %d groups to grant again (%s)", len(again), reason or "expired")
                await self._grant()
            case Dropped(group_ids=ids, reason=reason):
                gone = self.ledger.drop(ids, reason)
                log.warning("[controller] %s dropped %d groups: %s", replica.name, len(gone), reason or "no reason given")
                await self._grant()
            case WeightsReady(version=version):
                self.version = replica.version = version
                await self._move(self.rounds.publish(version))
            case WeightsLoaded(version=version, seconds=seconds):
                replica.version = version
                if version >= self.rounds.moved:
                    replica.caught_up = True
                self.stats.weights_loaded(seconds)
                await self._move(self.rounds.loaded(replica.rank, version, self._receivers()))
                await self._grant()
            case EvalDone():
                row = EvalRow(
                    step=self.ledger.steps_done,
                    version=msg.version,
                    version_end=msg.version_end,
                    seconds=round(msg.seconds, 3),
                    metrics=msg.metrics,
                )
                self.stats.evaluated(row)
                append_jsonl(self.run_dir.evals, row)
                log.info("[controller] eval at v%d: %s", msg.version, msg.metrics.get("accuracy"))
                self._eval_done.set()
                self._eval_done = trio.Event()
            case ErrorReport(fatal=fatal, kind=kind, message=message):
                text = f"{replica.name} failed: {kind}: {message}"
                if fatal and replica.role == "trainer":
                    self.error = text
                    raise RunFailed(text)
                if fatal:  # it is exiting: its death, when the launcher sees it, restarts it
                    replica.last_error = f"{kind}: {message}"[:500]
                log.warning("[controller] %s", text)
                if kind == WEIGHT_GROUP_BROKEN and self._collective():
                    await self._rebuild_weight_group()
            case Bye():
                replica.state = "bye"
            case _:
                self._ignore("unexpected", f"a {type(msg).__name__} from {replica.name}")

    def _warn(self, text: str) -> None:
        """Something a person should look at: logged, and the latest few in the status."""
        log.warning("[controller] %s", text)
        self.warnings.append(text)
        del self.warnings[:-WARNINGS_KEPT]

    def _ignore(self, kind: str, what: str) -> None:
        """Count a well-formed message that is not acted on (log the first few)."""
        self.ignored[kind] += 1
        if self.ignored[kind] <= 3:
            log.warning("[controller] ignored %s", what)

    def _refuse(self, identity: bytes, kind: str, why: str) -> None:
        """Answer a peer that may not join with a fatal `ErrorReport` (once per
        identity, so that a flood of bad hellos is not answered in kind)."""
        self._ignore(kind, why)
        if identity in self._refused or len(self._refused) >= MAX_REFUSED:
            return
        self._refused.add(identity)
        try:
            self._refusals.send_nowait((identity, ErrorReport(fatal=True, kind=kind, message=why)))
        except trio.WouldBlock:
            pass

    def _on_reject(self, identity: bytes, exc: ProtocolError) -> None:
        """A peer of another schema version is told so, in this one's."""
        if isinstance(exc, SchemaVersionMismatch) and identity not in self.by_identity:
            self._refuse(identity, "wrong_version", str(exc))

    async def _send_refusals(self) -> None:
        async for identity, report in self._refusals_out:
            try:
                await self._router.send(identity, report)
            except transport.PeerUnreachable:
                pass

    def _on_hello(self, identity: bytes, msg: Hello) -> None:
        name = f"{msg.role.label}-{msg.rank}"
        if msg.schema_version != SCHEMA_VERSION:
            self._refuse(identity, "wrong_version",
                         f"{name} speaks schema version {msg.schema_version}, this controller {SCHEMA_VERSION}")
            return
        if not secrets.compare_digest(msg.secret, self.secret):
            self._refuse(identity, "unauthenticated", f"a hello from {name} without the run's secret")
            return
        key = (msg.role.label, msg.rank)
        if key not in self.expected:
            self._refuse(identity, "unexpected_hello", f"a hello from {name}, which the config does not have")
            return
        old = self.replicas.get(key)
        if old is not None:
            if msg.incarnation <= old.incarnation or old.state not in ("gone", "restarting"):
                self._refuse(identity, "unexpected_hello", f"{name} said hello again as incarnation {msg.incarnation} "
                             f"while incarnation {old.incarnation} is {old.state}")
                return
            self._replaced(old, identity, msg)
            return
        replica = Replica(role=key[0], rank=key[1], identity=identity, hello=msg, version=self.version)
        if replica.role == "rollout":
            # A group keeps its place until its last sample finishes, so with
            # a long tail a replica needs several times the groups that fill
            # its slots; the staleness bound caps the total anyway.
            slots = int(msg.info.get("slots", self.config.run.samples_per_prompt))
            replica.capacity = max(1, math.ceil(HOLD * slots / self.config.run.samples_per_prompt))
        self.replicas[key] = replica
        self.by_identity[identity] = replica
        for problem in json.loads(msg.info.get("reference_problems", "[]")):
            self._warn(f"{replica.name}: {problem}")
        if len(self.replicas) == len(self.expected):
            self._all_hello.set()

    async def _send(self, replica: Replica, msg: Any) -> None:
        """Send to a replica; one whose connection is gone (it died, and the
        launcher has not said so yet) is lost, outside the caller's work."""
        assert self._router is not None
        try:
            await self._router.send(replica.identity, msg)
        except transport.PeerUnreachable:
            if self._nursery is None:
                raise
            if replica.state in ("gone", "given_up", "restarting"):
                return
            log.info("[controller] %s is unreachable (sending %s)", replica.name, type(msg).__name__)
            self._nursery.start_soon(functools.partial(self._lose, replica, "closed its connection",
                                                       incarnation=replica.incarnation))

    # --------------------------------------------------------- replica lives

    def _replaced(self, old: Replica, identity: bytes, hello: Hello) -> None:
        """A new incarnation of a replica said hello: it takes the old one's place."""
        self.by_identity.pop(old.identity, None)
        old.identity, old.hello, old.incarnation = identity, hello, hello.incarnation
        old.state, old.last_seen, old.version = "hello", time.monotonic(), 0
        old.caught_up = old.role != "rollout"
        self.by_identity[identity] = old
        self.stats.forget(old.role, old.rank)
        self._new_welcomes.send_nowait(old)

    async def _on_ready(self, replica: Replica, msg: Ready) -> None:
        replica.state = "ready"
        replica.version = msg.version
        replica.progressed = replica.last_seen = time.monotonic()
        if replica.incarnation == 0:
            replica.start_s = time.monotonic() - replica.started
        if len(self.replicas) == len(self.expected) and all(r.live for r in self.replicas.values()):
            self._all_ready.set()
        if replica.incarnation == 0:
            return
        log.info("[controller] %s is back (incarnation %d)", replica.name, replica.incarnation)
        await self._send_peers_to_upstream(replica.role)
        if replica.role == "rollout":
            await self._catch_up(replica)

    async def _welcome_replacements(self) -> None:
        """Welcome each new incarnation (after the run's handshake)."""
        await self._all_ready.wait()
        async for replica in self._new_welcomes_out:
            await self._send(replica, self._welcome(replica))

    async def _send_peers_to_upstream(self, role: str) -> None:
        """The role before `role` streams to its replicas' current endpoints."""
        order = [name for name, _ in self.config.role_items()]
        i = order.index(role)
        if i == 0:
            return
        for upstream in self._role(order[i - 1]):
            if upstream.live:
                await self._send(upstream, Peers(peers=self._peers(upstream.role)))

    async def _lose(self, replica: Replica, why: str, *, kill: bool = False, incarnation: int | None = None) -> None:
        """A replica died or hangs: give its work back, restart it (within its
        budget), and go on without it meanwhile. With `incarnation`, only if
        that incarnation is still the current one (a loss found by two sends
        at once is one loss, and never the replacement's)."""
        if replica.state in ("gone", "given_up"):
            return
        if incarnation is not None and (incarnation != replica.incarnation or replica.launched != incarnation):
            return
        text = f"{replica.name} {why}"
        if replica.role == "trainer":
            self.error = f"{text}; the run stops (continue it with rlflow up --resume {self.run_dir.path})"
            raise RunFailed(self.error)
        was_up = replica.state in ("hello", "ready")  # not a replacement that never came up
        replica.state = "gone"
        replica.last_error = why
        self.by_identity.pop(replica.identity, None)
        if kill:
            await trio.to_thread.run_sync(self.launcher.kill, replica.role, replica.rank)
        again = []
        if was_up:
            again = self.ledger.lost(replica.rank) if replica.role == "rollout" else self.ledger.lost_downstream(replica.name)
        self._warn(f"{text}; {len(again)} groups granted again")
        if replica.role == "rollout":
            self._regroup = True  # a collective weight group without it
            await self._move(self.rounds.left(self._receivers()))
        else:  # the role before it stops sending to it (until its replacement is ready)
            await self._send_peers_to_upstream(replica.role)
        if replica.restarts >= self.config.cluster.max_restarts:
            replica.state = "given_up"
            self._warn(f"{replica.name} is given up on after {replica.restarts} restarts; its last error: "
                       f"{replica.last_error}")
            if not any(r.live or r.state in ("gone", "restarting") for r in self._role(replica.role)):
                self.error = f"every {replica.role} replica is given up on; the last, {replica.name}: {replica.last_error}"
                raise RunFailed(self.error)
        else:
            replica.restarts += 1
            replica.launched += 1
            replica.state, replica.started = "restarting", time.monotonic()
            assert self._nursery is not None
            self._nursery.start_soon(self._restart, replica)
        await self._grant()

    async def _restart(self, replica: Replica) -> None:
        """Start the replica's next incarnation (beside the watch: starting may
        take a while); one that fails to start is lost again when its time to
        come up has passed."""
        try:
            await trio.to_thread.run_sync(self.launcher.restart, replica.role, replica.rank)
        except Exception as exc:
            replica.last_error = f"could not be restarted: {type(exc).__name__}: {exc}"
            log.warning("[controller] %s %s", replica.name, replica.last_error)

    def _restart_allowance(self, replica: Replica) -> float:
        """How long a restarted replica may take to be ready: three times what
        the first took, and never less than the heartbeat timeout."""
        return max(3 * replica.start_s, self.config.cluster.heartbeat_timeout_s)

    # ---------------------------------------------------------------- weights

    def _receivers(self) -> set[int]:
        """The rollout replicas that take part in weight rounds now."""
        return {r.rank for r in self._role("rollout") if r.live}

    def _collective(self) -> bool:
        return isinstance(self.replicas[("trainer", 0)].hello.weights, (WeightsGloo, WeightsNccl))

    async def _move(self, version: int | None) -> None:
        """Start moving `version` (if there is one to move): the trainer
        ranks send it, every live rollout replica loads it. A collective
        group that lost or gained a member is made anew first: the trainer
        hosts the new generation and says where (`WeightsGroup`), and the
        receivers join it as they load."""
        if version is None:
            if not self.rounds.busy:
                self._round_done.set()
                self._round_done = trio.Event()
            return
        transfer = None
        if self._regroup and self._collective():
            self._generation += 1
            offer = self.replicas[("trainer", 0)].hello.weights
            transfer = msgspec.structs.replace(offer, world_size=1 + len(self._receivers()), port=0,
                                               generation=self._generation)
            self._regroup = False
            self._members = sorted(self._receivers())
        for trainer in self._role("trainer"):
            await self._send(trainer, SendWeights(version=version, transfer=transfer))
        if transfer is not None:
            self._moving_version = version
            return  # the receivers are told when the trainer says where the group is
        for rollout in self._role("rollout"):
            if rollout.live:
                await self._send(rollout, UpdateWeights(version=version))

    async def _join_group(self, transfer: Any) -> None:
        """The trainer hosts a new generation of the weight group: every live
        receiver joins it, with its rank, and loads the version moving."""
        for i, rank in enumerate(self._members, start=1):
            rollout = self.replicas[("rollout", rank)]
            if rollout.live:
                mine = msgspec.structs.replace(transfer, rank=i)
                await self._send(rollout, UpdateWeights(version=self._moving_version, transfer=mine))

    async def _rebuild_weight_group(self) -> None:
        """A broadcast failed (a member died mid-way): the round moving is
        abandoned and the newest version moved again, through a new
        generation of the group."""
        self._regroup = True
        self.rounds.abandon()
        await self._move(self.rounds.repeat())

    async def _catch_up(self, replica: Replica) -> None:
        """A replacement rollout replica gets the current weights before any work."""
        replica.caught_up = False
        if self._collective():
            self._regroup = True
            if not self.rounds.busy:
                await self._move(self.rounds.repeat())
            return
        await self._send(replica, UpdateWeights(version=self.rounds.moved))

    # -------------------------------------------------------------- evaluation

    async def _evaluate(self, *, wait: bool) -> None:
        """Ask rollout 0 to evaluate the held-out set (and wait for the result)."""
        if not self.has_heldout:
            return
        version = self.version
        await self._send(
            self.replicas[("rollout", 0)], Evaluate(version=version, temperature=self.config.eval.temperature)
        )
        # An earlier evaluation may still be running: wait for this one's.
        while wait and not any(e.version >= version for e in self.stats.evals):
            await self._eval_done.wait()

    # ---------------------------------------------------------------- credits

    async def _grant(self) -> None:
        """Hand the groups the staleness bound allows to the rollout replicas with room."""
        if self.training_started is None or self.state not in ("running", "evaluating"):
            return
        room = {r.rank: r.capacity for r in self._role("rollout") if r.live and r.caught_up}
        for rank, groups in self.ledger.grant(room, self.version).items():
            await self._send(
                self.replicas[("rollout", rank)],
                Credits(group_ids=[g.group_id for g in groups], min_versions=[g.min_version for g in groups]),
            )

    async def _on_step(self, msg: StepDone) -> None:
        self.ledger.trained(msg.step, msg.acked)
        if "checkpoint" in msg.metrics:
            self._save_state(msg)
        since = self.training_started or self.started
        row = self.stats.close_step(msg, time.monotonic() - since, sum(self.received_by_type.values()))
        if row.reward_failed_share is not None and row.reward_failed_share > FAILED_SHARE_WARNING:
            self._warn(f"step {row.step}: the reward of {100 * row.reward_failed_share:.0f}% of the samples could not "
                       "be computed (see the reward counters in the status)")
        for sink in self._sinks:
            sink.write(row)
        if self.ledger.steps_done >= self.config.run.steps:
            self.stop_reason = f"{self.config.run.steps} steps done"
            self.done.set()
            return
        every = self.config.eval.every_steps
        if every and self.ledger.steps_done % every == 0:
            await self._evaluate(wait=False)
        await self._grant()

    def _save_state(self, msg: StepDone) -> None:
        """Beside the trainer's checkpoint: the clock and the ledger (the groups
        granted but not yet trained on are granted again on resume)."""
        folder = self.run_dir.checkpoint(msg.step + 1)
        if not folder.is_dir():
            log.warning("[controller] no checkpoint folder %s", folder)
            return
        state = ControllerState(step=msg.step + 1, version=msg.version, ledger=self.ledger.snapshot())
        write_json(folder / CONTROLLER_STATE, state)

    # ------------------------------------------------------------- watching

    async def _watch(self) -> None:
        """Every half second: replicas that died, went silent or hang are
        lost (and restarted); the ledger's changes are written; the status too."""
        cluster = self.config.cluster
        last_failures = 0.0
        while True:
            now = time.monotonic()
            if now - last_failures > 1.0:
                last_failures = now
                for failure in await trio.to_thread.run_sync(self.launcher.failures):
                    replica = self.replicas.get((failure.role, failure.rank))
                    if replica is None:  # before its hello: the run cannot start
                        self.error = f"{failure.role}-{failure.rank} {failure.message}"
                        raise RunFailed(self.error)
                    if failure.incarnation == replica.launched:  # not one lost already
                        await self._lose(replica, failure.message)
            if self.state in ("running", "evaluating"):
                for replica in list(self.replicas.values()):
                    await self._check_alive(replica, now, cluster)
            self._flush_journal()
            self._write_status()
            await trio.sleep(0.5)

    async def _check_alive(self, replica: Replica, now: float, cluster: Any) -> None:
        if replica.state == "restarting" and now - replica.started > self._restart_allowance(replica):
            await self._lose(replica, f"was not back within {self._restart_allowance(replica):.0f} s of its restart",
                             kill=True)
            return
        if not replica.live:
            return
        if now - replica.last_seen > cluster.heartbeat_timeout_s:
            await self._lose(replica, f"sent nothing for {now - replica.last_seen:.0f} s "
                             "(cluster.heartbeat_timeout_s): presumed dead", kill=True)
            return
        if replica.role == "trainer":
            return
        clock = self.stats.clocks.get((replica.role, replica.rank))
        if clock is None:
            return
        beat = clock.last
        progress = sum(beat.counters.get(k, 0.0) for k in PROGRESS_COUNTERS)
        if progress != replica.progress or not self._holds_work(replica, beat):
            replica.progress, replica.progressed = progress, now
        elif now - replica.progressed > cluster.progress_timeout_s:
            await self._lose(replica, f"made no progress for {now - replica.progressed:.0f} s while holding work "
                             "(cluster.progress_timeout_s): presumed hung", kill=True)

    def _holds_work(self, replica: Replica, beat: Heartbeat) -> bool:
        if replica.role == "rollout":
            return self.ledger.held_by(replica.rank) > 0
        return any(v > 0 for v in beat.queues.values())

    def _flush_journal(self) -> None:
        """The ledger's changes, appended to the run's ledger file."""
        events = self.ledger.drain()
        if events:
            now = time.time()
            with open(self.run_dir.ledger, "ab") as f:
                f.write(b"".join(encode(msgspec.structs.replace(e, t=round(now, 3))) + b"\n" for e in events))

    async def _shutdown_services(self) -> None:
        targets = [r for r in self.replicas.values() if r.state in ("hello", "ready")]
        for replica in targets:
            try:
                await self._send(replica, Shutdown(reason=self.stop_reason or self.error or "run ended"))
            except transport.PeerUnreachable:
                replica.state = "gone"
        with trio.move_on_after(10):
            while any(r.state in ("hello", "ready") for r in targets):
                if self._router is None:
                    break
                identity, msg = await self._router.recv()
                replica = self.by_identity.get(identity)
                if replica is not None and isinstance(msg, Bye | ErrorReport):
                    replica.state = "bye"

    # ---------------------------------------------------------------- status

    def status(self) -> Status:
        """The run now (what status.json holds)."""
        window = self.stats.window()
        roles = {}
        for name, cfg in self.config.role_items():
            replicas = self._role(name)
            beats = self.stats.latest(name)
            queues: collections.Counter[str] = collections.Counter()
            counters: collections.Counter[str] = collections.Counter()
            for beat in beats:
                queues.update(beat.queues)
                counters.update(beat.counters)
            held = [r.version for r in replicas if r.live] or [r.version for r in replicas]
            version = min(held, default=0) if name in POLICY_ROLES else None
            roles[name] = RoleStatus(
                replicas=cfg.replicas,
                up=sum(r.live for r in replicas),
                restarts=sum(r.restarts for r in replicas),
                placed=[
                    Placed(rank=r.rank, host=r.hello.host, pid=r.hello.pid, incarnation=r.hello.incarnation,
                           endpoints=r.hello.endpoints, info=r.hello.info)
                    for r in replicas
                ],
                states=window[name],
                queues=dict(queues),
                counters=dict(counters),
                version=version,
                behind=None if version is None else self.version - version,
            )
        return Status(
            run_id=self.run_id,
            state=self.state,
            error=self.error,
            pid=os.getpid(),
            host=socket.gethostname(),
            address=self.address,
            elapsed_s=round(time.monotonic() - self.started, 2),
            step=self.ledger.steps_done,
            steps=self.config.run.steps,
            samples=sum(r.samples for r in self.stats.rows),
            version=self.version,
            mode=self.config.run.mode,
            max_staleness=self.config.run.staleness,
            staleness_check=self.config.run.staleness_check,
            groups=self._group_counts(),
            last_step=self.stats.rows[-1] if self.stats.rows else None,
            last_eval=self.stats.evals[-1] if self.stats.evals else None,
            roles=roles,
            controller=self._controller_stats(),
            warnings=list(self.warnings),
            trends=self.stats.trends(),
        )

    def _group_counts(self) -> GroupCounts:
        counts = self.ledger.counts()
        return GroupCounts(
            queued=counts["queued"],
            generating=counts["generating"],
            downstream=counts["downstream"],
            received=counts["received"],
            trained=self.ledger.trained_count,
            granted=self.ledger.granted,
            reissued=self.ledger.reissued,
            dropped=dict(self.ledger.dropped),
        )

    def _controller_stats(self) -> ControllerStats:
        elapsed = max(time.monotonic() - self.started, 1e-9)
        (thread0, proc0), (thread, proc) = self._cpu0, process_cpu()
        messages = sum(self.received_by_type.values())
        router = self._router
        return ControllerStats(
            messages_received=messages,
            messages_per_s=round(messages / elapsed, 2),
            bytes_received=router.bytes_received if router else 0,
            bytes_sent=router.bytes_sent if router else 0,
            rejected=dict(router.rejected) if router else {},
            ignored=dict(self.ignored),
            by_type=dict(self.received_by_type),
            cpu_s=round(thread - thread0, 4),
            cpu_share=round((thread - thread0) / elapsed, 5),
            process_cpu_share=round((proc - proc0) / elapsed, 5),
        )

    def _write_status(self) -> None:
        status = self.status()
        write_json(self.run_dir.status, status)
        if self.on_status is not None:
            self.on_status(status)

    def summary(self) -> Summary:
        wall = time.monotonic() - (self.training_started or self.started)
        return self.stats.summary(
            wall,
            run_id=self.run_id,
            state=self.state,
            error=self.error,
            stop_reason=self.stop_reason,
            mode=self.config.run.mode,
            max_staleness=self.config.run.staleness,
            staleness_check=self.config.run.staleness_check,
            steps=self.ledger.steps_done,
            groups=self._group_counts(),
            controller=self._controller_stats(),
        )


def _only_cancelled(exc: BaseException) -> bool:
    """Whether `exc` is trio's cancellation and nothing else."""
    if isinstance(exc, BaseExceptionGroup):
        return exc.split(trio.Cancelled)[1] is None
    return isinstance(exc, trio.Cancelled)


def _unwrap(exc: BaseException) -> BaseException:
    """The one exception that says why the run ended, out of trio's groups:
    an interrupt first, then a `RunFailed`; anything else as it came."""
    if not isinstance(exc, BaseExceptionGroup):
        return exc
    for kind in (KeyboardInterrupt, RunFailed):
        match, _ = exc.split(kind)
        if match is not None:
            return next(leaves(match))
    return exc


def _describe(exc: BaseException) -> str:
    if isinstance(exc, BaseExceptionGroup):
        return "; ".join(_describe(e) for e in exc.exceptions)
    if isinstance(exc, KeyboardInterrupt):
        return "interrupted"
    return f"{type(exc).__name__}: {exc}" if not isinstance(exc, RunFailed) else str(exc)
