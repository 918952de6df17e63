"""examples/ppo.toml for real: vLLM on CPU generates one sample per prompt, a
torch critic on its own pool attaches GAE advantages, the torch trainer
takes its steps on them, and the critic holds the actor through its
warm-up; the policy learns what the reward asks for. (That a critic learns
to value prompts is tests/test_critic.py's; how far PPO gets on the default
task, against GRPO, is bench/critic.py's.)"""

from __future__ import annotations

import math
import pathlib

import pytest

from rlflow import config as C
from rlflow.control.launch import run
from rlflow.rundir import RunDir

# Timeout: a whole real-vLLM run, whose start alone took minutes on a busy machine.
pytestmark = [pytest.mark.ray, pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(1200)]

PPO = pathlib.Path(__file__).resolve().parent.parent / "examples" / "ppo.toml"
STEPS = 24  # a warm-up step of the critic's, then the actor's
MAX_TOKENS = 8
#: The reward: an answer that starts with 1, as about a third of the default model's do at first (a
#: signal at the first token, which PPO's per-token credit gives that token): one the default model
#: learns in a few steps, where its arithmetic takes a hundred.
REWARD = ('roles.reward.engine={kind = "functions", check_references = 0, functions = '
          '[{path = "rlflow.rewards:regex", kwargs = {pattern = "^1"}, workers = 1}]}')


def test_the_ppo_example_warms_its_critic_up_then_its_policy_learns(ray_cluster, tmp_path):
    run_dir = tmp_path / "run"
    # 32 prompts a step, not the example's 128, at ten times its learning rate: a few steps to learn in. The
    # reward reads the first token alone, so responses stop at 8 tokens, not the example's 100 (which the
    # learning policy's reach, making the critic's and the trainer's steps twelve times as long).
    config = C.load(PPO, [f"run.steps={STEPS}", "roles.critic.warmup_steps=1", "eval.every_steps=0",
                          "eval.before=false", "eval.after=false", "run.batch_size=32", "roles.trainer.engine.lr=1e-3",
                          f"roles.rollout.engine.max_tokens={MAX_TOKENS}", REWARD,
                          "cluster.handshake_timeout_s=900"])  # vLLM starts slowly on a busy machine
    summary = run(config, run_dir)
    assert summary.state == "stopped", summary.error
    folder = RunDir(run_dir)
    rows = folder.read_metrics()
    assert [r.train.get("actor_held", 0.0) for r in rows] == [1.0] + [0.0] * (STEPS - 1)
    assert folder.role_checkpoint("critic", STEPS).exists()
    # The policy learns: the reward of the last steps' samples is far above that of the first ones' (made
    # by the starting policy, or one or two versions past it); 0.07 to 0.82 when this was written.
    first, last = (sum(r.reward_mean for r in part) / len(part) for part in (rows[:6], rows[-6:]))
    assert last > first + 0.3, [round(r.reward_mean, 2) for r in rows]
    assert all(math.isfinite(r.train["critic_value_loss"]) for r in rows)
