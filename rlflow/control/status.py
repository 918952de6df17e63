"""The run's status (status.json) and summary built from what the controller
holds: plain functions, no I/O. `run_status` and `run_summary` read a
controller's public state (its config, replicas, ledger, statistics,
warnings, the door's counts and its router's)."""

from __future__ import annotations

import collections
import os
import socket
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Protocol

import msgspec

from rlflow.control.ledger import GroupLedger
from rlflow.control.replicas import Replica, Roster, State
from rlflow.control.stats import RunStats, process_cpu
from rlflow.protocol import Counters, EngineLoad, Heartbeat
from rlflow.roles import VERSIONED
from rlflow.rundir import (
    AgentsInfo, ControllerStats, GroupCounts, JoinInfo, Phase, Placed, RoleStatus, Shares, Status, Summary, named,
)

if TYPE_CHECKING:
    from rlflow.config import Config
    from rlflow.control.outbox import Door
    from rlflow.control.rounds import Weights
    from rlflow.data.net import CurveKeys
    from rlflow.data.transport import Router

#: Roles that hold versioned weights (and so can be behind the trainer): the
#: policy's, and a role's own (its version counts its steps as the policy's does).
VERSIONED_ROLES = VERSIONED


class ControllerView(Protocol):
    """What the status and the summary read of a controller (`rlflow.control.controller.Controller`,
    which imports this module)."""

    config: Config
    run_id: str
    secret: str
    curve: CurveKeys | None
    address: str | None
    router: Router | None
    roster: Roster
    ledger: GroupLedger
    weights: Weights
    stats: RunStats
    door: Door
    version: int
    state: Phase
    error: str | None
    stop_reason: str
    warnings: list[str]
    received_by_type: collections.Counter[str]
    started: float
    training_started: float | None
    cpu0: tuple[float, float]


def add_counters(counts: Iterable[Counters]) -> Counters:
    """Counters added up, field by field (maps, `rejected` and the counter families, key by key)."""
    plain: collections.Counter[str] = collections.Counter()
    maps: collections.defaultdict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    for c in counts:
        for name, value in msgspec.structs.asdict(c).items():
            if isinstance(value, dict):
                maps[name].update(value)
            else:
                plain[name] += value
    fields: dict[str, Any] = {**plain, **{name: dict(values) for name, values in maps.items()}}
    return Counters(**fields)


def add_loads(loads: Iterable[EngineLoad | None]) -> EngineLoad | None:
    """Engines' loads added up; KV-cache use is the fullest one's (None: no engine reported)."""
    reported = [load for load in loads if load is not None]
    if not reported:
        return None
    return EngineLoad(
        slots=sum(x.slots for x in reported),
        running=sum(x.running for x in reported),
        waiting=sum(x.waiting for x in reported),
        kv_cache_usage=max(x.kv_cache_usage for x in reported),
        preemptions=sum(x.preemptions for x in reported),
    )


def agents_info(replicas: Iterable[Replica], api_key: str, url: str = "") -> AgentsInfo:
    """Where outside agents take episodes now: the router's `url`, the endpoint each registered rollout
    replica's hello named, and the run's key (agents.json)."""
    return AgentsInfo(url=url, urls={r.name: r.hello.endpoints["agents"] for r in replicas
                                     if r.role == "rollout" and r.registered and "agents" in r.hello.endpoints},
                      api_key=api_key)


def placed(replica: Replica, now: float) -> Placed:
    hello = replica.hello
    waiting = None
    if replica.state is State.LOST and replica.restart_at is not None:
        waiting = round(max(0.0, replica.restart_at - now), 2)
    return Placed(
        rank=replica.rank, host=hello.host, pid=hello.pid, incarnation=replica.incarnation,
        endpoints=hello.endpoints, state=replica.state.value, restarts=replica.restarts, restart_in_s=waiting,
        last_error=replica.last_error, external=replica.external, threads=hello.threads, cpus=hello.cpus,
        model=hello.model,
    )


def role_status(role: str, expected: int, replicas: list[Replica], beats: list[Heartbeat], shares: Shares,
                version: int, now: float) -> RoleStatus:
    """One role now: its replicas, the shares of their time over the latest
    heartbeats (`shares`), their queues and counts added up, and (roles with
    versioned weights) the oldest version held and how far behind `version`."""
    queues: collections.Counter[str] = collections.Counter()
    for beat in beats:
        queues.update(beat.queues)
    held = [r.version for r in replicas if r.live] or [r.version for r in replicas]
    oldest = min(held, default=0) if role in VERSIONED_ROLES else None
    return RoleStatus(
        replicas=expected,
        up=sum(r.live for r in replicas),
        restarts=sum(r.restarts for r in replicas),
        placed=[placed(r, now) for r in replicas],
        states=shares,
        queues=dict(queues),
        counters=named(add_counters(beat.counters for beat in beats)),
        engine=named(add_loads(beat.engine for beat in beats)),
        version=oldest,
        behind=None if oldest is None else version - oldest,
    )


def group_counts(ledger: GroupLedger) -> GroupCounts:
    counts = ledger.counts()
    return GroupCounts(
        queued=counts["queued"],
        generating=counts["generating"],
        downstream=counts["downstream"],
        received=counts["received"],
        trained=ledger.trained_count,
        granted=ledger.granted,
        reissued=ledger.reissued,
        dropped=dict(ledger.dropped),
    )


def controller_stats(controller: ControllerView) -> ControllerStats:
    """The controller's own load."""
    elapsed = max(time.monotonic() - controller.started, 1e-9)
    (thread0, proc0), (thread, proc) = controller.cpu0, process_cpu()
    messages, router = sum(controller.received_by_type.values()), controller.router
    latency = controller.stats.latency
    return ControllerStats(
        messages_received=messages, messages_per_s=round(messages / elapsed, 2),
        bytes_received=router.bytes_received if router else 0, bytes_sent=router.bytes_sent if router else 0,
        rejected=dict(router.rejected) if router else {}, ignored=dict(controller.door.ignored),
        by_type=dict(controller.received_by_type), cpu_s=round(thread - thread0, 4),
        cpu_share=round((thread - thread0) / elapsed, 5), process_cpu_share=round((proc - proc0) / elapsed, 5),
        latency_p50_ms=round(1e3 * latency.quantile(0.5), 3), latency_p99_ms=round(1e3 * latency.quantile(0.99), 3),
        latency_max_ms=round(1e3 * latency.max, 3),
    )


def run_status(controller: ControllerView, now: float) -> Status:
    """status.json from the controller's state (`now`: its supervision clock)."""
    stats, run, window = controller.stats, controller.config.run, controller.stats.window()
    roles = {
        name: role_status(name, cfg.replicas, controller.roster.role(name), stats.latest(name), window[name],
                          controller.version, now)
        for name, cfg in controller.config.role_items()
    }
    return Status(
        run_id=controller.run_id, state=controller.state, error=controller.error, pid=os.getpid(),
        host=socket.gethostname(), address=controller.address,
        elapsed_s=round(time.monotonic() - controller.started, 2), step=controller.ledger.steps_done,
        steps=run.steps, samples=stats.totals.samples, version=controller.version, mode=run.mode,
        max_staleness=run.max_staleness, staleness_check=run.staleness_check, groups=group_counts(controller.ledger),
        last_step=stats.last_row, last_eval=stats.evals[-1] if stats.evals else None,
        roles=roles, controller=controller_stats(controller), warnings=list(controller.warnings),
        trends=stats.trends(),
        waiting_for=sorted(f"{role}-{rank}" for role, rank in controller.roster.external
                           if not (r := controller.roster.replicas.get((role, rank))) or not r.registered),
    )


def join_info(controller: ControllerView) -> JoinInfo:
    """What a replica the user starts needs (join.json)."""
    config = controller.config
    assert controller.address is not None  # join.json is written once the controller's router is bound
    return JoinInfo(run_id=controller.run_id, controller=controller.address, secret=controller.secret,
                    host=config.cluster.host, replicas={name: role.replicas for name, role in config.role_items()},
                    external=sorted(f"{role}-{rank}" for role, rank in controller.roster.external),
                    curve=controller.curve, handshake_timeout_s=config.cluster.handshake_timeout_s,
                    heartbeat_timeout_s=config.cluster.heartbeat_timeout_s)


def run_summary(controller: ControllerView) -> Summary:
    """summary.json from the controller's state."""
    run = controller.config.run
    return controller.stats.summary(
        time.monotonic() - (controller.training_started or controller.started), run_id=controller.run_id,
        state=controller.state, error=controller.error, stop_reason=controller.stop_reason, mode=run.mode,
        max_staleness=run.max_staleness, staleness_check=run.staleness_check, steps=controller.ledger.steps_done,
        groups=group_counts(controller.ledger), controller=controller_stats(controller),
        weights_checked=controller.weights.checksums.matched,
    )
