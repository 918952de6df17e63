"""Chaos: kill replicas at random moments of one run, and audit it.

Runs rlflow itself (controller, transport, services on a local Ray) with
simulated engines: two rollout, two reward and one teacher replica, and
the trainer. During the run it

* SIGKILLs a random rollout, reward or teacher replica, `--kills` times, at
  random moments (a replica only once it is up again);
* SIGSTOPs one replica until the controller has presumed it dead and
  started its next incarnation (a hang: the process is there, it says
  nothing);
* SIGKILLs the trainer once, which ends the run, and resumes it from its
  newest checkpoint (`rlflow up --resume` does the same);

then replays the run's ledger (`rlflow audit`). Ends with

    RESULT chaos kills=K hangs=H trainer_resumes=R lost=L duplicated=D steps_completed=N

Target: lost=0 and duplicated=0. `--quick` is the test suite's shorter run.

`--real` runs the embedded default instead (vLLM on CPU, the torch
trainer, the default model and task): once uninterrupted, then again from
the same seed with two SIGKILLs of the rollout replica and one of its vLLM
engine-core process, at moments spread over the run; it audits both and
compares their held-out accuracy at the end:

    RESULT chaos_real kills=K engine_kills=E lost=L duplicated=D heldout_whole=A heldout_chaos=B gap_points=G

Targets: lost=0, duplicated=0, |gap_points| <= 3.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import random
import signal
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field

from rlflow import config as C
from rlflow.control.launch import request_stop, run
from rlflow.errors import RunFailed
from rlflow.rundir import RunDir, Status
from rlflow.tools.audit import audit

#: The run's config, less its steps and what the chaos needs of the cluster (`chaos_run` adds them).
CONFIG = {
    "pools": {
        "generate": {"bundles_per_node": 2, "cpus_per_bundle": 0.25},
        "score": {"bundles_per_node": 3, "cpus_per_bundle": 0.25},
        "train": {"cpus_per_bundle": 0.25},
    },
    "roles": {
        "rollout": {"pool": "generate", "replicas": 2, "engine": {
            "kind": "sim", "slots": 32, "step_s": 0.002,
            "response_len": {"kind": "lognormal", "median": 32, "sigma": 1.0, "min": 1, "max": 512}}},
        "reward": {"pool": "score", "replicas": 2, "engine": {
            "kind": "sim", "latency_s": {"kind": "lognormal", "median": 0.002, "sigma": 0.5}}},
        "teacher": {"pool": "score", "engine": {"kind": "sim", "s_per_token": 2e-6}},
        "trainer": {"pool": "train", "engine": {
            "kind": "sim", "s_per_token": 1e-4, "weights_bytes": 1048576, "checkpoint_every": 5}},
    },
    "run": {"mode": "async", "max_staleness": 2, "batch_size": 4, "samples_per_prompt": 4},
    "cluster": {"heartbeat_s": 0.5},
}

VICTIMS = ("rollout", "reward", "teacher")


@dataclass
class Chaos:
    """What was done to the run, and the run's status as it goes."""

    kills: int = 0
    hangs: int = 0
    trainer_kills: int = 0
    engine_kills: int = 0
    status: Status | None = None
    error: str = ""
    log: list[str] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def on_status(self, status: Status) -> None:
        self.status = status

    def note(self, text: str) -> None:
        self.log.append(f"{time.strftime('%H:%M:%S')} {text}")
        print(f"[chaos] {text}", file=sys.stderr, flush=True)


def up(status: Status | None, role: str, rank: int) -> tuple[int, int] | None:
    """(pid, incarnation) of replica (role, rank) if every replica of its role
    is up, else None."""
    if status is None or status.state != "running" or role not in status.roles:
        return None
    info = status.roles[role]
    if info.up < info.replicas:
        return None
    placed = [p for p in info.placed if p.rank == rank]
    return (placed[0].pid, placed[0].incarnation) if placed else None


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False


def wait_for(chaos: Chaos, ready, timeout_s: float = 120.0):
    """Wait until `ready(status)` gives something other than None; that."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not chaos.stop.is_set():
        value = ready(chaos.status)
        if value is not None:
            return value
        time.sleep(0.05)
    return None


def saboteur(chaos: Chaos, rng: random.Random, kills: int, hang: bool, kill_trainer: bool) -> None:
    """Do the damage, one thing at a time, at random moments."""
    plan = ["kill"] * kills + (["hang"] if hang else []) + (["trainer"] if kill_trainer else [])
    rng.shuffle(plan)
    if kill_trainer:  # the trainer last but a few kills: the resumed run gets some too
        plan.remove("trainer")
        plan.insert(max(0, len(plan) - 3), "trainer")
    for action in plan:
        time.sleep(rng.uniform(0.2, 1.5))
        role, rank = ("trainer", 0) if action == "trainer" else (rng.choice(VICTIMS), 0)
        if role != "trainer":
            rank = rng.randrange(2) if role != "teacher" else 0
        found = wait_for(chaos, lambda s, r=role, k=rank: up(s, r, k))
        if found is None:
            raise RuntimeError(f"{role}-{rank} was not up within 120 s")
        pid, incarnation = found
        killed_run = chaos.status.run_id
        os.kill(pid, signal.SIGSTOP if action == "hang" else signal.SIGKILL)
        chaos.note(f"{'SIGSTOP' if action == 'hang' else 'SIGKILL'} {role}-{rank} (pid {pid})")
        if action == "trainer":
            chaos.trainer_kills += 1
            # The run ends; wait for the resumed one to be running.
            wait_for(chaos, lambda s: True if s is not None and s.run_id != killed_run and s.state == "running"
                     else None, timeout_s=300)
            continue
        chaos.hangs += action == "hang"
        chaos.kills += action == "kill"
        # Presumed dead (at once, or after the heartbeat timeout for a hang):
        # wait for its next incarnation, so that no pid is used twice.
        back = wait_for(chaos, lambda s, r=role, k=rank: True if (u := up(s, r, k)) and u[1] > incarnation
                        else None, timeout_s=300)
        if back is None and not chaos.stop.is_set():
            raise RuntimeError(f"{role}-{rank} did not come back within 300 s")


#: Steps a run stopped by its saboteur (`chaos_run(..., steps=None)`) takes after the last damage: the
#: last victim's replacement at work.
STEPS_AFTER = 5


def sabotage(chaos: Chaos, *args, stop_run: pathlib.Path | None = None) -> None:
    """The saboteur's damage; with `stop_run`, the run in that folder is then stopped, a few steps on
    (at once if the saboteur failed)."""
    try:
        saboteur(chaos, *args)
        if stop_run is not None:
            at = chaos.status.step if chaos.status is not None else 0
            wait_for(chaos, lambda s: True if s is not None and s.step >= at + STEPS_AFTER else None, timeout_s=300)
    except Exception as exc:
        chaos.error = f"{type(exc).__name__}: {exc}"
        chaos.note(f"stopped: {chaos.error}")
    if stop_run is not None and not chaos.stop.is_set():
        chaos.note(f"stopping the run at step {chaos.status.step if chaos.status else '?'}")
        request_stop(stop_run, "the saboteur is done")


def chaos_run(work: pathlib.Path, *, kills: int, hang: bool, kill_trainer: bool, steps: int | None, seed: int = 0,
              hang_s: float = 10.0, backoff_s: float = 1.0) -> tuple[Chaos, object, int]:
    """One run under chaos (resumed once if the trainer is killed); (what
    was done, the audit, the steps completed). `steps` None: the run goes on
    until the saboteur is done, and `STEPS_AFTER` steps more. `backoff_s`: the first restart's delay."""
    rng = random.Random(seed)
    cluster = {"heartbeat_timeout_s": hang_s, "max_restarts": kills + 2, "restart_backoff_s": backoff_s}
    config = C.build(CONFIG, {"run": {"steps": steps or 1_000_000}, "cluster": cluster})
    run_dir = work / "run"
    chaos = Chaos()
    thread = threading.Thread(target=sabotage, args=(chaos, rng, kills, hang, kill_trainer), daemon=True,
                              kwargs={"stop_run": run_dir if steps is None else None})
    thread.start()
    resumes = 0
    try:
        while True:
            try:
                summary = run(config, run_dir, on_status=chaos.on_status)
                break
            except RunFailed as exc:
                if "trainer-0" not in str(exc) or resumes >= 1 or chaos.trainer_kills == 0:
                    raise  # only the trainer's death that the chaos caused is resumed from
                checkpoint = RunDir(run_dir).latest_checkpoint()
                chaos.note(f"the run stopped ({exc}); resuming from {checkpoint.name}")
                chaos.status = None
                config = C.load(RunDir(run_dir).config, [f'run.resume="{checkpoint}"'])
                resumes += 1
    finally:
        chaos.stop.set()
        thread.join(timeout=10)
    if summary.state != "stopped":
        raise SystemExit(f"the run did not finish: {summary.state}: {summary.error}")
    return chaos, audit(run_dir), summary.steps


def real_saboteur(chaos: Chaos, run_dir: pathlib.Path, steps: int) -> None:
    """Kill the rollout replica twice and its engine-core process once, at a
    quarter, a half and three quarters of the run's steps."""
    import psutil

    plan = [(steps // 4, "kill"), (steps // 2, "engine"), (3 * steps // 4, "kill")]
    for at, action in plan:
        found = wait_for(chaos, lambda s: up(s, "rollout", 0) if s is not None and s.step >= at else None,
                         timeout_s=3600)
        if found is None:
            return
        pid, _ = found
        if action == "engine":
            cores = [p for p in psutil.Process(pid).children(recursive=True)
                     if "EngineCore" in " ".join(p.cmdline() + [p.name()])]
            for core in cores:
                core.kill()
            chaos.note(f"SIGKILL rollout-0's vLLM engine core (pids {[c.pid for c in cores]}) at step {at}")
            chaos.engine_kills += bool(cores)
        else:
            os.kill(pid, signal.SIGKILL)
            chaos.kills += 1
            chaos.note(f"SIGKILL rollout-0 (pid {pid}) at step {at}")


def real(args: argparse.Namespace) -> None:
    """The default run, uninterrupted and under chaos, from one seed."""
    from rlflow.tools.cli import default_config_path

    overrides = [f"run.steps={args.real_steps}", f"run.seed={args.seed}", "cluster.handshake_timeout_s=900"]
    results = {}
    with tempfile.TemporaryDirectory(prefix="rlflow-chaos-real-") as tmp:
        work = args.work or pathlib.Path(tmp)
        for name in ("whole", "chaos"):
            config = C.load(default_config_path(), overrides)
            run_dir = work / name
            chaos = Chaos()
            thread = None
            if name == "chaos":
                thread = threading.Thread(target=real_saboteur, args=(chaos, run_dir, args.real_steps), daemon=True)
                thread.start()
            started = time.monotonic()
            summary = run(config, run_dir, on_status=chaos.on_status)
            chaos.stop.set()
            if thread is not None:
                thread.join(timeout=10)
            result = audit(run_dir)
            print(f"[chaos] {name}: {summary.state}, {summary.steps} steps in {time.monotonic() - started:.0f} s, "
                  f"held-out {summary.accuracy_after}, {summary.groups.reissued} groups granted again", file=sys.stderr)
            results[name] = (chaos, result, summary)
    (_, whole, whole_summary), (chaos, hit, chaos_summary) = results["whole"], results["chaos"]
    a, b = whole_summary.accuracy_after or 0.0, chaos_summary.accuracy_after or 0.0
    print(f"RESULT chaos_real kills={chaos.kills} engine_kills={chaos.engine_kills} lost={whole.lost + hit.lost} "
          f"duplicated={whole.duplicated + hit.duplicated} heldout_whole={a:.4f} heldout_chaos={b:.4f} "
          f"gap_points={100 * (b - a):.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kills", type=int, default=20)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="4 kills, 120 steps")
    parser.add_argument("--work", type=pathlib.Path, help="keep the run here (default: a temporary folder)")
    parser.add_argument("--real", action="store_true", help="the embedded default (vLLM), whole and under chaos")
    parser.add_argument("--real-steps", type=int, default=60, help="steps of each --real run")
    args = parser.parse_args()
    if args.real:
        return real(args)
    kills, steps = (4, 120) if args.quick else (args.kills, args.steps)
    with tempfile.TemporaryDirectory(prefix="rlflow-chaos-") as tmp:
        work = args.work or pathlib.Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        started = time.monotonic()
        chaos, result, done = chaos_run(work, kills=kills, hang=True, kill_trainer=True, steps=steps,
                                        seed=args.seed)
        print(f"{time.monotonic() - started:.0f} s; {len(chaos.log)} actions", file=sys.stderr)
        for reason, count in result.reasons.most_common():
            print(f"dropped {count}: {reason}", file=sys.stderr)
    incomplete = chaos.kills < kills or chaos.hangs < 1 or chaos.trainer_kills < 1
    if incomplete:
        print(f"the chaos did not finish ({chaos.error or 'the run ended first: give it more --steps'}): "
              f"{chaos.kills} kills, {chaos.hangs} hangs, {chaos.trainer_kills} trainer kills", file=sys.stderr)
    print(f"RESULT chaos kills={chaos.kills} hangs={chaos.hangs} trainer_resumes={chaos.trainer_kills} "
          f"lost={result.lost} duplicated={result.duplicated} steps_completed={done}")
    if incomplete or result.lost or result.duplicated:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
