"""Layer-pipelined export (``--kv-layer-pipeline``): a prompt's KV written into its outgoing
/dev/shm frame layer by layer, during the prefill step that computes it.

:class:`LayerPipeline` is the engine's :class:`~epdserve.engine.kv_source.LayerSink` for
the requests that ask for it: as the forward pass finishes writing a layer's K/V, the
engine calls :meth:`LayerPipeline.write_layer`, which creates each prompt's segment at its
first layer and copies (converting as the frame's header says) that layer's blocks into
it. The exporter then only closes the frame (:meth:`LayerPipeline.finish`).
"""

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
    """A segment being written: its mapping, its tensors (views of the mapping) and the
    ms spent copying layers into it so far."""

    name: str
    mm: mmap.mmap
    views: dict[str, torch.Tensor]
    copy_ms: float = 0.0


def read_where_cached(engine: LLMEngine, ids: list[int], shape: torch.Size, layer: int | None = None) -> torch.Tensor:
    """Blocks ``ids`` (of ``layer``, or of every layer) of ``engine``'s cache copied into a
    new tensor of ``shape`` (``[layers, 2, len(ids), block_size, kv_heads, head_dim]``, no
    layer axis with ``layer``) on the cache's device and in its dtype: quantizing them
    (int8) then runs on the GPU of a GPU cache, and only the int8 bytes and scales cross to
    the host."""
    cache = engine.kv_cache
    return engine.read_kv(ids, out=torch.empty(shape, dtype=cache.dtype, device=cache.device), layer=layer)


class LayerPipeline:
    """Writes the prompts of ``engine`` into segments layer by layer; ``header(n_blocks)``:
    the frame header of ``n_blocks`` blocks. ``pending``: segments being written, by
    request id."""

    def __init__(self, engine: LLMEngine, header: Callable[[int], TensorHeader]):
        self.engine = engine
        self.header = header
        self.pending: dict[str, _Pending] = {}

    def write_layer(self, layer: int, prompts: list[tuple[str, list[int]]]) -> None:
        """Write layer ``layer`` of each prompt's blocks into its outgoing segment, creating
        the segment at its first layer."""
        if layer == 0:
            # A frame still pending from an earlier step belongs to a request that finished
            # in its prefill (EOS, max_tokens 1) and was never exported.
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
        """Close the request's segment: its name and the ms its layer copies took; None if
        none was written."""
        pending = self.pending.pop(request_id, None)
        if pending is None:
            return None
        pending.views.clear()  # the tensors view the mapping: drop them before closing it
        pending.mm.close()
        return pending.name, pending.copy_ms

    def drop(self, request_id: str) -> None:
        """Delete the request's segment, if one is being written."""
        pending = self.pending.pop(request_id, None)
        if pending is not None:
            pending.views.clear()
            pending.mm.close()
            shm.remove(pending.name)

    def drop_finished(self) -> None:
        """Delete the segments of requests the engine no longer runs (finished in their
        prefill; one not yet exported would just be written again at export)."""
        for request_id in [rid for rid in self.pending if rid not in self.engine.seqs]:
            self.drop(request_id)

    def close(self) -> None:
        for request_id in list(self.pending):
            self.drop(request_id)
