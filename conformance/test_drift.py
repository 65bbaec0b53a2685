"""Length-drift diagnostics (raggedspec/drift/): the plot data are right, and any trace in
schema v1 can be plotted, including a hand-made one from "another engine".

`engine_trace` (conformance/drift_traces.py) is such an engine: a few lines that write a
schema-v1 trace of their own (it proves a user's engine trace plots, and it is the oracle's
input). Expected values come from the spec (§15, §17.3) or from brute-force recomputation
over the raw JSON here. The report, its figures and the scenario runs are tested in
test_drift_report.py.
"""

from __future__ import annotations

import json
import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from raggedspec import drift
from raggedspec.conformance.drift_traces import (
    engine_trace,
    section_17_3,
    steps_with_accepts,
    write_csv,
    write_jsonl,
)
from raggedspec.drift import MissingField, TraceData, TraceFormatError

# ------------------------------------------------------------------------------ spread


def brute_spread(steps):
    """Independent oracle: per decode step, sorted spreads -> (min, median, max)."""
    out = []
    for s in steps:
        if s.get("phase", "decode") != "decode" or not s["rows"]:
            continue
        lens = [r["own_len"] for r in s["rows"]]
        sp = sorted(n - min(lens) for n in lens)
        m = len(sp)
        med = sp[m // 2] if m % 2 else (sp[m // 2 - 1] + sp[m // 2]) / 2
        out.append((s["step"], sp[0], med, sp[-1]))
    return out


@pytest.mark.rule("raggedspec drift: plot data from a trace")
@given(
    st.lists(
        st.dictionaries(st.integers(0, 20), st.integers(0, 500), max_size=9),
        min_size=1,
        max_size=25,
    ),
    st.sets(st.integers(0, 24), max_size=5),
)
def test_spread_band_equals_a_brute_force_recomputation(lengths_by_step, prompt_steps):
    steps = engine_trace(lengths_by_step, phases={t: "prompt" for t in prompt_steps})
    band = drift.spread_band(steps)
    expected = brute_spread(steps)
    assert [int(x) for x in band.step] == [e[0] for e in expected]
    assert list(band.lo) == [e[1] for e in expected]
    assert list(band.mid) == [e[2] for e in expected]
    assert list(band.hi) == [e[3] for e in expected]
    assert band.max_spread == max((e[3] for e in expected), default=0)
    for seq, (xs, ys) in band.rows.items():
        for x, y in zip(xs, ys, strict=False):
            lens = lengths_by_step[x]
            assert y == lens[seq] - min(lens.values())


@pytest.mark.rule("raggedspec drift: plot data from a trace")
def test_a_uniform_batch_has_a_zero_width_band():
    steps = engine_trace([{0: 100 + t, 1: 100 + t, 2: 100 + t} for t in range(30)])
    band = drift.spread_band(steps)
    assert len(band.step) == 30
    assert set(band.lo) == set(band.mid) == set(band.hi) == {0}
    assert band.max_spread == 0


@pytest.mark.rule("raggedspec drift: plot data from a trace")
def test_a_constant_spread_gives_flat_lines_and_a_constant_band():
    steps = engine_trace([{0: 50 + 3 * t, 1: 52 + 3 * t, 2: 55 + 3 * t} for t in range(20)])
    band = drift.spread_band(steps)
    assert set(band.hi - band.lo) == {5}
    assert set(band.mid) == {2}
    assert {q: set(ys) for q, (_, ys) in band.rows.items()} == {0: {0}, 1: {2}, 2: {5}}


@pytest.mark.rule("§17.3 no-strip negative control")
def test_the_section_17_3_control_collapses_to_spread_2_and_the_stripped_run_keeps_drifting():
    stripped = drift.spread_band(engine_trace(section_17_3(12, strip=True)))
    control = drift.spread_band(engine_trace(section_17_3(12, strip=False)))
    # §17.3: stripped lengths 7+3k, 4+k, 6+2k -> spread (7+3k) - (4+k) = 3 + 2k; k=12 -> [43,16,30].
    assert list(stripped.hi) == [3 + 2 * k for k in range(13)]
    assert stripped.rows[0][1][12] == 43 - 16 and stripped.rows[2][1][12] == 30 - 16
    # Negative control: [7+3k, 5+3k, 6+3k] from step 1 on, a constant spread of 2.
    assert list(control.hi[1:]) == [2] * 12
    assert stripped.max_spread == 27 and control.max_spread == 3


@pytest.mark.rule("raggedspec drift: plot data from a trace")
def test_only_decode_steps_are_measured_when_the_trace_has_phases():
    steps = engine_trace(
        [{0: 5, 1: 90}, {0: 10, 1: 12}, {0: 20, 1: 20}], phases={0: "prompt", 2: "idle"}
    )
    band = drift.spread_band(steps)
    assert list(band.step) == [1] and band.max_spread == 2
    for s in steps:
        del s["phase"]
    assert list(drift.spread_band(steps).step) == [0, 1, 2]


@pytest.mark.rule("raggedspec drift: plot data from a trace")
def test_the_row_lines_start_with_the_row_that_drifts_furthest():
    steps = engine_trace(
        [{0: 10, 1: 10, 2: 10, 3: 10}, {0: 11, 1: 19, 2: 12, 3: 13}, {0: 12, 2: 14, 3: 15}]
    )
    band = drift.spread_band(steps)
    assert drift.pick_row_lines(band) == [1, 0, 2]


# ---------------------------------------------------------------- per-position acceptance


@pytest.mark.rule("per-position acceptance read back from a trace")
def test_per_position_acceptance_of_the_spec_marker_example():
    # cache-and-draft §17.2 per_position_acceptance_is_on_the_marker_and_the_report:
    # accepts 3,2,1,0 at depth 3 -> accepted_at [3,2,1], reached [4,3,2], p_pos .75,.6667,.5.
    pp = drift.per_position_acceptance(steps_with_accepts([(3, 3), (3, 2), (3, 1), (3, 0)]))
    assert pp.accepted_beyond == [3, 2, 1]
    assert pp.reached_at == [4, 3, 2]
    assert [round(x, 4) for x in pp.p_pos] == [0.75, 0.6667, 0.5]
    assert pp.drafted_beyond == [4, 4, 4]
    assert pp.p == [0.75, 0.5, 0.25]


@pytest.mark.rule("per-position acceptance read back from a trace")
def test_per_position_acceptance_separates_profiles_the_aggregate_cannot():
    # §17.2: 100 steps at depth 3; step_of(3,1) -> accepted_at [100,0,0], reached [100,100,0];
    # alternating 2/0 -> [50,50,0], [100,50,50], p_pos [0.5, 1, 0].
    one = drift.per_position_acceptance(steps_with_accepts([(3, 1)] * 100))
    assert one.accepted_beyond == [100, 0, 0] and one.reached_at == [100, 100, 0]
    assert one.p_pos == [1.0, 0.0, None]
    alt = drift.per_position_acceptance(steps_with_accepts([(3, 2), (3, 0)] * 50))
    assert alt.accepted_beyond == [50, 50, 0] and alt.reached_at == [100, 50, 50]
    assert alt.p_pos == [0.5, 1.0, 0.0]
    # The brief's p_j (accepted beyond j / drafted beyond j) does not separate them at j=0.
    assert one.p[0] == 1.0 and alt.p[0] == 0.5


@pytest.mark.rule("per-position acceptance read back from a trace")
@given(st.lists(st.integers(0, 8).flatmap(lambda d: st.tuples(st.just(d), st.integers(0, d))),
                min_size=1, max_size=40))
def test_per_position_counts_equal_a_brute_force_count(pairs):
    pp = drift.per_position_acceptance(steps_with_accepts(pairs))
    depth = max(d for d, _ in pairs)
    for j in range(depth):
        assert pp.drafted_beyond[j] == len([1 for d, _ in pairs if j < d])
        assert pp.accepted_beyond[j] == len([1 for _, a in pairs if j < a])
        # reached j: every earlier draft was accepted and position j was drafted.
        assert pp.reached_at[j] == len([1 for d, a in pairs if j < d and a >= j])
    assert sum(pp.accepted_beyond) == sum(a for _, a in pairs)


# ----------------------------------------------------------- tok_per_step and summaries


@pytest.mark.rule("raggedspec drift: plot data from a trace")
def test_tok_per_step_prefers_the_summary_then_the_steps_then_the_rows():
    steps = engine_trace(
        [{0: 10, 1: 10}, {0: 12, 1: 11}], accepts=[{0: (3, 3), 1: (3, 0)}, {0: (3, 1), 1: (3, 2)}]
    )
    # committed = a + 1: (4 + 1 + 2 + 3) / 4 row-steps = 2.5
    assert drift.tok_per_step(TraceData("t", steps)) == 2.5
    assert drift.tok_per_step(TraceData("t", steps, summary={"tok_per_step": 1.25})) == 1.25
    for s in steps:
        del s["tok_per_step"]
    assert drift.tok_per_step(TraceData("t", steps)) == 2.5
    for s in steps:
        for r in s["rows"]:
            del r["committed"]
    with pytest.raises(MissingField, match=r"rows\[\]\.committed"):
        drift.tok_per_step(TraceData("t", steps))


@pytest.mark.rule("raggedspec drift: plot data from a trace")
def test_the_summary_reports_the_plotted_values():
    rng = random.Random(3)
    lens = []
    cur = {q: 100 for q in range(6)}
    for _ in range(40):
        lens.append(dict(cur))
        cur = {q: n + rng.randint(1, 4) for q, n in cur.items()}
    steps = engine_trace(lens)
    s = drift.summarize(TraceData("run", steps))
    assert s["max_spread"] == max(e[3] for e in brute_spread(steps))
    assert s["mean_padding_fraction"] == pytest.approx(
        sum(sum(max(row.values()) - n for n in row.values()) / (6 * max(row.values()))
            for row in lens)
        / 40,
        abs=1e-6,
    )
    assert s["groups"] == {"min": 1, "mean": 1.0, "max": 1}
    assert s["missing"] == []
    assert s["measured_steps"] == 40 and s["rows_max"] == 6


# ------------------------------------------------------------ reading other engines' traces


@pytest.mark.rule("raggedspec drift: plot data from a trace")
def test_a_jsonl_and_a_csv_trace_read_back_to_the_same_data(tmp_path):
    accepts = [{0: (3, 2), 1: (3, 0), 2: (3, 1)}] * 7
    steps = engine_trace(section_17_3(6, strip=True), accepts=accepts)
    a = drift.read_trace_file(write_jsonl(steps, tmp_path / "t.jsonl", summary={"steps": 7}))
    b = drift.read_trace_file(write_csv(steps, tmp_path / "t.csv"))
    assert a.header["schema"] == "raggedspec-trace" and a.summary == {"type": "summary", "steps": 7}
    assert [s["rows"] for s in a.steps] == [s["rows"] for s in b.steps]
    assert drift.summarize(a) | {"source": "", "label": ""} == drift.summarize(b) | {
        "source": "",
        "label": "",
    }


def minimal_engine_lines(n_steps=10):
    """What a bare engine might log: only the required fields."""
    return [
        {"step": t, "rows": [{"seq": q, "own_len": 10 + t * (q + 1)} for q in range(3)]}
        for t in range(n_steps)
    ]


@pytest.mark.rule("raggedspec drift: plot data from a trace")
def test_a_minimal_engine_trace_is_summarized_and_every_missing_field_is_named(tmp_path):
    path = tmp_path / "engine.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in minimal_engine_lines()))
    s = drift.summarize(drift.read_trace_file(path))
    assert s["max_spread"] == 18 and s["label"] == "engine" and s["measured_steps"] == 10
    missing = " ".join(s["missing"])
    for field in ("padding_fraction", "groups", "buckets", "rows[].committed", "rows[].drafted"):
        assert f"`{field}`" in missing
    assert (
        s["mean_padding_fraction"] is None
        and s["tok_per_step"] is None
        and s["per_position"] is None
    )


@pytest.mark.rule("raggedspec drift: plot data from a trace")
@pytest.mark.parametrize("text, field", [
    ('{"step": 0, "rows": [{"seq": 1}]}', "rows[].own_len"),
    ('{"step": 0, "rows": [{"own_len": 4}]}', "rows[].seq"),
    ('{"rows": []}', "field 'step'"),
    ('{"step": 3}', "field 'rows'"),
    ('{"step": 0, "rows": []}', "`rows`"),
    ('not json', "not a JSON object"),
])
def test_a_trace_without_a_required_field_is_refused_by_name(tmp_path, text, field):
    path = tmp_path / "bad.jsonl"
    path.write_text(text + "\n")
    with pytest.raises(TraceFormatError) as err:
        drift.read_trace_file(path)
    assert field in str(err.value) and str(path) in str(err.value)


@pytest.mark.rule("raggedspec drift: plot data from a trace")
def test_a_csv_without_own_len_is_refused_by_name(tmp_path):
    path = tmp_path / "bad.csv"
    path.write_text("step,seq\n0,1\n")
    with pytest.raises(TraceFormatError, match="own_len"):
        drift.read_trace_file(path)


# ---------------------------------------------------------------------------- the report


@pytest.mark.rule("raggedspec drift: plot data from a trace")
def test_the_summaries_of_the_three_section_17_3_style_runs():
    runs = [TraceData("cohort", engine_trace([{0: 10 + t, 1: 10 + t} for t in range(9)])),
            TraceData("per-sequence, strip", engine_trace(section_17_3(8, strip=True))),
            TraceData("per-sequence, no strip", engine_trace(section_17_3(8, strip=False)))]
    runs[2].control = drift.no_strip_control(runs[1].steps)
    summaries = [drift.summarize(r) for r in runs]
    assert [s["max_spread"] for s in summaries] == [0, 3 + 2 * 8, 3]
    assert [s["final_max_spread"] for s in summaries] == [0, 3 + 2 * 8, 2]
    assert summaries[2]["no_strip_control_max_spread"] == 3
    assert "no_strip_control_max_spread" not in summaries[1]
    assert json.loads(json.dumps(summaries)) == summaries  # plain JSON data


@pytest.mark.rule("§17.3 no-strip negative control")
def test_the_no_strip_control_rebuilds_section_17_3_from_the_stripped_run():
    control = drift.no_strip_control(engine_trace(section_17_3(12, strip=True)))
    expected = section_17_3(12, strip=False)
    assert [{r["seq"]: r["own_len"] for r in s["rows"]} for s in control] == expected
    # A row that joins later enters at its own length and then moves with the widest row.
    lens = [{0: 10}, {0: 12, 1: 5}, {0: 13, 1: 9}, {0: 16, 1: 10}]
    got = [
        {r["seq"]: r["own_len"] for r in s["rows"]}
        for s in drift.no_strip_control(engine_trace(lens))
    ]
    assert got == [{0: 10}, {0: 12, 1: 5}, {0: 13, 1: 16}, {0: 19, 1: 17}]
