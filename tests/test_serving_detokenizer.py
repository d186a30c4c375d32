"""Incremental detokenization and stop strings, without any server."""

from __future__ import annotations

import pytest

from epdserve.serving.api.detokenizer import IncrementalDetokenizer, StopMatcher, TextStream

TEXTS = ["Hello world, this is a test.", "日本語のテキスト 🎉🎉 emoji ünïcödé", " leading  spaces\nand\ttabs ",
         "a" * 50, "🧑‍🚀 astronaut and 中文"]


@pytest.mark.parametrize("text", TEXTS)
def test_one_token_at_a_time_equals_full_decode(tokenizer, text):
    ids = tokenizer(text).input_ids
    detok = IncrementalDetokenizer(tokenizer, tokenizer("Prompt:").input_ids)
    pieces = [detok.add([i]) for i in ids] + [detok.flush()]
    assert "".join(pieces) == tokenizer.decode(ids)
    assert all("\ufffd" not in p for p in pieces)


def test_incomplete_character_is_held_back_then_flushed(tokenizer):
    ids = tokenizer("🎉").input_ids
    assert len(ids) > 1  # a multi-byte character over several byte-level tokens
    detok = IncrementalDetokenizer(tokenizer)
    assert detok.add(ids[:1]) == ""
    assert detok.flush() == tokenizer.decode(ids[:1])  # at the end, what there is


def test_special_tokens_are_skipped(tokenizer):
    ids = tokenizer("Hi").input_ids + [tokenizer.eos_token_id]
    detok = IncrementalDetokenizer(tokenizer)
    assert "".join(detok.add([i]) for i in ids) + detok.flush() == "Hi"


@pytest.mark.parametrize("pieces,stops,emitted,stopped", [
    (["Hel", "lo wor", "ld"], ["wor"], "Hello ", True),
    (["ab", "c"], ["bc"], "a", True),                       # a stop string split across pieces
    (["a", "b", "x"], ["bc"], "abx", False),                 # a held-back prefix that did not match
    (["STOP"], ["STOP"], "", True),                          # at the very start
    (["aa", "ab"], ["aab", "xyz"], "a", True),               # overlapping prefixes
    (["one two"], [], "one two", False),
    (["x, y"], [", ", "y"], "x", True),                      # the earliest match wins
])
def test_stop_matcher(pieces, stops, emitted, stopped):
    m = StopMatcher(stops)
    out = "".join(m.feed(p) for p in pieces)
    out += m.flush()
    assert out == emitted and m.stopped == stopped


def test_text_stream_never_emits_stop_string(tokenizer):
    ids = tokenizer("The quick brown fox jumps over the lazy dog").input_ids
    s = TextStream(tokenizer, [], ["fox", "cat"])
    emitted = []
    for i in ids:
        emitted.append(s.add([i]))
        if s.stopped:
            break
    assert s.stopped and "".join(emitted) == "The quick brown " and s.text == "The quick brown "
    assert s.finish() == ""
