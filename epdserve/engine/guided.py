"""Structured output: grammars that constrain which tokens a request may sample.

A request's :class:`~epdserve.engine.request.GuidedSpec` (``kind``, ``value``) is compiled
by `xgrammar <https://github.com/mlc-ai/xgrammar>`_ (vLLM's default structured-output
backend; C++ on the CPU) into a grammar over this model's vocabulary. Each sequence keeps
its own ``xgrammar.GrammarMatcher``: before sampling, the matcher writes the bitmask of
the tokens the grammar allows next and the logits of the others become -inf
(:func:`mask_logits`); after sampling, the engine advances it with the chosen token. The
matcher allows EOS only where the grammar may end, and is terminated once EOS is taken.

The kinds, as vLLM builds them (``vllm/v1/structured_output/backend_xgrammar.py``):

* ``json``: ``value`` is a JSON schema (its JSON text), compiled in xgrammar's strict mode
  (no properties or items beyond those the schema names unless it allows them);
* ``json_object``: any JSON object (the schema ``{"type": "object"}``; ``value`` unused);
* ``regex``: ``value`` is a regular expression the whole output must match;
* ``choice``: ``value`` is a JSON list of strings; the output is exactly one of them;
* ``grammar``: ``value`` is an EBNF grammar in xgrammar's (GBNF) syntax, rule ``root``.

Compiled grammars are cached by xgrammar's compiler (an LRU keyed by the grammar's text,
bounded to :data:`CACHE_BYTES`), so the router's check and each worker compile a grammar
once. Nothing here runs for a batch without a guided row.
"""

from __future__ import annotations

import json
import re

import torch
import xgrammar as xgr

from epdserve.engine.request import GuidedSpec

CACHE_BYTES = 64 << 20  # compiled grammars kept per process; a JSON schema's is ~0.1-1 MB
# The JSON schema of OpenAI's ``json_object`` (vLLM compiles the same): an object, not any value.
JSON_OBJECT_SCHEMA = '{"type": "object"}'
# xgrammar's errors start with a timestamp and its C++ source position, and some with the
# check that failed: neither tells the client anything.
_NOISE = re.compile(r"^\[[0-9:]+\] \S+:\d+: |Check failed: \(.*?\) is false: ")


class GuidedError(ValueError):
    """A grammar that cannot be compiled; the message is xgrammar's, without its source position."""


class GuidedDecoder:
    """Compiles :class:`GuidedSpec` s for one model and makes a matcher per sequence.

    ``tokenizer``: the model's Hugging Face (fast) tokenizer; ``vocab_size``: the width of
    the model's logits (``config.json``'s ``vocab_size``, which may exceed the tokenizer's:
    the extra ids are never allowed); ``stop_token_ids``: the model's EOS ids, the only
    tokens that end a grammar (None: xgrammar's guess from the tokenizer); ``threads``: compile threads (1 keeps a worker's compile
    from taking a core that another worker's engine runs on).

    Thread-safe: the router compiles on its preprocessing threads.
    """

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: tuple[int, ...] | list[int] | None = None,
                 threads: int = 1):
        info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=None if stop_token_ids is None else list(stop_token_ids))
        self.vocab_size = vocab_size
        self.compiler = xgr.GrammarCompiler(info, max_threads=threads, cache_enabled=True,
                                            cache_limit_bytes=CACHE_BYTES)

    def compile(self, spec: GuidedSpec) -> xgr.CompiledGrammar:
        """The compiled grammar of ``spec`` (from the cache when compiled before).

        Raises:
            GuidedError: ``spec.value`` is not a schema / regex / grammar / choice list
                xgrammar can compile; the message says why.
        """
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
        """A fresh matcher for ``spec``, advanced over ``tokens`` (output tokens generated
        before this worker took the request: a decode worker's first token from the
        prefill worker, so the grammar's state continues across the hand-off).

        Raises:
            GuidedError: ``spec`` does not compile, or ``tokens`` break the grammar.
        """
        m = xgr.GrammarMatcher(self.compile(spec))
        for t in tokens:
            if not m.accept_token(t):
                raise GuidedError(f"output token {t} does not follow the request's {spec.kind} grammar")
        return m


def choice_grammar(choices: list[str]) -> str:
    """The EBNF grammar whose strings are exactly ``choices``: ``root ::= "a" | "b"``
    (a JSON string literal is a valid EBNF one: xgrammar reads its escapes).

    Raises:
        GuidedError: ``choices`` is not a non-empty list of strings.
    """
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) for c in choices):
        raise GuidedError("choice must be a non-empty list of strings")
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def clean_message(exc: Exception) -> str:
    """xgrammar's error message without its timestamp, C++ source position and check text."""
    text = _NOISE.sub("", str(exc).strip()).strip()
    return text[:500] or type(exc).__name__


def mask_logits(logits: torch.Tensor, rows: list[int], matchers: list[xgr.GrammarMatcher]) -> None:
    """Set to -inf, in place, the logits of row ``rows[i]`` of ``logits [S, vocab]``
    (float32, on any device) whose tokens ``matchers[i]``'s grammar does not allow next.
    The bitmask (1 bit a token) is allocated and filled on the host, so only a batch with a
    guided row pays for it, and applied on the logits' device (xgrammar's GPU kernel on
    CUDA; it wants both tensors on one device, as vLLM moves its bitmask)."""
    bitmask = xgr.allocate_token_bitmask(logits.shape[0], logits.shape[-1])
    for row, m in zip(rows, matchers):
        m.fill_next_token_bitmask(bitmask, row)
    xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), vocab_size=logits.shape[-1], indices=rows)
