"""EPD end to end with the default vision-language model (``--model vlm``: SmolLM2-135M with
a seeded synthetic SigLIP tower): the same greedy answer for an image in colocated, PD and
EPD deployments; an encode worker process's embeddings equal the in-process encoder's; a
repeated image is encoded once; prefix-cache keys carry image hashes; bad images get 400
while other requests go on."""

from __future__ import annotations

import base64
import io
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
import torch
import zmq
from PIL import Image
from prometheus_client.parser import text_string_to_metric_families

from conftest import _stop, free_port, start_deployment
from epdserve.engine.encoder import EncodeEngine
from epdserve.engine.engine import EngineConfig, LLMEngine
from epdserve.engine.request import SamplingParams
from epdserve.model.loader import resolve_model
from epdserve.serving import protocol as P
from epdserve.model.image_processor import ImageInput
from epdserve.transfer import embedding, shm, tcp

pytestmark = pytest.mark.epd

QUESTION = "Describe the picture in one sentence."


def picture(seed: int, size: tuple[int, int] = (320, 240)) -> bytes:
    """A seeded random PNG of ``size`` = (width, height) pixels."""
    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, "PNG")
    return out.getvalue()


def image_message(*images: bytes, text: str = QUESTION) -> list[dict]:
    parts = [{"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(b).decode()}}
             for b in images]
    return [{"role": "user", "content": parts + [{"type": "text", "text": text}]}]


def ask(dep, *images: bytes, max_tokens: int = 12):
    return dep.generate("chat", image_message(*images), stream=False, max_tokens=max_tokens, temperature=0)


def counter(url: str, name: str) -> float:
    """The sum over workers of counter ``name`` (without ``_total``) on /metrics."""
    text = httpx.get(url + "/metrics", timeout=10).text
    return sum(s.value for f in text_string_to_metric_families(text) if f.name == name
               for s in f.samples if s.name.endswith("_total"))


@pytest.fixture(scope="module")
def vlm():
    return resolve_model("vlm")


@pytest.fixture(scope="module")
def epd_server(tmp_path_factory):
    dep = start_deployment("epd", tmp_path_factory.mktemp("serve-epd"), "--model", "vlm", "--encode-workers", "2",
                           "--limit-images-per-prompt", "2")
    try:
        yield dep
    finally:
        _stop(dep.proc)


def test_models_say_the_vision_tower_is_synthetic(epd_server):
    card = httpx.get(epd_server.url + "/v1/models").json()["data"][0]
    assert card["id"] == "vlm" and card["input_modalities"] == ["text", "image"]
    assert card["synthetic_vision"] is True and "SYNTHETIC" in card["note"]
    assert sorted(w["role"] for w in httpx.get(epd_server.url + "/health").json()["workers"]) == \
        ["decode", "encode", "encode", "prefill"]


def test_same_greedy_answer_in_colocated_pd_and_epd(epd_server, tmp_path):
    """The EPD answer for two images (spread over the two encode workers), and for the
    second one alone, equals PD's (encoding in the prefill worker) and colocated's; the two
    answers differ (the images matter)."""
    a, b = picture(1), picture(2)
    both = ask(epd_server, a, b)
    assert epd_server.trace(both.id)["encode_workers"] == ["encode-0", "encode-1"]  # one image each
    expected = [both.text, ask(epd_server, b).text]
    assert expected[0] != expected[1] and all(expected)
    for mode in ("pd", "colocated"):
        dep = start_deployment(mode, tmp_path, "--model", "vlm")
        try:
            got = [ask(dep, a, b), ask(dep, b)]
            assert [r.text for r in got] == expected, mode
            rec = dep.trace(got[0].id)
            assert rec["num_images"] == 2 and rec["encode_ms"] > 0 and rec["embedding_bytes"] == 0
        finally:
            _stop(dep.proc)


def test_repeated_image_is_encoded_once(epd_server):
    """The second request with the same image hits the encode worker's embedding cache
    (encode time 0, mm_cache_hits +1) and the prefill worker's prefix cache, whose keys
    include the image hash: a different image with the same text reuses only the blocks
    before it."""
    image = picture(3)
    hits = counter(epd_server.url, "epdserve:mm_cache_hits")
    first, second = ask(epd_server, image), ask(epd_server, image)
    assert first.text == second.text
    one, two = epd_server.trace(first.id), epd_server.trace(second.id)
    assert two["encode_ms"] < one["encode_ms"] / 20  # a cache lookup, no vision forward
    assert 64 * 576 * 4 < one["embedding_bytes"] == two["embedding_bytes"] < 64 * 576 * 4 + 4096
    assert counter(epd_server.url, "epdserve:mm_cache_hits") == hits + 1
    assert second.usage.prompt_tokens_details.cached_tokens >= second.usage.prompt_tokens - 16
    other = ask(epd_server, picture(4))
    assert other.usage.prompt_tokens_details.cached_tokens < 64


@pytest.mark.parametrize("case", ["corrupt", "truncated", "too many", "text with <image>"])
def test_bad_images_get_400_and_others_go_on(epd_server, case):
    good = picture(5)
    messages = {"corrupt": image_message(b"\x89PNG\r\n\x1a\n" + b"garbage" * 50),
                "truncated": image_message(good[: len(good) // 2]),
                "too many": image_message(good, good, good),
                "text with <image>": image_message(good, text="look: <image>")}[case]
    with pytest.raises(openai.BadRequestError) as err:
        epd_server.openai().chat.completions.create(model="vlm", messages=messages, max_tokens=4)
    assert err.value.status_code == 400 and err.value.body["param"].startswith("messages")
    assert ask(epd_server, good, max_tokens=2).finish_reason == "length"


def test_images_to_a_text_model_get_400(colocated_server):
    with pytest.raises(openai.BadRequestError, match="takes no images"):
        colocated_server.openai().chat.completions.create(model=colocated_server.openai().models.list().data[0].id,
                                                          messages=image_message(picture(6)), max_tokens=4)


def test_encode_worker_embeddings_equal_in_process(vlm, tmp_path):
    """An ``epdserve worker --role encode`` process, driven over its real sockets: its frame,
    read from /dev/shm or fetched from its TCP server, holds exactly what EncodeEngine
    computes in this process; ReleaseKV deletes a frame nobody read."""
    images = [picture(7), picture(8, (500, 200))]
    ctx = zmq.Context()
    events = ctx.socket(zmq.PULL)
    events_addr = f"tcp://127.0.0.1:{free_port()}"
    events.bind(events_addr)
    cmd_addr = f"ipc://{tmp_path}/encode.sock"
    proc = subprocess.Popen([sys.executable, "-m", "epdserve", "worker", "--role", "encode", "--router", events_addr,
                             "--bind", cmd_addr, "--worker-id", "encode-t", "--model", "vlm",
                             "--allow-unauthenticated"],  # this test speaks the router's side unsealed
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    inbox: queue.Queue = queue.Queue()

    def receive():
        while not ctx.closed:
            try:
                if events.poll(200):
                    inbox.put(P.decode(events.recv()))
            except zmq.ZMQError:
                return

    threading.Thread(target=receive, daemon=True).start()
    try:
        hello = next(m for m in iter(lambda: inbox.get(timeout=300), None) if isinstance(m, P.Hello))
        assert hello.role == "encode" and hello.kv_layout["hidden_size"] == 576
        push = ctx.socket(zmq.PUSH)
        push.connect(cmd_addr)
        refs = [P.ImageRef(hash=ImageInput.from_bytes(b, "t").content_hash, tokens=64, data=b) for b in images]
        push.send(P.encode(P.Encode(request_id="r1", images=refs)))
        push.send(P.encode(P.Encode(request_id="r2", images=refs[1:])))
        push.send(P.encode(P.Encode(request_id="r3", images=refs[:1])))
        answers = {}
        while len(answers) < 3:
            msg = inbox.get(timeout=300)
            if isinstance(msg, (P.Encoded, P.Error)):
                answers[msg.request_id] = msg
        assert isinstance(answers["r1"], P.Encoded), answers["r1"]
        header, tensors = shm.read(answers["r1"].frame.name)
        got = embedding.unpack(header, tensors, 576, [r.hash for r in refs])
        frame = answers["r2"].frame
        header, tensors = tcp.fetch(ctx, frame.addr, "r2", frame.name, frame.nbytes, 30)
        got += embedding.unpack(header, tensors, 576, [refs[1].hash])
        expected = EncodeEngine(vlm.path).encode([ImageInput.from_bytes(b, "t") for b in images])
        for g, e in zip(got, expected + expected[1:]):
            assert torch.equal(g.embeddings, e.embeddings) and (g.rows, g.cols) == (e.rows, e.cols)
        unread = answers["r3"].frame.name
        assert (Path(shm.SHM_DIR) / unread).exists()
        push.send(P.encode(P.ReleaseKV(request_id="r3")))
        deadline = 50
        while (Path(shm.SHM_DIR) / unread).exists() and deadline:
            inbox.get(timeout=5)
            deadline -= 1
        assert not (Path(shm.SHM_DIR) / unread).exists()
        push.send(P.encode(P.Shutdown()))
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        ctx.destroy(linger=0)


def test_prefix_cache_keys_include_image_hashes(vlm):
    """Engine level: the same prompt tokens with another image's hash reuse only the blocks
    before the image; with the same hash, all but the last token's block."""
    engine = LLMEngine(str(vlm.path), EngineConfig(kv_cache_memory_mb=64))
    ids = [1] * 20 + [engine.image_token_id] * 64 + [2] * 30
    sampling = SamplingParams(max_tokens=1, temperature=0)
    cached = {}
    for rid, image_hash in (("a", "h1"), ("b", "h1"), ("c", "h2")):
        engine.add_request(rid, ids, sampling, images=[(image_hash, 64)], image_embeddings=torch.randn(64, 576))
        while engine.has_unfinished():
            for out in engine.step():
                cached[rid] = out.num_cached_tokens
    assert cached == {"a": 0, "b": 112, "c": 16}
    with pytest.raises(ValueError, match="64 image tokens, its 1 images need 32"):
        engine.add_request("d", ids, sampling, images=[("h", 32)], image_embeddings=torch.randn(32, 576))
    with pytest.raises(ValueError, match="needs their embeddings"):
        engine.add_request("e", ids, sampling, images=[("h", 64)])


@pytest.mark.parametrize("leave_after_events", [1, 3], ids=["during-encoding", "after-first-token"])
def test_client_gone_leaves_no_frames_or_blocks(epd_server, leave_after_events):
    """A client that leaves while its image is being encoded (the first SSE event is the
    role chunk, sent before any work) or after the first token: every worker ends with no
    request outstanding, no KV block in use, and the encode worker with no frame in /dev/shm."""
    from test_serving_cleanup import stream_and_leave, wait_all_free

    body = {"model": "vlm", "messages": image_message(picture(100 + leave_after_events)), "max_tokens": 200,
            "temperature": 0, "ignore_eos": True}
    stream_and_leave(epd_server.url + "/v1/chat/completions", body, leave_after_events)
    wait_all_free(epd_server.url, timeout=30)
    pids = [epd_server.worker_pid(f"encode-{i}") for i in range(2)]

    def frames() -> list[Path]:
        return [f for pid in pids for f in Path(shm.SHM_DIR).glob(f"epdserve-kv-{pid}-*")]

    deadline = time.monotonic() + 30
    while frames() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not frames()


def test_killed_prefill_worker_retries_encode_the_images_again(tmp_path):
    """kill -9 of a prefill worker holding EPD requests whose embedding frames it may have
    read already: they are retried on the other prefill worker, which encodes the images
    itself, and every request completes with the answer an undisturbed run gives."""
    import os
    import signal
    from concurrent.futures import ThreadPoolExecutor

    dep = start_deployment("epd", tmp_path, "--model", "vlm", "--prefill-workers", "2")
    try:
        images = [picture(200 + i) for i in range(4)]
        with ThreadPoolExecutor(len(images)) as pool:
            futures = [pool.submit(ask, dep, image, max_tokens=6) for image in images]
            deadline = time.monotonic() + 120
            while not any(w["worker_id"] == "prefill-0" and w["outstanding"] for w in dep.health()["workers"]):
                assert time.monotonic() < deadline, "no request reached prefill-0"
                time.sleep(0.05)
            os.kill(dep.worker_pid("prefill-0"), signal.SIGKILL)
            results = [f.result(timeout=300) for f in futures]
        assert "retrying on prefill-1" in dep.log_tail(10**6)
        assert [r.text for r in results] == [ask(dep, image, max_tokens=6).text for image in images]
    finally:
        _stop(dep.proc)


def test_an_encode_worker_killed_while_encoding_leaves_the_images_to_the_prefill_worker(epd_server):
    """kill -9 of the encode worker holding a request's images (a large one: seconds of encoding): the
    request goes on, its prefill worker encoding the image (``--migration-limit``), the trace names the
    move, and the answer equals the one the deployment gives again afterwards."""
    import os
    import signal
    from concurrent.futures import ThreadPoolExecutor

    image = picture(300, (1536, 1536))
    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(ask, epd_server, image, max_tokens=6)
        deadline = time.monotonic() + 120
        while not (busy := [w["worker_id"] for w in epd_server.health()["workers"]
                            if w["role"] == "encode" and w["outstanding"]]):
            assert time.monotonic() < deadline and not future.done(), "no encode worker got the image"
            time.sleep(0.02)
        os.kill(epd_server.worker_pid(busy[0]), signal.SIGKILL)
        result = future.result(timeout=300)
    (move,) = epd_server.trace(result.id)["migrations"]
    assert move["from"] == busy[0] and move["to"].startswith("prefill-") and move["recomputed_tokens"] > 0
    assert f"encode worker {busy[0]} died" in epd_server.log_tail(10**6)
    assert result.text == ask(epd_server, image, max_tokens=6).text
    deadline = time.monotonic() + 120
    while sum(w["role"] == "encode" and w["state"] == "up" for w in epd_server.health()["workers"]) < 2:
        assert time.monotonic() < deadline, "the killed encode worker did not come back"
        time.sleep(0.2)
