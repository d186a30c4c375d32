"""A real engine :class:`Worker` (its loop on a thread of this process) switching role
live: what it held when the switch came finishes under the role it was taken in, it
says ``RoleSwitched`` only once that is done, and the new role's work is served from the
switch on. Two moments that matter: a KV hand-off to the worker in flight (the fetch runs
on a fetch thread when SetRole comes), and a long prompt being prefilled."""

from __future__ import annotations

import itertools
import queue
import threading
import time

import pytest
import zmq

from epdserve.engine.engine import EngineConfig
from epdserve.engine.request import SamplingParams
from epdserve.serving import protocol as P
from epdserve.serving.worker.engine_worker import Worker
from epdserve.serving.worker.setup import new_engine
from epdserve.transfer import handoff
from epdserve.transfer.loopback import first_output

pytestmark = pytest.mark.elastic

PROMPT = "Once upon a time, in a small village by the sea, there lived"
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
_inproc = itertools.count()


@pytest.fixture
def engines(model_info):
    """Two engines built as an elastic worker's (a shared KV pool, so either may export),
    their pools, and a ZeroMQ context (per test: a worker's loop closes its pool as it ends)."""
    path = str(model_info.path)
    a, pool_a = new_engine(path, EngineConfig(kv_cache_memory_mb=96), True)
    b, pool_b = new_engine(path, EngineConfig(kv_cache_memory_mb=96), True)
    ctx = zmq.Context()
    try:
        yield (a, pool_a), (b, pool_b), ctx
    finally:
        pool_a.close()
        pool_b.close()
        ctx.destroy(linger=0)


class Harness:
    """A :class:`Worker` of ``role`` around ``engine`` with its loop on a thread: commands
    go into its inbox, its events come back on an inproc socket."""

    def __init__(self, engine, pool, ctx: zmq.Context, role: str):
        addr = f"inproc://elastic-events-{next(_inproc)}"
        self.events = ctx.socket(zmq.PULL)
        self.events.bind(addr)
        push = ctx.socket(zmq.PUSH)
        push.setsockopt(zmq.LINGER, 0)
        push.connect(addr)
        self.inbox: queue.Queue = queue.Queue()
        self.worker = Worker(engine, f"{role}-w", self.inbox, push, handoff.Exporter(engine, 60, ctx, None, "none", pool),
                             handoff.Importer(ctx, "shm", 30.0), role=role)
        self.thread = threading.Thread(target=self.worker.loop, daemon=True)
        self.thread.start()

    def put(self, msg) -> None:
        self.inbox.put((msg, time.perf_counter()))

    def events_until(self, done, timeout_s: float = 300.0) -> list:
        """Every Output, Error and RoleSwitched until ``done(msg)`` is true for one."""
        got, deadline = [], time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self.events.poll(200):
                continue
            msg = P.decode(self.events.recv())
            if isinstance(msg, (P.Output, P.Error, P.RoleSwitched)):
                got.append(msg)
                if done(msg):
                    return got
        raise AssertionError(f"timed out; events so far: {[type(m).__name__ for m in got]}")

    def stop(self) -> None:
        self.put(P.Shutdown())
        self.thread.join(30)
        assert not self.thread.is_alive()
        self.worker.events.close()
        self.events.close()


def _tokens(events: list, request_id: str) -> list[int]:
    return [t for m in events if isinstance(m, P.Output) and m.request_id == request_id for t in m.token_ids]


def _switched(m) -> bool:
    return isinstance(m, P.RoleSwitched)


def test_switch_while_a_kv_handoff_to_the_worker_is_in_flight(engines, tokenizer):
    """A decode worker gets a hand-off (its fetch starts on a fetch thread) and, right
    behind it, SetRole(prefill). The hand-off still decodes, to the colocated tokens; the
    worker announces the switch only after that request finished; a request after the
    switch is prefilled and exported as a prefill worker's; nothing stays held."""
    (a, pool_a), (b, pool_b), ctx = engines
    ids = tokenizer(PROMPT).input_ids
    expected = _colocated(b, ids)
    exporter = handoff.Exporter(a, 60, ctx, None, "none", pool_a)
    a.add_request("r1", ids, GREEDY, hold_kv=True)
    out = first_output(a, "r1")
    kv = exporter.export(out)
    h = Harness(b, pool_b, ctx, "decode")
    try:
        h.put(P.AddRequest(request_id="r1", prompt_token_ids=ids, sampling=GREEDY, kv=kv,
                           first_token=out.token_ids[-1]))
        h.put(P.SetRole(role="prefill", switch_id="s1"))  # the fetch has not come back yet
        events = h.events_until(_switched)
        finished = next(i for i, m in enumerate(events) if isinstance(m, P.Output) and m.finished)
        assert isinstance(events[-1], P.RoleSwitched) and finished < len(events) - 1, events
        sw = events[-1]
        assert (sw.previous, sw.role, sw.switch_id) == ("decode", "prefill", "s1") and sw.drain_ms > 0
        assert out.token_ids + _tokens(events, "r1") == expected
        exporter.table.release("r1")
        h.put(P.AddRequest(request_id="r2", prompt_token_ids=ids, sampling=GREEDY))
        events = h.events_until(lambda m: isinstance(m, P.Output) and m.request_id == "r2")
        assert events[-1].kv is not None and events[-1].token_ids == expected[:1]  # a prefill worker's output
        assert h.worker.hello is None or h.worker.hello.role == "prefill"
        h.put(P.ReleaseKV(request_id="r2"))
        _wait(lambda: not h.worker.holding())
    finally:
        h.stop()
        exporter.close()
    assert a.pool.num_in_use == 0 and b.pool.num_in_use == 0


def test_switch_while_prefilling_a_long_prompt(engines, tokenizer):
    """A prefill worker is prefilling a long prompt when SetRole(decode) comes. The prefill
    finishes and its KV is exported; the switch waits for that export to be released (the
    decode side imported it), then is announced; the worker then decodes hand-offs."""
    (a, pool_a), (b, pool_b), ctx = engines
    ids = tokenizer(PROMPT).input_ids
    long_ids = (ids * 100)[:1200]
    expected = _colocated(b, long_ids)
    h = Harness(a, pool_a, ctx, "prefill")
    try:
        h.put(P.AddRequest(request_id="long", prompt_token_ids=long_ids, sampling=GREEDY))
        _wait(lambda: "long" in a.seqs)
        time.sleep(0.2)  # in its prefill step now (1,200 tokens take seconds here)
        h.put(P.SetRole(role="decode", switch_id="s2"))
        events = h.events_until(lambda m: isinstance(m, P.Output) and m.request_id == "long")
        first = events[-1]
        assert first.kv is not None and first.token_ids == expected[:1]
        assert not any(_switched(m) for m in events), "announced while its export was still held"
        time.sleep(0.5)
        assert h.worker.roles.switch is not None, "the switch must wait for the export's release"
        # The decode side (engine b) imports the KV, then the router releases the export.
        importer = handoff.Importer(ctx, "shm", 30.0)
        source, _ = importer.take("long", first.kv, b.kv_layout(), b.kv_cache.dtype)
        b.add_request("long", long_ids, GREEDY, source, first.token_ids[-1])
        tokens = first.token_ids + [t for o in _run(b) if o.request_id == "long" for t in o.token_ids]
        assert tokens == expected
        h.put(P.ReleaseKV(request_id="long"))
        sw = h.events_until(_switched)[-1]
        assert (sw.previous, sw.role) == ("prefill", "decode")
        importer.close()
    finally:
        h.stop()
    assert a.pool.num_in_use == 0 and b.pool.num_in_use == 0


def _colocated(engine, ids: list[int]) -> list[int]:
    engine.add_request("colocated-ref", ids, GREEDY)
    return [t for o in _run(engine) if o.request_id == "colocated-ref" for t in o.token_ids]


def _run(engine) -> list:
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    return outs


def _wait(cond, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)
