"""Automatic prefix caching: full KV blocks found again by a hash of everything before them.

As vLLM v1 (``vllm/v1/core/kv_cache_utils.py: hash_block_tokens``, ``KVCacheManager``):
block ``i`` of a sequence is keyed by a hash chained over (hash of block ``i - 1``, the
block's token ids, extra keys such as image hashes), so equal keys mean equal prefixes. A
new sequence reuses the cached blocks of its longest cached run of leading full blocks and
computes only the rest; a block is registered once all its tokens have K/V. The hash is
SHA-256 over a msgpack encoding, the same in every process (Python's ``hash`` is salted per
process), so routers and peers can compare keys.
"""

from __future__ import annotations

import hashlib

import msgpack

from epdserve.engine.block_pool import BlockPool
from epdserve.engine.request import Sequence


def hash_block(parent: bytes | None, token_ids: list[int], extra_keys: tuple = ()) -> bytes:
    """32-byte key of one full block: SHA-256 of msgpack ``[parent, token_ids, extra_keys]``;
    ``parent`` is the previous block's key, None for a sequence's first block."""
    return hashlib.sha256(msgpack.packb([parent, token_ids, list(extra_keys)], use_bin_type=True)).digest()


class PrefixCache:
    """Looks up and registers a sequence's full blocks in ``pool``; a no-op when not
    ``enabled``. ``queries`` and ``hits`` count tokens, cumulatively (vLLM's
    ``prefix_cache_queries``/``prefix_cache_hits``): the tokens each sequence asked for at
    its first admission, and how many of them were found cached."""

    def __init__(self, pool: BlockPool, enabled: bool = True):
        self.pool = pool
        self.enabled = enabled
        self.queries = 0
        self.hits = 0

    def _hashes(self, seq: Sequence, num_blocks: int) -> list[bytes]:
        """The keys of ``seq``'s first ``num_blocks`` blocks (all full), computed once each."""
        hashes, size = seq.block_hashes, self.pool.block_size
        for i in range(len(hashes), num_blocks):
            extra = seq.images.block_keys(i, size) if seq.images is not None else ()
            hashes.append(hash_block(hashes[-1] if hashes else None, seq.token_ids[i * size:(i + 1) * size], extra))
        return hashes[:num_blocks]

    def match(self, seq: Sequence) -> list[int]:
        """The cached blocks holding ``seq``'s leading full blocks, not yet referenced. At
        least the last token stays uncached so that its logits get computed (vLLM's rule);
        a sequence whose prompt KV comes with it (decode role) may match all its prompt's
        full blocks, as those need no computing, only a copy. A sequence that wants prompt
        logprobs and has not had them (no token yet) matches nothing: every prompt position's
        logits must be computed (vLLM recomputes them too)."""
        if not self.enabled or (seq.sampling.prompt_logprobs is not None and seq.num_output_tokens == 0):
            return []
        imported = seq.pending_kv is not None
        limit = seq.num_prompt_tokens if imported else len(seq) - 1
        return self.pool.lookup(self._hashes(seq, limit // self.pool.block_size))

    def admitted(self, seq: Sequence, num_hit_blocks: int) -> None:
        """Count ``seq``'s first admission, with ``num_hit_blocks`` leading blocks found, in
        ``queries``/``hits`` and ``seq.num_cached_tokens``."""
        if seq.num_cached_tokens is None:
            seq.num_cached_tokens = num_hit_blocks * self.pool.block_size
            if self.enabled:
                self.queries += seq.num_prompt_tokens
                self.hits += seq.num_cached_tokens

    def register(self, seq: Sequence) -> None:
        """Cache ``seq``'s blocks that have become full of computed K/V since the last call."""
        num_full = seq.num_computed_tokens // self.pool.block_size
        if not self.enabled or num_full <= seq.num_cached_blocks:
            return
        hashes = self._hashes(seq, num_full)
        for i in range(seq.num_cached_blocks, num_full):
            self.pool.cache(seq.block_table[i], hashes[i])
        seq.num_cached_blocks = num_full
