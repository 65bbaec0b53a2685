"""The replay of `raggedspec check-trace` (raggedspec/trace_replay.py): a reference run's
trace replays exactly, and a trace changed in one place is reported at that place, with the
field named and both sides given (docs/trace-check.md, "Replay")."""

from __future__ import annotations

from dataclasses import replace

import pytest

from raggedspec.check_trace import check, exit_code
from raggedspec.reference import lengths
from raggedspec.reference.scenario import load_scenario
from raggedspec.reference.trace import Trace
from raggedspec.trace_replay import Divergence, first_divergence, replay_scenario

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
    res = check(tr, small)
    assert res["replay"] == {"ran": False, "reason": why} and exit_code(res) == 0


@pytest.mark.rule("raggedspec check-trace")
def test_an_empty_header_scenario_is_no_scenario():
    tr, _ = level_run()
    tr.header["scenario"] = {}
    assert check(tr)["replay"] == {
        "ran": False, "reason": "no scenario (none in the header; give --scenario)"}


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


def as_trace(steps: list[dict]) -> Trace:
    tr = Trace("unknown", None)
    for s in steps:
        tr.add_step({k: v for k, v in s.items() if k != "rows"}, s.get("rows", []))
    return tr


def arriving_at(sc, arrival: int):
    return replace(sc, requests=tuple(replace(r, arrival=arrival) for r in sc.requests))


# seq 1 is prefilled at step 0, seq 0 at step 2 after the completion forward (not in its
# rows), seq 2 first runs in the rows of step 4; step 3 failed, so its accepts are not the
# sequences' (their requests failed with it).
HAND = [
    {"step": 0, "phase": "prompt", "prefill": [1], "rows": [{"seq": 1, "own_len": 8}]},
    {"step": 2, "phase": "decode", "prefill": [0],
     "rows": [{"seq": 1, "own_len": 8, "drafted": 3, "accepted": 2}]},
    {"step": 3, "phase": "decode", "error": "left-aligned guard",
     "rows": [{"seq": 0, "own_len": 8, "drafted": 3, "accepted": 1},
              {"seq": 1, "own_len": 11, "drafted": 3, "accepted": 3}]},
    {"step": 4, "phase": "decode",
     "rows": [{"seq": 0, "own_len": 8, "drafted": 2, "accepted": 1},
              {"seq": 1, "own_len": 11, "drafted": 0, "accepted": 0},
              {"seq": 2, "own_len": 8}]},
    {"step": 9, "phase": "idle", "rows": []},
]


@pytest.mark.rule("the spec's rules applied to a trace")
def test_the_replayed_scenario_takes_the_traces_arrivals_accepts_and_length():
    sc = arriving_at(load_scenario({"batch": 4, "prompt_len": 8, "steps": 4}), 6)
    tr = as_trace(HAND)
    sc2, accepts = replay_scenario(tr, sc, {q: q for q in range(4)})
    assert [r.arrival for r in sc2.requests] == [2, 0, 4, 6]
    assert accepts == {1: [2], 0: [1]}
    assert sc2.steps == 10  # the trace's last step is 9
    assert load_scenario(sc2.to_dict()).requests == sc2.requests
    longer = replace(sc, steps=40)
    assert replay_scenario(tr, longer, {q: q for q in range(4)})[0].steps == 40


@pytest.mark.rule("the spec's rules applied to a trace")
def test_an_empty_trace_replays_the_scenarios_own_steps():
    sc = load_scenario({"batch": 2, "steps": 1})
    sc2, accepts = replay_scenario(as_trace([]), sc, {})
    assert (sc2.steps, accepts) == (1, {})


@pytest.mark.rule("the spec's rules applied to a trace")
def test_a_later_scenario_arrival_gives_way_to_the_traces_prefill():
    """W0, all at once: one request is prefilled on a decode step, after the completion
    forward, and is not in that step's rows. Its scenario arrival set later than that, the
    replay still matches (but for the bucket counts, which count it waiting): the arrival is
    the step the trace first shows it."""
    sc = load_scenario(dict(batch=3, prompt_len=[6, 12], max_new_tokens=[4, 8], depth=2,
                            steps=20, seed=0, world="W0", arrival="all-at-once"))
    tr = lengths.run(sc)
    steps = list(tr.steps())
    late = {q for s in steps if s["phase"] == "decode"
            for q in set(s.get("prefill") or []) - {r["seq"] for r in s["rows"]}}
    assert late  # the scenario shows the case
    later = replace(sc, requests=tuple(replace(r, arrival=5) if q in late else r
                                       for q, r in enumerate(sc.requests)))

    def no_buckets(steps):  # the buckets count requests waiting, which a trace does not show
        for s in steps:
            del s["buckets"]

    assert first_divergence(edited(tr, no_buckets), later) == (None, len(tr), None)


@pytest.mark.rule("the spec's rules applied to a trace")
def test_an_id_only_prefilled_or_equal_to_the_batch_has_no_request():
    sc = load_scenario({"batch": 3})
    only_prefilled = as_trace([{"step": 0, "phase": "prompt", "prefill": [3], "rows": []}])
    assert first_divergence(only_prefilled, sc) == (
        None, 0, "seq 3 (first at step 0) has no request in the scenario (3 requests)")
    after_a_repeat = as_trace([{"step": 1, "phase": "prompt", "prefill": [0],
                                "rows": [{"seq": 0, "own_len": 5}, {"seq": 3, "own_len": 5}]}])
    assert first_divergence(after_a_repeat, sc) == (
        None, 0, "seq 3 (first at step 1) has no request in the scenario (3 requests)")


@pytest.mark.rule("the spec's rules applied to a trace")
def test_draft_group_keys_given_as_tuples_compare_equal_to_lists():
    tr, sc = level_run()

    def tuples(steps):
        for s in steps:
            for r in s["rows"]:
                if r.get("group") is not None:
                    r["group"] = tuple(r["group"])

    assert first_divergence(edited(tr, tuples), sc) == (None, len(tr), None)


@pytest.mark.rule("the spec's rules applied to a trace")
def test_without_drafted_counts_the_replay_accepts_nothing():
    """A trace that does not say what a row drafted gives the replay no accept counts: every
    verify accepts 0, which is this run's own (its drafts are never accepted)."""
    sc = load_scenario({**LEVEL, "acceptance": "geometric:0.0"})
    tr = lengths.run(sc)
    assert all(r["accepted"] == 0 for s in tr.steps() for r in s["rows"])
    assert any(r["drafted"] for s in tr.steps() for r in s["rows"])

    def no_drafted(steps):
        for s in steps:
            for r in s["rows"]:
                del r["drafted"]

    assert first_divergence(edited(tr, no_drafted), sc) == (None, len(tr), None)


@pytest.mark.rule("the spec's rules applied to a trace")
def test_a_trace_without_phases_still_gives_the_replay_its_accepts():
    """docs/trace-check.md: the replay takes each sequence's drafted row-steps' accepts; a
    trace need not say each step's phase (only `step`, `rows[].seq`, `rows[].own_len` are
    required), and its drafted rows are still its verifies."""
    tr, sc = level_run()

    def drop(steps):
        for s in steps:
            del s["phase"]

    assert first_divergence(edited(tr, drop), sc) == (None, len(tr), None)
