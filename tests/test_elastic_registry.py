"""The router's side of a live role switch (issue 20), in process: the registry and the
request flows of tests/test_router_flows.py (a fake port records what would go to the
workers), an elastic registry. Paths follow the roles live when a request arrives; a
switch routes by the new role at once and is announced by the worker's RoleSwitched; a
request keeps the role it was sent in; the decode stage never goes back to the worker
that prefilled; the controller applies a decision and writes it to the trace."""

from __future__ import annotations

import pytest

from epdserve.serving import protocol as P
from epdserve.serving.elastic_policy import Decision, PolicyConfig, window
from epdserve.serving.router.elastic import Controller
from epdserve.serving.router.flows import DisaggregatedFlow, FlowConfig, LocalPrefillFlow, SingleWorkerFlow
from epdserve.serving.router.registry import Compat, Registry
from epdserve.serving.router.signals import SignalRecorder
from test_router_flows import KV, Reader, Setup, hello, run


class ElasticSetup(Setup):
    """An elastic registry (started colocated) with workers ``w0``, ``w1``; ``lines``: the
    trace lines it wrote."""

    def __init__(self, roles=("colocated", "colocated")):
        super().__init__("colocated")
        self.lines: list[dict] = []
        self.signals = SignalRecorder()
        self.registry = Registry("colocated", self.port, Compat("fp", {"num_layers": 2}), elastic=True,
                                 on_event=self.lines.append)
        self.config = FlowConfig("colocated", poll_s=0.02, clock=self.clock, elastic=True, signals=self.signals)
        for i, role in enumerate(roles):
            self.registry.on_message(hello(f"w{i}", role), self.clock())

    def switched(self, wid: str) -> None:
        """The worker answers its last SetRole."""
        set_role = self.port.of(wid, P.SetRole)[-1]
        w = self.registry.workers[wid]
        self.registry.on_message(P.RoleSwitched(worker_id=wid, role=set_role.role, previous=w.announced,
                                                switch_id=set_role.switch_id, drain_ms=12.5), self.clock())


def test_any_engine_role_joins_and_paths_follow_the_live_roles():
    s = ElasticSetup()
    assert s.registry.ready() and s.registry.serving_path() == "colocated"
    assert isinstance(s.flow("a"), SingleWorkerFlow)
    s.registry.set_role("w0", "prefill", "test")
    assert s.registry.serving_path() == "disaggregated"  # w1 colocated decodes hand-offs
    assert isinstance(s.flow("b"), DisaggregatedFlow)
    s.registry.set_role("w0", "decode")
    s.registry.set_role("w1", "decode")
    assert s.registry.serving_path() == "local" and isinstance(s.flow("c"), LocalPrefillFlow)
    with pytest.raises(ValueError, match="epd is not supported"):
        Registry("epd", s.port, Compat("fp", {}), elastic=True)


def test_a_switch_routes_at_once_and_is_announced_by_the_worker():
    s = ElasticSetup()
    s.registry.set_role("w0", "prefill", "because")
    w = s.registry.workers["w0"]
    [msg] = s.port.of("w0", P.SetRole)
    assert (msg.role, w.role, w.announced, w.switch_id) == ("prefill", "prefill", "colocated", msg.switch_id)
    assert w.as_json(0.0)["switching"] is True
    stale = P.RoleSwitched(worker_id="w0", role="prefill", previous="colocated", switch_id="other", drain_ms=1)
    s.registry.on_message(stale, s.clock())  # an answer to a replaced SetRole: ignored
    assert w.switch_id is not None
    s.switched("w0")
    assert (w.role, w.announced, w.switch_id) == ("prefill", "prefill", None)
    states = [(line["worker"], line["state"], line["role"], line["previous"]) for line in s.lines]
    assert states == [("w0", "up", "colocated", None), ("w1", "up", "colocated", None),
                      ("w0", "switching", "prefill", "colocated"), ("w0", "switched", "prefill", "colocated")]
    assert s.lines[2]["reason"] == "because" and s.lines[3]["drain_ms"] == 12.5
    metrics = s.registry.metrics.render().decode()
    assert 'epdserve:worker_role{model_name="epdserve",role="prefill",worker="w0"} 1.0' in metrics
    assert 'epdserve:role_switches_total{from_role="colocated",model_name="epdserve",to_role="prefill",worker="w0"} 1.0' in metrics
    s.registry.set_role("w0", "prefill")  # already: nothing sent
    assert len(s.port.of("w0", P.SetRole)) == 1
    for bad in [("w9", "decode"), ("w0", "encode")]:
        with pytest.raises(ValueError, match="cannot switch"):
            s.registry.set_role(*bad)
    static = Setup("colocated", "colocated-0").registry
    with pytest.raises(ValueError, match="elastic: False"):
        static.set_role("colocated-0", "prefill")


def test_a_request_keeps_its_role_and_decode_never_returns_to_its_prefill_worker():
    """w0 prefills a request, then both workers go colocated before its KV comes: the decode
    stage goes to w1 (colocated, the fallback), not back to w0, and the trace keeps w0 as
    the prefill worker; the prefill's timings are recorded as prefill's."""
    s = ElasticSetup(("prefill", "decode"))

    async def go():
        flow = s.flow()
        reader = Reader(flow)
        await reader.step()
        s.registry.set_role("w0", "colocated")
        s.registry.set_role("w1", "colocated")
        s.registry.on_message(P.Output(worker_id="w0", request_id="r1", token_ids=[9], kv=KV,
                                       timings=P.StageTimings(prefill_ms=5.0, queue_ms=1.0)), s.clock())
        await reader.step()
        await reader.step()
        assert s.port.of("w0", P.AddRequest)[0].kv is None
        assert [a.kv for a in s.port.of("w1", P.AddRequest)] == [KV]
        s.output("w1", (10,), finished=True)
        await reader.drain()
        assert s.port.frees() == [("w0", "release_kv")]
        rec = flow.trace()
        assert (rec.prefill_worker, rec.decode_worker, rec.mode, rec.path) == ("w0", "w1", "pd", "disaggregated")
        assert rec.prefill_ms == 5.0 and rec.prefill_queue_ms == 1.0
        arrivals, ttfts, queues, itls, computed = s.signals.take()
        assert arrivals == ((3, 4),) and len(ttfts) == 1 and len(queues) == 1 and computed == (3,)

    run(go())


def test_the_controller_keeps_the_policys_window_and_traces_every_sample():
    """The real policy, tick after tick: every sample is traced and the controller keeps
    exactly the window the policy reads (the last 20 s, extended back to hold 8 arrivals)."""
    s = ElasticSetup()
    lines: list[dict] = []
    config = PolicyConfig(slo_ttft_ms=2000, slo_tpot_ms=200)
    ctl = Controller(s.registry, s.signals, config, 2.0, lines.append, clock=s.clock)
    for k in range(40):
        s.clock.t = 1000.0 + 2.0 * k
        if k % 5 == 0:
            s.signals.arrival(100, 10)
        assert ctl.tick().roles is None  # nothing to act on: no traffic to speak of
    assert sum(line["event"] == "elastic_sample" for line in lines) == 40
    assert [x.t for x in ctl.samples] == [x.t for x in window(list(ctl.samples), config)]
    assert sum(len(x.arrivals) for x in ctl.samples) == 8 and ctl.samples[-1].t - ctl.samples[0].t == 78.0


def test_the_controller_applies_a_decision_and_traces_it(monkeypatch):
    s = ElasticSetup()
    lines: list[dict] = []
    ctl = Controller(s.registry, s.signals, PolicyConfig(slo_ttft_ms=2000, slo_tpot_ms=200), 2.0, lines.append,
                     clock=s.clock)
    decision = Decision(t=0.0, roles={"w0": "prefill", "w1": "decode"}, action="to-pd", reason="a test", signals={})
    monkeypatch.setattr("epdserve.serving.router.elastic.decide", lambda samples, state, config: (decision, state))
    assert ctl.tick() is decision
    assert [(m.role) for _, m in s.port.sent if isinstance(m, P.SetRole)] == ["prefill", "decode"]
    assert [line["event"] for line in lines] == ["elastic_sample", "elastic_decision"]
    assert lines[0]["sample"]["workers"][0]["role"] == "colocated" and lines[1]["reason"] == "a test"
    assert [line["reason"] for line in s.lines if line["state"] == "switching"] == ["a test", "a test"]
