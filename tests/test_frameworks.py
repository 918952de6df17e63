"""examples/framework_agents.toml for real: agents written with the OpenAI Agents SDK, LangGraph,
smolagents and Pydantic AI (each as its docs write one: examples/framework_agents.py) play the
embedded default over the rollout's endpoint, one framework a copy, on real vLLM; the episodes of
every framework are trained."""

from __future__ import annotations

import pathlib
import sys

import pytest

from rlflow import config as C

ROOT = pathlib.Path(__file__).resolve().parent.parent
FRAMEWORKS = ("openai-agents", "langgraph", "smolagents", "pydantic-ai")

pytestmark = [pytest.mark.slow, pytest.mark.ray, pytest.mark.vllm, pytest.mark.timeout(900)]


def test_agents_of_four_frameworks_train_the_embedded_default(ray_cluster, tmp_path):
    from conftest import trained_groups

    from rlflow.control.launch import run
    from rlflow.tools.audit import audit

    record = tmp_path / "ended"
    record.mkdir()
    command = [sys.executable, str(ROOT / "examples" / "framework_agents.py"), "--framework", "copy",
               "--sessions", "4", "--record", str(record)]
    config = C.load(ROOT / "examples" / "framework_agents.toml", [
        f"agents.command={command!r}".replace("'", '"'), "run.steps=2", "eval.before=false", "eval.after=false",
        "cluster.handshake_timeout_s=800"])
    summary = run(config, tmp_path / "run")
    assert summary.state == "stopped", summary.error
    trained = {group for _, group, _ in trained_groups(tmp_path / "run")}
    assert len(trained) == 2 * config.run.batch_size
    for framework in FRAMEWORKS:  # each framework's episodes: ended by its agent, and trained
        ended = (record / f"{framework}.txt").read_text().split() if (record / f"{framework}.txt").exists() else []
        assert any(int(episode.split("-")[0]) in trained for episode in ended), (framework, ended[:5])
    result = audit(tmp_path / "run")
    assert (result.lost, result.duplicated) == (0, 0), result
