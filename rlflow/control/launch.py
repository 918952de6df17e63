"""One training run from start to finish: paths, Ray, pools, services, controller.

`run` is what `rlflow up` calls. It resolves every path of the config once
(the "default" model to its directory, relative paths to absolute ones, the
directory user modules are imported from to where `rlflow` runs) and
writes that resolved config into the run directory: what the services get,
so that a service on another node needs nothing from the launcher's machine
but the paths themselves. It makes the run's secret and, when its sockets
are reachable from other hosts (`cluster.uses_curve`), its CURVE keys,
which every service gets in its `ServiceSpec`. Then it joins or starts Ray,
reserves the pools (and refuses a run that spans nodes on loopback
addresses), runs the controller (which starts the services) until the last
step, and, whatever happened, stops every service and removes every actor
and placement group.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import secrets
from collections.abc import Callable, Iterator

import msgspec
import trio

from rlflow.config import Config, ConfigError, to_toml
from rlflow.control import placement
from rlflow.control.controller import Controller
from rlflow.control.metrics import check_trackers
from rlflow.data import transport
from rlflow.data.net import is_loopback
from rlflow.models import resolve_model
from rlflow.taskmodel import TASK_MODEL, resolve_task_model
from rlflow.roles import NAMES
from rlflow.rundir import RunDir, Status, Summary
from rlflow.runstate import RUN_ID_VAR


def new_run_id(run_dir: pathlib.Path) -> str:
    return f"{run_dir.name}-{secrets.token_hex(3)}"


def resolve(config: Config) -> Config:
    """`config` with the model resolved and every path absolute.

    Raises `ConfigError` naming the key of a path that does not hold what it should.
    """
    run = msgspec.structs.replace(config.run, import_dir=os.path.abspath(config.run.import_dir or os.getcwd()))
    if run.resume:
        run = msgspec.structs.replace(run, resume=os.path.abspath(run.resume))
    rollout = config.roles.rollout
    if config.needs_model:
        try:
            found = resolve_task_model(config) if rollout.model == TASK_MODEL else resolve_model(rollout.model)
            model = str(found.resolve())
        except FileNotFoundError as exc:
            raise ConfigError("roles.rollout.model", rollout.model, str(exc)) from None
        rollout = msgspec.structs.replace(rollout, model=model)
    roles = msgspec.structs.replace(config.roles, rollout=rollout)
    for name in NAMES:  # the engines of other roles that load a model: "policy" or one with its tokenizer
        role = getattr(roles, name)
        engine = getattr(role, "engine", None)
        if name == "rollout" or engine is None or not isinstance(getattr(engine, "model", None), str):
            continue
        path = _role_model(engine.model, rollout.model, f"roles.{name}.engine.model")
        if hasattr(engine, "check_vocabulary"):
            engine.check_vocabulary(_vocab_size(path), f"roles.{name}.engine")
        roles = msgspec.structs.replace(roles, **{name: msgspec.structs.replace(
            role, engine=msgspec.structs.replace(engine, model=path))})
    check_trackers(config)
    return msgspec.structs.replace(config, run=run, roles=roles)


def _vocab_size(model: str) -> int | None:
    """The vocabulary size in a Hugging Face model directory's config (None if it does not say)."""
    try:
        return int(json.loads((pathlib.Path(model) / "config.json").read_text())["vocab_size"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def check_reach(host: str, nodes: int) -> None:
    """A run on more than one node cannot bind loopback: the others could not reach it."""
    if nodes > 1 and is_loopback(host):
        raise ConfigError(
            "cluster.host", host,
            f"the run spans {nodes} Ray nodes, and a socket on a loopback address cannot be reached from another "
            "node: leave it empty (each node's own IP)",
        )


def _role_model(model: str, policy: str, key: str) -> str:
    """The folder of a role's model (`key` names it in errors): "policy" is the
    policy's starting weights (not a checkpoint resumed from); any other name
    or path is resolved, and must share the policy's tokenizer."""
    if model == "policy":
        return policy
    try:
        path = str(resolve_model(model).resolve())
    except FileNotFoundError as exc:
        raise ConfigError(key, model, str(exc)) from None
    _same_tokenizer(path, policy, key)
    return path


def _same_tokenizer(model: str, policy: str, key: str) -> None:
    """A role that scores or values the tokens the policy samples must read them: one vocabulary."""
    from rlflow.tasks.core import load_tokenizer

    if model == policy:
        return
    if load_tokenizer(model).get_vocab() != load_tokenizer(policy).get_vocab():
        raise ConfigError(
            key, model,
            f"its tokenizer differs from the policy's ({policy}): it must read the tokens the policy samples",
        )


@contextlib.contextmanager
def _marked(run_id: str) -> Iterator[None]:
    """Processes started meanwhile carry the run id in their environment (`rlflow.runstate`)."""
    before = os.environ.get(RUN_ID_VAR)
    os.environ[RUN_ID_VAR] = run_id
    try:
        yield
    finally:
        if before is None:
            del os.environ[RUN_ID_VAR]
        else:
            os.environ[RUN_ID_VAR] = before


def request_stop(run_dir: str | os.PathLike, reason: str = "stop requested") -> bool:
    """Ask the controller of the run in `run_dir` to stop it, with the run's secret (what `rlflow down`
    does): it ends the run as after its last step (state "stopped"). False if the run has no controller
    to ask."""
    from rlflow.protocol import Shutdown

    info = RunDir(run_dir).read_controller()
    if info is None or not info.address:
        return False

    async def ask() -> None:
        async with transport.open_dealer(connect=info.address, curve=info.curve, name="stop") as dealer:
            await dealer.send(Shutdown(reason=reason, secret=info.secret))
            await trio.sleep(0.2)  # the message leaves before the socket closes

    trio.run(ask)
    return True


def run(
    config: Config,
    run_dir: str | os.PathLike,
    *,
    on_status: Callable[[Status], None] | None = None,
    run_id: str | None = None,
) -> Summary:
    """Run `config` to its last step in `run_dir`; the summary."""
    config = resolve(config)
    folder = RunDir(run_dir)
    folder.path.mkdir(parents=True, exist_ok=True)
    folder.config.write_text(to_toml(config))
    if config.agents is not None and not config.agents.api_key:  # made for this run, kept in agents.json alone
        config = msgspec.structs.replace(config, agents=msgspec.structs.replace(
            config.agents, api_key=secrets.token_urlsafe(24)))
    run_id = run_id or new_run_id(folder.path)
    started_ray = not placement.ray.is_initialized()
    with _marked(run_id):  # a local Ray started for the run is the run's: `rlflow down` finds it by the mark
        placement.start_ray(config.cluster)
    pools = placement.PoolManager(config, run_id)
    secret = secrets.token_hex(16)
    curve = transport.new_curve_keys() if config.cluster.uses_curve else None
    launcher = placement.RayLauncher(config, run_id, str(folder.path.resolve()), pools, secret=secret, curve=curve)
    try:
        pools.create()
        check_reach(config.cluster.host, len(pools.nodes()))
        controller = Controller(config, folder, run_id, launcher, on_status=on_status, secret=secret, curve=curve)
        return trio.run(controller.run)
    finally:
        launcher.stop()
        pools.remove()
        placement.wait_until_gone(run_id)
        if started_ray:
            placement.stop_ray()
