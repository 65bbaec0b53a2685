"""The trace (reference/trace.py, docs/trace.md) and the run summary (reference/policy.py):
the `Trace` container and its row arrays as schema row objects (-1 for a null column, 0 a real
value), schema v1's key order and a byte-identical file for the same scenario and seed, the
exact CSV form `write_csv` writes, the loose reader `read_trace` on simulator traces and on what
other engines write (no header, no `type`, blank lines, rows without a bucket key, a CSV without
the group and chain columns, text and negative bucket parts, error texts with line breaks), the
`MTP[agg]` / `SCHED[agg]` markers and the summary's totals brute-forced from the steps. The
strict reader is in test_trace_reader.py and test_trace_reader_csv.py.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from raggedspec.conformance.helpers import GRANTED
from raggedspec.reference import lengths, policy, simulator
from raggedspec.reference.accounting import AcceptanceTelemetry
from raggedspec.reference.capability import KvAdvanceLatch
from raggedspec.reference.scenario import load_scenario
from raggedspec.reference.scheduler_telemetry import BucketTelemetry
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
# docs/trace.md's key order of a step object, a row object and a summary object
STEP_ORDER = ["type", "step", "phase", "advance", "cache_instruction", "running", "waiting",
              "buckets", "groups", "width", "padding_fraction", "committed", "tok_per_step", "rows"]
ROW_ORDER = ["seq", "row", "own_len", "width", "lead", "u", "drafted", "accepted", "committed",
             "group", "chain_start", "filled", "bucket"]
SUMMARY_ORDER = ["type", "steps", "decode_steps", "committed", "tok_per_step", "max_spread",
                 "mean_padding_fraction", "refusal"]


# ----------------------------------------------------------------------------- the Trace container


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


@pytest.mark.rule("trace schema v1, JSONL and CSV", "the strict trace reader")
def test_rows_read_as_dicts_become_the_int_row_array_with_minus_one_for_null():
    tr = Trace("unknown", {})
    tr.add_step({"step": 0}, [
        {"seq": 3, "own_len": 9, "group": [2, 5], "chain_start": 7, "u": None},
        {"seq": 4, "own_len": 6, "group": None, "chain_start": None},  # nulls, absent columns
    ])
    arr = tr.row_array(0)
    assert arr.dtype == np.int64 and arr.shape == (2, len(ROW_COLUMNS))
    want = [dict.fromkeys(ROW_COLUMNS, 0) for _ in range(2)]
    want[0].update(seq=3, own_len=9, group_u=2, group_start=5, chain_start=7)
    want[1].update(seq=4, own_len=6, group_u=-1, group_start=-1, chain_start=-1)
    assert [[int(r[COL[c]]) for c in ROW_COLUMNS] for r in arr] == [
        [w[c] for c in ROW_COLUMNS] for w in want]



@pytest.mark.rule("trace schema v1, JSONL and CSV")
def test_prompt_and_decode_rows_are_int_rows_with_null_group_and_chain_start():
    """Rows are the schema's int array; an undrafted row (depth 0) and a prompt row carry -1
    for group and chain start."""
    tr = simulator.run(load_scenario({"batch": 2, "prompt_len": 6, "max_new_tokens": 30, "steps": 2,
                                      "depth": 0}))
    for t in (0, 1):
        rows = tr.row_array(t)
        assert rows.dtype == policy.ROW_DTYPE
        assert (rows[:, policy.NULL_COLS] == -1).all()
    assert [r["group"] for r in tr.rows(1)] == [None, None]


@pytest.mark.rule("trace schema v1, JSONL and CSV")
def test_step_fields_names_every_schema_field_in_order():
    names = ["step", "phase", "advance", "cache_instruction", "running", "waiting", "buckets",
             "groups", "width", "padding_fraction", "committed", "tok_per_step", "bucket",
             "prefill", "error"]
    fields = policy.step_fields(*range(100, 115))
    assert list(fields.items()) == list(zip(names, range(100, 115), strict=True))


# --------------------------------------------------------------------------------- schema v1 files


@pytest.mark.rule("trace schema v1, JSONL and CSV")
def test_the_trace_is_byte_identical_for_the_same_scenario_and_seed(tmp_path):
    sc = load_scenario(dict(GRANTED, batch=6, prompt_len=[4, 12], max_new_tokens=[10, 30],
                            steps=40, seed=3, arrival="staggered"))
    p1, p2, p3 = tmp_path / "a.jsonl", tmp_path / "b.jsonl", tmp_path / "c.jsonl"
    write_jsonl(lengths.run(sc), p1)
    write_jsonl(lengths.run(load_scenario(sc.to_dict())), p2)
    write_jsonl(lengths.run(load_scenario(sc.to_dict(), {"seed": 4})), p3)
    assert p1.read_bytes() == p2.read_bytes()
    assert p1.read_bytes() != p3.read_bytes()



@pytest.mark.rule("trace schema v1, JSONL and CSV")
def test_the_trace_follows_schema_v1_and_round_trips(tmp_path):
    sc = load_scenario({"batch": 3, "prompt_len": 6, "max_new_tokens": 9, "steps": 10, **GRANTED})
    tr = simulator.run(sc)
    path = tmp_path / "t.jsonl"
    write_jsonl(tr, path)
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    head, summary = lines[0], lines[-1]
    assert (head["type"], head["schema"], head["version"], head["mode"]) == (
        "header",
        "raggedspec-trace",
        1,
        "tensor",
    )
    assert load_scenario(head["scenario"]) == sc
    for s in lines[1:-1]:
        assert list(s)[: len(STEP_ORDER)] == STEP_ORDER
        for r in s["rows"]:
            assert list(r) == ROW_ORDER and r["lead"] == r["width"] - r["own_len"]
    assert list(summary)[:8] == SUMMARY_ORDER
    back = read_trace(path)
    assert list(back.lines()) == list(tr.lines())
    assert back.markers() == tr.markers()



@pytest.mark.rule("trace schema v1, JSONL and CSV")
def test_the_csv_has_one_line_per_step_and_row(tmp_path):
    tr = lengths.run(load_scenario({"batch": 3, "prompt_len": 6, "max_new_tokens": 9, "steps": 10}))
    path = tmp_path / "t.csv"
    write_csv(tr, path)
    text = path.read_text().splitlines()
    assert text[0] == ",".join(CSV_COLUMNS)
    assert len(text) - 1 == sum(len(s["rows"]) for s in tr.steps())
    back = read_trace(path)
    assert [r["own_len"] for s in back.steps() for r in s["rows"]] == \
        [r["own_len"] for s in tr.steps() for r in s["rows"]]
    first_decode = next(s for s in back.steps() if s["phase"] == "decode")
    assert (
        first_decode["rows"][0]["bucket"] == [6, 0, 0] or first_decode["rows"][0]["bucket"][0] == 6
    )


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


# -------------------------------------------------------------------------------- the loose reader


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


# ----------------------------------------------------------------------------- markers and summary


@pytest.mark.rule("MTP[agg] and SCHED[agg] markers")
def test_the_markers_are_the_spec_lines():
    tr = lengths.run(load_scenario({"batch": 4, "prompt_len": 8, "max_new_tokens": 20, "steps": 12,
                                    "acceptance": "all-accept", "depth": 3}))
    mtp, sched = tr.markers()
    assert mtp.startswith("MTP[agg] accept_rate=1.0000 ") and " tok_per_step=4.0000 " in mtp
    assert sched.startswith("SCHED[agg] calls=") and "shattered_frac=" in sched
    idle = lengths.run(load_scenario({"requests": [{"prompt_len": 4, "arrival": 50}], "steps": 3}))
    assert [m.split(" ")[0] for m in idle.markers()] == ["MTP[agg]"]  # no SCHED line at calls = 0
    assert [s["phase"] for s in idle.steps()] == ["idle"] * 3


@pytest.mark.rule("MTP[agg] and SCHED[agg] markers")
def test_the_summary_totals_are_brute_forced_from_a_fresh_run():
    # a fresh (uncached) run: one prompt step, then several decode steps
    tr = lengths.run(load_scenario(dict(batch=2, prompt_len=[3, 9], max_new_tokens=12, steps=8)))
    steps = list(tr.steps())
    decode = [s for s in steps if s["phase"] == "decode"]
    assert 2 <= len(decode) < len(steps) and len(decode) != len(steps) - len(decode)
    assert steps[-1]["committed"] < sum(s["committed"] for s in steps)  # non-degenerate
    assert tr.summary["steps"] == len(steps)
    assert tr.summary["decode_steps"] == len(decode)
    assert tr.summary["committed"] == sum(s["committed"] for s in steps)
    rows = [r for s in decode for r in s["rows"]]
    assert tr.summary["tok_per_step"] == sum(1 + r["accepted"] for r in rows) / len(rows) > 1


@pytest.mark.rule("MTP[agg] and SCHED[agg] markers")
def test_an_empty_run_summarizes_to_zeros():
    summary = policy.summarize(Trace("lengths", {}), AcceptanceTelemetry(), BucketTelemetry(),
                               KvAdvanceLatch(False, False), 0)
    assert {k: summary[k] for k in ("steps", "decode_steps", "committed", "tok_per_step",
                                    "max_spread", "mean_padding_fraction", "refusal", "errors",
                                    "shattered_steps")} == {
        "steps": 0, "decode_steps": 0, "committed": 0, "tok_per_step": 0.0, "max_spread": 0,
        "mean_padding_fraction": 0.0, "refusal": None, "errors": 0, "shattered_steps": 0}


@pytest.mark.rule(
    "window check, the two guards and the deferral",
    "MTP[agg] and SCHED[agg] markers",
)
def test_deferred_steps_count_in_the_summarys_spread_and_padding():
    """A `defer` step runs the plain decode on the batched cache, leads included, so the
    summary's max_spread and mean_padding_fraction count it (brute force over the trace's
    decode and defer steps). Non-degenerate: in this WA cohort run every decode step has
    spread 0 and only the deferred steps carry the leads."""
    sc = load_scenario(
        dict(batch=4, prompt_len=[3, 9], max_new_tokens=25, steps=16, world="WA", xs_per_seq=True)
    )
    for tr in (lengths.run(sc), simulator.run(sc)):
        steps = list(tr.steps())
        measured = [s for s in steps if s["phase"] in ("decode", "defer")]

        def spread(s):
            return max(r["own_len"] for r in s["rows"]) - min(r["own_len"] for r in s["rows"])

        assert any(s["phase"] == "defer" and s["padding_fraction"] > 0 for s in measured)
        assert max(spread(s) for s in steps if s["phase"] == "decode") == 0
        assert tr.summary["max_spread"] == max(spread(s) for s in measured) > 0
        assert tr.summary["mean_padding_fraction"] == pytest.approx(
            sum(s["padding_fraction"] for s in measured) / len(measured), abs=1e-15)
        assert tr.summary["shattered_steps"] == sum(s["buckets"] > 1 for s in measured)
