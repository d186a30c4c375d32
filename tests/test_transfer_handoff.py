"""Same-host hand-off from a prefill worker's shared KV pool, and layer-pipelined staged
frames: in-process PD (two real engines, the real Exporter/Importer) gives the colocated
greedy tokens; held blocks return to the pool on release; forged descriptors are refused
with clear errors; a real prefill worker's pool file goes when the worker stops (and a
killed worker's is removed as stale); ``serve --kv-layer-pipeline`` gives colocated output."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import zmq

from conftest import _stop as _stop_deployment
from conftest import free_port, generate, start_deployment
from epdserve.engine.engine import EngineConfig, LLMEngine
from epdserve.engine.request import SamplingParams
from epdserve.serving.worker.setup import new_engine
from epdserve.transfer import handoff, shm
from epdserve.transfer.loopback import first_output, generate_pd
from epdserve.transfer.wire import WireError

PROMPTS = ["The capital of France is", "Once upon a time, in a small village by the sea, there lived"]
SAMPLING = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
BIND = "tcp://127.0.0.1:0"


def pd_engines(model_info, tokenizer, *backend):
    """A prefill engine whose cache is a shared pool (``handoff.new_engine``; ``backend``:
    its CUDA IPC backend, if any), a decode engine, a ZeroMQ context, and the colocated
    engine's greedy tokens for each prompt; the pool and context are closed after."""
    path = str(model_info.path)
    prefill, pool = new_engine(path, EngineConfig(kv_cache_memory_mb=32), True, *backend)
    decode = LLMEngine(path, EngineConfig(kv_cache_memory_mb=32))
    colocated = LLMEngine(path, EngineConfig(kv_cache_memory_mb=32))  # not decode: its prefix cache would skip copies
    reference = [generate(colocated, [tokenizer(prompt).input_ids], SAMPLING)[0] for prompt in PROMPTS]
    ctx = zmq.Context()
    try:
        yield prefill, pool, decode, ctx, reference
    finally:
        pool.close()
        ctx.destroy(linger=0)


@pytest.fixture(scope="module")
def setup(model_info, tokenizer):
    """:func:`pd_engines` with a shared-memory pool."""
    yield from pd_engines(model_info, tokenizer)


def _pd(setup, tokenizer, exporter: handoff.Exporter, transport: str, label: str) -> list[list[int]]:
    """Each prompt through a PD hand-off; checks that nothing stays held on either side."""
    prefill, _, decode, ctx, _ = setup
    importer = handoff.Importer(ctx, transport, 10)
    results = []
    try:
        for i, prompt in enumerate(PROMPTS):
            tokens, timings = generate_pd(prefill, decode, exporter, importer, f"{label}-{i}",
                                          tokenizer(prompt).input_ids, SAMPLING)
            assert timings.kv_tcp == float(transport == "tcp") and timings.kv_bytes > 0
            results.append(tokens)
        assert not exporter.table and not _pending(exporter)
        assert prefill.pool.num_in_use == 0 and decode.pool.num_in_use == 0
    finally:
        _stop(exporter)
    return results


def _pending(exporter: handoff.Exporter) -> dict:
    """The layer-pipelined frames being written (none without a pipeline)."""
    return exporter.layer_sink.pending if exporter.layer_sink is not None else {}


def _stop(exporter: handoff.Exporter) -> None:
    """Close ``exporter``; one of the module's pool only stops serving (close would delete
    the pool's file, which the later tests map)."""
    if exporter.pool is None:
        exporter.close()
    elif exporter.server is not None:
        exporter.server.close()


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_pool_hand_off_matches_colocated(setup, tokenizer, transport):
    prefill, pool, _, ctx, reference = setup
    exporter = handoff.Exporter(prefill, 60, ctx, BIND if transport == "tcp" else None, "none", pool)
    assert exporter.hold
    assert _pd(setup, tokenizer, exporter, transport, f"pool-{transport}") == reference


@pytest.mark.parametrize("transfer_dtype", ["none", "bf16"])
def test_layer_pipeline_writes_the_same_frame(setup, tokenizer, transfer_dtype):
    prefill, _, _, ctx, reference = setup
    ids = tokenizer(PROMPTS[1]).input_ids
    frames = {}
    for pipelined in (False, True):
        exporter = handoff.Exporter(prefill, 60, ctx, None, transfer_dtype, layer_pipeline=pipelined)
        rid = f"frame-{transfer_dtype}-{pipelined}"
        prefill.add_request(rid, ids, SAMPLING, hold_kv=True, layer_sink=exporter.layer_sink)
        out = first_output(prefill, rid)
        assert bool(_pending(exporter)) == pipelined, "the pipelined frame is written during the step"
        desc = exporter.export(out)
        frames[pipelined] = shm.read(desc.name)[1]
        exporter.close()
        assert not _pending(exporter) and prefill.pool.num_in_use == 0
    assert frames[True].keys() == frames[False].keys()
    # A request that finishes in its prefill is never exported: its frame goes.
    exporter = handoff.Exporter(prefill, 60, ctx, None, transfer_dtype, layer_pipeline=True)
    prefill.add_request("one-token", ids, SamplingParams(max_tokens=1, temperature=0.0), hold_kv=True,
                        layer_sink=exporter.layer_sink)
    assert first_output(prefill, "one-token").finished
    (pending,) = _pending(exporter).values()
    assert (shm.SHM_DIR / pending.name).exists()
    exporter.expire()
    assert not _pending(exporter) and not (shm.SHM_DIR / pending.name).exists()
    exporter.close()
    for name, tensor in frames[False].items():
        assert tensor.abs().sum() > 0 and tensor.equal(frames[True][name])
    # And end to end, over shared memory and TCP:
    for transport in ("shm", "tcp"):
        exporter = handoff.Exporter(prefill, 60, ctx, BIND, transfer_dtype, layer_pipeline=True)
        tokens = _pd(setup, tokenizer, exporter, transport, f"pipelined-{transfer_dtype}-{transport}")
        if transfer_dtype == "none":
            assert tokens == reference
        else:
            assert [t[0] for t in tokens] == [t[0] for t in reference], "the first token comes from the prefill"


def _held_export(setup, tokenizer, rid: str):
    prefill, pool, decode, ctx, _ = setup
    exporter = handoff.Exporter(prefill, 60, ctx, BIND, "none", pool)
    prefill.add_request(rid, tokenizer(PROMPTS[1]).input_ids, SAMPLING, hold_kv=True)
    out = first_output(prefill, rid)
    return exporter, out, exporter.export(out)


def test_held_blocks_return_on_release(setup, tokenizer):
    prefill, pool, decode, ctx, _ = setup
    exporter, out, desc = _held_export(setup, tokenizer, "held")
    try:
        held = len(out.kv_block_ids)
        assert desc.kind == "pool" and desc.name == pool.name and prefill.pool.num_in_use == held
        assert sum(n for _, n in desc.block_runs) == held and (pool.tags[out.kv_block_ids] == desc.tag).all()
        kv, _ = handoff.Importer(ctx, "shm", 5).take("held", desc, decode.kv_layout(), decode.kv_cache.dtype)
        assert tuple(kv.shape) == decode.kv_block_shape(held)
        exporter.release("held")
        assert prefill.pool.num_in_use == 0 and (pool.tags == 0).all()
        with pytest.raises(WireError, match="no longer held"):
            kv.check()
        with pytest.raises(WireError, match="no longer held"):
            handoff.Importer(ctx, "shm", 5).take("held", desc, decode.kv_layout(), decode.kv_cache.dtype)
        with pytest.raises(WireError, match="no KV"):  # nor over TCP
            handoff.Importer(ctx, "tcp", 5).take("held", desc, decode.kv_layout(), decode.kv_cache.dtype)
    finally:
        exporter.release("held")
        _stop(exporter)


def test_an_expired_hand_off_fails_only_its_request(setup, tokenizer):
    """KV released on the prefill side (TTL) before the decode worker's step imports it:
    that request ends with an error output, the one batched with it goes on."""
    prefill, pool, decode, ctx, _ = setup
    exporter, out, desc = _held_export(setup, tokenizer, "expired")
    try:
        importer = handoff.Importer(ctx, "shm", 5)
        kv, timings = importer.take("expired", desc, decode.kv_layout(), decode.kv_cache.dtype)
        decode.add_request("expired", tokenizer(PROMPTS[1]).input_ids, SAMPLING, kv, out.token_ids[-1],
                           timings=timings)
        decode.add_request("healthy", tokenizer(PROMPTS[0]).input_ids, SAMPLING)  # prefilled locally
        exporter.release("expired")
        outputs = {o.request_id: o for o in decode.step()}
        assert outputs["expired"].finish_reason == "error" and "no longer held" in outputs["expired"].error
        assert outputs["healthy"].error is None and len(outputs["healthy"].token_ids) == 1
        while decode.has_unfinished():
            decode.step()
        assert decode.pool.num_in_use == 0 and "expired" not in decode.seqs
    finally:
        exporter.release("expired")
        _stop(exporter)


def test_forged_descriptors_are_refused(setup, tokenizer):
    prefill, pool, decode, ctx, _ = setup
    exporter, out, desc = _held_export(setup, tokenizer, "forged")
    importer = handoff.Importer(ctx, "auto", 5)
    layout, n = decode.kv_layout(), sum(n for _, n in desc.block_runs)
    forged = {
        "invalid": [{"block_runs": [(desc.pool_blocks - n + 1, n)]}, {"block_runs": [(10**12, n)]},
                    {"block_runs": [(-1, n)]}, {"block_runs": [(0, n + 1)]}, {"tag": 0}, {"num_tokens": 0}],
        "refusing": [{"name": "../../etc/passwd"}, {"name": shm.new_name("kv")}],
        "gone": [{"name": shm.new_name("kvpool")}],
        "bytes, a pool of": [{"pool_blocks": desc.pool_blocks + 1}],
        "no longer held": [{"tag": desc.tag + 1}],
        "unsupported KV pool dtype": [{"layout": dict(layout, dtype="int8")}, {"layout": dict(layout, dtype=[1])}],
    }
    try:
        for message, updates in forged.items():
            for update in updates:
                with pytest.raises(WireError, match=message):
                    importer.take("forged", desc.model_copy(update=update), layout, decode.kv_cache.dtype)
        with pytest.raises(ValueError, match="does not match"):
            importer.take("forged", desc.model_copy(update={"layout": dict(layout, head_dim=32)}), layout,
                          decode.kv_cache.dtype)
        with pytest.raises(WireError, match="another host"):
            handoff.Importer(ctx, "shm", 5).take("forged", desc.model_copy(update={"host_id": "elsewhere"}),
                                                 layout, decode.kv_cache.dtype)
        with pytest.raises(WireError, match="no KV"):  # the TCP server checks the request id
            handoff.Importer(ctx, "tcp", 5).take("other", desc, layout, decode.kv_cache.dtype)
        assert prefill.pool.num_in_use == len(out.kv_block_ids), "refusals leave the export held"
    finally:
        exporter.release("forged")
        _stop(exporter)
    assert prefill.pool.num_in_use == 0


def _start_prefill_worker(tmp_path):
    log = open(tmp_path / f"worker-{time.monotonic_ns()}.log", "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "epdserve", "worker", "--role", "prefill", "--worker-id", "p0",
         "--router", f"tcp://127.0.0.1:{free_port()}", "--bind", f"tcp://127.0.0.1:{free_port()}",
         "--kv-cache-memory-mb", "16", "--allow-unauthenticated"], stdout=log, stderr=subprocess.STDOUT)
    log.close()
    return proc, tmp_path / log.name


def _wait_for_pool(proc, log_path) -> list:
    """The worker's pool files once it serves (its SIGTERM handler is then installed)."""
    deadline = time.monotonic() + 120
    while "listening on" not in log_path.read_text():
        assert proc.poll() is None, log_path.read_text()
        assert time.monotonic() < deadline, "worker did not start:\n" + log_path.read_text()
        time.sleep(0.2)
    return list(shm.SHM_DIR.glob(f"epdserve-kvpool-{proc.pid}-*"))


@pytest.mark.server
def test_pool_file_goes_with_its_worker(tmp_path):
    proc, log_path = _start_prefill_worker(tmp_path)
    try:
        pools = _wait_for_pool(proc, log_path)
        assert len(pools) == 1
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        assert not pools[0].exists(), "SIGTERM: the worker deletes its pool"
        proc, log_path = _start_prefill_worker(tmp_path)
        pools = _wait_for_pool(proc, log_path)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(30)
        assert pools[0].exists(), "SIGKILL skips every handler"
        assert pools[0].name in shm.remove_stale() and not pools[0].exists()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)


def test_serve_with_layer_pipeline_matches_colocated(setup, tokenizer, tmp_path):
    """``serve --kv-layer-pipeline`` reaches the prefill worker (a staged frame, so no pool
    file) and PD output stays the colocated engine's."""
    *_, reference = setup
    dep = start_deployment("pd", tmp_path, "--kv-layer-pipeline", "--kv-cache-memory-mb", "64")
    try:
        assert not list(shm.SHM_DIR.glob(f"epdserve-kvpool-{dep.worker_pid('prefill-0')}-*"))
        for prompt, tokens in zip(PROMPTS, reference):
            got = dep.generate("completion", prompt, stream=True, max_tokens=SAMPLING.max_tokens, temperature=0,
                               extra_body={"ignore_eos": True})
            assert got.text == tokenizer.decode(tokens) and got.usage.completion_tokens == len(tokens)
    finally:
        _stop_deployment(dep.proc)
