"""Side by side with the peer: rlflow `sync`, the shipped default and TRL's GRPOTrainer.

The same model (the embedded default's; on a reasoning-gym dataset given
with `--task`, the one `rlflow model build --task` builds for it, and the
dataset's own verifier as the reward in all three), task stream (each
seed's prompts, in the order rlflow grants them), held-out set, batch (32 prompts x 8
samples), sampling (temperature 1, top-p 1, 100 tokens), optimizer (AdamW
at rlflow's lr and betas, no weight decay, the gradient's norm clipped at
1.0), schedule (rlflow's shape, over the steps each trainer makes in the
`--peer-time` budget: the default's as many as its pace fits in it, measured
first by a run of its shipped steps, `--default-budget`; sync's the
default's; the peer's however many it makes, `--peer-schedule`, and
lockstep's as many as the peer's) and loss (the clipped surrogate at 0.2 /
0.28, no KL, summed over tokens over every response token of the batch) in
every trainer, one run at a time with nothing else running, each seed. The
peer in the configuration a TRL user picks (`--peer-generation`,
`--peer-precision`; docs/benchmarks.md lists what each gave):

    peer     Hugging Face TRL's GRPOTrainer (`bench/peer_trl.py`, in the
             virtual environment `make peer` makes): transformers `generate`,
             fully on-policy, in one process
    lockstep rlflow, run.mode = "sync", step for step with the peer: the steps
             the peer made on that seed, its schedule over them
    sync     rlflow, run.mode = "sync" (a barrier per step: on-policy), the
             default's steps and schedule
    default  rlflow's embedded default as it ships (async, max_staleness 1)

What cannot match, and why (docs/benchmarks.md lists them too): TRL
generates with transformers and trains in the same process, one after the
other, on every core; rlflow generates with vLLM on its own pool and trains
on another. TRL's group standard deviation is the sample one (n - 1) plus
1e-4, rlflow's the population one plus 1e-6 (advantages 7% smaller in
TRL's groups of 8). Mixed precision is each one's own: TRL's `bf16`
(autocast) where rlflow's `mixed_precision = "auto"` turns bf16 passes on,
float32 elsewhere; rlflow's vLLM generates in bf16 on such a CPU too (the
default's rollout `dtype = "auto"`), TRL's `generate` under its autocast.

Accuracy: nothing is evaluated while anything trains. Each trainer writes
its weights at marks (every `--every` steps; the peer also at every
`--time-every` seconds of training, the weights it held then), and after
the runs each is evaluated on the 1,000 held-out problems, greedily, by
rlflow's vLLM evaluator (`bench/learning.py`'s): one evaluator for all
three, each reading one policy version. Clocks count training only (from
the first step's start; engine start-up and the marks' writing excluded).

Writes `bench/results/peer[-TAG][-TASK].{json,md,png}` and ends with one
line per task (`--task`, comma-separated; the default task's name is
"default"):

    RESULT peer task=NAME sync_vs_peer_points=A async_vs_sync_points=D time_to_peer_ratio=R
        time_to_peer_ratio_high=H peer_samples_per_s=P samples_per_s=S      (one line)

A: rlflow's held-out accuracy minus the peer's, step for step: lockstep's
(its schedule over the steps the peer made, as the peer's spans them) at
every step mark of the peer's run, the worst (means over seeds; without
lockstep, sync's, whose schedule spans the default's steps, so that A holds
the schedules' difference too); D: the default's minus sync's at every
step mark of the default's run (worst); R: the default's wall time to the peer's
accuracy at `--peer-time` seconds of training (the first of its marks whose
mean over seeds reaches it), over `--peer-time`; H: the upper end of R's
90% bootstrap interval over seeds (`ratio_high`; "na" where a draw never
reaches it); P, S: the peer's and the default's samples per second.
Targets: A >= -1.5, D >= -1.5, H <= 0.5.

Before it, A and D read again over the training reward (printed, not in the RESULT line): the mean
reward of the samples each trainer drew over the `--mark-every` steps to each mark, drawn by the
policies after the steps before them (the default's up to one version older, and taken in the order
they finished), from the same prompts in the same order (`reward_at`). And both readings of A and D
against what the seeds' spread alone gives (`sign_flips`): the worst mark read again with the signs of the
seeds' difference curves flipped, every way, each as likely as the reading were neither trainer ahead.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import math
import pathlib
import shutil
import statistics
import subprocess
import time
from collections.abc import Callable, Sequence

import learning  # bench/learning.py (bench/ is on the import path of a script run from it)

from rlflow.models import cpu_name

ROOT = learning.ROOT
RESULTS = learning.RESULTS
RUNS = ROOT / "runs" / "peer"
PEER_PYTHON = ROOT / ".venv-peer" / "bin" / "python"
SYSTEMS = ("peer", "lockstep", "sync", "default")
#: rlflow's variant (bench/learning.py) of each rlflow system.
VARIANT = {"lockstep": "sync", "sync": "sync", "default": "default"}
TARGETS = {"A": -1.5, "D": -1.5, "R": 0.5}
#: With its schedule over its time budget, the prompts the peer is given: this many times the
#: schedule's steps (it stops at the end of its budget: 89-100 steps in 420 s on the default task, 1.2-2.7 s a
#: step on spell_backward).
PEER_STEPS_OVER = 5


# -- running -------------------------------------------------------------------------------


def default_config(seed: int, task: str = "default", overrides: Sequence[str] = ()):
    """The embedded default with `seed` and `overrides` (`--set`): on its own task, or (`rlflow up
    --task`) on the reasoning-gym dataset `task` with the model built for it."""
    from rlflow import config as C
    from rlflow.taskmodel import task_config

    if task == "default":
        return C.load(C.default_config_path(), [f"run.seed={seed}", *overrides])
    return task_config(task, [f"run.seed={seed}", 'roles.rollout.model="task"', *overrides])


def peer_plan(seed: int, args, folder: pathlib.Path) -> dict:
    """What the peer needs: the model, the prompts in rlflow's order, and rlflow's settings."""
    import torch

    from rlflow.control.launch import resolve
    from rlflow.services.fsdp import bf16_passes
    from rlflow.tasks.core import load_tokenizer, make_task

    config = resolve(default_config(seed, args.task, args.set))
    model = config.roles.rollout.model
    tokenizer = load_tokenizer(model)
    task = make_task(config, tokenizer)
    trainer, rollout, run = config.roles.trainer.engine, config.roles.rollout.engine, config.run
    horizon = trainer.lr_decay_steps or run.steps
    # Over its time budget, the peer's schedule spans the steps it makes in it, however many.
    by_time = args.peer_schedule == "time"
    max_steps = max(horizon * PEER_STEPS_OVER, args.steps) if by_time else horizon
    groups = range(max_steps * run.batch_size)
    prompts = [task.prompt_text(g) for g in groups]
    return {
        "out": str(folder), "model": model, "seed": seed, "threads": args.peer_threads,
        "task": args.task, "prompts": prompts, "answers": [task.prompt(g, 1).reference for g in groups],
        "rows": [json.dumps(dict(task.row(g))) for g in groups],
        # The token ids rlflow's rollout is given (not the text encoded again): TRL's must be these.
        "prompt_ids": [list(map(int, task.prompt(g, 1).prompt_ids)) for g in groups[:8]],
        "batch_size": run.batch_size, "samples_per_prompt": run.samples_per_prompt,
        "accumulation": args.peer_accumulation,
        "max_tokens": rollout.max_tokens, "temperature": rollout.temperature, "top_p": rollout.top_p,
        "lr": trainer.lr, "betas": list(trainer.betas), "weight_decay": trainer.weight_decay,
        "grad_clip": trainer.grad_clip, "clip_low": trainer.clip_low, "clip_high": trainer.clip_high,
        "warmup_steps": trainer.warmup_steps, "lr_decay": trainer.lr_decay, "lr_final": trainer.lr_final,
        "lr_decay_steps": horizon, "max_steps": max_steps, "schedule_s": args.peer_time if by_time else 0,
        "bf16": (bf16_passes(trainer.mixed_precision, torch.device("cpu")) if args.peer_precision == "auto"
                 else args.peer_precision == "bf16"),
        "generation": args.peer_generation,
        "every": args.every, "time_marks": list(range(args.time_every, args.peer_time + 1, args.time_every)),
        # Over its time budget the peer stops at its end; over --horizon steps, once it has made --steps too.
        "min_steps": 0 if by_time else args.steps, "min_time_s": args.peer_time,
    }


def run_peer(seed: int, args, folder: pathlib.Path) -> None:
    """TRL's run of `seed` into `folder` (its weights at the marks, its per-step log)."""
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    plan = peer_plan(seed, args, folder)
    (folder / "plan.json").write_text(json.dumps(plan))
    # The evaluator reads the run's config: the default's (on the task), with this seed.
    from rlflow import config as C

    config = default_config(seed, args.task, args.set)
    (folder / "config.toml").write_text(C.to_toml(C.load(text=C.to_toml(config), overrides=[
        f'roles.rollout.model="{plan["model"]}"'])))
    print(f"[peer] peer seed {seed}: TRL's GRPOTrainer ({args.peer_generation}, {args.peer_precision}), "
          f"{args.peer_time} s of training", flush=True)
    started = time.monotonic()
    with open(folder.parent / f"{folder.name}.log", "w") as log:
        done = subprocess.run([str(PEER_PYTHON), str(ROOT / "bench" / "peer_trl.py"), str(folder / "plan.json")],
                              stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, timeout=args.timeout)
    if done.returncode != 0:
        raise RuntimeError(f"the peer's seed {seed} failed (exit {done.returncode}); see {folder}.log")
    print(f"[peer] peer seed {seed}: done in {time.monotonic() - started:.0f} s", flush=True)


def run_rlflow(system: str, seed: int, args, folder: pathlib.Path) -> None:
    if system == "lockstep":
        steps = horizon = peer_steps(folder.parent / f"peer-s{seed}")
    else:
        steps = args.steps if system == "sync" else args.default_steps_now
        horizon = args.horizon or args.default_steps_now
    extra = [*args.set, *(args.default_set if system == "default" else []),
             f"roles.trainer.engine.lr_decay_steps={horizon}"]
    learning.run_one(VARIANT[system], seed, steps, args.every, extra, folder, args.timeout,
                     task="" if args.task == "default" else args.task)


def peer_steps(folder: pathlib.Path) -> int:
    """The steps the peer's run in `folder` made (lockstep makes as many, its schedule over them)."""
    done = folder / "done.json"
    if not done.exists():
        raise RuntimeError(f"lockstep runs the peer's steps, and the peer has no finished run in {folder}: "
                           "run the peer first (--systems peer,lockstep)")
    return int(json.loads(done.read_text())["steps"])


def budget_steps(args, runs: pathlib.Path) -> int:
    """The steps the default makes in `--peer-time` seconds of training (a multiple of `--every`): its
    pace read from a run of its shipped steps (seed 0, no marks, into `runs`/pace)."""
    folder = runs / "pace"
    shipped = default_config(0, args.task, args.set).run.steps
    if not (args.reuse and (folder / "metrics.jsonl").exists()):
        learning.run_one(VARIANT["default"], 0, shipped, shipped, [*args.set, *args.default_set], folder,
                         args.timeout, task="" if args.task == "default" else args.task)
    metrics = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines() if line.strip()]
    pace = metrics[-1]["time_s"] / len(metrics)
    steps = max(args.every, args.every * int(args.peer_time / pace / args.every))
    print(f"[peer] the default's pace on {args.task}: {pace:.3f} s a step ({len(metrics)} steps): "
          f"{steps} steps in {args.peer_time} s", flush=True)
    return steps


# -- reading -------------------------------------------------------------------------------


def read_peer(folder: pathlib.Path) -> dict:
    """The peer's curve by steps and its accuracy at each time mark."""
    steps = [json.loads(line) for line in (folder / "steps.jsonl").read_text().splitlines() if line.strip()]
    marks = {m["name"]: m for m in map(json.loads, (folder / "marks.jsonl").read_text().splitlines())}
    ended = {s["step"]: s["time_s"] for s in steps if s.get("time_s") is not None}
    start = learning.read_heldout(folder, "step")[0]["accuracy"]
    curve = [{"step": r["step"], "time_s": ended.get(r["step"], 0.0), "accuracy": r["accuracy"]}
             for r in learning.read_heldout(folder, "step")]
    timed = {r["time_mark"]: r["accuracy"] for r in learning.read_heldout(folder, "time")}
    at_time = {}
    for name, mark in marks.items():
        if name.startswith("time-"):
            t = int(name.split("-")[1])
            at_time[t] = timed.get(t, start) if mark["path"] else start
    done = json.loads((folder / "done.json").read_text())
    batch = json.loads((folder / "plan.json").read_text())
    samples = batch["batch_size"] * batch["samples_per_prompt"] * done["steps"]
    return {
        "curve": curve, "at_time": at_time, "steps": done["steps"], "time_s": done["train_s"],
        "samples_per_s": samples / done["train_s"],
        "grad_norm": statistics.fmean(s["grad_norm"] for s in steps if "grad_norm" in s),
        "reward": [s.get("reward") for s in steps if "reward" in s],
    }


def read_rlflow(folder: pathlib.Path) -> dict:
    run = learning.read_run(folder)
    run["at_time"] = {}
    return run


def accuracy_at_time(curve: list[dict], t: float) -> float:
    """The accuracy of the last evaluated policy that a run held at `t` seconds (its marks by step)."""
    held = [p for p in curve if p["time_s"] <= t]
    return held[-1]["accuracy"] if held else curve[0]["accuracy"]


# -- summarising ---------------------------------------------------------------------------


def mean_at(runs: list[dict], step: int) -> float | None:
    points = [next((p["accuracy"] for p in r["curve"] if p["step"] == step), None) for r in runs]
    return statistics.fmean(points) if points and None not in points else None


def reward_at(runs: list[dict], step: int, width: int) -> float | None:
    """The training reward of steps `step - width + 1` to `step` (the samples those steps trained on, drawn
    by the policies after steps `step - width` to `step - 1`), mean over the seeds; None where a run has not
    made those steps or logged no reward in one."""
    windows = [r["reward"][step - width:step] for r in runs]
    if any(len(w) < width or any(v is None or math.isnan(v) for v in w) for w in windows):
        return None
    return statistics.fmean(v for w in windows for v in w)


def summarise(results: dict[str, dict[int, dict]], args) -> dict:
    # Every mark of the whole run: each pair compared where both have evaluated (the peer stops at its budget).
    last = max((p["step"] for by_seed in results.values() for r in by_seed.values() for p in r["curve"]), default=0)
    marks = list(range(args.mark_every, last + 1, args.mark_every))
    time_marks = list(range(args.time_every, args.peer_time + 1, args.time_every))
    out: dict = {"marks": marks, "time_marks": time_marks, "systems": {}}
    for system, by_seed in results.items():
        runs = list(by_seed.values())
        mean = learning.mean_curve(runs)
        by_time = {}
        for t in time_marks:
            values = [r["at_time"][t] if t in r["at_time"] else accuracy_at_time(r["curve"], t) for r in runs]
            by_time[t] = {"accuracy": statistics.fmean(values), "low": min(values), "high": max(values)}
        out["systems"][system] = {
            "seeds": sorted(by_seed), "mean": mean, "at_steps": {m: mean_at(runs, m) for m in marks},
            "at_time": by_time,
            "reward_at": {m: reward_at(runs, m, args.mark_every) for m in marks},
            "samples_per_s": statistics.fmean(r["samples_per_s"] for r in runs),
            "seconds_per_step": statistics.fmean(r["time_s"] / r["steps"] for r in runs),
            "grad_norm": statistics.fmean(r["grad_norm"] for r in runs),
            "staleness_mean": statistics.fmean(r.get("staleness_mean", 0.0) for r in runs),
        }
    systems = out["systems"]

    def gap(a: str, b: str) -> float | None:
        """The worst of `a`'s held-out accuracy minus `b`'s over the marks both have, in points."""
        if a not in systems or b not in systems:
            return None
        pairs = [(systems[a]["at_steps"][m], systems[b]["at_steps"][m]) for m in marks]
        gaps = [x - y for x, y in pairs if x is not None and y is not None]
        return 100 * min(gaps) if gaps else None

    out["A_from"] = "lockstep" if "lockstep" in systems else "sync"
    out["A_sync"] = gap("sync", "peer")
    out["A"] = gap(out["A_from"], "peer")
    out["D"] = gap("default", "sync")
    out["mark_every"] = args.mark_every
    out["R"] = out["target"] = out["time_to_target_s"] = None
    if "peer" in systems and "default" in systems:
        target = systems["peer"]["at_time"][args.peer_time]["accuracy"]
        reached = learning.first_reaching(systems["default"]["mean"], target)
        out["target"] = target
        out["time_to_target_s"] = reached["time_s"] if reached else None
        out["R"] = reached["time_s"] / args.peer_time if reached else None
    out["H"] = ratio_high(results, args) if out["R"] is not None else None
    # What the seeds' spread alone makes of the worst mark (A and D read the worst of many noisy marks);
    # and A and D again over the training reward: the trainers draw the same prompts in the same order, so a
    # window compares the policies on the same problems (a held-out reading adds its own noise).
    window = functools.partial(reward_at, width=args.mark_every)
    out["A_noise"] = sign_flips(results, out["A_from"], "peer", marks)
    out["D_noise"] = sign_flips(results, "default", "sync", marks)
    out["A_reward_noise"] = sign_flips(results, out["A_from"], "peer", marks, window)
    out["D_reward_noise"] = sign_flips(results, "default", "sync", marks, window)
    out["P"] = systems["peer"]["samples_per_s"] if "peer" in systems else None
    out["S"] = systems["default"]["samples_per_s"] if "default" in systems else None
    return out


def sign_flips(results: dict[str, dict[int, dict]], a: str, b: str, marks: list[int],
               at: Callable[[list[dict], int], float | None] = mean_at) -> dict | None:
    """`a`'s reading `at` (held-out accuracy; or the training reward of a window) minus `b`'s, seed by seed
    (a seed's two runs saw the same prompts), at the marks every such seed of both has: the worst mark's mean
    over seeds and the mean over the marks, in points, against the same worst read with the seeds' difference
    curves' signs flipped, every way (a curve flipped whole, so its marks keep their correlation). Were
    neither system ahead, each way would be as likely as the one read: `null_worst` is their worst on the
    mean, `as_low` how many of the `ways` read a worst as low."""
    if a not in results or b not in results:
        return None
    seeds = sorted(set(results[a]) & set(results[b]))
    curves: list[list[float]] = []
    for m in marks:
        points = [(at([results[a][s]], m), at([results[b][s]], m)) for s in seeds]
        if seeds and all(x is not None and y is not None for x, y in points):
            curves.append([100 * (x - y) for x, y in points])
    if not curves:
        return None
    worsts = [min(statistics.fmean(sign * d for sign, d in zip(signs, at_mark)) for at_mark in curves)
              for signs in itertools.product((1, -1), repeat=len(seeds))]  # the reading itself first
    return {"worst": worsts[0], "mean": statistics.fmean(statistics.fmean(at_mark) for at_mark in curves),
            "marks": len(curves), "seeds": len(seeds), "null_worst": statistics.fmean(worsts),
            "as_low": sum(w <= worsts[0] + 1e-9 for w in worsts), "ways": len(worsts)}


def ratio_high(results: dict[str, dict[int, dict]], args, draws: int = 2000) -> float:
    """The upper end of R's 90% bootstrap interval: seeds drawn with replacement (a draw takes a seed's
    peer and default runs together: they saw the same prompts); a draw whose default never reaches its
    peer's accuracy counts as infinite."""
    import random

    seeds = sorted(set(results["peer"]) & set(results["default"]))
    rng = random.Random(0)
    ratios = []
    for _ in range(draws):
        drawn = [rng.choice(seeds) for _ in seeds]
        peers = [results["peer"][s] for s in drawn]
        target = statistics.fmean(r["at_time"][args.peer_time] if args.peer_time in r["at_time"]
                                  else accuracy_at_time(r["curve"], args.peer_time) for r in peers)
        reached = learning.first_reaching(learning.mean_curve([results["default"][s] for s in drawn]), target)
        ratios.append(math.inf if reached is None else reached["time_s"] / args.peer_time)
    ratios.sort()
    return ratios[min(len(ratios) - 1, math.ceil(0.95 * len(ratios)) - 1)]


def flip_readings(summary: dict) -> list[tuple[str, dict]]:
    """(label, `sign_flips`) of A and D, held-out then over the training reward, where read."""
    out = []
    for reading, suffix in (("held-out", "noise"), ("training reward", "reward_noise")):
        for key, label, against in (("A", summary["A_from"], "the peer"), ("D", "default", "sync")):
            if (n := summary[f"{key}_{suffix}"]) is not None:
                out.append((f"{reading}, {label} minus {against}", n))
    return out


def table(summary: dict) -> str:
    systems = summary["systems"]
    names = list(systems)

    def cell(p: dict | None) -> str:
        return "" if p is None else f"{100 * p['accuracy']:.1f} [{100 * p['low']:.1f}-{100 * p['high']:.1f}]"

    lines = ["Held-out accuracy (%) by step, mean over seeds [min-max]:", "",
             "| step | " + " | ".join(names) + " |", "|---:|" + "---:|" * len(names)]
    steps = sorted({p["step"] for s in systems.values() for p in s["mean"]})
    for step in steps:
        lines.append(f"| {step} | " + " | ".join(cell(next((p for p in s["mean"] if p["step"] == step), None))
                                                 for s in systems.values()) + " |")
    lines += ["", "Held-out accuracy (%) by seconds of training (the policy held then), mean over seeds [min-max]:",
              "", "| seconds | " + " | ".join(names) + " |", "|---:|" + "---:|" * len(names)]
    for t in summary["time_marks"]:
        lines.append(f"| {t} | " + " | ".join(cell(s["at_time"][t]) for s in systems.values()) + " |")
    width = summary["mark_every"]
    lines += ["", f"Training reward (%) of the {width} steps to each mark: the samples those steps trained on, "
              f"from the same prompts in the same order, drawn by the policies after the {width} steps before them "
              "(the default's up to one version older), mean over seeds:", "",
              "| steps | " + " | ".join(names) + " |", "|---:|" + "---:|" * len(names)]
    for m in summary["marks"]:
        values = [s["reward_at"][m] for s in systems.values()]
        if any(v is not None for v in values):
            lines.append(f"| {m - width + 1}-{m} | " + " | ".join("" if v is None else f"{100 * v:.1f}"
                                                                  for v in values) + " |")

    def fmt(x, spec=".1f"):
        return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)

    lines += ["", "| | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for label, key, spec in (("samples/s", "samples_per_s", ".1f"), ("seconds a step", "seconds_per_step", ".2f"),
                             ("gradient norm, mean", "grad_norm", ".2f"), ("staleness, mean", "staleness_mean", ".2f")):
        lines.append(f"| {label} | " + " | ".join(fmt(s[key], spec) for s in systems.values()) + " |")
    if noise := flip_readings(summary):
        lines += ["", "The worst mark against what the seeds' spread alone gives (`sign_flips`): every way of "
                  "flipping the signs of the seeds' difference curves, each as likely were neither ahead (points; "
                  "the training reward's marks are its windows):", "",
                  "| | marks | worst | mean over the marks | worst, flipped, on the mean | as low |",
                  "|---|---:|---:|---:|---:|---:|"]
        lines += [f"| {label} | {n['marks']} | {n['worst']:.1f} | {n['mean']:.1f} | {n['null_worst']:.1f} "
                  f"| {n['as_low']} of {n['ways']} |" for label, n in noise]
    return "\n".join(lines) + "\n"


def plot(results: dict[str, dict[int, dict]], summary: dict, path: pathlib.Path, title: str, peer_time: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 5), sharey=True)
    colours = {"peer": "#7f7f7f", "lockstep": "#17becf", "sync": "#1f77b4", "default": "#d62728"}
    labels = {"peer": "TRL GRPOTrainer (on-policy)", "lockstep": "rlflow sync, the peer's steps",
              "sync": "rlflow sync", "default": "rlflow default (async)"}
    for system, by_seed in results.items():
        mean = summary["systems"][system]["mean"]
        n = len(by_seed)
        label = f"{labels[system]} ({n} seed{'s' if n > 1 else ''})"
        axes[0].plot([p["step"] for p in mean], [100 * p["accuracy"] for p in mean], color=colours[system],
                     linewidth=2, label=label)
        if n > 1:
            axes[0].fill_between([p["step"] for p in mean], [100 * p["low"] for p in mean],
                                 [100 * p["high"] for p in mean], color=colours[system], alpha=0.15)
        if system == "peer":
            at_time = summary["systems"][system]["at_time"]
            xs = [0, *at_time]
            lows = [100 * mean[0]["accuracy"], *(100 * v["low"] for v in at_time.values())]
            highs = [100 * mean[0]["accuracy"], *(100 * v["high"] for v in at_time.values())]
            ys = [100 * mean[0]["accuracy"], *(100 * v["accuracy"] for v in at_time.values())]
        else:
            xs = [p["time_s"] for p in mean]
            ys, lows, highs = ([100 * p[k] for p in mean] for k in ("accuracy", "low", "high"))
        axes[1].plot(xs, ys, color=colours[system], linewidth=2, label=label)
        if n > 1:
            axes[1].fill_between(xs, lows, highs, color=colours[system], alpha=0.15)
    if summary.get("target") is not None:
        for ax in axes:
            ax.axhline(100 * summary["target"], color="grey", linestyle=":", linewidth=1)
        axes[1].axvline(peer_time, color="grey", linestyle=":", linewidth=1)
    learning.save_figure(fig, axes, ("step (32 prompts x 8 samples)", "seconds of training"), title, path)


# -- main ----------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="one seed (0)")
    parser.add_argument("--task", default="default",
                        help="comma-separated: 'default' (the embedded default's task) and reasoning-gym datasets, "
                             "each on the model `rlflow model build --task` builds for it (built first)")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated, of {', '.join(SYSTEMS)}")
    parser.add_argument("--steps", type=int, default=0,
                        help="steps sync runs (0: as many as the default): D is read at every mark of them")
    parser.add_argument("--default-steps", type=int, default=0,
                        help="steps the default runs (0: as --default-budget says)")
    parser.add_argument("--default-budget", choices=("time", "steps"), default="time",
                        help="with no --default-steps, the default runs the steps its pace fits in --peer-time "
                             "(time) or its shipped run.steps (steps)")
    parser.add_argument("--every", type=int, default=5, help="write the weights every this many steps")
    parser.add_argument("--mark-every", type=int, default=10, help="the step marks A and D are read at")
    parser.add_argument("--peer-time", type=int, default=420, help="seconds of the peer's training R is read at")
    parser.add_argument("--time-every", type=int, default=60, help="the peer's weights every this many seconds")
    parser.add_argument("--horizon", type=int, default=0,
                        help="steps rlflow's learning-rate schedule spans (0: the default's steps)")
    parser.add_argument("--peer-accumulation", type=int, default=1,
                        help="the peer's gradient accumulation steps per optimizer step (its micro-batches)")
    parser.add_argument("--peer-generation", choices=("padded", "continuous"), default="padded",
                        help="TRL's generation: transformers `generate` over a padded batch, or its continuous "
                             "batching (use_transformers_continuous_batching)")
    parser.add_argument("--peer-precision", choices=("auto", "float32", "bf16"), default="auto",
                        help="TRL's bf16 (autocast): auto as rlflow's trainer (bf16 passes where the CPU "
                             "multiplies bf16)")
    parser.add_argument("--peer-schedule", choices=("time", "steps"), default="time",
                        help="the peer's learning-rate schedule spans its --peer-time (the steps it makes in "
                             "it) or --horizon steps")
    parser.add_argument("--peer-threads", type=int, default=len(__import__("os").sched_getaffinity(0)))
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="an override for every system (the peer reads its trainer's settings from it; repeatable)")
    parser.add_argument("--default-set", action="append", default=[], metavar="KEY=VALUE",
                        help="an override for the default alone (repeatable): a variant of it to compare")
    parser.add_argument("--tag", default="")
    parser.add_argument("--reuse", action="store_true", help="keep runs already finished and evaluated")
    parser.add_argument("--timeout", type=float, default=3600.0)
    args = parser.parse_args()
    # In SYSTEMS' order, whatever the order given: lockstep runs the steps of the peer's run before it.
    systems = sorted(learning.chosen(parser, args.systems, SYSTEMS, "system"), key=SYSTEMS.index)
    if "peer" in systems and not PEER_PYTHON.exists():
        parser.error(f"the peer's environment is missing ({PEER_PYTHON}): run `make peer` first")
    seeds = [0] if args.quick else [int(s) for s in args.seeds.split(",")]
    args.steps_given = args.steps
    print(f"[peer] on {cpu_name()}", flush=True)
    lines = [run_task(task.strip(), seeds, systems, args) for task in args.task.split(",") if task.strip()]
    print("\n".join(lines))


def run_task(task: str, seeds: list[int], systems: list[str], args) -> str:
    """Every system and seed on `task` ("default": the embedded default's; else a reasoning-gym dataset,
    its model built first); the tables and plot written; its RESULT line."""
    args.task = task
    if task != "default":
        from rlflow.taskmodel import build_task_model, task_model_dir

        config = default_config(0, task, args.set)
        if not (task_model_dir(config) / "config.json").exists():
            print(f"[peer] building the model of {task}", flush=True)
            build_task_model(config)
    name = "peer" + (f"-{args.tag}" if args.tag else "") + ("" if task == "default" else f"-{task}")
    runs = RUNS / (args.tag or "default") / ("" if task == "default" else task)
    if args.default_steps:
        args.default_steps_now = args.default_steps
    elif args.default_budget == "time" and {"sync", "default"} & set(systems):
        args.default_steps_now = budget_steps(args, runs)
    else:
        args.default_steps_now = default_config(0, task, args.set).run.steps
    args.steps = args.steps_given or args.default_steps_now

    results: dict[str, dict[int, dict]] = {}
    for seed in seeds:
        for system in systems:
            folder = runs / f"{system}-s{seed}"
            if not (args.reuse and (folder / "heldout.jsonl").exists()):
                if system == "peer":
                    run_peer(seed, args, folder)
                else:
                    run_rlflow(system, seed, args, folder)
                learning.evaluate_in_child(folder, args.timeout)
            results.setdefault(system, {})[seed] = read_peer(folder) if system == "peer" else read_rlflow(folder)

    summary = summarise(results, args)
    summary["machine"] = cpu_name()
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps({"args": vars(args), "summary": summary, "runs": {
        s: {str(k): r for k, r in by_seed.items()} for s, by_seed in results.items()}}, indent=1))
    title = (f"the {'default task' if task == 'default' else task}, 32 x 8 a step, on {summary['machine']}")
    plot(results, summary, RESULTS / f"{name}.png", title, args.peer_time)
    text = table(summary)
    (RESULTS / f"{name}.md").write_text(f"# {title}\n\n{text}")
    print(text)
    if summary["A_sync"] is not None and "lockstep" in summary["systems"]:
        print(f"sync (its schedule over the default's steps) minus the peer, worst: {summary['A_sync']:.1f} points")
    for label, n in flip_readings(summary):
        print(f"{label}: worst {n['worst']:.1f} points of {n['marks']} marks, {n['mean']:.1f} on their mean; "
              f"with the {n['seeds']} seeds' curves' signs flipped ({n['ways']} ways, each as likely were neither "
              f"ahead) the worst reads {n['null_worst']:.1f} on the mean, as low in {n['as_low']} of {n['ways']}")
    if summary["target"] is not None:
        reached = summary["time_to_target_s"]
        print(f"the peer's accuracy at {args.peer_time} s: {100 * summary['target']:.1f}%; the default reaches it "
              + (f"at {reached:.0f} s" if reached is not None else "in none of its steps"))
    print(f"wrote {RESULTS / name}.{{json,md,png}}")

    def fmt(key: str, spec: str) -> str:
        return "na" if summary[key] is None or summary[key] == math.inf else format(summary[key], spec)

    return "RESULT peer " + " ".join([
        f"task={task}", f"sync_vs_peer_points={fmt('A', '.1f')}", f"async_vs_sync_points={fmt('D', '.1f')}",
        f"time_to_peer_ratio={fmt('R', '.2f')}", f"time_to_peer_ratio_high={fmt('H', '.2f')}",
        f"peer_samples_per_s={fmt('P', '.1f')}", f"samples_per_s={fmt('S', '.1f')}",
    ])


if __name__ == "__main__":
    main()
