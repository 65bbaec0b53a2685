"""The strict trace reader on JSON lines (reference/trace_reader.py, docs/trace.md "Reading a
trace"): simulator traces read back exactly; every malformation named as FILE:LINE with the
field, its value and what it must be, all of them up to the limit; each known field's type and
range at its edges (the 32-bit length limit, the closed ratio interval, finite rates, booleans
never counting as integers) with the exact text of every check; a single problem shown as its
one line, long values cut short; the header and summary rules and the line order; the
file-level refusals; string sequence ids made dense integers; and `drift --trace` refusing a
malformed trace with exit 2. The CSV form is in test_trace_reader_csv.py.
"""

from __future__ import annotations

import json

import pytest

from raggedspec.cli import main
from raggedspec.conformance.helpers import (
    GRANTED,
    TRACE_HEADER as HEADER,
    TRACE_STEP as STEP,
    only_problem,
    problems,
    write_trace_lines as write,
)
from raggedspec.reference import lengths
from raggedspec.reference.scenario import load_scenario
from raggedspec.reference.trace import read_trace, write_csv, write_jsonl
from raggedspec.reference.trace_reader import TraceError, _one_of, read_trace_strict

DECODE = {**STEP, "phase": "decode"}
ONE_OF_PHASE = 'must be one of "prompt", "decode", "defer", "idle"'


def with_row(**fields) -> str:
    return json.dumps({**DECODE, "rows": [{"seq": 0, "own_len": 5, **fields}]})


def step_with(**fields):
    return {**STEP, **fields}


def row_with(**fields):
    return {**STEP, "rows": [{"seq": 0, "own_len": 5, **fields}]}


@pytest.mark.rule("the strict trace reader")
def test_simulator_traces_read_back_exactly_from_jsonl_and_csv(tmp_path):
    tr = lengths.run(load_scenario({"batch": 3, "prompt_len": [6, 12], "max_new_tokens": [10, 20],
                                    "depth": 3, "steps": 14, "seed": 2,
                                    "acceptance": "heterogeneous:0.2,0.9", **GRANTED}))
    write_jsonl(tr, tmp_path / "t.jsonl")
    write_csv(tr, tmp_path / "t.csv")
    for name in ("t.jsonl", "t.csv"):
        strict, loose = read_trace_strict(tmp_path / name), read_trace(tmp_path / name)
        assert list(strict.steps()) == list(loose.steps()) == list(tr.steps())
    assert read_trace_strict(tmp_path / "t.jsonl").header == tr.header



# ----------------------------------------------------------------------- malformations, each named


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
            [json.dumps({**DECODE, "phase": "Decode"})],
            1,
            'field \'phase\' = "Decode": must be one of "prompt"',
        ),
        (
            [json.dumps({**DECODE, "phase": "verify"})],
            1,
            "field 'phase' = \"verify\": must be one of",
        ),
        (
            [json.dumps({**DECODE, "advance": "ragged"})],
            1,
            "field 'advance' = \"ragged\": must be one of",
        ),
        (
            [json.dumps({**DECODE, "padding_fraction": 1.5})],
            1,
            "field 'padding_fraction' = 1.5: must be a number in [0, 1]",
        ),
        (
            [json.dumps(DECODE), json.dumps(DECODE)],
            2,
            (
                "field 'step' = 0: must be greater than the previous step 0 (line 1): "
                "steps strictly increase"
            ),
        ),
        (
            [json.dumps({**DECODE, "step": 5}), json.dumps({**DECODE, "step": 3})],
            2,
            "field 'step' = 3: must be greater than the previous step 5 (line 1)",
        ),
        (
            [json.dumps({**DECODE, "rows": [{"seq": 1, "own_len": 2}, {"seq": 1, "own_len": 3}]})],
            1,
            "field 'rows[].seq' = 1: must be unique in its step, rows[0] has it too (rows[1])",
        ),
        (
            [
                json.dumps({"type": "header", "schema": "raggedspec-trace", "version": 2}),
                json.dumps(DECODE),
            ],
            1,
            "field 'version' = 2: must be 1",
        ),
        (
            [
                json.dumps({"type": "header", "schema": "other-trace", "version": 1}),
                json.dumps(DECODE),
            ],
            1,
            'field \'schema\' = "other-trace": must be "raggedspec-trace"',
        ),
        (
            [
                json.dumps(DECODE),
                json.dumps({"type": "header", "schema": "raggedspec-trace", "version": 1}),
            ],
            2,
            "a header that is not the first line",
        ),
        (
            [json.dumps({"type": "summary"}), json.dumps({**DECODE, "step": 1})],
            2,
            "a line after the summary",
        ),
        (
            [json.dumps({"type": "footer"}), json.dumps(DECODE)],
            1,
            "field 'type' = \"footer\": must be one of",
        ),
        (
            [json.dumps(DECODE).replace("5}", "NaN}")],
            1,
            "not a JSON object (NaN is not a JSON number)",
        ),
        (["{oops", json.dumps({**DECODE, "step": 1})], 1, "not a JSON object"),
        (["[1, 2]", json.dumps(DECODE)], 1, "not a JSON object (a list)"),
    ],
)
def test_each_malformation_is_named_by_file_line_field_and_rule(tmp_path, lines, line, expected):
    path = write(tmp_path, lines, "bad.jsonl")
    with pytest.raises(TraceError) as err:
        read_trace_strict(path)
    assert f"{path}:{line}: {expected}" in str(err.value)



@pytest.mark.rule("the strict trace reader")
def test_every_problem_is_reported_up_to_the_limit(tmp_path):
    rows = [{"seq": i, "own_len": -i - 1} for i in range(30)]
    path = write(tmp_path, [json.dumps({**DECODE, "rows": rows})], "bad.jsonl")
    with pytest.raises(TraceError) as err:
        read_trace_strict(path, limit=5)
    assert len(err.value.problems) == 5 and err.value.more == 25
    assert "30 problems in the trace" in str(err.value) and "... and 25 more problem(s)" in str(
        err.value
    )
    assert "field 'rows[].own_len' = -5: must be an integer >= 0 (rows[4])" in str(err.value)



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


@pytest.mark.rule("the strict trace reader")
def test_one_of_names_every_allowed_value():
    check = _one_of(("a", "b c"))
    assert check("a") is None and check("b c") is None
    assert check("c") == 'must be one of "a", "b c"' and check(None) == 'must be one of "a", "b c"'


@pytest.mark.rule("the strict trace reader")
def test_the_rows_after_a_non_object_row_are_still_checked(tmp_path):
    path = write(tmp_path, [step_with(rows=[5, {"seq": 0, "own_len": -1}])])
    assert problems(path) == [
        f"{path}:1: field 'rows[0]' = 5: must be a row object",
        f"{path}:1: field 'rows[].own_len' = -1: must be an integer >= 0 (rows[1])",
    ]


# --------------------------------------------------------------------- header, summary, line order


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
def test_a_step_without_its_own_bucket_takes_its_first_rows(tmp_path):
    rows = [{"seq": 0, "own_len": 5, "bucket": [5, False]}, {"seq": 1, "own_len": 5}]
    tr = read_trace_strict(write(tmp_path, [step_with(rows=rows),
                                            step_with(step=1, bucket=[9], rows=rows),
                                            step_with(step=2, rows=[])]))
    assert tr.step_fields(0) == {"step": 0, "bucket": [5, False]}
    assert tr.step_fields(1)["bucket"] == [9] and tr.step_fields(2) == {"step": 2}


# ----------------------------------------------------------------------------- the file as a whole


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
def test_the_bad_byte_is_placed_on_its_line(tmp_path):
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(b"\n" + json.dumps(STEP).encode() + b"\n\xe9\n\n\n")
    at = len(json.dumps(STEP)) + 2
    assert only_problem(path).startswith(f"{path}:3: not UTF-8 text (byte {at}:")


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


@pytest.mark.rule("the strict trace reader")
def test_the_default_limit_is_20_problems(tmp_path):
    rows = [{"seq": i, "own_len": -1} for i in range(23)]
    with pytest.raises(TraceError) as err:
        read_trace_strict(write(tmp_path, [step_with(rows=rows)]))
    assert len(err.value.problems) == 20 and err.value.more == 3


# ------------------------------------------------------------------------------------ sequence ids


@pytest.mark.rule("the strict trace reader")
def test_string_sequence_ids_are_read_and_can_be_made_integers(tmp_path):
    lines = [
        json.dumps({"step": 0, "rows": [{"seq": "req-b", "own_len": 4}, {"seq": 7, "own_len": 6}]}),
        json.dumps(
            {"step": 1, "rows": [{"seq": "req-a", "own_len": 5}, {"seq": "req-b", "own_len": 5}]}
        ),
    ]
    path = write(tmp_path, lines, "ids.jsonl")
    assert [r["seq"] for r in read_trace_strict(path).rows(1)] == ["req-a", "req-b"]
    dense = read_trace_strict(path, int_ids=True)
    assert [r["seq"] for r in dense.rows(0)] == [8, 7] and [r["seq"] for r in dense.rows(1)] == [
        9,
        8,
    ]
    assert dense.seq_names == {8: "req-b", 9: "req-a"}



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
def test_an_int_and_a_string_id_are_different_sequences(tmp_path):
    rows = [{"seq": 1, "own_len": 2}, {"seq": "1", "own_len": 3}]
    assert len(read_trace_strict(write(tmp_path, [step_with(rows=rows)])).rows(0)) == 2


# --------------------------------------------------- drift reads a trace through the strict reader


@pytest.mark.slow
@pytest.mark.rule("raggedspec drift: plot data from a trace", "the strict trace reader")
def test_drift_trace_exits_2_on_a_malformed_trace_and_reads_string_ids(tmp_path, capsys):
    bad = write(tmp_path, [with_row(own_len=-3),
                           json.dumps({**DECODE, "step": 1, "phase": "Decode"})], "bad.jsonl")
    code = main(["drift", "--trace", str(bad), "--out", str(tmp_path / "d"), "-q"])
    err = capsys.readouterr().err
    assert code == 2
    assert (
        f"{bad}:1: field 'rows[].own_len' = -3" in err
        and f"{bad}:2: field 'phase' = \"Decode\"" in err
    )
    good = write(
        tmp_path,
        [
            json.dumps(
                {
                    "step": t,
                    "rows": [{"seq": "a", "own_len": 10 + 2 * t}, {"seq": "b", "own_len": 10 + t}],
                }
            )
            for t in range(4)
        ],
        "ids.jsonl",
    )
    code = main(["drift", "--trace", str(good), "--out", str(tmp_path / "d"), "-q"])
    out = capsys.readouterr().out
    assert code == 0 and "max_spread=3" in out

