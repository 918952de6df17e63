"""Moving policy weights from the trainer to the rollout: the torch side.

On CPU the weights travel over a gloo process group of their own (a TCPStore
rendezvous hosted by trainer rank 0, which leaves every process's default
group alone): the trainer packs all parameters into one flat byte buffer
and broadcasts it once; each rollout replica receives it into a buffer of
the same layout and loads the views. On GPU, vLLM's NCCL engine does the
same over NCCL (see `rlflow.services.rollout.vllm_engine`).

The layout (name, dtype, shape, byte offset of every parameter) is fixed for
a model; it travels with each update as `ParamSpec`s.
"""

from __future__ import annotations

import datetime
import math
from collections.abc import Iterable

import torch
import torch.distributed as dist

from rlflow.data.net import local_address
from rlflow.protocol import ParamSpec
from rlflow.services import compat

#: Parameters start at multiples of this many bytes in the flat buffer.
ALIGN = 64


def layout(named: Iterable[tuple[str, torch.Tensor]]) -> tuple[list[ParamSpec], int]:
    """Where each parameter goes in the flat buffer, and the buffer's size."""
    specs, offset = [], 0
    for name, tensor in named:
        dtype = str(tensor.dtype).removeprefix("torch.")
        specs.append(ParamSpec(name=name, dtype=dtype, shape=list(tensor.shape), offset=offset))
        offset += -(-tensor.numel() * tensor.element_size() // ALIGN) * ALIGN
    return specs, offset


def pack(named: Iterable[tuple[str, torch.Tensor]], specs: list[ParamSpec], nbytes: int) -> torch.Tensor:
    """One uint8 buffer holding every parameter (a copy: the trainer may go on)."""
    flat = torch.empty(nbytes, dtype=torch.uint8)
    for (name, tensor), spec in zip(named, specs):
        if name != spec.name:
            raise ValueError(f"parameter {name!r} where the layout has {spec.name!r}")
        data = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
        flat[spec.offset : spec.offset + data.numel()].copy_(data)
    return flat


def unpack(flat: torch.Tensor, specs: list[ParamSpec]) -> list[tuple[str, torch.Tensor]]:
    """(name, view into `flat`) of every parameter."""
    out = []
    for spec in specs:
        dtype = getattr(torch, spec.dtype)
        size = math.prod(spec.shape) * dtype.itemsize
        out.append((spec.name, flat[spec.offset : spec.offset + size].view(dtype).view(spec.shape)))
    return out


class GlooGroup:
    """A standalone gloo group; rank 0 hosts the rendezvous store at host:port.

    Creating it blocks until all `world_size` ranks have joined.
    """

    def __init__(self, host: str, port: int, rank: int, world_size: int, timeout_s: float = 600.0):
        timeout = datetime.timedelta(seconds=timeout_s)
        self.rank, self.world_size = rank, world_size
        self._store = dist.TCPStore(host, port, world_size, is_master=rank == 0, timeout=timeout, wait_for_workers=False)
        interface = host if rank == 0 else local_address(host)
        self._group = compat.gloo_group(self._store, rank, world_size, interface, timeout_s)

    def broadcast(self, flat: torch.Tensor, root: int = 0) -> None:
        """Broadcast `flat` from `root` to every rank (blocking)."""
        compat.broadcast(self._group, flat, root)
