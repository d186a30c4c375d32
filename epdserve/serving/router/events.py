"""What reaches one request's flow, as typed events, and how a flow fails.

The registry turns each worker message about a request into an event and puts it on
that request's queue (:meth:`~epdserve.serving.router.flows.Flow.deliver`); a flow that
waits a poll interval without one makes a :class:`Tick` itself, so that it can check its
workers' liveness and its own silence clock.
"""

from __future__ import annotations

from dataclasses import dataclass

from epdserve.serving import protocol as P
from epdserve.serving.api.errors import APIError


class WorkerFailed(Exception):
    """A request that ends with an error, never a hang: a worker rejected it (``status``
    400), failed it (500), was lost with it or none is live to take it (503: worth a retry,
    the launcher restarts workers), or went silent (504)."""

    def __init__(self, message: str, status: int = 500):
        super().__init__(message)
        self.status = status

    def api_error(self) -> APIError:
        """The HTTP error the client gets (status as above, OpenAI error type by status)."""
        kind = {400: "invalid_request_error", 503: "service_unavailable"}.get(self.status, "internal_server_error")
        return APIError(str(self), status=self.status, type=kind)


@dataclass(frozen=True)
class WorkerOutput:
    """New tokens (and, from a prefill worker, the exported KV's descriptor) from ``worker_id``."""

    worker_id: str
    msg: P.Output


@dataclass(frozen=True)
class WorkerError:
    """``worker_id`` could not serve the request (``msg.status``: 400 rejected, 5xx failed)."""

    worker_id: str
    msg: P.Error


@dataclass(frozen=True)
class Encoded:
    """An encode worker's embedding frame for its share of the request's images."""

    worker_id: str
    msg: P.Encoded


@dataclass(frozen=True)
class WorkerDown:
    """``worker_id``, which held the request, went down (``reason`` as the registry says)."""

    worker_id: str
    reason: str


@dataclass(frozen=True)
class Tick:
    """No event for a poll interval: time to check liveness and silence."""


Event = WorkerOutput | WorkerError | Encoded | WorkerDown | Tick


def event_for(msg: P.Output | P.Error | P.Encoded) -> Event:
    """The event a worker message about a request becomes."""
    if isinstance(msg, P.Output):
        return WorkerOutput(msg.worker_id, msg)
    if isinstance(msg, P.Error):
        return WorkerError(msg.worker_id, msg)
    return Encoded(msg.worker_id, msg)
