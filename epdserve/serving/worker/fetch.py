"""A worker's fetches of a request's KV (decode) or image embeddings (EPD) from the peer that holds
them, on a thread pool off the loop, so that a slow or silent peer delays only that request. A
fetch thread never touches the engine (not thread-safe), only the importer; a finished
:class:`Fetch` goes back into the loop's inbox as ``(fetch, time.perf_counter())``."""

from __future__ import annotations

import logging
import queue
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from epdserve.engine.kv_source import KVSource
from epdserve.serving import protocol as P
from epdserve.transfer import embedding, handoff
from epdserve.transfer.wire import WireError
from epdserve.trace import StageTimings

log = logging.getLogger("epdserve.worker")
# A fetch mostly waits with the GIL released; each holds a request's KV until the loop takes it,
# and a silent peer pins one for --kv-transfer-timeout: 8 leave room while several are stuck.
FETCH_THREADS = 8


@dataclass
class Fetch:
    """``layout``, ``dtype``, ``hidden_size``, ``device``: the engine's, read on the loop (a fetched
    frame is converted on ``device``, its KV cache's). The thread sets ``kv`` or ``embeddings`` and
    ``timings``, or ``error``. ``cancel``: set on Abort or shutdown, ending a TCP wait early."""

    msg: P.AddRequest
    arrival: float  # time.perf_counter() on receipt
    layout: dict
    dtype: torch.dtype
    hidden_size: int
    device: torch.device = torch.device("cpu")
    cancel: threading.Event = field(default_factory=threading.Event)
    kv: KVSource | None = None
    embeddings: torch.Tensor | None = None
    timings: StageTimings = field(default_factory=StageTimings)
    error: str | None = None


class Fetcher:
    """``fetching``: the fetches in flight, by request id."""

    def __init__(self, importer: handoff.Importer, inbox: queue.Queue, worker_id: str):
        self.importer = importer
        self.inbox = inbox
        self.worker_id = worker_id
        self.fetching: dict[str, Fetch] = {}
        self.pool = ThreadPoolExecutor(FETCH_THREADS, thread_name_prefix="epdserve-fetch")

    def start(self, fetch: Fetch) -> None:
        self.fetching[fetch.msg.request_id] = fetch
        self.pool.submit(self.run, fetch)

    def run(self, fetch: Fetch) -> None:
        if fetch.cancel.is_set():  # aborted, or the worker stopping, while it waited
            return
        msg = fetch.msg
        try:
            if msg.kv is not None:
                fetch.kv, fetch.timings = self.importer.take(msg.request_id, msg.kv, fetch.layout, fetch.dtype,
                                                             fetch.cancel, fetch.device)
            else:
                fetch.embeddings = fetch_embeddings(self.importer, msg, fetch.hidden_size, fetch.timings,
                                                    fetch.cancel)
        except (ValueError, WireError) as exc:
            fetch.error = str(exc)
        except Exception:
            # A bug must not leave the request waiting forever: fail it alone.
            log.error("%s: fetch for %s failed:\n%s", self.worker_id, msg.request_id, traceback.format_exc())
            fetch.error = "internal error fetching the request's KV or image embeddings"
        self.inbox.put((fetch, time.perf_counter()))

    def take(self, fetch: Fetch) -> bool:
        """False if ``fetch`` was dropped meanwhile (aborted: its result is to be ignored)."""
        request_id = fetch.msg.request_id
        if self.fetching.get(request_id) is not fetch:
            return False
        del self.fetching[request_id]
        return True

    def cancel(self, request_id: str) -> None:
        fetch = self.fetching.pop(request_id, None)
        if fetch is not None:
            fetch.cancel.set()

    def cancel_all(self) -> None:
        for fetch in self.fetching.values():
            fetch.cancel.set()
        self.fetching.clear()

    def stop(self) -> None:
        """Drop every fetch and wait for the threads: a TCP fetch sees its cancel within
        ``tcp.POLL_MS``."""
        self.cancel_all()
        self.pool.shutdown(wait=True, cancel_futures=True)


def fetch_embeddings(importer: handoff.Importer, msg: P.AddRequest, hidden_size: int, timings: StageTimings,
                     cancel: threading.Event | None = None) -> torch.Tensor:
    """``[image tokens, hidden_size]`` of ``msg``'s images, in prompt order, from the encode
    workers' frames (over TCP each waits up to the importer's timeout, or until ``cancel``); sets
    ``timings.embedding_fetch_ms``. Raises ValueError: some images have no embeddings; WireError: a
    frame gone, unreachable or not these images' embeddings."""
    start = time.perf_counter()
    parts: list[torch.Tensor | None] = [None] * len(msg.images)
    for ref in msg.embeddings:
        header, tensors = importer.fetch_frame(msg.request_id, ref.frame, cancel)
        hashes = [msg.images[i].hash for i in ref.images]
        for i, image in zip(ref.images, embedding.unpack(header, tensors, hidden_size, hashes)):
            parts[i] = image.embeddings
    if any(part is None for part in parts):
        raise ValueError("embeddings are missing for some of the request's images")
    timings.embedding_fetch_ms = (time.perf_counter() - start) * 1e3
    return torch.cat(parts)
