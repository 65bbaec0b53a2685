"""Running mutmut 3.8 once per module, each in its own workspace with that module's covering
tests (`scope.MUTMUT_MODULES`), results reused from the cache when the module's key is
unchanged (mutmut_cache.py); and reading the results: the stats file, the score
(killed + timeout) / (total - skipped), the per-module and per-function counts and each
survivor's mutated line, read from the `mutants/` dir without importing mutmut."""

from __future__ import annotations

import ast
import difflib
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
import tomllib
from dataclasses import asdict, dataclass, field
from pathlib import Path

from raggedspec.mutation.catalogue_run import CatalogueError, _baseline_run
from raggedspec.mutation import mutmut_cache
from raggedspec.mutation.scope import MUTMUT_MODULES
from raggedspec.mutation.workspace import ROOT, _env, drop_workspace, make_workspace, nested_path

# mutmut 3.8's exit-code -> status table (mutmut/stats.py), copied so reading results does
# not import mutmut's global state.
STATUS_BY_EXIT_CODE = {1: "killed", 3: "killed", 0: "survived", 5: "no tests", 2: "interrupted",
                       None: "not checked", 33: "no tests", 34: "skipped", 35: "suspicious",
                       36: "timeout", 37: "caught by type check", -24: "timeout", 24: "timeout",
                       152: "timeout", 255: "timeout", -11: "segfault", -9: "segfault"}
NOT_KILLED = ("survived", "no tests", "suspicious", "segfault", "not checked", "interrupted")

# The CI gate's fixed part: mutmut on the reference's dispatch module (its tests come from
# scope.MUTMUT_MODULES, like every module's).
MUTMUT_FAST = {"reference": ["reference/dispatch.py"], "gpu": ["gpu/dispatch.py"]}


@dataclass
class FunctionRow:
    function: str
    mutants: int = 0
    killed: int = 0
    survived: int = 0
    timeouts: int = 0
    other: int = 0  # no tests, suspicious, skipped, ...


@dataclass
class ModuleResult:
    """mutmut's verdicts for one module (one `.meta` file): the counts, the per-function rows,
    the survivors, and how the result was obtained (`seconds` of its run, `reused` from the
    cache under `key`)."""

    module: str
    mutants: int = 0
    killed: int = 0
    survived: int = 0
    timeouts: int = 0
    skipped: int = 0
    other: int = 0  # no tests, suspicious, segfault, not checked, interrupted
    rows: list[FunctionRow] = field(default_factory=list)
    survivors: list[dict] = field(default_factory=list)
    seconds: float = 0.0
    reused: bool = False
    key: str = ""  # mutmut_cache.module_key: the cache's key
    source_key: str = ""  # the same without mutmut's version and settings: the record's
    base: str = ""  # the key of the finished run this one continued (added test files only)

    @property
    def stats(self) -> dict:
        return {"killed": self.killed, "survived": self.survived, "timeout": self.timeouts,
                "total": self.mutants, "skipped": self.skipped, "no_tests": self.other,
                "suspicious": 0}

    @property
    def score(self) -> float:
        return score_of(self.stats)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["score"] = self.score
        return d

    @classmethod
    def from_dict(cls, d: dict) -> ModuleResult:
        d = {k: v for k, v in d.items() if k != "score"}
        d["rows"] = [FunctionRow(**r) for r in d.get("rows", [])]
        return cls(**d)


@dataclass
class MutmutReport:
    stats: dict
    rows: list[FunctionRow]
    survivors: list[dict]  # {"key", "function", "status", "line"}
    seconds: float = 0.0
    only_mutate: list[str] = field(default_factory=list)
    modules: dict[str, ModuleResult] = field(default_factory=dict)

    @property
    def score(self) -> float:
        return score_of(self.stats)


def report_from_modules(modules: dict[str, ModuleResult], seconds: float = 0.0) -> MutmutReport:
    """One report over several modules' results (stats summed; modules in path order)."""
    ordered = dict(sorted(modules.items()))
    stats = {k: sum(m.stats[k] for m in ordered.values())
             for k in ("killed", "survived", "timeout", "total", "skipped", "no_tests",
                       "suspicious")}
    stats["score"] = score_of(stats)
    rows = sorted((r for m in ordered.values() for r in m.rows), key=lambda r: r.function)
    survivors = [s for m in ordered.values() for s in m.survivors]
    return MutmutReport(stats, rows, survivors, seconds, list(ordered), ordered)


def module_of_meta(meta: Path, mutants: Path) -> str:
    """'mutants/raggedspec/reference/step.py.meta' -> 'reference/step.py' (the checkout path)."""
    rel = meta.relative_to(mutants).with_suffix("").as_posix()
    return rel.removeprefix("raggedspec/")


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
    """Per-function rows, per-module results and survivors from a mutmut `mutants/` dir (its
    *.meta files, the mutated sources and mutmut-cicd-stats.json)."""
    rows: dict[str, FunctionRow] = {}
    survivors = []
    modules: dict[str, ModuleResult] = {}
    for meta in sorted(mutants.rglob("*.py.meta")):
        data = json.loads(meta.read_text())
        mod = modules.setdefault(module_of_meta(meta, mutants),
                                 ModuleResult(module_of_meta(meta, mutants)))
        src_path = meta.with_suffix("")  # drop .meta
        src = _functions_in(src_path.read_text()) if src_path.is_file() else {}
        mod_rows: dict[str, FunctionRow] = {}
        for key, code in sorted(
            data.get("exit_code_by_key", {}).items(), key=lambda kv: _natural(kv[0])
        ):
            status = STATUS_BY_EXIT_CODE.get(code, "suspicious")
            func = function_of(key)
            row = rows.setdefault(func, FunctionRow(func))
            mod_rows[func] = row
            row.mutants += 1
            mod.mutants += 1
            if status in ("killed", "caught by type check"):
                row.killed += 1
                mod.killed += 1
            elif status == "timeout":
                row.timeouts += 1
                mod.timeouts += 1
            elif status == "survived":
                row.survived += 1
                mod.survived += 1
            else:
                row.other += 1
                if status == "skipped":
                    mod.skipped += 1
                else:
                    mod.other += 1
            if status in NOT_KILLED:
                sv = {"key": key, "function": func, "status": status,
                      "line": " | ".join(mutated_lines(src, key)) if src else "?"}
                survivors.append(sv)
                mod.survivors.append(sv)
        mod.rows = sorted(mod_rows.values(), key=lambda r: r.function)
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
    return MutmutReport(stats, sorted(rows.values(), key=lambda r: r.function), survivors, 0.0,
                        mutated, dict(sorted(modules.items())))


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


# The CPU-time floor of a continued run's mutants: mutmut limits each mutant to
# (its tests' measured seconds + timeout_constant) * timeout_multiplier * 2 CPU seconds, and
# the added test files alone measure so little that a mutant they run to the end is stopped
# first (and a timeout counts as killed). A larger constant only lets more mutants finish.
CONTINUATION_TIMEOUT_CONSTANT = 10.0


def _set_mutmut_config(workdir: Path, only_mutate: list[str], selection: list[str] | None,
                       timeout_constant: float | None = None) -> None:
    """Rewrite the copy's [tool.mutmut] `only_mutate`, (when given) the stats-run test
    selection and (when given) `timeout_constant`. Only ever called on a workspace copy."""
    py = workdir / "pyproject.toml"
    text = py.read_text()
    text = re.sub(
        r"(?m)^only_mutate = .*$", lambda _: "only_mutate = " + json.dumps(only_mutate), text
    )
    if timeout_constant is not None:
        text = re.sub(r"(?m)^timeout_constant = .*$",
                      lambda _: f"timeout_constant = {timeout_constant}", text)
    if selection is not None:
        text = re.sub(
            r"(?m)^pytest_add_cli_args_test_selection = .*$",
            lambda _: "pytest_add_cli_args_test_selection = " + json.dumps(selection),
            text,
        )
    py.write_text(text)


def seed_mutants(mutants: Path, module: str, seed: Path, reopen: bool) -> int:
    """Put `module`'s .meta and mutated source from `seed` (a cached `mutants/` dir) into the
    workspace's `mutants/`, where mutmut keeps every verdict it finds and checks only the
    mutants without one; with `reopen`, the mutants not killed lose their verdict first.
    Returns how many mutants are left to check."""
    mutmut_cache.copy_module_files(seed, module, mutants)
    meta = mutants / "raggedspec" / (module + ".meta")
    data = json.loads(meta.read_text())
    codes = data.get("exit_code_by_key", {})
    for k, code in codes.items():
        if reopen and STATUS_BY_EXIT_CODE.get(code, "suspicious") in NOT_KILLED:
            codes[k] = None
    meta.write_text(json.dumps(data))
    return sum(code is None for code in codes.values())


def reopened_codes(seed: Path, module: str) -> dict[str, int | None]:
    """The verdicts `seed_mutants(..., reopen=True)` takes away: each mutant not killed."""
    data = json.loads((seed / "raggedspec" / (module + ".meta")).read_text())
    return {k: c for k, c in data.get("exit_code_by_key", {}).items()
            if STATUS_BY_EXIT_CODE.get(c, "suspicious") in NOT_KILLED}


def settle_reopened(mutants: Path, module: str, old: dict[str, int | None]) -> None:
    """After a run of the reopened mutants with only the added test files: a mutant those
    did not kill (survived, no test covers it, not reached) gets its earlier verdict back,
    since the earlier tests did not kill it either. A timeout is not taken as a kill here:
    the earlier tests ran the mutant to its end, and the added files' short measured time
    makes mutmut's CPU limit stop mutants they would not kill."""
    if not old:
        return
    meta = mutants / "raggedspec" / (module + ".meta")
    data = json.loads(meta.read_text())
    codes = data.get("exit_code_by_key", {})
    for k, was in old.items():
        status = STATUS_BY_EXIT_CODE.get(codes.get(k), "suspicious")
        if k in codes and (status in NOT_KILLED or status == "timeout"):
            codes[k] = was
    meta.write_text(json.dumps(data))


class RunInterrupted(RuntimeError):
    """mutmut ran past the time limit; `mutants` holds the verdicts it wrote so far."""

    def __init__(self, message: str, mutants: Path, seconds: float):
        super().__init__(message)
        self.mutants, self.seconds = mutants, seconds


def run_module(module: str, root: Path = ROOT, jobs: int = 2, log=print,
               timeout: float = 3600, seed: Path | None = None, reopen: bool = False,
               only: list[str] | None = None) -> tuple[ModuleResult, list[str], Path]:
    """mutmut on one module in a fresh copy, with the module's covering tests
    (`scope.MUTMUT_MODULES`) as its test selection: a baseline of those tests (failing tests
    are deselected and returned: mutmut refuses to start on a red suite), `run`, then
    `export-cicd-stats`; (the module's result, the baseline failures, the copy's mutants/).
    With `seed`, the run starts from those verdicts (`seed_mutants`); with `reopen` and
    `only` (the test files added since the seed's run), the reopened mutants run with those
    files alone and `settle_reopened` gives back the verdicts they do not change. Past
    `timeout` seconds mutmut's process group is stopped and RunInterrupted carries what it
    wrote."""
    tests = [t for t in MUTMUT_MODULES[module] if (root / t).exists()]
    if only:
        tests = [t for t in tests if t in only]
    if not tests:
        raise CatalogueError(f"{module}: none of its test files exist")
    old = reopened_codes(seed, module) if seed is not None and reopen and only else {}
    ws = make_workspace(root, "mutmut", nested=True)
    selection = [nested_path(t) for t in tests]
    t0 = time.monotonic()
    red, secs = _baseline_run(ws, selection, jobs)
    log(f"mutmut {module}: baseline {'green' if not red else 'RED: ' + ', '.join(red)} "
        f"({secs:.1f} s)")
    _set_mutmut_config(ws, [nested_path(module)], selection + [f"--deselect={t}" for t in red],
                       CONTINUATION_TIMEOUT_CONSTANT if old else None)
    if seed is not None:
        left = seed_mutants(ws / "mutants", module, seed, reopen)
        log(f"mutmut {module}: continuing an earlier run, {left} mutants to check")
    env = _env()
    p = subprocess.Popen(
        [sys.executable, "-m", "mutmut", "run", "--max-children", str(jobs)],
        cwd=ws, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )
    try:
        out, err = p.communicate(timeout=max(1.0, timeout - (time.monotonic() - t0)))
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        p.communicate()
        settle_reopened(ws / "mutants", module, old)
        raise RunInterrupted(f"mutmut run on {module} passed its {timeout:.0f} s limit",
                             ws / "mutants", time.monotonic() - t0) from None
    tail = "\n".join(out.replace("\r", "\n").splitlines()[-8:])
    if p.returncode != 0:
        raise RuntimeError(f"mutmut run on {module} failed (exit {p.returncode}):\n{tail}\n"
                           f"{err[-3000:]}")
    settle_reopened(ws / "mutants", module, old)
    q = subprocess.run([sys.executable, "-m", "mutmut", "export-cicd-stats"], cwd=ws, env=env,
                       capture_output=True, text=True)
    if q.returncode != 0:
        raise RuntimeError(f"mutmut export-cicd-stats failed: {q.stdout}{q.stderr}")
    rep = read_mutants_dir(ws / "mutants")
    result = rep.modules.get(module, ModuleResult(module))
    result.seconds = time.monotonic() - t0
    return result, red, ws / "mutants"


def run_modules(modules: list[str], root: Path = ROOT, jobs: int = 2, cache: Path | None = None,
                log=print, timeout: float = 3600) -> tuple[MutmutReport, list[str]]:
    """Each module's result, from the cache when its key is there (mutmut_cache.py), else from
    a `run_module` that resumes an interrupted run under the same key, or continues from a
    finished one whose only difference is added test files, or starts afresh (stored in the
    cache when its baseline was green); (the report over all of them, the baseline failures).
    A run past `timeout` keeps its verdicts for the next run and raises RunInterrupted."""
    t0 = time.monotonic()
    results: dict[str, ModuleResult] = {}
    red: list[str] = []
    for module in modules:
        parts = mutmut_cache.module_parts(root, module)
        key = mutmut_cache.key_of(parts)
        source_key = mutmut_cache.module_key(root, module, tool=False)
        hit = mutmut_cache.cached(cache, module, key)
        if hit is not None:
            got = read_mutants_dir(hit).modules.get(module, ModuleResult(module))
            got.seconds = mutmut_cache.cached_seconds(cache, module, key)
            got.base = mutmut_cache.cached_base(cache, module, key)
            got.reused, got.key, got.source_key = True, key, source_key
            results[module] = got
            log(f"mutmut {module}: reused ({got.mutants} mutants, score {got.score:.1f}%)")
            continue
        seed, reopen, before, base, added = None, False, 0.0, "", None
        resumed = mutmut_cache.resume_from(cache, module, key)
        if resumed is not None:
            seed, before = resumed
        elif (found := mutmut_cache.base_for(cache, module, parts)) is not None:
            seed, base, added = found
            reopen = True
            before = mutmut_cache.cached_seconds(cache, module, base)  # a run's whole cost
        try:
            got, red_m, mutants = run_module(module, root, jobs, log, timeout, seed, reopen,
                                             added)
        except RunInterrupted as e:
            mutmut_cache.store_partial(cache, module, key, e.mutants, before + e.seconds)
            drop_workspace(e.mutants.parent)
            raise RunInterrupted(f"{e}; its verdicts so far are kept and the next run under "
                                 f"this key checks only the rest", e.mutants,
                                 before + e.seconds) from None
        got.key, got.source_key, got.base = key, source_key, base
        got.seconds += before
        results[module] = got
        red += [t for t in red_m if t not in red]
        log(f"mutmut {module}: {got.mutants} mutants, {got.killed} killed, score "
            f"{got.score:.1f}% ({got.seconds:.0f} s)")
        if not red_m:
            mutmut_cache.store(cache, module, key, mutants, got.seconds, parts, base)
        drop_workspace(mutants.parent)  # this module's copy is done with
    return report_from_modules(results, time.monotonic() - t0), red
