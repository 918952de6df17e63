"""`rlflow audit`: the replay of a run's ledger file, and the ledger under
any order of failures (property-based: replicas die with groups in every
state, copies arrive late, twice, or never)."""

from __future__ import annotations

import json
import random

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from rlflow.control.ledger import GroupLedger
from rlflow.rundir import RunDir
from rlflow.tools.audit import audit, text
from rlflow.tools.cli import main


def write_ledger(folder, events: list[dict], torn: bool = False) -> None:
    lines = [json.dumps(e) for e in events]
    if torn:
        lines.append('{"event": "trai')
    RunDir(folder).ledger.write_text("\n".join(lines) + "\n")


def test_a_resumed_run_counts_only_the_steps_its_weights_kept(tmp_path):
    """Steps trained after the checkpoint a run resumed from do not count;
    the groups queued again on resume are no longer dropped."""
    write_ledger(tmp_path, [
        {"event": "issued", "groups": list(range(8)), "replica": "rollout-0"},
        {"event": "trained", "groups": [0, 1, 2, 3], "step": 0},
        {"event": "trained", "groups": [4, 5, 6, 7], "step": 1},  # after the checkpoint: lost with the trainer
        {"event": "ended", "groups": [8], "reason": "the run ended"},
        {"event": "resumed", "groups": [4, 5, 6, 7], "step": 1},
        {"event": "issued", "groups": [4, 5, 6, 7], "replica": "rollout-0"},
        {"event": "trained", "groups": [4, 5, 6, 7], "step": 1},
    ], torn=True)
    result = audit(tmp_path)
    assert (result.issued, result.trained, result.lost, result.duplicated, result.dropped) == (8, 8, 0, 0, 0)
    assert result.torn_lines == 1
    assert text(result).splitlines()[-1] == "RESULT audit issued=8 trained=8 lost=0 duplicated=0 dropped=0"


def test_groups_a_stopped_session_made_after_its_checkpoint_are_not_lost_if_the_run_never_needs_them(tmp_path):
    """The session stopped short had issued groups 8-11 (its staleness bound
    allowed them) and dropped one; the checkpoint it resumes from had made
    groups up to 7 only, and the run needs no more than those."""
    write_ledger(tmp_path, [
        {"event": "issued", "groups": list(range(12)), "replica": "rollout-0"},
        {"event": "trained", "groups": [0, 1, 2, 3], "step": 0},
        {"event": "dropped", "groups": [9], "reason": "reward failed"},
        {"event": "trained", "groups": [4, 5, 6, 7], "step": 1},
        {"event": "resumed", "groups": [4, 5, 6, 7], "step": 1, "next_group": 8},
        {"event": "issued", "groups": [4, 5, 6, 7], "replica": "rollout-0"},
        {"event": "trained", "groups": [4, 5, 6, 7], "step": 1},
    ])
    result = audit(tmp_path)
    assert (result.issued, result.trained, result.lost, result.duplicated, result.dropped) == (8, 8, 0, 0, 0)


def test_lost_duplicated_and_dropped_groups_are_named(tmp_path, capsys):
    write_ledger(tmp_path, [
        {"event": "issued", "groups": [0, 1, 2, 3, 4], "replica": "rollout-0"},
        {"event": "trained", "groups": [0, 1], "step": 0},
        {"event": "trained", "groups": [1, 2], "step": 1},
        {"event": "dropped", "groups": [3], "reason": "reward math failed: timeout"},
    ])
    assert main(["audit", str(tmp_path)]) == 1
    out = capsys.readouterr().out.splitlines()
    assert "dropped 1: reward math failed: timeout" in out
    assert "lost 1: groups 4" in out
    assert out[-1] == "RESULT audit issued=5 trained=3 lost=1 duplicated=1 dropped=1"


def test_a_run_without_a_ledger_is_an_error_not_a_clean_audit(tmp_path, capsys):
    assert main(["audit", str(tmp_path)]) == 2
    assert "has no ledger" in capsys.readouterr().err


# -- the ledger under failures ------------------------------------------------------------

BATCH, STEPS = 3, 6

actions = st.lists(
    st.tuples(st.sampled_from(["grant", "finish", "deliver", "kill_rollout", "kill_downstream",
                               "drop", "train"]),
              st.integers(0, 1), st.integers(0, 1_000)),
    max_size=120,
)


class World:
    """The ledger, two rollout replicas, copies on their way and a trainer
    that keeps the first copy of a group and trains `BATCH` at a time."""

    def __init__(self, staleness: int):
        self.ledger = GroupLedger(batch_size=BATCH, max_staleness=staleness, steps=STEPS)
        self.generating: dict[int, list[int]] = {0: [], 1: []}
        self.in_flight: list[tuple[int, int]] = []  # (group, from rollout)
        self.held: list[int] = []
        self.trained: set[int] = set()
        self.version = 0
        self.events = []
        self.made: dict[int, int] = {}  # group id -> steps done when the ledger made it

    def grant(self) -> None:
        first_new = self.ledger.next_group
        granted = self.ledger.grant({0: 2, 1: 3}, self.version)
        self.made.update(dict.fromkeys(range(first_new, self.ledger.next_group), self.ledger.steps_done))
        for rank, groups in granted.items():
            for g in groups:  # the staleness bound, also for a group granted again
                # The step a group fills: its id's or, one made to take a dropped group's place, the
                # newest step open when it was made.
                step = min(g.group_id // BATCH, self.made[g.group_id] + self.ledger.max_staleness)
                assert g.min_version >= max(self.version, step) - self.ledger.max_staleness
            self.generating[rank] += [g.group_id for g in groups]

    def finish(self, rank: int, pick: int) -> None:
        if self.generating[rank]:
            group = self.generating[rank].pop(pick % len(self.generating[rank]))
            self.ledger.generated(rank, [group])
            self.in_flight.append((group, rank))

    def deliver(self, pick: int) -> None:
        if self.in_flight:
            group, _ = self.in_flight.pop(pick % len(self.in_flight))
            if group not in self.trained and group not in self.held:  # the trainer's duplicate check
                self.held.append(group)
                self.ledger.received([group])

    def train(self) -> None:
        if len(self.held) >= BATCH and self.ledger.steps_done < STEPS:
            batch, self.held = self.held[:BATCH], self.held[BATCH:]
            assert not self.trained & set(batch)
            self.trained.update(batch)
            self.ledger.trained(self.ledger.steps_done, batch)
            self.version += 1

    def step(self, action: str, rank: int, pick: int) -> None:
        match action:
            case "grant":
                self.grant()
            case "finish":
                self.finish(rank, pick)
            case "deliver":
                self.deliver(pick)
            case "kill_rollout":  # some of what it sent dies in its socket with it
                self.generating[rank] = []
                self.in_flight = [c for c in self.in_flight if c[1] != rank or pick % 2]
                self.ledger.lost(rank)
            case "kill_downstream":  # a reward replica: it held some of the copies
                rng = random.Random(pick)
                self.in_flight = [c for c in self.in_flight if rng.random() < 0.5]
                self.ledger.lost_downstream("reward-0")
            case "drop" if self.in_flight:
                group, _ = self.in_flight.pop(pick % len(self.in_flight))
                self.ledger.drop([group], "reward failed")
            case "train":
                self.train()
        self.events += self.ledger.drain()

    def finish_run(self) -> None:
        """No more failures: work until the last step is trained."""
        for _ in range(10_000):
            if self.ledger.steps_done >= STEPS:
                break
            self.grant()
            for rank in (0, 1):
                while self.generating[rank]:
                    self.finish(rank, 0)
            while self.in_flight:
                self.deliver(0)
            self.train()
        assert self.ledger.steps_done == STEPS, "the run stalled"
        self.ledger.end()
        self.events += self.ledger.drain()


@settings(max_examples=300, deadline=None)
@given(actions, st.integers(0, 2))
def test_whatever_dies_when_no_group_is_lost_or_trained_twice(tmp_path_factory, script, staleness):
    world = World(staleness)
    for action, rank, pick in script:
        world.step(action, rank, pick)
    world.finish_run()
    folder = tmp_path_factory.mktemp("run")
    RunDir(folder).ledger.write_bytes(b"\n".join(msgspec.json.encode(e) for e in world.events) + b"\n")
    result = audit(folder)
    assert (result.lost, result.duplicated) == (0, 0), result
    assert result.trained == BATCH * STEPS == len(world.trained)
    assert result.issued == result.trained + result.dropped
    ended = result.reasons.get("the run ended before they were trained", 0)
    # Dropped by a role, or (granted `max_grants` times, lost every time) as poison.
    assert result.dropped - ended == sum(world.ledger.dropped.values())
    assert set(world.ledger.dropped) <= {"reward failed", "poison"}
