"""examples/tools.toml for real: the tiny chat model (built on first use) sees
the `python` tool through its chat template, vLLM's hermes parser reads the
calls it writes, and the env role runs them in the code sandbox on its pool,
counting each by how it ended. (That episodes are rendered and masked right
is tests/test_env.py's; the tokenizer's round trip is tests/test_models.py's.)"""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

from rlflow import config as C
from rlflow.sandbox import check_isolation

ROOT = pathlib.Path(__file__).resolve().parent.parent
TOOLS = ROOT / "examples" / "tools.toml"
SANDBOX = check_isolation()

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(SANDBOX is not None, reason=f"no sandbox on this machine: {SANDBOX}")]


def test_check_shows_the_tool_to_the_model_and_scores_the_reference_answers():
    done = subprocess.run([sys.executable, "-m", "rlflow", "check", "--config", str(TOOLS)], check=False,
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    # The first observation, as the chat template renders it with the tool's schema.
    assert "--- episode of group 0, as the model sees it ---\n<|im_start|>system\nTools: python(code)<|im_end|>\n" \
           "<|im_start|>user\nWhat is " in done.stdout
    assert done.stdout.splitlines()[-1] == ("RESULT check rows=500 skipped=0 reference_reward_mean=1 failures=0 "
                                            "episodes=2 episode_reward_mean=0")


@pytest.mark.ray
@pytest.mark.vllm
@pytest.mark.timeout(900)  # vLLM's start alone took 221 s here while other jobs held the cores
def test_a_short_run_parses_the_models_tool_calls_and_runs_them_on_the_env_pool(ray_cluster, tmp_path):
    from rlflow.control.launch import run
    from rlflow.rundir import RunDir

    # 32 episodes: some call parses; the hellos wait for vLLM's start about as long as the test does.
    config = C.load(TOOLS, ["run.steps=1", "run.batch_size=8", "cluster.handshake_timeout_s=800"])
    summary = run(config, tmp_path / "run")
    assert summary.state == "stopped", summary.error
    folder = RunDir(tmp_path / "run")
    assert [r.step for r in folder.read_metrics()] == [0]
    calls = folder.read_status().roles["env"].counters.env_calls
    # (as of the env role's last heartbeat) The model's turns hold tool calls, which vLLM's parser read
    # and the sandbox ran; sampled at temperature 1, some are malformed, and are counted so.
    tools = {k: v for k, v in calls.items() if k.startswith("tool.")}
    assert calls.get("tool.python.ok", 0) >= 1 and sum(tools.values()) >= 8, calls
    assert set(tools) <= {"tool.python.ok", "tool.python.error", "tool.python.timeout", "tool.unparsed",
                          "tool.unknown"}, calls
