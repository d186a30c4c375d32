"""A worker's grammar compiles, off its loop.

A guided request's grammar (``SamplingParams.guided``, see :mod:`epdserve.engine.guided`)
is compiled on a thread of its own before the request goes on (to a KV fetch, or into the
engine), so that a compile (tens of ms for a JSON schema, seconds for a large grammar, and
at the first guided request the grammar library's import and the tokenizer's load) never
stalls the loop that steps every other request. The compiled grammar lands in the engine's
cache, where ``LLMEngine.add_request`` finds it. When the thread is done it puts the
:class:`Prepared` request back into the loop's inbox as ``(prepared, time)``; the loop
takes it (:meth:`GrammarPrep.take`) unless the request was aborted meanwhile.
"""

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
    """An AddRequest whose grammar has been compiled, or ``error`` says why it could not be."""

    msg: P.AddRequest
    arrival: float  # time.perf_counter() on receipt: the compile counts as queue time
    error: str | None = None


class GrammarPrep:
    """The guided requests of one worker whose grammars are being compiled (``pending``,
    by request id), on one thread: the engine's compiler is called from that thread only
    (see :meth:`LLMEngine.guided_decoder`), and compiles queue behind each other."""

    def __init__(self, engine: LLMEngine, inbox: queue.Queue):
        self._engine = engine
        self._inbox = inbox
        self.pending: set[str] = set()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="epdserve-grammar")

    def start(self, msg: P.AddRequest, arrival: float) -> None:
        """Compile ``msg``'s grammar on the thread; the loop gets it back in its inbox."""
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
        """Whether ``job``'s request still waits (it was not aborted meanwhile); it no longer does."""
        if job.msg.request_id not in self.pending:
            return False
        self.pending.discard(job.msg.request_id)
        return True

    def cancel(self, request_id: str) -> None:
        """Drop a request being compiled (Abort, Reset): its result is dropped when it comes."""
        self.pending.discard(request_id)

    def close(self) -> None:
        """Drop the compiles not started; one running ends on its own (the process is ending)."""
        self._pool.shutdown(wait=False, cancel_futures=True)
