"""The OpenAI front: from a request body to prompt ids, images, sampling settings and flows,
and from the flows' tokens back to text.

Preprocessing (chat template, tokenization, reading and decoding images) runs on a thread
pool of its own, never on the event loop. A chat request with images (served by a
vision-language model) is laid out here: the images are checked and decoded
(:func:`~epdserve.serving.multimodal.parse_chat_images`), each ``<image>`` placeholder
expanded to its tile tokens, and the image bytes travel to the worker that encodes them.
A request with ``n`` choices runs as n flows (ids ``<id>-<i>``, one trace line each)
whose texts are merged (:func:`merged`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
from dataclasses import dataclass, field
from typing import AsyncIterator

import pydantic

from epdserve.model.tokenizer import chat_prompt_ids
from epdserve.serving import openai_api as api
from epdserve.serving import protocol as P
from epdserve.serving.detokenizer import TextStream
from epdserve.serving.metrics import RouterMetrics
from epdserve.serving.multimodal import ImagePrompter
from epdserve.serving.router.flows import Flow, FlowConfig, new_flow
from epdserve.serving.router.registry import Registry

log = logging.getLogger("epdserve.router")

# Tokenizers and Pillow release the GIL while they work, so these threads keep requests'
# preprocessing going beside the event loop. Four, not two (the cores): a request with big
# images may wait in its thread for the process-wide decode budget (multimodal.py), and
# text requests must not queue behind it. The queue bound caps the request bodies held
# waiting for the threads.
PREPROCESS_THREADS = 4
MAX_PREPROCESS_QUEUE = 256


@dataclass
class Choice:
    """One of a request's ``n`` choices: its flow, text stream, and (if logprobs were
    asked) the formatter of its logprobs; ``parts``/``entries`` collect a non-streamed answer."""

    index: int
    gen: Flow
    text: TextStream
    logprobs: api.LogprobsFormatter | None
    parts: list[str] = field(default_factory=list)
    entries: list = field(default_factory=list)

    def logprobs_object(self, entries: list) -> dict | None:
        """The OpenAI ``logprobs`` object of ``entries`` (see :func:`texts`), None if not asked for."""
        return None if self.logprobs is None else self.logprobs(entries)


def sampling_params(body, max_tokens: int, i: int) -> P.SamplingParams:
    """Choice ``i``'s sampling settings. As vLLM's parallel sampling, choice i of a
    seeded request draws with seed + i (wrapped into int64), so choices differ but repeat.

    Raises:
        APIError: 400, a value the engine refuses (its message names the field).
    """
    seed = None if body.seed is None else (body.seed + i + 2**63) % 2**64 - 2**63
    try:
        return P.SamplingParams(
            max_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p, top_k=body.top_k,
            seed=seed, ignore_eos=body.ignore_eos, stop_token_ids=body.stop_token_ids,
            presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty,
            repetition_penalty=body.repetition_penalty, min_tokens=body.min_tokens, logprobs=body.num_logprobs)
    except pydantic.ValidationError as exc:
        err = exc.errors()[0]
        field_ = ".".join(map(str, err["loc"])) or None
        raise api.APIError(f"{field_}: {err['msg']}" if field_ else err["msg"], param=field_) from None


class Front:
    """Requests in, flows out. ``model``: a :class:`~epdserve.model.loader.ModelInfo`;
    ``images``: the model's :class:`ImagePrompter` (None: a text model, images get 400);
    ``trace_file``: where each finished request's trace line is appended (None: nowhere)."""

    def __init__(self, model, tokenizer, registry: Registry, config: FlowConfig, *,
                 images: ImagePrompter | None = None, metrics: RouterMetrics | None = None,
                 trace_file: str | None = None):
        self.model = model
        self.tokenizer = tokenizer
        self.vocab_size = len(tokenizer)
        self.registry = registry
        self.config = config
        self.images = images
        self.metrics = metrics or registry.metrics
        self.trace_file = trace_file
        self.max_token_chars = max(map(len, tokenizer.get_vocab()))  # see check_text_length
        self._preprocess = concurrent.futures.ThreadPoolExecutor(PREPROCESS_THREADS,
                                                                 thread_name_prefix="epdserve-preprocess")
        self._preprocess_queued = 0

    def close(self) -> None:
        """Drop the preprocessing queue (requests waiting there get cancelled)."""
        self._preprocess.shutdown(wait=False, cancel_futures=True)

    # -- checks
    def check_model(self, model: str | None) -> None:
        """Raises APIError 400 ``model_not_found`` unless ``model`` (None: any) names the served one."""
        if model is not None and model not in (self.model.name, self.model.source, str(self.model.path)):
            raise api.APIError(f"The model `{model}` does not exist (this server serves "
                               f"`{self.model.name}`).", param="model", code="model_not_found")

    def check_text_length(self, body) -> None:
        """Refuse, without tokenizing it, a prompt whose text alone is too long: no token
        covers more than ``max_token_chars`` characters (the longest vocabulary entry; a
        byte-level entry's characters are bytes, and a character is at least one byte), so
        N characters are at least N / max_token_chars tokens. Assumes the chat template
        keeps every message's text, as templates do.

        Raises:
            APIError: 400 ``context_length_exceeded`` when that bound is over ``max_model_len``.
        """
        if isinstance(body, api.ChatCompletionRequest):
            chars, param = sum(m.text_chars for m in body.messages), "messages"
        elif isinstance(body.prompt, str):
            chars, param = len(body.prompt), "prompt"
        else:
            return  # token ids: max_tokens() checks their number
        at_least = -(-chars // self.max_token_chars)
        if at_least > self.model.max_model_len:
            raise api.APIError(f"This model's maximum context length is {self.model.max_model_len} tokens. However, "
                               f"your request's {chars} characters are at least {at_least} tokens. Please reduce "
                               "the length of the input.", param=param, code="context_length_exceeded")

    def check_token_ids(self, ids: list[int], param: str) -> None:
        """Raises APIError 400 naming ``param`` if a token id is outside the vocabulary."""
        bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise api.APIError(f"{param}: token id {bad} is out of range [0, {self.vocab_size})", param=param)

    def max_tokens(self, body, n_prompt: int) -> int:
        """``max_tokens`` checked against the context window (default: what is left of it).

        Raises:
            APIError: 400 when the prompt plus max_tokens exceed ``max_model_len``.
        """
        limit = self.model.max_model_len
        requested = body.requested_max_tokens()
        if requested is None:
            if n_prompt >= limit:
                raise api.APIError(f"This model's maximum context length is {limit} tokens. However, "
                                   f"your request has {n_prompt} input tokens. Please reduce the "
                                   f"length of the input.", param="messages", code="context_length_exceeded")
            return limit - n_prompt
        if n_prompt + requested > limit:
            raise api.APIError(f"This model's maximum context length is {limit} tokens. However, you "
                               f"requested {n_prompt + requested} tokens ({n_prompt} in the prompt, "
                               f"{requested} in the completion). Please reduce the length of the "
                               f"prompt or completion.", param="max_tokens", code="context_length_exceeded")
        return requested

    # -- prompts
    async def prompt(self, body) -> tuple[list[int], list[P.ImageRef]]:
        """Token ids and images (with their bytes) of a chat or completion request.

        The work runs on :data:`PREPROCESS_THREADS` threads of its own, never on the event
        loop: a 10 MB prompt takes seconds to tokenize, and the loop also streams every
        other request's tokens and reads the workers' heartbeats. At most
        :data:`MAX_PREPROCESS_QUEUE` requests wait for those threads; more get 503. A text
        too long for the context window by its length alone is refused before any of it
        (:meth:`check_text_length`).

        Raises:
            APIError: 400, as :meth:`prompt_ids`, images sent to a text model, or bad images
                (see :func:`~epdserve.serving.multimodal.parse_chat_images`); 503 when the
                preprocessing queue is full.
        """
        self.check_text_length(body)
        if self._preprocess_queued >= MAX_PREPROCESS_QUEUE:
            raise api.APIError(f"the server is busy preparing {self._preprocess_queued} requests; retry later",
                               status=503, type="service_unavailable", code=503)
        self._preprocess_queued += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self._preprocess, self._prompt, body)
        finally:
            self._preprocess_queued -= 1

    def _prompt(self, body) -> tuple[list[int], list[P.ImageRef]]:
        if not isinstance(body, api.ChatCompletionRequest):
            return self.prompt_ids(body), []
        if self.images is None:
            if not any(m.num_images for m in body.messages):
                return self.prompt_ids(body), []
            raise api.APIError(f"the model `{self.model.name}` takes no images (serve a vision-language model, "
                               "e.g. --model vlm)", param="messages")
        return self.images.prompt([m.model_dump(exclude_none=True) for m in body.messages])

    def prompt_ids(self, body) -> list[int]:
        """Token ids of a chat or completion request without images.

        Raises:
            APIError: 400, empty prompt, bad token ids, or a chat template failure.
        """
        if isinstance(body, api.ChatCompletionRequest):
            try:
                ids = chat_prompt_ids(self.tokenizer, [m.as_template_dict() for m in body.messages])
            except ValueError as exc:
                raise api.APIError(str(exc), param="messages") from None
            param = "messages"
        elif isinstance(body.prompt, str):
            ids = self.tokenizer(body.prompt).input_ids
            param = "prompt"
        else:
            ids, param = list(body.prompt), "prompt"
            self.check_token_ids(ids, "prompt")
        if not ids:
            raise api.APIError("the prompt is empty", param=param)
        return ids

    def token_text(self, token_id: int) -> str:
        """One token's text on its own, as logprobs show it (vLLM decodes it alone too)."""
        return self.tokenizer.decode([token_id])

    # -- requests
    async def admit(self, body, kind: str, request_id: str, t_arrival: float) -> list[Choice]:
        """Check and prepare ``body`` (``kind`` "chat" or "completion"): its choices, not started.

        Raises:
            APIError: 400 (see the checks above, and ``min_tokens`` over ``max_tokens``), 503.
        """
        self.check_model(body.model)
        prompt_ids, images = await self.prompt(body)
        max_tokens = self.max_tokens(body, len(prompt_ids))
        if body.min_tokens > max_tokens:  # vLLM's rule
            raise api.APIError(f"min_tokens ({body.min_tokens}) must be at most max_tokens ({max_tokens})",
                               param="min_tokens")
        self.check_token_ids(body.stop_token_ids, "stop_token_ids")
        choices = [Choice(i, new_flow(self.registry, self.config, request_id if body.n == 1 else f"{request_id}-{i}",
                                      prompt_ids, sampling_params(body, max_tokens, i), t_arrival, images),
                          TextStream(self.tokenizer, prompt_ids, body.stop_list, body.include_stop_str_in_output),
                          None if body.num_logprobs is None else api.LogprobsFormatter(kind, self.token_text))
                   for i in range(body.n)]
        self.metrics.admitted(request_id, body.n)  # once they exist (sampling_params may refuse one)
        return choices

    def finish(self, flow: Flow) -> None:
        """Close a request that has ended and record it: metrics and the trace line."""
        flow.close()
        rec = flow.trace()
        self.metrics.ended(rec, None if flow.error is not None else flow.itls_s)
        if self.trace_file:
            try:
                with open(self.trace_file, "a") as f:
                    f.write(json.dumps(rec.as_json()) + "\n")
            except OSError as exc:
                log.warning("cannot write trace %s: %s", self.trace_file, exc)


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
            flow.itls_s.append(now - last)
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
