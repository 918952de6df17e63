"""What every rlflow service shares: how it is started, how it talks to the
controller, and the clock that says where its time goes.

A service is a class with its config and one `main(control)` coroutine that
reads top to bottom as its loop. `Service.run` wraps it: it opens the
control channel, runs `main`, and on the way out says `Bye` or, if `main`
raised, sends a fatal `ErrorReport` naming the error before re-raising, so
that a dying service is an error at the controller rather than a silence.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import pathlib
import secrets
import socket
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import msgspec
import trio

from rlflow import transport
from rlflow.config import Config
from rlflow.protocol import (
    SCHEMA_VERSION,
    Bye,
    ErrorReport,
    Heartbeat,
    Hello,
    Ready,
    Role,
    SampleBatch,
    Shutdown,
    Welcome,
    validate,
)

log = logging.getLogger("rlflow.service")

STATES = ("busy", "starved", "blocked", "loading", "idle")


class ServiceSpec(msgspec.Struct, frozen=True, kw_only=True):
    """Everything a service process needs to start (passed to it as bytes)."""

    role: str
    rank: int
    replicas: int
    run_id: str
    controller: str
    """The controller's ROUTER address."""
    config: Config
    run_dir: str = ""
    """Where the service writes its log (``logs/<role>-<rank>.log``); empty: stderr."""
    incarnation: int = 0
    secret: str = ""
    """The run's secret, shown to the controller in `Hello`."""

    def encode(self) -> bytes:
        return msgspec.msgpack.encode(self)

    @classmethod
    def decode(cls, data: bytes) -> ServiceSpec:
        return msgspec.msgpack.decode(data, type=cls)

    @property
    def name(self) -> str:
        return f"{self.role}-{self.rank}"


class StateClock:
    """Accumulates wall time per state: busy, starved (waiting for input),
    blocked (waiting for downstream to take output), loading (weights), idle."""

    def __init__(self) -> None:
        self._state = "idle"
        self._since = time.monotonic()
        self._totals = dict.fromkeys(STATES, 0.0)
        #: (wall time, state) at every change of state: the service's timeline.
        self.events: list[tuple[float, str]] = [(time.time(), "idle")]

    @property
    def current(self) -> str:
        return self._state

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


class Control:
    """A service's end of the control plane (a DEALER to the controller's ROUTER)."""

    def __init__(self, dealer: transport.Dealer, spec: ServiceSpec):
        self._dealer = dealer
        self.spec = spec

    async def hello(self, endpoints: dict[str, str], info: dict[str, str] | None = None) -> Welcome:
        hello = Hello(
            role=Role[self.spec.role.upper()],
            rank=self.spec.rank,
            replicas=self.spec.replicas,
            schema_version=SCHEMA_VERSION,
            endpoints=endpoints,
            pid=os.getpid(),
            host=socket.gethostname(),
            incarnation=self.spec.incarnation,
            info={**_placement_info(), **(info or {})},
            secret=self.spec.secret,
        )
        welcome = await self._dealer.request(
            hello,
            Welcome,
            timeout=self.spec.config.cluster.handshake_timeout_s,
            setting="cluster.handshake_timeout_s",
        )
        if welcome.schema_version != SCHEMA_VERSION:
            raise RuntimeError(
                f"controller speaks schema version {welcome.schema_version}, this service {SCHEMA_VERSION}"
            )
        return welcome

    async def ready(self, version: int) -> None:
        await self.send(Ready(version=version))

    async def send(self, msg: Any) -> None:
        await self._dealer.send(msg)

    async def recv(self) -> Any:
        return await self._dealer.recv()

    def __aiter__(self) -> AsyncIterator[Any]:
        return self._iter()

    async def _iter(self) -> AsyncIterator[Any]:
        while True:
            yield await self._dealer.recv()

    async def heartbeats(self, make: Callable[[int], Heartbeat], period_s: float) -> None:
        """Send `make(seq)` every `period_s` seconds, forever."""
        seq = 0
        while True:
            await self.send(make(seq))
            seq += 1
            await trio.sleep(period_s)

    @property
    def socket(self) -> transport.Dealer:
        return self._dealer


def _placement_info() -> dict[str, str]:
    """The CPUs this process may run on and its thread budget, as placed."""
    info = {"threads": os.environ.get("OMP_NUM_THREADS", "")}
    if hasattr(os, "sched_getaffinity"):
        info["cpus"] = cpu_ranges(sorted(os.sched_getaffinity(0)))
    return info


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
    async with transport.open_dealer(connect=spec.controller, identity=identity, name=f"{spec.name}/control") as dealer:
        yield Control(dealer, spec)


def bind_address(spec: ServiceSpec) -> str:
    """A TCP address with a free port on the address services bind to."""
    host = spec.config.cluster.host or _node_ip()
    return transport.tcp_address(host)


def _node_ip() -> str:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("10.255.255.255", 1))
            return probe.getsockname()[0]
        except OSError:
            return "127.0.0.1"


def leaves(exc: BaseException) -> Iterator[BaseException]:
    """The errors inside (nested) exception groups, in order; `exc` itself if
    it is not a group."""
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            yield from leaves(inner)
    else:
        yield exc


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
        #: Sockets whose rejected messages the heartbeats report.
        self.sockets: list[transport.Socket] = []

    def say(self, text: str, *args: Any) -> None:
        """Log a line that starts with the role, as every rlflow log line does."""
        self.log.info(f"[{self.spec.name}] " + text, *args)

    def queues(self) -> dict[str, int]:
        """Items waiting in this service's queues now (for heartbeats)."""
        return {}

    def checked_batch(self, msg: Any) -> Any:
        """`msg` if it is a consistent SampleBatch; else None, counted and logged."""
        if not isinstance(msg, SampleBatch):
            self.counters["unexpected_messages"] += 1
            return None
        try:
            validate(msg)
        except ValueError as exc:
            self.counters["rejected_batches"] += 1
            self.log.warning("[%s] dropped an inconsistent batch: %s", self.spec.name, exc)
            return None
        return msg

    def heartbeat(self, seq: int) -> Heartbeat:
        totals = self.clock.totals()
        counters = {k: float(v) for k, v in self.counters.items()}
        for sock in self.sockets:
            for kind, count in sock.rejected.items():
                key = f"rejected.{kind}"
                counters[key] = counters.get(key, 0.0) + count
        return Heartbeat(
            seq=seq,
            version=self.version,
            busy_s=totals["busy"],
            starved_s=totals["starved"],
            blocked_s=totals["blocked"],
            loading_s=totals["loading"],
            queues=self.queues(),
            counters=counters,
        )

    def write_trace(self) -> None:
        """The state timeline into ``trace/<role>-<rank>.json`` of the run
        directory (read by `rlflow report`)."""
        if not self.spec.run_dir:
            return
        folder = pathlib.Path(self.spec.run_dir) / "trace"
        folder.mkdir(parents=True, exist_ok=True)
        self.clock.set("idle")
        data = {"role": self.spec.role, "rank": self.spec.rank, "events": self.clock.events, "counters": dict(self.counters)}
        (folder / f"{self.spec.name}.json").write_text(json.dumps(data))

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
            self.write_trace()
            with trio.move_on_after(2) as scope:
                scope.shield = True
                await control.send(Bye(reason="shutdown"))

    async def main(self, control: Control) -> None:
        raise NotImplementedError


class StageService(Service):
    """A service in the middle of the stream: pull a batch, work on it, push it on.

    Up to `max_batches` batches are worked on at once. Its clock reads busy
    while any batch is being worked on, blocked while finished batches wait
    for downstream and nothing is being worked on, starved otherwise.
    """

    max_batches = 1

    def __init__(self, spec: ServiceSpec):
        super().__init__(spec)
        self._working = 0
        self._waiting_out = 0

    async def process(self, batch: Any) -> Any:
        """The batch with this stage's fields filled in."""
        raise NotImplementedError

    def queues(self) -> dict[str, int]:
        return {"working": self._working, "out": self._waiting_out}

    def _retime(self) -> None:
        if self._working:
            self.clock.set("busy")
        elif self._waiting_out:
            self.clock.set("blocked")
        else:
            self.clock.set("starved")

    async def main(self, control: Control) -> None:
        async with transport.open_pull(bind=bind_address(self.spec), name=f"{self.spec.name}/in") as inbox:
            self.sockets.append(inbox)
            welcome = await control.hello(endpoints={"in": transport.bound_address(inbox)})
            self.say("up, sending to %s", ", ".join(welcome.peers["out"]))
            async with (
                transport.open_push(connect=welcome.peers["out"], name=f"{self.spec.name}/out") as out,
                trio.open_nursery() as nursery,
            ):
                done_send, done_recv = trio.open_memory_channel(0)
                slots = trio.Semaphore(self.max_batches)

                async def work(batch: SampleBatch) -> None:
                    try:
                        result = await self.process(batch)
                    finally:
                        self._working -= 1
                        slots.release()
                    self._waiting_out += 1
                    self._retime()
                    await done_send.send(result)

                async def receive() -> None:
                    self._retime()
                    while True:
                        await slots.acquire()
                        batch = self.checked_batch(await inbox.recv())
                        if batch is None:
                            slots.release()
                            continue
                        self._working += 1
                        self._retime()
                        nursery.start_soon(work, batch)

                async def send() -> None:
                    async for result in done_recv:
                        await out.send(result)
                        self._waiting_out -= 1
                        self.counters["groups"] += len(result.groups)
                        self.counters["samples"] += result.n_samples
                        self._retime()

                nursery.start_soon(control.heartbeats, self.heartbeat, welcome.heartbeat_s)
                nursery.start_soon(send)
                nursery.start_soon(receive)
                await control.ready(self.version)
                async for msg in control:
                    if isinstance(msg, Shutdown):
                        self.say("shutting down (%s)", msg.reason)
                        break
                nursery.cancel_scope.cancel()
