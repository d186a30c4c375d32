"""What the router records of each request that ended: its /metrics series and its line
of the trace file (which also takes the registry's and the controller's event lines)."""

from __future__ import annotations

import json
import logging

from epdserve.serving.metrics import RouterMetrics
from epdserve.serving.router.flows import Flow

log = logging.getLogger("epdserve.router")


class RequestLog:
    """``trace_file``: where each line is appended as JSON (None: nowhere)."""

    def __init__(self, metrics: RouterMetrics, trace_file: str | None):
        self.metrics = metrics
        self.trace_file = trace_file

    def ended(self, flow: Flow) -> None:
        """Close ``flow`` and record it; its output gaps count only if it did not fail."""
        rec = flow.end()
        self.metrics.ended(rec, None if flow.error is not None else flow.itls_s)
        self.write(rec.as_json())

    def write(self, line: dict) -> None:
        if self.trace_file:
            try:
                with open(self.trace_file, "a") as f:
                    f.write(json.dumps(line) + "\n")
            except OSError as exc:
                log.warning("cannot write trace %s: %s", self.trace_file, exc)
