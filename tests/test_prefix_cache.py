"""Prefix caching: a shared prefix is computed once (engine, prefill and decode roles),
cached blocks are evicted least recently freed first, and the hit reaches the client as
``usage.prompt_tokens_details.cached_tokens`` and /metrics as ``epdserve:prefix_cache_hits``."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid

import httpx
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from epdserve.engine.engine import EngineConfig, LLMEngine
from epdserve.engine.kv_source import TensorKV
from epdserve.engine.prefix_cache import hash_block
from epdserve.serving.worker.setup import new_engine
from epdserve.engine.request import SamplingParams

BLOCK = 16
PREFIX = 512
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
ONE = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(model_info):
    return str(model_info.path)


def random_ids(n: int, seed: int) -> list[int]:
    """``n`` token ids, reproducible, none of them special (ids 100..30000)."""
    return torch.randint(100, 30000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def prefixed() -> tuple[list[int], list[int]]:
    """Two prompts sharing a 512-token prefix: 544 tokens (a block multiple) and 542."""
    prefix = random_ids(PREFIX, 0)
    a, b = prefix + random_ids(32, 1), prefix + random_ids(30, 2)
    assert a[PREFIX] != b[PREFIX]
    return a, b


def engine(model_dir: str, **kw) -> LLMEngine:
    """An engine that prefills each of these prompts in one step (the steps counted below)."""
    return LLMEngine(model_dir, EngineConfig(block_size=BLOCK, **{"num_kv_blocks": 128, "max_num_batched_tokens": 2048,
                                                                  **kw}))


def run(engine: LLMEngine, request_id: str, prompt: list[int], params=GREEDY) -> tuple[list[int], int, list[int]]:
    """Run one request alone: its tokens, its first output's ``num_cached_tokens``, and
    the tokens the scheduler gave it in each step (recorded around the real scheduler)."""
    scheduled, tokens, cached = [], [], []
    schedule = engine.scheduler.schedule

    def recording():
        batch = schedule()
        scheduled.extend(n for s, n in zip(batch.seqs, batch.num_tokens) if s.request_id == request_id)
        return batch

    engine.scheduler.schedule = recording
    try:
        engine.add_request(request_id, prompt, params)
        while engine.has_unfinished():
            for out in engine.step():
                tokens += out.token_ids
                cached.append(out.num_cached_tokens)
    finally:
        del engine.scheduler.schedule
    return tokens, cached[0], scheduled


def test_shared_prefix_is_computed_once_with_the_same_tokens(model_dir, prefixed):
    a, b = prefixed
    off = engine(model_dir, enable_prefix_caching=False)
    expected = [run(off, rid, p)[0] for rid, p in (("a", a), ("b", b))]
    assert off.stats()["prefix_cache_queries"] == 0

    on = engine(model_dir)
    tokens_a, cached_a, scheduled_a = run(on, "a", a)
    assert (tokens_a, cached_a, scheduled_a[0]) == (expected[0], 0, len(a))
    tokens_b, cached_b, scheduled_b = run(on, "b", b)
    assert tokens_b == expected[1]
    assert cached_b == PREFIX
    assert scheduled_b[0] == len(b) - PREFIX  # only the suffix is prefilled
    # The whole prompt cached: its last block is still computed, for the logits (vLLM's rule).
    again, cached_again, scheduled_again = run(on, "a-again", a)
    assert (again, cached_again, scheduled_again[0]) == (expected[0], len(a) - BLOCK, BLOCK)
    stats = on.stats()
    assert stats["prefix_cache_queries"] == 2 * len(a) + len(b)
    assert stats["prefix_cache_hits"] == PREFIX + len(a) - BLOCK
    assert stats["blocks_in_use"] == 0


def test_cached_blocks_are_evicted_least_recently_freed_first(model_dir):
    """10 blocks. x, y, z (49 tokens: 3 full blocks + 1) run in turn and leave 9 cached
    free blocks; w (33 tokens) takes the last uncached one and evicts two: x's, its tail
    first (a finished sequence frees its tail first). y then hits all 3 blocks, x only its
    first; x's recompute evicts z's tail, so z hits one block."""
    tiny = engine(model_dir, num_kv_blocks=10)
    x, y, z, w = random_ids(49, 10), random_ids(49, 11), random_ids(49, 12), random_ids(33, 13)
    first = {rid: run(tiny, rid, p, ONE) for rid, p in (("x", x), ("y", y), ("z", z), ("w", w))}
    assert [c for _, c, _ in first.values()] == [0, 0, 0, 0]
    assert tiny.stats()["blocks_in_use"] == 0 and len(tiny.pool.evictable) == 9
    for rid, prompt, hit in (("y", y, 48), ("x", x, 16), ("z", z, 16)):
        tokens, cached, scheduled = run(tiny, rid + "-again", prompt, ONE)
        assert (tokens, cached, scheduled) == (first[rid][0], hit, [49 - hit]), rid
    assert tiny.stats()["blocks_in_use"] == 0


def test_decode_worker_reuses_its_cached_prefix_and_copies_only_new_blocks(model_dir, prefixed):
    """Prefill → decode hand-offs of two prompts with a shared prefix: the prefill engine
    computes the prefix once; the decode engine finds it in its own cache and imports only
    the blocks after it, so the second hand-off's prefix blocks are zeroed here and the
    tokens still equal the colocated ones."""
    a, b = prefixed
    colocated = engine(model_dir, enable_prefix_caching=False)
    expected = {rid: run(colocated, rid, p)[0] for rid, p in (("a", a), ("b", b))}
    prefill, decode = engine(model_dir), engine(model_dir)
    for rid, prompt, hit in (("a", a, 0), ("b", b, PREFIX)):
        prefill.add_request(rid, prompt, GREEDY, hold_kv=True)
        (out,) = prefill.step()
        assert out.num_cached_tokens == hit and out.kv_block_ids is not None
        kv = prefill.read_kv(out.kv_block_ids)
        prefill.release_kv(rid)
        kv[:, :, : hit // BLOCK] = 0  # must not be copied: the decode engine holds these blocks
        decode.add_request(rid, prompt, GREEDY, TensorKV(kv), out.token_ids[0])
        tokens = list(out.token_ids)
        while decode.has_unfinished():
            for step_out in decode.step():
                tokens += step_out.token_ids
        assert tokens == expected[rid], rid
    assert decode.stats()["prefix_cache_hits"] == PREFIX
    assert prefill.stats()["blocks_in_use"] == 0 and decode.stats()["blocks_in_use"] == 0


def test_overlapping_held_hand_offs_stay_valid(model_dir, prefixed):
    """A prefill worker's held (zero-copy) hand-off tags its pool blocks for one decode
    worker; a second request whose prefix blocks that hand-off still holds is staged as a
    copy instead, and both decode to the colocated tokens."""
    import zmq

    from epdserve.transfer import handoff

    a, b = prefixed
    colocated = engine(model_dir, enable_prefix_caching=False)
    expected = {rid: run(colocated, rid, p)[0] for rid, p in (("a", a), ("b", b))}
    prefill, pool = new_engine(model_dir, EngineConfig(block_size=BLOCK, num_kv_blocks=128,
                                                       max_num_batched_tokens=2048), True)
    decode = engine(model_dir)
    ctx = zmq.Context()
    exporter = handoff.Exporter(prefill, 60, ctx, None, "none", pool)
    try:
        descs, firsts = {}, {}
        for rid, prompt in (("a", a), ("b", b)):  # b's export while a's is still held
            prefill.add_request(rid, prompt, GREEDY, hold_kv=True)
            (out,) = prefill.step()
            descs[rid], firsts[rid] = exporter.export(out), out.token_ids[0]
        assert (descs["a"].kind, descs["b"].kind) == ("pool", "shm")
        importer = handoff.Importer(ctx, "shm", 10)
        for rid, prompt in (("a", a), ("b", b)):
            kv, _ = importer.take(rid, descs[rid], decode.kv_layout(), decode.kv_cache.dtype)
            decode.add_request(rid, prompt, GREEDY, kv, firsts[rid])
            tokens = [firsts[rid]]
            while decode.has_unfinished():
                for out in decode.step():
                    tokens += out.token_ids
            exporter.release(rid)
            assert tokens == expected[rid], rid
        assert prefill.stats()["blocks_in_use"] == 0 and (pool.tags == 0).all()
    finally:
        exporter.close()
        ctx.destroy(linger=0)


def test_block_hash_is_the_same_in_every_process():
    """Routers and peers may compare keys: unlike Python's hash(), no per-process salt."""
    code = ("from epdserve.engine.prefix_cache import hash_block as h; "
            "print(h(h(None, [1, 2, 3]), [4, 5], ('img',)).hex())")
    env = dict(os.environ, PYTHONHASHSEED="12345")
    there = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    here = hash_block(hash_block(None, [1, 2, 3]), [4, 5], ("img",))
    assert there.stdout.strip() == here.hex() and len(here) == 32
    assert hash_block(None, [1, 2, 3]) != hash_block(hash_block(None, [0]), [1, 2, 3])


def prefix_cache_totals(url: str) -> tuple[float, float]:
    """Sums over workers of ``epdserve:prefix_cache_queries`` and ``..._hits`` on /metrics."""
    totals = {}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=10).text):
        totals[family.name] = sum(s.value for s in family.samples if s.name.endswith("_total"))
    return totals["epdserve:prefix_cache_queries"], totals["epdserve:prefix_cache_hits"]


def test_cached_tokens_reach_usage_and_metrics(server):
    """Two requests sharing a ~700-token prefix, as completions (not streamed) and as chats
    (streamed, usage in the last chunk): the second one's usage reports the hit."""
    before = prefix_cache_totals(server.url)
    prefix = f"Session {uuid.uuid4().hex}. " + "A long shared document about caches and prefixes. " * 70
    first = server.generate("completion", prefix + "Question one?", stream=False, max_tokens=4, temperature=0)
    second = server.generate("completion", prefix + "Another question?", stream=False, max_tokens=4,
                             temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert PREFIX <= cached < second.usage.prompt_tokens and cached % BLOCK == 0
    # The server trace says so too (the planner's prefill fit reads it there).
    assert [server.trace(r.id)["cached_tokens"] for r in (first, second)] == [0, cached]

    chats = [server.generate("chat", [{"role": "user", "content": prefix + q}], stream=True, max_tokens=4,
                             temperature=0) for q in ("Why?", "How so?")]
    assert chats[1].usage.prompt_tokens_details.cached_tokens >= PREFIX
    want = before[1] + cached + PREFIX  # at least; in pd the decode worker's hits add to it
    deadline = time.monotonic() + 10  # a worker's Stats may trail its last Output
    while (after := prefix_cache_totals(server.url))[1] < want and time.monotonic() < deadline:
        time.sleep(0.2)
    assert after[1] >= want
    assert after[0] >= before[0] + first.usage.prompt_tokens + second.usage.prompt_tokens
