"""Multi-turn episodes whose tool calls take long-tailed time: synchronous steps
against asynchronous ones, the environment in the rollout's process against
on its own pool, and how the env role scales out.

Runs rlflow itself (controller, transport, services on a local Ray) with a
simulated rollout (64 slots) and trainer, and the simulated environment
`rlflow.env.sim:SimEnv` in the env role's worker processes: episodes of 1 to
8 turns (uniform), each turn answered after a lognormal wait (median 0.5 s,
sigma 1.25, cut at 30 s: a tool call's latency). Throughput is episodes
finished per second, between two trainer steps after the pipeline has
filled (the rollout's count of finished episodes; an in-line environment is
too slow for steps, and is measured over a time window instead).

* async_vs_sync: `run.mode = "async"` (staleness 4) over `"sync"` (a
  barrier per step: each step waits for its slowest episode);
* env_pool_vs_inline: the environment on its own pool (asynchronous) over
  the environment run in the rollout process, where the engine waits while
  a call runs (`roles.env.inline`, what a loop that calls its tools between
  generations does);
* slot_occupancy: the share of the engine's slot time in use in the
  asynchronous run with its own pool (slots busy while tools run);
* env_scale_4_efficiency: throughput with 4 env replicas over 4x the
  throughput with 1, where each replica runs 16 calls at once and the
  environment is the bottleneck.

Targets: async_vs_sync >= 3, env_pool_vs_inline >= 2, slot_occupancy >= 0.9,
env_scale_4_efficiency >= 0.8. Ends with

    RESULT agent async_vs_sync=S env_pool_vs_inline=P slot_occupancy=O env_scale_4_efficiency=E
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import trio

from rlflow import config as C
from rlflow.control import placement
from rlflow.control.launch import run
from rlflow.rundir import RunDir, Status

#: What every run here shares (`config_of` adds each one's values).
BASE = {
    "pools": {"generate": {"cpus_per_bundle": 0.5}, "score": {"cpus_per_bundle": 0.25},
              "train": {"cpus_per_bundle": 0.25}},
    "roles": {
        "rollout": {"pool": "generate", "engine": {
            "kind": "sim", "slots": 64,
            "response_len": {"kind": "lognormal", "median": 50, "sigma": 0.5, "min": 1, "max": 512}}},
        "env": {
            "timeout_s": 60, "max_turns": 8, "max_tokens": 8192,
            "environment": {"path": "rlflow.env.sim:SimEnv", "kwargs": {
                "min_turns": 1, "max_turns": 8, "observation_chars": 16,
                "latency": {"kind": "lognormal", "median": 0.5, "sigma": 1.25, "max": 30.0}}},
        },
        "reward": {"pool": "score", "engine": {"kind": "env"}},
        "trainer": {"pool": "train", "engine": {"kind": "sim", "s_per_token": 1e-7, "weights_bytes": 65536}},
    },
    "cluster": {"heartbeat_s": 0.25, "progress_timeout_s": 600},
    "eval": {"before": False, "after": False, "every_steps": 0},
    "run": {"batch_size": 8, "samples_per_prompt": 8, "steps": 100000},
}


@dataclass
class Window:
    """What a run's status said over time, and the window measured."""

    warm_steps: int
    window_s: float
    by_steps: bool
    seen: list[tuple[float, int, int, float]] = field(default_factory=list)
    """(time, step, episodes finished, slot seconds) at each status."""
    start: tuple[float, int, int, float] | None = None
    end: tuple[float, int, int, float] | None = None
    slots: int = 64
    """The engine slots of the run (its rollout replicas' together)."""

    def observe(self, status: Status) -> bool:
        """Note a status; whether the window is over."""
        rollout = status.roles.get("rollout")
        if rollout is None or status.state != "running":
            return False
        now = (time.monotonic(), status.step, rollout.counters.episodes, rollout.counters.slot_s)
        stepped = self.seen and now[1] != self.seen[-1][1]
        self.seen.append(now)
        if self.start is None:
            if now[1] >= self.warm_steps and (stepped or not self.by_steps):
                self.start = now
            return False
        waited = now[0] - self.start[0]
        if waited >= self.window_s and (stepped or not self.by_steps or waited >= 4 * self.window_s):
            self.end = now
            return True
        return False

    @property
    def episodes_per_s(self) -> float:
        return (self.end[2] - self.start[2]) / (self.end[0] - self.start[0])

    @property
    def occupancy(self) -> float:
        return (self.end[3] - self.start[3]) / ((self.end[0] - self.start[0]) * self.slots)

    def more(self) -> str:
        """What a window of a kind of its own also measured, for the line `measure` prints."""
        return ""


def config_of(*, mode: str, step_s: float, replicas: int, workers: int, concurrency: int, inline: bool = False,
              max_staleness: int = 4) -> C.Config:
    """The run of one configuration: the environment on a pool of its own (`replicas` bundles), else in
    line in the rollout's process; `max_staleness` in async mode (sync's is its own)."""
    env_pool = {} if inline else {"pools": {"tools": {"bundles_per_node": replicas,
                                                      "cpus_per_bundle": 0.25 if replicas > 1 else 0.5}},
                                  "roles": {"env": {"pool": "tools"}}}
    return C.build(BASE, env_pool, {
        "roles": {"rollout": {"engine": {"step_s": step_s}},
                  "env": {"replicas": replicas, "inline": inline, "workers": workers, "concurrency": concurrency}},
        "run": {"mode": mode, "max_staleness": max_staleness if mode == "async" else None},
    })


def measure(work: pathlib.Path, name: str, window: Window, config: C.Config | None = None,
            also: Callable[[Status], None] | None = None, **fields) -> Window:
    """Run one configuration (`config`, else `config_of(**fields)`) until `window` is over (`also` sees
    each status too); the window."""
    config = config or config_of(**fields)
    run_dir = work / name
    stopping = threading.Event()

    def on_status(status: Status) -> None:
        if also is not None:
            also(status)
        if window.observe(status) and not stopping.is_set():
            stopping.set()
            threading.Thread(target=_stop, args=(run_dir,), daemon=True).start()

    _wait_for_cpus()
    started = time.monotonic()
    summary = run(config, run_dir, on_status=on_status)
    if window.end is None:
        raise RuntimeError(f"{name}: the run ended ({summary.state}: {summary.error}) before its window did")
    print(f"{name}: {window.episodes_per_s:.2f} episodes/s over {window.end[0] - window.start[0]:.0f} s "
          f"(steps {window.start[1]}-{window.end[1]}), slot occupancy {window.occupancy:.2f}{window.more()}; "
          f"run {time.monotonic() - started:.0f} s", flush=True)
    return window


def _wait_for_cpus(timeout_s: float = 120.0) -> None:
    """Until Ray has every CPU back from the last run (it frees them a little after its groups are gone)."""
    ray = placement.ray
    deadline = time.monotonic() + timeout_s
    while ray.available_resources().get("CPU", 0) < ray.cluster_resources().get("CPU", 0) - 1e-6:
        if time.monotonic() > deadline:
            raise RuntimeError(f"Ray still holds CPUs {timeout_s:g} s after the last run")
        time.sleep(0.5)


def _stop(run_dir: pathlib.Path) -> None:
    """`rlflow down`: the controller stops the run."""
    from rlflow.data import transport
    from rlflow.protocol import Shutdown

    info = RunDir(run_dir).read_controller()

    async def ask() -> None:
        async with transport.open_dealer(connect=info.address, curve=info.curve, name="bench") as dealer:
            await dealer.send(Shutdown(reason="the bench's window is over", secret=info.secret))
            await trio.sleep(0.2)

    trio.run(ask)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--window", type=float, default=60.0, help="seconds measured per run (at least)")
    parser.add_argument("--quick", action="store_true", help="windows of 20 s (the edit loop)")
    args = parser.parse_args()
    if args.quick:
        args.window = 20.0
    work = pathlib.Path(tempfile.mkdtemp(prefix="rlflow-agent-"))
    placement.start_ray(C.ClusterConfig())
    try:
        # A turn of 50 tokens takes ~1 s; a tool call 1.1 s on average: the engine is busy a little
        # under half of an episode's time, and 320 episodes in flight keep its 64 slots full.
        common = dict(step_s=0.02, replicas=1, workers=2, concurrency=256)
        sync = measure(work, "sync", Window(2, 2 * args.window, True), mode="sync", **common)
        pool = measure(work, "async", Window(3, args.window, True), mode="async", **common)
        inline = measure(work, "inline", Window(0, args.window, False), mode="async", inline=True, **common)
        # Environment-bound: faster turns, 16 calls at once per env replica.
        bound = dict(step_s=0.005, workers=1, concurrency=16, mode="async")
        one = measure(work, "env-1", Window(2, args.window, True), replicas=1, **bound)
        four = measure(work, "env-4", Window(3, args.window, True), replicas=4, **bound)
    finally:
        placement.stop_ray()
    result = {
        "async_vs_sync": pool.episodes_per_s / sync.episodes_per_s,
        "env_pool_vs_inline": pool.episodes_per_s / inline.episodes_per_s,
        "slot_occupancy": pool.occupancy,
        "env_scale_4_efficiency": four.episodes_per_s / (4 * one.episodes_per_s),
    }
    (work / "result.json").write_text(json.dumps(result, indent=1))
    print(f"results in {work}")
    print("RESULT agent " + " ".join(f"{k}={v:.2f}" for k, v in result.items()))


if __name__ == "__main__":
    sys.exit(main())
