"""`raggedspec conformance`: run the conformance suite against a backend and print a per-rule
table (rule, examples run, result).

Usage `raggedspec conformance [--backend numpy|torch|cupy|package.module:factory] [--device
...] [--dtype ...] [--profile ...] [--tests PATH ...] [-k EXPR] [PYTEST OPTION ...]`: any
option it does not know goes to pytest (`-n 4`, `--lf`, `-v`, `--junitxml=PATH`). Each test
names the rules it pins with `@pytest.mark.rule(...)` (docs/rules.md's row names); this
module is also the pytest plugin that carries them on each report (so they reach the table
from pytest-xdist's workers too). Exit 0 all passed, 1 some failed or the backend factory
raised, 2 bad usage or an unusable backend, 3 pytest's internal error. Options, the environment
it sets, how examples are counted and every exit code: docs/conformance.md, section
"conformance/runner.py".
"""

from __future__ import annotations

import argparse
import importlib.resources
import os
import re
import sys
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SUITE = Path(__file__).resolve().parent
PROFILES = ("ci", "dev", "short", "thorough", "mutmut", "explore")
DTYPES = ("float64", "float32", "bfloat16")
EXIT_USAGE = 2
EMPTY_SELECTION = 5  # pytest's exit code when nothing was collected
PYTEST_USAGE_ERROR = 4  # pytest's exit code for options it refuses (ours for that is 2)
EXIT_CODES_TEXT = (
    "Exit codes: 0 every selected test passed; 1 some failed (their rule rows say "
    "FAIL), or your backend factory raised (its traceback is printed); 2 bad input: an unknown "
    "backend, an unavailable device, a missing --tests path, a selection matching no test, or "
    "pytest not installed; 3 an internal error of pytest or raggedspec. Options it does not "
    "know go to pytest (-n 4, --lf, -v, --junitxml=PATH, ...)."
)
# pytest's options that need its cache (`-p no:cacheprovider` is dropped for them)
CACHE_OPTIONS = ("--lf", "--last-failed", "--ff", "--failed-first", "--nf", "--new-first",
                 "--sw", "--stepwise", "--sw-skip", "--stepwise-skip", "--lfnf",
                 "--last-failed-no-failures", "--cache-show", "--cache-clear")
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
    p.add_argument("-k", dest="keyword", default=None, metavar="EXPR",
                   help="pytest -k selection; one that matches no test is reported before the "
                        "suite is imported for the run")
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


def marker_name(row: str) -> str:
    """The marker name of a docs/rules.md row: its first cell without backticks and without a
    trailing parenthesised spec reference ("`front_pad_single` (C §4.1)" -> "front_pad_single")."""
    return re.sub(r"\s*\([^()]*\)\s*$", "", row.replace("`", "")).strip()


def table_rows(table: str | None = None) -> list[tuple[str, str, str]]:
    """`(rule, function, invariant)` for every row of docs/rules.md's tables (`table`: its text;
    by default the copy shipped in the package, `raggedspec.docs`)."""
    if table is None:
        table = (importlib.resources.files("raggedspec.docs") / "rules.md").read_text()
    rows = []
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and len(cells) == 3 and cells[0] != "rule" \
                and not set(cells[0]) <= set("-: "):
            rows.append((cells[0], cells[1], cells[2]))
    return rows


def rule_names(table: str | None = None) -> list[str]:
    """The marker names of the modelled rows (a row whose function reads "not modelled" has no
    test), in table order."""
    return [marker_name(rule) for rule, function, _ in table_rows(table)
            if not function.lower().startswith("not modelled")]


def rules_of(item) -> list[str]:
    """The rule names a collected test carries (`@pytest.mark.rule(...)`, its class's and its
    module's `pytestmark` included), in order, each once."""
    names: list[str] = []
    for mark in item.iter_markers("rule"):
        names += [n for n in mark.args if n not in names]
    return names


def _examples(stats: str | None) -> int | None:
    """Examples a Hypothesis test ran (passing + failing, every phase but shrink)."""
    if not stats:
        return None
    return sum(int(p) + int(f) for phase, p, f in _STATS.findall(stats) if phase != "shrink")


_BLAME = re.compile(r"\[first differing tensor; rule: ([^\]]+)\]")
# conftest records every collected test's rules here before any deselection
RULE_MARKS = pytest.StashKey[dict]() if (pytest := sys.modules.get("pytest")) else None
E2E_RULE = "end to end: the same scenario on two backends"
NO_RULE = "(no rule marker)"


def pytest_collection_modifyitems(items) -> None:
    """Plugin hook (this module is passed to pytest with `-p`, so it runs in pytest-xdist's
    workers too): each test's report carries the rules it pins (`user_properties`)."""
    for item in items:
        item.user_properties.append(("rules", rules_of(item)))


def pytest_runtest_teardown(item) -> None:
    """Plugin hook: the teardown report carries the examples the test ran."""
    n = _examples(getattr(item, "hypothesis_statistics", None))
    item.user_properties.append(("examples", 1 if n is None else n))


class Collector:
    """pytest plugin: per test node id, the rules it carries, its outcome ("passed", "failed",
    "skipped"), the examples it ran (1 for a plain test) and, for an end-to-end failure, the
    rule its first differing tensor belongs to (`blame`, from the Mismatch message) and that
    message. Read from the reports alone (`user_properties`), so it works under xdist."""

    def __init__(self) -> None:
        self.results: dict[str, dict] = {}

    def pytest_runtest_logreport(self, report) -> None:
        rec = self.results.setdefault(report.nodeid,
                                      {"outcome": "passed", "examples": 0, "rules": []})
        props = dict(report.user_properties)
        rec["rules"] = props.get("rules", rec["rules"])
        rec["examples"] = props.get("examples", rec["examples"])
        if report.failed:
            rec["outcome"] = "failed"
            text = str(report.longrepr)
            lines = [ln for ln in text.splitlines() if ln.startswith("E ") and _BLAME.search(ln)]
            if lines and "blame" not in rec:  # the raised message ("E   Mismatch: ..."), not source
                rec["blame"] = _BLAME.search(lines[-1]).group(1).strip()
                rec["message"] = lines[-1].removeprefix("E").strip()
        elif report.skipped and rec["outcome"] != "failed":
            rec["outcome"] = "skipped"


def rule_table(results: dict[str, dict], rules: list[str]) -> list[tuple[str, int, str]]:
    """`(rule, examples, result)` per rule of `rules` (then any rule a test names that the table
    lacks, and the tests with no rule marker): "pass" (every test carrying it that ran passed),
    "FAIL", "skipped" or "not run". A failed test fails every rule it carries and, for an
    end-to-end failure, the rule its first differing tensor belongs to (`blame`), so a port bug
    is named by its rule while the end-to-end rows say a run differed."""
    recs: dict[str, list[dict]] = {}
    failed: set[str] = set()
    for rec in results.values():
        carried = rec.get("rules") or [NO_RULE]
        for rule in carried:
            recs.setdefault(rule, []).append(rec)
        if rec["outcome"] == "failed":
            failed |= set(carried) | ({rec["blame"]} if rec.get("blame") else set())
    extra = sorted(r for r in recs if r not in rules)

    def summarize(rule: str) -> tuple[str, int, str]:
        mine = recs.get(rule, [])
        examples = sum(r["examples"] for r in mine)
        if rule in failed:
            return rule, examples, "FAIL"
        if not mine:
            return rule, 0, "not run"
        if {r["outcome"] for r in mine} == {"skipped"}:
            return rule, examples, "skipped"
        return rule, examples, "pass"

    return [summarize(rule) for rule in list(rules) + extra]


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


def _backend(args):
    """The backend under test, or the exit code when it cannot be had: 2 (a message) for an
    unusable name or device, 1 (its traceback) when the user's factory raised."""
    from raggedspec.exits import report_plugin_failure
    from raggedspec.reference.backend import load_backend

    try:
        return load_backend(args.backend, args.device, args.dtype)
    except Exception as exc:  # noqa: BLE001 (a user factory may raise anything: report it)
        if report_plugin_failure("conformance", exc):
            return 1
        print(f"raggedspec conformance: error: backend {args.backend!r} on device "
              f"{args.device!r} in {args.dtype}: {exc}", file=sys.stderr)
        return EXIT_USAGE


def build_pytest_args(args, profile: str, tests: list[str]) -> list[str]:
    """pytest's command line: the tests, `-q` (unless the user chose a verbosity), the
    profile, this module as the plugin that carries the rules, `-k` / `-x`, then every option
    given for pytest itself (`args.pytest_args`); pytest's cache is off unless one of those
    options needs it."""
    extra = list(getattr(args, "pytest_args", None) or [])
    wants_cache = any(a.split("=")[0] in CACHE_OPTIONS for a in extra)
    quiet = [] if any(a.startswith(("-v", "-q", "--verbose", "--quiet")) for a in extra) else ["-q"]
    out = tests + quiet + [f"--hypothesis-profile={profile}", "-rfE",
                   "-p", "raggedspec.conformance.runner",
                   # node ids relative to the folder holding conformance/ (the checkout, or the
                   # installed raggedspec package), the form the rule table names them in
                   f"--rootdir={ROOT}"]
    out += ["-o", f"cache_dir={cache_dir()}"] if wants_cache else ["-p", "no:cacheprovider"]
    if args.keyword:
        out += ["-k", args.keyword]
    if args.exitfirst:
        out.append("-x")
    return out + extra


def cache_dir() -> Path:
    """pytest's cache for `--lf` and the like: in the user's cache folder, not the package."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "raggedspec" / "pytest"


def selects_nothing(tests: list[str], keyword: str, profile: str) -> bool:
    """True when `-k keyword` selects no test of `tests`: a collection alone, in a child
    process with plain asserts (no assertion rewriting, the bulk of a first collection)."""
    import subprocess

    cmd = [sys.executable, "-m", "pytest", "--co", "-q", "--assert=plain", "-p",
           "no:cacheprovider", f"--hypothesis-profile={profile}", f"--rootdir={ROOT}",
           "-k", keyword, *tests]
    done = subprocess.run(cmd, capture_output=True, text=True, env=os.environ.copy())
    return done.returncode == EMPTY_SELECTION


def no_selection(args, tests: list[str], rc: int | None = None) -> int:
    """Exit 2 with the message for a selection matching no test."""
    what = f"-k {args.keyword!r} in " if args.keyword else ""
    code = "" if rc is None else f" (pytest exit {rc})"
    print(f"raggedspec conformance: error: {what}{' '.join(tests)}: no test selected{code}; "
          "check the -k expression and the --tests paths", file=sys.stderr)
    return EXIT_USAGE


def missing_tests(args) -> str | None:
    """The first --tests path that does not exist, or None."""
    return next((t for t in args.tests or [] if not Path(t.split("::")[0]).exists()), None)


@contextmanager
def environment(env: dict[str, str]):
    """`env` set in os.environ for the duration, the earlier values restored after."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def run(args) -> int:
    """Run the suite as `args` say (an argparse namespace of `add_arguments`, with the
    options for pytest in `args.pytest_args`)."""
    import pytest

    profile = args.profile or ("ci" if os.environ.get("CI") else "dev")
    backend = _backend(args)
    if isinstance(backend, int):
        return backend
    missing = missing_tests(args)
    if missing is not None:
        print(f"raggedspec conformance: error: --tests {missing}: no such file or folder",
              file=sys.stderr)
        return EXIT_USAGE
    import raggedspec.conformance.conftest  # noqa: F401 - registers the Hypothesis profiles for any --tests path

    tests = [t if "::" in t else str(Path(t)) for t in args.tests or []] or [str(SUITE)]
    env = {"RAGGEDSPEC_BACKEND": args.backend, "RAGGEDSPEC_DEVICE": str(backend.device),
           "RAGGEDSPEC_DTYPE": args.dtype, "HYPOTHESIS_PROFILE": profile}
    collector = Collector()
    with environment(env):
        if args.keyword and selects_nothing(tests, args.keyword, profile):
            return no_selection(args, tests)
        rc = int(pytest.main(build_pytest_args(args, profile, tests), plugins=[collector]))
    if rc == EMPTY_SELECTION:
        return no_selection(args, tests, rc)
    if rc == PYTEST_USAGE_ERROR:
        print(f"raggedspec conformance: error: pytest refused the options "
              f"{' '.join(getattr(args, 'pytest_args', None) or []) or '(none)'} (its message "
              "is above)", file=sys.stderr)
        return EXIT_USAGE
    if not collector.results:  # pytest stopped before running a test: its own error
        return rc
    title = (f"\nraggedspec conformance: backend {backend.name} ({backend.device}, "
             f"{backend.dtype}), profile {profile}, pytest exit {rc}")
    print(format_table(rule_table(collector.results, rule_names()), title,
                       hide_not_run=bool(args.tests or args.keyword)))
    for nodeid, rec in collector.results.items():
        if rec.get("blame"):
            print(f"blamed: {nodeid}: its first differing tensor belongs to rule "
                  f'"{rec["blame"]}": {rec["message"][:300]}')
    return rc


def main(argv: list[str] | None = None) -> int:
    """`raggedspec conformance` as a function: returns the exit code."""
    parser = argparse.ArgumentParser(
        prog="raggedspec conformance", description=__doc__.split("\n\n")[0], epilog=EXIT_CODES_TEXT
    )
    add_arguments(parser)
    try:
        args, rest = parser.parse_known_args(argv)
    except SystemExit as exc:
        return int(exc.code or 0)
    args.pytest_args = rest
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
