"""The strict trace reader's field rules one by one (reference/trace_reader.py, docs/trace.md
"Reading a trace"): each known field's type and range at its edges (the 32-bit length limit,
the closed ratio interval, finite rates, booleans never counting as integers), the exact
"what it must be" text of every check, a single problem shown as its one line, long values
cut short, the header and summary rules, the file-level refusals (missing, not UTF-8, no
step, an empty CSV) and string sequence ids made dense integers. test_trace_reader.py holds
the reader's round trip and its first malformation table.
"""

from __future__ import annotations

import json

import pytest

from raggedspec.reference.trace_reader import TraceError, _one_of, read_trace_strict

STEP = {"type": "step", "step": 0, "rows": [{"seq": 0, "own_len": 5}]}
HEADER = {"type": "header", "schema": "raggedspec-trace", "version": 1}
ONE_OF_PHASE = 'must be one of "prompt", "decode", "defer", "idle"'


def write(tmp_path, objs, name="t.jsonl"):
    path = tmp_path / name
    path.write_text("".join((o if isinstance(o, str) else json.dumps(o)) + "\n" for o in objs))
    return path


def problems(path) -> list[str]:
    with pytest.raises(TraceError) as err:
        read_trace_strict(path)
    return err.value.problems


def only_problem(path) -> str:
    """The refusal of a trace with exactly one problem: its one line is the message."""
    with pytest.raises(TraceError) as err:
        read_trace_strict(path)
    assert err.value.problems == [str(err.value)] and err.value.more == 0
    return str(err.value)


def step_with(**fields):
    return {**STEP, **fields}


def row_with(**fields):
    return {**STEP, "rows": [{"seq": 0, "own_len": 5, **fields}]}


# ------------------------------------------------------------ values at the edges of their range


@pytest.mark.rule("the strict trace reader")
@pytest.mark.parametrize("obj", [
    row_with(own_len=2**31 - 1, u=0, drafted=0, filled=2**31 - 1),
    step_with(padding_fraction=0, tok_per_step=0),
    step_with(padding_fraction=1, tok_per_step=7.5),
    step_with(padding_fraction=1.0, cache_instruction=None, error=None, groups=None),
    step_with(phase="defer", advance="cohort", cache_instruction="Reset"),
    step_with(phase="idle", advance="per-sequence", cache_instruction="Nothing", rows=[]),
    step_with(bucket=[40, True, "x", 0], prefill=[1, "req-a"], error="capacity refused"),
    row_with(group=[0, 0], chain_start=0, bucket=[], accepted_pos=[1, 0]),
    row_with(group=None, chain_start=None, accepted_pos=[]),
])
def test_values_at_the_edges_of_their_range_are_read(tmp_path, obj):
    tr = read_trace_strict(write(tmp_path, [obj]))
    assert len(tr) == 1 and tr.step_lines == [1]


@pytest.mark.rule("the strict trace reader")
@pytest.mark.parametrize("obj, shown", [
    (row_with(own_len=2**31), f"field 'rows[].own_len' = {2**31}: must be an integer <= "
                              f"{2**31 - 1} (rows[0])"),
    (row_with(u=-1), "field 'rows[].u' = -1: must be an integer >= 0 (rows[0])"),
    (row_with(chain_start=True), "field 'rows[].chain_start' = true: must be an integer >= 0 "
                                 "(rows[0])"),
    (row_with(group=[1, -1]), "field 'rows[].group' = [1, -1]: must be null or [u, start], two "
                              "integers >= 0 (rows[0])"),
    (row_with(group=[1, 2, 3]), "field 'rows[].group' = [1, 2, 3]: must be null or [u, start], "
                                "two integers >= 0 (rows[0])"),
    (row_with(group="1:2"), "field 'rows[].group' = \"1:2\": must be null or [u, start], two "
                            "integers >= 0 (rows[0])"),
    (row_with(bucket=[1.5]), "field 'rows[].bucket' = [1.5]: must be a list of integers, "
                             "booleans or strings (rows[0])"),
    (row_with(accepted_pos=[1, True]), "field 'rows[].accepted_pos' = [1, true]: must be a list "
                                       "of 0 / 1 (one per draft position) (rows[0])"),
    (row_with(accepted_pos=[2]), "field 'rows[].accepted_pos' = [2]: must be a list of 0 / 1 "
                                 "(one per draft position) (rows[0])"),
    (row_with(accepted_pos=1), "field 'rows[].accepted_pos' = 1: must be a list of 0 / 1 (one "
                               "per draft position) (rows[0])"),
    (row_with(seq=True), "field 'rows[].seq' = true: must be an integer >= 0 or a non-empty "
                         "string (rows[0])"),
    (step_with(padding_fraction=-0.5), "field 'padding_fraction' = -0.5: must be a number in "
                                       "[0, 1]"),
    (step_with(padding_fraction=True), "field 'padding_fraction' = true: must be a number in "
                                       "[0, 1]"),
    (step_with(padding_fraction="0.5"), "field 'padding_fraction' = \"0.5\": must be a number in "
                                        "[0, 1]"),
    (step_with(tok_per_step=-1), "field 'tok_per_step' = -1: must be a finite number >= 0"),
    (step_with(tok_per_step=False), "field 'tok_per_step' = false: must be a finite number >= 0"),
    (step_with(tok_per_step="2"), "field 'tok_per_step' = \"2\": must be a finite number >= 0"),
    (step_with(phase="Prompt"), f"field 'phase' = \"Prompt\": {ONE_OF_PHASE}"),
    (step_with(advance="Cohort"), "field 'advance' = \"Cohort\": must be one of \"cohort\", "
                                  "\"per-sequence\""),
    (step_with(cache_instruction="Out"), "field 'cache_instruction' = \"Out\": must be one of "
                                         "\"In\", \"Nothing\", \"Reset\""),
    (step_with(running=-2), "field 'running' = -2: must be an integer >= 0"),
    (step_with(groups=1.0), "field 'groups' = 1.0: must be an integer >= 0"),
    (step_with(error=3), "field 'error' = 3: must be a string"),
    (step_with(bucket="40"), "field 'bucket' = \"40\": must be a list of integers, booleans or "
                             "strings"),
    (step_with(prefill=[-1]), "field 'prefill' = [-1]: must be a list of sequence ids "
                              "(integers >= 0 or non-empty strings)"),
    (step_with(prefill="1"), "field 'prefill' = \"1\": must be a list of sequence ids "
                             "(integers >= 0 or non-empty strings)"),
    (step_with(step=-1), "field 'step' = -1: must be an integer >= 0"),
    (step_with(step="0"), "field 'step' = \"0\": must be an integer >= 0"),
    (step_with(step=None), "field 'step' = null: is required (an integer >= 0)"),
    ({"type": "step", "rows": []}, "field 'step' = null: is required (an integer >= 0)"),
    ({"type": "step"}, "field 'step' = null: is required (an integer >= 0)"),
    ({"type": "step", "step": 0}, "field 'rows' = null: is required (a list of row objects)"),
    (step_with(rows={"seq": 0}), "field 'rows' = {\"seq\": 0}: is required (a list of row "
                                 "objects)"),
    (step_with(rows=[5]), "field 'rows[0]' = 5: must be a row object"),
    (step_with(rows=[{"own_len": 3}]), "field 'rows[].seq' = null: is required (rows[0])"),
    (step_with(rows=[{"seq": 0}]), "field 'rows[].own_len' = null: is required (rows[0])"),
    (step_with(phase="x" * 80), 'field \'phase\' = "' + "x" * 56 + f"...: {ONE_OF_PHASE}"),
    (step_with(phase="x" * 58), 'field \'phase\' = "' + "x" * 58 + f'": {ONE_OF_PHASE}'),
    (step_with(phase="x" * 59), 'field \'phase\' = "' + "x" * 56 + f"...: {ONE_OF_PHASE}"),
    (step_with(phase=""), f"field 'phase' = \"\": {ONE_OF_PHASE}"),
    (row_with(seq=2**31), f"field 'rows[].seq' = {2**31}: must be an integer >= 0 or a non-empty "
                          "string (rows[0])"),
    (row_with(seq=[1]), "field 'rows[].seq' = [1]: must be an integer >= 0 or a non-empty "
                        "string (rows[0])"),
    (step_with(rows=[5, {"seq": 0, "own_len": 1}]), "field 'rows[0]' = 5: must be a row object"),
])
def test_each_bad_value_is_the_one_line_naming_field_value_and_rule(tmp_path, obj, shown):
    """A value is shown as JSON, cut to 57 characters and "..." when it is longer than 60."""
    path = write(tmp_path, [obj])
    assert only_problem(path) == f"{path}:1: {shown}"


# ----------------------------------------------------------------- header, summary, line order


@pytest.mark.rule("the strict trace reader")
@pytest.mark.parametrize("header, shown", [
    ({**HEADER, "version": True}, "field 'version' = true: must be 1 (this reader knows schema "
                                  "version 1 only)"),
    ({**HEADER, "version": "1"}, "field 'version' = \"1\": must be 1 (this reader knows schema "
                                 "version 1 only)"),
    ({**HEADER, "version": 1.0}, "field 'version' = 1.0: must be 1 (this reader knows schema "
                                 "version 1 only)"),
    ({"type": "header", "version": 1}, "field 'schema' = null: must be \"raggedspec-trace\""),
    ({**HEADER, "mode": 3}, "field 'mode' = 3: must be a string"),
    ({**HEADER, "scenario": [1]}, "field 'scenario' = [1]: must be an object (the resolved "
                                  "scenario)"),
])
def test_a_bad_header_field_is_named(tmp_path, header, shown):
    path = write(tmp_path, [header, STEP])
    assert only_problem(path) == f"{path}:1: {shown}"


@pytest.mark.rule("the strict trace reader")
def test_a_header_with_mode_and_scenario_is_kept_and_a_missing_one_is_made(tmp_path):
    header = {**HEADER, "mode": "lengths", "scenario": {"batch": 1}}
    assert read_trace_strict(write(tmp_path, [header, STEP])).header == header
    assert read_trace_strict(write(tmp_path, [{**HEADER, "scenario": None}, STEP])).header == {
        **HEADER, "scenario": None}
    made = read_trace_strict(write(tmp_path, [STEP])).header
    assert made == {**HEADER, "mode": "unknown", "scenario": None}


@pytest.mark.rule("the strict trace reader")
def test_the_summary_is_checked_kept_and_last(tmp_path):
    summary = {"type": "summary", "steps": 1, "decode_steps": 0, "committed": 3,
               "tok_per_step": 0.0, "max_spread": 0, "mean_padding_fraction": 1.0,
               "refusal": None, "errors": 0, "markers": ["MTP[agg] x"], "shattered_steps": 0}
    assert read_trace_strict(write(tmp_path, [HEADER, STEP, summary])).summary == summary
    bad = {"type": "summary", "steps": -1, "mean_padding_fraction": 2, "refusal": 1,
           "markers": ["a", 1], "tok_per_step": -0.5}
    path = write(tmp_path, [STEP, bad])
    assert problems(path) == [
        f"{path}:2: field 'steps' = -1: must be an integer >= 0",
        f"{path}:2: field 'tok_per_step' = -0.5: must be a finite number >= 0",
        f"{path}:2: field 'mean_padding_fraction' = 2: must be a number in [0, 1]",
        f"{path}:2: field 'refusal' = 1: must be a string",
        f"{path}:2: field 'markers' = [\"a\", 1]: must be a list of strings",
    ]
    path = write(tmp_path, [STEP, {"type": "summary"}, {**STEP, "step": 1}])
    assert only_problem(path) == (
        f"{path}:3: a line after the summary (the summary is the last line)")


@pytest.mark.rule("the strict trace reader")
def test_line_order_rules_name_the_line_and_the_one_before(tmp_path):
    path = write(tmp_path, [HEADER, HEADER, STEP])
    assert only_problem(path) == f"{path}:2: a header that is not the first line"
    # a refused step does not become "the previous step": 3 and 4 both follow step 5
    path = write(tmp_path, [step_with(step=5), step_with(step=3), step_with(step=4),
                            step_with(step=6)])
    rule = "must be greater than the previous step 5 (line 1): steps strictly increase"
    assert problems(path) == [f"{path}:2: field 'step' = 3: {rule}",
                              f"{path}:3: field 'step' = 4: {rule}"]
    path = write(tmp_path, [{"type": "footer"}, STEP])
    assert only_problem(path) == (
        f'{path}:1: field \'type\' = "footer": must be one of "header", "step", "summary"')
    path = write(tmp_path, ["", "  ", json.dumps(STEP), "", json.dumps(step_with(step=2))])
    tr = read_trace_strict(path)
    assert tr.step_lines == [3, 5] and [tr.step_fields(i)["step"] for i in range(2)] == [0, 2]


@pytest.mark.rule("the strict trace reader")
def test_a_step_without_its_own_bucket_takes_its_first_rows(tmp_path):
    rows = [{"seq": 0, "own_len": 5, "bucket": [5, False]}, {"seq": 1, "own_len": 5}]
    tr = read_trace_strict(write(tmp_path, [step_with(rows=rows),
                                            step_with(step=1, bucket=[9], rows=rows),
                                            step_with(step=2, rows=[])]))
    assert tr.step_fields(0) == {"step": 0, "bucket": [5, False]}
    assert tr.step_fields(1)["bucket"] == [9] and tr.step_fields(2) == {"step": 2}


# ------------------------------------------------------------------------- the file as a whole


@pytest.mark.rule("the strict trace reader")
def test_file_level_refusals(tmp_path):
    missing = tmp_path / "none.jsonl"
    with pytest.raises(FileNotFoundError) as err:
        read_trace_strict(missing)
    assert str(err.value) == f"trace file {missing} does not exist"
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(json.dumps(STEP).encode() + b"\n" + b'{"step": 1, "phase": "\xe9"}\n')
    assert only_problem(path) == (
        f"{path}:2: not UTF-8 text (byte {len(json.dumps(STEP)) + 23}: invalid continuation "
        "byte); a trace is JSON lines or CSV in UTF-8")
    path = write(tmp_path, [HEADER])
    assert only_problem(path) == (
        f"{path}:1: no step in the trace (a step line needs a `step` and a `rows` list)")
    path = write(tmp_path, ['"a step"', STEP])
    assert only_problem(path) == f"{path}:1: not a JSON object (a str)"
    empty = tmp_path / "e.csv"
    empty.write_text("")
    assert only_problem(empty) == f"{empty}:1: empty CSV file (no header line)"


@pytest.mark.rule("the strict trace reader")
def test_the_problem_limit_keeps_exactly_that_many_lines(tmp_path):
    rows = [{"seq": i, "own_len": -1} for i in range(3)]
    path = write(tmp_path, [step_with(rows=rows)])
    with pytest.raises(TraceError) as err:
        read_trace_strict(path, limit=3)
    assert len(err.value.problems) == 3 and err.value.more == 0
    assert str(err.value).startswith("3 problems in the trace:\n")
    assert "more problem" not in str(err.value)
    with pytest.raises(TraceError) as err:
        read_trace_strict(path, limit=2)
    assert str(err.value).endswith("\n... and 1 more problem(s)")


# ------------------------------------------------------------------------------------ CSV


def csv_file(tmp_path, text, name="t.csv"):
    path = tmp_path / name
    path.write_text(text)
    return path


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


# ---------------------------------------------------------------------------- dense int ids


@pytest.mark.rule("the strict trace reader")
def test_int_ids_number_string_ids_after_the_largest_int_in_first_seen_order(tmp_path):
    lines = [
        step_with(prefill=["p"], rows=[{"seq": "b", "own_len": 4}, {"seq": 3, "own_len": 5}]),
        step_with(step=1, prefill=["b", 3], rows=[{"seq": "a", "own_len": 5}]),
    ]
    path = write(tmp_path, lines)
    tr = read_trace_strict(path, int_ids=True)
    # first seen: "p" (a prefill id), "b", 3, "a"; ints keep theirs, strings count from 4
    assert tr.seq_names == {4: "p", 5: "b", 6: "a"}
    assert tr.step_fields(0)["prefill"] == [4] and tr.step_fields(1)["prefill"] == [5, 3]
    assert [r["seq"] for r in tr.rows(0)] == [5, 3] and [r["seq"] for r in tr.rows(1)] == [6]
    ints = read_trace_strict(write(tmp_path, [step_with(prefill=[2])], "i.jsonl"), int_ids=True)
    assert ints.seq_names == {} and ints.step_fields(0)["prefill"] == [2]
    assert read_trace_strict(path).seq_names == {}
    only_strings = write(tmp_path, [step_with(rows=[{"seq": "z", "own_len": 1}])], "s.jsonl")
    assert read_trace_strict(only_strings, int_ids=True).seq_names == {0: "z"}


@pytest.mark.rule("the strict trace reader")
def test_one_of_names_every_allowed_value():
    check = _one_of(("a", "b c"))
    assert check("a") is None and check("b c") is None
    assert check("c") == 'must be one of "a", "b c"' and check(None) == 'must be one of "a", "b c"'


@pytest.mark.rule("the strict trace reader")
def test_an_int_and_a_string_id_are_different_sequences(tmp_path):
    rows = [{"seq": 1, "own_len": 2}, {"seq": "1", "own_len": 3}]
    assert len(read_trace_strict(write(tmp_path, [step_with(rows=rows)])).rows(0)) == 2


@pytest.mark.rule("the strict trace reader")
def test_the_default_limit_is_20_problems(tmp_path):
    rows = [{"seq": i, "own_len": -1} for i in range(23)]
    with pytest.raises(TraceError) as err:
        read_trace_strict(write(tmp_path, [step_with(rows=rows)]))
    assert len(err.value.problems) == 20 and err.value.more == 3


@pytest.mark.rule("the strict trace reader")
def test_a_csv_trace_has_the_made_header_and_is_read_by_its_suffix_in_any_case(tmp_path):
    path = csv_file(tmp_path, "step,seq,own_len,error\n0,1,4,\"left\r\nguard\"\n", "t.CSV")
    tr = read_trace_strict(path)
    assert tr.header == {**HEADER, "mode": "unknown", "scenario": None}
    assert tr.step_fields(0)["error"] == "left\r\nguard"


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
def test_an_empty_accepted_pos_cell_is_no_field(tmp_path):
    path = csv_file(tmp_path, "step,seq,own_len,accepted_pos\n0,1,4,\n0,2,4,1:0\n")
    rows = read_trace_strict(path).rows(0)
    assert "accepted_pos" not in rows[0] and rows[1]["accepted_pos"] == [1, 0]


@pytest.mark.rule("the strict trace reader")
def test_the_rows_after_a_non_object_row_are_still_checked(tmp_path):
    path = write(tmp_path, [step_with(rows=[5, {"seq": 0, "own_len": -1}])])
    assert problems(path) == [
        f"{path}:1: field 'rows[0]' = 5: must be a row object",
        f"{path}:1: field 'rows[].own_len' = -1: must be an integer >= 0 (rows[1])",
    ]


@pytest.mark.rule("the strict trace reader")
def test_every_bad_line_is_reported_and_a_refused_step_is_not_the_previous_one(tmp_path):
    path = write(tmp_path, ["{oops", "[1]", step_with(step=5), step_with(step=5),
                            step_with(step=4)])
    rule = "must be greater than the previous step 5 (line 3): steps strictly increase"
    got = problems(path)
    assert got[0].startswith(f"{path}:1: not a JSON object (")
    assert got[1:] == [f"{path}:2: not a JSON object (a list)",
                       f"{path}:4: field 'step' = 5: {rule}",
                       f"{path}:5: field 'step' = 4: {rule}"]


@pytest.mark.rule("the strict trace reader")
def test_the_bad_byte_is_placed_on_its_line(tmp_path):
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(b"\n" + json.dumps(STEP).encode() + b"\n\xe9\n\n\n")
    at = len(json.dumps(STEP)) + 2
    assert only_problem(path).startswith(f"{path}:3: not UTF-8 text (byte {at}:")
