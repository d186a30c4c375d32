"""Image embeddings as one wire frame: ``embeddings [tokens, hidden]`` (a float dtype, prompt order),
``num_tokens`` = tokens, ``layout`` = ``{"kind": "image_embeddings", "hidden_size", "images": [{"hash",
"tokens", "rows", "cols", "encode_ms"}]}``; the receiver always checks it with :func:`unpack`."""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from epdserve.engine.encoder import EncodedImage
from epdserve.transfer import shm, wire
from epdserve.transfer.wire import TensorHeader, TensorSpec, WireError

KIND = "image_embeddings"
_FLOAT_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


class _Image(BaseModel):
    model_config = ConfigDict(extra="forbid")

    hash: str
    tokens: int = Field(ge=1)
    rows: int = Field(ge=0)
    cols: int = Field(ge=0)
    encode_ms: float = Field(ge=0)


class _Layout(BaseModel):
    model_config = ConfigDict(extra="forbid")

    kind: Literal["image_embeddings"]
    hidden_size: int = Field(ge=1)
    images: list[_Image]


def header(images: list[EncodedImage]) -> TensorHeader:
    """One request's images, in prompt order. Raises ValueError: none, or not 2-D of one float dtype and width."""
    if not images:
        raise ValueError("an embedding frame needs at least one image")
    first = images[0].embeddings
    if any(im.embeddings.dim() != 2 or im.embeddings.dtype != first.dtype
           or im.embeddings.shape[1] != first.shape[1] for im in images) or first.dtype not in _FLOAT_NAMES:
        raise ValueError("image embeddings must all be [tokens, hidden] of one float dtype and hidden size, got "
                         + ", ".join(f"{im.embeddings.dtype} {list(im.embeddings.shape)}" for im in images))
    layout = _Layout(kind=KIND, hidden_size=first.shape[1], images=[
        _Image(hash=im.content_hash, tokens=len(im.embeddings), rows=im.rows, cols=im.cols, encode_ms=im.encode_ms)
        for im in images])
    tokens = sum(len(im.embeddings) for im in images)
    return TensorHeader(tensors=[TensorSpec(name="embeddings", dtype=_FLOAT_NAMES[first.dtype],
                                            shape=[tokens, first.shape[1]])],
                        num_tokens=tokens, layout=layout.model_dump())


def _fill(images: list[EncodedImage]):
    def fill(tensors: dict[str, torch.Tensor]) -> None:
        torch.cat([im.embeddings for im in images], out=tensors["embeddings"])
    return fill


def pack(images: list[EncodedImage]) -> bytearray:
    """``images`` as one frame in memory (to send over TCP). Raises as :func:`header`."""
    return wire.pack(header(images), _fill(images))


def write_segment(images: list[EncodedImage]) -> tuple[str, int]:
    """For a reader on this host (``shm.read``; never read: ``shm.remove``). Returns (name, bytes). Raises
    ValueError as :func:`header`, OSError (/dev/shm)."""
    name = shm.new_name()
    return name, shm.write(name, header(images), _fill(images))


def unpack(frame_header: TensorHeader, tensors: dict[str, torch.Tensor], hidden_size: int,
           hashes: list[str]) -> list[EncodedImage]:
    """Checked against ``hidden_size`` and ``hashes`` (in order); the embeddings view the frame (no copy), in the
    sender's dtype. Raises WireError: not an embedding frame, or a width, image list, dtype or shape mismatch."""
    try:
        layout = _Layout.model_validate(frame_header.layout)
    except ValidationError as exc:
        raise WireError(f"not an image embedding frame: {exc}") from None
    if layout.hidden_size != hidden_size:
        raise WireError(f"embeddings are {layout.hidden_size} wide, this model's hidden size is {hidden_size}")
    if [im.hash for im in layout.images] != hashes:
        raise WireError(f"frame holds images {[im.hash[:12] for im in layout.images]},"
                        f" expected {[h[:12] for h in hashes]}")
    tokens = sum(im.tokens for im in layout.images)
    embeddings = tensors.get("embeddings")
    if set(tensors) != {"embeddings"} or embeddings.dtype not in _FLOAT_NAMES:
        raise WireError(f"an embedding frame holds one float tensor 'embeddings', not {sorted(tensors)}"
                        f" ({', '.join(str(t.dtype) for t in tensors.values())})")
    if list(embeddings.shape) != [tokens, hidden_size] or frame_header.num_tokens != tokens:
        raise WireError(f"embeddings {list(embeddings.shape)} (num_tokens {frame_header.num_tokens}) do not match"
                        f" the layout's {tokens} tokens of width {hidden_size}")
    chunks = embeddings.split([im.tokens for im in layout.images])
    return [EncodedImage(im.hash, chunk, im.rows, im.cols, im.encode_ms) for im, chunk in zip(layout.images, chunks)]
