"""The KV hand-off between workers of different tensor-parallel sizes: a KV cache split by
KV head into one part per rank (engine/kv_parts.py), each destination part copied from the
source parts holding its heads; a tensor-parallel worker's ranks keep their parts in one
/dev/shm pool (transfer/shm.py) so that rank 0 exports and imports every head.

In one process with real follower ranks: a TP=2 engine prefills for a TP=1 decode engine
and decodes for a TP=1 prefill engine over every hand-off (held pool blocks, TCP, bf16 and
int8 frames, the layer pipeline), with the greedy tokens of one float32 process (and of
transformers), the same bytes on the wire as TP=1 → TP=1, and no KV block left held
afterwards or after an abort."""

from __future__ import annotations

import itertools

import pytest
import torch
import zmq

from epdserve.engine.engine import EngineConfig, LLMEngine
from epdserve.engine.kv_parts import KVParts, copy_blocks, head_overlaps
from epdserve.engine.request import SamplingParams
from epdserve.serving.worker.ranks import Ranks
from epdserve.serving.worker.setup import new_engine
from epdserve.transfer import handoff, shm
from epdserve.transfer.loopback import generate_pd
from epdserve.transfer.wire import WireError

from conftest import generate

pytestmark = pytest.mark.tp

MAX_TOKENS = 12
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0)
STORY = ("The lighthouse keeper climbed the spiral stairs every evening at dusk, counting the steps as "
         "his father had taught him. Ships passed in the night, their lamps like slow stars. ")


# ---- KV parts --------------------------------------------------------------------------------

def cache(heads: list[int], blocks: int = 6, seed: int = 0) -> KVParts:
    """A random KV cache of 2 layers, ``blocks`` blocks of 4 tokens and head size 8, split
    as ``heads``."""
    full = torch.randn(2, 2, blocks, 4, sum(heads), 8, generator=torch.Generator().manual_seed(seed))
    return KVParts([p.clone() for p in full.split(heads, dim=4)])


def whole(kv: KVParts) -> torch.Tensor:
    return torch.cat(kv.parts, dim=4)


@pytest.mark.parametrize("src_split,dst_split", [([3], [3]), ([2, 1], [3]), ([3], [2, 1]), ([2, 1], [1, 1, 1]),
                                                 ([1, 2], [2, 1]), ([1, 1, 1], [3])])
def test_blocks_copy_between_any_two_splits_of_the_heads(src_split, dst_split):
    src, dst = cache(src_split, seed=1), cache(dst_split, seed=2)
    before = whole(dst).clone()
    copy_blocks(src, [4, 5, 0, 2], dst, [1, 2, 3, 0])
    after, want = whole(dst), whole(src)
    assert torch.equal(after[:, :, [1, 2, 3, 0]], want[:, :, [4, 5, 0, 2]])
    assert torch.equal(after[:, :, [4, 5]], before[:, :, [4, 5]])  # untouched blocks stay
    # Every head is read once: the overlaps cover each destination head exactly once.
    assert sum(n for *_, n in head_overlaps(src, dst)) == 3


def test_overlaps_name_exactly_the_heads_each_part_owns():
    src, dst = cache([2, 1]), cache([1, 1, 1])
    got = [(s is src.parts[0], s0, [d is p for p in dst.parts].index(True), d0, n)
           for s, s0, d, d0, n in head_overlaps(src, dst)]
    # heads 0 and 1 from part 0 into destination parts 0 and 1; head 2 from part 1 into part 2
    assert got == [(True, 0, 0, 0, 1), (True, 1, 1, 0, 1), (False, 0, 2, 0, 1)]
    assert src.block_shape(5) == (2, 2, 5, 4, 3, 8) and src.layer(1).block_shape(1) == (1, 2, 1, 4, 3, 8)


def test_parts_that_differ_beyond_their_heads_or_copies_that_do_not_fit_are_refused():
    with pytest.raises(ValueError, match="differ in more than their KV heads"):
        KVParts([torch.zeros(2, 2, 6, 4, 1, 8), torch.zeros(2, 2, 5, 4, 1, 8)])
    with pytest.raises(ValueError, match="at least one part"):
        KVParts([])
    with pytest.raises(ValueError, match="cannot copy KV blocks"):
        copy_blocks(cache([2, 1]), [0], cache([2]), [0])
    with pytest.raises(ValueError, match="2 source blocks for 1 destination"):
        copy_blocks(cache([3]), [0, 1], cache([3]), [0])


def test_a_pool_of_parts_is_mapped_by_each_rank_and_read_whole_by_a_peer():
    shape = (2, 2, 6, 4, 3, 8)
    pool = shm.KVPool(shape, torch.float32, [2, 1])
    try:
        follower = shm.map_part(pool.name, shape, torch.float32, [2, 1], 1)
        follower.fill_(7.0)  # a follower rank's writes land in the file rank 0 and peers read
        pool.parts[0].fill_(3.0)
        parts, tags = shm.map_pool(pool.name, shape, torch.float32, [2, 1])
        assert [tuple(p.shape) for p in parts] == [(2, 2, 6, 4, 2, 8), (2, 2, 6, 4, 1, 8)]
        assert bool((parts[1] == 7).all()) and bool((parts[0] == 3).all()) and tags.shape == (6,)
        with pytest.raises(WireError, match="is .* bytes, a pool of"):
            shm.map_pool(pool.name, shape[:4] + (4, 8), torch.float32, [2, 2])
    finally:
        pool.close()


# ---- engines of different TP sizes, joined by the real hand-off --------------------------------

@pytest.fixture(scope="module")
def engines(model_info):
    """``(tp1, tp2, other tp1)``: one-process float32 engines and a TP=2 engine (this
    process is its rank 0, one follower process), each with its KV cache in a shared
    pool, with their pools."""
    config = EngineConfig(kv_cache_memory_mb=32, weight_format="f32", dtype="float32")
    tp1, pool1 = new_engine(str(model_info.path), config, shared_pool=True)
    other, pool3 = new_engine(str(model_info.path), config, shared_pool=True)
    ranks = Ranks.start(2, "test-tp2", str(model_info.path), "float32", "f32", "cpu", [[0], [1]])
    try:
        tp2, pool2 = new_engine(str(model_info.path), config, shared_pool=True, tp=ranks)
        yield (tp1, pool1), (tp2, pool2), (other, pool3)
    finally:
        ranks.close()
        pool1.close()
        pool3.close()


@pytest.fixture(scope="module")
def prompts(tokenizer):
    story = tokenizer(STORY * 4).input_ids
    return [tokenizer("The capital of France is").input_ids, story[:70], story[:131]]


@pytest.fixture(scope="module")
def reference(model_info, prompts):
    engine = LLMEngine(str(model_info.path), EngineConfig(kv_cache_memory_mb=32, weight_format="f32"))
    return generate(engine, prompts, GREEDY)


def hand_off(prefill, decode, prompts, transfer_dtype="none", transport="shm", layer_pipeline=False):
    """Each prompt through ``prefill`` and ``decode`` ((engine, pool) pairs): the tokens and
    the bytes each hand-off's frame holds (what a TCP fetch moves)."""
    (p_engine, p_pool), (d_engine, _) = prefill, decode
    ctx = zmq.Context()
    exporter = handoff.Exporter(p_engine, 60, ctx, "tcp://127.0.0.1:0", transfer_dtype,
                                p_pool if transfer_dtype == "none" and not layer_pipeline else None, layer_pipeline)
    importer = handoff.Importer(ctx, transport, 30)
    try:
        runs = [generate_pd(p_engine, d_engine, exporter, importer, f"r{next(_ids)}", p, GREEDY) for p in prompts]
        return [tokens for tokens, _ in runs], [t.kv_bytes for _, t in runs]
    finally:
        exporter.server.close()
        exporter.table.close()
        if exporter.layer_sink is not None:
            exporter.layer_sink.close()
        importer.close()
        ctx.destroy(linger=0)


_ids = itertools.count()


def assert_all_free(*pairs):
    for engine, pool in pairs:
        assert engine.pool.num_in_use == 0 and not engine.held and not engine.seqs
        assert not bool(pool.tags.any())


@pytest.mark.parametrize("transfer_dtype,transport,layer_pipeline",
                         [("none", "shm", False), ("none", "tcp", False), ("bf16", "shm", False),
                          ("int8", "tcp", False), ("none", "shm", True)])
def test_a_tp2_prefill_hands_off_to_a_tp1_decode_and_back(engines, prompts, reference, transfer_dtype, transport,
                                                          layer_pipeline):
    tp1, tp2, other = engines
    got_21, bytes_21 = hand_off(tp2, tp1, prompts, transfer_dtype, transport, layer_pipeline)
    got_12, bytes_12 = hand_off(tp1, tp2, prompts, transfer_dtype, transport, layer_pipeline)
    if transfer_dtype == "none":  # the prompt's KV itself: the tokens of one process
        assert got_21 == reference and got_12 == reference
    else:  # rounded KV: the same rounding either way
        assert got_21 == got_12
        assert sum(a == b for g, r in zip(got_21, reference) for a, b in zip(g, r)) >= 0.8 * sum(map(len, reference))
    # The frame of a hand-off across TP sizes is the TP=1 frame: every head once.
    _, bytes_11 = hand_off(tp1, other, prompts, transfer_dtype, transport, layer_pipeline)
    assert bytes_21 == bytes_12 == bytes_11
    assert_all_free(tp1, tp2, other)


def test_the_tokens_are_transformers_greedy_ones(engines, prompts, model_info):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model_info.path), torch_dtype=torch.float32)
    want = hf.generate(torch.tensor([prompts[1]]), max_new_tokens=MAX_TOKENS, do_sample=False)[0, len(prompts[1]):]
    tp1, tp2, _ = engines
    (got_21,), _ = hand_off(tp2, tp1, prompts[1:2])
    (got_12,), _ = hand_off(tp1, tp2, prompts[1:2])
    assert got_21 == got_12 == want.tolist()


def test_an_export_released_unread_or_an_import_aborted_leaves_no_block(engines, prompts):
    from epdserve.transfer.loopback import first_output

    tp1, tp2, _ = engines
    ctx = zmq.Context()
    try:
        for (p_engine, p_pool), (d_engine, _) in ((tp2, tp1), (tp1, tp2)):
            exporter = handoff.Exporter(p_engine, 60, ctx, None, "none", p_pool)
            p_engine.add_request("abort", prompts[2], GREEDY, hold_kv=True)
            desc = exporter.export(first_output(p_engine, "abort"))
            kv, _ = handoff.Importer(ctx, "shm", 5).take("abort", desc, d_engine.kv_layout(), d_engine.kv_cache.dtype)
            d_engine.add_request("abort", prompts[2], GREEDY, kv, 1)
            d_engine.abort("abort")  # the client left before the decode engine imported it
            exporter.release("abort")
            p_engine.add_request("unread", prompts[1], GREEDY, hold_kv=True)
            exporter.export(first_output(p_engine, "unread"))
            exporter.table.close()  # a decode worker never took it: released at TTL or stop
        assert_all_free(tp1, tp2)
    finally:
        ctx.destroy(linger=0)
