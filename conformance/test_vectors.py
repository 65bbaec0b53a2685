"""The language-neutral test vectors (`raggedspec vectors`, docs/vectors.md) are themselves
tested: every written expectation is recomputed by calling the reference rule functions
directly (`ORACLE`) and the spec's worked examples hold their stated values; the standalone
consumer passes them on the reference and on the torch port and fails a planted wrong rule,
whose hash changes; the hash recipe, the schemas, the dtype spelling and the policy marks are
checked from the written folder alone, as docs/vectors.md states them; the same arguments give
the same bytes, the writer refuses to clobber, and the manifest's spec sections match
docs/rules.md."""

import ast
import hashlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from raggedspec import vectors
from raggedspec.cli import main
from raggedspec.conformance.vector_oracle import ORACLE, WITHOUT_ORACLE
from raggedspec.reference import rope, scheduler, step
from raggedspec.reference.errors import Refusal
from raggedspec.vectors import schema
from raggedspec.vectors.port import PORT_HOST_ONLY, reference_table

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
    for messages in ("exact", "values"):
        report = load_consumer().run_vectors(default_set, reference_table(), messages=messages)
        assert report.failed == [] and report.missing == [] and report.skipped == []
        assert report.passed == manifest["case_count"] > 500


@pytest.mark.rule("raggedspec vectors")
@pytest.mark.parametrize("dtype, torch_dtype", [("F64", "float64"), ("F32", "float32"),
                                                ("BF16", "bfloat16")])
def test_every_vector_the_port_implements_passes_on_the_port(default_set, dtype, torch_dtype):
    pytest.importorskip("torch")
    from raggedspec.vectors.port import port_table

    manifest = json.loads((default_set / "manifest.json").read_text())
    table = port_table("cpu", torch_dtype)
    report = load_consumer().run_vectors(default_set, table, dtype=dtype, messages="exact")
    assert report.failed == []
    assert sorted(report.missing) == sorted(PORT_HOST_ONLY)
    port_cases = sum(
        e["cases"]
        for e in manifest["functions"]
        if f"{e['family']}/{e['function']}" not in PORT_HOST_ONLY
    )
    assert report.passed == port_cases > 100


def consumer_cli(*args: str, **env: str) -> subprocess.CompletedProcess:
    """examples/vectors_consumer.py run as a command from the checkout root."""
    return subprocess.run([sys.executable, str(CONSUMER), *args], check=False, cwd=ROOT,
                          env=dict(os.environ, **env), capture_output=True, text=True, timeout=120)


@pytest.mark.rule("raggedspec vectors")
def test_the_consumer_command_line_runs_a_table_it_is_given(default_set, tmp_path):
    table = "raggedspec.vectors.port:reference_table"
    run = consumer_cli(str(default_set), "--table", table, "--require-all", PYTHONPATH=str(ROOT))
    assert run.returncode == 0, run.stdout + run.stderr
    assert re.search(r"^\d+ passed, 0 failed, 0 functions missing$", run.stdout, re.MULTILINE)
    bad = consumer_cli(str(default_set / "nowhere"), "--table", "x:y")
    assert bad.returncode == 2 and "manifest.json does not exist" in bad.stderr
    future = tmp_path / "future"
    shutil.copytree(default_set, future)
    manifest = json.loads((future / "manifest.json").read_text())
    (future / "manifest.json").write_text(json.dumps(dict(manifest, schema_version=3)))
    with pytest.raises(ValueError, match="schema_version 3"):
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
    report = consumer.run_vectors(default_set, table, messages="exact")
    failed = {where.split("/")[0] + "/" + where.split("/")[1] for where, _ in report.failed}
    assert failed == {
        "step/plan_batch_step",
        "dispatch/resolve_ragged_rows",
        "masks/make_left_padded_causal_mask",
    }
    assert any("returned" in p and "DispatchRefusal" in p for _, p in report.failed)
    # matching by class plus the values the message names: another wording passes when it
    # names the values, and fails when it drops one; the class alone accepts both
    one = {"masks/make_left_padded_causal_mask": reworded}
    assert consumer.run_vectors(default_set, one, messages="values").failed == []

    def vague(i):
        try:
            return real(i)
        except Refusal as exc:
            raise type(exc)("refused") from None

    vaguer = {"masks/make_left_padded_causal_mask": vague}
    failed = consumer.run_vectors(default_set, vaguer, messages="values").failed
    assert failed and all("does not name all of" in p for _, p in failed)
    lax = consumer.run_vectors(default_set, vaguer, messages="class")
    assert lax.failed == [] and lax.passed > 0
    assert consumer.names_values("row 1's lead pad 5, [0, 5]", [1, 5, 0, 5])
    assert not consumer.names_values("row 15 and V4", [1, 4])


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


# --------------------------------------------------------------------------- against the rules


def consumer_failures(report) -> set[str]:
    """The functions (family/function) with a failed case."""
    return {"/".join(where.split("/")[:2]) for where, _ in report.failed}


@pytest.mark.rule("raggedspec vectors")
def test_every_expectation_equals_the_reference_rule_called_directly(default_set):
    """Every written expected output and refusal, host-only rules included, is recomputed by
    calling the reference rule function itself (conformance/vector_oracle.py), not through
    the adapters that wrote it; only the functions that take cache slots or mask pieces
    lack an oracle, and the worked examples and the port pin those."""
    report = load_consumer().run_vectors(default_set, ORACLE, messages="exact")
    assert report.failed == [] and sorted(report.missing) == sorted(WITHOUT_ORACLE)
    assert set(PORT_HOST_ONLY) <= set(ORACLE)
    assert report.passed > 700


@pytest.mark.rule("raggedspec vectors")
def test_a_wrong_expected_value_written_into_a_vector_fails(default_set, tmp_path):
    copy = tmp_path / "v"
    shutil.copytree(default_set, copy)
    path = copy / "step" / "plan_batch_step" / "example-u-1-1-2-a-3-0-1" / "case.json"
    case = json.loads(path.read_text())
    case["outputs"]["keep"] += 1
    path.write_text(json.dumps(case))
    one = {"step/plan_batch_step": ORACLE["step/plan_batch_step"]}
    report = load_consumer().run_vectors(copy, one)
    assert [w for w, _ in report.failed] == ["step/plan_batch_step/example-u-1-1-2-a-3-0-1"]


# The spec's worked examples, with the values cache-and-draft.md (C) and
# masks-and-scheduling.md (M) state for them: case -> expected JSON outputs (or refusal class).
WORKED = {
    # M §2's table
    "dispatch/resolve_ragged_rows/example-none": {"rows": None},
    "dispatch/resolve_ragged_rows/example-uniform": {"rows": None},
    "dispatch/resolve_ragged_rows/example-ragged": {"rows": [12, 10, 7]},
    "dispatch/resolve_ragged_rows/refusal-width": "DispatchRefusal",
    "dispatch/resolve_ragged_rows/refusal-ahead": "DispatchRefusal",
    "dispatch/resolve_ragged_rows/refusal-no-row-at-end": "DispatchRefusal",
    # C §8.1, §8.2
    "step/plan_step_window/example-per-row": {"uncached": [1, 1, 1], "ok": True},
    "step/plan_step_window/example-shared-width": {"uncached": [1, 0, 0], "ok": False},
    "dispatch/resolve_row_cache_lens/example-leads-0-7-0-3": {"row_cache_lens": [40, 33, 40, 37]},
    "dispatch/resolve_row_cache_lens/example-all-zero": {"row_cache_lens": None},
    # C §9.1: 8 keys vs 1 at eight lengths, 4 keys under either flag for eight tails
    "draft/draft_group_keys/example-eight-lengths-per-row": {"keys": [[1, 0]] * 8},
    "draft/draft_group_keys/example-eight-lengths-scalar": {
        "keys": [[1, c - 1] for c in (40, 33, 37, 31, 39, 35, 30, 38)]},
    # C §9.4, §9.5
    "dispatch/resolve_ragged_chain_starts/example-40-33-37-40": {"starts": [40, 33, 37, 40]},
    "dispatch/resolve_ragged_chain_starts/example-uniform": {"starts": None},
    "dispatch/resolve_draft_leads/example-40-33-37-40": {"leads": [0, 7, 3, 0]},
    "dispatch/resolve_draft_leads/example-disabled": {"leads": None},
    # C §6.2: all equal -> [first]; empty -> [0]; else verbatim
    "dispatch/resolve_capture_offsets/example-uniform-collapses": {"values": [7]},
    "dispatch/resolve_capture_offsets/example-empty-is-zero": {"values": [0]},
    "dispatch/resolve_capture_offsets/example-ragged-survives": {"values": [10, 7, 12]},
    # C §12.1, §12.2
    "step/plan_batch_step/example-u-1-1-2-a-3-0-1": {"keep": 1, "n_drop": 3,
                                                     "next_uncached": [4, 1, 3]},
    "step/plan_per_sequence_step/example-w5-seven-rows": {
        "committed": [1, 5, 5, 5, 5, 2, 4], "dropped": [4, 0, 0, 0, 0, 3, 1],
        "next_uncached": [1] * 7},
    "step/plan_batch_step/example-w5-seven-rows": {"keep": 1},
    # C §2: floored to 8 bits unless allowed
    "capability/mtp_tail_isq/domain-afq2-floored": {"isq": "AFQ8"},
    "capability/mtp_tail_isq/domain-hqq4-floored": {"isq": "HQQ8"},
    "capability/mtp_tail_isq/domain-q4_0-floored": {"isq": "Q8_0"},
    "capability/mtp_tail_isq/domain-afq2-allowed": {"isq": "AFQ2"},
    # C §15: from_fused_verify(d, a): reached = min(a + 1, d), committed = 1 + a
    "accounting/from_fused_verify/example-rejected-at-1": {"step": {
        "accepted": 1, "proposed": 4, "steps": 1, "drafted_steps": 1, "committed": 2,
        "batch_steps": 0, "pos_over_cap": 0, "accepted_at": [1] + [0] * 7,
        "reached_at": [1, 1] + [0] * 6}},
    # M §3, M §5: raw_keep_span(1, 4, 7) = (3, 4)
    "masks/raw_keep_span/example-csa-rows-6-4-2": {"raw_base": 3, "keep": 4},
}


@pytest.mark.rule("raggedspec vectors")
def test_the_worked_examples_hold_the_values_the_spec_states(default_set):
    for path, want in WORKED.items():
        case = json.loads((default_set / path / "case.json").read_text())
        if isinstance(want, str):
            assert case["raises"]["class"] == want, path
        else:
            assert {k: case["outputs"][k] for k in want} == want, path
    from safetensors.numpy import load_file

    # M §5's CSA example: raw columns 3..6 then compressed block 0; row 2 masks column 3
    # (its dead prefix) and the block it has not completed
    csa = default_set / "masks/union_mask/example-csa-rows-6-4-2"
    mask = load_file(str(csa / "outputs.safetensors"))
    keep = np.isfinite(mask["mask"][:, 0, 0, :]).astype(int).tolist()
    assert keep == [[1, 1, 1, 1, 1], [1, 1, 1, 1, 1], [0, 1, 1, 1, 0]]
    # C §4.5: lives [12, 10] -> lead_pad [0, 2]; row 1 is two zero columns, then its own 10
    folder = default_set / "align/front_align/example-lives-12-and-10"
    case = json.loads((folder / "case.json").read_text())
    k_in = load_file(str(folder / "inputs.safetensors"))["k.1"]
    k_out = load_file(str(folder / "outputs.safetensors"))["k.1"]
    assert case["outputs"]["leads"] == [0, 2] and k_out.shape[2] == 12
    assert not k_out[:, :, :2].any() and np.array_equal(k_out[:, :, 2:], k_in)


def longest_accept(uncached, accepted, w):
    """A wrong cohort rule: it keeps the batch's longest accept instead of its shortest."""
    valid = [u + a for u, a in zip(uncached, accepted, strict=True)]
    keep = max(valid, default=0)
    return step.CohortPlan(keep, max(w - keep, 0), [max(v + 1 - keep, 0) for v in valid])


def first_row_offset(x, offsets, rope_dims, theta, inverse=False):
    """A wrong RoPE: every row rotated at row 0's offset."""
    return REAL_ROPE(x, [offsets[0]] * len(offsets), rope_dims, theta, inverse=inverse)


def widest_bucket(buckets, priorities, discrete):
    """A wrong bucket choice: always the longest key."""
    return max(buckets)


REAL_ROPE = rope.apply_rope
PLANTED = [  # (module, rule, a wrong version, the vector function whose rule it is)
    (step, "plan_batch_step", longest_accept, "step/plan_batch_step"),
    (rope, "apply_rope", first_row_offset, "rope/apply_rope"),
    (scheduler, "select_running_bucket", widest_bucket, "scheduler/select_running_bucket"),
]


@pytest.mark.rule("raggedspec vectors")
@pytest.mark.parametrize("module, rule, wrong, key", PLANTED, ids=[p[1] for p in PLANTED])
def test_a_planted_wrong_rule_fails_its_vectors_and_changes_only_its_hash(
    default_set, tmp_path, monkeypatch, module, rule, wrong, key
):
    monkeypatch.setattr(module, rule, wrong)
    report = load_consumer().run_vectors(default_set, reference_table())
    assert consumer_failures(report) == {key}
    base = {f"{e['family']}/{e['function']}": e["hash"]
            for e in json.loads((default_set / "manifest.json").read_text())["functions"]}
    family = vectors.write(tmp_path / "wrong", key.split("/")[0] + "/*")
    changed = {f"{e['family']}/{e['function']}" for e in family["functions"]
               if e["hash"] != base[f"{e['family']}/{e['function']}"]}
    assert changed == {key} and len(family["functions"]) > 1


# ------------------------------------------------------------------ the format, from the folder


def recomputed_hash(root: Path, key: str) -> str:
    """docs/vectors.md, "Hashes": SHA-256 over the function's files (every file under
    DIR/<family>/<function>/), sorted by their path relative to DIR as a UTF-8 byte string,
    each contributing that path, one NUL byte, and the 32-byte SHA-256 of its content."""
    paths = sorted(p.relative_to(root).as_posix().encode() for p in (root / key).rglob("*")
                   if p.is_file())
    h = hashlib.sha256()
    for rel in paths:
        h.update(rel + b"\0" + hashlib.sha256((root / rel.decode()).read_bytes()).digest())
    return h.hexdigest()


@pytest.mark.rule("raggedspec vectors")
def test_every_hash_is_recomputed_from_the_folder_alone_following_the_docs(default_set):
    manifest = json.loads((default_set / "manifest.json").read_text())
    whole = hashlib.sha256()
    for e in manifest["functions"]:
        key = f"{e['family']}/{e['function']}"
        assert recomputed_hash(default_set, key) == e["hash"], key
        whole.update(f"{key}\0{e['hash']}\n".encode())
        cases = sorted(p.parent.name for p in (default_set / key).glob("*/case.json"))
        assert e["case_names"] == cases and e["cases"] == len(cases), key
    assert whole.hexdigest() == manifest["content_hash"]


def safetensors_header(path: Path) -> dict:
    """The JSON header of a safetensors file (8-byte little-endian length, then JSON)."""
    data = path.read_bytes()
    n = int.from_bytes(data[:8], "little")
    return {k: v for k, v in json.loads(data[8:8 + n]).items() if k != "__metadata__"}


@pytest.mark.rule("raggedspec vectors")
def test_tensors_have_one_dtype_spelling_in_case_json_and_the_safetensors_header(default_set):
    seen = set()
    for path in default_set.glob("*/*/*/case.json"):
        case = json.loads(path.read_text())
        for meta, name in ((case["tensor_inputs"], "inputs"), (case["tensor_outputs"], "outputs")):
            if not meta:
                continue
            header = safetensors_header(path.parent / f"{name}.safetensors")
            assert {k: (m["dtype"], m["shape"]) for k, m in meta.items()} == {
                k: (h["dtype"], h["shape"]) for k, h in header.items()}, path
            seen |= {m["dtype"] for m in meta.values()}
    manifest = json.loads((default_set / "manifest.json").read_text())
    assert seen == {"F64", "I64"} and set(manifest["tolerance"]) == {"F64", "F32", "BF16"}


@pytest.mark.rule("raggedspec vectors")
def test_every_case_conforms_to_its_functions_schema_and_a_wrong_shape_does_not(default_set):
    manifest = json.loads((default_set / "manifest.json").read_text())
    for e in manifest["functions"]:
        sch = json.loads((default_set / e["schema"]).read_text())
        for name in e["case_names"]:
            case = json.loads((default_set / e["family"] / e["function"] / name / "case.json")
                              .read_text())
            assert schema.errors(case, sch) == [], (e["function"], name)
    sch = json.loads((default_set / "draft/draft_groups/schema.json").read_text())
    case = json.loads((default_set / "draft/draft_groups/example-cohort/case.json").read_text())
    assert schema.errors(case, sch) == []
    wrong = [
        dict(case, outputs={"groups": [[1, 39, 0]]}),           # rows not a list
        dict(case, outputs={}),                                  # an output missing
        dict(case, inputs=dict(case["inputs"], w=True)),          # a bool is not an integer
        dict(case, inputs=dict(case["inputs"], extra=1)),         # an undeclared input
        dict(case, expect="refusal"),                             # a refusal needs raises
    ]
    assert all(schema.errors(c, sch) for c in wrong)


@pytest.mark.rule("raggedspec vectors")
def test_the_schemas_are_valid_json_schema_for_a_standard_validator(default_set):
    jsonschema = pytest.importorskip("jsonschema", reason="jsonschema cross-checks the schemas")
    for path in sorted(default_set.glob("*/*/schema.json"))[::7]:
        sch = json.loads(path.read_text())
        jsonschema.Draft202012Validator.check_schema(sch)
        validator = jsonschema.Draft202012Validator(sch)
        for case in sorted(path.parent.glob("*/case.json")):
            assert list(validator.iter_errors(json.loads(case.read_text()))) == [], case


def paged_engine() -> dict:
    """The reference, but with a paged engine's buffers: every slot's capacity is its length
    (no 512-column growth), and nothing is refused for a capacity above max_seq_len."""
    table = reference_table()
    for key in [k for k in table if k.startswith("align/")]:
        real = table[key]

        def paged(inputs, real=real):
            try:
                out = real(inputs)
            except Refusal as exc:
                if "capacity" not in str(exc):
                    raise
                return {"leads": [], "lens": [], "capacities": []}
            return dict(out, capacities=list(out.get("lens", [])))

        table[key] = paged
    return table


@pytest.mark.rule("raggedspec vectors")
def test_policy_outputs_are_marked_so_a_paged_engine_can_skip_them(default_set):
    consumer = load_consumer()
    strict = consumer.run_vectors(default_set, paged_engine())
    # a draft group's buffer is sized at its width, so there the paged capacities agree
    assert consumer_failures(strict) == {f"align/{f}" for f in (
        "front_align", "strip_dead_prefix", "concat", "split")}
    lax = consumer.run_vectors(default_set, paged_engine(), skip_policy=True)
    assert lax.failed == [] and lax.missing == []
    whole = [w for w, what in lax.skipped if what.startswith("the whole case")]
    assert whole == ["align/front_align/refusal-capacity-above-max-seq-len"]
    assert {what for _, what in lax.skipped} - {what for w, what in lax.skipped if w in whole} == {
        "capacities"}
    manifest = json.loads((default_set / "manifest.json").read_text())
    assert {e["function"]: e["policy"] for e in manifest["functions"] if e["policy"]} == {
        f: ["capacities"] for f in ("front_align", "strip_dead_prefix", "concat", "split",
                                    "front_align_draft_group")}


@pytest.mark.rule("raggedspec vectors")
@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_written_files_get_the_umasks_mode(tmp_path, umask):
    old = os.umask(umask)
    try:
        vectors.write(tmp_path / "v", "step/mtp_window")
    finally:
        os.umask(old)
    modes = {p.stat().st_mode & 0o777 for p in (tmp_path / "v").rglob("*") if p.is_file()}
    assert modes == {0o666 & ~umask}

# --------------------------------------------------------------------------- spec references


def rules_rows() -> list[list[str]]:
    rows = []
    for line in (ROOT / "docs" / "rules.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if (
            len(cells) == 3
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
