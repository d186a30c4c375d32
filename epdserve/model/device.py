"""The device of a worker's model, KV cache and sampler: ``cpu`` or ``cuda[:N]`` (``docs/gpu.md``); step
metadata crosses once (:func:`to_device`) and only token ids (and logprobs) come back."""

from __future__ import annotations

import re

import torch

DEVICE_SYNTAX = "cpu, cuda or cuda:N"
_DEVICE = re.compile(r"(cpu|cuda)(?::(\d+))?")


def parse_device(text: str) -> str:
    """Canonical ``cpu``, ``cuda`` or ``cuda:N``, checked to exist here. Raises ValueError naming ``text``: bad
    syntax, a CPU build of torch, no visible GPU, or N past the device count."""
    match = _DEVICE.fullmatch(text.strip().lower())
    if match is None or (match[1] == "cpu" and match[2] is not None):
        raise ValueError(f"{text!r}: not a device (expected {DEVICE_SYNTAX})")
    if match[1] == "cpu":
        return "cpu"
    if torch.version.cuda is None:
        raise ValueError(f"{text!r}: no CUDA device: this torch ({torch.__version__}) is a CPU build")
    if not torch.cuda.is_available():
        raise ValueError(f"{text!r}: no CUDA device: torch.cuda.is_available() is False "
                         f"(no GPU visible: check the driver and CUDA_VISIBLE_DEVICES)")
    if match[2] is None:
        return "cuda"
    count = torch.cuda.device_count()
    if int(match[2]) >= count:
        names = "cuda:0" if count == 1 else f"cuda:0 .. cuda:{count - 1}"
        raise ValueError(f"{text!r}: this host has {count} CUDA device{'s' if count != 1 else ''} ({names})")
    return f"cuda:{int(match[2])}"


def synchronize(*devices: torch.device) -> None:
    """CUDA only (CPU operators finish before returning), so that a timed stage includes queued work."""
    for device in devices:
        if device.type == "cuda":
            torch.cuda.synchronize(device)


def to_device(tensors: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """int64 host tensors in one pinned, non-blocking copy (the caching host allocator keeps the buffer until
    done); unchanged on their own device. Raises ValueError for a tensor that is not int64."""
    if all(t.device == device for t in tensors):
        return list(tensors)
    bad = next((t.dtype for t in tensors if t.dtype != torch.long), None)
    if bad is not None:
        raise ValueError(f"to_device moves int64 tensors, not {bad}")
    flat = torch.cat([t.reshape(-1) for t in tensors])
    if device.type == "cuda":
        flat = flat.pin_memory()
    flat = flat.to(device, non_blocking=True)
    return [part.view(t.shape) for part, t in zip(flat.split([t.numel() for t in tensors]), tensors)]
