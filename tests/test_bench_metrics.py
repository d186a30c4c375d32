"""Metric formulas (as epdserve.bench.metrics defines them, vLLM ``bench serve`` names) on hand-computed records.

Records (times in s; chunk times relative to t0, start/end relative to the run start):

* r0: sent at 0.0, text chunks at 0.1, 0.3 (carries two tokens), 0.4, last chunk (usage)
  at 0.45; usage 10 prompt / 4 completion tokens.
  TTFT 100 ms, ITLs 200 and 100 ms, E2EL 450 ms, TPOT (450 − 100) / 3 = 116.67 ms.
* r1: sent at 0.5, one text chunk at 0.2, last chunk at 0.25; usage 20 / 1.
  TTFT 200 ms, no ITL, E2EL 250 ms, no TPOT (one output token).
* r2: sent at 1.0, chunks at 0.3, 0.35, 0.45, 0.5, no usage: 4 output tokens (chunks),
  30 prompt tokens (the trace's count). TTFT 300, ITLs 50, 100, 50, E2EL 500,
  TPOT (500 − 300) / 3 = 66.67 ms.
* r3: sent at 1.2, failed with HTTP 500 at 2.0.

Duration = 2.0 − 0.0 = 2 s; 3 completed, 1 failed; 60 input and 9 output tokens.
"""

import argparse
import math

import pytest

from epdserve.bench.client import RequestRecord
from epdserve.bench.metrics import (DEFAULT_SLOS_MS, compute, describe_slos, error_kind,
                                    judged_goodput, slo_goodput, slo_values_ms, tpot_s)
from epdserve.bench.run import parse_goodput


def records() -> list[RequestRecord]:
    return [
        RequestRecord(index=0, start_s=0.0, chunk_times_s=[0.1, 0.3, 0.4], last_chunk_s=0.45,
                      end_s=0.45, usage_prompt_tokens=10, usage_completion_tokens=4,
                      expected_prompt_tokens=7, request_id="a", success=True),
        RequestRecord(index=1, start_s=0.5, chunk_times_s=[0.2], last_chunk_s=0.25, end_s=0.75,
                      usage_prompt_tokens=20, usage_completion_tokens=1,
                      expected_prompt_tokens=17, request_id="b", success=True),
        RequestRecord(index=2, start_s=1.0, chunk_times_s=[0.3, 0.35, 0.45, 0.5],
                      last_chunk_s=0.5, end_s=1.5, expected_prompt_tokens=30, request_id="c",
                      success=True, kind="long"),
        RequestRecord(index=3, start_s=1.2, end_s=2.0, expected_prompt_tokens=40,
                      error="HTTP 500: boom"),
    ]


approx = lambda x: pytest.approx(x, rel=1e-9, abs=1e-9)  # noqa: E731


def test_throughputs_and_counts():
    r = compute(records())
    assert r["duration"] == approx(2.0)
    assert (r["completed"], r["failed"]) == (3, 1)
    assert r["total_input_tokens"] == 60
    assert r["total_output_tokens"] == 9
    assert r["request_throughput"] == approx(1.5)
    assert r["output_throughput"] == approx(4.5)
    assert r["total_token_throughput"] == approx(34.5)
    assert r["request_goodput"] is None and r["slo_attainment"] is None
    assert r["error_counts"] == {"HTTP 500": 1}


def test_ttft_from_first_text_chunk():
    r = compute(records())
    assert r["mean_ttft_ms"] == approx(200.0)
    assert r["median_ttft_ms"] == approx(200.0)
    assert r["std_ttft_ms"] == approx(math.sqrt(20000 / 3))
    assert r["p90_ttft_ms"] == approx(280.0)  # linear: 200 + 0.8 * 100
    assert r["p95_ttft_ms"] == approx(290.0)
    assert r["p99_ttft_ms"] == approx(298.0)


def test_itl_pooled_over_requests_and_multi_token_chunk_is_one_gap():
    r = compute(records())
    # pooled gaps: 200, 100 (r0), none (r1), 50, 100, 50 (r2)
    assert r["mean_itl_ms"] == approx(100.0)
    assert r["median_itl_ms"] == approx(100.0)
    assert r["std_itl_ms"] == approx(math.sqrt(3000))
    assert r["p90_itl_ms"] == approx(160.0)
    assert r["p95_itl_ms"] == approx(180.0)
    assert r["p99_itl_ms"] == approx(196.0)
    assert r["itls"][0] == [approx(0.2), approx(0.1)]
    assert r["itls"][1] == [] and r["itls"][3] == []


def test_tpot_skips_single_token_requests():
    recs = records()
    assert tpot_s(recs[0]) == approx(0.35 / 3)
    assert tpot_s(recs[1]) is None
    assert tpot_s(recs[3]) is None
    r = compute(recs)
    assert r["mean_tpot_ms"] == approx((350 / 3 + 200 / 3) / 2)
    assert r["median_tpot_ms"] == approx((350 / 3 + 200 / 3) / 2)
    assert r["std_tpot_ms"] == approx(25.0)
    assert r["p90_tpot_ms"] == approx(200 / 3 + 0.9 * 50)


def test_e2el_from_last_chunk():
    r = compute(records())
    assert r["mean_e2el_ms"] == approx(400.0)
    assert r["median_e2el_ms"] == approx(450.0)
    assert r["p90_e2el_ms"] == approx(490.0)
    assert r["p99_e2el_ms"] == approx(499.0)


def test_raw_arrays_in_trace_order_in_seconds():
    r = compute(records())
    assert r["ttfts"] == [approx(0.1), approx(0.2), approx(0.3), 0.0]
    assert r["e2els"] == [approx(0.45), approx(0.25), approx(0.5), 0.0]
    assert r["output_lens"] == [4, 1, 4, 0]
    assert r["input_lens"] == [10, 20, 30, 40]  # usage when sent, else the trace's count
    assert r["errors"] == ["", "", "", "HTTP 500: boom"]
    assert r["request_ids"] == ["a", "b", "c", None]
    assert r["start_offsets"] == [0.0, 0.5, 1.0, 1.2]
    assert r["kinds"] == ["chat", "chat", "long", "chat"]


@pytest.mark.parametrize("slos, good", [
    ({"ttft": 250}, 2),                 # r2's 300 ms TTFT misses
    ({"ttft": 250, "tpot": 100}, 1),    # r0's 116.7 ms TPOT misses; r1 (one token) passes
    ({"ttft": 1000, "e2el": 460}, 2),   # r2's 500 ms E2EL misses
    ({"ttft": 300, "tpot": 120, "e2el": 500}, 3),  # bounds are inclusive
    ({"e2el": 1}, 0),
])
def test_goodput_counts_completed_requests_meeting_every_slo(slos, good):
    r = compute(records(), slos)
    assert r["request_goodput"] == approx(good / 2.0)
    assert r["slo_attainment"] == approx(good / 4)  # the failed r3 counts as a miss


def test_unknown_slo_is_rejected():
    with pytest.raises(ValueError, match="ttfx"):
        compute(records(), {"ttfx": 1})


def test_all_failed_gives_zero_aggregates_not_a_crash():
    r = compute([records()[3]])
    assert (r["completed"], r["failed"]) == (0, 1)
    assert r["duration"] == approx(0.8)
    assert r["mean_ttft_ms"] == 0.0 and r["p99_itl_ms"] == 0.0
    assert r["request_throughput"] == 0.0


@pytest.mark.parametrize("error, kind", [
    ("HTTP 400: max_tokens must be >= 1", "HTTP 400"),
    ("error event: engine died", "error event"),
    ("RemoteProtocolError: peer closed connection without sending complete message body",
     "connection reset"),
    ("ReadTimeout", "timeout"),
    ("ConnectError: All connection attempts failed", "connection refused"),
    ("stream ended before [DONE]", "stream ended before [DONE]"),
])
def test_error_kinds(error, kind):
    assert error_kind(error) == kind


def test_peaks_per_second_as_vllm():
    # Buckets from the first send (0.0): r0's 3 chunks and r1's chunk (0.5 + 0.2) fall in
    # second 0, r2's 4 chunks at 1.3-1.5 in second 1; r0 (0-0.45) and r1 (0.5-0.75) are
    # active in second 0, r2 (1.0-1.5) in second 1; the failed r3 is left out.
    r = compute(records())
    assert r["max_output_tokens_per_s"] == 4.0
    assert r["max_concurrent_requests"] == 2
    assert r["start_times"] == [0.0, 0.5, 1.0, 1.2]
    assert compute([records()[3]])["max_output_tokens_per_s"] == 0.0


def frozen_and_smooth() -> list[RequestRecord]:
    """Two requests of 21 chunks, TTFT 0.5 s: "frozen" streams 19 gaps of 10 ms and one of
    2 s (a long prefill batched in), "smooth" 20 gaps of 100 ms. TPOT is the mean gap:
    frozen (2.69 − 0.5) / 20 = 109.5 ms, smooth 100 ms; both meet tpot:150."""
    frozen = [0.5 + 0.01 * i for i in range(10)] + [2.59 + 0.01 * i for i in range(11)]
    smooth = [0.5 + 0.1 * i for i in range(21)]
    return [RequestRecord(index=0, start_s=0.0, chunk_times_s=frozen, last_chunk_s=frozen[-1],
                          end_s=frozen[-1], usage_completion_tokens=21, request_id="frozen",
                          success=True),
            RequestRecord(index=1, start_s=0.0, chunk_times_s=smooth, last_chunk_s=smooth[-1],
                          end_s=smooth[-1], usage_completion_tokens=21, request_id="smooth",
                          success=True)]


def test_a_frozen_stream_meets_tpot_but_fails_the_itl_slo():
    recs = frozen_and_smooth()
    assert tpot_s(recs[0]) == approx((2.69 - 0.5) / 20)
    by = lambda slos: compute(recs, slos)["slo_attainment"]  # noqa: E731
    assert by({"tpot": 150}) == approx(1.0)       # the mean hides the 2 s freeze
    assert by({"itl": 1000}) == approx(0.5)       # the longest gap does not
    assert by({"itl": 2001}) == approx(1.0)       # a 2 s gap
    assert by({"tpot": 150, "itl": 1000}) == approx(0.5)
    assert compute(recs, {"itl": 1000})["goodput_slos_ms"] == {"itl": 1000}


def test_itl_p99_slo_is_the_requests_own_linear_p99_gap():
    recs = frozen_and_smooth()
    # frozen: 20 gaps, 19 of 10 ms and one of 2000 ms; numpy's linear p99 of 20 values
    # lies 0.81 of the way from the 19th (10 ms) to the 20th: 10 + 0.81 * 1990 = 1621.9 ms.
    values = slo_values_ms(recs[0].ttft_s, recs[0].e2el_s, 21, recs[0].itls_s)
    assert values["itl"] == pytest.approx(2000.0)
    assert values["itl_p99"] == pytest.approx(1621.9)
    assert values["tpot"] == pytest.approx(109.5)
    assert compute(recs, {"itl_p99": 1621})["slo_attainment"] == approx(0.5)
    assert compute(recs, {"itl_p99": 1622})["slo_attainment"] == approx(1.0)


def test_a_request_without_a_gap_meets_the_itl_slos():
    r = compute([records()[1]], {"itl": 0, "itl_p99": 0})  # one chunk: no gap
    assert r["slo_attainment"] == 1.0
    assert slo_values_ms(0.1, 0.1, 1, [])["itl"] == 0.0


def test_goodput_from_a_saved_result_equals_the_measured_one():
    # what compare does with a result that had no SLOs: judge it later from its arrays
    recs = [*records(), *frozen_and_smooth()]
    measured = compute(recs, DEFAULT_SLOS_MS)
    plain = compute(recs)
    assert slo_goodput(plain, DEFAULT_SLOS_MS) == {
        "request_goodput": measured["request_goodput"],
        "slo_attainment": measured["slo_attainment"]}
    judged = judged_goodput(plain)
    assert judged["goodput_slos_default"] is True
    assert judged["goodput_slos_ms"] == DEFAULT_SLOS_MS == {"ttft": 2000, "tpot": 200,
                                                            "itl": 1000}
    # 4 of 6 requests meet them: r0-r2 and smooth; r3 failed, frozen has a 2 s gap
    assert judged["slo_attainment"] == approx(4 / 6)
    given = judged_goodput(measured)  # SLOs given: as measured, not the defaults
    assert given["goodput_slos_default"] is False
    assert given["request_goodput"] == measured["request_goodput"]
    assert describe_slos(DEFAULT_SLOS_MS) == ("TTFT ≤ 2000 ms, TPOT ≤ 200 ms, "
                                              "longest ITL gap ≤ 1000 ms")


@pytest.mark.parametrize("text, parsed", [("itl:1000", ("itl", 1000.0)),
                                          ("itl_p99:250.5", ("itl_p99", 250.5)),
                                          ("ttft:0", ("ttft", 0.0))])
def test_parse_goodput_takes_the_itl_slos(text, parsed):
    assert parse_goodput(text) == parsed


@pytest.mark.parametrize("text, needle", [("itl_p95:100", "itl_p99"), ("itl", "KEY:MS"),
                                          ("itl:fast", "'fast' is not a number"),
                                          ("itl:-1", ">= 0"), ("itl:inf", "finite")])
def test_parse_goodput_names_the_bad_value(text, needle):
    with pytest.raises(argparse.ArgumentTypeError, match=needle) as info:
        parse_goodput(text)
    assert text in str(info.value)
