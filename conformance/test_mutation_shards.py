"""Tests of mutmut's scope, shards, merge, cache and record (mutation/scope.py, shards.py,
mutmut_cache.py, record.py): the scope tables classify every rule file, shards partition the
work, merged shards gate and document exactly as one run does, bad shard sets are refused
with exit 2, per-module counts come from the .meta files, and the cache reuses a module's
verdicts exactly when its key is unchanged. No real mutmut run: results are synthetic."""

from __future__ import annotations

import ast
import json
import random
import re
from pathlib import Path

import pytest

from raggedspec.mutation import mutmut_cache, runner
from raggedspec.mutation.catalogue import select
from raggedspec.mutation.scope import EXCLUDED, MUTMUT_MODULES

ROOT = Path(__file__).resolve().parent.parent
NONE = {"catalogue": {}, "mutmut": []}

# --------------------------------------------------------------------------- scope


@pytest.mark.rule("mutation scope, shards, result cache and CI plan")
def test_every_rule_file_is_mutated_or_excluded_with_a_reason_and_never_both():
    assert runner.unclassified(ROOT) == {}
    assert all(why.strip() for why in EXCLUDED.values())
    for path in ("gpu/kernel_emulator.py", "gpu/testing.py", "raggedspec/bench/",
                 "raggedspec/cli.py"):
        assert path in EXCLUDED


def _imports(path: Path) -> set[str]:
    """Dotted module names a file imports, `raggedspec.` dropped."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            base = node.module.removeprefix("raggedspec.")
            out.add(base)
            out.update(f"{base}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            out.update(a.name.removeprefix("raggedspec.") for a in node.names)
    return out


def _reaches(start: Path, target: str) -> bool:
    """Whether `start` imports `target` directly or through modules of the tree; the
    conformance backend module counts as importing the torch backend, its default."""
    seen, todo = set(), [start]
    while todo:
        f = todo.pop()
        if f in seen or not f.is_file():
            continue
        seen.add(f)
        names = _imports(f)
        if f.name == "backends.py" and 'DEFAULT_BACKEND = "torch"' in f.read_text():
            names.add("gpu.backend")
        if target in names:
            return True
        for n in names:
            parts = n.split(".")
            if parts[0] in ("reference", "gpu", "conformance"):
                todo.append(ROOT / Path(*parts[:2]).with_suffix(".py"))
    return False


@pytest.mark.rule("mutation scope, shards, result cache and CI plan")
@pytest.mark.parametrize("module", sorted(MUTMUT_MODULES))
def test_each_listed_test_file_exists_and_reaches_its_module(module):
    tests = MUTMUT_MODULES[module]
    assert tests and len(tests) <= 6  # a module's mutants run a few files, never the suite
    dotted = module.removesuffix(".py").replace("/", ".")
    for t in tests:
        assert (ROOT / t).is_file(), t
        assert _reaches(ROOT / t, dotted), f"{t} never imports {dotted}"


@pytest.mark.rule("mutation scope, shards, result cache and CI plan")
def test_the_docs_page_shows_the_scope_tables_of_the_code():
    doc = (ROOT / "docs" / "mutation.md").read_text()
    m = re.search(r"<!-- BEGIN generated:mutmut-scope -->\n(.*?)\n<!-- END", doc, re.S)
    assert m is not None
    rows = m.group(1).splitlines()
    for module, tests in MUTMUT_MODULES.items():
        assert any(r.startswith(f"| `{module}` |") and all(t.split("/")[-1] in r for t in tests)
                   for r in rows), module
    for path in EXCLUDED:
        assert any(r.startswith(f"| `{path}` |") for r in rows), path


# --------------------------------------------------------------------------- shards


@pytest.mark.rule("mutation scope, shards, result cache and CI plan")
@pytest.mark.parametrize("n", [1, 2, 3, 5])
def test_catalogue_shards_are_disjoint_complete_and_within_one_of_each_other(n):
    names = [m.name for m in select("all")]
    parts = [runner.catalogue_shard(names, k, n) for k in range(1, n + 1)]
    flat = [x for p in parts for x in p]
    assert sorted(flat) == sorted(names) and len(flat) == len(set(flat))
    assert max(map(len, parts)) - min(map(len, parts)) <= 1
    assert parts == [runner.catalogue_shard(names, k, n) for k in range(1, n + 1)]


@pytest.mark.rule("mutation scope, shards, result cache and CI plan")
@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_module_shards_are_disjoint_complete_deterministic_and_balanced_by_size(n):
    sizes = {m: (ROOT / m).stat().st_size for m in MUTMUT_MODULES if (ROOT / m).is_file()}
    parts = runner.module_shards(sizes, n)
    flat = [x for p in parts for x in p]
    assert sorted(flat) == sorted(sizes) and len(flat) == len(set(flat))
    loads = [sum(sizes[m] for m in p) for p in parts]
    # greedy largest-first: no shard exceeds another by more than the largest module
    assert max(loads) - min(loads) <= max(sizes.values())
    shuffled = list(sizes.items())
    random.Random(7).shuffle(shuffled)
    assert runner.module_shards(dict(shuffled), n) == parts  # the input order does not matter


@pytest.mark.rule("mutation scope, shards, result cache and CI plan")
def test_a_shard_spec_must_be_k_of_n():
    assert runner.parse_shard("2/3") == (2, 3)
    for bad in ("0/3", "4/3", "3", "a/b", "1/0"):
        with pytest.raises(ValueError):
            runner.parse_shard(bad)
    assert runner.main(["--shard", "4/3", "--no-docs"]) == 2


# --------------------------------------------------------------------------- merge

CAT = [f"entry {i}" for i in range(7)]
MODS = ["reference/a.py", "reference/b.py", "gpu/c.py", "gpu/d.py"]
SIZES = {"reference/a.py": 900, "reference/b.py": 300, "gpu/c.py": 500, "gpu/d.py": 400}


def _cat(name: str) -> dict:
    status = "SURVIVED" if name == "entry 4" else "CAUGHT"
    return {"name": name, "file": "reference/x.py", "spec": "C§1", "status": status,
            "detail": "conformance/test_x.py::t", "seconds": 0.1, "expect": "caught"}


def _mod(name: str) -> dict:
    # a: 20 mutants, one justified survivor (95%); b: 10, two survivors (80%, one unjustified);
    # c: clean; d: no mutants at all
    counts = {"reference/a.py": (20, 19, 1), "reference/b.py": (10, 8, 2), "gpu/c.py": (5, 5, 0),
              "gpu/d.py": (0, 0, 0)}[name]
    dotted = name.removesuffix(".py").replace("/", ".")
    survivors = [{"key": f"{dotted}.x_f__mutmut_{i}", "function": f"{dotted}.f",
                  "status": "survived", "line": f"return {i}"} for i in range(counts[2])]
    return runner.ModuleResult(name, counts[0], counts[1], counts[2], survivors=survivors,
                               seconds=10.0, key="k-" + name).to_dict()


def _result(k: int, n: int, cat: list[str], mods: list[str], **over) -> dict:
    r = {"format": runner.FORMAT, "commit": "c0ffee", "tree": "t1", "shard": [k, n],
         "scope": "all", "mode": "full", "catalogue_all": CAT, "catalogue_assigned": cat,
         "mutmut_all": MODS, "mutmut_assigned": mods, "threshold": 95.0, "allow_red": False,
         "command": "python -m raggedspec.mutation.runner", "date": "2026-12-01",
         "seconds": 30.0, "baseline_red": [], "infra": [],
         "catalogue": [_cat(c) for c in cat], "mutmut": {"modules": {m: _mod(m) for m in mods}}}
    r.update(over)
    return r


EQ = {"catalogue": {}, "mutmut": [{"function": "reference.a.f", "line": "return 0", "why": "w"},
                                  {"function": "reference.b.f", "line": "return 0", "why": "w"}]}


def _shard_files(tmp_path: Path, n: int) -> list[Path]:
    parts = runner.module_shards(SIZES, n)
    out = []
    for k in range(1, n + 1):
        p = tmp_path / f"shard{k}.json"
        p.write_text(json.dumps(_result(k, n, runner.catalogue_shard(CAT, k, n), parts[k - 1],
                                        seconds=10.0 * k)))
        out.append(p)
    return out


def _tables(doc: str) -> list[str]:
    return [line for line in doc.splitlines() if line.startswith(("|", "- `"))]


@pytest.mark.rule("mutation scope, shards, result cache and CI plan")
@pytest.mark.parametrize("n", [2, 3])
def test_merged_shards_gate_and_document_exactly_as_one_unsharded_run(tmp_path, n):
    whole = _result(1, 1, CAT, MODS)
    expected = runner.verdict_of(whole, EQ)
    assert not expected.ok
    # the reasons, written out: the surviving entry, b's score and unjustified survivor, d
    assert sorted(expected.reasons) == sorted([
        "catalogue: 'entry 4' SURVIVED (conformance/test_x.py::t)",
        "mutmut: reference/b.py scores 80.0%, under 95%",
        "mutmut: reference.b.x_f__mutmut_1 survived and is not in equivalent.toml: return 1",
        "mutmut: gpu/d.py has no mutants (nothing mutmut can mutate: move it to EXCLUDED in "
        "mutation/scope.py with the reason)",
    ])
    merged = runner.merge_results(_shard_files(tmp_path, n))
    assert sorted(runner.verdict_of(merged, EQ).reasons) == sorted(expected.reasons)
    assert [r["name"] for r in merged["catalogue"]] == CAT  # catalogue order restored
    assert merged["seconds"] == 10.0 * n  # the longest shard is the wall time

    one = tmp_path / "whole.json"
    one.write_text(json.dumps(whole))
    eq = tmp_path / "eq.toml"
    eq.write_text("".join(f'[[mutmut]]\nfunction = "{e["function"]}"\nline = "{e["line"]}"\n'
                          f'why = "{e["why"]}"\n' for e in EQ["mutmut"]))
    docs_one, docs_merged = tmp_path / "one.md", tmp_path / "merged.md"
    rec_one, rec_merged = tmp_path / "one.json", tmp_path / "merged.json"
    assert runner.main(["merge", str(one), "--docs", str(docs_one), "--record", str(rec_one),
                        "--equivalent", str(eq)]) == 1
    assert runner.main(["merge", *map(str, _shard_files(tmp_path, n)), "--docs",
                        str(docs_merged), "--record", str(rec_merged), "--equivalent",
                        str(eq)]) == 1
    t_one, t_merged = _tables(docs_one.read_text()), _tables(docs_merged.read_text())
    assert t_one == t_merged
    assert "| `reference/b.py` | 10 | 8 | 2 | 0 | 0 | 80.0% | FAIL | 2026-12-01, 10 s |" in t_one
    assert "| `reference/a.py` | 20 | 19 | 1 | 0 | 0 | 95.0% | pass | 2026-12-01, 10 s |" in t_one
    assert json.loads(rec_one.read_text()) == json.loads(rec_merged.read_text())


def _refused(capsys, paths) -> str:
    assert runner.main(["merge", *map(str, paths), "--json", "/dev/null"]) == 2
    return capsys.readouterr().err


@pytest.mark.rule("mutation scope, shards, result cache and CI plan")
def test_merge_refuses_missing_overlapping_and_mismatched_shards(tmp_path, capsys):
    s1, s2, s3 = _shard_files(tmp_path, 3)
    err = _refused(capsys, [s1, s3])
    assert "'shard'" in err and "2/3" in err and "missing" in err
    err = _refused(capsys, [s1, s1, s2, s3])
    assert "'shard'" in err and str(s1) in err

    other_n = tmp_path / "n2.json"
    other_n.write_text(json.dumps(_result(2, 2, [], [])))
    err = _refused(capsys, [s1, s2, other_n])
    assert str(other_n) in err and "'shard'" in err

    for field, value in (("commit", "deadbeef"), ("tree", "t2"), ("scope", "gpu")):
        d = json.loads(s2.read_text())
        d[field] = value
        bad = tmp_path / f"bad-{field}.json"
        bad.write_text(json.dumps(d))
        err = _refused(capsys, [s1, bad, s3])
        assert str(bad) in err and f"'{field}'" in err

    d = json.loads(s2.read_text())  # shard 2 also claims one of shard 1's entries
    d["catalogue_assigned"] = d["catalogue_assigned"] + [json.loads(s1.read_text())
                                                         ["catalogue_assigned"][0]]
    overlap = tmp_path / "overlap.json"
    overlap.write_text(json.dumps(d))
    err = _refused(capsys, [s1, overlap, s3])
    assert "'catalogue_assigned'" in err and "overlap" in err

    d = json.loads(s3.read_text())  # shard 3 dropped a module: the set is incomplete
    d["mutmut_assigned"] = d["mutmut_assigned"][1:]
    short = tmp_path / "short.json"
    short.write_text(json.dumps(d))
    err = _refused(capsys, [s1, s2, short])
    assert "'mutmut_assigned'" in err

    junk = tmp_path / "junk.json"
    junk.write_text('{"format": 1}')
    assert str(junk) in _refused(capsys, [junk])


@pytest.mark.rule("mutation scope, shards, result cache and CI plan")
def test_the_raggedspec_command_forwards_merge(tmp_path, capsys):
    from raggedspec.cli import main as cli_main

    s1, _, s3 = _shard_files(tmp_path, 3)
    assert cli_main(["mutation", "merge", str(s1), str(s3)]) == 2
    assert "missing" in capsys.readouterr().err


# --------------------------------------------------------------------------- per-module counts


def _meta(mutants: Path, module: str, codes: dict[str, int | None]) -> None:
    f = mutants / "raggedspec" / (module + ".meta")
    f.parent.mkdir(parents=True, exist_ok=True)
    f.write_text(json.dumps({"exit_code_by_key": codes}))


@pytest.mark.rule("mutation scope, shards, result cache and CI plan")
def test_the_per_module_counts_come_from_each_modules_meta_file(tmp_path):
    d = tmp_path / "mutants"
    # mutmut's exit codes: 1 killed, 0 survived, 36 timeout, 34 skipped, 33 no tests
    _meta(d, "reference/a.py", {"raggedspec.reference.a.x_f__mutmut_1": 1,
                                "raggedspec.reference.a.x_f__mutmut_2": 1,
                                "raggedspec.reference.a.x_g__mutmut_1": 1,
                                "raggedspec.reference.a.x_g__mutmut_2": 0,
                                "raggedspec.reference.a.x_g__mutmut_3": 36})
    _meta(d, "gpu/b.py", {"raggedspec.gpu.b.x_h__mutmut_1": 1,
                          "raggedspec.gpu.b.x_h__mutmut_2": 1,
                          "raggedspec.gpu.b.x_h__mutmut_3": 34,
                          "raggedspec.gpu.b.xǁKǁm__mutmut_1": 33})
    rep = runner.read_mutants_dir(d)
    assert sorted(rep.modules) == ["gpu/b.py", "reference/a.py"]
    a, b = rep.modules["reference/a.py"], rep.modules["gpu/b.py"]
    assert (a.mutants, a.killed, a.survived, a.timeouts, a.skipped, a.other) == (5, 3, 1, 1, 0, 0)
    assert (b.mutants, b.killed, b.survived, b.timeouts, b.skipped, b.other) == (4, 2, 0, 0, 1, 1)
    assert a.score == pytest.approx(80.0)        # (3 + 1) / 5
    assert b.score == pytest.approx(200 / 3)     # 2 / (4 - 1)
    assert [r.function for r in a.rows] == ["raggedspec.reference.a.f", "raggedspec.reference.a.g"]
    assert [s["key"] for s in a.survivors] == ["raggedspec.reference.a.x_g__mutmut_2"]
    assert [s["status"] for s in b.survivors] == ["no tests"]
    v = runner.gate(None, rep, NONE)
    assert "mutmut: reference/a.py scores 80.0%, under 95%" in v.reasons
    assert "mutmut: gpu/b.py scores 66.7%, under 95%" in v.reasons
    # the JSON form round-trips to the same module
    assert runner.ModuleResult.from_dict(json.loads(json.dumps(a.to_dict()))) == a


# --------------------------------------------------------------------------- cache


def _tree(tmp_path: Path) -> Path:
    root = tmp_path / "tree"
    (root / "reference").mkdir(parents=True)
    (root / "conformance").mkdir()
    (root / "pyproject.toml").write_text('[tool.mutmut]\ntimeout_constant = 0.5\n'
                                         'only_mutate = ["x"]\n')
    (root / "reference" / "rope.py").write_text("def f(x):\n    return x + 1\n")
    (root / "reference" / "other.py").write_text("def g():\n    return 0\n")
    (root / "conformance" / "test_rope.py").write_text("def test_f():\n    pass\n")
    (root / "conformance" / "conftest.py").write_text("# profiles\n")
    return root


@pytest.mark.rule("mutation scope, shards, result cache and CI plan")
def test_a_cached_module_is_reused_exactly_while_its_key_is_unchanged(tmp_path):
    root, cache, m = _tree(tmp_path), tmp_path / "cache", "reference/rope.py"

    def key() -> str:
        return mutmut_cache.module_key(root, m, ("conformance/test_rope.py",), "3.8.1")

    k0 = key()
    assert runner.reuse_plan(cache, {m: k0}) == {m: "run"}  # an empty cache
    done = tmp_path / "ws" / "mutants"
    _meta(done, m, {"raggedspec.reference.rope.x_f__mutmut_1": 1})
    mutmut_cache.store(cache, m, k0, done, 12.0)
    assert runner.reuse_plan(cache, {m: k0}) == {m: "reuse"}
    assert runner.reuse_plan(None, {m: k0}) == {m: "run"}  # --no-cache

    # what is not in the key: another source module, the two settings the runner rewrites
    (root / "reference" / "other.py").write_text("def g():\n    return 1\n")
    py = root / "pyproject.toml"
    py.write_text(py.read_text().replace('["x"]', '["y"]'))
    assert key() == k0
    # what is: the module, its tests, the shared helpers, mutmut's settings and version
    changes = [
        (root / "reference" / "rope.py", "def f(x):\n    return x + 2\n"),
        (root / "conformance" / "test_rope.py", "def test_f():\n    assert True\n"),
        (root / "conformance" / "conftest.py", "# other profiles\n"),
        (py, py.read_text().replace("0.5", "1.5")),
    ]
    for path, text in changes:
        before = path.read_text()
        path.write_text(text)
        assert key() != k0, path
        assert runner.reuse_plan(cache, {m: key()}) == {m: "run"}
        path.write_text(before)
    assert key() == k0
    assert mutmut_cache.module_key(root, m, ("conformance/test_rope.py",), "3.9.0") != k0
    # the record's source key ignores mutmut's version and settings, not the sources
    def source() -> str:
        return mutmut_cache.module_key(root, m, ("conformance/test_rope.py",), "3.8.1",
                                       tool=False)

    s0 = source()
    assert mutmut_cache.module_key(root, m, ("conformance/test_rope.py",), "3.9.0",
                                   tool=False) == s0
    py.write_text(py.read_text().replace("0.5", "1.5"))
    assert source() == s0 and key() != k0
    (root / "conformance" / "test_rope.py").write_text("def test_g():\n    pass\n")
    assert source() != s0


@pytest.mark.rule("mutation scope, shards, result cache and CI plan")
def test_run_modules_mutates_only_the_modules_whose_key_changed(tmp_path, monkeypatch):
    root, cache = _tree(tmp_path), tmp_path / "cache"
    (root / "reference" / "cache.py").write_text("def h():\n    return 2\n")
    monkeypatch.setitem(MUTMUT_MODULES, "reference/rope.py", ("conformance/test_rope.py",))
    monkeypatch.setitem(MUTMUT_MODULES, "reference/cache.py", ("conformance/test_rope.py",))
    ran = []

    def fake_run(module, root_, jobs, log, timeout, seed=None, reopen=False, only=None):
        ran.append(module)
        ws = tmp_path / f"ws-{module.replace('/', '_')}-{len(ran)}" / "mutants"
        dotted = "raggedspec." + module.removesuffix(".py").replace("/", ".")
        _meta(ws, module, {f"{dotted}.x_f__mutmut_1": 1, f"{dotted}.x_f__mutmut_2": 0})
        got = runner.read_mutants_dir(ws).modules[module]
        got.seconds = 5.0
        return got, [], ws

    monkeypatch.setattr("raggedspec.mutation.mutmut_run.run_module", fake_run)
    monkeypatch.setattr("raggedspec.mutation.mutmut_run.drop_workspace", lambda ws: None)
    mods = ["reference/cache.py", "reference/rope.py"]
    first, _ = runner.run_modules(mods, root, 1, cache, log=lambda *_: None)
    assert ran == mods and not any(r.reused for r in first.modules.values())
    again, _ = runner.run_modules(mods, root, 1, cache, log=lambda *_: None)
    assert ran == mods  # nothing mutated again
    assert all(r.reused for r in again.modules.values())
    assert {m: (r.mutants, r.killed, r.seconds) for m, r in again.modules.items()} == {
        m: (2, 1, 5.0) for m in mods}
    (root / "reference" / "rope.py").write_text("def f(x):\n    return x * 3\n")
    third, _ = runner.run_modules(mods, root, 1, cache, log=lambda *_: None)
    assert ran == mods + ["reference/rope.py"]
    assert third.modules["reference/cache.py"].reused
    assert not third.modules["reference/rope.py"].reused


# --------------------------------------------------------------------------- CI record


@pytest.mark.rule("mutation scope, shards, result cache and CI plan")
def test_the_ci_plan_reruns_changed_modules_and_fails_recorded_failures():
    record = {"modules": {"a.py": {"source_key": "1", "ok": True},
                          "b.py": {"source_key": "2", "ok": True},
                          "c.py": {"source_key": "3", "ok": False}}}
    plan = runner.ci_plan(record, {"a.py": "1", "b.py": "2-new", "c.py": "3", "d.py": "4"})
    assert plan == {"a.py": "unchanged", "b.py": "changed", "c.py": "failed",
                    "d.py": "unrecorded"}
    assert runner.ci_plan(record, {"c.py": "3-new"}) == {"c.py": "changed"}


@pytest.mark.rule("mutation scope, shards, result cache and CI plan")
def test_the_ci_gate_mutates_changed_modules_cheapest_first_within_its_budget():
    record = {"modules": {"a.py": {"seconds": 300.0}, "b.py": {"seconds": 200.0},
                          "c.py": {"seconds": 250.0}}}
    # 200 + 250 fit in 500; a (300) does not
    assert runner.within_budget(["a.py", "b.py", "c.py"], record, 500) == (["b.py", "c.py"],
                                                                          ["a.py"])
    assert runner.within_budget(["a.py", "b.py"], record, 1000) == (["a.py", "b.py"], [])
    assert runner.within_budget(["a.py"], record, 100) == ([], ["a.py"])


@pytest.mark.rule("mutation scope, shards, result cache and CI plan")
def test_the_fast_gate_mutates_the_dispatch_module_and_the_changed_recorded_ones(
        tmp_path, monkeypatch):
    now = runner.module_key(ROOT, "reference/rope.py", tool=False)
    record = {"modules": {
        "reference/rope.py": {"source_key": now, "key": "another mutmut", "ok": True,
                              "seconds": 1},
        "reference/masks.py": {"source_key": "an older source", "ok": True, "seconds": 1},
        "reference/model.py": {"source_key": "an older source", "ok": False, "seconds": 1},
        "reference/align.py": {"source_key": "an older source", "ok": True, "seconds": 10_000},
    }}
    rec = tmp_path / "record.json"
    rec.write_text(json.dumps(record))
    asked = []

    def fake_run_modules(modules, root, jobs, cache, timeout=3600):
        asked.append(list(modules))
        return runner.report_from_modules({m: runner.ModuleResult(m, 1, 1) for m in modules}), []

    monkeypatch.setattr(runner, "run_modules", fake_run_modules)
    rc = runner.main(["--fast", "--mutmut-only", "--scope", "reference", "--no-docs",
                      "--record", str(rec), "--no-cache"])
    # dispatch always; masks and model changed; align changed but over the budget; rope is
    # unchanged; every other reference module has no entry
    assert asked == [["reference/dispatch.py", "reference/masks.py", "reference/model.py"]]
    assert rc == 1  # align did not fit the budget


@pytest.mark.rule("mutation scope, shards, result cache and CI plan")
def test_shards_of_a_real_command_merge_to_its_unsharded_verdict(tmp_path, capsys):
    d = tmp_path / "mutants"
    for mod, n_killed in (("reference/rope.py", 19), ("reference/masks.py", 3),
                          ("gpu/rope.py", 4)):
        dotted = "raggedspec." + mod.removesuffix(".py").replace("/", ".")
        codes = {f"{dotted}.x_f__mutmut_{i}": 1 for i in range(1, n_killed + 1)}
        codes[f"{dotted}.x_f__mutmut_{n_killed + 1}"] = 0
        _meta(d, mod, codes)
    base = ["--mutmut-only", "--from-mutants", str(d), "--equivalent", str(tmp_path / "none")]
    whole = tmp_path / "whole.json"
    assert runner.main([*base, "--no-docs", "--json", str(whole)]) == 1
    shards = [tmp_path / f"s{k}.json" for k in (1, 2, 3)]
    for k, path in enumerate(shards, 1):
        runner.main([*base, "--no-docs", "--shard", f"{k}/3", "--json", str(path)])
    assigned = [json.loads(p.read_text())["mutmut_assigned"] for p in shards]
    assert sorted(m for a in assigned for m in a) == sorted(json.loads(whole.read_text())
                                                            ["mutmut_all"])
    assert all(len(a) == 1 for a in assigned)
    merged = tmp_path / "merged.json"
    assert runner.main(["merge", *map(str, shards), "--json", str(merged)]) == 1
    w, m = json.loads(whole.read_text()), json.loads(merged.read_text())
    assert sorted(m["reasons"]) == sorted(w["reasons"])
    # 19/20 = 95% passes the score; 3/4 and 4/5 do not; each survivor is unjustified
    assert sorted(r for r in w["reasons"] if "scores" in r) == [
        "mutmut: gpu/rope.py scores 80.0%, under 95%",
        "mutmut: reference/masks.py scores 75.0%, under 95%"]
    assert len([r for r in w["reasons"] if "not in equivalent.toml" in r]) == 3
    capsys.readouterr()


@pytest.mark.rule("mutation scope, shards, result cache and CI plan")
def test_a_module_outside_the_scope_table_is_refused_before_any_run(capsys):
    assert runner.main(["--mutmut-only", "--module", "gpu/testing.py", "--no-docs"]) == 2
    assert "gpu/testing.py" in capsys.readouterr().err
