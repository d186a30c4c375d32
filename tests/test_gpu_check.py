"""benchmarks/gpu_check.py end to end on the CPU (``--device cpu --smoke``): every section
runs at tiny shapes (a real transformers model for parity, two gloo rank processes for
tensor_parallel, real ``epdserve serve`` deployments for the 1P1D hand-off and the bursty
trace) and the JSON has the keys and the values a GPU run reports. Speeds are not asserted
(a CPU is no GPU); counts and bytes are."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "gpu_check.py"
TIMEOUT_S = 900


def run_smoke(output: Path) -> subprocess.CompletedProcess:
    """Run the script; on a timeout, SIGINT first, so that it stops its deployments."""
    proc = subprocess.Popen([sys.executable, str(SCRIPT), "--device", "cpu", "--smoke", "--output", str(output)],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        out, _ = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGINT)
        try:
            out, _ = proc.communicate(timeout=90)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
        raise AssertionError(f"gpu_check --smoke ran over {TIMEOUT_S} s:\n{out[-4000:]}") from None
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, "")


@pytest.mark.server
def test_gpu_check_smoke_writes_every_section(tmp_path):
    output = tmp_path / "gpu_check.json"
    proc = run_smoke(output)
    assert proc.returncode == 0, proc.stdout[-4000:]
    r = json.loads(output.read_text())
    failed = {k: v.get("error") for k, v in r.items() if isinstance(v, dict) and v.get("ok") is False}
    assert not failed, failed
    assert r["meta"]["device"] == "cpu" and r["meta"]["smoke"] is True

    assert r["ceilings"]["matmul_tflops"] > 0 and r["ceilings"]["bandwidth_gbps"] > 0
    assert r["parity"]["exact"] is True and r["parity"]["tokens_equal_batched"] == r["parity"]["tokens"] == 32

    tp = r["tensor_parallel"]
    assert (tp["backend"], tp["devices"], tp["size"]) == ("gloo", ["cpu", "cpu"], 2) and "note" in tp
    assert tp["tokens_equal"] is True and tp["ranks_agree"] is True and tp["tokens_equal_count"] == tp["tokens"] == 32
    assert 0 <= tp["max_abs_logit_diff"] < 1e-3 and tp["tp2_collective_ms"]["decode"] > 0
    assert [(row["rows"], row["per_step"]) for row in tp["all_reduce"]] == [(4, 7), (119, 7), (1, 5), (4, 5), (64, 5)]
    assert all(row["ms"] > 0 for row in tp["all_reduce"])
    # The KV hand-off across TP sizes through the real exporter and importer: TP=1 -> TP=1's tokens and bytes.
    handoff = tp["handoff"]
    assert handoff["tokens_equal"] is True and handoff["kv_bytes_equal"] is True
    assert [len(t) for t in handoff["tp2_to_tp1"]["tokens"]] == [8] * 4 and min(handoff["tp1_to_tp2"]["kv_bytes"]) > 0

    prefill = r["throughput"]["prefill"]
    assert (prefill["prompts"], prefill["prompt_len"]) == (2, 64) and prefill["vs_matmul_peak"] > 0
    assert sorted(r["throughput"]["decode"]) == ["1", "4"]
    for batch, row in r["throughput"]["decode"].items():
        assert row["tokens"] == int(batch) * row["steps"] and 0 < row["vs_bandwidth_bound"]
    assert r["ipc_copy"] == {"ok": None, "skipped": "CUDA only"}

    # Tiny shape on the CPU: 2 layers x K/V x 2 heads x 32 dims x float32 per token, whole 16-token blocks.
    for tokens in (32, 64):
        row = r["handoff_1p1d"][str(tokens)]
        raw = tokens * 2 * 2 * 2 * 32 * 4
        assert raw <= row["kv_bytes"] < raw + 4096, row
        assert row["kv_tcp"] == 0.0 and row["handoff_ms"]["n"] == 2 and row["gbps"] > 0 and row["d2d_gbps"] > 0

    trace = r["bursty"]["trace"]
    for mode in ("pd", "colocated"):
        summary = r["bursty"][mode]
        assert summary["ok"] and summary["errors"] == []
        assert summary["chat"]["ttft_ms"]["n"] == trace["chats"]
        assert summary["long"]["ttft_ms"]["n"] == trace["long_prompts"]
        gaps = trace["chats"] * (trace["chat_tokens"] - 1) + trace["long_prompts"] * (trace["long_tokens"] - 1)
        assert summary["all"]["itl_ms"]["n"] == gaps
        assert summary["all"]["ttft_ms"]["p50"] <= summary["all"]["ttft_ms"]["p99"]

    goals = {g["goal"]: g for g in r["goals"]}
    assert goals["parity_exact"]["met"] is True and goals["ipc_ms_2048"]["value"] is None
    assert goals["tp2_tokens_equal"]["met"] is True and goals["tp_handoff_tokens_equal"]["met"] is True
    assert "goal parity_exact" in proc.stdout and "ceiling" in proc.stdout
