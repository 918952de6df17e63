"""Worker processes: a parent that starts them, talks to each over a pipe,
and kills it (with everything it started) when it hangs or the parent goes;
the worker's side of the same pipe. Shared machinery: the reward functions'
pool (`rlflow.rewards`) and the environments' (`rlflow.env`) both run on it.

On the pipe each message is a 4-byte big-endian length and a msgpack body
(`frame`); which messages cross is each pool's own.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import subprocess
import sys
import traceback
from typing import Any

import msgspec
import trio

#: Bytes of a message's length before its body on a pipe.
HEADER = 4

_encoder = msgspec.msgpack.Encoder()


# -- the parent's side ---------------------------------------------------------------------------------------


class PoolError(RuntimeError):
    """A pool cannot run one of its functions: a worker of it did not start, or the pool is closed (the
    message names which and why)."""


class WorkerBroken(Exception):
    """A worker can no longer be used; the message says what happened to it."""


async def spawn(boot: str, env: dict[str, str]) -> trio.Process:
    """A worker process running the Python code `boot`, with the pipes of
    `WorkerProcess` and a process group of its own (killed as one)."""
    return await trio.lowlevel.open_process(
        [sys.executable, "-c", boot],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env=env,
        start_new_session=True,
    )


def worker_env(import_dir: str) -> tuple[list[str], dict[str, str]]:
    """The import path of the workers (`import_dir` first, then where this
    process imports from; '' resolved now, once) and their environment."""
    sys_path = [os.path.abspath(entry) for entry in ([import_dir, *sys.path] if import_dir else sys.path)]
    return sys_path, {**os.environ, "PYTHONPATH": os.pathsep.join(sys_path)}


class WorkerProcess:
    """One worker process and the pipes to it (its replies of type `replies`)."""

    def __init__(self, process: trio.Process, replies: Any):
        self.process = process
        self._buffer = bytearray()
        self._decoder = msgspec.msgpack.Decoder(replies)

    async def request(self, data: bytes) -> Any:
        """Send a framed message and read the reply."""
        assert self.process.stdin is not None
        try:
            await self.process.stdin.send_all(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            raise WorkerBroken(await self._ended()) from None
        return await self.receive()

    async def receive(self) -> Any:
        assert self.process.stdout is not None
        buffer = self._buffer
        while True:
            if len(buffer) >= HEADER:
                end = HEADER + int.from_bytes(buffer[:HEADER], "big")
                if len(buffer) >= end:
                    body = bytes(buffer[HEADER:end])
                    del buffer[:end]
                    try:
                        return self._decoder.decode(body)
                    except msgspec.DecodeError as error:
                        self.kill()
                        raise WorkerBroken(f"the worker sent an unreadable reply ({error}); it was killed") from None
            try:
                chunk = await self.process.stdout.receive_some(1 << 16)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                chunk = b""
            if not chunk:
                raise WorkerBroken(await self._ended())
            buffer += chunk

    async def _ended(self) -> str:
        """How the worker ended, once its pipe has: it normally has exited
        already; one that closed its pipe and lives on is killed."""
        with trio.move_on_after(1.0):
            await self.process.wait()
        if self.process.returncode is None:
            self.kill()
            await self.process.wait()
            return "the worker closed its pipe; it was killed"
        code = self.process.returncode
        if code < 0:
            try:
                name = signal.Signals(-code).name
            except ValueError:
                name = f"signal {-code}"
            return f"the worker died of {name} (its stderr is in this process's log)"
        return f"the worker exited with code {code}"

    def kill(self) -> None:
        """SIGKILL the worker and everything it started (its process group;
        a sandboxed run ends with its caller anyway)."""
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    async def reap(self) -> None:
        """Kill, wait for the end, close the pipes."""
        self.kill()
        await self.process.wait()
        for pipe in (self.process.stdin, self.process.stdout):
            if pipe is not None:
                await pipe.aclose()


# -- the worker's side ---------------------------------------------------------------------------------------


def frame(message: Any) -> bytes:
    """A message as it goes down a pipe."""
    body = _encoder.encode(message)
    return len(body).to_bytes(HEADER, "big") + body


def take_pipes() -> tuple[int, int]:
    """The descriptors of the parent's pipes (incoming, outgoing), moved out
    of the way of the worker's own I/O: stdin reads nothing, stdout goes to
    stderr. A segfault leaves the Python stack on stderr."""
    incoming, outgoing = os.dup(0), os.dup(1)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    os.dup2(2, 1)
    faulthandler.enable()
    return incoming, outgoing


def describe(error: BaseException) -> str:
    """The exception's type and message, and where it was raised."""
    kind = type(error)
    name = kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"
    text = f"{name}: {error}"
    frames = traceback.extract_tb(error.__traceback__)
    if frames:
        last = frames[-1]
        text += f" (at {last.filename}:{last.lineno} in {last.name})"
    return text if len(text) <= 2000 else text[:1997] + "..."


def read_message(fd: int) -> bytes | None:
    """One message's body, or None at end of input."""
    header = _read_exactly(fd, HEADER)
    if header is None:
        return None
    body = _read_exactly(fd, int.from_bytes(header, "big"))
    if body is None:
        raise EOFError("the pool closed the pipe in the middle of a message")
    return body


def _read_exactly(fd: int, n: int) -> bytes | None:
    chunks, left = [], n
    while left:
        chunk = os.read(fd, min(left, 1 << 20))
        if not chunk:
            if left == n:
                return None
            raise EOFError("the pool closed the pipe in the middle of a message")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def write_message(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def die_with_parent(parent_pid: int) -> None:
    """SIGKILL this worker's process group when its parent dies, even mid-call.

    A thread watches the parent: PR_SET_PDEATHSIG would fire when the
    *thread* that started the worker ends, and trio starts processes from
    its worker threads, which end after a while idle (a worker that took
    longer to start than that was killed)."""
    import signal
    import threading
    import time

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(0.2)
        os.killpg(os.getpgrp(), signal.SIGKILL)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()
