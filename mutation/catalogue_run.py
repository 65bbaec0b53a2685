"""Running the named catalogue: apply one entry's exact substitutions in a private
workspace, run its tests (a warm pytest server per worker, the last killer first),
and record CAUGHT, SURVIVED, TIMEOUT or BROKEN. A snippet that does not occur
exactly once is refused (`CatalogueError`), never applied."""

from __future__ import annotations

import concurrent.futures as cf
import json
import re
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from raggedspec.mutation.catalogue import Mutant
from raggedspec.mutation.workspace import ROOT, _env, in_tree, make_workspace

# entry name -> the test that caught it last time; run first (then the entry's own files), so a
# caught mutant usually costs one test. Rewritten by full runs, read by every run.
KILLERS = Path(__file__).resolve().parent / "killers.json"


PYTEST_ARGS = ["-x", "-q", "-p", "no:cacheprovider", "-o", "addopts=", "-rfE", "--no-header",
               "--hypothesis-profile=mutmut", "-n", "0"]


class CatalogueError(Exception):
    """A catalogue entry that cannot be applied (its snippet is missing or ambiguous)."""


def mutated_source(mutant: Mutant, source: str) -> str:
    """`source` with every substitution of `mutant` applied; CatalogueError unless each
    `old` snippet occurs exactly once (and the result differs)."""
    out = source
    for old, new in mutant.substitutions():
        n = out.count(old)
        if n != 1:
            raise CatalogueError(f"{mutant.name}: the snippet occurs {n} times in {mutant.file} "
                                 f"(must be exactly once): {old!r}")
        out = out.replace(old, new)
    if out == source:
        raise CatalogueError(f"{mutant.name}: the substitution changes nothing")
    return out


def check_catalogue(entries: list[Mutant], root: Path = ROOT) -> dict[str, str]:
    """{entry name: problem} for entries that cannot run, found without touching anything:
    unknown file, a snippet not found exactly once, an empty substitution, a duplicate name,
    no tests or an unknown test file."""
    problems: dict[str, str] = {}
    seen = set()
    for m in entries:
        if m.name in seen:
            problems[m.name] = "duplicate name"
        seen.add(m.name)
        path = root / m.file
        if not path.is_file():
            problems[m.name] = f"no file {m.file}"
            continue
        try:
            mutated_source(m, path.read_text())
        except CatalogueError as err:
            problems[m.name] = str(err)
        missing = [t for t in m.tests if not (root / t.split("::")[0]).is_file()]
        if missing or not m.tests:
            problems.setdefault(
                m.name, f"test file(s) missing: {missing}" if missing else "no tests"
            )
    return problems


@dataclass
class MutantResult:
    name: str
    file: str
    spec: str
    status: str  # CAUGHT | SURVIVED | TIMEOUT | ERROR | BROKEN
    detail: str  # first failing test (CAUGHT), or why
    seconds: float
    expect: str = "caught"

    @property
    def ok(self) -> bool:
        if self.expect == "survive":
            return self.status == "SURVIVED"
        return self.status in ("CAUGHT", "TIMEOUT")


# a node id runs to the end of its parameter brackets, which may hold spaces (`[idle steps]`)
_FAILED = re.compile(r"^(FAILED|ERROR) ([^\s\[]+(?:\[.*?\](?= - |$))?)", re.M)


def _first_failure(output: str) -> str:
    m = _FAILED.search(output)
    if m:
        return m.group(2) + (" (error)" if m.group(1) == "ERROR" else "")
    for line in output.splitlines():
        if "Error" in line or "error" in line:
            return line.strip()[:160]
    return output.strip().splitlines()[-1][:160] if output.strip() else "?"


# A warm pytest: one server per workspace has imported pytest, numpy and hypothesis (and torch
# for the port) once, and forks a fresh child per mutant. The child imports the project's
# modules itself, from the workspace, so every child sees the file as it is on disk now.
_SERVER = r"""
import json, os, signal, sys, time
import pytest, _pytest.python, _pytest.terminal, numpy, hypothesis, hypothesis.strategies
if os.environ.get("RAGGEDSPEC_MUTATION_TORCH") == "1":
    try:
        import torch
    except ImportError:
        pass
for line in sys.stdin:
    job = json.loads(line)
    t0 = time.monotonic()
    pid = os.fork()
    if pid == 0:
        try:
            fd = os.open(job["out"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            os.dup2(fd, 1); os.dup2(fd, 2)
            nul = os.open(os.devnull, os.O_RDONLY); os.dup2(nul, 0)
            sys.stdout = os.fdopen(1, "w", buffering=1); sys.stderr = os.fdopen(2, "w", buffering=1)
            os.chdir(job["cwd"]); sys.path.insert(0, job["cwd"])
            rc = int(pytest.main(job["args"]))
        except BaseException as exc:
            print("runner child crashed:", repr(exc), flush=True)
            rc = 70
        sys.stdout.flush(); sys.stderr.flush()
        os._exit(rc)
    deadline = t0 + job["timeout"]
    rc = None
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            rc = os.waitstatus_to_exitcode(status)
            break
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL); os.waitpid(pid, 0)
            break
        time.sleep(0.02)
    sys.stdout.write(json.dumps({"rc": rc, "seconds": time.monotonic() - t0}) + "\n")
    sys.stdout.flush()
"""


class WarmPytest:
    """A forking pytest server bound to one workspace (see `_SERVER`)."""

    def __init__(self, workdir: Path, torch: bool = False) -> None:
        self.workdir = workdir
        env = _env()
        if torch:
            env["RAGGEDSPEC_MUTATION_TORCH"] = "1"
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _SERVER],
            cwd=workdir,
            env=env,
            text=True,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        self.out = workdir.parent / "pytest.out"

    def run(self, args: list[str], timeout: float) -> tuple[int | None, str, float]:
        self.proc.stdin.write(
            json.dumps(
                {"cwd": str(self.workdir), "args": args, "out": str(self.out), "timeout": timeout}
            )
            + "\n"
        )
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("the warm pytest server died")
        reply = json.loads(line)
        return reply["rc"], self.out.read_text(errors="replace"), reply["seconds"]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def _pytest_args(tests: list[str], deselect: list[str] = (), extra: list[str] = (),
                 workdir: Path | None = None) -> list[str]:
    def here(t: str) -> str:
        return in_tree(workdir, t) if workdir is not None else t
    args = [*PYTEST_ARGS, *extra, *map(here, tests)]
    for d in deselect:
        args += ["--deselect", here(d)]
    return args


def run_pytest(
    workdir: Path,
    tests: list[str],
    deselect: list[str] = (),
    timeout: float = 600,
    extra: list[str] = (),
    server: WarmPytest | None = None,
) -> tuple[int | None, str, float]:
    """pytest in `workdir` (through `server` when given, else a fresh `python -m pytest`);
    (returncode or None on timeout, output, seconds)."""
    args = _pytest_args(tests, deselect, extra, workdir)
    if server is not None:
        return server.run(args, timeout)
    t0 = time.monotonic()
    try:
        p = subprocess.run([sys.executable, "-m", "pytest", *args], cwd=workdir, env=_env(),
                           capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        out = (
            exc.stdout.decode(errors="replace")
            if isinstance(exc.stdout, bytes)
            else (exc.stdout or "")
        )
        return None, out, time.monotonic() - t0
    return p.returncode, p.stdout + p.stderr, time.monotonic() - t0


def run_one(
    mutant: Mutant,
    workdir: Path,
    root: Path = ROOT,
    deselect: list[str] = (),
    timeout: float = 300,
    server: WarmPytest | None = None,
    hint: str | None = None,
) -> MutantResult:
    """Apply `mutant` in `workdir` (a copy of `root`), run its tests (the `hint` node first,
    when it still exists and is not deselected), restore the file."""
    tests = list(mutant.tests)
    if (
        hint
        and hint not in deselect
        and (workdir / in_tree(workdir, hint.split("::")[0])).is_file()
    ):
        tests = [hint] + tests
    target = workdir / in_tree(workdir, mutant.file)
    original = (root / mutant.file).read_text()
    t0 = time.monotonic()
    try:
        mutated = mutated_source(mutant, original)
    except CatalogueError as err:
        return MutantResult(
            mutant.name, mutant.file, mutant.spec, "BROKEN", str(err), 0.0, mutant.expect
        )
    target.write_text(mutated)
    try:
        code, out, secs = run_pytest(workdir, tests, deselect, timeout, server=server)
    finally:
        target.write_text(original)
    if code is None:
        status, detail = "TIMEOUT", f"no verdict in {timeout:.0f} s"
    elif code == 0:
        status, detail = "SURVIVED", "every selected test passed"
    elif code in (1, 2, 3):
        status, detail = "CAUGHT", _first_failure(out)
    else:  # 4: usage error, 5: no tests collected
        status, detail = "ERROR", f"pytest exit {code}: {_first_failure(out)}"
    return MutantResult(
        mutant.name, mutant.file, mutant.spec, status, detail, time.monotonic() - t0, mutant.expect
    )


def baseline(entries: list[Mutant], workdir: Path, jobs: int) -> tuple[list[str], float]:
    """Run the union of the entries' tests unmutated; the failing node ids (deselected from
    every mutant run, and reported: a red baseline fails the gate unless --allow-red)."""
    return _baseline_run(workdir, sorted({t for m in entries for t in m.tests}), jobs)


def _has_xdist() -> bool:
    try:
        import xdist  # noqa: F401
    except ImportError:
        return False
    return True


def load_killers(path: Path = KILLERS) -> dict[str, str]:
    try:
        return json.loads(Path(path).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


def save_killers(results: list[MutantResult], path: Path = KILLERS) -> None:
    """Record each CAUGHT entry's first failing test (merged into the existing file)."""
    killers = load_killers(path)
    for r in results:
        if r.status == "CAUGHT" and "::" in r.detail and " " not in r.detail:
            killers[r.name] = r.detail
    Path(path).write_text(json.dumps(dict(sorted(killers.items())), indent=1) + "\n")


def run_catalogue(
    entries: list[Mutant],
    root: Path = ROOT,
    jobs: int = 2,
    check_baseline: bool = True,
    log=print,
    hints: dict[str, str] | None = None,
    equivalents: dict | None = None,
) -> tuple[list[MutantResult], list[str]]:
    """Every entry in its own mutated copy, `jobs` at a time; (results in catalogue order,
    baseline failures). `hints`: entry name -> a test to run first."""
    hints = hints or {}
    jobs = max(1, min(jobs, len(entries) or 1))
    spaces = [make_workspace(root, f"cat{i}") for i in range(jobs)]
    red: list[str] = []
    if check_baseline:
        red, secs = baseline(entries, spaces[0], jobs)
        log(f"baseline: {'green' if not red else 'RED: ' + ', '.join(red)} ({secs:.1f} s)")
    torch = any(m.scope == "gpu" for m in entries)
    servers = [WarmPytest(ws, torch) for ws in spaces]
    free = list(servers)
    results: dict[str, MutantResult] = {}
    lock = threading.Lock()

    def work(m: Mutant) -> MutantResult:
        with lock:
            srv = free.pop()
        try:
            return run_one(m, srv.workdir, root, red, server=srv, hint=hints.get(m.name))
        finally:
            with lock:
                free.append(srv)

    pool = cf.ThreadPoolExecutor(jobs)
    try:
        futures = {pool.submit(work, m): m for m in entries}
        for fut in cf.as_completed(futures):
            r = fut.result()
            results[r.name] = r
            log(f"  {shown_status(r, equivalents):8} {r.name}  [{r.detail}]  {r.seconds:.1f}s")
    finally:
        # on an interrupt: drop the queued mutants, let the running ones (<= jobs) restore
        # their file, then stop the servers
        pool.shutdown(wait=True, cancel_futures=True)
        for srv in servers:
            srv.close()
    return [results[m.name] for m in entries], red


def shown_status(r: MutantResult, equivalents: dict | None) -> str:
    """A result's status as printed: a documented equivalent that survived reads
    `EQUIVALENT (its reason from equivalent.toml)`, every other result its status."""
    why = (equivalents or {}).get("catalogue", {}).get(r.name)
    return f"EQUIVALENT ({why})" if r.status == "SURVIVED" and why else r.status


def _baseline_run(workdir: Path, selection: list[str], jobs: int) -> tuple[list[str], float]:
    """Run a test selection (paths and pytest options) unmutated; the failing node ids."""
    args = [a for a in PYTEST_ARGS if a not in ("-x",)]
    i = args.index("-n")
    args = (
        args[:i] + args[i + 2 :] + (["-n", str(jobs)] if jobs > 1 and _has_xdist() else ["-n", "0"])
    )
    t0 = time.monotonic()
    selection = [in_tree(workdir, t) for t in selection]
    p = subprocess.run([sys.executable, "-m", "pytest", *args, *selection], cwd=workdir, env=_env(),
                       capture_output=True, text=True)
    out = p.stdout + p.stderr
    failed = [m.group(2) for m in _FAILED.finditer(out)]
    if p.returncode not in (0, 1) or (p.returncode == 1 and not failed):
        failed = failed or [f"<pytest exit {p.returncode}: {_first_failure(out)}>"]
    return failed, time.monotonic() - t0
