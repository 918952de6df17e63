"""examples/framework_agents.toml for real: agents written with the OpenAI Agents SDK, LangGraph,
smolagents and Pydantic AI (each as its docs write one: examples/framework_agents.py) play the
embedded default over the rollout's endpoint, one framework a copy, on real vLLM; beside them, a
verifiers environment (examples/verifiers_agent.py, on its own interpreter: `make verifiers-venv`)
plays it through the router's one address, its rubric giving the rewards. The episodes of every
framework are trained."""

from __future__ import annotations

import pathlib
import sys

import pytest

from rlflow import config as C

ROOT = pathlib.Path(__file__).resolve().parent.parent
FRAMEWORKS = ("openai-agents", "langgraph", "smolagents", "pydantic-ai")

pytestmark = [pytest.mark.slow, pytest.mark.ray, pytest.mark.vllm, pytest.mark.timeout(900)]


#: The interpreter of verifiers' own environment (the Makefile's verifiers-venv).
VERIFIERS = ROOT / ".venv-verifiers" / "bin" / "python"


def test_agents_of_four_frameworks_and_a_verifiers_environment_train_the_embedded_default(ray_cluster, tmp_path):
    import os
    import subprocess
    import threading

    from conftest import trained_groups

    from rlflow.control.launch import run
    from rlflow.rundir import RunDir
    from rlflow.tools.audit import audit

    assert VERIFIERS.exists(), f"no {VERIFIERS}: `make verifiers-venv` makes it (`make test` does)"
    record = tmp_path / "ended"
    record.mkdir()
    command = [sys.executable, str(ROOT / "examples" / "framework_agents.py"), "--framework", "copy",
               "--sessions", "4", "--record", str(record)]
    config = C.load(ROOT / "examples" / "framework_agents.toml", [
        f"agents.command={command!r}".replace("'", '"'), "run.steps=3", "eval.before=false", "eval.after=false",
        "cluster.handshake_timeout_s=800"])
    run_dir = tmp_path / "run"
    verifiers: list[subprocess.Popen] = []
    started = threading.Event()

    def start_verifiers() -> None:  # on the router's address, as soon as agents.json names it
        while not started.is_set():
            info = RunDir(run_dir).read_agents() if run_dir.exists() else None
            if info is not None and info.url:
                home = tmp_path / "home"  # where verifiers keeps its caches
                home.mkdir()
                verifiers.append(subprocess.Popen(
                    [str(VERIFIERS), str(ROOT / "examples" / "verifiers_agent.py"), "--sessions", "4",
                     "--record", str(record / "verifiers.txt")],
                    env={**os.environ, "RLFLOW_AGENTS_URL": info.url, "OPENAI_API_KEY": info.api_key,
                         "HOME": str(home)}))
                return
            started.wait(0.05)

    watcher = threading.Thread(target=start_verifiers, daemon=True)
    watcher.start()
    try:
        summary = run(config, run_dir)
    finally:
        started.set()
        watcher.join()
        for process in verifiers:
            process.kill()
            process.wait()
    assert summary.state == "stopped", summary.error
    trained = {group for _, group, _ in trained_groups(run_dir)}
    assert len(trained) == 3 * config.run.batch_size
    for framework in FRAMEWORKS:  # each framework's episodes: ended by its agent, and trained
        ended = [line.split()[0] for line in (record / f"{framework}.txt").read_text().splitlines()] \
            if (record / f"{framework}.txt").exists() else []
        assert any(int(episode.split("-")[0]) in trained for episode in ended), (framework, ended[:5])
    # verifiers' episodes too, each with the reward its environment's rubric computed (0 or 1).
    ended = [line.split() for line in (record / "verifiers.txt").read_text().splitlines()] \
        if (record / "verifiers.txt").exists() else []
    assert any(int(episode.split("-")[0]) in trained for episode, _ in ended), ended[:5]
    assert {float(reward) for _, reward in ended} <= {0.0, 1.0}
    result = audit(run_dir)
    assert (result.lost, result.duplicated) == (0, 0), result
