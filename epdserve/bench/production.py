"""Replaying a production trace (Mooncake or Azure) on a small model and machine: fit the rows,
build prompts whose equal hash ids are equal text and token ids (one-token words: a byte-level
BPE never merges across the space before a word), and report how the replay differs; see
docs/comparing.md, "Production traces"."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from epdserve.bench import tables
from epdserve.bench.production_formats import MOONCAKE_BLOCK_TOKENS, TraceFile, TraceRow
from epdserve.bench.prompts import word_list
from epdserve.bench.traces import Request, TraceError

PERCENTILES = (50, 90, 99)


def _half_up(x: float) -> int:
    """Python's round() rounds half to even (2.5 -> 2)."""
    return int(math.floor(x + 0.5))


@dataclass(frozen=True)
class Fit:
    """A window (``start_s``, ``duration_s`` in s; ``num_prompts``), ``time_scale`` on offsets,
    ``length_scale`` on lengths, caps in tokens after scaling; None: unbounded.

    Raises TraceError: a negative start, or a duration, count, scale or cap <= 0."""

    start_s: float = 0.0
    duration_s: float | None = None
    num_prompts: int | None = None
    time_scale: float = 1.0
    length_scale: float = 1.0
    max_input_len: int | None = None
    max_output_len: int | None = None

    def __post_init__(self):
        if not (0 <= self.start_s < math.inf):
            raise TraceError(f"window start {self.start_s} s: must be a finite number >= 0")
        for name in ("duration_s", "num_prompts", "time_scale", "length_scale",
                     "max_input_len", "max_output_len"):
            value = getattr(self, name)
            if value is not None and not (0 < value < math.inf):
                raise TraceError(f"{name} {value}: must be a finite number > 0")

    @property
    def block_tokens(self) -> int:
        """round(512 × length_scale), at least 1."""
        return max(1, _half_up(MOONCAKE_BLOCK_TOKENS * self.length_scale))


def _scaled(n: int, scale: float, cap: int | None) -> int:
    n = max(1, _half_up(n * scale))
    return n if cap is None else min(n, cap)


def fit_rows(rows: tuple[TraceRow, ...] | list[TraceRow], fit: Fit) -> list[TraceRow]:
    """The window's rows: offsets in s from its first request, lengths scaled and capped,
    hash ids cut to the blocks the prompt reaches. Raises TraceError for an empty window."""
    if not rows:
        raise TraceError("the trace has no requests")
    start = rows[0].timestamp_s + fit.start_s
    end = start + fit.duration_s if fit.duration_s is not None else math.inf
    window = [r for r in rows if start <= r.timestamp_s < end][:fit.num_prompts]
    if not window:
        span = rows[-1].timestamp_s - rows[0].timestamp_s
        length = "to the end" if fit.duration_s is None else f"for {fit.duration_s:g} s"
        raise TraceError(f"the window from {fit.start_s:g} s {length} holds no request: the "
                         f"trace's arrivals span 0-{span:.1f} s")
    first, block = window[0].timestamp_s, fit.block_tokens
    fitted = []
    for r in window:
        n_in = _scaled(r.input_len, fit.length_scale, fit.max_input_len)
        ids = None if r.hash_ids is None else r.hash_ids[:math.ceil(n_in / block)]
        fitted.append(TraceRow((r.timestamp_s - first) * fit.time_scale, n_in,
                               _scaled(r.output_len, fit.length_scale, fit.max_output_len), ids))
    return fitted


class PromptBuilder:
    """One seeded block of ``block_tokens`` one-token words per hash id (cached), then the
    request's own words. Raises TraceError when the tokenizer has too few one-token words."""

    def __init__(self, tokenizer, block_tokens: int, seed: int = 0):
        words = [" " + w for w in word_list(tokenizer)]
        counts = tokenizer(words, add_special_tokens=False)["input_ids"]
        self._words = [w for w, ids in zip(words, counts) if len(ids) == 1]
        if len(self._words) < 100:
            raise TraceError("tokenizer has too few one-token words to build trace prompts")
        self._block_tokens = block_tokens
        self._seed = seed
        self._blocks: dict[int, np.ndarray] = {}

    def _block(self, hash_id: int) -> np.ndarray:
        block = self._blocks.get(hash_id)
        if block is None:
            rng = np.random.default_rng([self._seed, 1, hash_id])
            block = self._blocks[hash_id] = rng.integers(0, len(self._words), self._block_tokens)
        return block

    def prompt(self, row: TraceRow, index: int) -> str:
        parts, n = [], 0
        for hash_id in row.hash_ids or ():
            if n >= row.input_len:
                break
            parts.append(self._block(hash_id)[:row.input_len - n])
            n += len(parts[-1])
        if n < row.input_len:
            rng = np.random.default_rng([self._seed, 2, index])
            parts.append(rng.integers(0, len(self._words), row.input_len - n))
        words = self._words
        return "".join([words[i] for i in np.concatenate(parts)])


# The simulator turns a shared start of c characters into c / len(text) of the prompt's tokens.
MARKER_CHARS_PER_TOKEN = 4


def marker_prompt(row: TraceRow, index: int, block_tokens: int) -> str:
    """The planner's stand-in prompt (no tokenizer): each block ``"<id>"`` padded with dots to
    :data:`MARKER_CHARS_PER_TOKEN` characters per token, so equal ids give equal starts (1-token
    blocks may cut long ids)."""
    width, parts, n = MARKER_CHARS_PER_TOKEN * block_tokens, [], 0
    for hash_id in row.hash_ids or ():
        if n >= row.input_len:
            break
        take = min(block_tokens, row.input_len - n)
        parts.append(f"<{hash_id}>".ljust(width, ".")[:MARKER_CHARS_PER_TOKEN * take])
        n += take
    if n < row.input_len:
        own = MARKER_CHARS_PER_TOKEN * (row.input_len - n)
        parts.append(f"<r{index}>".ljust(own, ".")[:own])
    return "".join(parts)


def build_requests(rows: list[TraceRow], tokenizer, block_tokens: int = MOONCAKE_BLOCK_TOKENS,
                   seed: int = 0) -> list[Request]:
    """A prompt of exactly ``input_len`` tokens per row (no chat template); ``tokenizer``
    None gives :func:`marker_prompt` stand-ins. Raises TraceError naming a prompt whose token
    count is off (a tokenizer that joins words)."""
    if tokenizer is None:
        texts = [marker_prompt(r, i, block_tokens) for i, r in enumerate(rows)]
    else:
        builder = PromptBuilder(tokenizer, block_tokens, seed)
        texts = [builder.prompt(r, i) for i, r in enumerate(rows)]
        counts = tokenizer(texts, add_special_tokens=False)["input_ids"]
        for i, (r, ids) in enumerate(zip(rows, counts)):
            if len(ids) != r.input_len:
                raise TraceError(f"request {i}: its prompt of {r.input_len} one-token words "
                                 f"tokenizes to {len(ids)} tokens; this tokenizer joins "
                                 f"words, so trace prompts cannot have exact lengths")
    return [Request(offset_s=round(r.timestamp_s, 6), prompt=text, max_tokens=r.output_len,
                    kind="chat", prompt_tokens=r.input_len) for r, text in zip(rows, texts)]


def replay_trace(trace: TraceFile, fit: Fit, tokenizer, seed: int = 0
                 ) -> tuple[list[Request], dict]:
    """(requests, replay report with the reader's ``reordered_rows`` and
    ``hash_count_mismatches``). Raises TraceError."""
    rows = fit_rows(trace.rows, fit)
    report = describe_replay(trace.rows, rows, fit.block_tokens)
    report.update(reordered_rows=trace.reordered, hash_count_mismatches=trace.hash_count_mismatches)
    return build_requests(rows, tokenizer, fit.block_tokens, seed), report


def shared_token_share(rows, block_tokens: int = MOONCAKE_BLOCK_TOKENS) -> float:
    """Share of prompt tokens in blocks whose id occurred in an earlier row: what an
    unbounded prefix cache could reuse; 0 without hash ids."""
    seen: set[int] = set()
    shared = 0
    for r in rows:
        ids = (r.hash_ids or ())[:math.ceil(r.input_len / block_tokens)]
        shared += sum(min(block_tokens, r.input_len - k * block_tokens)
                      for k, h in enumerate(ids) if h in seen)
        seen.update(ids)
    return shared / sum(r.input_len for r in rows)


def _stats(values) -> dict | None:
    """Mean and p50/p90/p99 (numpy linear); None when empty."""
    x = np.asarray(values, dtype=float)
    if x.size == 0:
        return None
    return {"mean": float(x.mean()), **{f"p{p}": float(np.percentile(x, p)) for p in PERCENTILES}}


def _describe(rows, block_tokens: int) -> dict:
    times = np.array([r.timestamp_s for r in rows])
    return {"count": len(rows), "duration_s": float(times[-1] - times[0]),
            "input_len": _stats([r.input_len for r in rows]),
            "output_len": _stats([r.output_len for r in rows]),
            "inter_arrival_s": _stats(np.diff(times)),
            "shared_prompt_share": shared_token_share(rows, block_tokens)}


def describe_replay(original_rows, replayed_rows,
                    replayed_block_tokens: int = MOONCAKE_BLOCK_TOKENS) -> dict:
    """``{"original", "replayed"}``: ``count``, ``duration_s``, ``input_len``, ``output_len``
    (tokens), ``inter_arrival_s`` as mean/p50/p90/p99 (None for one request), and
    ``shared_prompt_share``, counted within each set."""
    return {"original": _describe(original_rows, MOONCAKE_BLOCK_TOKENS),
            "replayed": _describe(replayed_rows, replayed_block_tokens)}


def _cell(stats: dict | None, fmt) -> str:
    if stats is None:
        return "—"
    return " / ".join(fmt(stats[k]) for k in ("mean", "p50", "p90", "p99"))


def _seconds(x: float) -> str:
    return f"{x:.0f}" if x >= 100 else f"{x:.2f}" if x >= 1 else f"{x:.3f}"


def replay_lines(report: dict) -> list[str]:
    """A markdown table that also lines up as plain text, then the reader's notes."""
    o, r = report["original"], report["replayed"]
    tokens = lambda x: f"{x:.0f}"  # noqa: E731
    rows = [("requests", str(o["count"]), str(r["count"])),
            ("duration (s)", _seconds(o["duration_s"]), _seconds(r["duration_s"]))]
    for key, label, fmt in (("input_len", "input tokens", tokens),
                            ("output_len", "output tokens", tokens),
                            ("inter_arrival_s", "inter-arrival (s)", _seconds)):
        rows.append((f"{label} mean / p50 / p90 / p99", _cell(o[key], fmt), _cell(r[key], fmt)))
    rows.append(("prompt tokens in shared blocks", f"{o['shared_prompt_share']:.0%}",
                 f"{r['shared_prompt_share']:.0%}"))
    lines = tables.markdown(["trace", "original", "replayed"], [list(r) for r in rows],
                            pad=True).splitlines()
    notes = [f"{report[k]} {what}" for k, what in (
        ("reordered_rows", "rows out of time order were sorted"),
        ("hash_count_mismatches", "rows have a hash id count other than ceil(input/512)"))
        if report.get(k)]
    return lines + ([f"Reading the trace: {'; '.join(notes)}."] if notes else [])
