"""Tensor parallelism of the Llama-family decoder: how its weights split over ``size``
ranks, and the collectives between the ranks (Megatron-LM's scheme: Shoeybi et al., 2019).

Each rank holds a contiguous share of

* the KV heads, with the query heads that read them (whole grouped-query groups: a rank
  attends with its own KV cache only). The shares are as even as possible and may differ by
  one KV head: SmolLM2-135M's 3 KV heads (9 query heads) split over 2 ranks as 2 + 1 (query
  heads 6 + 3), since refusing an uneven split would rule out TP=2 on the default model;
* the MLP's intermediate columns, and the vocabulary (rows of the embedding and LM head),
  as even as possible.

Column-parallel (Q, K, V, gate, up): a rank computes the output features of its share from
the full hidden states. Row-parallel (O, down): a rank multiplies its share of the input
features, and the partial sums are added over the ranks (:meth:`TPRank.all_reduce`) before
the residual add. The embedding is vocabulary-parallel (a token outside a rank's rows
contributes zeros, then an all-reduce), and the LM head computes the rank's vocabulary
slice of the logits, which every rank then gathers (:meth:`TPRank.gather_last_dim`). So one
decoder layer costs two all-reduces of ``[T, hidden]``, and a step one more for the
embedding and one gather of ``[S, vocab]`` logits. Norms, RoPE and the residual stream are
replicated: every rank holds the full hidden states.
"""

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
    """This process's place in a tensor-parallel group: ``rank`` of ``size``, and the
    ``torch.distributed`` process group of the ranks (None: the default group, which
    ``init_process_group`` must have set up; gloo on the CPU, NCCL on CUDA).

    Raises (constructor): ``ValueError`` for a rank outside ``[0, size)``.
    """

    rank: int
    size: int
    group: dist.ProcessGroup | None = None

    def __post_init__(self):
        if not 0 <= self.rank < self.size:
            raise ValueError(f"tensor parallel rank {self.rank} is outside [0, {self.size})")

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place (every rank gets the sum); returns ``x``."""
        dist.all_reduce(x, op=dist.ReduceOp.SUM, group=self.group)
        return x

    def gather_last_dim(self, x: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        """The full tensor ``[..., sum(sizes)]`` on every rank from each rank's slice ``x
        [..., sizes[rank]]`` along the last dim, in rank order. Uneven slices are padded
        to the largest for the gather (``all_gather`` takes equal shapes).

        Raises:
            ValueError: ``sizes`` does not have one entry per rank, or ``x`` is not this
                rank's size.
        """
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
    """How rank 0 of a tensor-parallel worker runs the other ranks, as the engine of rank 0
    sees them (``serving/worker/ranks.py`` implements it: the ranks are processes).
    ``rank`` is rank 0's :class:`TPRank` (its shard is loaded with it). :meth:`drive` gives
    every rank its KV cache of ``num_blocks`` blocks of ``block_size`` tokens in ``kv_dtype`` (the same
    block count on every rank: a block id is the same slot everywhere) and returns the
    model rank 0's engine then calls instead of ``model`` (each forward-pass call,
    ``hidden_states``, ``forward``, ``logits``, is first sent to every other rank with its
    inputs, then run here, since the collectives inside need every rank) and the ranks'
    caches ``[layers, 2, num_blocks, block_size, heads of the rank, head_dim]`` that this
    process can address, in rank order: rank 0's first, all of them where a KV hand-off
    must read or write every head (``model.kv_head_split`` gives each rank's heads)."""

    rank: TPRank

    def drive(self, model: "LlamaModel", num_blocks: int, block_size: int,
              kv_dtype: torch.dtype) -> tuple["LlamaModel", list[torch.Tensor]]: ...


class VisionDriver(Protocol):
    """How rank 0 of a tensor-parallel encode worker runs the other ranks' vision shards
    (``serving/worker/ranks.py`` implements it). ``rank`` is rank 0's :class:`TPRank`;
    :meth:`drive_vision` returns the encoder rank 0's engine then calls instead of
    ``vision``: each ``encode`` is first sent to every other rank with its pixel values."""

    rank: TPRank

    def drive_vision(self, vision: "VisionEncoder") -> "VisionEncoder": ...


@dataclass(frozen=True)
class Shard:
    """What one rank holds, as index ranges of the full model: ``kv_heads``, ``q_heads``
    (the query heads of its KV heads), ``intermediate`` (MLP columns) and ``vocab`` (rows of
    the embedding and the LM head)."""

    kv_heads: range
    q_heads: range
    intermediate: range
    vocab: range


def even_range(n: int, size: int, rank: int) -> range:
    """Rank ``rank``'s contiguous share of ``n`` items split over ``size`` ranks as evenly
    as possible: the first ``n % size`` ranks get one more (10 over 3: 4, 3, 3)."""
    base, extra = divmod(n, size)
    start = rank * base + min(rank, extra)
    return range(start, start + base + (rank < extra))


def shard_ranges(config: ModelConfig, rank: int, size: int) -> Shard:
    """Rank ``rank``'s :class:`Shard` of ``config``'s model split over ``size`` ranks
    (see the module doc). SmolLM2-135M (9 query heads, 3 KV heads) at ``size`` 2: rank 0
    KV heads ``[0, 2)``, query heads ``[0, 6)``; rank 1 KV heads ``[2, 3)``, query heads
    ``[6, 9)``.

    Raises:
        ValueError: ``size`` below 1 or above the model's KV heads (each rank needs one),
            or ``rank`` outside ``[0, size)``.
    """
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
    """Raises ValueError for a weight format with GGUF blocks: TP runs on a dense copy
    (the blocks are not split, and the fused decode-layer kernel cannot all-reduce)."""
    if fmt.blocks:
        raise ValueError(f"weight format {fmt.name}: tensor parallelism needs a dense format (f32 or bf16), "
                         "not GGUF blocks")


def take(t: torch.Tensor, r: range, per: int = 1, dim: int = 0) -> torch.Tensor:
    """A contiguous copy of items ``r`` (``per`` rows or columns each) of ``t`` along ``dim``."""
    return t.narrow(dim, r.start * per, len(r) * per).clone(memory_format=torch.contiguous_format)


def shard_weights(config: ModelConfig, weights: dict[str, torch.Tensor], rank: int, size: int
                  ) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Rank ``rank``'s model of ``size``: its config and its weights (Hugging Face names).

    The config has the rank's ``num_attention_heads``, ``num_key_value_heads`` and
    ``intermediate_size``; ``head_dim`` and ``vocab_size`` stay the model's (every rank's
    logits are full). The weights: the rows of its heads of ``q_proj`` / ``k_proj`` /
    ``v_proj`` (and their qwen2 biases), the columns of its query heads of ``o_proj``, the
    rows of its intermediate range of ``gate_proj`` / ``up_proj`` and those columns of
    ``down_proj``, the rows of its vocabulary of ``embed_tokens`` and ``lm_head`` (with tied
    embeddings the LM head is the embedding's shard); every other tensor (the norms) whole.
    Each is a contiguous copy, so the full tensors can be freed.

    Raises:
        ValueError: as :func:`shard_ranges`.
    """
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
