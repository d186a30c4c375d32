"""``epdserve serve --cluster ray`` on a real one-node Ray cluster (``ray start --head``,
stopped by the module on every outcome):

* 1P1D: the workers are Ray actors on the one node; /health and /metrics say where they
  run, and the KV hand-off goes by shared memory (the trace's ``kv_tcp`` is 0);
* 1P2D, kill -9 of a decode actor's process mid-stream: its stream ends with an error
  event, the stream on the other decode worker finishes, Ray restarts the actor (no
  launcher loop), the next request succeeds and no KV block stays in use;
* 1E1P1D with the vision-language model: the encode worker is an actor too, the
  embeddings and the KV go by shared memory, and the answer equals a local colocated one;
* bad cluster options stop ``serve`` with a one-line error naming the value.

The helpers here (a Ray node started in a session of its own and stopped by killing that
session) serve tests/test_ray_multinode.py too.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest

from conftest import _stop, free_port, interrupt, start_deployment
from test_faults_workers import kill_mid_stream, states, streams_on_two_decoders, wait_for
from test_serving_cleanup import wait_all_free

from epdserve.bench import deployments, server_trace
from epdserve.serving.launch.ray_cluster import parse_resources

pytestmark = pytest.mark.cluster

RAY = str(Path(sys.executable).with_name("ray"))
RESTART_TIMEOUT_S = 120
PROMPT = "The lighthouse keeper climbed the spiral stairs every evening at dusk, and"


class RayNode:
    """One ``ray start`` (head or joining) in a session of its own, with its own temporary
    directory: :meth:`stop` kills every process of that session (Ray's daemons keep it,
    whatever name they give themselves), so nothing outlives the test and no other Ray
    cluster is touched. ``netns``: run it inside that network namespace.

    Raises (constructor):
        RuntimeError: ``ray start`` failed (its output says why).
    """

    def __init__(self, *args: str, netns: str | None = None, num_cpus: int = 4):
        # Short: Ray puts unix sockets under it (at most 107 bytes a path).
        self.temp_dir = tempfile.mkdtemp(prefix="epray-", dir="/tmp")
        argv = [RAY, "start", *args, "--num-cpus", str(num_cpus), "--object-store-memory", str(80 * 2**20),
                "--disable-usage-stats", "--temp-dir", self.temp_dir]
        if "--head" in args:  # the head's option only
            argv.append("--include-dashboard=false")
        if netns:
            argv = ["ip", "netns", "exec", netns, *argv]
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True, env=dict(os.environ, RAY_USAGE_STATS_ENABLED="0"))
        self.session = proc.pid
        try:
            out, _ = proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            self.stop()
            raise RuntimeError(f"{' '.join(argv)} did not return in 120 s") from None
        if proc.returncode != 0:
            self.stop()
            raise RuntimeError(f"{' '.join(argv)} failed:\n{out[-3000:]}")

    def pids(self) -> list[int]:
        """The live processes of this node's session."""
        out = []
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                try:
                    stat = (entry / "stat").read_text()
                except OSError:
                    continue
                if int(stat.rsplit(")", 1)[1].split()[3]) == self.session:  # field 6: session id
                    out.append(int(entry.name))
        return out

    def raylet_pid(self) -> int:
        """The pid of this node's raylet."""
        for pid in self.pids():
            try:
                if Path(f"/proc/{pid}/comm").read_text().strip() == "raylet":
                    return pid
            except OSError:
                continue
        raise LookupError(f"no raylet in session {self.session}")

    def stop(self) -> None:
        """SIGTERM every process of the session, SIGKILL what is left after 10 s, remove
        the temporary directory. Idempotent."""
        for sig, wait_s in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
            for pid in self.pids():
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + wait_s
            while self.pids() and time.monotonic() < deadline:
                time.sleep(0.2)
        shutil.rmtree(self.temp_dir, ignore_errors=True)


def ray_deployment(mode: str, directory: Path, address: str, *extra: str):
    """``epdserve serve --mode MODE --cluster ray --ray-address ADDRESS`` (small KV pools)."""
    return start_deployment(mode, directory, "--cluster", "ray", "--ray-address", address,
                            "--kv-cache-memory-mb", "128", *extra)


def worker(dep, worker_id: str) -> dict:
    """``worker_id``'s /health entry."""
    return next(w for w in dep.health()["workers"] if w["worker_id"] == worker_id)


def one_node(num_cpus: int, *args: str):
    """A one-node Ray cluster of ``num_cpus`` logical CPUs (and ``ray start``'s ``args``),
    stopped after: yields its GCS address (the body of a module's ``ray_head`` fixture)."""
    port = free_port()
    node = RayNode("--head", "--port", str(port), *args, num_cpus=num_cpus)
    try:
        yield f"127.0.0.1:{port}"
    finally:
        node.stop()


@pytest.fixture(scope="module")
def ray_head():
    """A one-node Ray cluster (4 logical CPUs); its GCS address."""
    yield from one_node(4)


def test_one_node_pd_hands_kv_over_shared_memory(ray_head, tmp_path):
    dep = ray_deployment("pd", tmp_path, ray_head)
    try:
        result = dep.generate("completion", PROMPT, stream=False, max_tokens=12, temperature=0,
                              extra_body={"ignore_eos": True})
        trace = dep.trace(result.id)
        prefill, decode = worker(dep, "prefill-0"), worker(dep, "decode-0")
        assert trace["path"] == "disaggregated" and trace["kv_bytes"] > 0
        assert trace["kv_tcp"] == 0.0, trace  # same node: shared memory
        assert prefill["node_id"] == decode["node_id"] and len(prefill["node_id"]) > 16
        assert trace["prefill_node"] == trace["decode_node"] == prefill["node_id"]
        assert prefill["resources"] == {"CPU": 1.0} and decode["state"] == "up"
        assert prefill["addr"].startswith(f"tcp://{prefill['node_ip']}:")
        metrics = httpx.get(dep.url + "/metrics", timeout=10).text
        assert (f'epdserve:worker_node_info{{engine="decode-0",model_name="{dep.openai().models.list().data[0].id}",'
                f'node="{decode["node_id"]}",node_ip="{decode["node_ip"]}",role="decode",worker="decode-0"}} 1.0'
                in metrics)
    finally:
        interrupt(dep.proc)
    log = dep.log_tail(10**6)
    assert dep.proc.returncode == 0 and "all workers stopped" in log
    assert "Ray restarts it" not in log  # nothing died on the way
    # The actors are gone and their placement groups removed: the cluster holds nothing.
    wait_for(lambda: " 0.0/4.0 CPU" in cluster_status(ray_head), 30, "the cluster's CPUs free again")


def test_epd_runs_every_role_as_an_actor(ray_head, tmp_path):
    from test_epd import ask, picture

    image = picture(3)
    dep = ray_deployment("epd", tmp_path, ray_head, "--model", "vlm")
    try:
        assert sorted((w["role"], bool(w["node_id"])) for w in dep.health()["workers"]) == \
            [("decode", True), ("encode", True), ("prefill", True)]
        answer = ask(dep, image)
        trace = dep.trace(answer.id)
        assert trace["encode_workers"] == ["encode-0"] and trace["embedding_bytes"] > 0
        assert trace["kv_tcp"] == 0.0 and trace["prefill_node"] == trace["decode_node"]
    finally:
        _stop(dep.proc)
    local = start_deployment("colocated", tmp_path, "--model", "vlm")
    try:
        assert ask(local, image).text == answer.text
    finally:
        _stop(local.proc)


def test_unplaceable_role_stops_serve_and_frees_the_cluster(ray_head):
    proc = subprocess.run([sys.executable, "-m", "epdserve", "serve", "--mode", "pd", "--cluster", "ray",
                           "--ray-address", ray_head, "--decode-resources", "CPU=1,gpu_node=1", "--startup-timeout", "5",
                           "--port", "0", "--kv-cache-memory-mb", "128"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "Ray could not place 1 decode worker(s) of CPU=1,gpu_node=1 (PACK) within 5 s" in proc.stderr
    assert "Traceback" not in proc.stderr
    # The prefill actor started before it and both placement groups are gone.
    wait_for(lambda: " 0.0/4.0 CPU" in cluster_status(ray_head), 30, "the cluster's CPUs free again")


def cluster_status(address: str) -> str:
    """``ray status`` of the cluster at ``address``."""
    return subprocess.run([RAY, "status", "--address", address], capture_output=True, text=True, timeout=60).stdout


def test_kill_decode_actor_mid_stream(ray_head, tmp_path):
    dep = ray_deployment("pd", tmp_path, ray_head, "--decode-workers", "2", "--migration-limit", "0")
    try:
        wait_for(lambda: all(s == "up" for s in states(dep).values()), 60, "every worker up")
        victim, victim_stream, other_stream = streams_on_two_decoders(dep)
        old_pid = worker(dep, victim)["pid"]  # the actor's own process: the worker runs in it
        t_kill, t_error = kill_mid_stream(old_pid, victim, victim_stream, other_stream)

        wait_for(lambda: worker(dep, victim)["state"] == "up" and worker(dep, victim)["pid"] != old_pid,
                 RESTART_TIMEOUT_S, f"Ray to restart {victim}")
        print(f"\nkill -9 {victim} (Ray actor): error event after {t_error:.2f} s, "
              f"restarted by Ray after {time.monotonic() - t_kill:.1f} s")
        again = dep.generate("completion", other_stream.body["prompt"], stream=False, max_tokens=60,
                             temperature=0, extra_body={"ignore_eos": True})
        assert again.text == other_stream.text
        wait_all_free(dep.url)
    finally:
        _stop(dep.proc)
    assert "restarting it" not in dep.log_tail(10**6)  # no launcher restart loop on Ray


@pytest.mark.parametrize("value,message", [
    ("CPU=one", "--decode-resources 'CPU=one': 'CPU=one': the amount is not a number"),
    ("node_a", "--decode-resources 'node_a': 'node_a' is not NAME=AMOUNT"),
    ("GPU=-1", "--decode-resources 'GPU=-1': 'GPU=-1': the amount must be a finite number >= 0"),
    ("CPU=1,CPU=2", "CPU is given twice"),
])
def test_bad_resources_name_the_value(value, message):
    with pytest.raises(ValueError) as err:
        parse_resources(value, "--decode-resources")
    assert message in str(err.value)
    assert parse_resources("GPU=0.5,node_b=1", "--decode-resources") == {"GPU": 0.5, "node_b": 1.0, "CPU": 1.0}


def test_bad_resources_stop_serve_with_status_2():
    proc = subprocess.run([sys.executable, "-m", "epdserve", "serve", "--cluster", "ray", "--prefill-resources",
                           "CPU=one", "--port", "0"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "--prefill-resources 'CPU=one'" in proc.stderr and "Traceback" not in proc.stderr


def test_no_cluster_at_the_address_is_a_clear_error():
    address = f"127.0.0.1:{free_port()}"
    proc = subprocess.run([sys.executable, "-m", "epdserve", "serve", "--cluster", "ray", "--ray-address", address,
                           "--port", "0"], capture_output=True, text=True, timeout=180)
    assert proc.returncode == 1, proc.stderr
    assert f"--ray-address {address}: cannot join a Ray cluster: nothing answers there" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_deployment_entry_names_the_cluster(tmp_path):
    path = tmp_path / "deployments.toml"
    path.write_text('[[deployment]]\nname = "pd-ray"\nepdserve = "1p1d"\ncluster = "ray"\n'
                    'ray_address = "10.0.0.1:6379"\nray_resources = {prefill = "CPU=1,node_a=1"}\n'
                    'ray_placement = {decode = "SPREAD"}\nargs = ["--max-num-seqs", "8"]\n'
                    '[[deployment]]\nname = "pd-local"\nepdserve = "1p1d"\n')
    ray_entry, local_entry = deployments.load([path])
    assert ray_entry.args == ["--cluster", "ray", "--ray-address", "10.0.0.1:6379", "--prefill-resources",
                              "CPU=1,node_a=1", "--decode-placement", "SPREAD", "--max-num-seqs", "8"]
    assert local_entry.args is None and ray_entry.record()["cluster"] == "ray"
    path.write_text('[[deployment]]\nname = "x"\nepdserve = "1p1d"\ncluster = "ray"\n'
                    'ray_resources = {decode = "CPU=lots"}\n')
    with pytest.raises(deployments.DeploymentFileError, match="ray_resources.decode 'CPU=lots'"):
        deployments.load([path])


def test_trace_summary_splits_same_node_and_cross_node_handoffs(tmp_path):
    path = tmp_path / "trace.jsonl"
    stages = {"mode": "pd", "path": "disaggregated", "kv_export_ms": 1.0, "kv_fetch_ms": 2.0, "kv_import_ms": 1.0}
    lines = [dict(stages, request_id="a", kv_tcp=0.0, kv_bytes=1000.0),
             dict(stages, request_id="b", kv_tcp=1.0, kv_bytes=3000.0, kv_fetch_ms=10.0),
             dict(stages, request_id="c", kv_tcp=1.0, kv_bytes=5000.0, kv_fetch_ms=20.0),
             {"request_id": "d", "mode": "colocated"}]
    path.write_text("".join(json.dumps(rec) + "\n" for rec in lines))
    summary = server_trace.summarize(path)
    assert summary["same_node_requests"] == 1 and summary["cross_node_requests"] == 2
    assert summary["mean_kv_bytes_same_node"] == 1000.0 and summary["mean_kv_bytes_cross_node"] == 4000.0
    assert summary["mean_kv_transfer_ms_same_node"] == 4.0 and summary["mean_kv_transfer_ms_cross_node"] == 17.0
