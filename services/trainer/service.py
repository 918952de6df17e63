"""The trainer service: consumes groups, takes optimizer steps, publishes weights.

Its loop (rank 0): pull groups until a step's worth (`run.batch_size`) has
arrived, dropping duplicates (a reissued group that arrives twice), failed
samples, with the strict staleness check groups too stale to train on
(those are reported as `Expired` so that the controller reissues them),
and with `run.filter = "signal"` groups whose rewards are all equal
(reported as `Dropped` with reason `no_signal`: the controller grants
other prompts in their place);
deal the step's samples into a share per rank and send each other rank its
share; train on its own (in lock step with the others; not in a step the
config holds the policy through, `Config.holds_policy`); publish policy
version v+1 and tell the controller (`WeightsReady`), then acknowledge the
step's groups (`StepDone`). It never waits for the rollout to load the new
weights: every rank sends them when the controller says so (`SendWeights`).
Groups are taken off the stream the moment they arrive, also while a step
trains, so that a training step never holds up the roles upstream (the
credits bound how many can be outstanding).

The other ranks (a trainer of several replicas) have no stream of their
own: their loop takes each step's share from rank 0, trains, publishes and
checkpoints at the same steps. Only rank 0 talks to the controller about
steps; every rank says hello, heartbeats and bye like any replica.
"""

from __future__ import annotations

import bisect
import contextlib
import json
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import trio
from rlflow.protocol import (
    NO_SIGNAL,
    WEIGHT_GROUP_BROKEN,
    Ack,
    Dropped,
    ErrorReport,
    Expired,
    FinishReason,
    SampleBatch,
    SendWeights,
    Shutdown,
    Stage,
    StepDone,
    WeightsGroup,
    WeightsReady,
    WeightsZmq,
    concat_groups,
    stamp,
    take,
)
from rlflow.services.base import Control, Service, bind_host, shm_settings, takes_shm
from rlflow.services.trainer.engine import TrainerEngine, make_engine

from rlflow.algo.staleness import too_stale
from rlflow.roles import ROLES, hook
from rlflow.data import transport

#: Messages in, at most, whose groups one `Ack` acknowledges: those already waiting when one is read.
#: (One `Ack` a message was a message to the controller per group at 16,384 slots, where the reward
#: role sends each group on as it is scored.)
ACK_EVERY = 64


@dataclass(slots=True)
class Held:
    """A group in the trainer's buffer: group `index` of `batch`, its rows `a` to `b` (the message it came
    in, kept whole: a step's batch is cut from the messages, each column copied once (`gather`), not made of
    a batch per group, which at 16,384 slots cost the trainer more than the rest of its work on a group)."""

    group_id: int
    oldest: int | None
    """The policy version of its oldest token (None: it has none)."""
    seq: int
    """Which message it came in (they count up)."""
    batch: SampleBatch
    index: int
    a: int
    b: int


class TrainerService(Service):
    """Trains on what the stream brings, within the staleness bound."""

    def __init__(self, spec):
        super().__init__(spec)
        self.step = 0
        self.acked = GroupIds()
        self.buffer: list[Held] = []
        #: Ids of the groups in `buffer` or in the step being trained: one that arrives again meanwhile is a duplicate.
        self._held: set[int] = set()
        self._messages = 0
        self._arrived = trio.Event()
        self.engine: TrainerEngine | None = None
        self._nbytes = 0
        self._checksum = ""
        #: The newest generation of the weight group the controller asked for (0: the first).
        self._asked = 0
        #: What the run's roles that attach columns say of them each step (`RoleSpec.batch_stats`), resolved once.
        self._stats_of = [hook(role.batch_stats) for role in ROLES
                          if role.batch_stats and getattr(self.config.roles, role.name, None) is not None]

    def queues(self) -> dict[str, int]:
        return {"groups": len(self.buffer)}

    @property
    def lead(self) -> bool:
        """Rank 0: the trainer's face to the stream and the controller."""
        return self.spec.rank == 0

    async def main(self, control: Control) -> None:
        engine = self.engine = await make_engine(self.context())
        bind = transport.tcp_address(bind_host(self.config))
        # Rank 0 takes the stream; each other rank, its shares from rank 0.
        inbox_name = "in" if self.lead else "share"
        try:
            async with (
                transport.open_pull(
                    bind=bind, curve=self.spec.curve, name=f"{self.spec.name}/{inbox_name}", shm=takes_shm(self.config)
                ) as inbox,
                trio.open_nursery() as nursery,
            ):
                self.sockets.append(inbox)
                endpoints = {inbox_name: transport.bound_address(inbox)}
                hello: dict = {}
                if self.lead:
                    await nursery.start(engine.serve)
                    weights, layout = engine.offer()
                    if isinstance(weights, WeightsZmq):
                        endpoints["weights"] = weights.address
                    hello = {"weights": weights, "layout": layout, "adapter": engine.adapter}
                welcome = await control.hello(endpoints=endpoints, **hello)
                # Above 0 when resuming (the controller has cut the record of later steps: control.record).
                self.step = self.version = welcome.version
                await engine.connect(welcome.weights)
                self.say("up, engine %s, rank %d of %d", type(engine).__name__, self.spec.rank, self.spec.replicas)
                sends, to_send = trio.open_memory_channel(2)
                nursery.start_soon(control.heartbeats, self.heartbeat, welcome.heartbeat_s)
                nursery.start_soon(self.send_weights, to_send, control)
                if self.lead:
                    nursery.start_soon(self.receive, inbox, control)
                    nursery.start_soon(self.train, inbox, welcome.peers.get("shares", []), welcome.shm_peers, control)
                else:
                    nursery.start_soon(self.follow, inbox)
                await control.ready(self.version)
                async for msg in control:
                    match msg:
                        case SendWeights(version=version, transfer=transfer):
                            if transfer is not None:
                                self._asked = max(self._asked, transfer.generation)
                            if not self.lead:  # the other ranks only gather: rank 0 hosts the group
                                transfer = None
                            # One at a time, in the order asked: every rank gathers in that order.
                            await sends.send((version, transfer, self._asked))
                        case Shutdown(reason=reason):
                            self.say("shutting down (%s)", reason)
                            break
                nursery.cancel_scope.cancel()
        finally:
            with trio.move_on_after(10) as scope:
                scope.shield = True
                await engine.close()

    async def train(self, inbox: transport.Pull, shares: list[str], shm_peers: list[str], control: Control) -> None:
        run = self.config.run
        async with contextlib.AsyncExitStack() as stack:
            # One PUSH per other rank, in rank order: rank r's share goes to shares[r - 1].
            outs = [
                await stack.enter_async_context(
                    transport.open_push(
                        connect=address,
                        curve=self.spec.curve,
                        name=f"{self.spec.name}/share-{r}",
                        shm=shm_settings(self.config, self.spec.run_id),
                        shm_peers=shm_peers,
                    )
                )
                for r, address in enumerate(shares, start=1)
            ]
            if len(outs) != self.spec.replicas - 1:
                raise RuntimeError(f"{self.spec.replicas} trainer ranks, but the welcome names {len(outs)} share "
                                   "addresses for the others")
            waited, filtered = self.clock.totals()["starved"], self.counters["no_signal_groups"]
            while self.step < run.steps:
                groups = await self.collect(inbox, control, run.batch_size)
                batch = gather(groups)
                versions = batch.versions.numpy()
                # Versions behind the trainer's, per token (from the extremes: no array as long as the batch).
                staleness = (self.version - versions.mean(), self.version - versions.min()) if versions.size \
                    else (0.0, 0.0)
                self._record_lengths(batch, [self._oldest(g) for g in groups])
                with self.clock.state("busy"):
                    started = time.monotonic()
                    stats, parts = await self.engine.deal(batch)
                    for out, part in zip(outs, parts[1:], strict=True):
                        await out.send(part)
                    metrics = {**stats, **self._batch_stats(batch)}
                    if self.held:
                        metrics["actor_held"] = 1.0
                    else:
                        metrics.update(await self.engine.train(parts[0]))
                    metrics["train_s"] = time.monotonic() - started
                await self._stepped()
                await control.send(WeightsReady(version=self.version, nbytes=self._nbytes, checksum=self._checksum))
                if await self._checkpoint():
                    metrics["checkpoint"] = float(self.step)
                rewards = batch.rewards.numpy() if batch.rewards is not None else np.zeros(0)
                ids = batch.group_ids
                self.acked.update(ids)
                self._release(ids)
                metrics.update(
                    samples=float(batch.n_samples),
                    tokens=float(batch.n_tokens),
                    reward_mean=float(np.nanmean(rewards)) if rewards.size else float("nan"),
                    staleness_mean=float(staleness[0]),
                    staleness_max=float(staleness[1]),
                )
                metrics.update(episode_stats(batch))
                if (transit := transit_s(batch)) is not None:
                    metrics["transit_s"] = transit
                # What the step waited for groups (the credits' pace reads it: `run.credits`), and
                # the groups the signal filter dropped meanwhile.
                starved = self.clock.totals()["starved"]
                metrics["starved_s"], waited = starved - waited, starved
                if run.filter == "signal":
                    metrics["no_signal_groups"] = float(self.counters["no_signal_groups"] - filtered)
                    filtered = self.counters["no_signal_groups"]
                self.counters["samples"] += batch.n_samples
                self.counters["tokens"] += batch.n_tokens
                await control.send(StepDone(step=self.step - 1, version=self.version, acked=ids, metrics=metrics))
        self.clock.set("idle")

    async def follow(self, inbox: transport.Pull) -> None:
        """A rank above 0: each step, its share from rank 0, in step order."""
        run = self.config.run
        while self.step < run.steps:
            with self.clock.state("starved"):
                share = self.checked_batch(await inbox.recv())
            if share is None:
                continue
            if not self.held:
                with self.clock.state("busy"):
                    await self.engine.train(share)
            await self._stepped()
            await self._checkpoint()
            self.counters["samples"] += share.n_samples
            self.counters["tokens"] += share.n_tokens
        self.clock.set("idle")

    @property
    def held(self) -> bool:
        """Whether this step leaves the policy as it is (`Config.holds_policy`). The
        version still advances, so the pipeline's clock keeps one step per batch."""
        return self.config.holds_policy(self.step)

    async def _stepped(self) -> None:
        """After an optimizer step: the new version, its weights ready to send."""
        self.step += 1
        self.version = self.step
        with self.clock.state("loading"):
            self._nbytes, self._checksum = await self.engine.publish(self.version)

    async def _checkpoint(self) -> bool:
        """A checkpoint, if one is due at this step (every rank takes part); whether one was written."""
        run, every = self.config.run, self.engine.checkpoint_every
        if self.run_dir is None or not (self.step == run.steps or (every and self.step % every == 0)):
            return False
        with self.clock.state("loading"):
            return await self.engine.save(self.run_dir.checkpoint(self.step),
                                          {"step": self.step, "version": self.version})

    async def send_weights(self, to_send: trio.MemoryReceiveChannel, control: Control) -> None:
        """Send each version asked for, in order; a send that fails (a receiver
        died mid-way) is reported: the controller makes a new generation of the group.

        Rank 0 hosts a new generation when its turn comes, and only then says
        where (the receivers told of it find it listening). An order of a
        generation the controller has since replaced is gathered (every rank
        gathers every order, in order) but not broadcast: its receivers are
        told to join the newer one, so hosting it would wait for nobody; and a
        send that fails after a newer generation was asked for is not
        reported: the rebuild it would ask for is under way."""
        async for version, transfer, generation in to_send:
            superseded = generation < self._asked
            try:
                if transfer is not None and not superseded:
                    transfer = self.engine.new_group(transfer)
                    await control.send(WeightsGroup(transfer=transfer))
                await self.engine.send(version, None if superseded else transfer, broadcast=not superseded)
            except Exception as exc:
                self.counters["failed_sends"] += 1
                self.log.warning("[%s] sending weights v%d (generation %d) failed: %s: %s", self.spec.name, version,
                                 generation, type(exc).__name__, exc)
                if self.lead and generation == self._asked:
                    await control.send(ErrorReport(fatal=False, kind=WEIGHT_GROUP_BROKEN,
                                                   message=f"sending v{version}: {type(exc).__name__}: {exc}"[:500]))

    def _batch_stats(self, batch: SampleBatch) -> dict[str, float]:
        """What the roles of this run that attached columns say of them in this step (`RoleSpec.batch_stats`)."""
        return {key: value for stats_of in self._stats_of for key, value in stats_of(batch, self.step).items()}

    def _record_lengths(self, batch: SampleBatch, oldest: list[int]) -> None:
        """Per step: the response lengths (for `rlflow plan` to replay) and,
        per group, its id and the oldest policy version of its tokens."""
        if self.run_dir is None:
            return
        path = self.run_dir.lengths(self.spec.rank)
        path.parent.mkdir(parents=True, exist_ok=True)
        record = {
            "step": self.step,
            "lengths": np.diff(batch.response_offsets.numpy()).tolist(),
            "groups": batch.group_ids,
            "oldest": oldest,
        }
        with open(path, "a") as f:
            f.write(json.dumps(record) + "\n")

    async def receive(self, inbox: transport.Pull, control: Control) -> None:
        """Add every group to the buffer as it arrives."""
        async for msg in inbox:
            await self._accept_all(inbox, control, first=msg)
            self._arrived.set()
            # The step's turn between two takes (its training may have ended meanwhile): a long queue
            # holds this loop ACK_EVERY messages at a time, not until it is empty.
            await trio.lowlevel.checkpoint()

    async def collect(self, inbox: transport.Pull, control: Control, want: int) -> list[Held]:
        """The next `want` groups fit to train on, oldest policy first (in the order they came).

        Everything already delivered is in the buffer, so that the groups
        closest to the staleness bound are trained on before they pass it.
        With `staleness_check = "strict"`, groups that have passed it are
        dropped and reported for reissue (also those that waited here
        across a step).
        """
        while True:
            while await self._accept_all(inbox, control):  # what `receive` has not got to yet
                pass
            await self._drop_stale(control)
            if len(self.buffer) >= want:
                break
            self._arrived = trio.Event()
            with self.clock.state("starved"):
                await self._arrived.wait()
        self.buffer.sort(key=self._oldest)
        taken, self.buffer = self.buffer[:want], self.buffer[want:]
        # A reproducible run trains a step's groups in one order, whatever order they came in.
        taken.sort(key=(lambda h: h.group_id) if self.config.run.deterministic else (lambda h: (h.seq, h.index)))
        return taken

    def _oldest(self, held: Held) -> int:
        """The policy version of a group's oldest token."""
        return self.version if held.oldest is None else held.oldest

    def _release(self, group_ids: list[int]) -> None:
        """These groups are no longer held (trained on, or dropped)."""
        self._held.difference_update(group_ids)

    async def _drop_stale(self, control: Control) -> None:
        """Strict check: drop buffered groups past the bound, for reissue."""
        if self.config.run.staleness_check != "strict":
            return
        k = self.config.run.max_staleness
        keep, expired = [], []
        for group in self.buffer:
            (expired if too_stale(self._oldest(group), self.version, k) else keep).append(group)
        self.buffer = keep
        self._release([h.group_id for h in expired])
        if expired:
            self.counters["stale_groups"] += len(expired)
            await control.send(Expired(group_ids=[h.group_id for h in expired], reason="stale"))

    async def _accept_all(self, inbox: transport.Pull, control: Control, first: Any = None) -> int:
        """Accept `first` (if given) and the messages already waiting in `inbox`, up to `ACK_EVERY` in
        all, and acknowledge their groups to the controller in one `Ack`; how many messages it took."""
        received: list[int] = []
        taken = 0
        if first is not None:
            received += await self._accept(first, control)
            taken += 1
        while taken < ACK_EVERY and (msg := inbox.recv_nowait()) is not None:
            received += await self._accept(msg, control)
            taken += 1
        if received:
            await control.send(Ack(stage=Stage.TRAINER_RECEIVED, group_ids=received))
        return taken

    async def _accept(self, msg, control: Control) -> list[int]:
        """Add the groups of one message to the buffer (checked, deduplicated); the groups added."""
        msg = self.checked_batch(msg)
        if msg is None:
            return []
        msg = stamp(msg, Stage.TRAINER_RECEIVED, time.time())
        self._messages += 1
        columns = _columns(msg)
        failed_rows = {f.index for f in msg.failures}
        signal_filter = self.config.run.filter == "signal"
        failed_groups: list[int] = []
        errors: list[str] = []
        received: list[int] = []
        no_signal: list[int] = []
        b = 0
        for index, info in enumerate(msg.groups):
            a, b = b, b + info.size
            group_id = info.group_id
            if group_id in self.acked or group_id in self._held:
                self.counters["duplicates"] += 1
                continue
            held, (r_off, versions, rewards) = Held(group_id, None, self._messages, msg, index, a, b), columns
            failed = [f for f in msg.failures if a <= f.index < b] if failed_rows else []
            if failed:  # the group's other samples, as a batch of its own
                self.counters["failed_samples"] += len(failed)
                row = info.meta.get("row")
                why = (f"row {row}: " if row else "") + f"{failed[0].kind}: {failed[0].message}"
                alone = take(msg, [i for i in range(a, b) if i not in failed_rows])
                held, (r_off, versions, rewards) = Held(group_id, None, self._messages, alone, 0, 0,
                                                        alone.n_samples), _columns(alone)
            if held.a == held.b:
                failed_groups.append(group_id)
                errors.append(why[:500] if failed else "no samples")
                continue
            if signal_filter and not _differ(rewards[held.a : held.b]):
                no_signal.append(group_id)
                # Dropped for good: a copy granted again after a loss is a duplicate too.
                self.acked.add(group_id)
                continue
            if r_off[held.b] > r_off[held.a]:
                held.oldest = int(versions[r_off[held.a] : r_off[held.b]].min())
            self.buffer.append(held)
            self._held.add(group_id)
            received.append(group_id)
        if failed_groups:
            await control.send(Expired(group_ids=failed_groups, reason="every sample failed", errors=errors))
        if no_signal:
            self.counters["no_signal_groups"] += len(no_signal)
            await control.send(Dropped(group_ids=no_signal, reason=NO_SIGNAL))
        return received


def _columns(batch: SampleBatch) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A batch's response offsets, tokens' policy versions and rewards (none: an empty array)."""
    rewards = batch.rewards.numpy() if batch.rewards is not None else np.zeros(0)
    return batch.response_offsets.numpy(), batch.versions.numpy(), rewards


def gather(held: list[Held]) -> SampleBatch:
    """One batch of the `held` groups, in order: their rows of the messages they came in, copied once
    (`concat_groups` of each run of them that lie next to each other in one message)."""
    pieces: list[list] = []
    for h in held:
        if pieces and pieces[-1][0] is h.batch and pieces[-1][2] == h.index:
            pieces[-1][2] += 1
        else:
            pieces.append([h.batch, h.index, h.index + 1])
    return concat_groups(pieces)


def _differ(rewards: np.ndarray) -> bool:
    return rewards.size > 1 and float(np.nanmax(rewards)) != float(np.nanmin(rewards))


def has_signal(group: SampleBatch) -> bool:
    """Whether a group's rewards differ (group-relative advantages are all 0 where they do not;
    a single sample has no group to differ from)."""
    return _differ(group.rewards.numpy() if group.rewards is not None else np.zeros(0))


def transit_s(batch: SampleBatch) -> float | None:
    """The mean time of a step's samples from the rollout's end to the trainer (scoring, and waiting to
    be sent on, at each role between), where they carry both stamps."""
    stamps = batch.stamps.numpy()
    if stamps.shape[1] <= Stage.TRAINER_RECEIVED:
        return None
    transit = stamps[:, Stage.TRAINER_RECEIVED] - stamps[:, Stage.ROLLOUT_END]
    return float(np.nanmean(transit)) if np.isfinite(transit).any() else None


def episode_stats(batch: SampleBatch) -> dict[str, float]:
    """A step's episodes (a run with an environment; else nothing): their turns, the share cut
    off (at the turn or token limit), and the environment's mean reward at each turn."""
    if batch.env_rewards is None:
        return {}
    per_turn = batch.env_rewards.numpy()
    played = (~np.isnan(per_turn)).sum(axis=1)
    finish = batch.finish_reason.numpy()
    out = {"episode_turns_mean": float(played.mean()) if len(played) else 0.0,
           "episode_cut_share": float(np.isin(finish, (FinishReason.LENGTH, FinishReason.TURNS)).mean())
           if len(finish) else 0.0}
    for k in range(per_turn.shape[1]):
        column = per_turn[:, k]
        if (~np.isnan(column)).any():
            out[f"env_reward_turn{k + 1}"] = float(np.nanmean(column))
    return out


class GroupIds:
    """A set of group ids held as sorted, disjoint ranges [start, end).

    The trainer remembers every group it trained on, to drop a reissued
    copy that arrives later. Groups are granted in id order and trained
    within the staleness bound, so the ids it has seen are one range plus a
    few holes (groups still on their way, and each group dropped for good):
    memory that does not grow with the length of the run, as a set of every
    id would.
    """

    def __init__(self) -> None:
        self._starts: list[int] = []
        self._ends: list[int] = []

    def __contains__(self, group_id: int) -> bool:
        i = bisect.bisect_right(self._starts, group_id) - 1
        return i >= 0 and group_id < self._ends[i]

    def add(self, group_id: int) -> None:
        i = bisect.bisect_right(self._starts, group_id) - 1  # the range that starts at or before it
        if i >= 0 and group_id < self._ends[i]:
            return
        after_left = i >= 0 and self._ends[i] == group_id
        before_right = i + 1 < len(self._starts) and self._starts[i + 1] == group_id + 1
        if after_left and before_right:  # fills the hole between two ranges
            self._ends[i] = self._ends.pop(i + 1)
            del self._starts[i + 1]
        elif after_left:
            self._ends[i] = group_id + 1
        elif before_right:
            self._starts[i + 1] = group_id
        else:
            self._starts.insert(i + 1, group_id)
            self._ends.insert(i + 1, group_id + 1)

    def update(self, group_ids: Iterable[int]) -> None:
        for group_id in group_ids:
            self.add(group_id)

    def __len__(self) -> int:
        return sum(end - start for start, end in zip(self._starts, self._ends))

    @property
    def ranges(self) -> list[tuple[int, int]]:
        return list(zip(self._starts, self._ends))
