"""The README and docs/ say what the code does: the configuration reference
is the code's, every link resolves, and every command they show is one the
code takes and that a test or a bench runs."""

from __future__ import annotations

import pathlib
import re
import shlex

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

SHOW = "tests/test_config.py::test_config_show_prints_the_effective_config_which_loads_back_the_same"
#: Where each command the docs show is run: a test (file::function) or a bench.
RUN_BY = {
    "make up": "Makefile (up: the venv, then rlflow up; the default run's figures in README.md)",
    "make test": ".ci/run",
    "make test-fast": "Makefile",
    "rlflow up": "tests/test_pipeline.py::test_cli_up_runs_twenty_steps",
    "rlflow up --config": "tests/test_ppo.py::test_the_ppo_example_warms_its_critic_up_then_its_policy_learns",
    "rlflow up --config --steps --run-dir": "tests/test_pipeline.py::test_cli_up_runs_twenty_steps",
    "rlflow up --config --set --set": "tests/test_pipeline.py::test_each_mode_runs_within_its_staleness_bound",
    "rlflow up --config --detach": "tests/test_pipeline.py::test_detach_status_and_down",
    "rlflow up --resume": "tests/test_e2e.py::test_a_run_resumes_from_its_last_checkpoint_detached",
    "rlflow up --set": "tests/test_e2e.py::test_a_few_steps_with_real_vllm_and_the_real_trainer",
    "rlflow status": "tests/test_pipeline.py::test_detach_status_and_down",
    "rlflow down": "tests/test_pipeline.py::test_detach_status_and_down",
    "rlflow check --config": "tests/test_check.py::test_a_good_dataset_and_reward_check_out",
    "rlflow report": "tests/test_report_plan.py::test_a_slow_reward_is_reported_as_the_bottleneck",
    "rlflow audit": "tests/test_audit.py::test_lost_duplicated_and_dropped_groups_are_named",
    "rlflow plan --devices":
        "tests/test_report_plan.py::test_the_planner_learns_unit_costs_from_a_run_and_ranks_layouts",
    "rlflow join --role --rank":
        "tests/test_external.py::test_join_prints_what_an_external_replica_needs_and_spec_md_names_each",
    "rlflow model build": "tests/test_models.py",
    "rlflow model build --task": "tests/test_taskmodel.py::test_the_cli_names_a_task_it_cannot_build_in_one_line",
    "rlflow up --task": "bench/peer.py (run_task: each rlflow system through bench/learning.py's run_one)",
    "rlflow config show": SHOW,
    "rlflow config show --config --set": SHOW,
}


def commands() -> list[tuple[str, str]]:
    """(page, command) of every command line in a fenced block of the docs
    (blocks of no language or a shell's; not TOML, not Python)."""
    out = []
    for page in PAGES:
        language = None  # None: outside a block
        for line in page.read_text().splitlines():
            if line.startswith("```"):
                language = line[3:].strip() if language is None else None
                continue
            if language not in ("", "sh", "console"):
                continue
            line = line.split("  #")[0].strip().removeprefix("$ ")
            if re.match(r"(rlflow|make|\.venv/bin/python|python|eval) ", line):
                out.append((page.name, line))
    return out


def shape(command: str) -> str:
    """A command's verb and flags, without values (``rlflow up --config --steps``)."""
    words = shlex.split(command)
    verbs = [w for w in words[:3] if not w.startswith("-") and re.fullmatch(r"[a-z-]+", w)]
    grouped = words[0] == "rlflow" and len(verbs) > 2 and verbs[1] in ("model", "config")
    head = " ".join(verbs[:3] if grouped else verbs[:2])
    return " ".join([head, *[w for w in words if w.startswith("--")]])


def test_the_configuration_reference_is_the_codes():
    from rlflow.config import reference

    text = reference.PAGE.read_text()
    start, end = text.index(reference.BEGIN), text.index(reference.END) + len(reference.END)
    assert text[start:end] == reference.generate(), "regenerate it: python -m rlflow.config.reference --write"


def test_every_link_resolves():
    for page in PAGES:
        for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", page.read_text()):
            if "://" not in target:
                assert (page.parent / target).exists(), f"{page.name} links to {target}, which is not there"


def test_the_readme_is_a_page_a_newcomer_reads_to_the_end():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) < 300
    text = "\n".join(lines)
    assert "make up" in text and "make test" in text


def test_every_command_the_docs_show_is_taken_by_the_code_and_run_by_a_test_or_a_bench():
    from rlflow.tools.cli import build_parser

    makefile = (ROOT / "Makefile").read_text()
    seen = commands()
    assert len(seen) > 20
    for page, command in seen:
        words = shlex.split(command)
        if words[0] == "rlflow":
            build_parser().parse_args(words[1:])  # raises SystemExit on a flag it does not take
            where = RUN_BY.get(shape(command))
            assert where is not None, f"{page}: `{command}` ({shape(command)}) is run by no test or bench"
            file, _, function = where.partition("::")
            source = (ROOT / file.split(" ")[0]).read_text()
            assert not function or f"def {function}(" in source, f"{where} does not exist"
        elif words[0] == "make":
            assert re.search(rf"^{re.escape(words[1])}:", makefile, re.M), f"{page}: no make target {words[1]}"
        elif words[0] == "eval":
            assert words[1].startswith("$(rlflow join")
        else:  # a script: it is there, and takes the flags shown
            script = ROOT / words[1]
            assert script.exists(), f"{page}: {words[1]} is not there"
            flags = {w.split("=")[0] for w in words[2:] if w.startswith("--")} - {"--help"}
            source = script.read_text()
            for flag in flags:
                assert f'"{flag}"' in source, f"{page}: {words[1]} takes no {flag}"


@pytest.mark.parametrize("command", ["rlflow up --config my.toml --set run.mode=sync --set roles.rollout.replicas=4",
                                     "rlflow model build default-teacher", "rlflow join RUN_DIR --role reward --rank 0",
                                     "rlflow config show --config my.toml --set run.steps=5"])
def test_the_shape_of_a_command_is_its_verb_and_flags(command):
    assert shape(command) in RUN_BY
