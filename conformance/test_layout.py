"""The package layout's import rules: every import goes through the one import name
`raggedspec`, the reference never imports the port (`gpu`) or the tools, and the reference's
modules import each other without a cycle, counting imports made inside functions too (a
lazy import hides a cycle, it does not remove it); and `scripts/function_lengths.py`, which lists
the functions longer than the project's limit, behaves as documented.

The import graph is read from the source with `ast` (nothing is imported to build it).
"""

from __future__ import annotations

import ast
import subprocess
import sys

import pytest
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


PREFIX = "raggedspec."
PACKAGES = ("reference", "gpu", "conformance", "mutation", "raggedspec")


def imported_modules(path: Path, strip: bool = True) -> set[str]:
    """Every module name a file imports, at any depth of its syntax tree (with `strip`, the
    `raggedspec.` prefix removed: `reference.x` names the folder the module lives in)."""
    names = _imports(path)
    return {n[len(PREFIX):] if strip and n.startswith(PREFIX) else n for n in names}


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def reference_graph() -> dict[str, set[str]]:
    """`reference.x -> {reference.y, ...}` over the modules of reference/."""
    modules = {f"reference.{p.stem}": p for p in (ROOT / "reference").glob("*.py")
               if p.stem != "__init__"}
    return {name: {m for m in imported_modules(path) if m in modules and m != name}
            for name, path in modules.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of `graph` as a path `[a, b, ..., a]`, or None."""
    state: dict[str, int] = {}  # 1 on the stack, 2 done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


@pytest.mark.rule("the wheel and the package layout")
def test_every_import_goes_through_the_raggedspec_name():
    flat = ("reference", "gpu", "conformance", "mutation")
    offenders = {str(p.relative_to(ROOT)): sorted(m for m in imported_modules(p, strip=False)
                                                  if m.split(".")[0] in flat)
                 for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}
    assert {k: v for k, v in offenders.items() if v} == {}


@pytest.mark.rule("the wheel and the package layout")
def test_the_reference_never_imports_the_port_or_the_tools():
    offenders = {p.name: sorted(m for m in imported_modules(p, strip=False)
                                if m.startswith(("raggedspec.gpu", "raggedspec.conformance"))
                                or m.split(".")[:2] == ["raggedspec", "cli"]
                                or m in ("raggedspec", "raggedspec.drift", "raggedspec.bench"))
                 for p in (ROOT / "reference").glob("*.py")}
    assert {k: v for k, v in offenders.items() if v} == {}


@pytest.mark.rule("the wheel and the package layout")
def test_the_reference_modules_import_each_other_without_a_cycle():
    assert find_cycle(reference_graph()) is None


@pytest.mark.rule("the wheel and the package layout")
def test_the_cycle_finder_finds_a_planted_cycle_and_a_lazy_import(tmp_path):
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
    lazy = tmp_path / "lazy.py"
    lazy.write_text("def f():\n    from raggedspec.reference.acceptance import build_model\n")
    assert "reference.acceptance" in imported_modules(lazy)


LENGTHS_SCRIPT = ROOT / "scripts" / "function_lengths.py"

LONG_AND_SHORT = '''@decorator
def short():
    return 1


class K:
    def long(self):
        x = 1
        y = 2
        return x + y


def outer():
    def inner():
        return (
            3
        )
    return inner
'''


def run_lengths(*args: str):
    """`scripts/function_lengths.py` run as a user runs it: exit status, stdout, stderr."""
    done = subprocess.run([sys.executable, str(LENGTHS_SCRIPT), *args],
                          capture_output=True, text=True, timeout=60)
    return done.returncode, done.stdout, done.stderr


@pytest.mark.skipif(not LENGTHS_SCRIPT.is_file(), reason="needs the checkout's scripts/")
@pytest.mark.rule("scripts/function_lengths.py")
def test_function_lengths_lists_the_long_functions_and_refuses_a_bad_path(tmp_path):
    folder = tmp_path / "pkg"
    (folder / "sub").mkdir(parents=True)
    (folder / "sub" / "m.py").write_text(LONG_AND_SHORT)
    # K.long spans 4 lines (def to return), outer 6, outer.inner 4, short 2 (decorator excluded)
    code, out, _ = run_lengths("--limit", "3", str(folder))
    m = folder / "sub" / "m.py"
    assert code == 1
    assert out.splitlines() == [f"{m}:K.long:4", f"{m}:outer:6", f"{m}:outer.inner:4"]
    code, out, _ = run_lengths("--limit", "4", str(m))
    assert (code, out.splitlines()) == (1, [f"{m}:outer:6"])
    assert run_lengths("--limit", "6", str(folder))[0] == 0
    missing = tmp_path / "nope"
    code, out, err = run_lengths(str(folder), str(missing))
    assert (code, out) == (2, "")
    assert f"{missing}: no such file or folder" in err
