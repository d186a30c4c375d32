"""The ``elastic`` and ``elastic-N`` deployment names: what serve options they
mean, that they round-trip, that they are placed as ``colocated-N`` (the workers and cores
of the static deployments they are compared with), and the clear error of a bad one."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from epdserve.bench import compare
from epdserve.serving.deployment import NAME_FORMS, DeploymentSpec
from epdserve.argtypes import add_flags, config_from
from epdserve.serving.launch.options import ServeOptions

pytestmark = pytest.mark.elastic

ELASTIC = ["--elastic", "--mode", "colocated", "--workers"]


@pytest.mark.parametrize("name, flags", [("elastic", ELASTIC + ["2"]), ("elastic-2", ELASTIC + ["2"]),
                                         ("elastic-3", ELASTIC + ["3"]), ("elastic-12", ELASTIC + ["12"])])
def test_elastic_names_round_trip_and_map_to_serve_flags(name, flags):
    spec = DeploymentSpec.parse(name)
    assert spec.elastic and spec.mode == "colocated"
    assert spec.name == name and DeploymentSpec.parse(spec.name) == spec
    assert spec.serve_flags() == flags
    off = DeploymentSpec.parse(name + "-noprefix")
    assert off.name == name + "-noprefix" and off.elastic and not off.prefix_caching
    assert off.serve_flags() == flags + ["--no-enable-prefix-caching"]
    assert spec.num_workers == int(flags[-1]) and spec.counts() == {"colocated": int(flags[-1])}


def test_elastic_uses_the_workers_and_cores_of_the_static_deployments():
    cores = [0, 1]
    elastic = DeploymentSpec.parse("elastic").place(cores)
    assert elastic == DeploymentSpec.parse("colocated-2").place(cores) == [
        ("colocated", "colocated-0", [0]), ("colocated", "colocated-1", [1])]
    assert [c for _, _, c in elastic] == [c for _, _, c in DeploymentSpec.parse("1p1d").place(cores)]
    assert DeploymentSpec.parse("elastic-4").place(list(range(8))) == \
        DeploymentSpec.parse("colocated-4").place(list(range(8)))
    assert not DeploymentSpec.parse("colocated-2").elastic  # static names stay static


@pytest.mark.parametrize("name, needle", [("elastic-1", "at least 2"), ("elastic-0", "unknown deployment"),
                                          ("elastic-x", "unknown deployment"), ("elastic-01", "unknown deployment"),
                                          ("elastic-", "unknown deployment"), ("elastic-noprefix-noprefix",
                                                                               "unknown deployment")])
def test_bad_elastic_names_name_the_value_and_every_form(name, needle):
    with pytest.raises(ValueError) as info:
        DeploymentSpec.parse(name)
    message = str(info.value)
    assert repr(name) in message and needle in message
    assert all(form in message for form in NAME_FORMS) and "elastic-N's N: workers >= 2" in message


def test_elastic_specs_serve_cannot_switch_are_refused():
    with pytest.raises(ValueError, match="at least 2"):
        DeploymentSpec("colocated", workers=1, elastic=True)
    with pytest.raises(ValueError, match="colocated or pd"):
        DeploymentSpec("epd", elastic=True)
    pd = DeploymentSpec("pd", prefill=1, decode=1, elastic=True)  # serve --elastic --mode pd: no name
    assert pd.serve_flags()[:3] == ["--elastic", "--mode", "pd"]
    with pytest.raises(ValueError, match="no deployment name"):
        pd.name


def test_serve_args_with_elastic_give_back_the_deployment():
    parser = argparse.ArgumentParser()
    add_flags(parser, ServeOptions)

    def deployment(argv: list[str]) -> DeploymentSpec:
        return config_from(ServeOptions, parser.parse_args(argv)).deployment()

    assert deployment(DeploymentSpec.parse("elastic-3").serve_flags()) == DeploymentSpec.parse("elastic-3")
    with pytest.raises(ValueError, match="at least 2"):  # serve --elastic with one worker
        deployment(["--elastic"])
    assert not deployment([]).elastic


def test_compare_takes_elastic_and_refuses_a_bad_count():
    assert compare.parse_configs("colocated,colocated-2,1p1d,elastic") == ["colocated", "colocated-2", "1p1d",
                                                                            "elastic"]
    with pytest.raises(argparse.ArgumentTypeError, match="'elastic-1'"):
        compare.parse_configs("colocated,elastic-1")
    proc = subprocess.run([sys.executable, "-m", "epdserve", "compare", "--configs", "elastic-1"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "elastic-1" in proc.stderr and "Traceback" not in proc.stderr
