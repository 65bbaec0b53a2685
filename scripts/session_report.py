"""summary.md of the GPU run script (scripts/gpu_session.py): the step table, then what
the work folder holds so far (the environment, the preflight's checks, the JUnit counts per
test file, the benchmark and end-to-end tables). Every part is read from the files the steps
wrote, so a summary rewritten after a step that was killed shows what did finish; a file
that is missing or half-written is left out, never guessed at. Stdlib only.
"""

from __future__ import annotations

import json
import time
import xml.etree.ElementTree as ET
from pathlib import Path


def render_summary(
    mode: str, elapsed: float, deadline: float, rows: list[dict], notes: list[str], work: Path
) -> str:
    """summary.md: the step table (status, seconds, limit), the commands, the notes, then
    whatever the work folder holds so far: environment, preflight, JUnit counts, tables."""
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    lines = [
        f"# GPU run summary ({mode}, {stamp}, {elapsed:.0f} s of a {deadline:g} s deadline)",
        "",
        "| step | status | s | limit s | what |",
        "|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['step']} | {r['status']} | {r['seconds']} | {r['limit']} | {r['what']} |"
        for r in rows
    ]
    lines += ["", "Commands:", ""] + [f"- {r['step']}: `{r['command']}`" for r in rows]
    if notes:
        lines += ["", "## Notes", ""] + [f"- {n}" for n in notes]
    lines += _env_section(work / "env.json")
    lines += _preflight_section(work / "preflight.json")
    lines += _junit_section(work / "junit")
    for title, md in (
        ("Headline", "headline/bench.md"),
        ("Bench", "bench/bench.md"),
        ("End to end, torch backend", "e2e/e2e.md"),
        ("End to end, cupy backend", "e2e_cupy/e2e.md"),
    ):
        lines += _table_section(title, work / md) or _bench_rows_section(title, work / md)
    return "\n".join(lines) + "\n"


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _env_section(path: Path) -> list[str]:
    env = (_read_json(path) or {}).get("environment")
    if not env:
        return []
    return ["", "## Environment", "", "```"] + [f"{k}: {v}" for k, v in env.items()] + ["```"]


def _preflight_section(path: Path) -> list[str]:
    pf = _read_json(path)
    if not pf:
        return []
    head = "FAILED: " + ", ".join(pf["failed"]) if pf.get("failed") else "no check failed"
    lines = [
        "",
        f"## Preflight ({pf.get('mode')}): {head}",
        "",
        "| check | status | s | detail |",
        "|---|---|---|---|",
    ]
    for c in pf.get("checks", []):
        detail = plain(c["detail"])
        lines.append(
            f"| {c['check']} | {c['status']} | {c['seconds']} | {detail.replace('|', '/')[:400]} |"
        )
    return lines


def plain(detail) -> str:
    """A check's detail as one line: a string as it is; a dict as `key value` pairs, numbers
    to 4 significant digits, nested values as JSON."""
    if isinstance(detail, str):
        return detail
    if not isinstance(detail, dict):
        return json.dumps(detail, default=str)
    return "; ".join(
        f"{k} {v:.4g}"
        if isinstance(v, float)
        else f"{k} {json.dumps(v, default=str)}"
        if isinstance(v, (dict, list))
        else f"{k} {v}"
        for k, v in detail.items()
    )


def junit_counts(folder: Path) -> list[dict]:
    """Per step and test file: tests, failures, errors, skipped from the JUnit XML there."""
    rows = []
    for xml in sorted(folder.glob("*/*.xml")):
        try:
            s = ET.parse(xml).getroot()
        except ET.ParseError:
            continue
        n, f, e, sk = (int(s.get(k, 0)) for k in ("tests", "failures", "errors", "skipped"))
        rows.append(
            {
                "step": xml.parent.name,
                "file": xml.name,
                "tests": n,
                "passed": n - f - e - sk,
                "failed": f,
                "errors": e,
                "skipped": sk,
            }
        )
    return rows


def _junit_section(folder: Path) -> list[str]:
    rows = junit_counts(folder)
    if not rows:
        return []
    lines = [
        "",
        "## Conformance (JUnit per file)",
        "",
        "| step | file | passed | failed | errors | skipped |",
        "|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['step']} | {r['file']} | {r['passed']} | {r['failed']} | {r['errors']} "
        f"| {r['skipped']} |"
        for r in rows
    ]
    return lines


def _bench_rows_section(title: str, md: Path) -> list[str]:
    """A bench cut short leaves bench.json without bench.md: its finished cases, one line per
    case and strategy (status, ms), from the JSON (`raggedspec bench --replot` makes the full
    table from it)."""
    result = _read_json(md.with_suffix(".json")) or _read_json(md.with_suffix(".partial.json"))
    if not result or not isinstance(result.get("rows"), list):
        return []
    lines = ["", f"## {title} (cut short: the cases bench.json holds)", ""]
    for row in result["rows"]:
        case = f"w={row.get('w')} B={row.get('B')} L={row.get('L')} spread={row.get('spread')}"
        if "error" in row or not isinstance(row.get("strategies"), dict):
            lines.append(f"- {case}: {row.get('error', 'no strategy results')}")
            continue
        cells = []
        for name, res in row["strategies"].items():
            ms = res.get("ms")
            cells.append(
                f"{name} {res.get('status')}" + (f" {ms:.3f} ms" if ms is not None else "")
            )
        lines.append(f"- {case}: " + ", ".join(cells))
    return lines


def _table_section(title: str, path: Path) -> list[str]:
    if not path.is_file():
        return []
    return ["", f"## {title}", "", path.read_text()]
