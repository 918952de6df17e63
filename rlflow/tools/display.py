"""The live table of what every role is doing (for `rlflow up` and `rlflow status`)."""

from __future__ import annotations

from typing import Any

from rich.console import Group
from rich.table import Table
from rich.text import Text

from rlflow.rundir import Status, Trend


def _pct(x: float) -> str:
    return f"{100 * x:4.0f}%"


def trend_text(key: str, trend: Trend) -> str:
    """``kl_teacher 0.412 (10-step mean 0.450, -0.081)``."""
    change = "" if trend.change is None else f", {trend.change:+.3f}"
    return f"{key} {trend.last:.3f} ({trend.steps}-step mean {trend.mean:.3f}{change})"


def render(status: Status) -> Group:
    """A header line and one row per role."""
    last = status.last_step
    head = Text.assemble(
        (f"run {status.run_id}  ", "bold"),
        (f"{status.state}  ", "green" if status.state == "running" else "yellow"),
        f"step {status.step}/{status.steps}  ",
        f"version {status.version}  ",
        f"{status.mode} (max_staleness {status.max_staleness}, {status.staleness_check})  ",
        f"{status.elapsed_s:.0f} s",
        (f"  reward {last.reward_mean:.3f}" if last is not None and last.reward_mean is not None else ""),
        (f"  held-out {100 * status.last_eval.accuracy:.1f}%"
         if status.last_eval is not None and status.last_eval.accuracy is not None else ""),
        *(f"  {trend_text(key, trend)}" for key, trend in status.trends.items()),
    )
    table = Table(box=None, pad_edge=False, header_style="bold")
    for column in ("role", "replicas", "busy", "starved", "blocked", "loading", "queues", "version", "behind"):
        table.add_column(column, justify="left" if column in ("role", "queues") else "right")
    for role, info in status.roles.items():
        states = info.states
        queues = " ".join(f"{k}={v}" for k, v in sorted(info.queues.items()))
        table.add_row(
            role,
            f"{info.up}/{info.replicas}",
            _pct(states.busy),
            _pct(states.starved),
            _pct(states.blocked),
            _pct(states.loading),
            queues,
            "-" if info.version is None else str(info.version),
            "-" if info.behind is None else str(info.behind),
        )
    parts: list[Any] = [head, table]
    for warning in status.warnings[-3:]:
        parts.append(Text(f"warning: {warning}", style="yellow"))
    if status.error:
        parts.append(Text(f"error: {status.error}", style="red"))
    return Group(*parts)
