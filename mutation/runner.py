"""`raggedspec mutation` (also `python -m raggedspec.mutation.runner`): the named catalogue and
mutmut, one gate.

Without options it is the CI gate: every catalogue entry (`mutation/catalogue.toml`), then mutmut
on `reference/dispatch.py` with its topic tests. `--scope all` runs mutmut on every module of
pyproject's `[tool.mutmut]` (the rules, the port and the checkers) with the whole default suite.
Exit 0 when the gate passes; 1 when an entry is not caught (or a documented equivalent is),
stale, or broke its tests, or a module scores under the threshold or keeps a survivor; 2 for
bad usage (an `--only` or `--module` that selects nothing, mutmut unavailable, an output that
cannot be written). docs/mutation.md explains every part.
"""

from __future__ import annotations

import argparse
import datetime
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

from raggedspec.mutation import catalogue as cat
from raggedspec.mutation import mutmut_gate as mg
from raggedspec.outputs import OutputPathError, check_output_file
from raggedspec.progress import Progress, progress_mode

EXIT_OK, EXIT_FAIL, EXIT_USAGE = 0, 1, 2
BEGIN, END = "<!-- BEGIN generated: mutmut results -->", "<!-- END generated: mutmut results -->"


def build_parser(prog: str = "raggedspec mutation") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog, description=__doc__.split("\n\n")[1].replace("\n", " "),
        epilog="Exit codes: 0 the gate passed; 1 it failed; 2 bad input (an --only or "
               "--module that selects nothing, mutmut unavailable, an unwritable output).")
    what = p.add_mutually_exclusive_group()
    what.add_argument("--catalogue-only", action="store_true",
                      help="run only the named catalogue")
    what.add_argument("--mutmut-only", action="store_true", help="run only mutmut")
    p.add_argument("--scope", choices=("gate", "all"), default="gate",
                   help="mutmut's scope: gate (reference/dispatch.py with its topic tests; the "
                        "default) or all (every module of [tool.mutmut], the whole default suite)")
    p.add_argument("--module", action="append", default=[], metavar="PATH",
                   help="mutmut only this module (repeatable; e.g. reference/rope.py); implies "
                        "--scope all's test selection")
    p.add_argument("--only", metavar="TEXT",
                   help="only the catalogue entries whose name contains TEXT")
    p.add_argument("--jobs", type=int, default=2, metavar="N",
                   help="catalogue runs and mutmut workers side by side (default 2)")
    p.add_argument("--threshold", type=float, default=mg.THRESHOLD, metavar="PCT",
                   help="a module's lowest passing score (default 95)")
    p.add_argument("--docs", type=Path, metavar="PATH",
                   help="rewrite the mutmut results section of this page (docs/mutation.md)")
    p.add_argument("--json", type=Path, metavar="PATH", help="write the results as JSON here")
    return p


# ----------------------------------------------------------------------------- catalogue


def _line(r: cat.Result) -> str:
    shown = {"caught": "CAUGHT", "survived": "SURVIVED", "stale": "STALE", "error": "ERROR",
             "timeout": "TIMEOUT"}[r.status]
    if r.entry.expect == "survive":
        shown += " (documented equivalent: it must survive)"
    detail = f" - {r.detail}" if r.detail else ""
    return f"{shown:<9} {r.entry.name} ({r.seconds:.1f} s){detail}"


def run_catalogue(args: argparse.Namespace) -> tuple[bool, list[cat.Result]]:
    entries = cat.select(cat.load(), args.only)
    done = []

    def report(r: cat.Result) -> None:
        done.append(r)
        print(f"[{len(done)}/{len(entries)}] {_line(r)}", flush=True)

    start = time.monotonic()
    results = cat.run(entries, args.jobs, report)
    bad = [r for r in results if not r.ok]
    caught = sum(r.status == "caught" for r in results)
    print(f"catalogue: {len(results)} entries, {caught} caught, "
          f"{sum(r.ok and r.status == 'survived' for r in results)} documented equivalent "
          f"survived, {len(bad)} failing the gate ({time.monotonic() - start:.0f} s)")
    return not bad, results


# ----------------------------------------------------------------------------- mutmut


def marked_lines(root: Path, module: str) -> int:
    """Lines of the module that carry `# pragma: no mutate` (for the report)."""
    return (root / module).read_text().count("# pragma: no mutate")


def run_mutmut(args: argparse.Namespace) -> tuple[bool, list[mg.ModuleScore], float]:
    root = mg.checkout()
    scope = "all" if args.module else args.scope
    wanted = ["raggedspec/" + m.removeprefix("raggedspec/") for m in args.module]
    modules = mg.scope_modules(root, scope, wanted)
    if wanted and len(modules) != len(wanted):
        missing = sorted(set(wanted) - set(modules))
        raise mg.MutmutUnavailable(f"--module {', '.join(missing)}: not a module mutmut "
                                   "mutates (pyproject's [tool.mutmut] only_mutate)")
    only = modules if scope == "gate" or wanted else None
    tests = mg.GATE_TESTS if scope == "gate" else None
    bar = Progress("mutmut", progress_mode(False), unit="mutant")
    try:
        wall = mg.run(root, only, tests, args.jobs, progress=bar)
    finally:
        bar.close()
    got = mg.scores(root, modules)
    print(f"\nmutmut: {len(got)} module(s), {wall:.0f} s wall")
    for s in got:
        verdict = "pass" if s.passed(args.threshold) else "FAIL"
        print(f"{s.module}: {s.mutants} mutants, score {s.score:.1f}%, {s.open} open, "
              f"{marked_lines(root, s.module)} marked lines: {verdict}")
        for name in mg.survivors(root, s.module)[:20]:
            print(f"    open: {name} (mutmut show {name})")
    return all(s.passed(args.threshold) for s in got), got, wall


def results_table(got: list[mg.ModuleScore], root: Path, command: str, wall: float,
                  threshold: float) -> str:
    """The docs section: the run's command, date, commit and wall time, then one row a module."""
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root,
                            capture_output=True, text=True).stdout.strip() or "unknown"
    rows = [f"Run: `{command}` on {datetime.date.today()} at commit {commit}; mutmut took "
            f"{wall:.0f} s wall. Per module: its mutants' test time added up (seconds), the "
            "score (killed + timeout over mutants), mutants left open (survived, no tests, "
            "not checked) and the lines marked `# pragma: no mutate`.", "",
            "| module | mutants | killed | timeout | open | marked lines | test time (s) | score "
            "| gate |", "|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for s in got:
        rows.append(f"| `{s.module.removeprefix('raggedspec/')}` | {s.mutants} | "
                    f"{s.counts['killed']} | {s.counts['timeout'] + s.counts['segfault']} | "
                    f"{s.open} | {marked_lines(root, s.module)} | {s.seconds:.0f} | "
                    f"{s.score:.1f}% | {'pass' if s.passed(threshold) else 'FAIL'} |")
    return "\n".join(rows)


def write_docs(path: Path, table: str) -> None:
    text = path.read_text()
    if BEGIN not in text or END not in text:
        raise OSError(f"{path} has no '{BEGIN}' ... '{END}' section to rewrite")
    head, _, rest = text.partition(BEGIN)
    path.write_text(f"{head}{BEGIN}\n{table}\n{END}{rest.partition(END)[2]}")


# ----------------------------------------------------------------------------- main


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt  # a SIGTERM stops the runs and removes the copies, as Ctrl-C does


def main(argv: list[str] | None = None, prog: str = "raggedspec mutation") -> int:
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        return _main(argv, prog)
    except KeyboardInterrupt:
        print(f"{prog}: interrupted; the runs were stopped and their copies removed",
              file=sys.stderr)
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)


def _main(argv: list[str] | None, prog: str) -> int:
    args = build_parser(prog).parse_args(argv)
    if args.only and not cat.select(cat.load(), args.only):
        print(f"{prog}: error: --only {args.only!r} matches no catalogue entry", file=sys.stderr)
        return EXIT_USAGE
    try:
        for flag, out in (("--docs", args.docs), ("--json", args.json)):
            if out is not None:
                check_output_file(out, flag)
    except OutputPathError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    ok, report = True, {}
    if not args.mutmut_only:
        passed, results = run_catalogue(args)
        ok &= passed
        report["catalogue"] = [dict(name=r.entry.name, status=r.status, detail=r.detail,
                                    seconds=round(r.seconds, 1)) for r in results]
    if not args.catalogue_only:
        try:
            passed, got, wall = run_mutmut(args)
        except mg.MutmutUnavailable as exc:
            print(f"{prog}: error: {exc}", file=sys.stderr)
            return EXIT_USAGE
        ok &= passed
        report["mutmut"] = [dict(module=s.module, counts=dict(s.counts), score=s.score,
                                 passed=s.passed(args.threshold)) for s in got]
        if args.docs:
            command = " ".join(["raggedspec mutation", *(argv if argv is not None
                                                          else sys.argv[1:])])
            write_docs(args.docs, results_table(got, mg.checkout(), command, wall,
                                                args.threshold))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    print(f"mutation gate: {'PASS' if ok else 'FAIL'}")
    return EXIT_OK if ok else EXIT_FAIL


if __name__ == "__main__":
    sys.exit(main(prog="python -m raggedspec.mutation.runner"))
