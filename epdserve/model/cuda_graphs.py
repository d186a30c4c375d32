"""CUDA graphs of decode-only steps per batch-size bucket (vLLM's ``cudagraph_capture_sizes``); a step pads
to its bucket with copies of its first row (same K/V, same slot). Off by default (``--no-enforce-eager``):
not yet measured faster on a GPU."""

from __future__ import annotations

import torch

from epdserve.model.device import to_device
from epdserve.model.llama import AttentionMetadata, LlamaModel


def capture_sizes(max_batch: int) -> list[int]:
    """vLLM's default buckets: 1, 2, 4, multiples of 8, and ``max_batch`` (20: ``[1, 2, 4, 8, 16, 20]``).
    Raises ValueError below 1."""
    if max_batch < 1:
        raise ValueError(f"max_batch {max_batch} must be at least 1")
    return sorted({s for s in (1, 2, 4, *range(8, max_batch, 8)) if s < max_batch} | {max_batch})


class DecodeGraphs:
    """``max_blocks``: the static block-table width (split-K is chosen for it). Raises ValueError off CUDA or
    for a size outside ``[1, max_batch]``."""

    def __init__(self, model: LlamaModel, kv_cache: torch.Tensor, max_batch: int, max_blocks: int,
                 sizes: list[int] | None = None):
        if kv_cache.device.type != "cuda" or model.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA model and cache, not {model.device} / {kv_cache.device}")
        self.sizes = sorted(set(sizes or capture_sizes(max_batch)))
        if self.sizes[0] < 1 or self.sizes[-1] > max_batch:
            raise ValueError(f"capture sizes {self.sizes} must lie in [1, {max_batch}]")
        self.model, self.kv_cache, self.max_blocks = model, kv_cache, max_blocks
        n, device = self.sizes[-1], kv_cache.device
        self.ids, self.positions, self.slots = (torch.zeros(n, dtype=torch.long, device=device) for _ in range(3))
        self.ctx_lens = torch.ones(n, dtype=torch.long, device=device)
        self.tables = torch.zeros(n, max_blocks, dtype=torch.long, device=device)
        self.rows = torch.arange(n, device=device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    def _meta(self, size: int) -> AttentionMetadata:
        return AttentionMetadata(positions=self.positions[:size], slot_mapping=self.slots[:size], prefills=[],
                                 decode_rows=self.rows[:size], decode_block_tables=self.tables[:size],
                                 decode_ctx_lens=self.ctx_lens[:size], logits_rows=self.rows[:size])

    def capture(self) -> None:
        """Largest first, into one shared pool (as vLLM). Warm-up runs write K/V to slot 0: call before any
        request holds a block."""
        pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.sizes):
            meta = self._meta(size)
            side = torch.cuda.Stream(self.kv_cache.device)
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # warm-up on a side stream, as torch.cuda.graph's docs ask
                self.model.forward(self.ids[:size], meta, self.kv_cache)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                logits = self.model.forward(self.ids[:size], meta, self.kv_cache)
            self.graphs[size] = (graph, logits)

    def replay(self, input_ids: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor | None:
        """Logits ``[B, vocab]`` (float32), a view valid until the next replay, or None when the step must run
        eagerly. ``input_ids``, ``meta``: ``runner.prepare``'s, on the host."""
        batch = len(input_ids)
        if (meta.prefills or not self.graphs or not 0 < batch <= self.sizes[-1]
                or len(meta.decode_rows) != batch or len(meta.logits_rows) != batch
                or meta.decode_block_tables.shape[1] > self.max_blocks):
            return None
        size = next(s for s in self.sizes if s >= batch)
        width = meta.decode_block_tables.shape[1]

        def padded(t: torch.Tensor) -> torch.Tensor:  # rows past the batch repeat its first row
            return torch.cat([t, t[:1].expand(size - batch, *t.shape[1:])])

        host = [padded(t) for t in (input_ids, meta.positions, meta.slot_mapping, meta.decode_ctx_lens,
                                    meta.decode_block_tables)]
        # Only the step's table columns move: later ones are never read.
        for static, value in zip((self.ids, self.positions, self.slots, self.ctx_lens, self.tables[:, :width]),
                                 to_device(host, self.kv_cache.device)):
            static[:size].copy_(value)
        graph, logits = self.graphs[size]
        graph.replay()
        return logits[:batch]
