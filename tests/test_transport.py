"""trio/ZeroMQ transport: across processes, backpressure, cancellation, hostile peers."""

from __future__ import annotations

import multiprocessing as mp
import os
import tempfile

import msgspec
import numpy as np
import psutil
import pytest
import trio
import trio.testing
import zmq
from peers import echo, late_consumer, send_and_exit, spawned

from rlflow.data import transport
from rlflow.protocol import (
    DTYPE_SIZES,
    SCHEMA_VERSION,
    Codec,
    Hello,
    Ready,
    Role,
    Tensor,
    WeightsMessage,
    WeightsPayload,
    Welcome,
)

MiB = 1 << 20


@pytest.fixture
def ipc_dir():
    with tempfile.TemporaryDirectory(prefix="rlflow-", dir="/tmp") as path:
        yield path


def random_tensor(dtype: str, shape: tuple[int, ...], seed: int) -> Tensor:
    raw = np.random.default_rng(seed).integers(0, 256, size=int(np.prod(shape)) * DTYPE_SIZES[dtype], dtype=np.uint8)
    if dtype == "bool":
        raw &= 1
    return Tensor(dtype, shape, raw)


def weights(version: int, tensor: Tensor) -> WeightsPayload:
    return WeightsPayload(version=version, names=["t"], tensors=[tensor])


@pytest.mark.parametrize("kind", ["ipc", "tcp"])
async def test_every_dtype_crosses_a_process_bit_exact(kind, ipc_dir):
    dtypes = sorted(DTYPE_SIZES)
    # Random bytes: NaN payloads, infinities and denormals included.
    sent = [random_tensor(d, (3, 1000 + i), seed=i) for i, d in enumerate(dtypes)]
    sent.append(random_tensor("float32", (4 * MiB,), seed=99))  # a large frame too
    address = (lambda name: transport.ipc_address(ipc_dir, name)) if kind == "ipc" else (lambda _: "tcp://127.0.0.1:0")
    codec = Codec(WeightsMessage)
    with trio.fail_after(60):
        async with (
            transport.open_push(bind=address("out"), codec=codec) as push,
            transport.open_pull(bind=address("back"), codec=Codec(WeightsMessage)) as pull,
        ):
            with spawned(echo, transport.bound_address(push), transport.bound_address(pull), len(sent)):
                for i, tensor in enumerate(sent):
                    await push.send(weights(i, tensor))
                for i, tensor in enumerate(sent):
                    back = await pull.recv()
                    assert back.version == i
                    assert back.tensors[0] == tensor, f"{tensor.dtype} changed in transit"
                    assert back.tensors[0].torch().dtype.__repr__().endswith(tensor.dtype)


@pytest.mark.slow  # holds a consumer stalled for seconds
async def test_a_stalled_consumer_blocks_the_producer_with_bounded_memory():
    """The producer blocks at the high-water marks: nothing is dropped and
    its memory stays bounded while the consumer takes nothing."""
    size, attempts, hwm = 4 * MiB, 100, 4
    proc_self = psutil.Process()
    ctx = mp.get_context("spawn")
    go, result = ctx.Event(), ctx.Queue()
    with trio.fail_after(120):
        async with transport.open_push(bind="tcp://127.0.0.1:0", hwm=hwm, codec=Codec(WeightsMessage)) as push:
            with spawned(late_consumer, transport.bound_address(push), go, result):
                # Wait until the consumer has connected (ZeroMQ holds messages
                # for nobody until a peer connects, which is also bounded).
                await push.send(weights(0, Tensor.from_numpy(np.zeros(size, np.uint8))))
                rss0 = proc_self.memory_info().rss
                sent, peak, blocked = 1, 0, False
                for version in range(1, attempts):
                    # A fresh buffer per message, so queued messages hold memory.
                    tensor = Tensor.from_numpy(np.full(size, version % 256, np.uint8))
                    async with trio.open_nursery() as nursery:
                        done = trio.Event()

                        async def send(message=weights(version, tensor)) -> None:
                            await push.send(message)
                            done.set()

                        nursery.start_soon(send)
                        # Blocked: every task here waits, the send among them.
                        await trio.testing.wait_all_tasks_blocked()
                        blocked = not done.is_set()
                        nursery.cancel_scope.cancel()  # a cancelled send has queued nothing
                    peak = max(peak, proc_self.memory_info().rss - rss0)
                    if blocked:
                        break
                    sent += 1
                assert blocked, f"producer never blocked after {sent} messages of 4 MiB"
                # Both high-water marks plus the kernel's socket buffers.
                assert sent <= 2 * hwm + 8, f"{sent} messages queued with high-water marks of {hwm}"
                assert peak < (2 * hwm + 8) * size, f"producer grew by {peak / MiB:.0f} MiB"
                go.set()
                for version in range(sent, sent + 3):  # unblocked again
                    await push.send(weights(version, Tensor.from_numpy(np.zeros(size, np.uint8))))
                got = await trio.to_thread.run_sync(result.get, True, 60, abandon_on_cancel=True)
    assert got == list(range(sent + 3)), "messages were lost or reordered"


async def test_messages_queued_by_an_exiting_process_are_delivered(ipc_dir):
    """A peer that exits right after queueing zero-copy sends: its buffers
    must stay alive until ZeroMQ has sent them (no loss, no corruption)."""
    count, size = 6, 4 * MiB
    with trio.fail_after(60):
        async with transport.open_pull(bind=transport.ipc_address(ipc_dir, "in"), codec=Codec(WeightsMessage)) as pull:
            with spawned(send_and_exit, transport.bound_address(pull), count, size) as proc:
                while proc.is_alive():  # take nothing until the sender is gone
                    await trio.sleep(0.05)
                for version in range(count):
                    msg = await pull.recv()
                    assert msg.version == version
                    data = msg.tensors[0].numpy()
                    assert data.size == size and data.min() == data.max() == version


async def test_cancelled_receives_lose_nothing(ipc_dir):
    count = 3000
    address = transport.ipc_address(ipc_dir, "s")
    got: list[int] = []
    with trio.fail_after(60):
        async with (
            transport.open_pull(bind=address, codec=Codec(WeightsMessage)) as pull,
            transport.open_push(connect=address, codec=Codec(WeightsMessage)) as push,
        ):

            async def produce() -> None:
                empty = Tensor("uint8", (0,), b"")
                for i in range(count):
                    await push.send(weights(i, empty))
                    if i % 7 == 0:
                        await trio.sleep(0.0005)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(produce)
                cancelled = 0
                while len(got) < count:
                    # Deadlines short enough that many receives are cancelled
                    # while parked, some just as a message arrives.
                    with trio.move_on_after(0.0002) as scope:
                        got.append((await pull.recv()).version)
                    cancelled += scope.cancelled_caught
    assert got == list(range(count))
    assert cancelled > 0


async def test_bad_messages_are_counted_and_the_loop_goes_on(ipc_dir):
    address = transport.ipc_address(ipc_dir, "hostile")
    good = Codec(WeightsMessage).encode(weights(1, Tensor.of([1, 2, 3], "uint8")))
    good = [bytes(memoryview(f).cast("B")) for f in good]

    def envelope(body) -> bytes:
        return msgspec.msgpack.encode([SCHEMA_VERSION, body])

    hostile = [
        [b"\xc1\xff\x00"],  # not msgpack
        [good[0][:-2], good[1]],  # truncated header
        [envelope([99, 1])],  # unknown tag
        [msgspec.msgpack.encode([SCHEMA_VERSION + 7, [40, 1]])],  # wrong version
        [good[0]],  # tensor frame missing
        [*good, b"spare"],  # one frame too many
        [envelope([41, 1, ["t"], [["int64", [2**40], 1]]]), b"12345678"],  # declared size != frame
        [envelope([41, 1, ["t"], [["complex128", [1], 1]]]), b"x" * 16],  # unknown dtype
        [bytes([0x92, SCHEMA_VERSION]) + b"\x93\x28\x01" + b"\x91" * 1000 + b"\x00"],  # nested 1000 levels deep
        [good[0], *[b""] * 100],  # more frames than the socket takes
    ]
    ctx = zmq.Context.instance()
    raw = ctx.socket(zmq.PUSH)
    raw.setsockopt(zmq.SNDTIMEO, 10_000)  # a send in trio's thread must not block it past fail_after
    try:
        with trio.fail_after(30):
            async with transport.open_pull(bind=address, codec=Codec(WeightsMessage)) as pull:
                pull.max_frames = 64
                raw.connect(address)
                for i, frames in enumerate(hostile):
                    raw.send_multipart(frames)
                    raw.send_multipart([envelope([40, i])])  # a good WeightsRequest after each
                received = [(await pull.recv()).version for _ in hostile]
                assert received == list(range(len(hostile)))
                assert dict(pull.rejected) == {
                    "malformed": 2,
                    "truncated": 1,
                    "unknown_type": 1,
                    "wrong_version": 1,
                    "frame_count": 3,
                    "frame_size": 1,
                    "dtype": 1,
                }
    finally:
        raw.close(linger=0)


async def test_request_reply_and_a_timeout_that_names_the_setting():
    hello = Hello(role=Role.REWARD, rank=0, replicas=1, schema_version=SCHEMA_VERSION)
    with trio.fail_after(30):
        async with transport.open_router(bind="tcp://127.0.0.1:0") as router:
            address = transport.bound_address(router)

            async def controller() -> None:
                identity, msg = await router.recv()
                assert msg == hello
                await router.send(identity, Welcome(schema_version=SCHEMA_VERSION, run_id="r"))

            async with trio.open_nursery() as nursery:
                nursery.start_soon(controller)
                async with transport.open_dealer(connect=address, identity=b"reward-0") as dealer:
                    answer = await dealer.request(hello, Welcome, timeout=10, setting="cluster.handshake_timeout_s")
                    assert answer.run_id == "r"
                    with pytest.raises(TimeoutError, match="raise cluster.handshake_timeout_s"):
                        await dealer.request(Ready(), Welcome, timeout=0.2, setting="cluster.handshake_timeout_s")
            with pytest.raises(transport.PeerUnreachable, match="nobody"):
                await router.send(b"nobody", Welcome(schema_version=SCHEMA_VERSION, run_id="r"))


async def test_concurrent_send_and_receive_on_one_socket():
    """A DEALER used by a sender task and a receiver task at once (the edge
    one of them consumes must not strand the other)."""
    n = 2000
    with trio.fail_after(60):
        async with transport.open_router(bind="tcp://127.0.0.1:0") as router:
            async with transport.open_dealer(connect=transport.bound_address(router)) as dealer:

                async def bounce() -> None:
                    for _ in range(n):
                        identity, msg = await router.recv()
                        await router.send(identity, msg)

                async def send() -> None:
                    for i in range(n):
                        await dealer.send(Ready(version=i))

                got = []
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(bounce)
                    nursery.start_soon(send)
                    for _ in range(n):
                        got.append((await dealer.recv()).version)
    assert got == list(range(n))


async def test_sockets_close_on_exit_and_on_error():
    with trio.fail_after(30):
        with pytest.raises(RuntimeError, match="boom"):
            async with transport.open_push(bind="tcp://127.0.0.1:0") as push:
                raise RuntimeError("boom")
        assert push.closed
        async with transport.open_pull(bind="tcp://127.0.0.1:0") as pull:
            pass
        assert pull.closed


def test_ipc_paths_that_do_not_fit_are_refused():
    with pytest.raises(ValueError, match="at most 100"):
        transport.ipc_address("/tmp/" + "x" * 120, "s")


def test_only_the_transport_module_imports_zmq():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    offenders = []
    for folder in ("rlflow", "services", "protocol"):
        for dirpath, _, files in os.walk(os.path.join(root, folder)):
            for name in files:
                path = os.path.join(dirpath, name)
                if name.endswith(".py") and not path.endswith(os.path.join("rlflow", "data", "transport.py")):
                    with open(path) as f:
                        if any(line.startswith(("import zmq", "from zmq")) for line in f):
                            offenders.append(path)
    assert offenders == []


async def test_a_sender_with_no_live_peer_waits_and_goes_on_to_the_next_one():
    """A PUSH queues only to connected peers: with its one peer gone, a send
    waits (nothing is queued for the dead peer), and goes out as soon as the
    stream is pointed at a new peer, also when the new connection's signal
    came while another call used the socket."""
    async with transport.open_pull(bind=transport.tcp_address()) as first, \
            transport.open_push(connect=transport.bound_address(first)) as push:
        await push.send_frames([b"x"])
        assert [bytes(f) for f in await first.recv_frames()] == [b"x"]
        old = transport.bound_address(first)
        first.close()
        for _ in range(50):  # until this side has seen the disconnect
            if not push._sock.getsockopt(zmq.EVENTS) & zmq.POLLOUT:
                break
            await trio.sleep(0.02)
        with trio.move_on_after(0.3) as waited:
            await push.send_frames([b"nobody"])
        assert waited.cancelled_caught, "a message was queued for a peer that is gone"
        async with transport.open_pull(bind=transport.tcp_address()) as second, trio.open_nursery() as nursery:
            nursery.start_soon(push.send_frames, [b"y"])
            await trio.sleep(0.1)  # parked
            transport.connect(push, transport.bound_address(second))
            transport.disconnect(push, old)
            with trio.fail_after(10):
                assert [bytes(f) for f in await second.recv_frames()] == [b"y"]
