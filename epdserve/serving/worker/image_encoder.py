"""Images encoded on the worker itself from the bytes that came with a command: an encode worker's
batches, and a colocated or PD worker's prompts (on its loop, blocking it, as a vision encoder
inside an engine does)."""

from __future__ import annotations

import time

import torch

from epdserve.engine.encoder import EncodeEngine
from epdserve.model.image_processor import ImageError, ImageInput
from epdserve.serving import protocol as P
from epdserve.trace import StageTimings


def image_inputs(images: list[P.ImageRef]) -> list[ImageInput]:
    """Raises ValueError: an image without bytes, or whose bytes do not hash to its ``hash`` (it
    would poison the embedding cache)."""
    out = []
    for i, ref in enumerate(images):
        if ref.data is None:
            raise ValueError(f"image {i} came without its bytes")
        image = ImageInput.from_bytes(ref.data, "request", decode=False)
        if image.content_hash != ref.hash:
            raise ValueError(f"image {i}: its bytes hash to {image.content_hash[:12]}, not {ref.hash[:12]}")
        out.append(image)
    return out


def cache_stats(encoder: EncodeEngine | None) -> dict:
    """As :class:`~epdserve.serving.protocol.Stats` fields."""
    if encoder is None:
        return {}
    return {"mm_cache_queries": encoder.cache.queries, "mm_cache_hits": encoder.cache.hits}


class ImageEncoder:
    """``encoder``: None for a model without a vision tower."""

    def __init__(self, encoder: EncodeEngine | None):
        self.encoder = encoder

    def embeddings(self, msg: P.AddRequest, arrival: float, timings: StageTimings) -> torch.Tensor:
        """``[image tokens, hidden]``, in prompt order; sets ``timings.encode_queue_ms`` (from ``arrival``,
        ``time.perf_counter()``) and ``encode_ms``. Raises ValueError: images without bytes, or no vision
        tower; ImageError (a ValueError): bytes that do not decode to an image."""
        start = time.perf_counter()
        if self.encoder is None:
            raise ValueError("this worker has no vision encoder: its model takes no images")
        results = self.encoder.encode(image_inputs(msg.images))
        error = next((r for r in results if isinstance(r, ImageError)), None)
        if error is not None:
            raise error
        timings.encode_queue_ms, timings.encode_ms = (start - arrival) * 1e3, (time.perf_counter() - start) * 1e3
        return torch.cat([r.embeddings for r in results])
