"""The rollout service: turns credits into prompt groups, generates, streams
finished groups to the next role.

Its loop: credits arrive on the control channel -> the task makes each
group's prompt -> the engine generates `n` responses per prompt with
continuous batching -> each group is sent on the moment its last response
finishes, as one columnar `SampleBatch`. Weight updates arrive while
requests are in flight; the engine applies them between two decode steps and
tags later tokens with the new version.

`SimEngine` is the simulated engine (a product feature for scale runs and
the bench); the vLLM engine lives in `vllm_engine` and is imported only when
the config asks for it.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np
import trio

from rlflow import transport
from rlflow.config import SimRollout, VllmRollout
from rlflow.protocol import (
    Ack,
    Codec,
    Credits,
    EvalDone,
    Evaluate,
    FinishReason,
    PromptGroup,
    Response,
    Shutdown,
    Stage,
    UpdateWeights,
    WeightsLoaded,
    WeightsMessage,
    WeightsPayload,
    WeightsRequest,
    build_batch,
)
from rlflow.protocol.batch import N_STAGES
from rlflow.service import Control, Service
from rlflow.sim import draw_lengths
from rlflow.tasks import make_task


class RolloutService(Service):
    """Generates responses for the prompt groups the controller grants."""

    def __init__(self, spec):
        super().__init__(spec)
        self.engine = None
        self._wanted: UpdateWeights | None = None
        self._update = trio.Event()

    async def main(self, control: Control) -> None:
        run = self.config.run
        engine = self.engine = make_engine(self)
        try:
            self.say("starting %s", type(engine).__name__)
            started = time.monotonic()
            await engine.start()
            self.say("%s started in %.1f s", type(engine).__name__, time.monotonic() - started)
            task = make_task(self.config)
            welcome = await control.hello(endpoints={}, info=engine.hello_info())
            await engine.set_version(welcome.version)  # above 0 when resuming
            await engine.connect_weights(welcome.info)
            self.say("up: %s, sending to %s", type(engine).__name__, ", ".join(welcome.peers["out"]))
            async with (
                transport.open_push(connect=welcome.peers["out"], name=f"{self.spec.name}/out") as out,
                trio.open_nursery() as nursery,
            ):
                await nursery.start(engine.run)
                nursery.start_soon(control.heartbeats, self.heartbeat, welcome.heartbeat_s)
                nursery.start_soon(self.send_finished, out, control)
                nursery.start_soon(self.apply_updates, control)
                await control.ready(engine.version)
                async for msg in control:
                    match msg:
                        case Credits(group_ids=ids, min_versions=mins):
                            now = time.time()
                            for group_id, min_version in zip(ids, mins):
                                engine.submit(task.prompt(group_id, run.samples_per_prompt, min_version), now)
                        case UpdateWeights():
                            self._wanted = msg
                            self._update.set()
                        case Evaluate():
                            nursery.start_soon(self.evaluate, msg, task, control)
                        case Shutdown(reason=reason):
                            self.say("shutting down (%s)", reason)
                            break
                nursery.cancel_scope.cancel()
        finally:
            with trio.CancelScope(shield=True):
                await engine.close()

    def queues(self) -> dict[str, int]:
        return self.engine.queues() if self.engine is not None else {}

    async def send_finished(self, out: transport.Push, control: Control) -> None:
        """Send each finished group on, and tell the controller it left."""
        async for group, responses in self.engine.finished:
            batch = build_batch([(group, responses)])
            await out.send(batch)
            self.counters["groups"] += 1
            self.counters["samples"] += len(responses)
            self.counters["tokens"] += batch.n_tokens
            self.counters["bytes_out"] = out.bytes_sent
            await control.send(Ack(stage=Stage.ROLLOUT_END, group_ids=[group.group_id]))

    async def apply_updates(self, control: Control) -> None:
        """Load each version the controller asks for, in order."""
        while True:
            await self._update.wait()
            self._update = trio.Event()
            msg, self._wanted = self._wanted, None
            if msg is None or msg.version <= self.engine.version:
                continue
            started = time.monotonic()
            version = await self.engine.update_weights(msg)
            self.version = version
            seconds = time.monotonic() - started
            self.counters["weight_updates"] += 1
            self.say("weights v%d loaded in %.0f ms", version, 1000 * seconds)
            await control.send(WeightsLoaded(version=version, seconds=seconds))

    async def evaluate(self, msg: Evaluate, task, control: Control) -> None:
        """Answer every held-out prompt once, alongside training traffic."""
        started, version = time.monotonic(), self.engine.version
        prompts = task.heldout_prompts()
        responses: list[list[int] | None] = [None] * len(prompts)
        limit = trio.CapacityLimiter(self.engine.eval_concurrency)

        async def one(i: int) -> None:
            async with limit:
                responses[i] = await self.engine.complete(prompts[i], msg.temperature)

        async with trio.open_nursery() as nursery:
            for i in range(len(prompts)):
                nursery.start_soon(one, i)
        metrics = task.heldout_metrics(responses)
        seconds = time.monotonic() - started
        self.say("eval v%d: accuracy %.3f over %d problems in %.1f s", version, metrics["accuracy"], len(prompts), seconds)
        await control.send(EvalDone(version=version, metrics=metrics, seconds=seconds, version_end=self.engine.version))


def make_engine(service: RolloutService):
    match service.config.roles.rollout.engine:
        case SimRollout() as cfg:
            return SimEngine(cfg, service)
        case VllmRollout() as cfg:
            from rlflow.services.vllm_engine import VllmEngine

            return VllmEngine(cfg, service)
    raise ValueError(f"unknown rollout engine {service.config.roles.rollout.engine!r}")


# ---------------------------------------------------------------------------
# The simulated engine
# ---------------------------------------------------------------------------


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

    def __init__(self, cfg: SimRollout, service: RolloutService):
        self.cfg = cfg
        self.service = service
        self.clock = service.clock
        self.staleness = service.config.run.staleness
        self.strict = service.config.run.staleness_check == "strict"
        self.partial = service.config.run.partial_rollout
        self.vocab = getattr(service.config.task, "vocab_size", 32000)
        self.rng = np.random.default_rng((service.config.run.seed, service.spec.rank, 7))
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
        self._weights: dict[str, transport.Dealer] = {}
        self._sockets: contextlib.AsyncExitStack | None = None

    eval_concurrency = 1

    # -- called by the service ------------------------------------------------

    async def start(self) -> None:
        """Nothing to load."""

    async def connect_weights(self, info: dict[str, str]) -> None:
        """Weights come over ZeroMQ on request: nothing to join."""

    async def set_version(self, version: int) -> None:
        self.version = version

    async def close(self) -> None:
        """Nothing to release."""

    def hello_info(self) -> dict[str, str]:
        self.service.counters["slots"] = self.cfg.slots
        return {"slots": str(self.cfg.slots)}

    async def complete(self, prompt_ids: list[int], temperature: float) -> list[int]:
        raise NotImplementedError("the simulated engine has no model to evaluate")

    def submit(self, group: PromptGroup, issued_at: float) -> None:
        lengths = draw_lengths(self.cfg.response_len, self.rng, group.n)
        self.groups[group.group_id] = _GroupState(group, [None] * group.n, group.n)
        self.pending.extend(_Request(group, i, int(n), issued_at) for i, n in enumerate(lengths))
        if len(self.active) < self.cfg.slots:
            self._wake.set()

    async def update_weights(self, msg: UpdateWeights) -> int:
        """Fetch the weights over the wire, then apply them between two steps."""
        address = msg.info["address"]
        # The payload crosses the wire while generation goes on; only
        # applying it pauses the engine.
        self._fetching = True
        self._wake.set()
        try:
            payload = await self._fetch(address, msg.version)
        finally:
            self._fetching = False
        self.service.counters["weight_bytes"] += sum(t.nbytes for t in payload.tensors)
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
        self.service.counters["slot_s"] += used * step_s
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
            doomed = {r.group.group_id for r in self.active if version - r.spans[0][0] > self.staleness}
            for group_id, state in self.groups.items():
                firsts = [int(r.versions[0]) for r in state.responses if r is not None and len(r.versions)]
                if firsts and version - min(firsts) > self.staleness:
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
        self.service.counters["restarted_tokens"] += restarted
        self.service.counters["restarted_groups"] += len(doomed)
        self._applied.set()

    async def _fetch(self, address: str, version: int) -> WeightsPayload:
        dealer = self._weights.get(address)
        if dealer is None:
            dealer = await self._sockets.enter_async_context(
                transport.open_dealer(connect=address, codec=Codec(WeightsMessage), name="weights")
            )
            self._weights[address] = dealer
        return await dealer.request(
            WeightsRequest(version=version), WeightsPayload, timeout=120, setting="the trainer's weight server"
        )
