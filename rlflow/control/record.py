"""A run's record across its sessions: what a resumed session keeps of the
files the sessions before it wrote, and where it goes on from.

A session that stopped short (its trainer or its controller killed) trained
steps past its newest checkpoint; `rlflow up --resume` goes on from that
checkpoint, so those steps went with the weights that took them and are
trained again. `resume` cuts them from the record before the new session
writes a line: the rows of metrics.jsonl from the checkpoint's step on, the
evaluations of weights newer than the checkpoint's (or that ended after its
step), and the trainer's lengths of those steps; it logs what it cut. Lines
cut short by a crash are dropped too, so that the next line written does
not run on from one. Each file is rewritten whole, then put in place.

The session then carries on: the steps kept (the whole run's figures come
from them), their evaluations, and the training time of the last step kept,
from which `StepRow.time_s` goes on. ledger.jsonl is not cut: it records
the resume itself, which `rlflow audit` replays.
"""

from __future__ import annotations

import logging
import os
import pathlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

import msgspec

from rlflow.rundir import EvalRow, RunDir, StepRow

log = logging.getLogger("rlflow.controller")

T = TypeVar("T")


class _Step(msgspec.Struct):
    """The one field of a lengths record the cut reads."""

    step: int


class _Resumed(msgspec.Struct):
    """The one field of a ledger event counting sessions reads."""

    event: str


@dataclass
class Carried:
    """What a resumed session takes over from the sessions before it."""

    step: int = 0
    """The step it starts from (the checkpoint's)."""
    rows: list[StepRow] = field(default_factory=list)
    """metrics.jsonl as kept: the steps before `step`."""
    evals: list[EvalRow] = field(default_factory=list)
    time_s: float = 0.0
    """Training time of the last step kept: where this session's `StepRow.time_s` goes on from."""
    groups_trained: int = 0
    """Groups trained by the steps kept."""
    sessions: int = 0
    """Sessions before this one."""


@dataclass
class Cut:
    """What was cut from one file."""

    path: pathlib.Path
    kept: int
    cut: int
    torn: int
    """Lines that were not whole (a crash while one was written)."""
    what: str = "line"
    """What a line is (``step``, ``evaluation``)."""
    detail: str = ""

    def __str__(self) -> str:
        torn = f" and {_count(self.torn, 'line')} cut short by a crash" if self.torn else ""
        return f"{_count(self.cut, self.what)}{self.detail} of {self.path.name}{torn} (kept {self.kept})"


def resume(folder: RunDir, step: int, groups_trained: int = 0) -> Carried:
    """Cut the record of the sessions before to checkpoint `step` (see the
    module); what the new session carries on with."""
    rows, lost, cut = _cut(folder.metrics, StepRow, lambda r: r.step < step, once=lambda r: r.step)
    cut.what, cut.detail = "step", f" ({_span(sorted(r.step for r in lost))})" if lost else ""
    # Weights up to the checkpoint's version are the ones the run goes on with.
    evals, _, evals_cut = _cut(folder.evals, EvalRow, lambda e: e.step <= step and e.version_end <= step)
    evals_cut.what = "evaluation"
    cuts = [cut, evals_cut]
    for lengths in sorted(folder.traces.glob("lengths-*.jsonl")):
        cuts.append(_cut(lengths, _Step, lambda r: r.step < step, once=lambda r: r.step)[2])
    gone = [c for c in cuts if c.cut or c.torn]
    if gone:
        log.info("[controller] record cut to step %d, the checkpoint resumed from: %s", step, "; ".join(map(str, gone)))
    else:
        log.info("[controller] record kept whole: nothing in it is past step %d, the checkpoint resumed from", step)
    missing = sorted(set(range(step)) - {r.step for r in rows})
    if missing:
        log.warning("[controller] metrics.jsonl has no row for step %s (no session wrote one)", _span(missing))
    return Carried(
        step=step,
        rows=rows,
        evals=evals,
        time_s=rows[-1].time_s if rows else 0.0,
        groups_trained=groups_trained,
        sessions=1 + _resumes(folder),
    )


def _cut(path: pathlib.Path, kind: type[T], keep: Callable[[T], bool],
         once: Callable[[T], object] | None = None) -> tuple[list[T], list[T], Cut]:
    """Keep the whole lines of JSON-lines file `path` whose record `keep`
    accepts and, with `once`, only the last of those with the same key (a
    step written twice before resumes cut the record was trained again by
    the later session); the records kept, those cut, and what was cut."""
    try:
        lines = path.read_bytes().splitlines()
    except FileNotFoundError:
        return [], [], Cut(path, 0, 0, 0)
    decoder = msgspec.json.Decoder(kind)
    records: list[tuple[bytes, T]] = []
    dropped: list[tuple[bytes, T]] = []
    torn = 0
    for line in lines:
        if not line.strip():
            continue
        try:
            record = decoder.decode(line)
        except msgspec.DecodeError:
            torn += 1
            continue
        (records if keep(record) else dropped).append((line, record))
    if once is not None:
        last = {once(record): i for i, (_, record) in enumerate(records)}
        dropped += [item for i, item in enumerate(records) if last[once(item[1])] != i]
        records = [item for i, item in enumerate(records) if last[once(item[1])] == i]
    kept_lines, kept = [line for line, _ in records], [record for _, record in records]
    gone = [record for _, record in dropped]
    if gone or torn:
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_bytes(b"".join(line + b"\n" for line in kept_lines))
        os.replace(tmp, path)
    return kept, gone, Cut(path, len(kept), len(gone), torn)


def _resumes(folder: RunDir) -> int:
    """Resumes the run's ledger records."""
    try:
        data = folder.ledger.read_bytes()
    except FileNotFoundError:
        return 0
    decoder = msgspec.json.Decoder(_Resumed)
    count = 0
    for line in data.splitlines():
        if b'"resumed"' in line:
            try:
                count += decoder.decode(line).event == "resumed"
            except msgspec.DecodeError:
                pass
    return count


def _count(n: int, what: str) -> str:
    return f"{n} {what}{'' if n == 1 else 's'}"


def _span(steps: list[int]) -> str:
    """``70-78``, or one step, or a few steps."""
    if not steps:
        return ""
    if steps == list(range(steps[0], steps[-1] + 1)):
        return f"{steps[0]}-{steps[-1]}" if len(steps) > 1 else str(steps[0])
    return ", ".join(map(str, steps[:8])) + (" ..." if len(steps) > 8 else "")
