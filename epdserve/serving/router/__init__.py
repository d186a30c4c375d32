"""The router: an OpenAI-compatible HTTP front that drives colocated, PD or EPD workers.

It tokenizes each request once, picks a worker per role (least outstanding requests,
then fewest outstanding tokens), sends it an :class:`~epdserve.serving.protocol.AddRequest`
and streams the worker's outputs back as text. Its parts:

* :mod:`.registry`: the workers (hello, refusal, Reset, liveness, picking, stats), reached
  only through a :class:`~.registry.WorkerPort`;
* :mod:`.zmq_port`: that port over ZeroMQ, and the events socket's reading loop;
* :mod:`.events`, :mod:`.flows`, :mod:`.holdings`: one flow per request path (colocated,
  local prefill, disaggregated, EPD) driven by typed events, and what a request holds on
  workers, given back exactly once;
* :mod:`.front`: request bodies to prompt ids, sampling settings and flows; tokens to text;
* :mod:`.routes`: the FastAPI app; :mod:`.app`: the composition root and ``epdserve router``.
"""

from epdserve.serving.router.app import (Router, add_arguments, add_router_options, build_router, run,
                                         setup_logging)
from epdserve.serving.router.events import WorkerFailed
from epdserve.serving.router.flows import Flow, FlowConfig, new_flow
from epdserve.serving.router.registry import Registry, WorkerPort, WorkerState
from epdserve.serving.router.routes import SYNTHETIC_VISION_NOTE, SSEResponse, create_app

__all__ = ["SYNTHETIC_VISION_NOTE", "Flow", "FlowConfig", "Registry", "Router", "SSEResponse",
           "WorkerFailed", "WorkerPort", "WorkerState", "add_arguments", "add_router_options", "build_router",
           "create_app", "new_flow", "run", "setup_logging"]
