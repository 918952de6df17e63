"""The live table of what every role is doing (for `rlflow up` and `rlflow status`)."""

from __future__ import annotations

from typing import Any

from rich.console import Group
from rich.table import Table
from rich.text import Text

from rlflow.protocol import EngineLoad
from rlflow.rundir import RoleStatus, Status, Trend


def _pct(x: float) -> str:
    return f"{100 * x:4.0f}%"


def trend_text(key: str, trend: Trend) -> str:
    """``kl_teacher 0.412 (10-step mean 0.450, -0.081)``."""
    change = "" if trend.change is None else f", {trend.change:+.3f}"
    return f"{key} {trend.last:.3f} ({trend.steps}-step mean {trend.mean:.3f}{change})"


def _engine(load: EngineLoad | None) -> str:
    """``kv 85% run 12 wait 3 pre 1`` (a rollout's engines; "" for other roles)."""
    if load is None:
        return ""
    return f"kv {100 * load.kv_cache_usage:.0f}% run {load.running} wait {load.waiting} pre {load.preemptions}"


def _restarts(info: RoleStatus) -> str:
    """Restarts so far, and a back-off in progress (``2, next in 3 s``)."""
    waiting = [p.restart_in_s for p in info.placed if p.restart_in_s is not None]
    given_up = sum(p.state == "given_up" for p in info.placed)
    text = str(info.restarts)
    if waiting:
        text += f", next in {min(waiting):.0f} s"
    if given_up:
        text += f", {given_up} given up"
    return text


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
        (f"  held-out {100 * status.last_eval.accuracy:.1f}% (v{status.last_eval.version})"
         if status.last_eval is not None and status.last_eval.accuracy is not None else ""),
        *(f"  {trend_text(key, trend)}" for key, trend in status.trends.items()),
    )
    table = Table(box=None, pad_edge=False, header_style="bold")
    for column in ("role", "replicas", "restarts", "busy", "starved", "blocked", "loading", "queues", "engine",
                   "version", "behind"):
        table.add_column(column, justify="left" if column in ("role", "queues", "engine") else "right",
                         no_wrap=column == "role", min_width=len(column) if column == "role" else None)
    for role, info in status.roles.items():
        states = info.states
        queues = " ".join(f"{k}={v}" for k, v in sorted(info.queues.items()))
        table.add_row(
            role,
            f"{info.up}/{info.replicas}",
            _restarts(info),
            _pct(states.busy),
            _pct(states.starved),
            _pct(states.blocked),
            _pct(states.loading),
            queues,
            _engine(info.engine),
            "-" if info.version is None else str(info.version),
            "-" if info.behind is None else str(info.behind),
        )
    parts: list[Any] = [head, table]
    if status.waiting_for:
        parts.append(Text(f"waiting for external replicas {', '.join(status.waiting_for)} "
                          "(`rlflow join RUN_DIR --role ROLE --rank N` says what each needs)", style="yellow"))
    for warning in status.warnings[-3:]:
        parts.append(Text(f"warning: {warning}", style="yellow"))
    if status.error:
        parts.append(Text(f"error: {status.error}", style="red"))
    return Group(*parts)
