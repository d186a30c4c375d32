"""The engine's interfaces to KV from elsewhere (:class:`KVSource`, decode side) and to a reader of
its KV as a prefill step writes it (:class:`LayerSink`, a layer-pipelined export)."""

from __future__ import annotations

from typing import Protocol

import torch

from epdserve.engine.kv_parts import KVParts, copy_blocks


class KVSource(Protocol):
    """A prompt's KV blocks ``[layers, 2, n_blocks, block_size, kv_heads, head_dim]``."""

    def validate(self, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        """Raises ValueError unless blocks of ``shape`` and ``dtype``."""

    def copy_into(self, kv_cache: KVParts, block_table: list[int], first_block: int) -> None:
        """Into ``block_table`` past its ``first_block`` prefix-cached entries. Raises (e.g. WireError) if released."""


class LayerSink(Protocol):
    """Reads the KV of prompts a prefill step completes, layer by layer."""

    def write_layer(self, layer: int, prompts: list[tuple[str, list[int]]]) -> None:
        """Layer ``layer`` of each ``(request id, prompt block ids)`` is written; called per layer, in order."""


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
