"""Peers that tests run in separate processes (multiprocessing, spawn).

Each is a plain function that runs one trio program and exits; the test that
starts it also stops it (see `spawned`).
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
from collections.abc import Iterator

import numpy as np
import trio

from rlflow.data import transport
from rlflow.data.shm import ShmSettings
from rlflow.protocol import Codec, Tensor, WeightsMessage, WeightsPayload


def echo(inbox: str, outbox: str, count: int) -> None:
    """Receive `count` weight messages on `inbox` and send each back on `outbox`."""

    async def main() -> None:
        async with (
            transport.open_pull(connect=inbox, codec=Codec(WeightsMessage)) as pull,
            # Closing waits (up to 60 s) until the last replies have left.
            transport.open_push(connect=outbox, linger_ms=60_000, codec=Codec(WeightsMessage)) as push,
        ):
            for _ in range(count):
                await push.send(await pull.recv())

    trio.run(main)


def late_consumer(address: str, go: mp.Event, result: mp.Queue) -> None:
    """Connect to `address`, take nothing until `go` is set, then drain and
    report the version numbers received, in order."""

    async def main() -> None:
        async with transport.open_pull(connect=address, hwm=4, codec=Codec(WeightsMessage)) as pull:
            if not await trio.to_thread.run_sync(go.wait, 120, abandon_on_cancel=True):
                raise TimeoutError("the test never said go (120 s)")
            got = []
            while True:
                with trio.move_on_after(2.0) as idle:
                    got.append((await pull.recv()).version)
                if idle.cancelled_caught:
                    break
            result.put(got)

    trio.run(main)


@contextlib.contextmanager
def spawned(target, *args) -> Iterator[mp.Process]:
    """Run `target(*args)` in a fresh process; kill it on the way out."""
    proc = mp.get_context("spawn").Process(target=target, args=args, daemon=True)
    proc.start()
    try:
        yield proc
    except BaseException:
        proc.kill()
        proc.join(timeout=30)
        raise
    proc.join(timeout=30)
    if proc.is_alive():
        proc.kill()
        proc.join(timeout=30)
        raise AssertionError(f"{target.__name__} did not exit within 30 s")


def send_and_exit(address: str, count: int, size: int) -> None:
    """Send `count` zero-copy messages of fresh `size`-byte buffers, then exit
    at once: the process's exit must still let them leave."""

    async def main() -> None:
        async with transport.open_push(connect=address, linger_ms=60_000, codec=Codec(WeightsMessage)) as push:
            for version in range(count):
                data = np.full(size, version, dtype=np.uint8)
                await push.send(WeightsPayload(version=version, names=["t"], tensors=[Tensor.from_numpy(data)]))

    trio.run(main)


def shm_echo(inbox: str, outbox: str, count: int, min_bytes: int) -> None:
    """Receive `count` weight messages on `inbox` and send each back on
    `outbox`, tensors of at least `min_bytes` bytes through shared memory."""

    async def main() -> None:
        async with (
            transport.open_pull(connect=inbox, codec=Codec(WeightsMessage)) as pull,
            transport.open_push(
                connect=outbox, linger_ms=60_000, codec=Codec(WeightsMessage), shm=ShmSettings(min_bytes=min_bytes)
            ) as push,
        ):
            for _ in range(count):
                await push.send(await pull.recv())
            assert push.pool.placed == count and pull.segments.taken == count

    trio.run(main)


def hold(address: str, count: int, holding: mp.Event) -> None:
    """Take `count` messages from `address` and keep their tensors, then set
    `holding` and wait (to be killed)."""

    async def main() -> None:
        async with transport.open_pull(connect=address, codec=Codec(WeightsMessage)) as pull:
            held = [(await pull.recv()).tensors[0].numpy() for _ in range(count)]
            assert len(held) == count
            holding.set()
            await trio.sleep_forever()

    trio.run(main)


def drain(address: str, count: int, result: mp.Queue) -> None:
    """Take `count` messages from `address`; report their versions."""

    async def main() -> None:
        async with transport.open_pull(connect=address, codec=Codec(WeightsMessage)) as pull:
            result.put([(await pull.recv()).version for _ in range(count)])

    trio.run(main)


def send_and_wait(address: str, count: int, size: int, label: str, sent: mp.Event) -> None:
    """Send `count` messages of one `size`-byte tensor through shared memory,
    then set `sent` and wait (to be killed)."""

    async def main() -> None:
        async with transport.open_push(
            connect=address, codec=Codec(WeightsMessage), shm=ShmSettings(min_bytes=4096, label=label)
        ) as push:
            for version in range(count):
                data = np.full(size, version, dtype=np.uint8)
                await push.send(WeightsPayload(version=version, names=["t"], tensors=[Tensor.from_numpy(data)]))
            sent.set()
            await trio.sleep_forever()

    trio.run(main)


def send_shm_and_exit(address: str, count: int, size: int) -> None:
    """Send `count` messages through shared memory, then exit at once: the
    process waits (up to its linger time) for them to be taken."""

    async def main() -> None:
        async with transport.open_push(
            connect=address, linger_ms=60_000, codec=Codec(WeightsMessage), shm=ShmSettings(min_bytes=4096)
        ) as push:
            for version in range(count):
                data = np.full(size, version, dtype=np.uint8)
                await push.send(WeightsPayload(version=version, names=["t"], tensors=[Tensor.from_numpy(data)]))

    trio.run(main)
