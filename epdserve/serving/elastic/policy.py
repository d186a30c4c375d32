"""The elastic controller's policy: which role each engine worker should have, as a
pure function of the signals the router measured over a sliding window.

The router samples its signals every ``--elastic-interval`` seconds (a :class:`Sample`) and
calls :func:`decide` with the samples of the last ``window_s`` seconds; ``epdserve plan``
replays recorded samples through the same function (``epdserve/plan/elastic_replay.py``).
Stdlib only, no router imports, no clock: the same samples always give the same decision.

The choice is between every worker colocated and xPyD (x prefill + y decode workers, x, y >= 1,
x + y = N >= 2). The physics it follows:

* **Interference.** In one engine a long prompt's prefill stalls every running decode: the ITL
  spikes while the decode batch is small (a small batch's step takes ~10-15 ms here, so a
  gap far over the TPOT SLO is a stall). Prompts much longer than the answers: colocated -> xPyD.
* **Decode-heavy mix.** Short prompts and long answers keep many sequences decoding: in 1P1D
  one core carries the whole batch while the prefill worker idles: xPyD -> colocated.
* **Prefill capacity.** A split leaves x of the N workers to prefill every prompt: it pays
  only while they can keep up. The window's prompt tokens per second over the prefill speed
  the router measured (prompt tokens computed per second of TTFT less queue) is the
  prefill load in workers; colocated -> xPyD only while it is at most ``split_util`` of
  the x prefill workers, and 1PyD (no decode worker to give) -> colocated when it is over
  ``overload_util`` of its prefill worker: colocated, every worker prefills.
* **Low load.** Too few requests in flight to overlap: a split only idles a worker (and adds
  a KV hand-off to every TTFT): xPyD -> colocated.
* **Rebalancing xPyD.** Prefill pressure (TTFT or prefill queue over the SLO while decode has
  slack) moves a decode worker to prefill when y > 1; decode pressure (ITL over the SLO with
  big batches or a full KV cache, or requests waiting on decode) moves a prefill worker to
  decode when x > 1, or goes colocated when the mix is decode-heavy.

Never flapping: every condition that leaves a configuration is the far side of a band from
the one that entered it (prompt/answer tokens >= 4 to split, <= 2 to colocate; the other
bands: :class:`PolicyConfig`), so no steady signal moves the roles back and forth. Also: a
minimum dwell (``min_dwell_s``) after every change (as the Kubernetes HPA's stabilization
window), a hold while any worker is switching, only the samples since the last change
settled (older ones describe the old roles), and a hold on too little evidence (under half
a window of them, or fewer than 3 arrivals and 20 ITL gaps; low load needs only the span).
Thresholds and why: docs/elastic.md, "The controller's policy".
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

from epdserve.serving.deployment import ELASTIC_MIN_DWELL_S, ELASTIC_WINDOW_S, natural_order
from epdserve.serving.elastic.samples import Sample


@dataclass(frozen=True)
class PolicyConfig:
    """The SLOs (ms, ``serve --slo ttft:MS tpot:MS``) and thresholds of the policy.
    ``*_enter`` / ``*_leave`` (or ``*_slack``) are the two sides of a hysteresis band; why
    each default: docs/elastic.md, "The controller's policy".

    Raises:
        ValueError: naming the field, for a non-positive SLO, window or dwell (a change needs
            a sample after the last one), a quantile outside (0, 1], or a band whose enter
            side is not beyond its leave side.
    """
    slo_ttft_ms: float
    slo_tpot_ms: float
    window_s: float = ELASTIC_WINDOW_S              # the sliding window (s) ...
    window_arrivals: int = 8            # ... extended back until it holds this many arrivals ...
    max_window_s: float = 120.0         # ... or spans this long (s; window_s if longer): see window()
    min_dwell_s: float = ELASTIC_MIN_DWELL_S           # no change within this long of the last one (s)
    quantile: float = 0.9               # of the window's TTFTs, prefill queue times, ITL gaps
    min_arrivals: int = 3               # evidence: this many arrivals, or ...
    min_itl_gaps: int = 20              # ... this many ITL gaps in the window
    itl_enter: float = 1.2              # ITL p90 > this x TPOT SLO: pressure (or interference)
    itl_slack: float = 0.8              # ITL p90 <= this x TPOT SLO: decode has slack
    stall: float = 2.0                  # an ITL gap > this x TPOT SLO: a stall (interference)
    ttft_enter: float = 1.0             # TTFT p90 > this x TTFT SLO: prefill pressure
    ttft_slack: float = 0.8             # TTFT p90 <= this x TTFT SLO: prefill has slack
    queue_enter: float = 0.5            # prefill queue p90 > this x TTFT SLO: prefill pressure
    prefill_heavy_ratio: float = 4.0    # prompt / answer tokens >= this: prefill-heavy mix
    decode_heavy_ratio: float = 2.0     # prompt / answer tokens <= this: decode-heavy mix
    big_batch: float = 4.0              # running sequences per decode-capable worker: big
    kv_high: float = 0.85               # KV usage p90 (0..1) of decode workers: decode pressure
    decode_waiting_enter: float = 1.0   # requests waiting on decode workers: decode pressure
    low_load_enter: float = 0.2         # in flight per worker < this: low load
    low_load_leave: float = 0.4         # in flight per worker >= this: splitting may pay
    split_util: float = 0.7             # prefill load <= this x the split's prefill workers: may split
    overload_util: float = 0.9          # prefill load > this x 1PyD's prefill worker: colocate

    def __post_init__(self):
        for name in ("slo_ttft_ms", "slo_tpot_ms", "window_s", "min_dwell_s", "itl_enter", "stall",
                     "ttft_enter", "queue_enter", "decode_heavy_ratio", "big_batch",
                     "low_load_enter", "split_util"):
            if not getattr(self, name) > 0 or math.isinf(getattr(self, name)):
                raise ValueError(f"PolicyConfig {name}: expected a finite number > 0, "
                                 f"got {getattr(self, name)!r}")
        if not isinstance(self.window_arrivals, int) or self.window_arrivals < 0:
            raise ValueError(f"PolicyConfig window_arrivals: expected an integer >= 0, got {self.window_arrivals!r}")
        if not 0 < self.quantile <= 1:
            raise ValueError(f"PolicyConfig quantile: expected 0 < q <= 1, got {self.quantile!r}")
        for enter, leave in (("itl_enter", "itl_slack"), ("ttft_enter", "ttft_slack"),
                             ("prefill_heavy_ratio", "decode_heavy_ratio"),
                             ("low_load_leave", "low_load_enter"), ("overload_util", "split_util")):
            if not getattr(self, enter) > getattr(self, leave):
                raise ValueError(f"PolicyConfig {enter} {getattr(self, enter)!r} must be > "
                                 f"{leave} {getattr(self, leave)!r} (a hysteresis band)")


@dataclass(frozen=True)
class PolicyState:
    """What the policy remembers: ``last_switch_t``, when it last changed the roles (the
    samples' clock, s). The hysteresis lives in the thresholds' bands, not in a state."""
    last_switch_t: float = -math.inf


@dataclass(frozen=True)
class Decision:
    """One decision at ``t`` (the last sample's clock, s). ``roles``: the target role of every
    worker (by ``worker_id``), None to hold; ``action``: ``hold``, ``to-colocated``,
    ``to-pd`` or ``rebalance``; ``reason``: one line with the numbers that caused it;
    ``signals``: the windowed numbers it decided on (names: :meth:`Window.as_signals`)."""
    t: float
    roles: dict[str, str] | None
    action: str
    reason: str
    signals: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Window:
    """The windowed numbers of the samples since the last change (:func:`measure`): p90s
    (nearest rank) of the TTFTs, prefill queue times and ITL gaps, means over the samples of
    per-worker counts, the mean prompt and answer (``max_tokens``) of the arrivals, and the
    prefill demand and speed (tokens/s)."""
    span_s: float
    arrivals: int
    prompt_avg: float           # tokens per arriving request
    answer_avg: float           # max_tokens per arriving request
    ttft_p90: float             # ms; 0 without TTFTs (as the p90 of queue and ITL)
    queue_p90: float
    itl_p90: float
    itl_max: float              # ms: the longest gap (a prefill stalling the decodes shows here)
    n_ttft: int
    n_itl: int
    decode_batch: float         # mean running sequences per decode-capable worker
    kv_p90: float               # p90 over samples of the fullest decode-capable worker
    waiting_prefill: float      # mean waiting on prefill-role workers (sum over them)
    waiting_decode: float       # mean waiting on decode-capable workers (sum over them)
    inflight: float             # mean outstanding requests per worker
    demand_tok_s: float = 0.0   # prompt tokens arriving per second (over span_s)
    prefill_tok_s: float = 0.0  # prompt tokens one worker prefills per second; 0: not measured

    def prefill_load(self) -> float | None:
        """The prefill work arriving, in busy workers (demand over one worker's speed);
        None when the speed was not measured (no first token, or an older trace)."""
        return self.demand_tok_s / self.prefill_tok_s if self.prefill_tok_s > 0 else None

    @property
    def ratio(self) -> float:
        """Prompt tokens over answer tokens of the window's arrivals."""
        return self.prompt_avg / max(self.answer_avg, 1.0)

    def as_signals(self) -> dict[str, float]:
        """The numbers as ``Decision.signals`` (units in the names)."""
        return {"span_s": self.span_s, "arrivals": self.arrivals,
                "prompt_avg_tok": self.prompt_avg, "answer_avg_tok": self.answer_avg,
                "prompt_answer_ratio": self.ratio, "ttft_p90_ms": self.ttft_p90,
                "prefill_queue_p90_ms": self.queue_p90, "itl_p90_ms": self.itl_p90,
                "itl_max_ms": self.itl_max,
                "ttfts": self.n_ttft, "itl_gaps": self.n_itl, "decode_batch": self.decode_batch,
                "kv_usage_p90": self.kv_p90, "waiting_prefill": self.waiting_prefill,
                "waiting_decode": self.waiting_decode, "inflight_per_worker": self.inflight,
                "prefill_demand_tok_s": self.demand_tok_s, "prefill_speed_tok_s": self.prefill_tok_s}


def _quantile(values: list[float], q: float) -> float:
    """Nearest-rank quantile (the smallest value with at least q of them at or below it);
    0.0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[max(math.ceil(q * len(ordered)) - 1, 0)]


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


MIN_SPEED_TOKENS = 64  # shorter prefills are mostly fixed costs: no measure of the speed


def window(samples: Sequence[Sample], config: PolicyConfig) -> list[Sample]:
    """The samples a decision reads, of ``samples`` (oldest first; the last is now): those
    of the last ``window_s`` seconds, extended back whole samples at a time while they hold
    fewer than ``window_arrivals`` arrivals, up to ``max_window_s`` (or ``window_s`` if
    longer). At 0.12 req/s twenty seconds hold two or three arrivals: no measure of a mix,
    a load or the requests in flight (measured: a lull of one arrival in 18 s read as low
    load and undid a split a minute into a phase that needed it); eight arrivals put the
    count's spread at ~35 %.
    The router's controller keeps, and ``epdserve plan`` replays, exactly these."""
    samples = list(samples)  # the controller keeps a deque, which does not slice
    now, start, arrivals = samples[-1].t, len(samples), 0
    longest = max(config.max_window_s, config.window_s)
    for i in range(len(samples) - 1, -1, -1):
        age_ok = samples[i].t > now - config.window_s
        if not age_ok and (arrivals >= config.window_arrivals or samples[i].t <= now - longest):
            break
        arrivals += len(samples[i].arrivals)
        start = i
    return list(samples[start:])


def measure(samples: Sequence[Sample], q: float) -> Window:
    """The windowed numbers of ``samples`` (oldest first, at least one), with ``q`` the
    quantile of the per-event values. Decode-capable workers: colocated and decode."""
    arrivals = [a for s in samples for a in s.arrivals]
    decoders = [[w for w in s.workers if w.role != "prefill"] for s in samples]
    span_s = samples[-1].t - samples[0].t
    # TTFT less queue is the prefill (and the hops, a few ms); the fastest of the window's
    # prefills is the speed: two prompts prefilled together (chunked prefill shares the
    # steps) each take longer than one alone.
    speeds = [n / (t - q) * 1e3 for s in samples
              for t, q, n in zip(s.ttfts_ms, s.prefill_queue_ms, s.prefill_tokens)
              if n >= MIN_SPEED_TOKENS and t > q]
    return Window(
        span_s=span_s,
        arrivals=len(arrivals),
        prompt_avg=_mean([p for p, _ in arrivals]), answer_avg=_mean([m for _, m in arrivals]),
        ttft_p90=_quantile([x for s in samples for x in s.ttfts_ms], q),
        queue_p90=_quantile([x for s in samples for x in s.prefill_queue_ms], q),
        itl_p90=_quantile([x for s in samples for x in s.itls_ms], q),
        itl_max=max((x for s in samples for x in s.itls_ms), default=0.0),
        n_ttft=sum(len(s.ttfts_ms) for s in samples),
        n_itl=sum(len(s.itls_ms) for s in samples),
        decode_batch=_mean([_mean([w.num_running for w in d]) for d in decoders if d]),
        kv_p90=_quantile([max(w.kv_usage for w in d) for d in decoders if d], q),
        waiting_prefill=_mean([sum(w.num_waiting for w in s.workers if w.role == "prefill")
                               for s in samples]),
        waiting_decode=_mean([sum(w.num_waiting for w in d) for d in decoders]),
        inflight=_mean([_mean([w.outstanding for w in s.workers])
                        for s in samples if s.workers]),
        demand_tok_s=sum(p for p, _ in arrivals) / span_s if span_s > 0 else 0.0,
        prefill_tok_s=max(speeds, default=0.0))


@dataclass(frozen=True)
class _Layout:
    """The roles of the last sample: every worker's id (natural order) by role."""
    prefill: tuple[str, ...]
    decode: tuple[str, ...]
    colocated: tuple[str, ...]
    outstanding: dict[str, int]


def _layout(sample: Sample) -> _Layout:
    ids = sorted((w.worker_id for w in sample.workers), key=natural_order)
    role = {w.worker_id: w.role for w in sample.workers}
    return _Layout(*(tuple(i for i in ids if role[i] == r)
                     for r in ("prefill", "decode", "colocated")),
                   outstanding={w.worker_id: w.outstanding for w in sample.workers})


def _guard(now: Sample, state: PolicyState, config: PolicyConfig) -> str | None:
    """Why no decision may be taken now (a hold reason), or None."""
    if len(now.workers) < 2:
        return f"{len(now.workers)} live worker(s): a split needs >= 2"
    switching = [w.worker_id for w in now.workers if w.switching]
    if switching:
        return f"{', '.join(switching)} still switching"
    if now.t - state.last_switch_t < config.min_dwell_s:
        return (f"{now.t - state.last_switch_t:.1f} s since the last change "
                f"< min dwell {config.min_dwell_s:g} s")
    lay = _layout(now)
    mixed = lay.colocated and (lay.prefill or lay.decode)
    if mixed or not lay.colocated and not (lay.prefill and lay.decode):
        return (f"roles {len(lay.colocated)} colocated / {len(lay.prefill)} prefill / "
                f"{len(lay.decode)} decode are neither all colocated nor xPyD")
    return None


def settled(samples: Sequence[Sample], since: float) -> list[Sample]:
    """The samples of the workers and roles now (the last sample's): those after the last
    change (at ``since``) and after the last sample that shows other live workers or roles,
    or a worker switching. Earlier ones describe other workers: the old roles, a worker down
    or not yet added, and at start-up none at all (measured: a start-up's empty samples read
    as "0 arrivals: low load" and undid ``--mode pd`` a second after its workers were up)."""
    if not samples:
        return []
    now = _roles(samples[-1])
    kept = len(samples)
    while kept > 0 and samples[kept - 1].t > since and _roles(samples[kept - 1]) == now:
        kept -= 1
    return list(samples[kept:])


def _roles(sample: Sample) -> frozenset:
    return frozenset((w.worker_id, w.role, w.switching) for w in sample.workers)


def _no_evidence(win: Window, c: PolicyConfig) -> str | None:
    """The hold reason of too little evidence, or None: half a window of samples (after a
    long drain, seconds of the new roles are no measurement) and arrivals or ITL gaps."""
    if win.span_s < c.window_s / 2:
        return f"too little evidence: {win.span_s:.0f} s of settled samples < {c.window_s / 2:g} s"
    if win.arrivals >= c.min_arrivals or win.n_itl >= c.min_itl_gaps:
        return None
    return (f"too little evidence: {win.arrivals} arrivals < {c.min_arrivals} and "
            f"{win.n_itl} ITL gaps < {c.min_itl_gaps}")


def _load(win: Window) -> str:
    return (f"prefill load {win.prefill_load():.2f} workers ({win.demand_tok_s:.0f} prompt tok/s at "
            f"{win.prefill_tok_s:.0f} tok/s a worker)")


def _mix(win: Window) -> str:
    return (f"prompts avg {win.prompt_avg:.0f} tok / answers {win.answer_avg:.0f} tok "
            f"({win.ratio:.1f}x)")


def _interference(win: Window, c: PolicyConfig) -> str | None:
    """Prefill interference in colocated engines: the window's longest ITL gap is a stall
    (over ``stall`` x the TPOT SLO) that breaks a stalled answer's TPOT (the stall over the
    mean answer plus the ITL p90 > the TPOT SLO) while the decode batch is small, with a
    prefill-heavy mix and enough load for requests to overlap. The longest gap, not a p90: with short answers
    a stall is one gap of a dozen per request, invisible in a p90, yet it alone breaks the
    request's TPOT (a 6 s prefill over 12 tokens adds 500 ms to each)."""
    # The stall spread over an answer, on top of the usual gap: the TPOT of a stalled
    # request. A 3.3 s stall in a 126-token answer adds 26 ms, far inside a 250 ms TPOT:
    # then a split would halve the prefill capacity and save no request.
    stalled_tpot = win.itl_max / max(win.answer_avg, 1.0) + win.itl_p90
    if (win.arrivals >= c.min_arrivals and win.ratio >= c.prefill_heavy_ratio
            and win.itl_max > c.stall * c.slo_tpot_ms and stalled_tpot > c.slo_tpot_ms
            and win.decode_batch < c.big_batch and win.inflight >= c.low_load_leave):
        return (f"longest ITL gap {win.itl_max:.0f} ms > {c.stall:g} x TPOT SLO {c.slo_tpot_ms:g} ms "
                f"(a stalled answer's TPOT ~{stalled_tpot:.0f} ms) at decode batch {win.decode_batch:.1f} "
                f"< {c.big_batch:g} while {_mix(win)} >= {c.prefill_heavy_ratio:g}x: prefill interference")
    return None


def _low_load(win: Window, c: PolicyConfig) -> str | None:
    """Too few requests in flight for a split to pay (Little's law: arrival rate x time in
    the system), over at least half a window so that a short lull is not low load."""
    if win.inflight < c.low_load_enter and win.span_s >= c.window_s / 2:
        return (f"{win.inflight:.2f} requests in flight per worker < {c.low_load_enter:g} "
                f"({win.arrivals} arrivals in {win.span_s:.0f} s): low load, a split idles "
                f"a worker")
    return None


def _decode_pressure(win: Window, c: PolicyConfig) -> str | None:
    """Decode capacity is short: ITL over the SLO with big batches or a full KV cache, or
    requests waiting on the decode workers."""
    if win.itl_p90 > c.itl_enter * c.slo_tpot_ms and (win.decode_batch >= c.big_batch
                                                      or win.kv_p90 >= c.kv_high):
        return (f"ITL p90 {win.itl_p90:.0f} ms > {c.itl_enter:g} x TPOT SLO {c.slo_tpot_ms:g} ms "
                f"at decode batch {win.decode_batch:.1f}, KV p90 {win.kv_p90:.0%}")
    if win.waiting_decode >= c.decode_waiting_enter:
        return f"{win.waiting_decode:.1f} requests waiting on decode >= {c.decode_waiting_enter:g}"
    return None


def _decode_heavy(win: Window, c: PolicyConfig, pressure: str | None) -> str | None:
    """Short prompts, long answers, decode busy: every worker should decode (no long prefills
    to blame: an ITL p90 over the SLO is decode load at any batch size)."""
    if win.arrivals < c.min_arrivals or win.ratio > c.decode_heavy_ratio:
        return None
    heavy = f"while {_mix(win)} <= {c.decode_heavy_ratio:g}x: decode-heavy"
    if pressure:
        return f"{pressure} {heavy}"
    if win.itl_p90 > c.itl_enter * c.slo_tpot_ms:
        return (f"ITL p90 {win.itl_p90:.0f} ms > {c.itl_enter:g} x TPOT SLO {c.slo_tpot_ms:g} ms "
                f"at decode batch {win.decode_batch:.1f} {heavy}")
    if win.decode_batch >= c.big_batch:
        return (f"decode batch {win.decode_batch:.1f} >= {c.big_batch:g} {heavy}, "
                f"the prefill side idles")
    return None


def _prefill_pressure(win: Window, c: PolicyConfig) -> str | None:
    """Prefill capacity is short (TTFT or prefill queue p90 over the SLO) while decode has
    slack (ITL p90 well under the SLO, nothing waiting, KV not full)."""
    if win.ttft_p90 > c.ttft_enter * c.slo_ttft_ms:
        short = (f"TTFT p90 {win.ttft_p90:.0f} ms > {c.ttft_enter:g} x TTFT SLO "
                 f"{c.slo_ttft_ms:g} ms")
    elif win.queue_p90 > c.queue_enter * c.slo_ttft_ms:
        short = (f"prefill queue p90 {win.queue_p90:.0f} ms > {c.queue_enter:g} x TTFT SLO "
                 f"{c.slo_ttft_ms:g} ms")
    else:
        return None
    if (win.itl_p90 <= c.itl_slack * c.slo_tpot_ms and win.kv_p90 < c.kv_high
            and win.waiting_decode < c.decode_waiting_enter):
        return (f"{short} while decode has slack (ITL p90 {win.itl_p90:.0f} ms <= "
                f"{c.itl_slack:g} x TPOT SLO, {win.waiting_decode:.1f} waiting, "
                f"KV p90 {win.kv_p90:.0%})")
    return None


def _split(lay: _Layout) -> tuple[dict[str, str], str]:
    """Colocated -> xPyD (roles, and "xPyD"): the prefill-heavy mix that caused it gets the
    odd worker (x = ceil(N / 2)); rebalancing moves on from there. Prefill: the first ids."""
    ids = sorted(lay.colocated, key=natural_order)
    x = (len(ids) + 1) // 2
    return {i: "prefill" if k < x else "decode" for k, i in enumerate(ids)}, f"{x}P{len(ids) - x}D"


def _move(lay: _Layout, source: str, target: str) -> tuple[dict[str, str], str]:
    """Roles with one worker of ``source`` moved to ``target``: the one with the fewest
    outstanding requests (the quickest drain; ties: natural id order), and a label."""
    roles = {**{i: "prefill" for i in lay.prefill}, **{i: "decode" for i in lay.decode}}
    donors = lay.prefill if source == "prefill" else lay.decode
    mover = min(donors, key=lambda i: (lay.outstanding[i], natural_order(i)))
    roles[mover] = target
    x = sum(r == "prefill" for r in roles.values())
    return roles, f"{mover} {source} -> {target} ({x}P{len(roles) - x}D)"


def _from_colocated(win: Window, lay: _Layout, c: PolicyConfig) -> tuple[str, dict | None, str]:
    """(action, roles or None, reason) for colocated workers: split on interference."""
    thin = _no_evidence(win, c)
    if thin:
        return "hold", None, thin
    reason = _interference(win, c)
    if reason and win.ttft_p90 > c.ttft_slack * c.slo_ttft_ms:
        # A split takes workers from prefill: with the TTFT already near its SLO it would
        # trade the stalls for missed first tokens.
        return "hold", None, (f"{reason}, but TTFT p90 {win.ttft_p90:.0f} ms > {c.ttft_slack:g} x TTFT SLO "
                              f"{c.slo_ttft_ms:g} ms: no prefill capacity to spare for a split")
    if reason:
        roles, shape = _split(lay)
        x = sum(r == "prefill" for r in roles.values())
        load = win.prefill_load()
        if load is not None and load > c.split_util * x:
            return "hold", None, (f"{reason}, but {_load(win)}: {x} prefill worker(s) could not keep up "
                                  f"(> {c.split_util:g} each)")
        return "to-pd", roles, (f"{reason}; TTFT p90 {win.ttft_p90:.0f} ms <= {c.ttft_slack:g} x TTFT SLO"
                                f"{f' and {_load(win)}' if load is not None else ''}: prefill can spare "
                                f"a worker -> {shape}")
    return "hold", None, (f"colocated: no interference (ITL p90 {win.itl_p90:.0f} ms, "
                          f"decode batch {win.decode_batch:.1f}, {_mix(win)})")


def _from_pd(win: Window, lay: _Layout, c: PolicyConfig) -> tuple[str, dict | None, str]:
    """(action, roles or None, reason) for xPyD: colocate at low load or for a decode-heavy
    mix, else move one worker toward the side under pressure."""
    colocated = {i: "colocated" for i in lay.prefill + lay.decode}
    low = _low_load(win, c)
    if low:
        return "to-colocated", colocated, f"{low} -> colocated"
    thin = _no_evidence(win, c)
    if thin:
        return "hold", None, thin
    decode_short = _decode_pressure(win, c)
    heavy = _decode_heavy(win, c, decode_short)
    if heavy:
        return "to-colocated", colocated, f"{heavy} -> colocated"
    prefill_short = _prefill_pressure(win, c)
    if prefill_short and len(lay.decode) > 1:
        roles, moved = _move(lay, "decode", "prefill")
        return "rebalance", roles, f"{prefill_short}: prefill pressure -> {moved}"
    load = win.prefill_load()
    if (len(lay.decode) == 1 and load is not None and load > c.overload_util * len(lay.prefill)
            and win.ttft_p90 > c.ttft_slack * c.slo_ttft_ms):
        # Both: a burst of arrivals lifts the load for a window without the TTFTs suffering.
        return "to-colocated", colocated, (f"{_load(win)} > {c.overload_util:g} x {len(lay.prefill)} prefill "
                                           f"worker(s) and TTFT p90 {win.ttft_p90:.0f} ms > {c.ttft_slack:g} x "
                                           f"TTFT SLO, no decode worker to spare -> colocated (every worker "
                                           f"prefills)")
    if decode_short and len(lay.prefill) > 1 and win.ttft_p90 <= c.ttft_slack * c.slo_ttft_ms:
        roles, moved = _move(lay, "prefill", "decode")
        return "rebalance", roles, (f"{decode_short} while TTFT p90 {win.ttft_p90:.0f} ms <= "
                                    f"{c.ttft_slack:g} x TTFT SLO: decode pressure -> {moved}")
    return "hold", None, (f"{len(lay.prefill)}P{len(lay.decode)}D kept: prefill "
                          f"{prefill_short or 'no pressure'}; decode "
                          f"{decode_short or 'no pressure'}; {_mix(win)}")


def decide(samples: Sequence[Sample], state: PolicyState,
           config: PolicyConfig) -> tuple[Decision, PolicyState]:
    """The roles the workers should have now, and the policy's next state.

    ``samples``: every sample of the window (oldest first; the last is now). Holds while fewer
    than 2 workers live, any worker is switching, less than ``min_dwell_s`` passed since the
    last change, or the roles are neither all colocated nor xPyD; otherwise the rules of the
    module docstring run on the samples taken since the last change settled. A decision that
    changes roles sets ``last_switch_t`` to the last sample's ``t``.

    Raises:
        ValueError: for no samples.
    """
    if not samples:
        raise ValueError("decide: no samples in the window (the last one is now)")
    now = samples[-1]
    held = _guard(now, state, config)
    if held:
        return Decision(now.t, None, "hold", held), state
    win = measure(settled(samples, state.last_switch_t), config.quantile)
    lay = _layout(now)
    rule = _from_colocated if lay.colocated else _from_pd
    action, roles, reason = rule(win, lay, config)
    decision = Decision(now.t, roles, action, reason, win.as_signals())
    return decision, (state if roles is None else PolicyState(last_switch_t=now.t))
