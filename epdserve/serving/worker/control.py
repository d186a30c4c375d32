"""The control messages every worker loop (engine or encode) answers the same way."""

from __future__ import annotations

import logging

from epdserve.serving import protocol as P

log = logging.getLogger("epdserve.worker")


def handle_control(worker, msg) -> None:
    """``worker`` has ``running``, ``exit_code``, ``worker_id``, ``incarnation``, ``hello``,
    ``reset()`` and ``send()``. A Refused or Reset for another incarnation answers a Hello of
    another process that named this worker's address: it is ignored."""
    if isinstance(msg, P.Shutdown):
        worker.running = False
    elif isinstance(msg, (P.Refused, P.Reset)) and msg.incarnation != worker.incarnation:
        log.warning("%s: ignored a %s meant for another process (incarnation %r)", worker.worker_id, msg.type,
                    msg.incarnation[:16])
    elif isinstance(msg, P.Refused):
        log.error("%s: the router refused this worker: %s", worker.worker_id, msg.reason)
        print(f"epdserve worker: refused by the router: {msg.reason}", flush=True)
        worker.running, worker.exit_code = False, 2
    elif isinstance(msg, P.Reset):
        dropped = worker.reset()
        log.warning("%s: the router took this worker for down and hears it again: dropped %s; saying hello again",
                    worker.worker_id, dropped)
        worker.send(worker.hello)
    else:
        log.warning("%s: unexpected %s message", worker.worker_id, msg.type)

