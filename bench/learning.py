"""Learning per sample: held-out accuracy of sync, one-step and async training.

The default task (the embedded default config: vLLM on CPU generates, the
torch trainer learns, 32 prompts x 8 samples a step) from the same model,
run through `rlflow up` in each configuration, one run at a time:

    sync       run.mode = "sync"   (max_staleness 0, a barrier per step)
    one_step   run.mode = "one_step" (the async machinery with max_staleness 1)
    async-k1   run.mode = "async", max_staleness = 1 (the same as one_step)
    async-k2   run.mode = "async", max_staleness = 2 (the default)
    async-k4   run.mode = "async", max_staleness = 4
    async-k2-filter  async-k2 with run.filter = "signal" (dynamic sampling)
    async-k2-paced   async-k2 with run.credits = "paced" (only as far ahead as keeps the trainer fed)

each with several seeds (`run.seed`: prompts, sampling and training).

How accuracy is read. The runs evaluate nothing while they train: the
trainer writes a checkpoint every `--every` steps, and after the run each
checkpoint is evaluated on the task's 1,000 held-out problems, greedily, by
the rollout's own vLLM engine (`VllmEngine.complete`, as the rollout service
evaluates), its weights loaded through the rollout's own gloo update path.
So each reading belongs to exactly one policy version (an evaluation during
a run spans several: the rollout keeps loading new weights while it
answers) and no evaluation competes with the run for the CPU. What the run
pays is the checkpoint itself (weights and optimizer state written by the
trainer after it has offered the new weights); `checkpoint_s` in the table
says how much. Wall time at a checkpoint is the controller's `time_s` of
that step (from the first step's start, engine start-up excluded).

Per step, from `metrics.jsonl`: the training reward (its mean over steps
40-55, against the on-policy peer's), the share of samples in groups with
no signal (all rewards equal: what a filter of such groups would save), the
gradient norm, staleness.

Writes `bench/results/learning[-TAG].{json,md,png}` (every curve, a table,
accuracy against step and against wall time) and ends with

    RESULT learning async_vs_sync_points=D filter_speedup=F time_to_target_s=T samples_per_s=S

D: async-k2's held-out accuracy minus sync's at the last step (means over
seeds, in points); F: wall time to 60% held-out of async-k2 without the
no-signal group filter over with it (`async-k2-filter`, run.filter =
"signal"; "na" unless both ran and reached 60%);
T: wall time to 63% held-out of the shipped default (async-k2; the first
checkpoint where the mean over seeds reaches it); S: the default's samples
per second. Targets: D >= -1.5, T <= 210 s on a 2-core machine.

Wall times on a machine shared with other work are noisy; accuracy against
steps is what compares configurations.
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import shutil
import statistics
import subprocess
import sys
import threading
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
RUNS = ROOT / "runs" / "learning"

#: Each configuration compared: its `--set` overrides of the default config.
VARIANTS: dict[str, list[str]] = {
    "sync": ['run.mode="sync"', "run.max_staleness=0", 'run.filter="none"', 'run.credits="bound"'],
    "one_step": ['run.mode="one_step"', "run.max_staleness=1", 'run.filter="none"', 'run.credits="bound"'],
    "async-k1": ['run.mode="async"', "run.max_staleness=1", 'run.filter="none"', 'run.credits="bound"'],
    "async-k2": ['run.mode="async"', "run.max_staleness=2", 'run.filter="none"', 'run.credits="bound"'],
    "async-k4": ['run.mode="async"', "run.max_staleness=4", 'run.filter="none"', 'run.credits="bound"'],
    "async-k2-filter": ['run.mode="async"', "run.max_staleness=2", 'run.filter="signal"', 'run.credits="bound"'],
    "async-k2-paced": ['run.mode="async"', "run.max_staleness=2", 'run.filter="none"', 'run.credits="paced"'],
    "default": [],  # the embedded default as it ships
}
#: (without the filter, with it): the variants whose time to 60% gives filter_speedup.
FILTER: tuple[str, str] | None = ("async-k2", "async-k2-filter")
DEFAULT_VARIANT = "async-k2"
SYNC_VARIANT = "sync"
#: Held-out accuracy targets (fractions): filter_speedup at the first, time_to_target_s at the second.
TARGET_FILTER, TARGET = 0.60, 0.63
#: Steps over which the training reward is compared with the on-policy peer's (0.559).
REWARD_WINDOW = (40, 55)


def chosen(parser: argparse.ArgumentParser, text: str, known, what: str) -> list[str]:
    """The comma-separated names of `text`, each one of `known` (a `what`), or the parser's error."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in known]
    if unknown:
        parser.error(f"unknown {what} {unknown[0]!r}: the {what}s are {', '.join(known)}")
    return names


# -- running ------------------------------------------------------------------------------


def run_one(variant: str, seed: int, steps: int, every: int, extra: list[str], folder: pathlib.Path,
            timeout_s: float, task: str = "") -> None:
    """`rlflow up` of the default config as `variant` with `seed` (on the reasoning-gym dataset `task`
    with its built model, `rlflow up --task`, where given), into `folder` (no evaluation during the
    run; a checkpoint every `every` steps)."""
    if folder.exists():
        shutil.rmtree(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    overrides = [*VARIANTS[variant], f"run.seed={seed}", f"run.steps={steps}",
                 f"roles.trainer.engine.checkpoint_every={every}",
                 "eval.before=false", "eval.after=false", "eval.every_steps=0", *extra]
    command = [sys.executable, "-m", "rlflow", "up", "--run-dir", str(folder), "--no-display",
               *(["--task", task] if task else [])]
    for o in overrides:
        command += ["--set", o]
    print(f"[learning] {variant} seed {seed}: rlflow up {' '.join(overrides)}", flush=True)
    started = time.monotonic()
    with open(folder.parent / f"{folder.name}.log", "w") as log:
        done = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, timeout=timeout_s)
    if done.returncode != 0:
        raise RuntimeError(f"{variant} seed {seed} failed (exit {done.returncode}); see {folder}.log")
    print(f"[learning] {variant} seed {seed}: done in {time.monotonic() - started:.0f} s", flush=True)


# -- evaluating checkpoints ------------------------------------------------------------------


def evaluate(folder: pathlib.Path) -> list[dict]:
    """Held-out accuracy of the starting weights and of every checkpoint of
    the run in `folder`, each on one engine holding exactly those weights;
    written to `heldout.jsonl` there (and the optimizer state of each
    checkpoint removed once read: only the weights are kept)."""
    import msgspec
    import torch
    import trio
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from rlflow import config as C
    from rlflow.data.net import free_port
    from rlflow.protocol import WeightsGloo
    from rlflow.rewards import open_pool
    from rlflow.rundir import TRAINER_OPTIMIZER
    from rlflow.services.base import standalone_context
    from rlflow.services.rollout.vllm_engine import VllmBackend, VllmEngine
    from rlflow.services.weights import GlooGroup, layout, pack
    from rlflow.tasks.core import load_tokenizer, make_task

    config = C.load(folder / "config.toml")
    base = config.roles.rollout.model
    # One evaluator for every run, whatever its rollout's dtype: the policy's float32 weights, greedily.
    cfg = msgspec.structs.replace(config.roles.rollout.engine, dtype="float32")
    task = make_task(config, load_tokenizer(base))
    prompts = task.heldout_prompts()
    # step-N (a run's, a peer's) and time-T (a peer's weights at T seconds of training).
    checkpoints = sorted(
        (folder / "checkpoints").glob("*-*"), key=lambda p: (p.name.split("-")[0], int(p.name.split("-")[1]))
    )
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    specs, nbytes = layout(model.named_parameters())

    backend = VllmBackend(cfg, base, config.run.seed)
    backend.start_blocking()
    port = free_port("127.0.0.1")
    box: dict = {}
    host = threading.Thread(target=lambda: box.setdefault("group", GlooGroup("127.0.0.1", port, 0, 2)))
    host.start()
    trio.run(backend.join_weights, "127.0.0.1", port, 1, 2)
    host.join()
    group = box["group"]
    joined = (WeightsGloo(host="127.0.0.1", port=port, world_size=2, rank=1, nbytes=nbytes), specs)
    engine = VllmEngine(cfg, standalone_context(config, "rollout"), backend, joined)

    async def heldout() -> dict[str, float]:
        responses: list = [None] * len(prompts)
        limit = trio.CapacityLimiter(engine.eval_concurrency)

        async def one(i: int) -> None:
            async with limit:
                responses[i] = await engine.complete(prompts[i], config.eval.temperature)

        async with trio.open_nursery() as nursery:
            for i in range(len(prompts)):
                nursery.start_soon(one, i)
        if not task.scored_by_functions:
            return task.heldout_metrics(responses)
        reward = config.roles.reward.engine  # a task of rows: its reward functions judge, as in a run
        async with open_pool(reward.functions, start_timeout_s=reward.start_timeout_s,
                             import_dir=config.run.import_dir) as pool:
            return await pool.pass_rate(task.heldout_samples(responses), config.eval.pass_reward)

    async def load(step: int, path: pathlib.Path) -> None:
        weights = load_file(path / "model.safetensors")
        missing = [s.name for s in specs if s.name not in weights]
        if missing:
            raise RuntimeError(f"{path} lacks {missing[:3]}")
        flat = pack(((s.name, weights[s.name]) for s in specs), specs, nbytes)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(trio.to_thread.run_sync, group.broadcast, flat)
            await engine.update_weights(step, None)

    rows = []
    try:
        for version, (name, path) in enumerate([("step-0", None), *((p.name, p) for p in checkpoints)]):
            started = time.monotonic()
            if path is not None:
                trio.run(load, version, path)
            metrics = trio.run(heldout)
            kind, number = name.split("-")
            rows.append({"checkpoint": name, "step" if kind == "step" else "time_mark": int(number), **metrics,
                         "eval_s": time.monotonic() - started})
            print(f"[learning]   {name:>10}: {100 * metrics['accuracy']:.1f}% held-out "
                  f"({time.monotonic() - started:.0f} s)", flush=True)
            if path is not None and (path / TRAINER_OPTIMIZER).exists():
                shutil.rmtree(path / TRAINER_OPTIMIZER)
    finally:
        group.close()
        backend.close()
    (folder / "heldout.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return rows


def evaluate_in_child(folder: pathlib.Path, timeout_s: float) -> None:
    """`evaluate` in a process of its own (vLLM's engine goes with it)."""
    done = subprocess.run([sys.executable, __file__, "--evaluate", str(folder)], cwd=ROOT, timeout=timeout_s)
    if done.returncode != 0 or not (folder / "heldout.jsonl").exists():
        raise RuntimeError(f"evaluating {folder} failed (exit {done.returncode})")


# -- reading a run ---------------------------------------------------------------------------


def read_run(folder: pathlib.Path) -> dict:
    """A finished, evaluated run: its curve (step, wall time, accuracy) and per-step statistics."""
    metrics = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines() if line.strip()]
    by_step = {m["step"] + 1: m for m in metrics}  # steps done after this row
    heldout = read_heldout(folder)
    curve = []
    for row in heldout:
        step = row["step"]
        curve.append({"step": step, "time_s": by_step[step]["time_s"] if step else 0.0,
                      "accuracy": row["accuracy"],
                      "digits": {k.split("_")[-1]: v for k, v in row.items() if k.startswith("accuracy.digits_")}})
    train = [m.get("train", {}) for m in metrics]
    last = metrics[-1]
    lo, hi = REWARD_WINDOW
    window = [m["reward_mean"] for m in metrics if lo <= m["step"] + 1 <= hi]
    ckpt = _checkpoint_seconds(folder)
    return {
        "curve": curve,
        "steps": len(metrics),
        "time_s": last["time_s"],
        "samples_per_s": sum(m["samples"] for m in metrics) / last["time_s"],
        "reward": [m["reward_mean"] for m in metrics],
        "reward_window": statistics.fmean(window) if window else math.nan,
        "no_signal_share": statistics.fmean(1 - t.get("mixed_sample_share", math.nan) for t in train),
        "no_signal": [1 - t.get("mixed_sample_share", math.nan) for t in train],
        "all_right_share": statistics.fmean(t.get("uniform_high_share", 0.0) for t in train),
        "all_wrong_share": statistics.fmean(t.get("uniform_low_share", 0.0) for t in train),
        "grad_norm": statistics.fmean(t.get("grad_norm", math.nan) for t in train),
        "clipped_share": statistics.fmean(t.get("clipped_share", math.nan) for t in train),
        "behaviour_weight_mean": statistics.fmean(t.get("behaviour_weight_mean", math.nan) for t in train),
        # Of the groups generated and decided, the share the signal filter dropped (0 without it).
        "filtered_share": _filtered_share(folder, metrics),
        "staleness_mean": statistics.fmean(m["staleness_mean"] for m in metrics),
        "staleness_max": max(m["staleness_max"] for m in metrics),
        "checkpoint_s": ckpt,
    }


def _filtered_share(folder: pathlib.Path, metrics: list[dict]) -> float:
    import tomllib

    batch_size = tomllib.loads((folder / "config.toml").read_text())["run"]["batch_size"]
    dropped = sum(m.get("train", {}).get("no_signal_groups", 0.0) for m in metrics)
    trained = batch_size * len(metrics)
    return dropped / (dropped + trained) if dropped + trained else 0.0


def _checkpoint_seconds(folder: pathlib.Path) -> float:
    """Seconds the trainer spent loading (its state while it copies each
    version's weights and writes each checkpoint): an upper bound on what
    the checkpoints cost the run."""
    events = json.loads((folder / "trace" / "trainer-0.json").read_text())["events"]
    return sum(b[0] - a[0] for a, b in zip(events, events[1:]) if a[1] == "loading")


def read_heldout(folder: pathlib.Path, kind: str = "step") -> list[dict]:
    """The evaluated checkpoints of the run in `folder` of one kind: "step" (step-N, the start
    included) or "time" (a peer's time-T)."""
    rows = [json.loads(line) for line in (folder / "heldout.jsonl").read_text().splitlines() if line.strip()]
    return [r for r in rows if r.get("checkpoint", "step-").startswith(f"{kind}-")]


def first_reaching(curve: list[dict], target: float) -> dict | None:
    return next((p for p in curve if p["accuracy"] >= target), None)


def mean_curve(runs: list[dict]) -> list[dict]:
    """The mean over seeds at each evaluated step (steps every run has)."""
    steps = sorted(set.intersection(*(set(p["step"] for p in r["curve"]) for r in runs)))
    out = []
    for step in steps:
        points = [next(p for p in r["curve"] if p["step"] == step) for r in runs]
        accs = [p["accuracy"] for p in points]
        out.append({"step": step, "time_s": statistics.fmean(p["time_s"] for p in points),
                    "accuracy": statistics.fmean(accs), "low": min(accs), "high": max(accs),
                    "sd": statistics.stdev(accs) if len(accs) > 1 else 0.0})
    return out


# -- reporting -------------------------------------------------------------------------------


def summarise(results: dict[str, dict[int, dict]]) -> dict[str, dict]:
    out = {}
    for variant, by_seed in results.items():
        runs = list(by_seed.values())
        mean = mean_curve(runs)
        reach = {t: first_reaching(mean, t) for t in (TARGET_FILTER, TARGET)}
        out[variant] = {
            "seeds": sorted(by_seed),
            "mean": mean,
            "final": mean[-1],
            "samples_per_s": statistics.fmean(r["samples_per_s"] for r in runs),
            "time_s": statistics.fmean(r["time_s"] for r in runs),
            "reward_window": statistics.fmean(r["reward_window"] for r in runs),
            "no_signal_share": statistics.fmean(r["no_signal_share"] for r in runs),
            "filtered_share": statistics.fmean(r.get("filtered_share", 0.0) for r in runs),
            "all_right_share": statistics.fmean(r.get("all_right_share", math.nan) for r in runs),
            "all_wrong_share": statistics.fmean(r.get("all_wrong_share", math.nan) for r in runs),
            "grad_norm": statistics.fmean(r["grad_norm"] for r in runs),
            "staleness_mean": statistics.fmean(r["staleness_mean"] for r in runs),
            "staleness_max": max(r["staleness_max"] for r in runs),
            "behaviour_weight_mean": statistics.fmean(r["behaviour_weight_mean"] for r in runs),
            "checkpoint_s": statistics.fmean(r["checkpoint_s"] for r in runs),
            **{f"time_to_{round(100 * t)}": (p["time_s"] if p else None) for t, p in reach.items()},
            **{f"step_to_{round(100 * t)}": (p["step"] if p else None) for t, p in reach.items()},
        }
    return out


def table(summary: dict[str, dict], results: dict[str, dict[int, dict]]) -> str:
    """The markdown tables: accuracy at each evaluated step (mean over seeds,
    min-max beside it), then time, throughput and training statistics."""
    steps = sorted({p["step"] for s in summary.values() for p in s["mean"]})
    lines = ["Held-out accuracy (%), mean over seeds [min-max]:", "",
             "| step | " + " | ".join(summary) + " |", "|---:|" + "---:|" * len(summary)]
    for step in steps:
        cells = []
        for s in summary.values():
            p = next((q for q in s["mean"] if q["step"] == step), None)
            cells.append(f"{100 * p['accuracy']:.1f} [{100 * p['low']:.1f}-{100 * p['high']:.1f}]" if p else "")
        lines.append(f"| {step} | " + " | ".join(cells) + " |")

    def fmt(x, spec=".0f"):
        return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)

    lines += ["", "| | " + " | ".join(summary) + " |", "|---|" + "---|" * len(summary)]
    rows = [
        ("seeds", lambda s: ",".join(map(str, s["seeds"]))),
        ("samples/s", lambda s: fmt(s["samples_per_s"], ".1f")),
        ("wall time of the run (s)", lambda s: fmt(s["time_s"])),
        (f"time to {round(100 * TARGET_FILTER)}% (s, step)",
         lambda s: f"{fmt(s['time_to_60'])} ({fmt(s['step_to_60'], 'd')})"),
        (f"time to {round(100 * TARGET)}% (s, step)",
         lambda s: f"{fmt(s['time_to_63'])} ({fmt(s['step_to_63'], 'd')})"),
        (f"training reward, steps {REWARD_WINDOW[0]}-{REWARD_WINDOW[1]}", lambda s: fmt(s["reward_window"], ".3f")),
        ("no-signal sample share (all right + all wrong)",
         lambda s: f"{fmt(s['no_signal_share'], '.2f')} "
                   f"({fmt(s['all_right_share'], '.2f')} + {fmt(s['all_wrong_share'], '.2f')})"),
        ("groups generated and dropped by the signal filter (share)", lambda s: fmt(s["filtered_share"], ".2f")),
        ("grad norm (mean)", lambda s: fmt(s["grad_norm"], ".2f")),
        ("staleness mean / max", lambda s: f"{fmt(s['staleness_mean'], '.2f')} / {fmt(s['staleness_max'])}"),
        ("behaviour weight mean", lambda s: fmt(s["behaviour_weight_mean"], ".3f")),
        ("trainer loading: publishes + checkpoints (s)", lambda s: fmt(s["checkpoint_s"], ".1f")),
    ]
    sync = summary.get(SYNC_VARIANT)
    if sync is not None:
        rows.append(("minus sync: mean over steps / worst step (points)", lambda s: _versus(s["mean"], sync["mean"])))
    for name, cell in rows:
        lines.append(f"| {name} | " + " | ".join(cell(s) for s in summary.values()) + " |")
    lines += ["", "Per seed, held-out accuracy (%) at the last step:", ""]
    for variant, by_seed in results.items():
        finals = ", ".join(
            f"seed {seed}: {100 * r['curve'][-1]['accuracy']:.1f}" for seed, r in sorted(by_seed.items())
        )
        lines.append(f"- {variant}: {finals}")
    return "\n".join(lines) + "\n"


def _versus(curve: list[dict], sync: list[dict]) -> str:
    """The gap in points to sync's mean curve, averaged over the evaluated
    steps after the first, and at its worst."""
    at = {p["step"]: p["accuracy"] for p in sync}
    gaps = [100 * (p["accuracy"] - at[p["step"]]) for p in curve if p["step"] and p["step"] in at]
    return f"{statistics.fmean(gaps):+.1f} / {min(gaps):+.1f}" if gaps else "-"


def plot(results: dict[str, dict[int, dict]], summary: dict[str, dict], path: pathlib.Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 5), sharey=True)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (variant, by_seed) in enumerate(results.items()):
        colour = colours[i % len(colours)]
        mean = summary[variant]["mean"]
        for ax, key in zip(axes, ("step", "time_s")):
            for run in by_seed.values():
                ax.plot([p[key] for p in run["curve"]], [100 * p["accuracy"] for p in run["curve"]],
                        color=colour, alpha=0.3, linewidth=0.8)
            ax.plot([p[key] for p in mean], [100 * p["accuracy"] for p in mean], color=colour, linewidth=2,
                    label=f"{variant} ({len(by_seed)} seed{'s' if len(by_seed) > 1 else ''})")
    for ax in axes:
        ax.axhline(100 * TARGET, color="grey", linestyle=":", linewidth=1)
    save_figure(fig, axes, ("step", "wall time (s), training only"), title, path)


def save_figure(fig, axes, xlabels: tuple[str, str], title: str, path: pathlib.Path) -> None:
    """Held-out accuracy against two x axes: labelled, titled, written to `path`, closed."""
    import matplotlib.pyplot as plt

    for ax, label in zip(axes, xlabels):
        ax.set_xlabel(label)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("held-out accuracy (%), greedy, 1,000 problems")
    axes[0].legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# -- main ------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="one seed (0)")
    parser.add_argument("--modes", default=",".join(v for v in VARIANTS if v != "default"),
                        help=f"comma-separated, of {', '.join(VARIANTS)}")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--every", type=int, default=10, help="checkpoint (and evaluate) every this many steps")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="an override for every variant (repeatable)")
    parser.add_argument("--tag", default="", help="names the runs' folder and the result files")
    parser.add_argument("--reuse", action="store_true", help="keep runs already finished and evaluated")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds a run may take")
    parser.add_argument("--evaluate", metavar="RUN_DIR", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.evaluate:
        evaluate(pathlib.Path(args.evaluate))
        return
    modes = chosen(parser, args.modes, VARIANTS, "mode")
    seeds = [0] if args.quick else [int(s) for s in args.seeds.split(",")]
    if args.steps % args.every:
        parser.error(f"--steps {args.steps} is not a multiple of --every {args.every}")
    name = "learning" + (f"-{args.tag}" if args.tag else "")
    runs = RUNS / (args.tag or "default")

    results: dict[str, dict[int, dict]] = {}
    for variant in modes:
        for seed in seeds:
            folder = runs / f"{variant}-s{seed}"
            if not (args.reuse and (folder / "heldout.jsonl").exists()):
                run_one(variant, seed, args.steps, args.every, args.set, folder, args.timeout)
                evaluate_in_child(folder, args.timeout)
            results.setdefault(variant, {})[seed] = read_run(folder)

    summary = summarise(results)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps({"args": vars(args), "summary": summary, "runs": {
        v: {str(s): r for s, r in by_seed.items()} for v, by_seed in results.items()}}, indent=1))
    title = f"default task, {args.steps} steps of 32 x 8" + (f", {' '.join(args.set)}" if args.set else "")
    plot(results, summary, RESULTS / f"{name}.png", title)
    text = table(summary, results)
    (RESULTS / f"{name}.md").write_text(f"# {title}\n\n{text}")
    print(text)

    def final(variant: str) -> float | None:
        return summary[variant]["final"]["accuracy"] if variant in summary else None

    d = (100 * (final(DEFAULT_VARIANT) - final(SYNC_VARIANT))
         if final(DEFAULT_VARIANT) is not None and final(SYNC_VARIANT) is not None else None)
    f = None
    if FILTER is not None and all(v in summary for v in FILTER):
        without, with_ = (summary[v]["time_to_60"] for v in FILTER)
        f = without / with_ if without and with_ else None
    default = summary.get(DEFAULT_VARIANT)
    t = default["time_to_63"] if default else None
    s = default["samples_per_s"] if default else None
    print(f"wrote {RESULTS / name}.{{json,md,png}}")
    print("RESULT learning " + " ".join([
        f"async_vs_sync_points={d:.1f}" if d is not None else "async_vs_sync_points=na",
        f"filter_speedup={f:.2f}" if f is not None else "filter_speedup=na",
        f"time_to_target_s={t:.0f}" if t is not None else "time_to_target_s=na",
        f"samples_per_s={s:.1f}" if s is not None else "samples_per_s=na",
    ]))


if __name__ == "__main__":
    main()
