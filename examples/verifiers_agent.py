"""A verifiers environment trained by rlflow: its episodes played through rlflow's endpoint, its own
rubric the reward.

verifiers 0.4 (``import verifiers.v1 as vf``) pins ``openai<3``, which the other agent frameworks'
packages cannot share, so it lives in a virtual environment of its own (``make verifiers-venv``:
.venv-verifiers, verifiers==0.4.0) and this program runs there: it imports nothing of rlflow.

The environment is the default task as a verifiers taskset: each row a prompt (``57+68=``) and its
answer; the task's reward function (``@vf.reward``) gives 1 when the model's final reply holds the
answer after its last '#'. The harness is the one a single-turn chat environment needs, in-process:
one chat request through verifiers' interception server, which records the turn on the episode's
trace (the reward reads it there) and sends it on to the model verifiers is given: the episode's
``base_url`` on rlflow's endpoint. The runtime is the local one (`vf.SubprocessConfig`; verifiers'
default is a hosted sandbox), and no sampling field is set, so the run's sampling is used.

Each session takes an episode, builds its verifiers task from the episode's prompt and reference,
runs `env.run_episode`, and ends the rlflow episode with the reward the rubric computed. Started by
hand, point it at a run (agents.json has both):

    .venv-verifiers/bin/python examples/verifiers_agent.py --url http://127.0.0.1:PORT --key KEY
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys

import httpx
import verifiers.v1 as vf
from episodes import play_episodes  # examples/episodes.py, beside this file

#: The name verifiers finds this program's taskset and harness under (it loads plugins by module).
PLUGIN = "rlflow_verifiers_agent"


class Sum(vf.TaskData):
    """A row of the default task: `prompt` (the user's message) and the answer."""

    answer: str


class SumTask(vf.Task[Sum]):
    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        _, sep, tail = trace.last_reply.rpartition("#")
        return 1.0 if sep and "".join(c for c in tail if c.isdigit()) == self.data.answer else 0.0


class Sums(vf.Taskset[SumTask, vf.TasksetConfig]):
    """The taskset verifiers builds the environment on; rlflow hands out its rows, one an episode."""

    def load(self):
        return iter(())


class OneChatTurn(vf.Harness[vf.HarnessConfig]):
    """A single-turn chat agent: the task's prompt, one model turn through the interception server."""

    APPENDS_SYSTEM_PROMPT = True
    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data):
        system, prompt = self.resolve_prompt(data)
        messages = [{"role": "system", "content": system}] * bool(system) + [{"role": "user", "content": prompt}]
        async with httpx.AsyncClient(timeout=300) as client:
            answer = await client.post(f"{endpoint}/chat/completions", json={"model": ctx.model, "messages": messages},
                                       headers={"Authorization": f"Bearer {secret}"})
        return vf.ProgramResult(exit_code=0 if answer.status_code == 200 else 1, stdout=answer.text, stderr="")


__all__ = ["Sums", "OneChatTurn"]
sys.modules[PLUGIN] = sys.modules[__name__]


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default=os.environ.get("RLFLOW_AGENTS_URL", ""), help="the run's endpoint")
    parser.add_argument("--key", default=os.environ.get("OPENAI_API_KEY", ""), help="the run's key")
    parser.add_argument("--sessions", type=int, default=8, help="episodes played at once")
    parser.add_argument("--record", default="", help="a file: each ended episode's id and reward, a line")
    args = parser.parse_args()
    if not args.url or not args.key:
        parser.error("no endpoint: give --url and --key (agents.json of the run has both)")
    os.environ["RLFLOW_VERIFIERS_KEY"] = args.key  # verifiers reads a model's key from the variable it is named
    env = vf.SingleAgentEnv(vf.SingleAgentEnvConfig(
        taskset={"id": PLUGIN}, agent=vf.AgentConfig(harness={"id": PLUGIN}, runtime=vf.SubprocessConfig()),
        interception={"type": "server"}))

    async def play(episode: dict) -> float:
        task = SumTask(Sum(prompt=episode["prompt"], answer=episode["reference"]), vf.TaskConfig())
        model = vf.ModelContext(model="policy", sampling=vf.SamplingConfig(), client=vf.EvalClientConfig(
            base_url=episode["base_url"], api_key_var="RLFLOW_VERIFIERS_KEY"))
        played = await env.run_episode(task, model)
        return (played.traces[0].reward if played.traces else 0.0) or 0.0

    async with env.serving():
        await play_episodes(args.url, args.key, args.sessions, play, args.record)


if __name__ == "__main__":
    asyncio.run(main())
