"""KV hand-off between workers on one host through POSIX shared memory (/dev/shm).

The prefill worker copies a request's KV blocks straight from its cache into a new
shared-memory file holding one wire frame (:mod:`epdserve.transfer.wire`); only the
file's name travels to the decode worker, which maps the file, unlinks it at once (the
mapping keeps the memory until the import is done) and copies the blocks into its own
cache. Each byte is copied once per side and never passes through a socket.
"""

from __future__ import annotations

import mmap
import os
import re
import uuid
from pathlib import Path

import torch

from epdserve.transfer.wire import TensorHeader, WireError, frame_size, header_bytes, parse

SHM_DIR = Path("/dev/shm")
_NAME = re.compile(r"epdserve-kv-[0-9a-f]{32}")


def new_name() -> str:
    return f"epdserve-kv-{uuid.uuid4().hex}"


def write(name: str, header: TensorHeader, fill) -> int:
    """Create ``/dev/shm/name`` holding a frame with ``header``; ``fill(tensors)`` writes
    the tensors (a dict by name of tensors viewing the file). Returns the file size in
    bytes."""
    prefix = header_bytes(header)
    size = frame_size(header)
    fd = os.open(SHM_DIR / name, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, size)
        with mmap.mmap(fd, size) as mm:
            mm[: len(prefix)] = prefix
            _, views = parse(mm)
            fill(views)
            del views
    finally:
        os.close(fd)
    return size


def open_segment(name: str) -> mmap.mmap:
    """Map and unlink ``/dev/shm/name``; the mapping keeps the memory until it is freed.

    Raises:
        WireError: a name that is not ours, or a missing file.
    """
    if not _NAME.fullmatch(name):
        raise WireError(f"refusing shared-memory name {name!r}")
    path = SHM_DIR / name
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        raise WireError(f"KV segment {name} is gone (expired, released or already taken)") from None
    try:
        size = os.fstat(fd).st_size
        # Private (copy-on-write) mapping: writable for torch, never written back.
        return mmap.mmap(fd, size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
        path.unlink(missing_ok=True)


def read(name: str) -> tuple[TensorHeader, dict[str, torch.Tensor]]:
    """Map and unlink ``/dev/shm/name``; return its header and tensors by name (views of
    the mapping, freed when the last tensor is).

    Raises:
        WireError: a name that is not ours, a missing file, or a malformed frame.
    """
    return parse(open_segment(name))


def remove(name: str) -> None:
    """Delete a segment that will not be read (abort, timeout); missing is fine."""
    if _NAME.fullmatch(name):
        (SHM_DIR / name).unlink(missing_ok=True)
