"""``epdserve serve`` owns its workers: a dead worker stops the deployment with a clear
log line and exit status 1; a launcher killed with SIGKILL leaves no worker behind."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from epdserve.serving.launcher import plan_workers
from conftest import _stop, start_deployment


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
    assert plan_workers("pd", [0, 1]) == [("prefill", "prefill-0", [0]), ("decode", "decode-0", [1])]
    assert plan_workers("pd", [0, 1, 2, 3]) == [("prefill", "prefill-0", [0, 1]), ("decode", "decode-0", [2, 3])]
    assert plan_workers("pd", [3]) == [("prefill", "prefill-0", [3]), ("decode", "decode-0", [3])]
    with pytest.raises(ValueError):
        plan_workers("pd", [])


def _kill_leftovers(pids: list[int]) -> None:
    for pid in pids:
        if alive(pid):
            os.kill(pid, signal.SIGKILL)


def test_worker_death_stops_deployment(tmp_path):
    dep, workers = start_deployment("pd", tmp_path), []
    try:
        workers = children(dep.proc.pid)
        assert len(workers) == 2
        os.kill(workers[0], signal.SIGKILL)
        assert dep.proc.wait(60) == 1
        assert "exited with code -9; stopping" in dep.log_tail()
        assert wait_until(lambda: not any(alive(p) for p in workers), 15)
    finally:
        _stop(dep.proc)
        _kill_leftovers(workers)


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
