"""Agents written with four agent frameworks, each as its own docs write one, trained by rlflow.

Each plays the default task (an addition: the prompt is ``57+68=``, the model
writes the columns and the sum after '#') through the framework's usual
OpenAI-compatible model class pointed at the episode's base URL:

* ``openai-agents``: the OpenAI Agents SDK, an `Agent` run by `Runner.run`
  on `OpenAIChatCompletionsModel` (tracing off: nothing leaves the machine);
* ``langgraph``: a LangGraph graph of one node that calls LangChain's
  `ChatOpenAI`;
* ``smolagents``: a smolagents `CodeAgent` on `OpenAIServerModel`, with
  ``max_steps=1``: the default model reads 256 positions, and each step of a
  code agent sends its whole memory again;
* ``pydantic-ai``: a Pydantic AI `Agent` on `OpenAIChatModel`.

All four speak chat; the default model's chat template renders a
conversation's text in its alphabet (system messages and tools left out, any
other character dropped). The agent gives each episode its reward: 1 if the
framework's final answer holds the right sum after its last '#', else 0.

Nothing here imports rlflow. rlflow starts copies of it (``[agents] command``
in examples/framework_agents.toml) with RLFLOW_AGENTS_URL, OPENAI_API_KEY and
RLFLOW_AGENT_COPY set; ``--framework copy`` gives copy k the k-th framework
above. Started by hand, point it at a run:

    python examples/framework_agents.py --framework langgraph --url http://127.0.0.1:PORT --key KEY
"""

from __future__ import annotations

import argparse
import asyncio
import os
from collections.abc import Awaitable, Callable

from episodes import play_episodes  # examples/episodes.py, beside this file

INSTRUCTIONS = "Add the two numbers: write the sum of each column, then a hash sign and the answer."


async def openai_agents(base_url: str, key: str, prompt: str) -> str:
    from agents import Agent, OpenAIChatCompletionsModel, Runner, set_tracing_disabled
    from openai import AsyncOpenAI

    set_tracing_disabled(True)
    model = OpenAIChatCompletionsModel(model="policy", openai_client=AsyncOpenAI(base_url=base_url, api_key=key))
    agent = Agent(name="adder", instructions=INSTRUCTIONS, model=model)
    result = await Runner.run(agent, prompt)
    return str(result.final_output)


async def langgraph(base_url: str, key: str, prompt: str) -> str:
    from langchain_openai import ChatOpenAI
    from langgraph.graph import END, START, MessagesState, StateGraph

    llm = ChatOpenAI(model="policy", base_url=base_url, api_key=key)

    async def call_model(state: MessagesState) -> dict:
        return {"messages": [await llm.ainvoke(state["messages"])]}

    graph = StateGraph(MessagesState)
    graph.add_node("model", call_model)
    graph.add_edge(START, "model")
    graph.add_edge("model", END)
    out = await graph.compile().ainvoke({"messages": [("system", INSTRUCTIONS), ("user", prompt)]})
    return str(out["messages"][-1].content)


async def smolagents(base_url: str, key: str, prompt: str) -> str:
    from smolagents import CodeAgent, LogLevel, OpenAIServerModel

    model = OpenAIServerModel(model_id="policy", api_base=base_url, api_key=key)
    agent = CodeAgent(tools=[], model=model, max_steps=1, verbosity_level=LogLevel.OFF)
    return str(await asyncio.to_thread(agent.run, f"{INSTRUCTIONS}\n{prompt}"))


async def pydantic_ai(base_url: str, key: str, prompt: str) -> str:
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    model = OpenAIChatModel("policy", provider=OpenAIProvider(base_url=base_url, api_key=key))
    agent = Agent(model, instructions=INSTRUCTIONS)
    return (await agent.run(prompt)).output


FRAMEWORKS: dict[str, Callable[[str, str, str], Awaitable[str]]] = {
    "openai-agents": openai_agents, "langgraph": langgraph, "smolagents": smolagents, "pydantic-ai": pydantic_ai,
}


def reward(row: dict, said: str) -> float:
    _, sep, tail = said.rpartition("#")
    digits = "".join(c for c in tail if c.isdigit())
    return 1.0 if sep and digits == str(row["a"] + row["b"]) else 0.0


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--framework", choices=[*FRAMEWORKS, "copy"], default="copy",
                        help="which (copy: the RLFLOW_AGENT_COPY-th, in the order above)")
    parser.add_argument("--url", default=os.environ.get("RLFLOW_AGENTS_URL", ""), help="the run's endpoint")
    parser.add_argument("--key", default=os.environ.get("OPENAI_API_KEY", ""), help="the run's key")
    parser.add_argument("--sessions", type=int, default=8, help="episodes played at once")
    parser.add_argument("--record", default="",
                        help="a folder: each ended episode's id and reward, a line, in FRAMEWORK.txt")
    args = parser.parse_args()
    if not args.url or not args.key:
        parser.error("no endpoint: give --url and --key (agents.json of the run has both)")
    name = args.framework
    if name == "copy":
        name = list(FRAMEWORKS)[int(os.environ.get("RLFLOW_AGENT_COPY", "0")) % len(FRAMEWORKS)]
    agent = FRAMEWORKS[name]

    async def play(episode: dict) -> float:
        try:
            said = await agent(episode["base_url"], args.key, episode["prompt"])
        except Exception as exc:  # the framework gave up (a refused request, no room left): no answer
            print(f"{name}: {type(exc).__name__}: {exc}", flush=True)
            said = ""
        return reward(episode["row"], said)

    record = os.path.join(args.record, f"{name}.txt") if args.record else ""
    await play_episodes(args.url, args.key, args.sessions, play, record)


if __name__ == "__main__":
    asyncio.run(main())
