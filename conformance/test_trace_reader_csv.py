"""The strict trace reader on CSV (reference/trace_reader.py, docs/trace.md "CSV"): each cell
typed as its JSONL field, every malformation named by its line and column (bad cells, values
over the 32-bit limit, half-set groups, cell counts, missing columns), the lines of one step
agreeing on every step field, the schema extensions read and checked, the made header and a
suffix read in any case. The JSON lines form is in test_trace_reader.py.
"""

from __future__ import annotations

import pytest

from raggedspec.conformance.helpers import (
    TRACE_HEADER as HEADER,
    only_problem,
    problems,
)
from raggedspec.reference.trace_reader import TraceError, read_trace_strict


def csv_file(tmp_path, text, name="t.csv"):
    path = tmp_path / name
    path.write_text(text)
    return path


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


@pytest.mark.rule("the strict trace reader")
@pytest.mark.parametrize("text, shown", [
    ("step,seq,own_len\nx,1,4\n", "field 'step' = \"x\": must be an integer >= 0"),
    ("step,seq,own_len\n-1,1,4\n", "field 'step' = \"-1\": must be an integer >= 0"),
    ("step,seq,own_len\n0,,4\n", "field 'seq' = null: is required"),
    ("step,seq,own_len\n0,1,\n", "field 'own_len' = null: is required"),
    ("step,seq,own_len\n0,1,-4\n", "field 'own_len' = \"-4\": must be an integer >= 0"),
    ("step,seq,own_len,u\n0,1,4,-1\n", "field 'u' = -1: must be an integer >= 0"),
    ("step,seq,own_len,group_u,group_start\n0,1,4,,2\n",
     "field 'group_u' = null, 'group_start' = 2: both empty or both set"),
    ("step,seq,own_len,group_u,group_start\n0,1,4,1,-2\n",
     "field 'group_start' = -2: must be an integer >= 0"),
    ("step,seq,own_len,group_u,group_start\n0,1,4,x,0\n",
     "field 'group_u' = \"x\": must be an integer >= 0"),
    ("step,seq,own_len,padding_fraction\n0,1,4,nan\n",
     "field 'padding_fraction' = NaN: must be a number in [0, 1]"),
    ("step,seq,own_len,tok_per_step\n0,1,4,inf\n",
     "field 'tok_per_step' = Infinity: must be a finite number >= 0"),
    ("step,seq,own_len,tok_per_step\n0,1,4,fast\n",
     "field 'tok_per_step' = \"fast\": must be a finite number >= 0"),
    ("step,seq,own_len,running\n0,1,4,1.0\n", "field 'running' = \"1.0\": must be an integer >= 0"),
    ("step,seq,own_len,step_width\n0,1,4,-3\n",
     "field 'step_width' = -3: must be an integer >= 0"),
    ("step,seq,own_len,prefill\n0,1,4,2::3\n",
     "field 'prefill' = [2, null, 3]: must be a list of sequence ids (integers >= 0 or non-empty "
     "strings)"),
    ("step,seq,own_len,accepted_pos\n0,1,4,1:x\n",
     "field 'accepted_pos' = [1, \"x\"]: must be a list of 0 / 1 (one per draft position)"),
])
def test_a_bad_csv_cell_is_the_one_line_naming_its_column(tmp_path, text, shown):
    path = csv_file(tmp_path, text)
    assert only_problem(path) == f"{path}:2: {shown}"


@pytest.mark.rule("the strict trace reader")
@pytest.mark.parametrize("text, shown", [
    ("step,seq,own_len,group_u,group_start\n0,1,4,1,2147483648\n",
     "field 'group_start' = 2147483648: must be an integer <= 2147483647"),
    ("step,seq,own_len\n0,2147483648,4\n",
     "field 'seq' = 2147483648: must be an integer >= 0 or a non-empty string"),
    ("step,seq,own_len\n0,1,2147483648\n",
     "field 'own_len' = \"2147483648\": must be an integer <= 2147483647"),
    ("step,seq,own_len,bucket\n0,1,4,8:1\n0,2,4,\n",
     "field 'bucket' = \"\": must equal the step's value on its first line 2 ([8, 1])"),
])
def test_csv_values_over_the_32_bit_limit_and_a_bucket_that_goes_missing(tmp_path, text, shown):
    path = csv_file(tmp_path, text)
    line = 3 if "bucket" in text else 2
    assert only_problem(path) == f"{path}:{line}: {shown}"


@pytest.mark.rule("the strict trace reader")
def test_every_bad_csv_line_is_reported_and_the_reading_goes_on(tmp_path):
    path = csv_file(tmp_path, "step,seq,own_len\n0,1\nx,1,4\n1,2,-1\n2,2,4\n")
    assert problems(path) == [
        f"{path}:2: 2 cells, the header has 3 columns",
        f"{path}:3: field 'step' = \"x\": must be an integer >= 0",
        f"{path}:4: field 'own_len' = \"-1\": must be an integer >= 0",
    ]
    path = csv_file(tmp_path, "step\n0\n", "cols.csv")
    assert only_problem(path) == f"{path}:1: CSV header lacks the required column(s) seq, own_len"


@pytest.mark.rule("the strict trace reader")
def test_the_lines_of_a_csv_step_agree_on_every_step_field(tmp_path):
    head = "step,seq,own_len,step_width,error,bucket\n"
    path = csv_file(tmp_path, head + "0,1,4,8,,8:1\n0,2,4,9,,8:1\n0,3,4,8,oops,8:2\n")
    assert sorted(problems(path)) == [  # the fields of a line in any order
        f"{path}:3: field 'step_width' = \"9\": must equal the step's value on its first "
        "line 2 (8)",
        f"{path}:4: field 'bucket' = \"8:2\": must equal the step's value on its first line 2 "
        "([8, 1])",
        f"{path}:4: field 'error' = \"oops\": must equal the step's value on its first line 2 "
        "(null)",
    ]


@pytest.mark.rule("the strict trace reader")
def test_csv_cells_are_typed_as_their_jsonl_fields(tmp_path):
    head = ("step,phase,running,padding_fraction,tok_per_step,seq,own_len,group_u,group_start,"
            "chain_start,bucket,step_width,step_committed,prefill,error\n")
    path = csv_file(tmp_path, head
                    + "0,decode,2,0.25,1.5,7,5,1,0,4,-2:TRUE:False:x,9,3,a:4,guard\n"
                    + "\n"
                    + "0,decode,2,0.25,1.5,a,6,,,,-2:TRUE:False:x,9,3,a:4,guard\n"
                    + "1,idle,,,,0,5,,,,,,,,\n")
    tr = read_trace_strict(path)
    assert tr.step_lines == [2, 5]
    assert tr.step_fields(0) == {
        "step": 0, "phase": "decode", "running": 2, "padding_fraction": 0.25,
        "tok_per_step": 1.5, "width": 9, "committed": 3, "prefill": ["a", 4], "error": "guard",
        "bucket": [-2, True, False, "x"]}
    assert tr.rows(0) == [
        {"seq": 7, "own_len": 5, "chain_start": 4, "group": [1, 0],
         "bucket": [-2, True, False, "x"]},
        {"seq": "a", "own_len": 6, "chain_start": None, "group": None,
         "bucket": [-2, True, False, "x"]},
    ]
    assert tr.step_fields(1) == {"step": 1, "phase": "idle", "running": None,
                                 "padding_fraction": None, "tok_per_step": None, "width": None,
                                 "committed": None, "prefill": [], "error": None}


@pytest.mark.rule("the strict trace reader")
def test_an_empty_accepted_pos_cell_is_no_field(tmp_path):
    path = csv_file(tmp_path, "step,seq,own_len,accepted_pos\n0,1,4,\n0,2,4,1:0\n")
    rows = read_trace_strict(path).rows(0)
    assert "accepted_pos" not in rows[0] and rows[1]["accepted_pos"] == [1, 0]


@pytest.mark.rule("the strict trace reader")
def test_a_csv_trace_has_the_made_header_and_is_read_by_its_suffix_in_any_case(tmp_path):
    path = csv_file(tmp_path, "step,seq,own_len,error\n0,1,4,\"left\r\nguard\"\n", "t.CSV")
    tr = read_trace_strict(path)
    assert tr.header == {**HEADER, "mode": "unknown", "scenario": None}
    assert tr.step_fields(0)["error"] == "left\r\nguard"


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
