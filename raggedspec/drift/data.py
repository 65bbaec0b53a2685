"""Length-drift diagnostics: what happens to the rows' KV-cache lengths, step after step.

Input is a trace in schema v1 (docs/trace.md), the simulator's own or any engine's; only
`step`, `rows[].seq` and `rows[].own_len` are required, and every quantity comes straight
from the trace (nothing recomputes a rule). The quantities, which steps count and the
coverage labels: docs/simulator.md, section "raggedspec/drift/data.py".
"""

from __future__ import annotations

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


STEP_NUMBERS = ("padding_fraction", "tok_per_step")  # optional step fields drift reads: numbers
STEP_COUNTS = ("buckets", "groups")  # optional step fields drift reads: integers
ROW_COUNTS = ("drafted", "accepted", "committed")  # optional row fields drift reads: integers


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return (
        isinstance(v, (int, float))
        and not isinstance(v, bool)
        and v == v
        and abs(v) != float("inf")
    )


def _check_step(step: Mapping, where: str) -> None:
    """Refuse (TraceFormatError naming `where`, the field, the value and what is allowed) a
    step object without an integer `step`, a `rows` list of objects with integer `seq` and
    `own_len`, or with an optional field drift reads of the wrong type. Absent optional
    fields are fine: the diagnostics that need them say so instead."""
    if not isinstance(step, Mapping):
        raise TraceFormatError(f"{where}: a step must be an object, got {step!r:.60}")
    if step.get("step") is None:
        raise TraceFormatError(f"{where}: step object has no `step` field (required)")
    if not _is_int(step["step"]):
        raise TraceFormatError(f"{where}: field `step` = {step['step']!r:.60}: must be an integer")
    if "rows" not in step or not isinstance(step["rows"], list):
        raise TraceFormatError(f"{where}: step {step['step']} has no `rows` list (required)")
    if step.get("phase") is not None and not isinstance(step["phase"], str):
        raise TraceFormatError(
            f"{where}: step {step['step']} field `phase` = {step['phase']!r:.60}: "
            "must be a string or null"
        )
    for name, ok, allowed in [(n, _is_number, "a finite number or null") for n in STEP_NUMBERS] + [
        (n, _is_int, "an integer or null") for n in STEP_COUNTS
    ]:
        if step.get(name) is not None and not ok(step[name]):
            raise TraceFormatError(
                f"{where}: step {step['step']} field `{name}` = {step[name]!r:.60}: "
                f"must be {allowed}"
            )
    for r in step["rows"]:
        if not isinstance(r, Mapping):
            raise TraceFormatError(
                f"{where}: step {step['step']} has a row that is not an object: {r!r:.60}"
            )
        for name in ROW_REQUIRED:
            if name not in r or r[name] is None:
                raise TraceFormatError(
                    f"{where}: step {step['step']} has a row without `rows[].{name}` (required)"
                )
            if not _is_int(r[name]):
                raise TraceFormatError(
                    f"{where}: step {step['step']} field `rows[].{name}` = {r[name]!r:.60}: "
                    "must be an integer"
                )
        for name in ROW_COUNTS:
            if r.get(name) is not None and not _is_int(r[name]):
                raise TraceFormatError(
                    f"{where}: step {step['step']} field `rows[].{name}` = "
                    f"{r[name]!r:.60}: must be an integer or null"
                )


def read_trace_file(path: str | Path, label: str | None = None) -> TraceData:
    """Read a schema-v1 trace file (JSONL, or CSV when the name ends in .csv) with the strict
    reader `reference.trace_reader.read_trace_strict` (every schema problem, FILE:LINE), then
    check the fields drift reads (`step`, `rows[].seq`, `rows[].own_len` required; the optional
    ones typed when present). Raises TraceFormatError naming the file, the step object and the
    field; never anything else for a file's content."""
    from raggedspec.reference.trace_reader import TraceError, read_trace_strict

    path = Path(path)
    if not path.is_file():
        raise TraceFormatError(f"trace file {path} does not exist")
    try:
        trace = read_trace_strict(path, int_ids=True)
    except TraceError as exc:  # every schema problem, each FILE:LINE
        raise TraceFormatError(str(exc)) from None
    except UnicodeDecodeError as exc:
        raise TraceFormatError(
            f"{path}: not a text file in UTF-8 (byte {exc.start}: {exc.reason})"
        ) from None
    except (ValueError, KeyError, TypeError, AttributeError, IndexError) as exc:
        what = (
            f"no `{exc.args[0]}` column"
            if isinstance(exc, KeyError)
            else f"{type(exc).__name__}: {exc}"
        )
        raise TraceFormatError(f"{path}: not a schema-v1 trace ({what:.200})") from None
    summary = trace.summary
    if summary is not None and (
        not isinstance(summary, Mapping)
        or (summary.get("tok_per_step") is not None and not _is_number(summary["tok_per_step"]))
    ):
        raise TraceFormatError(
            f"{path}: summary line field `tok_per_step` must be a finite number or null"
        )
    try:
        data = as_trace_data(trace, label or path.stem, where=str(path))
    except TraceFormatError:
        raise
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise TraceFormatError(
            f"{path}: not a schema-v1 trace ({type(exc).__name__}: {exc!s:.200})"
        ) from None
    if not any(s["rows"] for s in data.steps):
        raise TraceFormatError(
            f"{path}: no step has any rows (`rows` is empty or absent on every "
            "step line), so there is nothing to plot"
        )
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
        _check_step(s, f"{where}, step object {i + 1}")
    return TraceData(
        label or "trace", steps, header, summary, "" if isinstance(trace, list) else "simulator"
    )


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
        for r, d in zip(s["rows"], spread, strict=True):
            line = rows.setdefault(int(r["seq"]), ([], []))
            line[0].append(int(s["step"]))
            line[1].append(d)
    return SpreadBand(
        np.array(xs, dtype=np.int64),
        np.array(lo, dtype=float),
        np.array(mid, dtype=float),
        np.array(hi, dtype=float),
        rows,
    )


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
        for q, r in zip(seqs, s["rows"], strict=True):
            ctl.setdefault(q, int(r["own_len"]))
        out.append({"step": s["step"], "rows": [{"seq": q, "own_len": ctl[q]} for q in seqs]})
        top = max(ctl[q] for q in seqs)
        for q in seqs:
            k = cursor[q]
            if k + 1 < len(seen[q]):
                ctl[q] = top + seen[q][k + 1] - seen[q][k]
            cursor[q] = k + 1
    return out


def overclaim(steps: Iterable[dict], control: list[dict]) -> tuple[np.ndarray, np.ndarray]:
    """(steps, mean excess) of a no-strip control against the run it was built from: at each
    control step, the mean over its rows of the control's recorded length minus the row's own
    length in `steps` (the tokens a row would claim without holding them; 0 when they agree)."""
    own = {(int(s["step"]), int(r["seq"])): int(r["own_len"]) for s in steps for r in s["rows"]}
    xs, ys = [], []
    for s in control:
        diffs = [r["own_len"] - own[(int(s["step"]), int(r["seq"]))] for r in s["rows"]]
        xs.append(int(s["step"]))
        ys.append(sum(diffs) / len(diffs) if diffs else 0.0)
    return np.array(xs, dtype=np.int64), np.array(ys, dtype=float)


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
    return (
        f"running bucket only: on {split} of {len(ms)} measured steps the scheduler formed "
        "several buckets "
        "(W0: one per cache length) and ran one; rows waiting in the others are not measured"
    )


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
                raise MissingField(
                    f"row field `rows[].{name}` is missing (first at step {s['step']})"
                )


def step_series(steps: Iterable[dict], name: str) -> tuple[np.ndarray, np.ndarray]:
    """(steps, values) of one step field over the measured steps; MissingField if absent."""
    ms = measured_steps(steps)
    _need_step_field(ms, name)
    return (
        np.array([s["step"] for s in ms], dtype=np.int64),
        np.array([s[name] for s in ms], dtype=float),
    )


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

    drafted_beyond: list[int]  # #(d > j)
    accepted_beyond: list[int]  # #(a > j)  (= the marker's accepted_at[j])
    reached_at: list[int]  # #(min(a + 1, d) > j)  (the marker's reached_at[j])

    @property
    def p(self) -> list[float | None]:
        """p_j = accepted beyond j / drafted beyond j."""
        pairs = zip(self.accepted_beyond, self.drafted_beyond, strict=True)
        return [a / d if d else None for a, d in pairs]

    @property
    def p_pos(self) -> list[float | None]:
        """The conditional rate accepted_at[j] / reached_at[j]: of the drafts that reached
        position j, the fraction accepted (the acceptance log's per-position rate, §15)."""
        pairs = zip(self.accepted_beyond, self.reached_at, strict=True)
        return [a / r if r else None for a, r in pairs]


def per_position_acceptance(steps: Iterable[dict]) -> PerPosition:
    """Per-position acceptance over the decode steps; needs rows[].drafted, .accepted."""
    ms = verify_steps(steps)
    _need_row_field(ms, "drafted")
    _need_row_field(ms, "accepted")
    pairs = [(int(r["drafted"]), int(r["accepted"])) for s in ms for r in s["rows"]]
    depth = max((d for d, _ in pairs), default=0)
    return PerPosition(
        [sum(d > j for d, _ in pairs) for j in range(depth)],
        [sum(a > j for _, a in pairs) for j in range(depth)],
        [sum(min(a + 1, d) > j for d, a in pairs) for j in range(depth)],
    )


def drafting_fraction(steps: Iterable[dict]) -> float:
    """Fraction of decode row-steps that drafted (rows[].drafted > 0)."""
    ms = verify_steps(steps)
    _need_row_field(ms, "drafted")
    n = sum(len(s["rows"]) for s in ms)
    return sum(r["drafted"] > 0 for s in ms for r in s["rows"]) / n if n else 0.0


def _failure_notes(run: TraceData) -> list[str]:
    failed = failures(run.steps)
    if not failed:
        return []
    step, msg = failed[0]
    short = msg if len(msg) <= 100 else msg[:99] + "…"
    ref = refused_at(run.steps)
    tail = ""
    if ref and ref[2]:
        tail = (
            "; no step ran after it, so this run's averages cover only its "
            f"{len(measured_steps(run.steps))} measured steps"
        )
    return [
        f"{len(failed)} step(s) failed their requests; the first, at step {step}, reported: "
        f"{short}{tail}"
    ]


def _stats(values: np.ndarray) -> dict:
    return {
        "min": int(values.min()),
        "mean": round(float(values.mean()), 4),
        "max": int(values.max()),
    }


def summarize(trace: TraceData) -> dict:
    """The summary JSON entry of one run; a diagnostic whose field is missing is reported
    under "missing" with the field's name instead of a value."""
    ms = measured_steps(trace.steps)
    band = spread_band(trace.steps)
    out: dict = {
        "label": trace.label,
        "source": trace.source or "in memory",
        "steps": len(trace.steps),
        "measured_steps": len(ms),
        "decode_steps": len(verify_steps(trace.steps)),
        "rows_max": max((len(s["rows"]) for s in ms), default=0),
        "max_spread": band.max_spread,
        "final_max_spread": int(band.hi[-1]) if len(band.hi) else 0,
        "rows_cover": rows_cover(trace.steps),
    }
    missing = []

    def attempt(key, fn):
        try:
            out[key] = fn()
        except MissingField as exc:
            out[key] = None
            missing.append(f"{key}: {exc}")

    attempt(
        "mean_padding_fraction",
        lambda: (
            round(float(step_series(trace.steps, "padding_fraction")[1].mean()), 6) if ms else 0.0
        ),
    )
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
        return {
            "p": [None if x is None else round(x, 6) for x in p.p],
            "p_pos": [None if x is None else round(x, 6) for x in p.p_pos],
            "drafted_beyond": p.drafted_beyond,
            "accepted_beyond": p.accepted_beyond,
            "reached_at": p.reached_at,
        }

    attempt("per_position", pp)
    out["missing"] = missing
    out["notes"] = trace.notes + _failure_notes(trace)
    return out
