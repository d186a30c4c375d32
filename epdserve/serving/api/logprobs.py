"""Log-probabilities in OpenAI's and vLLM's response shapes, clamped at -9999.0 (vLLM: the
JSON never holds -inf)."""

from __future__ import annotations

from typing import Callable

# (token id, logprob or None (an echoed prompt's first token), [(top id, logprob), ...] or None)
Entry = tuple[int, float | None, list[tuple[int, float]] | None]


def _clamp(logprob: float) -> float:
    return max(logprob, -9999.0)


class LogprobsFormatter:
    """One choice's, chunk after chunk: chat's ``content`` list, else the legacy shape, whose
    ``top_logprobs`` hold top + chosen and ``text_offset`` counts characters from the choice's start (vLLM)."""

    def __init__(self, kind: str, token_text: Callable[[int], str]):
        self.kind = kind
        self.token_text = token_text
        self.offset = 0

    def __call__(self, entries: list[Entry]) -> dict:
        text = self.token_text
        if self.kind == "chat":
            def item(token_id: int, logprob: float) -> dict:
                t = text(token_id)
                return {"token": t, "logprob": _clamp(logprob), "bytes": list(t.encode())}

            return {"content": [dict(item(t, lp), top_logprobs=[item(i, v) for i, v in top])
                                for t, lp, top in entries]}
        tokens = [text(t) for t, _, _ in entries]
        offsets = []
        for t in tokens:
            offsets.append(self.offset)
            self.offset += len(t)
        return {"tokens": tokens,
                "token_logprobs": [None if lp is None else _clamp(lp) for _, lp, _ in entries],
                "top_logprobs": [None if lp is None else {**{text(i): _clamp(v) for i, v in top}, tok: _clamp(lp)}
                                 for tok, (_, lp, top) in zip(tokens, entries)],
                "text_offset": offsets}


def token_texts(tokenizer, as_token_ids: bool = False) -> Callable[[int], str]:
    """Decoded alone (as vLLM), or ``token_id:<id>`` (vLLM's ``return_tokens_as_token_ids``)."""
    if as_token_ids:
        return lambda token_id: f"token_id:{token_id}"
    return lambda token_id: tokenizer.decode([token_id])


def prompt_entries(prompt_ids: list[int], prompt_logprobs: list | None) -> list[Entry]:
    """``prompt_logprobs``: ``[logprob, rank, top]`` per prompt token but the first; None: tokens alone."""
    scored = prompt_logprobs or []
    return [(prompt_ids[0], None, None)] + [
        (t, *(scored[j][0::2] if j < len(scored) else (None, None))) for j, t in enumerate(prompt_ids[1:])]


def vllm_prompt_logprobs(prompt_ids: list[int], prompt_logprobs: list,
                         token_text: Callable[[int], str]) -> list[dict | None]:
    """vLLM's: None first, then per token ``{str(token id): {"logprob", "rank", "decoded_token"}}`` for
    itself and the top k (rank 1: the most likely)."""
    out: list[dict | None] = [None]
    for token, (logprob, rank, top) in zip(prompt_ids[1:], prompt_logprobs):
        entry = {str(token): {"logprob": _clamp(logprob), "rank": rank, "decoded_token": token_text(token)}}
        for r, (i, v) in enumerate(top, 1):
            entry.setdefault(str(i), {"logprob": _clamp(v), "rank": r, "decoded_token": token_text(i)})
        out.append(entry)
    return out
