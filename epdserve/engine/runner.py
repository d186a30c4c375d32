"""A scheduled batch → the model's input tensors, built on the host, moved to the device in one copy."""

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
    """Returns ``input_ids [T]``, the metadata, the indices of the sequences sampled this step (not a
    non-final prefill chunk) and the step's image embeddings ``(rows [R], [R, hidden])`` or None."""
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
    """Index tensors in one host-to-device copy, image embeddings in a second; unchanged on the CPU."""
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
    """``(logits [S, vocab], indices of sampled sequences)``; ``hidden_sink`` gets the final hidden states
    ``[T, hidden]``. A plain decode step replays a CUDA graph when one fits (logits valid until the next step)."""
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
