"""OpenAI's response objects: a whole answer (``chat.completion``, ``text_completion``) and a
streamed one's server-sent events (:class:`StreamFramer`)."""

from __future__ import annotations

import json
import time
from typing import Any

SSE_DONE = "data: [DONE]\n\n"
CHUNK_OBJECTS = {"chat": "chat.completion.chunk", "completion": "text_completion"}


def now_s() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    """``cached_tokens``: prompt tokens served from the prefix cache."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def chat_choice(index: int, text: str | None, finish_reason: str | None, logprobs: dict | None = None,
                message: dict | None = None) -> dict:
    """``message``: one with tool calls (see tool_parsers.ToolOutput.message); else ``text``'s."""
    return {"index": index, "message": message or {"role": "assistant", "content": text},
            "logprobs": logprobs, "finish_reason": finish_reason}


def completion_choice(index: int, text: str, finish_reason: str | None, logprobs: dict | None = None) -> dict:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}


def chat_completion(request_id: str, model: str, created: int, choices: list[dict],
                    prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    """``completion_tokens``: summed over the choices (OpenAI)."""
    return {"id": request_id, "object": "chat.completion", "created": created, "model": model,
            "choices": choices, "usage": usage(prompt_tokens, completion_tokens, cached_tokens)}


def text_completion(request_id: str, model: str, created: int, choices: list[dict],
                    prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    return {"id": request_id, "object": "text_completion", "created": created, "model": model,
            "choices": choices, "usage": usage(prompt_tokens, completion_tokens, cached_tokens)}


def _chunk(request_id: str, model: str, created: int, obj: str, content: dict,
           finish_reason: str | None, include_usage: bool, index: int, logprobs: dict | None) -> dict:
    # With include_usage every chunk has "usage": null (OpenAI); the numbers come last.
    chunk = {"id": request_id, "object": obj, "created": created, "model": model,
             "choices": [{"index": index, **content, "logprobs": logprobs, "finish_reason": finish_reason}]}
    if include_usage:
        chunk["usage"] = None
    return chunk


def chat_chunk(request_id: str, model: str, created: int, delta: dict,
               finish_reason: str | None = None, include_usage: bool = False,
               index: int = 0, logprobs: dict | None = None) -> dict:
    return _chunk(request_id, model, created, "chat.completion.chunk", {"delta": delta},
                  finish_reason, include_usage, index, logprobs)


def completion_chunk(request_id: str, model: str, created: int, text: str,
                     finish_reason: str | None = None, include_usage: bool = False,
                     index: int = 0, logprobs: dict | None = None) -> dict:
    return _chunk(request_id, model, created, "text_completion", {"text": text},
                  finish_reason, include_usage, index, logprobs)


def usage_chunk(request_id: str, model: str, created: int, obj: str,
                prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    return {"id": request_id, "object": obj, "created": created, "model": model, "choices": [],
            "usage": usage(prompt_tokens, completion_tokens, cached_tokens)}


def sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


class StreamFramer:
    """The events of one streamed answer of ``kind`` "chat" or "completion".
    ``continuous_usage`` (vLLM's ``continuous_usage_stats``): each choice chunk carries
    its choice's usage so far."""

    def __init__(self, request_id: str, model: str, kind: str, include_usage: bool, continuous_usage: bool):
        self.request_id, self.model, self.kind = request_id, model, kind
        self.include_usage, self.continuous_usage = include_usage, continuous_usage
        self.created = now_s()
        self.announced: set[int] = set()  # chat choices whose role chunk went out

    def chat(self, index: int, deltas: list[dict] | None, finish: str | None, logprobs: dict | None,
             usage_so_far: dict | None) -> list[str]:
        """A chat choice's events for one output: its role chunk with its first output (as
        vLLM: a client's TTFT is its first chunk), then a chunk per delta (``deltas`` None:
        none), ``finish`` on the last, ``logprobs`` on the first."""
        events = []
        if index not in self.announced:
            self.announced.add(index)
            events.append(sse(chat_chunk(self.request_id, self.model, self.created,
                                         {"role": "assistant", "content": ""},
                                         include_usage=self.include_usage, index=index)))
        if deltas is None:
            return events
        deltas = deltas or [{}]
        last = len(deltas) - 1
        for k, delta in enumerate(deltas):
            chunk = chat_chunk(self.request_id, self.model, self.created, delta, finish if k == last else None,
                               include_usage=self.include_usage, index=index, logprobs=logprobs if k == 0 else None)
            events.append(self._framed(chunk, usage_so_far))
        return events

    def completion(self, index: int, text: str, finish: str | None, logprobs: dict | None,
                   usage_so_far: dict | None) -> list[str]:
        chunk = completion_chunk(self.request_id, self.model, self.created, text, finish,
                                 include_usage=self.include_usage, index=index, logprobs=logprobs)
        return [self._framed(chunk, usage_so_far)]

    def _framed(self, chunk: dict, usage_so_far: dict | None) -> str:
        if self.continuous_usage:
            chunk["usage"] = usage_so_far
        return sse(chunk)

    def end(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> list[str]:
        """The last events: the usage chunk (with ``include_usage``), ``[DONE]``."""
        if not self.include_usage:
            return [SSE_DONE]
        return [sse(usage_chunk(self.request_id, self.model, self.created, CHUNK_OBJECTS[self.kind],
                                prompt_tokens, completion_tokens, cached_tokens)), SSE_DONE]

    @staticmethod
    def error(body: dict) -> list[str]:
        """A stream that fails after it started ends with one event of the error's body."""
        return [sse(body), SSE_DONE]
