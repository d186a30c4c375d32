"""Trace generators: synthetic chat, shared prefixes, chat with long-prompt bursts
(the demo), and ShareGPT-format JSON files given by the user. Every generator is seeded
and deterministic; lengths come from :func:`epdserve.bench.prompts.draw_lengths`,
send times from :func:`epdserve.bench.arrivals.arrival_offsets`.

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
import re
from dataclasses import replace
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
