"""The one error of the config: `ConfigError`, a line naming the key, the
value given and what is allowed."""

from __future__ import annotations

from typing import Any

#: A key the config leaves out (shown as "(missing)").
MISSING = object()


class ConfigError(Exception):
    """A configuration problem: `key`, the value given, and what is allowed."""

    def __init__(self, key: str, given: Any, allowed: str):
        self.key, self.given, self.allowed = key, given, allowed
        shown = "(missing)" if given is MISSING else _show(given)
        super().__init__(f"config error: {key} = {shown}: {allowed}")


def _show(value: Any) -> str:
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {_show(v)}" for k, v in value.items()) + "}"
    if isinstance(value, str):
        return repr(value)
    return str(value).lower() if isinstance(value, bool) else str(value)

