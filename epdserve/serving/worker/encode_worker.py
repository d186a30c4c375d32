"""The encode worker of EPD (``epdserve worker --role encode``): each step encodes the images of
every request that has arrived in one vision batch and answers each with
:class:`~epdserve.serving.protocol.Encoded`: one frame (:mod:`epdserve.transfer.embedding`) in a
/dev/shm segment, also served over TCP, deleted on ``ReleaseKV`` or after ``--kv-ttl`` seconds."""

from __future__ import annotations

import logging
import queue
import time

import zmq

from epdserve.engine.encoder import EncodeEngine
from epdserve.model.image_processor import ImageError
from epdserve.serving import protocol as P
from epdserve.serving.worker.control import handle_control
from epdserve.serving.worker.image_encoder import cache_stats, image_inputs
from epdserve.serving.worker.rank_watch import RankWatch
from epdserve.serving.worker.ranks import RankFailure
from epdserve.serving.worker.stats_report import StatsReport
from epdserve.serving.worker.threads import IDLE_WAIT_S
from epdserve.transfer import embedding, shm, tcp
from epdserve.transfer.exports import ExportTable
from epdserve.transfer.handoff import host_id
from epdserve.transfer.wire import WireError
from epdserve.trace import StageTimings
from epdserve.transfer.sealing import NO_AUTH, Sealer

log = logging.getLogger("epdserve.encode_worker")


class EncodeWorker:
    """``kv_bind``: the TCP address to serve frames on (None: shared memory only); ``ttl_s``:
    seconds an unread frame is kept. ``run`` sets ``sealer``, ``incarnation``, ``hello`` and
    ``rank_watch.ranks``."""

    sealer: Sealer = NO_AUTH.sealer("events")
    incarnation: str = ""
    hello: P.Hello | None = None

    def __init__(self, encoder: EncodeEngine, worker_id: str, inbox: queue.Queue, events: zmq.Socket,
                 ctx: zmq.Context, kv_bind: str | None, ttl_s: float):
        self.encoder = encoder
        self.worker_id = worker_id
        self.inbox = inbox
        self.events = events
        self.host = host_id()
        self.server = tcp.KVServer(ctx, kv_bind, self._frame) if kv_bind else None
        self.pending: dict[str, tuple[P.Encode, float]] = {}
        self.frames = ExportTable(ttl_s, None, free_blocks=lambda request_id: None)  # segments only
        self.running = True
        self.exit_code = 0
        self.rank_watch = RankWatch(self, "encode worker")
        self.stats = StatsReport(worker_id, self.send)

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
            if self.pending:
                self.encode_pending()
            else:
                self.rank_watch.check()  # a follower that died while idle
            if self.rank_watch.failure is not None:
                continue
            self.report_stats()
            self.expire()
        self.close()

    def handle(self, msg, arrival: float) -> None:
        if isinstance(msg, P.Encode):
            self.pending[msg.request_id] = (msg, arrival)
        elif isinstance(msg, (P.ReleaseKV, P.Abort)):
            self.pending.pop(msg.request_id, None)
            self.release(msg.request_id)
        else:
            handle_control(self, msg)

    def encode_pending(self) -> None:
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
            self.rank_watch.failed(exc, [msg.request_id for msg, _, _ in requests])
            return
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
        """``P.Reset``: returns what was dropped, for the log."""
        pending, frames = len(self.pending), len(self.frames)
        self.pending.clear()
        self.frames.close()
        self.stats.send_next()
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
        self.stats.report(dict(blocks_total=0, blocks_in_use=0, num_running=0, num_waiting=len(self.pending),
                               num_preemptions=0, **cache_stats(self.encoder)))

    def close(self) -> None:
        """Delete every frame still held."""
        if self.server is not None:
            self.server.close()
        self.frames.close()
