"""Request fields outside the request models, from OpenAI's reference and vLLM's
``vllm/entrypoints/openai/protocol.py``: none is silently dropped (docs/serving.md, Request fields).
"""

from __future__ import annotations

import logging

from pydantic import BaseModel

from epdserve.serving.api.errors import APIError

log = logging.getLogger("epdserve.api")

MAX_LOGGED_NAMES = 256  # bounds the set a client sending random names could grow
_NAME_CHARS = 64

INFORMATIONAL: dict[str, str] = {
    "user": "an end-user id (OpenAI: abuse monitoring)",
    "safety_identifier": "an end-user id (OpenAI: abuse monitoring)",
    "metadata": "tags for stored completions",
    "store": "OpenAI's stored completions: nothing is stored",
    "service_tier": "OpenAI's processing tier: there is one",
    "prompt_cache_key": "a cache-routing hint: the prefix cache finds shared prefixes itself",
    "prompt_cache_retention": "a cache-retention hint",
    "prediction": "predicted output (OpenAI: latency only, the output is the same)",
    "parallel_tool_calls": "only matters with tools",
    "request_id": "vLLM's request id for its logs: the response id is the router's",
    "include_reasoning": "vLLM: drops reasoning content, which no reasoning parser here makes",
}

# name: (values that change nothing, why it is refused otherwise)
REFUSED: dict[str, tuple[tuple, str]] = {
    "suffix": ((None,), "no fill-in-the-middle template: the model cannot complete between a prefix and a suffix"),
    "audio": ((None,), "audio output is not supported"),
    "modalities": ((None, ["text"]), "only text output is supported"),
    "reasoning_effort": ((None,), "the model has no reasoning control"),
    "verbosity": ((None,), "the model has no verbosity control"),
    "web_search_options": ((None,), "web search is not supported"),
    "functions": ((None, []), "the deprecated functions API is not supported"),
    "function_call": ((None, "none"), "the deprecated functions API is not supported"),
    "tools": ((None, []), "tool calling is served on /v1/chat/completions"),
    "tool_choice": ((None, "none"), "tool calling is served on /v1/chat/completions"),
    "structural_tag": ((None,), "structural tags are not supported (response_format and guided_* are)"),
    "guided_whitespace_pattern": ((None,), "a whitespace pattern for structured output is not supported"),
    "use_beam_search": ((None, False), "beam search is not supported"),
    "length_penalty": ((None, 1, 1.0), "length_penalty applies to beam search, which is not supported"),
    "allowed_token_ids": ((None,), "allowed_token_ids is not supported"),
    "bad_words": ((None, []), "bad_words is not supported"),
    "skip_special_tokens": ((None, True), "special tokens are always skipped in the output text"),
    "spaces_between_special_tokens": ((None, True), "special tokens are always skipped in the output text"),
    "documents": ((None,), "documents for the chat template are not supported"),
    "chat_template": ((None,), "a chat template per request is not accepted; the server's is used"),
    "mm_processor_kwargs": ((None, {}), "image processor options are not supported"),
    "priority": ((None, 0), "priority scheduling is not supported"),
    "logits_processors": ((None, []), "custom logits processors are not supported"),
    "cache_salt": ((None,), "prefix-cache salting is not supported"),
    "kv_transfer_params": ((None,), "the router does the KV hand-off: external KV transfer parameters are refused"),
    "vllm_xargs": ((None, {}), "extension arguments are not supported"),
    "return_token_ids": ((None, False), "token ids in the response are not supported"),
    "prompt_embeds": ((None,), "prompt embeddings are not supported"),
}

_logged: set[str] = set()


def _neutral(value, neutral: tuple) -> bool:
    # bool is an int in Python: true must not pass for 1, nor 0 for false.
    return any(value == v and isinstance(value, bool) == isinstance(v, bool) for v in neutral)


def check(body: BaseModel) -> None:
    """Raises APIError 400 ``unsupported_parameter`` naming a :data:`REFUSED` field with a non-neutral value."""
    extra = body.model_extra or {}
    for name, value in extra.items():
        if name in REFUSED and not _neutral(value, REFUSED[name][0]):
            raise APIError(f"{name} is not supported by this server: {REFUSED[name][1]}", param=name,
                           code="unsupported_parameter")
    for name in extra:
        if name not in REFUSED and name not in INFORMATIONAL:
            log_unknown(name)


def log_unknown(name: str) -> None:
    """Once per name per process, as vLLM words it, for at most :data:`MAX_LOGGED_NAMES` names."""
    name = name[:_NAME_CHARS]
    if name in _logged or len(_logged) > MAX_LOGGED_NAMES:
        return
    _logged.add(name)
    if len(_logged) > MAX_LOGGED_NAMES:
        log.warning("more than %d unknown request field names seen: no longer logging new ones", MAX_LOGGED_NAMES)
        return
    # ascii(): a name may hold anything JSON can, control characters included.
    log.warning("The following fields were present in the request but ignored: %s", ascii(name))
