"""`rlflow check`: load a config's task and reward functions, without
starting a run, and show what the model will see and how the functions
score the dataset's own answers.

It prints how many rows loaded and how many were left out (and why), what
looked wrong in rows that loaded, three prompts exactly as the model will
see them, prompt-length statistics in tokens, the rows that have no
reference answer, and the reward of each row's reference answer scored as
if it were a response; its last line is

    RESULT check rows=N skipped=N reference_reward_mean=X failures=N

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
    from rlflow.data.dataset_task import DatasetError
    from rlflow.data.tasks import load_tokenizer, make_task, needs_tokenizer
    from rlflow.rewards import PoolError, RewardFunctionError, load_function, sandbox_problem
    from rlflow.startup import use_import_dir

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
    reward = config.roles.reward.engine
    if not isinstance(reward, FunctionsReward) or not task.scored_by_functions:
        say("the reward is the task's own verifier: no reward functions to check")
        return {"rows": loaded, "skipped": skipped, "reference_reward_mean": math.nan, "failures": 0}
    for spec in reward.functions:
        try:
            function = load_function(spec.path, spec.kwargs)
        except RewardFunctionError as exc:
            raise CheckError(f"config error: roles.reward.engine.functions: {exc}") from None
        if spec.path.endswith(":code") or getattr(function, "__name__", "") == "code":
            problem = sandbox_problem(**spec.kwargs)
            if problem is not None:
                raise CheckError(f"the code reward cannot run here: {problem}")
    if train is not None and task.answer:
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
    return {"rows": loaded, "skipped": skipped, "reference_reward_mean": mean, "failures": failures}


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
    rewards, failures, problems = [], 0, []
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
