"""`raggedspec check-trace`: check an engine's own trace against the spec's rules.

The trace (schema v1, JSONL or CSV, docs/trace.md) is read by the strict reader
(`reference.trace_reader`); a malformed one is refused with every problem named (exit 2).
Then each rule is checked on every row or step it applies to, but only when the fields
it needs are present: a rule whose fields are absent is reported as not run, naming them.
The rules are `raggedspec.trace_rules`. When a scenario is known (the header's, or
`--scenario`), the trace is also replayed through the reference lengths simulator with the
trace's own accept counts and arrivals (`raggedspec.trace_replay`), and the first step where
the two differ is reported with both sides.

Output: the first broken rule, then one line per violation (step, sequence, rule, expected,
actual) in the order their faults arose (`trace_rules.Report.in_order`), a table of the rules
with how many rows or steps each checked and how many broke it, the replay's verdict, and
with `--json PATH` the same as JSON (written to a temporary file, then renamed). Exit 0 when
every rule that ran holds and the replay (if it ran) matches, 1 when a rule is violated or
the replay diverges, 2 for a malformed trace or bad usage.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

from raggedspec.trace_rules import RULE_BY_ID, RULES, Rule, check_rules

if TYPE_CHECKING:  # the CLI builds its parser from this module: keep numpy out of that import
    from raggedspec.reference.scenario import Scenario
    from raggedspec.reference.trace import Trace

JSON_SCHEMA = "raggedspec-check-trace"
JSON_VERSION = 1
EXIT_OK, EXIT_VIOLATED, EXIT_USAGE = 0, 1, 2

# ------------------------------------------------------------------------ the check


def needs_met(rule: Rule, steps: list[dict], depth: int | None) -> list[str]:
    """The fields a rule needs that the trace never carries (empty: it can run)."""
    out = []
    for name in rule.needs:
        if name == "depth":
            if depth is None:
                out.append("depth (a scenario: the header's or --scenario)")
        elif name.startswith("rows[]."):
            key = name[len("rows[].") :]
            if not any(r.get(key) is not None for s in steps for r in s["rows"]):
                out.append(f"`{name}`")
        elif not any(s.get(name) is not None for s in steps):
            out.append(f"`{name}`")
    return out


def header_scenario(trace: Trace) -> Scenario | None:
    """The trace header's scenario as a `Scenario`, or None when the header has none.
    Raises ValueError naming the header's `scenario` when it does not load."""
    from raggedspec.reference.scenario import ScenarioError, load_scenario

    data = (trace.header or {}).get("scenario")
    if not isinstance(data, dict) or not data:
        return None
    try:
        return load_scenario(data)
    except ScenarioError as exc:
        raise ValueError(f"the header's `scenario` is not a valid scenario: {exc}") from None


def check(trace: Trace, scenario: Scenario | None = None) -> dict:
    """Check a trace: every rule (where its fields are present) and, given a scenario (a
    `Scenario`; default: the header's, if any), the replay. Returns the result as plain data
    (the `--json` object without its file fields)."""
    from raggedspec.trace_replay import first_divergence

    steps = [dict(s) for s in trace.steps()]
    if scenario is None:
        scenario = header_scenario(trace)
    depth = None if scenario is None else scenario.depth
    rep = check_rules(steps, depth)
    rules = []
    for rule in RULES:
        missing = needs_met(rule, steps, depth)
        n = rep.checked.get(rule.id, 0)
        rules.append(
            {
                "id": rule.id,
                "rule": rule.spec,
                "invariant": rule.invariant,
                "ran": n > 0,
                "checked": n,
                "violated": rep.violated(rule.id),
                "not_run_because": None
                if n
                else (", ".join(missing) or "no row or step it applies to"),
            }
        )
    replay = {"ran": False, "reason": "no scenario (none in the header; give --scenario)"}
    if scenario is not None:
        div, compared, why = first_divergence(trace, scenario)
        if why:
            replay = {"ran": False, "reason": why}
        else:
            replay = {
                "ran": True,
                "steps_compared": compared,
                "diverged": div is not None,
                "divergence": None if div is None else {**asdict(div), "line": div.line()},
            }
    return {
        "steps": len(steps),
        "row_steps": sum(len(s["rows"]) for s in steps),
        "rules": rules,
        "violations": [{**asdict(v), "line": v.line()} for v in rep.in_order()],
        "replay": replay,
    }


def exit_code(result: dict) -> int:
    """1 when a rule is violated or the replay diverged, else 0."""
    bad = result["violations"] or result["replay"].get("diverged")
    return EXIT_VIOLATED if bad else EXIT_OK


def render(result: dict, source: str, limit: int) -> str:
    """The text report: violation lines (at most `limit`, 0 = all), the rule table, the
    replay line and the verdict."""
    out = [f"{source}: {result['steps']} steps, {result['row_steps']} row-steps"]
    lines = [v["line"] for v in result["violations"]]
    if lines:
        out.append(first_broken(result["violations"]))
    shown = lines if limit <= 0 else lines[:limit]
    out += shown
    if len(shown) < len(lines):
        out.append(
            f"... and {len(lines) - len(shown)} more violation(s) "
            "(--limit 0 shows all; --json has all)"
        )
    width = max(len(f"{r['id']} [{r['rule']}]") for r in result["rules"])
    out.append("")
    out.append(f"{'rule':<{width}}  {'checked':>8}  {'violated':>8}")
    for r in result["rules"]:
        name = f"{r['id']} [{r['rule']}]"
        if r["ran"]:
            out.append(f"{name:<{width}}  {r['checked']:>8}  {r['violated']:>8}")
        else:
            out.append(f"{name:<{width}}  {'not run':>8}  ({r['not_run_because']})")
    rp = result["replay"]
    if not rp["ran"]:
        out.append(f"replay: not run: {rp['reason']}")
    elif rp["diverged"]:
        out.append(
            f"replay: diverged at {rp['divergence']['line']} "
            f"(after {rp['steps_compared']} equal steps)"
        )
    else:
        out.append(
            f"replay: matches the reference lengths simulator on all {rp['steps_compared']} steps"
        )
    n_rules = sum(r["violated"] > 0 for r in result["rules"])
    ran = sum(r["ran"] for r in result["rules"])
    verdict = (
        f"violated: {len(lines)} violation(s) of {n_rules} rule(s)"
        if lines
        else f"clean: {ran} of {len(result['rules'])} rules ran, none violated"
    )
    if rp.get("diverged"):
        verdict += "; the replay diverged"
    out.append(verdict)
    return "\n".join(out)


def first_broken(violations: list[dict]) -> str:
    """The line naming the first broken rule (the violations are in `Report.in_order`): the
    rule whose fault arose earliest, which the later ones may only follow from."""
    v = violations[0]
    rule = RULE_BY_ID[v["rule"]]
    where = f"step {v['step']}" + ("" if v["seq"] is None else f" seq {v['seq']}")
    since = "" if v["origin"] in (None, v["step"]) else f" (from step {v['origin']})"
    later = {w["rule"] for w in violations} - {v["rule"]}
    after = (f"; {', '.join(sorted(later))} broke later and may follow from it"
             if later else "")
    return f"first broken rule: {rule.id} [{rule.spec}] at {where}{since}{after}"


def write_json_atomic(data: dict, path: Path) -> None:
    """Write JSON to a temporary file beside `path`, then rename it over `path`."""
    from raggedspec.outputs import write_text_atomic

    text = json.dumps(data, indent=1)  # pragma: no mutate (layout only: same JSON read back)
    write_text_atomic(path, text + "\n")


# ------------------------------------------------------------------------------ CLI


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "check-trace",
        help="check a trace (e.g. your engine's) against the spec's rules",
        description="Check a schema-v1 trace (JSONL or CSV) against the spec's rules, each where "
        "its fields are present, and replay it through the reference lengths "
        "simulator when a scenario is known. Exit 0 clean, 1 a rule violated or the "
        "replay diverged, 2 a malformed trace or bad usage.",
    )
    p.add_argument("trace", type=Path, help="trace file (.jsonl, or .csv)")
    p.add_argument(
        "--scenario",
        type=Path,
        help="scenario file (.toml or .json) for the replay and the "
        "group-count rule (default: the trace header's)",
    )
    p.add_argument("--json", type=Path, metavar="PATH", help="also write the result as JSON")
    p.add_argument(
        "--limit",
        type=int,
        default=100,
        metavar="N",
        help="violation lines printed at most (default 100; 0: all)",
    )
    return p


def run(args: argparse.Namespace) -> int:
    """The subcommand; raises ValueError (exit 2 in the CLI) on bad usage or a bad trace."""
    from raggedspec.reference.scenario import load_scenario
    from raggedspec.reference.trace_reader import read_trace_strict

    if not args.trace.is_file():
        raise ValueError(f"trace file {args.trace} does not exist")
    if args.json is not None and args.json.resolve() == args.trace.resolve():
        raise ValueError(f"--json {args.json} is the trace itself; refusing to overwrite it")
    if args.json is not None:
        from raggedspec.output_paths import writable_file
        from raggedspec.outputs import OutputPathError

        try:
            writable_file(args.json, "--json")
        except OutputPathError as exc:
            raise ValueError(str(exc)) from None
    if args.limit < 0:
        raise ValueError(f"--limit {args.limit}: must be >= 0")
    scenario = None
    if args.scenario is not None:
        if not args.scenario.is_file():
            raise ValueError(f"scenario file {args.scenario} does not exist")
        scenario = load_scenario(args.scenario)
    trace = read_trace_strict(args.trace)
    if scenario is None:
        try:
            scenario = header_scenario(trace)
        except ValueError as exc:
            raise ValueError(f"{args.trace}:1: {exc} (give --scenario to use another)") from None
    result = check(trace, scenario)
    print(render(result, str(args.trace), args.limit))
    code = exit_code(result)
    if args.json is not None:
        data = {"schema": JSON_SCHEMA, "version": JSON_VERSION, "trace": str(args.trace)}
        try:
            write_json_atomic({**data, "exit": code, **result}, args.json)
        except OSError as exc:
            raise ValueError(f"--json {args.json}: cannot write it ({exc.strerror})") from None
        print(f"wrote {args.json}", file=sys.stderr)
    return code
