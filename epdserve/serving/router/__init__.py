"""The router: an OpenAI-compatible HTTP front that drives colocated, PD or EPD workers.
A request is admitted by :mod:`.front` (one flow per choice, :mod:`.paths`), driven
through the workers by its flow (:mod:`.flows`, :mod:`.epd_flow`) and answered by
:mod:`.answer`; :mod:`.registry` and :mod:`.zmq_port` keep the workers; :mod:`.app` wires it."""

from epdserve.serving.router.app import (Router, add_arguments, add_router_options, build_router, run,
                                         setup_logging)
from epdserve.serving.router.events import WorkerFailed
from epdserve.serving.router.answer import SSEResponse
from epdserve.serving.router.flows import Flow, FlowConfig
from epdserve.serving.router.paths import new_flow
from epdserve.serving.router.registry import Registry, WorkerPort, WorkerState
from epdserve.serving.router.routes import SYNTHETIC_VISION_NOTE, create_app

__all__ = ["SYNTHETIC_VISION_NOTE", "Flow", "FlowConfig", "Registry", "Router", "SSEResponse",
           "WorkerFailed", "WorkerPort", "WorkerState", "add_arguments", "add_router_options", "build_router",
           "create_app", "new_flow", "run", "setup_logging"]
