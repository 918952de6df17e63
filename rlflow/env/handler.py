"""What the env role answers to each request of the env channel, worked out on
an `EnvPool`: the same for an env replica and for a rollout that runs its
environment in line (`roles.env.inline`).

* `EnvReset`: the environment's `reset` of the row (its observation), with
  the tools' schemas; with `scripted`, also its `reference_turns`.
* `EnvStep` with tool calls (or calls that could not be parsed): each call
  runs in the pool, at once, and the observation is one ``tool`` message per
  call with its result, or with what went wrong (a call that fails, times
  out, names no tool or could not be parsed); reward 0, not done.
* `EnvStep` without: the environment's `step`.

The environment failing (reset or step: timeout, error, crashed) is the
episode's failure, said in the reply's `error`. Every call is counted by
outcome in `counters` (``env.reset.ok``, ``tool.python.timeout``, ...).
"""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

import trio

from rlflow.env.pool import EnvPool, Outcome
from rlflow.protocol import ChatMessage, EnvReply, EnvReset, EnvStep, ToolCall, ToolResult


class EnvHandler:
    """Answers env requests with `pool` (`timeout_s`: the role's per call; `tools`: their specs)."""

    def __init__(self, pool: EnvPool, *, tools: list[Any], timeout_s: float, counters: Counter[str]):
        self.pool = pool
        self.tools = {spec.name: spec for spec in tools}
        self.timeout_s = timeout_s
        self.counters = counters

    async def answer(self, msg: EnvReset | EnvStep) -> EnvReply:
        self.counters["env_requests"] += 1
        if isinstance(msg, EnvReset):
            return await self._reset(msg)
        if msg.calls or msg.unparsed:
            return await self._tools(msg)
        outcome = await self._call("env.step", "step", {
            "episode": {"row": msg.row, "reference": msg.reference, "group_id": msg.group_id, "index": msg.index,
                        "turn": msg.turn, "turns": [*msg.turns, msg.text], "state": msg.state},
            "turn": msg.text,
        }, self.timeout_s)
        if not outcome.ok:
            return _failed(msg.request_id, "step", outcome)
        value = outcome.value
        return EnvReply(request_id=msg.request_id, text=value["text"], messages=_messages(value["messages"]),
                        reward=value["reward"], done=value["done"], state=value["state"])

    async def _reset(self, msg: EnvReset) -> EnvReply:
        outcome = await self._call("env.reset", "reset", {"row": msg.row}, self.timeout_s)
        if not outcome.ok:
            return _failed(msg.request_id, "reset", outcome)
        scripted: list[str] = []
        if msg.scripted:
            turns = await self._call("env.reference", "reference", {"row": msg.row}, self.timeout_s)
            scripted = turns.value if turns.ok else []
        return EnvReply(request_id=msg.request_id, text=outcome.value["text"],
                        messages=_messages(outcome.value["messages"]), tools=self.pool.tools, scripted=scripted)

    async def _tools(self, msg: EnvStep) -> EnvReply:
        if msg.unparsed:
            self.counters["env.tool.unparsed"] += 1
            text = f"Error: the tool call could not be parsed: {msg.unparsed}"
            return EnvReply(request_id=msg.request_id, messages=[ChatMessage(role="tool", content=text)],
                            state=msg.state, results=[ToolResult(name="", status="unparsed")])
        answers: list[tuple[str, str]] = [("", "")] * len(msg.calls)

        async def one(i: int, call: ToolCall) -> None:
            answers[i] = await self._tool(call)

        async with trio.open_nursery() as nursery:
            for i, call in enumerate(msg.calls):
                nursery.start_soon(one, i, call)
        return EnvReply(
            request_id=msg.request_id,
            messages=[ChatMessage(role="tool", content=text, name=call.name, tool_call_id=call.id)
                      for call, (_, text) in zip(msg.calls, answers, strict=True)],
            state=msg.state,
            results=[ToolResult(name=call.name, status=status) for call, (status, _) in zip(msg.calls, answers)],
        )

    async def _tool(self, call: ToolCall) -> tuple[str, str]:
        """(status, what the model is told) of one tool call."""
        spec = self.tools.get(call.name)
        if spec is None:
            self.counters["env.tool.unknown"] += 1
            known = ", ".join(sorted(self.tools)) or "none"
            return "unknown", f"Error: there is no tool {call.name!r} (tools: {known})"
        try:
            arguments = json.loads(call.arguments or "{}")
        except json.JSONDecodeError as error:
            arguments = error
        if not isinstance(arguments, dict):
            self.counters[f"env.tool.{call.name}.error"] += 1
            return "error", f"Error: the arguments of {call.name} are not a JSON object: {call.arguments[:200]}"
        outcome = await self._call(f"env.tool.{call.name}", "tool", {"name": call.name, "arguments": arguments},
                                   spec.timeout_s or self.timeout_s)
        if outcome.ok:
            return "ok", outcome.value
        return outcome.status, f"Error: {call.name} {_said(outcome)}"

    async def _call(self, counter: str, kind: str, args: dict[str, Any], timeout_s: float) -> Outcome:
        outcome = await self.pool.call(kind, args, timeout_s)
        self.counters[f"{counter}.{outcome.status}"] += 1
        return outcome


def _failed(request_id: int, what: str, outcome: Outcome) -> EnvReply:
    return EnvReply(request_id=request_id, error=f"the environment's {what} {_said(outcome)}"[:1000],
                    error_kind=outcome.status)


def _said(outcome: Outcome) -> str:
    match outcome.status:
        case "timeout":
            return f"timed out: {outcome.message}"
        case "crashed":
            return f"crashed: {outcome.message}"
    return f"failed: {outcome.message}"


def _messages(items: list[dict[str, str]]) -> list[ChatMessage]:
    return [ChatMessage(**item) for item in items]
