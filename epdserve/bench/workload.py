"""Request traces: what to send, and when.

A trace is a list of :class:`Request` — send time after the start of the run
(``offset_s``, seconds), prompt text, ``max_tokens``, ``kind`` ("chat" or "long"), the
prompt length in tokens it was built to have (``prompt_tokens``, counted on the text
content alone with the model's tokenizer; the server adds its chat-template tokens on
top), and the images it carries (``images``: size and picture seed, for EPD workloads;
the client draws the pixels, :mod:`epdserve.bench.images`). Every
generator is seeded and deterministic: the same arguments and tokenizer give the same
trace, byte for byte.

Generators (:mod:`epdserve.bench.datasets`): synthetic chat, shared prefixes, chat with
long-prompt bursts (the demo), ShareGPT files; their lengths come from
:func:`draw_lengths` (uniform over an inclusive range, or a normal or lognormal clipped to
it, or fixed).

Arrivals (:func:`arrival_offsets`, vLLM ``bench serve`` semantics): gamma-distributed
gaps with mean 1/rate and shape ``burstiness`` (1 = Poisson), optionally with the rate
rising linearly from request to request (vLLM's linear ramp-up); rate ``inf`` sends
everything at t = 0. A cap on requests in flight is the client's (``--max-concurrency``).

Traces are saved and loaded as JSON lines, one request per line (:func:`save_trace`,
:func:`load_trace`), so a run can be replayed exactly; :func:`retime` re-spaces a trace
for another rate (the goodput sweep).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np

from epdserve.argtypes import int_at_least

KINDS = ("chat", "long")
LENGTH_DISTRIBUTIONS = ("uniform", "normal", "lognormal")


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


# ---------------------------------------------------------------------------------------
# Prompt text with an exact token count


def word_list(tokenizer, max_words: int = 5000) -> list[str]:
    """Common lowercase words of ``tokenizer``'s vocabulary, in id order (for BPE
    vocabularies, roughly most frequent first): tokens that decode to a space followed by
    3–10 ascii letters, so that ``" ".join(words)`` is about one token per word."""
    words: list[str] = []
    seen: set[str] = set()
    for token_id in range(len(tokenizer)):
        text = tokenizer.decode([token_id])
        word = text[1:]
        if (text.startswith(" ") and 3 <= len(word) <= 10 and word.isascii()
                and word.isalpha() and word.islower() and word not in seen):
            seen.add(word)
            words.append(word)
            if len(words) >= max_words:
                break
    if len(words) < 100:
        raise TraceError("tokenizer has too few plain word tokens to build prompts")
    return words


def count_tokens(tokenizer, text: str) -> int:
    """Tokens in ``text`` alone (no special tokens, no chat template)."""
    return len(tokenizer.encode(text, add_special_tokens=False))


def make_prompt(tokenizer, words: list[str], num_tokens: int, rng: np.random.Generator) -> str:
    """Random words from ``words`` whose text tokenizes to exactly ``num_tokens`` tokens.

    Draws ``num_tokens`` words, then drops or appends words until the count is exact
    (a word occasionally merges or splits at a boundary).

    Raises:
        TraceError: no exact text was found (a tokenizer unlike any tried).
    """
    if num_tokens < 1:
        raise TraceError(f"prompt length must be >= 1 token, got {num_tokens}")
    picks = list(rng.integers(0, len(words), size=num_tokens))
    for _ in range(20 + num_tokens // 10):
        text = " ".join(words[i] for i in picks)
        n = count_tokens(tokenizer, text)
        if n == num_tokens:
            return text
        if n > num_tokens and len(picks) > 1:
            picks.pop()
        else:
            picks.append(int(rng.integers(0, len(words))))
    raise TraceError(f"could not build a prompt of exactly {num_tokens} tokens")


# ---------------------------------------------------------------------------------------
# Arrivals


def arrival_offsets(num: int, rate: float, rng: np.random.Generator, burstiness: float = 1.0,
                    ramp: tuple[float, float] | None = None) -> list[float]:
    """Send times (s) of ``num`` requests: the first at 0, then gaps drawn from a gamma
    distribution with shape ``burstiness`` and scale 1/(rate·burstiness), so mean 1/rate
    and coefficient of variation 1/sqrt(burstiness) — vLLM ``bench serve``'s definition:
    burstiness 1 is a Poisson process (exponential gaps), < 1 burstier, > 1 steadier.

    ``ramp=(A, B)`` (req/s) replaces ``rate``: the gap before request i is drawn at rate
    A + (B − A)·i/(num − 1), rising linearly over the run (vLLM's linear ramp-up).
    ``rate`` = inf (and no ramp): all at 0.

    Raises:
        TraceError: rate or a ramp end <= 0, or burstiness <= 0.
    """
    if not (burstiness > 0) or math.isinf(burstiness):
        raise TraceError(f"burstiness {burstiness}: must be a finite number > 0")
    if ramp is not None:
        if not (0 < ramp[0] < math.inf and 0 < ramp[1] < math.inf):
            raise TraceError(f"ramp-up {ramp[0]}->{ramp[1]} req/s: both must be finite and > 0")
        rates = np.linspace(ramp[0], ramp[1], num) if num > 1 else np.array([ramp[0]])
    else:
        check_rate(rate)
        if math.isinf(rate):
            return [0.0] * num
        rates = np.full(num, rate)
    if num <= 0:
        return []
    if burstiness == 1.0:
        # Gamma(1, s) is Exponential(s); drawing it as such keeps seeded Poisson traces
        # identical to the ones made before gamma arrivals existed.
        gaps = rng.exponential(1.0 / rates[1:])
    else:
        gaps = rng.gamma(burstiness, 1.0 / (rates[1:] * burstiness))
    return [0.0] + [float(x) for x in np.cumsum(gaps)]


def retime(requests: list[Request], rate: float, seed: int = 0) -> list[Request]:
    """The same requests re-spaced to a mean arrival rate of ``rate`` req/s: offsets scaled
    by (current mean rate)/``rate``, keeping the pattern (bursts, long-prompt positions).
    A trace sent all at t = 0 has no pattern to keep; it gets Poisson offsets (seeded).

    Raises:
        TraceError: ``rate`` is not a finite number > 0.
    """
    if not (0 < rate < math.inf):
        raise TraceError(f"rate {rate}: must be a finite number > 0 req/s")
    if len(requests) < 2:
        return list(requests)
    span = max(r.offset_s for r in requests) - min(r.offset_s for r in requests)
    if span == 0:
        order = sorted(range(len(requests)), key=lambda i: requests[i].offset_s)
        offsets = arrival_offsets(len(requests), rate, np.random.default_rng(seed))
        new = list(requests)
        for i, off in zip(order, offsets):
            new[i] = replace(requests[i], offset_s=round(off, 6))
        return new
    scale = span / (len(requests) - 1) * rate  # = (current rate) / rate
    start = min(r.offset_s for r in requests)
    return [replace(r, offset_s=round((r.offset_s - start) / scale, 6)) for r in requests]


# ---------------------------------------------------------------------------------------
# Lengths


def check_range(name: str, lo_hi: tuple[int, int]) -> tuple[int, int]:
    """``lo_hi`` if 1 <= MIN <= MAX, else TraceError naming ``name``."""
    lo, hi = lo_hi
    if lo < 1 or hi < lo:
        raise TraceError(f"{name} {lo}:{hi}: need 1 <= MIN <= MAX")
    return lo, hi


def check_rate(rate: float) -> float:
    """``rate`` (req/s) if > 0 (inf allowed), else TraceError."""
    if not (rate > 0):  # also rejects NaN
        raise TraceError(f"request rate {rate}: must be > 0 (inf = all at once)")
    return rate


def draw_lengths(rng: np.random.Generator, num: int, lo_hi: tuple[int, int],
                 dist: str = "uniform") -> np.ndarray:
    """``num`` token lengths in the inclusive range ``lo_hi`` (MIN = MAX: fixed).

    ``dist``: "uniform" over the range; "normal" with mean at its middle and standard
    deviation (MAX − MIN)/6 (so ±3σ spans it); "lognormal" with median sqrt(MIN·MAX) and
    σ of the log ln(MAX/MIN)/6 (lengths of real prompts are skewed like this). Normal and
    lognormal draws are rounded and clipped to the range.

    Raises:
        TraceError: an unknown ``dist``.
    """
    lo, hi = lo_hi
    if dist == "uniform":
        return rng.integers(lo, hi + 1, size=num)
    if dist == "normal":
        x = rng.normal((lo + hi) / 2, (hi - lo) / 6, size=num)
    elif dist == "lognormal":
        x = rng.lognormal(math.log(math.sqrt(lo * hi)), math.log(hi / lo) / 6, size=num)
    else:
        raise TraceError(f"length distribution {dist!r}: use one of "
                         f"{', '.join(LENGTH_DISTRIBUTIONS)}")
    return np.clip(np.rint(x), lo, hi).astype(int)


# ---------------------------------------------------------------------------------------
# JSON lines


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


# ---------------------------------------------------------------------------------------
# Command-line arguments shared by `epdserve bench` and `epdserve compare`


def parse_range(text: str) -> tuple[int, int]:
    """argparse type for ``MIN:MAX`` (or a single ``N``) token lengths, 1 <= MIN <= MAX."""
    parts = text.split(":")
    try:
        if len(parts) == 1:
            lo = hi = int(parts[0])
        elif len(parts) == 2:
            lo, hi = int(parts[0]), int(parts[1])
        else:
            raise ValueError
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected MIN:MAX (integers)") from None
    if lo < 1 or hi < lo:
        raise argparse.ArgumentTypeError(f"{text!r}: need 1 <= MIN <= MAX")
    return lo, hi


def parse_rate(text: str) -> float:
    """argparse type for a request rate in req/s: a number > 0, or ``inf``."""
    try:
        rate = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: not a number (use inf for all at once)") from None
    if not (rate > 0):
        raise argparse.ArgumentTypeError(f"{text!r}: must be > 0 (inf = all at once)")
    return rate


positive_int = int_at_least(1)
nonnegative_int = int_at_least(0)


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: not a number") from None
    if not (0 < value < math.inf):
        raise argparse.ArgumentTypeError(f"{text!r}: must be a finite number > 0")
    return value


def parse_fraction(text: str) -> float:
    """argparse type for a fraction in [0, 1]."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (0 <= value <= 1):
        raise argparse.ArgumentTypeError(f"{text!r}: expected a fraction in [0, 1], e.g. 0.5")
    return value


def parse_size(text: str) -> tuple[int, int]:
    """argparse type for an image size ``WxH`` in pixels, both >= 1."""
    w, sep, h = text.lower().partition("x")
    try:
        size = (int(w), int(h))
    except ValueError:
        size = (0, 0)
    if not sep or min(size) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected WxH in pixels, e.g. 448x448")
    return size


WORKLOADS = ("synthetic", "prefix", "demo", "sharegpt")


def add_workload_arguments(parser: argparse.ArgumentParser, default: str = "synthetic") -> None:
    """Add the workload options (generator, lengths, arrivals, images, seed, --trace,
    --save-trace)."""
    from epdserve.bench.datasets import DEMO_DEFAULTS

    g = parser.add_argument_group("workload")
    g.add_argument("--workload", choices=WORKLOADS, default=default,
                   help=f"trace generator (default {default}); sharegpt needs --dataset-path")
    g.add_argument("--num-prompts", type=positive_int, default=None,
                   help="requests (default 50) or chat requests (demo, default 24)")
    g.add_argument("--input-len", type=parse_range, default=None, metavar="MIN:MAX",
                   help="prompt tokens (synthetic default 100:400, demo 50:250; N = fixed)")
    g.add_argument("--output-len", type=parse_range, default=None, metavar="MIN:MAX",
                   help="output tokens (default 64:128, demo 32:64; sharegpt: the answer's "
                        "length unless given)")
    g.add_argument("--length-dist", choices=LENGTH_DISTRIBUTIONS, default="uniform",
                   help="distribution of lengths over their MIN:MAX range: uniform (default), "
                        "normal (mean mid-range, std range/6) or lognormal (median "
                        "sqrt(MIN*MAX)), clipped to the range")
    a = parser.add_argument_group("arrivals")
    a.add_argument("--request-rate", type=parse_rate, default=None, metavar="R",
                   help="mean arrival rate in req/s, inf = all at once "
                        "(default inf, demo default 0.25)")
    a.add_argument("--burstiness", type=positive_float, default=1.0, metavar="B",
                   help="gamma shape of the gaps between arrivals: 1 = Poisson (default), "
                        "<1 burstier, >1 steadier (vLLM's definition)")
    a.add_argument("--ramp-up-start-rps", type=positive_float, default=None, metavar="A",
                   help="linear ramp: rate of the first request (req/s); needs "
                        "--ramp-up-end-rps, replaces --request-rate")
    a.add_argument("--ramp-up-end-rps", type=positive_float, default=None, metavar="B",
                   help="linear ramp: rate of the last request (req/s)")
    p = parser.add_argument_group("shared prefixes (--workload prefix)")
    p.add_argument("--prefix-count", type=positive_int, default=4, metavar="K",
                   help="distinct prefixes (default %(default)s)")
    p.add_argument("--prefix-len", type=positive_int, default=256, metavar="P",
                   help="tokens per prefix (default %(default)s)")
    p.add_argument("--suffix-len", type=parse_range, default=(16, 64), metavar="MIN:MAX",
                   help="tokens of each request's own suffix (default 16:64)")
    p.add_argument("--prefix-order", choices=["round-robin", "random"], default="round-robin",
                   help="which prefix request i takes (default round-robin)")
    d = parser.add_argument_group("long-prompt bursts (--workload demo)")
    d.add_argument("--num-long", "--long-count", dest="num_long", type=nonnegative_int,
                   metavar="N",
                   default=DEMO_DEFAULTS["num_long"],
                   help="long prompts (default %(default)s)")
    d.add_argument("--long-input-len", "--long-len", dest="long_input_len", type=positive_int,
                   metavar="N",
                   default=DEMO_DEFAULTS["long_input_len"],
                   help="tokens per long prompt (default %(default)s)")
    d.add_argument("--long-output-len", type=positive_int,
                   default=DEMO_DEFAULTS["long_output_len"],
                   help="output tokens per long prompt (default %(default)s)")
    d.add_argument("--long-burst", type=positive_int, default=1, metavar="N",
                   help="long prompts sent at the same instant (default 1)")
    g.add_argument("--dataset-path", default=None, metavar="FILE",
                   help="ShareGPT-format JSON file (--workload sharegpt)")
    g.add_argument("--images-per-request", type=nonnegative_int, default=0, metavar="N",
                   help="images attached to every request (default 0; needs a server with "
                        "vision support, e.g. --model vlm, and --endpoint chat)")
    g.add_argument("--image-size", type=parse_size, default=(448, 448), metavar="WxH",
                   help="pixel size of those images (default 448x448)")
    g.add_argument("--image-repeat-share", type=parse_fraction, default=0.0, metavar="F",
                   help="share of requests that send the same images as an earlier request "
                        "(embedding cache hits; default 0: every image distinct)")
    g.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    g.add_argument("--tokenizer", default=None, metavar="PATH",
                   help="model directory or GGUF whose tokenizer sizes the prompts "
                        "(default: the default model)")
    g.add_argument("--trace", default=None, metavar="FILE",
                   help="replay this JSON-lines trace instead of generating one")
    g.add_argument("--save-trace", default=None, metavar="FILE",
                   help="write the trace used to FILE (JSON lines)")


def load_tokenizer_for(path: str | None):
    """The tokenizer of a model directory or GGUF file (None: the default model).

    Raises:
        TraceError: the model cannot be found or read.
    """
    from epdserve.model.loader import ModelLoadError, resolve_model
    from epdserve.model.tokenizer import load_tokenizer

    try:
        return load_tokenizer(resolve_model(path).path)
    except ModelLoadError as exc:
        raise TraceError(f"tokenizer: {exc}") from None
    except OSError as exc:
        raise TraceError(f"tokenizer {path}: {exc}") from None


def _arrivals_from_args(args: argparse.Namespace, default_rate: float) -> dict:
    start = getattr(args, "ramp_up_start_rps", None)
    end = getattr(args, "ramp_up_end_rps", None)
    if (start is None) != (end is None):
        raise TraceError("a linear ramp needs both --ramp-up-start-rps and --ramp-up-end-rps")
    if start is not None and args.request_rate is not None:
        raise TraceError("--request-rate and --ramp-up-*-rps exclude each other "
                         "(the ramp sets the rate)")
    return {"burstiness": getattr(args, "burstiness", 1.0),
            "ramp": (start, end) if start is not None else None,
            "request_rate": args.request_rate or default_rate}


def build_from_args(args: argparse.Namespace, tokenizer_path: str | None = None
                    ) -> tuple[list[Request], dict]:
    """The trace the workload options ask for, and a dict describing how it was made.

    ``tokenizer_path`` is used when ``--tokenizer`` is not given. Saves the trace when
    ``--save-trace`` is given.

    Raises:
        TraceError: a bad trace or dataset file or setting (the message names it).
    """
    from epdserve.bench import datasets

    workload = args.workload
    if getattr(args, "dataset_path", None) and workload != "sharegpt":
        raise TraceError(f"--dataset-path is for --workload sharegpt, not {workload}")
    if args.trace:
        requests = load_trace(args.trace)
        spec = {"source": "trace", "trace": str(args.trace)}
    else:
        tok = load_tokenizer_for(args.tokenizer or tokenizer_path)
        dist = getattr(args, "length_dist", "uniform")
        extra: dict = {}
        if workload == "demo":
            d = datasets.DEMO_DEFAULTS
            params = dict(num_chat=args.num_prompts or d["num_chat"],
                          chat_input_len=args.input_len or d["chat_input_len"],
                          chat_output_len=args.output_len or d["chat_output_len"],
                          num_long=args.num_long, long_input_len=args.long_input_len,
                          long_output_len=args.long_output_len,
                          long_burst=getattr(args, "long_burst", 1), seed=args.seed,
                          length_dist=dist, **_arrivals_from_args(args, d["chat_rate"]))
            params["chat_rate"] = params.pop("request_rate")
            requests = datasets.demo(tok, **params)
        elif workload == "sharegpt":
            if not args.dataset_path:
                raise TraceError("--workload sharegpt needs --dataset-path FILE")
            params = dict(path=args.dataset_path, num_prompts=args.num_prompts or 50,
                          output_len=args.output_len, seed=args.seed,
                          **_arrivals_from_args(args, float("inf")))
            requests, extra = datasets.sharegpt(tok, **params)
            print(f"dataset {args.dataset_path}: {extra['used']} of {extra['conversations']} "
                  f"conversations used; skipped {extra['skipped_no_answer']} without an "
                  f"answer, {extra['skipped_too_short']} too short, "
                  f"{extra['skipped_too_long']} too long", file=sys.stderr)
        else:
            params = dict(num_prompts=args.num_prompts or 50,
                          output_len=args.output_len or (64, 128), seed=args.seed,
                          length_dist=dist, **_arrivals_from_args(args, float("inf")))
            if workload == "prefix":
                params.update(prefix_count=args.prefix_count, prefix_len=args.prefix_len,
                              suffix_len=args.suffix_len, order=args.prefix_order)
                requests = datasets.shared_prefix(tok, **params)
            else:
                params["input_len"] = args.input_len or (100, 400)
                requests = datasets.synthetic(tok, **params)
        images = getattr(args, "images_per_request", 0)
        if images:
            repeat = getattr(args, "image_repeat_share", 0.0)
            params.update(images_per_request=images, image_size=args.image_size,
                          image_repeat_share=repeat)
            requests = datasets.with_images(requests, images, args.image_size, repeat,
                                            args.seed)
        spec = {"source": workload, **{k: _jsonable(v) for k, v in params.items()}, **extra}
    if args.save_trace:
        save_trace(requests, args.save_trace)
    return requests, spec


def _jsonable(value):
    if isinstance(value, tuple):
        return list(value)
    if isinstance(value, float) and math.isinf(value):
        return str(value)
    return value
