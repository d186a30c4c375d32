"""PD output equals colocated output under greedy decoding, for varied prompt lengths
(short, around multiples of the 16-token KV block, over 1,000 tokens), streamed and not,
chat and completions."""

from __future__ import annotations

import pytest

MAX_TOKENS = 20

STORY = ("The lighthouse keeper climbed the spiral stairs every evening at dusk, counting the "
         "steps as his father had taught him. Ships passed in the night, their lamps like "
         "slow stars, and he wrote each one into a leather book with the date, the weather, "
         "and a guess at the cargo. ")


def _ids(tokenizer, n: int) -> list[int]:
    """Exactly ``n`` token ids of running English text."""
    ids = tokenizer(STORY * (n // 40 + 2)).input_ids
    assert len(ids) >= n
    return ids[:n]


def _long_document(n_sentences: int) -> str:
    return " ".join(f"Entry {i}: the ship {name} passed at {i % 12 + 1} o'clock carrying {cargo}."
                    for i, (name, cargo) in enumerate(
                        [("Aurora", "tea"), ("Brigid", "salt"), ("Corvus", "iron"), ("Delphine", "wool")]
                        * (n_sentences // 4 + 1)) if i < n_sentences)


def cases(tokenizer):
    return {
        "chat-short": ("chat", [{"role": "user", "content": "Hi!"}]),
        "chat-question": ("chat", [{"role": "system", "content": "Answer briefly."},
                                   {"role": "user", "content": "Why is the sky blue?"}]),
        "completion-short": ("completion", "The capital of France is"),
        "completion-16": ("completion", _ids(tokenizer, 16)),
        "completion-33": ("completion", _ids(tokenizer, 33)),
        "completion-64": ("completion", _ids(tokenizer, 64)),
        "completion-1100": ("completion", _ids(tokenizer, 1100)),
        "chat-long": ("chat", [{"role": "user", "content": _long_document(80)
                                + "\n\nWhich ship carried iron?"}]),
    }


CASE_NAMES = ["chat-short", "chat-question", "completion-short", "completion-16", "completion-33",
              "completion-64", "completion-1100", "chat-long"]


@pytest.mark.parametrize("stream", [False, True], ids=["full", "stream"])
@pytest.mark.parametrize("case", CASE_NAMES)
def test_pd_equals_colocated(pd_server, colocated_server, tokenizer, case, stream):
    kind, prompt = cases(tokenizer)[case]
    if case == "chat-long":
        from epdserve.model.tokenizer import chat_prompt_ids

        assert len(chat_prompt_ids(tokenizer, prompt)) > 1000
    params = dict(max_tokens=MAX_TOKENS, temperature=0)
    pd = pd_server.generate(kind, prompt, stream=stream, **params)
    colo = colocated_server.generate(kind, prompt, stream=stream, **params)
    assert pd.text == colo.text
    assert pd.finish_reason == colo.finish_reason
    assert pd.usage.prompt_tokens == colo.usage.prompt_tokens
    assert pd.usage.completion_tokens == colo.usage.completion_tokens
    assert pd.text and 1 <= pd.usage.completion_tokens <= MAX_TOKENS
