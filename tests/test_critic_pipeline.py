"""The critic role in the whole pipeline, on a real local Ray with real
sockets: a torch critic of two ranks (a tiny model) between simulated
engines. It attaches its columns on the way to the trainer, trains on what
passes within its staleness bound, holds the actor in its warm-up, shows in
the status and the report, and resumes from its checkpoint."""

from __future__ import annotations

import json
import pathlib

import pytest
from models import tiny_model

from rlflow import config as C
from rlflow.control.launch import run
from rlflow.rundir import RunDir
from rlflow.tools.plan import plan, workload_from_run
from rlflow.tools.report import report

# 19 s alone; a run and its resume of seven processes each took over 300 s under two busy loops.
pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(900)]

SIM = pathlib.Path(__file__).resolve().parent.parent / "examples" / "sim.toml"


def critic_config(model: pathlib.Path, *overrides: str) -> C.Config:
    """The simulated pipeline (its tokens within the tiny model's vocabulary) with a torch critic of two ranks."""
    return C.load(SIM, [
        "cluster.heartbeat_s=0.2",
        "cluster.handshake_timeout_s=600",
        f'roles.rollout.model="{model}"',
        "roles.rollout.engine.response_len={kind='lognormal', median=12, sigma=0.5, min=1, max=40}",
        "task.vocab_size=17",
        "task.prompt_len=6",
        "pools.value={bundles_per_node=2, cpus_per_bundle=0.5}",
        "roles.critic.pool=value",
        "roles.critic.replicas=2",
        f'roles.critic.engine={{kind="torch", model="{model}", micro_batch_tokens=256}}',
        "roles.critic.warmup_steps=1",
        "roles.critic.max_steps_owed=1",
        "roles.trainer.engine.checkpoint_every=2",
        "run.batch_size=4",
        "run.samples_per_prompt=2",
        *overrides,
    ])


def test_a_run_with_a_critic_attaches_trains_reports_and_resumes(ray_cluster, tmp_path):
    model = tiny_model(tmp_path / "model", tied=False, seed=7)
    run_dir = tmp_path / "run"
    summary = run(critic_config(model, "run.steps=4"), run_dir)
    assert summary.state == "stopped", summary.error
    folder = RunDir(run_dir)
    rows = folder.read_metrics()
    assert [r.step for r in rows] == [0, 1, 2, 3]
    # Its columns reached the trainer on every step; the actor was held in the warm-up alone.
    assert all("critic_value_loss" in r.train and "critic_staleness_max" in r.train for r in rows)
    assert [r.train.get("actor_held", 0.0) for r in rows] == [1.0, 0.0, 0.0, 0.0]
    # Values from a critic at most max_steps_owed steps behind its stream (the trainer may take a group a
    # step earlier or later than its place in the stream).
    assert max(r.train["critic_staleness_max"] for r in rows) <= 1 + 1
    status = folder.read_status()
    assert [name for name in status.roles] == ["rollout", "reward", "teacher", "critic", "trainer"]
    assert status.roles["critic"].replicas == 2 and status.roles["critic"].version >= 1
    # Both ranks took part in every step (rank 0 counts them); at shutdown it took the steps it owed.
    traces = {name: json.loads((folder.traces / f"{name}.json").read_text()) for name in ("critic-0", "critic-1")}
    assert traces["critic-0"]["counters"]["critic_steps"] >= 4
    assert {e[1] for e in traces["critic-1"]["events"]} >= {"busy", "starved"}
    text, _ = report(run_dir)
    assert "critic " in text and "critic over the last 4 steps" in text
    # `rlflow plan` takes the critic's costs from the run, and ranks layouts with and without its own pool.
    workload, _, _ = workload_from_run(run_dir)
    assert workload.learner.role == "critic"
    assert workload.learner.forward_s_per_token > 0 and workload.learner.step_s_per_token > 0
    ranked, section = plan(run_dir, devices=4)
    assert any(p.learner_devices for p in ranked) and "[roles.critic]" in section
    # Checkpoints of the critic beside the trainer's, and a resume from the newest.
    for step in (2, 4):
        saved = folder.role_checkpoint("critic", step)
        assert (saved / "run_state.json").is_file() and (saved / "model.safetensors").is_file()
    latest = folder.latest_checkpoint()
    assert latest is not None and latest.name == "step-000004"
    resumed = run(C.load(folder.config, [f'run.resume="{latest}"', "run.steps=6"]), run_dir)
    assert resumed.state == "stopped", resumed.error
    after = folder.read_metrics()[len(rows):]
    assert [r.step for r in after] == [4, 5]
    # The critic came back at its step 4: the values of the first step after the resume are its own.
    assert after[0].train["critic_version"] >= 4
    assert "up at version 4" in (run_dir / "logs" / "critic-0.log").read_text()
