"""Image bytes → checked Pillow image → SmolVLM / Idefics3 ``pixel_values`` and the
prompt text that stands for the image.

Preprocessing reproduces transformers' ``Idefics3ImageProcessorPil`` (the same as
``SmolVLMImageProcessorPil``) with Pillow and numpy: convert to RGB (transparency
composited onto white), resize so the longest edge is ``size["longest_edge"]`` (even
short edge), round both sides up to multiples of ``max_image_size``, cut that into
``rows × cols`` tiles of ``max_image_size`` pixels plus one global image resized to a
single tile, rescale by 1/255 and normalise with the mean/std. The prompt expansion
reproduces ``Idefics3Processor``: each ``<image>`` placeholder becomes, per tile,
``<fake_token_around_image><row_r_col_c>`` + ``image_seq_len`` × ``<image>`` (a newline
after each row), then ``\\n<fake_token_around_image><global-img>`` + ``image_seq_len`` ×
``<image>`` + ``<fake_token_around_image>``.
"""

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
    """An image that cannot be used: corrupt or truncated bytes, an unsupported
    format, or one over a size limit. The message says which; the API answers 400."""


def open_image(data: bytes, max_bytes: int = MAX_IMAGE_BYTES, max_pixels: int | None = None) -> Image.Image:
    """Read the header of ``data``: a Pillow image whose size, mode and format are known
    and whose pixels are not decoded yet (:func:`load_pixels`).

    ``max_bytes`` limits the encoded bytes; ``max_pixels`` (width × height) defaults to
    Pillow's ``Image.MAX_IMAGE_PIXELS`` and is checked here, before any pixel is decoded
    (decompression bombs).

    Raises:
        ImageError: more than ``max_bytes`` bytes, not an image, a format outside
            ``SUPPORTED_FORMATS``, or over ``max_pixels``.
    """
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
    """Bytes Pillow needs to decode ``image`` at its current size and mode, known from the
    header: width × height × bytes per pixel as Pillow stores them (1 for modes 1, L and
    P, 2 for I;16, 4 for the others: RGB is stored as 4 bytes a pixel); four times that
    for WebP, whose decoder holds libwebp's RGBA output and copies of it next to the
    image (peak RSS of a 4000x4000 load: 4x; the other formats: 1x)."""
    width, height = image.size
    mode = image.mode
    per_pixel = 1 if mode in ("1", "L", "P") else 2 if mode.startswith("I;16") else 4
    return width * height * per_pixel * (4 if image.format == "WEBP" else 1)


def reduce_for_check(image: Image.Image) -> None:
    """Make :func:`load_pixels` decode ``image`` (from :func:`open_image`) at the smallest
    size its format allows, for a caller that only checks that the bytes decode: JPEG
    decodes at 1/8 scale (1/64 of the memory; every coefficient is still read, so corrupt
    or truncated data is still found). Other formats have no reduced decode in Pillow
    (``reduce``/``thumbnail`` work on decoded pixels, so save nothing here) and are left
    as they are. ``image.size`` is the reduced size afterwards."""
    if image.format == "JPEG":
        image.draft(None, (1, 1))  # the largest reduction libjpeg offers


def load_pixels(image: Image.Image) -> None:
    """Decode the pixels of ``image`` (from :func:`open_image`).

    Raises:
        ImageError: corrupt or truncated data.
    """
    try:
        image.load()
    # Pillow's decoders raise many types for bad data (OSError for truncation,
    # SyntaxError for broken chunks, ValueError, struct.error, ...); all mean "corrupt".
    except Exception as exc:
        raise ImageError(f"corrupt or truncated {image.format} image: {exc}") from None


def load_image(data: bytes, max_bytes: int = MAX_IMAGE_BYTES, max_pixels: int | None = None) -> Image.Image:
    """Decode ``data`` into a fully loaded Pillow image, under the limits of
    :func:`open_image`.

    Raises:
        ImageError: as :func:`open_image`, or corrupt/truncated data.
    """
    image = open_image(data, max_bytes, max_pixels)
    load_pixels(image)
    return image


@dataclass(frozen=True)
class ImageInput:
    """One image of a request.

    ``content_hash`` is the sha256 hex digest of ``data``, the encoded file bytes (after
    base64 decoding), not of the decoded pixels: it is known before any decoding, so an
    encode worker can find cached embeddings without decoding, and equal bytes always
    decode to equal pixels, so it never joins two different images (a hash of raw pixels
    would also need the mode, size, palette and transparency to be safe). The price: the
    same picture saved twice in different files is encoded twice.

    ``image`` is the decoded Pillow image, or None where it was not kept (the router
    only checks that the bytes decode) or only the bytes travelled (an encode worker
    decodes on a cache miss). ``size`` is (width, height) in pixels, None where the bytes
    were not decoded. ``source`` says where it came from, for logs (``data:image/png``,
    ``file:/abs/path``, ``https://...``; never the bytes).
    """

    content_hash: str
    data: bytes
    source: str
    image: Image.Image | None = None
    size: tuple[int, int] | None = None

    @classmethod
    def from_bytes(cls, data: bytes, source: str, *, decode: bool = True, max_bytes: int = MAX_IMAGE_BYTES,
                   max_pixels: int | None = None) -> "ImageInput":
        """Hash ``data`` and, with ``decode``, decode it under the limits of
        :func:`~epdserve.model.image_processor.load_image`.

        Raises:
            ImageError: as ``load_image`` (with ``decode``).
        """
        image = load_image(data, max_bytes, max_pixels) if decode else None
        return cls(hashlib.sha256(data).hexdigest(), data, source, image, None if image is None else image.size)


@dataclass(frozen=True)
class ProcessedImage:
    """One image ready for the vision encoder: ``pixel_values [rows * cols + 1, 3, S, S]``
    float32 (tiles row-major, then the global image; ``[1, 3, S, S]`` when the image
    was not split, ``rows == cols == 0``)."""

    pixel_values: torch.Tensor
    rows: int
    cols: int


@dataclass(frozen=True)
class ImageProcessor:
    """SmolVLM / Idefics3 image preprocessing settings (``preprocessor_config.json`` field
    meanings; ``longest_edge`` is ``size["longest_edge"]``, ``max_image_size`` the tile
    side in pixels, ``image_seq_len`` the ``<image>`` tokens per tile)."""

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
        """Read ``preprocessor_config.json`` (or the ``image_processor`` entry of
        transformers 5's ``processor_config.json``) in ``model_dir``.

        Raises:
            ModelLoadError: neither file exists or holds image processor settings.
        """
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
        """``(rows, cols)`` of the tiles :meth:`process` cuts an image of ``size`` = (width,
        height) pixels into ((0, 0): not split, one tile); known without decoding the image,
        so a router can lay out the prompt (:meth:`num_tokens`) from the image's header."""
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
        """Tiles and global image of one loaded image (see the module docstring)."""
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
        """The text that replaces one ``<image>`` placeholder for an image of tile ``grid``
        (rows, cols)."""
        tile = IMAGE_TOKEN * self.image_seq_len
        rows, cols = grid
        text = ""
        if rows or cols:
            for r in range(1, rows + 1):
                text += "".join(f"{FAKE_TOKEN}<row_{r}_col_{c}>{tile}" for c in range(1, cols + 1)) + "\n"
            text += "\n"
        return text + f"{FAKE_TOKEN}{GLOBAL_TOKEN}{tile}{FAKE_TOKEN}"

    def expand(self, text: str, grids: list[tuple[int, int]]) -> str:
        """``text`` with its ``<image>`` placeholders replaced, in order, by the prompts of
        images with tile ``grids`` (:meth:`grid`, or ``(p.rows, p.cols)`` of processed ones).

        Raises:
            ValueError: the number of placeholders differs from ``len(grids)``.
        """
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
    """(width, height) with the longest edge ``longest`` and the other scaled, rounded
    down then up to even, then capped at ``MAX_RESIZED_SIDE`` (transformers'
    ``_resize_output_size_rescale_to_max_len`` then ``..._scale_below_upper_bound``)."""
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
    """(width, height) rounded up to multiples of ``side``, keeping the aspect ratio for
    the short edge first (transformers' ``resize_for_vision_encoder``)."""
    width, height = size
    aspect = width / height
    if width >= height:
        width = math.ceil(width / side) * side
        height = math.ceil(int(width / aspect) / side) * side
    else:
        height = math.ceil(height / side) * side
        width = math.ceil(int(height * aspect) / side) * side
    return width, height
