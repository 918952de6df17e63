"""One training run from start to finish: Ray, pools, services, controller.

`run` is what `rlflow up` calls: it writes the resolved config into the run
directory, joins or starts Ray, reserves the pools, runs the controller
(which starts the services) until the last step, and then, whatever
happened, stops every service and removes every actor and placement group.
"""

from __future__ import annotations

import pathlib
import secrets
from collections.abc import Callable
from typing import Any

import trio

from rlflow import placement
from rlflow.config import Config, to_toml
from rlflow.controller import Controller


def new_run_id(run_dir: pathlib.Path) -> str:
    return f"{run_dir.name}-{secrets.token_hex(3)}"


def run(
    config: Config,
    run_dir: pathlib.Path,
    *,
    on_status: Callable[[dict], None] | None = None,
    run_id: str | None = None,
) -> dict[str, Any]:
    """Run `config` to its last step in `run_dir`; the summary."""
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.toml").write_text(to_toml(config))
    run_id = run_id or new_run_id(run_dir)
    started_ray = not placement.ray.is_initialized()
    placement.start_ray(config.cluster)
    pools = placement.PoolManager(config, run_id)
    secret = secrets.token_hex(16)
    launcher = placement.RayLauncher(config, run_id, str(run_dir.resolve()), pools, secret=secret)
    try:
        pools.create()
        controller = Controller(config, run_dir, run_id, launcher, on_status=on_status, secret=secret)
        return trio.run(controller.run)
    finally:
        launcher.stop()
        pools.remove()
        placement.wait_until_gone(run_id)
        if started_ray:
            placement.stop_ray()
