"""SmolVLM / Idefics3 model layer against transformers: the vision encoder, the image
processor and prompt expansion, full-model logits with merged image embeddings; bad
image bytes; and the default multimodal model (SmolLM2 + synthetic vision tower)."""

from __future__ import annotations

import io
import json
import struct
import zlib

import numpy as np
import pytest
import torch
from PIL import Image

from epdserve.model.image_processor import SPECIAL_TOKENS, ImageError, load_image
from epdserve.model.llama import AttentionMetadata, LlamaModel, PrefillSeq
from epdserve.model.smolvlm import SmolVLM, default_multimodal_model, synthetic_vision_weights
from epdserve.model.loader import ModelLoadError
from epdserve.model.vision import VisionEncoder, read_weights

PROMPT = "User:<image>What is in this image?<end_of_utterance>\nAssistant:"


def gradient(width: int, height: int, mode: str = "RGB") -> Image.Image:
    """A deterministic colour gradient (``mode`` RGB or RGBA, half transparent)."""
    a = np.zeros((height, width, 4), np.uint8)
    a[..., 0] = np.arange(width)[None, :] * 255 // width
    a[..., 1] = np.arange(height)[:, None] * 255 // height
    a[..., 2] = 90
    a[..., 3] = np.where(np.arange(width)[None, :] < width // 2, 255, 80)
    return Image.fromarray(a[..., :4] if mode == "RGBA" else a[..., :3], mode)


@pytest.fixture(scope="module")
def tiny_vlm(tmp_path_factory, model_info):
    """A tiny random transformers Idefics3 model (2-layer SigLIP, hidden 32, 64-pixel
    tiles, patch 16, scale factor 2; 2-layer llama, hidden 64) saved with a processor
    whose tokenizer is SmolLM2's plus the image tokens. Returns (dir, model, processor)."""
    import transformers as tf

    path = tmp_path_factory.mktemp("tiny-vlm")
    tokenizer = tf.AutoTokenizer.from_pretrained(str(model_info.path))
    tokenizer.add_special_tokens({"additional_special_tokens": SPECIAL_TOKENS})
    config = tf.Idefics3Config(
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                           image_size=64, patch_size=16, initializer_range=0.2),
        text_config=dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=len(tokenizer),
                         max_position_embeddings=512, initializer_range=0.2),
        scale_factor=2, image_token_id=tokenizer.convert_tokens_to_ids("<image>"))
    torch.manual_seed(0)
    model = tf.Idefics3ForConditionalGeneration(config).eval()
    model.save_pretrained(path)
    image_processor = tf.Idefics3ImageProcessorPil(max_image_size={"longest_edge": 64}, size={"longest_edge": 128})
    tf.Idefics3Processor(image_processor=image_processor, tokenizer=tokenizer, image_seq_len=4).save_pretrained(path)
    return path, model, tf.AutoProcessor.from_pretrained(str(path))


def prefill_logits(model: LlamaModel, input_ids: torch.Tensor, embeds=None) -> torch.Tensor:
    """Next-token logits ``[vocab]`` of one prefill-only step over ``input_ids [T]``."""
    n, block = len(input_ids), 16
    blocks = -(-n // block)
    empty = torch.zeros(0, dtype=torch.long)
    meta = AttentionMetadata(positions=torch.arange(n), slot_mapping=torch.arange(n),
                             prefills=[PrefillSeq(0, n, n, torch.arange(blocks))], decode_rows=empty,
                             decode_block_tables=empty.view(0, 0), decode_ctx_lens=empty,
                             logits_rows=torch.tensor([n - 1]))
    return model.forward(input_ids, meta, model.allocate_kv_cache(blocks, block), embeds=embeds)[0]


@pytest.mark.parametrize("image", [gradient(100, 70), gradient(60, 150, "RGBA"), gradient(40, 30)],
                         ids=["100x70-rgb-2x2-tiles", "60x150-rgba-3x1-tiles", "40x30-single-tile"])
def test_processor_and_encoder_match_transformers(tiny_vlm, image):
    path, hf, processor = tiny_vlm
    ours = SmolVLM.load(path)
    ref = processor(text=[PROMPT], images=[[image]], return_tensors="pt")
    got = ours.processor.process(image)
    assert torch.equal(got.pixel_values, ref["pixel_values"][0])
    ids = processor.tokenizer(ours.processor.expand(PROMPT, [(got.rows, got.cols)]), add_special_tokens=False).input_ids
    assert ids == ref["input_ids"][0].tolist()
    assert ours.processor.grid(image.size) == (got.rows, got.cols)
    assert ours.processor.num_tokens((got.rows, got.cols)) == len(got.pixel_values) * 4
    with torch.inference_mode():
        features = hf.model.get_image_features(ref["pixel_values"], ref["pixel_attention_mask"]).pooler_output
    embeds = ours.vision.encode(got.pixel_values)
    assert embeds.shape == (got.pixel_values.shape[0], 4, 64)
    assert torch.equal(VisionEncoder.load(path).encode(got.pixel_values), embeds)
    torch.testing.assert_close(embeds.reshape(-1, 64), torch.cat(list(features)), atol=1e-4, rtol=0)


def test_image_text_logits_match_transformers(tiny_vlm):
    path, hf, processor = tiny_vlm
    ours = SmolVLM.load(path)
    images = [gradient(100, 70), gradient(40, 30)]
    prompt = "User:<image>and<image>Compare them.<end_of_utterance>\nAssistant:"
    ref = processor(text=[prompt], images=[images], return_tensors="pt")
    with torch.inference_mode():
        expected = hf(**ref).logits[0, -1]
    processed = [ours.processor.process(im) for im in images]
    input_ids = torch.tensor(processor.tokenizer(ours.processor.expand(prompt, [(p.rows, p.cols) for p in processed])).input_ids)
    embeds = torch.cat([ours.vision.encode(p.pixel_values) for p in processed])
    logits = prefill_logits(ours.text, input_ids, ours.image_embeds(input_ids, embeds))
    torch.testing.assert_close(logits, expected, atol=1e-3, rtol=0)
    assert int(logits.argmax()) == int(expected.argmax())
    with pytest.raises(ValueError, match="40 <image> tokens for 4 image embeddings"):
        ours.image_embeds(input_ids, embeds[:1])


def test_not_a_vision_language_model_is_refused(model_info, tmp_path):
    with pytest.raises(ModelLoadError, match="not a vision-language model, model_type='llama'"):
        SmolVLM.load(model_info.path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "idefics3"}))
    with pytest.raises(ModelLoadError, match="no \\*.safetensors weight files"):
        read_weights(tmp_path)


def png_chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def encoded(image: Image.Image, fmt: str) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format=fmt)
    return buf.getvalue()


BOMB_PNG = (b"\x89PNG\r\n\x1a\n" + png_chunk(b"IHDR", struct.pack(">IIBBBBB", 100_000, 100_000, 8, 2, 0, 0, 0))
            + png_chunk(b"IDAT", zlib.compress(b"\0" * 64)) + png_chunk(b"IEND", b""))


@pytest.mark.parametrize("data, message", [
    (encoded(gradient(100, 70), "PNG")[:131], "corrupt or truncated PNG image: image file is truncated"),
    (bytes(np.random.default_rng(0).integers(0, 256, 2000, dtype=np.uint8)), "cannot decode image"),
    (encoded(gradient(100, 70), "TIFF"), "unsupported image format TIFF"),
    (BOMB_PNG, "decompression bomb"),
], ids=["truncated-png", "random-bytes", "tiff", "bomb"])
def test_bad_images_raise_image_error(data, message):
    with pytest.raises(ImageError, match=message):
        load_image(data)


def test_image_limits_and_good_formats():
    png = encoded(gradient(100, 70), "PNG")
    with pytest.raises(ImageError, match="over the limit of 100 bytes"):
        load_image(png, max_bytes=100)
    with pytest.raises(ImageError, match="100x70 = 7000 pixels, over the limit of 5000"):
        load_image(png, max_pixels=5000)
    for fmt in ("PNG", "JPEG", "WEBP", "GIF", "BMP"):
        assert load_image(encoded(gradient(100, 70), fmt)).size == (100, 70)
    assert issubclass(ImageError, ValueError)


def greedy(model: LlamaModel, ids: list[int], n: int) -> list[int]:
    out = []
    for _ in range(n):
        out.append(int(prefill_logits(model, torch.tensor(ids + out)).argmax()))
    return out


def test_default_multimodal_model(model_info, tokenizer):
    path = default_multimodal_model()
    stamp = (path / "complete").stat().st_mtime_ns
    assert default_multimodal_model() == path and (path / "complete").stat().st_mtime_ns == stamp
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["synthetic_vision"] is True and cfg["vision_config"]["hidden_size"] == 768
    model = SmolVLM.load(path)
    assert model.synthetic_vision and model.processor.image_seq_len == 64
    # Same seed -> the same vision weights as a fresh generation.
    expected = synthetic_vision_weights(model.vision.config, cfg["synthetic_vision_seed"], projection_std=1.0)
    stored = read_weights(path, lambda name: name.startswith("model.vision_model."))
    assert stored.keys() == {k for k in expected if k.startswith("model.vision_model.")}
    assert all(torch.equal(stored[k], expected[k]) for k in stored)
    # A 128-pixel input (8x8 patches, bucketed position ids) keeps this fast: 4 tokens.
    embeds = model.vision.encode(torch.rand(1, 3, 128, 128, generator=torch.Generator().manual_seed(0)) * 2 - 1)
    assert embeds.shape == (1, 4, 576) and torch.isfinite(embeds).all()
    # The language model is SmolLM2 untouched: same greedy tokens for a text prompt.
    plain = LlamaModel.load(model_info.path)
    ids = tokenizer("The capital of France is").input_ids
    assert greedy(model.text, ids, 3) == greedy(plain, ids, 3)
