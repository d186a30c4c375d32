"""Structured output by `xgrammar <https://github.com/mlc-ai/xgrammar>`_ (vLLM's default backend), each
kind built as ``vllm/v1/structured_output/backend_xgrammar.py`` does (``json`` in strict mode; ``grammar``:
GBNF, rule ``root``). Compiled grammars are cached per process (LRU, :data:`CACHE_BYTES`)."""

from __future__ import annotations

import json
import re

import torch
import xgrammar as xgr

from epdserve.engine.request import GuidedSpec

CACHE_BYTES = 64 << 20  # compiled grammars kept per process; a JSON schema's is ~0.1-1 MB
# The JSON schema of OpenAI's ``json_object`` (vLLM compiles the same): an object, not any value.
JSON_OBJECT_SCHEMA = '{"type": "object"}'
# xgrammar's errors lead with a timestamp, C++ position and failed check: noise to a client.
_NOISE = re.compile(r"^\[[0-9:]+\] \S+:\d+: |Check failed: \(.*?\) is false: ")


class GuidedError(ValueError):
    """A grammar that cannot be compiled; the message is xgrammar's, without its source position."""


class GuidedDecoder:
    """``vocab_size``: the logits' width (may exceed the tokenizer's). ``stop_token_ids``: the only tokens that
    end a grammar (None: xgrammar's guess). ``threads``: 1 keeps compiles off other engines' cores. Thread-safe."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: tuple[int, ...] | list[int] | None = None,
                 threads: int = 1):
        info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=None if stop_token_ids is None else list(stop_token_ids))
        self.vocab_size = vocab_size
        self.compiler = xgr.GrammarCompiler(info, max_threads=threads, cache_enabled=True,
                                            cache_limit_bytes=CACHE_BYTES)

    def compile(self, spec: GuidedSpec) -> xgr.CompiledGrammar:
        """From the cache when compiled before. Raises GuidedError (the message says why)."""
        try:
            if spec.kind == "json":
                return self.compiler.compile_json_schema(spec.value, strict_mode=True)
            if spec.kind == "json_object":
                return self.compiler.compile_json_schema(JSON_OBJECT_SCHEMA, strict_mode=True)
            if spec.kind == "regex":
                return self.compiler.compile_regex(spec.value)
            if spec.kind == "choice":
                return self.compiler.compile_grammar(choice_grammar(json.loads(spec.value)))
            return self.compiler.compile_grammar(spec.value)
        except GuidedError:
            raise
        except Exception as exc:  # xgrammar raises RuntimeError, InvalidJSONError, ...
            raise GuidedError(clean_message(exc)) from None

    def matcher(self, spec: GuidedSpec, tokens: list[int] = ()) -> xgr.GrammarMatcher:
        """Advanced over ``tokens`` (a decode worker's first token, from prefill). Raises GuidedError."""
        m = xgr.GrammarMatcher(self.compile(spec))
        for t in tokens:
            if not m.accept_token(t):
                raise GuidedError(f"output token {t} does not follow the request's {spec.kind} grammar")
        return m


def choice_grammar(choices: list[str]) -> str:
    """``root ::= "a" | "b"`` (a JSON string literal is a valid EBNF one). Raises GuidedError."""
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) for c in choices):
        raise GuidedError("choice must be a non-empty list of strings")
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def clean_message(exc: Exception) -> str:
    text = _NOISE.sub("", str(exc).strip()).strip()
    return text[:500] or type(exc).__name__


def mask_logits(logits: torch.Tensor, rows: list[int], matchers: list[xgr.GrammarMatcher]) -> None:
    """-inf, in place, for the tokens ``matchers[i]`` disallows in row ``rows[i]`` of ``logits [S, vocab]``
    (float32, any device). The bitmask is built on the host, applied on the logits' device (as vLLM)."""
    bitmask = xgr.allocate_token_bitmask(logits.shape[0], logits.shape[-1])
    for row, m in zip(rows, matchers):
        m.fill_next_token_bitmask(bitmask, row)
    xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), vocab_size=logits.shape[-1], indices=rows)
