"""A request's answer. Each output of its choices goes through the stages once, in order:
the choice's text and logprobs (:meth:`Choice.outputs`), the tool-call parser (chat), then
SSE framing (:class:`StreamFramer`) or, once every choice has ended, the whole body. Every
flow ends here, recorded in the :class:`RequestLog`."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import AsyncIterator, Callable

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from epdserve.serving.api import responses
from epdserve.serving.api.logprobs import vllm_prompt_logprobs
from epdserve.serving.api.responses import StreamFramer
from epdserve.serving.api.tool_parsers import chat_deltas
from epdserve.serving.router.choices import Choice, merged
from epdserve.serving.router.events import WorkerFailed
from epdserve.serving.router.request_log import RequestLog

log = logging.getLogger("epdserve.router")


class SSEResponse(StreamingResponse):
    """A server-sent-event stream that notices a client going away even while no token
    flows, and always closes its generator (whose ``finally`` frees the request)."""

    media_type = "text/event-stream"

    async def __call__(self, scope, receive, send) -> None:
        async def stream():
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            async for chunk in self.body_iterator:
                await send({"type": "http.response.body", "body": chunk.encode(), "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        async def listen():
            while (await receive())["type"] != "http.disconnect":
                pass

        tasks = [asyncio.create_task(stream()), asyncio.create_task(listen())]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in tasks:
                t.cancel()
            results = await asyncio.gather(*tasks, return_exceptions=True)
            await self.body_iterator.aclose()
        for exc in results:
            if isinstance(exc, Exception) and not isinstance(exc, OSError):
                log.error("stream failed: %s: %s", type(exc).__name__, exc)


class Answer:
    """The answer to ``body`` (``kind`` "chat" or "completion") from its started
    ``choices``; ``token_text``: a token's text in vLLM's ``prompt_logprobs``."""

    def __init__(self, request_id: str, choices: list[Choice], body, kind: str, model: str,
                 request_log: RequestLog, token_text: Callable[[int], str]):
        self.request_id, self.choices, self.body, self.kind, self.model = request_id, choices, body, kind, model
        self.request_log = request_log
        self.token_text = token_text

    def streamed(self) -> SSEResponse:
        return SSEResponse(self.events())

    async def events(self) -> AsyncIterator[str]:
        """A chunk of a choice carries its index (``best_of`` over ``n`` is not streamed);
        a failure after the start is one event of OpenAI's error body."""
        framer = StreamFramer(self.request_id, self.model, self.kind, self.body.include_usage,
                              self.body.continuous_usage)
        try:
            async with contextlib.aclosing(merged(self.choices)) as outputs:
                async for choice, text, finish, entries in outputs:
                    usage = (responses.usage(len(choice.flow.prompt_ids), completion_tokens(choice))
                             if framer.continuous_usage else None)
                    if self.kind != "chat":
                        lp = choice.logprobs(entries) if choice.logprobs is not None else None
                        events = framer.completion(choice.index, text, finish, lp, usage)
                    elif (step := chat_deltas(choice.tools, text, finish, entries)) is None:
                        events = framer.chat(choice.index, None, None, None, None)  # the parser holds the text
                    else:
                        deltas, finish, entries = step
                        lp = choice.logprobs(entries) if choice.logprobs is not None else None
                        events = framer.chat(choice.index, deltas, finish, lp, usage)
                    for event in events:
                        yield event
            for event in framer.end(*usage_counts(self.choices)):
                yield event
        except WorkerFailed as exc:
            for c in self.choices:
                c.flow.fail(exc)
            for event in framer.error(exc.api_error().body()):
                yield event
        finally:
            for c in self.choices:
                self.request_log.ended(c.flow)

    async def whole(self, http_request: Request) -> Response:
        """The non-streamed answer; 499 (read by nobody) if the client goes away first.

        Raises:
            APIError: a worker failed the request (its status).
        """
        collected = {c.index: ([], []) for c in self.choices}  # text pieces, logprob entries
        task = asyncio.create_task(self._collect(collected))
        watch = asyncio.create_task(_wait_disconnect(http_request))
        try:
            await asyncio.wait([task, watch], return_when=asyncio.FIRST_COMPLETED)
            if not task.done():
                return Response(status_code=499)
            try:
                task.result()
            except WorkerFailed as exc:
                for c in self.choices:
                    c.flow.fail(exc)
                raise exc.api_error() from None
            body = self._body(collected)
        finally:
            for t in (task, watch):
                t.cancel()
            await asyncio.gather(task, watch, return_exceptions=True)
            for c in self.choices:
                self.request_log.ended(c.flow)
        return JSONResponse(body)

    async def _collect(self, collected: dict[int, tuple[list, list]]) -> None:
        async with contextlib.aclosing(merged(self.choices)) as outputs:
            async for choice, text, _, entries in outputs:
                pieces, kept = collected[choice.index]
                pieces.append(text)
                kept += entries

    def _body(self, collected: dict[int, tuple[list, list]]) -> dict:
        """The best ``n`` per prompt (:func:`best_choices`), with vLLM's ``prompt_logprobs``
        where computed (completions: per choice; chat: the request's, only when asked)."""
        usage = usage_counts(self.choices)
        chat = self.kind == "chat"
        answered = []
        for index, c in best_choices(self.choices, self.body.n):
            pieces, entries = collected[c.index]
            answered.append(choice_body(c, chat, index, "".join(pieces), entries))
            if not chat and self.body.prompt_logprobs_k is not None:
                answered[-1]["prompt_logprobs"] = vllm_prompt_logprobs(
                    c.flow.prompt_ids, c.flow.prompt_logprobs or [], self.token_text)
        build = responses.chat_completion if chat else responses.text_completion
        out = build(self.request_id, self.model, responses.now_s(), answered, *usage)
        if chat and self.body.prompt_logprobs is not None:
            first = self.choices[0].flow
            out["prompt_logprobs"] = vllm_prompt_logprobs(first.prompt_ids, first.prompt_logprobs or [],
                                                          self.token_text)
        return out


async def _wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def choice_body(choice: Choice, chat: bool, index: int, text: str, entries: list) -> dict:
    """A non-streamed choice, answered as choice ``index``; with tools, its text parsed at once."""
    lp = choice.logprobs(entries) if choice.logprobs is not None else None
    finish = choice.flow.finish_reason
    if not chat:
        return responses.completion_choice(index, text, finish, lp)
    if choice.tools is None:
        return responses.chat_choice(index, text, finish, lp)
    message, finish = choice.tools.message(text, finish)
    return responses.chat_choice(index, None, finish, lp, message=message)


def completion_tokens(choice: Choice) -> int:
    """Generated tokens the answer counts: none of an echo-only choice."""
    return choice.flow.output_tokens if choice.shown else 0


def usage_counts(choices: list[Choice]) -> tuple[int, int, int]:
    """``(prompt, completion, cached prompt)`` tokens: each prompt counted once (vLLM), every
    choice's generated tokens (``best_of``'s unanswered too, as OpenAI bills them)."""
    firsts: dict[int, Choice] = {}
    for c in choices:
        firsts.setdefault(c.prompt, c)
    return (sum(len(c.flow.prompt_ids) for c in firsts.values()), sum(completion_tokens(c) for c in choices),
            sum(c.flow.cached_tokens for c in firsts.values()))


def best_choices(choices: list[Choice], n: int) -> list[tuple[int, Choice]]:
    """The answered choices with their answer index: per prompt, in order, the ``n`` of the
    highest mean token logprob (OpenAI's best_of; ties: the earlier), indexed ``prompt * n +
    rank``; all, in order, when there are ``n`` per prompt."""
    by_prompt: dict[int, list[Choice]] = {}
    for c in choices:
        by_prompt.setdefault(c.prompt, []).append(c)
    out = []
    for p, group in by_prompt.items():
        ranked = group if len(group) == n else sorted(group, key=lambda c: -mean_logprob(c))[:n]
        out += [(p * n + r, c) for r, c in enumerate(ranked)]
    return out


def mean_logprob(choice: Choice) -> float:
    """Per generated token: OpenAI's best_of ranks by "the highest log probability per token"."""
    return choice.logprob_sum / max(1, choice.flow.output_tokens)
