"""Reward functions in worker processes that can be killed, called from trio.

`open_pool(specs)` starts `spec.workers` processes per function (see
`worker.py`); each imports its function once and runs its `prepare`. Then
`await pool.score(sample)` scores one sample with every function, each
call in a worker of its own function, and returns one `Scored` per
function, in the order of `specs`. Guarantees:

* Every result says how it ended (`Status`) and which function made it;
  nothing is turned into a value that was not returned.
* A call has `spec.timeout_s`. Past it, the parent SIGKILLs the worker's
  whole process group and marks the call TIMEOUT; a worker that dies during
  a call gives CRASHED. Either way a replacement starts in the background,
  and the pool goes on with the workers it has. Timeouts are the parent's,
  so a function that blocks signals or never returns to Python is stopped
  all the same; and in the worker the function runs on the main thread, so
  its own `signal.alarm` timeouts (math-verify's) work.
* `score` may be called from many tasks at once. Cancelling a caller
  abandons its wait, never a call in flight: that call runs to its end or
  its timeout, so a worker never gets out of step with its pipe.
* A batched function gets the samples that arrive together: once a worker
  is free, every sample already waiting, and those arriving within
  `spec.batch_wait_s`, up to `spec.max_batch`.
* A worker that cannot start (its function does not import, `prepare`
  raises, or it takes longer than `start_timeout_s`), at open or as a
  replacement, is fatal: `open_pool` raises `PoolError`, since that
  function can no longer score anything.
* On exit every worker is killed, with whatever it started.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import msgspec
import trio

from rlflow.errors import leaves
from rlflow.rewards.core import Combined, FunctionSpec, Sample, Scored, Status, check_specs, combine
from rlflow.rewards.worker import Call, Failed, FromWorker, Hello, Ready, Returned
from rlflow.workers import PoolError, WorkerBroken, WorkerProcess, frame, spawn, worker_env

log = logging.getLogger("rlflow.reward")

#: How a worker process starts.
_BOOT = "from rlflow.rewards.worker import main; main()"

#: Seconds to wait for killed workers to be reaped on the way out.
_REAP_S = 5.0


@dataclass(frozen=True)
class FunctionInfo:
    """A function of the pool, as its workers described it at start."""

    spec: FunctionSpec
    batched: bool
    reference_value: float | None
    """What its reference responses must score; None if it has no
    `reference_response` (then a reference is only checked to score)."""


class RewardPool:
    """The running functions of `open_pool`; see the module docstring."""

    def __init__(self, lanes: list[_Lane]):
        self._lanes = lanes
        self._encoder = msgspec.msgpack.Encoder(enc_hook=_plain)
        self.closed = False

    @property
    def specs(self) -> tuple[FunctionSpec, ...]:
        return tuple(lane.spec for lane in self._lanes)

    @property
    def functions(self) -> tuple[FunctionInfo, ...]:
        return tuple(lane.info for lane in self._lanes)

    @property
    def restarts(self) -> dict[str, int]:
        """Workers replaced so far, by function name (after a timeout or a crash)."""
        return {lane.spec.name: lane.restarts for lane in self._lanes}

    async def score(self, sample: Sample, *, as_reference: bool = False) -> list[Scored]:
        """Score `sample` with every function; one result per function, in
        order. `as_reference`: each function scores its own rendering of
        `sample.reference` instead of the response (see `check_references`)."""
        if self.closed:
            raise PoolError("the reward pool is closed")
        try:
            raw = msgspec.Raw(self._encoder.encode(sample))
        except (TypeError, ValueError, OverflowError) as error:
            why = f"the sample cannot be sent to a reward worker: {type(error).__name__}: {error}"
            return [Scored(function=lane.spec.name, status=Status.ERROR, message=why) for lane in self._lanes]
        if len(self._lanes) == 1:
            return [await self._lanes[0].submit(raw, as_reference)]
        results: list[Scored | None] = [None] * len(self._lanes)

        async def one(i: int) -> None:
            results[i] = await self._lanes[i].submit(raw, as_reference)

        async with trio.open_nursery() as nursery:
            for i in range(len(self._lanes)):
                nursery.start_soon(one, i)
        return [result for result in results if result is not None]

    async def score_many(self, samples: Sequence[Sample], *, as_reference: bool = False) -> list[list[Scored]]:
        """`score` of each sample, all at once; results in the order of `samples`."""
        results: list[list[Scored]] = [[] for _ in samples]

        async def one(i: int) -> None:
            results[i] = await self.score(samples[i], as_reference=as_reference)

        async with trio.open_nursery() as nursery:
            for i in range(len(samples)):
                nursery.start_soon(one, i)
        return results

    def combine(self, scored: Sequence[Scored]) -> Combined:
        """`combine` with this pool's specs."""
        return combine(scored, self.specs)

    async def pass_rate(self, samples: Sequence[Sample], pass_reward: float) -> dict[str, float]:
        """Held-out answers under these functions: ``accuracy`` (and ``pass_rate``) the share whose reward
        reaches `pass_reward` (those not scored count as not passed), ``reward_mean`` over those scored."""
        rewards = [self.combine(scored).reward for scored in await self.score_many(samples)]
        scored = [r for r in rewards if r is not None]
        passed = sum(r >= pass_reward for r in scored)
        n = len(samples)
        return {
            "accuracy": passed / n if n else 0.0,
            "pass_rate": passed / n if n else 0.0,
            "reward_mean": float(sum(scored) / len(scored)) if scored else 0.0,
            "problems": float(n),
            "failed": float(n - len(scored)),
        }


@asynccontextmanager
async def open_pool(
    specs: Sequence[FunctionSpec],
    *,
    start_timeout_s: float = 60.0,
    workers: int | None = None,
    import_dir: str = "",
) -> AsyncIterator[RewardPool]:
    """Start workers for `specs` and yield the pool once every worker is
    ready; kill them all on exit. `workers` overrides every spec's count
    (e.g. 1 for a check). `import_dir` goes first on the workers' import
    path (the run's `run.import_dir`, where the user's modules are). Raises
    `ValueError` for specs that cannot run together, `PoolError` when a
    worker cannot start."""
    check_specs(specs)
    if not 0 < start_timeout_s < math.inf:
        raise ValueError(f"start_timeout_s must be positive, got {start_timeout_s}")
    if workers is not None:
        specs = [msgspec.structs.replace(spec, workers=workers) for spec in specs]
    sys_path, env = worker_env(import_dir)
    lanes = [_Lane(spec, sys_path, env, start_timeout_s) for spec in specs]
    try:
        async with trio.open_nursery() as nursery:
            async with trio.open_nursery() as starting:
                for lane in lanes:
                    starting.start_soon(nursery.start, lane.run)
            pool = RewardPool(lanes)
            try:
                yield pool
            finally:
                pool.closed = True
                nursery.cancel_scope.cancel()
    except BaseExceptionGroup as group:
        # One error (a worker that could not start, or the body's own) is
        # raised as itself, not wrapped.
        errors = [error for error in leaves(group) if not isinstance(error, trio.Cancelled)]
        if len(errors) == 1:
            raise errors[0] from None
        raise


async def check_references(pool: RewardPool, samples: Sequence[Sample]) -> list[str]:
    """Score each sample's reference answer with every function of `pool`
    (as the function's `reference_response` renders it) and return the
    problems found, one sentence each: a reference that did not score OK,
    or scored other than the function's `reference_value`. Meant for the
    first rows of a dataset, before any generation starts."""
    problems = []
    results = await pool.score_many(samples, as_reference=True)
    for i, (sample, scored) in enumerate(zip(samples, results, strict=True)):
        for info, result in zip(pool.functions, scored, strict=True):
            reference = sample.reference if len(sample.reference) <= 60 else sample.reference[:57] + "..."
            where = f"reward function {result.function!r}: the reference answer of sample {i} ({reference!r})"
            if result.status is not Status.OK or result.value is None:
                problems.append(f"{where} did not score ({result.status.value}): {result.message}")
            elif info.reference_value is not None and not math.isclose(
                result.value, info.reference_value, rel_tol=1e-6, abs_tol=1e-6
            ):
                problems.append(f"{where} scored {result.value:g}, expected {info.reference_value:g}")
    return problems


class _Job:
    """One sample waiting for one function."""

    __slots__ = ("raw", "as_reference", "done", "result", "abandoned")

    def __init__(self, raw: msgspec.Raw, as_reference: bool):
        self.raw = raw
        self.as_reference = as_reference
        self.done = trio.Event()
        self.result: Scored | None = None
        self.abandoned = False  # its caller stopped waiting before it was sent


class _Lane:
    """One function: its workers, its queue of jobs, and the task that
    hands jobs (batches, if the function is batched) to free workers."""

    def __init__(self, spec: FunctionSpec, sys_path: list[str], env: dict[str, str], start_timeout_s: float):
        self.spec = spec
        self.restarts = 0
        self._hello = frame(Hello(spec.path, dict(spec.kwargs), sys_path, os.getpid()))
        self._env = env
        self._start_timeout_s = start_timeout_s
        self._ready: Ready | None = None
        self._workers: set[WorkerProcess] = set()
        # Jobs rendezvous with the dispatcher; free workers wait in a
        # channel that holds them all.
        self._jobs_in, self._jobs = trio.open_memory_channel[_Job](0)
        self._free_in, self._free = trio.open_memory_channel[WorkerProcess](spec.workers)
        self._nursery: trio.Nursery | None = None

    @property
    def info(self) -> FunctionInfo:
        assert self._ready is not None, "the lane has not started"
        return FunctionInfo(self.spec, self._ready.batched, self._ready.reference_value)

    async def submit(self, raw: msgspec.Raw, as_reference: bool) -> Scored:
        job = _Job(raw, as_reference)
        try:
            await self._jobs_in.send(job)
            await job.done.wait()
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            raise PoolError("the reward pool is closed") from None
        finally:
            job.abandoned = True
        assert job.result is not None
        return job.result

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                async with trio.open_nursery() as starting:
                    for _ in range(self.spec.workers):
                        starting.start_soon(self._add_worker)
                task_status.started()
                await self._dispatch()
        finally:
            with trio.move_on_after(_REAP_S) as cleanup:
                cleanup.shield = True
                for worker in list(self._workers):
                    worker.kill()
                for worker in list(self._workers):
                    await worker.reap()

    async def _dispatch(self) -> None:
        async with self._jobs:
            async for job in self._jobs:
                if job.abandoned:
                    continue
                worker = await self._free.receive()
                batch = [job]
                if self.info.batched:
                    await self._fill(batch)
                batch = [job for job in batch if not job.abandoned]
                if batch:
                    assert self._nursery is not None
                    self._nursery.start_soon(self._call, worker, batch)
                else:
                    self._free_in.send_nowait(worker)

    async def _fill(self, batch: list[_Job]) -> None:
        """Add the jobs waiting now, and those arriving within `batch_wait_s`."""
        deadline = trio.current_time() + self.spec.batch_wait_s
        while len(batch) < self.spec.max_batch:
            job: _Job | None
            try:
                job = self._jobs.receive_nowait()
            except trio.WouldBlock:
                job = None
                with trio.move_on_at(deadline):
                    job = await self._jobs.receive()
                if job is None:
                    return
            if not job.abandoned:
                batch.append(job)

    async def _call(self, worker: WorkerProcess, batch: list[_Job]) -> None:
        name = self.spec.name
        started = trio.current_time()
        call = frame(Call([job.raw for job in batch], [job.as_reference for job in batch]))
        reply: FromWorker | None = None
        failure: Scored | None
        try:
            with trio.move_on_after(self.spec.timeout_s):
                reply = await worker.request(call)
        except WorkerBroken as broken:
            failure = Scored(function=name, status=Status.CRASHED, message=str(broken))
            # The worker is gone or useless: replaced below.
        else:
            if reply is None:
                failure = Scored(
                    function=name,
                    status=Status.TIMEOUT,
                    message=f"took longer than its timeout_s = {self.spec.timeout_s:g} s; its worker was killed",
                )
            elif not isinstance(reply, Returned) or len(reply.outcomes) != len(batch):
                failure = Scored(
                    function=name, status=Status.CRASHED, message="the worker sent a reply out of step; it was killed"
                )
            else:
                failure = None
        seconds = trio.current_time() - started
        if failure is None:
            assert isinstance(reply, Returned)
            self._free_in.send_nowait(worker)
            results = [
                Scored(
                    function=name,
                    status=outcome.status,
                    value=outcome.value,
                    parts=outcome.parts,
                    message=outcome.message,
                    seconds=seconds,
                )
                for outcome in reply.outcomes
            ]
        else:
            worker.kill()
            assert self._nursery is not None
            self._nursery.start_soon(self._replace, worker, failure)
            results = [msgspec.structs.replace(failure, seconds=seconds)] * len(batch)
        for job, result in zip(batch, results, strict=True):
            job.result = result
            job.done.set()

    async def _replace(self, worker: WorkerProcess, why: Scored) -> None:
        started = trio.current_time()
        self.restarts += 1
        await worker.reap()
        self._workers.discard(worker)
        await self._add_worker()
        log.warning(
            "[reward] %s: worker %d %s (%s); a new one was ready in %.2f s",
            self.spec.name,
            worker.process.pid,
            "killed at its timeout" if why.status is Status.TIMEOUT else "crashed",
            why.message,
            trio.current_time() - started,
        )

    async def _add_worker(self) -> None:
        worker = await self._start_worker()
        self._free_in.send_nowait(worker)

    async def _start_worker(self) -> WorkerProcess:
        spec = self.spec
        process = await spawn(_BOOT, self._env)
        worker = WorkerProcess(process, FromWorker)
        self._workers.add(worker)
        try:
            with trio.fail_after(self._start_timeout_s):
                reply = await worker.request(self._hello)
        except trio.TooSlowError:
            raise PoolError(
                f"a worker of reward function {spec.name!r} ({spec.path}) was not ready within "
                f"start_timeout_s = {self._start_timeout_s:g} s"
            ) from None
        except WorkerBroken as broken:
            raise PoolError(
                f"a worker of reward function {spec.name!r} ({spec.path}) did not start: {broken}"
            ) from None
        match reply:
            case Ready():
                self._ready = reply
                return worker
            case Failed(message=message):
                raise PoolError(f"reward function {spec.name!r} cannot start: {message}")
            case _:
                raise PoolError(f"a worker of reward function {spec.name!r} answered {type(reply).__name__} to Hello")


def _plain(value: Any) -> Any:
    """Encode numpy arrays and scalars in a dataset row as plain data."""
    tolist = getattr(value, "tolist", None)
    if callable(tolist):
        return tolist()
    raise TypeError(f"{type(value).__name__} is not plain data (str, int, float, bool, None, list, dict)")
