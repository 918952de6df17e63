"""`rlflow plan RUN_DIR --devices N`: which split of N devices runs fastest.

A discrete-event model of the pipeline, with the semantics of rlflow's own
services (continuous batching over slots with one token per sequence per
decode step, credits within the staleness bound, a sync barrier at zero
staleness, weight updates reaching the rollout after a delay and, with the
strict staleness check, restarts and drops of groups past the bound)
replays the unit costs measured in a run: the decode-step time and slots of a
rollout replica, the response lengths, the trainer's time per token, the
weight-update delay and, in a run with a role that values each group on its
way to the trainer and trains on what it valued (a `Learner`, whose costs its
registry entry reads from the run, `RoleSpec.plan`), that role's forward and
step time per token. It predicts the throughput of each split of N devices
between rollout and trainer (and that role, on a pool of its own; or its
forward and step done on the trainer's devices before each step, as a
one-worker design does), and of the colocated layout (all devices
generate, then all train, synchronously), ranks them, and prints the pools
section of the best one.

`simulate` is also what `bench/plan.py` and `bench/longtail.py --scale`
hold against measured runs.
"""

from __future__ import annotations

import heapq
import itertools
import json
import math
import pathlib
from collections import deque
from dataclasses import dataclass
from typing import Any

import numpy as np
import tomli_w

from rlflow.config import SimRollout, SimTrainer, load
from rlflow.roles import MESSAGES_PER_S, ROLES, hook
from rlflow.rundir import RunDir


@dataclass(frozen=True)
class Learner:
    """A role between the reward and the trainer that values each group on its
    way to the trainer, then trains on what it valued, on devices of its own or
    the trainer's. Its registry entry's `RoleSpec.plan` reads its costs from a run."""

    role: str
    """Its name (its column in `table`, its table in `pools_section`)."""
    forward_s_per_token: float
    """Time per token to compute values, on one device."""
    step_s_per_token: float
    """Time per token of its optimizer step, on one device."""
    max_steps_owed: int = 1
    """Steps it may owe while it computes values for new groups."""


@dataclass(frozen=True)
class Workload:
    """Unit costs and shape of a run, per device."""

    slots_per_device: int
    """Concurrent sequences one rollout device decodes."""
    step_s: float
    """Decode-step time with one active sequence."""
    step_s_per_seq: float
    """Extra decode-step time per active sequence."""
    trainer_device_s_per_token: float
    """Trainer time per token on one device (halves with two)."""
    step_overhead_s: float = 0.0
    """Fixed trainer time per optimizer step."""
    update_s: float = 0.0
    """From the trainer publishing a version to the rollout generating with it."""
    reward_s: float = 0.0
    """Delay per group between rollout and trainer (scoring, and waiting to be sent on)."""
    batch_size: int = 32
    samples_per_prompt: int = 8
    max_staleness: int = 2
    strict: bool = False
    """`staleness_check = "strict"`: groups past the bound are generated again."""
    lengths: tuple[int, ...] = (256,)
    """Response lengths to draw from (the run's, or a distribution's)."""
    learner: Learner | None = None
    """A role between the reward and the trainer that values and trains (None: none)."""


@dataclass
class Prediction:
    layout: str
    rollout_devices: int
    trainer_devices: int
    samples_per_s: float
    step_s: float
    trainer_idle: float
    rollout_occupancy: float
    reissued: int = 0
    learner_devices: int = 0
    """Devices of the learner's own pool (0: no learner, or one on the trainer's devices)."""
    learner: str = ""
    """The learner's role ("": none)."""


@dataclass(eq=False)
class _Seq:
    group: int
    length: int
    min_version: int
    end: int = 0
    """The decode step after which it is done."""
    first_version: int = 0
    admitted: int = 0
    """When it first took a slot (its place among the active ones)."""


def simulate(w: Workload, rollout_devices: int, trainer_devices: int, steps: int = 20, *,
             colocated: bool = False, seed: int = 0, learner_devices: int = 0) -> Prediction:
    """Run the model for `steps` optimizer steps; throughput after the first few.

    Colocated: every device generates, then every device trains, with a
    barrier between steps (synchronous).

    With a learner (`w.learner`): on `learner_devices` of its own, each group
    is valued on its way to the trainer (one group at a time, in order) and
    each step's worth of groups valued is trained on, before more are valued
    once its `max_staleness` steps are owed; with none (and colocated),
    the trainer's devices value and train the learner on each step's batch
    before the actor's step.

    Sequences are kept in a heap by the decode step at which they end, so an
    event costs O(log slots): thousands of slots model in seconds.
    """
    rng = np.random.default_rng(seed)
    lengths = np.asarray(w.lengths)
    B, n = w.batch_size, w.samples_per_prompt
    k = 0 if colocated else w.max_staleness
    slots = w.slots_per_device * rollout_devices
    s_per_token = w.trainer_device_s_per_token / trainer_devices
    learner = w.learner
    if learner is not None and not learner_devices:  # on the trainer's devices, before each step
        s_per_token += (learner.forward_s_per_token + learner.step_s_per_token) / trainer_devices

    def step_time(active: int) -> float:
        return w.step_s + w.step_s_per_seq * active

    now = 0.0
    decoded = 0  # decode steps so far
    rollout_version = trainer_version = steps_done = next_group = reissued = 0
    pending: deque[_Seq] = deque()  # submitted requests waiting for a slot, in order
    active: set[_Seq] = set()
    ends: list[tuple[int, int, _Seq]] = []  # (end step, tie-break, sequence), stale entries included
    ties = itertools.count()
    left: dict[int, int] = {}
    tokens_of: dict[int, int] = {}
    first_of: dict[int, int] = {}
    ready: list[tuple[float, int]] = []  # (reaches the trainer, group)
    buffer: list[int] = []
    updates: list[tuple[float, int]] = []  # (the rollout has it, version)
    trainer_busy = slot_time = 0.0
    training, train_end = False, math.inf
    step_ends: list[float] = []
    valuing: deque[int] = deque()  # groups waiting for the learner's values
    owed: list[int] = []  # groups valued, not yet trained on by the learner
    learner_job: tuple[str, list[int]] | None = None
    learner_end = math.inf

    def learner_next() -> None:
        nonlocal learner_job, learner_end
        if learner_job is not None or learner is None or not learner_devices:
            return
        due = len(owed) // B
        if due > learner.max_steps_owed or (due and not valuing):
            learner_job = ("step", owed[:B])
            del owed[:B]
            cost = learner.step_s_per_token
        elif valuing:
            learner_job = ("values", [valuing.popleft()])
            cost = learner.forward_s_per_token
        else:
            return
        learner_end = now + cost * sum(tokens_of[g] for g in learner_job[1]) / learner_devices

    def start(seq: _Seq, length: int) -> None:
        seq.end = decoded + length
        active.add(seq)
        heapq.heappush(ends, (seq.end, next(ties), seq))

    def next_end() -> int:
        while True:
            end, _, seq = ends[0]
            if seq in active and seq.end == end:
                return end
            heapq.heappop(ends)

    def submit(group: int, min_version: int) -> None:
        left[group], tokens_of[group], first_of[group] = n, 0, 1 << 30
        for length in rng.choice(lengths, n):
            pending.append(_Seq(group, int(length), min_version))

    def grant() -> None:
        nonlocal next_group
        limit = min(B * (steps_done + k + 1), B * (steps + 4))
        while next_group < limit:
            submit(next_group, max(0, next_group // B - k))
            next_group += 1

    def admit() -> None:
        while pending and len(active) < slots and pending[0].min_version <= rollout_version:
            seq = pending.popleft()
            seq.first_version, seq.admitted = rollout_version, next(ties)
            start(seq, seq.length)

    grant()
    admit()
    while steps_done < steps:
        t_seq = now + (next_end() - decoded) * step_time(len(active)) if active else math.inf
        t_next = min(t_seq, ready[0][0] if ready else math.inf, train_end if training else math.inf,
                     updates[0][0] if updates else math.inf, learner_end)
        if t_next == math.inf:
            raise RuntimeError("the modelled pipeline stalled")
        if active:
            decoded += int((t_next - now) / step_time(len(active)) + 1e-9)
            slot_time += len(active) * (t_next - now)
        now = t_next
        while updates and updates[0][0] <= now:
            _, version = heapq.heappop(updates)
            rollout_version = max(rollout_version, version)
            # Strict: groups already too stale whatever happens start again, whole.
            doomed: set[int] = set()
            if w.strict:
                doomed = {q.group for q in active if rollout_version - q.first_version > k}
                doomed |= {g for g, first in first_of.items() if left.get(g, 0) > 0 and rollout_version - first > k}
            for q in sorted(active, key=lambda q: q.admitted) if doomed else ():
                if q.group in doomed:
                    q.length = int(rng.choice(lengths))
                    q.first_version = rollout_version
                    start(q, q.length)
            for group in doomed:
                done = (n - left[group] - sum(1 for q in pending if q.group == group)
                        - sum(1 for q in active if q.group == group))
                for _ in range(max(done, 0)):
                    pending.appendleft(_Seq(group, int(rng.choice(lengths)), 0))
                left[group] = n
                tokens_of[group] = 0
                first_of[group] = 1 << 30
        finished = []
        while ends and ends[0][0] <= decoded:
            end, _, q = heapq.heappop(ends)
            if q in active and q.end == end:
                active.remove(q)
                finished.append(q)
        for q in finished:
            left[q.group] -= 1
            tokens_of[q.group] += q.length
            first_of[q.group] = min(first_of[q.group], q.first_version)
            if left[q.group] == 0:
                heapq.heappush(ready, (now + w.reward_s, q.group))
        while ready and ready[0][0] <= now:
            (valuing if learner_devices else buffer).append(heapq.heappop(ready)[1])
        if learner_job is not None and now >= learner_end:
            kind, groups = learner_job
            if kind == "values":
                buffer += groups
                owed.extend(groups)
            learner_job, learner_end = None, math.inf
        learner_next()
        if training and now >= train_end:
            training = False
            steps_done += 1
            trainer_version += 1
            step_ends.append(now)
            heapq.heappush(updates, (now + w.update_s, trainer_version))
            grant()
        if not training:
            if w.strict:
                # The trainer drops what has passed the bound (reissued).
                for group in [g for g in buffer if trainer_version - first_of[g] > k]:
                    buffer.remove(group)
                    reissued += 1
                    submit(group, max(0, trainer_version - k))
            if len(buffer) >= B:
                buffer.sort(key=lambda g: first_of[g])  # the oldest first
                taken, buffer = buffer[:B], buffer[B:]
                duration = w.step_overhead_s + s_per_token * sum(tokens_of[g] for g in taken)
                training, train_end = True, now + duration
                trainer_busy += duration
        admit()
    warm = min(3, max(len(step_ends) - 2, 0))
    measured = len(step_ends) - 1 - warm
    step_s = (step_ends[-1] - step_ends[warm]) / measured if measured > 0 else now / max(steps_done, 1)
    return Prediction(
        layout=_layout(w, rollout_devices, trainer_devices, learner_devices, colocated),
        rollout_devices=rollout_devices,
        trainer_devices=trainer_devices,
        samples_per_s=B * n / step_s,
        step_s=step_s,
        trainer_idle=max(0.0, 1 - trainer_busy / now) if now else 0.0,
        rollout_occupancy=slot_time / (slots * now) if now else 0.0,
        reissued=reissued,
        learner_devices=learner_devices,
        learner=learner.role if learner is not None else "",
    )


def _layout(w: Workload, rollout: int, trainer: int, learner: int, colocated: bool) -> str:
    if colocated:
        return "colocated"
    if learner:
        return f"{rollout}+{trainer}+{learner}"
    return f"{rollout}+{trainer}" + ("i" if w.learner else "")


def candidates(w: Workload, devices: int, steps: int = 20) -> list[Prediction]:
    """Every split of `devices` between rollout and trainer (with a learner: also
    between rollout, trainer and a pool of the learner's; "i": the learner on the
    trainer's devices), and colocated; fastest first."""
    out = [simulate(w, r, devices - r, steps) for r in range(1, devices)]
    if w.learner:
        out += [simulate(w, r, t, steps, learner_devices=devices - r - t)
                for r in range(1, devices - 1) for t in range(1, devices - r)]
    out.append(simulate(w, devices, devices, steps, colocated=True))
    return sorted(out, key=lambda p: -p.samples_per_s)


# ---------------------------------------------------------------------------
# Unit costs from a run directory
# ---------------------------------------------------------------------------


def workload_from_run(run_dir: str | pathlib.Path) -> tuple[Workload, int, int]:
    """The run's unit costs per device, and its rollout and trainer device counts."""

    folder = RunDir(run_dir)
    path = folder.path
    config = load(folder.config)
    rows = folder.read_metrics()
    summary = folder.read_summary()
    if not rows or summary is None:
        raise ValueError(f"{path} has no finished steps to learn unit costs from")
    lengths: list[int] = []
    for file in sorted(folder.traces.glob("lengths-*.jsonl")):
        for line in file.read_text().splitlines():
            lengths += json.loads(line)["lengths"]
    rollout = config.roles.rollout
    rollout_devices = _devices(config, "rollout")
    trainer_devices = _devices(config, "trainer")
    # Trainer: measured seconds per consumed token (the model charges every
    # token of a step's groups), times its devices.
    train_s = sum(r.train_s for r in rows)
    tokens = sum(r.tokens for r in rows)
    trainer_cost = train_s / max(tokens, 1) * trainer_devices
    if not lengths:  # no per-sample record: every response of the mean length
        lengths = [max(1, round(tokens / max(sum(r.samples for r in rows), 1)))]
    counters: dict[str, float] = {}
    for file in sorted(folder.traces.glob("rollout-*.json")):
        for key, value in json.loads(file.read_text()).get("counters", {}).items():
            counters[key] = counters.get(key, 0.0) + value
    if isinstance(rollout.engine, SimRollout):
        slots = rollout.engine.slots * rollout.replicas
        step_s, per_seq = rollout.engine.step_s, rollout.engine.step_s_per_seq
        if counters.get("slot_s") and counters.get("tokens"):
            # What the engine really did: seconds a slot spent per token it
            # generated (its busy time would also count slots left empty
            # while the last sequences of the run drain).
            step_s, per_seq = counters["slot_s"] / counters["tokens"], 0.0
    else:
        # A real engine: its measured tokens per busy second at its batch size.
        slots = getattr(rollout.engine, "max_num_seqs", 64) * rollout.replicas
        rollout_shares = summary.roles.get("rollout")
        busy = (rollout_shares.busy if rollout_shares is not None else 1.0) * summary.wall_time_s
        step_s, per_seq = slots * busy / max(summary.tokens, 1), 0.0
    # The trainer's time between steps beyond its compute (collecting,
    # publishing), from steps where it did not wait for input.
    gaps = [
        b.time_s - a.time_s - b.train_s
        for a, b in zip(rows, rows[1:])
        if "trainer" in b.roles and b.roles["trainer"].starved < 0.05
    ]
    overhead = float(np.median(gaps)) if gaps else 0.0
    if isinstance(config.roles.trainer.engine, SimTrainer):
        overhead = max(overhead, config.roles.trainer.engine.step_overhead_s)
    learner = None
    for role in ROLES:  # the role that values and trains beside the trainer, costed by its registry entry
        if role.plan and getattr(config.roles, role.name, None) is not None:
            costs = hook(role.plan)(folder, config, _devices(config, role.name))
            learner = Learner(role=role.name, **costs)
    workload = Workload(
        slots_per_device=max(1, slots // max(rollout_devices, 1)),
        step_s=step_s,
        step_s_per_seq=per_seq,
        trainer_device_s_per_token=trainer_cost,
        step_overhead_s=overhead,
        update_s=summary.weights_load_s_mean,
        reward_s=paced_s(config),
        batch_size=config.run.batch_size,
        samples_per_prompt=config.run.samples_per_prompt,
        max_staleness=config.run.max_staleness,
        strict=config.run.staleness_check == "strict",
        lengths=tuple(lengths),
        learner=learner,
    )
    return workload, rollout_devices, trainer_devices


def paced_s(config) -> float:
    """A group's mean wait, on its way from the rollout to the trainer, for the next message of each
    replica that sends it on while groups keep coming (half of `replicas / MESSAGES_PER_S` at each).
    Its measured transit would not do: that counts its wait for a trainer that holds the run back too."""
    return sum(getattr(config.roles, role.name).replicas / MESSAGES_PER_S / 2 for role in ROLES
               if role.hands_on == "samples" and getattr(config.roles, role.name, None) is not None)


def _devices(config, role: str) -> int:
    """A role's devices: GPUs of its replicas' bundles, else its replicas."""
    cfg = dict(config.role_items())[role]
    pool = config.pools[cfg.pool]
    if pool.gpus_per_bundle:
        return max(1, round(pool.gpus_per_bundle * cfg.replicas))
    return cfg.replicas


def pools_section(best: Prediction, w: Workload, gpus: bool) -> str:
    """The pools and role placement for a layout, as TOML to paste into a config."""
    unit = "gpus_per_bundle" if gpus else "cpus_per_bundle"
    table: dict[str, dict[str, Any]]
    if best.layout == "colocated":
        table = {
            "pools": {"all": {"bundles_per_node": best.rollout_devices, unit: 1.0}},
            "run": {"mode": "sync"},  # colocated: generate with everything, then train with everything
            "roles": {"rollout": {"pool": "all", "replicas": best.rollout_devices}, "trainer": {"pool": "all"}},
        }
        if w.learner:
            table["roles"][w.learner.role] = {"pool": "all"}
    else:
        table = {
            "pools": {
                "generate": {"bundles_per_node": best.rollout_devices, unit: 1.0},
                "train": {"bundles_per_node": best.trainer_devices, unit: 1.0},
            },
            "roles": {
                "rollout": {"pool": "generate", "replicas": best.rollout_devices},
                # One trainer rank per device, the model sharded across them.
                "trainer": {"pool": "train", "replicas": best.trainer_devices},
            },
        }
        if w.learner and best.learner_devices:  # a pool of its own, one rank per device
            table["pools"][w.learner.role] = {"bundles_per_node": best.learner_devices, unit: 1.0}
            table["roles"][w.learner.role] = {"pool": w.learner.role, "replicas": best.learner_devices}
        elif w.learner:  # on the trainer's devices: one more rank on each
            table["roles"][w.learner.role] = {"pool": "train", "replicas": best.trainer_devices}
    return tomli_w.dumps(table)


def plan(run_dir: str | pathlib.Path, devices: int, steps: int = 20) -> tuple[list[Prediction], str]:
    workload, rollout_devices, trainer_devices = workload_from_run(run_dir)
    if devices < 2:
        raise ValueError("--devices must be at least 2 (one to generate, one to train)")
    ranked = candidates(workload, devices, steps)

    config = load(RunDir(run_dir).config)
    gpus = any(p.gpus_per_bundle for p in config.pools.values())
    return ranked, pools_section(ranked[0], workload, gpus)


def table(ranked: list[Prediction]) -> str:
    """The ranked layouts (with a learner, its devices in a column of its name)."""
    learner = next((p.learner for p in ranked if p.learner), "")
    extra = f"{learner:>8}" if learner else ""
    lines = [f"{'layout':<12}{'rollout':>8}{'trainer':>8}{extra}{'samples/s':>11}{'step s':>8}{'trainer idle':>13}"
             f"{'occupancy':>10}"]
    for p in ranked:
        where = ("-" if p.layout == "colocated" else str(p.learner_devices or "inline")) if learner else ""
        lines.append(
            f"{p.layout:<12}{p.rollout_devices:>8}{p.trainer_devices:>8}{where:>{len(extra)}}{p.samples_per_s:>11.1f}"
            f"{p.step_s:>8.2f}{p.trainer_idle:>13.0%}{p.rollout_occupancy:>10.0%}"
        )
    return "\n".join(lines)

