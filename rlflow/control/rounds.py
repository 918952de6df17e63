"""Weight rounds: moving each new policy version from the trainer to every
replica that loads weights, one version at a time.

Plain synchronous code, no I/O. A collective transfer needs the sender and
every receiver to take part in the same broadcast, so only one version is
in flight; a version published meanwhile waits, and a newer one replaces it
(replicas skip straight to the newest).
"""

from __future__ import annotations


class WeightRounds:
    """Which version is moving, and who has loaded it."""

    def __init__(self, version: int = 0):
        #: The newest version the trainer has published.
        self.published = version
        #: The version being moved now, if any.
        self.moving: int | None = None
        #: The newest version sent (or held by every receiver from the start).
        self.moved = version
        self._loaded: set[int] = set()

    def publish(self, version: int) -> int | None:
        """The trainer has `version`; the version to start moving now, if none is moving."""
        self.published = max(self.published, version)
        return self._start()

    def loaded(self, rank: int, version: int, receivers: set[int]) -> int | None:
        """Receiver `rank` now holds `version`; `receivers` are the ranks that
        take part. The next version to move, when this round is complete.

        A receiver that holds a newer version than the one moving has done
        its part: a weight server may hand out its newest version, published
        after this round started.
        """
        if self.moving is not None and version >= self.moving:
            self._loaded.add(rank)
        return self._check(receivers)

    def left(self, receivers: set[int]) -> int | None:
        """A receiver is gone: the round may now be complete without it."""
        return self._check(receivers)

    def _check(self, receivers: set[int]) -> int | None:
        if self.moving is not None and receivers <= self._loaded:
            self.moving = None
            return self._start()
        return None

    def _start(self) -> int | None:
        if self.moving is None and self.published > self.moved:
            self.moving, self._loaded = self.published, set()
            self.moved = self.published
            return self.moving
        return None

    @property
    def busy(self) -> bool:
        """Whether a version is moving now."""
        return self.moving is not None

    def abandon(self) -> None:
        """The round moving cannot complete (its broadcast broke): forget it."""
        self.moving, self._loaded = None, set()

    def repeat(self) -> int | None:
        """Move the newest version sent again (e.g. to a replica that joined
        late, through a new collective group); None if a round is moving."""
        if self.moving is not None:
            return None
        self.moving, self._loaded = self.moved, set()
        return self.moving
