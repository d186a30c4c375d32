"""A worker's fetches from peers, off its loop: a request's KV (decode) or its images'
embeddings (EPD) held by another worker are fetched on a small thread pool, so a slow or
silent peer delays only that request.

The loop starts a fetch (:meth:`Fetcher.start`) with what the thread needs to know of the
engine, read up front: the thread never touches the engine or its KV cache (neither is
thread-safe), only the :class:`~epdserve.transfer.handoff.Importer`. When the thread is
done it puts the :class:`Fetch` back into the loop's inbox as ``(fetch, time)`` (so a
fetch that ends wakes an idle loop at once), and the loop takes it (:meth:`Fetcher.take`).
"""

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
# Threads fetching KV and image embeddings from peers. A fetch mostly waits (on a TCP peer,
# or page faults of a /dev/shm mapping) with the GIL released, so threads beyond this
# worker's cores cost it little; what bounds them is that each one holds a request's KV
# until the loop takes it, and that a peer that never answers pins one thread for up to
# --kv-transfer-timeout. 8 leave room for hand-offs from healthy peers while several are
# stuck; more fetches than threads wait for one (counted in queue_ms).
FETCH_THREADS = 8


@dataclass
class Fetch:
    """An AddRequest whose KV or image embeddings a fetch thread is getting from a peer,
    with what the thread needs of the engine (``layout``, ``dtype``, ``hidden_size``, and
    ``device``: its KV cache's, where a fetched frame is converted); the thread sets ``kv``
    or ``embeddings`` and ``timings``, or ``error``. ``cancel``: set on Abort or shutdown,
    ending a TCP wait early."""

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
    """The fetches in flight of worker ``worker_id`` (``fetching``, by request id), run on
    ``FETCH_THREADS`` threads with ``importer``; finished ones go into ``inbox``."""

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
        """Thread body: get ``fetch``'s KV (``Importer.take``) or embeddings
        (:func:`fetch_embeddings`) into it, or the error, then hand it to the loop through
        the inbox."""
        if fetch.cancel.is_set():  # aborted, or the worker stopping, while it waited for a thread
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
        """The loop got ``fetch`` back: True (and it is no longer in flight) unless it was
        dropped meanwhile (aborted: its result, tensors and all, is to be ignored)."""
        request_id = fetch.msg.request_id
        if self.fetching.get(request_id) is not fetch:
            return False
        del self.fetching[request_id]
        return True

    def cancel(self, request_id: str) -> None:
        """Drop the request's fetch, if one is in flight (its result is ignored when it comes)."""
        fetch = self.fetching.pop(request_id, None)
        if fetch is not None:
            fetch.cancel.set()

    def cancel_all(self) -> None:
        for fetch in self.fetching.values():
            fetch.cancel.set()
        self.fetching.clear()

    def stop(self) -> None:
        """Drop every fetch in flight and wait for the threads to end, briefly: a TCP fetch
        sees its cancel within ``tcp.POLL_MS``, a shared-memory one only maps and checks."""
        self.cancel_all()
        self.pool.shutdown(wait=True, cancel_futures=True)


def fetch_embeddings(importer: handoff.Importer, msg: P.AddRequest, hidden_size: int, timings: StageTimings,
                     cancel: threading.Event | None = None) -> torch.Tensor:
    """``[image tokens, hidden_size]`` for ``msg``'s images, in prompt order, read from the
    encode workers' frames ``msg.embeddings``; adds ``embedding_fetch_ms`` to ``timings``.
    Runs on a fetch thread: waits up to the importer's timeout per frame over TCP (or
    until ``cancel`` is set).

    Raises:
        ValueError: some of the images have no embeddings.
        WireError: a frame that is gone, unreachable or not these images' embeddings.
    """
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
