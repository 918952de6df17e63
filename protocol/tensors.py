"""Tensors on the wire: a dtype name, a shape, and one raw frame of bytes.

A `Tensor` is what travels in a message field that holds an array. On the
wire it is a small msgpack array ``[dtype, shape, frame]`` inside the message
header plus one raw frame holding its bytes (little-endian, C order). The
bytes are never copied by the codec: sending hands the tensor's own buffer to
ZeroMQ, receiving wraps the received frame.

Lifetime of received buffers: a received `Tensor` keeps a reference to the
ZeroMQ frame that holds its bytes, and every numpy array or torch tensor made
from it with `numpy()` / `torch()` keeps that reference in turn. The memory
stays valid for as long as any of them is alive, and is freed when the last
one goes. Received tensors are read-only: numpy marks them so; torch cannot,
so writing into a tensor returned by `torch()` is undefined (clone it first).

Sent buffers: ZeroMQ may still be reading a sent tensor's memory after
`send` returns. Do not write into an array after sending it.

This module depends on numpy only; torch is imported lazily, on the first
call that needs it.
"""

from __future__ import annotations

import importlib
import math
import sys
import warnings
from typing import Any

import numpy as np

from .errors import FrameSizeMismatch, MalformedMessage, UnsupportedDType

if sys.byteorder != "little":  # pragma: no cover - no big-endian hosts here
    raise ImportError("rlflow.protocol needs a little-endian host")

#: Wire dtype name -> item size in bytes. Names are torch's, without the
#: ``torch.`` prefix. Append only: a name once given never changes meaning.
DTYPE_SIZES: dict[str, int] = {
    "bool": 1,
    "uint8": 1,
    "int8": 1,
    "int16": 2,
    "uint16": 2,
    "int32": 4,
    "uint32": 4,
    "int64": 8,
    "uint64": 8,
    "float16": 2,
    "bfloat16": 2,
    "float32": 4,
    "float64": 8,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
}

#: Wire dtypes that numpy has natively. The others are torch-only.
_NUMPY_DTYPES: dict[str, np.dtype] = {
    name: np.dtype(name)
    for name in DTYPE_SIZES
    if name not in ("bfloat16", "float8_e4m3fn", "float8_e5m2")
}

#: Native-order numpy dtype -> wire dtype name.
_WIRE_NAMES: dict[np.dtype, str] = {dt: name for name, dt in _NUMPY_DTYPES.items()}

#: Largest number of dimensions accepted from the wire.
MAX_NDIM = 32


class Tensor:
    """An n-dimensional array as it travels: dtype name, shape and bytes.

    `data` is any contiguous buffer (bytes, memoryview, numpy array, ZeroMQ
    frame) of exactly ``prod(shape) * itemsize`` bytes.
    """

    __slots__ = ("dtype", "shape", "data")

    def __init__(self, dtype: str, shape: tuple[int, ...], data: Any):
        """Wrap `data`; raises if its length does not match dtype and shape."""
        if dtype not in DTYPE_SIZES:
            raise UnsupportedDType(f"unsupported dtype {dtype!r}; supported: {', '.join(DTYPE_SIZES)}")
        self.dtype = dtype
        self.shape = tuple(shape)
        self.data = data
        expected = expected_nbytes(dtype, self.shape)
        got = memoryview(data).nbytes
        if got != expected:
            raise FrameSizeMismatch(f"tensor {dtype}{list(self.shape)} needs {expected} bytes, its buffer has {got}")

    @classmethod
    def _trusted(cls, dtype: str, shape: tuple[int, ...], data: Any) -> Tensor:
        """Construct without checks, for callers that have just made them."""
        self = cls.__new__(cls)
        self.dtype, self.shape, self.data = dtype, shape, data
        return self

    @property
    def nbytes(self) -> int:
        return memoryview(self.data).nbytes

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def __len__(self) -> int:
        return self.shape[0] if self.shape else 1

    def __repr__(self) -> str:
        return f"Tensor({self.dtype}, shape={list(self.shape)})"

    def __eq__(self, other: object) -> bool:
        """Equal when dtype, shape and every byte are equal (bit-exact)."""
        if not isinstance(other, Tensor):
            return NotImplemented
        return (
            self.dtype == other.dtype
            and self.shape == other.shape
            and memoryview(self.data).cast("B") == memoryview(other.data).cast("B")
        )

    __hash__ = None  # type: ignore[assignment]

    # -- construction ---------------------------------------------------

    @classmethod
    def from_numpy(cls, array: np.ndarray) -> Tensor:
        """Wrap a numpy array without copying (a copy is made only if it is
        not C-contiguous)."""
        array = np.ascontiguousarray(array)
        name = _WIRE_NAMES.get(array.dtype)  # not `dtype.name`: it costs more than the rest together
        if name is None:
            if array.dtype.byteorder == ">":
                raise UnsupportedDType("big-endian arrays are not supported on the wire")
            raise UnsupportedDType(
                f"numpy dtype {array.dtype.name!r} has no wire name; supported: {', '.join(_NUMPY_DTYPES)}"
            )
        # The bytes are the array's own, so they match dtype and shape.
        return cls._trusted(name, array.shape, array.reshape(-1).view(np.uint8) if array.size else b"")

    @classmethod
    def from_torch(cls, tensor: Any) -> Tensor:
        """Wrap a CPU torch tensor without copying (a device tensor is copied
        to the host; a non-contiguous one is made contiguous)."""
        name = str(tensor.dtype).removeprefix("torch.")
        if name not in DTYPE_SIZES:
            raise UnsupportedDType(f"torch dtype {name!r} has no wire name; supported: {', '.join(DTYPE_SIZES)}")
        tensor = tensor.detach()
        if tensor.device.type != "cpu":
            tensor = tensor.cpu()
        tensor = tensor.contiguous()
        shape = tuple(tensor.shape)
        if tensor.numel() == 0:
            return cls(name, shape, b"")
        return cls(name, shape, tensor.reshape(-1).view(_torch().uint8).numpy())

    @classmethod
    def of(cls, values: Any, dtype: str) -> Tensor:
        """Make a tensor from a sequence or array of values in a numpy dtype."""
        return cls.from_numpy(np.asarray(values, dtype=_NUMPY_DTYPES[dtype]))

    # -- views ------------------------------------------------------------

    def numpy(self) -> np.ndarray:
        """A numpy view of the bytes (read-only if they were received)."""
        dt = _NUMPY_DTYPES.get(self.dtype)
        if dt is None:
            raise UnsupportedDType(f"{self.dtype} has no numpy dtype; use .torch()")
        return np.frombuffer(self.data, dtype=dt).reshape(self.shape)

    def torch(self) -> Any:
        """A torch view of the bytes, sharing memory (no copy)."""
        torch = _torch()
        dt = getattr(torch, self.dtype)
        if self.nbytes == 0:
            return torch.empty(self.shape, dtype=dt)
        with warnings.catch_warnings():
            # Received frames are read-only buffers; torch has no read-only
            # tensors and warns. The module docstring states the contract.
            warnings.filterwarnings("ignore", message="The given buffer is not writable")
            flat = torch.frombuffer(self.data, dtype=torch.uint8)
        return flat.view(dt).reshape(self.shape)

    def tolist(self) -> list:
        return self.numpy().tolist()


def _torch() -> Any:
    """torch, imported on the first call that needs it: the protocol itself
    depends on numpy only."""
    return importlib.import_module("torch")


def expected_nbytes(dtype: str, shape: tuple[int, ...]) -> int:
    """Bytes that a tensor of this dtype and shape occupies; validates both."""
    size = DTYPE_SIZES.get(dtype)
    if size is None:
        raise UnsupportedDType(f"unsupported dtype {dtype!r}")
    if len(shape) > MAX_NDIM:
        raise MalformedMessage(f"tensor has {len(shape)} dimensions; at most {MAX_NDIM} are allowed")
    n = size
    for dim in shape:
        if type(dim) is not int or dim < 0:
            raise MalformedMessage(f"tensor shape {list(shape)} has an invalid dimension {dim!r}")
        n *= dim
    return n
