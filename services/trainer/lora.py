"""LoRA for the torch trainer: a PEFT adapter on the frozen base model.

`wrap` puts the adapter on a Hugging Face model (new, or the one a
checkpoint saved) and freezes everything else, so that the optimizer holds
only the adapter and the trainer sends only its tensors, under the names
PEFT gives them in its adapter file (what vLLM loads, and SPEC.md names).
Checkpoints keep the adapter in PEFT's own format (`save_adapter`), loadable by
`peft` and by vLLM as a LoRA adapter, and on request the base with the
adapter merged in, as a Hugging Face model directory.
"""

from __future__ import annotations

import pathlib

import torch
from rlflow.protocol import Adapter, AdapterUpdate, ParamSpec

from rlflow.config import Lora

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
