"""Trainer and critic ranks as real processes, for tests: `run_ranks` hands a job
of this module to one process per rank (spawned: nothing of the test process
is inherited), each joins a gloo process group on loopback for that job and
leaves it after; their results come back.

The processes are kept for the next job (each spawn re-imports torch and
transformers, seconds on a small machine): a job leaves nothing in them but
imported modules, since it makes its engine, group and seeds anew. A job that
fails or runs out of time ends them all, and the next job starts fresh ones;
`close_pool` ends them at the end of the session.

Jobs return plain data (numpy arrays, floats): nothing torch-specific
crosses the process boundary.
"""

from __future__ import annotations

import multiprocessing
import queue
import time
import traceback
from typing import Any

import numpy as np


def run_ranks(job: str, world: int, *args: Any, timeout_s: float = 180.0) -> list[Any]:
    """Run `job(ranks, *args)` on `world` ranks; the result of each, by rank."""
    from rlflow.data.net import free_port

    workers = _pool(world)
    port = free_port("127.0.0.1")
    for rank, (proc, inbox) in enumerate(workers):
        inbox.put((job, rank, world, port, args))
    out: dict[int, Any] = {}
    ok = False
    try:
        deadline = time.monotonic() + timeout_s
        while len(out) < world:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{job} on {world} ranks did not finish within {timeout_s:g} s")
            try:
                rank, done, value = _POOL["results"].get(timeout=0.5)
            except queue.Empty:
                dead = [p.exitcode for p, _ in workers if p.exitcode is not None]
                if dead:
                    raise RuntimeError(f"{job}: a rank exited with {dead[0]} before reporting") from None
                continue
            if not done:
                raise RuntimeError(f"{job} failed on rank {rank}:\n{value}")
            out[rank] = value
        ok = True
        return [out[rank] for rank in range(world)]
    finally:
        if not ok:
            close_pool()


#: The rank processes kept between jobs: "workers" [(process, its inbox)], "results" (one queue for all).
_POOL: dict[str, Any] = {}


def _pool(world: int) -> list[tuple[Any, Any]]:
    """The first `world` processes of the pool, started if there are fewer."""
    ctx = multiprocessing.get_context("spawn")
    if not _POOL:
        _POOL.update(workers=[], results=ctx.Queue())
    workers = _POOL["workers"]
    while len(workers) < world:
        inbox = ctx.Queue()
        proc = ctx.Process(target=_serve, args=(inbox, _POOL["results"]), daemon=True)
        proc.start()
        workers.append((proc, inbox))
    return workers[:world]


def close_pool() -> None:
    """End every process of the pool."""
    if not _POOL:
        return
    for proc, inbox in _POOL["workers"]:
        if proc.is_alive():
            proc.kill()
        proc.join(10)
        inbox.close()
        inbox.join_thread()
    _POOL["results"].close()
    _POOL["results"].join_thread()
    _POOL.clear()


def _serve(inbox: Any, results: Any) -> None:
    """A rank process: run each job it is handed, until it is ended."""
    while True:
        job, rank, world, port, args = inbox.get()
        _main(job, rank, world, port, results, args)


def _main(job: str, rank: int, world: int, port: int, results: Any, args: tuple) -> None:
    try:
        from rlflow.services.fsdp import Sharded

        ranks = Sharded(rank, world, "127.0.0.1", port, timeout_s=120)
        try:
            value = globals()[job](ranks, *args)
        finally:
            ranks.close()
        results.put((rank, True, value))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))


# -- jobs ----------------------------------------------------------------------------


def weights(engine) -> dict[str, np.ndarray] | None:
    """The engine's parameters whole (at rank 0; None elsewhere)."""
    state = engine.ranks.full_state(engine.model)
    if not engine.ranks.lead:
        return None
    names = {spec.name for spec in engine.specs}
    return {k: v.detach().float().numpy().copy() for k, v in state.items() if k in names}


def optimizer_state(engine) -> dict[str, dict[str, np.ndarray]] | None:
    """Adam's moments and step count of every parameter, whole (at rank 0)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    state = get_optimizer_state_dict(engine.model, engine.optimizer,
                                     options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if not engine.ranks.lead:
        return None
    return {name: {k: np.asarray(v.float().numpy() if hasattr(v, "numpy") else v).copy() for k, v in s.items()}
            for name, s in state["state"].items()}


def _engine(ranks, cfg, model_path):
    from rlflow.services.trainer.torch_engine import TorchEngine

    return TorchEngine(cfg, str(model_path), ranks=ranks)


def _step(engine, frames: list[bytes]) -> dict[str, float]:
    """One step on the batch in `frames` (each rank deals it and takes its own share)."""
    from rlflow.protocol import Codec

    batch = Codec().decode(frames)
    stats, shares = engine.prepare(batch, engine.ranks.world)
    return {**stats, **engine.step(shares[engine.ranks.rank])}


def two_steps_and_a_checkpoint(ranks, cfg, model_path, frames, folder) -> dict[str, Any]:
    """Step, checkpoint into `folder`, step again: the metrics and weights after each step."""
    import pathlib

    engine = _engine(ranks, cfg, model_path)
    first = _step(engine, frames)
    after_first = weights(engine)
    engine.save(pathlib.Path(folder), {"step": 1, "version": 1})
    second = _step(engine, frames)
    return {"first": first, "after_first": after_first, "second": second, "after_second": weights(engine)}


def resume_send_and_step(ranks, cfg, folder, frames, weight_port: int, receivers: int) -> dict[str, Any]:
    """Resume from `folder`; send the weights in pieces to `receivers` (rank 0
    hosts their gloo group at `weight_port`); step again."""
    import pathlib

    from rlflow.services.weights import GlooGroup

    engine = _engine(ranks, cfg, folder)
    engine.load_state(pathlib.Path(folder))
    resumed, moments = weights(engine), optimizer_state(engine)
    group = GlooGroup("127.0.0.1", weight_port, 0, 1 + receivers, timeout_s=60) if ranks.lead else None
    engine.send(engine.snapshot(), group.broadcast if group is not None else None)
    step = _step(engine, frames)
    return {"resumed": resumed, "moments": moments, "second": step, "after_second": weights(engine),
            "specs": [(s.name, s.offset) for s in engine.specs], "nbytes": engine.nbytes}


def _critic(ranks, cfg, model_path):
    from rlflow.services.critic.torch_engine import CriticModel

    return CriticModel(cfg, str(model_path), ranks=ranks)


def critic_values_step_checkpoint_step(ranks, cfg, model_path, frames, folder) -> dict[str, Any]:
    """The critic: values, a step, a checkpoint into `folder`, another step (each rank its share)."""
    import pathlib

    from rlflow.protocol import Codec

    critic = _critic(ranks, cfg, model_path)
    batch = Codec().decode(frames)
    values = critic.values(batch)
    first = critic.step(batch)
    after_first = weights_of(critic)
    critic.save(pathlib.Path(folder), {"version": 1})
    moments = optimizer_state(critic)
    second = critic.step(batch)
    return {"values": values, "first": first, "second": second, "after_first": after_first,
            "after_second": weights_of(critic), "moments": moments}


def critic_resume_and_step(ranks, cfg, folder, frames) -> dict[str, Any]:
    """The critic resumed from `folder`: its weights, moments and step count, and one more step."""
    import pathlib

    from rlflow.protocol import Codec

    critic = _critic(ranks, cfg, folder)
    critic.load_state(pathlib.Path(folder))
    resumed, moments = weights_of(critic), optimizer_state(critic)
    critic.step(Codec().decode(frames))
    return {"resumed": resumed, "moments": moments, "steps": critic.steps - 1, "after_second": weights_of(critic)}


def weights_of(model_holder) -> dict[str, np.ndarray] | None:
    """Every parameter whole, by name (at rank 0; None elsewhere)."""
    state = model_holder.ranks.full_state(model_holder.model)
    if not model_holder.ranks.lead:
        return None
    names = {name for name, _ in model_holder.model.named_parameters()}
    return {k: v.detach().float().numpy().copy() for k, v in state.items() if k in names}


def lora_step_and_checkpoint(ranks, cfg, model_path, frames, folder) -> dict[str, Any]:
    """A LoRA step and a checkpoint: the adapter and its checksum as rank 0 would send them."""
    import pathlib

    engine = _engine(ranks, cfg, model_path)
    _step(engine, frames)
    snapshot = engine.snapshot()
    engine.save(pathlib.Path(folder), {"step": 1, "version": 1})
    return {"adapter": [t.numpy().copy() for t in snapshot] if ranks.lead else None,
            "checksum": engine.checksum(snapshot)}


def lora_resume_and_step(ranks, cfg, model_path, frames, folder) -> dict[str, Any]:
    """Resume a LoRA checkpoint (base from `model_path`, adapter and optimizer from `folder`), step again."""
    import pathlib

    from rlflow.services.trainer.torch_engine import TorchEngine

    engine = TorchEngine(cfg, str(model_path), ranks=ranks, adapter=str(pathlib.Path(folder) / "adapter"))
    engine.load_state(pathlib.Path(folder))
    resumed = engine.snapshot()
    _step(engine, frames)
    after = engine.snapshot()
    return {"resumed": [t.numpy().copy() for t in resumed], "after": [t.numpy().copy() for t in after]}
