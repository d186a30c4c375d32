"""The hand-off gap's parts in process: a trace record with the decode worker's first step
and the router's stamp splits the client's token 1 -> 2 gap into named parts with nothing
left over; an older record keeps its "other"; summaries carry the new fields and the
recomputed tokens' total."""

from __future__ import annotations

import json

import pytest

from epdserve.bench import server_trace
from epdserve.trace import RequestTrace

# A PD request: router hop 2 + fetch 8 + decode queue 4 + import 10 + first step 30 +
# hops 6 (derived) = the router's gap of 60 ms.
PD = {"request_id": "chatcmpl-a", "mode": "pd", "path": "disaggregated", "ttft_ms": 490.0,
      "router_queue_ms": 5.0, "prefill_queue_ms": 20.0, "prefill_ms": 400.0, "kv_export_ms": 30.0,
      "router_hop_ms": 2.0, "kv_fetch_ms": 8.0, "decode_queue_ms": 4.0, "kv_import_ms": 10.0,
      "first_decode_ms": 30.0, "handoff_gap_ms": 60.0, "recomputed_tokens": 0}


def test_handoff_parts_name_the_whole_gap():
    rec = RequestTrace.from_json(PD)
    assert rec.handoff_hop_ms == pytest.approx(6.0)
    parts = server_trace.handoff_parts(63.0, rec)  # the client saw 3 ms more than the router
    assert parts == pytest.approx({"http": 3.0, "router hop": 2.0, "KV fetch": 8.0, "decode queue": 4.0,
                                   "KV import": 10.0, "first decode step": 30.0, "IPC hops": 6.0,
                                   "other": 0.0}, abs=1e-9)
    assert server_trace.sort_parts(parts, "handoff") == list(parts)  # already in time order


def test_older_record_keeps_the_first_step_in_other():
    old = {k: v for k, v in PD.items() if k not in ("first_decode_ms", "handoff_gap_ms")}
    parts = server_trace.handoff_parts(63.0, RequestTrace.from_json(old))
    assert set(parts) == {"router hop", "KV fetch", "decode queue", "KV import", "other"}
    assert parts["other"] == pytest.approx(63.0 - 24.0)


def test_breakdown_of_a_run_has_no_other_left():
    records = [RequestTrace.from_json(PD),
               RequestTrace.from_json(dict(PD, request_id="b", first_decode_ms=50.0, handoff_gap_ms=90.0))]
    result = {"request_ids": ["chatcmpl-a", "chatcmpl-b"], "errors": ["", ""], "ttfts": [0.5, 0.5],
              "itls": [[0.063, 0.02], [0.091]]}
    h = server_trace.breakdown(result, records)["handoff"]
    assert h["n"] == 2
    assert h["parts"] == ["http", "router hop", "KV fetch", "decode queue", "KV import", "first decode step",
                          "IPC hops", "other"]
    assert h["mean"]["first decode step"] == pytest.approx(40.0)
    assert h["mean"]["IPC hops"] == pytest.approx((6.0 + 16.0) / 2)
    assert h["mean"]["other"] == pytest.approx(0.0, abs=1e-9)
    assert sum(h["mean"].values()) == pytest.approx((63.0 + 91.0) / 2)  # the client's mean gap


def test_summary_has_the_new_stages_and_the_recomputed_total(tmp_path):
    path = tmp_path / "t.jsonl"
    rows = [PD, dict(PD, request_id="b", recomputed_tokens=120), dict(PD, request_id="c", recomputed_tokens=87),
            {"request_id": "d", "mode": "pd", "path": "disaggregated"}]  # an older line: not counted
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    s = server_trace.summarize(path)
    assert s["mean_first_decode_ms"] == 30.0 and s["mean_handoff_hop_ms"] == pytest.approx(6.0)
    assert s["mean_handoff_gap_ms"] == 60.0
    assert s["total_recomputed_tokens"] == 207 and s["mean_recomputed_tokens"] == pytest.approx(69.0)
    assert s["preempted_requests"] == 2
