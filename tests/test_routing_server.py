"""Prefix-aware routing on a real deployment: ``epdserve serve --workers 2`` (colocated, the
default model, one core each where there are two) under ``--routing least-loaded`` and then
``--routing prefix-aware``, the same bounded shared-prefix trace through each.

* Requests sharing a long prefix (> 3 blocks) go back to the worker that holds it: the share
  of prompt tokens the workers found cached (the usage's
  ``prompt_tokens_details.cached_tokens``) is above least-loaded's on the same trace, and
  every prefix-routed request found at least what the router believed.
* Prompts with all-different prefixes, one at a time, still reach both workers.

Runs in ``make cluster`` (not ``make test``): about 2 minutes on 2 cores.
"""

from __future__ import annotations

import concurrent.futures
import json
from collections import Counter

import httpx
import pytest

from conftest import _stop, start_deployment
from epdserve.bench.datasets import shared_prefix

pytestmark = pytest.mark.cluster

PREFIXES, ROUNDS, PREFIX_TOKENS = 5, 3, 96  # 96 tokens: 6 blocks of 16
CONCURRENCY = 2  # two requests in flight: least-loaded then alternates between the workers
MAX_TOKENS = 2


def _trace(tokenizer, num_prompts: int, prefix_count: int, seed: int):
    return shared_prefix(tokenizer, num_prompts=num_prompts, prefix_count=prefix_count, prefix_len=PREFIX_TOKENS,
                         suffix_len=(8, 16), output_len=(MAX_TOKENS, MAX_TOKENS), seed=seed)


def _send(dep, requests, concurrency: int) -> list[tuple[str, int, int]]:
    """Each request's ``(id, prompt tokens, cached prompt tokens)``, in trace order, at most
    ``concurrency`` in flight (each bounded by the client's 300 s timeout)."""
    client = dep.openai()
    model = client.models.list().data[0].id

    def one(req):
        resp = client.chat.completions.create(model=model, messages=[{"role": "user", "content": req.prompt}],
                                              max_tokens=req.max_tokens, temperature=0)
        return resp.id, resp.usage.prompt_tokens, resp.usage.prompt_tokens_details.cached_tokens

    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(one, requests))


def _records(dep) -> dict[str, dict]:
    return {r["request_id"]: r for r in map(json.loads, dep.trace_path.read_text().splitlines())}


@pytest.fixture(scope="module")
def runs(tokenizer, tmp_path_factory):
    """Per policy: the shared-prefix results, the trace records, /metrics, and (prefix-aware)
    the workers that served all-different prefixes."""
    shared = _trace(tokenizer, PREFIXES * ROUNDS, PREFIXES, seed=1)
    distinct = _trace(tokenizer, 6, 6, seed=2)
    out = {}
    for policy in ("least-loaded", "prefix-aware"):
        dep = start_deployment("colocated", tmp_path_factory.mktemp(policy), "--workers", "2", "--routing", policy)
        try:
            results = _send(dep, shared, CONCURRENCY)
            spread = _send(dep, distinct, 1) if policy == "prefix-aware" else []
            records = _records(dep)
            metrics = httpx.get(dep.url + "/metrics", timeout=10).text
        finally:
            _stop(dep.proc)
        out[policy] = {"results": results, "records": records, "metrics": metrics,
                       "spread": [records[rid]["worker"] for rid, _, _ in spread]}
    return out


def _share(results) -> float:
    return sum(c for _, _, c in results) / sum(p for _, p, _ in results)


def test_prefix_aware_finds_more_of_the_prompts_cached(runs):
    ll, pa = _share(runs["least-loaded"]["results"]), _share(runs["prefix-aware"]["results"])
    print(f"cached-token share: least-loaded {ll:.3f}, prefix-aware {pa:.3f}")
    assert pa > ll
    # Every round after the first finds its prefix (6 blocks) where it was sent before.
    later = runs["prefix-aware"]["results"][PREFIXES:]
    assert all(cached >= PREFIX_TOKENS - 16 for _, _, cached in later), later


def test_the_trace_sets_belief_beside_what_the_worker_found(runs):
    records = runs["prefix-aware"]["records"]
    routed = [records[rid] for rid, _, _ in runs["prefix-aware"]["results"]]
    assert {r["routing"] for r in routed} == {"prefix-aware"}
    by_prefix = [r for r in routed if r["routing_reason"] == "prefix"]
    assert len(by_prefix) >= PREFIXES * (ROUNDS - 1)
    for r in by_prefix:  # the router's keys are the workers' own for text: a belief is a floor
        assert r["cached_tokens"] >= r["routing_believed_tokens"] > 0, r
    ll = [runs["least-loaded"]["records"][rid] for rid, _, _ in runs["least-loaded"]["results"]]
    assert {r["routing"] for r in ll} == {"least-loaded"} and all("routing_believed_tokens" not in r for r in ll)
    hits = sum(1 for _, _, c in runs["prefix-aware"]["results"] if c > 0)
    metric = [line for line in runs["prefix-aware"]["metrics"].splitlines()
              if line.startswith("epdserve:routed_requests_total{") and 'hit="true"' in line]
    assert sum(float(line.rsplit(" ", 1)[1]) for line in metric) >= hits


def test_all_different_prefixes_reach_both_workers(runs):
    workers = Counter(runs["prefix-aware"]["spread"])
    assert len(workers) == 2, workers
