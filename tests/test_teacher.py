"""The teacher for real: a frozen model's scores equal a Hugging Face forward,
a sample it cannot score fails in-band, the trainer's distillation and KL
terms are what they claim, and configs that disagree are refused."""

from __future__ import annotations

import json
import pathlib

import msgspec
import numpy as np
import pytest
import torch
import trio
from models import tiny_model

from rlflow import config as C
from rlflow.algo.losses import kl_to_reference, logprobs_at, topk_reverse_kl
from rlflow.protocol import FinishReason, PromptGroup, Response, Tensor, build_batch, samples
from rlflow.services.base import standalone_context
from rlflow.services.teacher.torch_engine import TorchTeacherEngine, load_teacher

ROOT = pathlib.Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def teacher_path(tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp("teacher") / "model", tied=False, seed=21)


def config_for(teacher: pathlib.Path, *overrides: str) -> C.Config:
    return C.build({
        "pools": {"p": {}},
        "roles": {
            "rollout": {"pool": "p", "model": str(teacher), "engine": {"kind": "vllm", "temperature": 0.7}},
            "reward": {"pool": "p"},
            "teacher": {"pool": "p",
                        "engine": {"kind": "model", "model": str(teacher), "top_k": 4, "batch_tokens": 40}},
            "trainer": {"pool": "p", "engine": {"kind": "torch"}},
        },
    }, overrides=overrides)


def random_batch(groups: int = 3, n: int = 3, seed: int = 0, lengths=(2, 9)):
    rng = np.random.default_rng(seed)
    items = []
    for g in range(groups):
        responses = []
        for _ in range(n):
            t = int(rng.integers(*lengths))
            ids = rng.integers(3, 17, t).astype(np.int32)
            responses.append(Response(ids, -rng.random(t).astype(np.float32), np.zeros(t, np.int32), FinishReason.STOP))
        prompt = [int(x) for x in rng.integers(3, 17, int(rng.integers(2, 6)))]
        items.append((PromptGroup(group_id=g, prompt_ids=prompt, n=n), responses))
    return build_batch(items)


def hf_logsoftmax(model, prompt: np.ndarray, response: np.ndarray, temperature: float) -> torch.Tensor:
    """log-softmax(logits / T) at each response position, one sample, no padding."""
    ids = torch.from_numpy(np.concatenate([prompt, response]).astype(np.int64))[None]
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].float() / temperature
    positions = torch.arange(len(prompt) - 1, len(prompt) - 1 + len(response))
    return torch.log_softmax(logits[positions], -1)


@pytest.mark.parametrize("logit_rows", [1024, 5])  # the logits of a pass at once, or in small pieces
async def test_teacher_scores_equal_a_float32_forward_and_its_top_k(teacher_path, logit_rows, monkeypatch):
    from rlflow.services.teacher import torch_engine

    monkeypatch.setattr(torch_engine, "LOGIT_ROWS", logit_rows)
    config = config_for(teacher_path)
    engine = TorchTeacherEngine(config.roles.teacher.engine, standalone_context(config, "teacher"))
    await engine.start()
    batch = random_batch()
    with trio.fail_after(60):
        scores = await engine.score(batch)
    reference = load_teacher(str(teacher_path))
    errors = []
    for row in samples(batch):
        a, b = batch.response_offsets.numpy()[row.row : row.row + 2]
        full = hf_logsoftmax(reference, row.prompt_ids, row.response_ids, 0.7)
        expected = full[torch.arange(len(row.response_ids)), torch.from_numpy(row.response_ids.astype(np.int64))]
        errors.append(np.abs(scores.logprobs[a:b] - expected.numpy()))
        values, indices = torch.topk(full, 4, dim=-1)
        assert np.array_equal(scores.topk_ids[a:b], indices.numpy())
        assert np.abs(scores.topk_logprobs[a:b] - values.numpy()).max() < 1e-4
    assert float(np.concatenate(errors).mean()) < 1e-3
    assert scores.failed == {}


async def test_a_sample_longer_than_the_teachers_context_fails_in_band(teacher_path):
    config = config_for(teacher_path)
    engine = TorchTeacherEngine(config.roles.teacher.engine, standalone_context(config, "teacher"))
    with trio.fail_after(120):
        await engine.start()
    batch = random_batch(groups=2, n=2, lengths=(3, 5))
    rows = list(samples(batch))
    long = Response(np.full(600, 5, np.int32), np.zeros(600, np.float32), np.zeros(600, np.int32), FinishReason.LENGTH)
    items = [(PromptGroup(group_id=9, prompt_ids=[3, 4], n=1), [long])]
    items += [(PromptGroup(group_id=r.group.group_id, prompt_ids=r.prompt_ids.tolist(), n=1),
               [Response(r.response_ids, r.logprobs, r.versions, r.finish_reason)]) for r in rows]
    with trio.fail_after(120):
        scores = await engine.score(build_batch(items))
    assert list(scores.failed) == [0] and scores.failed[0][0] == "too_long"
    assert np.isnan(scores.logprobs[:600]).all() and not np.isnan(scores.logprobs[600:]).any()


# -- the trainer's teacher terms --------------------------------------------------------------


def test_the_topk_distillation_gradient_matches_a_direct_computation():
    torch.manual_seed(0)
    logits = torch.randn(5, 11, requires_grad=True)
    ids = torch.stack([torch.randperm(11)[:4] for _ in range(5)])
    teacher = torch.log_softmax(torch.randn(5, 11), -1).gather(-1, ids)
    ours = topk_reverse_kl(logprobs_at(logits, ids, 0.8), teacher).sum()
    (grad_ours,) = torch.autograd.grad(ours, logits)
    # Directly: the student's distribution over the teacher's top-k set, from a full softmax.
    p = torch.softmax(logits / 0.8, -1).gather(-1, ids)
    p = p / p.sum(-1, keepdim=True)
    q = teacher.exp() / teacher.exp().sum(-1, keepdim=True)
    direct = (p * (p.log() - q.log())).sum()
    (grad_direct,) = torch.autograd.grad(direct, logits)
    assert torch.allclose(ours, direct, atol=1e-6) and torch.allclose(grad_ours, grad_direct, atol=1e-6)
    assert float(ours.detach()) >= 0


def test_kl_estimators():
    logp, ref = torch.tensor([-1.0, -2.0]), torch.tensor([-1.5, -1.0])
    assert torch.allclose(kl_to_reference(logp, ref, "k1"), torch.tensor([0.5, -1.0]))
    k3 = kl_to_reference(logp, ref, "k3")
    assert torch.allclose(k3, torch.exp(ref - logp) - 1 - (ref - logp)) and (k3 >= 0).all()
    with pytest.raises(ValueError, match="unknown KL estimator"):
        kl_to_reference(logp, ref, "k2")


def teacher_batch(student, teacher_model, seed: int = 0, top_k: int = 4, groups: int = 2):
    """Samples drawn from the student, scored by the teacher (as the pipeline would)."""
    from rlflow.services.teacher.torch_engine import score_sequences

    rng = np.random.default_rng(seed)
    torch.manual_seed(seed)
    items = []
    for g in range(groups):
        prompt = [int(x) for x in rng.integers(3, 17, 4)]
        with torch.no_grad():
            out = student.generate(torch.tensor([prompt] * 8), do_sample=True, max_new_tokens=8, top_k=0,
                                   min_new_tokens=8, pad_token_id=0)
        responses = [Response(o[len(prompt):].numpy().astype(np.int32), np.zeros(8, np.float32),
                              np.zeros(8, np.int32), FinishReason.LENGTH) for o in out]
        items.append((PromptGroup(group_id=g, prompt_ids=prompt, n=8), responses))
    batch = build_batch(items)
    rows = list(samples(batch))
    behaviour = score_sequences(student, [r.prompt_ids for r in rows], [r.response_ids for r in rows],
                                temperature=1.0, top_k=0, batch_tokens=4096).logprobs
    scored = score_sequences(teacher_model, [r.prompt_ids for r in rows], [r.response_ids for r in rows],
                             temperature=1.0, top_k=top_k, batch_tokens=4096)
    return msgspec.structs.replace(
        batch,
        logprobs=Tensor.from_numpy(behaviour),
        rewards=Tensor.of([float(i % 2) for i in range(batch.n_samples)], "float32"),
        teacher_logprobs=Tensor.from_numpy(scored.logprobs),
        teacher_topk_ids=Tensor.from_numpy(scored.topk_ids),
        teacher_topk_logprobs=Tensor.from_numpy(scored.topk_logprobs),
    )


def full_reverse_kl(student, teacher, batch) -> float:
    """KL(student || teacher) of the whole next-token distributions, averaged
    over the response positions of `batch` (what distillation lowers)."""
    total, count = 0.0, 0
    for row in samples(batch):
        s = hf_logsoftmax(student, row.prompt_ids, row.response_ids, 1.0)
        t = hf_logsoftmax(teacher, row.prompt_ids, row.response_ids, 1.0)
        total += float((s.exp() * (s - t)).sum())
        count += len(row.response_ids)
    return total / count


@pytest.mark.slow
@pytest.mark.parametrize("form", ["sampled", "topk"])
def test_distillation_alone_brings_the_student_towards_the_teacher(teacher_path, tmp_path, form):
    from rlflow.services.trainer.torch_engine import TorchEngine

    student = tiny_model(tmp_path / "student", tied=False, seed=5)
    engine = TorchEngine(C.TorchTrainer(lr=3e-3, distill_coef=1.0, distill=form), str(student))
    teacher = load_teacher(str(teacher_path))
    held = teacher_batch(engine.model, teacher, seed=99)
    before = full_reverse_kl(engine.model, teacher, held)
    for step in range(12):
        engine.train(teacher_batch(engine.model, teacher, seed=step, groups=6))
    after = full_reverse_kl(engine.model, teacher, held)
    assert after < 0.8 * before, (before, after)


def test_a_kl_penalty_in_the_loss_or_the_reward_keeps_the_policy_near_the_reference(teacher_path):
    from rlflow.services.trainer.torch_engine import TorchEngine

    for where in ("loss", "reward"):
        engine = TorchEngine(C.TorchTrainer(lr=3e-3, kl_coef=0.5, kl_in=where), str(teacher_path))
        reference = load_teacher(str(teacher_path))
        stats = engine.train(teacher_batch(engine.model, reference))
        assert stats["kl_teacher"] == pytest.approx(0.0, abs=1e-4)  # the policy starts as the reference
        assert ("kl_loss" in stats) == (where == "loss") and ("kl_penalty_mean" in stats) == (where == "reward")


def test_a_batch_without_the_teachers_column_is_refused_by_a_trainer_that_reads_it(teacher_path):
    from rlflow.services.trainer.torch_engine import TorchEngine

    engine = TorchEngine(C.TorchTrainer(distill_coef=0.5, distill="topk"), str(teacher_path))
    scored = teacher_batch(engine.model, load_teacher(str(teacher_path)))
    topk = ("teacher_topk_ids", "teacher_topk_logprobs")  # the two come together (or neither)
    for left_out, column, key in ((("teacher_logprobs",), "teacher_logprobs", "distill_coef = 0.5"),
                                  (topk, "teacher_topk_ids", "distill = 'topk'")):
        with pytest.raises(ValueError, match=f"a batch without the column {column} reached a trainer with {key}$"):
            engine.prepare(msgspec.structs.replace(scored, **dict.fromkeys(left_out)), 1)
    stats, _ = engine.prepare(scored, 1)  # the same batch with its columns passes
    assert stats["kl_teacher"] == pytest.approx(0.0, abs=1e-4)


# -- configs that disagree ----------------------------------------------------------------------


def test_a_teacher_at_another_temperature_is_refused(teacher_path):
    with pytest.raises(C.ConfigError, match=r"roles.teacher.engine.temperature = 1.0: "
                                            r"must equal the rollout's sampling temperature \(0.7\)"):
        config_for(teacher_path, "roles.teacher.engine.temperature=1.0")
    refused = r"roles.trainer.engine.{} = {}: reads the column teacher_logprobs, which no role of this config " \
              r"attaches \(\[roles.teacher\] does"
    with pytest.raises(C.ConfigError, match=refused.format("distill_coef", "0.5")):
        C.load(ROOT / "rlflow" / "defaults" / "default.toml", ["roles.trainer.engine.distill_coef=0.5"])
    with pytest.raises(C.ConfigError, match=refused.format("kl_coef", "0.1")):  # a simulated teacher's are made up
        config_for(teacher_path, "roles.teacher.engine={kind='sim'}", "roles.trainer.engine.kl_coef=0.1")
    assert config_for(teacher_path, "roles.trainer.engine.kl_coef=0.1").roles.teacher.attaches() == {
        "teacher_logprobs", "teacher_topk_ids", "teacher_topk_logprobs"}
    with pytest.raises(C.ConfigError, match="roles.teacher.engine.top_k = 0: must be at least 1"):
        config_for(teacher_path, "roles.teacher.engine.top_k=0", "roles.trainer.engine.distill_coef=1.0",
                   "roles.trainer.engine.distill=topk")


def test_a_teacher_with_another_tokenizer_is_refused(teacher_path, tmp_path):
    from transformers import AutoTokenizer

    from rlflow.control.launch import resolve
    from rlflow.models import build_tokenizer

    other = tiny_model(tmp_path / "other", tied=False, seed=2)
    build_tokenizer("abc").save_pretrained(other)  # another vocabulary
    assert AutoTokenizer.from_pretrained(other).get_vocab() != AutoTokenizer.from_pretrained(teacher_path).get_vocab()
    config = config_for(teacher_path, f"roles.teacher.engine.model={json.dumps(str(other))}")
    with pytest.raises(C.ConfigError,
                       match=r"roles.teacher.engine.model = .*: its tokenizer differs from the policy's"):
        resolve(config)
    policy = resolve(config_for(teacher_path, "roles.teacher.engine.model=policy"))
    assert policy.roles.teacher.engine.model == str(teacher_path.resolve())


def test_a_top_k_beyond_the_teachers_vocabulary_is_refused(teacher_path):
    from rlflow.control.launch import resolve

    with pytest.raises(C.ConfigError, match=r"roles.teacher.engine.top_k = 32: asks for more tokens than the "
                                            r"teacher's vocabulary has \(17\)"):
        resolve(config_for(teacher_path, "roles.teacher.engine.top_k=32"))
    assert resolve(config_for(teacher_path, "roles.teacher.engine.top_k=17")).roles.teacher.engine.top_k == 17


def test_teacher_replicas_that_disagree_on_the_probe_are_refused():
    from rlflow.control.replicas import Replica, probes_disagree
    from rlflow.protocol import SCHEMA_VERSION, Hello, Role

    def teachers(*probes: list[float]) -> list[Replica]:
        return [Replica("teacher", rank, b"x", Hello(role=Role.TEACHER, rank=rank, replicas=len(probes),
                                                     schema_version=SCHEMA_VERSION, probe=probe), started=0.0)
                for rank, probe in enumerate(probes)]

    assert probes_disagree(teachers([-1.0, -2.0], [-1.0, -2.001])).startswith(
        "teacher replicas disagree: teacher-1 scores the probe sequence 0.001 nats")
    assert probes_disagree(teachers([-1.0, -2.0], [-1.0, -2.00000001])) is None
    assert "nan nats" in probes_disagree(teachers([-1.0, -2.0], [-1.0, float("nan")]))
