"""A worker's :class:`~epdserve.serving.protocol.Stats` to the router: sent when they change,
and at least every ``STATS_INTERVAL_S`` seconds."""

from __future__ import annotations

import time
from typing import Callable

from epdserve.serving import protocol as P

STATS_INTERVAL_S = 0.5


class StatsReport:
    def __init__(self, worker_id: str, send: Callable[[P.Stats], None]):
        self.worker_id = worker_id
        self.send = send
        self._last: dict | None = None
        self._last_time = 0.0

    def report(self, stats: dict) -> None:
        """``stats``: the fields of ``P.Stats`` but ``worker_id``."""
        now = time.monotonic()
        if stats != self._last or now - self._last_time > STATS_INTERVAL_S:
            self.send(P.Stats(worker_id=self.worker_id, **stats))
            self._last, self._last_time = stats, now

    def send_next(self) -> None:
        """Send the next report even if unchanged."""
        self._last = None
