"""The encode engine: images → the embeddings for their ``<image>`` tokens, with a cache keyed by
content hash. An image that does not decode fails alone. Not thread-safe: one engine per worker loop."""

from __future__ import annotations

import dataclasses
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch

from epdserve.model.image_processor import ImageError, ImageInput, ImageProcessor, ProcessedImage, load_image
from epdserve.model.tensor_parallel import VisionDriver
from epdserve.model.vision import VisionEncoder

DEFAULT_CACHE_BYTES = 256 * 1024 * 1024
# 16 SmolVLM tiles (512 px): ~50 MB of pixels, ~0.5 GB of float32 attention activations.
DEFAULT_MAX_BATCH_TILES = 16


@dataclass(frozen=True)
class EncodedImage:
    """``embeddings [tokens, hidden]``: ``rows * cols + 1`` tiles (row-major, then the global image) of
    ``tokens_per_image`` rows each; ``rows``/``cols`` 0/0: not split. ``encode_ms``: preprocessing plus
    this image's share of the encoder time, 0.0 from the cache. Shared with the cache: read-only."""

    content_hash: str
    embeddings: torch.Tensor
    rows: int
    cols: int
    encode_ms: float


class EmbeddingCache:
    """LRU by total ``embeddings.nbytes`` over ``capacity_bytes`` (0 disables it)."""

    def __init__(self, capacity_bytes: int):
        self.capacity_bytes = capacity_bytes
        self.entries: OrderedDict[str, EncodedImage] = OrderedDict()
        self.queries = self.hits = self.bytes = 0

    def get(self, content_hash: str) -> EncodedImage | None:
        self.queries += 1
        entry = self.entries.get(content_hash)
        if entry is None:
            return None
        self.hits += 1
        self.entries.move_to_end(content_hash)
        return dataclasses.replace(entry, encode_ms=0.0)

    def put(self, image: EncodedImage) -> None:
        size = image.embeddings.nbytes
        if size > self.capacity_bytes or image.content_hash in self.entries:
            return
        while self.bytes + size > self.capacity_bytes:
            self.bytes -= self.entries.popitem(last=False)[1].embeddings.nbytes
        self.entries[image.content_hash] = image
        self.bytes += size


class EncodeEngine:
    """The vision side of a SmolVLM / Idefics3 directory; embeddings come back to the host whatever ``device``.
    ``tp``: a tensor-parallel tower, this process rank 0. Raises ModelLoadError (not a VLM directory, missing
    weights or processor settings) and ValueError (a tower that does not split over ``tp``)."""

    def __init__(self, model_dir: str | Path, dtype: torch.dtype = torch.float32,
                 cache_bytes: int = DEFAULT_CACHE_BYTES, max_batch_tiles: int = DEFAULT_MAX_BATCH_TILES,
                 device: str | torch.device = "cpu", tp: VisionDriver | None = None):
        self.vision = VisionEncoder.load(model_dir, dtype, device, tp.rank if tp else None)
        if tp is not None:
            self.vision = tp.drive_vision(self.vision)
        self.processor = ImageProcessor.from_dir(model_dir, self.vision.config.tokens_per_image)
        self.cache = EmbeddingCache(cache_bytes)
        self.max_batch_tiles = max_batch_tiles

    @property
    def hidden_size(self) -> int:
        return self.vision.config.text_hidden_size

    def encode(self, images: list[ImageInput]) -> list[EncodedImage | ImageError]:
        """In order; an :class:`ImageError` in place of each image that does not decode."""
        results: list[EncodedImage | ImageError | None] = [None] * len(images)
        first: dict[str, int] = {}
        misses: list[tuple[int, ProcessedImage, float]] = []
        for i, item in enumerate(images):
            if item.content_hash in first:
                continue
            first[item.content_hash] = i
            results[i] = self.cache.get(item.content_hash)
            if results[i] is None:
                start = time.perf_counter()
                try:
                    processed = self.processor.process(item.image if item.image is not None else load_image(item.data))
                except ImageError as exc:
                    results[i] = exc
                    continue
                misses.append((i, processed, (time.perf_counter() - start) * 1e3))
        for (i, _, _), image in zip(misses, self._encode_batched(misses, images)):
            results[i] = image
            self.cache.put(image)
        for i, item in enumerate(images):
            if results[i] is None:
                earlier = results[first[item.content_hash]]
                results[i] = earlier if isinstance(earlier, ImageError) else (
                    self.cache.get(item.content_hash) or dataclasses.replace(earlier, encode_ms=0.0))
        return results

    def _encode_batched(self, misses: list[tuple[int, ProcessedImage, float]],
                        images: list[ImageInput]) -> list[EncodedImage]:
        if not misses:
            return []
        tiles = torch.cat([p.pixel_values for _, p, _ in misses])
        start = time.perf_counter()
        out = torch.cat([self.vision.encode(tiles[k:k + self.max_batch_tiles])
                         for k in range(0, len(tiles), self.max_batch_tiles)])
        # .cpu() inside the timed span: on CUDA it waits for the encoder.
        out = out.cpu()
        forward_ms = (time.perf_counter() - start) * 1e3
        counts = [len(p.pixel_values) for _, p, _ in misses]
        # clone(): a view would keep the whole batch alive, and the cache would undercount its bytes.
        return [EncodedImage(images[i].content_hash, chunk.reshape(-1, chunk.shape[-1]).clone(), p.rows, p.cols,
                             prep_ms + forward_ms * n / len(tiles))
                for (i, p, prep_ms), chunk, n in zip(misses, out.split(counts), counts)]
