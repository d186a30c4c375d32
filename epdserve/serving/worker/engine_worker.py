"""One engine worker process (``epdserve worker``): colocated, prefill or decode (encode:
:mod:`.encode_worker`). Its loop: docs/architecture.md; elastic role switches: docs/elastic.md."""

from __future__ import annotations

import dataclasses
import logging
import queue
import secrets
import signal
import threading
import time
import traceback
import torch
import zmq

from epdserve.engine.encoder import EncodeEngine
from epdserve.engine.engine import LLMEngine
from epdserve.engine.kv_source import KVSource
from epdserve.model.image_processor import ImageError
from epdserve.model.loader import ModelLoadError
from epdserve.serving import auth
from epdserve.serving import protocol as P
from epdserve.serving.handshake import auth_tag, model_fingerprint
from epdserve.serving.worker.control import handle_control
from epdserve.serving.worker.encode_worker import EncodeWorker
from epdserve.serving.worker.fetch import Fetch, Fetcher
from epdserve.serving.worker.grammar_prep import GrammarPrep, Prepared
from epdserve.serving.worker.image_encoder import ImageEncoder, cache_stats
from epdserve.serving.worker.rank_watch import RankWatch
from epdserve.serving.worker.ranks import RankFailure, Ranks
from epdserve.serving.worker.role_switch import Roles
from epdserve.serving.worker.stats_report import StatsReport
# add_arguments is the `epdserve worker` command's (epdserve/cli.py): its options live with the set-up.
from epdserve.serving.worker.setup import WorkerConfig, add_arguments, load, node_identity
from epdserve.serving.worker.threads import IDLE_WAIT_S, serve
from epdserve.transfer import handoff, tcp
from epdserve.trace import StageTimings
from epdserve.transfer.sealing import NO_AUTH, Sealer

log = logging.getLogger("epdserve.worker")


class Worker:
    """``inbox``: ``(item, time.perf_counter() at receipt)`` of the router's commands, finished
    fetches (:class:`Fetch`) and compiled grammars (:class:`Prepared`). ``run`` sets ``sealer``,
    ``incarnation``, ``hello`` (what a Reset is answered with) and ``rank_watch.ranks``."""

    sealer: Sealer = NO_AUTH.sealer("events")
    incarnation: str = ""
    hello: P.Hello | None = None

    def __init__(self, engine: LLMEngine, worker_id: str, inbox: queue.Queue, events: zmq.Socket,
                 exporter: handoff.Exporter, importer: handoff.Importer, encoder: EncodeEngine | None = None,
                 role: str = "colocated"):
        self.roles = Roles(role)
        self.engine = engine
        self.worker_id = worker_id
        self.inbox = inbox
        self.events = events
        self.exporter = exporter
        self.importer = importer
        self.running = True
        self.exit_code = 0
        self.fetcher = Fetcher(importer, inbox, worker_id)
        self.grammars = GrammarPrep(engine, inbox)
        self.images = ImageEncoder(encoder)
        self.rank_watch = RankWatch(self, "worker")
        self.stats = StatsReport(worker_id, self.send)

    def send(self, msg) -> None:
        self.events.send(self.sealer.seal(P.encode(msg)))

    def reset(self) -> str:
        """``P.Reset``: returns what was dropped, for the log."""
        requests, exports = self.requests(), self.exporter.table.ids()
        self.grammars.pending.clear()
        self.roles.forget()
        self.fetcher.cancel_all()
        for request_id in requests:
            self.engine.abort(request_id)
        for request_id in exports:
            self.exporter.table.release(request_id)
        self.exporter.expire()  # layer-pipelined frames of the aborted requests
        self.stats.send_next()
        return f"{len(requests)} requests, {len(exports)} exports"

    def loop(self) -> None:
        while self.running:
            self.drain_commands(block_s=0.0 if self.engine.has_unfinished() else IDLE_WAIT_S)
            if self.engine.has_unfinished():
                self.step()
            else:
                self.rank_watch.check()  # a follower that died while idle
            self.stats.report(self.engine.stats() | cache_stats(self.images.encoder))
            self.expire_exports()
            if self.roles.switch is not None:
                self.finish_switch()
        self.fetcher.stop()
        self.grammars.close()
        self.exporter.close()
        self.importer.close()

    def drain_commands(self, block_s: float) -> None:
        try:
            item = self.inbox.get(timeout=block_s) if block_s > 0 else self.inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            self.handle(*item)
            try:
                item = self.inbox.get_nowait()
            except queue.Empty:
                return

    def handle(self, msg, arrival: float) -> None:
        if isinstance(msg, Fetch):
            self.fetched(msg)
        elif isinstance(msg, Prepared):
            self.prepared(msg)
        elif isinstance(msg, P.AddRequest):
            self.add(msg, arrival)
        elif isinstance(msg, P.Abort):
            self.fetcher.cancel(msg.request_id)  # its result is dropped when it comes
            self.grammars.cancel(msg.request_id)
            self.roles.forget(msg.request_id)
            self.engine.abort(msg.request_id)
            self.exporter.table.release(msg.request_id)
        elif isinstance(msg, P.ReleaseKV):
            # This worker's export only: a fetch of the same id goes on (Abort ends a request).
            self.exporter.table.release(msg.request_id)
        elif isinstance(msg, P.SetRole):
            self.set_role(msg, arrival)
        else:
            handle_control(self, msg)

    def add(self, msg: P.AddRequest, arrival: float, compiled: bool = False) -> None:
        """Queue ``msg`` in the engine, compiling its grammar (unless ``compiled``) and fetching its KV or
        image embeddings off the loop first, each back through the inbox; else a ``P.Error``."""
        if msg.request_id in self.fetcher.fetching or msg.request_id in self.grammars.pending:
            self.fail(msg.request_id, f"duplicate request id {msg.request_id!r}")
        elif msg.sampling.guided is not None and not compiled:
            self.roles.take(msg.request_id)
            self.grammars.start(msg, arrival)
        elif msg.kv is not None or (msg.images and msg.embeddings):
            self.roles.take(msg.request_id)
            cache = self.engine.kv_cache
            self.fetcher.start(Fetch(msg, arrival, self.engine.kv_layout(), cache.dtype,
                                     self.engine.model.config.hidden_size, cache.device))
        else:
            try:
                timings, embeddings = StageTimings(), None
                if msg.images:
                    embeddings = self.images.embeddings(msg, arrival, timings)
                    arrival = time.perf_counter()  # encoding them is its own stage, not queue time
                self.enqueue(msg, arrival, timings, embeddings=embeddings)
            except (ValueError, ImageError) as exc:
                self.fail(msg.request_id, str(exc))

    def prepared(self, job: Prepared) -> None:
        if not self.grammars.take(job):
            return
        if job.error is not None:
            self.fail(job.msg.request_id, job.error)
        else:
            self.add(job.msg, job.arrival, compiled=True)

    def fetched(self, fetch: Fetch) -> None:
        request_id = fetch.msg.request_id
        if not self.fetcher.take(fetch):
            return
        if fetch.error is not None:  # the hand-off failed, not the request: a server fault
            self.fail(request_id, fetch.error, status=500)
            return
        # queue_ms excludes the fetch: the engine takes kv_fetch_ms off it; an embedding
        # fetch, its own stage too, moves the start of the queue on by its length.
        arrival = fetch.arrival + (fetch.timings.embedding_fetch_ms or 0.0) / 1e3
        try:
            self.enqueue(fetch.msg, arrival, fetch.timings, fetch.kv, fetch.embeddings)
        except ValueError as exc:
            self.fail(request_id, str(exc))

    def enqueue(self, msg: P.AddRequest, arrival: float, timings: StageTimings,
                kv: KVSource | None = None, embeddings: torch.Tensor | None = None) -> None:
        """As the role it was taken in needs: a prefill worker's requests hold their KV for export.
        Raises ``ValueError`` as ``LLMEngine.add_request``, or for KV sent to a prefill worker."""
        role = self.roles.role_of(msg.request_id)
        if kv is not None and msg.first_token is not None and role == "prefill":
            raise ValueError("a prefill worker takes no kv or first_token")
        prefill = role == "prefill"
        self.engine.add_request(msg.request_id, msg.prompt_token_ids, msg.sampling, kv, msg.first_token,
                                timings=timings, arrival=arrival,
                                images=[(im.hash, im.tokens) for im in msg.images], image_embeddings=embeddings,
                                hold_kv=prefill, layer_sink=self.exporter.layer_sink if prefill else None,
                                resume_ids=msg.resume_ids)

    def requests(self) -> list[str]:
        """In the engine, fetching, or compiling their grammar."""
        return list(self.engine.seqs) + list(self.fetcher.fetching) + list(self.grammars.pending)

    def holding(self) -> set[str]:
        """:meth:`requests`, and the exports not yet released."""
        return set(self.requests()) | set(self.exporter.table.ids())

    def set_role(self, msg: P.SetRole, arrival: float) -> None:
        previous = self.roles.role
        self.roles.begin(msg.role, msg.switch_id, arrival, self.holding())
        log.info("%s: switching role %s -> %s (%d requests to drain)", self.worker_id, previous, msg.role,
                 len(self.roles.switch.held))
        self.finish_switch()

    def finish_switch(self) -> None:
        switch = self.roles.drained(self.holding())
        if switch is None:
            return
        role, drain_ms = self.roles.role, switch.drain_ms
        self.hello = self.hello.model_copy(update={"role": role}) if self.hello else None
        log.info("%s: now %s (was %s; drained in %.0f ms)", self.worker_id, role, switch.previous, drain_ms)
        self.send(P.RoleSwitched(worker_id=self.worker_id, role=role, previous=switch.previous,
                                 switch_id=switch.switch_id, drain_ms=drain_ms))

    def fail(self, request_id: str, message: str, status: int = 400) -> None:
        self.roles.forget(request_id)
        self.send(P.Error(worker_id=self.worker_id, request_id=request_id, message=message, status=status))

    def step(self) -> None:
        try:
            outputs = self.engine.step()
        except RankFailure as exc:
            self.rank_watch.failed(exc, self.abort_engine_requests())
            return
        except Exception:
            # A bug must not hang clients: fail what is in flight, keep serving.
            log.error("%s: engine step failed:\n%s", self.worker_id, traceback.format_exc())
            for request_id in self.abort_engine_requests():
                self.fail(request_id, "internal error in the engine step", status=500)
            return
        for out in outputs:
            if out.error is not None:  # the engine failed this request alone (see engine/outputs.py)
                self.send(P.Error(worker_id=self.worker_id, request_id=out.request_id, message=out.error,
                                  status=500))
                continue
            kv = self.exporter.export(out) if out.kv_block_ids is not None else None
            self.send(P.Output(worker_id=self.worker_id, request_id=out.request_id, token_ids=out.token_ids,
                               finished=out.finished, finish_reason=out.finish_reason, kv=kv,
                               timings=out.timings, logprobs=out.logprobs, prompt_logprobs=out.prompt_logprobs,
                               num_cached_tokens=out.num_cached_tokens))

    def abort_engine_requests(self) -> list[str]:
        """Returns their ids."""
        request_ids = list(self.engine.seqs)
        for request_id in request_ids:
            self.engine.abort(request_id)
        return request_ids

    def expire_exports(self) -> None:
        for request_id in self.exporter.expire():
            log.warning("%s: KV of %s not taken within %.0f s; freed", self.worker_id, request_id,
                        self.exporter.ttl_s)


OPTIONS = WorkerConfig


def run(config: WorkerConfig) -> int:
    """Start the worker; returns 0 on shutdown, 2 on a bad option or model (a TCP listener
    without a token, see ``auth.options_error``) or when the router refuses it, 1 when a
    tensor-parallel rank fails (at start-up or later: :mod:`.rank_watch`)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    serves_tcp = (config.role in ("prefill", "encode") or config.elastic) and config.kv_transport != "shm"
    listeners = [a for a in (config.bind, config.kv_bind if serves_tcp else "") if a.startswith("tcp://")]
    error = auth.options_error(config.auth, listeners)
    if error is not None:
        print(f"epdserve worker: error: {error}", flush=True)
        return 2
    keyring = auth.keyring_from(config.auth)
    if not keyring.enabled:
        log.warning("%s: no auth token: frames go unsealed, and a router with a token will not hear this worker",
                    config.worker_id)
    tcp.configure(keyring)  # the exporter's KV server and the importer's fetches
    try:
        loaded = load(config)
    except (ValueError, ModelLoadError, OSError, RankFailure) as exc:
        print(f"epdserve worker: error: {exc}", flush=True)
        return 1 if isinstance(exc, RankFailure) else 2
    ranks = loaded[-1]
    try:
        return _serve_loaded(config, keyring, serves_tcp, *loaded)
    finally:
        if ranks is not None:
            ranks.close()


def _serve_loaded(config: WorkerConfig, keyring: auth.Keyring, serves_tcp: bool, cores: list[int], info,
                  encoder: EncodeEngine | None, engine: LLMEngine | None, kv_pool, ranks: Ranks | None) -> int:
    """Bind the worker's sockets, say Hello and run its loop until it stops (see :func:`run`)."""
    incarnation = secrets.token_hex(8)
    ctx = zmq.Context()
    cmd = ctx.socket(zmq.PULL)
    keyring.secure_server(cmd, config.bind)
    cmd.bind(config.bind)
    events = ctx.socket(zmq.PUSH)
    events.setsockopt(zmq.LINGER, 1000)
    keyring.secure_client(events, config.router)
    events.connect(config.router)
    inbox: queue.Queue = queue.Queue()
    try:
        worker, kv_layout, blocks_total = _make_worker(config, ctx, inbox, events, encoder, engine, kv_pool,
                                                       config.kv_bind if serves_tcp else None)
    except zmq.ZMQError as exc:
        print(f"epdserve worker: error: --kv-bind {config.kv_bind}: {exc}", flush=True)
        ctx.destroy(linger=0)
        return 2
    if threading.current_thread() is threading.main_thread():  # a Ray actor may run us on another thread
        signal.signal(signal.SIGTERM, lambda *_: setattr(worker, "running", False))
    worker.sealer, worker.incarnation, worker.rank_watch.ranks = keyring.sealer("events"), incarnation, ranks
    # The address bound, not the one asked for: "tcp://IP:0" (Ray actors) resolves to a free port.
    addr = cmd.getsockopt_string(zmq.LAST_ENDPOINT) if config.bind.startswith("tcp://") else config.bind
    worker.hello = P.Hello(worker_id=config.worker_id, role=config.role, addr=addr, model=info.name,
                           fingerprint=model_fingerprint(info.path), kv_layout=kv_layout,
                           blocks_total=blocks_total, cores=cores, auth=auth_tag(config.auth.auth_token, config.worker_id),
                           incarnation=incarnation, protocol=P.PROTOCOL_VERSION,
                           weight_format=engine.model.weight_format.name if engine else "",
                           tuned={name: t.as_json() for name, t in engine.tuned.items()} if engine else {},
                           engine=dataclasses.asdict(engine.config) if engine else {},
                           tensor_parallel_size=config.tensor_parallel_size, **node_identity())
    worker.send(worker.hello)
    ranks_note = f" over {config.tensor_parallel_size} tensor-parallel ranks" if ranks is not None else ""
    log.info("%s: %s worker on cores %s%s, device %s, weights %s, %d KV blocks, listening on %s%s", config.worker_id,
             config.role, cores, ranks_note, config.engine.device, worker.hello.weight_format or "-", blocks_total, addr,
             " (CURVE on TCP)" if keyring.curve else "")
    serve(worker, ctx, cmd, inbox, config.router, config.worker_id, keyring, incarnation)
    ctx.destroy(linger=1000)
    return worker.exit_code


def _make_worker(config: WorkerConfig, ctx: zmq.Context, inbox: queue.Queue, events: zmq.Socket,
                 encoder: EncodeEngine | None, engine: LLMEngine | None, kv_pool, kv_bind: str | None):
    """The role's worker loop object, the KV layout and block count its Hello reports.
    Raises ``zmq.ZMQError`` when ``kv_bind`` cannot be bound."""
    if config.role == "encode":
        worker = EncodeWorker(encoder, config.worker_id, inbox, events, ctx, kv_bind, config.kv_ttl)
        return worker, worker.kv_layout(), 0
    exporter = handoff.Exporter(engine, config.kv_ttl, ctx, kv_bind, config.kv_transfer_dtype, kv_pool,
                                config.kv_layer_pipeline)
    importer = handoff.Importer(ctx, config.kv_transport, config.kv_transfer_timeout)
    worker = Worker(engine, config.worker_id, inbox, events, exporter, importer, encoder, role=config.role)
    return worker, engine.kv_layout(), engine.pool.num_blocks
