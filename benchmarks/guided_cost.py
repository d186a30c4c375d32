"""What structured output costs per token: the same requests decoded unconstrained and
under a grammar, in one engine in this process (CPU, ``--threads`` torch threads), in the
same run.

Per batch size (``--batch``), ``--batch`` copies of one chat prompt are prefilled and then
decoded for ``--tokens`` tokens each, greedy, three ways:

* ``plain``: no constraint (``ignore_eos``, so every request makes all its tokens);
* ``json-string``: the JSON schema ``{"type": "string", "minLength": 100000}``, which no
  request can finish within ``--tokens``: every step is in a JSON string, the state most
  JSON output spends its tokens in;
* ``json-schema``: a small object schema (name, age, city, tags); requests end when the
  object is complete, so fewer tokens count.

Reported: decode ms per step and per token, the ratio of each to ``plain`` (the added
cost per token), and the grammar's own part, ms per step in the bitmask fill and mask
(``mask_logits``; the rest of the difference is the logits copy and advancing the
matchers); plus the cold compile time of each schema.

    .venv/bin/python benchmarks/guided_cost.py [--batch 1 8] [--tokens 48] [--threads 1] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from epdserve.engine import guided as guided_mod
from epdserve.engine.engine import EngineConfig, LLMEngine
from epdserve.engine.request import GuidedSpec, SamplingParams
from epdserve.model.loader import resolve_model
from epdserve.model.tokenizer import chat_prompt_ids, load_tokenizer

PROMPT = [{"role": "user", "content": "Describe a person as JSON: name, age, city and a few tags."}]
SCHEMAS = {
    "json-string": {"type": "string", "minLength": 100000},
    "json-schema": {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                                     "city": {"type": "string"},
                                                     "tags": {"type": "array", "items": {"type": "string"}}},
                    "required": ["name", "age", "city", "tags"]},
}


class Timer:
    """Wraps a function and sums the seconds spent in it."""

    def __init__(self, fn):
        self.fn, self.total = fn, 0.0

    def __call__(self, *args):
        start = time.perf_counter()
        try:
            return self.fn(*args)
        finally:
            self.total += time.perf_counter() - start


def decode(engine: LLMEngine, prompt: list[int], batch: int, tokens: int, spec: GuidedSpec | None) -> dict:
    """Prefill ``batch`` requests, then time their decode steps: ms per step, ms per token,
    and ms per step in the grammar's mask (bitmask fill and apply)."""
    sampling = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=spec is None, guided=spec)
    for i in range(batch):
        engine.add_request(f"{spec and spec.kind}-{i}-{time.perf_counter()}", prompt, sampling)
    while any(seq.is_prefilling for seq in engine.seqs.values()):
        engine.step()
    # The sampler looks mask_logits up in its module at each call: time it there.
    mask = guided_mod.mask_logits = Timer(guided_mod.mask_logits)
    steps, made = [], 0
    while engine.has_unfinished():
        start = time.perf_counter()
        outs = engine.step()
        steps.append(time.perf_counter() - start)
        made += sum(len(o.token_ids) for o in outs)
    guided_mod.mask_logits = mask.fn
    return {"ms_per_step": 1e3 * statistics.median(steps), "ms_per_token": 1e3 * sum(steps) / max(made, 1),
            "tokens": made, "mask_ms_per_step": 1e3 * mask.total / len(steps)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3, help="runs of each kind, interleaved; medians reported")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model_dir = str(resolve_model().path)
    tokenizer = load_tokenizer(model_dir)
    prompt = chat_prompt_ids(tokenizer, PROMPT)
    engine = LLMEngine(model_dir, EngineConfig(kv_cache_memory_mb=256))
    print(f"model {model_dir}, prompt {len(prompt)} tokens, {args.tokens} tokens a request, "
          f"{args.threads} torch thread(s)")
    decoder = engine.guided_decoder()
    specs = {}
    for name, schema in SCHEMAS.items():
        specs[name] = GuidedSpec(kind="json", value=json.dumps(schema))
        start = time.perf_counter()
        decoder.compile(specs[name])
        print(f"compile {name}: {1e3 * (time.perf_counter() - start):.1f} ms (cold)")
    for batch in args.batch:
        decode(engine, prompt, batch, 4, None)  # warm-up
        kinds = {"plain": None, **specs}
        runs = {name: [] for name in kinds}
        for _ in range(args.repeats):  # interleaved, so that a slow moment of the machine hits every kind
            for name, spec in kinds.items():
                runs[name].append(decode(engine, prompt, batch, args.tokens, spec))
        rows = [(name, {k: statistics.median(r[k] for r in rs) for k in rs[0]}) for name, rs in runs.items()]
        base = rows[0][1]
        print(f"\nbatch {batch} (medians of {args.repeats} runs)")
        print(f"{'run':<12} {'ms/step':>8} {'x plain':>8} {'ms/token':>9} {'x plain':>8} {'tokens':>7} "
              f"{'mask ms/step':>13}")
        for name, r in rows:
            print(f"{name:<12} {r['ms_per_step']:8.2f} {r['ms_per_step'] / base['ms_per_step']:8.3f} "
                  f"{r['ms_per_token']:9.2f} {r['ms_per_token'] / base['ms_per_token']:8.3f} {r['tokens']:7.0f} "
                  f"{r['mask_ms_per_step']:13.3f}")


if __name__ == "__main__":
    main()
