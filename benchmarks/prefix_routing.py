"""What prefix-aware routing buys: 2 colocated replicas (``epdserve serve --workers 2``, the
cores split between them as serve does), the same shared-prefix trace
(:func:`epdserve.bench.datasets.shared_prefix`, prefixes picked at random, Poisson arrivals)
served under ``--routing least-loaded`` and then ``--routing prefix-aware``, in one run.

Per policy: the cached-token share (prompt tokens the workers found in their prefix caches
over all prompt tokens, from the server trace's ``cached_tokens``), TTFT p50/p95 (client
side, ms) and how the requests split between the workers; then prefix-aware over
least-loaded for each. With ``--repeats R`` the policies run R times each in ABBA order
(least-loaded, prefix-aware, prefix-aware, least-loaded, ...) so that a drift of the
machine's load weighs on both alike; the numbers pool every run of a policy. Writes
``prefix_routing.json`` and ``prefix_routing.png`` to ``--output``. On a shared machine the
TTFTs are noisy: compare within one run only.

    .venv/bin/python benchmarks/prefix_routing.py [--num-prompts 32] [--prefixes 6] [--prefix-len 384] \\
        [--request-rate 0.3] [--repeats 2] [--output results/prefix-routing]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections import Counter
from pathlib import Path

import numpy as np

from epdserve.bench.client import run_trace
from epdserve.bench.datasets import shared_prefix
from epdserve.bench.processes import ServerProcess, port_is_free
from epdserve.model.loader import resolve_model
from epdserve.model.tokenizer import load_tokenizer

POLICIES = ("least-loaded", "prefix-aware")


def serve_and_run(policy: str, requests, out: Path, port: int, run: int) -> dict:
    """Start 2 colocated replicas under ``policy``, send the trace, stop them; this run's
    trace lines of the served requests (``served``) and client TTFTs (``ttft_ms``)."""
    trace_file = out / f"{policy}.{run}.server.jsonl"
    trace_file.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "epdserve", "serve", "--mode", "colocated", "--workers", "2",
           "--routing", policy, "--port", str(port), "--trace-file", str(trace_file)]
    server = ServerProcess(policy, cmd, out / f"{policy}.{run}.server.log", f"http://127.0.0.1:{port}")
    server.start()
    try:
        server.wait_healthy(600, workers=2)
        model = resolve_model(None).name
        records = asyncio.run(run_trace(server.base_url, model, requests, warmup=1, progress=False))
    finally:
        server.stop()
    lines = {r["request_id"]: r for r in map(json.loads, trace_file.read_text().splitlines())}
    served = [lines[r.request_id] for r in records if r.success and r.request_id in lines]
    return {"requests": len(records), "failed": sum(not r.success for r in records), "served": served,
            "ttft_ms": [1e3 * r.ttft_s for r in records if r.success and r.ttft_s is not None]}


def summary(policy: str, runs: list[dict]) -> dict:
    """One policy's numbers over its runs (pooled): cached-token share, TTFT p50/p95 (ms),
    requests per worker, routing reasons, and prompt tokens believed vs found cached."""
    served = [s for r in runs for s in r["served"]]
    ttfts = [t for r in runs for t in r["ttft_ms"]]
    return {"policy": policy, "runs": len(runs), "requests": sum(r["requests"] for r in runs),
            "failed": sum(r["failed"] for r in runs), "cached_token_share": share(served),
            "cached_token_share_per_run": [share(r["served"]) for r in runs],
            "ttft_p50_ms": float(np.percentile(ttfts, 50)), "ttft_p95_ms": float(np.percentile(ttfts, 95)),
            "ttft_p50_ms_per_run": [float(np.percentile(r["ttft_ms"], 50)) for r in runs],
            "ttft_ms": ttfts, "by_worker": dict(Counter(s["worker"] for s in served)),
            "believed_tokens": sum(s.get("routing_believed_tokens") or 0 for s in served),
            "cached_tokens_where_believed": sum(s.get("cached_tokens") or 0 for s in served
                                                if s.get("routing_believed_tokens")),
            "reasons": dict(Counter(s.get("routing_reason") for s in served if s.get("routing_reason")))}


def share(served: list[dict]) -> float:
    """Cached prompt tokens over prompt tokens of one run's served requests."""
    return sum(s.get("cached_tokens") or 0 for s in served) / max(sum(s["prompt_tokens"] for s in served), 1)


def plot(runs: dict, path: Path) -> None:
    """Cached-token share and TTFT distribution per policy, side by side."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.6))
    left.bar(list(runs), [runs[p]["cached_token_share"] for p in runs], color=["#888", "#2a7"])
    left.set_ylabel("cached prompt tokens / prompt tokens")
    left.set_ylim(0, 1)
    right.boxplot([runs[p]["ttft_ms"] for p in runs], showfliers=True)
    right.set_xticks(range(1, len(runs) + 1), list(runs))
    right.set_ylabel("TTFT (ms)")
    fig.suptitle("2 colocated replicas, shared-prefix trace: least-loaded vs prefix-aware")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    args = parse_args()
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    if not port_is_free(args.port):
        print(f"prefix_routing: error: port {args.port} is in use (--port)", file=sys.stderr)
        return 2
    tokenizer = load_tokenizer(resolve_model(None).path)
    requests = shared_prefix(tokenizer, num_prompts=args.num_prompts, prefix_count=args.prefixes,
                             prefix_len=args.prefix_len, suffix_len=(32, 64), output_len=(16, 32),
                             request_rate=args.request_rate, seed=args.seed, order="random")
    raw: dict[str, list[dict]] = {p: [] for p in POLICIES}
    for r in range(args.repeats):
        for policy in (POLICIES if r % 2 == 0 else POLICIES[::-1]):  # ABBA
            raw[policy].append(serve_and_run(policy, requests, out, args.port, r))
            print(f"run {r}: {policy}: cached-token share {share(raw[policy][-1]['served']):.3f}", flush=True)
    runs = {p: summary(p, raw[p]) for p in POLICIES}
    for policy in POLICIES:
        print(json.dumps({k: v for k, v in runs[policy].items() if k != "ttft_ms"}), flush=True)
    ll, pa = runs["least-loaded"], runs["prefix-aware"]
    ratios = {"cached_token_share": pa["cached_token_share"] / max(ll["cached_token_share"], 1e-9),
              "ttft_p50": pa["ttft_p50_ms"] / ll["ttft_p50_ms"], "ttft_p95": pa["ttft_p95_ms"] / ll["ttft_p95_ms"]}
    print("prefix-aware / least-loaded:", json.dumps({k: round(v, 3) for k, v in ratios.items()}))
    (out / "prefix_routing.json").write_text(json.dumps({"settings": vars(args), "runs": runs,
                                                         "ratios_prefix_aware_over_least_loaded": ratios},
                                                        indent=1))
    plot(runs, out / "prefix_routing.png")
    print(f"wrote {out / 'prefix_routing.json'} and {out / 'prefix_routing.png'}")
    return 0


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--prefixes", type=int, default=6, help="distinct shared prefixes")
    p.add_argument("--prefix-len", type=int, default=384, help="tokens per shared prefix")
    # 0.5 req/s is about the capacity of 2 one-core replicas on this trace (a request ~2 s of
    # prefill uncached and ~2 s of decode): 0.3 leaves room, so queues measure the policy.
    p.add_argument("--request-rate", type=float, default=0.3, help="Poisson arrivals, requests/s")
    p.add_argument("--repeats", type=int, default=2, help="runs per policy, in ABBA order")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--port", type=int, default=8123)
    p.add_argument("--output", default="results/prefix-routing")
    return p.parse_args()


if __name__ == "__main__":
    sys.exit(main())
