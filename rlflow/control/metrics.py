"""Where per-step metrics go: one sink interface, JSON lines always on,
TensorBoard event files too when the `tensorboard` extra is installed, and
the experiment trackers the config names (`[metrics]`: Weights & Biases,
trackio), each given the same scalars as TensorBoard.

JSON lines are written on the controller's loop (the run's record, read as
soon as a step is done); the others on a thread of their own (`Background`),
so that the loop never waits on a tracker's disk or network: TensorBoard's
writer waits for its file, and a step every few milliseconds left the
controller blocked there most of its time.

Each session of a run writes a TensorBoard event file of its own, which
starts by saying where the session starts (TensorBoard's `SessionLog.START`
at its first step, what a writer's ``purge_step`` writes): TensorBoard's
server then forgets the steps from there on that an earlier session wrote (a
resumed run trains them again). Not every reader honours that (the older
`EventAccumulator` keeps such tensors), so a resumed session also takes
those steps out of the earlier sessions' files: every reader shows one curve.
"""

from __future__ import annotations

import importlib.util
import logging
import math
import os
import pathlib
import queue
import threading
import time
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
    """Scalars of each step into a TensorBoard event file of this session's."""

    def __init__(self, run_dir: RunDir, first_step: int = 0):
        from tensorboard.compat.proto.event_pb2 import Event, SessionLog
        from tensorboard.plugins.scalar.summary_v2 import scalar_pb
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self._event, self._scalar = Event, scalar_pb
        if first_step > 0:
            _forget_from(run_dir.tensorboard, first_step)
        self._writer = EventFileWriter(str(run_dir.tensorboard))
        self._writer.add_event(Event(wall_time=time.time(), step=first_step,
                                     session_log=SessionLog(status=SessionLog.START)))
        self._writer.flush()

    def write(self, row: StepRow) -> None:
        now = time.time()
        for key, value in scalars(row).items():
            self._writer.add_event(self._event(wall_time=now, step=row.step, summary=self._scalar(key, value)))

    def flush(self) -> None:
        """Onto the disk: what TensorBoard's server reads."""
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class Background:
    """Sinks written on a thread of their own, in order: `write` only queues the row. The thread
    writes what is queued and, once it has caught up, flushes (`flush`, where a sink has one). A sink
    that fails is logged once and written to no more; the run goes on. `close` waits for the rows
    queued, then closes each sink."""

    def __init__(self, sinks: list[Sink]):
        self.sinks = list(sinks)
        self._rows: queue.SimpleQueue[StepRow | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="rlflow-metrics", daemon=True)
        self._thread.start()

    def write(self, row: StepRow) -> None:
        self._rows.put(row)

    def _run(self) -> None:
        while (row := self._rows.get()) is not None:
            for sink in list(self.sinks):
                try:
                    sink.write(row)
                    if self._rows.empty() and hasattr(sink, "flush"):
                        sink.flush()
                except Exception:
                    log.exception("[controller] %s failed at step %d: no more metrics go to it",
                                  type(sink).__name__, row.step)
                    self.sinks.remove(sink)

    def close(self) -> None:
        self._rows.put(None)
        self._thread.join()
        for sink in self.sinks:
            sink.close()


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


def _forget_from(folder: pathlib.Path, step: int) -> None:
    """Take the summaries of `step` and later out of the event files in
    `folder` (each rewritten whole, then put in place; a record cut short by
    a crash goes too)."""
    from tensorboard.backend.event_processing.event_file_loader import RawEventFileLoader
    from tensorboard.compat.proto.event_pb2 import Event
    from tensorboard.summary.writer.record_writer import RecordWriter

    for path in sorted(folder.glob("events.out.tfevents.*")):
        records = list(RawEventFileLoader(str(path)).Load())
        kept = [r for r in records if not _stale(Event.FromString(r), step)]
        if len(kept) == len(records) and path.stat().st_size == sum(len(r) + 16 for r in records):
            continue
        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "wb") as f:
            writer = RecordWriter(f)
            for record in kept:
                writer.write(record)
        os.replace(tmp, path)
        log.info("[controller] %s: took %d summaries of step %d and later out", path.name,
                 len(records) - len(kept), step)


def _stale(event: Any, step: int) -> bool:
    return event.HasField("summary") and event.step >= step


def open_sinks(run_dir: RunDir, config: Config | None = None, first_step: int = 0) -> list[Sink]:
    """JSON lines, TensorBoard where it is installed, and the trackers `config`
    names (`first_step`: where this session starts; TensorBoard forgets what
    earlier sessions wrote from there on)."""
    others: list[Sink] = []
    try:
        others.append(TensorBoardSink(run_dir, first_step))
    except ImportError:
        log.info("tensorboard is not installed: metrics go to metrics.jsonl only")
    if config is not None:
        for name, sink in TRACKERS.items():
            table = getattr(config.metrics, name)
            if table is not None:
                others.append(sink(run_dir, table, msgspec.to_builtins(config)))
    return [JsonlSink(run_dir), *([Background(others)] if others else [])]
