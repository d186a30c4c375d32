"""Server-side stages of any engine (vLLM, SGLang, llama.cpp, epdserve) from its Prometheus
``/metrics`` scraped before and after a run, as Prometheus's ``increase()`` and
``histogram_quantile`` compute them; method in docs/comparing.md, "Server-side stages"."""

from __future__ import annotations

import math
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

import httpx
from prometheus_client.parser import text_string_to_metric_families

from epdserve.bench import tables
from epdserve.bench.engine_metrics import ENGINES, STAGE_INFO, STAGES, STAGES_OF, Source

SETTLE_POLL_S = 0.25


class MetricsUnavailable(RuntimeError):
    """One line naming the URL."""


@dataclass
class Scrape:
    """``samples``: sample name (``x_total``, ``x_bucket``, ...) -> ``(labels, value)`` pairs."""

    url: str
    samples: dict[str, list[tuple[dict[str, str], float]]] = field(default_factory=dict)

    @classmethod
    def parse(cls, url: str, text: str) -> Scrape:
        """Raises MetricsUnavailable for text that is not Prometheus text."""
        scrape = cls(url)
        try:
            for family in text_string_to_metric_families(text):
                for s in family.samples:
                    if not s.name.endswith("_created"):  # a timestamp, not a value
                        scrape.samples.setdefault(s.name, []).append((s.labels, float(s.value)))
        except (ValueError, TypeError, IndexError, KeyError) as exc:
            raise MetricsUnavailable(f"{url}: not Prometheus text ({str(exc)[:80]})") from None
        return scrape

    def series(self, name: str, exclude: tuple[tuple[str, str], ...] = ()) -> list[tuple[dict, float]]:
        return [(lab, v) for lab, v in self.samples.get(name, [])
                if not any(lab.get(k) == val for k, val in exclude)]


def scrape(url: str, timeout_s: float = 5.0, http: httpx.Client | None = None) -> Scrape:
    """Reuse ``http``: a new client costs ~45 ms of CPU (the CA bundle), too much once a second.

    Raises MetricsUnavailable: no connection, no answer within ``timeout_s``, not 200, not
    Prometheus text."""
    try:
        answer = http.get(url, timeout=timeout_s) if http else httpx.get(url, timeout=timeout_s, trust_env=False)
    except httpx.TimeoutException:
        raise MetricsUnavailable(f"{url}: no answer within {timeout_s:g} s") from None
    except httpx.HTTPError as exc:
        raise MetricsUnavailable(f"{url}: cannot connect ({type(exc).__name__}: {exc})") from None
    if answer.status_code != 200:
        raise MetricsUnavailable(f"{url}: HTTP {answer.status_code} (is the metrics endpoint on? "
                                 f"llama-server needs --metrics, SGLang --enable-metrics)")
    return Scrape.parse(url, answer.text)


def detect_engine(scrapes: list[Scrape]) -> str | None:
    """The engine whose prefix most sample names carry (None: none); epdserve by its
    ``epdserve:`` TTFT histogram (``vllm:`` names alone read as vLLM)."""
    if any(src.present(s.samples) for s in scrapes for src in STAGES_OF["epdserve"]["ttft"]):
        return "epdserve"
    seen = Counter(engine for s in scrapes for name in s.samples
                   for engine, prefix in ENGINES.items() if name.startswith(prefix))
    return seen.most_common(1)[0][0] if seen else None


def _series_delta(before: Scrape, after: Scrape, name: str, exclude=()) -> dict[tuple, float]:
    """By sorted labels; a series absent before, or one that went down (a restart), counts
    from 0."""
    prior = {tuple(sorted(lab.items())): v for lab, v in before.series(name, exclude)}
    out = {}
    for lab, v in after.series(name, exclude):
        was = prior.get(key := tuple(sorted(lab.items())), 0.0)
        out[key] = v - was if v >= was else v
    return out


def counter_delta(before: Scrape, after: Scrape, metric: str, exclude=()) -> float:
    name = metric + "_total" if metric + "_total" in after.samples else metric
    return sum(_series_delta(before, after, name, exclude).values())


def histogram_delta(pairs: list[tuple[Scrape, Scrape]], metric: str, exclude=()) -> dict:
    """``{"count", "sum", "buckets": [(le, cumulative count)]}`` over every series of
    ``pairs`` (one per URL); only bounds all series share, where adding cumulative counts is right."""
    per_series: dict[tuple, dict[float, float]] = {}
    for i, (before, after) in enumerate(pairs):
        for labels, v in _series_delta(before, after, metric + "_bucket", exclude).items():
            series = (i, *(kv for kv in labels if kv[0] != "le"))
            per_series.setdefault(series, {})[float(dict(labels)["le"])] = v
    shared = set.intersection(*map(set, per_series.values())) if per_series else set()
    return {"count": sum(counter_delta(b, a, metric + "_count", exclude) for b, a in pairs),
            "sum": sum(counter_delta(b, a, metric + "_sum", exclude) for b, a in pairs),
            "buckets": sorted((le, sum(b[le] for b in per_series.values())) for le in shared)}


def histogram_quantile(q: float, buckets: list[tuple[float, float]]) -> tuple[float | None, bool]:
    """(value, at_least) of the ``q``-quantile (0-1), as promql/quantile.go
    ``bucketQuantile``; at_least when it falls in +Inf (value: the highest finite bound);
    (None, False) without observations."""
    if len(buckets) < 2 or buckets[-1][0] != math.inf or buckets[-1][1] <= 0:
        return None, False
    rank = q * buckets[-1][1]
    b = next(i for i, (_, c) in enumerate(buckets) if c >= rank)
    if b == len(buckets) - 1:
        return buckets[-2][0], True
    if b == 0 and buckets[0][0] <= 0:
        return buckets[0][0], False
    start, end, count = 0.0, buckets[b][0], buckets[b][1]
    if b > 0:
        start, count, rank = buckets[b - 1][0], count - buckets[b - 1][1], rank - buckets[b - 1][1]
    return start + (end - start) * (rank / count), False


def histogram_stage(h: dict) -> dict:
    """Count, mean, p50, p95 in ms from a histogram in seconds."""
    out = {"kind": "histogram", "count": int(round(h["count"])),
           "mean_ms": h["sum"] / h["count"] * 1000 if h["count"] > 0 else None}
    for q in (50, 95):
        v, at_least = histogram_quantile(q / 100, h["buckets"])
        out[f"p{q}_ms"], out[f"p{q}_at_least"] = (None if v is None else v * 1000), at_least
    return out


def gauge_stats(rounds: list[list[Scrape]], metric: str) -> dict | None:
    """Mean over rounds of the mean over series, and the highest value; None if never present."""
    means, highest = [], []
    for scrapes in rounds:
        values = [v for s in scrapes for _, v in s.series(metric)]
        if values:
            means.append(sum(values) / len(values))
            highest.append(max(values))
    if not means:
        return None
    return {"kind": "gauge", "mean": sum(means) / len(means), "max": max(highest), "samples": len(means)}


def _stage(src: Source, pairs: dict[str, tuple[Scrape, Scrape]], rounds: list[list[Scrape]],
           requests: tuple[float | None, str | None]) -> dict | None:
    """``requests``: (count, "server" | "client"), the divisor of the "seconds" kind."""
    if src.kind == "gauge":
        return gauge_stats(rounds, src.metric)
    if src.kind == "bytes":
        h = histogram_delta(list(pairs.values()), src.metric, src.exclude)
        return {"kind": "bytes", "count": int(round(h["count"])), "total_bytes": h["sum"],
                "mean_bytes": h["sum"] / h["count"] if h["count"] > 0 else None}
    if src.kind == "histogram":
        return {**histogram_stage(histogram_delta(list(pairs.values()), src.metric, src.exclude)),
                "per_url": {url: int(round(counter_delta(b, a, src.metric + "_count", src.exclude)))
                            for url, (b, a) in pairs.items()}}
    per_url = {m: {url: counter_delta(b, a, m, src.exclude) for url, (b, a) in pairs.items()}
               for m in (src.metric, *src.over)}
    delta = {m: sum(d.values()) for m, d in per_url.items()}
    if src.kind == "counter":
        return {"kind": "counter", "delta": delta[src.metric], "per_url": per_url[src.metric]}
    if src.kind == "ratio":
        total = sum(delta[m] for m in src.over)
        return {"kind": "ratio", "value": delta[src.metric] / total if total > 0 else None,
                "numerator": delta[src.metric], "denominator": total}
    seconds, tokens, (n, n_from) = delta[src.metric], delta[src.over[0]], requests
    divisor = (tokens - n if n is not None else None) if src.per_gap else n
    return {"kind": "seconds", "total_s": seconds, "tokens": tokens, "requests": n, "requests_from": n_from,
            "per_token_ms": seconds / tokens * 1000 if tokens > 0 else None,
            "mean_ms": seconds / divisor * 1000 if divisor else None}


def stages_between(before: dict[str, Scrape], after: dict[str, Scrape], rounds: list[list[Scrape]] = (),
                   completed_requests: int | None = None) -> dict:
    """``{"engine", "stages": {stage: dict | None}}``; before and after count as gauge rounds,
    and "seconds" stages divide by the server's request count, else ``completed_requests``."""
    engine = detect_engine([*before.values(), *after.values()])
    pairs = {u: (before[u], after[u]) for u in after if u in before}
    rounds = [list(before.values()), *rounds, list(after.values())]
    sources = STAGES_OF.get(engine, {})
    found = {stage: next((s for s in sources.get(stage, ()) if any(s.present(a.samples) for _, a in pairs.values())),
                         None) for stage in STAGES}
    requests = (None, None) if completed_requests is None else (completed_requests, "client")
    if found["requests"]:  # the divisor of the "seconds" stages
        requests = (_stage(found["requests"], pairs, rounds, requests)["delta"], "server")
    return {"engine": engine, "stages": {
        stage: src and {**_stage(src, pairs, rounds, requests), "metric": src.metric, "note": src.note}
        for stage, src in found.items()}}


class MetricsWatcher:
    """Scrapes a deployment's ``/metrics`` URLs (one per process) around a run and samples
    gauges every ``interval_s``; a URL that does not answer is a warning, never an exception."""

    def __init__(self, urls: list[str], interval_s: float = 1.0, timeout_s: float = 5.0,
                 settle_s: float = 2.0):
        self.urls, self.interval_s, self.timeout_s, self.settle_s = list(urls), interval_s, timeout_s, settle_s
        self.warnings, self.before, self.rounds, self.failed_samples = [], {}, [], 0
        self._stop, self._http = threading.Event(), httpx.Client(trust_env=False)  # one client: see scrape()
        self._thread = threading.Thread(target=self._sample_loop, name="epdserve-metrics", daemon=True)

    def _scrape_all(self, urls, when: str | None = None) -> dict[str, Scrape]:
        """A URL that does not answer is a warning when ``when`` is given, else a failed
        sample."""
        out = {}
        for url in urls:
            try:
                out[url] = scrape(url, self.timeout_s, self._http)
            except MetricsUnavailable as exc:
                if when:
                    self.warnings.append(f"metrics {when} the run: {exc}; its stages are left out")
                else:
                    self.failed_samples += 1
        return out

    def _sample_loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.rounds.append(list(self._scrape_all(self.before).values()))

    def start(self) -> MetricsWatcher:
        self.before = self._scrape_all(self.urls, "before")
        self._thread.start()
        return self

    def _settled_after(self) -> dict[str, Scrape]:
        """Scraped again every :data:`SETTLE_POLL_S` until counters stop moving (at most
        ``settle_s``): a server counts a request after its last byte."""
        def moved(scrapes: dict[str, Scrape]) -> float:
            return sum(v for s in scrapes.values() for name, vals in s.samples.items()
                       if name.endswith(("_total", "_count")) for _, v in vals)
        after, deadline = self._scrape_all(self.before, "after"), time.monotonic() + self.settle_s
        while after and time.monotonic() < deadline:
            time.sleep(SETTLE_POLL_S)
            again = self._scrape_all(after)
            if again.keys() == after.keys() and moved(again) == moved(after):
                break
            after = again
        return after

    def stop(self, completed_requests: int | None = None) -> dict:
        """``{"engine", "urls", "stages": {stage: dict | None}, "warnings"}``, JSON-able. Stage
        kinds: histogram (count, mean_ms, p50/p95_ms, p50/p95_at_least, per_url), counter (delta,
        per_url), gauge (mean, max, samples), ratio (value, numerator, denominator), seconds (total_s,
        tokens, per_token_ms, requests, requests_from, mean_ms). ``completed_requests`` is used only
        by an engine that counts no requests (llama.cpp)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        after = self._settled_after()
        self._http.close()
        if self.failed_samples:
            self.warnings.append(f"{self.failed_samples} scrapes during the run got no answer")
        result = stages_between(self.before, after, self.rounds, completed_requests)
        if after and result["engine"] is None:
            self.warnings.append("no vllm:, sglang:, llamacpp: or epdserve: metric at "
                                 + ", ".join(after) + ": engine not recognised")
        return {"engine": result["engine"], "urls": self.urls, "stages": result["stages"],
                "warnings": self.warnings}


def _ms(v: float | None, at_least: bool = False) -> str:
    return "—" if v is None else ("≥" if at_least else "") + f"{v:,.1f}"


def _per_url(counts: dict) -> str:
    return " (" + ", ".join(f"{u}: {c:g}" for u, c in counts.items()) + ")" if len(counts) > 1 else ""


def stage_cell(stage: dict | None) -> str:
    if stage is None:
        return "—"
    kind = stage["kind"]
    if kind == "histogram":
        if not stage["count"]:
            return "n=0"
        return (f"{_ms(stage['mean_ms'])} (p50 {_ms(stage['p50_ms'], stage['p50_at_least'])}, "
                f"p95 {_ms(stage['p95_ms'], stage['p95_at_least'])}) n={stage['count']}{_per_url(stage['per_url'])}")
    if kind == "bytes":
        if not stage["count"]:
            return "n=0"
        return f"{stage['mean_bytes'] / 1e6:,.2f} (Σ {stage['total_bytes'] / 1e6:,.1f}) n={stage['count']}"
    if kind == "counter":
        return f"{stage['delta']:g}{_per_url(stage['per_url'])}"
    if kind == "gauge":
        return f"{stage['mean']:.1%} (max {stage['max']:.1%})"
    if kind == "ratio":
        return "—" if stage["value"] is None else f"{stage['value']:.1%}"
    per_token = f"{_ms(stage['per_token_ms'])} ms/token"
    if stage["mean_ms"] is None:
        return f"Σ {stage['total_s']:.2f} s; {per_token}"
    n = f"{stage['requests']:g} {'requests' if stage['requests_from'] == 'server' else 'requests (client)'}"
    return f"{_ms(stage['mean_ms'])}; {per_token}; {n}"


UNIT_TEXT = {"ms": "mean (p50, p95) ms", "MB": "mean (Σ) MB"}


def stages_table(entries: list[dict]) -> tuple[list[str], list[list[str]]]:
    cell = lambda e, stage: stage_cell(((e.get("server_metrics") or {}).get("stages") or {}).get(stage))  # noqa: E731
    return ["Stage", *(e["name"] for e in entries)], [
        [f"{label}, {UNIT_TEXT.get(unit, unit)}", *(cell(e, stage) for e in entries)]
        for stage, (label, unit) in STAGE_INFO.items()]


def _notes(entries: list[dict]) -> list[str]:
    seen: dict[tuple, str] = {}
    for e in entries:
        m = e.get("server_metrics") or {}
        for stage, s in (m.get("stages") or {}).items():
            if s:
                seen.setdefault((m["engine"], STAGE_INFO[stage][0], s["metric"]), s["note"])
    lines = [f"- {engine}, {label}: `{metric}`: {note}" for (engine, label, metric), note in seen.items()]
    return lines + [f"- warning [{e['name']}]: {w}" for e in entries
                    for w in (e.get("server_metrics") or {}).get("warnings", [])]


def stages_markdown(entries: list[dict]) -> str:
    """"—": the engine lacks the metric or its URL did not answer; '' without server_metrics."""
    if not any(e.get("server_metrics") for e in entries):
        return ""
    return "\n".join([tables.markdown(*stages_table(entries)), "", *_notes(entries)])


def stages_text(entries: list[dict]) -> str:
    if not any(e.get("server_metrics") for e in entries):
        return ""
    return "\n".join([tables.text(*stages_table(entries)), "", *_notes(entries)])
