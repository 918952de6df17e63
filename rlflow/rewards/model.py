"""The built-in `reward_model` reward: a local Hugging Face
sequence-classification model scores prompt and response, in batches.

The model is loaded once per worker process (by `prepare`, outside the call
timeout) and kept, by path, device and dtype. It runs where the reward
role's workers run: on that pool's GPU if it has one (``device = "auto"``),
else on CPU. Each worker of the function holds its own copy, so a large
model wants ``workers = 1``. Nothing is downloaded: `model` is a local
directory (or a model already in the Hugging Face cache).
"""

from __future__ import annotations

import functools
from typing import Any

from rlflow.rewards.core import Sample

LAYOUTS = ("auto", "chat", "pair", "concat")


def reward_model(
    samples: list[Sample],
    *,
    model: str,
    layout: str = "auto",
    label: int = 0,
    max_length: int = 4096,
    batch_size: int = 8,
    device: str = "auto",
    dtype: str = "float32",
) -> list[float]:
    """The model's logit `label` for each (prompt, response). `layout`: how
    they are put to the model: "chat" (the tokenizer's chat template, user
    then assistant), "pair" (a text pair, as cross-encoders take it),
    "concat" (prompt + response), "auto" (chat if the tokenizer has a
    template, else pair). Inputs longer than `max_length` tokens lose their
    beginning. At most `batch_size` samples go through the model at once."""
    import torch

    scorer = _load(model, device, dtype)
    scores: list[float] = []
    for start in range(0, len(samples), batch_size):
        inputs = scorer.encode(samples[start : start + batch_size], layout, max_length)
        with torch.inference_mode():
            logits = scorer.model(**inputs).logits
        scores += logits[:, label].float().tolist()
    return scores


def _prepare(
    *,
    model: str,
    layout: str = "auto",
    label: int = 0,
    max_length: int = 4096,
    batch_size: int = 8,
    device: str = "auto",
    dtype: str = "float32",
) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"reward_model: layout must be one of {', '.join(LAYOUTS)}; got {layout!r}")
    if batch_size < 1 or max_length < 1:
        raise ValueError(f"reward_model: batch_size and max_length must be >= 1, got {batch_size}, {max_length}")
    scorer = _load(model, device, dtype)
    labels = scorer.model.config.num_labels
    if not 0 <= label < labels:
        raise ValueError(f"reward_model: label {label} is out of range: the model at {model} has {labels} label(s)")


reward_model.batched = True  # type: ignore[attr-defined]
reward_model.prepare = _prepare  # type: ignore[attr-defined]


class _Scorer:
    """A loaded model and its tokenizer."""

    def __init__(self, path: str, device: str, dtype: str):
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        self.tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        self.tokenizer.truncation_side = "left"  # keep the end of the response
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.model = AutoModelForSequenceClassification.from_pretrained(
            path, local_files_only=True, dtype=getattr(torch, dtype)
        )
        if self.model.config.pad_token_id is None:
            # Decoder models find each row's last token by the pad id.
            self.model.config.pad_token_id = self.tokenizer.pad_token_id
        self.model.to(self.device).eval()

    def encode(self, samples: list[Sample], layout: str, max_length: int) -> Any:
        tokenizer = self.tokenizer
        if layout == "auto":
            layout = "chat" if getattr(tokenizer, "chat_template", None) else "pair"
        options: dict[str, Any] = {
            "padding": True,
            "truncation": True,
            "max_length": max_length,
            "return_tensors": "pt",
        }
        if layout == "chat":
            texts = [
                tokenizer.apply_chat_template(
                    [{"role": "user", "content": s.prompt}, {"role": "assistant", "content": s.response}],
                    tokenize=False,
                )
                for s in samples
            ]
            inputs = tokenizer(texts, add_special_tokens=False, **options)
        elif layout == "pair":
            inputs = tokenizer([s.prompt for s in samples], [s.response for s in samples], **options)
        else:
            inputs = tokenizer([s.prompt + s.response for s in samples], **options)
        return inputs.to(self.device)


@functools.cache
def _load(path: str, device: str, dtype: str) -> _Scorer:
    return _Scorer(path, device, dtype)
