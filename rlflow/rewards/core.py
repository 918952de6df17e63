"""The contract between rlflow and a reward function: what it receives, what
it may return, how it is named and weighted, and how its results combine.

A reward function is named by import path, ``package.module:function``. It
is called with one `Sample` and the keyword arguments of its `FunctionSpec`
(sync, or ``async def``), and returns a float, or a float and a dict of
named parts (floats). Anything else, or a value that is not finite, is an
error: no silent zeros. Optional attributes on the function:

* ``batched = True``: it takes a list of samples and returns a list of
  results, one per sample, in order (for models that score in batches).
* ``prepare(**kwargs)``: called once per worker process, with the same
  keyword arguments, before its first call and outside the call timeout
  (load a model, compile a pattern, check a sandbox). If it raises, the
  pool does not start.
* ``reference_response(reference, **kwargs) -> str``: a response that
  states `reference` the way the function reads answers; it must score
  ``reference_value`` (default 1.0). Used by `check_references` before a
  run starts. Without it, a reference is only checked to score at all.

This module imports only msgspec and the standard library: the reward
service, the config and the worker processes all import it.
"""

from __future__ import annotations

import enum
import importlib
import inspect
import math
import numbers
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec


class RewardFunctionError(ValueError):
    """A reward function named in a config cannot be used; the message names
    its import path and says why."""


class BadReturn(Exception):
    """A reward function returned something that is not a reward; the
    message names what came back."""


class Status(enum.Enum):
    """How scoring one sample with one function ended."""

    OK = "ok"
    """The function returned a finite reward."""
    TIMEOUT = "timeout"
    """It ran past its `FunctionSpec.timeout_s` and its worker was killed, or
    it raised `TimeoutError` itself (e.g. math-verify's own timeout)."""
    ERROR = "error"
    """It raised, or returned something that is not a finite reward."""
    CRASHED = "crashed"
    """Its worker process died during the call (a segfault, `os._exit`, the
    kernel's out-of-memory killer)."""


class Sample(msgspec.Struct, frozen=True, kw_only=True):
    """One response to score, with what it answers."""

    prompt: str
    """The prompt text, as the policy saw it."""
    response: str
    """The response text."""
    response_ids: tuple[int, ...] = ()
    """The response's token ids."""
    reference: str = ""
    """The dataset's reference answer ("" when it has none)."""
    row: dict[str, Any] = {}
    """The dataset row the prompt came from (plain data: str, int, float,
    bool, None, lists and dicts of them)."""
    turns: tuple[str, ...] = ()
    """An episode's (a run with an environment): the model's turns, as text, in order
    (`response` is then the whole episode after the prompt, observations included)."""
    observations: tuple[str, ...] = ()
    """An episode's: the observations between its turns, as the model saw them."""


class Scored(msgspec.Struct, frozen=True, kw_only=True):
    """The result of one function on one sample. `value` is set exactly when
    `status` is OK; otherwise `message` says what happened."""

    function: str
    """The function's name (`FunctionSpec.name`)."""
    status: Status
    value: float | None = None
    """The reward, when OK."""
    parts: dict[str, float] = {}
    """Named parts the function returned, when OK."""
    message: str = ""
    """Why it is not OK: the exception's type and message, the timeout, or
    how the worker died."""
    seconds: float = 0.0
    """Wall time of the call that scored it (a whole batch for a batched function)."""


class FunctionSpec(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One reward function of a run, with its weight and how it is run."""

    path: str
    """Import path, "package.module:function" (e.g. "rlflow.rewards:math")."""
    name: str = ""
    """Name in results and logs; defaults to the function's name in `path`.
    Unique within a run, without dots."""
    weight: float = 1.0
    """Weight in the sample's reward (0: logged only; its failures do not
    fail the sample)."""
    kwargs: dict[str, Any] = {}
    """Keyword arguments passed to every call (and to `prepare`)."""
    timeout_s: float = 10.0
    """A call that takes longer is killed with its worker (status timeout);
    for a batched function, the limit of one batch."""
    workers: int = 2
    """Worker processes running this function, each with its own copy of it
    (and of its model, for `reward_model`)."""
    max_batch: int = 32
    """Batched functions: most samples per call."""
    batch_wait_s: float = 0.005
    """Batched functions: how long a batch waits for more samples once a
    worker is free and the first has arrived."""

    def __post_init__(self) -> None:
        module, _, attribute = self.path.partition(":")
        if not module or not attribute:
            raise ValueError(f"reward function path {self.path!r} must look like 'package.module:function'")
        if not self.name:
            msgspec.structs.force_setattr(self, "name", attribute.rsplit(".", 1)[-1])
        if "." in self.name:
            raise ValueError(f"reward function name {self.name!r} ({self.path}) must not contain '.'")
        if not math.isfinite(self.weight):
            raise ValueError(f"weight of reward function {self.name!r} must be finite, got {self.weight}")
        if not 0 < self.timeout_s < math.inf:
            raise ValueError(f"timeout_s of reward function {self.name!r} must be positive, got {self.timeout_s}")
        if not 0 <= self.batch_wait_s < math.inf:
            raise ValueError(f"batch_wait_s of reward function {self.name!r} must be >= 0, got {self.batch_wait_s}")
        for field in ("workers", "max_batch"):
            if getattr(self, field) < 1:
                raise ValueError(f"{field} of reward function {self.name!r} must be >= 1, got {getattr(self, field)}")


def check_specs(specs: Sequence[FunctionSpec]) -> None:
    """Raise `ValueError` unless `specs` can run together: at least one, and
    names unique."""
    if not specs:
        raise ValueError("no reward functions given")
    seen: dict[str, str] = {}
    for spec in specs:
        if spec.name in seen:
            raise ValueError(
                f"two reward functions are named {spec.name!r} ({seen[spec.name]} and {spec.path}); "
                "give one of them a name"
            )
        seen[spec.name] = spec.path


@dataclass(frozen=True)
class Combined:
    """A sample's reward from all its functions."""

    reward: float | None
    """The weighted sum, or None when a function with a nonzero weight did
    not score it (the sample fails; see `failed`)."""
    details: dict[str, float]
    """Each function's value as "<name>", and its parts as "<name>.<part>",
    for the functions that scored OK."""
    failed: tuple[Scored, ...]
    """The results that are not OK (any weight)."""


def combine(scored: Sequence[Scored], specs: Sequence[FunctionSpec]) -> Combined:
    """Weighted sum of one sample's results (`RewardPool.score` order)."""
    if len(scored) != len(specs):
        raise ValueError(f"{len(scored)} results for {len(specs)} reward functions")
    total = 0.0
    details: dict[str, float] = {}
    failed: list[Scored] = []
    fails_sample = False
    for result, spec in zip(scored, specs, strict=True):
        if result.function != spec.name:
            raise ValueError(f"result of {result.function!r} where {spec.name!r} was expected")
        if result.status is not Status.OK or result.value is None:
            failed.append(result)
            fails_sample |= spec.weight != 0
            continue
        total += spec.weight * result.value
        details[spec.name] = result.value
        for part, value in result.parts.items():
            details[f"{spec.name}.{part}"] = value
    return Combined(None if fails_sample else total, details, tuple(failed))


def load_function(path: str, kwargs: Mapping[str, Any] | None = None) -> Callable[..., Any]:
    """Import the reward function at `path` ("package.module:function",
    attributes may be dotted) and check that it can be called with one
    sample (or list of samples) and `kwargs`. Raises `RewardFunctionError`
    naming `path` and what is wrong."""
    module_name, _, attribute = path.partition(":")
    if not module_name or not attribute:
        raise RewardFunctionError(f"reward function {path!r}: expected an import path like 'package.module:function'")
    try:
        target: Any = importlib.import_module(module_name)
    except Exception as error:
        raise RewardFunctionError(
            f"reward function {path!r}: cannot import module {module_name!r}: {type(error).__name__}: {error}"
        ) from error
    for i, part in enumerate(attribute.split(".")):
        try:
            target = getattr(target, part)
        except AttributeError:
            owner = ".".join([module_name, *attribute.split(".")[:i]])
            raise RewardFunctionError(f"reward function {path!r}: {owner!r} has no attribute {part!r}") from None
    if not callable(target):
        raise RewardFunctionError(f"reward function {path!r} is not callable: it is a {type(target).__name__}")
    kwargs = dict(kwargs or {})
    try:
        signature = inspect.signature(target)
    except (TypeError, ValueError):
        return target  # a builtin without a signature: its first call will tell
    try:
        signature.bind(object(), **kwargs)
    except TypeError as error:
        given = ", ".join(sorted(kwargs)) or "no keyword arguments"
        raise RewardFunctionError(
            f"reward function {path!r} cannot be called as {attribute}(sample, **kwargs) with {given}: {error}"
        ) from None
    return target


def check_result(result: Any) -> tuple[float, dict[str, float]]:
    """The reward and parts in what a function returned; raises `BadReturn`
    naming what came back if it is not a finite float or (float, dict of
    str to finite float)."""
    value, parts = result if isinstance(result, tuple) and len(result) == 2 else (result, {})
    expected = "expected a finite float, or (float, dict of str to float)"
    if not _is_real(value):
        raise BadReturn(f"returned {show_value(result)}: {expected}")
    if not math.isfinite(float(value)):
        raise BadReturn(f"returned {show_value(value)} as its reward: {expected}")
    if not isinstance(parts, Mapping):
        raise BadReturn(f"returned parts {show_value(parts)}: {expected}")
    checked: dict[str, float] = {}
    for key, part in parts.items():
        if not isinstance(key, str) or not _is_real(part) or not math.isfinite(float(part)):
            raise BadReturn(f"returned part {show_value(key)}: {show_value(part)}: {expected}")
        checked[key] = float(part)
    return float(value), checked


def _is_real(value: Any) -> bool:
    # numbers.Real covers bool, int, float and numpy's scalars.
    return isinstance(value, numbers.Real)


def show_value(value: Any) -> str:
    text = repr(value)
    text = text if len(text) <= 80 else text[:77] + "..."
    return f"{text} ({type(value).__name__})"
