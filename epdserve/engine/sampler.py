"""Next-token sampling: min_tokens masking, penalties, greedy/temperature/top-k/top-p,
per-request seeds, and logprobs.

Order (vLLM's): logprobs are taken from the raw logits (vLLM's default ``logprobs_mode``
"raw_logprobs": before any penalty, mask or temperature); then stop tokens are masked
until ``min_tokens``, then the repetition penalty, then the frequency and presence
penalties; then a greedy row takes the argmax, another row divides by its temperature,
applies top-k and top-p and draws.
"""

from __future__ import annotations

import torch

from epdserve.engine.request import Sequence

# (the chosen token's logprob, [(token id, logprob)] of the top ``logprobs`` tokens, best first)
TokenLogprobs = tuple[float, list[tuple[int, float]]]


@torch.inference_mode()  # the model's logits are inference tensors; we edit them in place
def sample(logits: torch.Tensor, seqs: list[Sequence],
           eos_token_ids: tuple[int, ...] = ()) -> tuple[list[int], list[TokenLogprobs | None]]:
    """Pick one token per row of ``logits [S, vocab]`` (float32; modified in place) for
    ``seqs`` (one per row, their tokens so far in ``token_ids``).

    Returns the tokens and, per row, its :data:`TokenLogprobs` if the request asked for
    logprobs, else None. Rows without penalties, ``min_tokens`` or logprobs cost nothing
    extra; the others are processed together. A seeded row draws with a generator seeded
    by (seed, number of tokens generated so far), so it gives the same tokens in any
    batch, after a preemption, and across a prefill → decode hand-off.
    """
    want = [i for i, s in enumerate(seqs) if s.sampling.logprobs is not None]
    raw = torch.log_softmax(logits[want], dim=-1) if want else None
    _mask_stop_tokens(logits, seqs, eos_token_ids)
    _apply_penalties(logits, seqs)
    tokens = logits.argmax(dim=-1).tolist()
    for row, seq in enumerate(seqs):
        p = seq.sampling
        if p.temperature == 0:
            continue
        row_logits = logits[row] / p.temperature
        if 0 < p.top_k < row_logits.shape[-1]:
            kth = torch.topk(row_logits, p.top_k).values[-1]
            row_logits = row_logits.masked_fill(row_logits < kth, float("-inf"))
        probs = torch.softmax(row_logits, dim=-1)
        if p.top_p < 1.0:
            sorted_probs, order = probs.sort(descending=True)
            # Keep a token while the mass before it is below top_p (the first always stays).
            drop = sorted_probs.cumsum(-1) - sorted_probs >= p.top_p
            sorted_probs[drop] = 0.0
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
        tokens[row] = int(torch.multinomial(probs, 1, generator=_generator(seq)))
    logprobs: list[TokenLogprobs | None] = [None] * len(seqs)
    if want:
        chosen = raw.gather(1, torch.tensor([[tokens[i]] for i in want])).squeeze(1).tolist()
        k = max(seqs[i].sampling.logprobs for i in want)
        top_lp, top_ids = raw.topk(k, dim=-1)
        for j, row in enumerate(want):
            n = seqs[row].sampling.logprobs
            logprobs[row] = (chosen[j], list(zip(top_ids[j, :n].tolist(), top_lp[j, :n].tolist())))
    return tokens, logprobs


def _generator(seq: Sequence) -> torch.Generator | None:
    seed = seq.sampling.seed
    if seed is None:
        return None
    # One seed per (request seed, output position): the draw does not depend on what the
    # generator drew before, so a decode worker continues a prefill worker's sequence.
    return torch.Generator().manual_seed((seed * 0x9E3779B97F4A7C15 + seq.num_output_tokens) % 2**64)


def _mask_stop_tokens(logits: torch.Tensor, seqs: list[Sequence], eos_token_ids: tuple[int, ...]) -> None:
    """Until a request has ``min_tokens`` output tokens its stop tokens (``stop_token_ids``,
    and EOS unless ``ignore_eos``; vLLM's rule) get logit -inf."""
    rows, ids = [], []
    for row, seq in enumerate(seqs):
        p = seq.sampling
        if seq.num_output_tokens < p.min_tokens:
            stops = list(p.stop_token_ids) + ([] if p.ignore_eos else list(eos_token_ids))
            rows += [row] * len(stops)
            ids += stops
    if rows:
        logits[rows, ids] = float("-inf")


def _apply_penalties(logits: torch.Tensor, seqs: list[Sequence]) -> None:
    """Repetition penalty (CTRL, Keskar et al. 2019, as Hugging Face and vLLM apply it: a
    token seen in the prompt or the output has a positive logit divided by the penalty, a
    negative one multiplied), then OpenAI's frequency and presence penalties over the
    output tokens: ``logit -= frequency_penalty * count + presence_penalty * (count > 0)``.
    Only the (row, token) entries that occur are touched, so the cost follows the
    sequences' lengths, not rows x vocabulary."""
    rep_keys, out_keys = [], []
    vocab = logits.shape[-1]
    for row, seq in enumerate(seqs):
        p = seq.sampling
        if p.repetition_penalty != 1.0:
            rep_keys.append(torch.tensor(seq.token_ids) + row * vocab)
        if p.frequency_penalty != 0.0 or p.presence_penalty != 0.0:
            out_keys.append(torch.tensor(seq.token_ids[seq.num_prompt_tokens:], dtype=torch.long) + row * vocab)
    if not rep_keys and not out_keys:
        return
    flat = logits.view(-1)  # (row, token) -> row * vocab + token
    if rep_keys:
        keys = torch.cat(rep_keys).unique()
        rep = torch.tensor([s.sampling.repetition_penalty for s in seqs])[keys // vocab]
        values = flat[keys]
        flat[keys] = torch.where(values > 0, values / rep, values * rep)
    if out_keys:
        keys, counts = torch.cat(out_keys).unique(return_counts=True)
        rows = keys // vocab
        freq = torch.tensor([s.sampling.frequency_penalty for s in seqs])[rows]
        pres = torch.tensor([s.sampling.presence_penalty for s in seqs])[rows]
        flat[keys] -= freq * counts + pres
