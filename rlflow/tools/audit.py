"""`rlflow audit RUN_DIR`: replay a run's ledger and count what became of
every prompt group it issued.

Every group issued to a rollout replica is trained (an optimizer step used
it), dropped with a reason (a role gave up on it, or the run ended before it
was needed), or lost (neither): issued = trained + dropped + lost. A group
trained by two steps is duplicated. When a run resumes from a checkpoint at
step s, the steps from s on that it trained before it stopped never reached
the weights it goes on with: they do not count, nor do the groups issued that the checkpoint had not yet created
(the run creates them anew if it needs them). A group is lost only once the run has ended (`rlflow.runstate`:
stopped, or no status to say): of a run still going, or one that did not
finish (failed, interrupted, dead), the groups neither trained nor dropped
are *pending*: in flight, or granted again when the run is resumed. The
last line (``pending=N`` only for a run that has not ended):

    RESULT audit issued=N trained=N lost=N duplicated=N dropped=N [pending=N]
"""

from __future__ import annotations

import pathlib
from collections import Counter
from dataclasses import dataclass, field

import msgspec

from rlflow.control.ledger import POISON, Event
from rlflow.rundir import RunDir
from rlflow.runstate import run_state


@dataclass
class Audit:
    issued: int = 0
    trained: int = 0
    lost: int = 0
    duplicated: int = 0
    dropped: int = 0
    reasons: Counter[str] = field(default_factory=Counter)
    """Dropped groups, by reason."""
    lost_groups: list[int] = field(default_factory=list)
    details: dict[int, str] = field(default_factory=dict)
    """What went wrong with a dropped group, where the ledger says (a poison group: grants and last error)."""
    torn_lines: int = 0
    """Lines cut short by a crash while being written (skipped)."""
    pending: int = 0
    """Of a run that has not ended: groups neither trained nor dropped (yet)."""
    state: str = ""
    """The run's state (see `rlflow.runstate`; empty: it has no status)."""
    reason: str = ""

    @property
    def ended(self) -> bool:
        return self.state in ("", "stopped")

    def result(self) -> str:
        return (f"RESULT audit issued={self.issued} trained={self.trained} lost={self.lost} "
                f"duplicated={self.duplicated} dropped={self.dropped}"
                + ("" if self.ended else f" pending={self.pending}"))


def audit(run_dir: str | pathlib.Path) -> Audit:
    folder = RunDir(run_dir)
    if not folder.ledger.exists():
        raise FileNotFoundError(f"{folder.path} has no ledger ({folder.ledger.name})")
    decoder = msgspec.json.Decoder(Event)
    out = Audit()
    issued: set[int] = set()
    trained_at: dict[int, list[int]] = {}
    dropped: dict[int, str] = {}
    details: dict[int, str] = {}
    for line in folder.ledger.read_bytes().splitlines():
        if not line.strip():
            continue
        try:
            event = decoder.decode(line)
        except msgspec.DecodeError:
            out.torn_lines += 1
            continue
        match event.event:
            case "issued":
                issued.update(event.groups)
            case "trained":
                for group in event.groups:
                    trained_at.setdefault(group, []).append(event.step)
            case "dropped" | "ended":
                for group in event.groups:
                    dropped[group] = event.reason
                details.update(zip(event.groups, event.details))
            case "resumed":
                # Steps from the checkpoint on were lost with the weights that took them.
                for group, steps in list(trained_at.items()):
                    kept = [s for s in steps if s < event.step]
                    if kept:
                        trained_at[group] = kept
                    else:
                        del trained_at[group]
                for group in event.groups:  # queued again: whatever ended them before is undone
                    dropped.pop(group, None)
                if event.next_group >= 0:  # made after the checkpoint: made anew if the run needs them
                    later = {g for g in issued if g >= event.next_group}
                    issued -= later
                    for group in later:
                        dropped.pop(group, None)
    trained = set(trained_at)
    out.issued = len(issued)
    out.trained = len(trained)
    out.duplicated = sum(len(steps) - 1 for steps in trained_at.values())
    gone = {g: r for g, r in dropped.items() if g in issued and g not in trained}
    out.dropped = len(gone)
    out.reasons = Counter(gone.values())
    out.details = {g: details[g] for g in gone if details.get(g)}
    state = run_state(folder)
    if state is not None:
        out.state, out.reason = state.state, state.reason
    left = sorted(issued - trained - set(gone))
    if out.ended:
        out.lost_groups, out.lost = left, len(left)
    else:
        out.pending = len(left)
    return out


def text(result: Audit) -> str:
    lines = []
    if not result.ended:
        why = f" ({result.reason})" if result.reason else ""
        lines.append(f"the run is {result.state}{why}: {result.pending} groups neither trained nor dropped are "
                     "pending (in flight, or granted again when it is resumed), not lost")
    for reason, count in result.reasons.most_common():
        lines.append(f"dropped {count}: {reason}")
        named = [g for g in sorted(result.details) if g in result.details and reason == POISON][:20]
        lines += [f"  group {g}: {result.details[g]}" for g in named]
    if result.lost_groups:
        shown = ", ".join(str(g) for g in result.lost_groups[:20])
        lines.append(f"lost {result.lost}: groups {shown}{' ...' if result.lost > 20 else ''}")
    if result.torn_lines:
        lines.append(f"({result.torn_lines} lines cut short by a crash were skipped)")
    lines.append(result.result())
    return "\n".join(lines)
