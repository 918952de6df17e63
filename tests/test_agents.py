"""Outside agents in whole runs (simulated engines, real services, real HTTP, agent programs on the
`openai` package that the rollout starts); their turns on real vLLM are in test_vllm.py."""

from __future__ import annotations

import pathlib
import sys

import pytest
import trio

from rlflow import config as C
from rlflow.config import ConfigError

AGENT = pathlib.Path(__file__).with_name("agents.py")


def agent_run(tmp_path: pathlib.Path, *overrides: str) -> C.Config:
    from test_controller import sim

    command = [sys.executable, str(AGENT), "--sessions", "8", "--die-once", str(tmp_path / "died")]
    return sim("run.steps=6", "roles.reward.engine={kind=\"env\"}", f"agents.command={command!r}".replace("'", '"'),
               "agents.copies=2", "agents.idle_timeout_s=2.0", "agents.api_key=\"k3y\"",
               "roles.rollout.engine.response_len.median=8", "cluster.heartbeat_timeout_s=5", *overrides)


async def test_a_run_trains_on_what_outside_agents_played_and_drops_the_group_of_one_that_died(tmp_path):
    from test_controller import run_in_process

    from rlflow.rundir import RunDir
    from rlflow.tools.audit import audit

    with trio.fail_after(120):
        controller, summary = await run_in_process(agent_run(tmp_path), tmp_path)
    assert summary.state == "stopped", summary.error
    assert (tmp_path / "died").exists()
    rows = RunDir(tmp_path).read_metrics()
    assert [r.step for r in rows] == list(range(6)) and all(r.samples == 16 for r in rows)
    assert all(r.train["episode_turns_mean"] == 2 for r in rows)
    assert summary.groups.dropped.get("abandoned", 0) >= 1
    info = RunDir(tmp_path).read_agents()
    assert info.api_key == "k3y" and list(info.urls) == ["rollout-0"]
    events = RunDir(tmp_path).read_status().roles["rollout"].counters.agent_events
    assert events["exits"] >= 1 and events["abandoned"] >= 1 and events["taken"] >= 24
    result = audit(tmp_path)
    assert (result.lost, result.duplicated) == (0, 0), result
    assert result.trained == 6 * 4


@pytest.mark.parametrize("overrides, key, says", [
    (['roles.env={environment={path="rlflow.env.sim:SimEnv"}, pool="score"}'], "agents", "not both"),
    (['run.staleness_check="strict"'], "run.staleness_check", "admission"),
    (["roles.reward.inline=true"], "roles.reward.inline", "reward role"),
])
def test_agent_configs_that_cannot_run_get_one_clear_line(tmp_path, overrides, key, says):
    with pytest.raises(ConfigError) as caught:
        agent_run(tmp_path, *overrides)
    assert caught.value.key == key and says in str(caught.value)
