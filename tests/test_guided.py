"""Structured output, logit_bias and min_p.

Pure unit tests: the grammar mask on a tiny vocabulary, the sampler's guided rows (raw
logprobs, no bitmask without a guided row), logit_bias and min_p, the request fields'
conversion and refusals, the wire form. In process with the real model: a guided request
handed from a prefill engine to a decode engine, and one preempted, equal a plain run.
Against real servers through the ``openai`` SDK (colocated and 1P1D): every JSON output
parses and validates against its schema, the same in both; regex, choice, grammar; the
refusals (400 naming the field).
"""

from __future__ import annotations

import json
import re

import openai
import pytest
import torch
import xgrammar as xgr

from epdserve.engine.guided import GuidedDecoder, GuidedError, choice_grammar, mask_logits
from epdserve.engine.request import GuidedSpec, SamplingParams, Sequence
from epdserve.engine.sampler import sample
from epdserve.serving.api import openai as api
from epdserve.serving import protocol as P
from epdserve.serving.api.errors import APIError

pytestmark = pytest.mark.api

PERSON = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 20},
                         "age": {"type": "integer", "minimum": 0, "maximum": 150},
                         "city": {"type": "string", "enum": ["Paris", "London", "Berlin"]}},
          "required": ["name", "age", "city"], "additionalProperties": False}
PERSON_PROMPT = [{"role": "user", "content": "Give me a JSON object describing a person: name, age and city."}]
ANSWER_PROMPT = [{"role": "user", "content": 'Reply with a JSON object with one key "answer" whose value is '
                                             'the capital of France.'}]
TYPES = {"object": dict, "string": str, "integer": int, "array": list, "boolean": bool}


def validate(value, schema: dict) -> None:
    """Assert ``value`` meets ``schema`` (the keywords the tests' schemas use; jsonschema
    is not a dependency here)."""
    assert isinstance(value, TYPES[schema["type"]]) and not (schema["type"] == "integer" and isinstance(value, bool))
    if "enum" in schema:
        assert value in schema["enum"]
    if schema["type"] == "string":
        assert len(value) <= schema.get("maxLength", len(value))
    if schema["type"] == "integer":
        assert schema.get("minimum", value) <= value <= schema.get("maximum", value)
    if schema["type"] == "object":
        assert set(schema.get("required", ())) <= set(value)
        if schema.get("additionalProperties") is False:
            assert set(value) <= set(schema["properties"])
        for key, sub in schema.get("properties", {}).items():
            if key in value:
                validate(value[key], sub)


# ------------------------------------------------------------------- the mask, the sampler

TINY_VOCAB = ["a", "b", "c", "ab", "</s>"]
TINY_EOS = 4


def tiny_matcher(grammar: str) -> xgr.GrammarMatcher:
    info = xgr.TokenizerInfo(TINY_VOCAB, xgr.VocabType.RAW, stop_token_ids=[TINY_EOS])
    return xgr.GrammarMatcher(xgr.GrammarCompiler(info, max_threads=1).compile_grammar(grammar))


def tiny_seq(params: SamplingParams, grammar: str | None = None) -> Sequence:
    s = Sequence("r", [0], params)
    s.guided = None if grammar is None else tiny_matcher(grammar)
    return s


def test_mask_keeps_only_the_grammars_next_tokens_in_guided_rows():
    logits = torch.zeros(3, len(TINY_VOCAB))
    m = tiny_matcher('root ::= "ab" | "c"')
    mask_logits(logits, [1], [m])
    assert torch.isfinite(logits[1]).tolist() == [True, False, True, True, False]  # a, c, ab; no EOS yet
    assert torch.isfinite(logits[[0, 2]]).all()  # unguided rows untouched
    assert m.accept_token(2)  # "c": the grammar is complete, only EOS may follow
    logits = torch.zeros(1, len(TINY_VOCAB))
    mask_logits(logits, [0], [m])
    assert torch.isfinite(logits[0]).tolist() == [False, False, False, False, True]


def test_sampler_masks_guided_rows_and_logprobs_stay_raw():
    logits = torch.tensor([[0.0, 5.0, 1.0, 0.5, 9.0]] * 2)
    seqs = [tiny_seq(SamplingParams(temperature=0, logprobs=1), 'root ::= "c"'),
            tiny_seq(SamplingParams(temperature=0, logprobs=1))]
    tokens, lps = sample(logits, seqs, (TINY_EOS,))
    assert tokens == [2, 4]  # the guided row takes "c" though EOS has the top logit
    raw = torch.log_softmax(logits[0], -1)
    assert lps[0][0] == pytest.approx(float(raw[2])) and lps[0][1][0][0] == 4  # raw: EOS still on top
    assert logits[0, 4] == 9.0  # not modified
    for seed in range(20):  # drawn rows too
        s = tiny_seq(SamplingParams(temperature=1.0, seed=seed), 'root ::= "a" | "ab"')
        assert sample(logits[:1], [s], (TINY_EOS,))[0][0] in (0, 3)


def test_batch_without_guided_row_never_builds_a_mask(monkeypatch):
    import epdserve.engine.guided as guided

    calls = []
    monkeypatch.setattr(guided, "mask_logits", lambda *a: calls.append(a))
    seqs = [tiny_seq(SamplingParams(temperature=0)), tiny_seq(SamplingParams(temperature=0, logit_bias={1: 5.0}))]
    sample(torch.zeros(2, 5), seqs, ())
    assert calls == []
    seqs.append(tiny_seq(SamplingParams(temperature=0), 'root ::= "a"'))
    sample(torch.zeros(3, 5), seqs, ())
    assert [rows for _, rows, _ in calls] == [[2]]


def test_logit_bias_and_min_p():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0, -1.0]])
    greedy = SamplingParams(temperature=0, logit_bias={4: 100.0})
    assert sample(logits, [tiny_seq(greedy)], ())[0] == [4]
    banned = SamplingParams(temperature=0, logit_bias={0: -100.0, 1: -100.0})
    assert sample(logits, [tiny_seq(banned)], ())[0] == [2]
    assert logits[0, 0] == 3.0  # the caller's logits are left alone
    # min_p 1: only the most likely token, at any temperature; min_p 0.3 at T=1 keeps the
    # tokens with p >= 0.3 p_max: e^-1 = 0.37 passes, e^-2 = 0.14 does not.
    for seed in range(30):
        assert sample(logits, [tiny_seq(SamplingParams(temperature=2.0, min_p=1.0, seed=seed))], ())[0] == [0]
        assert sample(logits, [tiny_seq(SamplingParams(temperature=1.0, min_p=0.3, seed=seed))], ())[0][0] in (0, 1)


# --------------------------------------------------------------- compiling, the wire, fields

@pytest.fixture(scope="module")
def decoder(tokenizer):
    return GuidedDecoder(tokenizer, len(tokenizer))


def test_compile_errors_are_the_librarys_message_without_its_source_position(decoder):
    for spec, words in ((GuidedSpec(kind="json", value='{"type": "foo"}'), "Unsupported type"),
                        (GuidedSpec(kind="regex", value="(abc"), "parenthesis"),
                        (GuidedSpec(kind="grammar", value="root ::= foo"), "foo"),
                        (GuidedSpec(kind="choice", value="[]"), "non-empty")):
        with pytest.raises(GuidedError, match=words) as info:
            decoder.compile(spec)
        assert ".cc:" not in str(info.value) and not str(info.value).startswith("[")


def test_choice_grammar_takes_any_string(decoder):
    choices = ['say "hi"', "back\\slash", "new\nline", "é日本", ""]
    grammar = choice_grammar(choices)
    for c in choices:
        m = decoder.matcher(GuidedSpec(kind="grammar", value=grammar))
        assert m.accept_string(c) and m.is_completed()
    m = decoder.matcher(GuidedSpec(kind="choice", value=json.dumps(["yes"])))
    assert not m.accept_string("no")


def test_sampling_params_with_guided_and_logit_bias_cross_the_wire():
    msg = P.AddRequest(request_id="r", prompt_token_ids=[1, 2], sampling=SamplingParams(
        logit_bias={5: -100.0, 7: 2.5}, min_p=0.1, guided=GuidedSpec(kind="json", value=json.dumps(PERSON))))
    back = P.decode(P.encode(msg))
    assert back.sampling == msg.sampling and back.sampling.logit_bias == {5: -100.0, 7: 2.5}


def body(**fields) -> api.CompletionRequest:
    return api.CompletionRequest(prompt="x", **fields)


def test_request_fields_become_one_guided_spec():
    schema = {"type": "object"}
    rf = {"type": "json_schema", "json_schema": {"name": "p", "schema": schema, "strict": True}}
    assert body(response_format=rf).guided_spec() == ("response_format", GuidedSpec(kind="json", value='{"type": "object"}'))
    assert body(response_format={"type": "json_object"}).guided_spec()[1].kind == "json_object"
    assert body(response_format={"type": "text"}).guided_spec() is None
    assert body(guided_json='{"type": "object"}').guided_spec()[1].value == '{"type": "object"}'
    assert body(guided_choice=["a", "b"]).guided_spec() == ("guided_choice", GuidedSpec(kind="choice", value='["a", "b"]'))
    assert body(structured_outputs={"regex": "a+"}).guided_spec() == ("structured_outputs.regex",
                                                                      GuidedSpec(kind="regex", value="a+"))
    with pytest.raises(APIError, match="guided_regex, guided_grammar") as info:
        body(guided_regex="a", guided_grammar='root ::= "a"').guided_spec()
    assert info.value.param == "guided_regex"
    with pytest.raises(APIError, match="guided_json: not valid JSON"):
        body(guided_json="{nope").guided_spec()
    with pytest.raises(APIError, match="over the limit"):
        body(guided_regex="a" * 70_000).guided_spec()
    for bad in ({"response_format": {"type": "json_schema"}}, {"response_format": {"type": "xml"}},
                {"structured_outputs": {"disable_any_whitespace": True}}, {"logit_bias": {"a": 1}},
                {"logit_bias": {"1": 100.5}}, {"logit_bias": {str(i): 1 for i in range(301)}},
                {"min_p": 1.5}, {"guided_decoding_backend": "outlines"}):
        with pytest.raises(ValueError):
            body(**bad)


def test_router_compile_is_bounded_in_time_and_remembered(tokenizer, monkeypatch):
    """The router's check: a compile over the time limit is a 400 naming the field (the
    request does not wait for it), a grammar that compiled is not compiled again, and
    with the grammar thread's queue full a request gets 503."""
    import asyncio
    import time

    from epdserve.serving.router import grammar_check

    check = grammar_check.GrammarCheck(tokenizer)
    compiled = []
    check.decoder.compile = lambda spec: (compiled.append(spec), time.sleep(0.3 if spec.value == "slow" else 0))
    monkeypatch.setattr(grammar_check, "GUIDED_COMPILE_TIMEOUT_S", 0.1)
    try:
        with pytest.raises(APIError, match="guided_regex: not compiled within 0.1 s") as info:
            asyncio.run(check.spec(body(guided_regex="slow")))
        assert info.value.status == 400 and info.value.param == "guided_regex"
        time.sleep(0.3)
        for _ in range(2):
            assert asyncio.run(check.spec(body(guided_regex="a+"))) == GuidedSpec(kind="regex", value="a+")
        assert [s.value for s in compiled] == ["slow", "a+"]
        check._compiles_queued = grammar_check.MAX_COMPILE_QUEUE
        with pytest.raises(APIError) as info:
            asyncio.run(check.spec(body(guided_regex="b+")))
        assert info.value.status == 503
    finally:
        check.close()


# ------------------------------------------------------------------ the engine, in process

@pytest.fixture(scope="module")
def engine_parts(model_info, tokenizer):
    from epdserve.engine.engine import EngineConfig, LLMEngine
    from epdserve.model.tokenizer import chat_prompt_ids

    return LLMEngine, EngineConfig, str(model_info.path), chat_prompt_ids(tokenizer, PERSON_PROMPT)


def run(engine, request_id, prompt, sampling, **kw) -> tuple[list[int], str | None]:
    engine.add_request(request_id, prompt, sampling, **kw)
    tokens, reason = [], None
    for _ in range(sampling.max_tokens + 5):
        for out in engine.step():
            if out.request_id == request_id:
                tokens += out.token_ids
                reason = out.finish_reason if out.finished else reason
                if out.kv_block_ids is not None:
                    return tokens, "held"
        if reason is not None:
            return tokens, reason
    raise AssertionError("the request did not finish")


def test_grammar_state_continues_across_handoff_and_preemption(engine_parts, tokenizer):
    """A prefill engine's first token, then a decode engine that imports the KV and
    continues the grammar: the same tokens as one engine; and under a pool so small that
    two guided requests preempt each other, the same again."""
    from epdserve.engine.kv_source import TensorKV

    LLMEngine, EngineConfig, model_dir, prompt = engine_parts
    sampling = SamplingParams(max_tokens=40, temperature=0, guided=GuidedSpec(kind="json", value=json.dumps(PERSON)))
    whole, reason = run(LLMEngine(model_dir, EngineConfig(kv_cache_memory_mb=32)), "a", prompt, sampling)
    assert reason == "stop" and whole[-1] in tokenizer.all_special_ids
    validate(json.loads(tokenizer.decode(whole, skip_special_tokens=True)), PERSON)

    prefill = LLMEngine(model_dir, EngineConfig(kv_cache_memory_mb=32))
    first, held = run(prefill, "p", prompt, sampling, hold_kv=True)
    kv = TensorKV(prefill.read_kv(prefill.held["p"]))
    rest, reason = run(LLMEngine(model_dir, EngineConfig(kv_cache_memory_mb=32)), "d", prompt, sampling,
                       kv=kv, first_token=first[0])
    assert first + rest == whole and reason == "stop"

    # Room for one request and a bit: the second preempts the first (no prefix cache, so
    # they share no blocks).
    blocks = -(-(len(prompt) + 40) // 16)
    tight = LLMEngine(model_dir, EngineConfig(num_kv_blocks=blocks + 2, enable_prefix_caching=False))
    for rid in ("x", "y"):
        tight.add_request(rid, prompt, sampling)
    outs = {"x": [], "y": []}
    for _ in range(200):
        for out in tight.step():
            outs[out.request_id] += out.token_ids
        if not tight.has_unfinished():
            break
    assert tight.scheduler.num_preemptions > 0 and outs == {"x": whole, "y": whole}


# ------------------------------------------------------------------------ real servers

def chat(server, messages, **params):
    client = server.openai()
    return client.chat.completions.create(model=client.models.list().data[0].id, messages=messages,
                                          temperature=0, **params)


def test_json_schema_validates_and_pd_equals_colocated(pd_server, colocated_server):
    rf = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    texts = []
    for server in (colocated_server, pd_server):
        resp = chat(server, PERSON_PROMPT, response_format=rf, max_tokens=60)
        assert resp.choices[0].finish_reason == "stop"
        validate(json.loads(resp.choices[0].message.content), PERSON)
        texts.append(resp.choices[0].message.content)
    assert texts[0] == texts[1]


def test_json_object_streamed_parses(server):
    stream = chat(server, ANSWER_PROMPT, response_format={"type": "json_object"}, max_tokens=60, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert isinstance(json.loads(text), dict)


def test_vllm_guided_extras(server):
    client = server.openai()
    model = client.models.list().data[0].id
    out = client.completions.create(model=model, prompt="My phone number is", max_tokens=12, temperature=0,
                                    extra_body={"guided_regex": r"\d{3}-\d{4}"})
    assert re.fullmatch(r"\d{3}-\d{4}", out.choices[0].text) and out.choices[0].finish_reason == "stop"
    choices = ["Paris", "London", "Berlin"]
    resp = chat(server, [{"role": "user", "content": "Capital of France?"}], max_tokens=8,
                extra_body={"guided_choice": choices})
    assert resp.choices[0].message.content in choices
    resp = chat(server, [{"role": "user", "content": "Is the sky blue?"}], max_tokens=8,
                extra_body={"structured_outputs": {"grammar": 'root ::= "yes" | "no"'}})
    assert resp.choices[0].message.content in ("yes", "no")
    resp = chat(server, PERSON_PROMPT, max_tokens=60, extra_body={"guided_json": PERSON})
    validate(json.loads(resp.choices[0].message.content), PERSON)


def test_logit_bias_and_min_p_through_the_api(colocated_server, tokenizer):
    token = tokenizer.encode(" banana", add_special_tokens=False)[0]
    client = colocated_server.openai()
    out = client.completions.create(
        model=client.models.list().data[0].id, prompt="Hello", max_tokens=3, temperature=0.7, seed=1,
        logit_bias={str(token): 100}, extra_body={"min_p": 0.5})
    assert out.choices[0].text == tokenizer.decode([token] * 3)


@pytest.mark.parametrize("extra, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}},
     "response_format"),
    ({"guided_json": '{"type": "object", "properties": 3}'}, "guided_json"),
    ({"guided_regex": "(unclosed"}, "guided_regex"),
    ({"guided_grammar": "root ::= undefined_rule"}, "guided_grammar"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_regex"),
    ({"response_format": {"type": "json_object"}, "guided_json": {"type": "object"}}, "response_format"),
    ({"logit_bias": {"99999999": 1}}, "logit_bias"),
    ({"min_p": -0.1}, "min_p"),
])
def test_refused_with_400_naming_the_field(colocated_server, extra, param):
    with pytest.raises(openai.BadRequestError) as info:
        chat(colocated_server, [{"role": "user", "content": "hi"}], max_tokens=4, extra_body=extra)
    err = info.value.body
    assert info.value.status_code == 400 and err["param"] == param and param in err["message"], err
