"""A request's choices on the router, the first stage of its answer: each choice's outputs
as the client gets them (:meth:`Choice.outputs`), and every choice's merged (:func:`merged`)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from operator import itemgetter
from typing import AsyncIterator

from epdserve.serving.api.logprobs import LogprobsFormatter, prompt_entries
from epdserve.serving.api.detokenizer import TextStream
from epdserve.serving.router.flows import Flow
from epdserve.serving.api.tool_parsers import ToolOutput

# (new text, finish reason or None, logprob entries: (token id, logprob, [(top id, logprob), ...]))
Output = tuple[str, str | None, list]


@dataclass
class Choice:
    """``index``: prompt x ``best_of`` + candidate; ``echo``: text before its output (with the
    prompt's logprob entries if ``echo_logprobs``); ``shown``: False when only the echo is
    answered (``max_tokens`` 0)."""

    index: int
    flow: Flow
    text: TextStream
    logprobs: LogprobsFormatter | None  # None: not asked for
    prompt: int = 0
    echo: str | None = None
    echo_logprobs: bool = False
    shown: bool = True
    tools: ToolOutput | None = None
    logprob_sum: float = 0.0

    async def outputs(self) -> AsyncIterator[Output]:
        """To a stop string at most; text held back carries its tokens' entries over.
        Raises WorkerFailed as :meth:`Flow.tokens`."""
        entries: list = []
        async for ids, logprobs, finish in self.flow.tokens():
            if logprobs is not None:
                entries += [(t, lp, top) for t, (lp, top) in zip(ids, logprobs)]
            delta = self.text.add(ids)
            if self.text.stopped:
                self.flow.stop()
                finish = "stop"
            elif finish is not None:
                delta += self.text.finish()
            elif not delta:
                continue
            self.logprob_sum += sum(map(itemgetter(1), entries))
            shown, shown_entries = (delta, entries) if self.shown else ("", [])
            if self.echo is not None:
                echoed = prompt_entries(self.flow.prompt_ids, self.flow.prompt_logprobs) if self.echo_logprobs else []
                shown, shown_entries, self.echo = self.echo + shown, echoed + shown_entries, None
            yield shown, finish, shown_entries
            if finish is not None:
                return
            entries = []


async def merged(choices: list[Choice]) -> AsyncIterator[tuple[Choice, str, str | None, list]]:
    """As they come; closing it cancels every choice's reader. Raises WorkerFailed: any
    choice failed (the others are abandoned)."""
    if len(choices) == 1:  # the usual case: no task and queue hop per token
        async for item in choices[0].outputs():
            yield (choices[0], *item)
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(choice: Choice) -> None:
        try:
            async for item in choice.outputs():
                queue.put_nowait((choice, *item))
            queue.put_nowait(None)
        except Exception as exc:
            queue.put_nowait(exc)

    tasks = [asyncio.create_task(pump(c)) for c in choices]
    try:
        for _ in tasks:
            while (item := await queue.get()) is not None:
                if isinstance(item, Exception):
                    raise item
                yield item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
