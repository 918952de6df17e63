"""Where per-step metrics go: one sink interface, JSON lines always on,
TensorBoard event files too when the `tensorboard` extra is installed."""

from __future__ import annotations

import logging
import math
from typing import Any, Protocol

import msgspec

from rlflow.rundir import RunDir, StepRow, append_jsonl

log = logging.getLogger("rlflow.metrics")


class Sink(Protocol):
    def write(self, row: StepRow) -> None:
        """Record one trainer step's metrics."""
        ...

    def close(self) -> None: ...


class JsonlSink:
    """``metrics.jsonl``: one `StepRow` per line."""

    def __init__(self, run_dir: RunDir):
        self.path = run_dir.metrics

    def write(self, row: StepRow) -> None:
        append_jsonl(self.path, row)

    def close(self) -> None:
        """Each row is written whole: nothing to flush."""


def scalars(row: StepRow) -> dict[str, float]:
    """Every number of a row, by a flat name (``roles.trainer.busy`` -> ``trainer/busy``)."""
    out: dict[str, float] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict):
            for key, item in value.items():
                walk(f"{prefix}{key}/", item)
        elif isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            out[prefix.rstrip("/")] = float(value)

    data = msgspec.to_builtins(row)
    for key in ("step", "version"):
        data.pop(key)
    walk("", {**data.pop("roles"), **data.pop("train"), **data})
    return out


class TensorBoardSink:
    """Scalars of each step into TensorBoard event files."""

    def __init__(self, run_dir: RunDir):
        from tensorboard.summary import Writer

        self._writer = Writer(str(run_dir.tensorboard))

    def write(self, row: StepRow) -> None:
        for key, value in scalars(row).items():
            self._writer.add_scalar(key, value, row.step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


def open_sinks(run_dir: RunDir) -> list[Sink]:
    """JSON lines, and TensorBoard where it is installed."""
    sinks: list[Sink] = [JsonlSink(run_dir)]
    try:
        sinks.append(TensorBoardSink(run_dir))
    except ImportError:
        log.info("tensorboard is not installed: metrics go to metrics.jsonl only")
    return sinks
