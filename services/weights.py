"""Moving policy weights from the trainer to the rollout: the torch side.

On CPU the weights travel over a gloo process group of their own (a TCPStore
rendezvous hosted by trainer rank 0, which leaves every process's default
group alone). Every parameter has its place in one flat byte buffer (the
layout: name, dtype, shape, byte offset of each, fixed for a model and sent
once, as `ParamSpec`s); the buffer is broadcast in pieces of at most
`bucket_bytes` cut at parameter boundaries (`pieces`, as SPEC.md says), so
that neither side ever holds more than a piece or two of it. Each rollout
replica receives piece after piece and loads the views.

On GPU the weights travel over NCCL as vLLM's own `nccl` weight-transfer
backend receives them (`NcclGroup` here, rank 0; vLLM's engine on every
rollout worker): each receiver is as many NCCL ranks as it has
tensor-parallel workers (`nccl_ranks`), and the parameters go in vLLM's
packed chunks rather than rlflow's pieces (SPEC.md, *Weights*).
"""

from __future__ import annotations

import datetime
import math
import socket
from collections.abc import Callable, Iterable, Iterator
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from rlflow.protocol import ParamSpec, WeightsNccl, weights_checksum
from rlflow.services import compat

from rlflow.data.net import local_address

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


def unpack(flat: torch.Tensor, specs: list[ParamSpec], base: int = 0) -> list[tuple[str, torch.Tensor]]:
    """(name, view into `flat`) of every parameter; `flat` holds the layout's
    bytes from `base` on (a piece)."""
    out = []
    for spec in specs:
        dtype = getattr(torch, spec.dtype)
        size = math.prod(spec.shape) * dtype.itemsize
        start = spec.offset - base
        out.append((spec.name, flat[start : start + size].view(dtype).view(spec.shape)))
    return out


def tensors_checksum(specs: list[ParamSpec], tensors: Iterable[torch.Tensor]) -> str:
    """The checksum (SPEC.md, *Checksums*) of `tensors`, whole and in the layout's order."""
    return weights_checksum((s.name, s.dtype, s.shape, _bytes(t)) for s, t in zip(specs, tensors, strict=True))


def _bytes(tensor: torch.Tensor):
    return tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy()


class Piece(NamedTuple):
    """One broadcast of an update: parameters ``specs[first:stop]``, which lie
    in bytes ``[start, end)`` of the flat buffer."""

    first: int
    stop: int
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


def pieces(specs: list[ParamSpec], nbytes: int, bucket_bytes: int) -> list[Piece]:
    """The pieces an update travels in (SPEC.md, *Weights*): the layout cut at
    parameter boundaries into runs of at most `bucket_bytes` bytes (a larger
    parameter alone); 0: one piece. Together they cover ``[0, nbytes)``."""
    if not specs:
        return [Piece(0, 0, 0, nbytes)] if nbytes else []
    out, first, start = [], 0, 0
    for i in range(1, len(specs)):
        end = specs[i + 1].offset if i + 1 < len(specs) else nbytes
        if bucket_bytes and end - start > bucket_bytes:
            out.append(Piece(first, i, start, specs[i].offset))
            first, start = i, specs[i].offset
    out.append(Piece(first, len(specs), start, nbytes))
    return out


def receive_pieces(
    broadcast: Callable[[torch.Tensor], None], specs: list[ParamSpec], nbytes: int, bucket_bytes: int
) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of every parameter of one update, piece by piece as
    `broadcast` fills each (a receiver's end; one piece held at a time)."""
    for piece in pieces(specs, nbytes, bucket_bytes):
        buffer = torch.empty(piece.nbytes, dtype=torch.uint8)
        broadcast(buffer)
        yield from unpack(buffer, specs[piece.first : piece.stop], base=piece.start)


class GlooGroup:
    """A standalone gloo group; rank 0 hosts the rendezvous store at host:port.

    Creating it blocks until all `world_size` ranks have joined.
    """

    def __init__(self, host: str, port: int, rank: int, world_size: int, timeout_s: float = 600.0, *,
                 listener: socket.socket | None = None):
        """`listener`: rank 0's socket that has listened at `port` since the
        port was offered (see `compat.master_store`)."""
        timeout = datetime.timedelta(seconds=timeout_s)
        self.rank, self.world_size = rank, world_size
        self._store = compat.master_store(host, port, world_size, timeout, listener) if rank == 0 \
            else dist.TCPStore(host, port, world_size, is_master=False, timeout=timeout)
        interface = host if rank == 0 else local_address(host)
        self._group = compat.gloo_group(self._store, rank, world_size, interface, timeout_s)

    def broadcast(self, flat: torch.Tensor, root: int = 0) -> None:
        """Broadcast `flat` from `root` to every rank (blocking)."""
        group = self._group
        if group is None:
            raise RuntimeError("the weight group was let go of")
        compat.broadcast(group, flat, root)

    def close(self) -> None:
        """Let go of the group: its connections close, and peers waiting in a
        broadcast with this rank return with an error."""
        self._group = None
        self._store = None


#: Chunks vLLM's packed NCCL transfer keeps in flight (both ends must agree).
NCCL_BUFFERS = 2


class NcclRanks(NamedTuple):
    """Where a member of a `WeightsNccl` group sits among the NCCL ranks."""

    world: int
    """NCCL ranks in the group: the trainer's one and every receiver's workers."""
    offset: int
    """The member's first NCCL rank (0: the trainer); its tensor-parallel worker r is offset + r."""


def nccl_ranks(transfer: WeightsNccl) -> NcclRanks:
    """The NCCL ranks of `transfer`'s addressee (its `rank` and `world_size`
    count members; each receiver has `ranks_per_receiver` workers)."""
    per = transfer.ranks_per_receiver
    world = 1 + max(transfer.world_size - 1, 0) * per
    offset = 0 if transfer.rank == 0 else 1 + (transfer.rank - 1) * per
    return NcclRanks(world, offset)


def nccl_chunk_bytes(transfer: WeightsNccl) -> int:
    """The size of vLLM's packed chunks for `transfer`: its `bucket_bytes`, or
    (0) the whole update in one."""
    return transfer.bucket_bytes or max(transfer.nbytes, 1)


class NcclGroup:
    """NCCL rank 0 of a `WeightsNccl` group, on this process's CUDA device:
    hosts the rendezvous and sends. Creating it blocks until every receiver's
    workers have joined."""

    def __init__(self, transfer: WeightsNccl, device: torch.device | None = None, *,
                 listener: socket.socket | None = None):
        """`device`: the trainer's GPU (None: the current one). CUDA's current
        device is a per-thread setting, and both this and `send` run on
        worker threads, so it is named here and made current for each call.
        `listener`: the socket that has listened at the transfer's port since
        it was offered (see `compat.master_store`)."""
        self.chunk_bytes = nccl_chunk_bytes(transfer)
        self.device = torch.device("cuda", torch.cuda.current_device()) if device is None else device
        with torch.cuda.device(self.device):
            self._communicator: Any = compat.nccl_trainer_endpoint(transfer.host, transfer.port,
                                                                   nccl_ranks(transfer).world, listener)

    def send(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Broadcast every (name, CUDA tensor) in order, in vLLM's packed
        chunks; returns once the last chunk has left (blocking)."""
        communicator = self._communicator
        if communicator is None:
            raise RuntimeError("the weight group was let go of")
        with torch.cuda.device(self.device):
            compat.nccl_send_packed(communicator, named, self.chunk_bytes, NCCL_BUFFERS)

    def close(self) -> None:
        """Let go of the communicator."""
        communicator, self._communicator = self._communicator, None
        if communicator is not None:
            communicator.destroy()
