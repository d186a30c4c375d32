"""The engine's settings: each :class:`EngineConfig` field that is a worker flag carries its help and
argparse type (:func:`epdserve.argtypes.setting`); flags and config derive from the fields."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from epdserve.argtypes import from_check, int_at_least, setting
from epdserve.model.device import parse_device
from epdserve.model.kv_cache_dtype import KV_CACHE_DTYPES
from epdserve.model.linear import WEIGHT_FORMATS

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
DTYPE_CHOICES = ("auto", *DTYPES)
DEVICE_METAVAR = "cpu|cuda|cuda:N"
# The type of every device flag; its error names the value.
device_type = from_check(parse_device)


def default_dtype(device: str) -> str:
    """The dtype without ``--dtype``: bfloat16 on CUDA (as vLLM), float32 on the CPU."""
    return "bfloat16" if device.startswith("cuda") else "float32"


@dataclass(frozen=True)
class EngineConfig:
    """``num_kv_blocks`` overrides ``kv_cache_memory_mb`` (vLLM's ``num_gpu_blocks_override``; no flag).
    ``dtype`` None: :func:`default_dtype`; ``auto`` is resolved by the worker."""

    kv_cache_memory_mb: int = field(default=1024, metadata=setting("KV cache budget per worker (MiB)",
                                                                   type=int_at_least(1)))
    block_size: int = field(default=16, metadata=setting("tokens per KV block", type=int_at_least(1)))
    max_num_seqs: int = field(default=64, metadata=setting("most requests a worker runs at once",
                                                           type=int_at_least(1)))
    max_num_batched_tokens: int | None = field(default=None, metadata=setting(
        "most tokens in one engine step (default with chunked prefill: what this machine prefills in half a "
        "second, a power of two from 256 to 2048, measured once per machine and shown in /health's tuned; "
        "2048, vLLM's, on a GPU or with tensor-parallel ranks; the context window without chunked prefill)",
        type=int_at_least(1)))
    enable_chunked_prefill: bool = field(default=True, metadata=setting(
        "split prompts over steps of --max-num-batched-tokens tokens, batched with the running decodes "
        "(vLLM's default: on); --no-enable-chunked-prefill prefills each prompt in one step"))
    enable_prefix_caching: bool = field(default=True, metadata=setting(
        "reuse the KV blocks of cached prompt prefixes (vLLM's default: on)"))
    device: str = field(default="cpu", metadata=setting(
        "where the weights, KV cache, activations and sampler live: the CPU, or a CUDA GPU (docs/gpu.md)",
        type=device_type, metavar=DEVICE_METAVAR))
    enforce_eager: bool = field(default=True, metadata=setting(
        "CUDA workers: run every step eagerly (vLLM's flag; here on by default until CUDA graphs are measured "
        "faster); --no-enforce-eager replays decode steps as CUDA graphs, one per batch-size bucket "
        "(model/cuda_graphs.py, docs/gpu.md). Ignored on the CPU"))
    dtype: str | None = field(default=None, metadata=setting(
        "weights and KV cache dtype (default: bfloat16 on CUDA, float32 on the CPU); auto: bfloat16 on CUDA; "
        "on the CPU as vLLM's CPU backend, bfloat16 where the CPU computes it natively, else float32, and "
        "float32 for a quantized GGUF (its kernels compute in float32) unless --weight-format bf16",
        choices=DTYPE_CHOICES))
    weight_format: str = field(default="auto", metadata=setting(
        "which copies of the linear weights a worker holds and computes from (model/linear.py): the GGUF's "
        "Q4_1 blocks (fast decode, 0.75 byte a weight), a dense f32 or bf16 copy (fast prefill GEMMs), or "
        "both (q4_1+f32: steps of few rows on the blocks, larger ones on the copy); auto: prefill workers "
        "f32, decode workers q4_1, colocated and elastic q4_1+f32 (a model without GGUF blocks: dense)",
        choices=WEIGHT_FORMATS))
    kv_cache_dtype: str = field(default="auto", metadata=setting(
        "the KV cache's dtype (vLLM's flag): auto, the model's (exact parity); bfloat16, half the KV bytes of "
        "a float32 model (memory, decode reads, hand-offs; its bound on the tokens: docs/serving.md); fp8 is "
        "refused (no scaled fp8 kernels)", choices=KV_CACHE_DTYPES))
    num_kv_blocks: int | None = None
