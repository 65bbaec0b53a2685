"""`raggedspec mutation`: the catalogue's file format and runner, mutmut's results read back per
module, and the gate. The runner is run for real on small catalogues written here (a mutation
a test catches, one none catches, one that no longer applies, one that breaks the import)."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from raggedspec.mutation import catalogue as cat
from raggedspec.mutation import mutmut_gate as mg
from raggedspec.mutation import runner

pytestmark = pytest.mark.rule("raggedspec mutation: catalogue, runner and gate")

DISPATCH = "reference/dispatch.py"
UNIFORM = dict(file=DISPATCH, old="    if rows is None or all(r == q0 for r in rows):\n",
               new="    if rows is None:\n")


def write_catalogue(tmp_path: Path, *entries: dict) -> Path:
    lines = []
    for e in entries:
        lines.append("[[entry]]")
        lines += [f"{k} = {json.dumps(v)}" for k, v in e.items()]
    path = tmp_path / "catalogue.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


def entry(**fields) -> dict:
    return dict(dict(name="x", spec="M §2", tests=["dispatch"], **UNIFORM), **fields)


def test_the_shipped_catalogue_loads_with_unique_names_and_known_fields():
    entries = cat.load()
    assert len(entries) >= 60
    assert len({e.name for e in entries}) == len(entries)
    assert {e.expect for e in entries} <= {"caught", "survive"}


@pytest.mark.parametrize("bad, words", [
    (dict(tests="dispatch"), "field 'tests' must be a list"),
    (dict(old=3), "field 'old' must be a str"),
    (dict(expect="maybe"), "expect 'maybe'"),
    (dict(colour="red"), "unknown fields ['colour']"),
])
def test_a_malformed_entry_is_refused_naming_the_entry_and_field(tmp_path, bad, words):
    with pytest.raises(cat.CatalogueError, match="entry 2") as e:
        cat.load(write_catalogue(tmp_path, entry(name="a"), entry(name="b", **bad)))
    assert words in str(e.value)


def test_repeated_entry_names_are_refused(tmp_path):
    with pytest.raises(cat.CatalogueError, match=r"repeat: \['a'\]"):
        cat.load(write_catalogue(tmp_path, entry(name="a"), entry(name="a")))


def test_a_mutation_applies_where_its_text_occurs_exactly_once():
    e = cat.Entry("n", "s", "f.py", "b = 1", "b = 2", ())
    assert cat.mutated(e, "a = 0\nb = 1\n") == "a = 0\nb = 2\n"
    for source, times in (("a = 0\n", 0), ("b = 1\nb = 1\n", 2)):
        with pytest.raises(ValueError, match=f"occurs {times} times in f.py"):
            cat.mutated(e, source)


def test_select_matches_names_case_insensitively():
    entries = [cat.Entry(n, "", "", "", "", ()) for n in ("Alpha one", "beta")]
    assert [e.name for e in cat.select(entries, "ALPHA")] == ["Alpha one"]
    assert cat.select(entries, None) == entries


def test_named_tests_resolve_to_the_topic_files_that_exist(tmp_path):
    tree = tmp_path / "raggedspec"
    (tree / "conformance").mkdir(parents=True)
    (tree / "conformance" / "test_masks.py").write_text("")
    e = cat.Entry("n", "s", "f", "o", "n", ("masks", "no_such_topic"))
    assert cat.test_files(e, tree) == ["raggedspec/conformance/test_masks.py"]


@pytest.mark.parametrize("outcome, timed_out, status", [
    ({"code": 1, "first": "t.py::test_a"}, False, "caught"),
    ({"code": 0, "first": ""}, False, "survived"),
    ({"code": 5, "first": ""}, False, "survived"),   # nothing collected: nothing failed
    ({"code": 1, "first": ""}, False, "error"),      # exit 1 without a failed test: collection
    ({"code": 2, "first": ""}, False, "error"),
    (None, False, "error"),
    (None, True, "timeout"),
])
def test_only_a_failed_test_is_a_catch(outcome, timed_out, status):
    assert cat._verdict(outcome, timed_out)[0] == status


def test_a_result_is_ok_when_it_meets_its_entrys_expectation():
    caught, equivalent = (cat.Entry("n", "", "", "", "", (), expect=x) for x in
                          ("caught", "survive"))
    assert cat.Result(caught, "caught").ok and not cat.Result(caught, "survived").ok
    assert cat.Result(equivalent, "survived").ok and not cat.Result(equivalent, "caught").ok
    assert not cat.Result(caught, "error").ok and not cat.Result(caught, "stale").ok


@pytest.mark.slow
def test_the_runner_catches_a_real_bug_and_reports_the_rest_as_they_are():
    """Four entries through the real runner (a forked child per entry in a private copy):
    the uniform filter dropped is caught by a dispatch test; a docstring change survives (the
    fallback is one small file, to keep this test short); an entry whose text is gone is stale;
    one that breaks the module's syntax is an error, not a catch."""
    entries = [
        cat.Entry("uniform filter", "M §2", tests=("dispatch",), **UNIFORM),
        cat.Entry("docstring", "-", DISPATCH, '"""Dispatch resolvers:', '"""Resolvers:',
                  ("trace",)),
        cat.Entry("gone", "-", DISPATCH, "no such text anywhere", "x", ("dispatch",)),
        cat.Entry("syntax", "-", DISPATCH, UNIFORM["old"], "    if rows is None\n",
                  ("dispatch",)),
    ]
    seen = []
    got = {r.entry.name: r for r in cat.run(entries, jobs=2, report=seen.append,
                                             fallback=["raggedspec/conformance/test_trace.py"])}
    assert {n: r.status for n, r in got.items()} == {
        "uniform filter": "caught", "docstring": "survived", "gone": "stale", "syntax": "error"}
    assert "test_dispatch.py::" in got["uniform filter"].detail
    assert "occurs 0 times" in got["gone"].detail
    assert sorted(r.entry.name for r in seen) == sorted(got)
    assert (cat.PACKAGE / DISPATCH).read_text().count(UNIFORM["old"]) == 1  # never the checkout


def test_main_refuses_an_only_that_matches_nothing_and_keeps_the_sigterm_handler(capsys):
    import signal

    before = signal.getsignal(signal.SIGTERM)
    assert runner.main(["--catalogue-only", "--only", "no such entry zzz"]) == 2
    assert "--only 'no such entry zzz' matches no catalogue entry" in capsys.readouterr().err
    assert signal.getsignal(signal.SIGTERM) is before


def test_main_refuses_an_output_under_a_file(tmp_path, capsys):
    (tmp_path / "f").write_text("")
    assert runner.main(["--catalogue-only", "--json", str(tmp_path / "f" / "r.json")]) == 2
    assert "--json" in capsys.readouterr().err


@pytest.mark.parametrize("statuses, code", [
    (["caught", "caught"], 0), (["caught", "survived"], 1), (["caught", "stale"], 1)])
def test_the_gate_fails_on_any_entry_not_caught(monkeypatch, capsys, tmp_path, statuses, code):
    def fake_run(entries, jobs, report, fallback=None):
        out = [cat.Result(e, s) for e, s in zip(entries, statuses, strict=False)]
        for r in out:
            report(r)
        return out

    monkeypatch.setattr(cat, "run", fake_run)
    monkeypatch.setattr(cat, "load", lambda: [cat.Entry(n, "", "", "", "", ()) for n in "ab"])
    assert runner.main(["--catalogue-only", "--json", str(tmp_path / "r.json")]) == code
    out = capsys.readouterr().out
    assert f"mutation gate: {'PASS' if code == 0 else 'FAIL'}" in out
    assert [r["status"] for r in json.loads((tmp_path / "r.json").read_text())["catalogue"]] \
        == statuses


# ----------------------------------------------------------------------------- mutmut


def test_a_module_passes_at_the_threshold_with_nothing_left_open():
    s = mg.ModuleScore("m", Counter(killed=95, timeout=5))
    assert s.mutants == 100 and s.score == 100.0 and s.open == 0 and s.passed()
    s = mg.ModuleScore("m", Counter(killed=95, survived=5))
    assert s.score == 95.0 and s.open == 5 and not s.passed()
    s = mg.ModuleScore("m", Counter(killed=94, **{"no tests": 0}, skipped=10, timeout=1))
    assert s.mutants == 95 and s.passed() and not s.passed(threshold=100.1)
    assert not mg.ModuleScore("m", Counter()).passed()  # no mutants at all is not a pass
    assert not mg.ModuleScore("m", Counter(killed=99, **{"no tests": 1})).passed()


def test_scores_read_mutmuts_own_result_files(tmp_path):
    meta = tmp_path / "mutants" / "raggedspec" / "reference" / "x.py.meta"
    meta.parent.mkdir(parents=True)
    meta.write_text(json.dumps({"exit_code_by_key": {"a": 1, "b": 0, "c": 36, "d": None,
                                                     "e": 33},
                                "durations_by_key": {"a": 1.5, "b": 2.0}}))
    got, = mg.scores(tmp_path, ["raggedspec/reference/x.py"])
    assert dict(got.counts) == {"killed": 1, "survived": 1, "timeout": 1, "not checked": 1,
                                "no tests": 1}
    assert got.seconds == 3.5 and got.open == 3
    assert mg.survivors(tmp_path, "raggedspec/reference/x.py") == ["b", "d", "e"]
    missing, = mg.scores(tmp_path, ["raggedspec/reference/y.py"])
    assert missing.mutants == 0 and not missing.passed()


def test_the_scope_is_pyprojects_globs_over_the_package():
    root = mg.checkout()
    only, skip = mg.configured_scope(root)
    assert mg.in_scope("raggedspec/reference/masks.py", only, skip)
    assert not mg.in_scope("raggedspec/reference/__init__.py", only, skip)
    assert not mg.in_scope("raggedspec/gpu/_common.py", only, skip)
    assert not mg.in_scope("raggedspec/cli.py", only, skip)
    modules = mg.scope_modules(root, "all", [])
    assert "raggedspec/reference/dispatch.py" in modules
    assert "raggedspec/trace_rules.py" in modules and "raggedspec/gpu/masks.py" in modules
    assert "raggedspec/vectors/__init__.py" in modules  # the vectors writer is code, not a marker
    assert not [m for m in modules if "/conformance/" in m]
    assert not {"raggedspec/reference/__init__.py", "raggedspec/gpu/__init__.py"} & set(modules)
    assert mg.scope_modules(root, "gate", []) == [mg.GATE_MODULE]
    assert mg.scope_modules(root, "all", ["raggedspec/reference/rope.py", "x.py"]) == \
        ["raggedspec/reference/rope.py"]


def test_an_unknown_module_is_bad_usage(capsys):
    assert runner.main(["--mutmut-only", "--module", "reference/no_such.py"]) == 2
    assert "reference/no_such.py: not a module mutmut mutates" in capsys.readouterr().err


def test_the_docs_section_is_rewritten_between_its_markers(tmp_path):
    page = tmp_path / "m.md"
    page.write_text(f"before\n{runner.BEGIN}\nold\n{runner.END}\nafter\n")
    runner.write_docs(page, "| new |")
    assert page.read_text() == f"before\n{runner.BEGIN}\n| new |\n{runner.END}\nafter\n"
    page.write_text("no markers")
    with pytest.raises(OSError, match="no .* section"):
        runner.write_docs(page, "x")


def test_the_progress_follows_the_last_count_mutmut_wrote(tmp_path):
    log = tmp_path / "mutmut-run.log"
    log.write_text("Running stats\r⠋ 12/279  🎉 10 🫥 0\r⠙ 13/279  🎉 11 🫥 0")
    assert mg.last_count(log) == (13, 279)
    log.write_text("Generating mutants\n    done in 644ms")
    assert mg.last_count(log) is None
