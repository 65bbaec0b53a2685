"""The rules of `raggedspec check-trace` (raggedspec/trace_rules.py) on small hand-made
traces, each breaking one rule in one place: the rule named, the step and sequence reported,
the line printed (`step N seq S: id [spec]: expected ..., actual ... (note)`, docs/trace-check.md)
and the verdict; and the rows a rule must leave alone (its fields absent, a prompt or failed
step), where it checks nothing."""

from __future__ import annotations

import pytest

from raggedspec.check_trace import check, exit_code
from raggedspec.reference.scenario import load_scenario
from raggedspec.reference.trace import Trace
from raggedspec.trace_rules import check_rules

RULED = pytest.mark.rule("the spec's rules applied to a trace")


def step(t: int, rows: list[dict], phase: str = "decode", advance: str | None = "cohort",
         **fields) -> dict:
    return {"step": t, "phase": phase, "advance": advance, "rows": rows, **fields}


def lines(steps: list[dict], depth: int | None = None) -> list[str]:
    return [v.line() for v in check_rules(steps, depth).in_order()]


def checked(steps: list[dict], rule: str, depth: int | None = None) -> int:
    return check_rules(steps, depth).checked[rule]


def result(steps: list[dict]) -> dict:
    tr = Trace("unknown", None)
    for s in steps:
        tr.add_step({k: v for k, v in s.items() if k != "rows"}, s["rows"])
    return check(tr)


# ----------------------------------------------------------------------------- commit

@RULED
def test_a_short_commit_on_a_step_that_is_not_the_rows_last_says_why():
    steps = [step(0, [{"seq": 0, "own_len": 10, "accepted": 2, "committed": 1}]),
             step(1, [{"seq": 0, "own_len": 11}])]
    assert lines(steps) == [
        "step 0 seq 0: commit [accept and commit (C §11.2)]: expected committed 3 "
        "(accepted 2 + 1), actual committed 1 (the sequence runs again later, so it did not "
        "finish)"
    ]
    res = result(steps)
    assert exit_code(res) == 1
    assert res["violations"][0]["note"] == ("the sequence runs again later, so it did not "
                                            "finish")


@RULED
def test_a_short_commit_on_the_rows_last_step_holds_and_a_long_one_never_does():
    short = [step(0, [{"seq": 0, "own_len": 10, "accepted": 2, "committed": 1}])]
    assert lines(short) == [] and checked(short, "commit") == 1
    assert exit_code(result(short)) == 0
    long = [step(0, [{"seq": 0, "own_len": 10, "accepted": 2, "committed": 4}])]
    assert lines(long) == [
        "step 0 seq 0: commit [accept and commit (C §11.2)]: expected committed 3 "
        "(accepted 2 + 1), actual committed 4"
    ]
    res = result(long)
    assert exit_code(res) == 1 and res["violations"][0]["note"] == ""


# ------------------------------------------------------------------- cohort advance

@RULED
def test_a_row_that_advances_by_more_than_one_after_a_defer_step():
    """A defer step advances every row by 1, whatever the step's advance rule."""
    steps = [step(0, [{"seq": 0, "own_len": 10}, {"seq": 1, "own_len": 12}], phase="defer",
                  advance="per-sequence"),
             step(1, [{"seq": 0, "own_len": 11}, {"seq": 1, "own_len": 14}])]
    assert lines(steps) == [
        "step 1 seq 1: cohort-advance [plan_batch_step (C §12.1)]: expected own_len 13 "
        "(own_len 12 at step 0 + 1, defer: 1), actual own_len 14"
    ]
    res = result(steps)
    assert exit_code(res) == 1 and res["violations"][0]["origin"] == 0


@RULED
def test_a_cohort_row_that_advances_by_other_than_the_keep():
    rows0 = [{"seq": 0, "own_len": 10, "u": 1, "accepted": 2},
             {"seq": 1, "own_len": 10, "u": 1, "accepted": 1}]
    steps = [step(0, rows0), step(1, [{"seq": 0, "own_len": 13}, {"seq": 1, "own_len": 12}])]
    assert lines(steps) == [
        "step 1 seq 0: cohort-advance [plan_batch_step (C §12.1)]: expected own_len 12 "
        "(own_len 10 at step 0 + 2, keep = min(u + accepted)), actual own_len 13"
    ]
    assert checked(steps, "cohort-advance") == 2 and exit_code(result(steps)) == 1


@RULED
def test_without_u_and_accepted_the_first_row_seen_again_sets_the_advance():
    steps = [step(0, [{"seq": 0, "own_len": 10}, {"seq": 1, "own_len": 10},
                      {"seq": 2, "own_len": 10}]),
             step(1, [{"seq": 1, "own_len": 12}, {"seq": 0, "own_len": 11},
                      {"seq": 2, "own_len": 12}])]
    assert lines(steps) == [
        "step 1 seq 0: cohort-advance [plan_batch_step (C §12.1)]: expected advance 2 "
        "(as seq 1 after step 0), actual advance 1"
    ]


# ----------------------------------------------------------------- per-sequence advance

@RULED
def test_without_accepted_the_per_sequence_advance_reads_committed():
    steps = [step(0, [{"seq": 0, "own_len": 10, "u": 1, "committed": 3}],
                  advance="per-sequence"),
             step(1, [{"seq": 0, "own_len": 12}], advance="per-sequence")]
    assert lines(steps) == [
        "step 1 seq 0: per-sequence-advance [plan_per_sequence_step (C §12.2)]: expected "
        "own_len 13 (own_len 10 at step 0 + committed 3), actual own_len 12"
    ]


# ------------------------------------------------------------------------------- q0

@RULED
def test_q0_is_zero_on_a_prompt_step_and_the_own_length_on_a_defer_step():
    prompt = [step(0, [{"seq": 0, "own_len": 10, "width": 10, "lead": 0, "q0": 0}],
                   phase="prompt")]
    assert lines(prompt) == [] and checked(prompt, "q0") == 1
    prompt[0]["rows"][0]["q0"] = 10
    assert lines(prompt) == [
        "step 0 seq 0: q0 [ragged_row_q0 (M §12)]: expected q0 0 (prompt, cohort advance), "
        "actual q0 10"
    ]
    defer = [step(0, [{"seq": 0, "own_len": 10, "width": 12, "lead": 2, "q0": 10},
                      {"seq": 1, "own_len": 12, "width": 12, "lead": 0, "q0": 12}],
                  phase="defer")]
    assert lines(defer) == [] and checked(defer, "q0") == 2
    defer[0]["rows"][0]["q0"] = 12  # the batch width: a cohort decode step's position
    assert lines(defer) == [
        "step 0 seq 0: q0 [ragged_row_q0 (M §12)]: expected q0 10 (defer, cohort advance), "
        "actual q0 12"
    ]
    assert exit_code(result(defer)) == 1


# --------------------------------------------------------------------- group count

@RULED
def test_the_group_count_reads_the_steps_groups():
    steps = [step(0, [{"seq": 0, "own_len": 10}], advance="per-sequence", groups=4)]
    assert lines(steps, depth=2) == [
        "step 0: group-count [draft_groups (C §9.1)]: expected at most 3 groups "
        "(depth 2 + 1), actual 4 groups"
    ]
    steps[0]["groups"] = 3
    assert lines(steps, depth=2) == [] and checked(steps, "group-count", depth=2) == 1


# ------------------------------------------------------- the rows a rule leaves alone

@RULED
def test_chain_start_and_group_key_skip_prompt_and_failed_steps():
    wrong = {"own_len": 10, "width": 10, "lead": 0, "u": 1, "chain_start": 3, "group": [1, 3]}
    steps = [step(0, [dict(wrong, seq=0)], phase="prompt"),
             step(1, [dict(wrong, seq=0)], error="left-aligned guard")]
    assert lines(steps) == []
    assert checked(steps, "chain-start") == 0 and checked(steps, "group-key") == 0
    assert exit_code(result(steps)) == 0


@RULED
def test_each_row_rule_needs_both_of_its_fields():
    rows = [{"seq": 0, "own_len": 10, "width": 12},
            {"seq": 1, "own_len": 10, "lead": 2},
            {"seq": 2, "own_len": 10, "dead_cols": 5},
            {"seq": 3, "own_len": 10, "accepted_pos": [1, 0]}]
    steps = [step(0, rows, phase="prompt")]
    assert lines(steps) == []
    for rule in ("lead", "dead-cols", "accepted-prefix"):
        assert checked(steps, rule) == 0, rule


@RULED
def test_the_lines_of_dead_cols_accepted_le_drafted_and_accepted_prefix():
    rows = [{"seq": 0, "own_len": 10, "lead": 2, "dead_cols": 1},
            {"seq": 1, "own_len": 10, "drafted": 2, "accepted": 3},
            {"seq": 2, "own_len": 10, "accepted": 1, "accepted_pos": [0, 1, 0]}]
    assert lines([step(0, rows)]) == [
        "step 0 seq 0: dead-cols [ragged_union_mask (M §5)]: expected dead_cols 2 (the lead), "
        "actual dead_cols 1",
        "step 0 seq 1: accepted-le-drafted [verify_proposed (C §11.1)]: expected accepted <= "
        "drafted 2, actual accepted 3",
        "step 0 seq 2: accepted-prefix [verify_proposed (C §11.1)]: expected accepted_pos "
        "[1, 0, 0] (accepted 1), actual accepted_pos [0, 1, 0]",
    ]


# ------------------------------------------------------ the rule table: ran, or why not

def rule_entry(res: dict, rule: str) -> dict:
    return next(r for r in res["rules"] if r["id"] == rule)


@RULED
def test_the_group_count_says_it_needs_a_scenario_for_the_depth():
    steps = [step(0, [{"seq": 0, "own_len": 10}], advance="per-sequence", groups=2)]
    entry = rule_entry(result(steps), "group-count")
    assert (entry["ran"], entry["checked"]) == (False, 0)
    assert entry["not_run_because"] == "depth (a scenario: the header's or --scenario)"
    assert entry["invariant"] == "at most depth + 1 draft groups on a per-sequence step"
    tr = Trace("unknown", None)
    for s in steps:
        tr.add_step({k: v for k, v in s.items() if k != "rows"}, s["rows"])
    sc = load_scenario({"batch": 1, "depth": 2})
    entry = rule_entry(check(tr, sc), "group-count")
    assert (entry["ran"], entry["checked"], entry["not_run_because"]) == (True, 1, None)
    cohort = Trace("unknown", None)
    cohort.add_step({k: v for k, v in steps[0].items() if k != "rows"} | {"advance": "cohort"},
                    steps[0]["rows"])
    entry = rule_entry(check(cohort, sc), "group-count")
    assert (entry["ran"], entry["not_run_because"]) == (False, "no row or step it applies to")
