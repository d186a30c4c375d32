"""``--kv-cache-dtype`` (vLLM's flag): ``auto`` keeps the model's dtype (exact parity); ``bfloat16`` halves
a float32 model's KV bytes (K/V computed in float32, rounded once as written; its effect on tokens is
bounded in docs/serving.md). fp8 is refused (no scaled kernels), as is a non-model dtype on CUDA."""

from __future__ import annotations

import torch

KV_CACHE_DTYPES = ("auto", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2")
_DTYPES = {"bfloat16": torch.bfloat16}


def resolve(name: str, dtype: torch.dtype, device: str | torch.device) -> torch.dtype:
    """Raises ValueError naming the flag: unknown, fp8, or other than the model's off the CPU."""
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
    """``torch.bfloat16`` → ``bfloat16`` (the name in ``kv_layout`` and /health)."""
    return str(dtype).removeprefix("torch.")
