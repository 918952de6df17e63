"""LoRA against full weights: what a weight update costs, and what the
adapter learns.

Measured in one run on this machine, for the default model and for a
randomly initialised model of Qwen2-0.5B's shape built here (its config,
random weights, the default task's tokenizer; nothing downloaded), each
with a rank-16 adapter on every linear projection against the whole model,
through rlflow's own trainer (`TorchEngine`, one rank) and vLLM rollout
(`VllmEngine`) over the gloo weight group:

* update_bytes_ratio: bytes of one update, adapter over full weights;
* update_ms_ratio: one update, from the trainer starting its send to the
  rollout generating again (no requests in flight), adapter over full
  weights (medians);
* update_ratio: tokens/s of the rollout with an update after every
  trainer step's worth of finished groups, over tokens/s with none, for the
  adapter (in place): the median over repeats (four; the two sides of each
  measured one after the other, in turns) of each repeat's ratio; the same
  ratio for full weights is printed beside it.

The ratios of the RESULT line are those of the 0.5B shape. Then the
held-out accuracy of the default task trained with LoRA (`rlflow up
--config examples/lora.toml`) against full fine-tuning (the default `rlflow
up`), the same seed, at equal steps (the last evaluation of each) and at
equal wall time (each run's last evaluation of a step reached within the
shorter run's training time): of two runs of `--train STEPS` steps that the bench
starts itself, one after the other, or of two finished run directories
given with `--runs LORA_RUN FULL_RUN`. Without either, L and F are nan.

Ends with

    RESULT lora update_bytes_ratio=B update_ms_ratio=T update_ratio=U lora_heldout=L full_heldout=F
"""

from __future__ import annotations

import argparse
import json
import pathlib
import shutil
import statistics
import subprocess
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
from rlflow.services.rollout.vllm_engine import VllmBackend, VllmEngine, adapter_slots
from rlflow.services.trainer.lora import adapter_offer
from rlflow.services.trainer.torch_engine import TorchEngine
from rlflow.services.weights import GlooGroup
from rlflow.tasks.core import load_tokenizer, make_task

RESULTS = pathlib.Path(__file__).parent / "results"
ROOT = pathlib.Path(__file__).resolve().parent.parent
DEFAULT = ROOT / "rlflow" / "defaults" / "default.toml"
LORA = 'roles.trainer.engine.lora={rank = 16, alpha = 32}'


def qwen2_half_b(path: pathlib.Path) -> pathlib.Path:
    """Qwen2-0.5B's shape (24 layers, hidden 896, FFN 4864, 14 heads, 2 KV
    heads, a 151,936-token embedding tied to the head: 494M parameters) with
    random weights and the default task's tokenizer."""
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    from rlflow.models import build_tokenizer
    from rlflow.tasks.arith import Arith

    if (path / "config.json").exists():
        return path
    tokenizer = build_tokenizer(Arith.ALPHABET)
    config = Qwen2Config(
        vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
        num_key_value_heads=2, max_position_embeddings=4096, rope_theta=1_000_000.0, tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.eos_token_id,
        torch_dtype="float32", architectures=["Qwen2ForCausalLM"],
    )
    torch.manual_seed(0)
    tmp = path.with_name(path.name + ".tmp")
    Qwen2ForCausalLM(config).save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    GenerationConfig(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id).save_pretrained(tmp)
    tmp.rename(path)
    return path


class Sender:
    """The trainer's side in this process: rlflow's torch engine (with or
    without LoRA) hosting the gloo group, and one update per `push`."""

    def __init__(self, config, backend: VllmBackend):
        self.engine = TorchEngine(config.roles.trainer.engine, config.policy_path)
        port = free_port("127.0.0.1")
        box: dict = {}
        thread = threading.Thread(target=lambda: box.setdefault("group", GlooGroup("127.0.0.1", port, 0, 2)))
        thread.start()
        trio.run(backend.join_weights, "127.0.0.1", port, 1, 2)
        thread.join()
        self.group = box["group"]
        self.joined = (WeightsGloo(host="127.0.0.1", port=port, world_size=2, rank=1, nbytes=self.engine.nbytes,
                                   bucket_bytes=self.engine.cfg.bucket_bytes), self.engine.specs)
        lora = self.engine.lora
        self.adapter = adapter_offer(lora, config.run.max_staleness) if lora is not None else None

    async def push(self, engine: VllmEngine, version: int) -> float:
        """A new version (one tensor moved a little: the whole layout is sent
        either way); milliseconds from the start of the send to generation resumed."""
        params = [p for p in self.engine.model.parameters() if p.requires_grad]
        with torch.no_grad():
            params[0].add_(1e-3)
        snapshot = await trio.to_thread.run_sync(self.engine.snapshot)
        start = time.perf_counter()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(trio.to_thread.run_sync, self.engine.send, snapshot, self.group.broadcast)
            await engine.update_weights(version, None)
        ms = 1000 * (time.perf_counter() - start)
        if self.adapter is not None and engine.checksum != self.engine.checksum(snapshot):
            raise RuntimeError(f"v{version}: the rollout received {engine.checksum}, the trainer sent another")
        return ms


async def generate(engine: VllmEngine, groups: list[PromptGroup], sender: Sender | None = None,
                   update_every: int = 0) -> tuple[float, int, list[float]]:
    """Seconds and tokens for the engine (its loop running) to answer every
    group; with `update_every`, an update after each that many finished groups."""
    tokens, done, updates = 0, 0, []
    start = time.perf_counter()
    now = time.time()
    for group in groups:
        engine.submit(group, now)
    async for finished in engine.finished:
        for _, responses in finished:
            tokens += sum(len(r.token_ids) for r in responses)
            done += 1
            if update_every and done % update_every == 0 and done < len(groups):
                updates.append(await sender.push(engine, engine.version + 1))
        if done == len(groups):
            break
    return time.perf_counter() - start, tokens, updates


def measure(config, label: str, count: int, repeats: int, idle: int) -> dict:
    """One engine (LoRA or not, as `config` says) and its trainer: update
    times with nothing in flight, tokens/s without and with updates."""
    lora = config.lora
    cfg: VllmRollout = config.roles.rollout.engine
    backend = VllmBackend(cfg, config.policy_path, seed=0, lora_rank=lora.rank if lora else 0,
                          lora_slots=adapter_slots(lora.adapter_update, config.run.max_staleness) if lora else 1)
    started = time.perf_counter()
    backend.start_blocking()
    print(f"[{label}] vLLM started in {time.perf_counter() - started:.0f} s", flush=True)
    task = make_task(config, load_tokenizer(config.policy_path))
    step = config.run.batch_size
    out: dict = {"tokens_per_s": [], "tokens_per_s_updating": [], "update_ms_in_flight": []}

    async def session(sender: Sender) -> None:
        engine = VllmEngine(cfg, standalone_context(config, "rollout"), backend, sender.joined)
        await engine.start()
        await engine.join_weights(None, sender.engine.specs, sender.adapter)
        async with trio.open_nursery() as nursery:
            await nursery.start(engine.run)
            await generate(engine, [task.prompt(90_000 + i, config.run.samples_per_prompt) for i in range(step)])
            out["update_ms_idle"] = [await sender.push(engine, engine.version + 1) for _ in range(idle)]
            for r in range(repeats):
                groups = [task.prompt(r * count + i, config.run.samples_per_prompt) for i in range(count)]
                # Without and with updates in turn, the order swapped every other repeat: a machine whose
                # speed drifts over the run weighs on both sides alike.
                ms: list[float] = []
                for updating in ((False, True) if r % 2 == 0 else (True, False)):
                    seconds, tokens, moved = await generate(engine, groups, sender, step if updating else 0)
                    out["tokens_per_s_updating" if updating else "tokens_per_s"].append(tokens / seconds)
                    if updating:
                        ms = moved
                out["update_ms_in_flight"] += ms
                print(f"[{label}] repeat {r}: {out['tokens_per_s'][-1]:,.0f} tok/s without updates, "
                      f"{out['tokens_per_s_updating'][-1]:,.0f} with an update per {step} groups (ratio "
                      f"{out['tokens_per_s_updating'][-1] / out['tokens_per_s'][-1]:.3f}; {len(ms)} updates, "
                      f"{statistics.median(ms or [0]):.0f} ms each)", flush=True)
            nursery.cancel_scope.cancel()

    try:
        sender = Sender(config, backend)
        trio.run(session, sender)
    finally:
        backend.close()
    out["update_bytes"] = sender.engine.nbytes
    # The median of each repeat's own ratio: the two sides of a repeat ran minutes apart, repeats further.
    out["update_ratios"] = [u / n for u, n in zip(out["tokens_per_s_updating"], out["tokens_per_s"])]
    out["update_ratio"] = statistics.median(out["update_ratios"])
    print(f"[{label}] {out['update_bytes'] / 2**20:.2f} MiB per update, {statistics.median(out['update_ms_idle']):.0f} "
          f"ms idle, {statistics.median(out['update_ms_in_flight'] or [0]):.0f} ms with requests in flight; update "
          f"ratio {out['update_ratio']:.3f}", flush=True)
    return out


def compare(model: str, label: str, rollout: list[str], count: int, repeats: int, idle: int) -> dict:
    """Adapter (in place) against full weights on one model."""
    sets = [f'roles.rollout.model="{model}"', *rollout]
    full = measure(resolve(load(DEFAULT, sets)), f"{label} full", count, repeats, idle)
    lora = measure(resolve(load(DEFAULT, [*sets, "roles.trainer.engine.lr=1e-3", LORA])), f"{label} lora", count,
                   repeats, idle)
    return {
        "full": full,
        "lora": lora,
        "update_bytes_ratio": lora["update_bytes"] / full["update_bytes"],
        "update_ms_ratio": statistics.median(lora["update_ms_idle"]) / statistics.median(full["update_ms_idle"]),
        "update_ratio_lora": lora["update_ratio"],
        "update_ratio_full": full["update_ratio"],
    }


def heldout(lora_run: pathlib.Path, full_run: pathlib.Path) -> dict:
    """Held-out accuracy of the two runs at equal steps (each one's last
    evaluation) and at equal wall time (each one's last evaluation of a step
    reached within the shorter run's training time)."""
    from rlflow.rundir import RunDir

    def timeline(path: pathlib.Path) -> tuple[list[tuple[int, float, float]], float]:
        folder = RunDir(path)
        rows = folder.read_metrics()
        at = {r.step + 1: r.time_s for r in rows}  # steps done -> seconds since training started
        evals = [(e.step, at.get(e.step, 0.0), e.accuracy) for e in folder.read_evals() if e.accuracy is not None]
        return evals, rows[-1].time_s

    lora, lora_s = timeline(lora_run)
    full, full_s = timeline(full_run)
    horizon = min(lora_s, full_s)
    within = lambda evals: [e for e in evals if e[1] <= horizon][-1]  # noqa: E731
    return {
        "lora_evals": lora, "full_evals": full, "lora_train_s": lora_s, "full_train_s": full_s,
        "equal_steps": {"step": [lora[-1][0], full[-1][0]], "lora": lora[-1][2], "full": full[-1][2]},
        "equal_time": {"seconds": horizon, "lora": within(lora)[2], "full": within(full)[2],
                       "steps": [within(lora)[0], within(full)[0]]},
    }


def train_both(steps: int, folder: pathlib.Path) -> tuple[pathlib.Path, pathlib.Path]:
    """`rlflow up` with examples/lora.toml and with the default config, `steps`
    steps each, one after the other (seed 0); their run directories."""
    runs = (folder / f"lora-{steps}", folder / f"full-{steps}")
    for config, run in zip((ROOT / "examples" / "lora.toml", DEFAULT), runs):
        shutil.rmtree(run, ignore_errors=True)
        started = time.perf_counter()
        subprocess.run([sys.executable, "-m", "rlflow.tools.cli", "up", "--config", str(config), "--steps",
                        str(steps), "--run-dir", str(run)], check=True, stdout=subprocess.DEVNULL)
        print(f"[train] {run.name}: {time.perf_counter() - started:.0f} s", flush=True)
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer groups and repeats")
    parser.add_argument("--skip-default", action="store_true", help="only the 0.5B shape")
    parser.add_argument("--runs", nargs=2, type=pathlib.Path, metavar=("LORA_RUN", "FULL_RUN"),
                        help="run directories of examples/lora.toml and of the default config to compare")
    parser.add_argument("--train", type=int, default=0, metavar="STEPS",
                        help="train the default task with LoRA and in full for STEPS steps each, then compare")
    parser.add_argument("--models", type=pathlib.Path, default=None,
                        help="where the 0.5B-shape model is built (default: rlflow's cache)")
    parser.add_argument("--out", type=pathlib.Path, default=RESULTS / "lora.json")
    args = parser.parse_args()

    from rlflow.models import SHIPPED, cache_dir

    default = str(SHIPPED)
    # Groups per measurement: four trainer steps' worth (an update after each of the first three).
    repeats, idle = (1, 3) if args.quick else (4, 5)
    result: dict = {}
    if not args.skip_default:
        result["default"] = compare(default, "default", [], 64 if args.quick else 128, repeats, idle)
    half = qwen2_half_b((args.models or cache_dir() / "bench") / "qwen2-0.5b-shape")
    # The random model never says stop: every response runs to max_tokens.
    small = ["roles.rollout.engine.max_num_seqs=64", "roles.rollout.engine.kv_cache_bytes=134217728",
             *(["roles.rollout.engine.max_tokens=16", "run.batch_size=1", "run.samples_per_prompt=2"] if args.quick
               else ["roles.rollout.engine.max_tokens=32", "run.batch_size=4"])]
    result["qwen2_0.5b_shape"] = big = compare(str(half), "0.5B", small, 4 if args.quick else 16, repeats, idle)
    if args.train:
        args.runs = train_both(args.train, args.out.parent / "lora-runs")
    if args.runs:
        result["heldout"] = heldout(*args.runs)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")

    for name, row in result.items():
        if name == "heldout":
            continue
        print(f"{name}: update bytes {row['lora']['update_bytes'] / 2**20:.2f} MiB (adapter) against "
              f"{row['full']['update_bytes'] / 2**20:.1f} MiB, ratio {row['update_bytes_ratio']:.4f}; update ms "
              f"{statistics.median(row['lora']['update_ms_idle']):.0f} against "
              f"{statistics.median(row['full']['update_ms_idle']):.0f}, ratio {row['update_ms_ratio']:.3f}; tokens/s "
              f"with an update per step over without: adapter {row['update_ratio_lora']:.3f}, full "
              f"{row['update_ratio_full']:.3f}")
    lora_acc = full_acc = float("nan")
    if "heldout" in result:
        h = result["heldout"]
        lora_acc, full_acc = h["equal_steps"]["lora"], h["equal_steps"]["full"]
        print(f"held-out accuracy at equal steps ({h['equal_steps']['step']}): LoRA {lora_acc:.3f}, full "
              f"{full_acc:.3f}; at equal wall time ({h['equal_time']['seconds']:.0f} s of training, steps "
              f"{h['equal_time']['steps']}): LoRA {h['equal_time']['lora']:.3f}, full {h['equal_time']['full']:.3f}")
    print(f"RESULT lora update_bytes_ratio={big['update_bytes_ratio']:.4f} "
          f"update_ms_ratio={big['update_ms_ratio']:.3f} "
          f"update_ratio={big['update_ratio_lora']:.3f} lora_heldout={lora_acc:.3f} full_heldout={full_acc:.3f}")


if __name__ == "__main__":
    sys.exit(main())
