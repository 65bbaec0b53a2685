"""The language-neutral test vectors (`raggedspec vectors`, docs/vectors.md) are themselves
tested: the standalone consumer passes them on the reference and on the torch port, catalogue
mutants fail the vectors of their rule and change their hash, the same arguments give the
same bytes, the writer refuses to clobber, and the manifest's spec sections match
docs/rules.md."""

import ast
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from raggedspec import vectors
from raggedspec.cli import main
from raggedspec.vectors.port import PORT_HOST_ONLY, reference_table
from raggedspec.reference.errors import Refusal

ROOT = Path(__file__).resolve().parents[1]
CONSUMER = ROOT / "examples" / "vectors_consumer.py"
DOC = ROOT / "docs" / "vectors.md"


def load_consumer():
    spec = importlib.util.spec_from_file_location("vectors_consumer", CONSUMER)
    module = importlib.util.module_from_spec(spec)
    sys.modules["vectors_consumer"] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def default_set(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("vectors") / "v"
    assert main(["vectors", "--out", str(out)]) == 0
    return out


def files_of(root: Path) -> dict[str, bytes]:
    return {
        p.relative_to(root).as_posix(): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


# --------------------------------------------------------------------------- consumer


@pytest.mark.rule("raggedspec vectors")
def test_the_consumer_imports_only_numpy_safetensors_and_the_standard_library():
    tree = ast.parse(CONSUMER.read_text())
    roots = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            roots |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            roots.add(node.module.split(".")[0])
    third_party = roots - set(sys.stdlib_module_names) - {"__future__"}
    assert third_party == {"numpy", "safetensors"}


@pytest.mark.rule("raggedspec vectors")
def test_every_vector_passes_on_the_reference(default_set):
    manifest = json.loads((default_set / "manifest.json").read_text())
    report = load_consumer().run_vectors(default_set, reference_table())
    assert report.failed == [] and report.missing == []
    assert report.passed == manifest["case_count"] > 500


@pytest.mark.rule("raggedspec vectors")
@pytest.mark.parametrize("dtype", ["float64", "float32", "bfloat16"])
def test_every_vector_the_port_implements_passes_on_the_port(default_set, dtype):
    pytest.importorskip("torch")
    from raggedspec.vectors.port import port_table

    manifest = json.loads((default_set / "manifest.json").read_text())
    report = load_consumer().run_vectors(default_set, port_table("cpu", dtype), dtype=dtype)
    assert report.failed == []
    assert sorted(report.missing) == sorted(PORT_HOST_ONLY)
    port_cases = sum(
        e["cases"]
        for e in manifest["functions"]
        if f"{e['family']}/{e['function']}" not in PORT_HOST_ONLY
    )
    assert report.passed == port_cases > 300


@pytest.mark.rule("raggedspec vectors")
def test_the_consumer_command_line_runs_a_table_it_is_given(default_set, tmp_path):
    run = subprocess.run(
        [
            sys.executable,
            str(CONSUMER),
            str(default_set),
            "--table",
            "raggedspec.vectors.port:reference_table",
            "--require-all",
        ],
        check=False,
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert re.search(r"^\d+ passed, 0 failed, 0 functions missing$", run.stdout, re.MULTILINE)
    bad = subprocess.run(
        [sys.executable, str(CONSUMER), str(default_set / "nowhere"), "--table", "x:y"],
        check=False,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 2 and "manifest.json does not exist" in bad.stderr
    future = tmp_path / "future"
    shutil.copytree(default_set, future)
    manifest = json.loads((future / "manifest.json").read_text())
    (future / "manifest.json").write_text(json.dumps(dict(manifest, schema_version=2)))
    with pytest.raises(ValueError, match="schema_version 2"):
        load_consumer().run_vectors(future, reference_table())


@pytest.mark.rule("raggedspec vectors")
def test_the_consumer_reports_a_wrong_value_a_missed_refusal_and_a_wrong_message(default_set):
    consumer = load_consumer()
    table = reference_table()
    good = table["step/plan_batch_step"]
    table["step/plan_batch_step"] = lambda i: dict(good(i), keep=good(i)["keep"] + 1)
    table["dispatch/resolve_ragged_rows"] = lambda i: {"rows": i["rows"]}
    real = table["masks/make_left_padded_causal_mask"]

    def reworded(i):
        try:
            return real(i)
        except Refusal as exc:
            raise type(exc)(str(exc) + "!") from None

    table["masks/make_left_padded_causal_mask"] = reworded
    report = consumer.run_vectors(default_set, table)
    failed = {where.split("/")[0] + "/" + where.split("/")[1] for where, _ in report.failed}
    assert failed == {
        "step/plan_batch_step",
        "dispatch/resolve_ragged_rows",
        "masks/make_left_padded_causal_mask",
    }
    assert any("returned" in p and "DispatchRefusal" in p for _, p in report.failed)
    lax = consumer.run_vectors(
        default_set, {"masks/make_left_padded_causal_mask": reworded}, messages="class"
    )
    assert lax.failed == [] and lax.passed > 0


# --------------------------------------------------------------------------- determinism, writing


@pytest.mark.rule("raggedspec vectors")
def test_the_same_arguments_give_a_byte_identical_folder(default_set, tmp_path):
    again = tmp_path / "again"  # another process, another string-hash seed
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONHASHSEED="12345")
    cmd = [sys.executable, "-m", "raggedspec", "vectors", "--out", str(again)]
    run = subprocess.run(
        cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert run.returncode == 0, run.stderr
    assert files_of(again) == files_of(default_set)
    other = tmp_path / "other-seed"
    assert main(["vectors", "--out", str(other), "--seed", "1"]) == 0
    assert (
        json.loads((other / "manifest.json").read_text())["content_hash"]
        != json.loads((default_set / "manifest.json").read_text())["content_hash"]
    )
    # worked examples and refusals do not depend on the seed; generated cases do
    ex = "dispatch/resolve_ragged_rows/refusal-ahead/case.json"
    assert files_of(other)[ex] == files_of(default_set)[ex]


@pytest.mark.rule("raggedspec vectors")
def test_rules_and_cases_select_without_changing_the_selected_cases(default_set, tmp_path):
    out = tmp_path / "masks"
    assert main(["vectors", "--out", str(out), "--rules", "masks/*"]) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert {e["family"] for e in manifest["functions"]} == {"masks"}
    sub = {k: v for k, v in files_of(default_set).items() if k.startswith("masks/")}
    assert {k: v for k, v in files_of(out).items() if k != "manifest.json"} == sub
    more = tmp_path / "more"
    assert (
        main(["vectors", "--out", str(more), "--rules", "step/plan_batch_step", "--cases", "20"])
        == 0
    )
    entry = json.loads((more / "manifest.json").read_text())["functions"][0]
    base = next(
        e
        for e in json.loads((default_set / "manifest.json").read_text())["functions"]
        if e["function"] == "plan_batch_step"
    )
    assert entry["cases"] == base["cases"] + 12


@pytest.mark.rule("raggedspec vectors")
def test_the_writer_refuses_to_clobber_and_replaces_only_a_vectors_folder(tmp_path, capsys):
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    assert main(["vectors", "--out", str(foreign), "--rules", "step/*"]) == 2
    err = capsys.readouterr().err
    assert str(foreign) in err and "not a vectors folder" in err
    assert files_of(foreign) == {"notes.txt": b"keep me"}
    a_file = tmp_path / "file"
    a_file.write_text("x")
    assert main(["vectors", "--out", str(a_file)]) == 2 and a_file.read_text() == "x"
    assert main(["vectors", "--out", str(tmp_path / "n"), "--rules", "nothing/*"]) == 2
    assert "matches no vector function" in capsys.readouterr().err
    assert main(["vectors", "--out", str(tmp_path / "n"), "--cases", "-1"]) == 2
    assert not (tmp_path / "n").exists()
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["vectors", "--out", str(empty), "--rules", "step/mtp_window"]) == 0
    (empty / "stale.txt").write_text("from an older run")
    assert main(["vectors", "--out", str(empty), "--rules", "step/mtp_window"]) == 0
    assert "stale.txt" not in files_of(empty) and "manifest.json" in files_of(empty)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "empty",
        "file",
        "foreign",
    ]  # no temp left


@pytest.mark.rule("raggedspec vectors")
def test_the_subcommand_help_names_its_flags(capsys):
    assert main(["vectors", "--help"]) == 0
    out = capsys.readouterr().out
    assert all(flag in out for flag in ("--out", "--rules", "--cases", "--seed", "docs/vectors.md"))
    assert main(["vectors"]) == 2 and "--out" in capsys.readouterr().err


@pytest.mark.rule("raggedspec vectors")
def test_a_failed_build_leaves_the_previous_folder_untouched(tmp_path, monkeypatch):
    out = tmp_path / "v"
    vectors.write(out, "step/mtp_window")
    before = files_of(out)

    def broken(*args):
        raise RuntimeError("disk full")

    monkeypatch.setattr(vectors, "build", broken)
    with pytest.raises(RuntimeError):
        vectors.write(out, "step/*")
    assert files_of(out) == before
    assert [p.name for p in tmp_path.iterdir()] == ["v"]


@pytest.mark.rule("raggedspec vectors")
def test_case_names_say_what_the_case_expects(default_set):
    kinds = {}
    for path in default_set.glob("*/*/*/case.json"):
        case = json.loads(path.read_text(encoding="utf-8"))
        prefix = case["case"].split("-")[0]
        kinds.setdefault(prefix, set()).add(case["expect"])
    assert kinds["refusal"] == {"refusal"} and kinds["malformed"] == {"malformed"}
    assert set(kinds) == {"example", "refusal", "malformed", "domain", "gen"}


@pytest.mark.rule("raggedspec vectors")
def test_the_default_set_is_small_and_fast_enough_to_commit(default_set):
    size = vectors.folder_size(default_set)
    assert size < 20_000_000, size
    assert len(files_of(default_set)) < 3000


# --------------------------------------------------------------------------- spec references


def rules_rows() -> list[list[str]]:
    rows = []
    for line in (ROOT / "docs" / "rules.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if (
            len(cells) == 4
            and line.startswith("|")
            and cells[0] != "rule"
            and not set(cells[0]) <= set("-: ")
        ):
            rows.append(cells)
    return rows


def sections_of(rule: str) -> set[tuple[str | None, str]]:
    """("C" | "M" | None, "4.5") for every § reference of a rule cell; a bare § takes the
    document named before it in the cell ("C §4.5, M §14, §23" -> C 4.5, M 14, M 23)."""
    found, doc = set(), None
    for m in re.finditer(r"(?:\b(C|M|masks)\s*)?§\s*(\d+(?:\.\d+)*)", rule):
        if m.group(1):
            doc = "M" if m.group(1) == "masks" else m.group(1)
        found.add((doc, m.group(2)))
    return found


def spec_mismatches(entries: list[dict]) -> list[str]:
    rows, bad = rules_rows(), []
    for e in entries:
        doc, num = e["spec"].split(" §")
        named = [
            r
            for r in rows
            if re.search(r"(?<![\w.])" + re.escape(e["reference"]) + r"(?!\w)", r[1])
        ]
        if not any(
            (doc, num) in sections_of(r[0]) or (None, num) in sections_of(r[0]) for r in named
        ):
            bad.append(f"{e['family']}/{e['function']}: {e['reference']} {e['spec']}")
    return bad


@pytest.mark.rule("raggedspec vectors")
def test_the_manifest_spec_sections_are_those_of_docs_rules(default_set):
    entries = json.loads((default_set / "manifest.json").read_text())["functions"]
    assert spec_mismatches(entries) == []
    # the check can fail: a wrong section or a function docs/rules.md does not name
    wrong = [dict(entries[0], spec="C §99"), dict(entries[1], reference="reference.nowhere.f")]
    assert len(spec_mismatches(wrong)) == 2


@pytest.mark.rule("raggedspec vectors")
@pytest.mark.skipif(
    not (ROOT / "scripts" / "vectors_doc.py").is_file(),
    reason="needs the checkout's scripts/ (an installed raggedspec has none)",
)
def test_the_generated_parts_of_docs_vectors_are_in_step_with_the_generator(default_set):
    spec = importlib.util.spec_from_file_location(
        "vectors_doc", ROOT / "scripts" / "vectors_doc.py"
    )
    vectors_doc = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(vectors_doc)
    text = DOC.read_text(encoding="utf-8")
    assert vectors_doc.render(text, default_set) == text
    shown = re.findall(r"<!-- example: (\S+) -->", text)
    assert "masks/union_mask/example-csa-rows-6-4-2" in shown and len(shown) >= 2
    for path in shown:  # every key of a shown case.json is described
        for key in json.loads((default_set / path / "case.json").read_text(encoding="utf-8")):
            assert f"| `{key}` |" in text, key
    # the check can fail: a hand edit of a shown case is caught
    assert vectors_doc.render(text.replace('"q0": 6', '"q0": 5'), default_set) == text
    assert text.replace('"q0": 6', '"q0": 5') != text
