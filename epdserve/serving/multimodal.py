"""The images of an OpenAI chat request: content parts → checked image bytes, and the
message text with an ``<image>`` placeholder where each image was.

Accepted, as OpenAI and vLLM do: a content part ``{"type": "image_url", "image_url":
{"url": URL, "detail": "auto"|"low"|"high"}}`` or vLLM's short form ``"image_url": URL``,
where URL is

* a ``data:image/<png|jpeg|webp|gif|bmp>;base64,...`` URL (strict base64);
* a local file, ``file:///abs/path`` or ``/abs/path``, only inside
  :attr:`MediaOptions.allowed_local_dir` (vLLM's ``--allowed-local-media-path``; default:
  refused);
* an ``http(s)://`` URL, only with :attr:`MediaOptions.allow_remote` (default: refused),
  fetched with httpx under a time and byte limit. Enabling it lets clients make the
  server fetch any address it can reach (internal ones included).

Every failure raises :class:`~epdserve.serving.openai_api.APIError` (HTTP 400) whose
``param`` names the offending field, e.g. ``messages[0].content[1].image_url``.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import os
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlsplit

from PIL import Image

from epdserve.model.image_processor import IMAGE_TOKEN, MAX_IMAGE_BYTES, ImageError, load_image
from epdserve.serving.openai_api import APIError

DEFAULT_MAX_IMAGES = 8
MEDIA_TYPES = ("image/png", "image/jpeg", "image/jpg", "image/webp", "image/gif", "image/bmp")
DETAILS = ("auto", "low", "high")  # OpenAI's; accepted and ignored, as vLLM does


@dataclass(frozen=True)
class MediaOptions:
    """What a server accepts. ``max_images``: images per request (vLLM's
    ``--limit-mm-per-prompt``); ``max_image_bytes``: encoded bytes per image;
    ``max_image_pixels``: width × height per image (None: Pillow's
    ``Image.MAX_IMAGE_PIXELS``); ``allowed_local_dir``: the directory local files may be
    read from (None: none); ``allow_remote``: fetch http(s) URLs; ``fetch_timeout_s``:
    the whole fetch of one remote image, in seconds."""

    max_images: int = DEFAULT_MAX_IMAGES
    max_image_bytes: int = MAX_IMAGE_BYTES
    max_image_pixels: int | None = None
    allowed_local_dir: str | Path | None = None
    allow_remote: bool = False
    fetch_timeout_s: float = 10.0


@dataclass(frozen=True)
class ImageInput:
    """One image of a request.

    ``content_hash`` is the sha256 hex digest of ``data``, the encoded file bytes (after
    base64 decoding), not of the decoded pixels: it is known before any decoding, so an
    encode worker can find cached embeddings without decoding, and equal bytes always
    decode to equal pixels, so it never joins two different images (a hash of raw pixels
    would also need the mode, size, palette and transparency to be safe). The price: the
    same picture saved twice in different files is encoded twice.

    ``image`` is the decoded Pillow image, or None where only the bytes travelled (an
    encode worker decodes on a cache miss). ``source`` says where it came from, for logs
    (``data:image/png``, ``file:/abs/path``, ``https://...``; never the bytes).
    """

    content_hash: str
    data: bytes
    source: str
    image: Image.Image | None = None

    @classmethod
    def from_bytes(cls, data: bytes, source: str, *, decode: bool = True, max_bytes: int = MAX_IMAGE_BYTES,
                   max_pixels: int | None = None) -> "ImageInput":
        """Hash ``data`` and, with ``decode``, decode it under the limits of
        :func:`~epdserve.model.image_processor.load_image`.

        Raises:
            ImageError: as ``load_image`` (with ``decode``).
        """
        image = load_image(data, max_bytes, max_pixels) if decode else None
        return cls(hashlib.sha256(data).hexdigest(), data, source, image)


def parse_chat_images(messages: list[dict],
                      options: MediaOptions = MediaOptions()) -> tuple[list[dict], list[ImageInput]]:
    """Take the images out of chat ``messages`` (request JSON: dicts with ``role`` and
    ``content``, a string or a list of content parts).

    Returns the messages with each ``content`` a string, ready for the chat template
    (parts joined with newlines, as text parts are without images; each image part
    becomes one ``<image>`` placeholder for ``ImageProcessor.expand``; other keys kept),
    and the images in prompt order. Blocking (file reads, fetches, decoding): an async
    server calls it in a thread.

    Raises:
        APIError: 400 with ``param``: a malformed part, text containing ``<image>``
            itself, more than ``max_images`` images, a refused or unreadable URL, an
            image over a limit, or bytes that are not a supported image.
    """
    parts = []  # (param, image_url value) of every image part, in order
    out = []
    for i, message in enumerate(messages):
        content = message.get("content")
        if content is None or isinstance(content, str):
            _check_text(content or "", f"messages[{i}].content")
            out.append({**message, "content": content or ""})
            continue
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
        out.append({**message, "content": "\n".join(texts)})
    # Counted before anything is read or decoded.
    if len(parts) > options.max_images:
        raise APIError(f"{len(parts)} images in the request, more than the limit of {options.max_images}",
                       param="messages")
    return out, [_image(param, value, options) for param, value in parts]


def _check_text(text: str, param: str) -> None:
    # The tokenizer turns a literal <image> into the image token, which would then have
    # no embedding (or take another image's).
    if IMAGE_TOKEN in text:
        raise APIError(f"text may not contain the image placeholder {IMAGE_TOKEN}; send images as image_url parts",
                       param=param)


def _image(param: str, value, options: MediaOptions) -> ImageInput:
    if isinstance(value, dict):
        if value.get("detail", "auto") not in DETAILS:
            raise APIError(f"detail must be one of {', '.join(DETAILS)}, got {value['detail']!r}",
                           param=param + ".detail")
        value = value.get("url")
    if not isinstance(value, str):
        raise APIError("image_url must be a URL string or an object with a string 'url'", param=param)
    try:
        data, source = _read(value, param, options)
        return ImageInput.from_bytes(data, source, max_bytes=options.max_image_bytes,
                                     max_pixels=options.max_image_pixels)
    except ImageError as exc:
        raise APIError(f"{source}: {exc}", param=param) from None


def _read(url: str, param: str, options: MediaOptions) -> tuple[bytes, str]:
    """The bytes behind ``url`` and its short ``source`` name."""
    if url.startswith("data:"):
        return _data_url(url, param)
    if url.startswith(("http://", "https://")):
        if not options.allow_remote:
            raise APIError("http(s) image URLs are disabled on this server; send the image as a"
                           " data:image/...;base64 URL", param=param)
        return _fetch(url, param, options), url.split("?", 1)[0]
    if url.startswith("file:"):
        split = urlsplit(url)
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
    except binascii.Error as exc:
        raise APIError(f"invalid base64 in data URL: {exc}", param=param) from None
    return data, f"data:{media_type.lower()}"


def _local_file(path: str, param: str, options: MediaOptions) -> bytes:
    if options.allowed_local_dir is None:
        raise APIError("local image files are disabled on this server (no allowed local media directory)",
                       param=param)
    root = Path(options.allowed_local_dir).resolve()
    # resolve() folds '..' and follows symlinks, so neither can lead out of the root.
    resolved = Path(path).resolve()
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
                # httpx's timeout is per read; a server dripping bytes must not hold us longer.
                if time.monotonic() > deadline:
                    raise APIError(f"fetching {url} took over {options.fetch_timeout_s:g} s", param=param)
    except httpx.HTTPError as exc:
        # First line only: httpx appends a documentation link to status errors.
        raise APIError(f"cannot fetch image {url}: {str(exc).splitlines()[0]}", param=param) from None
    return bytes(data)


class ImagePrompter:
    """Lays out chat requests with images for the SmolVLM / Idefics3 model in
    ``model_dir``: the chat template's text with each ``<image>`` placeholder expanded to
    its tiles' tokens (the tile grid comes from the image size, as the encoder will cut
    it), tokenized, and the images as :class:`~epdserve.serving.protocol.ImageRef` with
    their bytes. ``embedding_shape``: what an encode worker's layout must match.

    Raises (constructor): ``ModelLoadError``: no vision config or image processor settings.
    """

    def __init__(self, model_dir: str | Path, tokenizer, media: MediaOptions):
        from epdserve.model.image_processor import ImageProcessor
        from epdserve.model.vision import VisionConfig, read_config
        from epdserve.transfer.embedding import KIND

        config = VisionConfig.from_dict(read_config(model_dir))
        self.processor = ImageProcessor.from_dir(model_dir, config.tokens_per_image)
        self.tokenizer = tokenizer
        self.media = media
        self.embedding_shape = {"kind": KIND, "hidden_size": config.text_hidden_size}

    def prompt(self, messages: list[dict]) -> tuple[list[int], list]:
        """``(prompt token ids, [ImageRef])`` of chat ``messages`` (request JSON). Blocking.

        Raises:
            APIError: 400, as :func:`parse_chat_images`, or the chat template fails.
        """
        from epdserve.model.tokenizer import chat_prompt_text
        from epdserve.serving.protocol import ImageRef

        messages, images = parse_chat_images(messages, self.media)
        grids = [self.processor.grid(image.image.size) for image in images]
        try:
            text = chat_prompt_text(self.tokenizer, messages)
        except ValueError as exc:
            raise APIError(str(exc), param="messages") from None
        ids = self.tokenizer(self.processor.expand(text, grids), add_special_tokens=False).input_ids
        return ids, [ImageRef(hash=image.content_hash, tokens=self.processor.num_tokens(grid), data=image.data)
                     for image, grid in zip(images, grids)]
