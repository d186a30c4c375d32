"""The wire format for tensors between workers: a validated header, then raw bytes.

A frame is ``MAGIC (4 bytes) | header length (uint32, little-endian) | msgpack header |
zero padding to a 64-byte boundary | payload``. The header names the payload's dtype and
shape and the KV layout it was cut from; nothing in a frame is ever unpickled, and a
frame whose magic, header or size is wrong raises :class:`WireError`.
"""

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


class TensorHeader(BaseModel):
    """``shape`` of the payload (KV blocks: ``[layers, 2, n_blocks, block_size, kv_heads,
    head_dim]``), its ``dtype`` name, and ``num_tokens`` positions that are valid."""

    model_config = ConfigDict(extra="forbid")

    dtype: str
    shape: list[int]
    num_tokens: int
    layout: dict


def dtype_of(header: TensorHeader) -> torch.dtype:
    if header.dtype not in DTYPES:
        raise WireError(f"unsupported dtype {header.dtype!r}")
    return DTYPES[header.dtype]


def payload_nbytes(header: TensorHeader) -> int:
    count = 1
    for d in header.shape:
        if d < 0:
            raise WireError(f"negative dimension in shape {header.shape}")
        count *= d
    return count * dtype_of(header).itemsize


def header_bytes(header: TensorHeader) -> bytes:
    """Magic, length, msgpack header and padding: everything before the payload."""
    body = msgpack.packb(header.model_dump(), use_bin_type=True)
    prefix = _PREFIX.pack(MAGIC, len(body)) + body
    return prefix + b"\0" * (-len(prefix) % ALIGN)


def parse(buffer) -> tuple[TensorHeader, torch.Tensor]:
    """Validate a frame in ``buffer`` (bytes, mmap, memoryview) and return its header and
    a tensor viewing the payload (no copy; it keeps ``buffer`` alive; read-only when
    ``buffer`` is).

    Raises:
        WireError: bad magic, header, dtype, or a size that does not match the shape.
    """
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
    start = end + (-end % ALIGN)
    nbytes = payload_nbytes(header)
    if start + nbytes != len(view):
        raise WireError(f"payload is {len(view) - start} bytes, header says {nbytes}")
    dtype = dtype_of(header)
    if nbytes == 0:
        return header, torch.empty(header.shape, dtype=dtype)
    with warnings.catch_warnings():
        # A received ZeroMQ message is read-only; the tensor is only ever read (copied into
        # the KV cache), so torch's warning about non-writable buffers does not apply.
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        tensor = torch.frombuffer(buffer, dtype=dtype, count=nbytes // dtype.itemsize, offset=start)
    return header, tensor.view(header.shape)
