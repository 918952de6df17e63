"""A run of the user's own: a dataset task, reward functions (one the user's own module), a teacher the
trainer distills from, real vLLM on CPU and the real trainer on Ray; its vLLM engine core killed midway.
(Apart from test_e2e.py's run, so that the two runs' starts can go to the suite's two workers.)"""

from __future__ import annotations

import pathlib

import psutil

import pytest
from conftest import until_in_thread
from models import tiny_model

from rlflow import config as C
from rlflow.control.launch import run
from rlflow.rundir import RunDir

# Timeout: the slowest of these took 388 s on a loaded 2-core machine.
pytestmark = [pytest.mark.ray, pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(1200)]

ROOT = pathlib.Path(__file__).resolve().parent.parent


def own_config(model: pathlib.Path, teacher: pathlib.Path, data: pathlib.Path) -> C.Config:
    """A dataset task (`data`) scored by two reward functions, the second the user's own module's,
    with `teacher` scoring every token for the trainer to distill from (the run of `own_run`)."""
    return C.build({
        "pools": {"generate": {"cpus_per_bundle": 1.0}, "score": {"cpus_per_bundle": 0.5},
                  "train": {"cpus_per_bundle": 0.5}},
        "roles": {
            "rollout": {"pool": "generate", "model": str(model), "engine": {
                "kind": "vllm", "max_num_seqs": 32, "max_tokens": 24, "kv_cache_bytes": 33554432}},
            "reward": {"pool": "score", "engine": {"kind": "functions", "check_references": 4, "functions": [
                {"path": "rlflow.rewards:math", "kwargs": {"extract": "marker", "marker": "#"}, "workers": 1},
                {"path": "own_rewards:length", "weight": 0.0, "workers": 1}]}},
            "teacher": {"pool": "score", "engine": {"kind": "model", "model": str(teacher), "top_k": 4}},
            "trainer": {"pool": "train", "engine": {
                "kind": "torch", "lr": 1e-3, "distill_coef": 0.5, "distill": "topk", "kl_coef": 0.05}},
        },
        "task": {"kind": "dataset", "train": str(data), "eval_fraction": 0.25},
        "eval": {"every_steps": 0},
        "run": {"mode": "async", "batch_size": 4, "samples_per_prompt": 4, "steps": 2},
    }, overrides=[
        f"run.steps={OWN_STEPS}", "cluster.restart_backoff_s=0.1", "cluster.handshake_timeout_s=900",
        # A group generation made while the dying replica still counted as a member waits this long for it
        # (a live member joins in milliseconds; the replacement joins a generation of its own once it is up).
        "cluster.weight_timeout_s=10"])


#: Steps of the run below. The engine core is killed once step 2 is trained; beyond the groups the
#: credits let out before that (3 steps' worth), every step needs the restarted replica, so the kill
#: lands mid-run: a step takes well under a second here, and the killer looks every 50 ms. (24 steps
#: took 25 s of the run's time, the replica's restart 10 s of them.)
OWN_STEPS = 12


@pytest.fixture(scope="module")
def own_run(ray_cluster, tmp_path_factory):
    """A dataset task scored by reward functions, one of them the user's own
    module in the folder the run is launched from (the Ray workers were
    started elsewhere), with a teacher scoring every token on its own pool
    and the trainer distilling from it; once two steps are trained, the
    engine-core process of the live vLLM rollout replica is SIGKILLed. One
    run that the two tests below read: (run dir, summary, pids killed)."""
    import itertools
    import threading

    root = tmp_path_factory.mktemp("own")
    own = root / "own"
    own.mkdir()
    (own / "own_rewards.py").write_text("def length(sample):\n    return float(len(sample.response))\n")
    model = tiny_model(root / "model", tied=False, seed=11)
    teacher = tiny_model(root / "teacher", tied=False, seed=12)
    data = root / "arith.jsonl"
    with open(ROOT / "examples" / "data" / "arith.jsonl") as source:
        data.write_text("".join(itertools.islice(source, 40)))
    config = own_config(model, teacher, data)
    run_dir = root / "run"
    killed: list[int] = []

    def engine_core_killed() -> bool:
        """Once two steps are trained, SIGKILL the vLLM engine core under this
        test's own Ray (its processes descend from this one); whether it did."""
        if len(RunDir(run_dir).read_metrics()) < 2:
            return False
        for proc in psutil.Process().children(recursive=True):
            try:
                if "EngineCore" in " ".join(proc.cmdline() + [proc.name()]):
                    proc.kill()
                    killed.append(proc.pid)
            except psutil.NoSuchProcess:
                continue
        return bool(killed)

    def kill_engine_core() -> None:
        until_in_thread(engine_core_killed, timeout_s=600)

    killer = threading.Thread(target=kill_engine_core, daemon=True)
    killer.start()
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(own)
        summary = run(config, run_dir)
    killer.join(timeout=10)
    return run_dir, summary, killed


def test_own_data_reward_functions_and_a_teacher_end_to_end(own_run):
    run_dir, summary, _ = own_run
    assert summary.state == "stopped", summary.error
    rows = RunDir(run_dir).read_metrics()
    assert [r.step for r in rows] == list(range(OWN_STEPS))
    for row in rows:
        assert row.samples == 16 and 0.0 <= row.reward_mean <= 1.0
        assert row.train["kl_teacher"] == row.train["kl_teacher"]  # a number: the teacher scored every token
        assert "distill_loss" in row.train and "kl_loss" in row.train
    assert RunDir(run_dir).read_status().roles["reward"].counters.reward_calls["length.ok"] > 0
    evals = RunDir(run_dir).read_evals()
    assert {"pass_rate", "reward_mean"} <= set(evals[0].metrics) and evals[0].metrics["problems"] == 10.0


def test_a_dead_vllm_engine_ends_its_replica_which_is_restarted_and_nothing_is_lost(own_run):
    """SIGKILL the engine-core process of a live vLLM rollout replica: the
    replica does not go on failing every request; it ends, is restarted as a
    new incarnation, and the run finishes with a clean audit."""
    from rlflow.tools.audit import audit

    run_dir, summary, killed = own_run
    assert killed, "found no vLLM engine-core process to kill"
    assert summary.state == "stopped" and summary.steps == OWN_STEPS, summary.error
    status = RunDir(run_dir).read_status()
    assert status.roles["rollout"].restarts >= 1 and status.roles["rollout"].placed[0].incarnation >= 1
    # Lost as it died, found by the launcher or by a message that found no one; it said why first.
    assert any(w.startswith("rollout-0 ") and "EngineDead" in w for w in status.warnings), status.warnings
    result = audit(run_dir)
    assert (result.lost, result.duplicated, result.trained) == (0, 0, OWN_STEPS * 4), result
