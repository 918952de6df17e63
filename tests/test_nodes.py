"""A run across two Ray nodes, each in a network namespace of its own that
the test makes on this machine (joined by a veth pair, addresses assigned
here), with CURVE on: the controller, reward, teacher and trainer on node A
(the head, where the driver runs), the rollout on node B. Everything the test
starts is stopped and removed afterwards, also when it fails.

Needs root (to make network namespaces); skipped otherwise.
"""

from __future__ import annotations

import json
import os
import pathlib
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from rlflow import config as C
from rlflow.rundir import RunDir
from rlflow.tools.audit import audit, text

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(900)]

ROOT = pathlib.Path(__file__).resolve().parent.parent
SIM = ROOT / "examples" / "sim.toml"
RAY = str(pathlib.Path(sys.executable).with_name("ray"))
PORT = 6379


def sh(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(args, capture_output=True, text=True, check=check, timeout=60)


@dataclass
class Node:
    netns: str
    ip: str
    ray: subprocess.Popen | None = None

    def cmd(self, *args: str) -> list[str]:
        """`args` run inside this node's network namespace."""
        return ["ip", "netns", "exec", self.netns, *args]


@dataclass
class TwoNodes:
    head: Node
    worker: Node
    env: dict[str, str]
    """For every process of the cluster (Ray's token: the test's own)."""
    tmp: pathlib.Path

    @property
    def address(self) -> str:
        return f"{self.head.ip}:{PORT}"


def _make_namespaces(a: Node, b: Node, prefix: str) -> None:
    veth_a, veth_b = f"{prefix}a0", f"{prefix}b0"
    sh("ip", "netns", "add", a.netns)
    sh("ip", "netns", "add", b.netns)
    sh("ip", "link", "add", veth_a, "type", "veth", "peer", "name", veth_b)
    for node, veth, other in ((a, veth_a, b), (b, veth_b, a)):
        sh("ip", "link", "set", veth, "netns", node.netns)
        sh("ip", "-n", node.netns, "addr", "add", f"{node.ip}/24", "dev", veth)
        sh("ip", "-n", node.netns, "link", "set", veth, "up")
        sh("ip", "-n", node.netns, "link", "set", "lo", "up")
        # A default route, so that each node's own IP is the one on its
        # route out (what Ray and rlflow's node_ip pick).
        sh("ip", "-n", node.netns, "route", "add", "default", "via", other.ip)


def _stop(nodes: list[Node]) -> None:
    """Stop each node's Ray, end every process left in its namespace (all
    of them were started by this test), then delete the namespaces."""
    running = [n.ray for n in nodes if n.ray is not None and n.ray.poll() is None]
    for ray in running:
        ray.send_signal(signal.SIGTERM)  # `ray start --block` stops what it started
    deadline = time.monotonic() + 10
    for ray in running:
        try:
            ray.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            ray.kill()
            ray.wait(timeout=30)
    for node in nodes:
        for pid in sh("ip", "netns", "pids", node.netns, check=False).stdout.split():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + 10
    for node in nodes:
        while sh("ip", "netns", "pids", node.netns, check=False).stdout.strip() and time.monotonic() < deadline:
            time.sleep(0.1)
        sh("ip", "netns", "del", node.netns, check=False)


def _ray_start(node: Node, log: pathlib.Path, env: dict[str, str], *args: str) -> subprocess.Popen:
    with open(log, "w") as out:
        return subprocess.Popen(
            node.cmd(RAY, "start", f"--node-ip-address={node.ip}", *args), env=env, stdout=out, stderr=subprocess.STDOUT
        )


def _wait_for_nodes(cluster: TwoNodes, count: int, timeout: float = 90) -> None:
    script = (
        "import ray, time\n"
        f"ray.init(address={cluster.address!r}, log_to_driver=False)\n"
        f"deadline = time.monotonic() + {timeout}\n"
        f"while sum(n['Alive'] for n in ray.nodes()) < {count} and time.monotonic() < deadline:\n"
        "    time.sleep(0.2)\n"
        "print(sum(n['Alive'] for n in ray.nodes()))\n"
    )
    done = subprocess.run(
        cluster.head.cmd(sys.executable, "-c", script), env=cluster.env, capture_output=True, text=True,
        timeout=timeout + 30,
    )
    assert done.returncode == 0 and done.stdout.split()[-1] == str(count), done.stderr[-3000:]


@pytest.fixture(scope="module")
def two_nodes() -> Iterator[TwoNodes]:
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("needs root and iproute2 to make network namespaces")
    prefix = f"rlf{os.getpid() % 100000}"
    subnet = f"10.{200 + os.getpid() % 50}.{os.getpid() % 250}"
    head, worker = Node(f"{prefix}a", f"{subnet}.1"), Node(f"{prefix}b", f"{subnet}.2")
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="rlfn-", dir="/tmp"))
    env = {
        **os.environ,
        "RAY_AUTH_MODE": "token",  # on, as Ray 2.60 has it by default, with a token of this test's own
        "RAY_AUTH_TOKEN": secrets.token_hex(32),
        "RAY_USAGE_STATS_ENABLED": "0",
        # A lost node is found out after 3 health checks half a second apart (Ray's default: 5, 3 s apart):
        # its replica's next incarnation waits for its placement group to be placed again, which waits for it.
        "RAY_health_check_period_ms": "500",
        "RAY_health_check_failure_threshold": "3",
    }
    env.pop("RAY_ADDRESS", None)
    cluster = TwoNodes(head, worker, env, tmp)
    try:
        try:
            _make_namespaces(head, worker, prefix)
        except subprocess.CalledProcessError as exc:
            pytest.skip(f"cannot make network namespaces here: {exc.stderr.strip()}")
        common = ["--block", "--disable-usage-stats", f"--temp-dir={tmp / 'ray'}"]
        head.ray = _ray_start(head, tmp / "head.log", env, "--head", f"--port={PORT}", "--num-cpus=2",
                              "--include-dashboard=false", *common)
        _wait_for_nodes(cluster, 1)
        worker.ray = _start_worker(cluster)
        _wait_for_nodes(cluster, 2)
        yield cluster
    finally:
        _stop([worker, head])
        shutil.rmtree(tmp, ignore_errors=True)


def _start_worker(cluster: TwoNodes) -> subprocess.Popen:
    """Node B's Ray, labelled for the generate pool."""
    return _ray_start(cluster.worker, cluster.tmp / "worker.log", cluster.env, f"--address={cluster.address}",
                      "--num-cpus=1", "--labels=pool=generate", "--block", "--disable-usage-stats",
                      f"--temp-dir={cluster.tmp / 'ray'}")


def _kill_node(node: Node) -> None:
    """Every process of the node (its Ray, and what Ray started there) killed at once, as a lost machine."""
    for pid in sh("ip", "netns", "pids", node.netns, check=False).stdout.split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except ProcessLookupError:
            pass
    if node.ray is not None:
        node.ray.wait(timeout=30)


class Driver:
    """`rlflow up` as the driver on the head node: rollout placed on node B by its label,
    every socket bound on its node's own IP, so CURVE is on. A context
    manager that kills it on the way out if it still runs."""

    def __init__(self, cluster: TwoNodes, run_dir: pathlib.Path, steps: int):
        self.run_dir = run_dir
        self.log = run_dir.parent / f"{run_dir.name}.out"
        args = [
            sys.executable, "-m", "rlflow", "up", "--config", str(SIM), "--steps", str(steps),
            "--run-dir", str(run_dir), "--no-display",
            "--set", f"cluster.address={cluster.address}",
            "--set", "cluster.host=",
            "--set", "cluster.heartbeat_s=0.2",
            "--set", 'pools.generate.labels={pool = "generate"}',
        ]
        with open(self.log, "w") as out:
            self.proc = subprocess.Popen(cluster.head.cmd(*args), env=cluster.env, stdout=out, stderr=subprocess.STDOUT)

    def __enter__(self) -> Driver:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)

    def output(self) -> str:
        return self.log.read_text()[-5000:]

    def finish(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"the run did not finish within {timeout:g} s:\n{self.output()}") from None

    def wait_for_step(self, step: int, timeout: float = 120) -> dict:
        """status.json once the run is running at `step` or later."""
        return self.wait_for(lambda status: status.get("step", 0) >= step, timeout, f"step {step}")

    def wait_for(self, ok, timeout: float, what: str = "what the test waits for") -> dict:
        """status.json once the run is running and `ok(status)`."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.proc.poll() is None:
            try:
                status = json.loads((self.run_dir / "status.json").read_text())
            except (OSError, ValueError):
                status = {}
            if status.get("state") == "running" and ok(status):
                return status
            time.sleep(0.1)
        raise AssertionError(f"the run never reached {what}:\n{self.output()}")


def netns_of(pid: int) -> str:
    return sh("ip", "netns", "identify", str(pid)).stdout.strip()


#: From another node, without the run's keys: a shutdown with the run's
#: secret to the controller and bytes that would count as malformed to the
#: reward's input; each socket waits until its handshake has failed.
INTRUDER = """
import sys, zmq
from rlflow.protocol import Codec, Shutdown
address, secret, reward_in = sys.argv[1:]
ctx = zmq.Context()
sockets = [(zmq.DEALER, address, Codec().encode(Shutdown(reason="intruder", secret=secret))),
           (zmq.PUSH, reward_in, [b"\\xc1" * 64])]
for kind, where, message in sockets:
    sock = ctx.socket(kind)
    monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL)
    sock.connect(where)
    sock.send_multipart(message)
    print("refused" if monitor.poll(30_000) else "no answer", flush=True)
    sock.disable_monitor()  # before closing either: a context with a live monitor may never end
    monitor.close(linger=0)
    sock.close(linger=0)
ctx.term()
"""


def intrude(cluster: TwoNodes, run_dir: pathlib.Path, status: dict) -> list[str]:
    """Run `INTRUDER` on node B against the run; how each of its handshakes ended."""
    info = json.loads((run_dir / "controller.json").read_text())
    reward_in = status["roles"]["reward"]["placed"][0]["endpoints"]["in"]
    done = subprocess.run(
        cluster.worker.cmd(sys.executable, "-c", INTRUDER, info["address"], info["secret"], reward_in),
        env=cluster.env, capture_output=True, text=True, timeout=90,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.split()


def test_a_run_across_two_nodes_with_curve_and_its_worker_node_lost_midway(two_nodes, tmp_path):
    """Where each role runs and on which address (the rollout on node B by the generate pool's label);
    an intruder on node B is refused by both sockets it reaches while the run goes on; node B, with the
    run's only rollout replica, is lost whole mid-run (every process of it killed at once): the replica
    is lost like any other (its groups granted again), its restart waits for a node with the pool's
    label, node B comes back, the replica's next incarnation registers over CURVE there, and the run
    finishes its steps with no group lost or trained twice."""
    run_dir = tmp_path / "run"
    steps = 40
    try:
        with Driver(two_nodes, run_dir, steps) as driver:
            status = driver.wait_for_step(2)
            placed = {role: info["placed"][0] for role, info in status["roles"].items()}
            # Where everything runs: the rollout in node B's namespace, the rest
            # in A's, each socket on its node's own address, not loopback.
            where = {role: netns_of(p["pid"]) for role, p in placed.items()}
            on_head = dict.fromkeys(("reward", "teacher", "trainer"), two_nodes.head.netns)
            assert where == {"rollout": two_nodes.worker.netns, **on_head}
            for role in on_head:
                assert placed[role]["endpoints"]["in"].startswith(f"tcp://{two_nodes.head.ip}:")
            assert status["address"].startswith(f"tcp://{two_nodes.head.ip}:")
            # Node B goes first: the run cannot finish without the rollout's next incarnation, so it is
            # still running once the intruder (a process in B's namespace, not of its Ray) is done.
            killed = placed["rollout"]["pid"]
            _kill_node(two_nodes.worker)
            assert intrude(two_nodes, run_dir, status) == ["refused", "refused"]
            assert json.loads((run_dir / "status.json").read_text())["state"] == "running"
            two_nodes.worker.ray = _start_worker(two_nodes)
            again = driver.wait_for(lambda st: st["roles"]["rollout"]["placed"][0]["incarnation"] >= 1
                                    and st["roles"]["rollout"]["placed"][0]["state"] == "ready", 240,
                                    "the rollout's next incarnation")
            assert netns_of(again["roles"]["rollout"]["placed"][0]["pid"]) == two_nodes.worker.netns
            assert driver.finish(300) == 0, driver.output()
    finally:  # node B up again for the tests after this one
        if two_nodes.worker.ray is None or two_nodes.worker.ray.poll() is not None:
            two_nodes.worker.ray = _start_worker(two_nodes)
    info = RunDir(run_dir).read_controller()
    assert info.curve is not None and (run_dir / "controller.json").stat().st_mode & 0o077 == 0
    assert C.load(run_dir / "config.toml").cluster.uses_curve
    # The intruder's shutdown (with the right secret) never arrived, nor its bytes.
    summary = RunDir(run_dir).read_summary()
    assert summary.state == "stopped" and summary.stop_reason == f"{steps} steps done", summary.error
    final = RunDir(run_dir).read_status()
    assert final.controller.rejected == {} and final.controller.ignored == {}
    assert "malformed" not in final.roles["reward"].counters.rejected
    rollout = final.roles["rollout"].placed[0]
    assert rollout.incarnation >= 1 and rollout.pid != killed
    result = audit(run_dir)
    assert result.lost == 0 and result.duplicated == 0, text(result)
    assert summary.groups.reissued > 0  # what the lost replica held was granted again


def test_ray_refuses_a_driver_without_the_clusters_token(two_nodes):
    """Ray's own token authentication stays on beside CURVE."""
    # A refused driver asks again once a second, 20 times by default (Ray's NUM_REDIS_GET_RETRIES); the
    # answer is the same refusal on the first.
    env = {**two_nodes.env, "RAY_AUTH_TOKEN": secrets.token_hex(32), "RAY_NUM_REDIS_GET_RETRIES": "2"}
    script = f"import ray\nray.init(address={two_nodes.address!r}, log_to_driver=False)\nprint('joined')\n"
    done = subprocess.run(two_nodes.worker.cmd(sys.executable, "-c", script), env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode != 0 and "joined" not in done.stdout
    assert "AuthenticationError" in done.stderr, done.stderr[-2000:]
