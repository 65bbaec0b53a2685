"""Private copies of the tree for the mutation runner: `make_workspace` copies sources,
tests and config (no VCS, no caches) under the system temp dir, importable as
`raggedspec.*`; every copy is removed at exit, SIGTERM included. Nothing here writes
into the checkout."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


COPY_IGNORE = shutil.ignore_patterns(
    ".git",
    "mutants",
    "__pycache__",
    ".hypothesis",
    ".pytest_cache",
    "*.egg-info",
    "build",
    "out",
    ".venv",
    "venv",
    "*.pyc",
)


_WORKSPACES: list[Path] = []


def _cleanup() -> None:
    while _WORKSPACES:
        shutil.rmtree(_WORKSPACES.pop(), ignore_errors=True)


atexit.register(_cleanup)


def _terminate(signum, frame):  # SIGTERM -> SystemExit, so `finally` and atexit clean up
    raise SystemExit(128 + signum)


# The folders that install under the `raggedspec` import name (pyproject's package-dir).
PACKAGES = ("reference", "gpu", "conformance", "mutation", "docs", "examples")


def make_workspace(root: Path = ROOT, tag: str = "ws", nested: bool = False) -> Path:
    """A private copy of the tree (sources, tests, config; no VCS or caches) under the system
    temp dir, importable as `raggedspec.*` from its top. From a checkout: flat (its layout,
    each of `PACKAGES` also linked under `raggedspec/`, so a catalogue path names the file the
    tests import) or `nested` (the packages moved under `raggedspec/`: mutmut names a mutant
    by its file's path, which must be its module's name). From an installed package (`root`
    is the `raggedspec` folder itself): always nested. Removed at exit."""
    base = Path(tempfile.mkdtemp(prefix=f"raggedspec-mutation-{tag}-"))
    _WORKSPACES.append(base)
    dest = base / "tree"
    if not (root / "raggedspec").is_dir():
        shutil.copytree(root, dest / "raggedspec", ignore=COPY_IGNORE, symlinks=True)
        return dest
    shutil.copytree(root, dest, ignore=COPY_IGNORE, symlinks=True)
    for pkg in PACKAGES:
        link = dest / "raggedspec" / pkg
        if link.is_symlink():  # a checkout that links its packages under raggedspec/ itself
            link.unlink()
        if nested:
            shutil.move(dest / pkg, dest / "raggedspec" / pkg)
        else:
            (dest / "raggedspec" / pkg).symlink_to(Path("..") / pkg, target_is_directory=True)
    return dest


def drop_workspace(ws: Path) -> None:
    """Remove one copy made by `make_workspace` (its `tree` and the folder holding it)."""
    base = ws.parent
    if base in _WORKSPACES:
        _WORKSPACES.remove(base)
    shutil.rmtree(base, ignore_errors=True)


def nested_path(rel: str) -> str:
    """A checkout-relative path (or pytest node id) as it stands in a nested workspace."""
    return f"raggedspec/{rel}" if rel.split("/", 1)[0] in PACKAGES else rel


def in_tree(workdir: Path, rel: str) -> str:
    """`rel` (a checkout-relative path, node id, or `--opt=path`) as it stands in `workdir`,
    flat or nested."""
    opt, eq, path = rel.partition("=") if rel.startswith("-") else ("", "", rel)
    if path and not (workdir / path.split("::")[0]).exists():
        path = nested_path(path)
    return f"{opt}{eq}{path}"


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONDONTWRITEBYTECODE"] = (
        "1"  # a same-size mutant within the same second must not hit a stale .pyc
    )
    env["CUDA_VISIBLE_DEVICES"] = ""
    env.pop("HYPOTHESIS_PROFILE", None)
    env.pop("PYTEST_ADDOPTS", None)
    return env
