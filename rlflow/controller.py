"""The controller: registers services, keeps the policy-version clock, grants
prompt-group credits within the staleness bound, coordinates weight updates
and writes the run's metrics. It carries no sample data.

Staleness. Group ``g`` belongs to step ``g // batch_size``; it may start on
weights no older than ``step - max_staleness`` (its credit's `min_version`),
and at most ``batch_size * (steps_done + max_staleness + 1)`` groups are
granted in all. With ``max_staleness = 0`` that is synchronous training with
a barrier: a step's groups start only once the previous step's weights are
loaded. The rollout restarts requests that fall too far behind a weight
update, and the trainer drops (and reports, for reissue) groups that would
still exceed the bound, so no token it trains on is older than allowed.

Every group is granted to one rollout replica, acknowledged by the trainer
when trained on, and granted again if a role drops it (`Expired`).
"""

from __future__ import annotations

import collections
import dataclasses
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

import psutil
import trio

from rlflow import transport
from rlflow.config import Config, kind_of
from rlflow.metrics import Sink, open_sinks
from rlflow.protocol import (
    SCHEMA_VERSION,
    Ack,
    Bye,
    Credits,
    ErrorReport,
    EvalDone,
    Evaluate,
    Expired,
    Heartbeat,
    Hello,
    Ready,
    Shutdown,
    Stage,
    StepDone,
    UpdateWeights,
    WeightsLoaded,
    WeightsReady,
    Welcome,
)
from rlflow.service import leaves

log = logging.getLogger("rlflow.controller")

STATE_KEYS = ("busy", "starved", "blocked", "loading")
#: Groups a rollout replica may hold, in multiples of what fills its slots.
HOLD = 16


class RunFailed(Exception):
    """The run cannot go on; the message says which service and why."""


class Launcher(Protocol):
    """What places and starts the services (see `rlflow.placement`)."""

    def start(self, controller_address: str) -> None: ...

    def failures(self) -> list[str]: ...


@dataclasses.dataclass
class Replica:
    role: str
    rank: int
    identity: bytes
    hello: Hello
    state: str = "hello"
    version: int = 0
    last_seen: float = dataclasses.field(default_factory=time.monotonic)
    heartbeats: collections.deque = dataclasses.field(default_factory=lambda: collections.deque(maxlen=32))
    first_heartbeat: Heartbeat | None = None
    at_last_step: Heartbeat | None = None
    outstanding: set[int] = dataclasses.field(default_factory=set)
    capacity: int = 1
    update_sent: dict[int, float] = dataclasses.field(default_factory=dict)

    @property
    def name(self) -> str:
        return f"{self.role}-{self.rank}"

    @property
    def heartbeat(self) -> Heartbeat | None:
        return self.heartbeats[-1] if self.heartbeats else None


@dataclasses.dataclass
class Group:
    group_id: int
    min_version: int
    owner: int | None = None
    state: str = "queued"  # queued -> issued -> generated -> acked


class Controller:
    """Runs one training run's control plane until its last step."""

    def __init__(
        self,
        config: Config,
        run_dir: pathlib.Path,
        run_id: str,
        launcher: Launcher,
        *,
        on_status: Callable[[dict], None] | None = None,
        secret: str = "",
    ):
        self.config = config
        #: Shown by every service in its hello and by `rlflow down`; a
        #: message from outside the run without it is ignored.
        self.secret = secret
        self.run_dir = pathlib.Path(run_dir)
        self.run_id = run_id
        self.launcher = launcher
        self.on_status = on_status
        run = config.run
        self.batch_size = run.batch_size
        self.staleness = run.staleness
        self.steps = run.steps
        self.expected = {(name, rank) for name, role in config.role_items() for rank in range(role.replicas)}
        self.replicas: dict[tuple[str, int], Replica] = {}
        self.by_identity: dict[bytes, Replica] = {}
        self.groups: dict[int, Group] = {}
        self.queue: collections.deque[int] = collections.deque()
        self.next_group = 0
        self.steps_done = 0
        self.version = 0
        self.weights: WeightsReady | None = None
        #: Version whose weights are being moved to the rollout now (one at a time).
        self.round: int | None = None
        self.loaded: set[int] = set()
        self.evals: list[dict[str, Any]] = []
        self._eval_done = trio.Event()
        self._round_done = trio.Event()
        self.has_heldout = kind_of(config.task) != "sim"
        self.state = "starting"
        self.error: str | None = None
        self.stop_reason = ""
        self.counts: collections.Counter[str] = collections.Counter()
        self.received_by_type: collections.Counter[str] = collections.Counter()
        self.last_metrics: dict[str, Any] = {}
        self.load_seconds: list[float] = []
        self.started = time.monotonic()
        self.training_started: float | None = None
        self._all_hello = trio.Event()
        self._all_ready = trio.Event()
        self.done = trio.Event()
        self._router: transport.Router | None = None
        self._sinks: list[Sink] = []
        self._cpu0 = (time.thread_time(), psutil.Process().cpu_times())
        if config.run.resume:
            self._restore(pathlib.Path(config.run.resume))

    # ------------------------------------------------------------------ run

    async def run(self) -> dict[str, Any]:
        """Start the services, run every step, shut them down; the summary."""
        host = self.config.cluster.host or "0.0.0.0"
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._sinks = open_sinks(self.run_dir)
        try:
            async with transport.open_router(bind=transport.tcp_address(host), name="controller") as router:
                self._router = router
                self.address = transport.bound_address(router)
                _write_json(
                    self.run_dir / "controller.json",
                    {"run_id": self.run_id, "pid": os.getpid(), "address": self.address, "secret": self.secret},
                    private=True,
                )
                try:
                    async with trio.open_nursery() as nursery:
                        nursery.start_soon(self._receive)
                        nursery.start_soon(self._watch)
                        await trio.to_thread.run_sync(self.launcher.start, self.address)
                        await self._handshake()
                        if self.config.eval.before:
                            self.state = "evaluating"
                            await self._evaluate(wait=True)
                        self.state = "running"
                        self.training_started = time.monotonic()
                        await self._grant()
                        await self.done.wait()
                        if self.config.eval.after and self.steps_done >= self.steps:
                            self.state = "evaluating"
                            while any(r.version < self.version for r in self._role("rollout")):
                                await self._round_done.wait()
                            await self._evaluate(wait=True)
                        nursery.cancel_scope.cancel()
                except BaseException as exc:
                    cause = _unwrap(exc)
                    self.state = "interrupted" if isinstance(cause, KeyboardInterrupt) else "failed"
                    if self.error is None:
                        self.error = _describe(cause)
                    if isinstance(cause, (KeyboardInterrupt, RunFailed)):
                        raise cause from None
                    log.error("[controller] failed", exc_info=cause)
                    raise RunFailed(self.error) from cause
                finally:
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
            self._write_status()
            summary = self.summary()
            _write_json(self.run_dir / "summary.json", summary)
        return summary

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
        for replica in self.replicas.values():
            await self._send(replica, Welcome(
                schema_version=SCHEMA_VERSION,
                run_id=self.run_id,
                peers=self._peers(replica.role),
                version=self.version,
                heartbeat_s=cluster.heartbeat_s,
                info=self._welcome_info(replica),
            ))
        with trio.move_on_after(cluster.handshake_timeout_s):
            await self._all_ready.wait()
        if not self._all_ready.is_set():
            missing = sorted(r.name for r in self.replicas.values() if r.state != "ready")
            raise RunFailed(
                f"{', '.join(missing)} not ready within {cluster.handshake_timeout_s:g} s of their welcome; "
                "raise cluster.handshake_timeout_s if they are slow to start"
            )
        log.info("[controller] all %d services ready", len(self.replicas))

    def _welcome_info(self, replica: Replica) -> dict[str, str]:
        """How the trainer's weights reach this replica: the trainer said in
        its hello; rollout replicas get ranks 1.. of the weight group."""
        trainer = self.replicas[("trainer", 0)].hello.info
        info = {k: v for k, v in trainer.items() if k.startswith("weights")}
        rollouts = len(self._role("rollout"))
        info["weights_world"] = str(1 + rollouts)
        if replica.role == "rollout":
            info["weights_rank"] = str(1 + replica.rank)
        return info

    def _peers(self, role: str) -> dict[str, list[str]]:
        order = [name for name, _ in self.config.role_items()]
        i = order.index(role)
        if i + 1 == len(order):
            return {}
        downstream = order[i + 1]
        return {"out": [r.hello.endpoints["in"] for r in self._role(downstream)]}

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
                self._unauthenticated("a shutdown")
                return
            self.stop_reason = msg.reason or "stopped on request"
            log.info("[controller] stop requested: %s", self.stop_reason)
            self.done.set()
            return
        replica = self.by_identity.get(identity)
        if replica is None:
            self.counts["unknown_sender"] += 1
            return
        replica.last_seen = time.monotonic()
        match msg:
            case Heartbeat():
                if replica.first_heartbeat is None:
                    replica.first_heartbeat = msg
                    replica.at_last_step = msg
                replica.heartbeats.append(msg)
                replica.version = max(replica.version, msg.version)
            case Ready():
                replica.state = "ready"
                replica.version = msg.version
                if all(r.state == "ready" for r in self.replicas.values()) and len(self.replicas) == len(self.expected):
                    self._all_ready.set()
            case Ack(stage=Stage.ROLLOUT_END, group_ids=ids):
                for group_id in ids:
                    replica.outstanding.discard(group_id)
                    group = self.groups.get(group_id)
                    if group is not None and group.state == "issued":
                        group.state = "generated"
                await self._grant()
            case StepDone():
                await self._on_step(msg)
            case Expired(group_ids=ids):
                for group_id in ids:
                    group = self.groups.get(group_id)
                    if group is None or group.state == "acked":
                        continue
                    if group.owner is not None:
                        self._replica("rollout", group.owner).outstanding.discard(group_id)
                    group.state, group.owner = "queued", None
                    self.queue.append(group_id)
                    self.counts["reissued"] += 1
                await self._grant()
            case WeightsReady():
                self.version = msg.version
                self.weights = msg
                if self.round is None:
                    await self._start_round()
            case WeightsLoaded(version=version, seconds=seconds):
                replica.version = version
                self.load_seconds.append(seconds)
                if version == self.round:
                    self.loaded.add(replica.rank)
                    if len(self.loaded) == len(self._role("rollout")):
                        self.round = None
                        self._round_done.set()
                        self._round_done = trio.Event()
                        if self.weights is not None and self.weights.version > version:
                            await self._start_round()
                await self._grant()
            case EvalDone():
                row = {
                    "step": self.steps_done,
                    "version": msg.version,
                    "version_end": msg.version_end,
                    "seconds": round(msg.seconds, 3),
                    **msg.metrics,
                }
                self.evals.append(row)
                with open(self.run_dir / "evals.jsonl", "a") as f:
                    f.write(json.dumps(row) + "\n")
                log.info("[controller] eval at v%d: %s", msg.version, msg.metrics.get("accuracy"))
                self._eval_done.set()
                self._eval_done = trio.Event()
            case ErrorReport(fatal=fatal, kind=kind, message=message):
                text = f"{replica.name} failed: {kind}: {message}"
                if fatal:
                    self.error = text
                    raise RunFailed(text)
                log.warning("[controller] %s", text)
                self.counts["errors"] += 1
            case Bye():
                replica.state = "bye"
            case _:
                self.counts["unexpected"] += 1

    async def _start_round(self) -> None:
        """Move the newest weights to every rollout replica (one round at a
        time: a collective transport must see the same versions on both sides)."""
        assert self.weights is not None
        msg = UpdateWeights(version=self.weights.version, info=self.weights.info, params=self.weights.params)
        self.round, self.loaded = msg.version, set()
        await self._send(self.replicas[("trainer", 0)], msg)
        for rollout in self._role("rollout"):
            rollout.update_sent[msg.version] = time.monotonic()
            await self._send(rollout, msg)

    async def _evaluate(self, *, wait: bool) -> None:
        """Ask rollout 0 to evaluate the held-out set (and wait for the result)."""
        if not self.has_heldout:
            return
        version = self.version
        await self._send(
            self.replicas[("rollout", 0)],
            Evaluate(version=version, temperature=self.config.eval.temperature),
        )
        # An earlier evaluation may still be running: wait for this one's.
        while wait and not any(e["version"] >= version for e in self.evals):
            await self._eval_done.wait()

    def _unauthenticated(self, what: str) -> None:
        """Count a message from outside the run that lacks its secret."""
        self.counts["unauthenticated"] += 1
        if self.counts["unauthenticated"] <= 3:
            log.warning("[controller] ignored %s without the run's secret", what)

    def _on_hello(self, identity: bytes, msg: Hello) -> None:
        if not secrets.compare_digest(msg.secret, self.secret):
            self._unauthenticated(f"a hello from {msg.role.label}-{msg.rank}")
            return
        key = (msg.role.label, msg.rank)
        if key not in self.expected:
            log.warning("[controller] hello from unexpected %s-%d ignored", *key)
            self.counts["unexpected_hello"] += 1
            return
        if key in self.replicas:
            raise RunFailed(f"{key[0]}-{key[1]} said hello twice (restarted?); recovering a replica is not supported")
        replica = Replica(role=key[0], rank=key[1], identity=identity, hello=msg)
        if replica.role == "rollout":
            # A group keeps its place until its last sample finishes, so with
            # a long tail a replica needs several times the groups that fill
            # its slots; the staleness bound caps the total anyway.
            slots = int(msg.info.get("slots", self.config.run.samples_per_prompt))
            replica.capacity = max(1, math.ceil(HOLD * slots / self.config.run.samples_per_prompt))
        self.replicas[key] = replica
        self.by_identity[identity] = replica
        if len(self.replicas) == len(self.expected):
            self._all_hello.set()

    def _replica(self, role: str, rank: int) -> Replica:
        return self.replicas[(role, rank)]

    async def _send(self, replica: Replica, msg: Any) -> None:
        assert self._router is not None
        await self._router.send(replica.identity, msg)

    # ---------------------------------------------------------------- credits

    async def _grant(self) -> None:
        """Queue the groups the staleness bound allows and hand them to the
        rollout replicas with room, least loaded first."""
        if self.state not in ("running", "evaluating") or self.training_started is None:
            return
        limit = min(self.batch_size * (self.steps_done + self.staleness + 1), self.batch_size * self.steps)
        while self.next_group < limit:
            group_id = self.next_group
            self.groups[group_id] = Group(group_id, max(0, group_id // self.batch_size - self.staleness))
            self.queue.append(group_id)
            self.next_group += 1
        rollouts = self._role("rollout")
        grants: dict[int, list[Group]] = collections.defaultdict(list)
        while self.queue:
            replica = min(rollouts, key=lambda r: len(r.outstanding) / r.capacity)
            if len(replica.outstanding) >= replica.capacity:
                break
            group = self.groups[self.queue.popleft()]
            # A reissued group may not start on weights older than the
            # bound allows at its new start.
            group.min_version = max(group.min_version, self.version - self.staleness)
            group.owner, group.state = replica.rank, "issued"
            replica.outstanding.add(group.group_id)
            grants[replica.rank].append(group)
        for rank, groups in grants.items():
            self.counts["granted"] += len(groups)
            await self._send(
                self._replica("rollout", rank),
                Credits(group_ids=[g.group_id for g in groups], min_versions=[g.min_version for g in groups]),
            )

    async def _on_step(self, msg: StepDone) -> None:
        self.steps_done = max(self.steps_done, msg.step + 1)
        for group_id in msg.acked:
            group = self.groups.pop(group_id, None)
            if group is not None and group.owner is not None:
                self._replica("rollout", group.owner).outstanding.discard(group_id)
        self.counts["acked"] += len(msg.acked)
        if "checkpoint" in msg.metrics:
            self._save_state(msg)
        since = self.training_started or self.started
        row = {"step": msg.step, "version": msg.version, "time_s": round(time.monotonic() - since, 4)}
        row.update(msg.metrics)
        occupancy = self._occupancy()
        if occupancy is not None:
            row["rollout.occupancy"] = round(occupancy, 4)
        for role, fractions in self._fractions(since_last_step=True).items():
            for key, value in fractions.items():
                row[f"{role}.{key}"] = round(value, 4)
        row["controller.msgs"] = sum(self.received_by_type.values())
        self.last_metrics = row
        for sink in self._sinks:
            sink.write(row)
        if self.steps_done >= self.steps:
            self.stop_reason = f"{self.steps} steps done"
            self.done.set()
            return
        every = self.config.eval.every_steps
        if every and self.steps_done % every == 0:
            await self._evaluate(wait=False)
        await self._grant()

    def _save_state(self, msg: StepDone) -> None:
        """Beside the trainer's checkpoint: the data cursor and the groups
        granted but not yet trained on (they are granted again on resume)."""
        folder = self.run_dir / "checkpoints" / f"step-{msg.step + 1:06d}"
        if not folder.is_dir():
            log.warning("[controller] no checkpoint folder %s", folder)
            return
        unacked = sorted(self.groups)
        _write_json(
            folder / "controller_state.json",
            {"step": msg.step + 1, "version": msg.version, "next_group": self.next_group, "unacked": unacked},
        )

    def _restore(self, folder: pathlib.Path) -> None:
        state = json.loads((folder / "controller_state.json").read_text())
        self.steps_done = self.version = state["step"]
        self.next_group = state["next_group"]
        for group_id in state["unacked"]:
            self.groups[group_id] = Group(group_id, max(0, self.version - self.staleness))
            self.queue.append(group_id)
        log.info("[controller] resumed at step %d, %d groups to grant again", self.steps_done, len(self.queue))

    # ------------------------------------------------------------- watching

    async def _watch(self) -> None:
        timeout = self.config.cluster.heartbeat_timeout_s
        last_failures = 0.0
        while True:
            now = time.monotonic()
            if now - last_failures > 1.0:
                last_failures = now
                failures = await trio.to_thread.run_sync(self.launcher.failures)
                if failures:
                    self.error = "; ".join(failures)
                    raise RunFailed(self.error)
            if self.state in ("running", "evaluating"):
                for replica in self.replicas.values():
                    if replica.state == "ready" and now - replica.last_seen > timeout:
                        self.error = (
                            f"{replica.name} sent nothing for {now - replica.last_seen:.0f} s "
                            "(cluster.heartbeat_timeout_s); it is presumed dead"
                        )
                        raise RunFailed(self.error)
            self._write_status()
            await trio.sleep(0.5)

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

    def _fractions(self, since_last_step: bool = False, window: bool = False) -> dict[str, dict[str, float]]:
        """Per role, the share of time in each state: since the last step,
        over the last few heartbeats, or over the whole run."""
        out = {}
        for name, _ in self.config.role_items():
            sums = dict.fromkeys(STATE_KEYS, 0.0)
            for replica in self._role(name):
                last = replica.heartbeat
                if last is None:
                    continue
                if since_last_step:
                    first = replica.at_last_step
                    replica.at_last_step = last
                elif window:
                    first = replica.heartbeats[0]
                else:
                    first = replica.first_heartbeat
                for key in STATE_KEYS:
                    sums[key] += getattr(last, f"{key}_s") - getattr(first, f"{key}_s")
            total = sum(sums.values())
            out[name] = {k: (v / total if total > 0 else 0.0) for k, v in sums.items()}
        return out

    def _occupancy(self) -> float | None:
        """Share of the rollout's slots in use since the last step (engines
        that count slot-seconds)."""
        used = capacity = 0.0
        for replica in self._role("rollout"):
            last, first = replica.heartbeat, replica.at_last_step
            if last is None or first is None or "slot_s" not in last.counters:
                return None
            elapsed = sum(getattr(last, f"{k}_s") - getattr(first, f"{k}_s") for k in STATE_KEYS)
            used += last.counters["slot_s"] - first.counters.get("slot_s", 0.0)
            capacity += elapsed * last.counters.get("slots", 0.0)
        return used / capacity if capacity > 0 else None

    def status(self) -> dict[str, Any]:
        now = time.monotonic()
        roles = {}
        window = self._fractions(window=True)
        for name, cfg in self.config.role_items():
            replicas = self._role(name)
            queues: collections.Counter[str] = collections.Counter()
            counters: collections.Counter[str] = collections.Counter()
            for r in replicas:
                if r.heartbeat is not None:
                    queues.update(r.heartbeat.queues)
                    counters.update({k: v for k, v in r.heartbeat.counters.items()})
            roles[name] = {
                "placed": [
                    {"rank": r.rank, "host": r.hello.host, "pid": r.hello.pid, "endpoints": r.hello.endpoints, **r.hello.info}
                    for r in replicas
                ],
                "replicas": cfg.replicas,
                "up": sum(r.state == "ready" for r in replicas),
                "states": {k: round(v, 3) for k, v in window[name].items()},
                "queues": dict(queues),
                "counters": dict(counters),
                "version": min((r.version for r in replicas), default=0),
                "staleness": self.version - min((r.version for r in replicas), default=0),
            }
        elapsed = now - self.started
        return {
            "run_id": self.run_id,
            "state": self.state,
            "error": self.error,
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "address": getattr(self, "address", None),
            "elapsed_s": round(elapsed, 2),
            "step": self.steps_done,
            "steps": self.steps,
            "version": self.version,
            "mode": self.config.run.mode,
            "max_staleness": self.staleness,
            "staleness_check": self.config.run.staleness_check,
            "groups": {
                "granted": self.counts["granted"],
                "outstanding": sum(len(r.outstanding) for r in self._role("rollout")),
                "acked": self.counts["acked"],
                "reissued": self.counts["reissued"],
            },
            "last_step": self.last_metrics,
            "roles": roles,
            "controller": self._controller_stats(),
        }

    def _controller_stats(self) -> dict[str, Any]:
        elapsed = max(time.monotonic() - self.started, 1e-9)
        thread0, proc0 = self._cpu0
        proc = psutil.Process().cpu_times()
        messages = sum(self.received_by_type.values())
        router = self._router
        return {
            "messages_received": messages,
            "messages_per_s": round(messages / elapsed, 2),
            "bytes_received": router.bytes_received if router else 0,
            "bytes_sent": router.bytes_sent if router else 0,
            "rejected": dict(router.rejected) if router else {},
            "ignored": {k: self.counts[k] for k in ("unknown_sender", "unauthenticated", "unexpected_hello") if self.counts[k]},
            "by_type": dict(self.received_by_type),
            "cpu_s": round(time.thread_time() - thread0, 4),
            "cpu_share": round((time.thread_time() - thread0) / elapsed, 5),
            "process_cpu_share": round(
                (proc.user + proc.system - proc0.user - proc0.system) / elapsed, 5
            ),
        }

    def _write_status(self) -> None:
        status = self.status()
        _write_json(self.run_dir / "status.json", status)
        if self.on_status is not None:
            self.on_status(status)

    def summary(self) -> dict[str, Any]:
        rows = _read_jsonl(self.run_dir / "metrics.jsonl")
        wall = time.monotonic() - (self.training_started or self.started)
        samples = sum(r.get("samples", 0) for r in rows)
        tokens = sum(r.get("tokens", 0) for r in rows)
        return {
            "run_id": self.run_id,
            "state": self.state,
            "error": self.error,
            "stop_reason": self.stop_reason,
            "mode": self.config.run.mode,
            "max_staleness": self.staleness,
            "staleness_check": self.config.run.staleness_check,
            "steps": self.steps_done,
            "samples": samples,
            "tokens": tokens,
            "wall_time_s": round(wall, 3),
            "samples_per_s": round(samples / wall, 3) if wall > 0 else 0.0,
            "tokens_per_s": round(tokens / wall, 3) if wall > 0 else 0.0,
            "staleness_max": max((r.get("staleness_max", 0) for r in rows), default=0),
            "staleness_mean": _mean([r.get("staleness_mean", 0) for r in rows]),
            "reward_mean": _mean([r["reward_mean"] for r in rows if _finite(r.get("reward_mean"))]),
            "weights_load_s_mean": _mean(self.load_seconds),
            "evals": self.evals,
            **_eval_summary(self.evals),
            "groups": {"acked": self.counts["acked"], "reissued": self.counts["reissued"]},
            "data_bytes": sum(
                r.heartbeat.counters.get("bytes_out", 0) for r in self._role("rollout") if r.heartbeat is not None
            ),
            "roles": self._fractions(),
            "controller": self._controller_stats(),
        }


def _eval_summary(evals: list[dict[str, Any]]) -> dict[str, Any]:
    """Accuracy before and after, and the gain of the mean of the last three
    evaluations over the first."""
    acc = [e["accuracy"] for e in evals if "accuracy" in e]
    if not acc:
        return {}
    tail = acc[-3:]
    return {
        "eval_accuracy_before": acc[0],
        "eval_accuracy_after": acc[-1],
        "eval_accuracy_last3_mean": sum(tail) / len(tail),
        "eval_gain_last3_vs_first": sum(tail) / len(tail) - acc[0],
    }


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


def _write_json(path: pathlib.Path, data: Any, *, private: bool = False) -> None:
    """Replace `path` atomically (readable by its owner only if `private`)."""
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600 if private else 0o644)
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps(data, indent=1, default=str))
    os.replace(tmp, path)


def _read_jsonl(path: pathlib.Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def _mean(values: list[float]) -> float:
    return round(sum(values) / len(values), 6) if values else 0.0
