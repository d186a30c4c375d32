"""The optional extras (``pip install 'epdserve[ray]'``, ``'epdserve[plots]'``): their modules
are imported only where a command uses them, and one that is missing becomes one line naming
the extra to install (:class:`MissingExtra`), never a traceback."""

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
    """Import and return ``extra``'s module (:data:`EXTRAS`) for ``what`` (the command or part
    that needs it, e.g. ``"epdserve serve --cluster ray"``).

    Raises:
        MissingExtra: it does not import; the message is
            ``"{what} needs {name}: pip install 'epdserve[{extra}]'"``.
    """
    module, name = EXTRAS[extra]
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise MissingExtra(f"{what} needs {name}: pip install 'epdserve[{extra}]'") from exc


def pyplot() -> ModuleType:
    """``matplotlib.pyplot`` on the Agg backend (PNG files, no display needed).

    Raises:
        MissingExtra: matplotlib (the ``plots`` extra) is not installed.
    """
    matplotlib = need("plots", "drawing the PNG plots")
    matplotlib.use("Agg")
    return importlib.import_module("matplotlib.pyplot")


def warn_skipped(exc: MissingExtra, extra: str = "plots") -> None:
    """Print ``epdserve: warning: {exc}; writing the results without them`` to stderr, once
    per process and extra: the command goes on without what the extra would have added."""
    if extra not in _warned:
        _warned.add(extra)
        print(f"epdserve: warning: {exc}; writing the results without them", file=sys.stderr, flush=True)
