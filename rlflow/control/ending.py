"""How a run ended, from the exception that ended it: its phase, the error its
status and summary say, and the exception to raise to the caller. Pure
classification (no I/O), apart from logging an unexpected failure once.

trio's cancellation alone is an interruption from outside; otherwise an
interrupt comes first, a `RunFailed` (a failure the controller found and
named) next, and anything else becomes a `RunFailed` that names it.
"""

from __future__ import annotations

import logging

import trio

from rlflow.errors import RunFailed, leaves
from rlflow.rundir import Phase

log = logging.getLogger("rlflow.controller")


def why_it_ended(exc: BaseException) -> tuple[Phase, str, BaseException]:
    """(the run's phase, its error, the exception to raise) for whatever ended a run."""
    if only_cancelled(exc):
        return Phase.INTERRUPTED, "cancelled", exc
    cause = unwrap(exc)
    phase = Phase.INTERRUPTED if isinstance(cause, KeyboardInterrupt) else Phase.FAILED
    if isinstance(cause, (KeyboardInterrupt, RunFailed)):
        cause.__suppress_context__ = True  # it says why on its own
        return phase, describe(cause), cause
    log.error("[controller] failed", exc_info=cause)
    failed = RunFailed(describe(cause))
    failed.__cause__ = cause
    return phase, describe(cause), failed


def only_cancelled(exc: BaseException) -> bool:
    """Whether `exc` is trio's cancellation and nothing else."""
    if isinstance(exc, BaseExceptionGroup):
        return exc.split(trio.Cancelled)[1] is None
    return isinstance(exc, trio.Cancelled)


def unwrap(exc: BaseException) -> BaseException:
    """The one exception that says why the run ended, out of trio's groups:
    an interrupt first, then a `RunFailed`; anything else as it came."""
    if not isinstance(exc, BaseExceptionGroup):
        return exc
    for kind in (KeyboardInterrupt, RunFailed):
        match, _ = exc.split(kind)
        if match is not None:
            return next(leaves(match))
    return exc


def describe(exc: BaseException) -> str:
    """One line for the status: a `RunFailed`'s own text, else the exception's type and text."""
    if isinstance(exc, BaseExceptionGroup):
        return "; ".join(describe(e) for e in exc.exceptions)
    if isinstance(exc, KeyboardInterrupt):
        return "interrupted"
    return f"{type(exc).__name__}: {exc}" if not isinstance(exc, RunFailed) else str(exc)
