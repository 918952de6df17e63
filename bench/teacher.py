"""The teacher: what scoring costs, and what distillation buys.

Four measurements, on this machine. The default model's vocabulary has 17
tokens, too few for top-32 scoring to mean anything, so the first two use
a pair of random models of the default shape (4 layers, hidden 256) with a
32,000-token vocabulary, as language models have:

* topk_cost_ratio: the teacher's time per token scoring with its top-32
  tokens over its time scoring the sampled token alone (torch backend, the
  same 256 samples; median of interleaved repeats). The vLLM backend's rate
  on the same samples is printed beside it.
* memory: the trainer's peak resident memory over three steps with the
  top-k distillation loss, over plain GRPO's (each in a fresh process; also
  what the steps added to the memory resident before them).

The runs use the default model as the student and the default teacher
("default-teacher": the default model warm-started to 80% on the
development set):

* trainer_wait_share: in the distillation run, the trainer's time starved
  while the teacher was busy (waiting for the teacher), over the trainer's
  time from its first step to its last.
* distill_steps_to_rl120: the first evaluation step at which distillation
  alone (`examples/distill.toml`) reaches the held-out accuracy that RL alone
  (the default run) reaches at step 120.

The runs: the default run (120 steps; or `--rl RUN_DIR`, a finished one),
distillation alone and distillation mixed half and half with RL (60 steps,
evaluated every 5). Ends with

    RESULT teacher trainer_wait_share=W topk_cost_ratio=C distill_steps_to_rl120=S

Targets: W <= 0.05, C <= 1.3, S <= 40 (a third of 120); memory <= 1.1x.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parent.parent
DISTILL = ROOT / "examples" / "distill.toml"
DEFAULT = ROOT / "rlflow" / "defaults" / "default.toml"


# -- scoring cost ---------------------------------------------------------------------------


VOCAB = 32_000


def wide_models(folder: pathlib.Path) -> tuple[str, str]:
    """A student and a teacher of the default model's shape with a
    32,000-token vocabulary (random weights; a character tokenizer over
    32,000 characters, for vLLM)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from rlflow.models import SPECIAL, build_tokenizer

    tokenizer = build_tokenizer("".join(chr(0x100 + i) for i in range(VOCAB - len(SPECIAL))))
    paths = []
    for name, seed in (("student", 1), ("teacher", 2)):
        path = folder / f"wide-{name}"
        if not (path / "config.json").exists():
            torch.manual_seed(seed)
            config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=256, intermediate_size=1024,
                                 num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
                                 max_position_embeddings=512, tie_word_embeddings=False,
                                 eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                                 torch_dtype="float32", architectures=["Qwen2ForCausalLM"])
            Qwen2ForCausalLM(config).save_pretrained(path)
            tokenizer.save_pretrained(path)
        paths.append(str(path))
    return paths[0], paths[1]


def samples_like_the_default(n: int, seed: int = 0) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """`n` prompts and responses of the default run's lengths (prompts of 8-20
    tokens, responses lognormal around 30, at most 100), random tokens: the
    cost of scoring does not depend on which."""
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(3, VOCAB, k).astype(np.int32) for k in rng.integers(8, 21, n)]
    lengths = np.clip(rng.lognormal(np.log(30), 0.6, n).astype(int), 4, 100)
    responses = [rng.integers(3, VOCAB, k).astype(np.int32) for k in lengths]
    return prompts, responses


def scoring_cost(teacher: str, repeats: int, with_vllm: bool) -> dict[str, float]:
    """Milliseconds per response token: torch sampled-token and top-32 (one
    thread), and vLLM's sampled-token and top-32 (its engine's threads)."""
    import torch

    from rlflow.services.teacher.torch_engine import load_teacher, score_sequences

    torch.set_num_threads(1)
    prompts, responses = samples_like_the_default(256)
    tokens = sum(len(r) for r in responses)
    model = load_teacher(teacher)

    def timed(top_k: int) -> float:
        times = []
        for _ in range(repeats):
            started = time.perf_counter()
            scores = score_sequences(model, prompts, responses, temperature=1.0, top_k=top_k, batch_tokens=8192)
            times.append(time.perf_counter() - started)
            if scores.failed:
                raise RuntimeError(f"scoring failed: {next(iter(scores.failed.values()))}")
        return 1000 * statistics.median(times) / tokens

    timed(0)  # warm up
    out = {}
    # Interleaved, so that both see the same load on a shared machine.
    pairs = [(timed(0), timed(32)) for _ in range(3)]
    out["sampled"] = statistics.median(p[0] for p in pairs)
    out["top32"] = statistics.median(p[1] for p in pairs)
    out["ratio"] = statistics.median(p[1] / p[0] for p in pairs)
    if with_vllm:
        out["vllm_sampled"] = vllm_cost(teacher, prompts, responses, 0) * 1000 / tokens
        out["vllm_top32"] = vllm_cost(teacher, prompts, responses, 32) * 1000 / tokens
    return out


def vllm_cost(teacher: str, prompts, responses, top_k: int) -> float:
    """Seconds for vLLM's prompt log-probabilities (with the top `top_k`) to
    score the samples (after a warm-up)."""
    import trio

    from rlflow import config as C
    from rlflow.protocol import FinishReason, PromptGroup, Response, build_batch
    from rlflow.services.base import standalone_context
    from rlflow.services.teacher.vllm_engine import VllmTeacherEngine

    config = C.load(DISTILL, [f'roles.teacher.engine.model="{teacher}"', 'roles.teacher.engine.backend="vllm"',
                              f"roles.teacher.engine.top_k={top_k}", 'roles.rollout.model="/unused"',
                              'roles.trainer.engine.distill="topk"' if top_k
                              else 'roles.trainer.engine.distill="sampled"'])
    groups = [(PromptGroup(group_id=i, prompt_ids=p.tolist(), n=1),
               [Response(r, np.zeros(len(r), np.float32), np.zeros(len(r), np.int32), FinishReason.STOP)])
              for i, (p, r) in enumerate(zip(prompts, responses))]
    batch = build_batch(groups)

    async def measure() -> float:
        engine = VllmTeacherEngine(config.roles.teacher.engine, standalone_context(config, "teacher"))
        await engine.start()
        try:
            await engine.score(batch)
            started = time.perf_counter()
            scores = await engine.score(batch)
            if scores.failed:
                raise RuntimeError(f"vLLM scoring failed: {next(iter(scores.failed.values()))}")
            return time.perf_counter() - started
        finally:
            engine.backend.close()

    return trio.run(measure)


# -- memory -------------------------------------------------------------------------------

MEMORY_CHILD = r"""
import json, resource, sys
import msgspec, numpy as np, torch
sys.path.insert(0, sys.argv[3])
from teacher import samples_like_the_default
from rlflow.config import TorchTrainer
from rlflow.protocol import FinishReason, PromptGroup, Response, Tensor, build_batch
from rlflow.services.teacher.torch_engine import load_teacher, score_sequences
from rlflow.services.trainer.torch_engine import TorchEngine

torch.set_num_threads(1)
policy, teacher, variant = sys.argv[1], sys.argv[2], sys.argv[4]
prompts, responses = samples_like_the_default(256)
groups = [(PromptGroup(group_id=g, prompt_ids=prompts[8 * g].tolist(), n=8),
           [Response(responses[8 * g + i], np.zeros(len(responses[8 * g + i]), np.float32),
                     np.zeros(len(responses[8 * g + i]), np.int32), FinishReason.STOP) for i in range(8)])
          for g in range(32)]
batch = build_batch(groups)
rows_prompts = [p for g in range(32) for p in [prompts[8 * g]] * 8]
model = load_teacher(teacher)
scores = score_sequences(model, rows_prompts, responses, temperature=1.0, top_k=32, batch_tokens=8192)
assert not scores.failed, scores.failed
del model
rng = np.random.default_rng(0)
batch = msgspec.structs.replace(
    batch, rewards=Tensor.from_numpy((rng.random(256) < 0.5).astype(np.float32)),
    logprobs=Tensor.from_numpy(scores.logprobs - 0.1),
    teacher_logprobs=Tensor.from_numpy(scores.logprobs),
    teacher_topk_ids=Tensor.from_numpy(scores.topk_ids),
    teacher_topk_logprobs=Tensor.from_numpy(scores.topk_logprobs))
cfg = TorchTrainer(lr=1e-4) if variant == "grpo" else TorchTrainer(lr=1e-4, distill_coef=1.0, distill="topk")
engine = TorchEngine(cfg, policy)
with open("/proc/self/statm") as f:
    before = int(f.read().split()[1]) * resource.getpagesize() // 1024  # resident now, before any step
for _ in range(3):
    engine.train(batch)
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"peak_kib": peak, "before_kib": before}))
"""


def memory(policy: str, teacher: str) -> dict[str, float]:
    """Peak resident memory (KiB) of a trainer process over steps of plain
    GRPO and of top-k distillation, each in a fresh process."""
    out = {}
    for variant in ("grpo", "topk"):
        done = subprocess.run([sys.executable, "-c", MEMORY_CHILD, policy, teacher, str(ROOT / "bench"), variant],
                              capture_output=True, text=True, timeout=900, cwd=ROOT)
        if done.returncode != 0:
            raise RuntimeError(f"the {variant} memory probe failed:\n{done.stderr[-3000:]}")
        figures = json.loads(done.stdout.strip().splitlines()[-1])
        out[variant] = figures["peak_kib"]
        out[f"{variant}_steps"] = figures["peak_kib"] - figures["before_kib"]
    return out


# -- the runs ---------------------------------------------------------------------------------


def run_config(path: pathlib.Path, run_dir: pathlib.Path, overrides: list[str]) -> pathlib.Path:
    """`rlflow up` of a config, in the foreground; its run directory (a
    finished run already there is taken as it is)."""
    if (run_dir / "summary.json").exists() and json.loads((run_dir / "summary.json").read_text())["state"] == "stopped":
        print(f"  {run_dir.name}: done before", file=sys.stderr)
        return run_dir
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "rlflow", "up", "--config", str(path), "--run-dir", str(run_dir),
                           "--no-display", *[a for o in overrides for a in ("--set", o)]],
                          capture_output=True, text=True, cwd=ROOT)
    if done.returncode != 0:
        raise RuntimeError(f"{path.name} failed:\n{done.stderr[-3000:]}")
    print(f"  {run_dir.name}: {time.monotonic() - started:.0f} s", file=sys.stderr)
    return run_dir


def curve(run_dir: pathlib.Path) -> list[tuple[int, float, float]]:
    """(step, held-out accuracy, seconds since the run started) of each evaluation."""
    from rlflow.rundir import RunDir

    folder = RunDir(run_dir)
    rows = folder.read_metrics()
    at = {r.step + 1: r.time_s for r in rows}
    return [(e.step, e.accuracy, at.get(e.step, 0.0)) for e in folder.read_evals() if e.accuracy is not None]


def wait_share(run_dir: pathlib.Path) -> float:
    """The trainer's time starved while a teacher replica was busy, over its
    time from its first busy moment to its last event."""
    from rlflow.tools.report import load

    run = load(run_dir)
    traces = {(t["role"], t["rank"]): t["events"] for t in run.traces}
    trainer = traces[("trainer", 0)]
    start = next(t for t, state in trainer if state == "busy")
    end = trainer[-1][0]

    def spans(events, state):
        return [(max(a, start), min(b, end)) for (a, s), (b, _) in zip(events, events[1:]) if s == state and b > a]

    teacher_busy = sorted(s for (role, _), events in traces.items() if role == "teacher" for s in spans(events, "busy"))
    merged: list[list[float]] = []
    for a, b in teacher_busy:
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        elif b > a:
            merged.append([a, b])
    waited = 0.0
    for a, b in spans(trainer, "starved"):
        for c, d in merged:
            waited += max(0.0, min(b, d) - max(a, c))
    return waited / (end - start)


def steps_to_reach(points: list[tuple[int, float, float]], target: float) -> int | None:
    return next((step for step, accuracy, _ in points if step > 0 and accuracy >= target), None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rl", type=pathlib.Path, help="a finished default run to take RL alone from")
    parser.add_argument("--work", type=pathlib.Path, help="where the runs go (default: a temporary folder)")
    parser.add_argument("--steps", type=int, default=60, help="steps of the distillation runs")
    parser.add_argument("--no-mixed", action="store_true", help="leave out the mixed run")
    parser.add_argument("--no-vllm", action="store_true", help="leave out the vLLM backend's scoring rate")
    args = parser.parse_args()

    from rlflow.tools.cli import build_model

    build_model(force=False)
    work = args.work or pathlib.Path(tempfile.mkdtemp(prefix="rlflow-teacher-"))
    work.mkdir(parents=True, exist_ok=True)

    student_wide, teacher_wide = wide_models(work)
    cost = scoring_cost(teacher_wide, repeats=3, with_vllm=not args.no_vllm)
    line = f"scoring, ms per response token: torch sampled {cost['sampled']:.2f}, torch top-32 {cost['top32']:.2f}"
    if "vllm_top32" in cost:
        line += f"; vLLM sampled {cost['vllm_sampled']:.2f}, vLLM top-32 {cost['vllm_top32']:.2f}"
    print(line)
    peaks = memory(student_wide, teacher_wide)
    print(f"trainer peak memory: GRPO {peaks['grpo'] / 1024:.0f} MiB, "
          f"top-k distillation {peaks['topk'] / 1024:.0f} MiB "
          f"({peaks['topk'] / peaks['grpo']:.3f}x); of which the steps added {peaks['grpo_steps'] / 1024:.0f} and "
          f"{peaks['topk_steps'] / 1024:.0f} MiB ({peaks['topk_steps'] / max(peaks['grpo_steps'], 1):.2f}x)")

    print("runs:", file=sys.stderr)
    rl = args.rl or run_config(DEFAULT, work / "rl", [])
    distill = run_config(DISTILL, work / "distill", [f"run.steps={args.steps}"])
    runs = {"RL alone": rl, "distillation": distill}
    if not args.no_mixed:
        runs["mixed 0.5"] = run_config(DISTILL, work / "mixed", [f"run.steps={args.steps}",
                                                                   "roles.trainer.engine.distill_coef=0.5"])
    # The teacher's own held-out accuracy: a run of one step that evaluates it first.
    teacher_path = str(build_model(force=False, name="default-teacher"))
    teacher_eval = run_config(DEFAULT, work / "teacher-eval", [f'roles.rollout.model="{teacher_path}"', "run.steps=1",
                                                                "eval.every_steps=0", "eval.after=false"])
    teacher_accuracy = curve(teacher_eval)[0][1]
    curves = {name: curve(folder) for name, folder in runs.items()}
    for name, points in curves.items():
        print(f"{name:>13}: " + ", ".join(f"{step}: {100 * acc:.1f}% ({t:.0f} s)" for step, acc, t in points))
    rl120 = next(acc for step, acc, _ in curves["RL alone"] if step == 120)
    steps = steps_to_reach(curves["distillation"], rl120)
    share = wait_share(distill)
    print(f"the teacher's held-out accuracy: {100 * teacher_accuracy:.1f}%")
    print(f"RL alone at step 120: {100 * rl120:.1f}%; distillation reaches it at step {steps}")
    print(f"runs in {work}")
    print(f"RESULT teacher trainer_wait_share={share:.3f} topk_cost_ratio={cost['ratio']:.2f} "
          f"distill_steps_to_rl120={steps if steps is not None else 'none'}")


if __name__ == "__main__":
    main()
