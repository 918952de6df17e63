"""The simulated rollout engine: a product feature for scale runs and the bench.

Continuous batching over `slots` sequences with a decode-step time and
long-tailed response lengths; every role downstream is real. Weights are
fetched over ZeroMQ from the trainer's weight server while generation goes
on, and only applying them pauses it.

Two parts: `SimBatcher`, the batching itself as plain synchronous code on
the engine's clock (unit-tested on its own), and `SimEngine`, the thin
async shell that runs it on trio's clock, takes weights and sends groups on.
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import math
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import numpy as np
import trio

from rlflow.algo.staleness import too_stale
from rlflow.config import Config, SimRollout, SimTask
from rlflow.data import transport
from rlflow.distributions import draw_lengths
from rlflow.protocol import (
    Adapter,
    EngineLoad,
    FinishReason,
    ParamSpec,
    PromptGroup,
    Response,
    Stage,
    WeightsPayload,
    WeightsZmq,
    WeightTransfer,
    payload_checksum,
)
from rlflow.protocol.batch import N_STAGES
from rlflow.services.base import EngineContext
from rlflow.services.rollout.engine import Finished
from rlflow.services.zmq_weights import fetch, open_fetcher

T = TypeVar("T")

#: Ids of episodes' turns in the batcher start here (above any group id).
_TURNS_FROM = 1 << 62

#: Longest the engine sleeps while it decodes (seconds), however far off the
#: next finish is, so that its `decode_steps` counter keeps moving.
PROGRESS_WAKE_S = 0.5


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
    cap: float = math.inf
    """Its length cap (an episode's turn: what is left of its budget)."""

    def generated(self, step: int) -> int:
        return step - self.start_step

    @property
    def end(self) -> int:
        """The step after which its last token is there."""
        return self.start_step + self.target


@dataclass(eq=False)
class _GroupState:
    group: PromptGroup
    responses: list[Response | None]
    left: int
    """Samples not finished."""
    waiting: list[_Request] = field(default_factory=list)
    """Samples not started."""
    running: list[_Request] = field(default_factory=list)
    """Samples being generated."""

    def finish_step(self) -> int | None:
        """The step after which its last sample is done, once all have started."""
        return None if self.waiting or not self.running else max(r.end for r in self.running)

    def longest_waiting(self) -> int | None:
        """The longest of its samples not started, in tokens."""
        return max(r.target for r in self.waiting) if self.waiting else None


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


class SimBatcher:
    """Continuous batching over `slots` sequences in decode steps, as plain
    code on the engine's own clock (seconds, any monotonic origin).

    Every active sequence gains one token per step; a step takes
    ``step_s + step_s_per_seq * active`` seconds; a sequence that ends frees
    its slot for the next request in line at that very step. `advance(now)`
    plays every step up to `now` at once, ending and starting sequences at
    the steps where they end and start, so the result does not depend on
    how often it is called: an engine that wakes late is not slower.
    `wake_time()` says when a group can finish at the earliest, so that the
    engine need not run before then unless something arrives (a wake per
    group, not per sequence). Finished groups collect in `outbox`.

    Weights are applied between two steps (`apply`): later tokens carry the
    new version; with the strict staleness check, groups that could only be
    trained on past the bound start again.
    """

    def __init__(self, cfg: SimRollout, *, rng: np.random.Generator, vocab: int, partial: bool,
                 strict: bool, staleness: int, counters: Counter[str], wall_offset: float = 0.0):
        self.cfg = cfg
        self.rng = rng
        self.vocab = vocab
        self.partial = partial
        self.strict = strict
        self.staleness = staleness
        self.counters = counters
        #: Wall time minus engine time (for the samples' stamps).
        self.wall_offset = wall_offset
        self.version = 0
        self.step = 0
        #: When step `step` began; None while the clock stands (nothing to decode, or paused).
        self.mark: float | None = None
        self.paused = False
        #: A version that has arrived and waits to be applied (without partial
        #: rollout nothing new starts meanwhile: the requests in flight drain first).
        self.incoming: int | None = None
        self.pending: RequestQueue[_Request] = RequestQueue()
        self.active: set[_Request] = set()
        self.groups: dict[int, _GroupState] = {}
        self.outbox: list[Finished] = []
        self._ends: list[tuple[int, int, _Request]] = []  # (end step, tie-break, request)
        self._finishing: list[tuple[int, int, _GroupState]] = []  # (finish step, tie, group): every sample started
        self._waiting: list[tuple[int, int, _GroupState]] = []  # (longest sample not started, tie, group)
        self._ties = itertools.count()
        # Tokens from a generator of their own, so that the lengths drawn
        # from `rng` do not depend on how many tokens were drawn.
        self._token_rng = rng.spawn(1)[0]
        self._ids, self._logprobs = self._draw_tokens(1 << 16)
        self._cursor = 0
        self._cap = getattr(cfg.response_len, "max", math.inf)

    # -- inputs ---------------------------------------------------------------

    def submit(self, group: PromptGroup, issued_at: float, now: float, max_tokens: int | None = None) -> None:
        """Line up `group`'s samples (none starts before `now`; none longer than `max_tokens`)."""
        self.advance(now)
        state = _GroupState(group, [None] * group.n, group.n)
        self.groups[group.group_id] = state
        cap = math.inf if max_tokens is None else max_tokens
        for i, n in enumerate(draw_lengths(self.cfg.response_len, self.rng, group.n).tolist()):
            req = _Request(group, i, int(min(n, cap)), issued_at, cap=cap)
            state.waiting.append(req)
            self.pending.push(req, group.min_version)
        self._track(state)

    def cancel(self, group_id: int, now: float) -> None:
        """Forget `group_id`: its sequences leave their slots, its samples not started never start."""
        self.advance(now)
        state = self.groups.pop(group_id, None)
        if state is None:
            return
        for req in state.running:
            self.active.discard(req)  # its entry in the heap of ends is dropped when it comes up
        self.admit(now)

    def advance(self, now: float) -> None:
        """Play every whole step up to `now` (the part of a step that has
        passed counts next time)."""
        if self.paused or not self.active:
            return
        if self.mark is None:  # decoding again after standing: from now
            self.mark = now
            return
        while self.active:
            step_s = self.step_s()
            end = self._next_end()
            whole = max(int((now - self.mark) / step_s + 1e-9), 0) if step_s > 0 else math.inf
            if end - self.step > whole:
                self._run(whole, step_s)
                return
            self._run(end - self.step, step_s)
            self._end_sequences()
            self.admit(now)
        self.mark = None  # the last sequence ended: the clock stands until something starts

    def admit(self, now: float) -> None:
        """Start requests in line on free slots, at the current step (`now`
        if the clock stands)."""
        if self.paused or self.draining or len(self.active) >= self.cfg.slots or not self.pending:
            return
        if self.mark is None:
            self.mark = now
        wall = self.wall_offset + self.mark
        free = self.cfg.slots - len(self.active)
        started: dict[int, _GroupState] = {}
        # In order, skipping requests that wait for newer weights (a reissued
        # group may start on the weights held now, behind ones that may not).
        while free > 0 and (req := self.pending.pop(self.version)) is not None:
            if req.group.group_id not in self.groups:  # cancelled
                continue
            req.start_step, req.started_at = self.step, wall
            req.spans = [(self.version, 0)]
            state = started[req.group.group_id] = self.groups[req.group.group_id]
            state.waiting.remove(req)
            state.running.append(req)
            self._start(req)
            free -= 1
        for state in started.values():
            self._track(state)

    def pause(self) -> None:
        """Stop the clock (weights going in, groups scored in line); `apply`
        or `resume` starts it again."""
        self.paused, self.mark = True, None

    def resume(self) -> None:
        """Start the clock again, from the next `advance`, on the same weights."""
        self.paused = False

    def apply(self, version: int, wall: float) -> None:
        """Generate with weights `version` from the current step on."""
        self.paused = False
        self.version = version
        self.incoming = None
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
        for req in list(self.active):
            if req.group.group_id in doomed:
                restarted += req.generated(self.step)
                req.target = int(draw_lengths(self.cfg.response_len, self.rng, 1)[0])
                req.start_step, req.spans = self.step, [(version, 0)]
                self._start(req)  # its old end is stale now
            else:
                req.spans.append((version, req.generated(self.step)))
        again: list[_Request] = []
        for group_id in doomed:
            state = self.groups[group_id]
            for index, response in enumerate(state.responses):
                if response is not None:
                    restarted += len(response.token_ids)
                    state.responses[index] = None
                    state.left += 1
                    length = int(draw_lengths(self.cfg.response_len, self.rng, 1)[0])
                    again.append(_Request(state.group, index, length, wall))
                    state.waiting.append(again[-1])
            self._track(state)
        for req in reversed(again):  # late already: first in line
            self.pending.push(req, req.group.min_version, first=True)
        self.counters["restarted_tokens"] += restarted
        self.counters["restarted_groups"] += len(doomed)

    # -- queries ----------------------------------------------------------------

    @property
    def draining(self) -> bool:
        """Weights wait for the requests in flight to finish (no partial rollout)."""
        return self.incoming is not None and not self.partial

    def step_s(self) -> float:
        return self.cfg.step_s + self.cfg.step_s_per_seq * len(self.active)

    def wake_time(self) -> float:
        """When the next group can finish, at the earliest (exactly, if every
        one of its samples has started), if nothing arrives meanwhile;
        infinity if the clock stands."""
        if self.paused or self.mark is None or not self.active:
            return math.inf
        target = self._first_finish()
        if self.draining:  # nothing starts: the next thing is a finish, or the last end
            target = min(target, max(r.end for r in self.active))
        else:
            # A group with samples not started ends no earlier than its
            # longest one would if it started as the next slot frees.
            target = min(target, self._next_end() + self._shortest_wait())
        return self._time_of(target)

    def idle_for_weights(self) -> bool:
        """Nothing to decode for want of weights (an update on its way, a barrier)."""
        return self.incoming is not None or self.pending.waits_for_weights(self.version)

    # -- the steps ----------------------------------------------------------------

    def _run(self, steps: int, step_s: float) -> None:
        # Slot-seconds in use, for the occupancy the bench reports.
        self.counters["slot_s"] += steps * len(self.active) * step_s
        self.counters["decode_steps"] += steps
        self.step += steps
        self.mark += steps * step_s

    def _start(self, req: _Request) -> None:
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

    def _end_sequences(self) -> None:
        """Finish every sequence that ends at this step."""
        wall = self.wall_offset + self.mark
        while self._ends and self._ends[0][0] <= self.step:
            end, _, req = heapq.heappop(self._ends)
            if req not in self.active or req.end != end:
                continue
            self.active.remove(req)
            state = self.groups[req.group.group_id]
            state.running.remove(req)
            state.responses[req.index] = self._response(req, wall)
            state.left -= 1
            if state.left == 0:
                del self.groups[req.group.group_id]
                self.outbox.append((state.group, state.responses))

    def _track(self, state: _GroupState) -> None:
        """Note when `state`'s group can finish at the earliest, after a change."""
        if state.waiting:
            heapq.heappush(self._waiting, (state.longest_waiting(), next(self._ties), state))
        elif state.running:
            heapq.heappush(self._finishing, (state.finish_step(), next(self._ties), state))

    def _first_finish(self) -> float:
        """The first step a group whose samples have all started finishes."""
        heap = self._finishing
        while heap:
            step, _, state = heap[0]
            if self.groups.get(state.group.group_id) is state and state.finish_step() == step:
                return step
            heapq.heappop(heap)
        return math.inf

    def _shortest_wait(self) -> float:
        """The least, over groups with samples not started, of their longest such sample."""
        heap = self._waiting
        if len(heap) > 2 * len(self.pending) + 64:  # mostly entries out of date: keep the live ones
            heap[:] = [e for e in heap if self._live_wait(*e)]
            heapq.heapify(heap)
        while heap:
            if self._live_wait(*heap[0]):
                return heap[0][0]
            heapq.heappop(heap)
        return math.inf

    def _live_wait(self, longest: int, _tie: int, state: _GroupState) -> bool:
        return self.groups.get(state.group.group_id) is state and state.longest_waiting() == longest

    def _time_of(self, step: float) -> float:
        """When step `step` begins at the earliest, on the clock as it runs now."""
        if step == math.inf:
            return math.inf
        if not self.cfg.step_s_per_seq:
            return self.mark + (step - self.step) * self.cfg.step_s
        # Steps are shorter with fewer sequences: count only those sure to
        # still be there (ending at or after `step`).
        staying = sum(1 for r in self.active if r.end >= step)
        return self.mark + (step - self.step) * (self.cfg.step_s + self.cfg.step_s_per_seq * max(staying, 1))

    # -- responses ----------------------------------------------------------------

    def _response(self, req: _Request, wall: float) -> Response:
        n = req.target
        if len(req.spans) == 1:  # the common case: all on one version
            versions = np.full(n, req.spans[0][0], np.int32)
        else:
            versions = np.empty(n, np.int32)
            bounds = [start for _, start in req.spans] + [n]
            for (version, start), end in zip(req.spans, bounds[1:]):
                versions[start:end] = version
        stamps = np.full(N_STAGES, np.nan)
        stamps[Stage.ISSUED] = req.issued_at
        stamps[Stage.ROLLOUT_START] = req.started_at
        stamps[Stage.ROLLOUT_END] = wall
        token_ids, logprobs = self._tokens(n)
        return Response(
            token_ids=token_ids,
            logprobs=logprobs,
            versions=versions,
            finish_reason=FinishReason.LENGTH if n >= min(self._cap, req.cap) else FinishReason.STOP,
            stamps=stamps,
        )

    def _tokens(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        """`n` token ids and their log-probabilities: the next slices of
        arrays drawn once (a simulated response's content does not matter,
        its length does); drawn again, longer, for a longer response."""
        if n > len(self._ids):
            self._ids, self._logprobs = self._draw_tokens(2 * n)
        if self._cursor + n > len(self._ids):
            self._cursor = 0
        a = self._cursor
        self._cursor += n
        return self._ids[a : a + n], self._logprobs[a : a + n]

    def _draw_tokens(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        ids = self._token_rng.integers(0, self.vocab, n, dtype=np.int32)
        logprobs = (-self._token_rng.exponential(1.0, n)).astype(np.float32)
        # Read-only: responses share these arrays.
        ids.flags.writeable = logprobs.flags.writeable = False
        return ids, logprobs


class SimEngine:
    """A simulated engine: `SimBatcher` run on trio's clock.

    It sleeps until a group can finish (`SimBatcher.wake_time`), or less when
    new work or weights arrive (and never more than `PROGRESS_WAKE_S`), then
    plays every step that has passed and sends the groups that finished. So
    it wakes about once per group rather than once per decode step or per
    sequence, and a thousand slots cost little more CPU than ten.
    """

    def __init__(self, cfg: SimRollout, ctx: EngineContext):
        self.cfg = cfg
        self.ctx = ctx
        self.clock = ctx.clock
        run = ctx.config.run
        self.batcher = SimBatcher(
            cfg,
            rng=np.random.default_rng((run.seed, ctx.rank, 7)),
            vocab=_vocab(ctx.config),
            partial=run.partial_rollout,
            strict=run.staleness_check == "strict",
            staleness=run.max_staleness,
            counters=ctx.counters,
            wall_offset=time.time() - trio.current_time(),
        )
        self._wake = trio.Event()
        self._fetching = False
        self._applied = trio.Event()
        self._send, self.finished = trio.open_memory_channel(2)
        #: Scores a finished group in this process before it is sent on
        #: (`roles.reward.inline`); no decode step runs meanwhile.
        self.inline: Callable[[PromptGroup, list[Response]], Awaitable[None]] | None = None
        self._server: str | None = None
        self._weights: transport.Dealer | None = None
        self._sockets: contextlib.AsyncExitStack | None = None
        #: The checksum of the payload fetched last (what it serves).
        self.checksum = ""
        #: An episode's turns in the batcher, by their own ids (beyond any group's): [done, response].
        self._turns: dict[int, list] = {}
        self._turn_ids = itertools.count(_TURNS_FROM)
        self._held = 0

    eval_concurrency = 1

    @property
    def version(self) -> int:
        return self.batcher.version

    # -- called by the service ------------------------------------------------

    async def start(self) -> None:
        """Nothing to load."""

    async def join_weights(self, transfer: WeightTransfer | None, layout: list[ParamSpec],
                           adapter: Adapter | None = None) -> None:
        """Weights come over ZeroMQ, on request, from the trainer's weight server
        (an adapter's too: the simulated engine has no model to put it on)."""
        if not isinstance(transfer, WeightsZmq):
            raise ValueError(f"the simulated rollout fetches weights over ZeroMQ; the trainer offers {transfer!r}")
        self._server = transfer.address

    async def set_version(self, version: int) -> None:
        self.batcher.version = version

    async def close(self) -> None:
        """Nothing to release."""

    def hello_fields(self) -> dict[str, Any]:
        return {"slots": self.cfg.slots}

    def load(self) -> EngineLoad:
        return EngineLoad(slots=self.cfg.slots, running=len(self.batcher.active), waiting=len(self.batcher.pending))

    async def complete(self, prompt_ids: list[int], temperature: float) -> list[int]:
        raise NotImplementedError("the simulated engine has no model to evaluate")

    def submit(self, group: PromptGroup, issued_at: float) -> None:
        self.batcher.submit(group, issued_at, trio.current_time())
        self._wake.set()  # it may start now, or finish sooner than the engine's next wake

    async def generate(self, prompt_ids: list[int], *, max_tokens: int, min_version: int = 0,
                       temperature: float | None = None, on_tokens: Any = None) -> Response:
        """One response (an episode's turn) of at most `max_tokens` tokens, batched with everything else."""
        turn = next(self._turn_ids)
        waiter = self._turns[turn] = [trio.Event(), None]
        self.batcher.submit(PromptGroup(group_id=turn, prompt_ids=[], n=1, min_version=min_version), time.time(),
                            trio.current_time(), max_tokens=max_tokens)
        self._wake.set()
        try:
            await waiter[0].wait()
        finally:
            if self._turns.pop(turn, None) is not None and not waiter[0].is_set():  # abandoned: free its slot
                self.batcher.cancel(turn, trio.current_time())
                self._wake.set()
        return waiter[1]

    @contextlib.asynccontextmanager
    async def hold(self):
        """No decode step runs while any task is in this block (an environment run in line,
        `roles.env.inline`: the engine waits while a call runs)."""
        if not self._held:
            self.batcher.advance(trio.current_time())
            self.batcher.pause()
        self._held += 1
        try:
            yield
        finally:
            self._held -= 1
            if not self._held:
                self.batcher.resume()
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
        self.checksum = payload_checksum(payload.names, payload.tensors)
        self.batcher.advance(trio.current_time())  # what ran before it arrived ran as before
        self.batcher.incoming = payload.version
        self._applied = trio.Event()
        self._wake.set()
        await self._applied.wait()
        return self.version

    def queues(self) -> dict[str, int]:
        return {"pending": len(self.batcher.pending), "active": len(self.batcher.active)}

    # -- the loop -----------------------------------------------------------------

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        batcher = self.batcher
        async with self._send, contextlib.AsyncExitStack() as self._sockets:
            task_status.started()
            while True:
                batcher.advance(trio.current_time())
                if batcher.outbox:
                    finished, batcher.outbox = self._turns_done(batcher.outbox), []
                    if not finished:
                        continue
                    if self.inline is not None:
                        await self._score_inline(finished)
                    with self.clock.state("blocked"):
                        await self._send.send(finished)
                    continue  # the steps that ran meanwhile first
                if batcher.incoming is not None and (batcher.partial or not batcher.active):
                    await self._apply(batcher.incoming)
                    continue
                batcher.admit(trio.current_time())
                self._wake = trio.Event()
                if not batcher.active:
                    # Idle for want of weights (a barrier, an update on its
                    # way) is loading; idle for want of work is starved.
                    self.clock.set("loading" if self._fetching or batcher.idle_for_weights() else "starved")
                    await self._wake.wait()
                    continue
                self.clock.set("busy")
                # Woken when a group can finish, when work or weights arrive,
                # and at least every PROGRESS_WAKE_S: the decode steps it counts
                # are how the controller tells a long group from a hung replica.
                with trio.move_on_at(min(batcher.wake_time(), trio.current_time() + PROGRESS_WAKE_S)):
                    await self._wake.wait()

    def _turns_done(self, outbox: list[Finished]) -> list[Finished]:
        """Hand each finished turn to its episode; the groups, to send on."""
        groups = []
        for group, responses in outbox:
            waiter = self._turns.get(group.group_id)
            if waiter is not None:
                waiter[1] = responses[0]
                waiter[0].set()
            elif group.group_id < _TURNS_FROM:
                groups.append((group, responses))
        return groups

    async def _score_inline(self, finished: list[Finished]) -> None:
        """Score finished groups in this process (`roles.reward.inline`); the
        clock stands meanwhile: no decode step runs while it scores."""
        self.batcher.pause()
        try:
            for group, responses in finished:
                await self.inline(group, responses)
        finally:
            self.batcher.resume()

    async def _apply(self, version: int) -> None:
        self.batcher.pause()  # no decoding while the weights go in
        with self.clock.state("loading"):
            if self.cfg.apply_weights_s:
                await trio.sleep(self.cfg.apply_weights_s)
        self.batcher.apply(version, time.time())
        if self._held:  # an environment run in line holds the engine still
            self.batcher.pause()
        self._applied.set()

    async def _fetch(self, version: int) -> WeightsPayload:
        if self._server is None:
            raise RuntimeError("no weight server to fetch from: join_weights was not called")
        if self._weights is None:
            self._weights = await self._sockets.enter_async_context(open_fetcher(self.ctx, self._server))
        return await fetch(self.ctx, self._weights, version)


def _vocab(config: Config) -> int:
    """How many token ids it draws from: the simulated task's vocabulary, or, for a task that speaks
    text, its policy tokenizer's (so that the ids decode to text, as a real engine's do)."""
    if isinstance(config.task, SimTask):
        return config.task.vocab_size
    from rlflow.tasks.core import load_tokenizer

    return len(load_tokenizer(config.policy_path))
