"""The embedded default model: a small Qwen2 that rlflow builds locally.

`build_default` makes a character-level tokenizer for the `arith` task, a
4-layer Qwen2 (untied embeddings, float32, 4.2M parameters) and warm-starts
it with a short supervised phase on worked additions until it solves a
fixed share of a development set, so that RL starts clearly below the
ceiling. Nothing is downloaded. The result is an ordinary Hugging Face
directory (safetensors, tokenizer, generation config) that vLLM and
transformers load as they are.

rlflow ships the default model so built (`SHIPPED`, 17 MB): a build is the
same recipe everywhere, but not the same weights (float sums differ from
one CPU to another, and so does the step where the warm start stops), and
a run's curve is only comparable with another's from the same start.
`rlflow model build` builds it again, into ``~/.cache/rlflow/models``
(``$RLFLOW_CACHE`` to move it), as it builds the models a role asks for
(`RoleSpec.models`: the same recipe, warm-started further).
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import platform
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from typing import Protocol

import numpy as np

from rlflow.roles import ROLES

#: Bump when the recipe below changes, so that caches rebuild.
BUILD_VERSION = 2
DEFAULT_NAME = "arith-qwen2-4x256"
SPECIAL = ("<pad>", "<eos>", "<unk>")


@dataclass(frozen=True)
class Recipe:
    """How the default model is built and warm-started."""

    hidden: int = 256
    layers: int = 4
    heads: int = 4
    ffn: int = 1024
    max_positions: int = 256
    seed: int = 0
    lr: float = 1e-3
    batch: int = 32
    target_accuracy: float = 0.33
    """Stop the warm start once greedy accuracy on the development set reaches this."""
    max_steps: int = 2000
    """Or after this many steps (never after a time: the model must not depend on the machine's speed)."""
    threads: int = 2
    """Torch threads while building: a fixed count, so that sums are added in the same order everywhere."""
    eval_every: int = 24
    dev_size: int = 300


def cpu_name() -> str:
    """This machine's CPU, as its figures are named: the model, its cores, and whether it has
    AVX-512 and multiplies bf16 itself (AVX512-BF16, AMX), which move every figure here."""
    try:
        text = pathlib.Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    model = next((line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("model name")),
                 platform.machine())
    flags = set(next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), []))
    extras = [name for name, flag in (("AVX-512", "avx512f"), ("AVX512-BF16", "avx512_bf16"), ("AMX", "amx_bf16"))
              if flag in flags] or ["AVX2, no AVX-512" if "avx2" in flags else "no AVX2"]
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"{model}, {cores} cores, {', '.join(extras)}"


def cache_dir() -> pathlib.Path:
    return pathlib.Path(os.environ.get("RLFLOW_CACHE", pathlib.Path.home() / ".cache" / "rlflow"))


#: The models rlflow builds itself, by name: (folder name, recipe): the default
#: model's, and those the roles ask for (`RoleSpec.models`: the default model
#: warm-started further).
BUILT = {
    "default": (DEFAULT_NAME, Recipe()),
    **{name: (DEFAULT_NAME + name.removeprefix("default"), Recipe(target_accuracy=accuracy, max_steps=steps))
       for role in ROLES for name, accuracy, steps in role.models},
}


#: The default model as rlflow ships it (its rlflow_build.json says where and how it was built).
SHIPPED = pathlib.Path(__file__).resolve().parent / "defaults" / DEFAULT_NAME


def default_model_dir(name: str = "default") -> pathlib.Path:
    """Where `rlflow model build` builds the model `name` of `BUILT` (the cache)."""
    return cache_dir() / "models" / f"{BUILT[name][0]}-v{BUILD_VERSION}"


#: A tiny model of random weights over text (built at once, on first use).
TINY_TEXT = "tiny-text"
#: A tiny chat model that calls a `python` tool through its chat template (built in under a minute, on first use).
TINY_CHAT = "tiny-chat"
#: Bump when a tiny model's recipe changes, so that caches rebuild (apart from
#: `BUILD_VERSION`, so that the default model's folder keeps its name).
TINY_VERSION = 3


def resolve_model(name: str) -> pathlib.Path:
    """A model directory: "default" is the default model rlflow ships,
    another name of `BUILT` that model once built, "tiny-text" a tiny
    text model (`build_tiny_text`), "tiny-chat" a tiny chat model that calls
    tools (`build_tiny_chat`)."""
    if name == "default":
        return SHIPPED
    if name in BUILT:
        path = default_model_dir(name)
        if not (path / "config.json").exists():
            raise FileNotFoundError(f"the {name} model is not built yet ({path}); run `rlflow model build {name}`")
        return path
    if name in (TINY_TEXT, TINY_CHAT):
        path = cache_dir() / "models" / f"{name}-v{TINY_VERSION}"
        if not (path / "config.json").exists():
            (build_tiny_text if name == TINY_TEXT else build_tiny_chat)(path)
        return path
    path = pathlib.Path(name).expanduser()
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"{path} is not a Hugging Face model directory (no config.json)")
    return path


def _tiny_qwen2(tokenizer, *, tied: bool, positions: int):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    return Qwen2ForCausalLM(Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=128, intermediate_size=512, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=positions, tie_word_embeddings=tied,
        bos_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, architectures=["Qwen2ForCausalLM"],
    ))


def _save(out: pathlib.Path, model, tokenizer) -> pathlib.Path:
    from transformers import GenerationConfig

    with building(out) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        GenerationConfig(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id).save_pretrained(tmp)
    return out


def random_arith_model(path: pathlib.Path, *, tied: bool, seed: int = 0, hidden: int = 128,
                       layers: int = 2) -> pathlib.Path:
    """A randomly initialised Qwen2 (`hidden`, `layers`) with the arith task's tokenizer, built in a
    second, in `path`: a stand-in policy for tests and for benchmarks of the machinery around a model
    (its weights are sharper than the default init's, so that samples differ by weights)."""
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

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
        dtype="float32",
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


def build_tiny_text(out: pathlib.Path) -> pathlib.Path:
    """A 2-layer Qwen2 (hidden 128) of random weights over a byte-level
    tokenizer (`build_byte_tokenizer`), with a chat template: it writes
    gibberish, but any text tokenizes, so it serves runs whose point is the
    pipeline around the model (e.g. the code reward under load)."""
    import torch

    tokenizer = tiny_text_tokenizer()
    torch.manual_seed(0)
    return _save(out, _tiny_qwen2(tokenizer, tied=True, positions=1024), tokenizer)


def tiny_text_tokenizer():
    """The tiny text model's tokenizer: bytes, pad / eos / unk, and a plain chat template."""
    tokenizer = build_byte_tokenizer(SPECIAL, eos="<eos>", pad="<pad>", unk="<unk>")
    tokenizer.chat_template = (
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant: {% endif %}"
    )
    return tokenizer


@contextlib.contextmanager
def building(out: pathlib.Path) -> Iterator[pathlib.Path]:
    """A folder to write a model into, beside `out`; it replaces `out` whole
    when the block ends without error, and is removed either way (a build
    that fails or is killed leaves the model there before untouched)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = pathlib.Path(tempfile.mkdtemp(dir=out.parent, prefix=".building-"))
    try:
        yield tmp
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


@contextlib.contextmanager
def deterministic(threads: int) -> Iterator[None]:
    """Torch on a fixed thread count with deterministic kernels (sums added in
    the same order everywhere), as it was afterwards."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.set_num_threads(before)
        torch.use_deterministic_algorithms(was)


#: The default model's chat template, so that agents that speak chat (their frameworks do) train it too:
#: the conversation's text in turn, each assistant turn closed by its end-of-sequence token, system
#: messages and tools left out (the model reads the arithmetic alphabet alone, and its tokenizer drops
#: any other character: "New task: 12+34=" reads as "12+34="). No generation prompt: the model answers
#: right after the question, as it was warm-started to.
ARITH_CHAT_TEMPLATE = (
    "{%- for m in messages %}{%- if m['role'] != 'system' %}"
    "{%- if m['content'] is string %}{{ m['content'] }}"
    "{%- elif m['content'] %}{%- for part in m['content'] %}{%- if part['type'] == 'text' %}{{ part['text'] }}"
    "{%- endif %}{%- endfor %}{%- endif %}"
    "{%- if m['role'] == 'assistant' %}{{ eos_token }}{%- endif %}"
    "{%- endif %}{%- endfor %}"
)


#: The chat template of the tiny chat model: Qwen's markers, and each tool shown as its name and arguments.
CHAT_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nTools:{% for t in tools %} {{ t.function.name }}("
    "{{ t.function.parameters.properties | list | join(', ') }}){% endfor %}<|im_end|>\n{% endif %}"
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
#: Its special tokens (the end of a turn is its end-of-sequence), and the tool-call tags, which
#: are tokens of their own but text, as in Qwen's tokenizers.
CHAT_SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHAT_TAGS = ("<tool_call>", "</tool_call>")
#: The tool the tiny chat model was warm-started to call, as its chat template sees it.
CHAT_TOOLS = [{"type": "function", "function": {"name": "python", "parameters": {"properties": {"code": {}}}}}]


def chat_transcript(a: int, b: int, op: str) -> tuple[list[dict[str, str]], str]:
    """A conversation in which the assistant asks the `python` tool for `a op b` and answers with its
    result: (the messages before the assistant's first turn, the rest of the transcript as text)."""
    code = f"print({a}{op}{b})"
    result = str({"+": a + b, "-": a - b, "*": a * b}[op])
    call = '<tool_call>{"name": "python", "arguments": {"code": "' + code + '"}}</tool_call>'
    rest = (f"{call}<|im_end|>\n<|im_start|>tool\n{result}\n<|im_end|>\n<|im_start|>assistant\n"
            f"The answer is {result}.<|im_end|>")
    return [{"role": "user", "content": f"What is {a}{op}{b}?"}], rest


def build_tiny_chat(out: pathlib.Path, steps: int = 120, batch: int = 8, lr: float = 5e-3,
                    seed: int = 0) -> pathlib.Path:
    """A 2-layer Qwen2 (hidden 128) over a byte-level tokenizer with Qwen's chat
    markers and tool-call tags, a chat template that shows tools
    (`CHAT_TEMPLATE`), and a short warm start on conversations where it calls
    a `python` tool to do arithmetic and answers with the result
    (`chat_transcript`): it writes tool calls in the format vLLM's hermes
    parser reads, for runs whose point is the tool path. After the 120 steps
    it writes a well-formed call nearly every time, but rarely copies the
    question's numbers into it: its answers are mostly wrong. Seeded, on a
    fixed thread count with deterministic kernels: the same model everywhere."""
    with deterministic(threads=2):
        return _build_tiny_chat(out, steps, batch, lr, seed)


def _build_tiny_chat(out: pathlib.Path, steps: int, batch: int, lr: float, seed: int) -> pathlib.Path:
    import torch

    torch.manual_seed(seed)
    tokenizer = tiny_chat_tokenizer()
    model = _tiny_qwen2(tokenizer, tied=False, positions=512)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    rng = np.random.default_rng((seed, 6))
    for step in range(steps):
        texts, starts = [], []
        for _ in range(batch):
            a, b = (int(x) for x in rng.integers(2, 100, 2))
            messages, rest = chat_transcript(a, b, str(rng.choice(["+", "-", "*"])))
            prompt = tokenizer.apply_chat_template(messages, tools=CHAT_TOOLS, add_generation_prompt=True,
                                                   tokenize=False)
            texts.append(prompt + rest)
            starts.append(len(tokenizer.encode(prompt, add_special_tokens=False)))
        enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        labels = enc["input_ids"].clone()
        labels[enc["attention_mask"] == 0] = -100
        for row, start in enumerate(starts):
            labels[row, :start] = -100  # learn the assistant's side (and the tool's, which it echoes)
        for group in optimizer.param_groups:
            group["lr"] = lr * min(1.0, (step + 1) / 10)
        model(**enc, labels=labels).loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return _save(out, model, tokenizer)


def tiny_chat_tokenizer():
    """The tiny chat model's tokenizer: bytes, Qwen's chat markers and tool-call tags, `CHAT_TEMPLATE`."""
    tokenizer = build_byte_tokenizer(CHAT_SPECIAL, eos="<|im_end|>", pad="<|endoftext|>", tags=CHAT_TAGS)
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def build_byte_tokenizer(special: tuple[str, ...], *, eos: str, pad: str, unk: str = "", tags: tuple[str, ...] = ()):
    """A byte-level tokenizer in exactly the form of Qwen2's (one token per byte,
    no merges, then `special` and `tags` as tokens of their own): a Qwen2
    model's folder is reloaded by transformers (and so by vLLM) as a
    `Qwen2Tokenizer` whatever class it was saved as, so a tokenizer of any other
    form (e.g. `build_tokenizer`'s) reloads with Qwen2's byte-level
    pre-tokenizer and decoder and loses the characters those map elsewhere
    (space, newline). This one reloads the same, and any text in Unicode's
    NFC form (Qwen2's normalizer puts it so) round-trips exactly (`unk`, pad
    if not given, is never produced: every byte is a token)."""
    from tokenizers import AddedToken
    from transformers.convert_slow_tokenizer import bytes_to_unicode
    from transformers.models.qwen2.tokenization_qwen2 import Qwen2Tokenizer

    vocab = {token: i for i, token in enumerate([*special, *tags, *bytes_to_unicode().values()])}
    extra = [token for token in special if token not in (eos, pad, unk)]
    tokenizer = Qwen2Tokenizer(vocab=vocab, merges=[], unk_token=unk or pad, eos_token=eos, pad_token=pad,
                               extra_special_tokens=extra, clean_up_tokenization_spaces=False)
    tokenizer.add_tokens([AddedToken(tag, special=False) for tag in tags])
    return tokenizer


def build_tokenizer(alphabet: str):
    """A character-level fast tokenizer over `alphabet` plus pad / eos / unk.

    Saved in a Qwen2 model's folder, it is reloaded as Qwen2's byte-level
    tokenizer (see `build_byte_tokenizer`), which agrees with it only on
    characters that the byte-level mapping leaves as they are: printable ASCII
    but the space, as in the default model's alphabet."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate([*SPECIAL, *alphabet])}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>",
        clean_up_tokenization_spaces=False
    )


class ModelShape(Protocol):
    """The shape of a model rlflow builds (`Recipe`, `rlflow.taskmodel.TaskRecipe`)."""

    @property
    def hidden(self) -> int: ...
    @property
    def ffn(self) -> int: ...
    @property
    def layers(self) -> int: ...
    @property
    def heads(self) -> int: ...
    @property
    def max_positions(self) -> int: ...


def qwen2_config(recipe: ModelShape, tokenizer):
    """The Qwen2 configuration of a model of `recipe`'s shape over `tokenizer` (its end of sequence
    the beginning too), untied, in float32."""
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=recipe.hidden,
        intermediate_size=recipe.ffn,
        num_hidden_layers=recipe.layers,
        num_attention_heads=recipe.heads,
        num_key_value_heads=recipe.heads,
        max_position_embeddings=recipe.max_positions,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        bos_token_id=tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype="float32",
        architectures=["Qwen2ForCausalLM"],
    )


def greedy_accuracy(model, tokenizer, problems: list[tuple[int, int]], max_new_tokens: int = 100) -> float:
    """Share of `problems` whose greedy answer is right (transformers, no vLLM)."""
    from rlflow.tasks.arith import Arith

    answers = greedy_answers(model, tokenizer, [Arith.prompt_text(a, b) for a, b in problems], max_new_tokens)
    return sum(Arith.check(str(a + b), text)[0] == 1.0 for (a, b), text in zip(problems, answers)) / len(problems)


def greedy_answers(model, tokenizer, prompts: list[str], max_new_tokens: int, chunk: int = 100) -> list[str]:
    """Each prompt's greedy answer (transformers, no vLLM, `chunk` prompts at a time), as text."""
    import torch

    side, tokenizer.padding_side = tokenizer.padding_side, "left"
    out: list[str] = []
    model.eval()
    with torch.no_grad():
        for start in range(0, len(prompts), chunk):
            enc = tokenizer(prompts[start : start + chunk], return_tensors="pt", padding=True,
                            add_special_tokens=False)
            made = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False,
                                  pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
            out += tokenizer.batch_decode(made[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
    model.train()
    tokenizer.padding_side = side
    return out


class StoppingRule(Protocol):
    """What a warm start stops by (`Recipe`, `rlflow.taskmodel.TaskRecipe`)."""

    @property
    def target_accuracy(self) -> float: ...

    @property
    def max_steps(self) -> int: ...


class BuildProgress:
    """What the warm start reports after each step: the steps against
    `max_steps` and the development-set accuracy against the target. Its
    fraction never goes back: dev accuracy is noisy, so the best so far
    counts (the stopping rule itself reads the accuracy of the moment)."""

    def __init__(self, recipe: StoppingRule):
        self.recipe = recipe
        self.best = 0.0

    def update(self, step: int, accuracy: float, loss: float) -> tuple[str, float]:
        """(text, fraction done) after `step` steps."""
        recipe = self.recipe
        self.best = max(self.best, accuracy)
        fraction = min(max(self.best / recipe.target_accuracy, step / recipe.max_steps), 1.0)
        text = (f"warm start: step {step} (at most {recipe.max_steps}), dev accuracy {accuracy:.1%} "
                f"(best {self.best:.1%}, target {recipe.target_accuracy:.0%}), loss {loss:.3f}")
        return text, fraction


def build_default(
    out: pathlib.Path | None = None,
    recipe: Recipe = Recipe(),
    progress: Callable[[str, float], None] | None = None,
) -> pathlib.Path:
    """Build, warm-start and save the default model; its directory.

    `progress(text, fraction)` is called as it goes (see `BuildProgress`;
    the fraction never goes back, and is 1 once built). The build is a function
    of the recipe alone: seeded, a fixed thread count, deterministic kernels,
    and a stopping rule by steps and accuracy, never by time.
    """
    report = progress or (lambda text, fraction: None)
    with deterministic(recipe.threads):
        return _build(out or default_model_dir(), recipe, report)


def _build(out: pathlib.Path, recipe: Recipe, report: Callable[[str, float], None]) -> pathlib.Path:
    import torch
    from transformers import GenerationConfig, Qwen2ForCausalLM

    from rlflow.config import ArithTask
    from rlflow.tasks.arith import Arith

    torch.manual_seed(recipe.seed)
    task_cfg = ArithTask()
    arith = Arith(task_cfg.digit_weights, seed=recipe.seed, heldout_seed=task_cfg.heldout_seed)
    tokenizer = build_tokenizer(Arith.ALPHABET)
    tokenizer.chat_template = ARITH_CHAT_TEMPLATE
    model = Qwen2ForCausalLM(qwen2_config(recipe, tokenizer))
    optimizer = torch.optim.AdamW(model.parameters(), lr=recipe.lr, betas=(0.9, 0.98))
    rng = np.random.default_rng((recipe.seed, 3))
    dev_rng = np.random.default_rng((recipe.seed, 4))
    dev = [arith.fresh_problem(dev_rng) for _ in range(recipe.dev_size)]
    eos = tokenizer.eos_token

    def batch():
        # Supervised data covers every length evenly, so the warm start is
        # sloppy at all of them rather than blind beyond a few digits.
        texts, prompts = [], []
        while len(texts) < recipe.batch:
            a, b = arith.fresh_problem(rng, uniform_digits=True)
            prompt = Arith.prompt_text(a, b)
            texts.append(prompt + Arith.solution(a, b) + eos)
            prompts.append(len(prompt))
        enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        labels = enc["input_ids"].clone()
        labels[enc["attention_mask"] == 0] = -100
        for row, n in enumerate(prompts):
            labels[row, :n] = -100  # learn the answer, not the question
        return enc, labels

    started = time.monotonic()
    accuracy, step, history = 0.0, 0, []
    shown = BuildProgress(recipe)
    while True:
        enc, labels = batch()
        warm = min(1.0, (step + 1) / 20)
        for group in optimizer.param_groups:
            group["lr"] = recipe.lr * warm
        loss = model(**enc, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        elapsed = time.monotonic() - started
        if step % recipe.eval_every == 0:
            accuracy = greedy_accuracy(model, tokenizer, dev)
            history.append({"step": step, "seconds": round(elapsed, 1), "loss": round(loss.item(), 4),
                            "dev_accuracy": accuracy})
        report(*shown.update(step, accuracy, loss.item()))
        if accuracy >= recipe.target_accuracy or step >= recipe.max_steps:
            break

    with building(out) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        GenerationConfig(
            eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, do_sample=True
        ).save_pretrained(tmp)
        info = {
            "name": out.name,
            "build_version": BUILD_VERSION,
            "recipe": asdict(recipe),
            "steps": step,
            "seconds": round(time.monotonic() - started, 1),
            "dev_accuracy": accuracy,
            "history": history,
            "parameters": sum(p.numel() for p in model.parameters()),
            "machine": cpu_name(),
        }
        (tmp / "rlflow_build.json").write_text(json.dumps(info, indent=1))
    report(f"built in {time.monotonic() - started:.0f} s: dev accuracy {accuracy:.1%}", 1.0)
    return out


