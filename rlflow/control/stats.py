"""What the controller knows of a run's progress, kept in memory: each
replica's heartbeats, the rows of the steps and evaluations so far, and the
status and summary built from them.

Getters have no side effects. The one place where a window moves is
`close_step`, a command: it makes the step's row and starts the next step's
window.

A resumed session `carry`s the rows the sessions before it kept (see
`rlflow.control.record`): the status and the summary count the whole run,
and the summary this session beside it.
"""

from __future__ import annotations

import collections
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any

from rlflow.control.record import Carried
from rlflow.protocol import EvalDone, Heartbeat, StepDone
from rlflow.rundir import EngineStep, EvalRow, GroupCounts, SessionTotals, Shares, StepRow, Summary, Trend

STATES = ("busy", "starved", "blocked", "loading")
#: Trainer statistics whose trend the status shows (where a run has them).
TRENDS = ("kl_teacher", "critic_value_loss", "critic_explained_var")
#: Steps over which a trend is taken.
TREND_STEPS = 10
#: Heartbeats of each replica kept for the live window.
WINDOW = 32

log = logging.getLogger("rlflow.controller")


@dataclass
class ReplicaClock:
    """One replica's heartbeats: the first, the one at the last step, the latest few."""

    first: Heartbeat
    at_step: Heartbeat
    recent: collections.deque[Heartbeat] = field(default_factory=lambda: collections.deque(maxlen=WINDOW))

    @property
    def last(self) -> Heartbeat:
        return self.recent[-1]


def _shares(pairs: list[tuple[Heartbeat, Heartbeat]]) -> Shares:
    """Shares of each state between the (earlier, later) heartbeats of each replica."""
    sums = dict.fromkeys(STATES, 0.0)
    for first, last in pairs:
        for key in STATES:
            sums[key] += getattr(last, f"{key}_s") - getattr(first, f"{key}_s")
    total = sum(sums.values())
    return Shares(**{k: (v / total if total > 0 else 0.0) for k, v in sums.items()})


class RunStats:
    """Heartbeat windows per replica and the run's rows (see the module)."""

    def __init__(self, roles: list[str]):
        self.roles = roles
        self.clocks: dict[tuple[str, int], ReplicaClock] = {}
        self.rows: list[StepRow] = []
        self.evals: list[EvalRow] = []
        self.load_seconds: list[float] = []
        self.carried = Carried()

    def carry(self, carried: Carried) -> None:
        """Go on from the record of the sessions before (a resume): their rows
        and evaluations, and their training time."""
        self.carried = carried
        self.rows = list(carried.rows)
        self.evals = list(carried.evals)

    # -- input ----------------------------------------------------------------

    def heartbeat(self, role: str, rank: int, beat: Heartbeat) -> None:
        clock = self.clocks.get((role, rank))
        if clock is None or beat.seq < clock.last.seq:  # the first, or a new incarnation's
            clock = self.clocks[(role, rank)] = ReplicaClock(first=beat, at_step=beat)
        clock.recent.append(beat)

    def forget(self, role: str, rank: int) -> None:
        """A replica is gone; a new incarnation starts counting afresh."""
        self.clocks.pop((role, rank), None)

    def close_step(self, msg: StepDone, time_s: float, messages: int) -> StepRow:
        """The row of the step the trainer just finished (`time_s`: since this
        session's training started); the next step's window starts here."""
        metrics = dict(msg.metrics)
        known = {name: metrics.pop(name, None) for name in ("samples", "tokens", "reward_mean", "staleness_mean",
                                                            "staleness_max", "train_s", "checkpoint")}
        reward = known["reward_mean"]
        row = StepRow(
            step=msg.step,
            version=msg.version,
            time_s=round(self.carried.time_s + time_s, 4),
            samples=int(known["samples"] or 0),
            tokens=int(known["tokens"] or 0),
            reward_mean=reward if reward is not None and math.isfinite(reward) else None,
            staleness_mean=known["staleness_mean"] or 0.0,
            staleness_max=known["staleness_max"] or 0.0,
            train_s=known["train_s"] or 0.0,
            occupancy=self._occupancy(),
            reward_failed_share=self._failed_share(),
            engine=self._engine_step(),
            roles={role: self._role_shares(role, "step") for role in self.roles},
            train=finite(metrics),
            controller_msgs=messages,
        )
        for clock in self.clocks.values():
            clock.at_step = clock.last
        self.rows.append(row)
        return row

    def evaluated(self, row: EvalRow) -> None:
        self.evals.append(row)

    def eval_done(self, msg: EvalDone, step: int) -> EvalRow:
        """The row of an evaluation a rollout replica finished (at trainer step `step`), kept."""
        row = EvalRow(step=step, version=msg.version, version_end=msg.version_end, seconds=round(msg.seconds, 3),
                      metrics=finite(msg.metrics))
        log.info("[controller] eval at v%d: %s", msg.version, msg.metrics.get("accuracy"))
        self.evaluated(row)
        return row

    def evaluated_at(self, step: int) -> bool:
        """Whether the run has an evaluation that ended at `step` (a resumed
        run may have kept one of the checkpoint it goes on from)."""
        return any(e.step == step for e in self.evals)

    def weights_loaded(self, seconds: float) -> None:
        self.load_seconds.append(seconds)

    # -- views ------------------------------------------------------------------

    def replicas(self, role: str) -> list[ReplicaClock]:
        return [clock for (name, _), clock in sorted(self.clocks.items()) if name == role]

    def _role_shares(self, role: str, since: str) -> Shares:
        if since == "step":
            pairs = [(c.at_step, c.last) for c in self.replicas(role)]
        elif since == "window":
            pairs = [(c.recent[0], c.last) for c in self.replicas(role)]
        else:
            pairs = [(c.first, c.last) for c in self.replicas(role)]
        return _shares(pairs)

    def window(self) -> dict[str, Shares]:
        """Each role's shares over its last few heartbeats (the live table)."""
        return {role: self._role_shares(role, "window") for role in self.roles}

    def whole_run(self) -> dict[str, Shares]:
        """Each role's shares since its first heartbeat."""
        return {role: self._role_shares(role, "run") for role in self.roles}

    def _occupancy(self) -> float | None:
        """Share of the rollout's slots in use since the last step (engines
        that count slot time)."""
        used = capacity = 0.0
        for clock in self.replicas("rollout"):
            last, first = clock.last, clock.at_step
            if last.engine is None or last.counters.slot_s == 0:
                return None
            elapsed = sum(getattr(last, f"{k}_s") - getattr(first, f"{k}_s") for k in STATES)
            used += last.counters.slot_s - first.counters.slot_s
            capacity += elapsed * last.engine.slots
        return round(used / capacity, 4) if capacity > 0 else None

    def _engine_step(self) -> EngineStep | None:
        """The rollout's engines now, and their preemptions since the last step."""
        clocks = [c for c in self.replicas("rollout") if c.last.engine is not None]
        if not clocks:
            return None
        now = [c.last.engine for c in clocks]
        before = sum(c.at_step.engine.preemptions for c in clocks if c.at_step.engine is not None)
        return EngineStep(running=sum(e.running for e in now), waiting=sum(e.waiting for e in now),
                          kv_cache_usage=max(e.kv_cache_usage for e in now),
                          preemptions=max(0, sum(e.preemptions for e in now) - before))

    def _failed_share(self) -> float | None:
        """Share of the samples the reward role scored since the last step
        whose reward could not be computed."""
        scored = failed = 0.0
        for clock in self.replicas("reward"):
            last, first = clock.last.counters, clock.at_step.counters
            scored += last.scored_samples - first.scored_samples
            failed += last.failed_samples - first.failed_samples
        return round(failed / scored, 4) if scored > 0 else None

    def trends(self, window: int = TREND_STEPS) -> dict[str, Trend]:
        """The statistics of `TRENDS` over the last `window` steps, and how
        their mean moved from the `window` steps before."""
        out = {}
        for key in TRENDS:
            values = []
            for row in reversed(self.rows):  # the latest 2 x window that have it
                if math.isfinite(row.train.get(key, math.nan)):
                    values.insert(0, row.train[key])
                    if len(values) == 2 * window:
                        break
            if not values:
                continue
            recent, before = values[-window:], values[-2 * window:-window]
            mean = sum(recent) / len(recent)
            change = mean - sum(before) / len(before) if len(before) == window else None
            out[key] = Trend(last=values[-1], mean=mean, steps=len(recent), change=change)
        return out

    def last(self, role: str, rank: int) -> Heartbeat | None:
        """A replica's latest heartbeat (None: none yet from this incarnation)."""
        clock = self.clocks.get((role, rank))
        return clock.last if clock is not None else None

    def latest(self, role: str) -> list[Heartbeat]:
        return [clock.last for clock in self.replicas(role)]

    def summary(self, wall_s: float, *, groups: GroupCounts = GroupCounts(), **fields: Any) -> Summary:
        """The run's summary from its rows in memory (`wall_s`: this session's
        training time; `groups`: the whole run's)."""
        rows = self.rows
        samples = sum(r.samples for r in rows)
        tokens = sum(r.tokens for r in rows)
        mine = [r for r in rows if r.step >= self.carried.step]
        session = _totals(mine, wall_s, self.carried.step, groups.trained - self.carried.groups_trained)
        wall_s += self.carried.time_s
        rewards = [r.reward_mean for r in rows if r.reward_mean is not None]
        accuracy = [e.accuracy for e in self.evals if e.accuracy is not None]
        tail = accuracy[-3:]
        last3 = sum(tail) / len(tail) if tail else None
        engines = [r.engine for r in rows if r.engine is not None]
        return Summary(
            kv_cache_usage_mean=_mean([e.kv_cache_usage for e in engines]) if engines else None,
            waiting_mean=_mean([float(e.waiting) for e in engines]) if engines else None,
            preemptions=sum(e.preemptions for e in engines),
            samples=samples,
            tokens=tokens,
            wall_time_s=round(wall_s, 3),
            samples_per_s=round(samples / wall_s, 3) if wall_s > 0 else 0.0,
            tokens_per_s=round(tokens / wall_s, 3) if wall_s > 0 else 0.0,
            staleness_max=max((r.staleness_max for r in rows), default=0.0),
            staleness_mean=_mean([r.staleness_mean for r in rows]),
            reward_mean=_mean(rewards) if rewards else None,
            weights_load_s_mean=_mean(self.load_seconds),
            evals=self.evals,
            accuracy_before=accuracy[0] if accuracy else None,
            accuracy_after=accuracy[-1] if accuracy else None,
            accuracy_last3_mean=last3,
            gain_points=round(100 * (last3 - accuracy[0]), 2) if accuracy else None,
            data_bytes=sum(b.counters.bytes_out for b in self.latest("rollout")),
            roles=self.whole_run(),
            groups=groups,
            sessions=self.carried.sessions + 1,
            session=session,
            **fields,
        )


def _totals(rows: list[StepRow], wall_s: float, first_step: int, groups_trained: int) -> SessionTotals:
    samples = sum(r.samples for r in rows)
    tokens = sum(r.tokens for r in rows)
    return SessionTotals(
        first_step=first_step,
        steps=len(rows),
        samples=samples,
        tokens=tokens,
        groups_trained=groups_trained,
        wall_time_s=round(wall_s, 3),
        samples_per_s=round(samples / wall_s, 3) if wall_s > 0 else 0.0,
        tokens_per_s=round(tokens / wall_s, 3) if wall_s > 0 else 0.0,
    )


def _mean(values: list[float]) -> float:
    return round(sum(values) / len(values), 6) if values else 0.0


def process_cpu() -> tuple[float, float]:
    """(this thread's CPU seconds, the process's), for the controller's own load."""
    import psutil

    times = psutil.Process().cpu_times()
    return time.thread_time(), times.user + times.system


def finite(metrics: dict[str, float]) -> dict[str, float]:
    """`metrics` without the undefined ones (NaN, infinities: e.g. the critic's explained variance
    over returns that do not vary). JSON has no NaN: written, it would read back as null, which no
    row's number may be."""
    return {name: value for name, value in metrics.items() if math.isfinite(value)}
