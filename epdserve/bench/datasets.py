"""Seeded, deterministic trace generators: synthetic chat, shared prefixes, the demo (chat with
long-prompt bursts), ShareGPT files (vLLM's filters; docs/comparing.md) and a workload shifting
in phases (docs/comparing.md, "A shifting workload")."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from epdserve.bench.arrivals import arrival_offsets, check_rate
from epdserve.bench.prompts import check_range, count_tokens, draw_lengths, make_prompt, word_list
from epdserve.bench.traces import Request, TraceError

# vLLM's is_valid_sequence defaults (benchmarks/datasets.py).
MIN_LEN = 4
MAX_PROMPT_LEN = 1024
MAX_TOTAL_LEN = 2048
_SEPARATORS = re.compile(r"[\s,]*")


def with_images(requests: list[Request], per_request: int, size: tuple[int, int],
                repeat_share: float = 0.0, seed: int = 0) -> list[Request]:
    """``per_request`` images of ``size`` (width, height px), each its own seeded picture,
    except round(``repeat_share`` · N) requests (never the first) that repeat an earlier request's
    images, so an embedding cache can hit. Raises TraceError for a share outside [0, 1]."""
    if not 0 <= repeat_share <= 1:
        raise TraceError(f"image repeat share {repeat_share}: must be in [0, 1]")
    if per_request == 0:
        return list(requests)
    rng = np.random.default_rng([seed, 2])  # apart from the generators' streams
    n = len(requests)
    repeats = set(rng.choice(np.arange(1, n), min(round(repeat_share * n), n - 1),
                             replace=False).tolist())
    out: list[Request] = []
    for i, r in enumerate(requests):
        if i in repeats:
            images = out[int(rng.integers(0, i))].images
        else:
            images = tuple({"width": size[0], "height": size[1], "seed": i * per_request + k}
                           for k in range(per_request))
        out.append(replace(r, images=images))
    return out


def synthetic(tokenizer, num_prompts: int = 50, input_len: tuple[int, int] = (100, 400),
              output_len: tuple[int, int] = (64, 128), request_rate: float = float("inf"),
              seed: int = 0, length_dist: str = "uniform", burstiness: float = 1.0,
              ramp: tuple[float, float] | None = None) -> list[Request]:
    if num_prompts < 1:
        raise TraceError(f"num prompts {num_prompts}: must be >= 1")
    check_range("input length", input_len)
    check_range("output length", output_len)
    check_rate(request_rate)
    rng = np.random.default_rng(seed)
    words = word_list(tokenizer)
    in_lens = draw_lengths(rng, num_prompts, input_len, length_dist)
    out_lens = draw_lengths(rng, num_prompts, output_len, length_dist)
    offsets = arrival_offsets(num_prompts, request_rate, rng, burstiness, ramp)
    return [Request(offset_s=round(offsets[i], 6),
                    prompt=make_prompt(tokenizer, words, int(in_lens[i]), rng),
                    max_tokens=int(out_lens[i]), kind="chat", prompt_tokens=int(in_lens[i]))
            for i in range(num_prompts)]


def shared_prefix(tokenizer, num_prompts: int = 50, prefix_count: int = 4,
                  prefix_len: int = 256, suffix_len: tuple[int, int] = (16, 64),
                  output_len: tuple[int, int] = (64, 128), request_rate: float = float("inf"),
                  seed: int = 0, order: str = "round-robin", length_dist: str = "uniform",
                  burstiness: float = 1.0, ramp: tuple[float, float] | None = None
                  ) -> list[Request]:
    """Request i takes prefix i mod K ("round-robin") or a seeded random one; its
    ``prompt_tokens`` counts the whole text (a word boundary may merge two tokens)."""
    if num_prompts < 1 or prefix_count < 1 or prefix_len < 1:
        raise TraceError(f"shared prefixes need >= 1 prompt, prefix and prefix token "
                         f"(got {num_prompts}, {prefix_count}, {prefix_len})")
    if order not in ("round-robin", "random"):
        raise TraceError(f"prefix order {order!r}: use round-robin or random")
    check_range("suffix length", suffix_len)
    check_range("output length", output_len)
    rng = np.random.default_rng(seed)
    words = word_list(tokenizer)
    prefixes = [make_prompt(tokenizer, words, prefix_len, rng) for _ in range(prefix_count)]
    picks = (np.arange(num_prompts) % prefix_count if order == "round-robin"
             else rng.integers(0, prefix_count, size=num_prompts))
    suffix_lens = draw_lengths(rng, num_prompts, suffix_len, length_dist)
    out_lens = draw_lengths(rng, num_prompts, output_len, length_dist)
    offsets = arrival_offsets(num_prompts, request_rate, rng, burstiness, ramp)
    requests = []
    for i in range(num_prompts):
        text = prefixes[picks[i]] + " " + make_prompt(tokenizer, words, int(suffix_lens[i]), rng)
        requests.append(Request(offset_s=round(offsets[i], 6), prompt=text,
                                max_tokens=int(out_lens[i]), kind="chat",
                                prompt_tokens=count_tokens(tokenizer, text)))
    return requests


# `make demo`'s defaults, sized for 2 CPU cores and SmolLM2-135M (docs/comparing.md).
DEMO_DEFAULTS = dict(num_chat=24, chat_input_len=(50, 250), chat_output_len=(128, 256),
                     chat_rate=0.25, num_long=6, long_input_len=1600, long_output_len=16)
_D = DEMO_DEFAULTS


def demo(tokenizer, num_chat: int = _D["num_chat"], chat_input_len: tuple[int, int] = _D["chat_input_len"],
         chat_output_len: tuple[int, int] = _D["chat_output_len"], chat_rate: float = _D["chat_rate"],
         num_long: int = _D["num_long"], long_input_len: int = _D["long_input_len"],
         long_output_len: int = _D["long_output_len"],
         seed: int = 0, long_burst: int = 1, length_dist: str = "uniform",
         burstiness: float = 1.0, ramp: tuple[float, float] | None = None) -> list[Request]:
    """``num_long`` long prompts in bursts of ``long_burst``; burst k of B is sent at fraction
    k/(B+1) of the chat arrival window, so most arrive while chats decode."""
    if num_chat < 1 or num_long < 0 or long_burst < 1:
        raise TraceError(f"demo needs >= 1 chat request, >= 0 long ones and bursts of >= 1 "
                         f"(got {num_chat}, {num_long}, {long_burst})")
    if long_input_len < 1 or long_output_len < 1:
        raise TraceError(f"long prompt lengths must be >= 1 (got {long_input_len}, "
                         f"{long_output_len})")
    chat = synthetic(tokenizer, num_chat, chat_input_len, chat_output_len, chat_rate, seed,
                     length_dist, burstiness, ramp)
    span = chat[-1].offset_s
    bursts = -(-num_long // long_burst)
    rng = np.random.default_rng([seed, 1])
    words = word_list(tokenizer)
    long = [Request(offset_s=round(span * (k // long_burst + 1) / (bursts + 1), 6),
                    prompt=make_prompt(tokenizer, words, long_input_len, rng),
                    max_tokens=long_output_len, kind="long", prompt_tokens=long_input_len)
            for k in range(num_long)]
    return sorted(chat + long, key=lambda r: r.offset_s)  # stable: ties keep chat first


def read_sharegpt(path: str | Path) -> list[tuple[str, str | None]]:
    """(first human turn, the gpt turn right after it or None) per conversation, in file order.

    Raises TraceError for an unreadable file, invalid JSON or an entry not of ShareGPT's shape
    (naming file:line)."""
    path = Path(path)
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise TraceError(f"dataset file {path}: {getattr(exc, 'strerror', None) or exc}") from None
    try:
        json.loads(text)
    except json.JSONDecodeError as exc:
        raise TraceError(f"{path}:{exc.lineno}: not valid JSON ({exc.msg})") from None
    entries = _list_entries(text)
    if entries is None:
        raise TraceError(f"dataset file {path}: expected a JSON list of "
                         f'{{"conversations": [...]}} objects (ShareGPT format)')
    pairs: list[tuple[str, str | None]] = []
    for i, (line, entry) in enumerate(entries):
        turns = entry.get("conversations") if isinstance(entry, dict) else None
        if not isinstance(turns, list) or not all(
                isinstance(t, dict) and isinstance(t.get("from"), str)
                and isinstance(t.get("value"), str) for t in turns):
            raise TraceError(f"{path}:{line}: entry {i}: expected "
                             f'{{"conversations": [{{"from": ..., "value": ...}}, ...]}}')
        for k, turn in enumerate(turns):
            if turn["from"] == "human":
                nxt = turns[k + 1] if k + 1 < len(turns) else None
                pairs.append((turn["value"],
                              nxt["value"] if nxt is not None and nxt["from"] == "gpt" else None))
                break
    return pairs


def _list_entries(text: str) -> list[tuple[int, object]] | None:
    """(start line, value) per element of a JSON list (None if not a list): decoding one by
    one lets a schema error name its line."""
    decoder = json.JSONDecoder()
    pos = _SEPARATORS.match(text).end()
    if not text.startswith("[", pos):
        return None
    entries = []
    line, counted = 1, 0
    pos += 1
    while True:
        pos = _SEPARATORS.match(text, pos).end()
        if text.startswith("]", pos):
            return entries
        value, end = decoder.raw_decode(text, pos)
        line += text.count("\n", counted, pos)  # counted incrementally: files are large
        counted = pos
        entries.append((line, value))
        pos = end


def sharegpt(tokenizer, path: str | Path, num_prompts: int = 50,
             output_len: tuple[int, int] | None = None, request_rate: float = float("inf"),
             seed: int = 0, burstiness: float = 1.0, ramp: tuple[float, float] | None = None
             ) -> tuple[list[Request], dict]:
    """Returns (requests, stats: ``conversations``, ``used``, ``skipped_no_answer``,
    ``skipped_too_short``, ``skipped_too_long``); ``output_len`` replaces the answer's length.

    Raises TraceError for a bad file or no usable conversation."""
    pairs = read_sharegpt(path)
    rng = np.random.default_rng(seed)
    stats = {"conversations": len(pairs), "used": 0, "skipped_no_answer": 0,
             "skipped_too_short": 0, "skipped_too_long": 0}
    kept: list[tuple[str, int, int]] = []
    for i in rng.permutation(len(pairs)):
        if len(kept) == num_prompts:
            break
        prompt, answer = pairs[i]
        if answer is None and output_len is None:
            stats["skipped_no_answer"] += 1
            continue
        n_in = count_tokens(tokenizer, prompt)
        n_out = (int(draw_lengths(rng, 1, output_len)[0]) if output_len is not None
                 else count_tokens(tokenizer, answer))
        # vLLM skips the answer-length check when the output length is fixed by the user.
        if n_in < MIN_LEN or (output_len is None and n_out < MIN_LEN):
            stats["skipped_too_short"] += 1
        elif n_in > MAX_PROMPT_LEN or n_in + n_out > MAX_TOTAL_LEN:
            stats["skipped_too_long"] += 1
        else:
            kept.append((prompt, n_in, n_out))
    if not kept:
        raise TraceError(f"dataset file {path}: no usable conversation ({stats['conversations']} "
                         f"read; skipped: {stats['skipped_no_answer']} without an answer, "
                         f"{stats['skipped_too_short']} too short, "
                         f"{stats['skipped_too_long']} too long)")
    stats["used"] = len(kept)
    offsets = arrival_offsets(len(kept), request_rate, rng, burstiness, ramp)
    requests = [Request(offset_s=round(off, 6), prompt=p, max_tokens=n_out, kind="chat",
                        prompt_tokens=n_in) for off, (p, n_in, n_out) in zip(offsets, kept)]
    return requests, stats


# Sized for 2 CPU cores and SmolLM2-135M (docs/comparing.md, "A shifting workload").
SHIFT_DEFAULT = ("in=1200:1700,out=8:16,rate=0.12,n=10;"
                 "in=30:120,out=200:400,rate=0.3,n=24;"
                 "in=50:200,out=32:64,rate=0.05,n=4")
# The default model's chat template adds 30 tokens to a prompt.
TEMPLATE_TOKENS = 32
_PHASE_KEYS = ("in", "out", "rate", "n")


@dataclass(frozen=True)
class Phase:
    """Inclusive token ranges, ``rate`` in req/s (finite > 0), ``num`` requests."""

    input_len: tuple[int, int]
    output_len: tuple[int, int]
    rate: float
    num: int


def parse_phases(text: str) -> list[Phase]:
    """Phases of a ``--shift-phases`` SPEC, e.g. :data:`SHIFT_DEFAULT`.

    Raises TraceError naming the phase (1-based) and the bad part."""
    parts = [p.strip() for p in text.split(";")]
    if not any(parts):
        raise TraceError(f"shift phases {text!r}: empty phase list (expected "
                         f"in=MIN:MAX,out=MIN:MAX,rate=R,n=N;...)")
    return [_parse_phase(part, k) for k, part in enumerate(parts, 1)]


def _parse_phase(part: str, k: int) -> Phase:
    where = f"shift phase {k} ({part!r})"
    if not part:
        raise TraceError(f"{where}: empty phase")
    fields: dict[str, str] = {}
    for item in part.split(","):
        key, sep, value = (s.strip() for s in item.partition("="))
        if not sep or key not in _PHASE_KEYS:
            raise TraceError(f"{where}: unknown key {key!r} (expected {', '.join(_PHASE_KEYS)})")
        if key in fields:
            raise TraceError(f"{where}: key {key!r} given twice")
        fields[key] = value
    missing = [key for key in _PHASE_KEYS if key not in fields]
    if missing:
        raise TraceError(f"{where}: missing {', '.join(missing)}")
    try:
        rate = float(fields["rate"])
    except ValueError:
        rate = math.nan
    if not (0 < rate < math.inf):
        raise TraceError(f"{where}: rate={fields['rate']}: must be a finite number > 0 req/s")
    num = _phase_int(fields["n"], f"{where}: n")
    if num < 1:
        raise TraceError(f"{where}: n={num}: must be >= 1")
    return Phase(_phase_range(fields["in"], f"{where}: in"),
                 _phase_range(fields["out"], f"{where}: out"), rate, num)


def _phase_int(text: str, where: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise TraceError(f"{where}={text}: not an integer") from None


def _phase_range(text: str, where: str) -> tuple[int, int]:
    ends = text.split(":")
    if len(ends) > 2:
        raise TraceError(f"{where}={text}: expected MIN:MAX")
    try:
        lo, hi = int(ends[0]), int(ends[-1])
    except ValueError:
        raise TraceError(f"{where}={text}: not an integer") from None
    if not 1 <= lo <= hi:
        raise TraceError(f"{where}={text}: need 1 <= MIN <= MAX")
    return lo, hi


def format_phases(phases: list[Phase]) -> str:
    return ";".join(f"in={p.input_len[0]}:{p.input_len[1]},out={p.output_len[0]}:{p.output_len[1]},"
                    f"rate={p.rate:g},n={p.num}" for p in phases)


def check_window(phases: list[Phase], window: int, template_tokens: int = TEMPLATE_TOKENS) -> None:
    """Raises TraceError for the first phase whose longest request (prompt + output +
    chat template) exceeds ``window`` tokens: the server would refuse it."""
    for k, p in enumerate(phases, 1):
        need = p.input_len[1] + p.output_len[1] + template_tokens
        if need > window:
            raise TraceError(f"shift phase {k}: in max {p.input_len[1]} + out max "
                             f"{p.output_len[1]} + {template_tokens} template tokens = {need} "
                             f"> the model's {window}-token window")


def shift(tokenizer, phases: list[Phase], seed: int = 0, length_dist: str = "uniform",
          burstiness: float = 1.0) -> tuple[list[Request], dict]:
    """Phases back to back; each gap drawn at its request's phase rate (gamma at ``burstiness``).

    Returns (requests, phase windows as columns ``first``, ``n``, ``start_s``, ``end_s``: columns
    because compare.md prints one ``key=value`` each). Raises TraceError."""
    if not phases:
        raise TraceError("shift: no phase")
    if not (0 < burstiness < math.inf):
        raise TraceError(f"burstiness {burstiness}: must be a finite number > 0")
    for p in phases:
        check_range("input length", p.input_len)
        check_range("output length", p.output_len)
    rng = np.random.default_rng(seed)
    words = word_list(tokenizer)
    rates = np.concatenate([np.full(p.num, p.rate) for p in phases])
    gaps = rng.gamma(burstiness, 1.0 / (rates[1:] * burstiness))
    offsets = np.concatenate([[0.0], np.cumsum(gaps)])
    requests: list[Request] = []
    table: dict[str, list] = {"first": [], "n": [], "start_s": [], "end_s": []}
    first = 0
    for p in phases:
        in_lens = draw_lengths(rng, p.num, p.input_len, length_dist)
        out_lens = draw_lengths(rng, p.num, p.output_len, length_dist)
        for i in range(p.num):
            requests.append(Request(offset_s=round(float(offsets[first + i]), 6),
                                    prompt=make_prompt(tokenizer, words, int(in_lens[i]), rng),
                                    max_tokens=int(out_lens[i]), kind="chat",
                                    prompt_tokens=int(in_lens[i])))
        for key, value in (("first", first), ("n", p.num), ("end_s", requests[-1].offset_s),
                           ("start_s", requests[first - 1].offset_s if first else 0.0)):
            table[key].append(value)
        first += p.num
    return requests, table


def split_by_phase(requests: list, table: dict) -> list[list]:
    """Raises TraceError when ``requests`` does not match the table's count."""
    total = sum(table["n"])
    if len(requests) != total:
        raise TraceError(f"{len(requests)} requests, but the phase table has {total}")
    return [requests[first:first + n] for first, n in zip(table["first"], table["n"])]
