"""A virtual environment that plays the GPU machine's Python for the device script's offline
test (conformance/test_device_script.py): without the project and without the system's
site-packages, holding only what the device has that the steps use (linked from this
machine's installs, with everything they need), pip and an old setuptools of its own, and a
decoy `raggedspec` that breaks any import reaching it; and the fresh copy of the checkout the
device would receive.
"""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def decoy(folder: Path, module: str, body: str) -> Path:
    """A package `module` under `folder` whose `__init__` is `body`; the folder."""
    (folder / module).mkdir(parents=True)
    (folder / module / "__init__.py").write_text(body)
    return folder


# What the GPU machine's Python holds that the steps use (Python 3.12, torch 2.11, CuPy 14,
# numpy, pytest, pytest-xdist, hypothesis, matplotlib, tqdm, safetensors, transformers and a
# setuptools of unknown version); the test links in those installed here, with what they need.
DEVICE_PACKAGES = ["torch", "numpy", "pytest", "pytest-xdist", "hypothesis", "matplotlib",
                   "tqdm", "safetensors"]
NEVER_LINKED = {"raggedspec", "setuptools", "pip"}  # the project; the venv's own old tools


def dependency_closure(names: list[str]) -> list[importlib.metadata.Distribution]:
    """The installed distributions of `names` and of everything they require here (markers
    evaluated, extras left out), the project and the packaging tools excepted."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    found, todo = {}, list(names)
    while todo:
        name = canonicalize_name(todo.pop())
        if name in found or name in NEVER_LINKED:
            continue
        try:
            dist = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            continue  # an optional need not installed here
        found[name] = dist
        for text in dist.requires or []:
            req = Requirement(text)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return list(found.values())


def link_distributions(dists, site: Path) -> list[str]:
    """Link each distribution's top-level entries (packages, modules, .dist-info) into
    `site`; the names linked."""
    linked = []
    for dist in dists:
        base = Path(dist.locate_file(""))
        tops = {Path(f).parts[0] for f in dist.files or []} - {"..", "__pycache__"}
        for top in sorted(tops):
            if not (site / top).exists() and (base / top).exists():
                (site / top).symlink_to(base / top)
                linked.append(top)
    return linked


def copy_checkout(dest: Path) -> None:
    """What the device receives: the checkout's tracked and untracked-not-ignored files, links
    kept as links."""
    try:
        listing = subprocess.run(["git", "ls-files", "-z", "--cached", "--others",
                                  "--exclude-standard"], cwd=ROOT, check=True,
                                 capture_output=True, timeout=60).stdout
    except (OSError, subprocess.CalledProcessError) as exc:
        pytest.skip(f"needs git to list the checkout's files ({exc})")
    for rel in filter(None, listing.decode().split("\0")):
        src, dst = ROOT / rel, dest / rel
        if not (src.is_symlink() or src.is_file()):
            continue  # deleted in the working tree
        dst.parent.mkdir(parents=True, exist_ok=True)
        if src.is_symlink():
            dst.symlink_to(os.readlink(src))
        else:
            shutil.copy2(src, dst)


def offline_venv(where: Path) -> Path:
    """A virtual environment without the project and without the system's site-packages:
    pip and setuptools 65.5 from ensurepip (Python 3.11 bundles them; a later Python's
    setuptools 65.5 comes from the package index here), the device's packages linked in,
    and a decoy `raggedspec` (an installed copy that must not shadow the checkout)."""
    subprocess.run([sys.executable, "-m", "venv", str(where)], check=True, timeout=300)
    py = where / "bin" / "python"
    version = venv_run(py, "import setuptools; print(setuptools.__version__)")
    if not version.startswith("65."):
        got = subprocess.run([str(py), "-m", "pip", "install", "-q", "setuptools==65.5.0"],
                             check=False, capture_output=True, text=True, timeout=300)
        if got.returncode:
            pytest.skip(f"needs setuptools 65.5.0 in the venv: {got.stderr.strip()[-300:]}")
    site = Path(venv_run(py, "import sysconfig; print(sysconfig.get_paths()['purelib'])"))
    link_distributions(dependency_closure(DEVICE_PACKAGES), site)
    decoy(site, "raggedspec", "raise ImportError('the installed decoy, not the checkout')\n")
    return py


def venv_run(py: Path, code: str) -> str:
    """`code`'s output under the venv's Python, run outside the checkout."""
    return subprocess.run([str(py), "-c", code], check=True, capture_output=True, text=True,
                          timeout=120, cwd=py.parents[2],
                          env={"PATH": os.environ["PATH"]}).stdout.strip()
