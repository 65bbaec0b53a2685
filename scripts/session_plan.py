"""The plan of the device script (scripts/gpu_session.py): its steps, most valuable first, each a
command with its own time cap. Stdlib only.

Step 0 (`imports`) imports every module the later steps need, from the checkout; then the
headline (the CuPy kernel against the live-KV bound at B = 128, L = 4096, w = 2 and 4, beside
padded SDPA and the per-row loop), the environment, the preflight, the CUDA conformance (the
kernels' CuPy tests, the port, the backends), then flex_attention, the rest of the benchmark
and the end-to-end runs. Each step gets its cap clipped to the time left, so the order is the
priority. The steps marked `keep` (step 0 to the port's conformance) fit the deadline together
with their whole caps (`kept_seconds`), and a step that is not kept holds back the caps of the
kept steps after it. `--cpu-smoke` runs the same steps at smoke sizes on the CPU.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

KILL_GRACE = 3.0  # SIGTERM -> SIGKILL -> reaped: what a step over its cap may take beyond it
FINAL_RESERVE = 3.0  # the last summary, results and tarball
DEADLINE = {"gpu": 330.0, "cpu-smoke": 180.0}
# the per-op port tests: on the GPU the whole default suite (every topic file runs its test bodies
# on the reference and the port alike, the port on RAGGEDSPEC_DEVICE); one topic file in the smoke
PORT_FILES = {"gpu": [""], "cpu-smoke": ["test_masks.py"]}
BACKEND_FILES = {"gpu": ["test_backend.py", "test_end_to_end.py"], "cpu-smoke": ["test_backend.py"]}
KERNEL_FILES = ["test_kernels.py", "test_kernels_tc.py"]
# The kernels' tests on the device: the CuPy runner's only. Deselected: the emulated half and the
# builds without a GPU (NVRTC, nvcc's PTX check): the CPU suite runs those.
KERNEL_TESTS_KEYWORD = "not emulate and not compile_for_the_gpu and not nvrtc"
HEADLINE_SIZES = {
    "gpu": ["--batches", "128", "--lengths", "4096", "--spreads", "64"],
    "cpu-smoke": ["--batches", "3", "--lengths", "40", "--spreads", "8", "--reps", "2"],
}
# The rest of the bench: the grid but the headline's spread on the GPU (no case twice); one tiny
# case of the strategies the headline leaves out in the smoke.
BENCH_REST = {
    "gpu": ["--spreads", "1024,0"],
    "cpu-smoke": ["--batches", "1", "--lengths", "40", "--spreads", "0", "--windows", "2",
                  "--strategies", "per_row,cohort,port,inplace_sdpa"],
}
WORKERS = {"gpu": "4", "cpu-smoke": "0"}  # pytest-xdist workers (the device has 16 cores)


@dataclass
class Step:
    """One command of the plan. `cap`: its time limit; `min_s`: below this it is skipped;
    `keep`: its cap is held back for it by the steps before it that are not kept; `cupy`:
    skipped once the CuPy
    path is ruled out; `result`: the JSON it writes (relative to the work folder)."""

    name: str
    cmd: list[str]
    cap: float
    what: str
    min_s: float = 5.0
    keep: bool = False
    cupy: bool = False
    env: dict = field(default_factory=dict)
    result: str | None = None
    budget_arg: bool = False  # append `--budget-s` from the step's limit (the rest of the bench)


def plan(mode: str, work: Path, py: str) -> list[Step]:
    """The steps of `mode` ("gpu" or "cpu-smoke"), most valuable first."""
    return (
        [imports_step(mode, work, py), headline_step(mode, work, py)]
        + [env_step(work, py), preflight_step(mode, work, py)]
        + conformance_steps(mode, work, py)
        + [flex_step(mode, work, py), bench_rest_step(mode, work, py)]
        + e2e_steps(mode, work, py)
        + ([extension_step(work, py)] if mode == "gpu" else [])
    )


def kept_seconds(steps: list[Step]) -> float:
    """What the kept steps may take in all: their caps, each with the kill grace."""
    return sum(st.cap + KILL_GRACE for st in steps if st.keep)


def imports_step(mode: str, work: Path, py: str) -> Step:
    """Step 0: every module the steps need, imported from the checkout
    (scripts/session_imports.py)."""
    code = "import sys, session_imports; sys.exit(session_imports.main(sys.argv[1:]))"
    return Step("imports", [py, "-c", code, mode, str(work / "imports.json")], cap=20, min_s=3,
                keep=True, result="imports.json",
                what="(0) every module the steps need imports, from this checkout")


def _rs(py: str) -> list[str]:
    return [py, "-m", "raggedspec"]


def _device(mode: str) -> list[str]:
    return ["--device", "cuda"] if mode == "gpu" else ["--smoke"]


def headline_step(mode: str, work: Path, py: str) -> Step:
    """The headline bench row: the CuPy kernel alone and with its wrapper, padded SDPA and the
    per-row loop (no compile), against the live-KV bound."""
    cmd = _rs(py) + ["bench", *_device(mode), *HEADLINE_SIZES[mode], "--windows", "2,4",
                     "--strategies", "cupy,padded_sdpa,per_row", "--out", str(work / "headline"),
                     "-q"]
    return Step("headline", cmd, cap=75 if mode == "gpu" else 30, min_s=15, keep=True,
                result="headline/bench.json",
                what="(1) headline: CuPy kernel (alone and with its wrapper) vs the live-KV "
                "bound, padded SDPA, per-row loop")


def env_step(work: Path, py: str) -> Step:
    return Step("env", _rs(py) + ["preflight", "--env-only", "--out", str(work / "env.json")],
                cap=15, min_s=3, keep=True, result="env.json",
                what="(2) GPU, driver, clocks, torch / CuPy / NVRTC versions")


def preflight_step(mode: str, work: Path, py: str) -> Step:
    cmd = _rs(py) + ["preflight", "--mode", "cupy" if mode == "gpu" else "emulate", "--out",
                     str(work / "preflight.json")]
    return Step("preflight", cmd, cap=45 if mode == "gpu" else 30, min_s=10, keep=True,
                result="preflight.json",
                what="(3) kernel variants compiled once, side stream, three dtypes vs the "
                "reference, timing; stops at the first failed check")


def pytest_step(mode: str, name: str, files: list[str], work: Path, py: str, cap: float,
                what: str, **kw) -> Step:
    """A conformance step: pytest on `files` with the short Hypothesis profile, its workers,
    one JUnit XML per test file (scripts/junit_per_file.py) under junit/<name>/."""
    keyword = kw.pop("keyword", None)
    cmd = [py, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfEs", "-n", WORKERS[mode],
           "-p", "junit_per_file", "--junit-dir", str(work / "junit" / name),
           "--hypothesis-profile=short", *[f"conformance/{f}" for f in files]]
    cmd += ["-k", keyword] if keyword else []
    return Step(name, cmd, cap=cap, min_s=8, what=what, **kw)


def conformance_steps(mode: str, work: Path, py: str) -> list[Step]:
    """The kernels through CuPy and the port on the device (kept), then the backends: torch and
    the CuPy kernels, in float64, bfloat16 and float32 (float64 alone in the smoke)."""
    gpu = mode == "gpu"
    device = {"RAGGEDSPEC_DEVICE": "cuda" if gpu else "cpu"}
    steps = [
        pytest_step(mode, "conf_kernels_cupy", KERNEL_FILES, work, py, 60 if gpu else 30,
                    "(4) the kernels' tests through CuPy, the tensor-core kernel's too",
                    keyword=KERNEL_TESTS_KEYWORD, keep=True, cupy=True, env=device),
        pytest_step(mode, "conf_port_torch", PORT_FILES[mode], work, py,
                    90 if gpu else 30, "(4) the torch port's per-op conformance on the device",
                    keep=True, env=device),
    ]
    cupy = "cupy" if gpu else "raggedspec.gpu.cupy_backend:emulated"
    for dtype in ("float64", "bfloat16", "float32") if gpu else ("float64",):
        for backend, spec in (("torch", "torch"), ("cupy", cupy)):
            env = dict(device, RAGGEDSPEC_BACKEND=spec, RAGGEDSPEC_DTYPE=dtype)
            steps.append(pytest_step(mode, f"conf_{backend}_{dtype}", BACKEND_FILES[mode], work,
                                     py, 40 if gpu else 30, f"(4) backend conformance, {backend}, "
                                     f"{dtype}", cupy=backend == "cupy", env=env))
    return steps


def flex_step(mode: str, work: Path, py: str) -> Step:
    """flex_attention at the headline sizes: its cold torch.compile comes after the conformance."""
    cmd = _rs(py) + ["bench", *_device(mode), *HEADLINE_SIZES[mode], "--windows", "2,4",
                     "--strategies", "flex", "--out", str(work / "flex"), "-q"]
    return Step("flex", cmd, cap=90 if mode == "gpu" else 20, min_s=15, result="flex/bench.json",
                what="(5) flex_attention at the headline sizes (compiled on CUDA)")


def bench_rest_step(mode: str, work: Path, py: str) -> Step:
    cmd = _rs(py) + ["bench", *_device(mode), *BENCH_REST[mode], "--out", str(work / "bench"),
                     "-q"]
    return Step("bench", cmd, cap=90 if mode == "gpu" else 20, min_s=20 if mode == "gpu" else 10,
                budget_arg=True, result="bench/bench.json",
                what="(6) the rest of the benchmark in the time left")


def e2e_steps(mode: str, work: Path, py: str) -> list[Step]:
    """The end-to-end step time on the torch backend, then on the CuPy kernels."""
    sizes = _device(mode) if mode == "gpu" else ["--smoke", "--e2e-batch", "4"]
    cupy = "cupy" if mode == "gpu" else "raggedspec.gpu.cupy_backend:emulated"
    steps = []
    for name, backend, label in (("e2e", "torch", "torch"), ("e2e_cupy", cupy, "CuPy kernels")):
        cmd = _rs(py) + ["bench", "--e2e", *sizes, "--e2e-backend", backend, "--out",
                         str(work / name), "-q"]
        steps.append(Step(name, cmd, cap=45 if mode == "gpu" else 20, min_s=10,
                          cupy=name == "e2e_cupy", result=f"{name}/e2e.json",
                          what=f"(7) the end-to-end step time, {label} backend"))
    return steps


def extension_step(work: Path, py: str) -> Step:
    return pytest_step("gpu", "check_kernel_ext", ["test_check_kernel.py"], work, py, 30,
                       "(8) check-kernel on flash-attn's and FlashInfer's kernels, when installed",
                       keyword="flash_attn or flashinfer", env={"RAGGEDSPEC_DEVICE": "cuda"})
