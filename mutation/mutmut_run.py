"""Running mutmut 3.8 in its own workspace and reading its results: the stats file,
the score (killed + timeout) / (total - skipped), the per-function table and each
survivor's mutated line, read from the `mutants/` dir without importing mutmut."""

from __future__ import annotations

import ast
import difflib
import json
import re
import subprocess
import sys
import textwrap
import time
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from raggedspec.mutation.catalogue_run import CatalogueError, _baseline_run
from raggedspec.mutation.workspace import ROOT, _env, make_workspace, nested_path

# mutmut 3.8's exit-code -> status table (mutmut/stats.py), copied so reading results does
# not import mutmut's global state.
STATUS_BY_EXIT_CODE = {1: "killed", 3: "killed", 0: "survived", 5: "no tests", 2: "interrupted",
                       None: "not checked", 33: "no tests", 34: "skipped", 35: "suspicious",
                       36: "timeout", 37: "caught by type check", -24: "timeout", 24: "timeout",
                       152: "timeout", 255: "timeout", -11: "segfault", -9: "segfault"}
NOT_KILLED = ("survived", "no tests", "suspicious", "segfault", "not checked", "interrupted")

# mutmut's scope per mode: what is mutated, and (fast) which tests the stats run uses.
MUTMUT_FULL = {"reference": ["reference/dispatch.py", "reference/step.py"],
               "gpu": ["gpu/dispatch.py"]}
MUTMUT_FAST = {"reference": ["reference/dispatch.py"], "gpu": ["gpu/dispatch.py"]}
FAST_TESTS = {"reference": ["conformance/test_dispatch.py", "conformance/test_draft.py",
                            "conformance/test_mutation_kills.py"],
              "gpu": ["conformance/test_port_dispatch.py"]}


@dataclass
class FunctionRow:
    function: str
    mutants: int = 0
    killed: int = 0
    survived: int = 0
    timeouts: int = 0
    other: int = 0  # no tests, suspicious, skipped, ...


@dataclass
class MutmutReport:
    stats: dict
    rows: list[FunctionRow]
    survivors: list[dict]  # {"key", "function", "status", "line"}
    seconds: float = 0.0
    only_mutate: list[str] = field(default_factory=list)

    @property
    def score(self) -> float:
        return score_of(self.stats)


def score_of(stats: dict) -> float:
    """(killed + timeout) / (total - skipped), in percent (0 when nothing was tested)."""
    tested = int(stats.get("total", 0)) - int(stats.get("skipped", 0))
    if tested <= 0:
        return 0.0
    return 100.0 * (int(stats.get("killed", 0)) + int(stats.get("timeout", 0))) / tested


def read_stats(path: Path) -> dict:
    """`mutants/mutmut-cicd-stats.json` as a dict, with the score added."""
    stats = json.loads(Path(path).read_text())
    stats["score"] = score_of(stats)
    return stats


_KEY = re.compile(
    r"^(?P<module>.+?)\.(?:x_(?P<func>\w+?)|xǁ(?P<cls>\w+)ǁ(?P<meth>\w+?))__mutmut_(?P<n>\d+)$"
)


def function_of(key: str) -> str:
    """'reference.dispatch.x_chain_start_of__mutmut_3' -> 'reference.dispatch.chain_start_of';
    methods as 'module.Class.method'."""
    m = _KEY.match(key)
    if not m:
        return key
    if m.group("func"):
        return f"{m.group('module')}.{m.group('func')}"
    return f"{m.group('module')}.{m.group('cls')}.{m.group('meth')}"


def _functions_in(source: str) -> dict[str, str]:
    """Every (possibly nested in a class) function's source, by name (linear in the file:
    mutmut's mutated files hold one copy of a function per mutant)."""
    lines = source.splitlines()
    out = {}
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            out[node.name] = textwrap.dedent("\n".join(lines[node.lineno - 1: node.end_lineno]))
    return out


def mutated_lines(mutated_file_source: str | dict[str, str], key: str) -> list[str]:
    """The statements of mutant `key` that differ from the original function, each on one
    line (a multi-line simple statement is joined; a compound one shows its changed lines).
    `mutated_file_source` is the mutated file's text or its `_functions_in` (parse once)."""
    funcs = (
        mutated_file_source
        if isinstance(mutated_file_source, dict)
        else _functions_in(mutated_file_source)
    )
    local = key.rsplit(".", 1)[1]
    orig = re.sub(r"__mutmut_\d+$", "__mutmut_orig", local)
    a, b = funcs.get(orig, ""), funcs.get(local, "")
    if not b:
        return ["<mutant not found>"]
    a_lines, b_lines = (
        a.splitlines()[1:],
        b.splitlines()[1:],
    )  # the def lines differ only in the name
    changed: list[int] = []  # 0-based indices into b_lines
    for tag, _, _, j1, j2 in difflib.SequenceMatcher(
        None, a_lines, b_lines, autojunk=False
    ).get_opcodes():
        if tag in ("replace", "insert"):
            changed.extend(range(j1, j2))
        elif tag == "delete":
            changed.append(min(j1, len(b_lines) - 1))
    try:
        body = ast.parse(textwrap.dedent(b)).body[0]
    except SyntaxError:
        body = None
    simple = (
        [n for n in ast.walk(body) if isinstance(n, ast.stmt) and not hasattr(n, "body")]
        if body
        else []
    )
    out: list[str] = []
    for i in changed:
        line_no = i + 2  # 1-based, in the function including its def line
        stmt = next((n for n in simple if n.lineno <= line_no <= n.end_lineno), None)
        if stmt is not None:
            text = " ".join(
                line.strip() for line in b.splitlines()[stmt.lineno - 1: stmt.end_lineno]
            )
        else:
            text = b_lines[i].strip()
        text = re.sub(r"\(\s+", "(", re.sub(r"\s+\)", ")", text))
        if text not in out:
            out.append(text)
    return out or ["<no textual change>"]


def read_mutants_dir(mutants: Path) -> MutmutReport:
    """Per-function rows and survivors from a mutmut `mutants/` dir (its *.meta files, the
    mutated sources and mutmut-cicd-stats.json)."""
    rows: dict[str, FunctionRow] = {}
    survivors = []
    for meta in sorted(mutants.rglob("*.py.meta")):
        data = json.loads(meta.read_text())
        src_path = meta.with_suffix("")  # drop .meta
        src = _functions_in(src_path.read_text()) if src_path.is_file() else {}
        for key, code in sorted(
            data.get("exit_code_by_key", {}).items(), key=lambda kv: _natural(kv[0])
        ):
            status = STATUS_BY_EXIT_CODE.get(code, "suspicious")
            func = function_of(key)
            row = rows.setdefault(func, FunctionRow(func))
            row.mutants += 1
            if status in ("killed", "caught by type check"):
                row.killed += 1
            elif status == "timeout":
                row.timeouts += 1
            elif status == "survived":
                row.survived += 1
            else:
                row.other += 1
            if status in NOT_KILLED:
                survivors.append({"key": key, "function": func, "status": status,
                                  "line": " | ".join(mutated_lines(src, key)) if src else "?"})
    stats_path = mutants / "mutmut-cicd-stats.json"
    if stats_path.is_file():
        stats = read_stats(stats_path)
    else:  # derive from the meta files
        stats = {
            "killed": sum(r.killed for r in rows.values()),
            "survived": sum(r.survived for r in rows.values()),
            "timeout": sum(r.timeouts for r in rows.values()),
            "total": sum(r.mutants for r in rows.values()),
            "skipped": 0,
        }
        stats["score"] = score_of(stats)
    mutated = sorted(
        str(m.relative_to(mutants).with_suffix("")) for m in mutants.rglob("*.py.meta")
    )
    return MutmutReport(
        stats, sorted(rows.values(), key=lambda r: r.function), survivors, 0.0, mutated
    )


def split_report(report: MutmutReport) -> dict[str, MutmutReport]:
    """The report per scope ("reference", "gpu"), from its rows and survivors (stats summed
    over the scope's functions)."""
    out = {}
    for scope in sorted({r.function.split(".")[0] for r in report.rows}):
        rows = [r for r in report.rows if r.function.startswith(scope + ".")]
        stats = {"killed": sum(r.killed for r in rows), "survived": sum(r.survived for r in rows),
                 "timeout": sum(r.timeouts for r in rows), "total": sum(r.mutants for r in rows),
                 "skipped": 0, "no_tests": sum(r.other for r in rows), "suspicious": 0}
        stats["score"] = score_of(stats)
        out[scope] = MutmutReport(
            stats,
            rows,
            [s for s in report.survivors if s["function"].startswith(scope + ".")],
            report.seconds,
            [p for p in report.only_mutate if p.startswith(scope + "/")],
        )
    return out


def _natural(key: str):
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", key)]


def _mutmut_config(workdir: Path) -> dict:
    return tomllib.loads((workdir / "pyproject.toml").read_text())["tool"]["mutmut"]


def _set_mutmut_config(workdir: Path, only_mutate: list[str], selection: list[str] | None) -> None:
    """Rewrite the copy's [tool.mutmut] `only_mutate` and (when given) the stats-run test
    selection. Only ever called on a workspace copy."""
    py = workdir / "pyproject.toml"
    text = py.read_text()
    text = re.sub(
        r"(?m)^only_mutate = .*$", lambda _: "only_mutate = " + json.dumps(only_mutate), text
    )
    if selection is not None:
        text = re.sub(
            r"(?m)^pytest_add_cli_args_test_selection = .*$",
            lambda _: "pytest_add_cli_args_test_selection = " + json.dumps(selection),
            text,
        )
    py.write_text(text)


def run_mutmut(scopes: list[str], fast: bool, root: Path = ROOT, jobs: int = 2, log=print,
               timeout: float = 3600) -> tuple[MutmutReport, list[str]]:
    """mutmut in a fresh copy: a baseline of its test selection (failing tests are
    deselected and returned: mutmut refuses to start on a red suite), `run`, then
    `export-cicd-stats`; (the report, the baseline failures)."""
    table = MUTMUT_FAST if fast else MUTMUT_FULL
    if fast and "reference" in scopes:
        scopes = ["reference"]  # the CI gate mutates one dispatch module: the reference's
    only = [p for s in scopes for p in table[s] if (root / p).is_file()]
    if not only:
        raise CatalogueError(f"nothing to mutate for scope {scopes}")
    ws = make_workspace(root, "mutmut", nested=True)
    if fast:
        selection = [nested_path(t) for s in scopes for t in FAST_TESTS[s] if (root / t).exists()]
    else:
        selection = list(_mutmut_config(ws)["pytest_add_cli_args_test_selection"])
        if "gpu" not in scopes:
            selection += [f"--ignore={nested_path(p.relative_to(root).as_posix())}"
                          for p in sorted((root / "conformance").glob("test_port_*.py"))]
    t0 = time.monotonic()
    red, secs = _baseline_run(ws, selection, jobs)
    log(f"mutmut baseline: {'green' if not red else 'RED: ' + ', '.join(red)} ({secs:.1f} s)")
    _set_mutmut_config(
        ws, [nested_path(p) for p in only], selection + [f"--deselect={t}" for t in red]
    )
    log(f"mutmut: mutating {', '.join(only)}")
    env = _env()
    p = subprocess.run(
        [sys.executable, "-m", "mutmut", "run", "--max-children", str(jobs)],
        cwd=ws,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    tail = "\n".join(p.stdout.replace("\r", "\n").splitlines()[-8:])
    if p.returncode != 0:
        raise RuntimeError(f"mutmut run failed (exit {p.returncode}):\n{tail}\n{p.stderr[-3000:]}")
    q = subprocess.run([sys.executable, "-m", "mutmut", "export-cicd-stats"], cwd=ws, env=env,
                       capture_output=True, text=True)
    if q.returncode != 0:
        raise RuntimeError(f"mutmut export-cicd-stats failed: {q.stdout}{q.stderr}")
    report = read_mutants_dir(ws / "mutants")
    report.seconds = time.monotonic() - t0
    report.only_mutate = only
    return report, red
