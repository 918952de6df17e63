"""The controller on its own: no Ray, no services."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest
import trio

from rlflow import cli
from rlflow import config as C
from rlflow.controller import Controller, RunFailed

ROOT = pathlib.Path(__file__).resolve().parent.parent
SIM = ROOT / "examples" / "sim.toml"


class BrokenLauncher:
    """A launcher whose cluster has gone away."""

    def start(self, controller_address: str) -> None:
        raise RuntimeError("the cluster went away")

    def failures(self) -> list[str]:
        return []


async def test_a_controller_that_fails_says_so_in_status_and_summary(tmp_path):
    controller = Controller(C.load(SIM), tmp_path, "run-x", BrokenLauncher(), secret="s")
    with pytest.raises(RunFailed, match="RuntimeError: the cluster went away"):
        with trio.fail_after(30):
            await controller.run()
    for name in ("status.json", "summary.json"):
        written = json.loads((tmp_path / name).read_text())
        assert written["state"] == "failed"
        assert "RuntimeError: the cluster went away" in written["error"]
    assert (tmp_path / "controller.json").stat().st_mode & 0o077 == 0  # it holds the run's secret


def test_status_of_a_run_whose_controller_is_gone_says_dead(tmp_path):
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    status = {"state": "running", "pid": gone.pid, "host": cli.socket.gethostname(), "error": None}
    (tmp_path / "status.json").write_text(json.dumps(status))
    read = cli._read_status(tmp_path / "status.json")
    assert read["state"] == "dead"
    assert f"pid {gone.pid}" in read["error"]
    done = subprocess.run(
        [sys.executable, "-m", "rlflow.cli", "status", str(tmp_path), "--once"], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0 and "dead" in done.stdout
