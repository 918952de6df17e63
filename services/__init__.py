"""rlflow's long-lived services: rollout, reward, teacher and trainer.

Each is a trio program that runs one loop under a nursery and speaks only
the protocol. `main` is what a service process runs.
"""

from __future__ import annotations

import importlib
import logging
import os
import pathlib

import trio

#: Role -> "module:class" of its service.
SERVICES = {
    "rollout": "rlflow.services.rollout:RolloutService",
    "reward": "rlflow.services.reward:RewardService",
    "teacher": "rlflow.services.teacher:TeacherService",
    "trainer": "rlflow.services.trainer:TrainerService",
}


def service_class(role: str) -> type:
    module, name = SERVICES[role].split(":")
    return getattr(importlib.import_module(module), name)


def main(spec_bytes: bytes) -> None:
    """Run the service described by `spec_bytes` until it is shut down."""
    from rlflow.service import ServiceSpec

    spec = ServiceSpec.decode(spec_bytes)
    _log_to(spec)
    service = service_class(spec.role)(spec)
    trio.run(service.run)


def _log_to(spec) -> None:
    root = logging.getLogger("rlflow")
    root.setLevel(logging.INFO)
    if spec.run_dir:
        folder = pathlib.Path(spec.run_dir) / "logs"
        folder.mkdir(parents=True, exist_ok=True)
        handler: logging.Handler = logging.FileHandler(folder / f"{spec.name}.log")
    else:
        handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter(f"%(asctime)s {os.getpid()} %(levelname)s %(message)s"))
    root.handlers[:] = [handler]
