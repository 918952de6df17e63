"""The mismatch-correction menu measured: held-out accuracy, the engine-trainer gap and the time a step
takes, for each correction, on the default task and on reasoning-gym tasks with their built models.

Each correction is a set of the trainer's keys (`roles.trainer.engine`, docs/training.md, *The gap
between engine and trainer*) over the embedded default, run through `rlflow up` one run at a time
and evaluated after the run checkpoint by checkpoint, as bench/learning.py does (its harness):

    none          the shipped default: PPO clipped around the behaviour policy, no weight
    tis           decoupled PPO, each token's weight truncated at 2 (TIS)
    icepop        tokens whose weight lies outside [0.5, 2] left out of the loss (IcePop)
    seq-mask      whole samples left out when their geometric-mean weight lies outside [0.5, 2]
    gspo          GSPO: the sample's geometric-mean ratio, clipped at 3e-4 / 4e-4, sequence-mean loss
    cispo         CISPO: the clipped ratio weighs each token's log-probability, no lower clip

and once more, on the default task, with the gap made large on purpose (`--mismatch`: the rollout
four versions ahead of the trainer at most, `run.max_staleness = 4`, at 3x the learning rate) for
`none` and for the correction that did best, or those of `--mismatch-corrections`: does a correction
keep a run learning where none stalls?

Writes `bench/results/corrections[-TAG].{json,md}` and ends with

    RESULT corrections best=NAME best_vs_default_points=B gap_p99=G collapse_kept=K

B: the best correction's held-out accuracy minus the default's (`none`) at the last mark (mean over
seeds, its worst task); G: the default's per-token p99 gap |log p_train - log p_rollout| (mean over
its steps, seeds and tasks); K: 1 if `none`'s mismatched run stalls (ends no more than 2 points
above its start) or collapses (falls 10 points or more below its start at some mark) and some
correction's keeps learning (never more than 2 points below the start, ending at least 2 above it
and no more than 2 below `none`'s end); else 0 ("na" without `--mismatch`).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics

import learning  # bench/learning.py (bench/ is on the import path of a script run from it)

ROOT = pathlib.Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
RUNS = ROOT / "runs" / "corrections"
ENGINE = "roles.trainer.engine"

#: Each correction: its overrides of the trainer's keys.
CORRECTIONS: dict[str, list[str]] = {
    "none": [],
    "tis": [f"{ENGINE}.decoupled=true", f'{ENGINE}.correction="truncate"', f"{ENGINE}.correction_high=2.0"],
    "icepop": [f'{ENGINE}.correction="mask"', f"{ENGINE}.correction_low=0.5", f"{ENGINE}.correction_high=2.0"],
    "seq-mask": [f'{ENGINE}.correction="mask"', f'{ENGINE}.correction_level="sequence"',
                 f"{ENGINE}.correction_low=0.5", f"{ENGINE}.correction_high=2.0"],
    "gspo": [f'{ENGINE}.objective="gspo"', f"{ENGINE}.clip_low=0.0003", f"{ENGINE}.clip_high=0.0004",
             f'{ENGINE}.loss_norm="sequences"'],
    "cispo": [f'{ENGINE}.objective="cispo"', f"{ENGINE}.clip_low=1.0"],
}
DEFAULT = "none"
#: The deliberately mismatched run: four versions of staleness at most, at 3x the default's rate.
MISMATCH = ['run.mode="async"', "run.max_staleness=4", f"{ENGINE}.lr=3e-4"]


def collapse_kept(mismatched: dict[str, dict]) -> bool:
    """K: the uncorrected mismatched run stalls (ends no more than 2 points above its start) or collapses
    (falls 10 points or more below its start at some mark), and some correction keeps it learning: never
    more than 2 points below the start, ending 2 points above it and no more than 2 below `none`'s end."""
    curves = {name: [p["accuracy"] for p in run["curve"]] for name, run in mismatched.items()}
    plain = curves[DEFAULT]
    start, end = plain[0], plain[-1]
    if end > start + 0.02 and min(plain) > start - 0.10:
        return False
    return any(min(c) >= start - 0.02 and c[-1] >= start + 0.02 and c[-1] >= end - 0.02
               for name, c in curves.items() if name != DEFAULT)


#: Keys the bench sets itself (a run's seed, length and marks, each correction's; on the default task the
#: mismatched run's too): not for `--task-set`, whose overrides would win over them.
OWN_KEYS = ("run.seed", "run.steps", f"{ENGINE}.checkpoint_every", "eval.before", "eval.after", "eval.every_steps",
            *(o.split("=")[0] for overrides in CORRECTIONS.values() for o in overrides))
MISMATCH_KEYS = tuple(o.split("=")[0] for o in MISMATCH)


def sets_own_key(key: str, own: tuple[str, ...]) -> bool:
    """Whether `key` is one of `own`, a table holding one (`run`), or a key inside one."""
    return any(key == k or k.startswith(key + ".") or key.startswith(k + ".") for k in own)


def task_overrides(parser: argparse.ArgumentParser, given: list[str], tasks: list[str],
                   quick: bool) -> dict[str, list[str]]:
    """`--task-set TASK:KEY=VALUE`, each to the runs of that task only (a reasoning-gym dataset's options),
    each task's config loaded with them first, so that a key the schema refuses fails before any run (a
    reasoning-gym dataset's options are its own to check, when its first run starts)."""
    from rlflow import config as C
    from rlflow.taskmodel import task_config

    out: dict[str, list[str]] = {task: [] for task in tasks}
    for item in given:
        task, sep, override = item.partition(":")
        key = override.split("=")[0].strip()
        if not sep or "=" not in override:
            parser.error(f"--task-set {item!r}: expected TASK:KEY=VALUE")
        if task not in out:
            parser.error(f"--task-set {item!r}: {task!r} is not one of the tasks run "
                         f"({', '.join(tasks)}{', as --quick says' if quick else ''})")
        if sets_own_key(key, OWN_KEYS + (MISMATCH_KEYS if task == "default" else ())):
            parser.error(f"--task-set {item!r}: the bench sets {key} itself")
        out[task].append(override)
    for task, overrides in out.items():
        try:
            if task == "default":
                C.load(C.default_config_path(), overrides)
            else:
                task_config(task, ['roles.rollout.model="task"', *overrides])
        except C.ConfigError as exc:
            parser.error(f"--task-set, {task}: {exc}")
    return out


def run_and_read(name: str, overrides: list[str], seed: int, task: str, args, folder: pathlib.Path) -> dict:
    if not (args.reuse and (folder / "heldout.jsonl").exists()):
        learning.run_one("default", seed, args.steps, args.every, [*overrides, *args.per_task.get(task, [])],
                         folder, args.timeout, task="" if task == "default" else task)
        learning.evaluate_in_child(folder, args.timeout)
    run = learning.read_run(folder)
    metrics = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines() if line.strip()]
    run["gap_p99"] = statistics.fmean(m["train"].get("gap_p99", 0.0) for m in metrics)
    run["gap_mean"] = statistics.fmean(m["train"].get("gap_mean", 0.0) for m in metrics)
    run["step_s"] = run["time_s"] / run["steps"]
    print(f"[corrections] {task} {name} seed {seed}: held-out {run['curve'][0]['accuracy']:.1%} -> "
          f"{run['curve'][-1]['accuracy']:.1%}, gap p99 {run['gap_p99']:.3f}, {run['step_s']:.2f} s a step",
          flush=True)
    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--corrections", default=",".join(CORRECTIONS), help=f"of {', '.join(CORRECTIONS)}")
    parser.add_argument("--tasks", default="default,spell_backward",
                        help="default, or reasoning-gym datasets (each with its built model: rlflow up --task)")
    parser.add_argument("--task-set", action="append", default=[], metavar="TASK:KEY=VALUE",
                        help="a config override for the runs of one task only, e.g. "
                             "word_sequence_reversal:task.options.max_words=4 (repeatable; --reuse finds runs by "
                             "task, correction and seed alone: give another --tag when these change)")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--quick", action="store_true", help="one seed (0), the default task, 60 steps")
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--every", type=int, default=10, help="checkpoint (and evaluate) every this many steps")
    parser.add_argument("--mismatch", action="store_true", help="also the deliberately mismatched runs")
    parser.add_argument("--mismatch-corrections", default="",
                        help="the corrections the mismatched run is tried with besides none (default: the best, "
                             "or tis where none is the best)")
    parser.add_argument("--tag", default="")
    parser.add_argument("--reuse", action="store_true", help="keep runs already finished and evaluated")
    parser.add_argument("--timeout", type=float, default=3600.0)
    args = parser.parse_args()
    names = learning.chosen(parser, args.corrections, CORRECTIONS, "correction")
    if DEFAULT not in names:
        names.insert(0, DEFAULT)
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    seeds = [int(s) for s in args.seeds.split(",")]
    if args.quick:
        tasks, seeds, args.steps = ["default"], [0], 60
    args.per_task = task_overrides(parser, args.task_set, tasks, args.quick)
    if args.steps % args.every:
        parser.error(f"--steps {args.steps} is not a multiple of --every {args.every}")
    runs = RUNS / (args.tag or "default")

    results: dict[str, dict[str, dict[int, dict]]] = {}  # task -> correction -> seed -> run
    for task in tasks:
        for name in names:
            for seed in seeds:
                folder = runs / f"{task}-{name}-s{seed}"
                results.setdefault(task, {}).setdefault(name, {})[seed] = run_and_read(
                    name, CORRECTIONS[name], seed, task, args, folder)

    def final(task: str, name: str) -> float:
        return statistics.fmean(r["curve"][-1]["accuracy"] for r in results[task][name].values())

    # The best: the highest of each correction's worst task (against the default there).
    margin = {name: min(100 * (final(t, name) - final(t, DEFAULT)) for t in tasks) for name in names}
    best = max(names, key=lambda n: (margin[n], n == DEFAULT))
    gap = statistics.fmean(r["gap_p99"] for t in tasks for r in results[t][DEFAULT].values())

    marks = ", ".join(str(p["step"]) for p in learning.mean_curve(list(results[tasks[0]][DEFAULT].values())))
    lines = [f"| task | correction | held-out at steps {marks} | gap p99 | gap mean | s a step |",
             "| --- | --- | --- | ---: | ---: | ---: |"]
    for task in tasks:
        for name in names:
            seeded = list(results[task][name].values())
            curve = " / ".join(f"{100 * p['accuracy']:.1f}" for p in learning.mean_curve(seeded))
            lines.append(f"| {task} | {name} | {curve} | {statistics.fmean(r['gap_p99'] for r in seeded):.3f} | "
                         f"{statistics.fmean(r['gap_mean'] for r in seeded):.4f} | "
                         f"{statistics.fmean(r['step_s'] for r in seeded):.2f} |")

    kept = "na"
    mismatched: dict[str, dict] = {}
    if args.mismatch:
        tried = [n.strip() for n in args.mismatch_corrections.split(",") if n.strip()] or \
            [best if best != DEFAULT else "tis"]
        unknown = sorted(set(tried) - set(CORRECTIONS))
        if unknown:
            raise SystemExit(f"--mismatch-corrections: unknown {unknown}; of {', '.join(CORRECTIONS)}")
        for name in dict.fromkeys([DEFAULT, *tried]):
            mismatched[name] = run_and_read(f"{name} (mismatched)", [*CORRECTIONS[name], *MISMATCH], seeds[0],
                                            "default", args, runs / f"mismatch-{name}-s{seeds[0]}")
        kept = "1" if collapse_kept(mismatched) else "0"
        for name, run in mismatched.items():
            curve = " / ".join(f"{100 * p['accuracy']:.1f}" for p in run["curve"])
            lines.append(f"| default, mismatched | {name} | {curve} | {run['gap_p99']:.3f} | {run['gap_mean']:.4f} | "
                         f"{run['step_s']:.2f} |")

    text = "\n".join(lines)
    name = "corrections" + (f"-{args.tag}" if args.tag else "")
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps({"args": vars(args), "margin_points": margin, "runs": {
        t: {n: {str(s): r for s, r in by.items()} for n, by in per.items()} for t, per in results.items()},
        "mismatched": mismatched}, indent=1))
    (RESULTS / f"{name}.md").write_text(text + "\n")
    print(text)
    print(f"wrote {RESULTS / name}.{{json,md}}")
    print("RESULT corrections " + " ".join([
        f"best={best}", f"best_vs_default_points={margin[best]:.1f}", f"gap_p99={gap:.3f}", f"collapse_kept={kept}"]))


if __name__ == "__main__":
    main()
