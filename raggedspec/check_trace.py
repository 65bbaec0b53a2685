"""`raggedspec check-trace`: check an engine's own trace against the spec's rules.

The trace (schema v1, JSONL or CSV, docs/trace.md) is read by the strict reader
(`reference.trace_reader`); a malformed one is refused with every problem named (exit 2).
Then each rule below is checked on every row or step it applies to, but only when the fields
it needs are present: a rule whose fields are absent is reported as not run, naming them.
Failed steps (an `error`) are left out of every rule but the lead identity: their outcome
fields are zero and their requests are over. When a scenario is known (the header's, or
`--scenario`), the trace is also replayed through the reference lengths simulator with the
trace's own accept counts and arrivals (`raggedspec.trace_replay`), and the first step where
the two differ is reported with both sides.

Output: one line per violation (step, sequence, rule, expected, actual), a table of the rules
with how many rows or steps each checked and how many broke it, the replay's verdict, and
with `--json PATH` the same as JSON (written to a temporary file, then renamed). Exit 0 when
every rule that ran holds and the replay (if it ran) matches, 1 when a rule is violated or
the replay diverges, 2 for a malformed trace or bad usage.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path

from reference.trace import Trace

JSON_SCHEMA = "raggedspec-check-trace"
JSON_VERSION = 1
EXIT_OK, EXIT_VIOLATED, EXIT_USAGE = 0, 1, 2


@dataclass(frozen=True)
class Rule:
    """One checked rule: its short id, the spec rule it is named after, the invariant, and
    the trace fields it needs."""

    id: str
    spec: str
    invariant: str
    needs: tuple[str, ...]


RULES = (
    Rule("lead", "front_align_batch (C §4.5)", "lead = width - own_len",
         ("rows[].width", "rows[].lead")),
    Rule("uniform-no-lead", "resolve_row_cache_lens (C §8.2)",
         "a uniform batch has no lead, and some row of a batch has lead 0", ("rows[].lead",)),
    Rule("accepted-le-drafted", "verify_proposed (C §11.1)", "accepted <= drafted",
         ("rows[].drafted", "rows[].accepted")),
    Rule("accepted-prefix", "verify_proposed (C §11.1)",
         "accepted_pos has one entry per draft and its accepted drafts are the first `accepted`",
         ("rows[].accepted_pos", "rows[].accepted")),
    Rule("commit", "accept and commit (C §11.2)",
         "committed = accepted + 1 on a decode step (fewer only on the row's last step)",
         ("phase", "rows[].accepted", "rows[].committed")),
    Rule("chain-start", "chain_start_of (C §9.1)",
         "chain_start = cache_len + u - 2 (cache_len: own_len under per-sequence advance, "
         "else width)", ("phase", "advance", "rows[].u", "rows[].chain_start")),
    Rule("group-key", "draft_group_key (C §9.1)",
         "group = [u, 0] under per-sequence advance, else [u, cache_len + u - 2]",
         ("phase", "advance", "rows[].u", "rows[].group")),
    Rule("group-count", "draft_groups (C §9.1)",
         "at most depth + 1 draft groups on a per-sequence step", ("phase", "advance", "groups", "depth")),
    Rule("q0", "ragged_row_q0 (M §12)",
         "q0 = the row's own position: own_len under per-sequence advance and on a defer step, "
         "width on a cohort decode step, 0 on a prompt step", ("phase", "advance", "rows[].q0")),
    Rule("dead-cols", "ragged_union_mask (M §5)", "the mask's dead-prefix columns = lead",
         ("rows[].dead_cols", "rows[].lead")),
    Rule("per-sequence-advance", "plan_per_sequence_step and the per-seq commit (C §12.2)",
         "a row's next own_len = own_len + committed (u + accepted)",
         ("phase", "advance", "rows[].committed")),
    Rule("cohort-advance", "plan_batch_step (C §12.1)",
         "every row of a cohort step advances by keep = min over rows of (u + accepted); a defer "
         "step by 1", ("phase", "advance")),
)
RULE_BY_ID = {r.id: r for r in RULES}


@dataclass
class Violation:
    step: int
    seq: object
    rule: str
    expected: object
    actual: object
    note: str = ""

    def line(self) -> str:
        r = RULE_BY_ID[self.rule]
        seq = "" if self.seq is None else f" seq {self.seq}"
        note = f" ({self.note})" if self.note else ""
        return (f"step {self.step}{seq}: {r.id} [{r.spec}]: expected {self.expected}, "
                f"actual {self.actual}{note}")


@dataclass
class Report:
    """Per rule: how many rows or steps it checked (0 = did not run) and its violations."""

    checked: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    violations: list[Violation] = field(default_factory=list)
    missing: dict[str, list[str]] = field(default_factory=dict)

    def bad(self, step, seq, rule, expected, actual, note="") -> None:
        self.violations.append(Violation(step, seq, rule, expected, actual, note))

    def violated(self, rule: str) -> int:
        return sum(v.rule == rule for v in self.violations)


# ----------------------------------------------------------------------- the rules


def _has(x: dict, *names: str) -> bool:
    return all(x.get(n) is not None for n in names)


def _position(step: dict, row: dict) -> int | None:
    """The row's own position (its cache length at verify): own_len under per-sequence
    advance, the batched width under the cohort rule."""
    if step.get("advance") == "per-sequence":
        return row["own_len"]
    return row.get("width")


def check_rows(steps: list[dict], last_step_of: dict, rep: Report) -> None:
    """The rules read within one row or one step."""
    for s in steps:
        t, rows, phase, failed = s["step"], s["rows"], s.get("phase"), bool(s.get("error"))
        for r in rows:
            q = r["seq"]
            if _has(r, "width", "lead"):
                rep.checked["lead"] += 1
                if r["lead"] != r["width"] - r["own_len"]:
                    rep.bad(t, q, "lead", f"lead {r['width'] - r['own_len']} (width {r['width']} - "
                                          f"own_len {r['own_len']})", f"lead {r['lead']}")
            if _has(r, "dead_cols", "lead"):
                rep.checked["dead-cols"] += 1
                if r["dead_cols"] != r["lead"]:
                    rep.bad(t, q, "dead-cols", f"dead_cols {r['lead']} (the lead)", f"dead_cols {r['dead_cols']}")
            if failed:
                continue
            if _has(r, "drafted", "accepted"):
                rep.checked["accepted-le-drafted"] += 1
                if r["accepted"] > r["drafted"]:
                    rep.bad(t, q, "accepted-le-drafted", f"accepted <= drafted {r['drafted']}",
                            f"accepted {r['accepted']}")
            if _has(r, "accepted_pos", "accepted"):
                _check_prefix(t, r, rep)
            if phase == "decode" and _has(r, "accepted", "committed"):
                rep.checked["commit"] += 1
                want = r["accepted"] + 1
                last = last_step_of.get(q) == t
                if r["committed"] > want or (r["committed"] < want and not last):
                    why = "" if r["committed"] > want else "the sequence runs again later, so it did not finish"
                    rep.bad(t, q, "commit", f"committed {want} (accepted {r['accepted']} + 1)",
                            f"committed {r['committed']}", why)
            _check_positions(s, r, rep)
        if not failed:
            _check_step_leads(s, rep)


def _check_prefix(t: int, r: dict, rep: Report) -> None:
    bits, a = r["accepted_pos"], r["accepted"]
    rep.checked["accepted-prefix"] += 1
    want = [1] * a + [0] * (len(bits) - a)
    if r.get("drafted") is not None and len(bits) != r["drafted"]:
        rep.bad(t, r["seq"], "accepted-prefix", f"{r['drafted']} entries (drafted)", f"{len(bits)} entries")
    elif bits != want[: len(bits)] or a > len(bits):
        rep.bad(t, r["seq"], "accepted-prefix", f"accepted_pos {want} (accepted {a})", f"accepted_pos {bits}")


def _check_positions(s: dict, r: dict, rep: Report) -> None:
    """chain-start, group-key and q0 of one row of a step that did not fail."""
    t, q, phase = s["step"], r["seq"], s.get("phase")
    if s.get("advance") is None or phase is None:
        return
    pos = _position(s, r)
    if phase == "decode" and pos is not None and r.get("u") is not None:
        start = pos + r["u"] - 2
        if r.get("chain_start") is not None:
            rep.checked["chain-start"] += 1
            if r["chain_start"] != start:
                rep.bad(t, q, "chain-start", f"chain_start {start} (cache_len {pos} + u {r['u']} - 2)",
                        f"chain_start {r['chain_start']}")
        if r.get("group") is not None:
            rep.checked["group-key"] += 1
            key = [r["u"], 0] if s["advance"] == "per-sequence" else [r["u"], start]
            if list(r["group"]) != key:
                rep.bad(t, q, "group-key", f"group {key} ({s['advance']} advance)", f"group {list(r['group'])}")
    if r.get("q0") is not None:
        want = {"prompt": 0, "defer": r["own_len"]}.get(phase, pos)
        if want is not None:
            rep.checked["q0"] += 1
            if r["q0"] != want:
                rep.bad(t, q, "q0", f"q0 {want} ({phase}, {s['advance']} advance)", f"q0 {r['q0']}")


def _check_step_leads(s: dict, rep: Report) -> None:
    rows = s["rows"]
    if not rows or any(r.get("lead") is None for r in rows):
        return
    rep.checked["uniform-no-lead"] += 1
    leads = [r["lead"] for r in rows]
    if len({r["own_len"] for r in rows}) == 1 and any(leads):
        rep.bad(s["step"], None, "uniform-no-lead", "leads all 0 (every row holds own_len "
                f"{rows[0]['own_len']})", f"leads {leads}")
    elif min(leads) > 0:
        rep.bad(s["step"], None, "uniform-no-lead", "some lead 0 (the widest row)", f"leads {leads}")


def check_group_count(steps: list[dict], depth: int | None, rep: Report) -> None:
    """At most depth + 1 draft groups on a per-sequence decode step (step `groups`, or the
    distinct row group keys when the step has no `groups`)."""
    if depth is None:
        return
    for s in steps:
        if s.get("phase") != "decode" or s.get("advance") != "per-sequence" or s.get("error"):
            continue
        n = s.get("groups")
        if n is None:
            keys = {tuple(r["group"]) for r in s["rows"] if r.get("group") is not None}
            if not any("group" in r for r in s["rows"]):
                continue
            n = len(keys)
        rep.checked["group-count"] += 1
        if n > depth + 1:
            rep.bad(s["step"], None, "group-count", f"at most {depth + 1} groups (depth {depth} + 1)", f"{n} groups")


def check_advance(steps: list[dict], rep: Report) -> None:
    """The two advance rules, across steps: a row's own_len at its next step against its
    own_len at a decode / defer step that did not fail."""
    prev: dict = {}  # seq -> (step dict, row dict, cohort keep or None)
    for s in steps:
        failed = bool(s.get("error"))
        for r in s["rows"]:
            q = r["seq"]
            if q in prev and not failed:
                _compare_advance(prev[q], s, r, rep)
            prev.pop(q, None)
        if failed or s.get("phase") not in ("decode", "defer") or s.get("advance") is None:
            continue
        keep = _cohort_keep(s)
        for r in s["rows"]:
            prev[r["seq"]] = (s, r, keep)


def _cohort_keep(s: dict) -> int | None:
    if s["phase"] == "defer":
        return 1
    rows = s["rows"]
    if rows and all(_has(r, "u", "accepted") for r in rows):
        return min(r["u"] + r["accepted"] for r in rows)
    return None


def _compare_advance(before: tuple, s: dict, r: dict, rep: Report) -> None:
    ps, pr, keep = before
    q, got = r["seq"], r["own_len"]
    if ps["phase"] == "decode" and ps["advance"] == "per-sequence":
        if _has(pr, "u", "accepted"):
            adv, how = pr["u"] + pr["accepted"], f"u {pr['u']} + accepted {pr['accepted']}"
        elif pr.get("committed") is not None:
            adv, how = pr["committed"], f"committed {pr['committed']}"
        else:
            return
        rep.checked["per-sequence-advance"] += 1
        if got != pr["own_len"] + adv:
            rep.bad(s["step"], q, "per-sequence-advance",
                    f"own_len {pr['own_len'] + adv} (own_len {pr['own_len']} at step {ps['step']} + {how})",
                    f"own_len {got}")
        return
    if ps["advance"] != "cohort" and ps["phase"] != "defer":
        return
    rep.checked["cohort-advance"] += 1
    if keep is not None:
        if got != pr["own_len"] + keep:
            how = "defer: 1" if ps["phase"] == "defer" else "keep = min(u + accepted)"
            rep.bad(s["step"], q, "cohort-advance",
                    f"own_len {pr['own_len'] + keep} (own_len {pr['own_len']} at step {ps['step']} + "
                    f"{keep}, {how})", f"own_len {got}")
        return
    first = ps.setdefault("_advance_seen", (q, got - pr["own_len"]))
    if got - pr["own_len"] != first[1]:
        rep.bad(s["step"], q, "cohort-advance", f"advance {first[1]} (as seq {first[0]} after step {ps['step']})",
                f"advance {got - pr['own_len']}")


# ------------------------------------------------------------------------ the check


def needs_met(rule: Rule, steps: list[dict], depth: int | None) -> list[str]:
    """The fields a rule needs that the trace never carries (empty: it can run)."""
    out = []
    for name in rule.needs:
        if name == "depth":
            if depth is None:
                out.append("depth (a scenario: the header's or --scenario)")
        elif name.startswith("rows[]."):
            key = name[len("rows[]."):]
            if not any(r.get(key) is not None for s in steps for r in s["rows"]):
                out.append(f"`{name}`")
        elif not any(s.get(name) is not None for s in steps):
            out.append(f"`{name}`")
    return out


def check(trace: Trace, scenario=None) -> dict:
    """Check a trace: every rule (where its fields are present) and, given a scenario (a
    `Scenario`; default: the header's, if any), the replay. Returns the result as plain data
    (the `--json` object without its file fields)."""
    from raggedspec.trace_replay import first_divergence
    from reference.scenario import load_scenario

    steps = [dict(s) for s in trace.steps()]
    if scenario is None and isinstance((trace.header or {}).get("scenario"), dict) and trace.header["scenario"]:
        scenario = load_scenario(trace.header["scenario"])
    depth = None if scenario is None else scenario.depth
    last_step_of = {}
    for s in steps:
        for r in s["rows"]:
            last_step_of[r["seq"]] = s["step"]
    rep = Report()
    check_rows(steps, last_step_of, rep)
    check_group_count(steps, depth, rep)
    check_advance(steps, rep)
    rules = []
    for rule in RULES:
        missing = needs_met(rule, steps, depth)
        n = rep.checked.get(rule.id, 0)
        rules.append({"id": rule.id, "rule": rule.spec, "invariant": rule.invariant, "ran": n > 0,
                      "checked": n, "violated": rep.violated(rule.id),
                      "not_run_because": None if n else (", ".join(missing) or "no row or step it applies to")})
    replay = {"ran": False, "reason": "no scenario (none in the header; give --scenario)"}
    if scenario is not None:
        div, compared, why = first_divergence(trace, scenario)
        if why:
            replay = {"ran": False, "reason": why}
        else:
            replay = {"ran": True, "steps_compared": compared, "diverged": div is not None,
                      "divergence": None if div is None else {**asdict(div), "line": div.line()}}
    return {"steps": len(steps), "row_steps": sum(len(s["rows"]) for s in steps),
            "rules": rules, "violations": [{**asdict(v), "line": v.line()} for v in rep.violations],
            "replay": replay}


def exit_code(result: dict) -> int:
    """1 when a rule is violated or the replay diverged, else 0."""
    bad = result["violations"] or result["replay"].get("diverged")
    return EXIT_VIOLATED if bad else EXIT_OK


def render(result: dict, source: str, limit: int) -> str:
    """The text report: violation lines (at most `limit`, 0 = all), the rule table, the
    replay line and the verdict."""
    out = [f"{source}: {result['steps']} steps, {result['row_steps']} row-steps"]
    lines = [v["line"] for v in result["violations"]]
    shown = lines if limit <= 0 else lines[:limit]
    out += shown
    if len(shown) < len(lines):
        out.append(f"... and {len(lines) - len(shown)} more violation(s) (--limit 0 shows all; --json has all)")
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
        out.append(f"replay: diverged at {rp['divergence']['line']} (after {rp['steps_compared']} equal steps)")
    else:
        out.append(f"replay: matches the reference lengths simulator on all {rp['steps_compared']} steps")
    n_rules = sum(r["violated"] > 0 for r in result["rules"])
    ran = sum(r["ran"] for r in result["rules"])
    verdict = (f"violated: {len(lines)} violation(s) of {n_rules} rule(s)" if lines else
               f"clean: {ran} of {len(result['rules'])} rules ran, none violated")
    if rp.get("diverged"):
        verdict += "; the replay diverged"
    out.append(verdict)
    return "\n".join(out)


def write_json_atomic(data: dict, path: Path) -> None:
    """Write JSON to a temporary file beside `path`, then rename it over `path`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1)
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


# ------------------------------------------------------------------------------ CLI


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "check-trace", help="check a trace (e.g. your engine's) against the spec's rules",
        description="Check a schema-v1 trace (JSONL or CSV) against the spec's rules, each where "
                    "its fields are present, and replay it through the reference lengths "
                    "simulator when a scenario is known. Exit 0 clean, 1 a rule violated or the "
                    "replay diverged, 2 a malformed trace or bad usage.")
    p.add_argument("trace", type=Path, help="trace file (.jsonl, or .csv)")
    p.add_argument("--scenario", type=Path, help="scenario file (.toml or .json) for the replay and the "
                                                 "group-count rule (default: the trace header's)")
    p.add_argument("--json", type=Path, metavar="PATH", help="also write the result as JSON")
    p.add_argument("--limit", type=int, default=100, metavar="N",
                   help="violation lines printed at most (default 100; 0: all)")
    return p


def run(args) -> int:
    """The subcommand; raises ValueError (exit 2 in the CLI) on bad usage or a bad trace."""
    from reference.scenario import load_scenario
    from reference.trace_reader import read_trace_strict

    if not args.trace.is_file():
        raise ValueError(f"trace file {args.trace} does not exist")
    if args.json is not None and args.json.resolve() == args.trace.resolve():
        raise ValueError(f"--json {args.json} is the trace itself; refusing to overwrite it")
    if args.limit < 0:
        raise ValueError(f"--limit {args.limit}: must be >= 0")
    scenario = None
    if args.scenario is not None:
        if not args.scenario.is_file():
            raise ValueError(f"scenario file {args.scenario} does not exist")
        scenario = load_scenario(args.scenario)
    trace = read_trace_strict(args.trace)
    result = check(trace, scenario)
    print(render(result, str(args.trace), args.limit))
    code = exit_code(result)
    if args.json is not None:
        write_json_atomic({"schema": JSON_SCHEMA, "version": JSON_VERSION, "trace": str(args.trace),
                           "exit": code, **result}, args.json)
        print(f"wrote {args.json}", file=sys.stderr)
    return code
