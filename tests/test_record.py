"""One run, one record: a run resumed after its trainer was killed reads,
file by file, as one run (each step once, time going forward, whole-run
totals beside the last session's), and what the cut takes out is what the
killed session trained past its checkpoint."""

from __future__ import annotations

import json
import logging
import math
import random

import msgspec
import pytest
import trio
from test_controller import InProcessLauncher, run_in_process, sim

from rlflow.control.controller import Controller
from rlflow.control.record import resume
from rlflow.errors import RunFailed
from rlflow.rundir import EvalRow, RunDir, StepRow


def write_lines(path, records, torn: str = "") -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"".join(msgspec.json.encode(r) + b"\n" for r in records) + torn.encode())


def test_a_resume_cuts_what_the_sessions_before_wrote_past_the_checkpoint(tmp_path, caplog):
    """Steps from the checkpoint on, evaluations of newer weights (or that
    ended later), the trainer's lengths of those steps and a line cut short
    by a crash go; what is kept is carried on, and the cut is logged."""
    folder = RunDir(tmp_path)
    # Steps 3-4 twice (written before resumes cut the record: the later is the one kept), then a session
    # that went past the checkpoint at 8 and one that resumed from it and was stopped again.
    rows = [StepRow(step=s, version=s + 1, time_s=1.0 + s, samples=8) for s in [*range(5), *range(3, 12), 8, 9]]
    rows[3:5] = [msgspec.structs.replace(r, samples=1) for r in rows[3:5]]
    write_lines(folder.metrics, rows, torn='{"step": 10, "vers')
    evals = [EvalRow(step=s, version=v, version_end=e, seconds=1.0, metrics={"accuracy": 0.1 * s})
             for s, v, e in [(0, 0, 0), (4, 4, 4), (8, 8, 8), (9, 8, 9), (11, 10, 11)]]
    write_lines(folder.evals, evals)
    write_lines(folder.lengths(0), [{"step": s, "lengths": [s]} for s in range(12)])
    with caplog.at_level(logging.INFO, logger="rlflow.controller"):
        carried = resume(folder, 8, groups_trained=32)
    assert [r.step for r in folder.read_metrics()] == list(range(8)) == [r.step for r in carried.rows]
    assert {r.samples for r in carried.rows} == {8}
    assert [(e.step, e.version_end) for e in folder.read_evals()] == [(0, 0), (4, 4), (8, 8)]
    assert [json.loads(line)["step"] for line in folder.lengths(0).read_text().splitlines()] == list(range(8))
    assert (carried.step, carried.time_s, carried.groups_trained, carried.sessions) == (8, 8.0, 32, 1)
    said = caplog.text
    assert ("record cut to step 8, the checkpoint resumed from: 8 steps (3, 4, 8, 8, 9, 9, 10, 11) of metrics.jsonl "
            "and 1 line cut short by a crash") in said
    assert "2 evaluations of evals.jsonl" in said and "4 lines of lengths-0.jsonl" in said
    # Once cut, a second look finds nothing more to cut.
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="rlflow.controller"):
        assert resume(folder, 8).rows == carried.rows
    assert "record kept whole: nothing in it is past step 8" in caplog.text


def tensorboard_steps(folder: RunDir, tag: str) -> dict[str, list[tuple[int, float]]]:
    """(step, value) of `tag` as each of TensorBoard's readers shows it: the
    accumulator its server uses, and the older one."""
    from tensorboard.backend.event_processing import event_accumulator, plugin_event_accumulator
    from tensorboard.util.tensor_util import make_ndarray

    out = {}
    for name, module in (("server", plugin_event_accumulator), ("legacy", event_accumulator)):
        events = module.EventAccumulator(str(folder.tensorboard), size_guidance={"tensors": 0})
        events.Reload()
        out[name] = [(e.step, float(make_ndarray(e.tensor_proto))) for e in events.Tensors(tag)]
    return out


@pytest.mark.slow  # four runs in a row
async def test_a_run_resumed_three_times_reads_as_one_run(tmp_path, caplog):
    """Kill the trainer at a random step past a checkpoint, resume, three
    times; then finish. Every file of the run directory reads as one run:
    metrics.jsonl, TensorBoard (as both its readers show it) and the
    trainer's lengths have each step once, the values of the session that
    kept it; time goes forward; every replica's timeline keeps each of its
    lives once; the ledger's audit is exact; the summary gives the whole
    run's totals and the last session's beside them."""
    from conftest import trained_groups

    from rlflow import timeline
    from rlflow.tools.audit import audit

    steps, batch, every = 30, 4, 3
    base = (f"run.steps={steps}", f"roles.trainer.engine.checkpoint_every={every}",
            "roles.rollout.engine.step_s=0.002")
    folder = RunDir(tmp_path / "run")
    rng = random.Random(7)
    resume_at: list[int] = []
    written_past: list[int] = []  # rows the killed session wrote from its newest checkpoint on

    async def kill_trainer(controller: Controller, launcher: InProcessLauncher) -> None:
        target = controller.ledger.steps_done + rng.randint(every + 1, 2 * every)  # past a checkpoint
        while controller.ledger.steps_done < target:
            await trio.sleep(0.01)
        await trio.sleep(rng.uniform(0, 0.2))
        await launcher.crash("trainer", 0)

    resumed: list[str] = []
    with caplog.at_level(logging.INFO, logger="rlflow.controller"):
        for _ in range(3):
            with trio.fail_after(120), pytest.raises(RunFailed, match="trainer-0 died: killed"):
                await run_in_process(sim(*base, *resumed), folder.path, during=kill_trainer)
            checkpoint = folder.latest_checkpoint()
            step = int(checkpoint.name.removeprefix("step-"))
            resume_at.append(step)
            written_past.append(sum(r.step >= step for r in folder.read_metrics()))
            resumed = [f"run.resume={json.dumps(str(checkpoint))}"]
        with trio.fail_after(120):
            _, summary = await run_in_process(sim(*base, *resumed), folder.path)
    assert summary.state == "stopped", summary.error
    assert resume_at == sorted(resume_at) and resume_at[-1] > 0
    assert sum(written_past) > 0, "no session trained past its checkpoint: nothing was cut"
    assert caplog.text.count("[controller] record cut to step") \
        + caplog.text.count("[controller] record kept whole") == 3

    rows = folder.read_metrics()
    assert [r.step for r in rows] == list(range(steps))
    assert all(a.time_s <= b.time_s for a, b in zip(rows, rows[1:])), [r.time_s for r in rows]
    assert all(r.samples == batch * 4 for r in rows)

    for reader, points in tensorboard_steps(folder, "reward_mean").items():
        assert [s for s, _ in points] == list(range(steps)), reader
        assert [v for _, v in points] == pytest.approx([r.reward_mean for r in rows], rel=1e-6), reader

    trained = trained_groups(folder.path)
    assert [s for s, _, _ in trained] == [s for s in range(steps) for _ in range(batch)]
    assert sorted(g for _, g, _ in trained) == list(range(steps * batch))

    for name in timeline.names(folder):
        trace = timeline.read(folder, name)
        keys = [(life["run_id"], life["incarnation"], life["start"]) for life in trace["lives"]]
        assert len(keys) == len(set(keys)) == 4, (name, trace["lives"])
        times = [t for t, _ in trace["events"]]
        assert times == sorted(times), name
        assert [state for _, state in trace["events"]].count(timeline.DOWN) == 4, name
        ended = [life["ended"] for life in trace["lives"]]
        assert ended == (["unknown"] * 3 + ["shutdown"] if name == "trainer-0" else ["shutdown"] * 4), (name, ended)

    result = audit(folder.path)
    assert (result.lost, result.duplicated, result.trained) == (0, 0, steps * batch), result
    resumes = [line for line in folder.ledger.read_text().splitlines() if '"resumed"' in line]
    assert [json.loads(line)["step"] for line in resumes] == resume_at

    whole = folder.read_summary()
    assert (whole.steps, whole.samples, whole.tokens) == (steps, sum(r.samples for r in rows),
                                                          sum(r.tokens for r in rows))
    assert whole.groups.trained == steps * batch and whole.sessions == 4
    last = whole.session
    assert last.first_step == resume_at[-1] and last.steps == steps - resume_at[-1]
    assert last.samples == sum(r.samples for r in rows[resume_at[-1]:])
    assert last.groups_trained == (steps - resume_at[-1]) * batch
    assert rows[-1].time_s <= whole.wall_time_s
    assert whole.wall_time_s - last.wall_time_s == pytest.approx(rows[resume_at[-1] - 1].time_s, abs=1e-3)
    assert math.isclose(whole.samples_per_s, whole.samples / whole.wall_time_s, rel_tol=1e-3)


def test_a_summary_written_before_sessions_were_told_apart_still_reads():
    from rlflow.rundir import Summary

    old = b'{"run_id": "r", "state": "stopped", "steps": 20, "samples": 1280, "wall_time_s": 12.5}'
    summary = msgspec.json.decode(old, type=Summary)
    assert (summary.steps, summary.samples, summary.sessions, summary.session) == (20, 1280, 1, None)


def test_an_undefined_metric_is_left_out_of_its_row_and_a_row_that_does_not_read_is_named(tmp_path):
    """JSON has no NaN: a step whose metric is undefined (the critic's
    explained variance over returns that do not vary) is written without it,
    and reads back; a whole line that is not a row is an error naming the
    file and the line, not taken for a line being written."""
    from rlflow.control.metrics import JsonlSink
    from rlflow.control.stats import RunStats
    from rlflow.protocol import StepDone

    folder = RunDir(tmp_path)
    stats, sink = RunStats(["trainer"]), JsonlSink(folder)
    for step, explained in enumerate([0.5, math.nan, -math.inf]):
        sink.write(stats.close_step(StepDone(step=step, version=step + 1, acked=[],
                                             metrics={"critic_explained_var": explained, "loss": 0.1}), 1.0, 0))
    rows = folder.read_metrics()
    assert [r.step for r in rows] == [0, 1, 2]
    assert [r.train.get("critic_explained_var") for r in rows] == [0.5, None, None]
    assert [r.train["loss"] for r in rows] == [0.1] * 3

    with open(folder.metrics, "ab") as f:
        f.write(b'{"step": 3, "version": 4, "train": {"critic_explained_var": null}}\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl, line 4: not a StepRow"):
        folder.read_metrics()
