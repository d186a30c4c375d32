"""Request traces: what to send, and when.

A trace is a list of :class:`Request` — send time after the start of the run
(``offset_s``, seconds), prompt text, ``max_tokens``, and ``kind`` ("chat" or "long") —
plus the prompt length in tokens it was built to have (``prompt_tokens``, counted on the
text content alone with the model's tokenizer; the server adds its chat-template tokens
on top). Every generator is seeded and deterministic: the same arguments and tokenizer
give the same trace, byte for byte.

Generators:

* :func:`synthetic` — ``num_prompts`` requests, input and output lengths drawn uniformly
  from inclusive ranges, Poisson arrivals at ``request_rate`` req/s (exponential gaps, as
  vLLM ``bench serve`` with burstiness 1; ``inf`` sends everything at t = 0).
* :func:`demo` — the load of ``make demo``: short chat requests at a steady Poisson rate
  plus a few long prompts that arrive while the chat requests are decoding, the case in
  which colocated serving stalls every decode behind a long prefill and PD does not.

Traces are saved and loaded as JSON lines, one request per line (:func:`save_trace`,
:func:`load_trace`), so a run can be replayed exactly.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

KINDS = ("chat", "long")


class TraceError(ValueError):
    """A trace file or workload setting that cannot be used; the message names it."""


@dataclass(frozen=True)
class Request:
    """One request of a trace.

    ``offset_s``: send time in seconds after the start of the run; ``prompt``: the user
    message text; ``max_tokens``: tokens to generate; ``kind``: "chat" or "long";
    ``prompt_tokens``: token count of ``prompt`` aimed for (text only, no template).
    """

    offset_s: float
    prompt: str
    max_tokens: int
    kind: str
    prompt_tokens: int


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
# Arrivals and generators


def poisson_offsets(num: int, rate: float, rng: np.random.Generator) -> list[float]:
    """Send times (s) of ``num`` requests arriving as a Poisson process of ``rate`` req/s:
    the first at 0, then exponential gaps of mean 1/rate. ``rate`` = inf: all at 0."""
    if num <= 0:
        return []
    if math.isinf(rate):
        return [0.0] * num
    gaps = rng.exponential(1.0 / rate, size=num - 1)
    return [0.0] + [float(x) for x in np.cumsum(gaps)]


def _check_range(name: str, lo_hi: tuple[int, int]) -> tuple[int, int]:
    lo, hi = lo_hi
    if lo < 1 or hi < lo:
        raise TraceError(f"{name} {lo}:{hi}: need 1 <= MIN <= MAX")
    return lo, hi


def _check_rate(rate: float) -> float:
    if not (rate > 0):  # also rejects NaN
        raise TraceError(f"request rate {rate}: must be > 0 (inf = all at once)")
    return rate


def synthetic(tokenizer, num_prompts: int = 50, input_len: tuple[int, int] = (100, 400),
              output_len: tuple[int, int] = (64, 128), request_rate: float = float("inf"),
              seed: int = 0) -> list[Request]:
    """``num_prompts`` chat requests: input/output token lengths uniform over the inclusive
    ranges, Poisson arrivals at ``request_rate`` req/s (inf: all at t = 0)."""
    if num_prompts < 1:
        raise TraceError(f"num prompts {num_prompts}: must be >= 1")
    _check_range("input length", input_len)
    _check_range("output length", output_len)
    _check_rate(request_rate)
    rng = np.random.default_rng(seed)
    words = word_list(tokenizer)
    in_lens = rng.integers(input_len[0], input_len[1] + 1, size=num_prompts)
    out_lens = rng.integers(output_len[0], output_len[1] + 1, size=num_prompts)
    offsets = poisson_offsets(num_prompts, request_rate, rng)
    return [Request(offset_s=round(offsets[i], 6),
                    prompt=make_prompt(tokenizer, words, int(in_lens[i]), rng),
                    max_tokens=int(out_lens[i]), kind="chat", prompt_tokens=int(in_lens[i]))
            for i in range(num_prompts)]


# Defaults of `make demo`, sized for a 2-core CPU running SmolLM2-135M in float32
# (measured: prefill ~240 tok/s per core, a decode step ~75 ms at batch 1 and ~150 ms at
# batch 8 on one core; a 2-thread engine sharing its cores with the router and client is
# slower still): 24 chat requests at 0.25 req/s arrive over ~95 s, asking for ~90 prompt
# tokens/s in all, below either deployment's prefill capacity; the 3 long prompts (~4 s of
# prefill on two cores, ~7 s on one) land at 1/4, 1/2 and 3/4 of the chat arrival window,
# while chat requests decode.
DEMO_DEFAULTS = dict(num_chat=24, chat_input_len=(50, 250), chat_output_len=(32, 64),
                     chat_rate=0.25, num_long=3, long_input_len=1600, long_output_len=16)


def demo(tokenizer, num_chat: int = 24, chat_input_len: tuple[int, int] = (50, 250),
         chat_output_len: tuple[int, int] = (32, 64), chat_rate: float = 0.25,
         num_long: int = 3, long_input_len: int = 1600, long_output_len: int = 16,
         seed: int = 0) -> list[Request]:
    """The demo load: ``num_chat`` chat requests (uniform lengths, Poisson at ``chat_rate``
    req/s) and ``num_long`` long prompts of ``long_input_len`` tokens with
    ``long_output_len`` output tokens, sent at evenly spaced fractions k/(num_long+1) of the
    chat arrival window (so they arrive while chat requests decode). Sorted by send time."""
    if num_chat < 1 or num_long < 0:
        raise TraceError(f"demo needs >= 1 chat request and >= 0 long ones "
                         f"(got {num_chat}, {num_long})")
    if long_input_len < 1 or long_output_len < 1:
        raise TraceError(f"long prompt lengths must be >= 1 (got {long_input_len}, "
                         f"{long_output_len})")
    chat = synthetic(tokenizer, num_chat, chat_input_len, chat_output_len, chat_rate, seed)
    span = chat[-1].offset_s if math.isfinite(chat_rate) else 0.0
    rng = np.random.default_rng([seed, 1])
    words = word_list(tokenizer)
    long = [Request(offset_s=round(span * (k + 1) / (num_long + 1), 6),
                    prompt=make_prompt(tokenizer, words, long_input_len, rng),
                    max_tokens=long_output_len, kind="long", prompt_tokens=long_input_len)
            for k in range(num_long)]
    return sorted(chat + long, key=lambda r: r.offset_s)  # stable: ties keep chat first


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
    requests = []
    for num, line in enumerate(lines, 1):
        if line.strip():
            requests.append(_parse_request(line, f"{path}:{num}"))
    if not requests:
        raise TraceError(f"trace file {path}: no requests")
    return requests


def _parse_request(line: str, where: str) -> Request:
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
    return Request(offset_s=float(obj["offset_s"]), prompt=obj["prompt"],
                   max_tokens=obj["max_tokens"], kind=obj["kind"],
                   prompt_tokens=obj["prompt_tokens"])


def describe(requests: list[Request]) -> dict:
    """Summary of a trace: counts, token totals and ranges per kind, arrival window (s)."""
    out: dict = {"num_requests": len(requests),
                 "duration_of_arrivals_s": round(max(r.offset_s for r in requests), 3)}
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


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: must be >= 1")
    return value


def nonnegative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: not an integer") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: must be >= 0")
    return value


def add_workload_arguments(parser: argparse.ArgumentParser, default: str = "synthetic") -> None:
    """Add the workload options (generator, sizes, seed, --trace, --save-trace)."""
    g = parser.add_argument_group("workload")
    g.add_argument("--workload", choices=["synthetic", "demo"], default=default,
                   help=f"trace generator (default {default})")
    g.add_argument("--num-prompts", type=positive_int, default=None,
                   help="requests (synthetic, default 50) or chat requests (demo, default 24)")
    g.add_argument("--input-len", type=parse_range, default=None, metavar="MIN:MAX",
                   help="prompt tokens, uniform (synthetic default 100:400, demo 50:250)")
    g.add_argument("--output-len", type=parse_range, default=None, metavar="MIN:MAX",
                   help="output tokens, uniform (synthetic default 64:128, demo 32:64)")
    g.add_argument("--request-rate", type=parse_rate, default=None, metavar="R",
                   help="Poisson arrival rate in req/s, inf = all at once "
                        "(synthetic default inf, demo default 0.25)")
    g.add_argument("--num-long", type=nonnegative_int, default=DEMO_DEFAULTS["num_long"],
                   help="demo: long prompts (default %(default)s)")
    g.add_argument("--long-input-len", type=positive_int,
                   default=DEMO_DEFAULTS["long_input_len"],
                   help="demo: tokens per long prompt (default %(default)s)")
    g.add_argument("--long-output-len", type=positive_int,
                   default=DEMO_DEFAULTS["long_output_len"],
                   help="demo: output tokens per long prompt (default %(default)s)")
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


def build_from_args(args: argparse.Namespace, tokenizer_path: str | None = None
                    ) -> tuple[list[Request], dict]:
    """The trace the workload options ask for, and a dict describing how it was made.

    ``tokenizer_path`` is used when ``--tokenizer`` is not given. Saves the trace when
    ``--save-trace`` is given.

    Raises:
        TraceError: a bad trace file or setting (the message names it).
    """
    if args.trace:
        requests = load_trace(args.trace)
        spec = {"source": "trace", "trace": str(args.trace)}
    else:
        tok = load_tokenizer_for(args.tokenizer or tokenizer_path)
        if args.workload == "demo":
            d = DEMO_DEFAULTS
            params = dict(num_chat=args.num_prompts or d["num_chat"],
                          chat_input_len=args.input_len or d["chat_input_len"],
                          chat_output_len=args.output_len or d["chat_output_len"],
                          chat_rate=args.request_rate or d["chat_rate"],
                          num_long=args.num_long, long_input_len=args.long_input_len,
                          long_output_len=args.long_output_len, seed=args.seed)
            requests = demo(tok, **params)
        else:
            params = dict(num_prompts=args.num_prompts or 50,
                          input_len=args.input_len or (100, 400),
                          output_len=args.output_len or (64, 128),
                          request_rate=args.request_rate or float("inf"), seed=args.seed)
            requests = synthetic(tok, **params)
        spec = {"source": args.workload,
                **{k: (list(v) if isinstance(v, tuple) else
                       (str(v) if isinstance(v, float) and math.isinf(v) else v))
                   for k, v in params.items()}}
    if args.save_trace:
        save_trace(requests, args.save_trace)
    return requests, spec
