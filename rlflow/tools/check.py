"""`rlflow check`: load a config's task and reward functions, without
starting a run, and show what the model will see and how the functions
score the dataset's own answers.

It prints how many rows loaded and how many were left out (and why), what
looked wrong in rows that loaded, three prompts exactly as the model will
see them, prompt-length statistics in tokens, the rows that have no
reference answer, and the reward of each row's reference answer scored as
if it were a response. With an environment (`[roles.env]`), it plays a few
episodes with its scripted model turns (`reference_turns`, where it has
them) and prints each as the model will see it: the prompt (with the tools'
schemas, as the chat template shows them), each scripted turn, and each
observation rendered as it follows the turn; with the environment's reward
of each turn. Its last line is

    RESULT check rows=N skipped=N reference_reward_mean=X failures=N

(with ``episodes=N episode_reward_mean=X`` after it, with an environment).
With outside agents (`[agents]`) that rlflow starts, it checks that their
program and the files its command names are there.

A bad config, data that cannot be used (the message names the file, the
row and the field) or a reward function that cannot be loaded is an error
of one line (`CheckError`).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import trio

from rlflow.config import Config, FunctionsReward


class CheckError(Exception):
    """What makes the config unusable, in one line."""


def check(config: Config, *, rows: int = 0, say: Callable[[str], None] = print) -> dict[str, float]:
    """Run the checks (see the module); the figures of the RESULT line.
    `rows` limits the rows whose reference answers are scored (0: all)."""
    from rlflow.control.launch import resolve
    from rlflow.rewards import PoolError, RewardFunctionError, load_function, sandbox_problem
    from rlflow.startup import use_import_dir
    from rlflow.tasks.core import load_tokenizer, make_task, needs_tokenizer
    from rlflow.tasks.dataset import DatasetError, RowTask

    config = resolve(config)
    use_import_dir(config)  # the functions are loaded here too, to name a bad one at once
    tokenizer = load_tokenizer(config.policy_path) if needs_tokenizer(config) else None
    try:
        task = make_task(config, tokenizer)
    except DatasetError as exc:
        raise CheckError(f"data error: {exc}") from None
    train = getattr(task, "train", None)
    loaded = len(train) if train is not None else 0
    skipped = sum(train.skipped.values()) if train is not None else 0
    say(f"task {task.name}: {loaded} training rows loaded, {skipped} left out"
        + (f"; {len(task.heldout)} evaluation rows" if hasattr(task, "heldout") else ""))
    for reason, count in (train.skipped.items() if train is not None else ()):
        say(f"  left out {count}: {reason}")
    for warning in getattr(task, "warnings", ()):
        say(f"  warning: {warning}")
    for group_id in range(3):
        say(f"--- prompt of group {group_id}, as the model sees it ---")
        say(task.prompt_text(group_id))
    if train is not None and loaded:
        lengths = np.array([len(ids) for ids in train.ids])
        say(f"prompt tokens: min {lengths.min()}, median {np.median(lengths):g}, p95 {np.percentile(lengths, 95):g}, "
            f"max {lengths.max()}")
    figures: dict[str, float] = {}
    if config.roles.env is not None:
        try:
            figures = trio.run(_play_scripted, config, task, tokenizer, say)
        except PoolError as exc:
            raise CheckError(f"environment: {exc}") from None
    if config.agents is not None:
        _check_agents(config, say)
    reward = config.roles.reward.engine
    if not isinstance(reward, FunctionsReward) or not task.scored_by_functions:
        say("the reward is the task's own verifier or the environment's: no reward functions to check")
        return {"rows": loaded, "skipped": skipped, "reference_reward_mean": math.nan, "failures": 0, **figures}
    for spec in reward.functions:
        try:
            function = load_function(spec.path, spec.kwargs)
        except RewardFunctionError as exc:
            raise CheckError(f"config error: roles.reward.engine.functions: {exc}") from None
        if spec.path.endswith(":code") or getattr(function, "__name__", "") == "code":
            problem = sandbox_problem(**spec.kwargs)
            if problem is not None:
                raise CheckError(f"the code reward cannot run here: {problem}")
    if isinstance(task, RowTask) and task.answer:  # a task of rows (the one kind with `train`)
        _say_missing_references(task, say)
    count = loaded if rows <= 0 else min(rows, loaded)
    try:
        rewards, failures, problems = trio.run(_score_references, task, reward, count, config.run.import_dir)
    except (PoolError, RewardFunctionError) as exc:
        raise CheckError(f"reward functions: {exc}") from None
    for problem in problems[:10]:
        say(f"  {problem}")
    if len(problems) > 10:
        say(f"  ... and {len(problems) - 10} more")
    mean = float(np.mean(rewards)) if rewards else math.nan
    if rewards or failures:
        say(f"reference answers of {len(rewards) + failures} rows, scored as responses: mean reward {mean:.4g}, "
            f"{failures} not scored")
    else:
        say("the rows have no reference answers to score (task.answer)")
    return {"rows": loaded, "skipped": skipped, "reference_reward_mean": mean, "failures": failures, **figures}


def _check_agents(config: Config, say: Callable[[str], None]) -> None:
    """The agent program the rollout is to start is there: its executable, and the files its arguments
    name (those ending in .py), from where the run starts it."""
    import os
    import shutil

    agents = config.agents
    assert agents is not None  # checked by the caller
    if not agents.command:
        say("agents: none started by rlflow; start yours against the url in the run's agents.json")
        return
    where = config.run.import_dir or os.getcwd()
    program = agents.command[0]
    if program not in ("python", "python3") and shutil.which(program, path=os.environ.get("PATH")) is None \
            and not os.path.isfile(os.path.join(where, program)):
        raise CheckError(f"config error: agents.command: no program {program!r} on PATH or in {where}")
    for arg in agents.command[1:]:
        if arg.endswith(".py") and not os.path.isfile(os.path.join(where, arg)):
            raise CheckError(f"config error: agents.command: no file {arg!r} in {where}")
    say(f"agents: {agents.copies} copies of {' '.join(agents.command)}, spread over "
        f"{config.roles.rollout.replicas} rollout replica(s)")


#: Episodes `check` plays with the environment's scripted turns.
EPISODES_SHOWN = 2


async def _play_scripted(config: Config, task, tokenizer, say: Callable[[str], None]) -> dict[str, float]:
    """Play `EPISODES_SHOWN` episodes with the environment's scripted turns, printing each as the
    model will see it; the episodes played and their mean reward."""
    from collections import Counter

    from rlflow.env import EnvHandler, open_env_pool
    from rlflow.env.pool import plain
    from rlflow.env.render import EpisodeText, RenderError
    from rlflow.protocol import EnvReset, EnvStep

    env = config.roles.env
    assert env is not None  # played only with an environment (checked by the caller)
    text = EpisodeText(tokenizer)
    show = text.tokenizer.decode if tokenizer is None else (
        lambda ids: tokenizer.decode(ids, skip_special_tokens=False)
    )
    rewards = []
    async with open_env_pool(env.environment, env.tools, workers=1, start_timeout_s=env.start_timeout_s,
                             import_dir=config.run.import_dir) as pool:
        handler = EnvHandler(pool, tools=env.tools, timeout_s=env.timeout_s, counters=Counter())
        for group_id in range(EPISODES_SHOWN):
            group = task.prompt(group_id, 1)
            row = plain(dict(task.row(group_id)))
            reset = await handler.answer(EnvReset(request_id=0, group_id=group_id, row=row,
                                                  reference=group.reference, scripted=True))
            if reset.error:
                raise CheckError(f"environment: the reset of group {group_id}'s row failed: {reset.error}")
            try:
                say(f"--- episode of group {group_id}, as the model sees it ---")
                say(show(text.first(reset)))
                if not reset.scripted:
                    say("[the environment has no reference_turns: its first observation only]")
                total, state = 0.0, reset.state
                turns: list[str] = []
                for turn, said in enumerate(reset.scripted[: env.max_turns], start=1):
                    say(f"[model turn {turn}] {said}")
                    reply = await handler.answer(EnvStep(request_id=turn, group_id=group_id, index=0, turn=turn,
                                                         text=said, state=state, row=row,
                                                         reference=group.reference, turns=turns))
                    turns.append(said)
                    if reply.error:
                        raise CheckError(f"environment: the step of turn {turn} of group {group_id} failed: "
                                         f"{reply.error}")
                    total, state = total + reply.reward, reply.state
                    say(f"[reward {reply.reward:g}{', done' if reply.done else ''}]")
                    if reply.done:
                        break
                    say(show(text.observation(reply, reset.tools)))
            except RenderError as exc:
                raise CheckError(f"environment: {exc}") from None
            rewards.append(total)
    return {"episodes": len(rewards), "episode_reward_mean": float(np.mean(rewards)) if rewards else math.nan}


#: Rows without a reference answer named by line (or record) at most.
MISSING_SHOWN = 5


def _say_missing_references(task, say: Callable[[str], None]) -> None:
    """How many training rows have no reference answer, and where the first are."""
    train = task.train
    missing = sorted(train.positions[i] for i, row in enumerate(train.rows) if not task.reference(row))
    if not missing:
        return
    source = train.source
    shown = ", ".join(str(source.number(p)) for p in missing[:MISSING_SHOWN])
    more = ", ..." if len(missing) > MISSING_SHOWN else ""
    say(f"{len(missing)} of {len(train)} rows have no reference answer (task.answer = {task.answer!r}), so how the "
        f"functions score a right answer is not checked on them: {source.name}: {source.unit}s {shown}{more}")


async def _score_references(
    task, reward: FunctionsReward, count: int, import_dir: str
) -> tuple[list[float], int, list[str]]:
    from rlflow.rewards import Sample, open_pool

    samples = []
    for group_id in range(count):  # each row once: the first epoch
        reference = task.prompt(group_id, 1).reference
        if reference:
            samples.append(Sample(prompt=task.prompt_text(group_id), response=reference, reference=reference,
                                  row=dict(task.row(group_id))))
    rewards: list[float] = []
    failures = 0
    problems: list[str] = []
    if not samples:
        return rewards, failures, problems
    async with open_pool(reward.functions, start_timeout_s=reward.start_timeout_s, import_dir=import_dir) as pool:
        results = await pool.score_many(samples, as_reference=True)
        for i, scored in enumerate(results):
            combined = pool.combine(scored)
            if combined.reward is None:
                failures += 1
                first = combined.failed[0]
                problems.append(f"row of group {i}: {first.function} {first.status.value}: {first.message[:200]}")
            else:
                rewards.append(combined.reward)
    return rewards, failures, problems
