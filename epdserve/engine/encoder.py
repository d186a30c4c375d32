"""The encode engine: images → the embeddings the language model takes in place of their
``<image>`` tokens, with an embedding cache keyed by image content hash.

One :meth:`EncodeEngine.encode` call takes the images of one or more requests: cached
ones are answered from the cache (and a repeat within the call from the first), the
rest are decoded if needed, preprocessed (:class:`ImageProcessor`), and their tiles run
through the vision encoder together, ``max_batch_tiles`` tiles per forward pass. An image
that cannot be decoded fails alone. Not thread-safe: one engine per worker loop.
"""

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
# 16 SmolVLM tiles (512 px) are about 50 MB of pixels and 0.5 GB of attention activations
# in float32: enough to fill the cores without a memory spike.
DEFAULT_MAX_BATCH_TILES = 16


@dataclass(frozen=True)
class EncodedImage:
    """One image's embeddings: ``embeddings [tokens, hidden]`` (all ``rows * cols + 1``
    tiles concatenated in prompt order, tiles row-major then the global image, each
    ``tokens_per_image`` rows: what fills the image's ``<image>`` tokens), the tile grid
    ``rows``/``cols`` (0/0: not split) and ``encode_ms`` (preprocessing plus this image's
    share, by tiles, of the vision encoder's time; 0.0 when served from the cache).
    Shared with the cache: read it, never write into it."""

    content_hash: str
    embeddings: torch.Tensor
    rows: int
    cols: int
    encode_ms: float


class EmbeddingCache:
    """Embeddings by image content hash, least recently used evicted first once their
    total ``embeddings.nbytes`` exceeds ``capacity_bytes`` (0 disables it). Counters:
    ``queries`` and ``hits`` (images looked up / found), ``bytes`` (held now)."""

    def __init__(self, capacity_bytes: int):
        self.capacity_bytes = capacity_bytes
        self.entries: OrderedDict[str, EncodedImage] = OrderedDict()
        self.queries = self.hits = self.bytes = 0

    def get(self, content_hash: str) -> EncodedImage | None:
        """The cached image with ``encode_ms`` 0.0, now most recently used; None on a miss."""
        self.queries += 1
        entry = self.entries.get(content_hash)
        if entry is None:
            return None
        self.hits += 1
        self.entries.move_to_end(content_hash)
        return dataclasses.replace(entry, encode_ms=0.0)

    def put(self, image: EncodedImage) -> None:
        """Store ``image`` unless it alone is over the capacity; evict LRU entries to fit."""
        size = image.embeddings.nbytes
        if size > self.capacity_bytes or image.content_hash in self.entries:
            return
        while self.bytes + size > self.capacity_bytes:
            self.bytes -= self.entries.popitem(last=False)[1].embeddings.nbytes
        self.entries[image.content_hash] = image
        self.bytes += size


class EncodeEngine:
    """The vision side of a SmolVLM / Idefics3 directory (no language model) and an
    :class:`EmbeddingCache` of ``cache_bytes``. ``dtype``: the vision encoder's and the
    embeddings' dtype. ``device``: where the vision encoder computes (``model/device.py``);
    the embeddings come back to the host either way (they leave as frames, or enter an
    engine step whose metadata is built on the host), and the cache holds them there.
    ``tp``: the ranks of a tensor-parallel encoder, this process being rank 0: it loads
    its shard of the tower and runs every forward pass on all the ranks (the preprocessing
    and the cache are rank 0's alone).

    Raises (constructor):
        ModelLoadError: not a vision-language model directory, or missing weights or
            image processor settings.
        ValueError: a tower that does not split over ``tp``'s ranks.
    """

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
        """The embeddings' width: the language model's hidden size."""
        return self.vision.config.text_hidden_size

    def encode(self, images: list[ImageInput]) -> list[EncodedImage | ImageError]:
        """The embeddings of ``images``, in order; an :class:`ImageError` in the place of
        each image whose bytes do not decode (``image`` None: decoded here under
        ``load_image``'s default limits), the others unaffected. Every image is looked up
        in the cache once; the misses are encoded and cached."""
        results: list[EncodedImage | ImageError | None] = [None] * len(images)
        first: dict[str, int] = {}
        misses: list[tuple[int, ProcessedImage, float]] = []
        for i, item in enumerate(images):
            if item.content_hash in first:
                continue  # a repeat within this call: answered once the first is encoded
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
        # To the host inside the timed span: on CUDA the copy waits for the encoder, so
        # encode_ms holds the device's time (a no-op on the CPU).
        out = out.cpu()
        forward_ms = (time.perf_counter() - start) * 1e3
        counts = [len(p.pixel_values) for _, p, _ in misses]
        # clone(): a view would keep the whole batch's output alive in the cache, whose
        # byte count would then understate what it holds.
        return [EncodedImage(images[i].content_hash, chunk.reshape(-1, chunk.shape[-1]).clone(), p.rows, p.cols,
                             prep_ms + forward_ms * n / len(tiles))
                for (i, p, prep_ms), chunk, n in zip(misses, out.split(counts), counts)]
