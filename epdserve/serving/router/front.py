"""The OpenAI front: from a request body to prompt ids, images, sampling settings and flows,
and from the flows' tokens back to text.

Preprocessing (chat template, tokenization, reading and decoding images) runs on a thread
pool of its own, never on the event loop. A chat request with images (served by a
vision-language model) is laid out here: the images are checked and decoded
(:func:`~epdserve.serving.multimodal.parse_chat_images`), each ``<image>`` placeholder
expanded to its tile tokens, and the image bytes travel to the worker that encodes them.
A request runs as one flow per choice generated: ``best_of`` (default ``n``) per prompt, for
each prompt of a completions batch (ids ``<id>-<i>``, one trace line each); their texts are
merged (:func:`merged`). With ``best_of`` over ``n``, the ``n`` choices of a prompt with
the highest mean token logprob are answered (:func:`best_choices`).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import inspect
import json
import logging
from dataclasses import dataclass, field
from typing import AsyncIterator

import pydantic

from epdserve.engine.guided import GuidedDecoder, GuidedError
from epdserve.engine.request import GuidedSpec
from epdserve.engine.prompt_logprobs import check_size
from epdserve.model.tokenizer import chat_prompt_ids
from epdserve.serving import api_fields
from epdserve.serving import openai_api as api
from epdserve.serving import protocol as P
from epdserve.serving.api_logprobs import LogprobsFormatter, prompt_entries
from epdserve.serving.detokenizer import TextStream
from epdserve.serving.metrics import RouterMetrics
from epdserve.serving.multimodal import ImagePrompter
from epdserve.serving.structured_output import FieldError
from epdserve.serving.tool_calls import ToolOutput, ToolPlan, ToolSettings, plan_tools, tool_chars
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
# A request's grammar must compile within this (s) on the router's grammar thread, or the
# request gets 400. A thread cannot be stopped, so one that takes longer goes on (a large
# grammar of overlapping alternatives took minutes here); it has a thread of its own so
# that it holds up only other new grammars, never the prompts' preprocessing, and at most
# MAX_COMPILE_QUEUE requests wait for it. Each worker compiles an accepted grammar again,
# off its loop (serving/grammar_prep.py). Grammars that compiled are remembered (up to
# MAX_CHECKED_GRAMMARS, least recently used out) and not compiled here again.
GUIDED_COMPILE_TIMEOUT_S = 10.0
MAX_COMPILE_QUEUE = 16
MAX_CHECKED_GRAMMARS = 1024
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
        raise api.APIError(f"{field_}: {err['msg']}" if field_ else err["msg"], param=field_) from None


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
        # Compiles requests' grammars to check them (a worker compiles them again).
        self.guided = GuidedDecoder(tokenizer, len(tokenizer))
        self._compiler = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="epdserve-grammar")
        self._compiles_queued = 0
        self._checked: collections.OrderedDict[GuidedSpec, None] = collections.OrderedDict()

    def close(self) -> None:
        """Drop the preprocessing queue (requests waiting there get cancelled)."""
        self._preprocess.shutdown(wait=False, cancel_futures=True)
        self._compiler.shutdown(wait=False, cancel_futures=True)

    # -- checks
    def check_model(self, model: str | None) -> None:
        """Check that a request's ``model`` (None: any) names the served one (one of
        ``--served-model-name``'s names; without it, the model's name, file or directory).

        Raises:
            APIError: 404 ``model_not_found``, OpenAI's status and code.
        """
        if model is not None and not self.model.accepts(model):
            raise api.APIError(f"The model `{model}` does not exist (this server serves "
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
                (see :func:`~epdserve.serving.multimodal.parse_chat_images`); 503 when the
                preprocessing queue is full.
        """
        self.check_text_length(body)
        if self._preprocess_queued >= MAX_PREPROCESS_QUEUE:
            raise api.APIError(f"the server is busy preparing {self._preprocess_queued} requests; retry later",
                               status=503, type="service_unavailable")
        self._preprocess_queued += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self._preprocess, self._prompts, body)
        finally:
            self._preprocess_queued -= 1

    async def guided_spec(self, body, tools: ToolPlan | None = None) -> GuidedSpec | None:
        """The request's structured-output constraint (None: none), checked by compiling it
        on the grammar thread (see :data:`GUIDED_COMPILE_TIMEOUT_S`) unless checked before; a
        "required" or named ``tool_choice`` of plan ``tools`` brings its own (see
        ``ToolPlan.guided_spec``).

        Raises:
            APIError: 400 naming the field: two constraints, a value the grammar library
                cannot compile (with its message), or one not compiled in time; 503 when
                :data:`MAX_COMPILE_QUEUE` requests already wait for the grammar thread.
        """
        try:
            found = body.guided_spec()
            forced = tools.guided_spec() if tools else None
        except FieldError as exc:
            raise api.APIError(str(exc), param=exc.param) from None
        if forced is not None:
            if found is not None:
                raise api.APIError(f"tool_choice: {tools.mode!r} forces the output, so it cannot be combined with "
                                   f"{found[0]}", param="tool_choice")
            found = ("tools", forced)
        if found is None:
            return None
        param, spec = found
        if spec in self._checked:
            self._checked.move_to_end(spec)
            return spec
        if self._compiles_queued >= MAX_COMPILE_QUEUE:
            raise api.APIError(f"the server is busy compiling {self._compiles_queued} grammars; retry later",
                               status=503, type="service_unavailable", code=503)
        self._compiles_queued += 1
        try:
            work = asyncio.get_running_loop().run_in_executor(self._compiler, self.guided.compile, spec)
            await asyncio.wait_for(work, GUIDED_COMPILE_TIMEOUT_S)
        except GuidedError as exc:
            raise api.APIError(f"{param}: {exc}", param=param) from None
        except asyncio.TimeoutError:
            raise api.APIError(f"{param}: not compiled within {GUIDED_COMPILE_TIMEOUT_S:g} s (too complex, or the "
                               "server is compiling others); simplify it or retry", param=param) from None
        finally:
            self._compiles_queued -= 1
        self._checked[spec] = None
        if len(self._checked) > MAX_CHECKED_GRAMMARS:
            self._checked.popitem(last=False)
        return spec

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
            raise api.APIError(f"the model `{self.model.name}` takes no images (serve a vision-language model, "
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
                raise api.APIError(str(exc), param="messages") from None
            param = "messages"
        elif isinstance(prompt, str):
            ids = self.tokenizer(prompt, add_special_tokens=body.add_special_tokens).input_ids
            param = "prompt"
        else:
            ids, param = list(prompt), "prompt"
            self.check_token_ids(ids, "prompt")
        if not ids:
            raise api.APIError("the prompt is empty", param=param)
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
            raise api.APIError(f"chat_template_kwargs: {', '.join(map(repr, clash))} "
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
        try:
            plan = plan_tools(body.tools, body.tool_choice, body.parallel_tool_calls, self.tools)
        except FieldError as exc:
            raise api.APIError(str(exc), param=exc.param) from None
        if any(m.tool_calls or m.role == "tool" for m in body.messages):
            if not self.tools.template_tools:
                raise api.APIError("messages: tool calls and tool results need a chat template with a tool-call "
                                   "format; serve the model with --chat-template FILE", param="messages")
            plan = plan or ToolPlan("none", [])
        if plan is not None and self.images is not None:
            raise api.APIError(f"tools: not supported with the vision-language model `{self.model.name}`",
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
        api_fields.check(body)
        plan = self.tool_plan(body) if kind == "chat" else None  # cheap 400s before the tokenizer's work
        prompts = await self.prompts(body)
        self.check_token_ids(body.stop_token_ids, "stop_token_ids")
        self.check_token_ids(list(body.logit_bias_ids), "logit_bias")
        guided = await self.guided_spec(body, plan)
        choices: list[Choice] = []
        single = len(prompts) * body.candidates == 1
        for p, prompt in enumerate(prompts):
            max_tokens = self.max_tokens(body, len(prompt.ids))
            if body.min_tokens > max_tokens:  # vLLM's rule
                raise api.APIError(f"min_tokens ({body.min_tokens}) must be at most max_tokens ({max_tokens})",
                                   param="min_tokens")
            if body.prompt_logprobs_k is not None:
                try:
                    check_size(len(prompt.ids), body.prompt_logprobs_k)
                except ValueError as exc:
                    raise api.APIError(str(exc), param="prompt_logprobs" if body.prompt_logprobs is not None
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
        if self.trace_file:
            try:
                with open(self.trace_file, "a") as f:
                    f.write(json.dumps(rec.as_json()) + "\n")
            except OSError as exc:
                log.warning("cannot write trace %s: %s", self.trace_file, exc)


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
