"""Encode messages to ZeroMQ frames and decode frames back, safely.

Frame 0 is the msgpack header ``[schema_version, message]``; frames 1..k
are the raw bytes of the k tensors the message holds, in the order the
header names them (each tensor is ``[dtype, shape, frame]``, see SPEC.md).
Between peers that have agreed to it, a large tensor may instead lie in a
segment of shared memory: it is ``[dtype, shape, frame, offset]`` and its
frame describes the segment (`ShmSegment`); see `shm.py` and SPEC.md.

Decoding treats every byte as hostile: the header's size, the version, the
tag, every field's type and bounds, each tensor's dtype and shape are
checked, each frame must be named by exactly one tensor, and each frame's
length must equal what its tensor declares (a tensor in shared memory
must lie inside its segment). Nothing is allocated from a declared size:
tensors are views of the frames actually received (or of the segment a
`ShmReader` has checked and mapped), and the
header is read with typed decoders only (never into generic objects a peer
could make large), so memory is bounded by the bytes that arrived. Whatever
the bytes, the only errors that come out are `ProtocolError` subclasses that
say what was wrong: a header nested deeper than the decoder can follow is
`malformed`, like any other bad header.

A `Codec` is cheap to keep and not thread-safe: give each socket its own.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec

import numpy as np

from .errors import (
    FrameCountMismatch,
    FrameSizeMismatch,
    MalformedMessage,
    ProtocolError,
    SchemaVersionMismatch,
    SharedMemoryError,
    TruncatedMessage,
    UnknownMessageType,
    UnsupportedDType,
)
from .messages import MESSAGE_TYPES, SCHEMA_VERSION, AnyMessage, Message
from .shm import ALIGN, CONTROL_BYTES, ShmReader, ShmSegment, ShmWriter, aligned
from .tensors import DTYPE_SIZES, MAX_NDIM, Tensor, expected_nbytes

#: Largest header (frame 0) a codec accepts by default, in bytes.
MAX_HEADER_BYTES = 16 << 20
#: Nesting every receiver accepts; deeper headers may be rejected (see SPEC.md).
MIN_DEPTH_ACCEPTED = 64
#: Most frames a message may have (the header and its tensors' frames).
MAX_FRAMES = 1 << 16
#: msgpack markers that start an array (fixarray, array 16, array 32).
_ARRAY_MARKERS = frozenset(range(0x90, 0xA0)) | {0xDC, 0xDD}


class Codec:
    """Turns messages of one union type into frames and back."""

    def __init__(
        self,
        message_type: Any = AnyMessage,
        *,
        schema_version: int = SCHEMA_VERSION,
        max_header_bytes: int = MAX_HEADER_BYTES,
    ):
        self._schema_version = schema_version
        #: The version as msgpack writes it in one byte (a positive fixint).
        self._version_byte = schema_version if 0 <= schema_version < 0x80 else -1
        self._max_header = max_header_bytes
        self._encoder = msgspec.msgpack.Encoder(enc_hook=self._enc_hook)
        self._decoder = msgspec.msgpack.Decoder(message_type, dec_hook=self._dec_hook)
        self._tags = _tags(message_type)
        self._segment_decoder = msgspec.msgpack.Decoder(ShmSegment)
        self._out: list[Any] = []
        self._in: Sequence[Any] = ()
        self._used: list[bool] = []
        self._writer: ShmWriter | None = None
        self._placed: list[tuple[Tensor, int]] = []
        self._segment_frame = 0
        self._reader: ShmReader | None = None
        self._claims: dict[int, tuple[Any, ShmSegment]] = {}

    # -- encode -------------------------------------------------------------

    def encode(self, msg: Message, *, shm: ShmWriter | None = None) -> list[Any]:
        """Frames for `msg`: the header, then one buffer per tensor (not copied).

        With `shm`, tensors of at least ``shm.min_bytes`` bytes are copied
        into one segment it reserves, described by one frame; if it has none
        to give, every tensor travels in a frame of its own.
        """
        self._out, self._writer, self._placed, self._segment_frame = [b""], shm, [], 0
        try:
            self._out[0] = self._encoder.encode((self._schema_version, msg))
            if shm is not None and self._placed and not self._place(shm):  # placed only with a writer
                return self.encode(msg)
            return self._out
        finally:
            self._out, self._writer, self._placed, self._segment_frame = [], None, [], 0

    def _enc_hook(self, obj: Any) -> Any:
        if isinstance(obj, Tensor):
            writer = self._writer
            # An array knows its size; anything else is asked through a memoryview.
            if writer is not None and (
                obj.data.nbytes if type(obj.data) is np.ndarray else obj.nbytes
            ) >= writer.min_bytes:
                if not self._segment_frame:
                    self._out.append(b"")  # the segment's description, once it has one
                    self._segment_frame = len(self._out) - 1
                end = self._placed[-1][1] + aligned(self._placed[-1][0].nbytes) if self._placed else CONTROL_BYTES
                self._placed.append((obj, end))
                return (obj.dtype, obj.shape, self._segment_frame, end)
            self._out.append(obj.data)
            return (obj.dtype, obj.shape, len(self._out) - 1)
        raise TypeError(f"cannot encode {type(obj).__name__} in a message")

    def _place(self, writer: ShmWriter) -> bool:
        """Copy the tensors placed while encoding into a segment from
        `writer`, and describe it in its frame; False if it has none."""
        last, offset = self._placed[-1]
        reserved = writer.reserve(offset + last.nbytes)
        if reserved is None:
            return False
        segment, buffer = reserved
        self._out[self._segment_frame] = msgspec.msgpack.encode(segment)
        dest = np.frombuffer(buffer, np.uint8)
        for tensor, offset in self._placed:
            src = _as_bytes(tensor.data)
            np.copyto(dest[offset : offset + src.size], src)
        return True

    # -- decode -------------------------------------------------------------

    def decode(self, frames: Sequence[Any], *, shm: ShmReader | None = None) -> Any:
        """The message in `frames` (bytes, memoryviews or zmq Frames).

        Tensors in shared memory are taken with `shm` (without it, such a
        message is a `SharedMemoryError`): each is a view of its segment that
        keeps the segment taken for as long as it, or anything made from it,
        lives. Raises a `ProtocolError` subclass naming what is wrong, and
        nothing else.
        """
        if not frames:
            raise FrameCountMismatch("empty message: no header frame")
        if len(frames) > MAX_FRAMES:
            raise FrameCountMismatch(f"message of {len(frames)} frames; at most {MAX_FRAMES} are accepted")
        head = _bytes_view(frames[0])
        size = head.nbytes
        if size > self._max_header:
            raise MalformedMessage(f"header of {size} bytes; at most {self._max_header} are accepted")
        if size > 2 and head[0] == 0x92 and head[1] == self._version_byte and head[2] in _ARRAY_MARKERS:
            body = head[2:]  # [this version, [...]]: the common case, in three byte compares
        else:
            version, start = _envelope(head)
            if version != self._schema_version:
                raise SchemaVersionMismatch(
                    f"message has schema version {version}, this peer speaks {self._schema_version}"
                )
            body = head[start:]
        self._in = frames
        self._used = [False] * len(frames)
        self._reader = shm
        try:
            msg = self._decoder.decode(body)
        except msgspec.ValidationError as exc:  # a DecodeError subclass: first
            raise self._classify(body, exc) from None
        except msgspec.DecodeError as exc:
            raise _decode_error(exc) from None
        except RecursionError:
            # msgspec follows nesting by recursion and stops at the
            # interpreter's limit; to a peer that is just a bad header.
            raise MalformedMessage("header is nested deeper than this peer accepts") from None
        finally:
            used, self._used, self._in = self._used, [], ()
            self._reader, self._claims = None, {}
        unused = used.count(False) - 1
        if unused and not _unknown_tail(body, type(msg), used):
            raise FrameCountMismatch(
                f"{type(msg).__name__} names {len(frames) - 1 - unused} tensor frames but {len(frames) - 1} arrived"
            )
        return msg

    def _dec_hook(self, kind: type, obj: Any) -> Any:
        if kind is not Tensor:
            raise TypeError(f"unsupported type {kind!r}")
        if not (isinstance(obj, list) and len(obj) in (3, 4)):
            raise MalformedMessage(
                f"tensor must be [dtype, shape, frame] or [dtype, shape, frame, offset], got {obj!r:.80}"
            )
        if len(obj) == 4:
            return self._shared(obj)
        dtype, shape, index = obj
        shape, want = _checked(dtype, shape)
        if type(index) is not int or not 1 <= index < len(self._in):
            raise FrameCountMismatch(
                f"tensor names frame {index!r:.20} but the message has frames 1..{len(self._in) - 1}"
            )
        if self._used[index]:
            raise FrameCountMismatch(f"frame {index} is named by two tensors")
        self._used[index] = True
        frame = self._in[index]
        view = frame.buffer if hasattr(frame, "buffer") else memoryview(frame)
        got = view.nbytes
        if got != want:
            raise FrameSizeMismatch(f"tensor {dtype}{list(shape)} declares {want} bytes, frame {index} has {got}")
        return Tensor._trusted(dtype, shape, view)

    def _shared(self, obj: list) -> Tensor:
        """A tensor ``[dtype, shape, frame, offset]`` whose bytes lie in the
        segment that frame describes (taken once per message, on first use)."""
        dtype, shape, index, offset = obj
        shape, want = _checked(dtype, shape)
        if type(index) is not int or not 1 <= index < len(self._in):
            raise FrameCountMismatch(
                f"tensor names frame {index!r:.20} but the message has frames 1..{len(self._in) - 1}"
            )
        if type(offset) is not int:
            raise MalformedMessage(f"tensor offset must be an integer, got {offset!r:.40}")
        taken = self._claims.get(index)
        if taken is None:
            if self._used[index]:
                raise FrameCountMismatch(f"frame {index} is named both as a tensor's bytes and as a segment")
            if self._reader is None:
                raise SharedMemoryError("a tensor lies in shared memory, and this socket takes none")
            try:
                segment = self._segment_decoder.decode(_bytes_view(self._in[index]))
            except msgspec.DecodeError as exc:
                raise SharedMemoryError(f"frame {index} is not a segment description: {exc}") from None
            taken = (None, segment)
        claim, segment = taken
        if offset % ALIGN or offset < CONTROL_BYTES or offset + want > segment.size:
            raise SharedMemoryError(
                f"tensor {dtype}{list(shape)} at offset {offset} of a segment of {segment.size} bytes: its bytes must "
                f"start at a multiple of {ALIGN} from {CONTROL_BYTES} on and end inside the segment"
            )
        if claim is None:  # taken only once its first tensor is known to lie inside it
            assert self._reader is not None  # a new segment is decoded only with a reader (checked above)
            claim = self._reader.claim(segment)
            self._used[index] = True
            self._claims[index] = (claim, segment)
        return Tensor._trusted(dtype, shape, claim.view(offset, want))


    def _classify(self, body: memoryview, exc: msgspec.ValidationError) -> ProtocolError:
        """Say whether a body that failed validation had an unknown tag."""
        tag = _leading_tag(body)
        if tag is None:
            return MalformedMessage(f"message is not a tagged array: {exc}")
        if tag not in MESSAGE_TYPES:
            return UnknownMessageType(f"unknown message tag {tag}")
        if tag not in self._tags:
            accepted = ", ".join(_tag_names(self._decoder.type))
            return UnknownMessageType(
                f"{MESSAGE_TYPES[tag].__name__} (tag {tag}) is not accepted on this channel; accepted: {accepted}"
            )
        return MalformedMessage(f"invalid {MESSAGE_TYPES[tag].__name__}: {exc}")


def _checked(dtype: Any, shape: Any) -> tuple[tuple[int, ...], int]:
    """A tensor's shape as a tuple and its size in bytes, once its dtype and
    shape have been checked."""
    if not isinstance(dtype, str) or dtype not in DTYPE_SIZES:
        raise UnsupportedDType(f"tensor dtype {dtype!r:.40} is not one of {', '.join(DTYPE_SIZES)}")
    if not isinstance(shape, list):
        raise MalformedMessage(f"tensor shape must be an array, got {shape!r:.40}")
    if len(shape) > MAX_NDIM:
        raise MalformedMessage(f"tensor has {len(shape)} dimensions; at most {MAX_NDIM} are allowed")
    shape = tuple(shape)
    return shape, expected_nbytes(dtype, shape)


def _as_bytes(data: Any) -> np.ndarray:
    """The bytes of a tensor's buffer as a flat uint8 array (no copy)."""
    view = data.buffer if hasattr(data, "buffer") else memoryview(data)
    return np.frombuffer(view if view.format == "B" and view.ndim == 1 else view.cast("B"), np.uint8)


def _bytes_view(frame: Any) -> memoryview:
    """The bytes of a frame (bytes, memoryview, zmq Frame), without a copy."""
    if type(frame) is bytes:
        return memoryview(frame)
    view = frame.buffer if hasattr(frame, "buffer") else memoryview(frame)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


#: msgpack's unsigned and signed integer markers -> (bytes that follow, signed).
_INT_MARKERS = {0xCC: (1, False), 0xCD: (2, False), 0xCE: (4, False), 0xCF: (8, False),
                0xD0: (1, True), 0xD1: (2, True), 0xD2: (4, True), 0xD3: (8, True)}


def _int_at(data: memoryview, pos: int) -> tuple[int, int] | None:
    """The msgpack integer at `pos` and the position after it; None if there
    is no integer there. Raises `TruncatedMessage` if the data ends inside it."""
    if pos >= data.nbytes:
        raise TruncatedMessage("header is truncated: it ends before an integer")
    marker = data[pos]
    if marker <= 0x7F:
        return marker, pos + 1
    if marker >= 0xE0:
        return marker - 0x100, pos + 1
    if marker not in _INT_MARKERS:
        return None
    size, signed = _INT_MARKERS[marker]
    end = pos + 1 + size
    if end > data.nbytes:
        raise TruncatedMessage("header is truncated: it ends inside an integer")
    return int.from_bytes(data[pos + 1 : end], "big", signed=signed), end


def _envelope(head: memoryview) -> tuple[int, int]:
    """(schema_version, offset of the message) of a header ``[version, message]``.

    Read by hand, without decoding the message, so that the version is
    checked first and nothing of the message is allocated twice.
    """
    if head.nbytes == 0:
        raise TruncatedMessage("header is truncated: it is empty")
    if head[0] != 0x92:  # a msgpack array of two elements
        raise MalformedMessage("header is not [schema_version, message]: not an array of two elements")
    version = _int_at(head, 1)
    if version is None:
        raise MalformedMessage("header is not [schema_version, message]: schema_version is not an integer")
    if version[1] >= head.nbytes:
        raise TruncatedMessage("header is truncated: it ends before the message")
    if head[version[1]] not in _ARRAY_MARKERS:
        raise MalformedMessage("header is not [schema_version, message]: the message is not an array")
    return version


def _unknown_tail(body: memoryview, cls: type[msgspec.Struct], used: list[bool]) -> bool:
    """Whether the frames no known field named belong to fields appended to
    the message after this peer's schema: the message has more fields than
    `cls` knows, and every unnamed frame comes after every named one (a newer
    sender's tensors are numbered after those of the fields both know)."""
    count = _array_length(body)
    if count is None or count <= 1 + len(cls.__struct_fields__):
        return False
    last_named = max((i for i, named in enumerate(used) if named), default=0)
    return all(used[1 : last_named + 1])


def _array_length(body: memoryview) -> int | None:
    """The length of the msgpack array `body` starts with (None: not an array)."""
    marker = body[0] if body.nbytes else 0
    if 0x90 <= marker <= 0x9F:
        return marker & 0x0F
    if marker in (0xDC, 0xDD) and body.nbytes >= (3 if marker == 0xDC else 5):
        size = 2 if marker == 0xDC else 4
        return int.from_bytes(body[1 : 1 + size], "big")
    return None


def _leading_tag(body: memoryview) -> int | None:
    """The first element of a msgpack array, if it is an integer."""
    if body.nbytes == 0:
        return None
    marker = body[0]
    if 0x90 <= marker <= 0x9F:
        pos = 1
    elif marker == 0xDC:
        pos = 3
    elif marker == 0xDD:
        pos = 5
    else:
        return None
    try:
        found = _int_at(body, pos)
    except TruncatedMessage:
        return None
    return None if found is None else found[0]


def _decode_error(exc: msgspec.DecodeError) -> ProtocolError:
    if "truncated" in str(exc):
        return TruncatedMessage(f"header is truncated: {exc}")
    return MalformedMessage(f"header is not valid msgpack: {exc}")


def _members(message_type: Any) -> tuple[type[msgspec.Struct], ...]:
    return getattr(message_type, "__args__", (message_type,))


def _tags(message_type: Any) -> set[int | str | None]:
    return {cls.__struct_config__.tag for cls in _members(message_type)}


def _tag_names(message_type: Any) -> list[str]:
    return [cls.__name__ for cls in _members(message_type)]


_default: Codec | None = None


def encode(msg: Message) -> list[Any]:
    """Frames for `msg`, with a module-level codec (not thread-safe)."""
    global _default
    if _default is None:
        _default = Codec()
    return _default.encode(msg)


def decode(frames: Sequence[Any], message_type: Any = AnyMessage) -> Any:
    """Decode `frames` with a fresh codec for `message_type`."""
    return Codec(message_type).decode(frames)
