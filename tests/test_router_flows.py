"""The router's request flows and worker registry, in process: a fake port records what
would go to the workers, a fake clock stands for time, worker messages are fed to the
registry as the events socket would. No sockets, no model."""

from __future__ import annotations

import asyncio
import logging
from collections import Counter

import pytest

from epdserve.serving import protocol as P
from epdserve.serving.router.events import Tick, WorkerFailed
from epdserve.serving.router.epd_flow import EncodeFlow
from epdserve.serving.router.flows import DisaggregatedFlow, FlowConfig, LocalPrefillFlow, SingleWorkerFlow
from epdserve.serving.router.paths import new_flow
from epdserve.serving.router.registry import JOIN_GRACE_S, RESET_RETRY_S, TAKEOVER_SILENCE_S, Compat, Registry
from epdserve.serving.api.errors import APIError

LAYOUT = {"num_layers": 2, "kind": "embeddings", "dtype": "float32"}
KV = P.KVDescriptor(name="kv-0", num_tokens=3, nbytes=64, host_id="h")
FRAME = P.KVDescriptor(name="frame", num_tokens=4, nbytes=64, host_id="h")


class FakePort:
    """Records every command instead of sending it; ``full``: worker ids whose queue is full."""

    def __init__(self):
        self.sent: list[tuple[str, object]] = []
        self.connected: dict[str, tuple[str, str]] = {}
        self.once: list[tuple[str, str, object]] = []  # Refused and Reset to workers without a channel
        self.full: set[str] = set()

    def connect(self, worker_id, addr, incarnation):
        self.connected[worker_id] = (addr, incarnation)

    def disconnect(self, worker_id):
        self.connected.pop(worker_id, None)

    def send(self, worker_id, msg):
        if worker_id in self.full:
            raise WorkerFailed(f"worker {worker_id} is not accepting commands")
        self.sent.append((worker_id, msg))

    def send_once(self, worker_id, addr, msg):
        self.once.append((worker_id, addr, msg))

    def frees(self) -> list[tuple[str, str]]:
        """``(worker id, type)`` of every Abort and ReleaseKV sent, in order."""
        return [(w, m.type) for w, m in self.sent if m.type in ("abort", "release_kv")]

    def of(self, worker_id: str, kind: type) -> list:
        return [m for w, m in self.sent if w == worker_id and isinstance(m, kind)]


class FakeClock:
    def __init__(self, t: float = 1000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, seconds: float) -> None:
        self.t += seconds


def hello(worker_id: str, role: str, incarnation: str | None = None, fingerprint: str = "fp") -> P.Hello:
    return P.Hello(worker_id=worker_id, role=role, addr=f"ipc:///tmp/{worker_id}", model="m",
                   fingerprint=fingerprint, kv_layout=LAYOUT, blocks_total=10,
                   incarnation=incarnation or f"{worker_id}-incarnation", protocol=P.PROTOCOL_VERSION)


class Setup:
    """A registry of mode ``mode`` with workers ``ids`` (their role from the id's prefix)."""

    def __init__(self, mode: str, *ids: str, threshold: int = 0, auth_token: str | None = None):
        self.port, self.clock = FakePort(), FakeClock()
        self.registry = Registry(mode, self.port, Compat("fp", {"num_layers": 2}, {"kind": "embeddings"},
                                                         auth_token))
        self.config = FlowConfig(mode, request_timeout_s=600.0, local_prefill_threshold=threshold, poll_s=0.02,
                                 clock=self.clock)
        for wid in ids:
            self.registry.on_message(hello(wid, wid.split("-")[0]), self.clock())

    def flow(self, rid: str = "r1", prompt=(1, 2, 3), max_tokens: int = 4, images=()):
        flow = new_flow(self.registry, self.config, rid, list(prompt), P.SamplingParams(max_tokens=max_tokens),
                        self.clock(), list(images))
        flow.start()
        return flow

    def output(self, wid: str, tokens=(7,), rid: str = "r1", finished: bool = False, kv=None, reason=None):
        self.registry.on_message(P.Output(worker_id=wid, request_id=rid, token_ids=list(tokens), finished=finished,
                                          finish_reason=reason or ("length" if finished else None), kv=kv),
                                 self.clock())

    def error(self, wid: str, status: int = 500, rid: str = "r1"):
        self.registry.on_message(P.Error(worker_id=wid, request_id=rid, message="boom", status=status),
                                 self.clock())

    def encoded(self, wid: str, rid: str = "r1"):
        self.registry.on_message(P.Encoded(worker_id=wid, request_id=rid, frame=FRAME), self.clock())


class Reader:
    """Reads a flow's tokens one step at a time, as the client's side would."""

    def __init__(self, flow):
        self.flow = flow
        self.gen = flow.tokens()
        self.items: list = []
        self.error: WorkerFailed | None = None
        self.pending: asyncio.Task | None = None

    async def step(self) -> None:
        """Ask for the next item and let the flow run until it waits (or yields)."""
        if self.pending is None:
            self.pending = asyncio.ensure_future(self.gen.__anext__())
        await spin()
        if self.pending.done():
            task, self.pending = self.pending, None
            try:
                self.items.append(task.result())
            except WorkerFailed as exc:
                self.error = exc
            except StopAsyncIteration:
                pass

    async def drain(self) -> None:
        for _ in range(20):
            await self.step()

    async def abort(self) -> list[tuple[str, str]]:
        """The client goes away: the reader is cancelled and the flow closed."""
        if self.pending is not None:
            self.pending.cancel()
            await asyncio.gather(self.pending, return_exceptions=True)
        await self.gen.aclose()
        return self.flow.close()


async def spin(n: int = 10) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


def run(coro):
    return asyncio.run(coro)


# --- paths -------------------------------------------------------------------------------

def test_new_flow_picks_the_path():
    s = Setup("pd", "prefill-0", "decode-0", threshold=5)

    async def go():
        assert isinstance(s.flow("a", prompt=[1] * 4), LocalPrefillFlow)
        assert isinstance(s.flow("b", prompt=[1] * 5), DisaggregatedFlow)
        assert isinstance(Setup("colocated", "colocated-0").flow(), SingleWorkerFlow)
        image = P.ImageRef(hash="h", tokens=2, data=b"x")
        assert isinstance(Setup("epd", "encode-0", "prefill-0", "decode-0").flow(images=[image]), EncodeFlow)

    run(go())


def test_colocated_streams_to_the_end_and_frees_nothing():
    s = Setup("colocated", "colocated-0")

    async def go():
        flow = s.flow()
        reader = Reader(flow)
        await reader.step()
        s.output("colocated-0", (5,))
        await reader.step()
        s.output("colocated-0", (6,), finished=True)
        await reader.drain()
        assert reader.items == [([5], None, None), ([6], None, "length")]
        assert flow.close() == [] and flow.close() == []
        assert s.port.frees() == [] and s.registry.requests == {}
        assert s.registry.workers["colocated-0"].outstanding == {}
        assert flow.trace().worker == "colocated-0"

    run(go())


def test_disaggregated_hands_the_kv_over_and_releases_it_once():
    s = Setup("pd", "prefill-0", "decode-0")

    async def go():
        flow = s.flow()
        reader = Reader(flow)
        await reader.step()
        assert [type(m) for _, m in s.port.sent] == [P.AddRequest]
        s.output("prefill-0", (9,), kv=KV)
        await reader.step()
        assert reader.items == [([9], None, None)]
        await reader.step()  # the hand-off
        add = s.port.of("decode-0", P.AddRequest)[0]
        assert add.kv == KV and add.first_token == 9
        assert s.port.frees() == []
        s.output("decode-0", (10,))
        await reader.step()
        assert s.port.frees() == [("prefill-0", "release_kv")]  # imported: no longer needed
        s.output("decode-0", (11,), finished=True)
        await reader.drain()
        assert reader.items[-1] == ([11], None, "length") and reader.error is None
        assert flow.close() == []
        assert s.port.frees() == [("prefill-0", "release_kv")]
        rec = flow.trace()
        assert (rec.prefill_worker, rec.decode_worker, rec.path) == ("prefill-0", "decode-0", "disaggregated")

    run(go())


async def _first_token_from_prefill(s: Setup) -> tuple:
    """A PD flow on ``s`` whose prefill worker has sent the first token (9) with its KV:
    (the flow, its reader, which has read that token)."""
    flow = s.flow()
    reader = Reader(flow)
    await reader.step()
    s.output("prefill-0", (9,), kv=KV)
    await reader.step()
    return flow, reader


def test_disaggregated_stamps_the_routers_token_1_to_2_gap():
    """``router_hop_ms``: token 1 at the router -> the AddRequest to the decode worker;
    ``handoff_gap_ms``: token 1 -> token 2 at the router (fake clock, ms)."""
    s = Setup("pd", "prefill-0", "decode-0")

    async def go():
        flow, reader = await _first_token_from_prefill(s)
        s.clock.advance(0.002)  # the first token's SSE write, before the flow reads on
        await reader.step()  # the hand-off
        s.clock.advance(0.045)  # the decode worker fetches, imports, steps
        s.output("decode-0", (10,))
        await reader.step()
        s.output("decode-0", (11,), finished=True)
        await reader.drain()
        rec = flow.trace()
        assert rec.router_hop_ms == pytest.approx(2.0) and rec.handoff_gap_ms == pytest.approx(47.0)

    run(go())


@pytest.mark.parametrize("outcome, reason", [("finished", "length"), ("abort", "abort"), ("error", "error")])
def test_trace_says_how_the_request_ended(outcome, reason):
    """As /metrics counts it: the worker's reason, "abort" for a client gone, "error" for a
    failed request (the route notes the reason or the failure, as ``choices.texts`` and
    ``choices.failed`` do)."""
    s = Setup("pd", "prefill-0", "decode-0")

    async def go():
        flow, reader = await _first_token_from_prefill(s)
        await reader.step()
        await _end(s, reader, outcome)
        if reader.error is not None:
            flow.error = str(reader.error)
        elif outcome == "finished":
            flow.finish_reason = reader.items[-1][2]
        flow.close()
        rec = flow.trace()
        assert rec.finish_reason == reason and (rec.error is not None) == (outcome == "error")

    run(go())


def test_local_prefill_goes_to_a_decode_worker_alone():
    s = Setup("pd", "prefill-0", "decode-0", threshold=10)

    async def go():
        flow = s.flow()
        reader = Reader(flow)
        await reader.step()
        assert [w for w, _ in s.port.sent] == ["decode-0"] and s.port.sent[0][1].kv is None
        s.output("decode-0", (1, 2), finished=True)
        await reader.drain()
        assert reader.items == [([1, 2], None, "length")]
        assert flow.close() == [] and s.port.frees() == []

    run(go())


# --- worker death ------------------------------------------------------------------------

def test_prefill_worker_dying_before_the_first_token_is_retried_elsewhere(caplog):
    s = Setup("pd", "prefill-0", "prefill-1", "decode-0")

    async def go():
        s.registry.workers["prefill-1"].outstanding["other"] = 1  # prefill-0 is picked first
        flow = s.flow()
        reader = Reader(flow)
        await reader.step()
        assert [w for w, _ in s.port.sent] == ["prefill-0"]
        with caplog.at_level(logging.WARNING, "epdserve.router"):
            s.registry.mark_dead("prefill-0", "process exited with code -9")
            await reader.step()
        assert [w for w, _ in s.port.sent] == ["prefill-0", "prefill-1"]
        assert "r1: worker prefill-0 died (process exited with code -9); retrying on prefill-1" in caplog.text
        s.output("prefill-1", (9,), kv=KV)
        await reader.drain()
        s.output("decode-0", (10,), finished=True)
        await reader.drain()
        assert reader.error is None and [i[0] for i in reader.items] == [[9], [10]]
        flow.close()
        # The dead worker gets nothing (its Reset or restart drops it all); the KV once.
        assert s.port.frees() == [("prefill-1", "release_kv")]
        assert flow.trace().prefill_worker == "prefill-1"

    run(go())


def test_no_other_prefill_worker_to_retry_on_is_a_503():
    s = Setup("pd", "prefill-0", "decode-0")

    async def go():
        flow = s.flow()
        reader = Reader(flow)
        await reader.step()
        s.registry.mark_dead("prefill-0", "silent for 5 s")
        await reader.step()
        assert reader.error.status == 503
        assert str(reader.error) == ("worker prefill-0 died (silent for 5 s); no other live prefill worker "
                                     "to retry on")
        assert flow.close() == [] and s.port.frees() == []

    run(go())


def test_epd_retry_re_encodes_the_images_on_the_next_prefill_worker():
    s = Setup("epd", "encode-0", "prefill-0", "prefill-1", "decode-0")
    image = P.ImageRef(hash="h", tokens=2, data=b"png")

    async def go():
        s.registry.workers["prefill-1"].outstanding["other"] = 1
        flow = s.flow(images=[image])
        reader = Reader(flow)
        await reader.step()
        assert s.port.of("encode-0", P.Encode)[0].images == [image]
        s.encoded("encode-0")
        await reader.step()
        first = s.port.of("prefill-0", P.AddRequest)[0]
        assert first.images[0].data is None and len(first.embeddings) == 1
        s.registry.mark_dead("prefill-0", "gone")
        await reader.step()
        retry = s.port.of("prefill-1", P.AddRequest)[0]
        assert retry.images[0].data == b"png" and retry.embeddings == []
        s.output("prefill-1", (3,), finished=True)
        await reader.drain()
        assert reader.items == [([3], None, "length")]
        flow.close()
        assert Counter(s.port.frees()) == {("prefill-1", "release_kv"): 1, ("encode-0", "release_kv"): 1}

    run(go())


@pytest.mark.parametrize("imported", [True, False])
def test_decode_worker_dying_is_a_503_after_the_first_token(imported):
    s = Setup("pd", "prefill-0", "decode-0", "decode-1")

    async def go():
        flow = s.flow()
        reader = Reader(flow)
        await reader.step()
        s.output("prefill-0", (9,), kv=KV)
        await reader.step()
        await reader.step()
        if imported:
            s.output("decode-0", (10,))
            await reader.step()
        s.registry.mark_dead("decode-0", "process exited with code 1")
        await reader.drain()
        assert reader.error.status == 503  # the client has a token already: no retry
        assert str(reader.error) == "worker decode-0 died (process exited with code 1)"
        assert s.port.of("decode-1", P.AddRequest) == []
        flow.close()
        assert s.port.frees() == [("prefill-0", "release_kv")]  # at the import, or at the end

    run(go())


def test_encode_worker_dying_is_a_503():
    s = Setup("epd", "encode-0", "encode-1", "prefill-0", "decode-0")
    images = [P.ImageRef(hash=f"h{i}", tokens=2, data=b"png") for i in range(2)]

    async def go():
        flow = s.flow(images=images)
        reader = Reader(flow)
        await reader.step()
        s.encoded("encode-1")
        s.registry.mark_dead("encode-0", "gone")
        await reader.step()
        assert reader.error.status == 503 and str(reader.error) == "encode worker encode-0 died (gone)"
        assert flow.close() == [("encode-1", "release_kv")]

    run(go())


# --- client aborts -----------------------------------------------------------------------

async def _to_stage(s: Setup, stage: str) -> Reader:
    """Start a request and take it to ``stage`` (``s``'s workers must suit it)."""
    image = P.ImageRef(hash="h", tokens=2, data=b"png")
    images = [image, image] if stage.startswith("encod") else []
    reader = Reader(s.flow(images=images))
    await reader.step()
    if stage in ("queued", "prefilling", "encoding"):
        return reader
    if stage == "encoded":
        s.encoded("encode-0")
        s.encoded("encode-1")
        await reader.step()
        return reader
    s.output("prefill-0", (9,), kv=KV)
    await reader.step()  # the first token is out; the hand-off waits for the next read
    if stage == "kv in flight, no decode yet":
        return reader
    await reader.step()
    if stage == "kv in flight to decode":
        return reader
    s.output("decode-0", (10,))
    await reader.step()
    assert stage == "decoding"
    return reader


@pytest.mark.parametrize("mode, stage, expected", [
    ("colocated", "queued", [("colocated-0", "abort")]),
    ("pd", "prefilling", [("prefill-0", "abort"), ("prefill-0", "release_kv")]),
    ("pd", "kv in flight, no decode yet", [("prefill-0", "release_kv")]),
    ("pd", "kv in flight to decode", [("decode-0", "abort"), ("prefill-0", "release_kv")]),
    ("pd", "decoding", [("decode-0", "abort")]),
    ("epd", "encoding", [("encode-0", "release_kv"), ("encode-1", "release_kv")]),
    ("epd", "encoded", [("prefill-0", "abort"), ("prefill-0", "release_kv"), ("encode-0", "release_kv"),
                        ("encode-1", "release_kv")]),
])
def test_client_abort_frees_exactly_what_the_request_holds(mode, stage, expected):
    ids = {"colocated": ["colocated-0"], "pd": ["prefill-0", "decode-0"],
           "epd": ["encode-0", "encode-1", "prefill-0", "decode-0"]}[mode]
    s = Setup(mode, *ids)

    async def go():
        reader = await _to_stage(s, stage)
        before = len(s.port.frees())
        assert await reader.abort() == expected
        assert s.port.frees()[before:] == expected
        assert reader.flow.close() == []  # idempotent
        assert s.registry.requests == {}
        assert all(not w.outstanding for w in s.registry.workers.values())

    run(go())


# --- exactly once on every outcome ---------------------------------------------------------

OUTCOMES = ["finished", "error", "abort", "decode death", "finished at token 1 without KV", "silence"]


@pytest.mark.parametrize("outcome", OUTCOMES)
@pytest.mark.parametrize("mode", ["pd", "epd"])
def test_kv_and_frames_are_released_exactly_once(mode, outcome):
    s = Setup(mode, "encode-0", "prefill-0", "decode-0") if mode == "epd" else Setup(mode, "prefill-0", "decode-0")
    images = [P.ImageRef(hash="h", tokens=2, data=b"png")] if mode == "epd" else []

    async def go():
        flow = s.flow(images=images)
        reader = Reader(flow)
        await reader.step()
        if mode == "epd":
            s.encoded("encode-0")
            await reader.step()
        if outcome == "finished at token 1 without KV":
            s.output("prefill-0", (9,), finished=True, reason="stop")
            await reader.drain()
            assert reader.items == [([9], None, "stop")]
        else:
            s.output("prefill-0", (9,), kv=KV)
            await reader.step()
            await reader.step()
            await _end(s, reader, outcome)
        flow.close()
        flow.close()
        frees = Counter(s.port.frees())
        assert frees[("prefill-0", "release_kv")] == 1
        assert frees[("encode-0", "release_kv")] == (1 if mode == "epd" else 0)
        assert frees[("prefill-0", "abort")] == 0
        assert frees[("decode-0", "abort")] == (1 if outcome in ("abort", "silence") else 0)

    run(go())


async def _end(s: Setup, reader: Reader, outcome: str) -> None:
    """Bring a request whose decode worker has it (KV not yet imported) to ``outcome``."""
    if outcome == "finished":
        s.output("decode-0", (10,))
        s.output("decode-0", (11,), finished=True)
        await reader.drain()
        assert reader.error is None and reader.items[-1][2] == "length"
    elif outcome == "error":
        s.error("decode-0", 500)
        await reader.drain()
        assert reader.error.status == 500
        assert str(reader.error) == "worker decode-0 failed the request: boom"
    elif outcome == "abort":
        await reader.abort()
    elif outcome == "decode death":
        s.registry.mark_dead("decode-0", "gone")
        await reader.drain()
        assert reader.error.status == 503
    elif outcome == "silence":
        s.clock.advance(601)
        reader.flow.deliver(Tick())
        await reader.drain()
        assert reader.error.status == 504


def test_prefill_worker_sending_no_kv_fails_and_releases():
    s = Setup("pd", "prefill-0", "decode-0")

    async def go():
        flow = s.flow()
        reader = Reader(flow)
        await reader.step()
        s.output("prefill-0", (9,))
        await reader.drain()
        assert reader.error.status == 500 and str(reader.error) == "prefill worker prefill-0 sent no KV"
        flow.close()
        assert s.port.frees() == [("prefill-0", "release_kv")]

    run(go())


def test_prefill_error_is_passed_on_and_frees_nothing():
    s = Setup("pd", "prefill-0", "decode-0")

    async def go():
        flow = s.flow()
        reader = Reader(flow)
        await reader.step()
        s.error("prefill-0", 400)
        await reader.drain()
        assert reader.error.status == 400
        assert str(reader.error) == "worker prefill-0 rejected the request: boom"
        assert flow.close() == [] and s.port.frees() == []

    run(go())


# --- silence -------------------------------------------------------------------------------

def test_a_silent_worker_fails_the_request_with_504_on_the_fake_clock():
    s = Setup("colocated", "colocated-0")

    async def go():
        flow = s.flow()
        reader = Reader(flow)
        await reader.step()
        s.clock.advance(599)
        flow.deliver(Tick())
        await reader.step()
        assert reader.error is None and reader.pending is not None
        s.clock.advance(2)
        flow.deliver(Tick())
        await reader.drain()
        assert reader.error.status == 504
        assert str(reader.error) == "no output from worker colocated-0 for 600 s"
        assert flow.close() == [("colocated-0", "abort")]

    run(go())


def test_silent_encode_workers_fail_the_request_with_504():
    s = Setup("epd", "encode-0", "prefill-0", "decode-0")

    async def go():
        flow = s.flow(images=[P.ImageRef(hash="h", tokens=2, data=b"png")])
        reader = Reader(flow)
        await reader.step()
        s.clock.advance(601)
        flow.deliver(Tick())
        await reader.drain()
        assert reader.error.status == 504 and str(reader.error) == "no embeddings within 600 s"
        assert flow.close() == [("encode-0", "release_kv")]

    run(go())


def test_no_live_worker_at_start_is_a_503_and_nothing_is_held():
    s = Setup("pd", "decode-0")

    async def go():
        flow = new_flow(s.registry, s.config, "r1", [1, 2], P.SamplingParams(max_tokens=2), s.clock())
        with pytest.raises(APIError) as err:
            flow.start()
        assert err.value.status == 503 and err.value.message == "no live prefill worker"
        assert flow.close() == []

    run(go())


# --- registry ------------------------------------------------------------------------------

def test_hello_is_accepted():
    s = Setup("pd", "prefill-0")
    w = s.registry.workers["prefill-0"]
    assert s.registry.live(w) and w.role == "prefill" and w.incarnation == "prefill-0-incarnation"
    assert s.port.connected["prefill-0"] == ("ipc:///tmp/prefill-0", "prefill-0-incarnation")
    assert not s.registry.ready()
    s.registry.on_message(hello("decode-0", "decode"), 0.0)
    assert s.registry.ready()
    assert b'epdserve:worker_up{engine="prefill-0",model_name="epdserve",role="prefill",worker="prefill-0"} 1.0' \
        in s.registry.metrics.render()


@pytest.mark.parametrize("msg, reason", [
    (hello("colocated-0", "colocated"), "worker colocated-0 has role colocated, a pd router uses"),
    (hello("prefill-0", "prefill", fingerprint="other"), "with fingerprint other, the router serves one"),
    # A worker of an older epdserve (no protocol field) would send frames the router drops.
    (hello("prefill-0", "prefill").model_copy(update={"protocol": 1}),
     f"speaks protocol version 1, the router {P.PROTOCOL_VERSION}: run the same epdserve version"),
])
def test_hello_is_refused(msg, reason):
    s = Setup("pd")
    s.registry.on_message(msg, 0.0)
    assert msg.worker_id not in s.registry.workers
    entry = s.registry.refused[msg.worker_id]
    assert entry["state"] == "refused" and reason in entry["reason"]
    [(wid, addr, refused)] = s.port.once
    assert (wid, addr, refused.incarnation) == (msg.worker_id, msg.addr, msg.incarnation)
    assert s.registry.health(0.0)[-1] is entry


@pytest.mark.parametrize("token", [None, "secret"])
def test_takeover_of_a_live_worker_id_only_after_its_silence(token):
    s = Setup("colocated", auth_token=token)
    from epdserve.serving.handshake import auth_tag

    def hi(incarnation):
        return hello("colocated-0", "colocated", incarnation).model_copy(
            update={"auth": auth_tag(token, "colocated-0")})

    s.registry.on_message(hi("first-process"), 0.0)
    s.registry.on_message(hi("first-process"), 0.0)  # the same process again: nothing
    assert s.port.once == []
    s.registry.advance(TAKEOVER_SILENCE_S)
    s.registry.on_message(hi("second-process"), 0.0)
    assert s.registry.workers["colocated-0"].incarnation == "first-process"  # untouched
    assert "colocated-0" not in s.registry.refused
    # Without a token, Refused is not sent: the Hello's address could be anyone's.
    assert [r.incarnation for _, _, r in s.port.once] == ([] if token is None else ["second-process"])
    s.registry.advance(0.1)  # first-process silent for more than TAKEOVER_SILENCE_S
    s.registry.on_message(hi("second-process"), 0.0)
    w = s.registry.workers["colocated-0"]
    assert w.incarnation == "second-process" and s.registry.live(w)
    assert s.port.connected["colocated-0"][1] == "second-process"


def test_takeover_moves_the_requests_the_old_process_held_to_the_new_one():
    s = Setup("colocated", "colocated-0")

    async def go():
        reader = Reader(s.flow())
        await reader.step()
        s.registry.advance(TAKEOVER_SILENCE_S + 0.5)
        s.registry.on_message(hello("colocated-0", "colocated", "a-new-process"), 0.0)
        await reader.step()  # nothing reached the client: retried, on the process now holding the id
        assert reader.error is None and len(s.port.of("colocated-0", P.AddRequest)) == 2
        old = s.registry.workers["colocated-0"]
        assert old.incarnation == "a-new-process" and set(old.outstanding) == {"r1"}
        assert await reader.abort() == [("colocated-0", "abort")]

    run(go())


def test_heartbeat_of_a_down_worker_gets_reset_then_hello_readmits_it():
    s = Setup("colocated", "colocated-0")
    reg = s.registry
    beat = P.Heartbeat(worker_id="colocated-0", incarnation="colocated-0-incarnation")
    reg.advance(6.0)
    reg.check_silence()
    assert reg.workers["colocated-0"].dead == "silent for 5 s"
    reg.on_message(P.Heartbeat(worker_id="colocated-0", incarnation="someone-else"), 10.0)
    assert s.port.of("colocated-0", P.Reset) == []
    reg.on_message(beat, 10.0)
    reg.on_message(beat, 10.0 + RESET_RETRY_S / 2)  # at most one Reset every RESET_RETRY_S
    assert [m.incarnation for m in s.port.of("colocated-0", P.Reset)] == ["colocated-0-incarnation"]
    reg.on_message(beat, 10.0 + RESET_RETRY_S)
    assert len(s.port.of("colocated-0", P.Reset)) == 2
    reg.on_message(hello("colocated-0", "colocated"), 13.0)
    assert reg.live(reg.workers["colocated-0"])


def test_a_restarted_router_resets_the_workers_that_beat_without_a_hello():
    s = Setup("pd", "prefill-0")  # a new router process: decode-0 said hello to the one before
    reg = s.registry
    beat = P.Heartbeat(worker_id="decode-0", incarnation="decode-0-incarnation", addr="ipc:///tmp/decode-0")
    reg.on_message(beat, 10.0)
    assert s.port.once == []  # its Hello, queued while no router was bound, may come next
    reg.on_message(beat, 10.0 + JOIN_GRACE_S)
    reg.on_message(beat, 10.0 + JOIN_GRACE_S + RESET_RETRY_S / 2)  # at most one Reset every RESET_RETRY_S
    assert [(w, a, m.type, m.incarnation) for w, a, m in s.port.once] == [
        ("decode-0", "ipc:///tmp/decode-0", "reset", "decode-0-incarnation")]
    reg.on_message(hello("decode-0", "decode"), 12.0)  # its answer to the Reset
    assert reg.live(reg.workers["decode-0"]) and "decode-0-incarnation" not in reg.invited
    reg.on_message(P.Heartbeat(worker_id="old-0", incarnation="old"), 20.0)  # an older worker: no address
    reg.remove("decode-0", "retired")
    reg.on_message(beat, 20.0)  # a removed worker's last beats: not invited back
    reg.on_message(beat, 20.0 + JOIN_GRACE_S)
    assert len(s.port.once) == 1

def test_pick_prefers_fewest_requests_then_tokens_and_skips_the_dead():
    s = Setup("pd", "prefill-0", "prefill-1", "prefill-2", "decode-0")
    reg = s.registry
    reg.workers["prefill-0"].outstanding.update(a=10, b=10)
    reg.workers["prefill-1"].outstanding.update(c=500)
    reg.workers["prefill-2"].outstanding.update(d=100)
    assert reg.pick("prefill").worker_id == "prefill-2"
    reg.mark_dead("prefill-2", "gone")
    assert reg.pick("prefill").worker_id == "prefill-1"
    reg.mark_dead("prefill-1", "gone")
    reg.mark_dead("prefill-0", "gone")
    with pytest.raises(APIError) as err:
        reg.pick("prefill")
    assert err.value.status == 503


def test_late_kv_of_a_closed_request_is_released():
    s = Setup("pd", "prefill-0", "decode-0")
    s.output("prefill-0", (9,), rid="gone", kv=KV)
    assert s.port.frees() == [("prefill-0", "release_kv")]


def test_a_full_command_queue_fails_dispatch_but_never_the_release():
    s = Setup("colocated", "colocated-0")
    s.port.full.add("colocated-0")

    async def go():
        flow = new_flow(s.registry, s.config, "r1", [1], P.SamplingParams(max_tokens=1), s.clock())
        with pytest.raises(WorkerFailed, match="not accepting commands"):
            flow.start()
        flow.close()  # logged, not raised
        assert s.registry.workers["colocated-0"].outstanding == {}

    run(go())
