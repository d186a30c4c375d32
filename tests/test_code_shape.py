"""The package's shape rules: no module in ``epdserve/`` over 500 lines and no function over 60,
except where its ``def`` line says why in a ``# long: <reason>`` comment (a module: a first-line
``# long: <reason>``)."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "epdserve"
MAX_MODULE_LINES, MAX_FUNCTION_LINES = 500, 60


def _modules():
    return sorted(PACKAGE.rglob("*.py"))


def test_no_module_over_500_lines():
    long = [f"{p.relative_to(PACKAGE.parent)}: {n} lines" for p in _modules()
            if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES
            and "# long:" not in p.read_text().splitlines()[0]]
    assert not long, "modules over 500 lines:\n" + "\n".join(long)


def test_no_function_over_60_lines():
    long = []
    for path in _modules():
        lines = path.read_text().splitlines()
        for node in ast.walk(ast.parse("\n".join(lines))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES and "# long:" not in lines[node.lineno - 1]:
                    long.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno} {node.name}: {n} lines")
    assert not long, "functions over 60 lines:\n" + "\n".join(long)
