"""DeploymentSpec: the one parser of deployment names (epdserve.serving.deployment)."""

from __future__ import annotations

import argparse
import re

import pytest

from epdserve.plan import search
from epdserve.plan.costmodel import LinearStep, Link, Platform
from epdserve.serving.deployment import NAME_FORMS, TP_FORMS, DeploymentSpec, plan_workers, tp_suffix
from epdserve.argtypes import add_flags, config_from
from epdserve.serving.launch.options import ServeOptions

NOPREFIX = ["--no-enable-prefix-caching"]

# name -> the `epdserve serve` flags it means
FLAGS = {
    "colocated": ["--mode", "colocated"],
    "pd": ["--mode", "pd"],
    "colocated-chunked": ["--mode", "colocated", "--max-num-batched-tokens", "256"],
    "colocated-1": ["--mode", "colocated", "--workers", "1"],
    "colocated-12": ["--mode", "colocated", "--workers", "12"],
    "1p1d": ["--mode", "pd", "--prefill-workers", "1", "--decode-workers", "1"],
    "2p1d": ["--mode", "pd", "--prefill-workers", "2", "--decode-workers", "1"],
    "10p30d": ["--mode", "pd", "--prefill-workers", "10", "--decode-workers", "30"],
    "1e1p1d": ["--mode", "epd", "--encode-workers", "1", "--prefill-workers", "1", "--decode-workers", "1"],
    "2e3p4d": ["--mode", "epd", "--encode-workers", "2", "--prefill-workers", "3", "--decode-workers", "4"],
    "pd-local0": ["--mode", "pd", "--local-prefill-threshold", "0"],
    "pd-local64": ["--mode", "pd", "--local-prefill-threshold", "64"],
    # Tensor-parallel sizes, as `epdserve plan` names them (search.candidates).
    "colocated-tp2": ["--mode", "colocated", "--tensor-parallel-size", "2"],
    "colocated-2-tp2": ["--mode", "colocated", "--workers", "2", "--tensor-parallel-size", "2"],
    "pd-tp2": ["--mode", "pd", "--tensor-parallel-size", "2"],
    "1p1d-tp2/1": ["--mode", "pd", "--prefill-workers", "1", "--decode-workers", "1", "--prefill-tp", "2"],
    "2p1d-tp1/2": ["--mode", "pd", "--prefill-workers", "2", "--decode-workers", "1", "--decode-tp", "2"],
    "1p1d-tp4/2": ["--mode", "pd", "--prefill-workers", "1", "--decode-workers", "1", "--prefill-tp", "4",
                   "--decode-tp", "2"],
    "1e1p1d-tp2": ["--mode", "epd", "--encode-workers", "1", "--prefill-workers", "1", "--decode-workers", "1",
                   "--tensor-parallel-size", "2"],
    "2e1p3d-tp8/4": ["--mode", "epd", "--encode-workers", "2", "--prefill-workers", "1", "--decode-workers", "3",
                     "--prefill-tp", "8", "--decode-tp", "4"],
    "1e1p1d-tp2/1/1": ["--mode", "epd", "--encode-workers", "1", "--prefill-workers", "1", "--decode-workers", "1",
                       "--encode-tp", "2"],
    "2e1p1d-tp2/4/4": ["--mode", "epd", "--encode-workers", "2", "--prefill-workers", "1", "--decode-workers", "1",
                       "--tensor-parallel-size", "4", "--encode-tp", "2"],
}

BAD = ["0p1d", "1p0d", "pd-local", "pd-local-1", "colocated-0", "colocated-01", "1p1d-noprefix-noprefix", "xyz",
       "", "-noprefix", "0e1p1d", "1e1p", "1e1q1d", "colocated-chunked-2", "PD", " pd", "pd-noprefix ",
       "2p1d-chunked", "colocated-noprefix-chunked", "epd",
       # tensor-parallel suffixes: a size below 1, two sizes where one is taken, a form that takes none, a
       # suffix after -noprefix, malformed ones
       "1p1d-tp0", "1p1d-tp2/0", "1p1d-tp0/2", "colocated-tp2/1", "colocated-3-tp1/2", "elastic-tp2", "elastic-3-tp2",
       "colocated-chunked-tp2", "pd-local8-tp2", "1p1d-noprefix-tp2", "1p1d-tp", "1p1d-tp2/", "1p1d-tp2/1/1",
       "1p1d-tp-2", "1p1d-tp2-tp2", "1p1d-TP2", "1p1d_tp2", "xyz-tp2", "-tp2", "colocated-tp2/1/1", "1e1p1d-tp2/1/",
       "1e1p1d-tp2/1/1/1", "1e1p1d-tp0/1/1"]


@pytest.mark.parametrize("name", [n + s for n in FLAGS for s in ("", "-noprefix")])
def test_every_form_round_trips_and_maps_to_its_serve_flags(name):
    spec = DeploymentSpec.parse(name)
    assert spec.name == name
    assert DeploymentSpec.parse(spec.name) == spec
    base = name.removesuffix("-noprefix")
    assert spec.serve_flags() == FLAGS[base] + (NOPREFIX if name != base else [])
    assert spec.prefix_caching == (name == base)


def test_what_each_name_means():
    assert DeploymentSpec.parse("colocated") == DeploymentSpec("colocated")
    assert DeploymentSpec.parse("colocated-3") == DeploymentSpec("colocated", workers=3)
    assert DeploymentSpec.parse("colocated-chunked").chunked_prefill
    assert DeploymentSpec.parse("colocated-chunked").max_num_batched_tokens == 256
    assert DeploymentSpec.parse("colocated").max_num_batched_tokens is None
    assert DeploymentSpec.parse("2p3d") == DeploymentSpec("pd", prefill=2, decode=3)
    assert DeploymentSpec.parse("1e2p3d") == DeploymentSpec("epd", encode=1, prefill=2, decode=3)
    assert DeploymentSpec.parse("pd-local64") == DeploymentSpec("pd", local_prefill_threshold=64)
    assert DeploymentSpec.parse("2p1d-noprefix") == DeploymentSpec("pd", prefill=2, decode=1, prefix_caching=False)
    # Leading zeros of a threshold are accepted, as before; the canonical name drops them.
    assert DeploymentSpec.parse("pd-local007").name == "pd-local7"
    # Tensor-parallel sizes: -tpS every engine worker, -tpP/D prefill and decode; encode workers one rank.
    assert DeploymentSpec.parse("colocated-2-tp4") == DeploymentSpec("colocated", workers=2, tp=4)
    assert DeploymentSpec.parse("1p1d-tp2/1") == DeploymentSpec("pd", prefill=1, decode=1, prefill_tp=2)
    spec = DeploymentSpec.parse("1e2p3d-tp2-noprefix")
    assert spec == DeploymentSpec("epd", encode=1, prefill=2, decode=3, prefill_tp=2, decode_tp=2, prefix_caching=False)
    assert [spec.role_tp(r) for r in ("encode", "prefill", "decode")] == [1, 2, 2]
    assert DeploymentSpec.parse("colocated-tp4").role_tp("colocated") == 4
    # -tpE/P/D: epd's encode workers split their vision tower too.
    spec = DeploymentSpec.parse("1e1p1d-tp2/1/1")
    assert spec == DeploymentSpec("epd", encode=1, prefill=1, decode=1, encode_tp=2)
    assert [spec.role_tp(r) for r in ("encode", "prefill", "decode")] == [2, 1, 1]
    assert DeploymentSpec.parse("1e1p1d-tp1/2/2").name == "1e1p1d-tp2"
    # Other spellings of the same sizes are accepted; the canonical name is plan's (tp_suffix).
    assert {n: DeploymentSpec.parse(n).name for n in ("1p1d-tp2/2", "1p1d-tp1", "1p1d-tp1/1", "colocated-tp02",
                                                      "pd-tp1-noprefix")} == {
        "1p1d-tp2/2": "1p1d-tp2", "1p1d-tp1": "1p1d", "1p1d-tp1/1": "1p1d", "colocated-tp02": "colocated-tp2",
        "pd-tp1-noprefix": "pd-noprefix"}
    assert [tp_suffix(*sizes) for sizes in ((1, 1), (2, 2), (2, 1), (1, 4), (1, 1, 2))] == [
        "", "-tp2", "-tp2/1", "-tp1/4", "-tp2/1/1"]


def test_worker_counts():
    counts = {n: DeploymentSpec.parse(n).num_workers
              for n in ("colocated", "colocated-chunked", "colocated-3", "pd", "2p3d", "colocated-2-noprefix",
                        "2e1p1d", "1e2p3d", "pd-local64")}
    assert counts == {"colocated": 1, "colocated-chunked": 1, "colocated-3": 3, "pd": 2, "2p3d": 5,
                      "colocated-2-noprefix": 2, "2e1p1d": 4, "1e2p3d": 6, "pd-local64": 2}
    assert DeploymentSpec.parse("2e1p1d").counts() == {"encode": 2, "prefill": 1, "decode": 1}


@pytest.mark.parametrize("name", BAD)
def test_bad_names_give_one_message_listing_every_form(name):
    with pytest.raises(ValueError) as info:
        DeploymentSpec.parse(name)
    message = str(info.value)
    assert repr(name) in message
    assert "expected one of: colocated, colocated-N, colocated-chunked, pd, XpYd, XeYpZd, pd-localN" in message
    assert "-noprefix suffix" in message
    assert all(form in message for form in NAME_FORMS)
    assert all(suffix in message for suffix in TP_FORMS)


@pytest.mark.parametrize("name, why", [
    ("1p1d-tp0", "-tp0: a tensor-parallel size must be >= 1"),
    ("1p1d-tp2/0", "-tp2/0: a tensor-parallel size must be >= 1"),
    ("colocated-tp2/1", "-tp2/1: colocated workers have one size (-tpS), not -tpP/D"),
    ("2p1d-tp2/1/1", "-tp2/1/1: only XeYpZd has encode workers (-tpE/P/D)"),
    ("colocated-tp2/1/1", "-tp2/1/1: colocated workers have one size (-tpS), not -tpE/P/D"),
    ("elastic-tp2", "-tp2: elastic deployments take no tensor-parallel suffix: their workers change role"),
    ("colocated-chunked-tp2", "-tp2: colocated-chunked and pd-localN take no tensor-parallel suffix"),
    ("1p1d-noprefix-tp2", "-noprefix comes after the tensor-parallel suffix (-tp2)"),
])
def test_bad_tensor_parallel_suffixes_say_why(name, why):
    with pytest.raises(ValueError, match="^" + re.escape(f"deployment {name!r}: {why}; expected one of: ")):
        DeploymentSpec.parse(name)


def test_bad_specs_are_refused_and_nameless_ones_say_so():
    with pytest.raises(ValueError, match="unknown mode"):
        DeploymentSpec("xpyd")
    with pytest.raises(ValueError, match="at least 1"):
        DeploymentSpec("pd", prefill=0, decode=1)
    with pytest.raises(ValueError, match="has no workers count"):
        DeploymentSpec("pd", workers=2)
    with pytest.raises(ValueError, match=">= 0"):
        DeploymentSpec("pd", local_prefill_threshold=-1)
    with pytest.raises(ValueError, match="no deployment name"):
        DeploymentSpec("epd", encode=1, prefill=1, decode=1, chunked_prefill=True).name
    with pytest.raises(ValueError, match="no deployment name"):
        DeploymentSpec("epd").name
    with pytest.raises(ValueError, match="no deployment name"):
        DeploymentSpec("pd", prefill=2, decode=1, local_prefill_threshold=8).name
    with pytest.raises(ValueError, match="tensor-parallel size must be at least 1"):
        DeploymentSpec("pd", prefill_tp=0)
    with pytest.raises(ValueError, match="mode pd has no tp size"):
        DeploymentSpec("pd", tp=2)
    with pytest.raises(ValueError, match="mode colocated has no prefill_tp, decode_tp size"):
        DeploymentSpec("colocated", prefill_tp=2, decode_tp=2)
    # serve can run these (its checks decide), but no name stands for them.
    for spec in (DeploymentSpec("colocated", workers=2, elastic=True, tp=2), DeploymentSpec("colocated", tp=2,
                 chunked_prefill=True), DeploymentSpec("pd", local_prefill_threshold=8, prefill_tp=2)):
        with pytest.raises(ValueError, match="no deployment name"):
            spec.name


def serve_args(*argv: str) -> ServeOptions:
    """serve's options of ``argv``."""
    parser = argparse.ArgumentParser()
    add_flags(parser, ServeOptions)
    return config_from(ServeOptions, parser.parse_args(list(argv)))


@pytest.mark.parametrize("name", ["colocated-2", "2p1d", "1e2p3d", "colocated-1-noprefix", "colocated-2-tp2",
                                  "2p1d-tp2", "1p1d-tp2/1", "1p2d-tp1/2", "1e1p1d-tp4/2",
                                  "1e1p1d-tp2/1/1", "1e2p1d-tp3/2/1"])
def test_serve_args_give_back_the_deployment_of_their_flags(name):
    spec = DeploymentSpec.parse(name)
    assert serve_args(*spec.serve_flags()).deployment() == spec


def test_serve_args_defaults_and_placement():
    spec = serve_args("--mode", "pd", "--local-prefill-threshold", "16").deployment()
    assert spec == DeploymentSpec("pd", prefill=1, decode=1, local_prefill_threshold=16)
    assert serve_args("--mode", "pd").deployment().local_prefill_threshold is None
    with pytest.raises(ValueError, match="at least 1"):  # a count of another mode too, as serve checks it
        ServeOptions(decode_workers=0).deployment()
    assert DeploymentSpec.parse("2p1d").place([0, 1, 2, 3]) == plan_workers("pd", [0, 1, 2, 3], prefill=2)
    assert DeploymentSpec.parse("pd").place([0, 1]) == [("prefill", "prefill-0", [0]), ("decode", "decode-0", [1])]
    assert DeploymentSpec.parse("colocated").place([0, 1]) == [("colocated", "colocated-0", [0, 1])]


def test_tensor_parallel_sizes_of_serve_options():
    spec = serve_args("--mode", "epd", "--tensor-parallel-size", "2", "--decode-tp", "4").deployment()
    assert (spec.prefill_tp, spec.decode_tp, spec.role_tp("encode"), spec.name) == (2, 4, 1, "1e1p1d-tp2/4")
    # --prefill-tp and --decode-tp are pd's and epd's: colocated workers take --tensor-parallel-size alone.
    assert serve_args("--tensor-parallel-size", "3").deployment().name == "colocated-1-tp3"


# Placement: cores -> name -> each worker's cores. Every worker gets at least as many distinct cores as ranks.
PLACED = {
    (0, 1): {
        "colocated-tp2": [[0, 1]],
        "colocated-2-tp2": [[0, 1], [0, 1]],  # fewer cores than ranks: both share cores 0 and 1
        "1p1d-tp2/1": [[0, 1], [0]],  # round-robin: prefill takes 0 and 1, decode the next, 0
        "1p1d-tp1/2": [[0], [0, 1]],
        "1p1d-tp2": [[0, 1], [0, 1]],
        "1e1p1d-tp2/1": [[0], [0, 1], [1]],  # every core holds two ranks
        "1e1p1d-tp1/2": [[0], [1], [0, 1]],
        "1e1p1d-tp2/1/1": [[0, 1], [0], [1]],
    },
    (0, 1, 2, 3): {
        "colocated-2-tp2": [[0, 1], [2, 3]],
        "1p1d-tp2": [[0, 1], [2, 3]],  # the halves, as without ranks
        "1p1d-tp2/1": [[0, 1], [2, 3]],
        "1p1d-tp3/1": [[0, 1, 2], [3]],  # the bound moves so that the prefill worker has a core a rank
        "1p1d-tp1/3": [[0], [1, 2, 3]],
        "1p2d-tp2/1": [[0, 1], [2], [3]],
        "2p1d-tp1/2": [[0], [1], [2, 3]],
        "1e1p1d-tp1/2": [[0], [1], [2, 3]],
        "1e1p1d-tp2/1": [[0], [1, 2], [3]],
        "2p1d-tp2/1": [[0, 1], [2, 3], [0]],  # 5 ranks on 4 cores: round-robin
        "1e1p1d-tp2": [[0], [1, 2], [0, 3]],
        "1e1p1d-tp2/1/1": [[0, 1], [2], [3]],
        "pd-tp4/2": [[0, 1, 2, 3], [0, 1]],
        "colocated-3-tp2": [[0, 1], [2, 3], [0, 1]],
    },
}


@pytest.mark.parametrize("cores, name", [(c, n) for c, names in PLACED.items() for n in names])
def test_tensor_parallel_placement(cores, name):
    spec = DeploymentSpec.parse(name)
    placed = spec.place(list(cores))
    assert [c for _, _, c in placed] == PLACED[cores][name]
    assert [role for role, _, _ in placed] == [r for r, n in spec.counts().items() for _ in range(n)]
    assert all(len(set(c)) == len(c) >= spec.role_tp(role) for role, _, c in placed)


def test_placement_without_ranks_is_unchanged_and_too_few_cores_are_refused():
    # Every worker of one rank: the halves, shared round-robin within a role's half as before.
    for cores in ([0, 1], [0, 1, 2, 3], list(range(6))):
        for name in ("3p1d", "1p3d", "2e1p1d", "colocated-3", "2p2d"):
            counts = {k.replace("colocated", "workers"): v for k, v in DeploymentSpec.parse(name).counts().items()}
            assert DeploymentSpec.parse(name).place(cores) == plan_workers(
                DeploymentSpec.parse(name).mode, cores, **counts)
    assert [c for _, _, c in DeploymentSpec.parse("3p1d").place([0, 1, 2, 3])] == [[0], [1], [0], [2, 3]]
    with pytest.raises(ValueError, match=r"a prefill worker of 3 tensor-parallel ranks needs 3 cores, one a rank; "
                                         r"there are 2 \(0,1\)"):
        DeploymentSpec.parse("1p1d-tp3/1").place([0, 1])
    with pytest.raises(ValueError, match="a colocated worker of 4 tensor-parallel ranks needs 4 cores"):
        plan_workers("colocated", [5, 6, 7], tp=4)
    with pytest.raises(ValueError, match="tensor-parallel size must be at least 1"):
        plan_workers("pd", [0, 1], decode_tp=0)
    # The order of --cores is kept (a worker's ranks pin themselves in that order).
    assert plan_workers("pd", [7, 3], prefill_tp=2) == [("prefill", "prefill-0", [7, 3]), ("decode", "decode-0", [7])]


def _gpu_platform(sizes: tuple[int, ...]) -> Platform:
    return Platform("flat", step=lambda n: LinearStep((10.0, 0.0, 0.0, 0.0, 0.0)), worker_sizes=sizes,
                    kv_bytes_per_token=1000, kv_link=Link(gbs=1e9, latency_ms=1.0), price_per_device_hour=1.0)


@pytest.mark.parametrize("budget", [1, 2, 3, 4, 6, 8])
def test_every_name_plan_prints_parses_but_shared_epd(budget):
    """Every candidate of `epdserve plan` (with images: EPD too) is a deployment name with the
    planner's workers, but the -shared EPD ones (serve cannot put an encode worker on its
    prefill worker's cores) and the single colocated worker of all devices, which plan names
    `colocated` (serve's colocated: one process on all the cores)."""
    seen = 0
    for deployment in search.candidates(_gpu_platform((1, 2, 4, 8)), budget, images=True):
        if deployment.name.endswith("-shared"):
            with pytest.raises(ValueError, match="unknown deployment"):
                DeploymentSpec.parse(deployment.name)
            continue
        spec = DeploymentSpec.parse(deployment.name)
        assert spec.name == deployment.name
        assert spec.num_workers == len(deployment.workers)
        roles = [w.role for w in deployment.workers]
        assert spec.counts() == {r: roles.count(r) for r in dict.fromkeys(roles)}, deployment.name
        if deployment.name != "colocated":
            assert [spec.role_tp(w.role) for w in deployment.workers] == [w.devices for w in deployment.workers]
        seen += 1
    assert seen >= (3 if budget > 1 else 1)


def test_compare_takes_per_role_names_and_keeps_their_files_apart(tmp_path):
    from pathlib import Path

    from epdserve.bench import compare, deployments, processes

    assert compare.parse_configs("1p1d-tp2/1,colocated-2-tp2,1p1d-tp2/2") == ["1p1d-tp2/1", "colocated-2-tp2", "1p1d-tp2"]
    dep = deployments.from_config("1p1d-tp2/1-noprefix")
    assert (dep.name, dep.epdserve) == ("1p1d-tp2/1-noprefix", "1p1d-tp2/1-noprefix")
    assert deployments.file_stem(dep.name) == "1p1d-tp2%2F1-noprefix"
    assert deployments.file_stem("1p1d-tp2") == "1p1d-tp2"
    assert processes.server_command(dep.epdserve, 8100, Path("t"), None, [])[:9] == [
        "--mode", "pd", "--prefill-workers", "1", "--decode-workers", "1", "--prefill-tp", "2",
        "--no-enable-prefix-caching"]
    # A file's own names keep to what names files, but the '/' a -tpP/D or -tpE/P/D has.
    assert deployments.file_stem(deployments.from_config("1e1p1d-tp2/1/1").name) == "1e1p1d-tp2%2F1%2F1"
    for bad in ("a/b", "x/1/2/3", "/1", "a//1"):
        (tmp_path / "d.toml").write_text(f'[[deployment]]\nname = "{bad}"\nbase_url = "http://127.0.0.1:1"\n')
        with pytest.raises(deployments.DeploymentFileError, match="up to two '/', each before a digit"):
            deployments.load([tmp_path / "d.toml"])
