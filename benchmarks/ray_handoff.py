"""``serve --cluster ray`` against the local launcher, on this machine:

* time to healthy of a 1P1D deployment (start of ``epdserve serve`` to ``/health`` 200 with
  both workers up): local launcher vs Ray actors on a running one-node Ray cluster
  (``ray start`` itself not counted; the ratio is Ray's over the launcher's, same run);
* KV hand-off per request for 512- and 2,048-token prompts (random token ids, so no prefix
  cache hit; ``--requests`` each, max_tokens 2), from the server trace: ``kv_bytes``,
  ``kv_transfer_ms`` (export + router hop + fetch + import) and ``kv_fetch_ms``, with GB/s
  = bytes / ms. Same node: prefill and decode actors on the head (shared memory); across
  nodes: the decode actor on a second Ray node in a network namespace joined by a veth
  pair (TCP), as tests/test_ray_multinode.py sets it up (needs root and ``ip netns``).

The machine is shared and has 2 cores: the numbers are noisy, and the veth link is a
kernel copy, not a network.

    sudo .venv/bin/python benchmarks/ray_handoff.py [--requests 3]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
from test_ray import RayNode  # noqa: E402 (the tests' Ray node: own session, own temp dir)

HEAD_IP, NODE_IP = "10.78.0.1", "10.78.0.2"
READY = re.compile(r"epdserve serve: ready at (http://\S+)")


def serve(log_path: Path, trace: Path, *flags: str) -> tuple[subprocess.Popen, str, float]:
    """Start ``epdserve serve --mode pd`` and wait for /health 200: (process, url, seconds)."""
    start = time.monotonic()
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "epdserve", "serve", "--mode", "pd", "--host", "127.0.0.1",
                                 "--port", "0", "--kv-cache-memory-mb", "256",
                                 "--trace-file", str(trace), *flags], stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    while True:
        match = READY.search(log_path.read_text(errors="replace"))
        if match and httpx.get(match[1] + "/health", timeout=10).status_code == 200:
            return proc, match[1], time.monotonic() - start
        if proc.poll() is not None or time.monotonic() - start > 600:
            stop(proc)
            raise RuntimeError(f"serve did not come up:\n{log_path.read_text()[-3000:]}")
        time.sleep(0.1)


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


def hand_offs(url: str, trace: Path, prompt_len: int, n: int, rng: random.Random) -> list[dict]:
    """``n`` requests of ``prompt_len`` random tokens; their trace records."""
    ids = []
    for _ in range(n):
        body = {"prompt": [rng.randrange(1000, 40000) for _ in range(prompt_len)], "max_tokens": 2,
                "temperature": 0, "ignore_eos": True}
        r = httpx.post(url + "/v1/completions", json=body, timeout=300)
        r.raise_for_status()
        ids.append(r.json()["id"])
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        recs = {}
        for line in trace.read_text().splitlines() if trace.exists() else []:
            rec = json.loads(line)
            recs[rec["request_id"]] = rec
        if all(i in recs for i in ids):
            return [recs[i] for i in ids]
        time.sleep(0.2)
    raise RuntimeError("trace records missing")


def row(label: str, prompt_len: int, recs: list[dict]) -> str:
    mean = lambda key: sum(r[key] for r in recs) / len(recs)  # noqa: E731
    nbytes, total, fetch = mean("kv_bytes"), mean("kv_transfer_ms"), mean("kv_fetch_ms")
    transport = {0.0: "shm", 1.0: "tcp"}[recs[0]["kv_tcp"]]
    return (f"{label:<12} {prompt_len:>6} {transport:>4} {nbytes / 2**20:>8.1f} {total:>9.1f} {fetch:>9.1f} "
            f"{nbytes / total / 1e6:>11.2f} {nbytes / fetch / 1e6:>11.2f}")


def netns() -> tuple[str, str]:
    tag = uuid.uuid4().hex[:6]
    ns, v_root, v_ns = f"epray-{tag}", f"eprh{tag}", f"eprn{tag}"
    for argv in (["ip", "netns", "add", ns], ["ip", "link", "add", v_root, "type", "veth", "peer", "name", v_ns],
                 ["ip", "link", "set", v_ns, "netns", ns], ["ip", "addr", "add", f"{HEAD_IP}/24", "dev", v_root],
                 ["ip", "link", "set", v_root, "up"], ["ip", "-n", ns, "addr", "add", f"{NODE_IP}/24", "dev", v_ns],
                 ["ip", "-n", ns, "link", "set", v_ns, "up"], ["ip", "-n", ns, "link", "set", "lo", "up"]):
        subprocess.run(argv, check=True, capture_output=True, timeout=30)
    return ns, v_root


def main() -> None:  # long: one linear script, set-up and teardown around each measurement
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=3, help="requests per prompt length and placement")
    opts = parser.parse_args()
    rng = random.Random(0)
    out = Path(tempfile.mkdtemp(prefix="ray-handoff-"))
    ns, v_root = netns()
    head = second = None
    try:
        port = 40000 + rng.randrange(1000)
        head = RayNode("--head", "--port", str(port), "--node-ip-address", HEAD_IP,
                       "--resources", json.dumps({"node_a": 4}))
        second = RayNode("--address", f"{HEAD_IP}:{port}", "--node-ip-address", NODE_IP,
                         "--resources", json.dumps({"node_b": 2}), netns=ns, num_cpus=2)
        ray = ["--cluster", "ray", "--ray-address", f"{HEAD_IP}:{port}", "--prefill-resources", "CPU=1,node_a=1"]
        healthy, lines = {}, []
        for label, flags in (("local", []), ("ray-1node", [*ray, "--decode-resources", "CPU=1,node_a=1"]),
                             ("ray-2nodes", [*ray, "--decode-resources", "CPU=1,node_b=1"])):
            trace = out / f"{label}.jsonl"
            proc, url, seconds = serve(out / f"{label}.log", trace, *flags)
            healthy[label] = seconds
            try:
                if label != "local":
                    for prompt_len in (512, 2048):
                        hand_offs(url, trace, 16, 1, rng)  # warm-up
                        lines.append(row(label, prompt_len, hand_offs(url, trace, prompt_len, opts.requests, rng)))
            finally:
                stop(proc)
        print(f"time to healthy (1P1D): local launcher {healthy['local']:.1f} s, Ray actors "
              f"{healthy['ray-1node']:.1f} s (one node, {healthy['ray-1node'] / healthy['local']:.2f}x), "
              f"{healthy['ray-2nodes']:.1f} s (two nodes)")
        print(f"\nKV hand-off per request, mean of {opts.requests} (GB/s = bytes / ms):")
        print(f"{'placement':<12} {'tokens':>6} {'via':>4} {'MiB':>8} {'xfer ms':>9} {'fetch ms':>9} "
              f"{'xfer GB/s':>11} {'fetch GB/s':>11}")
        print("\n".join(lines))
    finally:
        for node in (second, head):
            if node is not None:
                node.stop()
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        subprocess.run(["ip", "link", "del", v_root], capture_output=True)


if __name__ == "__main__":
    main()
