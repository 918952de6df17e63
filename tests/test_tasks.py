"""The arithmetic task: worked answers, answer checking, deterministic
prompts, and a held-out set that training never sees."""

from __future__ import annotations

import numpy as np
import pytest

from rlflow import config as C
from rlflow.protocol import GroupInfo
from rlflow.tasks.arith import Arith
from rlflow.tasks.core import ArithTaskImpl, load_tokenizer, make_task, needs_tokenizer


def test_the_worked_answer_carries_column_by_column():
    assert Arith.solution(57, 68) == "7+8=15,5+6+1=12,#125"
    assert Arith.solution(5, 3) == "5+3=8,#8"
    assert Arith.solution(999, 1) == "9+1=10,9+0+1=10,9+0+1=10,#1000"


@pytest.mark.parametrize(
    ("text", "reward", "formatted"),
    [
        ("7+8=15,5+6+1=12,#125", 1.0, 1.0),
        ("#125", 1.0, 1.0),  # only the answer after the last # counts
        ("#12,#125", 1.0, 1.0),
        ("7+8=15,#124", 0.0, 1.0),
        ("7+8=15,5+6+1=12", 0.0, 0.0),
        ("#12a", 0.0, 0.0),
        ("#" + "1" * 41, 0.0, 0.0),  # absurdly long numbers are not parsed
    ],
)
def test_an_answer_is_checked_after_its_last_marker(text, reward, formatted):
    assert Arith.check("125", text) == (reward, {"correct": reward, "formatted": formatted})


def test_prompts_are_a_function_of_the_group_id_and_never_held_out():
    arith = Arith(C.ArithTask().digit_weights, seed=3, heldout_size=200)
    again = Arith(C.ArithTask().digit_weights, seed=3, heldout_size=200)
    problems = [arith.training_problem(g) for g in range(2000)]
    assert problems == [again.training_problem(g) for g in range(2000)]
    assert not set(problems) & set(arith.heldout)
    digits = np.bincount([len(str(a)) for a, _ in problems], minlength=9)[1:] / len(problems)
    expected = np.asarray(C.ArithTask().digit_weights) / sum(C.ArithTask().digit_weights)
    assert np.abs(digits - expected).max() < 0.05  # the configured skew, less the held-out one-digit ones


def test_the_task_speaks_token_ids(tmp_path):
    from models import tiny_model

    path = tiny_model(tmp_path / "model", tied=True)
    config = C.load(text='[pools.p]\n[roles.rollout]\npool="p"\n[roles.reward]\npool="p"\n[roles.trainer]\npool="p"\n'
                         '[task]\nkind="arith"\nheldout_size=10')
    assert needs_tokenizer(config)
    with pytest.raises(ValueError, match="needs the model's tokenizer"):
        make_task(config)
    tokenizer = load_tokenizer(path)
    task = make_task(config, tokenizer)
    assert isinstance(task, ArithTaskImpl)
    group = task.prompt(7, n=4, min_version=2)
    a, b = task.arith.training_problem(7)
    assert tokenizer.decode(group.prompt_ids) == f"{a}+{b}=" and group.reference == str(a + b)
    assert (group.n, group.min_version) == (4, 2)
    right = tokenizer.encode(Arith.solution(a, b), add_special_tokens=False)
    info = GroupInfo(group_id=7, size=4, reference=group.reference)
    assert task.score(info, 0, np.asarray(right))[0] == 1.0
    metrics = task.heldout_metrics([tokenizer.encode(Arith.solution(a, b), add_special_tokens=False)
                                    for a, b in task.arith.heldout])
    assert metrics["accuracy"] == 1.0 and metrics["problems"] == 10.0
