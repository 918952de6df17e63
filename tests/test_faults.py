"""Faults seen from the outside, with every service a real process: a
replica stopped (SIGSTOP) until it is replaced, then let go on (SIGCONT),
must exit when told, and the run loses and duplicates nothing."""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys

import pytest
import trio

from rlflow import config as C
from rlflow.control.controller import Controller
from rlflow.control.placement import Failure
from rlflow.startup import ServiceSpec
from rlflow.rundir import RunDir

ROOT = pathlib.Path(__file__).resolve().parent.parent
SIM = ROOT / "examples" / "sim.toml"

pytestmark = pytest.mark.slow


class ProcessLauncher:
    """Starts each replica as a plain process of its own (no Ray). `kill`
    can be told to leave some replicas alone, as a launcher cannot kill a
    process started outside it."""

    def __init__(self, config: C.Config, run_dir: pathlib.Path, secret: str):
        self.config, self.run_dir, self.secret = config, run_dir, secret
        self.controller = ""
        self.procs: dict[tuple[str, int], tuple[int, subprocess.Popen]] = {}
        self.every: list[subprocess.Popen] = []
        self.unkillable: set[tuple[str, int]] = set()
        #: Roles `start` leaves out (the test starts them itself, with `restart`).
        self.held_back: set[str] = set()

    def start(self, controller_address: str) -> None:
        self.controller = controller_address
        for role, cfg in self.config.role_items():
            for rank in range(cfg.replicas if role not in self.held_back else 0):
                self._spawn(role, rank, 0)

    def _spawn(self, role: str, rank: int, incarnation: int) -> None:
        cfg = dict(self.config.role_items())[role]
        spec = ServiceSpec(role=role, rank=rank, replicas=cfg.replicas, run_id="faults", controller=self.controller,
                           config=self.config, run_dir=str(self.run_dir), incarnation=incarnation, secret=self.secret)
        proc = subprocess.Popen([sys.executable, "-c", "import sys; from rlflow.services import main; "
                                 "main(sys.stdin.buffer.read())"], stdin=subprocess.PIPE)
        proc.stdin.write(spec.encode())
        proc.stdin.close()
        self.procs[(role, rank)] = (incarnation, proc)
        self.every.append(proc)

    def failures(self) -> list[Failure]:
        out = []
        for (role, rank), (incarnation, proc) in list(self.procs.items()):
            if proc.poll() is not None and proc.returncode != 0:
                out.append(Failure(role, rank, incarnation, f"died: exit status {proc.returncode}"))
                self.procs[(role, rank)] = (incarnation, _Ended())
        return out

    def kill(self, role: str, rank: int) -> None:
        if (role, rank) not in self.unkillable:
            self.procs[(role, rank)][1].kill()

    def restart(self, role: str, rank: int, incarnation: int) -> None:
        self._spawn(role, rank, incarnation)

    def stop(self) -> None:
        for proc in self.every:
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGCONT)
                proc.kill()
            proc.wait(timeout=30)


async def run_beside(controller: Controller, launcher: ProcessLauncher, fault, timeout_s: float):
    """The controller's run with `fault()` beside it; every process the launcher started is stopped after."""
    try:
        with trio.fail_after(timeout_s):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(fault)
                return await controller.run()
    finally:
        launcher.stop()


class _Ended:
    """A process already reported as ended."""

    returncode = 0

    def poll(self) -> int:
        return 0


async def test_a_stopped_replica_replaced_and_let_go_on_exits_and_nothing_is_lost_or_trained_twice(tmp_path):
    from rlflow.tools.audit import audit

    config = C.load(SIM, ["run.steps=30", "cluster.heartbeat_s=0.2", "cluster.heartbeat_timeout_s=3",
                          "cluster.restart_backoff_s=0.2", "run.batch_size=4", "run.samples_per_prompt=4",
                          "roles.rollout.replicas=2", "roles.rollout.engine.step_s=0.004",
                          "roles.trainer.engine.weights_bytes=65536"])
    launcher = ProcessLauncher(config, tmp_path, "s3cret")
    launcher.unkillable.add(("rollout", 1))  # as if started outside the launcher
    controller = Controller(config, tmp_path, "faults", launcher, secret="s3cret")
    stopped: list[subprocess.Popen] = []

    async def stop_and_go_on() -> None:
        while controller.ledger.steps_done < 5:
            await trio.sleep(0.05)
        _, proc = launcher.procs[("rollout", 1)]
        os.kill(proc.pid, signal.SIGSTOP)
        stopped.append(proc)
        replica = controller.roster.replicas[("rollout", 1)]
        while not (replica.incarnation == 1 and replica.live):  # presumed dead, replaced, the new one ready
            await trio.sleep(0.05)
        os.kill(proc.pid, signal.SIGCONT)

    summary = await run_beside(controller, launcher, stop_and_go_on, 240)
    assert summary.state == "stopped" and summary.steps == 30, summary.error
    (old,) = stopped
    assert old.returncode == 1  # it exited on its own, told it was replaced
    log = RunDir(tmp_path).service_log("rollout-1").read_text()
    assert "the controller ended rollout-1: replaced" in log
    assert controller.door.ignored["replaced"] >= 1
    result = audit(tmp_path)
    assert (result.lost, result.duplicated, result.trained) == (0, 0, 30 * 4), result


async def test_a_replica_that_dies_while_the_run_starts_is_restarted_and_the_run_goes_on(tmp_path):
    """A reward replica says hello and dies while the run still waits for
    the trainer's: it is restarted then, not only once training has begun,
    and the run starts and finishes with nothing lost."""
    from rlflow.tools.audit import audit

    config = C.load(SIM, ["run.steps=3", "cluster.heartbeat_s=0.2", "cluster.restart_backoff_s=0.2",
                          "cluster.handshake_timeout_s=60", "run.batch_size=4", "run.samples_per_prompt=4"])
    launcher = ProcessLauncher(config, tmp_path, "s3cret")
    launcher.held_back.add("trainer")  # started below, once the reward replica has died
    controller = Controller(config, tmp_path, "faults", launcher, secret="s3cret")

    async def kill_reward_then_start_the_trainer() -> None:
        while ("reward", 0) not in controller.roster.replicas:
            await trio.sleep(0.05)
        replica = controller.roster.replicas[("reward", 0)]
        launcher.procs[("reward", 0)][1].kill()
        while replica.restarts == 0:  # lost, and its restart launched, with the run still starting
            await trio.sleep(0.05)
        assert controller.state == "starting", controller.state
        launcher.restart("trainer", 0, 0)

    summary = await run_beside(controller, launcher, kill_reward_then_start_the_trainer, 120)
    assert summary.state == "stopped" and summary.steps == 3, summary.error
    status = RunDir(tmp_path).read_status()
    assert status.roles["reward"].restarts == 1 and status.roles["reward"].placed[0].incarnation == 1
    result = audit(tmp_path)
    assert (result.lost, result.duplicated, result.trained) == (0, 0, 3 * 4), result
