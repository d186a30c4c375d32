"""A real Prometheus server (Debian's ``prometheus`` package: ``make prometheus``) scraping one
deployment's ``/metrics`` every second, and the PromQL of vLLM's Grafana dashboard asked of it.

The dashboard's queries are rebuilt from ``tests/data/vllm_grafana_metrics.txt`` (every ``vllm:``
family the dashboard reads, its type and the labels it groups by) in the forms its panels use:
``histogram_quantile`` of a histogram's bucket rates and its mean (``_sum`` over ``_count``
rates), a counter's rate (grouped by its label where the panel groups), a gauge as it is. The
dashboard's ``$__rate_interval`` becomes ``RATE_WINDOW``."""

from __future__ import annotations

import math
import shutil
import socket
import subprocess
import time
from pathlib import Path

import httpx

DASHBOARD = Path(__file__).resolve().parent.parent / "tests" / "data" / "vllm_grafana_metrics.txt"
RATE_WINDOW = "2m"
SCRAPE_INTERVAL = "1s"
EXTRA_QUERIES = ("epdserve:request_migrations_total", "sum(epdserve:worker_up)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def installed() -> str | None:
    """The ``prometheus`` binary's path, None when it is not installed."""
    return shutil.which("prometheus")


def dashboard_queries(url: str) -> list[str]:
    """The dashboard's queries for the model ``url`` serves (its first ``/v1/models`` id)."""
    model = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
    sel = f'{{model_name="{model}"}}'
    queries = []
    for line in DASHBOARD.read_text().splitlines():
        if not line or line.startswith("#"):
            continue
        name, kind, *labels = line.split()
        if kind == "histogram":
            queries += [f"histogram_quantile(0.99, sum by(le) (rate({name}_bucket{sel}[{RATE_WINDOW}])))",
                        f"rate({name}_sum{sel}[{RATE_WINDOW}]) / rate({name}_count{sel}[{RATE_WINDOW}])"]
        elif kind == "counter":
            by = f"sum by({','.join(labels)}) " if labels else ""
            queries.append(f"{by}(increase({name}_total{sel}[{RATE_WINDOW}]))" if labels
                           else f"rate({name}_total{sel}[{RATE_WINDOW}])")
        else:
            queries.append(f"{name}{sel}")
    return queries + list(EXTRA_QUERIES)


class Prometheus:
    """A Prometheus server on a free local port, its data in ``directory``, scraping
    ``127.0.0.1:target_port``. Raises RuntimeError (:meth:`start`): not installed, or not ready."""

    def __init__(self, directory: Path, target_port: int):
        self.directory, self.target_port = directory, target_port
        self.port = free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 60.0) -> None:
        binary = installed()
        if binary is None:
            raise RuntimeError("prometheus is not installed (make prometheus: Debian's package)")
        self.directory.mkdir(parents=True, exist_ok=True)
        config = self.directory / "prometheus.yml"
        config.write_text(f"global:\n  scrape_interval: {SCRAPE_INTERVAL}\n  evaluation_interval: {SCRAPE_INTERVAL}\n"
                          f"scrape_configs:\n  - job_name: epdserve\n    static_configs:\n"
                          f"      - targets: ['127.0.0.1:{self.target_port}']\n")
        with open(self.directory / "prometheus.log", "w") as log:
            self.proc = subprocess.Popen([binary, f"--config.file={config}", f"--storage.tsdb.path={self.directory}/data",
                                          f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"],
                                         stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout_s
        while not self._ready():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"prometheus did not become ready: {(self.directory / 'prometheus.log').read_text()[-2000:]}")
            time.sleep(0.2)

    def _ready(self) -> bool:
        try:
            return httpx.get(self.url + "/-/ready", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def ask(self, queries: list[str]) -> list[dict]:
        """Each query's ``series`` (how many returned a finite value) and a ``sample`` of them."""
        out = []
        for query in queries:
            body = httpx.get(self.url + "/api/v1/query", params={"query": query}, timeout=30).json()
            result = body.get("data", {}).get("result", [])
            finite = [r for r in result if math.isfinite(float(r["value"][1]))]
            out.append({"query": query, "status": body.get("status"), "series": len(finite),
                        "sample": [{**r["metric"], "value": r["value"][1]} for r in finite[:3]]})
        return out

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
