"""Where per-step metrics go: one sink interface, JSON lines always on,
TensorBoard event files too when the `tensorboard` extra is installed."""

from __future__ import annotations

import json
import logging
import math
import pathlib
from typing import Any, Protocol

log = logging.getLogger("rlflow.metrics")


class Sink(Protocol):
    def write(self, row: dict[str, Any]) -> None:
        """Record one trainer step's metrics (``row["step"]`` is its index)."""
        ...

    def close(self) -> None: ...


class JsonlSink:
    """``metrics.jsonl``: one JSON object per line, flushed per step."""

    def __init__(self, path: pathlib.Path):
        self.path = path
        self._file = open(path, "a", buffering=1)

    def write(self, row: dict[str, Any]) -> None:
        self._file.write(json.dumps(row) + "\n")

    def close(self) -> None:
        self._file.close()


class TensorBoardSink:
    """Scalars of each step into TensorBoard event files under `folder`."""

    def __init__(self, folder: pathlib.Path):
        from tensorboard.summary import Writer

        self._writer = Writer(str(folder))

    def write(self, row: dict[str, Any]) -> None:
        step = int(row["step"])
        for key, value in row.items():
            if key != "step" and isinstance(value, (int, float)) and math.isfinite(value):
                self._writer.add_scalar(key.replace(".", "/"), value, step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


def open_sinks(run_dir: pathlib.Path) -> list[Sink]:
    """JSON lines, and TensorBoard where it is installed."""
    sinks: list[Sink] = [JsonlSink(run_dir / "metrics.jsonl")]
    try:
        sinks.append(TensorBoardSink(run_dir / "tensorboard"))
    except ImportError:
        log.info("tensorboard is not installed: metrics go to metrics.jsonl only")
    return sinks
