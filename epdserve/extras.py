"""Optional extras (``epdserve[ray]``, ``[plots]``): a missing one is one line naming it, never a traceback."""

from __future__ import annotations

import importlib
import sys
from types import ModuleType

# extra -> (the module it brings, its name in messages)
EXTRAS = {"ray": ("ray", "Ray"), "plots": ("matplotlib", "matplotlib")}
_warned: set[str] = set()  # the extras warn_skipped has warned about in this process


class MissingExtra(ImportError):
    """An extra's module does not import; ``str()`` is the one line naming the extra."""


def need(extra: str, what: str) -> ModuleType:
    """Raises MissingExtra: ``"{what} needs {name}: pip install 'epdserve[{extra}]'"``."""
    module, name = EXTRAS[extra]
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise MissingExtra(f"{what} needs {name}: pip install 'epdserve[{extra}]'") from exc


def pyplot() -> ModuleType:
    """On the Agg backend (PNG, no display). Raises MissingExtra."""
    matplotlib = need("plots", "drawing the PNG plots")
    matplotlib.use("Agg")
    return importlib.import_module("matplotlib.pyplot")


def warn_skipped(exc: MissingExtra, extra: str = "plots") -> None:
    """Once per process and extra, to stderr; the command goes on without the extra's output."""
    if extra not in _warned:
        _warned.add(extra)
        print(f"epdserve: warning: {exc}; writing the results without them", file=sys.stderr, flush=True)
