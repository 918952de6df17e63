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
    """Scalars of each step into a TensorBoard event file of this session's:
    one event a step, its scalars the summary's values (in the scalar
    plugin's form, a float tensor each), made from the protos directly.
    (An event per scalar through the plugin's `scalar_pb`, which goes by
    way of numpy, took 7.5 ms a step of 30 scalars here, most of it that
    and each record's checksum, which TensorBoard computes in Python.)"""

    def __init__(self, run_dir: RunDir, first_step: int = 0):
        from tensorboard.compat.proto.event_pb2 import Event, SessionLog
        from tensorboard.compat.proto.summary_pb2 import Summary
        from tensorboard.compat.proto.tensor_pb2 import TensorProto
        from tensorboard.compat.proto.types_pb2 import DT_FLOAT
        from tensorboard.plugins.scalar.metadata import create_summary_metadata
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self._event, self._summary, self._tensor, self._float = Event, Summary, TensorProto, DT_FLOAT
        self._metadata = create_summary_metadata(display_name="", description="")
        if first_step > 0:
            _forget_from(run_dir.tensorboard, first_step)
        self._writer = EventFileWriter(str(run_dir.tensorboard))
        self._writer.add_event(Event(wall_time=time.time(), step=first_step,
                                     session_log=SessionLog(status=SessionLog.START)))
        self._writer.flush()

    def write(self, row: StepRow) -> None:
        values = [self._summary.Value(tag=key, metadata=self._metadata,
                                      tensor=self._tensor(dtype=self._float, float_val=[value]))
                  for key, value in scalars(row).items()]
        self._writer.add_event(self._event(wall_time=time.time(), step=row.step, summary=self._summary(value=values)))

    def flush(self) -> None:
        """Onto the disk: what TensorBoard's server reads."""
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class Background:
    """Sinks written on a thread of their own, in order: `write` only queues the row. The thread
    writes what is queued and, once it has caught up, flushes (`flush`, where a sink has one). A sink
    that fails is logged once and written to no more; the run goes on. `close` waits for the rows
    queued, then closes each sink.

    The queue holds at most `backlog` rows: while it is full (a tracker slower than the run's steps),
    a row is not queued, so that the controller's memory does not grow with the run's length. Such
    steps are counted and logged; metrics.jsonl, written on the loop, still has every one."""

    def __init__(self, sinks: list[Sink], backlog: int = 1024):
        self.sinks = list(sinks)
        self.backlog = backlog
        #: Steps not queued because the queue was full.
        self.skipped = 0
        self._rows: queue.SimpleQueue[StepRow | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="rlflow-metrics", daemon=True)
        self._thread.start()

    def write(self, row: StepRow) -> None:
        if self._rows.qsize() < self.backlog:
            self._rows.put(row)
            return
        self.skipped += 1
        if self.skipped == 1 or self.skipped % 1000 == 0:
            log.warning("[controller] %s: %d steps behind the run; step %d and %d in all left out of them "
                        "(metrics.jsonl has every step)", ", ".join(type(s).__name__ for s in self.sinks),
                        self.backlog, row.step, self.skipped)

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
