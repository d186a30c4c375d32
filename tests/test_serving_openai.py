"""Real deployments (``epdserve serve``) driven through the ``openai`` package."""

from __future__ import annotations

import dataclasses

import httpx
import torch

from epdserve.engine.config import EngineConfig
from epdserve.model import kernels, linear, prefill_attention, step_budget
from epdserve.model.cutover import ROWS as CUTOVER_ROWS
from epdserve.model.tokenizer import chat_prompt_ids


def test_pd_chat_stream_counts_tokens(pd_server, tokenizer, model_info):
    """Streamed PD chat: non-empty text, exact prompt/completion token counts, OpenAI chunk
    shape, one id (also the trace's request_id) with the handoff measured."""
    messages = [{"role": "system", "content": "You are a concise assistant."},
                {"role": "user", "content": "Name three colours of the rainbow."}]
    n = 12
    stream = pd_server.openai().chat.completions.create(
        model=model_info.name, messages=messages, max_tokens=n, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    assert chunks[0].id.startswith("chatcmpl-")
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text.strip()
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == ["length"]
    usage = chunks[-1].usage
    assert chunks[-1].choices == []
    assert usage.prompt_tokens == len(chat_prompt_ids(tokenizer, messages))
    assert usage.completion_tokens == n
    assert usage.total_tokens == usage.prompt_tokens + n

    rec = pd_server.trace(chunks[0].id)
    assert rec["mode"] == "pd" and rec["output_tokens"] == n and rec["prompt_tokens"] == usage.prompt_tokens
    for key in ("queue_ms", "prefill_ms", "kv_bytes", "kv_export_ms", "kv_import_ms", "kv_transfer_ms",
                "decode_ms", "ttft_ms", "e2e_ms", "router_queue_ms"):
        assert rec.get(key) is not None and rec[key] >= 0, key
    assert rec["kv_bytes"] > 0
    assert rec["kv_transfer_ms"] >= rec["kv_export_ms"] + rec["kv_import_ms"]
    assert rec["e2e_ms"] >= rec["ttft_ms"]


def test_models_health_metrics(server, model_info):
    models = server.openai().models.list().data
    assert [m.id for m in models] == [model_info.name]
    raw = httpx.get(server.url + "/v1/models").json()["data"][0]
    assert raw["max_model_len"] == model_info.max_model_len
    health = httpx.get(server.url + "/health")
    assert health.status_code == 200
    roles = sorted(w["role"] for w in health.json()["workers"])
    assert roles == (["decode", "prefill"] if server.mode == "pd" else ["colocated"])
    for w in health.json()["workers"]:
        assert w["state"] == "up" and w["cores"] and w["blocks_total"] > 0
        # Every engine setting as the worker runs it: EngineConfig's fields, each declared once.
        assert set(w["engine"]) == {f.name for f in dataclasses.fields(EngineConfig)}
        assert (w["engine"]["block_size"], w["engine"]["device"]) == (16, "cpu")
    # --weight-format auto by role: dense float32 for prefill GEMMs, the GGUF's Q4_1 blocks for
    # decode, both where one worker runs both phases.
    formats = {w["role"]: w["weight_format"] for w in health.json()["workers"]}
    assert formats == ({"prefill": "f32", "decode": "q4_1"} if server.mode == "pd" else {"colocated": "q4_1+f32"})
    # The choices each worker measured (or read) on this machine: the block kernel / BLAS
    # cut-over with blocks, the float32 GEMM library with a float32 dense copy, the prefill
    # attention's way where the CPU offers more than SDPA, the tokens a step computes.
    tuned = {w["role"]: w["tuned"] for w in health.json()["workers"]}
    ways = prefill_attention.ways(torch.float32, 9, 3, 64)
    for role, fmt in formats.items():
        assert ("kernel_rows" in tuned[role]) == ("q4_1" in fmt)
        assert ("f32_gemm" in tuned[role]) == ("f32" in fmt)
        assert ("prefill_attention" in tuned[role]) == (ways != ["sdpa"])
        assert ("q4_1_layout" in tuned[role]) == ("q4_1" in fmt and kernels.AVX512 <= kernels.cpu_flags())
        assert step_budget.valid(tuned[role]["max_num_batched_tokens"]["value"])
        valid = {"kernel_rows": (0, *CUTOVER_ROWS), "f32_gemm": linear.F32_GEMMS, "prefill_attention": ways,
                 "q4_1_layout": linear.Q4_1_LAYOUTS,
                 "max_num_batched_tokens": [tuned[role]["max_num_batched_tokens"]["value"]]}
        for name, choice in tuned[role].items():
            assert choice["value"] in valid[name] and choice["source"] in ("cache", "measured", "disturbed")
    metrics = httpx.get(server.url + "/metrics")
    assert metrics.status_code == 200
    for w in health.json()["workers"]:
        labels = (f'engine="{w["worker_id"]}",model_name="{model_info.name}",role="{w["role"]}",'
                  f'worker="{w["worker_id"]}"')
        assert f"epdserve:kv_blocks_total{{{labels}}}" in metrics.text
    for name in ("epdserve:time_to_first_token_seconds_bucket", "epdserve:e2e_request_latency_seconds_bucket",
                 "epdserve:kv_transfer_seconds_bucket", "epdserve:kv_transfer_bytes_bucket",
                 "epdserve:prompt_tokens_total", "epdserve:generation_tokens_total",
                 "epdserve:request_failure_total", "epdserve:num_requests_running",
                 "epdserve:kv_cache_usage_perc", "epdserve:num_preemptions_total"):
        assert name in metrics.text, name


def test_colocated_completion_trace(colocated_server, tokenizer, model_info):
    res = colocated_server.generate("completion", "The capital of France is", stream=False,
                                    max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
    assert res.id.startswith("cmpl-") and res.usage.completion_tokens == 6
    assert res.usage.prompt_tokens == len(tokenizer("The capital of France is").input_ids)
    rec = colocated_server.trace(res.id)
    assert rec["mode"] == "colocated" and rec["kv_bytes"] == 0 and rec["kv_transfer_ms"] == 0
    for key in ("queue_ms", "prefill_ms", "decode_ms", "ttft_ms", "e2e_ms"):
        assert rec[key] >= 0, key
