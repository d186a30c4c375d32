"""Request traces: the :class:`Request` record and traces saved and loaded as JSON lines, one
request a line, so a run can be replayed exactly."""

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
    """``offset_s``: send time, s after the run's start; ``prompt_tokens``: the text's own count
    (the server adds its chat template); ``images``: ``{"width", "height", "seed"}`` each (pixels;
    equal seed and size give equal bytes), empty for text."""

    offset_s: float
    prompt: str
    max_tokens: int
    kind: str
    prompt_tokens: int
    images: tuple[dict, ...] = ()


def save_trace(requests: list[Request], path: str | Path) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for r in requests:
            f.write(json.dumps(asdict(r), ensure_ascii=False) + "\n")


def load_trace(path: str | Path) -> list[Request]:
    """Raises TraceError for a missing file or a bad line (naming file:line)."""
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
    """An image without ``seed`` (an older trace) gets its number in the trace, as
    :func:`epdserve.bench.datasets.with_images` numbers them."""
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
    """Counts, token totals and ranges per kind, arrival window (s), and image counts."""
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
