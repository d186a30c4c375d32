"""The encode engine (epdserve.engine.encoder) on the tiny random Idefics3 model: embeddings
equal to the vision encoder's, tiles batched, the embedding cache (hits, LRU by bytes), a
bad image failing alone; and the embedding hand-off frame (epdserve.transfer.embedding)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from epdserve.engine.encoder import EncodedImage, EncodeEngine
from epdserve.model.image_processor import ImageError, ImageProcessor
from epdserve.model.vision import VisionEncoder
from epdserve.model.image_processor import ImageInput
from epdserve.transfer import embedding, shm, wire
from epdserve.transfer.wire import TensorHeader, TensorSpec, WireError
from test_vision import encoded, gradient, tiny_vlm  # noqa: F401  (tiny_vlm is a fixture)

HIDDEN = 64  # the tiny model's language hidden size; 4 tokens per 64-pixel tile


def image_input(image: Image.Image, fmt: str = "PNG") -> ImageInput:
    return ImageInput.from_bytes(encoded(image, fmt), f"test:{image.size}")


def noise(seed: int, size=(40, 30)) -> ImageInput:
    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    return image_input(Image.fromarray(pixels))


def by_hand(model_dir, item: ImageInput) -> torch.Tensor:
    """One image's embeddings from VisionEncoder.encode, its tiles concatenated."""
    vision = VisionEncoder.load(model_dir)
    processed = ImageProcessor.from_dir(model_dir, vision.config.tokens_per_image).process(item.image)
    return vision.encode(processed.pixel_values).reshape(-1, HIDDEN)


def counting(engine: EncodeEngine) -> list[int]:
    """Wrap the engine's vision encoder forward; returns the list of tiles per call."""
    calls, forward = [], engine.vision.encode

    def encode(pixel_values):
        calls.append(len(pixel_values))
        return forward(pixel_values)

    engine.vision.encode = encode
    return calls


def test_embeddings_equal_the_vision_encoder(tiny_vlm):
    path = tiny_vlm[0]
    engine = EncodeEngine(path, max_batch_tiles=3)
    calls = counting(engine)
    items = [image_input(gradient(100, 70)), image_input(gradient(60, 150, "RGBA")),
             image_input(gradient(40, 30), "JPEG")]
    # The last one as an encode worker gets it: bytes only, decoded by the engine.
    items[2] = ImageInput.from_bytes(items[2].data, "wire", decode=False)
    out = engine.encode(items)
    assert [(im.rows, im.cols) for im in out] == [(2, 2), (2, 1), (2, 2)]
    assert [im.embeddings.shape for im in out] == [(20, HIDDEN), (12, HIDDEN), (20, HIDDEN)]
    assert calls == [3, 3, 3, 3, 1]  # 13 tiles, 3 per forward pass, across image boundaries
    items[2] = ImageInput.from_bytes(items[2].data, "decoded")
    for item, got in zip(items, out):
        assert got.content_hash == item.content_hash and got.encode_ms > 0
        # Batched with other tiles vs alone: equal up to float rounding of the matmuls.
        torch.testing.assert_close(got.embeddings, by_hand(path, item), atol=1e-5, rtol=0)
    # Alone, in one forward pass as by hand: bit for bit.
    assert torch.equal(EncodeEngine(path).encode(items[:1])[0].embeddings, by_hand(path, items[0]))
    assert engine.hidden_size == HIDDEN
    assert (engine.cache.queries, engine.cache.hits) == (3, 0)


def test_repeated_image_is_not_encoded_again(tiny_vlm):
    engine = EncodeEngine(tiny_vlm[0])
    calls = counting(engine)
    a, b = image_input(gradient(100, 70)), noise(1)
    first = engine.encode([a, b, a])
    assert calls == [10]  # a (5 tiles) once, b (5 tiles)
    assert first[2].encode_ms == 0.0 and torch.equal(first[2].embeddings, first[0].embeddings)
    assert (engine.cache.queries, engine.cache.hits) == (3, 1)
    again = engine.encode([b, a])
    assert calls == [10]  # no forward pass at all
    assert [im.encode_ms for im in again] == [0.0, 0.0]
    assert torch.equal(again[0].embeddings, first[1].embeddings) and torch.equal(again[1].embeddings,
                                                                                 first[0].embeddings)
    assert (engine.cache.queries, engine.cache.hits) == (5, 3)
    assert engine.cache.bytes == 2 * 5 * 4 * HIDDEN * 4  # two images of 5 tiles of 4 float32 rows


def test_cache_evicts_least_recently_used_by_bytes(tiny_vlm):
    size = 5 * 4 * HIDDEN * 4  # bytes of one 2x2-tile image's embeddings
    engine = EncodeEngine(tiny_vlm[0], cache_bytes=2 * size + size // 2)
    calls = counting(engine)
    a, b, c = noise(1), noise(2), noise(3)
    engine.encode([a, b])
    engine.encode([a])  # a is now the most recently used
    engine.encode([c])  # evicts b
    assert list(engine.cache.entries) == [a.content_hash, c.content_hash] and engine.cache.bytes == 2 * size
    calls.clear()
    out = engine.encode([a, b, c])
    assert calls == [5] and [im.encode_ms == 0 for im in out] == [True, False, True]
    assert list(engine.cache.entries) == [c.content_hash, b.content_hash]  # a was least recently used
    small = EncodeEngine(tiny_vlm[0], cache_bytes=size - 1)  # an image larger than the cache is not kept
    small.encode([a])
    assert small.cache.bytes == 0 and small.encode([a])[0].encode_ms > 0


def test_bad_image_fails_alone(tiny_vlm):
    engine = EncodeEngine(tiny_vlm[0])
    good, other = image_input(gradient(100, 70)), noise(4)
    bad = ImageInput.from_bytes(encoded(gradient(100, 70), "PNG")[:131], "wire", decode=False)
    out = engine.encode([good, bad, other, bad])
    assert isinstance(out[1], ImageError) and "corrupt or truncated PNG image" in str(out[1])
    assert out[3] is out[1]
    assert [type(im) for im in (out[0], out[2])] == [EncodedImage, EncodedImage]
    torch.testing.assert_close(out[0].embeddings, by_hand(tiny_vlm[0], good), atol=1e-5, rtol=0)
    assert list(engine.cache.entries) == [good.content_hash, other.content_hash]


def encoded_images(dtype=torch.float32) -> list[EncodedImage]:
    g = torch.Generator().manual_seed(0)
    return [EncodedImage(f"{i:064x}", torch.randn(tokens, HIDDEN, generator=g).to(dtype), rows, cols, 1.5 * i)
            for i, (tokens, rows, cols) in enumerate([(20, 2, 2), (4, 0, 0), (16, 3, 1)])]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_embedding_frame_round_trip(dtype):
    images = encoded_images(dtype)
    hashes = [im.content_hash for im in images]
    frame = embedding.pack(images)
    name, size = embedding.write_segment(images)
    assert size == len(frame)
    for header, tensors in (wire.parse(bytes(frame)), shm.read(name)):
        back = embedding.unpack(header, tensors, HIDDEN, hashes)
        assert header.num_tokens == 40
        for im, got in zip(images, back):
            assert got.embeddings.dtype == dtype
            assert torch.equal(got.embeddings.view(torch.uint8), im.embeddings.view(torch.uint8))  # same bytes
            assert (got.content_hash, got.rows, got.cols, got.encode_ms) == (im.content_hash, im.rows, im.cols,
                                                                             im.encode_ms)
    assert not (shm.SHM_DIR / name).exists()  # read unlinks it


def test_embedding_frame_refused():
    images = encoded_images()
    hashes = [im.content_hash for im in images]
    frame = embedding.pack(images)
    corrupt = bytearray(frame)
    corrupt[12:20] = b"\xff" * 8  # inside the msgpack header
    with pytest.raises(WireError, match="invalid frame header"):
        wire.parse(bytes(corrupt))
    header, tensors = wire.parse(bytes(frame))
    with pytest.raises(WireError, match="embeddings are 64 wide, this model's hidden size is 576"):
        embedding.unpack(header, tensors, 576, hashes)
    with pytest.raises(WireError, match="frame holds images .* expected"):
        embedding.unpack(header, tensors, HIDDEN, hashes[::-1])

    def forged(layout_change: dict, spec: TensorSpec, num_tokens: int = 40) -> WireError:
        layout = {**header.layout, **layout_change}
        buf = wire.pack(TensorHeader(tensors=[spec], num_tokens=num_tokens, layout=layout), lambda t: None)
        with pytest.raises(WireError) as info:
            embedding.unpack(*wire.parse(bytes(buf)), HIDDEN, hashes)
        return info.value

    ok = TensorSpec(name="embeddings", dtype="float32", shape=[40, HIDDEN])
    assert "not an image embedding frame" in str(forged({"kind": "kv"}, ok))
    assert "not an image embedding frame" in str(forged({"extra": 1}, ok))
    assert "one float tensor 'embeddings'" in str(forged({}, TensorSpec(name="embeddings", dtype="int8",
                                                                        shape=[40, HIDDEN])))
    assert "one float tensor 'embeddings'" in str(forged({}, TensorSpec(name="kv", dtype="float32",
                                                                        shape=[40, HIDDEN])))
    assert "do not match the layout's 40 tokens" in str(forged({}, TensorSpec(name="embeddings", dtype="float32",
                                                                              shape=[39, HIDDEN])))
    assert "do not match the layout's 40 tokens" in str(forged({}, ok, num_tokens=41))
    with pytest.raises(ValueError, match="one float dtype and hidden size"):
        embedding.pack([images[0], EncodedImage("x", torch.zeros(4, 32), 0, 0, 0.0)])
