"""Turn a scheduled batch into the model's input tensors and run it.

The step's metadata is built on the host (Python lists of the scheduler's state), then
moved to the model's device in one copy (:func:`on_device`; nothing moves on the CPU).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch

from epdserve.engine.scheduler import ScheduledBatch
from epdserve.model.cuda_graphs import DecodeGraphs
from epdserve.model.device import to_device
from epdserve.model.llama import AttentionMetadata, LlamaModel, PrefillSeq


def prepare(batch: ScheduledBatch, block_size: int
            ) -> tuple[torch.Tensor, AttentionMetadata, list[int], tuple[torch.Tensor, torch.Tensor] | None]:
    """Flatten ``batch`` into ``input_ids [T]`` and its :class:`AttentionMetadata`.

    Returns also the indices (into ``batch.seqs``) of the sequences that get a new token
    this step: those whose every known token has K/V after the step (a prefill chunk
    that is not the last one samples nothing), and the image embeddings of the prompt
    positions in this step, ``(batch rows [R], embeddings [R, hidden])``, or None.
    """
    input_ids, positions, slots, prefills, embed_rows, embed_values = [], [], [], [], [], []
    decode_rows, decode_tables, decode_lens, logits_rows, sampled = [], [], [], [], []
    row = 0
    for index, (seq, n) in enumerate(zip(batch.seqs, batch.num_tokens)):
        start = seq.num_computed_tokens
        pos = torch.arange(start, start + n)
        table = torch.tensor(seq.block_table, dtype=torch.long)
        input_ids.extend(seq.token_ids[start:start + n])
        if seq.images is not None and start < seq.num_prompt_tokens:
            offsets, values = seq.images.rows(start, n)
            embed_rows.append(offsets + row)
            embed_values.append(values)
        positions.append(pos)
        slots.append(table[pos // block_size] * block_size + pos % block_size)
        if n == 1:
            decode_rows.append(row)
            decode_tables.append(seq.block_table)
            decode_lens.append(start + 1)
        else:
            prefills.append(PrefillSeq(start=row, q_len=n, ctx_len=start + n,
                                       block_table=table[: -(-(start + n) // block_size)]))
        row += n
        if start + n == len(seq):
            logits_rows.append(row - 1)
            sampled.append(index)
    width = max((len(t) for t in decode_tables), default=0)
    meta = AttentionMetadata(
        positions=torch.cat(positions),
        slot_mapping=torch.cat(slots),
        prefills=prefills,
        decode_rows=torch.tensor(decode_rows, dtype=torch.long),
        decode_block_tables=torch.tensor([t + [0] * (width - len(t)) for t in decode_tables],
                                         dtype=torch.long).view(len(decode_tables), width),
        decode_ctx_lens=torch.tensor(decode_lens, dtype=torch.long),
        logits_rows=torch.tensor(logits_rows, dtype=torch.long),
    )
    embeds = (torch.cat(embed_rows), torch.cat(embed_values)) if embed_rows else None
    return torch.tensor(input_ids, dtype=torch.long), meta, sampled, embeds


def on_device(input_ids: torch.Tensor, meta: AttentionMetadata, embeds: tuple[torch.Tensor, torch.Tensor] | None,
              device: torch.device
              ) -> tuple[torch.Tensor, AttentionMetadata, tuple[torch.Tensor, torch.Tensor] | None]:
    """:func:`prepare`'s tensors on ``device``: every index tensor (ids, positions, slots,
    rows, block tables, context lengths) in one host-to-device copy, the image embeddings
    (rare) in a second. On the CPU they come back as they are."""
    longs = [input_ids, meta.positions, meta.slot_mapping, meta.decode_rows, meta.decode_block_tables,
             meta.decode_ctx_lens, meta.logits_rows, *(p.block_table for p in meta.prefills),
             *(embeds[:1] if embeds is not None else ())]
    moved = to_device(longs, device)
    if moved[0] is input_ids:  # already there (the CPU)
        return input_ids, meta, embeds
    ids, positions, slots, rows, tables, lens, logits_rows, *rest = moved
    prefills = [dataclasses.replace(p, block_table=t) for p, t in zip(meta.prefills, rest)]
    meta = AttentionMetadata(positions=positions, slot_mapping=slots, prefills=prefills, decode_rows=rows,
                             decode_block_tables=tables, decode_ctx_lens=lens, logits_rows=logits_rows)
    if embeds is not None:
        embeds = (rest[-1], embeds[1].to(device))
    return ids, meta, embeds


def run(model: LlamaModel, batch: ScheduledBatch, kv_cache: torch.Tensor,
        kv_written: Callable[[int], None] | None = None,
        hidden_sink: Callable[[torch.Tensor], None] | None = None,
        graphs: DecodeGraphs | None = None) -> tuple[torch.Tensor, list[int]]:
    """One forward pass: returns ``(logits [S, vocab], indices of sampled sequences)``.
    ``kv_written``: see :meth:`LlamaModel.forward`. ``hidden_sink``, if given, gets the
    final hidden states of every row of the batch ``[T, hidden]`` (batch order, each
    sequence's new tokens in order) before the sampled rows' logits are taken from them
    (prompt logprobs, ``engine/prompt_logprobs.py``). ``graphs``: a decode-only step
    without either replays its batch-size bucket's CUDA graph when there is one
    (``model/cuda_graphs.py``; its logits are valid until the next step)."""
    input_ids, meta, sampled, embeds = prepare(batch, kv_cache.shape[3])
    if graphs is not None and kv_written is None and hidden_sink is None and embeds is None:
        logits = graphs.replay(input_ids, meta)
        if logits is not None:
            return logits, sampled
    input_ids, meta, embeds = on_device(input_ids, meta, embeds, kv_cache.device)
    if hidden_sink is None:
        return model.forward(input_ids, meta, kv_cache, embeds, kv_written), sampled
    hidden = model.hidden_states(input_ids, meta, kv_cache, embeds, kv_written)
    hidden_sink(hidden)
    return model.logits(hidden[meta.logits_rows]), sampled
