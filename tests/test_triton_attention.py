"""The Triton attention kernels over the paged KV pool (model/triton_attention.py) against
the gathering PyTorch path (``layer_ops.paged_decode_attention_torch``) and masked SDPA over
gathered blocks: decode with ragged contexts (1, block boundaries, long), GQA ratios 1, 3
and 4, padded and scattered block tables, split-K forced and by the rule; prefill behind a
cached prefix; float32 and bfloat16.

Without a GPU the kernels run on CPU tensors in Triton's interpreter (``TRITON_INTERPRET=1``,
set here before Triton is imported); with one, the same tests run the compiled kernels on
``cuda`` tensors. Under the interpreter bfloat16 tiles are widened to float32 before each
``tl.dot`` (``triton_attention.INTERPRETED``); the GPU runs bfloat16 dots.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is first imported

triton_attention = pytest.importorskip("epdserve.model.triton_attention", reason="needs triton")
from epdserve.model import layer_ops  # noqa: E402
from epdserve.model.prefill_attention import gathered_prefill_attention  # noqa: E402
from scripts import load_script  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BLOCK = 16
HEAD_DIM = 32
NUM_BLOCKS = 48


def randn(*shape, seed=0, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(DEVICE, dtype)


def pool(kv_heads, dtype, seed=1):
    """K and V caches ``[slots, kv_heads, head_dim]``."""
    return (randn(NUM_BLOCKS * BLOCK, kv_heads, HEAD_DIM, seed=seed, dtype=dtype),
            randn(NUM_BLOCKS * BLOCK, kv_heads, HEAD_DIM, seed=seed + 1, dtype=dtype))


def tables(ctx_lens, pad_blocks=0, seed=3):
    """Scattered block tables, each row padded with random (valid) block ids up to the widest
    context plus ``pad_blocks``."""
    g = torch.Generator().manual_seed(seed)
    width = max(-(-n // BLOCK) for n in ctx_lens) + pad_blocks
    perm = torch.randperm(NUM_BLOCKS, generator=g)
    out = torch.randint(0, NUM_BLOCKS, (len(ctx_lens), width), generator=g)
    used = 0
    for b, n in enumerate(ctx_lens):
        k = -(-n // BLOCK)
        out[b, :k] = perm[used:used + k]
        used += k
    return out.to(DEVICE)


def assert_within_rounding(got, ref):
    """float32: ``got`` within 1e-5 of the float32 reference; bfloat16: within one bfloat16
    unit in the last place of each reference value (2^-7 relative) plus 1e-3: the output's
    rounding (Triton's interpreter truncates float32 to bfloat16, a GPU rounds to nearest:
    half that), the float32 maths inside the same."""
    diff = (got.float() - ref).abs()
    if got.dtype == torch.float32:
        assert diff.max().item() < 1e-5, diff.max().item()
    else:
        excess = diff - (2.0**-7 * ref.abs() + 1e-3)
        assert excess.max().item() <= 0, (diff.max().item(), excess.max().item())


def assert_close_to_reference(got, q, k_cache, v_cache, block_tables, lens):
    """``got`` against the PyTorch path in float32 on the same (rounded) inputs."""
    assert got.shape == q.shape and got.dtype == q.dtype
    ref = layer_ops.paged_decode_attention_torch(q.float(), k_cache.float(), v_cache.float(), block_tables, lens,
                                                 BLOCK)
    assert_within_rounding(got, ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize("ctx_lens", [[1], [16, 17, 1, 33], [70, 5, 32, 150, 2, 48, 64, 99]])
def test_decode_matches_the_gathering_path(ctx_lens, group, dtype):
    kv_heads = 2
    k_cache, v_cache = pool(kv_heads, dtype)
    block_tables = tables(ctx_lens, pad_blocks=2)
    lens = torch.tensor(ctx_lens, device=DEVICE)
    q = randn(len(ctx_lens), kv_heads * group, HEAD_DIM, seed=4, dtype=dtype) * 3  # peaky softmax
    got = triton_attention.paged_decode_attention(q, k_cache, v_cache, block_tables, lens, BLOCK)
    assert_close_to_reference(got, q, k_cache, v_cache, block_tables, lens)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("splits", [2, 7])
def test_split_k_merges_to_the_same_output(splits, dtype):
    """Parts that hold no position of a short context (ctx 1 with 7 parts) merge to nothing."""
    ctx_lens = [150, 1, 33, 96]
    k_cache, v_cache = pool(1, dtype, seed=5)
    block_tables = tables(ctx_lens, seed=6)
    lens = torch.tensor(ctx_lens, device=DEVICE)
    q = randn(len(ctx_lens), 4, HEAD_DIM, seed=7, dtype=dtype) * 3
    got = triton_attention.paged_decode_attention(q, k_cache, v_cache, block_tables, lens, BLOCK, num_splits=splits)
    assert_close_to_reference(got, q, k_cache, v_cache, block_tables, lens)
    whole = triton_attention.paged_decode_attention(q, k_cache, v_cache, block_tables, lens, BLOCK, num_splits=1)
    assert_within_rounding(got, whole.float())


def test_split_rule():
    rule = triton_attention.decode_splits
    assert rule(1, 8, 32768, programs=132) == 17  # ceil(132 / 8) parts of >= 256 tokens
    assert rule(1, 8, 1024, programs=132) == 4  # capped by MIN_SPLIT_TOKENS
    assert rule(1, 8, 511, programs=132) == 1  # too short to split
    assert rule(32, 8, 32768, programs=132) == 1  # 256 programs fill the GPU already
    assert rule(2, 1, 10**6, programs=1000) == triton_attention.MAX_SPLITS
    assert rule(1, 8, 32768) == rule(1, 8, 32768, programs=triton_attention.DEFAULT_PROGRAMS)


def test_the_rule_splits_a_long_context_and_matches():
    """A batch of 1 over 600 tokens: the default rule picks 2 parts (checked), and the
    output matches."""
    ctx_lens = [600]
    k_cache, v_cache = (randn(640, 2, HEAD_DIM, seed=s, dtype=torch.float32) for s in (8, 9))
    block_tables = torch.randperm(40, generator=torch.Generator().manual_seed(10)).view(1, 40).to(DEVICE)
    assert triton_attention.decode_splits(1, 2, 40 * BLOCK) == 2
    lens = torch.tensor(ctx_lens, device=DEVICE)
    q = randn(1, 6, HEAD_DIM, seed=11)
    got = triton_attention.paged_decode_attention(q, k_cache, v_cache, block_tables, lens, BLOCK)
    assert_close_to_reference(got, q, k_cache, v_cache, block_tables, lens)


def prefill_reference(q, k_cache, v_cache, block_table, ctx_len):
    """Causal SDPA in float32 of ``q [q_len, H, D]`` (the last positions) over the gathered
    context."""
    kv_heads = k_cache.shape[1]
    ks, vs = (layer_ops.gather_blocks(c.float().view(-1, BLOCK, kv_heads, HEAD_DIM), block_table)[:ctx_len]
              for c in (k_cache, v_cache))
    q_len = q.shape[0]
    mask = torch.arange(ctx_len, device=DEVICE)[None, :] <= torch.arange(q_len, device=DEVICE)[:, None] + ctx_len - q_len
    o = torch.nn.functional.scaled_dot_product_attention(
        q.float().transpose(0, 1)[None], ks.transpose(0, 1)[None], vs.transpose(0, 1)[None], attn_mask=mask,
        enable_gqa=True)
    return o[0].transpose(0, 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group,q_len,ctx_len", [(3, 1, 17), (3, 20, 36), (1, 70, 100), (4, 5, 130),
                                                 (4, 33, 33), (1, 16, 160)])
def test_prefill_behind_a_cached_prefix(group, q_len, ctx_len, dtype):
    """Cached prefixes shorter and longer than the new tokens, none, one new token, query
    tiles cut mid-sequence (70 rows at group 1 are two tiles of 64; 33 at group 4, three
    tiles of 16), block-boundary contexts."""
    kv_heads = 2
    k_cache, v_cache = pool(kv_heads, dtype, seed=12)
    block_table = tables([ctx_len], pad_blocks=1, seed=13)[0]
    # q as the model passes it: rows of a wider [T, heads + 2 kv_heads, D] qkv view.
    qkv = randn(q_len + 3, kv_heads * (group + 2), HEAD_DIM, seed=14, dtype=dtype) * 3
    q = qkv[2:2 + q_len, : kv_heads * group]
    got = triton_attention.paged_prefill_attention(q, k_cache, v_cache, block_table, ctx_len, BLOCK)
    assert got.shape == q.shape and got.dtype == dtype
    assert_within_rounding(got, prefill_reference(q, k_cache, v_cache, block_table, ctx_len))


def test_head_dim_not_a_power_of_two():
    """head_dim 24 (as 80 or 96 in some models) is padded to 32 lanes, masked."""
    d, kv_heads = 24, 2
    k_cache, v_cache = (randn(NUM_BLOCKS * BLOCK, kv_heads, d, seed=s) for s in (15, 16))
    ctx_lens = [40, 7]
    block_tables = tables(ctx_lens, seed=17)
    lens = torch.tensor(ctx_lens, device=DEVICE)
    q = randn(2, 6, d, seed=18) * 3
    got = triton_attention.paged_decode_attention(q, k_cache, v_cache, block_tables, lens, BLOCK)
    ref = layer_ops.paged_decode_attention_torch(q, k_cache, v_cache, block_tables, lens, BLOCK)
    assert_within_rounding(got, ref)
    layer_cache = torch.stack([k_cache, v_cache]).view(2, NUM_BLOCKS, BLOCK, kv_heads, d)
    got = triton_attention.paged_prefill_attention(q.repeat(5, 1, 1), k_cache, v_cache, block_tables[0], 40, BLOCK)
    assert_within_rounding(got, gathered_prefill_attention(q.repeat(5, 1, 1), layer_cache, block_tables[0], 40))


def test_bad_shapes_are_named():
    k_cache, v_cache = pool(2, torch.float32)
    lens = torch.tensor([3], device=DEVICE)
    with pytest.raises(ValueError, match="5 heads"):
        triton_attention.paged_decode_attention(randn(1, 5, HEAD_DIM), k_cache, v_cache, tables([3]), lens, BLOCK)
    with pytest.raises(ValueError, match="bfloat16"):
        triton_attention.paged_decode_attention(randn(1, 4, HEAD_DIM, dtype=torch.bfloat16), k_cache, v_cache,
                                                tables([3]), lens, BLOCK)
    with pytest.raises(ValueError, match=r"block_tables \(2, 1\)"):
        triton_attention.paged_decode_attention(randn(1, 4, HEAD_DIM), k_cache, v_cache, tables([3, 3]), lens, BLOCK)
    with pytest.raises(ValueError, match="ctx_len 40"):
        triton_attention.paged_prefill_attention(randn(8, 4, HEAD_DIM), k_cache, v_cache, tables([16])[0], 40, BLOCK)


def test_benchmark_reports_both_paths():
    result = load_script("triton_attention_bench").benchmark_decode_attention(2, 40, 4, 2, HEAD_DIM, torch.float32, DEVICE, iters=1)
    assert result["kv_bytes"] == 2 * 2 * 40 * 2 * HEAD_DIM * 4
    assert result["triton_ms"] > 0 and result["torch_ms"] > 0 and result["triton_gbps"] > 0
    assert result["max_abs_diff"] < 1e-5 and result["splits"] == 1


def test_prefill_benchmark_compares_with_the_gathering_path():
    bench = load_script("triton_attention_bench")
    result = bench.benchmark_prefill_attention(20, 50, 4, 2, HEAD_DIM, torch.float32, DEVICE, iters=1)
    assert result["kv_bytes"] == 2 * 50 * 2 * HEAD_DIM * 4 and result["q_len"] == 20
    assert result["triton_tflops"] > 0 and result["torch_ms"] > 0 and result["max_abs_diff"] < 1e-5
    with pytest.raises(ValueError, match="q_len 50"):
        bench.benchmark_prefill_attention(50, 50, 4, 2, HEAD_DIM, torch.float32, DEVICE)


def test_cuda_graph_buckets_are_vllms(tmp_path):
    """``model/cuda_graphs.py`` (its replay is checked in test_device_cuda.py): vLLM's
    default capture sizes, and a refusal of a model on the CPU."""
    from epdserve.model import cuda_graphs
    from epdserve.model.llama import LlamaModel
    from test_device import write_tiny_llama

    assert cuda_graphs.capture_sizes(1) == [1]
    assert cuda_graphs.capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert cuda_graphs.capture_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    with pytest.raises(ValueError, match="max_batch 0"):
        cuda_graphs.capture_sizes(0)
    model = LlamaModel.load(write_tiny_llama(tmp_path / "tiny"))
    with pytest.raises(ValueError, match="need a CUDA model and cache, not cpu / cpu"):
        cuda_graphs.DecodeGraphs(model, model.allocate_kv_cache(4, 16), 8, 4)


# Compiles the kernels to sm_90 (H100 / H200) cubins with Triton's own ptxas: no GPU needed.
# In a child process, as Triton's interpreter is on in this one.
COMPILE_SCRIPT = textwrap.dedent("""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from epdserve.model import triton_attention as ta

    def signature(fn, pointers, constexprs):
        return {n: "constexpr" if n in constexprs else pointers.get(n, "i32") for n in fn.arg_names}

    target = GPUTarget("cuda", 90, 32)
    for dtype, decode, split in (("bf16", True, True), ("fp32", True, False), ("bf16", False, False)):
        pointers = dict.fromkeys(["Q", "K", "V", "Out"], "*" + dtype)
        pointers.update(BlockTables="*i64", CtxLens="*i64", PartAcc="*fp32", PartM="*fp32", PartL="*fp32",
                        qk_scale="fp32")
        constexprs = dict(NUM_KV_HEADS=8, GROUP=4, HEAD_DIM=128, BLOCK_M=16 if decode else 64,
                          BLOCK_Q=1 if decode else 16, BLOCK_N=ta.BLOCK_N, BLOCK_D=128, DECODE=decode, SPLIT=split,
                          F32_DOTS=dtype == "fp32")
        fn = ta._paged_attention_kernel
        kernel = triton.compile(ASTSource(fn, signature(fn, pointers, constexprs), constexprs), target=target)
        print(dtype, "decode" if decode else "prefill", len(kernel.asm["cubin"]))
    fn = ta._merge_splits_kernel
    constexprs = dict(HEAD_DIM=128, BLOCK_S=32, BLOCK_D=128)
    pointers = dict(PartAcc="*fp32", PartM="*fp32", PartL="*fp32", Out="*bf16")
    kernel = triton.compile(ASTSource(fn, signature(fn, pointers, constexprs), constexprs), target=target)
    print("merge", len(kernel.asm["cubin"]))
""")


def test_kernels_compile_for_an_h200():
    """The compiled path, which the interpreter does not take (types across constexpr
    branches, tl.dot shapes and precisions, the loop over device-side bounds): bfloat16
    split-K decode, float32 decode (full-precision dots), bfloat16 prefill and the merge
    kernel, at the Llama-3.1-8B shape."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"  # Triton 3.9's default, without its warning
    done = subprocess.run([sys.executable, "-c", COMPILE_SCRIPT], env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [line.split() for line in done.stdout.splitlines()]
    assert [line[:-1] for line in lines] == [["bf16", "decode"], ["fp32", "decode"], ["bf16", "prefill"], ["merge"]]
    assert all(int(line[-1]) > 0 for line in lines)  # cubin bytes
