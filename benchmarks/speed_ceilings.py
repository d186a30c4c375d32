"""Each engine's figures of ``benchmarks/speed.py`` as a share of the machine's ceilings
(``benchmarks/engine_limits.py``, measured in the same run on the engine's threads).

* **prefill**, at concurrency 1: the weight-matmul FLOPs of the mean prompt
  (:func:`engine_limits.forward_flops` of the prompt tokens the server reported) over TTFT
  p50 is the GFLOP/s the engine reached; the ceiling is the GEMM aggregate measured at the T
  nearest that prompt length, in the dtype its prefill GEMMs run in (bfloat16 for an
  epdserve worker whose ``--weight-format`` holds a bf16 copy, where measured; else float32). TTFT also holds the HTTP round trip, tokenization,
  scheduling, attention and the first token's LM head and sampling, so the share is a lower
  bound of the matmuls' own; a prefix-cache hit on the chat template's first tokens makes
  it slightly high.
* **decode**, at every level C (batch C): the roofline floor, the bytes of a decode step of
  C sequences at the mean context (prompt + half the output) at the measured copy GB/s,
  over ITL p50. Each engine's weights are counted as it holds them: epdserve its GGUF
  blocks when its weight format has them (else dense float32), vllm and transformers dense float32 (``--dtype float32``),
  llama-server the GGUF's own blocks with its default float16 KV cache. A share of 1 is a
  step at the floor.
"""

from __future__ import annotations

from pathlib import Path

import engine_limits  # benchmarks/

# engine row -> (weight format for engine_limits.weight_read_bytes, KV bytes per element)
ENGINE_FORMATS = {"epdserve": ("engine", 4), "vllm": ("float32", 4),
                  "transformers-generate": ("float32", 4), "transformers-cb": ("float32", 4),
                  "llama-server": ("gguf", 2)}


def chat_prompt_tokens(tokenizer, requests) -> int:
    """The mean token count of ``requests`` as chat prompts (the template around each
    user message): the T to measure the GEMM ceiling at."""
    from epdserve.model.tokenizer import chat_prompt_ids

    lens = [len(chat_prompt_ids(tokenizer, [{"role": "user", "content": r.prompt}])) for r in requests]
    return round(sum(lens) / len(lens))


def _mean_prompt(result: dict) -> float:
    return result["total_input_tokens"] / result["completed"] if result["completed"] else 0.0


def shares(limits: dict, results: dict[str, dict[int, dict]], output_len: int, model_dir: Path,
           gguf: str | None, weight_formats: dict[str, str] | None = None,
           kv_dtypes: dict[str, str] | None = None, q4_1_layouts: dict[str, str] | None = None) -> dict:
    """``{engine: {"prefill": {...} (C=1 only), "decode": {str(C): {...}}}}``, see the
    module doc; ``weight_formats``: engine -> its workers' ``--weight-format`` as /health
    named it (epdserve); ``kv_dtypes``: engine -> its KV cache's dtype where it is not
    :data:`ENGINE_FORMATS`' (epdserve's /health ``kv_dtype``, vLLM's ``--dtype``); ``q4_1_layouts``: engine ->
    the layout its Q4_1 blocks were held in (epdserve's /health ``tuned``; ``gguf`` if absent). An engine
    whose weight format cannot be read here is left out of decode."""
    cfg = limits["model"]
    gbs = limits["memory"]["copy_gbs"]
    weights: dict[tuple[str, str], dict | None] = {}
    out = {}
    for name, per_c in results.items():
        fmt, kv_elem = ENGINE_FORMATS.get(name, ("float32", 4))
        kv_elem = {"bfloat16": 2, "float32": 4}.get((kv_dtypes or {}).get(name, ""), kv_elem)
        served = (weight_formats or {}).get(name, "")
        if served and "q4_1" not in served:
            fmt = "float32"  # a dense copy only (a bf16 one still counted at 4 bytes: an upper bound)
        gemm_dtype = "bfloat16" if "bf16" in served and "bfloat16" in limits["gemm"] else "float32"
        layout = (q4_1_layouts or {}).get(name, "gguf")
        if (fmt, layout) not in weights:
            try:
                weights[fmt, layout] = engine_limits.weight_read_bytes(model_dir, fmt, gguf_path=gguf,
                                                                       q4_1_layout=layout)
            except (OSError, ValueError, KeyError):
                weights[fmt, layout] = None
        read = weights[fmt, layout]
        entry: dict = {"weights_format": served or (read["format"] if read else None),
                       "kv_bytes_per_element": kv_elem, "decode": {}}
        one = per_c.get(1)
        if one and one["completed"] and one["median_ttft_ms"] > 0:
            tokens = _mean_prompt(one)
            flops = engine_limits.forward_flops(cfg, tokens)
            reached = flops / (one["median_ttft_ms"] / 1e3) / 1e9
            t, ceiling = engine_limits.prefill_ceiling(limits, tokens, gemm_dtype)
            entry["prefill"] = {"prompt_tokens": tokens, "flops": flops, "ttft_p50_ms": one["median_ttft_ms"],
                                "gflops": reached, "ceiling_tokens": t, "ceiling_gflops": ceiling,
                                "ceiling_dtype": gemm_dtype, "share": reached / ceiling}
        for c, r in per_c.items():
            if read is None or not r["completed"] or r["median_itl_ms"] <= 0:
                continue
            context = _mean_prompt(r) + output_len / 2
            nbytes = engine_limits.decode_step_bytes(
                read, engine_limits.kv_bytes_per_token(cfg, kv_elem), c, context)
            floor = engine_limits.floor_ms(nbytes, gbs)
            entry["decode"][str(c)] = {"batch": c, "context": context, "bytes": nbytes, "copy_gbs": gbs,
                                       "floor_ms": floor, "itl_p50_ms": r["median_itl_ms"],
                                       "share": floor / r["median_itl_ms"]}
        out[name] = entry
    return out


def lines(limits: dict, found: dict) -> list[str]:
    """The printed section: the ceilings, then each engine's shares."""
    f32 = limits["gemm"]["float32"]
    out = [f"\nceilings ({limits['threads']} threads, benchmarks/engine_limits.py): float32 GEMM "
           + ", ".join(f"T={t}: {g['aggregate_gflops']:.1f} GFLOP/s" for t, g in f32.items())
           + f"; copy {limits['memory']['copy_gbs']:.2f} GB/s, read {limits['memory']['read_gbs']:.2f} GB/s"]
    for name, e in found.items():
        p = e.get("prefill")
        if p:
            out.append(f"  {name:<22} prefill C=1: {p['flops'] / 1e9:.1f} GFLOP ({p['prompt_tokens']:.0f} tokens) "
                       f"in TTFT p50 {p['ttft_p50_ms']:.0f} ms = {p['gflops']:.1f} GFLOP/s, "
                       f"{100 * p['share']:.0f}% of {p['ceiling_gflops']:.1f} ({p.get('ceiling_dtype', 'float32')} "
                       f"GEMM, T={p['ceiling_tokens']})")
        for c, d in e["decode"].items():
            out.append(f"  {name:<22} decode C={c}: floor {d['floor_ms']:.2f} ms ({d['bytes'] / 1e6:.1f} MB, "
                       f"{e['weights_format']}, context {d['context']:.0f}) / ITL p50 {d['itl_p50_ms']:.1f} ms "
                       f"= {100 * d['share']:.0f}% of the roofline")
    if any(e.get("prefill", {}).get("share", 0) > 1 or any(d["share"] > 1 for d in e["decode"].values())
           for e in found.values()):
        out.append("  a share above 100%: the ceiling was measured low (the machine was busy while "
                   "engine_limits ran, see its medians); run again on a quiet machine")
    return out
