"""One engine worker process (``epdserve worker``): colocated, prefill, decode or encode.

It binds a PULL socket for the router's commands (a thread of its own receives them and
stamps their arrival), connects a PUSH socket to the router's events address, says
:class:`~epdserve.serving.protocol.Hello`, then loops: handle the received commands, run
one engine step if there is work, publish the new tokens, report
:class:`~epdserve.serving.protocol.Stats`. A prefill worker writes each hand-off's KV
blocks to shared memory and owns that segment until the decode worker has taken it
(the decode worker unlinks it), the router releases it, or ``--kv-ttl`` passes. A worker
that prefills a prompt with images gets their embeddings from encode workers (EPD) or,
given the image bytes, encodes them itself first (colocated, PD), blocking its loop as a
vision encoder inside an engine does. An encode worker runs
:class:`~epdserve.serving.encode_worker.EncodeWorker` instead. The same command runs
alone on another host, so a launcher, Ray or Kubernetes can place it.

Every frame it sends is sealed, and every command it receives checked, with keys derived
from ``--auth-token`` (:mod:`epdserve.serving.auth`); commands are sealed for this process
alone (its random ``incarnation``). A TCP listener (``--bind``, or ``--kv-bind`` when it
serves KV) needs a token unless ``--allow-unauthenticated``. On
:class:`~epdserve.serving.protocol.Reset` (the router took it for down and hears it again)
it drops every request and export it holds and says Hello again.
"""

from __future__ import annotations

import argparse
import logging
import os
import queue
import secrets
import signal
import threading
import time
import traceback

import torch
import zmq

from epdserve.engine.encoder import EncodeEngine
from epdserve.engine.engine import DTYPES, ROLES, EngineConfig, LLMEngine, StepOutput
from epdserve.model.image_processor import ImageError
from epdserve.model.loader import ModelLoadError, resolve_model
from epdserve.serving import auth
from epdserve.serving import protocol as P
from epdserve.serving.encode_worker import EncodeWorker, handle_control, image_inputs
from epdserve.serving.handshake import auth_tag, model_fingerprint
from epdserve.transfer import embedding, handoff, kv_codec, tcp
from epdserve.transfer.wire import WireError

log = logging.getLogger("epdserve.worker")
STATS_INTERVAL_S = 0.5
HEARTBEAT_INTERVAL_S = 0.5
IDLE_WAIT_S = 0.1  # how long an idle worker waits for a command before its housekeeping


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--role", choices=ROLES + ("encode",), required=True)
    parser.add_argument("--router", required=True, help="router events address, e.g. tcp://127.0.0.1:5555")
    parser.add_argument("--bind", required=True, help="address for this worker's command socket")
    parser.add_argument("--worker-id", required=True)
    parser.add_argument("--model", default=None, help="GGUF file or Hugging Face directory (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--cores", default=None, help="CPU cores to pin to, e.g. 0,1 (default: all allowed)")
    add_engine_arguments(parser)
    parser.add_argument("--kv-ttl", type=float, default=120.0,
                        help="seconds a prefill worker keeps an exported KV segment nobody took")
    parser.add_argument("--kv-transport", choices=handoff.TRANSPORTS, default="auto",
                        help="KV hand-off: shared memory on the same host, TCP otherwise (auto), or one of them")
    parser.add_argument("--kv-bind", default="tcp://127.0.0.1:0",
                        help="address a prefill (encode) worker serves KV (embeddings) on over TCP "
                             "(port 0: any free port)")
    parser.add_argument("--kv-transfer-timeout", type=float, default=30.0,
                        help="seconds a decode worker waits for a KV fetch over TCP")
    parser.add_argument("--kv-transfer-dtype", choices=kv_codec.TRANSFER_DTYPES, default="none",
                        help="how a prefill worker sends KV: as cached, bf16, or int8 with per-token, per-head scales")
    parser.add_argument("--kv-layer-pipeline", action="store_true",
                        help="a prefill worker writes each layer's KV into the outgoing frame as soon as the layer "
                             "is computed (a staged frame instead of its shared KV pool)")
    auth.add_arguments(parser, "shared secret that seals every frame between this worker, the router and the "
                               "other workers (default: $EPDSERVE_AUTH_TOKEN)")


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """Engine options shared by ``worker`` and ``serve``."""
    parser.add_argument("--kv-cache-memory-mb", type=int, default=1024, help="KV cache budget per worker (MiB)")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument("--enable-chunked-prefill", action="store_true")
    parser.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                        help="reuse the KV blocks of cached prompt prefixes (vLLM's default: on)")
    parser.add_argument("--dtype", choices=list(DTYPES), default="float32")
    parser.add_argument("--quantized-weights", action=argparse.BooleanOptionalAction, default=True,
                        help="float32 with a Q4_1 / Q8_0 GGUF model: matmuls read the GGUF's weight blocks "
                             "(model/quant.py; same greedy tokens, less memory traffic); off: dense float32")


def engine_config(args: argparse.Namespace, role: str) -> EngineConfig:
    return EngineConfig(role=role, block_size=args.block_size, kv_cache_memory_mb=args.kv_cache_memory_mb,
                        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                        enable_chunked_prefill=args.enable_chunked_prefill,
                        enable_prefix_caching=args.enable_prefix_caching, dtype=args.dtype,
                        quantized_weights=args.quantized_weights)


def pin_to_cores(spec: str | None) -> list[int]:
    """Pin this process (and torch's thread pool) to ``spec`` ("0,1"); returns the cores.

    Raises:
        ValueError: a core that is not a number or not available to this process.
    """
    import torch

    allowed = sorted(os.sched_getaffinity(0))
    if spec is None:
        cores = allowed
    else:
        try:
            cores = sorted({int(c) for c in spec.split(",")})
        except ValueError:
            raise ValueError(f"--cores {spec!r}: expected comma-separated core numbers") from None
        if not set(cores) <= set(allowed):
            raise ValueError(f"--cores {spec!r}: available cores are {allowed}")
        os.sched_setaffinity(0, cores)
    torch.set_num_threads(len(cores))
    return cores


class Worker:
    """The command/step/publish loop around one :class:`LLMEngine`; commands come from
    ``inbox`` as ``(message, arrival)`` pairs put there by :func:`receive_commands`.
    ``run`` sets ``sealer`` (seals events), ``incarnation`` and ``hello`` (what a Reset is
    answered with, see ``encode_worker.handle_control``)."""

    sealer: auth.Sealer = auth.NO_AUTH.sealer("events")
    incarnation: str = ""
    hello: P.Hello | None = None

    def __init__(self, engine: LLMEngine, worker_id: str, inbox: queue.Queue, events: zmq.Socket,
                 exporter: handoff.Exporter, importer: handoff.Importer, encoder: EncodeEngine | None = None):
        self.engine = engine
        self.encoder = encoder  # for prompts with images that come with their bytes
        self.worker_id = worker_id
        self.role = engine.config.role
        self.inbox = inbox
        self.events = events
        self.exporter = exporter
        self.importer = importer
        self.last_stats: dict | None = None
        self.last_stats_time = 0.0
        self.running = True
        self.exit_code = 0

    def send(self, msg) -> None:
        self.events.send(self.sealer.seal(P.encode(msg)))

    def reset(self) -> str:
        """Abort every request and release every export (see ``P.Reset``: the router has
        failed or moved them all); returns what was dropped, for the log."""
        requests, exports = list(self.engine.seqs), list(self.exporter.exports)
        for request_id in requests:
            self.engine.abort(request_id)
        for request_id in exports:
            self.exporter.release(request_id)
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
            self.report_stats()
            self.expire_exports()
        self.exporter.close()

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
        """Act on one command; ``arrival`` is its ``time.perf_counter()`` on receipt."""
        if isinstance(msg, P.AddRequest):
            self.add(msg, arrival)
        elif isinstance(msg, P.Abort):
            self.engine.abort(msg.request_id)
            self.release(msg.request_id)
        elif isinstance(msg, P.ReleaseKV):
            self.release(msg.request_id)
        else:
            handle_control(self, msg)

    def add(self, msg: P.AddRequest, arrival: float) -> None:
        try:
            kv, timings, embeddings = None, {}, None
            if msg.kv is not None:
                # Blocks the loop for up to --kv-transfer-timeout when the KV comes over TCP.
                kv, timings = self.importer.take(msg.request_id, msg.kv, self.engine.kv_layout(),
                                                 self.engine.kv_cache.dtype)
            elif msg.images:
                embeddings = self.image_embeddings(msg, arrival, timings)
                arrival = time.perf_counter()  # encoding or fetching them is its own stage, not queue time
            self.engine.add_request(msg.request_id, msg.prompt_token_ids, msg.sampling, kv, msg.first_token,
                                    timings=timings, arrival=arrival,
                                    images=[(im.hash, im.tokens) for im in msg.images], image_embeddings=embeddings)
        except (ValueError, WireError, ImageError) as exc:
            self.send(P.Error(worker_id=self.worker_id, request_id=msg.request_id, message=str(exc)))

    def image_embeddings(self, msg: P.AddRequest, arrival: float, timings: dict[str, float]) -> torch.Tensor:
        """``[image tokens, hidden]`` for ``msg``'s images, in prompt order: read from the
        encode workers' frames (``embedding_fetch_ms``), or encoded here (``encode_queue_ms``
        from ``arrival``, ``encode_ms``). Blocks the loop while it encodes or fetches.

        Raises:
            ValueError: images neither encoded nor with bytes, or a model without a vision tower.
            WireError: a frame that is gone, unreachable or not these images' embeddings.
            ImageError: bytes that do not decode to an image.
        """
        start = time.perf_counter()
        if msg.embeddings:
            parts: list[torch.Tensor | None] = [None] * len(msg.images)
            for ref in msg.embeddings:
                header, tensors = self.importer.fetch_frame(msg.request_id, ref.frame)
                hashes = [msg.images[i].hash for i in ref.images]
                for i, image in zip(ref.images, embedding.unpack(header, tensors, self.engine.model.config.hidden_size,
                                                                 hashes)):
                    parts[i] = image.embeddings
            if any(part is None for part in parts):
                raise ValueError("embeddings are missing for some of the request's images")
            timings["embedding_fetch_ms"] = (time.perf_counter() - start) * 1e3
            return torch.cat(parts)
        if self.encoder is None:
            raise ValueError("this worker has no vision encoder: its model takes no images")
        results = self.encoder.encode(image_inputs(msg.images))
        error = next((r for r in results if isinstance(r, ImageError)), None)
        if error is not None:
            raise error
        timings.update(encode_queue_ms=(start - arrival) * 1e3, encode_ms=(time.perf_counter() - start) * 1e3)
        return torch.cat([r.embeddings for r in results])

    def release(self, request_id: str) -> None:
        self.exporter.release(request_id)

    def step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception:
            # A bug must not hang clients: fail what is in flight, keep serving.
            log.error("%s: engine step failed:\n%s", self.worker_id, traceback.format_exc())
            for request_id in list(self.engine.seqs):
                self.engine.abort(request_id)
                self.send(P.Error(worker_id=self.worker_id, request_id=request_id,
                                  message="internal error in the engine step"))
            return
        for out in outputs:
            if out.error is not None:
                self.send(P.Error(worker_id=self.worker_id, request_id=out.request_id, message=out.error))
                continue
            kv = self.export(out) if out.kv_block_ids is not None else None
            self.send(P.Output(worker_id=self.worker_id, request_id=out.request_id, token_ids=out.token_ids,
                               finished=out.finished, finish_reason=out.finish_reason, kv=kv,
                               timings=out.timings, logprobs=out.logprobs,
                               num_cached_tokens=out.num_cached_tokens))

    def export(self, out: StepOutput) -> P.KVDescriptor:
        return self.exporter.export(out)

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


def receive_commands(cmd: zmq.Socket, inbox: queue.Queue, worker_id: str, stop: threading.Event,
                     opener: auth.Opener | None = None) -> None:
    """Thread body: move each command from ``cmd`` into ``inbox`` as ``(message,
    time.perf_counter() at receipt)`` until ``stop`` is set. Stamping on a thread of its own
    counts the time a request waits while the engine is in a long step as queue time, not
    as an unexplained gap; the engine itself stays single-threaded. ``opener`` checks each
    frame's tag first (``auth``; None: no token); frames that fail it or are not epdserve
    messages are logged (rate-limited) and dropped."""
    opener = opener or auth.NO_AUTH.opener("commands")
    drops = auth.DropLog(log, f"{worker_id}: dropped a command frame")
    while not stop.is_set():
        if not cmd.poll(IDLE_WAIT_S * 1000):
            continue
        frame = cmd.recv()
        arrival = time.perf_counter()
        try:
            inbox.put((P.decode(opener.open(frame)), arrival))
        except auth.AuthError as exc:
            drops(f"it failed authentication: {exc}")
        except P.ProtocolError as exc:
            drops(f"it is not an epdserve message: {exc}")


def heartbeat(ctx: zmq.Context, router: str, worker_id: str, stop: threading.Event,
              keyring: auth.Keyring = auth.NO_AUTH, incarnation: str = "0" * 16) -> None:
    """Thread body: send Heartbeat every HEARTBEAT_INTERVAL_S until ``stop`` is set. Its own
    socket (ZeroMQ sockets are not thread-safe), and torch releases the GIL in long engine
    steps, so a worker busy for seconds still shows it is alive. Each beat is sealed anew
    (``keyring``): its counter rises, so a recorded beat cannot be replayed."""
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 4)  # a router that is away gets a few, not a backlog
    keyring.secure_client(sock, router)
    sock.connect(router)
    sealer = keyring.sealer("events")
    body = P.encode(P.Heartbeat(worker_id=worker_id, incarnation=incarnation))
    while not stop.wait(HEARTBEAT_INTERVAL_S):
        try:
            sock.send(sealer.seal(body), zmq.NOBLOCK)
        except zmq.Again:
            pass
    sock.close()


def run(args: argparse.Namespace) -> int:
    """Start the worker; returns 0 on shutdown, 2 on a bad option or model (a TCP listener
    without a token, see ``auth.options_error``) or when the router refuses it."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    encode_role = args.role == "encode"
    serves_tcp = args.role in ("prefill", "encode") and args.kv_transport != "shm"
    listeners = [a for a in (args.bind, args.kv_bind if serves_tcp else "") if a.startswith("tcp://")]
    error = auth.options_error(args, listeners)
    if error is not None:
        print(f"epdserve worker: error: {error}", flush=True)
        return 2
    keyring = auth.keyring_from(args)
    if not keyring.enabled:
        log.warning("%s: no auth token: frames go unsealed, and a router with a token will not hear this worker",
                    args.worker_id)
    tcp.configure(keyring)  # the exporter's KV server and the importer's fetches
    incarnation = secrets.token_hex(8)
    try:
        cores = pin_to_cores(args.cores)
        info = resolve_model(args.model)
        if encode_role or (info.multimodal and args.role in ("colocated", "prefill")):
            encoder = EncodeEngine(info.path, DTYPES[args.dtype])
            if info.synthetic_vision:
                log.warning("%s: the vision tower of %s has SYNTHETIC (seeded random) weights: image outputs "
                            "carry no meaning", args.worker_id, info.name)
        else:
            encoder = None
        if not encode_role:
            # A prefill worker keeps its KV cache in shared memory: a same-host hand-off copies it once.
            shared = args.role == "prefill" and args.kv_transfer_dtype == "none" and not args.kv_layer_pipeline
            engine, kv_pool = handoff.new_engine(str(info.path), engine_config(args, args.role), shared)
    except (ValueError, ModelLoadError, OSError) as exc:
        print(f"epdserve worker: error: {exc}", flush=True)
        return 2
    ctx = zmq.Context()
    cmd = ctx.socket(zmq.PULL)
    keyring.secure_server(cmd, args.bind)
    cmd.bind(args.bind)
    events = ctx.socket(zmq.PUSH)
    events.setsockopt(zmq.LINGER, 1000)
    keyring.secure_client(events, args.router)
    events.connect(args.router)
    inbox: queue.Queue = queue.Queue()
    try:
        if encode_role:
            worker = EncodeWorker(encoder, args.worker_id, inbox, events, ctx, args.kv_bind if serves_tcp else None,
                                  args.kv_ttl)
            kv_layout, blocks_total = worker.kv_layout(), 0
        else:
            exporter = handoff.Exporter(engine, args.kv_ttl, ctx, args.kv_bind if serves_tcp else None,
                                        args.kv_transfer_dtype, kv_pool, args.kv_layer_pipeline)
            importer = handoff.Importer(ctx, args.kv_transport, args.kv_transfer_timeout)
            worker = Worker(engine, args.worker_id, inbox, events, exporter, importer, encoder)
            kv_layout, blocks_total = engine.kv_layout(), engine.pool.num_blocks
    except zmq.ZMQError as exc:
        print(f"epdserve worker: error: --kv-bind {args.kv_bind}: {exc}", flush=True)
        ctx.destroy(linger=0)
        return 2
    signal.signal(signal.SIGTERM, lambda *_: setattr(worker, "running", False))
    worker.sealer, worker.incarnation = keyring.sealer("events"), incarnation
    worker.hello = P.Hello(worker_id=args.worker_id, role=args.role, addr=args.bind, model=info.name,
                           fingerprint=model_fingerprint(info.path), kv_layout=kv_layout,
                           blocks_total=blocks_total, cores=cores, auth=auth_tag(args.auth_token, args.worker_id),
                           incarnation=incarnation)
    worker.send(worker.hello)
    log.info("%s: %s worker on cores %s, %d KV blocks, listening on %s%s",
             args.worker_id, args.role, cores, blocks_total, args.bind, " (CURVE on TCP)" if keyring.curve else "")
    stop = threading.Event()
    beat = threading.Thread(target=heartbeat, args=(ctx, args.router, args.worker_id, stop, keyring, incarnation),
                            name="epdserve-heartbeat", daemon=True)
    # Commands open only with this process's incarnation: none meant for another opens here.
    receiver = threading.Thread(target=receive_commands, name="epdserve-commands", daemon=True,
                                args=(cmd, inbox, args.worker_id, stop, keyring.opener("commands", incarnation)))
    beat.start()
    receiver.start()
    try:
        worker.loop()
    finally:
        stop.set()
        beat.join()
        receiver.join()
    ctx.destroy(linger=1000)
    return worker.exit_code
