"""A tensor-parallel worker whose follower rank fails (:mod:`.ranks`): the ranks are out of step,
so it gives up the requests they ran (the router moves them, ``--migration-limit``, or fails
them) and stops with exit status 1, to be restarted whole."""

from __future__ import annotations

import logging
from typing import Iterable

from epdserve.serving import protocol as P
from epdserve.serving.worker.ranks import RankFailure, Ranks

log = logging.getLogger("epdserve.worker")
EXIT_STATUS = 1


class RankWatch:
    """``worker`` has ``worker_id``, ``running``, ``exit_code`` and ``send()``; ``ranks``: set once
    they are up (None: one process); ``what`` names the worker in the requests' errors."""

    def __init__(self, worker, what: str):
        self.worker = worker
        self.what = what
        self.ranks: Ranks | None = None
        self.failure: RankFailure | None = None

    def check(self) -> None:
        """For an idle worker: stop it if a follower has exited."""
        if self.ranks is None:
            return
        try:
            self.ranks.check()
        except RankFailure as exc:
            self.failed(exc)

    def failed(self, exc: RankFailure, request_ids: Iterable[str] = ()) -> None:
        """Each of ``request_ids`` gets an Error (status 500, ``worker_lost``) naming ``exc``."""
        message = f"the {self.what}'s tensor-parallel ranks failed ({exc}); it is restarting"
        for request_id in request_ids:
            self.worker.send(P.Error(worker_id=self.worker.worker_id, request_id=request_id, message=message,
                                     status=500, worker_lost=True))
        log.error("%s: %s; stopping this worker (exit status 1) so that it is restarted with all its ranks",
                  self.worker.worker_id, exc)
        self.failure = exc
        self.worker.running, self.worker.exit_code = False, EXIT_STATUS
