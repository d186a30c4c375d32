"""Wire fuzzer: 1,200 frames at the internal sockets of the 2P2D deployment (events on TCP,
an auth token) while a stream runs, and nothing gives.

Frames (seeded, so a failure repeats): to the router's events socket, random bytes, random
msgpack values, and epdserve messages mutated field by field, unsealed, sealed with another
token, and sealed with the deployment's token (a token holder's malformed or mischievous
frames: unknown workers and requests, absurd numbers, wrong incarnations, incompatible
Hellos naming loopback addresses only); to every worker's command socket, the same kinds
of frames and commands sealed for another process.

Afterwards: every worker is up (none was taken for dead, none restarted), the router
answers and renders /metrics, the stream beside the fuzzing completed with its ITL p99
within 2x of a control run (or 100 ms of it on this noisy machine), and no request, KV
block or frame is left.
"""

from __future__ import annotations

import random
import secrets
import statistics
import time

import httpx
import msgpack
import pytest
import zmq

from conftest import AUTH_TOKEN
from test_faults_channels import assert_serves
from test_faults_workers import Stream, all_up, wait_for
from test_serving_cleanup import wait_all_free

from epdserve.serving.auth import Keyring

pytestmark = pytest.mark.fuzz

SEED = 20261201
EVENT_FRAMES = 800
COMMAND_FRAMES = 100  # per worker, 4 workers
PROMPT = "Write a long story about a lighthouse keeper and the ships she watched,"


def _random_value(rng: random.Random, depth: int = 0):
    kind = rng.randrange(9 if depth < 3 else 6)
    if kind == 0:
        return None
    if kind == 1:
        return rng.choice([True, False])
    if kind == 2:
        return rng.choice([0, -1, 1, 2**31, 2**63 - 1, -2**63, 2**64 - 1, rng.randrange(-10**6, 10**6)])
    if kind == 3:
        return rng.choice([0.0, -0.0, 1e-300, 1e300, float("inf"), float("-inf"), float("nan"), rng.random()])
    if kind == 4:
        return "".join(chr(rng.randrange(32, 0x2FFF)) for _ in range(rng.randrange(0, 40)))
    if kind == 5:
        return rng.randbytes(rng.randrange(0, 64))
    if kind == 6:
        return [_random_value(rng, depth + 1) for _ in range(rng.randrange(0, 6))]
    if kind == 7:
        return {str(_random_value(rng, depth + 1))[:20]: _random_value(rng, depth + 1) for _ in range(rng.randrange(0, 5))}
    return [rng.randrange(0, 50000) for _ in range(rng.choice([0, 1, 10, 5000]))]


def _event_templates(rng: random.Random, workers: list[str]) -> list[dict]:
    """Well-formed worker messages that must do nothing harmful: unknown requests, unknown
    or misnamed workers, wrong incarnations, incompatible Hellos at loopback addresses."""
    rid = f"cmpl-fuzz-{secrets.token_hex(6)}"
    worker = rng.choice(workers + ["fuzz-worker"])
    addr = rng.choice(["ipc:///tmp/epdserve-fuzz-nowhere", f"tcp://127.0.0.1:{rng.randrange(20000, 60000)}"])
    return [
        {"type": "heartbeat", "worker_id": worker, "incarnation": secrets.token_hex(8)},
        {"type": "stats", "worker_id": worker, "blocks_total": rng.choice([0, -5, 2**40]),
         "blocks_in_use": rng.choice([-1, 10**9]), "num_running": -3, "num_waiting": 2**31,
         "num_preemptions": -1, "prefix_cache_queries": -7, "prefix_cache_hits": 10**12},
        {"type": "output", "worker_id": worker, "request_id": rid, "token_ids": [rng.randrange(0, 50000)] * 3,
         "finished": rng.choice([True, False]), "finish_reason": rng.choice([None, "stop", "length", "bogus"])},
        {"type": "output", "worker_id": worker, "request_id": rid, "token_ids": [],
         "kv": {"kind": "pool", "name": "epdserve-kvpool-1-" + "0" * 32, "num_tokens": 16, "nbytes": 10,
                "host_id": "x", "block_runs": [[0, 1]], "pool_blocks": 1, "tag": 1}},
        {"type": "error", "worker_id": worker, "request_id": rid, "message": "fuzz", "status": 500},
        {"type": "encoded", "worker_id": worker, "request_id": rid,
         "frame": {"name": "epdserve-kv-1-" + "0" * 32, "num_tokens": 1, "nbytes": 1, "host_id": "x"}},
        {"type": "hello", "worker_id": rng.choice(workers + [f"fuzz-{rng.randrange(100)}"]),
         "role": rng.choice(["decode", "prefill", "encode", "colocated"]), "addr": addr, "model": "fuzz",
         "fingerprint": "0" * 16, "kv_layout": {"num_layers": 1}, "blocks_total": 1,
         "incarnation": secrets.token_hex(8)},
    ]


def _command_templates(rng: random.Random) -> list[dict]:
    rid = f"cmpl-fuzz-{secrets.token_hex(6)}"
    return [
        {"type": "abort", "request_id": rid},
        {"type": "release_kv", "request_id": rid},
        {"type": "shutdown"},
        {"type": "refused", "reason": "fuzz", "incarnation": secrets.token_hex(8)},
        {"type": "reset", "incarnation": secrets.token_hex(8)},
        {"type": "add", "request_id": rid, "prompt_token_ids": [1, 2, 3], "sampling": {"max_tokens": 4}},
        {"type": "encode", "request_id": rid, "images": [{"hash": "0" * 64, "tokens": 1, "data": b"x"}]},
    ]


def _mutate(rng: random.Random, message: dict) -> dict:
    """The message with 0-2 fields replaced by random values, dropped, or one field added."""
    message = dict(message)
    for _ in range(rng.randrange(0, 3)):
        key = rng.choice(list(message))
        action = rng.randrange(3)
        if action == 0:
            message[key] = _random_value(rng)
        elif action == 1 and key != "type":
            del message[key]
        else:
            message[str(_random_value(rng))[:12]] = _random_value(rng)
    return message


def _frames(rng: random.Random, count: int, templates, purpose: str) -> list[bytes]:
    """``count`` frames: a fifth random bytes, a fifth random msgpack, the rest messages
    (mutated or not) unsealed, sealed with another token, or sealed with the right one for
    ``purpose`` (commands: for another process)."""
    right, wrong = Keyring(AUTH_TOKEN).sealer(purpose, secrets.token_hex(8)), Keyring("not-the-token").sealer(purpose)
    frames = []
    for _ in range(count):
        roll = rng.random()
        if roll < 0.2:
            frames.append(rng.randbytes(rng.choice([0, 1, 47, 48, 49, 200, 5000])))
            continue
        if roll < 0.4:
            body = msgpack.packb(_random_value(rng), use_bin_type=True)
        else:
            message = rng.choice(templates(rng))
            body = msgpack.packb(_mutate(rng, message) if rng.random() < 0.5 else message, use_bin_type=True)
        frames.append(rng.choice([lambda b: b, wrong.seal, right.seal])(body))
    return frames


def _send(ctx: zmq.Context, addr: str, frames: list[bytes]) -> None:
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 5000)
    sock.connect(addr)
    for i, frame in enumerate(frames):
        sock.send(frame)
        if i % 10 == 9:
            time.sleep(0.03)  # spread over the stream's life, not one burst before its next token
    sock.close()


def _itl_p99_ms(stream: Stream) -> float:
    times = [t for t, _ in stream.events]
    gaps = sorted((b - a) * 1000 for a, b in zip(times[1:], times[2:]))  # from token 2: no TTFT
    return gaps[min(len(gaps) - 1, int(0.99 * len(gaps)))]


def test_fuzzed_frames_change_nothing(xpyd_server):
    dep = xpyd_server
    wait_for(lambda: all_up(dep), 120, "every worker up")
    health = dep.health()
    workers = {w["worker_id"]: w["addr"] for w in health["workers"] if w["state"] == "up"}
    pids = {w: dep.worker_pid(w) for w in workers}

    control = Stream(dep.url, PROMPT, 100)
    control.start()
    control.join(300)
    assert control.failure is None and control.error is None

    rng = random.Random(SEED)
    events = _frames(rng, EVENT_FRAMES, lambda r: _event_templates(r, list(workers)), "events")
    commands = {w: _frames(rng, COMMAND_FRAMES, _command_templates, "commands") for w in workers}
    stream = Stream(dep.url, PROMPT, 100)
    stream.start()
    wait_for(lambda: len(stream.events) >= 2, 60, "the stream's first tokens")
    ctx = zmq.Context()
    try:
        t0 = time.monotonic()
        _send(ctx, dep.events, events)
        for worker, addr in workers.items():
            _send(ctx, addr, commands[worker])
        sent = len(events) + sum(map(len, commands.values()))
        took = time.monotonic() - t0
    finally:
        ctx.destroy(linger=0)
    stream.join(300)
    assert stream.failure is None and stream.error is None, stream.error
    assert stream.events[-1][1]["choices"][0]["finish_reason"] == "length"

    base, during = _itl_p99_ms(control), _itl_p99_ms(stream)
    print(f"\n{sent} frames in {took:.1f} s; stream ITL p99 {during:.0f} ms beside them, {base:.0f} ms alone")
    assert sent >= 1000
    assert during <= max(2 * base, base + 100), f"ITL p99 {during:.0f} ms, control {base:.0f} ms"
    time.sleep(1.5)  # heartbeats: a worker taken for dead would show now
    after = dep.health()
    assert {w["worker_id"]: w["state"] for w in after["workers"] if w["worker_id"] in workers} == \
        {w: "up" for w in workers}, after["workers"]
    assert {w: dep.worker_pid(w) for w in workers} == pids, "a worker exited or was restarted"
    assert not any(w["worker_id"].startswith("fuzz") and w["state"] == "up" for w in after["workers"])
    assert httpx.get(dep.url + "/metrics", timeout=10).status_code == 200
    log = dep.log_tail(10**8)
    assert "dropped a frame on the events socket" in log  # the fuzz reached the checks
    for _ in range(2):
        assert_serves(dep)
    wait_all_free(dep.url)
    assert dep.health()["requests_in_flight"] == 0
