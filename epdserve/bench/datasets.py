"""Trace generators: synthetic chat, shared prefixes, chat with long-prompt bursts
(the demo), a workload shifting in phases (:func:`shift`: each phase its own length mix
and rate, e.g. long documents, then long answers, then quiet), and ShareGPT-format JSON
files given by the user. Every generator is seeded and deterministic; lengths come from
:func:`epdserve.bench.prompts.draw_lengths`, send times from
:func:`epdserve.bench.arrivals.arrival_offsets` (the shift phases draw theirs alike).

ShareGPT: the format is the one vLLM's ``bench serve --dataset-name sharegpt`` reads, a
JSON list of ``{"conversations": [{"from": "human" | "gpt", "value": TEXT}, ...], ...}``.
A conversation gives one request: its first human turn is the prompt, and the gpt turn
right after it says how long the answer is (its token count is ``max_tokens``, unless an
output length is given). As in vLLM, conversations are shuffled with the seed and pairs
are skipped when a side is shorter than 4 tokens (too short), or the prompt is longer
than 1024 tokens or prompt + answer longer than 2048 (too long); the counts of skipped
ones are returned so the caller can say them.
"""

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
    """``requests`` with ``per_request`` images of ``size`` = (width, height) pixels each.

    Images are numbered in trace order and the number is the picture's seed (so each is a
    different picture), except that round(``repeat_share`` · N) of the N requests (never
    the first; chosen with ``seed``) send the same images as a random earlier request: an
    encode worker's embedding cache should then hit (vLLM and SGLang key theirs by image
    content too).

    Raises:
        TraceError: ``repeat_share`` outside [0, 1].
    """
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
    """``num_prompts`` chat requests: input/output token lengths from ``length_dist`` over
    the inclusive ranges (:func:`draw_lengths`), arrivals from :func:`arrival_offsets`."""
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
    """``num_prompts`` chat requests, each one of ``prefix_count`` shared prefixes of
    ``prefix_len`` tokens, a space, and its own suffix (lengths from ``suffix_len``).
    Request i takes prefix i mod K (``order`` "round-robin") or a seeded random one
    ("random"). ``prompt_tokens`` is the count of the whole text (a word boundary rarely
    merges two tokens, so it can differ from prefix + suffix by one)."""
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


# Defaults of `make demo`, sized for a 2-core CPU running SmolLM2-135M: 24 chat requests at
# 0.25 req/s arrive over ~95 s and decode 128-256 tokens each (2-5 s of decoding), and 6
# long prompts (~2 s of prefill on two cores, ~4 s on one) land evenly among them, so that
# most long prompts arrive while a chat decodes. A colocated engine then prefills them in
# steps of its budget between the chats' tokens (gaps of ~0.3-0.5 s), a PD decode worker
# keeps decoding (gaps under 0.1 s) and its prefill worker, on one core, answers the long
# prompts later: measured, the split wins at strict gap SLOs with a relaxed TTFT and
# colocated at tight TTFT SLOs (docs/comparing.md).
DEMO_DEFAULTS = dict(num_chat=24, chat_input_len=(50, 250), chat_output_len=(128, 256),
                     chat_rate=0.25, num_long=6, long_input_len=1600, long_output_len=16)
_D = DEMO_DEFAULTS


def demo(tokenizer, num_chat: int = _D["num_chat"], chat_input_len: tuple[int, int] = _D["chat_input_len"],
         chat_output_len: tuple[int, int] = _D["chat_output_len"], chat_rate: float = _D["chat_rate"],
         num_long: int = _D["num_long"], long_input_len: int = _D["long_input_len"],
         long_output_len: int = _D["long_output_len"],
         seed: int = 0, long_burst: int = 1, length_dist: str = "uniform",
         burstiness: float = 1.0, ramp: tuple[float, float] | None = None) -> list[Request]:
    """Chat requests mixed with bursts of long prompts: ``num_chat`` chat requests (as
    :func:`synthetic`, arriving at ``chat_rate`` req/s) and ``num_long`` long prompts of
    ``long_input_len`` tokens with ``long_output_len`` output tokens, in bursts of
    ``long_burst`` sent at the same instant; burst k of B is sent at fraction k/(B+1) of
    the chat arrival window (so they arrive while chat requests decode). Sorted by send
    time."""
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
    """(first human turn, the gpt turn right after it or None) per conversation of a
    ShareGPT JSON file, in file order; conversations without a human turn are left out.

    Raises:
        TraceError: missing/unreadable file, invalid JSON (names file:line), or an entry
            not of the ShareGPT shape (names file:line and the entry's index).
    """
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
    """(line where it starts, value) of each element of the JSON list ``text`` (already
    checked to be valid JSON), or None when ``text`` is not a list. Decoding element by
    element is what lets a schema error name its line."""
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
    """Up to ``num_prompts`` chat requests from the ShareGPT file ``path`` (see the module
    doc), arrivals as :func:`epdserve.bench.arrivals.arrival_offsets`. ``output_len``:
    draw ``max_tokens`` uniformly from this range instead of the answer's length.

    Returns (requests, stats): stats counts ``conversations`` read, ``used``, and
    ``skipped_no_answer``, ``skipped_too_short``, ``skipped_too_long``.

    Raises:
        TraceError: a bad file (see :func:`read_sharegpt`), or no usable conversation.
    """
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


# ---------------------------------------------------------------------------------------
# The shifting workload (--workload shift): phases back to back, each its own mix and rate.

# Sized for a 2-core CPU running SmolLM2-135M (2,048-token window), from the measurements
# above DEMO_DEFAULTS (prefill ~240 tok/s per core, a decode step ~75 ms at batch 1 and
# ~150 ms at batch 8): (1) long documents, short answers: 10 prompts of 1,200-1,700 tokens
# at 0.12 req/s ask ~175 prompt tokens/s, about one core's prefill, so prefill capacity
# decides TTFT (~85 s); (2) short questions, long answers: 24 requests of 200-400 output
# tokens at 0.3 req/s keep ~13 sequences decoding (Little's law at ~45 s each), so decode
# capacity decides ITL (~80 s); (3) quiet: 4 small requests at 0.05 req/s (~80 s), where a
# split idles half its cores. About 4 minutes of arrivals in all.
SHIFT_DEFAULT = ("in=1200:1700,out=8:16,rate=0.12,n=10;"
                 "in=30:120,out=200:400,rate=0.3,n=24;"
                 "in=50:200,out=32:64,rate=0.05,n=4")
# Tokens the server's chat template adds to a prompt: 30 for the default model (SmolLM2's
# system turn and role markers), rounded up.
TEMPLATE_TOKENS = 32
_PHASE_KEYS = ("in", "out", "rate", "n")


@dataclass(frozen=True)
class Phase:
    """One phase of a shifting workload: ``input_len`` and ``output_len`` inclusive token
    ranges (MIN, MAX), ``rate`` (req/s, finite > 0) and ``num`` requests."""

    input_len: tuple[int, int]
    output_len: tuple[int, int]
    rate: float
    num: int


def parse_phases(text: str) -> list[Phase]:
    """The phases of a ``--shift-phases`` SPEC: phases separated by ``;``, each
    ``in=MIN:MAX,out=MIN:MAX,rate=R,n=N`` (all four keys, any order; ``in``/``out`` take a
    single N for a fixed length), e.g. :data:`SHIFT_DEFAULT`. A phase is sized by its
    request count ``n`` (not by seconds) so that the trace's length never depends on the
    seed.

    Raises:
        TraceError: naming the phase (1-based) and the bad part: an empty list or phase, an
            unknown, repeated or missing key, a bad range, a rate not finite and > 0, n < 1.
    """
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
    """The ``--shift-phases`` SPEC of ``phases`` (:func:`parse_phases` reads it back)."""
    return ";".join(f"in={p.input_len[0]}:{p.input_len[1]},out={p.output_len[0]}:{p.output_len[1]},"
                    f"rate={p.rate:g},n={p.num}" for p in phases)


def check_window(phases: list[Phase], window: int, template_tokens: int = TEMPLATE_TOKENS) -> None:
    """TraceError naming the first phase whose longest prompt + longest output + the chat
    template's ``template_tokens`` exceed the model's ``window`` (tokens): its longest
    request would be refused (400 context_length_exceeded)."""
    for k, p in enumerate(phases, 1):
        need = p.input_len[1] + p.output_len[1] + template_tokens
        if need > window:
            raise TraceError(f"shift phase {k}: in max {p.input_len[1]} + out max "
                             f"{p.output_len[1]} + {template_tokens} template tokens = {need} "
                             f"> the model's {window}-token window")


def shift(tokenizer, phases: list[Phase], seed: int = 0, length_dist: str = "uniform",
          burstiness: float = 1.0) -> tuple[list[Request], dict]:
    """A trace in ``phases``, back to back: phase k's ``num`` chat requests, lengths from
    ``length_dist`` over its ranges, each sent a gap after the previous request drawn at
    phase k's rate (Poisson at ``burstiness`` 1, gamma gaps as :func:`arrival_offsets`
    otherwise); the first request at 0.

    Returns (requests in send order, phase windows): a table of one list per column, item
    k for phase k: ``first`` (index of its first request; its requests are ``first ..
    first + n - 1``), ``n``, ``start_s`` (the previous phase's last send, 0 for the first)
    and ``end_s`` (its last send), in seconds. Columns, not rows, because the table goes
    into the workload spec that ``compare.md`` prints one ``key=value`` per item.
    :func:`epdserve.bench.arrivals.retime` scales every offset by one factor, so a
    re-timed shift trace keeps its phases (indices unchanged, every phase's rate times the
    same factor, its times divided by it).

    Raises:
        TraceError: no phase, a bad range or rate, or burstiness not finite and > 0.
    """
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
    """``requests`` (a shift trace, or anything in its order: one result per request) cut
    into its phases by the phase windows of :func:`shift` (``first``, ``n``).

    Raises:
        TraceError: ``requests`` does not have the table's number of requests.
    """
    total = sum(table["n"])
    if len(requests) != total:
        raise TraceError(f"{len(requests)} requests, but the phase table has {total}")
    return [requests[first:first + n] for first, n in zip(table["first"], table["n"])]
