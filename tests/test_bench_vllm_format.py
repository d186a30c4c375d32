"""``epdserve bench`` writes what ``vllm bench serve`` writes: a real short run against a
colocated deployment gives vLLM's keys (``latencies``, ``label``, ``tokenizer_id``, ...), the
asked percentiles, the metadata and vLLM's file name; ``--dataset-name`` is ``--workload``;
``ignore_eos`` is sent where vLLM sends it; bad values are CLI errors naming them."""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys

import pytest

from epdserve.bench import metrics, result_file, workload
from epdserve.argtypes import config_from
from epdserve.bench.run import BenchOptions, add_arguments

from conftest import cli_exit


def parse(*argv: str) -> BenchOptions:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return config_from(BenchOptions, parser.parse_args(["--base-url", "http://127.0.0.1:9", *argv]))


def file_name(result: dict, *argv: str):
    options = parse(*argv)
    return result_file.file_name(options.result, result, options.workload.arrivals.request_rate)


def run_cli(*argv: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "epdserve", "bench", *argv], capture_output=True, text=True,
                          timeout=timeout)


def test_a_short_run_writes_vllms_result_file(colocated_server, tmp_path):
    proc = run_cli("--base-url", colocated_server.url, "--dataset-name", "random", "--num-prompts", "3",
                   "--input-len", "8:16", "--output-len", "4", "--max-concurrency", "2", "--disable-tqdm",
                   "--label", "smoke", "--metadata", "version=0.3.3", "tp=1",
                   "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "25,50,99.9",
                   "--save-result", "--result-dir", str(tmp_path / "results"))
    assert proc.returncode == 0, proc.stderr
    [path] = (tmp_path / "results").iterdir()
    result = json.loads(path.read_text())
    model = result["model_id"]
    assert re.fullmatch(rf"smoke-infqps-concurrency2-{re.escape(model)}-\d{{8}}-\d{{6}}\.json", path.name)
    assert path.name.endswith(f"-{result['date']}.json") and str(path) in proc.stdout
    assert list(result)[:7] == ["date", "endpoint_type", "backend", "label", "model_id", "tokenizer_id",
                                "num_prompts"]
    assert (result["label"], result["backend"], result["num_prompts"]) == ("smoke", "openai-chat", 3)
    assert result["tokenizer_id"] and (result["version"], result["tp"]) == ("0.3.3", "1")
    assert (result["request_rate"], result["burstiness"], result["max_concurrency"]) == ("inf", 1.0, 2)
    assert result["workload"]["source"] == "synthetic" and result["completed"] == 3
    assert result["latencies"] == result["e2els"] and len(result["latencies"]) == 3
    # random (synthetic) sends ignore_eos, as vLLM's random dataset does: lengths as asked
    assert result["ignore_eos"] is True and result["output_lens"] == [4, 4, 4]
    for m in ("ttft", "tpot", "itl", "e2el"):
        for stat in ("mean", "median", "std", "p25", "p50", "p99.9"):
            assert f"{stat}_{m}_ms" in result, (stat, m)
    assert not any(k.startswith(("p90_", "p95_", "p99_")) for k in result)
    assert result["p25_e2el_ms"] <= result["p50_e2el_ms"] <= result["p99.9_e2el_ms"]


@pytest.mark.parametrize("argv, needle", [
    (["--metric-percentiles", "50,abc"], "'abc' in '50,abc'"),
    (["--metric-percentiles", "0"], "'0' in '0'"),
    (["--percentile-metrics", "ttft,client_queue_time"], "'client_queue_time'"),
    (["--metadata", "version"], "'version': expected KEY=VALUE"),
    (["--dataset-name", "sonnet"], "'sonnet': expected one of"),
    (["--result-dir", "out"], "--result-dir need"),
    (["--result-filename", "r.json"], "--result-filename need"),
    (["--save-result", "--result-file", "r.json"], "exclude each other"),
    (["--metadata", "model_id=x"], "'model_id' is a field of the result"),
    (["--metadata", "p50_ttft_ms=1", "--metric-percentiles", "50"], "'p50_ttft_ms' is a field"),
    (["--metadata", "a=1", "a=2"], "a key given twice (a)"),
])
def test_bad_values_are_cli_errors_naming_them(capsys, argv, needle):
    """The command's own entry point, in-process: exit status 2 before anything is sent."""
    code, err = cli_exit(capsys, ["bench", "--base-url", "http://127.0.0.1:9", *argv])
    assert code == 2 and needle in err, err


def test_dataset_name_is_workload_with_vllms_names():
    assert parse("--dataset-name", "prefix").workload.workload == "prefix"
    assert parse("--dataset-name", "random").workload.workload == "synthetic"
    assert parse("--dataset-name", "prefix_repetition").workload.workload == "prefix"
    assert parse("--workload", "sharegpt").workload.workload == "sharegpt"


@pytest.mark.parametrize("argv, sends", [
    ([], True), (["--workload", "demo"], True), (["--dataset-name", "prefix_repetition"], False),
    (["--workload", "prefix", "--ignore-eos"], True), (["--workload", "sharegpt"], False),
    (["--trace", "t.jsonl", "--workload", "prefix"], True), (["--workload", "mooncake"], True),
])
def test_ignore_eos_where_vllm_sets_it(argv, sends):
    options = parse(*argv)
    assert workload.sends_ignore_eos(options.workload, options.client.ignore_eos) is sends


def test_file_names_follow_vllms_pattern(tmp_path):
    result = {"backend": "openai", "label": None, "model_id": "org/Model-1B", "date": "20261201-120000",
              "max_concurrency": None, "request_rate": 0.2739726}
    assert file_name(result, "--save-result", "--request-rate", "2").name == \
        "openai-2.0qps-Model-1B-20261201-120000.json"
    assert file_name(result, "--save-result").name == \
        "openai-0.274qps-Model-1B-20261201-120000.json"  # a replayed trace's mean rate
    ramp = {**result, "label": "x", "max_concurrency": 4, "ramp_up_strategy": "linear", "ramp_up_start_rps": 1.0,
            "ramp_up_end_rps": 3.0}
    assert file_name(ramp, "--save-result").name == \
        "x-ramp-up-linear-1.0qps-3.0qps-concurrency4-Model-1B-20261201-120000.json"
    assert file_name(result, "--save-result", "--result-dir", str(tmp_path), "--result-filename", "r.json") == \
        tmp_path / "r.json"
    assert file_name(result) is None
    assert str(file_name(result, "--result-file", "a/b.json")) == "a/b.json"


def test_percentile_keys_are_vllms():
    assert metrics.percentile_key(99, "ttft") == "p99_ttft_ms"
    assert metrics.percentile_key(99.9, "itl") == "p99.9_itl_ms"
    got = metrics.compute([], None, (50.0,), ("e2el",))
    assert {k for k in got if k.endswith("_ms")} == {"mean_e2el_ms", "median_e2el_ms", "std_e2el_ms",
                                                     "p50_e2el_ms"}
