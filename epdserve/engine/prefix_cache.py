"""Automatic prefix caching as vLLM v1 (``hash_block_tokens``): block ``i``'s key chains block ``i - 1``'s,
its token ids and image hashes; SHA-256, so keys match across processes (Python's ``hash`` is salted)."""

from __future__ import annotations

import hashlib

import msgpack

from epdserve.engine.block_pool import BlockPool
from epdserve.engine.request import Sequence


def hash_block(parent: bytes | None, token_ids: list[int], extra_keys: tuple = ()) -> bytes:
    """32 bytes: SHA-256 of msgpack ``[parent, token_ids, extra_keys]``; ``parent`` None for block 0."""
    return hashlib.sha256(msgpack.packb([parent, token_ids, list(extra_keys)], use_bin_type=True)).digest()


class PrefixCache:
    """A no-op unless ``enabled``. ``queries``/``hits``: cumulative tokens (vLLM's ``prefix_cache_queries``
    and ``_hits``) asked for and found at each sequence's first admission."""

    def __init__(self, pool: BlockPool, enabled: bool = True):
        self.pool = pool
        self.enabled = enabled
        self.queries = 0
        self.hits = 0

    def _hashes(self, seq: Sequence, num_blocks: int) -> list[bytes]:
        hashes, size = seq.block_hashes, self.pool.block_size
        for i in range(len(hashes), num_blocks):
            extra = seq.images.block_keys(i, size) if seq.images is not None else ()
            hashes.append(hash_block(hashes[-1] if hashes else None, seq.token_ids[i * size:(i + 1) * size], extra))
        return hashes[:num_blocks]

    def match(self, seq: Sequence) -> list[int]:
        """Unreferenced cached blocks of ``seq``'s leading full blocks. The last token stays uncached for its
        logits (vLLM's rule) unless the prompt KV is imported; a request wanting prompt logprobs matches none."""
        if not self.enabled or (seq.sampling.prompt_logprobs is not None and seq.num_output_tokens == 0):
            return []
        imported = seq.pending_kv is not None
        limit = seq.num_prompt_tokens if imported else len(seq) - 1
        return self.pool.lookup(self._hashes(seq, limit // self.pool.block_size))

    def admitted(self, seq: Sequence, num_hit_blocks: int) -> None:
        if seq.num_cached_tokens is None:
            seq.num_cached_tokens = num_hit_blocks * self.pool.block_size
            if self.enabled:
                self.queries += seq.num_prompt_tokens
                self.hits += seq.num_cached_tokens

    def register(self, seq: Sequence) -> None:
        num_full = seq.num_computed_tokens // self.pool.block_size
        if not self.enabled or num_full <= seq.num_cached_blocks:
            return
        hashes = self._hashes(seq, num_full)
        for i in range(seq.num_cached_blocks, num_full):
            self.pool.cache(seq.block_table[i], hashes[i])
        seq.num_cached_blocks = num_full
