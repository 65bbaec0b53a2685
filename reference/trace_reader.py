"""The strict trace reader: a schema-v1 trace (docs/trace.md), JSONL or CSV, checked field by
field before anything reads it, and returned as a `reference.trace.Trace`.

Checked: the header (first line, optional for traces from other engines) has the schema
`raggedspec-trace` and version 1; every known field has its type and range (lengths and
counts are integers in [0, 2**31), never floats or booleans; ratios are finite floats; an
enumerated field holds one of its values, so an unknown `phase` is an error, not a step that
silently measures nothing); steps strictly increase; a step's sequence ids are distinct and
are integers >= 0 or non-empty strings; a CSV step's fields agree on all its lines. Unknown
fields are kept and not checked (the schema lets version 1 gain fields). Every problem is
reported as `FILE:LINE: field 'NAME' = VALUE: what it must be`, all of them up to `limit`
(then a count of the rest), in one `TraceError`. Cross-field rules (`accepted <= drafted`,
`lead = width - own_len`, the advance rules) are not the reader's: `raggedspec check-trace`
checks them, so a trace that breaks one is still readable and its violation is reported.
"""

from __future__ import annotations

import csv
import json
import math
import re
from pathlib import Path

from raggedspec.reference.trace import (
    CSV_COLUMNS,
    CSV_STEP_TAIL,
    ROW_COLUMNS,
    SCHEMA,
    VERSION,
    Trace,
)

INT_MAX = 2**31 - 1  # trace lengths are 32-bit (reference.lengths.ROW_DTYPE)
PHASES = ("prompt", "decode", "defer", "idle")
ADVANCES = ("cohort", "per-sequence")
CACHE_INSTRUCTIONS = ("In", "Nothing", "Reset")
DEFAULT_LIMIT = 20


class TraceError(ValueError):
    """A trace that breaks the schema. `problems` holds one `FILE:LINE: ...` line per
    problem (at most the reader's limit); `more` counts the problems left out."""

    def __init__(self, problems: list[str], more: int = 0) -> None:
        self.problems, self.more = problems, more
        tail = [f"... and {more} more problem(s)"] if more else []
        n = len(problems) + more
        if n == 1:  # one problem: one line, FILE:LINE: field = value: what is allowed
            super().__init__(problems[0])
        else:
            super().__init__(f"{n} problems in the trace:\n" + "\n".join(problems + tail))


def _show(value) -> str:
    text = json.dumps(value)
    return text if len(text) <= 60 else text[:57] + "..."


# --------------------------------------------------------------------- value checks
# Each returns None when the value is good, else what it must be.


def _nonneg_int(v) -> str | None:
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        return "must be an integer >= 0"
    return None if v <= INT_MAX else f"must be an integer <= {INT_MAX}"


def _ratio(v) -> str | None:
    if (
        isinstance(v, bool)
        or not isinstance(v, (int, float))
        or not math.isfinite(v)
        or not 0 <= v <= 1
    ):
        return "must be a number in [0, 1]"
    return None


def _rate(v) -> str | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
        return "must be a finite number >= 0"
    return None


def _text(v) -> str | None:
    return None if isinstance(v, str) else "must be a string"


def _one_of(values: tuple[str, ...]):
    def check(v) -> str | None:
        return None if v in values else "must be one of " + ", ".join(json.dumps(x) for x in values)

    return check


def seq_id_problem(v) -> str | None:
    """None for a valid sequence id (an integer >= 0 or a non-empty string), else why not."""
    if isinstance(v, str):
        return None if v else "must be an integer >= 0 or a non-empty string"
    return None if _nonneg_int(v) is None else "must be an integer >= 0 or a non-empty string"


def _group(v) -> str | None:
    ok = isinstance(v, list) and len(v) == 2 and all(_nonneg_int(x) is None for x in v)
    return None if ok else "must be null or [u, start], two integers >= 0"


def _bucket(v) -> str | None:
    ok = isinstance(v, list) and all(isinstance(x, (int, str)) for x in v)
    return None if ok else "must be a list of integers, booleans or strings"


def _seq_list(v) -> str | None:
    ok = isinstance(v, list) and all(seq_id_problem(x) is None for x in v)
    return None if ok else "must be a list of sequence ids (integers >= 0 or non-empty strings)"


def _bits(v) -> str | None:
    ok = isinstance(v, list) and all(not isinstance(x, bool) and x in (0, 1) for x in v)
    return None if ok else "must be a list of 0 / 1 (one per draft position)"


def _markers(v) -> str | None:
    return (
        None
        if isinstance(v, list) and all(isinstance(x, str) for x in v)
        else "must be a list of strings"
    )


STEP_FIELDS = {
    "phase": _one_of(PHASES),
    "advance": _one_of(ADVANCES),
    "cache_instruction": _one_of(CACHE_INSTRUCTIONS),
    "running": _nonneg_int,
    "waiting": _nonneg_int,
    "buckets": _nonneg_int,
    "groups": _nonneg_int,
    "width": _nonneg_int,
    "padding_fraction": _ratio,
    "committed": _nonneg_int,
    "tok_per_step": _rate,
    "prefill": _seq_list,
    "error": _text,
    "bucket": _bucket,
}
ROW_FIELDS = {
    "row": _nonneg_int,
    "width": _nonneg_int,
    "lead": _nonneg_int,
    "u": _nonneg_int,
    "drafted": _nonneg_int,
    "accepted": _nonneg_int,
    "committed": _nonneg_int,
    "group": _group,
    "chain_start": _nonneg_int,
    "filled": _nonneg_int,
    "bucket": _bucket,
    # schema extensions (docs/trace.md): the row's first query position (its RoPE start), the
    # mask's dead-prefix columns in front of its live run, accepted per draft position
    "q0": _nonneg_int,
    "dead_cols": _nonneg_int,
    "accepted_pos": _bits,
}
SUMMARY_FIELDS = {
    "steps": _nonneg_int,
    "decode_steps": _nonneg_int,
    "committed": _nonneg_int,
    "tok_per_step": _rate,
    "max_spread": _nonneg_int,
    "mean_padding_fraction": _ratio,
    "refusal": _text,
    "errors": _nonneg_int,
    "markers": _markers,
    "shattered_steps": _nonneg_int,
}


class _Problems:
    """Collects `FILE:LINE: ...` lines up to a limit and counts the rest."""

    def __init__(self, path: Path, limit: int) -> None:
        self.path, self.limit, self.lines, self.more = path, limit, [], 0

    def add(self, line: int, text: str) -> None:
        if len(self.lines) < self.limit:
            self.lines.append(f"{self.path}:{line}: {text}")
        else:
            self.more += 1

    def field(self, line: int, name: str, value, must: str, at: str = "") -> None:
        self.add(line, f"field '{name}' = {_show(value)}: {must}{at}")

    def check(self, line: int, obj: dict, checks: dict, prefix: str = "", at: str = "") -> None:
        """Type and range of every known field present and not null."""
        for name, check in checks.items():
            if name in obj and obj[name] is not None:
                must = check(obj[name])
                if must:
                    self.field(line, prefix + name, obj[name], must, at)

    def raise_if_any(self) -> None:
        if self.lines:
            raise TraceError(self.lines, self.more)


# ------------------------------------------------------------------------- the reader


def read_trace_strict(path, limit: int = DEFAULT_LIMIT, int_ids: bool = False) -> Trace:
    """Read and check a trace file (CSV by the `.csv` suffix, else JSONL); return it as a
    `Trace` (header, steps, summary; `trace.step_lines` holds each step's first line number).
    Raises TraceError listing every problem found (at most `limit`, then a count), or
    FileNotFoundError. With `int_ids`, string sequence ids are replaced by integers in the
    order they first appear (`trace.seq_names` maps them back), for readers that need ints."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"trace file {path} does not exist")
    problems = _Problems(path, limit)
    raw = path.read_bytes()
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1
        raise TraceError([f"{path}:{line}: not UTF-8 text (byte {exc.start}: {exc.reason}); "
                          "a trace is JSON lines or CSV in UTF-8"]) from None
    reader = _read_csv if path.suffix.lower() == ".csv" else _read_jsonl
    trace, lines = reader(path, problems)
    if not len(trace) and not problems.lines:
        problems.add(1, "no step in the trace (a step line needs a `step` and a `rows` list)")
    problems.raise_if_any()
    trace.step_lines = lines
    trace.seq_names = _dense_ids(trace) if int_ids else {}
    return trace


def _reject_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def _read_jsonl(path: Path, problems: _Problems) -> tuple[Trace, list[int]]:
    trace = Trace("unknown", {})
    trace.header = None
    lines: list[int] = []
    last_step: tuple[int, int] | None = None  # (step, line)
    seen_step = seen_summary = False
    with open(path, encoding="utf-8") as f:  # read_trace_strict checked it decodes
        for n, text in enumerate(f, 1):
            if not text.strip():
                continue
            try:
                obj = json.loads(text, parse_constant=_reject_constant)
            except ValueError as exc:
                problems.add(n, f"not a JSON object ({exc})")
                continue
            if not isinstance(obj, dict):
                problems.add(n, f"not a JSON object (a {type(obj).__name__})")
                continue
            kind = obj.get("type", "step")
            if seen_summary:
                problems.add(n, "a line after the summary (the summary is the last line)")
            if kind == "header":
                if seen_step or trace.header is not None:
                    problems.add(n, "a header that is not the first line")
                _check_header(n, obj, problems)
                trace.header = obj
            elif kind == "summary":
                problems.check(n, obj, SUMMARY_FIELDS)
                trace.summary = obj
                seen_summary = True
            elif kind == "step":
                seen_step = True
                step, usable = _check_step(n, obj, problems, last_step)
                if step is not None and (last_step is None or step > last_step[0]):
                    last_step = (step, n)
                if not usable:
                    continue
                rows = obj["rows"]
                fields = {k: v for k, v in obj.items() if k not in ("type", "rows")}
                if rows and isinstance(rows[0].get("bucket"), list):
                    fields.setdefault("bucket", rows[0]["bucket"])
                trace.add_step(fields, rows)
                lines.append(n)
            else:
                problems.field(n, "type", kind, 'must be one of "header", "step", "summary"')
    if trace.header is None:
        trace.header = {
            "type": "header",
            "schema": SCHEMA,
            "version": VERSION,
            "mode": "unknown",
            "scenario": None,
        }
    return trace, lines


def _check_header(n: int, obj: dict, problems: _Problems) -> None:
    if obj.get("schema") != SCHEMA:
        problems.field(n, "schema", obj.get("schema"), f'must be "{SCHEMA}"')
    v = obj.get("version")
    if isinstance(v, bool) or v != VERSION or not isinstance(v, int):
        problems.field(
            n, "version", v, f"must be {VERSION} (this reader knows schema version {VERSION} only)"
        )
    if "mode" in obj and not isinstance(obj["mode"], str):
        problems.field(n, "mode", obj["mode"], "must be a string")
    if obj.get("scenario") is not None and not isinstance(obj["scenario"], dict):
        problems.field(n, "scenario", obj["scenario"], "must be an object (the resolved scenario)")


def _check_step(
    n: int, obj: dict, problems: _Problems, last: tuple[int, int] | None
) -> tuple[int | None, bool]:
    """Check one JSONL step object; returns (its step index or None, whether it is usable)."""
    step = obj.get("step")
    must = _nonneg_int(step) if step is not None else "is required (an integer >= 0)"
    if must:
        problems.field(n, "step", step, must)
        return None, False
    if last is not None and step <= last[0]:
        problems.field(
            n,
            "step",
            step,
            f"must be greater than the previous step {last[0]} (line {last[1]}): "
            "steps strictly increase",
        )
    problems.check(n, obj, STEP_FIELDS)
    rows = obj.get("rows")
    if not isinstance(rows, list):
        problems.field(n, "rows", rows, "is required (a list of row objects)")
        return step, False
    first: dict = {}
    ok = True
    for j, r in enumerate(rows):
        if not isinstance(r, dict):
            problems.field(n, f"rows[{j}]", r, "must be a row object")
            ok = False
            continue
        ok = _check_row(n, r, j, problems, first) and ok
        first.setdefault(_key(r.get("seq")), j)
    return step, ok


def _key(seq):
    return (type(seq).__name__, seq if isinstance(seq, (int, str)) else repr(seq))


def _check_row(n: int, r: dict, j: int, problems: _Problems, seen: dict) -> bool:
    """Check row j's fields (`seen`: the step's sequence ids so far, to their row index);
    False when a required field is missing or bad."""
    ok, at, prefix = True, f" (rows[{j}])", "rows[]."
    for name in ("seq", "own_len"):
        if r.get(name) is None:
            problems.field(n, prefix + name, None, "is required", at)
            ok = False
    seq = r.get("seq")
    if seq is not None:
        must = seq_id_problem(seq)
        if must:
            problems.field(n, prefix + "seq", seq, must, at)
            ok = False
        elif _key(seq) in seen:
            problems.field(
                n,
                prefix + "seq",
                seq,
                f"must be unique in its step, rows[{seen[_key(seq)]}] has it too",
                at,
            )
    if r.get("own_len") is not None:
        must = _nonneg_int(r["own_len"])
        if must:
            problems.field(n, prefix + "own_len", r["own_len"], must, at)
            ok = False
    problems.check(n, r, ROW_FIELDS, prefix, at)
    return ok


# ------------------------------------------------------------------------------ CSV

_INT_TEXT = re.compile(r"-?[0-9]+")
_CSV_FLOATS = {"padding_fraction", "tok_per_step"}
_CSV_TEXT = {"phase", "advance", "cache_instruction", "seq", "bucket", "prefill", "error"}
# every other column of the schema is an integer, and so are the extensions' q0 and dead_cols
_CSV_INTS = set(CSV_COLUMNS) - _CSV_TEXT - _CSV_FLOATS | {"q0", "dead_cols"}


def _csv_value(col: str, text: str):
    """A CSV cell typed as its JSONL field: None (empty), int, float, or the text; a cell
    that cannot be typed stays text, and the field check then names it."""
    if text == "":
        return None
    if col in _CSV_INTS:
        return int(text) if _INT_TEXT.fullmatch(text) else text
    if col in _CSV_FLOATS:
        try:
            return float(text)
        except ValueError:
            return text
    if col == "seq":
        return int(text) if text.isdigit() else text
    return text


def _bucket_part(text: str):
    if _INT_TEXT.fullmatch(text):
        return int(text)
    return text.lower() == "true" if text.lower() in ("true", "false") else text


def _read_csv(path: Path, problems: _Problems) -> tuple[Trace, list[int]]:
    """A CSV trace (one line per row, the step's fields repeated on each) and the first line of
    each step. Problems are collected, never raised: a header without `step`, `seq` and
    `own_len`, a line with another cell count, a step that is not an integer >= 0 (those lines
    are skipped), step fields that differ within a step, steps that do not strictly increase,
    a `seq` twice in one step."""
    trace = Trace("unknown", None)  # a CSV has no header: mode "unknown", no scenario
    lines: list[int] = []
    with open(path, newline="", encoding="utf-8") as f:
        reader = csv.reader(f)
        head = _csv_header(reader, problems)
        if head is None:
            return trace, lines
        cur: tuple[int, int, dict] | None = None  # (step, first line, fields)
        rows: list[dict] = []
        last: tuple[int, int] | None = None
        seen: dict = {}
        for cells in reader:
            n = reader.line_num
            if not any(cells):
                continue
            if len(cells) != len(head):
                problems.add(n, f"{len(cells)} cells, the header has {len(head)} columns")
                continue
            rec = dict(zip(head, cells, strict=True))
            fields, row = _csv_record(rec, n, problems)
            step = fields.get("step")
            if _nonneg_int(step):
                problems.field(n, "step", rec["step"], "must be an integer >= 0")
                continue
            if cur is not None and step == cur[0]:
                _check_same_step(fields, cur, rec, n, problems)
            else:
                if cur is not None:
                    trace.add_step(cur[2], rows)
                    lines.append(cur[1])
                _check_step_order(step, last, n, problems)
                cur, rows, seen = (step, n, fields), [], {}
                last = (step, n)
            _check_unique_seq(row.get("seq"), seen, n, problems)
            row["bucket"] = fields.get("bucket")
            rows.append(row)
        if cur is not None:
            trace.add_step(cur[2], rows)
            lines.append(cur[1])
    return trace, lines


def _csv_header(reader, problems: _Problems) -> list[str] | None:
    """The CSV's header line, or None (a problem on line 1) when the file is empty or the
    header lacks a required column (`step`, `seq`, `own_len`)."""
    try:
        head = next(reader)
    except StopIteration:
        problems.add(1, "empty CSV file (no header line)")
        return None
    missing = [c for c in ("step", "seq", "own_len") if c not in head]
    if missing:
        problems.add(1, "CSV header lacks the required column(s) " + ", ".join(missing))
        return None
    return head


def _check_same_step(fields: dict, cur: tuple[int, int, dict], rec: dict, n: int,
                     problems: _Problems) -> None:
    """Line `n` repeats the step fields of its step's first line `cur[1]`: a problem per field
    that differs, naming its CSV column and the first line's value."""
    for k in fields.keys() | cur[2].keys():
        if fields.get(k) != cur[2].get(k):
            problems.field(n, _csv_column(k), rec[_csv_column(k)],
                           f"must equal the step's value on its first line {cur[1]} "
                           f"({_show(cur[2].get(k))})")


def _check_step_order(step: int, last: tuple[int, int] | None, n: int,
                      problems: _Problems) -> None:
    """A new step on line `n` is greater than the previous step `last = (step, line)`, else a
    problem (steps strictly increase)."""
    if last is not None and step <= last[0]:
        problems.field(n, "step", step, f"must be greater than the previous step {last[0]} "
                       f"(line {last[1]}): steps strictly increase")


def _check_unique_seq(seq, seen: dict, n: int, problems: _Problems) -> None:
    """`seq` appears once per step: a problem when `seen` (key -> first line) has it already;
    records line `n` for a new one."""
    if seq is not None and _key(seq) in seen:
        problems.field(
            n, "seq", seq, f"must be unique in its step, line {seen[_key(seq)]} has it too"
        )
    seen.setdefault(_key(seq), n)


def _csv_column(field: str) -> str:
    return {v: k for k, v in CSV_STEP_TAIL.items()}.get(field, field)


def _csv_record(rec: dict, n: int, problems: _Problems) -> tuple[dict, dict]:
    """One CSV line as (step fields, row), typed and checked."""
    fields: dict = {"step": _csv_value("step", rec["step"])}
    for k in CSV_COLUMNS[1:10]:
        if k in rec:
            fields[k] = _csv_value(k, rec[k])
    for col, k in CSV_STEP_TAIL.items():
        if col in rec:
            v = rec[col]
            if k == "prefill":
                fields[k] = [_csv_value("seq", x) for x in v.split(":")] if v else []
            else:  # an int column, or the error text (None when empty)
                fields[k] = _csv_value(col, v)
    if rec.get("bucket"):
        fields["bucket"] = [_bucket_part(x) for x in rec["bucket"].split(":")]
    problems.check(
        n,
        {_csv_column(k): v for k, v in fields.items()},
        {_csv_column(k): c for k, c in STEP_FIELDS.items()},
    )
    row = {
        k: _csv_value(k, rec[k])
        for k in ROW_COLUMNS
        if k in rec and k not in ("group_u", "group_start")
    }
    for k in ("q0", "dead_cols"):
        if k in rec:
            row[k] = _csv_value(k, rec[k])
    gu, gs = (
        _csv_value("group_u", rec.get("group_u", "")),
        _csv_value("group_start", rec.get("group_start", "")),
    )
    if (gu is None) != (gs is None):
        problems.add(
            n, f"field 'group_u' = {_show(gu)}, 'group_start' = {_show(gs)}: both empty or both set"
        )
    for col, v in (("group_u", gu), ("group_start", gs)):
        if v is not None and _nonneg_int(v):
            problems.field(n, col, v, _nonneg_int(v))
    row["group"] = None if gu is None or gs is None else [gu, gs]
    if "accepted_pos" in rec and rec["accepted_pos"] != "":
        row["accepted_pos"] = [_csv_value("q0", x) for x in rec["accepted_pos"].split(":")]
    for name in ("seq", "own_len"):
        if row.get(name) is None:
            problems.field(n, name, None, "is required")
    if row.get("seq") is not None and seq_id_problem(row["seq"]):
        problems.field(n, "seq", row["seq"], seq_id_problem(row["seq"]))
    if row.get("own_len") is not None and _nonneg_int(row["own_len"]):
        problems.field(n, "own_len", rec["own_len"], _nonneg_int(row["own_len"]))
    problems.check(n, row, {k: c for k, c in ROW_FIELDS.items() if k != "group"})
    return fields, row


# ------------------------------------------------------------------------ sequence ids


def _dense_ids(trace: Trace) -> dict[int, str | int]:
    """Replace string sequence ids by ints (order of first appearance, after the largest
    int id); returns int -> original id. A trace of int ids is left as it is."""
    names: dict = {}
    for i in range(len(trace)):
        f = trace.step_fields(i)
        for s in list(f.get("prefill") or []) + [r["seq"] for r in trace.rows(i)]:
            names.setdefault(_key(s), s)
    if all(isinstance(s, int) for s in names.values()):
        return {}
    base = 1 + max((s for s in names.values() if isinstance(s, int)), default=-1)
    to_int, nxt = {}, base
    for k, s in names.items():
        if isinstance(s, int):
            to_int[k] = s
        else:
            to_int[k], nxt = nxt, nxt + 1
    for i in range(len(trace)):
        f = trace.step_fields(i)
        if f.get("prefill"):
            f["prefill"] = [to_int[_key(s)] for s in f["prefill"]]
        for r in trace.rows(i):
            r["seq"] = to_int[_key(r["seq"])]
    return {v: names[k] for k, v in to_int.items() if not isinstance(names[k], int)}
