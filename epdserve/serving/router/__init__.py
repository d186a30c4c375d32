"""The router: an OpenAI-compatible HTTP front over colocated, PD or EPD workers
(docs/architecture.md, The router)."""

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
