"""Tensor parallelism of the decoder (model/tensor_parallel.py): the split of SmolLM2-135M's
heads, MLP columns and vocabulary over 2 and 3 ranks, the shards' shapes, and ranks in real
processes (gloo over 127.0.0.1, one thread each) running a batched prefill with a chunked
prompt, then greedy decode steps, over their own paged KV caches, against the whole model
in this process (float32). Prints what the collectives cost per decode step."""

from __future__ import annotations

import queue
import time
import traceback
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from epdserve.engine import runner
from epdserve.engine.request import SamplingParams, Sequence
from epdserve.engine.scheduler import ScheduledBatch
from epdserve.model import linear
from epdserve.model.config import ModelConfig
from epdserve.model.llama import LlamaModel
from epdserve.model.tensor_parallel import TPRank, even_range, shard_ranges, shard_weights

from conftest import free_port

BLOCK = 8
PROMPT_LENGTHS = (5, 19, 37)  # the last one is prefilled in two chunks: 20, then 17 behind them
FIRST_CHUNK = 20
DECODE_STEPS = 8
RANKS_TIMEOUT_S = 120.0  # a whole TP run: start, load, steps (about 10 s on 2 cores)
# The ranks' logits against the whole model's: float32 partial sums added in another order
# (the O and down projections' all-reduces, the per-layer code against the fused decode
# kernel) move logits of magnitude ~20 by ~1e-5; 1e-3 leaves room and still catches any
# wrong head, column or vocabulary row (those move logits by whole units).
LOGITS_ATOL = 1e-3


@pytest.fixture(scope="module")
def model_dir(model_info):
    return str(model_info.path)


@pytest.fixture(scope="module")
def config(model_dir):
    return ModelConfig.from_dir(model_dir)


@pytest.fixture(scope="module")
def prompts(tokenizer):
    texts = ["The capital of France is Paris, and the capital of Italy is",
             "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) +",
             "Once upon a time, in a small village by the sea, there lived an old fisherman who every "
             "morning walked down to the harbour before sunrise to look at the boats. One day, as the sun "
             "rose, he found"]
    out = [tokenizer(t).input_ids[:n] for t, n in zip(texts, PROMPT_LENGTHS)]
    assert [len(p) for p in out] == list(PROMPT_LENGTHS)
    return out


def test_even_range_splits_contiguously_with_the_remainder_first():
    assert [even_range(10, 3, r) for r in range(3)] == [range(0, 4), range(4, 7), range(7, 10)]
    assert [even_range(6, 2, r) for r in range(2)] == [range(0, 3), range(3, 6)]


def test_smollm2_split_over_2_ranks_is_uneven_by_whole_gqa_groups(config):
    assert (config.num_attention_heads, config.num_key_value_heads) == (9, 3)
    r0, r1 = (shard_ranges(config, r, 2) for r in range(2))
    assert (r0.kv_heads, r0.q_heads, r1.kv_heads, r1.q_heads) == (range(0, 2), range(0, 6), range(2, 3), range(6, 9))
    assert (r0.intermediate, r1.intermediate) == (range(0, 768), range(768, 1536))
    assert (r0.vocab, r1.vocab) == (range(0, 24576), range(24576, 49152))


def test_smollm2_split_over_3_ranks(config):
    shards = [shard_ranges(config, r, 3) for r in range(3)]
    assert [s.kv_heads for s in shards] == [range(0, 1), range(1, 2), range(2, 3)]
    assert [s.q_heads for s in shards] == [range(0, 3), range(3, 6), range(6, 9)]
    assert [s.intermediate for s in shards] == [range(0, 512), range(512, 1024), range(1024, 1536)]
    assert [s.vocab for s in shards] == [range(0, 16384), range(16384, 32768), range(32768, 49152)]


def test_sizes_the_model_cannot_split_are_refused(config):
    with pytest.raises(ValueError, match="^tensor parallel size 4 exceeds the model's 3 KV heads: each rank needs"):
        shard_ranges(config, 0, 4)
    with pytest.raises(ValueError, match="^tensor parallel size 0 is below 1 \\(the model has 3 KV heads\\)$"):
        shard_ranges(config, 0, 0)
    with pytest.raises(ValueError, match="rank 2 is outside"):
        shard_ranges(config, 2, 2)
    with pytest.raises(ValueError, match="rank -1 is outside"):
        TPRank(-1, 2)


def test_shards_hold_the_ranks_rows_and_columns_as_contiguous_copies(model_dir, config):
    from safetensors.torch import load_file

    full = load_file(f"{model_dir}/model.safetensors")
    local, shard = shard_weights(config, full, 1, 2)
    assert (local.num_attention_heads, local.num_key_value_heads, local.intermediate_size) == (3, 1, 768)
    assert (local.head_dim, local.vocab_size, local.hidden_size) == (64, 49152, 576)
    p = "model.layers.7."
    expected = {  # name: (shape, the slice of the full tensor)
        p + "self_attn.q_proj.weight": ((192, 576), (slice(384, 576),)),
        p + "self_attn.k_proj.weight": ((64, 576), (slice(128, 192),)),
        p + "self_attn.v_proj.weight": ((64, 576), (slice(128, 192),)),
        p + "self_attn.o_proj.weight": ((576, 192), (slice(None), slice(384, 576))),
        p + "mlp.gate_proj.weight": ((768, 576), (slice(768, 1536),)),
        p + "mlp.up_proj.weight": ((768, 576), (slice(768, 1536),)),
        p + "mlp.down_proj.weight": ((576, 768), (slice(None), slice(768, 1536))),
        "model.embed_tokens.weight": ((24576, 576), (slice(24576, 49152),)),
        "model.norm.weight": ((576,), (slice(None),)),
        p + "input_layernorm.weight": ((576,), (slice(None),)),
    }
    assert shard.keys() == full.keys() and "lm_head.weight" not in shard  # tied: the embedding's shard
    for name, (shape, index) in expected.items():
        w = shard[name]
        assert tuple(w.shape) == shape and w.is_contiguous(), name
        assert torch.equal(w, full[name][index]), name
        assert w.untyped_storage().data_ptr() != full[name].untyped_storage().data_ptr(), f"{name} is a view"


@pytest.mark.parametrize("weight_format", ["q4_1", "q4_1+f32", "q4_1+bf16"])
def test_formats_with_gguf_blocks_are_refused_with_tp(model_dir, config, weight_format):
    message = f"^weight format {weight_format.replace('+', '[+]')}: tensor parallelism needs a dense format"
    with pytest.raises(ValueError, match=message):
        LlamaModel.load(model_dir, weight_format=weight_format, tp=TPRank(0, 2))
    with pytest.raises(ValueError, match=message):
        LlamaModel(config, {}, torch.float32, weight_format=linear.parse(weight_format), tp=TPRank(1, 2))


# ---- ranks in processes ----------------------------------------------------------------

COLLECTIVE_S = [0.0]  # (in a rank's process) seconds spent in the collectives so far


class TimedRank(TPRank):
    """A :class:`TPRank` that adds the time of each collective to :data:`COLLECTIVE_S`
    (including any wait for a slower rank: that is part of a step's cost too)."""

    def all_reduce(self, x):
        start = time.perf_counter()
        super().all_reduce(x)
        COLLECTIVE_S[0] += time.perf_counter() - start
        return x

    def gather_last_dim(self, x, sizes):
        start = time.perf_counter()
        out = super().gather_last_dim(x, sizes)
        COLLECTIVE_S[0] += time.perf_counter() - start
        return out


def run_steps(model: LlamaModel, prompts: list[list[int]]) -> dict:
    """A batched prefill (the last prompt's first chunk), then the rest of that prompt with
    the others' first decode steps, then :data:`DECODE_STEPS` decode steps of every
    sequence, through ``engine/runner.run`` over a paged cache; greedy. Returns the
    generated tokens, each step's logits, each decode step's seconds and collective
    seconds, and the KV cache's shape."""
    per_seq = -(-(max(PROMPT_LENGTHS) + DECODE_STEPS + 2) // BLOCK)
    kv_cache = model.allocate_kv_cache(len(prompts) * per_seq, BLOCK)
    seqs = [Sequence(str(i), p, SamplingParams(max_tokens=DECODE_STEPS + 2, temperature=0))
            for i, p in enumerate(prompts)]
    for i, seq in enumerate(seqs):
        seq.block_table = list(range(i * per_seq, (i + 1) * per_seq))
    first, others = len(prompts[-1]), len(prompts) - 1
    plan = [[len(p) for p in prompts[:-1]] + [FIRST_CHUNK], [1] * others + [first - FIRST_CHUNK]]
    plan += [[1] * len(prompts)] * DECODE_STEPS
    logits_per_step, step_s, collective_s = [], [], []
    for num_tokens in plan:
        batch = ScheduledBatch(seqs=seqs, num_tokens=num_tokens)
        COLLECTIVE_S[0] = 0.0
        start = time.perf_counter()
        logits, sampled = runner.run(model, batch, kv_cache)
        step_s.append(time.perf_counter() - start)
        collective_s.append(COLLECTIVE_S[0])
        for seq, n in zip(seqs, num_tokens):
            seq.num_computed_tokens += n
        for row, index in enumerate(sampled):
            seqs[index].token_ids.append(int(logits[row].argmax()))
        logits_per_step.append(logits.numpy().copy())
    return {"tokens": [s.token_ids[s.num_prompt_tokens:] for s in seqs], "logits": logits_per_step,
            "decode_s": step_s[2:], "collective_s": collective_s[2:], "kv_shape": tuple(kv_cache.shape)}


def all_reduce_latency_s(rows: int, hidden: int, calls: int = 200) -> float:
    """Seconds per all-reduce of a ``[rows, hidden]`` float32 tensor alone (a decode step's)."""
    x = torch.ones(rows, hidden)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(calls):
        dist.all_reduce(x)
    return (time.perf_counter() - start) / calls


def rank_main(rank: int, size: int, port: int, model_dir: str, prompts: list[list[int]], results) -> None:
    """One rank's process: join the group, load its shard, run :func:`run_steps`; puts
    ``(rank, result dict)`` on ``results``, or ``(rank, traceback text)`` on failure."""
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size,
                                timeout=timedelta(seconds=60))
        try:
            model = LlamaModel.load(model_dir, torch.float32, "f32", tp=TimedRank(rank, size))
            result = run_steps(model, prompts)
            result["all_reduce_s"] = all_reduce_latency_s(len(prompts), model.config.hidden_size)
            results.put((rank, result))
        finally:
            dist.destroy_process_group()
    except BaseException:
        results.put((rank, traceback.format_exc()))


def run_ranks(size: int, model_dir: str, prompts: list[list[int]]) -> list[dict]:
    """:func:`rank_main` in ``size`` spawned processes; each rank's result. Fails on a rank's
    error, death or :data:`RANKS_TIMEOUT_S`; the processes are always ended."""
    ctx = torch.multiprocessing.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=rank_main, args=(r, size, port, model_dir, prompts, results), daemon=True)
             for r in range(size)]
    got = {}
    try:
        for p in procs:
            p.start()
        deadline = time.monotonic() + RANKS_TIMEOUT_S
        while len(got) < size:
            try:
                rank, result = results.get(timeout=1.0)
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
                assert not dead, f"TP={size}: rank(s) {dead} died (exit codes {[procs[r].exitcode for r in dead]})"
                assert time.monotonic() < deadline, f"TP={size}: no result from ranks {set(range(size)) - set(got)}"
                continue
            assert not isinstance(result, str), f"TP={size} rank {rank} failed:\n{result}"
            got[rank] = result
        for p in procs:
            p.join(timeout=30)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=10)
        results.close()
    return [got[r] for r in range(size)]


@pytest.fixture(scope="module")
def whole_model_run(model_dir, prompts):
    """:func:`run_steps` of the whole model in this process (float32, one thread, as a rank)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return run_steps(LlamaModel.load(model_dir, torch.float32, "f32"), prompts)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("size", [2, 3])
def test_ranks_match_the_whole_model(model_dir, config, prompts, whole_model_run, size):
    ranks = run_ranks(size, model_dir, prompts)
    expected = whole_model_run
    assert [len(t) for t in expected["tokens"]] == [DECODE_STEPS + 2] * (len(prompts) - 1) + [DECODE_STEPS + 1]
    for rank, got in enumerate(ranks):
        kv_heads = len(shard_ranges(config, rank, size).kv_heads)
        assert got["kv_shape"][0:2] == (30, 2) and got["kv_shape"][3:] == (BLOCK, kv_heads, 64)
        assert got["tokens"] == expected["tokens"], f"rank {rank}"
        worst = 0.0
        for step, (mine, want) in enumerate(zip(got["logits"], expected["logits"])):
            assert mine.shape == want.shape == (2 if step == 0 else 3, config.vocab_size)
            torch.testing.assert_close(torch.from_numpy(mine), torch.from_numpy(want), rtol=0, atol=LOGITS_ATOL)
            worst = max(worst, float(abs(mine - want).max()))
            assert (mine == ranks[0]["logits"][step]).all(), f"rank {rank} step {step}: logits differ from rank 0's"
    decode_ms = 1e3 * sum(ranks[0]["decode_s"]) / DECODE_STEPS
    collective_ms = 1e3 * sum(max(r["collective_s"][i] for r in ranks) for i in range(DECODE_STEPS)) / DECODE_STEPS
    whole_ms = 1e3 * sum(expected["decode_s"]) / DECODE_STEPS
    calls = 2 * config.num_hidden_layers + 1
    print(f"\nTP={size} (gloo, 1 thread a rank, decode batch {len(prompts)}): decode step {decode_ms:.2f} ms, "
          f"of which collectives {collective_ms:.2f} ms ({calls} all-reduces + 1 logits gather, waits included); "
          f"one all-reduce alone {1e6 * ranks[0]['all_reduce_s']:.0f} us; whole model, 1 thread: {whole_ms:.2f} ms; "
          f"max |logits - whole| {worst:.2e}")
