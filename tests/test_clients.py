"""The field's client tools, unmodified, against real deployments (issue 17): AIPerf's
``profile`` (streaming chat, PD; its TTFT and ITL agree with ``epdserve bench`` on the same
load), GuideLLM's ``run`` (synchronous and constant rate, colocated) and
lm-evaluation-harness's ``local-completions`` (a log-likelihood task, the same scores
colocated and PD).

Each tool runs as its own command from the venv of the ``clients`` extra
(``.venv-clients``, which ``make test-tools`` builds; ``EPDSERVE_CLIENTS_VENV`` names
another), exactly as a user would start it: none of them is imported here. Every tool
process group is killed when its run ends, also on failure or timeout. The openai SDK's
smoke (``models.list``, a streamed chat, ``completions.create``) is in
``test_serving_openai.py``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

TOOL_TIMEOUT_S = 600.0  # one tool run (GuideLLM took ~6 min with both cores held by another run)
# Above pyproject's 600 s default: the lm-eval test makes three tool runs and starts two
# deployments (conftest's STARTUP_TIMEOUT_S, 300 s each).
pytestmark = [pytest.mark.clients, pytest.mark.timeout(3 * TOOL_TIMEOUT_S + 2 * 300)]

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data" / "clients"
# The tools load tokenizers and datasets from local paths only: no network here, and a
# test must not depend on one. AIPerf is left out of the offline switches: with
# HF_HUB_OFFLINE it looks a local tokenizer directory up in the hub cache and fails
# (aiperf 0.13 `Tokenizer._from_pretrained_local`); given a path it reads it directly.
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
# One load for both benchmark clients: requests, prompt and output tokens, concurrency.
LOAD = {"requests": 16, "input": 128, "output": 32, "concurrency": 2}
AGREEMENT = 0.15  # |AIPerf - epdserve bench| / epdserve bench, for the TTFT and ITL means


def clients_bin(name: str) -> Path:
    """The command ``name`` of the clients venv; skips when that venv was never built
    (a plain ``pytest`` run), fails when ``make test-tools`` named one that lacks it."""
    named = os.environ.get("EPDSERVE_CLIENTS_VENV")
    path = Path(named or ROOT / ".venv-clients") / "bin" / name
    if not path.exists():
        if named:
            pytest.fail(f"{path} is missing: the clients venv is incomplete")
        pytest.skip(f"{path} is missing: `make test-tools` installs the client tools")
    return path


def run_tool(argv: list, log: Path, tmp_path: Path, *, offline: bool = True,
             timeout_s: float = TOOL_TIMEOUT_S) -> None:
    """Run ``argv`` in a process group of its own with its output in ``log``, and kill
    the group when it ends (AIPerf and lm-eval start helper processes).

    Raises:
        AssertionError: it exited non-zero or ran past ``timeout_s`` (with the log's tail).
    """
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the tool's own venv only
    env["HF_HOME"] = str(tmp_path / "hf")  # dataset caches stay in the test's directory
    if offline:
        env.update(OFFLINE)
    with open(log, "w") as out:
        proc = subprocess.Popen([str(a) for a in argv], stdout=out, stderr=subprocess.STDOUT,
                                cwd=tmp_path, env=env, start_new_session=True)
    try:
        rc = proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        rc = None
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
    outcome = f"ran past {timeout_s:.0f} s" if rc is None else f"exited {rc}"
    assert rc == 0, f"{Path(argv[0]).name} {outcome}:\n{log.read_text(errors='replace')[-6000:]}"


def served_model(server) -> dict:
    """The first entry of ``/v1/models``."""
    return httpx.get(server.url + "/v1/models", timeout=30).json()["data"][0]


def tokenizer_dir(server, model_info) -> Path:
    """Where a user points a tool's tokenizer: ``/v1/models``' ``root`` when it names a
    directory with ``tokenizer.json`` (as vLLM's does), else the converted model
    directory, which has one (a ``.gguf`` root cannot be loaded by the tools)."""
    root = Path(served_model(server)["root"])
    return root if (root / "tokenizer.json").is_file() else model_info.path


def bench_ignore_eos_flags() -> list[str]:
    """``epdserve bench``'s switch for ignore_eos: ``--ignore-eos`` where bench has it (as
    ``vllm bench serve``), nothing where ignore_eos is bench's default."""
    out = subprocess.run([sys.executable, "-m", "epdserve", "bench", "--help"], capture_output=True,
                         text=True, timeout=120, check=True).stdout
    return ["--ignore-eos"] if "--ignore-eos" in out else []


# --------------------------------------------------------------------------- AIPerf


def epdserve_bench(server, tok: Path, tmp_path: Path) -> dict:
    """``epdserve bench`` with LOAD (a closed loop of LOAD["concurrency"] clients, every
    output exactly LOAD["output"] tokens); its result JSON."""
    result = tmp_path / "bench.json"
    run_tool([sys.executable, "-m", "epdserve", "bench", "--base-url", server.url, "--endpoint", "chat",
              "--workload", "synthetic", "--num-prompts", LOAD["requests"], "--input-len", LOAD["input"],
              "--output-len", LOAD["output"], "--max-concurrency", LOAD["concurrency"],
              "--tokenizer", tok, "--seed", 0, "--disable-tqdm", "--result-file", result,
              *bench_ignore_eos_flags()], tmp_path / "bench.log", tmp_path)
    return json.loads(result.read_text())


def aiperf_profile(server, tok: Path, tmp_path: Path) -> dict:
    """``aiperf profile`` with LOAD on the streaming chat endpoint; its summary JSON
    (``profile_export_aiperf.json``). Token counts are the server's ``usage`` (as
    epdserve bench's), not AIPerf's re-tokenization of the streamed text."""
    artifacts = tmp_path / "aiperf"
    run_tool([clients_bin("aiperf"), "profile", "--model", served_model(server)["id"], "--url", server.url,
              "--endpoint-type", "chat", "--streaming", "--tokenizer", tok,
              "--synthetic-input-tokens-mean", LOAD["input"], "--synthetic-input-tokens-stddev", 0,
              "--output-tokens-mean", LOAD["output"], "--output-tokens-stddev", 0,
              "--extra-inputs", "ignore_eos:true", "--use-server-token-count",
              "--request-count", LOAD["requests"], "--concurrency", LOAD["concurrency"],
              "--warmup-request-count", 1, "--random-seed", 0, "--artifact-dir", artifacts,
              "--ui-type", "none", "--no-server-metrics", "--no-gpu-telemetry"],
             tmp_path / "aiperf.log", tmp_path, offline=False)
    return json.loads((artifacts / "profile_export_aiperf.json").read_text())


def test_aiperf_pd_agrees_with_bench(pd_server, model_info, tmp_path):
    """AIPerf's streaming chat run against 1P1D completes with no error, and its TTFT and
    ITL means are within AGREEMENT of epdserve bench's on the same load and server (ours
    first). AIPerf's ITL is per request (E2EL - TTFT) / (output tokens - 1), i.e. vLLM's
    TPOT; with every output LOAD["output"] tokens long it equals bench's pooled ITL mean up
    to the final chunks, which is why both are checked against it."""
    tok = tokenizer_dir(pd_server, model_info)
    ours = epdserve_bench(pd_server, tok, tmp_path)
    theirs = aiperf_profile(pd_server, tok, tmp_path)
    assert ours["completed"] == LOAD["requests"] and ours["failed"] == 0
    assert not theirs.get("error_summary"), theirs["error_summary"]
    assert theirs["request_count"]["avg"] == LOAD["requests"]
    assert theirs.get("error_request_count", {}).get("avg", 0) == 0
    assert theirs["output_sequence_length"]["avg"] == LOAD["output"]
    pairs = {"TTFT": (theirs["time_to_first_token"]["avg"], ours["mean_ttft_ms"]),
             "ITL": (theirs["inter_token_latency"]["avg"], ours["mean_itl_ms"]),
             "ITL vs TPOT": (theirs["inter_token_latency"]["avg"], ours["mean_tpot_ms"])}
    report = ", ".join(f"{k}: AIPerf {a:.1f} ms, epdserve bench {b:.1f} ms" for k, (a, b) in pairs.items())
    for name, (aiperf_ms, bench_ms) in pairs.items():
        assert abs(aiperf_ms - bench_ms) <= AGREEMENT * bench_ms, f"{name} disagrees: {report}"


# --------------------------------------------------------------------------- GuideLLM


@pytest.mark.parametrize("profile", [{"kind": "synchronous"}, {"kind": "constant", "rate": 2.0}],
                         ids=["synchronous", "constant"])
def test_guidellm_colocated(colocated_server, model_info, tmp_path, profile):
    """A short GuideLLM run (6 requests, 64 prompt and 16 output tokens, streaming chat)
    with the given profile finishes every request without error, each with the 16 tokens
    asked for (its report JSON)."""
    tok = tokenizer_dir(colocated_server, model_info)
    report = tmp_path / "benchmarks.json"
    scenario = {"spec": {
        "backend": {"kind": "openai_http", "target": colocated_server.url, "model": served_model(colocated_server)["id"],
                    "request_format": "/v1/chat/completions", "timeout": 300},
        "profile": profile,
        "constraints": [{"kind": "max_requests", "count": 6}],
        "tokenizer": {"kind": "huggingface_auto", "model": str(tok)},
        "data": [{"kind": "synthetic_text", "prompt_tokens": 64, "output_tokens": 16}],
        "seed": {"kind": "static", "value": 0},
        "outputs": [{"kind": "json", "path": str(report)}]}}
    config = tmp_path / "scenario.json"
    config.write_text(json.dumps(scenario))
    run_tool([clients_bin("guidellm"), "run", "--config", config, "--disable-console-interactive"],
             tmp_path / "guidellm.log", tmp_path)
    benchmarks = json.loads(report.read_text())["benchmarks"]
    assert len(benchmarks) == 1
    totals = benchmarks[0]["metrics"]["request_totals"]
    assert totals["errored"] == 0 and totals["incomplete"] == 0, totals
    assert totals["successful"] == 6, totals
    output_tokens = benchmarks[0]["metrics"]["output_token_count"]["successful"]
    assert (output_tokens["min"], output_tokens["max"]) == (16, 16), output_tokens


# --------------------------------------------------------------------------- lm-evaluation-harness


TASK = "epdserve_facts"


def write_task(directory: Path) -> Path:
    """A multiple-choice log-likelihood task over tests/data/clients/mc_facts.jsonl (32
    questions, 4 choices each: 128 requests), as lm-eval reads a custom task: a YAML file
    in an ``--include_path`` directory, the data a local JSON-lines file."""
    directory.mkdir()
    (directory / f"{TASK}.yaml").write_text(
        f"task: {TASK}\n"
        "dataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {DATA / 'mc_facts.jsonl'}\n"
        "test_split: test\n"
        "output_type: multiple_choice\n"
        'doc_to_text: "{{question}}"\n'
        "doc_to_choice: choices\n"
        "doc_to_target: answer\n"
        "metric_list:\n  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n"
        "  - metric: acc_norm\n    aggregation: mean\n    higher_is_better: true\n")
    return directory


def lm_eval(server, model_info, tmp_path: Path, name: str, tokenized: bool) -> tuple[dict, list]:
    """``lm_eval --model local-completions`` on TASK against ``server`` (token-id prompts
    when ``tokenized``, else text); its task results and per-document log-likelihoods
    (``[[loglikelihood, is_greedy], ...]`` per choice, in document order)."""
    out = tmp_path / f"lm-eval-{name}"
    tasks = tmp_path / "tasks" if (tmp_path / "tasks").is_dir() else write_task(tmp_path / "tasks")
    model_args = ",".join([f"model={served_model(server)['id']}", f"base_url={server.url}/v1/completions",
                           f"tokenizer={tokenizer_dir(server, model_info)}", "tokenizer_backend=huggingface",
                           f"tokenized_requests={tokenized}", "num_concurrent=1", "max_retries=1"])
    run_tool([clients_bin("lm_eval"), "run", "--model", "local-completions", "--model_args", model_args,
              "--tasks", TASK, "--include_path", tasks, "--batch_size", 1, "--output_path", out,
              "--log_samples"], tmp_path / f"lm-eval-{name}.log", tmp_path)
    (results,) = out.rglob("results_*.json")
    (samples,) = out.rglob(f"samples_{TASK}_*.jsonl")
    docs = sorted((json.loads(line) for line in samples.read_text().splitlines()), key=lambda d: d["doc_id"])
    return json.loads(results.read_text())["results"][TASK], [d["filtered_resps"] for d in docs]


def test_lm_eval_loglikelihood_same_in_colocated_and_pd(colocated_server, pd_server, model_info, tmp_path):
    """lm-eval's log-likelihood task gives the same accuracy in colocated and PD, with
    token-id prompts and (colocated) with text prompts, and every choice's
    log-likelihood agrees within 1e-3 (the same prefill computes prompt logprobs in both)."""
    colocated, colocated_ll = lm_eval(colocated_server, model_info, tmp_path, "colocated", True)
    pd, pd_ll = lm_eval(pd_server, model_info, tmp_path, "pd", True)
    text, text_ll = lm_eval(colocated_server, model_info, tmp_path, "colocated-text", False)
    assert len(colocated_ll) == 32 and all(len(doc) == 4 for doc in colocated_ll)
    for other in (pd, text):
        assert other["acc,none"] == colocated["acc,none"], (colocated, other)
        assert other["acc_norm,none"] == colocated["acc_norm,none"], (colocated, other)
    for other_ll in (pd_ll, text_ll):
        for doc, other_doc in zip(colocated_ll, other_ll, strict=True):
            for (ll, greedy), (other, other_greedy) in zip(doc, other_doc, strict=True):
                assert abs(float(ll) - float(other)) <= 1e-3 and greedy == other_greedy, (doc, other_doc)
