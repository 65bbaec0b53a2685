"""The named catalogue: one small semantic mutation per bug class, each with the tests that must
catch it (`mutation/catalogue.toml`, read as data).

An entry replaces `old` by `new` in one file of the package (`old` must occur there exactly
once, else the entry is *stale* and says so). It is *caught* only when a test fails: the runner
writes the mutation into a private copy of the package, runs the entry's named test files with
`-x` and, if none fails, the rest of the default suite; a mutation that breaks collection or
import is an *error*, a run past the time limit a *timeout*, never a catch. Nothing is matched
against the tests' text and nothing is recorded between runs. Each run forks a fresh child from
a parent that has imported pytest, NumPy, Hypothesis and torch once, so a mutant costs its
tests only; `jobs` copies run side by side. docs/mutation.md describes the fields and the gate.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import sys
import tempfile
import time
import tomllib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import raggedspec

PACKAGE = Path(raggedspec.__file__).parent  # the package folder, links followed when copied
CATALOGUE = PACKAGE / "mutation" / "catalogue.toml"
TIME_LIMIT = 300.0  # seconds one run of an entry's tests may take
PYTEST_ARGS = ["-q", "-p", "no:cacheprovider", "--hypothesis-profile=mutmut",
               "-m", "not slow", "-W", "ignore::pytest.PytestUnknownMarkWarning"]


@dataclass(frozen=True)
class Entry:
    """One bug class: `new` in place of `old` in `file` (a path inside the package)."""

    name: str
    spec: str
    file: str
    old: str
    new: str
    tests: tuple[str, ...]
    expect: str = "caught"  # "survive": a documented equivalent (it must not be caught)


@dataclass
class Result:
    entry: Entry
    status: str  # caught | survived | stale | error | timeout
    detail: str = ""  # the first failing test, or what went wrong
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.status == ("survived" if self.entry.expect == "survive" else "caught")


class CatalogueError(ValueError):
    """A malformed catalogue file: the message names the entry and the field."""


FIELDS = {"name": str, "spec": str, "file": str, "old": str, "new": str, "tests": list}


def _entry(i: int, raw: dict) -> Entry:
    """One `[[entry]]` table checked field by field."""
    where = f"entry {i + 1} ({raw.get('name', 'no name')!r})"
    for key, kind in FIELDS.items():
        if not isinstance(raw.get(key), kind):
            raise CatalogueError(f"{where}: field {key!r} must be a {kind.__name__}")
    unknown = set(raw) - set(FIELDS) - {"expect"}
    if unknown or raw.get("expect", "caught") not in ("caught", "survive"):
        raise CatalogueError(f"{where}: unknown fields {sorted(unknown)} or expect "
                             f"{raw.get('expect')!r} (caught | survive)")
    return Entry(raw["name"], raw["spec"], raw["file"], raw["old"], raw["new"],
                 tuple(raw["tests"]), raw.get("expect", "caught"))


def load(path: Path = CATALOGUE) -> list[Entry]:
    """The entries of a catalogue file, in order; names are unique."""
    entries = [_entry(i, raw) for i, raw in enumerate(tomllib.loads(path.read_text())["entry"])]
    names = [e.name for e in entries]
    if len(set(names)) != len(names):
        raise CatalogueError(f"{path}: entry names repeat: "
                             f"{sorted({n for n in names if names.count(n) > 1})}")
    return entries


def select(entries: list[Entry], only: str | None) -> list[Entry]:
    """The entries whose name contains `only` (case-insensitive); all of them for None."""
    return [e for e in entries if not only or only.lower() in e.name.lower()]


def mutated(entry: Entry, source: str) -> str:
    """`source` with the entry applied; ValueError when `old` does not occur exactly once."""
    count = source.count(entry.old)
    if count != 1:
        raise ValueError(f"its `old` text occurs {count} times in {entry.file} (must be once): "
                         "update the entry to today's source")
    return source.replace(entry.old, entry.new)


def test_files(entry: Entry, tree: Path) -> list[str]:
    """The entry's named test files that exist in `tree` (`dispatch` -> the package's
    conformance/test_dispatch.py), as paths relative to `tree`'s parent."""
    found = [tree / "conformance" / f"test_{t}.py" for t in entry.tests]
    return [p.relative_to(tree.parent).as_posix() for p in found if p.is_file()]


# ----------------------------------------------------------------------------- running


def _preload() -> None:
    """Import what every test run needs, once, before the children fork."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    for name in ("pytest", "numpy", "hypothesis", "torch"):
        if importlib.util.find_spec(name):
            __import__(name)


def _copy_package(dest: Path) -> Path:
    """A private copy of the package (links followed) under `dest`; returns its folder."""
    tree = dest / "raggedspec"
    shutil.copytree(PACKAGE, tree, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    return tree


class _Failures:
    """pytest plugin: the node ids of the failed tests, in order."""

    def __init__(self) -> None:
        self.nodeids: list[str] = []

    def pytest_runtest_logreport(self, report) -> None:
        if report.failed and report.nodeid not in self.nodeids:
            self.nodeids.append(report.nodeid)


def _child(tree: Path, args: list[str], out: Path) -> None:
    """In the forked child: import the package from `tree` only, run pytest, write the
    outcome to `out` and exit."""
    for name in [m for m in sys.modules if m == "raggedspec" or m.startswith("raggedspec.")]:
        del sys.modules[name]
    sys.dont_write_bytecode = True
    sys.path.insert(0, str(tree.parent))
    os.environ.update(PYTHONPATH=str(tree.parent), PYTHONDONTWRITEBYTECODE="1",
                      CUDA_VISIBLE_DEVICES="")
    os.chdir(tree.parent)
    log = os.open(tree.parent / "log.txt", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    import pytest

    failures = _Failures()
    xdist = ["-p", "no:xdist"] if importlib.util.find_spec("xdist") else []
    code = int(pytest.main([*args, *PYTEST_ARGS, *xdist, f"--rootdir={tree.parent}"],
                           plugins=[failures]))
    out.write_text(json.dumps({"code": code, "first": (failures.nodeids or [""])[0],
                               "failed": failures.nodeids}))
    os._exit(0)


def _log_tail(tree: Path, lines: int = 15) -> str:
    log = tree.parent / "log.txt"
    text = log.read_text(errors="replace").splitlines()[-lines:] if log.is_file() else []
    return "\n".join("    | " + ln for ln in text)


def _verdict(outcome: dict | None, timed_out: bool) -> tuple[str, str]:
    """(status, detail) from a child's outcome: pytest's exit 1 with a failed test is a catch,
    exit 0 a survival, anything else an error (a mutant that breaks collection is no catch)."""
    if timed_out:
        return "timeout", f"its tests ran past {TIME_LIMIT:.0f} s"
    if outcome is None:
        return "error", "the test run died without a result"
    if outcome["code"] == 1 and outcome["first"]:
        return "caught", outcome["first"]
    if outcome["code"] in (0, 5):
        return "survived", ""
    return "error", f"pytest exit {outcome['code']} (collection or import broke)"


@dataclass
class _Slot:
    tree: Path
    entry: Entry | None = None
    pid: int = 0
    started: float = 0.0
    original: str = ""


def _start(slot: _Slot, entry: Entry | None, args: list[str]) -> None:
    """Write the mutation (none for `entry` None) into the slot's copy and fork the child that
    runs `args`."""
    slot.entry, slot.started = entry, time.monotonic()
    if entry is not None:
        target = slot.tree / entry.file
        slot.original = target.read_text()
        target.write_text(mutated(entry, slot.original))
    out = slot.tree.parent / "outcome.json"
    out.unlink(missing_ok=True)
    slot.pid = os.fork()
    if slot.pid == 0:
        try:
            os.setpgid(0, 0)  # its own group: a timeout takes any subprocess of a test along
            _child(slot.tree, args, out)
        finally:
            os._exit(3)


def _ended(slot: _Slot) -> bool | None:
    """None while the slot's child runs; else whether it was stopped at the time limit."""
    if time.monotonic() - slot.started > TIME_LIMIT:
        os.killpg(slot.pid, signal.SIGKILL)
        os.waitpid(slot.pid, 0)
        return True
    pid, _ = os.waitpid(slot.pid, os.WNOHANG)
    return False if pid else None


def _end(slot: _Slot) -> dict | None:
    """Restore the slot's file and read its child's outcome."""
    if slot.entry is not None:
        (slot.tree / slot.entry.file).write_text(slot.original)
    out = slot.tree.parent / "outcome.json"
    slot.entry, slot.pid = None, 0
    return json.loads(out.read_text()) if out.is_file() else None


def _stop(slots: list[_Slot]) -> None:
    """Kill the children still running (an interrupt); their copies go with the temp dir."""
    for slot in slots:
        if slot.pid:
            os.killpg(slot.pid, signal.SIGKILL)
            os.waitpid(slot.pid, 0)
            slot.pid = 0


Job = tuple  # (key, entry or None, pytest args)


def _run_all(slots: list[_Slot], jobs: list[Job]) -> dict:
    """Run every job in the free slots; {key: (outcome, timed_out, seconds, detail)}."""
    queue, done, keys = list(jobs), {}, {}
    try:
        while queue or any(s.pid for s in slots):
            for slot in slots:
                if not slot.pid and queue:
                    key, entry, args = queue.pop(0)
                    keys[id(slot)] = key
                    _start(slot, entry, args)
            time.sleep(0.05)
            for slot in [s for s in slots if s.pid]:
                timed_out = _ended(slot)
                if timed_out is not None:
                    seconds = time.monotonic() - slot.started
                    outcome = _end(slot)
                    done[keys[id(slot)]] = (outcome, timed_out, seconds, _log_tail(slot.tree))
    except BaseException:
        _stop(slots)
        raise
    return done


def _args(files: list[str], red: set[str]) -> list[str]:
    """pytest arguments for an entry's run: its files, stop at the first failure, and leave out
    the tests that fail without any mutation."""
    return [*files, "-x", *(a for t in sorted(red) for a in ("--deselect", t))]


def _red_tests(slots: list[_Slot], tests: set[str]) -> set[str]:
    """Of `tests`, those that fail on the unmutated copy (a catch by one of them means
    nothing)."""
    if not tests:
        return set()
    (outcome, _, _, _), = _run_all(slots[:1], [("baseline", None, sorted(tests))]).values()
    return set(outcome["failed"]) if outcome else set(tests)


def run(entries: list[Entry], jobs: int = 2, report: Callable[[Result], None] = lambda r: None,
        fallback: list[str] | None = None) -> list[Result]:
    """Run `entries` (each: its named tests, then, if it survived them and is not a documented
    equivalent, the `fallback` tests: by default the rest of the default suite), `jobs` at a
    time; `report` sees each final result. A catch counts only if the catching test passes
    without the mutation (checked once per test; an entry caught by a test that fails anyway
    runs again without that test). Stale entries are not run."""
    _preload()
    results: dict[str, Result] = {}
    stage: dict[str, str] = {}
    for e in entries:
        try:
            mutated(e, (PACKAGE / e.file).read_text())
            stage[e.name] = "named"
        except (ValueError, OSError) as exc:
            results[e.name] = Result(e, "stale", str(exc))
            report(results[e.name])
    by_name = {e.name: e for e in entries}
    seconds = dict.fromkeys(stage, 0.0)
    red: set[str] = set()
    verified: set[str] = set()
    with tempfile.TemporaryDirectory(prefix="raggedspec-catalogue-") as tmp:
        slots = [_Slot(_copy_package(Path(tmp) / str(i))) for i in range(max(1, jobs))]
        tree = slots[0].tree
        suite = fallback or [(tree / "conformance").relative_to(tree.parent).as_posix()]
        for name in [n for n in stage if not test_files(by_name[n], tree)]:
            stage[name] = "suite"
        while stage:
            files = {n: test_files(by_name[n], tree) if s == "named" else suite
                     for n, s in stage.items()}
            done = _run_all(slots, [(n, by_name[n], _args(files[n], red)) for n in stage])
            verdicts = {}
            for name, (outcome, timed_out, secs, log) in done.items():
                seconds[name] += secs
                status, detail = _verdict(outcome, timed_out)
                verdicts[name] = (status, detail + ("\n" + log if status == "error" else ""))
            catchers = {d for s, d in verdicts.values() if s == "caught"} - verified
            red |= _red_tests(slots, catchers)
            verified |= catchers
            for name, (status, detail) in verdicts.items():
                if status == "caught" and detail in red:
                    continue  # again, without the test that fails anyway
                if status == "survived" and stage[name] == "named" and \
                        by_name[name].expect == "caught":
                    stage[name] = "suite"  # a documented equivalent's proof is its named tests
                    continue
                del stage[name]
                shown = detail or ("no test of the suite failed" if status == "survived" else "")
                results[name] = Result(by_name[name], status, shown, seconds[name])
                report(results[name])
    return [results[e.name] for e in entries]
