"""What the controller keeps of each trained step: the ledger's account of
it, the controller's state beside the trainer's checkpoint (so that a
resumed run grants again the groups granted but not trained on), the step's
row in every sink, and the pace of paced credits. Plain synchronous code:
the controller calls `record` from its handler of `StepDone`.
"""

from __future__ import annotations

import logging
import pathlib
from typing import Any

import msgspec

from rlflow.control.ledger import GroupLedger, LedgerState
from rlflow.control.metrics import Sink
from rlflow.control.stats import RunStats
from rlflow.errors import RunFailed
from rlflow.protocol import StepDone
from rlflow.rundir import CONTROLLER_STATE, RunDir, read_json, write_json

log = logging.getLogger("rlflow.controller")

#: A step where a larger share of the samples' rewards failed is a warning.
FAILED_SHARE_WARNING = 0.05


class ControllerState(msgspec.Struct, frozen=True, kw_only=True):
    """What a checkpoint keeps of the controller (beside the trainer's state)."""

    step: int
    version: int
    ledger: LedgerState


def start_ledger(run: Any) -> tuple[GroupLedger, int]:
    """The ledger and version a run starts with: new, or as the checkpoint resumed from saved them."""
    ledger = GroupLedger(run.batch_size, run.max_staleness, run.steps, max_grants=run.max_grants)
    if not run.resume:
        return ledger, 0
    state = read_json(pathlib.Path(run.resume) / CONTROLLER_STATE, ControllerState)
    if state is None:
        raise RunFailed(f"{run.resume} has no readable {CONTROLLER_STATE}")
    ledger = GroupLedger.restore(state.ledger, run.batch_size, run.max_staleness, run.steps, max_grants=run.max_grants)
    log.info("[controller] resumed at step %d, %d groups to grant again", state.step, len(ledger.groups))
    return ledger, state.version


def save_state(run_dir: RunDir, msg: StepDone, ledger: GroupLedger) -> None:
    """Beside the trainer's checkpoint of step `msg.step`: the clock and the
    ledger (the groups granted but not trained on are granted again on resume)."""
    folder = run_dir.checkpoint(msg.step + 1)
    if not folder.is_dir():
        log.warning("[controller] no checkpoint folder %s", folder)
        return
    state = ControllerState(step=msg.step + 1, version=msg.version, ledger=ledger.snapshot())
    write_json(folder / CONTROLLER_STATE, state)


def record(msg: StepDone, ledger: GroupLedger, stats: RunStats, run_dir: RunDir, sinks: list[Sink], *,
           time_s: float, messages: int, paced: bool) -> list[str]:
    """Account for the step the trainer took (`time_s`: the run's training time at its end,
    `messages`: those the controller received so far): the ledger, the state beside its checkpoint,
    its row in every sink and, with paced credits, the ledger's pace. Warnings for a person to look at."""
    ledger.trained(msg.step, msg.acked)
    if "checkpoint" in msg.metrics:
        save_state(run_dir, msg, ledger)
    row = stats.close_step(msg, time_s, messages)
    if paced:
        starved = row.train.get("starved_s", 0.0)
        ledger.pace(starved / max(row.train_s + starved, 1e-9))
    for sink in sinks:
        sink.write(row)
    failed = row.reward_failed_share
    if failed is None or failed <= FAILED_SHARE_WARNING:
        return []
    return [f"step {row.step}: the reward of {100 * failed:.0f}% of the samples could not be computed (see "
                 "the reward counters in the status)"]
