"""The critic: what a pool of its own buys, and what PPO does on the default task.

First, the whole pipeline with simulated engines (real services on a local
Ray, real sockets), the trainer the bottleneck, in three layouts:

* own_pool: a critic role on a pool of its own, its forward pass and its step
  costing `--critic-cost` times the trainer's per token (a step is a forward
  and a backward pass and the update; a forward pass alone a third of that);
* inline: the same critic's forward pass and step done in the trainer's
  process before each actor step, as a one-worker design does
  (`roles.trainer.engine.inline_critic_s_per_token`);
* none: no critic (GRPO).

Each layout's steady throughput in tokens per second (after warm-up,
before the drain), and the trainer's share of that time starved for input
in the own-pool layout.

Then the real default model: the default GRPO run (32 prompts x 8 samples,
120 steps), then PPO (`examples/ppo.toml`: 128 prompts x 1 sample, a torch
critic on its own pool, evaluated every 20 steps) for as long as the GRPO
run trained, then stopped (`rlflow down`). Their held-out accuracy is
compared at equal wall time: the last evaluation each asked for by then (the
GRPO run's last, after its step 120). Ends with

    RESULT critic own_pool_vs_inline=R trainer_wait_share=W ppo_heldout=A grpo_heldout=G

Targets: R >= 1.5 at a critic cost of 0.5x the trainer's; W <= 0.05. A and
G are measured, with no target.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
SIM = ROOT / "examples" / "sim.toml"
PPO = ROOT / "examples" / "ppo.toml"
DEFAULT = ROOT / "rlflow" / "defaults" / "default.toml"

#: The trainer's time per token in the simulated layouts: the bottleneck.
TRAINER_S_PER_TOKEN = 1e-4


def sim_layout(layout: str, cost: float) -> list[str]:
    """Overrides of examples/sim.toml (its teacher left out) for one layout."""
    step = cost * TRAINER_S_PER_TOKEN
    forward = step / 3
    base = [
        "cluster.heartbeat_s=0.25",
        f"roles.trainer.engine.s_per_token={TRAINER_S_PER_TOKEN}",
        "roles.trainer.engine.weights_bytes=1048576",
        # A rollout fast enough that the trainer is what bounds the pipeline, its long tail included.
        "roles.rollout.engine.slots=256",
        "roles.rollout.engine.step_s=0.0005",
    ]
    if layout == "own_pool":
        return base + ["pools.value={cpus_per_bundle=0.25}", "roles.critic.pool=value", "roles.critic.engine.kind=sim",
                       f"roles.critic.engine.forward_s_per_token={forward}",
                       f"roles.critic.engine.step_s_per_token={step}"]
    if layout == "inline":
        return base + [f"roles.trainer.engine.inline_critic_s_per_token={forward + step}"]
    return base


def load_sim(overrides: list[str]):
    """examples/sim.toml without its teacher (not part of this comparison), with `overrides`."""
    from rlflow import config as C

    return C.build(C.read_toml(SIM), {"roles": {"teacher": None}, "pools": {"score": {"cpus_per_bundle": 0.25}}},
                   overrides=overrides)


def steady(run_dir: pathlib.Path, warmup: int = 3, drain: int = 2) -> dict[str, float]:
    """Samples and tokens per second, and the trainer's starved share, between
    the end of warm-up and the start of the drain. Tokens are the measure of
    throughput: response lengths are long-tailed, so the samples of a step
    vary in cost from run to run."""
    from rlflow.rundir import RunDir

    rows = RunDir(run_dir).read_metrics()
    window = rows[warmup - 1: len(rows) - drain]
    seconds = window[-1].time_s - window[0].time_s
    starved = sum(r.roles["trainer"].starved * (r.time_s - a.time_s) for a, r in zip(window, window[1:]))
    return {"samples_per_s": sum(r.samples for r in window[1:]) / seconds,
            "tokens_per_s": sum(r.tokens for r in window[1:]) / seconds, "trainer_starved": starved / seconds}


def simulated(work: pathlib.Path, steps: int, cost: float) -> dict[str, dict[str, float]]:
    from rlflow.control.launch import run

    out = {}
    for layout in ("own_pool", "inline", "none"):
        run_dir = work / f"sim-{layout}"
        shutil.rmtree(run_dir, ignore_errors=True)  # a run of its own each time, not a session added to the last
        summary = run(load_sim([*sim_layout(layout, cost), f"run.steps={steps}"]), run_dir)
        if summary.state != "stopped":
            raise RuntimeError(f"the {layout} run ended {summary.state}: {summary.error}")
        out[layout] = {**steady(run_dir), "trainer_busy": summary.roles["trainer"].busy}
        print(f"{layout:>9}: {out[layout]['tokens_per_s']:8.0f} tokens/s "
              f"({out[layout]['samples_per_s']:.1f} samples/s), "
              f"trainer starved {100 * out[layout]['trainer_starved']:.1f}% "
              f"(whole run: busy {100 * summary.roles['trainer'].busy:.0f}%)", flush=True)
    return out


# -- the real model ------------------------------------------------------------------------------


def run_config(path: pathlib.Path, run_dir: pathlib.Path, overrides: list[str]) -> pathlib.Path:
    """`rlflow up` of a config, in the foreground; its run directory (a
    finished run already there is taken as it is)."""
    summary = run_dir / "summary.json"
    if summary.exists() and json.loads(summary.read_text())["state"] == "stopped":
        print(f"  {run_dir.name}: done before", file=sys.stderr)
        return run_dir
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "rlflow", "up", "--config", str(path), "--run-dir", str(run_dir),
                           "--no-display", *[a for o in overrides for a in ("--set", o)]],
                          capture_output=True, text=True, cwd=ROOT)
    if done.returncode != 0:
        raise RuntimeError(f"{path.name} failed:\n{done.stderr[-3000:]}")
    print(f"  {run_dir.name}: {time.monotonic() - started:.0f} s", file=sys.stderr)
    return run_dir


def run_for(path: pathlib.Path, run_dir: pathlib.Path, overrides: list[str], seconds: float) -> pathlib.Path:
    """`rlflow up` of a config, stopped with `rlflow down` once it has trained
    for `seconds` (or at its last step, if that comes first)."""
    from rlflow.rundir import RunDir

    if (run_dir / "summary.json").exists():
        print(f"  {run_dir.name}: done before", file=sys.stderr)
        return run_dir
    started = time.monotonic()
    command = [sys.executable, "-m", "rlflow"]
    with subprocess.Popen([*command, "up", "--config", str(path), "--run-dir", str(run_dir), "--no-display",
                           *[a for o in overrides for a in ("--set", o)]], cwd=ROOT,
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) as up:
        while up.poll() is None:
            rows = RunDir(run_dir).read_metrics()
            if rows and rows[-1].time_s >= seconds:
                subprocess.run([*command, "down", str(run_dir)], cwd=ROOT, check=True, capture_output=True)
                break
            time.sleep(5)
        _, err = up.communicate()
    if up.returncode != 0:
        raise RuntimeError(f"{path.name} failed:\n{err[-3000:]}")
    print(f"  {run_dir.name}: {time.monotonic() - started:.0f} s", file=sys.stderr)
    return run_dir


def curve(run_dir: pathlib.Path) -> list[tuple[int, float, float]]:
    """(step, held-out accuracy, seconds since training started when it was asked for) of each evaluation."""
    from rlflow.rundir import RunDir

    folder = RunDir(run_dir)
    at = {r.step + 1: r.time_s for r in folder.read_metrics()}
    return [(e.step, e.accuracy, at.get(e.step, 0.0)) for e in folder.read_evals() if e.accuracy is not None]


def at_time(points: list[tuple[int, float, float]], seconds: float) -> tuple[int, float, float]:
    """The last evaluation asked for by `seconds`."""
    return [p for p in points if p[2] <= seconds + 1e-9][-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", type=pathlib.Path, help="where the runs go (default: a temporary folder)")
    parser.add_argument("--steps", type=int, default=30, help="steps of each simulated run")
    parser.add_argument("--critic-cost", type=float, default=0.5,
                        help="the critic's cost per token, times the trainer's")
    parser.add_argument("--grpo", type=pathlib.Path, help="a finished default run to take GRPO from")
    parser.add_argument("--ppo", type=pathlib.Path, help="a finished run of examples/ppo.toml to take PPO from")
    parser.add_argument("--sim-only", action="store_true", help="leave out the real model's runs")
    args = parser.parse_args()
    work = args.work or pathlib.Path(tempfile.mkdtemp(prefix="rlflow-critic-"))
    work.mkdir(parents=True, exist_ok=True)

    from rlflow.rundir import RunDir

    print(f"simulated, the critic at {args.critic_cost:g}x the trainer's cost per token:", flush=True)
    sims = simulated(work, args.steps, args.critic_cost)
    ratio = sims["own_pool"]["tokens_per_s"] / sims["inline"]["tokens_per_s"]
    share = sims["own_pool"]["trainer_starved"]
    print(f"tokens per second, own pool / inline: {ratio:.2f}x; own pool / no critic: "
          f"{sims['own_pool']['tokens_per_s'] / sims['none']['tokens_per_s']:.2f}x")
    result = {"sim": sims, "own_pool_vs_inline": ratio, "trainer_wait_share": share}
    ppo_acc = grpo_acc = None
    if not args.sim_only:
        from rlflow.tools.cli import build_model

        build_model(force=False)
        print("runs:", file=sys.stderr)
        grpo = args.grpo or run_config(DEFAULT, work / "grpo", [])
        trained = RunDir(grpo).read_metrics()[-1].time_s
        ppo = args.ppo or run_for(PPO, work / "ppo", ["eval.every_steps=20"], trained)
        curves = {"GRPO": curve(grpo), "PPO": curve(ppo)}
        for name, points in curves.items():
            print(f"{name:>5}: " + ", ".join(f"step {s}: {100 * a:.1f}% ({t:.0f} s)" for s, a, t in points))
        equal = min(points[-1][2] for points in curves.values())
        grpo_at, ppo_at = at_time(curves["GRPO"], equal), at_time(curves["PPO"], equal)
        grpo_acc, ppo_acc = grpo_at[1], ppo_at[1]
        print(f"at {equal:.0f} s: GRPO {100 * grpo_acc:.1f}% (step {grpo_at[0]}), PPO {100 * ppo_acc:.1f}% "
              f"(step {ppo_at[0]})")
        result.update(curves=curves, equal_s=equal, ppo_heldout=ppo_acc, grpo_heldout=grpo_acc)
    (work / "critic.json").write_text(json.dumps(result, indent=1))
    print(f"runs in {work}")
    print(f"RESULT critic own_pool_vs_inline={ratio:.2f} trainer_wait_share={share:.3f} "
          f"ppo_heldout={_figure(ppo_acc)} grpo_heldout={_figure(grpo_acc)}")


def _figure(x: float | None) -> str:
    return "none" if x is None else f"{x:.3f}"


if __name__ == "__main__":
    main()
