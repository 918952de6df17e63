"""Where per-step metrics go: one sink interface, JSON lines always on,
TensorBoard event files too when the `tensorboard` extra is installed, and
the experiment trackers the config names (`[metrics]`: Weights & Biases,
trackio), each given the same scalars as TensorBoard."""

from __future__ import annotations

import importlib.util
import logging
import math
from typing import Any, Protocol

import msgspec

from rlflow.config import Config, ConfigError, TrackioConfig, WandbConfig
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


class WandbSink:
    """Scalars of each step into a Weights & Biases run (its local files
    under the run directory's wandb/), the resolved config as its config."""

    def __init__(self, run_dir: RunDir, cfg: WandbConfig, config: dict[str, Any]):
        import wandb

        self._run = wandb.init(
            project=cfg.project, entity=cfg.entity or None, name=cfg.name or run_dir.path.name,
            tags=cfg.tags or None, dir=str(run_dir.path), config=config,
            mode=None if cfg.mode == "auto" else cfg.mode,
            settings=wandb.Settings(console="off"),  # the run's own output stays where it was
        )

    def write(self, row: StepRow) -> None:
        self._run.log(scalars(row), step=row.step)

    def close(self) -> None:
        self._run.finish()


class TrackioSink:
    """Scalars of each step into a trackio run (trackio's local database)."""

    def __init__(self, run_dir: RunDir, cfg: TrackioConfig, config: dict[str, Any]):
        import trackio

        self._run = trackio.init(project=cfg.project, name=cfg.name or run_dir.path.name, config=config,
                                 auto_log_cpu=False, auto_log_gpu=False)

    def write(self, row: StepRow) -> None:
        self._run.log(scalars(row), step=row.step)

    def close(self) -> None:
        self._run.finish()


#: The trackers of `[metrics]`, by config key (the package each needs has the same name).
TRACKERS = {"wandb": WandbSink, "trackio": TrackioSink}


def check_trackers(config: Config) -> None:
    """Each tracker the config names is installed (`ConfigError` naming the
    key and the extra to install if not): checked at launch, before anything starts."""
    for name in TRACKERS:
        table = getattr(config.metrics, name)
        if table is not None and importlib.util.find_spec(name) is None:
            raise ConfigError(f"metrics.{name}", msgspec.to_builtins(table),
                              f"needs the {name} package: pip install 'rlflow[{name}]'")


def open_sinks(run_dir: RunDir, config: Config | None = None) -> list[Sink]:
    """JSON lines, TensorBoard where it is installed, and the trackers `config` names."""
    sinks: list[Sink] = [JsonlSink(run_dir)]
    try:
        sinks.append(TensorBoardSink(run_dir))
    except ImportError:
        log.info("tensorboard is not installed: metrics go to metrics.jsonl only")
    if config is not None:
        for name, sink in TRACKERS.items():
            table = getattr(config.metrics, name)
            if table is not None:
                sinks.append(sink(run_dir, table, msgspec.to_builtins(config)))
    return sinks
