"""xPyD: a 2-prefill 2-decode deployment on 2 cores serves concurrent greedy requests with
the same text as colocated, spreads them over every worker, and lists every worker (its
cores, state and load) in /health and /metrics."""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor

import httpx

PROMPTS = ["The capital of France is", "Write a haiku about the sea.", "1, 2, 3, 4,",
           "The quick brown fox", "In the beginning", "Water boils at",
           "My favourite colour is", "Here is a short story about a robot:"]
# Prompts of ~200 tokens, each its own: a prefill long enough (~1 s on the shared core) that
# the concurrent requests overlap there. Short ones finish prefilling in tens of ms, and on
# a busy machine they reach the router one after another and all find the same idle worker.
LONG_PROMPTS = [" ".join([p] * 30) for p in PROMPTS]


def generate_all(dep, prompts: list[str]) -> list:
    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(lambda p: dep.generate("completion", p, stream=True, max_tokens=16,
                                                    temperature=0), prompts))


def test_2p2d_matches_colocated_and_spreads(xpyd_server, colocated_server):
    health = xpyd_server.health()
    workers = {w["worker_id"]: w for w in health["workers"] if w["state"] != "refused"}
    assert set(workers) == {"prefill-0", "prefill-1", "decode-0", "decode-1"}
    # The placement rule on 2 cores: prefill workers share core 0, decode workers core 1.
    assert [workers[w]["cores"] for w in ("prefill-0", "prefill-1", "decode-0", "decode-1")] == [[0], [0], [1], [1]]
    assert all(w["state"] == "up" for w in workers.values())

    pd = generate_all(xpyd_server, LONG_PROMPTS)
    colo = generate_all(colocated_server, LONG_PROMPTS)
    assert [r.text for r in pd] == [r.text for r in colo]
    assert all(r.text and r.usage.completion_tokens == c.usage.completion_tokens for r, c in zip(pd, colo))

    traces = [xpyd_server.trace(r.id) for r in pd]
    assert {t["prefill_worker"] for t in traces} == {"prefill-0", "prefill-1"}
    assert {t["decode_worker"] for t in traces} == {"decode-0", "decode-1"}

    metrics = httpx.get(xpyd_server.url + "/metrics").text
    for wid, w in workers.items():
        engine, labels = re.escape(f'engine="{wid}"'), re.escape(f'role="{w["role"]}",worker="{wid}"}}')
        assert re.search(rf'^epdserve:worker_up\{{{engine},model_name="[^"]+",{labels} 1\.0$', metrics, re.M)
        assert re.search(rf'^epdserve:num_requests_running\{{{engine},model_name="[^"]+",{labels} \d', metrics,
                         re.M)
