"""`raggedspec drift` from the command line: a hand-made engine trace and a bare one plot side
by side, a scenario gives the three runs and the sweep, the built-in scenario is used when
none is given, and bad input exits 2 saying why."""

from __future__ import annotations

import json

import pytest

from raggedspec import cli
from raggedspec.conformance.drift_traces import engine_trace, section_17_3, write_jsonl
from raggedspec.conformance.test_drift import brute_spread, minimal_engine_lines

PNG = b"\x89PNG\r\n\x1a\n"

# --------------------------------------------------------------------------------- drift


@pytest.mark.rule("raggedspec drift")
def test_drift_plots_a_hand_made_engine_trace_and_a_bare_one_side_by_side(tmp_path, capsys):
    steps = engine_trace(
        section_17_3(10, strip=True), accepts=[{0: (3, 2), 1: (3, 0), 2: (3, 1)}] * 11
    )
    full = write_jsonl(steps, tmp_path / "engine.jsonl")
    bare = tmp_path / "bare.jsonl"
    bare.write_text("".join(json.dumps(x) + "\n" for x in minimal_engine_lines()))
    out = tmp_path / "plots"
    assert cli.main(["drift", "--trace", str(full), "--trace", str(bare), "--label", "my engine",
                     "--label", "bare", "--out", str(out)]) == 0
    for name in ("spread", "padding", "groups_buckets", "per_position"):
        assert (out / f"{name}.png").read_bytes()[:8] == PNG
        assert b"<svg" in (out / f"{name}.svg").read_bytes()[:500]
    assert not (out / "tok_per_step_vs_batch.png").exists()  # a sweep needs a scenario
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["schema"], summary["version"]) == ("raggedspec-drift-summary", 1)  # not a trace
    mine, plain = summary["runs"]
    assert mine["label"] == "my engine" and plain["label"] == "bare"
    assert mine["max_spread"] == max(e[3] for e in brute_spread(steps)) == 3 + 2 * 10
    assert mine["per_position"]["accepted_beyond"] == [22, 11, 0] and mine["missing"] == []
    assert plain["max_spread"] == 18 and plain["per_position"] is None
    assert sorted(summary["files"]) == sorted(p.name for p in out.iterdir())  # relative to --out
    captured = capsys.readouterr()
    assert "my engine: max_spread=23" in captured.out
    assert "not plotted" in captured.err and "`padding_fraction`" in captured.err
    assert "`rows[].drafted`" in captured.err


@pytest.mark.rule("raggedspec drift")
def test_drift_from_a_scenario_writes_three_runs_and_the_sweep(tmp_path, capsys):
    sc = tmp_path / "s.toml"
    sc.write_text('batch = 6\nprompt_len = 24\nmax_new_tokens = 60\nsteps = 40\nworld = "WB"\n'
                  'acceptance = "geometric:0.7"\n')
    out = tmp_path / "d"
    assert cli.main(["drift", "--scenario", str(sc), "--batches", "1,4", "--out", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    cohort, strip, none = summary["runs"]
    assert cohort["max_spread"] == 0                       # every row holds the batched width
    assert strip["max_spread"] > none["no_strip_control_max_spread"]
    assert none["no_strip_control_max_spread"] <= 3        # §17.3: at most w - 1 = depth
    assert strip["max_spread"] > 3                         # the fixture does drift (non-degenerate)
    sweep = summary["sweep"]
    assert sweep["batch"] == [1, 4]
    cohort_tps, per_seq_tps = sweep["tok_per_step"].values()
    assert cohort_tps[0] == per_seq_tps[0]                 # the two rules agree at batch 1
    for name in drift_figures():
        assert (out / f"{name}.png").read_bytes()[:8] == PNG


def drift_figures():
    from raggedspec.drift import FIGURE_NAMES
    return FIGURE_NAMES


@pytest.mark.rule("raggedspec drift")
def test_drift_with_no_scenario_uses_the_built_in_one(tmp_path, capsys):
    out = tmp_path / "d"
    assert (
        cli.main(["drift", "--out", str(out), "--steps", "30", "--batches", "none", "--quiet"]) == 0
    )
    summary = json.loads((out / "summary.json").read_text())
    assert [r["label"] for r in summary["runs"]] == [
        "cohort advance",
        "per-sequence advance, dead prefix stripped",
        "per-sequence, no strip (negative control)",
    ]
    assert summary["sweep"] is None and summary["runs"][0]["rows_max"] == 32
    # the printout says which run a refusal ended, and over how few steps its values are
    lines = capsys.readouterr().out.splitlines()
    none = summary["runs"][2]
    assert none["ended_by_refusal"] and none["refused_at_step"] is not None
    assert lines[2].endswith(
        f"(refused at step {none['refused_at_step']}: over its {none['measured_steps']} "
        "measured steps only)"
    )
    assert "refused" not in lines[0] + lines[1]


@pytest.mark.rule("raggedspec drift")
@pytest.mark.parametrize("argv, words", [
    (["--trace", "missing.jsonl"], ["missing.jsonl", "does not exist"]),
    (["--batches", "0,2"], ["--batches", ">= 1"]),
    (["--trace", "{bad}", "--label", "a", "--label", "b"], ["--label given 2 times for 1 --trace"]),
    (["--trace", "{bad}", "--batch", "3"], ["--scenario runs"]),
    (["--trace", "{bad}"], ["rows[].own_len", "required"]),
])
def test_drift_bad_input_exits_2_and_says_why(argv, words, tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"step": 0, "rows": [{"seq": 1, "width": 4}]}\n')
    argv = [a.replace("{bad}", str(bad)) for a in argv]
    assert cli.main(["drift", *argv, "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    for w in words:
        assert w in err, f"{w!r} not in {err!r}"
