"""Tensor parallelism of the Llama-family decoder (Megatron-LM: Shoeybi et al., 2019): each rank holds an
even, contiguous share of the KV heads with their query heads (may differ by one: 3 KV heads over 2 ranks
are 2 + 1), MLP columns and vocabulary; two all-reduces of ``[T, hidden]`` a layer."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch
import torch.distributed as dist
import torch.nn.functional as F

from epdserve.model import linear
from epdserve.model.config import ModelConfig

if TYPE_CHECKING:  # (llama and vision import this module)
    from epdserve.model.llama import LlamaModel
    from epdserve.model.vision import VisionEncoder


@dataclass(frozen=True)
class TPRank:
    """``group`` None: the default group (gloo on the CPU, NCCL on CUDA). Raises ValueError for a bad rank."""

    rank: int
    size: int
    group: dist.ProcessGroup | None = None

    def __post_init__(self):
        if not 0 <= self.rank < self.size:
            raise ValueError(f"tensor parallel rank {self.rank} is outside [0, {self.size})")

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """In place, every rank gets the sum; returns ``x``."""
        dist.all_reduce(x, op=dist.ReduceOp.SUM, group=self.group)
        return x

    def gather_last_dim(self, x: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        """``[..., sum(sizes)]`` on every rank from each rank's slice. Raises ValueError for sizes that do not fit."""
        if len(sizes) != self.size or x.shape[-1] != sizes[self.rank]:
            raise ValueError(f"rank {self.rank} of {self.size}: a slice of {x.shape[-1]} for sizes {sizes}")
        if x.numel() == 0:  # (no rows: the same on every rank, so none of them gathers)
            return x.new_zeros(*x.shape[:-1], sum(sizes))
        width = max(sizes)
        part = F.pad(x, (0, width - x.shape[-1])) if x.shape[-1] < width else x.contiguous()
        parts = [torch.empty_like(part) for _ in range(self.size)]
        dist.all_gather(parts, part, group=self.group)
        return torch.cat([p[..., :n] for p, n in zip(parts, sizes)], dim=-1)


class RankDriver(Protocol):
    """How rank 0's engine runs the other ranks (``serving/worker/ranks.py``): :meth:`drive` gives every rank
    ``num_blocks`` KV blocks (a block id is the same slot everywhere) and returns the model to call instead and
    the addressable caches ``[layers, 2, num_blocks, block_size, rank's heads, head_dim]``, rank 0's first."""

    rank: TPRank

    def drive(self, model: "LlamaModel", num_blocks: int, block_size: int,
              kv_dtype: torch.dtype) -> tuple["LlamaModel", list[torch.Tensor]]: ...


class VisionDriver(Protocol):
    """How rank 0 of an encode worker runs the other ranks' vision shards; each ``encode`` goes to all."""

    rank: TPRank

    def drive_vision(self, vision: "VisionEncoder") -> "VisionEncoder": ...


@dataclass(frozen=True)
class Shard:
    """Index ranges of the full model; ``q_heads``: the query heads of its KV heads."""

    kv_heads: range
    q_heads: range
    intermediate: range
    vocab: range


def even_range(n: int, size: int, rank: int) -> range:
    """The first ``n % size`` ranks get one more (10 over 3: 4, 3, 3)."""
    base, extra = divmod(n, size)
    start = rank * base + min(rank, extra)
    return range(start, start + base + (rank < extra))


def shard_ranges(config: ModelConfig, rank: int, size: int) -> Shard:
    """SmolLM2-135M at ``size`` 2: rank 0 KV heads ``[0, 2)``, query heads ``[0, 6)``; rank 1 ``[2, 3)``,
    ``[6, 9)``. Raises ValueError: ``size`` outside 1..KV heads, or a bad ``rank``."""
    n_kv = config.num_key_value_heads
    if size < 1:
        raise ValueError(f"tensor parallel size {size} is below 1 (the model has {n_kv} KV heads)")
    if size > n_kv:
        raise ValueError(f"tensor parallel size {size} exceeds the model's {n_kv} KV heads: "
                         "each rank needs at least one")
    if not 0 <= rank < size:
        raise ValueError(f"tensor parallel rank {rank} is outside [0, {size})")
    kv = even_range(n_kv, size, rank)
    group = config.num_attention_heads // n_kv
    return Shard(kv_heads=kv, q_heads=range(kv.start * group, kv.stop * group),
                 intermediate=even_range(config.intermediate_size, size, rank),
                 vocab=even_range(config.vocab_size, size, rank))


def check_dense(fmt: linear.WeightFormat) -> None:
    """Raises ValueError for GGUF blocks: they are not split, and the fused kernel cannot all-reduce."""
    if fmt.blocks:
        raise ValueError(f"weight format {fmt.name}: tensor parallelism needs a dense format (f32 or bf16), "
                         "not GGUF blocks")


def take(t: torch.Tensor, r: range, per: int = 1, dim: int = 0) -> torch.Tensor:
    """A contiguous copy of items ``r`` (``per`` rows or columns each) of ``t`` along ``dim``."""
    return t.narrow(dim, r.start * per, len(r) * per).clone(memory_format=torch.contiguous_format)


def shard_weights(config: ModelConfig, weights: dict[str, torch.Tensor], rank: int, size: int
                  ) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """The rank's config (its heads and ``intermediate_size``; ``vocab_size`` whole) and contiguous copies of its
    weight shards (tied LM head: the embedding's). Raises ValueError as :func:`shard_ranges`."""
    s = shard_ranges(config, rank, size)
    d = config.head_dim
    split = {  # name suffix -> (range, rows or columns per item, dim)
        "q_proj.weight": (s.q_heads, d, 0), "q_proj.bias": (s.q_heads, d, 0),
        "k_proj.weight": (s.kv_heads, d, 0), "k_proj.bias": (s.kv_heads, d, 0),
        "v_proj.weight": (s.kv_heads, d, 0), "v_proj.bias": (s.kv_heads, d, 0),
        "o_proj.weight": (s.q_heads, d, 1),
        "gate_proj.weight": (s.intermediate, 1, 0), "up_proj.weight": (s.intermediate, 1, 0),
        "down_proj.weight": (s.intermediate, 1, 1),
        "embed_tokens.weight": (s.vocab, 1, 0), "lm_head.weight": (s.vocab, 1, 0),
    }
    out = {}
    for name, w in weights.items():
        rule = split.get(".".join(name.split(".")[-2:]))
        out[name] = take(w, *rule) if rule else w.clone(memory_format=torch.contiguous_format)
    local = dataclasses.replace(config, num_attention_heads=len(s.q_heads), num_key_value_heads=len(s.kv_heads),
                                intermediate_size=len(s.intermediate))
    return local, out
