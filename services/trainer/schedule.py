"""The torch trainer's learning-rate schedule: a pure function of the
config and the step, so that a resumed run takes up the same curve."""

from __future__ import annotations

import math

from rlflow.config import TorchTrainer


def learning_rate(cfg: TorchTrainer, step: int, total_steps: int) -> float:
    """The learning rate of step `step` (from 0) of `total_steps`: a linear
    warm-up over `warmup_steps`, then `lr`, held or brought down (`lr_decay`)
    to ``lr_final * lr`` at the last step."""
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if cfg.lr_decay == "none":
        return cfg.lr
    span = max(total_steps - 1 - cfg.warmup_steps, 1)
    progress = min(max(step - cfg.warmup_steps, 0) / span, 1.0)
    shape = 1.0 - progress if cfg.lr_decay == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
    return cfg.lr * (cfg.lr_final + (1.0 - cfg.lr_final) * shape)
