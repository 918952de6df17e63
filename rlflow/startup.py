"""The start-up contract between the launcher and every service: what a
service process is started with (its role, rank, the controller's address,
the resolved config, the run's secret and, when its sockets are reachable
from other hosts, the run's CURVE keys), passed to it as bytes.

Both sides import it: the control plane that places the services, and the
services themselves; so it lives beside the config, below both."""

from __future__ import annotations

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
