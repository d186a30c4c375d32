"""One request's KV blocks read straight from a prefill worker's cache (a /dev/shm pool or CUDA IPC), the tag
checked before the copy and after it has ended: a late or forged descriptor fails, never reads others' KV."""

from __future__ import annotations

from typing import Callable

import torch

from epdserve.engine.kv_parts import KVParts, copy_blocks
from epdserve.engine.kv_source import check_kv
from epdserve.transfer.wire import WireError


class PooledKV:
    """``runs``: ``(first block, count)`` of ``pool`` (a part per prefill rank) tagged ``tag`` in host ``tags``.
    ``owner_alive()`` None: unchecked (a /dev/shm mapping outlives its owner, a GPU allocation may not)."""

    def __init__(self, request_id: str, pool: KVParts, tags: torch.Tensor, runs: list[tuple[int, int]],
                 tag: int, dtype: torch.dtype, owner_alive: Callable[[], bool] | None = None):
        self.request_id = request_id
        self.pool, self.tags, self.runs, self.tag = pool, tags, runs, tag
        self.ids = [block for first, n in runs for block in range(first, first + n)]
        self.shape = pool.block_shape(len(self.ids))
        self.dtype = dtype
        self.owner_alive = owner_alive

    def check(self) -> None:
        """Raises WireError unless every block carries the tag and the owner (if checked) runs."""
        if self.owner_alive is not None and not self.owner_alive():
            raise WireError(f"the prefill worker that exported the KV of {self.request_id} is gone")
        if not bool((self.tags[self.ids] == self.tag).all()):
            raise WireError(f"KV blocks of {self.request_id} are no longer held by the prefill worker "
                            f"(released, expired, or not this request's)")

    def validate(self, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        check_kv(self.shape, self.dtype, shape, dtype)

    def copy_into(self, kv_cache: KVParts, block_table: list[int], first_block: int = 0) -> None:
        """Past ``first_block``; GPU copies end before the second tag check (mid-copy it would prove nothing).
        Raises WireError if the blocks were released (TTL, abort) or the exporter stopped: the copy is void."""
        first = first_block
        self.check()
        copy_blocks(self.pool, self.ids[first:], kv_cache, block_table[first:len(self.ids)])
        wait_for_copies(*self.pool.parts, *kv_cache.parts)
        self.check()


def wait_for_copies(*tensors: torch.Tensor) -> None:
    """On each GPU's current stream (host copies are synchronous)."""
    for device in {t.device for t in tensors if t.is_cuda}:
        torch.cuda.current_stream(device).synchronize()
