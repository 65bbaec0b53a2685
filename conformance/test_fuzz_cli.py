"""Fuzzing the command line in-process (`raggedspec.cli.main`): Hypothesis writes scenario
files (random bytes, TOML and JSON over the real scenario keys with values of every type),
trace files (random bytes, JSONL step objects with fields of wrong types) and argument
lists (flags and values, output paths that are a file's child, a folder, an existing file).

Every run must: exit 0, 1 or 2 (never 3, a bug; never anything else); print no traceback;
when it exits 2, change no file that existed before and create none; finish within
`LIMIT_S` seconds. Each run is bounded by its arguments (`--steps` given last wins), so the
fuzzer explores input handling, not long simulations.
"""

from __future__ import annotations

import pytest
import contextlib
import io
import json
import os
import tempfile
import time
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from raggedspec import cli
from raggedspec.reference.scenario import FIELDS

LIMIT_S = 60.0  # per run, on a shared 2-core machine; a bounded run takes well under a second
TRACEBACK = "Traceback (most recent call last)"


def fuzz(examples: int) -> settings:
    """The fuzz tests' settings: a fixed, small number of examples whatever the profile."""
    return settings(
        max_examples=examples,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )


values = st.one_of(
    st.integers(-3, 40),
    st.sampled_from([0, -1, 2**31, 10**12, 2**63]),
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
    st.dictionaries(st.sampled_from(["vocab", "hidden", "x"]), st.integers(-2, 64), max_size=2),
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
    return {
        str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()
    }


def run_in(tmp: Path, argv: list[str]) -> tuple[int, str, float]:
    """cli.main(argv) with the working directory in tmp; (exit code, stderr, seconds)."""
    err, out = io.StringIO(), io.StringIO()
    here = os.getcwd()
    os.chdir(tmp)
    t0 = time.monotonic()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
            rc = cli.main(argv)
    finally:
        os.chdir(here)
    return rc, err.getvalue(), time.monotonic() - t0


def check_run(argv_template: list[str], scenario: bytes = b"", trace: bytes = b"") -> None:
    with tempfile.TemporaryDirectory() as name:
        tmp = Path(name)
        keep = tmp / "keep"
        keep.mkdir()
        (keep / "existing.jsonl").write_text("an earlier trace\n")
        (keep / "afile").write_text("a plain file\n")
        (tmp / "s.toml").write_bytes(scenario)
        (tmp / "t.jsonl").write_bytes(trace)
        subs = {
            "{keep}": str(keep),
            "{missing}": str(tmp / "missing.toml"),
            "{scenario}": str(tmp / "s.toml"),
            "{trace}": str(tmp / "t.jsonl"),
        }
        argv = []
        for a in argv_template:
            for k, v in subs.items():
                a = a.replace(k, v)
            argv.append(a)
        before = _snapshot(tmp)
        rc, err, seconds = run_in(tmp, argv)
        assert rc in (0, 1, 2), (argv, rc, err[-2000:])
        assert TRACEBACK not in err, (argv, err[-2000:])
        assert seconds < LIMIT_S, (argv, seconds)
        if rc == 2:
            assert _snapshot(tmp) == before, (argv, err[-500:])
            assert err.strip(), argv  # an error says why


@pytest.mark.rule("raggedspec command line and raggedspec simulate")
@fuzz(40)
@given(scenario=scenario_bytes)
def test_fuzzed_scenario_files(scenario):
    check_run(
        [
            "simulate",
            "{scenario}",
            "--out",
            "{keep}/existing.jsonl",
            "--csv",
            "-q",
            "--steps",
            "12",
        ],
        scenario=scenario,
    )


@pytest.mark.rule("raggedspec command line and raggedspec simulate")
@fuzz(25)
@given(trace=trace_bytes)
def test_fuzzed_trace_files(trace):
    check_run(["drift", "--trace", "{trace}", "--out", "{keep}", "-q"], trace=trace)


@pytest.mark.rule("raggedspec command line and raggedspec simulate")
@fuzz(40)
@given(command=st.sampled_from(["simulate", "drift"]), middle=tokens, scenario=scenario_bytes)
def test_fuzzed_argument_lists(command, middle, scenario):
    bound = (
        []
        if "--trace" in middle
        else ["--steps", "12"] + (["--batches", "none"] if command == "drift" else [])
    )
    check_run(
        [command, *middle, *bound],
        scenario=scenario,
        trace=b'{"step": 1, "rows": [{"seq": 0, "own_len": 5}, {"seq": 1, "own_len": 7}]}\n',
    )
