"""mutmut's results kept between runs, outside the checkout, one folder per module and key.

A module's key is a SHA-256 over what its mutants' verdicts depend on directly: mutmut's
version, the `[tool.mutmut]` settings (less the two the runner rewrites per module), the
module's source, the source of each test file `scope.MUTMUT_MODULES` lists for it, and the
shared test helpers (every `conformance/*.py` that is not a `test_*.py`: conftest.py with the
`mutmut` Hypothesis profile, strategies.py, backends.py, ...). A rerun whose key is found
reuses that module's `.meta` verdicts and mutated source (read back as if mutmut had just
written them). Short of that, two runs continue earlier work instead of starting afresh: an
interrupted run (the per-module time limit) keeps its verdicts under its key, and the next
run under that key checks only the mutants still unchecked; a run whose only change is new
test files added to the module's list starts from the newest finished entry whose every
part is unchanged, keeps its killed mutants killed (the same tests still run) and checks the
others again with the new test files alone. Any other module is mutated afresh. Not in the key: the
other source modules the tests or the module import (the reference a port test compares
against, a helper the module calls). A change there keeps the cached verdicts until that
module's own source or tests change, `--no-cache` is given, or a full run without the
cache refreshes them.

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


def module_parts(root: Path, module: str, tests: tuple[str, ...] | None = None,
                 mutmut_version: str | None = None, tool: bool = True) -> dict[str, str]:
    """{part name: SHA-256 of its bytes} for what `module`'s key covers, in key order: with
    `tool`, "mutmut" (the version) and "config" (the settings), then the module, each listed
    test file ("<missing>" when absent) and each shared helper."""
    tests = MUTMUT_MODULES[module] if tests is None else tests
    parts: dict[str, bytes] = {}
    if tool:
        parts["mutmut"] = (mutmut_version or _mutmut_version()).encode()
        py = root / "pyproject.toml"
        cfg = (tomllib.loads(py.read_text()).get("tool", {}).get("mutmut", {})
               if py.is_file() else {})
        parts["config"] = json.dumps({k: v for k, v in cfg.items() if k not in _REWRITTEN},
                                     sort_keys=True).encode()
    parts[module] = (root / module).read_bytes()
    for t in tests:
        f = root / t
        parts[t] = f.read_bytes() if f.is_file() else b"<missing>"
    for f in helper_files(root):
        parts[f.relative_to(root).as_posix()] = f.read_bytes()
    return {name: hashlib.sha256(data).hexdigest() for name, data in parts.items()}


def key_of(parts: dict[str, str]) -> str:
    h = hashlib.sha256()
    for name, digest in parts.items():
        h.update(name.encode() + b"\0" + bytes.fromhex(digest))
    return h.hexdigest()


def module_key(root: Path, module: str, tests: tuple[str, ...] | None = None,
               mutmut_version: str | None = None, tool: bool = True) -> str:
    """The cache key of `module` in the tree at `root` (see the module docstring). With
    `tool=False`, the source key: the same without mutmut's version and settings (what the
    CI gate compares with the record, so a mutmut patch release alone re-tests nothing)."""
    return key_of(module_parts(root, module, tests, mutmut_version, tool))


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


def cached_base(cache: Path, module: str, key: str) -> str:
    """The key of the run the entry under `key` continued ("" for a run from scratch)."""
    try:
        return str(json.loads((entry_dir(cache, module, key) / "result.json").read_text())
                   .get("base", ""))
    except (FileNotFoundError, json.JSONDecodeError):
        return ""


def copy_module_files(mutants: Path, module: str, dst_mutants: Path) -> None:
    """Copy `module`'s mutated source and .meta (those present) between `mutants/` dirs."""
    for suffix in ("", ".meta"):
        src = mutants / "raggedspec" / (module + suffix)
        if src.is_file():
            dst = dst_mutants / "raggedspec" / (module + suffix)
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst)


def store(cache: Path | None, module: str, key: str, mutants: Path, seconds: float,
          parts: dict[str, str] | None = None, base: str = "") -> None:
    """Keep `module`'s files of a finished `mutants/` dir (its .meta and mutated source) under
    its key, with the digests of the parts the key covers (what `base_for` compares) and the
    key of the run it continued, if any; written to a temporary name first, so an interrupted
    store is never read. A finished store drops the key's partial entry."""
    if cache is None:
        return
    d = entry_dir(cache, module, key)
    tmp = d.with_name(d.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    copy_module_files(mutants, module, tmp / "mutants")
    (tmp / "result.json").parent.mkdir(parents=True, exist_ok=True)
    (tmp / "result.json").write_text(json.dumps({"module": module, "key": key,
                                                 "seconds": seconds, "parts": parts or {},
                                                 "base": base}))
    shutil.rmtree(d, ignore_errors=True)
    tmp.rename(d)
    shutil.rmtree(partial_dir(cache, module, key), ignore_errors=True)


def partial_dir(cache: Path, module: str, key: str) -> Path:
    d = entry_dir(cache, module, key)
    return d.with_name(d.name + ".partial")


def store_partial(cache: Path | None, module: str, key: str, mutants: Path,
                  seconds: float) -> None:
    """Keep the verdicts of an interrupted run (mutmut writes each one as it comes) under
    `key`, with the seconds spent so far, so the next run under the same key checks only the
    mutants still without a verdict."""
    if cache is None:
        return
    d = partial_dir(cache, module, key)
    tmp = d.with_name(d.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    copy_module_files(mutants, module, tmp / "mutants")
    (tmp / "partial.json").write_text(json.dumps({"module": module, "key": key,
                                                  "seconds": seconds}))
    shutil.rmtree(d, ignore_errors=True)
    tmp.rename(d)


def resume_from(cache: Path | None, module: str, key: str) -> tuple[Path, float] | None:
    """(the `mutants/` dir, the seconds spent) of an interrupted run under `key`, or None."""
    if cache is None:
        return None
    d = partial_dir(cache, module, key)
    try:
        seconds = float(json.loads((d / "partial.json").read_text())["seconds"])
    except (FileNotFoundError, json.JSONDecodeError, KeyError, ValueError):
        return None
    return d / "mutants", seconds


def base_for(cache: Path | None, module: str,
             parts: dict[str, str]) -> tuple[Path, str, list[str]] | None:
    """(the `mutants/` dir, the key, the test files added since) of a finished entry of
    `module` whose verdicts stay true under `parts`: mutmut's version and settings, the module
    and the shared helpers as they are now, and every test file it ran unchanged and still
    listed, new test files added. A mutant such a run killed is killed again (the same tests
    still run, derandomized), and one it did not kill is killed now exactly when an added test
    fails on it, so only its other mutants need a run, and only with the added files; None
    when no entry qualifies (the newest one wins)."""
    if cache is None:
        return None
    found = []
    for d in cache.glob(module.replace("/", "__") + "-*"):
        try:
            res = json.loads((d / "result.json").read_text())
        except (FileNotFoundError, NotADirectoryError, json.JSONDecodeError):
            continue
        old = res.get("parts") or {}
        if not old or res.get("module") != module or key_of(parts) == res.get("key"):
            continue
        if not set(old) <= set(parts) or any(parts[n] != h for n, h in old.items()):
            continue
        if {n for n in parts if n not in old and not _is_listed_test(n)}:
            continue  # something beside new test files is new: a helper, the tool
        added = [n for n in parts if n not in old and _is_listed_test(n)]
        found.append(((d / "result.json").stat().st_mtime, d / "mutants", res["key"], added))
    if not found:
        return None
    _, mutants, key, added = max(found)
    return mutants, key, added


def _is_listed_test(part: str) -> bool:
    name = part.rsplit("/", 1)[-1]
    return part.startswith("conformance/") and name.startswith("test_")
