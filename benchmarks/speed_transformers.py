"""The transformers rows of ``benchmarks/speed.py``: the float32 Hugging Face directory
epdserve converted the GGUF into, run in this process with ``AutoModelForCausalLM``, its
token times turned into the bench client's per-request records so that
:mod:`epdserve.bench.metrics` computes the same metrics as for the servers.

* ``transformers-generate``: ``generate`` on static batches of C prompts (left padding,
  greedy, ``min_new_tokens = max_new_tokens``: EOS ignored), one batch after another;
  token times from a stopping criterion, called once after every step;
* ``transformers-cb``: transformers' continuous batching (``init_continuous_batching``)
  when the installed version has it: a closed loop of C requests in flight, per-token
  timestamps from ``record_timestamps``.
"""

from __future__ import annotations

import time
from pathlib import Path

from epdserve.bench import client, metrics, workload


def _records_from_times(reqs: list[workload.Request], t0s: list[float], times: list[list[float]],
                        texts: list[str], prompt_lens: list[int], run_start: float
                        ) -> list[client.RequestRecord]:
    """Client-style records (seconds, see :class:`epdserve.bench.client.RequestRecord`)
    from each request's start ``t0s`` and token times (``time.perf_counter``)."""
    out = []
    for i, (req, t0, ts) in enumerate(zip(reqs, t0s, times)):
        rel = [t - t0 for t in ts]
        out.append(client.RequestRecord(
            index=i, max_tokens=req.max_tokens, expected_prompt_tokens=req.prompt_tokens,
            start_s=t0 - run_start, chunk_times_s=rel, last_chunk_s=rel[-1],
            end_s=ts[-1] - run_start, usage_prompt_tokens=prompt_lens[i],
            usage_completion_tokens=len(ts), generated_text=texts[i], success=True))
    return out


class Transformers:
    """The float32 HF model epdserve converted the GGUF into, on ``threads`` CPU threads."""

    def __init__(self, model_dir: Path, threads: int):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        torch.set_num_threads(threads)
        self.torch = torch
        self.tok = AutoTokenizer.from_pretrained(model_dir)
        self.tok.padding_side = "left"
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    def prompt_ids(self, req: workload.Request) -> list[int]:
        """Token ids of ``req`` as a chat with one user message (the tokenizer's chat
        template, as epdserve's /v1/chat/completions applies it)."""
        text = self.tok.apply_chat_template([{"role": "user", "content": req.prompt}],
                                            add_generation_prompt=True, tokenize=False)
        return self.tok.encode(text, add_special_tokens=False)

    def generate(self, requests: list[workload.Request], concurrency: int
                 ) -> list[client.RequestRecord]:
        """Static batches of ``concurrency`` requests, one after another (see module doc)."""
        from transformers import StoppingCriteria, StoppingCriteriaList

        torch = self.torch

        class StepTimes(StoppingCriteria):
            """Called by ``generate`` after every step; records when, never stops."""

            def __init__(self):
                self.times: list[float] = []

            def __call__(self, input_ids, scores, **kwargs):
                self.times.append(time.perf_counter())
                return torch.zeros(input_ids.shape[0], dtype=torch.bool)

        pad = self.tok.pad_token_id if self.tok.pad_token_id is not None else self.tok.eos_token_id
        records, run_start = [], time.perf_counter()
        for b in range(0, len(requests), concurrency):
            batch = requests[b:b + concurrency]
            ids = [self.prompt_ids(r) for r in batch]
            width = max(map(len, ids))
            input_ids = torch.tensor([[pad] * (width - len(x)) + x for x in ids])
            mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in ids])
            n_out = batch[0].max_tokens
            steps = StepTimes()
            t0 = time.perf_counter()
            with torch.inference_mode():
                out = self.model.generate(input_ids=input_ids, attention_mask=mask,
                                          max_new_tokens=n_out, min_new_tokens=n_out,
                                          do_sample=False, pad_token_id=pad,
                                          stopping_criteria=StoppingCriteriaList([steps]))
            texts = self.tok.batch_decode(out[:, width:], skip_special_tokens=True)
            records += _records_from_times(batch, [t0] * len(batch), [steps.times] * len(batch),
                                           texts, [len(x) for x in ids], run_start)
        return records

    def continuous_batching(self, requests: list[workload.Request], concurrency: int
                            ) -> list[client.RequestRecord]:
        """Closed loop of ``concurrency`` requests through transformers' continuous
        batching manager (see module doc).

        Raises:
            RuntimeError: a request failed inside the manager (its error message).
        """
        from transformers import GenerationConfig
        from transformers.generation.configuration_utils import ContinuousBatchingConfig

        n_out = requests[0].max_tokens
        ids = [self.prompt_ids(r) for r in requests]
        # A KV cache sized for C requests in flight (without num_blocks it is sized from
        # free memory, GPU-style); eos_token_id -1 disables EOS, as vLLM's ignore_eos.
        page = 256
        blocks = concurrency * (-(-(max(map(len, ids)) + n_out) // page) + 1)
        manager = self.model.init_continuous_batching(
            generation_config=GenerationConfig(max_new_tokens=n_out, do_sample=False,
                                               eos_token_id=-1),
            continuous_batching_config=ContinuousBatchingConfig(
                page_size=page, num_blocks=blocks, max_requests_per_batch=concurrency))
        t0s: dict[str, float] = {}  # request id -> just before add_request; one per sent
        done: dict[str, object] = {}
        manager.start()
        try:
            run_start = time.perf_counter()

            def submit(i: int) -> None:
                t0s[f"r{i}"] = time.perf_counter()
                manager.add_request(ids[i], request_id=f"r{i}", max_new_tokens=n_out,
                                    record_timestamps=True)

            for i in range(min(concurrency, len(requests))):
                submit(i)
            while len(done) < len(requests):
                result = manager.get_result(timeout=1)
                if result is None:
                    if not manager.is_running():
                        raise RuntimeError("transformers continuous batching: the generation "
                                           "thread stopped")
                    continue
                if not result.is_finished():
                    continue
                if result.error:
                    raise RuntimeError(f"transformers continuous batching: {result.error}")
                done[result.request_id] = result
                if len(t0s) < len(requests):
                    submit(len(t0s))
        finally:
            manager.stop(block=True, timeout=30)
        results = [done[f"r{i}"] for i in range(len(requests))]
        texts = self.tok.batch_decode([r.generated_tokens for r in results],
                                      skip_special_tokens=True)
        return _records_from_times(requests, [t0s[f"r{i}"] for i in range(len(requests))],
                                   [r.timestamps for r in results], texts,
                                   [len(x) for x in ids], run_start)


def has_continuous_batching(model) -> bool:
    """Whether this transformers version has the continuous-batching API on its models."""
    return hasattr(model, "init_continuous_batching")


def run_transformers(model_dir: Path, traces: dict, threads: int, record) -> None:
    """Measure ``transformers-generate`` and, when the API exists, ``transformers-cb`` on
    every level, each after one unmeasured warm-up call; pass each result (the dict of
    :func:`epdserve.bench.metrics.compute`) to ``record(NAME, C, result)``."""
    engine = Transformers(model_dir, threads)
    runs = {"transformers-generate": engine.generate}
    if has_continuous_batching(engine.model):
        runs["transformers-cb"] = engine.continuous_batching
    else:
        print("[transformers] this version has no continuous-batching API "
              "(init_continuous_batching); only generate is measured", flush=True)
    warm = [workload.Request(0.0, client.WARMUP_PROMPT, client.WARMUP_MAX_TOKENS, "chat", 0)]
    for name, fn in runs.items():
        fn(warm, 1)
        for c, requests in traces.items():
            result = metrics.compute(fn(requests, c))
            result["max_concurrency"] = c
            record(name, c, result)
