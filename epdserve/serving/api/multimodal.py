"""The images of an OpenAI chat request: content parts → checked image bytes, and the message
text with an ``<image>`` placeholder where each image was. The router needs only each image's
size and that it decodes (the encoding worker decodes it again), so it checks one image at a
time, keeping no pixels (accepted forms and limits: docs/serving.md Images, docs/security.md).
"""

from __future__ import annotations

import base64
import ctypes
import hashlib
import os
import re
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlsplit

from PIL import Image

from epdserve.model.image_processor import (FAKE_TOKEN, GLOBAL_TOKEN, IMAGE_TOKEN, MAX_GRID,
                                            MAX_IMAGE_BYTES, ImageError, ImageInput, ImageProcessor, decoded_bytes,
                                            load_pixels, open_image, reduce_for_check)
from epdserve.model.tokenizer import chat_prompt_text
from epdserve.model.vision import VisionConfig, read_config
from epdserve.serving.protocol import ImageRef
from epdserve.transfer.embedding import KIND
from epdserve.serving.api.errors import APIError

DEFAULT_MAX_IMAGES = 8
MEDIA_TYPES = ("image/png", "image/jpeg", "image/jpg", "image/webp", "image/gif", "image/bmp")
DETAILS = ("auto", "low", "high")  # OpenAI's; accepted and ignored, as vLLM does
# Refused in client text: a stray <image> has no embedding (or takes another's), layout tokens fake a grid.
IMAGE_TOKENS = re.compile("|".join(re.escape(t) for t in [IMAGE_TOKEN, FAKE_TOKEN, GLOBAL_TOKEN] + [
    f"<row_{r}_col_{c}>" for r in range(1, MAX_GRID + 1) for c in range(1, MAX_GRID + 1)]))
TRIM_AFTER_BYTES = 16 * 1024 * 1024  # Pillow's block size: smaller decodes are not worth a malloc_trim


@dataclass(frozen=True)
class MediaOptions:
    """``max_request_decoded_bytes``: a request's images at full size (w x h x bytes per pixel: eight
    12 MP photos take 384 MiB); ``max_decoding_bytes``: this process's checks at once, all requests
    (an image over it decodes alone); past ``decode_wait_s`` waiting for it, 503."""

    max_images: int = DEFAULT_MAX_IMAGES
    max_image_bytes: int = MAX_IMAGE_BYTES  # encoded, per image
    max_image_pixels: int | None = None  # w x h; None: Pillow's Image.MAX_IMAGE_PIXELS (89.5 M)
    max_request_decoded_bytes: int = 1 << 30
    max_decoding_bytes: int = 1 << 30
    decode_wait_s: float = 10.0
    allowed_local_dir: str | Path | None = None  # None: local files refused
    allow_remote: bool = False
    fetch_timeout_s: float = 10.0  # the whole fetch of one image


def parse_chat_images(messages: list[dict],
                      options: MediaOptions = MediaOptions()) -> tuple[list[dict], list[ImageInput]]:
    """Messages with ``content`` a string (parts joined by newlines, an ``<image>`` per image), and
    the images in prompt order, checked, not kept decoded. Blocking: call it in a thread.

    Raises APIError with ``param``: 400 a bad message, part, URL, image or text (an image token,
    a lone surrogate), over ``max_images``; 413 over ``max_request_decoded_bytes``; 503 no decode room.
    """
    parts = []  # (param, image_url value) of every image part, in order
    out = [_flat_message(i, message, parts) for i, message in enumerate(messages)]
    if len(parts) > options.max_images:
        raise APIError(f"{len(parts)} images in the request, more than the limit of {options.max_images}",
                       param="messages")
    # Every header before any pixel: a request over the budget is refused undecoded.
    opened = [(param, *_open(param, value, options)) for param, value in parts]
    total = 0
    for param, _, source, image in opened:
        total += decoded_bytes(image)
        if total > options.max_request_decoded_bytes:
            raise APIError(f"{source}: a {image.width}x{image.height} {image.mode} image takes {decoded_bytes(image)}"
                           f" bytes decoded, bringing the request's images to {total} bytes, over the limit of"
                           f" {options.max_request_decoded_bytes} bytes per request", status=413, param=param)
    return out, [_checked(*item, options) for item in opened]


def _flat_message(i: int, message, parts: list) -> dict:
    if not isinstance(message, dict):
        raise APIError("a message must be an object", param=f"messages[{i}]")
    for key in ("role", "name"):
        if key in message and (key == "role" or message[key] is not None):
            if not isinstance(message[key], str):
                raise APIError(f"{key} must be a string", param=f"messages[{i}].{key}")
            _check_text(message[key], f"messages[{i}].{key}", f"a {key}")
    content = message.get("content")
    if content is None or isinstance(content, str):
        _check_text(content or "", f"messages[{i}].content")
        return {**message, "content": content or ""}
    if not isinstance(content, list):
        raise APIError("content must be a string or a list of content parts", param=f"messages[{i}].content")
    texts = []
    for j, part in enumerate(content):
        param = f"messages[{i}].content[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text":
            if not isinstance(part.get("text"), str):
                raise APIError("a text part needs a string 'text'", param=param + ".text")
            _check_text(part["text"], param + ".text")
            texts.append(part["text"])
        elif kind == "image_url":
            parts.append((param + ".image_url", part.get("image_url")))
            texts.append(IMAGE_TOKEN)
        else:
            raise APIError(f"unsupported content part type {kind!r} (supported: text, image_url)",
                           param=param + ".type")
    return {**message, "content": "\n".join(texts)}


def _check_text(text: str, param: str, what: str = "text") -> None:
    found = IMAGE_TOKENS.search(text)
    if found:
        raise APIError(f"{what} may not contain the image placeholder {IMAGE_TOKEN} or another image token"
                       f" (found {found.group()}); send images as image_url parts", param=param)
    if not _is_unicode(text):
        raise APIError(f"{what} is not valid Unicode: it contains a lone surrogate (an unpaired \\ud800-\\udfff"
                       " escape)", param=param)


def _is_unicode(text: str) -> bool:
    # a JSON lone surrogate ("\ud800") cannot be UTF-8: the tokenizer and the error body would fail
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _open(param: str, value, options: MediaOptions) -> tuple[bytes, str, Image.Image]:
    """``(bytes, source, header-only Pillow image)``."""
    if isinstance(value, dict):
        if value.get("detail", "auto") not in DETAILS:
            raise APIError(f"detail must be one of {', '.join(DETAILS)}, got {value['detail']!r}",
                           param=param + ".detail")
        value = value.get("url")
    if not isinstance(value, str):
        raise APIError("image_url must be a URL string or an object with a string 'url'", param=param)
    if not _is_unicode(value):
        raise APIError("image URL is not valid Unicode: it contains a lone surrogate", param=param)
    data, source = _read(value, param, options)
    try:
        return data, source, open_image(data, options.max_image_bytes, options.max_image_pixels)
    except ImageError as exc:
        raise APIError(f"{source}: {exc}", param=param) from None


def _checked(param: str, data: bytes, source: str, image: Image.Image, options: MediaOptions) -> ImageInput:
    """Decoded (reduced where the format allows) within the process-wide budget, then dropped."""
    size = image.size
    reduce_for_check(image)
    cost = decoded_bytes(image)  # at the reduced size: what this check holds
    if not _DECODING.acquire(cost, options.max_decoding_bytes, options.decode_wait_s):
        raise APIError(f"the server is busy decoding other images: no room for this one ({cost} bytes) in its"
                       f" {options.max_decoding_bytes} byte decode budget within {options.decode_wait_s:g} s;"
                       " retry later", status=503, type="service_unavailable", param=param)
    try:
        load_pixels(image)
    except ImageError as exc:
        raise APIError(f"{source}: {exc}", param=param) from None
    finally:
        image.close()  # frees the pixels now, not when the request's list of images goes
        _DECODING.release(cost)
        if cost >= TRIM_AFTER_BYTES:
            _trim()
    return ImageInput(hashlib.sha256(data).hexdigest(), data, source, size=size)


def _read(url: str, param: str, options: MediaOptions) -> tuple[bytes, str]:
    if url.startswith("data:"):
        return _data_url(url, param)
    if url.startswith(("http://", "https://")):
        if not options.allow_remote:
            raise APIError("http(s) image URLs are disabled on this server; send the image as a"
                           " data:image/...;base64 URL", param=param)
        return _fetch(url, param, options), url.split("?", 1)[0]
    if url.startswith("file:"):
        try:
            split = urlsplit(url)
        except ValueError:  # e.g. an unclosed [ in the host
            raise APIError("invalid file URL", param=param) from None
        if split.netloc not in ("", "localhost"):
            raise APIError(f"file URL on another host {split.netloc!r}", param=param)
        path = unquote(split.path)
    elif url.startswith("/"):
        path = url
    else:
        raise APIError("image URL must be a data:, file: or http(s): URL or an absolute path", param=param)
    return _local_file(path, param, options), f"file:{path}"


def _data_url(url: str, param: str) -> tuple[bytes, str]:
    meta, sep, payload = url[len("data:"):].partition(",")
    media_type, *attrs = meta.split(";")
    if not sep or attrs[-1:] != ["base64"]:
        raise APIError("data URL must be data:<media type>;base64,<data>", param=param)
    if media_type.lower() not in MEDIA_TYPES:
        raise APIError(f"unsupported image media type {media_type!r} (supported: {', '.join(MEDIA_TYPES)})",
                       param=param)
    try:
        data = base64.b64decode(payload, validate=True)
    except ValueError as exc:  # binascii.Error, or non-ASCII characters
        raise APIError(f"invalid base64 in data URL: {exc}", param=param) from None
    return data, f"data:{media_type.lower()}"


def _local_file(path: str, param: str, options: MediaOptions) -> bytes:
    if options.allowed_local_dir is None:
        raise APIError("local image files are disabled on this server (no allowed local media directory)",
                       param=param)
    if "\0" in path:
        raise APIError("image path contains a NUL byte", param=param)
    root = Path(options.allowed_local_dir).resolve()
    # resolve() folds '..' and follows symlinks, so neither can lead out of the root.
    try:
        resolved = Path(path).resolve()
    except (OSError, RuntimeError):  # RuntimeError: a symlink loop
        raise APIError(f"cannot resolve image path {path}", param=param) from None
    if not resolved.is_relative_to(root):
        raise APIError(f"image file {path} is outside the allowed local media directory {root}", param=param)
    try:
        with open(resolved, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size > options.max_image_bytes:
                raise APIError(f"image file {path} is {size} bytes, over the limit of {options.max_image_bytes} bytes",
                               param=param)
            return f.read()
    except OSError as exc:
        raise APIError(f"cannot read image file {path}: {exc.strerror}", param=param) from None


def _fetch(url: str, param: str, options: MediaOptions) -> bytes:
    import httpx

    deadline = time.monotonic() + options.fetch_timeout_s
    data = bytearray()
    try:
        with httpx.stream("GET", url, timeout=options.fetch_timeout_s, follow_redirects=True) as response:
            response.raise_for_status()
            for chunk in response.iter_bytes():
                data += chunk
                if len(data) > options.max_image_bytes:
                    raise APIError(f"image at {url} is over the limit of {options.max_image_bytes} bytes",
                                   param=param)
                # httpx's timeout is per read: a server dripping bytes must not hold us longer
                if time.monotonic() > deadline:
                    raise APIError(f"fetching {url} took over {options.fetch_timeout_s:g} s", param=param)
    except httpx.InvalidURL:  # not an HTTPError
        raise APIError(f"invalid image URL {url}", param=param) from None
    except httpx.HTTPError as exc:
        # First line only: httpx appends a documentation link to status errors.
        raise APIError(f"cannot fetch image {url}: {str(exc).splitlines()[0]}", param=param) from None
    return bytes(data)


class _BytesInFlight:
    """Decoded bytes held by this process's image checks, all threads and requests."""

    def __init__(self):
        self.held = 0
        self._cond = threading.Condition()

    def acquire(self, n: int, limit: int, timeout_s: float) -> bool:
        """False after ``timeout_s`` seconds without room (alone, any ``n`` fits). A thread holds one
        image at a time, so waits cannot deadlock."""
        with self._cond:
            if not self._cond.wait_for(lambda: self.held == 0 or self.held + n <= limit, timeout_s):
                return False
            self.held += n
            return True

    def release(self, n: int) -> None:
        with self._cond:
            self.held -= n
            self._cond.notify_all()


_DECODING = _BytesInFlight()


def _load_malloc_trim():
    try:
        return ctypes.CDLL(None).malloc_trim  # glibc only
    except (OSError, AttributeError):
        return None


_malloc_trim = _load_malloc_trim()


def _trim() -> None:
    """glibc's ``malloc_trim`` (~0.1 ms; no-op elsewhere): its per-thread heaps keep Pillow's freed
    16 MiB blocks while other allocations sit above them (``benchmarks/image_memory.py``)."""
    if _malloc_trim is not None:
        _malloc_trim(0)


class ImagePrompter:
    """Chat prompts with images for a SmolVLM / Idefics3 model: each ``<image>`` expanded to its
    tiles' tokens. Raises ``ModelLoadError`` (constructor): no vision config or processor settings."""

    def __init__(self, model_dir: str | Path, tokenizer, media: MediaOptions):
        config = VisionConfig.from_dict(read_config(model_dir))
        self.processor = ImageProcessor.from_dir(model_dir, config.tokens_per_image)
        self.tokenizer = tokenizer
        self.media = media
        self.embedding_shape = {"kind": KIND, "hidden_size": config.text_hidden_size}

    def prompt(self, messages: list[dict], add_special_tokens: bool = False, **template) -> tuple[list[int], list]:
        """Blocking. Raises APIError as :func:`parse_chat_images`; 400 the template failed; 500 its
        output holds other ``<image>`` placeholders than the images' (client text cannot)."""
        messages, images = parse_chat_images(messages, self.media)
        grids = [self.processor.grid(image.size) for image in images]
        try:
            text = chat_prompt_text(self.tokenizer, messages, **template)
        except ValueError as exc:
            raise APIError(str(exc), param="messages") from None
        try:
            text = self.processor.expand(text, grids)
        except ValueError as exc:
            raise APIError(f"the chat template's output does not match the images: {exc}", status=500,
                           type="internal_server_error") from None
        ids = self.tokenizer(text, add_special_tokens=add_special_tokens).input_ids
        return ids, [ImageRef(hash=image.content_hash, tokens=self.processor.num_tokens(grid), data=image.data)
                     for image, grid in zip(images, grids)]
