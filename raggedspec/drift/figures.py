"""The drift figures (PNG and SVG) and summary.json, drawn from `raggedspec.drift.data`.

Every figure uses matplotlib's constrained layout and is saved with a tight bounding box, so
titles, legends and notes are never clipped whatever the number of panels. Titles, axes and
notes speak an engine author's words: they name a behaviour, never a section of the spec,
and explain a term where it first appears. A run that a refusal ended within a few steps is
named in a note under the per-step figures instead of being drawn as a stub.
"""

from __future__ import annotations

import json
import textwrap
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from raggedspec.drift.data import (
    SUMMARY_SCHEMA,
    SUMMARY_VERSION,
    MissingField,
    SpreadBand,
    TraceData,
    _failure_notes,
    failures,
    measured_steps,
    per_position_acceptance,
    pick_row_lines,
    refused_at,
    rows_cover,
    spread_band,
    step_series,
    summarize,
)

FIGURE_NAMES = ("spread", "padding", "groups_buckets", "tok_per_step_vs_batch", "per_position")


def _new_figure(width: float, height: float, rows: int = 1, cols: int = 1, **kw):
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), layout="constrained")
    axes = fig.subplots(rows, cols, squeeze=False, **kw)
    return fig, axes


def _say_missing(ax, label: str, exc: Exception) -> None:
    ax.text(
        0.5,
        0.5,
        f"{label}: not plotted\n{exc}",
        ha="center",
        va="center",
        wrap=True,
        transform=ax.transAxes,
        fontsize=9,
        color="0.3",
        bbox=dict(boxstyle="round", fc="0.95", ec="0.7"),
    )


def _style(i: int) -> dict:
    """Run i's line style: colour, dash and marker differ, and earlier runs are drawn wider,
    so runs whose lines coincide stay visible."""
    return dict(
        color=f"C{i}",
        ls=("-", "--", ":", "-.")[i % 4],
        marker="osD^"[i % 4],
        lw=max(2.6 - 0.8 * i, 1.0),
        ms=4,
        markevery=0.1,
    )


def run_tag(run: TraceData) -> str:
    """A short label suffix for a run with failed steps: "refused at step N: over its M
    steps only" when a refusal ended it (with several failed steps: "K failed steps from
    step N: ..."), "K failed step(s), first at step N" when it went on; "" for a clean run."""
    ref = refused_at(run.steps)
    if ref is None:
        return ""
    k = len(failures(run.steps))
    what = f"refused at step {ref[0]}" if k == 1 else f"{k} failed steps from step {ref[0]}"
    if ref[2]:
        return f"{what}: over its {len(measured_steps(run.steps))} steps only"
    return f"{k} failed step(s), first at step {ref[0]}"


def too_short(run: TraceData, runs: list[TraceData]) -> bool:
    """True for a run a refusal ended within a fifth of the longest run's measured steps: on
    the shared step axis it would be a stub, so the per-step figures name it in a note."""
    ref = refused_at(run.steps)
    longest = max(len(measured_steps(r.steps)) for r in runs)
    return bool(ref and ref[2]) and len(measured_steps(run.steps)) * 5 < longest


def _short_notes(runs: list[TraceData]) -> list[str]:
    longest = max((len(measured_steps(r.steps)) for r in runs), default=0)
    return [
        f"Not drawn: {r.label} ({run_tag(r)}), too few steps to show against {longest}; "
        "summary.json has its values."
        for r in runs
        if too_short(r, runs)
    ]


def _notes_below(fig, notes: list[str], width: int = 110) -> None:
    if notes:
        text = "\n".join(textwrap.fill(n, width) for n in notes)
        fig.supxlabel(text, fontsize=8, color="0.3", ha="center", ma="left")


def _tagged(label: str, run: TraceData, what: str) -> str:
    tag = run_tag(run)
    return f"{label} ({what}; {tag})" if tag else f"{label} ({what})"


def _title_lines(run: TraceData, band: SpreadBand) -> list[str]:
    lines = [run.label]
    ref = refused_at(run.steps)
    who = "simulated run" if run.source == "simulator" else "run"
    cover = rows_cover(run.steps)
    bucket = " (running bucket only)" if cover.startswith("running bucket") else ""
    if ref is not None and ref[2]:
        short = ref[1] if len(ref[1]) <= 40 else ref[1][:39] + "…"
        k = len(failures(run.steps))
        lines.append(
            f"{who} refused at step {ref[0]} ({short})"
            if k == 1
            else f"{who}: {k} steps refused, the first at step {ref[0]} ({short})"
        )
        lines.append(f"max spread {band.max_spread} tokens over its {len(band.step)} steps{bucket}")
    else:
        lines.append(f"max spread {band.max_spread} tokens{bucket}")
    return lines


def spread_legend(n: int):
    """The spread figure's shared legend for n panels: (handles, labels). The band, max and
    median entries show one swatch per panel in that panel's colour (C0, C1, ...), so the
    legend matches every panel; the individual sequences are the same grey everywhere."""
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    handles = [
        tuple(Patch(color=f"C{i}", alpha=0.3) for i in range(n)),
        tuple(Line2D([], [], color=f"C{i}", lw=1.8) for i in range(n)),
        tuple(Line2D([], [], color=f"C{i}", lw=1.4, ls="--") for i in range(n)),
        Line2D([], [], color=ROW_LINE["color"], lw=ROW_LINE["lw"], ls=ROW_LINE["ls"]),
    ]
    labels = [
        "band: min to max over the step's rows",
        "max over rows",
        "median over rows",
        "three individual sequences (largest spread, longest lived)",
    ]
    return handles, labels


ROW_LINE = dict(
    color="0.3", lw=0.9, ls=(0, (1, 1.5)), zorder=2
)  # individual sequences: under the max line


def figure_spread(runs: list[TraceData]):
    """One panel per run: the band min..max of own_len - batch min over the rows, the
    max and median lines (the run's colour, drawn on top), and three rows' own lines (thin,
    dotted grey, underneath). A no-strip panel with a `control` draws the §17.3 rule applied
    to the stripped run's advances (computed, not simulated) as a black dotted line."""
    from matplotlib.legend_handler import HandlerTuple

    fig, axes = _new_figure(4.6 * len(runs) + 0.6, 4.9, 1, len(runs), sharey=True)
    for i, (ax, run) in enumerate(zip(axes[0], runs, strict=True)):
        band = spread_band(run.steps)
        if len(band.step):
            ax.fill_between(band.step, band.lo, band.hi, color=f"C{i}", alpha=0.22, lw=0, zorder=1)
            for q in pick_row_lines(band):
                xs, ys = band.rows[q]
                ax.plot(xs, ys, **ROW_LINE)
            few = (
                dict(marker="o", ms=3) if len(band.step) < 20 else {}
            )  # a run cut short stays visible
            ax.plot(band.step, band.hi, color=f"C{i}", lw=1.8, zorder=3, **few)
            ax.plot(band.step, band.mid, color=f"C{i}", lw=1.4, ls="--", zorder=3)
        if run.control:
            _draw_control(ax, run)
        cover = rows_cover(run.steps)
        ax.set_title("\n".join(_title_lines(run, band)), fontsize=9.5)
        ax.set_xlabel("engine step (decode and deferred steps)")
        ax.xaxis.get_major_locator().set_params(integer=True)
        ax.grid(alpha=0.3)
        notes = list(run.notes) + _failure_notes(run)
        if cover.startswith("running bucket"):
            notes.append("Spread of the " + cover[0].lower() + cover[1:] + ".")
        if len(band.step) and band.max_spread == 0:
            msg = (
                "0 at every step: every running row holds the same length"
                if not cover.startswith("running bucket")
                else "0 at every step, but only within the bucket that ran: rows of other "
                "lengths waited in other buckets"
            )
            if notes:
                notes.insert(0, msg + ".")
            else:
                ax.text(
                    0.5, 0.12, msg, ha="center", transform=ax.transAxes, fontsize=9, color=f"C{i}"
                )
        if notes:
            ax.text(
                0.03,
                0.74 if run.control else 0.97,
                "\n".join(textwrap.fill(n, 52) for n in notes),
                transform=ax.transAxes,
                va="top",
                fontsize=7.5,
                zorder=5,
                bbox=dict(boxstyle="round", fc="lightyellow", ec="0.7"),
            )
    axes[0][0].set_ylabel("sequence's KV length − the batch's shortest (tokens)")
    axes[0][0].set_ylim(-0.5, max(axes[0][0].get_ylim()[1], 5))
    n = len(runs)
    handles, labels = spread_legend(n)
    fig.legend(
        handles,
        labels,
        loc="outside lower center",
        ncols=4 if n > 2 else n,
        fontsize=8.5,
        frameon=False,
        handler_map={tuple: HandlerTuple(ndivide=None, pad=0.2)},
        handlelength=4,
    )
    fig.suptitle(
        textwrap.fill(
            "Length drift: how far each sequence's KV-cache length runs ahead of the batch's "
            "shortest, step by step (each panel in its own colour)",
            max(40, int((4.6 * len(runs) + 0.6) * 10)),
        ),
        fontsize=11,
    )
    return fig


def _draw_control(ax, run: TraceData) -> None:
    """The no-strip rule computed over the whole run (grey band, black dotted max) and where
    the simulated run was refused (a dashed line), with a legend saying which is which."""
    ctl = spread_band(run.control)
    ax.fill_between(ctl.step, ctl.lo, ctl.hi, color="0.5", alpha=0.25, lw=0, zorder=1)
    ax.plot(ctl.step, ctl.hi, color="k", lw=1.8, ls=":", zorder=4,
            label="computed, not simulated: the no-strip rule applied\nto the stripped run's "
            f"per-step advances, whole run\n(max; grey band: min to max), peak {ctl.max_spread} "
            "tokens")
    ref = refused_at(run.steps)
    if ref is not None:
        ax.axvline(ref[0], color="C2", lw=1.2, ls="--", zorder=2,
                   label=f"the simulated run, refused at step {ref[0]}")
    ax.legend(loc="upper right", fontsize=7.5)


def figure_padding(runs: list[TraceData]):
    """Padding fraction (dead columns / all columns of the batched cache) per step; a run a
    refusal ended is labelled so (its mean covers only its few steps)."""
    fig, axes = _new_figure(8, 4.2)
    ax = axes[0][0]
    lost = []
    for i, run in enumerate(runs):
        if too_short(run, runs):
            continue
        try:
            xs, ys = step_series(run.steps, "padding_fraction")
            if not len(xs):
                continue
            ax.plot(xs, ys, **_style(i), label=_tagged(run.label, run, f"mean {ys.mean():.3f}"))
        except MissingField as exc:
            lost.append(f"{run.label}: {exc}")
    if lost:
        _say_missing(ax, "padding fraction", MissingField("\n".join(lost)))
    ax.set_title("Padding of the batched KV cache: dead (front-padding) columns / all columns")
    _notes_below(fig, _short_notes(runs))
    ax.set_xlabel("engine step (decode and deferred steps)")
    ax.set_ylabel("padding (fraction of columns)")
    ax.set_ylim(bottom=0)
    ax.set_ylim(top=max(ax.get_ylim()[1] * 1.3, 0.05))
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8, loc="upper left")
    return fig


def _constant(values: np.ndarray):
    return values[0] if len(values) and (values == values[0]).all() else None


GROUPS_WHY = (
    "A draft group is the rows that run one draft-model forward together: the same number u "
    "of uncached tokens and, under cohort advance, the same chain start. Cohort advance keeps "
    "for every row only the batch's shortest accept, so rows that accepted more carry 1 to "
    "depth uncached tokens into the next step and split into up to depth groups. Per-sequence "
    "advance commits each row's own accept, so every row has u = 1 and all rows draft in "
    "one group. 0: no row drafted."
)


def figure_groups_buckets(runs: list[TraceData]):
    """Draft groups and scheduler buckets per step, with a note saying why cohort advance
    splits the rows into several groups and per-sequence advance keeps one. When every run's
    bucket count is one constant value the bottom panel is dropped and the note says so (a
    flat line explains nothing)."""
    shown = [r for r in runs if not too_short(r, runs)]
    series = {}
    for run in shown:
        try:
            series[run.label] = step_series(run.steps, "buckets")[1]
        except MissingField:
            series[run.label] = None
    consts = {lab: _constant(v) for lab, v in series.items() if v is not None and len(v)}
    flat = (
        bool(consts)
        and all(c is not None for c in consts.values())
        and len(set(consts.values())) == 1
        and all(v is not None for v in series.values())
    )
    panels = [("groups", "draft groups per step")]
    if not flat:
        panels.append(("buckets", "scheduler buckets per step"))
    fig, axes = _new_figure(8, 6 if not flat else 4.4, len(panels), 1, sharex=True)
    for (name, what), ax in zip(panels, (a[0] for a in axes), strict=True):
        lost = []
        for i, run in enumerate(runs):
            if run not in shown:
                continue
            try:
                xs, ys = step_series(run.steps, name)
                if not len(xs):
                    continue
                const = _constant(ys)
                what_run = f"mean {ys.mean():.2f}" if const is None else f"{const:g} at every step"
                ax.step(
                    xs,
                    ys,
                    where="mid",
                    **(_style(i) | {"marker": None}),
                    alpha=0.85,
                    label=_tagged(run.label, run, what_run),
                )
            except MissingField as exc:
                lost.append(f"{run.label}: {exc}")
        if lost:
            _say_missing(ax, name, MissingField("\n".join(lost)))
        ax.set_ylabel(what)
        ax.set_ylim(0, max(ax.get_ylim()[1] * 1.35, 2))
        ax.yaxis.get_major_locator().set_params(integer=True)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8, loc="upper left")
    title = "Draft groups per step: rows that run one draft-model forward together"
    if not flat:
        title += "\nand scheduler buckets per step (sequences grouped by cache length; one runs)"
    axes[0][0].set_title(title, fontsize=10)
    axes[-1][0].set_xlabel("engine step (decode and deferred steps)")
    notes = [GROUPS_WHY]
    if flat:
        value = next(iter(consts.values()))
        one = " (every running sequence was scheduled together in one bucket)" if value == 1 else ""
        notes.append(
            f"Scheduler buckets per step are not plotted: {value:g} at every measured step in "
            f"every run{one}."
        )
    _notes_below(fig, notes + _short_notes(runs))
    return fig


def _uniform_stall(stalls: dict) -> bool:
    """True when rows stopped drafting mainly because a uniform draft group was refused."""
    from raggedspec.reference.lengths import STALL_UNIFORM

    total = sum(stalls.values()) if stalls else 0
    return bool(total) and stalls.get(STALL_UNIFORM, 0) * 2 > total


def _stall_note(label: str, b: int, v: float, f: float, uniform: bool) -> str:
    """The note under the sweep for a point where fewer than half the row-steps drafted."""
    head = f"{label}, B = {b}: {v:.2f} tokens per step; only {f:.0%} of row-steps drafted."
    if not uniform:
        return head + " Speculation stalled there (summary.json's sweep.stalls says why)."
    rows = "the two rows" if b == 2 else f"{b} rows"
    return head + (
        f" {rows.capitalize()}' draft caches grew at different steps, so their buffer "
        f"capacities differ; once {rows} reach equal lengths the engine refuses to batch "
        "their draft caches (equal lengths are batched only with equal capacities), and they "
        "never draft again. The engine behaves so; it is not a fault of the simulator."
    )


def _sweep_limits(values: list[list[float]], stalled: list[list[bool]]) -> tuple[float, float]:
    """y limits from the points where speculation ran, so one stalled point does not squash
    the rest of the figure (all points when every point stalled)."""
    kept = [v for vs, ss in zip(values, stalled, strict=True)
            for v, s in zip(vs, ss, strict=True) if not s]
    kept = kept or [v for vs in values for v in vs]
    lo, hi = min(kept), max(kept)
    pad = max(0.08 * (hi - lo), 0.05)
    return lo - 2 * pad, hi + pad


def figure_sweep(sweep: dict):
    """tok_per_step against batch size, one line per advance rule. A point where fewer than
    half the decode row-steps drafted is a stall: it is left out of its line (which breaks
    there), drawn hollow, at the bottom edge when it lies below the scale, and explained in a
    note under the figure (in plain words when a refused uniform draft group caused it)."""
    fig, axes = _new_figure(8.2, 5.6)
    ax = axes[0][0]
    batches = sweep["batch"]
    labels = list(sweep["tok_per_step"])
    values = [sweep["tok_per_step"][k] for k in labels]
    fracs = [sweep.get("drafting_fraction", {}).get(k, [1.0] * len(batches)) for k in labels]
    stalled = [[f < 0.5 for f in fs] for fs in fracs]
    lo, hi = _sweep_limits(values, stalled)
    notes = []
    for i, label in enumerate(labels):
        line = [np.nan if s else v for v, s in zip(values[i], stalled[i], strict=True)]
        ax.plot(batches, line, **(_style(i) | {"markevery": 1}), label=label)
        stalls = sweep.get("stalls", {}).get(label, [{}] * len(batches))
        refused = sweep.get("refused_at", {}).get(label, [None] * len(batches))
        for b, v, f, why, ref in zip(batches, values[i], fracs[i], stalls, refused, strict=False):
            if ref is not None:
                ax.annotate(f"refused at step {ref}", (b, min(max(v, lo), hi)),
                            textcoords="offset points", xytext=(7, -10), fontsize=7.5,
                            color=f"C{i}")
            if f >= 0.5:
                continue
            below = v < lo
            ax.plot([b], [lo if below else v], marker="v" if below else "o", ms=8, mfc="white",
                    mec=f"C{i}", mew=1.5, ls="none", clip_on=False, zorder=5)
            ax.annotate(f"B = {b}: {v:.2f}{', below the scale' if below else ''} (note)",
                        (b, lo if below else v), textcoords="offset points", xytext=(8, 4),
                        fontsize=7.5, color=f"C{i}")
            notes.append(_stall_note(label, b, v, f, _uniform_stall(why)))
    ax.set_ylim(lo, hi)
    ax.set_xscale("log", base=2)
    ax.set_xticks(batches, [str(b) for b in batches])
    ax.set_xlabel("batch size B (sequences decoded together)")
    ax.set_ylabel("tokens committed per sequence per decode step", fontsize=9)
    ax.set_title(
        "Tokens per sequence per decode step against batch size\n(cohort advance rolls every "
        "row back to the batch's shortest accept;\nper-sequence advance keeps each row's own)",
        fontsize=10,
    )
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="center right")
    _notes_below(fig, notes, 120)
    return fig


def figure_per_position(runs: list[TraceData]):
    """Per draft position: P(accepted > j | drafted > j) and the marker's conditional p_pos.
    A run a refusal ended is drawn faded and labelled with how few row-steps it has."""
    fig, axes = _new_figure(10, 5.2, 1, 2, sharey=True)
    titles = (
        "Of the rows that drafted position j, the fraction\nwhose drafts 1 .. j were all accepted",
        "Of the drafts that reached position j (drafts 1 .. j−1\naccepted), the fraction accepted\n"
        "(the per-position rate an engine's acceptance log reports)",
    )
    lost = []
    for i, run in enumerate(runs):
        try:
            pp = per_position_acceptance(run.steps)
        except MissingField as exc:
            lost.append(f"{run.label}: {exc}")
            continue
        xs = np.arange(1, len(pp.p) + 1)
        ref = refused_at(run.steps)
        ended = bool(ref and ref[2])
        n = pp.drafted_beyond[0] if pp.drafted_beyond else 0
        label = (
            f"{run.label} (refused at step {ref[0]}: only {n} drafting row-steps)"
            if ended
            else run.label
        )
        for ax, ys in zip(axes[0], (pp.p, pp.p_pos), strict=True):
            ax.plot(
                xs,
                [np.nan if y is None else y for y in ys],
                **(_style(i) | {"markevery": 1}),
                alpha=0.45 if ended else 0.85,
                label=label,
            )
    for ax, title in zip(axes[0], titles, strict=True):
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("draft position j (1 = first draft token)")
        ax.set_ylim(-0.02, 1.02)
        ax.grid(alpha=0.3)
        ax.xaxis.get_major_locator().set_params(integer=True)
        if lost:
            _say_missing(ax, "per-position acceptance", MissingField("\n".join(lost)))
    axes[0][0].set_ylabel("acceptance rate (fraction of drafts)")
    handles, labels = axes[0][0].get_legend_handles_labels()
    if handles:
        fig.legend(
            handles,
            labels,
            loc="outside lower center",
            ncols=1 if len(runs) > 2 else len(runs),
            fontsize=8,
            frameon=False,
        )
    fig.suptitle("Per-position acceptance over all decode row-steps", fontsize=11)
    return fig


def _save(fig, stage, out_dir: Path, name: str) -> list[str]:
    """Save `fig` as NAME.png and NAME.svg through the stage; return the file names. The
    tight bounding box keeps every title, legend and note inside the image."""
    names = []
    for ext, meta in (("png", {"Software": None}), ("svg", {"Date": None})):
        fig.savefig(
            stage[out_dir / f"{name}.{ext}"],
            format=ext,
            dpi=100,
            metadata=meta,
            bbox_inches="tight",
            pad_inches=0.15,
        )
        names.append(f"{name}.{ext}")
    return names


def write_report(
    runs: list[TraceData],
    out_dir: str | Path,
    sweep: dict | None = None,
    notes: Iterable[str] = (),
    scenario: dict | None = None,
) -> dict:
    """Write every figure (PNG and SVG) and summary.json into out_dir; return the summary.
    `sweep` is {"batch": [...], "tok_per_step": {label: [...]}} or None (no sweep figure);
    `scenario` is the resolved scenario of simulated runs (None: taken from the first
    run's trace header, if it has one). Invariants: nothing in out_dir changes unless every
    file was drawn (the files are staged, then renamed); summary.json names files relative
    to out_dir, so it does not depend on where the report was written; figures an earlier
    run left in out_dir that this run does not draw are removed and listed in the
    returned dict's `removed_stale` (not in summary.json)."""
    import matplotlib

    from raggedspec.outputs import remove_stale, staged

    out_dir = Path(out_dir)
    if scenario is None:
        scenario = ((runs[0].header or {}).get("scenario") if runs else None) or None
    with (
        staged() as stage,
        matplotlib.rc_context({"svg.hashsalt": "raggedspec"}),
    ):  # reproducible SVG ids
        files = _save(figure_spread(runs), stage, out_dir, "spread")
        files += _save(figure_padding(runs), stage, out_dir, "padding")
        files += _save(figure_groups_buckets(runs), stage, out_dir, "groups_buckets")
        if sweep:
            files += _save(figure_sweep(sweep), stage, out_dir, "tok_per_step_vs_batch")
        files += _save(figure_per_position(runs), stage, out_dir, "per_position")
        summary = {
            "schema": SUMMARY_SCHEMA,
            "version": SUMMARY_VERSION,
            "scenario": scenario,
            "seed": None if scenario is None else scenario.get("seed"),
            "runs": [summarize(r) for r in runs],
            "sweep": sweep,
            "notes": list(notes),
            "files": files + ["summary.json"],
        }
        stale = [
            f"{n}.{ext}"
            for n in FIGURE_NAMES
            for ext in ("png", "svg")
            if f"{n}.{ext}" not in files
        ]
        stage[out_dir / "summary.json"].write_text(json.dumps(summary, indent=2) + "\n")
    removed = remove_stale(out_dir, stale, [out_dir / f for f in files])
    return summary | {"removed_stale": [p.name for p in removed]}
