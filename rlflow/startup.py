"""The start-up contract between the launcher and every service: what a
service process is started with (its role, rank, the controller's address,
the resolved config, the run's secret and, when its sockets are reachable
from other hosts, the run's CURVE keys), passed to it as bytes.

Both sides import it: the control plane that places the services, and the
services themselves; so it lives beside the config, below both."""

from __future__ import annotations

import os
import sys
from typing import Any

import msgspec

from rlflow.config import Config
from rlflow.data.net import CurveKeys
from rlflow.roles import EXTERNAL


def use_import_dir(config: Config) -> None:
    """Put the run's `run.import_dir` (resolved at launch) first on this
    process's import path: the user's modules are found there whatever the
    process's working directory."""
    path = config.run.import_dir
    if path and path not in sys.path:
        sys.path.insert(0, path)


class ServiceSpec(msgspec.Struct, frozen=True, kw_only=True):
    """Everything a service process needs to start (passed to it as bytes)."""

    role: str
    rank: int
    replicas: int
    run_id: str
    controller: str
    """The controller's ROUTER address."""
    config: Config
    run_dir: str = ""
    """Where the service writes its log (``logs/<role>-<rank>.log``); empty: stderr."""
    incarnation: int = 0
    secret: str = ""
    """The run's secret, shown to the controller in `Hello`."""
    curve: CurveKeys | None = None
    """The run's CURVE keys, for every socket the service opens; None: the run stays on loopback."""

    def encode(self) -> bytes:
        return msgspec.msgpack.encode(self)

    @classmethod
    def decode(cls, data: bytes) -> ServiceSpec:
        return msgspec.msgpack.decode(data, type=cls)

    @property
    def name(self) -> str:
        return f"{self.role}-{self.rank}"


#: What a replica the user starts is given, as environment variables (`rlflow
#: join` prints them; SPEC.md, *Start-up parameters*, says what to do with each).
JOIN_ENV = {
    "RLFLOW_CONTROLLER": "the controller's ROUTER address: connect a DEALER to it",
    "RLFLOW_RUN_ID": "the run's name",
    "RLFLOW_ROLE": f"the role to play (`Hello.role`, by its name: {', '.join(EXTERNAL)})",
    "RLFLOW_RANK": "the replica's rank within its role (`Hello.rank`)",
    "RLFLOW_REPLICAS": "replicas of the role (`Hello.replicas`)",
    "RLFLOW_SECRET": "the run's secret (`Hello.secret`)",
    "RLFLOW_HOST": "the address to bind the replica's own sockets on (empty: the machine's own IP)",
    "RLFLOW_JOIN_FILE": "the owner-only file (JSON) that holds all of these",
    "RLFLOW_HANDSHAKE_TIMEOUT_S": "seconds the replica waits for its `Welcome` after its hello (the controller "
    "waits as long for a hello, and for `Ready` after its welcome)",
    "RLFLOW_HEARTBEAT_TIMEOUT_S": "seconds of silence after which the controller presumes the replica lost: "
    "send `Heartbeat` every `Welcome.heartbeat_s`, well within this",
    "RLFLOW_CURVE_SERVER_PUBLIC": "with CURVE: the run's server public key (Z85), which every socket that "
    "connects expects, and which every socket that binds serves with",
    "RLFLOW_CURVE_SERVER_SECRET": "with CURVE: the run's server secret key (Z85), for the sockets the replica binds",
    "RLFLOW_CURVE_CLIENT_PUBLIC": "with CURVE: the run's client public key (Z85), for the sockets the replica "
    "connects, and the one key its servers admit",
    "RLFLOW_CURVE_CLIENT_SECRET": "with CURVE: the run's client secret key (Z85)",
}


def join_environment(info: Any, role: str, rank: int, path: str) -> dict[str, str]:
    """The environment of replica `rank` of `role` joining the run of `info`
    (a `rundir.JoinInfo`, read from `path`)."""
    if role not in info.replicas:
        raise ValueError(f"the run has no role {role!r}; its roles: {', '.join(info.replicas)}")
    if not 0 <= rank < info.replicas[role]:
        raise ValueError(f"{role} has ranks 0 to {info.replicas[role] - 1}, not {rank}")
    env = {"RLFLOW_CONTROLLER": info.controller, "RLFLOW_RUN_ID": info.run_id, "RLFLOW_ROLE": role,
           "RLFLOW_RANK": str(rank), "RLFLOW_REPLICAS": str(info.replicas[role]), "RLFLOW_SECRET": info.secret,
           "RLFLOW_HOST": info.host, "RLFLOW_JOIN_FILE": path,
           "RLFLOW_HANDSHAKE_TIMEOUT_S": f"{info.handshake_timeout_s:g}",
           "RLFLOW_HEARTBEAT_TIMEOUT_S": f"{info.heartbeat_timeout_s:g}"}
    if info.curve is not None:
        env.update(RLFLOW_CURVE_SERVER_PUBLIC=info.curve.server_public,
                   RLFLOW_CURVE_SERVER_SECRET=info.curve.server_secret,
                   RLFLOW_CURVE_CLIENT_PUBLIC=info.curve.client_public,
                   RLFLOW_CURVE_CLIENT_SECRET=info.curve.client_secret)
    return env


#: The cores a replica keeps to once it is ready ("0-1,3"), set by the Ray actor that hosts it. It
#: starts on every core its node lends the run: a replica's start is mostly imports (vLLM's twice: its
#: engine core is a process of its own), and two rollout replicas pinned from the first instruction to
#: their pool's one core started their engines there one after the other while the trainer's core
#: waited idle (a two-replica, two-rank test run 48 s to its first step against 37 s).
CORES_VAR = "RLFLOW_CORES"


def cpu_ranges(cpus: list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2,5"."""
    runs: list[list[int]] = []
    for cpu in cpus:
        if runs and runs[-1][1] == cpu - 1:
            runs[-1][1] = cpu
        else:
            runs.append([cpu, cpu])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def parse_ranges(text: str) -> list[int]:
    """"0-2,5" -> [0, 1, 2, 5]."""
    out: list[int] = []
    for part in filter(None, text.split(",")):
        first, _, last = part.partition("-")
        out += range(int(first), int(last or first) + 1)
    return out


def own_cores() -> list[int] | None:
    """The cores this replica keeps to once it is ready (None: the launcher gave it none; it runs
    wherever it may)."""
    text = os.environ.get(CORES_VAR, "")
    return parse_ranges(text) if text else None


def placed_cores() -> list[int]:
    """The cores this replica runs on once it is ready: its own, else wherever it may now."""
    return own_cores() or sorted(os.sched_getaffinity(0))


def keep_to_own_cores() -> int:
    """Keep every thread of this process and of the processes it started (a vLLM engine core, a
    reward's workers) to this replica's own cores from now on; threads that keep to some of them
    already (vLLM binds its compute threads one to a core) are left as they are. Threads started
    later inherit it. The threads moved (0 without own cores)."""
    import psutil

    cores = own_cores()
    if cores is None or not hasattr(os, "sched_setaffinity"):
        return 0
    wanted, moved = set(cores), 0
    me = psutil.Process()
    for process in [me, *me.children(recursive=True)]:
        try:
            threads = [t.id for t in process.threads()]
        except psutil.Error:  # it ended meanwhile
            continue
        for tid in threads:
            try:
                if not os.sched_getaffinity(tid) <= wanted:
                    os.sched_setaffinity(tid, wanted)
                    moved += 1
            except OSError:  # the thread ended meanwhile
                continue
    return moved
