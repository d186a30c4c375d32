"""Bad requests get HTTP 400 with an OpenAI-style body, while a stream started before
them keeps streaming and completes correctly."""

from __future__ import annotations

import json

import httpx

CONTEXT_TEXT = "hello " * 9000  # > 8,192 tokens, the default model's window


def bad_requests(model: str) -> list[tuple[str, str, object]]:
    user = [{"role": "user", "content": "hi"}]
    return [
        ("invalid JSON", "/v1/chat/completions", b'{"messages": [ {"role": "user"'),
        ("no messages", "/v1/chat/completions", {"model": model, "messages": []}),
        ("messages missing", "/v1/chat/completions", {"model": model}),
        ("max_tokens 0", "/v1/chat/completions", {"model": model, "messages": user, "max_tokens": 0}),
        ("max_tokens -1", "/v1/chat/completions", {"model": model, "messages": user, "max_tokens": -1}),
        ("max_tokens 0 (completions)", "/v1/completions", {"model": model, "prompt": "hi", "max_tokens": 0}),
        ("prompt too long", "/v1/chat/completions",
         {"model": model, "messages": [{"role": "user", "content": CONTEXT_TEXT}], "max_tokens": 10}),
        ("prompt too long (completions)", "/v1/completions", {"model": model, "prompt": CONTEXT_TEXT}),
        ("n=17", "/v1/chat/completions", {"model": model, "messages": user, "n": 17}),
        ("empty prompt", "/v1/completions", {"model": model, "prompt": ""}),
    ]


def _post(url: str, body) -> httpx.Response:
    if isinstance(body, bytes):
        return httpx.post(url, content=body, headers={"content-type": "application/json"}, timeout=60)
    return httpx.post(url, json=body, timeout=60)


def test_bad_requests_during_a_stream(server, model_info):
    n = 40
    body = {"model": model_info.name, "prompt": "Count to twenty: one, two, three,", "max_tokens": n,
            "temperature": 0, "ignore_eos": True}
    reference = _post(server.url + "/v1/completions", body).json()["choices"][0]["text"]

    texts, finish, usage = [], None, None
    with httpx.Client(timeout=120) as client, client.stream(
            "POST", server.url + "/v1/completions",
            json=dict(body, stream=True, stream_options={"include_usage": True})) as stream:
        assert stream.status_code == 200
        lines = stream.iter_lines()

        def read_event():
            for line in lines:
                if line.startswith("data: "):
                    return line[6:]
            raise AssertionError("stream ended early")

        first = json.loads(read_event())  # the stream is live
        texts.append(first["choices"][0]["text"])

        for name, path, bad in bad_requests(model_info.name):
            r = _post(server.url + path, bad)
            assert r.status_code == 400, (name, r.status_code, r.text[:300])
            err = r.json()["error"]
            assert set(err) >= {"message", "type", "param", "code"}, name
            assert err["type"] == "invalid_request_error" and err["message"], name
            if name.startswith("prompt too long"):
                assert str(model_info.max_model_len) in err["message"], err

        while (data := read_event()) != "[DONE]":
            event = json.loads(data)
            assert "error" not in event, event
            if event["choices"]:
                texts.append(event["choices"][0]["text"])
                finish = event["choices"][0]["finish_reason"] or finish
            else:
                usage = event["usage"]
    assert "".join(texts) == reference
    assert finish == "length" and usage["completion_tokens"] == n
