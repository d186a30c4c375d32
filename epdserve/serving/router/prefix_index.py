"""Prefix-aware routing by SGLang's cache-aware rule over a per-worker LRU belief of the block
keys routed there (llm-d's kind of index); the rule, the keys and measurements are in
docs/serving.md (Routing among workers).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Protocol

from epdserve.engine.prefix_cache import hash_block

POLICIES = ("least-loaded", "prefix-aware")
DEFAULT_POLICY = "least-loaded"
# SGLang's defaults are 64 and 1.5, sized for GPU batches of hundreds; a CPU worker runs a handful.
BALANCE_ABS_THRESHOLD = 4
BALANCE_REL_THRESHOLD = 1.5
CACHE_THRESHOLD = 0.3  # SGLang's (and its model gateway's) --cache-threshold default


class Candidate(Protocol):
    """A :class:`~epdserve.serving.router.registry.WorkerState` as the policy reads it."""

    worker_id: str
    outstanding: dict[str, int]  # request id -> tokens
    blocks_total: int  # its KV pool, in blocks
    kv_layout: dict


def load(w: Candidate) -> tuple[int, int]:
    """Outstanding requests, then their tokens (lowest first)."""
    return len(w.outstanding), sum(w.outstanding.values())


@dataclass
class Decision:
    """``matched_blocks``: believed held by the chosen worker, of ``block_size`` tokens each."""

    worker_id: str
    matched_blocks: int
    block_size: int
    reason: str  # "prefix", "balance" or "spread"

    @property
    def believed_tokens(self) -> int:
        return self.matched_blocks * self.block_size


class PromptBlocks:
    """``image_hashes``: sha256 hex, in prompt order; every one is in every block's key."""

    def __init__(self, token_ids: list[int], image_hashes: tuple[str, ...] | list[str] = ()):
        self.token_ids = token_ids
        self.image_hashes = tuple(image_hashes)
        self.decision: Decision | None = None
        self._hashes: dict[int, list[bytes]] = {}

    def hashes(self, block_size: int) -> list[bytes]:
        """32-byte chained keys of the ``(len(token_ids) - 1) // block_size`` blocks a worker could
        reuse (it always computes the last prompt token). Raises ValueError: ``block_size`` < 1."""
        if block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {block_size}")
        if block_size not in self._hashes:
            keys: list[bytes] = []
            for i in range(max(len(self.token_ids) - 1, 0) // block_size):
                keys.append(hash_block(keys[-1] if keys else None,
                                       self.token_ids[i * block_size:(i + 1) * block_size], self.image_hashes))
            self._hashes[block_size] = keys
        return self._hashes[block_size]


class WorkerIndex:
    """Least recently used first; ``owner``: the ``WorkerState`` object it belongs to."""

    def __init__(self, owner: object):
        self.owner = owner
        self.keys: OrderedDict[bytes, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self.keys)

    def match(self, hashes: list[bytes]) -> int:
        """Leading keys held; a chained key stands for its whole prefix, so the first miss ends it."""
        n = 0
        for key in hashes:
            if key not in self.keys:
                break
            n += 1
        return n

    def insert(self, hashes: list[bytes], capacity: int) -> None:
        """The leading block is touched last: workers free a sequence tail first (vLLM), so a match
        stays a leading run."""
        for key in reversed(hashes):
            self.keys[key] = None
            self.keys.move_to_end(key)
        while len(self.keys) > max(capacity, 0):
            self.keys.popitem(last=False)


class PrefixAware:
    """``cache_threshold``: share of blocks, [0, 1]; ``balance_abs_threshold``: requests, >= 0;
    ``balance_rel_threshold``: ratio, >= 1. Raises ValueError outside these."""

    name = "prefix-aware"

    def __init__(self, cache_threshold: float = CACHE_THRESHOLD, balance_abs_threshold: int = BALANCE_ABS_THRESHOLD,
                 balance_rel_threshold: float = BALANCE_REL_THRESHOLD):
        if not 0.0 <= cache_threshold <= 1.0:
            raise ValueError(f"cache_threshold must be in [0, 1], got {cache_threshold}")
        if balance_abs_threshold < 0:
            raise ValueError(f"balance_abs_threshold must be >= 0, got {balance_abs_threshold}")
        if balance_rel_threshold < 1.0:
            raise ValueError(f"balance_rel_threshold must be >= 1, got {balance_rel_threshold}")
        self.cache_threshold = cache_threshold
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.indexes: dict[str, WorkerIndex] = {}

    def index(self, w: Candidate) -> WorkerIndex:
        """A new, empty one for another registration (replaced, restarted or reset: holds nothing)."""
        idx = self.indexes.get(w.worker_id)
        if idx is None or idx.owner is not w:
            idx = self.indexes[w.worker_id] = WorkerIndex(w)
        return idx

    def imbalanced(self, candidates: list[Candidate]) -> bool:
        loads = [len(w.outstanding) for w in candidates]
        lo, hi = min(loads), max(loads)
        return hi - lo > self.balance_abs_threshold and hi > self.balance_rel_threshold * lo

    def choose(self, candidates: list[Candidate], prompt: PromptBlocks) -> Candidate:
        """Records the keys in its index and the :class:`Decision` in ``prompt.decision``.
        Raises ValueError: no candidates."""
        if not candidates:
            raise ValueError("no candidate workers")
        matched = {}
        for w in candidates:
            hashes = prompt.hashes(_block_size(w))
            matched[w.worker_id] = (self.index(w).match(hashes), len(hashes))
        if self.imbalanced(candidates):
            chosen, reason = min(candidates, key=load), "balance"
        else:
            best = min(candidates, key=lambda w: (-matched[w.worker_id][0], load(w)))
            got, total = matched[best.worker_id]
            if got and got >= self.cache_threshold * total:
                chosen, reason = best, "prefix"
            else:
                chosen, reason = min(candidates, key=lambda w: (load(w), len(self.index(w)))), "spread"
        block_size = _block_size(chosen)
        self.index(chosen).insert(prompt.hashes(block_size), chosen.blocks_total)
        prompt.decision = Decision(chosen.worker_id, matched[chosen.worker_id][0], block_size, reason)
        return chosen


def _block_size(w: Candidate) -> int:
    """Raises ValueError if ``kv_layout`` has none."""
    size = w.kv_layout.get("block_size")
    if not isinstance(size, int) or size < 1:
        raise ValueError(f"worker {w.worker_id} reports no block_size in its kv_layout ({w.kv_layout})")
    return size


def make_policy(name: str) -> PrefixAware | None:
    """None for "least-loaded" (the registry's own order). Raises ValueError: an unknown name."""
    if name not in POLICIES:
        raise ValueError(f"unknown routing policy {name!r} (expected one of {', '.join(POLICIES)})")
    return PrefixAware() if name == "prefix-aware" else None
