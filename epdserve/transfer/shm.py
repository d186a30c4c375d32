"""KV hand-off between workers on one host through POSIX shared memory (/dev/shm).

Two kinds of files, both named ``epdserve-<kind>-<owner pid>-<32 hex digits>``:

* a **pool** (``kvpool``): a prefill worker's whole KV cache, created once at start-up
  (:class:`KVPool`). A same-host hand-off then copies nothing on the prefill side: the
  decode worker maps the pool once (:func:`map_pool`) and copies the request's blocks
  straight out of it. Behind the KV tensor the file holds one int64 *tag* per block: the
  prefill side writes a hand-off's tag into its blocks when it exports them and clears it
  when it releases them, and the reader checks the tags before and after its copy, so a
  late or forged descriptor yields a clear error, never another request's KV.
* a **segment** (``kv``): one wire frame (:mod:`epdserve.transfer.wire`) holding one
  request's blocks, for compressed KV (bf16, int8) and layer-pipelined hand-offs. The
  reader maps it, unlinks it at once (the mapping keeps the memory) and copies from it.

The owner pid in the name lets :func:`remove_stale` delete the files of a worker that was
killed (SIGKILL skips every cleanup handler).
"""

from __future__ import annotations

import atexit
import mmap
import os
import re
import uuid
import warnings
from pathlib import Path

import torch

from epdserve.transfer.wire import ALIGN, TensorHeader, WireError, frame_size, header_bytes, parse

SHM_DIR = Path("/dev/shm")
_SEGMENT = re.compile(r"epdserve-kv-([0-9]{1,10})-[0-9a-f]{32}")
_POOL = re.compile(r"epdserve-kvpool-([0-9]{1,10})-[0-9a-f]{32}")


def new_name(kind: str = "kv") -> str:
    """A fresh file name of ``kind`` ("kv" segment or "kvpool") owned by this process."""
    return f"epdserve-{kind}-{os.getpid()}-{uuid.uuid4().hex}"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def remove_stale() -> list[str]:
    """Delete every epdserve segment and pool whose owner process is gone; returns their
    names. (A pid reused by an unrelated process keeps its files until that one exits.)"""
    removed = []
    for path in SHM_DIR.glob("epdserve-*"):
        match = _SEGMENT.fullmatch(path.name) or _POOL.fullmatch(path.name)
        if match and not _alive(int(match.group(1))):
            path.unlink(missing_ok=True)
            removed.append(path.name)
    return removed


def _pool_layout(shape: tuple[int, ...], dtype: torch.dtype) -> tuple[int, int]:
    """Byte offset of the tags (after the KV tensor, 64-byte aligned) and the file size."""
    kv_bytes = dtype.itemsize
    for d in shape:
        kv_bytes *= d
    tags_at = kv_bytes + (-kv_bytes % ALIGN)
    return tags_at, tags_at + 8 * shape[2]


def _views(buffer, shape: tuple[int, ...], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    tags_at, _ = _pool_layout(shape, dtype)
    count = tags_at // dtype.itemsize
    with warnings.catch_warnings():
        # A reader's mapping is read-only and only ever copied from.
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        flat = torch.frombuffer(buffer, dtype=dtype, count=count)
        tags = torch.frombuffer(buffer, dtype=torch.int64, count=shape[2], offset=tags_at)
    numel = 1
    for d in shape:
        numel *= d
    return flat[:numel].view(shape), tags


class KVPool:
    """A KV cache ``kv [layers, 2, num_blocks, block_size, kv_heads, head_dim]`` of
    ``dtype`` and its block tags ``tags [num_blocks]`` (int64, 0 = not exported) in a new
    /dev/shm file ``name``, mapped shared and pre-touched: every page is written once here
    (zeros, as an engine's cache starts), because first writes into fresh tmpfs pages
    fault and run at about 1 GB/s, far below memcpy. Deletes stale files first
    (:func:`remove_stale`).

    Raises:
        OSError: /dev/shm is missing, full or not writable.
    """

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype):
        remove_stale()
        self.name = new_name("kvpool")
        self.shape = tuple(shape)
        _, size = _pool_layout(self.shape, dtype)
        fd = os.open(SHM_DIR / self.name, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, size)
            self._mm = mmap.mmap(fd, size)
        except BaseException:
            (SHM_DIR / self.name).unlink(missing_ok=True)
            raise
        finally:
            os.close(fd)
        atexit.register(self.close)  # also on a bad option or an error before the worker's loop
        self.kv, self.tags = _views(self._mm, self.shape, dtype)
        self.kv.zero_()
        self.tags.zero_()

    def close(self) -> None:
        """Delete the file (idempotent). Mappings, ours and readers', stay valid until
        dropped."""
        (SHM_DIR / self.name).unlink(missing_ok=True)


def map_pool(name: str, shape: tuple[int, ...], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Map another process's pool read-only; returns its ``kv`` and ``tags`` (see
    :class:`KVPool`). The page tables are filled at once (MAP_POPULATE) so that copies
    from the mapping run at memcpy speed from the first one.

    Raises:
        WireError: a name that is not a pool's, a missing file, or a file whose size is not
            that of a pool of ``shape`` and ``dtype``.
    """
    if not _POOL.fullmatch(name):
        raise WireError(f"refusing shared-memory pool name {name!r}")
    _, size = _pool_layout(shape, dtype)
    try:
        fd = os.open(SHM_DIR / name, os.O_RDONLY)
    except FileNotFoundError:
        raise WireError(f"KV pool {name} is gone (its prefill worker stopped)") from None
    try:
        actual = os.fstat(fd).st_size
        if actual != size:
            raise WireError(f"KV pool {name} is {actual} bytes, a pool of {list(shape)} {dtype} is {size}")
        mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE, prot=mmap.PROT_READ)
    finally:
        os.close(fd)
    return _views(mm, shape, dtype)


def pool_exists(name: str) -> bool:
    return _POOL.fullmatch(name) is not None and (SHM_DIR / name).exists()


def create(name: str, header: TensorHeader) -> tuple[mmap.mmap, dict[str, torch.Tensor]]:
    """Create ``/dev/shm/name`` holding a frame with ``header`` and return its mapping and
    its tensors by name (views of the mapping, to be filled; drop them before closing the
    mapping).

    Raises:
        OSError: /dev/shm is full or not writable.
    """
    prefix = header_bytes(header)
    size = frame_size(header)
    fd = os.open(SHM_DIR / name, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, size)
        mm = mmap.mmap(fd, size)
    finally:
        os.close(fd)
    mm[: len(prefix)] = prefix
    return mm, parse(mm)[1]


def write(name: str, header: TensorHeader, fill) -> int:
    """Create ``/dev/shm/name`` holding a frame with ``header``; ``fill(tensors)`` writes
    the tensors (a dict by name of tensors viewing the file). Returns the file size in
    bytes."""
    mm, views = create(name, header)
    with mm:
        fill(views)
        del views
        return len(mm)


def open_segment(name: str) -> mmap.mmap:
    """Map and unlink ``/dev/shm/name``; the mapping keeps the memory until it is freed.

    Raises:
        WireError: a name that is not a segment's, or a missing file.
    """
    if not _SEGMENT.fullmatch(name):
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
    if _SEGMENT.fullmatch(name):
        (SHM_DIR / name).unlink(missing_ok=True)
