"""Tensor parallelism of the vision tower (an encode worker of ``--encode-tp N``,
model/vision.py): the split of SmolVLM-256M's tower (12 heads, 3,072 MLP features) over 2
and 5 ranks, then real follower ranks (``serving/worker/ranks.py``, gloo over 127.0.0.1)
encoding images through the encode engine, against the whole tower in this process; and
the sizes serve and the worker refuse, each with one line."""

from __future__ import annotations

import argparse
import io
import time

import numpy as np
import pytest
import torch
from PIL import Image

from epdserve.engine.encoder import EncodeEngine
from epdserve.model.image_processor import ImageInput
from epdserve.model.loader import resolve_model
from epdserve.model.vision import VisionConfig, read_config, vision_shard
from epdserve.serving.launch import launcher
from epdserve.serving.worker import engine_worker
from epdserve.serving.worker.ranks import Ranks
from epdserve.argtypes import config_from
from epdserve.serving.launch.options import ServeOptions

# The ranks' embeddings against the whole tower's: float32 partial sums of the output
# projection and fc2 added in another order move embeddings of magnitude ~0.6 by ~4e-7; a
# wrong head or feature moves them by whole tenths.
EMBEDDINGS_ATOL = 1e-5


@pytest.fixture(scope="module")
def vlm_dir() -> str:
    return str(resolve_model("vlm").path)


@pytest.fixture(scope="module")
def config(vlm_dir) -> VisionConfig:
    return VisionConfig.from_dict(read_config(vlm_dir))


def image(seed: int, size: tuple[int, int]) -> ImageInput:
    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, "PNG")
    return ImageInput.from_bytes(out.getvalue(), "test")


def test_the_tower_splits_by_whole_heads_and_mlp_features(config):
    assert (config.num_attention_heads, config.intermediate_size, config.head_dim) == (12, 3072, 64)
    assert [vision_shard(config, r, 2) for r in range(2)] == [(range(0, 6), range(0, 1536)),
                                                            (range(6, 12), range(1536, 3072))]
    heads, features = zip(*(vision_shard(config, r, 5) for r in range(5)))
    assert [len(h) for h in heads] == [3, 3, 2, 2, 2] and [len(f) for f in features] == [615, 615, 614, 614, 614]
    for size in (0, 13):
        with pytest.raises(ValueError, match=f"^tensor parallel size {size} of the vision tower: it must be between "
                                             "1 and its 12 attention heads"):
            vision_shard(config, 0, size)


@pytest.fixture(scope="module")
def images():
    return [image(1, (300, 200)), image(2, (900, 700))]  # one batch of 2 tiles (the default VLM does not split)


@pytest.fixture(scope="module")
def whole(vlm_dir, images):
    return EncodeEngine(vlm_dir).encode(images)


@pytest.mark.parametrize("size", [2, 5], ids=["tp2", "tp5-uneven"])
def test_ranks_encode_what_the_whole_tower_does(vlm_dir, images, whole, size):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    ranks = Ranks.start(size, f"encode-tp{size}", vlm_dir, "float32", "auto", "cpu", [[0], [1]] * 3, part="vision")
    try:
        engine = EncodeEngine(vlm_dir, tp=ranks)
        assert engine.vision.num_heads == (6 if size == 2 else 3)
        start = time.perf_counter()
        got = engine.encode(images)
        print(f"\n{size} ranks: {len(images)} images encoded in {time.perf_counter() - start:.2f} s")
        for a, b in zip(whole, got):
            assert (a.rows, a.cols) == (b.rows, b.cols) and a.embeddings.shape == b.embeddings.shape
            assert torch.allclose(a.embeddings, b.embeddings, atol=EMBEDDINGS_ATOL, rtol=0)
        assert engine.encode(images[:1])[0].encode_ms == 0.0  # rank 0's cache answers a repeat
    finally:
        ranks.close()
        torch.set_num_threads(threads)


def serve_error(*argv: str) -> str | None:
    parser = argparse.ArgumentParser()
    launcher.add_arguments(parser)
    options = config_from(ServeOptions, parser.parse_args([*argv, "--allow-unauthenticated", "--cores", "0,1"]))
    return launcher._check_options(options)[2]


def test_serve_takes_encode_ranks_in_epd_only():
    assert serve_error("--mode", "epd", "--encode-tp", "2") is None
    assert serve_error("--mode", "pd", "--encode-tp", "2") == ("--encode-tp applies to epd mode; a pd deployment has "
                                                               "no encode workers")
    assert serve_error("--encode-tp", "2") == ("--encode-tp applies to epd mode; a colocated deployment has no "
                                               "encode workers")
    assert serve_error("--elastic", "--workers", "2", "--encode-tp", "2") == ("--encode-tp applies to epd mode; an "
                                                                           "elastic deployment has no encode workers")
    assert serve_error("--mode", "epd", "--encode-tp", "3") == ("--encode-tp 3 needs 3 cores, one a rank; serve has 2 "
                                                                "(0,1): give it more --cores or use fewer ranks")


def test_an_encode_worker_refuses_more_ranks_than_heads(capsys):
    parser = argparse.ArgumentParser()
    engine_worker.add_arguments(parser)
    args = parser.parse_args(["--role", "encode", "--model", "vlm", "-tp", "13", "--router", "ipc:///nowhere/events",
                              "--bind", "ipc:///nowhere/cmd", "--worker-id", "e", "--allow-unauthenticated"])
    threads = torch.get_num_threads()
    try:
        assert engine_worker.run(engine_worker.WorkerConfig.from_args(args)) == 2
    finally:
        torch.set_num_threads(threads)
    assert capsys.readouterr().out.strip() == ("epdserve worker: error: tensor parallel size 13 of the vision tower: "
                                               "it must be between 1 and its 12 attention heads (each rank needs one)")
