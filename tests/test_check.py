"""`rlflow check`: the task and reward functions loaded without a run; what
the model will see; one line naming file, row and field when data is bad."""

from __future__ import annotations

import contextlib
import io
import json
import os
import pathlib
import subprocess
import sys
from dataclasses import dataclass

import pytest
import tomli_w
from models import tiny_model

from rlflow.sandbox import check_isolation

ROOT = pathlib.Path(__file__).resolve().parent.parent
SANDBOX = check_isolation()
needs_sandbox = pytest.mark.skipif(SANDBOX is not None, reason=f"no sandbox on this machine: {SANDBOX}")

#: Each check loads a dataset and starts reward worker processes.
pytestmark = pytest.mark.slow


@dataclass
class Done:
    """What `rlflow check` said, as a finished process would have."""

    returncode: int
    stdout: str
    stderr: str


def rlflow(*args: str, cwd: pathlib.Path = ROOT) -> Done:
    """The `rlflow` command in this process (the console script itself is run once, below)."""
    from rlflow.tools.cli import main

    out, err, before = io.StringIO(), io.StringIO(), os.getcwd()
    try:
        os.chdir(cwd)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(list(args))
    finally:
        os.chdir(before)
    return Done(code, out.getvalue(), err.getvalue())


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp("check") / "model", tied=True)


def check(model, *sets: str, cwd: pathlib.Path = ROOT) -> Done:
    args = ["check", "--config", str(ROOT / "examples" / "dataset.toml"),
            "--set", f"roles.rollout.model={json.dumps(str(model))}", "--rows", "50"]
    for item in sets:
        args += ["--set", item]
    return rlflow(*args, cwd=cwd)


def test_a_good_dataset_and_reward_check_out(model):
    done = check(model)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "task dataset: 8000 training rows loaded, 0 left out; 1000 evaluation rows"
    assert sum(line.startswith("--- prompt of group") for line in lines) == 3
    assert any(line.startswith("prompt tokens: min 4, median") for line in lines)
    assert lines[-1] == "RESULT check rows=8000 skipped=0 reference_reward_mean=1 failures=0"


def test_long_prompts_are_counted(model):
    done = check(model, "task.max_prompt_tokens=10")
    assert done.returncode == 0, done.stderr
    assert "left out" in done.stdout and "longer than task.max_prompt_tokens = 10" in done.stdout
    skipped = int(done.stdout.splitlines()[-1].split("skipped=")[1].split()[0])
    assert skipped > 0


@pytest.mark.parametrize(
    ("rows", "sets", "error"),
    [
        ([{"prompt": "1+1=", "answer": "2"}, {"q": "x", "answer": "1"}], [], r": line 2: has no field 'prompt'"),
        ([{"prompt": [{"role": "user", "text": "hi"}], "answer": "1"}], ["task.chat_template=false"],
         r": line 1: field 'prompt'\[0\]: is not a \{role, content\} message"),
        ([{"prompt": "1+1=", "answer": "2"}], ['roles.reward.engine.functions=[{path = "no_such_module:f"}]'],
         r"reward function 'no_such_module:f': cannot import module"),
        ([{"prompt": "1+1=", "answer": "2"}],
         ['roles.reward.engine.functions=[{path = "tomllib:loads", kwargs = {x = 1}}]'],
         r"reward function 'tomllib:loads' cannot be called as loads\(sample, \*\*kwargs\) with x"),
    ],
)
def test_bad_data_or_functions_are_one_line_and_exit_status_2(model, tmp_path, rows, sets, error):
    import re

    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    done = check(model, f"task.train={json.dumps(str(data))}", "task.eval=", *sets)
    assert done.returncode == 2, done.stdout + done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert re.search(error, done.stderr), done.stderr
    if "line" in error:
        assert str(data) in done.stderr


def test_a_reward_module_beside_the_config_is_found_by_the_rlflow_command(model, tmp_path):
    """The console script does not put its working directory on the import
    path (`python -m rlflow` does): the run's `import_dir` does, for the check
    and for every reward worker."""
    (tmp_path / "user_rewards.py").write_text(
        "def fn(sample):\n    return float(sample.response.strip() == sample.reference.strip())\n"
    )
    (tmp_path / "data.jsonl").write_text("".join(json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1)}) + "\n"
                                                 for i in range(4)))
    (tmp_path / "my.toml").write_text(tomli_w.dumps({
        "pools": {"cpu": {"cpus_per_bundle": 1}},
        "roles": {
            "rollout": {"pool": "cpu", "model": str(model)},
            "reward": {"pool": "cpu", "engine": {"kind": "functions", "functions": [{"path": "user_rewards:fn"}]}},
            "trainer": {"pool": "cpu"},
        },
        "task": {"kind": "dataset", "train": "data.jsonl"},
    }))
    rlflow = pathlib.Path(sys.executable).parent / "rlflow"
    done = subprocess.run([str(rlflow), "check", "--config", "my.toml"], capture_output=True, text=True, timeout=300,
                          cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == "RESULT check rows=4 skipped=0 reference_reward_mean=1 failures=0"


def code_check(*sets: str) -> Done:
    args = ["check", "--config", str(ROOT / "examples" / "code.toml")]
    for item in sets:
        args += ["--set", item]
    return rlflow(*args)


@needs_sandbox
def test_the_code_examples_reference_solutions_score_1_in_the_sandbox():
    done = code_check()
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == "RESULT check rows=12 skipped=0 reference_reward_mean=1 failures=0"
    assert "no reference answer" not in done.stdout


@needs_sandbox
def test_check_names_the_rows_without_a_reference(tmp_path):
    rows = [json.loads(line) for line in (ROOT / "examples" / "data" / "code.jsonl").read_text().splitlines()]
    for i in (2, 4, 5, 6, 7, 8, 9):
        rows[i]["solution"] = None if i % 2 else ""
    data = tmp_path / "code.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    done = code_check(f"task.train={json.dumps(str(data))}")
    assert done.returncode == 0, done.stderr
    assert (f"7 of 12 rows have no reference answer (task.answer = 'solution'), so how the functions score a right "
            f"answer is not checked on them: {data}: lines 3, 5, 6, 7, 8, ...") in done.stdout
    assert done.stdout.splitlines()[-1] == "RESULT check rows=12 skipped=0 reference_reward_mean=1 failures=0"

