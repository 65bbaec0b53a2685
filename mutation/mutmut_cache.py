"""mutmut's results kept between runs, outside the checkout, one folder per module and key.

A module's key is a SHA-256 over what its mutants' verdicts depend on directly: mutmut's
version, the `[tool.mutmut]` settings (less the two the runner rewrites per module), the
module's source, the source of each test file `scope.MUTMUT_MODULES` lists for it, and the
shared test helpers (every `conformance/*.py` that is not a `test_*.py`: conftest.py with the
`mutmut` Hypothesis profile, strategies.py, backends.py, ...). A rerun whose key is found
reuses that module's `.meta` verdicts and mutated source (read back as if mutmut had just
written them); any other module is mutated afresh. Not in the key: the other source modules
the tests or the module import (the reference a port test compares against, a helper the
module calls). A change there keeps the cached verdicts until that module's own source or
tests change, `--no-cache` is given, or a full run without the cache refreshes them.

The folder is `--cache DIR`, else `$RAGGEDSPEC_MUTATION_CACHE`, else
`$XDG_CACHE_HOME/raggedspec/mutmut` (`~/.cache/raggedspec/mutmut`).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tomllib
from importlib import metadata
from pathlib import Path

from raggedspec.mutation.scope import MUTMUT_MODULES

_REWRITTEN = ("only_mutate", "pytest_add_cli_args_test_selection")


def default_cache_dir() -> Path:
    if os.environ.get("RAGGEDSPEC_MUTATION_CACHE"):
        return Path(os.environ["RAGGEDSPEC_MUTATION_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "raggedspec" / "mutmut"


def _mutmut_version() -> str:
    try:
        return metadata.version("mutmut")
    except metadata.PackageNotFoundError:
        return "absent"


def helper_files(root: Path) -> list[Path]:
    """The shared test helpers every module's tests may load."""
    return sorted(p for p in (root / "conformance").glob("*.py")
                  if not p.name.startswith("test_"))


def module_key(root: Path, module: str, tests: tuple[str, ...] | None = None,
               mutmut_version: str | None = None, tool: bool = True) -> str:
    """The cache key of `module` in the tree at `root` (see the module docstring). With
    `tool=False`, the source key: the same without mutmut's version and settings (what the
    CI gate compares with the record, so a mutmut patch release alone re-tests nothing)."""
    tests = MUTMUT_MODULES[module] if tests is None else tests
    h = hashlib.sha256()

    def part(name: str, data: bytes) -> None:
        h.update(name.encode() + b"\0" + hashlib.sha256(data).digest())

    if tool:
        part("mutmut", (mutmut_version or _mutmut_version()).encode())
        py = root / "pyproject.toml"
        cfg = (tomllib.loads(py.read_text()).get("tool", {}).get("mutmut", {})
               if py.is_file() else {})
        part("config", json.dumps({k: v for k, v in cfg.items() if k not in _REWRITTEN},
                                  sort_keys=True).encode())
    part(module, (root / module).read_bytes())
    for t in tests:
        f = root / t
        part(t, f.read_bytes() if f.is_file() else b"<missing>")
    for f in helper_files(root):
        part(f.relative_to(root).as_posix(), f.read_bytes())
    return h.hexdigest()


def entry_dir(cache: Path, module: str, key: str) -> Path:
    return cache / f"{module.replace('/', '__')}-{key[:20]}"


def cached(cache: Path | None, module: str, key: str) -> Path | None:
    """The cached `mutants/` dir of `module` at `key`, or None (no cache, or not there)."""
    if cache is None:
        return None
    d = entry_dir(cache, module, key)
    done = d / "result.json"
    if not done.is_file():
        return None
    try:
        if json.loads(done.read_text()).get("key") != key:
            return None
    except json.JSONDecodeError:
        return None
    return d / "mutants"


def reuse_plan(cache: Path | None, keys: dict[str, str]) -> dict[str, str]:
    """{module: "reuse" | "run"} for modules with keys `keys`: reused exactly when the cache
    holds a complete entry under the module's current key."""
    return {m: "reuse" if cached(cache, m, k) is not None else "run" for m, k in keys.items()}


def cached_seconds(cache: Path, module: str, key: str) -> float:
    try:
        return float(json.loads((entry_dir(cache, module, key) / "result.json").read_text())
                     .get("seconds", 0.0))
    except (FileNotFoundError, json.JSONDecodeError, ValueError):
        return 0.0


def store(cache: Path | None, module: str, key: str, mutants: Path, seconds: float) -> None:
    """Keep `module`'s files of a finished `mutants/` dir (its .meta and mutated source) under
    its key; written to a temporary name first, so an interrupted store is never read."""
    if cache is None:
        return
    d = entry_dir(cache, module, key)
    tmp = d.with_name(d.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    for suffix in ("", ".meta"):
        src = mutants / "raggedspec" / (module + suffix)
        if src.is_file():
            dst = tmp / "mutants" / "raggedspec" / (module + suffix)
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst)
    (tmp / "result.json").parent.mkdir(parents=True, exist_ok=True)
    (tmp / "result.json").write_text(json.dumps({"module": module, "key": key,
                                                 "seconds": seconds}))
    shutil.rmtree(d, ignore_errors=True)
    tmp.rename(d)
