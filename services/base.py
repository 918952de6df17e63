"""What every rlflow service shares: how it talks to the controller, the
clock that says where its time goes, and the narrow context its engine gets.

A service is a class with its config and one `main(control)` coroutine that
reads top to bottom as its loop. `Service.run` wraps it: it opens the
control channel, runs `main`, and on the way out says `Bye` or, if `main`
raised, sends a fatal `ErrorReport` naming the error before re-raising, so
that a dying service is an error at the controller rather than a silence.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import math
import os
import secrets
import socket
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import Any

import msgspec
import trio

from rlflow.config import Config
from rlflow.data import transport
from rlflow.data import net
from rlflow.data.shm import ShmSettings, host_token
from rlflow.errors import leaves
from rlflow.protocol import (
    SCHEMA_VERSION,
    Bye,
    Counters,
    EngineLoad,
    ErrorReport,
    Heartbeat,
    Hello,
    Peers,
    Ready,
    Role,
    SampleBatch,
    Shutdown,
    Welcome,
    concat,
    layout,
)
from rlflow import timeline
from rlflow.roles import COUNTER_FAMILIES, MESSAGES_PER_S
from rlflow.rundir import RunDir
from rlflow.startup import ServiceSpec
from rlflow.tasks.core import Task, load_tokenizer, make_task, needs_tokenizer

STATES = ("busy", "starved", "blocked", "loading", "idle")


class StateClock:
    """Accumulates wall time per state: busy, starved (waiting for input),
    blocked (waiting for downstream to take output), loading (weights), idle."""

    def __init__(self) -> None:
        self._state = "idle"
        self._since = time.monotonic()
        self._totals = dict.fromkeys(STATES, 0.0)
        #: (wall time, state) at every change of state since the last `drain`:
        #: the service's timeline is every drain's events in order, then these.
        self.events: list[tuple[float, str]] = [(time.time(), "idle")]

    def drain(self) -> list[tuple[float, str]]:
        """The state changes recorded since the last drain, forgotten here
        (a busy service changes state thousands of times a second)."""
        events, self.events = self.events, []
        return events

    def set(self, state: str) -> None:
        now = time.monotonic()
        self._totals[self._state] += now - self._since
        if state != self._state:
            self.events.append((time.time(), state))
        self._state, self._since = state, now

    @contextlib.contextmanager
    def state(self, state: str) -> Iterator[None]:
        """Be in `state` for the block, then go back to the state before."""
        previous = self._state
        self.set(state)
        try:
            yield
        finally:
            self.set(previous)

    def totals(self) -> dict[str, float]:
        """Seconds in each state so far (the current one included)."""
        out = dict(self._totals)
        out[self._state] += time.monotonic() - self._since
        return out


@dataclass(frozen=True)
class EngineContext:
    """What an engine gets from its service, and no more: the config, which
    replica it is, where to account its time and counts, where to bind."""

    config: Config
    name: str
    """``<role>-<rank>``, for log lines."""
    rank: int
    replicas: int
    clock: StateClock
    counters: Counter[str]
    host: str
    """The address to bind sockets on."""
    run_dir: RunDir | None
    watch: Callable[[transport.Socket], None]
    """Report this socket's rejected messages in the heartbeats."""
    log: logging.Logger
    curve: net.CurveKeys | None = None
    """The run's CURVE keys, for the sockets the engine opens (None: the run stays on loopback)."""
    run_id: str = ""
    """The run's name (e.g. in the names of its shared-memory segments)."""

    def say(self, text: str, *args: Any) -> None:
        self.log.info(f"[{self.name}] " + text, *args)


def standalone_context(config: Config, role: str, rank: int = 0) -> EngineContext:
    """A context for an engine run without its service (tests, benches)."""
    return EngineContext(
        config=config,
        name=f"{role}-{rank}",
        rank=rank,
        replicas=1,
        clock=StateClock(),
        counters=Counter(),
        host="127.0.0.1",
        run_dir=None,
        watch=lambda sock: None,
        log=logging.getLogger(f"rlflow.{role}"),
    )


class Control:
    """A service's end of the control plane (a DEALER to the controller's ROUTER)."""

    def __init__(self, dealer: transport.Dealer, spec: ServiceSpec):
        self._dealer = dealer
        self.spec = spec
        #: The sequence number of the next heartbeat (the controller takes a lower one for a new incarnation's).
        self.beats = 0

    @property
    def socket(self) -> transport.Dealer:
        return self._dealer

    async def hello(self, endpoints: dict[str, str], **fields: Any) -> Welcome:
        """Register (with the run's secret); the controller's `Welcome`.
        `fields`: what the controller should know of this replica (`Hello`'s
        role-specific fields, e.g. a rollout's ``slots``)."""
        hello = Hello(
            role=Role[self.spec.role.upper()],
            rank=self.spec.rank,
            replicas=self.spec.replicas,
            schema_version=SCHEMA_VERSION,
            endpoints=endpoints,
            pid=os.getpid(),
            host=socket.gethostname(),
            incarnation=self.spec.incarnation,
            secret=self.spec.secret,
            **_placement(),
            shm=shm_token(self.spec.config),
            **fields,
        )
        welcome = await self._dealer.request(
            hello,
            (Welcome, ErrorReport),
            timeout=self.spec.config.cluster.handshake_timeout_s,
            setting="cluster.handshake_timeout_s",
        )
        if isinstance(welcome, ErrorReport):
            raise RuntimeError(f"the controller refused {self.spec.name}: {welcome.kind}: {welcome.message}")
        if welcome.schema_version != SCHEMA_VERSION:
            raise RuntimeError(
                f"controller speaks schema version {welcome.schema_version}, this service {SCHEMA_VERSION}"
            )
        return welcome

    async def ready(self, version: int) -> None:
        await self.send(Ready(version=version))

    async def send(self, msg: Any) -> None:
        await self._dealer.send(msg)

    def __aiter__(self) -> Control:
        return self

    async def __anext__(self) -> Any:
        """The next message from the controller (an iterator, not a generator:
        leaving an `async for` over it leaves nothing to clean up). A fatal
        `ErrorReport` from the controller (this incarnation was replaced)
        ends the service: it raises `Replaced`."""
        msg = await self._dealer.recv()
        if isinstance(msg, ErrorReport) and msg.fatal:
            raise Replaced(f"the controller ended {self.spec.name}: {msg.kind}: {msg.message}")
        return msg

    async def heartbeats(self, make: Callable[[int], Heartbeat], period_s: float) -> None:
        """Send `make(seq)` every `period_s` seconds, forever."""
        while True:
            await self.send(make(self.beats))
            self.beats += 1
            await trio.sleep(period_s)


class Replaced(Exception):
    """The controller presumed this incarnation lost and replaced it (or refused it)."""


def _placement() -> dict[str, Any]:
    """The CPUs this process may run on and its thread budget, as placed."""
    threads = os.environ.get("OMP_NUM_THREADS", "")
    out: dict[str, Any] = {"threads": int(threads) if threads.isdigit() else 0}
    if hasattr(os, "sched_getaffinity"):
        out["cpus"] = cpu_ranges(sorted(os.sched_getaffinity(0)))
    return out


#: The plain counts of `Counters` and whether each is a whole number.
_COUNTS = {f.name: isinstance(f.type, msgspec.inspect.IntType) for f in msgspec.inspect.type_info(Counters).fields
           if isinstance(f.type, (msgspec.inspect.IntType, msgspec.inspect.FloatType))}


def typed_counters(counts: Counter[str], rejected: Counter[str] | None = None) -> Counters:
    """A service's counts by name as the wire's `Counters`: a name of a family the role registry
    declares (`rlflow.roles.COUNTER_FAMILIES`: ``reward.<function>.<status>``, ``env.<call>.<status>``,
    ``agents.<event>``) goes to the family's map, any other to the field of its name. A name `Counters`
    does not have is a bug: it raises."""
    plain: dict[str, Any] = {}
    families: dict[str, dict[str, int]] = {field: {} for field in COUNTER_FAMILIES.values()}
    for key, value in counts.items():
        prefix, dot, rest = key.partition(".")
        if dot and prefix in COUNTER_FAMILIES:
            families[COUNTER_FAMILIES[prefix]][rest] = int(value)
        elif key in _COUNTS:
            plain[key] = int(value) if _COUNTS[key] else float(value)
        else:
            raise KeyError(f"{key!r} is not a field of rlflow.protocol.Counters")
    return Counters(**plain, **families, rejected=dict(rejected or {}))


def cpu_ranges(cpus: list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2,5"."""
    runs: list[list[int]] = []
    for cpu in cpus:
        if runs and runs[-1][1] == cpu - 1:
            runs[-1][1] = cpu
        else:
            runs.append([cpu, cpu])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


@contextlib.asynccontextmanager
async def open_control(spec: ServiceSpec) -> AsyncIterator[Control]:
    # A random identity: a peer that guessed it could otherwise take this
    # service's place at the controller's ROUTER before it connects.
    identity = f"{spec.name}-{secrets.token_hex(8)}".encode()
    async with transport.open_dealer(
        connect=spec.controller, identity=identity, curve=spec.curve, name=f"{spec.name}/control"
    ) as dealer:
        yield Control(dealer, spec)


def takes_shm(config: Config) -> bool:
    """Whether the run's services send and take tensors in shared memory (`cluster.shm`)."""
    return config.cluster.shm != "off"


def shm_settings(config: Config, run_id: str) -> ShmSettings | None:
    """How a service's sending sockets use shared memory (None: not at all)."""
    cluster = config.cluster
    if not takes_shm(config):
        return None
    return ShmSettings(min_bytes=cluster.shm_min_bytes, max_bytes=cluster.shm_max_bytes, label=run_id)


def shm_token(config: Config) -> str:
    """What this process says in `Hello.shm` (and `WeightsRequest.shm`)."""
    return host_token() if takes_shm(config) else ""


def waiting(channel: trio.MemoryReceiveChannel, most: int | None = None) -> list:
    """What `channel` holds now (at most `most` of it), taken without waiting."""
    out: list = []
    while most is None or len(out) < most:
        try:
            out.append(channel.receive_nowait())
        except trio.WouldBlock:
            break
    return out


def follow(push: transport.Push, current: list[str], peers: list[str], shm_peers: list[str] = ()) -> list[str]:
    """Point `push` at `peers` (after a replica of the next role was replaced):
    connect the new addresses (those in `shm_peers` take shared memory), let
    go of the old; the addresses now."""
    for address in peers:
        if address not in current:
            transport.connect(push, address, shm=address in shm_peers)
    for address in current:
        if address not in peers:
            transport.disconnect(push, address)
    return list(peers)


def bind_host(config: Config) -> str:
    """The address services bind their sockets on (the node's own, unless configured)."""
    return net.bind_host(config.cluster.host)


class Service:
    """Base of the four services: identity, clock, counters, and `run`."""

    def __init__(self, spec: ServiceSpec):
        self.spec = spec
        self.config = spec.config
        self.clock = StateClock()
        self.counters: Counter[str] = Counter()
        #: Policy version of the weights this service holds.
        self.version = 0
        self.log = logging.getLogger(f"rlflow.{spec.role}")
        self.run_dir = RunDir(spec.run_dir) if spec.run_dir else None
        #: Sockets whose rejected messages the heartbeats report.
        self.sockets: list[transport.Socket] = []
        #: This life of the replica in its timeline, once its first events are saved.
        self._life: dict[str, Any] | None = None
        self._started = time.time()

    def say(self, text: str, *args: Any) -> None:
        """Log a line that starts with the role, as every rlflow log line does."""
        self.log.info(f"[{self.spec.name}] " + text, *args)

    def context(self) -> EngineContext:
        """The narrow view of this service that its engine gets."""
        return EngineContext(
            config=self.config,
            name=self.spec.name,
            rank=self.spec.rank,
            replicas=self.spec.replicas,
            clock=self.clock,
            counters=self.counters,
            host=bind_host(self.config),
            run_dir=self.run_dir,
            watch=self.sockets.append,
            log=self.log,
            curve=self.spec.curve,
            run_id=self.spec.run_id,
        )

    def load_task(self) -> Task:
        """The run's task, with the policy's tokenizer where it speaks text."""
        tokenizer = load_tokenizer(self.config.policy_path) if needs_tokenizer(self.config) else None
        task = make_task(self.config, tokenizer)
        for warning in getattr(task, "warnings", ()):
            self.log.warning("[%s] data: %s", self.spec.name, warning)
        return task

    def queues(self) -> dict[str, int]:
        """Items waiting in this service's queues now (for heartbeats)."""
        return {}

    def checked_batch(self, msg: Any) -> Any:
        """`msg` if it is a SampleBatch; else None, counted. Its columns agree:
        every SampleBatch is validated when it is made, so one that arrived
        inconsistent was rejected as malformed by the socket."""
        if not isinstance(msg, SampleBatch):
            self.counters["unexpected_messages"] += 1
            return None
        return msg

    def engine_load(self) -> EngineLoad | None:
        """The engine's load now (a rollout replica's; None for other roles)."""
        return None

    def heartbeat(self, seq: int) -> Heartbeat:
        self.save_timeline()
        totals = self.clock.totals()
        rejected: Counter[str] = Counter()
        for sock in self.sockets:
            rejected.update(sock.rejected)
        return Heartbeat(
            seq=seq,
            version=self.version,
            busy_s=totals["busy"],
            starved_s=totals["starved"],
            blocked_s=totals["blocked"],
            loading_s=totals["loading"],
            queues=self.queues(),
            counters=typed_counters(self.counters, rejected),
            engine=self.engine_load(),
        )

    def save_timeline(self) -> None:
        """Move the state changes recorded so far out of memory (at every
        heartbeat): appended to the run directory's events file, or dropped
        when there is none, so that a long run's timeline does not grow the
        process. The first save starts this life of the replica there, and
        each says it was alive then (`rlflow.timeline`)."""
        events = self.clock.drain()
        if self.run_dir is None:
            return
        lines = [] if self._life is not None else [self._start_life()]
        lines += [json.dumps(event) for event in events]
        lines.append(json.dumps({"seen": time.time()}))
        timeline.append(self.run_dir, self.spec.name, lines)

    def _start_life(self) -> str:
        self._life = {"run_id": self.spec.run_id, "incarnation": self.spec.incarnation, "pid": os.getpid(),
                      "start": self._started}
        return timeline.life_line(**self._life)

    def write_trace(self) -> None:
        """The state timeline into the run directory (read by `rlflow report`):
        this life's, after those of the replica's lives before it."""
        if self.run_dir is None:
            return
        self.clock.set("idle")
        self.save_timeline()
        timeline.fold(self.run_dir, self.spec.name, self._life, {k: float(v) for k, v in self.counters.items()},
                      time.time())

    async def run(self) -> None:
        async with open_control(self.spec) as control:
            self.sockets.append(control.socket)
            try:
                await self.main(control)
            except Exception as exc:
                cause = next(leaves(exc))  # the first one is the one to report
                self.log.exception("[%s] failed", self.spec.name)
                with trio.move_on_after(2) as scope:
                    scope.shield = True
                    await control.send(ErrorReport(fatal=True, kind=type(cause).__name__, message=str(cause)[:2000]))
                raise
            # Its last counts, or the run's status ends on those of a heartbeat ago; before the trace is
            # written, which closes this life of its timeline (a heartbeat saves the timeline too).
            if control.beats:
                with trio.move_on_after(2) as scope:
                    scope.shield = True
                    await control.send(self.heartbeat(control.beats))
            self.write_trace()
            with trio.move_on_after(2) as scope:
                scope.shield = True
                await control.send(Bye(reason="shutdown"))

    async def main(self, control: Control) -> None:
        raise NotImplementedError


#: Batches a stage has done at most that go on as one message (those of one `layout`, joined): those
#: already done when it sends. At 16,384 slots the rollout sends each group as it finishes and the
#: trainer read, checked and acknowledged one message a group.
JOIN_AT_MOST = 64


class StageService(Service):
    """A service in the middle of the stream: pull a batch, work on it, push it on.

    Every streaming role plugs into this one loop: `process` (the role's
    work on a batch), and, for a role that keeps what passes and trains on it,
    `sent` (a batch went on), `idle` (work of its own while no
    batch waits: a training step) and `finish` (at shutdown, what it owes).
    Up to `max_batches` batches are worked on at once; those done while the
    one before them went on go on together, as one batch (`JOIN_AT_MOST`),
    and while batches keep coming its replicas send at most `MESSAGES_PER_S`
    messages a second together (the wait counts as busy).
    Batches come in and go on over shared memory between services of one
    machine (`cluster.shm`).
    Its clock reads busy while any batch or work of its own is under way,
    blocked while finished batches wait for downstream and nothing is being
    worked on, starved otherwise. A role of several ranks whose ranks above 0
    take no stream (`lead_only`) runs `follow` on those.
    """

    max_batches = 1
    #: Only rank 0 takes the stream; the others `follow` it.
    lead_only = False
    #: Seconds `finish` may take at shutdown.
    finish_s = 20.0

    def __init__(self, spec: ServiceSpec):
        super().__init__(spec)
        self._working = 0
        self._waiting_out = 0
        #: Whether its sends wait between two messages (`MESSAGES_PER_S`; counted busy).
        self._pacing = False
        self._due = trio.Event()
        #: The control channel, once `main` runs (`process` may tell the controller things).
        self.control: Control | None = None

    @property
    def lead(self) -> bool:
        """Rank 0: the role's face to the stream."""
        return self.spec.rank == 0

    async def prepare(self) -> None:
        """Get ready to work (load a model), before saying hello."""

    def hello_fields(self) -> dict[str, Any]:
        """What the controller should know of this replica (`Hello`'s role-specific fields)."""
        return {}

    async def process(self, batch: Any) -> Any:
        """The batch with this stage's fields filled in (None: nothing of it goes on)."""
        raise NotImplementedError

    async def sent(self, batch: Any) -> None:
        """`batch` went on downstream."""

    async def idle(self) -> bool:
        """No batch waits: do some work of its own if there is any (True), or say there is none (False);
        a role whose work falls due later says so with `work_due`."""
        return False

    def work_due(self) -> None:
        """Work of the role's own is due: `idle` is asked again, even while no batch arrives."""
        self._due.set()

    async def finish(self) -> None:
        """Shutting down (no more batches come in or go on): do what is owed."""

    async def follow(self, control: Control) -> None:
        """A rank above 0 of a `lead_only` role: take part in what rank 0 does until the run ends."""
        raise NotImplementedError

    def queues(self) -> dict[str, int]:
        return {"working": self._working, "out": self._waiting_out}

    def _retime(self) -> None:
        if self._working or self._pacing:
            self.clock.set("busy")
        elif self._waiting_out:
            self.clock.set("blocked")
        else:
            self.clock.set("starved")

    async def main(self, control: Control) -> None:
        self.control = control
        await self.prepare()
        if self.lead_only and not self.lead:
            return await self.follow(control)
        bind = transport.tcp_address(bind_host(self.config))
        async with transport.open_pull(
            bind=bind, curve=self.spec.curve, name=f"{self.spec.name}/in", shm=takes_shm(self.config)
        ) as inbox:
            self.sockets.append(inbox)
            welcome = await control.hello(endpoints={"in": transport.bound_address(inbox)}, **self.hello_fields())
            self.say("up at version %d, sending to %s", self.version, ", ".join(welcome.peers["out"]))
            async with (
                transport.open_push(
                    connect=welcome.peers["out"],
                    curve=self.spec.curve,
                    name=f"{self.spec.name}/out",
                    shm=shm_settings(self.config, self.spec.run_id),
                    shm_peers=welcome.shm_peers,
                ) as out,
                trio.open_nursery() as nursery,
            ):
                nursery.start_soon(control.heartbeats, self.heartbeat, welcome.heartbeat_s)
                streaming, streamed = trio.CancelScope(), trio.Event()
                nursery.start_soon(self._stream, inbox, out, streaming, streamed)
                await control.ready(self.version)
                peers = welcome.peers["out"]
                async for msg in control:
                    match msg:
                        case Peers():
                            peers = follow(out, peers, msg.peers.get("out", []), msg.shm_peers)
                        case Shutdown(reason=reason):
                            self.say("shutting down (%s)", reason)
                            streaming.cancel()
                            with trio.move_on_after(self.finish_s):
                                await streamed.wait()  # work under way ends first (a step in a thread)
                                await self.finish()
                            break
                nursery.cancel_scope.cancel()

    async def _stream(self, inbox: transport.Pull, out: transport.Push, scope: trio.CancelScope,
                      streamed: trio.Event) -> None:
        """Receive, work, send, until `scope` is cancelled; `streamed` is set when it has."""
        try:
            await self._streaming(inbox, out, scope)
        finally:
            streamed.set()

    async def _streaming(self, inbox: transport.Pull, out: transport.Push, scope: trio.CancelScope) -> None:
        with scope:
            async with trio.open_nursery() as nursery:
                done_send, done_recv = trio.open_memory_channel(0)
                slots = trio.Semaphore(self.max_batches)

                async def work(batch: SampleBatch) -> None:
                    try:
                        result = await self.process(batch)
                    finally:
                        self._working -= 1
                        slots.release()
                    if result is None:
                        self._retime()
                        return
                    self._waiting_out += 1
                    self._retime()
                    await done_send.send(result)

                async def next_batch() -> Any:
                    """The next message in; while none waits, the role's own work (`idle`, asked again
                    whenever it says work is due)."""
                    while (msg := inbox.recv_nowait()) is None:
                        self._working += 1
                        self._retime()
                        try:
                            did = await self.idle()
                        finally:
                            self._working -= 1
                            self._retime()
                        if did:
                            continue
                        self._due = trio.Event()
                        got: list[Any] = []
                        async with trio.open_nursery() as race:  # a message in, or work due (recv is cancel-safe)

                            async def take() -> None:
                                got.append(await inbox.recv())
                                race.cancel_scope.cancel()

                            async def due() -> None:
                                await self._due.wait()
                                race.cancel_scope.cancel()

                            race.start_soon(take)
                            race.start_soon(due)
                        if got:
                            return got[0]
                    return msg

                async def receive() -> None:
                    self._retime()
                    while True:
                        await slots.acquire()
                        batch = self.checked_batch(await next_batch())
                        if batch is None:
                            slots.release()
                            continue
                        self._working += 1
                        self._retime()
                        nursery.start_soon(work, batch)

                async def send() -> None:
                    last, every = -math.inf, self.spec.replicas / MESSAGES_PER_S
                    async for result in done_recv:
                        if (wait := last + every - trio.current_time()) > 0:
                            self._pacing = True  # busy, not blocked: nothing waits for downstream
                            self._retime()
                            await trio.sleep(wait)
                            self._pacing = False
                            self._retime()
                        last = trio.current_time()
                        # and those done by now: one message
                        results = [result, *waiting(done_recv, JOIN_AT_MOST - 1)]
                        for _, run in itertools.groupby(results, key=layout):
                            run = list(run)
                            batch = concat(run)
                            await out.send(batch)
                            self._waiting_out -= len(run)
                            self.counters["groups"] += len(batch.groups)
                            self.counters["samples"] += batch.n_samples
                            self.counters["bytes_out"] = out.bytes_sent
                            self.counters["bytes_shared"] = out.bytes_shared
                            self._retime()
                            await self.sent(batch)

                nursery.start_soon(send)
                nursery.start_soon(receive)
