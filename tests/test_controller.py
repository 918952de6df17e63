"""The controller on its own, without Ray: its ledger, its weight rounds and
statistics as plain code, and the async shell with real services on real
sockets started in this process."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import msgspec
import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from rlflow import config as C
from rlflow.control.controller import Controller
from rlflow.control.ledger import GroupLedger, GroupState, min_version
from rlflow.control.rounds import WeightRounds
from rlflow.control.spec import ServiceSpec
from rlflow.control.stats import RunStats
from rlflow.errors import RunFailed
from rlflow.protocol import Heartbeat, StepDone
from rlflow.rundir import RunDir
from rlflow.tools import cli

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
    assert ledger.held_by(0) == 4 and ledger.held_by(1) == 8
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


def test_a_lost_replica_gives_back_exactly_the_groups_it_was_generating():
    ledger = GroupLedger(batch_size=4, max_staleness=1, steps=100)
    granted = ledger.grant({0: 3, 1: 3}, 0)
    mine = [g.group_id for g in granted[1]]
    ledger.generated(1, mine[:1])  # this one already left the replica
    assert sorted(ledger.lost(1)) == sorted(mine[1:])
    assert all(ledger.groups[g].state is GroupState.QUEUED for g in mine[1:])
    assert ledger.groups[mine[0]].state is GroupState.DOWNSTREAM


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
    assert back.counts() == {"queued": 2, "generating": 0, "downstream": 0}
    granted = back.grant({0: 100}, version=1)[0]
    # The untrained ones first, then new ones up to the bound of step 1.
    assert [g.group_id for g in granted] == [2, 3, 4, 5]
    assert all(g.min_version >= 0 for g in granted)


@settings(max_examples=200)
@given(
    st.integers(1, 4),
    st.integers(0, 3),
    st.lists(st.tuples(st.sampled_from(["grant", "generate", "train", "expire", "lose"]), st.integers(0, 2)), max_size=60),
)
def test_the_ledger_keeps_its_promises_whatever_happens(batch, k, ops):
    """Random grants, acks, steps, expiries and lost replicas: no group
    exists beyond the bound, starts on weights older than its step allows,
    is held by two replicas, or comes back after it was trained on."""
    steps = 6
    ledger = GroupLedger(batch, k, steps)
    trained: set[int] = set()
    version = 0
    for op, rank in ops:
        if op == "grant":
            for owner, groups in ledger.grant({0: 3, 1: 3, 2: 3}, version).items():
                for g in groups:
                    assert g.group_id not in trained
                    assert g.min_version >= min_version(g.group_id, batch, k)
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
        else:
            ledger.lost(rank)
        assert ledger.next_group <= ledger.limit
        assert not trained & set(ledger.groups)
        assert all(ledger.held_by(r) <= 3 for r in range(3))
        assert len(trained) + len(ledger.groups) == ledger.next_group  # nothing lost


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


def test_a_receiver_that_got_a_newer_version_has_done_its_part():
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


def test_the_gain_is_in_points():
    from rlflow.rundir import EvalRow

    stats = RunStats(["rollout"])
    for step, accuracy in ((0, 0.40), (30, 0.55), (60, 0.60), (90, 0.65)):
        stats.evaluated(EvalRow(step=step, version=step, version_end=step, seconds=1.0, metrics={"accuracy": accuracy}))
    summary = stats.summary(1.0, run_id="r", state="stopped")
    assert summary.accuracy_last3_mean == pytest.approx(0.60)
    assert summary.gain_points == pytest.approx(20.0)


# -- the shell, with real services in this process ----------------------------------------


class InProcessLauncher:
    """Starts each service of the config as a trio task of this process
    (real sockets, real services, simulated engines; no Ray)."""

    def __init__(self, config: C.Config, run_id: str, secret: str, token: trio.lowlevel.TrioToken):
        self.config, self.run_id, self.secret, self.token = config, run_id, secret, token
        self.nursery: trio.Nursery | None = None

    def start(self, controller_address: str) -> None:
        from rlflow.services import service_class

        for role, cfg in self.config.role_items():
            for rank in range(cfg.replicas):
                spec = ServiceSpec(role=role, rank=rank, replicas=cfg.replicas, run_id=self.run_id,
                                   controller=controller_address, config=self.config, secret=self.secret)
                trio.from_thread.run_sync(self.nursery.start_soon, service_class(role)(spec).run, trio_token=self.token)

    def failures(self) -> list[str]:
        return []


async def run_in_process(config: C.Config, run_dir: pathlib.Path) -> tuple[Controller, object]:
    async with trio.open_nursery() as nursery:
        launcher = InProcessLauncher(config, "test", "s3cret", trio.lowlevel.current_trio_token())
        launcher.nursery = nursery
        controller = Controller(config, run_dir, "test", launcher, secret="s3cret")
        summary = await controller.run()
    return controller, summary


def sim(*overrides: str) -> C.Config:
    fast = ["cluster.heartbeat_s=0.1", "roles.trainer.engine.weights_bytes=65536", "run.batch_size=4",
            "run.samples_per_prompt=4"]
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


async def test_a_resumed_ledger_grants_the_untrained_groups_first(tmp_path):
    """The controller's part of a resume: the groups granted before the
    checkpoint and not trained on are granted again, none skipped."""
    from rlflow.control.controller import ControllerState

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
    assert summary.groups.trained == 8 and summary.groups.reissued == 0


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
    gone.wait()
    status = {"run_id": "r", "state": "running", "pid": gone.pid, "host": cli.socket.gethostname()}
    (tmp_path / "status.json").write_text(json.dumps(status))
    read = cli._read_status(RunDir(tmp_path))
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
    assert controller.ignored == {"unauthenticated": 1, "unexpected_hello": 1, "wrong_version": 1}
