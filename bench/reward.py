"""Rewards with a long-tailed latency: scored in line in the rollout process
against on a pool of their own, and how the reward role scales out.

Runs rlflow itself (controller, transport, services on a local Ray) with a
simulated rollout and trainer and a simulated reward whose latency per
sample is lognormal (sigma 1.0):

* isolated_vs_inline: throughput with the reward on its own pool (one
  replica) over throughput with the reward scored in line in the rollout
  process (what AReaL and slime do: the engine waits while a finished group
  is scored), at a latency where scoring a step's samples takes 0.8x as
  long as generating them;
* scale_4_efficiency: throughput with 4 reward replicas over 4x the
  throughput with 1, at a latency where even 4 replicas are the bottleneck;
* sandbox_p50_ms: the median start-to-exit time of a trivial program in the
  code sandbox.

Targets: isolated_vs_inline >= 1.5, scale_4_efficiency >= 0.8,
sandbox_p50_ms <= 100. Ends with

    RESULT reward isolated_vs_inline=R scale_4_efficiency=E sandbox_p50_ms=M
"""

from __future__ import annotations

import argparse
import math
import pathlib
import statistics
import sys
import tempfile
import time

from rlflow import config as C
from rlflow.control.launch import run
from rlflow.rundir import RunDir

#: What every run here shares (`config_of` adds each one's values).
BASE = {
    "pools": {"generate": {"cpus_per_bundle": 0.5}, "score": {}, "train": {"cpus_per_bundle": 0.5}},
    "roles": {
        "rollout": {"pool": "generate", "engine": {"kind": "sim"}},
        "reward": {"pool": "score", "engine": {"kind": "sim"}},
        "trainer": {"pool": "train", "engine": {"kind": "sim", "s_per_token": 1e-7, "weights_bytes": 65536}},
    },
    "cluster": {"heartbeat_s": 0.25},
    "run": {"mode": "async", "samples_per_prompt": 8},
}


def config_of(*, steps: int, replicas: int, score_cpus: float, inline: bool, slots: int, step_s: float,
              median: float, concurrency: int, latency_median: float, staleness: int, batch_size: int) -> C.Config:
    """One run's config: `replicas` reward replicas (each a bundle of `score_cpus`) or the reward scored
    in line, lognormal response lengths around `median` and reward latencies around `latency_median`."""
    return C.build(BASE, {
        "pools": {"score": {"bundles_per_node": replicas, "cpus_per_bundle": score_cpus}},
        "roles": {
            "rollout": {"engine": {"slots": slots, "step_s": step_s, "response_len": {
                "kind": "lognormal", "median": median, "sigma": 0.5, "min": 1, "max": 1024}}},
            "reward": {"replicas": replicas, "inline": inline, "engine": {
                "concurrency": concurrency,
                "latency_s": {"kind": "lognormal", "median": latency_median, "sigma": 1.0}}},
        },
        "run": {"max_staleness": staleness, "batch_size": batch_size, "steps": steps},
    })


#: exp(sigma^2 / 2): the mean of a lognormal over its median, at sigma 1.0.
LOGNORMAL_MEAN_OVER_MEDIAN = math.exp(0.5)


def throughput(work: pathlib.Path, name: str, *, steps: int, warmup: int = 2, drain: int = 2, **fields) -> float:
    """Steady-state samples/s of one run: after the first steps, and before
    the last ones, which drain the pipeline (nothing new hides the tail)."""
    config = config_of(steps=steps, **fields)
    run_dir = work / name
    run(config, run_dir)
    rows = RunDir(run_dir).read_metrics()
    window = rows[warmup - 1 : len(rows) - drain]
    return sum(r.samples for r in window[1:]) / (window[-1].time_s - window[0].time_s)


def sandbox_p50_ms(runs: int = 30) -> float:
    from rlflow.sandbox import check_isolation, run_python

    problem = check_isolation()
    if problem is not None:
        print(f"the sandbox cannot run here: {problem}")
        return math.nan
    run_python("print(1)\n")  # warm the page cache
    times = []
    for _ in range(runs):
        started = time.perf_counter()
        run_python("print(1)\n")
        times.append(1000 * (time.perf_counter() - started))
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=14, help="optimizer steps per run")
    args = parser.parse_args()
    work = pathlib.Path(tempfile.mkdtemp(prefix="rlflow-reward-"))
    slots, step_s, median, batch_size, concurrency = 64, 0.002, 48, 16, 16
    samples_per_step = batch_size * 8
    mean_len = median * math.exp(0.5**2 / 2)
    generate_s = samples_per_step * mean_len * step_s / slots  # a step's samples at full occupancy
    # Scoring a step's samples (concurrency at a time) takes 0.8x as long as generating them.
    latency_mean = 0.8 * generate_s * concurrency / samples_per_step
    common = dict(slots=slots, step_s=step_s, median=median, batch_size=batch_size, concurrency=concurrency)
    fields = dict(common, latency_median=latency_mean / LOGNORMAL_MEAN_OVER_MEDIAN, score_cpus=0.25, staleness=2)
    print(f"generation {generate_s:.3f} s a step; reward latency mean {1000 * latency_mean:.1f} ms, lognormal sigma 1")
    inline = throughput(work, "inline", steps=args.steps, replicas=1, inline=True, **fields)
    isolated = throughput(work, "isolated", steps=args.steps, replicas=1, inline=False, **fields)
    print(f"scored in line: {inline:.1f} samples/s; on its own pool: {isolated:.1f} samples/s")
    # Thirty times the latency: even four replicas score at a fraction of
    # generation's pace; credits for 8 steps ahead, so that the staleness
    # bound does not cap how many groups the replicas can work on.
    slow = dict(common, latency_median=30 * latency_mean / LOGNORMAL_MEAN_OVER_MEDIAN, score_cpus=0.25, staleness=8)
    one = throughput(work, "scale-1", steps=args.steps, replicas=1, inline=False, **slow)
    four = throughput(work, "scale-4", steps=args.steps, replicas=4, inline=False, **slow)
    print(f"reward-bound: 1 replica {one:.1f} samples/s, 4 replicas {four:.1f} samples/s")
    sandbox = sandbox_p50_ms()
    print(f"sandbox: a trivial program starts and exits in {sandbox:.1f} ms (median)")
    print(f"RESULT reward isolated_vs_inline={isolated / inline:.2f} scale_4_efficiency={four / (4 * one):.2f} "
          f"sandbox_p50_ms={sandbox:.1f}")


if __name__ == "__main__":
    sys.exit(main())
