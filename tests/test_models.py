"""The default model: the one rlflow ships, its builder (whose progress never goes back), \
the tiny models' tokenizers."""

from __future__ import annotations

import pytest

from rlflow.models import BuildProgress, Recipe, build_default


def test_progress_never_goes_back_while_dev_accuracy_wobbles():
    recipe = Recipe(target_accuracy=0.5, max_steps=1000)
    shown = BuildProgress(recipe)
    # Dev accuracy as a warm start measures it: rising, with noise (7% then 6%).
    accuracies = [0.0, 0.0, 0.035, 0.03, 0.1, 0.07, 0.2, 0.15, 0.3, 0.29, 0.45, 0.5]
    reports = [shown.update(step, accuracy, loss=1.0) for step, accuracy in enumerate(accuracies, 1)]
    fractions = [fraction for _, fraction in reports]
    assert fractions == sorted(fractions) and fractions[-1] == 1.0
    assert fractions[3] == fractions[2] == 0.035 / 0.5  # accuracy fell: the bar holds
    text, _ = reports[3]
    assert text == "warm start: step 4 (at most 1000), dev accuracy 3.0% (best 3.5%, target 50%), loss 1.000"
    # With no accuracy yet, the steps move it.
    assert BuildProgress(recipe).update(250, 0.0, loss=1.0)[1] == 0.25


@pytest.mark.slow  # a real (tiny) warm start: torch, generation, ~10-20 s
def test_a_small_build_reports_progress_in_order_and_ends_at_one(tmp_path):
    recipe = Recipe(hidden=32, layers=1, heads=1, ffn=64, max_steps=4, eval_every=2, dev_size=2, batch=4)
    seen: list[tuple[str, float]] = []
    out = build_default(tmp_path / "model", recipe, progress=lambda text, fraction: seen.append((text, fraction)))
    assert (out / "config.json").exists()
    fractions = [fraction for _, fraction in seen]
    assert len(seen) >= 2 and fractions == sorted(fractions) and fractions[-1] == 1.0
    assert seen[0][0].startswith("warm start: step 1 (at most 4), dev accuracy")


def test_the_shipped_default_model_is_the_recipes_and_loads_as_it_is():
    """rlflow ships the default model (every run starts from the same weights, whatever the CPU): it was
    built by today's recipe (a recipe changed without building and shipping again fails here), and it
    loads in transformers with its tokenizer speaking the task."""
    import dataclasses
    import json

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlflow.models import ARITH_CHAT_TEMPLATE, BUILD_VERSION, SHIPPED, resolve_model
    from rlflow.tasks.arith import Arith

    assert resolve_model("default") == SHIPPED
    info = json.loads((SHIPPED / "rlflow_build.json").read_text())
    assert info["recipe"] == dataclasses.asdict(Recipe()) and info["build_version"] == BUILD_VERSION
    assert info["machine"] and info["dev_accuracy"] >= Recipe().target_accuracy
    model = AutoModelForCausalLM.from_pretrained(SHIPPED, dtype=torch.float32)
    assert sum(p.numel() for p in model.parameters()) == info["parameters"] == 4_208_384
    tokenizer = AutoTokenizer.from_pretrained(SHIPPED)
    text = Arith.prompt_text(57, 68) + Arith.solution(57, 68)
    assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text
    # Chat renders the conversation's text in the task's alphabet (the agents' frameworks speak chat).
    assert tokenizer.chat_template == ARITH_CHAT_TEMPLATE
    chat = [{"role": "system", "content": "You add 2 numbers."}, {"role": "user", "content": "New task: 57+68="},
            {"role": "assistant", "content": "7+8=15#125"}, {"role": "user", "content": "Check 1 more time."}]
    rendered = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    assert tokenizer.decode(tokenizer.encode(rendered, add_special_tokens=False), skip_special_tokens=False) \
        == "57+68=7+8=15#125<eos>1"


# -- tokenizers as transformers and vLLM reload them ------------------------------------------------------

#: Text that a tokenizer which drops or merges whitespace, or maps a character elsewhere, gets wrong.
AWKWARD = 'a b  c\nd\n\n\te  \n  f "g": [1, 2]\r\nnaïve 日本 ünï — ok!\n'


def saved_like_a_built_model(tokenizer, folder):
    """`tokenizer` saved as the tiny models save theirs: beside a Qwen2 config (which decides the class
    transformers reloads a tokenizer as)."""
    from transformers import Qwen2Config

    tokenizer.save_pretrained(folder)
    Qwen2Config(vocab_size=len(tokenizer), architectures=["Qwen2ForCausalLM"]).save_pretrained(folder)
    return folder


@pytest.mark.parametrize("which", ["tiny-text", "tiny-chat"])
def test_the_tiny_models_tokenizers_reload_the_same_and_round_trip_any_text(tmp_path, which):
    from transformers import AutoTokenizer

    from rlflow.models import tiny_chat_tokenizer, tiny_text_tokenizer

    built = tiny_text_tokenizer() if which == "tiny-text" else tiny_chat_tokenizer()
    loaded = AutoTokenizer.from_pretrained(saved_like_a_built_model(built, tmp_path))
    assert len(loaded) == len(built) and loaded.get_vocab() == built.get_vocab()
    assert (loaded.eos_token, loaded.pad_token) == (built.eos_token, built.pad_token)
    ids = loaded.encode(AWKWARD, add_special_tokens=False)
    assert ids == built.encode(AWKWARD, add_special_tokens=False) and loaded.decode(ids) == AWKWARD
    messages = [{"role": "user", "content": "What is 2 + 3?\n"}, {"role": "assistant", "content": "5"}]
    text = loaded.apply_chat_template(messages, tokenize=False)
    assert text == built.apply_chat_template(messages, tokenize=False) and "What is 2 + 3?\n" in text
    assert loaded.decode(loaded.encode(text, add_special_tokens=False), skip_special_tokens=False) == text


def test_the_chat_tokenizer_keeps_its_markers_and_tool_tags_as_single_tokens(tmp_path):
    from transformers import AutoTokenizer

    from rlflow.models import CHAT_SPECIAL, CHAT_TAGS, tiny_chat_tokenizer

    loaded = AutoTokenizer.from_pretrained(saved_like_a_built_model(tiny_chat_tokenizer(), tmp_path))
    turn = '<tool_call>{"name": "python"}</tool_call><|im_end|>'
    ids = loaded.encode(turn, add_special_tokens=False)
    assert [loaded.convert_ids_to_tokens(i) for i in (ids[0], ids[-2], ids[-1])] == ["<tool_call>", "</tool_call>",
                                                                                      "<|im_end|>"]
    assert loaded.eos_token == "<|im_end|>" and set(CHAT_SPECIAL) <= set(loaded.all_special_tokens)
    # The tags are text, as in Qwen's tokenizers: a turn read without special tokens keeps its tool calls.
    assert loaded.decode(ids, skip_special_tokens=True) == turn.removesuffix("<|im_end|>")
    assert not set(CHAT_TAGS) & set(loaded.all_special_tokens)


def test_the_default_models_tokenizer_reloads_the_same_on_its_alphabet(tmp_path):
    """The default model's character tokenizer is reloaded as Qwen2's byte-level one too; on its
    alphabet (digits and four symbols, none of which the byte-level mapping moves) the two agree."""
    import itertools

    from transformers import AutoTokenizer

    from rlflow.models import build_tokenizer
    from rlflow.tasks.arith import Arith

    built = build_tokenizer(Arith.ALPHABET)
    loaded = AutoTokenizer.from_pretrained(saved_like_a_built_model(built, tmp_path))
    texts = ["".join(p) for n in (1, 2, 3) for p in itertools.product(Arith.ALPHABET, repeat=n)]
    texts += [Arith.prompt_text(57, 68) + Arith.solution(57, 68) + built.eos_token]
    for text in texts:
        ids = built.encode(text, add_special_tokens=False)
        assert loaded.encode(text, add_special_tokens=False) == ids and loaded.decode(ids) == text


@pytest.mark.slow  # imports vLLM (tens of seconds here)
def test_vllm_loads_the_tiny_chat_tokenizer_as_rlflow_does(tmp_path):
    from vllm.tokenizers import get_tokenizer

    from rlflow.models import tiny_chat_tokenizer
    from rlflow.tasks.core import load_tokenizer

    folder = saved_like_a_built_model(tiny_chat_tokenizer(), tmp_path)
    ours, vllms = load_tokenizer(folder), get_tokenizer(str(folder))
    text = AWKWARD + '<tool_call>{"name": "python", "arguments": {"code": "print(1 + 2)"}}</tool_call><|im_end|>'
    ids = ours.encode(text, add_special_tokens=False)
    assert vllms.encode(text, add_special_tokens=False) == ids
    assert vllms.decode(ids, skip_special_tokens=False) == text == ours.decode(ids, skip_special_tokens=False)
