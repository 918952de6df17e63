"""Hypothesis strategies for every wire message, derived from msgspec's type info.

Deriving them from the Structs themselves means a message or field added
later is covered by the round-trip tests without touching them.
"""

from __future__ import annotations

import math

import msgspec
import numpy as np
from hypothesis import strategies as st

from rlflow.protocol import (
    DTYPE_SIZES,
    MESSAGE_TYPES,
    Credits,
    Expired,
    PromptGroup,
    Response,
    SampleBatch,
    SampleFailure,
    Stage,
    Tensor,
    WeightsPayload,
    build_batch,
    with_text,
)

_I64 = 2**63 - 1


@st.composite
def tensors(draw, dtype: str | None = None, max_numel: int = 64) -> Tensor:
    """A tensor of any wire dtype and shape, with arbitrary bytes (NaNs,
    infinities and denormals included: equality is bit-exact)."""
    dtype = dtype or draw(st.sampled_from(sorted(DTYPE_SIZES)))
    ndim = draw(st.integers(0, 3))
    shape = tuple(draw(st.lists(st.integers(0, 4), min_size=ndim, max_size=ndim)))
    numel = math.prod(shape)
    if numel > max_numel:
        shape = (max_numel,)
        numel = max_numel
    raw = draw(st.binary(min_size=numel * DTYPE_SIZES[dtype], max_size=numel * DTYPE_SIZES[dtype]))
    if dtype == "bool":
        raw = bytes(b & 1 for b in raw)
    return Tensor(dtype, shape, np.frombuffer(raw, dtype=np.uint8).copy())


def _strategy(t: msgspec.inspect.Type) -> st.SearchStrategy:
    insp = msgspec.inspect
    if isinstance(t, insp.IntType):
        lo = t.ge if t.ge is not None else (t.gt + 1 if t.gt is not None else -_I64)
        hi = t.le if t.le is not None else (t.lt - 1 if t.lt is not None else _I64)
        return st.integers(lo, hi)
    if isinstance(t, insp.FloatType):
        lo = t.ge if t.ge is not None else None
        hi = t.le if t.le is not None else None
        # NaN would make equal messages compare unequal; tensors carry NaNs instead.
        return st.floats(min_value=lo, max_value=hi, allow_nan=False, allow_infinity=lo is None and hi is None)
    if isinstance(t, insp.StrType):
        return st.text(max_size=12)
    if isinstance(t, insp.BoolType):
        return st.booleans()
    if isinstance(t, insp.NoneType):
        return st.none()
    if isinstance(t, insp.EnumType):
        return st.sampled_from(list(t.cls))
    if isinstance(t, (insp.ListType, insp.VarTupleType)):
        return st.lists(_strategy(t.item_type), max_size=4)
    if isinstance(t, insp.DictType):
        return st.dictionaries(_strategy(t.key_type), _strategy(t.value_type), max_size=3)
    if isinstance(t, insp.UnionType):
        return st.one_of([_strategy(m) for m in t.types])
    if isinstance(t, insp.CustomType) and t.cls is Tensor:
        return tensors()
    if isinstance(t, insp.StructType):
        return structs(t.cls)
    if isinstance(t, insp.AnyType):
        return _plain
    raise NotImplementedError(f"no strategy for {t!r}")


#: Plain data, as an environment's row or state holds (msgpack's own types, no NaN).
_plain = st.recursive(
    st.none() | st.booleans() | st.integers(-_I64, _I64) | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8,
)


def structs(cls: type) -> st.SearchStrategy:
    if cls in _CONSISTENT:
        return _CONSISTENT[cls]()
    info = msgspec.inspect.type_info(cls)
    return st.builds(cls, **{f.name: _strategy(f.type) for f in info.fields})


def messages() -> st.SearchStrategy:
    """Any message of any kind."""
    return st.one_of([structs(cls) for cls in MESSAGE_TYPES.values()])


@st.composite
def _parallel(draw, cls: type, a: str, b: str) -> msgspec.Struct:
    """A message whose lists `a` and `b` are as long as each other."""
    info = {f.name: f.type for f in msgspec.inspect.type_info(cls).fields}
    size = draw(st.integers(0, 4))
    fields = {name: draw(_strategy(t)) for name, t in info.items() if name not in (a, b)}
    for name in (a, b):
        fields[name] = draw(st.lists(_strategy(info[name].item_type), min_size=size, max_size=size))
    return cls(**fields)


@st.composite
def sample_batches(draw) -> SampleBatch:
    """A consistent batch: groups of responses of any length, optional columns drawn too."""
    groups = []
    for g in range(draw(st.integers(0, 3))):
        responses = []
        for _ in range(draw(st.integers(0, 3))):
            t = draw(st.integers(0, 6))
            floats = st.floats(width=32, allow_nan=True, allow_infinity=True)
            responses.append(
                Response(
                    token_ids=np.asarray(draw(st.lists(st.integers(0, 2**31 - 1), min_size=t, max_size=t)), np.int32),
                    logprobs=np.asarray(draw(st.lists(floats, min_size=t, max_size=t)), np.float32),
                    versions=np.asarray(draw(st.lists(st.integers(0, 2**31 - 1), min_size=t, max_size=t)), np.int32),
                    finish_reason=draw(st.integers(0, 3)),
                )
            )
        prompt = draw(st.lists(st.integers(0, 2**31 - 1), max_size=5))
        groups.append((PromptGroup(group_id=g, prompt_ids=prompt, n=max(1, len(responses)),
                                   reference=draw(st.text(max_size=5))), responses))
    batch = build_batch(groups)
    n, t = batch.n_samples, batch.n_tokens
    if draw(st.booleans()):
        batch = msgspec.structs.replace(
            batch, rewards=Tensor.of(draw(st.lists(st.floats(width=32), min_size=n, max_size=n)), "float32")
        )
    if draw(st.booleans()):
        batch = msgspec.structs.replace(batch, teacher_logprobs=Tensor.of(np.zeros(t), "float32"))
    if draw(st.booleans()):
        batch = msgspec.structs.replace(
            batch, advantages=Tensor.of(draw(st.lists(st.floats(width=32), min_size=n, max_size=n)), "float32")
        )
    if draw(st.booleans()):
        k = draw(st.integers(1, 4))
        batch = msgspec.structs.replace(
            batch,
            teacher_topk_ids=Tensor.from_numpy(np.zeros((t, k), np.int32)),
            teacher_topk_logprobs=Tensor.from_numpy(np.full((t, k), -1.0, np.float32)),
        )
    if draw(st.booleans()):
        mask = draw(st.lists(st.integers(0, 1), min_size=t, max_size=t))
        batch = msgspec.structs.replace(batch, loss_mask=Tensor.from_numpy(np.asarray(mask, np.uint8)))
    if draw(st.booleans()):
        k = draw(st.integers(1, 3))
        turns = draw(st.lists(st.floats(width=32), min_size=n * k, max_size=n * k))
        batch = msgspec.structs.replace(
            batch, env_rewards=Tensor.from_numpy(np.asarray(turns, np.float32).reshape(n, k))
        )
    if draw(st.booleans()):
        words = st.text(st.characters(codec="utf-8"), max_size=4)
        batch = with_text(batch, lambda ids: draw(words))
    if n and draw(st.booleans()):
        failures = [SampleFailure(index=draw(st.integers(0, n - 1)), stage=Stage.REWARD_END, kind="timeout")]
        batch = msgspec.structs.replace(batch, failures=failures)
    return batch


_CONSISTENT = {
    SampleBatch: sample_batches,
    Credits: lambda: _parallel(Credits, "group_ids", "min_versions"),
    Expired: lambda: _parallel(Expired, "group_ids", "errors"),
    WeightsPayload: lambda: _parallel(WeightsPayload, "names", "tensors"),
}


# -- hostile msgpack ------------------------------------------------------------


@st.composite
def nested(draw, min_depth: int = 1, max_depth: int = 20_000) -> bytes:
    """A msgpack value nested `depth` levels deep: arrays and one-entry maps,
    mixed, around a leaf."""
    depth = draw(st.integers(min_depth, max_depth))
    openers = draw(st.lists(st.sampled_from([b"\x91", b"\x81\xa1k", b"\xdc\x00\x01", b"\x81\x00"]),
                            min_size=1, max_size=4))
    leaf = draw(st.sampled_from([b"\x00", b"\xc0", b"\xa1x", b"\x90", b"\x80"]))
    return b"".join(openers[i % len(openers)] for i in range(depth)) + leaf


@st.composite
def oversized(draw) -> bytes:
    """A msgpack value that declares far more than it holds, or that really
    holds a large flat array or string."""
    count = draw(st.sampled_from([2**16, 2**31, 2**32 - 1]))
    declared = draw(
        st.sampled_from(
            [
                b"\xdd" + count.to_bytes(4, "big"),  # array32
                b"\xdf" + count.to_bytes(4, "big"),  # map32
                b"\xdb" + count.to_bytes(4, "big"),  # str32
                b"\xc6" + count.to_bytes(4, "big"),  # bin32
                b"\xc9" + count.to_bytes(4, "big") + b"\x01",  # ext32
            ]
        )
    )
    real = draw(st.integers(1, 200_000))
    flat = draw(
        st.sampled_from(
            [
                b"\xdd" + real.to_bytes(4, "big") + b"\xc0" * real,  # many nils
                b"\xdd" + real.to_bytes(4, "big") + b"\x01" * real,  # many ints
                b"\xdb" + real.to_bytes(4, "big") + b"a" * real,  # a long string
            ]
        )
    )
    return draw(st.sampled_from([declared + draw(st.binary(max_size=16)), flat]))


def hostile() -> st.SearchStrategy:
    return st.one_of(nested(), oversized())


def _slots(value, path=()):
    """Paths to every element of a decoded header, containers included."""
    yield path
    if isinstance(value, list):
        for i, item in enumerate(value):
            yield from _slots(item, (*path, i))
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _slots(item, (*path, key))


_HOLE = "\x00rlflow-hole\x00"


@st.composite
def spliced(draw, frames: list[bytes]) -> list[bytes]:
    """`frames` (an encoded message) with a hostile value put in place of one
    element of its header, or appended to the message as an extra field."""
    header = msgspec.msgpack.decode(frames[0])
    slots = list(_slots(header))
    path = draw(st.sampled_from(slots + [("append",)]))
    if path == ("append",):
        header[1].append(_HOLE)
    elif not path:
        header = _HOLE
    else:
        node = header
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = _HOLE
    hole = msgspec.msgpack.encode(_HOLE)
    raw = msgspec.msgpack.encode(header)
    assert raw.count(hole) == 1
    return [raw.replace(hole, draw(hostile())), *frames[1:]]
