"""The vLLM rollout engine: what rlflow's wrapper costs, and what weight updates cost.

Measured in one run on this machine, with the default model and task:

* wrapper_ratio: tokens/s of rlflow's rollout engine (trio service side,
  asyncio bridge, groups streamed as they finish) over tokens/s of bare vLLM
  (AsyncLLM driven directly on its own loop) generating the same prompts
  with the same settings, on the same engine;
* update_ratio: tokens/s with a weight update after every trainer step's
  worth of groups, over tokens/s with no updates (updates keep requests in
  flight and must not stall generation); with the default
  `kv_on_update = "keep"`, and printed besides with "recompute";
* update_ms_default / update_ms_halfgb: one weight update, from the trainer
  starting its broadcast to the rollout generating again, for the default
  model and for a model of about 0.5 GB of random weights;
* broadcast_2_vs_1: one update (default model) to two vLLM replicas, each
  engine on a core of its own, in one gloo group (one broadcast, not one
  send per replica), over the same update to one;
* stall_p99_ms: while both replicas generate, 100 updates (one every
  0.2 s); each replica's pause per update, from the update's start to
  generating again (its p99; the p50 of the first and second half of the
  updates are printed too, to show it stays flat).

Ends with

    RESULT rollout wrapper_ratio=A update_ratio=B update_ms_default=C update_ms_halfgb=D \
broadcast_2_vs_1=E stall_p99_ms=F
"""

from __future__ import annotations

import argparse
import asyncio
import json
import pathlib
import statistics
import sys
import threading
import time

import torch
import trio

from rlflow.config import VllmRollout, load
from rlflow.control.launch import resolve
from rlflow.data.net import free_port
from rlflow.protocol import PromptGroup, WeightsGloo
from rlflow.services.base import standalone_context
from rlflow.services.rollout.vllm_engine import VllmBackend, VllmEngine
from rlflow.services.weights import GlooGroup, layout, pack
from rlflow.tasks.core import load_tokenizer, make_task

RESULTS = pathlib.Path(__file__).parent / "results"
DEFAULT = pathlib.Path(__file__).resolve().parent.parent / "rlflow" / "defaults" / "default.toml"


def prompts(config, count: int, first: int = 0) -> list[PromptGroup]:
    task = make_task(config, load_tokenizer(config.policy_path))
    return [task.prompt(first + i, config.run.samples_per_prompt) for i in range(count)]


# -- bare vLLM -------------------------------------------------------------------------


def bare(backend: VllmBackend, groups: list[PromptGroup], temperature: float) -> tuple[float, int]:
    """Seconds and tokens for AsyncLLM alone to answer every group."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    llm = backend.llm
    params = SamplingParams(
        n=groups[0].n, temperature=temperature, max_tokens=backend.cfg.max_tokens, logprobs=0,
        output_kind=RequestOutputKind.FINAL_ONLY,
    )

    async def one(group: PromptGroup) -> int:
        final = None
        async for out in llm.generate({"prompt_token_ids": group.prompt_ids}, params,
                                      f"bare-{group.group_id}-{time.time()}"):
            final = out
        return sum(len(c.token_ids) for c in final.outputs)

    async def every() -> tuple[float, int]:
        start = time.perf_counter()
        counts = await asyncio.gather(*(one(g) for g in groups))
        return time.perf_counter() - start, sum(counts)

    return asyncio.run_coroutine_threadsafe(every(), backend.bridge.loop).result()


# -- rlflow's engine -----------------------------------------------------------------------


async def wrapped(
    backend: VllmBackend, config, groups: list[PromptGroup], *, update_every: int = 0, trainer=None
) -> tuple[float, int, list[float]]:
    """Seconds and tokens for rlflow's engine to answer every group; with
    `update_every`, a weight update from `trainer` after each that many
    finished groups."""
    joined = trainer.joined if trainer is not None else None
    engine = VllmEngine(config.roles.rollout.engine, standalone_context(config, "rollout"), backend, joined)
    await engine.start()  # labels the weights held now
    tokens, done, updates = 0, 0, []
    async with trio.open_nursery() as nursery:
        await nursery.start(engine.run)
        start = time.perf_counter()
        now = time.time()
        for group in groups:
            engine.submit(group, now)
        version = engine.version
        async for finished in engine.finished:
            for _, responses in finished:
                tokens += sum(len(r.token_ids) for r in responses)
                done += 1
                if update_every and done % update_every == 0 and done < len(groups):
                    version += 1
                    updates.append(await trainer.push([engine], version))
            if done == len(groups):
                break
        seconds = time.perf_counter() - start
        nursery.cancel_scope.cancel()
    return seconds, tokens, updates


class Trainer:
    """The sending end of the weight group, in this process; every backend
    in `backends` joins the group as a receiver (ranks 1, 2, ...)."""

    def __init__(self, backends: list[VllmBackend], model_path: str):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
        self.specs, self.nbytes = layout(self.model.named_parameters())
        port, world = free_port("127.0.0.1"), 1 + len(backends)
        box: dict = {}
        thread = threading.Thread(target=lambda: box.setdefault("group", GlooGroup("127.0.0.1", port, 0, world)))
        thread.start()

        async def join_all() -> None:
            async with trio.open_nursery() as nursery:
                for rank, backend in enumerate(backends, 1):
                    nursery.start_soon(backend.join_weights, "127.0.0.1", port, rank, world)

        trio.run(join_all)
        thread.join()
        self.group = box["group"]
        self.backends = backends
        self.joins = [(WeightsGloo(host="127.0.0.1", port=port, world_size=world, rank=rank, nbytes=self.nbytes),
                       self.specs) for rank in range(1, world)]
        self.joined = self.joins[0]

    async def push(self, engines: list[VllmEngine] | None, version: int, stalls: list[float] | None = None) -> float:
        """Milliseconds from the start of the broadcast to generation resumed
        on every receiver; with `stalls`, each receiver's own pause (ms) is
        added to it."""

        with torch.no_grad():
            for p in self.model.parameters():
                p.mul_(1.0 + 1e-4)  # new weights, barely different
        flat = pack(self.model.named_parameters(), self.specs, self.nbytes)

        async def receive(i: int) -> None:
            began = time.perf_counter()
            if engines is not None:
                await engines[i].update_weights(version, None)
            else:
                await self.backends[i].update(version, self.specs, self.nbytes)
            if stalls is not None:
                stalls.append(1000 * (time.perf_counter() - began))

        start = time.perf_counter()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(trio.to_thread.run_sync, self.group.broadcast, flat)
            for i in range(len(self.backends)):
                nursery.start_soon(receive, i)
        return 1000 * (time.perf_counter() - start)


async def updates_while_generating(
    trainer: Trainer, config, groups: list[list[PromptGroup]], updates: int, every_s: float
) -> list[float]:
    """Each receiver generates its groups while `updates` weight updates go
    out, one every `every_s`; each receiver's stall per update (ms)."""
    engines = [VllmEngine(config.roles.rollout.engine, standalone_context(config, "rollout", i), backend, joined)
               for i, (backend, joined) in enumerate(zip(trainer.backends, trainer.joins))]
    stalls: list[float] = []
    async with trio.open_nursery() as nursery:
        for engine, mine in zip(engines, groups):
            await engine.start()
            await nursery.start(engine.run)
            now = time.time()
            for group in mine:
                engine.submit(group, now)
        version = max(engine.version for engine in engines)
        for _ in range(updates):
            await trio.sleep(every_s)
            version += 1
            await trainer.push(engines, version, stalls)
        nursery.cancel_scope.cancel()
    return stalls


def fanout(config, cfg: VllmRollout, quick: bool) -> dict:
    """One update to two vLLM replicas against one (each replica's engine on
    a core of its own), and the stall each replica sees over many updates
    while both generate."""
    import os

    cpus = sorted(os.sched_getaffinity(0))
    saved = os.environ.get("VLLM_CPU_OMP_THREADS_BIND")
    backends = []
    try:
        for i in range(2):
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = str(cpus[i % len(cpus)])
            backends.append(VllmBackend(cfg, config.policy_path, seed=i))
            backends[-1].start_blocking()
        if saved is None:
            os.environ.pop("VLLM_CPU_OMP_THREADS_BIND")
        else:
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = saved
        repeats = 5 if quick else 10
        one = Trainer(backends[:1], config.policy_path)
        to_one = [trio.run(one.push, None, 100 + i) for i in range(repeats)]
        two = Trainer(backends, config.policy_path)
        to_two = [trio.run(two.push, None, 200 + i) for i in range(repeats)]
        updates = 30 if quick else 100
        work = [prompts(config, 400, first=20_000 + 1_000 * i) for i in range(2)]
        stalls = trio.run(updates_while_generating, two, config, work, updates, 0.2)
    finally:
        for backend in backends:
            backend.close()
    half = len(stalls) // 2  # in the order the updates went: is the stall flat?
    early, late = statistics.median(stalls[:half]), statistics.median(stalls[half:])
    stalls.sort()
    return {
        "update_ms_to_1": to_one,
        "update_ms_to_2": to_two,
        "broadcast_2_vs_1": statistics.median(to_two) / statistics.median(to_one),
        "stall_ms": stalls,
        "stall_p50_ms": stalls[len(stalls) // 2],
        "stall_p99_ms": stalls[min(len(stalls) - 1, int(0.99 * len(stalls)))],
        "stall_p50_ms_first_half": early,
        "stall_p50_ms_second_half": late,
        "updates": updates,
    }


def halfgb_model(path: pathlib.Path) -> pathlib.Path:
    """A Qwen2 of about 0.5 GB of random float32 weights, with the task's tokenizer."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from rlflow.models import build_tokenizer
    from rlflow.tasks.arith import Arith

    tokenizer = build_tokenizer(Arith.ALPHABET)
    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=1024, intermediate_size=4096, num_hidden_layers=8,
        num_attention_heads=16, num_key_value_heads=16, max_position_embeddings=256, tie_word_embeddings=False,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, architectures=["Qwen2ForCausalLM"],
    )
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer groups and repeats")
    parser.add_argument("--out", type=pathlib.Path, default=RESULTS / "rollout.json")
    args = parser.parse_args()

    config = resolve(load(DEFAULT))
    cfg: VllmRollout = config.roles.rollout.engine
    count, repeats = (64, 2) if args.quick else (128, 3)
    step_groups = config.run.batch_size

    backend = VllmBackend(cfg, config.policy_path, seed=0)
    backend.start_blocking()
    try:
        trainer = Trainer([backend], config.policy_path)
        bare(backend, prompts(config, 16, first=10_000), cfg.temperature)  # warm-up
        rows = {"bare": [], "rlflow": [], "rlflow_updates": [], "rlflow_updates_recompute": []}
        recompute = resolve(load(DEFAULT, ["roles.rollout.engine.kv_on_update=recompute"]))
        update_ms: list[float] = []
        for r in range(repeats):
            groups = prompts(config, count, first=r * count)
            seconds, tokens = bare(backend, groups, cfg.temperature)
            rows["bare"].append(tokens / seconds)
            seconds, tokens, _ = trio.run(wrapped, backend, config, groups)
            rows["rlflow"].append(tokens / seconds)
            seconds, tokens, ms = trio.run(
                lambda: wrapped(backend, config, groups, update_every=step_groups, trainer=trainer)
            )
            rows["rlflow_updates"].append(tokens / seconds)
            update_ms += ms
            seconds, tokens, _ = trio.run(
                lambda: wrapped(backend, recompute, groups, update_every=step_groups, trainer=trainer)
            )
            rows["rlflow_updates_recompute"].append(tokens / seconds)
            print(
                f"repeat {r}: bare {rows['bare'][-1]:,.0f} tok/s, rlflow {rows['rlflow'][-1]:,.0f} tok/s, "
                f"rlflow with an update per {step_groups} groups {rows['rlflow_updates'][-1]:,.0f} tok/s "
                f"({len(ms)} updates, {statistics.median(ms) if ms else 0:.0f} ms each; "
                f"{rows['rlflow_updates_recompute'][-1]:,.0f} tok/s recomputing the KV cache)",
                flush=True,
            )
        idle_ms = [trio.run(trainer.push, None, 1000 + i) for i in range(5)]
    finally:
        backend.close()

    # A model of about 0.5 GB: update time only.
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        path = halfgb_model(pathlib.Path(tmp) / "halfgb")
        big = VllmBackend(VllmRollout(max_num_seqs=16, max_tokens=16, kv_cache_bytes=64 << 20), str(path), seed=0)
        big.start_blocking()
        try:
            big_trainer = Trainer([big], str(path))
            halfgb_bytes = big_trainer.nbytes
            halfgb_ms = [trio.run(big_trainer.push, None, i + 1) for i in range(3 if args.quick else 5)]
        finally:
            big.close()

    fan = fanout(config, cfg, args.quick)

    wrapper_ratio = statistics.median(rows["rlflow"]) / statistics.median(rows["bare"])
    update_ratio = statistics.median(rows["rlflow_updates"]) / statistics.median(rows["rlflow"])
    recompute_ratio = statistics.median(rows["rlflow_updates_recompute"]) / statistics.median(rows["rlflow"])
    result = {
        "groups_per_run": count,
        "samples_per_group": config.run.samples_per_prompt,
        "tokens_per_s": {k: v for k, v in rows.items()},
        "wrapper_ratio": wrapper_ratio,
        "update_ratio": update_ratio,
        "update_ratio_recompute": recompute_ratio,
        "update_ms_in_flight": update_ms,
        "update_ms_default": idle_ms,
        "default_bytes": trainer.nbytes,
        "update_ms_halfgb": halfgb_ms,
        "halfgb_bytes": halfgb_bytes,
        **fan,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(
        f"default model {trainer.nbytes / 2**20:.1f} MiB: update {statistics.median(idle_ms):.1f} ms idle, "
        f"{statistics.median(update_ms) if update_ms else 0:.1f} ms with requests in flight; "
        f"{halfgb_bytes / 2**20:.0f} MiB model: {statistics.median(halfgb_ms):.0f} ms"
    )
    print(f"updates recomputing the KV cache of requests in flight: {recompute_ratio:.3f} of no updates")
    print(f"one update to 1 replica {statistics.median(fan['update_ms_to_1']):.1f} ms, to 2 replicas "
          f"{statistics.median(fan['update_ms_to_2']):.1f} ms (one gloo broadcast to both); over {fan['updates']} "
          f"updates while both generate, each replica's stall p50 {fan['stall_p50_ms']:.1f} ms, p99 "
          f"{fan['stall_p99_ms']:.1f} ms (p50 {fan['stall_p50_ms_first_half']:.1f} ms in the first half of the "
          f"updates, {fan['stall_p50_ms_second_half']:.1f} ms in the second)")
    print(
        f"RESULT rollout wrapper_ratio={wrapper_ratio:.3f} update_ratio={update_ratio:.3f} "
        f"update_ms_default={statistics.median(idle_ms):.1f} update_ms_halfgb={statistics.median(halfgb_ms):.0f} "
        f"broadcast_2_vs_1={fan['broadcast_2_vs_1']:.2f} stall_p99_ms={fan['stall_p99_ms']:.1f}"
    )


if __name__ == "__main__":
    sys.exit(main())
