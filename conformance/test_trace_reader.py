"""The strict trace reader (reference/trace_reader.py): every malformation named as FILE:LINE
with the field, its value and what it must be, all of them up to the limit; simulator traces
(JSONL and CSV) read back exactly; `drift --trace` refuses a malformed trace with exit 2.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from raggedspec.conformance.test_check_trace import GRANTED, cli, small_run, write_lines
from raggedspec.reference.trace import read_trace, write_csv, write_jsonl
from raggedspec.reference.trace_reader import TraceError, read_trace_strict


@pytest.mark.rule("the strict trace reader")
def test_simulator_traces_read_back_exactly_from_jsonl_and_csv(tmp_path):
    tr = small_run(**GRANTED)
    write_jsonl(tr, tmp_path / "t.jsonl")
    write_csv(tr, tmp_path / "t.csv")
    for name in ("t.jsonl", "t.csv"):
        strict, loose = read_trace_strict(tmp_path / name), read_trace(tmp_path / name)
        assert list(strict.steps()) == list(loose.steps()) == list(tr.steps())
    assert read_trace_strict(tmp_path / "t.jsonl").header == tr.header


STEP = {"type": "step", "step": 0, "phase": "decode", "rows": [{"seq": 0, "own_len": 5}]}


def with_row(**fields) -> str:
    return json.dumps({**STEP, "rows": [{"seq": 0, "own_len": 5, **fields}]})


@pytest.mark.rule("the strict trace reader")
@pytest.mark.parametrize(
    "lines, line, expected",
    [
        ([with_row(own_len=-3)], 1, "field 'rows[].own_len' = -3: must be an integer >= 0"),
        ([with_row(own_len=4.0)], 1, "field 'rows[].own_len' = 4.0: must be an integer >= 0"),
        ([with_row(own_len=True)], 1, "field 'rows[].own_len' = true: must be an integer >= 0"),
        ([with_row(own_len=1e30)], 1, "field 'rows[].own_len' = 1e+30: must be an integer >= 0"),
        (
            [with_row(own_len=2**40)],
            1,
            f"field 'rows[].own_len' = {2**40}: must be an integer <= 2147483647",
        ),
        ([with_row(accepted="2")], 1, "field 'rows[].accepted' = \"2\": must be an integer >= 0"),
        ([with_row(group=[1])], 1, "field 'rows[].group' = [1]: must be null or [u, start]"),
        (
            [with_row(seq=-1)],
            1,
            "field 'rows[].seq' = -1: must be an integer >= 0 or a non-empty string",
        ),
        (
            [with_row(seq="")],
            1,
            "field 'rows[].seq' = \"\": must be an integer >= 0 or a non-empty string",
        ),
        (
            [json.dumps({**STEP, "phase": "Decode"})],
            1,
            'field \'phase\' = "Decode": must be one of "prompt"',
        ),
        (
            [json.dumps({**STEP, "phase": "verify"})],
            1,
            "field 'phase' = \"verify\": must be one of",
        ),
        (
            [json.dumps({**STEP, "advance": "ragged"})],
            1,
            "field 'advance' = \"ragged\": must be one of",
        ),
        (
            [json.dumps({**STEP, "padding_fraction": 1.5})],
            1,
            "field 'padding_fraction' = 1.5: must be a number in [0, 1]",
        ),
        (
            [json.dumps(STEP), json.dumps(STEP)],
            2,
            (
                "field 'step' = 0: must be greater than the previous step 0 (line 1): "
                "steps strictly increase"
            ),
        ),
        (
            [json.dumps({**STEP, "step": 5}), json.dumps({**STEP, "step": 3})],
            2,
            "field 'step' = 3: must be greater than the previous step 5 (line 1)",
        ),
        (
            [json.dumps({**STEP, "rows": [{"seq": 1, "own_len": 2}, {"seq": 1, "own_len": 3}]})],
            1,
            "field 'rows[].seq' = 1: must be unique in its step, rows[0] has it too (rows[1])",
        ),
        (
            [
                json.dumps({"type": "header", "schema": "raggedspec-trace", "version": 2}),
                json.dumps(STEP),
            ],
            1,
            "field 'version' = 2: must be 1",
        ),
        (
            [
                json.dumps({"type": "header", "schema": "other-trace", "version": 1}),
                json.dumps(STEP),
            ],
            1,
            'field \'schema\' = "other-trace": must be "raggedspec-trace"',
        ),
        (
            [
                json.dumps(STEP),
                json.dumps({"type": "header", "schema": "raggedspec-trace", "version": 1}),
            ],
            2,
            "a header that is not the first line",
        ),
        (
            [json.dumps({"type": "summary"}), json.dumps({**STEP, "step": 1})],
            2,
            "a line after the summary",
        ),
        (
            [json.dumps({"type": "footer"}), json.dumps(STEP)],
            1,
            "field 'type' = \"footer\": must be one of",
        ),
        (
            [json.dumps(STEP).replace("5}", "NaN}")],
            1,
            "not a JSON object (NaN is not a JSON number)",
        ),
        (["{oops", json.dumps({**STEP, "step": 1})], 1, "not a JSON object"),
        (["[1, 2]", json.dumps(STEP)], 1, "not a JSON object (a list)"),
    ],
)
def test_each_malformation_is_named_by_file_line_field_and_rule(tmp_path, lines, line, expected):
    path = write_lines(tmp_path / "bad.jsonl", lines)
    with pytest.raises(TraceError) as err:
        read_trace_strict(path)
    assert f"{path}:{line}: {expected}" in str(err.value)


@pytest.mark.rule("the strict trace reader")
def test_every_problem_is_reported_up_to_the_limit(tmp_path):
    rows = [{"seq": i, "own_len": -i - 1} for i in range(30)]
    path = write_lines(tmp_path / "bad.jsonl", [json.dumps({**STEP, "rows": rows})])
    with pytest.raises(TraceError) as err:
        read_trace_strict(path, limit=5)
    assert len(err.value.problems) == 5 and err.value.more == 25
    assert "30 problems in the trace" in str(err.value) and "... and 25 more problem(s)" in str(
        err.value
    )
    assert "field 'rows[].own_len' = -5: must be an integer >= 0 (rows[4])" in str(err.value)


@pytest.mark.rule("the strict trace reader")
def test_string_sequence_ids_are_read_and_can_be_made_integers(tmp_path):
    lines = [
        json.dumps({"step": 0, "rows": [{"seq": "req-b", "own_len": 4}, {"seq": 7, "own_len": 6}]}),
        json.dumps(
            {"step": 1, "rows": [{"seq": "req-a", "own_len": 5}, {"seq": "req-b", "own_len": 5}]}
        ),
    ]
    path = write_lines(tmp_path / "ids.jsonl", lines)
    assert [r["seq"] for r in read_trace_strict(path).rows(1)] == ["req-a", "req-b"]
    dense = read_trace_strict(path, int_ids=True)
    assert [r["seq"] for r in dense.rows(0)] == [8, 7] and [r["seq"] for r in dense.rows(1)] == [
        9,
        8,
    ]
    assert dense.seq_names == {8: "req-b", 9: "req-a"}


@pytest.mark.rule("the strict trace reader")
@pytest.mark.parametrize(
    "text, line, expected",
    [
        ("step,seq,own_len\n0,1,x\n", 2, "field 'own_len' = \"x\": must be an integer >= 0"),
        ("step,seq,own_len\n0,1,2.5\n", 2, "field 'own_len' = \"2.5\": must be an integer >= 0"),
        ("step,seq,own_len,phase\n0,1,4,verify\n", 2, "field 'phase' = \"verify\": must be one of"),
        (
            "step,seq,own_len,phase\n0,1,4,decode\n0,2,4,prompt\n",
            3,
            (
                'field \'phase\' = "prompt": must equal the step\'s value on its first line 2 '
                '("decode")'
            ),
        ),
        (
            "step,seq,own_len\n1,1,4\n0,1,4\n",
            3,
            "field 'step' = 0: must be greater than the previous step 1",
        ),
        (
            "step,seq,own_len\n0,1,4\n1,1,5\n0,1,6\n",
            4,
            "field 'step' = 0: must be greater than the previous step 1 (line 3)",
        ),
        (
            "step,seq,own_len\n0,1,4\n0,1,5\n",
            3,
            "field 'seq' = 1: must be unique in its step, line 2 has it too",
        ),
        ("step,seq,own_len\n0,1\n", 2, "2 cells, the header has 3 columns"),
        ("step,seq\n0,1\n", 1, "CSV header lacks the required column(s) own_len"),
        (
            "step,seq,own_len,group_u,group_start\n0,1,4,1,\n",
            2,
            "field 'group_u' = 1, 'group_start' = null: both empty or both set",
        ),
    ],
)
def test_csv_malformations_are_named_by_line(tmp_path, text, line, expected):
    path = tmp_path / "bad.csv"
    path.write_text(text)
    with pytest.raises(TraceError) as err:
        read_trace_strict(path)
    assert f"{path}:{line}: {expected}" in str(err.value)


@pytest.mark.rule("raggedspec drift: plot data from a trace", "the strict trace reader")
def test_drift_trace_exits_2_on_a_malformed_trace_and_reads_string_ids(tmp_path):
    bad = write_lines(
        tmp_path / "bad.jsonl",
        [with_row(own_len=-3), json.dumps({**STEP, "step": 1, "phase": "Decode"})],
    )
    code, _, err = cli("drift", "--trace", str(bad), "--out", str(tmp_path / "d"), "-q")
    assert code == 2
    assert (
        f"{bad}:1: field 'rows[].own_len' = -3" in err
        and f"{bad}:2: field 'phase' = \"Decode\"" in err
    )
    good = write_lines(
        tmp_path / "ids.jsonl",
        [
            json.dumps(
                {
                    "step": t,
                    "rows": [{"seq": "a", "own_len": 10 + 2 * t}, {"seq": "b", "own_len": 10 + t}],
                }
            )
            for t in range(4)
        ],
    )
    code, out, _ = cli("drift", "--trace", str(good), "--out", str(tmp_path / "d"), "-q")
    assert code == 0 and "max_spread=3" in out


@pytest.mark.rule("the strict trace reader")
def test_the_schema_extensions_are_read_and_checked_in_csv(tmp_path):
    head = "step,phase,advance,seq,own_len,width,lead,q0,dead_cols,accepted_pos\n"
    path = tmp_path / "ext.csv"
    path.write_text(head + "0,decode,per-sequence,a,10,12,2,10,2,1:0:0\n")
    row = read_trace_strict(path).rows(0)[0]
    assert (row["q0"], row["dead_cols"], row["accepted_pos"]) == (10, 2, [1, 0, 0])
    path.write_text(head + "0,decode,per-sequence,a,10,12,2,-1,x,1:2\n")
    with pytest.raises(TraceError) as err:
        read_trace_strict(path)
    text = str(err.value)
    assert f"{path}:2: field 'q0' = -1: must be an integer >= 0" in text
    assert f"{path}:2: field 'dead_cols' = \"x\": must be an integer >= 0" in text
    assert f"{path}:2: field 'accepted_pos' = [1, 2]: must be a list of 0 / 1" in text


@pytest.mark.rule("trace schema v1, JSONL and CSV", "the strict trace reader")
def test_rows_read_as_dicts_become_the_int_row_array_with_minus_one_for_null():
    from raggedspec.reference.trace import COL, ROW_COLUMNS, Trace

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
