"""Prefix-aware routing: which worker of a role most likely holds a request's prompt prefix.

The router cannot see the workers' prefix caches; as SGLang's cache-aware router (its
approximate radix tree per worker), llm-d's approximate prefix-cache scorer (an LRU index
of the prefix hashes recently sent to each pod) and Dynamo's KV router in approximation
mode (``--no-kv-events``), it keeps a *belief*: per worker, the block keys of the prompts it
routed there (:class:`WorkerIndex`), bounded by the worker's KV pool (``blocks_total``) with
LRU eviction, and forgotten when the worker is replaced, restarted or reset (it then holds
nothing).

Keys (:class:`PromptBlocks`): the prompt's leading full blocks of ``block_size`` tokens (the
workers' block size, from their Hello's ``kv_layout``), chained as the workers' own
(:func:`~epdserve.engine.prefix_cache.hash_block`, vLLM's scheme), up to the blocks a worker
could reuse (all but the last prompt token: vLLM's rule). A prompt with images mixes every
image's content hash into every block's key: the router does not know where each image's
tokens lie, so two prompts with the same placeholder tokens and other images never match
(the price: a text prefix shared by prompts with different images is not believed cached).

The rule (:meth:`PrefixAware.choose`) is SGLang's cache-aware one:

1. Load = outstanding requests. If the role is imbalanced, ``max - min >
   balance_abs_threshold`` and ``max > balance_rel_threshold * min``, the least loaded
   worker takes the request (reason "balance"): one hot prefix cannot pile every request
   onto one worker.
2. Else the worker believed to hold the most leading blocks takes it, if that is at least
   ``cache_threshold`` of the prompt's blocks (reason "prefix"; ties: least loaded).
3. Else the least loaded worker, ties broken by the smaller index (SGLang: the smallest
   tree, the one with the most room for a new prefix) (reason "spread").

The chosen worker's index then takes the request's keys (it will cache those blocks).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Protocol

from epdserve.engine.prefix_cache import hash_block

POLICIES = ("least-loaded", "prefix-aware")
DEFAULT_POLICY = "least-loaded"
# SGLang's router defaults are 64 and 1.5 (a GPU worker batches hundreds of requests); a CPU
# worker here runs a handful at once, so the absolute gap is scaled down to match.
BALANCE_ABS_THRESHOLD = 4
BALANCE_REL_THRESHOLD = 1.5
CACHE_THRESHOLD = 0.3  # SGLang's (and its model gateway's) --cache-threshold default


class Candidate(Protocol):
    """What the policy reads of a worker (a :class:`~epdserve.serving.router.registry.WorkerState`):
    ``outstanding`` maps request ids to tokens; ``blocks_total``: its KV pool, in blocks;
    ``kv_layout["block_size"]``: tokens per block."""

    worker_id: str
    outstanding: dict[str, int]
    blocks_total: int
    kv_layout: dict


def load(w: Candidate) -> tuple[int, int]:
    """Outstanding requests, then their tokens: the least-loaded order (lowest first)."""
    return len(w.outstanding), sum(w.outstanding.values())


@dataclass
class Decision:
    """How a request was routed: ``worker_id``; ``matched_blocks`` of ``block_size``
    tokens the router believed that worker held; ``reason`` "prefix", "balance" or
    "spread" (see the module docstring)."""

    worker_id: str
    matched_blocks: int
    block_size: int
    reason: str

    @property
    def believed_tokens(self) -> int:
        """Prompt tokens believed cached on the chosen worker."""
        return self.matched_blocks * self.block_size


class PromptBlocks:
    """One request's prompt as the router keys it: ``token_ids`` and the content hashes of
    its images (``image_hashes``, in prompt order, sha256 hex as
    :class:`~epdserve.serving.protocol.ImageRef`'s). :meth:`hashes` keys it for a block size;
    ``decision`` is set by :meth:`PrefixAware.choose` (None until routed by it)."""

    def __init__(self, token_ids: list[int], image_hashes: tuple[str, ...] | list[str] = ()):
        self.token_ids = token_ids
        self.image_hashes = tuple(image_hashes)
        self.decision: Decision | None = None
        self._hashes: dict[int, list[bytes]] = {}

    def hashes(self, block_size: int) -> list[bytes]:
        """The 32-byte keys of the prompt's leading full blocks a worker could reuse:
        ``(len(token_ids) - 1) // block_size`` of them (the last prompt token is always
        computed), each chained on the one before; computed once per block size.

        Raises:
            ValueError: ``block_size`` under 1.
        """
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
    """The block keys believed held by one worker, least recently used first; ``owner`` is
    the registration (the ``WorkerState`` object) it belongs to."""

    def __init__(self, owner: object):
        self.owner = owner
        self.keys: OrderedDict[bytes, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self.keys)

    def match(self, hashes: list[bytes]) -> int:
        """How many of ``hashes`` (a prompt's chained keys) lead the prompt unbroken in the
        index; a chained key stands for its whole prefix, so the first miss ends the match."""
        n = 0
        for key in hashes:
            if key not in self.keys:
                break
            n += 1
        return n

    def insert(self, hashes: list[bytes], capacity: int) -> None:
        """Record ``hashes`` as held, most recently used, keeping at most ``capacity`` keys
        (the worker's ``blocks_total``). The leading block is touched last: as a worker
        frees a sequence's blocks tail first (vLLM), a prefix's later blocks are evicted
        before its first ones, and a match stays a leading run."""
        for key in reversed(hashes):
            self.keys[key] = None
            self.keys.move_to_end(key)
        while len(self.keys) > max(capacity, 0):
            self.keys.popitem(last=False)


class PrefixAware:
    """The prefix-aware policy: a :class:`WorkerIndex` per worker id and SGLang's rule
    (module docstring). ``cache_threshold``: the least matched share of a prompt's blocks
    that wins over load; ``balance_abs_threshold`` (requests) and ``balance_rel_threshold``
    (ratio): past both, routing is least-loaded.

    Raises (constructor):
        ValueError: a threshold out of range (cache share outside [0, 1], a negative gap, a ratio under 1).
    """

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
        """``w``'s index; a new, empty one when ``w`` is another registration than the one
        indexed (the worker was replaced, restarted or reset, and holds nothing)."""
        idx = self.indexes.get(w.worker_id)
        if idx is None or idx.owner is not w:
            idx = self.indexes[w.worker_id] = WorkerIndex(w)
        return idx

    def imbalanced(self, candidates: list[Candidate]) -> bool:
        """SGLang's test: the outstanding-request gap is over both thresholds."""
        loads = [len(w.outstanding) for w in candidates]
        lo, hi = min(loads), max(loads)
        return hi - lo > self.balance_abs_threshold and hi > self.balance_rel_threshold * lo

    def choose(self, candidates: list[Candidate], prompt: PromptBlocks) -> Candidate:
        """The worker among ``candidates`` (live, of one role) for ``prompt``, by the rule of
        the module docstring; records the keys in its index and the :class:`Decision` in
        ``prompt.decision``.

        Raises:
            ValueError: no candidates.
        """
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
    """Tokens per KV block of ``w`` (its Hello's ``kv_layout``). Raises ValueError if absent."""
    size = w.kv_layout.get("block_size")
    if not isinstance(size, int) or size < 1:
        raise ValueError(f"worker {w.worker_id} reports no block_size in its kv_layout ({w.kv_layout})")
    return size


def make_policy(name: str) -> PrefixAware | None:
    """The policy ``--routing NAME`` names: None for "least-loaded" (the registry's own
    order), a :class:`PrefixAware` for "prefix-aware".

    Raises:
        ValueError: another name.
    """
    if name not in POLICIES:
        raise ValueError(f"unknown routing policy {name!r} (expected one of {', '.join(POLICIES)})")
    return PrefixAware() if name == "prefix-aware" else None
