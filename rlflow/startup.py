"""The start-up contract between the launcher and every service: what a
service process is started with (its role, rank, the controller's address,
the resolved config, the run's secret and, when its sockets are reachable
from other hosts, the run's CURVE keys), passed to it as bytes.

Both sides import it: the control plane that places the services, and the
services themselves; so it lives beside the config, below both."""

from __future__ import annotations

import sys

import msgspec

from rlflow.config import Config
from rlflow.data.net import CurveKeys


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
