"""How close `rlflow plan` comes to real runs.

Runs the pipeline (simulated engines, real services on a local Ray) in two
layouts, one and two rollout replicas, learns the unit costs from the first
run alone, and compares the planner's prediction for each layout with the
steady-state throughput measured in its run.

Ends with

    RESULT plan error_1_rollout=E1 error_2_rollouts=E2

(relative errors; the target is at most 0.10 each).
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import tempfile

from rlflow import config as C
from rlflow.control.launch import run
from rlflow.rundir import RunDir
from rlflow.tools.plan import simulate, workload_from_run

EXAMPLE = pathlib.Path(__file__).resolve().parent.parent / "examples" / "sim-plan.toml"


def steady_samples_per_s(run_dir: pathlib.Path, warmup: int = 3, drain: int = 2) -> float:
    """Throughput between the end of warm-up and the start of the drain."""
    rows = RunDir(run_dir).read_metrics()
    window = rows[warmup - 1 : len(rows) - drain]
    return sum(r.samples for r in window[1:]) / (window[-1].time_s - window[0].time_s)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=14, help="optimizer steps per run")
    args = parser.parse_args()
    work = pathlib.Path(tempfile.mkdtemp(prefix="rlflow-plan-"))
    runs = {}
    for rollouts in (1, 2):
        run_dir = work / f"rollouts-{rollouts}"
        layout = [f"pools.generate.bundles_per_node={rollouts}", f"roles.rollout.replicas={rollouts}"]
        run(C.load(EXAMPLE, [*layout, f"run.steps={args.steps}"]), run_dir)
        runs[rollouts] = run_dir
    workload, _, _ = workload_from_run(runs[1])
    errors = {}
    for rollouts, run_dir in runs.items():
        predicted = simulate(workload, rollouts, 1, steps=30).samples_per_s
        measured = steady_samples_per_s(run_dir)
        errors[rollouts] = abs(predicted - measured) / measured
        print(f"{rollouts} rollout replica(s): predicted {predicted:.1f} samples/s, measured {measured:.1f}")
    print(f"RESULT plan error_1_rollout={errors[1]:.3f} error_2_rollouts={errors[2]:.3f}")


if __name__ == "__main__":
    sys.exit(main())
