"""Typed errors for messages that cannot be accepted.

Every rejection raised while decoding bytes from a peer is a `ProtocolError`
subclass whose message says what was wrong. A receiver catches
`ProtocolError`, counts it by class, and goes on serving.
"""


class ProtocolError(Exception):
    """A message could not be encoded or decoded."""

    #: Short stable name, used as a counter key in metrics.
    kind = "protocol"


class MalformedMessage(ProtocolError):
    """The header is not a valid msgpack message of the expected layout."""

    kind = "malformed"


class TruncatedMessage(MalformedMessage):
    """The header ends before the msgpack data it declares."""

    kind = "truncated"


class UnknownMessageType(ProtocolError):
    """The message tag names no message this peer knows."""

    kind = "unknown_type"


class SchemaVersionMismatch(ProtocolError):
    """The peer speaks an incompatible schema version."""

    kind = "wrong_version"


class FrameCountMismatch(ProtocolError):
    """The number of tensor frames differs from the tensors the header names."""

    kind = "frame_count"


class FrameSizeMismatch(ProtocolError):
    """A tensor frame's length differs from its declared dtype and shape."""

    kind = "frame_size"


class UnsupportedDType(ProtocolError):
    """A tensor names a dtype that is not on the wire's list."""

    kind = "dtype"


class SharedMemoryError(ProtocolError):
    """A tensor in shared memory cannot be taken: this receiver takes none,
    its segment cannot be opened or is not the one described, or its bytes
    lie outside the segment."""

    kind = "shm"
