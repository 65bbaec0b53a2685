"""The `raggedspec` command line: help, exit codes, simulate -> a readable trace, the progress
bar, the documented oracle example; `raggedspec drift` (figures and summary.json from a
hand-made trace and from a scenario) is tested in test_cli_drift.py."""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from raggedspec import cli
from raggedspec.reference.errors import StepRefusal
from raggedspec.reference.trace import read_trace

ROOT = Path(__file__).resolve().parents[1]
PNG = b"\x89PNG\r\n\x1a\n"


def run_module(*args, cwd=None):
    """`python -m raggedspec ARGS` in a subprocess (stderr is a pipe, not a TTY)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run(
        [sys.executable, "-m", "raggedspec", *args],
        capture_output=True,
        text=True,
        cwd=cwd or ROOT,
        env=env,
        timeout=120,
    )


SMALL = ["--batch", "4", "--steps", "30", "--set", "max_new_tokens=[20,40]"]


# ------------------------------------------------------------------------ help and usage


@pytest.mark.rule("raggedspec command line and raggedspec simulate")
def test_help_works_on_every_command():
    top = run_module("--help")
    assert top.returncode == 0
    assert "simulate" in top.stdout and "drift" in top.stdout and "Exit codes" in top.stdout
    for command, flags in (
        (
            "simulate",
            [
                "--batch",
                "--depth",
                "--advance",
                "--world",
                "--admission",
                "--strip",
                "--acceptance",
                "--seed",
                "--steps",
                "--mode",
                "--out",
                "--csv",
                "--quiet",
                "--set",
            ],
        ),
        ("drift", ["--scenario", "--trace", "--out", "--batches", "--label", "--quiet"]),
    ):
        out = run_module(command, "--help")
        assert out.returncode == 0, out.stderr
        for flag in flags:
            assert flag in out.stdout, f"{command} --help does not mention {flag}"


@pytest.mark.rule("raggedspec command line and raggedspec simulate")
@pytest.mark.parametrize(
    "argv", [[], ["frobnicate"], ["simulate", "--depth", "three"], ["drift", "--bogus"]]
)
def test_bad_usage_exits_2(argv, capsys):
    assert cli.main(argv) == 2
    assert "usage: raggedspec" in capsys.readouterr().err


@pytest.mark.rule("raggedspec command line and raggedspec simulate")
@pytest.mark.parametrize("argv, words", [
    (["--depth", "9"], ["'depth'", "0..=8", "9"]),
    (["--batch", "0"], ["'batch'", "1..=", "got 0"]),
    (["--advance", "sideways"], ["'advance'", "cohort", "per-sequence"]),
    (["--set", "bogus=3"], ["'bogus'", "unknown key"]),
    (["--set", "max_new_tokens=-4"], ["'max_new_tokens'", ">= 1"]),
])
def test_a_bad_scenario_value_exits_2_naming_the_key_and_range(argv, words, tmp_path, capsys):
    assert cli.main(["simulate", *argv, "--out", str(tmp_path / "t.jsonl")]) == 2
    err = capsys.readouterr().err
    for w in words:
        assert w in err, f"{w!r} not in {err!r}"
    assert not (tmp_path / "t.jsonl").exists()


@pytest.mark.rule("raggedspec command line and raggedspec simulate")
def test_a_bad_scenario_file_exits_2_from_the_console(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("batch = 4\ndepth = 12\n")
    out = run_module("simulate", str(bad), "--out", str(tmp_path / "t.jsonl"))
    assert out.returncode == 2
    assert "'depth'" in out.stderr and "0..=8" in out.stderr
    missing = run_module("simulate", str(tmp_path / "nope.toml"))
    assert missing.returncode == 2 and "nope.toml" in missing.stderr


@pytest.mark.rule("raggedspec command line and raggedspec simulate")
def test_a_refusal_raised_by_a_rule_exits_1(monkeypatch, capsys):
    def refuse(args):
        raise StepRefusal("MTP step refused by the follows guard: rows [3, 1]")

    monkeypatch.setitem(cli.COMMANDS, "simulate", (cli.add_simulate, refuse))
    assert cli.main(["simulate"]) == 1
    err = capsys.readouterr().err
    assert "StepRefusal" in err and "follows guard" in err


# ------------------------------------------------------------------------------ simulate


@pytest.mark.rule("raggedspec command line and raggedspec simulate")
def test_simulate_writes_a_trace_that_read_trace_reads_back(tmp_path, capsys):
    out = tmp_path / "run" / "t.jsonl"
    assert cli.main(["simulate", *SMALL, "--out", str(out), "--csv"]) == 0
    stdout = capsys.readouterr().out.splitlines()
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert (
        lines[0]["type"] == "header"
        and lines[0]["version"] == 1
        and lines[0]["scenario"]["batch"] == 4
    )
    assert lines[-1]["type"] == "summary"
    steps = [x for x in lines if x["type"] == "step"]
    assert 0 < len(steps) <= 30 and lines[-1]["steps"] == len(steps)
    back = read_trace(out)
    assert list(back.steps()) == steps
    from_csv = list(read_trace(out.with_suffix(".csv")).steps())
    assert [[(r["seq"], r["own_len"], r["accepted"]) for r in s["rows"]] for s in from_csv] == [
        [(r["seq"], r["own_len"], r["accepted"]) for r in s["rows"]] for s in steps if s["rows"]
    ]
    # The markers are printed exactly as the run records them, MTP first.
    assert stdout == back.markers()
    assert stdout[0].startswith("MTP[agg] accept_rate=") and stdout[1].startswith(
        "SCHED[agg] calls="
    )


@pytest.mark.rule("raggedspec command line and raggedspec simulate")
def test_simulate_flags_reach_the_scenario_and_override_the_file(tmp_path, capsys):
    sc = tmp_path / "s.json"
    sc.write_text(json.dumps({"batch": 3, "depth": 2, "steps": 12, "max_new_tokens": 30}))
    out = tmp_path / "t.jsonl"
    assert (
        cli.main(
            ["simulate", str(sc), "--depth", "5", "--acceptance", "all-accept", "--out", str(out)]
        )
        == 0
    )
    header = json.loads(out.read_text().splitlines()[0])["scenario"]
    assert (
        header["depth"] == 5
        and header["batch"] == 3
        and header["acceptance"]["model"] == "all-accept"
    )
    decode = [s for s in read_trace(out).steps() if s["phase"] == "decode"]
    # all-accept at depth 5 (w = 6): a u = 1 row drafts 5 and accepts all 5.
    assert decode and all(r["accepted"] == r["drafted"] for s in decode for r in s["rows"])
    assert max(r["drafted"] for s in decode for r in s["rows"]) == 5


@pytest.mark.rule("raggedspec command line and raggedspec simulate")
def test_simulate_exits_1_when_a_rule_refuses_a_step_and_still_writes_the_trace(tmp_path, capsys):
    # The no-strip negative control records padded lengths until the left-aligned guard refuses.
    out = tmp_path / "t.jsonl"
    code = cli.main(
        [
            "simulate",
            *SMALL,
            "--advance",
            "per-sequence",
            "--xs-per-seq",
            "--admission",
            "grant",
            "--world",
            "WB",
            "--strip",
            "none",
            "--out",
            str(out),
        ]
    )
    err = capsys.readouterr().err
    assert code == 1
    assert "refused" in err and "left-aligned guard" in err
    assert any(s.get("error") for s in read_trace(out).steps())


@pytest.mark.rule("raggedspec command line and raggedspec simulate")
def test_a_refused_per_sequence_request_is_a_warning_naming_the_check(tmp_path, capsys):
    code = cli.main(
        ["simulate", *SMALL, "--advance", "per-sequence", "--out", str(tmp_path / "t.jsonl")]
    )
    err = capsys.readouterr().err
    assert code == 0
    assert "warning" in err and "cannot honour it" in err and "ARC_V4_XS_PER_SEQ" in err


# ------------------------------------------------------------------------------ progress


class Tty(io.StringIO):
    def isatty(self):
        return True


@pytest.mark.rule("raggedspec command line and raggedspec simulate")
def test_progress_is_a_bar_on_a_tty_lines_otherwise_and_nothing_when_quiet(monkeypatch):
    from raggedspec.progress import Progress

    tty = Tty()
    bar = Progress("run", "tty", stream=tty)
    for i in range(1, 11):
        bar(i, 10)
    bar.close()
    assert "\r" in tty.getvalue() and "10/10" in tty.getvalue()
    log = io.StringIO()
    lines = Progress("run", "lines", stream=log, interval=0)
    for i in range(1, 11):
        lines(i, 10)
    lines.close()
    text = log.getvalue()
    assert "\r" not in text and text.count("\n") >= 2 and "10/10" in text.splitlines()[-1], text
    quiet = io.StringIO()
    off = Progress("run", "off", stream=quiet)
    off(10, 10)
    off.close()
    assert quiet.getvalue() == ""
    # The CLI: a bar on a TTY, lines when stderr is not one, nothing with --quiet.
    monkeypatch.setattr(sys, "stderr", Tty())
    assert cli.progress_factory(cli.build_parser().parse_args(["drift"]))("x").mode == "tty"
    assert cli.progress_factory(cli.build_parser().parse_args(["drift", "-q"]))("x").mode == "off"
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    assert cli.progress_factory(cli.build_parser().parse_args(["drift"]))("x").mode == "lines"


@pytest.mark.rule("raggedspec command line and raggedspec simulate")
def test_a_simulation_on_a_tty_shows_the_bar_on_stderr(tmp_path, monkeypatch, capsys):
    tty = Tty()
    monkeypatch.setattr(sys, "stderr", tty)
    assert cli.main(["simulate", *SMALL, "--out", str(tmp_path / "t.jsonl")]) == 0
    assert re.search(r"\rsimulate \(lengths\).*\| ?\d+/30", tty.getvalue()), tty.getvalue()
    assert tty.getvalue().count("\n") >= 1


# --------------------------------------------------------------------------------- docs


@pytest.mark.rule("raggedspec command line and raggedspec simulate")
def test_the_simulator_doc_lists_every_scenario_key_model_and_flag():
    from raggedspec.reference.scenario import ACCEPTANCE_MODELS, FIELDS, MODEL_KEYS

    text = (ROOT / "docs" / "simulator.md").read_text()
    for key in FIELDS:
        assert f"| `{key}` |" in text, f"scenario key {key} is not in the docs' key table"
    for key in MODEL_KEYS:
        assert f"`{key}`" in text, f"model key {key} is not documented"
    for model in ACCEPTANCE_MODELS:
        assert f"| {model} |" in text, f"acceptance model {model} is not documented"
    for flag, _key, _kw in cli.SCENARIO_FLAGS:
        assert f"`{flag}`" in text, f"flag {flag} is not documented"
    figure = ROOT / "docs" / "img" / "drift-spread.png"
    assert "(img/drift-spread.png)" in text
    assert figure.read_bytes()[:8] == PNG and figure.stat().st_size < 300_000


# ------------------------------------------------------------------------- review fixes


@pytest.mark.rule("raggedspec command line and raggedspec simulate")
@pytest.mark.parametrize(
    "make, words",
    [
        (lambda d: "file:/nonexistent", ["'acceptance.path'", "/nonexistent", "does not exist"]),
        (
            lambda d: "file:" + str(write(d / "neg.json", "[1,-2]")),
            ["'acceptance.path'", "neg.json", "[1, -2]"],
        ),
        (
            lambda d: "file:" + str(write(d / "bad.json", "not json")),
            ["'acceptance.path'", "bad.json", "not valid JSON"],
        ),
        (lambda d: "oracle:nosuchmod:f", ["'acceptance.factory'", "nosuchmod:f", "cannot import"]),
        (lambda d: "oracle:os:sep", ["'acceptance.factory'", "os:sep", "not callable"]),
        (lambda d: "profile:", ["'acceptance'", "profile:", "after the colon"]),
        (lambda d: "heterogeneous:", ["'acceptance'", "after the colon"]),
        (lambda d: "profile", ["'acceptance.p'", "profile needs"]),
        (lambda d: "heterogeneous:0.4", ["'acceptance.p'", "at least two", "[0.4]"]),
    ],
)
def test_bad_acceptance_configuration_exits_2_naming_the_key_and_value(
    make, words, tmp_path, capsys
):
    """Never a traceback: a missing or malformed accept file, an oracle factory that does
    not import or is not callable, and a probability model without its probabilities are
    refused before anything runs."""
    out = tmp_path / "t.jsonl"
    for mode in ("lengths", "tensor"):
        assert (
            cli.main(
                ["simulate", "--acceptance", make(tmp_path), "--mode", mode, "--out", str(out)]
            )
            == 2
        )
        err = capsys.readouterr().err
        assert "Traceback" not in err and err.startswith("raggedspec simulate: error: scenario key")
        for w in words:
            assert w in err, f"{w!r} not in {err!r}"
        assert not out.exists()


def write(path, text):
    path.write_text(text)
    return path


def console_script(tmp_path):
    """A launcher exactly like the one pip writes for the `raggedspec` console script: its
    own folder (not the current one) is first on sys.path."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    launcher = bin_dir / "raggedspec"
    launcher.write_text("import sys\nfrom raggedspec.cli import main\nsys.exit(main())\n")
    env = dict(os.environ, PYTHONPATH=str(ROOT))

    def run(*args, cwd):
        return subprocess.run(
            [sys.executable, str(launcher), *args],
            capture_output=True,
            text=True,
            cwd=cwd,
            env=env,
            timeout=120,
        )

    return run


def docs_oracle_example() -> str:
    text = (ROOT / "docs" / "simulator.md").read_text()
    m = re.search(r"```python\n(# my_module\.py\n.*?)```", text, re.S)
    assert m, "docs/simulator.md has no my_module.py example"
    return m.group(1)


@pytest.mark.rule("raggedspec command line and raggedspec simulate")
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
        out = run(
            "simulate",
            "--acceptance",
            "oracle:my_module:make_oracle",
            "--batch",
            "2",
            "--steps",
            "12",
            "--mode",
            mode,
            "--out",
            f"t-{mode}.jsonl",
            cwd=work,
        )
        assert out.returncode == 0, out.stderr
        assert out.stdout.startswith("MTP[agg] accept_rate=")
    lines = [(work / f"t-{m}.jsonl").read_text().splitlines() for m in ("lengths", "tensor")]
    assert lines[0][1:] == lines[1][1:]
    rows = [
        r
        for s in read_trace(work / "t-lengths.jsonl").steps()
        if s["phase"] == "decode"
        for r in s["rows"]
    ]
    assert rows and all(r["drafted"] == 3 and r["accepted"] < 3 for r in rows)
    assert {r["accepted"] for r in rows} >= {0, 2} or {r["accepted"] for r in rows} >= {1, 2}


@pytest.mark.rule("raggedspec command line and raggedspec simulate")
def test_a_broken_oracle_at_run_time_exits_2_in_both_modes(tmp_path, capsys):
    for mode in ("lengths", "tensor"):
        code = cli.main(
            [
                "simulate",
                "--acceptance",
                "oracle:raggedspec.conformance.test_scenario:make_short_drafter",
                "--batch",
                "2",
                "--steps",
                "6",
                "--mode",
                mode,
                "--out",
                str(tmp_path / "t.jsonl"),
            ]
        )
        err = capsys.readouterr().err
        assert code == 2 and "Traceback" not in err
        assert "'acceptance.factory'" in err and "exactly 3 token(s) (got 2)" in err


@pytest.mark.rule("raggedspec command line and raggedspec simulate")
def test_the_csv_carries_the_step_fields_with_their_types(tmp_path):
    """CSV: step-level width, committed, prefill and error are columns; read back, every
    step with rows equals the JSONL step (ints, floats, bucket booleans, lists, null)."""
    out = tmp_path / "t.jsonl"
    argv = [
        "simulate",
        "--batch",
        "5",
        "--steps",
        "16",
        "--set",
        "prompt_len=[3,9]",
        "--set",
        "max_new_tokens=25",
        "--advance",
        "per-sequence",
        "--xs-per-seq",
        "--admission",
        "grant",
        "--world",
        "WB",
        "--strip",
        "none",
        "--out",
        str(out),
        "--csv",
    ]
    assert (
        cli.main(argv) == 1
    )  # the no-strip control is refused by a rule (exit 1), the trace is written
    header = out.with_suffix(".csv").read_text().splitlines()[0].split(",")
    assert header[-4:] == ["step_width", "step_committed", "prefill", "error"]
    want = [s for s in read_trace(out).steps() if s["rows"]]
    got = list(read_trace(out.with_suffix(".csv")).steps())
    assert got == want
    assert any(s["error"] for s in got) and any(s["prefill"] for s in got)
    assert all(
        isinstance(s["rows"][0]["bucket"][3], bool) and isinstance(s["width"], int) for s in got
    )
    assert all(s["rows"][0]["bucket"][1] is False for s in got)


@pytest.mark.rule("raggedspec command line and raggedspec simulate")
def test_the_progress_bar_finishes_when_the_run_ends_early(tmp_path, monkeypatch):
    tty = Tty()
    monkeypatch.setattr(sys, "stderr", tty)
    assert cli.main(["simulate", "--batch", "2", "--steps", "500", "--set", "max_new_tokens=10",
                     "--out", str(tmp_path / "t.jsonl")]) == 0
    lines = tty.getvalue().split("\n")
    end = r"simulate \(lengths\): ended at step \d+ of at most 500: no request left to run"
    assert any(re.fullmatch(end, ln) for ln in lines), lines
    from raggedspec.progress import Progress
    bar = Progress("run", "lines", stream=io.StringIO(), interval=0)
    bar(3, 10)
    bar.close()
    assert bar.stream.getvalue().endswith("run: ended at step 3 of at most 10\n")


@pytest.mark.rule("raggedspec command line and raggedspec simulate")
def test_max_seq_len_arrival_and_no_xs_per_seq_flags(tmp_path, capsys):
    sc = write(tmp_path / "s.json", json.dumps({"batch": 3, "xs_per_seq": True, "steps": 4}))
    out = tmp_path / "t.jsonl"
    assert (
        cli.main(
            [
                "simulate",
                str(sc),
                "--max-seq-len",
                "1040",
                "--arrival",
                "staggered",
                "--no-xs-per-seq",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    scenario = json.loads(out.read_text().splitlines()[0])["scenario"]
    assert (scenario["max_seq_len"], scenario["arrival"], scenario["xs_per_seq"]) == (
        1040,
        "staggered",
        False,
    )
    assert cli.main(["simulate", str(sc), "--out", str(out)]) == 0
    assert (
        json.loads(out.read_text().splitlines()[0])["scenario"]["xs_per_seq"] is True
    )  # untouched without the flag
    assert cli.main(["simulate", "--max-seq-len", "1", "--out", str(out)]) == 2
    assert "'max_seq_len'" in capsys.readouterr().err
    assert cli.main(["simulate", "--arrival", "sometimes", "--out", str(out)]) == 2
    assert "all-at-once, staggered" in capsys.readouterr().err


@pytest.mark.rule("raggedspec command line and raggedspec simulate")
def test_simulate_runs_the_tensor_mode_on_the_torch_backend_with_the_same_trace(tmp_path, capsys):
    """`--backend torch` reaches the simulator: the integer trace equals the numpy backend's,
    and the backend flags are refused (exit 2, saying why) outside tensor mode or for an
    unknown backend."""
    common = ["simulate", "--batch", "3", "--depth", "2", "--steps", "12", "--mode", "tensor", "-q"]
    assert cli.main(common + ["--out", str(tmp_path / "n.jsonl")]) == 0
    assert cli.main(common + ["--backend", "torch", "--out", str(tmp_path / "t.jsonl")]) == 0
    numpy_lines = (tmp_path / "n.jsonl").read_text().splitlines()[1:]
    torch_lines = (tmp_path / "t.jsonl").read_text().splitlines()[1:]
    assert numpy_lines == torch_lines and len(numpy_lines) > 5
    capsys.readouterr()
    assert (
        cli.main(["simulate", "--backend", "torch", "--out", str(tmp_path / "x.jsonl"), "-q"]) == 2
    )
    assert "need --mode tensor" in capsys.readouterr().err
    assert cli.main(common + ["--backend", "nope", "--out", str(tmp_path / "x.jsonl")]) == 2
    assert "unknown backend 'nope'" in capsys.readouterr().err
