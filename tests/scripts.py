"""The benchmark scripts as modules, for the tests that check them (``benchmarks/`` is not a
package and stays off ``sys.path``)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def load_script(name: str):
    """``benchmarks/NAME.py`` as module NAME, registered in ``sys.modules`` so that a script
    importing it by name gets this one."""
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
