"""Mutation runner: the named catalogue and mutmut, in a temporary copy of the tree.

`python -m raggedspec.mutation.runner [--fast | --catalogue-only | --scope gpu]`; nothing
is written into the checkout's source or tests. The modes, what the checkout
receives, the gate (exit 1) and the score: docs/mutation.md, section "mutation/runner.py".

The parts: workspaces (workspace.py), the catalogue run (catalogue_run.py), the mutmut run
(mutmut_run.py), the gate and report (report.py); this module parses the arguments, runs
them in order and re-exports their names.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict
from pathlib import Path

from raggedspec.mutation.catalogue import Mutant, select
from raggedspec.mutation.catalogue_run import (
    KILLERS,
    PYTEST_ARGS,
    CatalogueError,
    MutantResult,
    WarmPytest,
    baseline,
    check_catalogue,
    load_killers,
    mutated_source,
    run_catalogue,
    run_one,
    run_pytest,
    save_killers,
    shown_status,
)
from raggedspec.mutation.mutmut_run import (
    FAST_TESTS,
    MUTMUT_FAST,
    MUTMUT_FULL,
    NOT_KILLED,
    STATUS_BY_EXIT_CODE,
    FunctionRow,
    MutmutReport,
    function_of,
    mutated_lines,
    read_mutants_dir,
    read_stats,
    run_mutmut,
    score_of,
    split_report,
)
from raggedspec.mutation.report import (
    EQUIVALENT,
    THRESHOLD,
    Verdict,
    catalogue_table,
    equivalent_for,
    gate,
    load_equivalents,
    mutmut_table,
    print_mutmut,
    write_docs,
)
from raggedspec.mutation.workspace import (
    COPY_IGNORE,
    PACKAGES,
    ROOT,
    _cleanup,
    _terminate,
    in_tree,
    make_workspace,
    nested_path,
)

__all__ = [
    "COPY_IGNORE",
    "CatalogueError",
    "EQUIVALENT",
    "FAST_TESTS",
    "FunctionRow",
    "KILLERS",
    "MUTMUT_FAST",
    "MUTMUT_FULL",
    "Mutant",
    "MutantResult",
    "MutmutReport",
    "NOT_KILLED",
    "PACKAGES",
    "PYTEST_ARGS",
    "ROOT",
    "STATUS_BY_EXIT_CODE",
    "THRESHOLD",
    "Verdict",
    "WarmPytest",
    "baseline",
    "catalogue_table",
    "check_catalogue",
    "equivalent_for",
    "function_of",
    "gate",
    "in_tree",
    "load_equivalents",
    "load_killers",
    "main",
    "make_workspace",
    "mutated_lines",
    "mutated_source",
    "mutmut_table",
    "nested_path",
    "print_mutmut",
    "read_mutants_dir",
    "read_stats",
    "run_catalogue",
    "run_mutmut",
    "run_one",
    "run_pytest",
    "save_killers",
    "score_of",
    "select",
    "shown_status",
    "split_report",
    "write_docs",
]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m raggedspec.mutation.runner", description=__doc__.split("\n\n")[0],
        epilog="Exit codes: 0 the gate passed; 1 it failed (the reasons are listed); 2 bad "
               "input (an --only matching no entry) or mutmut did not complete.")
    ap.add_argument(
        "--scope",
        choices=("reference", "gpu", "all"),
        default="all",
        help="all (default): the reference and the port; reference: the reference rules; "
        "gpu: the torch port and the kernels",
    )
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--catalogue-only", action="store_true", help="run only the named catalogue")
    mode.add_argument("--mutmut-only", action="store_true", help="run only mutmut")
    ap.add_argument("--fast", action="store_true",
                    help="CI gate: the catalogue plus mutmut on the dispatch module only")
    ap.add_argument("--only", help="catalogue entries whose name contains this text")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--threshold", type=float, default=THRESHOLD)
    ap.add_argument(
        "--no-baseline", action="store_true", help="skip the catalogue's unmutated baseline run"
    )
    ap.add_argument("--no-hints", action="store_true",
                    help="ignore mutation/killers.json (run each entry's test files in order)")
    ap.add_argument(
        "--allow-red",
        action="store_true",
        help="do not fail the gate when unmutated tests fail (they are deselected either way)",
    )
    ap.add_argument(
        "--from-mutants",
        type=Path,
        help="read an existing mutmut mutants/ dir instead of running mutmut",
    )
    ap.add_argument("--equivalent", type=Path, default=EQUIVALENT)
    ap.add_argument(
        "--docs", type=Path, help="write the report here (default: docs/mutation.md on a full run)"
    )
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
                print(
                    f"python -m raggedspec.mutation.runner: error: --only {args.only!r} matches no "
                    f"catalogue entry in scope {args.scope} (mutation/catalogue.py names them)",
                    file=sys.stderr,
                )
                return 2
            broken = check_catalogue(entries, root)
            for name, why in broken.items():
                print(f"BROKEN {name}: {why}")
            runnable = [m for m in entries if m.name not in broken]
            print(
                f"catalogue: {len(entries)} entries ({len(runnable)} runnable), scope "
                f"{args.scope}, "
                f"{args.jobs} job(s)"
            )
            hints = {} if args.no_hints else load_killers()
            results, red = run_catalogue(runnable, root, args.jobs, not args.no_baseline,
                                         hints=hints, equivalents=equivalents)
            results += [
                MutantResult(m.name, m.file, m.spec, "BROKEN", broken[m.name], 0.0, m.expect)
                for m in entries
                if m.name in broken
            ]
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
    docs = args.docs or (
        root / "docs" / "mutation.md" if full_run and checkout and not args.no_docs else None
    )
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
