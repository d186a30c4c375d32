"""Layer-pipelined export (``--kv-layer-pipeline``): the engine's ``LayerSink`` writing each prompt's KV
into its outgoing /dev/shm frame layer by layer during the prefill step; the exporter then only closes it."""

from __future__ import annotations

import mmap
import time
from dataclasses import dataclass
from typing import Callable

import torch

from epdserve.engine.engine import LLMEngine
from epdserve.transfer import kv_codec, shm
from epdserve.transfer.wire import TensorHeader


@dataclass
class _Pending:
    """``copy_ms``: the time spent copying layers in so far."""

    name: str
    mm: mmap.mmap
    views: dict[str, torch.Tensor]
    copy_ms: float = 0.0


def read_where_cached(engine: LLMEngine, ids: list[int], shape: torch.Size, layer: int | None = None) -> torch.Tensor:
    """Copied to a new tensor of ``shape`` on the cache's device, in its dtype (no layer axis with ``layer``):
    int8 quantization then runs on the GPU, and only its bytes cross to the host."""
    cache = engine.kv_cache
    return engine.read_kv(ids, out=torch.empty(shape, dtype=cache.dtype, device=cache.device), layer=layer)


class LayerPipeline:
    """``header(n_blocks)``: the frame header; ``pending``: segments being written, by request id."""

    def __init__(self, engine: LLMEngine, header: Callable[[int], TensorHeader]):
        self.engine = engine
        self.header = header
        self.pending: dict[str, _Pending] = {}

    def write_layer(self, layer: int, prompts: list[tuple[str, list[int]]]) -> None:
        """Creating each segment at its first layer."""
        if layer == 0:
            # A frame still pending here: its request finished in prefill (EOS, max_tokens 1), never exported.
            for request_id in set(self.pending) - {rid for rid, _ in prompts}:
                self.drop(request_id)
        for request_id, ids in prompts:
            start = time.perf_counter()
            if request_id not in self.pending:
                name = shm.new_name()
                self.pending[request_id] = _Pending(name, *shm.create(name, self.header(len(ids))))
            pending = self.pending[request_id]
            views = {key: tensor[layer] for key, tensor in pending.views.items()}
            if "scales" in views:
                kv_codec.encode(read_where_cached(self.engine, ids, views["kv"].shape, layer), views)
            else:
                self.engine.read_kv(ids, out=views["kv"], layer=layer)
            pending.copy_ms += (time.perf_counter() - start) * 1e3

    def finish(self, request_id: str) -> tuple[str, float] | None:
        """The segment's name and its layer-copy ms; None if none was written."""
        pending = self.pending.pop(request_id, None)
        if pending is None:
            return None
        pending.views.clear()  # the tensors view the mapping: drop them before closing it
        pending.mm.close()
        return pending.name, pending.copy_ms

    def drop(self, request_id: str) -> None:
        pending = self.pending.pop(request_id, None)
        if pending is not None:
            pending.views.clear()
            pending.mm.close()
            shm.remove(pending.name)

    def drop_finished(self) -> None:
        """Of requests that finished in their prefill (one not yet exported is rewritten at export)."""
        for request_id in [rid for rid in self.pending if rid not in self.engine.seqs]:
            self.drop(request_id)

    def close(self) -> None:
        for request_id in list(self.pending):
            self.drop(request_id)
