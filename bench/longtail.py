"""Long-tail rollouts: how much of the tail rlflow's async pipeline hides.

With long-tailed response lengths a synchronous step waits for its longest
rollout while the trainer idles. This runs rlflow itself (controller,
transport, services on Ray) with simulated engines, so that rlflow's own
overheads are in the figures, in each mode, and compares:

* against two synchronous baselines: the same split pools with a barrier
  per step, and a colocated run that gives every device to generation and
  then every device to training (twice the slots, twice the training speed,
  one phase at a time);
* against the overlap bound: a run can go no faster than the busier of
  generation at full slot occupancy and training, computed from the
  workload's parameters and the unit costs measured in the run.

Per run it reports samples/s, tokens/s, trainer idle %, rollout slot
occupancy %, staleness mean / max, the ratio to each sync baseline and the
efficiency against the bound; writes bench/results/longtail.json, a timeline
PNG and a Chrome / Perfetto trace per mode. The full run also sweeps the
length distribution (fixed, lognormal sigma 0.5 / 1.0 / 1.5, Pareto), the
rollout capacity (8 to 1,024 slots over simulated replicas), partial
rollout on and off, the strict staleness check against the credits alone,
and runs the real pipeline (vLLM on CPU, the default model) sync against
async.

    RESULT longtail workload=reference async_vs_sync=S bound_efficiency=E async_vs_colocated_sync=C real_async_vs_sync=R

`--scale` runs bigger simulated clusters instead: 1,024 slots over 4
rollout replicas, 4,096 over 16, and 16,384 over 64 with 16 reward
replicas (async, max_staleness 2, batch sizes scaled with the slots as in
the sweep's `slots-1024`; every replica a process of its own on Ray, the
engines simulated; at 16,384 a decode step takes 16 ms, a GPU's at that
batch, where 1 ms would ask more samples a second of the data plane than
two cores move), reports each one's efficiency against the bound, the
controller's CPU (its thread's share of one core) and how long a message
waits for it and its handling (p50 / p99, from taken off its socket to
handled), and holds `rlflow plan`'s prediction (its `simulate`, with the
unit costs learned from each run) against the steady-state throughput
measured in that run:

    RESULT longtail_scale slots_1024_efficiency=A slots_4096_efficiency=B slots_16384_efficiency=C \
        controller_cpu_16384=U controller_p99_ms_16384=L plan_error_max=E
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field

import numpy as np

from rlflow import config as C
from rlflow.tools.report import load as load_run
from rlflow.tools.report import write_timeline
from rlflow.control.launch import run
from rlflow.rundir import RunDir
from rlflow.distributions import draw_lengths
from rlflow.tools.plan import simulate, workload_from_run

RESULTS = pathlib.Path(__file__).parent / "results"

#: The reference layout (`Workload.config` adds the workload's, the mode's and the run's values).
BASE = {
    "pools": {
        "generate": {"cpus_per_bundle": 0.5},
        "score": {"cpus_per_bundle": 0.25},
        "train": {"cpus_per_bundle": 0.5},
    },
    "roles": {
        "rollout": {"pool": "generate", "engine": {"kind": "sim"}},
        "reward": {"pool": "score", "engine": {"kind": "sim", "concurrency": 4096}},
        "trainer": {"pool": "train", "engine": {"kind": "sim", "weights_bytes": 1048576}},
    },
    "cluster": {
        "heartbeat_s": 0.25,
        # --scale starts 82 processes on a machine of two cores: the last of them said hello
        # more than 300 s after the first (2026-12-05, an AMD EPYC).
        "handshake_timeout_s": 1200,
    },
}

#: The synchronous baseline that gives every device to one phase at a time: one pool for both roles.
COLOCATED = {
    "pools": {"generate": {"cpus_per_bundle": 1.0}, "train": None},
    "roles": {"trainer": {"pool": "generate"}},
}

#: `Workload.spread`: the rollout replicas on one core, reward and trainer on the next.
SPREAD = {"pools": {"generate": {"cpus_per_bundle": 1.0}, "score": {"cpus_per_bundle": 0.5}}}


@dataclass(frozen=True)
class Workload:
    """A long-tail workload: lengths, rollout capacity, a trainer balanced against it."""

    name: str
    response_len: dict
    """The rollout's `response_len` table (a `C.Distribution`'s)."""
    slots: int = 64
    replicas: int = 1
    step_s: float = 0.001
    step_s_per_seq: float = 0.0
    batch_size: int = 32
    n: int = 8
    balance: float = 1.0
    """Training time of a step / generation time of a step at full occupancy."""
    reward_replicas: int = 1
    spread: bool = False
    """Lay the roles out over this machine's cores: the rollout replicas on one
    (a generate pool of 1 CPU), reward and trainer on the next (0.5 each),
    as `examples/sim.toml` does; else the reference layout, where the
    generate and score pools (0.5 and 0.25 CPUs) share the first core."""

    def distribution(self) -> C.Distribution:
        return C.build(BASE, self._tables("async", 2, 1, True)).roles.rollout.engine.response_len

    def mean_len(self) -> float:
        lengths = draw_lengths(self.distribution(), np.random.default_rng(123), 200_000)
        return float(lengths.mean())

    def decode_s(self) -> float:
        """Decode-step time at full occupancy."""
        return self.step_s + self.step_s_per_seq * self.slots

    def s_per_token(self) -> float:
        # Training one step's tokens takes `balance` times as long as
        # generating them at full occupancy.
        return self.balance * self.decode_s() / (self.slots * self.replicas)

    def _tables(self, mode: str, staleness: int, steps: int, partial: bool, colocated: bool = False,
                check: str = "admission") -> dict:
        """What the workload, the mode and the run set over `BASE`."""
        slots, s_per_token = self.slots, self.s_per_token()
        if colocated:  # every device generates, then every device trains
            slots, s_per_token = 2 * slots, s_per_token / 2
        return {
            "roles": {
                "rollout": {
                    "replicas": self.replicas,
                    "engine": {"slots": slots, "step_s": self.step_s, "step_s_per_seq": self.step_s_per_seq,
                               "response_len": self.response_len},
                },
                "reward": {"replicas": self.reward_replicas},
                "trainer": {"engine": {"s_per_token": s_per_token}},
            },
            "run": {"mode": mode, "max_staleness": staleness, "batch_size": self.batch_size,
                    "samples_per_prompt": self.n, "steps": steps, "partial_rollout": partial,
                    "staleness_check": check},
        }

    def config(self, mode: str, staleness: int, steps: int, partial: bool = True, colocated: bool = False,
               check: str = "admission") -> C.Config:
        return C.build(BASE, self._tables(mode, staleness, steps, partial, colocated, check),
                       COLOCATED if colocated else {}, SPREAD if self.spread else {})


REFERENCE = Workload("reference", {"kind": "lognormal", "median": 256, "sigma": 1.0, "min": 1, "max": 4096})

#: The bigger simulated clusters of `--scale`: 256 slots a replica, a step
#: of half as many groups as slots (4 samples a slot), as the sweep's
#: `slots-1024`, and the roles spread over the machine's cores.
SCALE = [
    Workload("scale-1024", REFERENCE.response_len, slots=256, replicas=4, batch_size=512, spread=True),
    Workload("scale-4096", REFERENCE.response_len, slots=256, replicas=16, batch_size=2048, spread=True),
    # 64 rollout replicas and 16 reward replicas, each a process of its own; their decode steps take
    # 16 ms (a GPU's at this batch, where the 1 ms above would ask 30,000 samples/s of two cores).
    Workload("scale-16384", REFERENCE.response_len, slots=256, replicas=64, reward_replicas=16, step_s=0.016,
             batch_size=8192, spread=True),
]


@dataclass
class Result:
    workload: str
    mode: str
    staleness: int
    partial: bool
    check: str
    samples_per_s: float
    tokens_per_s: float
    trainer_idle: float
    occupancy: float
    staleness_mean: float
    staleness_max: float
    reissued: int
    bound_samples_per_s: float
    efficiency: float
    run_dir: str
    vs: dict = field(default_factory=dict)
    predicted_samples_per_s: float = math.nan
    """`rlflow plan`'s prediction for this run (`--scale` only)."""
    controller_cpu: float = math.nan
    """The controller's thread's share of one core over the run."""
    controller_p50_ms: float = math.nan
    controller_p99_ms: float = math.nan
    """A message's wait for the controller and its handling (median, 99th percentile)."""
    controller_msgs_per_s: float = math.nan


def measure(w: Workload, mode: str, staleness: int, steps: int, out: pathlib.Path, *, partial: bool = True,
            colocated: bool = False, check: str = "admission", warmup: int = 2) -> Result:
    drain = 0 if mode == "sync" else staleness  # a barrier leaves nothing to drain
    label = f"{w.name}-{'colocated-' if colocated else ''}{mode}{staleness}{_variant(partial, check)}"
    run_dir = out / label
    shutil.rmtree(run_dir, ignore_errors=True)
    summary = run(w.config(mode, staleness, steps, partial, colocated, check), run_dir)
    rows = RunDir(run_dir).read_metrics()
    # Steady state: after the first steps, and before the last ones, which
    # drain the pipeline (no new work comes in to hide the final tail).
    window = rows[warmup - 1 : len(rows) - drain]
    first, last = window[0], window[-1]
    span = last.time_s - first.time_s
    samples = sum(r.samples for r in window[1:])
    tokens = sum(r.tokens for r in window[1:])
    trace = load_run(run_dir)
    counters = {}
    for t in trace.traces:
        if t["role"] == "rollout":
            for key, value in t["counters"].items():
                counters[key] = counters.get(key, 0) + value
    slots_total = (2 * w.slots if colocated else w.slots) * w.replicas
    # Unit costs measured in the run: tokens per slot-second while generating,
    # and the trainer's time per token.
    tokens_per_slot_s = counters.get("tokens", 0) / max(counters.get("slot_s", 1e-9), 1e-9)
    train_s_per_token = sum(r.train_s for r in rows) / max(sum(r.tokens for r in rows), 1)
    mean_tokens = tokens / max(samples, 1)
    gen_s_per_sample = mean_tokens / (tokens_per_slot_s * slots_total)
    train_s_per_sample = mean_tokens * train_s_per_token
    if colocated:  # one phase after the other, each with every device
        bound = 1 / (gen_s_per_sample + train_s_per_sample)
    else:
        bound = 1 / max(gen_s_per_sample, train_s_per_sample)
    timeline, chrome = write_timeline(trace, out / f"{label}.png", out / f"{label}.trace.json",
                                      title=f"{label}: lanes per replica")
    return Result(
        workload=w.name,
        mode=("colocated-" if colocated else "") + mode,
        staleness=staleness,
        partial=partial,
        check=check,
        samples_per_s=samples / span,
        tokens_per_s=tokens / span,
        trainer_idle=_mean([r.roles["trainer"].starved for r in window[1:]]),
        occupancy=_mean([r.occupancy for r in window[1:]]),
        staleness_mean=summary.staleness_mean,
        staleness_max=summary.staleness_max,
        reissued=summary.groups.reissued,
        bound_samples_per_s=bound,
        efficiency=(samples / span) / bound,
        run_dir=str(run_dir),
        controller_cpu=summary.controller.cpu_share,
        controller_p50_ms=summary.controller.latency_p50_ms,
        controller_p99_ms=summary.controller.latency_p99_ms,
        controller_msgs_per_s=summary.controller.messages_per_s,
    )


def _variant(partial: bool, check: str) -> str:
    return ("" if partial else "-nopartial") + ("-strict" if check == "strict" else "")


def _mean(values: list) -> float:
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else math.nan


def real_ratio(out: pathlib.Path, steps: int) -> tuple[float, dict]:
    """The default model with vLLM on CPU: sync against async (max_staleness 2).

    The trainer trains on every group here, so that training and generation
    are of a similar size, the case the overlap is for.
    """
    from rlflow.tools.cli import default_config_path

    times = {}
    for mode, extra in (("sync", ["run.max_staleness=0"]), ("async", ["run.max_staleness=2"])):
        overrides = [
            f"run.mode={mode}", *extra, f"run.steps={steps}", "run.batch_size=16",
            "roles.trainer.engine.skip_uniform_groups=false", "eval.before=false", "eval.after=false",
            "eval.every_steps=0", "pools.generate.cpus_per_bundle=1.0", "pools.train.cpus_per_bundle=1.0",
        ]
        config = C.load(default_config_path(), overrides)
        run_dir = out / f"real-{mode}"
        shutil.rmtree(run_dir, ignore_errors=True)
        run(config, run_dir)
        rows = RunDir(run_dir).read_metrics()
        times[mode] = (rows[-1].time_s - rows[1].time_s) / (len(rows) - 2)
        write_timeline(load_run(run_dir), out / f"real-{mode}.png", out / f"real-{mode}.trace.json",
                       title=f"real {mode}: vLLM on CPU, default model")
    return times["sync"] / times["async"], times


def predict(r: Result, steps: int = 30) -> None:
    """`rlflow plan`'s throughput for the run's own layout, from the unit costs
    learned from the run, into `r.predicted_samples_per_s`."""
    workload, rollout_devices, trainer_devices = workload_from_run(r.run_dir)
    r.predicted_samples_per_s = simulate(workload, rollout_devices, trainer_devices, steps=steps).samples_per_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    modes = parser.add_mutually_exclusive_group()
    modes.add_argument("--quick", action="store_true", help="the reference workload only (under 3 minutes)")
    modes.add_argument("--scale", action="store_true",
                       help="1,024, 4,096 and 16,384 slots, the controller's load, and the planner against them")
    parser.add_argument("--out", type=pathlib.Path, default=RESULTS)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    work = pathlib.Path(tempfile.mkdtemp(prefix="rlflow-longtail-"))

    import ray

    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, configure_logging=False, namespace="rlflow")
    started = time.monotonic()
    results: list[Result] = []
    real = None
    try:
        steps_async, steps_sync = (14, 6) if args.quick or args.scale else (24, 10)
        if args.scale:
            for w in SCALE:
                results.append(measure(w, "async", 2, steps_async, work))
                predict(results[-1])
        else:
            if not args.quick:
                real, real_times = real_ratio(work, 10)
            async_ref = measure(REFERENCE, "async", 2, steps_async, work)
            sync_ref = measure(REFERENCE, "sync", 0, steps_sync, work)
            colocated = measure(REFERENCE, "sync", 0, steps_sync, work, colocated=True)
            results += [async_ref, sync_ref, colocated]
        if not args.quick and not args.scale:
            for mode, k in (("one_step", 1), ("async", 1), ("async", 4)):
                results.append(measure(REFERENCE, mode, k, steps_async, work))
            results.append(measure(REFERENCE, "async", 2, steps_async, work, partial=False))
            results.append(measure(REFERENCE, "async", 2, steps_async, work, check="strict"))
            sweep = [
                Workload("fixed", {"kind": "fixed", "value": 416}),
                Workload("lognormal-0.5", {"kind": "lognormal", "median": 256, "sigma": 0.5, "min": 1, "max": 4096}),
                Workload("lognormal-1.5", {"kind": "lognormal", "median": 256, "sigma": 1.5, "min": 1, "max": 4096}),
                Workload("pareto", {"kind": "pareto", "scale": 128, "alpha": 1.5, "max": 4096}),
                Workload("slots-8", REFERENCE.response_len, slots=8, batch_size=4),
                Workload("slots-256", REFERENCE.response_len, slots=256, batch_size=128),
                Workload("slots-1024", REFERENCE.response_len, slots=256, replicas=4, batch_size=512),
            ]
            for w in sweep:
                results.append(measure(w, "async", 2, steps_async, work))
                results.append(measure(w, "sync", 0, steps_sync, work))
    finally:
        ray.shutdown()

    by_workload: dict[str, dict[str, Result]] = {}
    for r in results:
        by_workload.setdefault(r.workload, {})[f"{r.mode}{r.staleness}{_variant(r.partial, r.check)}"] = r
    for name, runs in by_workload.items():
        sync = runs.get("sync0")
        coloc = runs.get("colocated-sync0")
        for r in runs.values():
            if sync is not None:
                r.vs["sync"] = r.samples_per_s / sync.samples_per_s
            if coloc is not None:
                r.vs["colocated_sync"] = r.samples_per_s / coloc.samples_per_s

    planned = f"{'planned':>9}{'ctl CPU':>8}{'msg/s':>7}{'p50 ms':>7}{'p99 ms':>7}" if args.scale else ""
    print(f"{'workload':<15}{'mode':<22}{'samples/s':>10}{'tokens/s':>10}{'trainer idle':>13}{'occupancy':>10}"
          f"{'stale mean/max':>15}{'vs sync':>8}{'vs coloc':>9}{'efficiency':>11}{planned}")
    for r in results:
        mode = f"{r.mode} k={r.staleness}{_variant(r.partial, r.check).replace('-', ' ')}"
        planned = (f"{r.predicted_samples_per_s:>9.1f}{r.controller_cpu:>8.1%}{r.controller_msgs_per_s:>7.0f}"
                   f"{r.controller_p50_ms:>7.2f}{r.controller_p99_ms:>7.2f}") if args.scale else ""
        print(f"{r.workload:<15}{mode:<22}{r.samples_per_s:>10.1f}{r.tokens_per_s:>10.0f}{r.trainer_idle:>13.0%}"
              f"{r.occupancy:>10.0%}{r.staleness_mean:>9.2f}/{r.staleness_max:<5g}"
              f"{r.vs.get('sync', math.nan):>8.2f}{r.vs.get('colocated_sync', math.nan):>9.2f}{r.efficiency:>11.2f}"
              f"{planned}")
    prefix = "longtail-scale-" if args.scale else "longtail-"
    for r in results:
        for suffix in (".png", ".trace.json"):
            src = work / f"{pathlib.Path(r.run_dir).name}{suffix}"
            if src.exists():
                shutil.copy(src, args.out / f"{prefix}{src.name}")
    if real is not None:
        for mode in ("sync", "async"):
            for suffix in (".png", ".trace.json"):
                src = work / f"real-{mode}{suffix}"
                if src.exists():
                    shutil.copy(src, args.out / f"longtail-{src.name}")
    (args.out / ("longtail-scale.json" if args.scale else "longtail.json")).write_text(json.dumps({
        "quick": args.quick,
        "scale": args.scale,
        "seconds": round(time.monotonic() - started, 1),
        "results": [r.__dict__ for r in results],
        "real": None if real is None else {"async_vs_sync": real, "step_s": real_times},
    }, indent=1) + "\n")
    shutil.rmtree(work, ignore_errors=True)
    if args.scale:
        errors = [abs(r.predicted_samples_per_s - r.samples_per_s) / r.samples_per_s for r in results]
        wide = results[2]
        print(
            f"RESULT longtail_scale slots_1024_efficiency={results[0].efficiency:.2f} "
            f"slots_4096_efficiency={results[1].efficiency:.2f} slots_16384_efficiency={wide.efficiency:.2f} "
            f"controller_cpu_16384={wide.controller_cpu:.3f} controller_p99_ms_16384={wide.controller_p99_ms:.2f} "
            f"plan_error_max={max(errors):.3f}"
        )
        return
    real_text = "skipped" if real is None else f"{real:.2f}"
    print(
        f"RESULT longtail workload=reference async_vs_sync={async_ref.samples_per_s / sync_ref.samples_per_s:.2f} "
        f"bound_efficiency={async_ref.efficiency:.2f} "
        f"async_vs_colocated_sync={async_ref.samples_per_s / colocated.samples_per_s:.2f} "
        f"real_async_vs_sync={real_text}"
    )

if __name__ == "__main__":
    sys.exit(main())
