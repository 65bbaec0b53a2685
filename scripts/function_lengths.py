"""List every function longer than a limit in the given files and folders.

Usage (from the repository root):

    python scripts/function_lengths.py [--limit 60] [PATH ...]

PATH defaults to `raggedspec/reference` and `raggedspec/gpu`; a folder is searched for `*.py`
files at any depth. A function's length counts its lines from `def` to its last line,
decorators excluded; methods and nested functions are measured too and named by their
qualified name. Each finding is one line `file:function:length`. Exit status 0 when no
function is over the limit, 1 when some are, 2 for a path that does not exist or a file that
does not parse (the message names it).
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

from uncovered_functions import functions  # the same walk: nested functions and methods

DEFAULT_PATHS = ("raggedspec/reference", "raggedspec/gpu")


def length(node: ast.FunctionDef) -> int:
    """The lines from the `def` line to the function's last line (decorators excluded)."""
    return (node.end_lineno or node.lineno) - node.lineno + 1


def long_functions(path: Path, limit: int) -> list[tuple[str, int]]:
    """`(qualified name, length)` for every function of the file `path` longer than `limit`."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    return [(name, length(node)) for name, node in functions(tree) if length(node) > limit]


def python_files(path: Path) -> list[Path]:
    """`path` itself when it is a file, else its `*.py` files at any depth, sorted."""
    return [path] if path.is_file() else sorted(path.rglob("*.py"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="*", default=list(DEFAULT_PATHS),
                        help="files or folders to measure (default: the reference and the port)")
    parser.add_argument("--limit", type=int, default=60, help="the longest allowed function")
    args = parser.parse_args(argv)
    missing = [p for p in args.paths if not Path(p).exists()]
    if missing:
        print(f"{missing[0]}: no such file or folder", file=sys.stderr)
        return 2
    findings = []
    for path in (f for p in args.paths for f in python_files(Path(p))):
        try:
            findings += [f"{path}:{name}:{n}" for name, n in long_functions(path, args.limit)]
        except SyntaxError as exc:
            print(f"{path}: does not parse ({exc.msg}, line {exc.lineno})", file=sys.stderr)
            return 2
    print("\n".join(findings) if findings else f"no function over {args.limit} lines")
    return 1 if findings else 0


if __name__ == "__main__":
    raise SystemExit(main())
