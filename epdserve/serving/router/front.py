"""The OpenAI front: from a request body to prompt ids, images, sampling settings and flows,
and from the flows' tokens back to text.

Preprocessing (chat template, tokenization, reading and decoding images) runs on a thread
pool of its own, never on the event loop. A chat request with images (served by a
vision-language model) is laid out here: the images are checked and decoded
(:func:`~epdserve.serving.api.multimodal.parse_chat_images`), each ``<image>`` placeholder
expanded to its tile tokens, and the image bytes travel to the worker that encodes them.
A request runs as one flow per choice generated: ``best_of`` (default ``n``) per prompt, for
each prompt of a completions batch (ids ``<id>-<i>``, one trace line each); their texts are
merged (:func:`~epdserve.serving.router.choices.merged`). With ``best_of`` over ``n``, the
``n`` choices of a prompt with the highest mean token logprob are answered
(:func:`~epdserve.serving.router.choices.best_choices`). A structured-output constraint is
checked by :mod:`~epdserve.serving.router.grammar_check`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import json
import logging
from dataclasses import dataclass, field

import pydantic

from epdserve.engine.request import GuidedSpec
from epdserve.engine.prompt_logprobs import check_size
from epdserve.model.tokenizer import chat_prompt_ids
from epdserve.serving.api import fields
from epdserve.serving.api import openai as api
from epdserve.serving import protocol as P
from epdserve.serving.api.logprobs import LogprobsFormatter
from epdserve.serving.api.detokenizer import TextStream
from epdserve.serving.metrics import RouterMetrics
from epdserve.serving.api.multimodal import ImagePrompter
from epdserve.serving.api.tool_calls import ToolPlan, ToolSettings, plan_tools, tool_chars
from epdserve.serving.router.choices import Choice
from epdserve.serving.router.flows import Flow, FlowConfig, new_flow
from epdserve.serving.router.grammar_check import GrammarCheck
from epdserve.serving.router.registry import Registry
from epdserve.serving.api.errors import APIError

log = logging.getLogger("epdserve.router")

# Tokenizers and Pillow release the GIL while they work, so these threads keep requests'
# preprocessing going beside the event loop. Four, not two (the cores): a request with big
# images may wait in its thread for the process-wide decode budget (multimodal.py), and
# text requests must not queue behind it. The queue bound caps the request bodies held
# waiting for the threads.
PREPROCESS_THREADS = 4
MAX_PREPROCESS_QUEUE = 256
# Names chat_template_kwargs may not use: the renderer's own (transformers passes its
# special tokens to the template too); the arguments of apply_chat_template are added.
TEMPLATE_NAMES = {"messages", "bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
                  "mask_token", "additional_special_tokens"}


@dataclass
class Prompt:
    """One prompt of a request: its token ids, images (with their bytes) and, with
    ``echo``, the text echoed before its choices' output."""

    ids: list[int]
    images: list[P.ImageRef] = field(default_factory=list)
    echo: str | None = None


def sampling_params(body, max_tokens: int, i: int, guided: GuidedSpec | None = None) -> P.SamplingParams:
    """Choice ``i``'s sampling settings, ``guided`` its structured-output constraint (see
    :meth:`Front.guided_spec`). As vLLM's parallel sampling, choice i of a
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
            repetition_penalty=body.repetition_penalty, min_tokens=body.min_tokens, logprobs=body.engine_logprobs,
            prompt_logprobs=body.prompt_logprobs_k, logit_bias=body.logit_bias_ids, min_p=body.min_p, guided=guided)
    except pydantic.ValidationError as exc:
        err = exc.errors()[0]
        field_ = ".".join(map(str, err["loc"])) or None
        raise APIError(f"{field_}: {err['msg']}" if field_ else err["msg"], param=field_) from None


class Front:
    """Requests in, flows out. ``model``: a :class:`~epdserve.model.loader.ModelInfo`;
    ``images``: the model's :class:`ImagePrompter` (None: a text model, images get 400);
    ``trace_file``: where each finished request's trace line is appended (None: nowhere);
    ``tools``: the tool-calling options (``--enable-auto-tool-choice``, the template's format)."""

    def __init__(self, model, tokenizer, registry: Registry, config: FlowConfig, *,
                 images: ImagePrompter | None = None, metrics: RouterMetrics | None = None,
                 trace_file: str | None = None, tools: ToolSettings = ToolSettings(),
                 sampling_defaults: dict | None = None):
        self.model = model
        self.tools = tools
        self.sampling_defaults = sampling_defaults or {}  # see with_defaults
        self.tokenizer = tokenizer
        self.vocab_size = len(tokenizer)
        self.registry = registry
        self.config = config
        self.images = images
        self.metrics = metrics or registry.metrics
        self.trace_file = trace_file
        self.max_token_chars = max(map(len, tokenizer.get_vocab()))  # see check_text_length
        self.template_names = (TEMPLATE_NAMES | set(tokenizer.special_tokens_map) |
                               set(inspect.signature(tokenizer.apply_chat_template).parameters) - {"kwargs"})
        self._preprocess = concurrent.futures.ThreadPoolExecutor(PREPROCESS_THREADS,
                                                                 thread_name_prefix="epdserve-preprocess")
        self._preprocess_queued = 0
        self.grammars = GrammarCheck(tokenizer)

    def close(self) -> None:
        """Drop the preprocessing queue (requests waiting there get cancelled)."""
        self._preprocess.shutdown(wait=False, cancel_futures=True)
        self.grammars.close()

    # -- checks
    def check_model(self, model: str | None) -> None:
        """Check that a request's ``model`` (None: any) names the served one (one of
        ``--served-model-name``'s names; without it, the model's name, file or directory).

        Raises:
            APIError: 404 ``model_not_found``, OpenAI's status and code.
        """
        if model is not None and not self.model.accepts(model):
            raise APIError(f"The model `{model}` does not exist (this server serves "
                               f"`{self.model.name}`).", status=404, param="model", code="model_not_found")

    def with_defaults(self, body):
        """``body`` with ``sampling_defaults`` (``--generation-config``) in the fields it
        did not set (pydantic's ``model_fields_set``: a value the client sent, even the
        field's own default, is kept); ``max_tokens`` is not filled in where a chat
        request set ``max_completion_tokens``."""
        unset = {k: v for k, v in self.sampling_defaults.items() if k not in body.model_fields_set
                 and k in type(body).model_fields}
        if "max_completion_tokens" in body.model_fields_set:
            unset.pop("max_tokens", None)
        return body.model_copy(update=unset) if unset else body

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
            lengths, param = [sum(m.text_chars for m in body.messages) + tool_chars(body)], "messages"
        else:  # token ids: max_tokens() checks their number
            lengths, param = [len(p) for p in body.prompts if isinstance(p, str)], "prompt"
        if body.truncate_prompt_tokens is not None:
            return  # a long text may be cut to fit
        chars = max(lengths, default=0)
        at_least = -(-chars // self.max_token_chars)
        if at_least > self.model.max_model_len:
            raise APIError(f"This model's maximum context length is {self.model.max_model_len} tokens. However, "
                               f"your request's {chars} characters are at least {at_least} tokens. Please reduce "
                               "the length of the input.", param=param, code="context_length_exceeded")

    def check_token_ids(self, ids: list[int], param: str) -> None:
        """Raises APIError 400 naming ``param`` if a token id is outside the vocabulary."""
        bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise APIError(f"{param}: token id {bad} is out of range [0, {self.vocab_size})", param=param)

    def max_tokens(self, body, n_prompt: int) -> int:
        """``max_tokens`` checked against the context window (default: what is left of it).

        Raises:
            APIError: 400 when the prompt plus max_tokens exceed ``max_model_len``.
        """
        limit = self.model.max_model_len
        requested = body.requested_max_tokens()
        if requested is None:
            if n_prompt >= limit:
                raise APIError(f"This model's maximum context length is {limit} tokens. However, "
                                   f"your request has {n_prompt} input tokens. Please reduce the "
                                   f"length of the input.", param="messages", code="context_length_exceeded")
            return limit - n_prompt
        if n_prompt + requested > limit:
            raise APIError(f"This model's maximum context length is {limit} tokens. However, you "
                               f"requested {n_prompt + requested} tokens ({n_prompt} in the prompt, "
                               f"{requested} in the completion). Please reduce the length of the "
                               f"prompt or completion.", param="max_tokens", code="context_length_exceeded")
        return requested

    # -- prompts
    async def prompts(self, body) -> list[Prompt]:
        """The prompts of a chat request (one) or a completion request (one or a batch).

        The work runs on :data:`PREPROCESS_THREADS` threads of its own, never on the event
        loop: a 10 MB prompt takes seconds to tokenize, and the loop also streams every
        other request's tokens and reads the workers' heartbeats. At most
        :data:`MAX_PREPROCESS_QUEUE` requests wait for those threads; more get 503. A text
        too long for the context window by its length alone is refused before any of it
        (:meth:`check_text_length`).

        Raises:
            APIError: 400, as :meth:`prompt_ids`, images sent to a text model, or bad images
                (see :func:`~epdserve.serving.api.multimodal.parse_chat_images`); 503 when the
                preprocessing queue is full.
        """
        self.check_text_length(body)
        if self._preprocess_queued >= MAX_PREPROCESS_QUEUE:
            raise APIError(f"the server is busy preparing {self._preprocess_queued} requests; retry later",
                               status=503, type="service_unavailable")
        self._preprocess_queued += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self._preprocess, self._prompts, body)
        finally:
            self._preprocess_queued -= 1

    def _prompts(self, body) -> list[Prompt]:
        if not isinstance(body, api.ChatCompletionRequest):
            prompts = [Prompt(self.prompt_ids(body, p)) for p in body.prompts]
            if body.echo:  # the prompt as sent; token ids as their text
                for prompt, sent in zip(prompts, body.prompts):
                    truncated = body.truncate_prompt_tokens is not None
                    prompt.echo = sent if isinstance(sent, str) and not truncated else self.tokenizer.decode(prompt.ids)
            return prompts
        last = body.messages[-1]
        echo = last.as_template_dict()["content"] if body.echo and last.role == "assistant" else None
        if self.images is None:
            if not any(m.num_images for m in body.messages):
                return [Prompt(self.prompt_ids(body), echo=echo)]
            raise APIError(f"the model `{self.model.name}` takes no images (serve a vision-language model, "
                               "e.g. --model vlm)", param="messages")
        ids, images = self.images.prompt([m.model_dump(exclude_none=True) for m in body.messages],
                                         body.add_special_tokens, **self.template_options(body))
        return [Prompt(self.truncated(body, ids), images, echo)]

    def prompt_ids(self, body, prompt: str | list[int] | None = None) -> list[int]:
        """Token ids of a chat request without images, or of ``prompt``, one prompt of a
        completion request; truncated to the last ``truncate_prompt_tokens``.

        Raises:
            APIError: 400, empty prompt, bad token ids, a chat template failure or
                ``chat_template_kwargs`` that use the renderer's own names.
        """
        if isinstance(body, api.ChatCompletionRequest):
            plan = self.tool_plan(body)
            try:
                ids = chat_prompt_ids(self.tokenizer, [m.as_template_dict() for m in body.messages],
                                      body.add_special_tokens, **self.template_options(body, plan))
            except ValueError as exc:
                raise APIError(str(exc), param="messages") from None
            param = "messages"
        elif isinstance(prompt, str):
            ids = self.tokenizer(prompt, add_special_tokens=body.add_special_tokens).input_ids
            param = "prompt"
        else:
            ids, param = list(prompt), "prompt"
            self.check_token_ids(ids, "prompt")
        if not ids:
            raise APIError("the prompt is empty", param=param)
        return self.truncated(body, ids)

    @staticmethod
    def truncated(body, ids: list[int]) -> list[int]:
        """``ids`` cut to their last ``truncate_prompt_tokens`` (vLLM's left truncation)."""
        return ids if body.truncate_prompt_tokens is None else ids[-body.truncate_prompt_tokens:]

    def template_options(self, body: api.ChatCompletionRequest, plan: ToolPlan | None = None) -> dict:
        """The chat template's arguments and variables of ``body`` (with ``plan``: its tools).

        Raises:
            APIError: 400, ``chat_template_kwargs`` naming an argument or variable of the
                renderer itself (``add_generation_prompt``, ``tools``, ``bos_token``, ...).
        """
        extra = body.chat_template_kwargs or {}
        clash = sorted(set(extra) & self.template_names)
        if clash:
            raise APIError(f"chat_template_kwargs: {', '.join(map(repr, clash))} "
                               f"{'is an argument' if len(clash) == 1 else 'are arguments'} of the chat template "
                               "renderer itself (use the request's own fields)", param="chat_template_kwargs")
        options = dict(extra, add_generation_prompt=body.add_generation_prompt,
                       continue_final_message=body.continue_final_message)
        if plan is not None:
            options["tools"] = plan.template_tools()
        return options

    def tool_plan(self, body) -> ToolPlan | None:
        """How a chat request uses its tools (see :func:`plan_tools`); None: it has none.

        Raises:
            APIError: 400, as :func:`plan_tools`; tool calls or results in ``messages`` while
                the chat template has no tool format; tools with a vision-language model.
        """
        plan = plan_tools(body.tools, body.tool_choice, body.parallel_tool_calls, self.tools)
        if any(m.tool_calls or m.role == "tool" for m in body.messages):
            if not self.tools.template_tools:
                raise APIError("messages: tool calls and tool results need a chat template with a tool-call "
                                   "format; serve the model with --chat-template FILE", param="messages")
            plan = plan or ToolPlan("none", [])
        if plan is not None and self.images is not None:
            raise APIError(f"tools: not supported with the vision-language model `{self.model.name}`",
                               param="tools")
        return plan

    def token_text(self, token_id: int) -> str:
        """One token's text on its own, as logprobs show it (vLLM decodes it alone too)."""
        return self.tokenizer.decode([token_id])

    @staticmethod
    def token_id_text(token_id: int) -> str:
        """A token as vLLM's ``return_tokens_as_token_ids`` names it in logprobs."""
        return f"token_id:{token_id}"

    # -- requests
    async def admit(self, body, kind: str, request_id: str, t_arrival: float) -> list[Choice]:
        """Check and prepare ``body`` (``kind`` "chat" or "completion"): its choices, not started.

        Raises:
            APIError: 400 (see the checks above, ``min_tokens`` over ``max_tokens``, a
                ``logit_bias`` token outside the vocabulary, and :meth:`guided_spec`), 503.
        """
        self.check_model(body.model)
        body = self.with_defaults(body)
        fields.check(body)
        plan = self.tool_plan(body) if kind == "chat" else None  # cheap 400s before the tokenizer's work
        prompts = await self.prompts(body)
        self.check_token_ids(body.stop_token_ids, "stop_token_ids")
        self.check_token_ids(list(body.logit_bias_ids), "logit_bias")
        guided = await self.grammars.spec(body, plan)
        choices: list[Choice] = []
        single = len(prompts) * body.candidates == 1
        for p, prompt in enumerate(prompts):
            max_tokens = self.max_tokens(body, len(prompt.ids))
            if body.min_tokens > max_tokens:  # vLLM's rule
                raise APIError(f"min_tokens ({body.min_tokens}) must be at most max_tokens ({max_tokens})",
                                   param="min_tokens")
            if body.prompt_logprobs_k is not None:
                try:
                    check_size(len(prompt.ids), body.prompt_logprobs_k)
                except ValueError as exc:
                    raise APIError(str(exc), param="prompt_logprobs" if body.prompt_logprobs is not None
                                       else "logprobs") from None
            for c in range(body.candidates):
                i = len(choices)
                # max_tokens 0 (echo only): one token is generated, as vLLM does, and not shown.
                flow = new_flow(self.registry, self.config, request_id if single else f"{request_id}-{i}",
                                prompt.ids, sampling_params(body, max(max_tokens, 1), c, guided), t_arrival,
                                prompt.images)
                choices.append(Choice(i, flow, TextStream(self.tokenizer, prompt.ids, body.stop_list,
                                                          body.include_stop_str_in_output),
                                      self.logprobs_formatter(body, kind), p, prompt.echo,
                                      echo_logprobs=kind != "chat" and body.num_logprobs is not None,
                                      shown=max_tokens > 0, tools=plan.output() if plan else None))
        self.metrics.admitted(request_id, len(choices))  # once they exist (sampling_params may refuse one)
        return choices

    def logprobs_formatter(self, body, kind: str) -> LogprobsFormatter | None:
        """A choice's logprobs formatter, None if the client asked for no logprobs."""
        if body.num_logprobs is None:
            return None
        return LogprobsFormatter(kind, self.token_id_text if body.return_tokens_as_token_ids else self.token_text)

    def finish(self, flow: Flow) -> None:
        """Close a request that has ended and record it: metrics and the trace line."""
        flow.close()
        rec = flow.trace()
        self.metrics.ended(rec, None if flow.error is not None else flow.itls_s)
        self.write_trace(rec.as_json())

    def write_trace(self, line: dict) -> None:
        """Append ``line`` to the trace file as one JSON line (nothing without one)."""
        if self.trace_file:
            try:
                with open(self.trace_file, "a") as f:
                    f.write(json.dumps(line) + "\n")
            except OSError as exc:
                log.warning("cannot write trace %s: %s", self.trace_file, exc)
