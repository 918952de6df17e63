"""The live table of what every role is doing (for `rlflow up` and `rlflow status`)."""

from __future__ import annotations

from typing import Any

from rich.console import Group
from rich.table import Table
from rich.text import Text


def _pct(x: float) -> str:
    return f"{100 * x:4.0f}%"


def render(status: dict[str, Any]) -> Group:
    """A header line and one row per role."""
    last = status.get("last_step") or {}
    reward = last.get("reward_mean")
    head = Text.assemble(
        (f"run {status.get('run_id', '?')}  ", "bold"),
        (f"{status.get('state', '?')}  ", "green" if status.get("state") == "running" else "yellow"),
        f"step {status.get('step', 0)}/{status.get('steps', '?')}  ",
        f"version {status.get('version', 0)}  ",
        f"{status.get('mode', '')} (max_staleness {status.get('max_staleness', '?')}, "
        f"{status.get('staleness_check', 'admission')})  ",
        f"{status.get('elapsed_s', 0):.0f} s",
        (f"  reward {reward:.3f}" if isinstance(reward, (int, float)) else ""),
    )
    table = Table(box=None, pad_edge=False, header_style="bold")
    for column in ("role", "replicas", "busy", "starved", "blocked", "loading", "queues", "version", "behind"):
        table.add_column(column, justify="left" if column in ("role", "queues") else "right")
    for role, info in (status.get("roles") or {}).items():
        states = info.get("states", {})
        queues = " ".join(f"{k}={v}" for k, v in sorted(info.get("queues", {}).items()))
        table.add_row(
            role,
            f"{info.get('up', 0)}/{info.get('replicas', 0)}",
            _pct(states.get("busy", 0)),
            _pct(states.get("starved", 0)),
            _pct(states.get("blocked", 0)),
            _pct(states.get("loading", 0)),
            queues,
            str(info.get("version", 0)),
            str(info.get("staleness", 0)),
        )
    parts: list[Any] = [head, table]
    if status.get("error"):
        parts.append(Text(f"error: {status['error']}", style="red"))
    return Group(*parts)
