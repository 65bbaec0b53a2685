"""`raggedspec drift` (raggedspec/drift/): the plot data are right, any trace in schema v1
can be plotted (including a hand-made one from "another engine"), the scenario runs and the
sweep, the figures' words, legends and layout, the summary and output folder of a report, and
the command line.

`engine_trace` (conformance/drift_traces.py) is such an engine: a few lines that write a
schema-v1 trace of their own (it proves a user's engine trace plots, and it is the oracle's
input). Expected values come from the spec (§15, §17.3) or from brute-force recomputation
over the raw JSON here.
"""

from __future__ import annotations

import json
import os
import random

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from raggedspec import cli, drift
from raggedspec.conformance.drift_traces import (
    brute_spread,
    engine_trace,
    figure_text,
    minimal_engine_lines,
    outside_the_canvas,
    section_17_3,
    steps_with_accepts,
    write_csv,
    write_jsonl,
)
from raggedspec.drift import MissingField, TraceData, TraceFormatError

# ------------------------------------------------------------------------------ spread


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
    # The plain ratio p_j (accepted beyond j / drafted beyond j) does not separate them at j=0.
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


@pytest.mark.rule("raggedspec drift: plot data from a trace")
def test_a_minimal_engine_trace_is_summarized_and_every_missing_field_is_named(tmp_path):
    path = tmp_path / "engine.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in minimal_engine_lines()))
    s = drift.summarize(drift.read_trace_file(path))
    assert s["max_spread"] == 18 and s["label"] == "engine" and s["measured_steps"] == 10
    missing = " ".join(s["missing"])
    for field in ("padding_fraction", "groups", "buckets", "rows[].committed", "rows[].drafted"):
        assert f"`{field}`" in missing
    assert s["mean_padding_fraction"] is s["tok_per_step"] is s["per_position"] is None


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
    got = [{r["seq"]: r["own_len"] for r in s["rows"]}
           for s in drift.no_strip_control(engine_trace(lens))]
    assert got == [{0: 10}, {0: 12, 1: 5}, {0: 13, 1: 16}, {0: 19, 1: 17}]


# ------------------------------------------------------------------------- from a scenario

SMALL_W0 = {"batch": 4, "prompt_len": 16, "max_new_tokens": 24, "steps": 20, "world": "W0"}


@pytest.mark.rule("raggedspec drift")
def test_scenario_runs_grant_per_sequence_and_explain_a_world_that_splits_ragged_rows():
    runs = drift.scenario_runs(SMALL_W0)
    sc = [r.header["scenario"] for r in runs]
    assert [s["advance"] for s in sc] == ["cohort", "per-sequence", "per-sequence"]
    assert [s["strip"] for s in sc] == ["eager", "eager", "none"]
    assert all(s["admission"] == "grant" and s["xs_per_seq"] for s in sc)
    assert not any("world W0" in n for n in runs[0].notes)
    assert all(any("world W0" in n and "world WB" in n for n in r.notes) for r in runs[1:])
    assert runs[2].control is not None and runs[0].control is None


@pytest.mark.rule("raggedspec drift")
def test_the_sweep_reports_both_rules_per_batch_and_drives_the_progress_bar():
    calls = []

    class Bar:
        def __call__(self, done, total):
            calls.append((done, total))

        def close(self):
            calls.append("closed")

    sweep = drift.sweep_tok_per_step(
        SMALL_W0 | {"world": "WB"}, batches=[1, 3], progress=lambda label: Bar()
    )
    assert sweep["batch"] == [1, 3]
    cohort, per_seq = sweep["tok_per_step"].values()
    assert cohort[0] == per_seq[0]  # the two advance rules are identical at batch 1 (§17.2)
    assert len(cohort) == len(per_seq) == 2
    assert calls == [(1, 4), (2, 4), (3, 4), (4, 4), "closed"]


# ------------------------------------------------------------------------- review fixes


@pytest.mark.rule("raggedspec drift")
def test_deferred_steps_carry_leads_and_count_in_spread_and_padding_but_not_in_acceptance():
    """A `defer` step (the window deferral's plain decode) runs on the batched cache with
    its leads, so spread and padding count it; acceptance counts only `decode` steps."""
    steps = engine_trace(
        [{0: 10, 1: 10}, {0: 14, 1: 11}, {0: 17, 1: 12}],
        accepts=[{0: (3, 3), 1: (3, 0)}, {0: (0, 0), 1: (0, 0)}, {0: (3, 2), 1: (3, 1)}],
        phases={1: "defer"},
    )
    band = drift.spread_band(steps)
    assert list(band.step) == [0, 1, 2] and list(band.hi) == [0, 3, 5]
    s = drift.summarize(TraceData("t", steps))
    assert s["measured_steps"] == 3 and s["decode_steps"] == 2
    assert s["mean_padding_fraction"] == pytest.approx((0 + 3 / 28 + 5 / 34) / 3, abs=1e-6)
    pp = drift.per_position_acceptance(steps)
    assert pp.drafted_beyond == [4, 4, 4] and pp.accepted_beyond == [3, 2, 1]
    assert (
        s["drafting_fraction"] == 1.0
    )  # the deferred rows did not verify, so they are not counted
    # tok_per_step from rows: committed = a + 1 over the decode row-steps only
    for t in steps:
        del t["tok_per_step"]
    assert drift.tok_per_step(TraceData("t", steps)) == (4 + 1 + 3 + 2) / 4


@pytest.mark.rule("raggedspec drift")
def test_rows_cover_says_when_only_the_running_bucket_is_measured():
    one = engine_trace([{0: 10, 1: 10}, {0: 11, 1: 11}])
    assert drift.rows_cover(one) == "every running sequence"
    split = engine_trace([{0: 10}, {1: 12}, {0: 11}])
    split[1]["buckets"] = split[2]["buckets"] = 2
    assert drift.rows_cover(split).startswith("running bucket only: on 2 of 3 measured steps")
    bare = [{"step": 0, "rows": [{"seq": 0, "own_len": 3}]}]
    assert drift.rows_cover(bare).startswith("unknown")
    assert drift.summarize(TraceData("t", split))["rows_cover"] == drift.rows_cover(split)


@pytest.mark.rule("raggedspec drift")
def test_a_w0_run_that_shatters_does_not_claim_every_row_holds_the_same_length():
    """W0 puts each cache length in its own bucket, so a granted per-sequence run's steps
    hold one length each: spread 0 within the bucket that ran. The summary and the figure say
    so ("running bucket only") instead of "every row holds the same length"."""
    runs = drift.scenario_runs(SMALL_W0)
    per_seq = drift.summarize(runs[1])
    assert per_seq["max_spread"] == 0 and per_seq["rows_cover"].startswith("running bucket only")
    assert drift.summarize(runs[0])["rows_cover"] == "every running sequence"
    text = figure_text(drift.figure_spread(runs))
    assert "only within the bucket that ran" in text and "(running bucket only)" in text
    assert text.count("every running row holds the same length") == 1  # the cohort panel only


@pytest.mark.rule("raggedspec drift")
def test_a_run_a_refusal_ended_is_labelled_in_every_figure_and_the_summary():
    """The no-strip control is refused after a few steps; its panel title says so, the
    dotted line says it is computed (not simulated), and its averages are labelled."""
    runs = drift.scenario_runs(
        {"batch": 6, "prompt_len": 24, "max_new_tokens": 60, "steps": 40, "world": "WB"}
    )
    none = drift.summarize(runs[2])
    n, step = none["measured_steps"], none["refused_at_step"]
    assert none["ended_by_refusal"] and step is not None and n < 10
    assert (
        drift.summarize(runs[1])["refused_at_step"] is None
        and not drift.summarize(runs[1])["ended_by_refusal"]
    )
    spread = figure_text(drift.figure_spread(runs))
    assert f"simulated run refused at step {step} (left-aligned guard)" in spread
    assert f"over its {n} steps" in spread
    assert "computed, not simulated" in spread and "refused at step" in spread
    tag = f"refused at step {step}: over its {n} steps only"
    for fig in (drift.figure_padding(runs), drift.figure_groups_buckets(runs)):
        # a run of a few steps is named in a note, not drawn as a stub on the step axis
        assert f"Not drawn: {runs[2].label} ({tag})" in figure_text(fig)
        assert not any(runs[2].label in (ln.get_label() or "") for ax in fig.axes
                       for ln in ax.lines)
    assert f"refused at step {step}: only" in figure_text(drift.figure_per_position(runs))
    assert tag not in figure_text(drift.figure_padding(runs[:2]))
    assert any(f"averages cover only its {n} measured steps" in x for x in none["notes"])


@pytest.mark.rule("raggedspec drift")
def test_the_spread_legend_matches_the_panels_and_rows_do_not_overdraw_the_max_line():
    runs = drift.scenario_runs(SMALL_W0 | {"world": "WB", "steps": 40, "max_new_tokens": 60})
    fig = drift.figure_spread(runs)
    import matplotlib.colors as mcolors

    handles, _ = drift.spread_legend(3)
    panel = [mcolors.to_hex(f"C{i}") for i in range(3)]
    assert [mcolors.to_hex(h.get_facecolor()) for h in handles[0]] == panel  # band swatches
    assert [mcolors.to_hex(h.get_color()) for h in handles[1]] == panel      # max lines
    assert [mcolors.to_hex(h.get_color()) for h in handles[2]] == panel      # median lines
    for i, ax in enumerate(fig.axes[:3]):
        lines = [ln for ln in ax.lines if ln.get_color() != "k"]
        mx = [ln for ln in lines if ln.get_linestyle() == "-"]
        rows = [ln for ln in lines if ln.get_color() == drift.ROW_LINE["color"]]
        assert len(mx) == 1 and mcolors.to_hex(mx[0].get_color()) == mcolors.to_hex(f"C{i}")
        assert rows and all(
            r.get_zorder() < mx[0].get_zorder() and r.get_linestyle() != "-" for r in rows
        )


@pytest.mark.rule("raggedspec drift")
def test_a_constant_bucket_series_is_explained_not_plotted():
    flat = [TraceData("a", engine_trace([{0: 10 + t, 1: 9 + t} for t in range(5)]))]
    fig = drift.figure_groups_buckets(flat)
    assert len(
        fig.axes
    ) == 1 and "buckets per step are not plotted: 1 at every measured step" in figure_text(fig)
    varied = engine_trace([{0: 10 + t, 1: 9 + t} for t in range(5)])
    varied[2]["buckets"] = 3
    fig = drift.figure_groups_buckets(flat + [TraceData("b", varied)])
    assert len(fig.axes) == 2 and "a (1 at every step)" in figure_text(fig)


@pytest.mark.rule("raggedspec drift")
def test_the_per_position_titles_are_plain_words():
    text = figure_text(
        drift.figure_per_position([TraceData("t", steps_with_accepts([(3, 2), (3, 0)]))])
    )
    assert "Of the rows that drafted position j, the fraction" in text
    assert "Of the drafts that reached position j" in text and "the fraction accepted" in text


@pytest.mark.slow
@pytest.mark.rule("raggedspec drift")
def test_the_sweep_keeps_the_b2_stall_off_its_scale_and_explains_it_in_words():
    """At B = 2 with per-sequence advance (the built-in scenario) the two rows stop drafting:
    their draft caches' capacities differ when they meet at equal lengths, and the engine
    refuses to batch the uniform group. The point is left out of its line and below the
    scale, so the others are readable, and a note says why in plain words."""
    from raggedspec.reference.lengths import STALL_UNIFORM

    sweep = drift.sweep_tok_per_step(None, batches=[1, 2, 4])
    label = drift.DRIFT_RUNS[1][0]
    assert sweep["drafting_fraction"][label][1] < 0.05
    assert sweep["stalls"][label][1][STALL_UNIFORM] > 400 and sweep["stalls"][label][0] == {}
    assert sweep["refused_at"][label] == [None, None, None]
    fig = drift.figure_sweep(sweep)
    text = figure_text(fig)
    assert "B = 2" in text and "refuses to batch their draft caches" in text
    assert "never draft again" in text and "not a fault of the simulator" in text
    assert "tokens committed per sequence per decode step" in text
    ax = fig.axes[0]
    line = next(ln for ln in ax.lines if ln.get_label() == label)
    assert np.isnan(line.get_ydata()[1]) and not np.isnan(line.get_ydata()[2])
    low = ax.get_ylim()[0]
    assert sweep["tok_per_step"][label][1] < low < min(v for vs in sweep["tok_per_step"].values()
                                                         for v in vs if v > 2)
    assert outside_the_canvas(fig) == []
    clean = sweep | {"drafting_fraction": {k: [1.0] * 3 for k in sweep["drafting_fraction"]}}
    assert "draft caches" not in figure_text(drift.figure_sweep(clean))


@pytest.mark.rule("raggedspec drift")
def test_the_figures_cite_no_spec_section_and_explain_their_terms():
    runs = drift.scenario_runs(None, {"steps": 60})
    sweep = drift.sweep_tok_per_step(None, {"steps": 60}, batches=[1, 2, 4])
    figs = [drift.figure_spread(runs), drift.figure_padding(runs),
            drift.figure_groups_buckets(runs), drift.figure_sweep(sweep),
            drift.figure_per_position(runs)]
    text = " | ".join(figure_text(f) for f in figs)
    for word in ("§", "cache-and-draft", "arc ", " WB", "MTP", "marker"):
        assert word not in text, word
    groups = figure_text(figs[2])
    assert "Cohort advance keeps for every row only the batch's shortest accept" in groups
    assert "every row has u = 1 and all rows draft in one group" in groups
    assert "mean 2." in groups and "(1 at every step)" in groups


@pytest.mark.rule("§17.3 no-strip negative control")
def test_the_no_strip_control_claims_tokens_the_rows_do_not_hold():
    """§17.3: stripped lengths {7+3k, 4+k, 6+2k}, the control's {7+3k, 5+3k, 6+3k}: the
    control records 0, 1+2k and k tokens more than each row holds, (1+3k)/3 on average."""
    stripped = engine_trace(section_17_3(12, strip=True))
    xs, excess = drift.overclaim(stripped, drift.no_strip_control(stripped))
    assert list(xs) == list(range(13)) and excess[0] == 0
    assert list(excess[1:]) == pytest.approx([(1 + 3 * k) / 3 for k in range(1, 13)])


@pytest.mark.rule("raggedspec drift")
def test_the_control_panel_draws_the_computed_rule_over_the_whole_run_and_says_how_far():
    runs = drift.scenario_runs({"batch": 6, "prompt_len": 24, "max_new_tokens": 60,
                                "steps": 40, "world": "WB"})
    fig = drift.figure_spread(runs)
    ctl = next(ln for ln in fig.axes[2].lines if ln.get_label().startswith("computed"))
    stripped_steps = drift.spread_band(runs[1].steps).step
    assert max(ctl.get_xdata()) == stripped_steps.max() > 5 * drift.summarize(runs[2])[
        "measured_steps"]
    xs, excess = drift.overclaim(runs[1].steps, runs[2].control)
    assert f"by step {xs[-1]} every row records on average {excess[-1]:.0f} tokens" in (
        figure_text(fig).lower())


@pytest.mark.rule("raggedspec command line and raggedspec simulate")
@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_outputs_get_the_umasks_mode(tmp_path, umask):
    """Every output (drift's figures and summary.json, simulate's trace, ...) is staged
    through raggedspec.outputs; the renamed file has 0666 less the umask, as `open` gives."""
    from raggedspec.outputs import staged, write_text_atomic

    old = os.umask(umask)
    try:
        write_text_atomic(tmp_path / "summary.json", "{}")
        with staged() as stage:
            stage[tmp_path / "a" / "spread.png"].write_bytes(b"png")
    finally:
        os.umask(old)
    modes = {p.stat().st_mode & 0o777 for p in tmp_path.rglob("*") if p.is_file()}
    assert modes == {0o666 & ~umask}


# ------------------------------------------------------------------- layout and summary


@pytest.mark.slow
@pytest.mark.rule("raggedspec drift")
@pytest.mark.parametrize("n", [1, 2, 3, 5])
def test_no_title_or_legend_is_clipped_at_any_panel_count(n):
    accepts = [{0: (3, 2), 1: (3, 0), 2: (3, 1)}] * 7
    steps = engine_trace(section_17_3(6, strip=True), accepts=accepts)
    runs = [drift.as_trace_data(steps, f"run {i} with a fairly long label") for i in range(n)]
    for make in (drift.figure_spread, drift.figure_padding, drift.figure_groups_buckets,
                 drift.figure_per_position):
        fig = make(runs)
        assert outside_the_canvas(fig) == [], (make.__name__, n)


@pytest.mark.slow
@pytest.mark.rule("raggedspec drift")
def test_summary_records_scenario_and_seed_and_does_not_depend_on_the_output_folder(tmp_path):
    over = {"batch": 3, "steps": 12, "max_new_tokens": 10, "seed": 7}
    a = drift.drift_from_scenario(None, tmp_path / "a", overrides=over, batches=[1, 2])
    drift.drift_from_scenario(None, tmp_path / "deeper" / "b", overrides=over, batches=[1, 2])
    text_a = (tmp_path / "a" / "summary.json").read_text()
    assert text_a == (tmp_path / "deeper" / "b" / "summary.json").read_text()
    summary = json.loads(text_a)
    assert summary["seed"] == 7 and summary["scenario"]["seed"] == 7
    assert summary["scenario"]["batch"] == 3
    assert str(tmp_path) not in text_a
    assert sorted(summary["files"]) == sorted(p.name for p in (tmp_path / "a").iterdir())
    assert a["removed_stale"] == []


@pytest.mark.slow
@pytest.mark.rule("raggedspec drift")
def test_a_reused_output_folder_loses_the_figures_this_run_does_not_draw(tmp_path):
    over = {"batch": 3, "steps": 12, "max_new_tokens": 10}
    drift.drift_from_scenario(None, tmp_path, overrides=over, batches=[1, 2])
    assert (tmp_path / "tok_per_step_vs_batch.png").is_file()
    (tmp_path / "mine.txt").write_text("not a figure")
    again = drift.drift_from_scenario(None, tmp_path, overrides=over, batches=[])
    sweep = ["tok_per_step_vs_batch.png", "tok_per_step_vs_batch.svg"]
    assert sorted(again["removed_stale"]) == sweep
    assert not (tmp_path / sweep[0]).exists() and (tmp_path / "mine.txt").is_file()
    kept = sorted(p.name for p in tmp_path.iterdir() if p.name != "mine.txt")
    assert sorted(again["files"]) == kept


@pytest.mark.slow
@pytest.mark.rule("raggedspec drift")
def test_a_figure_that_fails_to_draw_leaves_the_earlier_report_untouched(tmp_path, monkeypatch):
    import raggedspec.drift.figures as figures

    over = {"batch": 3, "steps": 12, "max_new_tokens": 10}
    drift.drift_from_scenario(None, tmp_path, overrides=over, batches=[])
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}

    def broken(runs):
        raise RuntimeError("drawing failed")

    # the last figure fails: the others are drawn (and staged) first
    monkeypatch.setattr(figures, "figure_per_position", broken)
    with pytest.raises(RuntimeError):
        drift.drift_from_scenario(None, tmp_path, overrides=over | {"seed": 3}, batches=[])
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before


# ------------------------------------------------------------------ the command line

PNG = b"\x89PNG\r\n\x1a\n"



@pytest.mark.slow
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


@pytest.mark.slow
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
    for name in drift.FIGURE_NAMES:
        assert (out / f"{name}.png").read_bytes()[:8] == PNG


@pytest.mark.slow
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
