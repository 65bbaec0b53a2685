"""Traces of engines with known bugs: the reference lengths model with one bug injected.

Each bug class is a small scenario and one change to `reference.lengths.LengthsEngine`'s
decode step (a subclass; the reference is untouched). `python -m raggedspec.trace_bugs --out
DIR` writes one `NAME.jsonl` per class; the classes: docs/trace-check.md, section
"raggedspec/trace_bugs.py".
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np

from raggedspec.reference.lengths import LengthsEngine
from raggedspec.reference.scenario import Scenario, load_scenario
from raggedspec.reference.trace import Trace, write_jsonl

GRANTED = {
    "advance": "per-sequence",
    "world": "WB",
    "admission": "grant",
    "xs_per_seq": True,
    "per_seq_kv": True,
}
BASE = {
    "batch": 4,
    "prompt_len": [12, 20],
    "max_new_tokens": [40, 40],
    "depth": 3,
    "steps": 12,
    "acceptance": "heterogeneous:0.2,0.9",
    "max_draft_kv_seqs": None,
    "seed": 3,
    **GRANTED,
}

# column indices of a lengths-model trace row (reference.trace.ROW_COLUMNS)
OWN, WIDTH, LEAD, U, ACC, GROUP_START, CHAIN = 2, 3, 4, 5, 7, 10, 11


class BuggedEngine(LengthsEngine):
    """`LengthsEngine` whose decode step, when it did not fail, is followed by `bug(self,
    ids, res, rows)`: the hook edits the engine's state or the step's recorded fields."""

    def __init__(self, sc: Scenario, bug: Callable) -> None:
        super().__init__(sc)
        self.bug = bug
        self.t = -1
        self.extra: dict[tuple[int, int], dict] = {}  # (step, seq) -> extension fields

    def _schedule(self):
        self.t += 1
        return super()._schedule()

    def _decode(self, ids):
        res, rows = super()._decode(ids)
        if res["error"] is None and res["phase"] == "decode":
            self.bug(self, ids, res, rows)
        return res, rows


def uniform_advance(eng: BuggedEngine, ids: np.ndarray, res: dict, rows: np.ndarray) -> None:
    if res["advance"] == "per-sequence":
        eng.stored[ids] = rows[:, OWN] + int((rows[:, U] + rows[:, ACC]).min())


def position_holes(eng: BuggedEngine, ids: np.ndarray, res: dict, rows: np.ndarray) -> None:
    if res["advance"] != "per-sequence":
        return
    hole = eng.__dict__.setdefault("hole", np.zeros(eng.sc.batch, dtype=np.int64))
    for r, i in enumerate(ids.tolist()):
        eng.extra[(eng.t, i)] = {"q0": int(rows[r, OWN] + hole[i])}
    commit = rows[:, U] + rows[:, ACC]
    hole[ids] += int(commit.max()) - commit


def stuck_drafter(eng: BuggedEngine, ids: np.ndarray, res: dict, rows: np.ndarray) -> None:
    first = eng.__dict__.setdefault("first_start", {})
    for r, i in enumerate(ids.tolist()):
        if rows[r, CHAIN] >= 0:
            rows[r, CHAIN] = first.setdefault(i, int(rows[r, CHAIN]))


def scalar_group_keys(eng: BuggedEngine, ids: np.ndarray, res: dict, rows: np.ndarray) -> None:
    drew = rows[:, CHAIN] >= 0
    rows[drew, GROUP_START] = rows[drew, CHAIN]
    res["groups"] = len({(int(r[U]), int(r[CHAIN])) for r in rows[drew]})


def uniform_ragged_path(eng: BuggedEngine, ids: np.ndarray, res: dict, rows: np.ndarray) -> None:
    if (rows[:, OWN] == rows[0, OWN]).all():
        rows[:, WIDTH] += 1
        rows[:, LEAD] += 1
        res["width"] += 1
        res["pad"] = float(rows[:, LEAD].sum() / (rows.shape[0] * res["width"]))


def _no_bug(eng: BuggedEngine, ids: np.ndarray, res: dict, rows: np.ndarray) -> None:
    return None


BUGS = {
    # name: (scenario changes, the bug, header scenario changes (what the engine claims))
    "uniform-advance": ({}, uniform_advance, {}),
    "position-holes": ({}, position_holes, {}),
    "no-strip": ({"strip": "none"}, _no_bug, {"strip": "eager"}),
    "stuck-drafter": ({}, stuck_drafter, {}),
    "scalar-group-keys": ({"batch": 8, "depth": 2}, scalar_group_keys, {}),
    "uniform-ragged-path": (
        {"prompt_len": 16, "acceptance": "all-accept"},
        uniform_ragged_path,
        {},
    ),
}


def bugged_trace(name: str) -> Trace:
    """The trace of the named bug class's scenario run with the bug injected."""
    changes, bug, claimed = BUGS[name]
    sc = load_scenario({**BASE, **changes})
    eng = BuggedEngine(sc, bug)
    trace = eng.run()
    trace.header["scenario"] = {**trace.header["scenario"], **claimed}
    if eng.extra:
        for i in range(len(trace)):
            t = trace.step_fields(i)["step"]
            rows = trace.rows(i)
            for r in rows:
                r.update(eng.extra.get((t, r["seq"]), {}))
            trace._rows[i] = rows
    return trace


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m raggedspec.trace_bugs", description=__doc__.splitlines()[0]
    )
    p.add_argument(
        "--out", type=Path, required=True, help="folder for NAME.jsonl, one per bug class"
    )
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    for name in BUGS:
        write_jsonl(bugged_trace(name), args.out / f"{name}.jsonl")
        print(f"wrote {args.out / (name + '.jsonl')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
