"""The simulator's trace (schema v1, docs/trace.md): a header, one object per engine step with
one row object per sequence that ran, and a summary; written as JSONL (and CSV), read back by
`read_trace` (also traces written by other engines, see docs/trace.md).

Rows are held as one int64 array `[B, len(ROW_COLUMNS)]` per step (-1 stands for null in
`group_u`, `group_start`, `chain_start`), so a long run does not build millions of dicts;
`steps()` yields the schema's dicts. Determinism: the same scenario and seed give a
byte-identical file (keys in schema order, ints as ints, floats by Python's repr).
"""

from __future__ import annotations

import csv
import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np

SCHEMA = "raggedspec-trace"
VERSION = 1
ROW_COLUMNS = ("seq", "row", "own_len", "width", "lead", "u", "drafted", "accepted", "committed",
               "group_u", "group_start", "chain_start", "filled")
# A row column's index in the `[B, len(ROW_COLUMNS)]` row arrays: every reader and writer
# addresses the columns by name through this map, never by a bare number.
COL = {name: i for i, name in enumerate(ROW_COLUMNS)}
STEP_KEYS = (
    "step",
    "phase",
    "advance",
    "cache_instruction",
    "running",
    "waiting",
    "buckets",
    "groups",
    "width",
    "padding_fraction",
    "committed",
    "tok_per_step",
)
EXTRA_STEP_KEYS = ("prefill", "error")  # schema v1 extensions (added fields, after "rows")
# CSV column -> step field, for the step-level columns whose names a row column already takes
# (`width`, `committed` are the row's) or that follow the row columns.
CSV_STEP_TAIL = {
    "step_width": "width",
    "step_committed": "committed",
    "prefill": "prefill",
    "error": "error",
}
# One CSV line per (step, row): the step's scalar fields but the two a row column names, the
# row's columns, the bucket key, then the step-level tail.
CSV_COLUMNS = (
    tuple(k for k in STEP_KEYS if k not in ("width", "committed"))
    + ROW_COLUMNS
    + ("bucket",)
    + tuple(CSV_STEP_TAIL)
)
_NULLABLE = {"group_u", "group_start", "chain_start"}
_STEP_INTS = ("running", "waiting", "buckets", "groups")
_STEP_FLOATS = ("padding_fraction", "tok_per_step")


def row_dict(r: np.ndarray, bucket) -> dict:
    """One schema row object from an int row `[len(ROW_COLUMNS)]`."""
    v = {name: int(r[i]) for name, i in COL.items()}
    return {
        "seq": v["seq"],
        "row": v["row"],
        "own_len": v["own_len"],
        "width": v["width"],
        "lead": v["lead"],
        "u": v["u"],
        "drafted": v["drafted"],
        "accepted": v["accepted"],
        "committed": v["committed"],
        "group": None if v["group_u"] < 0 else [v["group_u"], v["group_start"]],
        "chain_start": None if v["chain_start"] < 0 else v["chain_start"],
        "filled": v["filled"],
        "bucket": bucket,
    }


class Trace:
    """A run's trace. `header` (type, schema, version, mode, scenario), per step the scalar
    fields (`STEP_KEYS` + `EXTRA_STEP_KEYS` + `bucket`) and the rows, and `summary` (set by
    `finish`). `tensors` holds per-step tensor records when the tensor mode ran with
    `record_tensors=True` (not written to the files)."""

    def __init__(self, mode: str, scenario: dict) -> None:
        self.header = {"type": "header", "schema": SCHEMA, "version": VERSION, "mode": mode,
                       "scenario": scenario}
        self._steps: list[dict] = []
        self._rows: list = []
        self.summary: dict | None = None
        self.tensors: list[dict] = []

    def __len__(self) -> int:
        return len(self._steps)

    def add_step(self, fields: dict, rows) -> None:
        """Append one step: `fields` has every `STEP_KEYS` key (+ extensions, `bucket`);
        `rows` is an int array `[B, len(ROW_COLUMNS)]` or a list of row dicts."""
        self._steps.append(fields)
        self._rows.append(rows)

    def step_fields(self, i: int) -> dict:
        return self._steps[i]

    def row_array(self, i: int) -> np.ndarray:
        """Step i's rows as an int array (-1 for null group/chain start)."""
        rows = self._rows[i]
        if isinstance(rows, np.ndarray):
            return rows
        out = np.zeros((len(rows), len(ROW_COLUMNS)), dtype=np.int64)
        for j, r in enumerate(rows):
            g = r.get("group") or [-1, -1]
            cs = r.get("chain_start")
            vals = {c: r.get(c) for c in ROW_COLUMNS}
            vals.update(group_u=g[0], group_start=g[1], chain_start=-1 if cs is None else cs)
            out[j] = [0 if vals[c] is None else vals[c] for c in ROW_COLUMNS]
        return out

    def rows(self, i: int) -> list[dict]:
        rows = self._rows[i]
        if isinstance(rows, np.ndarray):
            bucket = self._steps[i].get("bucket")
            return [row_dict(r, bucket) for r in rows]
        return rows

    def steps(self) -> Iterator[dict]:
        """The step objects in schema order (type, STEP_KEYS, rows, extensions)."""
        for i, f in enumerate(self._steps):
            d = {"type": "step"}
            for k in STEP_KEYS:
                d[k] = f.get(k)
            d["rows"] = self.rows(i)
            for k in EXTRA_STEP_KEYS:
                if k in f:
                    d[k] = f[k]
            yield d

    def finish(self, summary: dict) -> None:
        self.summary = {"type": "summary", **summary}

    def markers(self) -> list[str]:
        """The `MTP[agg] ...` and `SCHED[agg] ...` lines of the run (the spec's exact formats,
        from `AcceptanceTelemetry.marker` and `BucketTelemetry.sched_bucket_marker`; SCHED is
        absent when nothing was ever scheduled)."""
        return list((self.summary or {}).get("markers", []))

    def lines(self) -> Iterator[str]:
        """The JSONL lines (without newlines)."""
        yield json.dumps(self.header)
        for s in self.steps():
            yield json.dumps(s)
        if self.summary is not None:
            yield json.dumps(self.summary)


def write_jsonl(trace: Trace, path) -> None:
    """Write the trace as JSONL (header, steps, summary), one object per line."""
    with open(path, "w") as f:
        for line in trace.lines():
            f.write(line)
            f.write("\n")


def _csv_cell(v) -> str:
    if v is None:
        return ""
    if isinstance(v, list):
        return ":".join(str(x) for x in v)
    return str(v)


def write_csv(trace: Trace, path) -> None:
    """Write one CSV line per (step, row) with `CSV_COLUMNS`: the step's fields (repeated on
    each of its rows), the row's fields, the bucket key joined with ':', then the step-level
    `step_width`, `step_committed`, `prefill` (ids joined with ':', empty = none) and `error`.
    An empty cell is null. Steps without rows have no line."""
    with open(path, "w", newline="") as f:
        w = csv.writer(f, lineterminator="\n")
        w.writerow(CSV_COLUMNS)
        for i, fields in enumerate(trace._steps):
            arr = trace.row_array(i)
            head = [_csv_cell(fields.get(k)) for k in CSV_COLUMNS[:10]]
            tail = [_csv_cell(fields.get("bucket"))] + [
                _csv_cell(fields.get(k)) for k in CSV_STEP_TAIL.values()
            ]
            for r in arr:
                cells = [
                    "" if c in _NULLABLE and r[i] < 0 else str(int(r[i])) for c, i in COL.items()
                ]
                w.writerow(head + cells + tail)


def _int_or_none(text: str):
    return None if text == "" else int(text)


def _key_part(text: str):
    """One ':'-joined part of a bucket key: an int, a bool (`True` / `False`, any case), or
    the text."""
    if text.lstrip("-").isdigit():
        return int(text)
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    return text


def read_trace(path) -> Trace:
    """Read a JSONL trace (or a CSV one, by the `.csv` suffix) into a `Trace`. Unknown fields
    are kept; a JSONL file without a header gets mode "unknown"."""
    path = Path(path)
    if path.suffix.lower() == ".csv":
        return _read_csv(path)
    trace = Trace("unknown", {})
    with open(path) as f:
        for n, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            obj = json.loads(line)
            kind = obj.get("type", "step")
            if kind == "header":
                trace.header = obj
            elif kind == "summary":
                trace.summary = obj
            elif kind == "step":
                rows = obj.get("rows", [])
                fields = {k: v for k, v in obj.items() if k not in ("type", "rows")}
                if rows and "bucket" in rows[0]:
                    fields.setdefault("bucket", rows[0]["bucket"])
                trace.add_step(fields, rows)
            else:
                raise ValueError(f"{path}:{n}: unknown object type {kind!r}")
    return trace


def _read_csv(path: Path) -> Trace:
    """The CSV form back as typed step fields and rows (ints as int, the ratios as float,
    bucket parts as int / bool, `prefill` as a list of ints, empty cells as null), so a
    step read from CSV equals the same step read from JSONL. Columns absent from the file
    (an older or foreign CSV) are absent from the fields."""
    trace = Trace("unknown", {})
    with open(path, newline="") as f:
        cur_step, fields, rows = None, None, []
        for rec in csv.DictReader(f):
            step = int(rec["step"])
            if step != cur_step:
                if fields is not None:
                    trace.add_step(fields, rows)
                cur_step, rows = step, []
                fields = {"step": step}
                for k in CSV_COLUMNS[1:10]:
                    if k in rec:
                        v = rec[k]
                        fields[k] = (None if v == "" else float(v) if k in _STEP_FLOATS
                                     else int(v) if k in _STEP_INTS else v)
                for col, k in CSV_STEP_TAIL.items():
                    if col in rec:
                        v = rec[col]
                        if k == "prefill":
                            fields[k] = [int(x) for x in v.split(":")] if v else []
                        elif k == "error":
                            fields[k] = v or None
                        else:
                            fields[k] = _int_or_none(v)
                if rec.get("bucket"):
                    fields["bucket"] = [_key_part(x) for x in rec["bucket"].split(":")]
            g = (_int_or_none(rec.get("group_u", "")), _int_or_none(rec.get("group_start", "")))
            row = {k: _int_or_none(rec[k]) for k in ROW_COLUMNS if k in rec and k not in _NULLABLE}
            row["group"] = None if g[0] is None else [g[0], g[1]]
            row["chain_start"] = _int_or_none(rec.get("chain_start", ""))
            row["bucket"] = fields.get("bucket")
            rows.append(row)
        if fields is not None:
            trace.add_step(fields, rows)
    return trace
