"""Write docs/flags.md, the reference of every flag of ``epdserve serve``, ``router`` and ``worker``,
from their options' config fields (each flag's names, default and help as declared).
``tests/test_docs_flags.py`` fails when the file is stale.

    .venv/bin/python docs/make_flags.py
"""

from __future__ import annotations

import argparse
import importlib
from pathlib import Path

from epdserve.cli import COMMANDS

OUT = Path(__file__).resolve().parent / "flags.md"
SERVERS = ("serve", "router", "worker")
HEAD = """# Flags of the servers

Every flag of `epdserve serve`, `epdserve router` and `epdserve worker`, generated from the
fields of their options (`docs/make_flags.py`; [architecture.md](architecture.md#options)).
What each does in depth: [serving.md](serving.md). serve passes the worker flags it is given
to each worker ("passed to each worker"); not given, the worker's default holds.
"""


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _default(action: argparse.Action) -> str:
    if action.default in (None, argparse.SUPPRESS) or action.required:
        return ""
    return f"`{action.default}`"


def command_table(command: str) -> str:
    parser = argparse.ArgumentParser(prog=f"epdserve {command}")
    importlib.import_module(COMMANDS[command][0]).add_arguments(parser)
    rows = ["| flag | default | |", "|---|---|---|"]
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        names = ", ".join(f"`{n}`" for n in action.option_strings) or f"`{action.metavar or action.dest}`"
        text = (action.help or "").replace("%(default)s", str(action.default)).replace("%%", "%")
        rows.append(f"| {names} | {_cell(_default(action))} | {_cell(text)} |")
    return f"## epdserve {command}\n\n" + "\n".join(rows) + "\n"


def render() -> str:
    return HEAD + "".join(f"\n{command_table(c)}" for c in SERVERS)


if __name__ == "__main__":
    OUT.write_text(render())
    print(f"wrote {OUT}")
