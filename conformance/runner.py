"""`raggedspec conformance`: run the conformance suite against a backend and print a per-rule
table (rule, examples run, result).

    raggedspec conformance [--backend numpy|torch|cupy|package.module:factory]
                           [--device cpu|cuda|cuda:N] [--dtype float64|float32|bfloat16]
                           [--profile ci|dev|thorough|mutmut] [--tests PATH ...] [-k EXPR]

(or `python -m raggedspec.conformance.runner ...`). The backend is selected for the tests through
the
environment (`RAGGEDSPEC_BACKEND`, `RAGGEDSPEC_DEVICE`, `RAGGEDSPEC_DTYPE`: see
`conformance/backends.py`) and the Hypothesis profile through `HYPOTHESIS_PROFILE` and
`--hypothesis-profile`; the suite runs in this process with `pytest.main`, and a small
plugin records each test's outcome and, for Hypothesis tests, the examples it ran (from
Hypothesis's own statistics). Tests map to rules through the tables of docs/rules.md
(`| rule | function | tests | invariant |`); a test named by no row
is listed under "(no rule row) FILE".

Exit code: 0 all passed, 1 some failed (pytest's); 2 for bad usage, a missing --tests path,
a selection that matches no test, an unknown or unloadable backend, or a device the backend
cannot use (e.g. `--device cuda` without CUDA); 3 pytest's own internal error.
"""

from __future__ import annotations

import argparse
import importlib.resources
import contextlib
import os
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SUITE = Path(__file__).resolve().parent
PROFILES = ("ci", "dev", "short", "thorough", "mutmut", "explore")
DTYPES = ("float64", "float32", "bfloat16")
EXIT_USAGE = 2
EMPTY_SELECTION = 5  # pytest's exit code when nothing was collected
EXIT_CODES_TEXT = (
    "Exit codes: 0 every selected test passed; 1 some failed (their rule rows say "
    "FAIL); 2 bad input: an unknown backend, an unavailable device, a missing --tests "
    "path or a selection matching no test; 3 an internal error of pytest or raggedspec."
)
_TEST_REF = re.compile(r"(conformance/[\w/]+\.py)::([\w:]+)")
# "60 passing examples, 0 failing examples" (Hypothesis <= 6.15x) or "60 passing, 0 failing,
# and 2 invalid test cases" (newer): accept both wordings.
_STATS = re.compile(r"during (\w+) phase.*?(\d+) passing(?: examples)?, (\d+) failing", re.S)


# ----------------------------------------------------------------------------- parser


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--backend",
        default="torch",
        help="backend under test: numpy (the reference itself), torch (the gpu/ port; default), "
        "cupy (the torch port with the hand-written kernels; CUDA only), "
        "or package.module:factory (your own port, docs/conformance.md)",
    )
    p.add_argument(
        "--device",
        default=None,
        help="device for the backend: cpu, cuda, cuda:N (default: the backend's own: cpu for "
        "numpy and torch unless RAGGEDSPEC_DEVICE says otherwise, cuda for cupy)",
    )
    p.add_argument(
        "--dtype",
        default="float64",
        choices=DTYPES,
        help="float dtype of the backend (default float64)",
    )
    p.add_argument(
        "--profile",
        choices=PROFILES,
        default=None,
        help="Hypothesis profile, every one but explore derandomized (the same examples every "
        "run): ci (200 examples; default when CI is set), dev (100; default otherwise), short "
        "(20), thorough (2000), mutmut (60, no shrinking), explore (500 fresh random examples "
        "each run)",
    )
    p.add_argument(
        "--tests",
        nargs="+",
        default=None,
        metavar="PATH",
        help="test files or folders to run (default: the whole conformance suite)",
    )
    p.add_argument("-k", dest="keyword", default=None, metavar="EXPR", help="pytest -k selection")
    p.add_argument("-x", "--exitfirst", action="store_true", help="stop at the first failure")


def add_parser(sub) -> argparse.ArgumentParser:
    """The `conformance` subcommand for `raggedspec.cli` (COMMANDS entry)."""
    p = sub.add_parser(
        "conformance",
        help="run the conformance suite against a backend; print a per-rule table",
        description="Run the conformance suite (reference properties, reference-vs-backend "
        "per-method properties and end-to-end runs compared tensor for tensor) against a backend, "
        "and "
        "print one line per rule of docs/rules.md: the rule, the examples its tests ran, "
        "and the result.",
        epilog=EXIT_CODES_TEXT,
    )
    add_arguments(p)
    return p


# ----------------------------------------------------------------------------- rules


def rule_rows(table: str | None = None) -> list[tuple[str, list[str]]]:
    """`(rule, [test node ids])` for every table row of docs/rules.md (`table`: its text; by
    default the copy shipped in the package, `raggedspec.docs`), a rule listed twice reported
    once."""
    if table is None:
        table = (importlib.resources.files("raggedspec.docs") / "rules.md").read_text()
    rows, seen = [], set()
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if (
            not line.startswith("|")
            or len(cells) != 4
            or set(cells[0]) <= set("-: ")
            or cells[0] == "rule"
        ):
            continue
        if cells[1].lower().startswith("not modelled"):
            continue
        tests = [f"{f}::{n}" for f, n in _TEST_REF.findall(cells[2])]
        key = (cells[0], tuple(tests))
        if tests and key not in seen:
            seen.add(key)
            rows.append((cells[0], tests))
    return rows


def _examples(stats: str | None) -> int | None:
    """Examples a Hypothesis test ran (passing + failing, every phase but shrink)."""
    if not stats:
        return None
    return sum(int(p) + int(f) for phase, p, f in _STATS.findall(stats) if phase != "shrink")


_BLAME = re.compile(r"\[first differing tensor; rule: ([^\]]+)\]")
E2E_FILE = "conformance/test_end_to_end.py"


class Collector:
    """pytest plugin: per test node id, its outcome ("passed", "failed", "skipped"), the
    examples it ran (1 for a plain test) and, for an end-to-end failure, the rule its first
    differing tensor belongs to (`blame`, from the Mismatch message) and that message."""

    def __init__(self) -> None:
        self.results: dict[str, dict] = {}

    def pytest_runtest_logreport(self, report) -> None:
        rec = self.results.setdefault(report.nodeid, {"outcome": "passed", "examples": 0})
        if report.failed:
            rec["outcome"] = "failed"
            text = str(report.longrepr)
            lines = [ln for ln in text.splitlines() if ln.startswith("E ") and _BLAME.search(ln)]
            if lines and "blame" not in rec:  # the raised message ("E   Mismatch: ..."), not source
                rec["blame"] = _BLAME.search(lines[-1]).group(1).strip()
                rec["message"] = lines[-1].removeprefix("E").strip()
        elif report.skipped and rec["outcome"] != "failed":
            rec["outcome"] = "skipped"

    def pytest_runtest_teardown(self, item) -> None:
        rec = self.results.setdefault(item.nodeid, {"outcome": "passed", "examples": 0})
        n = _examples(getattr(item, "hypothesis_statistics", None))
        rec["examples"] = 1 if n is None else n


def _base(nodeid: str) -> str:
    """`file::test` of a node id (parameters dropped, path relative to the repo root)."""
    nodeid = nodeid.split("[", 1)[0]
    file, _, name = nodeid.partition("::")
    path = Path(file)
    if path.is_absolute():
        with contextlib.suppress(ValueError):  # a path outside the checkout stays as it is
            file = path.relative_to(ROOT).as_posix()
    return f"{file}::{name}"


def rule_table(
    results: dict[str, dict], rows: list[tuple[str, list[str]]]
) -> list[tuple[str, int, str]]:
    """`(rule, examples, result)`: result "pass" (every test of the rule that ran passed),
    "FAIL", "skipped", or "not run"; then the tests no row names, per file. A row fails
    when one of its own tests failed (a row listing per-method tests and end-to-end tests
    owns the per-method ones), or when an end-to-end failure's first differing tensor
    belongs to its rule (`conformance.backends.rule_of`); an end-to-end failure without
    such a tensor fails every row listing it."""
    by_test: dict[str, list[dict]] = {}
    for nodeid, rec in results.items():
        by_test.setdefault(_base(nodeid), []).append(rec)

    blamed = {rec["blame"] for recs in by_test.values() for rec in recs if rec.get("blame")}

    def summarize(rule, tests):
        recs = [r for t in tests for r in by_test.get(t, [])]
        if not recs:
            return 0, "not run"
        examples = sum(r["examples"] for r in recs)
        own = [t for t in tests if not t.startswith(E2E_FILE + "::")] or tests
        own_recs = [r for t in own for r in by_test.get(t, [])]
        shared = [r for t in tests if t not in own for r in by_test.get(t, [])]
        # an end-to-end failure marks its own rows and the rule its first differing tensor
        # belongs to, not every row that lists the end-to-end test
        failed = (
            any(r["outcome"] == "failed" for r in own_recs)
            or any(rule.startswith(b) for b in blamed)
            or any(r["outcome"] == "failed" and not r.get("blame") for r in shared)
        )
        if failed:
            return examples, "FAIL"
        if {r["outcome"] for r in recs} == {"skipped"}:
            return examples, "skipped"
        return examples, "pass"

    table = [(rule, *summarize(rule, tests)) for rule, tests in rows]
    named = {t for _, tests in rows for t in tests}
    unnamed: dict[str, list[str]] = {}
    for test in by_test:
        if test not in named:
            unnamed.setdefault(test.split("::")[0], []).append(test)
    for file in sorted(unnamed):
        table.append((f"(no rule row) {file}", *summarize(f"(no rule row) {file}", unnamed[file])))
    return table


def format_table(table: list[tuple[str, int, str]], title: str, hide_not_run: bool = False) -> str:
    """The table as text; `hide_not_run` leaves out the rows none of whose tests ran (a
    selection with --tests or -k), counting them in the last line."""
    shown = [row for row in table if not (hide_not_run and row[2] == "not run")]
    width = min(max((len(r) for r, _, _ in shown), default=4), 110)
    lines = [
        title,
        f"{'rule':<{width}}  {'examples':>8}  result",
        f"{'-' * width}  {'-' * 8}  ------",
    ]
    for rule, examples, result in shown:
        lines.append(f"{rule:<{width}}  {examples:>8}  {result}")
    counts = {
        k: sum(1 for *_, r in table if r == k) for k in ("pass", "FAIL", "skipped", "not run")
    }
    lines.append(
        f"{len(table)} rows: {counts['pass']} pass, {counts['FAIL']} FAIL, "
        f"{counts['skipped']} skipped, {counts['not run']} not run"
        f"{' (not shown)' if hide_not_run and counts['not run'] else ''}; "
        f"{sum(e for _, e, _ in table)} examples"
    )
    return "\n".join(lines)


# ----------------------------------------------------------------------------- run


def run(args) -> int:
    """Run the suite as `args` say (an argparse namespace of `add_arguments`)."""
    import pytest

    from raggedspec.reference.backend import load_backend

    profile = args.profile or ("ci" if os.environ.get("CI") else "dev")
    try:
        backend = load_backend(args.backend, args.device, args.dtype)
    except Exception as exc:  # noqa: BLE001 (a user factory may raise anything: report it, exit 2)
        print(
            f"raggedspec conformance: error: backend {args.backend!r} on device {args.device!r} in "
            f"{args.dtype}: {exc}",
            file=sys.stderr,
        )
        return EXIT_USAGE
    env = {
        "RAGGEDSPEC_BACKEND": args.backend,
        "RAGGEDSPEC_DEVICE": str(backend.device),
        "RAGGEDSPEC_DTYPE": args.dtype,
        "HYPOTHESIS_PROFILE": profile,
    }
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    for t in args.tests or []:
        if not Path(t.split("::")[0]).exists():
            print(
                f"raggedspec conformance: error: --tests {t}: no such file or folder",
                file=sys.stderr,
            )
            return EXIT_USAGE
    import raggedspec.conformance.conftest  # noqa: F401 - registers the Hypothesis profiles for any --tests path

    tests = [t if "::" in t else str(Path(t)) for t in args.tests or []] or [str(SUITE)]
    pytest_args = tests + [
        "-q",
        "-p",
        "no:cacheprovider",
        f"--hypothesis-profile={profile}",
        "-rfE",
        # node ids relative to the folder holding conformance/ (the checkout, or the installed
        # raggedspec package), the form the rule table names them in
        f"--rootdir={ROOT}",
    ]
    if args.keyword:
        pytest_args += ["-k", args.keyword]
    if args.exitfirst:
        pytest_args.append("-x")
    collector = Collector()
    try:
        rc = int(pytest.main(pytest_args, plugins=[collector]))
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    title = (
        f"\nraggedspec conformance: backend {backend.name} ({backend.device}, {backend.dtype}), "
        f"profile {profile}, pytest exit {rc}"
    )
    if rc == EMPTY_SELECTION or not collector.results:
        what = f"-k {args.keyword!r} in " if args.keyword else ""
        print(
            f"raggedspec conformance: error: {what}{' '.join(tests)}: no test selected "
            f"(pytest exit {rc}); check the -k expression and the --tests paths",
            file=sys.stderr,
        )
        return EXIT_USAGE
    print(
        format_table(
            rule_table(collector.results, rule_rows()),
            title,
            hide_not_run=bool(args.tests or args.keyword),
        )
    )
    for nodeid, rec in collector.results.items():
        if rec.get("blame"):
            print(
                f"end to end: {nodeid}: first differing tensor belongs to rule "
                f'"{rec["blame"]}": {rec["message"][:300]}'
            )
    return rc


def main(argv: list[str] | None = None) -> int:
    """`raggedspec conformance` as a function: returns the exit code."""
    parser = argparse.ArgumentParser(
        prog="raggedspec conformance", description=__doc__.split("\n\n")[0], epilog=EXIT_CODES_TEXT
    )
    add_arguments(parser)
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:
        return int(exc.code or 0)
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
