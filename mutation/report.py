"""The mutation gate and its report: the documented equivalents
(`mutation/equivalent.toml`), the verdict (which entries and survivors fail it, and
why), the tables printed and the sections written into docs/mutation.md."""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass
from pathlib import Path

from raggedspec.mutation.catalogue_run import MutantResult
from raggedspec.mutation.mutmut_run import MutmutReport, split_report

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
        if report.score < threshold:
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
        body = [
            f"`{command}` ({when}; the whole run took {seconds:.0f} s wall): {len(rs)} entries, "
            f"**{caught} caught, {survived} survived** ({eq} of them the documented equivalent), "
            f"{len(rs) - caught - survived} other.",
            "",
            *catalogue_table(rs),
        ]
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
    eq += [
        f"| mutmut | `{e['function']}`: `{e['line']}` | {e['why']} |" for e in equivalents["mutmut"]
    ]
    doc = _replace_section(doc, "equivalents", eq)
    path.write_text(doc)
