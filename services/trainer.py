"""The trainer service: consumes groups, takes optimizer steps, publishes weights.

Its loop: pull groups until a step's worth (`run.batch_size`) has arrived,
dropping duplicates (a reissued group that arrives twice), failed samples
and, with the strict staleness check, groups too stale to train on (those
are reported as `Expired` so that the controller reissues them); train;
publish policy version v+1 and tell the controller (`WeightsReady`), then
acknowledge the step's groups (`StepDone`). It never waits for the rollout
to load the new weights.
"""

from __future__ import annotations

import json
import pathlib
import time

import msgspec
import numpy as np
import trio

from rlflow import transport
from rlflow.config import SimTrainer, TorchTrainer
from rlflow.protocol import (
    Codec,
    Expired,
    SampleBatch,
    Shutdown,
    Stage,
    StepDone,
    Tensor,
    UpdateWeights,
    WeightsMessage,
    WeightsPayload,
    WeightsReady,
    WeightsRequest,
    concat,
    split,
    take,
)
from rlflow.service import Control, Service, bind_address

#: Largest tensor of a simulated weight payload (a model's layer).
SIM_TENSOR_BYTES = 4 << 20


class TrainerService(Service):
    """Trains on what the stream brings, within the staleness bound."""

    def __init__(self, spec):
        super().__init__(spec)
        self.step = 0
        self.acked: set[int] = set()
        self.buffer: list[SampleBatch] = []
        self.engine = None

    def queues(self) -> dict[str, int]:
        return {"groups": len(self.buffer)}

    async def main(self, control: Control) -> None:
        engine = self.engine = await make_engine(self)
        async with (
            transport.open_pull(bind=bind_address(self.spec), name=f"{self.spec.name}/in") as inbox,
            trio.open_nursery() as nursery,
        ):
            self.sockets.append(inbox)
            await nursery.start(engine.serve)
            welcome = await control.hello(endpoints={"in": transport.bound_address(inbox)}, info=engine.hello_info())
            self.step = self.version = welcome.version  # above 0 when resuming
            await engine.connect(welcome.info)
            self.say("up, engine %s", type(engine).__name__)
            nursery.start_soon(control.heartbeats, self.heartbeat, welcome.heartbeat_s)
            nursery.start_soon(self.train, inbox, control)
            await control.ready(self.version)
            async for msg in control:
                match msg:
                    case UpdateWeights(version=version):
                        nursery.start_soon(engine.send, version)
                    case Shutdown(reason=reason):
                        self.say("shutting down (%s)", reason)
                        break
            nursery.cancel_scope.cancel()

    async def train(self, inbox: transport.Pull, control: Control) -> None:
        run = self.config.run
        while self.step < run.steps:
            groups = await self.collect(inbox, control, run.batch_size // self.spec.replicas)
            batch = concat(groups)
            staleness = self.version - batch.versions.numpy()
            self._record_lengths(batch)
            with self.clock.state("busy"):
                started = time.monotonic()
                metrics = await self.engine.train(batch)
                metrics["train_s"] = time.monotonic() - started
            self.step += 1
            self.version = self.step
            with self.clock.state("loading"):
                ready = await self.engine.publish(self.version)
            await control.send(ready)
            every = getattr(self.engine, "checkpoint_every", 0)
            if self.step == run.steps or (every and self.step % every == 0):
                with self.clock.state("loading"):
                    path = await self.engine.save(self.step)
                if path is not None:
                    metrics["checkpoint"] = float(self.step)
            rewards = batch.rewards.numpy() if batch.rewards is not None else np.zeros(0)
            ids = batch.group_ids
            self.acked.update(ids)
            metrics.update(
                samples=float(batch.n_samples),
                tokens=float(batch.n_tokens),
                reward_mean=float(np.nanmean(rewards)) if rewards.size else float("nan"),
                staleness_mean=float(staleness.mean()) if staleness.size else 0.0,
                staleness_max=float(staleness.max()) if staleness.size else 0.0,
            )
            self.counters["samples"] += batch.n_samples
            self.counters["tokens"] += batch.n_tokens
            await control.send(StepDone(step=self.step - 1, version=self.version, acked=ids, metrics=metrics))
        self.clock.set("idle")

    def _record_lengths(self, batch: SampleBatch) -> None:
        """Per step: the response lengths (for `rlflow plan` to replay) and,
        per group, its id and the oldest policy version of its tokens."""
        if not self.spec.run_dir:
            return
        folder = pathlib.Path(self.spec.run_dir) / "trace"
        folder.mkdir(parents=True, exist_ok=True)
        lengths = np.diff(batch.response_offsets.numpy()).tolist()
        groups = split(batch)
        record = {
            "step": self.step,
            "lengths": lengths,
            "groups": [g.groups[0].group_id for g in groups],
            "oldest": [self._oldest(g) for g in groups],
        }
        with open(folder / f"lengths-{self.spec.rank}.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")

    async def collect(self, inbox: transport.Pull, control: Control, want: int) -> list[SampleBatch]:
        """The next `want` groups fit to train on, oldest policy first.

        Everything already delivered is taken off the stream, so that the
        groups closest to the staleness bound are trained on before they
        pass it. With `staleness_check = "strict"`, groups that have passed
        it are dropped and reported for reissue (also those that waited here
        across a step).
        """
        while True:
            await self._drop_stale(control)
            if len(self.buffer) >= want:
                msg = inbox.recv_nowait()
                if msg is None:
                    break
            else:
                with self.clock.state("starved"):
                    msg = await inbox.recv()
            await self._accept(msg, control)
        self.buffer.sort(key=self._oldest)
        taken, self.buffer = self.buffer[:want], self.buffer[want:]
        return taken

    def _oldest(self, group: SampleBatch) -> int:
        """The policy version of a group's oldest token."""
        return int(group.versions.numpy().min()) if group.n_tokens else self.version

    async def _drop_stale(self, control: Control) -> None:
        """Strict check: drop buffered groups past the bound, for reissue."""
        if self.config.run.staleness_check != "strict":
            return
        k = self.config.run.staleness
        keep, expired = [], []
        for group in self.buffer:
            (expired if self.version - self._oldest(group) > k else keep).append(group)
        self.buffer = keep
        if expired:
            self.counters["stale_groups"] += len(expired)
            await control.send(Expired(group_ids=[g.groups[0].group_id for g in expired], reason="stale"))

    async def _accept(self, msg, control: Control) -> None:
        """Add the groups of one message to the buffer (checked, deduplicated)."""
        msg = self.checked_batch(msg)
        if msg is None:
            return
        now = time.time()
        failed_groups: list[int] = []
        for group in split(msg):
            group_id = group.groups[0].group_id
            if group_id in self.acked or any(b.groups[0].group_id == group_id for b in self.buffer):
                self.counters["duplicates"] += 1
                continue
            failed = {f.index for f in group.failures}
            if failed:
                self.counters["failed_samples"] += len(failed)
                group = take(group, [i for i in range(group.n_samples) if i not in failed])
            if group.n_samples == 0:
                failed_groups.append(group_id)
                continue
            stamps = group.stamps.numpy().copy()
            stamps[:, Stage.TRAINER_RECEIVED] = now
            self.buffer.append(msgspec.structs.replace(group, stamps=Tensor.from_numpy(stamps)))
        if failed_groups:
            await control.send(Expired(group_ids=failed_groups, reason="every sample failed"))


async def make_engine(service: TrainerService):
    match service.config.roles.trainer.engine:
        case SimTrainer() as cfg:
            return SimTrainerEngine(cfg, service.config.run.seed, service)
        case TorchTrainer() as cfg:
            from rlflow.services.torch_trainer import TorchTrainerEngine

            return await trio.to_thread.run_sync(TorchTrainerEngine, cfg, service)
    raise ValueError(f"unknown trainer engine {service.config.roles.trainer.engine!r}")


class SimTrainerEngine:
    """Trains for `s_per_token` per token; its weights are `weights_bytes` of
    fixed random bytes, in tensors of at most 4 MiB, that really cross the
    wire: the rollout fetches them from this engine's weight server."""

    checkpoint_every = 0

    def __init__(self, cfg: SimTrainer, seed: int, service: TrainerService):
        self.cfg = cfg
        self.service = service
        rng = np.random.default_rng((seed, 17))
        data = rng.integers(0, 256, cfg.weights_bytes, dtype=np.uint8)
        chunks = range(0, cfg.weights_bytes, SIM_TENSOR_BYTES)
        self.names = [f"layers.{i}.weight" for i in range(len(chunks))]
        self.tensors = [Tensor.from_numpy(data[a : a + SIM_TENSOR_BYTES]) for a in chunks]
        self.latest: WeightsPayload | None = None
        self._published = trio.Event()
        self.address = ""

    def hello_info(self) -> dict[str, str]:
        return {"weights": "zmq", "weights_address": self.address}

    async def connect(self, info: dict[str, str]) -> None:
        """The rollout pulls weights from the server: nothing to join."""

    async def serve(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Answer each weight request with the newest version."""
        async with transport.open_router(
            bind=bind_address(self.service.spec), codec=Codec(WeightsMessage), name="weights"
        ) as sock:
            self.address = transport.bound_address(sock)
            self.service.sockets.append(sock)
            task_status.started()
            while True:
                identity, msg = await sock.recv()
                if not isinstance(msg, WeightsRequest):
                    continue
                while self.latest is None or self.latest.version < msg.version:
                    self._published = trio.Event()
                    await self._published.wait()
                await sock.send(identity, self.latest)

    async def train(self, batch: SampleBatch) -> dict[str, float]:
        seconds = self.cfg.step_overhead_s + self.cfg.s_per_token * batch.n_tokens
        if seconds > 0:
            await trio.sleep(seconds)
        return {"loss": 0.0}

    async def publish(self, version: int) -> WeightsReady:
        self.latest = WeightsPayload(version=version, names=self.names, tensors=self.tensors)
        self._published.set()
        return WeightsReady(
            version=version, nbytes=sum(t.nbytes for t in self.tensors), info={"address": self.address}
        )

    async def send(self, version: int) -> None:
        """Pulled, not pushed: nothing to do."""

    async def save(self, step: int) -> None:
        """Nothing to save."""
        return None
