"""The agents' router beside a run (`agents.router`): one address for every rollout replica.

The router (services/rollout/router.py) is a process of its own, started here by the controller and
kept for the whole run: after the services' farewell too, so that the answers replicas give agents as
they stop reach them through it. It reads the run's agents.json for the replicas' addresses; its own
goes there as ``url``. One that exits is started again on the port it had (its agents keep their
base URLs; only requests under way are lost), and one that cannot start fails the run, naming why.
"""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import sys
from collections.abc import AsyncIterator, Callable, Iterable

import msgspec
import trio

from rlflow.config import Config
from rlflow.errors import RunFailed
from rlflow.control.replicas import Replica
from rlflow.control.status import agents_info
from rlflow.rundir import RunDir, write_json

log = logging.getLogger("rlflow.controller")

#: How long a router may take to start (its imports, on a busy 2-core machine) before the run fails.
START_S = 120.0


@contextlib.asynccontextmanager
async def agents_router(config: Config, run_dir: RunDir, why: Callable[[], str]) -> AsyncIterator[str]:
    """The router's URL while the block runs ("" when the run has none); after it, the router answers
    every request 410 `run_over` naming `why()` for a moment, and is stopped."""
    if config.agents is None or not config.agents.router:
        yield ""
        return
    process: list[trio.Process] = []
    ending = trio.Event()
    async with trio.open_nursery() as nursery:
        url = await nursery.start(_keep, config, run_dir, process, ending)
        write_agents(run_dir, (), config, url)  # agents may come before the replicas: the router holds their takes
        try:
            yield url
        finally:
            ending.set()
            with trio.CancelScope(shield=True), trio.move_on_after(START_S):
                stdin = process[-1].stdin
                assert stdin is not None  # opened as a pipe
                try:
                    await stdin.send_all(f"{why()}\n".encode())
                    await stdin.aclose()  # it answers what waits, then ends
                    await process[-1].wait()
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    pass  # it ended already
            nursery.cancel_scope.cancel()


def write_agents(run_dir: RunDir, replicas: Iterable[Replica], config: Config, url: str) -> None:
    """agents.json (owner-only): the router's `url`, each registered rollout replica's endpoint, the key."""
    assert config.agents is not None  # only a run with [agents] serves agents
    write_json(run_dir.agents, agents_info(replicas, config.agents.api_key, url), private=True)


async def _keep(config: Config, run_dir: RunDir, process_now: list[trio.Process], ending: trio.Event, *,
                task_status=trio.TASK_STATUS_IGNORED) -> None:
    assert config.agents is not None
    port = config.agents.router_port
    env = {**os.environ, "RLFLOW_AGENTS": msgspec.json.encode(config.agents).decode()}  # with the run's key
    started = False
    while True:
        command = [sys.executable, "-m", "rlflow.services.rollout.router", "--run-dir", str(run_dir.path),
                   "--port", str(port)]
        process = await trio.lowlevel.open_process(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
        process_now[:] = [process]  # the one running now
        try:
            with trio.move_on_after(START_S):
                url = await _first_line(process.stdout)
            if not url:
                code = process.poll()
                why = f"it exited with {code}" if code is not None else f"no address after {START_S:g} s"
                raise RunFailed(f"the agents' router did not start: {why} (its errors are in the controller's log)")
            if not started:
                task_status.started(url)
                started = True
            port = int(url.rsplit(":", 1)[1])
            log.info("[controller] the agents' router serves at %s", url)
            code = await process.wait()
            if ending.is_set():
                return
            log.warning("[controller] the agents' router exited (%s); starting it again on port %d", code, port)
            await trio.sleep(1.0)
        finally:
            if process.returncode is None:
                process.terminate()
                with trio.CancelScope(shield=True), trio.move_on_after(5):
                    await process.wait()
                if process.returncode is None:
                    process.kill()


async def _first_line(stream) -> str:
    """The first line `stream` writes ("" if it ends before one)."""
    line = b""
    while not line.endswith(b"\n"):
        chunk = await stream.receive_some(1)
        if not chunk:
            return ""
        line += chunk
    return line.decode().strip()
