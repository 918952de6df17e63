"""The controller on its own, without Ray: its ledger, its weight rounds and
statistics as plain code, and the async shell with real services on real
sockets started in this process."""

from __future__ import annotations

import json
import math
import pathlib
import re
import socket
import statistics
import subprocess
import sys

import msgspec
import pytest
import rich.console
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from rlflow import config as C
from rlflow.control.controller import Controller, heartbeat_s
from rlflow.control.ledger import NO_SIGNAL, POISON, GroupLedger, GroupState, min_version
from rlflow.control.rounds import WeightRounds
from rlflow.control.stats import RunStats
from rlflow.errors import RunFailed
from rlflow.protocol import Heartbeat, Stage, StepDone, split
from rlflow.rundir import RunDir
from rlflow.startup import ServiceSpec
from rlflow.runstate import run_state

ROOT = pathlib.Path(__file__).resolve().parent.parent
SIM = ROOT / "examples" / "sim.toml"


# -- the ledger -----------------------------------------------------------------------


def test_the_first_grant_fills_the_staleness_bound_and_no_more():
    for k in (0, 1, 2, 4):
        ledger = GroupLedger(batch_size=4, max_staleness=k, steps=100)
        granted = ledger.grant({0: 1000}, version=0)[0]
        assert [g.group_id for g in granted] == list(range(4 * (k + 1)))
        assert all(g.min_version == max(0, g.group_id // 4 - k) for g in granted)
        assert ledger.grant({0: 1000}, version=0) == {}


def test_a_run_that_drops_batch_after_batch_and_never_trains_fails_naming_why():
    """Four batches' worth of groups dropped (for want of signal aside) with no step trained in
    between fail the run, naming the reasons and the last drop's detail."""
    ledger = GroupLedger(batch_size=2, max_staleness=10, steps=100)
    assert len(ledger.grant({0: 100}, 0)[0]) == 22
    ledger.drop([0], NO_SIGNAL)  # the signal filter's work, not a fault: never counted
    ledger.drop([1, 2, 3], "abandoned")
    ledger.generated(0, [4, 5])
    ledger.trained(0, [4, 5])  # a step trained: the count starts again
    ledger.drop([6, 7], "abandoned")
    ledger.drop([8, 9, 10], "reward failed", ["timeout", "timeout", "the function raised"])
    ledger.drop([11, 12], POISON, ["granted 3 times"] * 2)
    with pytest.raises(RunFailed) as failed:
        ledger.drop([13], POISON, ["rollout-0: its engine died"])
    assert str(failed.value) == (
        "8 groups dropped (3 reward failed, 3 poison, 2 abandoned) since step 0: the run cannot train; the last: "
        "rollout-0: its engine died (see the roles' logs)"
    )


def test_sync_is_a_barrier_one_step_at_a_time():
    ledger = GroupLedger(batch_size=2, max_staleness=0, steps=3)
    assert [g.group_id for g in ledger.grant({0: 10}, 0)[0]] == [0, 1]
    ledger.generated(0, [0, 1])
    ledger.trained(0, [0, 1])
    (groups,) = ledger.grant({0: 10}, 1).values()
    assert [(g.group_id, g.min_version) for g in groups] == [(2, 1), (3, 1)]


def test_no_more_groups_than_the_run_needs():
    ledger = GroupLedger(batch_size=4, max_staleness=2, steps=2)
    assert len(ledger.grant({0: 100}, 0)[0]) == 8


def test_room_is_shared_least_loaded_first_and_never_exceeded():
    ledger = GroupLedger(batch_size=8, max_staleness=2, steps=100)
    granted = ledger.grant({0: 4, 1: 8}, 0)
    assert len(granted[0]) == 4 and len(granted[1]) == 8
    assert ledger.holders() == {0: 4, 1: 8}
    ledger.generated(1, [g.group_id for g in granted[1][:2]])
    again = ledger.grant({0: 4, 1: 8}, 0)
    assert list(again) == [1] and len(again[1]) == 2


def test_an_expired_group_is_granted_again_first_on_weights_the_bound_allows():
    ledger = GroupLedger(batch_size=2, max_staleness=1, steps=100)
    ledger.grant({0: 100}, 0)
    ledger.generated(0, [0, 1, 2, 3])
    ledger.trained(0, [0, 1])
    ledger.trained(1, [2])
    assert ledger.expired([3, 3, 0]) == [3]  # 0 is trained: never again; one 3 is enough
    (regrant,) = ledger.grant({0: 1}, version=5).values()
    assert [(g.group_id, g.min_version, g.grants) for g in regrant] == [(3, 4, 2)]
    assert ledger.reissued == 1


def test_a_lost_replica_gives_back_what_it_held_and_what_did_not_reach_the_trainer():
    ledger = GroupLedger(batch_size=4, max_staleness=1, steps=100)
    granted = ledger.grant({0: 3, 1: 3}, 0)
    mine = [g.group_id for g in granted[1]]
    ledger.generated(1, mine[:2])  # these left the replica...
    ledger.received(mine[:1])  # ... and this one reached the trainer
    assert sorted(ledger.lost(1)) == sorted(mine[1:])  # the second may have died in its socket
    assert all(ledger.groups[g].state is GroupState.QUEUED for g in mine[1:])
    assert ledger.groups[mine[0]].state is GroupState.RECEIVED
    others = [g.group_id for g in granted[0]]
    ledger.generated(0, others)
    assert sorted(ledger.lost_downstream("reward-0")) == sorted(others)  # on their way: who knows where
    events = [e.event for e in ledger.drain()]
    assert events == ["issued", "issued", "generated", "received", "requeued", "generated", "requeued"]


def test_an_ack_from_the_wrong_replica_changes_nothing():
    ledger = GroupLedger(batch_size=2, max_staleness=0, steps=10)
    ledger.grant({0: 1, 1: 1}, 0)
    owner = ledger.groups[0].owner
    ledger.generated(1 - owner, [0])
    assert ledger.groups[0].state is GroupState.GENERATING


def test_restore_queues_every_untrained_group_again_and_keeps_the_clock():
    ledger = GroupLedger(batch_size=2, max_staleness=1, steps=10)
    ledger.grant({0: 100}, 0)
    ledger.generated(0, [0, 1, 2])
    ledger.trained(0, [0, 1])
    state = msgspec.json.decode(msgspec.json.encode(ledger.snapshot()), type=type(ledger.snapshot()))
    back = GroupLedger.restore(state, batch_size=2, max_staleness=1, steps=10)
    assert back.steps_done == 1 and back.next_group == 4
    assert back.counts() == {"queued": 2, "generating": 0, "downstream": 0, "received": 0}
    granted = back.grant({0: 100}, version=1)[0]
    # The untrained ones first, then new ones up to the bound of step 1.
    assert [g.group_id for g in granted] == [2, 3, 4, 5]
    # Groups 2-3 belong to step 1, 4-5 to step 2: with max_staleness 1 they may start on v0 and v1.
    assert [g.min_version for g in granted] == [0, 0, 1, 1]


@settings(max_examples=200)
@given(
    st.integers(1, 4),
    st.integers(0, 3),
    st.lists(st.tuples(st.sampled_from(["grant", "generate", "train", "expire", "lose", "no_signal", "pace"]),
                       st.integers(0, 2)), max_size=60),
)
def test_the_ledger_keeps_its_promises_whatever_happens(batch, k, ops):
    """Random grants, acks, steps, expiries, lost replicas, groups dropped for want of signal
    and paced credits: no group exists beyond the bound (the over-granting for groups without
    signal aside), starts on weights older than its step allows, is held by two replicas, or
    comes back after it was trained on."""
    steps = 6
    ledger = GroupLedger(batch, k, steps)
    trained: set[int] = set()
    version = 0
    for op, rank in ops:
        if op == "grant":
            for owner, groups in ledger.grant({0: 3, 1: 3, 2: 3}, version).items():
                for g in groups:
                    assert g.group_id not in trained
                    # No older than the step it fills allows (a group that takes a dropped
                    # one's place fills a step open now, not its id's).
                    step = min(g.group_id // batch, ledger.steps_done + k)
                    assert g.min_version >= min_version(step * batch, batch, k)
                    assert g.min_version >= version - k
                    assert g.owner == owner
        elif op == "generate":
            ledger.generated(rank, [g.group_id for g in ledger.groups.values() if g.owner == rank])
        elif op == "train":
            ready = sorted(g.group_id for g in ledger.groups.values() if g.state is GroupState.DOWNSTREAM)[:batch]
            if len(ready) == batch and ledger.steps_done < steps:
                ledger.trained(ledger.steps_done, ready)
                trained.update(ready)
                version += 1
        elif op == "expire":
            ledger.expired([g for g in list(ledger.groups)[:1]])
        elif op == "no_signal":
            ledger.drop([g.group_id for g in ledger.groups.values() if g.state is GroupState.DOWNSTREAM][:1], NO_SIGNAL)
        elif op == "pace":
            ledger.pace(0.5 * rank)
            assert min(1, k) <= ledger.lead <= k
        else:
            ledger.lost(rank)
        if not ledger.dropped[NO_SIGNAL]:
            assert ledger.next_group <= ledger.limit + batch * (k - ledger.lead)  # a lead lowered since
        assert not trained & set(ledger.groups)
        assert all(ledger.holders()[r] <= 3 for r in range(3))
        assert all(g.strikes < ledger.max_grants for g in ledger.groups.values())
        assert set(ledger.dropped) <= {POISON, NO_SIGNAL}  # as poison, or by the trainer
        # Nothing lost: every group made is trained, still in the ledger, or dropped with its reason.
        assert len(trained) + len(ledger.groups) + sum(ledger.dropped.values()) == ledger.next_group


# -- weight rounds ------------------------------------------------------------------------


def test_one_version_moves_at_a_time_and_the_newest_waiting_one_goes_next():
    rounds = WeightRounds()
    assert rounds.publish(1) == 1
    assert rounds.publish(2) is None and rounds.publish(3) is None  # 1 is still moving
    assert rounds.loaded(0, 1, {0, 1}) is None
    assert rounds.loaded(1, 1, {0, 1}) == 3  # 2 is skipped
    assert rounds.loaded(0, 3, {0, 1}) is None
    assert rounds.left({0}) is None  # replica 1 is gone: 0 has it, the round is complete
    assert not rounds.busy


def test_a_receiver_that_got_a_newer_version_than_the_one_moving_completes_the_round():
    rounds = WeightRounds()
    assert rounds.publish(1) == 1
    assert rounds.publish(2) is None
    # The weight server had 2 by the time replica 0 fetched: it holds 2.
    assert rounds.loaded(0, 2, {0}) == 2
    assert rounds.loaded(0, 2, {0}) is None and not rounds.busy  # it says it holds 2 (see the rollout service)


def test_a_round_counts_receivers_that_got_the_version_moving_or_a_newer_one():
    rounds = WeightRounds()
    assert rounds.publish(1) == 1
    assert rounds.publish(2) is None
    assert rounds.loaded(0, 2, {0, 1}) is None  # it pulled the newest there was
    assert rounds.loaded(1, 1, {0, 1}) == 2


def test_a_round_completes_without_a_receiver_that_left():
    rounds = WeightRounds(version=4)
    assert rounds.publish(4) is None  # every receiver holds it already
    assert rounds.publish(5) == 5
    rounds.loaded(0, 5, {0, 1})
    assert rounds.moving == 5
    assert rounds.left({0}) is None and rounds.moving is None


def test_a_held_round_lets_the_one_moving_end_and_starts_the_newest_once_released():
    """An evaluation holds the rounds: the version moving completes, none starts until it is released."""
    rounds = WeightRounds()
    assert rounds.publish(1) == 1
    rounds.hold()
    assert rounds.publish(2) is None and rounds.publish(3) is None
    assert rounds.loaded(0, 1, {0}) is None and not rounds.busy and rounds.moved == 1  # 1 is what is evaluated
    assert rounds.release() == 3 and rounds.busy
    rounds.hold()
    assert rounds.release() is None  # nothing waited


# -- statistics ---------------------------------------------------------------------------


def beat(seq: int, busy: float, starved: float) -> Heartbeat:
    return Heartbeat(seq=seq, version=0, busy_s=busy, starved_s=starved)


def test_getters_have_no_side_effects_and_a_step_closes_its_window():
    stats = RunStats(["rollout", "trainer"])
    stats.heartbeat("trainer", 0, beat(0, 0.0, 0.0))
    stats.heartbeat("trainer", 0, beat(1, 1.0, 3.0))
    before = stats.window(), stats.whole_run()
    assert (stats.window(), stats.whole_run()) == before  # asking twice changes nothing
    row = stats.close_step(StepDone(step=0, version=1, acked=[], metrics={"samples": 8.0, "loss": 0.5}), 4.0, 10)
    assert row.roles["trainer"].busy == pytest.approx(0.25) and row.samples == 8 and row.train == {"loss": 0.5}
    stats.heartbeat("trainer", 0, beat(2, 3.0, 3.0))
    row = stats.close_step(StepDone(step=1, version=2, acked=[], metrics={}), 6.0, 20)
    assert row.roles["trainer"].busy == pytest.approx(1.0)  # only what happened since the last step
    assert stats.whole_run()["trainer"].busy == pytest.approx(0.5)
    assert stats.summary(6.0, run_id="r", state="stopped").samples == 8


def test_message_latency_quantiles_come_from_a_histogram_of_fixed_size():
    from rlflow.control.stats import Latency

    latency = Latency()
    assert latency.quantile(0.99) == 0.0
    size = len(latency.counts)
    for i in range(100_000):
        latency.add(1e-4 if i % 100 else 0.02)  # 0.1 ms, and one in a hundred 20 ms
    latency.add(120.0)  # beyond the last bucket: counted there
    assert len(latency.counts) == size and latency.n == 100_001
    assert 1e-4 <= latency.quantile(0.5) <= 1.26e-4
    assert 1e-4 <= latency.quantile(0.989) <= 1.26e-4 and 0.02 <= latency.quantile(0.995) <= 0.0252
    assert latency.quantile(1.0) == latency.max == 120.0


def test_the_summary_is_summed_as_steps_come_and_the_controller_keeps_no_row_but_the_last():
    """The summary's figures are those of the rows (written to metrics.jsonl, not kept), and what the
    statistics hold grows by less than 10 bytes a step from step 200 to 2,000 (a few KB of allocator
    noise; keeping the rows held 875 bytes a step)."""
    import tracemalloc

    from rlflow.protocol import EngineLoad

    stats = RunStats(["rollout", "trainer"])

    def steps(first: int, count: int) -> int:
        """Steps `first`... closed (their rows let go, as the controller lets them go once written);
        the bytes of those rows."""
        written = 0
        for step in range(first, first + count):
            metrics = {"samples": 8.0 + step % 3, "tokens": 100.0 + step, "staleness_mean": step % 2,
                       "staleness_max": step % 4, "reward_mean": math.nan if step % 5 == 0 else step % 7 / 7,
                       "kl_teacher": 0.1 * (step % 10)}
            stats.heartbeat("rollout", 0, Heartbeat(seq=step, version=step, busy_s=step, engine=EngineLoad(
                slots=16, running=step % 9, waiting=step % 4, kv_cache_usage=(step % 10) / 10,
                preemptions=step // 50)))
            row = stats.close_step(StepDone(step=step, version=step + 1, acked=[], metrics=metrics), float(step), 0)
            written += len(msgspec.json.encode(row))
        return written

    def held() -> int:
        """Bytes still held that were allocated under the statistics' code."""
        mine = tracemalloc.Filter(True, "*/rlflow/control/stats.py", all_frames=True)
        return sum(stat.size for stat in tracemalloc.take_snapshot().filter_traces([mine]).statistics("filename"))

    tracemalloc.start(16)
    steps(0, 200)
    before = held()
    written = steps(200, 1800)
    after = held()
    tracemalloc.stop()
    assert after - before < 10 * 1800, (after - before, written)  # under 10 bytes a step (the rows: 457)
    summary = stats.summary(100.0, run_id="r", state="stopped")
    assert summary.samples == sum(8 + step % 3 for step in range(2000))
    assert summary.tokens == sum(100 + step for step in range(2000))
    assert summary.staleness_max == 3 and summary.staleness_mean == pytest.approx(0.5)
    rewards = [step % 7 / 7 for step in range(2000) if step % 5]
    assert summary.reward_mean == pytest.approx(sum(rewards) / len(rewards), abs=1e-6)
    assert summary.session.steps == 2000 and summary.samples_per_s == pytest.approx(summary.samples / 100.0, abs=1e-3)
    assert stats.last_row.step == 1999 and stats.trends()["kl_teacher"].steps == 10


def test_the_gain_is_in_points():
    from rlflow.rundir import EvalRow

    stats = RunStats(["rollout"])
    for step, accuracy in ((0, 0.40), (30, 0.55), (60, 0.60), (90, 0.65)):
        stats.evaluated(EvalRow(step=step, version=step, version_end=step, seconds=1.0, metrics={"accuracy": accuracy}))
    summary = stats.summary(1.0, run_id="r", state="stopped")
    assert summary.accuracy_last3_mean == pytest.approx(0.60)
    assert summary.gain_points == pytest.approx(20.0)


def test_the_kl_to_the_teacher_is_shown_with_its_trend(tmp_path):
    """The status, the live table and the log line say where the KL is going;
    the curves get a panel for it."""
    from rlflow.rundir import RunDir, Status
    from rlflow.tools.cli import progress_line
    from rlflow.tools.display import render
    from rlflow.tools.report import load, write_curves

    stats = RunStats(["trainer"])
    assert stats.trends() == {}
    rows = []
    for step in range(25):  # 1.0 for 8 steps, then 0.5; one step without a teacher's figure
        metrics = {} if step == 3 else {"kl_teacher": 1.0 if step < 8 else 0.5}
        metrics["critic_value_loss"] = 0.1  # a role's own statistics (`RoleSpec.curves`) get a panel too
        rows.append(stats.close_step(StepDone(step=step, version=step + 1, acked=[], metrics=metrics), float(step), 0))
    trend = stats.trends()["kl_teacher"]
    assert (trend.last, trend.mean, trend.steps) == (0.5, 0.5, 10)
    assert trend.change == pytest.approx(0.5 - (3 * 1.0 + 7 * 0.5) / 10)  # steps 15-24 against 5-14
    status = Status(run_id="r", state="running", trends=stats.trends())
    assert "kl_teacher 0.500 (10-step mean 0.500, -0.150)" in progress_line(status)
    console = rich.console.Console(record=True, width=200)
    console.print(render(status))
    assert "kl_teacher 0.500" in console.export_text()
    folder = RunDir(tmp_path)
    folder.metrics.write_text("".join(msgspec.json.encode(row).decode() + "\n" for row in rows))
    png = write_curves(load(tmp_path), tmp_path / "curves.png")
    import matplotlib.image

    assert matplotlib.image.imread(png).shape[1] > 3 * 4.2 * 110  # reward, staleness, the critic's, the KL


# -- the shell, with real services in this process ----------------------------------------


class InProcessLauncher:
    """Starts each service of the config as a trio task of this process
    (real sockets, real services, simulated engines; no Ray). `crash` ends a
    replica's task at once, as a SIGKILL would (no bye); `restart` starts its
    next incarnation; `services` holds each replica's service object (to
    make one hang)."""

    def __init__(self, config: C.Config, run_id: str, secret: str, token: trio.lowlevel.TrioToken, run_dir: str = ""):
        self.config, self.run_id, self.secret, self.token, self.run_dir = config, run_id, secret, token, run_dir
        self.nursery: trio.Nursery | None = None
        self.controller = ""
        self.scopes: dict[tuple[str, int], trio.CancelScope] = {}
        self.incarnations: dict[tuple[str, int], int] = {}
        self.services: dict[tuple[str, int], object] = {}
        self.ended: list = []
        #: role -> incarnations from which restarts of it start nothing (a replacement that never comes up).
        self.dud_from: dict[str, int] = {}

    def start(self, controller_address: str) -> None:
        self.controller = controller_address
        for role, cfg in self.config.launched_roles():
            for rank in range(cfg.replicas):
                trio.from_thread.run_sync(self._start, role, rank, 0, trio_token=self.token)

    def _start(self, role: str, rank: int, incarnation: int) -> None:
        from rlflow.services import service_class

        cfg = dict(self.config.role_items())[role]
        spec = ServiceSpec(role=role, rank=rank, replicas=cfg.replicas, run_id=self.run_id, controller=self.controller,
                           config=self.config, secret=self.secret, incarnation=incarnation, run_dir=self.run_dir)
        scope = self.scopes[(role, rank)] = trio.CancelScope()
        self.incarnations[(role, rank)] = incarnation
        if incarnation >= self.dud_from.get(role, 1 << 30):
            return
        service = self.services[(role, rank)] = service_class(role)(spec)

        async def run() -> None:
            # Outside the scope: a kill (the scope cancelled) that meets the service's own error (told it
            # was replaced) leaves that error once the scope has taken its Cancelled out.
            try:
                with scope:
                    await service.run()
            except Exception as exc:  # as a process would: it dies, and the launcher says so
                self.ended.append((f"died: {type(exc).__name__}: {exc}", role, rank, incarnation))

        self.nursery.start_soon(run)

    def _end(self, role: str, rank: int, why: str) -> None:
        self.scopes[(role, rank)].cancel()
        self.ended.append((why, role, rank, self.incarnations[(role, rank)]))

    async def crash(self, role: str, rank: int) -> None:
        """Kill a replica from the test (as a SIGKILL would)."""
        self._end(role, rank, "died: killed")
        await trio.sleep(0)

    def kill(self, role: str, rank: int) -> None:
        """The controller ends a replica (one that hangs)."""
        trio.from_thread.run_sync(self._end, role, rank, "died: killed by the controller", trio_token=self.token)

    def failures(self) -> list:
        from rlflow.control.placement import Failure

        out = [Failure(role, rank, incarnation, message) for message, role, rank, incarnation in self.ended]
        self.ended.clear()
        return out

    def restart(self, role: str, rank: int, incarnation: int) -> None:
        trio.from_thread.run_sync(self._start, role, rank, incarnation, trio_token=self.token)


async def run_in_process(config: C.Config, run_dir: pathlib.Path, during=None) -> tuple[Controller, object]:
    """Run `config` with its services in this process; `during(controller,
    launcher)` runs alongside (e.g. to kill replicas)."""
    try:
        return await _run_in_process(config, run_dir, during)
    except BaseExceptionGroup as group:  # the run's own error, as `run` raises it
        failed = group.subgroup(RunFailed)
        while isinstance(failed, BaseExceptionGroup) and len(failed.exceptions) == 1:
            failed = failed.exceptions[0]
        if isinstance(failed, RunFailed):
            raise failed from group
        raise


async def _run_in_process(config: C.Config, run_dir: pathlib.Path, during) -> tuple[Controller, object]:
    async with trio.open_nursery() as nursery:
        launcher = InProcessLauncher(config, "test", "s3cret", trio.lowlevel.current_trio_token(), str(run_dir))
        launcher.nursery = nursery
        controller = Controller(config, run_dir, "test", launcher, secret="s3cret")
        if during is not None:
            nursery.start_soon(during, controller, launcher)
        summary = await controller.run()
        nursery.cancel_scope.cancel()
    return controller, summary


def sim(*overrides: str) -> C.Config:
    fast = ["cluster.heartbeat_s=0.1", "roles.trainer.engine.weights_bytes=65536", "run.batch_size=4",
            "run.samples_per_prompt=4", "cluster.restart_backoff_s=0.05"]
    return C.load(SIM, [*fast, *overrides])


async def test_a_run_in_process_trains_every_group_once_within_the_bound(tmp_path):
    with trio.fail_after(60):
        controller, summary = await run_in_process(sim("run.steps=6"), tmp_path)
    assert summary.state == "stopped" and summary.steps == 6
    assert summary.groups.trained == 24 and summary.groups.reissued == 0
    rows = RunDir(tmp_path).read_metrics()
    assert [r.step for r in rows] == list(range(6)) and all(r.samples == 16 for r in rows)
    assert controller.ledger.next_group <= 4 * (6 + 2)
    status = RunDir(tmp_path).read_status()
    assert status.roles["reward"].version is None and status.roles["reward"].behind is None
    assert status.roles["rollout"].behind is not None


@pytest.mark.parametrize("shm", ["auto", "off"])
@pytest.mark.slow  # a run of every service
async def test_services_of_one_machine_pass_large_tensors_through_shared_memory_unless_told_not_to(tmp_path, shm):
    """Every service here can map every other's memory (one process), so with
    a threshold that a batch's token columns pass, they go through shared
    memory from each stage to the next, and the weights from the trainer's
    server; the run trains the same either way."""
    overrides = ["run.steps=3", "run.samples_per_prompt=8", "roles.rollout.engine.response_len.median=256",
                 "cluster.shm_min_bytes=4096", f"cluster.shm={shm}"]
    with trio.fail_after(120):
        controller, summary = await run_in_process(sim(*overrides), tmp_path)
    assert summary.state == "stopped" and summary.steps == 3
    assert summary.groups.trained == 12 and summary.groups.reissued == 0
    status = RunDir(tmp_path).read_status()
    # The trainer's: the weights it served (64 KiB per update here).
    shared = {role: status.roles[role].counters.bytes_shared
              for role in ("rollout", "reward", "teacher", "trainer")}
    if shm == "auto":
        assert all(n > 0 for n in shared.values()), shared
    else:
        assert shared == dict.fromkeys(shared, 0)
    rejected = {role: s.counters.rejected for role, s in status.roles.items()}
    assert rejected == dict.fromkeys(status.roles, {})


async def test_a_resumed_ledger_grants_the_untrained_groups_first(tmp_path):
    """The controller's part of a resume: the groups granted before the
    checkpoint and not trained on are granted again, none skipped."""
    from rlflow.control.steps import ControllerState

    ledger = GroupLedger(4, 2, 100)
    ledger.grant({0: 100}, 0)
    ledger.generated(0, list(range(12)))
    for step in range(2):
        ledger.trained(step, list(range(4 * step, 4 * step + 4)))
    checkpoint = tmp_path / "checkpoint"
    checkpoint.mkdir()
    (checkpoint / "controller_state.json").write_bytes(
        msgspec.json.encode(ControllerState(step=2, version=2, ledger=ledger.snapshot()))
    )
    config = sim("run.steps=4", f"run.resume={json.dumps(str(checkpoint))}")
    with trio.fail_after(60):
        _, summary = await run_in_process(config, tmp_path / "run")
    assert summary.state == "stopped" and summary.steps == 4
    assert [r.step for r in RunDir(tmp_path / "run").read_metrics()] == [2, 3]
    # The whole run's groups (the two steps before the checkpoint, then these two), and this session's.
    assert summary.groups.trained == 16 and summary.session.groups_trained == 8 and summary.groups.reissued == 0


class BrokenLauncher:
    """A launcher whose cluster has gone away."""

    def start(self, controller_address: str) -> None:
        raise RuntimeError("the cluster went away")

    def failures(self) -> list[str]:
        return []


async def test_a_controller_that_fails_says_so_in_status_and_summary(tmp_path):
    controller = Controller(C.load(SIM), tmp_path, "run-x", BrokenLauncher(), secret="s")
    with pytest.raises(RunFailed, match="RuntimeError: the cluster went away"):
        with trio.fail_after(30):
            await controller.run()
    folder = RunDir(tmp_path)
    for record in (folder.read_status(), folder.read_summary()):
        assert record.state == "failed"
        assert "RuntimeError: the cluster went away" in record.error
    assert folder.controller.stat().st_mode & 0o077 == 0  # it holds the run's secret


def test_status_of_a_run_whose_controller_is_gone_says_dead(tmp_path):
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait(timeout=30)
    status = {"run_id": "r", "state": "running", "pid": gone.pid, "host": socket.gethostname()}
    (tmp_path / "status.json").write_text(json.dumps(status))
    read = run_state(RunDir(tmp_path)).status
    assert read.state == "dead"
    assert f"pid {gone.pid}" in read.error
    done = subprocess.run(
        [sys.executable, "-m", "rlflow", "status", str(tmp_path), "--once"], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0 and "dead" in done.stdout


class IdleLauncher:
    """Starts nothing: the controller waits for hellos that never come."""

    def start(self, controller_address: str) -> None:
        """Nothing to start."""

    def failures(self) -> list[str]:
        return []


async def test_a_peer_that_may_not_join_is_told_why_on_the_wire(tmp_path):
    from rlflow.data import transport
    from rlflow.protocol import SCHEMA_VERSION, Codec, ErrorReport, Hello, Role

    controller = Controller(C.load(SIM), tmp_path, "run-x", IdleLauncher(), secret="s3cret")

    def hello(rank: int = 0, **fields) -> Hello:
        return Hello(role=Role.REWARD, rank=rank, replicas=1, schema_version=SCHEMA_VERSION, **fields)

    async def answer(frames: list) -> ErrorReport:
        async with transport.open_dealer(connect=controller.address) as dealer:
            await dealer.send_frames(frames)
            return await dealer.recv()

    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(controller.run)
            while controller.address is None:
                await trio.sleep(0.01)
            codec = Codec()
            refused = await answer(codec.encode(hello(secret="guess")))
            assert (refused.fatal, refused.kind) == (True, "unauthenticated")
            refused = await answer(codec.encode(hello(secret="s3cret", rank=5)))
            assert refused.kind == "unexpected_hello" and "reward-5" in refused.message
            newer = Codec(schema_version=SCHEMA_VERSION + 1).encode(hello(secret="s3cret"))
            refused = await answer(newer)
            assert refused.kind == "wrong_version"
            assert f"schema version {SCHEMA_VERSION + 1}, this peer speaks {SCHEMA_VERSION}" in refused.message
            nursery.cancel_scope.cancel()
    assert controller.door.ignored == {"unauthenticated": 1, "unexpected_hello": 1, "wrong_version": 1}


def test_a_dropped_group_is_gone_for_good_and_makes_room_for_a_new_one():
    ledger = GroupLedger(batch_size=2, max_staleness=0, steps=10)
    assert [g.group_id for g in ledger.grant({0: 10}, 0)[0]] == [0, 1]
    ledger.generated(0, [0, 1])
    assert ledger.drop([1, 1, 7], "reward function 'math': timeout") == [1]
    assert ledger.dropped == {"reward function 'math': timeout": 1}
    assert [g.group_id for g in ledger.grant({0: 10}, 0)[0]] == [2]  # the bound of step 0, less the dropped one
    assert ledger.expired([1]) == []  # never granted again
    state = ledger.snapshot()
    assert GroupLedger.restore(state, 2, 0, 10).dropped == {"reward function 'math': timeout": 1}


def test_a_group_lost_with_the_crowd_gets_its_last_grant_alone_and_the_others_go_on():
    """Replicas that die for reasons of their own take their groups with them: groups lost twice so
    are granted a third time each alone (to a replica that holds none, and takes no other while it
    holds it), while the other replicas go on taking groups; then they are trained, not poison."""
    ledger = GroupLedger(batch_size=8, max_staleness=1, steps=10)
    room = dict.fromkeys(range(6), 2)
    first = ledger.grant(room, 0)
    assert [g.group_id for g in first[0]] == [0, 6]
    for _ in range(2):  # replica 0 dies twice holding groups 0 and 6
        assert ledger.lost(0) == [0, 6]
        if ledger.groups[0].grants == 1:
            assert [g.group_id for g in ledger.grant(room, 0)[0]] == [0, 6]
    ledger.generated(3, [3, 9])
    ledger.generated(4, [4, 10])
    granted = {rank: [g.group_id for g in groups] for rank, groups in ledger.grant(room, 0).items()}
    assert granted == {0: [0], 3: [6], 4: [12, 13]}
    assert ledger.groups[0].alone and ledger.groups[6].alone and not ledger.groups[12].alone
    ledger.generated(1, [1, 7])
    # Replicas 0 and 3 hold a last grant: they take nothing more, though they have room.
    assert {rank: [g.group_id for g in groups] for rank, groups in ledger.grant(room, 0).items()} == {1: [14, 15]}
    ledger.generated(0, [0])
    ledger.generated(3, [6])
    ledger.received(list(range(8)))
    ledger.trained(0, list(range(8)))
    assert ledger.dropped == {} and ledger.trained_count == 8


def test_a_group_lost_after_it_was_generated_has_not_failed():
    """Deaths downstream of the rollout (a reward or teacher replica), or of the rollout replica after it
    sent the group, queue it again without a strike: never poison, never held back for a try alone."""
    ledger = GroupLedger(batch_size=2, max_staleness=0, steps=10, max_grants=2)
    for _ in range(5):
        (group, *_), = ledger.grant({0: 4}, 0).values()
        ledger.generated(0, [0, 1])
        assert 0 in (ledger.lost_downstream("reward-0") if group.grants % 2 else ledger.lost(0))
    assert ledger.dropped == {} and ledger.groups[0].grants == 5 and ledger.groups[0].strikes == 0
    assert not ledger.groups[0].alone


def test_a_late_copy_of_a_recent_drop_undoes_it_and_the_ledger_forgets_old_drops():
    from rlflow.control.ledger import DROPS_KEPT

    ledger = GroupLedger(batch_size=2, max_staleness=0, steps=10**6)
    step = 0
    for step in range(3 * DROPS_KEPT):  # every step: one group dropped, its place taken by the next
        ids = [g.group_id for g in ledger.grant({0: 10}, step)[0]]
        ledger.generated(0, ids)
        ledger.drop(ids[:1], "timeout")
        ids += [g.group_id for g in ledger.grant({0: 10}, step)[0]]
        ledger.generated(0, ids[1:])
        ledger.received(ids[1:])
        ledger.trained(step, ids[1:])
        ledger.journal.clear()
    assert ledger.dropped == {"timeout": 3 * DROPS_KEPT} and not ledger.groups
    assert len(ledger._drop_reasons) <= DROPS_KEPT * 2  # a long run's drops do not pile up
    latest = next(reversed(ledger._drop_reasons))
    ledger.received([latest])  # a copy of the latest drop arrives after all: it counts as not dropped
    assert ledger.dropped == {"timeout": 3 * DROPS_KEPT - 1} and latest in ledger.groups


def test_groups_without_signal_are_replaced_and_the_missing_ones_over_granted_by_their_share():
    ledger = GroupLedger(batch_size=4, max_staleness=0, steps=10)
    assert [g.group_id for g in ledger.grant({0: 100}, 0)[0]] == [0, 1, 2, 3]
    ledger.generated(0, [0, 1, 2, 3])
    ledger.received([0, 1])
    assert ledger.drop([2, 3], NO_SIGNAL) == [2, 3] and ledger.no_signal_share == 0.5
    # Two replacements, and as many again: at a share of 1/2, four groups to bring the two still missing.
    assert [(g.group_id, g.min_version) for g in ledger.grant({0: 100}, 0)[0]] == [(4, 0), (5, 0), (6, 0), (7, 0)]
    ledger.generated(0, [4, 5, 6, 7])
    ledger.received([4, 5])  # the step is whole: nothing more is granted for it, whatever the share
    assert ledger.grant({0: 100}, 0) == {}
    ledger.trained(0, [0, 1, 4, 5])
    # Step 1 needs four: six on their way at the share measured (2 of the 6 groups decided: 1/3),
    # of which two are the surplus of step 0, still in flight.
    assert [g.group_id for g in ledger.grant({0: 100}, 1)[0]] == [8, 9, 10, 11]
    assert sorted(ledger.groups) == [6, 7, 8, 9, 10, 11]
    assert ledger.dropped == {NO_SIGNAL: 2} and ledger.snapshot().dropped == {NO_SIGNAL: 2}


def test_over_granting_assumes_at_most_a_share_and_a_run_of_groups_without_signal_is_told_once():
    ledger = GroupLedger(batch_size=2, max_staleness=0, steps=100)
    for _ in range(6):
        ids = [g.group_id for groups in ledger.grant({0: 1000}, 0).values() for g in groups]
        ledger.generated(0, ids)
        ledger.drop(ids, NO_SIGNAL)
    assert ledger.no_signal_share == 0.8  # every group without signal: over-granted by 5x, not without end
    ledger.grant({0: 1000}, 0)
    assert len(ledger.groups) == 2 + 8
    assert len(ledger.notices) == 1 and "100% of the latest 8 groups had no signal" in ledger.notices[0]


def test_paced_credits_come_down_while_the_trainer_is_fed_and_go_back_up_when_it_waits():
    ledger = GroupLedger(batch_size=2, max_staleness=3, steps=100)
    assert ledger.lead == 3 and ledger.limit == 2 * 4
    for share in (0.0, 0.01, 0.05):  # three steps fed (5% is not waiting): one step less ahead
        ledger.pace(share)
    assert ledger.lead == 2 and ledger.limit == 2 * 3
    for _ in range(6):
        ledger.pace(0.0)
    assert ledger.lead == 1  # and no lower: one step ahead keeps generation and training overlapped
    ledger.pace(0.2)
    assert ledger.lead == 2
    for _ in range(5):
        ledger.pace(0.5)
    assert ledger.lead == 3  # the bound is the ceiling
    ledger.steps_done = 10
    assert ledger.limit == 2 * (10 + 3 + 1)


@pytest.mark.slow  # two runs
async def test_paced_credits_keep_samples_fresher_when_the_rollout_outruns_the_trainer(tmp_path):
    """Short responses and a trainer that takes 100 ms a step: bounded credits run two steps ahead
    all along; paced ones come down to one once the trainer is fed, with every step still trained."""
    staleness = {}
    for credits in ("bound", "paced"):
        config = sim("run.steps=16", "run.max_staleness=2", f"run.credits={credits}",
                     "roles.trainer.engine.step_overhead_s=0.1", "roles.rollout.engine.response_len.median=16",
                     "roles.rollout.engine.response_len.max=32")
        with trio.fail_after(60):
            controller, summary = await run_in_process(config, tmp_path / credits)
        assert summary.state == "stopped" and summary.steps == 16
        rows = RunDir(tmp_path / credits).read_metrics()
        staleness[credits] = statistics.fmean(r.staleness_mean for r in rows[8:])
        assert controller.ledger.lead == (2 if credits == "bound" else 1)
    assert staleness["paced"] < staleness["bound"] - 0.5, staleness


@pytest.mark.slow  # a run with a death and a restart
async def test_a_replica_that_dies_is_restarted_its_groups_reissued_and_nothing_is_lost(tmp_path):
    """Kill the rollout, reward and teacher replicas mid-run (their tasks end
    at once, as with SIGKILL): each is restarted as a new incarnation, the
    groups it held are granted again, and the audit of the run's ledger
    finds nothing lost and nothing trained twice."""
    from rlflow.tools.audit import audit

    async def kill_some(controller: Controller, launcher: InProcessLauncher) -> None:
        for n, role in enumerate(("rollout", "reward", "teacher", "rollout")):
            while controller.ledger.steps_done < 2 + 2 * n or not all(r.live for r in controller.roster):
                await trio.sleep(0.05)
            before = controller.roster.replicas[(role, 0)].incarnation
            await launcher.crash(role, 0)
            while controller.roster.replicas[(role, 0)].incarnation == before \
                    or not controller.roster.replicas[(role, 0)].live:
                await trio.sleep(0.05)

    config = sim("run.steps=14", "cluster.heartbeat_timeout_s=5", "roles.rollout.engine.step_s=0.002")
    with trio.fail_after(120):
        controller, summary = await run_in_process(config, tmp_path, during=kill_some)
    assert summary.state == "stopped", summary.error
    assert summary.steps == 14
    status = RunDir(tmp_path).read_status()
    assert {role: info.restarts for role, info in status.roles.items()} == {
        "rollout": 2, "reward": 1, "teacher": 1, "trainer": 0}
    assert [p.incarnation for p in status.roles["rollout"].placed] == [2]
    result = audit(tmp_path)
    assert (result.lost, result.duplicated) == (0, 0), result
    assert result.trained == 14 * 4 and result.issued == result.trained + result.dropped
    assert summary.groups.reissued > 0


def ks_distance(a: list[int], b: list[int]) -> float:
    """The two-sample Kolmogorov-Smirnov statistic: the largest gap between
    the empirical distribution functions of `a` and `b`."""
    import numpy as np

    a, b = np.sort(a), np.sort(b)
    grid = np.concatenate([a, b])
    return float(np.max(np.abs(np.searchsorted(a, grid, "right") / len(a)
                               - np.searchsorted(b, grid, "right") / len(b))))


@pytest.mark.slow  # ten runs in a row
async def test_ten_kill_and_resume_cycles_lose_nothing_and_train_what_an_uninterrupted_run_does(tmp_path):
    """Kill the trainer at a random moment, resume from the newest checkpoint,
    ten times over; then finish. The audit finds no group lost or trained
    twice, every step trained each of its groups within the staleness bound
    (also the first step after each resume), and the trained response
    lengths are distributed as in a run that was never interrupted."""
    import random

    from conftest import late_starts, trained_groups

    from rlflow.tools.audit import audit

    steps, batch = 30, 4
    base = (f"run.steps={steps}", "roles.trainer.engine.checkpoint_every=1", "roles.rollout.engine.step_s=0.002")
    with trio.fail_after(120):
        await run_in_process(sim(*base), tmp_path / "whole")
    rng = random.Random(12)
    run_dir, resume, kills = tmp_path / "cut", [], 0

    async def kill_trainer(controller: Controller, launcher: InProcessLauncher) -> None:
        nonlocal kills
        start = controller.ledger.steps_done
        while controller.ledger.steps_done < start + 1:
            await trio.sleep(0.01)
        await trio.sleep(rng.uniform(0, 0.3))
        await launcher.crash("trainer", 0)
        kills += 1

    for cycle in range(10):
        with trio.fail_after(120), pytest.raises(RunFailed, match=r"trainer-0 died: killed; .*rlflow up --resume"):
            await run_in_process(sim(*base, *resume), run_dir, during=kill_trainer)
        checkpoint = RunDir(run_dir).latest_checkpoint()
        assert checkpoint is not None, f"cycle {cycle}: no checkpoint"
        resume = [f"run.resume={json.dumps(str(checkpoint))}"]
    assert kills == 10
    with trio.fail_after(120):
        _, summary = await run_in_process(sim(*base, *resume), run_dir)
    assert summary.state == "stopped" and summary.steps == steps
    result = audit(run_dir)
    assert (result.lost, result.duplicated, result.trained) == (0, 0, steps * batch), result
    trained = trained_groups(run_dir)
    assert sorted(g for _, g, _ in trained) == list(range(steps * batch))  # none skipped, none twice
    assert [s for s, _, _ in trained] == [s for s in range(steps) for _ in range(batch)]
    assert late_starts(run_dir, batch, 2) == []

    def lengths(folder) -> list[int]:
        return [n for line in RunDir(folder).lengths(0).read_text().splitlines() for n in json.loads(line)["lengths"]]

    cut, whole = lengths(run_dir), lengths(tmp_path / "whole")
    assert len(cut) == len(whole) == steps * batch * 4
    # Two samples of 480 from one distribution: a gap over 0.13 has p < 0.001.
    assert ks_distance(cut, whole) < 0.13


@pytest.mark.slow  # waits out a heartbeat timeout
async def test_a_replica_that_hangs_while_holding_work_is_killed_and_restarted(tmp_path):
    """Its heartbeats go on, its tokens do not: after
    `cluster.progress_timeout_s` it counts as dead."""
    from rlflow.tools.audit import audit

    async def hang(controller: Controller, launcher: InProcessLauncher) -> None:
        while controller.ledger.steps_done < 2:
            await trio.sleep(0.02)
        # Its batcher's clock stands: no decode step, no group finishes.
        batcher = launcher.services[("rollout", 0)].engine.batcher
        batcher.advance = lambda now: None
        batcher.wake_time = lambda: math.inf

    with trio.fail_after(120):
        _, summary = await run_in_process(sim("run.steps=8", "cluster.progress_timeout_s=2"), tmp_path, during=hang)
    assert summary.state == "stopped" and summary.steps == 8, summary.error
    status = RunDir(tmp_path).read_status()
    assert status.roles["rollout"].restarts >= 1  # (a loaded machine may make a healthy one look hung too)
    assert any("rollout-0 made no progress for" in w and "presumed hung" in w for w in status.warnings), status.warnings
    result = audit(tmp_path)
    assert (result.lost, result.duplicated) == (0, 0)


@pytest.mark.slow  # a run with restarts
async def test_a_replica_that_keeps_dying_is_given_up_on_and_the_others_go_on(tmp_path):
    async def kill_twice(controller: Controller, launcher: InProcessLauncher) -> None:
        for n in range(2):
            while controller.ledger.steps_done < 2 + 2 * n or not controller.roster.replicas[("rollout", 1)].live \
                    or controller.roster.replicas[("rollout", 1)].incarnation != n:
                await trio.sleep(0.02)
            await launcher.crash("rollout", 1)

    config = sim("run.steps=10", "roles.rollout.replicas=2", "cluster.max_restarts=1")
    with trio.fail_after(30):
        _, summary = await run_in_process(config, tmp_path, during=kill_twice)
    assert summary.state == "stopped" and summary.steps == 10, summary.error
    status = RunDir(tmp_path).read_status()
    assert status.roles["rollout"].restarts == 1
    # The controller learns of the death from the launcher, or first from a send that finds no one.
    assert any(re.fullmatch(r"rollout-1 is given up on after 1 restarts: 2 deaths in 3600 s "
                            r"\(cluster.restart_window_s\), over cluster.max_restarts = 1; its last error: "
                            r"(died: killed|closed its connection)", w) for w in status.warnings), status.warnings


@pytest.mark.slow  # a run with three restarts
async def test_a_role_whose_last_replica_is_given_up_on_stops_the_run_naming_it(tmp_path):
    """The reward replica dies; its replacement never comes up (within
    `cluster.handshake_timeout_s` of its restart); with no restarts left the
    run stops, saying which replica and why."""
    async def kill_reward(controller: Controller, launcher: InProcessLauncher) -> None:
        launcher.dud_from["reward"] = 1
        while controller.ledger.steps_done < 2:
            await trio.sleep(0.02)
        await launcher.crash("reward", 0)

    config = sim("run.steps=100000", "cluster.max_restarts=1", "cluster.handshake_timeout_s=4")
    with trio.fail_after(120), pytest.raises(
            RunFailed, match=r"every reward replica is given up on; the last, reward-0: was not back within 4 s of "
                             r"its restart \(cluster.handshake_timeout_s\)"):
        await run_in_process(config, tmp_path, during=kill_reward)
    status = RunDir(tmp_path).read_status()
    assert status.state == "failed" and status.roles["reward"].restarts == 1


async def test_the_signal_filter_trains_every_step_on_groups_with_signal_and_the_audit_accounts_for_the_others(
        tmp_path):
    """Two samples a prompt, each right by chance 1/2: half the groups have no signal. With
    run.filter = "signal" each step still trains its four groups, every one of them with signal;
    the others are dropped as no_signal, counted per step, and the audit balances."""
    from rlflow.services.trainer.service import has_signal
    from rlflow.tools.audit import audit

    trained = []

    async def watch(controller: Controller, launcher: InProcessLauncher) -> None:
        while ("trainer", 0) not in launcher.services or launcher.services[("trainer", 0)].engine is None:
            await trio.sleep(0.01)
        engine = launcher.services[("trainer", 0)].engine
        deal = engine.deal

        async def dealt(batch):
            trained.append(batch)
            return await deal(batch)

        engine.deal = dealt

    config = sim("run.steps=6", "run.samples_per_prompt=2", "run.filter=signal")
    with trio.fail_after(60):
        _, summary = await run_in_process(config, tmp_path, during=watch)
    assert summary.state == "stopped" and summary.steps == 6
    assert [b.n_samples for b in trained] == [8] * 6
    assert all(has_signal(group) for batch in trained for group in split(batch))
    rows = RunDir(tmp_path).read_metrics()
    filtered = sum(r.train["no_signal_groups"] for r in rows)
    result = audit(tmp_path)
    assert (result.lost, result.duplicated, result.trained) == (0, 0, 24)
    # What was left at the end (over-granted, not needed) is dropped as the run ended; the rest had no signal.
    assert result.reasons[NO_SIGNAL] >= filtered > 0 \
        and set(result.reasons) <= {NO_SIGNAL, "the run ended before they were trained"}


async def test_a_prompt_that_fails_every_time_is_dropped_as_poison_and_the_run_goes_on(tmp_path):
    """Every sample of group 5 fails, every time it is generated: granted
    `run.max_grants` times, it is dropped with reason poison (named with its
    last error in the warnings, the ledger and the audit); every step still
    trains, and failed samples are not progress."""
    import msgspec

    from rlflow.protocol import SampleFailure
    from rlflow.tools.audit import audit, text

    async def poison(controller: Controller, launcher: InProcessLauncher) -> None:
        while ("rollout", 0) not in launcher.services:
            await trio.sleep(0.01)
        service = launcher.services[("rollout", 0)]
        build = service._batch

        def failing(finished):
            batch = build(finished)
            rows, start = [], 0
            for g in batch.groups:
                if g.group_id == 5:
                    rows += range(start, start + g.size)
                start += g.size
            bad = [SampleFailure(index=i, stage=Stage.ROLLOUT_END, kind="engine_error", message="prompt too long")
                   for i in rows]
            return msgspec.structs.replace(batch, failures=batch.failures + bad) if bad else batch

        service._batch = failing

    with trio.fail_after(60):
        _, summary = await run_in_process(sim("run.steps=6", "run.max_grants=2"), tmp_path, during=poison)
    assert summary.state == "stopped" and summary.steps == 6 and summary.groups.dropped == {"poison": 1}
    status = RunDir(tmp_path).read_status()
    assert any(w == "group 5 dropped as poison (granted 2 times, the last alone; last: engine_error: prompt too long)"
               for w in status.warnings), status.warnings
    result = audit(tmp_path)
    assert (result.lost, result.duplicated, result.trained) == (0, 0, 24)
    assert result.reasons == {"poison": 1} and "group 5: granted 2 times" in text(result)


def test_many_replicas_are_asked_for_fewer_heartbeats_each():
    """The controller asks for `cluster.heartbeat_s`, but at most 100 heartbeats a second of all
    replicas together, and always four within the timeout."""
    cluster = C.load(SIM, ["cluster.heartbeat_s=0.25", "cluster.heartbeat_timeout_s=60"]).cluster
    assert heartbeat_s(cluster, 4) == 0.25
    assert heartbeat_s(cluster, 82) == pytest.approx(0.82)
    assert heartbeat_s(cluster, 100_000) == 15.0
