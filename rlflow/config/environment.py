"""The tables that name a run's environment and its tools: `[roles.env]`'s
``environment = {path, kwargs}`` and ``tools = [{path, name, kwargs,
timeout_s}, ...]``.

They are checked here for their shape only (an import path of the form
``package.module:attribute``, tool names unique); whether the path imports
and what it names is `rlflow.env`'s to check, in the process that runs it.
The config reads them and the env role runs them, so they live below both.

This module imports msgspec and the standard library only.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import msgspec


class EnvironmentSpec(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The environment of a run."""

    path: str
    """Import path, "package.module:Class" (e.g. "rlflow.env.arith:SecondTry")."""
    kwargs: dict[str, Any] = {}
    """Keyword arguments the class is made with (once per worker process)."""

    def __post_init__(self) -> None:
        _check_path(self.path, "environment", "Class")


class ToolSpec(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A tool the model may call."""

    path: str
    """Import path, "package.module:function" (e.g. "rlflow.env.tools:python")."""
    name: str = ""
    """The name the model calls it by; defaults to the function's name in `path`."""
    kwargs: dict[str, Any] = {}
    """Keyword arguments passed to every call, besides the model's (not shown to the model)."""
    timeout_s: float = 0.0
    """A call that takes longer fails (the model is told so); 0: `roles.env.timeout_s`."""

    def __post_init__(self) -> None:
        _check_path(self.path, "tool", "function")
        if not self.name:
            msgspec.structs.force_setattr(self, "name", self.path.partition(":")[2].rsplit(".", 1)[-1])
        if not (self.timeout_s == 0 or 0 < self.timeout_s < math.inf):
            raise ValueError(f"timeout_s of tool {self.name!r} must be positive (or 0), got {self.timeout_s}")


def _check_path(path: str, what: str, example: str) -> None:
    module, _, attribute = path.partition(":")
    if not module or not attribute:
        raise ValueError(f"{what} path {path!r} must look like 'package.module:{example}'")


def check_tools(tools: Sequence[ToolSpec]) -> None:
    """Raise `ValueError` unless the tools' names are unique."""
    seen: dict[str, str] = {}
    for tool in tools:
        if tool.name in seen:
            raise ValueError(f"two tools are named {tool.name!r} ({seen[tool.name]} and {tool.path}); "
                             "give one of them a name")
        seen[tool.name] = tool.path
