"""Mutation runner: the named catalogue and mutmut, in a temporary copy of the tree.

    python -m raggedspec.mutation.runner                    # full: catalogue + mutmut on dispatch + step,
                                                 # reference and port (= --scope all)
    python -m raggedspec.mutation.runner --fast             # CI gate: catalogue + mutmut on reference/dispatch.py
    python -m raggedspec.mutation.runner --catalogue-only   # the named mutants only
    python -m raggedspec.mutation.runner --scope gpu        # the port's entries / modules only

Nothing is ever written into the checkout's source or tests: every mutant is applied in a
private copy (one per worker, under the system temp dir, removed on exit, interrupts
included), and mutmut runs in its own copy. The checkout only receives `docs/mutation.md`
(full runs, or `--docs PATH`) and, with `--json PATH`, a machine-readable result.

Gate (exit 1): a catalogue entry that is not CAUGHT (unless it is a documented equivalent
that SURVIVED), an entry whose `old` snippet does not occur exactly once, a mutmut score
under the threshold (95%), or a mutmut survivor that is not in `mutation/equivalent.toml`.
Score = (killed + timeout) / (total - skipped), as mutmut's own badge computes it.
"""

from __future__ import annotations

import argparse
import ast
import atexit
import concurrent.futures as cf
import difflib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import tomllib
from dataclasses import asdict, dataclass, field
from pathlib import Path

from raggedspec.mutation.catalogue import Mutant, select

ROOT = Path(__file__).resolve().parent.parent
EQUIVALENT = Path(__file__).resolve().parent / "equivalent.toml"
# entry name -> the test that caught it last time; run first (then the entry's own files), so a
# caught mutant usually costs one test. Rewritten by full runs, read by every run.
KILLERS = Path(__file__).resolve().parent / "killers.json"
THRESHOLD = 95.0
COPY_IGNORE = shutil.ignore_patterns(".git", "mutants", "__pycache__", ".hypothesis", ".pytest_cache",
                                     "*.egg-info", "build", "out", ".venv", "venv", "*.pyc")
PYTEST_ARGS = ["-x", "-q", "-p", "no:cacheprovider", "-o", "addopts=", "-rfE", "--no-header",
               "--hypothesis-profile=mutmut", "-n", "0"]

# mutmut 3.8's exit-code -> status table (mutmut/stats.py), copied so reading results does
# not import mutmut's global state.
STATUS_BY_EXIT_CODE = {1: "killed", 3: "killed", 0: "survived", 5: "no tests", 2: "interrupted",
                       None: "not checked", 33: "no tests", 34: "skipped", 35: "suspicious",
                       36: "timeout", 37: "caught by type check", -24: "timeout", 24: "timeout",
                       152: "timeout", 255: "timeout", -11: "segfault", -9: "segfault"}
NOT_KILLED = ("survived", "no tests", "suspicious", "segfault", "not checked", "interrupted")

# mutmut's scope per mode: what is mutated, and (fast) which tests the stats run uses.
MUTMUT_FULL = {"reference": ["reference/dispatch.py", "reference/step.py"],
               "gpu": ["gpu/dispatch.py", "gpu/step.py"]}
MUTMUT_FAST = {"reference": ["reference/dispatch.py"], "gpu": ["gpu/dispatch.py"]}
FAST_TESTS = {"reference": ["conformance/test_dispatch.py", "conformance/test_draft.py",
                            "conformance/test_mutation_kills.py"],
              "gpu": ["conformance/test_port_dispatch.py"]}


class CatalogueError(Exception):
    """A catalogue entry that cannot be applied (its snippet is missing or ambiguous)."""


# --------------------------------------------------------------------------- workspaces


_WORKSPACES: list[Path] = []


def _cleanup() -> None:
    while _WORKSPACES:
        shutil.rmtree(_WORKSPACES.pop(), ignore_errors=True)


atexit.register(_cleanup)


def _terminate(signum, frame):  # SIGTERM -> SystemExit, so `finally` and atexit clean up
    raise SystemExit(128 + signum)


# The folders that install under the `raggedspec` import name (pyproject's package-dir).
PACKAGES = ("reference", "gpu", "conformance", "mutation")


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
    env["PYTHONDONTWRITEBYTECODE"] = "1"  # a same-size mutant within the same second must not hit a stale .pyc
    env["CUDA_VISIBLE_DEVICES"] = ""
    env.pop("HYPOTHESIS_PROFILE", None)
    env.pop("PYTEST_ADDOPTS", None)
    return env


# --------------------------------------------------------------------------- applying


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
            problems.setdefault(m.name, f"test file(s) missing: {missing}" if missing else "no tests")
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


_FAILED = re.compile(r"^(FAILED|ERROR) (\S+)", re.M)


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
        self.proc = subprocess.Popen([sys.executable, "-c", _SERVER], cwd=workdir, env=env, text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self.out = workdir.parent / "pytest.out"

    def run(self, args: list[str], timeout: float) -> tuple[int | None, str, float]:
        self.proc.stdin.write(json.dumps({"cwd": str(self.workdir), "args": args, "out": str(self.out),
                                          "timeout": timeout}) + "\n")
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


def run_pytest(workdir: Path, tests: list[str], deselect: list[str] = (), timeout: float = 600,
               extra: list[str] = (), server: WarmPytest | None = None) -> tuple[int | None, str, float]:
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
        out = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        return None, out, time.monotonic() - t0
    return p.returncode, p.stdout + p.stderr, time.monotonic() - t0


def run_one(mutant: Mutant, workdir: Path, root: Path = ROOT, deselect: list[str] = (),
            timeout: float = 300, server: WarmPytest | None = None, hint: str | None = None) -> MutantResult:
    """Apply `mutant` in `workdir` (a copy of `root`), run its tests (the `hint` node first,
    when it still exists and is not deselected), restore the file."""
    tests = list(mutant.tests)
    if hint and hint not in deselect and (workdir / in_tree(workdir, hint.split("::")[0])).is_file():
        tests = [hint] + tests
    target = workdir / in_tree(workdir, mutant.file)
    original = (root / mutant.file).read_text()
    t0 = time.monotonic()
    try:
        mutated = mutated_source(mutant, original)
    except CatalogueError as err:
        return MutantResult(mutant.name, mutant.file, mutant.spec, "BROKEN", str(err), 0.0, mutant.expect)
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
    return MutantResult(mutant.name, mutant.file, mutant.spec, status, detail, time.monotonic() - t0,
                        mutant.expect)


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


def run_catalogue(entries: list[Mutant], root: Path = ROOT, jobs: int = 2, check_baseline: bool = True,
                  log=print, hints: dict[str, str] | None = None,
                  equivalents: dict | None = None) -> tuple[list[MutantResult], list[str]]:
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


# --------------------------------------------------------------------------- mutmut


@dataclass
class FunctionRow:
    function: str
    mutants: int = 0
    killed: int = 0
    survived: int = 0
    timeouts: int = 0
    other: int = 0  # no tests, suspicious, skipped, ...


@dataclass
class MutmutReport:
    stats: dict
    rows: list[FunctionRow]
    survivors: list[dict]  # {"key", "function", "status", "line"}
    seconds: float = 0.0
    only_mutate: list[str] = field(default_factory=list)

    @property
    def score(self) -> float:
        return score_of(self.stats)


def score_of(stats: dict) -> float:
    """(killed + timeout) / (total - skipped), in percent (0 when nothing was tested)."""
    tested = int(stats.get("total", 0)) - int(stats.get("skipped", 0))
    if tested <= 0:
        return 0.0
    return 100.0 * (int(stats.get("killed", 0)) + int(stats.get("timeout", 0))) / tested


def read_stats(path: Path) -> dict:
    """`mutants/mutmut-cicd-stats.json` as a dict, with the score added."""
    stats = json.loads(Path(path).read_text())
    stats["score"] = score_of(stats)
    return stats


_KEY = re.compile(r"^(?P<module>.+?)\.(?:x_(?P<func>\w+?)|xǁ(?P<cls>\w+)ǁ(?P<meth>\w+?))__mutmut_(?P<n>\d+)$")


def function_of(key: str) -> str:
    """'reference.dispatch.x_chain_start_of__mutmut_3' -> 'reference.dispatch.chain_start_of';
    methods as 'module.Class.method'."""
    m = _KEY.match(key)
    if not m:
        return key
    if m.group("func"):
        return f"{m.group('module')}.{m.group('func')}"
    return f"{m.group('module')}.{m.group('cls')}.{m.group('meth')}"


def _functions_in(source: str) -> dict[str, str]:
    """Every (possibly nested in a class) function's source, by name (linear in the file:
    mutmut's mutated files hold one copy of a function per mutant)."""
    lines = source.splitlines()
    out = {}
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            out[node.name] = textwrap.dedent("\n".join(lines[node.lineno - 1: node.end_lineno]))
    return out


def mutated_lines(mutated_file_source: str | dict[str, str], key: str) -> list[str]:
    """The statements of mutant `key` that differ from the original function, each on one
    line (a multi-line simple statement is joined; a compound one shows its changed lines).
    `mutated_file_source` is the mutated file's text or its `_functions_in` (parse once)."""
    funcs = mutated_file_source if isinstance(mutated_file_source, dict) else _functions_in(mutated_file_source)
    local = key.rsplit(".", 1)[1]
    orig = re.sub(r"__mutmut_\d+$", "__mutmut_orig", local)
    a, b = funcs.get(orig, ""), funcs.get(local, "")
    if not b:
        return ["<mutant not found>"]
    a_lines, b_lines = a.splitlines()[1:], b.splitlines()[1:]  # the def lines differ only in the name
    changed: list[int] = []  # 0-based indices into b_lines
    for tag, _, _, j1, j2 in difflib.SequenceMatcher(None, a_lines, b_lines, autojunk=False).get_opcodes():
        if tag in ("replace", "insert"):
            changed.extend(range(j1, j2))
        elif tag == "delete":
            changed.append(min(j1, len(b_lines) - 1))
    try:
        body = ast.parse(textwrap.dedent(b)).body[0]
    except SyntaxError:
        body = None
    simple = [n for n in ast.walk(body) if isinstance(n, ast.stmt) and not hasattr(n, "body")] if body else []
    out: list[str] = []
    for i in changed:
        line_no = i + 2  # 1-based, in the function including its def line
        stmt = next((n for n in simple if n.lineno <= line_no <= n.end_lineno), None)
        if stmt is not None:
            text = " ".join(l.strip() for l in b.splitlines()[stmt.lineno - 1: stmt.end_lineno])
        else:
            text = b_lines[i].strip()
        text = re.sub(r"\(\s+", "(", re.sub(r"\s+\)", ")", text))
        if text not in out:
            out.append(text)
    return out or ["<no textual change>"]


def read_mutants_dir(mutants: Path) -> MutmutReport:
    """Per-function rows and survivors from a mutmut `mutants/` dir (its *.meta files, the
    mutated sources and mutmut-cicd-stats.json)."""
    rows: dict[str, FunctionRow] = {}
    survivors = []
    for meta in sorted(mutants.rglob("*.py.meta")):
        data = json.loads(meta.read_text())
        src_path = meta.with_suffix("")  # drop .meta
        src = _functions_in(src_path.read_text()) if src_path.is_file() else {}
        for key, code in sorted(data.get("exit_code_by_key", {}).items(), key=lambda kv: _natural(kv[0])):
            status = STATUS_BY_EXIT_CODE.get(code, "suspicious")
            func = function_of(key)
            row = rows.setdefault(func, FunctionRow(func))
            row.mutants += 1
            if status in ("killed", "caught by type check"):
                row.killed += 1
            elif status == "timeout":
                row.timeouts += 1
            elif status == "survived":
                row.survived += 1
            else:
                row.other += 1
            if status in NOT_KILLED:
                survivors.append({"key": key, "function": func, "status": status,
                                  "line": " | ".join(mutated_lines(src, key)) if src else "?"})
    stats_path = mutants / "mutmut-cicd-stats.json"
    if stats_path.is_file():
        stats = read_stats(stats_path)
    else:  # derive from the meta files
        stats = {"killed": sum(r.killed for r in rows.values()), "survived": sum(r.survived for r in rows.values()),
                 "timeout": sum(r.timeouts for r in rows.values()), "total": sum(r.mutants for r in rows.values()),
                 "skipped": 0}
        stats["score"] = score_of(stats)
    mutated = sorted(str(m.relative_to(mutants).with_suffix("")) for m in mutants.rglob("*.py.meta"))
    return MutmutReport(stats, sorted(rows.values(), key=lambda r: r.function), survivors, 0.0, mutated)


def split_report(report: MutmutReport) -> dict[str, MutmutReport]:
    """The report per scope ("reference", "gpu"), from its rows and survivors (stats summed
    over the scope's functions)."""
    out = {}
    for scope in sorted({r.function.split(".")[0] for r in report.rows}):
        rows = [r for r in report.rows if r.function.startswith(scope + ".")]
        stats = {"killed": sum(r.killed for r in rows), "survived": sum(r.survived for r in rows),
                 "timeout": sum(r.timeouts for r in rows), "total": sum(r.mutants for r in rows),
                 "skipped": 0, "no_tests": sum(r.other for r in rows), "suspicious": 0}
        stats["score"] = score_of(stats)
        out[scope] = MutmutReport(stats, rows, [s for s in report.survivors if s["function"].startswith(scope + ".")],
                                  report.seconds, [p for p in report.only_mutate if p.startswith(scope + "/")])
    return out


def _natural(key: str):
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", key)]


def _mutmut_config(workdir: Path) -> dict:
    return tomllib.loads((workdir / "pyproject.toml").read_text())["tool"]["mutmut"]


def _set_mutmut_config(workdir: Path, only_mutate: list[str], selection: list[str] | None) -> None:
    """Rewrite the copy's [tool.mutmut] `only_mutate` and (when given) the stats-run test
    selection. Only ever called on a workspace copy."""
    py = workdir / "pyproject.toml"
    text = py.read_text()
    text = re.sub(r"(?m)^only_mutate = .*$", lambda _: "only_mutate = " + json.dumps(only_mutate), text)
    if selection is not None:
        text = re.sub(r"(?m)^pytest_add_cli_args_test_selection = .*$",
                      lambda _: "pytest_add_cli_args_test_selection = " + json.dumps(selection), text)
    py.write_text(text)


def run_mutmut(scopes: list[str], fast: bool, root: Path = ROOT, jobs: int = 2, log=print,
               timeout: float = 3600) -> tuple[MutmutReport, list[str]]:
    """mutmut in a fresh copy: a baseline of its test selection (failing tests are
    deselected and returned: mutmut refuses to start on a red suite), `run`, then
    `export-cicd-stats`; (the report, the baseline failures)."""
    table = MUTMUT_FAST if fast else MUTMUT_FULL
    if fast and "reference" in scopes:
        scopes = ["reference"]  # the CI gate mutates one dispatch module: the reference's
    only = [p for s in scopes for p in table[s] if (root / p).is_file()]
    if not only:
        raise CatalogueError(f"nothing to mutate for scope {scopes}")
    ws = make_workspace(root, "mutmut", nested=True)
    if fast:
        selection = [nested_path(t) for s in scopes for t in FAST_TESTS[s] if (root / t).exists()]
    else:
        selection = list(_mutmut_config(ws)["pytest_add_cli_args_test_selection"])
        if "gpu" not in scopes:
            selection += [f"--ignore={nested_path(p.relative_to(root).as_posix())}"
                          for p in sorted((root / "conformance").glob("test_port_*.py"))]
    t0 = time.monotonic()
    red, secs = _baseline_run(ws, selection, jobs)
    log(f"mutmut baseline: {'green' if not red else 'RED: ' + ', '.join(red)} ({secs:.1f} s)")
    _set_mutmut_config(ws, [nested_path(p) for p in only], selection + [f"--deselect={t}" for t in red])
    log(f"mutmut: mutating {', '.join(only)}")
    env = _env()
    p = subprocess.run([sys.executable, "-m", "mutmut", "run", "--max-children", str(jobs)], cwd=ws, env=env,
                       capture_output=True, text=True, timeout=timeout)
    tail = "\n".join(p.stdout.replace("\r", "\n").splitlines()[-8:])
    if p.returncode != 0:
        raise RuntimeError(f"mutmut run failed (exit {p.returncode}):\n{tail}\n{p.stderr[-3000:]}")
    q = subprocess.run([sys.executable, "-m", "mutmut", "export-cicd-stats"], cwd=ws, env=env,
                       capture_output=True, text=True)
    if q.returncode != 0:
        raise RuntimeError(f"mutmut export-cicd-stats failed: {q.stdout}{q.stderr}")
    report = read_mutants_dir(ws / "mutants")
    report.seconds = time.monotonic() - t0
    report.only_mutate = only
    return report, red


def _baseline_run(workdir: Path, selection: list[str], jobs: int) -> tuple[list[str], float]:
    """Run a test selection (paths and pytest options) unmutated; the failing node ids."""
    args = [a for a in PYTEST_ARGS if a not in ("-x",)]
    i = args.index("-n")
    args = args[:i] + args[i + 2:] + (["-n", str(jobs)] if jobs > 1 and _has_xdist() else ["-n", "0"])
    t0 = time.monotonic()
    selection = [in_tree(workdir, t) for t in selection]
    p = subprocess.run([sys.executable, "-m", "pytest", *args, *selection], cwd=workdir, env=_env(),
                       capture_output=True, text=True)
    out = p.stdout + p.stderr
    failed = [m.group(2) for m in _FAILED.finditer(out)]
    if p.returncode not in (0, 1) or (p.returncode == 1 and not failed):
        failed = failed or [f"<pytest exit {p.returncode}: {_first_failure(out)}>"]
    return failed, time.monotonic() - t0


# --------------------------------------------------------------------------- equivalents


def load_equivalents(path: Path = EQUIVALENT) -> dict:
    """{"catalogue": {name: why}, "mutmut": [{"function", "line", "why"}]}; ValueError for an
    entry without a one-line justification."""
    data = tomllib.loads(Path(path).read_text()) if Path(path).is_file() else {}
    cat, mm = {}, []
    for e in data.get("catalogue", []):
        _need_why(e)
        cat[e["name"]] = e["why"]
    for e in data.get("mutmut", []):
        _need_why(e)
        if not e.get("function") or not e.get("line"):
            raise ValueError(f"mutmut equivalent {e} needs 'function' and 'line'")
        mm.append(e)
    return {"catalogue": cat, "mutmut": mm}


def _need_why(e: dict) -> None:
    why = str(e.get("why", "")).strip()
    if not why or "\n" in why:
        raise ValueError(f"equivalent entry {e} needs a one-line 'why'")


def equivalent_for(survivor: dict, equivalents: dict) -> str | None:
    """The justification of a mutmut survivor: an entry whose function matches and whose
    `line` equals the mutated line (whitespace-insensitive)."""
    norm = lambda s: re.sub(r"\s+", "", s)
    for e in equivalents["mutmut"]:
        if e["function"] == survivor["function"] and norm(e["line"]) == norm(survivor["line"]):
            return e["why"]
    return None


# --------------------------------------------------------------------------- gate


@dataclass
class Verdict:
    ok: bool
    reasons: list[str]


def gate(results: list[MutantResult] | None, report: MutmutReport | None, equivalents: dict,
         threshold: float = THRESHOLD, baseline_red: list[str] = (), allow_red: bool = False) -> Verdict:
    reasons = []
    if baseline_red and not allow_red:
        reasons.append(f"the unmutated tests are red: {', '.join(baseline_red)}")
    for r in results or []:
        if r.ok:
            if r.expect == "survive" and r.name not in equivalents["catalogue"]:
                reasons.append(f"catalogue: '{r.name}' is expected to survive but has no justification "
                               f"in equivalent.toml")
            continue
        if r.expect == "survive":
            reasons.append(f"catalogue: '{r.name}' was expected to survive (a documented equivalent) but is "
                           f"{r.status} ({r.detail}): the equivalence claim is wrong")
        elif r.status == "SURVIVED" and r.name in equivalents["catalogue"]:
            continue
        else:
            reasons.append(f"catalogue: '{r.name}' {r.status} ({r.detail})")
    if report is not None:
        if report.score < threshold:
            reasons.append(f"mutmut: score {report.score:.1f}% is under {threshold:.0f}%")
        for s in report.survivors:
            if equivalent_for(s, equivalents) is None:
                reasons.append(f"mutmut: {s['key']} {s['status']} and is not in equivalent.toml: {s['line']}")
    return Verdict(not reasons, reasons)


# --------------------------------------------------------------------------- output


def catalogue_table(results: list[MutantResult]) -> list[str]:
    lines = ["| # | mutant | file | spec | result | first failing test |", "|---|---|---|---|---|---|"]
    for i, r in enumerate(results, 1):
        status = r.status + (" (equivalent)" if r.expect == "survive" and r.status == "SURVIVED" else "")
        lines.append(f"| {i} | {r.name} | `{r.file}` | {r.spec} | {status} | "
                     f"{'`' + r.detail + '`' if r.status == 'CAUGHT' else r.detail} |")
    return lines


def mutmut_table(report: MutmutReport) -> list[str]:
    lines = ["| function | mutants | killed | survived | timeouts | other |", "|---|---:|---:|---:|---:|---:|"]
    for r in report.rows:
        lines.append(f"| `{r.function}` | {r.mutants} | {r.killed} | {r.survived} | {r.timeouts} | {r.other} |")
    s = report.stats
    lines.append(f"| **total** | {s.get('total', 0)} | {s.get('killed', 0)} | {s.get('survived', 0)} | "
                 f"{s.get('timeout', 0)} | {s.get('no_tests', 0) + s.get('suspicious', 0) + s.get('skipped', 0)} |")
    return lines


def print_mutmut(report: MutmutReport, equivalents: dict, log=print) -> None:
    w = max([len(r.function) for r in report.rows] + [8])
    log(f"{'function':{w}}  mutants  killed  survived  timeouts  other")
    for r in report.rows:
        log(f"{r.function:{w}}  {r.mutants:7}  {r.killed:6}  {r.survived:8}  {r.timeouts:8}  {r.other:5}")
    s = report.stats
    log(f"{'total':{w}}  {s.get('total', 0):7}  {s.get('killed', 0):6}  {s.get('survived', 0):8}  "
        f"{s.get('timeout', 0):8}  {s.get('no_tests', 0) + s.get('suspicious', 0):5}")
    log(f"mutmut score: {report.score:.1f}% = (killed + timeout) / (total - skipped) "
        f"= ({s.get('killed', 0)} + {s.get('timeout', 0)}) / ({s.get('total', 0)} - {s.get('skipped', 0)})")
    for sv in report.survivors:
        why = equivalent_for(sv, equivalents)
        log(f"  {sv['status']}: {sv['key']}: {sv['line']}  -> {'equivalent: ' + why if why else 'NOT JUSTIFIED'}")


BEGIN, END = "<!-- BEGIN generated:{} -->", "<!-- END generated:{} -->"


def _replace_section(doc: str, name: str, body: list[str]) -> str:
    b, e = BEGIN.format(name), END.format(name)
    block = "\n".join([b, *body, e])
    if b in doc and e in doc:
        return doc[: doc.index(b)] + block + doc[doc.index(e) + len(e):]
    return doc.rstrip("\n") + "\n\n" + block + "\n"


def write_docs(path: Path, results: list[MutantResult] | None, report: MutmutReport | None,
               equivalents: dict, command: str, seconds: float, when: str) -> None:
    """Replace the generated sections of `path` that this run produced (one catalogue and one
    mutmut section per scope, and the equivalent list); hand-written text between them and
    the sections of scopes this run did not cover are kept."""
    doc = path.read_text() if path.is_file() else "# Mutation testing\n"
    for scope in ("reference", "gpu"):
        rs = [r for r in results or [] if (r.file.startswith("gpu/")) == (scope == "gpu")]
        if not rs:
            continue
        caught = sum(r.status in ("CAUGHT", "TIMEOUT") for r in rs)
        survived = sum(r.status == "SURVIVED" for r in rs)
        eq = sum(r.expect == "survive" and r.status == "SURVIVED" for r in rs)
        body = [f"`{command}` ({when}; the whole run took {seconds:.0f} s wall): {len(rs)} entries, "
                f"**{caught} caught, {survived} survived** ({eq} of them the documented equivalent), "
                f"{len(rs) - caught - survived} other.", "", *catalogue_table(rs)]
        doc = _replace_section(doc, f"catalogue-{scope}", body)
    for scope, rep in (split_report(report) if report is not None else {}).items():
        s = rep.stats
        took = f"{rep.seconds:.0f} s wall" if rep.seconds else "time not recorded"
        body = [f"`{command}` ({when}; mutmut took {took} for "
                f"{', '.join('`' + p + '`' for p in report.only_mutate)}). This scope: "
                f"{', '.join('`' + p + '`' for p in rep.only_mutate)}, "
                f"**score {rep.score:.1f}%** = (killed {s['killed']} + timeout {s['timeout']}) / "
                f"(total {s['total']} - skipped {s['skipped']}).", "", *mutmut_table(rep), ""]
        if rep.survivors:
            body += ["Survivors (each must be in `mutation/equivalent.toml`):", ""]
            for sv in rep.survivors:
                why = equivalent_for(sv, equivalents)
                body.append(f"- `{sv['key']}` ({sv['status']}): `{sv['line']}` — "
                            f"{why if why else '**not justified**'}")
        else:
            body.append("No survivors.")
        doc = _replace_section(doc, f"mutmut-{scope}", body)
    eq = ["| kind | mutant | why it cannot be caught |", "|---|---|---|"]
    eq += [f"| catalogue | {name} | {why} |" for name, why in equivalents["catalogue"].items()]
    eq += [f"| mutmut | `{e['function']}`: `{e['line']}` | {e['why']} |" for e in equivalents["mutmut"]]
    doc = _replace_section(doc, "equivalents", eq)
    path.write_text(doc)


# --------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m raggedspec.mutation.runner", description=__doc__.split("\n\n")[0],
        epilog="Exit codes: 0 the gate passed; 1 it failed (the reasons are listed); 2 bad "
               "input (an --only matching no entry) or mutmut did not complete.")
    ap.add_argument("--scope", choices=("reference", "gpu", "all"), default="all",
                    help="all (default): the reference and the port; reference: the reference rules; "
                         "gpu: the torch port and the kernels")
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--catalogue-only", action="store_true", help="run only the named catalogue")
    mode.add_argument("--mutmut-only", action="store_true", help="run only mutmut")
    ap.add_argument("--fast", action="store_true",
                    help="CI gate: the catalogue plus mutmut on the dispatch module only")
    ap.add_argument("--only", help="catalogue entries whose name contains this text")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--threshold", type=float, default=THRESHOLD)
    ap.add_argument("--no-baseline", action="store_true", help="skip the catalogue's unmutated baseline run")
    ap.add_argument("--no-hints", action="store_true",
                    help="ignore mutation/killers.json (run each entry's test files in order)")
    ap.add_argument("--allow-red", action="store_true",
                    help="do not fail the gate when unmutated tests fail (they are deselected either way)")
    ap.add_argument("--from-mutants", type=Path, help="read an existing mutmut mutants/ dir instead of running mutmut")
    ap.add_argument("--equivalent", type=Path, default=EQUIVALENT)
    ap.add_argument("--docs", type=Path, help="write the report here (default: docs/mutation.md on a full run)")
    ap.add_argument("--no-docs", action="store_true")
    ap.add_argument("--json", type=Path, help="also write the results as JSON")
    ap.add_argument("--root", type=Path, default=ROOT, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.json is not None:  # refused now, not after a run of many minutes
        from raggedspec.outputs import OutputPathError, check_output_file

        try:
            check_output_file(args.json, "--json")
        except OutputPathError as exc:
            print(f"python -m raggedspec.mutation.runner: error: {exc}", file=sys.stderr)
            return 2
    root = args.root.resolve()
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _terminate)
    t0 = time.monotonic()
    equivalents = load_equivalents(args.equivalent)

    scopes = ["reference", "gpu"] if args.scope == "all" else [args.scope]
    if "gpu" in scopes and not any((root / p).is_file() for p in MUTMUT_FULL["gpu"]):
        scopes = [s for s in scopes if s != "gpu"]

    results, red, report, infra = None, [], None, None
    try:
        if not args.mutmut_only:
            entries = select(args.scope, args.only)
            if args.only is not None and not entries:
                print(f"python -m raggedspec.mutation.runner: error: --only {args.only!r} matches no "
                      f"catalogue entry in scope {args.scope} (mutation/catalogue.py names them)",
                      file=sys.stderr)
                return 2
            broken = check_catalogue(entries, root)
            for name, why in broken.items():
                print(f"BROKEN {name}: {why}")
            runnable = [m for m in entries if m.name not in broken]
            print(f"catalogue: {len(entries)} entries ({len(runnable)} runnable), scope {args.scope}, "
                  f"{args.jobs} job(s)")
            hints = {} if args.no_hints else load_killers()
            results, red = run_catalogue(runnable, root, args.jobs, not args.no_baseline,
                                         hints=hints, equivalents=equivalents)
            results += [MutantResult(m.name, m.file, m.spec, "BROKEN", broken[m.name], 0.0, m.expect)
                        for m in entries if m.name in broken]
            n_c = sum(r.status in ("CAUGHT", "TIMEOUT") for r in results)
            n_s = sum(r.status == "SURVIVED" for r in results)
            print(f"catalogue: {len(results)} entries, {n_c} caught, {n_s} survived, "
                  f"{len(results) - n_c - n_s} other ({time.monotonic() - t0:.0f} s)")
        if not args.catalogue_only and not args.only:
            if args.from_mutants:
                report = read_mutants_dir(args.from_mutants)
            elif scopes:
                try:
                    report, red_mm = run_mutmut(scopes, args.fast, root, args.jobs)
                    red = red + [t for t in red_mm if t not in red]
                except (RuntimeError, subprocess.TimeoutExpired) as err:
                    infra = f"mutmut did not complete: {err}"
                    print(infra)
            if report is not None:
                print_mutmut(report, equivalents)
    finally:
        _cleanup()

    verdict = gate(results, report, equivalents, args.threshold, red, args.allow_red)
    if infra:
        verdict = Verdict(False, verdict.reasons + [infra])
    seconds = time.monotonic() - t0
    shown = list(argv if argv is not None else sys.argv[1:])
    for opt in ("--json", "--docs"):  # where the output went is not part of what ran
        if opt in shown and shown.index(opt) + 1 < len(shown):
            i = shown.index(opt)
            del shown[i: i + 2]
    command = "python -m raggedspec.mutation.runner " + " ".join(shown)
    when = time.strftime("%Y-%m-%d")
    full_run = not args.fast and not args.only and not args.from_mutants
    checkout = (root / "raggedspec").is_dir()  # not an installed package: docs/ is the repo's
    docs = args.docs or (root / "docs" / "mutation.md" if full_run and checkout and not args.no_docs else None)
    if docs is not None and not args.no_docs:
        write_docs(docs, results, report, equivalents, command.strip(), seconds, when)
        print(f"wrote {docs}")
        if results and docs == root / "docs" / "mutation.md":
            save_killers(results)
    if args.json:
        from raggedspec.outputs import write_text_atomic

        write_text_atomic(args.json, json.dumps({
            "ok": verdict.ok, "reasons": verdict.reasons, "seconds": seconds, "baseline_red": red,
            "catalogue": [asdict(r) for r in results or []],
            "mutmut": None if report is None else {"stats": report.stats, "score": report.score,
                                                   "rows": [asdict(r) for r in report.rows],
                                                   "survivors": report.survivors},
        }, indent=2))
    print(f"mutation gate: {'PASS' if verdict.ok else 'FAIL'} ({seconds:.0f} s)")
    for r in verdict.reasons:
        print(f"  - {r}")
    return 0 if verdict.ok else (2 if infra else 1)


if __name__ == "__main__":
    sys.exit(main())
