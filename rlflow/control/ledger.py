"""The controller's ledger of prompt groups: plain synchronous code, no I/O.

Every group the run will train on passes through it:

    QUEUED --grant--> GENERATING --generated--> DOWNSTREAM --received--> RECEIVED --trained--> (gone)
       ^                  |                          |                       |
       +-- expired, or the replica holding it lost --+-----------------------+  (drop: gone for good)

* `grant` creates the groups the staleness bound allows and hands queued
  ones to the rollout replicas with room, least loaded first. Group ``g``
  belongs to step ``g // batch_size``: it may not start on weights older than
  ``step - max_staleness`` (its `min_version`), and at most
  ``batch_size * (steps_done + max_staleness + 1)`` groups exist in all (a
  dropped group makes room for one more). A group granted again may not
  start on weights older than the bound allows at its new start either.
* `generated`: its rollout replica finished it and sent it on (it is being
  scored, or on its way); `received`: the trainer holds it.
* `trained`: an optimizer step used it; it is never granted again.
* `expired` (a role dropped it unused), `lost` (its rollout replica went
  away: the groups it was generating, and those it sent that the trainer
  has not received) and `lost_downstream` (a replica between the rollout and
  the trainer went away, holding who knows which of the groups on their way) queue groups
  again, in front of new ones. A group that arrives twice is dropped by the
  trainer: nothing is lost, nothing is trained twice.
* `drop`: a role gave up on a group (e.g. its reward could not be computed);
  it is counted with the reason and never granted again. If another copy of
  it (granted again after a loss) still reaches the trainer, it counts as
  received after all, and no longer as dropped.
* Dynamic sampling (`run.filter = "signal"`): the trainer drops a group
  whose rewards are all equal with reason `no_signal`, which makes room
  for one more like any drop; and so that a step need not wait for those
  replacements to be generated, the groups still missing for the open steps
  are over-granted by the share of recent groups that had no signal,
  `D * s / (1 - s)` more groups for `D` missing (`s` over the last
  `4 * batch_size` groups decided, at most `MAX_NO_SIGNAL_SHARE`). Those
  extra groups start within the bound of the newest open step.
* Paced credits (`run.credits = "paced"`): groups are made for `lead`
  steps ahead of the trainer instead of `max_staleness`. The lead starts at
  the bound, comes down one step after `PACE_PATIENCE` steps in a row in
  which the trainer did not wait for groups (more than `PACE_STARVED` of
  the step), and goes back up one after a step in which it did, between 1
  and the bound: the rollout runs only as far ahead as keeps the trainer
  fed, and the samples are fresher for it. The bound on each group's start
  (`min_version`) stays `max_staleness`.
* Failures are bounded: a group whose grant ends in a failure of its own
  `max_grants` times (every sample failed, or the rollout replica
  generating it died) is dropped with reason `poison`, with what last went
  wrong with it, and the run goes on. Its last try is *alone*: granted to
  a replica that holds no other group, and that takes no other while it
  holds it (the replica that holds the fewest takes no more until it has
  none). A group lost twice beside hundreds of others on replicas that
  died for reasons of their own is trained then; one that fails alone is
  the common factor. A group queued again because a replica died after it
  was generated (a replica downstream of the rollout, or its rollout
  replica once it had sent it) has not failed.

Every change is also written to `journal`, the events the controller appends
to the run's ledger file and `rlflow audit` replays. `snapshot` / `restore`
save and reload the ledger with a checkpoint: the groups granted but not
trained on are queued again on resume, so none is skipped.
"""

from __future__ import annotations

import collections
import enum
import math
from collections.abc import Sequence, Set
from dataclasses import dataclass

import msgspec

# `Event.reason` of a group the trainer dropped for having no signal (`run.filter`) is the wire's reason.
from rlflow.errors import RunFailed
from rlflow.protocol import NO_SIGNAL


class GroupState(enum.Enum):
    QUEUED = "queued"
    """Waiting for a credit (new, expired, or its replica was lost)."""
    GENERATING = "generating"
    """Granted to a rollout replica that has not finished it."""
    DOWNSTREAM = "downstream"
    """Generated, on its way: being scored, or in a socket."""
    RECEIVED = "received"
    """At the trainer, waiting for its step."""


@dataclass
class Group:
    group_id: int
    min_version: int
    state: GroupState = GroupState.QUEUED
    owner: int | None = None
    """The rollout replica generating it, or (downstream) that generated it."""
    grants: int = 0
    """Times it has been granted."""
    strikes: int = 0
    """Grants that ended in a failure of its own: every sample failed, or the rollout replica generating
    it died."""
    alone: bool = False
    """Its latest grant was its last try, to a replica holding no other group (see the module)."""
    error: str = ""
    """What last went wrong with it (as an expiry said)."""


class Event(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """One change of the ledger (a line of the run's ledger file)."""

    event: str
    """issued, generated, received, trained, requeued, dropped, resumed, ended."""
    groups: list[int] = []
    replica: str = ""
    """Who: the rollout replica a group was issued to or generated by."""
    step: int = -1
    """trained: the optimizer step; resumed: the step resumed from."""
    reason: str = ""
    """requeued / dropped: why."""
    min_versions: list[int] = []
    """issued: the oldest version each group may start on."""
    details: list[str] = []
    """dropped: what went wrong with each group, where known (a poison group: its grants and last error)."""
    next_group: int = -1
    """resumed: the first group id the checkpoint had not created (those from there on are made anew)."""
    t: float = 0.0
    """Seconds since the Unix epoch (set by the controller when it writes the event)."""


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
    dropped: dict[str, int] = {}
    """Groups dropped for good, by reason."""
    trained: int | None = None
    """Groups trained on so far (None, in a checkpoint that did not say: a batch per step)."""
    granted: int | None = None
    """Grants so far (None, in a checkpoint that did not say: one per group trained)."""


#: `Event.reason` of a group dropped for having failed `max_grants` times.
POISON = "poison"
#: Over-granting for groups without signal assumes at most this share of them (a factor of 5 at most).
MAX_NO_SIGNAL_SHARE = 0.8
#: A run is told once when at least this share of its latest groups had no signal.
NO_SIGNAL_WARNING = 0.9
#: Paced credits: a step in which the trainer waited more than this share of its time for groups
#: raises the lead; `PACE_PATIENCE` steps in a row in which it did not lower it.
PACE_STARVED = 0.05
PACE_PATIENCE = 3
#: Steps' worth of dropped groups whose reason the ledger remembers (see `GroupLedger._drop_reasons`).
DROPS_KEPT = 64
#: Batches' worth of groups dropped for good (for want of signal aside) with no step trained in
#: between, after which the run fails: a rollout whose engine serves nothing, or a reward that fails
#: on everything, would otherwise drop group after group and never train, nor end.
STUCK_BATCHES = 4


def min_version(group_id: int, batch_size: int, max_staleness: int) -> int:
    """The oldest policy version group `group_id` may start on."""
    return max(0, group_id // batch_size - max_staleness)


class GroupLedger:
    """Which groups exist, where each is, and which may start (see the module)."""

    def __init__(self, batch_size: int, max_staleness: int, steps: int, *, max_grants: int = 3):
        self.batch_size = batch_size
        self.max_staleness = max_staleness
        self.steps = steps
        self.max_grants = max_grants
        self.steps_done = 0
        self.next_group = 0
        self.groups: dict[int, Group] = {}
        self._queue: collections.deque[int] = collections.deque()
        self.granted = 0
        self.reissued = 0
        self.trained_count = 0
        #: Groups dropped for good, by reason.
        self.dropped: collections.Counter[str] = collections.Counter()
        #: The reason each of the latest dropped groups was dropped for (a copy that still arrives, granted
        #: again after a loss, undoes it): the latest `DROPS_KEPT` steps' worth, so that a long run's
        #: drops do not pile up (a copy older than that is far past any staleness bound).
        self._drop_reasons: collections.OrderedDict[int, str] = collections.OrderedDict()
        #: Changes not yet written out (the controller drains it).
        self.journal: list[Event] = []
        #: What a person should hear of since the controller last asked (groups dropped as poison;
        #: a run where most groups have no signal).
        self.notices: list[str] = []
        #: Of the latest groups the trainer received or dropped for want of signal: 1 for each dropped.
        self._no_signal: collections.deque[int] = collections.deque(maxlen=4 * batch_size)
        self._said_no_signal = False
        #: Groups dropped (for want of signal aside) since the last step trained, by reason, and the
        #: last one's detail.
        self._dropped_since_step: collections.Counter[str] = collections.Counter()
        self._last_drop = ""
        #: Steps ahead of the trainer that groups are made for (`pace`; the bound unless paced).
        self.lead = max_staleness
        self._fed = 0

    # -- queries ------------------------------------------------------------

    @property
    def limit(self) -> int:
        """Groups that may exist now: the staleness bound, and no more than the
        run needs; a dropped group makes room for one more; and the groups
        still missing are over-granted by the share that has had no signal."""
        needed = min(self.batch_size * (self.steps_done + self.lead + 1), self.batch_size * self.steps)
        share = self.no_signal_share
        extra = 0
        if share > 0:
            received = sum(1 for g in self.groups.values() if g.state is GroupState.RECEIVED)
            missing = max(0, needed - self.trained_count - received)
            extra = math.ceil(missing * share / (1 - share) - 1e-9)  # not one more for a rounding error
        return needed + sum(self.dropped.values()) + extra

    @property
    def no_signal_share(self) -> float:
        """The share of the latest groups decided that the trainer dropped for want of
        signal (at most `MAX_NO_SIGNAL_SHARE`; 0 before any, or without the filter)."""
        if not self._no_signal:
            return 0.0
        return min(MAX_NO_SIGNAL_SHARE, sum(self._no_signal) / len(self._no_signal))

    def holders(self) -> collections.Counter[int]:
        """Rollout replica -> the groups it is generating (one pass over the groups, for every replica:
        at 16,384 slots a pass per replica, every half second, was most of the controller's work)."""
        return collections.Counter(g.owner for g in self.groups.values()
                                   if g.owner is not None and g.state is GroupState.GENERATING)

    def counts(self) -> dict[str, int]:
        """Groups in each state now."""
        out = dict.fromkeys((s.value for s in GroupState), 0)
        for group in self.groups.values():
            out[group.state.value] += 1
        return out

    def drain(self) -> list[Event]:
        """The changes since the last drain."""
        events, self.journal = self.journal, []
        return events

    # -- changes ------------------------------------------------------------

    def grant(self, room: dict[int, int], version: int) -> dict[int, list[Group]]:
        """Hand queued groups to rollout replicas: `room` maps each replica to
        the most groups it may hold; `version` is the newest policy version.

        Each group goes to the replica with the lowest share of its room in
        use. Returns the groups granted to each replica, in order.
        """
        limit = self.limit  # making queued groups does not move it
        while self.next_group < limit:
            self._add(self.next_group)
            self.next_group += 1
        if not self._queue:  # the common case (every rollout ack asks): nothing to count
            return {}
        generating = [g for g in self.groups.values() if g.owner is not None and g.state is GroupState.GENERATING]
        held = collections.Counter(g.owner for g in generating)
        out: dict[int, list[Group]] = collections.defaultdict(list)
        # A replica holding a group's last grant takes no other.
        taken = {g.owner for g in generating if g.alone}
        candidates = [rank for rank, capacity in room.items() if capacity > 0 and rank not in taken]
        # Each group queued for its last grant: the replica that holds the fewest is kept for it (it takes
        # the group once it holds none, and nothing else meanwhile).
        for group_id in [g for g in self._queue if self._last_grant(self.groups[g])]:
            if not candidates:
                break
            rank = min(candidates, key=lambda r: (held[r], r))
            candidates.remove(rank)
            if held[rank] == 0:
                self._queue.remove(group_id)
                self._give(self.groups[group_id], rank, version, held, out, alone=True)
        while self._queue and candidates:
            rank = min(candidates, key=lambda r: (held[r] / room[r], r))
            if held[rank] >= room[rank]:
                break
            chosen = next((g for g in self._queue if not self._last_grant(self.groups[g])), None)
            if chosen is None:
                break
            self._queue.remove(chosen)
            self._give(self.groups[chosen], rank, version, held, out)
        self.granted += sum(len(groups) for groups in out.values())
        for rank, groups in out.items():
            self.journal.append(Event(event="issued", groups=[g.group_id for g in groups], replica=f"rollout-{rank}",
                                      min_versions=[g.min_version for g in groups]))
        return dict(out)

    def generated(self, owner: int, group_ids: list[int]) -> None:
        """Replica `owner` finished these groups and sent them on."""
        moved = []
        for group_id in group_ids:
            group = self.groups.get(group_id)
            if group is not None and group.state is GroupState.GENERATING and group.owner == owner:
                group.state = GroupState.DOWNSTREAM
                moved.append(group_id)
        if moved:
            self.journal.append(Event(event="generated", groups=moved, replica=f"rollout-{owner}"))

    def received(self, group_ids: list[int]) -> None:
        """The trainer holds these groups now."""
        moved = []
        for group_id in group_ids:
            group = self.groups.get(group_id)
            if group is None and group_id in self._drop_reasons:
                # A copy outlived the one dropped (granted again after a loss): not dropped after all.
                reason = self._drop_reasons.pop(group_id)
                self.dropped[reason] -= 1
                if not self.dropped[reason]:
                    del self.dropped[reason]
                group = self.groups[group_id] = Group(group_id, min_version(group_id, self.batch_size,
                                                                            self.max_staleness))
            if group is not None and group.state is not GroupState.RECEIVED:
                group.state, group.owner = GroupState.RECEIVED, None
                moved.append(group_id)
        if moved:
            self._no_signal.extend([0] * len(moved))
            # A copy may arrive after its group was queued again: it is not granted twice.
            self._unqueue(moved)
            self.journal.append(Event(event="received", groups=moved))

    def trained(self, step: int, group_ids: list[int]) -> None:
        """Optimizer step `step` used these groups: they are done for good."""
        self.steps_done = max(self.steps_done, step + 1)
        done = [g for g in group_ids if self.groups.pop(g, None) is not None]
        self._unqueue(done)
        self.trained_count += len(done)
        self._dropped_since_step.clear()
        self.journal.append(Event(event="trained", groups=list(group_ids), step=step))

    def drop(self, group_ids: list[int], reason: str, details: Sequence[str] = ()) -> list[int]:
        """A role dropped these groups for good: they are not trained on, nor
        granted again (`details`: what went wrong with each, for the ledger
        file and the audit). Returns those that were in the ledger."""
        said = dict(zip(group_ids, details))
        gone = [g for g in dict.fromkeys(group_ids) if self.groups.pop(g, None) is not None]
        if gone:
            self._unqueue(gone)
            self.dropped[reason or "dropped"] += len(gone)
            self._drop_reasons.update(dict.fromkeys(gone, reason or "dropped"))
            while len(self._drop_reasons) > DROPS_KEPT * self.batch_size:
                self._drop_reasons.popitem(last=False)
            if reason == NO_SIGNAL:
                self._no_signal.extend([1] * len(gone))
                self._tell_no_signal()
            self.journal.append(Event(event="dropped", groups=gone, reason=reason or "dropped",
                                      details=[said.get(g, "") for g in gone] if said else []))
            if reason != NO_SIGNAL:
                self._stuck(gone, reason or "dropped", said)
        return gone

    def _stuck(self, gone: list[int], reason: str, said: dict[int, str]) -> None:
        """Fail the run once `STUCK_BATCHES` batches' worth of groups were dropped with no step trained."""
        self._dropped_since_step[reason] += len(gone)
        self._last_drop = said.get(gone[-1], "") or self._last_drop
        total = sum(self._dropped_since_step.values())
        if total >= STUCK_BATCHES * self.batch_size:
            reasons = ", ".join(f"{n} {why}" for why, n in self._dropped_since_step.most_common())
            since = f"since step {self.steps_done - 1}" if self.steps_done else "and no step trained yet"
            last = f"; the last: {self._last_drop}" if self._last_drop else ""
            raise RunFailed(f"{total} groups dropped ({reasons}) {since}: the run cannot train{last} "
                            "(see the roles' logs)")

    def end(self) -> list[int]:
        """The run is over: the groups never trained on are abandoned."""
        left = sorted(self.groups)
        if left:
            self.journal.append(Event(event="ended", groups=left, reason="the run ended before they were trained"))
        return left

    def _last_grant(self, group: Group) -> bool:
        """Whether `group`'s next grant is its last try (given alone)."""
        return self.max_grants > 1 and group.strikes == self.max_grants - 1

    def _give(self, group: Group, rank: int, version: int, held: collections.Counter,
              out: dict[int, list[Group]], alone: bool = False) -> None:
        group.min_version = max(group.min_version, version - self.max_staleness, self._oldest(group.group_id))
        group.state, group.owner, group.alone = GroupState.GENERATING, rank, alone
        group.grants += 1
        if group.grants > 1:
            self.reissued += 1
        held[rank] += 1
        out[rank].append(group)

    def expired(self, group_ids: list[int], reason: str = "expired", errors: Sequence[str] = ()) -> list[int]:
        """A role dropped these groups unused (`errors`: what went wrong with
        each, if it says): queue them again, first in line. Returns those
        that were queued (not the ones already trained on or already queued,
        nor those dropped as poison)."""
        for group_id, error in zip(group_ids, errors):
            if group_id in self.groups:
                self.groups[group_id].error = error
        ids = [g for g in group_ids if g in self.groups]
        return self._requeue(ids, reason, struck=set(ids))

    def lost(self, owner: int) -> list[int]:
        """Rollout replica `owner` went away: queue again the groups it was
        generating (a failure of theirs, perhaps), and those it sent that the
        trainer has not received (they may have died in its socket)."""
        held = (GroupState.GENERATING, GroupState.DOWNSTREAM)
        mine = [g for g in self.groups.values() if g.owner == owner and g.state in held]
        struck = {g.group_id for g in mine if g.state is GroupState.GENERATING}
        return self._requeue([g.group_id for g in mine], f"rollout-{owner} lost", struck=struck)

    def lost_downstream(self, replica: str) -> list[int]:
        """A replica between rollout and trainer went away: queue again every
        group on its way (those that still arrive are dropped as duplicates)."""
        return self._requeue(
            (g.group_id for g in self.groups.values() if g.state is GroupState.DOWNSTREAM), f"{replica} lost"
        )

    def _requeue(self, group_ids, reason: str, struck: Set[int] = frozenset()) -> list[int]:
        """Queue `group_ids` again, first in line; those in `struck` failed (see `Group.strikes`)."""
        again = [g for g in dict.fromkeys(group_ids) if self.groups[g].state is not GroupState.QUEUED]
        for group_id in again:
            if group_id in struck:
                self.groups[group_id].strikes += 1
        poison = [g for g in again if self.groups[g].strikes >= self.max_grants]
        if poison:
            again = [g for g in again if self.groups[g].strikes < self.max_grants]
            details = [_poison_detail(self.groups[g], reason) for g in poison]
            self.drop(poison, POISON, details)
            self.notices += [f"group {g} dropped as poison ({detail})" for g, detail in zip(poison, details)]
        for group_id in reversed(again):
            group = self.groups[group_id]
            group.state, group.owner = GroupState.QUEUED, None
            self._queue.appendleft(group_id)
        if again:
            self.journal.append(Event(event="requeued", groups=again, reason=reason))
        return again

    def pace(self, starved_share: float) -> None:
        """Paced credits: after a step in which the trainer waited `starved_share` of its time
        for groups, move the lead (see the module)."""
        if starved_share > PACE_STARVED:
            self.lead, self._fed = min(self.max_staleness, self.lead + 1), 0
            return
        self._fed += 1
        if self._fed >= PACE_PATIENCE and self.lead > 1:
            self.lead, self._fed = self.lead - 1, 0

    def _tell_no_signal(self) -> None:
        """Once a run: most of the latest groups had no signal (a task too easy or too hard for
        the model; the filter keeps each step whole at the cost of many more prompts generated)."""
        window = self._no_signal
        if not self._said_no_signal and len(window) == window.maxlen and sum(window) >= NO_SIGNAL_WARNING * len(window):
            self._said_no_signal = True
            self.notices.append(f"{100 * sum(window) / len(window):.0f}% of the latest {len(window)} groups had no "
                                "signal (every reward equal) and others were granted in their place: the task may "
                                "be too easy or too hard for the model")

    def _unqueue(self, group_ids: list[int]) -> None:
        gone = set(group_ids)
        if any(g in gone for g in self._queue):
            self._queue = collections.deque(g for g in self._queue if g not in gone)

    def _add(self, group_id: int) -> None:
        self.groups[group_id] = Group(group_id, self._oldest(group_id))
        self._queue.append(group_id)

    def _oldest(self, group_id: int) -> int:
        """The oldest version group `group_id` may start on now. A group made to take a
        dropped one's place fills a step that is open now, not the later step its id would
        say (in sync mode that step could never start); a step done since it was made
        opens a later one, so this is asked again when the group is granted."""
        step = min(group_id // self.batch_size, self.steps_done + self.max_staleness)
        return min_version(step * self.batch_size, self.batch_size, self.max_staleness)

    # -- checkpoints --------------------------------------------------------

    def snapshot(self) -> LedgerState:
        return LedgerState(
            steps_done=self.steps_done,
            next_group=self.next_group,
            untrained=sorted(self.groups),
            reissued=self.reissued,
            dropped=dict(self.dropped),
            trained=self.trained_count,
            granted=self.granted,
        )

    @classmethod
    def restore(cls, state: LedgerState, batch_size: int, max_staleness: int, steps: int, *,
                max_grants: int = 3) -> GroupLedger:
        """The ledger as saved, with every untrained group queued again (in id order)."""
        ledger = cls(batch_size, max_staleness, steps, max_grants=max_grants)
        ledger.steps_done, ledger.next_group, ledger.reissued = state.steps_done, state.next_group, state.reissued
        ledger.dropped.update(state.dropped)
        # A step trains a batch of groups, so a checkpoint that kept no counts says them anyway.
        ledger.trained_count = state.trained if state.trained is not None else batch_size * state.steps_done
        ledger.granted = state.granted if state.granted is not None else ledger.trained_count
        for group_id in state.untrained:
            ledger._add(group_id)
        ledger.journal.append(Event(event="resumed", step=state.steps_done, groups=list(state.untrained),
                                    next_group=state.next_group))
        return ledger


def _poison_detail(group: Group, reason: str) -> str:
    """What the ledger, the log and the audit say of a group dropped as poison."""
    granted = f"granted {group.grants} times" if group.grants == group.strikes else \
        f"failed {group.strikes} of {group.grants} grants"
    return f"{granted}{', the last alone' if group.alone else ''}; last: {group.error or reason}"
