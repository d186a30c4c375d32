"""Which device a worker's model, KV cache and sampler run on: ``cpu`` (the default) or a
CUDA GPU (``cuda``, ``cuda:N``), checked once where the option is read, and what the rest
of the engine needs of it.

What lives where (see ``docs/gpu.md``): on CUDA the weights (dense, in the engine's dtype:
the GGUF block matmuls and C++ kernels are CPU-only), the RoPE tables, the KV block pool,
the activations and the sampler's logits are on the device; each step's metadata is built
on the host and crosses once (:func:`to_device`), and only token ids (and logprobs when
asked) come back.
"""

from __future__ import annotations

import re

import torch

DEVICE_SYNTAX = "cpu, cuda or cuda:N"
_DEVICE = re.compile(r"(cpu|cuda)(?::(\d+))?")


def parse_device(text: str) -> str:
    """``text`` as a canonical device name (``"cpu"``, ``"cuda"`` or ``"cuda:N"``), once it
    is known to exist on this host (the CUDA checks run only for a CUDA name).

    Raises:
        ValueError: the message names ``text``: not of the form ``cpu|cuda|cuda:N`` (e.g.
            ``gpu``, ``cuda:x``, ``cpu:0``), CUDA asked of a CPU build of torch or of a host
            where ``torch.cuda.is_available()`` is False, or ``cuda:N`` with N at least the
            number of devices.
    """
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
    """Wait for the work this process queued on each of ``devices`` (CUDA only; nothing on
    the CPU, where every operator has finished when it returns), so that a timed stage
    includes it."""
    for device in devices:
        if device.type == "cuda":
            torch.cuda.synchronize(device)


def to_device(tensors: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """``tensors`` (int64, on the host, any shapes) on ``device`` in one copy: flattened into
    one buffer, pinned and sent without blocking on CUDA (the host's next step is prepared
    while it flies; the caching host allocator keeps the pinned buffer until the copy is
    done), then viewed back into their shapes. On the host's own device they come back as
    they are (no copy).

    Raises:
        ValueError: a tensor that is not int64.
    """
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
