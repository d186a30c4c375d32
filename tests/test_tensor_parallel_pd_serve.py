"""PD and EPD served with tensor-parallel workers of different sizes (``serve --prefill-tp
N --decode-tp M``) on this machine's 2 cores: prefill TP=2 → decode TP=1 and TP=1 → TP=2
give the greedy tokens of one float32 engine, the trace's KV bytes equal those of TP=1 →
TP=1, no KV block stays held (after aborts too); EPD with a TP=2 prefill worker, or a TP=2
encode worker (its vision tower split), gives the colocated answer for an image; a prefill
rank, or an encode rank, killed mid-request fails that request with an error within 5 s and
the worker comes back whole; elastic workers of 2 ranks switched to prefill and decode hand
KV over."""

from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from epdserve.engine.engine import EngineConfig, LLMEngine
from epdserve.engine.request import SamplingParams
from epdserve.model.tokenizer import chat_prompt_ids

from conftest import _stop, generate, start_deployment
from test_elastic_serve import _switch, _wait
from test_epd import ask as ask_image, picture
from test_serving_cleanup import stream_and_leave, wait_all_free
from test_tensor_parallel_serve import KILL_ERROR_S, RESTART_TIMEOUT_S, Stream, ask, follower_pids, story_ids, wait_for

pytestmark = pytest.mark.tp

MAX_TOKENS = 12
F32 = ("--weight-format", "f32", "--kv-cache-memory-mb", "64")


@pytest.fixture(scope="module")
def reference(model_info):
    return LLMEngine(str(model_info.path), EngineConfig(kv_cache_memory_mb=64, weight_format="f32"))


def workers(dep) -> dict[str, dict]:
    return {w["role"]: w for w in dep.health()["workers"]}


def kv_bytes(dep, request_ids) -> list[float]:
    return [dep.trace(rid)["kv_bytes"] for rid in request_ids]


def served(dep, tokenizer, reference, transport: str):
    """Greedy chat and completions, concurrently: the token ids, which must equal the
    reference engine's; returns the KV bytes of a completion's hand-off."""
    chats = [[{"role": "user", "content": "Hi!"}], [{"role": "user", "content": "Why is the sky blue?"}]]
    completions = [story_ids(tokenizer, n) for n in (40, 300)]
    requests = [("chat", c) for c in chats] + [("completion", c) for c in completions]
    with ThreadPoolExecutor(len(requests)) as pool:
        got = list(pool.map(lambda r: ask(dep.url, *r, MAX_TOKENS), requests))
    prompts = [chat_prompt_ids(tokenizer, c) for c in chats] + completions
    assert got == generate(reference, prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0)), transport
    wait_all_free(dep.url)
    one = dep.generate("completion", "The history of the printing press", stream=False, max_tokens=4, temperature=0)
    return dep.trace(one.id)["kv_bytes"]


@pytest.fixture(scope="module")
def tp1_bytes(tmp_path_factory, tokenizer, reference) -> int:
    """The KV bytes of one TP=1 -> TP=1 hand-off over TCP (``served``'s last completion)."""
    dep = start_deployment("pd", tmp_path_factory.mktemp("tp1"), "--kv-transport", "tcp", *F32)
    try:
        return served(dep, tokenizer, reference, "tcp")
    finally:
        _stop(dep.proc)


@pytest.mark.parametrize("sizes", [("2", "1"), ("1", "2")], ids=["tp2-to-tp1", "tp1-to-tp2"])
def test_pd_across_tp_sizes_gives_one_process_tokens_and_tp1_bytes(tmp_path, tokenizer, reference, tp1_bytes,
                                                                   sizes):
    got_bytes = {}
    prefill_tp, decode_tp = sizes
    for transport in ("shm", "tcp"):
        dep = start_deployment("pd", tmp_path, "--prefill-tp", prefill_tp, "--decode-tp", decode_tp,
                               "--kv-transport", transport, *F32)
        try:
            w = workers(dep)
            assert (w["prefill"]["tensor_parallel_size"], w["decode"]["tensor_parallel_size"]) == \
                (int(prefill_tp), int(decode_tp))
            got_bytes[transport] = served(dep, tokenizer, reference, transport)
            if transport == "shm":  # a client leaving frees every block
                body = {"prompt": "Write a long story.", "max_tokens": 500, "temperature": 0, "ignore_eos": True}
                stream_and_leave(dep.url + "/v1/completions", body, 3)
                wait_all_free(dep.url)
                assert all(w["blocks_in_use"] == 0 for w in workers(dep).values())
        finally:
            _stop(dep.proc)
    print(f"\nKV bytes of one hand-off: {got_bytes}, TP=1 -> TP=1: {tp1_bytes}")
    assert got_bytes["tcp"] == tp1_bytes > 0


def test_epd_with_a_tp2_prefill_or_encode_worker_gives_the_colocated_answer(tmp_path):
    image = picture(5)
    answers = []
    for mode, extra, sizes in (("epd", ("--prefill-tp", "2"), (1, 2)), ("epd", ("--encode-tp", "2"), (2, 1)),
                               ("colocated", (), None)):
        dep = start_deployment(mode, tmp_path, "--model", "vlm", "--kv-cache-memory-mb", "64", *extra)
        try:
            if sizes:
                assert (workers(dep)["encode"]["tensor_parallel_size"],
                        workers(dep)["prefill"]["tensor_parallel_size"]) == sizes
            answers.append(ask_image(dep, image).text)
            wait_all_free(dep.url)
        finally:
            _stop(dep.proc)
    assert answers[0] == answers[1] == answers[2] and answers[0]


def test_an_encode_rank_killed_mid_encoding_fails_the_request_and_the_worker_comes_back(tmp_path):
    # --migration-limit 0: the request fails as it always did (above 0 its prefill worker encodes the
    # images instead: tests/test_router_migration.py)
    dep = start_deployment("epd", tmp_path, "--model", "vlm", "--kv-cache-memory-mb", "64", "--encode-tp", "2",
                           "--migration-limit", "0")
    try:
        before = ask_image(dep, picture(5)).text
        old = workers(dep)["encode"]
        (follower,) = follower_pids(old["pid"])
        # Eight images (seconds of encoding on 2 ranks) are in the encode worker's batch when rank 1 dies.
        with ThreadPoolExecutor(1) as pool:
            reply = pool.submit(ask_failing, dep, [picture(10 + i) for i in range(8)])
            wait_for(lambda: workers(dep)["encode"]["outstanding"] >= 1, 30, "the request at the encode worker")
            time.sleep(0.5)
            os.kill(follower, signal.SIGKILL)
            t_kill = time.monotonic()
            error, t_end = reply.result(60)
        assert "tensor-parallel ranks failed" in error, error
        assert t_end - t_kill < KILL_ERROR_S, f"error {t_end - t_kill:.2f} s after the kill"
        wait_for(lambda: workers(dep)["encode"]["state"] == "up" and workers(dep)["encode"]["pid"] != old["pid"],
                 RESTART_TIMEOUT_S, "the encode worker up again")
        print(f"\nkill -9 of encode rank 1: error {t_end - t_kill:.2f} s later, worker up again "
              f"{time.monotonic() - t_kill:.1f} s later")
        assert ask_image(dep, picture(5)).text == before
        assert len(follower_pids(workers(dep)["encode"]["pid"])) == 1
        wait_all_free(dep.url)
    finally:
        _stop(dep.proc)


def ask_failing(dep, images: list[bytes]) -> tuple[str, float]:
    """The error of a chat with ``images`` that must fail, and when it came (monotonic)."""
    try:
        reply = ask_image(dep, *images)
    except Exception as exc:  # the openai client's APIError of the failed request
        return str(exc), time.monotonic()
    raise AssertionError(f"the request did not fail: {reply}")


def test_a_prefill_rank_killed_mid_request_fails_it_and_the_worker_comes_back(tmp_path, tokenizer):
    dep = start_deployment("pd", tmp_path, "--prefill-tp", "2", *F32)
    try:
        before = ask(dep.url, "completion", "The history of the printing press", 8)
        old = workers(dep)["prefill"]
        (follower,) = follower_pids(old["pid"])
        # A long prompt (seconds of prefill on 2 ranks) is in the prefill worker's steps when rank 1 dies.
        stream = Stream(dep.url, prompt=story_ids(tokenizer, 1500), max_tokens=4)
        stream.start()
        wait_for(lambda: workers(dep)["prefill"]["outstanding"] >= 1, 30, "the request at the prefill worker")
        time.sleep(0.2)
        os.kill(follower, signal.SIGKILL)
        t_kill = time.monotonic()
        stream.join(30)
        assert stream.failure is None and not stream.is_alive()
        t_end, last = stream.events[-1] if stream.events else (time.monotonic(), {})
        assert "error" in last, stream.events[-3:]
        assert t_end - t_kill < KILL_ERROR_S, f"error {t_end - t_kill:.2f} s after the kill"
        wait_for(lambda: workers(dep)["prefill"]["state"] == "up" and workers(dep)["prefill"]["pid"] != old["pid"],
                 RESTART_TIMEOUT_S, "the prefill worker up again")
        print(f"\nkill -9 of prefill rank 1: error {t_end - t_kill:.2f} s later, worker up again "
              f"{time.monotonic() - t_kill:.1f} s later")
        assert ask(dep.url, "completion", "The history of the printing press", 8) == before
        wait_all_free(dep.url)
        assert all(w["blocks_in_use"] == 0 for w in workers(dep).values())
    finally:
        _stop(dep.proc)


def test_elastic_tp2_workers_switch_to_prefill_and_decode_and_hand_kv_over(tmp_path, tokenizer, reference):
    """Two elastic workers of 2 ranks each (sharing the 2 cores) switched to a prefill and a
    decode worker hand every KV head over through their ranks' pools."""
    dep = start_deployment("colocated", tmp_path, "--elastic", "--workers", "2", "--elastic-interval", "0",
                           "--tensor-parallel-size", "2", *F32)
    try:
        ids = sorted(workers_by_id(dep))
        assert all(w["tensor_parallel_size"] == 2 for w in workers_by_id(dep).values())
        for worker, role in zip(ids, ("prefill", "decode")):
            _switch(dep, worker, role)
        _wait(lambda: [w["role"] for w in map(workers_by_id(dep).get, ids)] == ["prefill", "decode"]
              and not any(w["switching"] for w in workers_by_id(dep).values()), "the switches")
        prompt = story_ids(tokenizer, 120)
        want = generate(reference, [prompt], SamplingParams(max_tokens=MAX_TOKENS, temperature=0))
        assert [ask(dep.url, "completion", prompt, MAX_TOKENS)] == want
        one = dep.generate("completion", "The history of the printing press", stream=False, max_tokens=4,
                           temperature=0)
        assert dep.trace(one.id)["kv_bytes"] > 0  # it went through a hand-off
        wait_all_free(dep.url)
    finally:
        _stop(dep.proc)


def workers_by_id(dep) -> dict[str, dict]:
    return {w["worker_id"]: w for w in dep.health()["workers"]}
