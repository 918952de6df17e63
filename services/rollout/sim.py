"""The simulated rollout engine: a product feature for scale runs and the bench.

Continuous batching over `slots` sequences with a decode-step time and
long-tailed response lengths; every role downstream is real. Weights are
fetched over ZeroMQ from the trainer's weight server while generation goes
on, and only applying them pauses it.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

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


@dataclass
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

    It does not sleep once per step: it sleeps until the next sequence
    finishes and wakes early when new work can start or weights arrive, then
    counts the whole steps that have passed. So a thousand slots cost no
    more CPU than ten.
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
        self.pending: deque[_Request] = deque()
        self.active: list[_Request] = []
        self.groups: dict[int, _GroupState] = {}
        self._wake = trio.Event()
        self._mark: float | None = None  # when the engine's step count was last brought up to date
        self._new_version: int | None = None
        self._fetching = False
        self._applied = trio.Event()
        self._send, self.finished = trio.open_memory_channel(2)
        #: Scores a finished group in this process before it is sent on
        #: (`roles.reward.inline`); no decode step runs meanwhile.
        self.inline: Callable[[PromptGroup, list[Response]], Awaitable[None]] | None = None
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
        self.pending.extend(_Request(group, i, int(n), issued_at) for i, n in enumerate(lengths))
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
                        self._fetching
                        or self._new_version is not None
                        or (self.pending and self.pending[0].group.min_version > self.version)
                    )
                    self.clock.set("loading" if waiting_for_weights else "starved")
                    self._mark = None
                    await self._wake.wait()
                    continue
                self.clock.set("busy")
                await self._advance()
                await self._finish()

    def _admit(self) -> None:
        if self._new_version is not None and not self.partial:
            return  # draining: in-flight requests finish on the old weights first
        now = time.time()
        free = self.cfg.slots - len(self.active)
        if free <= 0 or not self.pending:
            return
        # In order, skipping requests that wait for newer weights (a reissued
        # group may start on the weights held now, behind ones that may not).
        waiting: deque[_Request] = deque()
        while self.pending and free > 0:
            req = self.pending.popleft()
            if req.group.min_version > self.version:
                waiting.append(req)
                continue
            req.start_step, req.started_at = self.step, now
            req.spans = [(self.version, 0)]
            self.active.append(req)
            free -= 1
        waiting.extend(self.pending)
        self.pending = waiting

    async def _advance(self) -> None:
        """Sleep until the next sequence finishes, or less if woken; count
        the whole steps that passed."""
        step_s = self.cfg.step_s + self.cfg.step_s_per_seq * len(self.active)
        todo = min(r.target - r.generated(self.step) for r in self.active)
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
        # Slot-seconds in use, for the occupancy the bench reports.
        used = sum(min(steps, r.target - r.generated(self.step)) for r in self.active)
        self.ctx.counters["slot_s"] += used * step_s
        self.ctx.counters["decode_steps"] += steps
        self.step += steps

    async def _finish(self) -> None:
        done = [r for r in self.active if r.generated(self.step) >= r.target]
        if not done:
            return
        self.active = [r for r in self.active if r.generated(self.step) < r.target]
        now = time.time()
        for req in done:
            state = self.groups[req.group.group_id]
            state.responses[req.index] = self._response(req, now)
            state.left -= 1
            if state.left == 0:
                del self.groups[req.group.group_id]
                if self.inline is not None:
                    await self.inline(state.group, state.responses)
                    self._mark = None  # no decoding while it scored
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
        return Response(
            token_ids=self.rng.integers(0, self.vocab, n, dtype=np.int32),
            logprobs=(-self.rng.exponential(1.0, n)).astype(np.float32),
            versions=versions,
            finish_reason=FinishReason.LENGTH if n >= getattr(self.cfg.response_len, "max", math.inf) else FinishReason.STOP,
            stamps=stamps,
        )

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
        for req in self.active:
            if req.group.group_id in doomed:
                restarted += req.generated(self.step)
                req.target = int(draw_lengths(self.cfg.response_len, self.rng, 1)[0])
                req.start_step, req.spans = self.step, [(version, 0)]
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
        self.pending.extendleft(reversed(again))  # late already: first in line
        self.ctx.counters["restarted_tokens"] += restarted
        self.ctx.counters["restarted_groups"] += len(doomed)
        self._applied.set()

    async def _fetch(self, version: int) -> WeightsPayload:
        if self._server is None:
            raise RuntimeError("no weight server to fetch from: join_weights was not called")
        if self._weights is None:
            self._weights = await self._sockets.enter_async_context(
                transport.open_dealer(
                    connect=self._server, codec=Codec(WeightsMessage), curve=self.ctx.curve, name="weights"
                )
            )
        return await self._weights.request(
            WeightsRequest(version=version), WeightsPayload, timeout=120, setting="the trainer's weight server"
        )
