"""What the per-request trace says of a PD request beyond TTFT, on a real 1P1D deployment
with a small KV pool (16 MiB per worker: 22 blocks of 16 tokens):

* the hand-off gap: the decode worker's step that imports the KV (``first_decode_ms``)
  and the router's token 1 -> 2 gap (``handoff_gap_ms``) name the client's gap, with no
  "other" left;
* a client that goes away mid-stream: ``finish_reason`` "abort", as /metrics counts it;
* two requests that cannot both fit on the decode worker: the one preempted carries the
  tokens it computed again (``recomputed_tokens``), which are exactly the decode worker's
  computed tokens (``iteration_tokens_total``) beyond what the requests needed.
"""

from __future__ import annotations

import json
import re
import threading
import time

import httpx
import pytest

from epdserve.bench import server_trace
from epdserve.trace import RequestTrace

from conftest import _stop, start_deployment


@pytest.fixture(scope="module")
def small_pd(tmp_path_factory):
    dep = start_deployment("pd", tmp_path_factory.mktemp("serve-pd-small-kv"), "--kv-cache-memory-mb", "16")
    try:
        yield dep
    finally:
        _stop(dep.proc)


def prompt_ids(tokenizer, n: int, offset: int) -> list[int]:
    """``n`` token ids of plain text, different for each ``offset`` (no shared prefix)."""
    words = tokenizer(" ".join(f"ledger {offset + i} counted ships" for i in range(n))).input_ids
    return words[:n]


def stream(dep, prompt: list[int], max_tokens: int, leave_after: int | None = None) -> tuple[str, list[float]]:
    """A streamed greedy completion; (response id, each text chunk's arrival, perf_counter
    s). ``leave_after``: close the connection after that many chunks."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
    rid, times = None, []
    with httpx.stream("POST", dep.url + "/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: "):])
            rid = chunk["id"]
            if chunk["choices"] and chunk["choices"][0]["text"]:
                times.append(time.perf_counter())
            if leave_after is not None and len(times) >= leave_after:
                break
    return rid, times


def iteration_tokens(dep, worker: str) -> float:
    """The tokens ``worker``'s engine steps have computed (``iteration_tokens_total``'s sum)."""
    text = httpx.get(dep.url + "/metrics", timeout=10).text
    pattern = rf'^epdserve:iteration_tokens_total_sum{{[^}}]*worker="{worker}"[^}}]*}} (\S+)$'
    match = re.search(pattern, text, re.M)
    return float(match.group(1)) if match else 0.0


def settled_iteration_tokens(dep, worker: str) -> float:
    """:func:`iteration_tokens` once it stops moving (a step's Stats may trail its tokens)."""
    last = iteration_tokens(dep, worker)
    for _ in range(20):
        time.sleep(0.25)
        now = iteration_tokens(dep, worker)
        if now == last:
            return now
        last = now
    return last


def test_handoff_gap_is_named_to_the_last_part(small_pd, tokenizer):
    rid, times = stream(small_pd, prompt_ids(tokenizer, 120, 0), 6)
    rec = small_pd.trace(rid)
    assert rec["path"] == "disaggregated" and rec["finish_reason"] == "length"
    gap_ms = (times[1] - times[0]) * 1000
    # The decode worker's first step is measured, and within the router's gap.
    assert 0 < rec["first_decode_ms"] <= rec["handoff_gap_ms"]
    assert rec["handoff_hop_ms"] >= 0  # the router's remainder: stages never overlap
    parts = server_trace.handoff_parts(gap_ms, RequestTrace.from_json(rec))
    assert parts["first decode step"] == rec["first_decode_ms"] and parts["IPC hops"] == rec["handoff_hop_ms"]
    assert sum(parts.values()) == pytest.approx(gap_ms)
    assert parts["other"] == pytest.approx(0.0, abs=1e-3)  # the trace rounds to µs
    assert rec["recomputed_tokens"] == 0  # alone: never preempted


def test_client_abort_is_recorded_as_abort(small_pd, tokenizer):
    rid, times = stream(small_pd, prompt_ids(tokenizer, 60, 1000), 200, leave_after=1)
    assert len(times) == 1
    rec = small_pd.trace(rid)
    assert rec["finish_reason"] == "abort" and rec["error"] is None
    assert rec["output_tokens"] < 200


def test_preempted_request_carries_its_recomputed_tokens(small_pd, tokenizer):
    """Two 150-token prompts decoding 120 tokens each need 2 x 17 blocks at the end; the
    decode worker has 22."""
    before = settled_iteration_tokens(small_pd, "decode-0")
    results: dict[int, str] = {}
    threads = [threading.Thread(target=lambda i=i: results.__setitem__(
        i, stream(small_pd, prompt_ids(tokenizer, 150, 2000 + 1000 * i), 120)[0])) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    recs = [small_pd.trace(rid) for rid in results.values()]
    computed = settled_iteration_tokens(small_pd, "decode-0") - before
    assert all(r["path"] == "disaggregated" and r["output_tokens"] == 120 for r in recs)
    needed = sum(r["output_tokens"] - 1 for r in recs)  # tokens 1..119: the prompt came as KV
    recomputed = sum(r["recomputed_tokens"] for r in recs)
    assert recomputed > 0 and recomputed == computed - needed
