"""Encode messages to ZeroMQ frames and decode frames back, safely.

Frame 0 is the msgpack header ``[schema_version, message]``; frames 1..k
are the raw bytes of the k tensors the message holds, in the order the
header names them (each tensor is ``[dtype, shape, frame]``, see SPEC.md).

Decoding treats every byte as hostile: the version, the tag, every field's
type and bounds, each tensor's dtype and shape are checked, each frame must
be named by exactly one tensor, and each frame's length must equal what its
tensor declares. Nothing is allocated from a declared size: tensors are views
of the frames actually received. Any failure raises a `ProtocolError`
subclass that says what was wrong.

A `Codec` is cheap to keep and not thread-safe: give each socket its own.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec

from .errors import (
    FrameCountMismatch,
    FrameSizeMismatch,
    MalformedMessage,
    ProtocolError,
    SchemaVersionMismatch,
    TruncatedMessage,
    UnknownMessageType,
    UnsupportedDType,
)
from .messages import MESSAGE_TYPES, SCHEMA_VERSION, AnyMessage, Message
from .tensors import DTYPE_SIZES, Tensor, expected_nbytes

_Envelope = tuple[int, msgspec.Raw]
_TensorRef = tuple[str, tuple[int, ...], int]


class Codec:
    """Turns messages of one union type into frames and back."""

    def __init__(self, message_type: Any = AnyMessage, *, schema_version: int = SCHEMA_VERSION):
        self._schema_version = schema_version
        self._encoder = msgspec.msgpack.Encoder(enc_hook=self._enc_hook)
        self._envelope = msgspec.msgpack.Decoder(_Envelope)
        self._decoder = msgspec.msgpack.Decoder(message_type, dec_hook=self._dec_hook)
        self._tensor_ref = msgspec.msgpack.Decoder(_TensorRef)
        self._peek = msgspec.msgpack.Decoder(list[msgspec.Raw])
        self._int = msgspec.msgpack.Decoder(int)
        self._out: list[Any] = []
        self._in: Sequence[Any] = ()
        self._used: list[bool] = []

    # -- encode -------------------------------------------------------------

    def encode(self, msg: Message) -> list[Any]:
        """Frames for `msg`: the header, then one buffer per tensor (not copied)."""
        self._out = [b""]
        try:
            self._out[0] = self._encoder.encode((self._schema_version, msg))
            return self._out
        finally:
            self._out = []

    def _enc_hook(self, obj: Any) -> Any:
        if isinstance(obj, Tensor):
            self._out.append(obj.data)
            return (obj.dtype, obj.shape, len(self._out) - 1)
        raise TypeError(f"cannot encode {type(obj).__name__} in a message")

    # -- decode -------------------------------------------------------------

    def decode(self, frames: Sequence[Any]) -> Any:
        """The message in `frames` (bytes, memoryviews or zmq Frames).

        Raises a `ProtocolError` subclass naming what is wrong.
        """
        if not frames:
            raise FrameCountMismatch("empty message: no header frame")
        try:
            version, body = self._envelope.decode(frames[0])
        except msgspec.ValidationError as exc:  # a DecodeError subclass: first
            raise MalformedMessage(f"header is not [schema_version, message]: {exc}") from None
        except msgspec.DecodeError as exc:
            raise _decode_error(exc) from None
        if version != self._schema_version:
            raise SchemaVersionMismatch(
                f"message has schema version {version}, this peer speaks {self._schema_version}"
            )
        self._in = frames
        self._used = [False] * len(frames)
        try:
            msg = self._decoder.decode(body)
        except msgspec.ValidationError as exc:
            raise self._classify(body, exc) from None
        except msgspec.DecodeError as exc:
            raise _decode_error(exc) from None
        finally:
            used, self._used, self._in = self._used, [], ()
        unused = used.count(False) - 1
        if unused:
            raise FrameCountMismatch(
                f"{type(msg).__name__} names {len(frames) - 1 - unused} tensor frames but {len(frames) - 1} arrived"
            )
        return msg

    def _dec_hook(self, kind: type, obj: Any) -> Any:
        if kind is not Tensor:
            raise TypeError(f"unsupported type {kind!r}")
        if not (isinstance(obj, list) and len(obj) == 3):
            raise MalformedMessage(f"tensor must be [dtype, shape, frame], got {obj!r:.80}")
        dtype, shape, index = obj
        if not isinstance(dtype, str) or dtype not in DTYPE_SIZES:
            raise UnsupportedDType(f"tensor dtype {dtype!r:.40} is not one of {', '.join(DTYPE_SIZES)}")
        if not isinstance(shape, list):
            raise MalformedMessage(f"tensor shape must be an array, got {shape!r:.40}")
        shape = tuple(shape)
        want = expected_nbytes(dtype, shape)
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

    def _classify(self, body: bytes, exc: msgspec.ValidationError) -> ProtocolError:
        """Say whether a header that failed validation had an unknown tag."""
        try:
            tag = self._int.decode(self._peek.decode(body)[0])
        except (msgspec.DecodeError, msgspec.ValidationError, IndexError):
            return MalformedMessage(f"message is not a tagged array: {exc}")
        if tag not in MESSAGE_TYPES:
            return UnknownMessageType(f"unknown message tag {tag}")
        accepted = ", ".join(_tag_names(self._decoder.type))
        if tag not in _tags(self._decoder.type):
            return UnknownMessageType(
                f"{MESSAGE_TYPES[tag].__name__} (tag {tag}) is not accepted on this channel; accepted: {accepted}"
            )
        return MalformedMessage(f"invalid {MESSAGE_TYPES[tag].__name__}: {exc}")


def _decode_error(exc: msgspec.DecodeError) -> ProtocolError:
    if "truncated" in str(exc):
        return TruncatedMessage(f"header is truncated: {exc}")
    return MalformedMessage(f"header is not valid msgpack: {exc}")


def _members(message_type: Any) -> tuple[type, ...]:
    return getattr(message_type, "__args__", (message_type,))


def _tags(message_type: Any) -> set[int]:
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
