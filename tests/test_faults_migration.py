"""A worker killed mid-stream with migration on (serve's default ``--migration-limit``), real processes and
kill -9: the stream goes on with no error and the same greedy text as without the fault, the trace records
the move, /metrics counts it, the killed worker comes back and no KV block stays held. Colocated (two
workers) and PD (one prefill, two decode workers)."""

from __future__ import annotations

import os
import signal

import httpx
import pytest

from conftest import _stop, start_deployment
from test_faults_workers import RESTART_TIMEOUT_S, Stream, outstanding, states, wait_for
from test_serving_cleanup import wait_all_free

pytestmark = pytest.mark.faults

PROMPT = "Once upon a time, in a land far away,"
MAX_TOKENS = 200
DEPLOYMENTS = {"colocated": ("--workers", "2"), "pd": ("--prefill-workers", "1", "--decode-workers", "2")}


@pytest.fixture(scope="module", params=list(DEPLOYMENTS))
def deployment(request, tmp_path_factory):
    mode = request.param
    dep = start_deployment(mode, tmp_path_factory.mktemp(f"migrate-{mode}"), *DEPLOYMENTS[mode],
                           "--kv-cache-memory-mb", "128")
    try:
        yield dep
    finally:
        _stop(dep.proc)


def test_a_stream_whose_worker_is_killed_goes_on_elsewhere_with_the_same_text(deployment):
    dep = deployment
    role = "colocated" if dep.mode == "colocated" else "decode"
    expected = dep.generate("completion", PROMPT, stream=False, max_tokens=MAX_TOKENS, temperature=0,
                            extra_body={"ignore_eos": True}).text
    stream = Stream(dep.url, PROMPT, MAX_TOKENS)
    stream.start()
    wait_for(lambda: len(stream.events) >= 20, 60, "20 streamed tokens")
    victim = next(w for w, n in outstanding(dep, role).items() if n)
    os.kill(dep.worker_pid(victim), signal.SIGKILL)
    before = len(stream.events)
    stream.join(120)

    assert stream.failure is None and stream.error is None, stream.events[-1:]
    assert stream.events[-1][1]["choices"][0]["finish_reason"] == "length"
    assert stream.text == expected  # no token repeated, none missing
    times = [t for t, _ in stream.events]
    stall = max(b - a for a, b in zip(times, times[1:]))  # the move's: one prefill of prompt and output
    rec = dep.trace(stream.events[0][1]["id"])
    (move,) = rec["migrations"]
    assert move["from"] == victim and move["to"] != victim and move["recomputed_tokens"] > 20
    metrics = httpx.get(dep.url + "/metrics", timeout=10).text
    assert 'epdserve:request_migrations_total{engine="router",model_name="SmolLM2-135M-Instruct"} 1.0' in metrics
    print(f"\n{dep.mode}: kill -9 {victim} after {before} tokens; the longest gap between tokens {stall:.2f} s, "
          f"{move['recomputed_tokens']} tokens computed again on {move['to']}")
    wait_for(lambda: states(dep)[victim] == "up", RESTART_TIMEOUT_S, f"{victim} up again")
    wait_all_free(dep.url)
