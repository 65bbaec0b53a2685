"""The strict trace reader (reference/trace_reader.py) and `raggedspec check-trace`
(raggedspec/check_trace.py, trace_rules.py, trace_replay.py).

Reader: every malformation named as FILE:LINE with the field, its value and the rule, all of
them up to the limit; simulator traces read back exactly. Checker: each bug-class fixture
(conformance/traces/, made by raggedspec/trace_bugs.py) is flagged by the rules it breaks and
by no other; every trace the simulator writes (generated scenarios, both modes, every world
and advance rule, eager and lazy strip) is clean and its replay matches.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest
from hypothesis import given, settings

from raggedspec import trace_bugs
from raggedspec.check_trace import check, exit_code, render
from raggedspec.conformance.helpers import run_cli as cli
from raggedspec.conformance.strategies import simulator_scenarios
from raggedspec.trace_rules import RULES
from raggedspec.reference import lengths, simulator
from raggedspec.reference.scenario import load_scenario
from raggedspec.reference.trace import write_csv, write_jsonl
from raggedspec.reference.trace_reader import read_trace_strict

TRACES = Path(__file__).parent / "traces"
GRANTED = {"advance": "per-sequence", "world": "WB", "admission": "grant", "xs_per_seq": True}


def violated(result: dict) -> dict[str, int]:
    return {r["id"]: r["violated"] for r in result["rules"] if r["violated"]}


SMALL = dict(batch=3, prompt_len=[6, 12], max_new_tokens=[10, 20], depth=3, steps=14, seed=2,
             acceptance="heterogeneous:0.2,0.9")


def small_run(**changes):
    return lengths.run(load_scenario({**SMALL, **changes}))


def lines_of(trace) -> list[str]:
    return list(trace.lines())


def write_lines(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(x + "\n" for x in lines))
    return path


# -------------------------------------------------------------------------- the gallery

FIXTURE_RULES = {
    "uniform-advance": {"per-sequence-advance"},
    "position-holes": {"q0"},
    "no-strip": {"per-sequence-advance"},
    "stuck-drafter": {"chain-start"},
    "scalar-group-keys": {"group-key", "group-count"},
    "uniform-ragged-path": {"uniform-no-lead"},
}


@pytest.mark.rule("raggedspec check-trace")
def test_every_bug_class_has_a_fixture():
    assert set(FIXTURE_RULES) == set(trace_bugs.BUGS)
    assert {p.stem for p in TRACES.glob("*.jsonl")} == set(FIXTURE_RULES)


@pytest.mark.rule("the spec's rules applied to a trace")
@pytest.mark.parametrize("name", sorted(FIXTURE_RULES))
def test_each_fixture_is_flagged_by_the_rule_it_breaks_and_by_no_other(name):
    path = TRACES / f"{name}.jsonl"
    result = check(read_trace_strict(path))
    assert set(violated(result)) == FIXTURE_RULES[name]
    # the replay does not see q0 (the simulator has no RoPE field), every other bug it does
    assert result["replay"]["ran"] and result["replay"]["diverged"] == (name != "position-holes")
    code, out, _ = cli("check-trace", str(path))
    assert code == 1 and all(f": {rule} [" in out for rule in FIXTURE_RULES[name])


@pytest.mark.rule("raggedspec check-trace")
@pytest.mark.parametrize("name", sorted(FIXTURE_RULES))
def test_the_fixtures_are_what_the_bugged_lengths_model_writes(name):
    assert (TRACES / f"{name}.jsonl").read_text().splitlines() == lines_of(
        trace_bugs.bugged_trace(name)
    )


@pytest.mark.rule("raggedspec check-trace")
def test_the_gallery_shows_the_checkers_current_output():
    doc = (Path(__file__).parent.parent / "docs" / "trace-check.md").read_text()
    for name in FIXTURE_RULES:
        path = TRACES / f"{name}.jsonl"
        code, out, _ = cli("check-trace", str(path), "--limit", "3")
        shown = out.replace(str(path), f"conformance/traces/{name}.jsonl").rstrip()
        assert code == 1 and shown in doc, name
    for rule in RULES:
        assert f"| `{rule.id}` | {rule.spec} | {rule.invariant} |" in doc


@pytest.mark.rule("the spec's rules applied to a trace")
def test_without_the_bug_the_fixture_scenarios_are_clean():
    """(The no-strip class's bug is its scenario's strip "none": without it, the claimed eager.)"""
    for name, (changes, _bug, claimed) in trace_bugs.BUGS.items():
        tr = lengths.run(load_scenario({**trace_bugs.BASE, **changes, **claimed}))
        result = check(tr)
        assert exit_code(result) == 0, (name, result["violations"][:2])


# ------------------------------------------------------------------ simulator traces pass

scenarios = simulator_scenarios(8, 24, ("eager", "lazy"))


def assert_clean(trace) -> None:
    result = check(trace)
    assert (
        result["violations"] == [] and result["replay"]["ran"] and not result["replay"]["diverged"]
    ), (result["violations"][:3], result["replay"])
    ran = {r["id"] for r in result["rules"] if r["ran"]}
    assert {"lead", "uniform-no-lead"} <= ran


@pytest.mark.rule("the spec's rules applied to a trace")
@given(data=scenarios)
def test_every_lengths_mode_trace_is_clean_and_replays_exactly(data):
    """Strip "none" is left out: it is the negative control, the no-strip fixture."""
    tr = lengths.run(load_scenario(data))
    assert_clean(tr)
    with tempfile.TemporaryDirectory() as d:
        write_jsonl(tr, Path(d) / "t.jsonl")
        write_csv(tr, Path(d) / "t.csv")
        assert_clean(read_trace_strict(Path(d) / "t.jsonl"))
        csv_result = check(read_trace_strict(Path(d) / "t.csv"), load_scenario(data))
        assert csv_result["violations"] == [] and not csv_result["replay"].get("diverged")


@pytest.mark.rule("the spec's rules applied to a trace")
@settings(max_examples=15)
@given(data=scenarios)
def test_every_tensor_mode_trace_is_clean_and_replays_exactly(data):
    assert_clean(simulator.run(load_scenario(data)))


@pytest.mark.rule("the spec's rules applied to a trace")
def test_the_property_reaches_both_advance_rules_every_world_and_failed_steps():
    """The generated runs exercise what the rules read: per-sequence and cohort steps, defer
    steps, failed steps, shattered W0 batches; each rule that the simulator's fields feed ran."""
    runs = [
        small_run(**GRANTED),
        small_run(world="W0"),
        small_run(world="WA", xs_per_seq=True),
        small_run(advance="per-sequence", world="WA", xs_per_seq=True, admission="grant"),
        small_run(advance="per-sequence", world="W0", xs_per_seq=True, admission="grant"),
    ]
    ran, phases, errors = set(), set(), set()
    for tr in runs:
        result = check(tr)
        assert exit_code(result) == 0, result["violations"][:2]
        ran |= {r["id"] for r in result["rules"] if r["ran"]}
        phases |= {s["phase"] for s in tr.steps()}
        errors |= {s["error"] for s in tr.steps() if s["error"]}
    assert ran == {
        "lead",
        "uniform-no-lead",
        "accepted-le-drafted",
        "commit",
        "chain-start",
        "group-key",
        "group-count",
        "per-sequence-advance",
        "cohort-advance",
    }
    assert {"decode", "prompt"} <= phases and "follows guard" in errors


# ---------------------------------------------------------------- rules on hand-made traces


def decode_step(t: int, rows: list[dict], advance: str = "per-sequence") -> dict:
    return {"type": "step", "step": t, "phase": "decode", "advance": advance, "rows": rows}


@pytest.mark.rule("the spec's rules applied to a trace")
def test_a_rule_runs_only_where_its_fields_are_present(tmp_path):
    path = write_lines(
        tmp_path / "min.jsonl",
        [json.dumps({"step": t, "rows": [{"seq": 3, "own_len": 8 + t}]}) for t in range(3)],
    )
    code, out, _ = cli("check-trace", str(path))
    result = check(read_trace_strict(path))
    assert code == 0 and not any(r["ran"] for r in result["rules"])
    assert "lead [front_align_batch (C §4.5)]" in out and "(`rows[].width`, `rows[].lead`)" in out
    assert "replay: not run: no scenario" in out


@pytest.mark.rule("the spec's rules applied to a trace")
def test_the_per_sequence_rule_falls_back_to_committed_without_u():
    tr = small_run(**GRANTED)
    steps = [
        dict(
            s, rows=[{k: v for k, v in r.items() if k not in ("u", "accepted")} for r in s["rows"]]
        )
        for s in tr.steps()
    ]
    result = check(_as_trace(steps))
    rules = {r["id"]: r for r in result["rules"]}
    assert (
        rules["per-sequence-advance"]["checked"] > 0
        and rules["per-sequence-advance"]["violated"] == 0
    )
    assert (
        not rules["chain-start"]["ran"] and "`rows[].u`" in rules["chain-start"]["not_run_because"]
    )


def _as_trace(steps: list[dict]):
    from raggedspec.reference.trace import Trace

    tr = Trace("unknown", {})
    tr.header["scenario"] = None
    for s in steps:
        tr.add_step({k: v for k, v in s.items() if k not in ("type", "rows")}, s["rows"])
    return tr


@pytest.mark.rule("the spec's rules applied to a trace")
def test_a_cohort_row_that_advances_on_its_own_is_flagged():
    tr = small_run(depth=0, world="W0")
    steps = [dict(s) for s in tr.steps()]
    t = next(i for i, s in enumerate(steps) if s["phase"] == "decode" and i > 6 and s["rows"])
    row = dict(steps[t]["rows"][0], own_len=steps[t]["rows"][0]["own_len"] + 1)
    row["width"] += 1
    steps[t] = dict(steps[t], rows=[row] + steps[t]["rows"][1:])
    result = check(_as_trace(steps), load_scenario(tr.header["scenario"]))
    assert set(violated(result)) == {"cohort-advance"}
    assert (
        result["violations"][0]["step"] == steps[t]["step"]
        and result["violations"][0]["seq"] == row["seq"]
    )


@pytest.mark.rule("the spec's rules applied to a trace")
def test_the_extension_rules_q0_dead_cols_and_accepted_pos():
    rows0 = [
        {
            "seq": 0,
            "own_len": 10,
            "width": 12,
            "lead": 2,
            "q0": 10,
            "dead_cols": 2,
            "drafted": 3,
            "accepted": 1,
            "accepted_pos": [1, 0, 0],
        },
        {
            "seq": 1,
            "own_len": 12,
            "width": 12,
            "lead": 0,
            "q0": 12,
            "dead_cols": 0,
            "drafted": 3,
            "accepted": 2,
            "accepted_pos": [1, 1, 0],
        },
    ]
    assert check(_as_trace([decode_step(0, rows0)]))["violations"] == []
    bad = [
        dict(rows0[0], q0=12, dead_cols=0, accepted_pos=[0, 1, 0]),
        dict(rows0[1], accepted_pos=[1, 1]),
    ]
    result = check(_as_trace([decode_step(0, bad)]))
    assert violated(result) == {"q0": 1, "dead-cols": 1, "accepted-prefix": 2}
    lines = " | ".join(v["line"] for v in result["violations"])
    assert "q0 [ragged_row_q0 (M §12)]: expected q0 10 (decode" in lines and "actual q0 12" in lines
    assert "expected 3 entries (drafted), actual 2 entries" in lines
    cohort = check(_as_trace([decode_step(0, rows0, advance="cohort")]))
    assert violated(cohort) == {"q0": 1}  # a cohort row's position is the batch width, 12


@pytest.mark.rule("the spec's rules applied to a trace")
def test_accepted_beyond_drafted_and_commit_are_flagged():
    rows = [
        {"seq": 0, "own_len": 10, "drafted": 2, "accepted": 3, "committed": 4},
        {"seq": 1, "own_len": 10, "drafted": 3, "accepted": 1, "committed": 1},
    ]
    steps = [decode_step(0, rows), decode_step(1, [{"seq": 1, "own_len": 11}])]
    result = check(_as_trace(steps))
    assert violated(result) == {"accepted-le-drafted": 1, "commit": 1}
    assert [v["seq"] for v in result["violations"]] == [
        0,
        1,
    ]  # seq 0 committed 4 = 3 + 1 on its last step


# ------------------------------------------------------------------------------ the CLI


@pytest.mark.rule("raggedspec check-trace")
def test_check_trace_exit_codes_json_and_no_clobbering(tmp_path):
    tr = small_run(**GRANTED)
    path = tmp_path / "t.jsonl"
    write_jsonl(tr, path)
    before = path.read_bytes()
    code, out, _ = cli("check-trace", str(path), "--json", str(tmp_path / "out" / "r.json"))
    data = json.loads((tmp_path / "out" / "r.json").read_text())
    assert code == 0 and data["exit"] == 0 and data["schema"] == "raggedspec-check-trace"
    assert "replay: matches the reference lengths simulator" in out and "clean:" in out
    assert not list((tmp_path / "out").glob(".*tmp"))
    code, _, err = cli("check-trace", str(path), "--json", str(path))
    assert code == 2 and "refusing to overwrite" in err and path.read_bytes() == before
    assert cli("check-trace", str(tmp_path / "nope.jsonl"))[0] == 2
    assert cli("check-trace", str(path), "--json", str(tmp_path))[0] == 2
    code, _, err = cli("check-trace", str(path), "--json", str(path / "r.json"))
    assert code == 2 and "is a file, not a folder" in err and path.read_bytes() == before
    assert cli("check-trace", str(path), "--scenario", str(tmp_path / "nope.toml"))[0] == 2
    bad = write_lines(
        tmp_path / "bad.jsonl", [json.dumps({"step": 0, "rows": [{"seq": 0, "own_len": -3}]})]
    )
    code, _, err = cli("check-trace", str(bad), "--json", str(tmp_path / "bad.json"))
    assert (
        code == 2
        and f"{bad}:1: field 'rows[].own_len' = -3" in err
        and not (tmp_path / "bad.json").exists()
    )


@pytest.mark.rule("raggedspec check-trace")
def test_check_trace_replays_a_headerless_csv_with_a_scenario_file(tmp_path):
    data = {
        "batch": 3,
        "prompt_len": 8,
        "max_new_tokens": 12,
        "steps": 12,
        "arrival": "staggered",
        **GRANTED,
    }
    (tmp_path / "s.json").write_text(json.dumps(data))
    tr = lengths.run(load_scenario(data))
    write_csv(tr, tmp_path / "t.csv")
    code, out, _ = cli("check-trace", str(tmp_path / "t.csv"))
    assert code == 0 and "replay: not run" in out
    code, out, _ = cli(
        "check-trace", str(tmp_path / "t.csv"), "--scenario", str(tmp_path / "s.json")
    )
    assert code == 0 and "replay: matches" in out
    # string ids, matched to the requests in order of first appearance (staggered: id order)
    lines = [
        json.dumps(
            s
            | {
                "rows": [dict(r, seq=f"req-{r['seq']}") for r in s["rows"]],
                "prefill": [f"req-{q}" for q in s["prefill"]],
            }
        )
        for s in tr.steps()
    ]
    path = write_lines(tmp_path / "ids.jsonl", lines)
    code, out, _ = cli("check-trace", str(path), "--scenario", str(tmp_path / "s.json"))
    assert code == 0 and "replay: matches" in out
    write_lines(path, [x.replace('"own_len": 9,', '"own_len": 10,', 1) for x in lines])
    code, out, _ = cli("check-trace", str(path), "--scenario", str(tmp_path / "s.json"))
    assert code == 1 and "replay: diverged at step" in out and "seq req-" in out


@pytest.mark.rule("raggedspec check-trace")
def test_a_header_scenario_that_does_not_load_is_bad_usage(tmp_path):
    head = {"type": "header", "schema": "raggedspec-trace", "version": 1, "scenario": {"batch": 0}}
    path = write_lines(
        tmp_path / "h.jsonl", [json.dumps(head), json.dumps({"step": 0, "rows": []})]
    )
    code, _, err = cli("check-trace", str(path))
    assert code == 2 and f"{path}:1: the header's `scenario` is not a valid scenario" in err
    assert "'batch'" in err


# --------------------------------------------------------------------- docs/findings.md


def findings_commands() -> list[tuple[list[str], list[str]]]:
    """(argv, shown output lines) of every `$ python -m raggedspec ...` in docs/findings.md."""
    text = (Path(__file__).parent.parent / "docs" / "findings.md").read_text()
    out, cur = [], None
    for block in text.split("```")[1::2]:
        for line in block.strip("\n").splitlines():
            if line.startswith("$ python -m raggedspec "):
                cur = (line.split()[4:], [])
                out.append(cur)
            elif cur is not None:
                cur[1].append(line)
    return out


@pytest.mark.rule("raggedspec check-trace")
@pytest.mark.parametrize("argv, shown", findings_commands(), ids=lambda x: " ".join(x)[:60])
def test_the_findings_show_what_their_commands_print(tmp_path, argv, shown):
    root = Path(__file__).parent.parent  # the docs' paths are the checkout's, whatever the cwd
    argv = [str(tmp_path / "t.jsonl") if a.startswith("out/")
            else str(root / a) if a.startswith("examples/") else a for a in argv]
    code, out, err = cli(*argv, "-q")
    printed = out + err
    for line in shown:
        for part in line.split(" ..."):
            assert part.strip() in printed, (part, printed[:300])
    assert code == (1 if "refused:" in " ".join(shown) else 0)


@pytest.mark.rule("the spec's rules applied to a trace")
def test_the_remaining_branches_of_the_rules_fail_when_broken():
    # lead identity; a ragged batch with no zero lead; committed above accepted + 1
    rows = [
        {"seq": 0, "own_len": 10, "width": 12, "lead": 1, "accepted": 0, "committed": 2},
        {"seq": 1, "own_len": 11, "width": 12, "lead": 1},
    ]
    result = check(_as_trace([decode_step(0, rows, advance="cohort")]))
    assert violated(result) == {"lead": 1, "uniform-no-lead": 1, "commit": 1}
    lines = " | ".join(v["line"] for v in result["violations"])
    assert "expected lead 2 (width 12 - own_len 10), actual lead 1" in lines
    assert "expected some lead 0 (the widest row), actual leads [1, 1]" in lines
    assert "expected committed 1 (accepted 0 + 1), actual committed 2" in lines
    # cohort without u / accepted: every row advances as the first one seen again does
    steps = [
        decode_step(0, [{"seq": 0, "own_len": 10}, {"seq": 1, "own_len": 10}], "cohort"),
        decode_step(1, [{"seq": 0, "own_len": 12}, {"seq": 1, "own_len": 13}], "cohort"),
    ]
    result = check(_as_trace(steps))
    assert violated(result) == {"cohort-advance": 1}
    assert result["violations"][0]["seq"] == 1
    assert (
        "expected advance 2 (as seq 0 after step 0), actual advance 3"
        in result["violations"][0]["line"]
    )


@pytest.mark.rule("the spec's rules applied to a trace")
def test_the_group_count_reads_the_row_keys_when_the_step_has_no_groups():
    rows = [{"seq": i, "own_len": 10 + i, "u": 1, "group": [1, i]} for i in range(4)]
    sc = load_scenario({"batch": 4, "depth": 2})
    result = check(_as_trace([decode_step(0, rows)]), sc)
    assert violated(result) == {"group-key": 3, "group-count": 1}
    assert "expected at most 3 groups (depth 2 + 1), actual 4 groups" in " ".join(
        v["line"] for v in result["violations"]
    )


@pytest.mark.rule("the spec's rules applied to a trace")
def test_the_replay_does_not_run_on_ids_it_cannot_match():
    sc = load_scenario({"batch": 2})
    mixed = [decode_step(0, [{"seq": 0, "own_len": 4}, {"seq": "b", "own_len": 4}])]
    assert "mixes integer and string" in check(_as_trace(mixed), sc)["replay"]["reason"]
    beyond = [decode_step(0, [{"seq": 5, "own_len": 4}])]
    result = check(_as_trace(beyond), sc)
    reason = result["replay"]["reason"]
    assert reason == "seq 5 (first at step 0) has no request in the scenario (2 requests)"
    assert result["replay"]["ran"] is False and exit_code(result) == 0
    assert f"replay: not run: {reason}" in render(result, "t.jsonl", 0).splitlines()


@pytest.mark.rule("the spec's rules applied to a trace")
def test_the_schema_extension_example_in_docs_trace_md_is_clean(tmp_path):
    doc = (Path(__file__).parent.parent / "docs" / "trace.md").read_text()
    block = doc.split("### Schema extensions")[1].split("```json\n")[1].split("\n```")[0]
    row = json.loads(block)
    widest = dict(row, seq="req-8", own_len=12, lead=0, chain_start=11, q0=12, dead_cols=0)
    step = {"step": 4, "phase": "decode", "advance": "per-sequence", "rows": [row, widest]}
    path = write_lines(tmp_path / "ext.jsonl", [json.dumps(step)])
    result = check(read_trace_strict(path))
    ran = {r["id"] for r in result["rules"] if r["ran"]}
    assert result["violations"] == [] and {"q0", "dead-cols", "accepted-prefix"} <= ran


# ------------------------------------------------------------- every finding sets the verdict


@pytest.mark.rule("raggedspec check-trace")
def test_a_replay_that_diverges_while_no_rule_fires_exits_1(tmp_path):
    """Each kind of finding sets the exit code on its own: here every rule holds (the trace
    is the reference's own), but the header's scenario has other prompt lengths, so the
    replay parts from the trace at its first step."""
    tr = small_run(**GRANTED)
    path = tmp_path / "t.jsonl"
    write_jsonl(tr, path)
    lines = path.read_text().splitlines()
    header = json.loads(lines[0])
    header["scenario"]["prompt_len"] = [30, 40]
    write_lines(path, [json.dumps(header), *lines[1:]])
    code, out, _ = cli("check-trace", path, "--json", tmp_path / "r.json")
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["violations"] == [] and data["replay"]["diverged"] is True
    assert code == 1 and data["exit"] == 1 and "replay: diverged at step" in out
    assert "first broken rule" not in out
    assert out.splitlines()[-1].endswith("none violated; the replay diverged")


@pytest.mark.rule("raggedspec check-trace")
def test_a_violated_rule_without_a_replay_exits_1(tmp_path):
    path = write_lines(tmp_path / "t.jsonl", [json.dumps(s) for s in UNIFORM_ADVANCE])
    code, out, _ = cli("check-trace", path, "--json", tmp_path / "r.json")
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["replay"]["ran"] is False and data["violations"]
    assert code == 1 and data["exit"] == 1 and "replay: not run" in out


# ---------------------------------------------------------------- the first broken rule first

# A per-sequence engine whose KV advance is uniform (every row by the batch's smallest commit,
# 1) while its scheduler tracks the true positions: at step 1 seq 0's own length is 11 where
# 10 + u 1 + accepted 3 = 14 was due, and its chain start is computed from 14. The broken rule
# is the advance (read from step 0); the chain start is what it causes.
UNIFORM_ADVANCE = [
    decode_step(0, [{"seq": 0, "own_len": 10, "u": 1, "accepted": 3, "committed": 4,
                     "chain_start": 9},
                    {"seq": 1, "own_len": 10, "u": 1, "accepted": 0, "committed": 1,
                     "chain_start": 9}]),
    decode_step(1, [{"seq": 0, "own_len": 11, "u": 1, "accepted": 0, "committed": 1,
                     "chain_start": 13},
                    {"seq": 1, "own_len": 11, "u": 1, "accepted": 0, "committed": 1,
                     "chain_start": 10}]),
]


@pytest.mark.rule("raggedspec check-trace")
def test_the_first_broken_rule_is_listed_before_what_it_causes(tmp_path):
    result = check(_as_trace(UNIFORM_ADVANCE))
    order = [(v["step"], v["rule"]) for v in result["violations"]]
    assert order == [(1, "per-sequence-advance"), (1, "chain-start")]
    assert result["violations"][0]["origin"] == 0
    path = write_lines(tmp_path / "t.jsonl", [json.dumps(s) for s in UNIFORM_ADVANCE])
    code, out, _ = cli("check-trace", path, "--limit", "1")
    lines = out.splitlines()
    assert code == 1
    assert lines[1].startswith("first broken rule: per-sequence-advance [plan_per_sequence_step")
    assert "at step 1 seq 0 (from step 0)" in lines[1] and "chain-start broke later" in lines[1]
    assert lines[2].startswith("step 1 seq 0: per-sequence-advance")


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux's /proc")
@pytest.mark.rule("raggedspec check-trace")
def test_a_json_path_that_cannot_be_written_is_refused_before_the_check(tmp_path):
    path = write_lines(tmp_path / "t.jsonl", [json.dumps(s) for s in UNIFORM_ADVANCE])
    code, out, err = cli("check-trace", path, "--json", "/proc/nope/r.json")
    assert code == 2 and out == "" and "--json /proc/nope/r.json" in err
    assert "cannot write there" in err

