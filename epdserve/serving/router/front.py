"""The OpenAI front: a request body to prompt ids, images, sampling settings and one
flow per choice generated (``best_of``, default ``n``, per prompt; ids ``<id>-<i>`` when
there are several). Preprocessing runs on a thread pool of its own, never on the event loop."""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
from dataclasses import dataclass, field

import pydantic

from epdserve.engine.request import GuidedSpec
from epdserve.engine.prompt_logprobs import check_size
from epdserve.model.tokenizer import chat_prompt_ids
from epdserve.serving.api import fields
from epdserve.serving.api import openai as api
from epdserve.serving import protocol as P
from epdserve.serving.api.logprobs import LogprobsFormatter, token_texts
from epdserve.serving.api.detokenizer import TextStream
from epdserve.serving.metrics import RouterMetrics
from epdserve.serving.api.multimodal import ImagePrompter
from epdserve.serving.api.tool_calls import ToolPlan, ToolSettings, plan_tools, tool_chars
from epdserve.serving.router.choices import Choice
from epdserve.serving.router.flows import FlowConfig
from epdserve.serving.router.grammar_check import GrammarCheck
from epdserve.serving.router.paths import new_flow
from epdserve.serving.router.registry import Registry
from epdserve.serving.router.request_log import RequestLog
from epdserve.serving.api.errors import APIError

# Tokenizers and Pillow release the GIL. Four, not two (the cores): a request with big
# images may wait for the process-wide decode budget, and text must not queue behind it.
PREPROCESS_THREADS = 4
MAX_PREPROCESS_QUEUE = 256
# The renderer's own names, not for chat_template_kwargs (nor apply_chat_template's arguments).
TEMPLATE_NAMES = {"messages", "bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
                  "mask_token", "additional_special_tokens"}


@dataclass
class Prompt:
    """``images``: with their bytes; ``echo``: text put before its choices' output."""

    ids: list[int]
    images: list[P.ImageRef] = field(default_factory=list)
    echo: str | None = None


def sampling_params(body, max_tokens: int, i: int, guided: GuidedSpec | None = None) -> P.SamplingParams:
    """Choice ``i`` of a seeded request draws with seed + i, wrapped into int64 (vLLM).
    Raises APIError 400: a value the engine refuses (naming the field)."""
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
    """``model``: a ModelInfo; ``images``: None for a text model (images get 400);
    ``trace_file``: None, no trace lines."""

    def __init__(self, model, tokenizer, registry: Registry, config: FlowConfig, *,
                 images: ImagePrompter | None = None, metrics: RouterMetrics | None = None,
                 trace_file: str | None = None, tools: ToolSettings = ToolSettings(),
                 sampling_defaults: dict | None = None):
        self.model = model
        self.tools = tools
        self.sampling_defaults = sampling_defaults or {}
        self.tokenizer = tokenizer
        self.vocab_size = len(tokenizer)
        self.registry = registry
        self.config = config
        self.images = images
        self.metrics = metrics or registry.metrics
        self.request_log = RequestLog(self.metrics, trace_file)
        self.token_text = token_texts(tokenizer)
        self.max_token_chars = max(map(len, tokenizer.get_vocab()))
        self.template_names = (TEMPLATE_NAMES | set(tokenizer.special_tokens_map) |
                               set(inspect.signature(tokenizer.apply_chat_template).parameters) - {"kwargs"})
        self._preprocess = concurrent.futures.ThreadPoolExecutor(PREPROCESS_THREADS,
                                                                 thread_name_prefix="epdserve-preprocess")
        self._preprocess_queued = 0
        self.grammars = GrammarCheck(tokenizer)

    def close(self) -> None:
        self._preprocess.shutdown(wait=False, cancel_futures=True)
        self.grammars.close()

    def check_model(self, model: str | None) -> None:
        """Raises APIError 404 ``model_not_found`` (OpenAI's) unless None or a served name."""
        if model is not None and not self.model.accepts(model):
            raise APIError(f"The model `{model}` does not exist (this server serves "
                               f"`{self.model.name}`).", status=404, param="model", code="model_not_found")

    def with_defaults(self, body):
        """``--generation-config``'s values in the fields the client did not send
        (``model_fields_set``); no ``max_tokens`` beside ``max_completion_tokens``."""
        unset = {k: v for k, v in self.sampling_defaults.items() if k not in body.model_fields_set
                 and k in type(body).model_fields}
        if "max_completion_tokens" in body.model_fields_set:
            unset.pop("max_tokens", None)
        return body.model_copy(update=unset) if unset else body

    def check_text_length(self, body) -> None:
        """Before tokenizing: N characters are at least N / ``max_token_chars`` tokens (the
        longest vocabulary entry), the template keeping every message's text. Raises
        APIError 400 ``context_length_exceeded`` when that is over ``max_model_len``."""
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
        bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise APIError(f"{param}: token id {bad} is out of range [0, {self.vocab_size})", param=param)

    def max_tokens(self, body, n_prompt: int) -> int:
        """Default: what is left of the context window. Raises APIError 400 past it."""
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

    async def prompts(self, body, plan: ToolPlan | None = None) -> list[Prompt]:
        """One for chat, one or a batch for completions; off the event loop (a 10 MB
        prompt takes seconds), at most :data:`MAX_PREPROCESS_QUEUE` waiting. ``plan``: the chat's tools.

        Raises:
            APIError: 400, as :meth:`prompt_ids`, images to a text model, bad images; 503,
                the queue is full.
        """
        self.check_text_length(body)
        if self._preprocess_queued >= MAX_PREPROCESS_QUEUE:
            raise APIError(f"the server is busy preparing {self._preprocess_queued} requests; retry later",
                               status=503, type="service_unavailable")
        self._preprocess_queued += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self._preprocess, self._prompts, body, plan)
        finally:
            self._preprocess_queued -= 1

    def _prompts(self, body, plan: ToolPlan | None) -> list[Prompt]:
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
                return [Prompt(self.prompt_ids(body, plan=plan), echo=echo)]
            raise APIError(f"the model `{self.model.name}` takes no images (serve a vision-language model, "
                               "e.g. --model vlm)", param="messages")
        ids, images = self.images.prompt([m.model_dump(exclude_none=True) for m in body.messages],
                                         body.add_special_tokens, **self.template_options(body))
        return [Prompt(self.truncated(body, ids), images, echo)]

    def prompt_ids(self, body, prompt: str | list[int] | None = None, plan: ToolPlan | None = None) -> list[int]:
        """Of a chat request without images (``plan``: its tools), or of one completion ``prompt``. Raises
        APIError 400: empty, bad token ids, the template failed or ``chat_template_kwargs`` clash."""
        if isinstance(body, api.ChatCompletionRequest):
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
        """vLLM's left truncation."""
        return ids if body.truncate_prompt_tokens is None else ids[-body.truncate_prompt_tokens:]

    def template_options(self, body: api.ChatCompletionRequest, plan: ToolPlan | None = None) -> dict:
        """Raises APIError 400: ``chat_template_kwargs`` naming one of the renderer's own."""
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
        """None: no tools. Raises APIError 400, as :func:`plan_tools`; tool messages with a
        template without a tool format; tools with a vision-language model."""
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

    async def admit(self, body, kind: str, request_id: str, t_arrival: float) -> list[Choice]:
        """``body``'s choices, not started. Raises APIError 400 (the checks above), 503."""
        self.check_model(body.model)
        body = self.with_defaults(body)
        fields.check(body)
        plan = self.tool_plan(body) if kind == "chat" else None  # cheap 400s before the tokenizer's work
        prompts = await self.prompts(body, plan)
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
        self.metrics.admitted(request_id, len(choices))
        return choices

    def logprobs_formatter(self, body, kind: str) -> LogprobsFormatter | None:
        if body.num_logprobs is None:
            return None
        return LogprobsFormatter(kind, token_texts(self.tokenizer, True) if body.return_tokens_as_token_ids
                                 else self.token_text)

    def write_trace(self, line: dict) -> None:
        """The registry's and controller's event lines."""
        self.request_log.write(line)
