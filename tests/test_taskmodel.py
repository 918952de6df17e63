"""A model for any task of rows (`rlflow model build --task`): its folder named
by what it depends on, a warm start that is the same twice, a config that
names it with ``roles.rollout.model = "task"``, and the errors of the tasks
it cannot be built for."""

from __future__ import annotations

import json
import pathlib

import pytest

from rlflow import config as C
from rlflow.config import ConfigError
from rlflow.control.launch import resolve
from rlflow.tools.cli import default_config_path
from rlflow.taskmodel import TaskModelError, TaskRecipe, build_task_model, task_config, task_model_dir

#: A model of a few seconds: too small to learn, enough to prove the machinery.
SMALL = TaskRecipe(hidden=64, layers=1, heads=1, ffn=128, max_steps=6, eval_every=3, dev_size=8, batch=4)
CHAIN_SUM = ["task.size=200", "task.eval_size=10", "task.options={max_terms=3, max_digits=2}"]


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch) -> pathlib.Path:
    monkeypatch.setenv("RLFLOW_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_the_folder_is_named_by_the_task_its_reward_and_the_recipe():
    config = task_config("chain_sum", CHAIN_SUM)
    path = task_model_dir(config)
    assert path.name.startswith("task-reasoning_gym-chain_sum-")
    assert task_model_dir(task_config("chain_sum", CHAIN_SUM)) == path
    assert task_model_dir(task_config("chain_sum", [*CHAIN_SUM, "task.options={max_terms=4}"])) != path
    assert task_model_dir(task_config("chain_sum", [*CHAIN_SUM, "eval.pass_reward=0.5"])) == path  # judged alike
    assert task_model_dir(config, SMALL) != path
    other = task_config("chain_sum", [*CHAIN_SUM, "roles.reward.engine.functions=[{path='rlflow.rewards:exact'}]"])
    assert task_model_dir(other) != path


def test_a_task_without_rows_gets_no_model_and_a_config_naming_one_unbuilt_says_how_to_build_it():
    with pytest.raises(TaskModelError, match="not task.kind = 'arith' \\(the arith task has the default model\\)"):
        task_model_dir(C.load(default_config_path()))
    config = task_config("chain_sum", [*CHAIN_SUM, 'roles.rollout.model="task"'])
    with pytest.raises(ConfigError, match="roles.rollout.model.*not built yet.*rlflow model build --task"):
        resolve(config)


@pytest.mark.slow  # two real (tiny) warm starts: torch, generation, the reward pool; ~20 s
def test_a_build_is_the_same_twice_loads_as_it_is_and_a_config_runs_on_it(tmp_path):
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    config = task_config("chain_sum", CHAIN_SUM)
    seen: list[float] = []
    first = build_task_model(config, SMALL, out=tmp_path / "a", progress=lambda text, fraction: seen.append(fraction))
    second = build_task_model(config, SMALL, out=tmp_path / "b")
    assert seen == sorted(seen) and seen[-1] == 1.0
    a, b = load_file(first / "model.safetensors"), load_file(second / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)  # seeded, deterministic kernels
    info = json.loads((first / "rlflow_build.json").read_text())
    assert info["steps"] == 6 and [h["step"] for h in info["history"]] == [3, 6]
    assert info["dev_rows"] == 8 and info["rows"] + info["dev_rows"] <= 200 and info["machine"]
    # It loads as it is, and its tokenizer speaks the task's prompts exactly (bytes: any text).
    model = AutoModelForCausalLM.from_pretrained(first)
    tokenizer = AutoTokenizer.from_pretrained(first)
    assert sum(p.numel() for p in model.parameters()) == info["parameters"]
    from rlflow.tasks.core import make_task

    task = make_task(config, tokenizer)
    text = task.prompt_text(0) + task.prompt(0, 1).reference
    assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text
    # Built where the config's task is, a config naming "task" resolves to it.
    build_task_model(config, SMALL, out=task_model_dir(config))
    named = resolve(task_config("chain_sum", [*CHAIN_SUM, 'roles.rollout.model="task"']))
    assert named.roles.rollout.model == str(task_model_dir(config).resolve())


def test_the_cli_names_a_task_it_cannot_build_in_one_line(tmp_path, capsys):
    from rlflow.tools.cli import main

    def model(*args: str) -> tuple[int, str, str]:
        code = main(["model", *args])
        out, err = capsys.readouterr()
        return code, out, err

    code, out, _ = model("path", "--task", "no_such_dataset_here")
    assert code == 0 and "task-reasoning_gym-no_such_dataset_here-" in out
    code, _, err = model("build", "--task", "no_such_dataset_here")
    assert code == 2 and "reasoning-gym dataset 'no_such_dataset_here'" in err and "Traceback" not in err
    code, _, err = model("build", "--task", str(default_config_path()))  # the embedded default: the arith task
    assert code == 2 and "not task.kind = 'arith'" in err
    with pytest.raises(SystemExit, match="--set goes with --task"):
        model("build", "--set", "task.size=3")
    assert main(["up", "--task", "spell_backward", "--config", str(default_config_path())]) == 2
    assert "--task" in (err := capsys.readouterr().err) and "goes without --config" in err
