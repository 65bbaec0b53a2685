"""Replay a trace through the reference lengths simulator and find where they part.

The scenario (the trace header's, or one the caller gives) is run by
`reference.lengths.LengthsEngine` with two things taken from the trace instead of the
scenario: the accept count of every drafted row-step (the trace's `rows[].accepted`, in the
order each sequence verified) and each sequence's arrival (the step it first appears, when
that is earlier than the scenario's). Every other decision is the reference's own, so the
replayed trace is what a correct engine would have recorded given the same accepts; the two
are compared step by step (phase, the rows that ran, own lengths, widths, leads, draft
groups and chain starts, scheduler buckets, errors), and the first difference is returned
with both sides.

Sequence ids: integer ids are the scenario's request indices; string ids are matched to the
requests in the order they first appear. A trace field that is absent is not compared; a
trace without `phase` gives the accept counts of every row that drafted.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from raggedspec.reference.lengths import LengthsEngine
from raggedspec.reference.scenario import Scenario
from raggedspec.reference.trace import Trace

STEP_COMPARED = ("advance", "width", "groups", "buckets", "bucket", "error")
ROW_COMPARED = ("own_len", "width", "lead", "group", "chain_start")


@dataclass
class Divergence:
    """The first place the trace and the replay differ: `field` at `step` (and `seq`, for a
    row field), the trace's value and the replay's."""

    step: int
    seq: object
    field: str
    trace: object
    replay: object

    def line(self) -> str:
        where = f"step {self.step}" + ("" if self.seq is None else f" seq {self.seq}")
        return f"{where}: {self.field}: trace {self.trace!r}, replay {self.replay!r}"


class TraceAcceptance:
    """An acceptance model for `LengthsEngine` that returns, for each sequence's k-th drafted
    verify, the trace's accept count of that sequence's k-th drafted row-step (0 past the
    trace's end), clamped to the drafts proposed."""

    needs_tokens = False

    def __init__(self, accepts: dict[int, list[int]]) -> None:
        self.accepts = accepts

    def accepted(
        self, ids: np.ndarray, lengths: np.ndarray, drafts: np.ndarray, k: np.ndarray
    ) -> np.ndarray:
        out = np.zeros(len(ids), dtype=np.int64)  # pragma: no mutate (the engine stores ints)
        for j, i in enumerate(ids.tolist()):
            seq, n = self.accepts.get(i, []), int(k[j])
            out[j] = min(seq[n], int(drafts[j])) if n < len(seq) else 0
        return out


def request_index(trace: Trace, batch: int) -> tuple[dict, str | None]:
    """Trace sequence id -> request index (ints as they are, strings in order of first
    appearance), or an error line naming the first id the scenario has no request for (or
    the first that mixes the two kinds)."""
    index: dict = {}
    strings = 0
    for i in range(len(trace)):
        ids = list(trace.step_fields(i).get("prefill") or []) + [r["seq"] for r in trace.rows(i)]
        for s in ids:
            if s in index:
                continue
            if isinstance(s, str):
                index[s], strings = strings, strings + 1
            else:
                index[s] = s
            if strings and len(index) > strings:
                return index, f"the trace mixes integer and string sequence ids (seq {s!r})"
            if index[s] >= batch:
                step = trace.step_fields(i)["step"]
                return index, (
                    f"seq {s!r} (first at step {step}) has no request in the scenario "
                    f"({batch} requests)"
                )
    return index, None


def replay_scenario(
    trace: Trace, sc: Scenario, index: dict
) -> tuple[Scenario, dict[int, list[int]]]:
    """The scenario with the trace's arrivals, and the trace's accept counts per request."""
    first: dict[int, int] = {}
    accepts: dict[int, list[int]] = {}
    for i in range(len(trace)):
        f = trace.step_fields(i)
        for s in f.get("prefill") or []:
            first.setdefault(index[s], f["step"])
        for r in trace.rows(i):
            q = index[r["seq"]]
            first.setdefault(q, f["step"])
            verify = f.get("phase") in ("decode", None)  # a trace without phases: its drafts
            if verify and not f.get("error") and (r.get("drafted") or 0) > 0:
                accepts.setdefault(q, []).append(int(r.get("accepted") or 0))
    reqs = tuple(
        replace(r, arrival=min(r.arrival, first.get(q, r.arrival)))
        for q, r in enumerate(sc.requests)
    )
    steps = max(
        sc.steps, 1 + max((trace.step_fields(i)["step"] for i in range(len(trace))), default=0)
    )
    return replace(sc, requests=reqs, generator=None, steps=steps), accepts


def run_replay(trace: Trace, sc: Scenario) -> Trace:
    """The reference lengths run of `sc` driven by the trace's accepts and arrivals.
    (The engine's acceptance model is swapped after construction: `LengthsEngine` has no
    parameter for an outside accept source.)"""
    index, _ = request_index(trace, sc.batch)
    sc2, accepts = replay_scenario(trace, sc, index)
    engine = LengthsEngine(sc2)
    engine.model = TraceAcceptance(accepts)
    engine.tokens_mode, engine.oracle = False, None
    return engine.run()


def _norm(v):
    return list(v) if isinstance(v, tuple) else v


def first_divergence(trace: Trace, sc: Scenario) -> tuple[Divergence | None, int, str | None]:
    """(the first divergence or None, steps compared, why the replay could not run or None)."""
    index, err = request_index(trace, sc.batch)
    if err:
        return None, 0, err
    rep = run_replay(trace, sc)
    back = {q: s for s, q in index.items()}
    by_step = {rep.step_fields(i)["step"]: i for i in range(len(rep))}
    compared = 0
    for i in range(len(trace)):
        f = trace.step_fields(i)
        t = f["step"]
        if t not in by_step:
            return (
                Divergence(t, None, "step", "present", "absent (the replay ended earlier)"),
                compared,
                None,
            )
        j = by_step[t]
        g = rep.step_fields(j)
        if f.get("phase") is not None and f["phase"] != g.get("phase"):
            return Divergence(t, None, "phase", f["phase"], g.get("phase")), compared, None
        rows = trace.rows(i)
        rrows = {back.get(r["seq"], r["seq"]): r for r in rep.rows(j)}
        ran = [r["seq"] for r in rows]
        if sorted(map(str, ran)) != sorted(map(str, rrows)):
            return Divergence(t, None, "rows[].seq", ran, list(rrows)), compared, None
        for r in rows:
            other = rrows[r["seq"]]
            for k in ROW_COMPARED:
                if r.get(k) is not None and _norm(r[k]) != _norm(other.get(k)):
                    return (
                        Divergence(t, r["seq"], f"rows[].{k}", r[k], other.get(k)),
                        compared,
                        None,
                    )
        for k in STEP_COMPARED:
            if f.get(k) is not None and _norm(f[k]) != _norm(g.get(k)):
                return Divergence(t, None, k, f[k], g.get(k)), compared, None
        compared += 1
    return None, compared, None
