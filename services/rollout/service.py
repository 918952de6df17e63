"""The rollout service: turns credits into prompt groups, generates, streams
finished groups to the next role.

Its loop: credits arrive on the control channel -> the task makes each
group's prompt -> the engine generates `n` responses per prompt with
continuous batching -> each group is sent on the moment its last response
finishes, as one columnar `SampleBatch` with every other group finished by
then (one message and one acknowledgement however many: when this process
is behind, it catches up in fewer, larger messages). Weight updates arrive while
requests are in flight; the engine applies them between two decode steps and
tags later tokens with the new version.

With an environment (`[roles.env]`) each group is `n` multi-turn episodes
instead (`episodes.EpisodeRunner`): the env role is asked for every step,
over the env channel, while the engine serves other episodes; a group whose
env replica is lost mid-episode is given back (`Expired`), to be granted again.
With outside agents (`[agents]`) each group is `n` episodes that agents play
over the replica's OpenAI-compatible endpoint (`agents.AgentEndpoint`); a
group an agent abandons is dropped (`Dropped`, reason ``abandoned``). To the replica's loop both are an
episode source (`source.EpisodeSource`).
"""

from __future__ import annotations

import collections
import contextlib
import math
import time

import trio

from rlflow.algo.staleness import groups_held
from rlflow.config import FunctionsReward, SimRollout, VllmRollout
from rlflow.data import transport
from rlflow.errors import WeightGroupBroken
from rlflow.protocol import (
    EngineLoad,
    WEIGHT_GROUP_BROKEN,
    Ack,
    ErrorReport,
    Credits,
    Dropped,
    EvalDone,
    Evaluate,
    Expired,
    Peers,
    SampleBatch,
    Shutdown,
    Stage,
    UpdateWeights,
    WeightsLoaded,
    build_batch,
    concat,
    with_text,
)
from rlflow.roles import MESSAGES_PER_S
from rlflow.services.base import Control, EngineContext, Service, follow, shm_settings, waiting
from rlflow.services.rollout.engine import Finished, RolloutEngine
from rlflow.services.rollout.agents import AgentEndpoint
from rlflow.services.rollout.episodes import EpisodeRunner
from rlflow.services.rollout.source import EpisodeSource
from rlflow.tasks.core import Task


class RolloutService(Service):
    """Generates responses for the prompt groups the controller grants."""

    def __init__(self, spec):
        super().__init__(spec)
        self.engine: RolloutEngine | None = None
        self.eval_pool = None
        #: Groups scored in line, waiting to be sent.
        self._scored: dict[int, SampleBatch] = {}
        self._wanted: UpdateWeights | None = None
        self._update = trio.Event()
        #: Held while the held-out set is evaluated: weights wait, so that an evaluation reads one version.
        self._evaluating = trio.Lock()
        #: Multi-turn episodes, in a run with an environment or outside agents.
        self.episodes: EpisodeSource | None = None
        self.task: Task | None = None
        #: Whether a replica it streams to asked for text (`Hello.text`): then every batch it sends carries it.
        self.text = False

    async def main(self, control: Control) -> None:
        task = self.load_task()
        reward = self.config.roles.reward.engine
        if task.scored_by_functions and isinstance(reward, FunctionsReward) and self._evaluates():
            # Held-out answers are scored by the run's reward functions, here.
            from rlflow.rewards import open_pool

            async with open_pool(reward.functions, start_timeout_s=reward.start_timeout_s, workers=1,
                                 import_dir=self.config.run.import_dir) as pool:
                self.eval_pool = pool
                await self._main(control, task)
        else:
            await self._main(control, task)

    def _holds(self, engine: RolloutEngine) -> int:
        """The most groups the controller lets this replica hold, as it reckons them from its hello."""
        return groups_held(engine.hello_fields().get("slots", 0), self.config.run.samples_per_prompt)

    def _evaluates(self) -> bool:
        """Whether this replica evaluates the held-out set (rank 0, if the config asks)."""
        ev = self.config.eval
        return self.spec.rank == 0 and (ev.before or ev.after or ev.every_steps > 0)

    async def _main(self, control: Control, task: Task) -> None:
        run = self.config.run
        engine = self.engine = make_engine(self.context())
        self.task = task
        try:
            self.say("starting %s", type(engine).__name__)
            started = time.monotonic()
            await engine.start()
            self.say("%s started in %.1f s", type(engine).__name__, time.monotonic() - started)
            agents = self._agents(engine, task)
            welcome = await control.hello(endpoints={"agents": agents.bind()} if agents else {},
                                          **engine.hello_fields())
            await engine.set_version(welcome.version)  # above 0 when resuming
            self.version = welcome.version
            await engine.join_weights(welcome.weights, welcome.layout, welcome.adapter)
            if self.config.roles.reward.inline:
                self._score_inline(engine, task)
            self.say("up: %s, sending to %s", type(engine).__name__, ", ".join(welcome.peers["out"]))
            self._want_text(welcome.peers["out"], welcome.text_peers)
            async with (
                transport.open_push(
                    connect=welcome.peers["out"],
                    curve=self.spec.curve,
                    name=f"{self.spec.name}/out",
                    shm=shm_settings(self.config, self.spec.run_id),
                    shm_peers=welcome.shm_peers,
                ) as out,
                contextlib.AsyncExitStack() as stack,
                trio.open_nursery() as nursery,
            ):
                await nursery.start(engine.run)
                if agents is not None:
                    await nursery.start(agents.run)
                    self.say("agents: serving %s", agents.url)
                episodes = self.episodes = agents or await self._episodes(engine, task, welcome, stack, nursery)
                work = episodes or engine
                nursery.start_soon(control.heartbeats, self.heartbeat, welcome.heartbeat_s)
                nursery.start_soon(self.send_finished, out, control, (episodes or engine).finished)
                if episodes is not None:
                    nursery.start_soon(self.give_back, episodes, control)
                nursery.start_soon(self.apply_updates, control)
                await control.ready(engine.version)
                peers = welcome.peers["out"]
                async for msg in control:
                    match msg:
                        case Peers():
                            peers = follow(out, peers, msg.peers.get("out", []), msg.shm_peers)
                            self._want_text(peers, msg.text_peers)
                            if episodes is not None:
                                episodes.follow(msg.peers.get("env", []))
                        case Credits(group_ids=ids, min_versions=mins):
                            now = time.time()
                            for group_id, min_version in zip(ids, mins, strict=True):
                                work.submit(task.prompt(group_id, run.samples_per_prompt, min_version), now)
                        case UpdateWeights():
                            self._wanted = msg
                            self._update.set()
                        case Evaluate():
                            nursery.start_soon(self.evaluate, msg, task, control)
                        case Shutdown(reason=reason):
                            self.say("shutting down (%s)", reason)
                            if episodes is not None:
                                await episodes.close(reason)
                            break
                nursery.cancel_scope.cancel()
        finally:
            with trio.CancelScope(shield=True):
                await engine.close()

    def _want_text(self, peers: list[str], text_peers: list[str]) -> None:
        """Fill in text while any replica it streams to asked for it: a PUSH hands each batch to whichever
        peer is ready, so they all get it then (SPEC.md, *Text*)."""
        text = any(address in text_peers for address in peers)
        if text != self.text:
            self.say("%s the text of responses and prompts", "sending" if text else "no longer sending")
        self.text = text

    def queues(self) -> dict[str, int]:
        out = self.engine.queues() if self.engine is not None else {}
        if self.episodes is not None:
            out.update(self.episodes.queues())
        return out

    async def _episodes(self, engine: RolloutEngine, task: Task, welcome, stack: contextlib.AsyncExitStack,
                        nursery: trio.Nursery) -> EpisodeSource | None:
        """The episodes of a run with an environment (None without): asked of the env replicas the
        welcome names, or of an env pool of this process (`roles.env.inline`)."""
        env = self.config.roles.env
        if env is None:
            return None
        from rlflow.env.render import EpisodeText
        from rlflow.services.rollout.envclient import EnvClient, InlineEnv

        if env.inline:
            from rlflow.env import EnvHandler, open_env_pool

            pool = await stack.enter_async_context(open_env_pool(
                env.environment, env.tools, workers=env.workers, concurrency=env.concurrency,
                start_timeout_s=env.start_timeout_s, import_dir=self.config.run.import_dir))
            client = InlineEnv(EnvHandler(pool, tools=env.tools, timeout_s=env.timeout_s, counters=self.counters),
                               engine.hold)
        else:
            client = EnvClient(curve=self.spec.curve, name=self.spec.name, timeout_s=env.request_timeout_s,
                               watch=self.sockets.append, counters=self.counters)
            await nursery.start(client.run, welcome.peers.get("env", []))
        run = self.config.run
        tokenizer = getattr(task, "tokenizer", None)

        def make_parser(tools):  # vLLM's, only once a turn is to be read for tool calls
            from rlflow.services import compat

            return compat.tool_parser(env.tool_parser, tokenizer, tools)

        runner = EpisodeRunner(engine, client, task, env, text=EpisodeText(tokenizer, make_parser, env.tool_parser),
                               turn_tokens=getattr(self.config.roles.rollout.engine, "max_tokens", env.max_tokens),
                               counters=self.counters, holds=self._holds(engine),
                               strict=run.staleness_check == "strict", staleness=run.max_staleness)
        await nursery.start(runner.run)
        return runner

    def _agents(self, engine: RolloutEngine, task: Task) -> AgentEndpoint | None:
        """The endpoint outside agents play the episodes through (a run with `[agents]`; else None)."""
        cfg = self.config.agents
        if cfg is None:
            return None
        if not cfg.api_key:
            raise RuntimeError("agents.api_key is empty: the launcher makes one for the run; a replica started "
                               "by hand needs the run's config as the launcher wrote it")
        from rlflow.config import EnvReward
        from rlflow.env.render import EpisodeText

        tokenizer = getattr(task, "tokenizer", None)

        def make_parser(tools):  # vLLM's, only once a turn is to be read for tool calls
            from rlflow.services import compat

            return compat.tool_parser(cfg.tool_parser, tokenizer, tools)

        return AgentEndpoint(engine, task, cfg, text=EpisodeText(tokenizer), make_parser=make_parser,
                             turn_tokens=getattr(self.config.roles.rollout.engine, "max_tokens", cfg.max_tokens),
                             counters=self.counters, api_key=cfg.api_key, rank=self.spec.rank,
                             replicas=self.spec.replicas, holds=self._holds(engine),
                             takes_reward=isinstance(self.config.roles.reward.engine, EnvReward),
                             import_dir=self.config.run.import_dir, log=self.log)

    async def give_back(self, episodes: EpisodeSource, control: Control) -> None:
        """Tell the controller of each group the episodes gave up on: granted again (`Expired`: its env
        replica was lost with it), or dropped for good (`Dropped`: an agent abandoned it)."""
        async for first in episodes.given_up:
            given = [first, *waiting(episodes.given_up)]
            kinds = collections.defaultdict(list)
            for g in given:
                kinds[g.again, g.reason].append(g)
            for (again, reason), these in kinds.items():
                ids = [g.group_id for g in these]
                self.log.warning("[%s] groups %s %s: %s", self.spec.name, ids,
                                 "given back" if again else "dropped", "; ".join(sorted({g.why for g in these})))
                await control.send(Expired(group_ids=ids, reason=reason, errors=[g.why[:500] for g in these])
                                   if again else Dropped(group_ids=ids, reason=reason))

    def engine_load(self) -> EngineLoad | None:
        return self.engine.load() if self.engine is not None else None

    def _score_inline(self, engine: RolloutEngine, task: Task) -> None:
        """Score each finished group in this process, while the engine waits
        (`roles.reward.inline`)."""
        from rlflow.services.reward.scorer import Scorer

        scorer = Scorer(self.config.roles.reward.engine, task, self.counters,
                        (self.config.run.seed, self.spec.rank, 11))

        async def inline(group, responses) -> None:
            self._scored[group.group_id], _ = await scorer.score(build_batch([(group, responses)]))

        engine.inline = inline

    async def send_finished(self, out: transport.Push, control: Control, source: trio.MemoryReceiveChannel) -> None:
        """Send finished groups on, and tell the controller they left: the rollout's replicas together at
        most `MESSAGES_PER_S` messages a second, as a stage's (the groups that finish before a replica's
        next turn join the message; the engine is never held up meanwhile)."""
        last, every = -math.inf, self.spec.replicas / MESSAGES_PER_S
        async for finished in source:
            if last + every > trio.current_time():
                with trio.move_on_at(last + every):
                    async for more in source:
                        finished += more
            last = trio.current_time()
            for more in waiting(source):  # and whatever else has finished by now
                finished += more
            batch = self._batch(finished)
            if self.text:  # the tokenizer's work, off the event loop
                batch = await trio.to_thread.run_sync(with_text, batch, self.task.decode)
            await out.send(batch)
            self.counters["groups"] += len(finished)
            self.counters["samples"] += batch.n_samples
            self.counters["tokens"] += batch.n_tokens
            self.counters["failed_samples"] += len(batch.failures)
            self.counters["bytes_out"] = out.bytes_sent
            self.counters["bytes_shared"] = out.bytes_shared
            await control.send(Ack(stage=Stage.ROLLOUT_END, group_ids=batch.group_ids))

    def _batch(self, finished: list[Finished]) -> SampleBatch:
        """One batch of finished groups; those scored in line as scored."""
        if not self._scored:
            return build_batch(finished)
        return concat([self._scored.pop(group.group_id, None) or build_batch([(group, responses)])
                       for group, responses in finished])

    async def apply_updates(self, control: Control) -> None:
        """Load each version the controller asks for, in order (a newer order
        replaces one not yet started); say at once if it is held already (an
        earlier fetch may have brought a newer version than it asked for)."""
        while True:
            await self._update.wait()
            self._update = trio.Event()
            msg, self._wanted = self._wanted, None
            if msg is None:
                continue
            # A new weight group must be joined (and its broadcast taken) even
            # for a version held already: every member takes part.
            if msg.version <= self.engine.version and msg.transfer is None:
                # Held already (a weight server gave a newer version than the
                # one asked for): say so, or the controller's round waits.
                await control.send(WeightsLoaded(version=self.engine.version, seconds=0.0,
                                                 checksum=self.engine.checksum))
                continue
            try:
                async with self._evaluating:
                    started = time.monotonic()
                    self.version = await self.engine.update_weights(msg.version, msg.transfer)
            except WeightGroupBroken as exc:
                # The trainer or another member died mid-broadcast: wait for
                # the next generation of the group, which the controller makes.
                self.counters["failed_updates"] += 1
                self.log.warning("[%s] loading weights v%d failed: %s", self.spec.name, msg.version, exc)
                await control.send(ErrorReport(fatal=False, kind=WEIGHT_GROUP_BROKEN,
                                               message=f"loading v{msg.version}: {exc}"[:500]))
                continue
            seconds = time.monotonic() - started
            self.counters["weight_updates"] += 1
            self.say("weights v%d loaded in %.0f ms", self.version, 1000 * seconds)
            await control.send(WeightsLoaded(version=self.version, seconds=seconds, checksum=self.engine.checksum))

    async def evaluate(self, msg: Evaluate, task: Task, control: Control) -> None:
        """Answer every held-out prompt once (play one episode of each, with an environment) on the
        weights held now, which stay until it is done: the engine serves its requests first and
        training traffic around them."""
        async with self._evaluating:
            await self._evaluate(msg, task, control)

    async def _evaluate(self, msg: Evaluate, task: Task, control: Control) -> None:
        started, version = time.monotonic(), self.engine.version
        if self.episodes is not None:
            metrics = await self.episodes.evaluate(task.heldout_rows(), self.engine.eval_concurrency, msg.temperature)
            seconds = time.monotonic() - started
            self.say("eval v%d: accuracy %.3f over %d episodes in %.1f s", version, metrics["accuracy"],
                     int(metrics["problems"]), seconds)
            await control.send(EvalDone(version=version, metrics=metrics, seconds=seconds,
                                        version_end=self.engine.version))
            return
        prompts = task.heldout_prompts()
        responses: list[list[int] | None] = [None] * len(prompts)
        limit = trio.CapacityLimiter(self.engine.eval_concurrency)

        async def one(i: int) -> None:
            async with limit:
                responses[i] = await self.engine.complete(prompts[i], msg.temperature)

        async with trio.open_nursery() as nursery:
            for i in range(len(prompts)):
                nursery.start_soon(one, i)
        if task.scored_by_functions:
            metrics = await self._scored_metrics(task.heldout_samples(responses))
        else:
            metrics = task.heldout_metrics(responses)
        seconds = time.monotonic() - started
        self.say("eval v%d: accuracy %.3f over %d problems in %.1f s",
                 version, metrics["accuracy"], len(prompts), seconds)
        await control.send(EvalDone(version=version, metrics=metrics, seconds=seconds, version_end=self.engine.version))

    async def _scored_metrics(self, answers: list) -> dict[str, float]:
        """Mean reward and pass rate of held-out answers under the run's reward functions."""
        return await self.eval_pool.pass_rate(answers, self.config.eval.pass_reward)


def make_engine(ctx: EngineContext) -> RolloutEngine:
    match ctx.config.roles.rollout.engine:
        case SimRollout() as cfg:
            from rlflow.services.rollout.sim import SimEngine

            return SimEngine(cfg, ctx)
        case VllmRollout() as cfg:
            from rlflow.services.rollout.vllm_engine import VllmEngine

            return VllmEngine(cfg, ctx)
    raise ValueError(f"unknown rollout engine {ctx.config.roles.rollout.engine!r}")
