"""Conditional disaggregation: with ``--local-prefill-threshold N`` a pd deployment sends a
prompt shorter than N tokens straight to a decode worker, which prefills it itself (no
prefill worker, no KV hand-off), and still answers exactly as colocated; longer prompts and
a threshold of 0 take the prefill -> decode path."""

from __future__ import annotations

import subprocess
import sys

import httpx
from prometheus_client.parser import text_string_to_metric_families

from conftest import _stop, start_deployment

SHORT = "The capital of France is"


def prefill_queue_count(url: str) -> float:
    """How many requests a prefill worker queued, from /metrics."""
    for family in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=10).text):
        if family.name == "epdserve:request_queue_time_seconds":
            return sum(s.value for s in family.samples
                       if s.name.endswith("_count") and s.labels.get("stage") == "prefill")
    return 0.0


def test_short_prompts_prefill_on_the_decode_worker(tmp_path, tokenizer, colocated_server, pd_server):
    long = tokenizer.decode(list(range(1000, 1100)))  # ~100 tokens, over the threshold
    dep = start_deployment("pd", tmp_path, "--local-prefill-threshold", "64")
    try:
        local = dep.generate("completion", SHORT, stream=True, max_tokens=16, temperature=0)
        rec = dep.trace(local.id)
        assert rec["path"] == "local" and rec["prompt_tokens"] < 64
        assert rec["prefill_worker"] is None and rec["decode_worker"] == "decode-0"
        assert "kv_transfer_ms" not in rec and rec["prefill_ms"] > 0 and rec["decode_queue_ms"] >= 0
        assert prefill_queue_count(dep.url) == 0  # the prefill worker got nothing

        handed = dep.generate("completion", long, stream=False, max_tokens=8, temperature=0)
        rec = dep.trace(handed.id)
        assert rec["path"] == "disaggregated" and rec["prefill_worker"] == "prefill-0"
        assert prefill_queue_count(dep.url) == 1

        for prompt, result in ((SHORT, local), (long, handed)):
            colo = colocated_server.generate("completion", prompt, stream=False,
                                             max_tokens=result.usage.completion_tokens, temperature=0)
            assert result.text == colo.text
    finally:
        _stop(dep.proc)

    # Threshold 0 (the default): every prompt is disaggregated.
    default = pd_server.generate("completion", SHORT, stream=False, max_tokens=4, temperature=0)
    rec = pd_server.trace(default.id)
    assert rec["path"] == "disaggregated" and rec["prefill_worker"] is not None


def test_negative_threshold_is_refused():
    proc = subprocess.run([sys.executable, "-m", "epdserve", "serve", "--mode", "pd",
                           "--local-prefill-threshold", "-5"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "--local-prefill-threshold" in proc.stderr and "'-5': must be >= 0" in proc.stderr
