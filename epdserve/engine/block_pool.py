"""The paged KV cache's block pool, as vLLM v1's ``BlockPool`` (``vllm/v1/core/block_pool.py``):
refcount 0 is free; a free block holding a full cached-prefix block stays findable by hash until
allocated again (least recently freed first)."""

from __future__ import annotations

from collections import OrderedDict, deque


class NoFreeBlocks(RuntimeError):
    """Fewer blocks free than :meth:`BlockPool.allocate` was asked for."""


class BlockPool:
    """Block ids index dimension 2 of the KV cache tensor. ``evictable``: free blocks with cached
    content, least recently freed first; ``cached``: block hash → block id."""

    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1:
            raise ValueError(f"KV cache has no blocks (num_blocks={num_blocks}); raise the memory budget")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref_counts = [0] * num_blocks
        self.free_ids: deque[int] = deque(range(num_blocks))
        self.evictable: OrderedDict[int, None] = OrderedDict()
        self.cached: dict[bytes, int] = {}
        self.block_hashes: dict[int, bytes] = {}

    @property
    def num_free(self) -> int:
        """Cached-but-free blocks included."""
        return len(self.free_ids) + len(self.evictable)

    @property
    def num_in_use(self) -> int:
        return self.num_blocks - self.num_free

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def allocate(self, n: int) -> list[int]:
        """Uncached blocks first, then the least recently freed cached ones. Raises :class:`NoFreeBlocks`."""
        if n > self.num_free:
            raise NoFreeBlocks(f"need {n} blocks, {self.num_free} free")
        ids = []
        for _ in range(n):
            if self.free_ids:
                i = self.free_ids.popleft()
            else:
                i, _ = self.evictable.popitem(last=False)
                del self.cached[self.block_hashes.pop(i)]
            self.ref_counts[i] = 1
            ids.append(i)
        return ids

    def free(self, ids: list[int]) -> None:
        """Last block first, so a sequence's tail is evicted before its head (vLLM's order)."""
        for i in reversed(ids):
            self.ref_counts[i] -= 1
            if self.ref_counts[i] == 0:
                if i in self.block_hashes:
                    self.evictable[i] = None
                else:
                    self.free_ids.append(i)

    def lookup(self, hashes: list[bytes]) -> list[int]:
        ids = []
        for h in hashes:
            i = self.cached.get(h)
            if i is None:
                break
            ids.append(i)
        return ids

    def touch(self, ids: list[int]) -> None:
        for i in ids:
            if self.ref_counts[i] == 0:
                del self.evictable[i]
            self.ref_counts[i] += 1

    def cache(self, block_id: int, block_hash: bytes) -> None:
        """The first block cached under a hash keeps it."""
        if block_hash not in self.cached and block_id not in self.block_hashes:
            self.cached[block_hash] = block_id
            self.block_hashes[block_id] = block_hash
