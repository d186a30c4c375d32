"""What one request holds on workers: the holder gets ``Abort``, the KV's prefill worker and
the encode workers ``ReleaseKV``. Each holding is cleared as its message goes out, so it is
given back exactly once; a worker that went down is only forgotten (its Reset drops it all).
"""

from __future__ import annotations

from epdserve.serving import protocol as P
from epdserve.serving.router.registry import Registry, WorkerState


class Holdings:
    """Sends quietly: a full command queue is logged, never raised."""

    def __init__(self, registry: Registry, request_id: str):
        self.registry = registry
        self.request_id = request_id
        self.holder: WorkerState | None = None
        self.kv: WorkerState | None = None
        self.frames: list[WorkerState] = []

    def hold(self, worker: WorkerState, tokens: int, exports_kv: bool = False) -> None:
        """``tokens``: prompt + max_tokens; ``exports_kv``: it may export the KV any time from now."""
        worker.outstanding[self.request_id] = tokens
        self.holder = worker
        if exports_kv:
            if self.kv is not None:  # a retry elsewhere: the first worker's export is gone with its failure
                self._forget_kv()
            self.kv = worker
            worker.exports.add(self.request_id)

    def done(self, worker: WorkerState, failed: bool = False) -> None:
        """Its last output or KV export; ``failed``: its Error, after which it keeps no export either."""
        if self.holder is worker:
            self.holder = None
        if failed and self.kv is worker:
            self._forget_kv()

    def encoding(self, worker: WorkerState) -> None:
        worker.outstanding[self.request_id] = 0
        self.frames.append(worker)

    def lost(self, worker: WorkerState) -> None:
        """Nothing is sent to it."""
        if self.holder is worker:
            self.holder = None
        if self.kv is worker:
            self._forget_kv()
        self.frames = [w for w in self.frames if w is not worker]

    def release_kv(self) -> None:
        if self.kv is not None:
            worker = self.kv
            self._forget_kv()
            self.registry.send_quietly(worker, P.ReleaseKV(request_id=self.request_id))

    def _forget_kv(self) -> None:
        self.kv.exports.discard(self.request_id)
        self.kv = None

    def settle(self) -> list[tuple[str, str]]:
        """On any ending; returns ``(worker id, message type)`` of what was sent, in order."""
        sent = []
        if self.holder is not None:
            worker, self.holder = self.holder, None
            worker.outstanding.pop(self.request_id, None)
            self.registry.send_quietly(worker, P.Abort(request_id=self.request_id))
            sent.append((worker.worker_id, "abort"))
        if self.kv is not None:
            sent.append((self.kv.worker_id, "release_kv"))
            self.release_kv()
        frames, self.frames = self.frames, []
        for worker in frames:  # an encoding in progress, or a frame never read
            worker.outstanding.pop(self.request_id, None)
            self.registry.send_quietly(worker, P.ReleaseKV(request_id=self.request_id))
            sent.append((worker.worker_id, "release_kv"))
        return sent
