"""The shape of the package's code, as a maintainer reads it: how much of it is prose, which
modules are long, how parsed options travel, and whether the imports form a loop.

Counts, over every ``epdserve/**/*.py``:

* prose: docstring lines (of modules, classes and functions) and comment lines, as a share
  of all lines (blank ones included);
* long modules: those over ``--max-lines`` (400) lines, and whether each says why (a
  comment ``# long: <reason>`` in its first 30 lines);
* untyped options: an ``Options = Any`` alias, or a use of one, and ``getattr(args, ...)``
  outside the CLI layer (``epdserve/cli.py``, ``epdserve/argtypes.py``: the code that turns
  argv into typed configs);
* imports: the runtime import graph between the package's modules (imports inside
  functions included, ``if TYPE_CHECKING:`` blocks left out), its cycles (strongly connected
  components of more than one module), and the imports of package modules made inside a
  function.

    python benchmarks/house_shape.py [--root epdserve] [--max-lines 400] [--list] [--output FILE.json]
"""

from __future__ import annotations

import argparse
import ast
import io
import json
import re
import tokenize
from pathlib import Path

CLI_LAYER = ("cli.py", "argtypes.py")
LONG_REASON = re.compile(r"^# long: \S")


def module_name(root: Path, path: Path) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def prose_lines(source: str, tree: ast.Module) -> tuple[int, int]:
    """(docstring lines, comment lines not inside a docstring) of one module."""
    docs: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            first = node.body[0] if node.body else None
            if (isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
                    and isinstance(first.value.value, str)):
                docs.update(range(first.lineno, first.end_lineno + 1))
    comments = {tok.start[0] for tok in tokenize.generate_tokens(io.StringIO(source).readline)
                if tok.type == tokenize.COMMENT}
    return len(docs), len(comments - docs)


def type_checking_nodes(tree: ast.Module) -> set[int]:
    """ids of the nodes under ``if TYPE_CHECKING:`` (imports that never run)."""
    skipped = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return skipped


def imports(tree: ast.Module, name: str, is_package: bool, known: set[str]) -> list[tuple[str, bool]]:
    """(imported package module, inside a function) for each runtime import in ``tree``."""
    skipped = type_checking_nodes(tree)
    inside: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            inside.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    package = name if is_package else name.rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        targets = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1] + ([base] if base else []))
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                out.append((target, id(node) in inside))
    return out


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def measure(root: Path, max_lines: int) -> dict:
    paths = sorted(root.rglob("*.py"))
    known = {module_name(root, p) for p in paths}
    total = docs = comments = 0
    long_modules, any_options, getattr_args, function_imports = [], [], [], []
    graph: dict[str, set[str]] = {}
    for path in paths:
        source = path.read_text()
        tree = ast.parse(source)
        rel = str(path.relative_to(root.parent))
        lines = source.splitlines()
        total += len(lines)
        d, c = prose_lines(source, tree)
        docs, comments = docs + d, comments + c
        if len(lines) > max_lines:
            why = next((line for line in lines[:30] if LONG_REASON.match(line)), None)
            long_modules.append({"module": rel, "lines": len(lines), "why": why})
        for number, line in enumerate(lines, 1):
            if re.search(r"\bOptions\s*=\s*Any\b|[:,(]\s*Options\b", line):
                any_options.append(f"{rel}:{number}")
            if "getattr(args" in line and path.name not in CLI_LAYER:
                getattr_args.append(f"{rel}:{number}")
        name = module_name(root, path)
        for target, in_function in imports(tree, name, path.name == "__init__.py", known):
            graph.setdefault(name, set()).add(target)
            if in_function:
                function_imports.append(f"{rel} -> {target}")
    return {"lines": total, "docstring_lines": docs, "comment_lines": comments,
            "prose_share": round((docs + comments) / total, 4), "max_lines": max_lines,
            "long_modules": sorted(long_modules, key=lambda m: -m["lines"]),
            "any_options": any_options, "getattr_args_outside_cli": getattr_args,
            "import_cycles": cycles(graph), "imports_in_functions": sorted(set(function_imports))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", type=Path, default=Path(__file__).resolve().parent.parent / "epdserve")
    parser.add_argument("--max-lines", type=int, default=400)
    parser.add_argument("--list", action="store_true", help="list every finding, not only the counts")
    parser.add_argument("--output", type=Path, help="write the findings as JSON")
    args = parser.parse_args()
    shape = measure(args.root, args.max_lines)
    print(f"{shape['lines']} lines: docstrings {shape['docstring_lines']}, comments {shape['comment_lines']} "
          f"= {shape['prose_share']:.1%} prose")
    unexplained = [m for m in shape["long_modules"] if not m["why"]]
    print(f"modules over {args.max_lines} lines: {len(shape['long_modules'])} ({len(unexplained)} without a reason)")
    for key in ("any_options", "getattr_args_outside_cli", "import_cycles", "imports_in_functions"):
        print(f"{key.replace('_', ' ')}: {len(shape[key])}")
    if args.list:
        for m in shape["long_modules"]:
            print(f"  {m['lines']:>4} {m['module']}  {m['why'] or ''}")
        for key in ("any_options", "getattr_args_outside_cli", "import_cycles", "imports_in_functions"):
            for item in shape[key]:
                print(f"  {key}: {item}")
    if args.output:
        args.output.write_text(json.dumps(shape, indent=1) + "\n")


if __name__ == "__main__":
    main()
