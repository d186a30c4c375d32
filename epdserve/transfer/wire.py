"""Tensor frames between workers: ``MAGIC (b"EPDW") | header length (uint32 LE) | msgpack header``, then
each tensor in order at a 64-byte boundary (zero padding). Never unpickled; a bad magic, header or size
raises :class:`WireError`."""

from __future__ import annotations

import struct
import warnings

import msgpack
import torch
from pydantic import BaseModel, ConfigDict, ValidationError

MAGIC = b"EPDW"
ALIGN = 64
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "int8": torch.int8}
_PREFIX = struct.Struct("<4sI")


class WireError(ValueError):
    """Bytes that are not a well-formed epdserve tensor frame."""


class TensorSpec(BaseModel):
    """One tensor of a frame: its ``name`` (unique in the frame), ``dtype`` name and ``shape``."""

    model_config = ConfigDict(extra="forbid")

    name: str
    dtype: str
    shape: list[int]


class TensorHeader(BaseModel):
    """``num_tokens``: the valid positions; ``layout``: the sender's KV cache layout (KV tensors: ``kv_codec``)."""

    model_config = ConfigDict(extra="forbid")

    tensors: list[TensorSpec]
    num_tokens: int
    layout: dict


def dtype_of(spec: TensorSpec) -> torch.dtype:
    if spec.dtype not in DTYPES:
        raise WireError(f"unsupported dtype {spec.dtype!r}")
    return DTYPES[spec.dtype]


def nbytes_of(spec: TensorSpec) -> int:
    count = 1
    for d in spec.shape:
        if d < 0:
            raise WireError(f"negative dimension in shape {spec.shape}")
        count *= d
    return count * dtype_of(spec).itemsize


def _align(n: int) -> int:
    return n + (-n % ALIGN)


def _offsets(header: TensorHeader, start: int) -> tuple[list[int], int]:
    """Byte offset of each tensor when the first may start at ``start``; and the frame size."""
    offsets, end = [], start
    for spec in header.tensors:
        offsets.append(_align(end))
        end = offsets[-1] + nbytes_of(spec)
    return offsets, end


def header_bytes(header: TensorHeader) -> bytes:
    """Magic, length and msgpack header: everything before the first tensor's padding."""
    body = msgpack.packb(header.model_dump(), use_bin_type=True)
    return _PREFIX.pack(MAGIC, len(body)) + body


def frame_size(header: TensorHeader) -> int:
    return _offsets(header, len(header_bytes(header)))[1]


def pack(header: TensorHeader, fill, buffer=None):
    """Into ``buffer`` (writable, :func:`frame_size` bytes, e.g. page-locked) or a new bytearray, filled by
    ``fill(tensors)``. Raises WireError for a buffer of another size."""
    prefix = header_bytes(header)
    size = frame_size(header)
    buffer = bytearray(size) if buffer is None else buffer
    view = memoryview(buffer).cast("B")
    if len(view) != size:
        raise WireError(f"a buffer of {len(view)} bytes cannot hold a frame of {size}")
    view[: len(prefix)] = prefix
    fill(parse(buffer)[1])
    return buffer


def parse(buffer) -> tuple[TensorHeader, dict[str, torch.Tensor]]:
    """Header and tensors viewing ``buffer`` (no copy; read-only if it is). Raises WireError: bad magic, header
    or dtype, duplicate names, or a size that does not match."""
    view = memoryview(buffer)
    if len(view) < _PREFIX.size:
        raise WireError(f"frame of {len(view)} bytes is too short")
    magic, length = _PREFIX.unpack_from(view)
    if magic != MAGIC:
        raise WireError(f"not an epdserve frame (magic {bytes(magic)!r})")
    end = _PREFIX.size + length
    if end > len(view):
        raise WireError(f"header length {length} exceeds the frame ({len(view)} bytes)")
    try:
        header = TensorHeader.model_validate(msgpack.unpackb(view[_PREFIX.size:end], raw=False))
    except (ValidationError, ValueError, msgpack.UnpackException) as exc:
        raise WireError(f"invalid frame header: {exc}") from None
    if len({spec.name for spec in header.tensors}) != len(header.tensors):
        raise WireError("duplicate tensor names in the frame header")
    offsets, size = _offsets(header, end)
    if size != len(view):
        raise WireError(f"frame is {len(view)} bytes, its header says {size}")
    return header, {spec.name: _tensor(buffer, spec, offset) for spec, offset in zip(header.tensors, offsets)}


def _tensor(buffer, spec: TensorSpec, offset: int) -> torch.Tensor:
    dtype, nbytes = dtype_of(spec), nbytes_of(spec)
    if nbytes == 0:
        return torch.empty(spec.shape, dtype=dtype)
    with warnings.catch_warnings():
        # Received ZeroMQ messages are read-only; the tensor is only ever read.
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        tensor = torch.frombuffer(buffer, dtype=dtype, count=nbytes // dtype.itemsize, offset=offset)
    return tensor.view(spec.shape)
