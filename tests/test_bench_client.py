"""The bench client and ``epdserve bench`` against a stub OpenAI-compatible server.

The stub (this file run as a script, in its own process, on a free 127.0.0.1 port) streams
fixed chunks with known sleeps, so TTFT/ITL/E2EL are known to within scheduling noise:

* a role chunk with empty content at once (must not count as the first token);
* ``STUB_TTFT_S`` later the text "Hello", then every ``STUB_ITL_S`` " big" and " world";
* a finish chunk, a usage chunk (prompt_tokens 42, completion_tokens 4: " big" stands for
  two tokens) and ``[DONE]``.

With ``--trace-file`` it writes a router-like trace line per request (a
``RequestTrace``: queue 1 ms; in ``--mode pd``/``epd`` the prefill worker's, and a 2.5 ms
KV hand-off of 4,096 bytes); a chat request with images adds the image stages (encode 0.5 +
3 ms; in ``--mode epd`` 1000 embedding bytes and 0.25 ms of transfer per image).

A prompt containing FAIL400 gets HTTP 400; one containing FAILSTREAM gets one text chunk
and then an error event; one containing RESET gets one text chunk and then the connection
dropped. A prompt containing QUEUE waits for a single "prefill" slot, held for
``STUB_TTFT_S`` (a server of capacity 1/STUB_TTFT_S req/s, whose TTFT grows with load).
``GET /log`` lists what arrived (``time.monotonic()`` and body); ``GET /inflight`` the
most requests that were in flight at once since ``POST /reset``.
"""

import argparse
import json
import os
import signal
import subprocess
import sys
import time

import httpx
import numpy as np
import pytest

from epdserve.bench import client, datasets, workload
from epdserve.argtypes import config_from
from epdserve.bench.run import BenchOptions, ClientOptions, add_arguments, bench
from epdserve.trace import RequestTrace

from conftest import cli_exit

STUB_TTFT_S = 0.20
STUB_ITL_S = 0.10
STUB_PROMPT_TOKENS = 42
STUB_COMPLETION_TOKENS = 4
# Send-time tolerance of the replay test. Typical errors measured on the shared 2-core
# machine are 1-5 ms, with outliers near 9 ms on the server side, so 5 ms would flake.
TOLERANCE_S = 0.020


# ---------------------------------------------------------------------------------------
# The stub server


def stub_app(mode: str = "colocated", trace_file: str | None = None):
    import asyncio

    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, StreamingResponse

    app = FastAPI()
    log: list[dict] = []
    counter = iter(range(1, 10**9))
    inflight = {"now": 0, "max": 0}
    prefill_slot = asyncio.Lock()

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "stub-model", "object": "model"}]}

    @app.get("/log")
    async def get_log():
        return log

    @app.get("/inflight")
    async def get_inflight():
        return inflight

    @app.post("/reset")
    async def reset():
        log.clear()
        inflight["max"] = inflight["now"]
        return {}

    async def completion(request: Request, chat: bool):
        t = time.monotonic()
        body = await request.json()
        log.append({"t": t, "body": body})
        prompt = body["messages"][-1]["content"] if chat else body["prompt"]
        rid = f"req-{next(counter)}"
        if body["model"] != "stub-model":
            return JSONResponse({"error": {"message": f"model {body['model']!r} does not exist",
                                           "code": 404}}, status_code=404)
        if "FAIL400" in prompt:
            return JSONResponse({"error": {"message": "stub rejects FAIL400", "code": 400}},
                                status_code=400)

        def chunk(text=None, finish=None, usage=None, role=False):
            if chat:
                delta = {"role": "assistant", "content": ""} if role else (
                    {"content": text} if text is not None else {})
                choices = [{"index": 0, "delta": delta, "finish_reason": finish}]
            else:
                choices = [{"index": 0, "text": text or "", "finish_reason": finish}]
            obj = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
                   "model": body["model"], "choices": [] if usage else choices}
            if usage:
                obj["usage"] = usage
            return f"data: {json.dumps(obj)}\n\n"

        async def stream():
            inflight["now"] += 1
            inflight["max"] = max(inflight["max"], inflight["now"])
            try:
                async for part in stream_parts():
                    yield part
            finally:
                inflight["now"] -= 1

        async def stream_parts():
            if chat:
                yield chunk(role=True)
            if "QUEUE" in prompt:
                async with prefill_slot:
                    await asyncio.sleep(STUB_TTFT_S)
            else:
                await asyncio.sleep(STUB_TTFT_S)
            yield chunk("Hello")
            if "RESET" in prompt:
                raise RuntimeError("stub drops the connection")
            if "FAILSTREAM" in prompt:
                yield 'data: {"error": {"message": "stub engine died", "code": 500}}\n\n'
                yield "data: [DONE]\n\n"
                return
            for text in (" big", " world"):
                await asyncio.sleep(STUB_ITL_S)
                yield chunk(text)
            yield chunk(finish="length")
            yield chunk(usage={"prompt_tokens": STUB_PROMPT_TOKENS,
                               "completion_tokens": STUB_COMPLETION_TOKENS,
                               "total_tokens": STUB_PROMPT_TOKENS + STUB_COMPLETION_TOKENS})
            yield "data: [DONE]\n\n"
            if trace_file:  # the router's per-request trace line
                pd = mode != "colocated"
                t = RequestTrace(request_id=rid, mode=mode, path="disaggregated" if pd else "colocated",
                                 prompt_tokens=STUB_PROMPT_TOKENS, output_tokens=STUB_COMPLETION_TOKENS,
                                 prefill_ms=1000 * STUB_TTFT_S, decode_ms=2000 * STUB_ITL_S,
                                 e2e_ms=1000 * (STUB_TTFT_S + 2 * STUB_ITL_S))
                if pd:  # a KV hand-off of 2.5 ms: export 0.5 + fetch 1 + import 1
                    t.prefill_queue_ms, t.kv_bytes = 1.0, 4096
                    t.kv_export_ms, t.kv_fetch_ms, t.kv_import_ms = 0.5, 1.0, 1.0
                else:
                    t.colocated_queue_ms = 1.0
                images = sum(1 for part in prompt if isinstance(part, dict)
                             and part.get("type") == "image_url") if chat else 0
                if images:  # the router's image stages (embeddings cross only in EPD)
                    t.num_images, t.encode_queue_ms, t.encode_ms = images, 0.5, 3.0
                    if mode == "epd":
                        t.embedding_bytes, t.embedding_export_ms = 1000 * images, 0.25 * images
                line = t.as_json()
                with open(trace_file, "a") as f:
                    f.write(json.dumps(line) + "\n")

        return StreamingResponse(stream(), media_type="text/event-stream")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await completion(request, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await completion(request, chat=False)

    return app


def serve_stub() -> None:
    """Take ``epdserve serve``'s options (--mode, --host, --port, --trace-file; worker
    counts and --model accepted and ignored); bind the port (0: a free one, printed
    first), serve until SIGTERM."""
    import socket

    import uvicorn

    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", default="colocated")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--trace-file", default=None)
    for ignored in ("--model", "--encode-workers", "--prefill-workers", "--decode-workers"):
        parser.add_argument(ignored)
    args = parser.parse_args()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((args.host, args.port))
    sock.listen(128)
    print(sock.getsockname()[1], flush=True)
    app = stub_app(args.mode, args.trace_file)
    uvicorn.Server(uvicorn.Config(app, log_level="warning")).run(sockets=[sock])


class Stub:
    """The stub server as a subprocess in its own process group."""

    def __init__(self):
        self.proc = subprocess.Popen([sys.executable, __file__], stdout=subprocess.PIPE,
                                     text=True, start_new_session=True)
        self.port = int(self.proc.stdout.readline())
        self.url = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + 20
        while True:
            try:
                if httpx.get(self.url + "/health", trust_env=False).status_code == 200:
                    break
            except httpx.HTTPError:
                if time.monotonic() > deadline:
                    self.stop()
                    raise
            time.sleep(0.05)

    def log(self) -> list[dict]:
        return httpx.get(self.url + "/log", trust_env=False).json()

    def reset(self) -> None:
        httpx.post(self.url + "/reset", trust_env=False)

    def max_inflight(self) -> int:
        return httpx.get(self.url + "/inflight", trust_env=False).json()["max"]

    def stop(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()


@pytest.fixture(scope="module")
def stub():
    server = Stub()
    try:
        yield server
    finally:
        server.stop()


# ---------------------------------------------------------------------------------------
# Helpers


def bench_args(*extra: str) -> ClientOptions:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--base-url", "http://unused", "--disable-tqdm", *extra])
    return config_from(BenchOptions, args).client


def req(offset: float, prompt: str, max_tokens: int = 4, kind: str = "chat") -> workload.Request:
    return workload.Request(offset_s=offset, prompt=prompt, max_tokens=max_tokens, kind=kind,
                            prompt_tokens=len(prompt.split()))


def run_cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "epdserve", "bench", *args],
                          capture_output=True, text=True, timeout=timeout)


# ---------------------------------------------------------------------------------------
# Tests


@pytest.mark.parametrize("endpoint", ["chat", "completions", "/v1/chat/completions", "/v1/completions"])
def test_latencies_follow_the_stubs_sleeps(stub, endpoint):
    """Either endpoint, named ours or vLLM's way (the request path)."""
    trace = [req(0.0, "one two three"), req(0.05, "four five six"), req(0.1, "seven eight")]
    result = bench(stub.url, trace, bench_args("--endpoint", endpoint, "--ignore-eos"))
    assert result["completed"] == 3 and result["failed"] == 0
    assert result["model_id"] == "stub-model"
    # TTFT: the empty role chunk does not count; the first text comes after STUB_TTFT_S.
    for ttft in result["ttfts"]:
        assert STUB_TTFT_S - 0.005 <= ttft <= STUB_TTFT_S + 0.15
    for gaps in result["itls"]:
        assert len(gaps) == 2  # three text chunks, one of them carrying two tokens
        for g in gaps:
            assert STUB_ITL_S - 0.02 <= g <= STUB_ITL_S + 0.15
    for e2el in result["e2els"]:
        assert STUB_TTFT_S + 2 * STUB_ITL_S - 0.01 <= e2el <= STUB_TTFT_S + 2 * STUB_ITL_S + 0.3
    # Token counts come from usage, not from the chunk count.
    assert result["output_lens"] == [STUB_COMPLETION_TOKENS] * 3
    assert result["input_lens"] == [STUB_PROMPT_TOKENS] * 3
    assert result["total_output_tokens"] == 3 * STUB_COMPLETION_TOKENS
    # TPOT = (E2EL - TTFT) / (4 - 1) ~ 2 * ITL / 3.
    assert 2 * STUB_ITL_S / 3 - 0.01 <= result["median_tpot_ms"] / 1000 <= 2 * STUB_ITL_S / 3 + 0.1
    assert result["generated_texts"] == ["Hello big world"] * 3
    assert result["request_ids"][0].startswith("req-")
    assert len(set(result["request_ids"])) == 3
    # Bodies as the contract asks.
    bodies = [x["body"] for x in stub.log()[-3:]]
    for body in bodies:
        assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
        assert body["ignore_eos"] is True and body["temperature"] == 0
        assert body["max_tokens"] == 4 and body["model"] == "stub-model"
        assert ("messages" in body) == (endpoint in ("chat", "/v1/chat/completions"))


def test_http_400_and_error_events_are_failures_with_messages(stub):
    trace = [req(0.0, "fine"), req(0.0, "please FAIL400"), req(0.0, "please FAILSTREAM")]
    result = bench(stub.url, trace, bench_args("--goodput", "ttft:10000"))
    assert result["completed"] == 1 and result["failed"] == 2
    assert result["errors"][0] == ""
    assert result["errors"][1].startswith("HTTP 400") and "FAIL400" in result["errors"][1]
    assert "stub engine died" in result["errors"][2]
    assert result["output_lens"] == [STUB_COMPLETION_TOKENS, 0, 0]
    # Only the completed request counts, in throughput and goodput.
    assert result["request_goodput"] == pytest.approx(1 / result["duration"])
    assert result["request_throughput"] == pytest.approx(1 / result["duration"])


def test_replayed_trace_sends_identical_requests_at_the_same_offsets(stub, tmp_path):
    tok = workload.load_tokenizer_for(None)
    trace = datasets.synthetic(tok, num_prompts=8, input_len=(5, 40), output_len=(2, 6),
                               request_rate=8.0, seed=3)
    path = tmp_path / "trace.jsonl"
    workload.save_trace(trace, path)
    runs, sends = [], []
    for _ in range(2):
        stub.reset()
        replay = workload.load_trace(path)
        assert replay == trace
        result = bench(stub.url, replay, bench_args())
        # The client's own t0s are on schedule ...
        late = [a - r.offset_s for a, r in zip(result["start_offsets"], replay)]
        assert all(-0.001 <= x < TOLERANCE_S for x in late), late
        sends.append(result["start_offsets"])
        log = sorted(stub.log(), key=lambda x: x["t"])
        assert log[0]["body"]["messages"][0]["content"] == client.WARMUP_PROMPT
        runs.append(log[1:])  # the warm-up request is not part of the trace
    # The replay's bound: the two replays send each request at the same offset, apart by no
    # more than one run's lateness bound (a busy CI machine delays a send by several ms) ...
    assert max(abs(a - b) for a, b in zip(*sends)) < TOLERANCE_S, sends
    # ... and the server sees the same bodies at the same offsets, run after run.
    first, second = runs
    assert [x["body"] for x in first] == [x["body"] for x in second]
    expected = sorted(r.offset_s for r in trace)
    for log in runs:
        seen = [x["t"] - log[0]["t"] for x in log]
        for got, want in zip(seen, expected):
            assert abs(got - want) < TOLERANCE_S, (seen, expected)
    # The two runs started at different times; align them on the median difference (the
    # first request alone is a noisy anchor: its arrival varies by several ms under load).
    diffs = [a["t"] - b["t"] for a, b in zip(first, second)]
    drift = [abs(d - float(np.median(diffs))) for d in diffs]
    # Arrivals at the server add its and the network's jitter to the client's 5 ms: each run
    # is within TOLERANCE_S of the schedule, so two runs differ by at most twice that.
    assert max(drift) < 2 * TOLERANCE_S, drift


def test_cli_writes_result_json(stub, tmp_path):
    trace = [req(0.0, "alpha beta"), req(0.1, "gamma FAIL400")]
    trace_file, out = tmp_path / "t.jsonl", tmp_path / "out" / "result.json"
    workload.save_trace(trace, trace_file)
    proc = run_cli("--base-url", stub.url, "--trace", str(trace_file), "--disable-tqdm",
                   "--goodput", "ttft:5000", "tpot:1000", "--result-file", str(out),
                   "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "90,95,99")
    assert proc.returncode == 0, proc.stderr
    result = json.loads(out.read_text())
    assert result["completed"] == 1 and result["failed"] == 1
    for key in ("duration", "request_throughput", "output_throughput", "total_token_throughput",
                "request_goodput", "mean_ttft_ms", "median_itl_ms", "p99_e2el_ms", "std_tpot_ms",
                "p90_ttft_ms", "p95_itl_ms", "ttfts", "itls", "e2els", "input_lens",
                "output_lens", "errors", "request_ids", "start_offsets",
                # vLLM's run settings and peaks, for tools written for its results
                "request_rate", "burstiness", "max_concurrency", "endpoint_type",
                "generated_texts", "start_times", "max_output_tokens_per_s",
                "max_concurrent_requests", "slo_attainment", "error_counts"):
        assert key in result, key
    assert result["request_rate"] == pytest.approx(10.0)  # the trace's: 2 requests 0.1 s apart
    assert result["burstiness"] == 1.0 and result["max_concurrency"] is None
    assert "Failed requests" in proc.stdout and "HTTP 400" in proc.stdout


@pytest.mark.parametrize("args, needle", [
    (["--input-len", "5:2"], "5:2"),
    (["--output-len", "x:3"], "x:3"),
    (["--request-rate", "-1"], "-1"),
    (["--goodput", "ttfx:5"], "ttfx:5"),
    (["--trace", "/nonexistent/trace.jsonl"], "/nonexistent/trace.jsonl"),
    (["--workload", "sharegpt", "--dataset-path", "/nonexistent/sg.json"], "/nonexistent/sg.json"),
    (["--workload", "sharegpt"], "--dataset-path"),
    (["--burstiness", "0"], "'0'"),
    (["--ramp-up-start-rps", "1"], "--ramp-up-end-rps"),
    (["--request-rate", "2", "--ramp-up-start-rps", "1", "--ramp-up-end-rps", "3"], "exclude"),
    (["--image-size", "12by4"], "12by4"),
    (["--image-repeat-share", "1.5"], "1.5"),
    (["--sweep-rates", "3:1"], "3:1"),
    (["--goodput-target", "1.5"], "1.5"),
    (["--temperature", "-0.5"], "--temperature: '-0.5'"),
    (["--request-timeout", "0"], "--request-timeout: '0'"),
])
def test_cli_bad_values_exit_2_with_one_message(capsys, args, needle):
    """The command's own entry point, in-process (one run as a process below): exit status 2
    naming the bad value, nothing sent."""
    code, err = cli_exit(capsys, ["bench", "--base-url", "http://127.0.0.1:9", *args])
    assert code == 2 and needle in err, err


def test_cli_bad_value_as_a_process_exits_2_without_a_traceback():
    proc = run_cli("--base-url", "http://127.0.0.1:9", "--input-len", "5:2")
    assert proc.returncode == 2
    assert "5:2" in proc.stderr and "Traceback" not in proc.stderr


def test_cli_malformed_trace_line_names_the_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    good = json.dumps({"offset_s": 0, "prompt": "hi", "max_tokens": 2, "kind": "chat",
                       "prompt_tokens": 1})
    path.write_text(good + "\n{not json\n")
    proc = run_cli("--base-url", "http://127.0.0.1:9", "--trace", str(path))
    assert proc.returncode == 2
    assert f"{path}:2" in proc.stderr and "Traceback" not in proc.stderr


def test_cli_failed_warmup_stops_before_the_run(stub, tmp_path):
    path = tmp_path / "t.jsonl"
    workload.save_trace([req(0.0, "hi")], path)
    stub.reset()
    proc = run_cli("--base-url", stub.url, "--model", "nope", "--trace", str(path))
    assert proc.returncode == 1
    assert "'nope' does not exist" in proc.stderr and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    assert len(stub.log()) == 1  # only the warm-up was sent


def test_cli_unreachable_server_is_one_line(tmp_path):
    path = tmp_path / "t.jsonl"
    workload.save_trace([req(0.0, "hi")], path)
    proc = run_cli("--base-url", "http://127.0.0.1:9", "--trace", str(path), "--disable-tqdm")
    assert proc.returncode == 2
    assert "http://127.0.0.1:9" in proc.stderr and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_failures_are_counted_by_kind_and_kept_out_of_latencies(stub):
    trace = [req(0.0, "fine"), req(0.0, "FAIL400 a"), req(0.0, "FAIL400 b"),
             req(0.0, "please RESET"), req(0.0, "FAILSTREAM")]
    result = bench(stub.url, trace, bench_args())
    assert result["completed"] == 1 and result["failed"] == 4
    assert result["error_counts"] == {"HTTP 400": 2, "connection reset": 1, "error event": 1}
    # Percentiles are over the one completed request only.
    assert result["p99_ttft_ms"] == result["mean_ttft_ms"] == pytest.approx(
        1000 * result["ttfts"][0])
    from epdserve.bench.run import summary_lines
    line = next(x for x in summary_lines(result) if x.startswith("Failed requests"))
    assert line.endswith("4 (HTTP 400 x2, connection reset x1, error event x1)")


def test_max_concurrency_caps_requests_in_flight(stub):
    stub.reset()
    trace = [req(0.0, f"closed loop {i}") for i in range(7)]
    result = bench(stub.url, trace, bench_args("--max-concurrency", "3", "--warmup", "0"))
    assert result["completed"] == 7 and result["max_concurrency"] == 3
    assert stub.max_inflight() == 3
    # A closed loop: request 3 is sent only when one of the first three has finished.
    first_wave_end = min(sorted(result["e2els"])[:3])
    assert sorted(result["start_offsets"])[3] >= first_wave_end - 0.005


def test_warmup_requests_are_sent_but_not_measured(stub):
    stub.reset()
    trace = [req(0.01 * i, f"prompt {i}") for i in range(4)]
    result = bench(stub.url, trace, bench_args("--warmup-requests", "2", "--warmup", "0"))
    assert len(stub.log()) == 4
    assert result["num_prompts"] == 2 == result["completed"] == len(result["ttfts"])
    assert result["start_offsets"][0] >= 0.02 - 0.001
    with pytest.raises(workload.TraceError, match="--warmup-requests 4"):
        bench(stub.url, trace, bench_args("--warmup-requests", "4"))


def decode_data_url(url: str):
    """(media type, bytes, decoded Pillow image) of a base64 data URL."""
    import base64
    import io

    from PIL import Image

    head, data = url.split(",", 1)
    assert head.startswith("data:") and head.endswith(";base64")
    raw = base64.b64decode(data, validate=True)
    return head[5:-7], raw, Image.open(io.BytesIO(raw))


def image_req(prompt: str, *seeds: int, size=(64, 48)) -> workload.Request:
    return workload.Request(0.0, prompt, 4, "chat", 1, images=tuple(
        {"width": size[0], "height": size[1], "seed": s} for s in seeds))


def test_request_body_sends_images_as_openai_image_url_parts():
    body = client.request_body(image_req("what is this", 3, 4, size=(64, 48)), "m")
    (message,) = body["messages"]
    text, *parts = message["content"]
    assert message["role"] == "user" and text == {"type": "text", "text": "what is this"}
    assert [p["type"] for p in parts] == ["image_url", "image_url"]
    decoded = [decode_data_url(p["image_url"]["url"]) for p in parts]
    for media, raw, image in decoded:
        assert media == "image/jpeg" and image.format == "JPEG"
        assert image.size == (64, 48) and image.mode == "RGB"
    assert decoded[0][1] != decoded[1][1]  # different seeds, different pictures
    # The same request gives the same bytes every time (a fair compare), also when the
    # cache is cold (another run), and a text-only request keeps plain string content.
    again = client.request_body(image_req("other text", 3, size=(64, 48)), "m")
    from epdserve.bench import images

    images.image_bytes.cache_clear()
    cold = client.request_body(image_req("x", 3, size=(64, 48)), "m")
    assert (again["messages"][0]["content"][1] == cold["messages"][0]["content"][1]
            == parts[0])
    big = decode_data_url(client.request_body(image_req("x", 3, size=(640, 480)), "m")
                          ["messages"][0]["content"][1]["image_url"]["url"])
    assert big[2].size == (640, 480)
    assert client.request_body(req(0.0, "plain"), "m")["messages"][0]["content"] == "plain"
    with pytest.raises(client.UnsupportedWorkload, match="only the chat endpoint"):
        client.request_body(image_req("x", 1), "m", endpoint="completions")


def test_images_reach_the_server_and_the_warmup_warms_the_encoder(stub):
    stub.reset()
    trace = [image_req("look", 0), image_req("look again", 0), image_req("and this", 7)]
    result = bench(stub.url, trace, bench_args())
    assert result["completed"] == 3
    bodies = [entry["body"]["messages"][0]["content"] for entry in stub.log()]
    assert len(bodies) == 4  # the warm-up first, then the trace (sent at once: any order)
    by_text = {text["text"]: decode_data_url(image["image_url"]["url"])
               for text, image in bodies}
    warm, look, again, other = (by_text[t] for t in (client.WARMUP_PROMPT, "look",
                                                     "look again", "and this"))
    assert bodies[0][0]["text"] == client.WARMUP_PROMPT
    assert warm[2].size == (64, 48)  # the trace's size ...
    assert warm[1] not in (look[1], other[1])  # ... but never one of its pictures
    assert look[1] == again[1] != other[1]  # a repeated seed is a repeated image


def test_images_on_the_completions_endpoint_are_refused_before_anything_is_sent(stub, tmp_path):
    stub.reset()
    trace = [image_req("look", 0)]
    with pytest.raises(client.UnsupportedWorkload, match="1 of 1 requests carry images"):
        bench(stub.url, trace, bench_args("--endpoint", "completions"))
    assert stub.log() == []
    path = tmp_path / "img.jsonl"
    workload.save_trace(trace, path)
    proc = run_cli("--base-url", stub.url, "--trace", str(path), "--endpoint", "completions")
    assert proc.returncode == 2 and "only the chat endpoint" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_cli_sweep_finds_the_rate_the_stub_sustains(stub, tmp_path):
    # QUEUE requests hold one slot for 0.2 s each: evenly spaced arrivals meet a 300 ms
    # TTFT SLO up to 5 req/s and queue up beyond. Rates tried: 2, 10, 6, 4.
    trace = [req(0.1 * i, f"QUEUE {i}") for i in range(10)]
    trace_file, out = tmp_path / "t.jsonl", tmp_path / "sweep" / "sweep.json"
    workload.save_trace(trace, trace_file)
    proc = run_cli("--base-url", stub.url, "--trace", str(trace_file), "--sweep",
                   "--goodput", "ttft:300", "--sweep-rates", "2:10", "--sweep-iters", "2",
                   "--disable-tqdm", "--result-file", str(out))
    assert proc.returncode == 0, proc.stderr
    result = json.loads(out.read_text())
    assert [p["rate"] for p in result["points"]] == [2.0, 4.0, 6.0, 10.0]
    assert result["max_rate"] == 4.0 and result["bracket"] == [4.0, 6.0]
    att = {p["rate"]: p["slo_attainment"] for p in result["points"]}
    assert att[2.0] == att[4.0] == 1.0 and att[6.0] < 0.9 and att[10.0] < att[6.0]
    assert all(p["request_rate"] == p["rate"] for p in result["points"])
    assert (out.parent / "goodput_vs_rate.png").stat().st_size > 5000
    assert "Max rate with >= 90% of requests within SLOs: 4.000 req/s" in proc.stdout


def test_cli_sweep_needs_slos_and_a_result_file():
    proc = run_cli("--base-url", "http://127.0.0.1:9", "--sweep")
    assert proc.returncode == 2 and "--goodput" in proc.stderr


if __name__ == "__main__":
    serve_stub()
