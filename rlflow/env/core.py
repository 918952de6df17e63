"""The contract between rlflow and an environment or a tool: how each is
named, what it is called with, what it may return.

An environment is a class named by import path (``package.module:Class``),
made once per worker process with the keyword arguments of its
`EnvironmentSpec`. Its methods may be sync or ``async def``:

* ``reset(row) -> observation``: the first observation of an episode on the
  dataset row `row` (a dict of plain data): the prompt, as text or as a
  list of chat messages (``{"role": ..., "content": ...}``). It is called
  once per group: every episode of a group starts from it.
* ``step(episode, turn) -> (observation, reward, done)``: the answer to the
  model's turn `turn` (text) of `episode` (an `Episode`): the observation
  that follows it (text, chat messages, or None once done), this turn's
  reward (a finite float) and whether the episode is over. A `Step` may be
  returned instead of the tuple.
* ``reference_turns(row) -> list[str]`` (optional): model turns that play
  the row right, for `rlflow check` to show an episode before any
  generation.

Nothing is kept between calls in the environment's object for one episode:
an episode's own state lives in ``episode.state``, a dict of plain data
that ``step`` may change, which travels with the episode (any worker of
any env replica may take its next step).

A tool is a function named by import path (``package.module:function``),
sync or async, called with the keyword arguments the model wrote (and its
`ToolSpec.kwargs`); it returns text (anything else is shown to the model as
JSON). The model sees its JSON schema, made from its signature and its
docstring (Google style, an ``Args:`` section), or its ``schema`` attribute
(the schema of OpenAI's ``tools`` field) where it has one.

The specs that name an environment and its tools (`EnvironmentSpec`,
`ToolSpec`) are the config's (`rlflow.config.environment`); this module
imports them and the standard library only.
"""

from __future__ import annotations

import importlib
import inspect
import json
import math
import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from rlflow.config.environment import EnvironmentSpec, ToolSpec


class EnvError(ValueError):
    """An environment or tool named in a config cannot be used; the message
    names its import path and says why."""


class BadReturn(Exception):
    """An environment returned something it may not; the message names what came back."""


@dataclass
class Episode:
    """One episode so far, as `step` sees it."""

    row: dict[str, Any]
    """The dataset row it plays (the same for every episode of its group)."""
    reference: str = ""
    """The row's reference answer, where the task has one."""
    group_id: int = 0
    """Its group."""
    index: int = 0
    """Its index in the group."""
    turn: int = 1
    """The model turns so far, the one being answered included."""
    turns: list[str] = field(default_factory=list)
    """The model's turns so far, as text, the one being answered last."""
    state: dict[str, Any] = field(default_factory=dict)
    """The environment's own record of the episode: plain data, kept from one step to the next."""


class Step(NamedTuple):
    """What `step` returns (a tuple of the same three works too)."""

    observation: str | list[dict[str, str]] | None
    """What the model sees next: text, chat messages, or None when done."""
    reward: float = 0.0
    """This turn's reward."""
    done: bool = False
    """The episode is over."""


def load(path: str, what: str) -> Any:
    """The object at import path `path` ("package.module:attribute", attributes
    may be dotted); `EnvError` naming the path and what is wrong."""
    module_name, _, attribute = path.partition(":")
    try:
        target: Any = importlib.import_module(module_name)
    except Exception as error:
        raise EnvError(f"{what} {path!r}: cannot import module {module_name!r}: {type(error).__name__}: {error}") \
            from error
    for i, part in enumerate(attribute.split(".")):
        try:
            target = getattr(target, part)
        except AttributeError:
            owner = ".".join([module_name, *attribute.split(".")[:i]])
            raise EnvError(f"{what} {path!r}: {owner!r} has no attribute {part!r}") from None
    return target


def make_environment(spec: EnvironmentSpec) -> Any:
    """An instance of the environment class of `spec`, checked to have `reset` and `step`."""
    cls = load(spec.path, "environment")
    if not inspect.isclass(cls):
        raise EnvError(f"environment {spec.path!r} is a {type(cls).__name__}, not a class")
    missing = [name for name in ("reset", "step") if not callable(getattr(cls, name, None))]
    if missing:
        raise EnvError(f"environment {spec.path!r} has no {' or '.join(missing)} method")
    try:
        return cls(**spec.kwargs)
    except TypeError as error:
        raise EnvError(f"environment {spec.path!r} cannot be made with kwargs {sorted(spec.kwargs)}: {error}") \
            from None


def load_tool(spec: ToolSpec) -> Any:
    """The function of `spec`, checked to be callable."""
    fn = load(spec.path, "tool")
    if not callable(fn):
        raise EnvError(f"tool {spec.path!r} is not callable: it is a {type(fn).__name__}")
    return fn


def tool_schema(fn: Any, spec: ToolSpec) -> dict[str, Any]:
    """The JSON schema the model sees of tool `fn` (OpenAI's ``tools`` entry):
    its ``schema`` attribute, or one made from its signature and docstring by
    transformers; the arguments of `spec.kwargs` are left out, and the name is
    the spec's."""
    schema = getattr(fn, "schema", None)
    if schema is None:
        from transformers.utils import get_json_schema

        try:
            schema = get_json_schema(fn)
        except Exception as error:  # transformers' own errors name what the docstring lacks
            raise EnvError(f"tool {spec.path!r}: no schema can be made from its docstring ({error}); document "
                           "each argument under 'Args:', or give it a `schema` attribute") from None
    schema = json.loads(json.dumps(schema))
    function = schema.setdefault("function", {})
    function["name"] = spec.name
    parameters = function.get("parameters", {})
    for key in spec.kwargs:
        parameters.get("properties", {}).pop(key, None)
        if key in parameters.get("required", []):
            parameters["required"].remove(key)
    return schema


def check_observation(value: Any, what: str) -> tuple[str, list[dict[str, str]]]:
    """(text, messages) of an observation: text, or a list of chat messages
    (dicts with string "role" and "content"); `BadReturn` otherwise."""
    if isinstance(value, str):
        return value, []
    if isinstance(value, Sequence) and value and all(_is_message(m) for m in value):
        return "", [{k: str(v) for k, v in m.items() if k in _MESSAGE_KEYS} for m in value]
    raise BadReturn(f"{what} returned {_show(value)}: expected text, or a list of chat messages "
                    "({'role': ..., 'content': ...})")


_MESSAGE_KEYS = ("role", "content", "name", "tool_call_id")


def _is_message(m: Any) -> bool:
    return isinstance(m, Mapping) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)


def check_step(value: Any) -> tuple[str, list[dict[str, str]], float, bool]:
    """(text, messages, reward, done) of what `step` returned; `BadReturn` if it is not a step."""
    if not isinstance(value, tuple) or len(value) != 3:
        raise BadReturn(f"step returned {_show(value)}: expected (observation, reward, done)")
    observation, reward, done = value
    if not isinstance(reward, numbers.Real) or not math.isfinite(float(reward)):
        raise BadReturn(f"step returned the reward {_show(reward)}: expected a finite float")
    if not isinstance(done, (bool, numbers.Integral)):
        raise BadReturn(f"step returned done = {_show(done)}: expected a bool")
    if observation is None:
        if not done:
            raise BadReturn("step returned no observation for an episode that is not done")
        return "", [], float(reward), True
    text, messages = check_observation(observation, "step")
    return text, messages, float(reward), bool(done)


def tool_text(value: Any) -> str:
    """What the model is shown of a tool's result: text as it is, else JSON."""
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value, ensure_ascii=False, default=str)
    except (TypeError, ValueError):
        return repr(value)


def _show(value: Any) -> str:
    text = repr(value)
    text = text if len(text) <= 80 else text[:77] + "..."
    return f"{text} ({type(value).__name__})"
