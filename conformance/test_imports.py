"""The house's import arrows: one import name, and the port depends on the reference, never
the other way round."""

from __future__ import annotations

import ast
from pathlib import Path

import raggedspec

ROOT = Path(raggedspec.__file__).resolve().parents[1]
PACKAGES = ("reference", "gpu", "conformance", "mutation", "raggedspec")


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, imported module) for every import statement of a file, lazy ones included."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out += [(node.lineno, node.module)]
            out += [(node.lineno, f"{node.module}.{a.name}") for a in node.names]
    return out


def _sources(*pkgs: str) -> list[Path]:
    return sorted(p for pkg in pkgs for p in (ROOT / pkg).rglob("*.py") if "mutants" not in p.parts)


def test_every_import_goes_through_the_raggedspec_name():
    flat = ("reference", "gpu", "conformance", "mutation")
    bad = [f"{p.relative_to(ROOT)}:{line}: {mod}" for p in _sources(*PACKAGES)
           for line, mod in _imports(p) if mod.split(".")[0] in flat]
    assert not bad, "imports by the bare folder name:\n" + "\n".join(bad)


def test_the_reference_never_imports_the_port_or_the_tools():
    bad = [f"{p.relative_to(ROOT)}:{line}: {mod}" for p in _sources("reference")
           for line, mod in _imports(p)
           if mod.startswith(("raggedspec.gpu", "raggedspec.cli", "raggedspec.conformance"))]
    assert not bad, "reference/ depends on:\n" + "\n".join(bad)
