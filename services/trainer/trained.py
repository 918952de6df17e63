"""What of the torch trainer's policy trains, leaves and is saved: the whole
model (`WholeWeights`), or a LoRA adapter on a frozen base
(`lora.AdapterWeights`). The engine chooses one when it starts and calls it
for every difference between the two, so that its step reads the same for
both.

Weights leave in pieces (`rlflow.services.weights.pieces`): after a step each
rank copies its shards (`snapshot`, so that training goes on); to send a
version, every rank gathers piece after piece and rank 0 broadcasts each to
the rollout while the next is gathered (`send`), or hands the gathered
parameters one by one to vLLM's packed NCCL broadcast (`send_named`).
"""

from __future__ import annotations

import pathlib
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

from rlflow.protocol import ParamSpec
from rlflow.services.fsdp import Solo
from rlflow.services.trainer.packing import Packed, column
from rlflow.services.weights import layout, pieces


class TrainedWeights:
    """The parameters of `model` (sharded over `ranks` already) that train and leave:
    those at `indices` among its parameters, under `names` in the layout
    (`specs`, `nbytes`) the receivers load them by. Whole weights unless a
    subclass says otherwise."""

    #: Whether a KL penalty's reference is the base with the adapter off (else the batch's `teacher_logprobs`).
    base_reference = False
    #: Whether every rank takes part in a send (rank 0 alone when the snapshot is whole at rank 0 already).
    gathers = True

    def __init__(self, model: torch.nn.Module, ranks: Solo, indices: Sequence[int], names: Sequence[str],
                 bucket_bytes: int) -> None:
        self.model, self.ranks = model, ranks
        self.indices = list(indices)
        params = list(model.parameters())
        self.specs: list[ParamSpec]
        self.specs, self.nbytes = layout((name, params[i]) for i, name in zip(self.indices, names))
        self.bucket_bytes = bucket_bytes

    # -- a version -------------------------------------------------------------------

    def snapshot(self) -> list[torch.Tensor]:
        """This rank's part of every parameter sent now (a copy: training goes on)."""
        with torch.no_grad():
            params = list(self.model.parameters())
            return [self.ranks.local(params[i]).detach().clone() for i in self.indices]

    def checksum(self, snapshot: list[torch.Tensor]) -> str:
        """The checksum (SPEC.md, *Checksums*) of `snapshot`; empty: not checked."""
        return ""

    def full(self, snapshot: list[torch.Tensor], j: int) -> torch.Tensor:
        """Sent parameter `j` whole (collective: every rank gathers it)."""
        return self.ranks.full(snapshot[j], self.indices[j])

    # -- sending -----------------------------------------------------------------------

    def pieces(self, snapshot: list[torch.Tensor]) -> Iterator[torch.Tensor | None]:
        """The flat buffer of `snapshot`'s weights, piece by piece, each piece
        gathered when it is asked for (every rank iterates, in step; rank 0
        gets the bytes, on the CPU, the others None)."""
        lead = self.ranks.lead
        if not (self.gathers or lead):
            return
        for piece in pieces(self.specs, self.nbytes, self.bucket_bytes):
            buffer = torch.zeros(piece.nbytes, dtype=torch.uint8) if lead else None
            for j in range(piece.first, piece.stop):
                full = self.full(snapshot, j)
                if buffer is not None:
                    data = full.detach().contiguous().reshape(-1).view(torch.uint8)
                    start = self.specs[j].offset - piece.start
                    buffer[start : start + data.numel()].copy_(data)
                del full
            yield buffer

    def named_full(self, snapshot: list[torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, whole parameter on this rank's device) of `snapshot`, in the
        layout's order, each gathered when it is asked for (every rank
        iterates, in step)."""
        if not (self.gathers or self.ranks.lead):
            return
        for j, spec in enumerate(self.specs):
            yield spec.name, self.full(snapshot, j)

    def send_named(self, snapshot: list[torch.Tensor],
                   send: Callable[[Iterator[tuple[str, torch.Tensor]]], None] | None) -> None:
        """Gather `snapshot` parameter by parameter (every rank) and hand them
        to `send` (rank 0, e.g. `NcclGroup.send`; None: gather only)."""
        named = self.named_full(snapshot)
        if send is None:
            for _ in named:
                pass
            return
        try:
            send(named)
        finally:
            for _ in named:  # a failed send: the other ranks are gathering still
                pass

    def send(self, snapshot: list[torch.Tensor], broadcast: Callable[[torch.Tensor], None] | None) -> None:
        """Gather `snapshot` piece by piece (every rank) and hand each piece to
        `broadcast` (rank 0; None: gather only), gathering the next piece while
        the last is broadcast: at most two pieces are held at once.

        A failed broadcast stops the broadcasting, not the gathering (the other
        ranks are gathering too); it is raised at the end."""
        failure: BaseException | None = None
        with ThreadPoolExecutor(1, thread_name_prefix="weights-out") as pool:
            sending: Future | None = None
            for piece in self.pieces(snapshot):
                if sending is not None:
                    failure = failure or sending.exception()
                    sending = None
                if broadcast is not None and failure is None:
                    sending = pool.submit(broadcast, piece)
            if sending is not None:
                failure = failure or sending.exception()
        if failure is not None:
            raise failure

    # -- a KL penalty's reference ---------------------------------------------------------

    def reference_rows(self, rows: list) -> list[np.ndarray]:
        """The reference's log-probabilities of every sample's response tokens (its `teacher_logprobs`)."""
        return [r.teacher_logprobs for r in rows]

    def reference(self, part: list, packed: Packed, keep: torch.Tensor | None) -> torch.Tensor:
        """The reference's log-probabilities of the tokens of a pass over `part` trained on
        (`packed` as the pass packed them, `keep` applied): the batch's `teacher_logprobs`."""
        return column(part, "teacher_logprobs", keep).to(self.ranks.device)

    def idle_reference(self, ids: torch.Tensor) -> None:
        """What an idle pass does first to pair with a real pass's reference (nothing: the batch's is read)."""

    # -- checkpoints --------------------------------------------------------------------

    def save(self, folder: pathlib.Path, model_path: str, dtype: torch.dtype) -> bool:
        """Write the weights into `folder` (every rank takes part): a Hugging Face model
        directory. Whether this rank writes the rest of the checkpoint (rank 0)."""
        weights = self.ranks.full_state(self.model)
        if not self.ranks.lead:
            return False
        self.model.save_pretrained(folder, state_dict=weights, safe_serialization=True)
        return True


class WholeWeights(TrainedWeights):
    """Every parameter of `model` (as loaded; sharded over `ranks` here) trains and leaves under its own name."""

    def __init__(self, model: torch.nn.Module, ranks: Solo, bucket_bytes: int) -> None:
        model = ranks.shard(model)
        names = [n for n, _ in model.named_parameters()]
        super().__init__(model, ranks, range(len(names)), names, bucket_bytes)
