"""Token lengths of requests, and prompt text of an exact token count."""

from __future__ import annotations

import math

import numpy as np

from epdserve.bench.traces import TraceError
from epdserve.model.loader import ModelLoadError, resolve_model
from epdserve.model.tokenizer import load_tokenizer

LENGTH_DISTRIBUTIONS = ("uniform", "normal", "lognormal")


def load_tokenizer_for(path: str | None):
    """None: the default model's. Raises TraceError when it cannot be read."""
    try:
        return load_tokenizer(resolve_model(path).path)
    except ModelLoadError as exc:
        raise TraceError(f"tokenizer: {exc}") from None
    except OSError as exc:
        raise TraceError(f"tokenizer {path}: {exc}") from None


def word_list(tokenizer, max_words: int = 5000) -> list[str]:
    """Vocabulary tokens that decode to a space and 3-10 lowercase ascii letters, in id order
    (BPE: roughly most frequent first): about one token per word when joined by spaces."""
    words: list[str] = []
    seen: set[str] = set()
    for token_id in range(len(tokenizer)):
        text = tokenizer.decode([token_id])
        word = text[1:]
        if (text.startswith(" ") and 3 <= len(word) <= 10 and word.isascii()
                and word.isalpha() and word.islower() and word not in seen):
            seen.add(word)
            words.append(word)
            if len(words) >= max_words:
                break
    if len(words) < 100:
        raise TraceError("tokenizer has too few plain word tokens to build prompts")
    return words


def count_tokens(tokenizer, text: str) -> int:
    """Tokens of ``text`` alone: no special tokens, no chat template."""
    return len(tokenizer.encode(text, add_special_tokens=False))


def make_prompt(tokenizer, words: list[str], num_tokens: int, rng: np.random.Generator) -> str:
    """Random words tokenizing to exactly ``num_tokens``, adjusted word by word (a boundary may
    merge or split). Raises TraceError when no exact text is found."""
    if num_tokens < 1:
        raise TraceError(f"prompt length must be >= 1 token, got {num_tokens}")
    picks = list(rng.integers(0, len(words), size=num_tokens))
    for _ in range(20 + num_tokens // 10):
        text = " ".join(words[i] for i in picks)
        n = count_tokens(tokenizer, text)
        if n == num_tokens:
            return text
        if n > num_tokens and len(picks) > 1:
            picks.pop()
        else:
            picks.append(int(rng.integers(0, len(words))))
    raise TraceError(f"could not build a prompt of exactly {num_tokens} tokens")


def check_range(name: str, lo_hi: tuple[int, int]) -> tuple[int, int]:
    lo, hi = lo_hi
    if lo < 1 or hi < lo:
        raise TraceError(f"{name} {lo}:{hi}: need 1 <= MIN <= MAX")
    return lo, hi


def draw_lengths(rng: np.random.Generator, num: int, lo_hi: tuple[int, int],
                 dist: str = "uniform") -> np.ndarray:
    """``num`` lengths in the inclusive range: "uniform"; "normal", mean mid-range, σ =
    range/6; "lognormal", median sqrt(MIN·MAX), σ of the log ln(MAX/MIN)/6 (real prompt lengths
    skew so); rounded and clipped. Raises TraceError for another ``dist``."""
    lo, hi = lo_hi
    if dist == "uniform":
        return rng.integers(lo, hi + 1, size=num)
    if dist == "normal":
        x = rng.normal((lo + hi) / 2, (hi - lo) / 6, size=num)
    elif dist == "lognormal":
        x = rng.lognormal(math.log(math.sqrt(lo * hi)), math.log(hi / lo) / 6, size=num)
    else:
        raise TraceError(f"length distribution {dist!r}: use one of "
                         f"{', '.join(LENGTH_DISTRIBUTIONS)}")
    return np.clip(np.rint(x), lo, hi).astype(int)
