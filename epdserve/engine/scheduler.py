"""Continuous batching as vLLM's v1 scheduler (no priorities): running sequences first, preempting the
newest by recompute when blocks run out, then waiting ones while seats, token budget and blocks allow."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from epdserve.engine.block_pool import BlockPool
from epdserve.engine.prefix_cache import PrefixCache
from epdserve.engine.request import Sequence, Status


@dataclass(frozen=True)
class SchedulerConfig:
    """Defaults: vLLM's OpenAI server on the CPU (2,048 tokens a step, chunked prefill, prefix caching).
    Without chunked prefill the budget must cover the context window."""

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
        if seq.status == Status.RUNNING:
            self.running.remove(seq)
        elif seq.status == Status.WAITING:
            self.waiting.remove(seq)
        self.pool.free(seq.block_table)
        seq.block_table = []
        seq.num_cached_blocks = 0
        seq.status = Status.FINISHED

    def schedule(self) -> ScheduledBatch:
        """Never raises for lack of blocks."""
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
        """False if too few blocks are free."""
        need = self.pool.blocks_for(seq.num_computed_tokens + n) - len(seq.block_table)
        if need > self.pool.num_free:
            return False
        if need > 0:
            seq.block_table.extend(self.pool.allocate(need))
        return True

    def _admit(self, seq: Sequence, hits: list[int], num_tokens: int) -> bool:
        """False (taking nothing) if too few blocks are free."""
        need = self.pool.blocks_for(num_tokens) - len(hits)
        revived = sum(1 for b in hits if self.pool.ref_counts[b] == 0)  # free now, in use after
        if need + revived > self.pool.num_free:
            return False
        self.pool.touch(hits)
        seq.block_table = hits + self.pool.allocate(need)
        seq.num_cached_blocks = len(hits)
        return True

    def _preempt(self, seq: Sequence) -> None:
        # Recompute: drop the KV, keep the tokens; its full blocks stay in the prefix cache until evicted.
        self.running.remove(seq)
        self.pool.free(seq.block_table)
        seq.block_table = []
        seq.num_cached_blocks = 0
        seq.num_computed_tokens = 0
        seq.pending_kv = None
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1
