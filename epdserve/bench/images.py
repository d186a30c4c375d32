"""Seeded synthetic pictures for image workloads, as the bytes and data URLs a client sends.

A trace names each image by size and seed (:class:`epdserve.bench.workload.Request`);
the pixels are drawn here: an 8×8 grid of random colours from the seed, resized bicubically
to the size (smooth colour fields, like an out-of-focus photo) and saved as JPEG, quality
:data:`JPEG_QUALITY`. The same size and seed give the same bytes on every run and for
every configuration compared (with the same Pillow build), so the servers decode and
encode the very same files; different seeds give different bytes, so the content hashes
that key an embedding cache differ.

JPEG rather than PNG because it is what photos are sent as, and it is cheap to make:
about 3 ms and 21 kB for 448×448 on this 2-core machine, against 130 ms and 140 kB
for PNG. The vision tower's cost does not depend on the bytes: every picture is resized
and tiled to the model's input size first.
"""

from __future__ import annotations

import base64
import io
from functools import lru_cache

import numpy as np
from PIL import Image

JPEG_QUALITY = 90
GRID = 8  # random colours per side before resizing


@lru_cache(maxsize=256)  # a sweep re-sends the trace; repeated images are built once
def image_bytes(width: int, height: int, seed: int) -> bytes:
    """The JPEG file of the picture ``seed`` (>= 0) at ``width`` × ``height`` pixels.

    Raises:
        ValueError: a size < 1 or a negative seed.
    """
    if width < 1 or height < 1 or seed < 0:
        raise ValueError(f"image {width}x{height} seed {seed}: need sizes >= 1 and seed >= 0")
    rng = np.random.default_rng(seed)
    grid = rng.integers(0, 256, size=(GRID, GRID, 3), dtype=np.uint8)
    picture = Image.fromarray(grid, "RGB").resize((width, height), Image.BICUBIC)
    out = io.BytesIO()
    picture.save(out, format="JPEG", quality=JPEG_QUALITY)
    return out.getvalue()


def data_url(image: dict) -> str:
    """``data:image/jpeg;base64,...`` of a trace image ``{"width", "height", "seed"}``
    (the form OpenAI's ``image_url`` content part takes).

    Raises:
        ValueError: as :func:`image_bytes`.
    """
    data = image_bytes(image["width"], image["height"], image["seed"])
    return "data:image/jpeg;base64," + base64.b64encode(data).decode("ascii")
