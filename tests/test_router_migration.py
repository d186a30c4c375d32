"""A request whose worker dies mid-stream moves to a live worker of its role (``--migration-limit``), in
process with test_router_flows' fake port and clock: what is sent where, what the client reads, what the
trace and /metrics record, and where it fails instead."""

from __future__ import annotations

import logging

from epdserve.serving import protocol as P
from epdserve.serving.metrics import RouterMetrics

from test_router_flows import KV, Reader, Setup, run


def migrating(mode: str, *ids: str, limit: int = 2) -> Setup:
    s = Setup(mode, *ids)
    s.config.migration_limit = limit
    return s


def test_a_colocated_request_moves_with_its_output_and_the_stream_goes_on(caplog):
    s = migrating("colocated", "colocated-0", "colocated-1")

    async def go():
        s.registry.workers["colocated-1"].outstanding["other"] = 1  # colocated-0 is picked first
        flow = s.flow(max_tokens=6, prompt=(1, 2, 3))
        reader = Reader(flow)
        await reader.step()
        s.output("colocated-0", (7,))
        await reader.step()
        s.output("colocated-0", (8,))
        await reader.drain()
        with caplog.at_level(logging.WARNING, "epdserve.router"):
            s.registry.mark_dead("colocated-0", "process exited with code -9")
            await reader.drain()
        assert ("r1: worker colocated-0 died (process exited with code -9); moving it with its 2 output tokens "
                "to colocated-1") in caplog.text
        (moved,) = s.port.of("colocated-1", P.AddRequest)
        assert moved.prompt_token_ids == [1, 2, 3] and moved.resume_ids == [7, 8]
        assert moved.sampling.max_tokens == 6  # the engine counts the resumed tokens against it
        s.output("colocated-1", (9, 10))
        s.output("colocated-1", (11, 12), finished=True)
        await reader.drain()
        assert reader.error is None and [i[0] for i in reader.items] == [[7], [8], [9, 10], [11, 12]]
        rec = flow.end()
        assert rec.output_tokens == 6 and rec.finish_reason == "length" and rec.worker == "colocated-1"
        assert rec.migrations == [{"from": "colocated-0", "to": "colocated-1", "recomputed_tokens": 5}]
        assert rec.as_json()["migrations"] == rec.migrations
        metrics = RouterMetrics("m")
        metrics.ended(rec, flow.itls_s)
        assert 'epdserve:request_migrations_total{engine="router",model_name="m"} 1.0' in metrics.render().decode()

    run(go())


def test_a_pd_request_moves_to_another_decode_worker_without_kv():
    s = migrating("pd", "prefill-0", "decode-0", "decode-1")

    async def go():
        s.registry.workers["decode-1"].outstanding["other"] = 1  # decode-0 is picked first
        flow = s.flow(max_tokens=5)
        reader = Reader(flow)
        await reader.step()
        s.output("prefill-0", (9,), kv=KV)
        await reader.drain()
        s.registry.mark_dead("decode-0", "process exited with code 1")  # before its first output
        await reader.drain()
        (moved,) = s.port.of("decode-1", P.AddRequest)
        assert moved.kv is None and moved.first_token is None and moved.resume_ids == [9]
        s.output("decode-1", (10, 11, 12, 13), finished=True)
        await reader.drain()
        assert reader.error is None and [i[0] for i in reader.items] == [[9], [10, 11, 12, 13]]
        flow.close()
        assert s.port.frees() == [("prefill-0", "release_kv")]
        assert flow.trace().decode_worker == "decode-1"

    run(go())


def test_past_the_limit_or_with_no_live_worker_it_fails_at_once_naming_why():
    for limit, ids, why in ((1, ("colocated-0", "colocated-1"), "; moved 1 times already (--migration-limit)"),
                            (2, ("colocated-0",), "; no other live colocated worker to move it to")):
        s = migrating("colocated", *ids, limit=limit)

        async def go():
            flow = s.flow()
            reader = Reader(flow)
            await reader.step()
            s.output("colocated-0", (7,))
            await reader.drain()
            s.registry.mark_dead("colocated-0", "gone")
            await reader.drain()
            if limit == 1:  # one move, then its new worker dies too
                s.output("colocated-1", (8,))
                await reader.drain()
                s.registry.mark_dead("colocated-1", "gone")
                await reader.drain()
            assert reader.error.status == 503
            dead = "colocated-1" if limit == 1 else "colocated-0"
            assert str(reader.error) == f"worker {dead} died (gone){why}"
            flow.close()

        run(go())


def test_a_decode_worker_s_image_request_is_not_moved():
    """It would need the images' embeddings; a colocated worker gets their bytes and could."""
    s = migrating("epd", "encode-0", "prefill-0", "decode-0", "decode-1")
    image = P.ImageRef(hash="h0", tokens=2, data=b"png")

    async def go():
        flow = s.flow(prompt=(1, 5, 5, 2), images=[image])
        reader = Reader(flow)
        await reader.step()
        s.encoded("encode-0")
        await reader.drain()
        s.output("prefill-0", (9,), kv=KV)
        await reader.drain()
        s.registry.mark_dead("decode-0", "gone")
        await reader.drain()
        assert str(reader.error) == "worker decode-0 died (gone)"
        assert s.port.of("decode-1", P.AddRequest) == []
        flow.close()

    run(go())


def test_a_worker_whose_tensor_parallel_ranks_failed_gives_up_its_requests_to_another():
    """Its Error with ``worker_lost``: the worker is down at once and the request moves (before its first
    token: retried); with --migration-limit 0 the Error ends the request, as it always did."""
    for limit in (2, 0):
        s = migrating("colocated", "colocated-0", "colocated-1", limit=limit)
        lost = "the worker's tensor-parallel ranks failed (tensor-parallel rank 1 exited); it is restarting"

        async def go():
            s.registry.workers["colocated-1"].outstanding["other"] = 1  # colocated-0 is picked first
            flow = s.flow(max_tokens=4)
            reader = Reader(flow)
            await reader.step()
            s.output("colocated-0", (7,))
            await reader.drain()
            s.registry.on_message(P.Error(worker_id="colocated-0", request_id="r1", message=lost, status=500,
                                          worker_lost=True), s.clock())
            await reader.drain()
            if limit:
                assert s.registry.workers["colocated-0"].dead == lost
                (moved,) = s.port.of("colocated-1", P.AddRequest)
                assert moved.resume_ids == [7]
                s.output("colocated-1", (8, 9, 10), finished=True)
                await reader.drain()
                assert reader.error is None and [i[0] for i in reader.items] == [[7], [8, 9, 10]]
            else:
                assert str(reader.error) == f"worker colocated-0 failed the request: {lost}"
                assert reader.error.status == 500 and not s.registry.workers["colocated-0"].dead
            flow.close()

        run(go())


def test_an_encode_worker_lost_leaves_its_images_to_the_prefill_worker():
    """With --migration-limit 0 it is a 503 (test_router_flows); above 0 the request goes on: its prefill
    worker gets the image bytes, no frame, and encodes them; every encode worker's frame is released."""
    s = migrating("epd", "encode-0", "encode-1", "prefill-0", "decode-0")
    images = [P.ImageRef(hash=f"h{i}", tokens=3, data=b"png") for i in range(2)]

    async def go():
        flow = s.flow(prompt=(1, 5, 5, 5, 6, 6, 6, 2), images=images)
        reader = Reader(flow)
        await reader.step()
        s.encoded("encode-1")
        s.registry.mark_dead("encode-0", "gone")
        await reader.step()
        (sent,) = s.port.of("prefill-0", P.AddRequest)
        assert sent.embeddings == [] and [im.data for im in sent.images] == [b"png", b"png"]
        s.output("prefill-0", (9,), kv=KV)
        await reader.drain()
        s.output("decode-0", (10, 11), finished=True)
        await reader.drain()
        assert reader.error is None and [i[0] for i in reader.items] == [[9], [10, 11]]
        assert flow.trace().migrations == [{"from": "encode-0", "to": "prefill-0", "recomputed_tokens": 6}]
        assert ("encode-1", "release_kv") in flow.close()

    run(go())


def test_an_encode_worker_whose_ranks_failed_leaves_its_images_to_the_prefill_worker():
    s = migrating("epd", "encode-0", "prefill-0", "decode-0")
    image = P.ImageRef(hash="h0", tokens=3, data=b"png")

    async def go():
        flow = s.flow(prompt=(1, 5, 5, 5, 2), images=[image])
        reader = Reader(flow)
        await reader.step()
        s.registry.on_message(P.Error(worker_id="encode-0", request_id="r1", message="ranks failed", status=500,
                                      worker_lost=True), s.clock())
        await reader.step()
        assert s.registry.workers["encode-0"].dead == "ranks failed"
        (sent,) = s.port.of("prefill-0", P.AddRequest)
        assert sent.embeddings == [] and sent.images[0].data == b"png"
        flow.close()

    run(go())
