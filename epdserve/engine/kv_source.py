"""What the engine needs of KV from elsewhere, and of a reader of its own KV as a prefill
step writes it.

* :class:`KVSource`: a prompt's KV blocks that arrive with a request (decode side),
  whatever carried them: an in-memory tensor (:class:`TensorKV`: a frame mapped from
  /dev/shm or fetched over TCP, converted), or blocks copied straight out of a peer's
  shared pool (:class:`epdserve.transfer.handoff.PooledKV`). The engine checks it once at
  :meth:`~epdserve.engine.engine.LLMEngine.add_request` (``validate``) and copies it into
  its cache when the request is first scheduled (``copy_into``).
* :class:`LayerSink`: a reader that copies each layer's K/V of the prompts a prefill step
  completes out of the cache as soon as the forward pass has written that layer
  (a layer-pipelined export, e.g. :class:`epdserve.transfer.pipeline.LayerPipeline`).
"""

from __future__ import annotations

from typing import Protocol

import torch

from epdserve.engine.kv_parts import KVParts, copy_blocks


class KVSource(Protocol):
    """A prompt's KV blocks ``[layers, 2, n_blocks, block_size, kv_heads, head_dim]``."""

    def validate(self, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        """Raises ``ValueError`` unless these are KV blocks of ``shape`` and ``dtype`` (the
        prompt's blocks of the receiving cache)."""

    def copy_into(self, kv_cache: KVParts, block_table: list[int], first_block: int) -> None:
        """Copy the blocks into ``kv_cache`` (every KV head, in however many parts the
        receiving ranks hold them) at ``block_table`` (its leading entries), all but the
        first ``first_block`` (the receiver's prefix cache holds them already). Raises
        (e.g. ``WireError``) when the KV turns out void (its sender released it)."""


class LayerSink(Protocol):
    """Reads the KV of prompts a prefill step completes, layer by layer."""

    def write_layer(self, layer: int, prompts: list[tuple[str, list[int]]]) -> None:
        """Layer ``layer`` of each ``(request id, prompt block ids)`` is now in the cache
        (called for every layer, in order, during the step's forward pass)."""


class TensorKV:
    """KV blocks held in a tensor ``kv`` (any float dtype is copied as the cache's)."""

    def __init__(self, kv: torch.Tensor):
        self.kv = kv

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.kv.shape)

    @property
    def dtype(self) -> torch.dtype:
        return self.kv.dtype

    def validate(self, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        check_kv(self.shape, self.dtype, shape, dtype)

    def copy_into(self, kv_cache: KVParts, block_table: list[int], first_block: int) -> None:
        n = self.kv.shape[2]
        copy_blocks(KVParts([self.kv]), list(range(first_block, n)), kv_cache, block_table[first_block:n])


def check_kv(shape: tuple[int, ...], dtype: torch.dtype,
             expected: tuple[int, ...], expected_dtype: torch.dtype) -> None:
    """Raises ``ValueError`` unless ``shape`` and ``dtype`` are the expected ones."""
    if tuple(shape) != tuple(expected) or dtype != expected_dtype:
        raise ValueError(f"KV of shape {tuple(shape)} {dtype}, expected {tuple(expected)} {expected_dtype}")


def block_runs(block_ids: list[int]) -> list[tuple[int, int, int]]:
    """``(position in block_ids, first block id, length)`` of each run of consecutive ids:
    [7, 8, 9, 3, 4] → [(0, 7, 3), (3, 3, 2)]."""
    runs: list[tuple[int, int, int]] = []
    for pos, block in enumerate(block_ids):
        if runs and block == runs[-1][1] + runs[-1][2]:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((pos, block, 1))
    return runs
