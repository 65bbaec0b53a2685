"""The wheel carries what the commands read at run time, and nothing outside the `raggedspec`
import name. (scripts/check_wheel.sh, run by CI, installs it and runs the commands.)"""

from __future__ import annotations

import importlib.metadata
import json
import shutil
import subprocess
import sys
import zipfile

import pytest

import raggedspec
from raggedspec.cli import example_names, main
from raggedspec.conformance.helpers import CHECKOUT, PACKAGE


def _setuptools_is_new_enough() -> bool:
    try:
        major = int(importlib.metadata.version("setuptools").split(".")[0])
    except importlib.metadata.PackageNotFoundError:
        return False
    return major >= 77


@pytest.fixture(scope="module")
def wheel_files(tmp_path_factory) -> set[str]:
    if CHECKOUT is None:
        pytest.skip("needs the source checkout (this is an installed package)")
    out = tmp_path_factory.mktemp("wheel")
    cmd = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(out), str(CHECKOUT)]
    if _setuptools_is_new_enough():  # build with it here; else pip fetches one for the build
        cmd.insert(5, "--no-build-isolation")
    had_build = (CHECKOUT / "build").exists()
    try:
        subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=600)
    finally:  # an in-tree build leaves build/ behind: leave the checkout as it was
        if not had_build:
            shutil.rmtree(CHECKOUT / "build", ignore_errors=True)
    (wheel,) = out.glob("raggedspec-*.whl")
    with zipfile.ZipFile(wheel) as z:
        return set(z.namelist())


@pytest.mark.rule("the wheel and the package layout")
def test_the_wheel_carries_every_run_time_file(wheel_files):
    needed = ["raggedspec/gpu/kernels.cu", "raggedspec/docs/rules.md",
              "raggedspec/docs/spec-rules.txt", "raggedspec/mutation/catalogue.toml",
              "raggedspec/conformance/conftest.py",
              "raggedspec/conformance/examples/buggy_backend.py"]
    needed += [f"raggedspec/examples/{p.name}" for p in sorted((PACKAGE / "examples").iterdir())
               if p.suffix in (".toml", ".json")]
    for pkg in ("reference", "gpu", "conformance", "mutation"):
        needed += [f"raggedspec/{pkg}/{p.name}" for p in sorted((PACKAGE / pkg).glob("*.py"))]
    missing = [f for f in needed if f not in wheel_files]
    assert not missing, f"the wheel lacks {missing}"


@pytest.mark.rule("the wheel and the package layout")
def test_the_wheel_installs_nothing_beside_raggedspec(wheel_files):
    tops = {f.split("/", 1)[0] for f in wheel_files}
    assert {t for t in tops if not t.endswith(".dist-info")} == {"raggedspec"}
    assert any(f.endswith(".dist-info/licenses/LICENSE") for f in wheel_files)


@pytest.mark.rule("the wheel and the package layout")
def test_every_shipped_example_is_offered_and_runs(tmp_path):
    names = example_names()
    assert "per-sequence-b128" in names and len(names) == len(
        [p for p in (PACKAGE / "examples").iterdir() if p.suffix in (".toml", ".json")])
    out = tmp_path / "t.jsonl"
    assert main(["simulate", "--example", "per-sequence-b128", "--steps", "3", "--out", str(out),
                 "--quiet"]) == 0
    kinds = [json.loads(line)["type"] for line in out.read_text().splitlines()]
    assert kinds.count("step") == 3 and kinds[0] == "header"


@pytest.mark.rule("the wheel and the package layout")
def test_the_version_comes_from_one_place(capsys):
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"raggedspec {raggedspec.__version__}"
    assert importlib.metadata.version("raggedspec") == raggedspec.__version__
