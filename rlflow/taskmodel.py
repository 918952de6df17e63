"""A model for any task of rows, built on a laptop: `rlflow model build --task`.

The embedded default model knows one task (`rlflow.models`). For another,
a `reasoning_gym` dataset with its options or the user's own `dataset` with
answers, rlflow builds a small model the same way: a byte-level tokenizer
(any text tokenizes, `rlflow.models.tiny_text_tokenizer`, with its plain chat
template), a 2-layer Qwen2 of 0.6M parameters (`TaskRecipe`), and a supervised warm start on
the task's own prompts and reference answers (each answer then the end of
sequence), until its greedy answers to a development set of training rows
pass the run's own reward functions (`eval.pass_reward`) at
`TaskRecipe.target_accuracy`: RL then starts with room above it.

Where the rows come from: the task as a run of seed `TaskRecipe.data_seed`
loads it (a seed no run uses by default), so the evaluation split is left
out as in every run; the development set is a fixed share of those rows,
never trained on in the warm start.

The build is a function of the task's config, its reward functions and the
recipe (seeded, a fixed thread count, deterministic kernels, a stopping rule
by steps and accuracy, never by time); its folder in the cache is named by a
hash of the three (`task_model_dir`), and ``roles.rollout.model = "task"``
in a config names the model built for that config's task.
"""

from __future__ import annotations

import hashlib
import json
import math
import pathlib
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any, NamedTuple

import msgspec
import numpy as np

from rlflow.config import Config, DatasetTask, FunctionsReward, ReasoningGymTask, kind_of
from rlflow.models import (
    BuildProgress, building, cache_dir, cpu_name, deterministic, greedy_answers, qwen2_config,
    tiny_text_tokenizer,
)

#: `roles.rollout.model` that names the model built for the config's task.
TASK_MODEL = "task"
#: Bump when the recipe below changes, so that caches rebuild.
TASK_BUILD_VERSION = 1


@dataclass(frozen=True)
class TaskRecipe:
    """How a task's model is built and warm-started."""

    hidden: int = 128
    layers: int = 2
    heads: int = 2
    """Heads of 64 (vLLM's CPU attention wants them so)."""
    ffn: int = 512
    max_positions: int = 1024
    seed: int = 0
    data_seed: int = 7919
    """The run seed whose training rows the warm start reads (`make_task`)."""
    lr: float = 3e-3
    """On spell_backward (2-core AMD EPYC, AVX-512): this model at 3e-3 reached 30% at step 1,200 (240 s); the
    default model's shape (4 x 256) at 1e-3 was at 1.5% at step 165, 1.4 s a step."""
    batch: int = 32
    target_accuracy: float = 0.3
    """Stop once this share of the development set passes (greedy answers, the run's reward functions)."""
    max_steps: int = 1500
    """Or after this many steps (never after a time: the model must not depend on the machine's speed)."""
    threads: int = 2
    eval_every: int = 25
    dev_size: int = 200
    max_answer_tokens: int = 0
    """Greedy answers' length in the development set: 0 is the longest reference answer's, plus 8."""


class TaskModelError(ValueError):
    """A task rlflow cannot build a model for; the message says why."""


def task_key(config: Config, recipe: TaskRecipe = TaskRecipe()) -> str:
    """What the model of `config`'s task depends on, hashed: the task's table, the reward functions
    that judge the development set, and the recipe."""
    reward = msgspec.to_builtins(config.roles.reward.engine)
    blob = json.dumps([TASK_BUILD_VERSION, msgspec.to_builtins(config.task), reward, asdict(recipe)],
                      sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def task_model_dir(config: Config, recipe: TaskRecipe = TaskRecipe()) -> pathlib.Path:
    """Where the model of `config`'s task is built (the cache)."""
    task = config.task
    if not isinstance(task, DatasetTask | ReasoningGymTask):
        raise TaskModelError(f"a model is built for a task of rows (dataset, reasoning_gym), not task.kind = "
                             f"{kind_of(task)!r} (the arith task has the default model)")
    name = task.dataset if isinstance(task, ReasoningGymTask) else pathlib.Path(task.train).stem
    safe = "".join(c if c.isalnum() or c in "-_" else "-" for c in name)[:40]
    return cache_dir() / "models" / f"task-{kind_of(task)}-{safe}-{task_key(config, recipe)}"


def resolve_task_model(config: Config) -> pathlib.Path:
    """The built model of `config`'s task (``roles.rollout.model = "task"``)."""
    path = task_model_dir(config)
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"the model of this config's task is not built yet ({path}); run `rlflow model "
                                "build --task CONFIG` with this config (a few minutes on a CPU)")
    return path


#: The trainer's learning rate on a model of `TaskRecipe` (the embedded default's, 1e-4, is its own
#: model's, 7x the parameters, and barely moves this one). On spell_backward (2-core AMD EPYC, AVX-512)
#: on-policy training (`run.mode = "sync"`, two seeds of 40 steps from the model built before, 27% on 200
#: problems) fell to 11.5-20% by step 10 at 1e-3 and read 22.5% at step 40; 5e-4 read 21-28.5% over
#: steps 5-40, 3e-4 22.5-28.5%. From the model built now (22.0% on 1,000 problems), 120 steps at 5e-4:
#: sync 32.2%, the asynchronous default 32.7% (three seeds, bench/peer.py); the default 32.0% at 3e-4.
TASK_LR = 5e-4


def task_config(spec: str, overrides: list[str]) -> Config:
    """The config of `--task SPEC`: a TOML config file (its task and reward), or a reasoning-gym
    dataset's name (the embedded default with that task, scored by its own verifier, the trainer at
    `TASK_LR`)."""
    from rlflow import config as C

    path = pathlib.Path(spec)
    if path.suffix == ".toml" or path.exists():
        return C.load(path, overrides)
    return C.load(C.default_config_path(), [
        f"task={{kind='reasoning_gym', dataset='{spec}'}}",
        "roles.reward.engine={kind='functions', functions=[{path='rlflow.rewards:reasoning_gym'}]}",
        f"roles.trainer.engine.lr={TASK_LR}",
        *overrides,
    ])


def build_task_model(config: Config, recipe: TaskRecipe = TaskRecipe(), out: pathlib.Path | None = None,
                     progress: Callable[[str, float], None] | None = None) -> pathlib.Path:
    """Build, warm-start and save the model of `config`'s task; its directory (see the module).

    `progress(text, fraction)` is called as it goes (`rlflow.models.BuildProgress`)."""
    import trio

    if not isinstance(config.roles.reward.engine, FunctionsReward):
        raise TaskModelError("the task's answers are judged by reward functions (roles.reward.engine.kind = "
                             "'functions'): the development set is scored by them")
    return trio.run(_build, config, recipe, out or task_model_dir(config, recipe),
                    progress or (lambda text, fraction: None))


class _Row(NamedTuple):
    text: str
    """The prompt as the model sees it."""
    answer: str
    row: dict[str, Any]
    prompt_ids: list[int]
    answer_ids: list[int]
    """The answer's tokens, then the end of sequence."""


def _rows(config: Config, recipe: TaskRecipe, tokenizer) -> tuple[list[_Row], list[_Row]]:
    """The warm start's rows and the development set's: the task's training rows with a reference
    answer, as a run of `recipe.data_seed` loads them."""
    from rlflow.tasks.core import make_task

    config = msgspec.structs.replace(config, run=msgspec.structs.replace(config.run, seed=recipe.data_seed))
    task = make_task(config, tokenizer)
    train = task.train  # type: ignore[attr-defined]  # a RowTask (task_model_dir refused the others)
    rows = []
    for text, ids, row in zip(train.texts, train.ids, train.rows, strict=True):
        answer = task.reference(row)  # type: ignore[attr-defined]
        if answer:
            answer_ids = [*tokenizer.encode(answer, add_special_tokens=False), tokenizer.eos_token_id]
            rows.append(_Row(text, answer, dict(row), list(ids), answer_ids))
    if len(rows) < 2 * recipe.dev_size:
        field = "task.answer" if isinstance(config.task, DatasetTask) else "the dataset's answers"
        raise TaskModelError(f"{len(rows)} training rows with a reference answer ({field}); the warm start "
                             f"needs at least {2 * recipe.dev_size}")
    longest = max(len(r.prompt_ids) + len(r.answer_ids) for r in rows)
    if longest > recipe.max_positions:
        raise TaskModelError(f"a prompt and its answer take {longest} tokens, more than the recipe's "
                             f"{recipe.max_positions} positions (task.max_prompt_tokens leaves longer prompts out)")
    order = np.random.default_rng((recipe.seed, 11)).permutation(len(rows))
    return [rows[i] for i in order[recipe.dev_size :]], [rows[i] for i in order[: recipe.dev_size]]


async def _build(config: Config, recipe: TaskRecipe, out: pathlib.Path,
                 report: Callable[[str, float], None]) -> pathlib.Path:
    """The reward pool that judges the development set, here; the warm start in a thread of its own
    (torch's thread count is a thread's own), which asks the pool through trio."""
    import trio

    from rlflow.rewards import Sample, open_pool

    reward = config.roles.reward.engine
    assert isinstance(reward, FunctionsReward)

    async def pass_rate(dev: list[_Row], answers: list[str]) -> float:
        samples = [Sample(prompt=r.text, response=said, reference=r.answer, row=r.row)
                   for r, said in zip(dev, answers, strict=True)]
        return (await pool.pass_rate(samples, config.eval.pass_reward))["accuracy"]

    async with open_pool(reward.functions, start_timeout_s=reward.start_timeout_s,
                         import_dir=config.run.import_dir) as pool:
        return await trio.to_thread.run_sync(
            _warm_start, config, recipe, out, report,
            lambda dev, answers: trio.from_thread.run(pass_rate, dev, answers))


def _warm_start(config: Config, recipe: TaskRecipe, out: pathlib.Path, report: Callable[[str, float], None],
                pass_rate: Callable[[list[_Row], list[str]], float]) -> pathlib.Path:
    with deterministic(recipe.threads):
        return _train(config, recipe, out, report, pass_rate)


def _train(config: Config, recipe: TaskRecipe, out: pathlib.Path, report: Callable[[str, float], None],
           pass_rate: Callable[[list[_Row], list[str]], float]) -> pathlib.Path:
    import torch
    from transformers import GenerationConfig, Qwen2ForCausalLM

    torch.manual_seed(recipe.seed)
    tokenizer = tiny_text_tokenizer()
    train, dev = _rows(config, recipe, tokenizer)
    model = Qwen2ForCausalLM(qwen2_config(recipe, tokenizer))
    optimizer = torch.optim.AdamW(model.parameters(), lr=recipe.lr, betas=(0.9, 0.98))
    rng = np.random.default_rng((recipe.seed, 12))
    answer_tokens = recipe.max_answer_tokens or max(len(r.answer_ids) for r in train + dev) + 8

    def step(number: int) -> float:
        picked = [train[i] for i in rng.integers(0, len(train), recipe.batch)]
        width = max(len(r.prompt_ids) + len(r.answer_ids) for r in picked)
        ids = torch.full((len(picked), width), tokenizer.pad_token_id)
        labels = torch.full((len(picked), width), -100)
        mask = torch.zeros((len(picked), width), dtype=torch.long)
        for i, r in enumerate(picked):  # the answer alone is learnt, not the question
            n, m = len(r.prompt_ids), len(r.answer_ids)
            ids[i, : n + m] = torch.tensor(r.prompt_ids + r.answer_ids)
            labels[i, n : n + m] = torch.tensor(r.answer_ids)
            mask[i, : n + m] = 1
        for group in optimizer.param_groups:
            group["lr"] = recipe.lr * min(1.0, (number + 1) / 20)
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return float(loss.item())

    started = time.monotonic()
    accuracy, number, history, loss = 0.0, 0, [], math.nan
    shown = BuildProgress(recipe)
    while True:
        loss = step(number)
        number += 1
        if number % recipe.eval_every == 0:
            accuracy = pass_rate(dev, greedy_answers(model, tokenizer, [r.text for r in dev], answer_tokens))
            history.append({"step": number, "seconds": round(time.monotonic() - started, 1),
                            "loss": round(loss, 4), "dev_accuracy": accuracy})
        report(*shown.update(number, accuracy, loss))
        if accuracy >= recipe.target_accuracy or number >= recipe.max_steps:
            break
    with building(out) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        GenerationConfig(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                         do_sample=True).save_pretrained(tmp)
        info: dict[str, Any] = {
            "name": out.name, "build_version": TASK_BUILD_VERSION, "task": msgspec.to_builtins(config.task),
            "recipe": asdict(recipe), "steps": number, "seconds": round(time.monotonic() - started, 1),
            "dev_accuracy": accuracy, "history": history, "rows": len(train), "dev_rows": len(dev),
            "parameters": sum(p.numel() for p in model.parameters()), "machine": cpu_name(),
        }
        (tmp / "rlflow_build.json").write_text(json.dumps(info, indent=1))
    report(f"built in {time.monotonic() - started:.0f} s: dev accuracy {accuracy:.1%}", 1.0)
    return out

