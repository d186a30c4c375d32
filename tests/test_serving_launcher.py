"""``epdserve serve`` places its workers by a fixed rule and owns them: a launcher killed
with SIGKILL leaves no worker behind (worker deaths: tests/test_faults_workers.py)."""

from __future__ import annotations

import argparse
import os
import signal
import time
from pathlib import Path

import pytest

from conftest import _stop, start_deployment
from epdserve.host import child_pids
from epdserve.serving.deployment import plan_workers
from epdserve.serving.launch import launcher, placement
from epdserve.serving.worker import setup as worker_setup
from epdserve.argtypes import config_from
from epdserve.serving.launch.options import ServeOptions


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
    # Tensor-parallel workers: at least a core a rank, round-robin when there are fewer cores than ranks.
    assert plan_workers("pd", [0, 1], prefill_tp=2) == [("prefill", "prefill-0", [0, 1]), ("decode", "decode-0", [0])]
    assert plan_workers("pd", [0, 1, 2, 3], prefill_tp=3) == [("prefill", "prefill-0", [0, 1, 2]),
                                                             ("decode", "decode-0", [3])]
    assert plan_workers("colocated", [0, 1, 2, 3], workers=2, tp=2) == [("colocated", "colocated-0", [0, 1]),
                                                                       ("colocated", "colocated-1", [2, 3])]


def serve_args(*argv: str):
    parser = argparse.ArgumentParser()
    launcher.add_arguments(parser)
    return config_from(ServeOptions, parser.parse_args([*argv, "--allow-unauthenticated"]))


@pytest.mark.parametrize("argv, error", [
    (("--prefill-tp", "2"), "--prefill-tp applies to pd and epd modes; colocated workers take --tensor-parallel-size"),
    (("--workers", "2", "--decode-tp", "1"), "--decode-tp applies to pd and epd modes"),
    (("--elastic", "--mode", "pd", "--decode-tp", "2"),
     "--decode-tp: an elastic worker changes role, so every worker takes --tensor-parallel-size"),
    (("--elastic", "--workers", "2", "--prefill-tp", "2"), "--prefill-tp: an elastic worker changes role"),
    (("--mode", "pd", "--prefill-tp", "3", "--cores", "0,1"),
     "--prefill-tp 3 needs 3 cores, one a rank; serve has 2 (0,1): give it more --cores or use fewer ranks"),
    (("--mode", "epd", "-tp", "2", "--decode-tp", "4", "--cores", "0,1"), "--decode-tp 4 needs 4 cores"),
    (("--mode", "pd", "-tp", "3", "--prefill-tp", "1", "--cores", "0,1"), "--tensor-parallel-size 3 needs 3 cores"),
])
def test_per_role_tensor_parallel_flags_are_refused_where_they_do_not_apply(argv, error):
    assert launcher._check_options(serve_args(*argv))[2].startswith(error)


@pytest.mark.parametrize("argv, error", [
    (("--prefill-kv-cache-dtype", "bfloat16"),
     "--prefill-kv-cache-dtype applies to pd and epd modes; colocated workers take --kv-cache-dtype"),
    (("--decode-weight-format", "q4_1"),
     "--decode-weight-format applies to pd and epd modes; colocated workers take --weight-format"),
    (("--decode-dtype", "bfloat16"), "--decode-dtype applies to pd and epd modes; colocated workers take --dtype"),
    (("--elastic", "--workers", "2", "--decode-kv-cache-dtype", "bfloat16"),
     "--decode-kv-cache-dtype: an elastic worker changes role"),
])
def test_per_role_precision_flags_are_refused_where_no_worker_takes_them(argv, error):
    assert launcher._check_options(serve_args(*argv))[2].startswith(error)
    assert launcher._check_options(serve_args("--mode", "pd", *argv[-2:]))[2] is None


def test_serve_stops_on_a_role_size_it_does_not_take(capsys):
    assert launcher.run(serve_args("--prefill-tp", "2", "--log-level", "error")) == 2
    assert capsys.readouterr().err.strip() == ("epdserve serve: error: --prefill-tp applies to pd and epd modes; "
                                               "colocated workers take --tensor-parallel-size")
    for bad in ("0", "-1", "x"):
        with pytest.raises(SystemExit) as info:
            serve_args("--mode", "pd", "--decode-tp", bad)
        assert info.value.code == 2
    assert "--decode-tp" in capsys.readouterr().err


def test_each_worker_is_checked_and_started_with_its_roles_size(monkeypatch):
    checked = []
    monkeypatch.setattr(placement, "split_cores", lambda cores, size: checked.append((size, cores)))
    monkeypatch.setattr(placement, "usable_cores", lambda spec: [int(c) for c in (spec or "0,1,2,3").split(",")])
    args = serve_args("--mode", "epd", "-tp", "2", "--decode-tp", "3")
    _, plan, error = launcher._check_options(args)
    # The encode worker has one rank whatever -tp says; 6 ranks on 4 cores: round-robin.
    assert error is None and checked == [(1, [0]), (2, [1, 2]), (3, [0, 1, 3])]
    assert [c for _, _, c in plan] == [[0], [1, 2], [0, 1, 3]]
    worker = argparse.ArgumentParser()
    worker_setup.add_arguments(worker)
    sizes = {role: worker.parse_args(launcher.worker_command(args, role, f"{role}-0", cores, "e", "c")[4:])
             .tensor_parallel_size for role, _, cores in plan}
    assert sizes == {"encode": 1, "prefill": 2, "decode": 3}
    assert "--tensor-parallel-size" not in launcher.worker_flags(args, "encode", "encode-0", "e")
    checked.clear()
    _, plan, error = launcher._check_options(serve_args("--mode", "pd", "--prefill-tp", "2", "--cores", "0,1"))
    assert error is None and checked == [(2, [0, 1]), (1, [0])]
    # --encode-tp is the encode workers' own: passed to them alone.
    args = serve_args("--mode", "epd", "--encode-tp", "2")
    assert launcher.worker_flags(args, "encode", "encode-0", "e")[-2:] == ["--tensor-parallel-size", "2"]
    assert "--tensor-parallel-size" not in launcher.worker_flags(args, "prefill", "prefill-0", "e")


def test_capacity_counts_each_workers_ranks(tmp_path):
    with open(tmp_path / "model.safetensors", "wb") as f:
        f.truncate(2**30)  # 1 GiB of weights (a sparse file)
    args = serve_args("--mode", "pd", "--prefill-tp", "2", "--kv-cache-memory-mb", "1024", "--cores", "0,1")
    plan = placement.plan_for(args)
    # Two workers' weights (the ranks' shards add up to one copy each) + 2 + 1 ranks' KV caches: 5 GiB.
    warnings, error = launcher.check_capacity(args, plan, tmp_path, 4 * 2**30)
    assert "2 workers need about 5.0 GiB (1.00 GiB of weights + 1024 MiB of KV cache per worker rank)" in error
    assert warnings == ["2 workers on 2 cores: cores 0 are each shared by several workers, which slow each other "
                        "down (fewer workers or more cores avoid it)"]
    assert launcher.check_capacity(args, plan, tmp_path, 5 * 2**30)[1] is None


def _kill_leftovers(pids: list[int]) -> None:
    for pid in pids:
        if alive(pid):
            os.kill(pid, signal.SIGKILL)


def test_no_orphans_after_launcher_sigkill(tmp_path):
    dep, workers = start_deployment("colocated", tmp_path), []
    try:
        workers = children(dep.proc.pid)  # its worker and its router process
        assert sorted(child_pids(dep.proc.pid)) == ["colocated-0", "router"] and len(workers) == 2
        assert all(alive(p) for p in workers)
        os.kill(dep.proc.pid, signal.SIGKILL)
        dep.proc.wait(10)
        assert wait_until(lambda: not any(alive(p) for p in workers), 15), "a child outlived its launcher"
    finally:
        _stop(dep.proc)
        _kill_leftovers(workers)


def test_compare_checks_tensor_parallel_names_as_serve_does():
    from epdserve.bench import compare

    parser = argparse.ArgumentParser()
    compare.add_arguments(parser)
    options = config_from(compare.OPTIONS, parser.parse_args(["--configs", "colocated-tp4096,1p1d-tp1/4096"]))
    warnings, errors = compare.preflight(options, None)
    assert [e.split(", one a rank")[0] for e in errors] == [
        "[colocated-tp4096] --tensor-parallel-size 4096 needs 4096 cores", "[1p1d-tp1/4096] --decode-tp 4096 needs 4096 cores"]


def test_the_routers_connections_send_without_nagle_delay():
    """serve's listening socket names IPPROTO_TCP, so asyncio sets TCP_NODELAY on every
    connection it accepts: with Nagle's algorithm on, a response's second write waited for
    the client's delayed ACK, 40 ms on each request of a kept-alive connection."""
    import asyncio
    import socket

    async def accepted_nodelay() -> int:
        sock = launcher.listen_socket("127.0.0.1", 0)
        got = asyncio.get_running_loop().create_future()

        class Probe(asyncio.Protocol):
            def connection_made(self, transport):
                s = transport.get_extra_info("socket")
                got.set_result(s.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
                transport.close()

        server = await asyncio.get_running_loop().create_server(Probe, sock=sock)
        try:
            _, writer = await asyncio.open_connection("127.0.0.1", sock.getsockname()[1])
            value = await asyncio.wait_for(got, 10)
            writer.close()
            return value
        finally:
            server.close()

    assert asyncio.run(accepted_nodelay()) != 0
