"""CURVE on the transport: with the run's keys its sockets talk; a peer
without them (no keys, its own keypair, another run's keys) cannot get a
message in; off this host, nothing binds or connects without CURVE."""

from __future__ import annotations

import pathlib
import subprocess
import sys
import time

import numpy as np
import pytest
import trio
import zmq
from zmq.utils.monitor import recv_monitor_message

from rlflow import config as C
from rlflow.control.launch import check_reach
from rlflow.data import transport
from rlflow.data.net import CurveKeys, endpoint_is_local, node_ip
from rlflow.protocol import (
    SCHEMA_VERSION,
    Codec,
    Hello,
    Role,
    Shutdown,
    Tensor,
    WeightsMessage,
    WeightsPayload,
    Welcome,
)

SIM = pathlib.Path(__file__).resolve().parent.parent / "examples" / "sim.toml"
HANDSHAKE_FAILED = {
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "no_detail",
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "protocol",
    zmq.EVENT_HANDSHAKE_FAILED_AUTH: "auth",
}


def payload(version: int) -> WeightsPayload:
    data = np.random.default_rng(version).integers(0, 256, 1 << 20, dtype=np.uint8)
    return WeightsPayload(version=version, names=["t"], tensors=[Tensor.from_numpy(data)])


async def test_streams_and_control_work_with_the_run_keys():
    keys = transport.new_curve_keys()
    codec = Codec(WeightsMessage)
    hello = Hello(role=Role.REWARD, rank=0, replicas=1, schema_version=SCHEMA_VERSION, secret="s")
    with trio.fail_after(30):
        async with (
            transport.open_pull(bind="tcp://127.0.0.1:0", codec=codec, curve=keys) as pull,
            transport.open_push(connect=transport.bound_address(pull), codec=codec, curve=keys) as push,
        ):
            for version in range(3):
                await push.send(payload(version))
            for version in range(3):
                assert await pull.recv() == payload(version)
        async with transport.open_router(bind="tcp://127.0.0.1:0", curve=keys) as router:

            async def controller() -> None:
                identity, msg = await router.recv()
                assert msg == hello
                await router.send(identity, Welcome(schema_version=SCHEMA_VERSION, run_id="r"))

            async with trio.open_nursery() as nursery:
                nursery.start_soon(controller)
                async with transport.open_dealer(connect=transport.bound_address(router), curve=keys) as dealer:
                    answer = await dealer.request(hello, Welcome, timeout=10, setting="cluster.handshake_timeout_s")
                    assert answer.run_id == "r"
    assert router.rejected == {}


#: Seconds an intruder waits for its handshake to fail, all told.
INTRUDE_S = 15.0
#: Seconds after a disconnect in which the failure that caused it is still reported.
GRACE_S = 1.0


def intrude(address: str, kind: int, keys: CurveKeys | None, frames: list[list[bytes]]) -> str:
    """Connect a plain ZeroMQ socket of `kind` to `address`, as a CURVE client
    with `keys` if given, queue `frames`, and wait for the handshake to fail;
    how it failed: the kind of failure its monitor reports, or
    "disconnected" (the server dropped the connection before any handshake
    completed, and said no more). Every call has a deadline: a send that
    cannot queue gives up, and a server that keeps dropping the connection
    (each reconnect an event) does not keep it watching for ever."""
    deadline = time.monotonic() + INTRUDE_S
    ctx = zmq.Context()
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDTIMEO, 2_000)
    monitor = sock.get_monitor_socket()
    try:
        if keys is not None:
            sock.curve_serverkey = keys.server_public.encode()
            sock.curve_publickey = keys.client_public.encode()
            sock.curve_secretkey = keys.client_secret.encode()
        sock.connect(address)
        for message in frames:
            try:
                sock.send_multipart(message)
            except zmq.Again:  # nothing to queue it for: it cannot get in either
                break
        dropped_at = None
        while (left := deadline - time.monotonic()) > 0:
            if dropped_at is not None:
                left = min(left, dropped_at + GRACE_S - time.monotonic())
                if left <= 0:
                    return "disconnected"
            if not monitor.poll(max(1, int(left * 1000))):
                continue
            event = recv_monitor_message(monitor)["event"]
            if event in HANDSHAKE_FAILED:
                return HANDSHAKE_FAILED[event]
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                return "succeeded"
            if event == zmq.EVENT_DISCONNECTED and dropped_at is None:
                dropped_at = time.monotonic()
        raise AssertionError(f"neither a handshake failure nor a disconnect within {INTRUDE_S:g} s on {address}")
    finally:
        sock.disable_monitor()  # before closing either: a context with a live monitor may never end
        monitor.close(linger=0)
        sock.close(linger=0)
        ctx.term()


def keys_with(keys: CurveKeys, *, server_public: str) -> CurveKeys:
    """Another keypair of a client's own, that knows the server's public key."""
    own = transport.new_curve_keys()
    return CurveKeys(
        server_public=server_public, server_secret="", client_public=own.client_public, client_secret=own.client_secret
    )


@pytest.mark.parametrize("channel", ["data", "control"])
async def test_a_peer_without_the_run_keys_cannot_inject(channel):
    """Three intruders each try to get a message in: no keys at all, a keypair
    of their own that knows the server's public key (refused by the ZAP
    handler, and counted), and another run's keys. Each handshake fails;
    afterwards the run's own client gets through, and only its message
    arrives."""
    keys = transport.new_curve_keys()
    data = channel == "data"
    codec = Codec()
    if data:
        server = transport.open_pull(bind="tcp://127.0.0.1:0", codec=Codec(WeightsMessage), curve=keys)
        kind, sent = zmq.PUSH, codec.encode(payload(666))
    else:
        server = transport.open_router(bind="tcp://127.0.0.1:0", curve=keys)
        impostor = Hello(role=Role.ROLLOUT, rank=0, replicas=1, schema_version=SCHEMA_VERSION, secret="leaked")
        kind, sent = zmq.DEALER, codec.encode(impostor)
    intruders = {
        "no keys": None,
        "own keypair": keys_with(keys, server_public=keys.server_public),
        "another run's keys": transport.new_curve_keys(),
    }
    with trio.fail_after(60):
        async with server as sock:
            address = transport.bound_address(sock)
            failures = {}
            for who, their_keys in intruders.items():
                # Abandoned on cancel: an intruder that overstays fails the test instead of hanging it.
                failures[who] = await trio.to_thread.run_sync(intrude, address, kind, their_keys, [sent, sent],
                                                              abandon_on_cancel=True)
            # None got in; the ZAP handler refused the one that completed CURVE's key exchange.
            assert "succeeded" not in failures.values(), failures
            assert failures["own keypair"] == "auth"
            assert sock.rejected == {"unauthenticated": 1}
            if data:
                async with transport.open_push(connect=address, codec=Codec(WeightsMessage), curve=keys) as push:
                    await push.send(payload(1))
                    assert (await sock.recv()).version == 1
            else:
                async with transport.open_dealer(connect=address, curve=keys) as dealer:
                    await dealer.send(Shutdown(reason="ours", secret="s"))
                    _, msg = await sock.recv()
                    assert msg == Shutdown(reason="ours", secret="s")
            await trio.sleep(0.2)
            if data:
                assert sock.recv_nowait() is None
            else:
                assert sock.received == 1


async def test_binding_or_connecting_off_this_host_without_curve_is_refused():
    off_host = ["tcp://0.0.0.0:0", "tcp://*:0", "tcp://192.0.2.1:0", "tcp://[::]:0"]
    ip = node_ip()
    if not endpoint_is_local(f"tcp://{ip}:0"):
        off_host.append(f"tcp://{ip}:0")
    with trio.fail_after(30):
        for address in off_host:
            refused = r"refusing to bind .* without CURVE keys.*cluster\.curve"
            with pytest.raises(transport.InsecureEndpoint, match=refused):
                async with transport.open_pull(bind=address):
                    pass
        with pytest.raises(transport.InsecureEndpoint, match="refusing to connect tcp://192.0.2.1:5555"):
            async with transport.open_dealer(connect="tcp://192.0.2.1:5555"):
                pass
        async with transport.open_push(connect=[]) as push:
            with pytest.raises(transport.InsecureEndpoint):
                transport.connect(push, "tcp://192.0.2.1:5555")
        # With the run's keys, the node's own address binds (where it has one).
        if len(off_host) == 5:
            keys = transport.new_curve_keys()
            async with transport.open_pull(bind=off_host[-1], curve=keys) as pull:
                assert transport.bound_address(pull).startswith(f"tcp://{ip}:")


def test_curve_is_on_whenever_other_hosts_can_reach_the_sockets():
    def cluster(*overrides: str) -> C.ClusterConfig:
        return C.load(SIM, list(overrides)).cluster

    assert not cluster().uses_curve  # one machine: loopback, no CURVE
    assert cluster("cluster.curve=on").uses_curve
    assert cluster("cluster.host=").uses_curve  # each node's own IP
    assert cluster("cluster.host=10.1.2.3").uses_curve
    assert not cluster("cluster.host=::1").uses_curve
    with pytest.raises(C.ConfigError, match=r"cluster\.host = '0\.0\.0\.0': a wildcard is no address to connect to"):
        cluster("cluster.host=0.0.0.0")
    with pytest.raises(C.ConfigError, match=r"cluster\.curve = 'off'"):
        cluster("cluster.curve=off")


def test_a_run_over_several_nodes_on_loopback_is_refused():
    check_reach("127.0.0.1", 1)
    check_reach("", 2)
    refused = r"cluster\.host = '127\.0\.0\.1': the run spans 2 Ray nodes.*leave it empty"
    with pytest.raises(C.ConfigError, match=refused):
        check_reach("127.0.0.1", 2)


def test_the_keys_never_show_in_a_repr():
    keys = transport.new_curve_keys()
    assert keys.server_secret not in repr(keys) and keys.client_secret not in repr(keys)
    assert keys.server_public in repr(keys)


def test_a_process_with_curve_sockets_exits_cleanly():
    """At exit the ZAP handler's thread is stopped before the sockets it
    polls are destroyed: the process ends at once and says nothing."""
    script = (
        "import trio\n"
        "from rlflow.data import transport\n"
        "async def main():\n"
        "    keys = transport.new_curve_keys()\n"
        "    async with transport.open_pull(bind='tcp://127.0.0.1:0', curve=keys) as pull:\n"
        "        async with transport.open_push(connect=transport.bound_address(pull), curve=keys) as push:\n"
        "            await push.send_frames([b'x'])\n"
        "            await pull.recv_frames()\n"
        "    async with transport.open_router(bind='tcp://127.0.0.1:0', curve=keys):\n"
        "        pass\n"
        "trio.run(main)\n"
    )
    done = subprocess.run([sys.executable, "-W", "error", "-c", script], capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stderr) == (0, "")
