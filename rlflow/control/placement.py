"""Placement on Ray: role -> pool -> placement group -> one actor per replica.

`PoolManager` checks the cluster's resources against what every pool asks
for (and fails naming the pool, the resource, asked and available), then
reserves one placement group per pool. `RayLauncher` starts one named Ray
actor per replica of each role, scheduled into a bundle of its pool's group,
with WORLD_SIZE, RANK, LOCAL_RANK, MASTER_ADDR and MASTER_PORT in its
environment, thread counts from its bundle, and on CPU its own cores where
the node has enough; the actor then runs the role's service until it is
shut down.

This is the only module that imports Ray.
"""

from __future__ import annotations

import importlib
import logging
import math
import os
import re
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from rlflow.data import transport
from rlflow.data.net import CurveKeys, free_port, hold_port
from rlflow.config import ClusterConfig, Config, PoolConfig
from rlflow.startup import ServiceSpec
from rlflow.runstate import RUN_ID_VAR

log = logging.getLogger("rlflow.control.placement")

NAMESPACE = "rlflow"
_THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "RLFLOW_NUM_THREADS")
#: OpenMP threads that wait sleep rather than spin (unless the user says otherwise): the roles of a
#: run share cores, and torch's threads spinning at a barrier while another process holds the core
#: made a 4-s test of a role's two ranks take 224 s on a busy 2-core machine (27 s with this).
_WAIT_POLICY = {"OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE")}


class PlacementError(Exception):
    """The cluster cannot hold what the config asks for."""


def start_ray(cluster: ClusterConfig) -> dict[str, Any]:
    """Join the configured Ray cluster, or start a local one; its resources."""
    if ray.is_initialized():
        return ray.cluster_resources()
    kwargs: dict[str, Any] = {"namespace": NAMESPACE, "log_to_driver": False, "configure_logging": False}
    if cluster.address:
        ray.init(address=cluster.address, **kwargs)
    else:
        ray.init(num_cpus=cluster.num_cpus or os.cpu_count(), include_dashboard=cluster.dashboard, **kwargs)
    return ray.cluster_resources()


def stop_ray() -> None:
    if ray.is_initialized():
        ray.shutdown()


def _bundle(pool: PoolConfig) -> dict[str, float]:
    bundle = {"CPU": pool.cpus_per_bundle}
    if pool.gpus_per_bundle:
        bundle["GPU"] = pool.gpus_per_bundle
    bundle.update(pool.resources)
    return {k: v for k, v in bundle.items() if v > 0}


def check_resources(config: Config, available: dict[str, float], nodes: list[dict[str, float]],
                    labels: list[dict[str, str]] | None = None) -> None:
    """Fail, naming the pool, the resource, asked and available, if the pools
    cannot fit in a cluster with `available` resources on `nodes` (whose Ray
    node labels are `labels`, in the same order: a pool with labels of its own
    fits only on the nodes that carry them)."""
    asked: dict[str, float] = defaultdict(float)
    takers: dict[str, list[str]] = defaultdict(list)
    for name, pool in config.pools.items():
        bundle = _bundle(pool)
        if pool.labels:
            carrying = [n for n, have in zip(nodes, labels or [{}] * len(nodes))
                        if all(have.get(k) == v for k, v in pool.labels.items())]
            if not carrying:
                wanted = ", ".join(f"{k}={v}" for k, v in pool.labels.items())
                raise PlacementError(f"pool {name!r} asks for nodes labelled {wanted}; no live node of the cluster "
                                     "is (`ray start --labels`)")
            nodes_of_pool = carrying
        else:
            nodes_of_pool = nodes
        for resource, amount in bundle.items():
            total = amount * pool.bundles
            before = asked[resource]
            asked[resource] += total
            takers[resource].append(name)
            have = available.get(resource, 0.0)
            if asked[resource] > have + 1e-9:
                earlier = f" after {', '.join(takers[resource][:-1])} took {before:g}" if before else ""
                raise PlacementError(
                    f"pool {name!r} asks for {total:g} {resource} ({pool.bundles} bundles x {amount:g}); "
                    f"the cluster has {have:g} {resource}{earlier}"
                )
            largest = max((n.get(resource, 0.0) for n in nodes_of_pool), default=0.0)
            if amount > largest + 1e-9:
                raise PlacementError(
                    f"pool {name!r} asks for bundles of {amount:g} {resource}; the largest node has {largest:g}"
                )


def share_bundles(config: Config) -> list[tuple[str, str, int, dict[str, float]]]:
    """(role, pool, bundle, resources) of every replica, in rank order per role.

    Replicas of the roles on one pool take its bundles round-robin, and the
    replicas in one bundle split its resources evenly.
    """
    members: dict[tuple[str, int], list[tuple[str, int]]] = defaultdict(list)
    for role, cfg in config.launched_roles():
        bundles = config.pools[cfg.pool].bundles
        for rank in range(cfg.replicas):
            members[(cfg.pool, rank % bundles)].append((role, rank))
    out = []
    for (pool_name, bundle), replicas in members.items():
        share = {k: v / len(replicas) for k, v in _bundle(config.pools[pool_name]).items()}
        out += [(role, rank, pool_name, bundle, share) for role, rank in replicas]
    out.sort(key=lambda item: (item[0], item[1]))
    return [(role, pool_name, bundle, share) for role, _, pool_name, bundle, share in out]


def core_ranges(
    by_node: dict[str, list[tuple[str, int, float]]], node_cpus: dict[str, float]
) -> dict[tuple[str, int], tuple[int, int]]:
    """(first, count) of the CPUs of each (pool, bundle), laid out in order on
    its node, where the node has a CPU for each CPU its bundles ask for
    (otherwise its bundles share every CPU). A bundle of under one CPU
    shares a core with its neighbour."""
    out = {}
    for node, bundles in by_node.items():
        if sum(c for _, _, c in bundles) > node_cpus.get(node, 0) + 1e-9:
            continue
        start = 0.0
        for name, bundle, cpus in bundles:
            if cpus <= 0:
                continue
            first, last = math.floor(start + 1e-9), math.ceil(start + cpus - 1e-9)
            out[(name, bundle)] = (first, max(1, last - first))
            start += cpus
    return out


@dataclass
class Slot:
    """Where one replica runs: its pool's group, a bundle, its share of it."""

    pool: str
    group: PlacementGroup
    bundle: int
    resources: dict[str, float]
    cores: tuple[int, int] | None
    """(first, count) of the node's CPUs it may use, or None to share them all."""
    threads: int
    node: str = ""


@dataclass
class PoolManager:
    """One placement group per pool, checked against the cluster first."""

    config: Config
    run_id: str
    groups: dict[str, PlacementGroup] = field(default_factory=dict)

    def create(self) -> None:
        alive = [n for n in ray.nodes() if n.get("Alive")]
        nodes, labels = [n["Resources"] for n in alive], [n.get("Labels") or {} for n in alive]
        check_resources(self.config, ray.cluster_resources(), nodes, labels)
        # The pools fit the cluster: wait for resources a run that just ended gives back (Ray frees a
        # removed placement group's bundles a moment later; on a busy machine, longer than 10 s).
        deadline = time.monotonic() + self.config.cluster.placement_timeout_s
        while True:
            try:
                check_resources(self.config, ray.available_resources(), nodes, labels)
                break
            except PlacementError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        for name, pool in self.config.pools.items():
            self.groups[name] = placement_group(
                [_bundle(pool)] * pool.bundles, strategy=pool.strategy, name=f"rlflow:{self.run_id}:{name}",
                bundle_label_selector=[dict(pool.labels)] * pool.bundles if pool.labels else None,
            )
        deadline = self.config.cluster.placement_timeout_s
        for name, group in self.groups.items():
            ready, _ = ray.wait([group.ready()], timeout=deadline)
            if not ready:
                raise PlacementError(
                    f"pool {name!r} was not placed within {deadline:g} s (cluster.placement_timeout_s); "
                    f"strategy {self.config.pools[name].strategy} may be impossible on this cluster"
                )

    def nodes(self) -> set[str]:
        """The Ray nodes this run occupies: those of its bundles and the driver's (the controller's)."""
        table = ray.util.placement_group_table()
        out = {ray.get_runtime_context().get_node_id()}
        for group in self.groups.values():
            out.update(table.get(group.id.hex(), {}).get("bundles_to_node_id", {}).values())
        return out

    def slots(self) -> dict[str, list[Slot]]:
        """Role -> the slot of each replica (see `share_bundles`)."""
        cores = self._cores()
        out: dict[str, list[Slot]] = defaultdict(list)
        for role, pool_name, bundle, share in share_bundles(self.config):
            pool = self.config.pools[pool_name]
            out[role].append(
                Slot(
                    pool=pool_name,
                    group=self.groups[pool_name],
                    bundle=bundle,
                    resources=share,
                    cores=cores.get((pool_name, bundle)),
                    threads=max(1, math.ceil(pool.cpus_per_bundle)),
                )
            )
        return dict(out)

    def _cores(self) -> dict[tuple[str, int], tuple[int, int]]:
        """CPU ranges of the bundles Ray placed (see `core_ranges`)."""
        table = ray.util.placement_group_table()
        by_node: dict[str, list[tuple[str, int, float]]] = defaultdict(list)
        for name, group in self.groups.items():
            info = table.get(group.id.hex(), {})
            for bundle, node in sorted(info.get("bundles_to_node_id", {}).items()):
                by_node[node].append((name, int(bundle), self.config.pools[name].cpus_per_bundle))
        node_cpus = {n["NodeID"]: n["Resources"].get("CPU", 0) for n in ray.nodes() if n.get("Alive")}
        return core_ranges(by_node, node_cpus)

    def remove(self) -> None:
        for group in self.groups.values():
            try:
                remove_placement_group(group)
            except Exception as exc:  # already gone with a dead cluster
                log.warning("removing a placement group failed: %s", exc)
        self.groups.clear()


class ServiceHost:
    """The Ray actor that hosts one replica's service process."""

    def __init__(self, cores: tuple[int, int] | None):
        if cores is not None and hasattr(os, "sched_setaffinity"):
            available = sorted(os.sched_getaffinity(0))
            first, count = cores
            if first + count <= len(available):
                os.sched_setaffinity(0, available[first : first + count])

    def address(self, ranks: int) -> tuple[str, int]:
        """This node's IP and a port for MASTER_ADDR / MASTER_PORT. For a role of
        more than one rank the port is held by this process (rank 0's, which
        hosts the ranks' group over it: `take_held`), so that nothing else
        binds it while the ranks start; one rank meets no one."""
        return ray.util.get_node_ip_address(), hold_port() if ranks > 1 else free_port()

    def run(self, spec: bytes, master: tuple[str, int]) -> str:
        os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = master[0], str(master[1])
        # The services are started by name: the control plane does not import them.
        importlib.import_module("rlflow.services").main(spec)
        return "exited"


@dataclass
class Failure:
    """A replica whose process ended on its own (an error, or a death)."""

    role: str
    rank: int
    incarnation: int
    message: str


@dataclass
class _Running:
    role: str
    rank: int
    incarnation: int
    actor: Any
    ref: Any
    options: dict[str, Any]
    cores: tuple[int, int] | None
    master: tuple[str, int]


class RayLauncher:
    """Starts, watches, restarts and stops the services of one run on Ray."""

    def __init__(
        self, config: Config, run_id: str, run_dir: str, pools: PoolManager, *, secret: str = "",
        curve: CurveKeys | None = None,
    ):
        self.config = config
        self.secret = secret
        self.curve = curve
        self.run_id = run_id
        self.run_dir = run_dir
        self.pools = pools
        self.running: dict[tuple[str, int], _Running] = {}
        self.controller = ""
        self._stopping = False

    def actor_name(self, role: str, rank: int) -> str:
        return f"rlflow:{self.run_id}:{role}:{rank}"

    def start(self, controller_address: str) -> None:
        self.controller = controller_address
        host_cls = ray.remote(ServiceHost)
        slots = self.pools.slots()
        # Every role's actors are created before any is waited on: their processes start together.
        roles: list[tuple[str, list[tuple[int, Any, dict[str, Any], tuple[int, int] | None]], Any]] = []
        for role, cfg in self.config.launched_roles():
            started: list[tuple[int, Any, dict[str, Any], tuple[int, int] | None]] = []
            local_ranks: dict[tuple[str, int], int] = defaultdict(int)
            for rank, slot in enumerate(slots[role][: cfg.replicas]):
                local_rank = local_ranks[(slot.pool, slot.bundle)]
                local_ranks[(slot.pool, slot.bundle)] += 1
                env = {
                    **transport.PROCESS_ENV,
                    **_WAIT_POLICY,
                    **dict.fromkeys(_THREAD_VARS, str(slot.threads)),
                    "WORLD_SIZE": str(cfg.replicas),
                    "RANK": str(rank),
                    "LOCAL_RANK": str(local_rank),
                    RUN_ID_VAR: self.run_id,  # `rlflow down` finds what is left of the run by it
                }
                options: dict[str, Any] = {
                    "name": self.actor_name(role, rank),
                    "namespace": NAMESPACE,
                    "num_cpus": slot.resources.get("CPU", 0),
                    "num_gpus": slot.resources.get("GPU", 0),
                    "resources": {k: v for k, v in slot.resources.items() if k not in ("CPU", "GPU")},
                    "scheduling_strategy": PlacementGroupSchedulingStrategy(slot.group, slot.bundle),
                    "runtime_env": {"env_vars": env},
                    "max_restarts": 0,
                    "max_concurrency": 2,
                }
                started.append((rank, host_cls.options(**options).remote(slot.cores), options, slot.cores))
            roles.append((role, started, started[0][1].address.remote(cfg.replicas)))
        masters = ray.get([master for _, _, master in roles])
        for (role, started, _), master in zip(roles, masters):
            for rank, actor, options, cores in started:
                self._run(role, rank, 0, actor, options, cores, master)

    def _run(self, role: str, rank: int, incarnation: int, actor: Any, options: dict[str, Any],
             cores: tuple[int, int] | None, master: tuple[str, int]) -> None:
        spec = ServiceSpec(
            role=role,
            rank=rank,
            replicas=dict(self.config.role_items())[role].replicas,
            run_id=self.run_id,
            controller=self.controller,
            config=self.config,
            run_dir=self.run_dir,
            incarnation=incarnation,
            secret=self.secret,
            curve=self.curve,
        )
        ref = actor.run.remote(spec.encode(), master)
        self.running[(role, rank)] = _Running(role, rank, incarnation, actor, ref, options, cores, master)

    def failures(self) -> list[Failure]:
        """Replicas whose process has ended on its own since the last call
        (each reported once)."""
        if self._stopping:
            return []
        items = [item for item in list(self.running.values()) if item.ref is not None]  # not those reported
        if not items:
            return []
        done, _ = ray.wait([r.ref for r in items], num_returns=len(items), timeout=0)
        out = []
        for item in items:
            if item.ref in done:
                try:
                    ray.get(item.ref)
                    message = "exited before the run ended"
                except Exception as exc:
                    message = f"died: {_first_line(exc)}"
                out.append(Failure(item.role, item.rank, item.incarnation, message))
                item.ref = None
        return out

    def kill(self, role: str, rank: int) -> None:
        """End a replica (e.g. one that hangs); it is then reported as a failure."""
        item = self.running.get((role, rank))
        if item is not None:
            ray.kill(item.actor, no_restart=True)

    def restart(self, role: str, rank: int, incarnation: int) -> None:
        """Start incarnation `incarnation` of a replica that has ended, in its bundle."""
        item = self.running[(role, rank)]
        ray.kill(item.actor, no_restart=True)  # frees its name, if it lingers
        deadline = time.monotonic() + 30
        while self.actor_name(role, rank) in alive_actors(self.run_id) and time.monotonic() < deadline:
            time.sleep(0.05)
        actor = ray.remote(ServiceHost).options(**item.options).remote(item.cores)
        self._run(role, rank, incarnation, actor, item.options, item.cores, item.master)

    def stop(self, wait_s: float = 20.0) -> None:
        """Let services that are shutting down finish, then kill what is left."""
        self._stopping = True
        refs = [r.ref for r in self.running.values() if r.ref is not None]
        if refs:
            ray.wait(refs, num_returns=len(refs), timeout=wait_s)
        for item in self.running.values():
            ray.kill(item.actor, no_restart=True)
        self.running.clear()
        self.pools.remove()


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    if isinstance(exc, ray.exceptions.ActorDiedError) and "worker process has died" in text:  # the gist of a paragraph
        kind = re.search(r"Worker exit type: (\w+)", text)
        return f"its process ended ({kind.group(1) if kind else 'actor died'}: killed, out of memory, or crashed)"
    # Ray wraps the service's own error (a traceback, maybe of an exception
    # group drawn with | and +---): the last line that names an error says it.
    lines = [line.strip().lstrip("|").strip() for line in text.splitlines()]
    named = [line for line in lines if _ERROR_LINE.match(line)]
    plain = [line for line in lines if line and line.strip("+-|= ")]
    return (named or plain or [type(exc).__name__])[-1][:500]


#: A line that names an error: ``SomeError: what``, ``pkg.mod.SomeError: what``.
_ERROR_LINE = re.compile(r"^[\w.]*(Error|Exception|Dead|Exit|Interrupt|Failed)\b: ")


def alive_actors(run_id: str | None = None) -> list[str]:
    """Names of rlflow actors Ray still has alive (for one run, or any)."""
    prefix = f"rlflow:{run_id}:" if run_id else "rlflow:"
    named = ray.util.list_named_actors(all_namespaces=True)
    return [a["name"] for a in named if a["namespace"] == NAMESPACE and a["name"].startswith(prefix)]


def live_placement_groups(run_id: str | None = None) -> list[str]:
    """Names of rlflow placement groups not yet removed."""
    prefix = f"rlflow:{run_id}:" if run_id else "rlflow:"
    table = ray.util.placement_group_table()
    return [g["name"] for g in table.values() if g["name"].startswith(prefix) and g["state"] != "REMOVED"]


def wait_until_gone(run_id: str, timeout_s: float = 30.0) -> None:
    """Block until the run's actors and placement groups are gone."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not alive_actors(run_id) and not live_placement_groups(run_id):
            return
        time.sleep(0.2)


def remove_run(address: str, run_id: str, timeout_s: float = 30.0) -> tuple[list[str], list[str]] | None:
    """Kill the actors and remove the placement groups of run `run_id` that
    the Ray cluster at `address` still has (a run whose controller died
    without removing them); their names. None: no cluster answers there."""
    if not _reachable(address):
        return None
    joined = not ray.is_initialized()
    if joined:
        ray.init(address=address, namespace=NAMESPACE, log_to_driver=False, configure_logging=False)
    try:
        actors, groups = alive_actors(run_id), live_placement_groups(run_id)
        for name in actors:
            try:
                ray.kill(ray.get_actor(name, namespace=NAMESPACE), no_restart=True)
            except ValueError:  # gone meanwhile
                pass
        for name in groups:
            group = ray.util.get_placement_group(name)
            if group is not None:
                remove_placement_group(group)
        wait_until_gone(run_id, timeout_s)
        return actors, groups
    finally:
        if joined:
            ray.shutdown()


def _reachable(address: str, timeout_s: float = 3.0) -> bool:
    """Whether something listens at a Ray address (``host:port``; "auto" is
    left to Ray): joining one that is gone would wait a long while before it fails."""
    import socket

    if address == "auto":
        return True
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
            return True
    except (OSError, ValueError):
        return False

