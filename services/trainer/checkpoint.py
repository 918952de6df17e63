"""The torch trainer's checkpoints: the weights as `TrainedWeights.save`
writes them (a Hugging Face model directory, or a LoRA adapter in PEFT's
format) with the model's tokenizer files, plus the optimizer's state as a
torch distributed checkpoint (every rank writes its shards; any number of
ranks reads it), the RNG and the step, and the run state.

A checkpoint is written into a ``.tmp`` folder beside its own and moved
into place once complete: a folder without that suffix is a whole checkpoint.
"""

from __future__ import annotations

import json
import pathlib
from typing import Any

import torch

from rlflow.protocol import ParamSpec
from rlflow.rundir import RUN_STATE, TRAINER_OPTIMIZER, TRAINER_STATE
from rlflow.services.fsdp import Solo, checkpoint_begin, checkpoint_end, restore_rng
from rlflow.services.trainer.trained import TrainedWeights


def save(folder: pathlib.Path, run_state: dict[str, Any], *, weights: TrainedWeights, optimizer: torch.optim.Optimizer,
         steps: int, model_path: str, dtype: torch.dtype) -> None:
    """Write `weights` (their model loaded from `model_path` in `dtype`), the
    optimizer, RNG and step (after `steps` steps) and `run_state` into
    `folder` (every rank, at the same step)."""
    ranks: Solo = weights.ranks
    tmp = checkpoint_begin(folder, ranks)
    ranks.save_optimizer(weights.model, optimizer, tmp / TRAINER_OPTIMIZER)
    if weights.save(tmp, model_path, dtype):  # the rest is rank 0's
        checkpoint_end(tmp, folder, model_path=model_path, state_file=TRAINER_STATE, steps=steps, run_state=run_state)


def load(folder: pathlib.Path, *, weights: TrainedWeights,
         optimizer: torch.optim.Optimizer) -> tuple[int, dict[str, Any]]:
    """Restore the optimizer and RNG state `save` wrote into `folder` (on any
    number of ranks); the steps taken, and the run state. The weights are the
    folder's model (or adapter), loaded when the engine started."""
    state = torch.load(folder / TRAINER_STATE, weights_only=False)
    if (folder / TRAINER_OPTIMIZER).is_dir():
        weights.ranks.load_optimizer(weights.model, optimizer, folder / TRAINER_OPTIMIZER)
    elif "optimizer" in state:  # written by a trainer of one process, before it was sharded
        weights.ranks.load_full_optimizer(weights.model, optimizer, _by_name(state["optimizer"], weights.specs))
    restore_rng(state)
    return state["steps"], json.loads((folder / RUN_STATE).read_text())


def _by_name(state: dict[str, Any], specs: list[ParamSpec]) -> dict[str, Any]:
    """A torch optimizer state dict keyed by parameter index, keyed by
    parameter name instead (the indices count the model's parameters in order)."""
    names = [spec.name for spec in specs]
    return {
        "state": {names[i]: value for i, value in state["state"].items()},
        "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in state["param_groups"]],
    }
