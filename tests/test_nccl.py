"""The CUDA weight path, as far as it can be checked without a GPU: which
transfer the trainer offers on which device, the NCCL ranks of receivers
with tensor parallelism, the init and update info handed to vLLM's `nccl`
backend (accepted by vLLM's own dataclasses), the chunks vLLM's packed
producer cuts (as SPEC.md describes them), and a new generation of the
group. The broadcast itself runs in `test_gpu.py`."""

from __future__ import annotations

import types

import msgspec
import pytest
import torch

from rlflow.protocol import ParamSpec, WeightsGloo, WeightsNccl
from rlflow.services.weights import NcclRanks, layout, nccl_chunk_bytes, nccl_ranks


def test_the_trainer_offers_gloo_on_cpu_and_nccl_on_cuda():
    from rlflow.services.trainer.torch_trainer import weight_offer

    cpu = weight_offer("cpu", "10.0.0.2", 29500, 4096, 1024, ranks_per_receiver=2)
    assert cpu == WeightsGloo(host="10.0.0.2", port=29500, nbytes=4096, bucket_bytes=1024)
    cuda = weight_offer("cuda", "10.0.0.2", 29500, 4096, 1024, ranks_per_receiver=2)
    assert cuda == WeightsNccl(host="10.0.0.2", port=29500, nbytes=4096, bucket_bytes=1024, ranks_per_receiver=2)


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("replicas", [1, 3])
def test_every_worker_of_every_replica_has_its_own_nccl_rank(tp, replicas):
    offer = WeightsNccl(host="h", port=1, world_size=1 + replicas, ranks_per_receiver=tp)
    assert nccl_ranks(offer) == NcclRanks(world=1 + replicas * tp, offset=0)
    taken = [0]
    for member in range(1, replicas + 1):
        ranks = nccl_ranks(msgspec.structs.replace(offer, rank=member))
        assert ranks.world == 1 + replicas * tp
        # vLLM's worker joins at rank_offset + its rank within the replica (tp, no data parallel).
        taken += [ranks.offset + r for r in range(tp)]
    assert taken == list(range(1 + replicas * tp))


def test_the_chunk_size_is_the_bucket_or_the_whole_update():
    assert nccl_chunk_bytes(WeightsNccl(host="h", port=1, nbytes=4096, bucket_bytes=1024)) == 1024
    assert nccl_chunk_bytes(WeightsNccl(host="h", port=1, nbytes=4096)) == 4096


def _layout() -> list[ParamSpec]:
    named = [("embed.weight", torch.zeros(16, 8)), ("norm.weight", torch.zeros(8, dtype=torch.bfloat16)),
             ("proj.weight", torch.zeros(8, 8)), ("head.bias", torch.zeros(3))]
    return layout(named)[0]


@pytest.mark.slow  # imports vLLM
def test_vllm_accepts_the_init_and_update_info():
    from vllm.distributed.weight_transfer.nccl_common import NCCLWeightTransferInitInfo
    from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferUpdateInfo

    from rlflow.services.vllm_client import nccl_init_info, nccl_update_info

    specs = _layout()
    transfer = WeightsNccl(host="10.0.0.2", port=29500, world_size=3, rank=2, nbytes=4096, bucket_bytes=1024,
                           ranks_per_receiver=2)
    init = NCCLWeightTransferInitInfo(**nccl_init_info(transfer))
    assert (init.master_address, init.master_port, init.rank_offset, init.world_size) == ("10.0.0.2", 29500, 3, 5)
    assert init.packed and init.packed_buffer_size_bytes == 1024 and init.packed_num_buffers == 2
    update = NCCLWeightTransferUpdateInfo(**nccl_update_info(specs))
    assert update.names == [s.name for s in specs]
    assert [getattr(torch, d) for d in update.dtype_names] == [torch.float32, torch.bfloat16, torch.float32,
                                                               torch.float32]
    assert update.shapes == [[16, 8], [8], [8, 8], [3]]


def spec_chunks(sizes: list[int], chunk_bytes: int) -> list[list[int]]:
    """The chunks as SPEC.md says: a chunk takes parameters until its size
    exceeds the chunk size."""
    out, current, total = [], [], 0
    for i, size in enumerate(sizes):
        current.append(i)
        total += size
        if total > chunk_bytes:
            out.append(current)
            current, total = [], 0
    return out + ([current] if current else [])


@pytest.mark.parametrize("bucket", [0, 1, 64, 300, 600, 10_000])
def test_vllms_packed_chunks_are_what_the_spec_says(bucket):
    from vllm.distributed.weight_transfer.packed_tensor import pack_tensors

    named = [("embed.weight", torch.randn(16, 8)), ("norm.weight", torch.randn(8).to(torch.bfloat16)),
             ("proj.weight", torch.randn(8, 8)), ("head.bias", torch.randn(3))]
    specs, nbytes = layout(named)
    chunk = nccl_chunk_bytes(WeightsNccl(host="h", port=1, nbytes=nbytes, bucket_bytes=bucket))
    items, got = iter(named), []
    with pytest.warns(UserWarning) if 0 < bucket < 512 else _nothing():  # vLLM warns of a parameter over the chunk
        while (packed := pack_tensors(items, lambda item: item[1], chunk)) is not None:
            got.append(packed)
    sizes = [t.numel() * t.element_size() for _, t in named]
    assert [[named.index((n, dict(named)[n])) for n in c.names] for c in got] == spec_chunks(sizes, chunk)
    # Each chunk is its parameters' bytes, back to back, no padding.
    flat = torch.cat([c.packed_tensor for c in got])
    assert torch.equal(flat, torch.cat([t.contiguous().view(-1).view(torch.uint8) for _, t in named]))
    if bucket == 0:
        assert len(got) == 1


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_the_rollout_refuses_a_transfer_its_backend_cannot_receive():
    from rlflow.services.rollout.vllm_engine import NCCL, check_offer
    from rlflow.services.rollout.vllm_worker import BACKEND

    gloo, nccl = WeightsGloo(host="h", port=1), WeightsNccl(host="h", port=1)
    check_offer(BACKEND, gloo)
    check_offer(NCCL, nccl)
    with pytest.raises(ValueError, match="on CPU .gloo. receives weights as WeightsGloo"):
        check_offer(BACKEND, nccl)
    with pytest.raises(ValueError, match="on CUDA .* receives weights as WeightsNccl"):
        check_offer(NCCL, gloo)


def test_a_new_generation_of_an_nccl_group_keeps_its_shape():
    from rlflow.services.trainer.torch_trainer import TorchTrainerEngine

    # What the controller asks for (its offer with a new generation and size) ...
    offer = WeightsNccl(host="127.0.0.1", port=29500, nbytes=4096, bucket_bytes=1024, ranks_per_receiver=2)
    asked = msgspec.structs.replace(offer, world_size=3, port=0, generation=2)
    # ... and what the trainer hosts: a port of its own, the rest kept.
    trainer = types.SimpleNamespace(host="127.0.0.1", _listener=None, engine=types.SimpleNamespace(
        nbytes=4096, cfg=types.SimpleNamespace(bucket_bytes=1024)))
    hosted = TorchTrainerEngine.new_group(trainer, asked)
    try:
        assert isinstance(hosted, WeightsNccl) and hosted.port > 0
        assert trainer._listener.getsockname()[1] == hosted.port  # held from now on, for the group's store
        assert msgspec.structs.replace(hosted, port=0) == asked
        assert nccl_ranks(hosted).world == 5
    finally:
        trainer._listener.close()
