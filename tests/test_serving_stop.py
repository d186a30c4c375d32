"""Finish reasons: stop strings (truncated before the stop string, streamed or not),
``max_tokens`` ("length"), and EOS ("stop")."""

from __future__ import annotations

import pytest

PROMPT = "Once upon a time, in a small village by the sea,"
N = 32


@pytest.fixture
def reference(server, model_info):
    res = server.generate("completion", PROMPT, stream=False, max_tokens=N, temperature=0,
                          extra_body={"ignore_eos": True})
    assert res.finish_reason == "length" and res.usage.completion_tokens == N
    return res.text


def _stop_string(text: str) -> tuple[str, str]:
    """A stop string from the second half of ``text`` and the text expected before it."""
    for k in range(len(text) // 2, len(text) - 3):
        stop = text[k:k + 4]
        if stop.strip() and text.find(stop) > 0:
            return stop, text[:text.find(stop)]
    raise AssertionError(f"no usable stop string in {text!r}")


@pytest.mark.parametrize("stream", [False, True], ids=["full", "stream"])
def test_stop_string(server, reference, stream):
    stop, expected = _stop_string(reference)
    for stops in (stop, ["\u2603never\u2603", stop]):
        res = server.generate("completion", PROMPT, stream=stream, max_tokens=N, temperature=0, stop=stops,
                              extra_body={"ignore_eos": True})
        assert res.text == expected, (stop, res.text, reference)
        assert res.finish_reason == "stop"
        assert res.usage.completion_tokens < N


@pytest.mark.parametrize("stream", [False, True], ids=["full", "stream"])
def test_max_tokens_is_length(server, reference, stream):
    res = server.generate("completion", PROMPT, stream=stream, max_tokens=5, temperature=0,
                          stop=["\u2603never\u2603"], extra_body={"ignore_eos": True})
    assert res.finish_reason == "length" and res.usage.completion_tokens == 5
    assert reference.startswith(res.text) and res.text


def test_eos_is_stop(server, model_info):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    res = server.generate("chat", messages, stream=True, max_tokens=64, temperature=0)
    assert res.finish_reason == "stop" and res.usage.completion_tokens < 64
    assert "Paris" in res.text
