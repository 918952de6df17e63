"""Soak: does any process grow with a run's length? A wide run and a long narrow one.

Runs rlflow itself (controller, transport, every service on Ray, real
messages) with the simulated engines tuned for throughput (short responses,
a fast decode step, a small weight payload, no scoring latency), and reads
the resident memory (RSS) of each service's process and of the controller's
(the process that runs it) at 1% of the run and at every tenth. A process
that leaks grows at the same pace all run long; one that warms up (the rollout's
allocator and queues fill over its first few hundred steps) grows early and
then stays flat. So the growth that counts is over the second half of the
run, from the reading at 50% to the one at 100%: the target is at most 2%
for every process. The warm-up, from 1% to 50%, is reported on its own line.

Two runs, one after the other: the wide one (`--samples`, three million by
default, 1,024 samples a step), where what a process keeps per sample would
show; and the long narrow one (`--steps`, 30,000 by default, 16 samples a
step), where what it keeps per step would. Each runs in a process of its own
(the controller's, as each `rlflow up` has one: run in one process after the
wide one, the narrow run's controller grew 24 bytes a step, against 4 on its
own). Writes bench/results/soak.json.

    RESULT soak samples=N rss_growth_max=G controller_bytes_per_step=K

N: the wide run's samples; G: the largest second-half growth of any process
in either run; K: the controller process's growth over the narrow run's
second half in bytes per step (its resident memory: the controller's state
with whatever else its process holds), where steps, not samples, are what
the run is made of. The wide run's own figure (the same growth over its far
fewer steps) is printed on a line before, with each run's warm-up. `--samples
0` or `--steps 0` leaves a run out (K is then the wide run's).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import subprocess
import sys
import tempfile
import time
import tracemalloc

import psutil

from rlflow import config as C
from rlflow.control.launch import run
from rlflow.rundir import Status

RESULTS = pathlib.Path(__file__).parent / "results"
#: Prompt groups per step and samples per group: 1,024 samples a step.
BATCH, SAMPLES_PER_PROMPT = 64, 16
#: The same of the long narrow run (`--steps`): 16 samples a step.
NARROW_BATCH, NARROW_SAMPLES_PER_PROMPT = 4, 4
#: Share of the run's steps run past the last reading, so that every service is still up for it (the
#: controller reports about twice a second: at 30 steps a second, 5 steps were over before it did).
TAIL_SHARE = 0.03
#: Largest growth over the second half of the run, for every process.
TARGET = 0.02
#: When the readings are taken, as fractions of the run: the first, early in the warm-up, then every tenth.
MARKS = (0.01, *(k / 10 for k in range(1, 11)))

#: The run's config, less its batch and steps (`soak` adds them).
CONFIG = {
    "pools": {"generate": {"cpus_per_bundle": 1.0}, "score": {"cpus_per_bundle": 0.5},
              "train": {"cpus_per_bundle": 0.5}},
    "roles": {
        "rollout": {"pool": "generate", "engine": {
            "kind": "sim", "slots": 1024, "step_s": 0.0002,
            "response_len": {"kind": "lognormal", "median": 4, "sigma": 0.5, "min": 1, "max": 16}}},
        "reward": {"pool": "score", "engine": {"kind": "sim", "concurrency": 4096}},
        "teacher": {"pool": "score", "engine": {"kind": "sim"}},
        "trainer": {"pool": "train", "engine": {"kind": "sim", "s_per_token": 0.0, "weights_bytes": 65536}},
    },
    "run": {"mode": "async", "max_staleness": 2},
    "cluster": {"heartbeat_s": 0.5},
}


class Readings:
    """RSS of every service and the controller at each of `MARKS` (an
    `on_status` callback: the controller calls it about twice a second)."""

    def __init__(self, steps: int, trace: bool = False):
        self.marks = [(fraction, max(1, round(steps * fraction))) for fraction in MARKS]
        #: With `trace`: tracemalloc snapshots of this process at 50% and 100% (what the Python code grew by).
        self.trace, self.snapshots = trace, {}
        self.rows: list[dict] = []
        self.started = time.monotonic()
        #: "role.queue" -> its deepest so far: a buffer's high-water mark is where its memory stays.
        self.peaks: dict[str, int] = {}

    def __call__(self, status: Status) -> None:
        if status.state == "running":
            for role, info in status.roles.items():
                for queue, depth in info.queues.items():
                    key = f"{role}.{queue}"
                    self.peaks[key] = max(self.peaks.get(key, 0), depth)
        if not self.marks or status.state != "running" or status.step < self.marks[0][1]:
            return
        fraction = 0.0
        while self.marks and status.step >= self.marks[0][1]:  # a late status passes several: the last counts
            fraction = self.marks.pop(0)[0]
        pids = {"controller": os.getpid()}
        pids.update((f"{role}-{placed.rank}", placed.pid)
                    for role, info in status.roles.items() for placed in info.placed)
        rss, anon = {}, {}
        for name, pid in pids.items():
            try:
                memory = psutil.Process(pid).memory_info()
            except psutil.NoSuchProcess:
                continue
            # Its own memory (heap, stacks: RssAnon), not pages of the files it maps (RssFile + RssShmem).
            rss[name], anon[name] = memory.rss, memory.rss - memory.shared
        if self.trace and fraction in (0.5, 1.0):
            self.snapshots[fraction] = tracemalloc.take_snapshot()
        row = {"fraction": fraction, "step": status.step, "samples": status.samples,
               "elapsed_s": time.monotonic() - self.started, "rss": rss, "anon": anon, "queue_peaks": dict(self.peaks)}
        self.rows.append(row)
        shown = "  ".join(f"{name} {value / 2**20:.0f}" for name, value in sorted(rss.items()))
        deepest = " ".join(f"{k}={v}" for k, v in sorted(self.peaks.items()) if k.startswith("rollout."))
        print(f"[soak] {fraction:4.0%} step {status.step:6d}  {status.samples:9,d} samples  {row['elapsed_s']:6.0f} s  "
              f"RSS MiB: {shown}  (deepest so far: {deepest})", flush=True)

    def at(self, fraction: float) -> dict | None:
        """The first reading at `fraction` of the run or later."""
        return next((row for row in self.rows if row["fraction"] >= fraction - 1e-9), None)


def growth(before: dict, after: dict) -> dict[str, float]:
    """Each process's RSS growth between two readings, as a fraction."""
    return {name: after["rss"][name] / rss - 1 for name, rss in before["rss"].items() if name in after["rss"]}


def soak(batch: int, spp: int, steps: int, trace: bool) -> dict | None:
    """One run of `steps` steps of `batch` groups of `spp` samples; its readings and growth (None: it failed)."""
    tail = max(5, math.ceil(steps * TAIL_SHARE))
    config = C.build(CONFIG, {"run": {"batch_size": batch, "samples_per_prompt": spp, "steps": steps + tail}})
    readings = Readings(steps, trace)
    if trace:
        tracemalloc.start(4)
    with tempfile.TemporaryDirectory(prefix="rlflow-soak-") as tmp:
        started = time.monotonic()
        summary = run(config, pathlib.Path(tmp) / "run", on_status=readings)
        wall = time.monotonic() - started
    if trace:
        tracemalloc.stop()
    if summary.state != "stopped":
        print(f"the run {summary.state}: {summary.error}", file=sys.stderr)
        return None
    first, half, last = readings.at(MARKS[0]), readings.at(0.5), readings.at(1.0)
    if None in (first, half, last) or first is half or half is last:
        print("too few readings: the run was too short to read memory at 1%, 50% and 100%", file=sys.stderr)
        return None
    warmup, second = growth(first, half), growth(half, last)
    print(f"{'process':12s} {'RSS at 1%':>10s} {'at 50%':>8s} {'at 100%':>9s} {'warm-up':>8s} {'2nd half':>9s}")
    for name in sorted(second):
        print(f"{name:12s} {first['rss'][name] / 2**20:8.1f} M {half['rss'][name] / 2**20:6.1f} M "
              f"{last['rss'][name] / 2**20:7.1f} M {warmup[name]:+8.2%} {second[name]:+9.2%}")
    worst, warm = max(second.values()), max(warmup.values())
    print(f"warm-up, steps {first['step']}-{half['step']} (1% to 50% of the run): largest growth {warm:+.2%} "
          f"({max(warmup, key=warmup.get)})")
    print(f"{last['samples']:,d} samples in {wall:.0f} s ({summary.samples / wall:.0f} samples/s over the whole run); "
          f"largest growth over the second half, steps {half['step']}-{last['step']}: {worst:+.2%} "
          f"({max(second, key=second.get)}; target at most {TARGET:.0%})")
    if len(readings.snapshots) == 2:
        grown = readings.snapshots[1.0].compare_to(readings.snapshots[0.5], "traceback")
        print(f"this process's Python allocations over the second half: {sum(d.size_diff for d in grown):+,d} bytes; "
              "the largest:")
        for diff in grown[:8]:
            print(f"  {diff.size_diff:+,d} B in {diff.count_diff:+d} blocks at "
                  + " <- ".join(f"{f.filename.rsplit('/', 2)[-1]}:{f.lineno}" for f in diff.traceback[:4]))
    controller = last["rss"]["controller"] - half["rss"]["controller"]
    own = last["anon"]["controller"] - half["anon"]["controller"]
    per_step = controller / max(1, last["step"] - half["step"])
    print(f"the controller's process over the second half: {controller / 2**10:+,.0f} KiB, "
          f"{per_step:,.0f} bytes a step ({own / 2**10:+,.0f} KiB of it anonymous, "
          f"{(controller - own) / 2**10:+,.0f} KiB pages of files)")
    return {"samples": last["samples"], "steps": steps, "samples_per_step": batch * spp, "wall_s": wall,
            "growth": second, "warmup_growth": warmup, "rss_growth_max": worst, "warmup_growth_max": warm,
            "controller_bytes": controller, "controller_bytes_per_step": per_step, "readings": readings.rows}


def run_one(name: str, samples: int, steps: int, trace: bool, out: pathlib.Path) -> int:
    """The wide or the narrow run, in this process; its results into `out`/NAME.json."""
    if name == "wide":
        print(f"[soak] the wide run: {samples:,d} samples, {BATCH * SAMPLES_PER_PROMPT:,d} a step", flush=True)
        result = soak(BATCH, SAMPLES_PER_PROMPT, max(100, math.ceil(samples / (BATCH * SAMPLES_PER_PROMPT))), trace)
    else:
        print(f"[soak] the narrow run: {steps:,d} steps of {NARROW_BATCH * NARROW_SAMPLES_PER_PROMPT} samples",
              flush=True)
        result = soak(NARROW_BATCH, NARROW_SAMPLES_PER_PROMPT, max(100, steps), trace)
    if result is None:
        return 1
    (out / f"{name}.json").write_text(json.dumps(result))
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=3_000_000,
                        help="samples of the wide run, 1,024 a step (default three million; 0: no wide run)")
    parser.add_argument("--steps", type=int, default=30_000,
                        help="steps of the long narrow run, 16 samples each (default 30,000; 0: no narrow run)")
    parser.add_argument("--trace-memory", action="store_true",
                        help="trace the controller process's Python allocations (slower): where they grew over "
                             "each second half")
    parser.add_argument("--out", type=pathlib.Path, default=RESULTS)
    parser.add_argument("--only", choices=("wide", "narrow"), help=argparse.SUPPRESS)  # one run, in a child
    args = parser.parse_args()
    if not args.samples and not args.steps:
        parser.error("--samples 0 and --steps 0 leave nothing to run")

    if args.only:
        return run_one(args.only, args.samples, args.steps, args.trace_memory, args.out)
    runs = {}
    with tempfile.TemporaryDirectory(prefix="rlflow-soak-runs-") as tmp:
        for name in ("wide", "narrow"):
            if (args.samples if name == "wide" else args.steps):
                # Each run in a process of its own, as each `rlflow up` is: the controller's memory is one run's.
                child = [sys.executable, __file__, "--only", name, "--samples", str(args.samples),
                         "--steps", str(args.steps), "--out", tmp, *(["--trace-memory"] if args.trace_memory else [])]
                subprocess.run(child, check=False)
                done = pathlib.Path(tmp) / f"{name}.json"
                runs[name] = json.loads(done.read_text()) if done.exists() else None
    if None in runs.values():
        return 1
    worst = max(r["rss_growth_max"] for r in runs.values())
    samples = (runs.get("wide") or runs["narrow"])["samples"]
    per_step = (runs.get("narrow") or runs["wide"])["controller_bytes_per_step"]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "soak.json").write_text(json.dumps({"target": TARGET, **runs}, indent=1))
    for name, r in runs.items():
        print(f"{name}: {r['samples']:,d} samples in {r['steps']:,d} steps; largest second-half growth "
              f"{r['rss_growth_max']:+.2%}, warm-up {r['warmup_growth_max']:+.2%}; the controller "
              f"{r['controller_bytes'] / 2**10:+,.0f} KiB over the second half ({r['controller_bytes_per_step']:,.0f} "
              "bytes a step)")
    print(f"RESULT soak samples={samples} rss_growth_max={worst:.4f} controller_bytes_per_step={per_step:.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
