"""The fused layer kernels (model/layer_kernels.cpp) against their PyTorch versions
(model/layer_ops.py *_torch), on SmolLM2-135M's shapes (9 query heads, 3 KV heads, head
dim 64, hidden 576), and a whole model with them against one without."""

from __future__ import annotations

import pytest
import torch

from epdserve.model import kernels, layer_ops
from epdserve.model.llama import AttentionMetadata, LlamaModel, PrefillSeq

pytestmark = pytest.mark.skipif(not kernels.cpu_supported(), reason="the kernels need AVX2 and FMA")

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16


@pytest.fixture(scope="module", autouse=True)
def built():
    assert kernels.available(), "the kernels failed to build (see the log)"


def randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def test_rms_norm_matches_transformers_order():
    x, w = randn(7, 576) * 3, randn(576, seed=1)
    got = torch.ops.epdserve.rms_norm(x, w, 1e-5)
    torch.testing.assert_close(got, layer_ops.rms_norm_torch(x, w, 1e-5), rtol=1e-5, atol=1e-5)


def test_rope_and_kv_write_are_bit_identical():
    positions, slots = torch.tensor([0, 5, 17, 3, 100, 2, 9]), torch.tensor([3, 9, 1, 40, 63, 0, 7])
    qkv = randn(7, (HEADS + 2 * KV_HEADS) * HEAD_DIM)
    cos, sin = randn(200, HEAD_DIM, seed=1), randn(200, HEAD_DIM, seed=2)
    caches = [torch.zeros(64, KV_HEADS, HEAD_DIM) for _ in range(4)]
    expected = qkv.clone()
    torch.ops.epdserve.rope_write_kv(qkv, positions, cos, sin, caches[0], caches[1], slots, HEADS)
    layer_ops.rope_write_kv_torch(expected, positions, cos, sin, caches[2], caches[3], slots, HEADS)
    assert torch.equal(qkv, expected)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    assert caches[0][slots].abs().sum() > 0 and caches[0][10:40].abs().sum() == 0  # only the given slots


@pytest.mark.parametrize("ctx_lens", [[1, 16, 17, 250], [37, 3]])
def test_paged_decode_attention_matches_sdpa(ctx_lens):
    num_blocks = 64
    k_cache, v_cache = randn(num_blocks * BLOCK, KV_HEADS, HEAD_DIM, seed=1), randn(num_blocks * BLOCK, KV_HEADS, HEAD_DIM, seed=2)
    width = max(-(-n // BLOCK) for n in ctx_lens)
    # Scattered, non-contiguous blocks, padded with block 0 as the runner pads.
    perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(3))
    tables = torch.zeros(len(ctx_lens), width, dtype=torch.long)
    used = 0
    for b, n in enumerate(ctx_lens):
        k = -(-n // BLOCK)
        tables[b, :k] = perm[used:used + k]
        used += k
    q = randn(len(ctx_lens), HEADS, HEAD_DIM, seed=4) * 4  # peaky softmax
    lens = torch.tensor(ctx_lens)
    got = layer_ops.paged_decode_attention(q, k_cache, v_cache, tables, lens, BLOCK)
    expected = layer_ops.paged_decode_attention_torch(q, k_cache, v_cache, tables, lens, BLOCK)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=2e-5)


def test_bad_arguments_raise_instead_of_reading_out_of_bounds():
    q, cache = randn(1, HEADS, HEAD_DIM), randn(4 * BLOCK, KV_HEADS, HEAD_DIM)
    with pytest.raises(RuntimeError, match="outside the cache"):
        layer_ops.paged_decode_attention(q, cache, cache, torch.tensor([[9]]), torch.tensor([5]), BLOCK)
    with pytest.raises(RuntimeError, match="outside its block table"):
        layer_ops.paged_decode_attention(q, cache, cache, torch.tensor([[1]]), torch.tensor([17]), BLOCK)
    qkv = randn(1, (HEADS + 2 * KV_HEADS) * HEAD_DIM)
    with pytest.raises(RuntimeError, match="out of range"):
        layer_ops.rope_write_kv(qkv, torch.tensor([0]), randn(8, HEAD_DIM), randn(8, HEAD_DIM), cache, cache,
                                torch.tensor([4 * BLOCK]), HEADS)
    with pytest.raises(RuntimeError, match="columns"):
        layer_ops.rope_write_kv(qkv, torch.tensor([0]), randn(8, HEAD_DIM), randn(8, HEAD_DIM), cache, cache,
                                torch.tensor([0]), HEADS + 1)


def test_model_with_kernels_matches_pytorch_operators(model_info, monkeypatch):
    """A prefill of 40 tokens and 8 decode steps: the same greedy tokens, logits within
    float32 summation noise, with the kernels and with the PyTorch operators."""
    model = LlamaModel.load(model_info.path, weight_format="q4_1")
    prompt = randn(40, seed=5).abs().mul(1000).long().tolist()

    def greedy():
        cache = model.allocate_kv_cache(8, BLOCK)
        table = torch.arange(8)
        tokens, logits_seen = list(prompt), []
        for step in range(9):
            start = 0 if step == 0 else len(tokens) - 1
            pos = torch.arange(start, len(tokens))
            ids = torch.tensor(tokens[start:])
            prefill = [PrefillSeq(0, len(pos), len(tokens), table)] if step == 0 else []
            decode = torch.tensor([] if step == 0 else [0])
            meta = AttentionMetadata(positions=pos, slot_mapping=pos, prefills=prefill, decode_rows=decode,
                                     decode_block_tables=table.view(1, -1)[: len(decode)],
                                     decode_ctx_lens=torch.tensor([len(tokens)])[: len(decode)],
                                     logits_rows=torch.tensor([len(pos) - 1]))
            logits = model.forward(ids, meta, cache)
            logits_seen.append(logits)
            tokens.append(int(logits.argmax()))
        return tokens, torch.cat(logits_seen)

    fused_tokens, fused_logits = greedy()
    monkeypatch.setattr(layer_ops, "fused", lambda x: False)
    torch_tokens, torch_logits = greedy()
    assert fused_tokens == torch_tokens
    torch.testing.assert_close(fused_logits, torch_logits, rtol=1e-4, atol=1e-3)
