"""`raggedspec simulate`: a scenario (file, shipped example, flags) gives a trace read_trace
reads back (JSONL and typed CSV), the flags reach the scenario, a refused step still writes
the trace and exits 1, bad scenario values exit 2 naming the key, the range and the value
(seeds and the model table included), oversized runs are refused before any work, the
progress bar finishes, the documented oracle example runs, and the tensor mode gives the
lengths mode's integer trace. The generic command line (help, exit codes, outputs, plug-ins,
fuzzing) is test_cli.py."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

from raggedspec import cli
from raggedspec.conformance.helpers import (
    PACKAGE,
    TRACEBACK,
    Tty,
    console_script,
    one_error_line,
    run_cli,
    write,
)
from raggedspec.reference.trace import read_trace

pytestmark = pytest.mark.rule("raggedspec command line and raggedspec simulate")

PNG = b"\x89PNG\r\n\x1a\n"
SMALL = ["--batch", "4", "--steps", "30", "--set", "max_new_tokens=[20,40]"]
TINY = ["--batch", "2", "--steps", "5", "--set", "max_new_tokens=8", "-q"]


# ------------------------------------------------------------------------------- the trace


def test_simulate_writes_a_trace_that_read_trace_reads_back(tmp_path):
    out = tmp_path / "run" / "t.jsonl"
    rc, stdout, _ = run_cli("simulate", *SMALL, "--out", out, "--csv")
    assert rc == 0
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert lines[0]["type"] == "header" and lines[0]["version"] == 1
    assert lines[0]["scenario"]["batch"] == 4 and lines[-1]["type"] == "summary"
    steps = [x for x in lines if x["type"] == "step"]
    assert 0 < len(steps) <= 30 and lines[-1]["steps"] == len(steps)
    back = read_trace(out)
    assert list(back.steps()) == steps
    from_csv = list(read_trace(out.with_suffix(".csv")).steps())
    assert [[(r["seq"], r["own_len"], r["accepted"]) for r in s["rows"]] for s in from_csv] == [
        [(r["seq"], r["own_len"], r["accepted"]) for r in s["rows"]] for s in steps if s["rows"]
    ]
    # The markers are printed exactly as the run records them, MTP first.
    printed = stdout.splitlines()
    assert printed == back.markers()
    assert printed[0].startswith("MTP[agg] accept_rate=")
    assert printed[1].startswith("SCHED[agg] calls=")


def test_simulate_flags_reach_the_scenario_and_override_the_file(tmp_path):
    sc = write(tmp_path / "s.json",
               json.dumps({"batch": 3, "depth": 2, "steps": 12, "max_new_tokens": 30}))
    out = tmp_path / "t.jsonl"
    assert run_cli("simulate", sc, "--depth", "5", "--acceptance", "all-accept",
                   "--out", out)[0] == 0
    header = json.loads(out.read_text().splitlines()[0])["scenario"]
    assert header["depth"] == 5 and header["batch"] == 3
    assert header["acceptance"]["model"] == "all-accept"
    decode = [s for s in read_trace(out).steps() if s["phase"] == "decode"]
    # all-accept at depth 5 (w = 6): a u = 1 row drafts 5 and accepts all 5.
    assert decode and all(r["accepted"] == r["drafted"] for s in decode for r in s["rows"])
    assert max(r["drafted"] for s in decode for r in s["rows"]) == 5


def test_max_seq_len_arrival_and_no_xs_per_seq_flags(tmp_path):
    sc = write(tmp_path / "s.json", json.dumps({"batch": 3, "xs_per_seq": True, "steps": 4}))
    out = tmp_path / "t.jsonl"
    assert run_cli("simulate", sc, "--max-seq-len", "1040", "--arrival", "staggered",
                   "--no-xs-per-seq", "--out", out)[0] == 0
    scenario = json.loads(out.read_text().splitlines()[0])["scenario"]
    assert (scenario["max_seq_len"], scenario["arrival"], scenario["xs_per_seq"]) == (
        1040, "staggered", False)
    assert run_cli("simulate", sc, "--out", out)[0] == 0
    # untouched without the flag
    assert json.loads(out.read_text().splitlines()[0])["scenario"]["xs_per_seq"] is True
    rc, _, err = run_cli("simulate", "--max-seq-len", "1", "--out", out)
    assert rc == 2 and "'max_seq_len'" in err
    rc, _, err = run_cli("simulate", "--arrival", "sometimes", "--out", out)
    assert rc == 2 and "all-at-once, staggered" in err


def test_the_csv_carries_the_step_fields_with_their_types(tmp_path):
    """CSV: step-level width, committed, prefill and error are columns; read back, every
    step with rows equals the JSONL step (ints, floats, bucket booleans, lists, null)."""
    out = tmp_path / "t.jsonl"
    rc = run_cli("simulate", "--batch", "5", "--steps", "16", "--set", "prompt_len=[3,9]",
                 "--set", "max_new_tokens=25", "--advance", "per-sequence", "--xs-per-seq",
                 "--admission", "grant", "--world", "WB", "--strip", "none", "--out", out,
                 "--csv")[0]
    assert rc == 1  # the no-strip control is refused by a rule (exit 1), the trace is written
    header = out.with_suffix(".csv").read_text().splitlines()[0].split(",")
    assert header[-4:] == ["step_width", "step_committed", "prefill", "error"]
    want = [s for s in read_trace(out).steps() if s["rows"]]
    got = list(read_trace(out.with_suffix(".csv")).steps())
    assert got == want
    assert any(s["error"] for s in got) and any(s["prefill"] for s in got)
    assert all(isinstance(s["rows"][0]["bucket"][3], bool) and isinstance(s["width"], int)
               for s in got)
    assert all(s["rows"][0]["bucket"][1] is False for s in got)


@pytest.mark.slow
def test_simulate_runs_the_tensor_mode_on_the_torch_backend_with_the_same_trace(tmp_path):
    """`--backend torch` reaches the simulator: the integer trace equals the numpy backend's,
    and the backend flags are refused (exit 2, saying why) outside tensor mode or for an
    unknown backend."""
    common = ["simulate", "--batch", "3", "--depth", "2", "--steps", "12", "--mode", "tensor",
              "-q"]
    assert run_cli(*common, "--out", tmp_path / "n.jsonl")[0] == 0
    assert run_cli(*common, "--backend", "torch", "--out", tmp_path / "t.jsonl")[0] == 0
    numpy_lines = (tmp_path / "n.jsonl").read_text().splitlines()[1:]
    torch_lines = (tmp_path / "t.jsonl").read_text().splitlines()[1:]
    assert numpy_lines == torch_lines and len(numpy_lines) > 5
    rc, _, err = run_cli("simulate", "--backend", "torch", "--out", tmp_path / "x.jsonl", "-q")
    assert rc == 2 and "need --mode tensor" in err
    rc, _, err = run_cli(*common, "--backend", "nope", "--out", tmp_path / "x.jsonl")
    assert rc == 2 and "unknown backend 'nope'" in err


# ----------------------------------------------------------------------- refusals, exit 1


def test_simulate_exits_1_when_a_rule_refuses_a_step_and_still_writes_the_trace(tmp_path):
    # The no-strip negative control records padded lengths until the left-aligned guard refuses.
    out = tmp_path / "t.jsonl"
    rc, _, err = run_cli("simulate", *SMALL, "--advance", "per-sequence", "--xs-per-seq",
                         "--admission", "grant", "--world", "WB", "--strip", "none",
                         "--out", out)
    assert rc == 1 and "refused" in err and "left-aligned guard" in err
    assert any(s.get("error") for s in read_trace(out).steps())


def test_a_refused_per_sequence_request_is_a_warning_naming_the_check(tmp_path):
    rc, _, err = run_cli("simulate", *SMALL, "--advance", "per-sequence",
                         "--out", tmp_path / "t.jsonl")
    assert rc == 0
    assert "warning" in err and "cannot honour it" in err and "ARC_V4_XS_PER_SEQ" in err


# ---------------------------------------------------------------- bad scenario values, exit 2


@pytest.mark.parametrize("argv, words", [
    (["--depth", "9"], ["'depth'", "0..=8", "9"]),
    (["--batch", "0"], ["'batch'", "1..=", "got 0"]),
    (["--advance", "sideways"], ["'advance'", "cohort", "per-sequence"]),
    (["--set", "bogus=3"], ["'bogus'", "unknown key"]),
    (["--set", "max_new_tokens=-4"], ["'max_new_tokens'", ">= 1"]),
    # a seed past 64 bits is refused, never reduced modulo 2**64 (it would replay seed 0)
    (["--seed", str(2**70)], ["'seed'", "0..=18446744073709551615", str(2**70)]),
    (["--set", "model.seed=-1"], ["'model.seed'", "0..=18446744073709551615", "-1"]),
    # a type error names the field, the value and what is allowed (no Python comparison text)
    (["--set", 'model.vocab="x"'], ["'model.vocab'", "integer >= 1", "'x'"]),
    (["--set", 'model.compress_ratios=["a"]'], ["'model.compress_ratios'", "integer", "'a'"]),
    (["--set", 'model.mtp="tower"'], ["'model.mtp'", "block, heads", "'tower'"]),
])
def test_a_bad_scenario_value_exits_2_naming_the_key_and_range(argv, words, tmp_path):
    rc, _, err = run_cli("simulate", *argv, "--out", tmp_path / "t.jsonl")
    assert rc == 2 and TRACEBACK not in err and "not supported between" not in err
    line = one_error_line(err)
    for w in words:
        assert w in line, f"{w!r} not in {line!r}"
    assert not (tmp_path / "t.jsonl").exists()


def test_the_largest_seed_runs_and_differs_from_seed_0(tmp_path):
    for seed in (0, 2**64 - 1):
        assert run_cli("simulate", *TINY, "--seed", seed,
                       "--out", tmp_path / f"{seed}.jsonl")[0] == 0
    steps = [(tmp_path / f"{s}.jsonl").read_text().splitlines()[1:] for s in (0, 2**64 - 1)]
    assert steps[0] != steps[1]


def test_a_bad_scenario_file_exits_2_from_the_console(tmp_path):
    bad = write(tmp_path / "bad.toml", "batch = 4\ndepth = 12\n")
    rc, _, err = run_cli("simulate", bad, "--out", tmp_path / "t.jsonl")
    assert rc == 2 and "'depth'" in err and "0..=8" in err
    rc, _, err = run_cli("simulate", tmp_path / "nope.toml")
    assert rc == 2 and "nope.toml" in err


@pytest.mark.parametrize(
    "content", [b"\x00\xff\xfe binary", "batch = 2\n".encode("utf-16")], ids=["binary", "utf-16"]
)
def test_a_scenario_file_that_is_not_utf8_exits_2_naming_the_file(content, tmp_path):
    sc = tmp_path / "s.toml"
    sc.write_bytes(content)
    out = write(tmp_path / "t.jsonl", "earlier trace\n")
    rc, _, err = run_cli("simulate", sc, "--out", out, "-q")
    line = one_error_line(err)
    assert rc == 2 and str(sc) in line and "not UTF-8" in line
    assert out.read_text() == "earlier trace\n"


@pytest.mark.rule("scenario config and validation")
def test_a_length_past_32_bits_exits_2_naming_the_key_and_range(tmp_path):
    sc = write(tmp_path / "s.toml", "max_seq_len = 1000000000000\n")
    rc, _, err = run_cli("simulate", sc, "--out", tmp_path / "t.jsonl", "-q")
    line = one_error_line(err)
    assert rc == 2 and "max_seq_len" in line and "2147483647" in line
    assert "1000000000000" in line and str(sc) in line


@pytest.mark.parametrize("make, words", [
    (lambda d: "file:/nonexistent", ["'acceptance.path'", "/nonexistent", "does not exist"]),
    (lambda d: "file:" + str(write(d / "neg.json", "[1,-2]")),
     ["'acceptance.path'", "neg.json", "[1, -2]"]),
    (lambda d: "file:" + str(write(d / "bad.json", "not json")),
     ["'acceptance.path'", "bad.json", "not valid JSON"]),
    (lambda d: "oracle:nosuchmod:f", ["'acceptance.factory'", "nosuchmod:f", "cannot import"]),
    (lambda d: "oracle:os:sep", ["'acceptance.factory'", "os:sep", "not callable"]),
    (lambda d: "profile:", ["'acceptance'", "profile:", "after the colon"]),
    (lambda d: "heterogeneous:", ["'acceptance'", "after the colon"]),
    (lambda d: "profile", ["'acceptance.p'", "profile needs"]),
    (lambda d: "heterogeneous:0.4", ["'acceptance.p'", "at least two", "[0.4]"]),
])
def test_bad_acceptance_configuration_exits_2_naming_the_key_and_value(make, words, tmp_path):
    """Never a traceback: a missing or malformed accept file, an oracle factory that does
    not import or is not callable, and a probability model without its probabilities are
    refused before anything runs."""
    out = tmp_path / "t.jsonl"
    for mode in ("lengths", "tensor"):
        rc, _, err = run_cli("simulate", "--acceptance", make(tmp_path), "--mode", mode,
                             "--out", out)
        assert rc == 2 and TRACEBACK not in err
        assert err.startswith("raggedspec simulate: error: scenario key")
        for w in words:
            assert w in err, f"{w!r} not in {err!r}"
        assert not out.exists()


def test_a_broken_oracle_at_run_time_exits_2_in_both_modes(tmp_path):
    """An oracle that breaks the TokenOracle contract (a draft of the wrong length) is a
    configuration error naming the key, not the oracle raising."""
    for mode in ("lengths", "tensor"):
        rc, _, err = run_cli("simulate", "--acceptance",
                             "oracle:raggedspec.conformance.helpers:make_short_drafter",
                             "--batch", "2", "--steps", "6", "--mode", mode,
                             "--out", tmp_path / "t.jsonl")
        assert rc == 2 and TRACEBACK not in err
        assert "'acceptance.factory'" in err and "exactly 3 token(s) (got 2)" in err


# ------------------------------------------------------------------------------ run size


def test_a_run_over_the_size_limit_is_refused_with_its_estimate_unless_forced(
    tmp_path, monkeypatch
):
    import raggedspec.estimate

    out = tmp_path / "t.jsonl"
    monkeypatch.setattr(raggedspec.estimate, "LIMIT_BYTES", 10_000)
    rc, _, err = run_cli("simulate", *TINY, "--out", out)
    assert rc == 2 and not out.exists()
    line = one_error_line(err)
    assert "estimated" in line and "above the" in line and "--force" in line
    assert "row-steps" in line
    rc, _, err = run_cli("simulate", *TINY, "--out", out, "--force")
    assert rc == 0 and out.is_file() and "over the limit" in err


@pytest.mark.slow
def test_the_largest_allowed_batch_is_refused_before_any_work(tmp_path):
    out = write(tmp_path / "t.jsonl", "earlier trace\n")
    rc, _, err = run_cli("simulate", "--batch", 2**20, "--steps", "20", "--out", out, "-q")
    assert rc == 2 and "trace" in one_error_line(err) and "GB" in err
    assert out.read_text() == "earlier trace\n"


def test_a_huge_tensor_scenario_is_refused_for_its_memory(tmp_path):
    rc, _, err = run_cli("simulate", "--mode", "tensor", "--batch", "4096", "--set",
                         "prompt_len=2000", "--set", "max_new_tokens=2000",
                         "--out", tmp_path / "t.jsonl", "-q")
    assert rc == 2 and "memory" in one_error_line(err) and "tensor mode" in err


def test_the_estimate_is_above_what_a_small_run_writes(tmp_path):
    from raggedspec.estimate import estimate
    from raggedspec.reference.scenario import load_scenario

    out = tmp_path / "t.jsonl"
    assert run_cli("simulate", *TINY, "--out", out, "--csv")[0] == 0
    args = cli.build_parser("simulate").parse_args(["simulate", *TINY])
    est = estimate(load_scenario(None, cli.scenario_overrides(args)))
    assert est.jsonl_bytes >= out.stat().st_size
    assert est.csv_bytes >= out.with_suffix(".csv").stat().st_size
    assert est.jsonl_bytes < 4 * out.stat().st_size  # an estimate, not a blanket refusal


def test_simulate_interrupted_while_writing_the_csv_keeps_the_earlier_trace(
    tmp_path, monkeypatch
):
    from raggedspec.reference import trace as reference_trace

    out = write(tmp_path / "t.jsonl", "earlier trace\n")

    def interrupted(trace, path):
        Path(path).write_text("partial")
        raise KeyboardInterrupt

    monkeypatch.setattr(reference_trace, "write_csv", interrupted)
    rc, _, err = run_cli("simulate", *TINY, "--out", out, "--csv")
    assert rc == 130 and "interrupted" in err
    assert out.read_text() == "earlier trace\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.jsonl"]


# ------------------------------------------------------------------------------ progress


def test_a_simulation_on_a_tty_shows_the_bar_on_stderr(tmp_path, monkeypatch, capsys):
    tty = Tty()
    monkeypatch.setattr(sys, "stderr", tty)
    assert cli.main(["simulate", *SMALL, "--out", str(tmp_path / "t.jsonl")]) == 0
    assert re.search(r"\rsimulate \(lengths\).*\| ?\d+/30", tty.getvalue()), tty.getvalue()
    assert tty.getvalue().count("\n") >= 1


def test_the_progress_bar_finishes_when_the_run_ends_early(tmp_path, monkeypatch):
    tty = Tty()
    monkeypatch.setattr(sys, "stderr", tty)
    assert cli.main(["simulate", "--batch", "2", "--steps", "500", "--set", "max_new_tokens=10",
                     "--out", str(tmp_path / "t.jsonl")]) == 0
    end = r"simulate \(lengths\): ended at step \d+ of at most 500: no request left to run"
    assert any(re.fullmatch(end, ln) for ln in tty.getvalue().split("\n")), tty.getvalue()


# ------------------------------------------------------------------------- docs, oracle


def test_the_simulator_doc_lists_every_scenario_key_model_and_flag():
    from raggedspec.reference.scenario import ACCEPTANCE_MODELS, FIELDS, MODEL_KEYS

    text = (PACKAGE / "docs" / "simulator.md").read_text()
    for key in FIELDS:
        assert f"| `{key}` |" in text, f"scenario key {key} is not in the docs' key table"
    for key in MODEL_KEYS:
        assert f"`{key}`" in text, f"model key {key} is not documented"
    for model in ACCEPTANCE_MODELS:
        assert f"| {model} |" in text, f"acceptance model {model} is not documented"
    for flag, _key, _kw in cli.SCENARIO_FLAGS:
        assert f"`{flag}`" in text, f"flag {flag} is not documented"
    figure = PACKAGE / "docs" / "img" / "drift-spread.png"
    assert "(img/drift-spread.png)" in text
    assert figure.read_bytes()[:8] == PNG and figure.stat().st_size < 300_000


def docs_oracle_example() -> str:
    text = (PACKAGE / "docs" / "simulator.md").read_text()
    m = re.search(r"```python\n(# my_module\.py\n.*?)```", text, re.S)
    assert m, "docs/simulator.md has no my_module.py example"
    return m.group(1)


@pytest.mark.slow
def test_the_documented_oracle_example_runs_from_the_console_script(tmp_path):
    """docs/simulator.md's `oracle:my_module:make_oracle` with my_module.py in the current
    folder works from the console script (the folder is put on sys.path for the import), in
    both modes, and the oracle decides the accepts (the example gets every third position
    wrong, so no row accepts 3 of 3)."""
    work = tmp_path / "work"
    work.mkdir()
    (work / "my_module.py").write_text(docs_oracle_example())
    run = console_script(tmp_path)
    for mode in ("lengths", "tensor"):
        out = run("simulate", "--acceptance", "oracle:my_module:make_oracle", "--batch", "2",
                  "--steps", "12", "--mode", mode, "--out", f"t-{mode}.jsonl", cwd=work)
        assert out.returncode == 0, out.stderr
        assert out.stdout.startswith("MTP[agg] accept_rate=")
    lines = [(work / f"t-{m}.jsonl").read_text().splitlines() for m in ("lengths", "tensor")]
    assert lines[0][1:] == lines[1][1:]
    rows = [r for s in read_trace(work / "t-lengths.jsonl").steps() if s["phase"] == "decode"
            for r in s["rows"]]
    assert rows and all(r["drafted"] == 3 and r["accepted"] < 3 for r in rows)
    assert {r["accepted"] for r in rows} >= {0, 2} or {r["accepted"] for r in rows} >= {1, 2}
