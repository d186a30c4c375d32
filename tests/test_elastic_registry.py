"""The router's side of a live role switch, in process: the registry and the
request flows of tests/test_router_flows.py (a fake port records what would go to the
workers), an elastic registry. Paths follow the roles live when a request arrives; a
switch routes by the new role at once and is announced by the worker's RoleSwitched; a
request keeps the role it was sent in; the decode stage never goes back to the worker
that prefilled; the controller applies a decision and writes it to the trace. A restarted
worker is switched back to its last announced role at its Hello; the workforce adds
workers within ``--max-workers`` and retires them only once they hold nothing."""

from __future__ import annotations

import json

import pytest

from epdserve.plan.elastic_replay import read_dwell_restarts, read_samples, replay
from epdserve.serving import protocol as P
from epdserve.serving.elastic.policy import Decision, PolicyConfig, window
from epdserve.serving.elastic.scaling import ScaleDecision, ScalingConfig, ScalingState
from epdserve.serving.api.errors import APIError
from epdserve.serving.router.elastic import Controller, ScaleRefused, Workforce, strands_decodes
from epdserve.serving.router.holdings import Holdings
from epdserve.serving.router.flows import DisaggregatedFlow, FlowConfig, LocalPrefillFlow, SingleWorkerFlow
from epdserve.serving.router.registry import Compat, Registry
from epdserve.serving.router.signals import SignalRecorder
from test_router_flows import KV, Reader, Setup, hello, run

pytestmark = pytest.mark.elastic


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


def test_health_lists_workers_in_id_order_whatever_order_they_joined_in():
    s = ElasticSetup(roles=())
    for wid in ("w10", "w2", "w0"):  # Ray's actors say hello in any order
        s.registry.on_message(hello(wid, "colocated"), s.clock())
    assert [w["worker_id"] for w in s.registry.health(s.clock())] == ["w0", "w2", "w10"]


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
    assert s.lines[2]["reason"] == s.lines[3]["reason"] == "because" and s.lines[3]["drain_ms"] == 12.5
    metrics = s.registry.metrics.render().decode()
    assert 'epdserve:worker_role{engine="w0",model_name="epdserve",role="prefill",worker="w0"} 1.0' in metrics
    assert ('epdserve:role_switches_total{engine="w0",from_role="colocated",model_name="epdserve",'
            'to_role="prefill",worker="w0"} 1.0') in metrics
    s.registry.set_role("w0", "prefill")  # already: nothing sent
    assert len(s.port.of("w0", P.SetRole)) == 1
    for bad in [("w9", "decode"), ("w0", "encode")]:
        with pytest.raises(ValueError, match="cannot switch"):
            s.registry.set_role(*bad)
    static = Setup("colocated", "colocated-0").registry
    with pytest.raises(ValueError, match="elastic: False"):
        static.set_role("colocated-0", "prefill")


def test_no_switch_leaves_prefills_without_a_worker_to_decode_them():
    """Swapping 1P1D's roles by hand: w0 (prefill -> decode) still holds a prefill whose KV
    only w1 could decode (never w0 itself), so w1 may not turn prefill until it is handed off;
    and the last worker that can decode never turns prefill."""
    s = ElasticSetup(("prefill", "decode"))
    held = Holdings(s.registry, "r1")
    held.hold(s.registry.workers["w0"], 10, exports_kv=True)
    s.registry.set_role("w0", "decode")
    assert strands_decodes(s.registry, "w1") == ("worker w0 holds 1 prefill(s) whose KV only worker w1 could "
                                                "decode: try again once they are handed off")
    held.release_kv()  # w1 imported it
    assert strands_decodes(s.registry, "w1") is None
    s.registry.set_role("w1", "prefill")
    assert strands_decodes(s.registry, "w0") == "worker w0 is the last live worker that can decode"


def test_a_switch_moves_the_workers_gauges_to_its_new_role():
    """Per-worker gauges under the old role go (their last values would read as blocks held
    forever); the switched line keeps the reason; a switch back while draining is no switch."""
    s = ElasticSetup()
    s.registry.on_message(stats("w0", blocks=7, running=2), s.clock())
    s.registry.set_role("w0", "decode", "because")
    metrics = s.registry.metrics.render().decode()
    assert 'role="colocated",worker="w0"} 7.0' not in metrics
    gauges = ("epdserve:kv_blocks_", "epdserve:kv_cache_usage_perc{", "epdserve:num_requests_")
    assert not [line for line in metrics.splitlines() if 'role="colocated",worker="w0"' in line
                and line.startswith(gauges)]  # counters stay: what it did in that role
    s.registry.on_message(stats("w0", blocks=3, running=1), s.clock())
    assert 'epdserve:kv_blocks_in_use{engine="w0",model_name="epdserve",role="decode",worker="w0"} 3.0' in \
        s.registry.metrics.render().decode()
    s.registry.set_role("w0", "colocated", "back")  # before the first switch was announced
    s.switched("w0")  # colocated -> colocated: announced, not counted
    assert s.lines[-1]["state"] == "switched" and s.lines[-1]["reason"] == "back"
    assert "epdserve:role_switches_total{" not in s.registry.metrics.render().decode()


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


def test_a_switch_by_hand_restarts_the_controllers_dwell_and_its_replay(tmp_path):
    """The restart is traced, so a replay of the trace restarts its dwell too and decides
    as the controller did (without it, the replay would not)."""
    s = ElasticSetup(("prefill", "decode"))
    config = PolicyConfig(slo_ttft_ms=2000, slo_tpot_ms=200, min_dwell_s=10)
    lines: list[dict] = []
    ctl = Controller(s.registry, s.signals, config, 2.0, lines.append, clock=s.clock)
    live = []
    for k in range(12):
        s.clock.t = 1000.0 + 2.0 * k
        live.append(ctl.tick())
        if k == 3:
            s.clock.t += 1.0
            ctl.switched_by_hand("POST /roles: w0 -> prefill")
    assert "1.0 s since the last change < min dwell 10 s" in live[4].reason, live[4].reason
    [restart] = [line for line in lines if line["event"] == "elastic_dwell"]
    assert (restart["t"], restart["cause"]) == (1007.0, "POST /roles: w0 -> prefill")

    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(json.dumps(line) + "\n" for line in lines))
    samples, restarts = read_samples(trace), read_dwell_restarts(trace)
    assert restarts == [1007.0]
    assert [d.reason for d in replay(samples, config, restarts)] == [d.reason for d in live]
    assert [d.reason for d in replay(samples, config)][4] != live[4].reason


def test_a_restarted_worker_is_switched_back_to_its_last_announced_role():
    """w0 announced decode, died; its new process says Hello in its first role (colocated,
    its command line or Ray actor's arguments): the router routes it as decode at once and
    sends it SetRole(decode), which it answers at once (it holds nothing)."""
    s = ElasticSetup()
    s.registry.set_role("w0", "decode")
    s.switched("w0")
    s.registry.mark_dead("w0", "killed")
    s.registry.on_message(hello("w0", "colocated", incarnation="w0-second"), s.clock())
    w = s.registry.workers["w0"]
    [_, back] = s.port.of("w0", P.SetRole)
    assert (back.role, w.role, w.announced, w.switch_id) == ("decode", "decode", "colocated", back.switch_id)
    assert s.registry.pick("decode") is w
    assert s.lines[-1]["state"] == "switching" and s.lines[-1]["reason"] == \
        "restarted: back to its last announced role decode"
    s.switched("w0")
    assert (w.role, w.announced, w.switch_id) == ("decode", "decode", None)
    # Killed while switching (asked colocated, announced decode): back as decode, not colocated.
    s.registry.set_role("w0", "colocated")
    s.registry.mark_dead("w0", "killed")
    s.registry.on_message(hello("w0", "colocated", incarnation="w0-third"), s.clock())
    assert s.port.of("w0", P.SetRole)[-1].role == "decode" and s.registry.workers["w0"].role == "decode"


class FakeScaler:
    """Hands out ids w2, w3, ...; records the removals."""

    def __init__(self):
        self.added: list[str] = []
        self.removed: list[str] = []

    def add(self, role: str) -> str:
        self.added.append(f"w{2 + len(self.added)}")
        return self.added[-1]

    def remove(self, worker_id: str) -> None:
        self.removed.append(worker_id)


def stats(wid: str, blocks: int = 0, running: int = 0) -> P.Stats:
    return P.Stats(worker_id=wid, blocks_total=10, blocks_in_use=blocks, num_running=running, num_waiting=0,
                   num_preemptions=0)


def test_the_workforce_adds_within_max_and_retires_once_a_worker_holds_nothing():
    s = ElasticSetup()
    scaler = FakeScaler()
    lines: list[dict] = []
    force = Workforce(s.registry, scaler, 2, 3, 60.0, lines.append, clock=s.clock)
    with pytest.raises(ScaleRefused, match="role 'encode'") as err:
        force.add("encode", "test")
    assert err.value.status == 400
    with pytest.raises(ScaleRefused, match="the minimum") as err:
        force.retire("w1", "test")
    assert err.value.status == 409
    assert force.add("decode", "test") == "w2" and force.changing() == 1
    with pytest.raises(ScaleRefused, match="--max-workers 3 reached") as err:  # w2 counts while it starts
        force.add("decode", "test")
    assert err.value.status == 409 and lines[-1]["state"] == "starting"
    s.registry.on_message(hello("w2", "decode"), s.clock())
    force.poll()
    assert force.starting == {} and force.live() == ["w0", "w1", "w2"]
    # w2 holds a request when it is retired: no new work for it, removed only once it is done.
    s.registry.workers["w2"].outstanding["r1"] = 10
    force.retire("w2", "DELETE /workers")
    assert s.registry.workers["w2"].as_json(0.0)["state"] == "retiring"
    assert s.registry.pick("decode").worker_id in ("w0", "w1")  # the colocated fallback, never w2
    with pytest.raises(ScaleRefused, match="already retiring"):
        force.retire("w2", "again")
    s.registry.on_message(stats("w2", blocks=3, running=1), s.clock())
    force.poll()
    s.registry.on_message(P.Output(worker_id="w2", request_id="r1", token_ids=[1], finished=True), s.clock())
    force.poll()  # nothing outstanding: waits for a Stats that came after it
    s.clock.advance(0.5)
    s.registry.on_message(stats("w2", blocks=2), s.clock())  # a block still held
    force.poll()
    assert "w2" in s.registry.workers and not s.port.of("w2", P.Shutdown)
    s.clock.advance(0.5)
    s.registry.on_message(stats("w2"), s.clock())
    force.poll()
    assert "w2" not in s.registry.workers and len(s.port.of("w2", P.Shutdown)) == 1 and scaler.removed == ["w2"]
    assert [(line["worker"], line["state"]) for line in s.lines[-2:]] == [("w2", "retiring"), ("w2", "removed")]
    metrics = s.registry.metrics.render().decode()
    assert 'epdserve:workers{engine="router",model_name="epdserve",state="live"} 2.0' in metrics
    assert 'epdserve:worker_scale_total{direction="in",engine="router",model_name="epdserve"} 1.0' in metrics
    assert 'epdserve:worker_scale_total{direction="out",engine="router",model_name="epdserve"} 1.0' in metrics
    # One never up within the startup timeout is given up and its resources freed.
    assert force.add("colocated", "test") == "w3"
    s.clock.advance(61.0)
    force.poll()
    assert force.starting == {} and scaler.removed == ["w2", "w3"] and lines[-1]["state"] == "given-up"
    with pytest.raises(ScaleRefused) as err:
        force.retire("w9", "test")
    assert err.value.status == 404


def test_the_last_worker_that_can_decode_is_not_retired():
    s = ElasticSetup(("prefill", "prefill", "decode", "decode"))
    force = Workforce(s.registry, None, 1, 4, 60.0, lambda line: None, clock=s.clock)
    force.retire("w3", "test")
    with pytest.raises(ScaleRefused, match="last live worker that can decode"):
        force.retire("w2", "test")
    force.retire("w1", "test")  # a prefill worker: w0 still prefills
    with pytest.raises(ScaleRefused, match="--max-workers"):  # no scaler: nothing can be added
        force.add("decode", "test")
    with pytest.raises(APIError):
        s.registry.pick("decode", exclude=s.registry.workers["w2"])  # w3 retiring: not picked
    assert s.registry.pick("prefill").worker_id == "w0"


def test_the_controller_scales_when_the_role_policy_holds(monkeypatch):
    s = ElasticSetup()
    lines: list[dict] = []
    ctl = Controller(s.registry, s.signals, PolicyConfig(slo_ttft_ms=2000, slo_tpot_ms=200), 2.0, lines.append,
                     clock=s.clock)
    scaler = FakeScaler()
    ctl.workforce = Workforce(s.registry, scaler, 2, 3, 60.0, lines.append, clock=s.clock)
    ctl.scaling = ScalingConfig(2, 3, 2000.0, 200.0)
    out = ScaleDecision(t=s.clock(), action="scale-out", reason="saturated", role="decode", signals={"x": 1.0})
    monkeypatch.setattr("epdserve.serving.router.elastic.decide_scale",
                        lambda samples, state, config, changing, role_change_t: (out, ScalingState(out.t)))
    ctl.tick()  # the role policy holds (too little evidence): the scaling policy is asked
    assert scaler.added == ["w2"] and ctl.scale_state.last_change_t == out.t
    assert ctl.state.last_switch_t == out.t  # the role policy dwells from the change too
    decision = next(line for line in lines if line["event"] == "elastic_decision")
    assert (decision["action"], decision["role"], decision["reason"]) == ("scale-out", "decode", "saturated")
    assert lines[-2]["state"] == "starting" and lines[-2]["worker"] == "w2"
    assert {k: lines[-1][k] for k in ("event", "t", "cause")} == {"event": "elastic_dwell", "t": out.t,
                                                                  "cause": "scale-out"}
