"""The simulated rollout engine: a product feature for scale runs and the bench.

Continuous batching over `slots` sequences with a decode-step time and
long-tailed response lengths; every role downstream is real. Weights are
fetched over ZeroMQ from the trainer's weight server while generation goes
on, and only applying them pauses it.
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import math
import time
from dataclasses import dataclass, field
from typing import Generic, TypeVar

import numpy as np
import trio

from rlflow.algo.staleness import too_stale
from rlflow.config import SimRollout
from rlflow.data import transport
from rlflow.distributions import draw_lengths
from rlflow.protocol import (
    Codec,
    FinishReason,
    ParamSpec,
    PromptGroup,
    Response,
    Stage,
    WeightsMessage,
    WeightsPayload,
    WeightsRequest,
    WeightsZmq,
    WeightTransfer,
)
from rlflow.protocol.batch import N_STAGES
from rlflow.services.base import EngineContext

T = TypeVar("T")


@dataclass(eq=False)
class _Request:
    group: PromptGroup
    index: int
    target: int
    """Response length it will reach."""
    issued_at: float
    start_step: int = 0
    started_at: float = math.nan
    spans: list[tuple[int, int]] = field(default_factory=list)
    """(version, first token index) of each weight version it was generated under."""

    def generated(self, step: int) -> int:
        return step - self.start_step

    @property
    def end(self) -> int:
        """The engine step after which its last token is there."""
        return self.start_step + self.target


class RequestQueue(Generic[T]):
    """Requests waiting for a slot, first in line first, except that a request
    may not start on weights older than its `min_version`: those wait aside,
    keeping their place in line, until such weights are held.

    Putting a request in line and taking the next one cost O(log n) however
    many wait, so that a replica can hold thousands.
    """

    def __init__(self) -> None:
        self._ready: list[tuple[int, T]] = []  # (place in line, request)
        self._later: list[tuple[int, int, T]] = []  # (min_version, place in line, request)
        self._back = itertools.count()
        self._front = itertools.count(-1, -1)

    def push(self, req: T, min_version: int, *, first: bool = False) -> None:
        """Put `req` at the end of the line (`first`: at its head)."""
        place = next(self._front) if first else next(self._back)
        heapq.heappush(self._later, (min_version, place, req))

    def pop(self, version: int) -> T | None:
        """The first request in line that may start on weights `version`, if any."""
        while self._later and self._later[0][0] <= version:
            _, place, req = heapq.heappop(self._later)
            heapq.heappush(self._ready, (place, req))
        return heapq.heappop(self._ready)[1] if self._ready else None

    def waits_for_weights(self, version: int) -> bool:
        """Whether there are requests and every one waits for weights newer than `version`."""
        return not self._ready and bool(self._later) and self._later[0][0] > version

    def __len__(self) -> int:
        return len(self._ready) + len(self._later)


@dataclass
class _GroupState:
    group: PromptGroup
    responses: list[Response | None]
    left: int


class SimEngine:
    """A simulated engine: continuous batching over `slots` sequences, every
    active sequence gains one token per decode step, a step takes
    ``step_s + step_s_per_seq * active`` seconds, response lengths follow the
    configured distribution.

    It advances by events, not by decode steps: it sleeps until the next
    sequence finishes (the earliest end in a heap of the active ones) and
    wakes early when new work can start or weights arrive, then counts the
    whole steps that have passed. Token ids and log-probabilities are slices
    of arrays drawn once (a simulated response's content does not matter,
    its length does). So a wake costs O(log slots) and a response a copy of
    its tokens, and a thousand slots cost little more CPU than ten.
    """

    def __init__(self, cfg: SimRollout, ctx: EngineContext):
        self.cfg = cfg
        self.ctx = ctx
        self.clock = ctx.clock
        run = ctx.config.run
        self.staleness = run.staleness
        self.strict = run.staleness_check == "strict"
        self.partial = run.partial_rollout
        self.vocab = getattr(ctx.config.task, "vocab_size", 32000)
        self.rng = np.random.default_rng((run.seed, ctx.rank, 7))
        self.version = 0
        self.step = 0
        self.pending: RequestQueue[_Request] = RequestQueue()
        self.active: set[_Request] = set()
        self._ends: list[tuple[int, int, _Request]] = []  # (end step, tie-break, request), stale ones included
        self._ties = itertools.count()
        self._ids, self._logprobs = self._draw_tokens(1 << 16)
        self._cursor = 0
        self._cap = getattr(cfg.response_len, "max", math.inf)
        self.groups: dict[int, _GroupState] = {}
        self._wake = trio.Event()
        self._mark: float | None = None  # when the engine's step count was last brought up to date
        self._new_version: int | None = None
        self._fetching = False
        self._applied = trio.Event()
        self._send, self.finished = trio.open_memory_channel(2)
        self._server: str | None = None
        self._weights: transport.Dealer | None = None
        self._sockets: contextlib.AsyncExitStack | None = None

    eval_concurrency = 1

    # -- called by the service ------------------------------------------------

    async def start(self) -> None:
        """Nothing to load."""

    async def join_weights(self, transfer: WeightTransfer | None, layout: list[ParamSpec]) -> None:
        """Weights come over ZeroMQ, on request, from the trainer's weight server."""
        if not isinstance(transfer, WeightsZmq):
            raise ValueError(f"the simulated rollout fetches weights over ZeroMQ; the trainer offers {transfer!r}")
        self._server = transfer.address

    async def set_version(self, version: int) -> None:
        self.version = version

    async def close(self) -> None:
        """Nothing to release."""

    def hello_info(self) -> dict[str, str]:
        self.ctx.counters["slots"] = self.cfg.slots
        return {"slots": str(self.cfg.slots)}

    async def complete(self, prompt_ids: list[int], temperature: float) -> list[int]:
        raise NotImplementedError("the simulated engine has no model to evaluate")

    def submit(self, group: PromptGroup, issued_at: float) -> None:
        lengths = draw_lengths(self.cfg.response_len, self.rng, group.n)
        self.groups[group.group_id] = _GroupState(group, [None] * group.n, group.n)
        for i, n in enumerate(lengths.tolist()):
            self.pending.push(_Request(group, i, n, issued_at), group.min_version)
        if len(self.active) < self.cfg.slots:
            self._wake.set()

    async def update_weights(self, version: int, transfer: WeightTransfer | None) -> int:
        """Fetch the weights over the wire, then apply them between two steps."""
        if transfer is not None:
            await self.join_weights(transfer, [])
        # The payload crosses the wire while generation goes on; only
        # applying it pauses the engine.
        self._fetching = True
        self._wake.set()
        try:
            payload = await self._fetch(version)
        finally:
            self._fetching = False
        self.ctx.counters["weight_bytes"] += sum(t.nbytes for t in payload.tensors)
        self._new_version = payload.version
        self._applied = trio.Event()
        self._wake.set()
        await self._applied.wait()
        return self.version

    def queues(self) -> dict[str, int]:
        return {"pending": len(self.pending), "active": len(self.active)}

    # -- the loop -----------------------------------------------------------------

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        async with self._send, contextlib.AsyncExitStack() as self._sockets:
            task_status.started()
            while True:
                if self._new_version is not None and (self.partial or not self.active):
                    await self._apply(self._new_version)
                    self._mark = None  # no decoding while the weights went in
                self._admit()
                if not self.active:
                    self._wake = trio.Event()
                    # Idle for want of weights (a barrier, an update on its
                    # way) is loading; idle for want of work is starved.
                    waiting_for_weights = (
                        self._fetching or self._new_version is not None or self.pending.waits_for_weights(self.version)
                    )
                    self.clock.set("loading" if waiting_for_weights else "starved")
                    self._mark = None
                    await self._wake.wait()
                    continue
                self.clock.set("busy")
                await self._finish(await self._advance())

    def _admit(self) -> None:
        if self._new_version is not None and not self.partial:
            return  # draining: in-flight requests finish on the old weights first
        free = self.cfg.slots - len(self.active)
        if free <= 0 or not self.pending:
            return
        now = time.time()
        # In order, skipping requests that wait for newer weights (a reissued
        # group may start on the weights held now, behind ones that may not).
        while free > 0 and (req := self.pending.pop(self.version)) is not None:
            req.start_step, req.started_at = self.step, now
            req.spans = [(self.version, 0)]
            self._activate(req)
            free -= 1

    def _activate(self, req: _Request) -> None:
        self.active.add(req)
        heapq.heappush(self._ends, (req.end, next(self._ties), req))

    def _next_end(self) -> int:
        """The step at which the first active sequence ends (entries of
        requests restarted or gone since they were pushed are dropped)."""
        while True:
            end, _, req = self._ends[0]
            if req in self.active and req.end == end:
                return end
            heapq.heappop(self._ends)

    async def _advance(self) -> list[_Request]:
        """Sleep until the next sequence finishes, or less if woken; count
        the whole steps that passed; the requests that have finished."""
        active = len(self.active)
        step_s = self.cfg.step_s + self.cfg.step_s_per_seq * active
        todo = self._next_end() - self.step
        self._wake = trio.Event()
        if self._mark is None:  # busy again after idling
            self._mark = trio.current_time()
        if step_s > 0:
            with trio.move_on_after(max(todo * step_s - (trio.current_time() - self._mark), 0)):
                await self._wake.wait()
            # The engine's clock runs on its own, like a real engine's: every
            # whole step since the last count counts (the time this loop spent
            # on finishing and admitting requests too), also past the first
            # finish when this task woke late: sequences that ended meanwhile
            # stop at their length, the others go on (a late wake costs the
            # finished ones' slots, not everyone's progress). The part of a
            # step that has passed counts next time.
            steps = int((trio.current_time() - self._mark) / step_s + 1e-9)
            self._mark += steps * step_s
        else:
            await trio.sleep(0)
            steps = todo
        self.step += steps
        done = []
        while self._ends and self._ends[0][0] <= self.step:
            end, _, req = heapq.heappop(self._ends)
            if req in self.active and req.end == end:
                self.active.remove(req)
                done.append(req)
        # Slot-seconds in use, for the occupancy the bench reports: every
        # sequence for every step, but a finished one only up to its end.
        used = steps * active - sum(self.step - r.end for r in done)
        self.ctx.counters["slot_s"] += used * step_s
        return done

    async def _finish(self, done: list[_Request]) -> None:
        if not done:
            return
        now = time.time()
        for req in done:
            state = self.groups[req.group.group_id]
            state.responses[req.index] = self._response(req, now)
            state.left -= 1
            if state.left == 0:
                del self.groups[req.group.group_id]
                with self.clock.state("blocked"):
                    await self._send.send((state.group, state.responses))

    def _response(self, req: _Request, now: float) -> Response:
        n = req.target
        versions = np.empty(n, np.int32)
        bounds = [start for _, start in req.spans] + [n]
        for (version, start), end in zip(req.spans, bounds[1:]):
            versions[start:end] = version
        stamps = np.full(N_STAGES, np.nan)
        stamps[Stage.ISSUED] = req.issued_at
        stamps[Stage.ROLLOUT_START] = req.started_at
        stamps[Stage.ROLLOUT_END] = now
        token_ids, logprobs = self._tokens(n)
        return Response(
            token_ids=token_ids,
            logprobs=logprobs,
            versions=versions,
            finish_reason=FinishReason.LENGTH if n >= self._cap else FinishReason.STOP,
            stamps=stamps,
        )

    def _tokens(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        """`n` token ids and their log-probabilities: the next slices of the
        arrays drawn at the start (drawn again, longer, for a longer response)."""
        if n > len(self._ids):
            self._ids, self._logprobs = self._draw_tokens(2 * n)
        if self._cursor + n > len(self._ids):
            self._cursor = 0
        a = self._cursor
        self._cursor += n
        return self._ids[a : a + n], self._logprobs[a : a + n]

    def _draw_tokens(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        ids = self.rng.integers(0, self.vocab, n, dtype=np.int32)
        logprobs = (-self.rng.exponential(1.0, n)).astype(np.float32)
        # Read-only: responses share these arrays.
        ids.flags.writeable = logprobs.flags.writeable = False
        return ids, logprobs

    async def _apply(self, version: int) -> None:
        with self.clock.state("loading"):
            if self.cfg.apply_weights_s:
                await trio.sleep(self.cfg.apply_weights_s)
        self.version = version
        self._new_version = None
        # Strict: a group whose oldest token is already more than the bound
        # behind can only be consumed at a trainer version >= this one:
        # whatever happens, it would be dropped. Start all of it again now, finished
        # samples included, on these weights (a fresh sample draws a fresh
        # length, as a new response would).
        doomed: set[int] = set()
        if self.strict:
            doomed = {r.group.group_id for r in self.active if too_stale(r.spans[0][0], version, self.staleness)}
            for group_id, state in self.groups.items():
                firsts = [int(r.versions[0]) for r in state.responses if r is not None and len(r.versions)]
                if firsts and too_stale(min(firsts), version, self.staleness):
                    doomed.add(group_id)
        restarted = 0
        again: list[_Request] = []
        for req in list(self.active):
            if req.group.group_id in doomed:
                restarted += req.generated(self.step)
                req.target = int(draw_lengths(self.cfg.response_len, self.rng, 1)[0])
                req.start_step, req.spans = self.step, [(version, 0)]
                self._activate(req)  # its old end is stale now
            else:
                req.spans.append((version, req.generated(self.step)))
        for group_id in doomed:
            state = self.groups[group_id]
            for index, response in enumerate(state.responses):
                if response is not None:
                    restarted += len(response.token_ids)
                    state.responses[index] = None
                    state.left += 1
                    length = int(draw_lengths(self.cfg.response_len, self.rng, 1)[0])
                    again.append(_Request(state.group, index, length, time.time()))
        for req in reversed(again):  # late already: first in line
            self.pending.push(req, req.group.min_version, first=True)
        self.ctx.counters["restarted_tokens"] += restarted
        self.ctx.counters["restarted_groups"] += len(doomed)
        self._applied.set()

    async def _fetch(self, version: int) -> WeightsPayload:
        if self._server is None:
            raise RuntimeError("no weight server to fetch from: join_weights was not called")
        if self._weights is None:
            self._weights = await self._sockets.enter_async_context(
                transport.open_dealer(connect=self._server, codec=Codec(WeightsMessage), name="weights")
            )
        return await self._weights.request(
            WeightsRequest(version=version), WeightsPayload, timeout=120, setting="the trainer's weight server"
        )
