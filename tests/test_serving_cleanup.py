"""Every way a request can end frees its KV blocks on every worker: completion, stop
string, finished at the first token (PD: KV released), clients that leave mid-stream,
right after the first token, or before a non-streamed answer."""

from __future__ import annotations

import re
import time

import httpx
import pytest

BLOCKS_IN_USE = re.compile(r'^epdserve:kv_blocks_in_use\{([^}]*)\} (\S+)$', re.M)


def blocks_in_use(url: str) -> dict[str, float]:
    return {labels: float(v) for labels, v in BLOCKS_IN_USE.findall(httpx.get(url + "/metrics").text)}


def wait_all_free(url: str, timeout: float = 10.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        used = blocks_in_use(url)
        health = httpx.get(url + "/health").json()
        busy = {w["worker_id"]: w["outstanding"] for w in health["workers"] if w["outstanding"]}
        if used and not any(used.values()) and not busy:
            return used
        if time.monotonic() > deadline:
            raise AssertionError(f"blocks still in use after {timeout} s: {used}; outstanding: {busy}")
        time.sleep(0.2)


def stream_and_leave(url: str, body: dict, n_events: int) -> None:
    """Open a stream, read ``n_events`` SSE events, close the connection."""
    with httpx.Client(timeout=120) as client, client.stream("POST", url, json=dict(body, stream=True)) as r:
        assert r.status_code == 200
        seen = 0
        for line in r.iter_lines():
            if line.startswith("data: "):
                seen += 1
                if seen >= n_events:
                    break


def test_blocks_freed_after_every_outcome(server, model_info):
    url = server.url
    # Long enough that a client left unnoticed keeps its blocks well past the wait below.
    long = {"model": model_info.name, "max_tokens": 2000, "temperature": 0, "ignore_eos": True}
    completions, chat = url + "/v1/completions", url + "/v1/chat/completions"

    # Clients that disconnect mid-stream (chat: event 1 is the role chunk).
    for _ in range(2):
        stream_and_leave(completions, dict(long, prompt="Write a long story about a dragon."), 2)
    stream_and_leave(chat, dict(long, messages=[{"role": "user", "content": "Tell me a long story."}]), 2)
    stream_and_leave(completions, dict(long, prompt="Once upon a time"), 1)  # right after token 1
    stream_and_leave(completions, dict(long, prompt="Three stories:", n=3, temperature=1.0), 4)  # all n go
    # Non-streaming clients that give up.
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(completions, json=dict(long, prompt="List every prime below ten thousand:"), timeout=1.5)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(chat, json=dict(long, messages=[{"role": "user", "content": "Count."}], n=2), timeout=1.5)
    # Requests that end normally, at the first token, or at a stop string.
    r = httpx.post(completions, json={"prompt": "Hello", "max_tokens": 1, "temperature": 0}, timeout=120)
    assert r.json()["choices"][0]["finish_reason"] == "length"
    r = httpx.post(completions, json={"prompt": "1, 2, 3, 4,", "max_tokens": 50, "temperature": 0,
                                      "ignore_eos": True, "stop": [","]}, timeout=120)
    assert r.json()["choices"][0]["finish_reason"] == "stop"
    r = httpx.post(completions, json={"prompt": "The sky is", "max_tokens": 8, "temperature": 0}, timeout=120)
    assert r.status_code == 200

    used = wait_all_free(url)
    workers = {w["worker_id"] for w in httpx.get(url + "/health").json()["workers"]}
    assert {re.search(r'worker="([^"]+)"', k).group(1) for k in used} == workers

    # Still serving correctly afterwards.
    r = httpx.post(completions, json={"prompt": "The sky is", "max_tokens": 4, "temperature": 0,
                                      "ignore_eos": True}, timeout=120)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    wait_all_free(url)
