"""The rest of the OpenAI request surface against real
colocated and 1P1D deployments, with the ``openai`` SDK and httpx:

* completions ``echo`` + ``logprobs`` as lm-evaluation-harness sends them for
  log-likelihood tasks (a batch of token-id prompts, ``max_tokens`` 1, ``logprobs`` 1): the
  prompt's tokens and logprobs, the first null, equal to the model's log-softmax computed
  in this process within 1e-4, and equal between colocated and PD; ``max_tokens`` 0;
  streamed echo; vLLM's ``prompt_logprobs`` on completions and chat;
* batched prompts (choice index = prompt x n + choice, usage summed), ``best_of`` (the
  candidates are replayed alone, by their seeds, to check the one with the highest mean
  token logprob is answered);
* vLLM's chat extras, ``truncate_prompt_tokens``, ``return_tokens_as_token_ids``,
  ``continuous_usage_stats``;
* every refused field gets a 400 naming it, informational fields are accepted, an unknown
  field is logged once; error bodies (streamed too) have a string or null ``code``.

Plus in-process checks of the engine's prompt logprobs (prefix cache, chunked prefill)
and of the pieces (field policy, formatting, ranking).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from types import SimpleNamespace

import httpx
import openai
import pytest
import torch

from epdserve.engine.engine import EngineConfig, LLMEngine
from epdserve.engine.prompt_logprobs import check_size
from epdserve.engine.request import SamplingParams
from epdserve.model.llama import AttentionMetadata, PrefillSeq
from epdserve.model.tokenizer import chat_prompt_ids
from epdserve.serving.api import fields
from epdserve.serving.api import openai as api
from epdserve.serving import protocol as P
from epdserve.serving.api.logprobs import LogprobsFormatter, prompt_entries, vllm_prompt_logprobs
from epdserve.serving.api.responses import SSE_DONE
from epdserve.serving.router.events import WorkerFailed
from epdserve.serving.router.answer import Answer, best_choices
from epdserve.serving.router.choices import Choice
from epdserve.serving.router.paths import new_flow
from epdserve.serving.api.errors import APIError

pytestmark = pytest.mark.api

TOL = 1e-4
TEXTS = ["The capital of France is Paris, and the capital of Italy is",
         "Water boils at a temperature of one hundred degrees",
         "Once upon a time there was"]
CHAT = [{"role": "user", "content": "Name a colour."}]


# ----------------------------------------------------------------------- references

@pytest.fixture(scope="module")
def engine(model_info):
    """An engine on the servers' model and settings (float32, quantized weights)."""
    return LLMEngine(str(model_info.path), EngineConfig(kv_cache_memory_mb=64))


def reference_logprobs(model, ids: list[int]) -> torch.Tensor:
    """log-softmax ``[len(ids), vocab]`` of the model's logits at every position of ``ids``,
    from one forward pass over the whole prompt in a fresh cache."""
    n, block = len(ids), 16
    blocks = -(-n // block)
    meta = AttentionMetadata(positions=torch.arange(n), slot_mapping=torch.arange(n),
                             prefills=[PrefillSeq(0, n, n, torch.arange(blocks))],
                             decode_rows=torch.zeros(0, dtype=torch.long),
                             decode_block_tables=torch.zeros(0, 0, dtype=torch.long),
                             decode_ctx_lens=torch.zeros(0, dtype=torch.long), logits_rows=torch.arange(n))
    return torch.log_softmax(model.forward(torch.tensor(ids), meta, model.allocate_kv_cache(blocks, block)), -1)


def run_alone(engine: LLMEngine, request_id: str, ids: list[int], sampling: SamplingParams) -> list:
    engine.add_request(request_id, ids, sampling)
    outs = []
    for _ in range(10 * len(ids) + 100):
        if not engine.has_unfinished():
            return outs
        outs += engine.step()
    raise AssertionError("the engine did not finish")


# ------------------------------------------------------------------------ in-process

def test_engine_prompt_logprobs_match_the_model_with_cache_and_chunks(model_info, tokenizer, engine):
    ids = tokenizer(TEXTS[0] * 3).input_ids
    ref = reference_logprobs(engine.model, ids)
    first = run_alone(engine, "a", ids, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=3))[0]
    got = first.prompt_logprobs
    assert len(got) == len(ids) - 1
    for p, (lp, rank, top) in enumerate(got):
        row = ref[p]
        assert abs(lp - row[ids[p + 1]].item()) < TOL
        assert rank == int((row > row[ids[p + 1]]).sum()) + 1
        assert [i for i, _ in top] == row.topk(3).indices.tolist()
    # The prompt is in the prefix cache now: a request asking for prompt logprobs skips it,
    # one that does not uses it.
    again = run_alone(engine, "b", ids, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=3))[0]
    assert again.num_cached_tokens == 0 and again.prompt_logprobs == got
    plain = run_alone(engine, "c", ids, SamplingParams(max_tokens=1, temperature=0))[0]
    assert plain.num_cached_tokens > 0 and plain.prompt_logprobs is None
    chunked = LLMEngine(str(model_info.path), EngineConfig(kv_cache_memory_mb=64, enable_chunked_prefill=True,
                                                           max_num_batched_tokens=7))
    parts = run_alone(chunked, "d", ids, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=3))[0]
    assert [r for _, r, _ in parts.prompt_logprobs] == [r for _, r, _ in got]
    assert max(abs(a[0] - b[0]) for a, b in zip(parts.prompt_logprobs, got)) < TOL


def test_prompt_logprobs_are_bounded(engine):
    """This model's context (8,192 tokens x 21 entries) stays under the bound, which a
    longer context can pass."""
    check_size(8192, 20)
    with pytest.raises(ValueError, match="prompt_logprobs"):
        engine.prompt_logprobs.start("big", 20_000, 20)
    assert "big" not in engine.prompt_logprobs.pending


def test_field_policy_refuses_logs_once_and_accepts_neutral_values(caplog):
    for name, (neutral, _) in fields.REFUSED.items():
        body = api.CompletionRequest(prompt="x", **{name: "not neutral"})
        with pytest.raises(APIError) as exc:
            fields.check(body)
        assert (exc.value.param, exc.value.code, exc.value.status) == (name, "unsupported_parameter", 400)
        fields.check(api.CompletionRequest(prompt="x", **{name: neutral[-1]}))
    with pytest.raises(APIError):  # true is not 1, nor false 0
        fields.check(api.CompletionRequest(prompt="x", priority=False, use_beam_search=0))
    fields.check(api.CompletionRequest(prompt="x", **{k: "v" for k in fields.INFORMATIONAL}))
    with caplog.at_level(logging.WARNING, "epdserve.api"):
        for _ in range(3):
            fields.check(api.CompletionRequest(prompt="x", zz_unit_unknown=1))
    assert sum("zz_unit_unknown" in r.getMessage() for r in caplog.records) == 1
    caplog.clear()
    with caplog.at_level(logging.WARNING, "epdserve.api"):
        for i in range(2 * fields.MAX_LOGGED_NAMES):
            fields.log_unknown(f"zz_flood_{i}")
    assert len(fields._logged) <= fields.MAX_LOGGED_NAMES + 1
    assert len(caplog.records) < fields.MAX_LOGGED_NAMES + 2


def test_error_code_is_a_string_or_null():
    with pytest.raises(TypeError):
        APIError("x", code=400)
    assert APIError("x", status=503).body()["error"]["code"] is None
    assert WorkerFailed("gone", 503).api_error().body() == {
        "error": {"message": "gone", "type": "service_unavailable", "param": None, "code": None}}


def test_pd_flow_keeps_the_prefill_workers_prompt_logprobs_and_spares_the_decode_worker():
    """In process (test_router_flows' fakes): the prefill worker's first output brings the
    prompt logprobs, which the flow keeps; the decode worker's request does not ask for them."""
    from test_router_flows import KV, Reader, Setup, run

    s = Setup("pd", "prefill-0", "decode-0")
    scored = [(-1.5, 3, [(4, -0.5)]), (-0.25, 1, [(5, -0.25)])]

    async def go():
        flow = new_flow(s.registry, s.config, "r1", [1, 2, 3], SamplingParams(max_tokens=3, prompt_logprobs=1),
                        s.clock())
        flow.start()
        reader = Reader(flow)
        await reader.step()
        s.registry.on_message(P.Output(worker_id="prefill-0", request_id="r1", token_ids=[9], kv=KV,
                                       prompt_logprobs=scored), s.clock())
        await reader.step()
        await reader.step()  # the hand-off
        assert flow.prompt_logprobs == scored
        assert s.port.of("prefill-0", P.AddRequest)[0].sampling.prompt_logprobs == 1
        assert s.port.of("decode-0", P.AddRequest)[0].sampling.prompt_logprobs is None
        s.output("decode-0", (10,), finished=True)
        await reader.drain()
        assert reader.error is None
        flow.close()

    run(go())


def test_concurrency_limit_503_has_the_error_body():
    """uvicorn's --limit-concurrency answer: 503 with OpenAI's body, not plain text."""
    import socket
    import threading

    import uvicorn
    from fastapi import FastAPI

    from epdserve.serving.router.http_guard import HttpLimits, uvicorn_config

    app = FastAPI()
    app.get("/ok")(lambda: {"ok": True})
    limits = HttpLimits(http_header_timeout=5.0, http_body_timeout=5.0, max_request_body_mb=1, limit_concurrency=2)
    server = uvicorn.Server(uvicorn_config(app, "127.0.0.1", 0, limits))
    thread = threading.Thread(target=lambda: asyncio.run(server.serve()), daemon=True)
    thread.start()
    try:
        for _ in range(200):
            if server.started:
                break
            time.sleep(0.05)
        port = server.servers[0].sockets[0].getsockname()[1]
        with socket.create_connection(("127.0.0.1", port)), socket.create_connection(("127.0.0.1", port)):
            time.sleep(0.2)  # both connections counted: the next request is past the limit
            r = httpx.get(f"http://127.0.0.1:{port}/ok", timeout=10)
        assert r.status_code == 503, r.text
        assert r.json()["error"] == {"message": r.json()["error"]["message"], "type": "service_unavailable",
                                     "param": None, "code": None}
    finally:
        server.should_exit = True
        thread.join(10)


def test_logprob_shapes():
    text = {1: "a", 2: "bb", 3: "c"}.get
    entries = prompt_entries([1, 2, 3], [[-1.0, 2, [[3, -0.5]]], [-2.0, 1, [[3, -2.0]]]])
    assert entries == [(1, None, None), (2, -1.0, [[3, -0.5]]), (3, -2.0, [[3, -2.0]])]
    legacy = LogprobsFormatter("completion", text)(entries)
    assert legacy == {"tokens": ["a", "bb", "c"], "token_logprobs": [None, -1.0, -2.0],
                      "top_logprobs": [None, {"c": -0.5, "bb": -1.0}, {"c": -2.0}], "text_offset": [0, 1, 3]}
    assert vllm_prompt_logprobs([1, 2, 3], [(-1.0, 2, [(3, -0.5)]), (-2.0, 1, [(3, -2.0)])], text) == [
        None, {"2": {"logprob": -1.0, "rank": 2, "decoded_token": "bb"},
               "3": {"logprob": -0.5, "rank": 1, "decoded_token": "c"}},
        {"3": {"logprob": -2.0, "rank": 1, "decoded_token": "c"}}]


def test_best_choices_ranks_by_mean_token_logprob():
    def choice(i, prompt, total, tokens):
        c = Choice(i, SimpleNamespace(output_tokens=tokens), None, None, prompt)
        c.logprob_sum = total
        return c
    cs = [choice(0, 0, -4.0, 4), choice(1, 0, -1.0, 2), choice(2, 0, -0.6, 1),
          choice(3, 1, -3.0, 3), choice(4, 1, -3.0, 3), choice(5, 1, -9.0, 3)]
    assert [(i, c.index) for i, c in best_choices(cs, 2)] == [(0, 1), (1, 2), (2, 3), (3, 4)]
    assert [(i, c.index) for i, c in best_choices(cs, 3)] == [(i, i) for i in range(6)]


class _FailingFlow:
    """A flow whose worker fails after the stream started."""

    def __init__(self):
        self.clock, self.itls_s, self.output_tokens, self.prompt_ids = time.monotonic, [], 0, [1]
        self.finish_reason = self.error = None

    async def tokens(self):
        yield [5], None, None
        raise WorkerFailed("worker w1 died (killed)", 503)

    def fail(self, exc):
        self.error = str(exc)


def test_streamed_error_event_has_the_error_body(tokenizer):
    from epdserve.serving.api.detokenizer import TextStream

    request_log = SimpleNamespace(ended=lambda flow: None)
    choices = [Choice(0, _FailingFlow(), TextStream(tokenizer, [1], []), None)]
    body = api.CompletionRequest(prompt="x", stream=True)

    async def collect():
        return [e async for e in Answer("cmpl-1", choices, body, "completion", "m", request_log, str).events()]

    events = asyncio.run(collect())
    assert events[-1] == SSE_DONE
    error = json.loads(events[-2].removeprefix("data: "))
    assert error == {"error": {"message": "worker w1 died (killed)", "type": "service_unavailable",
                               "param": None, "code": None}}


# --------------------------------------------------------------------------- servers

def post(server, path: str, body: dict, timeout: float = 300) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=timeout)


def model_name(server) -> str:
    return server.openai().models.list().data[0].id


def test_lm_eval_loglikelihood_payload(server, tokenizer, engine):
    """lm-evaluation-harness's local-completions payload: the prompt's logprobs equal the
    model's, and its parsing (``token_logprobs[ctxlen:-1]``, greedy check) works."""
    prompts = [tokenizer(t).input_ids for t in TEXTS]
    body = {"model": model_name(server), "prompt": prompts, "temperature": 0, "max_tokens": 1, "logprobs": 1,
            "seed": 1234, "echo": True}
    r = post(server, "/v1/completions", body)
    assert r.status_code == 200, r.text
    out = r.json()
    assert [c["index"] for c in out["choices"]] == [0, 1, 2]
    assert out["usage"]["prompt_tokens"] == sum(map(len, prompts)) and out["usage"]["completion_tokens"] == 3
    for ids, choice in zip(prompts, sorted(out["choices"], key=lambda c: c["index"])):
        lp = choice["logprobs"]
        assert len(lp["tokens"]) == len(ids) + 1 and lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        assert choice["text"].startswith(tokenizer.decode(ids))
        ref = reference_logprobs(engine.model, ids)
        for p in range(1, len(ids)):
            assert abs(lp["token_logprobs"][p] - ref[p - 1, ids[p]].item()) < TOL, p
            top = lp["top_logprobs"][p]
            assert lp["tokens"][p] in top and len(top) <= 2
            assert max(top.values()) == pytest.approx(ref[p - 1].max().item(), abs=TOL)
        ctxlen = len(ids) - 2  # as lm-eval scores a continuation: the last two prompt tokens
        assert math.isfinite(sum(lp["token_logprobs"][ctxlen:-1]))
        assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])
        assert choice["prompt_logprobs"][0] is None and len(choice["prompt_logprobs"]) == len(ids)


def test_echo_logprobs_equal_in_colocated_and_pd(colocated_server, pd_server, tokenizer):
    body = {"prompt": TEXTS, "echo": True, "logprobs": 2, "max_tokens": 1, "temperature": 0}
    a, b = (post(s, "/v1/completions", body).json()["choices"] for s in (colocated_server, pd_server))
    for x, y in zip(a, b):
        assert x["logprobs"]["tokens"] == y["logprobs"]["tokens"] and x["text"] == y["text"]
        assert all(p is q is None or abs(p - q) < TOL
                   for p, q in zip(x["logprobs"]["token_logprobs"], y["logprobs"]["token_logprobs"]))


def test_echo_max_tokens_zero_and_streamed_echo(server, tokenizer):
    client = server.openai()
    model = model_name(server)
    resp = client.completions.create(model=model, prompt=TEXTS[1], echo=True, logprobs=0, max_tokens=0)
    choice = resp.choices[0]
    ids = tokenizer(TEXTS[1]).input_ids
    assert choice.text == TEXTS[1] and resp.usage.completion_tokens == 0 and choice.finish_reason in ("length", "stop")
    assert len(choice.logprobs.tokens) == len(ids) and choice.logprobs.token_logprobs[0] is None
    full = client.completions.create(model=model, prompt=TEXTS[1], echo=True, logprobs=0, max_tokens=3,
                                     temperature=0, extra_body={"ignore_eos": True})
    chunks = list(client.completions.create(model=model, prompt=TEXTS[1], echo=True, logprobs=0, max_tokens=3,
                                            temperature=0, stream=True, extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].text.startswith(TEXTS[1])
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
    streamed = [t for c in chunks if c.choices for t in c.choices[0].logprobs.token_logprobs]
    assert streamed[0] is None and len(streamed) == len(ids) + 3
    assert all(abs(s - f) < TOL for s, f in zip(streamed[1:], full.choices[0].logprobs.token_logprobs[1:]))


def test_prompt_logprobs_extra_on_completions_and_chat(server, tokenizer):
    r = post(server, "/v1/completions", {"prompt": TEXTS[2], "max_tokens": 2, "prompt_logprobs": 2,
                                         "temperature": 0})
    assert r.status_code == 200, r.text
    plp = r.json()["choices"][0]["prompt_logprobs"]
    ids = tokenizer(TEXTS[2]).input_ids
    assert plp[0] is None and len(plp) == len(ids)
    for token, entry in zip(ids[1:], plp[1:]):
        assert str(token) in entry and 2 <= len(entry) <= 3
        assert sorted(e["rank"] for e in entry.values())[:2] == [1, 2]
    r = post(server, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 2, "prompt_logprobs": 0})
    assert r.status_code == 200, r.text
    assert len(r.json()["prompt_logprobs"]) == len(chat_prompt_ids(tokenizer, CHAT))


def test_batched_prompts_indices_and_usage(server, tokenizer):
    client = server.openai()
    model = model_name(server)
    params = dict(model=model, max_tokens=3, temperature=0, extra_body={"ignore_eos": True})
    batch = client.completions.create(prompt=TEXTS[:2], n=2, **params)
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    for p, text in enumerate(TEXTS[:2]):
        alone = client.completions.create(prompt=text, **params)
        assert batch.choices[2 * p].text == batch.choices[2 * p + 1].text == alone.choices[0].text
    assert batch.usage.prompt_tokens == sum(len(tokenizer(t).input_ids) for t in TEXTS[:2])
    assert batch.usage.completion_tokens == 12
    chunks = list(client.completions.create(prompt=TEXTS[:2], stream=True, stream_options={"include_usage": True},
                                            **params))
    texts = {}
    for c in chunks:
        for ch in c.choices:
            texts[ch.index] = texts.get(ch.index, "") + ch.text
    assert texts == {0: batch.choices[0].text, 1: batch.choices[2].text}
    assert chunks[-1].usage.completion_tokens == 6
    r = post(server, "/v1/completions", {"prompt": [], "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"


def test_best_of_answers_the_candidate_with_the_highest_mean_logprob(server):
    client = server.openai()
    model = model_name(server)
    params = dict(model=model, prompt=TEXTS[2], max_tokens=4, temperature=1.0, seed=7)
    best = client.completions.create(n=1, best_of=3, **params)
    assert [c.index for c in best.choices] == [0] and best.choices[0].logprobs is None
    # Candidate i draws with seed + i (vLLM's parallel sampling): replay each alone.
    alone = [client.completions.create(**dict(params, seed=7 + i), logprobs=0).choices[0] for i in range(3)]
    means = [sum(c.logprobs.token_logprobs) / len(c.logprobs.token_logprobs) for c in alone]
    assert best.choices[0].text == alone[max(range(3), key=lambda i: (means[i], -i))].text
    assert best.usage.completion_tokens == sum(len(c.logprobs.tokens) for c in alone)
    two = client.completions.create(n=2, best_of=3, logprobs=1, **params)
    assert [c.index for c in two.choices] == [0, 1] and two.choices[0].logprobs is not None


def test_vllm_extras(server, tokenizer):
    client = server.openai()
    model = model_name(server)
    ids = tokenizer(TEXTS[0]).input_ids
    cut = client.completions.create(model=model, prompt=TEXTS[0], max_tokens=1, echo=True,
                                    extra_body={"truncate_prompt_tokens": 5, "add_special_tokens": True})
    assert cut.usage.prompt_tokens == 5 and cut.choices[0].text.startswith(tokenizer.decode(ids[-5:]))
    as_ids = client.completions.create(model=model, prompt=TEXTS[0], max_tokens=2, logprobs=1,
                                       extra_body={"return_tokens_as_token_ids": True})
    assert all(t.startswith("token_id:") for t in as_ids.choices[0].logprobs.tokens)
    chunks = list(client.completions.create(model=model, prompt=TEXTS[0], max_tokens=3, stream=True,
                                            stream_options={"include_usage": True, "continuous_usage_stats": True},
                                            extra_body={"ignore_eos": True}))
    counts = [c.usage.completion_tokens for c in chunks if c.choices]
    assert counts == sorted(counts) and counts[-1] == 3 and chunks[-1].usage.completion_tokens == 3


def test_chat_template_extras(server, tokenizer):
    client = server.openai()
    model = model_name(server)
    prefix = [*CHAT, {"role": "assistant", "content": "My favourite colour is"}]

    def prompt_tokens(**template):
        text = tokenizer.apply_chat_template(prefix if template.get("continue_final_message") else CHAT,
                                             tokenize=False, **template)
        return len(tokenizer(text, add_special_tokens=False).input_ids)

    plain = client.chat.completions.create(model=model, messages=CHAT, max_tokens=1,
                                           extra_body={"chat_template_kwargs": {"unused_variable": 1}})
    assert plain.usage.prompt_tokens == prompt_tokens(add_generation_prompt=True)
    no_gen = client.chat.completions.create(model=model, messages=CHAT, max_tokens=1,
                                            extra_body={"add_generation_prompt": False})
    assert no_gen.usage.prompt_tokens == prompt_tokens(add_generation_prompt=False)
    cont = client.chat.completions.create(model=model, messages=prefix, max_tokens=2, extra_body={
        "add_generation_prompt": False, "continue_final_message": True, "echo": True})
    assert cont.usage.prompt_tokens == prompt_tokens(continue_final_message=True)
    assert cont.choices[0].message.content.startswith("My favourite colour is")


def test_refused_fields_are_400_naming_them(server):
    for name in fields.REFUSED:
        r = post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 1, name: "not neutral"}, timeout=120)
        assert r.status_code == 400, (name, r.text)
        err = r.json()["error"]
        assert err["param"] == name and (err["code"] is None or isinstance(err["code"], str)), err
    cases = [
        ("/v1/completions", {"prompt": "hi", "suffix": "there"}, "suffix"),
        ("/v1/completions", {"prompt": "hi", "n": 2, "best_of": 1}, "best_of"),
        ("/v1/completions", {"prompt": "hi", "best_of": 2, "stream": True}, "best_of"),
        ("/v1/completions", {"prompt": "hi", "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens"),
        ("/v1/completions", {"prompt": ["hi"] * 257}, "prompt"),
        ("/v1/chat/completions", {"messages": CHAT, "chat_template_kwargs": {"add_generation_prompt": False}},
         "chat_template_kwargs"),
        ("/v1/chat/completions", {"messages": CHAT, "chat_template_kwargs": {"bos_token": "x"}},
         "chat_template_kwargs"),
        ("/v1/chat/completions", {"messages": CHAT, "continue_final_message": True}, "continue_final_message"),
        ("/v1/chat/completions", {"messages": CHAT, "use_beam_search": True}, "use_beam_search"),
    ]
    for path, body, param in cases:
        r = post(server, path, {"max_tokens": 1, **body}, timeout=120)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)


def test_informational_fields_accepted_and_unknown_logged_once(server):
    body = {"prompt": "hi", "max_tokens": 1, "user": "u", "metadata": {"k": "v"}, "store": False,
            "service_tier": "auto", "request_id": "r1", "suffix": None, "use_beam_search": False,
            "length_penalty": 1.0, "skip_special_tokens": True, "priority": 0}
    assert post(server, "/v1/completions", body).status_code == 200
    name = f"zz_unknown_{server.mode}_field"
    for _ in range(2):
        assert post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 1, name: [1]}).status_code == 200
    deadline = time.monotonic() + 10
    while name not in server.log_tail(10**7) and time.monotonic() < deadline:
        time.sleep(0.2)
    lines = [line for line in server.log_tail(10**7).splitlines() if name in line]
    assert len(lines) == 1 and "WARNING" in lines[0] and "ignored" in lines[0], lines


def test_error_bodies_have_string_or_null_codes(server):
    checks = [post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 10**6}),
              post(server, "/v1/completions", {"prompt": "hi", "temperature": "hot"}),
              httpx.get(server.url + "/v1/nope", timeout=30),
              httpx.post(server.url + "/v1/completions", content=b'{"prompt": [' + b"1," * 300_000 + b"1]}",
                         headers={"content-type": "application/json"}, timeout=60)]
    assert [r.status_code for r in checks] == [400, 400, 404, 413]
    for r in checks:
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}
        assert err["code"] is None or isinstance(err["code"], str), err
    assert checks[0].json()["error"]["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as exc:
        server.openai().completions.create(model=model_name(server), prompt="hi", suffix="x")
    assert exc.value.code == "unsupported_parameter" and exc.value.param == "suffix"
