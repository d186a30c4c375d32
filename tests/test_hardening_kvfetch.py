"""KV and embedding fetches run off a decode worker's step loop: a real :class:`Worker`
(its loop on a thread of this process, a real engine) keeps streaming while a hand-off's
TCP peer never answers, and the stuck request ends with an Error once
``--kv-transfer-timeout`` passes; an Abort while a fetch runs drops its result (no late
Output, nothing held); a fetched hand-off still decodes the colocated tokens, with
``queue_ms`` excluding ``kv_fetch_ms``; shutdown does not wait out a stuck fetch."""

from __future__ import annotations

import itertools
import queue
import threading
import time

import pytest
import zmq

from epdserve.engine.engine import EngineConfig, LLMEngine
from epdserve.engine.request import SamplingParams
from epdserve.serving import protocol as P
from epdserve.serving.worker.engine_worker import Worker
from epdserve.serving.worker.setup import new_engine
from epdserve.transfer import handoff, tcp
from epdserve.transfer.loopback import first_output, generate_pd

pytestmark = pytest.mark.faults

PROMPT = "Once upon a time, in a small village by the sea, there lived"
SAMPLING = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
STUCK_TIMEOUT_S = 4.0  # the decode worker's --kv-transfer-timeout in the stuck-peer test
_inproc = itertools.count()


@pytest.fixture(scope="module")
def engines(model_info):
    """A prefill engine whose KV cache is a shared pool (and the pool), a decode engine
    with room for a long stream, and a ZeroMQ context."""
    path = str(model_info.path)
    prefill, pool = new_engine(path, EngineConfig(kv_cache_memory_mb=32), True)
    decode = LLMEngine(path, EngineConfig(kv_cache_memory_mb=128))
    ctx = zmq.Context()
    try:
        yield prefill, pool, decode, ctx
    finally:
        pool.close()
        ctx.destroy(linger=0)


class Harness:
    """A decode :class:`Worker` around ``engine``: commands go straight into its inbox
    (stamped as its receiving thread stamps them), its events come back on an inproc
    socket. :meth:`start` runs its loop on a thread; else the test drives ``handle``."""

    def __init__(self, engine: LLMEngine, ctx: zmq.Context, transport: str, timeout_s: float):
        addr = f"inproc://kvfetch-events-{next(_inproc)}"
        self.events = ctx.socket(zmq.PULL)
        self.events.bind(addr)
        push = ctx.socket(zmq.PUSH)
        push.setsockopt(zmq.LINGER, 0)
        push.connect(addr)
        self.inbox: queue.Queue = queue.Queue()
        self.worker = Worker(engine, "decode-0", self.inbox, push, handoff.Exporter(engine, 60, ctx, None),
                             handoff.Importer(ctx, transport, timeout_s), role="decode")
        self.thread: threading.Thread | None = None
        self.stats: P.Stats | None = None

    def start(self) -> None:
        self.thread = threading.Thread(target=self.worker.loop, name="test-worker-loop", daemon=True)
        self.thread.start()

    def put(self, msg) -> None:
        self.inbox.put((msg, time.perf_counter()))

    def next_event(self, timeout_s: float):
        """The next Output or Error and its arrival (``time.monotonic()``), or None."""
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            if not self.events.poll(left * 1000):
                return None
            msg = P.decode(self.events.recv())
            if isinstance(msg, P.Stats):
                self.stats = msg
            else:
                return msg, time.monotonic()
        return None

    def stop(self, timeout_s: float = 10.0) -> float:
        """Shut the loop down; returns how long it took."""
        start = time.monotonic()
        if self.thread is not None:
            self.put(P.Shutdown())
            self.thread.join(timeout_s)
            assert not self.thread.is_alive(), f"the worker loop did not stop within {timeout_s} s"
        else:  # what the loop does when it ends
            self.worker.fetcher.stop()
        self.worker.events.close()
        self.events.close()
        return time.monotonic() - start


def _stuck_peer(ctx: zmq.Context) -> tuple[zmq.Socket, str]:
    """A ROUTER socket that takes KV requests and never answers, and its address."""
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    return sock, f"tcp://127.0.0.1:{port}"


def _remote(addr: str, num_tokens: int) -> P.KVDescriptor:
    """A descriptor of a frame on another host, served at ``addr``."""
    return P.KVDescriptor(name="epdserve-kv-0-stuck", num_tokens=num_tokens, nbytes=4096, host_id="elsewhere",
                          addr=addr)


def _fetch_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("epdserve-fetch")]


def test_a_stuck_kv_peer_does_not_stall_other_streams(engines, tokenizer):
    """The stuck-peer probe: one request streams on the decode worker when two hand-offs
    arrive whose peer never answers (KV, and image embeddings). The stream's inter-token
    gaps stay far below the fetch timeout; each stuck request ends with its own Error
    after the timeout; nothing stays held."""
    _, _, decode, ctx = engines
    peer, addr = _stuck_peer(ctx)
    h = Harness(decode, ctx, "tcp", STUCK_TIMEOUT_S)
    ids = tokenizer(PROMPT).input_ids
    long = SamplingParams(max_tokens=2000, temperature=0.0, ignore_eos=True)
    tokens: list[float] = []  # arrival of each of the running stream's outputs
    errors: dict[str, tuple[str, float]] = {}
    try:
        h.start()
        h.put(P.AddRequest(request_id="running", prompt_token_ids=ids, sampling=long))
        while len(tokens) < 5:
            event = h.next_event(120)
            assert event is not None and isinstance(event[0], P.Output), event
            tokens.append(event[1])
        sent = time.monotonic()
        h.put(P.AddRequest(request_id="stuck-kv", prompt_token_ids=ids, sampling=SAMPLING,
                           kv=_remote(addr, len(ids)), first_token=ids[-1]))
        h.put(P.AddRequest(request_id="stuck-embeddings", prompt_token_ids=ids, sampling=SAMPLING,
                           images=[P.ImageRef(hash="ab" * 32, tokens=1)],
                           embeddings=[P.EmbeddingRef(images=[0], frame=_remote(addr, 1))]))
        while len(errors) < 2:
            event = h.next_event(STUCK_TIMEOUT_S * 2 + 60)
            assert event is not None, f"stuck requests never ended; errors so far: {errors}"
            msg, at = event
            if isinstance(msg, P.Error):
                errors[msg.request_id] = (msg.message, at)
            else:
                assert msg.request_id == "running" and not msg.finished, msg
                tokens.append(at)
        last_error = max(at for _, at in errors.values())
        while tokens[-1] < last_error + 0.5:  # the stream goes on past the stuck fetches' end
            event = h.next_event(60)
            assert event is not None and event[0].request_id == "running" and not event[0].finished, event
            tokens.append(event[1])
        h.put(P.Abort(request_id="running"))
        window = [t for t in tokens if t >= sent - 1.0]
        gaps = [b - a for a, b in zip(window, window[1:])]
        # Blocked, the loop shows one gap of the whole timeout (two, serially, before the
        # fix: 8 s); a busy machine's decode steps stay far below half of it.
        assert max(gaps) < STUCK_TIMEOUT_S / 2, (
            f"the running stream stalled {max(gaps):.2f} s while a KV peer was stuck "
            f"(fetch timeout {STUCK_TIMEOUT_S} s)")
        assert set(errors) == {"stuck-kv", "stuck-embeddings"}
        for request_id, (message, at) in errors.items():
            assert "no KV from" in message and "within" in message, (request_id, message)
            assert at - sent >= STUCK_TIMEOUT_S * 0.9, "an Error before the timeout"
    finally:
        h.stop()
        peer.close()
    assert decode.pool.num_in_use == 0 and not decode.seqs
    assert not getattr(h.worker, "fetching", {})
    assert not _fetch_threads(), "the fetch threads end with the loop"


@pytest.fixture
def held(engines, tokenizer):
    """Export the prompt's KV as held pool blocks; yields ``make(request_id)`` → (the
    prefill output, its descriptor) and releases every export at the end."""
    prefill, pool, decode, ctx = engines
    exporter = handoff.Exporter(prefill, 60, ctx, None, "none", pool)
    ids = tokenizer(PROMPT).input_ids

    def make(request_id: str):
        prefill.add_request(request_id, ids, SAMPLING, hold_kv=True)
        out = first_output(prefill, request_id)
        return out, exporter.export(out)

    try:
        yield make, exporter, ids
    finally:
        for request_id in exporter.table.ids():
            exporter.release(request_id)
        assert prefill.pool.num_in_use == 0


def _drain_steps(h: Harness) -> dict[str, list[P.Output]]:
    """Step the engine on this thread until it is idle; the outputs it sent, by request."""
    while h.worker.engine.has_unfinished():
        h.worker.step()
    outputs: dict[str, list] = {}
    while (event := h.next_event(0.2)) is not None:
        outputs.setdefault(event[0].request_id, []).append(event[0])
    return outputs


def test_fetches_complete_off_the_loop_and_aborts_drop_them(engines, tokenizer, held):
    """Driving the worker by hand: an AddRequest returns at once and the finished fetch
    comes back through the inbox; handled, the request decodes the tokens of the in-process
    PD hand-off. A fetch whose request was aborted meanwhile is dropped: no Output, no
    Error, no blocks held."""
    prefill, _, decode, ctx = engines
    make, exporter, ids = held
    reference, _ = generate_pd(prefill, decode, exporter, handoff.Importer(ctx, "shm", 5), "reference", ids,
                               SAMPLING)
    h = Harness(decode, ctx, "auto", 5)
    try:
        for request_id, abort in (("fetched", False), ("aborted", True)):
            out, desc = make(request_id)
            h.worker.handle(P.AddRequest(request_id=request_id, prompt_token_ids=ids, sampling=SAMPLING, kv=desc,
                                         first_token=out.token_ids[-1]), time.perf_counter())
            assert request_id not in decode.seqs, "the fetch runs off the loop"
            done = h.inbox.get(timeout=30)
            if abort:
                h.worker.handle(P.Abort(request_id=request_id), time.perf_counter())
            h.worker.handle(*done)
            outputs = _drain_steps(h)
            exporter.release(request_id)  # as the router does after the first output, or on abort
            if abort:
                assert not outputs and request_id not in decode.seqs
            else:
                assert [t for o in outputs[request_id] for t in o.token_ids] == reference[1:]
                timings = outputs[request_id][-1].timings
                assert timings.kv_fetch_ms > 0 and timings.queue_ms >= 0
            assert decode.pool.num_in_use == 0 and not h.worker.fetcher.fetching
    finally:
        h.stop()


def test_queue_ms_excludes_a_slow_fetch_and_an_aborted_fetch_ends(engines, tokenizer, held):
    """Over TCP, a KV server that answers after 0.6 s: ``kv_fetch_ms`` holds the wait and
    ``queue_ms`` does not. A fetch aborted while its peer is silent sends nothing, and the
    worker stops at once rather than after the fetch's 30 s timeout."""
    prefill, _, decode, ctx = engines
    make, exporter, ids = held
    asked, gate = threading.Event(), threading.Event()

    def gated(request_id: str, name: str):
        asked.set()
        gate.wait(30)
        return exporter._frame(request_id, name)

    server = tcp.KVServer(ctx, "tcp://127.0.0.1:0", gated)
    h = Harness(decode, ctx, "tcp", 30)
    try:
        h.start()
        out, desc = make("slow")
        threading.Timer(0.6, gate.set).start()
        h.put(P.AddRequest(request_id="slow", prompt_token_ids=ids, sampling=SAMPLING,
                           kv=desc.model_copy(update={"addr": server.addr}), first_token=out.token_ids[-1]))
        outputs = []
        while not outputs or not outputs[-1].finished:
            event = h.next_event(60)
            assert event is not None and isinstance(event[0], P.Output), event
            outputs.append(event[0])
            exporter.release("slow")
        timings = outputs[-1].timings
        assert timings.kv_fetch_ms >= 500 and timings.kv_tcp == 1.0
        assert 0 <= timings.queue_ms < 300, timings

        gate.clear()
        asked.clear()
        out, desc = make("silent")
        h.put(P.AddRequest(request_id="silent", prompt_token_ids=ids, sampling=SAMPLING,
                           kv=desc.model_copy(update={"addr": server.addr}), first_token=out.token_ids[-1]))
        assert asked.wait(30)
        h.put(P.Abort(request_id="silent"))
        exporter.release("silent")
        assert h.next_event(1.0) is None, "nothing is sent for an aborted request"
        assert h.stop() < 5, "shutdown waited for the aborted fetch"
    finally:
        gate.set()
        server.close()
    assert decode.pool.num_in_use == 0 and not decode.seqs and not _fetch_threads()


def test_shutdown_does_not_wait_for_a_stuck_fetch(engines, tokenizer):
    _, _, decode, ctx = engines
    peer, addr = _stuck_peer(ctx)
    h = Harness(decode, ctx, "tcp", 30)
    ids = tokenizer(PROMPT).input_ids
    try:
        h.start()
        h.put(P.AddRequest(request_id="stuck", prompt_token_ids=ids, sampling=SAMPLING,
                           kv=_remote(addr, len(ids)), first_token=ids[-1]))
        assert peer.poll(30_000), "the fetch reached the peer"
        time.sleep(0.2)
    finally:
        took = h.stop(timeout_s=60)
        peer.close()
    assert took < 5, f"shutdown waited {took:.1f} s for a stuck fetch"
    assert not _fetch_threads() and decode.pool.num_in_use == 0
