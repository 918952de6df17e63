"""The OpenAI API at the agents' endpoint, both ways: requests read by vLLM's
request models (their checks are vLLM's server's), answers written by its
response models, so that an agent gets the JSON vLLM's own server would send
it: whole answers with every field, streamed events with those set (as vLLM
streams them), ``token_ids`` and ``prompt_token_ids`` where a request asks
``return_token_ids``. vLLM's protocol modules are a heavy import: both kinds
of model are imported at their first use (`requests`, `answers`).
"""

from __future__ import annotations

import functools
import itertools
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from rlflow.protocol import FinishReason, Response
from rlflow.services.rollout import http
from rlflow.services.rollout.agent_book import Refused

#: A turn's finish as the API names it.
FINISH = {FinishReason.STOP: "stop", FinishReason.LENGTH: "length"}
#: The event that ends a stream.
DONE = b"data: [DONE]\n\n"


@functools.cache
def requests() -> tuple[Any, Any, Any]:
    """vLLM's chat and completion request models and its client error (`compat.openai_requests`)."""
    from rlflow.services import compat

    return compat.openai_requests()


@functools.cache
def answers() -> Any:
    """vLLM's answer models (`compat.openai_responses`)."""
    from rlflow.services import compat

    return compat.openai_responses()


def validated(model: Any, body: Any) -> Any:
    """`body` read by the request `model`; refused (400) naming the first field it finds wrong."""
    import pydantic

    if not isinstance(body, dict):
        raise Refused(400, "the request body is not a JSON object")
    try:
        return model.model_validate(body)
    except pydantic.ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(x) for x in first.get("loc", ()))
        raise Refused(400, f"{where}: {first.get('msg', 'invalid')}" if where else str(first.get("msg"))) from None
    except (ValueError, requests()[2]) as exc:  # vLLM's own checks of a request
        raise Refused(400, str(exc)) from None


def body(request: http.HttpRequest) -> dict[str, Any]:
    """The request's JSON object (empty: no body)."""
    try:
        value = request.json() or {}
    except ValueError as exc:
        raise Refused(400, f"the request body is not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise Refused(400, f"the request body is a JSON {type(value).__name__}, not an object")
    return value


def message(m: Any) -> dict[str, Any]:
    """A request's chat message as the chat template reads it: text content, tool calls' arguments as
    objects (as vLLM's own server passes them)."""
    m = dict(m)
    content = m.get("content")
    if isinstance(content, list):
        m["content"] = "".join(part.get("text", "") for part in content if isinstance(part, dict))
    calls = m.get("tool_calls")
    if calls:
        m["tool_calls"] = [dict(call) for call in calls]
        for call in m["tool_calls"]:
            function = dict(call.get("function") or {})
            if isinstance(function.get("arguments"), str):
                try:
                    function["arguments"] = json.loads(function["arguments"])
                except ValueError:
                    pass
            call["function"] = function
    return m


def stops(stop: str | list[str] | None) -> list[str]:
    """A request's `stop`, as strings."""
    return [stop] if isinstance(stop, str) else list(stop or [])


def usage(prompt_ids: Sequence[int], ids: Sequence[int]) -> Any:
    return answers().UsageInfo(prompt_tokens=len(prompt_ids), completion_tokens=len(ids),
                               total_tokens=len(prompt_ids) + len(ids))


def whole(answer: Any) -> http.HttpResponse:
    """A whole answer, every field written."""
    return http.HttpResponse(200, answer.model_dump_json().encode())


def event(value: Any) -> bytes:
    """One server-sent event: an answer model's fields that were set, or a plain object (an error)."""
    text = value.model_dump_json(exclude_unset=True) if hasattr(value, "model_dump_json") else json.dumps(value)
    return b"data: " + text.encode() + b"\n\n"


async def stream(events: Iterable[Any]) -> AsyncIterator[bytes]:
    """Events known at once, then the end."""
    for value in events:
        yield event(value)
    yield DONE


def _set(**fields: Any) -> dict[str, Any]:
    """The fields that are not None (those left unset stay out of a streamed event)."""
    return {k: v for k, v in fields.items() if v is not None}


@dataclass
class _Answer:
    """An answer's request: the `model` it named, the tokens its turn was generated over, whether it
    asked for log-probabilities and token ids; `decode`: token ids to text; `fingerprint`: the
    answer's `system_fingerprint` (None: none); `created`: when the request came."""

    model: str
    prompt_ids: list[int]
    logprobs: Any
    token_ids: bool | None
    decode: Callable[[list[int]], str]
    fingerprint: str | None = None
    created: int = field(default_factory=lambda: int(time.time()))


@dataclass
class ChatAnswer(_Answer):
    """The answer to one chat turn, whole (`whole`) or as events (`first`, `delta`, `end`)."""

    id: str = field(default_factory=lambda: f"chatcmpl-{uuid.uuid4().hex}")

    def _logprobs(self, out: Response) -> Any:
        if not self.logprobs:
            return None
        return answers().ChatCompletionLogProbs(content=[
            {"token": self.decode([t]), "logprob": float(lp), "top_logprobs": []}
            for t, lp in zip(out.token_ids.tolist(), out.logprobs.tolist())])

    def whole(self, out: Response, content: str | None, calls: list[dict[str, Any]], finish: str) -> Any:
        a = answers()
        ids = out.token_ids.tolist()
        return a.ChatCompletionResponse(
            id=self.id, created=self.created, model=self.model, system_fingerprint=self.fingerprint,
            choices=[a.ChatCompletionResponseChoice(
                index=0, message=a.ChatMessage(role="assistant", content=content, tool_calls=calls),
                logprobs=self._logprobs(out), finish_reason=finish, token_ids=ids if self.token_ids else None)],
            usage=usage(self.prompt_ids, ids), prompt_token_ids=self.prompt_ids if self.token_ids else None)

    def _chunk(self, choices: list[Any], **more: Any) -> Any:
        return answers().ChatCompletionStreamResponse(
            id=self.id, object="chat.completion.chunk", created=self.created, model=self.model, choices=choices,
            **_set(system_fingerprint=self.fingerprint), **more)

    def delta(self, content: str | None = None, *, role: str | None = None,
              calls: list[dict[str, Any]] | None = None) -> Any:
        """An event of the turn's text (`role`: the first, which also names the prompt's tokens)."""
        a = answers()
        delta = a.DeltaMessage(**_set(role=role, content=content),
                               **({"tool_calls": [{"index": i, **call} for i, call in enumerate(calls)]}
                                  if calls else {}))
        first = {"prompt_token_ids": self.prompt_ids} if role and self.token_ids else {}
        return self._chunk([a.ChatCompletionResponseStreamChoice(index=0, delta=delta, logprobs=None,
                                                                 finish_reason=None)], **first)

    def first(self) -> Any:
        return self.delta("", role="assistant")

    def end(self, out: Response, finish: str, usage_too: bool) -> list[Any]:
        """The last events: how the turn finished (its log-probabilities and token ids, where asked), then
        its usage (where the request's `stream_options` asked)."""
        a = answers()
        ids = out.token_ids.tolist()
        events = [self._chunk([a.ChatCompletionResponseStreamChoice(
            index=0, delta=a.DeltaMessage(), logprobs=self._logprobs(out), finish_reason=finish,
            **_set(token_ids=ids if self.token_ids else None))])]
        if usage_too:
            events.append(self._chunk([], usage=usage(self.prompt_ids, ids)))
        return events

    def events(self, out: Response, content: str | None, calls: list[dict[str, Any]], finish: str,
               usage_too: bool) -> list[Any]:
        """A whole turn as events (one streamed at its end)."""
        return ([self.first()] + [self.delta(content)] * bool(content) + [self.delta(calls=calls)] * bool(calls)
                + self.end(out, finish, usage_too))


@dataclass
class CompletionAnswer(_Answer):
    """The answer to one completion turn, whole (`whole`) or as events (`delta`, `end`)."""

    id: str = field(default_factory=lambda: f"cmpl-{uuid.uuid4().hex}")

    def _choice(self, kind: Any, out: Response, text: str) -> Any:
        ids, said = out.token_ids.tolist(), out.logprobs.tolist()
        tokens = [self.decode([t]) for t in ids]
        # Each token's top log-probabilities hold the sampled token alone (as vLLM's, which always include it).
        logprobs = answers().CompletionLogProbs(
            tokens=tokens, token_logprobs=said, top_logprobs=[{t: lp} for t, lp in zip(tokens, said)],
            text_offset=list(itertools.accumulate([len(t) for t in tokens[:-1]], initial=0)) if tokens else []
        ) if self.logprobs is not None else None
        return kind(index=0, text=text, logprobs=logprobs, finish_reason=FINISH.get(out.finish_reason, "stop"),
                    **(dict(prompt_token_ids=self.prompt_ids, token_ids=ids) if self.token_ids else {}))

    def whole(self, out: Response, text: str) -> Any:
        a = answers()
        return a.CompletionResponse(
            id=self.id, created=self.created, model=self.model, system_fingerprint=self.fingerprint,
            choices=[self._choice(a.CompletionResponseChoice, out, text)],
            usage=usage(self.prompt_ids, out.token_ids.tolist()))

    def _chunk(self, choices: list[Any], **more: Any) -> Any:
        return answers().CompletionStreamResponse(
            id=self.id, object="text_completion", created=self.created, model=self.model, choices=choices,
            **_set(system_fingerprint=self.fingerprint), **more)

    def delta(self, text: str) -> Any:
        return self._chunk([answers().CompletionResponseStreamChoice(index=0, text=text, logprobs=None,
                                                                     finish_reason=None)])

    def end(self, out: Response, text: str, usage_too: bool) -> list[Any]:
        """The last events: the rest of the turn's `text` with how it finished, then its usage (where asked)."""
        events = [self._chunk([self._choice(answers().CompletionResponseStreamChoice, out, text)])]
        if usage_too:
            events.append(self._chunk([], usage=usage(self.prompt_ids, out.token_ids.tolist())))
        return events
