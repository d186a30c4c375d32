"""``epdserve compare --deployments FILE``: the file schema and its one-line errors (pure),
and deployments run end to end with real processes: a process that never gets ready, a
base URL that is not an OpenAI server, an ``epdserve serve`` killed in the middle of its
run, and llama.cpp's ``llama-server`` next to epdserve colocated on the same trace.

Every process a test starts is stopped by the test or by compare; each test checks that
nothing it started is left running (process groups gone, ports free)."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from epdserve import host
from epdserve.argtypes import config_from
from epdserve.bench import compare, deployments, processes, report, workload
from epdserve.bench.deployments import Deployment, DeploymentFileError
from test_bench_client import req
from scripts import load_script
from test_bench_compare import free_port, group_alive

pytestmark = pytest.mark.interop

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted((ROOT / "examples" / "deployments").glob("*.toml"))
STUB = [sys.executable, str(Path(__file__).with_name("test_bench_client.py"))]
FAKE_ENV = {"LLAMA_SERVER": "/opt/llama-server", "EPDSERVE_GGUF": "/m/model.gguf"}


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def compare_args(*extra: str) -> compare.CompareOptions:
    parser = argparse.ArgumentParser()
    compare.add_arguments(parser)
    return config_from(compare.CompareOptions, parser.parse_args(["--disable-tqdm", "--repeats", "1", *extra]))


def stub_entry(name: str, port: int) -> str:
    """A processes entry running the bench tests' OpenAI stub (a real HTTP server)."""
    return (f'[[deployment]]\nname = "{name}"\nopenai_base_url = "http://127.0.0.1:{port}/v1"\n'
            f'resources = {{ cpu_cores = 1 }}\n[[deployment.processes]]\n'
            f'command = {json.dumps([*STUB, "--port", str(port)])}\n'
            f'ready = {{ url = "http://127.0.0.1:{port}/health", timeout_s = 60 }}\n')


def saved_trace(path: Path, requests: list[workload.Request]) -> Path:
    workload.save_trace(requests, path)
    return path


def wait_for_file(path: Path, timeout_s: float = 60) -> str:
    deadline = time.monotonic() + timeout_s
    while not (path.exists() and path.read_text().strip()):
        assert time.monotonic() < deadline, f"{path} never written"
        time.sleep(0.05)
    return path.read_text().strip()


# ---------------------------------------------------------------------------------------
# The schema


def test_every_example_file_parses_and_names_its_sources():
    deps = deployments.load(EXAMPLES)
    assert {d.name for d in deps} == {"epdserve-colocated", "epdserve-1p1d", "epdserve-1p1d-bf16-prefill",
                                      "llama-server", "vllm-colocated", "vllm-1p1d", "sglang-1p1d", "vllm-cpu",
                                      "vllm-cpu-1p1d"}
    by_name = {d.name: d for d in deps}
    assert by_name["epdserve-1p1d"].entry_mode == "pd" and by_name["epdserve-1p1d"].epdserve == "1p1d"
    assert by_name["epdserve-1p1d-bf16-prefill"].args == ["--prefill-weight-format", "bf16"]
    llama = by_name["llama-server"].resolved_processes(FAKE_ENV)[0].command
    assert llama[:3] == ["/opt/llama-server", "-m", "/m/model.gguf"] and "--metrics" in llama
    for name in ("vllm-1p1d", "sglang-1p1d"):
        dep = by_name[name]
        assert dep.entry_mode == "pd" and dep.resources.gpus == 2
        assert len(dep.processes) == 3 and len(dep.metrics_urls) == 3  # one per process
        assert all(p.ready for p in dep.processes[:2])  # the engines before their router
    vllm = by_name["vllm-1p1d"].resolved_processes({})
    assert '{"kv_connector":"NixlConnector","kv_role":"kv_both"}' in vllm[0].command
    assert vllm[1].env["CUDA_VISIBLE_DEVICES"] == "1" and vllm[0].command[2] == "Qwen/Qwen3-0.6B"
    # The CPU ones run here (tests/test_vllm.py): the model compare serves, make vllm's venv.
    env = {"EPDSERVE_MODEL_DIR": "/m/hf"}
    for name in ("vllm-cpu", "vllm-cpu-1p1d"):
        dep = by_name[name]
        assert dep.setup == "make vllm" and dep.resources.cpu_cores == 2
        for p in dep.resolved_processes(env):
            assert p.command[0].startswith(".venv-vllm/bin/vllm")
            assert p.command[2] == "/m/hf" or p.command[0].endswith("vllm-router")
    pd = by_name["vllm-cpu-1p1d"].resolved_processes(env)
    assert [p.env["VLLM_CPU_OMP_THREADS_BIND"] for p in pd[:2]] == ["0", "1"]
    assert '{"kv_connector":"NixlConnector","kv_role":"kv_consumer"}' in pd[1].command
    for path in (p for p in EXAMPLES if p.name.startswith(("vllm", "sglang")) and "-cpu" not in p.name):
        comment = path.read_text().replace("\n# ", " ")  # the header comment as one text
        assert "Flags checked against https://" in comment, path
        assert "on 2026-12-01; not run here (no GPU)" in comment, path
    # The epdserve examples' extra args are serve options (checked as serve will).
    warnings, errors = compare.preflight(compare_args(), None, deps)
    assert errors == [], errors


def test_the_model_variables_name_what_epdserve_serves(model_info, tmp_path):
    """``EPDSERVE_MODEL_DIR`` / ``EPDSERVE_GGUF`` of compare's model, unless set; a
    Hugging Face directory has no GGUF, so that variable stays unset for it."""
    env = deployments.ModelVariables(None, {"HOME": "/h"})
    assert env["EPDSERVE_MODEL_DIR"] == str(model_info.path)
    assert env["EPDSERVE_GGUF"] == str(model_info.source) and env["HOME"] == "/h"
    assert deployments.ModelVariables(None, {"EPDSERVE_MODEL_DIR": "/x"})["EPDSERVE_MODEL_DIR"] == "/x"
    assert "EPDSERVE_GGUF" not in deployments.ModelVariables(str(model_info.path), {})
    dep = Deployment.model_validate({"name": "p", "openai_base_url": "http://h:1/v1",
                                     "processes": [{"command": ["serve", "${EPDSERVE_GGUF}"]}]})
    with pytest.raises(DeploymentFileError, match=r"\$\{EPDSERVE_GGUF\} is not set"):
        dep.resolved_processes(deployments.ModelVariables(str(model_info.path), {}))


@pytest.mark.parametrize("text, message", [
    ('[[deployment]]\nname = "vllm-pd"\nbase_url = "http://127.0.0.1:9"\n'
     'ready = { url = "http://127.0.0.1:9/health", timeout_s = -1 }\n',
     'deployment "vllm-pd": ready.timeout_s: must be > 0 (got -1)'),
    ('[[deployment]]\nname = "x"\nbase_url = "http://h:1"\nredy = 3\n',
     'deployment "x": redy: unknown key (the keys here: name, epdserve, args, processes'),
    ('[[deployment]]\nname = "x"\nprocesses = [{ comand = ["a"] }]\n'
     'openai_base_url = "http://h:1"\n',
     'deployment "x": processes[0].command: required'),
    ('[[deployment]]\nname = "x"\nepdserve = "3q"\n',
     "deployment \"x\": epdserve: unknown deployment '3q': expected one of"),
    ('[[deployment]]\nname = "x"\nepdserve = "pd"\nbase_url = "http://h:1"\n',
     'deployment "x": give exactly one of epdserve, processes, base_url (got epdserve and base_url)'),
    ('[[deployment]]\nname = "x"\nmode = "pd"\n',
     'deployment "x": give exactly one of epdserve, processes, base_url'),
    ('[[deployment]]\nname = "x"\nprocesses = [{ command = ["a"] }]\n',
     'deployment "x": openai_base_url: required with processes'),
    ('[[deployment]]\nname = "x"\nepdserve = "pd"\nopenai_base_url = "http://h:1"\n',
     'deployment "x": openai_base_url: not for an epdserve entry'),
    ('[[deployment]]\nname = "x"\nepdserve = "pd"\nengine = "vLLM"\n',
     'deployment "x": engine: not for an epdserve entry'),
    ('[[deployment]]\nname = "x"\nbase_url = "http://h:1"\nengine = ""\n', 'deployment "x": engine: '),
    ('[[deployment]]\nname = "x"\nbase_url = "http://h:1"\nargs = ["--x"]\n',
     'deployment "x": args: only for an epdserve entry'),
    ('[[deployment]]\nname = "x"\nbase_url = "http://h:1"\nsetup = "make vllm"\n',
     'deployment "x": setup: only for an entry with processes (what installs them)'),
    ('[[deployment]]\nname = "x"\nepdserve = "pd"\nsetup = ""\n',
     'deployment "x": setup: '),
    ('[[deployment]]\nname = "x"\nbase_url = "http://h:1"\n'
     'resources = { cpu_cores = 2, gpus = 1 }\n', 'deployment "x": resources: give cpu_cores or gpus'),
    ('[[deployment]]\nname = "x"\nbase_url = "ftp://h"\n', "deployment \"x\": base_url: 'ftp://h' is not"),
    ('[[deployment]]\nname = "x"\nbase_url = "http://h:1"\nready = { url = "http://h:1", status = 7 }\n',
     'deployment "x": ready.status: must be >= 100 (got 7)'),
    ('[[deployment]]\nname = "a b"\nbase_url = "http://h:1"\n', "deployment \"a b\": name: 'a b': letters"),
    ('[[deployment]]\nbase_url = "http://h:1"\n', "deployment #1: name: required"),
    ('[[deployment]]\nname = "x"\nbase_url = "http://h:1"\nready = { url = "http://h:1", timeout_s = "3" }\n',
     'deployment "x": ready.timeout_s: Input should be a valid number'),
    ('[deployment]\nname = "x"\n', "deployments.toml: deployment: expected one or more [[deployment]]"),
    ('[[deployment]]\nname = "x\n', "deployments.toml:2: not valid TOML: "),
])
def test_a_malformed_file_is_one_line_naming_file_entry_and_key(tmp_path, text, message):
    path = write(tmp_path / "deployments.toml", text)
    with pytest.raises(DeploymentFileError) as info:
        deployments.load([path])
    line = str(info.value)
    assert "\n" not in line and line.startswith(str(path).removesuffix("deployments.toml"))
    assert message in line, line


def test_names_are_unique_across_files_and_configs(tmp_path):
    a = write(tmp_path / "a.toml", '[[deployment]]\nname = "x"\nbase_url = "http://h:1"\n')
    b = write(tmp_path / "b.toml", '[[deployment]]\nname = "x"\nepdserve = "pd"\n')
    with pytest.raises(DeploymentFileError, match=f'{b}: deployment "x": name: already used '
                                                  f'by an entry of {a}'):
        deployments.load([a, b])
    c = write(tmp_path / "c.toml", '[[deployment]]\nname = "pd"\nepdserve = "2p1d"\n')
    with pytest.raises(DeploymentFileError, match="already used by --configs"):
        compare.selected(compare_args("--configs", "colocated,pd", "--deployments", str(c)))
    # Without --configs, a deployments file alone runs only its own entries.
    assert [d.name for d in compare.selected(compare_args("--deployments", str(c)))] == ["pd"]
    assert [d.name for d in compare.selected(compare_args())] == ["colocated", "pd"]


def test_variables_and_home_are_expanded_in_command_cwd_and_env(tmp_path):
    dep = deployments.load([write(tmp_path / "d.toml", (
        '[[deployment]]\nname = "x"\nopenai_base_url = "http://127.0.0.1:1/v1"\n'
        '[[deployment.processes]]\ncommand = ["${BIN}", "--port", "${PORT:-8000}", "$literal"]\n'
        'cwd = "~/work"\nenv = { A = "${HOME}/a", B = "${EMPTY:-fallback}" }\n'))])[0]
    env = {"BIN": "/usr/bin/srv", "HOME": os.environ["HOME"], "EMPTY": ""}
    p = dep.resolved_processes(env)[0]
    assert p.command == ["/usr/bin/srv", "--port", "8000", "$literal"]
    assert p.cwd == os.path.expanduser("~/work")
    assert p.env == {"A": os.environ["HOME"] + "/a", "B": "fallback"}
    assert dep.processes[0].command[0] == "${BIN}"  # the entry keeps what was written
    assert dep.record()["processes"][0]["command"][0] == "${BIN}" and dep.record()["source"].endswith("d.toml")
    with pytest.raises(DeploymentFileError, match=r'deployment "x": processes\[0\]\.command\[0\]: '
                                                  r'\$\{BIN\} is not set'):
        dep.resolved_processes({})


def test_resources_of_each_kind(tmp_path):
    def resources(extra: str) -> dict:
        dep = Deployment.model_validate({"name": "x", "base_url": "http://h:1", **extra})
        return processes.Running(dep, tmp_path, processes.LaunchOptions()).resources()

    assert resources({"resources": {"gpus": 8, "price_per_hour": 31.5}}) == {
        "workers": [], "cores": [], "num_cores": None, "device_kind": "GPU", "num_devices": 8,
        "price_per_hour": 31.5}
    assert resources({"resources": {"cpu_cores": 2}})["num_devices"] == 2
    assert resources({})["num_devices"] is None


def test_the_cli_refuses_a_malformed_file_before_starting_anything(tmp_path):
    bad = write(tmp_path / "d.toml", '[[deployment]]\nname = "x"\nbase_url = "http://h:1"\n'
                                     'ready = { url = "http://h:1", timeout_s = 0 }\n')
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "epdserve", "compare", "--deployments", str(bad),
                           "--output", str(out)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip() == (f'epdserve compare: error: {bad}: deployment "x": '
                                   f'ready.timeout_s: must be > 0 (got 0)')
    assert not out.exists()


# ---------------------------------------------------------------------------------------
# Faults, with real processes


def test_a_deployment_that_never_gets_ready_leaves_the_others_running(tmp_path, capsys):
    pid_file, port, stub_port = tmp_path / "sleeper.pid", free_port(), free_port()
    sleeper = ["sh", "-c", f'echo $$ > {pid_file}; echo "loading weights..."; exec sleep 600']
    path = write(tmp_path / "d.toml", (
        f'[[deployment]]\nname = "sleeper"\nopenai_base_url = "http://127.0.0.1:{port}/v1"\n'
        f'ready = {{ url = "http://127.0.0.1:{port}/health", timeout_s = 3 }}\n'
        f'[[deployment.processes]]\ncommand = {json.dumps(sleeper)}\n\n' + stub_entry("stub", stub_port)))
    trace = saved_trace(tmp_path / "t.jsonl", [req(0.0, "one two"), req(0.1, "three four")])
    out = tmp_path / "out"
    rc = compare.run(compare_args("--deployments", str(path), "--trace", str(trace),
                                  "--output", str(out)))
    err = capsys.readouterr().err
    assert rc == 1
    pid = int(pid_file.read_text())
    assert not group_alive(pid)  # stopped when its wait ran out, not left behind
    first, second = json.loads((out / "compare.json").read_text())["configs"]
    assert first["name"] == "sleeper" and "result" not in first
    assert first["error"] == f"http://127.0.0.1:{port}/health did not answer 200 within 3 s"
    assert first["log_tail"] == "loading weights..."
    assert first["deployment"]["source"] == str(path)
    assert "[sleeper] last lines of its log:\nloading weights..." in err
    assert second["result"]["completed"] == 2 and second["result"]["failed"] == 0
    assert second["server"] == {} and second["breakdown"] == {}  # no epdserve trace
    assert second["resources"]["num_devices"] == 1 and second["mode"] is None
    assert (out / "sleeper.p0.log").exists() and (out / "stub.p0.log").exists()
    assert processes.port_is_free(stub_port)
    md = (out / "compare.md").read_text()
    assert "**sleeper failed:**" in md and "| Metric | Better | stub |" in md


def test_repeats_auto_stops_when_the_paired_verdict_is_clear(tmp_path):
    """The default, --repeats auto, against two identical OpenAI stubs (real processes, one
    marked as a PD split, both of one engine): every request meets the SLOs in both, so the
    paired interval is [0, 0], a tie, after one round, and a second puts the machine's drift
    in it; the simpler wins and the report says why it stopped."""
    ports = free_port(), free_port()
    entries = "\n".join(stub_entry(name, port).replace(
        "\nopenai_base_url", f'\nmode = "{mode}"\nengine = "stub"\nopenai_base_url')
                        for name, mode, port in (("one", "colocated", ports[0]), ("split", "pd", ports[1])))
    path = write(tmp_path / "d.toml", entries)
    trace = saved_trace(tmp_path / "t.jsonl", [req(0.1 * i, f"count to {i}", 4) for i in range(6)])
    out = tmp_path / "out"
    assert compare.run(compare_args("--deployments", str(path), "--trace", str(trace), "--output",
                                    str(out), "--warmup", "0", "--repeats", "auto")) == 0
    rec = json.loads((out / "compare.json").read_text())["recommendation"]
    assert rec["choice"] == "one" and rec["verdict"] == "tie" and rec["settled"]
    assert rec["comparison"]["counts"] == {"both": 12, "a_only": 0, "b_only": 0, "neither": 0}
    assert rec["stopped"] == "--repeats auto stopped after 2 rounds: the verdict is clear (tie)."
    md = (out / "compare.md").read_text()
    assert "**one and split tie by goodput (within ±10%" in md and rec["stopped"] in md
    assert all(processes.port_is_free(p) for p in ports)


def test_a_base_url_that_is_not_an_openai_server_is_a_clear_error(tmp_path):
    port = free_port()
    other = subprocess.Popen([sys.executable, "-m", "http.server", str(port), "--bind",
                              "127.0.0.1", "--directory", str(tmp_path)],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                             start_new_session=True)
    try:
        dep = Deployment(name="web", base_url=f"http://127.0.0.1:{port}")
        with pytest.raises(processes.ServerError) as info:
            compare.run_config(dep, [req(0.0, "x")], compare_args(), tmp_path)
        assert info.value.reason.startswith(
            f"http://127.0.0.1:{port} is not an OpenAI-compatible server (GET /v1/models must "
            f'answer 200 with {{"data": [{{"id": ...}}]}}): http://127.0.0.1:{port}/v1/models: '
            f"HTTP 404")
        assert other.poll() is None  # a base URL is never stopped by compare
        # Nothing answers at all: a clear error too, after the wait.
        gone = Deployment(name="gone", base_url=f"http://127.0.0.1:{free_port()}",
                          ready={"url": f"http://127.0.0.1:{free_port()}/v1/models", "timeout_s": 1})
        with pytest.raises(processes.ServerError, match="did not answer 200 within 1 s"):
            compare.run_config(gone, [req(0.0, "x")], compare_args(), tmp_path)
    finally:
        os.killpg(other.pid, signal.SIGTERM)
        other.wait(10)


def test_a_program_that_cannot_run_is_a_clear_error(tmp_path):
    dep = Deployment.model_validate({"name": "missing", "openai_base_url": f"http://127.0.0.1:{free_port()}",
                                     "processes": [{"command": [str(tmp_path / "no-such-server")]}]})
    with pytest.raises(processes.ServerError, match=r"missing\.p0: cannot run '.*no-such-server': "
                                                    r"No such file or directory"):
        compare.run_config(dep, [req(0.0, "x")], compare_args(), tmp_path)


def test_a_process_that_exits_before_ready_gives_its_status_and_log(tmp_path):
    port = free_port()
    dep = Deployment.model_validate({
        "name": "bad", "openai_base_url": f"http://127.0.0.1:{port}/v1",
        "processes": [{"command": ["sh", "-c", "echo 'error: unknown flag --tp'; exit 2"]}]})
    with pytest.raises(processes.ServerError) as info:
        compare.run_config(dep, [req(0.0, "x")], compare_args(), tmp_path)
    assert info.value.reason == (f"bad.p0 exited with status 2 before "
                                 f"http://127.0.0.1:{port}/v1/models answered")
    assert info.value.log_tail == "error: unknown flag --tp"


def test_epdserve_args_are_checked_as_serve_will(tmp_path):
    dep = deployments.load([write(tmp_path / "d.toml", (
        '[[deployment]]\nname = "e"\nepdserve = "pd"\nargs = ["--no-such-flag"]\n'))])
    warnings, errors = compare.preflight(compare_args(), None, dep)
    assert errors == ["[e] args: not epdserve serve options: --no-such-flag"]


@pytest.mark.server
def test_a_deployment_killed_mid_run_counts_its_failures_and_the_next_one_runs(tmp_path):
    """An ``epdserve serve`` started as a processes entry is SIGKILLed by the test during
    the trace: the requests after it fail (counted), the entry says which process died
    with which status, its workers go with it (PR_SET_PDEATHSIG), and the next deployment
    runs."""
    pid_file, port, stub_port = tmp_path / "serve.pid", free_port(), free_port()
    serve = ["sh", "-c", f"echo $$ > {pid_file}; exec {sys.executable} -m epdserve serve "
                         f"--mode colocated --host 127.0.0.1 --port {port}"]
    path = write(tmp_path / "d.toml", (
        f'[[deployment]]\nname = "dies"\nmode = "colocated"\n'
        f'openai_base_url = "http://127.0.0.1:{port}/v1"\n'
        f'ready = {{ url = "http://127.0.0.1:{port}/health", timeout_s = 600 }}\n'
        f'resources = {{ cpu_cores = 2 }}\n'
        f'[[deployment.processes]]\ncommand = {json.dumps(serve)}\n\n' + stub_entry("after", stub_port)))
    # Eight short requests, one every 0.5 s: the kill 1.5 s in leaves most of them unsent.
    trace = saved_trace(tmp_path / "t.jsonl", [req(0.5 * i, f"count to {i}", 8) for i in range(8)])
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "epdserve", "compare", "--deployments", str(path), "--trace",
           str(trace), "--output", str(out), "--warmup", "0", "--disable-tqdm", "--repeats", "1"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    tree, lines = {}, []
    try:
        for line in proc.stdout:
            lines.append(line)
            if "[1/2 dies] sending" in line:
                pid = int(wait_for_file(pid_file))
                tree = host.tree_ticks(pid)  # the launcher and its workers
                time.sleep(1.5)
                os.kill(pid, signal.SIGKILL)
                break
        rest, _ = proc.communicate(timeout=600)
        lines.append(rest)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    log = "".join(lines)
    assert proc.returncode == 1, log
    assert len(tree) >= 2, log  # the launcher and at least one worker were seen
    dies, after = json.loads((out / "compare.json").read_text())["configs"]
    assert dies["died"]["process"] == "dies.p0" and dies["died"]["status"] == -signal.SIGKILL
    assert dies["result"]["failed"] >= 4 and dies["result"]["completed"] + dies["result"]["failed"] == 8
    assert "dies.p0 exited with status -9 during the run" in log
    assert after["result"]["completed"] == 8 and "died" not in after
    deadline = time.monotonic() + 10  # the workers' parent-death SIGKILL lands at once
    while any(_alive(*k) for k in tree) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(*k) for k in tree), "a process of the killed deployment is left"
    assert processes.port_is_free(port) and processes.port_is_free(stub_port)


def test_sigterm_to_compare_stops_every_process_it_started(tmp_path):
    port = free_port()
    pids = [tmp_path / "p0.pid", tmp_path / "p1.pid"]
    first = ["sh", "-c", f"echo $$ > {pids[0]}; exec {' '.join(STUB)} --port {port}"]
    second = ["sh", "-c", f"echo $$ > {pids[1]}; exec sleep 600"]
    path = write(tmp_path / "d.toml", (
        f'[[deployment]]\nname = "two"\nopenai_base_url = "http://127.0.0.1:{port}"\n'
        f'[[deployment.processes]]\ncommand = {json.dumps(first)}\n'
        f'ready = {{ url = "http://127.0.0.1:{port}/health", timeout_s = 60 }}\n'
        f'[[deployment.processes]]\ncommand = {json.dumps(second)}\n'))
    trace = saved_trace(tmp_path / "t.jsonl", [req(0.0, "now"), req(60.0, "a minute later")])
    proc = subprocess.Popen([sys.executable, "-m", "epdserve", "compare", "--deployments", str(path),
                             "--trace", str(trace), "--output", str(tmp_path / "out"),
                             "--disable-tqdm", "--repeats", "1"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        for line in proc.stdout:
            if "[1/1 two] sending" in line:
                break
        time.sleep(0.5)  # into the run: the second request is a minute away
        proc.send_signal(signal.SIGTERM)
        rest, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 130, rest
    assert "interrupted; servers stopped" in rest and "Traceback" not in rest
    for pid in (int(wait_for_file(p)) for p in pids):
        assert not group_alive(pid)
    assert processes.port_is_free(port)


def _alive(pid: int, start_ticks: int) -> bool:
    """True while process ``pid`` started at ``start_ticks`` exists (not a reused pid)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return False
    return int(fields[19]) == start_ticks and fields[0] != "Z"


# ---------------------------------------------------------------------------------------
# llama.cpp's llama-server next to epdserve


@pytest.fixture(scope="session")
def llama_server() -> argparse.Namespace:
    """``binary``: the llama-server built once by ``benchmarks/llama_build.py`` (cached under
    ~/.cache/epdserve; the first build takes many minutes on 2 cores), and the
    ``runtime_flags`` this CPU needs; the tests using it are skipped, with the reason, when
    it cannot be built here."""
    build = load_script("llama_build")
    version = build.LLAMA_CPP_PYTHON_VERSION
    try:
        binary = build.build_llama_server(version, build.default_cache_dir(version))
    except build.BuildError as exc:  # no cmake or compiler, no sdist, a failed build
        pytest.skip(f"llama-server cannot be built here: {str(exc).splitlines()[0]}")
    return argparse.Namespace(binary=binary, runtime_flags=build.runtime_flags())


@pytest.mark.server
def test_llama_server_and_epdserve_colocated_on_the_same_trace(tmp_path, llama_server, model_info,
                                                                monkeypatch):
    monkeypatch.setenv("LLAMA_SERVER", str(llama_server.binary))
    monkeypatch.setenv("EPDSERVE_GGUF", str(model_info.source))
    port = free_port()
    llama = ["${LLAMA_SERVER}", "-m", "${EPDSERVE_GGUF}", "--host", "127.0.0.1", "--port",
             str(port), "--alias", "smollm2", "--parallel", "4", "--ctx-size", "4096",
             "--threads", "2", "--threads-batch", "2", "--cont-batching", "--jinja",
             "--no-webui", "--metrics", *llama_server.runtime_flags]
    path = write(tmp_path / "d.toml", (
        f'[[deployment]]\nname = "llama-server"\nmode = "colocated"\n'
        f'openai_base_url = "http://127.0.0.1:{port}/v1"\n'
        f'ready = {{ url = "http://127.0.0.1:{port}/health", timeout_s = 120 }}\n'
        f'metrics_urls = ["http://127.0.0.1:{port}/metrics"]\nresources = {{ cpu_cores = 2 }}\n'
        f'[[deployment.processes]]\ncommand = {json.dumps(llama)}\n\n'
        f'[[deployment]]\nname = "epdserve-colocated"\nepdserve = "colocated"\n'))
    trace = saved_trace(tmp_path / "t.jsonl", [
        req(0.3 * i, f"Tell me a short fact about the number {i}.", 12) for i in range(6)])
    out = tmp_path / "out"
    rc = compare.run(compare_args("--deployments", str(path), "--trace", str(trace), "--output",
                                  str(out), "--port", str(free_port())))
    assert rc == 0
    llama_entry, epd = json.loads((out / "compare.json").read_text())["configs"]
    for e in (llama_entry, epd):
        assert (e["result"]["completed"], e["result"]["failed"]) == (6, 0), e["result"]["errors"]
    assert llama_entry["result"]["model_id"] == "smollm2"
    assert llama_entry["resources"] == {"workers": [], "cores": [], "num_cores": 2,
                                        "device_kind": "core", "num_devices": 2,
                                        "price_per_hour": None}
    assert llama_entry["metrics_urls"] == [f"http://127.0.0.1:{port}/metrics"]
    assert llama_entry["server"] == {} and llama_entry["breakdown"] == {}
    assert epd["resources"]["device_kind"] == "core"
    assert epd["resources"]["num_devices"] == epd["resources"]["num_cores"] >= 1
    assert epd["server"]["matched_client_requests"] == 6
    assert (out / "llama-server.p0.log").stat().st_size > 0
    assert (out / "epdserve-colocated.server.log").stat().st_size > 0
    header, rows = report.table([llama_entry, epd])
    assert header[:4] == ["Metric", "Better", "llama-server", "epdserve-colocated"]
    by_label = {r[0]: r[2:4] for r in rows}
    assert by_label["Cores"] == ["2", str(epd["resources"]["num_cores"])]
    per_core = [label for label in by_label if "per core" in label]
    assert per_core  # per-device rows: computed from resources
    for label in per_core:
        assert "—" not in by_label[label], (label, by_label[label])
    # The server's own view through /metrics, over the measured requests (not the warm-up):
    # epdserve counts each request; llama.cpp counts none, its means divide by the client's.
    assert epd["server_metrics"]["engine"] == "epdserve"
    assert epd["server_metrics"]["stages"]["ttft"]["count"] == 6
    assert epd["server_metrics"]["stages"]["requests"]["delta"] == 6
    lm = llama_entry["server_metrics"]
    assert lm["engine"] == "llama.cpp" and lm["warnings"] == []
    assert lm["stages"]["ttft"] is None and lm["stages"]["prefill"]["requests"] == 6
    assert lm["stages"]["decode"]["mean_ms"] > 0
    assert processes.port_is_free(port)
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)
