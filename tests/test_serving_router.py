"""The router against fake workers that speak the real protocol over real ZeroMQ sockets
(no engine): PD handoff, cleanup on every outcome (Abort / ReleaseKV), errors, timeouts,
health, metrics and traces. Runs in seconds and needs no model weights beyond the
tokenizer."""

from __future__ import annotations

import json
import threading
import time

import httpx
import openai
import pytest
import uvicorn
import zmq

from epdserve.serving import protocol as P
from epdserve.serving.router import Router, create_app

ERROR_TOKEN = 7  # a prompt containing this id is rejected by the fake workers


class FakeWorker(threading.Thread):
    """A worker thread: tokens are a fixed text cycled from an offset given by the
    prompt, one per ``step_s``; 2 blocks per request; a prefill worker's exported KV lives
    in ``kv_store`` (shared, like /dev/shm) until a decode worker imports it or ReleaseKV."""

    def __init__(self, events: str, cmd: str, role: str, worker_id: str, text_ids: list[int],
                 kv_store: dict, step_s: float = 0.01, model: str = "SmolLM2-135M-Instruct"):
        super().__init__(daemon=True)
        self.events, self.cmd, self.role, self.worker_id = events, cmd, role, worker_id
        self.text_ids, self.kv_store, self.step_s, self.model = text_ids, kv_store, step_s, model
        self.active: dict[str, dict] = {}
        self.received: list[tuple[str, str | None]] = []
        self.blocks_total = 100
        self.stop_event = threading.Event()
        self.silent = False  # stop sending anything (a hung worker)

    def blocks_in_use(self) -> int:
        return 2 * len(self.active)

    def token(self, req: dict, i: int) -> int:
        return self.text_ids[(sum(req["prompt"]) + i) % len(self.text_ids)]

    def run(self) -> None:
        ctx = zmq.Context()
        pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
        pull.bind(self.cmd)
        push.connect(self.events)
        send = lambda m: None if self.silent else push.send(P.encode(m))  # noqa: E731
        send(P.Hello(worker_id=self.worker_id, role=self.role, addr=self.cmd, model=self.model,
                     kv_layout={}, blocks_total=self.blocks_total))
        last_stats = 0.0
        try:
            while not self.stop_event.is_set():
                changed = False
                while pull.poll(0):
                    msg = P.decode(pull.recv())
                    self.received.append((msg.type, getattr(msg, "request_id", None)))
                    changed |= self.handle(msg, send)
                time.sleep(self.step_s)
                for rid, req in list(self.active.items()):
                    changed = True
                    self.step(rid, req, send)
                now = time.monotonic()
                if changed or now - last_stats > 0.2:
                    last_stats = now
                    send(P.Stats(worker_id=self.worker_id, blocks_total=self.blocks_total,
                                 blocks_in_use=self.blocks_in_use(), num_running=len(self.active),
                                 num_waiting=0, num_preemptions=0))
        finally:
            pull.close(0)
            push.close(0)
            ctx.term()

    def handle(self, msg, send) -> bool:
        if isinstance(msg, P.AddRequest):
            if ERROR_TOKEN in msg.prompt_token_ids:
                send(P.Error(worker_id=self.worker_id, request_id=msg.request_id, message="fake rejection"))
                return False
            req = {"prompt": msg.prompt_token_ids, "max": msg.sampling.max_tokens, "n": 0}
            if self.role == "decode":
                if self.kv_store.pop(msg.kv.name, None) is None:
                    send(P.Error(worker_id=self.worker_id, request_id=msg.request_id, message="no such KV"))
                    return False
                req["n"] = 1  # the first token came from the prefill worker
            self.active[msg.request_id] = req
            return True
        if isinstance(msg, P.Abort):
            return self.active.pop(msg.request_id, None) is not None
        if isinstance(msg, P.ReleaseKV):
            self.kv_store.pop(f"kv-{msg.request_id}", None)
        return False

    def step(self, rid: str, req: dict, send) -> None:
        tok = self.token(req, req["n"])
        req["n"] += 1
        done = req["n"] >= req["max"]
        if self.role == "prefill":
            del self.active[rid]
            kv = None
            if not done:
                kv = P.KVDescriptor(name=f"kv-{rid}", num_tokens=len(req["prompt"]), nbytes=4096)
                self.kv_store[kv.name] = True
            send(P.Output(worker_id=self.worker_id, request_id=rid, token_ids=[tok], finished=done,
                          finish_reason="length" if done else None, kv=kv,
                          timings={"queue_ms": 1.0, "prefill_ms": 2.0, "kv_export_ms": 0.5, "kv_bytes": 4096}))
            return
        if done:
            del self.active[rid]
        timings = {}
        if done:
            timings = ({"queue_ms": 1.0, "kv_import_ms": 0.25, "decode_ms": 3.0} if self.role == "decode"
                       else {"queue_ms": 1.0, "prefill_ms": 2.0, "decode_ms": 3.0})
        send(P.Output(worker_id=self.worker_id, request_id=rid, token_ids=[tok], finished=done,
                      finish_reason="length" if done else None, timings=timings))


class RouterHarness:
    """A router served by uvicorn in a thread, plus its fake workers."""

    def __init__(self, mode: str, model_info, tokenizer, tmp_path, step_s: float = 0.01, **router_kw):
        self.tmp = tmp_path
        self.events = f"ipc://{tmp_path}/events"
        self.trace = tmp_path / "trace.jsonl"
        self.router = Router(mode, model_info, tokenizer, self.events, trace_file=str(self.trace), **router_kw)
        self.server = uvicorn.Server(uvicorn.Config(create_app(self.router), host="127.0.0.1", port=0,
                                                    log_level="warning", lifespan="on"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.kv_store: dict = {}
        self.workers: list[FakeWorker] = []
        self.text_ids = tokenizer("The quick brown fox jumps over the lazy dog. Über naïve 🎉 日本. ").input_ids
        self.step_s = step_s
        self.url = ""

    def start(self, roles: list[str]) -> "RouterHarness":
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.02)
        self.url = f"http://127.0.0.1:{self.server.servers[0].sockets[0].getsockname()[1]}"
        for i, role in enumerate(roles):
            self.add_worker(role, f"{role}-{roles[:i].count(role)}")
        while len(self.router.workers) < len(roles):  # every hello arrived
            assert time.monotonic() < deadline, "fake workers did not say hello"
            time.sleep(0.02)
        return self

    def add_worker(self, role: str, wid: str) -> FakeWorker:
        w = FakeWorker(self.events, f"ipc://{self.tmp}/{wid}", role, wid, self.text_ids, self.kv_store,
                       self.step_s, model=self.router.model.name)
        w.start()
        self.workers.append(w)
        return w

    def wait_healthy(self, timeout: float = 10) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            r = httpx.get(self.url + "/health")
            if r.status_code == 200 or time.monotonic() > deadline:
                return r
            time.sleep(0.05)

    def stop(self) -> None:
        for w in self.workers:
            w.stop_event.set()
        self.server.should_exit = True
        self.thread.join(15)
        for w in self.workers:
            w.join(5)

    def expected_text(self, tokenizer, prompt_ids: list[int], n: int) -> str:
        return tokenizer.decode([self.text_ids[(sum(prompt_ids) + i) % len(self.text_ids)] for i in range(n)],
                                skip_special_tokens=True)

    def wait_idle(self, timeout: float = 5) -> None:
        """Until no worker holds a request, no KV is exported and the router tracks nothing."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if (not self.kv_store and not self.router.requests
                    and all(not w.active for w in self.workers)
                    and all(not s.outstanding and s.blocks_in_use == 0 for s in self.router.workers.values())):
                return
            time.sleep(0.05)
        raise AssertionError(f"not idle: kv={self.kv_store} requests={list(self.router.requests)} "
                             f"active={[list(w.active) for w in self.workers]}")


@pytest.fixture
def harness(request, model_info, tokenizer, tmp_path):
    made = []

    def make(mode: str, roles: list[str], **kw) -> RouterHarness:
        h = RouterHarness(mode, model_info, tokenizer, tmp_path, **kw)
        made.append(h)
        h.start(roles)
        assert h.wait_healthy().status_code == 200
        return h

    try:
        yield make
    finally:
        for h in made:
            h.stop()


def _completion_prompt(tokenizer, text="Once upon a time"):
    return tokenizer(text).input_ids


@pytest.mark.parametrize("mode,roles", [("pd", ["prefill", "decode"]), ("colocated", ["colocated"])])
def test_stream_and_nonstream_match_fake_tokens(harness, tokenizer, model_info, mode, roles):
    h = harness(mode, roles)
    client = openai.OpenAI(base_url=h.url + "/v1", api_key="x", max_retries=0)
    prompt = "Once upon a time"
    ids = tokenizer(prompt).input_ids
    want = h.expected_text(tokenizer, ids, 12)
    chunks = list(client.completions.create(model=model_info.name, prompt=prompt, max_tokens=12, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want
    assert chunks[-1].usage.completion_tokens == 12 and chunks[-1].usage.prompt_tokens == len(ids)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert len({c.id for c in chunks}) == 1 and chunks[0].id.startswith("cmpl-")
    full = client.completions.create(model=model_info.name, prompt=ids, max_tokens=12)
    assert full.choices[0].text == want and full.object == "text_completion"
    assert full.usage.total_tokens == len(ids) + 12
    h.wait_idle()
    trace = [json.loads(line) for line in h.trace.read_text().splitlines()]
    assert [t["request_id"] for t in trace] == [chunks[0].id, full.id]
    for t in trace:
        assert t["mode"] == mode and t["output_tokens"] == 12 and t["finish_reason"] == "length"
        assert t["ttft_ms"] > 0 and t["e2e_ms"] >= t["ttft_ms"] and t["router_queue_ms"] >= 0
        if mode == "pd":
            assert t["kv_bytes"] == 4096 and t["prefill_queue_ms"] == 1.0 and t["decode_queue_ms"] == 1.0
            assert t["queue_ms"] == 2.0 and t["kv_transfer_ms"] >= 0.75
            assert t["prefill_worker"] == "prefill-0" and t["decode_worker"] == "decode-0"
        else:
            assert t["queue_ms"] == 1.0 and t["decode_ms"] == 3.0
    metrics = httpx.get(h.url + "/metrics").text
    assert 'epdserve:request_success_total{finish_reason="length"} 2.0' in metrics
    assert "epdserve:generation_tokens_total 24.0" in metrics
    if mode == "pd":
        assert "epdserve:kv_transfer_bytes_count 2.0" in metrics


def test_pd_chat_stream_via_openai(harness, tokenizer, model_info):
    from epdserve.model.tokenizer import chat_prompt_ids

    h = harness("pd", ["prefill", "decode"])
    client = openai.OpenAI(base_url=h.url + "/v1", api_key="x", max_retries=0)
    messages = [{"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]}]
    stream = client.chat.completions.create(model=model_info.name, messages=messages, max_tokens=5, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    ids = chat_prompt_ids(tokenizer, [{"role": "user", "content": "Hi\nthere"}])
    assert text == h.expected_text(tokenizer, ids, 5)
    assert chunks[-1].usage.prompt_tokens == len(ids) and chunks[-1].usage.completion_tokens == 5
    assert chunks[0].id.startswith("chatcmpl-") and chunks[0].object == "chat.completion.chunk"
    h.wait_idle()


def test_pd_finished_at_first_token_releases_kv(harness, tokenizer, model_info):
    h = harness("pd", ["prefill", "decode"])
    r = httpx.post(h.url + "/v1/completions", json={"prompt": "Hello", "max_tokens": 1})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] == "length" and r.json()["usage"]["completion_tokens"] == 1
    h.wait_idle()
    prefill, decode = h.workers
    assert [m for m, _ in decode.received] == []  # the decode worker never saw it


def test_stop_string_aborts_worker(harness, tokenizer, model_info):
    h = harness("pd", ["prefill", "decode"])
    ids = tokenizer("Once upon a time").input_ids
    full = h.expected_text(tokenizer, ids, 40)
    stop = "lazy"
    assert stop in full
    for stream in (False, True):
        r = httpx.post(h.url + "/v1/completions", json={"prompt": ids, "max_tokens": 40, "stop": [stop, "nothere"],
                                                        "stream": stream})
        assert r.status_code == 200
        if stream:
            events = [json.loads(line[6:]) for line in r.text.splitlines()
                      if line.startswith("data: {")]
            text = "".join(e["choices"][0]["text"] for e in events)
            finish = events[-1]["choices"][0]["finish_reason"]
        else:
            text, finish = r.json()["choices"][0]["text"], r.json()["choices"][0]["finish_reason"]
        assert text == full[:full.index(stop)] and finish == "stop"
        h.wait_idle()
    assert ("abort", None) not in h.workers[1].received
    assert sum(1 for m, _ in h.workers[1].received if m == "abort") == 2


@pytest.mark.parametrize("mode,roles", [("pd", ["prefill", "decode"]), ("colocated", ["colocated"])])
def test_client_disconnects_free_everything(harness, tokenizer, model_info, mode, roles):
    h = harness(mode, roles, step_s=0.05)
    body = {"model": model_info.name, "prompt": "Tell me a story", "max_tokens": 200, "stream": True}
    for n_chunks in (1, 2, 5):
        with httpx.Client(timeout=30) as c, c.stream("POST", h.url + "/v1/completions", json=body) as r:
            lines = r.iter_lines()
            got = 0
            for line in lines:
                if line.startswith("data: "):
                    got += 1
                    if got == n_chunks:
                        break
        h.wait_idle()
    # a non-streaming client that gives up
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(h.url + "/v1/completions", json=dict(body, stream=False), timeout=0.5)
    h.wait_idle()
    aborts = [rid for w in h.workers for m, rid in w.received if m == "abort"]
    assert len(aborts) == 4


def test_worker_error_is_an_api_error(harness, tokenizer, model_info):
    h = harness("pd", ["prefill", "decode"])
    r = httpx.post(h.url + "/v1/completions", json={"prompt": [1, ERROR_TOKEN, 3], "max_tokens": 4})
    assert r.status_code == 400 and "fake rejection" in r.json()["error"]["message"]
    r = httpx.post(h.url + "/v1/completions", json={"prompt": [1, ERROR_TOKEN, 3], "max_tokens": 4, "stream": True})
    assert r.status_code == 200
    assert '"error"' in r.text and "fake rejection" in r.text and r.text.rstrip().endswith("data: [DONE]")
    with pytest.raises(openai.APIError):
        list(openai.OpenAI(base_url=h.url + "/v1", api_key="x", max_retries=0).completions.create(
            model=model_info.name, prompt=[1, ERROR_TOKEN], max_tokens=3, stream=True))
    h.wait_idle()
    assert "epdserve:request_failure_total 3.0" in httpx.get(h.url + "/metrics").text


def test_silent_worker_fails_request_and_health(harness, tokenizer, model_info):
    h = harness("colocated", ["colocated"], worker_timeout_s=1.5)
    h.workers[0].silent = True
    t0 = time.monotonic()
    r = httpx.post(h.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 4}, timeout=30)
    assert r.status_code == 500 and "colocated-0" in r.json()["error"]["message"]
    assert time.monotonic() - t0 < 10
    health = httpx.get(h.url + "/health")
    assert health.status_code == 503 and health.json()["workers"][0]["state"] == "dead"
    r = httpx.post(h.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 4})
    assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable"


def test_health_waits_for_every_role(model_info, tokenizer, tmp_path):
    h = RouterHarness("pd", model_info, tokenizer, tmp_path)
    try:
        h.start(["prefill"])
        time.sleep(0.3)
        r = httpx.get(h.url + "/health")
        assert r.status_code == 503 and r.json()["workers"][0]["role"] == "prefill"
        h.add_worker("decode", "decode-0")
        r = h.wait_healthy()
        assert r.status_code == 200
        assert {w["worker_id"]: w["role"] for w in r.json()["workers"]} == {"prefill-0": "prefill", "decode-0": "decode"}
        for w in r.json()["workers"]:
            assert {"state", "blocks_in_use", "outstanding"} <= set(w)
        models = httpx.get(h.url + "/v1/models").json()
        assert models["data"][0]["id"] == model_info.name
        assert models["data"][0]["max_model_len"] == model_info.max_model_len
    finally:
        h.stop()


def test_least_outstanding_worker_is_picked(harness, tokenizer, model_info):
    h = harness("colocated", ["colocated", "colocated"], step_s=0.05)
    body = {"prompt": "Hi", "max_tokens": 400, "stream": True}
    with httpx.Client(timeout=30) as c, c.stream("POST", h.url + "/v1/completions", json=body) as r1, \
            c.stream("POST", h.url + "/v1/completions", json=body) as r2:
        lines1, lines2 = r1.iter_lines(), r2.iter_lines()  # (dropping an iterator closes the stream)
        next(lines1)
        next(lines2)
        held = sorted(len(s.outstanding) for s in h.router.workers.values())
        assert held == [1, 1]
    h.wait_idle()


BAD_REQUESTS = [
    ("chat", b"{not json", "JSON"),
    ("chat", {"messages": []}, "messages"),
    ("chat", {"model": "x"}, "messages"),
    ("chat", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, "max_tokens"),
    ("chat", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": -1}, "max_tokens"),
    ("chat", {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 0}, "max_completion_tokens"),
    ("chat", {"messages": [{"role": "user", "content": "hi"}], "model": "gpt-17"}, "gpt-17"),
    ("chat", {"messages": [{"role": "user", "content": "hi"}], "n": 2}, "n must be 1"),
    ("chat", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages"),
    ("completion", {"prompt": ""}, "empty"),
    ("completion", {"prompt": []}, "empty"),
    ("completion", {"prompt": ["a", "b"]}, "prompt"),
    ("completion", {"prompt": [10**9]}, "out of range"),
    ("completion", {"prompt": "hi", "max_tokens": 9000}, "maximum context length"),
    ("completion", {"prompt": "hi", "temperature": -1}, "temperature"),
    ("completion", [1, 2], "body"),
]


@pytest.mark.parametrize("kind,body,needle", BAD_REQUESTS)
def test_bad_requests_get_openai_400(harness, model_info, kind, body, needle):
    h = harness("colocated", ["colocated"])
    path = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
    if isinstance(body, bytes):
        r = httpx.post(h.url + path, content=body, headers={"content-type": "application/json"})
    else:
        r = httpx.post(h.url + path, json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error"
    assert needle.lower() in err["message"].lower() or needle == err["param"], err
    assert "epdserve:bad_request_total 1.0" in httpx.get(h.url + "/metrics").text
    h.wait_idle()


def test_context_window_message_names_both_numbers(harness, model_info, tokenizer):
    h = harness("colocated", ["colocated"])
    n = model_info.max_model_len
    r = httpx.post(h.url + "/v1/completions", json={"prompt": [5] * n, "max_tokens": 1})
    assert r.status_code == 400
    msg = r.json()["error"]["message"]
    assert str(n) in msg and str(n + 1) in msg
    r = httpx.post(h.url + "/v1/chat/completions",
                   json={"messages": [{"role": "user", "content": "hello " * n}]})
    assert r.status_code == 400 and str(n) in r.json()["error"]["message"]
    assert httpx.get(h.url + "/v1/nothing").json()["error"]["code"] == 404
