"""The one table of a prefill worker's live exports: the KV it holds for decode workers,
each under a lease (``ttl_s``).

An export is a **segment** (a /dev/shm file holding a staged frame; released: the file is
deleted) or **held blocks** of the shared pool (:class:`~epdserve.transfer.shm.KVPool`, or
a GPU's :class:`~epdserve.transfer.cuda_ipc.DevicePool` whose tags lie in /dev/shm beside it;
held: the blocks carry the export's tag in the pool's tag array, which a decode worker
checks before and after it copies them; released: the tags are cleared first, then the
blocks go back to the engine through ``free_blocks``, its ``release_kv``). The table is
the only place exports are added, looked up, released and expired, so the pool's tags
always name exactly the held exports.

Lookups (:meth:`ExportTable.get`) may run on the KV server's thread: a dict lookup is
atomic under the GIL; everything else runs on the worker's loop.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass
from typing import Callable

import torch

from epdserve.transfer import cuda_ipc, shm
from epdserve.transfer.wire import TensorHeader


@dataclass
class Export:
    """A request's KV held for a decode worker: a segment ``name``, or ``blocks`` of the pool
    ``name`` tagged ``tag`` (with the ``header`` of the frame a TCP fetch of them gets);
    ``created``: ``time.monotonic()`` at export, the start of its lease."""

    name: str
    created: float
    blocks: list[int] | None = None
    header: TensorHeader | None = None
    tag: int = 0


class ExportTable:
    """The live exports by request id. ``pool``: the shared pool whose blocks may be held
    (its ``name`` and ``tags`` are used; None: segments only); ``free_blocks(request_id)``:
    gives a held export's blocks back
    to the engine."""

    def __init__(self, ttl_s: float, pool: shm.KVPool | cuda_ipc.DevicePool | None,
                 free_blocks: Callable[[str], object]):
        self.ttl_s = ttl_s
        self.pool = pool
        self.free_blocks = free_blocks
        self._exports: dict[str, Export] = {}
        self._tags = itertools.count(1)

    def __len__(self) -> int:
        return len(self._exports)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._exports

    def ids(self) -> list[str]:
        return list(self._exports)

    def get(self, request_id: str) -> Export | None:
        return self._exports.get(request_id)

    def can_hold(self, blocks: list[int]) -> bool:
        """Whether ``blocks`` can be held for one more export: there is a pool and none of
        them is held already (a block shared through the prefix cache may be held for
        another hand-off; one tag per block cannot name two holders)."""
        return self.pool is not None and not bool(self.pool.tags[torch.tensor(blocks)].any())

    def hold(self, request_id: str, blocks: list[int], header: TensorHeader) -> Export:
        """Register held pool ``blocks`` (see :meth:`can_hold`) and tag them."""
        tag = next(self._tags)
        self.pool.tags[torch.tensor(blocks)] = tag
        entry = self._exports[request_id] = Export(self.pool.name, time.monotonic(), list(blocks), header, tag)
        return entry

    def add_segment(self, request_id: str, name: str) -> Export:
        """Register the segment ``name`` (already written)."""
        entry = self._exports[request_id] = Export(name, time.monotonic())
        return entry

    def release(self, request_id: str) -> bool:
        """Give up the request's export if it is still live (imported, abort, TTL): delete
        its segment, or untag its blocks and free them. True if there was one."""
        entry = self._exports.pop(request_id, None)
        if entry is None:
            return False
        if entry.blocks is None:
            shm.remove(entry.name)
        else:
            self.pool.tags[torch.tensor(entry.blocks)] = 0  # before the blocks can be reused
            self.free_blocks(request_id)
        return True

    def expire(self) -> list[str]:
        """Release every export whose lease (``ttl_s``) has passed; returns their request ids."""
        now = time.monotonic()
        old = [rid for rid, entry in self._exports.items() if now - entry.created > self.ttl_s]
        for request_id in old:
            self.release(request_id)
        return old

    def close(self) -> None:
        """Release every export still live."""
        for request_id in list(self._exports):
            self.release(request_id)
