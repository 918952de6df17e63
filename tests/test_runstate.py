"""Dead is dead everywhere: one function decides a run's state from its
files and its processes, and `rlflow status`, `down`, `report` and `audit`
all say what it says."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time

import msgspec
import pytest
import trio
from test_controller import run_in_process, sim

from rlflow.rundir import RunDir, Status
from rlflow.runstate import RUN_ID_VAR, alive, run_state
from rlflow.tools.cli import main


def write_status(folder: RunDir, **fields) -> None:
    status = {"run_id": "r-1", "state": "running", "host": socket.gethostname(), **fields}
    folder.path.mkdir(parents=True, exist_ok=True)
    folder.status.write_text(json.dumps(status))


@pytest.fixture
def sleeper():
    """A process of this test's own that stays up until the test ends (its
    environment: `RLFLOW_RUN_ID` of run "r-1", as a service's child would have)."""
    started = []

    def start(marked: bool = False) -> subprocess.Popen:
        env = {**os.environ, RUN_ID_VAR: "r-1"} if marked else None
        proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], env=env)
        started.append(proc)
        return proc

    yield start
    for proc in started:
        proc.kill()
        proc.wait(timeout=30)


def test_a_run_said_to_be_running_is_dead_when_its_controller_is_gone_or_its_pid_taken(tmp_path, sleeper):
    folder = RunDir(tmp_path)
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait(timeout=30)
    write_status(folder, pid=gone.pid)
    state = run_state(folder)
    assert (state.state, state.status.state) == ("dead", "dead")
    assert f"its controller (pid {gone.pid}) is gone" in state.reason and "no checkpoint" in state.reason
    # A live process whose id the status names, but that began after the status was written: not its controller.
    newer = sleeper()
    write_status(folder, pid=newer.pid)
    os.utime(folder.status, (time.time() - 60, time.time() - 60))
    assert run_state(folder).state == "dead"
    # The same process, older than the status: the run is going.
    write_status(folder, pid=newer.pid)
    assert run_state(folder).state == "running" and alive(newer.pid)
    # Another host's run cannot be checked from here: as written, and said so.
    write_status(folder, pid=gone.pid, host="elsewhere")
    state = run_state(folder)
    assert state.state == "running" and "runs on elsewhere" in state.reason
    # Written as ended: ended, whatever the processes.
    write_status(folder, pid=gone.pid, state="failed", error="trainer-0 died")
    assert (run_state(folder).state, run_state(folder).reason) == ("failed", "trainer-0 died")
    assert run_state(RunDir(tmp_path / "nothing")) is None


def test_a_detached_run_is_starting_until_it_writes_its_own_status(tmp_path, sleeper):
    folder = RunDir(tmp_path)
    write_status(folder, pid=0, state="failed", error="an earlier session's")
    os.utime(folder.status, (time.time() - 60, time.time() - 60))
    process = sleeper()
    folder.run_pid.write_text(str(process.pid))
    assert run_state(folder).state == "starting"
    process.kill()
    process.wait(timeout=30)
    assert run_state(folder).state == "failed"  # it never wrote: the last status stands
    folder.status.unlink()
    state = run_state(folder)
    assert state.state == "dead" and "ended before it wrote a status" in state.reason


@pytest.mark.slow  # starts and kills a whole run
async def test_status_down_report_and_audit_of_a_dead_run_say_dead_and_down_cleans_up(tmp_path, sleeper, capsys):
    """A real run (services in this process, real sockets) whose status is
    then made that of a controller that was SIGKILLed: `status` and
    `report` say dead, `audit` counts the groups in flight as pending, not
    lost, `down` says dead, stops what is left of the run on this host
    (a process carrying its run id), writes the dead state for readers of
    the file alone, and exits 0."""
    folder = RunDir(tmp_path / "run")
    with trio.fail_after(60):
        await run_in_process(sim("run.steps=3"), folder.path)
    killed = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    killed.kill()
    killed.wait(timeout=30)
    status = msgspec.structs.replace(folder.read_status(), state="running", run_id="r-1", pid=killed.pid)
    folder.status.write_bytes(msgspec.json.encode(status))
    with folder.ledger.open("a") as ledger:  # granted when the controller died
        ledger.write(json.dumps({"event": "issued", "groups": [1000, 1001], "replica": "rollout-0"}) + "\n")
    stray = sleeper(marked=True)

    def run(*argv: str) -> tuple[int, str, str]:
        code = main(list(argv))
        out = capsys.readouterr()
        return code, out.out, out.err

    code, out, _ = run("status", str(folder.path), "--once")
    assert code == 0 and "dead" in out
    code, out, _ = run("report", str(folder.path))
    assert code == 0 and out.splitlines()[0].startswith(f"run {folder.path}: dead (its controller (pid {killed.pid})")
    code, out, _ = run("audit", str(folder.path))
    assert code == 0
    assert out.splitlines()[-1] == "RESULT audit issued=14 trained=12 lost=0 duplicated=0 dropped=0 pending=2"
    assert json.loads(folder.status.read_text())["state"] == "running"  # the file alone still says so

    def down() -> subprocess.CompletedProcess:
        # As a person would: from a process of its own (the status names this one, which it must spare).
        return subprocess.run([sys.executable, "-m", "rlflow", "down", str(folder.path)], capture_output=True,
                              text=True, timeout=120)

    # The stray is this process's child: reaped as soon as it ends (as a shell reaps its own), or `down`
    # would see a zombie still there and wait out its grace before SIGKILL.
    threading.Thread(target=stray.wait, daemon=True).start()
    done = down()
    assert done.returncode == 0, done.stderr
    assert f"run {folder.path} is dead: its controller (pid {killed.pid}) is gone" in done.stderr
    assert f"stopped 1 process of the run: {stray.pid}" in done.stderr
    assert stray.wait(timeout=30) is not None
    assert msgspec.json.decode(folder.status.read_bytes(), type=Status).state == "dead"
    done = down()
    assert done.returncode == 0 and "is dead" in done.stderr
    assert "no process of the run is left on this host" in done.stderr
