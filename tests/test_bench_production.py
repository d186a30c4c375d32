"""Production traces (Mooncake JSON lines, Azure CSV): readers, fitting, prompts whose shared
blocks are shared token for token, the replay report, the workload options. Fast: tiny
traces written here, the real tokenizer, no servers."""

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from epdserve.argtypes import config_from
from epdserve.bench import production, run, workload
from epdserve.bench.production import Fit, build_requests, describe_replay, fit_rows
from epdserve.bench.production_formats import (TraceRow, detect_format, parse_azure_timestamp,
                                               read_azure, read_mooncake, read_production)
from epdserve.bench.traces import TraceError

# Three requests sharing block 0 (a system prompt); the third repeats the first's first two
# blocks (a later turn); the second arrives 105 ms after the first.
MOONCAKE = [
    {"timestamp": 0, "input_length": 1200, "output_length": 52, "hash_ids": [0, 1, 2]},
    {"timestamp": 105, "input_length": 1800, "output_length": 26, "hash_ids": [0, 3, 4, 5]},
    {"timestamp": 2000, "input_length": 1300, "output_length": 10, "hash_ids": [0, 1, 6]},
    {"timestamp": 4500, "input_length": 600, "output_length": 300, "hash_ids": [7, 8]},
]
AZURE = """TIMESTAMP,ContextTokens,GeneratedTokens
2023-11-16 18:15:46.6805900,374,44
2023-11-16 18:15:50.9951690,396,109
2023-11-16 18:15:51.2224670,879,55
2023-11-16 18:15:51.3910170,91,16
"""


@pytest.fixture(scope="module")
def tok():
    return workload.load_tokenizer_for(None)


@pytest.fixture
def mooncake_file(tmp_path):
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in MOONCAKE))
    return path


@pytest.fixture
def azure_file(tmp_path):
    path = tmp_path / "azure.csv"
    path.write_text(AZURE)
    return path


def tokens(tok, text):
    return tok.encode(text, add_special_tokens=False)


# ---------------------------------------------------------------------------------------
# Readers


def test_mooncake_reader_keeps_lengths_times_and_ids(mooncake_file):
    trace = read_mooncake(mooncake_file)
    assert trace.format == "mooncake" and trace.reordered == 0 and trace.hash_count_mismatches == 0
    assert [r.timestamp_s for r in trace.rows] == [0.0, 0.105, 2.0, 4.5]
    assert [(r.input_len, r.output_len) for r in trace.rows] == [(1200, 52), (1800, 26),
                                                                  (1300, 10), (600, 300)]
    assert trace.rows[1].hash_ids == (0, 3, 4, 5)


def test_azure_reader_parses_100ns_timestamps_relative_to_the_first(azure_file):
    trace = read_azure(azure_file)
    assert [(r.input_len, r.output_len, r.hash_ids) for r in trace.rows][:2] == [(374, 44, None),
                                                                                 (396, 109, None)]
    assert trace.rows[0].timestamp_s == 0.0
    assert trace.rows[1].timestamp_s == pytest.approx(4.314579, abs=1e-6)
    assert trace.rows[3].timestamp_s == pytest.approx(4.710427, abs=1e-6)
    # 7 fractional digits; T or a space; a zone offset is honoured.
    assert parse_azure_timestamp("2023-11-16T18:15:46.6805900+01:00") == pytest.approx(
        parse_azure_timestamp("2023-11-16 17:15:46.68059"), abs=1e-6)
    for bad in ("2023-11-16", "2023-13-16 18:15:46.6", "18:15:46", "2023-11-16 18:15:46.x"):
        with pytest.raises(ValueError):
            parse_azure_timestamp(bad)


def test_rows_out_of_order_are_sorted_and_counted_odd_id_counts_counted(tmp_path):
    path = tmp_path / "t.jsonl"
    rows = [dict(MOONCAKE[2]), dict(MOONCAKE[0]), {**MOONCAKE[1], "hash_ids": [0, 3]}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    trace = read_mooncake(path)
    assert [r.timestamp_s for r in trace.rows] == [0.0, 0.105, 2.0]
    assert trace.reordered == 1 and trace.hash_count_mismatches == 1


def test_format_detection_and_a_file_of_the_other_format(mooncake_file, azure_file, tmp_path):
    assert detect_format(mooncake_file) == "mooncake" and detect_format(azure_file) == "azure"
    saved = tmp_path / "saved.jsonl"
    saved.write_text('{"offset_s": 0, "prompt": "x", "max_tokens": 1, "kind": "chat", '
                     '"prompt_tokens": 1}\n')
    assert detect_format(saved) is None
    with pytest.raises(TraceError, match="mooncake format, not azure"):
        read_production(mooncake_file, "azure")


@pytest.mark.parametrize("line, needle", [
    ("{nope", "not valid JSON"),
    ("[1, 2]", "expected a JSON object"),
    ('{"input_length": 5, "output_length": 1}', "missing field 'timestamp'"),
    ('{"timestamp": 0, "input_length": -3, "output_length": 1}',
     "field 'input_length' must be an integer >= 1, got -3"),
    ('{"timestamp": 0, "input_length": 5.5, "output_length": 1}', "field 'input_length'"),
    ('{"timestamp": "0", "input_length": 5, "output_length": 1}', "field 'timestamp'"),
    ('{"timestamp": -1, "input_length": 5, "output_length": 1}', "field 'timestamp'"),
    ('{"timestamp": 0, "input_length": 5, "output_length": true}', "field 'output_length'"),
    ('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [1, -2]}',
     "field 'hash_ids' must be a list of integers >= 0, got -2 (item 1)"),
    ('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": "1,2"}',
     "field 'hash_ids'"),
])
def test_malformed_mooncake_lines_name_file_line_and_field(tmp_path, line, needle):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(MOONCAKE[0]) + "\n\n" + line + "\n")
    with pytest.raises(TraceError, match=re.escape(needle)) as info:
        read_mooncake(path)
    assert str(info.value).startswith(f"{path}:3:")


@pytest.mark.parametrize("row, needle", [
    ("2023-11-16 18:15:47.0,-3,5", "field 'ContextTokens' must be an integer >= 1, got '-3'"),
    ("2023-11-16 18:15:47.0,12,many", "field 'GeneratedTokens'"),
    ("2023-11-16 18:15:47.0,12", "field 'GeneratedTokens'"),
    ("yesterday,12,5", "field 'TIMESTAMP' must be a time like"),
])
def test_malformed_azure_rows_name_file_line_and_field(tmp_path, row, needle):
    path = tmp_path / "bad.csv"
    path.write_text(AZURE + row + "\n")
    with pytest.raises(TraceError, match=re.escape(needle)) as info:
        read_azure(path)
    assert str(info.value).startswith(f"{path}:6:")


def test_missing_column_missing_and_empty_files(tmp_path):
    path = tmp_path / "cols.csv"
    path.write_text("TIMESTAMP,ContextTokens\n2023-11-16 18:15:47.0,12\n")
    with pytest.raises(TraceError, match=r"cols.csv:1: missing column\(s\) GeneratedTokens"):
        read_azure(path)
    with pytest.raises(TraceError, match="nothere.jsonl"):
        read_mooncake(tmp_path / "nothere.jsonl")
    for name, reader in (("e.jsonl", read_mooncake), ("e.csv", read_azure)):
        (tmp_path / name).write_text("\n" if name.endswith("jsonl") else "")
        with pytest.raises(TraceError, match="no requests"):
            reader(tmp_path / name)
    (tmp_path / "h.csv").write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n")
    with pytest.raises(TraceError, match="no requests"):
        read_azure(tmp_path / "h.csv")


# ---------------------------------------------------------------------------------------
# Fitting and the replay report


def test_unfitted_replay_reproduces_lengths_arrivals_and_sharing(mooncake_file):
    rows = read_mooncake(mooncake_file).rows
    fitted = fit_rows(rows, Fit())
    assert fitted == list(rows)
    report = describe_replay(rows, fitted)
    assert report["original"] == report["replayed"]
    o = report["original"]
    assert o["count"] == 4 and o["duration_s"] == 4.5
    assert o["input_len"]["p50"] == 1250 and o["output_len"]["mean"] == 97
    assert o["inter_arrival_s"]["mean"] == pytest.approx(1.5)
    # Shared: request 2's block 0 (512) and request 3's blocks 0 and 1 (1024) of 4,900.
    assert o["shared_prompt_share"] == pytest.approx((512 + 1024) / 4900)


def test_window_start_duration_and_count(mooncake_file):
    rows = read_mooncake(mooncake_file).rows
    assert [r.input_len for r in fit_rows(rows, Fit(start_s=0.1))] == [1800, 1300, 600]
    window = fit_rows(rows, Fit(start_s=0.1, duration_s=2.0))
    assert [r.timestamp_s for r in window] == [0.0, pytest.approx(1.895)]
    assert len(fit_rows(rows, Fit(num_prompts=2))) == 2
    with pytest.raises(TraceError, match="holds no request"):
        fit_rows(rows, Fit(start_s=10))
    # Sharing is counted within the replayed set: the window drops request 1's blocks.
    report = describe_replay(rows, window)
    assert report["replayed"]["shared_prompt_share"] == pytest.approx(512 / 3100)
    assert report["original"]["count"] == 4 and report["replayed"]["count"] == 2


def test_time_scale_multiplies_arrival_offsets(mooncake_file):
    rows = read_mooncake(mooncake_file).rows
    report = describe_replay(rows, fit_rows(rows, Fit(time_scale=0.1)))
    assert report["replayed"]["duration_s"] == pytest.approx(0.45)
    assert report["replayed"]["inter_arrival_s"]["p50"] == pytest.approx(
        report["original"]["inter_arrival_s"]["p50"] * 0.1)


def test_length_scale_and_caps(mooncake_file):
    rows = read_mooncake(mooncake_file).rows
    fit = Fit(length_scale=0.05)
    assert fit.block_tokens == 26  # round(25.6)
    scaled = fit_rows(rows, fit)
    assert [(r.input_len, r.output_len) for r in scaled] == [(60, 3), (90, 1), (65, 1), (30, 15)]
    assert [r.hash_ids for r in scaled] == [(0, 1, 2), (0, 3, 4, 5), (0, 1, 6), (7, 8)]
    report = describe_replay(rows, scaled, fit.block_tokens)
    assert report["replayed"]["input_len"]["mean"] == pytest.approx(61.25)
    assert report["replayed"]["shared_prompt_share"] == pytest.approx((26 + 52) / 245)
    capped = fit_rows(rows, Fit(length_scale=0.05, max_input_len=40, max_output_len=2))
    # A capped prompt keeps its first blocks: 40 tokens reach blocks 0 and 1 only.
    assert [(r.input_len, r.output_len, r.hash_ids) for r in capped][1] == (40, 1, (0, 3))
    assert max(r.output_len for r in capped) == 2


def test_replay_lines_are_an_aligned_markdown_table(mooncake_file, azure_file):
    rows = read_mooncake(mooncake_file).rows
    report = describe_replay(rows, fit_rows(rows, Fit(num_prompts=1)))
    lines = production.replay_lines(report)
    assert lines[0].startswith("| trace") and "original" in lines[0] and "replayed" in lines[0]
    assert len({len(line) for line in lines}) == 1  # aligned columns
    assert any("inter-arrival (s)" in line and "—" in line for line in lines)  # 1 request
    assert "31%" in lines[-1] and "0%" in lines[-1]
    azure = read_azure(azure_file).rows
    assert describe_replay(azure, azure)["original"]["shared_prompt_share"] == 0.0


def test_fit_rejects_bad_values():
    for bad in (dict(start_s=-1), dict(time_scale=0), dict(length_scale=float("inf")),
                dict(num_prompts=0), dict(max_input_len=-5)):
        with pytest.raises(TraceError):
            Fit(**bad)


# ---------------------------------------------------------------------------------------
# Prompts


def test_equal_hash_ids_give_equal_token_blocks_and_exact_counts(tok, mooncake_file):
    fit = Fit(length_scale=0.05)
    rows = fit_rows(read_mooncake(mooncake_file).rows, fit)
    requests = build_requests(rows, tok, fit.block_tokens, seed=3)
    ids = [tokens(tok, r.prompt) for r in requests]
    assert [len(x) for x in ids] == [r.prompt_tokens for r in requests] == [60, 90, 65, 30]
    b = fit.block_tokens
    assert ids[0][:b] == ids[1][:b] == ids[2][:b]  # hash id 0
    assert ids[0][:2 * b] == ids[2][:2 * b]  # ids 0, 1: a prefix of two blocks
    assert ids[0][b:2 * b] != ids[1][b:2 * b]  # ids 1 and 3 differ
    assert requests[0].prompt[:200] == requests[2].prompt[:200]  # byte-equal text too
    assert [r.max_tokens for r in requests] == [3, 1, 1, 15]
    assert [r.offset_s for r in requests] == [0.0, 0.105, 2.0, 4.5]
    assert all(r.kind == "chat" for r in requests)
    # Whole-prompt tokens are the blocks' tokens concatenated (nothing merges at borders).
    builder = production.PromptBuilder(tok, b, seed=3)
    block_text = builder.prompt(TraceRow(0, b, 1, (1,)), 0)
    assert ids[0][b:2 * b] == tokens(tok, block_text)
    # The same seed gives the same trace; another seed other text.
    assert build_requests(rows, tok, b, seed=3) == requests
    assert build_requests(rows, tok, b, seed=4)[0].prompt != requests[0].prompt


def test_azure_prompts_are_distinct_and_exact(tok, azure_file):
    rows = fit_rows(read_azure(azure_file).rows, Fit(length_scale=0.2))
    requests = build_requests(rows, tok, seed=0)
    assert [r.prompt_tokens for r in requests] == [75, 79, 176, 18]
    assert [len(tokens(tok, r.prompt)) for r in requests] == [75, 79, 176, 18]
    firsts = [tokens(tok, r.prompt)[:16] for r in requests]
    assert len({tuple(x) for x in firsts}) == 4
    planned = build_requests(rows, None)[0]  # the planner's stand-in: 4 characters a token
    assert len(planned.prompt) == 4 * 75 and planned.prompt_tokens == 75


def test_a_thousand_prompts_of_400_tokens_build_in_seconds(tok):
    rows = [TraceRow(i * 0.1, 400, 8, (0, *range(1 + 3 * i, 4 + 3 * i))) for i in range(1000)]
    t0 = time.perf_counter()
    requests = build_requests(rows, tok, block_tokens=100)
    assert time.perf_counter() - t0 < 30  # ~2 s on an idle core; generous for a loaded CI
    assert len(requests) == 1000 and requests[-1].prompt_tokens == 400


# ---------------------------------------------------------------------------------------
# Workload options (bench and compare)


def _parse(*argv):
    parser = argparse.ArgumentParser()
    run.add_arguments(parser)
    return config_from(run.BenchOptions, parser.parse_args(["--base-url", "http://127.0.0.1:1", *argv])).workload


def test_workload_mooncake_builds_the_fitted_trace_and_its_spec(mooncake_file, capsys):
    args = _parse("--workload", "mooncake", "--dataset-path", str(mooncake_file),
                  "--start", "0.1", "--num-prompts", "2", "--time-scale", "2",
                  "--length-scale", "0.05", "--max-input-len", "80", "--max-output-len", "64")
    requests, spec = workload.build_from_args(args)
    assert [(r.offset_s, r.prompt_tokens) for r in requests] == [(0.0, 80), (3.79, 65)]
    assert spec["source"] == "mooncake" and spec["dataset_path"] == str(mooncake_file)
    assert (spec["start_s"], spec["num_prompts"], spec["time_scale"], spec["length_scale"],
            spec["max_input_len"], spec["max_output_len"], spec["block_tokens"]) == (
        0.1, 2, 2.0, 0.05, 80, 64, 26)
    assert spec["replay"]["replayed"]["count"] == 2 and spec["replay"]["original"]["count"] == 4
    json.dumps(spec)  # compare.json holds it
    err = capsys.readouterr().err
    assert "2 of 4 requests replayed" in err and "prompt tokens in shared blocks" in err


def test_workload_azure_and_option_checks(azure_file, mooncake_file):
    requests, spec = workload.build_from_args(
        _parse("--workload", "azure", "--dataset-path", str(azure_file), "--duration", "4.6"))
    assert [r.prompt_tokens for r in requests] == [374, 396, 879]
    assert spec["duration_s"] == 4.6 and spec["replay"]["replayed"]["shared_prompt_share"] == 0
    for argv, needle in [
        (("--workload", "synthetic", "--time-scale", "2"), "--time-scale: for --workload"),
        (("--workload", "azure", "--dataset-path", str(azure_file), "--request-rate", "3"),
         "takes arrivals and lengths from the trace"),
        (("--workload", "mooncake",), "needs --dataset-path"),
        (("--workload", "prefix", "--dataset-path", str(mooncake_file)), "--dataset-path is for"),
        (("--workload", "mooncake", "--dataset-path", str(mooncake_file), "--start", "99"),
         "holds no request"),
    ]:
        with pytest.raises(TraceError, match=needle):
            workload.build_from_args(_parse(*argv))


@pytest.mark.parametrize("argv, needle", [
    (("--time-scale", "-1"), "'-1': must be a finite number > 0"),
    (("--length-scale", "x"), "'x': not a number"),
    (("--start", "-2"), "'-2': must be a finite number >= 0"),
    (("--duration", "0"), "'0': must be a finite number > 0"),
    (("--max-input-len", "0"), "'0': must be >= 1"),
    (("--max-output-len", "1.5"), "'1.5': not an integer"),
    (("--workload", "burstgpt"), "'burstgpt': expected one of synthetic"),
])
def test_bad_option_values_are_rejected_naming_the_value(capsys, argv, needle):
    with pytest.raises(SystemExit):
        _parse(*argv)
    assert needle in capsys.readouterr().err


def test_cli_malformed_trace_exits_2_naming_file_line_and_field(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(MOONCAKE[0]) + '\n{"timestamp": 5, "input_length": 0, '
                    '"output_length": 3}\n')
    proc = subprocess.run([sys.executable, "-m", "epdserve", "bench", "--base-url",
                           "http://127.0.0.1:9", "--workload", "mooncake", "--dataset-path",
                           str(path)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert f"{path}:2: field 'input_length' must be an integer >= 1, got 0" in proc.stderr


def test_example_traces_are_what_make_traces_writes_and_read_cleanly(tmp_path):
    root = Path(__file__).resolve().parent.parent
    subprocess.run([sys.executable, str(root / "benchmarks" / "make_traces.py"), "--output",
                    str(tmp_path)], check=True, capture_output=True, timeout=120)
    for name, fmt in (("mooncake_like.jsonl", "mooncake"), ("azure_conv_like.csv", "azure"),
                      ("azure_code_like.csv", "azure")):
        example = root / "examples" / "traces" / name
        assert (tmp_path / name).read_bytes() == example.read_bytes(), name
        trace = read_production(example, fmt)
        assert len(trace.rows) == 300 and trace.reordered == 0
        assert trace.hash_count_mismatches == 0 and example.stat().st_size < 100_000
    rows = read_mooncake(root / "examples" / "traces" / "mooncake_like.jsonl").rows
    assert 0.5 < production.shared_token_share(rows) < 0.7
