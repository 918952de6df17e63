"""rlflow's long-lived services, grouped by process: a folder per role (the
roles are `rlflow.roles.ROLES`), each with its service and its engines, and
``base`` and the other modules here that they share.

Each service is a trio program that runs one loop under a nursery and speaks
only the protocol. `main` is what a service process runs. Importing this
package loads nothing else: vLLM's engine-core process imports
``rollout/vllm_lora_worker`` and ``rollout/vllm_worker`` through it.
"""

from __future__ import annotations

import importlib
import logging
import os


def service_class(role: str) -> type:
    """The service class of `role`, from the role registry."""
    from rlflow.roles import BY_NAME

    module, name = BY_NAME[role].service.split(":")
    return getattr(importlib.import_module(module), name)


def main(spec_bytes: bytes) -> None:
    """Run the service described by `spec_bytes` until it is shut down."""
    import trio

    from rlflow.startup import ServiceSpec, use_import_dir

    spec = ServiceSpec.decode(spec_bytes)
    use_import_dir(spec.config)
    _log_to(spec)
    service = service_class(spec.role)(spec)
    trio.run(service.run)


def _log_to(spec) -> None:
    from rlflow.rundir import RunDir

    root = logging.getLogger("rlflow")
    root.setLevel(logging.INFO)
    if spec.run_dir:
        path = RunDir(spec.run_dir).service_log(spec.name)
        path.parent.mkdir(parents=True, exist_ok=True)
        handler: logging.Handler = logging.FileHandler(path)
    else:
        handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter(f"%(asctime)s {os.getpid()} %(levelname)s %(message)s"))
    root.handlers[:] = [handler]
