"""The elastic role policy: every engine worker's role, all colocated or xPyD (x, y >= 1), as a
pure function of the router's samples (stdlib only, no clock: ``epdserve plan`` replays it).
Rules, hysteresis bands, dwell, evidence and why each threshold: docs/elastic.md, "The
controller's policy"."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

from epdserve.serving.deployment import ELASTIC_MIN_DWELL_S, ELASTIC_WINDOW_S, natural_order
from epdserve.serving.elastic.samples import Sample
from epdserve.serving.elastic.windowed import Window, measure, settled


@dataclass(frozen=True)
class PolicyConfig:
    """SLOs (ms, ``serve --slo``) and thresholds; ``*_enter`` / ``*_leave`` (or ``*_slack``) bound a
    hysteresis band. Raises ValueError naming the field: a non-positive SLO, window or dwell, a
    quantile outside (0, 1], or a band whose enter side is not beyond its leave side."""
    slo_ttft_ms: float
    slo_tpot_ms: float
    window_s: float = ELASTIC_WINDOW_S
    window_arrivals: int = 8            # window(): extended back to this many arrivals, up to max_window_s
    max_window_s: float = 120.0
    min_dwell_s: float = ELASTIC_MIN_DWELL_S
    quantile: float = 0.9
    min_arrivals: int = 3               # evidence: this many arrivals or min_itl_gaps ITL gaps
    min_itl_gaps: int = 20
    # x the SLO: ITL / TTFT / prefill queue p90 over *_enter is pressure, at most *_slack is slack;
    # one ITL gap over stall x TPOT SLO is a stall (interference)
    itl_enter: float = 1.2
    itl_slack: float = 0.8
    stall: float = 2.0
    ttft_enter: float = 1.0
    ttft_slack: float = 0.8
    queue_enter: float = 0.5
    prefill_heavy_ratio: float = 4.0    # prompt / answer tokens
    decode_heavy_ratio: float = 2.0
    big_batch: float = 4.0              # running sequences per decode-capable worker
    kv_high: float = 0.85               # KV usage p90 (0..1)
    decode_waiting_enter: float = 1.0
    low_load_enter: float = 0.2         # requests in flight per worker
    low_load_leave: float = 0.4
    split_util: float = 0.7             # prefill load over the prefill workers: at most to split, over to leave 1PyD
    overload_util: float = 0.9

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
    """``last_switch_t``: the last change of roles (s, the samples' clock)."""
    last_switch_t: float = -math.inf


@dataclass(frozen=True)
class Decision:
    """At ``t`` (s, the last sample's): ``roles`` by worker id (None: hold); ``action``: ``hold``,
    ``to-colocated``, ``to-pd`` or ``rebalance``; ``signals``: :meth:`Window.as_signals`."""
    t: float
    roles: dict[str, str] | None
    action: str
    reason: str
    signals: dict[str, float] = field(default_factory=dict)


def window(samples: Sequence[Sample], config: PolicyConfig) -> list[Sample]:
    """The last ``window_s`` of ``samples`` (oldest first), extended back while they hold fewer than
    ``window_arrivals`` arrivals, up to ``max_window_s``; why: docs/elastic.md."""
    samples = list(samples)  # a deque does not slice
    now, start, arrivals = samples[-1].t, len(samples), 0
    longest = max(config.max_window_s, config.window_s)
    for i in range(len(samples) - 1, -1, -1):
        age_ok = samples[i].t > now - config.window_s
        if not age_ok and (arrivals >= config.window_arrivals or samples[i].t <= now - longest):
            break
        arrivals += len(samples[i].arrivals)
        start = i
    return list(samples[start:])


@dataclass(frozen=True)
class _Layout:
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


def _no_evidence(win: Window, c: PolicyConfig) -> str | None:
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
    """The longest ITL gap, not a p90: with short answers one stall hides in a p90 yet breaks TPOT."""
    # A stalled request's TPOT: a stall spread over a long answer may break no SLO
    stalled_tpot = win.itl_max / max(win.answer_avg, 1.0) + win.itl_p90
    if (win.arrivals >= c.min_arrivals and win.ratio >= c.prefill_heavy_ratio
            and win.itl_max > c.stall * c.slo_tpot_ms and stalled_tpot > c.slo_tpot_ms
            and win.decode_batch < c.big_batch and win.inflight >= c.low_load_leave):
        return (f"longest ITL gap {win.itl_max:.0f} ms > {c.stall:g} x TPOT SLO {c.slo_tpot_ms:g} ms "
                f"(a stalled answer's TPOT ~{stalled_tpot:.0f} ms) at decode batch {win.decode_batch:.1f} "
                f"< {c.big_batch:g} while {_mix(win)} >= {c.prefill_heavy_ratio:g}x: prefill interference")
    return None


def _low_load(win: Window, c: PolicyConfig) -> str | None:
    if win.inflight < c.low_load_enter and win.span_s >= c.window_s / 2:
        return (f"{win.inflight:.2f} requests in flight per worker < {c.low_load_enter:g} "
                f"({win.arrivals} arrivals in {win.span_s:.0f} s): low load, a split idles "
                f"a worker")
    return None


def _decode_pressure(win: Window, c: PolicyConfig) -> str | None:
    if win.itl_p90 > c.itl_enter * c.slo_tpot_ms and (win.decode_batch >= c.big_batch
                                                      or win.kv_p90 >= c.kv_high):
        return (f"ITL p90 {win.itl_p90:.0f} ms > {c.itl_enter:g} x TPOT SLO {c.slo_tpot_ms:g} ms "
                f"at decode batch {win.decode_batch:.1f}, KV p90 {win.kv_p90:.0%}")
    if win.waiting_decode >= c.decode_waiting_enter:
        return f"{win.waiting_decode:.1f} requests waiting on decode >= {c.decode_waiting_enter:g}"
    return None


def _decode_heavy(win: Window, c: PolicyConfig, pressure: str | None) -> str | None:
    """With short prompts an ITL p90 over the SLO is decode load at any batch size."""
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
    """x = ceil(N / 2): the prefill-heavy mix gets the odd worker; prefill takes the first ids."""
    ids = sorted(lay.colocated, key=natural_order)
    x = (len(ids) + 1) // 2
    return {i: "prefill" if k < x else "decode" for k, i in enumerate(ids)}, f"{x}P{len(ids) - x}D"


def _move(lay: _Layout, source: str, target: str) -> tuple[dict[str, str], str]:
    """Moves the ``source`` worker with the fewest outstanding requests (the quickest drain)."""
    roles = {**{i: "prefill" for i in lay.prefill}, **{i: "decode" for i in lay.decode}}
    donors = lay.prefill if source == "prefill" else lay.decode
    mover = min(donors, key=lambda i: (lay.outstanding[i], natural_order(i)))
    roles[mover] = target
    x = sum(r == "prefill" for r in roles.values())
    return roles, f"{mover} {source} -> {target} ({x}P{len(roles) - x}D)"


def _from_colocated(win: Window, lay: _Layout, c: PolicyConfig) -> tuple[str, dict | None, str]:
    thin = _no_evidence(win, c)
    if thin:
        return "hold", None, thin
    reason = _interference(win, c)
    if reason and win.ttft_p90 > c.ttft_slack * c.slo_ttft_ms:
        # a split takes prefill capacity: it would trade the stalls for missed first tokens
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
        # TTFT too: a burst lifts the load for a window without the TTFTs suffering
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
    """``samples``: the window, oldest first (the last is now). Raises ValueError for none."""
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
