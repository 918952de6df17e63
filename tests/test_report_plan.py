"""`rlflow report` names the bottleneck; `rlflow plan` predicts real runs."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys
import tomllib

import pytest

from rlflow import config as C
from rlflow.tools.plan import simulate, workload_from_run
from rlflow.tools.report import bottleneck, load, report
from rlflow.control.launch import run
from rlflow.rundir import RunDir

pytestmark = pytest.mark.ray

EXAMPLE = pathlib.Path(__file__).resolve().parent.parent / "examples" / "sim-plan.toml"


def sim(tmp_path: pathlib.Path, name: str, *, rollouts: int = 1, reward_s: float = 0.0, reward_concurrency: int = 64,
        steps: int = 14):
    config = C.load(EXAMPLE, [
        f"pools.generate.bundles_per_node={rollouts}", f"roles.rollout.replicas={rollouts}",
        f"roles.reward.engine.latency_s={{kind='fixed', value={reward_s}}}",
        f"roles.reward.engine.concurrency={reward_concurrency}", f"run.steps={steps}",
    ])
    run_dir = tmp_path / name
    return run_dir, run(config, run_dir)


def test_the_bottleneck_sentence_names_the_slow_role():
    fractions = {
        "rollout": {"busy": 0.30, "starved": 0.0, "blocked": 0.65, "loading": 0.05},
        "reward": {"busy": 0.97, "starved": 0.03, "blocked": 0.0, "loading": 0.0},
        "trainer": {"busy": 0.59, "starved": 0.41, "blocked": 0.0, "loading": 0.0},
    }
    assert bottleneck(fractions) == (
        "bottleneck: reward. trainer starved 41%: waiting for reward; rollout blocked 65% on reward; "
        "reward replicas busy 97%"
    )
    trainer_bound = {
        "rollout": {"busy": 0.5, "starved": 0.5},
        "trainer": {"busy": 0.98, "starved": 0.02},
    }
    assert bottleneck(trainer_bound, max_staleness=2) == (
        "bottleneck: trainer. rollout starved 50%: out of credits until the trainer catches up "
        "(max_staleness = 2); trainer replicas busy 98%"
    )
    assert bottleneck({"rollout": {"busy": 0.9}, "trainer": {"busy": 0.92}}).startswith("balanced: ")


def test_the_sentence_names_kv_cache_pressure_when_it_holds_the_rollout_back():
    from rlflow.rundir import Summary
    from rlflow.tools.report import kv_pressure

    full = Summary(run_id="r", state="stopped", kv_cache_usage_mean=0.96, waiting_mean=14.5, preemptions=7)
    kv = kv_pressure(full)
    assert kv == ("rollout held back by its KV cache: 96% full on average, 14.5 requests waiting, 7 preemptions "
                  "(raise roles.rollout.engine.kv_cache_bytes, or gpu_memory_utilization on a GPU)")
    rollout_bound = {"rollout": {"busy": 0.97}, "trainer": {"busy": 0.5, "starved": 0.5}}
    assert bottleneck(rollout_bound, kv=kv).endswith(f"trainer starved 50%: waiting for rollout; {kv}; "
                                                     "rollout replicas busy 97%")
    # Not said when the cache has room, nor when the rollout is not what the run waits for.
    assert kv_pressure(Summary(run_id="r", state="stopped", kv_cache_usage_mean=0.4, preemptions=0)) == ""
    assert kv_pressure(Summary(run_id="r", state="stopped")) == ""
    assert "KV cache" not in bottleneck({"rollout": {"busy": 0.3}, "trainer": {"busy": 0.99}}, kv=kv)


def test_a_slow_reward_is_reported_as_the_bottleneck(ray_cluster, tmp_path):
    # One sample scored at a time, 12 ms each: the reward role cannot keep up.
    run_dir, summary = sim(tmp_path, "slow-reward", reward_s=0.012, reward_concurrency=1, steps=6)
    assert summary.state == "stopped"
    body, files = report(run_dir)
    assert "bottleneck: reward. trainer starved" in body
    assert "waiting for reward" in body
    names = sorted(p.name for p in files)
    assert names == ["curves.png", "timeline.png", "trace.json"]
    trace = json.loads((run_dir / "trace.json").read_text())
    lanes = {e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M"}
    assert lanes == {"rollout-0", "reward-0", "trainer-0"}
    assert {e["name"] for e in trace["traceEvents"] if e["ph"] == "X"} \
        >= {"generating", "scoring", "training", "starved"}
    cli = subprocess.run([sys.executable, "-m", "rlflow", "report", str(run_dir)], capture_output=True, text=True,
                         timeout=120)
    assert cli.returncode == 0 and "bottleneck: reward" in cli.stdout


def test_the_planner_learns_unit_costs_from_a_run_and_ranks_layouts(ray_cluster, tmp_path):
    """The planner's inputs come from a real run; how close its predictions
    come to measured runs is `bench/plan.py`'s (a timing target)."""
    one, _ = sim(tmp_path, "one-rollout", rollouts=1)
    workload, rollout_devices, trainer_devices = workload_from_run(one)
    assert (rollout_devices, trainer_devices) == (1, 1)
    assert workload.slots_per_device == 16 and workload.batch_size == 8 and workload.max_staleness == 2
    assert workload.trainer_device_s_per_token > 0 and workload.step_s > 0
    assert len(workload.lengths) == 14 * 8 * 4
    # A group's way from the rollout to the trainer, as the samples' stamps measured it each step; the
    # planner replays the wait for each sending replica's next message (a rollout and a reward of one).
    transits = [row.train["transit_s"] for row in RunDir(one).read_metrics()]
    assert len(transits) == 14 and all(0 < t < 5 for t in transits)
    assert workload.reward_s == pytest.approx(2 * 1 / 50 / 2)
    one_device, two_devices = (simulate(workload, n, 1, steps=30).samples_per_s for n in (1, 2))
    assert two_devices > one_device  # generation is the busier role here
    cli = subprocess.run([sys.executable, "-m", "rlflow", "plan", str(one), "--devices", "3"],
                         capture_output=True, text=True, timeout=120)
    assert cli.returncode == 0, cli.stderr
    assert "[pools.generate]" in cli.stdout and "samples/s" in cli.stdout
    pools = tomllib.loads(cli.stdout.split("Its pools:")[1].split("note:")[0])  # valid TOML to paste
    assert set(pools["pools"]) == {"generate", "train"} and pools["roles"]["rollout"]["pool"] == "generate"


def test_a_run_is_loaded_for_reporting(tmp_path):
    with pytest.raises(FileNotFoundError, match="is not a run directory"):
        load(tmp_path / "nothing")
