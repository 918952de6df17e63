"""The run's environment and tools in worker processes that can be killed,
called from trio.

`open_env_pool(...)` starts `workers` processes (see `worker.py`), each
with the environment made and the tools imported. Then `await
pool.call(kind, args, timeout_s)` runs one call (reset, step, tool or
reference) in the least busy worker and returns an `Outcome`. Guarantees:

* Every outcome says how it ended: ok (with its value), timeout, error
  (the code raised, or returned what it may not), crashed (its worker died).
* A call has `timeout_s`. Async code is cancelled there by the worker
  (timeout); code that does not give the worker back its loop (sync code,
  a blocking call) is stopped by the parent `KILL_GRACE_S` later: it SIGKILLs
  the worker's process group, the call is a timeout, the worker's other
  calls in flight crash, and a replacement starts in the background.
* A worker runs up to `concurrency` calls at once (async code overlaps;
  sync code waits its turn on the worker's loop).
* `call` may be called from many tasks at once. Cancelling a caller
  abandons its wait, never the call: it runs to its end in the worker, whose
  reply is then dropped.
* A worker that cannot start (the environment or a tool does not load, or
  it is not ready within `start_timeout_s`), at open or as a replacement,
  is fatal: `PoolError`.
* On exit every worker is killed, with whatever it started.
"""

from __future__ import annotations

import itertools
import logging
import os
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import msgspec
import trio

from rlflow.config.environment import EnvironmentSpec, ToolSpec, check_tools
from rlflow.env.worker import Call, Done, Failed, FromWorker, Hello, Ready
from rlflow.errors import leaves
from rlflow.workers import PoolError, WorkerBroken, WorkerProcess, frame, spawn, worker_env

log = logging.getLogger("rlflow.env")

_BOOT = "from rlflow.env.worker import main; main()"

#: Seconds past a call's timeout after which the parent kills a worker that has not answered.
KILL_GRACE_S = 1.0

#: Seconds to wait for killed workers to be reaped on the way out.
_REAP_S = 5.0


@dataclass(frozen=True)
class Outcome:
    """How one call ended: `status` ok (`value` set), timeout, error or crashed (`message` says)."""

    status: str
    value: Any = None
    message: str = ""

    @property
    def ok(self) -> bool:
        return self.status == "ok"


class _Pending:
    __slots__ = ("done", "outcome")

    def __init__(self) -> None:
        self.done = trio.Event()
        self.outcome: Outcome | None = None

    def settle(self, outcome: Outcome) -> None:
        if self.outcome is None:
            self.outcome = outcome
            self.done.set()


class _Worker:
    """One worker process, its calls in flight, and the lock on its pipe."""

    def __init__(self, process: WorkerProcess):
        self.process = process
        self.pending: dict[int, _Pending] = {}
        self.dead = False
        self.writing = trio.Lock()

    async def send(self, data: bytes) -> None:
        assert self.process.process.stdin is not None
        async with self.writing:
            try:
                await self.process.process.stdin.send_all(data)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                raise WorkerBroken("the worker's pipe is closed") from None


class EnvPool:
    """The running workers of `open_env_pool`; see the module docstring."""

    def __init__(self, hello: Hello, env: dict[str, str], *, workers: int, concurrency: int,
                 start_timeout_s: float, nursery: trio.Nursery):
        self._hello = frame(hello)
        self._env = env
        self._size = workers
        self._concurrency = concurrency
        self._start_timeout_s = start_timeout_s
        self._nursery = nursery
        self._workers: list[_Worker] = []
        self._every: list[_Worker] = []  # the dead too, until reaped
        self._limit = trio.Semaphore(workers * concurrency)
        self._changed = trio.Event()
        self._ids = itertools.count()
        #: Each tool's JSON schema, in the order of the config (as the workers made them).
        self.tools: list[str] = []
        self.restarts = 0
        self.closed = False

    async def call(self, kind: str, args: dict[str, Any], timeout_s: float) -> Outcome:
        """Run one call in a worker (see the module docstring)."""
        if self.closed:
            raise PoolError("the env pool is closed")
        async with self._limit:
            worker = await self._pick()
            call_id, pending = next(self._ids), _Pending()
            worker.pending[call_id] = pending
            try:
                try:
                    await worker.send(frame(Call(call_id, kind, args, timeout_s)))
                except WorkerBroken as broken:
                    self._lose(worker, str(broken))
                with trio.move_on_after(timeout_s + KILL_GRACE_S):
                    await pending.done.wait()
                if pending.outcome is None:
                    message = f"took longer than its timeout of {timeout_s:g} s; its worker was killed"
                    pending.settle(Outcome("timeout", message=message))
                    self._lose(worker, f"a call ran past its timeout of {timeout_s:g} s and the worker was killed")
                assert pending.outcome is not None  # settled: by the worker, its loss, or the timeout above
                return pending.outcome
            finally:
                worker.pending.pop(call_id, None)

    async def _pick(self) -> _Worker:
        """The live worker with the fewest calls in flight (one is free: the semaphore says so)."""
        while True:
            live = [w for w in self._workers if not w.dead and len(w.pending) < self._concurrency]
            if live:
                return min(live, key=lambda w: len(w.pending))
            self._changed = trio.Event()
            await self._changed.wait()  # a replacement starting

    def _lose(self, worker: _Worker, why: str) -> None:
        """A worker died or was killed: its calls crash, a replacement starts."""
        if worker.dead:
            return
        worker.dead = True
        worker.process.kill()
        for pending in list(worker.pending.values()):
            pending.settle(Outcome("crashed", message=why))
        self._workers.remove(worker)
        if not self.closed:
            self._nursery.start_soon(self._replace, worker, why)

    async def _replace(self, worker: _Worker, why: str) -> None:
        started = trio.current_time()
        self.restarts += 1
        await worker.process.reap()
        self._every.remove(worker)
        await self._add()
        log.warning("[env] worker %d ended (%s); a new one was ready in %.2f s", worker.process.process.pid, why,
                    trio.current_time() - started)

    async def _add(self) -> None:
        """Start one worker, wait for it to be ready, and put it to work."""
        process = WorkerProcess(await spawn(_BOOT, self._env), FromWorker)
        worker = _Worker(process)
        self._every.append(worker)
        name = "an env worker"
        try:
            with trio.fail_after(self._start_timeout_s):
                reply = await process.request(self._hello)
        except trio.TooSlowError:
            raise PoolError(f"{name} was not ready within start_timeout_s = {self._start_timeout_s:g} s") from None
        except WorkerBroken as broken:
            raise PoolError(f"{name} did not start: {broken}") from None
        match reply:
            case Ready(tools=tools):
                self.tools = tools
            case Failed(message=message):
                raise PoolError(f"the environment or a tool cannot be loaded: {message}")
            case _:
                raise PoolError(f"{name} answered {type(reply).__name__} to Hello")
        self._workers.append(worker)
        self._nursery.start_soon(self._read, worker)
        self._changed.set()

    async def _read(self, worker: _Worker) -> None:
        """Hand each reply of `worker` to its caller, until the worker ends."""
        while not worker.dead:
            try:
                reply = await worker.process.receive()
            except WorkerBroken as broken:
                self._lose(worker, str(broken))
                return
            if not isinstance(reply, Done):
                self._lose(worker, f"it sent {type(reply).__name__} out of step; it was killed")
                return
            pending = worker.pending.get(reply.id)
            if pending is not None:
                pending.settle(Outcome(reply.status, reply.value, reply.message))

    async def _stop(self) -> None:
        with trio.move_on_after(_REAP_S) as cleanup:
            cleanup.shield = True
            for worker in self._every:
                worker.process.kill()
            for worker in self._every:
                await worker.process.reap()


@asynccontextmanager
async def open_env_pool(
    environment: EnvironmentSpec,
    tools: Sequence[ToolSpec] = (),
    *,
    workers: int = 2,
    concurrency: int = 1,
    start_timeout_s: float = 120.0,
    import_dir: str = "",
) -> AsyncIterator[EnvPool]:
    """Start `workers` env workers and yield the pool once every one is ready;
    kill them all on exit. `import_dir` goes first on their import path.
    Raises `PoolError` when a worker cannot start."""
    check_tools(tools)
    sys_path, env = worker_env(import_dir)
    hello = Hello(environment, list(tools), sys_path, os.getpid())
    pool: EnvPool | None = None
    try:
        async with trio.open_nursery() as nursery:
            pool = EnvPool(hello, env, workers=workers, concurrency=concurrency, start_timeout_s=start_timeout_s,
                           nursery=nursery)
            try:
                async with trio.open_nursery() as starting:
                    for _ in range(workers):
                        starting.start_soon(pool._add)
                yield pool
            finally:
                pool.closed = True
                nursery.cancel_scope.cancel()
    except BaseExceptionGroup as group:
        errors = [error for error in leaves(group) if not isinstance(error, trio.Cancelled)]
        if len(errors) == 1:
            raise errors[0] from None
        raise
    finally:
        if pool is not None:  # every task has ended: every worker any of them started is listed
            await pool._stop()


def plain(value: Any) -> Any:
    """`value` as plain data a worker can be sent (numpy arrays and scalars as lists and numbers)."""
    return msgspec.msgpack.decode(msgspec.msgpack.encode(value, enc_hook=_plain))


def _plain(value: Any) -> Any:
    tolist = getattr(value, "tolist", None)
    if callable(tolist):
        return tolist()
    raise TypeError(f"{type(value).__name__} is not plain data (str, int, float, bool, None, list, dict)")
