"""``epdserve serve`` places its workers by a fixed rule and owns them: a launcher killed
with SIGKILL leaves no worker behind (worker deaths: tests/test_faults_workers.py)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from conftest import _stop, start_deployment
from epdserve.serving.deployment import plan_workers


def children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        out += [int(c) for c in (task / "children").read_text().split()]
    return out


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def wait_until(cond, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.1)
    return cond()


def test_plan_workers():
    assert plan_workers("colocated", [0, 1]) == [("colocated", "colocated-0", [0, 1])]
    assert plan_workers("colocated", [0, 1], workers=3) == [
        ("colocated", "colocated-0", [0]), ("colocated", "colocated-1", [1]), ("colocated", "colocated-2", [0])]
    assert plan_workers("pd", [0, 1]) == [("prefill", "prefill-0", [0]), ("decode", "decode-0", [1])]
    assert plan_workers("pd", [0, 1, 2, 3]) == [("prefill", "prefill-0", [0, 1]), ("decode", "decode-0", [2, 3])]
    assert plan_workers("epd", [0, 1]) == [("encode", "encode-0", [0]), ("prefill", "prefill-0", [0]),
                                           ("decode", "decode-0", [1])]
    assert plan_workers("epd", [0, 1, 2, 3], encode=2) == [
        ("encode", "encode-0", [0]), ("encode", "encode-1", [0]), ("prefill", "prefill-0", [1]),
        ("decode", "decode-0", [2, 3])]
    assert plan_workers("pd", [3]) == [("prefill", "prefill-0", [3]), ("decode", "decode-0", [3])]
    assert plan_workers("pd", [0, 1], prefill=2, decode=2) == [
        ("prefill", "prefill-0", [0]), ("prefill", "prefill-1", [0]),
        ("decode", "decode-0", [1]), ("decode", "decode-1", [1])]
    assert plan_workers("pd", [0, 1, 2, 3, 4, 5], prefill=2, decode=1) == [
        ("prefill", "prefill-0", [0, 1]), ("prefill", "prefill-1", [2]), ("decode", "decode-0", [3, 4, 5])]
    with pytest.raises(ValueError):
        plan_workers("pd", [])
    with pytest.raises(ValueError):
        plan_workers("pd", [0, 1], decode=0)


def _kill_leftovers(pids: list[int]) -> None:
    for pid in pids:
        if alive(pid):
            os.kill(pid, signal.SIGKILL)


def test_no_orphans_after_launcher_sigkill(tmp_path):
    dep, workers = start_deployment("colocated", tmp_path), []
    try:
        workers = children(dep.proc.pid)
        assert len(workers) == 1 and alive(workers[0])
        os.kill(dep.proc.pid, signal.SIGKILL)
        dep.proc.wait(10)
        assert wait_until(lambda: not any(alive(p) for p in workers), 15), "worker outlived its launcher"
    finally:
        _stop(dep.proc)
        _kill_leftovers(workers)
