"""The user's own prompts as a task: rows from local files, rendered with the
model's chat template, a deterministic order per epoch.

Rows are read with the `datasets` library (JSON lines, JSON, Parquet, CSV,
or a folder written by `save_to_disk`); nothing is downloaded. Each row's
prompt column is a string or a list of chat messages; it is rendered with
the tokenizer's chat template (with an optional system prompt and the
generation prompt) unless the config turns that off, and rows whose prompt
is longer than `max_prompt_tokens` are left out, and counted, when the data
is loaded.

Group id ``g`` is row ``order(epoch)[i]`` with ``epoch, i = divmod(g, rows)``,
where ``order(epoch)`` is a permutation drawn from (seed, epoch): a group
granted again is the same prompt, and a run that resumes at group ``g`` goes
on where it stopped, with no row skipped or repeated within an epoch. The
evaluation split (a file of its own, or a fixed share of the training rows)
is never trained on.

A message about a row names it as its file numbers it: the line (from 1, as
an editor shows it) of a JSON-lines or CSV file, where a CSV's header is
line 1 and its first row line 2; the record (from 1) where the source has
no lines (Parquet, a `save_to_disk` folder, a JSON array, generated
problems). Rows that load but look wrong (a prompt column that mixes plain
strings and chat messages) are warnings kept beside the rows left out
(`Split.warnings`, `RowTask.warnings`): `rlflow check` shows them, and each
service that loads the task logs them.

The same machinery serves procedural problems from `reasoning-gym`
(`ReasoningGymTaskImpl`): generated locally, each problem a row.
"""

from __future__ import annotations

import csv
import functools
import os
import pathlib
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rlflow.config import DatasetTask, ReasoningGymTask
from rlflow.protocol import GroupInfo, PromptGroup

#: Rows whose answers are scored by `rlflow check` and at a run's start, by default.
REFERENCE_ROWS = 8


class DatasetError(ValueError):
    """Data that cannot be used; the message names the file, the row (see
    `RowSource`) and the field."""


class RowSource:
    """Where rows come from, to name a row as the source numbers it: a line
    of a JSON-lines or CSV file (from 1; a CSV's header is line 1), else a
    record (from 1). The lines are found on first use: only a message needs them."""

    def __init__(self, name: str, path: str | os.PathLike | None = None):
        self.name = name
        self._path = None if path is None else pathlib.Path(path)
        self._lines: list[int] | None = None

    @functools.cached_property
    def unit(self) -> str:
        """"line" where the source is a file of lines, else "record"."""
        return "record" if self._record_lines() is None else "line"

    def number(self, index: int) -> int:
        """The line (or record) number of the row read `index`-th (from 0)."""
        lines = self._record_lines()
        return index + 1 if lines is None else lines[index]

    def where(self, index: int) -> str:
        """The row read `index`-th (from 0), as a message names it."""
        return f"{self.name}: {self.unit} {self.number(index)}"

    def _record_lines(self) -> list[int] | None:
        if self._lines is not None:
            return self._lines
        path, lines = self._path, None
        if path is None or path.is_dir():
            return None
        suffix = path.suffix.lower()
        if suffix in (".jsonl", ".json"):
            with path.open(encoding="utf-8", errors="replace") as f:
                numbered = [(n, line) for n, line in enumerate(f, 1) if line.strip()]
            if suffix == ".jsonl" or not numbered or not numbered[0][1].lstrip().startswith("["):
                lines = [n for n, _ in numbered]  # JSON lines: blank lines hold no row
        elif suffix == ".csv":
            with path.open(newline="", encoding="utf-8", errors="replace") as f:
                reader, lines, end = csv.reader(f), [], 0
                for record in reader:
                    start, end = end + 1, reader.line_num  # a quoted field may span lines
                    if record:  # blank lines hold no row
                        lines.append(start)
            lines = lines[1:]  # the header
        self._lines = lines
        return lines


@dataclass
class Split:
    """Rows kept for one purpose, rendered and tokenized."""

    rows: list[dict[str, Any]] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    """Each prompt as the model sees it (after the chat template)."""
    ids: list[list[int]] = field(default_factory=list)
    skipped: Counter[str] = field(default_factory=Counter)
    """Rows left out, by reason."""
    source: RowSource = field(default_factory=lambda: RowSource("(no source)"))
    positions: list[int] = field(default_factory=list)
    """Where each row was read in `source` (from 0)."""
    warnings: list[str] = field(default_factory=list)
    """What looked wrong in rows that loaded."""

    def __len__(self) -> int:
        return len(self.rows)

    def where(self, i: int) -> str:
        """Row `i` of the split, as the source numbers it."""
        return self.source.where(self.positions[i])


def read_rows(path: str | os.PathLike) -> list[dict[str, Any]]:
    """Every row of a local data file or `save_to_disk` folder, as dicts."""
    import datasets

    datasets.disable_progress_bars()
    source = pathlib.Path(path)
    if not source.exists():
        raise DatasetError(f"{source}: no such file or folder")
    if source.is_dir():
        loaded = datasets.load_from_disk(str(source))
        if isinstance(loaded, datasets.DatasetDict):
            if "train" not in loaded:
                raise DatasetError(f"{source}: a folder of splits {sorted(loaded)} without a 'train' split")
            loaded = loaded["train"]
        return list(loaded)
    kinds = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
    kind = kinds.get(source.suffix.lower())
    if kind is None:
        raise DatasetError(f"{source}: not a data file rlflow reads ({', '.join(kinds)} or a save_to_disk folder)")
    try:
        return list(datasets.load_dataset(kind, data_files=str(source), split="train"))
    except Exception as exc:  # the library's own parse errors, of many types
        raise DatasetError(f"{source}: cannot be read as {kind}: {type(exc).__name__}: {exc}") from None


class Renderer:
    """Turns a row's prompt into the text and token ids the model sees."""

    def __init__(self, tokenizer: Any, *, chat_template: bool, system_prompt: str, max_tokens: int):
        self.tokenizer = tokenizer
        self.templated = chat_template and bool(getattr(tokenizer, "chat_template", None))
        self.system_prompt = system_prompt
        self.max_tokens = max_tokens

    def messages(self, value: Any, where: str) -> list[dict[str, str]]:
        """`value` as chat messages (a string is one user message)."""
        if isinstance(value, str):
            return [{"role": "user", "content": value}]
        if not isinstance(value, Sequence) or not value:
            raise DatasetError(f"{where}: is neither a string nor a list of {{role, content}} messages: {value!r:.80}")
        out = []
        for i, message in enumerate(value):
            if not (isinstance(message, Mapping) and isinstance(message.get("role"), str)
                    and isinstance(message.get("content"), str)):
                raise DatasetError(f"{where}[{i}]: is not a {{role, content}} message of strings: {message!r:.80}")
            out.append({"role": message["role"], "content": message["content"]})
        return out

    def render(self, value: Any, where: str) -> str:
        if not self.templated:
            if isinstance(value, str):
                return value
            self.messages(value, where)  # names a malformed one first
            raise DatasetError(f"{where}: holds chat messages, but prompts are not rendered with a chat template "
                               "(task.chat_template = false, or the tokenizer has none)")
        messages = self.messages(value, where)
        if self.system_prompt and messages[0]["role"] != "system":
            messages = [{"role": "system", "content": self.system_prompt}, *messages]
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    def split(self, rows: list[dict[str, Any]], source: RowSource, prompt: str, positions: Sequence[int]) -> Split:
        """Render and tokenize `rows` (read at `positions` of `source`),
        leaving out those too long."""
        out = Split(source=source)
        first: tuple[int, bool] | None = None  # the first row's position, and whether its prompt is a string
        for row, position in zip(rows, positions, strict=True):
            where = source.where(position)
            value = row.get(prompt)
            if value is None:
                raise DatasetError(f"{where}: has no field {prompt!r} (task.prompt)")
            text = self.render(value, f"{where}: field {prompt!r}")
            if first is None:
                first = (position, isinstance(value, str))
            elif isinstance(value, str) != first[1] and not out.warnings:
                kinds = ("a list of chat messages", "a string") if first[1] else ("a string", "a list of chat messages")
                out.warnings.append(
                    f"{where}: field {prompt!r} is {kinds[0]}, while {source.unit} {source.number(first[0])} has "
                    f"{kinds[1]}: the column mixes plain prompts and chat messages (each is rendered as it is)"
                )
            ids = self.tokenizer.encode(text, add_special_tokens=False)
            if len(ids) > self.max_tokens:
                out.skipped[f"longer than task.max_prompt_tokens = {self.max_tokens}"] += 1
                continue
            out.rows.append(row)
            out.texts.append(text)
            out.ids.append(list(ids))
            out.positions.append(position)
        return out


class RowTask:
    """A task whose prompts are rows (see the module docstring): what the
    dataset and reasoning-gym tasks share."""

    name = "dataset"
    scored_by_functions = True

    def __init__(self, train: Split, heldout: Split, seed: int, answer: str, tokenizer: Any):
        _leave_out_heldout(train, heldout)
        self.tokenizer = tokenizer
        if not len(train):
            raise DatasetError("no training rows are left after loading (see the rows left out, above)")
        self.train, self.heldout, self.seed, self.answer = train, heldout, seed, answer

    # -- training prompts -------------------------------------------------------

    @functools.lru_cache(maxsize=4)
    def _order(self, epoch: int) -> np.ndarray:
        return np.random.default_rng((self.seed, 5, epoch)).permutation(len(self.train))

    def index(self, group_id: int) -> int:
        """The training row of group `group_id`."""
        epoch, i = divmod(group_id, len(self.train))
        return int(self._order(epoch)[i])

    def row(self, group_id: int) -> Mapping[str, Any]:
        return self.train.rows[self.index(group_id)]

    def prompt_text(self, group_id: int) -> str:
        return self.train.texts[self.index(group_id)]

    @property
    def warnings(self) -> list[str]:
        """What looked wrong in the rows that loaded, training and held out."""
        return self.train.warnings + self.heldout.warnings

    def where(self, group_id: int) -> str:
        """The training row of group `group_id`, as its file numbers it."""
        return self.train.where(self.index(group_id))

    def reference(self, row: Mapping[str, Any]) -> str:
        value = row.get(self.answer) if self.answer else None
        return "" if value is None else str(value)

    def prompt(self, group_id: int, n: int, min_version: int = 0) -> PromptGroup:
        i = self.index(group_id)
        return PromptGroup(
            group_id=group_id,
            prompt_ids=self.train.ids[i],
            n=n,
            reference=self.reference(self.train.rows[i]),
            task=self.name,
            min_version=min_version,
        )

    def decode(self, ids: np.ndarray) -> str:
        return self.tokenizer.decode(ids.tolist(), skip_special_tokens=True)

    def score(self, group: GroupInfo, index: int, response_ids: np.ndarray) -> tuple[float, dict[str, float]]:
        raise TypeError(f"the {self.name} task is scored by reward functions (roles.reward.engine.kind = 'functions')")

    # -- held-out prompts -------------------------------------------------------

    def heldout_prompts(self) -> list[list[int]]:
        return self.heldout.ids

    def heldout_rows(self) -> list[tuple[dict[str, Any], str]]:
        """(row, reference answer) of every held-out row (the episodes of an environment)."""
        return [(dict(row), self.reference(row)) for row in self.heldout.rows]

    def heldout_samples(self, responses: list[list[int]]) -> list[Any]:
        """What reward functions see of each held-out answer."""
        from rlflow.rewards import Sample

        return [
            Sample(prompt=text, response=self.decode(np.asarray(ids)), response_ids=tuple(ids),
                   reference=self.reference(row), row=dict(row))
            for text, row, ids in zip(self.heldout.texts, self.heldout.rows, responses, strict=True)
        ]


class DatasetTaskImpl(RowTask):
    """The `dataset` task (see the module docstring)."""

    name = "dataset"

    def __init__(self, cfg: DatasetTask, seed: int, tokenizer: Any):
        renderer = Renderer(tokenizer, chat_template=cfg.chat_template, system_prompt=cfg.system_prompt,
                            max_tokens=cfg.max_prompt_tokens)
        rows, source = read_rows(cfg.train), RowSource(cfg.train, cfg.train)
        _check_answers(rows, source, cfg.answer)
        positions = list(range(len(rows)))
        if cfg.eval:
            heldout_rows, heldout_source = read_rows(cfg.eval), RowSource(cfg.eval, cfg.eval)
            _check_answers(heldout_rows, heldout_source, cfg.answer)
            heldout_positions = list(range(len(heldout_rows)))
        else:
            # A fixed share, whatever the run's seed: runs of one dataset compare.
            order = np.random.default_rng((0, 6)).permutation(len(rows))
            cut = round(cfg.eval_fraction * len(rows))
            held = set(order[:cut].tolist())
            heldout_positions = sorted(held)
            heldout_rows = [rows[i] for i in heldout_positions]
            positions = [i for i in positions if i not in held]
            rows = [rows[i] for i in positions]
            heldout_source = source
        if cfg.eval_size:
            heldout_rows, heldout_positions = heldout_rows[: cfg.eval_size], heldout_positions[: cfg.eval_size]
        super().__init__(
            renderer.split(rows, source, cfg.prompt, positions),
            renderer.split(heldout_rows, heldout_source, cfg.prompt, heldout_positions),
            seed,
            cfg.answer,
            tokenizer,
        )


class ReasoningGymTaskImpl(RowTask):
    """The `reasoning_gym` task: problems generated locally, each a row with its
    question, answer and metadata (which `rlflow.rewards:reasoning_gym` scores)."""

    name = "reasoning_gym"

    def __init__(self, cfg: ReasoningGymTask, seed: int, tokenizer: Any):
        try:
            import reasoning_gym
        except ImportError:
            raise DatasetError("task.kind = 'reasoning_gym' needs the reasoning-gym package: "
                               "pip install 'rlflow[tasks]'") from None
        renderer = Renderer(tokenizer, chat_template=cfg.chat_template, system_prompt=cfg.system_prompt,
                            max_tokens=cfg.max_prompt_tokens)

        def generate(size: int, seed: int) -> list[dict[str, Any]]:
            if not size:
                return []
            try:
                made = reasoning_gym.create_dataset(cfg.dataset, size=size, seed=seed, **cfg.options)
            except Exception as exc:  # unknown name or options: the package's own errors
                raise DatasetError(f"reasoning-gym dataset {cfg.dataset!r}: {type(exc).__name__}: {exc}") from None
            return [dict(entry) for entry in made]

        # Training problems from the run's seed; the evaluation's from its own, so that every seed is
        # evaluated on the same problems (and none of them is trained on).
        train, heldout = generate(cfg.size, seed * 1000 + 1), generate(cfg.eval_size, cfg.eval_seed)
        source = f"reasoning-gym:{cfg.dataset}"
        train_split = renderer.split(train, RowSource(source), "question", range(len(train)))
        heldout_split = renderer.split(heldout, RowSource(f"{source} (evaluation)"), "question", range(len(heldout)))
        _leave_out_heldout(train_split, heldout_split)
        super().__init__(
            train_split,
            heldout_split,
            seed,
            "answer",
            tokenizer,
        )


def _check_answers(rows: list[dict[str, Any]], source: RowSource, answer: str) -> None:
    """The answer column, if one is named, is in every row."""
    if not answer:
        return
    for i, row in enumerate(rows):
        if answer not in row:
            raise DatasetError(f"{source.where(i)}: has no field {answer!r} (task.answer; set it to \"\" for none)")


def _leave_out_heldout(train: Split, heldout: Split) -> None:
    """Training rows whose prompt is also a held-out prompt are left out (and
    counted), so that the evaluation is on prompts never trained on."""
    held = set(heldout.texts)
    keep = [i for i, text in enumerate(train.texts) if text not in held]
    if len(keep) < len(train):
        train.skipped["also in the evaluation split"] += len(train) - len(keep)
        train.rows = [train.rows[i] for i in keep]
        train.texts = [train.texts[i] for i in keep]
        train.ids = [train.ids[i] for i in keep]
        train.positions = [train.positions[i] for i in keep]
