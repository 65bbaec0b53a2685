"""Length-drift reports (raggedspec/drift/): scenario runs and the sweep, the figures' words,
legends and layout, and the summary and output folder of a report. Traces come from the
hand-made engine in conformance/drift_traces.py or from reference scenario runs.
"""

from __future__ import annotations

import json

import pytest

from raggedspec import drift
from raggedspec.conformance.drift_traces import engine_trace, section_17_3, steps_with_accepts
from raggedspec.drift import TraceData

# ------------------------------------------------------------------------- from a scenario

SMALL_W0 = {"batch": 4, "prompt_len": 16, "max_new_tokens": 24, "steps": 20, "world": "W0"}


@pytest.mark.rule("raggedspec drift")
def test_scenario_runs_grant_per_sequence_and_explain_a_world_that_splits_ragged_rows():
    runs = drift.scenario_runs(SMALL_W0)
    assert [r.header["scenario"]["advance"] for r in runs] == [
        "cohort",
        "per-sequence",
        "per-sequence",
    ]
    assert [r.header["scenario"]["strip"] for r in runs] == ["eager", "eager", "none"]
    assert all(
        r.header["scenario"]["admission"] == "grant" and r.header["scenario"]["xs_per_seq"]
        for r in runs
    )
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


def figure_text(fig):
    out = [t.get_text() for t in fig.texts]
    for ax in fig.axes:
        out += [ax.get_title(), ax.get_xlabel(), ax.get_ylabel()] + [t.get_text() for t in ax.texts]
        leg = ax.get_legend()
        if leg:
            out += [t.get_text() for t in leg.get_texts()]
    for leg in fig.legends:
        out += [t.get_text() for t in leg.get_texts()]
    return " | ".join(" ".join(x.split()) for x in out)  # wrapped lines joined back


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
    assert "computed, not simulated" in spread and "§17.3" in spread
    tag = f"refused at step {step}: over its {n} steps only"
    assert tag in figure_text(drift.figure_padding(runs))
    assert tag in figure_text(drift.figure_groups_buckets(runs))
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


@pytest.mark.rule("raggedspec drift")
def test_the_sweep_explains_the_b2_drop_and_names_its_ratio():
    """At B = 2 with per-sequence advance (the built-in scenario) the two rows stop drafting:
    their draft caches' capacities differ when they meet at equal lengths, and
    batch_draft_caches refuses the uniform group (§9.6). The figure says so in plain words
    and the y axis names the MTP accounting ratio (§15)."""
    from raggedspec.reference.lengths import STALL_UNIFORM

    sweep = drift.sweep_tok_per_step(None, batches=[1, 2])
    label = drift.DRIFT_RUNS[1][0]
    assert sweep["drafting_fraction"][label][1] < 0.05
    assert sweep["stalls"][label][1][STALL_UNIFORM] > 400 and sweep["stalls"][label][0] == {}
    assert sweep["refused_at"][label] == [None, None]
    text = figure_text(drift.figure_sweep(sweep))
    assert "B = 2" in text and "batch_draft_caches refuses it" in text and "§9.6" in text
    assert "never draft again" in text and "real arc behaviour" in text
    assert "MTP accounting ratio" in text  # in words, not a formula:
    assert "tokens committed per row per decode step" in text
    clean = figure_text(drift.figure_sweep(sweep | {"drafting_fraction": {k: [1.0, 1.0] for k in
                                                                          sweep["drafting_fraction"]}}))
    assert "batch_draft_caches" not in clean


# ------------------------------------------------------------------- layout and summary


def _inside(fig) -> list[str]:
    """The texts and legends of a drawn figure that reach outside its canvas."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    renderer = canvas.get_renderer()
    box = fig.bbox
    out = []
    artists = [fig._suptitle, fig._supxlabel] + list(fig.legends)
    for ax in fig.axes:
        artists += [ax.title, ax._left_title, ax._right_title, ax.get_legend(), ax.xaxis.label,
                    ax.yaxis.label]
    for a in artists:
        if a is None or not a.get_visible() or (hasattr(a, "get_text") and not a.get_text()):
            continue
        e = a.get_window_extent(renderer)
        if e.x0 < box.x0 - 1 or e.y0 < box.y0 - 1 or e.x1 > box.x1 + 1 or e.y1 > box.y1 + 1:
            text = getattr(a, "get_text", lambda: "")()
            out.append(f"{type(a).__name__} {text!r:.40} at {e.bounds}")
    return out


@pytest.mark.rule("raggedspec drift")
@pytest.mark.parametrize("n", [1, 2, 3, 5])
def test_no_title_or_legend_is_clipped_at_any_panel_count(n):
    accepts = [{0: (3, 2), 1: (3, 0), 2: (3, 1)}] * 7
    steps = engine_trace(section_17_3(6, strip=True), accepts=accepts)
    runs = [drift.as_trace_data(steps, f"run {i} with a fairly long label") for i in range(n)]
    for make in (drift.figure_spread, drift.figure_padding, drift.figure_groups_buckets,
                 drift.figure_per_position):
        fig = make(runs)
        assert _inside(fig) == [], (make.__name__, n)


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
