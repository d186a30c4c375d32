"""/dev/shm files ``epdserve-<kind>-<owner pid>-<32 hex>``: a prefill worker's KV cache (``kvpool``: one part
per rank, each 64-byte aligned, then one int64 tag per block), a one-request frame (``kv``, unlinked by its
reader on mapping), or a GPU cache's tags alone (``kvtags``, the pool id). Tags are set at export, cleared
at release, checked by the reader before and after its copy; the pid lets :func:`remove_stale` clean up."""

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
    """Returns their names. A reused pid keeps its files until that process exits."""
    removed = []
    for path in SHM_DIR.glob("epdserve-*"):
        match = _SEGMENT.fullmatch(path.name) or _POOL.fullmatch(path.name) or TAGS.fullmatch(path.name)
        if match and not pid_alive(int(match.group(1))):
            path.unlink(missing_ok=True)
            removed.append(path.name)
    return removed


def _pool_layout(shape: tuple[int, ...], dtype: torch.dtype, head_split: list[int]) -> tuple[list[int], int, int]:
    """Part offsets (one per ``head_split`` entry, 64-byte aligned), the tags' (aligned), and the file size."""
    per_head = dtype.itemsize * math.prod(shape[:4] + shape[5:])
    offsets, at = [], 0
    for heads in head_split:
        offsets.append(at)
        at += per_head * heads
        at += -at % ALIGN
    return offsets, at, at + 8 * shape[2]


def part_shapes(shape: tuple[int, ...], head_split: list[int]) -> list[tuple[int, ...]]:
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
    """Split by KV head into ``parts`` (``head_split``), tags int64 (0: not exported), mapped shared and pre-touched
    (first writes to fresh tmpfs pages fault at ~1 GB/s). Raises OSError (/dev/shm)."""

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
        """Idempotent; mappings, ours and readers', stay valid until dropped."""
        (SHM_DIR / self.name).unlink(missing_ok=True)


def _create_owned(name: str, size: int, close) -> mmap.mmap:
    """Deleted at interpreter exit too (also on an error before the worker's loop)."""
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
    """Read-only, MAP_POPULATE, checked to be ``size`` bytes."""
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
    """The tags of a GPU's KV cache (the rules of a :class:`KVPool`'s) in a new /dev/shm file ``name``.
    Raises OSError (/dev/shm)."""

    def __init__(self, num_blocks: int):
        self.name = new_name("kvtags")
        self._mm = _create_owned(self.name, 8 * num_blocks, self.close)
        self.tags = torch.frombuffer(self._mm, dtype=torch.int64, count=num_blocks)
        self.tags.zero_()

    def close(self) -> None:
        """Idempotent; mappings stay valid until dropped."""
        (SHM_DIR / self.name).unlink(missing_ok=True)


def map_tags(name: str, num_blocks: int) -> torch.Tensor:
    """Read-only. Raises WireError: not a tag file's name, missing, or not ``num_blocks`` tags long."""
    if not TAGS.fullmatch(name):
        raise WireError(f"refusing KV tag file name {name!r}")
    mm = _map_readonly(name, 8 * num_blocks, "KV tag file", f"a tag file of {num_blocks} blocks")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        return torch.frombuffer(mm, dtype=torch.int64, count=num_blocks)


def map_pool(name: str, shape: tuple[int, ...], dtype: torch.dtype,
             head_split: list[int]) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Read-only; MAP_POPULATE so copies run at memcpy speed from the first. Raises WireError: not a pool's
    name, missing, or the wrong size."""
    if not _POOL.fullmatch(name):
        raise WireError(f"refusing shared-memory pool name {name!r}")
    size = _pool_layout(shape, dtype, head_split)[2]
    mm = _map_readonly(name, size, "KV pool", f"a pool of {list(shape)} {dtype} in parts of {head_split} heads")
    return _views(mm, shape, dtype, head_split)


def map_part(name: str, shape: tuple[int, ...], dtype: torch.dtype, head_split: list[int],
             index: int) -> torch.Tensor:
    """Read-write: a follower rank's KV cache in rank 0's file. Raises OSError (missing or wrong size)."""
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
    """The mapping and its tensors to fill (drop them before closing it). Raises OSError (/dev/shm)."""
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
    """``fill(tensors)`` writes the tensors; returns the file size in bytes."""
    mm, views = create(name, header)
    with mm:
        fill(views)
        del views
        return len(mm)


def open_segment(name: str) -> mmap.mmap:
    """The mapping keeps the memory. Raises WireError: not a segment's name, or gone."""
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
    """Header and tensors viewing the mapping. Raises WireError (as :func:`open_segment`, or a malformed frame)."""
    return parse(open_segment(name))


def remove(name: str) -> None:
    """Delete a segment that will not be read (abort, timeout); missing is fine."""
    if _SEGMENT.fullmatch(name):
        (SHM_DIR / name).unlink(missing_ok=True)
