"""Request traces: the :class:`Request` record, saving and loading traces as JSON lines
(one request per line, so that a run can be replayed exactly) and their summary
(:func:`describe`).

A trace is a list of :class:`Request` — send time after the start of the run
(``offset_s``, seconds), prompt text, ``max_tokens``, ``kind`` ("chat" or "long"), the
prompt length in tokens it was built to have (``prompt_tokens``, counted on the text
content alone with the model's tokenizer; the server adds its chat-template tokens on
top), and the images it carries (``images``: size and picture seed, for EPD workloads;
the client draws the pixels, :mod:`epdserve.bench.images`).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

KINDS = ("chat", "long")


class TraceError(ValueError):
    """A trace file or workload setting that cannot be used; the message names it."""


@dataclass(frozen=True)
class Request:
    """One request of a trace.

    ``offset_s``: send time in seconds after the start of the run; ``prompt``: the user
    message text; ``max_tokens``: tokens to generate; ``kind``: "chat" or "long";
    ``prompt_tokens``: token count of ``prompt`` aimed for (text only, no template);
    ``images``: one ``{"width": W, "height": H, "seed": S}`` per image sent with the
    prompt (pixels; S >= 0 picks the picture, :func:`epdserve.bench.images.image_bytes`:
    equal seed and size give equal bytes, so a repeated seed is a repeated image), empty
    for text-only requests.
    """

    offset_s: float
    prompt: str
    max_tokens: int
    kind: str
    prompt_tokens: int
    images: tuple[dict, ...] = ()


def save_trace(requests: list[Request], path: str | Path) -> None:
    """Write ``requests`` to ``path`` as JSON lines (one request object per line)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for r in requests:
            f.write(json.dumps(asdict(r), ensure_ascii=False) + "\n")


def load_trace(path: str | Path) -> list[Request]:
    """Read a JSON-lines trace written by :func:`save_trace` (blank lines skipped).

    Raises:
        TraceError: missing file, or a line that is not a valid request (names file:line).
    """
    path = Path(path)
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise TraceError(f"trace file {path}: {exc.strerror or exc}") from None
    requests, num_images = [], 0
    for num, line in enumerate(lines, 1):
        if line.strip():
            requests.append(_parse_request(line, f"{path}:{num}", num_images))
            num_images += len(requests[-1].images)
    if not requests:
        raise TraceError(f"trace file {path}: no requests")
    return requests


def _parse_request(line: str, where: str, images_before: int = 0) -> Request:
    """One trace line. An image without a ``seed`` (a trace written before seeds
    existed) gets its number in the trace, ``images_before`` + its position, as
    :func:`epdserve.bench.datasets.with_images` numbers images without repeats."""
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        raise TraceError(f"{where}: not valid JSON ({exc.msg})") from None
    if not isinstance(obj, dict):
        raise TraceError(f"{where}: expected a JSON object")
    fields = {"offset_s": (int, float), "prompt": str, "max_tokens": int, "kind": str,
              "prompt_tokens": int}
    for name, types in fields.items():
        value = obj.get(name)
        if value is None:
            raise TraceError(f"{where}: missing field {name!r}")
        if not isinstance(value, types) or isinstance(value, bool):
            raise TraceError(f"{where}: field {name!r} has the wrong type ({value!r})")
    if not (math.isfinite(obj["offset_s"]) and obj["offset_s"] >= 0):
        raise TraceError(f"{where}: offset_s {obj['offset_s']!r} must be finite and >= 0")
    if obj["max_tokens"] < 1:
        raise TraceError(f"{where}: max_tokens {obj['max_tokens']} must be >= 1")
    if obj["kind"] not in KINDS:
        raise TraceError(f"{where}: kind {obj['kind']!r} must be one of {', '.join(KINDS)}")
    images = obj.get("images", [])
    if not isinstance(images, list) or not all(_is_image(x) for x in images):
        raise TraceError(f"{where}: field 'images' must be a list of "
                         f'{{"width": W, "height": H, "seed": S}} with W, H >= 1 and S >= 0 '
                         f"(seed optional) ({images!r})")
    return Request(offset_s=float(obj["offset_s"]), prompt=obj["prompt"],
                   max_tokens=obj["max_tokens"], kind=obj["kind"],
                   prompt_tokens=obj["prompt_tokens"],
                   images=tuple({"width": x["width"], "height": x["height"],
                                 "seed": x.get("seed", images_before + k)}
                                for k, x in enumerate(images)))


def _is_int(v, least: int) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= least


def _is_image(x) -> bool:
    return (isinstance(x, dict) and _is_int(x.get("width"), 1) and _is_int(x.get("height"), 1)
            and ("seed" not in x or _is_int(x["seed"], 0)))


def describe(requests: list[Request]) -> dict:
    """Summary of a trace: counts, token totals and ranges per kind, arrival window (s),
    and, when any request carries an image, the number of images and of distinct ones
    (size and seed)."""
    out: dict = {"num_requests": len(requests),
                 "duration_of_arrivals_s": round(max(r.offset_s for r in requests), 3)}
    num_images = sum(len(r.images) for r in requests)
    if num_images:
        out["num_images"] = num_images
        out["distinct_images"] = len({tuple(sorted(x.items())) for r in requests
                                      for x in r.images})
    for kind in KINDS:
        sel = [r for r in requests if r.kind == kind]
        if sel:
            out[kind] = {
                "count": len(sel),
                "prompt_tokens": [min(r.prompt_tokens for r in sel),
                                  max(r.prompt_tokens for r in sel)],
                "max_tokens": [min(r.max_tokens for r in sel), max(r.max_tokens for r in sel)],
                "total_prompt_tokens": sum(r.prompt_tokens for r in sel),
                "total_max_tokens": sum(r.max_tokens for r in sel),
                "offsets_s": [round(r.offset_s, 3) for r in sel] if kind == "long" else None,
            }
            if out[kind]["offsets_s"] is None:
                del out[kind]["offsets_s"]
    return out
