"""The per-request trace adds up: the stage times a deployment reports for the way to the
first token (router queue, worker queue, prefill, KV export, hops) sum to the TTFT the
client measures, also for a ~1,000-token prompt that arrives while other requests decode."""

from __future__ import annotations

import threading
import time

import pytest

# The first worker's queue key in the trace, by the path the request took.
FIRST_QUEUE = {"colocated": "queue_ms", "disaggregated": "prefill_queue_ms", "local": "decode_queue_ms"}


def ttft_stages(rec: dict) -> dict[str, float]:
    """The trace's stages between HTTP arrival and the first token, in ms."""
    keys = ["router_queue_ms", FIRST_QUEUE[rec["path"]], "prefill_ms", "ttft_hop_ms"]
    if rec["path"] == "disaggregated":
        keys.append("kv_export_ms")
    return {k: rec[k] for k in keys}


def timed_stream(dep, prompt, max_tokens: int, started: threading.Event | None = None) -> tuple[str, float]:
    """Stream one greedy completion; returns (response id, client TTFT in ms, from just
    before the request is sent to the first chunk)."""
    client = dep.openai()
    t0 = time.perf_counter()
    stream = client.completions.create(model=dep.model_id, prompt=prompt, max_tokens=max_tokens,
                                       temperature=0, stream=True, extra_body={"ignore_eos": True})
    ttft_ms = None
    for chunk in stream:
        if ttft_ms is None:
            ttft_ms = (time.perf_counter() - t0) * 1000
            if started is not None:
                started.set()
    return chunk.id, ttft_ms


def run_scenario(dep, tokenizer, offset: int) -> dict[str, tuple[str, float]]:
    """A background stream, then a ~1,000-token and a ~200-token prompt arriving while it
    decodes, then one ~200-token prompt alone. ``offset`` shifts every prompt's token ids, so a
    repeated scenario meets no prefix cache. Returns name -> (response id, client TTFT ms)."""
    long_prompt = tokenizer.decode(list(range(offset + 1000, offset + 2000)))  # ~1,000 tokens
    # ~200 tokens: enough prefill that fixed HTTP costs on a busy machine stay well under 10%.
    medium, other, first = (tokenizer.decode(list(range(offset + start, offset + start + 200)))
                            for start in (3000, 4000, 5000))
    results: dict[str, tuple[str, float]] = {}
    background_started = threading.Event()
    background = threading.Thread(target=lambda: results.__setitem__(
        "background", timed_stream(dep, first, 96, background_started)))
    background.start()
    try:
        assert background_started.wait(120)
        # Both arrive while the background request decodes.
        results["long"] = timed_stream(dep, long_prompt, 8)
        results["medium"] = timed_stream(dep, medium, 8)
    finally:
        background.join()
    results["alone"] = timed_stream(dep, other, 8)
    return results


def gaps(dep, results) -> dict[str, tuple[float, float, dict]]:
    """name -> (client TTFT ms, sum of the trace's stages ms, trace record) for every request
    whose stages miss the client's TTFT by more than the tolerance."""
    missed = {}
    for name, (rid, client_ttft) in results.items():
        rec = dep.trace(rid)
        stages = ttft_stages(rec)
        assert all(v >= 0 for v in stages.values()), (name, stages)
        # The HTTP framing outside the server's window costs 3-15 ms here; 150 ms absorbs a
        # scheduling hiccup of the shared 2-core CI runner on a ~0.5 s TTFT.
        if sum(stages.values()) != pytest.approx(client_ttft, rel=0.10, abs=150):
            missed[name] = (client_ttft, sum(stages.values()), rec)
    return missed


@pytest.mark.parametrize("mode", ["colocated", "pd"])
def test_ttft_stages_add_up(mode, request, tokenizer):
    dep = request.getfixturevalue(f"{mode}_server")
    dep.model_id = dep.openai().models.list().data[0].id
    # The shared CI runner has stalled the client or the server's process for 108-183 ms outside
    # the server's window, once per run at most: a missed request is measured again on fresh
    # prompts, and a gap the server really leaves out shows on both tries.
    tries = []
    for offset in (0, 6000):
        results = run_scenario(dep, tokenizer, offset)
        tries.append(gaps(dep, results))
        if not tries[-1]:
            break
    assert not tries[-1], tries
    long_rec = dep.trace(results["long"][0])
    assert long_rec["prompt_tokens"] > 900
    # The measured stages, not the hop remainder, carry a long prefill's TTFT.
    assert long_rec["ttft_hop_ms"] < 0.1 * long_rec["ttft_ms"]
    assert long_rec["path"] == ("disaggregated" if mode == "pd" else "colocated")
