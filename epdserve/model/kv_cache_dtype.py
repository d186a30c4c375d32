"""The KV cache's dtype, ``--kv-cache-dtype`` (vLLM's flag and values where they apply).

``auto`` keeps the model's dtype: exact parity with transformers (float32 on the CPU).
``bfloat16`` halves the KV bytes of a float32 model: half the memory per token, half of
what a decode step reads at large batches, half the hand-off. The new tokens' K/V are
computed in float32 and rounded once, as written; attention reads them back as float32
(``layer_kernels.cpp``). Its effect on the tokens is bounded in docs/serving.md and
tests/test_kv_cache_dtype.py (top-1 agreement and the largest logprob gap over the parity
prompts). A prefill's own tokens attend to each other unrounded; later steps read the
rounded copies (vLLM's order too).

vLLM's ``fp8`` values need per-tensor scales and kernels this engine does not have: they are
refused at start-up with one line, as is a cache dtype other than the model's on CUDA (the
Triton kernels read the cache in the model's dtype).
"""

from __future__ import annotations

import torch

KV_CACHE_DTYPES = ("auto", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2")
_DTYPES = {"bfloat16": torch.bfloat16}


def resolve(name: str, dtype: torch.dtype, device: str | torch.device) -> torch.dtype:
    """The cache dtype ``--kv-cache-dtype name`` gives a model in ``dtype`` on ``device``.

    Raises:
        ValueError: a name not in :data:`KV_CACHE_DTYPES`, an fp8 one, or a dtype other
            than the model's off the CPU; the message names the flag and the value.
    """
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"--kv-cache-dtype {name}: expected one of {', '.join(KV_CACHE_DTYPES)}")
    if name == "auto":
        return dtype
    if name not in _DTYPES:
        raise ValueError(f"--kv-cache-dtype {name}: not supported (fp8 needs per-tensor scales this engine's "
                         "kernels do not have); use auto or bfloat16")
    kv = _DTYPES[name]
    if kv != dtype and torch.device(device).type != "cpu":
        raise ValueError(f"--kv-cache-dtype {name} on {device} needs --dtype {name} (this model runs in "
                         f"{name_of(dtype)}; the Triton kernels read the cache in the model's dtype)")
    return kv


def name_of(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``bfloat16`` (the name a worker's ``kv_layout`` and /health give)."""
    return str(dtype).removeprefix("torch.")
