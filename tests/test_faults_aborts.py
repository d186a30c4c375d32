"""Client aborts at random points — queued, prefilling, just after the first token, while
decoding, non-streamed requests that time out — on the 2P2D deployment: afterwards every
worker's KV blocks in use are 0, no request is left in flight, and it still serves.

``EPDSERVE_TEST_ABORTS`` sets the number of aborts (default 100; a full run's 1,000 takes
about ten times as long)."""

from __future__ import annotations

import asyncio
import os
import random
import time

import httpx
import pytest

from test_serving_cleanup import wait_all_free

pytestmark = pytest.mark.faults

N_ABORTS = int(os.environ.get("EPDSERVE_TEST_ABORTS", "100"))
CONCURRENCY = 12


async def abort_one(client: httpx.AsyncClient, url: str, rng: random.Random, prompt: list[int]) -> None:
    body = {"prompt": prompt, "max_tokens": 200, "temperature": 0, "ignore_eos": True}
    if rng.random() < 0.3:  # a non-streamed request whose client gives up
        try:
            await client.post(url, json=body, timeout=rng.uniform(0.05, 1.0))
        except httpx.TimeoutException:
            return
        return
    leave_after = rng.choice([0, 0, 1, 2, 3, 5, 8])  # 0: right after the headers
    async with client.stream("POST", url, json=dict(body, stream=True), timeout=120) as r:
        assert r.status_code == 200
        seen = 0
        async for line in r.aiter_lines():
            if seen >= leave_after:
                break
            seen += line.startswith("data: ")


async def abort_many(url: str, n: int, vocab: list[int]) -> None:
    rng = random.Random(1234)
    sem = asyncio.Semaphore(CONCURRENCY)

    async def one(i: int) -> None:
        prompt = [rng.choice(vocab) for _ in range(rng.choice([5, 30, 120, 300]))]
        async with sem:
            await abort_one(client, url + "/v1/completions", rng, prompt)

    async with httpx.AsyncClient() as client:
        await asyncio.gather(*(one(i) for i in range(n)))


def test_random_aborts_free_everything(xpyd_server, tokenizer):
    dep = xpyd_server
    vocab = tokenizer("the harbour master counted ships and wrote their names in a ledger").input_ids
    t0 = time.monotonic()
    asyncio.run(abort_many(dep.url, N_ABORTS, vocab))
    took = time.monotonic() - t0
    print(f"\n{N_ABORTS} aborts in {took:.1f} s ({took / N_ABORTS * 1000:.0f} ms per abort)")
    wait_all_free(dep.url, timeout=60)
    health = dep.health()
    assert health["requests_in_flight"] == 0
    assert all(w["state"] == "up" for w in health["workers"] if w["worker_id"].startswith(("prefill", "decode")))
    r = httpx.post(dep.url + "/v1/completions", json={"prompt": "The sky is", "max_tokens": 4,
                                                      "temperature": 0, "ignore_eos": True}, timeout=120)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
