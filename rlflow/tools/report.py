"""`rlflow report RUN_DIR`: where each role's time went, and who holds the run back.

Reads what a run left in its directory (metrics, summary, status, the
services' state timelines) and prints, per role, the shares of time busy /
starved (waiting for input) / blocked (waiting for downstream) / loading
weights, queue depths and staleness, then one sentence naming the
bottleneck role and what waits for it. It also writes, into the run
directory:

* ``timeline.png``: one lane per replica per role, coloured by state;
* ``trace.json``: the same as a Chrome / Perfetto trace (chrome://tracing,
  ui.perfetto.dev);
* ``curves.png``: reward, held-out accuracy and staleness over the run (and
  a panel per role that draws statistics of its own, `RoleSpec.curves`).
"""

from __future__ import annotations

import json
import math
import pathlib
from dataclasses import dataclass, field
from typing import Any

import msgspec

from rlflow import timeline
from rlflow.control.stats import TREND_STEPS
from rlflow.roles import NAMES, ROLES, hook
from rlflow.rundir import EvalRow, RunDir, Status, StepRow, Summary
from rlflow.runstate import RunState, run_state

ORDER = NAMES
STATES = ("busy", "starved", "blocked", "loading")
COLOURS = {"busy": "#2e7d32", "starved": "#f9a825", "blocked": "#c62828", "loading": "#1565c0", "idle": "#e0e0e0"}
#: What "busy" means for each role, in pictures.
BUSY = {role.name: role.busy for role in ROLES}


@dataclass
class Run:
    folder: RunDir
    metrics: list[StepRow] = field(default_factory=list)
    evals: list[EvalRow] = field(default_factory=list)
    summary: Summary | None = None
    status: Status | None = None
    traces: list[dict[str, Any]] = field(default_factory=list)
    state: RunState | None = None

    @property
    def path(self) -> pathlib.Path:
        return self.folder.path

    @property
    def fractions(self) -> dict[str, dict[str, float]]:
        if self.summary is not None and self.summary.roles:
            roles = self.summary.roles
        elif self.status is not None:
            roles = {r: v.states for r, v in self.status.roles.items()}
        else:
            roles = {}
        return {r: msgspec.structs.asdict(roles[r]) for r in ORDER if r in roles}


def load(run_dir: str | pathlib.Path) -> Run:
    folder = RunDir(run_dir)
    if not folder.path.is_dir():
        raise FileNotFoundError(f"{folder.path} is not a run directory")
    traces = [trace for name in timeline.names(folder) if (trace := timeline.read(folder, name)) is not None]
    state = run_state(folder)
    return Run(
        folder=folder,
        metrics=folder.read_metrics(),
        evals=folder.read_evals(),
        summary=folder.read_summary(),
        status=state.status if state is not None else None,
        traces=[t for t in traces if "events" in t],
        state=state,
    )


def _pct(x: float) -> str:
    return f"{100 * x:.0f}%"


#: The rollout's KV cache this full on average, or any preemption, is pressure worth naming.
KV_PRESSURE = 0.9


def kv_pressure(summary: Summary | None) -> str:
    """What the rollout's KV cache did to it, when it held generation back (else "")."""
    if summary is None or summary.kv_cache_usage_mean is None:
        return ""
    if summary.kv_cache_usage_mean < KV_PRESSURE and summary.preemptions == 0:
        return ""
    return (f"rollout held back by its KV cache: {_pct(summary.kv_cache_usage_mean)} full on average, "
            f"{summary.waiting_mean or 0:.1f} requests waiting, {summary.preemptions} preemptions "
            "(raise roles.rollout.engine.kv_cache_bytes, or gpu_memory_utilization on a GPU)")


def bottleneck(fractions: dict[str, dict[str, float]], max_staleness: int | None = None, kv: str = "") -> str:
    """One sentence: which role holds the run back and what waits for it
    (`kv`: what the rollout's KV cache did, said when the rollout is what waits)."""
    roles = [r for r in ORDER if r in fractions]
    if not roles:
        return "no role reported its time"

    def share(role: str, state: str) -> float:
        return fractions[role].get(state, 0.0)

    saturated = [r for r in roles if share(r, "busy") >= 0.85]
    if len(saturated) > 1:
        each = ", ".join(f"{r} busy {_pct(share(r, 'busy'))}" for r in saturated)
        tail = f"; {kv}" if kv and "rollout" in saturated else ""
        return f"balanced: {each}; the run needs more of each to go faster{tail}"
    busiest = max(roles, key=lambda r: share(r, "busy"))
    head = f"{busiest} replicas busy {_pct(share(busiest, 'busy'))}"
    parts = []
    if busiest != "trainer" and share("trainer", "starved") >= 0.1:
        parts.append(f"trainer starved {_pct(share('trainer', 'starved'))}: waiting for {busiest}")
    for role in roles[: roles.index(busiest)]:  # upstream, held back by it
        if share(role, "blocked") >= 0.1:
            parts.append(f"{role} blocked {_pct(share(role, 'blocked'))} on {busiest}")
    if busiest == "trainer" and share("rollout", "starved") >= 0.1:
        bound = f" (max_staleness = {max_staleness})" if max_staleness is not None else ""
        parts.append(f"rollout starved {_pct(share('rollout', 'starved'))}: "
                     f"out of credits until the trainer catches up{bound}")
    for role in roles:
        if share(role, "loading") >= 0.1:
            parts.append(f"{role} loading weights {_pct(share(role, 'loading'))}")
    if kv and busiest == "rollout":
        parts.append(kv)
    if not parts:
        return f"bottleneck: {busiest} ({head}); nothing waits long for it"
    return f"bottleneck: {busiest}. " + "; ".join(parts) + f"; {head}"


def role_lines(rows: list[StepRow]) -> list[str]:
    """What each role says about its own training statistics (`RoleSpec.report`), in the stream's order."""
    out = []
    for role in ROLES:
        if role.report:
            said = hook(role.report)(rows)
            if said:
                out.append(said)
    return out


def text(run: Run) -> str:
    """The per-role table and the bottleneck sentence."""
    state = run.state
    lines = [f"run {run.path}" + (f": {state.state}" if state is not None else "")
             + (f" ({state.reason})" if state is not None and state.reason else "")]
    summary = run.summary
    if state is not None and state.state not in ("stopped", "failed", "interrupted") and summary is not None:
        lines.append(f"  (its summary is of an earlier session, which ended {summary.state})")
    if summary is not None:
        lines.append(
            f"  {summary.steps} steps, {summary.samples} samples, "
            f"{summary.wall_time_s:.1f} s ({summary.samples_per_s:.1f} samples/s); "
            f"staleness mean {summary.staleness_mean:.2f}, max {summary.staleness_max:g}"
        )
        session = summary.session
        if summary.sessions > 1 and session is not None:
            lines.append(
                f"  over {summary.sessions} sessions; the last, from step {session.first_step}: {session.steps} steps, "
                f"{session.samples} samples in {session.wall_time_s:.1f} s ({session.samples_per_s:.1f} samples/s)"
            )
        if summary.accuracy_before is not None:
            lines.append(
                f"  held-out accuracy {summary.accuracy_before:.1%} -> {summary.accuracy_after:.1%} "
                f"(last three {summary.accuracy_last3_mean:.1%}, {summary.gain_points:+.1f} points)"
            )
    roles = run.status.roles if run.status is not None else {}
    lines.append(f"  {'role':<9}{'busy':>7}{'starved':>9}{'blocked':>9}{'loading':>9}  queues")
    for role, f in run.fractions.items():
        queues = " ".join(f"{k}={v}" for k, v in sorted(roles[role].queues.items())) if role in roles else ""
        lines.append(
            f"  {role:<9}{_pct(f.get('busy', 0)):>7}{_pct(f.get('starved', 0)):>9}"
            f"{_pct(f.get('blocked', 0)):>9}{_pct(f.get('loading', 0)):>9}  {queues}"
        )
    lines += ["  " + said for said in role_lines(run.metrics)]
    lines.append("  " + bottleneck(run.fractions, summary.max_staleness if summary is not None else None,
                                   kv_pressure(summary)))
    return "\n".join(lines)


def _spans(run: Run) -> list[tuple[str, list[tuple[float, float, str]]]]:
    """Per lane, (start, duration, state) spans from time zero."""
    # Time zero: when the first service got to work (start-up is left out).
    firsts = [next((t for t, state in trace["events"] if state not in ("idle", timeline.DOWN)), None)
              for trace in run.traces]
    starts = [t for t in firsts if t is not None]
    if not starts:
        return []
    t0 = min(starts)
    lanes = []
    key = {role: i for i, role in enumerate(ORDER)}
    for trace in sorted(run.traces, key=lambda t: (key.get(t["role"], 9), t["rank"])):
        events = trace["events"]
        spans = []
        for (start, state), (end, _) in zip(events, events[1:]):
            start = max(start, t0)
            if end > start:
                spans.append((start - t0, end - start, state))
        lanes.append((f"{trace['role']}-{trace['rank']}", spans))
    return lanes


def write_timeline(run: Run, png: pathlib.Path | None = None, trace: pathlib.Path | None = None,
                   title: str = "") -> tuple[pathlib.Path, pathlib.Path]:
    """``timeline.png`` and ``trace.json`` of the run's state timelines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    png = png or run.folder.timeline_png
    trace = trace or run.folder.trace_json
    lanes = _spans(run)
    fig, ax = plt.subplots(figsize=(12, 0.5 + 0.45 * max(len(lanes), 1)))
    for row, (name, spans) in enumerate(lanes):
        for state in COLOURS:
            bars = [(s, d) for s, d, st in spans if st == state]
            if bars:
                ax.broken_barh(bars, (row - 0.4, 0.8), facecolors=COLOURS[state], linewidth=0)
    ax.set_yticks(range(len(lanes)), [name for name, _ in lanes])
    ax.invert_yaxis()
    ax.set_xlabel("seconds")
    labels = {"busy": "busy (generating / scoring / training)", "starved": "starved", "blocked": "blocked",
              "loading": "loading weights", "idle": "idle"}
    ax.legend(handles=[Patch(color=COLOURS[s], label=labels[s]) for s in COLOURS], loc="lower center",
              bbox_to_anchor=(0.5, 1.0), ncol=5, frameon=False)
    if title:
        ax.set_title(title, pad=24)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
    events = []
    for pid, (name, spans) in enumerate(lanes):
        events.append({"name": "process_name", "ph": "M", "pid": pid, "args": {"name": name}})
        for start, duration, state in spans:
            if state == timeline.DOWN:  # not running: a gap in its lane
                continue
            role = name.rsplit("-", 1)[0]
            label = BUSY.get(role, "busy") if state == "busy" else state
            events.append({"name": label, "ph": "X", "pid": pid, "tid": 0, "ts": start * 1e6, "dur": duration * 1e6})
    trace.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))
    return png, trace


def write_curves(run: Run, png: pathlib.Path | None = None) -> pathlib.Path | None:
    """``curves.png``: reward, held-out accuracy and staleness by step."""
    if not run.metrics:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    png = png or run.folder.curves_png
    steps = [r.step for r in run.metrics]
    # A panel per role that draws its own statistics (`RoleSpec.curves`), where the run has them.
    own = [(role, {label: [r.train.get(key, math.nan) for r in run.metrics] for key, label in role.curves})
           for role in ROLES if role.curves]
    own = [(role, fit) for role, fit in own if any(math.isfinite(v) for values in fit.values() for v in values)]
    panels = 2 + bool(run.evals) + len(own)
    fig, axes = plt.subplots(1, panels, figsize=(4.2 * panels, 3.2))
    axes[0].plot(steps, [math.nan if r.reward_mean is None else r.reward_mean for r in run.metrics], lw=1)
    axes[0].set_title("reward (training samples)")
    axes[0].set_xlabel("step")
    stale = axes[1]
    stale.plot(steps, [r.staleness_mean for r in run.metrics], label="mean", lw=1)
    stale.plot(steps, [r.staleness_max for r in run.metrics], label="max", lw=1)
    stale.set_title("staleness (versions behind, per token)")
    stale.set_xlabel("step")
    stale.legend(frameon=False)
    scored = [(e.version, e.accuracy) for e in run.evals if e.accuracy is not None]
    if run.evals:
        ax = axes[2]
        # Each evaluation reads one policy version: version v is the policy after v steps.
        ax.plot([version for version, _ in scored], [100 * accuracy for _, accuracy in scored], marker="o")
        ax.set_title("held-out accuracy (%)")
        ax.set_xlabel("policy version (step)")
    for ax, (role, fit) in zip(axes[2 + bool(run.evals):], own):
        for label, values in fit.items():  # each step's, faint, and the trend's mean
            line, = ax.plot(steps, values, lw=0.8, alpha=0.5)
            ax.plot(steps, _rolling_mean(values, TREND_STEPS), lw=1.5, color=line.get_color(),
                    label=f"{label} ({TREND_STEPS}-step mean)")
        ax.set_title(role.curves_title, fontsize=9)
        ax.set_xlabel("step")
        ax.legend(frameon=False, fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return png


def _rolling_mean(values: list[float], window: int) -> list[float]:
    """The mean of each value's window (itself and up to `window - 1` before), over the finite ones."""
    out = []
    for i in range(len(values)):
        finite = [v for v in values[max(0, i - window + 1): i + 1] if math.isfinite(v)]
        out.append(sum(finite) / len(finite) if finite else math.nan)
    return out


def report(run_dir: str | pathlib.Path) -> tuple[str, list[pathlib.Path]]:
    """The report's text, and the pictures and trace it wrote."""
    run = load(run_dir)
    files: list[pathlib.Path] = []
    if run.traces:
        mode = run.summary.mode if run.summary is not None else ""
        files += list(write_timeline(run, title=f"{mode} run {run.path.name}"))
    curves = write_curves(run)
    if curves is not None:
        files.append(curves)
    return text(run), files
