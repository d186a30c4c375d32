"""The internal channels refuse what they must: a pickle frame on the router's events
socket or a worker's command socket is logged and dropped, never unpickled (with a token
it fails authentication before anything parses it); a worker with other weights, or whose
KV layout cannot exchange blocks with the deployment's, is refused at Hello (it exits
with status 2, /health lists it as refused with the reason) and never routed to; one
without the auth token is not even answered (its frames are dropped unread); internal
sockets default to 127.0.0.1. The 2P2D deployment keeps serving throughout."""

from __future__ import annotations

import argparse
import json
import os
import pickle
import re
import subprocess
import sys
import time

import httpx
import pytest
import zmq

from conftest import AUTH_TOKEN
from epdserve.serving import protocol as P
from epdserve.serving.auth import Keyring
from epdserve.serving.router.zmq_port import ZmqPort

pytestmark = pytest.mark.faults


class Exploit:
    """Unpickling this creates ``path``: proof that someone unpickled it."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


def assert_serves(dep) -> None:
    r = httpx.post(dep.url + "/v1/completions", json={"prompt": "The sky is", "max_tokens": 3,
                                                      "temperature": 0, "ignore_eos": True}, timeout=120)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3


def wait_log(dep, text: str, timeout: float = 10.0) -> None:
    import time

    deadline = time.monotonic() + timeout
    while text not in dep.log_tail(10**7):
        assert time.monotonic() < deadline, f"{text!r} not in the log"
        time.sleep(0.1)


def test_pickle_frames_rejected(xpyd_server, tmp_path):
    dep = xpyd_server
    marker = tmp_path / "unpickled"
    frame = pickle.dumps(Exploit(str(marker)))
    worker_addr = next(w["addr"] for w in dep.health()["workers"] if w["worker_id"] == "decode-1")
    ctx = zmq.Context()
    try:
        for addr in (dep.events, worker_addr):
            sock = ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 2000)
            sock.connect(addr)
            sock.send(frame)
            sock.close()
    finally:
        ctx.term()
    wait_log(dep, "dropped a frame on the events socket: it failed authentication")
    wait_log(dep, "decode-1: dropped a command frame: it failed authentication")
    assert not marker.exists()
    assert all(w["state"] == "up" for w in dep.health()["workers"] if w["worker_id"].startswith("decode"))
    assert_serves(dep)


def start_worker(dep, tmp_path, worker_id: str, token: str, *extra: str) -> subprocess.Popen:
    argv = [sys.executable, "-m", "epdserve", "worker", "--role", "decode", "--router", dep.events,
            "--bind", f"ipc://{tmp_path}/{worker_id}", "--worker-id", worker_id, "--cores", "1",
            "--kv-cache-memory-mb", "32", *extra]
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=dict(os.environ, EPDSERVE_AUTH_TOKEN=token))


def other_model(model_info, directory) -> str:
    """The served model's files with another rope_theta: same shapes, other weights' meaning."""
    directory.mkdir()
    for f in model_info.path.iterdir():
        if f.name != "config.json":
            (directory / f.name).symlink_to(f)
    config = json.loads((model_info.path / "config.json").read_text())
    config["rope_theta"] = config.get("rope_theta", 10000.0) * 2
    (directory / "config.json").write_text(json.dumps(config))
    return str(directory)


def test_incompatible_workers_refused(xpyd_server, model_info, tmp_path):
    dep = xpyd_server
    procs = {"rogue-layout": start_worker(dep, tmp_path, "rogue-layout", AUTH_TOKEN, "--block-size", "32"),
             "rogue-auth": start_worker(dep, tmp_path, "rogue-auth", "wrong-token"),
             "rogue-model": start_worker(dep, tmp_path, "rogue-model", AUTH_TOKEN, "--model",
                                         other_model(model_info, tmp_path / "model"))}
    answered = ("rogue-layout", "rogue-model")
    try:
        outs = {wid: procs[wid].communicate(timeout=180)[0] for wid in answered}
        wait_log(dep, "dropped a frame on the events socket: it failed authentication", 60)
        unanswered = procs["rogue-auth"].poll() is None  # its Hello was dropped unread: nothing comes back
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
    for wid in answered:
        assert procs[wid].returncode == 2, outs[wid]
        assert "refused by the router" in outs[wid]
    assert unanswered
    refused = {w["worker_id"]: w for w in dep.health()["workers"] if w["state"] == "refused"}
    layout = refused["rogue-layout"]["reason"]
    assert "'block_size': 32" in layout and "'block_size': 16" in layout and "prefill-" in layout
    assert "fingerprint" in refused["rogue-model"]["reason"]
    assert "rogue-auth" not in {w["worker_id"] for w in dep.health()["workers"]}
    log = dep.log_tail(10**7)
    assert all(f"refused worker {wid}" in log for wid in answered)
    assert re.search(r'^epdserve:worker_up\{engine="rogue-layout",model_name="[^"]+",role="decode",'
                     r'worker="rogue-layout"\} 0\.0$',
                     httpx.get(dep.url + "/metrics").text, re.M)
    for _ in range(4):  # with two live decode workers, none of these may land on a refused one
        assert_serves(dep)
    assert dep.health()["status"] == "ok"


def test_internal_sockets_default_to_loopback():
    from epdserve.serving.launch import launcher
    from epdserve.serving import router
    from epdserve.serving.worker import engine_worker as worker

    for module in (launcher, router):
        parser = argparse.ArgumentParser()
        module.add_arguments(parser)
        args = parser.parse_args([])
        assert args.host == "127.0.0.1"
        assert args.events is None or args.events.startswith("tcp://127.0.0.1:")  # serve: private ipc
    parser = argparse.ArgumentParser()
    worker.add_arguments(parser)
    args = parser.parse_args(["--role", "decode", "--router", "x", "--bind", "y", "--worker-id", "z"])
    assert all(v.startswith("tcp://127.0.0.1:") for k, v in vars(args).items()
               if k.endswith("bind") and k != "bind" and isinstance(v, str))


def test_a_closed_command_connection_is_reported_once(tmp_path):
    """ZmqPort.lost: a worker's command connection that closes after it was made (the
    worker's process died: the kernel closes its sockets) is reported once; one never
    made (nothing listens yet) is not; one that is replaced is not watched any more."""
    def wait_lost(port: ZmqPort, seconds: float) -> list[str]:
        deadline, seen = time.monotonic() + seconds, []
        while time.monotonic() < deadline and not seen:
            seen = port.lost()
            time.sleep(0.05)
        return seen

    ctx, port = zmq.Context(), ZmqPort(Keyring(AUTH_TOKEN))
    try:
        port.connect("w-never", f"ipc://{tmp_path}/nobody", "a" * 16)
        pull = ctx.socket(zmq.PULL)
        pull.bind(f"ipc://{tmp_path}/w0")
        port.connect("w0", f"ipc://{tmp_path}/w0", "b" * 16)
        port.send("w0", P.Shutdown())
        assert pull.poll(5000)  # connected: a command arrived
        assert port.lost() == []
        pull.close(linger=0)  # the worker is gone
        assert wait_lost(port, 5.0) == ["w0"]
        assert wait_lost(port, 0.5) == []  # once, though ZeroMQ keeps trying to reconnect
        port.connect("w0", f"ipc://{tmp_path}/w0-new", "c" * 16)  # its new process
        assert wait_lost(port, 0.5) == []
    finally:
        port.close()
        ctx.destroy(linger=0)
