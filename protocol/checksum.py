"""The checksum of a set of weights, as SPEC.md (*Checksums*) defines it.

The trainer computes it over the tensors it sends, each receiver over the
tensors it received and handed to its engine; the controller compares the
two after every update, so that weights that never arrived (or arrived
wrong) fail the run instead of passing for staleness. CRC-32 (zlib's) is
enough to tell one set of weights from another and runs at memory speed;
it is no defence against anyone forging weights (CURVE is).
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable, Sequence
from typing import Any

#: The prefix naming the algorithm, so that another can be added later.
ALGORITHM = "crc32"


def weights_checksum(tensors: Iterable[tuple[str, str, Sequence[int], Any]]) -> str:
    """``crc32:`` and 8 lowercase hex digits: CRC-32 over, for each tensor in
    order, the UTF-8 bytes of ``name:dtype:d0,d1,...`` and a newline, then its
    bytes (C order, little-endian). `tensors`: (name, wire dtype, shape, a
    buffer of its bytes) each."""
    crc = 0
    for name, dtype, shape, data in tensors:
        crc = zlib.crc32(f"{name}:{dtype}:{','.join(str(d) for d in shape)}\n".encode(), crc)
        crc = zlib.crc32(memoryview(data).cast("B"), crc)
    return f"{ALGORITHM}:{crc:08x}"


def payload_checksum(names: Sequence[str], tensors: Sequence[Any]) -> str:
    """The checksum of the tensors of a `WeightsPayload` (`Tensor`s, named by `names`)."""
    return weights_checksum((n, t.dtype, t.shape, t.data) for n, t in zip(names, tensors, strict=True))
