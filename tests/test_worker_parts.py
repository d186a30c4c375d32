"""The parts an engine or encode worker delegates to, in-process with fakes: the watch over a
tensor-parallel worker's follower ranks (serving/worker/rank_watch.py), images encoded from
their bytes (image_encoder.py) and the Stats report (stats_report.py)."""

from __future__ import annotations

import logging
import queue

import pytest
import torch

from epdserve.engine.request import SamplingParams
from epdserve.model.image_processor import ImageError, ImageInput
from epdserve.serving import protocol as P
from epdserve.serving.worker import stats_report
from epdserve.serving.worker.encode_worker import EncodeWorker
from epdserve.serving.worker.engine_worker import Worker
from epdserve.serving.worker.image_encoder import ImageEncoder, cache_stats
from epdserve.serving.worker.ranks import RankFailure
from epdserve.trace import StageTimings

HIDDEN = 4


class Events:
    """A worker's events socket: what it sends, decoded."""

    def __init__(self):
        self.sent = []

    def send(self, frame: bytes) -> None:
        self.sent.append(P.decode(frame))

    def of(self, kind) -> list:
        return [m for m in self.sent if isinstance(m, kind)]


class FakeRanks:
    def __init__(self, failure: RankFailure | None = None):
        self.failure = failure

    def check(self) -> None:
        if self.failure is not None:
            raise self.failure


class FakeEngine:
    """Requests ``seqs``; ``step`` raises ``error`` if set, else finishes nothing."""

    def __init__(self, *request_ids: str, error: Exception | None = None):
        self.seqs = dict.fromkeys(request_ids)
        self.error = error

    def has_unfinished(self) -> bool:
        return bool(self.seqs)

    def step(self) -> list:
        if self.error is not None:
            raise self.error
        return []

    def abort(self, request_id: str) -> None:
        self.seqs.pop(request_id, None)

    def stats(self) -> dict:
        return dict(blocks_total=8, blocks_in_use=len(self.seqs), num_running=len(self.seqs), num_waiting=0,
                    num_preemptions=0)


class FakeExporter:
    ttl_s = 60.0
    layer_sink = None

    class table:
        @staticmethod
        def ids() -> list[str]:
            return []

    def expire(self) -> list[str]:
        return []

    def close(self) -> None:
        pass


class FakeImporter:
    def close(self) -> None:
        pass


class FakeEncoder:
    """Encodes each image to ``[tokens, HIDDEN]`` rows of its index, or fails it with ``bad``."""

    class cache:
        queries, hits = 3, 1

    def __init__(self, tokens: int = 2, bad: ImageError | None = None, failure: RankFailure | None = None):
        self.tokens, self.bad, self.failure = tokens, bad, failure

    def encode(self, images: list[ImageInput]) -> list:
        if self.failure is not None:
            raise self.failure
        return [self.bad or type("Encoded", (), {"embeddings": torch.full((self.tokens, HIDDEN), float(i))})()
                for i, _ in enumerate(images)]


def worker(engine, encoder=None) -> Worker:
    return Worker(engine, "w0", queue.Queue(), Events(), FakeExporter(), FakeImporter(), encoder)


def image(data: bytes, tokens: int = 2) -> P.ImageRef:
    return P.ImageRef(hash=ImageInput.from_bytes(data, "t", decode=False).content_hash, tokens=tokens, data=data)


def add(request_id: str, *images: P.ImageRef) -> P.AddRequest:
    return P.AddRequest(request_id=request_id, prompt_token_ids=[1, 2], sampling=SamplingParams(max_tokens=1),
                        images=list(images))


# ---- rank watch -------------------------------------------------------------------------

def test_a_rank_failure_in_a_step_fails_the_engines_requests_and_stops_with_status_1(caplog):
    w = worker(FakeEngine("a", "b", error=RankFailure("tensor-parallel rank 1 of w0 exited")))
    w.rank_watch.ranks = FakeRanks()
    with caplog.at_level(logging.ERROR, "epdserve.worker"):
        w.step()
    errors = w.events.of(P.Error)
    assert [(e.request_id, e.status) for e in errors] == [("a", 500), ("b", 500)]
    assert errors[0].message == ("the worker's tensor-parallel ranks failed (tensor-parallel rank 1 of w0 exited); "
                                 "it is restarting")
    assert not w.engine.seqs and (w.running, w.exit_code) == (False, 1)
    assert "restarted with all its ranks" in caplog.text


def test_any_other_step_error_fails_the_requests_and_keeps_serving():
    w = worker(FakeEngine("a", error=RuntimeError("bug")))
    w.step()
    (error,) = w.events.of(P.Error)
    assert (error.request_id, error.status, error.message) == ("a", 500, "internal error in the engine step")
    assert not w.engine.seqs and (w.running, w.exit_code) == (True, 0)


def test_an_idle_worker_stops_when_a_follower_has_exited_and_one_process_never_does():
    w = worker(FakeEngine())
    w.rank_watch.check()  # no ranks
    w.rank_watch.ranks = FakeRanks()
    w.rank_watch.check()
    assert (w.running, w.rank_watch.failure) == (True, None)
    w.rank_watch.ranks = FakeRanks(RankFailure("rank 1 exited"))
    w.loop()  # idle: the check stops it after one round
    assert (w.running, w.exit_code, str(w.rank_watch.failure)) == (False, 1, "rank 1 exited")
    assert not w.events.of(P.Error)


def test_an_encode_rank_failure_fails_the_batch_and_stops_before_more_housekeeping():
    encoder = FakeEncoder(failure=RankFailure("rank 1 exited"))
    w = EncodeWorker(encoder, "e0", queue.Queue(), Events(), None, None, 60.0)
    w.rank_watch.ranks = FakeRanks()
    for request_id in ("r1", "r2"):
        w.inbox.put((P.Encode(request_id=request_id, images=[image(request_id.encode())]), 0.0))
    w.loop()
    errors = w.events.of(P.Error)
    assert [(e.request_id, e.status) for e in errors] == [("r1", 500), ("r2", 500)]
    assert errors[0].message.startswith("the encode worker's tensor-parallel ranks failed (rank 1 exited)")
    assert (w.running, w.exit_code) == (False, 1) and not w.events.of(P.Stats)


# ---- image encoding ---------------------------------------------------------------------

def test_images_are_encoded_in_prompt_order_and_timed():
    timings = StageTimings()
    rows = ImageEncoder(FakeEncoder(tokens=2)).embeddings(add("r", image(b"x"), image(b"y")), 0.0, timings)
    assert rows.shape == (4, HIDDEN) and rows[:, 0].tolist() == [0.0, 0.0, 1.0, 1.0]
    assert timings.encode_ms >= 0 and timings.encode_queue_ms > 0


@pytest.mark.parametrize("encoder, ref, error", [
    (None, image(b"x"), "this worker has no vision encoder"),
    (FakeEncoder(), P.ImageRef(hash="0" * 64, tokens=2), "image 0 came without its bytes"),
    (FakeEncoder(), P.ImageRef(hash="0" * 64, tokens=2, data=b"x"), "image 0: its bytes hash to"),
    (FakeEncoder(bad=ImageError("not an image")), image(b"x"), "not an image"),
])
def test_images_that_cannot_be_encoded_raise(encoder, ref, error):
    with pytest.raises(ValueError, match=error):
        ImageEncoder(encoder).embeddings(add("r", ref), 0.0, StageTimings())


def test_a_worker_fails_a_request_whose_images_cannot_be_encoded():
    engine = FakeEngine()
    engine.add_request = lambda *args, **kwargs: pytest.fail("queued")
    w = worker(engine)  # a text model: no vision encoder
    w.handle(add("r", image(b"x")), 0.0)
    (error,) = w.events.of(P.Error)
    assert (error.request_id, error.status) == ("r", 400) and "takes no images" in error.message


def test_cache_stats_are_the_encoders_counters():
    assert cache_stats(None) == {}
    assert cache_stats(FakeEncoder()) == {"mm_cache_queries": 3, "mm_cache_hits": 1}


# ---- stats report -----------------------------------------------------------------------

def test_stats_are_sent_when_they_change_and_at_least_every_interval(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(stats_report.time, "monotonic", lambda: now[0])
    sent = []
    report = stats_report.StatsReport("w0", sent.append)
    stats = FakeEngine("a").stats()
    report.report(stats)
    report.report(dict(stats))  # unchanged, within the interval
    now[0] += stats_report.STATS_INTERVAL_S / 2
    report.report(dict(stats, num_waiting=1))  # changed
    report.report(dict(stats, num_waiting=1))
    now[0] += stats_report.STATS_INTERVAL_S * 1.5
    report.report(dict(stats, num_waiting=1))  # the interval passed
    report.send_next()
    report.report(dict(stats, num_waiting=1))
    assert [m.num_waiting for m in sent] == [0, 1, 1, 1] and {m.worker_id for m in sent} == {"w0"}
