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

CONFIG = """
[pools.generate]
bundles_per_node = {rollouts}
cpus_per_bundle = 0.25
[pools.score]
cpus_per_bundle = 0.25
[pools.train]
cpus_per_bundle = 0.5

[roles.rollout]
pool = "generate"
replicas = {rollouts}
[roles.rollout.engine]
kind = "sim"
slots = 16
step_s = 0.002
response_len = {{ kind = "lognormal", median = 48, sigma = 0.5, min = 1, max = 400 }}

[roles.reward]
pool = "score"
[roles.reward.engine]
kind = "sim"

[roles.trainer]
pool = "train"
[roles.trainer.engine]
kind = "sim"
s_per_token = 1.1e-4
weights_bytes = 65536

[cluster]
heartbeat_s = 0.2

[run]
mode = "async"
max_staleness = 2
batch_size = 8
samples_per_prompt = 4
steps = {steps}
"""


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
        run(C.load(text=CONFIG.format(rollouts=rollouts, steps=args.steps)), run_dir)
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
