"""A few steps end to end: real vLLM on CPU and the real trainer, on Ray."""

from __future__ import annotations

import collections
import json
import pathlib
import subprocess
import sys
import time

import psutil

import pytest
from conftest import late_starts, trained_groups
from models import tiny_model

from rlflow import config as C
from rlflow.control.launch import run
from rlflow.rundir import RunDir

# Timeout: the slowest of these took 388 s on a loaded 2-core machine.
pytestmark = [pytest.mark.ray, pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(1200)]

ROOT = pathlib.Path(__file__).resolve().parent.parent

#: The run's tables, less its model (`real_config` adds it, and what the real run changes).
CONFIG = {
    "pools": {"generate": {"cpus_per_bundle": 1.0}, "train": {"cpus_per_bundle": 1.0}},
    # Two vLLM engines took 193 s to start on a 2-core machine busy with other work (8.5 s alone).
    "cluster": {"handshake_timeout_s": 900},
    "roles": {
        "rollout": {"pool": "generate", "engine": {
            "kind": "vllm", "max_num_seqs": 32, "max_tokens": 24, "kv_cache_bytes": 33554432}},
        "reward": {"pool": "generate", "engine": {"kind": "task"}},
        "trainer": {"pool": "train", "engine": {"kind": "torch", "lr": 1e-3, "checkpoint_every": 2}},
    },
    "task": {"kind": "arith", "heldout_size": 24},
    "eval": {"every_steps": 2},
    # Reproducible (sync, run.deterministic): the test of that runs it a second time.
    "run": {"mode": "sync", "deterministic": True, "batch_size": 4, "samples_per_prompt": 4, "steps": 3},
}


#: The real run below has two trainer ranks and two rollout replicas; it resumes on one of each.
TWO = ["roles.trainer.replicas=2", "roles.rollout.replicas=2"]
ONE = ["roles.trainer.replicas=1", "roles.rollout.replicas=1"]


def real_config(model: pathlib.Path, *overrides: str) -> C.Config:
    """`CONFIG` on `model`, its weights sent in 64 KiB pieces, on two trainer ranks and two rollout replicas
    (then `overrides`)."""
    return C.build(CONFIG, {"roles": {
        "rollout": {"model": str(model)},
        # A format reward that some samples of most groups meet (the tiny model's
        # arithmetic earns nothing): there is something to learn at every step.
        "reward": {"engine": {"kind": "functions", "check_references": 0, "functions": [
            {"path": "rlflow.rewards:regex", "kwargs": {"pattern": "^[0-4]"}, "workers": 1}]}},
        "trainer": {"engine": {"bucket_bytes": 65536}},
    }}, overrides=[*TWO, *overrides])


@pytest.fixture(scope="module")
def real_run(ray_cluster, tmp_path_factory):
    """3 steps of two real vLLM replicas' samples trained by the torch trainer
    on 2 ranks (FSDP2 over gloo), its weights broadcast to both replicas in
    one group, in 64 KiB pieces; held-out evaluations and checkpoints every 2
    steps; reproducible (sync, `run.deterministic`). One run (a start of Ray
    actors and vLLM engines costs more than its steps) that the tests below
    read, one runs again, and the last resumes."""
    root = tmp_path_factory.mktemp("e2e")
    model = tiny_model(root / "model", tied=False, seed=11)
    config = real_config(model)
    run_dir = root / "run"
    summary = run(config, run_dir)
    return model, run_dir, summary


def test_a_few_steps_with_real_vllm_and_the_real_trainer(real_run):
    _, run_dir, summary = real_run
    assert summary.state == "stopped", summary.error
    folder = RunDir(run_dir)
    steps = folder.read_metrics()
    assert [r.step for r in steps] == [0, 1, 2]
    assert all(r.samples == 16 for r in steps)
    assert late_starts(run_dir, 4, 2) == []
    assert all(0.0 <= r.reward_mean <= 1.0 for r in steps)
    # Weights really moved to the rollout: it loaded every version.
    assert summary.weights_load_s_mean > 0
    # Held-out evaluations: before, every 2 steps, after.
    evals = folder.read_evals()
    assert evals[0].version == 0 and evals[-1].version == 3
    assert all(e.metrics["problems"] == 24 for e in evals)
    assert summary.accuracy_before == evals[0].accuracy
    # The services got the model as an absolute path, resolved once at launch.
    assert C.load(folder.config).roles.rollout.model == str((run_dir.parent / "model").resolve())
    # Checkpoints every 2 steps and at the end, each a model directory.
    done = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert done == ["step-000002", "step-000003"]
    for name in done:
        assert (run_dir / "checkpoints" / name / "model.safetensors").exists()
        assert (run_dir / "checkpoints" / name / "controller_state.json").exists()


def test_a_trainer_of_two_ranks_end_to_end(real_run):
    """Every step trained on both ranks; the final checkpoint is a Hugging Face
    model and a distributed checkpoint of the optimizer."""
    from transformers import AutoModelForCausalLM

    model, run_dir, summary = real_run
    assert summary.state == "stopped", summary.error
    rows = RunDir(run_dir).read_metrics()
    assert [r.step for r in rows] == [0, 1, 2] and all(r.samples == 16 for r in rows)
    assert len([g for g in trained_groups(run_dir) if g[0] < 3]) == 3 * 4  # every group of every step, once
    assert sum(r.train["trained_tokens"] for r in rows) > 0
    folder = run_dir / "checkpoints" / "step-000003"
    assert (folder / "optimizer").is_dir()
    trained = AutoModelForCausalLM.from_pretrained(folder)
    start = AutoModelForCausalLM.from_pretrained(model)
    assert max((a - b).abs().max().item() for a, b in zip(trained.parameters(), start.parameters())) > 0
    assert (run_dir / "logs" / "trainer-1.log").exists()
    generated = collections.Counter()
    for line in RunDir(run_dir).ledger.read_text().splitlines():
        event = json.loads(line)
        if event["event"] == "generated":
            generated[event["replica"]] += len(event["groups"])
    assert set(generated) == {"rollout-0", "rollout-1"}, generated  # both replicas generated, on new weights too


def test_a_run_resumes_from_its_last_checkpoint_detached(real_run, ray_cluster):
    """`rlflow up --resume --detach` of the two-rank run on one trainer rank
    (and one rollout replica): the distributed checkpoint of the optimizer
    loads on one rank, and the run goes on from where it was."""
    _, run_dir, _ = real_run
    folder = RunDir(run_dir)
    config_before = folder.config.read_text()
    evals_before = folder.read_evals()
    up = subprocess.run(
        [sys.executable, "-m", "rlflow", "up", "--resume", str(run_dir), "--steps", "4", "--detach",
         "--set", f"cluster.address={ray_cluster}", *(f"--set={o}" for o in ONE)],
        capture_output=True, text=True, timeout=600,
    )
    assert up.returncode == 0, up.stderr[-3000:]
    pid = int(folder.run_pid.read_text())
    deadline = time.monotonic() + 600
    while psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < deadline, "the resumed run did not finish"
        time.sleep(0.5)
    assert folder.read_summary().state == "stopped", folder.run_log.read_text()[-3000:]
    steps = folder.read_metrics()
    assert [r.step for r in steps] == [0, 1, 2, 3]
    assert steps[-1].version == 4
    # The resumed run is this run, continued: its config is the same but for
    # the resume point, the steps and the ranks and replicas asked for.
    assert C.load(folder.config).roles == C.load(text=config_before, overrides=ONE).roles
    state = json.loads((folder.checkpoint(4) / "controller_state.json").read_text())
    assert state["step"] == 4
    assert (folder.checkpoint(4) / "model.safetensors").exists()
    # One record: the evaluations of the checkpoint it resumed from and before are kept (that of
    # step 3 is not made again), then the final one.
    evals = folder.read_evals()
    assert any(e.step == 3 for e in evals_before)
    assert evals[:-1] == evals_before and (evals[-1].step, evals[-1].version) == (4, 4)
    summary = folder.read_summary()
    assert (summary.steps, summary.sessions, summary.session.first_step, summary.session.steps) == (4, 2, 3, 1)
    assert summary.samples == sum(r.samples for r in steps)


def test_a_deterministic_sync_run_writes_the_same_record_twice(real_run, tmp_path_factory):
    """`run.deterministic` in sync mode: the real run made again on one vLLM replica (the first had
    two, which raced for the groups; the trainer's two ranks reduce their gradients in both) writes
    the same metrics and evaluations, but for what measures time; the run samples (temperature 1) and
    learns (the rewards and the loss move). Its first three steps alone: another test resumes it."""
    model, run_dir, _ = real_run
    again = tmp_path_factory.mktemp("again") / "run"
    summary = run(real_config(model, "roles.rollout.replicas=1"), again)
    assert summary.state == "stopped", summary.error

    def record(folder: RunDir) -> tuple[list[dict], list[dict]]:
        return ([r.learning() for r in folder.read_metrics() if r.step < 3],
                [e.learning() for e in folder.read_evals() if e.version <= 3])

    (steps, evals), (steps_again, evals_again) = record(RunDir(run_dir)), record(RunDir(again))
    assert [r["step"] for r in steps] == [0, 1, 2] and [e["version"] for e in evals] == [0, 2, 3]
    assert steps == steps_again and evals == evals_again
    assert len({r["reward_mean"] for r in steps}) > 1 and len({r["train"]["loss"] for r in steps}) == 3
