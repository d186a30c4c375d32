"""Every test runs in exactly one Makefile target. Each target runs ``pytest -m`` with its
``MARK_<target>`` line of the Makefile; those expressions, evaluated on the markers of every
collected test (one ``--collect-only`` in a subprocess, with conftest.py's markers), must
split the collection, name only registered markers, and .ci/run must run every target."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from _pytest.mark.expression import Expression

ROOT = Path(__file__).resolve().parents[1]
# Written next to the output as a plugin of the collecting pytest: each test's markers.
PLUGIN = '''
import json, os


def pytest_collection_finish(session):
    with open(os.environ["EPDSERVE_MARKERS_OUT"], "w") as out:
        json.dump({item.nodeid: sorted({m.name for m in item.iter_markers()}) for item in session.items}, out)
'''


def target_expressions() -> dict[str, str]:
    """Target name -> its ``-m`` expression, from the Makefile's ``MARK_<target> := EXPR`` lines."""
    return dict(re.findall(r"^MARK_(\S+) := (.+)$", (ROOT / "Makefile").read_text(), re.M))


def test_each_target_runs_its_expression_and_ci_runs_each_target():
    makefile, targets = (ROOT / "Makefile").read_text(), target_expressions()
    assert "test" in targets and len(targets) > 1
    for target in targets:
        recipe = re.search(rf"^{re.escape(target)}:.*\n((?:\t.*\n)+)", makefile, re.M)
        assert recipe and '-m "$(MARK_$@)"' in recipe.group(1), f"make {target} does not run pytest -m \"$(MARK_$@)\""
    ci = set(re.findall(r"^make (\S+)$", (ROOT / ".ci" / "run").read_text(), re.M))
    assert set(targets) <= ci, f".ci/run does not run make {', make '.join(sorted(set(targets) - ci))}"


def test_expressions_name_registered_markers(pytestconfig):
    registered = {line.split(":")[0].strip() for line in pytestconfig.getini("markers")}
    for target, expr in target_expressions().items():
        assert Expression.compile(expr).idents() <= registered, f"make {target}: {expr}"


def test_every_collected_test_is_in_exactly_one_target(tmp_path):
    (tmp_path / "collected_markers.py").write_text(PLUGIN)
    out = tmp_path / "markers.json"
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"}
    env.update(EPDSERVE_MARKERS_OUT=str(out), PYTHONPATH=os.pathsep.join(filter(None, [
        str(tmp_path), env.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                           "-p", "collected_markers"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    markers = json.loads(out.read_text())
    assert len(markers) > 100 and any(name.startswith("tests/test_markers.py::") for name in markers)
    exprs = {target: Expression.compile(expr) for target, expr in target_expressions().items()}
    homes = {test: [target for target, expr in exprs.items() if expr.evaluate(lambda name, **_: name in marks)]
             for test, marks in markers.items()}
    wrong = {test: targets for test, targets in homes.items() if len(targets) != 1}
    assert not wrong, f"{len(wrong)} tests in no target or in several (shown: 20): " + "".join(
        f"\n  {test}: {targets or 'none'} (markers {markers[test]})" for test, targets in list(wrong.items())[:20])
