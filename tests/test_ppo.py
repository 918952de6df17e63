"""examples/ppo.toml for real, a few steps: vLLM on CPU generates one sample
per prompt, a torch critic on its own pool attaches GAE advantages, the
torch trainer takes its steps on them, and the critic holds the actor
through its warm-up. (That a critic learns to value prompts is
tests/test_critic.py's; whether PPO learns the task is bench/critic.py's.)"""

from __future__ import annotations

import pathlib

import pytest

from rlflow import config as C
from rlflow.control.launch import run
from rlflow.rundir import RunDir

pytestmark = [pytest.mark.ray, pytest.mark.vllm, pytest.mark.slow]

PPO = pathlib.Path(__file__).resolve().parent.parent / "examples" / "ppo.toml"
STEPS = 2  # a warm-up step of the critic's, and one step of the actor


def test_the_ppo_example_runs_its_critic_warm_up_then_trains_the_actor(ray_cluster, tmp_path):
    run_dir = tmp_path / "run"
    # 16 prompts a step, not the example's 128: what is checked is the order of the critic's and the actor's
    # steps, whatever the batch.
    config = C.load(PPO, [f"run.steps={STEPS}", "roles.critic.warmup_steps=1", "eval.every_steps=0",
                          "eval.before=false", "eval.after=false", "run.batch_size=16"])
    summary = run(config, run_dir)
    assert summary.state == "stopped", summary.error
    folder = RunDir(run_dir)
    rows = folder.read_metrics()
    assert [r.train.get("actor_held", 0.0) for r in rows] == [1.0, 0.0]
    assert folder.critic_checkpoint(STEPS).exists()
