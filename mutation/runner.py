"""Mutation runner: the named catalogue and mutmut, in a temporary copy of the tree.

`python -m raggedspec.mutation.runner [--fast | --catalogue-only | --scope gpu] [--shard K/N]`
and `... merge A.json B.json ...`; nothing is written into the checkout's source or tests.
The modes, what the checkout receives, the gate (exit 1) and the score: docs/mutation.md,
section "mutation/runner.py".

The parts: workspaces (workspace.py), the catalogue run (catalogue_run.py), mutmut's scope
(scope.py), its per-module runs (mutmut_run.py) and cache (mutmut_cache.py), shards and
their merge (shards.py), the record and the CI plan (record.py), the gate and report
(report.py); this module parses the arguments, runs them in order, judges the run's JSON
result (`verdict_of`, the same for one run and for merged shards) and re-exports the names.
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
from raggedspec.mutation.mutmut_cache import default_cache_dir, module_key, reuse_plan
from raggedspec.mutation.mutmut_run import (
    MUTMUT_FAST,
    NOT_KILLED,
    STATUS_BY_EXIT_CODE,
    FunctionRow,
    ModuleResult,
    MutmutReport,
    function_of,
    mutated_lines,
    read_mutants_dir,
    RunInterrupted,
    read_stats,
    report_from_modules,
    run_module,
    reopened_codes,
    run_modules,
    seed_mutants,
    settle_reopened,
    score_of,
    split_report,
)
from raggedspec.mutation.record import RECORD, ci_plan, load_record, save_record
from raggedspec.mutation.report import (
    EQUIVALENT,
    THRESHOLD,
    Verdict,
    catalogue_table,
    equivalent_for,
    gate,
    load_equivalents,
    module_ok,
    module_table,
    mutmut_table,
    print_mutmut,
    write_docs,
)
from raggedspec.mutation.scope import EXCLUDED, MUTMUT_MODULES, modules_in_scope, unclassified
from raggedspec.mutation.shards import (
    FORMAT,
    MergeError,
    catalogue_shard,
    git_commit,
    merge_results,
    module_shard,
    module_shards,
    parse_shard,
    tree_hash,
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
    "FunctionRow",
    "KILLERS",
    "MUTMUT_FAST",
    "MUTMUT_MODULES",
    "EXCLUDED",
    "FORMAT",
    "MergeError",
    "ModuleResult",
    "RECORD",
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
    "run_module",
    "run_modules",
    "RunInterrupted",
    "reopened_codes",
    "seed_mutants",
    "settle_reopened",
    "catalogue_shard",
    "module_shard",
    "module_shards",
    "parse_shard",
    "merge_results",
    "merge_main",
    "verdict_of",
    "within_budget",
    "CI_BUDGET_S",
    "report_from_modules",
    "modules_in_scope",
    "unclassified",
    "ci_plan",
    "load_record",
    "save_record",
    "reuse_plan",
    "module_key",
    "module_ok",
    "module_table",
    "default_cache_dir",
    "git_commit",
    "tree_hash",
    "run_one",
    "run_pytest",
    "save_killers",
    "score_of",
    "select",
    "shown_status",
    "split_report",
    "write_docs",
]


def verdict_of(result: dict, equivalents: dict, threshold: float | None = None) -> Verdict:
    """The gate's verdict on a result dict (one run's, or merged shards'): the same for both,
    since both are judged from their JSON form."""
    cat = result.get("catalogue")
    results = None if cat is None else [MutantResult(**r) for r in cat]
    report = _report_of(result)
    thr = result.get("threshold", THRESHOLD) if threshold is None else threshold
    v = gate(results, report, equivalents, thr, result.get("baseline_red", []),
             bool(result.get("allow_red")))
    reasons = v.reasons + list(result.get("ci", {}).get("reasons", [])) + list(
        result.get("infra", []))
    return Verdict(not reasons, reasons)


def _report_of(result: dict) -> MutmutReport | None:
    mm = result.get("mutmut")
    if mm is None:
        return None
    return report_from_modules({m: ModuleResult.from_dict(d) for m, d in mm["modules"].items()},
                               float(result.get("mutmut_seconds", result.get("seconds", 0.0))))


def _finish(result: dict, verdict: Verdict, equivalents: dict, docs: Path | None,
            record_path: Path | None, json_path: Path | None, root: Path) -> int:
    """Write the docs (and the record), the JSON, print the verdict; the exit code."""
    result["ok"], result["reasons"] = verdict.ok, verdict.reasons
    if docs is not None:
        cat = result.get("catalogue")
        results = None if cat is None else [MutantResult(**r) for r in cat]
        record = load_record(record_path) if record_path is not None else None
        rec = write_docs(docs, results, _report_of(result), equivalents, result["command"],
                         float(result.get("seconds", 0.0)), result["date"], record,
                         result.get("threshold", THRESHOLD))
        print(f"wrote {docs}")
        if rec is not None and record_path is not None:
            save_record(rec, record_path)
            print(f"wrote {record_path}")
        if results and docs.resolve() == (root / "docs" / "mutation.md").resolve():
            save_killers(results)
    if json_path is not None:
        from raggedspec.outputs import write_text_atomic

        write_text_atomic(json_path, json.dumps(result, indent=2))
    print(f"mutation gate: {'PASS' if verdict.ok else 'FAIL'} "
          f"({float(result.get('seconds', 0.0)):.0f} s)")
    for r in verdict.reasons:
        print(f"  - {r}")
    return 0 if verdict.ok else (2 if result.get("infra") else 1)


def _record_for(docs: Path | None, given: Path | None, root: Path) -> Path | None:
    if given is not None:
        return given
    checkout_page = (root / "docs" / "mutation.md").resolve()
    return RECORD if docs is not None and docs.resolve() == checkout_page else None


def merge_main(argv: list[str]) -> int:
    """`merge A.json B.json ...`: the shards' combined result, gated and (with --docs)
    written as one unsharded run's; exit 2 when the shards cannot be merged."""
    ap = argparse.ArgumentParser(prog="python -m raggedspec.mutation.runner merge",
                                 description="combine the --json results of --shard K/N runs")
    ap.add_argument("shards", nargs="+", type=Path)
    ap.add_argument("--docs", type=Path, help="write docs/mutation.md's sections here")
    ap.add_argument("--record", type=Path, help="the record to update (default: "
                    "mutation/mutmut_record.json when --docs is the checkout's page)")
    ap.add_argument("--json", type=Path, help="write the merged result here")
    ap.add_argument("--equivalent", type=Path, default=EQUIVALENT)
    ap.add_argument("--threshold", type=float)
    ap.add_argument("--root", type=Path, default=ROOT, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    try:
        merged = merge_results(args.shards)
    except MergeError as exc:
        print(f"python -m raggedspec.mutation.runner merge: refused: {exc}", file=sys.stderr)
        return 2
    equivalents = load_equivalents(args.equivalent)
    if args.threshold is not None:
        merged["threshold"] = args.threshold
    merged["command"] = f"{merged.get('command', '')} (merged from {merged['shards']} shards)"
    verdict = verdict_of(merged, equivalents, args.threshold)
    root = args.root.resolve()
    return _finish(merged, verdict, equivalents, args.docs, _record_for(args.docs, args.record,
                                                                      root), args.json, root)


def _mutmut_modules(args, root: Path, scopes: list[str], log=print) -> tuple[list[str], dict]:
    """The modules this run's mutmut part covers (before sharding), and for --fast the CI
    plan: {"plan": {module: state}, "reasons": [...]} (see record.py)."""
    if args.module:
        unknown = [m for m in args.module if m not in MUTMUT_MODULES]
        if unknown:
            raise ValueError(f"--module {', '.join(unknown)}: not in MUTMUT_MODULES "
                             f"(mutation/scope.py)")
        return list(args.module), {}
    every = [m for s in scopes for m in modules_in_scope(s, root)]
    if not args.fast:
        return every, {}
    fixed = MUTMUT_FAST["reference"] if "reference" in scopes else MUTMUT_FAST["gpu"]
    record = load_record(args.record or RECORD)
    plan = ci_plan(record, {m: module_key(root, m, tool=False) for m in every})
    changed = [m for m in every if plan[m] == "changed" and m not in fixed]
    reasons: list[str] = []
    changed, over = within_budget(changed, record, args.ci_budget)
    if over:
        reasons.append(f"mutmut: {', '.join(over)} changed since the record but do not fit the "
                       f"CI budget ({args.ci_budget:.0f} s of recorded run time): run them "
                       f"(--module, or a sharded full run) and commit mutation/mutmut_record.json")
    unrecorded = [m for m in every if plan[m] == "unrecorded" and m not in fixed]
    log(f"mutmut CI plan: {len(fixed)} fixed, {len(changed)} changed since the record"
        + (f" ({', '.join(changed)})" if changed else "")
        + f", {sum(v == 'unchanged' for v in plan.values())} unchanged, "
        f"{len(unrecorded)} not recorded (not covered here)"
        + "".join(f"; {m}: its recorded run failed the gate, unchanged since"
                  for m in every if plan[m] == "failed"))
    return [m for m in every if m in fixed or m in changed], {"plan": plan, "reasons": reasons}


CI_BUDGET_S = 300.0


def within_budget(changed: list[str], record: dict, budget: float) -> tuple[list[str], list[str]]:
    """The changed modules the CI gate mutates (cheapest recorded run first, while the sum of
    their recorded seconds stays within `budget`) and those left over, both in input order."""
    cost = {m: float(record.get("modules", {}).get(m, {}).get("seconds", 0.0)) for m in changed}
    take, used = set(), 0.0
    for m in sorted(changed, key=lambda m: (cost[m], m)):
        if used + cost[m] > budget:
            break
        take.add(m)
        used += cost[m]
    return [m for m in changed if m in take], [m for m in changed if m not in take]


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["merge"]:
        return merge_main(argv[1:])
    ap = argparse.ArgumentParser(
        prog="python -m raggedspec.mutation.runner", description=__doc__.split("\n\n")[0],
        epilog="`merge A.json B.json ... [--docs PATH]` combines --shard results. Exit codes: "
               "0 the gate passed; 1 it failed (the reasons are listed); 2 bad input (an --only "
               "matching no entry, shards that cannot be merged) or mutmut did not complete.")
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
                    help="CI gate: the catalogue, mutmut on the dispatch module, and mutmut on "
                    "every module changed since mutation/mutmut_record.json")
    ap.add_argument("--only", help="catalogue entries whose name contains this text")
    ap.add_argument("--module", action="append",
                    help="mutmut only this module (repeatable; a path of MUTMUT_MODULES)")
    ap.add_argument("--shard", help="K/N: run the K-th of N deterministic parts of the work")
    ap.add_argument("--cache", type=Path, help="mutmut result cache (default: the user cache "
                    "dir, see mutation/mutmut_cache.py)")
    ap.add_argument("--no-cache", action="store_true", help="neither read nor write the cache")
    ap.add_argument("--record", type=Path, help="the mutmut record (default: "
                    "mutation/mutmut_record.json; updated with the checkout's docs page)")
    ap.add_argument("--ci-budget", type=float, default=CI_BUDGET_S,
                    help="--fast: the most recorded seconds of changed modules to mutate "
                    "(default %(default)s; the rest fail the gate)")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--time-limit", type=float, default=3600.0,
                    help="seconds one module's mutmut run may take (default %(default)s); a run "
                    "past it keeps its verdicts and the next run checks only the rest")
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
    try:
        k, n = parse_shard(args.shard) if args.shard else (1, 1)
    except ValueError as exc:
        print(f"python -m raggedspec.mutation.runner: error: {exc}", file=sys.stderr)
        return 2
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
    cache = None if args.no_cache else (args.cache or default_cache_dir())
    scopes = ["reference", "gpu"] if args.scope == "all" else [args.scope]

    results, red, report, infra = None, [], None, []
    cat_all: list[str] = []
    cat_assigned: list[str] = []
    mm_all: list[str] = []
    mm_assigned: list[str] = []
    ci: dict = {}
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
            cat_all = [m.name for m in entries]
            cat_assigned = catalogue_shard(cat_all, k, n)
            mine = set(cat_assigned)
            entries = [m for m in entries if m.name in mine]
            broken = check_catalogue(entries, root)
            for name, why in broken.items():
                print(f"BROKEN {name}: {why}")
            runnable = [m for m in entries if m.name not in broken]
            print(f"catalogue: {len(entries)} entries ({len(runnable)} runnable), scope "
                  f"{args.scope}, shard {k}/{n}, {args.jobs} job(s)")
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
                mm_all = list(report.modules)
                mm_assigned = module_shard(mm_all, root, k, n)
                if n > 1:
                    report = report_from_modules({m: report.modules[m] for m in mm_assigned})
            else:
                try:
                    mm_all, ci = _mutmut_modules(args, root, scopes)
                except ValueError as exc:
                    print(f"python -m raggedspec.mutation.runner: error: {exc}", file=sys.stderr)
                    return 2
                mm_assigned = module_shard(mm_all, root, k, n)
                try:
                    report, red_mm = run_modules(mm_assigned, root, args.jobs, cache,
                                                 timeout=args.time_limit)
                    red = red + [t for t in red_mm if t not in red]
                except (RuntimeError, subprocess.TimeoutExpired, CatalogueError) as err:
                    infra.append(f"mutmut did not complete: {err}")
                    print(infra[-1])
            if report is not None:
                print_mutmut(report, equivalents)
    finally:
        _cleanup()

    seconds = time.monotonic() - t0
    shown = list(argv)
    for opt in ("--json", "--docs", "--cache", "--record"):  # where things went is not what ran
        if opt in shown and shown.index(opt) + 1 < len(shown):
            i = shown.index(opt)
            del shown[i: i + 2]
    result = {
        "format": FORMAT, "commit": git_commit(root), "tree": tree_hash(root), "shard": [k, n],
        "scope": args.scope,
        "mode": ("catalogue-only" if args.catalogue_only else "mutmut-only" if args.mutmut_only
                 else "full") + (" fast" if args.fast else "") + (f" only={args.only}"
                                                                   if args.only else ""),
        "catalogue_all": cat_all, "catalogue_assigned": cat_assigned,
        "mutmut_all": mm_all, "mutmut_assigned": mm_assigned,
        "threshold": args.threshold, "allow_red": args.allow_red,
        "command": ("python -m raggedspec.mutation.runner " + " ".join(shown)).strip(),
        "date": time.strftime("%Y-%m-%d"), "seconds": seconds,
        "mutmut_seconds": report.seconds if report is not None else 0.0,
        "baseline_red": red, "infra": infra, "ci": ci,
        "catalogue": None if results is None else [asdict(r) for r in results],
        "mutmut": None if report is None else {
            "modules": {m: r.to_dict() for m, r in report.modules.items()}},
    }
    verdict = verdict_of(result, equivalents)
    full_run = (not args.fast and not args.only and not args.from_mutants and not args.module
                and n == 1)
    checkout = (root / "raggedspec").is_dir()  # not an installed package: docs/ is the repo's
    docs = None if args.no_docs else args.docs or (
        root / "docs" / "mutation.md" if full_run and checkout else None)
    return _finish(result, verdict, equivalents, docs, _record_for(docs, args.record, root),
                   args.json, root)


if __name__ == "__main__":
    sys.exit(main())
