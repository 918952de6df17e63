"""An episode's text and tokens: the prompt and each observation rendered once,
as the model will see them, and each model turn read back as text and tool calls.

* Text observations are tokenized as they are.
* Chat messages go through the tokenizer's chat template (with the tools'
  schemas, `tools=`): the first observation with the generation prompt; a
  later one as what the template writes after an assistant turn, then the
  observation's messages, then the next generation prompt. That is the
  template's rendering of a fixed conversation with and without the
  observation (their difference), after the text the template puts between
  the end of an assistant turn and the next message (its glue, where the
  model's own end-of-turn token is not part of it). So a model turn's tokens
  stay exactly as generated, and no text is ever tokenized again.
* Tool calls are read out of a model turn by the parser the rollout gives
  (vLLM's tool-call parser named in the config, `services.compat.tool_parser`),
  never by a pattern of rlflow's.

A run without a tokenizer (the simulated task) reads and writes text as
UTF-8 bytes, one token each.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

import trio

from rlflow.protocol import ChatMessage, EnvReply, ToolCall

#: The fixed conversation an observation is rendered after.
_BEFORE = [{"role": "user", "content": "question"}, {"role": "assistant", "content": "answer"}]


class RenderError(ValueError):
    """An observation cannot be rendered as the model would see it."""


class ByteTokenizer:
    """UTF-8 bytes as tokens: the text of a run whose task has no tokenizer."""

    eos_token = None
    chat_template = None

    @staticmethod
    def encode(text: str, add_special_tokens: bool = False) -> list[int]:
        return list(text.encode())

    @staticmethod
    def decode(ids: list[int], skip_special_tokens: bool = True) -> str:
        return bytes(i % 256 for i in ids).decode(errors="replace")


#: A tool-call parser: a function of a model turn's text -> ((name, arguments as JSON text, id) of
#: each call; whether the turn holds the parser's start marker; the turn's text outside its calls).
Parser = Callable[[str], tuple[list[tuple[str, str, str]], bool, str | None]]
#: Makes a tool-call parser from the tools' schemas.
ParserMaker = Callable[[list[dict[str, Any]]], Parser]


class EpisodeText:
    """Rendering and reading for one run: its tokenizer (None: UTF-8 bytes), and what
    makes its tool-call parser (`parser_name` names it in messages)."""

    def __init__(self, tokenizer: Any, make_parser: ParserMaker | None = None, parser_name: str = ""):
        self.tokenizer: Any = tokenizer or ByteTokenizer()
        self.make_parser, self.parser_name = make_parser, parser_name
        self._parse: Parser | None = None
        self._making = trio.Lock()
        self._glue: str | None = None

    def first(self, reply: EnvReply) -> list[int]:
        """The tokens of an episode's prompt: the reset's observation."""
        if not reply.messages:
            return self.encode(reply.text)
        return self.encode(self.render(_dicts(reply.messages), _schemas(reply.tools), generation=True))

    def observation(self, reply: EnvReply, tools: list[str]) -> list[int]:
        """The tokens of a step's observation, as they follow the model's turn."""
        if not reply.messages:
            return self.encode(reply.text)
        return self.following(_dicts(reply.messages), _schemas(tools))

    def following(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[int]:
        """The tokens of chat messages that follow the model's turn, and the next generation prompt."""
        before = self.render(_BEFORE, tools, generation=False)
        after = self.render(_BEFORE + messages, tools, generation=True)
        if not after.startswith(before):
            raise RenderError("the chat template renders a conversation differently once an observation follows "
                              "it, so the observation's tokens cannot be told apart; return text instead")
        return self.encode(self.glue(before) + after[len(before):])

    def glue(self, before: str) -> str:
        """What the template writes between the end of an assistant turn and the next message,
        less the model's own end-of-turn token (which the model generated)."""
        if self._glue is None:
            tail = before[before.rindex(_BEFORE[-1]["content"]) + len(_BEFORE[-1]["content"]):]
            eos = self.tokenizer.eos_token or ""
            self._glue = tail[len(eos):] if eos and tail.startswith(eos) else tail
        return self._glue

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int]) -> str:
        """A model turn as the environment reads it (special tokens left out)."""
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def before_stop(self, ids: list[int], stops: Sequence[str]) -> int | None:
        """How many of a turn's tokens `ids` to keep so that its text ends before the first of the
        `stops` strings in it, as vLLM applies `stop` (None: none is in it). A token that runs into
        the stop string goes with it, so that the kept tokens' text is what the agent reads."""
        text = self.decode(ids)
        at = min((i for i in (text.find(stop) for stop in stops if stop) if i >= 0), default=-1)
        if at < 0:
            return None
        low, high = 0, len(ids)  # the longest prefix whose text stays within text[:at]
        while low < high:
            mid = (low + high + 1) // 2
            if len(self.decode(ids[:mid])) <= at:
                low = mid
            else:
                high = mid - 1
        return low

    async def calls(self, ids: list[int], tools: list[str]) -> tuple[list[ToolCall], str]:
        """The tool calls of a model turn, and why they could not be parsed (empty: they could,
        or there are none). The parser is made on the first call, in a thread: vLLM's parsers are a
        heavy import, and the caller's loop goes on meanwhile."""
        async with self._making:
            if self._parse is None:
                if self.make_parser is None:
                    raise RenderError("the model's turns cannot be read for tool calls here: no tool-call parser")
                self._parse = await trio.to_thread.run_sync(self.make_parser, [json.loads(t) for t in tools])
        text = self.tokenizer.decode(list(ids), skip_special_tokens=False)
        found, marked, _ = self._parse(text)
        if not found and marked:
            return [], f"the {self.parser_name} parser found no well-formed tool call in the turn"
        return [ToolCall(name=name, arguments=arguments, id=call_id) for name, arguments, call_id in found], ""

    def render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, *, generation: bool) -> str:
        """The chat template's text of `messages` (with the generation prompt, if `generation`)."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise RenderError("chat messages came, but the tokenizer has no chat template: give text instead")
        return self.tokenizer.apply_chat_template(messages, tools=tools or None, add_generation_prompt=generation,
                                                  tokenize=False)


def _schemas(tools: list[str]) -> list[dict[str, Any]]:
    return [json.loads(t) for t in tools]


def _dicts(messages: list[ChatMessage]) -> list[dict[str, str]]:
    out = []
    for m in messages:
        item = {"role": m.role, "content": m.content}
        if m.name:
            item["name"] = m.name
        if m.tool_call_id:
            item["tool_call_id"] = m.tool_call_id
        out.append(item)
    return out
