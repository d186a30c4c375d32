"""Guided requests' grammars compiled on a thread of their own before the request goes on, so that
a compile (tens of ms for a JSON schema, seconds for a large grammar or the first one's imports)
never stalls the loop. The compiled grammar lands in the engine's cache, where
``LLMEngine.add_request`` finds it; the request comes back into the loop's inbox as
``(Prepared, time.perf_counter())``."""

from __future__ import annotations

import logging
import queue
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from epdserve.engine.engine import LLMEngine
from epdserve.serving import protocol as P

log = logging.getLogger("epdserve.worker")


@dataclass
class Prepared:
    """``error``: why the grammar could not be compiled."""

    msg: P.AddRequest
    arrival: float  # time.perf_counter() on receipt: the compile counts as queue time
    error: str | None = None


class GrammarPrep:
    """``pending``: the request ids being compiled. One thread: the engine's compiler is called
    from it alone (:meth:`LLMEngine.guided_decoder`)."""

    def __init__(self, engine: LLMEngine, inbox: queue.Queue):
        self._engine = engine
        self._inbox = inbox
        self.pending: set[str] = set()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="epdserve-grammar")

    def start(self, msg: P.AddRequest, arrival: float) -> None:
        self.pending.add(msg.request_id)
        self._pool.submit(self._compile, Prepared(msg, arrival))

    def _compile(self, job: Prepared) -> None:
        try:
            self._engine.guided_decoder().compile(job.msg.sampling.guided)
        except ValueError as exc:  # GuidedError: the router compiled it, so this is rare
            job.error = str(exc)
        except Exception:
            log.exception("request %s: compiling its grammar failed", job.msg.request_id)
            job.error = "compiling the request's grammar failed"
        self._inbox.put((job, time.perf_counter()))

    def take(self, job: Prepared) -> bool:
        """False if ``job``'s request was aborted meanwhile."""
        if job.msg.request_id not in self.pending:
            return False
        self.pending.discard(job.msg.request_id)
        return True

    def cancel(self, request_id: str) -> None:
        self.pending.discard(request_id)

    def close(self) -> None:
        """A compile running ends on its own (the process is ending)."""
        self._pool.shutdown(wait=False, cancel_futures=True)
