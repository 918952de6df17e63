"""Errors shared by the control plane and the services."""

from __future__ import annotations

from collections.abc import Iterator


class RunFailed(Exception):
    """The run cannot go on; the message says which service and why."""


class WeightGroupBroken(Exception):
    """A weight broadcast failed (a member of the collective group died
    mid-way); nothing was loaded, and the next generation of the group will
    bring the weights."""


def leaves(exc: BaseException) -> Iterator[BaseException]:
    """The errors inside (nested) exception groups, in order; `exc` itself if
    it is not a group."""
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            yield from leaves(inner)
    else:
        yield exc
