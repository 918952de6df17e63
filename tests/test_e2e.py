"""A few steps end to end: real vLLM on CPU and the real trainer, on Ray."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest
from conftest import late_starts
from models import tiny_model

from rlflow import config as C
from rlflow.run import run

pytestmark = [pytest.mark.ray, pytest.mark.vllm, pytest.mark.slow]

CONFIG = """
[pools.generate]
cpus_per_bundle = 1.0
[pools.train]
cpus_per_bundle = 1.0

[roles.rollout]
pool = "generate"
model = "{model}"
[roles.rollout.engine]
kind = "vllm"
max_num_seqs = 32
max_tokens = 24
kv_cache_bytes = 33554432

[roles.reward]
pool = "generate"
[roles.reward.engine]
kind = "task"

[roles.trainer]
pool = "train"
[roles.trainer.engine]
kind = "torch"
lr = 1e-3
checkpoint_every = 2

[task]
kind = "arith"
heldout_size = 24

[eval]
every_steps = 2

[run]
mode = "async"
batch_size = 4
samples_per_prompt = 4
steps = 3
"""


def rows(path: pathlib.Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def real_run(ray_cluster, tmp_path_factory):
    root = tmp_path_factory.mktemp("e2e")
    model = tiny_model(root / "model", tied=False, seed=11)
    config = C.load(text=CONFIG.format(model=model))
    run_dir = root / "run"
    summary = run(config, run_dir)
    return run_dir, summary


def test_a_few_steps_with_real_vllm_and_the_real_trainer(real_run):
    run_dir, summary = real_run
    assert summary["state"] == "stopped", summary["error"]
    steps = rows(run_dir / "metrics.jsonl")
    assert [r["step"] for r in steps] == [0, 1, 2]
    assert all(r["samples"] == 16 for r in steps)
    assert late_starts(run_dir, 4, 2) == []
    assert all(0.0 <= r["reward_mean"] <= 1.0 for r in steps)
    # Weights really moved to the rollout: it loaded every version.
    assert summary["weights_load_s_mean"] > 0
    # Held-out evaluations: before, every 2 steps, after.
    evals = rows(run_dir / "evals.jsonl")
    assert [e["version"] for e in evals][0] == 0 and evals[-1]["version"] == 3
    assert all(e["problems"] == 24 for e in evals)
    assert summary["eval_accuracy_before"] == evals[0]["accuracy"]
    # Checkpoints every 2 steps and at the end, each a model directory.
    done = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert done == ["step-000002", "step-000003"]
    for name in done:
        assert (run_dir / "checkpoints" / name / "model.safetensors").exists()
        assert (run_dir / "checkpoints" / name / "controller_state.json").exists()


def test_a_run_resumes_from_its_last_checkpoint(real_run, ray_cluster):
    run_dir, _ = real_run
    done = subprocess.run(
        [sys.executable, "-m", "rlflow.cli", "up", "--resume", str(run_dir), "--steps", "4",
         "--set", f"cluster.address={ray_cluster}", "--no-display"],
        capture_output=True, text=True, timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    steps = rows(run_dir / "metrics.jsonl")
    assert [r["step"] for r in steps] == [0, 1, 2, 3]
    assert steps[-1]["version"] == 4
    state = json.loads((run_dir / "checkpoints" / "step-000004" / "controller_state.json").read_text())
    assert state["step"] == 4
