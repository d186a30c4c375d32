"""CUDA IPC hand-off (epdserve.transfer.cuda_ipc): the handle format and its validation
(every bad field named), the release rules with the CPU fake backend (a real prefill and
decode engine, the real Exporter/Importer: success, abort, TTL, peer death, double
release, import after release, a GPU the importer does not see), page-locked staging's
frame, and, on a GPU only (``cuda`` marker), a real export/import between two processes."""

from __future__ import annotations

import subprocess
import sys
import time

import msgpack
import pytest
import torch

from scripts import load_script
from test_transfer_handoff import PROMPTS, SAMPLING, pd_engines

from epdserve.engine.kv_parts import KVParts
from epdserve.transfer import cuda_ipc, handoff, shm, wire
from epdserve.transfer.cuda_ipc import FakeBackend, IpcError, IpcImporter
from epdserve.transfer.loopback import first_output, generate_pd
from epdserve.transfer.pooled import PooledKV
from epdserve.transfer.wire import WireError

BIND = "tcp://127.0.0.1:0"
SHAPE = (2, 2, 6, 4, 2, 8)  # layers, K/V, blocks, block size, kv heads, head dim
LAYOUT = {"num_layers": 2, "num_kv_heads": 2, "head_dim": 8, "block_size": 4, "dtype": "bfloat16"}


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


@pytest.fixture
def small_pool():
    """A fake-shared bf16 pool of SHAPE on the CPU with counting values."""
    pool = cuda_ipc.DevicePool(SHAPE, torch.bfloat16, "cpu", FakeBackend())
    pool.kv.copy_(torch.arange(pool.kv.numel()).view(SHAPE) % 251)
    yield pool
    pool.close()


# --- the format --------------------------------------------------------------------------

def test_a_handle_round_trips_as_msgpack_bytes(small_pool):
    data = small_pool.handle_bytes
    assert isinstance(data, bytes) and len(data) < cuda_ipc.MAX_PACKED_BYTES
    assert cuda_ipc.unpack_handle(data) == small_pool.handle
    assert small_pool.handle.pool_id == small_pool.name and shm.TAGS.fullmatch(small_pool.name)
    assert small_pool.handle.size_bytes == small_pool.kv.nbytes and small_pool.handle.shape == list(SHAPE)


BAD_FIELDS = [
    ({"handle": b"\x03c" + bytes(63)}, "handle is 65 bytes"),
    ({"handle": b"\x03e" + bytes(64)}, "expandable segment"),
    ({"event_handle": bytes(10)}, "event_handle is 10 bytes"),
    ({"size_bytes": 2 * 6 * 4 * 2 * 8 * 2 * 2 + 2}, r"size_bytes \d+ does not fit shape"),
    ({"offset_bytes": 3}, "offset_bytes 3"),
    ({"offset_bytes": -2}, "offset_bytes -2"),
    ({"dtype": "int8"}, "dtype 'int8' is not a KV cache dtype"),
    ({"dtype": "float64"}, "dtype 'float64' is not a KV cache dtype"),
    ({"shape": [2, 2, 6, 4, 2]}, r"shape \[2, 2, 6, 4, 2\] is not \[layers, 2"),
    ({"shape": [2, 3, 6, 4, 2, 8]}, "is not \\[layers, 2"),
    ({"shape": [2, 2, 0, 4, 2, 8]}, "is not \\[layers, 2"),
    ({"pool_id": "../../etc/passwd"}, "pool_id '../../etc/passwd' is not a KV tag file's name"),
    ({"pool_id": shm.new_name("kvpool")}, "is not a KV tag file's name"),
    ({"owner_pid": 0}, "owner pid 0"),
    ({"device_index": -1}, "device -1"),
    ({"device_uuid": ""}, "not a process and a GPU"),
    ({"ref_counter": b"/dev/shm/other"}, "ref counter"),
    ({"ref_counter_offset": cuda_ipc.REF_COUNTER_SLOTS}, "ref counter"),
    ({"ref_counter": b"/torch_1_2_3"}, r"ref counter b'/torch_1_2_3' slot 0 is not torch's of process \d+"),
    ({"backend": "rdma"}, "backend: Input should be 'cuda' or 'fake'"),
    ({"owner_pid": "12"}, "owner_pid: Input should be a valid integer"),
    ({"handle": "text"}, "handle: Input should be a valid bytes"),
    ({"extra": 1}, "extra: Extra inputs are not permitted"),
]


@pytest.mark.parametrize("update, message", BAD_FIELDS)
def test_every_bad_field_is_named(small_pool, update, message):
    fields = {**small_pool.handle.model_dump(), **update}
    with pytest.raises(IpcError, match=message):
        cuda_ipc.make_handle(**fields)
    with pytest.raises(IpcError, match=message):  # the same from the wire
        cuda_ipc.unpack_handle(msgpack.packb(fields, use_bin_type=True))


def test_malformed_bytes_are_refused(small_pool):
    missing = small_pool.handle.model_dump()
    del missing["handle"]
    for data, message in [(b"", "1 to 4096 bytes"), (b"\x00" * 5000, "1 to 4096 bytes"), ("text", "not str"),
                          (b"\xc1", "not msgpack"), (msgpack.packb([1, 2]), "not a map"),
                          (msgpack.packb(missing, use_bin_type=True), "handle: Field required")]:
        with pytest.raises(IpcError, match=message):
            cuda_ipc.unpack_handle(data)


def test_the_importer_says_what_differs(small_pool):
    importer = IpcImporter(FakeBackend())
    with pytest.raises(IpcError, match=r"differs from this worker's: block_size 4 \(theirs\) vs 8 \(ours\), "
                                       r"head_dim 8 \(theirs\) vs 16 \(ours\)$"):
        importer.open(small_pool.handle, dict(LAYOUT, head_dim=16, block_size=8))
    with pytest.raises(IpcError, match="GPU fake-gpu-0 .* is not one this process sees .*CUDA_VISIBLE_DEVICES"):
        IpcImporter(FakeBackend(uuids=("fake-gpu-1",))).open(small_pool.handle, LAYOUT)
    kv, tags = importer.open(small_pool.handle, dict(LAYOUT, dtype="float32"))  # a dtype of its own is fine
    assert kv.data_ptr() == small_pool.kv.data_ptr() and tags.shape == (SHAPE[2],)
    forged = cuda_ipc.make_handle(**{**small_pool.handle.model_dump(), "device_index": 3})
    with pytest.raises(IpcError, match="open with another handle"):
        importer.open(forged, LAYOUT)
    importer.close()
    assert not importer.open_ids() and importer.backend.open_count == 0


# --- open → copy blocks → close, and peer death -------------------------------------------

def _pooled(importer: IpcImporter, pool: cuda_ipc.DevicePool, runs, tag: int) -> PooledKV:
    kv, tags = importer.open(pool.handle, LAYOUT)
    return PooledKV("r", KVParts([kv]), tags, runs, tag, torch.float32, lambda: cuda_ipc.exporter_alive(pool.handle))


def test_open_copy_close(small_pool):
    importer = IpcImporter(FakeBackend())
    small_pool.tags[[1, 2, 4]] = 7
    kv = _pooled(importer, small_pool, [(1, 2), (4, 1)], 7)
    cache = torch.zeros(SHAPE[:2] + (5,) + SHAPE[3:])
    kv.copy_into(KVParts([cache]), [3, 4, 0])
    assert cache[:, :, [3, 4, 0]].equal(small_pool.kv[:, :, [1, 2, 4]].float())
    assert importer.open_ids() == [small_pool.name] and importer.backend.open_count == 1
    importer.close(small_pool.name)
    assert not importer.open_ids() and importer.backend.open_count == 0


def test_a_dead_or_closed_exporter_voids_the_import(small_pool):
    dead = cuda_ipc.DevicePool(SHAPE, torch.bfloat16, "cpu", FakeBackend(owner_pid=_dead_pid()))
    importer = IpcImporter(FakeBackend())
    try:
        dead.tags[:] = 1
        kv = _pooled(importer, dead, [(0, 1)], 1)
        with pytest.raises(WireError, match="prefill worker that exported the KV of r is gone"):
            kv.check()
        _pooled(importer, small_pool, [(0, 1)], 0)  # the next open drops the dead exporter's pool
        assert importer.open_ids() == [small_pool.name]
    finally:
        dead.close()
    small_pool.tags[0] = 3
    kv = _pooled(importer, small_pool, [(0, 1)], 3)
    small_pool.close()  # a stopped prefill worker: its tag file goes
    with pytest.raises(WireError, match="is gone"):
        kv.copy_into(KVParts([torch.zeros(SHAPE)]), [0])
    with pytest.raises(WireError, match="tag file .* is gone"):
        importer.open(small_pool.handle, LAYOUT)
    assert not importer.open_ids()


def test_pinned_frame_is_a_wire_frame():
    header = wire.TensorHeader(tensors=[wire.TensorSpec(name="kv", dtype="bfloat16", shape=[2, 3])],
                               num_tokens=3, layout=LAYOUT)
    values = torch.arange(6, dtype=torch.bfloat16).view(2, 3)
    frame = cuda_ipc.pinned_frame(header, lambda views: views["kv"].copy_(values), pin=False)
    parsed, tensors = wire.parse(frame)
    assert parsed == header and tensors["kv"].equal(values)
    with pytest.raises(WireError, match="cannot hold a frame"):
        wire.pack(header, lambda views: None, bytearray(wire.frame_size(header) + 1))


# --- the release rules with real engines ---------------------------------------------------

@pytest.fixture(scope="module")
def engines(model_info, tokenizer):
    """:func:`pd_engines` with a fake-shared DevicePool as the prefill engine's cache."""
    yield from pd_engines(model_info, tokenizer, FakeBackend())


def test_the_fake_shared_pool_is_the_prefill_cache(engines):
    prefill, pool = engines[:2]
    assert isinstance(pool, cuda_ipc.DevicePool) and pool.kv.data_ptr() == prefill.kv_cache.data_ptr()


@pytest.mark.parametrize("transport, sees_gpu, over_tcp", [("auto", True, 0.0), ("shm", True, 0.0),
                                                            ("tcp", True, 1.0), ("auto", False, 1.0)])
def test_hand_off_matches_colocated(engines, tokenizer, transport, sees_gpu, over_tcp):
    """CUDA IPC (fake) on one host; TCP when asked, or when "auto" finds the GPU invisible."""
    prefill, pool, decode, ctx, reference = engines
    exporter = handoff.Exporter(prefill, 60, ctx, BIND, "none", pool)
    importer = handoff.Importer(ctx, transport, 10, FakeBackend(uuids=("fake-gpu-0",) if sees_gpu else ("x",)))
    try:
        for i, prompt in enumerate(PROMPTS):
            tokens, timings = generate_pd(prefill, decode, exporter, importer, f"{transport}-{sees_gpu}-{i}",
                                          tokenizer(prompt).input_ids, SAMPLING)
            assert tokens == reference[i] and timings.kv_tcp == over_tcp
        assert not exporter.table and prefill.pool.num_in_use == 0 and not pool.tags.any()
        assert importer.ipc.open_ids() == ([pool.name] if over_tcp == 0.0 else [])
    finally:
        exporter.server.close()
        importer.close()


def _export(engines, tokenizer, rid: str, ttl_s: float = 60):
    prefill, pool, _, ctx, _ = engines
    exporter = handoff.Exporter(prefill, ttl_s, ctx, None, "none", pool)
    prefill.add_request(rid, tokenizer(PROMPTS[1]).input_ids, SAMPLING, hold_kv=True)
    out = first_output(prefill, rid)
    desc = exporter.export(out)
    assert desc.kind == "cuda_ipc" and desc.name == pool.name and (pool.tags[out.kv_block_ids] == desc.tag).all()
    return exporter, out, desc


def _take(engines, rid, desc, importer=None):
    _, _, decode, ctx, _ = engines
    importer = importer or handoff.Importer(ctx, "auto", 5, FakeBackend())
    return importer.take(rid, desc, decode.kv_layout(), decode.kv_cache.dtype)


@pytest.mark.parametrize("rule", ["abort", "ttl", "double release"])
def test_released_blocks_are_never_imported(engines, tokenizer, rule):
    prefill, pool, _, _, _ = engines
    exporter, out, desc = _export(engines, tokenizer, rule, ttl_s=0.0 if rule == "ttl" else 60)
    kv, _ = _take(engines, rule, desc)  # taken, not yet copied by the decode engine
    if rule == "ttl":
        time.sleep(0.01)
        assert exporter.expire() == [rule]
    else:
        exporter.release(rule)
    assert prefill.pool.num_in_use == 0 and not pool.tags.any()
    if rule == "double release":
        assert not exporter.table.release(rule) and prefill.pool.num_in_use == 0
    with pytest.raises(WireError, match="no longer held"):
        kv.copy_into(KVParts([torch.zeros(kv.shape)]), list(range(kv.shape[2])))
    with pytest.raises(WireError, match="no longer held"):  # an import after the release
        _take(engines, rule, desc)


def test_a_late_release_fails_only_its_request(engines, tokenizer):
    """Released (TTL) while the decode engine queued the import: that request ends with an
    error, the one batched with it goes on."""
    prefill, _, decode, _, _ = engines
    exporter, out, desc = _export(engines, tokenizer, "late")
    kv, timings = _take(engines, "late", desc)
    decode.add_request("late", tokenizer(PROMPTS[1]).input_ids, SAMPLING, kv, out.token_ids[-1], timings=timings)
    decode.add_request("local", tokenizer(PROMPTS[0]).input_ids, SAMPLING)
    exporter.release("late")
    outputs = {o.request_id: o for o in decode.step()}
    assert outputs["late"].finish_reason == "error" and "no longer held" in outputs["late"].error
    assert outputs["local"].error is None
    while decode.has_unfinished():
        decode.step()
    assert decode.pool.num_in_use == 0 and prefill.pool.num_in_use == 0


def test_forged_ipc_descriptors_are_refused(engines, tokenizer):
    prefill, pool, decode, _, _ = engines
    exporter, out, desc = _export(engines, tokenizer, "forged")
    other = cuda_ipc.make_handle(**{**pool.handle.model_dump(), "pool_id": shm.new_name("kvtags")})
    forged = {
        "1 to 4096 bytes": {"ipc": b""},
        "not msgpack": {"ipc": b"\xc1"},
        "names pool": {"name": shm.new_name("kvtags")},
        "tag file .* is gone": {"name": other.pool_id, "ipc": cuda_ipc.pack_handle(other)},
        "invalid": {"block_runs": [(pool.handle.num_blocks, 1)]},
        "no longer held": {"tag": desc.tag + 1},
    }
    try:
        for message, update in forged.items():
            with pytest.raises(WireError, match=message):
                _take(engines, "forged", desc.model_copy(update=update))
        with pytest.raises(IpcError, match="not one this process sees"):
            _take(engines, "forged", desc, handoff.Importer(engines[3], "shm", 5, FakeBackend(uuids=("x",))))
        assert prefill.pool.num_in_use == len(out.kv_block_ids), "refusals leave the export held"
    finally:
        exporter.release("forged")
    assert prefill.pool.num_in_use == 0


# --- on a GPU --------------------------------------------------------------------------------

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (this torch sees none)")


@pytest.mark.cuda
@cuda
def test_two_processes_share_kv_by_cuda_ipc():
    """A real export in one process, import in another on the same GPU: the copied blocks
    are bit-equal, a copy after the exporter's release is refused, the handle is closed."""
    ipc_bench = load_script("ipc_bench")

    assert ipc_bench.two_process_check("cuda:0") == {"bit_equal": True, "refused_after_release": True,
                                                     "closed": True}
    if torch.cuda.device_count() > 1:  # into a cache on another GPU: a peer copy
        assert ipc_bench.two_process_check("cuda:0", "cuda:1")["bit_equal"]


@pytest.mark.cuda
@cuda
def test_the_copy_benchmark_runs():
    ipc_bench = load_script("ipc_bench")

    result = ipc_bench.ipc_copy_benchmark(64, repeats=3)
    assert result["kv_bytes"] == 64 * 128 * 1024 and result["ipc_ms"] > 0 and result["d2d_gbps"] > 0
