"""Step 0 of the device script (scripts/gpu_session.py): import every module the later steps
need, one by one, from the checkout, and stop at the first that fails.

It runs as the steps run: a child of the script's Python, in the checkout root, with the root
first on the module path. The top-level folders are importable as `raggedspec.*` there through
the links `raggedspec/reference -> ../reference` (and gpu, conformance, mutation, docs,
examples), so nothing is installed and no package registry or setuptools is needed. Each of the
project's own modules must come from this checkout: an installed copy that shadows it is a
failure, named. On the GPU, torch must see CUDA; CuPy is recorded (its steps say why they do not
run without it). The record (`imports.json`) is rewritten before each import, naming it, so a
hang is reported by module; on a failure its `failed` field is the one line the script prints.
Stdlib only until it imports.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# (module, whether it is the project's own): the order the steps first need them in
MODULES = [
    ("raggedspec", True),
    ("numpy", False),
    ("raggedspec.reference.attention", True),
    ("torch", False),
    ("raggedspec.gpu.backend", True),
    ("raggedspec.gpu.kernel_emulator", True),
    ("raggedspec.gpu.cupy_kernels", True),
    ("raggedspec.gpu.cupy_backend", True),
    ("raggedspec.preflight", True),
    ("tqdm", False),
    ("matplotlib", False),
    ("raggedspec.bench.runner", True),
    ("raggedspec.cli", True),
    ("pytest", False),
    ("xdist", False),
    ("hypothesis", False),
    ("raggedspec.conformance.backends", True),
    ("junit_per_file", True),
    ("session_report", True),
]


class StepZeroFailed(Exception):
    """A module the steps need cannot be used here; the message is the one line to print."""


def main(argv: list[str]) -> int:
    """`MODE OUT_JSON`: import MODULES in order, then the mode's device checks; 0 when all
    passed, 1 at the first failure (its line printed and recorded as `failed`)."""
    mode, out = argv[0], Path(argv[1])
    record = {"python": sys.version.split()[0], "executable": sys.executable,
              "root": str(ROOT), "mode": mode, "modules": [], "importing": None,
              "failed": None, "device": {}}
    try:
        for name, own in MODULES:
            record["modules"].append(import_one(name, own, record, out))
        record["device"] = device_checks(mode)
    except StepZeroFailed as exc:
        record["failed"] = f"step 0: {exc}"
        save(record, out)
        print(record["failed"], flush=True)
        return 1
    record["importing"] = None
    save(record, out)
    print(f"step 0: ok: {len(MODULES)} modules, the project's from {ROOT}", flush=True)
    return 0


def import_one(name: str, own: bool, record: dict, out: Path) -> dict:
    """Import `name` (recorded as `importing` first); its file, version and seconds.
    StepZeroFailed when the import raises, or when one of the project's own modules comes
    from outside the checkout."""
    record["importing"] = name
    save(record, out)
    print(f"importing {name}", flush=True)
    t0 = time.perf_counter()
    try:
        module = importlib.import_module(name)
    except BaseException as exc:  # noqa: BLE001 - any failure to import is this step's answer
        raise StepZeroFailed(f"cannot import {name}: {type(exc).__name__}: {exc} "
                             f"(Python {sys.executable})") from None
    where = getattr(module, "__file__", None)
    if own and not inside(where, ROOT):
        raise StepZeroFailed(f"{name} was imported from {where}, not from this checkout "
                             f"({ROOT}): an installed copy shadows it")
    return {"module": name, "file": where, "version": getattr(module, "__version__", None),
            "seconds": round(time.perf_counter() - t0, 3)}


def inside(path: str | None, root: Path) -> bool:
    """Whether `path` (links resolved) lies under `root`."""
    return path is not None and Path(path).resolve().is_relative_to(root.resolve())


def device_checks(mode: str) -> dict:
    """On the GPU: torch must see CUDA (else StepZeroFailed: nothing on the plan could run);
    CuPy's state is recorded. In the smoke: whether g++ is there for the kernel emulator."""
    import torch

    info = {"torch": torch.__version__, "torch_cuda": torch.version.cuda}
    if mode == "gpu" and not torch.cuda.is_available():
        raise StepZeroFailed(f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no "
                             "CUDA device: no step of the GPU plan can run here "
                             "(--cpu-smoke runs the plan on the CPU)")
    from raggedspec.gpu import cupy_kernels, kernel_emulator

    info["cupy"] = cupy_kernels.cupy_unavailable() or "available"
    info["g++"] = kernel_emulator.compilers()["g++"]
    return info


def save(record: dict, out: Path) -> None:
    """Write the record atomically (a reader never sees half a file)."""
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(record, indent=1))
    os.replace(tmp, out)
