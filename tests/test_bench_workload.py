"""Workload traces: exact prompt token counts, determinism, arrivals, save/load."""

import json
import math

import numpy as np
import pytest

from epdserve.bench import datasets, workload
from epdserve.bench.workload import Request, TraceError
from epdserve.bench.arrivals import arrival_offsets, retime
from epdserve.bench.prompts import count_tokens, draw_lengths
from epdserve.bench.traces import describe


@pytest.fixture(scope="module")
def tok():
    return workload.load_tokenizer_for(None)


def test_synthetic_prompts_have_the_exact_token_count_and_ranges(tok):
    trace = datasets.synthetic(tok, num_prompts=12, input_len=(1, 300), output_len=(5, 9),
                               request_rate=4.0, seed=1)
    assert len(trace) == 12
    for r in trace:
        assert count_tokens(tok, r.prompt) == r.prompt_tokens
        assert 1 <= r.prompt_tokens <= 300 and 5 <= r.max_tokens <= 9 and r.kind == "chat"
    offsets = [r.offset_s for r in trace]
    assert offsets[0] == 0.0 and offsets == sorted(offsets)


def test_same_seed_same_trace_other_seed_other_trace(tok):
    a = datasets.synthetic(tok, 5, (10, 50), (2, 4), 2.0, seed=7)
    b = datasets.synthetic(tok, 5, (10, 50), (2, 4), 2.0, seed=7)
    c = datasets.synthetic(tok, 5, (10, 50), (2, 4), 2.0, seed=8)
    assert a == b and a != c


def test_poisson_gaps_have_mean_one_over_rate_and_inf_sends_all_at_once():
    offsets = arrival_offsets(4001, 5.0, np.random.default_rng(0))
    gaps = np.diff(offsets)
    assert gaps.mean() == pytest.approx(0.2, rel=0.05)
    assert gaps.std() == pytest.approx(0.2, rel=0.1)  # exponential: std == mean
    assert arrival_offsets(3, math.inf, np.random.default_rng(0)) == [0.0] * 3


def test_demo_defaults_long_prompts_arrive_during_the_chat_stream(tok):
    trace = datasets.demo(tok)
    chat = [r for r in trace if r.kind == "chat"]
    long = [r for r in trace if r.kind == "long"]
    assert len(chat) == 24 and len(long) == 6
    assert all(50 <= r.prompt_tokens <= 250 and 128 <= r.max_tokens <= 256 for r in chat)
    assert all(r.prompt_tokens >= 1500 and r.max_tokens == 16 for r in long)
    assert all(count_tokens(tok, r.prompt) == r.prompt_tokens for r in trace)
    # Each long prompt lands strictly inside the chat arrival window, with chat requests
    # sent shortly before it (so they are decoding when it arrives).
    for r in long:
        before = [c.offset_s for c in chat if c.offset_s < r.offset_s]
        assert before and max(before) > r.offset_s - 15 and chat[-1].offset_s > r.offset_s
    # Sized for ~1.5-2.5 min per configuration: arrivals span 60-130 s.
    assert 60 <= trace[-1].offset_s <= 130
    assert [r.offset_s for r in trace] == sorted(r.offset_s for r in trace)


def test_save_load_round_trip(tok, tmp_path):
    trace = datasets.demo(tok, num_chat=4, chat_rate=2.0, num_long=1, long_input_len=50)
    path = tmp_path / "t.jsonl"
    workload.save_trace(trace, path)
    assert workload.load_trace(path) == trace
    assert len(path.read_text().splitlines()) == 5


@pytest.mark.parametrize("line, needle", [
    ("{nope", "not valid JSON"),
    ("[1, 2]", "expected a JSON object"),
    ('{"offset_s": 0, "prompt": "x", "max_tokens": 1, "kind": "chat"}', "prompt_tokens"),
    ('{"offset_s": -1, "prompt": "x", "max_tokens": 1, "kind": "chat", "prompt_tokens": 1}',
     "offset_s"),
    ('{"offset_s": 0, "prompt": "x", "max_tokens": 0, "kind": "chat", "prompt_tokens": 1}',
     "max_tokens"),
    ('{"offset_s": 0, "prompt": "x", "max_tokens": 1, "kind": "img", "prompt_tokens": 1}',
     "kind"),
    ('{"offset_s": "0", "prompt": "x", "max_tokens": 1, "kind": "chat", "prompt_tokens": 1}',
     "wrong type"),
])
def test_malformed_trace_lines_name_file_and_line(tmp_path, line, needle):
    path = tmp_path / "bad.jsonl"
    good = json.dumps({"offset_s": 0, "prompt": "x", "max_tokens": 1, "kind": "chat",
                       "prompt_tokens": 1})
    path.write_text(good + "\n" + line + "\n")
    with pytest.raises(TraceError, match=needle) as info:
        workload.load_trace(path)
    assert f"{path}:2" in str(info.value)


def test_missing_and_empty_trace_files(tmp_path):
    with pytest.raises(TraceError, match="missing.jsonl"):
        workload.load_trace(tmp_path / "missing.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(TraceError, match="no requests"):
        workload.load_trace(tmp_path / "empty.jsonl")


def test_bad_generator_settings_are_trace_errors(tok):
    with pytest.raises(TraceError, match="5:2"):
        datasets.synthetic(tok, 2, (5, 2), (1, 2), 1.0)
    with pytest.raises(TraceError, match="-1"):
        datasets.synthetic(tok, 2, (5, 6), (1, 2), -1.0)
    assert Request(0.0, "x", 1, "chat", 1).kind == "chat"


# ---------------------------------------------------------------------------------------
# Lengths, shared prefixes, bursts, images


@pytest.mark.parametrize("dist", ["uniform", "normal", "lognormal"])
def test_length_distributions_stay_in_range_and_have_their_centre(dist):
    x = draw_lengths(np.random.default_rng(0), 20000, (100, 900), dist)
    assert x.min() >= 100 and x.max() <= 900
    centre = {"uniform": 500, "normal": 500, "lognormal": 300}[dist]  # mean, mean, median
    got = np.median(x) if dist == "lognormal" else x.mean()
    assert got == pytest.approx(centre, rel=0.03)
    if dist == "normal":
        assert x.std() == pytest.approx(800 / 6, rel=0.05)
    assert (draw_lengths(np.random.default_rng(0), 5, (7, 7), dist) == 7).all()


def test_shared_prefix_requests_start_with_one_of_k_prefixes(tok):
    trace = datasets.shared_prefix(tok, num_prompts=9, prefix_count=3, prefix_len=40,
                                   suffix_len=(5, 10), output_len=(3, 3), seed=2)
    assert trace == datasets.shared_prefix(tok, num_prompts=9, prefix_count=3, prefix_len=40,
                                           suffix_len=(5, 10), output_len=(3, 3), seed=2)
    ids = [tok.encode(r.prompt, add_special_tokens=False) for r in trace]
    prefixes = [tuple(x[:40]) for x in ids]
    assert len(set(prefixes)) == 3
    assert prefixes[:3] * 3 == prefixes  # round-robin
    for r, x in zip(trace, ids):
        # 40 + (5..10) tokens, give or take one merged at the boundary
        assert 44 <= len(x) <= 51 and r.prompt_tokens == len(x) and r.max_tokens == 3
    rand = datasets.shared_prefix(tok, num_prompts=30, prefix_count=3, prefix_len=40,
                                  suffix_len=(5, 10), order="random", seed=2)
    picks = [tuple(tok.encode(r.prompt, add_special_tokens=False)[:40]) for r in rand]
    assert len(set(picks)) == 3 and picks[:3] * 10 != picks


def test_long_prompts_come_in_bursts(tok):
    trace = datasets.demo(tok, num_chat=10, chat_input_len=(5, 10), chat_output_len=(2, 2),
                          chat_rate=2.0, num_long=6, long_input_len=30, long_burst=3)
    long = [r.offset_s for r in trace if r.kind == "long"]
    span = max(r.offset_s for r in trace if r.kind == "chat")
    assert long == [pytest.approx(span / 3)] * 3 + [pytest.approx(2 * span / 3)] * 3


def test_images_round_trip_through_a_trace(tok, tmp_path):
    trace = datasets.with_images(datasets.synthetic(tok, 3, (5, 8), (2, 2), seed=1), 2, (640, 480))
    # Every image its own picture: seeds number the images in trace order.
    assert [r.images for r in trace] == [
        tuple({"width": 640, "height": 480, "seed": 2 * i + k} for k in range(2))
        for i in range(3)]
    workload.save_trace(trace, tmp_path / "t.jsonl")
    assert workload.load_trace(tmp_path / "t.jsonl") == trace
    assert describe(trace)["num_images"] == 6
    assert describe(trace)["distinct_images"] == 6
    # A trace written before seeds existed gets the same numbering.
    lines = [json.loads(x) for x in (tmp_path / "t.jsonl").read_text().splitlines()]
    for obj in lines:
        obj["images"] = [{"width": x["width"], "height": x["height"]} for x in obj["images"]]
    (tmp_path / "old.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    assert workload.load_trace(tmp_path / "old.jsonl") == trace
    for image in ({"width": 0, "height": 3}, {"width": 3, "height": 3, "seed": -1},
                  {"width": 3, "height": 3, "seed": True}):
        bad = dict(lines[0], images=[image])
        (tmp_path / "bad.jsonl").write_text(json.dumps(bad) + "\n")
        with pytest.raises(TraceError, match=r"bad.jsonl:1: field 'images'"):
            workload.load_trace(tmp_path / "bad.jsonl")


def test_image_repeat_share_reuses_earlier_images(tok):
    base = datasets.synthetic(tok, 10, (5, 8), (2, 2), seed=1)
    trace = datasets.with_images(base, 2, (32, 32), repeat_share=0.3, seed=5)
    assert trace == datasets.with_images(base, 2, (32, 32), repeat_share=0.3, seed=5)
    seen, repeats = [], 0
    for r in trace:
        if r.images in seen:
            repeats += 1  # the same pictures as an earlier request, both of them
        else:
            assert r.images == tuple({"width": 32, "height": 32, "seed": s}
                                     for s in (2 * len(seen) + 2 * repeats,
                                               2 * len(seen) + 2 * repeats + 1))
            seen.append(r.images)
    assert repeats == 3 and trace[0].images == seen[0]
    assert describe(trace)["distinct_images"] == 14
    everything = datasets.with_images(base, 1, (32, 32), repeat_share=1.0)
    assert all(r.images == everything[0].images for r in everything)  # all repeat the first
    with pytest.raises(TraceError, match="repeat share 1.5"):
        datasets.with_images(base, 1, (32, 32), repeat_share=1.5)


# ---------------------------------------------------------------------------------------
# Arrivals


def test_gamma_arrivals_have_the_asked_mean_rate_and_burstiness():
    for burstiness in (0.25, 1.0, 4.0):
        gaps = np.diff(arrival_offsets(20001, 5.0, np.random.default_rng(3), burstiness))
        assert gaps.mean() == pytest.approx(0.2, rel=0.05)
        # gamma: coefficient of variation = 1/sqrt(shape)
        assert gaps.std() / gaps.mean() == pytest.approx(burstiness ** -0.5, rel=0.07)


def test_burstiness_one_is_poisson():
    rng = np.random.default_rng(4)
    gaps = np.diff(arrival_offsets(20001, 2.0, rng, burstiness=1.0))
    ref = np.random.default_rng(5).gamma(1.0, 0.5, size=20000)  # Exponential(mean 0.5)
    for q in (0.1, 0.25, 0.5, 0.75, 0.9, 0.99):
        assert np.quantile(gaps, q) == pytest.approx(np.quantile(ref, q), rel=0.08)
        assert np.quantile(gaps, q) == pytest.approx(-0.5 * math.log(1 - q), rel=0.08)


def test_ramp_offsets_follow_the_linear_rate():
    # A very steady process (burstiness 1e4: gaps within ~1% of their mean) shows the
    # rate of each gap: 1/gap rises linearly from 1 to 9 req/s over the run.
    offsets = arrival_offsets(41, math.inf, np.random.default_rng(0), 1e4, ramp=(1.0, 9.0))
    rates = 1 / np.diff(offsets)
    want = np.linspace(1.0, 9.0, 41)[1:]
    assert rates == pytest.approx(want, rel=0.05)


def test_retime_keeps_prompts_and_pattern_at_the_new_rate(tok):
    trace = datasets.demo(tok, num_chat=6, chat_input_len=(5, 6), chat_output_len=(2, 2),
                          chat_rate=1.0, num_long=1, long_input_len=20)
    fast = retime(trace, 4 * (len(trace) - 1) / trace[-1].offset_s)
    assert [r.prompt for r in fast] == [r.prompt for r in trace]
    assert [r.offset_s for r in fast] == pytest.approx([r.offset_s / 4 for r in trace], abs=1e-5)
    at_once = datasets.synthetic(tok, 50, (5, 6), (2, 2))
    spread = retime(at_once, 10.0)
    assert np.diff([r.offset_s for r in spread]).mean() == pytest.approx(0.1, rel=0.35)


# ---------------------------------------------------------------------------------------
# ShareGPT files


def sharegpt_file(tmp_path, entries, name="sg.json"):
    path = tmp_path / name
    path.write_text(json.dumps(entries, indent=1))
    return path


def conv(human, gpt=None):
    turns = [{"from": "human", "value": human}]
    if gpt is not None:
        turns.append({"from": "gpt", "value": gpt})
    return {"id": "x", "conversations": turns}


def test_sharegpt_prompts_answers_and_skips(tok, tmp_path):
    long_text = " ".join(["word"] * 1100)
    entries = [conv("please tell me about the weather today", "it is sunny and warm outside"),
               conv("what is two plus two equal to", "the answer is four of course"),
               conv("hi", "a reply that is long enough"),           # prompt too short
               conv(long_text, "a reply that is long enough"),      # prompt too long
               conv("a question without any answer at all"),        # no gpt turn
               {"conversations": [{"from": "system", "value": "only a system turn"}]}]
    path = sharegpt_file(tmp_path, entries)
    trace, stats = datasets.sharegpt(tok, path, num_prompts=10, seed=0)
    assert stats == {"conversations": 5, "used": 2, "skipped_no_answer": 1,
                     "skipped_too_short": 1, "skipped_too_long": 1}
    by_prompt = {r.prompt: r for r in trace}
    r = by_prompt["please tell me about the weather today"]
    assert r.prompt_tokens == count_tokens(tok, r.prompt)
    assert r.max_tokens == count_tokens(tok, "it is sunny and warm outside")
    fixed, _ = datasets.sharegpt(tok, path, num_prompts=10, output_len=(7, 7))
    assert all(r.max_tokens == 7 for r in fixed)
    one, _ = datasets.sharegpt(tok, path, num_prompts=1)
    assert len(one) == 1


@pytest.mark.parametrize("text, needle", [
    ('[{"conversations": []},\n\n {"conversations": [1, 2]}]', ":3: entry 1"),
    ('{"conversations": []}', "expected a JSON list"),
    ('[\n{"conversations": []},\n{oops}\n]', ":3: not valid JSON"),
])
def test_bad_sharegpt_files_name_file_and_place(tok, tmp_path, text, needle):
    path = tmp_path / "bad.json"
    path.write_text(text)
    with pytest.raises(TraceError, match=needle) as info:
        datasets.sharegpt(tok, path)
    assert str(path) in str(info.value)


def test_sharegpt_missing_or_empty_after_filtering(tok, tmp_path):
    with pytest.raises(TraceError, match="nope.json"):
        datasets.sharegpt(tok, tmp_path / "nope.json")
    path = sharegpt_file(tmp_path, [conv("hi", "yo")])
    with pytest.raises(TraceError, match=r"no usable conversation .*1 too short"):
        datasets.sharegpt(tok, path)
