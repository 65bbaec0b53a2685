"""The trace itself (reference/trace.py, docs/trace.md): the `Trace` container, its row arrays
as schema row objects, the exact CSV form `write_csv` writes, and the loose reader
`read_trace` on what other engines write (no header, no `type`, blank lines, rows without a
bucket key, a CSV without the group and chain columns, text and negative bucket parts, error
texts with line breaks). The strict reader and its refusals are in test_trace_reader.py;
simulator traces read back exactly there too.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from raggedspec.reference.trace import (
    COL,
    CSV_COLUMNS,
    ROW_COLUMNS,
    Trace,
    read_trace,
    write_csv,
    write_jsonl,
)

# The header a trace read without one gets (docs/trace.md: mode "unknown"; no scenario known).
UNKNOWN_HEADER = {"type": "header", "schema": "raggedspec-trace", "version": 1,
                  "mode": "unknown", "scenario": {}}


def row_array(**cols) -> np.ndarray:
    """One int row `[len(ROW_COLUMNS)]`, every column 0 unless given."""
    r = np.zeros(len(ROW_COLUMNS), dtype=np.int64)
    for name, v in cols.items():
        r[COL[name]] = v
    return r


@pytest.mark.rule("trace schema v1, JSONL and CSV")
def test_a_new_trace_is_empty_and_has_no_markers():
    tr = Trace("lengths", {"batch": 1})
    assert len(tr) == 0 and tr.summary is None and tr.tensors == [] and tr.markers() == []
    assert tr.header == {"type": "header", "schema": "raggedspec-trace", "version": 1,
                         "mode": "lengths", "scenario": {"batch": 1}}
    tr.finish({"steps": 0})  # a summary without the markers extension
    assert tr.summary == {"type": "summary", "steps": 0} and tr.markers() == []
    tr.finish({"steps": 0, "markers": ["MTP[agg] a=1"]})
    assert tr.markers() == ["MTP[agg] a=1"]


@pytest.mark.rule("trace schema v1, JSONL and CSV")
def test_a_group_key_of_zero_is_a_group_and_minus_one_is_null():
    """-1 stands for null in group_u / group_start / chain_start; 0 is a real value."""
    tr = Trace("lengths", {})
    rows = np.stack([
        row_array(seq=0, own_len=5, group_u=0, group_start=0, chain_start=0),
        row_array(seq=1, own_len=6, group_u=-1, group_start=-1, chain_start=-1),
    ])
    tr.add_step({"step": 0, "bucket": [5, False, 0]}, rows)
    got = tr.rows(0)
    assert (got[0]["group"], got[0]["chain_start"]) == ([0, 0], 0)
    assert (got[1]["group"], got[1]["chain_start"]) == (None, None)
    assert got[0]["bucket"] == [5, False, 0]


def _one_step_trace() -> Trace:
    tr = Trace("lengths", {})
    rows = np.stack([
        row_array(seq=0, row=0, own_len=12, width=12, lead=0, u=1, drafted=3, accepted=1,
                  committed=2, group_u=1, group_start=0, chain_start=11, filled=14),
        row_array(seq=1, row=1, own_len=10, width=12, lead=2, u=1, drafted=0, accepted=0,
                  committed=1, group_u=-1, group_start=-1, chain_start=-1, filled=0),
    ])
    fields = {"step": 2, "phase": "decode", "advance": "per-sequence", "cache_instruction": "In",
              "running": 2, "waiting": 0, "buckets": 1, "groups": 1, "width": 12,
              "padding_fraction": 0.25, "committed": 3, "tok_per_step": 1.5,
              "bucket": [10, False, 0, True], "prefill": [4, 5], "error": None}
    tr.add_step(fields, rows)
    tr.add_step({"step": 3, "phase": "idle", "bucket": None}, np.zeros((0, len(ROW_COLUMNS))))
    return tr


@pytest.mark.rule("trace schema v1, JSONL and CSV")
def test_the_csv_form_is_exactly_the_documented_columns_and_cells(tmp_path):
    """docs/trace.md "CSV": one line per (step, row), the step's fields repeated, `width` and
    `committed` the row's, an empty cell for null, the bucket and `prefill` joined with ':';
    a step without rows has no line; lines end with a bare newline (byte-identical files)."""
    path = tmp_path / "t.csv"
    write_csv(_one_step_trace(), path)
    step = "2,decode,per-sequence,In,2,0,1,1,0.25,1.5"
    tail = "10:False:0:True,12,3,4:5,"
    want = [
        ",".join(CSV_COLUMNS),
        f"{step},0,0,12,12,0,1,3,1,2,1,0,11,14,{tail}",
        f"{step},1,1,10,12,2,1,0,0,1,,,,0,{tail}",
    ]
    assert path.read_bytes() == ("\n".join(want) + "\n").encode()


@pytest.mark.rule("trace schema v1, JSONL and CSV")
def test_the_csv_form_reads_back_typed_as_the_jsonl_step(tmp_path):
    tr = _one_step_trace()
    write_csv(tr, tmp_path / "t.csv")
    back = read_trace(tmp_path / "t.csv")
    assert back.header == UNKNOWN_HEADER and len(back) == 1
    assert back.step_fields(0) == tr.step_fields(0)  # exactly its fields, typed
    assert back.rows(0) == tr.rows(0)


@pytest.mark.rule("trace schema v1, JSONL and CSV")
def test_csv_cells_a_foreign_engine_writes_read_as_the_docs_say(tmp_path):
    """Empty step cells are null; an `error` text is kept as text (null when empty); bucket
    parts are ints (negative too), booleans in any case, or the text; a line break inside a
    quoted cell survives."""
    path = tmp_path / "f.csv"
    head = ("step,phase,cache_instruction,running,padding_fraction,seq,own_len,group_u,"
            "group_start,chain_start,bucket,step_width,prefill,error\n")
    path.write_text(
        head
        + "0,idle,,,,1,4,,,,-3:TRUE:false:X2:x,,,capacity refused\n"
        + '1,decode,In,2,0.5,1,5,2,0,4,7,9,3,"left-aligned\r\nguard"\n'
        + "1,decode,In,2,0.5,2,6,,0,,7,9,3,\"left-aligned\r\nguard\"\n",
        newline="",
    )
    tr = read_trace(path)
    f0 = tr.step_fields(0)
    assert (f0["cache_instruction"], f0["running"], f0["padding_fraction"]) == (None, None, None)
    assert (f0["width"], f0["prefill"], f0["error"]) == (None, [], "capacity refused")
    assert f0["bucket"] == [-3, True, False, "X2", "x"]
    f1 = tr.step_fields(1)
    assert (f1["running"], f1["padding_fraction"], f1["width"]) == (2, 0.5, 9)
    assert f1["prefill"] == [3] and f1["error"] == "left-aligned\r\nguard"
    r0, r1 = tr.rows(1)
    assert (r0["group"], r0["chain_start"]) == ([2, 0], 4)
    # group is null when group_u is: a half-set pair is not a group
    assert (r1["group"], r1["chain_start"]) == (None, None)


@pytest.mark.rule("trace schema v1, JSONL and CSV")
def test_a_csv_without_the_group_and_chain_columns_reads_them_as_null(tmp_path):
    path = tmp_path / "old.csv"
    path.write_text("step,seq,own_len\n0,1,4\n0,2,6\n")
    tr = read_trace(path)
    assert tr.header == UNKNOWN_HEADER
    assert tr.step_fields(0) == {"step": 0}
    assert tr.rows(0) == [
        {"seq": 1, "own_len": 4, "group": None, "chain_start": None, "bucket": None},
        {"seq": 2, "own_len": 6, "group": None, "chain_start": None, "bucket": None},
    ]


@pytest.mark.rule("trace schema v1, JSONL and CSV")
def test_the_loose_reader_reads_header_steps_and_summary_back(tmp_path):
    tr = _one_step_trace()
    tr.finish({"steps": 2, "markers": ["MTP[agg] x=1"]})
    write_jsonl(tr, tmp_path / "t.jsonl")
    back = read_trace(tmp_path / "t.jsonl")
    assert back.header == tr.header and back.summary == tr.summary
    assert list(back.steps()) == list(tr.steps()) and back.markers() == ["MTP[agg] x=1"]


@pytest.mark.rule("trace schema v1, JSONL and CSV")
def test_an_engine_trace_without_header_or_type_reads_as_steps(tmp_path):
    """docs/trace.md "Traces from other engines": a line without `type` is a step; blank
    lines are skipped; a step takes its rows' bucket when it has none of its own; a step
    without `rows` has none; the header is mode "unknown"."""
    path = tmp_path / "e.jsonl"
    lines = [
        json.dumps({"step": 0, "rows": [{"seq": 3, "own_len": 8, "bucket": [8, 0]}]}),
        "",
        json.dumps({"type": "step", "step": 1, "rows": []}),
        "   ",
        json.dumps({"step": 2, "phase": "idle"}),
        json.dumps({"step": 3, "bucket": [1], "rows": [{"seq": 3, "own_len": 9, "bucket": [9]}]}),
    ]
    path.write_text("\n".join(lines) + "\n")
    tr = read_trace(path)
    assert tr.header == UNKNOWN_HEADER and tr.summary is None and len(tr) == 4
    assert tr.step_fields(0) == {"step": 0, "bucket": [8, 0]}
    assert tr.step_fields(1) == {"step": 1}
    assert tr.step_fields(2) == {"step": 2, "phase": "idle"} and tr.rows(2) == []
    assert tr.step_fields(3)["bucket"] == [1]  # its own bucket wins
    assert [s["rows"] for s in tr.steps()][0] == [{"seq": 3, "own_len": 8, "bucket": [8, 0]}]


@pytest.mark.rule("trace schema v1, JSONL and CSV")
def test_an_unknown_object_type_is_named_by_file_and_line(tmp_path):
    path = tmp_path / "u.jsonl"
    path.write_text(json.dumps({"step": 0, "rows": []}) + "\n"
                    + json.dumps({"type": "footer"}) + "\n")
    with pytest.raises(ValueError) as err:
        read_trace(path)
    assert str(err.value) == f"{path}:2: unknown object type 'footer'"
