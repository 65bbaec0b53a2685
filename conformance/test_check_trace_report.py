"""`raggedspec check-trace`'s report and command as its docs promise (docs/trace-check.md):
at most `--limit` violation lines then how many more, the verdict's counts, the first broken
rule with the later ones, each rule not run with the fields it lacks, every usage refusal
naming its file or flag, the JSON file's documented fields (and a write that fails after the
check), and the help the docs show. The rules themselves and the reader: test_check_trace.py."""

from __future__ import annotations

import errno
import json
from pathlib import Path

import pytest

from raggedspec.check_trace import check, render
from raggedspec.conformance.helpers import run_cli as cli
from raggedspec.conformance.test_check_trace import (
    GRANTED,
    UNIFORM_ADVANCE,
    _as_trace,
    decode_step,
    small_run,
    write_lines,
)
from raggedspec.reference.scenario import load_scenario
from raggedspec.reference.trace import write_jsonl
from raggedspec.reference.trace_reader import read_trace_strict
from raggedspec.trace_rules import RULES


# ------------------------------------------------------------------------ the report's shape

# One step of 130 rows, each with lead 1 where width 12 - own_len 10 = 2 is due: more
# violations than the default --limit prints.
MANY_LEADS = [decode_step(0, [{"seq": i, "own_len": 10, "width": 12, "lead": 1}
                              for i in range(130)], "cohort")]


def violation_lines(out: str) -> list[str]:
    return [ln for ln in out.splitlines() if ln.startswith("step ")]


@pytest.mark.rule("raggedspec check-trace")
@pytest.mark.parametrize("argv, shown", [(["--limit", "0"], None), (["--limit", "1"], 1),
                                         ([], 100)], ids=["0 all", "1", "default 100"])
def test_limit_prints_at_most_n_violation_lines_then_how_many_more(tmp_path, argv, shown):
    path = write_lines(tmp_path / "t.jsonl", [json.dumps(s) for s in MANY_LEADS])
    total = len(check(read_trace_strict(path))["violations"])
    shown = total if shown is None else shown
    assert total > 100
    code, out, _ = cli("check-trace", path, *argv)
    assert code == 1 and len(violation_lines(out)) == shown
    more = f"... and {total - shown} more violation(s) (--limit 0 shows all; --json has all)"
    assert (more in out) == (shown < total), out[-300:]


BROKEN_ONCE_EACH = [decode_step(0, [
    {"seq": 0, "own_len": 10, "width": 12, "lead": 1, "accepted": 0, "committed": 2},
    {"seq": 1, "own_len": 11, "width": 12, "lead": 1},
], advance="cohort")]  # lead, uniform-no-lead and commit, each broken once at step 0


@pytest.mark.rule("raggedspec check-trace")
def test_the_verdict_counts_violations_and_broken_rules_and_names_the_later_ones():
    result = check(_as_trace(BROKEN_ONCE_EACH))
    lines = render(result, "t.jsonl", 0).splitlines()
    broken = {v["rule"] for v in result["violations"]}
    assert len(broken) == 3 and len(result["violations"]) == 3
    assert lines[-1] == "violated: 3 violation(s) of 3 rule(s)"
    first = result["violations"][0]["rule"]
    later = ", ".join(sorted(broken - {first}))
    assert lines[1].startswith(f"first broken rule: {first} [")
    assert lines[1].endswith(f"; {later} broke later and may follow from it")


@pytest.mark.rule("raggedspec check-trace")
def test_a_clean_verdict_counts_the_rules_of_the_table_that_ran(tmp_path):
    path = tmp_path / "t.jsonl"
    write_jsonl(small_run(**GRANTED), path)
    code, out, _ = cli("check-trace", path)
    lines = out.splitlines()
    table = lines[lines.index(next(ln for ln in lines if ln.startswith("rule "))) + 1:-2]
    ran = [ln for ln in table if "not run" not in ln]
    assert code == 0 and len(table) == len(RULES) and 0 < len(ran) < len(RULES)
    assert lines[-1] == f"clean: {len(ran)} of {len(RULES)} rules ran, none violated"


@pytest.mark.rule("raggedspec check-trace")
def test_each_usage_refusal_names_the_flag_or_file(tmp_path):
    path = write_lines(tmp_path / "t.jsonl", [json.dumps(s) for s in UNIFORM_ADVANCE])
    for argv, words in [
        ([tmp_path / "nope.jsonl"], f"trace file {tmp_path / 'nope.jsonl'} does not exist"),
        ([path, "--scenario", tmp_path / "nope.toml"],
         f"scenario file {tmp_path / 'nope.toml'} does not exist"),
        ([path, "--limit", "-1"], "--limit -1: must be >= 0"),
    ]:
        code, out, err = cli("check-trace", *argv)
        assert code == 2 and out == "" and words in err, err


@pytest.mark.rule("raggedspec check-trace")
def test_the_json_has_the_documented_fields_and_is_announced_on_stderr(tmp_path):
    path = write_lines(tmp_path / "t.jsonl", [json.dumps(s) for s in UNIFORM_ADVANCE])
    target = tmp_path / "r.json"
    code, out, err = cli("check-trace", path, "--json", target)
    data = json.loads(target.read_text())
    assert set(data) == {"schema", "version", "trace", "exit", "steps", "row_steps", "rules",
                         "violations", "replay"}
    assert (data["schema"], data["version"], data["trace"], data["exit"]) == (
        "raggedspec-check-trace", 1, str(path), code)
    assert f"wrote {target}" in err and "wrote" not in out


@pytest.mark.rule("raggedspec check-trace")
def test_a_json_that_fails_to_write_after_the_check_is_bad_usage(tmp_path, monkeypatch):
    """The folder was writable when checked, before the work; the disk filled up since."""
    import raggedspec.outputs

    def disk_full(path, text):
        raise OSError(errno.ENOSPC, "No space left on device")

    path = write_lines(tmp_path / "t.jsonl", [json.dumps(s) for s in UNIFORM_ADVANCE])
    monkeypatch.setattr(raggedspec.outputs, "write_text_atomic", disk_full)
    code, _, err = cli("check-trace", path, "--json", tmp_path / "r.json")
    assert code == 2
    assert f"--json {tmp_path / 'r.json'}: cannot write it (No space left on device)" in err



def docs_needs() -> dict[str, list[str]]:
    """Each rule's `needs` column of the table in docs/trace-check.md."""
    doc = (Path(__file__).parent.parent / "docs" / "trace-check.md").read_text()
    rows = [ln.split(" | ") for ln in doc.splitlines() if ln.startswith("| `")]
    return {r[0].strip("|` "): [n.strip("` |") for n in r[3].split(", ")]
            for r in rows if len(r) == 4}


@pytest.mark.rule("raggedspec check-trace")
def test_a_rule_not_run_names_every_field_it_needs_that_the_trace_lacks(tmp_path):
    """A trace of sequence lengths only, with no scenario: no rule runs, and each says it
    lacks every field of its `needs` in the docs' table, depth as a scenario to give."""
    path = write_lines(tmp_path / "min.jsonl",
                       [json.dumps({"step": t, "rows": [{"seq": 0, "own_len": 8 + t}]})
                        for t in range(2)])
    needs = docs_needs()
    rules = check(read_trace_strict(path))["rules"]
    assert {r["id"] for r in rules} == set(needs) and not any(r["ran"] for r in rules)
    for r in rules:
        reasons = r["not_run_because"].split(", ")
        fields = [n for n in needs[r["id"]] if n != "depth"]
        assert reasons[: len(fields)] == [f"`{n}`" for n in fields], r
        if "depth" in needs[r["id"]]:
            assert reasons[-1].startswith("depth (") and reasons[-1].endswith(" or --scenario)")
    # given a scenario, the depth is known: only the fields are lacking
    with_depth = check(read_trace_strict(path), load_scenario({"batch": 1}))["rules"]
    for r in with_depth:
        fields = [f"`{n}`" for n in needs[r["id"]] if n != "depth"]
        assert r["not_run_because"] == ", ".join(fields), r


@pytest.mark.rule("raggedspec check-trace")
def test_fields_present_on_other_rows_or_steps_than_a_rule_needs_them_together():
    """`dead_cols` and `lead` each on one row, `phase` and `advance` on one step: present,
    but on no row or step together where their rule applies."""
    steps = [decode_step(0, [{"seq": 0, "own_len": 10, "dead_cols": 0},
                             {"seq": 1, "own_len": 10, "lead": 0}]),
             {"step": 1, "rows": [{"seq": 0, "own_len": 11}, {"seq": 1, "own_len": 11}]}]
    rules = {r["id"]: r for r in check(_as_trace(steps))["rules"]}
    for rule in ("dead-cols", "cohort-advance"):
        assert rules[rule]["not_run_because"] == "no row or step it applies to", rules[rule]
    assert rules["lead"]["not_run_because"] == "`rows[].width`"


@pytest.mark.rule("raggedspec check-trace")
def test_an_empty_header_scenario_is_no_scenario(tmp_path):
    head = {"type": "header", "schema": "raggedspec-trace", "version": 1, "scenario": {}}
    path = write_lines(tmp_path / "h.jsonl",
                       [json.dumps(head), *(json.dumps(s) for s in UNIFORM_ADVANCE)])
    code, out, _ = cli("check-trace", path)
    assert code == 1 and "replay: not run: no scenario" in out


@pytest.mark.rule("raggedspec check-trace")
def test_the_json_rules_violations_and_replay_have_the_documented_fields(tmp_path):
    """docs/trace-check.md's JSON: each rule with its id, spec rule and invariant as the table
    gives them; the divergence with the line printed for it."""
    tr = small_run(**GRANTED)
    path = tmp_path / "t.jsonl"
    write_jsonl(tr, path)
    lines = path.read_text().splitlines()
    header = json.loads(lines[0])
    header["scenario"]["prompt_len"] = [30, 40]  # the replay parts from the trace at once
    rows = json.loads(lines[1])
    rows["rows"][0]["lead"] += 1  # and one lead is off
    write_lines(path, [json.dumps(header), json.dumps(rows), *lines[2:]])
    code, out, _ = cli("check-trace", path, "--json", tmp_path / "r.json")
    data = json.loads((tmp_path / "r.json").read_text())
    doc = (Path(__file__).parent.parent / "docs" / "trace-check.md").read_text()
    assert code == 1 and [r["id"] for r in data["rules"]] == [r.id for r in RULES]
    for r in data["rules"]:
        assert set(r) == {"id", "rule", "invariant", "ran", "checked", "violated",
                          "not_run_because"}
        assert f"| `{r['id']}` | {r['rule']} | {r['invariant']} |" in doc
        assert (r["not_run_because"] is None) == r["ran"] == (r["checked"] > 0)
    assert all(set(v) == {"step", "seq", "rule", "expected", "actual", "note", "origin", "line"}
               for v in data["violations"]) and data["violations"]
    assert all(v["line"] in out.splitlines() for v in data["violations"])
    replay = data["replay"]
    assert set(replay) == {"ran", "steps_compared", "diverged", "divergence"}
    assert replay["ran"] is True and replay["diverged"] is True
    assert f"replay: diverged at {replay['divergence']['line']} " in out
    steps = list(tr.steps())
    assert (data["steps"], data["row_steps"]) == (len(steps), sum(len(s["rows"]) for s in steps))
