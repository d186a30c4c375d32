"""Write small seeded traces shaped like the public production traces, in their own formats,
for ``--workload mooncake`` and ``--workload azure`` (see docs/comparing.md, "Production
traces"). They are *shaped like* the real ones (published statistics below), not rows of them.

    .venv/bin/python benchmarks/make_traces.py [--output examples/traces] [--rows 300] [--seed 0]

writes ``mooncake_like.jsonl``, ``azure_conv_like.csv`` and ``azure_code_like.csv`` and
prints each file's shape as the reader sees it.

Shapes and their sources:

* **Mooncake** (``mooncake_trace.jsonl`` of kvcache-ai/Mooncake, the one-hour Kimi trace of
  the technical report, arXiv 2407.00079; statistics from the ``datagen analyze`` output in
  NVIDIA Dynamo's ``benchmarks/README.md``): 23,608 requests in one hour (6.6 req/s); input
  tokens mean 8,590, p25 3,227, median 6,345, p75 7,470, max 125,546; output tokens mean 182,
  p25 13, median 30, p75 356, max 2,000; the part of a prompt in blocks seen before ("context
  length") median 6,144 = 12 blocks and mean 5,755 (67 % of the input tokens), the rest
  ("unique prompt") median 560, p75 1,103, mean 2,834. Modelled as: one of three shared
  system prompts of 12, 4 or 1 blocks (55 %, 30 %, 15 % of new sessions) followed by the
  request's own text (lognormal, median 500 tokens; one in ten a long document, median
  15,000), or, for 15 % of requests, a later turn of a recent request (its prompt and answer
  and a new message of median 150 tokens), as the FAST'25 conversation trace repeats an
  earlier turn's blocks; outputs a 60/40 mix of short (median 15) and long (median 350)
  answers; arrivals gamma with rate 6.6 req/s and shape 0.5 (bursty). Hash ids are
  prefix-chained and numbered in order of first use, as Mooncake's are.
* **Azure conversation** (``AzureLLMInferenceTrace_conv.csv`` of Azure/AzurePublicDataset,
  2023, the Splitwise trace: 19,366 requests in 58 minutes, 5.5 req/s): ContextTokens p50
  1,020, p95 4,083, p99 4,142; GeneratedTokens p50 129, p95 451, p99 601 (medians as in
  Splitwise, Patel et al., ISCA 2024, Section III; percentiles from a published summary of
  the file). Modelled as lognormal context (median 1,020, sigma 0.84, at most 4,150) and
  output (median 129, sigma 0.76, at most 700), gamma arrivals of shape 0.7.
* **Azure code** (``AzureLLMInferenceTrace_code.csv``: 8,819 requests in 57 minutes,
  2.6 req/s, bursty, peak/mean about 3.3 per minute): Splitwise's medians of 1,500 prompt and
  13 generated tokens. Modelled as lognormal context (median 1,500, sigma 1.0, at most 7,500)
  and output (median 13, sigma 0.9, at most 1,000), gamma arrivals of shape 0.3.
"""

from __future__ import annotations

import argparse
import json
import math
from datetime import datetime, timedelta
from pathlib import Path

import numpy as np

from epdserve.bench.arrivals import arrival_offsets
from epdserve.bench.production import describe_replay
from epdserve.bench.production_formats import MOONCAKE_BLOCK_TOKENS, read_production

BLOCK = MOONCAKE_BLOCK_TOKENS
SYSTEM_PROMPT_BLOCKS = (12, 4, 1)
SYSTEM_PROMPT_SHARES = (0.55, 0.30, 0.15)
LATER_TURN_SHARE = 0.15
AZURE = {  # context (median, sigma, max), output (median, sigma, max), rate, gamma shape, start
    "conv": ((1020, 0.84, 4150), (129, 0.76, 700), 5.5, 0.7, datetime(2023, 11, 16, 18, 15, 46, 680590)),
    "code": ((1500, 1.0, 7500), (13, 0.9, 1000), 2.6, 0.3, datetime(2023, 11, 16, 18, 17, 3, 979960)),
}


def lognormal(rng: np.random.Generator, median: float, sigma: float, top: int) -> int:
    """One lognormal draw with this median and sigma of the log, rounded, in [1, top]."""
    return int(min(top, max(1, round(rng.lognormal(math.log(median), sigma)))))


class HashIds:
    """Prefix-chained block ids, numbered in order of first use."""

    def __init__(self):
        self.next = 0

    def new(self, count: int) -> list[int]:
        ids = list(range(self.next, self.next + count))
        self.next += count
        return ids


def mooncake_rows(rows: int, rng: np.random.Generator) -> list[dict]:
    """``rows`` Mooncake-format requests shaped as the module doc says."""
    ids = HashIds()
    system: dict[int, list[int]] = {}  # system prompt -> its block ids, made on first use
    offsets = arrival_offsets(rows, 6.6, rng, burstiness=0.5)
    out: list[dict] = []
    for t in offsets:
        if out and rng.random() < LATER_TURN_SHARE:
            earlier = out[int(rng.integers(max(0, len(out) - 20), len(out)))]
            prefix_len = earlier["input_length"] + earlier["output_length"]
            kept = earlier["hash_ids"][:earlier["input_length"] // BLOCK]
            own = prefix_len - len(kept) * BLOCK + lognormal(rng, 150, 0.8, 4000)
        else:
            k = int(rng.choice(len(SYSTEM_PROMPT_BLOCKS), p=SYSTEM_PROMPT_SHARES))
            if k not in system:
                system[k] = ids.new(SYSTEM_PROMPT_BLOCKS[k])
            kept = system[k]
            document = rng.random() < 0.1
            own = lognormal(rng, 15000 if document else 500, 0.8 if document else 0.9, 100_000)
        input_len = len(kept) * BLOCK + own
        long_answer = rng.random() < 0.4
        out.append({"timestamp": int(t * 1000), "input_length": input_len,
                    "output_length": lognormal(rng, 350 if long_answer else 15,
                                               0.6 if long_answer else 0.7, 2000),
                    "hash_ids": kept + ids.new(math.ceil(input_len / BLOCK) - len(kept))})
    return out


def write_mooncake(path: Path, rows: int, seed: int) -> None:
    lines = [json.dumps(r) for r in mooncake_rows(rows, np.random.default_rng([seed, 0]))]
    path.write_text("\n".join(lines) + "\n")


def write_azure(path: Path, kind: str, rows: int, seed: int) -> None:
    """``rows`` Azure-format requests of ``kind`` ("conv" or "code"); TIMESTAMP with 7
    fractional digits (100 ns ticks), as the published files have."""
    context, output, rate, shape, start = AZURE[kind]
    rng = np.random.default_rng([seed, 1 if kind == "conv" else 2])
    lines = ["TIMESTAMP,ContextTokens,GeneratedTokens"]
    for t in arrival_offsets(rows, rate, rng, burstiness=shape):
        ticks = round(t * 1e7)  # of 100 ns
        stamp = start + timedelta(microseconds=ticks // 10)
        lines.append(f"{stamp:%Y-%m-%d %H:%M:%S.%f}{ticks % 10},"
                     f"{lognormal(rng, *context)},{lognormal(rng, *output)}")
    path.write_text("\n".join(lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", default="examples/traces", metavar="DIR")
    parser.add_argument("--rows", type=int, default=300, help="requests per trace (default 300)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    files = {"mooncake": out / "mooncake_like.jsonl", "azure conv": out / "azure_conv_like.csv",
             "azure code": out / "azure_code_like.csv"}
    write_mooncake(files["mooncake"], args.rows, args.seed)
    write_azure(files["azure conv"], "conv", args.rows, args.seed)
    write_azure(files["azure code"], "code", args.rows, args.seed)
    for name, path in files.items():
        rows = read_production(path, name.split()[0]).rows
        d = describe_replay(rows, rows)["original"]
        i, o = d["input_len"], d["output_len"]
        print(f"{path} ({path.stat().st_size / 1024:.0f} KiB): {d['count']} requests over "
              f"{d['duration_s']:.0f} s; input tokens mean {i['mean']:.0f}, p50 {i['p50']:.0f}, "
              f"p99 {i['p99']:.0f}; output tokens mean {o['mean']:.0f}, p50 {o['p50']:.0f}; "
              f"{d['shared_prompt_share']:.0%} of prompt tokens in shared blocks")


if __name__ == "__main__":
    main()
