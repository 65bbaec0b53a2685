"""List the functions of `reference/` and `gpu/` a coverage.py run never executed, and the line
coverage per package.

Usage (from the repository root, after a measured run of the default suite):

    python -m coverage run --source=reference,gpu -m pytest -q
    python scripts/uncovered_functions.py [--data .coverage]

A function counts as executed when any line of its first statement after the docstring ran
(a function whose body is only a docstring or `...` counts by its `def` line). Nested functions
and methods are listed by their qualified name. Exit status 0; 2 when the data file is missing
(the message names it).
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

PACKAGES = ("reference", "gpu")


def functions(tree: ast.AST, prefix: str = ""):
    """`(qualified name, node)` for every function in `tree`, nested ones included."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            name = f"{prefix}{node.name}"
            yield name, node
            yield from functions(node, f"{name}.")
        elif isinstance(node, ast.ClassDef):
            yield from functions(node, f"{prefix}{node.name}.")


def probe_lines(node: ast.FunctionDef) -> set[int]:
    """The lines whose execution shows that `node` ran."""
    body = node.body
    if body and isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None),
                                                             ast.Constant):
        body = body[1:]
    if not body:
        return {node.lineno}
    first = body[0]
    return set(range(first.lineno, (first.end_lineno or first.lineno) + 1))


def never_executed(path: Path, executed: set[int]) -> list[str]:
    """The qualified names of the functions of `path` none of whose probe lines ran."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return [name for name, node in functions(tree) if not probe_lines(node) & executed]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default=".coverage", help="the coverage data file")
    parser.add_argument("--root", default=".", help="the repository root")
    args = parser.parse_args(argv)
    import coverage

    data_file = Path(args.data)
    if not data_file.is_file():
        print(f"{data_file}: no coverage data file (run `python -m coverage run ...` first)",
              file=sys.stderr)
        return 2
    cov = coverage.Coverage(data_file=str(data_file))
    cov.load()
    root = Path(args.root).resolve()
    measured = {Path(f).resolve(): f for f in cov.get_data().measured_files()}
    for pkg in PACKAGES:
        total = hit = 0
        missing: list[str] = []
        for path in sorted((root / pkg).glob("*.py")):
            key = measured.get(path.resolve())
            if key is None:
                missing.append(f"{path.name}: (never imported)")
                continue
            _, statements, _, not_run, _ = cov.analysis2(key)
            total += len(statements)
            hit += len(statements) - len(not_run)
            executed = set(statements) - set(not_run)
            missing += [f"{path.name}: {name}" for name in never_executed(path, executed)]
        pct = 100.0 * hit / total if total else 100.0
        print(f"{pkg}/: line coverage {pct:.1f}% ({hit}/{total} statements)")
        for line in missing:
            print(f"  never executed: {line}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
