"""The mutation gate and its report: the documented equivalents
(`mutation/equivalent.toml`), the verdict (which entries and survivors fail it, and
why), the tables printed and the sections written into docs/mutation.md."""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass
from pathlib import Path

from raggedspec.mutation.catalogue_run import MutantResult
from raggedspec.mutation.mutmut_run import ModuleResult, MutmutReport
from raggedspec.mutation.record import updated
from raggedspec.mutation.scope import EXCLUDED, MUTMUT_MODULES

EQUIVALENT = Path(__file__).resolve().parent / "equivalent.toml"


THRESHOLD = 95.0


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

    def norm(s: str) -> str:
        return re.sub(r"\s+", "", s)

    for e in equivalents["mutmut"]:
        if e["function"] == survivor["function"] and norm(e["line"]) == norm(survivor["line"]):
            return e["why"]
    return None


# --------------------------------------------------------------------------- gate


@dataclass
class Verdict:
    ok: bool
    reasons: list[str]


def gate(
    results: list[MutantResult] | None,
    report: MutmutReport | None,
    equivalents: dict,
    threshold: float = THRESHOLD,
    baseline_red: list[str] = (),
    allow_red: bool = False,
) -> Verdict:
    """Every reason the run fails the gate (none: it passes). mutmut: each module must score
    at least `threshold` and have mutants; every survivor must be a documented equivalent."""
    reasons = []
    if baseline_red and not allow_red:
        reasons.append(f"the unmutated tests are red: {', '.join(baseline_red)}")
    for r in results or []:
        if r.ok:
            if r.expect == "survive" and r.name not in equivalents["catalogue"]:
                reasons.append(
                    f"catalogue: '{r.name}' is expected to survive but has no justification "
                    f"in equivalent.toml"
                )
            continue
        if r.expect == "survive":
            reasons.append(
                f"catalogue: '{r.name}' was expected to survive (a documented equivalent) but is "
                f"{r.status} ({r.detail}): the equivalence claim is wrong"
            )
        elif r.status == "SURVIVED" and r.name in equivalents["catalogue"]:
            continue
        else:
            reasons.append(f"catalogue: '{r.name}' {r.status} ({r.detail})")
    if report is not None:
        if report.modules:
            for name, mod in report.modules.items():
                if mod.mutants == 0:
                    reasons.append(f"mutmut: {name} has no mutants (nothing mutmut can mutate: "
                                   f"move it to EXCLUDED in mutation/scope.py with the reason)")
                elif mod.score < threshold:
                    reasons.append(f"mutmut: {name} scores {mod.score:.1f}%, under "
                                   f"{threshold:.0f}%")
        elif report.score < threshold:
            reasons.append(f"mutmut: score {report.score:.1f}% is under {threshold:.0f}%")
        for s in report.survivors:
            if equivalent_for(s, equivalents) is None:
                reasons.append(
                    f"mutmut: {s['key']} {s['status']} and is not in equivalent.toml: {s['line']}"
                )
    return Verdict(not reasons, reasons)


# --------------------------------------------------------------------------- output


def catalogue_table(results: list[MutantResult]) -> list[str]:
    lines = [
        "| # | mutant | file | spec | result | first failing test |",
        "|---|---|---|---|---|---|",
    ]
    for i, r in enumerate(results, 1):
        status = r.status + (
            " (equivalent)" if r.expect == "survive" and r.status == "SURVIVED" else ""
        )
        lines.append(f"| {i} | {r.name} | `{r.file}` | {r.spec} | {status} | "
                     f"{'`' + r.detail + '`' if r.status == 'CAUGHT' else r.detail} |")
    return lines


def mutmut_table(report: MutmutReport) -> list[str]:
    lines = [
        "| function | mutants | killed | survived | timeouts | other |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in report.rows:
        lines.append(
            f"| `{r.function}` | {r.mutants} | {r.killed} | {r.survived} | {r.timeouts} | "
            f"{r.other} |"
        )
    s = report.stats
    lines.append(
        f"| **total** | {s.get('total', 0)} | {s.get('killed', 0)} | {s.get('survived', 0)} | "
        f"{s.get('timeout', 0)} | "
        f"{s.get('no_tests', 0) + s.get('suspicious', 0) + s.get('skipped', 0)} |"
    )
    return lines


def print_mutmut(report: MutmutReport, equivalents: dict, log=print) -> None:
    w = max([len(r.function) for r in report.rows] + [8])
    log(f"{'function':{w}}  mutants  killed  survived  timeouts  other")
    for r in report.rows:
        log(
            f"{r.function:{w}}  {r.mutants:7}  {r.killed:6}  {r.survived:8}  {r.timeouts:8}  "
            f"{r.other:5}"
        )
    s = report.stats
    log(f"{'total':{w}}  {s.get('total', 0):7}  {s.get('killed', 0):6}  {s.get('survived', 0):8}  "
        f"{s.get('timeout', 0):8}  {s.get('no_tests', 0) + s.get('suspicious', 0):5}")
    log(
        f"mutmut score: {report.score:.1f}% = (killed + timeout) / (total - skipped) "
        f"= ({s.get('killed', 0)} + {s.get('timeout', 0)}) / ({s.get('total', 0)} - "
        f"{s.get('skipped', 0)})"
    )
    for sv in report.survivors:
        why = equivalent_for(sv, equivalents)
        log(
            f"  {sv['status']}: {sv['key']}: {sv['line']}  -> "
            f"{'equivalent: ' + why if why else 'NOT JUSTIFIED'}"
        )


BEGIN, END = "<!-- BEGIN generated:{} -->", "<!-- END generated:{} -->"


def _replace_section(doc: str, name: str, body: list[str]) -> str:
    b, e = BEGIN.format(name), END.format(name)
    block = "\n".join([b, *body, e])
    if b in doc and e in doc:
        return doc[: doc.index(b)] + block + doc[doc.index(e) + len(e):]
    return doc.rstrip("\n") + "\n\n" + block + "\n"


def module_ok(mod: ModuleResult, equivalents: dict, threshold: float = THRESHOLD) -> bool:
    """Whether one module passes the mutmut gate on its own."""
    return (mod.mutants > 0 and mod.score >= threshold
            and all(equivalent_for(s, equivalents) is not None for s in mod.survivors))


def module_table(record: dict, modules: list[str]) -> list[str]:
    """The per-module table of docs/mutation.md, one row per module (recorded or not)."""
    lines = ["| module | mutants | killed | survived | timeout | other | score | gate | run |",
             "|---|---:|---:|---:|---:|---:|---:|---|---|"]
    rec = record.get("modules", {})
    for m in modules:
        e = rec.get(m)
        if e is None:
            lines.append(f"| `{m}` | | | | | | | not run yet | |")
            continue
        lines.append(
            f"| `{m}` | {e['mutants']} | {e['killed']} | {e['survived']} | {e['timeouts']} | "
            f"{e['other'] + e['skipped']} | {e['score']:.1f}% | {'pass' if e['ok'] else 'FAIL'}"
            f" | {e['date']}, {e['seconds']:.0f} s{' (continued)' if e.get('base') else ''}"
            f"{' (cached)' if e.get('reused') else ''} |")
    return lines


def scope_tables() -> list[str]:
    """mutation/scope.py as two tables: each mutated module with its tests, and the
    exclusions with their reasons."""
    lines = ["| mutated module | tests its mutants run |", "|---|---|"]
    lines += [f"| `{m}` | {', '.join('`' + t.removeprefix('conformance/') + '`' for t in ts)} |"
              for m, ts in MUTMUT_MODULES.items()]
    lines += ["", "| not mutated | why |", "|---|---|"]
    lines += [f"| `{p}` | {why} |" for p, why in EXCLUDED.items()]
    return lines


def write_docs(path: Path, results: list[MutantResult] | None, report: MutmutReport | None,
               equivalents: dict, command: str, seconds: float, when: str,
               record: dict | None = None, threshold: float = THRESHOLD) -> dict | None:
    """Replace the generated sections of `path` that this run produced (one catalogue section
    per scope, the per-module mutmut table rendered from `record` (this run's modules
    already in it; without a record, from this run alone), the scope tables and the
    equivalent list); hand-written text between them is kept. Returns the updated record
    (None when the run had no mutmut part)."""
    rec = None
    doc = path.read_text() if path.is_file() else "# Mutation testing\n"
    for scope in ("reference", "gpu"):
        rs = [r for r in results or [] if (r.file.startswith("gpu/")) == (scope == "gpu")]
        if not rs:
            continue
        caught = sum(r.status in ("CAUGHT", "TIMEOUT") for r in rs)
        survived = sum(r.status == "SURVIVED" for r in rs)
        eq = sum(r.expect == "survive" and r.status == "SURVIVED" for r in rs)
        body = [
            f"`{command}` ({when}; the whole run took {seconds:.0f} s wall): {len(rs)} entries, "
            f"**{caught} caught, {survived} survived** ({eq} of them the documented equivalent), "
            f"{len(rs) - caught - survived} other.",
            "",
            *catalogue_table(rs),
        ]
        doc = _replace_section(doc, f"catalogue-{scope}", body)
    if report is not None:
        ok = {m: module_ok(r, equivalents, threshold) for m, r in report.modules.items()}
        rec = updated(record if record is not None else {"modules": {}}, report.modules, ok,
                      when)
        names = list(MUTMUT_MODULES) + sorted(m for m in rec["modules"] if m not in MUTMUT_MODULES)
        reused = sum(r.reused for r in report.modules.values())
        body = [f"Last run: `{command}` ({when}; mutmut took {report.seconds:.0f} s wall for "
                f"{len(report.modules)} module(s), {reused} of them reused from the cache). "
                f"Each row is the module's last recorded run "
                f"(`mutation/mutmut_record.json`); score = (killed + timeout) / "
                f"(mutants - skipped); gate: score >= {threshold:.0f}% and every survivor in "
                f"`mutation/equivalent.toml`.", "", *module_table(rec, names), ""]
        survivors = [(m, sv) for m in names for sv in rec["modules"].get(m, {})
                     .get("survivors", [])]
        if survivors:
            body += ["Survivors (each must be in `mutation/equivalent.toml`):", ""]
            for _, sv in survivors:
                why = equivalent_for(sv, equivalents)
                body.append(f"- `{sv['key']}` ({sv['status']}): `{sv['line']}` — "
                            f"{why if why else '**not justified**'}")
        else:
            body.append("No survivors.")
        doc = _replace_section(doc, "mutmut-modules", body)
    doc = _replace_section(doc, "mutmut-scope", scope_tables())
    eq = ["| kind | mutant | why it cannot be caught |", "|---|---|---|"]
    eq += [f"| catalogue | {name} | {why} |" for name, why in equivalents["catalogue"].items()]
    eq += [
        f"| mutmut | `{e['function']}`: `{e['line']}` | {e['why']} |" for e in equivalents["mutmut"]
    ]
    doc = _replace_section(doc, "equivalents", eq)
    path.write_text(doc)
    return rec
