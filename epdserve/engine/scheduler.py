"""Continuous batching: which sequences run in the next step, and with how many tokens.

Each step first gives every running sequence its next tokens (one for a decode, the next
chunk for a chunked prefill), preempting the newest running sequences by recompute when
blocks run out, then admits waiting sequences while ``max_num_seqs``,
``max_num_batched_tokens`` and free blocks allow (the policy of vLLM's v1 scheduler,
without priorities). A sequence admitted with a prefix-cache hit starts with the hit
blocks in its block table and computes only the rest.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from epdserve.engine.block_pool import BlockPool
from epdserve.engine.prefix_cache import PrefixCache
from epdserve.engine.request import Sequence, Status


@dataclass(frozen=True)
class SchedulerConfig:
    """``max_num_batched_tokens``: tokens per step; with ``enable_chunked_prefill`` (the
    default, as vLLM's) a prompt longer than what a step has left is prefilled over several
    steps, without it whole, so the budget must then be at least the context window. The
    defaults are vLLM's for its OpenAI server on the CPU (2,048 tokens a step, chunked); an
    engine on the CPU sets its own budget (``model/step_budget.py``).
    ``enable_prefix_caching``: reuse cached full blocks (vLLM v1's default, on)."""

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True


@dataclass
class ScheduledBatch:
    """Sequences for one step and how many new tokens of each to compute."""

    seqs: list[Sequence]
    num_tokens: list[int]

    def __len__(self) -> int:
        return len(self.seqs)


class Scheduler:
    """Owns the waiting queue and the running list; allocates blocks from ``pool`` and
    finds cached ones through ``prefix_cache``."""

    def __init__(self, config: SchedulerConfig, pool: BlockPool):
        self.config = config
        self.pool = pool
        self.prefix_cache = PrefixCache(pool, config.enable_prefix_caching)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def remove(self, seq: Sequence) -> None:
        """Drop ``seq`` from the queues and free its blocks (finish or abort)."""
        if seq.status == Status.RUNNING:
            self.running.remove(seq)
        elif seq.status == Status.WAITING:
            self.waiting.remove(seq)
        self.pool.free(seq.block_table)
        seq.block_table = []
        seq.num_cached_blocks = 0
        seq.status = Status.FINISHED

    def schedule(self) -> ScheduledBatch:
        """Pick the next step's work; never raises for lack of blocks."""
        batch = ScheduledBatch([], [])
        budget = self.config.max_num_batched_tokens
        preempted = False
        for seq in list(self.running):
            if seq.status != Status.RUNNING or budget == 0:
                continue
            n = min(seq.num_new_tokens, budget)
            while not self._grow(seq, n):
                victim = self.running[-1]
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            if seq.status == Status.RUNNING:
                batch.seqs.append(seq)
                batch.num_tokens.append(n)
                budget -= n
        while self.waiting and not preempted and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            hits = self.prefix_cache.match(seq)
            # An imported prompt's K/V counts as computed already; a hit saves its copy.
            computed = seq.num_computed_tokens if seq.pending_kv is not None else len(hits) * self.pool.block_size
            n = len(seq) - computed
            if n > budget and not self.config.enable_chunked_prefill:
                break
            n = min(n, budget)
            if not self._admit(seq, hits, computed + n):
                break
            self.prefix_cache.admitted(seq, len(hits))
            seq.num_computed_tokens = computed
            self.waiting.popleft()
            seq.status = Status.RUNNING
            self.running.append(seq)
            batch.seqs.append(seq)
            batch.num_tokens.append(n)
            budget -= n
        return batch

    def _grow(self, seq: Sequence, n: int) -> bool:
        """Give ``seq`` blocks for ``n`` more tokens; False if too few are free."""
        need = self.pool.blocks_for(seq.num_computed_tokens + n) - len(seq.block_table)
        if need > self.pool.num_free:
            return False
        if need > 0:
            seq.block_table.extend(self.pool.allocate(need))
        return True

    def _admit(self, seq: Sequence, hits: list[int], num_tokens: int) -> bool:
        """Give a waiting ``seq`` the cached blocks ``hits`` and new blocks up to
        ``num_tokens`` tokens; False (taking nothing) if too few are free."""
        need = self.pool.blocks_for(num_tokens) - len(hits)
        revived = sum(1 for b in hits if self.pool.ref_counts[b] == 0)  # free now, in use after
        if need + revived > self.pool.num_free:
            return False
        self.pool.touch(hits)
        seq.block_table = hits + self.pool.allocate(need)
        seq.num_cached_blocks = len(hits)
        return True

    def _preempt(self, seq: Sequence) -> None:
        # Recompute policy: drop the KV, keep the tokens; the sequence re-enters prefill
        # with prompt + generated tokens when blocks free up (its full blocks stay in the
        # prefix cache until evicted, so the recompute may find them there).
        self.running.remove(seq)
        self.pool.free(seq.block_table)
        seq.block_table = []
        seq.num_cached_blocks = 0
        seq.num_computed_tokens = 0
        seq.pending_kv = None
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1
