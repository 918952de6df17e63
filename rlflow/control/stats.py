"""What the controller knows of a run's progress, kept in memory: each
replica's latest heartbeats, running totals of the steps so far (no step's
row is kept but the latest few: the controller's memory does not grow with
a run's length), the evaluations, and the status and summary built from them.

Getters have no side effects. The one place where a window moves is
`close_step`, a command: it makes the step's row and starts the next step's
window.

A resumed session `carry`s the rows the sessions before it kept (see
`rlflow.control.record`), folded into the totals: the status and the summary
count the whole run, and the summary this session beside it.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any

from rlflow.control.record import Carried
from rlflow.protocol import EvalDone, Heartbeat, StepDone
from rlflow.roles import ROLES
from rlflow.rundir import EngineStep, EvalRow, GroupCounts, SessionTotals, Shares, StepRow, Summary, Trend

STATES = ("busy", "starved", "blocked", "loading")
#: Statistics of a step whose trend the status shows (where a run has them): those the roles draw
#: (`RoleSpec.curves`).
TRENDS = tuple(key for role in ROLES for key, _ in role.curves)
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


@dataclass
class Totals:
    """What the summary takes of every step's row, summed as the rows come."""

    steps: int = 0
    samples: int = 0
    tokens: int = 0
    staleness_max: float = 0.0
    staleness_sum: float = 0.0
    rewards: int = 0
    """Steps with a reward (not every sample failed)."""
    reward_sum: float = 0.0
    engines: int = 0
    """Steps with the rollout engines' load."""
    kv_cache_usage_sum: float = 0.0
    waiting_sum: float = 0.0
    preemptions: int = 0

    def add(self, row: StepRow) -> None:
        self.steps += 1
        self.samples += row.samples
        self.tokens += row.tokens
        self.staleness_max = max(self.staleness_max, row.staleness_max)
        self.staleness_sum += row.staleness_mean
        if row.reward_mean is not None:
            self.rewards += 1
            self.reward_sum += row.reward_mean
        if row.engine is not None:
            self.engines += 1
            self.kv_cache_usage_sum += row.engine.kv_cache_usage
            self.waiting_sum += row.engine.waiting
            self.preemptions += row.engine.preemptions


def _shares(pairs: list[tuple[Heartbeat, Heartbeat]]) -> Shares:
    """Shares of each state between the (earlier, later) heartbeats of each replica."""
    sums = dict.fromkeys(STATES, 0.0)
    for first, last in pairs:
        for key in STATES:
            sums[key] += getattr(last, f"{key}_s") - getattr(first, f"{key}_s")
    total = sum(sums.values())
    return Shares(**{k: (v / total if total > 0 else 0.0) for k, v in sums.items()})


class Latency:
    """How long messages wait for the controller and its work on them: a
    histogram of fixed logarithmic buckets (ten a decade, from 1 µs to 100 s),
    so its memory stays the same however long a run lasts."""

    PER_DECADE, LOW, DECADES = 10, 1e-6, 8

    def __init__(self) -> None:
        self.counts = [0] * (self.PER_DECADE * self.DECADES + 1)
        self.n, self.max = 0, 0.0

    def add(self, seconds: float) -> None:
        i = math.floor(self.PER_DECADE * math.log10(max(seconds, self.LOW) / self.LOW))
        self.counts[min(i, len(self.counts) - 1)] += 1
        self.n += 1
        self.max = max(self.max, seconds)

    def quantile(self, q: float) -> float:
        """The `q` quantile, in seconds: the upper edge of its bucket (at most 26% above it), 0 with none."""
        if not self.n:
            return 0.0
        seen = 0
        for i, count in enumerate(self.counts):
            seen += count
            if seen >= q * self.n:
                return min(self.LOW * 10 ** ((i + 1) / self.PER_DECADE), self.max)
        return self.max


class RunStats:
    """Heartbeat windows per replica and the run's rows (see the module)."""

    def __init__(self, roles: list[str]):
        self.roles = roles
        self.clocks: dict[tuple[str, int], ReplicaClock] = {}
        #: The whole run's steps (those of the sessions before a resume too), and this session's.
        self.totals, self.session = Totals(), Totals()
        #: The latest step's row.
        self.last_row: StepRow | None = None
        #: Per statistic of `TRENDS`, its latest values (two trend windows).
        self.recent: dict[str, collections.deque[float]] = {
            key: collections.deque(maxlen=2 * TREND_STEPS) for key in TRENDS
        }
        self.evals: list[EvalRow] = []
        self.loads, self.load_s = 0, 0.0
        self.carried = Carried()
        #: From a message taken off the controller's socket to its handling done.
        self.latency = Latency()

    def carry(self, carried: Carried) -> None:
        """Go on from the record of the sessions before (a resume): their rows
        (folded into the totals, then let go) and evaluations, and their training time."""
        for row in carried.rows:
            self._add(row, session=False)
        self.carried = dataclasses.replace(carried, rows=[])
        self.evals = list(carried.evals)

    def _add(self, row: StepRow, *, session: bool) -> None:
        self.totals.add(row)
        if session:
            self.session.add(row)
        self.last_row = row
        for key, values in self.recent.items():
            if math.isfinite(row.train.get(key, math.nan)):
                values.append(row.train[key])

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
        self._add(row, session=True)
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
        self.loads += 1
        self.load_s += seconds

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
        now = [e for c in clocks if (e := c.last.engine) is not None]
        if not now:
            return None
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

    def trends(self) -> dict[str, Trend]:
        """The statistics of `TRENDS` over the last `TREND_STEPS` steps that have them, and how their
        mean moved from the `TREND_STEPS` before."""
        out = {}
        for key, kept in self.recent.items():
            if not kept:
                continue
            values = list(kept)
            recent, before = values[-TREND_STEPS:], values[-2 * TREND_STEPS:-TREND_STEPS]
            mean = sum(recent) / len(recent)
            change = mean - sum(before) / len(before) if len(before) == TREND_STEPS else None
            out[key] = Trend(last=values[-1], mean=mean, steps=len(recent), change=change)
        return out

    def last(self, role: str, rank: int) -> Heartbeat | None:
        """A replica's latest heartbeat (None: none yet from this incarnation)."""
        clock = self.clocks.get((role, rank))
        return clock.last if clock is not None else None

    def latest(self, role: str) -> list[Heartbeat]:
        return [clock.last for clock in self.replicas(role)]

    def summary(self, wall_s: float, *, groups: GroupCounts = GroupCounts(), **fields: Any) -> Summary:
        """The run's summary from its totals (`wall_s`: this session's
        training time; `groups`: the whole run's)."""
        run, mine = self.totals, self.session
        session = SessionTotals(
            first_step=self.carried.step, steps=mine.steps, samples=mine.samples, tokens=mine.tokens,
            groups_trained=groups.trained - self.carried.groups_trained, wall_time_s=round(wall_s, 3),
            samples_per_s=_per(mine.samples, wall_s), tokens_per_s=_per(mine.tokens, wall_s),
        )
        wall_s += self.carried.time_s
        accuracy = [e.accuracy for e in self.evals if e.accuracy is not None]
        tail = accuracy[-3:]
        last3 = sum(tail) / len(tail) if tail else None
        return Summary(
            kv_cache_usage_mean=_mean(run.kv_cache_usage_sum, run.engines) if run.engines else None,
            waiting_mean=_mean(run.waiting_sum, run.engines) if run.engines else None,
            preemptions=run.preemptions,
            samples=run.samples,
            tokens=run.tokens,
            wall_time_s=round(wall_s, 3),
            samples_per_s=_per(run.samples, wall_s),
            tokens_per_s=_per(run.tokens, wall_s),
            staleness_max=run.staleness_max,
            staleness_mean=_mean(run.staleness_sum, run.steps),
            reward_mean=_mean(run.reward_sum, run.rewards) if run.rewards else None,
            weights_load_s_mean=_mean(self.load_s, self.loads),
            evals=self.evals,
            accuracy_before=accuracy[0] if accuracy else None,
            accuracy_after=accuracy[-1] if accuracy else None,
            accuracy_last3_mean=last3,
            gain_points=round(100 * (last3 - accuracy[0]), 2) if last3 is not None else None,
            data_bytes=sum(b.counters.bytes_out for b in self.latest("rollout")),
            roles=self.whole_run(),
            groups=groups,
            sessions=self.carried.sessions + 1,
            session=session,
            **fields,
        )


def _per(amount: int, seconds: float) -> float:
    return round(amount / seconds, 3) if seconds > 0 else 0.0


def _mean(total: float, count: int) -> float:
    return round(total / count, 6) if count else 0.0


def process_cpu() -> tuple[float, float]:
    """(this thread's CPU seconds, the process's), for the controller's own load."""
    import psutil

    times = psutil.Process().cpu_times()
    return time.thread_time(), times.user + times.system


def finite(metrics: dict[str, float]) -> dict[str, float]:
    """`metrics` without the undefined ones (NaN, infinities: e.g. an explained variance
    over returns that do not vary). JSON has no NaN: written, it would read back as null, which no
    row's number may be."""
    return {name: value for name, value in metrics.items() if math.isfinite(value)}
