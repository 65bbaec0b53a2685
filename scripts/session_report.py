"""The device script's reports (scripts/gpu_session.py): `results.json` (every step's row and
the JSON each step wrote, the conformance counts and failures) and `summary.md` (the headline
numbers first, then the steps, the notes, step 0, the environment, the preflight, the
conformance counts and the other tables). Both are rebuilt from the work folder after every
step, so a run cut short shows what did finish; a file that is missing or half-written is left
out, never guessed at. Stdlib only.
"""

from __future__ import annotations

import json
import time
import xml.etree.ElementTree as ET
from pathlib import Path

SCHEMA = "raggedspec-device-run/1"
LISTED_FAILURES = 30  # failing tests named in summary.md (results.json holds them all)


def read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def step_output(work: Path, result: str) -> dict | None:
    """The JSON a step wrote, or the partial one a bench cut short leaves."""
    path = work / result
    return read_json(path) or read_json(path.with_name(path.stem + ".partial.json"))


def results(run: dict, steps: list, work: Path) -> dict:
    """results.json: `run` (mode, deadline, elapsed, rows, notes, exit code) with every step's
    own JSON under `outputs` and the JUnit counts and failures under `conformance`."""
    outputs = {st.name: step_output(work, st.result) for st in steps if st.result}
    rows, failures = junit_counts(work / "junit")
    return dict(run, schema=SCHEMA, outputs=outputs,
                conformance={"files": rows, "failures": failures})


def junit_counts(folder: Path) -> tuple[list[dict], list[dict]]:
    """Per step and test file: tests, passed, failures, errors, skipped from the JUnit XML
    there; and each failed or erroring test with the last line of its report."""
    rows, failures = [], []
    for xml in sorted(folder.glob("*/*.xml")):
        try:
            suite = ET.parse(xml).getroot()
        except ET.ParseError:
            continue
        n, f, e, sk = (int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped"))
        rows.append({"step": xml.parent.name, "file": xml.name, "tests": n,
                     "passed": n - f - e - sk, "failed": f, "errors": e, "skipped": sk})
        for case in suite.iter("testcase"):
            for bad in list(case.findall("failure")) + list(case.findall("error")):
                failures.append({"step": xml.parent.name, "test": f"{suite.get('name')}::"
                                 f"{case.get('name')}", "message": bad.get("message", "")})
    return rows, failures


def render_summary(res: dict, work: Path) -> str:
    """summary.md from results.json's dict (and the bench tables in the work folder)."""
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    state = "finished" if res.get("finished") else "in progress"
    lines = [f"# Device run summary ({res['mode']}, {stamp}, {state}: {res['elapsed_s']:.0f} s "
             f"of a {res['deadline_s']:g} s deadline" + exit_note(res) + ")"]
    lines += headline_section(res["outputs"].get("headline"))
    lines += verdict_lines(work / "headline" / "bench.md")
    lines += steps_section(res["steps"])
    if res["notes"]:
        lines += ["", "## Notes", ""] + [f"- {n}" for n in res["notes"]]
    lines += imports_section(res["outputs"].get("imports"))
    lines += env_section(res["outputs"].get("env"))
    lines += preflight_section(res["outputs"].get("preflight"))
    lines += conformance_section(res["conformance"])
    for title, name, md in (("flex_attention at the headline sizes", "flex", "flex/bench.md"),
                            ("The rest of the benchmark", "bench", "bench/bench.md"),
                            ("End to end, torch backend", "e2e", "e2e/e2e.md"),
                            ("End to end, CuPy kernels", "e2e_cupy", "e2e_cupy/e2e.md")):
        lines += table_section(title, work / md) or bench_rows_section(title,
                                                                       res["outputs"].get(name))
    return "\n".join(lines) + "\n"


def exit_note(res: dict) -> str:
    return "" if res.get("exit_code") is None else f", exit {res['exit_code']}"


def bound_ms(bench: dict, row: dict) -> float:
    """The live-KV bound of a bench row: live K+V bytes over the run's best copy bandwidth."""
    best = max(m["GBps"] for m in bench["copy_bandwidth"])
    return row["live_kv_bytes"] / (best * 1e9) * 1e3


def headline_section(bench: dict | None) -> list[str]:
    """The headline table: per w, the bound, the CuPy kernel alone and with its wrapper (x the
    bound), the wrapper's overhead, padded SDPA and the per-row loop; 'not measured' before
    the step has finished a case."""
    head = ["", "## Headline: ragged verify kernel vs the live-KV bound", ""]
    rows = [r for r in (bench or {}).get("rows", []) if "strategies" in r]
    if not rows or not bench.get("copy_bandwidth"):
        return head + ["Not measured (see the steps table)."]
    if bench.get("smoke"):
        head += ["**SMOKE (CPU, g++ emulator, tiny sizes): no performance claim.**", ""]
    lines = head + ["| w | B | L | spread | bound ms | CuPy kernel ms (x bound) | CuPy call ms "
                    "(x bound) | wrapper overhead ms | padded SDPA ms (x bound) | per-row loop "
                    "ms (x bound) |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        bound, st = bound_ms(bench, r), r["strategies"]
        cupy = st.get("cupy", {})
        lines.append(f"| {r['w']} | {r['B']} | {r['L']} | {r['spread']} | {bound:.4f} | "
                     f"{timed(cupy, 'kernel_ms', bound)} | {timed(cupy, 'ms', bound)} | "
                     f"{number(cupy.get('wrapper_ms'))} | "
                     f"{timed(st.get('padded_sdpa', {}), 'ms', bound)} | "
                     f"{timed(st.get('per_row', {}), 'ms', bound)} |")
    notes = bench.get("notes", {}).get("cupy") or bench.get("not_run", {}).get("cupy")
    return lines + (["", f"CuPy: {notes}"] if notes else [])


def verdict_lines(bench_md: Path) -> list[str]:
    """The bench's own headline lines (each strategy x the bound, the targets' verdict), once
    the headline step has finished and written its table."""
    try:
        found = [line for line in bench_md.read_text().splitlines()
                 if line.startswith("- headline ")]
    except OSError:
        return []
    return [""] + found if found else []


def timed(res: dict, key: str, bound: float) -> str:
    """`ms (x bound)`, or the strategy's status (and reason) where it has no such time."""
    if key in res:
        return f"{res[key]:.3f} ({res[key] / bound:.2f}x)"
    why = res.get("reason") or res.get("error") or (f"err {res['err']:.2g}" if "err" in res
                                                    else "")
    return (res.get("status", "absent") + (f": {why}" if why else "")).replace("|", "/")[:200]


def number(x) -> str:
    return "-" if x is None else f"{x:.3f}"


def steps_section(rows: list[dict]) -> list[str]:
    lines = ["", "## Steps", "", "| step | status | s | limit s | what |", "|---|---|---|---|---|"]
    lines += [f"| {r['step']} | {r['status']} | {r['seconds']} | {r['limit']} | {r['what']} |"
              for r in rows]
    return lines + ["", "Commands:", ""] + [f"- {r['step']}: `{r['command']}`" for r in rows]


def imports_section(rec: dict | None) -> list[str]:
    if not rec:
        return []
    lines = ["", "## Step 0: imports", "", f"Python {rec['python']} ({rec['executable']}); "
             f"the project from {rec['root']}."]
    if rec.get("failed"):
        lines.append(f"FAILED: {rec['failed']}")
    elif rec.get("importing"):
        lines.append(f"Stopped while importing {rec['importing']}.")
    versions = [f"{m['module']} {m['version']}" for m in rec["modules"] if m.get("version")]
    lines += [f"Versions: {', '.join(versions)}."] if versions else []
    if rec.get("device"):
        lines.append("Device: " + "; ".join(f"{k} {v}" for k, v in rec["device"].items()) + ".")
    return lines


def env_section(env_file: dict | None) -> list[str]:
    env = (env_file or {}).get("environment")
    if not env:
        return []
    return ["", "## Environment", "", "```"] + [f"{k}: {v}" for k, v in env.items()] + ["```"]


def preflight_section(pf: dict | None) -> list[str]:
    if not pf:
        return []
    if pf.get("failed"):
        head = f"FAILED: {', '.join(pf['failed'])}; not run after it: " + (
            ", ".join(pf.get("not_run", [])) or "none")
    elif pf.get("running"):
        head = f"stopped while running {pf['running']}"
    else:
        head = "no check failed"
    lines = ["", f"## Preflight ({pf.get('mode')}): {head}", "", "| check | status | s | detail |",
             "|---|---|---|---|"]
    for c in pf.get("checks", []):
        lines.append(f"| {c['check']} | {c['status']} | {c['seconds']} | "
                     f"{plain(c['detail']).replace('|', '/')[:400]} |")
    return lines


def plain(detail) -> str:
    """A check's detail as one line: a string as it is; a dict as `key value` pairs, numbers
    to 4 significant digits, nested values as JSON."""
    if isinstance(detail, str):
        return detail
    if not isinstance(detail, dict):
        return json.dumps(detail, default=str)
    return "; ".join(
        f"{k} {v:.4g}" if isinstance(v, float)
        else f"{k} {json.dumps(v, default=str)}" if isinstance(v, (dict, list))
        else f"{k} {v}"
        for k, v in detail.items()
    )


def conformance_section(conf: dict) -> list[str]:
    """The JUnit counts per step and file, then the first failing tests by name."""
    if not conf["files"]:
        return []
    lines = ["", "## Conformance (JUnit per file)", "",
             "| step | file | passed | failed | errors | skipped |", "|---|---|---|---|---|---|"]
    lines += [f"| {r['step']} | {r['file']} | {r['passed']} | {r['failed']} | {r['errors']} "
              f"| {r['skipped']} |" for r in conf["files"]]
    bad = conf["failures"]
    if bad:
        lines += ["", f"Failing tests ({len(bad)}; the first {LISTED_FAILURES} here, all in "
                  "results.json):", ""]
        lines += [f"- {b['step']}: `{b['test']}`: {b['message'][:300]}"
                  for b in bad[:LISTED_FAILURES]]
    return lines


def bench_rows_section(title: str, result: dict | None) -> list[str]:
    """A bench cut short leaves its JSON without its table: its finished cases, one line per
    case and strategy (status, ms), from the JSON (`raggedspec bench --replot` makes the
    full table from it)."""
    if not result or not isinstance(result.get("rows"), list):
        return []
    lines = ["", f"## {title} (cut short: the cases its JSON holds)", ""]
    for row in result["rows"]:
        case = f"w={row.get('w')} B={row.get('B')} L={row.get('L')} spread={row.get('spread')}"
        if "error" in row or not isinstance(row.get("strategies"), dict):
            lines.append(f"- {case}: {row.get('error', 'no strategy results')}")
            continue
        cells = [f"{name} {res.get('status')}" + (f" {res['ms']:.3f} ms" if "ms" in res else "")
                 for name, res in row["strategies"].items()]
        lines.append(f"- {case}: " + ", ".join(cells))
    return lines


def table_section(title: str, path: Path) -> list[str]:
    if not path.is_file():
        return []
    return ["", f"## {title}", "", path.read_text()]
