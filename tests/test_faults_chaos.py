"""The chaos soak's short version (``benchmarks/chaos.py``, whose 10-minute run is a benchmark): a
2P2D deployment under steady load while two workers are killed with kill -9 and another is stopped
past ``--worker-timeout``, with Debian's Prometheus scraping it. No request fails, every text and
token count equals the fault-free run's, nothing is left held, and every query of vLLM's Grafana
dashboard, and the migration counter, returns data from Prometheus."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import free_port

pytestmark = pytest.mark.faults

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
from prometheus_scrape import installed  # noqa: E402


@pytest.mark.skipif(installed() is None, reason="prometheus is not installed: make prometheus (Debian's package)")
def test_a_short_chaos_run_loses_nothing_and_prometheus_reads_it(tmp_path):
    argv = [sys.executable, str(BENCHMARKS / "chaos.py"), "--minutes", "1", "--rate", "0.8", "--prompts", "8",
            "--kill-every", "25", "--stop-every", "35", "--stop-for", "8", "--prometheus", "--port", str(free_port()),
            "--output", str(tmp_path)]
    run = subprocess.run(argv, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    v = json.loads((tmp_path / "chaos.json").read_text())["verdicts"]

    assert v["kills"] == 2 and v["stops"] == 1
    assert v["failed"] == 0 and v["texts_differing"] == 0 and v["completed"] == v["requests"] > 0
    assert not [q["query"] for q in v["prometheus"] if not q["series"]]
    assert (tmp_path / "chaos.png").stat().st_size > 0
    print(f"\nchaos: {v['requests']} requests, {v['migrated']} moved, {v['tokens_checked']} tokens checked; "
          f"TTFT p99 during faults {v['latency']['during_faults']['ttft_p99_ms']} ms, quiet "
          f"{v['latency']['quiet']['ttft_p99_ms']} ms")
