"""Soak: a million samples through the simulated pipeline; does any process grow?

Runs rlflow itself (controller, transport, every service on Ray, real
messages) with the simulated engines tuned for throughput (short responses,
a fast decode step, a small weight payload, no scoring latency), and reads
the resident memory (RSS) of each service's process and of the controller's
(this process) at every tenth of the run. A service's growth is from its
reading at 10% (after warm-up) to its reading at 100%; the target is under
5% for every one. Writes bench/results/soak.json.

    RESULT soak samples=N rss_growth_max=G
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import sys
import tempfile
import time

import psutil

from rlflow import config as C
from rlflow.control.launch import run
from rlflow.rundir import Status

RESULTS = pathlib.Path(__file__).parent / "results"
#: Prompt groups per step and samples per group: 1,024 samples a step.
BATCH, SAMPLES_PER_PROMPT = 64, 16
#: Steps run past the last reading, so that every service is still up for it.
TAIL_STEPS = 5
TARGET = 0.05

CONFIG = """
[pools.generate]
cpus_per_bundle = 1.0
[pools.score]
cpus_per_bundle = 0.5
[pools.train]
cpus_per_bundle = 0.5

[roles.rollout]
pool = "generate"
[roles.rollout.engine]
kind = "sim"
slots = 1024
step_s = 0.0002
response_len = {{ kind = "lognormal", median = 4, sigma = 0.5, min = 1, max = 16 }}

[roles.reward]
pool = "score"
[roles.reward.engine]
kind = "sim"
concurrency = 4096

[roles.teacher]
pool = "score"
[roles.teacher.engine]
kind = "sim"

[roles.trainer]
pool = "train"
[roles.trainer.engine]
kind = "sim"
s_per_token = 0.0
weights_bytes = 65536

[run]
mode = "async"
max_staleness = 2
batch_size = {batch}
samples_per_prompt = {spp}
steps = {steps}

[cluster]
heartbeat_s = 0.5
"""


class Readings:
    """RSS of every service and the controller at each tenth of the run (an
    `on_status` callback: the controller calls it about twice a second)."""

    def __init__(self, steps: int):
        self.marks = [max(1, round(steps * k / 10)) for k in range(1, 11)]
        self.rows: list[dict] = []
        self.started = time.monotonic()

    def __call__(self, status: Status) -> None:
        if not self.marks or status.state != "running" or status.step < self.marks[0]:
            return
        while self.marks and status.step >= self.marks[0]:
            self.marks.pop(0)
        rss = {"controller": psutil.Process(os.getpid()).memory_info().rss}
        for role, info in status.roles.items():
            for placed in info.placed:
                try:
                    rss[f"{role}-{placed.rank}"] = psutil.Process(placed.pid).memory_info().rss
                except psutil.NoSuchProcess:
                    pass
        row = {"step": status.step, "samples": status.samples, "elapsed_s": time.monotonic() - self.started, "rss": rss}
        self.rows.append(row)
        shown = "  ".join(f"{name} {value / 2**20:.0f}" for name, value in sorted(rss.items()))
        print(f"[soak] step {status.step:6d}  {status.samples:9,d} samples  {row['elapsed_s']:6.0f} s  "
              f"RSS MiB: {shown}", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=1_000_000, help="samples to train on (default a million)")
    parser.add_argument("--run-dir", type=pathlib.Path, default=None,
                        help="keep the run here (default: a temporary one)")
    parser.add_argument("--out", type=pathlib.Path, default=RESULTS)
    args = parser.parse_args()

    per_step = BATCH * SAMPLES_PER_PROMPT
    steps = max(10, math.ceil(args.samples / per_step))
    config = C.load(text=CONFIG.format(batch=BATCH, spp=SAMPLES_PER_PROMPT, steps=steps + TAIL_STEPS))
    readings = Readings(steps)
    with tempfile.TemporaryDirectory(prefix="rlflow-soak-") as tmp:
        run_dir = args.run_dir or pathlib.Path(tmp) / "run"
        started = time.monotonic()
        summary = run(config, run_dir, on_status=readings)
        wall = time.monotonic() - started
    if summary.state != "stopped":
        print(f"the run {summary.state}: {summary.error}", file=sys.stderr)
        return 1
    if len(readings.rows) < 2:
        print("too few readings: the run was too short to read memory at 10% and 100%", file=sys.stderr)
        return 1
    first, last = readings.rows[0], readings.rows[-1]
    growth = {name: last["rss"][name] / rss - 1 for name, rss in first["rss"].items() if name in last["rss"]}
    print(f"{'process':12s} {'RSS at 10%':>11s} {'at 100%':>9s} {'growth':>7s}")
    for name in sorted(growth):
        print(f"{name:12s} {first['rss'][name] / 2**20:9.1f} M {last['rss'][name] / 2**20:7.1f} M {growth[name]:+7.2%}")
    worst = max(growth.values())
    samples = last["samples"]
    print(f"{samples:,d} samples in {wall:.0f} s ({summary.samples / wall:.0f} samples/s over the whole run); "
          f"largest growth {worst:+.2%} (target under {TARGET:.0%})")
    args.out.mkdir(parents=True, exist_ok=True)
    result = {"samples": samples, "steps": steps, "wall_s": wall, "growth": growth, "rss_growth_max": worst,
              "readings": readings.rows}
    (args.out / "soak.json").write_text(json.dumps(result, indent=1))
    print(f"RESULT soak samples={samples} rss_growth_max={worst:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
