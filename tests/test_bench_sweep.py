"""Goodput sweep: bisection on request rate (DistServe's goodput) and its plot."""

import pytest

from epdserve.bench import sweep


def fake_measure(calls):
    """A server that meets every SLO below 3.0 req/s and misses more the faster above."""
    def measure(rate):
        calls.append(rate)
        attainment = 1.0 if rate <= 3.0 else max(0.0, 1.0 - (rate - 3.0))
        return {"slo_attainment": attainment, "request_throughput": rate,
                "request_goodput": rate * attainment, "completed": 10, "ttfts": [0.1] * 10}
    return measure


def test_bisection_finds_the_rate_where_attainment_drops_below_target():
    calls = []
    out = sweep.find_max_goodput_rate(fake_measure(calls), target_share=0.9, lo=0.5, hi=8.0,
                                      iters=8, progress=False)
    # attainment >= 0.9 up to 3.1 req/s; 8 halvings of 7.5 req/s leave < 0.03 req/s.
    assert 3.1 - 7.5 / 2**8 <= out["max_rate"] <= 3.1
    assert out["bracket"][1] - out["bracket"][0] == pytest.approx(7.5 / 2**8)
    assert len(out["points"]) == 10 == len(calls)
    assert [p["rate"] for p in out["points"]] == sorted(calls)
    p = out["points"][0]
    assert p["rate"] == 0.5 and p["slo_attainment"] == 1.0 and "ttfts" not in p


def test_range_too_low_or_too_high_is_reported_not_guessed():
    high = sweep.find_max_goodput_rate(fake_measure([]), lo=0.5, hi=2.0, iters=3, progress=False)
    assert high["max_rate"] == 2.0 and high["bracket"] == [2.0, None]
    assert len(high["points"]) == 2
    low = sweep.find_max_goodput_rate(fake_measure([]), lo=5.0, hi=9.0, iters=3, progress=False)
    assert low["max_rate"] is None and low["bracket"] == [None, 5.0]
    assert len(low["points"]) == 1


@pytest.mark.parametrize("kwargs, word", [(dict(lo=2.0, hi=1.0), "2.0:1.0"),
                                          (dict(lo=1.0, hi=float("inf")), "inf"),
                                          (dict(target_share=1.5), "1.5"),
                                          (dict(iters=-1), "-1")])
def test_bad_settings_raise_sweep_error_naming_the_value(kwargs, word):
    with pytest.raises(sweep.SweepError, match=word):
        sweep.find_max_goodput_rate(fake_measure([]), progress=False, **kwargs)


def test_result_without_slos_is_refused():
    with pytest.raises(sweep.SweepError, match="slo_attainment"):
        sweep.find_max_goodput_rate(lambda rate: {"request_throughput": rate}, progress=False)


def test_plot_writes_a_png(tmp_path):
    out = sweep.find_max_goodput_rate(fake_measure([]), lo=1.0, hi=5.0, iters=2, progress=False)
    path = sweep.plot(out, tmp_path / "goodput_vs_rate.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 5000
