"""DeploymentSpec: the one parser of deployment names (epdserve.serving.deployment)."""

from __future__ import annotations

import argparse

import pytest

from epdserve.serving.deployment import NAME_FORMS, DeploymentSpec, plan_workers

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
}

BAD = ["0p1d", "1p0d", "pd-local", "pd-local-1", "colocated-0", "colocated-01", "1p1d-noprefix-noprefix", "xyz",
       "", "-noprefix", "0e1p1d", "1e1p", "1e1q1d", "colocated-chunked-2", "PD", " pd", "pd-noprefix ",
       "2p1d-chunked", "colocated-noprefix-chunked", "epd"]


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


def serve_args(*argv: str) -> argparse.Namespace:
    """Parsed with the options DeploymentSpec.from_serve_args reads, serve's defaults."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", default="colocated")
    for opt in ("--workers", "--prefill-workers", "--decode-workers", "--encode-workers"):
        parser.add_argument(opt, type=int, default=1)
    parser.add_argument("--local-prefill-threshold", type=int, default=0)
    parser.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None)
    return parser.parse_args(list(argv))


@pytest.mark.parametrize("name", ["colocated-2", "2p1d", "1e2p3d", "colocated-1-noprefix"])
def test_serve_args_give_back_the_deployment_of_their_flags(name):
    spec = DeploymentSpec.parse(name)
    assert DeploymentSpec.from_serve_args(serve_args(*spec.serve_flags())) == spec


def test_serve_args_defaults_and_placement():
    spec = DeploymentSpec.from_serve_args(serve_args("--mode", "pd", "--local-prefill-threshold", "16"))
    assert spec == DeploymentSpec("pd", prefill=1, decode=1, local_prefill_threshold=16)
    assert DeploymentSpec.from_serve_args(serve_args("--mode", "pd")).local_prefill_threshold is None
    with pytest.raises(ValueError, match="at least 1"):  # a count of another mode too, as serve checks it
        DeploymentSpec.from_serve_args(serve_args("--mode", "colocated", "--decode-workers", "0"))
    assert DeploymentSpec.parse("2p1d").place([0, 1, 2, 3]) == plan_workers("pd", [0, 1, 2, 3], prefill=2)
    assert DeploymentSpec.parse("pd").place([0, 1]) == [("prefill", "prefill-0", [0]), ("decode", "decode-0", [1])]
    assert DeploymentSpec.parse("colocated").place([0, 1]) == [("colocated", "colocated-0", [0, 1])]
