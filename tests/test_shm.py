"""Tensors through shared memory: across real processes and sockets, what a
death leaves behind, bounded memory, hostile descriptions, negotiation."""

from __future__ import annotations

import gc
import multiprocessing as mp
import os
import shutil
import signal
import subprocess
import sys

import msgspec
import numpy as np
import psutil
import pytest
import trio
import trio.testing
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from peers import drain, hold, late_consumer, send_and_wait, send_shm_and_exit, shm_echo, spawned

from rlflow.data import shm, transport
from rlflow.data.shm import SegmentMap, SegmentPool, ShmSettings
from rlflow.protocol import (
    DTYPE_SIZES,
    Codec,
    ProtocolError,
    Tensor,
    WeightsMessage,
    WeightsPayload,
)
from rlflow.protocol.errors import FrameCountMismatch, SharedMemoryError
from rlflow.protocol.shm import CONTROL_BYTES, ShmSegment

MiB = 1 << 20


@pytest.fixture
def ipc_dir(tmp_path_factory):
    # Socket paths must be short: tmp_path is too deep for sun_path.
    path = tmp_path_factory.mktemp("s", numbered=True)
    short = f"/tmp/rlflow-shm-{os.getpid()}-{path.name}"
    os.makedirs(short)
    try:
        yield short
    finally:
        shutil.rmtree(short, ignore_errors=True)


def random_tensor(dtype: str, shape: tuple[int, ...], seed: int) -> Tensor:
    raw = np.random.default_rng(seed).integers(0, 256, size=int(np.prod(shape)) * DTYPE_SIZES[dtype], dtype=np.uint8)
    if dtype == "bool":
        raw &= 1
    return Tensor(dtype, shape, raw)


def payload(version: int, *tensors: Tensor) -> WeightsPayload:
    return WeightsPayload(version=version, names=[f"t{i}" for i in range(len(tensors))], tensors=list(tensors))


def filled(version: int, size: int) -> Tensor:
    return Tensor.from_numpy(np.full(size, version % 256, np.uint8))


def segments_here(label: str) -> list[str]:
    """This process's descriptors and mappings of segments named with `label`."""
    fds = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            fds.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:  # closed since the listing: the listing's own descriptor, or another thread's
            continue
    with open("/proc/self/maps") as f:
        maps = f.read().splitlines()
    return [x for x in fds + maps if f"rlflow-{label}" in x]


def named_in_dev_shm(*needles: str) -> list[str]:
    return [name for name in os.listdir("/dev/shm") if "rlflow" in name or any(n in name for n in needles)]


# -- across processes -----------------------------------------------------------------


async def test_every_dtype_crosses_two_processes_through_shared_memory_bit_exact(ipc_dir):
    """Both ways through shared memory (the peer sends back what it took from
    its segments); small tensors ride along in frames, in the same messages."""
    dtypes = sorted(DTYPE_SIZES)
    sent = [
        payload(i, random_tensor(d, (3, 1000 + i), seed=i), Tensor.of([i, 1, 2], "int64"))
        for i, d in enumerate(dtypes)
    ]
    sent.append(payload(len(sent), random_tensor("float32", (4 * MiB,), seed=99)))
    min_bytes = 3000  # every dtype's big tensor (>= 3,000 bytes), none of the small ones
    with trio.fail_after(120):
        async with (
            transport.open_push(
                bind=transport.ipc_address(ipc_dir, "out"), codec=Codec(WeightsMessage),
                shm=ShmSettings(min_bytes=min_bytes),
            ) as push,
            transport.open_pull(bind=transport.ipc_address(ipc_dir, "back"), codec=Codec(WeightsMessage)) as pull,
        ):
            assert push.uses_shm
            address = transport.bound_address
            with spawned(shm_echo, address(push), address(pull), len(sent), min_bytes):
                for msg in sent:
                    await push.send(msg)
                    back = await pull.recv()
                    assert back.version == msg.version
                    for got, want in zip(back.tensors, msg.tensors, strict=True):
                        assert got == want, f"{want.dtype} changed in transit"
                        assert got.torch().dtype.__repr__().endswith(want.dtype)
            assert push.pool.placed == len(sent) and pull.segments.taken == len(sent)
            assert push.bytes_shared == sum(m.tensors[0].nbytes for m in sent)
            del back


async def test_a_receiver_killed_mid_stream_leaves_nothing_and_its_segments_are_reused(ipc_dir):
    """The receiver holds three messages' tensors and has two more queued when
    it is killed. Nothing is ever named in /dev/shm; the three it held are
    free again at once (the kernel dropped its locks), the two queued stay
    counted in flight, and once the sender closes nothing of the segments is
    left in either process."""
    label = f"kill{os.getpid()}"
    size, held, queued = 2 * MiB, 3, 2
    before = set(named_in_dev_shm(label))
    ctx = mp.get_context("spawn")
    holding, result = ctx.Event(), ctx.Queue()
    with trio.fail_after(300):
        async with transport.open_push(
            bind=transport.ipc_address(ipc_dir, "out"), codec=Codec(WeightsMessage), linger_ms=0,
            shm=ShmSettings(min_bytes=4096, label=label),
        ) as push:
            pool = push.pool
            with spawned(hold, transport.bound_address(push), held, holding) as proc:
                for version in range(held):
                    await push.send(payload(version, filled(version, size)))
                assert await trio.to_thread.run_sync(holding.wait, 120), "the receiver never took its messages"
                for version in range(held, held + queued):
                    await push.send(payload(version, filled(version, size)))
                assert pool.in_use() == held + queued
                os.kill(proc.pid, signal.SIGKILL)
                await trio.to_thread.run_sync(proc.join, 30)
            assert pool.in_use() == queued, "the killed receiver's segments were not taken back"
            assert set(named_in_dev_shm(label)) == before
            made = pool.segments
            reserved = []
            for _ in range(held):  # the segments the dead receiver held are the next ones used
                assert pool.reserve(size + CONTROL_BYTES) is not None
                reserved.append(pool.take_reserved())
            assert pool.segments == made and len({id(r.segment) for r in reserved}) == held
            for placement in reserved:
                placement.unsend()
            with spawned(drain, transport.bound_address(push), 20, result):
                for version in range(100, 120):
                    await push.send(payload(version, filled(version, size)))
                got = await trio.to_thread.run_sync(result.get, True, 120)
            assert got == list(range(100, 120)) and pool.fallbacks == 0
            assert segments_here(label)
    assert segments_here(label) == [], "the sender kept segments after closing"
    assert set(named_in_dev_shm(label)) == before


async def test_a_sender_killed_mid_stream_leaves_nothing_once_its_receiver_lets_go(ipc_dir):
    """Messages the receiver took before the kill stay intact; those still
    queued whose segments it had not mapped cannot be opened any more and
    are rejected (``shm``); once it drops what it holds, no segment of the
    dead sender is left anywhere."""
    label = f"sk{os.getpid()}"
    count, size, taken = 6, 1 * MiB, 2
    before = set(named_in_dev_shm(label))
    ctx = mp.get_context("spawn")
    sent = ctx.Event()
    with trio.fail_after(300):
        async with transport.open_pull(
            bind=transport.ipc_address(ipc_dir, "in"), codec=Codec(WeightsMessage), hwm=100
        ) as pull:
            with spawned(send_and_wait, transport.bound_address(pull), count, size, label, sent) as proc:
                held = [await pull.recv() for _ in range(taken)]
                assert await trio.to_thread.run_sync(sent.wait, 120), "the sender never sent everything"
                os.kill(proc.pid, signal.SIGKILL)
                await trio.to_thread.run_sync(proc.join, 30)
            assert segments_here(label), "the taken messages' segments are mapped here"
            for version, msg in enumerate(held):
                data = msg.tensors[0].numpy()
                assert data.size == size and data.min() == data.max() == version
            later = []
            while len(later) + pull.rejected["shm"] < count - taken:
                msg = pull.recv_nowait()
                if msg is None:
                    await trio.sleep(0.01)
                else:
                    later.append(msg.version)
            assert later == [] and pull.rejected == {"shm": count - taken}
            del held, msg, data
            gc.collect()
    assert segments_here(label) == []
    assert set(named_in_dev_shm(label)) == before


@pytest.mark.slow  # holds a consumer stalled for seconds
async def test_a_stalled_consumer_holds_back_the_producer_with_bounded_memory_through_shared_memory():
    """As on the socket path: with the consumer taking nothing, the segments
    fill up to `max_bytes`, then tensors go in frames until the high-water
    marks hold the producer; nothing is dropped or reordered."""
    size, hwm, max_bytes = 4 * MiB, 4, 32 * MiB
    proc_self = psutil.Process()
    ctx = mp.get_context("spawn")
    go, result = ctx.Event(), ctx.Queue()
    with trio.fail_after(120):
        async with transport.open_push(
            bind="tcp://127.0.0.1:0", hwm=hwm, codec=Codec(WeightsMessage),
            shm=ShmSettings(min_bytes=MiB, max_bytes=max_bytes),
        ) as push:
            pool = push.pool
            with spawned(late_consumer, transport.bound_address(push), go, result):
                await push.send(payload(0, filled(0, size)))
                rss0 = proc_self.memory_info().rss
                sent, peak, blocked = 1, 0, False
                for version in range(1, 200):
                    tensor = filled(version, size)  # a fresh buffer per message, as before
                    async with trio.open_nursery() as nursery:
                        done = trio.Event()

                        async def send(message=payload(version, tensor)) -> None:
                            await push.send(message)
                            done.set()

                        nursery.start_soon(send)
                        await trio.testing.wait_all_tasks_blocked()
                        blocked = not done.is_set()
                        nursery.cancel_scope.cancel()  # a cancelled send has queued nothing, reserved nothing
                    peak = max(peak, proc_self.memory_info().rss - rss0)
                    if blocked:
                        break
                    sent += 1
                assert blocked, f"producer never blocked after {sent} messages of 4 MiB"
                in_segments = max_bytes // shm._size_class(size + CONTROL_BYTES)
                assert pool.nbytes <= max_bytes and pool.placed == in_segments and pool.fallbacks > 0
                assert sent <= in_segments + 2 * hwm + 8, f"{sent} messages queued"
                assert peak < max_bytes + (2 * hwm + 8) * size, f"producer grew by {peak / MiB:.0f} MiB"
                go.set()
                for version in range(sent, sent + 3):
                    await push.send(payload(version, filled(version, size)))
                got = await trio.to_thread.run_sync(result.get, True, 60)
    assert got == list(range(sent + 3)), "messages were lost or reordered"


async def test_a_sender_that_exits_waits_for_its_segments_to_be_taken(ipc_dir):
    """Closing lingers for segments in flight as ZeroMQ does for messages: a
    receiver that keeps reading gets everything of a sender that has exited."""
    count, size = 6, 2 * MiB
    with trio.fail_after(120):
        async with transport.open_pull(bind=transport.ipc_address(ipc_dir, "in"), codec=Codec(WeightsMessage)) as pull:
            with spawned(send_shm_and_exit, transport.bound_address(pull), count, size):
                for version in range(count):
                    msg = await pull.recv()
                    data = msg.tensors[0].numpy()
                    assert msg.version == version and data.size == size and data.min() == data.max() == version
            assert pull.segments.taken == count and pull.rejected == {}


# -- in one process -------------------------------------------------------------------


async def test_small_tensors_stay_in_frames_and_large_ones_share_one_segment():
    async with (
        transport.open_pull(bind="tcp://127.0.0.1:0", codec=Codec(WeightsMessage)) as pull,
        transport.open_push(
            connect=transport.bound_address(pull), codec=Codec(WeightsMessage), shm=ShmSettings(min_bytes=MiB)
        ) as push,
    ):
        small = [filled(i, 1024) for i in range(3)] + [filled(3, MiB - 1)]
        await push.send(payload(0, *small))
        frames = await pull.recv_frames()
        assert len(frames) == 1 + len(small) and push.pool.placed == 0 and push.bytes_shared == 0
        mixed = [filled(0, 10), filled(1, MiB), filled(2, 10), filled(3, 3 * MiB)]
        frames = Codec(WeightsMessage).encode(payload(1, *mixed), shm=push.pool)
        placed = push.pool.take_reserved()
        assert len(frames) == 1 + 3 and placed.nbytes == MiB + 3 * MiB  # two frames, one segment frame
        placed.unsend()
        await push.send(payload(1, *mixed))
        back = await pull.recv()
        assert back.tensors == mixed and pull.segments.taken == 1


async def test_a_received_tensor_keeps_its_segment_until_it_is_gone():
    """A view (numpy or torch) of a received tensor keeps its segment: the
    sender writes the next messages elsewhere; once it is gone, the segment
    is reused."""
    size = 2 * MiB
    async with (
        transport.open_pull(bind="tcp://127.0.0.1:0", codec=Codec(WeightsMessage)) as pull,
        transport.open_push(
            connect=transport.bound_address(pull), codec=Codec(WeightsMessage), shm=ShmSettings(min_bytes=4096)
        ) as push,
    ):
        await push.send(payload(1, filled(1, size)))
        kept = (await pull.recv()).tensors[0].torch()
        gc.collect()
        for version in range(2, 6):
            await push.send(payload(version, filled(version, size)))
            msg = await pull.recv()
            assert msg.tensors[0].numpy().min() == version
            assert not msg.tensors[0].numpy().flags.writeable
            del msg
        assert int(kept.min()) == int(kept.max()) == 1, "a held tensor was overwritten"
        assert push.pool.segments == 2 and push.pool.in_use() == 1
        del kept
        assert push.pool.in_use() == 0
        for version in range(6, 9):
            await push.send(payload(version, filled(version, size)))
            assert (await pull.recv()).version == version
        assert push.pool.segments == 2


async def test_cancelled_sends_through_shared_memory_lose_nothing_and_free_their_segments(ipc_dir):
    """Sends cancelled before they queue (every third one at once, the others
    by a short deadline while the consumer lags and the segments run out):
    what was sent arrives once and in order, and no segment stays taken."""
    count, size, max_bytes = 600, 64 * 1024, MiB
    address = transport.ipc_address(ipc_dir, "s")
    async with (
        transport.open_pull(bind=address, hwm=1, codec=Codec(WeightsMessage)) as pull,
        transport.open_push(
            connect=address, hwm=1, codec=Codec(WeightsMessage), shm=ShmSettings(min_bytes=4096, max_bytes=max_bytes)
        ) as push,
    ):
        completed, got = [], []
        done = trio.Event()

        async def consume() -> None:
            while not (done.is_set() and len(got) == len(completed)):
                with trio.move_on_after(0.05):
                    got.append((await pull.recv()).version)
                    await trio.sleep(0.0005)

        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(consume)
                for version in range(count):
                    with trio.move_on_after(0.0003) as scope:
                        if version % 3 == 0:
                            scope.cancel()
                        await push.send(payload(version, filled(version, size)))
                        completed.append(version)
                done.set()
        assert len(completed) < count * 2 / 3, "no send was cancelled by its deadline"
        assert got == completed
        assert push.pool.placed > len(completed) // 2 and push.pool.nbytes <= max_bytes
        assert push.pool.in_use() == 0


async def test_a_peer_that_takes_no_shared_memory_gets_every_tensor_in_frames():
    """A PUSH may hand a message to any peer: with one peer that takes no
    shared memory, none is used; once that peer is gone, it is again. A
    receiver that takes none rejects a segment it is sent anyway (counted),
    and goes on."""
    async with (
        transport.open_pull(bind="tcp://127.0.0.1:0", codec=Codec(WeightsMessage)) as takes,
        transport.open_pull(bind="tcp://127.0.0.1:0", codec=Codec(WeightsMessage), shm=False) as refuses,
    ):
        a, b = transport.bound_address(takes), transport.bound_address(refuses)
        async with transport.open_push(
            connect=[a, b], codec=Codec(WeightsMessage), shm=ShmSettings(min_bytes=4096), shm_peers=[a]
        ) as push:
            assert not push.uses_shm
            for version in range(10):
                await push.send(payload(version, filled(version, MiB)))
            got = []
            with trio.fail_after(10):
                while len(got) < 10:
                    msg = takes.recv_nowait() or refuses.recv_nowait()
                    if msg is None:
                        await trio.sleep(0.01)
                    else:
                        got.append(msg.version)
            assert sorted(got) == list(range(10)) and push.pool.placed == 0 and refuses.rejected == {}
            transport.disconnect(push, b)
            assert push.uses_shm
            # ZeroMQ ends the connection to b in its I/O thread: a send just after the disconnect may still
            # go to b, which rejects its segment (counted); that message is sent again.
            with trio.fail_after(30):
                while True:
                    rejected = refuses.rejected.get("shm", 0)
                    await push.send(payload(10, filled(10, MiB)))
                    while (msg := takes.recv_nowait()) is None:
                        assert refuses.recv_nowait() is None
                        if refuses.rejected.get("shm", 0) > rejected:
                            break
                        await trio.sleep(0.01)
                    if msg is not None:
                        break
            assert msg.version == 10 and push.pool.placed >= 1
            transport.connect(push, b)  # said nothing about shared memory: assumed not to take it
            assert not push.uses_shm
        rejected = refuses.rejected.get("shm", 0)
        async with transport.open_push(
            connect=b, codec=Codec(WeightsMessage), shm=ShmSettings(min_bytes=4096)
        ) as forced:
            await forced.send(payload(11, filled(11, MiB)))
            await forced.send(payload(12, filled(12, 100)))
            with trio.fail_after(30):
                assert (await refuses.recv()).version == 12 and refuses.rejected == {"shm": rejected + 1}


async def test_no_shared_memory_off_this_host():
    curve = transport.new_curve_keys()
    async with transport.open_pull(bind="tcp://127.0.0.1:0", curve=curve) as pull:
        address = transport.bound_address(pull)
        async with transport.open_push(connect=address, curve=curve, shm=ShmSettings()) as push:
            assert push.uses_shm  # loopback with CURVE: this host only
        outside = address.replace("127.0.0.1", "192.0.2.1")  # TEST-NET: never reached
        async with transport.open_push(connect=outside, curve=curve, shm=ShmSettings()) as push:
            assert not push.uses_shm


# -- hostile descriptions ----------------------------------------------------------------


def _message_in(pool: SegmentPool, *tensors: Tensor) -> list[bytes]:
    frames = Codec(WeightsMessage).encode(payload(1, *tensors), shm=pool)
    pool.take_reserved()
    return [bytes(memoryview(f).cast("B")) for f in frames]


def _with_segment(frames: list[bytes], **changes) -> list[bytes]:
    described = msgspec.msgpack.decode(frames[1], type=ShmSegment)
    return [frames[0], msgspec.msgpack.encode(msgspec.structs.replace(described, **changes))]


def _with_offset(frames: list[bytes], offset: int) -> list[bytes]:
    version, body = msgspec.msgpack.decode(frames[0])
    body[3][0][3] = offset
    return [msgspec.msgpack.encode([version, body]), frames[1]]


@pytest.fixture
def pool():
    p = SegmentPool(ShmSettings(min_bytes=16, label=f"h{os.getpid()}"), "test")
    yield p
    p.close(0)


def test_a_tensor_in_shared_memory_is_refused_by_a_receiver_that_takes_none(pool):
    with pytest.raises(SharedMemoryError, match="takes none"):
        Codec(WeightsMessage).decode(_message_in(pool, filled(1, 100)))


def test_descriptions_that_do_not_fit_their_segment_are_refused(pool):
    frames = _message_in(pool, filled(1, 100))
    size = msgspec.msgpack.decode(frames[1], type=ShmSegment).size
    null = os.open("/dev/null", os.O_RDONLY)
    bad = {
        "misaligned": _with_offset(frames, CONTROL_BYTES + 1),
        "in the control page": _with_offset(frames, 64),
        "past the end": _with_offset(frames, size - 64),
        "another id": _with_segment(frames, id="0" * 32),
        "a stale seq": _with_segment(frames, seq=7),
        "a wrong size": _with_segment(frames, size=size + 4096),
        "a descriptor that is not a file": _with_segment(frames, fd=null),
        "a process that does not exist": _with_segment(frames, pid=2**22 + 12345),
        "not a segment frame": [frames[0], b"\xc1"],
        "a field out of range": [frames[0], msgspec.msgpack.encode([os.getpid(), 3, "zz", 1, 4096])],
    }
    try:
        for why, message in bad.items():
            with pytest.raises(SharedMemoryError):
                Codec(WeightsMessage).decode(message, shm=SegmentMap())
                pytest.fail(why)
    finally:
        os.close(null)
    taken = Codec(WeightsMessage).decode(frames, shm=SegmentMap())
    assert taken.tensors[0] == filled(1, 100)
    with pytest.raises(SharedMemoryError, match="taken before"):
        Codec(WeightsMessage).decode(frames, shm=SegmentMap())


def test_a_frame_is_a_segment_or_tensor_bytes_not_both(pool):
    frames = _message_in(pool, filled(1, 100))
    version, body = msgspec.msgpack.decode(frames[0])
    body[3].append(["uint8", [4], 1])
    body[2].append("u")
    with pytest.raises(FrameCountMismatch, match="named by two tensors"):
        Codec(WeightsMessage).decode([msgspec.msgpack.encode([version, body]), frames[1]], shm=SegmentMap())


def test_a_file_others_may_read_is_refused(pool):
    frames = _message_in(pool, filled(1, 100))
    described = msgspec.msgpack.decode(frames[1], type=ShmSegment)
    os.fchmod(described.fd, 0o644)
    with pytest.raises(SharedMemoryError, match="not a private file"):
        Codec(WeightsMessage).decode(frames, shm=SegmentMap())


@settings(max_examples=150, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(st.data())
def test_corrupted_shared_memory_messages_raise_only_protocol_errors(pool, data):
    frames = _message_in(pool, filled(1, data.draw(st.integers(16, 5000))), filled(2, 3))
    for _ in range(data.draw(st.integers(1, 3))):
        which = data.draw(st.integers(0, 1))
        frame = bytearray(frames[which])
        # Positions drawn whatever the frame's length (a descriptor's fd, and
        # so its length, differs from one run to the next).
        frame[data.draw(st.integers(0, 255)) % len(frame)] = data.draw(st.integers(0, 255))
        frames[which] = bytes(frame)
    try:
        Codec(WeightsMessage).decode(frames, shm=SegmentMap())
    except ProtocolError:
        pass


# -- who may map whose memory ------------------------------------------------------------


def test_segments_are_private_to_their_user(pool):
    frames = _message_in(pool, filled(1, 100))
    described = msgspec.msgpack.decode(frames[1], type=ShmSegment)
    assert os.fstat(described.fd).st_mode & 0o777 == 0o600
    assert os.readlink(f"/proc/self/fd/{described.fd}").startswith(f"/memfd:rlflow-h{os.getpid()}-test-")
    if os.getuid() != 0:
        pytest.skip("needs root to try as another user")
    other = (
        "import os\nos.setgid(65534)\nos.setuid(65534)\n"
        f"try:\n    os.open('/proc/{os.getpid()}/fd/{described.fd}', os.O_RDONLY)\n    print('opened')\n"
        "except PermissionError:\n    print('refused')\n"
    )
    out = subprocess.run([sys.executable, "-c", other], capture_output=True, text=True, timeout=30)
    assert out.stdout.strip() == "refused", out.stderr


def test_the_host_token_tells_who_can_map_whose_memory():
    token = shm.host_token()
    boot, namespace, uid = token.split("/")
    assert len(boot) == 36 and int(namespace) > 0 and int(uid) == os.getuid()
    out = subprocess.run([sys.executable, "-c", "from rlflow.data.shm import host_token; print(host_token())"],
                         capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == token
    unshare = shutil.which("unshare")
    if os.getuid() != 0 or unshare is None:
        pytest.skip("needs root and unshare to make a PID namespace")
    # A process on the same loopback in another PID namespace: same host, but
    # it could not open /proc/<pid>/fd of this one; its token says so.
    other = subprocess.run(
        [unshare, "--pid", "--fork", "--mount-proc", sys.executable, "-c",
         "from rlflow.data.shm import host_token; print(host_token())"],
        capture_output=True, text=True, timeout=60,
    )
    if other.returncode != 0:
        pytest.skip(f"cannot make a PID namespace here: {other.stderr.strip()[-200:]}")
    assert other.stdout.strip().split("/")[0] == boot and other.stdout.strip() != token
