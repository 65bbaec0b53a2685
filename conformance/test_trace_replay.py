"""The replay of `raggedspec check-trace` (raggedspec/trace_replay.py): a reference run's
trace replays exactly, and a trace changed in one place is reported at that place, with the
field named and both sides given (docs/trace-check.md, "Replay")."""

from __future__ import annotations

import pytest

from raggedspec.check_trace import check, exit_code
from raggedspec.reference import lengths
from raggedspec.reference.scenario import load_scenario
from raggedspec.reference.trace import Trace
from raggedspec.trace_replay import Divergence, first_divergence

# Three requests of one prompt length, prefilled together at step 0 in index order (so
# string ids given in that order name the same requests); the run ends before `steps`.
LEVEL = dict(batch=3, prompt_len=[10, 10], max_new_tokens=[6, 8], depth=3, steps=30, seed=2,
             acceptance="heterogeneous:0.2,0.9", advance="per-sequence", world="WB",
             admission="grant", xs_per_seq=True)


def level_run():
    sc = load_scenario(LEVEL)
    return lengths.run(sc), sc


def edited(trace: Trace, edit) -> Trace:
    """A copy of `trace` whose step objects went through `edit(steps)` (a list to change)."""
    steps = [dict(s, rows=[dict(r) for r in s["rows"]]) for s in trace.steps()]
    edit(steps)
    out = Trace("unknown", trace.header["scenario"])
    for s in steps:
        out.add_step({k: v for k, v in s.items() if k not in ("type", "rows")}, s["rows"])
    return out


def decode_at(steps: list[dict]) -> int:
    """The index of the first decode step with more than one row."""
    return next(i for i, s in enumerate(steps) if s["phase"] == "decode" and len(s["rows"]) > 1)


@pytest.mark.rule("the spec's rules applied to a trace")
def test_the_reference_run_replays_on_every_step():
    tr, sc = level_run()
    assert first_divergence(tr, sc) == (None, len(tr), None)


@pytest.mark.rule("the spec's rules applied to a trace")
def test_ids_the_scenario_has_no_request_for_compare_no_step():
    tr, sc = level_run()
    small = load_scenario({**LEVEL, "batch": 2})
    div, compared, why = first_divergence(tr, small)
    assert (div, compared) == (None, 0)
    assert why == "seq 2 (first at step 0) has no request in the scenario (2 requests)"


@pytest.mark.rule("the spec's rules applied to a trace")
def test_a_step_after_the_replay_ended_is_reported_as_absent():
    tr, sc = level_run()
    n, last = len(tr), list(tr.steps())[-1]["step"]

    def extra(steps):
        steps.append({"step": last + 2, "phase": "idle", "rows": []})

    div, compared, why = first_divergence(edited(tr, extra), sc)
    assert div == Divergence(last + 2, None, "step", "present",
                             "absent (the replay ended earlier)")
    assert (compared, why) == (n, None)
    assert div.line() == (f"step {last + 2}: step: trace 'present', "
                          "replay 'absent (the replay ended earlier)'")


@pytest.mark.rule("the spec's rules applied to a trace")
def test_a_changed_phase_is_the_first_divergence():
    tr, sc = level_run()
    steps = list(tr.steps())
    t = decode_at(steps)

    def defer(s):
        s[t]["phase"] = "defer"

    div, compared, _ = first_divergence(edited(tr, defer), sc)
    assert div == Divergence(steps[t]["step"], None, "phase", "defer", "decode")
    assert compared == t
    assert div.line() == f"step {steps[t]['step']}: phase: trace 'defer', replay 'decode'"


@pytest.mark.rule("the spec's rules applied to a trace")
def test_a_step_without_a_phase_is_compared_on_its_other_fields():
    tr, sc = level_run()

    def drop(steps):
        del steps[0]["phase"]  # the prompt step

    assert first_divergence(edited(tr, drop), sc) == (None, len(tr), None)


@pytest.mark.rule("the spec's rules applied to a trace")
def test_a_missing_row_reports_both_sides_rows():
    tr, sc = level_run()
    steps = list(tr.steps())
    t = decode_at(steps)
    ran = [r["seq"] for r in steps[t]["rows"]]

    def drop_last_row(s):
        s[t]["rows"] = s[t]["rows"][:-1]

    div, compared, _ = first_divergence(edited(tr, drop_last_row), sc)
    assert div == Divergence(steps[t]["step"], None, "rows[].seq", ran[:-1], ran)
    assert compared == t


@pytest.mark.rule("the spec's rules applied to a trace")
def test_a_changed_step_field_is_reported_with_both_values():
    tr, sc = level_run()
    steps = list(tr.steps())
    t = decode_at(steps)
    width = steps[t]["width"]

    def wider(s):
        s[t]["width"] = width + 5

    div, compared, why = first_divergence(edited(tr, wider), sc)
    assert div == Divergence(steps[t]["step"], None, "width", width + 5, width)
    assert (compared, why) == (t, None)
    assert div.line() == f"step {steps[t]['step']}: width: trace {width + 5}, replay {width}"


@pytest.mark.rule("the spec's rules applied to a trace")
def test_string_ids_name_the_requests_in_order_of_first_appearance():
    tr, sc = level_run()
    name = {0: "req-a", 1: "req-b", 2: "req-c"}
    steps = list(tr.steps())
    assert [s for s in steps[0]["prefill"]] == [0, 1, 2]  # the scenario prefills in order

    def rename(s):
        for st in s:
            st["prefill"] = [name[q] for q in st.get("prefill") or []]
            for r in st["rows"]:
                r["seq"] = name[r["seq"]]

    named = edited(tr, rename)
    assert first_divergence(named, sc) == (None, len(tr), None)
    t = decode_at(steps)

    def drop_first_row(s):
        rename(s)
        s[t]["rows"] = s[t]["rows"][1:]

    div, _, _ = first_divergence(edited(tr, drop_first_row), sc)
    ran = [name[r["seq"]] for r in steps[t]["rows"]]
    assert div == Divergence(steps[t]["step"], None, "rows[].seq", ran[1:], ran)


@pytest.mark.rule("raggedspec check-trace")
def test_a_replay_divergence_alone_sets_the_verdict():
    tr, sc = level_run()
    steps = list(tr.steps())
    t = decode_at(steps)
    buckets = steps[t]["buckets"]

    def more_buckets(s):
        s[t]["buckets"] = buckets + 1

    result = check(edited(tr, more_buckets), sc)
    assert result["violations"] == [] and exit_code(result) == 1
    assert result["replay"]["steps_compared"] == t
    assert result["replay"]["divergence"]["line"] == (
        f"step {steps[t]['step']}: buckets: trace {buckets + 1}, replay {buckets}"
    )


@pytest.mark.rule("the spec's rules applied to a trace")
def test_a_request_the_trace_never_ran_shows_as_its_index():
    tr, sc = level_run()

    def forget_seq_2(steps):
        for s in steps:
            s["prefill"] = [q for q in s.get("prefill") or [] if q != 2]
            s["rows"] = [r for r in s["rows"] if r["seq"] != 2]

    div, compared, _ = first_divergence(edited(tr, forget_seq_2), sc)
    assert div == Divergence(0, None, "rows[].seq", [0, 1], [0, 1, 2])
    assert compared == 0
