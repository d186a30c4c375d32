"""KV hand-off between workers on one host through POSIX shared memory (/dev/shm).

Three kinds of files, all named ``epdserve-<kind>-<owner pid>-<32 hex digits>``:

* a **pool** (``kvpool``): a prefill worker's whole KV cache, created once at start-up
  (:class:`KVPool`); a tensor-parallel worker's holds one part per rank, each rank mapping
  its own (:func:`map_part`). A same-host hand-off then copies nothing on the prefill
  side: the decode worker maps the pool once (:func:`map_pool`) and copies the request's
  blocks straight out of it. Behind the KV parts the file holds one int64 *tag* per block: the
  prefill side writes a hand-off's tag into its blocks when it exports them and clears it
  when it releases them, and the reader checks the tags before and after its copy, so a
  late or forged descriptor yields a clear error, never another request's KV.
* a **segment** (``kv``): one wire frame (:mod:`epdserve.transfer.wire`) holding one
  request's blocks, for compressed KV (bf16, int8) and layer-pipelined hand-offs. The
  reader maps it, unlinks it at once (the mapping keeps the memory) and copies from it.
* a **tag file** (``kvtags``): only the tags, one int64 per block, of a prefill worker's KV
  cache that lives on a GPU (:class:`TagFile`, used by :mod:`epdserve.transfer.cuda_ipc`):
  the same tags with the same rules as a pool's, next to device memory a decode worker
  opens by CUDA IPC. Its name is also the pool's id.

The owner pid in the name lets :func:`remove_stale` delete the files of a worker that was
killed (SIGKILL skips every cleanup handler).
"""

from __future__ import annotations

import atexit
import math
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
TAGS = re.compile(r"epdserve-kvtags-([0-9]{1,10})-[0-9a-f]{32}")


def new_name(kind: str = "kv") -> str:
    """A fresh file name of ``kind`` ("kv" segment or "kvpool") owned by this process."""
    return f"epdserve-{kind}-{os.getpid()}-{uuid.uuid4().hex}"


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists (a reused pid reads as alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def remove_stale() -> list[str]:
    """Delete every epdserve segment, pool and tag file whose owner process is gone; returns their
    names. (A pid reused by an unrelated process keeps its files until that one exits.)"""
    removed = []
    for path in SHM_DIR.glob("epdserve-*"):
        match = _SEGMENT.fullmatch(path.name) or _POOL.fullmatch(path.name) or TAGS.fullmatch(path.name)
        if match and not pid_alive(int(match.group(1))):
            path.unlink(missing_ok=True)
            removed.append(path.name)
    return removed


def _pool_layout(shape: tuple[int, ...], dtype: torch.dtype, head_split: list[int]) -> tuple[list[int], int, int]:
    """Byte offset of each part (one per entry of ``head_split``, the KV heads it holds, each
    64-byte aligned), of the tags (after the parts, aligned) and the file size."""
    per_head = dtype.itemsize * math.prod(shape[:4] + shape[5:])
    offsets, at = [], 0
    for heads in head_split:
        offsets.append(at)
        at += per_head * heads
        at += -at % ALIGN
    return offsets, at, at + 8 * shape[2]


def part_shapes(shape: tuple[int, ...], head_split: list[int]) -> list[tuple[int, ...]]:
    """The shape of each part of a pool of ``shape`` (every KV head) split as ``head_split``."""
    return [tuple(shape[:4]) + (heads,) + tuple(shape[5:]) for heads in head_split]


def _views(buffer, shape: tuple[int, ...], dtype: torch.dtype,
           head_split: list[int]) -> tuple[list[torch.Tensor], torch.Tensor]:
    offsets, tags_at, _ = _pool_layout(shape, dtype, head_split)
    parts = []
    with warnings.catch_warnings():
        # A reader's mapping is read-only and only ever copied from.
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        for offset, part in zip(offsets, part_shapes(shape, head_split)):
            parts.append(torch.frombuffer(buffer, dtype=dtype, count=math.prod(part), offset=offset).view(part))
        tags = torch.frombuffer(buffer, dtype=torch.int64, count=shape[2], offset=tags_at)
    return parts, tags


class KVPool:
    """A KV cache of ``shape [layers, 2, num_blocks, block_size, kv_heads, head_dim]`` in
    ``dtype``, split by KV head into ``parts`` (``head_split``: the heads of each, in order;
    default one part of every head), the parts of a tensor-parallel worker's ranks
    (``engine/kv_parts.py``), and its block tags ``tags [num_blocks]`` (int64, 0 = not
    exported) in a new /dev/shm file ``name``, mapped shared and pre-touched: every page is
    written once here (zeros, as an engine's cache starts), because first writes into fresh
    tmpfs pages fault and run at about 1 GB/s, far below memcpy. Deletes stale files first
    (:func:`remove_stale`). Other ranks map their part with :func:`map_part`.

    Raises:
        OSError: /dev/shm is missing, full or not writable.
    """

    kind = "pool"  # the descriptor kind of its exports

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, head_split: list[int] | None = None):
        self.name = new_name("kvpool")
        self.shape = tuple(shape)
        self.head_split = list(head_split or [shape[4]])
        self._mm = _create_owned(self.name, _pool_layout(self.shape, dtype, self.head_split)[2], self.close)
        self.parts, self.tags = _views(self._mm, self.shape, dtype, self.head_split)
        for part in self.parts:
            part.zero_()
        self.tags.zero_()

    def close(self) -> None:
        """Delete the file (idempotent). Mappings, ours and readers', stay valid until
        dropped."""
        (SHM_DIR / self.name).unlink(missing_ok=True)


def _create_owned(name: str, size: int, close) -> mmap.mmap:
    """Create and map ``/dev/shm/name`` of ``size`` bytes for this process (deleting stale
    files first), with ``close`` registered to delete it at interpreter exit (also on a bad
    option or an error before the worker's loop)."""
    remove_stale()
    fd = os.open(SHM_DIR / name, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, size)
        mm = mmap.mmap(fd, size)
    except BaseException:
        (SHM_DIR / name).unlink(missing_ok=True)
        raise
    finally:
        os.close(fd)
    atexit.register(close)
    return mm


def _map_readonly(name: str, size: int, what: str, expected: str) -> mmap.mmap:
    """Map another process's ``/dev/shm/name`` read-only with its page tables filled
    (MAP_POPULATE), checking it is ``size`` bytes; ``what`` names it in errors and
    ``expected`` says what holds ``size`` bytes."""
    try:
        fd = os.open(SHM_DIR / name, os.O_RDONLY)
    except FileNotFoundError:
        raise WireError(f"{what} {name} is gone (its prefill worker stopped)") from None
    try:
        actual = os.fstat(fd).st_size
        if actual != size:
            raise WireError(f"{what} {name} is {actual} bytes, {expected} is {size}")
        return mmap.mmap(fd, size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE, prot=mmap.PROT_READ)
    finally:
        os.close(fd)


class TagFile:
    """The block tags ``tags [num_blocks]`` (int64, 0 = not exported) of a KV cache that is
    not in this file (a GPU's), in a new /dev/shm file ``name`` (``epdserve-kvtags-<pid>-<hex>``),
    mapped shared: the same tags as a :class:`KVPool`'s, written and cleared by the
    :class:`~epdserve.transfer.exports.ExportTable`, read by the decode side around its
    copy.

    Raises:
        OSError: /dev/shm is missing, full or not writable.
    """

    def __init__(self, num_blocks: int):
        self.name = new_name("kvtags")
        self._mm = _create_owned(self.name, 8 * num_blocks, self.close)
        self.tags = torch.frombuffer(self._mm, dtype=torch.int64, count=num_blocks)
        self.tags.zero_()

    def close(self) -> None:
        """Delete the file (idempotent); mappings stay valid until dropped."""
        (SHM_DIR / self.name).unlink(missing_ok=True)


def map_tags(name: str, num_blocks: int) -> torch.Tensor:
    """Map another process's :class:`TagFile` read-only; returns its ``tags [num_blocks]``.

    Raises:
        WireError: a name that is not a tag file's, a missing file, or one whose size is not
            that of ``num_blocks`` tags.
    """
    if not TAGS.fullmatch(name):
        raise WireError(f"refusing KV tag file name {name!r}")
    mm = _map_readonly(name, 8 * num_blocks, "KV tag file", f"a tag file of {num_blocks} blocks")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        return torch.frombuffer(mm, dtype=torch.int64, count=num_blocks)


def map_pool(name: str, shape: tuple[int, ...], dtype: torch.dtype,
             head_split: list[int]) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Map another process's pool read-only; returns its ``parts`` and ``tags`` (see
    :class:`KVPool`). The page tables are filled at once (MAP_POPULATE) so that copies
    from the mapping run at memcpy speed from the first one.

    Raises:
        WireError: a name that is not a pool's, a missing file, or a file whose size is not
            that of a pool of ``shape``, ``dtype`` and ``head_split``.
    """
    if not _POOL.fullmatch(name):
        raise WireError(f"refusing shared-memory pool name {name!r}")
    size = _pool_layout(shape, dtype, head_split)[2]
    mm = _map_readonly(name, size, "KV pool", f"a pool of {list(shape)} {dtype} in parts of {head_split} heads")
    return _views(mm, shape, dtype, head_split)


def map_part(name: str, shape: tuple[int, ...], dtype: torch.dtype, head_split: list[int],
             index: int) -> torch.Tensor:
    """Map part ``index`` of a :class:`KVPool` of this host read-write (a follower rank's
    KV cache, in the file rank 0 created).

    Raises:
        OSError: the file is missing or not the size of that pool.
    """
    size = _pool_layout(shape, dtype, head_split)[2]
    fd = os.open(SHM_DIR / name, os.O_RDWR)
    try:
        if os.fstat(fd).st_size != size:
            raise OSError(f"KV pool {name} is not a pool of {list(shape)} {dtype} in parts of {head_split} heads")
        mm = mmap.mmap(fd, size)
    finally:
        os.close(fd)
    return _views(mm, shape, dtype, head_split)[0][index]


def pool_exists(name: str) -> bool:
    """Whether ``name`` is a pool's or tag file's name and the file is still there."""
    return (_POOL.fullmatch(name) or TAGS.fullmatch(name)) is not None and (SHM_DIR / name).exists()


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
