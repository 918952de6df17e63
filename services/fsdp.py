"""The ranks of a role that trains a torch model (`RoleSpec.stateful`):
every replica of the role in one process group, the model sharded across them
with FSDP2, bf16 passes on a CPU, checkpoints (the optimizer's shards, and
the folder a checkpoint is written into and put in place whole), and the
few collectives a step needs. Shared machinery: the roles import it from here.

One code path for CPU and GPU: the device is CUDA where there is one (a GPU
per rank, NCCL, bf16 compute with fp32 gradient reduction and fp32 master
weights through `MixedPrecisionPolicy`), else the CPU (gloo, the weights'
own dtype throughout). `Sharded` is that; `Solo` is one process with no
process group at all (tests and tools that train in the process they run
in), with the same methods, so that the engine reads the same either way.

Two facts about FSDP2 on gloo that shape this module (torch 2.13):

* gloo has no PREMUL_SUM, which FSDP2's reduce-scatter uses to divide
  gradients; `set_force_sum_reduction_for_comms` makes it a plain SUM. The
  divide factor is 1: each rank's loss is already its tokens' share of the
  whole step's token mean, so the sum over ranks is the mean. Both are
  settings of each FSDP unit, not of the root alone.
* Collectives of one process group must be issued in the same order on
  every rank. The weights for the rollout are gathered on a group of their
  own (`gather_mesh`), so that a send can run while the next step trains.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import pathlib
import random
import shutil
import warnings
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from rlflow.data.net import take_held
from rlflow.rundir import RUN_STATE
from rlflow.services import compat


def device() -> torch.device:
    """This rank's device: its GPU where there is one, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    return torch.device("cpu")


class Solo:
    """One process, no process group: every collective is the identity."""

    rank = 0
    world = 1
    lead = True

    def __init__(self) -> None:
        self.device = torch.device("cpu")

    def shard(self, model: torch.nn.Module) -> torch.nn.Module:
        return model

    def local(self, param: torch.Tensor) -> torch.Tensor:
        """The part of `param` this rank holds."""
        return param

    def full(self, local: torch.Tensor, index: int) -> torch.Tensor:
        """Parameter `index` whole, from every rank's `local` part (collective)."""
        return local

    def sum(self, values: list[float]) -> list[float]:
        return list(values)

    def max(self, value: int) -> int:
        return value

    def highest(self, values: list[float]) -> list[float]:
        """Each of `values`, the largest over every rank."""
        return list(values)

    def barrier(self) -> None:
        pass

    def broadcast_object(self, obj: Any) -> Any:
        """Rank 0's `obj` (pickled), on every rank (collective)."""
        return obj

    def gather_object(self, obj: Any) -> list[Any] | None:
        """Every rank's `obj` (pickled), in rank order, at rank 0; None elsewhere (collective)."""
        return [obj]

    def full_state(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """Every parameter and buffer whole, on the CPU, at rank 0 (collective)."""
        return model.state_dict()

    def save_optimizer(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, path: pathlib.Path) -> None:
        """The optimizer's state as a torch distributed checkpoint in `path`
        (each rank writes its shards; any number of ranks can read it)."""
        with _single_process():
            dcp.save(get_optimizer_state_dict(model, optimizer), checkpoint_id=path, no_dist=True)

    def load_optimizer(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, path: pathlib.Path) -> None:
        state = get_optimizer_state_dict(model, optimizer)
        with _single_process():
            dcp.load(state, checkpoint_id=path, no_dist=True)
        set_optimizer_state_dict(model, optimizer, state)

    def load_full_optimizer(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                            state: dict[str, Any]) -> None:
        """A whole optimizer state keyed by parameter name (every rank has it)."""
        set_optimizer_state_dict(model, optimizer, state, options=StateDictOptions(full_state_dict=True))

    def close(self) -> None:
        pass


class Sharded(Solo):
    """This process as rank `rank` of `world` trainer ranks (joins the group
    at ``address:port``, hosted by rank 0; blocks until every rank is there;
    one rank alone binds no port)."""

    def __init__(self, rank: int, world: int, address: str, port: int, *, timeout_s: float = 1800.0):
        self.rank, self.world, self.lead = rank, world, rank == 0
        self.device = device()
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.set_device(self.device)
        backend = "nccl" if cuda else "gloo"
        timeout = datetime.timedelta(seconds=timeout_s)
        if world == 1:  # meets no one: no port to bind
            store: dist.Store = dist.HashStore()
        elif rank == 0:  # over the socket the launcher has held for the port since it chose it, if it did
            store = compat.master_store(address, port, world, timeout, take_held(port))
        else:
            store = dist.TCPStore(address, port, world, is_master=False, timeout=timeout)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
        self.mesh = init_device_mesh(self.device.type, (world,))
        self.gather_mesh = DeviceMesh.from_group(dist.new_group(backend=backend), self.device.type)
        self._mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if cuda else None
        self._meta: list[tuple[Any, torch.Size, tuple[int, ...]]] = []

    def shard(self, model: torch.nn.Module) -> torch.nn.Module:
        """Each decoder layer its own FSDP unit, then the rest (embeddings, norm, head) at the root."""
        model.to(self.device)
        extra = {"mp_policy": self._mp} if self._mp is not None else {}
        blocks = set(getattr(model, "_no_split_modules", None) or ())
        for module in model.modules():
            if type(module).__name__ in blocks:
                fully_shard(module, mesh=self.mesh, **extra)
        fully_shard(model, mesh=self.mesh, **extra)
        for module in model.modules():  # each unit has its own settings
            if isinstance(module, FSDPModule):
                module.set_gradient_divide_factor(1.0)
                module.set_force_sum_reduction_for_comms(True)
        self._meta = [(p.placements, p.shape, p.stride()) for p in model.parameters()]
        return model

    def local(self, param: torch.Tensor) -> torch.Tensor:
        return param.to_local() if isinstance(param, DTensor) else param

    def full(self, local: torch.Tensor, index: int) -> torch.Tensor:
        placements, shape, stride = self._meta[index]
        return DTensor.from_local(local, self.gather_mesh, placements, run_check=False, shape=shape,
                                  stride=stride).full_tensor()

    def sum(self, values: list[float]) -> list[float]:
        tensor = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(tensor)
        return tensor.tolist()

    def max(self, value: int) -> int:
        tensor = torch.tensor([value], dtype=torch.int64, device=self.device)
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
        return int(tensor.item())

    def highest(self, values: list[float]) -> list[float]:
        tensor = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
        return tensor.tolist()

    def barrier(self) -> None:
        dist.barrier()

    def broadcast_object(self, obj: Any) -> Any:
        box = [obj if self.lead else None]
        dist.broadcast_object_list(box, src=0, device=self.device)
        return box[0]

    def gather_object(self, obj: Any) -> list[Any] | None:
        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, obj)  # one path for gloo and NCCL; what is gathered is small
        return out if self.lead else None

    def full_state(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def save_optimizer(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, path: pathlib.Path) -> None:
        dcp.save(get_optimizer_state_dict(model, optimizer), checkpoint_id=path)

    def load_optimizer(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, path: pathlib.Path) -> None:
        state = get_optimizer_state_dict(model, optimizer)
        dcp.load(state, checkpoint_id=path)
        set_optimizer_state_dict(model, optimizer, state)

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def bf16_passes(setting: bool | str, device: torch.device) -> bool:
    """Whether forward and backward passes on `device` run in bf16 over the
    weights' own dtype, under `mixed_precision = setting`: a CPU's only (on
    CUDA, FSDP's mixed precision does it), "auto" where the CPU multiplies
    bf16 itself."""
    if device.type != "cpu":
        return False
    return compat.cpu_multiplies_bf16() if setting == "auto" else bool(setting)


def autocast(bf16: bool) -> contextlib.AbstractContextManager:
    """The passes' precision: bf16 on the CPU if `bf16`, else the weights'."""
    return torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()


def rendezvous(world: int) -> tuple[str, int]:
    """Where rank 0 hosts the ranks' process group: MASTER_ADDR and MASTER_PORT,
    which the launcher sets for each role (one rank meets no one: it needs
    neither)."""
    if "MASTER_ADDR" in os.environ and "MASTER_PORT" in os.environ:
        return os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    if world == 1:
        return "127.0.0.1", 0
    raise RuntimeError("ranks meet at MASTER_ADDR:MASTER_PORT, which the launcher sets; neither is set")


@contextlib.contextmanager
def _single_process() -> Iterator[None]:
    """Quiet torch's warning that a checkpoint without a process group is
    written (or read) by one process: that is what `Solo` means."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


# -- checkpoints ---------------------------------------------------------------------

def _beside_weights(name: str) -> bool:
    """Whether a file of a model's directory goes beside a checkpoint's weights (the tokenizer's, and how
    to generate): a checkpoint reads the same tokens as the model it started from."""
    return "token" in name or name in ("generation_config.json", "vocab.json", "merges.txt")


def checkpoint_begin(folder: pathlib.Path, ranks: Solo) -> pathlib.Path:
    """The ``.tmp`` folder beside `folder` that a checkpoint is written into
    (made anew by rank 0; every rank waits for it): a folder without that
    suffix is a whole checkpoint."""
    tmp = folder.with_name(folder.name + ".tmp")
    if ranks.lead:
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
    ranks.barrier()
    return tmp


def checkpoint_end(tmp: pathlib.Path, folder: pathlib.Path, *, model_path: str, state_file: str, steps: int,
                   run_state: dict[str, Any]) -> None:
    """Rank 0 finishes the checkpoint in `tmp`, its weights written: the model's
    tokenizer files beside them, `steps` and the RNG in `state_file`, the run
    state; then `tmp` takes `folder`'s place."""
    for name in os.listdir(model_path):
        src = pathlib.Path(model_path) / name
        if _beside_weights(name) and src.is_file() and not (tmp / name).exists():
            shutil.copy(src, tmp / name)
    rng = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    torch.save({"steps": steps, "rng": rng}, tmp / state_file)
    (tmp / RUN_STATE).write_text(json.dumps(run_state, indent=1))
    if folder.exists():
        shutil.rmtree(folder)
    os.replace(tmp, folder)


def restore_rng(state: dict[str, Any]) -> None:
    """The RNG as `checkpoint_end` saved it (`state`: what it wrote into its state file)."""
    torch.set_rng_state(state["rng"]["torch"])
    np.random.set_state(state["rng"]["numpy"])
    random.setstate(state["rng"]["python"])
