"""The paged KV cache's block pool: which fixed-size blocks are free, who holds them, and
which keep a cached prefix.

As vLLM v1's ``BlockPool`` (``vllm/v1/core/block_pool.py``): a block with reference count
0 is free; a free block that holds a full block of a cached prefix stays findable by its
hash until it is allocated again (evicted, least recently freed first), and a hit on it
revives it. :class:`~epdserve.engine.prefix_cache.PrefixCache` decides what to look up
and register.
"""

from __future__ import annotations

from collections import OrderedDict, deque


class NoFreeBlocks(RuntimeError):
    """Raised by :meth:`BlockPool.allocate` when fewer blocks are free than asked for."""


class BlockPool:
    """``num_blocks`` blocks of ``block_size`` tokens each, with reference counts.

    Block ids index dimension 2 of the KV cache tensor. ``free_ids``: free blocks without
    cached content; ``evictable``: free blocks with cached content, least recently freed
    first; ``cached``: block hash → block id (free or not).
    """

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
        """Blocks that :meth:`allocate` can hand out (cached-but-free ones included)."""
        return len(self.free_ids) + len(self.evictable)

    @property
    def num_in_use(self) -> int:
        """Blocks with a reference (cached-but-free blocks are not in use)."""
        return self.num_blocks - self.num_free

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` tokens (ceil division)."""
        return -(-num_tokens // self.block_size)

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` free blocks: blocks without cached content first, then the least
        recently freed cached ones (their hash is dropped). Raises :class:`NoFreeBlocks`
        if fewer are free."""
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
        """Drop one reference to each block of ``ids`` (a block table, or its head or
        tail). Freed last block first, so that a sequence's tail, the part least likely
        shared, is evicted before its head (vLLM's order)."""
        for i in reversed(ids):
            self.ref_counts[i] -= 1
            if self.ref_counts[i] == 0:
                if i in self.block_hashes:
                    self.evictable[i] = None
                else:
                    self.free_ids.append(i)

    def lookup(self, hashes: list[bytes]) -> list[int]:
        """The cached blocks of the longest leading run of ``hashes`` found in the cache."""
        ids = []
        for h in hashes:
            i = self.cached.get(h)
            if i is None:
                break
            ids.append(i)
        return ids

    def touch(self, ids: list[int]) -> None:
        """Take one reference to each cached block of ``ids`` (a prefix-cache hit),
        reviving free ones."""
        for i in ids:
            if self.ref_counts[i] == 0:
                del self.evictable[i]
            self.ref_counts[i] += 1

    def cache(self, block_id: int, block_hash: bytes) -> None:
        """Make the held, full block ``block_id`` findable under ``block_hash``. A hash
        that another block already holds keeps that block (the first one wins; this one is
        freed as uncached later)."""
        if block_hash not in self.cached and block_id not in self.block_hashes:
            self.cached[block_hash] = block_id
            self.block_hashes[block_id] = block_hash
