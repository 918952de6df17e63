"""A reward worker: a process that imports one reward function and runs
calls to it, one at a time, for the pool in its parent (`pool.py`).

The two sides talk over the worker's stdin and stdout, moved at start to
private descriptors (the function's own prints go to stderr, and its
children inherit neither). Each message is a 4-byte big-endian length and a
msgpack-encoded `ToWorker` or `FromWorker`; what crosses is plain data,
never pickle. The parent sends `Hello`; the worker imports the function,
runs its `prepare`, and answers `Ready` (or `Failed` and exits). Then each
`Call` gets one `Returned`, with an `Outcome` per sample. The worker only
ever reports OK, ERROR or TIMEOUT (the function raised `TimeoutError`); the
parent decides TIMEOUT when a call overruns and CRASHED when the worker
dies. The worker exits when its stdin ends and dies with its parent.

Kept light: the standard library and msgspec, until `Hello` names what to import.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any, TypeVar

import msgspec

from rlflow.rewards.core import BadReturn, Sample, Status, check_result, load_function, show_value
from rlflow.workers import describe, die_with_parent, frame, read_message, take_pipes, write_message

T = TypeVar("T")

#: Bytes of a message's length prefix.


class Hello(msgspec.Struct, tag="hello", array_like=True, frozen=True):
    """Parent -> worker, first: which function, and where to import from."""

    path: str
    kwargs: dict[str, Any]
    sys_path: list[str]
    parent_pid: int


class Call(msgspec.Struct, tag="call", array_like=True, frozen=True):
    """Parent -> worker: score these samples (one, unless batched)."""

    samples: list[msgspec.Raw]
    """Each an encoded `Sample` (encoded once by the parent, for every function)."""
    as_reference: list[bool]
    """Per sample: replace its response with the function's
    `reference_response` of its reference (see `check_references`)."""


class Ready(msgspec.Struct, tag="ready", array_like=True, frozen=True):
    """Worker -> parent: imported and prepared."""

    batched: bool
    reference_value: float | None
    """What a reference response must score; None without `reference_response`."""


class Failed(msgspec.Struct, tag="failed", array_like=True, frozen=True):
    """Worker -> parent: could not import or prepare the function; it exits."""

    message: str


class Outcome(msgspec.Struct, array_like=True, frozen=True):
    """One sample's result, as the worker saw it."""

    status: Status
    value: float | None = None
    parts: dict[str, float] = {}
    message: str = ""


class Returned(msgspec.Struct, tag="returned", array_like=True, frozen=True):
    """Worker -> parent: the outcomes of a `Call`, one per sample, in order."""

    outcomes: list[Outcome]


ToWorker = Hello | Call
FromWorker = Ready | Failed | Returned

#: A place held in a call's outcomes until its sample is scored.
_PENDING = Outcome(Status.ERROR, message="not scored")



def main() -> None:
    """The worker's whole life (run as `python -c`, by `pool.py`)."""
    # A segfault in the function leaves its Python stack on stderr, then
    # kills the worker as before (the parent reports CRASHED).
    incoming, outgoing = take_pipes()
    decoder = msgspec.msgpack.Decoder(ToWorker)
    hello = decoder.decode(read_message(incoming) or b"")
    assert isinstance(hello, Hello)
    die_with_parent(hello.parent_pid)
    sys.path[:] = hello.sys_path
    function = _Function(hello)
    try:
        ready = function.start()
    except (Exception, SystemExit) as error:
        write_message(outgoing, frame(Failed(describe(error))))
        os._exit(1)
    write_message(outgoing, frame(ready))
    while (data := read_message(incoming)) is not None:
        call = decoder.decode(data)
        assert isinstance(call, Call)
        write_message(outgoing, frame(Returned(function.call(call))))
    os._exit(0)


class _Function:
    """The loaded function and how to call it."""

    def __init__(self, hello: Hello):
        self.path = hello.path
        self.kwargs = hello.kwargs
        self.sample_decoder = msgspec.msgpack.Decoder(Sample)
        self.runner: Any = None  # asyncio.Runner, made on the first coroutine

    def start(self) -> Ready:
        self.fn = load_function(self.path, self.kwargs)
        self.batched = bool(getattr(self.fn, "batched", False))
        self.render = getattr(self.fn, "reference_response", None)
        prepare = getattr(self.fn, "prepare", None)
        if prepare is not None:
            self._await(prepare(**self.kwargs))
        reference_value = float(getattr(self.fn, "reference_value", 1.0)) if self.render is not None else None
        return Ready(self.batched, reference_value)

    def call(self, call: Call) -> list[Outcome]:
        """One outcome per sample of `call`, in order."""
        outcomes: list[Outcome] = []
        todo: list[tuple[int, Sample]] = []  # decoded, by position
        for raw, as_reference in zip(call.samples, call.as_reference, strict=True):
            match self._catch(self._sample, raw, as_reference):
                case (sample, None):
                    todo.append((len(outcomes), sample))
                    outcomes.append(_PENDING)
                case (_, failure):
                    outcomes.append(failure)
        if self.batched and todo:
            match self._catch(self._batch, [sample for _, sample in todo]):
                case (results, None):
                    for k, (i, _) in enumerate(todo):
                        outcomes[i] = self._outcome(check_result, results[k])
                case (_, failure):
                    for i, _ in todo:
                        outcomes[i] = failure
        else:
            for i, sample in todo:
                outcomes[i] = self._outcome(self._one, sample)
        return outcomes

    def _sample(self, raw: msgspec.Raw, as_reference: bool) -> Sample:
        sample = self.sample_decoder.decode(raw)
        if as_reference and self.render is not None:
            sample = msgspec.structs.replace(sample, response=self.render(sample.reference, **self.kwargs))
        return sample

    def _one(self, sample: Sample) -> tuple[float, dict[str, float]]:
        return check_result(self._await(self.fn(sample, **self.kwargs)))

    def _batch(self, samples: list[Sample]) -> list[Any]:
        results = self._await(self.fn(samples, **self.kwargs))
        if not isinstance(results, (list, tuple)) or len(results) != len(samples):
            got = f"{len(results)} results" if isinstance(results, (list, tuple)) else show_value(results)
            raise BadReturn(
                f"returned {got} for a batch of {len(samples)}: "
                "a batched function returns a list, one result per sample"
            )
        return list(results)

    def _outcome(self, work: Callable[..., tuple[float, dict[str, float]]], *args: Any) -> Outcome:
        match self._catch(work, *args):
            case (scored, None):
                return Outcome(Status.OK, *scored)
            case (_, failure):
                return failure

    def _catch(self, work: Callable[..., T], *args: Any) -> tuple[T, None] | tuple[None, Outcome]:
        """What `work(*args)` returns, or the outcome that its exception makes."""
        try:
            return work(*args), None
        except BadReturn as error:
            return None, Outcome(Status.ERROR, message=str(error))
        except TimeoutError as error:
            return None, Outcome(Status.TIMEOUT, message=describe(error))
        except (Exception, SystemExit) as error:
            return None, Outcome(Status.ERROR, message=describe(error))

    def _await(self, result: Any) -> Any:
        """`result`, or what it resolves to if it is awaitable: run on one
        event loop kept for the worker's life, so that clients a function
        caches stay usable."""
        import inspect

        if not inspect.isawaitable(result):
            return result
        import asyncio

        async def wait() -> Any:
            return await result

        if self.runner is None:
            self.runner = asyncio.Runner()
        return self.runner.run(wait())
