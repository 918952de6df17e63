"""PPO on the default model for real: vLLM on CPU generates one sample per
prompt, a torch critic on its own pool attaches GAE advantages, the torch
trainer takes its steps on them; the critic holds the actor through its
warm-up and ends up valuing prompts by how often the policy gets them
right."""

from __future__ import annotations

import pathlib

import numpy as np
import pytest

from rlflow import config as C
from rlflow.control.launch import run
from rlflow.rundir import RunDir

# About 8 s a step on a loaded 2-core machine: 40 steps, two evaluations and the start take over 300 s.
pytestmark = [pytest.mark.ray, pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(1200)]

PPO = pathlib.Path(__file__).resolve().parent.parent / "examples" / "ppo.toml"
STEPS = 40


def prompt_values(critic_dir: pathlib.Path) -> dict[int, float]:
    """The critic's mean value at the first response token of held-out problems, by digits
    (its checkpoint holds the policy's tokenizer)."""
    from rlflow.protocol import FinishReason, PromptGroup, Response, build_batch
    from rlflow.services.critic.torch_engine import CriticModel

    from rlflow.data.tasks import Arith, load_tokenizer

    tokenizer = load_tokenizer(critic_dir)
    arith = Arith(C.ArithTask().digit_weights, heldout_size=400)
    items, digits = [], []
    for g, (a, b) in enumerate(arith.heldout):
        prompt = tokenizer.encode(Arith.prompt_text(a, b), add_special_tokens=False)
        first = np.asarray(tokenizer.encode(Arith.solution(a, b), add_special_tokens=False)[:1], np.int32)
        items.append((PromptGroup(group_id=g, prompt_ids=prompt, n=1),
                      [Response(first, np.zeros(1, np.float32), np.zeros(1, np.int32), FinishReason.STOP)]))
        digits.append(len(str(a)))
    critic = CriticModel(C.TorchCritic(), str(critic_dir))
    values = critic.values(build_batch(items))
    digits = np.array(digits)
    return {d: float(values[digits == d].mean()) for d in sorted(set(digits.tolist()))}


def test_a_ppo_run_on_the_default_model_trains_its_critic(ray_cluster, tmp_path):
    run_dir = tmp_path / "run"
    config = C.load(PPO, [f"run.steps={STEPS}", "eval.every_steps=0", "task.heldout_size=400"])
    summary = run(config, run_dir)
    assert summary.state == "stopped", summary.error
    folder = RunDir(run_dir)
    rows = folder.read_metrics()
    assert [r.train.get("actor_held", 0.0) for r in rows[:6]] == [1.0] * 5 + [0.0]
    # It values prompts with more digits, which the policy gets right less often, lower.
    by_digits = prompt_values(folder.critic_checkpoint(STEPS))
    assert by_digits[1] > by_digits[2] > by_digits[3] > by_digits[4], by_digits
