"""Where a run runs: `[cluster]` (Ray, sockets, supervision) and `[pools.NAME]`."""

from __future__ import annotations

from typing import Annotated, Literal

from msgspec import Meta

from rlflow.config.base import NonNegFloat, NonNegInt, PosFloat, PosInt, Table
from rlflow.data.net import is_loopback


class ClusterConfig(Table, frozen=True):
    """Where the run's Ray cluster is and how services reach each other."""

    address: str = ""
    """Ray address to join ("auto", "HOST:PORT"); empty starts a local Ray for the run."""
    num_cpus: NonNegInt = 0
    """Logical CPUs of a local Ray (0: this machine's count)."""
    host: str = "127.0.0.1"
    """Address services bind their sockets on; empty: each node's own IP (a run that spans nodes needs that)."""
    handshake_timeout_s: PosFloat = 300.0
    """How long the controller waits for every service to say hello and get ready, and for a restarted
    replica to come back (a restart still starting after this counts as a death)."""
    heartbeat_s: PosFloat = 0.5
    """Seconds between service heartbeats (longer in a run of more than 50 replicas: the controller asks
    for at most 100 a second of them all)."""
    heartbeat_timeout_s: PosFloat = 60.0
    """A service silent for this long is presumed dead (restarted, but for the roles that train, whose
    loss stops the run)."""
    progress_timeout_s: PosFloat = 300.0
    """A replica (not of a role that trains) that holds work but makes no progress (no decode step, no
    finished group) for this long is presumed hung, and restarted."""
    max_restarts: NonNegInt = 3
    """Deaths of a replica, those of the roles that train aside (dying, hanging, going silent), within
    `restart_window_s` after which it is not restarted again but given up on (the run goes on with the
    role's other replicas, if it has any): a long run survives a death a day."""
    restart_window_s: PosFloat = 3600.0
    """The window over which a replica's deaths count against `max_restarts`."""
    restart_backoff_s: NonNegFloat = 1.0
    """Wait before restarting a replica that died; doubled for each further death in the window (with
    up to 25% jitter either way), up to `restart_backoff_max_s`."""
    restart_backoff_max_s: NonNegFloat = 60.0
    """The longest wait before a restart."""
    weight_timeout_s: PosFloat = 120.0
    """How long a new generation of a collective weight group waits for its members to join, and a
    broadcast for its peers: a member that died leaves the group broken after this long (and it is made
    anew), not stuck. The first group, made while the services start, waits `handshake_timeout_s`."""
    max_weight_rebuilds: NonNegInt = 5
    """A collective weight group that breaks (a member died mid-broadcast) is made anew and the newest
    version moved again; after this many breaks in a row with no round completed, the run fails."""
    placement_timeout_s: PosFloat = 60.0
    """How long to wait for the placement groups of all pools (first, for the resources that a run just
    ended gives back)."""
    dashboard: bool = False
    """Start Ray's dashboard with a local Ray (needs ray[default]; serves Ray's state API on :8265)."""
    curve: Literal["auto", "on"] = "auto"
    """ZeroMQ CURVE on every socket of the run (encrypted; only processes given the run's keys may connect).
    "auto": whenever `host` is not a loopback address (empty included), i.e. whenever other hosts can reach
    the sockets (there, a socket without CURVE is refused); "on": also on loopback (a machine shared with
    others). CURVE costs throughput: ~0.25 GB/s per stream here against ~2.4 GB/s without."""
    shm: Literal["auto", "off"] = "auto"
    """Large tensors between services of one machine through shared memory rather than the socket (which
    still carries each message's header). "auto": from each sender to the receivers that can map its memory
    (same kernel, PID namespace and user, as each says at registration; never across hosts); "off": every
    tensor over the socket. Segments are private to the run's user (mode 0600), CURVE or not."""
    shm_min_bytes: Annotated[int, Meta(ge=4096)] = 1 << 20
    """Tensors of at least this many bytes go through shared memory; smaller ones stay in the message."""
    shm_max_bytes: Annotated[int, Meta(ge=1 << 20)] = 1 << 30
    """Most shared memory each sending socket holds at once (segments are reused; when none is free and no
    new one fits, tensors go over the socket, whose high-water marks then hold the sender back)."""

    @property
    def uses_curve(self) -> bool:
        """Whether the run's sockets speak CURVE (see `curve`)."""
        return self.curve == "on" or not is_loopback(self.host)


class PoolConfig(Table, frozen=True):
    """A resource pool: bundles of CPUs / GPUs reserved as one placement group."""

    bundles_per_node: PosInt = 1
    """Bundles on each node."""
    nodes: PosInt = 1
    """Nodes the pool spans."""
    cpus_per_bundle: NonNegFloat = 1.0
    """CPUs in each bundle (fractions allowed)."""
    gpus_per_bundle: NonNegFloat = 0.0
    """GPUs in each bundle."""
    resources: dict[str, float] = {}
    """Custom Ray resources in each bundle (e.g. {gpu_slot = 1} to emulate accelerators)."""
    strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = "PACK"
    """Ray placement strategy for the pool's bundles."""
    labels: dict[str, str] = {}
    """Ray node labels every bundle's node must carry (e.g. {pool = "generate"} places the pool on nodes
    started with `ray start --labels pool=generate`); empty: any node."""

    @property
    def bundles(self) -> int:
        return self.bundles_per_node * self.nodes
