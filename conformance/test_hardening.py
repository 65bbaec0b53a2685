"""Bad input to the command line, one test per class of failure: each exits 2 with one line
naming the file or flag, the value and what is allowed, prints no traceback, and changes no
existing file; a bug exits 3 with the traceback saved; outputs are staged and renamed; runs
too large for the limit are refused with their estimate before any work; conformance blames
the rule of the first differing tensor; mutation refuses an empty selection."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from raggedspec import cli
from raggedspec.outputs import OutputPathError, check_output_dir, check_output_file, staged

ROOT = Path(__file__).resolve().parents[1]
TRACEBACK = "Traceback (most recent call last)"
TINY = ["--batch", "2", "--steps", "5", "--set", "max_new_tokens=8", "-q"]


def run_cli(argv, capsys) -> tuple[int, str]:
    rc = cli.main([str(a) for a in argv])
    err = capsys.readouterr().err
    assert TRACEBACK not in err, err
    return rc, err


def one_error_line(err: str) -> str:
    lines = [ln for ln in err.splitlines() if ": error: " in ln]
    assert len(lines) == 1, err
    return lines[0]


# ------------------------------------------------------------------- scenario files


@pytest.mark.rule("raggedspec command line and raggedspec simulate")
@pytest.mark.parametrize(
    "content", [b"\x00\xff\xfe binary", "batch = 2\n".encode("utf-16")], ids=["binary", "utf-16"]
)
def test_a_scenario_file_that_is_not_utf8_exits_2_naming_the_file(content, tmp_path, capsys):
    sc = tmp_path / "s.toml"
    sc.write_bytes(content)
    out = tmp_path / "t.jsonl"
    out.write_text("earlier trace\n")
    rc, err = run_cli(["simulate", sc, "--out", out, "-q"], capsys)
    assert rc == 2
    line = one_error_line(err)
    assert str(sc) in line and "not UTF-8" in line
    assert out.read_text() == "earlier trace\n"


@pytest.mark.rule(
    "scenario config and validation",
    "raggedspec command line and raggedspec simulate",
)
def test_a_length_past_32_bits_exits_2_naming_the_key_and_range(tmp_path, capsys):
    sc = tmp_path / "s.toml"
    sc.write_text("max_seq_len = 1000000000000\n")
    rc, err = run_cli(["simulate", sc, "--out", tmp_path / "t.jsonl", "-q"], capsys)
    assert rc == 2
    line = one_error_line(err)
    assert (
        "max_seq_len" in line
        and "2147483647" in line
        and "1000000000000" in line
        and str(sc) in line
    )


@pytest.mark.rule("raggedspec command line and raggedspec simulate")
def test_an_acceptance_oracle_that_raises_exits_2_naming_it(tmp_path, capsys):
    mod = tmp_path / "raising_oracle.py"
    mod.write_text("def make(scenario):\n    raise RuntimeError('oracle is broken')\n")
    sys.path.insert(0, str(tmp_path))
    try:
        rc, err = run_cli(
            [
                "simulate",
                *TINY,
                "--acceptance",
                "oracle:raising_oracle:make",
                "--out",
                tmp_path / "t.jsonl",
            ],
            capsys,
        )
    finally:
        sys.path.remove(str(tmp_path))
    assert rc == 2
    assert "raising_oracle:make" in one_error_line(err) and "oracle is broken" in err


# ------------------------------------------------------------------------- outputs


@pytest.mark.rule("raggedspec command line and raggedspec simulate")
@pytest.mark.parametrize("where", ["child of a file", "directory", "csv under a file"])
def test_bad_output_paths_exit_2_before_any_work_and_clobber_nothing(where, tmp_path, capsys):
    afile = tmp_path / "afile"
    afile.write_text("keep me\n")
    out = tmp_path / "t.jsonl"
    out.write_text("earlier trace\n")
    argv = {
        "child of a file": ["--out", afile / "t.jsonl"],
        "directory": ["--out", tmp_path],
        "csv under a file": ["--out", out, "--csv", afile / "t.csv"],
    }[where]
    rc, err = run_cli(["simulate", *TINY, *argv], capsys)
    assert rc == 2
    line = one_error_line(err)
    assert ("--csv" if where.startswith("csv") else "--out") in line
    assert "estimated trace" not in err  # refused before the estimate, the run, any write
    assert out.read_text() == "earlier trace\n" and afile.read_text() == "keep me\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile", "t.jsonl"]


@pytest.mark.rule("raggedspec command line and raggedspec simulate")
def test_an_unwritable_output_folder_exits_2(tmp_path, monkeypatch, capsys):
    import raggedspec.outputs

    ro = tmp_path / "ro"
    ro.mkdir()
    real = (
        os.access
    )  # the machine may run as root, who writes anywhere: say the folder is read-only
    monkeypatch.setattr(
        raggedspec.outputs.os, "access", lambda p, mode: Path(p) != ro and real(p, mode)
    )
    rc, err = run_cli(["simulate", *TINY, "--out", ro / "t.jsonl"], capsys)
    assert rc == 2 and "not writable" in one_error_line(err) and str(ro) in err
    assert list(ro.iterdir()) == []


@pytest.mark.rule("raggedspec command line and raggedspec simulate")
def test_output_path_checks_name_the_flag_and_refuse_each_case(tmp_path):
    f = tmp_path / "f"
    f.write_text("x")
    for bad, check in (
        (f / "x.jsonl", check_output_file),
        (tmp_path, check_output_file),
        (f, check_output_dir),
        (f / "sub", check_output_dir),
    ):
        with pytest.raises(OutputPathError, match="--flag"):
            check(bad, "--flag")
    assert check_output_file(tmp_path / "new" / "t.jsonl", "--out") == tmp_path / "new" / "t.jsonl"
    assert not (tmp_path / "new").exists()  # a check creates nothing


@pytest.mark.rule("raggedspec command line and raggedspec simulate")
def test_a_failed_or_interrupted_write_leaves_every_existing_file_and_no_temporary(tmp_path):
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text("old a")
    b.write_text("old b")
    for exc in (RuntimeError("disk full"), KeyboardInterrupt()):
        with pytest.raises(type(exc)), staged() as stage:
            stage[a].write_text("new a")
            stage[b].write_text("half of b")
            raise exc
        assert (a.read_text(), b.read_text()) == ("old a", "old b")
        assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt", "b.txt"]
    with staged() as stage:
        stage[a].write_text("new a")
        stage[b].write_text("new b")
    assert (a.read_text(), b.read_text()) == ("new a", "new b")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt", "b.txt"]


@pytest.mark.rule("raggedspec command line and raggedspec simulate")
def test_simulate_interrupted_while_writing_the_csv_keeps_the_earlier_trace(
    tmp_path, monkeypatch, capsys
):
    from raggedspec.reference import trace as reference_trace

    out = tmp_path / "t.jsonl"
    out.write_text("earlier trace\n")

    def interrupted(trace, path):
        Path(path).write_text("partial")
        raise KeyboardInterrupt

    monkeypatch.setattr(reference_trace, "write_csv", interrupted)
    rc, err = run_cli(["simulate", *TINY, "--out", out, "--csv"], capsys)
    assert rc == 130 and "interrupted" in err
    assert out.read_text() == "earlier trace\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.jsonl"]


@pytest.mark.rule("raggedspec command line and raggedspec simulate")
def test_a_bug_exits_3_with_the_traceback_saved_to_the_printed_file(tmp_path, monkeypatch, capsys):
    import raggedspec.drift

    def broken(*args, **kwargs):
        raise ZeroDivisionError("a bug in the simulator")

    monkeypatch.setattr(raggedspec.drift, "simulate", broken)
    out = tmp_path / "t.jsonl"
    out.write_text("earlier trace\n")
    rc, err = run_cli(["simulate", *TINY, "--out", out], capsys)
    assert rc == 3 and "internal error" in err and "ZeroDivisionError" in err
    saved = Path(err.split("saved to ")[1].split(";")[0])
    try:
        text = saved.read_text()
        assert TRACEBACK in text and "a bug in the simulator" in text and "broken" in text
    finally:
        saved.unlink()
    assert out.read_text() == "earlier trace\n"


# ----------------------------------------------------------------------- run size


@pytest.mark.rule("raggedspec command line and raggedspec simulate")
def test_a_run_over_the_size_limit_is_refused_with_its_estimate_unless_forced(
    tmp_path, monkeypatch, capsys
):
    import raggedspec.estimate

    out = tmp_path / "t.jsonl"
    monkeypatch.setattr(raggedspec.estimate, "LIMIT_BYTES", 10_000)
    rc, err = run_cli(["simulate", *TINY, "--out", out], capsys)
    assert rc == 2 and not out.exists()
    line = one_error_line(err)
    assert "estimated" in line and "above the" in line and "--force" in line and "row-steps" in line
    rc, err = run_cli(["simulate", *TINY, "--out", out, "--force"], capsys)
    assert rc == 0 and out.is_file() and "over the limit" in err


@pytest.mark.rule("raggedspec command line and raggedspec simulate")
def test_the_largest_allowed_batch_is_refused_before_any_work(tmp_path, capsys):
    out = tmp_path / "t.jsonl"
    out.write_text("earlier trace\n")
    rc, err = run_cli(
        ["simulate", "--batch", str(2**20), "--steps", "20", "--out", out, "-q"], capsys
    )
    assert rc == 2 and "trace" in one_error_line(err) and "GB" in err
    assert out.read_text() == "earlier trace\n"


@pytest.mark.rule("raggedspec command line and raggedspec simulate")
def test_a_huge_tensor_scenario_is_refused_for_its_memory(tmp_path, capsys):
    rc, err = run_cli(
        [
            "simulate",
            "--mode",
            "tensor",
            "--batch",
            "4096",
            "--set",
            "prompt_len=2000",
            "--set",
            "max_new_tokens=2000",
            "--out",
            tmp_path / "t.jsonl",
            "-q",
        ],
        capsys,
    )
    assert rc == 2 and "memory" in one_error_line(err) and "tensor mode" in err


@pytest.mark.rule("raggedspec command line and raggedspec simulate")
def test_the_estimate_is_above_what_a_small_run_writes(tmp_path, capsys):
    from raggedspec.estimate import estimate
    from raggedspec.reference.scenario import load_scenario

    out = tmp_path / "t.jsonl"
    assert cli.main(["simulate", *TINY, "--out", str(out), "--csv"]) == 0
    est = estimate(
        load_scenario(
            None, cli.scenario_overrides(cli.build_parser().parse_args(["simulate", *TINY]))
        )
    )
    assert (
        est.jsonl_bytes >= out.stat().st_size
        and est.csv_bytes >= out.with_suffix(".csv").stat().st_size
    )
    assert est.jsonl_bytes < 4 * out.stat().st_size  # an estimate, not a blanket refusal


# ------------------------------------------------------------------------ drift


@pytest.mark.rule("raggedspec drift")
def test_drift_label_without_a_trace_exits_2(tmp_path, capsys):
    rc, err = run_cli(["drift", "--label", "mine", "--out", tmp_path / "o"], capsys)
    assert rc == 2 and "--label" in one_error_line(err) and "--trace" in err
    assert not (tmp_path / "o").exists()


@pytest.mark.rule("raggedspec drift: plot data from a trace")
@pytest.mark.parametrize(
    "line, words",
    [
        ('{"step": "x", "rows": []}', ["t.jsonl:1:", "field 'step'", '"x"', "integer"]),
        (
            '{"step": 1, "rows": [{"seq": 1, "own_len": "a"}]}',
            ["t.jsonl:1:", "field 'rows[].own_len'", '"a"', "integer"],
        ),
        (
            '{"step": 1, "rows": [{"seq": 1, "own_len": 3}], "buckets": "z"}',
            ["t.jsonl:1:", "field 'buckets'", '"z"'],
        ),
        (
            '{"step": 1, "rows": [{"seq": 1, "own_len": 3, "drafted": 1.5}]}',
            ["t.jsonl:1:", "field 'rows[].drafted'", "1.5"],
        ),
        ("5", ["t.jsonl:1:", "not a JSON object"]),
        ('{"step": 1, "rows": [7]}', ["t.jsonl:1:", "field 'rows[0]'", "row object"]),
    ],
)
def test_trace_fields_of_the_wrong_type_exit_2_naming_file_field_and_value(
    line, words, tmp_path, capsys
):
    trace = tmp_path / "t.jsonl"
    trace.write_text(line + "\n")
    rc, err = run_cli(["drift", "--trace", trace, "--out", tmp_path / "o"], capsys)
    assert rc == 2
    msg = one_error_line(err)
    for w in [str(trace), *words]:
        assert w in msg, (w, msg)
    assert not (tmp_path / "o").exists()


@pytest.mark.rule("raggedspec drift: plot data from a trace")
def test_a_trace_that_is_not_utf8_exits_2(tmp_path, capsys):
    trace = tmp_path / "t.jsonl"
    trace.write_bytes(b"\xff\xfe\x00binary")
    rc, err = run_cli(["drift", "--trace", trace, "--out", tmp_path / "o"], capsys)
    assert rc == 2 and "UTF-8" in one_error_line(err)


# ------------------------------------------------------------------------ bench


@pytest.mark.rule("raggedspec bench")
@pytest.mark.parametrize(
    "content, words",
    [
        (None, ["no such file"]),
        ("not json", ["not a JSON file"]),
        ('{"schema": "something else"}', ["`schema`"]),
        ('{"schema": "raggedspec-bench/1", "rows": 3}', ["`rows`", "list"]),
    ],
)
def test_bench_replot_on_a_missing_or_malformed_file_exits_2(content, words, tmp_path, capsys):
    path = tmp_path / "bench.json"
    if content is not None:
        path.write_text(content)
    rc, err = run_cli(["bench", "--replot", path], capsys)
    assert rc == 2
    line = one_error_line(err)
    assert "--replot" in line and str(path) in line and all(w in line for w in words)
    assert sorted(p.name for p in tmp_path.iterdir()) == ([] if content is None else ["bench.json"])


# ------------------------------------------------------------- conformance, mutation


def run_module(*args):
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run(
        [sys.executable, "-m", "raggedspec", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=300,
    )


@pytest.mark.rule("raggedspec conformance and its per-rule table")
def test_conformance_on_a_missing_path_or_an_empty_selection_exits_2():
    p = run_module("conformance", "--backend", "numpy", "--tests", "conformance/no_such_test.py")
    assert (
        p.returncode == 2
        and "--tests conformance/no_such_test.py" in p.stderr
        and "INTERNALERROR" not in p.stdout
    )
    p = run_module(
        "conformance",
        "--backend",
        "numpy",
        "--tests",
        "conformance/test_rope.py",
        "-k",
        "no_such_name",
    )
    assert p.returncode == 2 and "no test selected" in p.stderr and "no_such_name" in p.stderr


@pytest.mark.rule("raggedspec conformance and its per-rule table")
def test_an_end_to_end_failure_blames_the_rule_of_its_first_differing_tensor():
    """A port that rotates every row at row 0's offset: the RoPE row fails, the union-mask row
    (which also lists the failing end-to-end test) passes, and the failure is named."""
    p = run_module(
        "conformance",
        "--backend",
        "conformance.examples.rope_row0:factory",
        "--profile",
        "ci",
        "--tests",
        "conformance/test_backend.py",
        "conformance/test_end_to_end.py",
        "-k",
        "rope_positions_and_rotation or union_mask_matches or per_sequence_example",
    )
    assert p.returncode == 1, p.stdout[-3000:] + p.stderr[-2000:]
    rows = {
        ln.rsplit(None, 2)[0].strip(): ln.split()[-1]
        for ln in p.stdout.splitlines()
        if ln.endswith(("  pass", "  FAIL"))
    }
    rope = next(r for r in rows if r.startswith("RoPE positions and rotation, backend"))
    mask = next(r for r in rows if r.startswith("dead-prefix union mask, backend"))
    assert rows[rope] == "FAIL" and rows[mask] == "pass", rows
    blame = [ln for ln in p.stdout.splitlines() if ln.startswith("blamed: ")]
    assert (
        len(blame) == 1
        and "rope_positions" in blame[0]
        and "RoPE positions and rotation" in blame[0]
    )


@pytest.mark.rule("raggedspec conformance and its per-rule table")
def test_rule_table_fails_the_rules_a_failed_test_carries_or_the_tensor_it_names():
    from raggedspec.conformance.runner import E2E_RULE, NO_RULE, rule_table

    mask, rope = "dead-prefix union mask, backend", "RoPE positions and rotation, backend"
    rules = [mask, rope, E2E_RULE]
    ok = {"outcome": "passed", "examples": 2}
    results = {
        "t_mask": dict(ok, rules=[mask]),
        "t_rope": dict(ok, rules=[rope]),
        "t_e2e": {"outcome": "failed", "examples": 1, "rules": [E2E_RULE], "blame": rope},
    }
    got = {rule: (n, result) for rule, n, result in rule_table(results, rules)}
    assert got == {mask: (2, "pass"), rope: (2, "FAIL"), E2E_RULE: (1, "FAIL")}
    del results["t_e2e"]["blame"]  # no tensor named: only the rules the test carries fail
    got = {rule: result for rule, _, result in rule_table(results, rules)}
    assert got == {mask: "pass", rope: "pass", E2E_RULE: "FAIL"}
    results["t_mask"]["outcome"] = "failed"  # a failed test fails every rule it carries
    assert dict((r, x) for r, _, x in rule_table(results, rules))[mask] == "FAIL"
    results = {"t": dict(ok, rules=[]), "u": dict(ok, rules=["a rule the table lacks"]),
               "s": {"outcome": "skipped", "examples": 0, "rules": [rope]}}
    got = {rule: result for rule, _, result in rule_table(results, [mask, rope])}
    assert got == {mask: "not run", rope: "skipped", NO_RULE: "pass",
                   "a rule the table lacks": "pass"}


@pytest.mark.rule("raggedspec mutation: catalogue, runner and gate")
def test_mutation_only_matching_nothing_exits_2(capsys):
    rc = cli.main(["mutation", "--catalogue-only", "--only", "no such entry zzz"])
    out, err = capsys.readouterr()
    assert rc == 2 and "--only 'no such entry zzz'" in err and "matches no catalogue entry" in err
    assert "mutation gate: PASS" not in out and TRACEBACK not in err


# --------------------------------------------------------------------- exit codes


@pytest.mark.rule("raggedspec command line and raggedspec simulate")
def test_every_help_and_the_readme_state_the_exit_codes(capsys):
    for argv in (
        ["--help"],
        *([c, "--help"] for c in cli.COMMANDS if c != "mutation"),
        ["mutation", "--help"],
    ):
        assert cli.main(argv) == 0
        text = " ".join(capsys.readouterr().out.split())
        assert "Exit codes" in text and "2 bad input" in text, argv
    readme = (ROOT / "README.md").read_text()
    for code in ("`0`", "`1`", "`2`", "`3`"):
        assert code in readme.split("## Exit codes")[1].split("\n## ")[0]


@pytest.mark.rule("raggedspec drift")
def test_drift_over_the_memory_limit_is_refused_before_any_run(tmp_path, monkeypatch, capsys):
    import raggedspec.estimate

    monkeypatch.setattr(raggedspec.estimate, "LIMIT_BYTES", 1000)
    argv = ["drift", "--steps", "5", "--batch", "2", "--out", tmp_path / "o", "-q"]
    rc, err = run_cli(argv, capsys)
    assert rc == 2 and "memory" in one_error_line(err) and "--force" in err
    assert not (tmp_path / "o").exists()


@pytest.mark.rule("raggedspec mutation: catalogue, runner and gate")
def test_mutation_json_under_a_file_is_refused_before_the_run(tmp_path, capsys):
    afile = tmp_path / "afile"
    afile.write_text("keep me\n")
    argv = ["mutation", "--catalogue-only", "--only", "x", "--json", afile / "r.json"]
    rc, err = run_cli(argv, capsys)
    assert rc == 2 and "--json" in one_error_line(err) and afile.read_text() == "keep me\n"
    assert "is a file, not a folder" in err
