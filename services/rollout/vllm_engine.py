"""The rollout's vLLM engine, driven from trio through the vLLM client
(`rlflow.services.vllm_client`: vLLM's `AsyncLLM` on an asyncio thread of its
own, every call bridged there and back).

Each prompt group is one request with ``n`` samples; the group is sent on
the moment its last sample finishes. Every sampled token comes with its
log-probability under the sampling distribution and the policy version that
produced it (vLLM's weight-version spans). A request that fails becomes
failed samples in the batch (`FinishReason.ERROR`), and the engine goes on.

Weights, on CPU: a gloo process group with the trainer, received by
rlflow's own weight-transfer backend inside vLLM's engine-core process
(`vllm_worker`). On CUDA: vLLM's own `nccl` backend, every worker of every
replica in one NCCL group with the trainer's rank 0 (`WeightsNccl`; each
tensor-parallel worker its own rank). Which one is chosen when the engine
starts, by its platform; the trainer's offer must match. An update pauses
the engine with its requests kept, receives the weights piece by piece (or
vLLM's packed chunks) and loads them, and resumes: requests in flight go on
over their KV cache (or recompute it under the new weights,
``kv_on_update = "recompute"``) and their later tokens carry the new version.
What is served, the whole model or LoRA adapter versions on the base, is
one object of `vllm_lora` (`WholeWeights`, `AdapterVersions`) that the
engine asks for each version's load and each request's adapter.

With `vllm_worker`, `vllm_lora_worker` and the vLLM client, this module is the only place that imports vLLM.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import numpy as np
import trio

from rlflow.algo.staleness import too_stale
from rlflow.config import VllmRollout
from rlflow.protocol import (
    Adapter, EngineLoad, FinishReason, ParamSpec, PromptGroup, Response, Stage, WeightsGloo, WeightsNccl, WeightsZmq,
    WeightTransfer
)
from rlflow.protocol.batch import N_STAGES
from rlflow.services import compat
from rlflow.services.base import EngineContext
from rlflow.errors import WeightGroupBroken
from rlflow.services.rollout.engine import EngineDead, VersionWait
from rlflow.services.rollout.vllm_lora import AdapterVersions, WholeWeights, adapter_slots
from rlflow.services.vllm_client import EVAL_PRIORITY, IN_PLACE_ID, NCCL, VllmBackend

__all__ = ["IN_PLACE_ID", "EngineDead", "VllmBackend", "VllmEngine", "adapter_slots", "check_offer"]


@dataclass
class _Group:
    group: PromptGroup
    issued_at: float
    submitted_version: int = 0
    scope: trio.CancelScope | None = None  # of its generation, while running


class VllmEngine:
    """Generates prompt groups with vLLM (see the module docstring)."""

    def __init__(
        self,
        cfg: VllmRollout,
        ctx: EngineContext,
        backend: VllmBackend | None = None,
        joined: tuple[WeightsGloo | WeightsNccl, list[ParamSpec]] | None = None,
    ) -> None:
        """`backend`: a started engine to share (tests, benches), `joined`: the
        weight group it has already joined."""
        self.cfg = cfg
        self.ctx = ctx
        self.clock = ctx.clock
        run = ctx.config.run
        self.staleness = run.max_staleness
        self.strict = run.staleness_check == "strict"
        #: A reproducible run's seed of its requests' own (None: the engine's stream, shared by all).
        self.seed = run.seed if run.deterministic else None
        lora = ctx.config.lora
        slots = adapter_slots(lora.adapter_update, run.max_staleness) if lora else 1
        self.backend = backend or VllmBackend(cfg, ctx.config.policy_path, run.seed + ctx.rank,
                                              lora_rank=lora.rank if lora else 0, lora_slots=slots,
                                              seeded=run.deterministic)
        self._owns_backend = backend is None
        self.version = 0
        self.pending: deque[_Group] = deque()
        self.running: dict[int, _Group] = {}
        self._send, self.finished = trio.open_memory_channel(2)
        self._wake = trio.Event()
        self._weights: WeightTransfer | None = None
        self._layout: list[ParamSpec] = []
        self._weights_ready = trio.Event()
        self._weights_changed = VersionWait()
        if joined is not None:
            (self._weights, self._layout) = joined
            self._weights_ready.set()
        self._updating = False
        #: What is served: the whole model until the trainer's welcome names a LoRA adapter.
        self.served: WholeWeights = WholeWeights(self.backend, cfg.kv_on_update)
        #: Episodes' turns being generated.
        self._turns = 0

    @property
    def eval_concurrency(self) -> int:
        return self.cfg.max_num_seqs

    def queues(self) -> dict[str, int]:
        return {"pending": len(self.pending), "running": len(self.running)}

    def hello_fields(self) -> dict[str, Any]:
        return {"model": self.backend.model_path, "slots": self.cfg.max_num_seqs}

    def load(self) -> EngineLoad:
        return self.backend.load(self.cfg.max_num_seqs)

    @property
    def adapter(self) -> Adapter | None:
        """The LoRA adapter served on the base (None: whole weights)."""
        return self.served.adapter

    @property
    def checksum(self) -> str:
        """The checksum of the version served (SPEC.md, *Checksums*; empty: not checked)."""
        return self.served.checksum

    # -- start-up ---------------------------------------------------------------

    async def start(self) -> None:
        if self.backend.llm is None:
            await trio.to_thread.run_sync(self.backend.start_blocking)
        await self.set_version(self.version)

    async def set_version(self, version: int) -> None:
        self.version = version
        await self.backend.set_version(version)
        self._weights_changed.changed()

    async def close(self) -> None:
        if self._owns_backend:
            await trio.to_thread.run_sync(self.backend.close)

    async def join_weights(self, transfer: WeightTransfer | None, layout: list[ParamSpec],
                           adapter: Adapter | None = None, *, first: bool = True) -> None:
        """Join the trainer's weight group (returns once the trainer has joined
        too); none: a replacement, which joins the next generation of the group.
        The first group waits as long as a start may take; a later generation
        `cluster.weight_timeout_s`. With `adapter`, serve the base with it from
        now on, starting with the adapter of the version held (zeros, or the
        checkpoint resumed from)."""
        self._layout = layout or self._layout
        if adapter is not None and self.adapter is None:
            served = AdapterVersions(self.backend, self.cfg.kv_on_update, self.ctx, adapter)
            await served.first(self.version, self._weights, self._layout)
            self.served = served
        if transfer is None:
            return
        self.served.check(transfer)
        if isinstance(transfer, WeightsZmq):
            self._weights = transfer
            self._weights_ready.set()
            return
        check_offer(self.backend.weight_backend(), transfer)
        cluster = self.ctx.config.cluster
        timeout_s = max(cluster.handshake_timeout_s, cluster.weight_timeout_s) if first else cluster.weight_timeout_s
        if isinstance(transfer, WeightsNccl):
            await self.backend.join_nccl(transfer)
        else:
            await self.backend.join_weights(transfer.host, transfer.port, transfer.rank, transfer.world_size,
                                            timeout_s)
        self._weights = transfer
        self._weights_ready.set()

    # -- called by the service ----------------------------------------------------

    @property
    def context(self) -> int | None:
        """The longest sequence (prompt and response) the engine takes; None before it has started."""
        llm = self.backend.llm
        return llm.model_config.max_model_len if llm is not None else None

    def submit(self, group: PromptGroup, issued_at: float) -> None:
        self.pending.append(_Group(group, issued_at))
        self._wake.set()

    async def update_weights(self, version: int, transfer: WeightTransfer | None) -> int:
        if transfer is not None:
            await self.join_weights(transfer, self._layout, first=False)
        await self._weights_ready.wait()
        self._updating = True
        self.clock.set("loading")
        try:
            version = await self.served.load(version, self._weights, self._layout)
        except Exception as exc:
            if compat.engine_dead(exc):  # nothing more can be loaded or served: the replica ends, to be restarted
                raise EngineDead(f"vLLM's engine died while loading weights v{version}: {exc}") from exc
            if isinstance(exc, RuntimeError):  # gloo: "Connection closed by peer", a timeout; an NCCL error
                raise WeightGroupBroken(f"{type(exc).__name__}: {exc}") from exc
            raise
        finally:
            self._updating = False
        self.version = version
        old = self.served.falling_out(version)
        if old:  # per request: the groups still running on versions let go of start again, on the newest
            self._restart(lambda item: item.submitted_version in old)
            await self.served.retire(old)
        if self.strict:  # groups whose first tokens are already too old to be trained on
            self._restart(lambda item: too_stale(item.submitted_version, self.version, self.staleness))
        self._wake.set()
        self._weights_changed.changed()
        return self.version

    def _restart(self, which) -> None:
        """Start the running groups `which` picks again (at the front of the queue)."""
        for item in list(self.running.values()):
            if which(item) and item.scope is not None and not item.scope.cancel_called:
                self.ctx.counters["restarted_groups"] += 1
                item.scope.cancel()
                self.pending.appendleft(item)

    # -- the loop -------------------------------------------------------------------

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        async with self._send, trio.open_nursery() as nursery:
            task_status.started()
            while True:
                while self.pending and self.pending[0].group.min_version <= self.version:
                    item = self.pending.popleft()
                    item.submitted_version = self.version
                    scope = item.scope = trio.CancelScope()
                    self.running[item.group.group_id] = item
                    nursery.start_soon(self._generate_group, item, scope)
                self._retime()
                self._wake = trio.Event()
                await self._wake.wait()

    def _retime(self) -> None:
        if self._updating:
            return
        if self.running or self._turns:
            self.clock.set("busy")
        elif self.pending:
            self.clock.set("loading")  # waiting for the weights a barrier asks for
        else:
            self.clock.set("starved")

    async def _generate_group(self, item: _Group, scope: trio.CancelScope) -> None:
        group_id = item.group.group_id
        try:
            with scope:
                started = time.time()
                try:
                    output = await self.backend.generate(item.group.prompt_ids, item.group.n, self.cfg.temperature,
                                                         lora_id=self.served.lora_id(item.submitted_version),
                                                         seed=self._seed(group_id))
                    responses = self._responses(output, item, started)
                except Exception as exc:
                    if compat.engine_dead(exc):  # nothing more can be served: the replica ends, to be restarted
                        raise EngineDead(f"vLLM's engine died while generating group {group_id}: {exc}") from exc
                    # Per request: failed samples in the batch, the engine goes on.
                    self.ctx.counters["failed_requests"] += 1
                    self.ctx.log.warning("[%s] group %d failed: %s: %s",
                                         self.ctx.name, group_id, type(exc).__name__, exc)
                    responses = [_failed(item, started, exc)] * item.group.n
            if scope.cancelled_caught:
                return
        finally:
            if item.scope is scope:  # not restarted meanwhile
                del self.running[group_id]
                item.scope = None
            self._wake.set()
        await self._send.send([(item.group, responses)])

    async def generate(self, prompt_ids: list[int], *, max_tokens: int, min_version: int = 0,
                       temperature: float | None = None, on_tokens: Any = None) -> Response:
        """One response (an episode's turn) to `prompt_ids`, of at most `max_tokens` tokens, not
        started on weights older than `min_version` (`temperature`: the config's if None; `on_tokens`:
        called with the tokens so far after each engine step)."""
        # A barrier: the weights it may start on are on their way.
        await self._weights_changed.reach(min_version, lambda: self.version)
        temperature = self.cfg.temperature if temperature is None else temperature
        item = _Group(PromptGroup(group_id=0, prompt_ids=[], n=1), time.time(), submitted_version=self.version)
        self._turns += 1
        self._retime()
        started = time.time()
        try:
            output = await self.backend.generate(prompt_ids, 1, temperature, max_tokens=max_tokens,
                                                 lora_id=self.served.lora_id(item.submitted_version),
                                                 on_tokens=on_tokens)
        except Exception as exc:
            if compat.engine_dead(exc):
                raise EngineDead(f"vLLM's engine died while generating an episode's turn: {exc}") from exc
            self.ctx.counters["failed_requests"] += 1
            return _failed(item, started, exc)
        finally:
            self._turns -= 1
            self._retime()
        return self._responses(output, item, started)[0]

    async def complete(self, prompt_ids: list[int], temperature: float) -> list[int]:
        """One answer to `prompt_ids` (for evaluation: not a training sample; served before training's)."""
        output = await self.backend.generate(prompt_ids, 1, temperature, lora_id=self.served.lora_id(self.version),
                                             priority=EVAL_PRIORITY, seed=self._seed(self.version, *prompt_ids))
        return list(output.outputs[0].token_ids)

    def _seed(self, *key: int) -> int | None:
        """A reproducible run's seed of the request `key` names (a prompt group; an evaluation's version
        and prompt): the same in every run with the run's seed, whichever replica serves it."""
        if self.seed is None:
            return None
        return int(np.random.SeedSequence([self.seed % 2**32, *key]).generate_state(1)[0]) >> 1

    def _responses(self, output, item: _Group, started: float) -> list[Response]:
        out = []
        for completion in output.outputs:
            ids = np.asarray(completion.token_ids, dtype=np.int32)
            logprobs = np.fromiter(
                (lp[token].logprob for token, lp in zip(completion.token_ids, completion.logprobs or [])),
                dtype=np.float32,
                count=len(ids),
            ) if completion.logprobs else np.zeros(len(ids), np.float32)  # greedy: none asked for
            versions = np.full(len(ids), item.submitted_version, dtype=np.int32)
            # Per request, every token is the adapter version it started on, whatever vLLM's label.
            for span in () if self.served.per_request else completion.weight_versions or ():
                versions[span.start : span.end] = int(span.version)
            out.append(
                Response(
                    token_ids=ids,
                    logprobs=logprobs,
                    versions=versions,
                    finish_reason=_FINISH.get(completion.finish_reason, FinishReason.ABORT),
                    stamps=_stamps(item, started),
                )
            )
        return out


def check_offer(backend: str, transfer: WeightTransfer) -> None:
    """Refuse a transfer the engine's weight backend cannot receive: NCCL
    (`WeightsNccl`) on CUDA, gloo (`WeightsGloo`) otherwise."""
    wanted = WeightsNccl if backend == NCCL else WeightsGloo
    if not isinstance(transfer, wanted):
        where = "CUDA (vLLM's nccl backend)" if backend == NCCL else "CPU (gloo)"
        raise ValueError(f"the vLLM rollout on {where} receives weights as {wanted.__name__}; the trainer offers "
                         f"{transfer!r} (trainer and rollout must both be on GPUs, or both on CPUs)")


_FINISH = {"stop": FinishReason.STOP, "length": FinishReason.LENGTH, "abort": FinishReason.ABORT}


def _stamps(item: _Group, started: float) -> np.ndarray:
    stamps = np.full(N_STAGES, np.nan)
    stamps[Stage.ISSUED] = item.issued_at
    stamps[Stage.ROLLOUT_START] = started
    stamps[Stage.ROLLOUT_END] = time.time()
    return stamps


def _failed(item: _Group, started: float, exc: Exception) -> Response:
    """A sample of a request the engine could not generate."""
    empty = np.zeros(0, np.int32)
    return Response(
        token_ids=empty,
        logprobs=np.zeros(0, np.float32),
        versions=empty,
        finish_reason=FinishReason.ERROR,
        stamps=_stamps(item, started),
        error=f"{type(exc).__name__}: {exc}"[:500],
    )
