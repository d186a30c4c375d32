"""What reaches one request's flow, as typed events, and how a flow fails."""

from __future__ import annotations

from dataclasses import dataclass

from epdserve.serving import protocol as P
from epdserve.serving.api.errors import APIError


class WorkerFailed(Exception):
    """``status``: 400 rejected, 500 failed, 503 lost or none live (worth a retry), 504 silent."""

    def __init__(self, message: str, status: int = 500):
        super().__init__(message)
        self.status = status

    def api_error(self) -> APIError:
        kind = {400: "invalid_request_error", 503: "service_unavailable"}.get(self.status, "internal_server_error")
        return APIError(str(self), status=self.status, type=kind)


@dataclass(frozen=True)
class WorkerOutput:
    worker_id: str
    msg: P.Output


@dataclass(frozen=True)
class WorkerError:
    worker_id: str
    msg: P.Error


@dataclass(frozen=True)
class Encoded:
    worker_id: str
    msg: P.Encoded


@dataclass(frozen=True)
class WorkerDown:
    worker_id: str
    reason: str


@dataclass(frozen=True)
class Tick:
    """No event for a poll interval: time to check liveness and silence."""


Event = WorkerOutput | WorkerError | Encoded | WorkerDown | Tick


def event_for(msg: P.Output | P.Error | P.Encoded) -> Event:
    if isinstance(msg, P.Output):
        return WorkerOutput(msg.worker_id, msg)
    if isinstance(msg, P.Error):
        return WorkerError(msg.worker_id, msg)
    return Encoded(msg.worker_id, msg)
