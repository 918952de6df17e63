"""Tiny models for tests, built in a second, never downloaded."""

from __future__ import annotations

import pathlib


def tiny_model(path: pathlib.Path, *, tied: bool, seed: int = 0, hidden: int = 128, layers: int = 2) -> pathlib.Path:
    """A randomly initialised Qwen2 with the arith task's tokenizer."""
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    from rlflow.models import build_tokenizer
    from rlflow.tasks.arith import Arith

    tokenizer = build_tokenizer(Arith.ALPHABET)
    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,  # vLLM's CPU attention wants heads of 64
        num_key_value_heads=1,
        max_position_embeddings=512,
        tie_word_embeddings=tied,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.eos_token_id,
        torch_dtype="float32",
        architectures=["Qwen2ForCausalLM"],
    )
    model = Qwen2ForCausalLM(config)
    with torch.no_grad():  # sharper than the default init, so samples differ by weights
        for p in model.parameters():
            p.mul_(4.0 if p.dim() > 1 else 1.0)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    GenerationConfig(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id).save_pretrained(path)
    return path
