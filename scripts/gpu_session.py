"""The one prepared script a GPU window runs: step 0 proves every module imports from this
checkout (nothing installed, no registry), then the headline number, then the rest in order of
value, under a hard deadline, every result written to the output folder as each step ends.

`OUT=/tmp/gpu-smoke bash scripts/gpu_session.sh --cpu-smoke` here first; `bash
scripts/gpu_session.sh` is the device tool's command. The plan: scripts/session_plan.py; the
reports: scripts/session_report.py. Stdlib only. The steps, the deadline, the output files and
the exit codes: docs/bench.md, section "scripts/gpu_session.py".
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

from session_plan import DEADLINE, FINAL_RESERVE, KILL_GRACE, Step, plan
from session_report import render_summary, results

ROOT = Path(__file__).resolve().parents[1]
EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_PREFLIGHT, EXIT_STEP0 = 0, 1, 2, 4, 5
OUT_FILES = ("summary.md", "results.json", "session.log", "all.tar.gz")  # the device takes 8
LINKS = ("reference", "gpu", "conformance", "mutation", "docs", "examples")
LOG_TAIL = 64 * 1024  # bytes of each step's output copied into session.log (all in the tarball)
TAR_FILE_LIMIT = 4 << 20  # larger files stay out of all.tar.gz (named in the notes)
PREFLIGHT_FAILED = 4  # `raggedspec preflight`'s exit code for a failed check


class Run:
    """The run's state: the clock, the step rows, the notes; `collect` rewrites OUT. `clock`
    and `execute` (run one command: `(cmd, env, limit, log_path) -> (rc, timed_out)`) are
    the real ones unless a test passes others."""

    def __init__(self, mode: str, out: Path, deadline: float, work: Path, clock=time.monotonic,
                 execute=None) -> None:
        self.mode, self.out, self.deadline, self.work = mode, out, deadline, work
        self.clock, self.t0 = clock, clock()
        self.execute = execute or self.run_process
        self.rows: list[dict] = []
        self.notes: list[str] = []
        self.cupy_out: str | None = None  # why the CuPy steps are skipped, once known
        self.failed = self.preflight_failed = self.step0_failed = False
        self.exit_code: int | None = None
        self.current: subprocess.Popen | None = None  # the step running now
        self.log_path = out / "session.log"
        self.log_path.write_text("")

    def elapsed(self) -> float:
        return self.clock() - self.t0

    def log(self, msg: str) -> None:
        line = f"[{self.elapsed():6.1f}s] {msg}"
        print(line, flush=True)
        with self.log_path.open("a") as f:
            f.write(line + "\n")

    def limit_for(self, step: Step, later: list[Step]) -> tuple[float, str | None]:
        """`(timeout, None)`: the step's cap clipped to the time left before the deadline, less
        the final collect and its own kill grace, and, for a step that is not kept, less the
        caps (with grace) of the kept steps still to come; `(0, why)` when that is under the
        step's minimum."""
        left = self.deadline - self.elapsed() - FINAL_RESERVE
        keep = 0.0 if step.keep else sum(st.cap + KILL_GRACE for st in later if st.keep)
        limit = min(step.cap, left - keep - KILL_GRACE)
        if limit < step.min_s:
            return 0.0, (
                f"skipped: needs >= {step.min_s:g} s, {max(left, 0):.0f} s left before the "
                f"{self.deadline:g} s deadline ({keep:g} s kept for the steps after it)"
            )
        return limit, None

    def run_step(self, step: Step, base_env: dict, later: list[Step]) -> int | None:
        """Run one step (or skip it with a note); its exit code, None when skipped, 124 when
        it ran past its limit (then its process group was killed)."""
        if step.cupy and self.cupy_out:
            return self.skip(step, f"skipped: {self.cupy_out}")
        limit, why = self.limit_for(step, later)
        if why:
            return self.skip(step, why)
        cmd = list(step.cmd)
        if step.budget_arg:
            cmd += ["--budget-s", f"{max(1.0, 0.6 * limit - 10):.0f}"]
        self.log(f"=== {step.name} (timeout {limit:.0f} s): {' '.join(cmd)}")
        log_file = self.work / f"{step.name}.log"
        t = self.clock()
        rc, timed_out = self.execute(cmd, {**base_env, **step.env}, limit, log_file)
        dt = self.clock() - t
        self.append_log(log_file)
        status = "timed out" if timed_out else ("ok" if rc == 0 else f"failed (exit {rc})")
        self.rows.append({"step": step.name, "status": status, "rc": rc, "seconds": round(dt, 1),
                          "limit": round(limit), "what": step.what, "command": " ".join(cmd)})
        self.log(f"=== {step.name}: {status} after {dt:.1f} s")
        return 124 if timed_out else rc

    def run_process(self, cmd: list[str], env: dict, limit: float, log_file: Path):
        """The real executor: the command in the checkout root, in its own process group,
        output to `log_file`; over `limit` the group is killed. `(rc, timed_out)`."""
        with log_file.open("w") as f:
            proc = subprocess.Popen(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, env=env,
                                    start_new_session=True)
            self.current = proc
            try:
                return proc.wait(timeout=limit), False
            except subprocess.TimeoutExpired:
                kill_group(proc)
                return 124, True
            finally:
                self.current = None

    def append_log(self, log_file: Path) -> None:
        """The end of a step's output into session.log (the whole of it is in the tarball)."""
        try:
            data = log_file.read_bytes()
        except OSError:
            return
        cut = len(data) > LOG_TAIL
        with self.log_path.open("a") as f:
            if cut:
                f.write(f"[... the first {len(data) - LOG_TAIL} bytes: {log_file.name} in "
                        "all.tar.gz]\n")
            f.write(data[-LOG_TAIL:].decode(errors="replace"))

    def skip(self, step: Step, why: str) -> None:
        self.rows.append({"step": step.name, "status": why, "rc": None, "seconds": 0,
                          "limit": 0, "what": step.what, "command": " ".join(step.cmd)})
        self.notes.append(f"{step.name}: {why}")
        self.log(f"=== {step.name}: {why}")

    def state(self, finished: bool) -> dict:
        return {"mode": self.mode, "deadline_s": self.deadline,
                "elapsed_s": round(self.elapsed(), 1), "finished": finished,
                "exit_code": self.exit_code, "steps": self.rows, "notes": self.notes}

    def collect(self, steps: list[Step], finished: bool = False) -> None:
        """Rewrite results.json, summary.md and all.tar.gz in OUT (each atomically)."""
        res = results(self.state(finished), steps, self.work)
        write_atomic(self.out / "results.json", json.dumps(res, indent=1, default=str))
        write_atomic(self.out / "summary.md", render_summary(res, self.work))
        self.write_tar()

    def write_tar(self) -> None:
        """The work folder (logs, JUnit XML, every step's files) as all.tar.gz; a file over
        TAR_FILE_LIMIT is left out and named in the notes."""
        tmp = self.out / "all.tar.gz.tmp"
        with tarfile.open(tmp, "w:gz") as tar:
            for path in sorted(self.work.rglob("*")):
                if path.is_file() and path.stat().st_size > TAR_FILE_LIMIT:
                    note = f"{path.relative_to(self.work)} left out of all.tar.gz (too large)"
                    self.notes += [] if note in self.notes else [note]
                elif path.is_file():
                    tar.add(path, arcname=f"device-run/{path.relative_to(self.work)}")
        tmp.replace(self.out / "all.tar.gz")


def write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def kill_group(proc: subprocess.Popen) -> None:
    """SIGTERM the step's process group, SIGKILL it (the leader and any child left behind)
    at most KILL_GRACE - 1 s later, then reap the leader: KILL_GRACE s at most."""
    for sig, wait in ((signal.SIGTERM, KILL_GRACE - 1), (signal.SIGKILL, 1.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            continue
        if sig == signal.SIGTERM:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # children the leader left behind
        return


# ----------------------------------------------------------------------------- the verdicts


def judge(s: Run, step: Step, rc: int | None) -> bool:
    """Record what a finished step means for the run; True when the run must stop (step 0
    failed: nothing after it could work)."""
    if step.name == "imports":
        return judge_imports(s, rc)
    if step.name == "preflight":
        judge_preflight(s, rc)
    elif rc not in (None, 0):
        s.failed = True
    return False


def judge_imports(s: Run, rc: int | None) -> bool:
    """Step 0 failed (an import, the checkout's origin, no CUDA) or ran out of time: its one
    line goes to stderr and the notes, and the run stops (exit 5)."""
    if rc == 0:
        return False
    rec = read_record(s.work / "imports.json")
    if rc == 124:
        line = (f"step 0: importing {rec.get('importing') or 'the first module'} did not finish "
                f"within its {s.rows[-1]['limit']} s")
    elif rc is None:
        line = "step 0: not run (no time left before the deadline)"
    else:
        line = rec.get("failed") or f"step 0: the import check exited {rc} (see session.log)"
    s.step0_failed = True
    s.notes.append(line + "; nothing else was run")
    print(f"gpu_session: {line}", file=sys.stderr, flush=True)
    return True


def judge_preflight(s: Run, rc: int | None) -> None:
    """A failed check rules the CuPy steps out (exit 4 at the end); a timeout is recorded as a
    timeout with the check it stopped in, and the CuPy steps still run; a preflight that could
    not start CuPy (exit 2) or did not run rules them out with its reason."""
    rec = read_record(s.work / "preflight.json")
    if rc == PREFLIGHT_FAILED:
        s.preflight_failed = True
        s.cupy_out = (f"the preflight's check {', '.join(rec.get('failed', [])) or '?'} failed: "
                      "the CuPy steps are not run")
        s.notes.append(s.cupy_out)
    elif rc == 124:
        s.failed = True
        s.notes.append(f"the preflight timed out while running {rec.get('running') or '?'} "
                       "(a timeout, not a failed check): the CuPy steps still run")
    elif rc is None:
        s.cupy_out = "the preflight did not run: the CuPy steps are not run"
    elif rc != 0:
        s.failed = True
        s.cupy_out = f"the preflight could not run the kernels (exit {rc}; see session.log)"
        s.notes.append(s.cupy_out)


def read_record(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def final_code(s: Run) -> int:
    if s.step0_failed:
        return EXIT_STEP0
    return EXIT_PREFLIGHT if s.preflight_failed else (EXIT_FAILED if s.failed else EXIT_OK)


# ----------------------------------------------------------------------------- the run


def ensure_links(root: Path = ROOT) -> list[str]:
    """Put back any link `raggedspec/<folder> -> ../<folder>` a copy of the checkout lost (the
    package imports through them); the notes saying which."""
    notes = []
    for name in LINKS:
        link = root / "raggedspec" / name
        if link.exists() or not (root / name).is_dir():
            continue
        if link.is_symlink():  # a dangling link
            link.unlink()
        link.symlink_to(Path("..") / name)
        notes.append(f"raggedspec/{name} was missing: linked to ../{name} again")
    return notes


def step_env() -> dict:
    """The steps' environment: the checkout root first on the module path (the package
    imports from it through its links), then scripts/ (the JUnit plugin, step 0's check)."""
    extra = [os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else []
    return dict(os.environ, PYTHONUNBUFFERED="1", MPLBACKEND="Agg",
                PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "scripts"), *extra]))


def run_plan(mode: str, out: Path, deadline: float, only: list[str] | None, py: str,
             clock=time.monotonic, execute=None) -> int:
    """The whole run; returns the exit code (docs/bench.md). `clock` and `execute` as Run's."""
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="gpu-session."))
    s = Run(mode, out, deadline, work, clock, execute)
    steps = [st for st in plan(mode, work, py) if st.name == "imports" or not only
             or st.name in only]
    s.notes += ensure_links()
    s.log(f"mode {mode}, deadline {deadline:g} s, work folder {work}, output {out}")
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: stopped(s, steps, signum))
    try:
        run_steps(s, steps)
    finally:
        signal.signal(signal.SIGTERM, previous)
    s.exit_code = final_code(s)
    s.log(f"done after {s.elapsed():.1f} s, exit {s.exit_code}; files in {out}: "
          + " ".join(sorted(p.name for p in out.iterdir())))
    s.collect(steps, finished=True)
    shutil.rmtree(work, ignore_errors=True)  # all of it is in all.tar.gz
    return s.exit_code


def run_steps(s: Run, steps: list[Step]) -> None:
    """Each step in order, judged, then OUT rewritten; stops after a failed step 0."""
    base_env = step_env()
    for i, step in enumerate(steps):
        rc = s.run_step(step, base_env, steps[i + 1:])
        stop = judge(s, step, rc)
        s.collect(steps)
        if stop:
            return


def stopped(s: Run, steps: list[Step], signum: int) -> None:
    """Killed from outside: take the running step's group along, write what finished."""
    if s.current is not None:
        kill_group(s.current)
    s.notes.append(f"the script was stopped by signal {signum} after {s.elapsed():.0f} s")
    s.collect(steps)
    sys.exit(128 + signum)


def usage_error(out: Path | None, deadline: float, only: list[str] | None, names: list[str]):
    """The first bad argument as one line, or None."""
    if out is None:
        return "no output folder: set OUT or pass --out"
    if out.exists() and not out.is_dir():
        return f"--out {out} exists and is not a folder"
    held = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    if held:  # an earlier run's files would mix with this run's: never overwrite, never mix
        return (f"--out {out} is not empty (it holds {held[0]!r}): refusing to write over or "
                "beside it; empty the folder or pick another")
    if not deadline > 0:
        return f"--deadline {deadline} must be > 0 seconds"
    unknown = sorted(set(only or []) - set(names))
    if unknown:
        return f"--only: unknown step(s) {unknown}; steps: {', '.join(names)}"
    return None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="scripts/gpu_session.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--cpu-smoke", action="store_true",
                   help="the same plan on the CPU at smoke sizes")
    p.add_argument("--deadline", type=float, default=None,
                   help="hard deadline in seconds for the whole run (default 330; 180 with "
                   "--cpu-smoke)")
    p.add_argument("--out", type=Path, default=None, help="output folder (default $OUT)")
    p.add_argument("--only", default=None,
                   help="comma-separated step names to run after step 0 (default all, in order)")
    p.add_argument("--python", default=sys.executable,
                   help="the Python the steps run (default this one)")
    args = p.parse_args(argv)
    mode = "cpu-smoke" if args.cpu_smoke else "gpu"
    out = args.out or (Path(os.environ["OUT"]) if os.environ.get("OUT") else None)
    deadline = DEADLINE[mode] if args.deadline is None else args.deadline
    only = [x.strip() for x in args.only.split(",") if x.strip()] if args.only else None
    why = usage_error(out, deadline, only, [st.name for st in plan(mode, Path("."), args.python)])
    if why:
        print(f"gpu_session: error: {why}", file=sys.stderr)
        return EXIT_USAGE
    return run_plan(mode, out, deadline, only, args.python)


if __name__ == "__main__":
    sys.exit(main())
