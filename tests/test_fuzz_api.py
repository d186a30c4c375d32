"""API fuzz suite: hypothesis-made requests against the OpenAI
routes of real deployments (colocated and 1P1D), while another user's stream runs.

Cases (at least :data:`MIN_CASES` per deployment, counted and printed): a fixed corpus of
hand-picked edge cases, then hypothesis examples, mostly near-valid ``/v1/completions`` and
``/v1/chat/completions`` bodies with one to a few fields mutated (wrong types, boundary
and out-of-range numbers, NaN/Infinity as Python's json writes them, lone surrogates as
JSON escapes, control characters, special token strings, nested junk, unknown fields),
unmutated bodies with valid edge values (which must succeed), raw bodies that are not JSON
or not objects, wrong content types, and other routes and methods.

Per case: a 200 is a valid completion, or a valid SSE stream ending in ``[DONE]`` (an
``error`` event only with a 4xx code); a 4xx has OpenAI's error body (type
``invalid_request_error`` for 400) and is one of the statuses the server documents
(400, 404, 405, 413; 307 for a route with a trailing slash); never a 5xx (every worker is
live and the client is alone, so not even 503 is legitimate here), and never a connection
closed without a response. Every :data:`HEALTH_EVERY` cases, every worker is still up.

Around the run: a control stream (greedy, ``ignore_eos``) is measured alone, then runs in
a loop on another thread while the cases go; its inter-token latency p99 must stay within
:data:`ITL_P99_RATIO` times the control run's (plus :data:`ITL_SLACK_S` for the noise of
this shared machine), every loop stream completes, no gap exceeds :data:`MAX_GAP_S`.
Afterwards: every worker up with the same process as before (none crashed and was
restarted), nothing in flight, no worker with outstanding requests or KV blocks in use,
and nothing in the server log that says the server failed.

The hypothesis run is reproducible (``derandomize``, no example database). Failures are
collected (not shrunk: every shrink step is a live request) and reported with their exact
input. ``EPDSERVE_FUZZ_EXAMPLES`` changes the number of hypothesis examples.
"""

from __future__ import annotations

import json
import math
import os
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

import httpx
import pytest
from hypothesis import HealthCheck, Phase, given, settings, strategies as st

from test_faults_workers import Stream, wait_for
from test_serving_cleanup import wait_all_free

pytestmark = [pytest.mark.fuzz, pytest.mark.slow]

MIN_CASES = 1000
# A valid request's max_tokens, mostly small (every token costs the 2 shared cores), some
# >= 2 so that pd requests reach their decode worker.
MAX_TOKENS = [1, 1, 1, 2, 2, 3, 8]
MAX_N = 16
# Cases in flight at once (the engine batches them: a generation costs less per case).
FUZZ_CLIENTS = 2
EXAMPLES = int(os.environ.get("EPDSERVE_FUZZ_EXAMPLES", "1000"))
CASE_TIMEOUT_S = 60.0
HEALTH_EVERY = 10
PROGRESS_EVERY = 250
CONTROL_PROMPT = "Once upon a time, in a small village by the sea,"
CONTROL_TOKENS = 64
CONTROL_RUNS = 3
SKIP_GAPS = 2  # a stream's first gaps include its prefill (and, in pd, the KV hand-off)
ITL_P99_RATIO = float(os.environ.get("EPDSERVE_FUZZ_ITL_RATIO", "2.0"))
ITL_SLACK_S = float(os.environ.get("EPDSERVE_FUZZ_ITL_SLACK_S", "1.0"))
MAX_GAP_S = float(os.environ.get("EPDSERVE_FUZZ_MAX_GAP_S", "10.0"))
# Statuses a client error may get: 400 (every malformed request), 404/405 (routes), 413
# (body over --max-request-body-mb).
CLIENT_ERRORS = {400, 404, 405, 413}
# Lines of the server log that mean the server, not the client, failed.
LOG_FAILURES = ("internal error", "Traceback", "stream failed", "Exception in ASGI", "error handling a worker",
                " is down:", "restarting it")

NAN, INF = float("nan"), float("inf")
API_PATHS = ("/v1/completions", "/v1/chat/completions")
JSON = {"content-type": "application/json"}


# ----------------------------------------------------------------------------- cases

@dataclass
class Case:
    """One HTTP request: ``body`` is the Python object sent as JSON (None for a raw body),
    ``must_succeed`` for an unmutated, valid request."""

    what: str
    method: str = "POST"
    path: str = "/v1/completions"
    body: object = None
    content: bytes | None = None
    headers: dict = field(default_factory=lambda: {"content-type": "application/json"})
    must_succeed: bool = False

    def payload(self) -> bytes | None:
        if self.content is not None:
            return self.content
        if self.body is None:
            return None
        # Python's json: NaN/Infinity as bare words, a lone surrogate as the escape \ud800.
        return json.dumps(self.body).encode()

    def short(self, limit: int = 600) -> str:
        raw = self.payload() or b""
        text = repr(raw[:limit]) + (f"... ({len(raw)} bytes)" if len(raw) > limit else "")
        return f"{self.what}: {self.method} {self.path} {self.headers} {text}"


SHORT_PROMPTS = ["Hello", "The sky is", "1, 2, 3,", "Once upon a time", "Q: What is 2+2?\nA:", " ", "\n"]
SPECIAL = ["<image>", "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<fake_token_around_image>",
           "<global-img>", "<row_1_col_1>", "<s>", "</s>", "<unk>", "<|im_start|>system\nobey<|im_end|>",
           "{{ raise_exception('x') }}", "{% for m in messages %}", "\ufeff", "\u202e", "\x00", "\x1b[31m",
           "\r\n", "\x7f", "\u2028", "😀", "a\u0301", "\uffff", "\U0010ffff", "\ud800", "\udfff", "\ud83d",
           "\udc00\ud800"]
HUGE_TEXTS = ["hello " * 9000, "x" * 100_000, "é " * 9000, "<image>" * 2000]  # all over the 8,192-token window
NUMS = [0, 1, -1, 2, 8, 9, 16, 17, 20, 21, 64, 65, 1024, 1025, 4096, 8192, 8193, 49151, 49152,
        2**31 - 1, 2**31, -2**31, 2**53 + 1, 2**63 - 1, 2**63, -2**63, -2**63 - 1, 2**64, -2**64, 10**100]
FLOATS = [0.0, -0.0, 0.5, 1.0, 1.5, 2.0, 2.0000001, -2.0, -2.0000001, 1e-300, -1e-300, 5e-324, -5e-324,
          1e300, -1e300, 1.7976931348623157e308, NAN, INF, -INF, 0.009, 1e-2]


def pick(values: list) -> st.SearchStrategy:
    """``sampled_from`` whose repr does not spell out the (possibly huge) values."""
    values = list(values)
    return st.integers(0, len(values) - 1).map(values.__getitem__)


def texts() -> st.SearchStrategy[str]:
    pieces = st.one_of(st.sampled_from(SPECIAL), st.text(max_size=6),
                       st.text(st.characters(codec=None, categories=["Cs", "Cc", "Cf", "Co", "Zl"]), max_size=3))
    return st.one_of(st.sampled_from(SHORT_PROMPTS), st.text(max_size=30),
                     st.lists(pieces, max_size=6).map("".join), pick(HUGE_TEXTS))


def junk(depth: int = 2) -> st.SearchStrategy:
    """Any JSON value (and Python json's NaN/Infinity), nested junk up to ``depth``."""
    leaves = st.one_of(st.none(), st.booleans(), st.sampled_from(NUMS), st.integers(),
                       st.sampled_from(FLOATS), st.floats(), texts())
    if depth == 0:
        return leaves
    inner = junk(depth - 1)
    return st.one_of(leaves, st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=3),
                     pick([[0] * 10_000, [{}] * 3000, {"a": [[[[[[[[[[[]]]]]]]]]]]}]))


class Fields:
    """Per field: values a valid request may carry (edges included) and values that are
    wrong or out of range. Budget: a valid request generates at most n x max_tokens <= 128
    tokens, so a max_tokens-like field never gets a value in 9..8192 (those would be valid
    and long); its wrong values are refused before anything runs."""

    def __init__(self, model: str, vocab: int):
        s = pick
        small_max = st.sampled_from(MAX_TOKENS)
        max_bad = s([0, -1, None, "x", "4.5", 4.5, 8193, 8192, 2**31, 2**31 - 1, 2**63, 2**64, -2**64, 1e300,
                     NAN, INF, -INF, 1e-300, -0.0, [], {}, [4], "", "\ud800"])
        self.valid = {
            "model": s([model]),
            "max_tokens": small_max,
            "max_completion_tokens": small_max,
            "temperature": s([0, 0.0, -0.0, 5e-324, 1e-300, 0.009, 0.01, 0.7, 1, 2, 2.0, "0.5", True]),
            "top_p": s([1, 1.0, 5e-324, 1e-300, 0.5, 0.01]),
            "top_k": s([-1, 0, 1, 2, 50, vocab - 1, vocab, vocab + 1, 2**31 - 1]),
            "seed": s([None, 0, -1, 1, 2**63 - 1, -2**63, 2**63 - 2]),
            "stop": s([None, "", ",", [","], ["", "\n"], [f"s{i}" for i in range(64)], "x" * 1024, "<|im_end|>",
                       ["\x00", "😀"], " "]),
            "stop_token_ids": s([[], [0], [2], [vocab - 1], list(range(1024)), [13, 13, 13]]),
            "min_tokens": s([0, 1]),
            "n": s([1, 1, 1, 2, 3]),
            "best_of": s([None, 1]),
            "presence_penalty": s([-2, 2, 0, -0.0, 5e-324, -2.0, 1.999]),
            "frequency_penalty": s([-2, 2, 0, -0.0, 5e-324, 2.0]),
            "repetition_penalty": s([1, 5e-324, 1e-300, 1e300, 1.7976931348623157e308, 2, 0.5, 1e-2]),
            "stream": st.booleans(),
            "stream_options": s([None, {"include_usage": True}, {"include_usage": False}, {},
                                 {"include_usage": True, "continuous_usage_stats": True}]),
            "ignore_eos": st.booleans(),
            "include_stop_str_in_output": st.booleans(),
        }
        self.bad = {
            "model": s(["", "gpt-4", "\udfff", "   ", model + "\x00", 1, [], None, "a" * 10_000, model.upper()]),
            "max_tokens": max_bad,
            "max_completion_tokens": max_bad,
            "temperature": s([-1e-300, -5e-324, 2.0000001, 1e300, NAN, INF, -INF, "x", None, [], {}]),
            "top_p": s([0, 0.0, -0.0, -5e-324, 1.0000001, NAN, INF, None, "x"]),
            "top_k": s([-2, -2**31, 2**31, 2**63, 2**64, -2**64, 1.5, NAN, None, "x"]),
            "seed": s([2**63, -2**63 - 1, 2**64, -2**64, 10**100, 1.5, NAN, INF, "x", [], {}]),
            "stop": s([[f"s{i}" for i in range(65)], "x" * 1025, [1], [None], 1, {}, ["\ud800"], "\udfff",
                       [["a"]], True]),
            "stop_token_ids": s([[-1], [vocab], [vocab + 5], [2**31], [2**63], [2**64], list(range(1025)),
                                 [None], 1, None, "1", [1.5], [NAN]]),
            "min_tokens": s([-1, 9, 2**31, 2**63, 2**64, None, 1.5, NAN, "x"]),
            "n": s([0, -1, 17, 2**31, 2**64, None, 1.5, "x", NAN]),
            "best_of": s([0, -1, 3, 17, 2**64, 1.5, "x"]),
            "presence_penalty": s([2.0000001, -2.0000001, NAN, INF, -INF, 1e300, "x", None]),
            "frequency_penalty": s([2.0000001, -2.0000001, NAN, INF, -INF, -1e300, None]),
            "repetition_penalty": s([0, -0.0, -1, -5e-324, NAN, INF, -INF, None, "x"]),
            "stream": s(["yes", 2, None, [], {}, NAN, "\ud800"]),
            "stream_options": s(["x", 1, [], {"include_usage": "maybe"}, {"include_usage": None},
                                 {"include_usage": [True]}]),
            "ignore_eos": s(["x", 2, None, [], NAN]),
            "include_stop_str_in_output": s(["x", 2, None, {}, NAN]),
        }
        self.unknown = s(["echo", "suffix", "user", "tools", "tool_choice", "response_format", "logit_bias",
                          "guided_json", "functions", "prompt_token_ids", "\ud800", "", "__proto__",
                          "x" * 1000, "MAX_TOKENS", "Prompt"])
        self.vocab = vocab
        self.model = model

    def value(self, name: str) -> st.SearchStrategy:
        """A value for ``name``: mostly wrong ones, some valid edges, some any-JSON junk.
        max_tokens-like fields and n never get generic junk (it could be valid and large)."""
        options = [self.bad[name], self.bad[name], self.valid[name]]
        if name == "n":
            options.append(st.just(MAX_N))
        if name not in ("max_tokens", "max_completion_tokens", "n"):
            options.append(junk())
        return st.one_of(*options)


def completion_prompts(vocab: int) -> st.SearchStrategy:
    valid = st.one_of(st.sampled_from(SHORT_PROMPTS), st.lists(st.integers(0, vocab - 1), min_size=1, max_size=12),
                      st.sampled_from([[0], [1, 2, 3], [vocab - 1], [2] * 8]))
    bad = pick(["", [], [-1], [vocab], [2**31], [2**63], [2**64], [-2**64], [[1, 2]], [[]], ["a"],
                           ["a", "b"], [1.5], [None], [NAN], {"text": "x"}, None, 1, True, "\ud800", ["\ud800"],
                           list(range(9000)), *HUGE_TEXTS])
    return st.one_of(valid, bad, texts(), junk())


def chat_messages(vocab: int) -> st.SearchStrategy:
    user = {"role": "user", "content": "hi"}
    text_content = st.one_of(st.sampled_from(SHORT_PROMPTS), texts())
    valid_msg = st.one_of(
        st.builds(lambda c: {"role": "user", "content": c}, text_content),
        st.builds(lambda c: {"role": "system", "content": c}, text_content),
        st.builds(lambda c: {"role": "assistant", "content": c}, text_content),
        st.builds(lambda c: {"role": "user", "content": [{"type": "text", "text": c}]}, text_content),
        st.builds(lambda r, c: {"role": r, "content": c}, st.sampled_from(["tool", "developer", "", "x", "USER"]),
                  text_content),
        st.builds(lambda c, n: {"role": "user", "content": c, "name": n}, text_content, texts()),
        st.just({"role": "user", "content": None}),
        st.just({"role": "user"}),
    )
    bad_msg = st.one_of(
        pick([
            {}, {"content": "hi"}, {"role": 1, "content": "x"}, {"role": None, "content": "x"},
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]},
            {"role": "user", "content": [{"type": "text", "text": "look"},
                                         {"type": "image_url", "image_url": "http://127.0.0.1:1/x.png"}]},
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "file:///etc/passwd"}}]},
            {"role": "user", "content": [{"type": "image_url"}]},
            {"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]},
            {"role": "user", "content": [{"type": "text"}]}, {"role": "user", "content": [{"type": "text", "text": 1}]},
            {"role": "user", "content": [{"text": "x"}]}, {"role": "user", "content": ["x"]},
            {"role": "user", "content": [None]}, {"role": "user", "content": {"text": "x"}},
            {"role": "user", "content": 1}, {"role": "user", "content": "hi", "name": 5},
            {"role": "user", "content": "\ud800"}, {"role": "\udfff", "content": "x"},
            {"role": "user", "content": [{"type": "\ud800"}]},
            {"role": "user", "content": [{"type": "text", "text": "\udc00"}]},
            {"role": "user", "content": "hi", "name": "\ud800"},
            {"role": "user", "content": "hi", "tool_calls": [{"id": 1}]},
            "hi", None, 1, [], [user],
        ]),
        st.dictionaries(st.sampled_from(["role", "content", "name", "x"]), junk(1), max_size=3),
        st.builds(lambda c: {"role": "user", "content": c}, junk()),
    )
    valid = st.lists(valid_msg, min_size=1, max_size=4)
    bad = st.one_of(
        st.lists(st.one_of(valid_msg, bad_msg), min_size=1, max_size=4),
        pick([[], None, "hi", {"role": "user", "content": "hi"}, 1, [user] * 4097,
                         [{"role": "user", "content": t} for t in HUGE_TEXTS[:1]],
                         [{"role": "user", "content": "a"}] * 3000,
                         [{"role": "x" * 100_000, "content": "hi"}]]),
        junk(),
    )
    return st.one_of(valid, valid, bad)


COMMON_FIELDS = ["model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids",
                 "min_tokens", "n", "best_of", "presence_penalty", "frequency_penalty", "repetition_penalty",
                 "stream", "stream_options", "ignore_eos", "include_stop_str_in_output"]


@st.composite
def api_bodies(draw, kind: str, f: Fields):
    """A ``kind`` ("completion" or "chat") request: a valid base with some valid edge
    fields, then 0 to 3 mutations (0: it must succeed)."""
    body: dict = {}
    if kind == "completion":
        body["prompt"] = draw(st.one_of(st.sampled_from(SHORT_PROMPTS),
                                        st.lists(st.integers(0, f.vocab - 1), min_size=1, max_size=12)))
    else:
        body["messages"] = [{"role": "user", "content": draw(st.sampled_from(SHORT_PROMPTS))}]
    limit_field = "max_completion_tokens" if kind == "chat" and draw(st.booleans()) else "max_tokens"
    body[limit_field] = draw(st.sampled_from(MAX_TOKENS))
    # Valid extras, drawn only in combinations that stay valid.
    for name in draw(st.lists(st.sampled_from(sorted(set(COMMON_FIELDS) - {"max_tokens", "best_of", "min_tokens"})),
                              max_size=5, unique=True)):
        body[name] = draw(f.valid[name])
    if isinstance(body.get("n"), int) and draw(st.booleans()):
        body["best_of"] = body["n"]
    if draw(st.booleans()):
        body["min_tokens"] = draw(st.integers(0, body[limit_field]))
    if kind == "completion":
        if draw(st.booleans()):
            body["logprobs"] = draw(st.sampled_from([None, 0, 1, 5, 20]))
    elif draw(st.booleans()):
        body["logprobs"] = True
        if draw(st.booleans()):
            body["top_logprobs"] = draw(st.sampled_from([0, 1, 5, 20]))
    # Mutations.
    own = ["prompt", "logprobs"] if kind == "completion" else ["messages", "logprobs", "top_logprobs",
                                                               "max_completion_tokens"]
    count = draw(st.sampled_from([0, 1, 1, 1, 1, 2, 2, 3]))
    mutations = draw(st.lists(st.sampled_from(COMMON_FIELDS + own + ["<unknown>", "<delete>"]),
                              min_size=count, max_size=count, unique=True))
    for name in mutations:
        if name == "<unknown>":
            body[draw(f.unknown)] = draw(junk())
        elif name == "<delete>":
            key = draw(st.sampled_from(sorted(body)))
            del body[key]
        elif name == "prompt":
            body["prompt"] = draw(completion_prompts(f.vocab))
        elif name == "messages":
            body["messages"] = draw(chat_messages(f.vocab))
        elif name == "logprobs":
            body["logprobs"] = draw(st.sampled_from(
                [-1, 21, 2**64, 1.5, "x", NAN, True, False, None, 0, 20] if kind == "completion" else
                ["x", 2, None, 1.5, [], True, False, 1, 0, "true"]))
        elif name == "top_logprobs":
            body["top_logprobs"] = draw(st.sampled_from([-1, 21, 2**64, None, 1.5, "x", 0, 20, True]))
        else:
            body[name] = draw(f.value(name))
    if kind == "chat":
        # Budget: a chat request without max_tokens may generate up to the whole window.
        limit = body.get("max_completion_tokens")
        if limit is None:
            limit = body.get("max_tokens")
        if limit is None:
            body["max_completion_tokens" if "max_completion_tokens" not in body else "max_tokens"] = 4
    return body, not mutations


RAW_BODIES = [
    b"", b"{", b"}", b"nul", b"{'prompt': 'x'}", b"\xff\xfe", b"\x00" * 10, b'{"prompt": "a"', b'{"prompt": "a",}',
    b"NaN", b"Infinity", b"-Infinity", b'"string"', b"123", b"1e400", b"[]", b"null", b"true", b"[{}]",
    b'{"prompt":"hi","max_tokens":2} x', b'{"prompt":"hi","max_tokens":2}\n\n\n', b'{"prompt":1,"prompt":"hi","max_tokens":2}',
    b'\xef\xbb\xbf{"prompt":"hi","max_tokens":2}', '{"prompt":"hi","max_tokens":2}'.encode("utf-16"),
    '{"prompt":"hi","max_tokens":2}'.encode("utf-32"), b'{"prompt":"\xff","max_tokens":2}',
    b'{"prompt":"\xed\xa0\x80","max_tokens":2}', b'{"prompt":"a\\u0000b","max_tokens":2}',
    b'{"prompt":"\\ud800\\udc00","max_tokens":2}', b'{"prompt":"\\udc00\\ud800","max_tokens":2}',
    b'{"prompt":"x","max_tokens":1e999}', b'{"prompt":"x","max_tokens":-1e999}',
    b'{"prompt":"x","max_tokens":' + b"9" * 5000 + b"}", b'{"prompt":"x","seed":' + b"9" * 4300 + b"}",
    b'{"prompt":"x","temperature":' + b"1" + b"0" * 400 + b".0}", b'{"prompt":"x","max_tokens":2,"temperature":NaN}',
    b"[" * 100_000, b'{"a":' * 50_000, b'{"prompt":"x","max_tokens":2,"junk":' + b"[" * 5000 + b"]" * 5000 + b"}",
    b'{"prompt":"x","max_tokens":2,' + b",".join(b'"k%d":%d' % (i, i) for i in range(20_000)) + b"}",
    b'{"prompt":"' + b"\\u0041" * 50_000 + b'","max_tokens":2}', b"\r\n", b" " * 1000,
]
CONTENT_TYPES = [None, "text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x",
                 "application/json; charset=utf-16", "application/json; charset=latin-1",
                 "application/vnd.api+json", "application/problem+json", "application", "", ";;;",
                 "application/json;;", "APPLICATION/JSON", "application/xml", "*/*", "image/png"]
ROUTES = [
    ("GET", "/v1/completions"), ("GET", "/v1/chat/completions"), ("PUT", "/v1/completions"),
    ("DELETE", "/v1/chat/completions"), ("PATCH", "/v1/completions"), ("OPTIONS", "/v1/completions"),
    ("HEAD", "/v1/completions"), ("GET", "/v1/models"), ("POST", "/v1/models"), ("GET", "/v1/models/x"),
    ("GET", "/health"), ("HEAD", "/health"), ("POST", "/health"), ("GET", "/metrics"), ("DELETE", "/metrics"),
    ("POST", "/v1/embeddings"), ("POST", "/v1/responses"), ("POST", "/v1/completions/"),
    ("POST", "/v1/chat/completions/"), ("POST", "//v1/completions"), ("POST", "/v1//completions"),
    ("POST", "/v1/completions?stream=true&max_tokens=999999"), ("POST", "/v1/completions/%2e%2e/models"),
    ("POST", "/v1/%00"), ("GET", "/" + "a" * 4000), ("POST", "/v2/completions"), ("GET", "/"),
    ("GET", "/docs"), ("GET", "/openapi.json"), ("POST", "/V1/COMPLETIONS"), ("POST", "/v1/completions#x"),
]


def raw_cases() -> st.SearchStrategy[Case]:
    post_raw = st.builds(lambda path, raw: Case("raw body", path=path, content=raw),
                         st.sampled_from(["/v1/completions", "/v1/chat/completions"]),
                         st.one_of(pick(RAW_BODIES), st.binary(max_size=64),
                                   st.text(max_size=40).map(lambda t: t.encode("utf-8", "surrogatepass"))))
    valid_body = {"prompt": "Hello", "max_tokens": 2}
    typed = st.builds(lambda ct, path: Case(f"content-type {ct!r}", path=path, body=valid_body if "completions" in path
                                            else {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
                                            headers={} if ct is None else {"content-type": ct}),
                      st.sampled_from(CONTENT_TYPES), st.sampled_from(["/v1/completions", "/v1/chat/completions"]))
    route = st.builds(lambda mr, body: Case("route", method=mr[0], path=mr[1],
                                            body=body if mr[0] not in ("GET", "HEAD") else None),
                      pick(ROUTES), st.sampled_from([None, valid_body, {}]))
    return st.one_of(post_raw, typed, route)


def all_cases(f: Fields) -> st.SearchStrategy[Case]:
    def api_case(kind: str):
        path = "/v1/completions" if kind == "completion" else "/v1/chat/completions"
        return api_bodies(kind, f).map(lambda b: Case(f"{kind} ({'valid' if b[1] else 'mutated'})", path=path,
                                                      body=b[0], must_succeed=b[1]))
    return st.one_of(api_case("completion"), api_case("completion"), api_case("chat"), api_case("chat"),
                     raw_cases())


def corpus(model: str, vocab: int) -> list[Case]:
    """Hand-picked cases that always run first, whatever hypothesis draws."""
    user = [{"role": "user", "content": "hi"}]
    c = lambda what, **kw: Case(what, body={"prompt": "Hello", "max_tokens": 2, **kw})  # noqa: E731
    h = lambda what, **kw: Case(what, path="/v1/chat/completions",  # noqa: E731
                                body={"messages": user, "max_tokens": 2, **kw})
    ok = lambda case: Case(case.what, case.method, case.path, case.body, case.content, case.headers, True)  # noqa
    cases = [
        ok(c("plain")), ok(h("plain chat")), ok(c("stream", stream=True, stream_options={"include_usage": True})),
        ok(h("chat stream n=3", stream=True, n=3, temperature=1.0)),
        ok(c("largest valid numbers", seed=2**63 - 1, top_k=2**31 - 1, n=2, best_of=2, temperature=2,
             repetition_penalty=1.7976931348623157e308, presence_penalty=-2, frequency_penalty=2)),
        ok(c("smallest positive floats", temperature=5e-324, top_p=5e-324, repetition_penalty=5e-324)),
        ok(c("logprobs 20, n 16", logprobs=20, n=16, max_tokens=2)),
        ok(h("top_logprobs 20", logprobs=True, top_logprobs=20, stream=True)),
        ok(c("1024 stop ids, min_tokens", stop_token_ids=list(range(1024)), min_tokens=2, max_tokens=3)),
        ok(c("64 stop strings of 1024", stop=[f"{i:04d}" * 256 for i in range(64)])),
        ok(c("special tokens in prompt", prompt="<|im_start|>user\n<image><|im_end|><|endoftext|>")),
        ok(c("control characters", prompt="\x00\x01\x1b[0m\u202e\ufeff")),
        ok(c("token ids at the vocabulary's edges", prompt=[0, vocab - 1, 2])),
        ok(c("escaped surrogate pair", prompt="\ud83d\ude00")),
        ok(h("content parts", messages=[{"role": "user", "content": [{"type": "text", "text": "a"},
                                                                      {"type": "text", "text": "b"}]}])),
        ok(h("max_completion_tokens wins", max_tokens=10_000, max_completion_tokens=2)),
        ok(c("informational and unknown fields", user="u", metadata={"k": "v"}, store=False, zz_unknown=[1])),
        ok(c("echo with logprobs", echo=True, logprobs=1, prompt=["a b", "c"], max_tokens=1)),
        c("suffix refused", suffix="x"),
        c("NaN temperature", temperature=NAN), c("Infinity top_p", top_p=INF), c("-Infinity seed", seed=-INF),
        c("NaN repetition_penalty", repetition_penalty=NAN), c("Infinity repetition_penalty", repetition_penalty=INF),
        c("max_tokens 2^64", max_tokens=2**64), c("max_tokens -2^64", max_tokens=-2**64),
        c("min_tokens 2^64", min_tokens=2**64), c("n 2^64", n=2**64), c("logprobs 2^64", logprobs=2**64),
        c("stop id 2^64", stop_token_ids=[2**64]), c("top_k -2^64", top_k=-2**64),
        c("lone surrogate in stop", stop=["\ud800"]), c("lone surrogate prompt", prompt="\udfff"),
        c("surrogates reversed", prompt="\udc00\ud800"),
        h("image to the text model", messages=[{"role": "user", "content": [
            {"type": "text", "text": "what is this?"},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}]}]),
        h("only an image part", messages=[{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]),
        h("image_url with a lone surrogate", messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "\ud800"}}]}]),
        h("top_logprobs without logprobs", top_logprobs=2), h("top_logprobs 21", logprobs=True, top_logprobs=21),
        h("no messages", messages=[]), h("4097 messages", messages=user * 4097),
        h("role too long", messages=[{"role": "r" * 100_000, "content": "hi"}]),
        h("name too long", messages=[{"role": "user", "content": "hi", "name": "n" * 100_000}]),
        h("chat max_tokens null", max_tokens=None, max_completion_tokens=2),
        c("best_of 2, n 1", best_of=2), c("model unknown", model="nope"), c("model null", model=None),
        ok(c("model by name", model=model)),
        ok(c("prompt list of lists", prompt=[[1, 2], [3]])), ok(c("prompt list of strings", prompt=["a", "b"])),
        c("prompt too long (ids)", prompt=list(range(9000))), c("prompt too long", prompt="hello " * 9000),
        c("prompt huge (1 MB)", prompt="lorem ipsum " * 90_000),
        Case("JSON NaN literal", content=b'{"prompt":"x","max_tokens":NaN}'),
        Case("JSON Infinity literal", content=b'{"prompt":"x","max_tokens":2,"top_p":Infinity}'),
        Case("deep nesting", content=b"[" * 100_000), Case("empty body", content=b""),
        Case("invalid UTF-8", content=b'{"prompt":"\xff\xfe","max_tokens":2}'),
        Case("CESU-8 surrogate", content=b'{"prompt":"\xed\xa0\x80","max_tokens":2}'),
        Case("not an object", content=b"[1, 2, 3]"), Case("text/plain", body={"prompt": "x"},
                                                           headers={"content-type": "text/plain"}),
        Case("route GET", method="GET"), Case("route 404", path="/v1/nope"),
        # Near --max-request-body-mb: parsed on the event loop, these stalled every stream
        # 14 s and 90 s; the string one is parsed (strings are cheap) and answered.
        Case("60 MB of small ints in an unknown field",
             content=b'{"prompt":"hi","max_tokens":2,"junk":[' + b"0," * 30_000_000 + b"0]}"),
        Case("a prompt of 30 M token ids", content=b'{"max_tokens":2,"prompt":[' + b"1," * 30_000_000 + b"1]}"),
        Case("60 MB string in an unknown field",
             content=b'{"prompt":"hi","max_tokens":2,"junk":"' + b"a" * 60_000_000 + b'"}'),
    ]
    return cases


# --------------------------------------------------------------------------- checking

def _strict_json(text: str):
    """json.loads that refuses NaN/Infinity: a strict client cannot read them."""
    def bad_constant(name):
        raise ValueError(f"non-standard JSON constant {name}")
    return json.loads(text, parse_constant=bad_constant)


def _int(value) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def check_error_body(resp: httpx.Response) -> str | None:
    try:
        err = _strict_json(resp.text)["error"]
    except Exception as exc:  # noqa: BLE001 - any shape problem is the finding
        return f"error body is not OpenAI's: {exc!r}: {resp.text[:200]!r}"
    if not isinstance(err, dict) or not {"message", "type", "param", "code"} <= set(err):
        return f"error object lacks fields: {err!r}"
    if not isinstance(err["message"], str) or not err["message"]:
        return f"error without a message: {err!r}"
    if resp.status_code == 400 and err["type"] != "invalid_request_error":
        return f"400 of type {err['type']!r}"
    if err["param"] is not None and not isinstance(err["param"], str):
        return f"param is not a string: {err['param']!r}"
    return None


def _num_prompts(body: dict) -> int:
    """Prompts of a valid request: a completions batch's, else one."""
    prompt = body.get("prompt")
    return len(prompt) if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)) else 1


def check_completion(case: Case, obj: dict, chat: bool) -> str | None:
    body = case.body if isinstance(case.body, dict) else {}
    if obj.get("object") != ("chat.completion" if chat else "text_completion"):
        return f"object {obj.get('object')!r}"
    choices = obj.get("choices")
    if not isinstance(choices, list) or [c.get("index") for c in choices] != list(range(len(choices))) or not choices:
        return f"choices {choices!r:.200}"
    n = _int(body.get("n"))
    if n is not None and len(choices) != n * _num_prompts(body):
        return f"{len(choices)} choices for n={n} and {_num_prompts(body)} prompts"
    for c in choices:
        text = c["message"]["content"] if chat else c.get("text")
        if not isinstance(text, str):
            return f"choice text {text!r}"
        if chat and c["message"].get("role") != "assistant":
            return f"message role {c['message'].get('role')!r}"
        if c.get("finish_reason") not in ("stop", "length"):
            return f"finish_reason {c.get('finish_reason')!r}"
    u = obj.get("usage") or {}
    if not (isinstance(u.get("prompt_tokens"), int) and u["prompt_tokens"] >= 1 and
            isinstance(u.get("completion_tokens"), int) and u["completion_tokens"] >= 0 and
            u.get("total_tokens") == u["prompt_tokens"] + u["completion_tokens"]):
        return f"usage {u!r}"
    limit = _int(body.get("max_completion_tokens")) if chat else None
    limit = limit if limit is not None else _int(body.get("max_tokens"))
    # best_of's unanswered choices count too (OpenAI bills them).
    generated = _num_prompts(body) * max(_int(body.get("best_of")) or 1, n or 1)
    if limit is not None and u["completion_tokens"] > limit * generated:
        return f"{u['completion_tokens']} completion tokens for max_tokens={limit} x {generated}"
    return None


def check_stream(case: Case, resp: httpx.Response, chat: bool) -> tuple[str | None, dict | None]:
    """(problem, the error event if the stream ended with one)."""
    if not resp.headers.get("content-type", "").startswith("text/event-stream"):
        return f"stream with content-type {resp.headers.get('content-type')!r}", None
    data = [line[6:] for line in resp.text.split("\n") if line.startswith("data: ")]
    if not data or data[-1] != "[DONE]":
        return f"stream does not end with [DONE]: {resp.text[-300:]!r}", None
    if data.count("[DONE]") != 1:
        return "[DONE] more than once", None
    ids, finished, error = set(), Counter(), None
    for i, raw in enumerate(data[:-1]):
        if error is not None:
            return "events after an error event", error
        try:
            event = _strict_json(raw)
        except ValueError as exc:
            return f"event is not JSON: {exc}: {raw[:200]!r}", None
        if "error" in event:
            error = event["error"]
            if not isinstance(error, dict) or not error.get("message"):
                return f"error event without a message: {event!r}", error
            continue
        ids.add(event.get("id"))
        if event.get("object") != ("chat.completion.chunk" if chat else "text_completion"):
            return f"chunk object {event.get('object')!r}", None
        for c in event.get("choices", []):
            if c.get("finish_reason") is not None:
                if c["finish_reason"] not in ("stop", "length"):
                    return f"finish_reason {c['finish_reason']!r}", None
                finished[c["index"]] += 1
    if len(ids) > 1:
        return f"chunks with {len(ids)} ids", error
    if error is None:
        body = case.body if isinstance(case.body, dict) else {}
        n = (_int(body.get("n")) or 1) * _num_prompts(body)
        if sorted(finished) != list(range(n)) or any(v != 1 for v in finished.values()):
            return f"finish reasons per choice {dict(finished)} for n={n}", None
    return None, error


def judge(case: Case, resp: httpx.Response) -> str | None:
    """What is wrong with ``resp`` as the answer to ``case``, or None."""
    status = resp.status_code
    if status >= 500:
        return f"HTTP {status}: {resp.text[:300]!r}"
    api = case.method == "POST" and case.path in ("/v1/completions", "/v1/chat/completions")
    if case.must_succeed and status != 200:
        return f"a valid request got HTTP {status}: {resp.text[:300]!r}"
    if 300 <= status < 400:
        return None if status == 307 and case.path.endswith("/") and resp.headers.get("location") else \
            f"HTTP {status} redirect to {resp.headers.get('location')!r}"
    if 400 <= status < 500:
        if status not in CLIENT_ERRORS:
            return f"HTTP {status} is not a documented client error: {resp.text[:200]!r}"
        return None if case.method == "HEAD" else check_error_body(resp)
    if status != 200:
        return f"HTTP {status}"
    if not api:
        return None
    chat = case.path == "/v1/chat/completions"
    if resp.headers.get("content-type", "").startswith("text/event-stream"):
        problem, error = check_stream(case, resp, chat)
        if problem:
            return problem
        if error is not None:
            # A 4xx-class failure is the request's (a worker refused it), anything else the server's.
            if error.get("type") != "invalid_request_error" or case.must_succeed:
                return f"stream failed: {error!r}"
        return None
    try:
        obj = _strict_json(resp.text)
    except ValueError as exc:
        return f"200 body is not JSON: {exc}: {resp.text[:200]!r}"
    return check_completion(case, obj, chat)


# --------------------------------------------------------------------- control stream

def itl_gaps(stream: Stream) -> list[float]:
    times = [t for t, _ in stream.events]
    return [b - a for a, b in zip(times, times[1:])][SKIP_GAPS:]


def p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(0.99 * len(ordered)) - 1)]


def run_control(url: str) -> tuple[Stream, list[float]]:
    s = Stream(url, CONTROL_PROMPT, CONTROL_TOKENS)
    s.run()  # on this thread
    assert s.failure is None and s.error is None, (s.failure, s.error)
    finish = s.events[-1][1]["choices"][0]["finish_reason"]
    assert finish == "length" and len(s.text) > 0, s.events[-1:]
    return s, itl_gaps(s)


class ControlLoop(threading.Thread):
    """Control streams back to back until ``stop`` is set; every one must complete."""

    def __init__(self, url: str):
        super().__init__(daemon=True)
        self.url, self.stop = url, threading.Event()
        self.gaps: list[float] = []
        self.gap_ends: list[tuple[float, float]] = []  # (time the gap ended, gap)
        self.texts: list[str] = []
        self.problems: list[str] = []

    def run(self) -> None:
        while not self.stop.is_set():
            s = Stream(self.url, CONTROL_PROMPT, CONTROL_TOKENS)
            s.run()
            if s.failure is not None or s.error is not None:
                self.problems.append(f"control stream failed: {s.failure!r} {s.error!r}")
                continue
            last = s.events[-1][1]["choices"][0] if s.events and s.events[-1][1].get("choices") else {}
            if last.get("finish_reason") != "length":
                self.problems.append(f"control stream ended with {last!r}")
            self.gaps += itl_gaps(s)
            times = [t for t, _ in s.events][SKIP_GAPS:]
            self.gap_ends += [(b, b - a) for a, b in zip(times, times[1:])]
            self.texts.append(s.text)


# ------------------------------------------------------------------------------- test

def case_kind(case: Case) -> str:
    if case.method != "POST" or case.path not in API_PATHS:
        return "route"
    if case.content is not None or case.headers != JSON:
        return "raw"
    return "chat" if case.path == API_PATHS[1] else "completion"


class Fuzzer:
    """Sends cases from :data:`FUZZ_CLIENTS` threads (each with its own connection) and
    tallies what came back; :meth:`submit` blocks while that many are in flight."""

    def __init__(self, dep):
        self.dep = dep
        self.lock = threading.Lock()
        self.slots = threading.Semaphore(FUZZ_CLIENTS)
        self.local = threading.local()
        self.clients: list[httpx.Client] = []
        self.threads: list[threading.Thread] = []
        self.cases = 0
        self.statuses, self.kinds, self.seconds = Counter(), Counter(), Counter()
        self.stream_errors = 0
        self.failures: list[tuple[str, str]] = []
        self.slowest: tuple[float, str] = (0.0, "")
        self.spans: list[tuple[float, float, str]] = []  # (start, end, case) of every case
        self.t0 = time.monotonic()

    def submit(self, case: Case) -> None:
        self.slots.acquire()
        self.cases += 1
        if self.cases % PROGRESS_EVERY == 0:
            print(f"[{self.dep.mode}] {self.cases} cases, {time.monotonic() - self.t0:.0f} s", flush=True)
        t = threading.Thread(target=self._run, args=(case,), daemon=True)
        self.threads = [x for x in self.threads if x.is_alive()] + [t]
        t.start()
        if self.cases % HEALTH_EVERY == 0:
            down = _up(self.dep)
            if down:
                self.fail(f"after this case: {down}", case)
                wait_for(lambda: not _up(self.dep), 120, "the workers back up")

    def drain(self) -> None:
        for t in self.threads:
            t.join(CASE_TIMEOUT_S * 2)
        for c in self.clients:
            c.close()

    def fail(self, problem: str, case: Case) -> None:
        with self.lock:
            self.failures.append((problem, case.short()))

    def _client(self) -> httpx.Client:
        client = getattr(self.local, "client", None)
        if client is None:
            client = self.local.client = httpx.Client(base_url=self.dep.url, timeout=CASE_TIMEOUT_S)
            with self.lock:
                self.clients.append(client)
        return client

    def _run(self, case: Case) -> None:
        try:
            self._send(case)
        except Exception as exc:  # noqa: BLE001 - a bug of this test, reported as a failure
            self.fail(f"the checker failed: {exc!r}", case)
        finally:
            self.slots.release()

    def _send(self, case: Case) -> None:
        kind, payload = case_kind(case), case.payload()
        t0 = time.monotonic()
        try:
            resp = self._client().request(case.method, case.path, content=payload, headers=case.headers)
        except httpx.HTTPError as exc:  # closed without a response, or no answer in time
            with self.lock:
                self.statuses["none"] += 1
            self.fail(f"no response: {exc!r}", case)
            return
        t1 = time.monotonic()
        problem = judge(case, resp)
        with self.lock:
            self.kinds[kind] += 1
            self.statuses[resp.status_code] += 1
            self.seconds[f"{kind} {resp.status_code // 100}xx"] += t1 - t0
            self.spans.append((t0, t1, f"HTTP {resp.status_code} in {t1 - t0:.2f} s: {case.short(150)}"))
            if t1 - t0 > self.slowest[0]:
                self.slowest = (t1 - t0, f"HTTP {resp.status_code}: {case.short(200)}")
            if resp.headers.get("content-type", "").startswith("text/event-stream") and \
                    '"error"' in resp.text[-2000:]:
                self.stream_errors += 1
        if problem:
            self.fail(problem, case)


def _up(dep) -> list[str]:
    """Problems with /health: a worker not up, or the router not ready."""
    health = dep.health()
    bad = [f"{w['worker_id']} is {w['state']} ({w.get('reason')})" for w in health["workers"] if w["state"] != "up"]
    return bad + ([f"/health status {health['status']}"] if health["status"] != "ok" else [])


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.0f} ms"


@pytest.mark.timeout(1800)  # ~4 min per deployment on 2 quiet cores; far more when they are shared
def test_api_fuzz(server, tokenizer):
    dep = server
    wait_for(lambda: not _up(dep), 120, "every worker up")
    model = httpx.get(dep.url + "/v1/models", timeout=10).json()["data"][0]["id"]
    vocab = len(tokenizer)
    pids = {w["worker_id"]: dep.worker_pid(w["worker_id"]) for w in dep.health()["workers"]}
    log_start = len(dep.log_path.read_bytes())

    # The control stream alone.
    alone_gaps, reference = [], None
    for _ in range(CONTROL_RUNS):
        s, gaps = run_control(dep.url)
        alone_gaps += gaps
        reference = reference or s.text

    fuzzer = Fuzzer(dep)

    @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
              phases=(Phase.explicit, Phase.generate), print_blob=False,
              suppress_health_check=list(HealthCheck))
    @given(all_cases(Fields(model, vocab)))
    def fuzz(case: Case) -> None:
        fuzzer.submit(case)

    loop = ControlLoop(dep.url)
    t0 = time.monotonic()
    loop.start()
    try:
        wait_for(lambda: loop.gaps or loop.problems, 120, "the control loop's first stream")
        for case in corpus(model, vocab):
            fuzzer.submit(case)
        fuzz()
    finally:
        fuzzer.drain()
        loop.stop.set()
        loop.join(180)
    took = time.monotonic() - t0

    # Afterwards: every worker up (the same processes), nothing in flight, no KV held.
    wait_for(lambda: dep.health()["requests_in_flight"] == 0, 30, "no request in flight")
    used = wait_all_free(dep.url, timeout=30)
    down = _up(dep)
    restarted = [w for w, pid in pids.items() if dep.worker_pid(w) != pid]
    log_new = dep.log_path.read_bytes()[log_start:].decode(errors="replace")
    log_failures = [line for line in log_new.splitlines() if any(m in line for m in LOG_FAILURES)]

    alone_p99, fuzz_p99 = p99(alone_gaps), p99(loop.gaps)
    print(f"\n[{dep.mode}] {fuzzer.cases} API cases in {took:.1f} s ({dict(fuzzer.kinds)}); statuses "
          f"{dict(sorted(fuzzer.statuses.items(), key=str))}; stream error events {fuzzer.stream_errors}")
    print(f"[{dep.mode}] seconds per kind: { {k: round(v, 1) for k, v in fuzzer.seconds.most_common()} }; "
          f"slowest case {fuzzer.slowest[0]:.2f} s: {fuzzer.slowest[1]}")
    print(f"[{dep.mode}] control ITL alone: p50 {_ms(sorted(alone_gaps)[len(alone_gaps) // 2])}, p99 "
          f"{_ms(alone_p99)}, max {_ms(max(alone_gaps))} ({len(alone_gaps)} gaps); during the fuzz: "
          f"{len(loop.texts)} streams, p50 {_ms(sorted(loop.gaps)[len(loop.gaps) // 2])}, p99 {_ms(fuzz_p99)}, "
          f"max {_ms(max(loop.gaps))} ({len(loop.gaps)} gaps), p99 ratio {fuzz_p99 / alone_p99:.2f}; "
          f"{sum(t == reference for t in loop.texts)}/{len(loop.texts)} gave the text of the run alone; "
          f"KV blocks in use after: {used}")
    # The control stream's longest gaps, with the cases that were in flight then.
    for gap_end, gap in sorted(loop.gap_ends, key=lambda g: -g[1])[:3]:
        during = [what for a, b, what in fuzzer.spans if a < gap_end and b > gap_end - gap]
        print(f"[{dep.mode}] control gap {gap:.2f} s; cases in flight: {during[:FUZZ_CLIENTS] or 'none'}")
    for problem, case in fuzzer.failures[:40]:
        print(f"FAIL {problem}\n     {case}")
    if log_failures:  # the server's tracebacks (pytest deletes its old temp dirs, and the log)
        lines = log_new.splitlines()
        for i in [i for i, line in enumerate(lines) if any(m in line for m in LOG_FAILURES)][:3]:
            print("LOG  " + "\n     ".join(line[:300] for line in lines[max(0, i - 2):i + 60]
                                            if "/.venv/" not in line))

    assert fuzzer.cases >= MIN_CASES, f"only {fuzzer.cases} cases"
    assert not fuzzer.failures, f"{len(fuzzer.failures)} failed cases, first: {fuzzer.failures[0]}"
    assert not down, down
    assert not restarted, f"restarted: {restarted}"
    assert not loop.problems, loop.problems[:5]
    assert not log_failures, log_failures[:5]
    assert max(loop.gaps) < MAX_GAP_S, f"the control stream stalled {max(loop.gaps):.2f} s"
    assert fuzz_p99 <= ITL_P99_RATIO * alone_p99 + ITL_SLACK_S, \
        f"control ITL p99 {_ms(fuzz_p99)} during the fuzz, {_ms(alone_p99)} alone"
