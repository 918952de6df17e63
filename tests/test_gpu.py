"""The CUDA path: weights over NCCL into a real vLLM CUDA engine, checked
against a Hugging Face forward, and the FSDP2 trainer's step on a GPU.

Skipped without a CUDA device (and the NCCL test without two: NCCL refuses
two ranks of one group on the same GPU). `bench/gpu_check.sh` runs them
with ``pytest -m gpu``.
"""

from __future__ import annotations

import threading

import msgspec
import numpy as np
import pytest
import torch
import trio
from models import tiny_model

from rlflow.config import TorchTrainer, VllmRollout
from rlflow.data.net import free_port
from rlflow.protocol import WeightsNccl

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(GPUS == 0,
                       reason="no CUDA device: the CUDA path is proved by bench/gpu_check.sh on a GPU machine"),
]

PROMPT_IDS = [5, 9, 4, 7, 12, 3, 8, 6, 10, 4, 11]


def _perturbed(path, seed: int):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=generator) * 0.5 * p.std().clamp(min=0.02))
    return model


def _hf_prompt_logprobs(model, ids: list[int], device) -> np.ndarray:
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids], device=device)).logits[0].float()
    logp = torch.log_softmax(logits, -1)
    return logp[torch.arange(len(ids) - 1), torch.tensor(ids[1:], device=device)].cpu().numpy()


def _vllm_prompt_logprobs(backend, ids: list[int]) -> np.ndarray:
    rows = trio.run(backend.prompt_logprobs, ids, 1)
    return np.array([rows[i][ids[i]].logprob for i in range(1, len(ids))])


@pytest.mark.skipif(GPUS == 1, reason="NCCL needs the trainer and the vLLM engine on two different GPUs")
@pytest.mark.parametrize("bucket_bytes", [0, 64 << 10])
def test_nccl_broadcast_into_vllm_matches_hugging_face(tmp_path, bucket_bytes):
    from rlflow.services.vllm_client import NCCL, VllmBackend
    from rlflow.services.weights import NcclGroup, layout

    path = tiny_model(tmp_path / "model", tied=False, seed=3)
    cfg = VllmRollout(max_num_seqs=8, max_tokens=16, kv_cache_bytes=64 << 20, gpu_memory_utilization=0.2)
    backend = VllmBackend(cfg, str(path), seed=0, weights=NCCL)
    backend.start_blocking()  # the engine's worker takes the first visible GPU
    trainer_device = torch.device("cuda", 1)
    try:
        model = _perturbed(path, seed=5).to(trainer_device)
        specs, nbytes = layout(model.named_parameters())
        offer = WeightsNccl(host="127.0.0.1", port=free_port("127.0.0.1"), world_size=2, nbytes=nbytes,
                            bucket_bytes=bucket_bytes)
        box: dict = {}
        host = threading.Thread(target=lambda: box.setdefault("group", NcclGroup(offer, trainer_device)))
        host.start()
        trio.run(backend.join_nccl, msgspec.structs.replace(offer, rank=1))
        host.join(timeout=120)
        group = box["group"]
        try:
            named = [(name, p.detach()) for name, p in model.named_parameters()]
            sender = threading.Thread(target=group.send, args=(named,))
            sender.start()
            trio.run(lambda: backend.update(1, specs, nbytes, bucket_bytes=bucket_bytes))
            sender.join(timeout=120)
            got = _vllm_prompt_logprobs(backend, PROMPT_IDS)
            want = _hf_prompt_logprobs(model, PROMPT_IDS, trainer_device)
            np.testing.assert_allclose(got, want, atol=2e-3)
        finally:
            group.close()
    finally:
        backend.close()


def test_fsdp2_trainer_step_on_cuda(tmp_path):
    from test_trainer import fixed_batch

    from rlflow.services.fsdp import Sharded
    from rlflow.services.trainer.torch_engine import TorchEngine

    path = tiny_model(tmp_path / "model", tied=False, seed=1)
    cfg = TorchTrainer(lr=1e-4, micro_batch_tokens=24)
    cpu = TorchEngine(cfg, str(path))
    batch = fixed_batch(cpu)
    cpu_stats = cpu.train(batch)
    ranks = Sharded(0, 1, "127.0.0.1", free_port("127.0.0.1"), timeout_s=120)
    try:
        assert ranks.device.type == "cuda"
        engine = TorchEngine(cfg, str(path), ranks=ranks)
        before = [t.float().cpu() for t in engine.snapshot()]
        stats, (share,) = engine.prepare(batch, 1)
        stats.update(engine.step(share))
        assert np.isfinite(stats["loss"]) and np.isfinite(stats["grad_norm"]) and stats["grad_norm"] > 0
        # bf16 compute on the GPU, fp32 on the CPU: the same step, up to bf16's precision.
        assert abs(stats["loss"] - cpu_stats["loss"]) < 0.05 * max(1.0, abs(cpu_stats["loss"]))
        after = engine.snapshot()
        assert all(a.is_cuda for a in after)
        assert any(not torch.equal(b, a.float().cpu()) for b, a in zip(before, after))
        # What rank 0 would hand to the NCCL broadcast: whole parameters, as the layout says.
        got = list(engine.named_full(after))
        assert [(n, str(t.dtype).removeprefix("torch."), list(t.shape)) for n, t in got] == [
            (s.name, s.dtype, list(s.shape)) for s in engine.specs
        ]
    finally:
        ranks.close()
