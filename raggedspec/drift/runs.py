"""The drift runs of a scenario: three simulated runs (cohort advance, per-sequence advance
with the dead-prefix strip, per-sequence without it: the negative control) and a
tok_per_step sweep over the batch size, all in lengths mode, then the report.

Nothing here recomputes a rule: the runs are the simulator's own traces
(`reference.lengths.run`, or `reference.simulator.run` in tensor mode), read by
`raggedspec.drift.data`, and drawn by `raggedspec.drift.figures`.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path

from raggedspec.drift.data import (
    TraceData,
    as_trace_data,
    drafting_fraction,
    no_strip_control,
    overclaim,
    refused_at,
)
from raggedspec.drift.figures import write_report

# The built-in scenario of `raggedspec drift` (keys: docs/simulator.md): 32 sequences with
# equal prompts (so any spread is drift, not admission) and 300..600 new tokens (so the
# running set shrinks as they finish), depth 3, geometric acceptance 0.7, the WB world, and
# an unbounded draft-KV map (the source engine keeps 64: above B = 64 rows would stop
# drafting for that reason alone, which would hide the advance rules' difference in the
# sweep). DRIFT_RUNS add what per-sequence advance needs to be granted (the flags and ragged
# admission, cache-and-draft §13); the cohort run keeps the same settings.
DEFAULT_SCENARIO = {
    "batch": 32,
    "prompt_len": 64,
    "max_new_tokens": [300, 600],
    "arrival": "all-at-once",
    "depth": 3,
    "acceptance": "geometric:0.7",
    "world": "WB",
    "max_draft_kv_seqs": None,
    "steps": 250,
    "seed": 0,
}
CAPABLE = {"admission": "grant", "xs_per_seq": True}
DRIFT_RUNS = (
    ("cohort advance", {"advance": "cohort", "strip": "eager"} | CAPABLE),
    (
        "per-sequence advance, dead prefix stripped",
        {"advance": "per-sequence", "strip": "eager"} | CAPABLE,
    ),
    (
        "per-sequence, no strip (negative control)",
        {"advance": "per-sequence", "strip": "none"} | CAPABLE,
    ),
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
    names a bad key. `backend` (a `raggedspec.reference.backend.Backend`) is for the tensor mode
    only."""
    from raggedspec.reference.scenario import load_scenario

    sc = load_scenario(scenario, override_list(overrides))
    if mode == "lengths":
        if backend is not None:
            raise ValueError(
                "a backend applies to --mode tensor only (lengths mode has no tensors)"
            )
        from raggedspec.reference.lengths import run

        return run(sc, progress=progress)
    if mode == "tensor":
        from raggedspec.reference.simulator import run

        return run(sc, progress=progress, backend=backend)
    raise ValueError(f"mode {mode!r} must be lengths or tensor")


def _refusal_note(data: TraceData, requested: str) -> None:
    refusal = (data.summary or {}).get("refusal")
    if refusal and requested == "per-sequence":
        data.notes.append(
            f"per-sequence advance was refused, so this run used the cohort rule: {refusal}"
        )
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
            data.notes.append(_world_note(world))
        runs.append(data)
    runs[2].control = no_strip_control(runs[1].steps)
    runs[2].notes.insert(0, _control_note(runs[1].steps, runs[2].control))
    return runs


def _world_note(world: str) -> str:
    """Why a per-sequence run in scheduler world W0 or WA cannot advance per sequence."""
    split = " and puts each cache length in a bucket of its own" if world == "W0" else ""
    return (
        f"Scheduler world {world} hands the engine the batch's cache only when the batch "
        f"changes{split}, so a stable batch skips the per-sequence commit, which is why "
        "admission refuses it; world WB admits sequences of different lengths into one batch."
    )


def _control_note(stripped: list[dict], control: list[dict]) -> str:
    """The negative control's note: what the simulated run did, and what the control band
    computed from the stripped run shows over the whole run."""
    xs, excess = overclaim(stripped, control)
    tail = (
        f" By step {int(xs[-1])} every row records on average {excess[-1]:.0f} tokens "
        f"more than it holds (at most {excess.max():.0f})."
        if len(xs)
        else ""
    )
    return (
        "Without the dead-prefix strip each row records the padded width as its own length: "
        "the rows converge (spread at most the draft depth) and soon record more KV than "
        "they hold tokens, which the engine's left-aligned guard refuses, so the simulated "
        "run stops. The band is the same rule applied to the stripped run's per-step "
        "advances, computed over the whole run." + tail
    )


def sweep_tok_per_step(
    scenario=None, overrides=None, batches: Iterable[int] = SWEEP_BATCHES, progress=None
) -> dict:
    """tok_per_step of the cohort run and of the per-sequence (stripped) run at each batch
    size (the scenario's `batch` key), in lengths mode. Per label and batch it also keeps
    the share of decode row-steps that drafted, why rows that could draft did not
    (`stalls`: row-step counts by reason, from the lengths engine, `reference.lengths`
    STALL_*) and the step of the first failure (`refused_at`, None when none failed)."""
    source = DEFAULT_SCENARIO if scenario is None else scenario
    batches = list(batches)
    result = {
        "batch": batches,
        "tok_per_step": {},
        "drafting_fraction": {},
        "stalls": {},
        "refused_at": {},
        "refusal": {},
    }
    bar = _progress(progress, "tok_per_step sweep")
    total, done = 2 * len(batches), 0
    try:
        for label, extra in DRIFT_RUNS[:2]:
            values, drafting, stalls, refused = [], [], [], []
            for b in batches:
                trace = simulate(
                    source, override_list(overrides) + override_list(extra | {"batch": b})
                )
                steps = list(trace.steps())
                values.append(round(float(trace.summary["tok_per_step"]), 6))
                drafting.append(round(drafting_fraction(steps), 6))
                stalls.append(
                    {k: v for k, v in (getattr(trace, "draft_stalls", None) or {}).items() if v}
                )
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


def drift_from_scenario(
    scenario,
    out_dir: str | Path,
    overrides=None,
    batches: Iterable[int] = SWEEP_BATCHES,
    progress=None,
) -> dict:
    """Simulate the three drift runs and the batch sweep of a scenario (None: the built-in
    one) and write the report. A scenario that lists its requests explicitly has no batch
    key to sweep: the sweep is skipped and the summary says so."""
    from raggedspec.reference.scenario import load_scenario

    runs = scenario_runs(scenario, overrides, progress)
    notes, sweep = [], None
    batches = list(batches)
    resolved = load_scenario(
        DEFAULT_SCENARIO if scenario is None else scenario, override_list(overrides)
    ).to_dict()
    explicit = scenario is not None and "requests" in resolved
    if batches and explicit:
        notes.append(
            "tok_per_step sweep skipped: the scenario lists its requests, so there is no "
            "`batch` key to sweep"
        )
    elif batches:
        sweep = sweep_tok_per_step(scenario, overrides, batches, progress)
    return write_report(runs, out_dir, sweep, notes, scenario=resolved)
