"""Image bytes → checked Pillow image → SmolVLM / Idefics3 ``pixel_values`` and prompt text, as transformers'
``Idefics3ImageProcessorPil`` and ``Idefics3Processor``."""

from __future__ import annotations

import hashlib
import io
import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError

from epdserve.model.base import ModelLoadError

IMAGE_TOKEN = "<image>"
FAKE_TOKEN = "<fake_token_around_image>"
GLOBAL_TOKEN = "<global-img>"
MAX_GRID = 6  # <row_6_col_6> is the largest tile tag in Idefics3 / SmolVLM tokenizers
SPECIAL_TOKENS = [FAKE_TOKEN, IMAGE_TOKEN, GLOBAL_TOKEN, "<end_of_utterance>"] + [
    f"<row_{r}_col_{c}>" for r in range(1, MAX_GRID + 1) for c in range(1, MAX_GRID + 1)]
SUPPORTED_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")
MAX_IMAGE_BYTES = 20 * 1024 * 1024
MAX_RESIZED_SIDE = 4096  # transformers' MAX_IMAGE_SIZE for Idefics3 / SmolVLM


class ImageError(ValueError):
    """Corrupt, unsupported or oversized; the message says which (the API answers 400)."""


def open_image(data: bytes, max_bytes: int = MAX_IMAGE_BYTES, max_pixels: int | None = None) -> Image.Image:
    """Header only; ``max_pixels`` (default Pillow's ``MAX_IMAGE_PIXELS``) checked before decoding (bombs).
    Raises ImageError: too many bytes or pixels, not an image, or a format outside ``SUPPORTED_FORMATS``."""
    if len(data) > max_bytes:
        raise ImageError(f"image is {len(data)} bytes, over the limit of {max_bytes} bytes")
    max_pixels = max_pixels or Image.MAX_IMAGE_PIXELS
    try:
        image = Image.open(io.BytesIO(data))  # reads the header only
    except Image.DecompressionBombError as exc:
        raise ImageError(f"image rejected as a decompression bomb: {exc}") from None
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError):
        raise ImageError("cannot decode image: not an image or corrupt data"
                         f" (supported formats: {', '.join(SUPPORTED_FORMATS)})") from None
    if image.format not in SUPPORTED_FORMATS:
        raise ImageError(f"unsupported image format {image.format}"
                         f" (supported: {', '.join(SUPPORTED_FORMATS)})")
    width, height = image.size
    if width * height > max_pixels:
        raise ImageError(f"image is {width}x{height} = {width * height} pixels, over the limit of"
                         f" {max_pixels} pixels (decompression bomb guard)")
    return image


def decoded_bytes(image: Image.Image) -> int:
    """Bytes Pillow needs to decode ``image``, from the header: width × height × (1 for modes 1/L/P, 2 for
    I;16, else 4), x4 for WebP (libwebp's RGBA copies: a 4000x4000 load peaks at 4x)."""
    width, height = image.size
    mode = image.mode
    per_pixel = 1 if mode in ("1", "L", "P") else 2 if mode.startswith("I;16") else 4
    return width * height * per_pixel * (4 if image.format == "WEBP" else 1)


def reduce_for_check(image: Image.Image) -> None:
    """For a decode check: JPEG at 1/8 scale (1/64 memory, every coefficient still read); others unchanged."""
    if image.format == "JPEG":
        image.draft(None, (1, 1))  # the largest reduction libjpeg offers


def load_pixels(image: Image.Image) -> None:
    """Raises ImageError for corrupt or truncated data."""
    try:
        image.load()
    # Pillow raises many types for bad data (OSError, SyntaxError, struct.error, ...).
    except Exception as exc:
        raise ImageError(f"corrupt or truncated {image.format} image: {exc}") from None


def load_image(data: bytes, max_bytes: int = MAX_IMAGE_BYTES, max_pixels: int | None = None) -> Image.Image:
    """Under :func:`open_image`'s limits. Raises ImageError."""
    image = open_image(data, max_bytes, max_pixels)
    load_pixels(image)
    return image


@dataclass(frozen=True)
class ImageInput:
    """``content_hash``: sha256 hex of the encoded bytes, not the pixels: known before decoding, and equal bytes
    decode equal. ``image``/``size``: None where not decoded. ``source``: for logs, never the bytes."""

    content_hash: str
    data: bytes
    source: str
    image: Image.Image | None = None
    size: tuple[int, int] | None = None

    @classmethod
    def from_bytes(cls, data: bytes, source: str, *, decode: bool = True, max_bytes: int = MAX_IMAGE_BYTES,
                   max_pixels: int | None = None) -> "ImageInput":
        """Raises ImageError (with ``decode``) as :func:`load_image`."""
        image = load_image(data, max_bytes, max_pixels) if decode else None
        return cls(hashlib.sha256(data).hexdigest(), data, source, image, None if image is None else image.size)


@dataclass(frozen=True)
class ProcessedImage:
    """``pixel_values [rows * cols + 1, 3, S, S]`` float32: tiles row-major, then the global image."""

    pixel_values: torch.Tensor
    rows: int
    cols: int


@dataclass(frozen=True)
class ImageProcessor:
    """``preprocessor_config.json`` meanings; ``max_image_size``: tile side (px); ``image_seq_len``: tokens a tile."""

    longest_edge: int
    max_image_size: int
    image_seq_len: int
    do_resize: bool = True
    do_image_splitting: bool = True
    resample: int = Image.Resampling.LANCZOS
    rescale_factor: float = 1 / 255
    image_mean: tuple[float, ...] = (0.5, 0.5, 0.5)
    image_std: tuple[float, ...] = (0.5, 0.5, 0.5)

    @classmethod
    def from_dir(cls, model_dir: str | Path, image_seq_len: int) -> "ImageProcessor":
        """From ``preprocessor_config.json`` or transformers 5's ``processor_config.json``. Raises ModelLoadError."""
        model_dir = Path(model_dir)
        try:
            if (model_dir / "preprocessor_config.json").is_file():
                cfg = json.loads((model_dir / "preprocessor_config.json").read_text())
            else:
                cfg = json.loads((model_dir / "processor_config.json").read_text())["image_processor"]
        except (OSError, KeyError, json.JSONDecodeError) as exc:
            raise ModelLoadError(f"{model_dir}: no image processor settings in preprocessor_config.json"
                                 f" or processor_config.json ({type(exc).__name__}: {exc})") from None
        return cls(
            longest_edge=cfg.get("size", {}).get("longest_edge", 4 * 364),
            max_image_size=cfg.get("max_image_size", {}).get("longest_edge", 364),
            image_seq_len=image_seq_len,
            do_resize=cfg.get("do_resize", True),
            do_image_splitting=cfg.get("do_image_splitting", True),
            resample=cfg.get("resample", Image.Resampling.LANCZOS),
            rescale_factor=cfg.get("rescale_factor", 1 / 255),
            image_mean=tuple(cfg.get("image_mean", (0.5, 0.5, 0.5))),
            image_std=tuple(cfg.get("image_std", (0.5, 0.5, 0.5))),
        )

    def to_config(self) -> dict:
        """The ``preprocessor_config.json`` content transformers reads back."""
        return {
            "image_processor_type": "Idefics3ImageProcessor", "processor_class": "Idefics3Processor",
            "do_convert_rgb": True, "do_resize": self.do_resize, "do_image_splitting": self.do_image_splitting,
            "do_rescale": True, "do_normalize": True, "do_pad": True, "resample": int(self.resample),
            "rescale_factor": self.rescale_factor, "image_mean": list(self.image_mean),
            "image_std": list(self.image_std), "size": {"longest_edge": self.longest_edge},
            "max_image_size": {"longest_edge": self.max_image_size},
        }

    def grid(self, size: tuple[int, int]) -> tuple[int, int]:
        """``(rows, cols)`` for ``size`` = (width, height) px; (0, 0): not split. Needs only the header."""
        if self.do_resize:
            size = _longest_edge_size(size, self.longest_edge)
        if not self.do_image_splitting:
            return 0, 0
        side = self.max_image_size
        width, height = _tile_multiple_size(size, side)
        return (height // side, width // side) if width > side or height > side else (0, 0)

    def num_tokens(self, grid: tuple[int, int]) -> int:
        """``<image>`` tokens (= embedding rows) of an image with tile ``grid``."""
        return self.image_seq_len * (grid[0] * grid[1] + 1)

    def process(self, image: Image.Image) -> ProcessedImage:
        image = _to_rgb(image)
        rows, cols = self.grid(image.size)
        if self.do_resize:
            image = image.resize(_longest_edge_size(image.size, self.longest_edge), resample=self.resample)
        side = self.max_image_size
        if self.do_image_splitting:
            image = image.resize(_tile_multiple_size(image.size, side), resample=self.resample)
            frames = [image.crop((c * side, r * side, (c + 1) * side, (r + 1) * side))
                      for r in range(rows) for c in range(cols)]
            frames.append(image.resize((side, side), resample=self.resample) if rows else image)
        else:
            frames = [image.resize((side, side), resample=self.resample)]
        mean = np.array(self.image_mean, dtype=np.float32)[:, None, None]
        std = np.array(self.image_std, dtype=np.float32)[:, None, None]
        # Same dtype steps as transformers: rescale in float64, cast to float32, normalise.
        tiles = [((np.asarray(f).transpose(2, 0, 1).astype(np.float64) * self.rescale_factor)
                  .astype(np.float32) - mean) / std for f in frames]
        return ProcessedImage(torch.from_numpy(np.stack(tiles)), rows, cols)

    def prompt(self, grid: tuple[int, int]) -> str:
        """The text replacing one ``<image>`` placeholder."""
        tile = IMAGE_TOKEN * self.image_seq_len
        rows, cols = grid
        text = ""
        if rows or cols:
            for r in range(1, rows + 1):
                text += "".join(f"{FAKE_TOKEN}<row_{r}_col_{c}>{tile}" for c in range(1, cols + 1)) + "\n"
            text += "\n"
        return text + f"{FAKE_TOKEN}{GLOBAL_TOKEN}{tile}{FAKE_TOKEN}"

    def expand(self, text: str, grids: list[tuple[int, int]]) -> str:
        """Placeholders replaced in order. Raises ValueError unless there are ``len(grids)`` of them."""
        parts = text.split(IMAGE_TOKEN)
        if len(parts) - 1 != len(grids):
            raise ValueError(f"prompt has {len(parts) - 1} {IMAGE_TOKEN} placeholders for {len(grids)} images")
        return parts[0] + "".join(self.prompt(g) + part for g, part in zip(grids, parts[1:]))


def _to_rgb(image: Image.Image) -> Image.Image:
    # Transparent pixels become white, as transformers' convert_to_rgb.
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        return Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba).convert("RGB")
    return image.convert("RGB")


def _longest_edge_size(size: tuple[int, int], longest: int) -> tuple[int, int]:
    """transformers' ``_resize_output_size_rescale_to_max_len`` then ``_scale_below_upper_bound``."""
    width, height = size
    aspect = width / height
    if width >= height:
        width, height = longest, int(longest / aspect)
        height += height % 2
    else:
        height, width = longest, int(longest * aspect)
        width += width % 2
    width, height = max(width, 1), max(height, 1)
    aspect = width / height
    if width >= height and width > MAX_RESIZED_SIDE:
        width, height = MAX_RESIZED_SIDE, int(MAX_RESIZED_SIDE / aspect)
    elif height > width and height > MAX_RESIZED_SIDE:
        height, width = MAX_RESIZED_SIDE, int(MAX_RESIZED_SIDE * aspect)
    return max(width, 1), max(height, 1)


def _tile_multiple_size(size: tuple[int, int], side: int) -> tuple[int, int]:
    """transformers' ``resize_for_vision_encoder``."""
    width, height = size
    aspect = width / height
    if width >= height:
        width = math.ceil(width / side) * side
        height = math.ceil(int(width / aspect) / side) * side
    else:
        height = math.ceil(height / side) * side
        width = math.ceil(int(height * aspect) / side) * side
    return width, height
