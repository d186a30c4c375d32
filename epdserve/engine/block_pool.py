"""The paged KV cache's block pool: which fixed-size blocks are free, and who holds them."""

from __future__ import annotations

from collections import deque


class NoFreeBlocks(RuntimeError):
    """Raised by :meth:`BlockPool.allocate` when fewer blocks are free than asked for."""


class BlockPool:
    """``num_blocks`` blocks of ``block_size`` tokens each, with reference counts.

    Block ids index dimension 2 of the KV cache tensor. A block is free when its
    reference count is 0; the count lets a prefix cache share one block between
    sequences later.
    """

    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1:
            raise ValueError(f"KV cache has no blocks (num_blocks={num_blocks}); raise the memory budget")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref_counts = [0] * num_blocks
        self.free_ids: deque[int] = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self.free_ids)

    @property
    def num_in_use(self) -> int:
        return self.num_blocks - len(self.free_ids)

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` tokens (ceil division)."""
        return -(-num_tokens // self.block_size)

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` free blocks. Raises :class:`NoFreeBlocks` if fewer are free."""
        if n > len(self.free_ids):
            raise NoFreeBlocks(f"need {n} blocks, {len(self.free_ids)} free")
        ids = [self.free_ids.popleft() for _ in range(n)]
        for i in ids:
            self.ref_counts[i] = 1
        return ids

    def free(self, ids: list[int]) -> None:
        """Drop one reference to each block; blocks reaching 0 become free."""
        for i in ids:
            self.ref_counts[i] -= 1
            if self.ref_counts[i] == 0:
                self.free_ids.append(i)
