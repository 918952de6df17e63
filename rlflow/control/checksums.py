"""Proof that the weights arrived: the trainer's checksum of each version it
published against the checksum each replica reports of what it now serves.

Plain synchronous code, no I/O. A replica may report a version before the
controller has the trainer's checksum of it (a weight server hands out its
newest version, which may be published a moment before its `WeightsReady`
is read): such a report waits for it. A mismatch is a `RunFailed` that
names the replica, the version and both checksums: an adapter that never
reached the rollout otherwise looks like nothing worse than staleness.
"""

from __future__ import annotations

from rlflow.errors import RunFailed

#: Versions whose checksums are remembered (reports of older ones are not checked).
KEPT = 16


class Checksums:
    """The trainer's checksum per version, and replicas' reports waiting for one."""

    def __init__(self, start: int = 0) -> None:
        #: The version the run starts from: replicas load it from disk, not from the trainer (not checked).
        self.start = start
        self.published: dict[int, str] = {}
        #: (replica, version, checksum) reports of versions the trainer has not published yet.
        self.waiting: list[tuple[str, int, str]] = []
        #: Reports checked and found right.
        self.matched = 0

    def publish(self, version: int, checksum: str) -> None:
        """The trainer published `version` with `checksum` (empty: not checked);
        the reports that waited for it are checked now."""
        self.published[version] = checksum
        for old in sorted(self.published)[:-KEPT]:
            del self.published[old]
        ready = [w for w in self.waiting if w[1] <= version]
        self.waiting = [w for w in self.waiting if w[1] > version]
        for name, v, got in ready:
            if v in self.published:
                self._check(name, v, got)

    def served(self, name: str, version: int, checksum: str) -> None:
        """Replica `name` serves `version`, received with `checksum` (empty: none)."""
        if version <= self.start:
            return
        if version in self.published:
            self._check(name, version, checksum)
        elif version > max(self.published, default=self.start):
            # One report waits per replica: a newer one replaces it.
            self.waiting = [w for w in self.waiting if w[0] != name] + [(name, version, checksum)]

    def _check(self, name: str, version: int, got: str) -> None:
        want = self.published[version]
        if not want:
            return
        if got != want:
            raise RunFailed(f"{name} serves weights v{version} with checksum {got or '(none reported)'}, but the "
                            f"trainer sent checksum {want}: the weights it serves are not the ones sent")
        self.matched += 1
