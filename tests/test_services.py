"""The services and engines one by one, in this process, on real sockets:
the simulated rollout engine, the stage service's loop and clock, the
reward and teacher services' work on a batch, the trainer service's intake."""

from __future__ import annotations

import collections
import contextlib
import json
import math
import pathlib
import time
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import numpy as np
import pytest
import trio
from hypothesis import given
from hypothesis import strategies as st
from golden import examples

from rlflow import config as C
from rlflow.data import transport
from rlflow.protocol import (
    SCHEMA_VERSION,
    Ack,
    Bye,
    EvalDone,
    Heartbeat,
    Evaluate,
    Hello,
    PromptGroup,
    Ready,
    SampleBatch,
    SampleFailure,
    Shutdown,
    Stage,
    StepDone,
    UpdateWeights,
    Welcome,
    WeightsLoaded,
    WeightsZmq,
    build_batch,
    concat,
    samples,
    split,
)
from rlflow.rundir import RunDir
from rlflow.startup import ServiceSpec
from rlflow.services.base import Service, StageService, standalone_context
from rlflow.services.reward.service import RewardService
from rlflow.services.rollout.service import RolloutService
from rlflow.services.rollout.sim import RequestQueue, SimBatcher, SimEngine
from rlflow.services.teacher.service import TeacherService
from rlflow.services.trainer import service as trainer_service
from rlflow.services.trainer.service import GroupIds, gather
from rlflow.services.trainer.service import Held as HeldGroup
from rlflow.services.trainer.sim import SimTrainerEngine

ROOT = pathlib.Path(__file__).resolve().parent.parent
SIM = ROOT / "examples" / "sim.toml"


def sim_config(*overrides: str) -> C.Config:
    return C.load(SIM, list(overrides))


def spec(config: C.Config, role: str, controller: str = "") -> ServiceSpec:
    return ServiceSpec(role=role, rank=0, replicas=1, run_id="t", controller=controller, config=config, secret="s")


# -- the simulated rollout engine -------------------------------------------------------


async def collect(engine: SimEngine, count: int) -> dict[int, list]:
    out = {}
    async for finished in engine.finished:
        for group, responses in finished:
            out[group.group_id] = responses
        if len(out) >= count:
            return out
    raise AssertionError("the engine stopped")


async def test_the_simulated_engine_generates_lengths_from_its_distribution():
    config = sim_config("roles.rollout.engine.response_len={kind='fixed', value=40}", "roles.rollout.engine.slots=8")
    ctx = standalone_context(config, "rollout")
    engine = SimEngine(config.roles.rollout.engine, ctx)
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            await nursery.start(engine.run)
            for g in range(4):
                engine.submit(PromptGroup(group_id=g, prompt_ids=[1, 2], n=4), time.time())
            finished = await collect(engine, 4)
            nursery.cancel_scope.cancel()
    for responses in finished.values():
        assert [len(r.token_ids) for r in responses] == [40] * 4
        for r in responses:
            assert (r.versions == 0).all() and (r.logprobs <= 0).all()
            assert r.stamps[Stage.ROLLOUT_START] <= r.stamps[Stage.ROLLOUT_END]
    # 16 sequences of 40 tokens through 8 slots: every slot busy throughout.
    assert ctx.counters["slot_s"] == pytest.approx(16 * 40 * 0.001)


async def test_weights_arrive_between_steps_and_later_tokens_carry_the_new_version():
    config = sim_config("roles.rollout.engine.response_len={kind='fixed', value=2000}",
                        "roles.rollout.engine.step_s=0.0005", "roles.trainer.engine.weights_bytes=4096")
    trainer = SimTrainerEngine(config.roles.trainer.engine, standalone_context(config, "trainer"))
    ctx = standalone_context(config, "rollout")
    engine = SimEngine(config.roles.rollout.engine, ctx)
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            await nursery.start(trainer.serve)
            await nursery.start(engine.run)
            await engine.join_weights(WeightsZmq(address=trainer.server.address), [])
            engine.submit(PromptGroup(group_id=0, prompt_ids=[1], n=2), time.time())
            while ctx.counters["decode_steps"] < 10:  # some tokens on version 0
                await trio.sleep(0.01)
            await trainer.publish(1)
            assert await engine.update_weights(1, None) == 1
            finished = await collect(engine, 1)
            nursery.cancel_scope.cancel()
    for r in finished[0]:
        cut = int(np.argmax(r.versions == 1))
        assert 0 < cut < 2000 and (r.versions[:cut] == 0).all() and (r.versions[cut:] == 1).all()


async def test_the_weight_server_outlives_a_replica_that_died_waiting_for_a_version():
    """A rollout replica asks for a version not published yet and dies; when
    the version comes, the reply finds no one: the server goes on serving."""
    from rlflow.protocol import Codec, WeightsMessage, WeightsRequest

    config = sim_config("roles.trainer.engine.weights_bytes=4096")
    ctx = standalone_context(config, "trainer")
    trainer = SimTrainerEngine(config.roles.trainer.engine, ctx)
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            await nursery.start(trainer.serve)
            async with transport.open_dealer(connect=trainer.server.address, codec=Codec(WeightsMessage)) as doomed:
                await doomed.send(WeightsRequest(version=1))
                await trio.sleep(0.2)  # it is parked at the server
            await trio.sleep(0.3)  # the server has seen it go
            await trainer.publish(1)
            async with transport.open_dealer(connect=trainer.server.address, codec=Codec(WeightsMessage)) as next_one:
                await next_one.send(WeightsRequest(version=1))
                assert (await next_one.recv()).version == 1
            nursery.cancel_scope.cancel()
    assert ctx.counters["weights_unclaimed"] == 1


@pytest.mark.slow  # waits for a group to fall behind
async def test_strict_staleness_restarts_a_group_that_fell_behind():
    config = sim_config("run.staleness_check=strict", "run.max_staleness=0",
                        "roles.rollout.engine.response_len={kind='fixed', value=3000}",
                        "roles.trainer.engine.weights_bytes=4096")
    ctx = standalone_context(config, "rollout")
    trainer = SimTrainerEngine(config.roles.trainer.engine, standalone_context(config, "trainer"))
    engine = SimEngine(config.roles.rollout.engine, ctx)
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            await nursery.start(trainer.serve)
            await nursery.start(engine.run)
            await engine.join_weights(WeightsZmq(address=trainer.server.address), [])
            engine.submit(PromptGroup(group_id=0, prompt_ids=[1], n=1), time.time())
            await trio.sleep(0.1)
            await trainer.publish(1)
            await engine.update_weights(1, None)  # with max_staleness 0 its v0 tokens cannot be trained on
            finished = await collect(engine, 1)
            nursery.cancel_scope.cancel()
    assert ctx.counters["restarted_groups"] == 1 and ctx.counters["restarted_tokens"] > 0
    assert (finished[0][0].versions == 1).all()  # generated again, wholly on the new weights


def test_the_request_queue_keeps_the_line_and_holds_back_requests_for_newer_weights():
    queue = RequestQueue()
    for name, min_version in (("a", 0), ("later", 2), ("b", 0), ("c", 0)):
        queue.push(name, min_version)
    queue.push("again", 0, first=True)
    assert [queue.pop(0) for _ in range(4)] == ["again", "a", "b", "c"]
    assert queue.pop(1) is None and queue.waits_for_weights(1) and len(queue) == 1
    # Once its weights are held it takes its place in line again: ahead of those behind it.
    queue.push("d", 0)
    assert [queue.pop(2), queue.pop(2), queue.pop(2)] == ["later", "d", None]
    assert not queue.waits_for_weights(2) and len(queue) == 0


def batcher(*overrides: str, partial: bool = True) -> SimBatcher:
    config = sim_config("roles.rollout.engine.response_len={kind='lognormal', median=40, sigma=1.0, min=1, max=300}",
                        "roles.rollout.engine.slots=8", *overrides)
    return SimBatcher(config.roles.rollout.engine, rng=np.random.default_rng(3), vocab=100, partial=partial,
                      strict=False, staleness=2, counters=collections.Counter())


def run_batcher(b: SimBatcher, times: list[float]) -> list[tuple[int, list[tuple[int, float, float]]]]:
    """Submit 12 groups (6 at first, 6 at 0.05 s), advance at each of `times`;
    each finished group's id, and (length, start, end) of each sample."""
    for g in range(6):
        b.submit(PromptGroup(group_id=g, prompt_ids=[1], n=3), 0.0, 0.0)
    b.admit(0.0)
    later = True
    for t in times:
        if later and t >= 0.05:
            b.advance(0.05)
            for g in range(6, 12):
                b.submit(PromptGroup(group_id=g, prompt_ids=[1], n=3), 0.05, 0.05)
            b.admit(0.05)
            later = False
        b.advance(t)
    return [(group.group_id, [(len(r.token_ids), r.stamps[Stage.ROLLOUT_START], r.stamps[Stage.ROLLOUT_END])
                              for r in responses]) for group, responses in b.outbox]


@pytest.mark.parametrize("per_seq", [0.0, 0.0002])
def test_the_batcher_plays_the_same_steps_however_often_it_is_advanced(per_seq):
    """Advanced once at the end, or at a thousand times on the way, it starts
    and ends every sequence at the same step: a late engine is not a slow one."""
    at_once, often = batcher(f"roles.rollout.engine.step_s_per_seq={per_seq}"), \
        batcher(f"roles.rollout.engine.step_s_per_seq={per_seq}")
    coarse = run_batcher(at_once, [0.049, 0.05, 5.0])
    fine = run_batcher(often, [i * 0.0005 for i in range(1, 10_001)])
    assert len(coarse) == 12 and [g for g, _ in coarse] == [g for g, _ in fine]
    for (_, a), (_, b) in zip(coarse, fine):
        assert [n for n, _, _ in a] == [n for n, _, _ in b]
        assert np.allclose([x[1:] for x in a], [x[1:] for x in b])
    assert at_once.counters["slot_s"] == pytest.approx(often.counters["slot_s"])
    if not per_seq:  # every sequence ran one token a step from its start, and a slot counts its tokens
        for _, spans in coarse:
            for n, start, end in spans:
                assert end - start == pytest.approx(n * 0.001)
        tokens = sum(n for _, spans in coarse for n, _, _ in spans)
        assert at_once.counters["slot_s"] == pytest.approx(tokens * 0.001)


@pytest.mark.parametrize("partial", [True, False])
def test_no_group_finishes_before_the_batcher_says_it_may(partial):
    """`wake_time` is never later than the next group's finish: woken then,
    the engine sends every group on time (with or without requests draining
    for weights)."""
    b = batcher("roles.rollout.engine.step_s_per_seq=0.0001", partial=partial)
    for g in range(12):
        b.submit(PromptGroup(group_id=g, prompt_ids=[1], n=3), 0.0, 0.0)
    b.admit(0.0)
    finished, wakes = 0, 0
    while b.active:
        if wakes == 2:
            b.incoming = 1  # weights arrive: without partial rollout, nothing new starts
        t = b.wake_time()
        assert t < math.inf
        b.advance(t - 1e-7)
        assert len(b.outbox) == finished
        b.advance(t)
        b.admit(t)
        finished, wakes = len(b.outbox), wakes + 1
    assert wakes < 12 * 3  # about one per group, not one per sequence
    if partial:
        assert finished == 12
    else:
        assert finished < 12 and len(b.pending) > 0 and b.draining


async def test_the_simulated_engine_counts_every_token_of_every_slot_whatever_the_lengths():
    config = sim_config("roles.rollout.engine.response_len={kind='lognormal', median=60, sigma=1.0, min=1, max=400}",
                        "roles.rollout.engine.slots=8", "roles.rollout.engine.step_s=0.0005")
    ctx = standalone_context(config, "rollout")
    engine = SimEngine(config.roles.rollout.engine, ctx)
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            await nursery.start(engine.run)
            for g in range(6):
                engine.submit(PromptGroup(group_id=g, prompt_ids=[1, 2], n=4), time.time())
            finished = await collect(engine, 6)
            nursery.cancel_scope.cancel()
    responses = [r for rs in finished.values() for r in rs]
    lengths = [len(r.token_ids) for r in responses]
    assert len(set(lengths)) > 5  # long-tailed, not fixed
    for r in responses:
        assert len(r.logprobs) == len(r.versions) == len(r.token_ids)
        assert ((r.token_ids >= 0) & (r.token_ids < config.task.vocab_size)).all() and (r.logprobs <= 0).all()
    # A slot is counted for each step its sequence was generating, however
    # late the engine woke: the slot-seconds are the tokens' steps.
    assert ctx.counters["slot_s"] == pytest.approx(sum(lengths) * 0.0005)
    assert engine.queues() == {"pending": 0, "active": 0}


async def test_a_group_that_waits_for_newer_weights_starts_when_they_arrive_and_others_go_first():
    config = sim_config("roles.rollout.engine.response_len={kind='fixed', value=50}", "roles.rollout.engine.slots=4",
                        "roles.trainer.engine.weights_bytes=4096")
    trainer = SimTrainerEngine(config.roles.trainer.engine, standalone_context(config, "trainer"))
    engine = SimEngine(config.roles.rollout.engine, standalone_context(config, "rollout"))
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            await nursery.start(trainer.serve)
            await nursery.start(engine.run)
            await engine.join_weights(WeightsZmq(address=trainer.server.address), [])
            engine.submit(PromptGroup(group_id=0, prompt_ids=[1], n=2, min_version=1), time.time())
            engine.submit(PromptGroup(group_id=1, prompt_ids=[1], n=2), time.time())
            first = await collect(engine, 1)
            assert list(first) == [1] and engine.queues() == {"pending": 2, "active": 0}
            await trainer.publish(1)
            assert await engine.update_weights(1, None) == 1
            second = await collect(engine, 1)
            nursery.cancel_scope.cancel()
    assert all((r.versions == 0).all() for r in first[1])
    assert all((r.versions == 1).all() for r in second[0])


# -- the stage service ------------------------------------------------------------------------


class Slow(StageService):
    """Takes `seconds` per batch, `max_batches` at once."""

    max_batches = 2
    seconds = 0.2

    async def process(self, batch: SampleBatch) -> SampleBatch:
        await trio.sleep(self.seconds)
        return batch


async def test_a_stage_service_registers_works_on_batches_and_accounts_its_time():
    """A fake controller: hello -> welcome -> ready, batches through, shutdown -> bye."""
    batch = examples()["SampleBatch"]
    async with (
        transport.open_router(bind="tcp://127.0.0.1:0") as router,
        transport.open_pull(bind="tcp://127.0.0.1:0") as downstream,
    ):
        service = Slow(spec(sim_config(), "reward", transport.bound_address(router)))
        with trio.fail_after(30):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(service.run)
                identity, hello = await router.recv()
                assert isinstance(hello, Hello) and hello.secret == "s" and hello.role.label == "reward"
                welcome = Welcome(schema_version=SCHEMA_VERSION, run_id="t", heartbeat_s=0.05,
                                  peers={"out": [transport.bound_address(downstream)]})
                await router.send(identity, welcome)
                assert isinstance((await router.recv())[1], Ready)
                async with transport.open_push(connect=hello.endpoints["in"]) as upstream:
                    started = time.monotonic()
                    for _ in range(4):
                        await upstream.send(batch)
                    got = []  # four batches, some of them joined into one (those done together)
                    while sum(len(b.groups) for b in got) < 4 * len(batch.groups):
                        got.append(await downstream.recv())
                    elapsed = time.monotonic() - started
                    assert all(set(b.group_ids) == set(batch.group_ids) for b in got)
                await router.send(identity, Shutdown(reason="done"))
                while not isinstance((await router.recv())[1], Bye):
                    pass
    assert elapsed >= 2 * Slow.seconds  # two at a time, four batches
    totals = service.clock.totals()
    assert totals["busy"] >= 2 * Slow.seconds and service.counters["samples"] == 4 * batch.n_samples


@contextlib.asynccontextmanager
async def stage_running(make: Any) -> AsyncIterator[tuple[Any, transport.Push, transport.Pull]]:
    """A stage service (`make(controller address)`) welcomed by a fake controller and running: it, a PUSH
    into it and a PULL of what it sends on; shut down (to its bye) on the way out."""
    async with (
        transport.open_router(bind="tcp://127.0.0.1:0") as router,
        transport.open_pull(bind="tcp://127.0.0.1:0") as downstream,
    ):
        service = make(transport.bound_address(router))
        with trio.fail_after(30):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(service.run)
                identity, hello = await router.recv()
                await router.send(identity, Welcome(schema_version=SCHEMA_VERSION, run_id="t", heartbeat_s=0.05,
                                                    peers={"out": [transport.bound_address(downstream)]}))
                assert isinstance((await router.recv())[1], Ready)
                async with transport.open_push(connect=hello.endpoints["in"]) as upstream:
                    yield service, upstream, downstream
                await router.send(identity, Shutdown(reason="done"))
                while not isinstance((await router.recv())[1], Bye):
                    pass


class Held(StageService):
    """Works on up to four batches at once, each until `release` is set."""

    max_batches = 4

    def __init__(self, spec):
        super().__init__(spec)
        self.release = trio.Event()

    async def process(self, batch: SampleBatch) -> SampleBatch:
        await self.release.wait()
        return batch


async def test_batches_a_stage_has_done_by_the_time_it_sends_go_on_as_one():
    """Three batches done at once go on as one message (fewer messages downstream and to the
    controller, the same groups); one done on its own afterwards goes on as it is."""
    groups = split(batch_of(4, 2))
    async with stage_running(lambda address: Held(spec(sim_config(), "reward", address))) as (
            service, upstream, downstream):
        for g in groups[:3]:
            await upstream.send(g)
        while service.queues()["working"] < 3:
            await trio.sleep(0.01)
        service.release.set()
        joined = await downstream.recv()
        await upstream.send(groups[3])
        alone = await downstream.recv()
    assert sorted(joined.group_ids) == [0, 1, 2] and joined.n_samples == 6
    assert alone.group_ids == [3]
    assert service.counters["groups"] == 4 and service.counters["samples"] == 8


class Passes(Slow):
    """Passes each batch on at once."""

    seconds = 0.0


async def test_a_stage_of_many_replicas_sends_fewer_messages_while_batches_keep_coming():
    """A replica of a stage of 25 (`MESSAGES_PER_S` = 50: a message every 0.5 s at most) sends eight
    groups that come 0.1 s apart in at most three messages (the first at once, the others joined),
    every group once."""
    groups = split(batch_of(8, 2))

    def make(address: str) -> Passes:
        return Passes(msgspec.structs.replace(spec(sim_config(), "reward", address), replicas=25))

    async with stage_running(make) as (_, upstream, downstream):
        for g in groups:
            await upstream.send(g)
            await trio.sleep(0.1)
        messages = []
        while sum(len(m.groups) for m in messages) < len(groups):
            messages.append(await downstream.recv())
    assert sorted(g for m in messages for g in m.group_ids) == list(range(8))
    assert messages[0].group_ids == [0] and len(messages) <= 3, [m.group_ids for m in messages]


async def test_a_rollout_of_many_replicas_sends_fewer_messages_while_groups_keep_finishing():
    """A replica of a rollout of 25 sends eight groups that finish 0.1 s apart in at most three messages
    (the first at once, the others joined), every group once, and an `Ack` of the groups of each."""
    from rlflow.protocol import Response

    service = RolloutService(msgspec.structs.replace(spec(sim_config(), "rollout"), replicas=25))
    response = Response(token_ids=np.arange(3, dtype=np.int32), logprobs=np.zeros(3, np.float32),
                        versions=np.zeros(3, np.int32), finish_reason=0)
    acks: list[Ack] = []

    class Control:
        async def send(self, msg: Ack) -> None:
            acks.append(msg)

    finishing, finished = trio.open_memory_channel(2)
    async with (
        transport.open_pull(bind="tcp://127.0.0.1:0") as downstream,
        transport.open_push(connect=transport.bound_address(downstream)) as out,
        trio.open_nursery() as nursery,
    ):
        nursery.start_soon(service.send_finished, out, Control(), finished)
        with trio.fail_after(30):
            for g in range(8):
                await finishing.send([(PromptGroup(group_id=g, prompt_ids=[1, 2], n=2), [response, response])])
                await trio.sleep(0.1)
            messages = []
            while sum(len(m.groups) for m in messages) < 8:
                messages.append(await downstream.recv())
        nursery.cancel_scope.cancel()
    assert sorted(g for m in messages for g in m.group_ids) == list(range(8))
    assert messages[0].group_ids == [0] and len(messages) <= 3, [m.group_ids for m in messages]
    assert [a.group_ids for a in acks] == [m.group_ids for m in messages]
    assert all(a.stage == Stage.ROLLOUT_END for a in acks)


async def test_every_stage_runs_the_shared_loop_and_hands_its_batches_on_through_shared_memory():
    """Every role between the rollout and the trainer (the registry's) is a `StageService`, and a stage's hop
    to a replica on its machine carries its tensors in shared memory, not through the socket."""
    from rlflow.roles import ROLES
    from rlflow.services import service_class

    stages = [role.name for role in ROLES if role.takes == role.hands_on == "samples"]
    assert stages == ["reward", "teacher", "critic"]
    assert all(issubclass(service_class(name), StageService) for name in stages)
    batch = batch_of(groups=4, n=8, length=200)  # token columns of 25 KiB
    async with (
        transport.open_router(bind="tcp://127.0.0.1:0") as router,
        transport.open_pull(bind="tcp://127.0.0.1:0") as downstream,
    ):
        service = Passes(spec(sim_config("cluster.shm_min_bytes=4096"), "reward", transport.bound_address(router)))
        with trio.fail_after(30):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(service.run)
                identity, hello = await router.recv()
                out = transport.bound_address(downstream)
                await router.send(identity, Welcome(schema_version=SCHEMA_VERSION, run_id="t", heartbeat_s=0.05,
                                                    peers={"out": [out]}, shm_peers=[out]))
                assert isinstance((await router.recv())[1], Ready)
                async with transport.open_push(connect=hello.endpoints["in"]) as upstream:
                    await upstream.send(batch)
                    got = await downstream.recv()
                await router.send(identity, Shutdown(reason="done"))
                while not isinstance((await router.recv())[1], Bye):
                    pass
    assert (got.response_ids.numpy() == batch.response_ids.numpy()).all() and got.group_ids == batch.group_ids
    assert service.counters["bytes_shared"] >= batch.response_ids.numpy().nbytes
    assert service.counters["bytes_out"] < batch.response_ids.numpy().nbytes  # the socket took the header


async def test_a_rollout_told_to_load_a_version_it_holds_says_so():
    """The trainer's weight server hands out its newest version: ordered to
    load v1 after v2 is out, the rollout loads v2; ordered to load v2 next,
    it answers at once that it holds v2 (else the controller's round waits
    for ever)."""
    config = sim_config("roles.trainer.engine.weights_bytes=4096")
    trainer = SimTrainerEngine(config.roles.trainer.engine, standalone_context(config, "trainer"))
    async with (
        transport.open_router(bind="tcp://127.0.0.1:0") as router,
        transport.open_pull(bind="tcp://127.0.0.1:0") as downstream,
        trio.open_nursery() as nursery,
    ):
        await nursery.start(trainer.serve)
        service = RolloutService(spec(config, "rollout", transport.bound_address(router)))
        nursery.start_soon(service.run)

        async def answer(kind: type) -> Any:
            while not isinstance(msg := (await router.recv())[1], kind):
                pass
            return msg

        with trio.fail_after(30):
            identity, hello = await router.recv()
            await router.send(identity, Welcome(schema_version=SCHEMA_VERSION, run_id="t", heartbeat_s=0.05,
                                                peers={"out": [transport.bound_address(downstream)]},
                                                weights=WeightsZmq(address=trainer.server.address)))
            await answer(Ready)
            await trainer.publish(1)
            await trainer.publish(2)
            await router.send(identity, UpdateWeights(version=1))
            loaded = await answer(WeightsLoaded)
            # What it fetched over ZeroMQ is what the trainer published: the same checksum.
            assert (loaded.version, loaded.checksum) == (2, trainer.checksum) and trainer.checksum.startswith("crc32:")
            await router.send(identity, UpdateWeights(version=2))
            assert await answer(WeightsLoaded) == WeightsLoaded(version=2, seconds=0.0, checksum=trainer.checksum)
            await router.send(identity, Shutdown(reason="done"))
            await answer(Bye)
        nursery.cancel_scope.cancel()
    assert service.counters["weight_updates"] == 1


async def test_an_evaluation_reads_one_version_and_the_weights_wait_for_it(monkeypatch):
    """A version ordered while the held-out set is being answered is loaded once it is answered: the
    evaluation reads the version it started on, whole."""
    from rlflow.models import SHIPPED

    config = sim_config("roles.trainer.engine.weights_bytes=4096", 'task={kind = "arith", heldout_size = 20}',
                        f'roles.rollout.model="{SHIPPED}"')
    trainer = SimTrainerEngine(config.roles.trainer.engine, standalone_context(config, "trainer"))
    answering = trio.Event()

    async def complete(self, prompt_ids, temperature):  # the simulated engine answers nothing; this one, slowly
        answering.set()
        await trio.sleep(0.05)
        return list(prompt_ids)

    monkeypatch.setattr(SimEngine, "complete", complete)
    async with (
        transport.open_router(bind="tcp://127.0.0.1:0") as router,
        transport.open_pull(bind="tcp://127.0.0.1:0") as downstream,
        trio.open_nursery() as nursery,
    ):
        await nursery.start(trainer.serve)
        service = RolloutService(spec(config, "rollout", transport.bound_address(router)))
        nursery.start_soon(service.run)
        said = []

        async def answer(kind: type) -> Any:
            while not isinstance(msg := (await router.recv())[1], kind):
                said.append(msg)
            said.append(msg)
            return msg

        with trio.fail_after(30):
            identity, hello = await router.recv()
            await router.send(identity, Welcome(schema_version=SCHEMA_VERSION, run_id="t", heartbeat_s=0.05,
                                                peers={"out": [transport.bound_address(downstream)]},
                                                weights=WeightsZmq(address=trainer.server.address)))
            await answer(Ready)
            await router.send(identity, Evaluate(version=0))
            await answering.wait()
            await trainer.publish(1)
            await router.send(identity, UpdateWeights(version=1))
            done = await answer(EvalDone)
            assert (done.version, done.version_end, done.metrics["problems"]) == (0, 0, 20)
            assert (await answer(WeightsLoaded)).version == 1
            assert not any(isinstance(m, WeightsLoaded) for m in said[: said.index(done)])
            await router.send(identity, Shutdown(reason="done"))
            await answer(Bye)
        nursery.cancel_scope.cancel()


@given(st.lists(st.integers(0, 60), max_size=120))
def test_group_ids_hold_exactly_the_ids_added_in_few_ranges(ids):
    held = GroupIds()
    held.update(ids)
    assert [i for i in range(62) if i in held] == sorted(set(ids))
    assert len(held) == len(set(ids))
    runs = sum(1 for i in sorted(set(ids)) if i - 1 not in set(ids))
    assert len(held.ranges) == runs  # adjacent ids always merge


def test_group_ids_of_a_long_run_stay_a_few_ranges():
    held = GroupIds()
    rng = np.random.default_rng(0)
    for step in range(2000):  # each step's 64 groups in any order; group 1000 never comes
        held.update(i for i in rng.permutation(range(64 * step, 64 * (step + 1))) if i != 1000)
    assert held.ranges == [(0, 1000), (1001, 128_000)]


def test_the_timeline_leaves_memory_at_each_heartbeat_and_ends_whole_in_the_trace(tmp_path):
    service = Service(msgspec.structs.replace(spec(sim_config(), "reward"), run_dir=str(tmp_path)))
    states = ["busy", "starved", "busy", "blocked"] * 50
    for i, state in enumerate(states):
        service.clock.set(state)
        if i % 7 == 0:
            service.heartbeat(i)
        assert len(service.clock.events) <= 7
    service.write_trace()
    folder = RunDir(tmp_path)
    trace = json.loads(folder.service_trace("reward-0").read_text())
    assert [state for _, state in trace["events"]] == ["idle", *states, "idle", "down"]
    assert [t for t, _ in trace["events"]] == sorted(t for t, _ in trace["events"])
    assert trace["role"] == "reward" and not folder.service_events("reward-0").exists()


def test_every_life_of_a_replica_stays_in_its_timeline_once(tmp_path):
    """A replica killed (its events left behind), its next incarnation, which
    ends cleanly, and a later session's: the trace keeps the three lives in
    order, each once, with the replica down between them; a reader sees a
    killed life before any life folds it in."""
    from rlflow import timeline

    def life(incarnation: int, run_id: str, states: list[str], *, clean: bool) -> Service:
        service = Service(msgspec.structs.replace(spec(sim_config(), "reward"), run_dir=str(tmp_path),
                                                  incarnation=incarnation, run_id=run_id))
        for state in states:
            service.clock.set(state)
            service.counters["samples"] += 1
            time.sleep(0.002)
            service.heartbeat(0)
        if clean:
            service.write_trace()
        return service

    folder = RunDir(tmp_path)
    life(0, "session-1", ["busy", "starved"], clean=False)  # killed: no trace written
    killed = timeline.read(folder, "reward-0")
    assert [(x["incarnation"], x["ended"]) for x in killed["lives"]] == [(0, "unknown")]
    assert timeline.names(folder) == ["reward-0"]
    life(1, "session-1", ["busy", "blocked"], clean=True)
    life(0, "session-2", ["busy"], clean=True)
    trace = json.loads(folder.service_trace("reward-0").read_text())
    assert [(x["run_id"], x["incarnation"], x["ended"]) for x in trace["lives"]] == [
        ("session-1", 0, "unknown"), ("session-1", 1, "shutdown"), ("session-2", 0, "shutdown")]
    states = [state for _, state in trace["events"]]
    assert states == ["idle", "busy", "starved", "down", "idle", "busy", "blocked", "idle", "down",
                      "idle", "busy", "idle", "down"]
    assert [t for t, _ in trace["events"]] == sorted(t for t, _ in trace["events"])
    assert trace["counters"] == {"samples": 3.0}  # the lives that could say theirs
    assert not folder.service_events("reward-0").exists()
    assert timeline.read(folder, "reward-0") == trace


# -- reward and teacher ----------------------------------------------------------------------


def batch_of(groups: int, n: int, length: int = 5) -> SampleBatch:
    from rlflow.protocol import Response

    rng = np.random.default_rng(0)
    items = []
    for g in range(groups):
        responses = [
            Response(token_ids=rng.integers(0, 50, length).astype(np.int32),
                     logprobs=-rng.random(length).astype(np.float32),
                     versions=np.zeros(length, np.int32), finish_reason=0)
            for _ in range(n)
        ]
        items.append((PromptGroup(group_id=g, prompt_ids=[1, 2, 3], n=n, reference="1"), responses))
    return build_batch(items)


@pytest.mark.parametrize("latency", [0.0, 0.001])
async def test_the_reward_service_scores_every_sample_and_keeps_failed_ones_unscored(latency):
    service = RewardService(spec(sim_config(f"roles.reward.engine.latency_s={{kind='fixed', value={latency}}}"),
                                 "reward"))
    batch = batch_of(3, 4)
    failed = SampleFailure(index=5, stage=Stage.ROLLOUT_END, kind="engine_error", message="refused")
    batch = msgspec.structs.replace(batch, failures=[failed])
    with trio.fail_after(30):
        scored = await service.process(batch)
    rewards = scored.rewards.numpy()
    assert np.isnan(rewards[5]) and not np.isnan(np.delete(rewards, 5)).any()
    assert set(np.delete(rewards, 5)) <= {0.0, 1.0}
    assert scored.failures == [failed]
    assert not np.isnan(scored.stamps.numpy()[:, Stage.REWARD_END]).any()


async def test_a_simulated_reward_scores_a_batch_at_once_as_it_would_sample_by_sample():
    """At zero latency the simulated task scores a whole batch at once (`score_all`): the rewards and
    their parts are those it gives sample by sample (as it still does where a sample has failed)."""
    service = RewardService(spec(sim_config("roles.reward.engine.latency_s={kind='fixed', value=0.0}"), "reward"))
    batch = batch_of(5, 8)
    batch = msgspec.structs.replace(batch, groups=[msgspec.structs.replace(g, group_id=2**40 + 7 * g.group_id)
                                                   for g in batch.groups])
    score, service.task.score = service.task.score, lambda *_: pytest.fail("scored sample by sample")
    at_once = await service.process(batch)
    service.task.score = score
    one_by_one = [service.task.score(view.group, view.index, view.response_ids) for view in samples(batch)]
    assert at_once.rewards.tolist() == [reward for reward, _ in one_by_one]
    assert 0 < sum(at_once.rewards.tolist()) < 40
    details = {"correct": [parts["correct"] for _, parts in one_by_one]}
    assert {k: v.tolist() for k, v in at_once.reward_details.items()} == details
    assert not np.isnan(at_once.stamps.numpy()[:, Stage.REWARD_END]).any()
    failed = SampleFailure(index=3, stage=Stage.ROLLOUT_END, kind="engine_error", message="refused")
    alone = await service.process(msgspec.structs.replace(batch, failures=[failed]))  # sample by sample
    assert np.isnan(alone.rewards.numpy()[3])
    assert np.array_equal(np.delete(alone.rewards.numpy(), 3), np.delete(at_once.rewards.numpy(), 3))


async def test_a_reward_that_hangs_is_a_failed_sample_and_the_service_goes_on():
    config = sim_config("roles.reward.engine={kind='task', timeout_s=1.0, concurrency=4}")
    service = RewardService(spec(config, "reward"))

    def score(group, index, response_ids):
        if index == 1:
            time.sleep(5)  # a verifier that hangs
        return 1.0, {"correct": 1.0}

    service.task.score = score
    with trio.fail_after(30):
        scored = await service.process(batch_of(1, 3))
    assert [f.index for f in scored.failures] == [1] and scored.failures[0].kind == "timeout"
    assert "roles.reward.engine.timeout_s" in scored.failures[0].message
    assert scored.rewards.tolist()[0] == 1.0 and scored.rewards.tolist()[2] == 1.0


async def test_the_teacher_service_adds_a_log_probability_per_token():
    service = TeacherService(spec(sim_config(), "teacher"))
    batch = batch_of(2, 2)
    with trio.fail_after(30):
        out = await service.process(batch)
    teacher = out.teacher_logprobs.numpy()
    assert out.teacher_logprobs.dtype == "float32" and teacher.shape == (batch.n_tokens,)
    assert (teacher <= 0).all()
    assert [len(s.teacher_logprobs) for s in samples(out)] == [5] * 4


# -- the trainer ---------------------------------------------------------------------------


class HeldTrainer(SimTrainerEngine):
    """The simulated trainer, but its first step ends when the test says so."""

    def __init__(self, cfg, ctx):
        super().__init__(cfg, ctx)
        self.training, self.go = trio.Event(), trio.Event()

    async def train(self, batch: SampleBatch) -> dict[str, float]:
        self.training.set()
        await self.go.wait()
        return {"loss": 0.0}


async def test_the_trainer_takes_groups_off_the_stream_while_a_step_trains(monkeypatch):
    """Groups that arrive during a step wait in the trainer, not upstream; one
    that is in the step being trained is a duplicate."""
    config = sim_config("run.batch_size=2", "run.steps=2", "roles.trainer.engine.weights_bytes=4096")
    engine: list[HeldTrainer] = []

    async def make_engine(ctx):
        engine.append(HeldTrainer(ctx.config.roles.trainer.engine, ctx))
        return engine[0]

    monkeypatch.setattr(trainer_service, "make_engine", make_engine)
    groups = split(batch_of(4, 2))
    async with transport.open_router(bind="tcp://127.0.0.1:0") as router:
        service = trainer_service.TrainerService(spec(config, "trainer", transport.bound_address(router)))

        async def next_of(kind):
            while not isinstance(msg := (await router.recv())[1], kind):
                pass
            return msg

        with trio.fail_after(30):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(service.run)
                identity, hello = await router.recv()
                await router.send(identity, Welcome(schema_version=SCHEMA_VERSION, run_id="t", heartbeat_s=0.05,
                                                    weights=hello.weights))
                await next_of(Ready)
                async with transport.open_push(connect=hello.endpoints["in"]) as upstream:
                    for g in groups[:2]:
                        await upstream.send(g)
                    await engine[0].training.wait()
                    for g in (groups[0], *groups[2:]):  # the first is in the step being trained
                        await upstream.send(g)
                    while len(service.buffer) < 2 or service.counters["duplicates"] < 1:
                        await trio.sleep(0.01)
                    assert not engine[0].go.is_set()  # all taken while the first step trains
                    engine[0].go.set()
                    assert (await next_of(StepDone)).acked == [0, 1]
                    assert (await next_of(StepDone)).acked == [2, 3]
                await router.send(identity, Shutdown(reason="done"))
                await next_of(Bye)
    assert service.counters["duplicates"] == 1 and service.counters["samples"] == 8


async def test_the_trainer_acknowledges_the_groups_already_waiting_in_one_message(monkeypatch):
    """Groups that wait in the trainer's socket when it reads are acknowledged to the controller
    together: one `Ack`, not one a message (a message to the controller per group at wide scale)."""
    config = sim_config("run.batch_size=32", "run.steps=1", "roles.trainer.engine.weights_bytes=4096")
    groups = split(batch_of(10, 2))
    # The trainer binds in-process endpoints here: over inproc a message sent is in the receiver's
    # queue when `send` returns, so all ten are waiting when the trainer first reads (over TCP they
    # cross ZeroMQ's I/O threads, and on a loaded machine some were still on the way after a second).
    names = iter(range(1_000_000))
    monkeypatch.setattr(transport, "tcp_address", lambda host="": f"inproc://trainer-ack-{next(names)}")
    async with transport.open_router(bind="tcp://127.0.0.1:0") as router:
        service = trainer_service.TrainerService(spec(config, "trainer", transport.bound_address(router)))
        acks = []
        with trio.fail_after(30):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(service.run)
                identity, hello = await router.recv()
                assert hello.endpoints["in"].startswith("inproc://")
                async with transport.open_push(connect=hello.endpoints["in"]) as upstream:
                    for g in groups:  # before the welcome: the trainer reads nothing yet
                        await upstream.send(g)
                    await router.send(identity, Welcome(schema_version=SCHEMA_VERSION, run_id="t",
                                                        heartbeat_s=0.05, weights=hello.weights))
                    while sum(len(a.group_ids) for a in acks) < len(groups):
                        msg = (await router.recv())[1]
                        if isinstance(msg, Ack) and msg.stage == Stage.TRAINER_RECEIVED:
                            acks.append(msg)
                await router.send(identity, Shutdown(reason="done"))
                closing = [(await router.recv())[1]]
                while not isinstance(closing[-1], Bye):
                    closing.append((await router.recv())[1])
    assert [sorted(a.group_ids) for a in acks] == [list(range(10))]
    # Its last heartbeat comes just before its goodbye, with its final counts (the run's status ends on them).
    last = closing[-2]
    assert isinstance(last, Heartbeat) and last.queues == {"groups": 10}
    assert all(beat.seq < last.seq for beat in closing[:-2] if isinstance(beat, Heartbeat))


# -- reward functions in the reward service ---------------------------------------------------


def functions_config(tmp_path: pathlib.Path, on_failure: str = "drop", module: str = "") -> C.Config:
    from models import tiny_model

    model = tiny_model(tmp_path / "model", tied=True)
    data = tmp_path / "d.jsonl"
    data.write_text("".join(f'{{"prompt": "{i}+{i}=", "answer": "{2 * i}"}}\n' for i in range(6)))
    functions = '{path = "rlflow.rewards:math", kwargs = {extract = "marker", marker = "#"}}'
    if module:
        functions += (f', {{path = "{module}:slow", weight = 0.0, timeout_s = 0.5}}, '
                      f'{{path = "{module}:flaky", timeout_s = 0.5}}')
    return C.load(text=f"""
[pools.p]
[roles.rollout]
pool = "p"
model = "{model}"
engine = {{ kind = "vllm" }}
[roles.reward]
pool = "p"
engine = {{ kind = "functions", on_failure = "{on_failure}", functions = [{functions}] }}
[roles.trainer]
pool = "p"
[task]
kind = "dataset"
train = "{data}"
""")


def answers(task, texts: dict[int, list[str]]) -> SampleBatch:
    """A batch of the given response texts for the given groups."""
    from rlflow.protocol import Response

    items = []
    for group_id, responses in texts.items():
        group = task.prompt(group_id, len(responses))
        out = []
        for text in responses:
            ids = np.asarray(task.tokenizer.encode(text, add_special_tokens=False), np.int32)
            out.append(Response(ids, np.zeros(len(ids), np.float32), np.zeros(len(ids), np.int32), 0))
        items.append((group, out))
    return build_batch(items)


async def test_reward_functions_score_the_decoded_response_against_the_reference(tmp_path):
    from rlflow.control.launch import resolve
    from rlflow.rewards import open_pool

    config = resolve(functions_config(tmp_path))
    service = RewardService(spec(config, "reward"))
    right = str(2 * service.task.index(0))  # group 0's row i asks for i+i
    with trio.fail_after(120):
        async with open_pool(config.roles.reward.engine.functions) as pool:
            service.pool = pool
            scored = await service.process(answers(service.task, {0: [f"1,#{right}", "#99", "no marker"]}))
    assert scored.rewards.tolist() == [1.0, 0.0, 0.0]
    assert scored.reward_details["math"].tolist() == [1.0, 0.0, 0.0]
    assert service.counters["reward.math.ok"] == 3


REWARDS_MODULE = '''
import os, time

def slow(sample):
    time.sleep(5)  # hangs: killed at its timeout
    return 1.0

def flaky(sample):
    if sample.response.startswith("#0"):
        raise ValueError("cannot score this one")
    return 0.5
'''


@pytest.mark.parametrize("policy", ["drop", "fallback"])
@pytest.mark.slow  # waits out reward retries
async def test_a_sample_a_function_cannot_score_drops_its_group_or_falls_back(tmp_path, monkeypatch, policy):
    from rlflow.control.launch import resolve
    from rlflow.protocol import Dropped
    from rlflow.rewards import open_pool
    from rlflow.services.base import Control

    (tmp_path / "user_rewards.py").write_text(REWARDS_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    config = resolve(functions_config(tmp_path, policy, "user_rewards"))
    async with (
        transport.open_router(bind="tcp://127.0.0.1:0") as router,
        transport.open_dealer(connect=transport.bound_address(router)) as dealer,
    ):
        service = RewardService(spec(config, "reward"))
        service.control = Control(dealer, service.spec)
        with trio.fail_after(120):
            async with open_pool(config.roles.reward.engine.functions) as pool:
                service.pool = pool
                scored = await service.process(answers(service.task, {3: ["#0 x", "#1"], 4: ["#2", "#4"]}))
            if policy == "drop":
                _, msg = await router.recv()
    if policy == "drop":
        assert isinstance(msg, Dropped) and msg.group_ids == [3] and "flaky:error" in msg.reason
        assert scored.group_ids == [4] and not scored.failures  # the other group goes on
        assert service.counters["dropped_groups"] == 1
    else:
        assert scored.group_ids == [3, 4]
        assert scored.reward_details["flaky.failed"].tolist() == [1.0, 0.0, 0.0, 0.0]
    # The weight-0 function that hangs is killed every time and logged, never failing a sample.
    assert service.counters["reward.slow.timeout"] == 4


def test_a_step_is_cut_from_the_messages_its_groups_came_in():
    """`gather` makes the batch of held groups, some of several messages, some not all of one (and one
    group a batch of its own), with the rows and columns a batch made group by group has."""
    first, second = batch_of(4, 3), batch_of(3, 2, length=7)
    second = msgspec.structs.replace(second, groups=[msgspec.structs.replace(g, group_id=10 + g.group_id)
                                                     for g in second.groups])
    alone = split(first)[3]

    def held(batch: SampleBatch, seq: int, index: int) -> HeldGroup:
        a = sum(g.size for g in batch.groups[:index])
        return HeldGroup(batch.groups[index].group_id, None, seq, batch, index, a, a + batch.groups[index].size)

    chosen = [held(first, 1, 0), held(first, 1, 2), held(second, 2, 0), held(second, 2, 1), held(second, 2, 2),
              held(alone, 3, 0)]
    batch = gather(chosen)
    expected = concat([split(first)[0], split(first)[2], *split(second), alone])
    assert batch.group_ids == [0, 2, 10, 11, 12, 3]
    assert batch == expected
    assert gather([held(second, 2, i) for i in range(3)]) is second  # a whole message, as it came
