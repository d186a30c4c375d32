"""The tokens an engine step computes (``max_num_batched_tokens``) when the operator sets
none: what this machine prefills in :data:`STEP_TARGET_S`, measured once per machine,
model, weight format and dtypes (``tuning.py``: kept, measured again when disturbed).

A step's outputs all come at its end. With a budget of 2,048 tokens (vLLM's on the CPU),
sixteen 286-token prompts arriving together fill a float32 step seven at a time on 2 cores:
the first seven wait ~2 s for the whole step and every running decode waits as long between
two tokens. A step of what the machine prefills in half a second frees the first prompts
sooner, keeps the running decodes' gaps under half the default longest-gap SLO (1 s), and
starts their decodes earlier, so later steps batch more of them. On a 2-core Xeon with AMX
(float32, ``benchmarks/speed.py --concurrency 16 32``) 512 tokens a step gave a C=16 mean
TTFT of 1,988 ms against 3,431 at 2,048, 162 against 144 output tok/s, and at C=32 181
against 140 tok/s with an ITL p99 of 582 against 2,337 ms. What it costs a lone long prompt
there (in-process, one 1,500-token prefill): 1,680 ms in 512-token steps on 2 threads against
1,597 in one 2,048-token step (+5 %; 256-token steps +21 %), and nothing on 1 thread (256:
3,223 against 3,283 ms).
"""

from __future__ import annotations

import math

import torch

from epdserve.model import tuning
from epdserve.model.llama import AttentionMetadata, LlamaModel, PrefillSeq

STEP_TARGET_S = 0.5  # half the default longest-ITL-gap SLO (bench/metrics.py)
LIMITS = (256, 2048)  # the smallest and largest budget chosen (the largest: vLLM's CPU default)
PROBE_TOKENS = 256  # the prompt timed


def from_rate(tokens_per_s: float) -> int:
    """The budget for a prefill speed (prompt tokens per second): the tokens of
    :data:`STEP_TARGET_S`, to the nearest power of two (a coarse grid, so that run-to-run
    noise seldom moves the choice), within :data:`LIMITS`."""
    tokens = 2 ** round(math.log2(max(tokens_per_s * STEP_TARGET_S, 1.0)))
    return min(max(tokens, LIMITS[0]), LIMITS[1])


def valid(value: object) -> bool:
    """Whether ``value`` is a budget :func:`from_rate` gives."""
    return isinstance(value, int) and LIMITS[0] <= value <= LIMITS[1] and value & (value - 1) == 0


def _probe(model: LlamaModel, kv_dtype: torch.dtype, block_size: int = 16):
    """A forward pass of one :data:`PROBE_TOKENS`-token prompt into a KV cache of its own."""
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
    """This machine's budget for ``model`` (on the CPU, one process; its ``tuned`` choices
    made) with a KV cache of ``kv_dtype``: :func:`from_rate` of the prefill speed of a
    :data:`PROBE_TOKENS`-token prompt, through ``tuning.choose`` (``force``: measured again)."""
    c = model.config
    key = [c.hidden_size, c.intermediate_size, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads,
           c.vocab_size, repr(model.weight_format), str(model.dtype), str(kv_dtype),
           sorted((name, t.value) for name, t in model.tuned.items())]
    run = _probe(model, kv_dtype)
    return tuning.choose("max_num_batched_tokens", key, lambda: tuning.time_rounds({"prefill": run}),
                         lambda seconds: from_rate(PROBE_TOKENS / seconds["prefill"]), valid, force)
