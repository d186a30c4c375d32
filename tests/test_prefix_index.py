"""Prefix-aware routing in process: the router's block keys, the per-worker LRU index, the
balance rule, forgetting a replaced worker, and the decision reaching the trace and
/metrics. A real Registry with a recording port (no sockets, no model)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

import pytest

from epdserve.engine.prefix_cache import hash_block
from epdserve.serving import protocol as P
from epdserve.serving.metrics import RouterMetrics
from epdserve.serving.router.app import add_router_options
from epdserve.serving.router.flows import FlowConfig
from epdserve.serving.router.paths import new_flow
from epdserve.serving.router.prefix_index import (BALANCE_ABS_THRESHOLD, PrefixAware, PromptBlocks, WorkerIndex,
                                                  make_policy)
from epdserve.serving.router.registry import Compat, Registry
from epdserve.trace import RequestTrace

BS = 4  # tokens per block in these tests


@dataclass
class W:
    """A candidate worker: what the policy reads of a WorkerState."""

    worker_id: str
    blocks_total: int = 100
    outstanding: dict = field(default_factory=dict)
    kv_layout: dict = field(default_factory=lambda: {"block_size": BS})


def prompt(prefix: int, n: int = 17, suffix: int = 0, salt: int | None = None) -> list[int]:
    """``n`` token ids: a run seeded by ``prefix``, its last ``suffix`` tokens unique to ``salt``
    (default: ``suffix``)."""
    ids = [prefix * 1000 + i for i in range(n)]
    for i in range(n - suffix, n):
        ids[i] = 10**6 + prefix * 100 + i + (suffix if salt is None else salt) * 7
    return ids


# -- keys

def test_hashes_are_the_workers_chained_keys_of_the_reusable_full_blocks():
    ids = prompt(1, n=17)  # 16 reusable tokens (the last is always computed): 4 blocks
    keys = PromptBlocks(ids).hashes(BS)
    assert len(keys) == 4
    want, parent = [], None
    for i in range(4):
        parent = hash_block(parent, ids[i * BS:(i + 1) * BS])
        want.append(parent)
    assert keys == want  # a text prompt's keys are the worker's own (engine/prefix_cache.py)
    assert len(PromptBlocks(ids[:16]).hashes(BS)) == 3  # 15 reusable tokens: 3 full blocks
    assert PromptBlocks([7]).hashes(BS) == []
    assert PromptBlocks(ids).hashes(8) == [hash_block(None, ids[:8]), hash_block(hash_block(None, ids[:8]), ids[8:16])]


def test_a_shared_prefix_shares_leading_keys_only():
    a, b = PromptBlocks(prompt(1, 17, suffix=6)).hashes(BS), PromptBlocks(prompt(1, 17, suffix=5)).hashes(BS)
    assert a[:2] == b[:2] and a[2] != b[2] and a[3] != b[3]  # tokens 0..9 shared: blocks 0 and 1
    other = PromptBlocks(prompt(2, 17)).hashes(BS)
    assert not set(other) & set(a)


def test_images_are_part_of_every_key():
    ids = prompt(3, 17)
    cat, dog = PromptBlocks(ids, ["aa" * 32]).hashes(BS), PromptBlocks(ids, ["bb" * 32]).hashes(BS)
    assert len(cat) == len(dog) == 4 and not set(cat) & set(dog)  # same placeholder tokens, other image
    assert PromptBlocks(ids, ["aa" * 32]).hashes(BS) == cat
    assert not set(cat) & set(PromptBlocks(ids).hashes(BS))


def test_bad_block_size_and_policy_name_are_refused():
    with pytest.raises(ValueError, match="block_size must be at least 1, got 0"):
        PromptBlocks([1, 2, 3]).hashes(0)
    with pytest.raises(ValueError, match="unknown routing policy 'random'"):
        make_policy("random")
    assert make_policy("least-loaded") is None and isinstance(make_policy("prefix-aware"), PrefixAware)
    with pytest.raises(ValueError, match="balance_rel_threshold must be >= 1, got 0.5"):
        PrefixAware(balance_rel_threshold=0.5)
    with pytest.raises(ValueError, match=r"reports no block_size"):
        PrefixAware().choose([W("w0", kv_layout={})], PromptBlocks(prompt(1)))


def test_routing_flag_takes_two_policies_and_refuses_others(capsys):
    parser = argparse.ArgumentParser()
    add_router_options(parser)
    assert parser.parse_args([]).routing == "least-loaded"
    assert parser.parse_args(["--routing", "prefix-aware"]).routing == "prefix-aware"
    with pytest.raises(SystemExit) as exc:
        parser.parse_args(["--routing", "sticky"])
    assert exc.value.code == 2 and "invalid choice: 'sticky'" in capsys.readouterr().err


# -- the index

def test_index_is_bounded_by_blocks_total_and_evicts_tails_first():
    idx = WorkerIndex(owner=None)
    a, b = PromptBlocks(prompt(1)).hashes(BS), PromptBlocks(prompt(2)).hashes(BS)
    idx.insert(a, capacity=6)
    assert idx.match(a) == 4 and len(idx) == 4
    idx.insert(b, capacity=6)
    assert len(idx) == 6 and idx.match(b) == 4
    assert idx.match(a) == 2  # a's two last blocks went first: its leading run is still held
    idx.insert(a[:1], capacity=6)  # a's first block used again: now the most recent
    idx.insert(PromptBlocks(prompt(5)).hashes(BS), capacity=6)
    assert idx.match(a) == 1 and len(idx) == 6
    idx.insert(b, capacity=0)
    assert len(idx) == 0


# -- the rule

def test_a_prefix_goes_back_to_the_worker_that_holds_it_and_new_prefixes_spread():
    policy, w0, w1 = PrefixAware(), W("w0"), W("w1")
    first = PromptBlocks(prompt(1, 33, suffix=3))
    assert policy.choose([w0, w1], first) is w0 and first.decision.reason == "spread"
    second = PromptBlocks(prompt(2, 33, suffix=3))
    assert policy.choose([w0, w1], second) is w1  # w1's index is smaller
    assert second.decision.matched_blocks == 0
    for k in range(3):  # the same long prefix, other suffixes: always its worker
        again = PromptBlocks(prompt(1, 33, suffix=3, salt=10 + k))
        assert policy.choose([w0, w1], again) is w0
        assert again.decision.reason == "prefix" and again.decision.matched_blocks == 7
        assert again.decision.believed_tokens == 28
    w0.outstanding = {"r1": 100}  # busier, but not imbalanced: the prefix still wins
    assert policy.choose([w0, w1], PromptBlocks(prompt(1, 33, suffix=2))) is w0


def test_a_short_match_under_the_cache_threshold_goes_least_loaded():
    policy, w0, w1 = PrefixAware(cache_threshold=0.5), W("w0"), W("w1")
    policy.choose([w0, w1], PromptBlocks(prompt(1, 9)))  # w0 holds 2 blocks of prefix 1
    w0.outstanding = {"r1": 10}
    longer = PromptBlocks(prompt(1, 9) + [5] * 24)  # 8 blocks, 2 believed on w0: 25 % < 50 %
    assert policy.choose([w0, w1], longer) is w1 and longer.decision.reason == "spread"
    assert longer.decision.matched_blocks == 0


def test_imbalance_beyond_both_thresholds_goes_least_loaded():
    policy, w0, w1 = PrefixAware(), W("w0"), W("w1")
    policy.choose([w0, w1], PromptBlocks(prompt(1, 33)))
    w0.outstanding = {f"r{i}": 10 for i in range(BALANCE_ABS_THRESHOLD + 1)}
    hot = PromptBlocks(prompt(1, 33, suffix=2))
    assert policy.choose([w0, w1], hot) is w1 and hot.decision.reason == "balance"
    assert hot.decision.matched_blocks == 0  # w1 did not hold it; now it does
    w1.outstanding = {f"q{i}": 10 for i in range(BALANCE_ABS_THRESHOLD)}  # gap 1: balanced again
    again = PromptBlocks(prompt(1, 33, suffix=3))
    assert policy.choose([w0, w1], again) is w1 and again.decision.reason == "prefix"  # ties -> less loaded
    assert again.decision.matched_blocks == 7


# -- with the registry and flows

class RecordingPort:
    def __init__(self):
        self.sent = []

    def connect(self, worker_id, addr, incarnation):
        pass

    def disconnect(self, worker_id):
        pass

    def send(self, worker_id, msg):
        self.sent.append((worker_id, msg))

    def send_once(self, worker_id, addr, msg):
        pass


def hello(worker_id: str, incarnation: str) -> P.Hello:
    return P.Hello(worker_id=worker_id, role="colocated", addr=f"ipc:///tmp/{worker_id}", model="m",
                   fingerprint="fp", kv_layout={"num_layers": 2, "block_size": BS}, blocks_total=50,
                   incarnation=incarnation, protocol=P.PROTOCOL_VERSION)


def test_a_replaced_worker_is_believed_to_hold_nothing():
    registry = Registry("colocated", RecordingPort(), Compat("fp", {"num_layers": 2}))
    registry.on_hello(hello("c0", "c0-first-process"))
    registry.on_hello(hello("c1", "c1-first-process"))
    policy = PrefixAware()
    ids = prompt(1, 33)
    w = registry.pick("colocated", PromptBlocks(ids), policy)
    assert registry.pick("colocated", PromptBlocks(ids), policy) is w
    assert policy.index(w).match(PromptBlocks(ids).hashes(BS)) == 8
    registry.mark_dead(w.worker_id, "killed")
    registry.clock += 10
    registry.on_hello(hello(w.worker_id, f"{w.worker_id}-restarted"))
    again = PromptBlocks(ids)
    registry.pick("colocated", again, policy)
    assert again.decision.matched_blocks == 0 and again.decision.reason == "spread"
    assert registry.pick("colocated", None, policy) is not None  # no keys: least-loaded


@pytest.mark.parametrize("routing", ["prefix-aware", "least-loaded"])
def test_the_decision_reaches_the_trace_and_metrics(routing):
    registry = Registry("colocated", RecordingPort(), Compat("fp", {"num_layers": 2}))
    registry.on_hello(hello("c0", "c0-first-process"))
    config = FlowConfig("colocated", routing=make_policy(routing))
    metrics = RouterMetrics("m")
    for i, cached in enumerate((0, 28)):
        flow = new_flow(registry, config, f"req-{i}", prompt(1, 33, suffix=i + 1),
                        P.SamplingParams(max_tokens=4), 0.0)
        flow.start()
        flow.record.cached_tokens = cached  # as the worker's first output reports it
        flow.close()
        rec = flow.trace()
        assert rec.routing == routing
        if routing == "prefix-aware":
            assert (rec.routing_reason, rec.routing_believed_tokens) == (("spread", 0), ("prefix", 28))[i]
        else:
            assert rec.routing_reason is None and rec.routing_believed_tokens is None
        assert RequestTrace.from_json(rec.as_json()).routing == routing
        metrics.ended(rec, [])
    text = metrics.render().decode()
    believed = ("false", "true") if routing == "prefix-aware" else ("none", "none")
    for hit, bel in zip(("false", "true"), believed):
        line = (f'epdserve:routed_requests_total{{believed="{bel}",engine="router",hit="{hit}",model_name="m",'
                f'policy="{routing}"}} 1.0')
        assert line in text


def test_pd_routes_prefill_by_prefix_and_decode_by_load():
    registry = Registry("pd", RecordingPort(), Compat("fp", {"num_layers": 2}))
    for wid, role in (("p0", "prefill"), ("p1", "prefill"), ("d0", "decode"), ("d1", "decode")):
        registry.on_hello(hello(wid, f"{wid}-first-process").model_copy(update={"role": role}))
    config = FlowConfig("pd", routing=make_policy("prefix-aware"))
    image = P.ImageRef(hash="cc" * 32, tokens=4)
    flows = [new_flow(registry, config, f"req-{i}", prompt(1, 33, suffix=2, salt=i), P.SamplingParams(max_tokens=4),
                      0.0, images=[image] if i == 2 else []) for i in range(3)]
    for flow in flows:
        flow.start()
    first, second, with_image = (f.prefill_worker.worker_id for f in flows)
    assert second == first and flows[1].blocks.decision.reason == "prefix"
    assert with_image != first and flows[2].blocks.decision.matched_blocks == 0  # same tokens, an image
    decode = flows[0]._choose("decode")
    assert decode.role == "decode" and flows[0].blocks.decision.worker_id == first  # decode left it alone
    assert set(config.routing.indexes) == {"p0", "p1"}  # nothing believed of decode workers
