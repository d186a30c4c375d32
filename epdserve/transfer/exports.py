"""The one table of a prefill worker's live exports under a lease (``ttl_s``): a /dev/shm segment, or held
pool blocks (tagged while held; tags cleared before the blocks are freed). :meth:`ExportTable.get` may run
on the KV server's thread (a GIL-atomic lookup); all else on the worker's loop."""

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
    """``blocks`` None: a segment. ``header``: what a TCP fetch of the blocks gets; ``created``:
    ``time.monotonic()``, the lease's start."""

    name: str
    created: float
    blocks: list[int] | None = None
    header: TensorHeader | None = None
    tag: int = 0


class ExportTable:
    """``pool`` None: segments only; ``free_blocks(request_id)`` gives held blocks back to the engine."""

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
        """None held already: a prefix-cache-shared block may be held for another hand-off, and one tag cannot name
        two holders."""
        return self.pool is not None and not bool(self.pool.tags[torch.tensor(blocks)].any())

    def hold(self, request_id: str, blocks: list[int], header: TensorHeader) -> Export:
        """Register held pool ``blocks`` (see :meth:`can_hold`) and tag them."""
        tag = next(self._tags)
        self.pool.tags[torch.tensor(blocks)] = tag
        entry = self._exports[request_id] = Export(self.pool.name, time.monotonic(), list(blocks), header, tag)
        return entry

    def add_segment(self, request_id: str, name: str) -> Export:
        entry = self._exports[request_id] = Export(name, time.monotonic())
        return entry

    def release(self, request_id: str) -> bool:
        """Delete its segment, or untag and free its blocks. True if it was live (a repeat is a no-op)."""
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
        """Returns the released request ids."""
        now = time.monotonic()
        old = [rid for rid, entry in self._exports.items() if now - entry.created > self.ttl_s]
        for request_id in old:
            self.release(request_id)
        return old

    def close(self) -> None:
        for request_id in list(self._exports):
            self.release(request_id)
