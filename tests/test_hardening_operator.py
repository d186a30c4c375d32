"""Operator-facing rough edges of ``serve`` and ``compare``: worker options checked by
serve before any worker starts, a busy port in one line, deployments larger than the host
refused (serve) or all checked before any runs (compare), and the load that other
processes put on the cores recorded around each compare run (``epdserve/host.py``)."""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest

from epdserve import host
from epdserve.argtypes import config_from
from epdserve.serving.launch import launcher
from epdserve.serving.worker import engine_worker as worker
from epdserve.serving.deployment import plan_workers
from epdserve.serving.launch.options import ServeOptions

pytestmark = pytest.mark.faults

SERVE = [sys.executable, "-m", "epdserve", "serve", "--host", "127.0.0.1"]


def serve_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="epdserve serve")
    launcher.add_arguments(parser)
    return parser


def run_serve(*args: str, timeout: float = 120) -> tuple[subprocess.CompletedProcess, float]:
    start = time.monotonic()
    proc = subprocess.run([*SERVE, *args], capture_output=True, text=True, timeout=timeout)
    return proc, time.monotonic() - start


def test_serve_refuses_a_bad_worker_choice_before_starting_workers():
    proc, took = run_serve("--mode", "pd", "--port", "0", "--kv-transfer-dtype", "fp4",
                           "--startup-timeout", "30")
    assert proc.returncode == 2, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert "--kv-transfer-dtype" in last and "'fp4'" in last
    assert all(f"'{c}'" in last for c in ("none", "bf16", "int8"))
    assert proc.stderr.count("error:") == 1  # not once per worker, under its usage text
    assert "epdserve worker" not in proc.stderr + proc.stdout and "started worker" not in proc.stderr
    assert took < 60  # no model loaded, no worker waited for (machine shared: generous)


def test_serve_stops_on_a_weight_format_the_model_cannot_hold():
    """Known only once the model is read: the worker's one line names the flag, and serve
    stops instead of restarting it."""
    proc, _ = run_serve("--port", "0", "--dtype", "bfloat16", "--weight-format", "q4_1", "--startup-timeout", "120")
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert "--weight-format q4_1 needs --dtype float32" in proc.stdout + proc.stderr
    assert "configuration is wrong" in proc.stderr


def test_serve_takes_the_worker_choices_and_refuses_numbers_below_one(capsys):
    serve, work = serve_parser(), argparse.ArgumentParser()
    worker.add_arguments(work)
    choices = lambda p: {a.dest: a.choices for a in p._actions if a.choices}  # noqa: E731
    for dest in ("dtype", "weight_format", "kv_transport", "kv_transfer_dtype"):
        assert list(choices(serve)[dest]) == list(choices(work)[dest]), dest
    for bad in (["--dtype", "float16"], ["--kv-transport", "rdma"], ["--block-size", "0"],
                ["--max-num-seqs", "0"], ["--kv-cache-memory-mb", "-1"],
                ["--max-num-batched-tokens", "x"], ["--weight-format", "q4_0"], ["--prefill-weight-format", "f16"]):
        with pytest.raises(SystemExit) as info:
            serve.parse_args(bad)
        assert info.value.code == 2
        assert bad[0] in capsys.readouterr().err.splitlines()[-1]
    args = serve.parse_args([])  # nothing given: nothing passed, the worker's defaults hold
    assert (args.dtype, args.kv_transport, args.kv_cache_memory_mb) == (None, None, None)
    assert config_from(ServeOptions, args).worker == {}


def test_serve_refuses_cores_it_may_not_use():
    with pytest.raises(ValueError, match="comma-separated"):
        launcher.usable_cores("0,x")
    with pytest.raises(ValueError, match="may use cores"):
        launcher.usable_cores("0,100000")
    assert launcher.usable_cores(None) == sorted(os.sched_getaffinity(0))


def test_serve_on_a_busy_port_says_so_in_one_line():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        proc, _ = run_serve("--port", str(port), "--startup-timeout", "30")
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr and "started worker" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if "rror" in line]
    assert len(errors) == 1 and f"127.0.0.1:{port}" in errors[0] and "in use" in errors[0]
    assert "--port" in errors[0]


def fake_model(tmp_path: Path, weight_mib: int) -> Path:
    """A model directory whose weights take ``weight_mib`` MiB on disk (a sparse file)."""
    with open(tmp_path / "model.safetensors", "wb") as f:
        f.truncate(weight_mib * 2**20)
    (tmp_path / "quantized").mkdir()
    (tmp_path / "quantized" / "blocks.safetensors").write_bytes(b"x" * 100)  # not counted
    return tmp_path


GiB = 2**30


def test_capacity_warns_on_shared_cores_and_refuses_what_memory_cannot_hold(tmp_path):
    model = fake_model(tmp_path, 512)
    parser = serve_parser()
    # conftest's 2P2D fixture on 2 cores: shared cores are a warning, 4 x (0.5 + 0.125) GiB fits.
    args = config_from(ServeOptions, parser.parse_args(["--mode", "pd", "--prefill-workers", "2", "--decode-workers",
                                                        "2", "--kv-cache-memory-mb", "128", "--cores", "0,1"]))
    warnings, error = launcher.check_capacity(args, plan_workers("pd", [0, 1], prefill=2, decode=2),
                                              model, 20 * GiB)
    assert error is None and len(warnings) == 1 and "cores 0,1" in warnings[0]
    # 9p9d with the worker's default KV cache (1024 MiB): 18 x 1.5 GiB = 27 GiB.
    args = config_from(ServeOptions, parser.parse_args(["--mode", "pd", "--prefill-workers", "9", "--decode-workers",
                                                        "9"]))
    plan = plan_workers("pd", [0, 1], prefill=9, decode=9)
    warnings, error = launcher.check_capacity(args, plan, model, 20 * GiB)
    assert "18 workers need about 27.0 GiB" in error and "20.0 GiB is available" in error
    assert launcher.check_capacity(args, plan, model, 28 * GiB)[1] is None
    assert launcher.check_capacity(args, plan, model, None)[1] is None  # no MemAvailable: unchecked
    args = replace(args, allow_oversubscription=True)
    warnings, error = launcher.check_capacity(args, plan, model, 20 * GiB)
    assert error is None and "--allow-oversubscription" in warnings[-1]
    # One worker per core, encode workers without KV cache: 3 x 0.5 + 2 x 1 = 3.5 GiB.
    args = config_from(ServeOptions, parser.parse_args(["--mode", "epd"]))
    plan = plan_workers("epd", [0, 1, 2, 3])
    assert launcher.check_capacity(args, plan, model, int(3.5 * GiB)) == ([], None)
    assert "3.5 GiB" in launcher.check_capacity(args, plan, model, 3 * GiB)[1]


def test_serve_refuses_a_deployment_larger_than_memory_before_starting_workers():
    # 100 TiB of KV cache per worker: larger than any host's available memory.
    proc, _ = run_serve("--mode", "pd", "--port", "0", "--kv-cache-memory-mb", str(100 * 2**20),
                        "--startup-timeout", "20")
    assert proc.returncode == 2, proc.stderr[-2000:]
    error = proc.stderr.strip().splitlines()[-1]
    assert error.startswith("epdserve serve: error: 2 workers need about")
    assert "--allow-oversubscription" in error and "--kv-cache-memory-mb" in error
    assert "started worker" not in proc.stderr and "Traceback" not in proc.stderr


def test_compare_checks_every_configuration_before_running_any(tmp_path, monkeypatch, capsys):
    from epdserve.bench import compare

    def must_not_run(*a, **k):
        raise AssertionError("a configuration ran before every one was checked")

    monkeypatch.setattr(compare, "run_config", must_not_run)
    monkeypatch.setattr(host, "mem_available_bytes", lambda *a: 4 * GiB)
    parser = argparse.ArgumentParser()
    compare.add_arguments(parser)
    args = config_from(compare.CompareOptions, parser.parse_args(
        ["--configs", "colocated,9p9d", "--workload", "synthetic", "--num-prompts", "2", "--output",
         str(tmp_path / "out"), "--disable-tqdm"]))
    assert compare.run(args) == 2
    out, err = capsys.readouterr()
    assert "error: [9p9d] 18 workers need about" in err and "[colocated]" not in err
    assert "--configs" in err and "--allow-oversubscription" in err
    assert "warning: [9p9d] 18 workers on" in out  # and they would share the cores
    assert not (tmp_path / "out").exists()
    # With the override the same check lets it through (as serve then will).
    warnings, errors = compare.preflight(dataclasses.replace(args, allow_oversubscription=True), 4 * GiB)
    assert errors == [] and any("starting anyway" in w for w in warnings)
    assert "--allow-oversubscription" in compare.server_command("pd", 1, Path("t"), None, [], True)
    # EPD on the default (text) model: refused before any run, as serve refuses it.
    epd = config_from(compare.CompareOptions, parser.parse_args(["--configs", "1e1p1d"]))
    warnings, errors = compare.preflight(epd, None)
    assert errors == ["[1e1p1d] --mode epd needs a vision-language model (e.g. --model vlm), not "
                      "SmolLM2-135M-Instruct"], errors


# --- outside load -----------------------------------------------------------------------

def test_proc_parsers_on_fixed_text(tmp_path):
    (tmp_path / "meminfo").write_text("MemTotal: 100 kB\nMemAvailable:    2048 kB\n")
    assert host.mem_available_bytes(tmp_path / "meminfo") == 2048 * 1024
    assert host.mem_available_bytes(tmp_path / "absent") is None
    (tmp_path / "loadavg").write_text("1.50 0.80 0.40 2/300 1234\n")
    assert host.loadavg_1m(tmp_path / "loadavg") == 1.5
    (tmp_path / "stat").write_text(
        "cpu  100 100 100 100 100 100 100 100 0 0\n"
        "cpu0 10 1 5 80 2 1 1 3 4 0\n"     # busy 10+1+5+1+1 = 18, steal 3, total 103
        "cpu1 20 0 10 60 0 0 0 10 0 0\n"   # busy 30, steal 10, total 100
        "cpu2 1 1 1 1 1 1 1 1 0 0\nintr 5\n")
    assert host.cpu_ticks([0, 1], tmp_path / "stat") == {"busy": 48, "steal": 13, "total": 203}
    assert host.cpu_ticks([7], tmp_path / "stat") == {"busy": 0, "steal": 0, "total": 0}
    proc = tmp_path / "proc"
    for pid, ppid, utime, stime in ((10, 1, 5, 1), (11, 10, 7, 2), (12, 11, 3, 0), (13, 1, 50, 50)):
        (proc / str(pid)).mkdir(parents=True)
        fields = ["S", str(ppid)] + ["0"] * 9 + [str(utime), str(stime)] + ["0"] * 6 + [str(pid * 100)]
        (proc / str(pid) / "stat").write_text(f"{pid} (a) b) {' '.join(fields)} 0 {pid + 1}\n")  # vsize, rss pages
    (proc / "self").mkdir()
    assert host.tree_ticks(10, proc) == {(10, 1000): 6, (11, 1100): 9, (12, 1200): 3}
    assert host.tree_stats(10, proc)[(12, 1200)] == (3, 13 * host.PAGE_BYTES)


def test_outside_warning_threshold():
    assert host.outside_warning(0.05, 0.04, 2) is None
    text = host.outside_warning(0.25, 0.01, 2)
    assert "25% of the 2 cores" in text and "steal 1%" in text and "10%" in text
    assert host.outside_warning(0.0, 0.12, 2) is not None  # steal takes cores too


BURN = ("import sys, time\nt = time.process_time()\n"
        "while time.process_time() - t < {cpu}: pass\nprint('done', flush=True)\ntime.sleep({sleep})\n")


def test_load_monitor_tells_the_deployment_from_other_processes():
    cores = sorted(os.sched_getaffinity(0))
    # The "deployment": a shell whose child burns 0.6 CPU s, as a launcher's workers would.
    deployment = subprocess.Popen(["sh", "-c", f"{sys.executable} -c \"{BURN.format(cpu=0.6, sleep=30)}\""
                                   " & wait"], stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        monitor = host.LoadMonitor(cores, [deployment.pid], interval_s=0.1).start()
        outside = subprocess.run([sys.executable, "-c", BURN.format(cpu=0.6, sleep=0)], timeout=60)
        assert outside.returncode == 0
        assert deployment.stdout.readline().strip() == "done"
        load = monitor.stop()
    finally:
        os.killpg(deployment.pid, signal.SIGKILL)  # the shell and its child: our session
        deployment.wait()
    assert load["deployment_cpu_s"] >= 0.55
    # Other processes: at least the outside burner (other users of the machine add to it).
    assert load["outside_cpu_s"] >= 0.4
    assert load["busy_cpu_s"] >= load["deployment_cpu_s"] + load["outside_cpu_s"] - 0.05
    assert 0 < load["outside_share"] <= 1 and 0 <= load["steal_share"] <= 1
    assert load["client_cpu_s"] >= 0 and load["loadavg_1m_max"] is not None
    assert load["deployment_rss_peak_bytes"] > 4e6  # a shell and a Python interpreter, resident
    before = host.quiet_check(cores, 0.2)
    assert set(before) == {"window_s", "loadavg_1m", "outside_share", "steal_share"}


def test_the_2p2d_fixture_still_starts_with_shared_cores_a_warning(xpyd_server):
    """conftest's 2P2D deployment shares cores on a small machine: serve warns and runs."""
    assert xpyd_server.health()["status"] == "ok"
    log = xpyd_server.log_tail(10**6)
    if len(os.sched_getaffinity(0)) < 4:
        assert "epdserve serve: warning: 4 workers on" in log
    assert "epdserve serve: error" not in log
