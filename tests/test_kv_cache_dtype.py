"""--kv-cache-dtype (model/kv_cache_dtype.py): a bfloat16 KV cache under a float32 model
against the float32 one on the engine's parity prompts (1-1,200 tokens), bounded as
docs/serving.md states it; the values refused at start-up, each with one line naming the
flag and the value."""

from __future__ import annotations

import pytest
import torch

from epdserve.engine.engine import EngineConfig, LLMEngine
from epdserve.engine.request import SamplingParams
from epdserve.model import kv_cache_dtype
from epdserve.model.tokenizer import load_tokenizer

# A chosen token's logprob moves by at most this between the two caches (0.016 measured over
# these prompts, 16 tokens each); greedy tokens may only part where float32's top two are
# closer than KV_BF16_MARGIN (none did).
KV_BF16_LOGPROB_GAP = 0.05
KV_BF16_MARGIN = 0.1
LENGTHS = [1, 7, 16, 33, 100, 255, 500, 1200]


def test_resolve_names_the_flag_for_what_cannot_be_held():
    f32, bf16 = torch.float32, torch.bfloat16
    assert kv_cache_dtype.resolve("auto", f32, "cpu") == f32 and kv_cache_dtype.resolve("auto", bf16, "cuda") == bf16
    assert kv_cache_dtype.resolve("bfloat16", f32, "cpu") == bf16
    assert kv_cache_dtype.resolve("bfloat16", bf16, "cuda:0") == bf16
    for name in ("fp8", "fp8_e4m3", "fp8_e5m2"):
        with pytest.raises(ValueError, match=f"^--kv-cache-dtype {name}: not supported"):
            kv_cache_dtype.resolve(name, f32, "cpu")
    with pytest.raises(ValueError, match="^--kv-cache-dtype bfloat16 on cuda needs --dtype bfloat16"):
        kv_cache_dtype.resolve("bfloat16", f32, "cuda")
    with pytest.raises(ValueError, match="^--kv-cache-dtype float16: expected one of auto, bfloat16"):
        kv_cache_dtype.resolve("float16", f32, "cpu")


def test_engine_refuses_fp8_at_start(model_info):
    with pytest.raises(ValueError, match="--kv-cache-dtype fp8: not supported"):
        LLMEngine(str(model_info.path), EngineConfig(kv_cache_memory_mb=8, kv_cache_dtype="fp8"))


@pytest.mark.parametrize("weight_format", ["auto", "f32"])
def test_bfloat16_cache_keeps_greedy_tokens_within_its_bound(model_info, weight_format):
    """The same prompts through a float32 and a bfloat16 KV cache (the blocks' decode kernel
    for auto, the dense copy for f32): the cache holds half the bytes, the tokens agree
    until float32's top two are within KV_BF16_MARGIN, the chosen tokens' logprobs within
    KV_BF16_LOGPROB_GAP, and every block comes back."""
    path = str(model_info.path)
    tok = load_tokenizer(path)
    ids = tok("The history of computing is a story of people, ideas and machines. " * 200).input_ids
    prompts = [ids[i:i + n] for i, n in enumerate(LENGTHS)]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=2)
    runs, bytes_per_block = [], []
    for kv in ("auto", "bfloat16"):
        engine = LLMEngine(path, EngineConfig(kv_cache_memory_mb=64, weight_format=weight_format, kv_cache_dtype=kv))
        for i, p in enumerate(prompts):
            engine.add_request(str(i), p, params)
        steps: dict[str, list] = {}
        while engine.has_unfinished():
            for out in engine.step():
                steps.setdefault(out.request_id, []).extend(zip(out.token_ids, out.logprobs))
        runs.append([steps[str(i)] for i in range(len(prompts))])
        bytes_per_block.append(engine.kv_cache[:, :, 0].numel() * engine.kv_cache.element_size())
        assert engine.kv_layout()["dtype"] == {"auto": "float32"}.get(kv, kv)
        assert engine.stats()["blocks_in_use"] == 0
    assert bytes_per_block[1] * 2 == bytes_per_block[0]
    for ref, got in zip(*runs):
        for (token, lp), (other, lp_other) in zip(ref, got):
            if token != other:
                assert lp[1][0][1] - lp[1][1][1] < KV_BF16_MARGIN, (token, other, lp)
                break
            assert abs(lp[1][0][1] - lp_other[1][0][1]) < KV_BF16_LOGPROB_GAP
