"""Replaying a production trace (Mooncake or Azure, read by
:mod:`epdserve.bench.production_formats`) on a small model and machine.

Three steps, each a function of its own so that the planner can use the first without text:

1. :func:`fit_rows` — the rows to replay (:class:`Fit`): a time window (``start_s``,
   ``duration_s``, ``num_prompts``), arrival offsets from 0 at the window's first request
   and multiplied by ``time_scale``, input and output lengths multiplied by
   ``length_scale`` (rounded half up, at least 1 token) and then capped
   (``max_input_len``, ``max_output_len``). A Mooncake block becomes
   :attr:`Fit.block_tokens` = round(512 × ``length_scale``) tokens (>= 1), and a prompt
   keeps the ids of the blocks its scaled, capped length still reaches: a capped prompt
   keeps its first blocks.
2. :func:`build_requests` — prompt text in which equal hash ids are equal text *and* equal
   token ids, so that the trace's prefix sharing is real for any engine's prefix cache:
   every block is a seeded run of common words of the tokenizer's vocabulary that are one
   token each with their leading space (`` the``, `` and``, ...). A byte-level BPE
   pre-tokenizer (GPT-2's, Llama 3's, Qwen's, SmolLM's) never merges across the space
   before a word, so the prompt tokenizes to exactly the concatenation of its blocks'
   tokens: one token per word, and the count is exact. Tokens past a prompt's last hash id
   (or of an Azure row, which has none) are the request's own seeded words. Each built
   prompt's count is checked with the tokenizer. A prompt starts with a space; a chat
   template that trims its message (Llama 3's does) changes the first word's tokens, the
   same way for every prompt, so the sharing holds.
3. :func:`describe_replay` and :func:`replay_lines` — how the replayed rows differ from the
   whole original: count, duration, input/output length and inter-arrival mean and
   percentiles, and the share of prompt tokens in shared blocks.
"""

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
    """``x`` rounded half up (Python's round() rounds half to even: 2.5 -> 2)."""
    return int(math.floor(x + 0.5))


@dataclass(frozen=True)
class Fit:
    """How a production trace is fitted to a smaller model and machine.

    ``start_s`` (s): the window starts this long after the trace's first arrival;
    ``duration_s`` (s, None = to the end): it ends this long after its start;
    ``num_prompts`` (None = all): at most this many requests, the window's first ones;
    ``time_scale``: every arrival offset is multiplied by it (0.1 replays 10 minutes of
    trace in 1; 2 at half speed); ``length_scale``: input and output token lengths are
    multiplied by it; ``max_input_len`` / ``max_output_len`` (tokens, None = no cap):
    caps applied after scaling.

    Raises:
        TraceError: a negative start, or a duration, count, scale or cap <= 0.
    """

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
        """Tokens of one replayed Mooncake block: round(512 × length_scale), at least 1."""
        return max(1, _half_up(MOONCAKE_BLOCK_TOKENS * self.length_scale))


def _scaled(n: int, scale: float, cap: int | None) -> int:
    n = max(1, _half_up(n * scale))
    return n if cap is None else min(n, cap)


def fit_rows(rows: tuple[TraceRow, ...] | list[TraceRow], fit: Fit) -> list[TraceRow]:
    """The rows of ``rows`` (sorted by arrival, as a :class:`TraceFile` holds them) that
    ``fit`` replays, fitted (see the module doc): timestamps are send offsets in seconds
    from the window's first request (0), lengths scaled and capped, hash ids cut to the
    blocks of :attr:`Fit.block_tokens` the prompt reaches.

    Raises:
        TraceError: the window holds no request (names the window and the trace's span).
    """
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
    """Prompt text for fitted rows: one seeded block of ``block_tokens`` words per hash id
    (cached, so a trace's ~100k ids cost one draw each), the request's own words after its
    last id. Words are one token each, so a text of n words is n tokens (module doc).

    Raises:
        TraceError: the tokenizer has too few one-token words.
    """

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
        """Word indices of the block ``hash_id`` (the same for the same id and seed)."""
        block = self._blocks.get(hash_id)
        if block is None:
            rng = np.random.default_rng([self._seed, 1, hash_id])
            block = self._blocks[hash_id] = rng.integers(0, len(self._words), self._block_tokens)
        return block

    def prompt(self, row: TraceRow, index: int) -> str:
        """The text of ``row``, request ``index`` of the replay: its blocks, the last one cut
        to ``row.input_len``, then words of its own (seeded by ``index``) up to that length."""
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


# Characters per token of the planner's stand-in prompts: the simulator turns a shared
# start of c characters into c / len(text) of the prompt's tokens (plan/sim_worker.py).
MARKER_CHARS_PER_TOKEN = 4


def marker_prompt(row: TraceRow, index: int, block_tokens: int) -> str:
    """A stand-in prompt for the planner, which needs no tokenizer but must see the
    trace's prefix sharing: :data:`MARKER_CHARS_PER_TOKEN` characters per token, each
    block ``"<id>"`` padded with dots, the last block cut to ``row.input_len``, then the
    request's own part ``"<r index>"`` padded. Equal ids give equal starts; a different id
    differs within its first characters (blocks of 1 token, 4 characters, may cut long
    ids: two such blocks can then look equal)."""
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
    """Chat requests of fitted ``rows``: sent at ``timestamp_s``, ``max_tokens`` =
    ``output_len``, a prompt of exactly ``input_len`` tokens (text only, no chat template)
    from :class:`PromptBuilder`. ``tokenizer`` None gives the planner's stand-in prompts
    (:func:`marker_prompt`: not text to send, but with the trace's prefix sharing).

    Raises:
        TraceError: a prompt does not tokenize to its length (a tokenizer that merges
            tokens across words; names the request).
    """
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
    """The requests replaying ``trace`` as ``fit`` says (:func:`fit_rows`,
    :func:`build_requests`; ``tokenizer`` None: the planner's stand-in prompts) and the report
    (:func:`describe_replay`) with the reader's counts of ``reordered_rows`` and
    ``hash_count_mismatches``.

    Raises:
        TraceError: an empty window, or prompts that cannot be built.
    """
    rows = fit_rows(trace.rows, fit)
    report = describe_replay(trace.rows, rows, fit.block_tokens)
    report.update(reordered_rows=trace.reordered, hash_count_mismatches=trace.hash_count_mismatches)
    return build_requests(rows, tokenizer, fit.block_tokens, seed), report


# ---------------------------------------------------------------------------------------
# The replay report


def shared_token_share(rows, block_tokens: int = MOONCAKE_BLOCK_TOKENS) -> float:
    """Share of all prompt tokens of ``rows`` that lie in blocks whose hash id occurred in an
    earlier row (blocks of ``block_tokens``, the last one cut to the prompt's length): what
    an unbounded prefix cache could reuse. 0 for rows without hash ids."""
    seen: set[int] = set()
    shared = 0
    for r in rows:
        ids = (r.hash_ids or ())[:math.ceil(r.input_len / block_tokens)]
        shared += sum(min(block_tokens, r.input_len - k * block_tokens)
                      for k, h in enumerate(ids) if h in seen)
        seen.update(ids)
    return shared / sum(r.input_len for r in rows)


def _stats(values) -> dict | None:
    """mean and p50/p90/p99 (numpy.percentile, linear) of ``values``; None when empty."""
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
    """How the replay differs from the trace: ``{"original": ..., "replayed": ...}``, each
    with ``count``, ``duration_s`` (first to last arrival, s), ``input_len`` and
    ``output_len`` (tokens) and ``inter_arrival_s`` (s) as ``{"mean", "p50", "p90", "p99"}``
    (None with a single request), and ``shared_prompt_share`` (:func:`shared_token_share`;
    original blocks are 512 tokens, replayed ones ``replayed_block_tokens``, see
    :attr:`Fit.block_tokens`; sharing is counted within each set, so a window that starts
    mid-trace shares less than the whole)."""
    return {"original": _describe(original_rows, MOONCAKE_BLOCK_TOKENS),
            "replayed": _describe(replayed_rows, replayed_block_tokens)}


def _cell(stats: dict | None, fmt) -> str:
    if stats is None:
        return "—"
    return " / ".join(fmt(stats[k]) for k in ("mean", "p50", "p90", "p99"))


def _seconds(x: float) -> str:
    return f"{x:.0f}" if x >= 100 else f"{x:.2f}" if x >= 1 else f"{x:.3f}"


def replay_lines(report: dict) -> list[str]:
    """:func:`describe_replay`'s report as a markdown table whose columns also line up as
    plain text: one row per figure, original and replayed side by side, then a line on
    rows the reader sorted or whose hash id count was odd (from :func:`replay_trace`)."""
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
