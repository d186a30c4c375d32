"""A request's choices on the router: each choice's state (:class:`Choice`), their text
streams merged into one (:func:`merged`), the best ``n`` of ``best_of`` (:func:`best_choices`)
and their usage."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import AsyncIterator

from epdserve.serving.api.logprobs import LogprobsFormatter, prompt_entries
from epdserve.serving.api.detokenizer import TextStream
from epdserve.serving.router.flows import Flow
from epdserve.serving.api.tool_calls import ToolOutput


@dataclass
class Choice:
    """One generated choice: its flow, text stream, (if logprobs were asked) the
    formatter of its logprobs and (with tools) the parser of its tool calls;
    ``parts``/``entries`` collect a non-streamed answer.
    ``index``: its place in the request's choices (prompt x ``best_of`` + candidate; the
    answer's index unless ``best_of`` reorders); ``prompt``: its prompt's index;
    ``echo``: text still to put before its output (``echo_logprobs``: with its prompt's
    logprob entries); ``shown``: False when only the echo is answered (``max_tokens`` 0);
    ``logprob_sum``: of its generated tokens (``best_of`` ranks by it)."""

    index: int
    gen: Flow
    text: TextStream
    logprobs: LogprobsFormatter | None
    prompt: int = 0
    echo: str | None = None
    echo_logprobs: bool = False
    shown: bool = True
    tools: ToolOutput | None = None
    parts: list[str] = field(default_factory=list)
    entries: list = field(default_factory=list)
    held_entries: list = field(default_factory=list)  # logprobs of text the tool parser holds back
    logprob_sum: float = 0.0

    def logprobs_object(self, entries: list) -> dict | None:
        """The OpenAI ``logprobs`` object of ``entries`` (see :func:`texts`), None if not asked for."""
        return None if self.logprobs is None else self.logprobs(entries)

    def shape(self, delta: str, entries: list) -> tuple[str, list]:
        """What the client gets of one output's ``delta`` text and logprob ``entries``:
        the echo first, once, and nothing generated when not :attr:`shown`."""
        self.logprob_sum += sum(lp for _, lp, _ in entries)
        if not self.shown:
            delta, entries = "", []
        if self.echo is not None:
            echoed = prompt_entries(self.gen.prompt_ids, self.gen.prompt_logprobs) if self.echo_logprobs else []
            delta, entries, self.echo = self.echo + delta, echoed + entries, None
        return delta, entries

    @property
    def completion_tokens(self) -> int:
        """Generated tokens the answer counts (none when not :attr:`shown`)."""
        return self.gen.output_tokens if self.shown else 0

    @property
    def mean_logprob(self) -> float:
        """Mean logprob of its generated tokens (OpenAI's best_of: "the highest log
        probability per token")."""
        return self.logprob_sum / max(1, self.gen.output_tokens)


def usage_counts(choices: list[Choice]) -> tuple[int, int, int]:
    """``(prompt tokens, completion tokens, cached prompt tokens)`` of a request: each
    prompt counted once (vLLM), the tokens of every choice generated (``best_of``'s
    unanswered ones too, as OpenAI bills them; none of an echo-only choice)."""
    firsts: dict[int, Choice] = {}
    for c in choices:
        firsts.setdefault(c.prompt, c)
    return (sum(len(c.gen.prompt_ids) for c in firsts.values()), sum(c.completion_tokens for c in choices),
            sum(c.gen.cached_tokens for c in firsts.values()))


def best_choices(choices: list[Choice], n: int) -> list[tuple[int, Choice]]:
    """The answered choices with their answer index: per prompt (in order), the ``n`` with
    the highest :attr:`Choice.mean_logprob` (ties: the earlier), indexed ``prompt * n +
    rank``; all of them, in order, when there are ``n`` per prompt."""
    by_prompt: dict[int, list[Choice]] = {}
    for c in choices:
        by_prompt.setdefault(c.prompt, []).append(c)
    out = []
    for p, group in by_prompt.items():
        ranked = group if len(group) == n else sorted(group, key=lambda c: -c.mean_logprob)[:n]
        out += [(p * n + r, c) for r, c in enumerate(ranked)]
    return out


def failed(choices: list[Choice], exc: Exception) -> None:
    """Mark every choice not yet finished as failed with ``exc`` (abandoned with the failed one)."""
    for c in choices:
        if c.gen.finish_reason is None:
            c.gen.error = str(exc)


async def texts(flow: Flow, stream: TextStream) -> AsyncIterator[tuple[str, str | None, list]]:
    """Yield ``(new_text, finish_reason or None, logprob entries)``; stops at a stop
    string. The entries, ``(token id, logprob, [(top id, logprob), ...])``, are those
    of the tokens since the last yield (text held back carries its tokens' over).

    Raises:
        WorkerFailed: as :meth:`Flow.tokens`.
    """
    last, entries = None, []
    async for ids, logprobs, finish in flow.tokens():
        now = flow.clock()
        if last is not None:
            flow.note_itl(now - last)
        last = now
        flow.output_tokens += len(ids)
        if logprobs is not None:
            entries += [(t, lp, top) for t, (lp, top) in zip(ids, logprobs)]
        delta = stream.add(ids)
        if stream.stopped:
            flow.finish_reason = "stop"
            yield delta, "stop", entries
            return
        if finish is not None:
            flow.finish_reason = finish
            yield delta + stream.finish(), finish, entries
            return
        if delta:
            yield delta, None, entries
            entries = []


async def merged(choices: list[Choice]) -> AsyncIterator[tuple[int, str, str | None, list]]:
    """Yield ``(choice index, new_text, finish_reason or None, logprob entries)`` of every
    choice (see :func:`texts`) as they come. Closing it cancels every choice's reader; the
    caller still finishes the flows.

    Raises:
        WorkerFailed: any choice failed (the others are then abandoned).
    """
    if len(choices) == 1:  # the usual case: no task and queue hop per token
        async for item in texts(choices[0].gen, choices[0].text):
            yield (0, *item)
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(choice: Choice) -> None:
        try:
            async for item in texts(choice.gen, choice.text):
                queue.put_nowait((choice.index, *item))
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
