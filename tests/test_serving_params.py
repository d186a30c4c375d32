"""Every OpenAI/vLLM sampling parameter through the ``openai`` package, against real
deployments (colocated and PD, where the prefill worker samples the first token and the
decode worker the rest): logprobs (checked against transformers), penalties, min_tokens,
stop strings and stop token ids, seed, ignore_eos, n, token-id prompts, and bad values."""

from __future__ import annotations

from collections import Counter

import openai
import pytest
import torch

from epdserve.model.tokenizer import chat_prompt_ids

PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "What is the capital of France?"}]
REPETITIVE = "one two one two one two one two one two one two one two"


@pytest.fixture(scope="module")
def hf_model(model_info):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_info.path), dtype=torch.float32).eval()


def hf_greedy(hf_model, prompt_ids: list[int], n: int) -> tuple[list[int], torch.Tensor]:
    """Greedy tokens of transformers and the log_softmax ``[n, vocab]`` each was picked from."""
    ids, rows = list(prompt_ids), []
    with torch.inference_mode():
        for _ in range(n):
            logprobs = torch.log_softmax(hf_model(torch.tensor([ids])).logits[0, -1].float(), -1)
            rows.append(logprobs)
            ids.append(int(logprobs.argmax()))
    return ids[len(prompt_ids):], torch.stack(rows)


def model_name(server) -> str:
    return server.openai().models.list().data[0].id


def test_completion_logprobs_match_transformers(server, hf_model, tokenizer):
    n, k = 6, 5
    ref_ids, ref = hf_greedy(hf_model, tokenizer(PROMPT).input_ids, n)
    resp = server.openai().completions.create(model=model_name(server), prompt=PROMPT, max_tokens=n,
                                              temperature=0, logprobs=k, extra_body={"ignore_eos": True})
    lp = resp.choices[0].logprobs
    assert lp.tokens == [tokenizer.decode([t]) for t in ref_ids]
    assert "".join(lp.tokens) == resp.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(n)]
    for i, (token, top) in enumerate(zip(ref_ids, lp.top_logprobs)):
        assert abs(lp.token_logprobs[i] - ref[i, token].item()) < 1e-3
        values, ids = ref[i].topk(k)
        # The chosen (greedy: the argmax) is one of the top k, so exactly k entries.
        assert set(top) == {tokenizer.decode([t]) for t in ids.tolist()}
        for t, v in zip(ids.tolist(), values.tolist()):
            assert abs(top[tokenizer.decode([t])] - v) < 1e-3

    # Streamed: each chunk carries its tokens' logprobs; together they are the same.
    chunks = list(server.openai().completions.create(
        model=model_name(server), prompt=PROMPT, max_tokens=n, temperature=0, logprobs=k, stream=True,
        extra_body={"ignore_eos": True}))
    tokens = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    offsets = [o for c in chunks if c.choices and c.choices[0].logprobs for o in c.choices[0].logprobs.text_offset]
    assert tokens == lp.tokens and offsets == lp.text_offset


def test_chat_logprobs_match_transformers(server, hf_model, tokenizer):
    n, k = 5, 3
    ref_ids, ref = hf_greedy(hf_model, chat_prompt_ids(tokenizer, CHAT), n)
    for stream in (False, True):
        res = server.openai().chat.completions.create(model=model_name(server), messages=CHAT, max_tokens=n,
                                                      temperature=0, logprobs=True, top_logprobs=k,
                                                      stream=stream, extra_body={"ignore_eos": True})
        if stream:
            content = [e for c in res if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
        else:
            content = res.choices[0].logprobs.content
        assert len(content) == n
        for i, (token, entry) in enumerate(zip(ref_ids, content)):
            assert entry.token == tokenizer.decode([token])
            assert entry.bytes == list(entry.token.encode())
            assert abs(entry.logprob - ref[i, token].item()) < 1e-3
            tops = [t.logprob for t in entry.top_logprobs]
            assert len(tops) == k and tops == sorted(tops, reverse=True)
            assert entry.top_logprobs[0].token == entry.token  # greedy picks the argmax
            assert abs(tops[-1] - ref[i].topk(k).values[-1].item()) < 1e-3
    plain = server.openai().chat.completions.create(model=model_name(server), messages=CHAT, max_tokens=2,
                                                    temperature=0, logprobs=True)
    assert all(e.top_logprobs == [] for e in plain.choices[0].logprobs.content)
    assert server.openai().chat.completions.create(
        model=model_name(server), messages=CHAT, max_tokens=2).choices[0].logprobs is None


def _completion(server, prompt, **params):
    return server.openai().completions.create(model=model_name(server), prompt=prompt, **params).choices[0]


def test_frequency_and_presence_penalties(server):
    """Greedy with penalties picks, at every step, the best raw logprob less the penalty of
    the tokens generated so far (the first token counts, across the PD hand-off)."""
    base = dict(max_tokens=12, temperature=0, logprobs=20, extra_body={"ignore_eos": True})
    plain = _completion(server, REPETITIVE, **base).logprobs
    for f, p in ((2.0, 0.0), (0.0, 2.0), (0.5, 0.7)):
        pen = _completion(server, REPETITIVE, frequency_penalty=f, presence_penalty=p, **base).logprobs
        assert max(Counter(pen.tokens).values()) < max(Counter(plain.tokens).values()), (f, p)
        for i, token in enumerate(pen.tokens):
            counts = Counter(pen.tokens[:i])
            score = {t: lp - f * counts[t] - p * (counts[t] > 0) for t, lp in pen.top_logprobs[i].items()}
            assert score[token] >= max(score.values()) - 1e-4, (f, p, i, token, score)


def test_repetition_penalty_avoids_prompt_tokens(server, tokenizer):
    n = 12
    prompt_tokens = {tokenizer.decode([t]) for t in tokenizer(REPETITIVE).input_ids}

    def from_prompt(**extra) -> int:
        lp = _completion(server, REPETITIVE, max_tokens=n, temperature=0, logprobs=0,
                         extra_body={"ignore_eos": True, **extra}).logprobs
        return sum(t in prompt_tokens for t in lp.tokens)

    plain, penalised = from_prompt(), from_prompt(repetition_penalty=2.0)
    assert plain >= n - 2 and penalised < plain // 2, (plain, penalised)  # greedy repeats the pattern


def test_stop_token_ids_and_min_tokens(server, hf_model, tokenizer):
    (first, second), _ = hf_greedy(hf_model, tokenizer(PROMPT).input_ids, 2)
    stopped = _completion(server, PROMPT, max_tokens=8, temperature=0, extra_body={"stop_token_ids": [first]})
    # vLLM: the output keeps a stop token unless it is a special token.
    assert stopped.finish_reason == "stop" and stopped.text == tokenizer.decode([first])
    held = server.openai().completions.create(model=model_name(server), prompt=PROMPT, max_tokens=8,
                                              temperature=0, logprobs=0,
                                              extra_body={"stop_token_ids": [first], "min_tokens": 4})
    # The first token may not stop before 4: the runner-up comes instead.
    assert held.usage.completion_tokens >= 4
    assert held.choices[0].logprobs.tokens[0] != tokenizer.decode([first])
    # EOS too: the greedy answer ends after a few tokens, min_tokens makes it go on.
    short = server.openai().chat.completions.create(model=model_name(server), messages=CHAT, max_tokens=64,
                                                    temperature=0)
    assert short.choices[0].finish_reason == "stop" and short.usage.completion_tokens < 20
    longer = server.openai().chat.completions.create(model=model_name(server), messages=CHAT, max_tokens=64,
                                                     temperature=0, extra_body={"min_tokens": 20})
    assert longer.usage.completion_tokens >= 20


def test_ignore_eos_and_include_stop_str(server):
    res = server.openai().chat.completions.create(model=model_name(server), messages=CHAT, max_tokens=40,
                                                  temperature=0, extra_body={"ignore_eos": True})
    assert res.choices[0].finish_reason == "length" and res.usage.completion_tokens == 40
    text = _completion(server, PROMPT, max_tokens=8, temperature=0, extra_body={"ignore_eos": True}).text
    stop = text.split()[1]
    cut = _completion(server, PROMPT, max_tokens=8, temperature=0, stop=[stop], extra_body={"ignore_eos": True})
    kept = _completion(server, PROMPT, max_tokens=8, temperature=0, stop=[stop],
                       extra_body={"ignore_eos": True, "include_stop_str_in_output": True})
    assert cut.finish_reason == kept.finish_reason == "stop"
    assert cut.text == text[:text.index(stop)] and kept.text == text[:text.index(stop) + len(stop)]


def test_seed_repeats_and_token_id_prompt(server, tokenizer):
    sampled = dict(max_tokens=16, temperature=1.0, extra_body={"ignore_eos": True})
    a = _completion(server, PROMPT, seed=11, **sampled).text
    assert _completion(server, PROMPT, seed=11, **sampled).text == a
    assert any(_completion(server, PROMPT, seed=s, **sampled).text != a for s in (12, 13))
    greedy = dict(max_tokens=10, temperature=0, extra_body={"ignore_eos": True})
    assert _completion(server, tokenizer(PROMPT).input_ids, **greedy).text == _completion(server, PROMPT, **greedy).text


def test_seeded_sampling_is_the_same_in_pd_and_colocated(pd_server, colocated_server):
    """A seed fixes each output position's draw, so the decode worker continues exactly
    what the prefill worker began."""
    params = dict(max_tokens=16, temperature=0.8, seed=5, extra_body={"ignore_eos": True})
    assert _completion(pd_server, PROMPT, **params).text == _completion(colocated_server, PROMPT, **params).text


def test_n_choices(server):
    n, tokens = 3, 8
    params = dict(max_tokens=tokens, temperature=1.0, seed=3, extra_body={"ignore_eos": True})
    client = server.openai()
    resp = client.completions.create(model=model_name(server), prompt=PROMPT, n=n, **params)
    assert [c.index for c in resp.choices] == [0, 1, 2]
    assert all(c.finish_reason == "length" for c in resp.choices)
    single = client.completions.create(model=model_name(server), prompt=PROMPT, **params)
    assert resp.usage.prompt_tokens == single.usage.prompt_tokens  # counted once
    assert resp.usage.completion_tokens == n * tokens
    # vLLM's convention: choice i of a seeded request samples with seed + i.
    texts = [c.text for c in resp.choices]
    assert texts[0] == single.choices[0].text
    assert texts[2] == _completion(server, PROMPT, **dict(params, seed=5)).text
    assert len(set(texts)) > 1

    chunks = list(client.completions.create(model=model_name(server), prompt=PROMPT, n=n, stream=True,
                                            stream_options={"include_usage": True}, **params))
    streamed, finished = {i: "" for i in range(n)}, {}
    for c in chunks:
        for choice in c.choices:
            streamed[choice.index] += choice.text
            if choice.finish_reason:
                finished[choice.index] = choice.finish_reason
    assert [streamed[i] for i in range(n)] == texts and finished == {i: "length" for i in range(n)}
    assert chunks[-1].usage.completion_tokens == n * tokens

    chat = list(client.chat.completions.create(model=model_name(server), messages=CHAT, n=2, stream=True,
                                               max_tokens=4, temperature=1.0,
                                               stream_options={"include_usage": True},
                                               extra_body={"ignore_eos": True}))
    roles = sorted(c.choices[0].index for c in chat if c.choices and c.choices[0].delta.role)
    assert roles == [0, 1] and chat[-1].usage.completion_tokens == 8


BAD = [
    ("completion", {"logprobs": 21}, "logprobs"),
    ("completion", {"n": 0}, "n"),
    ("completion", {"n": 17}, "n"),
    ("completion", {"presence_penalty": 2.5}, "presence_penalty"),
    ("completion", {"frequency_penalty": -3}, "frequency_penalty"),
    ("completion", {"extra_body": {"repetition_penalty": 0}}, "repetition_penalty"),
    ("completion", {"max_tokens": 4, "extra_body": {"min_tokens": 5}}, "min_tokens"),
    ("completion", {"extra_body": {"min_tokens": -1}}, "min_tokens"),
    ("chat", {"top_logprobs": 3}, "top_logprobs"),
    ("chat", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
]


@pytest.mark.parametrize("kind,params,param", BAD, ids=[f"{p}={v}" for _, v, p in BAD])
def test_bad_values_are_400_naming_the_param(colocated_server, kind, params, param):
    client = colocated_server.openai()
    with pytest.raises(openai.BadRequestError) as exc:
        if kind == "chat":
            client.chat.completions.create(model=model_name(colocated_server), messages=CHAT, **params)
        else:
            client.completions.create(model=model_name(colocated_server), prompt=PROMPT, **params)
    error = exc.value.response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error
