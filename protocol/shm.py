"""Tensors in shared memory: how a message names them, how a segment is laid out.

Between two processes on one machine a large tensor need not cross the
socket: the sender writes its bytes into a segment of shared memory and the
message carries, instead of the bytes, a frame that describes the segment
(`ShmSegment`) and, in the tensor, the offset of its bytes there. The
receiver maps the segment and views the bytes where they lie.

Only a peer that has said it takes tensors this way is ever sent one (see
SPEC.md, *Tensors in shared memory*); to any other the same tensor travels
in its own frame, as always.

Each segment starts with a control page (`CONTROL_BYTES`) through which
sender and receiver hand it back and forth; `CONTROL_FIELDS` is its layout,
and SPEC.md's table of it is generated from that list. Tensor bytes follow
the control page, each at an offset that is a multiple of `ALIGN`.

This module is the format only (numpy and msgspec at most); creating,
mapping and handing segments back is `rlflow.data.shm`.
"""

from __future__ import annotations

from typing import Annotated, Any, NamedTuple, Protocol

from msgspec import Meta

from .messages import NonNegInt, Record

#: Bytes of the control page at the start of every segment.
CONTROL_BYTES = 4096
#: Tensor bytes start at offsets that are multiples of this.
ALIGN = 64
#: The first 8 bytes of every segment.
MAGIC = b"rlflowsm"
#: Bytes of a segment's random id (`ShmSegment.id` is its hex).
ID_BYTES = 16


class ControlField(NamedTuple):
    """One field of the control page: where it lies, who writes it, what it holds."""

    name: str
    offset: int
    size: int
    writer: str
    meaning: str


#: The control page, in order. Integers are unsigned 64-bit little-endian,
#: each written and read whole (one aligned 8-byte store or load).
CONTROL_FIELDS = (
    ControlField("magic", 0, 8, "sender, at creation", "the 8 ASCII bytes `rlflowsm`"),
    ControlField("id", 8, ID_BYTES, "sender, at creation", "16 random bytes: `ShmSegment.id` is their lower-case hex"),
    ControlField("size", 24, 8, "sender, at creation", "length of the segment in bytes, this page included"),
    ControlField("pid", 32, 8, "sender, at creation", "process id of the sender"),
    ControlField("sent", 40, 8, "sender", "`seq` of the message the segment now carries (0: none yet)"),
    ControlField("claimed", 48, 8, "receiver", "`seq` of the message a receiver has taken"),
    ControlField(
        "released",
        56,
        8,
        "receiver (or the sender, for a send that did not happen)",
        "`seq` of the message whose tensors nobody uses any more",
    ),
    ControlField("retired", 64, 8, "sender", "1: the sender will put nothing more in the segment"),
)

#: Index of each 8-byte word of the control page, by field name (id spans two).
WORD = {f.name: f.offset // 8 for f in CONTROL_FIELDS}


class ShmSegment(Record, frozen=True):
    """A segment of shared memory holding tensors of this message (the
    content of a segment frame; see SPEC.md, *Tensors in shared memory*)."""

    pid: Annotated[int, Meta(ge=1)]
    """Process that holds the segment: the receiver opens ``/proc/<pid>/fd/<fd>``."""
    fd: NonNegInt
    """The segment's file descriptor in that process."""
    id: Annotated[str, Meta(min_length=2 * ID_BYTES, max_length=2 * ID_BYTES, pattern="^[0-9a-f]+$")]
    """The segment's id, as its control page holds it (32 lower-case hex digits)."""
    seq: Annotated[int, Meta(ge=1)]
    """This message's use of the segment: the control page's `sent` holds it."""
    size: Annotated[int, Meta(ge=CONTROL_BYTES)]
    """Length of the segment in bytes, its control page included."""


class ShmWriter(Protocol):
    """What `Codec.encode` needs to put tensors in shared memory."""

    #: Tensors of at least this many bytes go to shared memory; smaller ones
    #: travel in frames of their own.
    min_bytes: int

    def reserve(self, nbytes: int) -> tuple[ShmSegment, memoryview] | None:
        """A segment of at least `nbytes` bytes and a writable view of all of
        it, marked as carrying its next message (its `seq`); None if none can
        be had now (the tensors then travel in frames)."""


class ShmReader(Protocol):
    """What `Codec.decode` needs to take tensors out of shared memory."""

    def claim(self, segment: ShmSegment) -> Any:
        """Take `segment` for one message; an object whose ``view(offset,
        nbytes)`` is a read-only buffer of those bytes that keeps the segment
        taken while it lives. Raises `SharedMemoryError`."""


def aligned(n: int) -> int:
    """`n` rounded up to a multiple of `ALIGN`."""
    return -(-n // ALIGN) * ALIGN
