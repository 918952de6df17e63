"""The controller's ledger of prompt groups: plain synchronous code, no I/O.

Every group the run will train on passes through it:

    QUEUED --grant--> GENERATING --generated--> DOWNSTREAM --trained--> (gone)
       ^                  |                          |
       +-- expired / its replica lost ---------------+

* `grant` creates the groups the staleness bound allows and hands queued
  ones to the rollout replicas with room, least loaded first. Group ``g``
  belongs to step ``g // batch_size``: it may not start on weights older than
  ``step - max_staleness`` (its `min_version`), and at most
  ``batch_size * (steps_done + max_staleness + 1)`` groups exist in all. A
  group granted again may not start on weights older than the bound allows
  at its new start either.
* `generated`: the replica finished it and sent it on (it is being scored,
  or waits at the trainer).
* `trained`: an optimizer step used it; it is never granted again.
* `expired` (a role dropped it unused) and `lost` (the replica holding it
  went away) queue it again, in front of new groups.

`snapshot` / `restore` save and reload it with a checkpoint: the groups
granted but not trained on are queued again on resume, so none is skipped.
"""

from __future__ import annotations

import collections
import enum
from dataclasses import dataclass

import msgspec


class GroupState(enum.Enum):
    QUEUED = "queued"
    """Waiting for a credit (new, expired, or its replica was lost)."""
    GENERATING = "generating"
    """Granted to a rollout replica that has not finished it."""
    DOWNSTREAM = "downstream"
    """Generated; being scored, or waiting at the trainer."""


@dataclass
class Group:
    group_id: int
    min_version: int
    state: GroupState = GroupState.QUEUED
    owner: int | None = None
    """The rollout replica generating it."""
    grants: int = 0
    """Times it has been granted."""


class LedgerState(msgspec.Struct, frozen=True, kw_only=True):
    """What a checkpoint keeps of the ledger."""

    steps_done: int
    """Optimizer steps trained."""
    next_group: int
    """The first group id never created."""
    untrained: list[int]
    """Groups created but not trained on: queued again on resume."""
    reissued: int = 0
    """Groups granted more than once so far."""


def min_version(group_id: int, batch_size: int, max_staleness: int) -> int:
    """The oldest policy version group `group_id` may start on."""
    return max(0, group_id // batch_size - max_staleness)


class GroupLedger:
    """Which groups exist, where each is, and which may start (see the module)."""

    def __init__(self, batch_size: int, max_staleness: int, steps: int):
        self.batch_size = batch_size
        self.max_staleness = max_staleness
        self.steps = steps
        self.steps_done = 0
        self.next_group = 0
        self.groups: dict[int, Group] = {}
        self._queue: collections.deque[int] = collections.deque()
        self.granted = 0
        self.reissued = 0
        self.trained_count = 0

    # -- queries ------------------------------------------------------------

    @property
    def limit(self) -> int:
        """Groups that may exist now: the staleness bound, and no more than the run needs."""
        return min(self.batch_size * (self.steps_done + self.max_staleness + 1), self.batch_size * self.steps)

    def held_by(self, owner: int) -> int:
        """Groups rollout replica `owner` is generating."""
        return sum(1 for g in self.groups.values() if g.owner == owner)

    def counts(self) -> dict[str, int]:
        """Groups in each state now."""
        out = dict.fromkeys((s.value for s in GroupState), 0)
        for group in self.groups.values():
            out[group.state.value] += 1
        return out

    # -- changes ------------------------------------------------------------

    def grant(self, room: dict[int, int], version: int) -> dict[int, list[Group]]:
        """Hand queued groups to rollout replicas: `room` maps each replica to
        the most groups it may hold; `version` is the newest policy version.

        Each group goes to the replica with the lowest share of its room in
        use. Returns the groups granted to each replica, in order.
        """
        while self.next_group < self.limit:
            self._add(self.next_group)
            self.next_group += 1
        if not self._queue:  # the common case (every rollout ack asks): nothing to count
            return {}
        held = collections.Counter(g.owner for g in self.groups.values() if g.owner is not None)
        out: dict[int, list[Group]] = collections.defaultdict(list)
        candidates = [rank for rank, capacity in room.items() if capacity > 0]
        while self._queue and candidates:
            rank = min(candidates, key=lambda r: (held[r] / room[r], r))
            if held[rank] >= room[rank]:
                break
            group = self.groups[self._queue.popleft()]
            group.min_version = max(group.min_version, version - self.max_staleness)
            group.state, group.owner = GroupState.GENERATING, rank
            group.grants += 1
            if group.grants > 1:
                self.reissued += 1
            held[rank] += 1
            out[rank].append(group)
        self.granted += sum(len(groups) for groups in out.values())
        return dict(out)

    def generated(self, owner: int, group_ids: list[int]) -> None:
        """Replica `owner` finished these groups and sent them on."""
        for group_id in group_ids:
            group = self.groups.get(group_id)
            if group is not None and group.state is GroupState.GENERATING and group.owner == owner:
                group.state, group.owner = GroupState.DOWNSTREAM, None

    def trained(self, step: int, group_ids: list[int]) -> None:
        """Optimizer step `step` used these groups: they are done for good."""
        self.steps_done = max(self.steps_done, step + 1)
        for group_id in group_ids:
            if self.groups.pop(group_id, None) is not None:
                self.trained_count += 1

    def expired(self, group_ids: list[int]) -> list[int]:
        """A role dropped these groups unused: queue them again, first in
        line. Returns those that were queued (not the ones already trained
        on or already queued)."""
        return self._requeue(g for g in group_ids if g in self.groups)

    def lost(self, owner: int) -> list[int]:
        """Replica `owner` went away: queue again every group it was generating."""
        return self._requeue(g.group_id for g in self.groups.values() if g.owner == owner)

    def _requeue(self, group_ids) -> list[int]:
        again = [g for g in dict.fromkeys(group_ids) if self.groups[g].state is not GroupState.QUEUED]
        for group_id in reversed(again):
            group = self.groups[group_id]
            group.state, group.owner = GroupState.QUEUED, None
            self._queue.appendleft(group_id)
        return again

    def _add(self, group_id: int) -> None:
        self.groups[group_id] = Group(group_id, min_version(group_id, self.batch_size, self.max_staleness))
        self._queue.append(group_id)

    # -- checkpoints --------------------------------------------------------

    def snapshot(self) -> LedgerState:
        return LedgerState(
            steps_done=self.steps_done, next_group=self.next_group, untrained=sorted(self.groups), reissued=self.reissued
        )

    @classmethod
    def restore(cls, state: LedgerState, batch_size: int, max_staleness: int, steps: int) -> GroupLedger:
        """The ledger as saved, with every untrained group queued again (in id order)."""
        ledger = cls(batch_size, max_staleness, steps)
        ledger.steps_done, ledger.next_group, ledger.reissued = state.steps_done, state.next_group, state.reissued
        for group_id in state.untrained:
            ledger._add(group_id)
        return ledger
