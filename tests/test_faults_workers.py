"""Worker faults on the 2P2D deployment, with real processes and kill -9: nothing hangs,
nothing leaks, and the launcher brings the worker back.

* a decode worker killed mid-stream: its stream ends with an error event within 5 s, a
  stream on the other decode worker completes, /health shows the worker down then up,
  and the first request after the restart gives the same text as before;
* a prefill worker killed with requests queued on it: they are retried on the other
  prefill worker and complete; afterwards every worker's KV blocks in use are 0;
* a 1,600-token prefill (seconds in one engine step) is not taken for a dead worker,
  although the silence timeout is 5 s: the heartbeat thread keeps talking.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from test_serving_cleanup import wait_all_free

pytestmark = pytest.mark.faults

RESTART_TIMEOUT_S = 120


class Stream(threading.Thread):
    """A streamed completion read in a thread: ``events`` are ``(monotonic time, parsed
    data)``, ``text`` the concatenated text, ``error`` the error event if one came."""

    def __init__(self, url: str, prompt: str, max_tokens: int):
        super().__init__(daemon=True)
        self.url, self.body = url, {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                                    "ignore_eos": True, "stream": True}
        self.events: list[tuple[float, dict]] = []
        self.error: dict | None = None
        self.failure: BaseException | None = None

    def run(self) -> None:
        try:
            with httpx.stream("POST", self.url + "/v1/completions", json=self.body, timeout=120) as r:
                for line in r.iter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        data = json.loads(line[6:])
                        self.events.append((time.monotonic(), data))
                        self.error = data.get("error", self.error)
        except BaseException as exc:  # reported by the test
            self.failure = exc

    @property
    def text(self) -> str:
        return "".join(d["choices"][0]["text"] for _, d in self.events if d.get("choices"))


def wait_for(cond, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def states(dep) -> dict[str, str]:
    return {w["worker_id"]: w["state"] for w in dep.health()["workers"]}


def outstanding(dep, role: str) -> dict[str, int]:
    return {w["worker_id"]: w["outstanding"] for w in dep.health()["workers"]
            if w["role"] == role and w["state"] != "refused"}  # refused ones hold nothing


def all_up(dep) -> bool:
    s = states(dep)
    return all(s.get(w) == "up" for w in ("prefill-0", "prefill-1", "decode-0", "decode-1"))


def streams_on_two_decoders(dep) -> tuple[str, Stream, Stream]:
    """``(victim, its stream, the other stream)``: a long stream on one decode worker of a
    deployment with two (the victim), then a short one, which goes to the other."""
    victim_stream = Stream(dep.url, "Once upon a time, in a land far away,", 400)
    victim_stream.start()
    # Once it streams, it holds one decode worker; the next stream goes to the other one.
    wait_for(lambda: len(victim_stream.events) >= 3, 60, "the first stream's tokens")
    victim = next(w for w, n in outstanding(dep, "decode").items() if n)
    other_stream = Stream(dep.url, "The history of the printing press", 60)
    other_stream.start()
    wait_for(lambda: len(other_stream.events) >= 2 and all(outstanding(dep, "decode").values()), 60,
             "the second stream on the other decode worker")
    return victim, victim_stream, other_stream


def kill_mid_stream(pid: int, victim: str, victim_stream: Stream, other_stream: Stream) -> tuple[float, float]:
    """kill -9 ``pid`` (the victim's process): its stream ends with an error event that
    names it, the other finishes. Returns ``(time.monotonic() of the kill, seconds from
    the kill to the error event)``."""
    os.kill(pid, signal.SIGKILL)
    t_kill = time.monotonic()
    victim_stream.join(30)
    assert victim_stream.failure is None and victim_stream.error is not None, victim_stream.events[-1:]
    assert victim in victim_stream.error["message"]
    other_stream.join(120)
    assert other_stream.failure is None and other_stream.error is None
    assert other_stream.events[-1][1]["choices"][0]["finish_reason"] == "length"
    return t_kill, victim_stream.events[-1][0] - t_kill


def test_kill_decode_mid_stream(xpyd_server):
    dep = xpyd_server
    wait_for(lambda: all_up(dep), RESTART_TIMEOUT_S, "every worker up")
    victim, victim_stream, other_stream = streams_on_two_decoders(dep)

    t_kill, t_error = kill_mid_stream(dep.worker_pid(victim), victim, victim_stream, other_stream)
    assert t_error < 5.0, f"error event {t_error:.2f} s after kill -9"
    assert states(dep)[victim] == "down"

    wait_for(lambda: states(dep)[victim] == "up", RESTART_TIMEOUT_S, f"{victim} up again")
    t_restart = time.monotonic() - t_kill
    print(f"\nkill -9 {victim}: error event after {t_error:.2f} s, worker up again after {t_restart:.1f} s")
    # The first request after the restart works, and greedy gives the same text again.
    again = dep.generate("completion", other_stream.body["prompt"], stream=False, max_tokens=60,
                         temperature=0, extra_body={"ignore_eos": True})
    assert again.text == other_stream.text
    assert "restarting it" in dep.log_tail(10**6)
    wait_all_free(dep.url)


def test_kill_prefill_with_queued_requests(xpyd_server, tokenizer):
    dep = xpyd_server
    wait_for(lambda: all_up(dep), RESTART_TIMEOUT_S, "every worker up")
    # Long distinct prompts so that prefills queue up on both prefill workers.
    prompts = [f"Report {i}: " + "the committee reviewed the harbour accounts and noted the tides. " * 40
               for i in range(8)]
    with ThreadPoolExecutor(len(prompts)) as pool:
        futures = [pool.submit(dep.generate, "completion", p, stream=True, max_tokens=8, temperature=0,
                               extra_body={"ignore_eos": True}) for p in prompts]
        wait_for(lambda: outstanding(dep, "prefill")["prefill-0"] >= 2, 60, "requests queued on prefill-0")
        os.kill(dep.worker_pid("prefill-0"), signal.SIGKILL)
        t_kill = time.monotonic()
        results = [f.result(timeout=300) for f in futures]
    print(f"\nkill -9 prefill-0: all {len(results)} requests done {time.monotonic() - t_kill:.1f} s later")
    assert all(r.finish_reason == "length" and r.usage.completion_tokens == 8 for r in results)
    traces = [dep.trace(r.id) for r in results]
    assert all(t["error"] is None for t in traces)
    assert any(t["prefill_worker"] == "prefill-1" for t in traces)
    assert "retrying on prefill-1" in dep.log_tail(10**6)
    wait_for(lambda: all_up(dep), RESTART_TIMEOUT_S, "prefill-0 up again")
    wait_all_free(dep.url)


def test_long_prefill_is_not_taken_for_dead(xpyd_server, tokenizer):
    dep = xpyd_server
    wait_for(lambda: all_up(dep), RESTART_TIMEOUT_S, "every worker up")
    ids = tokenizer("The lighthouse keeper wrote the weather into his book every night. " * 140).input_ids[:1600]
    t0 = time.monotonic()
    r = httpx.post(dep.url + "/v1/completions", json={"prompt": ids, "max_tokens": 2, "temperature": 0},
                   timeout=300)
    took = time.monotonic() - t0
    print(f"\n1,600-token request took {took:.1f} s")
    assert r.status_code == 200, r.text
    assert "silent for" not in dep.log_tail(10**6)
    assert all_up(dep)
