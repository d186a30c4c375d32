"""One engine worker process (``epdserve worker``): colocated, prefill, decode or encode.

It binds a PULL socket for the router's commands (a thread of its own receives them and
stamps their arrival), connects a PUSH socket to the router's events address, says
:class:`~epdserve.serving.protocol.Hello`, then loops: handle the received commands, run
one engine step if there is work, publish the new tokens, report
:class:`~epdserve.serving.protocol.Stats`. A prefill worker holds each hand-off's KV
(by default its blocks, in the shared KV pool its cache lives in; a staged frame with
``--kv-transfer-dtype`` or ``--kv-layer-pipeline``) until the router releases it, once the
decode worker has imported it or on failure, or ``--kv-ttl`` passes
(:mod:`epdserve.transfer.handoff`). A worker
that prefills a prompt with images gets their embeddings from encode workers (EPD) or,
given the image bytes, encodes them itself first (colocated, PD), blocking its loop as a
vision encoder inside an engine does. A request's KV (decode) or image embeddings (EPD)
held by a peer are fetched on a small thread pool, off the loop, so a slow or silent peer
delays only that request (:mod:`epdserve.serving.worker.fetch`). The role is this layer's: the
engine is role-free, and the worker asks it per request for what its role needs (a
prefill worker's requests hold their prompt's KV for export; only a decode worker's
requests bring KV). An encode worker runs
:class:`~epdserve.serving.worker.encode_worker.EncodeWorker` instead. The same command runs
alone on another host, so a launcher, Ray or Kubernetes can place it. With
``--tensor-parallel-size`` N it is rank 0 of N processes (:mod:`~epdserve.serving.worker.ranks`);
a rank that fails stops it (exit status 1) so that it is restarted whole.

Every frame it sends is sealed, and every command it receives checked, with keys derived
from ``--auth-token`` (:mod:`epdserve.serving.auth`); commands are sealed for this process
alone (its random ``incarnation``). A TCP listener (``--bind``, or ``--kv-bind`` when it
serves KV) needs a token unless ``--allow-unauthenticated``. On
:class:`~epdserve.serving.protocol.Reset` (the router took it for down and hears it again)
it drops every request and export it holds and says Hello again.

Elastic (``--elastic``, docs/elastic.md): the router may change an engine worker's role
with :class:`~epdserve.serving.protocol.SetRole`. Such a worker is built for every role
from the start (its KV cache in the shared pool, its KV server up, the vision encoder
loaded), so a switch reloads nothing. It takes the new role's work at once and drains
the old one's: what it held when the switch came (queued, running, fetching or
compiling requests, exports not yet released) finishes under the role it was taken in;
once none is left it says :class:`~epdserve.serving.protocol.RoleSwitched`, and its Hello
(said again after a Reset) names the new role.
"""

from __future__ import annotations

import logging
import queue
import secrets
import signal
import threading
import time
import traceback
import torch
import zmq

from epdserve.argtypes import Options
from epdserve.engine.encoder import EncodeEngine
from epdserve.engine.engine import LLMEngine
from epdserve.engine.kv_source import KVSource
from epdserve.model.image_processor import ImageError
from epdserve.model.loader import ModelLoadError
from epdserve.serving import auth
from epdserve.serving import protocol as P
from epdserve.serving.handshake import auth_tag, model_fingerprint
from epdserve.serving.worker.control import handle_control, stop_for_failed_ranks
from epdserve.serving.worker.encode_worker import EncodeWorker, image_inputs
from epdserve.serving.worker.fetch import Fetch, Fetcher
from epdserve.serving.worker.grammar_prep import GrammarPrep, Prepared
from epdserve.serving.worker.ranks import RankFailure, Ranks
from epdserve.serving.worker.role_switch import Roles
# add_arguments is the `epdserve worker` command's (epdserve/cli.py): its options live with the set-up.
from epdserve.serving.worker.setup import WorkerConfig, add_arguments, load, node_identity
from epdserve.serving.worker.threads import IDLE_WAIT_S, serve
from epdserve.transfer import handoff, tcp
from epdserve.trace import StageTimings
from epdserve.transfer.sealing import NO_AUTH, Sealer

log = logging.getLogger("epdserve.worker")
STATS_INTERVAL_S = 0.5


class Worker:
    """The command/step/publish loop around one :class:`LLMEngine` of a worker of ``role``
    (its :class:`~epdserve.serving.worker.role_switch.Roles`); commands come from ``inbox`` as ``(message, arrival)`` pairs
    put there by :func:`receive_commands`, finished fetches as ``(Fetch, time)`` pairs
    put there by the fetch threads (:class:`~epdserve.serving.worker.fetch.Fetcher`), and guided
    requests whose grammar is compiled as ``(Prepared, time)`` (:class:`GrammarPrep`). The
    exporter's table (``exporter.table``) holds this worker's live exports. ``run`` sets ``sealer`` (seals events),
    ``incarnation``, ``hello`` (what a Reset is answered with, see
    ``control.handle_control``) and, for a tensor-parallel worker, ``ranks``: its follower
    ranks, whose failure stops the worker (:meth:`ranks_failed`)."""

    sealer: Sealer = NO_AUTH.sealer("events")
    incarnation: str = ""
    hello: P.Hello | None = None
    ranks: Ranks | None = None

    def __init__(self, engine: LLMEngine, worker_id: str, inbox: queue.Queue, events: zmq.Socket,
                 exporter: handoff.Exporter, importer: handoff.Importer, encoder: EncodeEngine | None = None,
                 role: str = "colocated"):
        self.roles = Roles(role)  # raises ValueError for an unknown role
        self.engine = engine
        self.encoder = encoder  # for prompts with images that come with their bytes
        self.worker_id = worker_id
        self.inbox = inbox
        self.events = events
        self.exporter = exporter
        self.importer = importer
        self.last_stats: dict | None = None
        self.last_stats_time = 0.0
        self.running = True
        self.exit_code = 0
        self.fetcher = Fetcher(importer, inbox, worker_id)
        self.grammars = GrammarPrep(engine, inbox)  # guided requests' compiles, off the loop

    @property
    def role(self) -> str:
        return self.roles.role

    @property
    def switch(self):
        """The role switch being drained (elastic), or None."""
        return self.roles.switch

    @property
    def fetching(self) -> dict[str, Fetch]:
        """Requests whose KV or embeddings are on the way, by id."""
        return self.fetcher.fetching

    def send(self, msg) -> None:
        self.events.send(self.sealer.seal(P.encode(msg)))

    def reset(self) -> str:
        """Abort every request and release every export (see ``P.Reset``: the router has
        failed or moved them all); returns what was dropped, for the log."""
        requests, exports = self.requests(), self.exporter.table.ids()
        self.grammars.pending.clear()
        self.roles.forget()
        self.fetcher.cancel_all()
        for request_id in requests:
            self.engine.abort(request_id)
        for request_id in exports:
            self.exporter.table.release(request_id)
        self.exporter.expire()  # layer-pipelined frames of the aborted requests
        self.last_stats = None  # report the freed blocks at once
        return f"{len(requests)} requests, {len(exports)} exports"

    def loop(self) -> None:
        while self.running:
            # Busy: take what has arrived and step at once; idle: sleep until a command
            # comes (or 100 ms pass, for stats and KV expiry) without spinning.
            self.drain_commands(block_s=0.0 if self.engine.has_unfinished() else IDLE_WAIT_S)
            if self.engine.has_unfinished():
                self.step()
            elif self.ranks is not None:  # a follower that died while idle
                try:
                    self.ranks.check()
                except RankFailure as exc:
                    self.ranks_failed(exc)
            self.report_stats()
            self.expire_exports()
            if self.roles.switch is not None:
                self.finish_switch()
        self.stop_fetches()
        self.grammars.close()
        self.exporter.close()
        self.importer.close()  # GPU pools opened by CUDA IPC: their handles closed (host pools unmapped)

    def drain_commands(self, block_s: float) -> None:
        """Handle every command in the inbox, waiting up to ``block_s`` seconds for the first."""
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
        """Act on one command, or a finished fetch; ``arrival`` is its
        ``time.perf_counter()`` on receipt."""
        if isinstance(msg, Fetch):
            self.fetched(msg)
        elif isinstance(msg, Prepared):
            self.prepared(msg)
        elif isinstance(msg, P.AddRequest):
            self.add(msg, arrival)
        elif isinstance(msg, P.Abort):
            self.fetcher.cancel(msg.request_id)  # its result is dropped when it comes (see fetched)
            self.grammars.cancel(msg.request_id)  # the same (see prepared)
            self.roles.forget(msg.request_id)
            self.engine.abort(msg.request_id)
            self.release(msg.request_id)
        elif isinstance(msg, P.ReleaseKV):
            # This worker's own export only. A fetch of the same id goes on: ReleaseKV does
            # not end a request here (it did not before fetches left the loop either), and
            # the router sends Abort to end one.
            self.release(msg.request_id)
        elif isinstance(msg, P.SetRole):
            self.set_role(msg, arrival)
        else:
            handle_control(self, msg)

    def add(self, msg: P.AddRequest, arrival: float, compiled: bool = False) -> None:
        """Queue ``msg`` (received at ``arrival``, ``time.perf_counter()``) in the engine;
        or, when its KV or its images' embeddings lie with a peer, start fetching them on a
        fetch thread and return at once (:meth:`fetched` queues it when they are here).
        A guided request's grammar is compiled first, off the loop, unless ``compiled``
        (see :mod:`~epdserve.serving.worker.grammar_prep`). A request that cannot be queued gets
        a ``P.Error``."""
        if msg.request_id in self.fetching or msg.request_id in self.grammars.pending:
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
                    embeddings = self.image_embeddings(msg, arrival, timings)
                    arrival = time.perf_counter()  # encoding them is its own stage, not queue time
                self.enqueue(msg, arrival, timings, embeddings=embeddings)
            except (ValueError, ImageError) as exc:
                self.fail(msg.request_id, str(exc))

    def prepared(self, job: Prepared) -> None:
        """The grammar thread is done with ``job``: go on with its request, or send its
        error. One aborted meanwhile is dropped."""
        if not self.grammars.take(job):
            return
        if job.error is not None:
            self.fail(job.msg.request_id, job.error)
        else:
            self.add(job.msg, job.arrival, compiled=True)

    def fetched(self, fetch: Fetch) -> None:
        """A fetch thread is done with ``fetch``: queue its request in the engine, or send
        its error. One aborted meanwhile (no longer in ``fetching``) is dropped: no Output,
        and its tensors (and the mapping or message they view) go with it."""
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
        """Add ``msg`` to the engine, asking it for what the role it was taken in needs
        (:meth:`Roles.role_of`): a prefill worker's requests hold their
        prompt's KV for :meth:`export` (written layer by layer into the exporter's layer
        sink with ``--kv-layer-pipeline``); a decode worker's (or, elastic, a colocated
        worker's, which then decodes it) bring KV. Raises ``ValueError`` as
        ``LLMEngine.add_request``, or for KV sent to a prefill worker."""
        role = self.roles.role_of(msg.request_id)
        if kv is not None and msg.first_token is not None and role == "prefill":
            raise ValueError("a prefill worker takes no kv or first_token")
        prefill = role == "prefill"
        self.engine.add_request(msg.request_id, msg.prompt_token_ids, msg.sampling, kv, msg.first_token,
                                timings=timings, arrival=arrival,
                                images=[(im.hash, im.tokens) for im in msg.images], image_embeddings=embeddings,
                                hold_kv=prefill, layer_sink=self.exporter.layer_sink if prefill else None)

    def requests(self) -> list[str]:
        """The request ids queued or running in the engine, fetching, or compiling their grammar."""
        return list(self.engine.seqs) + list(self.fetching) + list(self.grammars.pending)

    def holding(self) -> set[str]:
        """The request ids this worker holds: :meth:`requests`, and those exported and not
        yet released."""
        return set(self.requests()) | set(self.exporter.table.ids())

    def set_role(self, msg: P.SetRole, arrival: float) -> None:
        """Take ``msg.role``'s work from now on and drain the old role's (see the module's
        docstring); :meth:`finish_switch` announces it. A second SetRole while one drains
        redirects it: the work of both older roles drains."""
        previous = self.role
        self.roles.begin(msg.role, msg.switch_id, arrival, self.holding())
        log.info("%s: switching role %s -> %s (%d requests to drain)", self.worker_id, previous, msg.role,
                 len(self.roles.switch.held))
        self.finish_switch()

    def finish_switch(self) -> None:
        """Announce the switch being drained once nothing of the old role is left."""
        switch = self.roles.drained(self.holding())
        if switch is None:
            return
        drain_ms = switch.drain_ms
        self.hello = self.hello.model_copy(update={"role": self.role}) if self.hello else None
        log.info("%s: now %s (was %s; drained in %.0f ms)", self.worker_id, self.role, switch.previous, drain_ms)
        self.send(P.RoleSwitched(worker_id=self.worker_id, role=self.role, previous=switch.previous,
                                 switch_id=switch.switch_id, drain_ms=drain_ms))

    def fail(self, request_id: str, message: str, status: int = 400) -> None:
        """Tell the router the request ended with an error (see :class:`~epdserve.serving.protocol.Error`)."""
        self.roles.forget(request_id)
        self.send(P.Error(worker_id=self.worker_id, request_id=request_id, message=message, status=status))

    def stop_fetches(self) -> None:
        """Drop every fetch in flight and wait for the fetch threads to end (see
        :meth:`Fetcher.stop`). Their requests get no Error: as those in the engine, they end
        with the worker, and the router fails them when it sees it go."""
        self.fetcher.stop()

    def image_embeddings(self, msg: P.AddRequest, arrival: float, timings: StageTimings) -> torch.Tensor:
        """``[image tokens, hidden]`` for ``msg``'s images, in prompt order, encoded here from
        the bytes that came with the request (``encode_queue_ms`` from ``arrival``,
        ``encode_ms``). Runs on the loop and blocks it while it encodes, by design: a
        vision encoder inside an engine does (EPD moves it to encode workers, whose
        embeddings are fetched off the loop by :func:`~epdserve.serving.worker.fetch.fetch_embeddings`).

        Raises:
            ValueError: images without bytes, or a model without a vision tower.
            ImageError: bytes that do not decode to an image.
        """
        start = time.perf_counter()
        if self.encoder is None:
            raise ValueError("this worker has no vision encoder: its model takes no images")
        results = self.encoder.encode(image_inputs(msg.images))
        error = next((r for r in results if isinstance(r, ImageError)), None)
        if error is not None:
            raise error
        timings.encode_queue_ms, timings.encode_ms = (start - arrival) * 1e3, (time.perf_counter() - start) * 1e3
        return torch.cat([r.embeddings for r in results])

    def release(self, request_id: str) -> None:
        """End this worker's export of the request, if it holds one (ReleaseKV, Abort)."""
        self.exporter.table.release(request_id)

    def step(self) -> None:
        try:
            outputs = self.engine.step()
        except RankFailure as exc:
            self.ranks_failed(exc)
            return
        except Exception:
            # A bug must not hang clients: fail what is in flight, keep serving.
            log.error("%s: engine step failed:\n%s", self.worker_id, traceback.format_exc())
            self.fail_engine_requests("internal error in the engine step")
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

    def fail_engine_requests(self, message: str) -> None:
        """End every request in the engine with a ``P.Error`` (status 500) of ``message``."""
        for request_id in list(self.engine.seqs):
            self.engine.abort(request_id)
            self.send(P.Error(worker_id=self.worker_id, request_id=request_id, message=message, status=500))

    def ranks_failed(self, exc: RankFailure) -> None:
        """A tensor-parallel rank failed (``exc`` says which, or the failed call): the ranks
        are out of step, so fail the engine's requests and stop (exit status 1: ``serve``
        restarts the worker, its ranks included)."""
        self.fail_engine_requests(f"the worker's tensor-parallel ranks failed ({exc}); it is restarting")
        stop_for_failed_ranks(self, exc)

    def report_stats(self) -> None:
        stats = self.engine.stats()
        if self.encoder is not None:
            stats.update(mm_cache_queries=self.encoder.cache.queries, mm_cache_hits=self.encoder.cache.hits)
        now = time.monotonic()
        if stats != self.last_stats or now - self.last_stats_time > STATS_INTERVAL_S:
            self.send(P.Stats(worker_id=self.worker_id, **stats))
            self.last_stats, self.last_stats_time = stats, now

    def expire_exports(self) -> None:
        for request_id in self.exporter.expire():
            log.warning("%s: KV of %s not taken within %.0f s; freed", self.worker_id, request_id,
                        self.exporter.ttl_s)


def run(args: Options) -> int:
    """Start the worker; returns 0 on shutdown, 2 on a bad option or model (a TCP listener
    without a token, see ``auth.options_error``) or when the router refuses it, 1 when a
    tensor-parallel rank fails (at start-up or later: ``Worker.ranks_failed``)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    config = WorkerConfig.from_args(args)
    serves_tcp = (config.role in ("prefill", "encode") or config.elastic) and config.kv_transport != "shm"
    listeners = [a for a in (config.bind, config.kv_bind if serves_tcp else "") if a.startswith("tcp://")]
    error = auth.options_error(config, listeners)
    if error is not None:
        print(f"epdserve worker: error: {error}", flush=True)
        return 2
    keyring = auth.keyring_from(config)
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
    worker.sealer, worker.incarnation, worker.ranks = keyring.sealer("events"), incarnation, ranks
    # The address bound, not the one asked for: "tcp://IP:0" (Ray actors) resolves to a free port.
    addr = cmd.getsockopt_string(zmq.LAST_ENDPOINT) if config.bind.startswith("tcp://") else config.bind
    worker.hello = P.Hello(worker_id=config.worker_id, role=config.role, addr=addr, model=info.name,
                           fingerprint=model_fingerprint(info.path), kv_layout=kv_layout,
                           blocks_total=blocks_total, cores=cores, auth=auth_tag(config.auth_token, config.worker_id),
                           incarnation=incarnation, protocol=P.PROTOCOL_VERSION,
                           weight_format=engine.model.weight_format.name if engine else "",
                           tuned={name: t.as_json() for name, t in engine.tuned.items()} if engine else {},
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
