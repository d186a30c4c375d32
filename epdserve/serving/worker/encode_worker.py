"""The encode worker of EPD (``epdserve worker --role encode``): images in, embeddings out.

Same sockets, threads and handshake as an engine worker (:mod:`epdserve.serving.worker.engine_worker`),
but its loop serves :class:`~epdserve.serving.protocol.Encode` commands with an
:class:`~epdserve.engine.encoder.EncodeEngine`: every step takes all the requests that
have arrived and encodes their images together (one vision batch, cached images
answered from the embedding cache), writes each request's embeddings as one frame to a
/dev/shm segment (:mod:`epdserve.transfer.embedding`) and answers
:class:`~epdserve.serving.protocol.Encoded` with its descriptor. A prefill worker on the
same host maps and unlinks the segment; one on another host fetches it from this
worker's TCP server. A frame nobody reads is deleted on ``ReleaseKV`` (the router sends
it when the request ends) or after ``--kv-ttl`` seconds.

With ``--tensor-parallel-size`` N the vision tower is split over N rank processes
(:mod:`~epdserve.serving.worker.ranks`); when one fails, the batch's requests fail with its
message and the worker exits (status 1) so that ``serve`` restarts it with all its ranks.
"""

from __future__ import annotations

import logging
import queue
import time

import zmq

from epdserve.engine.encoder import EncodeEngine
from epdserve.model.image_processor import ImageError
from epdserve.serving import protocol as P
from epdserve.model.image_processor import ImageInput
from epdserve.serving.worker.control import handle_control, stop_for_failed_ranks
from epdserve.serving.worker.ranks import RankFailure, Ranks
from epdserve.transfer import embedding, shm, tcp
from epdserve.transfer.exports import ExportTable
from epdserve.transfer.handoff import host_id
from epdserve.transfer.wire import WireError
from epdserve.trace import StageTimings
from epdserve.transfer.sealing import NO_AUTH, Sealer

log = logging.getLogger("epdserve.encode_worker")
STATS_INTERVAL_S = 0.5
IDLE_WAIT_S = 0.1


def image_inputs(images: list[P.ImageRef]) -> list[ImageInput]:
    """The images of a command, their bytes checked against their hashes (a wrong hash
    would poison the embedding cache).

    Raises:
        ValueError: an image without bytes, or whose bytes do not hash to its ``hash``.
    """
    out = []
    for i, ref in enumerate(images):
        if ref.data is None:
            raise ValueError(f"image {i} came without its bytes")
        image = ImageInput.from_bytes(ref.data, "request", decode=False)
        if image.content_hash != ref.hash:
            raise ValueError(f"image {i}: its bytes hash to {image.content_hash[:12]}, not {ref.hash[:12]}")
        out.append(image)
    return out


class EncodeWorker:
    """The command/encode/publish loop around one :class:`EncodeEngine`. ``kv_bind``: the
    TCP address to serve frames on (None: shared memory only); ``ttl_s``: how long an
    unread frame is kept. ``run`` sets ``sealer`` (seals events), ``incarnation`` and
    ``hello`` (what a Reset is answered with), and ``ranks``: the other ranks of a
    tensor-parallel vision tower, whose failure stops the worker."""

    sealer: Sealer = NO_AUTH.sealer("events")
    incarnation: str = ""
    hello: P.Hello | None = None
    ranks: Ranks | None = None

    def __init__(self, encoder: EncodeEngine, worker_id: str, inbox: queue.Queue, events: zmq.Socket,
                 ctx: zmq.Context, kv_bind: str | None, ttl_s: float):
        self.encoder = encoder
        self.worker_id = worker_id
        self.inbox = inbox
        self.events = events
        self.host = host_id()
        self.server = tcp.KVServer(ctx, kv_bind, self._frame) if kv_bind else None
        self.pending: dict[str, tuple[P.Encode, float]] = {}
        # The embedding frames held for prefill workers (segments only), with their lease.
        self.frames = ExportTable(ttl_s, None, free_blocks=lambda request_id: None)
        self.last_stats: tuple | None = None
        self.last_stats_time = 0.0
        self.running = True
        self.exit_code = 0

    def kv_layout(self) -> dict:
        """What the router checks a prefill worker against: the embeddings' width and dtype."""
        return {"kind": embedding.KIND, "hidden_size": self.encoder.hidden_size,
                "dtype": str(self.encoder.vision.dtype).removeprefix("torch.")}

    def send(self, msg) -> None:
        self.events.send(self.sealer.seal(P.encode(msg)))

    def loop(self) -> None:
        while self.running:
            try:
                item = self.inbox.get(timeout=IDLE_WAIT_S) if not self.pending else self.inbox.get_nowait()
                while True:
                    self.handle(*item)
                    item = self.inbox.get_nowait()
            except queue.Empty:
                pass
            try:
                if self.pending:
                    self.encode_pending()
                elif self.ranks is not None:  # a follower that died while idle
                    self.ranks.check()
            except RankFailure as exc:
                stop_for_failed_ranks(self, exc)
                continue
            self.report_stats()
            self.expire()
        self.close()

    def handle(self, msg, arrival: float) -> None:
        """Act on one command; ``arrival`` is its ``time.perf_counter()`` on receipt."""
        if isinstance(msg, P.Encode):
            self.pending[msg.request_id] = (msg, arrival)
        elif isinstance(msg, (P.ReleaseKV, P.Abort)):
            self.pending.pop(msg.request_id, None)
            self.release(msg.request_id)
        else:
            handle_control(self, msg)

    def encode_pending(self) -> None:
        """Encode the images of every pending request in one call and answer each."""
        batch, self.pending = list(self.pending.values()), {}
        requests = []  # (command, arrival, its images)
        for msg, arrival in batch:
            try:
                requests.append((msg, arrival, image_inputs(msg.images)))
            except ValueError as exc:
                self.send(P.Error(worker_id=self.worker_id, request_id=msg.request_id, message=str(exc)))
        start = time.perf_counter()
        try:
            results = self.encoder.encode([image for _, _, images in requests for image in images])
        except RankFailure as exc:
            why = f"the encode worker's tensor-parallel ranks failed ({exc}); it is restarting"
            for msg, _, _ in requests:
                self.send(P.Error(worker_id=self.worker_id, request_id=msg.request_id, message=why, status=500))
            raise
        k = 0
        for msg, arrival, images in requests:
            mine, k = results[k:k + len(images)], k + len(images)
            error = next((r for r in mine if isinstance(r, ImageError)), None)
            if error is not None:
                self.send(P.Error(worker_id=self.worker_id, request_id=msg.request_id, message=str(error)))
                continue
            written = time.perf_counter()
            try:
                name, nbytes = embedding.write_segment(mine)
            except OSError as exc:
                log.error("%s: cannot write the embeddings of %s: %s", self.worker_id, msg.request_id, exc)
                self.send(P.Error(worker_id=self.worker_id, request_id=msg.request_id,
                                  message="the encode worker could not store the embeddings", status=500))
                continue
            self.frames.add_segment(msg.request_id, name)
            # encode_ms: the whole call's time up to this frame, not the images' own share:
            # the request waits for the batch it is in.
            timings = StageTimings(encode_queue_ms=(start - arrival) * 1e3, encode_ms=(written - start) * 1e3,
                                   embedding_export_ms=(time.perf_counter() - written) * 1e3,
                                   embedding_bytes=float(nbytes))
            frame = P.KVDescriptor(kind="shm", name=name, num_tokens=sum(len(r.embeddings) for r in mine),
                                   nbytes=nbytes, host_id=self.host, addr=self.server and self.server.addr)
            self.send(P.Encoded(worker_id=self.worker_id, request_id=msg.request_id, frame=frame, timings=timings))

    def _frame(self, request_id: str, name: str):
        """KV server source (its own thread): the request's segment, mapped and unlinked."""
        held = self.frames.get(request_id)
        if held is None or held.name != name:
            raise WireError(f"no embeddings {name} for request {request_id}")
        return shm.open_segment(name)

    def reset(self) -> str:
        """Drop every pending encoding and delete every frame held (see ``P.Reset``);
        returns what was dropped, for the log."""
        pending, frames = len(self.pending), len(self.frames)
        self.pending.clear()
        self.frames.close()
        self.last_stats = None  # report the emptied state at once
        return f"{pending} pending encodings, {frames} frames"

    @property
    def ttl_s(self) -> float:
        return self.frames.ttl_s

    def release(self, request_id: str) -> None:
        self.frames.release(request_id)

    def expire(self) -> None:
        for request_id in self.frames.expire():
            log.warning("%s: embeddings of %s not read within %.0f s; deleted", self.worker_id, request_id,
                        self.ttl_s)

    def report_stats(self) -> None:
        cache = self.encoder.cache
        stats = (len(self.pending), cache.queries, cache.hits)
        now = time.monotonic()
        if stats != self.last_stats or now - self.last_stats_time > STATS_INTERVAL_S:
            self.send(P.Stats(worker_id=self.worker_id, blocks_total=0, blocks_in_use=0, num_running=0,
                              num_waiting=len(self.pending), num_preemptions=0,
                              mm_cache_queries=cache.queries, mm_cache_hits=cache.hits))
            self.last_stats, self.last_stats_time = stats, now

    def close(self) -> None:
        """Stop serving and delete every frame still held."""
        if self.server is not None:
            self.server.close()
        self.frames.close()
