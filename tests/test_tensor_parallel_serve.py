"""A tensor-parallel engine worker (``--tensor-parallel-size``; serving/worker/ranks.py):
``epdserve serve --mode colocated -tp 2`` on the 2 cores gives the same greedy tokens as a
TP=1 engine on the dense float32 weights (chat and completions, concurrent, one prompt over
300 tokens), frees every KV block after its requests and after a client that leaves
mid-stream, shows its ranks in ``/health`` and pins each rank to its core; a follower killed
mid-stream ends the stream with an error within 5 s (no other worker to move it to) and the
worker comes back whole, and with a second TP=2 worker the request moves to it instead. The
start-up refusals (more ranks than cores or than KV heads, GGUF blocks) each end serve or
the worker with one line; the control messages round-trip; a vision-language model's text
model (image embeddings in the step) runs on 2 ranks too."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import torch

from epdserve.engine.engine import EngineConfig, LLMEngine
from epdserve.engine.request import SamplingParams
from epdserve.model.loader import resolve_model
from epdserve.model.tokenizer import chat_prompt_ids
from epdserve.serving.launch import launcher
from epdserve.serving.worker import engine_worker, rank_messages
from epdserve.serving.worker.ranks import Ranks, remove_stale_dirs, split_cores
from epdserve.argtypes import config_from
from epdserve.serving.launch.options import ServeOptions

from conftest import _stop, generate, start_deployment
from test_serving_cleanup import stream_and_leave, wait_all_free

pytestmark = pytest.mark.tp

MAX_TOKENS = 16
KILL_ERROR_S = 5.0  # a killed rank's request must end with an error this soon
RESTART_TIMEOUT_S = 120
STORY = ("The lighthouse keeper climbed the spiral stairs every evening at dusk, counting the steps as "
         "his father had taught him. Ships passed in the night, their lamps like slow stars. ")


@pytest.fixture(scope="module")
def tp_server(tmp_path_factory):
    dep = start_deployment("colocated", tmp_path_factory.mktemp("serve-tp2"), "--tensor-parallel-size", "2",
                           "--kv-cache-memory-mb", "128")
    try:
        yield dep
    finally:
        _stop(dep.proc)


def story_ids(tokenizer, n: int) -> list[int]:
    ids = tokenizer(STORY * (n // 30 + 2)).input_ids
    return ids[:n]


def ask(url: str, kind: str, prompt, max_tokens: int = MAX_TOKENS) -> list[int]:
    """The generated token ids of one greedy request (from its logprobs, as token ids)."""
    body = {"max_tokens": max_tokens, "temperature": 0, "return_tokens_as_token_ids": True}
    if kind == "chat":
        body.update(messages=prompt, logprobs=True)
    else:
        body.update(prompt=prompt, logprobs=1)
    r = httpx.post(f"{url}/v1/{'chat/completions' if kind == 'chat' else 'completions'}", json=body, timeout=120)
    assert r.status_code == 200, r.text
    logprobs = r.json()["choices"][0]["logprobs"]
    tokens = [t["token"] for t in logprobs["content"]] if kind == "chat" else logprobs["tokens"]
    return [int(t.removeprefix("token_id:")) for t in tokens]


def follower_pids(worker_pid: int) -> list[int]:
    """The tensor-parallel followers among ``worker_pid``'s children."""
    pids = []
    for task in Path(f"/proc/{worker_pid}/task").iterdir():
        for pid in (task / "children").read_text().split():
            try:
                if b"epdserve.serving.worker.follower" in Path(f"/proc/{pid}/cmdline").read_bytes():
                    pids.append(int(pid))
            except FileNotFoundError:
                continue
    return pids


def worker_entry(dep) -> dict:
    return dep.health()["workers"][0]


def test_greedy_outputs_equal_one_rank_on_f32(tp_server, tokenizer, model_info):
    chats = [[{"role": "user", "content": "Hi!"}],
             [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Why is the sky blue?"}]]
    completions = [story_ids(tokenizer, n) for n in (7, 120, 340)]
    requests = [("chat", c) for c in chats] + [("completion", c) for c in completions]
    with ThreadPoolExecutor(len(requests)) as pool:  # concurrent: batched in the worker's steps
        got = list(pool.map(lambda r: ask(tp_server.url, *r), requests))
    prompts = [chat_prompt_ids(tokenizer, c) for c in chats] + completions
    assert len(prompts[-1]) > 300
    reference = LLMEngine(str(model_info.path), EngineConfig(kv_cache_memory_mb=64, weight_format="f32"))
    want = generate(reference, prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0))
    assert got == want
    assert all(len(g) == MAX_TOKENS or g[-1] in reference.model.config.eos_token_ids for g in got)
    wait_all_free(tp_server.url)


def test_health_shows_the_ranks_and_each_rank_is_pinned_to_its_core(tp_server):
    w = worker_entry(tp_server)
    assert (w["tensor_parallel_size"], w["cores"], w["weight_format"]) == (2, [0, 1], "f32")
    assert w["blocks_in_use"] == 0 and w["blocks_total"] > 0
    (follower,) = follower_pids(w["pid"])
    assert os.sched_getaffinity(w["pid"]) == {0} and os.sched_getaffinity(follower) == {1}


def test_a_client_that_leaves_mid_stream_frees_its_blocks(tp_server):
    body = {"prompt": "Write a long story about a dragon.", "max_tokens": 2000, "temperature": 0, "ignore_eos": True}
    stream_and_leave(tp_server.url + "/v1/completions", body, 4)
    wait_all_free(tp_server.url)
    assert worker_entry(tp_server)["blocks_in_use"] == 0


class Stream(threading.Thread):
    """A long streamed completion read in a thread: ``events`` are ``(monotonic time, data)``."""

    def __init__(self, url: str, prompt="Once upon a time", max_tokens: int = 1500):
        super().__init__(daemon=True)
        self.url, self.events, self.failure = url, [], None
        self.prompt, self.max_tokens = prompt, max_tokens

    def run(self) -> None:
        body = {"prompt": self.prompt, "max_tokens": self.max_tokens, "temperature": 0, "ignore_eos": True,
                "stream": True}
        try:
            with httpx.stream("POST", self.url + "/v1/completions", json=body, timeout=120) as r:
                for line in r.iter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        self.events.append((time.monotonic(), json.loads(line[6:])))
        except BaseException as exc:  # reported by the test
            self.failure = exc


def wait_for(cond, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out after {timeout} s waiting for {what}"
        time.sleep(0.05)


def test_a_follower_killed_mid_stream_fails_the_request_and_the_worker_comes_back(tp_server):
    """Last in the module: the worker restarts."""
    before = ask(tp_server.url, "completion", "The history of the printing press", 12)
    stream = Stream(tp_server.url)
    stream.start()
    wait_for(lambda: len(stream.events) >= 5, 60, "the stream's first tokens")
    old = worker_entry(tp_server)
    (follower,) = follower_pids(old["pid"])
    os.kill(follower, signal.SIGKILL)
    t_kill = time.monotonic()
    stream.join(30)
    assert stream.failure is None and not stream.is_alive()
    t_end, last = stream.events[-1]
    assert "error" in last and "tensor-parallel rank 1" in last["error"]["message"], last
    assert t_end - t_kill < KILL_ERROR_S, f"error {t_end - t_kill:.2f} s after the kill"
    wait_for(lambda: worker_entry(tp_server)["state"] == "down", 10, "the worker down")
    wait_for(lambda: worker_entry(tp_server)["state"] == "up" and worker_entry(tp_server)["pid"] != old["pid"],
             RESTART_TIMEOUT_S, "the worker up again")
    print(f"\nkill -9 of rank 1: error event {t_end - t_kill:.2f} s later, worker up again "
          f"{time.monotonic() - t_kill:.1f} s later")
    assert ask(tp_server.url, "completion", "The history of the printing press", 12) == before
    assert len(follower_pids(worker_entry(tp_server)["pid"])) == 1
    assert "restarted with all its ranks" in tp_server.log_tail(10**6)
    wait_all_free(tp_server.url)


def test_a_follower_killed_mid_stream_moves_the_request_to_the_other_tp_worker(tmp_path):
    """Two TP=2 workers (their 4 ranks share the 2 cores): the request of the worker whose follower
    died moves to the other with its output (``--migration-limit``) and ends with the fault-free text."""
    dep = start_deployment("colocated", tmp_path, "--workers", "2", "--tensor-parallel-size", "2",
                           "--kv-cache-memory-mb", "128")
    try:
        prompt, n = "Once upon a time, in a land far away,", 120
        before = httpx.post(dep.url + "/v1/completions", json={"prompt": prompt, "max_tokens": n, "temperature": 0,
                                                               "ignore_eos": True}, timeout=120).json()
        stream = Stream(dep.url, prompt, n)
        stream.start()
        wait_for(lambda: len(stream.events) >= 20, 60, "20 streamed tokens")
        busy = next(w for w in dep.health()["workers"] if w["outstanding"])
        (follower,) = follower_pids(busy["pid"])
        os.kill(follower, signal.SIGKILL)
        stream.join(60)
        text = "".join(d["choices"][0]["text"] for _, d in stream.events if d.get("choices"))
        rec = dep.trace(stream.events[0][1]["id"])

        assert stream.failure is None and not any("error" in d for _, d in stream.events)
        assert text == before["choices"][0]["text"]
        (move,) = rec["migrations"]
        assert move["from"] == busy["worker_id"] and move["to"] != busy["worker_id"]
        assert "tensor-parallel rank 1" in dep.log_tail(10**6)
        times = [t for t, _ in stream.events]
        print(f"\nkill -9 of rank 1 of {busy['worker_id']}: moved to {move['to']}; the longest gap between tokens "
              f"{max(b - a for a, b in zip(times, times[1:])):.2f} s")
    finally:
        _stop(dep.proc)


# ---- start-up refusals -------------------------------------------------------------------

def serve_args(*argv: str):
    parser = argparse.ArgumentParser()
    launcher.add_arguments(parser)
    return config_from(ServeOptions, parser.parse_args([*argv, "--allow-unauthenticated"]))


def test_serve_takes_ranks_on_every_engine_role_and_refuses_them_beyond_the_cores():
    message = "--tensor-parallel-size 3 needs 3 cores, one a rank; serve has 2 (0,1)"
    assert message in launcher._check_options(serve_args("-tp", "3", "--cores", "0,1"))[2]
    for argv in (("-tp", "2"), ("--mode", "pd", "-tp", "2"), ("--mode", "epd", "-tp", "2"),
                 ("--elastic", "--workers", "2", "-tp", "2")):  # (encode workers keep one rank)
        assert launcher._check_options(serve_args(*argv, "--cores", "0,1"))[2] is None, argv
    # Fewer cores than ranks: the workers share them, each on 2 distinct cores (serve warns).
    assert launcher._check_options(serve_args("--workers", "2", "--cores", "0,1", "-tp", "2"))[1] == [
        ("colocated", "colocated-0", [0, 1]), ("colocated", "colocated-1", [0, 1])]
    assert split_cores([0, 1, 2], 2) == [[0, 1], [2]] and split_cores([4, 5, 6, 7], 2) == [[4, 5], [6, 7]]


def run_worker(capsys, *argv: str) -> tuple[int, str]:
    """``epdserve worker ARGV`` (colocated) in this process, up to its start-up refusal."""
    parser = argparse.ArgumentParser()
    engine_worker.add_arguments(parser)
    args = parser.parse_args(["--role", "colocated", "--router", "ipc:///nowhere/events", "--bind",
                              "ipc:///nowhere/cmd", "--worker-id", "w", "--allow-unauthenticated", *argv])
    threads = torch.get_num_threads()
    try:
        rc = engine_worker.run(engine_worker.WorkerConfig.from_args(args))
    finally:
        torch.set_num_threads(threads)
    return rc, capsys.readouterr().out.strip()


def test_the_worker_refuses_splits_the_model_cannot_take(capsys):
    rc, out = run_worker(capsys, "-tp", "4")
    assert (rc, out) == (2, "epdserve worker: error: tensor parallel size 4 exceeds the model's 3 KV heads: "
                            "each rank needs at least one")
    for fmt in ("q4_1", "q4_1+f32", "q4_1+bf16"):
        rc, out = run_worker(capsys, "-tp", "2", "--weight-format", fmt)
        assert (rc, out) == (2, f"epdserve worker: error: weight format {fmt}: tensor parallelism needs a dense "
                                "format (f32 or bf16), not GGUF blocks")


def test_serve_stops_when_its_worker_refuses_gguf_blocks_with_ranks():
    proc = subprocess.run([sys.executable, "-m", "epdserve", "serve", "-tp", "2", "--weight-format", "q4_1",
                           "--port", "0", "--startup-timeout", "120"], capture_output=True, text=True, timeout=180)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr + proc.stdout
    assert ("weight format q4_1: tensor parallelism needs a dense format (f32 or bf16), not GGUF blocks"
            in proc.stdout + proc.stderr)
    assert "configuration is wrong" in proc.stderr


# ---- the control channel and a vision-language model ----------------------------------------

def test_a_killed_rank_0s_socket_directory_goes_at_the_next_start(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    dead = subprocess.Popen(["true"])
    dead.wait()
    for name in (f"epdserve-tp-{dead.pid}-a_1", f"epdserve-tp-{os.getpid()}-b2", "epdserve-tp-x", "other"):
        (tmp_path / name).mkdir()
    assert remove_stale_dirs() == [f"epdserve-tp-{dead.pid}-a_1"]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([f"epdserve-tp-{os.getpid()}-b2", "epdserve-tp-x",
                                                                "other"])


def test_control_messages_round_trip_without_pickle():
    from epdserve.model.llama import AttentionMetadata, PrefillSeq

    meta = AttentionMetadata(positions=torch.arange(7), slot_mapping=torch.arange(7) + 32,
                             prefills=[PrefillSeq(0, 5, 9, torch.tensor([2, 3]))], decode_rows=torch.tensor([5, 6]),
                             decode_block_tables=torch.tensor([[4, 0], [5, 6]]), decode_ctx_lens=torch.tensor([3, 20]),
                             logits_rows=torch.tensor([4, 5, 6]))
    embeds = (torch.tensor([1, 2]), torch.randn(2, 8).bfloat16())
    frames = rank_messages.encode_step("forward", torch.arange(7) + 100, meta, embeds)
    assert all(isinstance(f, (bytes, memoryview)) for f in frames)
    header, tensors = rank_messages.decode([bytes(f) for f in frames])
    ids, got, got_embeds = rank_messages.decode_step(header, tensors)
    assert header["op"] == "forward" and torch.equal(ids, torch.arange(7) + 100)
    for name in rank_messages.META_FIELDS:
        assert torch.equal(getattr(got, name), getattr(meta, name)), name
    assert [(p.start, p.q_len, p.ctx_len, p.block_table.tolist()) for p in got.prefills] == [(0, 5, 9, [2, 3])]
    assert torch.equal(got_embeds[0], embeds[0]) and torch.equal(got_embeds[1], embeds[1])
    empty = AttentionMetadata(torch.arange(3), torch.arange(3), [PrefillSeq(0, 3, 3, torch.tensor([0]))],
                              torch.empty(0, dtype=torch.long), torch.empty(0, 0, dtype=torch.long),
                              torch.empty(0, dtype=torch.long), torch.tensor([2]))
    _, got, none = rank_messages.decode_step(*rank_messages.decode(
        [bytes(f) for f in rank_messages.encode_step("hidden_states", torch.arange(3), empty, None)]))
    assert got.decode_block_tables.shape == (0, 0) and none is None
    for bad in ([b"\x80"], [rank_messages.encode("logits", [torch.ones(2)])[0]],
                [rank_messages.encode("logits", [torch.ones(2)])[0], b"123"]):
        with pytest.raises(rank_messages.MessageError):
            rank_messages.decode(bad)


def test_a_vision_language_models_text_model_runs_on_two_ranks():
    """In-process rank 0 (no server): a prompt with image embeddings, sent to the follower in
    the step message, gives the same greedy tokens as one rank."""
    vlm = resolve_model("vlm")
    config = EngineConfig(kv_cache_memory_mb=32)
    embeddings = torch.randn(64, 576, generator=torch.Generator().manual_seed(0)) * 0.05
    params = SamplingParams(max_tokens=8, temperature=0)

    def run(engine: LLMEngine) -> list[int]:
        ids = [1] * 20 + [engine.image_token_id] * 64 + [2] * 30
        engine.add_request("r", ids, params, images=[("h", 64)], image_embeddings=embeddings)
        out = []
        while engine.has_unfinished():
            out += [t for o in engine.step() for t in o.token_ids]
        return out

    ranks = Ranks.start(2, "vlm-test", str(vlm.path), "float32", "f32", "cpu", [[0], [1]])
    try:
        got = run(LLMEngine(str(vlm.path), config, tp=ranks))
    finally:
        ranks.close()
    assert all(p.returncode == 0 for p in ranks.procs)
    assert got == run(LLMEngine(str(vlm.path), config))
