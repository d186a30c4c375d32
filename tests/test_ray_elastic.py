"""``epdserve serve --cluster ray --elastic`` on a real one-node Ray cluster, with the
``openai`` client:

* two elastic workers as Ray actors switch to 1P1D by ``POST /roles`` under a steady
  stream (no failed request, greedy texts unchanged);
* the decode worker's actor process is killed (kill -9) after it announced decode: Ray
  restarts the actor with its first arguments (colocated) and the router switches it back
  at its Hello, so it is a decode worker again (/health and the trace's ``role`` lines);
* ``POST /workers`` adds a third actor (``worker-2``, a placement group of its own) that
  takes decodes with the same greedy text as the colocated engine; at ``--max-workers 3``
  another is refused (409); ``DELETE /workers/worker-2`` retires it under the stream: no
  failed request, every KV block free, its actor and placement group gone (the cluster's
  CPUs back to the two starting workers'), ``epdserve:workers`` and
  ``epdserve:worker_scale_total`` count it;
* bad bodies and bounds: 400, 404, 409 with OpenAI-style bodies;
* the controller itself (a 4 s window, TTFT SLO 1 ms, one sequence per engine): a stream
  that keeps every worker's queue non-empty adds ``worker-2``; once the stream stops, the
  low load retires it; no request fails.
"""

from __future__ import annotations

import json
import os
import signal
import time

import httpx
import pytest

from conftest import _stop
from test_elastic_serve import PROMPTS, Stream, _complete, _events, _switch, _wait, _workers
from test_ray import cluster_status, one_node, ray_deployment, wait_for

pytestmark = pytest.mark.elastic


@pytest.fixture(scope="module")
def ray_head():
    """A one-node Ray cluster of 6 logical CPUs (the module's first deployment keeps its 2
    workers while the controller's deployment runs up to 3); its address."""
    yield from one_node(6)


@pytest.fixture(scope="module")
def elastic_ray(ray_head, tmp_path_factory):
    dep = ray_deployment("colocated", tmp_path_factory.mktemp("ray-elastic"), ray_head, "--workers", "2",
                         "--elastic", "--elastic-interval", "0", "--max-workers", "3")
    try:
        yield dep
    finally:
        _stop(dep.proc)


def _under_stream(dep, expected: dict, action) -> list:
    """Run ``action()`` while two clients stream the prompts; every result, checked: none
    failed, every greedy text as ``expected``."""
    stream = Stream(dep)
    try:
        time.sleep(2.0)  # requests in flight when the action comes
        action()
        time.sleep(2.0)
    finally:
        results = stream.end()
    failed = [(p, r) for p, r in results if isinstance(r, Exception)]
    assert not failed, failed[:3]
    changed = [(p, r) for p, r in results if r != expected[p]]
    assert not changed, changed[:3]
    return results


def test_switch_kill_add_and_retire_on_ray(elastic_ray, ray_head):
    dep = elastic_ray
    expected = {p: _complete(dep, p).text for p in PROMPTS}  # two colocated workers: the colocated engine's text
    ws = _workers(dep)
    assert ws["worker-1"]["resources"] == {"CPU": 1.0} and len(ws["worker-1"]["node_id"]) > 16

    def to_1p1d():
        _switch(dep, "worker-0", "prefill")
        _switch(dep, "worker-1", "decode")
        _wait(lambda: [_workers(dep)[w]["announced_role"] for w in ("worker-0", "worker-1")] == ["prefill", "decode"],
              "1P1D")
    _under_stream(dep, expected, to_1p1d)

    # Kill the decode worker's actor process: Ray restarts it as colocated (its arguments),
    # the router switches it back to decode at its Hello.
    old_pid, before = _workers(dep)["worker-1"]["pid"], len(_events(dep, "role"))
    os.kill(old_pid, signal.SIGKILL)
    t_kill = time.monotonic()
    _wait(lambda: any(e["worker"] == "worker-1" and e["state"] == "switched" for e in _events(dep, "role")[before:]),
          "Ray to restart worker-1 and the router to switch it back", 180)
    after = [(e["state"], e["role"], e["reason"]) for e in _events(dep, "role")[before:] if e["worker"] == "worker-1"]
    assert after == [("up", "colocated", None),
                     ("switching", "decode", "restarted: back to its last announced role decode"),
                     ("switched", "decode", "restarted: back to its last announced role decode")], after
    w = _workers(dep)["worker-1"]
    assert (w["state"], w["role"], w["announced_role"], w["switching"]) == ("up", "decode", "decode", False)
    assert w["pid"] != old_pid
    print(f"\nkill -9 worker-1 (decode): back as decode after {time.monotonic() - t_kill:.1f} s")

    # Add a decode worker: its own actor and placement group.
    t_add = time.monotonic()
    r = httpx.post(dep.url + "/workers", json={"role": "decode", "reason": "test"}, timeout=10)
    assert r.status_code == 200 and r.json() == {"worker_id": "worker-2", "state": "starting", "role": "decode"}, r.text
    r = httpx.post(dep.url + "/workers", json={"role": "decode"}, timeout=10)  # worker-2 counts while it starts
    assert r.status_code == 409 and "--max-workers 3 reached" in r.json()["error"]["message"], r.text
    _wait(lambda: _workers(dep).get("worker-2", {}).get("state") == "up", "worker-2 up", 180)
    assert _workers(dep)["worker-2"]["role"] == "decode"
    print(f"POST /workers: worker-2 up after {time.monotonic() - t_add:.1f} s")
    wait_for(lambda: " 3.0/6.0 CPU" in cluster_status(ray_head), 30, "three actors on the cluster")

    def retire_once_it_decodes():
        _wait(lambda: any(e.get("decode_worker") == "worker-2" for e in _trace(dep)), "worker-2 decoding", 60)
        t_delete = time.monotonic()
        r = httpx.delete(dep.url + "/workers/worker-2", timeout=10)
        assert r.status_code == 200 and r.json()["state"] == "retiring", r.text
        _wait(lambda: "worker-2" not in _workers(dep), "worker-2 retired", 120)
        print(f"DELETE /workers/worker-2: removed after {time.monotonic() - t_delete:.1f} s")
    results = _under_stream(dep, expected, retire_once_it_decodes)
    print(f"{len(results)} requests under the stream around the retirement, none failed")

    states = [e["state"] for e in _events(dep, "role") if e["worker"] == "worker-2"]
    assert states == ["starting", "up", "retiring", "removed"], states
    _wait(lambda: all(w["blocks_in_use"] == 0 and w["outstanding"] == 0 for w in _workers(dep).values()),
          "every KV block free", 30)
    wait_for(lambda: " 2.0/6.0 CPU" in cluster_status(ray_head), 60, "worker-2's actor and placement group gone")
    metrics = httpx.get(dep.url + "/metrics", timeout=10).text
    assert 'epdserve:workers{engine="router",model_name="' in metrics and 'state="live"} 2.0' in metrics
    for direction in ("in", "out"):
        assert any(line.startswith("epdserve:worker_scale_total{") and f'direction="{direction}"' in line
                   and line.endswith(" 1.0") for line in metrics.splitlines()), direction


def _trace(dep) -> list[dict]:
    return [json.loads(line) for line in dep.trace_path.read_text().splitlines()]


def test_bad_worker_requests(elastic_ray):
    """OpenAI-style 400/404/409 bodies; nothing added or retired."""
    dep = elastic_ray
    before = sorted(_workers(dep))
    for method, path, body, status in [
        ("POST", "/workers", {"role": "encode"}, 400), ("POST", "/workers", {"role": "decode", "extra": 1}, 400),
        ("POST", "/workers", {}, 400), ("DELETE", "/workers/nope", None, 404),
        ("DELETE", "/workers/worker-0", None, 409),  # the minimum: the starting workers
    ]:
        r = httpx.request(method, dep.url + path, json=body, timeout=10)
        assert r.status_code == status and "message" in r.json()["error"], (method, path, body, r.status_code, r.text)
    assert sorted(_workers(dep)) == before


def test_the_controller_scales_out_under_saturation_and_back_in(ray_head, tmp_path):
    dep = ray_deployment("colocated", tmp_path, ray_head, "--workers", "2", "--elastic", "--max-workers", "3",
                         "--max-num-seqs", "1", "--slo", "ttft:1", "tpot:100000", "--elastic-window", "4",
                         "--elastic-interval", "1", "--elastic-min-dwell", "2")
    try:
        expected = {p: _complete(dep, p).text for p in PROMPTS}
        streams = [Stream(dep) for _ in range(3)]  # 6 clients, 1 running per engine: >= 1 waiting on each
        try:
            _wait(lambda: _workers(dep).get("worker-2", {}).get("state") == "up", "the controller to add worker-2",
                  180)
        finally:
            results = [r for stream in streams for r in stream.end()]
        _wait(lambda: "worker-2" not in _workers(dep), "the controller to retire worker-2 at low load", 120)
        failed = [(p, r) for p, r in results if isinstance(r, Exception)]
        assert not failed, failed[:3]
        assert all(r == expected[p] for p, r in results)
        decisions = [e for e in _trace(dep) if e.get("event") == "elastic_decision"]
        assert [(d["action"], d["role"], d["worker"]) for d in decisions] == \
            [("scale-out", "colocated", None), ("scale-in", None, "worker-2")], decisions
        assert "saturated" in decisions[0]["reason"] and decisions[0]["signals"]["ttft_p90_ms"] > 1
        assert "in flight per worker" in decisions[1]["reason"]
        print(f"\ncontroller: {decisions[0]['reason']}\n            {decisions[1]['reason']}")
        states = [e["state"] for e in _events(dep, "role") if e["worker"] == "worker-2"]
        assert states == ["starting", "up", "retiring", "removed"], states
    finally:
        _stop(dep.proc)
