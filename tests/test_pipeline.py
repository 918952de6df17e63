"""The whole pipeline on a real local Ray with real sockets and simulated engines."""

from __future__ import annotations

import collections
import json
import os
import pathlib
import signal
import subprocess
import sys
import threading
import time

import pytest
from conftest import late_starts, leftovers, trained_groups

from rlflow import config as C
from rlflow.errors import RunFailed
from rlflow.control.placement import PlacementError
from rlflow.protocol import MESSAGE_TYPES, SCHEMA_VERSION
from rlflow.control.launch import run
from rlflow.rundir import RunDir, StepRow

pytestmark = pytest.mark.ray

ROOT = pathlib.Path(__file__).resolve().parent.parent
SIM = ROOT / "examples" / "sim.toml"
CONTROL_TYPES = {cls.__name__ for tag, cls in MESSAGE_TYPES.items() if 10 <= tag < 40}


def sim_config(*overrides: str) -> C.Config:
    return C.load(SIM, ["cluster.heartbeat_s=0.2", *overrides])


def rows(run_dir: pathlib.Path) -> list[StepRow]:
    return RunDir(run_dir).read_metrics()


@pytest.fixture
def clean(ray_cluster):
    """Each test leaves no rlflow actor or placement group behind (checked
    with Ray's state API, and cleaned up if it did, so others are unaffected)."""
    yield ray_cluster
    deadline = time.monotonic() + 30
    while (left := leftovers()) != ([], []) and time.monotonic() < deadline:
        time.sleep(0.25)
    if left != ([], []):
        import ray

        for name in left[0]:
            ray.kill(ray.get_actor(name, namespace="rlflow"))
        pytest.fail(f"left behind: actors {left[0]}, placement groups {left[1]}")


@pytest.mark.parametrize(
    ("mode", "bound", "check"),
    [("sync", 0, "strict"), ("one_step", 1, "strict"), ("async", 2, "strict"), ("async", 2, "admission")],
)
def test_each_mode_runs_within_its_staleness_bound(mode, bound, check, clean, tmp_path):
    overrides = [f"run.mode={mode}", "run.steps=4", f"run.staleness_check={check}"]
    if mode != "async":
        overrides.append("run.max_staleness=" + str(bound))
    config = sim_config(*overrides)
    summary = run(config, tmp_path / "run")
    assert summary.state == "stopped", summary.error
    steps = rows(tmp_path / "run")
    assert [r.step for r in steps] == [0, 1, 2, 3]
    assert [r.version for r in steps] == [1, 2, 3, 4]
    # Every group started within its credit; strict: every token within the
    # bound, from what the trainer consumed.
    groups = trained_groups(tmp_path / "run")
    assert len(groups) == 4 * config.run.batch_size
    assert late_starts(tmp_path / "run", config.run.batch_size, bound) == []
    if check == "strict":
        assert max(r.staleness_max for r in steps) <= bound
        assert all(step - oldest <= bound for step, _, oldest in groups)
    if mode == "sync":
        assert all(r.staleness_max == 0 for r in steps)
    assert all(r.samples == 64 for r in steps)
    for role in ("rollout", "reward", "teacher", "trainer"):
        shares = steps[-1].roles[role]
        assert shares.busy + shares.starved + shares.blocked + shares.loading == pytest.approx(1, abs=0.01)


@pytest.fixture(scope="module")
def three_steps(ray_cluster, tmp_path_factory):
    """One short async sim run shared by the tests that only read its output."""
    run_dir = tmp_path_factory.mktemp("three") / "run"
    return run_dir, run(sim_config("run.steps=3"), run_dir)


def test_the_controller_carries_no_sample_data(three_steps, clean):
    _, summary = three_steps
    controller = summary.controller
    assert set(controller.by_type) <= CONTROL_TYPES
    assert controller.rejected == {}
    # Control traffic only: a few hundred bytes per message, however large
    # the samples that went from role to role.
    assert controller.bytes_received / controller.messages_received < 600
    assert summary.data_bytes > 200_000
    assert controller.bytes_received < summary.data_bytes / 5
    # Every message handled was timed, from taken off the socket to handled.
    assert 0 < controller.latency_p50_ms <= controller.latency_p99_ms <= controller.latency_max_ms


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs to give pools their own")
def test_pools_get_their_own_cores_and_thread_counts(three_steps, clean):
    run_dir, _ = three_steps
    roles = RunDir(run_dir).read_status().roles
    placed = {role: info.placed[0] for role, info in roles.items()}
    # examples/sim.toml: generate = 1 CPU, score = 0.5, train = 0.5 (sharing the next core).
    assert placed["rollout"].cpus == "0"
    assert placed["reward"].cpus == placed["teacher"].cpus == placed["trainer"].cpus == "1"
    assert all(p.threads == 1 for p in placed.values())


def test_metrics_also_go_to_tensorboard(three_steps, clean):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir, _ = three_steps
    from tensorboard.util.tensor_util import make_ndarray

    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    tags = events.Tags()["tensors"]  # scalars written as TensorBoard's v2 scalar summaries
    assert {"reward_mean", "staleness_max", "trainer/busy", "rollout/starved"} <= set(tags)
    assert [e.step for e in events.Tensors("staleness_max")] == [0, 1, 2]
    samples = [float(make_ndarray(e.tensor_proto)) for e in events.Tensors("samples")]
    assert samples == [r.samples for r in rows(run_dir)]


def wait_for_status(run_dir: pathlib.Path, ready, timeout_s: float = 120.0) -> dict:
    """The run's status.json once `ready(status)` holds."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            status = json.loads((run_dir / "status.json").read_text())
        except (OSError, ValueError):
            status = {}
        if status and ready(status):
            return status
        time.sleep(0.05)
    raise TimeoutError(f"the run in {run_dir} never got there")


def running_at(step: int):
    return lambda s: s.get("state") == "running" and s.get("step", 0) >= step


@pytest.mark.timeout(600)  # 134 s on a 2-core AMD EPYC when it ran a fixed 500 steps
def test_chaos_kills_a_hang_and_a_trainer_resume_lose_nothing(clean, tmp_path, monkeypatch):
    """The chaos bench, shorter: SIGKILL three random rollout, reward or
    teacher replicas, SIGSTOP one until it is presumed dead, SIGKILL the
    trainer and resume; the audit finds nothing lost or trained twice.
    The run goes on until the saboteur is done, which waits for each
    victim's next incarnation, and is stopped a few steps later: no fixed
    length is too short on a slow machine or too long on a fast one."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("chaos", ROOT / "bench" / "chaos.py")
    chaos = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "chaos", chaos)  # its dataclasses look their module up there
    spec.loader.exec_module(chaos)
    # A hang is found out by the heartbeat timeout: 4 s of silence (8 heartbeats) rather than the bench's 10;
    # each victim's next incarnation starts 0.1 s after its death rather than 1 s (the saboteur waits for it).
    done, result, steps = chaos.chaos_run(tmp_path, kills=3, hang=True, kill_trainer=True, steps=None, seed=3,
                                          hang_s=4.0, backoff_s=0.1)
    assert (done.kills, done.hangs, done.trainer_kills, done.error) == (3, 1, 1, ""), done.log
    assert (result.lost, result.duplicated) == (0, 0), result
    assert steps >= chaos.STEPS_AFTER and result.trained == steps * 4


def test_with_no_restarts_allowed_a_dead_replica_fails_the_run_and_leaves_nothing(clean, tmp_path):
    import ray

    run_dir = tmp_path / "run"
    killed = []

    def kill_reward_when_running() -> None:
        status = wait_for_status(run_dir, running_at(2))
        ray.kill(ray.get_actor(f"rlflow:{status['run_id']}:reward:0", namespace="rlflow"))
        killed.append(status["run_id"])

    killer = threading.Thread(target=kill_reward_when_running, daemon=True)
    killer.start()
    with pytest.raises(RunFailed, match="every reward replica is given up on; the last, reward-0: died"):
        run(sim_config("run.steps=100000", "cluster.max_restarts=0"), run_dir)
    killer.join(timeout=120)
    assert not killer.is_alive()
    assert killed
    assert leftovers(killed[0]) == ([], [])
    status = RunDir(run_dir).read_status()
    assert status.state == "failed" and "reward-0" in status.error


def test_a_resource_shortfall_names_the_pool_and_the_numbers(clean, tmp_path):
    config = sim_config("pools.train.cpus_per_bundle=64")
    with pytest.raises(PlacementError, match=r"pool 'train' asks for 64 CPU \(1 bundles x 64\); "
                                             r"the cluster has [\d.]+ CPU after generate, score took 1.5"):
        run(config, tmp_path / "run")


def written_engine_slots(run_dir) -> int:
    rollout = C.load(run_dir / "config.toml").roles.rollout
    return rollout.engine.slots * rollout.replicas


def test_cli_up_runs_twenty_steps(clean, tmp_path):
    run_dir = tmp_path / "run"
    done = subprocess.run(
        [sys.executable, "-m", "rlflow", "up", "--config", str(SIM), "--steps", "20",
         "--run-dir", str(run_dir), "--set", f"cluster.address={clean}", "--no-display"],
        capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stderr
    # Not a terminal: progress lines instead of the live table.
    assert "[rlflow] running: step " in done.stderr, done.stderr
    steps = rows(run_dir)
    assert len(steps) == 20
    assert (run_dir / "config.toml").exists() and (run_dir / "summary.json").exists()
    written = C.load(run_dir / "config.toml").run
    assert written.steps == 20
    assert late_starts(run_dir, written.batch_size, written.max_staleness) == []
    # status.json names every count: a script reads it without the wire's field order.
    roles = json.loads((run_dir / "status.json").read_text())["roles"]
    assert roles["trainer"]["counters"]["samples"] > 0 and roles["rollout"]["counters"]["decode_steps"] > 0
    assert roles["rollout"]["engine"]["slots"] == written_engine_slots(run_dir)


@pytest.mark.parametrize("curve", ["auto", "on"])
def test_detach_status_and_down(curve, clean, tmp_path):
    """With CURVE on, `rlflow down` reaches the controller with the keys in controller.json."""
    run_dir = tmp_path / "run"
    base = [sys.executable, "-m", "rlflow"]
    up = subprocess.run(
        [*base, "up", "--detach", "--config", str(SIM), "--steps", "100000",
         "--run-dir", str(run_dir), "--set", f"cluster.address={clean}", "--set", f"cluster.curve={curve}"],
        capture_output=True, text=True, timeout=300,
    )
    pid = int((run_dir / "run.pid").read_text()) if (run_dir / "run.pid").exists() else None
    try:
        assert up.returncode == 0, up.stderr
        assert "is up" in up.stderr
        status = subprocess.run([*base, "status", str(run_dir), "--once"], capture_output=True, text=True, timeout=60)
        assert status.returncode == 0
        for role in ("rollout", "reward", "teacher", "trainer"):
            assert role in status.stdout
        info = json.loads((run_dir / "controller.json").read_text())
        run_id = info["run_id"]
        assert (info.get("curve") is not None) == (curve == "on")
        assert len(leftovers(run_id)[0]) == 4
        down = subprocess.run([*base, "down", str(run_dir)], capture_output=True, text=True, timeout=180)
        assert down.returncode == 0, down.stderr
        assert json.loads((run_dir / "status.json").read_text())["state"] == "stopped"
        assert leftovers(run_id) == ([], [])
    finally:
        if pid is not None:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_a_detached_run_whose_controller_is_killed_is_dead_to_status_and_down(clean, tmp_path):
    """SIGKILL the controller of a detached run: `rlflow status` says dead;
    `rlflow down` says dead, leaves none of its actors, placement groups or
    processes (also one a service started, carrying the run's id), writes
    the dead state into status.json, and exits 0."""
    import psutil

    from rlflow.runstate import RUN_ID_VAR

    run_dir = tmp_path / "run"
    base = [sys.executable, "-m", "rlflow"]
    up = subprocess.run(
        [*base, "up", "--detach", "--config", str(SIM), "--steps", "100000", "--run-dir", str(run_dir),
         "--set", f"cluster.address={clean}"],
        capture_output=True, text=True, timeout=300,
    )
    pid = int((run_dir / "run.pid").read_text()) if (run_dir / "run.pid").exists() else None
    stray = None
    try:
        assert up.returncode == 0, up.stderr
        status = wait_for_status(run_dir, running_at(2))
        run_id = status["run_id"]
        services = [p["pid"] for info in status["roles"].values() for p in info["placed"]]
        assert len(leftovers(run_id)[0]) == 4
        stray = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"],
                                 env={**os.environ, RUN_ID_VAR: run_id}, start_new_session=True)
        os.kill(pid, signal.SIGKILL)
        psutil.Process(pid).wait(timeout=30)
        shown = subprocess.run([*base, "status", str(run_dir), "--once"], capture_output=True, text=True, timeout=60)
        assert shown.returncode == 0 and "dead" in shown.stdout, shown.stdout
        # The stray is this process's child: reaped as soon as it ends (as a shell reaps its own), or `down`
        # would see a zombie still there and wait out its grace before SIGKILL.
        threading.Thread(target=stray.wait, daemon=True).start()
        down = subprocess.run([*base, "down", str(run_dir)], capture_output=True, text=True, timeout=180)
        assert down.returncode == 0, down.stderr
        assert f"is dead: its controller (pid {pid}) is gone without saying why" in down.stderr, down.stderr
        assert str(stray.pid) in down.stderr, down.stderr
        assert stray.wait(timeout=30) is not None
        assert json.loads((run_dir / "status.json").read_text())["state"] == "dead"
        assert leftovers(run_id) == ([], [])
        assert not [p for p in services if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
        again = subprocess.run([*base, "down", str(run_dir)], capture_output=True, text=True, timeout=180)
        assert again.returncode == 0 and "is dead" in again.stderr, again.stderr
    finally:
        for process in (pid, stray.pid if stray is not None else None):
            if process is not None:
                try:
                    os.kill(process, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        if stray is not None:
            stray.wait(timeout=30)


def test_what_a_run_left_on_ray_is_removed_by_its_id(clean):
    """Actors and placement groups named for a run, made to outlive their
    maker (detached), as a dead controller's may be: `remove_run` removes
    them, and nothing of another run."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    from rlflow.control.placement import remove_run

    @ray.remote(num_cpus=0)
    class Idle:
        def ping(self) -> str:
            return "up"

    actors = [Idle.options(name=f"rlflow:{run}:x:0", namespace="rlflow", lifetime="detached").remote()
              for run in ("gone-1", "other-1")]
    groups = [placement_group([{"CPU": 0.01}], name=f"rlflow:{run}:pool", lifetime="detached")
              for run in ("gone-1", "other-1")]
    try:
        assert ray.get([a.ping.remote() for a in actors], timeout=60) == ["up", "up"]
        ray.get([g.ready() for g in groups], timeout=60)
        assert remove_run(clean, "gone-1") == (["rlflow:gone-1:x:0"], ["rlflow:gone-1:pool"])
        assert leftovers("gone-1") == ([], [])
        assert leftovers("other-1") == (["rlflow:other-1:x:0"], ["rlflow:other-1:pool"])
        assert remove_run("127.0.0.1:1", "gone-1") is None  # no cluster there
    finally:
        ray.kill(actors[1])
        remove_placement_group(groups[1])


#: The header of the report: about a kilobyte, nested a thousand levels deep.
DEEP = bytes([0x92, SCHEMA_VERSION]) + b"\x91" * 1000 + b"\x00"


def hostile_stream() -> list[tuple[str, list[bytes]]]:
    """(the rejection it must count, the frames) of one message of each kind
    of breakage, built from a valid `SampleBatch`, then 40 generated ones
    (a hostile value spliced into the batch's header: "any")."""
    import msgspec
    from golden import examples
    from hypothesis import HealthCheck, given, settings
    from strategies import spliced

    from rlflow.protocol import Codec

    frames = [bytes(f) for f in Codec().encode(examples()["SampleBatch"])]
    header = msgspec.msgpack.decode(frames[0])

    def rewrite(change) -> bytes:
        copy = msgspec.msgpack.decode(frames[0])
        change(copy)
        return msgspec.msgpack.encode(copy)

    tensor = next(i for i in range(1, len(frames)) if len(frames[i]) > 4)
    out = [
        ("malformed", [b"\xc1" * 64]),
        ("malformed", [DEEP]),
        ("truncated", [frames[0][: len(frames[0]) // 2], *frames[1:]]),
        ("wrong_version", [rewrite(lambda h: h.__setitem__(0, header[0] + 1)), *frames[1:]]),
        ("unknown_type", [rewrite(lambda h: h[1].__setitem__(0, 99)), *frames[1:]]),
        ("frame_count", frames[:-1]),
        ("frame_count", [*frames, b"extra"]),
        ("frame_size", [*frames[:tensor], frames[tensor][:-4], *frames[tensor + 1:]]),
    ]

    @settings(max_examples=40, derandomize=True, database=None, suppress_health_check=list(HealthCheck))
    @given(spliced(frames))
    def collect(message: list[bytes]) -> None:
        out.append(("any", message))

    collect()
    return out


def test_hostile_messages_to_every_live_socket_are_counted_and_the_run_goes_on(clean, tmp_path):
    """While a run goes on, an outsider sends every socket that listens (the
    controller, the data inputs, the weight server) one message of each kind
    of breakage (random bytes, a header nested a thousand levels deep,
    truncation, another schema version, an unknown type, missing and extra
    frames, a frame shorter than its header says) and 40 generated hostile
    headers, and the controller a hello and a shutdown without the run's
    secret. The run finishes its steps; every message is rejected and
    counted, by kind, where it arrived; each kind is logged a few times, not
    once per message; the services' memory does not grow with it."""
    import psutil
    import zmq

    from rlflow.protocol import SCHEMA_VERSION, Codec, Hello, Role, Shutdown

    run_dir = tmp_path / "run"
    stream = hostile_stream()
    attacked, rss = {}, {}

    def attack() -> None:
        status = wait_for_status(run_dir, running_at(2))
        placed = {role: info["placed"][0] for role, info in status["roles"].items()}
        targets = {
            "controller": (zmq.DEALER, status["address"]),
            "reward": (zmq.PUSH, placed["reward"]["endpoints"]["in"]),
            "teacher": (zmq.PUSH, placed["teacher"]["endpoints"]["in"]),
            "trainer": (zmq.PUSH, placed["trainer"]["endpoints"]["in"]),
            "weights": (zmq.DEALER, placed["trainer"]["endpoints"]["weights"]),
        }
        pids = {role: p["pid"] for role, p in placed.items()}
        rss["before"] = {role: psutil.Process(pid).memory_info().rss for role, pid in pids.items()}
        codec = Codec()
        impostor = Hello(role=Role.ROLLOUT, rank=0, replicas=1, schema_version=SCHEMA_VERSION, secret="guess")
        ctx = zmq.Context()
        try:
            for name, (kind, address) in targets.items():
                sock = ctx.socket(kind)
                sock.setsockopt(zmq.LINGER, 5000)
                sock.setsockopt(zmq.SNDTIMEO, 10_000)
                sock.connect(address)
                for _, frames in stream:
                    sock.send_multipart(frames)
                if name == "controller":
                    sock.send_multipart(codec.encode(impostor))
                    sock.send_multipart(codec.encode(Shutdown(reason="outsider")))
                sock.close()
            attacked["step"] = status["step"]
        finally:
            ctx.term()
        wait_for_status(run_dir, running_at(status["step"] + 3))
        rss["after"] = {role: psutil.Process(pid).memory_info().rss for role, pid in pids.items()}

    attacker = threading.Thread(target=attack, daemon=True)
    attacker.start()
    summary = run(sim_config("run.steps=40"), run_dir)
    attacker.join(timeout=120)
    assert not attacker.is_alive(), "the attacker did not finish within 120 s of the run"
    assert attacked, "the run never reached step 2"
    assert summary.state == "stopped", summary.error
    assert summary.steps == 40 and summary.stop_reason == "40 steps done"
    status = RunDir(run_dir).read_status()
    # ... and the peer of another schema version is told so, in this one's.
    assert status.controller.ignored == {"unauthenticated": 2, "wrong_version": 1}
    sent = collections.Counter(kind for kind, _ in stream)
    counts = {"controller": status.controller.rejected}
    counts.update({role: dict(info.counters.rejected) for role, info in status.roles.items()})
    for role, times in (("controller", 1), ("reward", 1), ("teacher", 1), ("trainer", 2)):  # trainer: input + weights
        assert sum(counts[role].values()) == times * len(stream), (role, counts[role])
    for role in ("reward", "teacher", "trainer"):  # on a data socket, each breakage is what is counted
        for kind, n in sent.items():
            if kind != "any":
                assert counts[role].get(kind, 0) >= n, (role, kind, counts[role])
    logs = {p.name: p.read_text() for p in (run_dir / "logs").glob("*.log")}
    assert "RecursionError" not in "".join(logs.values())
    for name, text in logs.items():  # the first three of a kind, then every thousandth
        for kind in sent:
            assert text.count(f"of kind {kind}:") <= 3 * 2, (name, kind)
    growth = {role: rss["after"][role] - rss["before"][role] for role in rss["before"]}
    assert max(growth.values()) < 64 << 20, growth
