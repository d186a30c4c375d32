"""Workload traces: exact prompt token counts, determinism, arrivals, save/load."""

import json
import math

import numpy as np
import pytest

from epdserve.bench import datasets, workload
from epdserve.bench.workload import Request, TraceError


@pytest.fixture(scope="module")
def tok():
    return workload.load_tokenizer_for(None)


def test_synthetic_prompts_have_the_exact_token_count_and_ranges(tok):
    trace = datasets.synthetic(tok, num_prompts=12, input_len=(1, 300), output_len=(5, 9),
                               request_rate=4.0, seed=1)
    assert len(trace) == 12
    for r in trace:
        assert workload.count_tokens(tok, r.prompt) == r.prompt_tokens
        assert 1 <= r.prompt_tokens <= 300 and 5 <= r.max_tokens <= 9 and r.kind == "chat"
    offsets = [r.offset_s for r in trace]
    assert offsets[0] == 0.0 and offsets == sorted(offsets)


def test_same_seed_same_trace_other_seed_other_trace(tok):
    a = datasets.synthetic(tok, 5, (10, 50), (2, 4), 2.0, seed=7)
    b = datasets.synthetic(tok, 5, (10, 50), (2, 4), 2.0, seed=7)
    c = datasets.synthetic(tok, 5, (10, 50), (2, 4), 2.0, seed=8)
    assert a == b and a != c


def test_poisson_gaps_have_mean_one_over_rate_and_inf_sends_all_at_once():
    offsets = workload.poisson_offsets(4001, 5.0, np.random.default_rng(0))
    gaps = np.diff(offsets)
    assert gaps.mean() == pytest.approx(0.2, rel=0.05)
    assert gaps.std() == pytest.approx(0.2, rel=0.1)  # exponential: std == mean
    assert workload.poisson_offsets(3, math.inf, np.random.default_rng(0)) == [0.0] * 3


def test_demo_defaults_long_prompts_arrive_during_the_chat_stream(tok):
    trace = datasets.demo(tok)
    chat = [r for r in trace if r.kind == "chat"]
    long = [r for r in trace if r.kind == "long"]
    assert len(chat) == 24 and len(long) == 3
    assert all(50 <= r.prompt_tokens <= 250 and 32 <= r.max_tokens <= 64 for r in chat)
    assert all(r.prompt_tokens >= 1500 and r.max_tokens == 16 for r in long)
    assert all(workload.count_tokens(tok, r.prompt) == r.prompt_tokens for r in trace)
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
