"""The one prepared script a GPU window runs: the most valuable numbers first, a hard deadline,
every result written under the output folder as it exists.

`OUT=/tmp/gpu-smoke python3 scripts/gpu_session.py --cpu-smoke` here first (< 90 s); `bash
scripts/gpu_session.sh` is the device tool's command. Stdlib only. The steps, the deadline,
the output files and the exit codes: docs/bench.md, section "scripts/gpu_session.py".
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from session_report import render_summary

ROOT = Path(__file__).resolve().parents[1]
EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_PREFLIGHT = 0, 1, 2, 4
DEFAULT_DEADLINE = {"gpu": 330.0, "cpu-smoke": 85.0}
KILL_GRACE = 3.0  # SIGTERM -> SIGKILL
FINAL_RESERVE = 3.0  # the last summary and tarball
OUT_FILES = (
    "summary.md",
    "session.log",
    "preflight.json",
    "headline.json",
    "bench.json",
    "e2e.json",
    "all.tar.gz",
)
# the per-op port tests: the test_port_*.py files, and the topic files whose test bodies run on
# the reference and the port alike
PORT_FILES = sorted(p.name for p in (ROOT / "conformance").glob("test_port_*.py")) + [
    "test_masks.py", "test_rope.py", "test_attention.py", "test_attention_dsv4.py",
    "test_attention_in_place.py", "test_step.py"]
BACKEND_FILES = ["test_backend.py", "test_end_to_end.py"]
SMOKE_PORT_FILES = ["test_masks.py"]
# The kernel tests on the device: the CuPy runner's only. Deselected: the emulated half (the
# CPU suite runs it) and nvcc's PTX front-end check (the preflight compiles every variant
# through CuPy's NVRTC itself).
KERNEL_TESTS_KEYWORD = "not emulate and not compile_for_the_gpu"
# The rest of the bench on the GPU: the whole grid but the headline's spread (64), so no case
# runs twice; spread 1024 comes first (the bench orders the longest L and widest spread first).
GPU_BENCH_REST = ["--spreads", "1024,0"]
# The smoke's "rest of the bench": one tiny case of the strategies the headline leaves out.
SMOKE_BENCH_REST = [
    "--batches",
    "1",
    "--lengths",
    "40",
    "--spreads",
    "0",
    "--windows",
    "2",
    "--strategies",
    "per_row,cohort,port,inplace_sdpa",
]


@dataclass
class Step:
    """One command of the plan. `cap`: its own timeout; `min_s`: below this it is skipped;
    `reserve`: seconds it leaves for the steps after it; `cupy`: skipped when the CuPy path
    is out (the preflight failed, or no CuPy); `copy`: (file in the work folder, name in OUT)."""

    name: str
    cmd: list[str]
    cap: float
    min_s: float = 5.0
    reserve: float = 0.0
    cupy: bool = False
    env: dict = field(default_factory=dict)
    copy: tuple[tuple[str, str], ...] = ()
    what: str = ""
    budget_arg: bool = False  # append `--budget-s` from the step's limit (the rest of the bench)


def plan(mode: str, work: Path, py: str) -> list[Step]:
    """The steps of `mode` ("gpu" or "cpu-smoke"), most valuable first."""
    gpu = mode == "gpu"
    rs = [py, "-m", "raggedspec"]
    dev = ["--device", "cuda"] if gpu else ["--smoke"]
    strategies = "cupy,padded_sdpa,flex"
    head = (
        ["--batches", "128", "--lengths", "4096", "--spreads", "64"]
        if gpu
        else ["--batches", "3", "--lengths", "40", "--spreads", "8", "--reps", "2"]
    )
    cupy_spec = "cupy" if gpu else "raggedspec.gpu.cupy_backend:emulated"
    e2e = dev if gpu else ["--smoke", "--e2e-batch", "4"]
    later = 75.0 if gpu else 25.0  # kept by the conformance for (e) and (f)
    steps = [
        Step(
            "env",
            rs + ["preflight", "--env-only", "--out", str(work / "env.json")],
            cap=30,
            min_s=3,
            what="(a) GPU, driver, clocks, torch / CuPy / NVRTC versions",
        ),
        Step(
            "preflight",
            rs
            + [
                "preflight",
                "--mode",
                "cupy" if gpu else "emulate",
                "--out",
                str(work / "preflight.json"),
            ],
            cap=90 if gpu else 40,
            min_s=10,
            reserve=60 if gpu else 15,
            copy=(("preflight.json", "preflight.json"),),
            what="(b) kernel variants compiled, side stream, three dtypes vs the reference, timing",
        ),
        Step(
            "headline",
            rs
            + [
                "bench",
                *dev,
                *head,
                "--windows",
                "2,4",
                "--strategies",
                strategies,
                "--out",
                str(work / "headline"),
                "-q",
            ],
            cap=120 if gpu else 45,
            min_s=15,
            copy=(("headline/bench.json", "headline.json"),),
            what="(c) the headline bench row: CuPy kernel, padded SDPA, flex_attention",
        ),
    ]
    device_env = {"RAGGEDSPEC_DEVICE": "cuda" if gpu else "cpu"}
    steps.append(
        _pytest_step(
            "conf_kernels_cupy",
            ["test_cupy_kernels.py"],
            work,
            py,
            device_env,
            cap=60 if gpu else 20,
            reserve=later,
            cupy=True,
            keyword=KERNEL_TESTS_KEYWORD,
            what="(d) the kernel tests through CuPy (the emulated ones deselected)",
        )
    )
    steps.append(
        _pytest_step(
            "conf_port_torch",
            PORT_FILES if gpu else SMOKE_PORT_FILES,
            work,
            py,
            device_env,
            cap=90 if gpu else 20,
            reserve=later,
            what="(d) the torch port's per-op conformance on the device",
        )
    )
    for dtype in ("float64", "bfloat16", "float32"):
        for backend in ("torch", "cupy"):
            if not gpu and dtype != "float64":
                continue
            env = dict(
                device_env,
                RAGGEDSPEC_BACKEND=backend if backend == "torch" else cupy_spec,
                RAGGEDSPEC_DTYPE=dtype,
            )
            files = BACKEND_FILES if gpu else BACKEND_FILES[:1]
            steps.append(
                _pytest_step(
                    f"conf_{backend}_{dtype}",
                    files,
                    work,
                    py,
                    env,
                    cap=60 if gpu else 20,
                    reserve=later,
                    cupy=backend == "cupy",
                    what=f"(d) backend conformance, {backend}, {dtype}",
                )
            )
    steps += [
        Step(
            "bench",
            rs
            + [
                "bench",
                *dev,
                *(GPU_BENCH_REST if gpu else SMOKE_BENCH_REST),
                "--out",
                str(work / "bench"),
                "-q",
            ],
            cap=90 if gpu else 25,
            min_s=20 if gpu else 10,
            reserve=40 if gpu else 12,
            budget_arg=True,
            copy=(("bench/bench.json", "bench.json"),),
            what="(e) the rest of the benchmark in the time left",
        ),
        Step(
            "e2e",
            rs + ["bench", "--e2e", *e2e, "--out", str(work / "e2e"), "-q"],
            cap=60 if gpu else 20,
            min_s=10,
            copy=(("e2e/e2e.json", "e2e.json"),),
            what="(f) the end-to-end step time, torch backend",
        ),
        Step(
            "e2e_cupy",
            rs
            + [
                "bench",
                "--e2e",
                *e2e,
                "--e2e-backend",
                cupy_spec,
                "--out",
                str(work / "e2e_cupy"),
                "-q",
            ],
            cap=60 if gpu else 20,
            min_s=10,
            cupy=True,
            what="(f) the end-to-end step time, cupy backend",
        ),
    ]
    if gpu:  # the users' kernels, where the device has them (each test skips with its reason)
        steps.append(
            _pytest_step(
                "check_kernel_ext",
                ["test_check_kernel.py"],
                work,
                py,
                device_env,
                cap=60,
                reserve=0,
                keyword="flash_attn or flashinfer",
                what="check-kernel on flash-attn's and FlashInfer's kernels, when installed",
            )
        )
    return steps


def _pytest_step(
    name: str,
    files: list[str],
    work: Path,
    py: str,
    env: dict,
    cap: float,
    reserve: float,
    what: str,
    cupy: bool = False,
    keyword: str | None = None,
) -> Step:
    cmd = [
        py,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "-rfEs",
        "-p",
        "junit_per_file",
        "--junit-dir",
        str(work / "junit" / name),
        "--hypothesis-profile=short",
        *[f"conformance/{f}" for f in files],
    ]
    if keyword:
        cmd += ["-k", keyword]
    return Step(name, cmd, cap=cap, min_s=8, reserve=reserve, cupy=cupy, env=env, what=what)


# ----------------------------------------------------------------------------- the run


class Run:
    """The run's state: the clock, the step rows, the notes; `collect` rewrites OUT."""

    def __init__(self, mode: str, out: Path, deadline: float, work: Path) -> None:
        self.mode, self.out, self.deadline, self.work = mode, out, deadline, work
        self.t0 = time.monotonic()
        self.rows: list[dict] = []
        self.notes: list[str] = []
        self.cupy_out: str | None = None  # why the CuPy steps are skipped, once known
        self.current: subprocess.Popen | None = None  # the step running now
        self.log_path = out / "session.log"
        self.log_path.write_text("")

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def log(self, msg: str) -> None:
        line = f"[{self.elapsed():6.1f}s] {msg}"
        print(line, flush=True)
        with self.log_path.open("a") as f:
            f.write(line + "\n")

    def limit_for(self, step: Step, last: bool = False) -> tuple[float, str | None]:
        """`(timeout, None)`: the step's cap clipped to the time left before the deadline, less
        the final collect, the kill grace and (unless it is the `last` step to run) what it
        keeps for the steps after it; `(0, why)` when that is under the step's minimum."""
        left = self.deadline - self.elapsed() - FINAL_RESERVE
        reserve = 0.0 if last else step.reserve
        limit = min(step.cap, left - reserve - KILL_GRACE)
        if limit < step.min_s:
            return 0.0, (
                f"skipped: needs >= {step.min_s:g} s, {max(left, 0):.0f} s left before the "
                f"{self.deadline:g} s deadline ({reserve:g} s kept for the steps after it)"
            )
        return limit, None

    def run_step(self, step: Step, base_env: dict, last: bool = False) -> int | None:
        """Run one step (or skip it with a note); returns its exit code, None when skipped.
        Over its limit the step's process group gets SIGTERM, then SIGKILL (exit 124)."""
        if step.cupy and self.cupy_out:
            return self._skip(step, f"skipped: {self.cupy_out}")
        limit, why = self.limit_for(step, last)
        if why:
            return self._skip(step, why)
        cmd = list(step.cmd)
        if step.budget_arg:
            cmd += ["--budget-s", f"{max(1.0, 0.6 * limit - 10):.0f}"]
        self.log(f"=== {step.name} (timeout {limit:.0f} s): {' '.join(cmd)}")
        log_file = self.work / f"{step.name}.log"
        t = time.monotonic()
        with log_file.open("w") as f:
            proc = subprocess.Popen(
                cmd,
                cwd=ROOT,
                stdout=f,
                stderr=subprocess.STDOUT,
                env={**base_env, **step.env},
                start_new_session=True,
            )
            self.current = proc
            try:
                rc = proc.wait(timeout=limit)
                timed_out = False
            except subprocess.TimeoutExpired:
                rc, timed_out = 124, True
                _kill(proc)
            finally:
                self.current = None
        dt = time.monotonic() - t
        with self.log_path.open("a") as f:
            f.write(log_file.read_text(errors="replace"))
        status = "timed out" if timed_out else ("ok" if rc == 0 else f"failed (exit {rc})")
        self.rows.append(
            {
                "step": step.name,
                "status": status,
                "rc": rc,
                "seconds": round(dt, 1),
                "limit": round(limit),
                "what": step.what,
                "command": " ".join(cmd),
            }
        )
        self.log(f"=== {step.name}: {status} after {dt:.1f} s")
        return rc

    def _skip(self, step: Step, why: str) -> None:
        self.rows.append(
            {
                "step": step.name,
                "status": why,
                "rc": None,
                "seconds": 0,
                "limit": 0,
                "what": step.what,
                "command": " ".join(step.cmd),
            }
        )
        self.notes.append(f"{step.name}: {why}")
        self.log(f"=== {step.name}: {why}")

    def collect(self, steps: list[Step]) -> None:
        """Copy the finished outputs to OUT, rewrite summary.md and all.tar.gz."""
        for step in steps:
            for src, dest in step.copy:
                # a bench cut short leaves only its partial file (the cases it finished)
                for name in (src, src.replace(".json", ".partial.json")):
                    if (self.work / name).is_file():
                        shutil.copyfile(self.work / name, self.out / dest)
                        break
        (self.out / "summary.md").write_text(self.summary())
        shutil.copyfile(self.log_path, self.work / "session.log")
        tmp = self.out / "all.tar.gz.tmp"
        with tarfile.open(tmp, "w:gz") as tar:
            tar.add(self.work, arcname="gpu-session")
        tmp.replace(self.out / "all.tar.gz")

    def summary(self) -> str:
        return render_summary(
            self.mode, self.elapsed(), self.deadline, self.rows, self.notes, self.work
        )


def _kill(proc: subprocess.Popen) -> None:
    """SIGTERM the step's process group, SIGKILL it KILL_GRACE s later if still there."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=KILL_GRACE)
            if sig == signal.SIGTERM:
                os.killpg(proc.pid, signal.SIGKILL)  # children left behind by the group leader
            return
        except subprocess.TimeoutExpired:
            continue
        except ProcessLookupError:
            return


def run_plan(mode: str, out: Path, deadline: float, only: list[str] | None, py: str) -> int:
    """The whole run; returns the exit code (module docstring)."""
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="gpu-session."))
    s = Run(mode, out, deadline, work)
    steps = plan(mode, work, py)
    if only:
        steps = [st for st in steps if st.name in only]
    base_env = dict(
        os.environ,
        PYTHONUNBUFFERED="1",
        MPLBACKEND="Agg",
        PYTHONPATH=os.pathsep.join(
            [str(ROOT), str(ROOT / "scripts")]
            + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])
        ),
    )
    s.log(f"mode {mode}, deadline {deadline:g} s, work folder {work}, output {out}")

    def stopped(signum, frame):  # killed from outside: take the running step's group along
        if s.current is not None:
            _kill(s.current)
        s.notes.append(f"the script was stopped by signal {signum} after {s.elapsed():.0f} s")
        s.collect(steps)
        sys.exit(128 + signum)

    signal.signal(signal.SIGTERM, stopped)
    failed, preflight_failed = False, False
    for i, step in enumerate(steps):
        rc = s.run_step(step, base_env, last=i == len(steps) - 1)
        if step.name == "preflight" and rc is not None and rc != 0:
            preflight_failed = True
            s.cupy_out = (
                f"the preflight failed (exit {rc}; see the preflight table): "
                "the CuPy steps are not run"
            )
            s.notes.append(s.cupy_out)
        elif step.name == "preflight" and rc is None:
            s.cupy_out = "the preflight did not run: the CuPy steps are not run"
        elif rc not in (None, 0):
            failed = True
        s.collect(steps)
        if step.name == "preflight" and s.cupy_out:
            _drop_cupy_strategy(steps)
    s.log(
        f"done after {s.elapsed():.1f} s; files in {out}: "
        + " ".join(sorted(p.name for p in out.iterdir()))
    )
    s.collect(steps)
    shutil.rmtree(work, ignore_errors=True)
    return EXIT_PREFLIGHT if preflight_failed else (EXIT_FAILED if failed else EXIT_OK)


def _drop_cupy_strategy(steps: list[Step]) -> None:
    """The headline without the CuPy kernel's column (the preflight ruled it out)."""
    for st in steps:
        if st.name == "headline" and "--strategies" in st.cmd:
            i = st.cmd.index("--strategies") + 1
            st.cmd[i] = ",".join(x for x in st.cmd[i].split(",") if x != "cupy")
            st.what += " (without the CuPy kernel column: the preflight did not pass)"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="scripts/gpu_session.py", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--cpu-smoke", action="store_true", help="the same plan on the CPU at smoke sizes (< 90 s)"
    )
    p.add_argument(
        "--deadline",
        type=float,
        default=None,
        help="hard deadline in seconds for the whole run (default 330; 85 with --cpu-smoke)",
    )
    p.add_argument("--out", type=Path, default=None, help="output folder (default $OUT)")
    p.add_argument(
        "--only", default=None, help="comma-separated step names to run (default all, in order)"
    )
    p.add_argument(
        "--python", default=sys.executable, help="the Python the steps run (default this one)"
    )
    args = p.parse_args(argv)
    mode = "cpu-smoke" if args.cpu_smoke else "gpu"
    out = args.out or (Path(os.environ["OUT"]) if os.environ.get("OUT") else None)
    if out is None:
        print("gpu_session: error: no output folder: set OUT or pass --out", file=sys.stderr)
        return EXIT_USAGE
    if out.exists() and not out.is_dir():
        print(f"gpu_session: error: --out {out} exists and is not a folder", file=sys.stderr)
        return EXIT_USAGE
    held = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    if held:  # an earlier run's files would mix with this run's: never overwrite, never mix
        print(
            f"gpu_session: error: --out {out} is not empty (it holds {held[0]!r}): refusing to "
            "write over or beside it; empty the folder or pick another",
            file=sys.stderr,
        )
        return EXIT_USAGE
    deadline = DEFAULT_DEADLINE[mode] if args.deadline is None else args.deadline
    if not deadline > 0:
        print(
            f"gpu_session: error: --deadline {args.deadline} must be > 0 seconds", file=sys.stderr
        )
        return EXIT_USAGE
    only = [x.strip() for x in args.only.split(",") if x.strip()] if args.only else None
    names = [st.name for st in plan(mode, Path("."), args.python)]
    unknown = sorted(set(only or []) - set(names))
    if unknown:
        print(
            f"gpu_session: error: --only: unknown step(s) {unknown}; steps: {', '.join(names)}",
            file=sys.stderr,
        )
        return EXIT_USAGE
    return run_plan(mode, out, deadline, only, args.python)


if __name__ == "__main__":
    sys.exit(main())
