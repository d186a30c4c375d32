"""KV over TCP (ZeroMQ): the frame a prefill worker serves equals its shared-memory frame,
bad replies and silence are errors, and a decode worker on another "host" (a network
namespace joined by a veth pair) gets the KV over TCP and generates what a colocated
engine generates."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest
import torch
import zmq

from epdserve.serving.protocol import KVDescriptor
from epdserve.transfer import handoff, shm, tcp
from epdserve.transfer.wire import TensorHeader, TensorSpec, WireError

LAYOUT = {"num_layers": 2, "num_kv_heads": 3, "head_dim": 8, "block_size": 4, "dtype": "float32"}


@pytest.fixture
def ctx():
    context = zmq.Context()
    yield context
    context.destroy(linger=0)


def _segment(request_id: str = "r1") -> tuple[str, torch.Tensor, int]:
    """A /dev/shm frame of random KV (2 blocks); returns its name, the tensor and file size."""
    kv = torch.randn(2, 2, 2, 4, 3, 8)
    header = TensorHeader(tensors=[TensorSpec(name="kv", dtype="float32", shape=list(kv.shape))],
                          num_tokens=8, layout=LAYOUT)
    name = shm.new_name()
    nbytes = shm.write(name, header, lambda views: views["kv"].copy_(kv))
    return name, kv, nbytes


def _serve_if(allowed: bool, name: str):
    """A KV server source serving segment ``name`` when ``allowed``."""
    if not allowed:
        raise WireError(f"no KV segment {name}")
    return shm.open_segment(name)


def test_frame_over_tcp_equals_shm_frame(ctx):
    name, kv, nbytes = _segment()
    on_disk = (shm.SHM_DIR / name).read_bytes()
    server = tcp.KVServer(ctx, "tcp://127.0.0.1:0", lambda rid, n: _serve_if((rid, n) == ("r1", name), n))
    try:
        with pytest.raises(WireError, match="no KV segment"):
            tcp.fetch(ctx, server.addr, "other-request", name, nbytes, timeout_s=5)
        header, got = tcp.fetch(ctx, server.addr, "r1", name, nbytes, timeout_s=5)
        assert header.layout == LAYOUT and header.num_tokens == 8
        assert torch.equal(got["kv"], kv)
        assert len(on_disk) == nbytes
        assert not (shm.SHM_DIR / name).exists(), "a served segment is unlinked"
        with pytest.raises(WireError, match="gone"):
            tcp.fetch(ctx, server.addr, "r1", name, nbytes, timeout_s=5)
    finally:
        server.close()
        shm.remove(name)


def _fake_server(ctx, reply: list[bytes] | None) -> tuple[str, threading.Thread]:
    """A ROUTER that answers one request with ``reply`` (or never, if None)."""
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind("tcp://127.0.0.1:*")
    addr = sock.getsockopt_string(zmq.LAST_ENDPOINT)

    def serve():
        if sock.poll(5000) and reply is not None:
            identity, _ = sock.recv_multipart()
            sock.send_multipart([identity, *reply])
        time.sleep(0.5 if reply is None else 0)
        sock.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return addr, thread


@pytest.mark.parametrize("reply,nbytes,match", [
    ([b"ok", b"EPDW" + b"\0" * 60], 128, "is 64 bytes, expected 128"),
    ([b"ok", b"\x80\x04pickle" + b"\0" * 56], 64, "not an epdserve frame"),
    ([b"maybe", b"x"], 64, "not \\[status, body\\]"),
    ([b"error", b"segment is gone"], 64, "segment is gone"),
])
def test_bad_reply_is_rejected(ctx, reply, nbytes, match):
    addr, thread = _fake_server(ctx, reply)
    with pytest.raises(WireError, match=match):
        tcp.fetch(ctx, addr, "r1", shm.new_name(), nbytes, timeout_s=5)
    thread.join()


def test_timeout_is_a_clear_error(ctx):
    addr, thread = _fake_server(ctx, None)
    start = time.monotonic()
    with pytest.raises(WireError, match=r"no KV from .* within 0.3 s"):
        tcp.fetch(ctx, addr, "r1", shm.new_name(), 1024, timeout_s=0.3)
    assert time.monotonic() - start < 3
    thread.join()


@pytest.mark.parametrize("transport,host,tcp_used", [
    ("auto", "same", False), ("auto", "other", True), ("tcp", "same", True), ("shm", "same", False)])
def test_importer_picks_the_transport(ctx, transport, host, tcp_used):
    name, kv, nbytes = _segment()
    server = tcp.KVServer(ctx, "tcp://127.0.0.1:0", lambda rid, n: _serve_if(n == name, n))
    try:
        host_id = handoff.host_id() if host == "same" else "another-host"
        desc = KVDescriptor(name=name, num_tokens=8, nbytes=nbytes, host_id=host_id, addr=server.addr)
        got, timings = handoff.Importer(ctx, transport, 5).take("r1", desc, LAYOUT, torch.float32)
        assert torch.equal(got.kv, kv)
        assert timings.kv_tcp == float(tcp_used) and timings.kv_fetch_ms >= 0
    finally:
        server.close()
        shm.remove(name)


def test_importer_refuses_shm_from_another_host_and_a_wrong_layout(ctx):
    name, kv, nbytes = _segment()
    try:
        desc = KVDescriptor(name=name, num_tokens=8, nbytes=nbytes, host_id="another-host", addr=None)
        with pytest.raises(WireError, match="another host"):
            handoff.Importer(ctx, "shm", 5).take("r1", desc, LAYOUT, torch.float32)
        with pytest.raises(WireError, match="serves no TCP address"):
            handoff.Importer(ctx, "auto", 5).take("r1", desc, LAYOUT, torch.float32)
        desc = desc.model_copy(update={"host_id": handoff.host_id()})
        with pytest.raises(ValueError, match="layout"):
            handoff.Importer(ctx, "auto", 5).take("r1", desc, dict(LAYOUT, block_size=16), torch.float32)
    finally:
        shm.remove(name)


# --- two hosts: network namespaces joined by a veth pair ---------------------------------

ROOT = Path(__file__).resolve().parent.parent
PROMPT = "The lighthouse keeper climbed the spiral stairs every evening at dusk, and"
MAX_TOKENS = 12


def _sh(*argv: str) -> None:
    subprocess.run(argv, check=True, capture_output=True, timeout=30)


@pytest.fixture
def two_hosts():
    """Namespaces (ns1 10.77.0.1, ns2 10.77.0.2) joined by a veth pair; removed afterwards."""
    if shutil.which("ip") is None or os.geteuid() != 0:
        pytest.skip("needs root and iproute2 to create network namespaces")
    tag = uuid.uuid4().hex[:6]
    ns1, ns2, v1, v2 = f"epd1-{tag}", f"epd2-{tag}", f"epv1{tag}", f"epv2{tag}"
    probe = subprocess.run(["ip", "netns", "add", ns1], capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"ip netns add is not permitted here: {probe.stderr.strip()}")
    try:
        _sh("ip", "netns", "add", ns2)
        _sh("ip", "link", "add", v1, "type", "veth", "peer", "name", v2)
        for ns, dev, ip in ((ns1, v1, "10.77.0.1/24"), (ns2, v2, "10.77.0.2/24")):
            _sh("ip", "link", "set", dev, "netns", ns)
            _sh("ip", "-n", ns, "addr", "add", ip, "dev", dev)
            _sh("ip", "-n", ns, "link", "set", dev, "up")
            _sh("ip", "-n", ns, "link", "set", "lo", "up")
        yield ns1, ns2
    finally:
        for ns in (ns1, ns2):  # deleting a namespace deletes its end of the veth pair
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def _reference_tokens(prompt_ids: list[int]) -> list[int]:
    from epdserve.engine.engine import LLMEngine
    from epdserve.engine.request import SamplingParams
    from epdserve.model.loader import resolve_model

    engine = LLMEngine(str(resolve_model(None).path))
    engine.add_request("ref", prompt_ids, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))
    tokens = []
    while engine.has_unfinished():
        tokens += [t for out in engine.step() for t in out.token_ids]
    return tokens


@pytest.mark.server
def test_decode_worker_on_another_host_gets_kv_over_tcp(two_hosts, tokenizer, tmp_path):
    ns1, ns2 = two_hosts
    py = sys.executable
    events, http = "tcp://10.77.0.1:5700", "10.77.0.1"
    common = ["--router", events, "--kv-cache-memory-mb", "64", "--cores", ",".join(
        map(str, sorted(os.sched_getaffinity(0))[:1]))]
    commands = {
        "router": [ns1, py, "-m", "epdserve", "router", "--mode", "pd", "--events", events, "--host", http,
                   "--port", "8700", "--trace-file", str(tmp_path / "trace.jsonl")],
        "prefill": [ns1, py, "-m", "epdserve", "worker", "--role", "prefill", "--worker-id", "prefill-0",
                    "--bind", "tcp://10.77.0.1:5701", "--kv-bind", "tcp://10.77.0.1:5702", *common],
        "decode": [ns2, py, "-m", "epdserve", "worker", "--role", "decode", "--worker-id", "decode-0",
                   "--bind", "tcp://10.77.0.2:5701", *common],
    }
    procs: dict[str, subprocess.Popen] = {}
    logs = {name: tmp_path / f"{name}.log" for name in commands}
    try:
        for name, (ns, *argv) in commands.items():
            with open(logs[name], "w") as log:
                procs[name] = subprocess.Popen(["ip", "netns", "exec", ns, *argv], cwd=ROOT, stdout=log,
                                               stderr=subprocess.STDOUT, start_new_session=True,
                                               env=dict(os.environ, EPDSERVE_AUTH_TOKEN="two-hosts-token"))
        prompt_ids = tokenizer(PROMPT).input_ids
        expected = _reference_tokens(prompt_ids)
        # The client runs inside ns1 too: no traffic leaves the two namespaces.
        client = ("import httpx, json, sys, time\n"
                  "deadline = time.monotonic() + 240\n"
                  "while True:\n"
                  "    try:\n"
                  "        if httpx.get('http://10.77.0.1:8700/health', timeout=5).status_code == 200: break\n"
                  "    except httpx.HTTPError: pass\n"
                  "    if time.monotonic() > deadline: sys.exit('router never became healthy')\n"
                  "    time.sleep(0.5)\n"
                  "r = httpx.post('http://10.77.0.1:8700/v1/completions', timeout=120, json={\n"
                  f"    'prompt': {prompt_ids!r}, 'max_tokens': {MAX_TOKENS},\n"
                  "    'temperature': 0, 'ignore_eos': True})\n"
                  "print(r.text)\n")
        result = subprocess.run(["ip", "netns", "exec", ns1, py, "-c", client], capture_output=True, text=True,
                                timeout=300)
        diagnostics = "\n".join(f"--- {n}\n{p.read_text()[-2000:]}" for n, p in logs.items())
        assert result.returncode == 0, result.stderr + diagnostics
        body = json.loads(result.stdout)
        assert "choices" in body, result.stdout + diagnostics
        assert body["choices"][0]["text"] == tokenizer.decode(expected), diagnostics
        trace = json.loads((tmp_path / "trace.jsonl").read_text().splitlines()[-1])
        assert trace["kv_tcp"] == 1.0 and trace["kv_bytes"] > 0, trace
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, 15)
        for proc in procs.values():
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, 9)
                proc.wait(5)
