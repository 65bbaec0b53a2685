"""The `raggedspec` command line as a whole: help (every command, every flag, every exit
code, built lazily), exit codes (a refusal 1, bad input 2 in one line, a bug 3 with its
traceback saved), the user's faults blamed on the user (a plug-in that raises: exit 1 with
its traceback and "raised by your ..."; a missing optional package: exit 2 with its pip
line; plug-ins imported from the working folder), outputs (checked by a real write before
any work, staged and renamed, never clobbered), progress, the bad input of drift, bench and
mutation, and fuzzed scenario files, traces and argument lists. `raggedspec simulate`'s own
behaviour is test_simulate.py; check-kernel, check-trace and conformance have their files."""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from raggedspec import cli
from raggedspec.conformance.helpers import (
    CHECKOUT,
    ROOT,
    TRACEBACK,
    Tty,
    child_env,
    console_script,
    one_error_line,
    run_cli,
    run_module,
    write,
)
from raggedspec.outputs import OutputPathError, check_output_dir, check_output_file, staged
from raggedspec.reference.errors import StepRefusal
from raggedspec.reference.scenario import FIELDS

CLI_RULE = "raggedspec command line and raggedspec simulate"
pytestmark = pytest.mark.rule(CLI_RULE)
TINY = ["--batch", "2", "--steps", "5", "--set", "max_new_tokens=8", "-q"]


# ------------------------------------------------------------------------ help and usage


@pytest.mark.slow
def test_help_works_on_every_command():
    top = run_module("--help")
    assert top.returncode == 0 and "Exit codes" in top.stdout
    for command in cli.COMMANDS:
        assert command in top.stdout
    for command, flags in (
        ("simulate", ["--batch", "--depth", "--advance", "--world", "--admission", "--strip",
                      "--acceptance", "--seed", "--steps", "--mode", "--out", "--csv",
                      "--quiet", "--set"]),
        ("drift", ["--scenario", "--trace", "--out", "--batches", "--label", "--quiet"]),
    ):
        out = run_module(command, "--help")
        assert out.returncode == 0, out.stderr
        for flag in flags:
            assert flag in out.stdout, f"{command} --help does not mention {flag}"


@pytest.mark.parametrize(
    "argv", [[], ["frobnicate"], ["simulate", "--depth", "three"], ["drift", "--bogus"]]
)
def test_bad_usage_exits_2(argv):
    rc, _, err = run_cli(*argv)
    assert rc == 2 and "usage: raggedspec" in err


def test_every_help_and_the_readme_state_every_exit_code():
    for argv in (["--help"], *([c, "--help"] for c in cli.COMMANDS)):
        rc, out, _ = run_cli(*argv)
        text = " ".join(out.split())
        assert rc == 0 and "Exit codes" in text and "2 bad input" in text, argv
    top = " ".join(run_cli("--help")[1].split())
    for code in ("0 ok", "1 a rule", "3 internal error", "4 preflight only", "130 interrupted",
                 "your plug-in", "pip install"):
        assert code in top, code
    if CHECKOUT is None:
        return  # an installed package ships no README; the helps above were checked
    readme = (CHECKOUT / "README.md").read_text().split("## Exit codes")[1].split("\n## ")[0]
    for code in ("`0`", "`1`", "`2`", "`3`", "`4`", "`130`"):
        assert code in readme


def test_every_flag_of_every_command_has_help():
    """`raggedspec mutation --help` is the mutation runner's own parser."""
    for name in cli.COMMANDS:
        if name == "mutation":
            continue
        sub = next(a for a in cli.build_parser(name)._actions if a.dest == "command")
        for action in sub.choices[name]._actions:
            assert action.help, f"{name} {action.option_strings or action.dest} has no help"


@pytest.mark.slow
def test_help_imports_no_command_module():
    """`raggedspec --help` builds the list of commands only: no command's module, no numpy,
    torch, matplotlib or tqdm is imported (they load when a command runs)."""
    code = ("import sys, contextlib, io\nfrom raggedspec.cli import main\n"
            "with contextlib.redirect_stdout(io.StringIO()):\n    main(['--help'])\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in "
            "('numpy', 'torch', 'matplotlib', 'tqdm', 'pytest', 'hypothesis') or "
            "m.startswith(('raggedspec.drift', 'raggedspec.reference', 'raggedspec.bench', "
            "'raggedspec.vectors', 'raggedspec.check_', 'raggedspec.conformance', "
            "'raggedspec.preflight', 'raggedspec.mutation'))))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=child_env(), cwd=ROOT, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "[]", done.stdout + done.stderr


def test_a_refusal_raised_by_a_rule_exits_1(monkeypatch):
    def refuse(args):
        raise StepRefusal("MTP step refused by the follows guard: rows [3, 1]")

    cmd = cli.COMMANDS["simulate"]
    monkeypatch.setitem(cli.COMMANDS, "simulate", cli.Command(cmd.help, cmd.add, refuse))
    rc, _, err = run_cli("simulate")
    assert rc == 1 and "StepRefusal" in err and "follows guard" in err


def test_a_bug_exits_3_with_the_traceback_saved_to_the_printed_file(tmp_path, monkeypatch):
    import raggedspec.drift

    def broken(*args, **kwargs):
        raise ZeroDivisionError("a bug in the simulator")

    monkeypatch.setattr(raggedspec.drift, "simulate", broken)
    out = write(tmp_path / "t.jsonl", "earlier trace\n")
    rc, _, err = run_cli("simulate", *TINY, "--out", out)
    assert rc == 3 and "internal error" in err and "ZeroDivisionError" in err
    assert "raised by your" not in err
    saved = Path(err.split("saved to ")[1].split(";")[0])
    try:
        text = saved.read_text()
        assert TRACEBACK in text and "a bug in the simulator" in text and "broken" in text
    finally:
        saved.unlink()
    assert out.read_text() == "earlier trace\n"


# ---------------------------------------------------------------- plug-ins: the user's fault


def plugin(tmp_path: Path, name: str, text: str, monkeypatch) -> None:
    """A module `name` in tmp_path, the current folder (and nowhere on sys.path)."""
    write(tmp_path / f"{name}.py", text)
    monkeypatch.chdir(tmp_path)
    monkeypatch.delitem(sys.modules, name, raising=False)


ORACLE = """
class Oracle:
    def prompt(self, seq_id, length):
        return [1] * length
    def target(self, seq_id, context):
        {target}
    def draft(self, seq_id, context, n):
        return [1] * n
def make(scenario):
    {make}
"""


@pytest.mark.parametrize("what, module, words", [
    ("factory", ORACLE.format(target="return 1", make="raise RuntimeError('oracle is broken')"),
     ["raised by your oracle 'rs_oracle_a:make'", "oracle is broken", 'rs_oracle_a.py", line']),
    ("method", ORACLE.format(target="raise KeyError('no such context')", make="return Oracle()"),
     ["raised by your oracle 'rs_oracle_a:make'", "no such context", "in target"]),
    ("import", "raise RuntimeError('no weights here')\n",
     ["raised by your oracle 'rs_oracle_a:make'", "while importing", "no weights here"]),
])
def test_an_oracle_that_raises_is_the_runs_failure_with_its_traceback(
    what, module, words, tmp_path, monkeypatch
):
    plugin(tmp_path, "rs_oracle_a", module, monkeypatch)
    out = tmp_path / "t.jsonl"
    rc, _, err = run_cli("simulate", *TINY, "--acceptance", "oracle:rs_oracle_a:make",
                         "--out", out)
    assert rc == 1, err
    assert TRACEBACK in err and "internal error" not in err and "please report" not in err
    for w in words:
        assert w in err, (w, err)
    assert not out.exists()


def test_a_backend_factory_that_raises_is_the_runs_failure(tmp_path, monkeypatch):
    plugin(tmp_path, "rs_backend_a",
           "def make(**kw):\n    raise ValueError('this port needs a GPU')\n", monkeypatch)
    rc, _, err = run_cli("simulate", *TINY, "--mode", "tensor", "--backend", "rs_backend_a:make",
                         "--out", tmp_path / "t.jsonl")
    assert rc == 1 and TRACEBACK in err and "internal error" not in err
    assert "raised by your backend 'rs_backend_a:make'" in err and "needs a GPU" in err


@pytest.mark.slow
def test_plugins_import_from_the_working_folder_through_the_console_script(tmp_path):
    """The console script has its own folder first on sys.path, not the current one: an
    oracle and a backend factory beside the user are found all the same."""
    work = tmp_path / "work"
    work.mkdir()
    write(work / "rs_here_oracle.py", ORACLE.format(target="return 1", make="return Oracle()"))
    write(work / "rs_here_backend.py",
          "from raggedspec.reference.backend import NumpyBackend\n"
          "def make(**kw):\n    return NumpyBackend(**kw)\n")
    run = console_script(tmp_path)
    done = run("simulate", *TINY, "--acceptance", "oracle:rs_here_oracle:make",
               "--out", "a.jsonl", cwd=work)
    assert done.returncode == 0 and (work / "a.jsonl").is_file(), done.stderr
    done = run("simulate", *TINY, "--mode", "tensor", "--backend", "rs_here_backend:make",
               "--out", "b.jsonl", cwd=work)
    assert done.returncode == 0 and (work / "b.jsonl").is_file(), done.stderr


@pytest.mark.parametrize("command, hidden, extra", [
    (["conformance", "--backend", "numpy"], ("pytest",), "conformance"),
    (["check-kernel", "--layout", "varlen", "raggedspec.kernel_adapters:sdpa_varlen"],
     ("hypothesis",), "check-kernel"),
])
def test_a_missing_optional_package_exits_2_naming_the_pip_line(command, hidden, extra,
                                                                 monkeypatch):
    for name in hidden:
        monkeypatch.setitem(sys.modules, name, None)  # an import of it now fails
    monkeypatch.delitem(sys.modules, "raggedspec.kernel_cases", raising=False)
    rc, _, err = run_cli(*command)
    line = one_error_line(err)
    assert rc == 2 and f"pip install 'raggedspec[{extra}]'" in line and hidden[0] in line
    assert "internal error" not in err


@pytest.mark.skipif(CHECKOUT is None, reason="an installed package ships no pyproject.toml")
def test_the_extras_named_exist_in_pyproject():
    import tomllib

    extras = tomllib.loads((CHECKOUT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    from raggedspec.exits import EXTRA_MODULES

    assert set(EXTRA_MODULES) <= set(extras)
    assert {c.extra for c in cli.COMMANDS.values()} - {None} <= set(extras)
    assert not any("nvrtc" in d or "mutmut" in d for d in extras["test"])


# ---------------------------------------------------------------------------- outputs


@pytest.mark.parametrize("where", ["child of a file", "directory", "csv under a file"])
def test_bad_output_paths_exit_2_before_any_work_and_clobber_nothing(where, tmp_path):
    afile = write(tmp_path / "afile", "keep me\n")
    out = write(tmp_path / "t.jsonl", "earlier trace\n")
    argv = {"child of a file": ["--out", afile / "t.jsonl"], "directory": ["--out", tmp_path],
            "csv under a file": ["--out", out, "--csv", afile / "t.csv"]}[where]
    rc, _, err = run_cli("simulate", *TINY, *argv)
    line = one_error_line(err)
    assert rc == 2 and ("--csv" if where.startswith("csv") else "--out") in line
    assert "estimated trace" not in err  # refused before the estimate, the run, any write
    assert out.read_text() == "earlier trace\n" and afile.read_text() == "keep me\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile", "t.jsonl"]


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux's /proc")
@pytest.mark.parametrize("argv", [
    ["simulate", *TINY, "--out", "/proc/nope/run/t.jsonl"],
    ["drift", "--out", "/proc/nope/drift", "--steps", "5", "--batches", "none", "-q"],
])
def test_an_output_folder_that_cannot_be_created_is_found_before_any_work(argv):
    """Permissions pass (root writes anywhere, /proc is a folder) but nothing can be made
    there: the real write tried first refuses it at once, before the estimate or a run."""
    rc, out, err = run_cli(*argv)
    line = one_error_line(err)
    assert rc == 2 and "--out /proc/nope/" in line and "cannot write there" in line
    assert "estimated" not in err and out == "" and "internal error" not in err


def test_an_unwritable_output_folder_exits_2(tmp_path, monkeypatch):
    import raggedspec.outputs

    ro = tmp_path / "ro"
    ro.mkdir()
    real = os.access  # the machine may run as root, who writes anywhere: say it is read-only
    monkeypatch.setattr(raggedspec.outputs.os, "access",
                        lambda p, mode: Path(p) != ro and real(p, mode))
    rc, _, err = run_cli("simulate", *TINY, "--out", ro / "t.jsonl")
    assert rc == 2 and "not writable" in one_error_line(err) and str(ro) in err
    assert list(ro.iterdir()) == []


def test_output_path_checks_name_the_flag_and_refuse_each_case(tmp_path):
    f = write(tmp_path / "f", "x")
    for bad, check in ((f / "x.jsonl", check_output_file), (tmp_path, check_output_file),
                       (f, check_output_dir), (f / "sub", check_output_dir)):
        with pytest.raises(OutputPathError, match="--flag"):
            check(bad, "--flag")
    assert check_output_file(tmp_path / "new" / "t.jsonl", "--out") == tmp_path / "new" / "t.jsonl"
    assert not (tmp_path / "new").exists()  # a check creates nothing


def test_the_write_probe_leaves_nothing_behind(tmp_path):
    from raggedspec.output_paths import writable_dir, writable_file

    assert writable_file(tmp_path / "a" / "b" / "t.jsonl", "--out") == tmp_path / "a/b/t.jsonl"
    assert writable_dir(tmp_path / "c" / "d", "--out") == tmp_path / "c" / "d"
    assert list(tmp_path.iterdir()) == []


def test_a_failed_or_interrupted_write_leaves_every_existing_file_and_no_temporary(tmp_path):
    a, b = write(tmp_path / "a.txt", "old a"), write(tmp_path / "b.txt", "old b")
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


# ------------------------------------------------------------------------------ progress


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
    parse = cli.build_parser("drift").parse_args
    monkeypatch.setattr(sys, "stderr", Tty())
    assert cli.progress_factory(parse(["drift"]))("x").mode == "tty"
    assert cli.progress_factory(parse(["drift", "-q"]))("x").mode == "off"
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    assert cli.progress_factory(parse(["drift"]))("x").mode == "lines"


def test_progress_ends_with_a_note_when_short_and_counts_without_a_total():
    from raggedspec.progress import Progress

    bar = Progress("run", "lines", stream=io.StringIO(), interval=0)
    bar(3, 10)
    bar.close()
    assert bar.stream.getvalue().endswith("run: ended at step 3 of at most 10\n")
    count = Progress("shrinking", "lines", stream=io.StringIO(), interval=0, unit="case")
    for i in range(1, 6):
        count(i, None)
    count.close()
    last = count.stream.getvalue().splitlines()[-1]
    assert last.startswith("shrinking: 5") and "case" in last and "ended" not in last


# ------------------------------------------------------------- drift, bench, mutation input


@pytest.mark.rule("raggedspec drift")
def test_drift_label_without_a_trace_exits_2(tmp_path):
    rc, _, err = run_cli("drift", "--label", "mine", "--out", tmp_path / "o")
    assert rc == 2 and "--label" in one_error_line(err) and "--trace" in err
    assert not (tmp_path / "o").exists()


@pytest.mark.rule("raggedspec drift")
def test_drift_over_the_memory_limit_is_refused_before_any_run(tmp_path, monkeypatch):
    import raggedspec.estimate

    monkeypatch.setattr(raggedspec.estimate, "LIMIT_BYTES", 1000)
    rc, _, err = run_cli("drift", "--steps", "5", "--batch", "2", "--out", tmp_path / "o", "-q")
    assert rc == 2 and "memory" in one_error_line(err) and "--force" in err
    assert not (tmp_path / "o").exists()


@pytest.mark.rule("raggedspec drift: plot data from a trace")
@pytest.mark.parametrize("line, words", [
    ('{"step": "x", "rows": []}', ["t.jsonl:1:", "field 'step'", '"x"', "integer"]),
    ('{"step": 1, "rows": [{"seq": 1, "own_len": "a"}]}',
     ["t.jsonl:1:", "field 'rows[].own_len'", '"a"', "integer"]),
    ('{"step": 1, "rows": [{"seq": 1, "own_len": 3}], "buckets": "z"}',
     ["t.jsonl:1:", "field 'buckets'", '"z"']),
    ('{"step": 1, "rows": [{"seq": 1, "own_len": 3, "drafted": 1.5}]}',
     ["t.jsonl:1:", "field 'rows[].drafted'", "1.5"]),
    ("5", ["t.jsonl:1:", "not a JSON object"]),
    ('{"step": 1, "rows": [7]}', ["t.jsonl:1:", "field 'rows[0]'", "row object"]),
])
def test_trace_fields_of_the_wrong_type_exit_2_naming_file_field_and_value(line, words,
                                                                           tmp_path):
    trace = write(tmp_path / "t.jsonl", line + "\n")
    rc, _, err = run_cli("drift", "--trace", trace, "--out", tmp_path / "o")
    msg = one_error_line(err)
    assert rc == 2
    for w in [str(trace), *words]:
        assert w in msg, (w, msg)
    assert not (tmp_path / "o").exists()


@pytest.mark.rule("raggedspec drift: plot data from a trace")
def test_a_trace_that_is_not_utf8_exits_2(tmp_path):
    trace = tmp_path / "t.jsonl"
    trace.write_bytes(b"\xff\xfe\x00binary")
    rc, _, err = run_cli("drift", "--trace", trace, "--out", tmp_path / "o")
    assert rc == 2 and "UTF-8" in one_error_line(err)


@pytest.mark.rule("raggedspec bench")
@pytest.mark.parametrize("content, words", [
    (None, ["no such file"]),
    ("not json", ["not a JSON file"]),
    ('{"schema": "something else"}', ["`schema`"]),
    ('{"schema": "raggedspec-bench/1", "rows": 3}', ["`rows`", "list"]),
])
def test_bench_replot_on_a_missing_or_malformed_file_exits_2(content, words, tmp_path):
    path = tmp_path / "bench.json"
    if content is not None:
        path.write_text(content)
    rc, _, err = run_cli("bench", "--replot", path)
    line = one_error_line(err)
    assert rc == 2 and "--replot" in line and str(path) in line
    assert all(w in line for w in words)
    assert sorted(p.name for p in tmp_path.iterdir()) == ([] if content is None else ["bench.json"])


@pytest.mark.rule("raggedspec mutation: catalogue, runner and gate")
def test_mutation_only_matching_nothing_exits_2():
    rc, out, err = run_cli("mutation", "--catalogue-only", "--only", "no such entry zzz")
    assert rc == 2 and "--only 'no such entry zzz'" in err
    assert "matches no catalogue entry" in err
    assert "mutation gate: PASS" not in out and TRACEBACK not in err


@pytest.mark.rule("raggedspec mutation: catalogue, runner and gate")
def test_mutation_json_under_a_file_is_refused_before_the_run(tmp_path):
    afile = write(tmp_path / "afile", "keep me\n")
    rc, _, err = run_cli("mutation", "--catalogue-only", "--only", "x",
                         "--json", afile / "r.json")
    assert rc == 2 and "--json" in one_error_line(err) and afile.read_text() == "keep me\n"
    assert "is a file, not a folder" in err


# -------------------------------------------------------------------------------- fuzzing
# Hypothesis writes scenario files (random bytes, TOML and JSON over the real scenario keys
# with values of every type), trace files (random bytes, JSONL step objects with fields of
# wrong types) and argument lists (flags and values, output paths that are a file's child, a
# folder, an existing file). Every run must exit 0, 1 or 2 (never 3, a bug), print no
# traceback, say something (no silent exit 0), and when it exits 2 change no file that
# existed before and create none. Each run is bounded by its arguments (`--steps` given last
# wins), so the fuzzer explores input handling, not long simulations.


def fuzz(examples: int) -> settings:
    """The fuzz tests' settings: a fixed, small number of examples whatever the profile."""
    return settings(max_examples=examples, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


values = st.one_of(
    st.integers(-3, 40),
    st.sampled_from([0, -1, 2**31, 10**12, 2**63, 2**70]),
    st.booleans(),
    st.none(),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=10),
    st.sampled_from(
        [
            "cohort",
            "per-sequence",
            "W0",
            "WB",
            "grant",
            "eager",
            "none",
            "geometric:0.7",
            "profile:0.7,0.5",
            "file:/no/such",
            "oracle:os:getcwd",
            "oracle:nope:x",
        ]
    ),
    st.lists(st.integers(-2, 60), max_size=3),
    st.dictionaries(st.sampled_from(["vocab", "hidden", "seed", "mtp", "x"]),
                    st.one_of(st.integers(-2, 64), st.text(max_size=3)), max_size=2),
)
scenario_dicts = st.dictionaries(
    st.sampled_from(sorted(FIELDS) + ["bogus", "model"]), values, max_size=6
)


def _toml_value(v) -> str:
    if isinstance(v, dict):
        return (
            "{" + ", ".join(f"{k} = {_toml_value(x)}" for k, x in v.items() if x is not None) + "}"
        )
    if v is None:
        return '""'
    return json.dumps(v) if not isinstance(v, float) or v == v and abs(v) != float("inf") else "nan"


scenario_bytes = st.one_of(
    st.binary(max_size=120),
    scenario_dicts.map(lambda d: json.dumps(d).encode()),
    scenario_dicts.map(
        lambda d: "".join(f"{k} = {_toml_value(v)}\n" for k, v in d.items()).encode()
    ),
    st.text(max_size=80).map(lambda s: s.encode("utf-16")),
)

row_values = st.one_of(
    st.integers(-5, 60), st.text(max_size=3), st.none(), st.floats(), st.booleans()
)
rows = st.lists(
    st.fixed_dictionaries(
        {"seq": row_values, "own_len": row_values},
        optional={"drafted": row_values, "accepted": row_values, "committed": row_values},
    ),
    max_size=4,
)
step_objects = st.fixed_dictionaries(
    {"step": st.one_of(st.integers(0, 30), row_values)},
    optional={
        "rows": st.one_of(rows, row_values),
        "phase": st.one_of(st.sampled_from(["decode", "defer", "prompt"]), row_values),
        "buckets": row_values,
        "groups": row_values,
        "padding_fraction": row_values,
        "tok_per_step": row_values,
        "type": st.sampled_from(["step", "summary", "header", "odd"]),
    },
)
trace_bytes = st.one_of(
    st.binary(max_size=120),
    st.lists(st.one_of(step_objects, values), max_size=5).map(
        lambda objs: "".join(json.dumps(o) + "\n" for o in objs).encode()
    ),
    st.lists(st.lists(st.text(max_size=4), max_size=4), max_size=4).map(
        lambda recs: "\n".join(",".join(r) for r in [["step", "seq", "own_len"], *recs]).encode()
    ),
)

FLAGS = [
    "--batch",
    "--arrival",
    "--max-seq-len",
    "--depth",
    "--advance",
    "--world",
    "--admission",
    "--strip",
    "--xs-per-seq",
    "--no-xs-per-seq",
    "--acceptance",
    "--seed",
    "--set",
    "--mode",
    "--backend",
    "--device",
    "--dtype",
    "--out",
    "--csv",
    "--force",
    "-q",
    "--label",
    "--trace",
    "--scenario",
    "--batches",
    "--steps",
]
VALUES = [
    "0",
    "-1",
    "3",
    "2",
    "abc",
    "1e12",
    "1000000000000",
    "max_new_tokens=[1,5]",
    "model.vocab=1",
    'model.vocab="x"',
    str(2**70),
    "depth=99",
    "bogus=1",
    "=",
    "tensor",
    "lengths",
    "numpy",
    "nope.mod:f",
    "cuda",
    "float32",
    "none",
    "1,2",
    "0,2",
    "x",
    "{keep}/existing.jsonl",
    "{keep}/afile/t.jsonl",
    "{keep}",
    "{missing}",
    "{keep}/afile",
    "{scenario}",
    "{trace}",
    "new/out.jsonl",
    "new/csv.csv",
]
tokens = st.lists(st.sampled_from(FLAGS + VALUES), max_size=8)


def _snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file()}


def run_in(tmp: Path, argv: list[str]) -> tuple[int, str, str]:
    """cli.main(argv) with the working directory in tmp; (exit code, stdout, stderr)."""
    err, out = io.StringIO(), io.StringIO()
    here = os.getcwd()
    os.chdir(tmp)
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
            rc = cli.main(argv)
    finally:
        os.chdir(here)
    return rc, out.getvalue(), err.getvalue()


def check_run(argv_template: list[str], scenario: bytes = b"", trace: bytes = b"") -> None:
    with tempfile.TemporaryDirectory() as name:
        tmp = Path(name)
        keep = tmp / "keep"
        keep.mkdir()
        (keep / "existing.jsonl").write_text("an earlier trace\n")
        (keep / "afile").write_text("a plain file\n")
        (tmp / "s.toml").write_bytes(scenario)
        (tmp / "t.jsonl").write_bytes(trace)
        subs = {"{keep}": str(keep), "{missing}": str(tmp / "missing.toml"),
                "{scenario}": str(tmp / "s.toml"), "{trace}": str(tmp / "t.jsonl")}
        argv = []
        for a in argv_template:
            for k, v in subs.items():
                a = a.replace(k, v)
            argv.append(a)
        before = _snapshot(tmp)
        rc, out, err = run_in(tmp, argv)
        assert rc in (0, 1, 2), (argv, rc, err[-2000:])
        assert TRACEBACK not in err, (argv, err[-2000:])
        assert (out + err).strip(), (argv, rc)  # never a silent exit
        if rc == 2:
            assert _snapshot(tmp) == before, (argv, err[-500:])


@pytest.mark.slow
@fuzz(40)
@given(scenario=scenario_bytes)
def test_fuzzed_scenario_files(scenario):
    check_run(["simulate", "{scenario}", "--out", "{keep}/existing.jsonl", "--csv", "-q",
               "--steps", "12"], scenario=scenario)


@pytest.mark.slow
@fuzz(25)
@given(trace=trace_bytes)
def test_fuzzed_trace_files(trace):
    check_run(["drift", "--trace", "{trace}", "--out", "{keep}", "-q"], trace=trace)
    check_run(["check-trace", "{trace}", "--json", "{keep}/r.json"], trace=trace)


@pytest.mark.slow
@fuzz(40)
@given(command=st.sampled_from(["simulate", "drift"]), middle=tokens, scenario=scenario_bytes)
def test_fuzzed_argument_lists(command, middle, scenario):
    bound = ([] if "--trace" in middle
             else ["--steps", "12"] + (["--batches", "none"] if command == "drift" else []))
    check_run([command, *middle, *bound], scenario=scenario,
              trace=b'{"step": 1, "rows": [{"seq": 0, "own_len": 5}, {"seq": 1, "own_len": 7}]}\n')


@pytest.mark.rule("raggedspec command line and raggedspec simulate")
def test_naming_one_of_raggedspecs_own_classes_does_not_make_its_errors_the_users():
    """A plug-in spec may name raggedspec's own code (`...backend:NumpyBackend`); an exception
    raised later inside that code is still raggedspec's, not blamed on "your backend"."""
    from raggedspec.reference import plugins
    from raggedspec.reference.backend import load_backend

    plugins.load_object("raggedspec.reference.backend:NumpyBackend", "backend")
    with pytest.raises(ValueError) as err:
        load_backend("numpy", dtype="float32")  # refused inside reference/backend.py
    assert plugins.blame(err.value) is None
    example = "raggedspec.conformance.examples.buggy_backend:BuggyBackend"
    assert plugins.load_object(example, "backend") is not None  # an example port is a plug-in
