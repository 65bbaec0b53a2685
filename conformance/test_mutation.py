"""Tests of the mutation runner itself (mutation/): the catalogue applies, a mutant really
changes behaviour and never touches the checkout, the stats reader scores as mutmut does, and
the gate fails on a planted survivor that is not a documented equivalent."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from raggedspec.mutation import runner
from raggedspec.mutation.catalogue import ALL, CATALOGUE, Mutant

ROOT = Path(__file__).resolve().parent.parent

# The 22 mutations the source PR lists (source/mtp-draft-chain-per-row-positions.txt).
SOURCE_PR_MUTATIONS = [
    "resolve_capture_offsets: never build the per-row vector",
    "resolve_capture_offsets: always build the per-row vector",
    "CaptureOffsets::row: ignore the row index (read row 0)",
    "CaptureOffsets::describes: never refuse a batch it does not cover",
    "resolve_ragged_chain_starts: send UNIFORM groups down the ragged path",
    "resolve_ragged_chain_starts: never take the ragged path",
    "resolve_draft_leads: ignore the per-sequence-advance gate",
    "resolve_draft_leads: align to the group MINIMUM not the maximum",
    "resolve_draft_leads: never report a lead",
    "front_align_draft_group: skip the front pad",
    "front_align_draft_group: skip the per-row truncation",
    "front_align_draft_group: clamp a too-far chain start not refuse",
    "front_align_draft_group: never refuse a width mismatch",
    "draft_group_key: ignore carries_per_row",
    "draft_group_key: drop the chain start unconditionally",
    "chain_start_of: off by one against the group key",
    "draft_step_end_column: row 0's position instead of the maximum",
    "draft_step_end_column: never refuse a wrong-width vector",
    "draft_step_end_column: never refuse a desynced cache",
    "per_sequence_refusal: drop the batch-admission check",
    "draft_chain_carries_per_sequence_positions: never refuse",
    "per_sequence_refusal: drop the draft-chain check",
]


def _entry(name: str) -> Mutant:
    return next(m for m in ALL if m.name == name)


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# --------------------------------------------------------------------------- catalogue


@pytest.mark.rule("raggedspec mutation: catalogue, runner and gate")
def test_every_catalogue_entry_applies_exactly_once_to_todays_source():
    # a refactor that moves a snippet makes its entry fail here, loudly, instead of the
    # runner silently mutating nothing
    assert runner.check_catalogue(ALL, ROOT) == {}


@pytest.mark.rule("raggedspec mutation: catalogue, runner and gate")
def test_the_catalogue_holds_every_source_pr_mutation_and_at_least_60_entries():
    names = {m.name for m in ALL}
    assert len(SOURCE_PR_MUTATIONS) == 22
    assert [n for n in SOURCE_PR_MUTATIONS if n not in names] == []
    assert len(ALL) >= 60
    assert len(names) == len(ALL)
    pr = [m for m in CATALOGUE if m.spec.startswith("PR")]
    assert sorted(m.name for m in pr) == sorted(SOURCE_PR_MUTATIONS)


@pytest.mark.rule("raggedspec mutation: catalogue, runner and gate")
def test_only_the_documented_equivalent_is_expected_to_survive_and_it_is_justified():
    eq = runner.load_equivalents()
    survivors = [m.name for m in ALL if m.expect == "survive"]
    assert survivors == ["per_sequence_refusal: drop the draft-chain check"]
    assert set(eq["catalogue"]) == set(survivors)
    assert all(why.strip() and "\n" not in why for why in eq["catalogue"].values())
    for e in eq["mutmut"]:
        assert e["why"].strip() and "\n" not in e["why"]


@pytest.mark.rule("raggedspec mutation: catalogue, runner and gate")
def test_mutated_source_refuses_a_missing_or_ambiguous_snippet_and_a_no_op():
    src = "a = 1\nb = 1\n"
    with pytest.raises(runner.CatalogueError, match="0 times"):
        runner.mutated_source(Mutant("x", "f.py", "c = 1", "c = 2", "", ("t",)), src)
    with pytest.raises(runner.CatalogueError, match="2 times"):
        runner.mutated_source(Mutant("x", "f.py", " = 1", " = 2", "", ("t",)), src)
    with pytest.raises(runner.CatalogueError, match="changes nothing"):
        runner.mutated_source(Mutant("x", "f.py", "a = 1", "a = 1", "", ("t",)), src)
    assert (
        runner.mutated_source(Mutant("x", "f.py", "a = 1", "a = 2", "", ("t",)), src)
        == "a = 2\nb = 1\n"
    )


@pytest.mark.rule("raggedspec mutation: catalogue, runner and gate")
def test_the_first_failing_test_keeps_a_parametrized_id_that_holds_spaces():
    """The catalogue records (and later runs first) the first failing node id: a parameter
    id with spaces or dashes is kept whole, up to pytest's ` - ` before the message."""
    from raggedspec.mutation.catalogue_run import _first_failure

    out = ("x\nFAILED conformance/t.py::test_a[idle steps, the map at 2] - AssertionError: 1\n"
           "FAILED conformance/t.py::test_b - assert 0")
    assert _first_failure(out) == "conformance/t.py::test_a[idle steps, the map at 2]"
    one = "FAILED conformance/t.py::test_b - assert 0"
    assert _first_failure(one) == "conformance/t.py::test_b"
    assert _first_failure("ERROR conformance/t.py::test_c[0-bfloat16]") == (
        "conformance/t.py::test_c[0-bfloat16] (error)")


@pytest.mark.rule("raggedspec mutation: catalogue, runner and gate")
def test_an_applied_mutant_really_changes_behaviour_and_only_in_the_copy(tmp_path):
    m = _entry("resolve_draft_leads: align to the group MINIMUM not the maximum")
    checkout = ROOT / m.file
    before = _digest(checkout)
    shutil.copytree(ROOT / "reference", tmp_path / "reference")
    (tmp_path / m.file).write_text(runner.mutated_source(m, checkout.read_text()))
    probe = "from reference.dispatch import resolve_draft_leads as f; print(f(True, [3, 5, 4]))"

    def run(cwd):
        return subprocess.run(
            [sys.executable, "-B", "-c", probe], cwd=cwd, capture_output=True, text=True, check=True
        ).stdout.strip()

    assert run(ROOT) == "[2, 0, 1]"          # distance to the widest row
    assert run(tmp_path) == "[0, -2, -1]"    # aligned to the minimum: negative leads
    assert _digest(checkout) == before


# --------------------------------------------------------------------------- running and gating


@pytest.mark.rule("raggedspec mutation: catalogue, runner and gate")
def test_the_runner_catches_a_real_mutant_and_gates_on_a_planted_survivor():
    caught = _entry("chain_start_of: off by one against the group key")
    caught = Mutant(caught.name, caught.file, caught.old, caught.new, caught.spec,
                    ("conformance/test_dispatch.py::test_the_group_key_and_the_per_row_chain_start_are_the_same_expression",))
    planted = Mutant(
        "planted: a comment-only change",
        "reference/dispatch.py",
        "    top = max(vals)\n",
        "    top = max(vals)  # planted, changes nothing\n",
        "test",
        (
            "conformance/test_dispatch.py::test_the_draft_leads_are_the_distance_to_the_groups_widest_row",
        ),
    )
    before = _digest(ROOT / "reference/dispatch.py")
    results, red = runner.run_catalogue(
        [caught, planted], ROOT, jobs=1, check_baseline=False, log=lambda *_: None
    )
    assert _digest(ROOT / "reference/dispatch.py") == before
    by = {r.name: r for r in results}
    assert red == []
    assert by[caught.name].status == "CAUGHT"
    assert by[caught.name].detail == caught.tests[0]
    assert by[planted.name].status == "SURVIVED"

    no_equivalents = {"catalogue": {}, "mutmut": []}
    verdict = runner.gate(results, None, no_equivalents)
    assert not verdict.ok and any("planted" in r and "SURVIVED" in r for r in verdict.reasons)
    # listing it as an equivalent is what (and only what) lets it pass
    listed = {"catalogue": {planted.name: "comment only"}, "mutmut": []}
    assert runner.gate(results, None, listed).ok
    # an expected-survivor that gets caught means the equivalence claim is wrong
    wrong = [
        runner.MutantResult(caught.name, caught.file, "", "CAUGHT", "t", 0.0, expect="survive")
    ]
    assert not runner.gate(wrong, None, {"catalogue": {caught.name: "x"}, "mutmut": []}).ok


@pytest.mark.rule("raggedspec mutation: catalogue, runner and gate")
def test_main_exits_nonzero_on_a_planted_catalogue_survivor(monkeypatch, tmp_path):
    planted = Mutant(
        "planted: a comment-only change",
        "reference/dispatch.py",
        "    top = max(vals)\n",
        "    top = max(vals)  # planted\n",
        "test",
        ("conformance/test_dispatch.py::test_chain_start_of_needs_a_pair_to_seed_from",),
    )
    monkeypatch.setattr(runner, "select", lambda scope, only=None: [planted])
    out = tmp_path / "r.json"
    rc = runner.main(
        ["--catalogue-only", "--no-baseline", "--jobs", "1", "--no-docs", "--json", str(out)]
    )
    assert rc == 1
    data = json.loads(out.read_text())
    assert data["ok"] is False and data["catalogue"][0]["status"] == "SURVIVED"


# --------------------------------------------------------------------------- mutmut results


@pytest.mark.rule("raggedspec mutation: catalogue, runner and gate")
def test_the_score_is_killed_plus_timeout_over_total_minus_skipped(tmp_path):
    p = tmp_path / "mutmut-cicd-stats.json"
    p.write_text(
        json.dumps(
            {
                "killed": 90,
                "survived": 2,
                "total": 100,
                "no_tests": 1,
                "skipped": 4,
                "suspicious": 0,
                "timeout": 3,
                "check_was_interrupted_by_user": 0,
                "segfault": 0,
            }
        )
    )
    stats = runner.read_stats(p)
    assert stats["score"] == pytest.approx(100 * 93 / 96)
    assert runner.score_of({"killed": 0, "total": 0, "skipped": 0}) == 0.0
    assert runner.score_of(
        {"killed": 19, "timeout": 0, "total": 20, "skipped": 0}
    ) == pytest.approx(95.0)


MUTATED = '''
def x_f__mutmut_orig(a, b):
    """doc"""
    return a + b

def x_f__mutmut_1(a, b):
    """doc"""
    return a - b

def x_f__mutmut_2(a, b):
    """doc"""
    return a + b + 0

class C:
    def xǁCǁg__mutmut_orig(self, r):
        return r

    def xǁCǁg__mutmut_1(self, r):
        return None
'''


def _fake_mutants(tmp_path, codes, stats=None):
    d = tmp_path / "mutants"
    (d / "pkg").mkdir(parents=True)
    (d / "pkg" / "mod.py").write_text(MUTATED)
    (d / "pkg" / "mod.py.meta").write_text(json.dumps({"exit_code_by_key": codes}))
    if stats is not None:
        (d / "mutmut-cicd-stats.json").write_text(json.dumps(stats))
    return d


@pytest.mark.rule("raggedspec mutation: catalogue, runner and gate")
def test_the_mutants_dir_reader_builds_the_per_function_table_and_names_the_mutated_line(tmp_path):
    d = _fake_mutants(tmp_path, {"pkg.mod.x_f__mutmut_1": 1, "pkg.mod.x_f__mutmut_2": 0,
                                 "pkg.mod.xǁCǁg__mutmut_1": 36})
    rep = runner.read_mutants_dir(d)
    rows = {r.function: r for r in rep.rows}
    assert (rows["pkg.mod.f"].mutants, rows["pkg.mod.f"].killed, rows["pkg.mod.f"].survived) == (
        2,
        1,
        1,
    )
    assert (rows["pkg.mod.C.g"].mutants, rows["pkg.mod.C.g"].timeouts) == (1, 1)
    assert rep.stats["total"] == 3 and rep.score == pytest.approx(200 / 3)
    assert rep.survivors == [
        {
            "key": "pkg.mod.x_f__mutmut_2",
            "function": "pkg.mod.f",
            "status": "survived",
            "line": "return a + b + 0",
        }
    ]
    assert (
        runner.function_of("reference.dispatch.x_chain_start_of__mutmut_12")
        == "reference.dispatch.chain_start_of"
    )
    assert (
        runner.function_of("reference.dispatch.xǁCaptureOffsetsǁrow__mutmut_3")
        == "reference.dispatch.CaptureOffsets.row"
    )


@pytest.mark.rule("raggedspec mutation: catalogue, runner and gate")
def test_the_mutmut_gate_needs_each_modules_score_and_a_justification_for_every_survivor(
        tmp_path):
    # one module, 20 mutants: 19 killed and one survivor (95% exactly)
    codes = {f"pkg.mod.x_f__mutmut_{i}": 1 for i in range(3, 21)}
    codes |= {"pkg.mod.x_f__mutmut_1": 1, "pkg.mod.x_f__mutmut_2": 0}
    d = _fake_mutants(tmp_path, codes)
    rep = runner.read_mutants_dir(d)
    assert rep.modules["pkg/mod.py"].score == pytest.approx(95.0)
    none = {"catalogue": {}, "mutmut": []}
    v = runner.gate(None, rep, none)
    assert not v.ok and any("x_f__mutmut_2" in r for r in v.reasons)
    eq = {
        "catalogue": {},
        "mutmut": [{"function": "pkg.mod.f", "line": "return a+b+0", "why": "adds zero"}],
    }
    assert runner.gate(None, rep, eq).ok
    v = runner.gate(None, rep, eq, threshold=96.0)  # under the threshold
    assert not v.ok and v.reasons == ["mutmut: pkg/mod.py scores 95.0%, under 96%"]


@pytest.mark.rule("raggedspec mutation: catalogue, runner and gate")
def test_main_gates_an_existing_mutants_dir(tmp_path):
    d = _fake_mutants(
        tmp_path,
        {"pkg.mod.x_f__mutmut_1": 1, "pkg.mod.x_f__mutmut_2": 0},
        {"killed": 1, "survived": 1, "total": 2, "skipped": 0, "timeout": 0, "no_tests": 0},
    )
    eq = tmp_path / "eq.toml"
    eq.write_text(
        '[[mutmut]]\nfunction = "pkg.mod.f"\nline = "return a + b + 0"\nwhy = "adds zero"\n'
    )
    docs = tmp_path / "mutation.md"
    args = ["--mutmut-only", "--from-mutants", str(d), "--equivalent", str(eq), "--docs", str(docs)]
    assert runner.main(args) == 1  # 50% < 95%
    assert runner.main(args + ["--threshold", "50"]) == 0
    text = docs.read_text()
    assert "| `pkg/mod.py` | 2 | 1 | 1 | 0 | 0 | 50.0% | pass |" in text and "adds zero" in text
    assert text.count("BEGIN generated:mutmut-modules") == 1  # a rerun replaces its section
    bad = tmp_path / "bad.toml"
    bad.write_text('[[mutmut]]\nfunction = "pkg.mod.f"\nline = "x"\nwhy = ""\n')
    with pytest.raises(ValueError, match="one-line"):
        runner.load_equivalents(bad)
