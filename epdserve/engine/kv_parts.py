"""A KV cache split by KV head into parts (per tensor-parallel rank, part i ``[layers, 2, num_blocks,
block_size, heads_i, head_dim]``), and :func:`copy_blocks` between any two splits, every byte moved once."""

from __future__ import annotations

import itertools

import torch

HEADS_AXIS = 4  # the KV-head axis of a part (and of a block tensor)


class KVParts:
    """Parts in KV-head order, possibly on different devices. Raises ValueError: no parts, or parts that
    differ in more than KV heads and device."""

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
        """``[layers, 2, num_blocks, block_size, kv_heads, head_dim]``, every KV head."""
        shape = list(self.parts[0].shape)
        shape[2], shape[HEADS_AXIS] = num_blocks, self.num_kv_heads
        return tuple(shape)

    def layer(self, index: int) -> KVParts:
        """Views, no copy."""
        return KVParts([p[index:index + 1] for p in self.parts])


def copy_blocks(src: KVParts, src_ids: list[int], dst: KVParts, dst_ids: list[int]) -> None:
    """Block ``src_ids[j]`` into ``dst_ids[j]`` for every j (dtype converted, any devices), one strided copy per
    overlapping pair of parts and run of ids. Raises ValueError: other heads or layers, or unequal id lists."""
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
    """``(src part, first head in it, dst part, first head in it, heads)`` per overlapping pair: parts of
    2+1 heads into one of 3 → ``(p0, 0, d, 0, 2)``, ``(p1, 0, d, 2, 1)``."""
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
