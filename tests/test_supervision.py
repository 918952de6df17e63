"""The controller's plain modules on their own, without sockets or Ray:
admission, the supervision policy on trio's mock clock, the weights'
generations, topology, the status builders; and the outbox with real
sockets (a replica that stops reading delays only itself)."""

from __future__ import annotations

import random

import pytest
import trio

from rlflow.control.ledger import GroupLedger
from rlflow.control.replicas import (
    Policy, Refusal, Replica, Restart, Roster, State, Supervisor, admit, supersedes,
)
from rlflow.control.rounds import Weights
from rlflow.control.status import add_counters, add_loads, role_status
from rlflow.control.topology import Topology
from rlflow.protocol import (
    REPLACED, SCHEMA_VERSION, UNAUTHENTICATED, UNEXPECTED_HELLO, WRONG_VERSION, Adapter, Counters, EngineLoad,
    Heartbeat, Hello, Role, SendWeights, UpdateWeights, WeightsGloo, WeightsZmq,
)
from rlflow.rundir import Shares

EXPECTED = {("rollout", 0), ("rollout", 1), ("reward", 0), ("trainer", 0)}


def hello(role: Role = Role.ROLLOUT, rank: int = 0, *, incarnation: int = 0, secret: str = "s", **fields) -> Hello:
    return Hello(role=role, rank=rank, replicas=2, schema_version=SCHEMA_VERSION, incarnation=incarnation,
                 secret=secret, **fields)


def replica(role: str = "rollout", rank: int = 0, state: State = State.READY, **fields) -> Replica:
    r = Replica(role, rank, f"{role}-{rank}".encode(), hello(Role[role.upper()], rank), started=0.0, **fields)
    r.state = state
    return r


# -- admission ------------------------------------------------------------------------------


def test_admission_refuses_with_a_kind_and_a_reason():
    def refusal(h: Hello, current: Replica | None = None) -> Refusal | None:
        return admit(h, expected=EXPECTED, secret="s", schema_version=SCHEMA_VERSION, current=current)

    assert refusal(hello()) is None
    assert refusal(Hello(role=Role.ROLLOUT, rank=0, replicas=2,
                         schema_version=SCHEMA_VERSION + 1)).kind == WRONG_VERSION
    assert refusal(hello(secret="guess")).kind == UNAUTHENTICATED
    assert refusal(hello(rank=5)) == Refusal(UNEXPECTED_HELLO, "a hello from rollout-5, which the config does not have")
    # A second hello while the first incarnation is up: refused.
    assert refusal(hello(incarnation=1), replica()).message == (
        "rollout-0 said hello again as incarnation 1 while incarnation 0 is ready")
    # A restart: only the incarnation the launcher started now.
    restarting = replica(state=State.RESTARTING, launched=2, incarnation=1)
    assert refusal(hello(incarnation=2), restarting) is None
    assert "while the one expected is incarnation 2" in refusal(hello(incarnation=1), restarting).message
    assert refusal(hello(incarnation=3), restarting).kind == UNEXPECTED_HELLO
    # Lost and waiting for its back-off: no hello yet (the incarnation it will be is not started).
    assert refusal(hello(incarnation=1), replica(state=State.LOST)).kind == UNEXPECTED_HELLO
    # An external replica that was lost comes back with any higher incarnation.
    external = replica(state=State.LOST, external=True, incarnation=4)
    assert refusal(hello(incarnation=5), external) is None
    assert refusal(hello(incarnation=4), external).kind == UNEXPECTED_HELLO


def test_a_live_external_replicas_next_incarnation_supersedes_it_at_once_and_a_forged_one_does_not():
    def supersedes_(h: Hello, current: Replica) -> bool:
        return supersedes(h, current, expected=EXPECTED, secret="s", schema_version=SCHEMA_VERSION)

    alive = replica(external=True, incarnation=1700000000000)  # a time in ms: its user restarted it
    assert supersedes_(hello(incarnation=1700000005000), alive)
    assert not supersedes_(hello(incarnation=1700000005000, secret="guess"), alive)
    assert not supersedes_(hello(incarnation=1699999999999), alive)  # an older start says hello late
    assert not supersedes_(hello(incarnation=2), replica(incarnation=1))  # rlflow's own: it restarts them
    assert not supersedes_(hello(incarnation=5), replica(state=State.LOST, external=True, incarnation=4))
    roster = Roster(EXPECTED, external={("reward", 0)})
    first = roster.join(b"a", hello(Role.REWARD, incarnation=7), secret="s", schema_version=SCHEMA_VERSION,
                        now=0.0, samples_per_prompt=8)
    first.state = State.READY
    assert roster.superseded(hello(Role.REWARD, incarnation=9), secret="s", schema_version=SCHEMA_VERSION) is first
    assert roster.superseded(hello(Role.REWARD, incarnation=9, secret="x"), secret="s",
                             schema_version=SCHEMA_VERSION) is None


def test_the_roster_registers_a_next_incarnation_in_place_and_retires_the_last():
    roster = Roster(EXPECTED)
    first = roster.join(b"a", hello(slots=64), secret="s", schema_version=SCHEMA_VERSION, now=0.0,
                        samples_per_prompt=8)
    assert isinstance(first, Replica) and first.capacity == 16 * 64 // 8
    assert isinstance(roster.join(b"b", hello(secret="x"), secret="s", schema_version=SCHEMA_VERSION, now=0.0,
                                  samples_per_prompt=8), Refusal)
    first.state = State.READY
    roster.retire(first)
    first.state, first.launched = State.RESTARTING, 1
    again = roster.join(b"c", hello(incarnation=1), secret="s", schema_version=SCHEMA_VERSION, now=5.0,
                        samples_per_prompt=8)
    assert again is first and again.identity == b"c" and again.state is State.HELLO
    assert roster.by_identity == {b"c": first} and roster.retired == {b"a": "rollout-0 incarnation 0"}
    assert roster.receivers() == set()  # not ready yet


# -- the supervision policy, on trio's mock clock ------------------------------------------


POLICY = Policy(heartbeat_timeout_s=10, progress_timeout_s=30, handshake_timeout_s=60, max_restarts=3,
                restart_window_s=3600, backoff_s=1, backoff_max_s=20)


async def test_restarts_back_off_doubling_with_jitter_up_to_the_cap(autojump_clock):
    supervisor = Supervisor(POLICY, trio.current_time, random.Random(3))
    r = replica()
    delays = []
    for _ in range(3):
        verdict = supervisor.died(r, "died: killed")
        assert isinstance(verdict, Restart) and r.state is State.LOST
        delays.append(verdict.delay_s)
        assert not supervisor.due(r)
        await trio.sleep(verdict.delay_s)
        assert supervisor.due(r)
        supervisor.restarting(r)
        assert (r.state, r.restarts, r.launched) == (State.RESTARTING, len(delays), len(delays))
        r.state = State.READY
    for n, delay in enumerate(delays):
        assert 0.75 * 2**n <= delay <= 1.25 * 2**n
    assert supervisor.backoff(10) <= 20 and supervisor.backoff(10) >= 15  # 1 x 2^9, capped at 20
    # A fourth death within the window: over max_restarts.
    verdict = supervisor.died(r, "died: killed")
    assert r.state is State.GIVEN_UP and "4 deaths in 3600 s" in verdict.reason


async def test_max_restarts_counts_deaths_within_the_window_so_a_long_run_survives_a_death_a_day(autojump_clock):
    supervisor = Supervisor(POLICY, trio.current_time, random.Random(0))
    r = replica()
    for _ in range(10):  # ten deaths, a day apart
        assert isinstance(supervisor.died(r, "died: killed"), Restart)
        assert len(r.deaths) == 1
        await trio.sleep(86_400)
        supervisor.restarting(r)
        r.state = State.READY


async def test_silence_and_hangs_are_found_on_the_clock(autojump_clock):
    supervisor = Supervisor(POLICY, trio.current_time)
    r = replica(last_seen=trio.current_time(), progressed=trio.current_time())
    assert supervisor.silent_or_hung(r, progress=5, holds_work=True) is None
    await trio.sleep(25)  # progress stands while it holds work, heartbeats go on
    r.last_seen = trio.current_time()
    assert supervisor.silent_or_hung(r, progress=5, holds_work=True) is None
    await trio.sleep(6)
    r.last_seen = trio.current_time()
    assert "made no progress for 31 s" in supervisor.silent_or_hung(r, progress=5, holds_work=True)
    # Idle (no work held): no progress expected.
    assert supervisor.silent_or_hung(r, progress=5, holds_work=False) is None
    await trio.sleep(11)
    assert "sent nothing for 11 s" in supervisor.silent_or_hung(r, progress=6, holds_work=True)


async def test_a_slow_restart_is_waited_for_until_the_handshake_timeout(autojump_clock):
    supervisor = Supervisor(POLICY, trio.current_time)
    r = replica()
    supervisor.died(r, "died: killed")
    await trio.sleep(2)
    supervisor.restarting(r)
    await trio.sleep(59)
    assert supervisor.review(r, None, False) is None  # slow, its process alive: not a death
    await trio.sleep(2)
    assert supervisor.review(r, None, False) == ("lose", "was not back within 60 s of its restart "
                                                         "(cluster.handshake_timeout_s)")


async def test_a_lost_external_replica_is_waited_for_then_given_up_on(autojump_clock):
    supervisor = Supervisor(POLICY, trio.current_time)
    r = replica(external=True)
    verdict = supervisor.died(r, "sent nothing")
    assert r.state is State.LOST and verdict.delay_s == float("inf")  # never restarted here
    await trio.sleep(59)
    assert supervisor.review(r, None, False) is None
    await trio.sleep(2)
    action, why = supervisor.review(r, None, False)
    assert action == "give_up" and "(external) did not come back within 60 s" in why


# -- weights: rounds and generations -------------------------------------------------------


def test_generations_regroup_after_a_receiver_leaves_and_a_replacement_catches_up():
    weights = Weights(0, max_rebuilds=2)
    weights.offered(WeightsGloo(host="h", port=1, nbytes=8), [], receivers=2)
    transfer = weights.welcome("rollout", 1, first=True, receivers=2)["weights"]
    assert (transfer.rank, transfer.world_size) == (2, 3)
    assert "weights" not in weights.welcome("rollout", 1, first=False, receivers=2)  # joins the next generation
    first = weights.publish(1, {0, 1})
    assert [(o.role, o.rank, type(o.message)) for o in first] == [
        ("trainer", None, SendWeights), ("rollout", 0, UpdateWeights), ("rollout", 1, UpdateWeights)]
    weights.loaded(0, 1, {0, 1})
    assert weights.left(1, {0}) == []  # round 1 completes without it
    assert not weights.busy
    # The next version goes through a new generation of one receiver.
    (send,) = weights.publish(2, {0})
    assert send.message.transfer.generation == 1 and send.message.transfer.world_size == 2
    (load,) = weights.hosted(WeightsGloo(host="h", port=77, world_size=2, generation=1), {0})
    assert (load.rank, load.message.version, load.message.transfer.rank, load.message.transfer.port) == (0, 2, 1, 77)
    weights.loaded(0, 2, {0})
    # Replica 1 is back: it catches up (no work meanwhile) through generation 2.
    (send,) = weights.joined(1, {0, 1})
    assert 1 in weights.catching_up and send.message.version == 2 and send.message.transfer.generation == 2
    weights.hosted(WeightsGloo(host="h", port=78, world_size=3, generation=2), {0, 1})
    weights.loaded(0, 2, {0, 1})
    weights.loaded(1, 2, {0, 1})
    assert not weights.catching_up and not weights.busy


def test_a_broken_group_is_rebuilt_a_bounded_number_of_times_in_a_row():
    from rlflow.errors import RunFailed

    weights = Weights(0, max_rebuilds=2)
    weights.offered(WeightsGloo(host="h", port=1, nbytes=8), [], receivers=1)
    weights.publish(1, {0})
    for generation in (1, 2):
        (send,) = weights.broken({0})
        assert send.message.version == 1 and send.message.transfer.generation == generation
    with pytest.raises(RunFailed, match="broke 3 times in a row .*cluster.max_weight_rebuilds = 2"):
        weights.broken({0})
    # A round that completes resets the count.
    weights = Weights(0, max_rebuilds=1)
    weights.offered(WeightsGloo(host="h", port=1, nbytes=8), [], receivers=1)
    weights.publish(1, {0})
    weights.broken({0})
    weights.hosted(WeightsGloo(host="h", port=2, world_size=2, generation=1), {0})
    weights.loaded(0, 1, {0})
    weights.publish(2, {0})
    weights.broken({0})  # the first break of this round


def test_a_generation_replaced_before_the_trainer_hosted_it_gets_no_members():
    """A break during a rebuild asks for a newer generation; the older one,
    hosted late, is joined by nobody: the version moves through the newer."""
    weights = Weights(0, max_rebuilds=3)
    weights.offered(WeightsGloo(host="h", port=1, nbytes=8), [], receivers=1)
    weights.publish(1, {0})
    weights.broken({0})  # generation 1 asked for
    weights.broken({0})  # generation 2 asked for before the trainer got to 1
    assert weights.hosted(WeightsGloo(host="h", port=2, world_size=2, generation=1), {0}) == []
    (load,) = weights.hosted(WeightsGloo(host="h", port=3, world_size=2, generation=2), {0})
    assert load.message == UpdateWeights(version=1, transfer=WeightsGloo(host="h", port=3, world_size=2,
                                                                          generation=2, rank=1))


def test_with_the_zmq_transfer_a_replacement_is_sent_the_newest_version_moved():
    weights = Weights(3, max_rebuilds=1)
    weights.offered(WeightsZmq(address="tcp://t:1"), [], receivers=2)
    assert weights.welcome("rollout", 0, first=True, receivers=2) == {"weights": WeightsZmq(address="tcp://t:1"),
                                                                       "layout": [], "adapter": None}
    (order,) = weights.joined(0, {1})
    assert (order.rank, order.message) == (0, UpdateWeights(version=3))


def test_a_replica_whose_checksum_is_not_the_trainers_fails_the_run_naming_both():
    from rlflow.errors import RunFailed

    adapter = Adapter(rank=4, alpha=8.0, targets=["q_proj"])
    weights = Weights(0, max_rebuilds=1)
    weights.offered(WeightsGloo(host="h", port=1, nbytes=8), [], receivers=2, adapter=adapter)
    assert weights.welcome("rollout", 0, first=True, receivers=2)["adapter"] == adapter
    assert "adapter" not in weights.welcome("trainer", 0, first=True, receivers=2)
    weights.publish(1, {0, 1}, "crc32:00000001")
    weights.loaded(0, 1, {0, 1}, "crc32:00000001")
    assert weights.checksums.matched == 1
    with pytest.raises(RunFailed, match=r"rollout-1 serves weights v1 with checksum crc32:0000dead, but the trainer "
                                        r"sent checksum crc32:00000001"):
        weights.loaded(1, 1, {0, 1}, "crc32:0000dead")
    # A replica that reports none where the trainer gave one: the adapter never arrived.
    weights.publish(2, {0, 1}, "crc32:00000002")
    with pytest.raises(RunFailed, match=r"rollout-0 serves weights v2 with checksum \(none reported\)"):
        weights.loaded(0, 2, {0, 1}, "")


def test_a_report_ahead_of_the_trainers_checksum_waits_for_it_and_whole_weights_are_not_checked():
    from rlflow.errors import RunFailed

    weights = Weights(3, max_rebuilds=1)
    weights.offered(WeightsZmq(address="tcp://t:1"), [], receivers=1)
    weights.loaded(0, 3, {0}, "")  # the version it started with, from disk: nothing to check
    weights.loaded(0, 4, {0}, "crc32:0000beef")  # a weight server handed out v4 before its WeightsReady was read
    assert weights.checksums.waiting == [("rollout-0", 4, "crc32:0000beef")]
    with pytest.raises(RunFailed, match="rollout-0 serves weights v4 with checksum crc32:0000beef"):
        weights.publish(4, {0}, "crc32:00000004")
    weights = Weights(0, max_rebuilds=1)
    weights.offered(WeightsGloo(host="h", port=1, nbytes=8), [], receivers=1)
    weights.publish(1, {0})  # whole weights over gloo: no checksum
    weights.loaded(0, 1, {0}, "")
    assert weights.checksums.matched == 0 and not weights.checksums.waiting


# -- topology and status -------------------------------------------------------------------


def test_each_replica_streams_to_every_registered_replica_of_the_next_role():
    topology = Topology(["rollout", "reward", "trainer"])
    reward0, reward1 = replica("reward", 0), replica("reward", 1, state=State.LOST)
    for r, port in ((reward0, 1), (reward1, 2)):
        r.hello = hello(Role.REWARD, r.rank, endpoints={"in": f"tcp://h:{port}"})
    trainers = [replica("trainer", k) for k in range(3)]
    for t in trainers:
        t.hello = hello(Role.TRAINER, t.rank, endpoints={"share": f"tcp://t:{t.rank}"} if t.rank else {"in": "x"})
    everyone = [reward0, reward1, *trainers]
    assert topology.peers("rollout", 0, everyone) == {"out": ["tcp://h:1"]}  # not the lost one
    assert topology.peers("trainer", 0, everyone) == {"shares": ["tcp://t:1", "tcp://t:2"]}
    assert topology.peers("trainer", 1, everyone) == {}
    assert topology.previous("reward") == "rollout" and topology.next("trainer") is None


def test_a_rollout_is_told_which_replicas_it_streams_to_asked_for_text():
    topology = Topology(["rollout", "reward", "teacher", "trainer"])
    roster = Roster({("rollout", 0), ("reward", 0), ("reward", 1), ("teacher", 0), ("trainer", 0)})
    for role, rank, endpoints, text in (("rollout", 0, {}, False), ("reward", 0, {"in": "tcp://r:0"}, True),
                                        ("reward", 1, {"in": "tcp://r:1"}, False),
                                        ("teacher", 0, {"in": "tcp://t:0"}, True), ("trainer", 0, {"in": "x"}, False)):
        r = roster.replicas[(role, rank)] = replica(role, rank)
        r.hello = hello(Role[role.upper()], rank, endpoints=endpoints, text=text)
    peers = topology.peers("rollout", 0, roster)
    assert Topology.text_peers(peers, roster) == ["tcp://r:0"]  # of its own peers: not the teacher
    assert Topology.text_peers(topology.peers("reward", 0, roster), roster) == ["tcp://t:0"]
    # A replacement that does not ask: the rollout is told so with the new addresses.
    roster.replicas[("reward", 0)].hello = hello(Role.REWARD, 0, endpoints={"in": "tcp://r:9"})
    [(rollout, told)] = topology.upstream("reward", roster)
    assert rollout.name == "rollout-0" and told.peers == {"out": ["tcp://r:9", "tcp://r:1"]} and told.text_peers == []


def test_the_status_adds_up_each_roles_counters_and_engines():
    beats = [Heartbeat(seq=1, version=4, counters=Counters(samples=3, rejected={"malformed": 1},
                                                           reward_calls={"f.ok": 2}),
                       engine=EngineLoad(slots=8, running=5, waiting=1, kv_cache_usage=0.25, preemptions=1)),
             Heartbeat(seq=1, version=3, counters=Counters(samples=4, rejected={"malformed": 2}),
                       engine=EngineLoad(slots=8, running=8, waiting=6, kv_cache_usage=0.9, preemptions=2))]
    assert add_counters(b.counters for b in beats) == Counters(samples=7, rejected={"malformed": 3},
                                                               reward_calls={"f.ok": 2})
    assert add_loads(b.engine for b in beats) == EngineLoad(slots=16, running=13, waiting=7, kv_cache_usage=0.9,
                                                            preemptions=3)
    assert add_loads([None]) is None
    lost = replica(rank=1, state=State.LOST, restart_at=12.5, restarts=2)
    up = replica(rank=0, version=4)
    status = role_status("rollout", 2, [up, lost], beats, Shares(busy=1.0), version=6, now=10.0)
    assert (status.up, status.restarts, status.version, status.behind) == (1, 2, 4, 2)
    assert [(p.state, p.restart_in_s) for p in status.placed] == [("ready", None), ("lost", 2.5)]


# -- the outbox, with real sockets ----------------------------------------------------------


async def test_a_replica_that_stops_reading_delays_neither_another_replicas_welcome_nor_a_weight_order():
    """Two peers of the controller's ROUTER; one never reads. Its outbox
    fills (and reports it), while every message to the other arrives at once."""
    from rlflow.control.outbox import Outbox
    from rlflow.data import transport
    from rlflow.protocol import Welcome

    async with (
        transport.open_router(bind="tcp://127.0.0.1:*", hwm=4) as router,
        transport.open_dealer(connect=transport.bound_address(router), identity=b"stuck", hwm=4) as stuck,
        transport.open_dealer(connect=transport.bound_address(router), identity=b"fine", hwm=4) as fine,
        trio.open_nursery() as nursery,
    ):
        with trio.fail_after(30):
            for dealer in (stuck, fine):  # the ROUTER learns each identity
                await dealer.send(hello())
                await router.recv()
            boxes = {name: Outbox(router, name, size=50) for name in (b"stuck", b"fine")}
            for box in boxes.values():
                nursery.start_soon(box.run, lambda: None)
            full = 0
            for version in range(200):
                full += not boxes[b"stuck"].post(UpdateWeights(version=version))
            assert full > 0  # the stuck peer's pipe and its outbox filled: the controller sees it
            for version in range(20):
                assert boxes[b"fine"].post(UpdateWeights(version=version))
            assert boxes[b"fine"].post(Welcome(schema_version=SCHEMA_VERSION, run_id="r"))
            with trio.fail_after(5):
                got = [await fine.recv() for _ in range(21)]
            assert [m.version for m in got[:20]] == list(range(20)) and isinstance(got[20], Welcome)
            for box in boxes.values():
                box.close()  # a send stuck on the full peer is abandoned
        nursery.cancel_scope.cancel()


async def test_a_stuck_replica_is_queued_as_lost_not_lost_inside_the_post_that_found_it():
    """Posting to a full outbox only queues the loss (the handler that posted goes on undisturbed); the
    controller takes it between handlers, once, and not if the replica was replaced meanwhile."""
    from types import SimpleNamespace

    from rlflow.control.outbox import Outboxes
    from rlflow.data import transport

    async with (
        transport.open_router(bind="tcp://127.0.0.1:*", hwm=4) as router,
        transport.open_dealer(connect=transport.bound_address(router), identity=b"stuck", hwm=4) as stuck,
        trio.open_nursery() as nursery,
    ):
        with trio.fail_after(30):
            await stuck.send(hello())
            await router.recv()
            outboxes = Outboxes()
            outboxes.router, outboxes.nursery = router, nursery
            replica = SimpleNamespace(identity=b"stuck", incarnation=1, registered=True, name="reward-0")
            outboxes.open(replica)
            for version in range(2000):  # more than its pipe and its outbox hold: found stuck, many times
                outboxes.post(replica, UpdateWeights(version=version))
            [(lost, why, kill)] = await outboxes.losses()
            assert lost is replica and "presumed stuck" in why and kill
            for version in range(2000):  # full again (its task may have sent a few meanwhile): queued again
                outboxes.post(replica, UpdateWeights(version=version))
            replica.incarnation = 2  # ... but replaced before the controller took it
            assert await outboxes.losses() == []
            outboxes.close(replica)
        nursery.cancel_scope.cancel()


async def test_the_farewell_keeps_the_version_and_counts_of_each_replicas_last_heartbeat():
    """A role that takes the steps it owes at shutdown ends ahead of its last heartbeat in the run: the
    farewell takes the version of the beat it sends before its Bye (the run's status ends on it)."""
    from rlflow.control.outbox import farewell
    from rlflow.data import transport
    from rlflow.protocol import Bye, Shutdown

    roster = Roster({("critic", 0), ("critic", 1)})
    async with (
        transport.open_router(bind="tcp://127.0.0.1:*", hwm=16) as router,
        transport.open_dealer(connect=transport.bound_address(router), identity=b"critic-0", hwm=16) as first,
        transport.open_dealer(connect=transport.bound_address(router), identity=b"critic-1", hwm=16) as second,
        trio.open_nursery() as nursery,
    ):
        with trio.fail_after(30):
            for dealer in (first, second):
                await dealer.send(hello(Role.CRITIC, rank=int(dealer is second)))
                identity, msg = await router.recv()
                roster.join(identity, msg, secret="s", schema_version=SCHEMA_VERSION, now=0.0,
                            samples_per_prompt=2)
            heard = []

            async def last_steps(dealer, version: int) -> None:
                assert isinstance(await dealer.recv(), Shutdown)
                await dealer.send(Heartbeat(seq=9, version=version, counters=Counters(critic_steps=version)))
                await dealer.send(Bye(reason="shutdown"))

            nursery.start_soon(last_steps, first, 4)
            nursery.start_soon(last_steps, second, 3)
            await farewell(router, roster, "run ended", heard=lambda r, beat: heard.append((r.name, beat.counters)))
        assert {r.name: (r.version, r.state) for r in roster} == {"critic-0": (4, State.GONE),
                                                                  "critic-1": (3, State.GONE)}
        assert sorted(heard) == [("critic-0", Counters(critic_steps=4)), ("critic-1", Counters(critic_steps=3))]


def test_a_replaced_incarnation_is_told_the_kind_the_spec_names():
    from rlflow.protocol import CONTROLLER_ERROR_KINDS

    assert REPLACED == "replaced" and REPLACED in CONTROLLER_ERROR_KINDS


def test_poison_names_the_group_its_grants_and_its_last_error():
    ledger = GroupLedger(2, 0, 10, max_grants=2)
    ledger.grant({0: 10}, 0)
    assert ledger.expired([0], "every sample failed", ["row 7: engine_error: prompt too long"]) == [0]
    # Its last grant is alone: not while the replica still holds group 1.
    assert ledger.grant({0: 10}, 0) == {}
    ledger.generated(0, [1])
    assert [g.group_id for g in ledger.grant({0: 10}, 0)[0]] == [0]
    assert ledger.expired([0], "every sample failed", ["row 7: engine_error: prompt too long"]) == []
    assert ledger.dropped == {"poison": 1}
    (event,) = [e for e in ledger.drain() if e.event == "dropped"]
    assert event.groups == [0]
    assert event.details == ["granted 2 times, the last alone; last: row 7: engine_error: prompt too long"]
    # The step the poisoned group left is filled by a new group that can start now (sync: version 0).
    (fresh,) = [g for g in ledger.grant({0: 10}, 0)[0] if g.group_id == 2]
    assert fresh.min_version == 0


def test_the_live_table_shows_restarts_the_back_off_in_progress_and_the_engines_load():
    import rich.console

    from rlflow.rundir import Placed, RoleStatus, Status, named
    from rlflow.tools.display import render

    rollout = RoleStatus(replicas=2, up=1, restarts=3, engine=named(EngineLoad(slots=64, running=5, waiting=2,
                                                                               kv_cache_usage=0.9, preemptions=1)),
                         placed=[Placed(rank=0, host="h", pid=1), Placed(rank=1, host="h", pid=2, state="lost",
                                                                         restart_in_s=3.2)])
    console = rich.console.Console(record=True, width=240)
    console.print(render(Status(run_id="r", state="running", roles={"rollout": rollout})))
    shown = console.export_text()
    assert "3, next in 3 s" in shown and "kv 90% run 5 wait 2 pre 1" in shown


def test_a_round_left_by_its_last_receiver_ends_and_the_replacement_catches_up_to_the_newest():
    weights = Weights(0, max_rebuilds=2)
    weights.offered(WeightsGloo(host="h", port=1, nbytes=8), [], receivers=1)
    weights.publish(1, {0})
    assert weights.left(0, set()) == [] and not weights.busy  # the only receiver died mid-round
    assert weights.publish(2, set()) == [] and not weights.busy  # nobody to move version 2 to
    send, = weights.joined(0, {0})
    assert send.message.version == 2 and send.message.transfer.generation == 1
    (load,) = weights.hosted(WeightsGloo(host="h", port=9, world_size=2, generation=1), {0})
    assert load.message.version == 2
    weights.loaded(0, 2, {0})
    assert not weights.busy and not weights.catching_up
