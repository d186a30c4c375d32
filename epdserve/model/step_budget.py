"""Default ``max_num_batched_tokens``: what this machine prefills in :data:`STEP_TARGET_S` (``tuning.py``). On
2 AMX cores, 512 tokens a step against 2,048: C=16 mean TTFT 1,988 vs 3,431 ms, C=32 ITL p99 582 vs 2,337 ms,
a lone 1,500-token prefill +5 % (``benchmarks/speed.py``)."""

from __future__ import annotations

import math

import torch

from epdserve.model import tuning
from epdserve.model.llama import AttentionMetadata, LlamaModel, PrefillSeq

STEP_TARGET_S = 0.5  # half the default longest-ITL-gap SLO (bench/metrics.py)
LIMITS = (256, 2048)  # the smallest and largest budget chosen (the largest: vLLM's CPU default)
PROBE_TOKENS = 256  # the prompt timed


def from_rate(tokens_per_s: float) -> int:
    """Tokens of :data:`STEP_TARGET_S` to a power of two (noise seldom moves it), within :data:`LIMITS`."""
    tokens = 2 ** round(math.log2(max(tokens_per_s * STEP_TARGET_S, 1.0)))
    return min(max(tokens, LIMITS[0]), LIMITS[1])


def valid(value: object) -> bool:
    return isinstance(value, int) and LIMITS[0] <= value <= LIMITS[1] and value & (value - 1) == 0


def _probe(model: LlamaModel, kv_dtype: torch.dtype, block_size: int = 16):
    n = PROBE_TOKENS
    blocks = -(-n // block_size)
    kv_cache = model.allocate_kv_cache(blocks, block_size, dtype=kv_dtype)
    rows = torch.arange(n, device=model.device)
    empty = torch.zeros(0, dtype=torch.long, device=model.device)
    meta = AttentionMetadata(positions=rows, slot_mapping=rows,
                             prefills=[PrefillSeq(0, n, n, torch.arange(blocks, device=model.device))],
                             decode_rows=empty, decode_block_tables=empty.view(0, 0), decode_ctx_lens=empty,
                             logits_rows=rows[-1:])
    input_ids = (rows * 7919 + 100) % model.config.vocab_size  # any tokens: the time is the same
    return lambda: model.forward(input_ids, meta, kv_cache)


def measured(model: LlamaModel, kv_dtype: torch.dtype, force: bool = False) -> tuning.Tuned:
    """On the CPU, one process, after the model's ``tuned`` choices (``force``: measure again)."""
    c = model.config
    key = [c.hidden_size, c.intermediate_size, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads,
           c.vocab_size, repr(model.weight_format), str(model.dtype), str(kv_dtype),
           sorted((name, t.value) for name, t in model.tuned.items())]
    run = _probe(model, kv_dtype)
    return tuning.choose("max_num_batched_tokens", key, lambda: tuning.time_rounds({"prefill": run}),
                         lambda seconds: from_rate(PROBE_TOKENS / seconds["prefill"]), valid, force)
