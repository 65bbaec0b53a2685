"""Length-drift diagnostics: what happens to the rows' KV-cache lengths, step after step.

Input is a trace in schema v1 (docs/trace.md): the simulator's own `Trace`, or a trace file
(JSONL or CSV) written by this simulator or by any engine. Only `step`, `rows[].seq` and
`rows[].own_len` are required (the spread plot); every other plot uses its fields when they
are present and otherwise says which field is missing instead of failing.

Quantities (all integers come straight from the trace; nothing here recomputes a rule):
- spread of row i at a step = own_len_i - min over the step's rows of own_len. Under the
  cohort rule every row's own length is the batched width C, so the spread is 0; under
  per-sequence advance it grows; a per-sequence run that records the padded width as its
  own length (no dead-prefix strip) keeps it bounded by w - 1 (cache-and-draft §17.3).
- padding fraction = dead (lead) columns / all columns of the batched cache (step field).
- draft groups and scheduler buckets per step (step fields).
- tok_per_step = the MTP[agg] accounting ratio: committed (1 + a per row-step, §15) / row-steps
  of decode.
- per-position acceptance, draft position j counted from 0: p_j = #(accepted > j) /
  #(drafted > j) over decode row-steps, and the MTP marker's conditional p_pos[j] =
  accepted_at[j] / reached_at[j] (§15). The figures number positions from 1.

Which steps count, when a step has a `phase` field: lengths (spread, padding, groups, buckets)
are measured on every step that ran on the batched cache, `decode` and `defer` (the window
deferral's plain decode carries the same leads); acceptance (per-position, drafting fraction,
tok_per_step from rows) only on `decode` steps, the ones that verify drafts. Prompt and idle
steps are never measured; a trace without `phase` has every step measured.

Honesty about coverage: a step's rows are the scheduled bucket only. When the scheduler formed
several buckets (W0 shatters a ragged batch into one bucket per cache length) the spread
leaves out the rows that waited; `rows_cover` says so. A run that a refusal ended early (the
no-strip control) is labelled "refused at step N" wherever its averages are shown, since they
cover only its few steps.
"""

from __future__ import annotations

import json
import textwrap
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from statistics import median

import numpy as np

SUMMARY_SCHEMA = "raggedspec-drift-summary"  # summary.json; traces are "raggedspec-trace"
SUMMARY_VERSION = 1
ROW_REQUIRED = ("seq", "own_len")


class TraceFormatError(ValueError):
    """The trace cannot be read at all: not JSONL/CSV, or a required field is missing.
    The message names the file, the step and the field."""


class MissingField(ValueError):
    """An optional field one diagnostic needs is absent; the message names the field."""


@dataclass
class TraceData:
    """A trace as plain schema-v1 dicts: `steps` are the step objects in order."""

    label: str
    steps: list[dict]
    header: dict | None = None
    summary: dict | None = None
    source: str = ""
    notes: list[str] = field(default_factory=list)
    control: list[dict] | None = None  # the §17.3 no-strip control drawn in this run's panel


# ----------------------------------------------------------------------------- reading


def _check_step(step: Mapping, where: str) -> None:
    if step.get("step") is None:
        raise TraceFormatError(f"{where}: step object has no `step` field (required)")
    if "rows" not in step or not isinstance(step["rows"], list):
        raise TraceFormatError(f"{where}: step {step['step']} has no `rows` list (required)")
    for r in step["rows"]:
        for name in ROW_REQUIRED:
            if name not in r or r[name] is None:
                raise TraceFormatError(
                    f"{where}: step {step['step']} has a row without `rows[].{name}` (required)")


def read_trace_file(path: str | Path, label: str | None = None) -> TraceData:
    """Read a schema-v1 trace file (JSONL, or CSV when the name ends in .csv) with
    `reference.trace.read_trace`, then check the required fields (`step`, `rows[].seq`,
    `rows[].own_len`); optional fields may be absent. Raises TraceFormatError naming the
    file and the field."""
    from raggedspec.reference.trace import read_trace

    path = Path(path)
    if not path.is_file():
        raise TraceFormatError(f"trace file {path} does not exist")
    try:
        data = as_trace_data(read_trace(path), label or path.stem, where=str(path))
    except TraceFormatError:
        raise
    except (ValueError, KeyError) as exc:
        what = f"no `{exc.args[0]}` column" if isinstance(exc, KeyError) else str(exc)
        raise TraceFormatError(f"{path}: not a schema-v1 trace ({what})") from None
    if not any(s["rows"] for s in data.steps):
        raise TraceFormatError(f"{path}: no step has any rows (`rows` is empty or absent on every "
                               "step line), so there is nothing to plot")
    data.source = str(path)
    return data


def as_trace_data(trace, label: str | None = None, where: str = "trace") -> TraceData:
    """Accept a TraceData, a trace file path, a list of schema step dicts, or the
    simulator's `reference.trace.Trace`; check the required fields."""
    if isinstance(trace, TraceData):
        return trace
    if isinstance(trace, (str, Path)):
        return read_trace_file(trace, label)
    if isinstance(trace, list):
        steps, header, summary = trace, None, None
    else:
        steps, header, summary = list(trace.steps()), trace.header, trace.summary
    for i, s in enumerate(steps):
        _check_step(s, f"{where}, step object {i}")
    return TraceData(label or "trace", steps, header, summary, "" if isinstance(trace, list) else "simulator")


# ---------------------------------------------------------------------- data functions


LENGTH_PHASES = (None, "decode", "defer")
VERIFY_PHASES = (None, "decode")


def measured_steps(steps: Iterable[dict]) -> list[dict]:
    """Steps that ran on the batched cache, whose rows carry leads: phase "decode" or
    "defer" when the step has a phase (null counts as absent), every step otherwise; steps
    without rows are dropped. Spread, padding, groups and buckets are read on these."""
    return [s for s in steps if s["rows"] and s.get("phase") in LENGTH_PHASES]


def verify_steps(steps: Iterable[dict]) -> list[dict]:
    """Steps that verify drafts: phase "decode" (or no phase), with rows. Acceptance
    (per-position, drafting fraction, tok_per_step from rows) is read on these."""
    return [s for s in steps if s["rows"] and s.get("phase") in VERIFY_PHASES]


@dataclass
class SpreadBand:
    """Per measured step: min / median / max over rows of own_len - batch minimum, plus
    each sequence's own spread line (seq -> (steps, spreads))."""

    step: np.ndarray
    lo: np.ndarray
    mid: np.ndarray
    hi: np.ndarray
    rows: dict[int, tuple[list[int], list[int]]]

    @property
    def max_spread(self) -> int:
        return int(self.hi.max()) if len(self.hi) else 0


def spread_band(steps: Iterable[dict]) -> SpreadBand:
    """own_len - min(own_len) per row, reduced to a band per measured step."""
    xs, lo, mid, hi = [], [], [], []
    rows: dict[int, tuple[list[int], list[int]]] = {}
    for s in measured_steps(steps):
        lens = [int(r["own_len"]) for r in s["rows"]]
        base = min(lens)
        spread = [n - base for n in lens]
        xs.append(int(s["step"]))
        lo.append(min(spread))
        mid.append(median(spread))
        hi.append(max(spread))
        for r, d in zip(s["rows"], spread):
            line = rows.setdefault(int(r["seq"]), ([], []))
            line[0].append(int(s["step"]))
            line[1].append(d)
    return SpreadBand(np.array(xs, dtype=np.int64), np.array(lo, dtype=float),
                      np.array(mid, dtype=float), np.array(hi, dtype=float), rows)


def no_strip_control(steps: Iterable[dict]) -> list[dict]:
    """The §17.3 negative control built from a stripped per-sequence run: the same per-step
    advance, but each row records the aligned width as its length (no dead-prefix strip), so
    `len_i' = max_j len_j + adv_i` over the step's rows (§17.3: set_len(live - n + adv) with
    live = aligned width + n). adv_i is the row's own-length growth to its next measured step;
    a row enters the control at its own length. Returns step dicts with only `step` and the
    rows' `seq` and `own_len` (the control's lengths)."""
    ms = measured_steps(steps)
    seen: dict[int, list[int]] = {}
    for s in ms:
        for r in s["rows"]:
            seen.setdefault(int(r["seq"]), []).append(int(r["own_len"]))
    cursor = {q: 0 for q in seen}
    ctl: dict[int, int] = {}
    out = []
    for s in ms:
        seqs = [int(r["seq"]) for r in s["rows"]]
        for q, r in zip(seqs, s["rows"]):
            ctl.setdefault(q, int(r["own_len"]))
        out.append({"step": s["step"], "rows": [{"seq": q, "own_len": ctl[q]} for q in seqs]})
        top = max(ctl[q] for q in seqs)
        for q in seqs:
            k = cursor[q]
            if k + 1 < len(seen[q]):
                ctl[q] = top + seen[q][k + 1] - seen[q][k]
            cursor[q] = k + 1
    return out


def failures(steps: Iterable[dict]) -> list[tuple[int, str]]:
    """(step, message) of every step whose optional `error` field is set."""
    return [(int(s["step"]), str(s["error"])) for s in steps if s.get("error")]


def refused_at(steps: Iterable[dict]) -> tuple[int, str, bool] | None:
    """(step, message, ended) of the run's first failed step, or None; `ended` is true when
    no measured step follows the last failure: a refusal ended the run, so its averages
    cover only the steps before it."""
    steps = list(steps)
    failed = failures(steps)
    if not failed:
        return None
    last_fail = failed[-1][0]
    ended = not any(int(s["step"]) > last_fail for s in measured_steps(steps))
    return failed[0][0], failed[0][1], ended


def rows_cover(steps: Iterable[dict]) -> str:
    """What a step's rows cover: "every running sequence" when no measured step's scheduler
    formed more than one bucket; "running bucket only ..." when some did (their rows leave
    out the sequences waiting in the other buckets, e.g. W0 shattering a ragged batch);
    "unknown ..." when the trace has no `buckets` field."""
    ms = measured_steps(steps)
    if any(s.get("buckets") is None for s in ms):
        return "unknown: the trace has no `buckets` field, so rows may be one bucket of several"
    split = sum(int(s["buckets"]) > 1 for s in ms)
    if not split:
        return "every running sequence"
    return (f"running bucket only: on {split} of {len(ms)} measured steps the scheduler formed several buckets "
            "(W0: one per cache length) and ran one; rows waiting in the others are not measured")


def pick_row_lines(band: SpreadBand, n: int = 3) -> list[int]:
    """Sequences worth drawing as lines: the one reaching the largest spread, then the
    longest-lived others (ties by seq id), n in all."""
    if not band.rows:
        return []
    by_peak = max(band.rows, key=lambda q: (max(band.rows[q][1]), -q))
    rest = sorted((q for q in band.rows if q != by_peak), key=lambda q: (-len(band.rows[q][0]), q))
    return [by_peak] + rest[: n - 1]


def _need_step_field(steps: list[dict], name: str) -> None:
    for s in steps:
        if s.get(name) is None:
            raise MissingField(f"step field `{name}` is missing (first at step {s['step']})")


def _need_row_field(steps: list[dict], name: str) -> None:
    for s in steps:
        for r in s["rows"]:
            if r.get(name) is None:
                raise MissingField(f"row field `rows[].{name}` is missing (first at step {s['step']})")


def step_series(steps: Iterable[dict], name: str) -> tuple[np.ndarray, np.ndarray]:
    """(steps, values) of one step field over the measured steps; MissingField if absent."""
    ms = measured_steps(steps)
    _need_step_field(ms, name)
    return (np.array([s["step"] for s in ms], dtype=np.int64),
            np.array([s[name] for s in ms], dtype=float))


def tok_per_step(trace: TraceData) -> float:
    """Committed tokens per row-step of decode: the summary's value when the trace has a
    summary line, else the last measured step's cumulative `tok_per_step`, else computed
    from `rows[].committed`."""
    if trace.summary and trace.summary.get("tok_per_step") is not None:
        return float(trace.summary["tok_per_step"])
    ms = verify_steps(trace.steps)
    if ms and ms[-1].get("tok_per_step") is not None:
        return float(ms[-1]["tok_per_step"])
    _need_row_field(ms, "committed")
    row_steps = sum(len(s["rows"]) for s in ms)
    return sum(r["committed"] for s in ms for r in s["rows"]) / row_steps if row_steps else 0.0


@dataclass
class PerPosition:
    """Counts over decode row-steps, per draft position j (0 = first draft)."""

    drafted_beyond: list[int]   # #(d > j)
    accepted_beyond: list[int]  # #(a > j)  (= the marker's accepted_at[j])
    reached_at: list[int]       # #(min(a + 1, d) > j)  (the marker's reached_at[j])

    @property
    def p(self) -> list[float | None]:
        """p_j = accepted beyond j / drafted beyond j."""
        return [a / d if d else None for a, d in zip(self.accepted_beyond, self.drafted_beyond)]

    @property
    def p_pos(self) -> list[float | None]:
        """The MTP marker's conditional rate accepted_at[j] / reached_at[j] (§15)."""
        return [a / r if r else None for a, r in zip(self.accepted_beyond, self.reached_at)]


def per_position_acceptance(steps: Iterable[dict]) -> PerPosition:
    """Per-position acceptance over the decode steps; needs rows[].drafted, .accepted."""
    ms = verify_steps(steps)
    _need_row_field(ms, "drafted")
    _need_row_field(ms, "accepted")
    pairs = [(int(r["drafted"]), int(r["accepted"])) for s in ms for r in s["rows"]]
    depth = max((d for d, _ in pairs), default=0)
    return PerPosition([sum(d > j for d, _ in pairs) for j in range(depth)],
                       [sum(a > j for _, a in pairs) for j in range(depth)],
                       [sum(min(a + 1, d) > j for d, a in pairs) for j in range(depth)])


def drafting_fraction(steps: Iterable[dict]) -> float:
    """Fraction of decode row-steps that drafted (rows[].drafted > 0)."""
    ms = verify_steps(steps)
    _need_row_field(ms, "drafted")
    n = sum(len(s["rows"]) for s in ms)
    return sum(r["drafted"] > 0 for s in ms for r in s["rows"]) / n if n else 0.0


def _stats(values: np.ndarray) -> dict:
    return {"min": int(values.min()), "mean": round(float(values.mean()), 4), "max": int(values.max())}


def summarize(trace: TraceData) -> dict:
    """The summary JSON entry of one run; a diagnostic whose field is missing is reported
    under "missing" with the field's name instead of a value."""
    ms = measured_steps(trace.steps)
    band = spread_band(trace.steps)
    out: dict = {"label": trace.label, "source": trace.source or "in memory",
                 "steps": len(trace.steps), "measured_steps": len(ms),
                 "decode_steps": len(verify_steps(trace.steps)),
                 "rows_max": max((len(s["rows"]) for s in ms), default=0),
                 "max_spread": band.max_spread,
                 "final_max_spread": int(band.hi[-1]) if len(band.hi) else 0,
                 "rows_cover": rows_cover(trace.steps)}
    missing = []

    def attempt(key, fn):
        try:
            out[key] = fn()
        except MissingField as exc:
            out[key] = None
            missing.append(f"{key}: {exc}")

    attempt("mean_padding_fraction",
            lambda: round(float(step_series(trace.steps, "padding_fraction")[1].mean()), 6) if ms else 0.0)
    attempt("tok_per_step", lambda: round(tok_per_step(trace), 6))
    attempt("drafting_fraction", lambda: round(drafting_fraction(trace.steps), 6))
    failed = failures(trace.steps)
    out["failed_steps"] = len(failed)
    out["first_failure"] = failed[0][1] if failed else None
    ref = refused_at(trace.steps)
    out["refused_at_step"] = None if ref is None else ref[0]
    out["ended_by_refusal"] = bool(ref and ref[2])
    if trace.control:
        out["no_strip_control_max_spread"] = spread_band(trace.control).max_spread
    attempt("groups", lambda: _stats(step_series(trace.steps, "groups")[1]) if ms else None)
    attempt("buckets", lambda: _stats(step_series(trace.steps, "buckets")[1]) if ms else None)

    def pp():
        p = per_position_acceptance(trace.steps)
        return {"p": [None if x is None else round(x, 6) for x in p.p],
                "p_pos": [None if x is None else round(x, 6) for x in p.p_pos],
                "drafted_beyond": p.drafted_beyond, "accepted_beyond": p.accepted_beyond,
                "reached_at": p.reached_at}

    attempt("per_position", pp)
    out["missing"] = missing
    out["notes"] = trace.notes + _failure_notes(trace)
    return out


# ------------------------------------------------------------------- from a scenario

# The built-in scenario of `raggedspec drift` (keys: docs/simulator.md): 32 sequences with
# equal prompts (so any spread is drift, not admission) and 300..600 new tokens (so the
# running set shrinks as they finish), depth 3, geometric acceptance 0.7, the WB world, and
# an unbounded draft-KV map (arc keeps 64: above B = 64 rows would stop drafting for that
# reason alone, which would hide the advance rules' difference in the sweep).
# DRIFT_RUNS add what per-sequence advance needs to be granted (the flags and ragged
# admission, cache-and-draft §13); the cohort run keeps the same settings.
DEFAULT_SCENARIO = {"batch": 32, "prompt_len": 64, "max_new_tokens": [300, 600],
                    "arrival": "all-at-once", "depth": 3, "acceptance": "geometric:0.7",
                    "world": "WB", "max_draft_kv_seqs": None, "steps": 250, "seed": 0}
CAPABLE = {"admission": "grant", "xs_per_seq": True}
DRIFT_RUNS = (
    ("cohort advance", {"advance": "cohort", "strip": "eager"} | CAPABLE),
    ("per-sequence advance, dead prefix stripped", {"advance": "per-sequence", "strip": "eager"} | CAPABLE),
    ("per-sequence, no strip (negative control)", {"advance": "per-sequence", "strip": "none"} | CAPABLE),
)
SWEEP_BATCHES = (1, 2, 4, 8, 16, 32, 64, 128)


def override_list(overrides) -> list[str]:
    """Overrides as load_scenario's "key=value" strings: a dict's values JSON-encoded, a
    list kept as is, None empty. Later entries win."""
    if not overrides:
        return []
    if isinstance(overrides, Mapping):
        return [f"{k}={json.dumps(v)}" for k, v in overrides.items()]
    return list(overrides)


def simulate(scenario=None, overrides=None, mode: str = "lengths", progress=None, backend=None):
    """Run the simulator on a scenario (file, dict or None for the defaults) plus overrides
    (a dict or "key=value" strings); returns its `reference.trace.Trace`. ScenarioError
    names a bad key. `backend` (a `raggedspec.reference.backend.Backend`) is for the tensor mode only."""
    from raggedspec.reference.scenario import load_scenario

    sc = load_scenario(scenario, override_list(overrides))
    if mode == "lengths":
        if backend is not None:
            raise ValueError("a backend applies to --mode tensor only (lengths mode has no tensors)")
        from raggedspec.reference.lengths import run
        return run(sc, progress=progress)
    if mode == "tensor":
        from raggedspec.reference.simulator import run
        return run(sc, progress=progress, backend=backend)
    raise ValueError(f"mode {mode!r} must be lengths or tensor")


def _refusal_note(data: TraceData, requested: str) -> None:
    refusal = (data.summary or {}).get("refusal")
    if refusal and requested == "per-sequence":
        data.notes.append(f"per-sequence advance was refused, so this run used the cohort rule: {refusal}")
    elif refusal:
        data.notes.append(f"refusal: {refusal}")


def _progress(progress, label: str):
    return progress(label) if progress else None


def _close(bar) -> None:
    if bar is not None and hasattr(bar, "close"):
        bar.close()


def scenario_runs(scenario=None, overrides=None, progress=None) -> list[TraceData]:
    """The three drift runs of one scenario (DRIFT_RUNS), in lengths mode. `progress` is
    None or a factory label -> callable(done, total) (with an optional close())."""
    source = DEFAULT_SCENARIO if scenario is None else scenario
    runs = []
    for label, extra in DRIFT_RUNS:
        bar = _progress(progress, label)
        try:
            trace = simulate(source, override_list(overrides) + override_list(extra), progress=bar)
        finally:
            _close(bar)
        data = as_trace_data(trace, label)
        _refusal_note(data, extra["advance"])
        world = ((data.header or {}).get("scenario") or {}).get("world")
        if extra["advance"] == "per-sequence" and world != "WB":
            data.notes.append(f"world {world}: `In` only when the batch changes (and, in W0, one bucket "
                              "per cache length), so a stable batch skips the per-sequence commit "
                              "(cache-and-draft §13, why admission refuses); world WB admits ragged "
                              "cohorts.")
        runs.append(data)
    runs[2].control = no_strip_control(runs[1].steps)
    runs[2].notes.insert(0, "Simulator, strip = none: each row records the padded width as its own "
                            "length, so the rows converge (spread at most w - 1) and soon claim more "
                            "cache than they have tokens.")
    return runs


def sweep_tok_per_step(scenario=None, overrides=None,
                       batches: Iterable[int] = SWEEP_BATCHES, progress=None) -> dict:
    """tok_per_step of the cohort run and of the per-sequence (stripped) run at each batch
    size (the scenario's `batch` key), in lengths mode. Per label and batch it also keeps
    the share of decode row-steps that drafted, why rows that could draft did not
    (`stalls`: row-step counts by reason, from the lengths engine, `reference.lengths`
    STALL_*) and the step of the first failure (`refused_at`, None when none failed)."""
    source = DEFAULT_SCENARIO if scenario is None else scenario
    batches = list(batches)
    result = {"batch": batches, "tok_per_step": {}, "drafting_fraction": {}, "stalls": {}, "refused_at": {},
              "refusal": {}}
    bar = _progress(progress, "tok_per_step sweep")
    total, done = 2 * len(batches), 0
    try:
        for label, extra in DRIFT_RUNS[:2]:
            values, drafting, stalls, refused = [], [], [], []
            for b in batches:
                trace = simulate(source, override_list(overrides) + override_list(extra | {"batch": b}))
                steps = list(trace.steps())
                values.append(round(float(trace.summary["tok_per_step"]), 6))
                drafting.append(round(drafting_fraction(steps), 6))
                stalls.append({k: v for k, v in (getattr(trace, "draft_stalls", None) or {}).items() if v})
                ref = refused_at(steps)
                refused.append(None if ref is None else ref[0])
                if trace.summary.get("refusal"):
                    result["refusal"][f"{label}, B={b}"] = trace.summary["refusal"]
                done += 1
                if bar:
                    bar(done, total)
            result["tok_per_step"][label] = values
            result["drafting_fraction"][label] = drafting
            result["stalls"][label] = stalls
            result["refused_at"][label] = refused
    finally:
        _close(bar)
    return result


def drift_from_scenario(scenario, out_dir: str | Path, overrides=None,
                        batches: Iterable[int] = SWEEP_BATCHES, progress=None) -> dict:
    """Simulate the three drift runs and the batch sweep of a scenario (None: the built-in
    one) and write the report. A scenario that lists its requests explicitly has no batch
    key to sweep: the sweep is skipped and the summary says so."""
    from raggedspec.reference.scenario import load_scenario

    runs = scenario_runs(scenario, overrides, progress)
    notes, sweep = [], None
    batches = list(batches)
    explicit = scenario is not None and "requests" in load_scenario(scenario, override_list(overrides)).to_dict()
    if batches and explicit:
        notes.append("tok_per_step sweep skipped: the scenario lists its requests, so there is no "
                     "`batch` key to sweep")
    elif batches:
        sweep = sweep_tok_per_step(scenario, overrides, batches, progress)
    return write_report(runs, out_dir, sweep, notes)


# ------------------------------------------------------------------------------ figures

FIGURE_NAMES = ("spread", "padding", "groups_buckets", "tok_per_step_vs_batch", "per_position")


def _new_figure(width: float, height: float, rows: int = 1, cols: int = 1, **kw):
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), layout="constrained")
    axes = fig.subplots(rows, cols, squeeze=False, **kw)
    return fig, axes


def _say_missing(ax, label: str, exc: Exception) -> None:
    ax.text(0.5, 0.5, f"{label}: not plotted\n{exc}", ha="center", va="center", wrap=True,
            transform=ax.transAxes, fontsize=9, color="0.3",
            bbox=dict(boxstyle="round", fc="0.95", ec="0.7"))


def _style(i: int) -> dict:
    """Run i's line style: colour, dash and marker differ, and earlier runs are drawn wider,
    so runs whose lines coincide stay visible."""
    return dict(color=f"C{i}", ls=("-", "--", ":", "-.")[i % 4], marker="osD^"[i % 4],
                lw=max(2.6 - 0.8 * i, 1.0), ms=4, markevery=0.1)


def _failure_notes(run: TraceData) -> list[str]:
    failed = failures(run.steps)
    if not failed:
        return []
    step, msg = failed[0]
    short = msg if len(msg) <= 100 else msg[:99] + "…"
    ref = refused_at(run.steps)
    tail = ""
    if ref and ref[2]:
        tail = (f"; no step ran after it, so this run's averages cover only its "
                f"{len(measured_steps(run.steps))} measured steps")
    return [f"{len(failed)} step(s) failed their requests; the first, at step {step}, reported: {short}{tail}"]


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
        lines.append(f"{who} refused at step {ref[0]} ({short})" if k == 1 else
                     f"{who}: {k} steps refused, the first at step {ref[0]} ({short})")
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

    handles = [tuple(Patch(color=f"C{i}", alpha=0.3) for i in range(n)),
               tuple(Line2D([], [], color=f"C{i}", lw=1.8) for i in range(n)),
               tuple(Line2D([], [], color=f"C{i}", lw=1.4, ls="--") for i in range(n)),
               Line2D([], [], color=ROW_LINE["color"], lw=ROW_LINE["lw"], ls=ROW_LINE["ls"])]
    labels = ["band: min to max over the step's rows", "max over rows", "median over rows",
              "three individual sequences (largest spread, longest lived)"]
    return handles, labels


ROW_LINE = dict(color="0.3", lw=0.9, ls=(0, (1, 1.5)), zorder=2)  # individual sequences: under the max line


def figure_spread(runs: list[TraceData]):
    """One panel per run: the band min..max of own_len - batch min over the rows, the
    max and median lines (the run's colour, drawn on top), and three rows' own lines (thin,
    dotted grey, underneath). A no-strip panel with a `control` draws the §17.3 rule applied
    to the stripped run's advances (computed, not simulated) as a black dotted line."""
    from matplotlib.legend_handler import HandlerTuple

    fig, axes = _new_figure(4.6 * len(runs) + 0.6, 4.9, 1, len(runs), sharey=True)
    for i, (ax, run) in enumerate(zip(axes[0], runs)):
        band = spread_band(run.steps)
        if len(band.step):
            ax.fill_between(band.step, band.lo, band.hi, color=f"C{i}", alpha=0.22, lw=0, zorder=1)
            for q in pick_row_lines(band):
                xs, ys = band.rows[q]
                ax.plot(xs, ys, **ROW_LINE)
            few = dict(marker="o", ms=3) if len(band.step) < 20 else {}  # a run cut short stays visible
            ax.plot(band.step, band.hi, color=f"C{i}", lw=1.8, zorder=3, **few)
            ax.plot(band.step, band.mid, color=f"C{i}", lw=1.4, ls="--", zorder=3)
        if run.control:
            ctl = spread_band(run.control)
            ax.plot(ctl.step, ctl.hi, color="k", lw=1.8, ls=":", zorder=4,
                    label=f"computed, not simulated: §17.3's rule (each row\nrecords the aligned width, "
                          f"len_i' = max_j len_j + adv_i)\napplied to the stripped run's per-step advances:\n"
                          f"max spread, peak {ctl.max_spread} tokens")
            ax.legend(loc="upper right", fontsize=7.5)
        cover = rows_cover(run.steps)
        ax.set_title("\n".join(_title_lines(run, band)), fontsize=9.5)
        ax.set_xlabel("engine step (decode and deferred steps)")
        ax.xaxis.get_major_locator().set_params(integer=True)
        ax.grid(alpha=0.3)
        notes = list(run.notes) + _failure_notes(run)
        if cover.startswith("running bucket"):
            notes.append("Spread of the " + cover[0].lower() + cover[1:] + ".")
        if len(band.step) and band.max_spread == 0:
            msg = ("0 at every step: every running row holds the same length"
                   if not cover.startswith("running bucket") else
                   "0 at every step, but only within the bucket that ran: rows of other lengths waited in "
                   "other buckets")
            if notes:
                notes.insert(0, msg + ".")
            else:
                ax.text(0.5, 0.12, msg, ha="center", transform=ax.transAxes, fontsize=9, color=f"C{i}")
        if notes:
            ax.text(0.03, 0.70 if run.control else 0.97, "\n".join(textwrap.fill(n, 52) for n in notes),
                    transform=ax.transAxes, va="top", fontsize=7.5, zorder=5,
                    bbox=dict(boxstyle="round", fc="lightyellow", ec="0.7"))
    axes[0][0].set_ylabel("own KV length − batch minimum (tokens)")
    axes[0][0].set_ylim(-0.5, max(axes[0][0].get_ylim()[1], 5))
    n = len(runs)
    handles, labels = spread_legend(n)
    fig.legend(handles, labels, loc="outside lower center", ncols=4 if n > 2 else 2, fontsize=8.5,
               frameon=False, handler_map={tuple: HandlerTuple(ndivide=None, pad=0.2)}, handlelength=4)
    fig.suptitle("Length drift: how far each row's own KV-cache length runs ahead of the "
                 "shortest row in its batch (each panel in its own colour)", fontsize=11)
    return fig


def figure_padding(runs: list[TraceData]):
    """Padding fraction (dead columns / all columns of the batched cache) per step; a run a
    refusal ended is labelled so (its mean covers only its few steps)."""
    fig, axes = _new_figure(8, 4.2)
    ax = axes[0][0]
    lost = []
    for i, run in enumerate(runs):
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


def figure_groups_buckets(runs: list[TraceData]):
    """Draft groups (MTP-block forwards per chain step) and scheduler buckets per step. When
    every run's bucket count is one constant value the bottom panel is dropped and a line
    under the figure says so (a flat line explains nothing)."""
    series = {}
    for run in runs:
        try:
            series[run.label] = step_series(run.steps, "buckets")[1]
        except MissingField:
            series[run.label] = None
    consts = {lab: _constant(v) for lab, v in series.items() if v is not None and len(v)}
    flat = bool(consts) and all(c is not None for c in consts.values()) and len(set(consts.values())) == 1 \
        and all(v is not None for v in series.values())
    panels = [("groups", "draft groups per step (count)")]
    if not flat:
        panels.append(("buckets", "scheduler buckets per step (count)"))
    fig, axes = _new_figure(8, 6 if not flat else 4.4, len(panels), 1, sharex=True)
    for (name, what), ax in zip(panels, (a[0] for a in axes)):
        lost = []
        for i, run in enumerate(runs):
            try:
                xs, ys = step_series(run.steps, name)
                if not len(xs):
                    continue
                const = _constant(ys)
                what_run = f"mean {ys.mean():.2f}" if const is None else f"{const:g} at every step"
                ax.step(xs, ys, where="mid", **(_style(i) | {"marker": None}), alpha=0.85,
                        label=_tagged(run.label, run, what_run))
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
    title = ("Draft groups per step: one MTP-block forward each, per chain step\n(cohort: one group per "
             "distinct uncached tail u and chain start; per-sequence: one per distinct u; 0: no row drafted)")
    if not flat:
        title += "\nand scheduler buckets per step (formed before one is selected)"
    axes[0][0].set_title(title, fontsize=9.5)
    axes[-1][0].set_xlabel("engine step (decode and deferred steps)")
    if flat:
        value = next(iter(consts.values()))
        fig.supxlabel(textwrap.fill(
            f"Scheduler buckets per step are not plotted: {value:g} at every measured step in every run"
            + (" (every running sequence was scheduled together in one bucket)." if value == 1 else "."), 110),
            fontsize=8, color="0.3")
    return fig


def _uniform_stall(stalls: dict) -> bool:
    """True when rows stopped drafting mainly because a uniform draft group was refused."""
    from raggedspec.reference.lengths import STALL_UNIFORM

    total = sum(stalls.values()) if stalls else 0
    return bool(total) and stalls.get(STALL_UNIFORM, 0) * 2 > total


def figure_sweep(sweep: dict):
    """tok_per_step against batch size, one line per advance rule. Points where fewer than
    half the decode row-steps drafted are marked; when that is because a uniform draft group
    was refused (§9.6) the first such point gets a plain-language explanation."""
    fig, axes = _new_figure(8.2, 5.6)
    ax = axes[0][0]
    batches = sweep["batch"]
    stalled = explained = False
    for i, (label, values) in enumerate(sweep["tok_per_step"].items()):
        ax.plot(batches, values, **(_style(i) | {"markevery": 1}), label=label)
        fracs = sweep.get("drafting_fraction", {}).get(label, [])
        stalls = sweep.get("stalls", {}).get(label, [{}] * len(batches))
        refused = sweep.get("refused_at", {}).get(label, [None] * len(batches))
        for b, v, f, why, ref in zip(batches, values, fracs, stalls, refused):
            if ref is not None:
                ax.annotate(f"refused at step {ref}", (b, v), textcoords="offset points", xytext=(7, -10),
                            fontsize=7.5, color=f"C{i}")
            if f >= 0.5:
                continue
            if _uniform_stall(why) and not explained:
                explained = True
                rows = "the two rows" if b == 2 else f"{b} rows"
                text = textwrap.fill(
                    f"B = {b}: only {f:.0%} of row-steps drafted. {rows.capitalize()}' draft caches grew at "
                    f"different steps, so their capacities differ; when {rows} meet at equal lengths they form "
                    "a uniform draft group, batch_draft_caches refuses it (cache-and-draft §9.6: equal lengths, "
                    "different capacity histories) and they never draft again. A real arc behaviour the "
                    "simulator exposes, not a simulator fault.", 58)
                ax.annotate(text, (b, v), xytext=(0.30, 0.05), textcoords="axes fraction", fontsize=7.5,
                            va="bottom", color="0.15", arrowprops=dict(arrowstyle="->", color=f"C{i}", lw=1),
                            bbox=dict(boxstyle="round", fc="lightyellow", ec="0.7"))
            else:
                stalled = True
                ax.annotate(f"{f:.0%} drafted", (b, v), textcoords="offset points", xytext=(7, 2),
                            fontsize=7.5, color=f"C{i}")
    ax.set_xscale("log", base=2)
    ax.set_xticks(batches, [str(b) for b in batches])
    ax.set_xlabel("batch size B (sequences running together)")
    ax.set_ylabel("tok_per_step: the MTP accounting ratio (tokens)\ncommitted (1 + accepted per row-step, §15) "
                  "/ decode row-steps", fontsize=9)
    ax.set_title("Tokens per row per decode step vs batch size\n(the cohort rule rolls every row "
                 "back to the batch's shortest accept)", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper right")
    if stalled:
        fig.supxlabel(textwrap.fill(
            "\"x% drafted\": the share of decode row-steps that drafted at all, shown where it is "
            "below 50 %: speculation stalled there.", 110), fontsize=7.5, color="0.3")
    return fig


def figure_per_position(runs: list[TraceData]):
    """Per draft position: P(accepted > j | drafted > j) and the marker's conditional p_pos.
    A run a refusal ended is drawn faded and labelled with how few row-steps it has."""
    fig, axes = _new_figure(10, 5.2, 1, 2, sharey=True)
    titles = ("Of the rows that drafted position j, the fraction\nwhose drafts 1 .. j were all accepted\n"
              "[#(accepted ≥ j) / #(drafted ≥ j)]",
              "Of the drafts that reached position j (drafts 1 .. j−1\naccepted), the fraction accepted\n"
              "[the MTP marker's p_pos = accepted_at / reached_at]")
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
        label = f"{run.label} (refused at step {ref[0]}: only {n} drafting row-steps)" if ended else run.label
        for ax, ys in zip(axes[0], (pp.p, pp.p_pos)):
            ax.plot(xs, [np.nan if y is None else y for y in ys], **(_style(i) | {"markevery": 1}),
                    alpha=0.45 if ended else 0.85, label=label)
    for ax, title in zip(axes[0], titles):
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
        fig.legend(handles, labels, loc="outside lower center", ncols=1 if len(runs) > 2 else len(runs),
                   fontsize=8, frameon=False)
    fig.suptitle("Per-position acceptance over all decode row-steps", fontsize=11)
    return fig


def _save(fig, out_dir: Path, name: str) -> list[str]:
    paths = []
    for ext, meta in (("png", {"Software": None}), ("svg", {"Date": None})):
        path = out_dir / f"{name}.{ext}"
        fig.savefig(path, dpi=100, metadata=meta)
        paths.append(str(path))
    return paths


def write_report(runs: list[TraceData], out_dir: str | Path, sweep: dict | None = None,
                 notes: Iterable[str] = ()) -> dict:
    """Write every figure (PNG and SVG) and summary.json into out_dir; return the summary.
    `sweep` is {"batch": [...], "tok_per_step": {label: [...]}} or None (no sweep figure)."""
    import matplotlib

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    files = []
    with matplotlib.rc_context({"svg.hashsalt": "raggedspec"}):  # reproducible SVG ids
        files += _save(figure_spread(runs), out_dir, "spread")
        files += _save(figure_padding(runs), out_dir, "padding")
        files += _save(figure_groups_buckets(runs), out_dir, "groups_buckets")
        if sweep:
            files += _save(figure_sweep(sweep), out_dir, "tok_per_step_vs_batch")
        files += _save(figure_per_position(runs), out_dir, "per_position")
    summary = {"schema": SUMMARY_SCHEMA, "version": SUMMARY_VERSION, "runs": [summarize(r) for r in runs],
               "sweep": sweep,
               "notes": list(notes), "files": files + [str(out_dir / "summary.json")]}
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary
