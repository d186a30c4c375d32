"""The install requirements (pyproject.toml) are ranges, Ray and matplotlib are extras, and a
command that needs a missing extra says which one in one line: ``serve --cluster ray``
exits 2, and the plotting commands write their results without the PNGs after one warning.

An extra is made missing in a subprocess by a ``sitecustomize`` on ``PYTHONPATH`` that sets
``sys.modules[NAME] = None``: its import then fails as an uninstalled module's does."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from conftest import free_port
from test_bench_client import req
from test_bench_deployments import saved_trace, stub_entry, write

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
RAY_LINE = "epdserve serve --cluster ray needs Ray: pip install 'epdserve[ray]'"
PLOTS_LINE = ("epdserve: warning: drawing the PNG plots needs matplotlib: pip install 'epdserve[plots]'; "
              "writing the results without them")


def name_of(requirement: str) -> str:
    """The distribution name of a requirement string, lower case."""
    return re.match(r"[A-Za-z0-9_.-]+", requirement).group(0).lower()


def without(module: str, tmp_path: Path) -> dict[str, str]:
    """An environment in which ``module`` does not import (a ``sitecustomize`` sets
    ``sys.modules[module] = None``)."""
    site = tmp_path / f"no-{module}"
    site.mkdir()
    (site / "sitecustomize.py").write_text(f"import sys\nsys.modules[{module!r}] = None\n")
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))}


def test_core_requirements_are_ranges_without_ray_or_matplotlib():
    deps = PYPROJECT["dependencies"]
    assert not [d for d in deps if "==" in d], deps
    assert not {"ray", "matplotlib"} & {name_of(d) for d in deps}
    extras = PYPROJECT["optional-dependencies"]
    assert [name_of(d) for d in extras["ray"]] == ["ray"] and "==" not in extras["ray"][0]
    assert [name_of(d) for d in extras["plots"]] == ["matplotlib"]
    assert "epdserve[ray,plots]" in extras["test"]  # the suite runs the Ray tests and draws
    assert "'.[test,ray,plots]'" in (ROOT / "Makefile").read_text()


def test_the_built_metadata_puts_ray_and_matplotlib_behind_their_extras(tmp_path):
    """What pip reads: the wheel metadata setuptools makes from pyproject.toml (built on a
    copy, so nothing is written into the checkout)."""
    build_meta = pytest.importorskip("setuptools.build_meta")
    src = tmp_path / "src"
    (src / "epdserve").mkdir(parents=True)
    (src / "epdserve" / "__init__.py").write_text("")
    for name in ("pyproject.toml", "README.md"):
        (src / name).write_text((ROOT / name).read_text())
    cwd = os.getcwd()
    os.chdir(src)
    try:
        info = build_meta.prepare_metadata_for_build_wheel(str(tmp_path))
    finally:
        os.chdir(cwd)
    requires = [line.split(":", 1)[1].strip() for line in (tmp_path / info / "METADATA").read_text().splitlines()
                if line.startswith("Requires-Dist:")]
    core = [r for r in requires if "extra ==" not in r]
    assert core and not {"ray", "matplotlib"} & {name_of(r) for r in core}
    assert any(r.startswith("ray") and 'extra == "ray"' in r for r in requires), requires
    assert any(r.startswith("matplotlib") and 'extra == "plots"' in r for r in requires), requires


def test_serve_cluster_ray_without_ray_names_the_extra_and_exits_2(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "epdserve", "serve", "--cluster", "ray", "--port", "0"],
                          capture_output=True, text=True, timeout=120, env=without("ray", tmp_path))
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip() == RAY_LINE
    assert "Traceback" not in proc.stderr + proc.stdout


def test_compare_without_matplotlib_writes_its_results_and_warns_once(tmp_path):
    """A real ``epdserve compare`` of a deployment (the bench tests' OpenAI stub): the JSON and
    markdown results are written, no PNG, and the warning comes once."""
    path = write(tmp_path / "d.toml", stub_entry("a", free_port()))
    trace = saved_trace(tmp_path / "t.jsonl", [req(0.0, "one two"), req(0.05, "three four")])
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "epdserve", "compare", "--deployments", str(path), "--trace",
                           str(trace), "--output", str(out), "--warmup", "0", "--disable-tqdm", "--repeats", "1"],
                          capture_output=True, text=True, timeout=300, env=without("matplotlib", tmp_path))
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log
    assert [e["name"] for e in json.loads((out / "compare.json").read_text())["configs"]] == ["a"]
    assert (out / "compare.md").is_file() and not list(out.glob("*.png"))
    assert log.count(PLOTS_LINE) == 1 and "Traceback" not in log


def test_sweep_and_plan_plots_without_matplotlib_are_skipped_with_one_warning(tmp_path):
    """``bench --sweep``'s and ``plan search``'s plot functions: no PNG, one warning for both."""
    script = (
        "import json, sys\n"
        "from epdserve.bench import sweep\n"
        "from epdserve.plan import report\n"
        "points = [{'rate': 1.0, 'slo_attainment': 1.0, 'request_goodput': 1.0, 'request_throughput': 1.0}]\n"
        "a = sweep.plot({'points': points, 'max_rate': 1.0, 'target_share': 0.9}, sys.argv[1] + '/s.png')\n"
        "b = report.plot({'pd': points}, 0.9, sys.argv[1] + '/g.png')\n"
        "print(json.dumps([a, b, 'matplotlib' in sys.modules and sys.modules['matplotlib'] is not None]))\n")
    proc = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True,
                          timeout=120, env=without("matplotlib", tmp_path))
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == [None, False, False]
    assert proc.stderr.strip() == PLOTS_LINE
    assert not list(tmp_path.glob("*.png"))
