"""Hypothesis strategies for every wire message, derived from msgspec's type info.

Deriving them from the Structs themselves means a message or field added
later is covered by the round-trip tests without touching them.
"""

from __future__ import annotations

import math

import msgspec
import numpy as np
from hypothesis import strategies as st

from rlflow.protocol import DTYPE_SIZES, MESSAGE_TYPES, Tensor

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
        # NaN would make equal messages compare unequal; tensors carry NaNs instead.
        return st.floats(min_value=lo, allow_nan=False, allow_infinity=lo is None)
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
    raise NotImplementedError(f"no strategy for {t!r}")


def structs(cls: type) -> st.SearchStrategy:
    info = msgspec.inspect.type_info(cls)
    return st.builds(cls, **{f.name: _strategy(f.type) for f in info.fields})


def messages() -> st.SearchStrategy:
    """Any message of any kind."""
    return st.one_of([structs(cls) for cls in MESSAGE_TYPES.values()])
