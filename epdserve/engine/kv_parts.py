"""A KV cache split by KV head into parts, and the one copy of KV blocks between two such
caches that every hand-off and import makes.

A tensor-parallel worker's ranks each hold a contiguous range of the model's KV heads
(``model/tensor_parallel.shard_ranges``), so its KV cache is one part per rank, part i
``[layers, 2, num_blocks, block_size, heads_i, head_dim]`` holding heads ``[sum(heads_<i),
sum(heads_<=i))``; a single-process engine's cache, or a wire frame's tensor, is one part
of every head. :func:`copy_blocks` copies blocks from one such cache to another whatever
their splits: each destination part takes exactly its heads from the source parts that
hold them, so every byte is read and written once. SmolLM2's 3 KV heads from a prefill
worker of 2 ranks (parts of 2 and 1 heads) into a decode worker of 1 rank (one part of 3)
are two copies per run of blocks; into 3 ranks (parts of 1), three.
"""

from __future__ import annotations

import itertools

import torch

HEADS_AXIS = 4  # the KV-head axis of a part (and of a block tensor)


class KVParts:
    """The parts of one KV cache (or block tensor), in KV-head order; see the module doc.
    The parts may lie on different devices (on CUDA, each rank's on its own GPU).

    Raises (constructor):
        ValueError: no parts, or parts that differ in anything but their KV heads and
            devices (layers, blocks, block size, head size, dtype).
    """

    def __init__(self, parts: list[torch.Tensor]):
        if not parts:
            raise ValueError("a KV cache needs at least one part")
        first = parts[0]
        for p in parts[1:]:
            if (p.shape[:HEADS_AXIS] != first.shape[:HEADS_AXIS] or p.shape[HEADS_AXIS + 1:] != first.shape[HEADS_AXIS + 1:]
                    or p.dtype != first.dtype):
                raise ValueError(f"KV parts {tuple(first.shape)} {first.dtype} and {tuple(p.shape)} {p.dtype} "
                                 "differ in more than their KV heads")
        self.parts = list(parts)
        self.heads = [p.shape[HEADS_AXIS] for p in parts]
        self.starts = list(itertools.accumulate(self.heads, initial=0))[:-1]

    @property
    def num_kv_heads(self) -> int:
        return sum(self.heads)

    def block_shape(self, num_blocks: int) -> tuple[int, ...]:
        """The shape of ``num_blocks`` of these blocks with every KV head: ``[layers, 2,
        num_blocks, block_size, kv_heads, head_dim]``."""
        shape = list(self.parts[0].shape)
        shape[2], shape[HEADS_AXIS] = num_blocks, self.num_kv_heads
        return tuple(shape)

    def layer(self, index: int) -> KVParts:
        """Layer ``index`` alone, as a cache of one layer (views, no copy)."""
        return KVParts([p[index:index + 1] for p in self.parts])


def copy_blocks(src: KVParts, src_ids: list[int], dst: KVParts, dst_ids: list[int]) -> None:
    """Copy block ``src_ids[j]`` of ``src`` into block ``dst_ids[j]`` of ``dst`` for every j
    (converting the dtype; any devices), each destination part's heads from the source
    parts holding them: one strided copy per overlapping pair of parts and stretch of ids
    consecutive on both sides.

    Raises:
        ValueError: the caches hold different KV heads or layers, or the id lists differ
            in length.
    """
    if src.num_kv_heads != dst.num_kv_heads or src.parts[0].shape[:2] != dst.parts[0].shape[:2]:
        raise ValueError(f"cannot copy KV blocks of {src.block_shape(0)} into {dst.block_shape(0)}")
    if len(src_ids) != len(dst_ids):
        raise ValueError(f"{len(src_ids)} source blocks for {len(dst_ids)} destination blocks")
    runs = paired_runs(src_ids, dst_ids)
    for s_part, s_start, d_part, d_start, n in head_overlaps(src, dst):
        s_heads = slice(s_start, s_start + n)
        d_heads = slice(d_start, d_start + n)
        for s, d, length in runs:
            d_part[:, :, d:d + length, :, d_heads].copy_(s_part[:, :, s:s + length, :, s_heads])


def head_overlaps(src: KVParts, dst: KVParts) -> list[tuple[torch.Tensor, int, torch.Tensor, int, int]]:
    """``(source part, first head in it, destination part, first head in it, heads)`` for
    each pair of parts holding common KV heads: parts of 2+1 heads into one of 3 are
    ``(p0, 0, d, 0, 2)`` and ``(p1, 0, d, 2, 1)``."""
    out = []
    for s_part, s_first, s_n in zip(src.parts, src.starts, src.heads):
        for d_part, d_first, d_n in zip(dst.parts, dst.starts, dst.heads):
            lo, hi = max(s_first, d_first), min(s_first + s_n, d_first + d_n)
            if lo < hi:
                out.append((s_part, lo - s_first, d_part, lo - d_first, hi - lo))
    return out


def paired_runs(src: list[int], dst: list[int]) -> list[tuple[int, int, int]]:
    """``(src start, dst start, length)`` of each stretch where both id lists count up by one:
    [4, 5, 6, 9], [0, 1, 7, 8] → [(4, 0, 2), (6, 7, 1), (9, 8, 1)]."""
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(src, dst):
        if runs and s == runs[-1][0] + runs[-1][2] and d == runs[-1][1] + runs[-1][2]:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((s, d, 1))
    return runs
