"""LoRA for the torch trainer: a PEFT adapter on the frozen base model.

`wrap` puts the adapter on a Hugging Face model (new, or the one a
checkpoint saved) and freezes everything else, so that the optimizer holds
only the adapter and the trainer sends only its tensors, under the names
PEFT gives them in its adapter file (what vLLM loads, and SPEC.md names).
Checkpoints keep the adapter in PEFT's own format (`save_adapter`), loadable by
`peft` and by vLLM as a LoRA adapter, and on request the base with the
adapter merged in, as a Hugging Face model directory.

`AdapterWeights` is the torch engine's view of all this (beside its
`trained.WholeWeights`): the optimizer holds only the adapter, a version's
snapshot is the adapter whole (gathered when it is published: it is small),
so that its checksum goes with `WeightsReady` and rank 0 sends it without
the other ranks; a KL penalty may take the base itself as its reference
(the adapter turned off for one more forward pass).
"""

from __future__ import annotations

import pathlib

import numpy as np
import torch
from rlflow.protocol import Adapter, AdapterUpdate, ParamSpec
from rlflow.services.fsdp import Solo
from rlflow.services.trainer.packing import Packed, logits_at, pack
from rlflow.services.trainer.trained import TrainedWeights
from rlflow.services.weights import tensors_checksum

from rlflow.algo.balance import micro_batches
from rlflow.algo.losses import token_logprobs
from rlflow.config import Lora, TorchTrainer

#: PEFT's name of the one adapter the trainer trains.
NAME = "default"
#: The files of an adapter in PEFT's format.
WEIGHTS_FILE = "adapter_model.safetensors"
CONFIG_FILE = "adapter_config.json"


def peft_config(cfg: Lora):
    from peft import LoraConfig

    return LoraConfig(r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout, target_modules=list(cfg.targets),
                      bias="none", task_type="CAUSAL_LM")


def wrap(model: torch.nn.Module, cfg: Lora, adapter_dir: str = "") -> torch.nn.Module:
    """`model` with a LoRA adapter on the modules `cfg.targets` names (the
    adapter saved in `adapter_dir`, else a new one: B = 0, so version 0 is
    the base itself); only the adapter requires gradients."""
    from peft import get_peft_model, set_peft_model_state_dict

    wrapped = get_peft_model(model, peft_config(cfg))
    if adapter_dir:
        from safetensors.torch import load_file

        saved = load_file(str(pathlib.Path(adapter_dir) / WEIGHTS_FILE))
        result = set_peft_model_state_dict(wrapped, saved)
        missing = [k for k in result.missing_keys if "lora_" in k]
        if missing or result.unexpected_keys:
            raise ValueError(f"the adapter in {adapter_dir} does not fit lora = {cfg}: missing {missing[:3]}, "
                             f"unexpected {list(result.unexpected_keys)[:3]}")
    return wrapped


def file_name(parameter: str) -> str:
    """The name PEFT's adapter file gives a parameter of the adapter (without the adapter's own name)."""
    return parameter.replace(f".{NAME}.", ".")


def trained_parameters(model: torch.nn.Module) -> tuple[list[int], list[str]]:
    """The adapter's parameters: their indices among `model.parameters()`, and
    their names in PEFT's adapter file (checked against PEFT's own)."""
    from peft import get_peft_model_state_dict

    indices, names = [], []
    for i, (name, p) in enumerate(model.named_parameters()):
        if p.requires_grad:
            indices.append(i)
            names.append(file_name(name))
    expected = set(get_peft_model_state_dict(model))
    if set(names) != expected:
        raise RuntimeError(f"the adapter's trainable parameters {sorted(set(names) ^ expected)[:4]} are not what "
                           "PEFT saves (a peft version rlflow does not know?)")
    if not names:
        raise ValueError("the LoRA targets match no module of the model: check roles.trainer.engine.lora.targets")
    return indices, names


def adapter_offer(cfg: Lora, staleness: int) -> Adapter:
    """How the trainer offers the adapter (its `Hello.adapter`)."""
    per_request = cfg.adapter_update == "per_request"
    return Adapter(rank=cfg.rank, alpha=cfg.alpha, targets=list(cfg.targets),
                   update=AdapterUpdate.PER_REQUEST if per_request else AdapterUpdate.IN_PLACE,
                   versions=staleness + 1 if per_request else 1)


def save_adapter(folder: pathlib.Path, cfg: Lora, specs: list[ParamSpec], tensors: list[torch.Tensor], base: str,
         dtype: torch.dtype) -> None:
    """Write the adapter into `folder`/adapter in PEFT's format (its config
    naming `base`); with `cfg.save_merged`, also the base (loaded in `dtype`)
    with it merged in, as a Hugging Face model directory in `folder` itself."""
    from safetensors.torch import save_file

    from rlflow.config import ADAPTER_DIR

    target = folder / ADAPTER_DIR
    target.mkdir(parents=True, exist_ok=True)
    save_file({s.name: t.detach().to("cpu").contiguous() for s, t in zip(specs, tensors, strict=True)},
              str(target / WEIGHTS_FILE), metadata={"format": "pt"})
    config = peft_config(cfg)
    config.base_model_name_or_path = base
    config.save_pretrained(str(target))
    if cfg.save_merged:
        save_merged(folder, target, base, dtype)


def save_merged(folder: pathlib.Path, adapter_dir: pathlib.Path, base: str, dtype: torch.dtype) -> None:
    """The base at `base` with the adapter in `adapter_dir` merged in (by
    PEFT), saved as a Hugging Face model directory in `folder`."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=dtype)
    merged = PeftModel.from_pretrained(model, str(adapter_dir)).merge_and_unload()
    merged.save_pretrained(folder, safe_serialization=True)


class AdapterWeights(TrainedWeights):
    """A LoRA adapter on `model` (as loaded; the base frozen, the whole sharded
    over `ranks` here): only the adapter trains and leaves, under the names of
    PEFT's adapter file; `adapter_dir`: the adapter to start from (empty: a new one)."""

    gathers = False

    def __init__(self, model: torch.nn.Module, ranks: Solo, cfg: TorchTrainer, adapter_dir: str = "", *,
                 temperature: float = 1.0) -> None:
        if cfg.lora is None:
            raise ValueError("AdapterWeights needs a trainer config with lora")
        self.cfg, self.temperature = cfg, temperature
        self.lora: Lora = cfg.lora
        model = ranks.shard(wrap(model, self.lora, adapter_dir))
        super().__init__(model, ranks, *trained_parameters(model), cfg.bucket_bytes)
        #: A KL penalty's reference: the base with the adapter off (`reference = "base"`), else the batch's
        #: `teacher_logprobs`.
        self.base_reference = self.lora.reference == "base" and cfg.kl_coef > 0

    def snapshot(self) -> list[torch.Tensor]:
        """The adapter whole, gathered now (it is small; every rank takes part)
        and kept by rank 0 (the others keep nothing): its sends gather nothing more."""
        local = super().snapshot()
        with torch.no_grad():
            whole = [self.ranks.full(t, i) for t, i in zip(local, self.indices)]
        return whole if self.ranks.lead else []

    def checksum(self, snapshot: list[torch.Tensor]) -> str:
        """The checksum (SPEC.md, *Checksums*) of the adapter's `snapshot` at rank 0; empty at the other ranks."""
        return tensors_checksum(self.specs, snapshot) if self.ranks.lead else ""

    def full(self, snapshot: list[torch.Tensor], j: int) -> torch.Tensor:
        return snapshot[j]  # whole already

    # -- the reference: the base with the adapter off -------------------------------------

    def reference_rows(self, rows: list) -> list[np.ndarray]:
        return self.base_rows(rows) if self.base_reference else super().reference_rows(rows)

    def reference(self, part: list, packed: Packed, keep: torch.Tensor | None) -> torch.Tensor:
        return self.base_logprobs(packed) if self.base_reference else super().reference(part, packed, keep)

    def idle_reference(self, ids: torch.Tensor) -> None:
        if self.base_reference:  # as a real pass: the base's forward first
            with torch.no_grad(), self.model.disable_adapter():
                self.model(input_ids=ids)

    def base_logprobs(self, packed: Packed) -> torch.Tensor:
        """The base model's log-probabilities of `targets` (the packed inputs of
        `packing.pack`), with the adapter turned off: the reference of a KL penalty."""
        device = self.ranks.device
        with torch.no_grad(), self.model.disable_adapter():
            return token_logprobs(logits_at(self.model, packed, device), packed.targets.to(device), self.temperature)

    def base_rows(self, rows: list) -> list[np.ndarray]:
        """The base's log-probabilities of every sample's response tokens, in
        micro-batches (a trainer of one rank: every rank would have to join)."""
        out: list[np.ndarray] = [np.zeros(0, np.float32)] * len(rows)
        lengths = [len(r.prompt_ids) + len(r.response_ids) for r in rows]
        for micro in micro_batches(lengths, self.cfg.micro_batch_tokens):
            chosen = [j for j in micro if len(rows[j].response_ids)]
            if not chosen:
                continue
            flat = self.base_logprobs(pack([rows[j] for j in chosen])).float().cpu().numpy()
            offsets = np.cumsum([0] + [len(rows[j].response_ids) for j in chosen])
            for k, j in enumerate(chosen):
                out[j] = flat[offsets[k] : offsets[k + 1]]
        return out

    # -- checkpoints ------------------------------------------------------------------------

    def save(self, folder: pathlib.Path, model_path: str, dtype: torch.dtype) -> bool:
        """The adapter in PEFT's format under `folder`/adapter (and the merged model, if asked for)."""
        adapter = self.snapshot()
        if not self.ranks.lead:
            return False
        save_adapter(folder, self.lora, self.specs, adapter, model_path, dtype)
        return True
