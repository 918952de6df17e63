"""Where metrics go: the experiment trackers get each step's scalars, the
same as TensorBoard, and a tracker that is not installed is a config error
at launch."""

from __future__ import annotations

import json
import pathlib
import struct
import subprocess
import sys

import pytest

from rlflow import config as C
from rlflow.control.metrics import check_trackers, open_sinks, scalars
from rlflow.rundir import RunDir, Shares, StepRow

BASE = {"pools": {"p": {}}, "roles": {"rollout": {"pool": "p"}, "reward": {"pool": "p"}, "trainer": {"pool": "p"}}}


def rows() -> list[StepRow]:
    return [
        StepRow(step=s, version=s + 1, time_s=1.5 * s, samples=64, tokens=1000 + s, reward_mean=0.25 * s,
                staleness_max=float(s % 2), roles={"trainer": Shares(busy=0.75, starved=0.25)},
                train={"loss": 1.0 / (s + 1)})
        for s in range(3)
    ]


def write_rows(run_dir: RunDir, config: C.Config) -> None:
    sinks = open_sinks(run_dir, config)
    try:
        for row in rows():
            for sink in sinks:
                sink.write(row)
    finally:
        for sink in sinks:
            sink.close()


def wandb_records(path: pathlib.Path) -> list:
    """The records of an offline run's ``.wandb`` file: a log of 32 KiB blocks
    of chunks (a 7-byte header: checksum, length, type full/first/middle/last),
    after a 7-byte file header; each record a protobuf `Record`."""
    from wandb.proto import wandb_internal_pb2

    data, block, header = path.read_bytes(), 32768, 7
    assert data[:4] == b":W&B"
    records, pending, pos = [], b"", header
    while pos + header <= len(data):
        if block - pos % block < header:  # the end of a block too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + header])
        if kind == 0:
            break
        pending += data[pos + header : pos + header + length]
        pos += header + length
        if kind in (1, 4):  # full, or the last chunk of a record
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


@pytest.mark.slow  # starts W&B offline
def test_wandb_offline_gets_the_scalars_tensorboard_gets(tmp_path, monkeypatch):
    import wandb

    for name in ("WANDB_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(name, str(tmp_path / name.lower()))
    monkeypatch.setenv("WANDB_MODE", "offline")  # no network, no account
    monkeypatch.setenv("WANDB_SILENT", "true")
    config = C.build(BASE, {"metrics": {"wandb": {"project": "rlflow-test", "tags": ["ci"]}}})
    run_dir = RunDir(tmp_path / "run-7")
    run_dir.path.mkdir()
    try:
        write_rows(run_dir, config)
    finally:
        wandb.teardown()  # its service process, which would outlive the run otherwise
    (path,) = run_dir.path.glob("wandb/offline-run-*/run-*.wandb")  # under the run directory
    records = wandb_records(path)
    history = [{item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in r.history.item}
               for r in records if r.WhichOneof("record_type") == "history"]
    assert [h["_step"] for h in history] == [0, 1, 2]
    for logged, row in zip(history, rows(), strict=True):
        expected = scalars(row)
        assert {"reward_mean", "trainer/busy", "loss", "staleness_max"} <= set(expected)
        assert {key: logged[key] for key in expected} == pytest.approx(expected)
    (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert (run.project, run.display_name, list(run.tags)) == ("rlflow-test", "run-7", ["ci"])
    logged_config = {item.key: json.loads(item.value_json) for item in run.config.update}
    assert logged_config["run"]["mode"] == "async" and "roles" in logged_config  # the resolved config


TRACKIO_SCRIPT = """
import json, sys
from rlflow import config as C
from rlflow.rundir import RunDir
sys.path.insert(0, sys.argv[1])
from test_metrics import BASE, write_rows
import trackio
config = C.build(BASE, {"metrics": {"trackio": {"project": "rlflow-test"}}})
run_dir = RunDir(sys.argv[2])
run_dir.path.mkdir()
write_rows(run_dir, config)
print("LOGS", json.dumps(trackio.SQLiteStorage.get_logs("rlflow-test", "run-7"), default=str))
"""


def test_trackio_gets_the_scalars_tensorboard_gets(tmp_path):
    pytest.importorskip("trackio")  # the optional extra rlflow[trackio]
    import os

    # trackio reads where its database is once, on import: a process of its own.
    env = {**os.environ, "TRACKIO_DIR": str(tmp_path / "trackio")}
    done = subprocess.run([sys.executable, "-c", TRACKIO_SCRIPT, str(pathlib.Path(__file__).parent),
                           str(tmp_path / "run-7")], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    (line,) = [line for line in done.stdout.splitlines() if line.startswith("LOGS ")]  # trackio prints too
    logs = json.loads(line.removeprefix("LOGS "))
    assert [entry["step"] for entry in logs] == [0, 1, 2]
    for logged, row in zip(logs, rows(), strict=True):
        expected = scalars(row)
        assert {key: logged[key] for key in expected} == pytest.approx(expected)


def test_a_tracker_that_is_not_installed_is_a_config_error_at_launch(monkeypatch):
    import importlib.util

    config = C.build(BASE, {"metrics": {"wandb": {"project": "x"}}})
    check_trackers(config)  # installed here
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(C.ConfigError, match=r"metrics.wandb = \{project = 'x', .*\}: needs the wandb package: "
                                            r"pip install 'rlflow\[wandb\]'"):
        check_trackers(config)
    check_trackers(C.build(BASE))  # none asked for


def test_metrics_tables_are_checked_like_the_rest():
    with pytest.raises(C.ConfigError, match=r"metrics.wandb.project = \(missing\): required: a string"):
        C.build(BASE, overrides=["metrics.wandb.mode=offline"])
    with pytest.raises(C.ConfigError,
                       match=r"metrics.wandb.mode = 'cloud': expected one of 'auto', 'offline', 'online'"):
        C.build(BASE, overrides=['metrics.wandb={project = "x", mode = "cloud"}'])


def test_trackers_write_off_the_controllers_loop_in_order_and_one_that_fails_is_let_go(caplog):
    """`write` returns while a tracker still waits on its disk; `close` waits for every row, in order;
    a tracker that raises is logged and dropped, and the others go on."""
    import threading

    from rlflow.control.metrics import Background

    release, got = threading.Event(), []

    class Slow:
        def write(self, row):
            release.wait(30)
            got.append(row.step)

        def close(self):
            got.append("closed")

    class Broken:
        def write(self, row):
            raise OSError("disk full")

        def close(self):
            raise AssertionError("a sink let go of is not closed")

    sinks = Background([Broken(), Slow()])
    for row in rows():
        sinks.write(row)  # returns at once: the slow sink still waits
    assert got == []
    release.set()
    sinks.close()
    assert got == [0, 1, 2, "closed"]
    assert "Broken failed at step 0: no more metrics go to it" in caplog.text


def test_a_tracker_that_falls_behind_leaves_steps_out_instead_of_growing_the_queue(caplog):
    """At most `backlog` rows wait for the thread: past that a step is left out of the trackers, counted
    and logged, and the ones queued are still written in order."""
    import threading

    from rlflow.control.metrics import Background

    busy, release, got = threading.Event(), threading.Event(), []

    class Slow:
        def write(self, row):
            busy.set()
            release.wait(30)
            got.append(row.step)

        def close(self):
            pass

    first, *others = [StepRow(step=s, version=s + 1, time_s=float(s), samples=1, tokens=1) for s in range(5)]
    sinks = Background([Slow()], backlog=2)
    sinks.write(first)
    assert busy.wait(30)  # the thread holds step 0: the queue is empty
    for row in others:
        sinks.write(row)
    assert sinks.skipped == 2
    release.set()
    sinks.close()
    assert got == [0, 1, 2]
    assert "Slow: 2 steps behind the run; step 3 and 1 in all left out of them" in caplog.text
