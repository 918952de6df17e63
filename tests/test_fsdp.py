"""The trainer sharded over ranks (FSDP2 over gloo on loopback, one real
process per rank): a step on 2 ranks is the step on 1, checkpoints resume
on another number of ranks, and the weights leave in pieces."""

from __future__ import annotations

import threading

import msgspec
import numpy as np
import pytest
import torch
from models import tiny_model
from ranks import run_ranks
from rlflow.protocol import Codec
from rlflow.services.trainer.torch_engine import TorchEngine
from rlflow.services.weights import GlooGroup, pieces, receive_pieces
from test_trainer import fixed_batch

from rlflow.config import TorchTrainer
from rlflow.data.net import free_port

#: Two micro-batches per rank; weights in several pieces. A small learning
#: rate: Adam's first step is about lr x sign(gradient), so a gradient that
#: is zero but for rounding could move a weight by lr either way.
CFG = TorchTrainer(lr=1e-4, micro_batch_tokens=24, bucket_bytes=64 << 10)
TOL = 1e-5

# Timeout: the fixtures that start the ranks took 72-156 s on a loaded 2-core machine.
pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]  # process groups of several ranks


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp("fsdp") / "model", tied=False, seed=5)


@pytest.fixture(scope="module")
def frames(model_path):
    """A step's batch as wire frames (what the ranks' processes get)."""
    batch = fixed_batch(TorchEngine(CFG, str(model_path)))
    return [bytes(f) for f in Codec().encode(batch)]


@pytest.fixture(scope="module")
def solo(model_path, frames):
    """Two steps by the one-process trainer, as before sharding."""
    engine = TorchEngine(CFG, str(model_path))
    batch = Codec().decode(frames)
    first = engine.train(batch)
    after_first = {n: p.detach().numpy().copy() for n, p in engine.model.named_parameters()}
    second = engine.train(batch)
    after_second = {n: p.detach().numpy().copy() for n, p in engine.model.named_parameters()}
    return {"first": first, "after_first": after_first, "second": second, "after_second": after_second}


@pytest.fixture(scope="module")
def sharded(model_path, frames, tmp_path_factory):
    """Two steps with a checkpoint between them, on 1 rank and on 2 ranks."""
    out = {}
    for world in (1, 2):
        folder = tmp_path_factory.mktemp(f"ranks{world}") / "step-000001"
        (out[world],) = run_ranks("two_steps_and_a_checkpoint", world, CFG, model_path, frames, folder)[:1]
        out[world]["folder"] = folder
    return out


def same_weights(a: dict[str, np.ndarray], b: dict[str, np.ndarray], tol: float = TOL) -> None:
    assert a.keys() == b.keys()
    for name in a:
        np.testing.assert_allclose(a[name], b[name], atol=tol, rtol=0, err_msg=name)


def test_a_step_on_two_ranks_is_the_step_on_one(solo, sharded):
    one, two = sharded[1], sharded[2]
    for run in (one, two):
        for step in ("first", "second"):
            for key in ("loss", "grad_norm", "trained_tokens", "clipped_share", "behaviour_kl"):
                assert run[step][key] == pytest.approx(solo[step][key], abs=TOL), (step, key)
        same_weights(run["after_first"], solo["after_first"])
        same_weights(run["after_second"], solo["after_second"])
    # The weights did move, by far more than the tolerance.
    assert max(np.abs(solo["after_first"][n] - solo["after_second"][n]).max() for n in solo["after_first"]) > 5e-5


def test_ranks_with_unequal_shares_take_the_same_step(model_path, frames, tmp_path):
    """7 samples, one per micro-batch: a rank of 4 passes and one of 3, which
    makes an idle pass so that their collectives pair up."""
    from rlflow.protocol import take

    cfg = msgspec.structs.replace(CFG, micro_batch_tokens=12)
    odd = [bytes(f) for f in Codec().encode(take(Codec().decode(frames), list(range(7))))]
    engine = TorchEngine(cfg, str(model_path))
    expected = engine.train(Codec().decode(odd))
    (two,) = run_ranks("two_steps_and_a_checkpoint", 2, cfg, model_path, odd, tmp_path / "step-000001")[:1]
    assert two["first"]["micro_batches"] == 4 and expected["micro_batches"] == 7
    assert two["first"]["loss"] == pytest.approx(expected["loss"], abs=TOL)
    assert two["first"]["grad_norm"] == pytest.approx(expected["grad_norm"], abs=TOL)
    same_weights(two["after_first"], {n: p.detach().numpy() for n, p in engine.model.named_parameters()})


def test_the_checkpoint_is_a_hugging_face_model(sharded):
    from transformers import AutoModelForCausalLM

    folder = sharded[2]["folder"]
    model = AutoModelForCausalLM.from_pretrained(folder)
    same_weights({n: p.detach().numpy() for n, p in model.named_parameters()}, sharded[2]["after_first"], 0)
    assert (folder / "optimizer").is_dir() and (folder / "tokenizer.json").exists()


@pytest.mark.parametrize(("saved", "resumed"), [(2, 1), (1, 2)])
def test_a_checkpoint_resumes_on_another_number_of_ranks(saved, resumed, sharded, frames, model_path):
    """Same weights, same Adam moments, same next step; and the resumed
    trainer's weights reach a receiver in pieces."""
    run = sharded[saved]
    specs, nbytes = layout_of(model_path)
    port = free_port("127.0.0.1")
    received: dict[str, np.ndarray] = {}

    def receive() -> None:
        # A rollout replica's end of the weight group: one update, piece by piece.
        group = GlooGroup("127.0.0.1", port, 1, 2, timeout_s=60)
        for name, tensor in receive_pieces(lambda piece: group.broadcast(piece, root=0), specs, nbytes,
                                           CFG.bucket_bytes):
            received[name] = tensor.numpy().copy()

    receiver = threading.Thread(target=receive, daemon=True)
    receiver.start()
    try:
        out = run_ranks("resume_send_and_step", resumed, CFG, run["folder"], frames, port, 1)[0]
    finally:
        receiver.join(60)
    assert not receiver.is_alive()
    same_weights(out["resumed"], run["after_first"], 0)
    moments = out["moments"]
    assert moments.keys() == run["after_first"].keys()
    assert all(float(m["step"]) == 1 and np.abs(m["exp_avg_sq"]).max() > 0 for m in moments.values())
    same_weights(received, run["after_first"], 0)
    assert out["second"]["loss"] == pytest.approx(run["second"]["loss"], abs=TOL)
    assert out["second"]["grad_norm"] == pytest.approx(run["second"]["grad_norm"], abs=TOL)
    same_weights(out["after_second"], run["after_second"])


def layout_of(model_path) -> tuple[list, int]:
    engine = TorchEngine(CFG, str(model_path))
    return engine.specs, engine.nbytes


def test_weights_leave_in_pieces_of_at_most_the_bucket(model_path):
    engine = TorchEngine(CFG, str(model_path))
    parts = pieces(engine.specs, engine.nbytes, CFG.bucket_bytes)
    assert len(parts) > 1
    assert parts[0].start == 0 and parts[-1].end == engine.nbytes and parts[-1].stop == len(engine.specs)
    assert all(a.end == b.start and a.stop == b.first for a, b in zip(parts, parts[1:]))
    for part in parts:
        assert part.start == engine.specs[part.first].offset
        assert part.nbytes <= CFG.bucket_bytes or part.stop - part.first == 1
    assert pieces(engine.specs, engine.nbytes, 0) == [(0, len(engine.specs), 0, engine.nbytes)]
    # What the engine hands out, piece by piece, received piece by piece: the model's weights.
    sent = iter(engine.pieces(engine.snapshot()))
    back = dict(receive_pieces(lambda buf: buf.copy_(next(sent)), engine.specs, engine.nbytes, CFG.bucket_bytes))
    for name, param in engine.model.named_parameters():
        assert torch.equal(back[name], param.detach())
