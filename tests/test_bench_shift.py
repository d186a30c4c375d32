"""The shifting workload (--workload shift): phases, their rates and order, the phase
table, seeds, retime, bad SPECs, and the CLI path that builds and saves the trace."""

import argparse
import json

import numpy as np
import pytest

from epdserve import cli
from epdserve.argtypes import add_flags, config_from
from epdserve.bench import datasets, report, workload
from epdserve.bench.prompts import count_tokens
from epdserve.bench.workload import TraceError
from epdserve.bench.arrivals import retime
from epdserve.bench.traces import describe

# Three phases of 150 requests: enough for a mean gap within 25 % of 1/rate (the mean of
# 150 exponential gaps has a relative standard deviation of 1/sqrt(150) = 8 %).
RATES = (2.0, 0.5, 5.0)
MANY = ";".join(f"in=4:{8 + k},out={10 * (k + 1)}:{10 * (k + 1) + 5},rate={r},n=150"
                for k, r in enumerate(RATES))


@pytest.fixture(scope="module")
def tok():
    return workload.load_tokenizer_for(None)


@pytest.fixture(scope="module")
def many(tok):
    return datasets.shift(tok, datasets.parse_phases(MANY), seed=3)


def gaps_into(requests, table, k):
    """The gaps before each request of phase k (its first: from the previous phase's last)."""
    offsets = np.array([r.offset_s for r in requests])
    lo, hi = table["first"][k], table["first"][k] + table["n"][k]
    return np.diff(offsets[max(lo - 1, 0):hi])


def test_default_phases_fit_the_window_and_follow_their_mixes(tok):
    phases = datasets.parse_phases(datasets.SHIFT_DEFAULT)
    assert [(p.input_len, p.output_len, p.rate, p.num) for p in phases] == [
        ((1200, 1700), (8, 16), 0.12, 10), ((30, 120), (200, 400), 0.3, 24),
        ((50, 200), (32, 64), 0.05, 4)]
    datasets.check_window(phases, 2048)  # fits even a 2,048-token window
    requests, table = datasets.shift(tok, phases, seed=0)
    assert len(requests) == 38 and requests[0].offset_s == 0.0
    for p, part in zip(phases, datasets.split_by_phase(requests, table)):
        assert len(part) == p.num
        assert all(p.input_len[0] <= r.prompt_tokens <= p.input_len[1] for r in part)
        assert all(p.output_len[0] <= r.max_tokens <= p.output_len[1] for r in part)
    long_prompt = requests[0]
    assert count_tokens(tok, long_prompt.prompt) == long_prompt.prompt_tokens >= 1200
    # About 4 minutes of arrivals, as the defaults say.
    assert 120 < requests[-1].offset_s < 480


def test_phases_come_in_order_back_to_back(many):
    requests, table = many
    offsets = [r.offset_s for r in requests]
    assert offsets == sorted(offsets)
    assert table["first"] == [0, 150, 300] and table["n"] == [150] * 3
    assert table["start_s"][0] == 0.0
    for k in (1, 2):
        assert table["start_s"][k] == table["end_s"][k - 1] == requests[table["first"][k] - 1].offset_s
    for k, part in enumerate(datasets.split_by_phase(requests, table)):
        assert table["end_s"][k] == part[-1].offset_s
        assert {r.max_tokens // 10 for r in part} == {k + 1}  # each phase its own out range


def test_each_phase_arrives_at_its_own_rate(many):
    requests, table = many
    for k, rate in enumerate(RATES):
        mean_gap = gaps_into(requests, table, k).mean()
        assert mean_gap == pytest.approx(1 / rate, rel=0.25), (rate, mean_gap)
    # Poisson: the gaps' coefficient of variation is about 1.
    gaps = gaps_into(requests, table, 1)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.3)


def test_burstiness_shapes_the_gaps_within_a_phase(tok):
    phases = datasets.parse_phases("in=4:8,out=5,rate=1,n=200")
    requests, table = datasets.shift(tok, phases, seed=1, burstiness=4.0)
    gaps = gaps_into(requests, table, 0)
    assert gaps.mean() == pytest.approx(1.0, rel=0.2)
    assert gaps.std() / gaps.mean() == pytest.approx(0.5, rel=0.3)  # 1/sqrt(4)


def test_same_seed_same_trace_other_seed_other_trace(tok):
    phases = datasets.parse_phases("in=5:50,out=5:9,rate=1,n=6;in=4:9,out=20:30,rate=3,n=6")
    a = datasets.shift(tok, phases, seed=7)
    assert datasets.shift(tok, phases, seed=7) == a
    b = datasets.shift(tok, phases, seed=8)
    assert [r.prompt for r in b[0]] != [r.prompt for r in a[0]]
    assert [r.offset_s for r in b[0]] != [r.offset_s for r in a[0]]


def test_retime_scales_every_phase_by_one_factor(many):
    """A goodput sweep re-times the trace: phases keep their indices and relative rates."""
    requests, table = many
    mean_rate = (len(requests) - 1) / requests[-1].offset_s
    faster = retime(requests, 2 * mean_rate)
    assert [r.prompt for r in faster] == [r.prompt for r in requests]
    assert (len(faster) - 1) / faster[-1].offset_s == pytest.approx(2 * mean_rate, rel=1e-4)
    for k in range(3):
        assert gaps_into(faster, table, k).mean() == pytest.approx(
            gaps_into(requests, table, k).mean() / 2, rel=1e-4)
    assert [len(p) for p in datasets.split_by_phase(faster, table)] == [150, 150, 150]


def test_trace_round_trip_keeps_phase_order(many, tmp_path):
    requests, table = many
    workload.save_trace(requests, tmp_path / "shift.jsonl")
    loaded = workload.load_trace(tmp_path / "shift.jsonl")
    assert loaded == requests
    assert datasets.split_by_phase(loaded, table) == datasets.split_by_phase(requests, table)
    with pytest.raises(TraceError, match="449 requests, but the phase table has 450"):
        datasets.split_by_phase(loaded[1:], table)


@pytest.mark.parametrize("spec, needle", [
    ("", "empty phase list"),
    (" ; ", "empty phase list"),
    ("in=1:2,out=3,rate=1,n=2;", "shift phase 2 (''): empty phase"),
    ("in=1:2,out=3,rate=1,n=2,s=60", "unknown key 's'"),
    ("in=1:2,out=3,rate=1,n=2,in=3", "key 'in' given twice"),
    ("in=1:2,out=3,rate=1", "missing n"),
    ("in=1:2,out3,rate=1,n=2", "unknown key 'out3'"),
    ("in=5:2,out=3,rate=1,n=2", "in=5:2: need 1 <= MIN <= MAX"),
    ("in=0:2,out=3,rate=1,n=2", "in=0:2: need 1 <= MIN <= MAX"),
    ("in=1:2:3,out=3,rate=1,n=2", "in=1:2:3: expected MIN:MAX"),
    ("in=1:2,out=a:b,rate=1,n=2", "out=a:b: not an integer"),
    ("in=1:2,out=3,rate=0,n=2", "rate=0: must be a finite number > 0"),
    ("in=1:2,out=3,rate=-1,n=2", "rate=-1"),
    ("in=1:2,out=3,rate=inf,n=2", "rate=inf"),
    ("in=1:2,out=3,rate=x,n=2", "rate=x"),
    ("in=1:2,out=3,rate=1,n=0", "n=0: must be >= 1"),
    ("in=1:2,out=3,rate=1,n=2;in=1,out=3,rate=1,n=1.5", "shift phase 2 ('in=1,out=3,rate=1,n=1.5'): n=1.5"),
])
def test_bad_specs_name_the_phase_and_part(spec, needle):
    with pytest.raises(TraceError) as exc:
        datasets.parse_phases(spec)
    assert needle in str(exc.value), exc.value


def test_a_phase_over_the_window_is_refused():
    phases = datasets.parse_phases("in=10,out=5,rate=1,n=1;in=1500:2000,out=8:16,rate=1,n=1")
    with pytest.raises(TraceError, match=r"shift phase 2: in max 2000 \+ out max 16 \+ 32 "
                                         r"template tokens = 2048 > the model's 2047-token window"):
        datasets.check_window(phases, 2047)
    datasets.check_window(phases, 2048)


def bench_args(*argv):
    parser = argparse.ArgumentParser()
    add_flags(parser, workload.WorkloadOptions)
    return config_from(workload.WorkloadOptions, parser.parse_args(list(argv)))


def test_build_records_the_phase_table_and_refuses_other_options(tmp_path):
    args = bench_args("--workload", "shift", "--shift-phases", "in=2:9,out=4,rate=2,n=3;"
                      "in=4:9,out=30:40,rate=1,n=2", "--save-trace", str(tmp_path / "t.jsonl"))
    requests, spec = workload.build_from_args(args)
    assert spec["source"] == "shift" and spec["seed"] == 0 and len(requests) == 5
    assert spec["phases"] == "in=2:9,out=4:4,rate=2,n=3;in=4:9,out=30:40,rate=1,n=2"
    assert datasets.format_phases(datasets.parse_phases(spec["phases"])) == spec["phases"]
    windows = spec["phase_windows"]
    assert windows["first"] == [0, 3] and windows["n"] == [3, 2]
    assert windows["end_s"] == [requests[2].offset_s, requests[4].offset_s]
    assert json.loads(json.dumps(spec)) == spec  # goes into the result JSON as it is
    lines = report.workload_lines(spec, describe(requests))  # compare.md's workload
    assert "phases=in=2:9,out=4:4,rate=2,n=3;in=4:9,out=30:40,rate=1,n=2" in lines[0]
    assert "phase_windows" not in lines[0]
    assert lines[2] == f"- phase 1: requests 0–2, sent 0.0–{requests[2].offset_s:.1f} s"
    assert lines[3].startswith("- phase 2: requests 3–4, sent ")
    assert workload.load_trace(tmp_path / "t.jsonl") == requests
    assert workload.sends_ignore_eos(args)
    over = bench_args("--workload", "shift", "--shift-phases", "in=8192,out=1,rate=1,n=1")
    with pytest.raises(TraceError, match="> the model's 8192-token window"):
        workload.build_from_args(over)  # the default model's max_position_embeddings
    with pytest.raises(TraceError, match="--shift-phases is for --workload shift, not synthetic"):
        workload.build_from_args(bench_args("--shift-phases", "in=1,out=1,rate=1,n=1"))
    with pytest.raises(TraceError, match="--request-rate, --num-prompts: --workload shift sets"):
        workload.build_from_args(bench_args("--workload", "shift", "--request-rate", "2",
                                            "--num-prompts", "4"))


def test_cli_builds_and_saves_the_trace_and_refuses_a_bad_spec(tmp_path, capsys):
    """``epdserve bench`` in-process: the trace is built and saved before the (here
    unreachable) server is asked for, so a shift trace can be made for ``--trace`` and
    ``epdserve plan --trace`` with no server; a bad SPEC is a usage error, exit 2."""
    path = tmp_path / "shift.jsonl"
    spec = "in=100:200,out=8:16,rate=0.5,n=4;in=10:20,out=100:150,rate=2,n=6"
    with pytest.raises(SystemExit) as exit_:
        cli.main(["bench", "--base-url", "http://127.0.0.1:9", "--workload", "shift",
                  "--shift-phases", spec, "--seed", "5", "--save-trace", str(path)])
    assert exit_.value.code == 2 and "cannot reach server" in capsys.readouterr().err
    saved = workload.load_trace(path)
    expected, _ = datasets.shift(workload.load_tokenizer_for(None), datasets.parse_phases(spec), seed=5)
    assert saved == expected and [r.max_tokens >= 100 for r in saved] == [False] * 4 + [True] * 6
    with pytest.raises(SystemExit) as exit_:
        cli.main(["bench", "--base-url", "http://127.0.0.1:9", "--workload", "shift",
                  "--shift-phases", "in=1:2,out=3,rate=0,n=2"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "Traceback" not in err
    assert "argument --shift-phases: shift phase 1 ('in=1:2,out=3,rate=0,n=2'): rate=0" in err
