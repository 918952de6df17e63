"""Build columnar `SampleBatch`es from per-sample responses, and read them back.

Producers (rollout engines) hand in one `Response` per sample; consumers see
one `SampleView` per row. Both sides work on numpy arrays; the batch itself
holds `Tensor`s, so it travels as a handful of frames however many samples it
carries.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, overload

import msgspec
import numpy as np

from .messages import GroupInfo, PromptGroup, SampleBatch, SampleFailure, Stage
from .tensors import Tensor

N_STAGES = len(Stage)


@dataclass
class Response:
    """One generated sample, as an engine produces it."""

    token_ids: np.ndarray
    """int32 [t]"""
    logprobs: np.ndarray
    """float32 [t]: behaviour log-probability of each token."""
    versions: np.ndarray
    """int32 [t]: policy version of each token."""
    finish_reason: int
    stamps: np.ndarray = field(default_factory=lambda: np.full(N_STAGES, np.nan))
    """float64 [S]"""
    error: str | None = None
    """Why the engine could not generate it (then it is a failed sample in the batch)."""
    loss_mask: np.ndarray | None = None
    """uint8 [t]: 1 where the token is the policy's own (an episode's; None: every token is)."""
    env_rewards: np.ndarray | None = None
    """float32 [turns]: an episode's reward from its environment at each turn."""
    failure_kind: str = "engine_error"
    """`SampleFailure.kind` of a response with an `error`."""

    def __post_init__(self) -> None:
        t = len(self.token_ids)
        if len(self.logprobs) != t or len(self.versions) != t:
            raise ValueError(
                f"response has {t} tokens but {len(self.logprobs)} log-probs and {len(self.versions)} versions"
            )
        if self.loss_mask is not None and len(self.loss_mask) != t:
            raise ValueError(f"response has {t} tokens but a loss mask of {len(self.loss_mask)}")


def build_batch(groups: Sequence[tuple[PromptGroup, Sequence[Response]]]) -> SampleBatch:
    """One batch holding every group's responses, in order."""
    infos, prompts, prompt_lens = [], [], []
    rows: list[tuple[int, Response]] = []  # (index in its group, response)
    for group, responses in groups:
        infos.append(
            GroupInfo(
                group_id=group.group_id,
                size=len(responses),
                n=group.n,
                reference=group.reference,
                task=group.task,
                meta=group.meta,
            )
        )
        prompts.append(np.asarray(group.prompt_ids, dtype=np.int32))
        prompt_lens.append(len(group.prompt_ids))
        rows.extend((i, r) for i, r in enumerate(responses))
    lens = [len(r.token_ids) for _, r in rows]
    failures = [
        SampleFailure(index=row, stage=Stage.ROLLOUT_END, kind=r.failure_kind, message=r.error)
        for row, (_, r) in enumerate(rows)
        if r.error is not None
    ]
    responses = [r for _, r in rows]
    return SampleBatch(
        groups=infos,
        prompt_ids=Tensor.from_numpy(_cat(prompts, np.int32)),
        prompt_offsets=Tensor.from_numpy(_offsets(prompt_lens)),
        sample_index=Tensor.of([i for i, _ in rows], "int32"),
        response_ids=Tensor.from_numpy(_cat([r.token_ids for _, r in rows], np.int32)),
        response_offsets=Tensor.from_numpy(_offsets(lens)),
        logprobs=Tensor.from_numpy(_cat([r.logprobs for _, r in rows], np.float32)),
        versions=Tensor.from_numpy(_cat([r.versions for _, r in rows], np.int32)),
        finish_reason=Tensor.of([r.finish_reason for _, r in rows], "uint8"),
        stamps=Tensor.from_numpy(
            np.stack([np.asarray(r.stamps, dtype=np.float64) for _, r in rows])
            if rows
            else np.zeros((0, N_STAGES))
        ),
        failures=failures,
        loss_mask=_masks([(r.loss_mask, len(r.token_ids)) for r in responses]),
        env_rewards=_turn_rewards([r.env_rewards for r in responses]),
    )


def _masks(parts: Sequence[tuple[np.ndarray | None, int]]) -> Tensor | None:
    """The loss-mask column of samples with these (mask, length): None if no
    sample has a mask; a sample without one has every token trained on."""
    if all(mask is None for mask, _ in parts):
        return None
    return Tensor.from_numpy(_cat([np.ones(n, np.uint8) if mask is None else mask for mask, n in parts], np.uint8))


def _turn_rewards(rows: Sequence[np.ndarray | None]) -> Tensor | None:
    """The [n, K] column of per-turn rewards (K the most turns; NaN past a
    sample's last turn and for a sample without any); None if no sample has them."""
    if all(r is None for r in rows):
        return None
    width = max(len(r) for r in rows if r is not None)
    out = np.full((len(rows), width), np.nan, np.float32)
    for i, r in enumerate(rows):
        if r is not None:
            out[i, : len(r)] = r
    return Tensor.from_numpy(out)


def with_text(batch: SampleBatch, decode: Callable[[np.ndarray], str]) -> SampleBatch:
    """A copy of `batch` with its text columns (SPEC.md, *Text*): `decode` of each sample's response
    tokens and of each group's prompt tokens, as UTF-8."""
    p_off, r_off = batch.prompt_offsets.numpy().tolist(), batch.response_offsets.numpy().tolist()
    prompt_ids, response_ids = batch.prompt_ids.numpy(), batch.response_ids.numpy()
    prompts = [decode(prompt_ids[p_off[g] : p_off[g + 1]]) for g in range(len(batch.groups))]
    responses = [decode(response_ids[r_off[i] : r_off[i + 1]]) for i in range(batch.n_samples)]
    return msgspec.structs.replace(batch, **_text_column("prompt_text", [t.encode() for t in prompts]),
                                   **_text_column("response_text", [t.encode() for t in responses]))


def _text_column(name: str, rows: Sequence[bytes | np.ndarray]) -> dict[str, Tensor]:
    """A text column `name` and its offsets, of these rows of UTF-8 bytes."""
    parts = [np.frombuffer(r, np.uint8) if isinstance(r, bytes) else r for r in rows]
    offsets = _offsets([len(r) for r in parts])
    return {name: Tensor.from_numpy(_cat(parts, np.uint8)), f"{name}_offsets": Tensor.from_numpy(offsets)}


def _text_rows(batch: SampleBatch, name: str, rows: Sequence[int]) -> dict[str, Tensor]:
    """The text column `name` of just these rows of `batch`, in this order (nothing if it has none)."""
    data = getattr(batch, name)
    if data is None:
        return {}
    buf, off = data.numpy(), getattr(batch, f"{name}_offsets").numpy().tolist()
    return _text_column(name, [buf[off[r] : off[r + 1]] for r in rows])


def text_of(data: Tensor | None, offsets: Tensor | None) -> list[str] | None:
    """The rows of a text column, as strings (None without one)."""
    if data is None or offsets is None:
        return None
    buf, off = data.numpy(), offsets.numpy().tolist()
    return [buf[a:b].tobytes().decode() for a, b in zip(off, off[1:])]


def stamp(batch: SampleBatch, stage: Stage, when: float, rows: np.ndarray | None = None, **fields: Any) -> SampleBatch:
    """A copy of `batch` with `stage` set to `when` (for every row, or `rows`)
    and with `fields` replaced (one copy, checked once)."""
    stamps = batch.stamps.numpy()
    if stamps.shape[1] <= stage:
        wide = np.full((stamps.shape[0], N_STAGES), np.nan)
        wide[:, : stamps.shape[1]] = stamps
        stamps = wide
    else:
        stamps = stamps.copy()
    if rows is None:
        stamps[:, stage] = when
    else:
        stamps[rows, stage] = when
    return msgspec.structs.replace(batch, stamps=Tensor.from_numpy(stamps), **fields)


def concat(batches: Sequence[SampleBatch]) -> SampleBatch:
    """One batch with the rows of all `batches`, in order.

    Optional per-token and per-sample columns (rewards, teacher log-probs,
    reward details, the critic's columns) are kept only if every batch has them
    (batches of one `layout` lose nothing).
    """
    if len(batches) == 1:
        return batches[0]
    return concat_groups([(b, 0, len(b.groups)) for b in batches])


def concat_groups(pieces: Sequence[tuple[SampleBatch, int, int]]) -> SampleBatch:
    """One batch of groups ``g0`` to ``g1`` (not included) of each ``(batch, g0, g1)`` of `pieces`, in order:
    `concat` of each piece's rows, with each column copied once and no batch made per piece (a trainer cuts
    a step of thousands of groups out of the messages they came in). A piece of a whole batch is the
    batch's rows; the optional columns are kept as `concat` keeps them."""
    if len(pieces) == 1 and pieces[0][1] == 0 and pieces[0][2] == len(pieces[0][0].groups):
        return pieces[0][0]
    batches = [b for b, _, _ in pieces]
    firsts: dict[int, list[int]] = {}  # id(batch) -> the first row of each group, and the row count
    rows, tokens, prompts = [], [], []  # per piece: (first, end) of its rows, of its tokens, of its prompt ids
    for b, g0, g1 in pieces:
        first = firsts.get(id(b))
        if first is None:
            first = firsts[id(b)] = [0, *itertools.accumulate(g.size for g in b.groups)]
        a, z = first[g0], first[g1]
        r_off, p_off = b.response_offsets.numpy(), b.prompt_offsets.numpy()
        rows.append((a, z))
        tokens.append((int(r_off[a]), int(r_off[z])))
        prompts.append((int(p_off[g0]), int(p_off[g1])))

    groups = [(g0, g1) for _, g0, g1 in pieces]

    def col(name: str, spans: list[tuple[int, int]]) -> list[np.ndarray]:
        return [getattr(b, name).numpy()[a:z] for b, (a, z) in zip(batches, spans)]

    def opt(name: str, spans: list[tuple[int, int]]) -> Tensor | None:
        values = [getattr(b, name) for b in batches]
        if any(v is None for v in values) or len({v.shape[1:] for v in values}) > 1:
            return None
        return Tensor.from_numpy(np.concatenate(col(name, spans)))

    def offsets(name: str, spans: list[tuple[int, int]]) -> Tensor:
        """The offsets column `name` of the rows `spans` say (each with its end)."""
        return Tensor.from_numpy(_join_offsets(col(name, [(a, z + 1) for a, z in spans])))

    detail_keys = set.intersection(*(set(b.reward_details) for b in batches)) if batches else set()
    failures, row0 = [], 0
    for b, (a, z) in zip(batches, rows):
        failures += [msgspec.structs.replace(f, index=f.index - a + row0) for f in b.failures if a <= f.index < z]
        row0 += z - a
    width = max((b.stamps.shape[1] for b in batches), default=N_STAGES)
    stamps = []
    for s in col("stamps", rows):
        if s.shape[1] < width:
            s = np.concatenate([s, np.full((s.shape[0], width - s.shape[1]), np.nan)], axis=1)
        stamps.append(s)
    return SampleBatch(
        groups=[g for b, g0, g1 in pieces for g in b.groups[g0:g1]],
        prompt_ids=Tensor.from_numpy(_cat(col("prompt_ids", prompts), np.int32)),
        prompt_offsets=offsets("prompt_offsets", groups),
        sample_index=Tensor.from_numpy(_cat(col("sample_index", rows), np.int32)),
        response_ids=Tensor.from_numpy(_cat(col("response_ids", tokens), np.int32)),
        response_offsets=offsets("response_offsets", rows),
        logprobs=Tensor.from_numpy(_cat(col("logprobs", tokens), np.float32)),
        versions=Tensor.from_numpy(_cat(col("versions", tokens), np.int32)),
        finish_reason=Tensor.from_numpy(_cat(col("finish_reason", rows), np.uint8)),
        stamps=Tensor.from_numpy(np.concatenate(stamps) if stamps else np.zeros((0, width))),
        rewards=opt("rewards", rows),
        reward_details={
            k: Tensor.from_numpy(np.concatenate([b.reward_details[k].numpy()[a:z] for b, (a, z) in zip(batches, rows)]))
            for k in sorted(detail_keys)
        },
        teacher_logprobs=opt("teacher_logprobs", tokens),
        ref_logprobs=opt("ref_logprobs", tokens),
        failures=failures,
        **_topk(opt("teacher_topk_ids", tokens), opt("teacher_topk_logprobs", tokens)),
        advantages=opt("advantages", rows),
        loss_mask=_masks([(None if b.loss_mask is None else b.loss_mask.numpy()[a:z], z - a)
                          for b, (a, z) in zip(batches, tokens)]),
        env_rewards=_turn_rewards([r for b, (a, z) in zip(batches, rows) for r in _rows_of(b.env_rewards, a, z)]),
        **{name: opt(name, tokens) for name in ("values", "returns", "token_advantages")},
        critic_versions=opt("critic_versions", rows),
        **_joined_text(batches, "response_text", rows),
        **_joined_text(batches, "prompt_text", groups),
    )


def layout(batch: SampleBatch) -> tuple:
    """What `concat` keeps only where every batch has it alike: which of the optional columns a batch
    has, with their shapes past the first axis (the top-k's k), its reward details' names and shapes,
    and its text columns. Batches of one layout are joined whole."""
    return (
        tuple(None if (col := getattr(batch, name)) is None else col.shape[1:] for name in _OPTIONAL_COLUMNS),
        tuple(sorted((key, col.shape[1:]) for key, col in batch.reward_details.items())),
        batch.response_text is None,
        batch.prompt_text is None,
    )


def _joined_text(batches: Sequence[SampleBatch], name: str, spans: Sequence[tuple[int, int]]) -> dict[str, Tensor]:
    """The text column `name` of rows ``a`` to ``z`` of each of `batches` (`spans`), if every one has it."""
    if any(getattr(b, name) is None for b in batches):
        return {}
    data, offsets = [], []
    for b, (a, z) in zip(batches, spans):
        off = getattr(b, f"{name}_offsets").numpy()
        data.append(getattr(b, name).numpy()[off[a] : off[z]])
        offsets.append(off[a : z + 1])
    return {name: Tensor.from_numpy(_cat(data, np.uint8)), f"{name}_offsets": Tensor.from_numpy(_join_offsets(offsets))}


def _rows_of(column: Tensor | None, a: int, z: int) -> list[np.ndarray | None]:
    """Rows `a` to `z` of an optional 2-D per-sample column (None each without it)."""
    return [None] * (z - a) if column is None else list(column.numpy()[a:z])


def _topk(ids: Tensor | None, logprobs: Tensor | None) -> dict[str, Tensor | None]:
    """The top-k columns, kept only if both are there (and of one k)."""
    if ids is None or logprobs is None or ids.shape != logprobs.shape:
        return {}
    return {"teacher_topk_ids": ids, "teacher_topk_logprobs": logprobs}


def take(batch: SampleBatch, rows: Sequence[int] | np.ndarray) -> SampleBatch:
    """A batch of the given rows of `batch`, in the order given (rows of one
    group must be contiguous); groups left with no rows are dropped. Every
    row in order, of groups that all have rows, is `batch` itself (no copy)."""
    rows = np.asarray(rows, dtype=np.int64)
    if len(rows) == batch.n_samples and np.array_equal(rows, np.arange(len(rows))) and \
            all(g.size for g in batch.groups):
        return batch
    r_off = batch.response_offsets.numpy()
    p_off = batch.prompt_offsets.numpy()
    group_of = np.repeat(np.arange(len(batch.groups)), [g.size for g in batch.groups])
    # Every token of every row, in row order: each row's first token, then on.
    starts, lens = r_off[rows], r_off[rows + 1] - r_off[rows]
    token_idx = np.arange(int(lens.sum()), dtype=np.int64) + np.repeat(starts - (np.cumsum(lens) - lens), lens)
    groups, prompts, prompt_lens, kept = [], [], [], []
    for g, count in _runs(group_of[rows]):
        kept.append(g)
        info = batch.groups[g]
        groups.append(msgspec.structs.replace(info, size=count))
        prompts.append(batch.prompt_ids.numpy()[p_off[g] : p_off[g + 1]])
        prompt_lens.append(p_off[g + 1] - p_off[g])
    new_index = {int(old): new for new, old in enumerate(rows)}

    @overload
    def tok(t: Tensor) -> Tensor: ...
    @overload
    def tok(t: None) -> None: ...
    def tok(t: Tensor | None) -> Tensor | None:
        return None if t is None else Tensor.from_numpy(t.numpy()[token_idx])

    @overload
    def per_row(t: Tensor) -> Tensor: ...
    @overload
    def per_row(t: None) -> None: ...
    def per_row(t: Tensor | None) -> Tensor | None:
        return None if t is None else Tensor.from_numpy(t.numpy()[rows])

    return SampleBatch(
        groups=groups,
        prompt_ids=Tensor.from_numpy(_cat(prompts, np.int32)),
        prompt_offsets=Tensor.from_numpy(_offsets(prompt_lens)),
        sample_index=per_row(batch.sample_index),
        response_ids=tok(batch.response_ids),
        response_offsets=Tensor.from_numpy(_offsets(np.diff(r_off)[rows])),
        logprobs=tok(batch.logprobs),
        versions=tok(batch.versions),
        finish_reason=per_row(batch.finish_reason),
        stamps=per_row(batch.stamps),
        rewards=per_row(batch.rewards),
        reward_details={k: per_row(v) for k, v in batch.reward_details.items()},
        teacher_logprobs=tok(batch.teacher_logprobs),
        ref_logprobs=tok(batch.ref_logprobs),
        teacher_topk_ids=tok(batch.teacher_topk_ids),
        teacher_topk_logprobs=tok(batch.teacher_topk_logprobs),
        failures=[
            msgspec.structs.replace(f, index=new_index[f.index]) for f in batch.failures if f.index in new_index
        ],
        advantages=per_row(batch.advantages),
        loss_mask=tok(batch.loss_mask),
        env_rewards=per_row(batch.env_rewards),
        values=tok(batch.values),
        returns=tok(batch.returns),
        token_advantages=tok(batch.token_advantages),
        critic_versions=per_row(batch.critic_versions),
        **_text_rows(batch, "response_text", rows.tolist()),
        **_text_rows(batch, "prompt_text", kept),
    )


def split(batch: SampleBatch) -> list[SampleBatch]:
    """One batch per group. Their columns are views of `batch`'s (no copies):
    a group's rows and tokens are contiguous."""
    if len(batch.groups) == 1:
        return [batch]
    p_off, r_off = batch.prompt_offsets.numpy(), batch.response_offsets.numpy()
    prompt_ids = batch.prompt_ids.numpy()
    token_cols = {name: _array(getattr(batch, name)) for name in _TOKEN_COLUMNS}
    row_cols = {name: _array(getattr(batch, name)) for name in _ROW_COLUMNS}
    details = {k: v.numpy() for k, v in batch.reward_details.items()}
    texts = {name: (getattr(batch, name).numpy(), getattr(batch, f"{name}_offsets").numpy())
             for name in ("response_text", "prompt_text") if getattr(batch, name) is not None}
    out, a = [], 0
    for g, info in enumerate(batch.groups):
        b = a + info.size
        ta, tb = int(r_off[a]), int(r_off[b])
        prompt = prompt_ids[p_off[g] : p_off[g + 1]]
        out.append(SampleBatch(
            groups=[info],
            prompt_ids=Tensor.from_numpy(prompt),
            prompt_offsets=Tensor.from_numpy(np.array([0, len(prompt)], dtype=np.int64)),
            response_offsets=Tensor.from_numpy(r_off[a : b + 1] - ta),
            reward_details={k: Tensor.from_numpy(v[a:b]) for k, v in details.items()},
            failures=[msgspec.structs.replace(f, index=f.index - a) for f in batch.failures if a <= f.index < b],
            **_slices(token_cols, ta, tb),
            **_slices(row_cols, a, b),
            **_text_slice(texts, "response_text", a, b),
            **_text_slice(texts, "prompt_text", g, g + 1),
        ))
        a = b
    return out


def _slices(columns: dict[str, np.ndarray | None], a: int, b: int) -> dict[str, Any]:
    """Entries `a` to `b` of each column, as views (a column that is not there stays None), to pass
    as a `SampleBatch`'s keyword arguments."""
    return {name: None if col is None else Tensor.from_numpy(col[a:b]) for name, col in columns.items()}


def _text_slice(texts: dict[str, tuple[np.ndarray, np.ndarray]], name: str, a: int, b: int) -> dict[str, Tensor]:
    """Rows `a` to `b` of the text column `name` (bytes and offsets in `texts`, if it is there), the bytes
    as a view and the offsets rebased to 0."""
    if name not in texts:
        return {}
    data, off = texts[name]
    return {name: Tensor.from_numpy(data[off[a] : off[b]]),
            f"{name}_offsets": Tensor.from_numpy(off[a : b + 1] - off[a])}


#: Columns with one entry (or row) per response token, and with one per sample (row).
_TOKEN_COLUMNS = (
    "response_ids",
    "logprobs",
    "versions",
    "teacher_logprobs",
    "ref_logprobs",
    "teacher_topk_ids",
    "teacher_topk_logprobs",
    "loss_mask",
    "values",
    "returns",
    "token_advantages",
)
_ROW_COLUMNS = ("sample_index", "finish_reason", "stamps", "rewards", "advantages", "env_rewards", "critic_versions")
#: The columns the critic fills in (kept by `concat` only if every batch has them).
_CRITIC_COLUMNS = ("values", "returns", "token_advantages", "critic_versions")
#: The columns `concat` keeps only if every batch has them, of one shape past the first axis.
_OPTIONAL_COLUMNS = ("rewards", "teacher_logprobs", "ref_logprobs", "teacher_topk_ids", "teacher_topk_logprobs",
                     "advantages", *_CRITIC_COLUMNS)


def _array(t: Tensor | None) -> np.ndarray | None:
    return None if t is None else t.numpy()


def _runs(values: np.ndarray) -> list[tuple[int, int]]:
    """(value, run length) of each run of equal values."""
    out: list[tuple[int, int]] = []
    for v in values.tolist():
        if out and out[-1][0] == v:
            out[-1] = (v, out[-1][1] + 1)
        else:
            out.append((v, 1))
    return out


@dataclass(frozen=True)
class SampleView:
    """Row `row` of a batch, as numpy views (no copies)."""

    row: int
    group: GroupInfo
    index: int
    prompt_ids: np.ndarray
    response_ids: np.ndarray
    logprobs: np.ndarray
    versions: np.ndarray
    finish_reason: int
    reward: float | None
    teacher_logprobs: np.ndarray | None
    ref_logprobs: np.ndarray | None
    teacher_topk_ids: np.ndarray | None = None
    teacher_topk_logprobs: np.ndarray | None = None
    loss_mask: np.ndarray | None = None
    """uint8: 1 where the token is the policy's own (None: every token is)."""
    env_rewards: np.ndarray | None = None
    """float32 [K]: the environment's reward at each turn (NaN: no such turn)."""
    values: np.ndarray | None = None
    returns: np.ndarray | None = None
    token_advantages: np.ndarray | None = None
    critic_version: int | None = None
    response_text: str | None = None
    """The response's text, where the batch carries it (SPEC.md, *Text*)."""
    prompt_text: str | None = None
    """The group's prompt's text, where the batch carries it."""


def samples(batch: SampleBatch) -> Iterator[SampleView]:
    """Every row of `batch`, with its group."""
    # Per-row numbers as Python ints and floats once, not a numpy scalar per row.
    p_off = batch.prompt_offsets.numpy().tolist()
    r_off = batch.response_offsets.numpy().tolist()
    prompt_ids = batch.prompt_ids.numpy()
    resp, lp, ver = batch.response_ids.numpy(), batch.logprobs.numpy(), batch.versions.numpy()
    idx, fin = batch.sample_index.numpy().tolist(), batch.finish_reason.numpy().tolist()
    rewards = batch.rewards.numpy().tolist() if batch.rewards is not None else None
    teacher = batch.teacher_logprobs.numpy() if batch.teacher_logprobs is not None else None
    ref = batch.ref_logprobs.numpy() if batch.ref_logprobs is not None else None
    topk_ids = batch.teacher_topk_ids.numpy() if batch.teacher_topk_ids is not None else None
    topk_lps = batch.teacher_topk_logprobs.numpy() if batch.teacher_topk_logprobs is not None else None
    mask = batch.loss_mask.numpy() if batch.loss_mask is not None else None
    env = batch.env_rewards.numpy() if batch.env_rewards is not None else None
    values, returns, token_adv = (_array(batch.values), _array(batch.returns), _array(batch.token_advantages))
    critic = batch.critic_versions.numpy().tolist() if batch.critic_versions is not None else None
    response_text = text_of(batch.response_text, batch.response_text_offsets)
    prompt_text = text_of(batch.prompt_text, batch.prompt_text_offsets)
    row = 0
    for g, info in enumerate(batch.groups):
        prompt = prompt_ids[p_off[g] : p_off[g + 1]]
        for _ in range(info.size):
            a, b = r_off[row], r_off[row + 1]
            yield SampleView(
                row=row,
                group=info,
                index=idx[row],
                prompt_ids=prompt,
                response_ids=resp[a:b],
                logprobs=lp[a:b],
                versions=ver[a:b],
                finish_reason=fin[row],
                reward=None if rewards is None else rewards[row],
                teacher_logprobs=None if teacher is None else teacher[a:b],
                ref_logprobs=None if ref is None else ref[a:b],
                teacher_topk_ids=None if topk_ids is None else topk_ids[a:b],
                teacher_topk_logprobs=None if topk_lps is None else topk_lps[a:b],
                loss_mask=None if mask is None else mask[a:b],
                env_rewards=None if env is None else env[row],
                values=None if values is None else values[a:b],
                returns=None if returns is None else returns[a:b],
                token_advantages=None if token_adv is None else token_adv[a:b],
                critic_version=None if critic is None else critic[row],
                response_text=None if response_text is None else response_text[row],
                prompt_text=None if prompt_text is None else prompt_text[g],
            )
            row += 1


def _cat(arrays: Sequence[np.ndarray], dtype: type) -> np.ndarray:
    if not arrays:
        return np.zeros(0, dtype=dtype)
    return np.concatenate(arrays, dtype=dtype, casting="unsafe")


def _offsets(lengths: Sequence[int]) -> np.ndarray:
    """Offsets from lengths."""
    out = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=out[1:])
    return out


def _join_offsets(parts: Sequence[np.ndarray]) -> np.ndarray:
    """The offsets of the concatenation of the spans of columns that `parts` give (each the offsets of a
    run of rows, from wherever in its column the run starts), in one pass over all of them rather than one
    per part: a trainer joins thousands of groups a step."""
    sizes = np.fromiter((len(p) for p in parts), dtype=np.int64, count=len(parts))
    joined = np.concatenate(parts, dtype=np.int64)
    ends = np.cumsum(sizes)
    starts = ends - sizes
    # Each part from 0, then from where the ones before it end; its leading 0 goes.
    joined -= np.repeat(joined[starts], sizes)
    bases = np.zeros(len(parts), dtype=np.int64)
    np.cumsum(joined[ends[:-1] - 1], out=bases[1:])
    joined += np.repeat(bases, sizes)
    keep = np.ones(len(joined), dtype=bool)
    keep[starts[1:]] = False
    return joined[keep]
