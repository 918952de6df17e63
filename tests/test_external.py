"""Replicas the user starts: `launch = "external"`. The reference external
reward replica (examples/external_reward.py: pyzmq and msgpack, no rlflow)
takes the reward role of a simulated run, is killed mid-run and started
again, and the run finishes with a clean audit; again across CURVE."""

from __future__ import annotations

import os
import pathlib
import shlex
import signal
import subprocess
import sys

import pytest
import trio

from rlflow.control.status import run_status
from rlflow.rundir import RunDir
from rlflow.startup import JOIN_ENV, join_environment

from test_controller import run_in_process, sim

ROOT = pathlib.Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "external_reward.py"


def start_replica(run_dir: pathlib.Path, rank: int = 0) -> subprocess.Popen:
    """The example, started as a user would: with `rlflow join`'s environment."""
    folder = RunDir(run_dir)
    env = {**os.environ, **join_environment(folder.read_join(), "reward", rank, str(folder.join))}
    with open(run_dir / f"external-{rank}.log", "ab") as log:
        return subprocess.Popen([sys.executable, str(EXAMPLE)], env=env, stdout=log, stderr=log)


@pytest.mark.parametrize("curve", ["auto", "on"])
@pytest.mark.slow  # a run, a restart and an external process
async def test_an_external_reward_replica_joins_survives_a_restart_and_nothing_is_lost(tmp_path, curve):
    from rlflow.tools.audit import audit

    config = sim("run.steps=12", "roles.reward.launch='external'", "roles.reward.pool=''", f"cluster.curve='{curve}'",
                 "cluster.heartbeat_timeout_s=2", "cluster.handshake_timeout_s=60")
    procs: list[subprocess.Popen] = []

    async def user(controller, launcher) -> None:
        while controller.address is None or not RunDir(tmp_path).join.exists():
            await trio.sleep(0.05)
        assert RunDir(tmp_path).join.stat().st_mode & 0o077 == 0  # it holds the run's secret
        procs.append(start_replica(tmp_path))
        while controller.ledger.steps_done < 4:
            await trio.sleep(0.05)
        procs[-1].send_signal(signal.SIGKILL)  # mid-run, as a crash would
        reward = controller.roster.replicas[("reward", 0)]
        while reward.registered:  # presumed lost (it went silent): its groups are granted again
            await trio.sleep(0.05)
        assert run_status(controller, trio.current_time()).waiting_for == ["reward-0"]
        procs.append(start_replica(tmp_path))  # the user starts it again

    try:
        with trio.fail_after(120):
            controller, summary = await run_in_process(config, tmp_path, during=user)
    finally:
        for proc in procs:
            try:
                proc.wait(timeout=15)  # told to shut down, it leaves on its own
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
    assert summary.state == "stopped" and summary.steps == 12, summary.error
    assert procs[-1].returncode == 0  # told to shut down, it said goodbye
    status = RunDir(tmp_path).read_status()
    reward = status.roles["reward"]
    assert (reward.restarts, reward.placed[0].external, reward.placed[0].state) == (1, True, "gone")
    assert any("reward-0 sent nothing for" in w for w in status.warnings), status.warnings
    result = audit(tmp_path)
    assert (result.lost, result.duplicated, result.trained) == (0, 0, 12 * 4), result
    rewards = [row.reward_mean for row in RunDir(tmp_path).read_metrics()]
    assert all(r is not None and 0 <= r <= 1 for r in rewards)  # scored by the example's function


def test_join_prints_what_an_external_replica_needs_and_spec_md_names_each(tmp_path):
    from rlflow.data.transport import new_curve_keys
    from rlflow.rundir import JoinInfo, write_json
    from rlflow.tools import cli

    folder = RunDir(tmp_path)
    keys = new_curve_keys()
    write_json(folder.join, JoinInfo(run_id="r1", controller="tcp://10.0.0.1:5000", secret="s3", host="",
                                     replicas={"rollout": 1, "reward": 2, "trainer": 1}, external=["reward-1"],
                                     curve=keys, handshake_timeout_s=90.0), private=True)
    done = subprocess.run([sys.executable, "-m", "rlflow", "join", str(tmp_path), "--role", "reward", "--rank", "1"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    exported = dict(shlex.split(line)[1].split("=", 1) for line in done.stdout.splitlines())  # as a shell reads it
    assert exported["RLFLOW_CONTROLLER"] == "tcp://10.0.0.1:5000" and exported["RLFLOW_REPLICAS"] == "2"
    assert exported["RLFLOW_CURVE_CLIENT_SECRET"] == keys.client_secret and set(exported) == set(JOIN_ENV)
    assert (exported["RLFLOW_HANDSHAKE_TIMEOUT_S"], exported["RLFLOW_HEARTBEAT_TIMEOUT_S"]) == ("90", "60")
    assert cli.main(["join", str(tmp_path), "--role", "reward", "--rank", "0"]) == 2  # rlflow starts that one
    assert cli.main(["join", str(tmp_path), "--role", "reward", "--rank", "5"]) == 2
    spec = (ROOT / "protocol" / "SPEC.md").read_text()
    assert all(f"`{name}`" in spec for name in JOIN_ENV)
