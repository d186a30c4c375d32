"""The typed trace record: derived stages as the module defines them, and JSON round trips."""

import pytest

from epdserve.trace import RequestTrace, StageTimings


def _pd_trace() -> RequestTrace:
    t = RequestTrace(request_id="cmpl-1", mode="pd", path="disaggregated", prompt_tokens=100, output_tokens=8,
                     max_tokens=8, router_queue_ms=2.0, ttft_ms=50.0, e2e_ms=120.0, router_hop_ms=0.5)
    t.add("prefill", StageTimings(queue_ms=3.0, prefill_ms=30.0, kv_export_ms=4.0, kv_bytes=1e6))
    t.add("decode", StageTimings(queue_ms=1.0, kv_fetch_ms=2.0, kv_import_ms=1.5, decode_ms=60.0, kv_tcp=0.0))
    return t


def test_pd_stages_are_derived_from_what_was_measured():
    t = _pd_trace()
    assert t.prefill_queue_ms == 3.0 and t.decode_queue_ms == 1.0
    assert t.queue_ms == 4.0
    assert t.kv_transfer_ms == pytest.approx(4.0 + 0.5 + 2.0 + 1.5)
    assert t.ttft_hop_ms == pytest.approx(50.0 - 2.0 - 3.0 - 30.0 - 4.0)
    assert t.embedding_transfer_ms is None


def test_colocated_record_has_zero_hand_off_and_its_worker_queue():
    t = RequestTrace(request_id="cmpl-2", mode="colocated", path="colocated", worker="colocated-0",
                     router_queue_ms=1.0, ttft_ms=20.0, e2e_ms=40.0)
    t.add("colocated", StageTimings(queue_ms=2.0, prefill_ms=10.0, decode_ms=20.0))
    rec = t.as_json()
    assert rec["queue_ms"] == 2.0 and "colocated_queue_ms" not in rec
    assert rec["kv_bytes"] == 0.0 and rec["kv_transfer_ms"] == 0.0 and rec["worker"] == "colocated-0"
    assert rec["ttft_hop_ms"] == pytest.approx(20.0 - 1.0 - 2.0 - 10.0)


def test_encode_workers_bytes_add_up_and_images_enter_ttft():
    t = RequestTrace(request_id="c", mode="epd", path="disaggregated", num_images=2, router_queue_ms=1.0,
                     ttft_ms=100.0)
    t.add("encode", StageTimings(encode_queue_ms=1.0, encode_ms=20.0, embedding_export_ms=2.0, embedding_bytes=10.0))
    t.add("encode", StageTimings(encode_queue_ms=2.0, encode_ms=30.0, embedding_export_ms=3.0, embedding_bytes=5.0))
    t.add("prefill", StageTimings(queue_ms=4.0, prefill_ms=40.0, embedding_fetch_ms=1.0, kv_export_ms=2.0))
    assert t.embedding_bytes == 15.0 and t.encode_ms == 30.0
    assert t.embedding_transfer_ms == 4.0
    assert t.ttft_hop_ms == pytest.approx(100.0 - 1.0 - 4.0 - (2.0 + 30.0 + 4.0) - 40.0 - 2.0)


def test_json_round_trip_keeps_every_stage():
    for t in (_pd_trace(), RequestTrace(request_id="x", mode="colocated", colocated_queue_ms=3.0)):
        back = RequestTrace.from_json(t.as_json())
        assert back.as_json() == t.as_json()


def test_older_lines_without_path_read_by_mode():
    assert RequestTrace.from_json({"request_id": "a", "mode": "pd"}).path == "disaggregated"
    line = RequestTrace.from_json({"request_id": "a", "mode": "colocated", "queue_ms": 5.0, "future_key": 1})
    assert line.path == "colocated" and line.queue_ms == 5.0


def test_workers_cannot_send_unknown_stages():
    with pytest.raises(ValueError):
        StageTimings.model_validate({"queue_ms": 1.0, "made_up_ms": 2.0})


def test_handoff_gap_splits_into_the_measured_stages_and_the_hops():
    t = _pd_trace()
    assert t.handoff_hop_ms is None and "handoff_hop_ms" not in t.as_json()  # no router stamp yet
    t.handoff_gap_ms = 40.0
    assert t.handoff_hop_ms is None  # nor the decode worker's first step
    t.add("decode", StageTimings(first_decode_ms=25.0))
    # 40 - router hop 0.5 - fetch 2 - decode queue 1 - import 1.5 - first step 25
    assert t.handoff_hop_ms == pytest.approx(10.0)
    rec = t.as_json()
    assert rec["first_decode_ms"] == 25.0 and rec["handoff_gap_ms"] == 40.0 and rec["handoff_hop_ms"] == 10.0
    assert RequestTrace.from_json(rec).as_json() == rec


def test_recomputed_tokens_add_up_over_the_workers():
    t = _pd_trace()
    assert t.recomputed_tokens is None  # an older worker's timings: not measured
    t.add("prefill", StageTimings(recomputed_tokens=0))
    t.add("decode", StageTimings(recomputed_tokens=207))
    assert t.recomputed_tokens == 207 and t.as_json()["recomputed_tokens"] == 207
