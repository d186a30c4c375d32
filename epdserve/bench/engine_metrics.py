"""Which metric of which engine (vLLM, SGLang, llama.cpp, epdserve) is which server-side stage:
:data:`STAGES`, with the sources each name was checked against."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

ENGINES = {"vllm": "vllm:", "sglang": "sglang:", "llama.cpp": "llamacpp:", "epdserve": "epdserve:"}


@dataclass(frozen=True)
class Source:
    """Where an engine keeps a stage. ``kind``: "histogram" (s), "bytes", "counter", "gauge",
    "ratio" (Δ``metric`` / Σ Δ``over``) or "seconds" (a counter of s, per request and per token of
    Δ``over[0]``; ``per_gap``: per gap, tokens - requests). ``exclude``: label values left out."""

    kind: str
    metric: str
    note: str
    over: tuple[str, ...] = ()
    exclude: tuple[tuple[str, str], ...] = ()
    per_gap: bool = False

    def present(self, samples: Mapping[str, object]) -> bool:
        suffixes = {"histogram": ("_count",), "bytes": ("_count",), "gauge": ("",)}.get(self.kind, ("_total", ""))
        return any(self.metric + x in samples for x in suffixes)


def _h(metric: str, note: str, **kw) -> Source:
    return Source("histogram", metric, note, **kw)


STAGE_INFO = {"queue": ("queue time", "ms"), "prefill": ("prefill time", "ms"),
              "decode": ("decode time", "ms"), "ttft": ("TTFT", "ms"),
              "itl": ("inter-token latency", "ms"), "e2e": ("E2E latency", "ms"),
              "requests": ("requests finished", "count"), "kv_cache_usage": ("KV cache usage", "share"),
              "prefix_cache_hit_rate": ("prefix-cache hit rate", "share of prompt tokens"),
              "kv_transfer": ("KV hand-off time", "ms"), "kv_bytes": ("KV hand-off size", "MB")}

# stage -> engine -> places to look, first found wins; an engine missing does not export it.
# vLLM V1: docs/design/metrics.md, vllm/v1/metrics/loggers.py; NIXL: kv_connector/v1/nixl/stats.py
# (on the decode instance, per transfer). SGLang: python/sglang/srt/metrics/collector.py,
# docs/references/production_metrics.md. llama.cpp: tools/server/server-task.cpp to_metrics()
# (llama-cpp-python 0.3.36), tools/server/README.md. epdserve: epdserve/serving/metrics.py.
_GAP = "gap between successive tokens"
_HITS = "Δ hits ÷ Δ queries (prompt tokens)"
_DONE, _ERRORS = "finished requests, all finish reasons but error", (("finished_reason", "error"),)
STAGES: dict[str, dict[str, tuple[Source, ...]]] = {
    "queue": {
        "vllm": (_h("vllm:request_queue_time_seconds", "engine core: queued → first scheduled"),),
        "sglang": (_h("sglang:queue_time_seconds", "scheduler: waiting queue → forward"),),
        "epdserve": (_h("epdserve:request_queue_time_seconds", "worker queues: arrival at a worker → first "
                        "scheduled (router queue left out); in PD a request waits twice, prefill and decode "
                        "worker", exclude=(("stage", "router"),)),)},
    "prefill": {
        "vllm": (_h("vllm:request_prefill_time_seconds", "first scheduled → first token"),),
        "llama.cpp": (Source("seconds", "llamacpp:prompt_seconds", "Σ prompt-processing wall time (batched "
                             "prompts counted once) ÷ requests; ms/token over uncached prompt tokens",
                             over=("llamacpp:prompt_tokens",)),),
        "epdserve": (_h("epdserve:request_prefill_time_seconds", "first scheduled → first token, on the "
                        "worker that prefilled"),)},
    "decode": {
        "vllm": (_h("vllm:request_decode_time_seconds", "first token → last token"),),
        "llama.cpp": (Source("seconds", "llamacpp:tokens_predicted_seconds", "Σ per-request generation "
                             "time (first → last token) ÷ requests", over=("llamacpp:tokens_predicted",)),),
        "epdserve": (_h("epdserve:request_decode_time_seconds", "first token → last token on the worker "
                        "that decoded (an imported request: from first scheduled)"),)},
    "ttft": {
        "vllm": (_h("vllm:time_to_first_token_seconds", "frontend arrival → first token"),),
        "sglang": (_h("sglang:time_to_first_token_seconds", "tokenizer arrival → first token"),),
        "epdserve": (_h("epdserve:time_to_first_token_seconds", "HTTP arrival at the router → first token"),)},
    "itl": {
        "vllm": (_h("vllm:inter_token_latency_seconds", _GAP),
                 _h("vllm:time_per_output_token_seconds", _GAP + " (older name)")),
        "sglang": (_h("sglang:inter_token_latency_seconds", _GAP),
                   _h("sglang:time_per_output_token_seconds", _GAP + " (older name)")),
        "llama.cpp": (Source("seconds", "llamacpp:tokens_predicted_seconds", "Σ generation time ÷ (tokens - "
                             "requests): the mean gap, no percentiles", over=("llamacpp:tokens_predicted",),
                             per_gap=True),),
        "epdserve": (_h("epdserve:inter_token_latency_seconds", "gap between outputs reaching the router"),)},
    "e2e": {
        "vllm": (_h("vllm:e2e_request_latency_seconds", "frontend arrival → last token"),),
        "sglang": (_h("sglang:e2e_request_latency_seconds", "arrival → finish"),),
        "epdserve": (_h("epdserve:e2e_request_latency_seconds", "HTTP arrival at the router → last token"),)},
    "requests": {
        "vllm": (Source("counter", "vllm:request_success", _DONE, exclude=_ERRORS),),
        "sglang": (Source("counter", "sglang:num_requests", "requests processed"),),
        "epdserve": (Source("counter", "epdserve:request_success", _DONE, exclude=_ERRORS),)},
    "kv_cache_usage": {
        "vllm": (Source("gauge", "vllm:kv_cache_usage_perc", "share of KV blocks in use"),
                 Source("gauge", "vllm:gpu_cache_usage_perc", "share of KV blocks in use (older name)")),
        "sglang": (Source("gauge", "sglang:token_usage", "share of KV token slots in use"),),
        "llama.cpp": (Source("gauge", "llamacpp:kv_cache_usage_ratio", "share of KV cells in use (older "
                             "llama.cpp only)"),),
        "epdserve": (Source("gauge", "epdserve:kv_cache_usage_perc", "share of KV blocks in use, per worker"),)},
    "prefix_cache_hit_rate": {
        "vllm": (Source("ratio", "vllm:prefix_cache_hits", _HITS, over=("vllm:prefix_cache_queries",)),
                 Source("ratio", "vllm:gpu_prefix_cache_hits", _HITS + ", older name",
                        over=("vllm:gpu_prefix_cache_queries",))),
        "sglang": (Source("gauge", "sglang:cache_hit_rate", "the scheduler's hit-rate gauge, sampled"),),
        "llama.cpp": (Source("ratio", "llamacpp:prompt_tokens_cached", "Δ cached ÷ Δ (cached + processed) "
                             "prompt tokens", over=("llamacpp:prompt_tokens_cached", "llamacpp:prompt_tokens")),),
        "epdserve": (Source("ratio", "epdserve:prefix_cache_hits", _HITS,
                            over=("epdserve:prefix_cache_queries",)),)},
    "kv_transfer": {
        "vllm": (_h("vllm:nixl_xfer_time_seconds", "the decode instance pulling a request's KV blocks over "
                    "NIXL (the transfer alone)"),),
        "epdserve": (_h("epdserve:kv_transfer_seconds", "a PD request's hand-off: export + router hop + "
                        "fetch + import"),)},
    "kv_bytes": {
        "vllm": (Source("bytes", "vllm:nixl_bytes_transferred", "KV bytes per NIXL transfer"),),
        "epdserve": (Source("bytes", "epdserve:kv_transfer_bytes", "KV bytes per PD request"),)},
}


STAGES_OF = {engine: {stage: by[engine] for stage, by in STAGES.items() if engine in by} for engine in ENGINES}
