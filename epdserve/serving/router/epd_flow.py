"""The flow of an epd request with images: its images go to encode workers first (spread
over them); once every one has answered with its frame, the request goes on as a
disaggregated one, its prefill worker getting the frames instead of the image bytes."""

from __future__ import annotations

import logging
from typing import AsyncIterator

from epdserve.serving import protocol as P
from epdserve.serving.router.events import Encoded, Tick, WorkerDown, WorkerError, WorkerFailed
from epdserve.serving.router.flows import DisaggregatedFlow, Tokens
from epdserve.serving.router.registry import WorkerState
from epdserve.trace import RequestTrace
from epdserve.serving.api.errors import APIError

log = logging.getLogger("epdserve.router")


class EncodeFlow(DisaggregatedFlow):
    """epd with images: encode workers -> prefill worker -> KV hand-off -> decode worker."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.encoders: dict[str, tuple[WorkerState, list[int]]] = {}  # id -> (worker, its images)
        self.embeddings: list[P.EmbeddingRef] = []

    def _begin(self) -> None:
        """Deal the images round-robin to the live encode workers, least loaded first; each
        answers with one frame. Raises APIError 503 if none is live."""
        workers = self.registry.encoders()
        if not workers:
            raise APIError("no live encode worker", status=503, type="service_unavailable")
        n = len(self.images)
        shares = [list(range(i, n, len(workers))) for i in range(min(len(workers), n))]
        for worker, indices in zip(workers, shares):
            self.encoders[worker.worker_id] = (worker, indices)
            self.holdings.encoding(worker)
            self.registry.send(worker, P.Encode(request_id=self.request_id, images=[self.images[i] for i in indices]))

    async def _outputs(self) -> AsyncIterator[Tokens]:
        lost = await self._encoded()
        prefill = self._pick("prefill")
        if lost is not None:  # the prefill worker encodes every image, as for a retried prefill
            self.record.migrations = [{"from": lost.worker_id, "to": prefill.worker_id,
                                       "recomputed_tokens": sum(im.tokens for im in self.images)}]
            log.warning("%s: encode worker %s died (%s); %s encodes the images", self.request_id, lost.worker_id,
                        lost.dead, prefill.worker_id)
        self._dispatch(prefill, "prefill")
        async for item in super()._outputs():
            yield item

    def _image_fields(self, role: str) -> dict:
        """With the frames, no worker encodes: every one gets the hashes alone."""
        encodes_here = role != "decode" and not self.embeddings
        images = self.images if encodes_here else [im.model_copy(update={"data": None}) for im in self.images]
        return {"images": images, "embeddings": self.embeddings}

    def _retry(self, worker: WorkerState, role: str) -> None:
        # The dead worker may have read, and so deleted, the frames: the next one encodes.
        self.embeddings = []
        self._dispatch(worker, role)

    async def _encoded(self) -> WorkerState | None:
        """Every encode worker's frame; timings of the last to answer (the critical path). An encode
        worker that died: returned at once with no frames kept (``--migration-limit`` above 0), the
        prefill worker to encode. Raises WorkerFailed: rejected (400), failed (500), died (503, with
        ``--migration-limit 0``), silent (504)."""
        waiting = dict(self.encoders)
        timeout = self.config.request_timeout_s
        silent_since = self.config.clock()
        while waiting:
            event = self._down_if_lost(await self._poll(), waiting)
            if isinstance(event, (Tick, WorkerDown)):
                dead = next((w for w, _ in waiting.values() if w.dead), None)
                if dead is not None:
                    self.holdings.lost(dead)
                    if not self.config.migration_limit:
                        raise WorkerFailed(f"encode worker {dead.worker_id} died ({dead.dead})", 503)
                    self.embeddings = []
                    return dead
                if self.config.clock() - silent_since > timeout:
                    raise WorkerFailed(f"no embeddings within {timeout:.0f} s", 504)
                continue
            if not isinstance(event, (Encoded, WorkerError)) or event.worker_id not in waiting:
                continue
            worker, indices = waiting.pop(event.worker_id)
            if isinstance(event, WorkerError):
                what = "rejected the images" if event.msg.status < 500 else "failed"
                raise WorkerFailed(f"encode worker {worker.worker_id} {what}: {event.msg.message}", event.msg.status)
            self.embeddings.append(P.EmbeddingRef(images=indices, frame=event.msg.frame))
            self.record.add("encode", event.msg.timings)
        return None

    def trace(self) -> RequestTrace:
        rec = super().trace()
        if self.encoders:
            rec.encode_workers = sorted(self.encoders)
        return rec
