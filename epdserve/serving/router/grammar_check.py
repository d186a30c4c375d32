"""The router's check of a request's structured-output constraint: its grammar compiled once,
off the event loop, bounded in time (docs/serving.md, Structured output)."""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures

from epdserve.engine.guided import GuidedDecoder, GuidedError
from epdserve.engine.request import GuidedSpec
from epdserve.serving.api.tool_calls import ToolPlan
from epdserve.serving.api.errors import APIError

# A compile past the timeout cannot be stopped: its own thread keeps it from holding up preprocessing.
GUIDED_COMPILE_TIMEOUT_S = 10.0
MAX_COMPILE_QUEUE = 16
MAX_CHECKED_GRAMMARS = 1024  # compiled ones, LRU


class GrammarCheck:

    def __init__(self, tokenizer):
        self.decoder = GuidedDecoder(tokenizer, len(tokenizer))
        self._compiler = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="epdserve-grammar")
        self._compiles_queued = 0
        self._checked: collections.OrderedDict[GuidedSpec, None] = collections.OrderedDict()

    def close(self) -> None:
        """Drop the grammars waiting for the thread."""
        self._compiler.shutdown(wait=False, cancel_futures=True)

    async def spec(self, body, tools: ToolPlan | None = None) -> GuidedSpec | None:
        """None: no constraint; a forcing ``tool_choice`` brings its own. Raises APIError 400 naming
        the field (two constraints, not compilable, not in time), 503 (:data:`MAX_COMPILE_QUEUE` wait)."""
        found = body.guided_spec()
        forced = tools.guided_spec() if tools else None
        if forced is not None:
            if found is not None:
                raise APIError(f"tool_choice: {tools.mode!r} forces the output, so it cannot be combined with "
                                   f"{found[0]}", param="tool_choice")
            found = ("tools", forced)
        if found is None:
            return None
        param, spec = found
        if spec in self._checked:
            self._checked.move_to_end(spec)
            return spec
        if self._compiles_queued >= MAX_COMPILE_QUEUE:
            raise APIError(f"the server is busy compiling {self._compiles_queued} grammars; retry later",
                               status=503, type="service_unavailable")
        self._compiles_queued += 1
        try:
            work = asyncio.get_running_loop().run_in_executor(self._compiler, self.decoder.compile, spec)
            await asyncio.wait_for(work, GUIDED_COMPILE_TIMEOUT_S)
        except GuidedError as exc:
            raise APIError(f"{param}: {exc}", param=param) from None
        except asyncio.TimeoutError:
            raise APIError(f"{param}: not compiled within {GUIDED_COMPILE_TIMEOUT_S:g} s (too complex, or the "
                               "server is compiling others); simplify it or retry", param=param) from None
        finally:
            self._compiles_queued -= 1
        self._checked[spec] = None
        if len(self._checked) > MAX_CHECKED_GRAMMARS:
            self._checked.popitem(last=False)
        return spec
