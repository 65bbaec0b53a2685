"""Dispatch resolvers (reference/dispatch.py): each returns the scalar (pre-change)
representation for a uniform batch and the per-row form otherwise. Two paths that agree bit for
bit are told apart only by testing the predicate (cache-and-draft.md §6, §8.2, §9, §10.1, §14;
masks §1, §2, §11, §12, §22).

The port has no dispatch code of its own: its attention and RoPE call these functions on host
integers (their "uniform batch never takes the ragged path" counters are tested in
test_attention_dsv4.py and test_rope.py). Malformed input is a ValueError whose message names
the values, one condition broken per case, so a check whose `and` became `or` lets a case
through; the smallest legal values are accepted.
"""

import re

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from raggedspec.conformance.helpers import assert_refused, malformed_cases
from raggedspec.conformance.strategies import (
    drafting_rows,
    lead_pads,
    ragged_lengths,
    uniform_lengths,
)
from raggedspec.reference.dispatch import (
    CaptureOffsets,
    MtpHiddenCapture,
    chain_start_of,
    draft_group_key,
    draft_groups,
    draft_step_end_column,
    ragged_row_q0,
    resolve_capture_offsets,
    resolve_draft_leads,
    resolve_ragged_chain_starts,
    resolve_ragged_rows,
    resolve_row_cache_lens,
    resolve_row_offsets,
    uniform_seqlen_offset,
)
from raggedspec.reference.errors import DispatchRefusal

# --- masks §2: resolve_ragged_rows ---------------------------------------------------------


@pytest.mark.rule("resolve_ragged_rows")
def test_resolve_ragged_rows_table():
    assert resolve_ragged_rows(None, 12, 3) is None
    assert resolve_ragged_rows([7, 7, 7, 7], 7, 4) is None
    assert resolve_ragged_rows([12, 10, 7], 12, 3) == [12, 10, 7]
    with pytest.raises(DispatchRefusal, match="per-row query positions for a batch of") as e:
        resolve_ragged_rows([6, 4], 6, 3)
    assert "2" in str(e.value) and "3" in str(e.value)
    with pytest.raises(DispatchRefusal, match="AHEAD of the batch") as e:
        resolve_ragged_rows([7, 4, 2], 6, 3)
    assert "7" in str(e.value)
    with pytest.raises(DispatchRefusal, match="no row sits at the batch's shared end column") as e:
        resolve_ragged_rows([5, 4, 2], 6, 3)
    assert "6" in str(e.value)


@pytest.mark.rule("resolve_ragged_rows", "§22 dispatch tests: each predicate tested directly")
def test_a_uniform_batch_never_reaches_the_ragged_path():
    # empty and a uniform vector of the WRONG length are filtered before the width check
    assert resolve_ragged_rows([], 9, 3) is None
    assert resolve_ragged_rows([9, 9], 9, 3) is None
    assert resolve_ragged_rows([9], 9, 1) is None


@pytest.mark.rule("resolve_ragged_rows")
def test_resolve_ragged_rows_check_order():
    # width is checked before "ahead": a wrong-width vector with a row ahead is a width refusal
    with pytest.raises(DispatchRefusal, match="for a batch of"):
        resolve_ragged_rows([9, 4], 6, 3)
    # "ahead" is checked before "no row at the end"
    with pytest.raises(DispatchRefusal, match="AHEAD"):
        resolve_ragged_rows([7, 5, 5], 6, 3)
    # a row exactly at q0 is not ahead (> not >=)
    assert resolve_ragged_rows([6, 5, 5], 6, 3) == [6, 5, 5]
    # a vector LONGER than the batch is a width refusal too (not only a shorter one)
    with pytest.raises(
        DispatchRefusal, match=re.escape("4 per-row query positions for a batch of 3")
    ):
        resolve_ragged_rows([6, 4, 5, 6], 6, 3)


@pytest.mark.rule("resolve_ragged_rows")
@given(lengths=ragged_lengths(min_rows=1, max_rows=8))
def test_resolve_ragged_rows_dispatch_property(lengths):
    q0 = max(lengths)
    got = resolve_ragged_rows(lengths, q0, len(lengths))
    if len(set(lengths)) == 1:
        assert got is None
    else:
        assert got == lengths


# --- masks §11: uniform_seqlen_offset --------------------------------------------------------


@pytest.mark.rule("uniform_seqlen_offset", "§22 dispatch tests: each predicate tested directly")
def test_uniform_seqlen_offset_examples():
    assert uniform_seqlen_offset([]) is None
    assert uniform_seqlen_offset([7]) == 7
    assert uniform_seqlen_offset([5, 5, 5]) == 5
    assert uniform_seqlen_offset([6, 4, 2]) is None
    assert uniform_seqlen_offset([10, 7]) is None
    assert uniform_seqlen_offset([0, 0]) == 0


# --- masks §1 / §22: resolve_row_offsets -----------------------------------------------------


@pytest.mark.rule("resolve_row_offsets")
def test_a_batch_with_no_per_row_offset_takes_the_shared_path():
    assert resolve_row_offsets([None, None, None], 17) is None
    assert resolve_row_offsets([], 17) is None


@pytest.mark.rule("resolve_row_offsets")
def test_a_row_with_its_own_offset_makes_the_whole_batch_per_row():
    assert resolve_row_offsets([40, 33, 37], 17) == [40, 33, 37]
    assert resolve_row_offsets([40, None], 17) == [40, 17]  # the batch's offset, not 0
    # cache-and-draft §16 PerSequence example: set_prefill_toks_at(window, cache_lens[i]),
    # shared offset 0 -> every row's own position, which is also its row_q0
    assert resolve_row_offsets([12, 10], 0) == [12, 10]


@pytest.mark.rule("resolve_row_offsets")
def test_equal_overrides_are_not_collapsed_into_the_shared_offset():
    """The scalar path reads `shared`, not the common value: collapsing `[40, 40]` with
    shared 0 would put both rows at position 0. The RoPE dispatch collapses it downstream."""
    got = resolve_row_offsets([40, 40], 0)
    assert got == [40, 40]
    assert uniform_seqlen_offset(got) == 40


@pytest.mark.rule("resolve_row_offsets", "§22 dispatch tests: each predicate tested directly")
@given(b=st.integers(0, 12), shared=st.integers(0, 5000), data=st.data())
def test_resolve_row_offsets_dispatch_property(b, shared, data):
    # uniform (no row carries its own offset) -> the scalar form, at every width
    assert resolve_row_offsets([None] * b, shared) is None
    per_seq = data.draw(
        st.lists(st.one_of(st.none(), st.integers(0, 5000)), min_size=b, max_size=b)
    )
    got = resolve_row_offsets(per_seq, shared)
    if all(o is None for o in per_seq):
        assert got is None
    else:
        assert got == [shared if o is None else o for o in per_seq]


# --- §6 capture --------------------------------------------------------------------------------


@pytest.mark.rule("CaptureOffsets::row", "CaptureOffsets::describes", "resolve_capture_offsets")
def test_the_capture_offsets_collapse_when_the_rows_agree_and_survive_when_they_do_not():
    one = CaptureOffsets([12])
    assert [one.row(r) for r in range(4)] == [12, 12, 12, 12]
    assert one.row(99) == 12  # r >= B still answers for a one-element vector
    assert one.describes(4) and one.describes(1) and one.describes(0)
    per_row = CaptureOffsets([12, 9, 11])
    assert per_row.row(0) == 12 and per_row.row(1) == 9 and per_row.row(2) == 11
    assert per_row.row(3) is None
    assert per_row.describes(3)
    assert not per_row.describes(4) and not per_row.describes(2) and not per_row.describes(1)
    assert resolve_capture_offsets([12, 12, 12, 12]).values == (12,)
    empty = resolve_capture_offsets([])
    assert empty.values == (0,) and empty.row(0) == 0  # the legitimate "no offsets" path
    assert resolve_capture_offsets([12, 9, 11]).values == (12, 9, 11)
    # a vector that agrees except for one row is kept whole
    assert resolve_capture_offsets([12, 12, 11]).values == (12, 12, 11)


@pytest.mark.rule("MtpHiddenCapture")
def test_mtp_hidden_capture_stores_only_while_armed_and_take_clears():
    cap = MtpHiddenCapture()
    assert cap.armed is False and cap.take() is None  # a fresh capture: disarmed and empty
    h = np.arange(6.0).reshape(1, 2, 3)
    cap.store(5, h)
    assert not cap.armed and cap.take() is None
    cap.arm()
    assert cap.armed
    cap.store(5, h)
    offsets, got = cap.take()
    assert offsets == CaptureOffsets([5]) and got is h
    assert cap.take() is None  # take clears
    cap.store_rows([10, 8, 5], h)
    h2 = np.zeros((3, 1, 3))
    cap.store_rows([7, 7, 7], h2)  # overwrites, and collapses a uniform vector
    offsets, got = cap.take()
    assert offsets.values == (7,) and got is h2
    cap.store_rows([10, 8, 5], h)
    offsets, _ = cap.take()
    assert [offsets.row(r) for r in range(3)] == [10, 8, 5]
    cap.store(3, h)
    cap.clear()
    assert cap.take() is None


# --- §8.2 per-row cache lengths ----------------------------------------------------------------


@pytest.mark.rule("resolve_row_cache_lens")
def test_a_uniform_batch_never_reaches_the_per_row_step_arithmetic():
    assert resolve_row_cache_lens(True, 40, [0, 0, 0, 0]) is None
    assert resolve_row_cache_lens(True, 40, []) is None


@pytest.mark.rule("resolve_row_cache_lens")
def test_the_per_row_step_arithmetic_is_opt_in():
    assert resolve_row_cache_lens(False, 40, [0, 7, 0, 3]) is None
    assert resolve_row_cache_lens(True, 40, [0, 7, 0, 3]) == [40, 33, 40, 37]


@pytest.mark.rule("resolve_row_cache_lens")
def test_a_batch_that_is_not_a_left_aligned_cohort_is_refused_by_name():
    with pytest.raises(DispatchRefusal) as e:
        resolve_row_cache_lens(True, 10, [0, 12])
    assert "wider than" in str(e.value) and "disagree" in str(e.value)
    assert "12" in str(e.value) and "10" in str(e.value)
    with pytest.raises(DispatchRefusal) as e:
        resolve_row_cache_lens(True, 10, [2, 3])
    assert "every row" in str(e.value) and "end column" in str(e.value)
    # the width refusal comes first even when no lead is 0
    with pytest.raises(DispatchRefusal, match="wider than"):
        resolve_row_cache_lens(True, 10, [2, 11])
    # a lead of exactly C is not wider than C
    assert resolve_row_cache_lens(True, 10, [0, 10]) == [10, 0]


@pytest.mark.rule("resolve_row_cache_lens")
@given(leads=lead_pads(min_rows=1, max_rows=8, max_lead=20), extra=st.integers(0, 30))
def test_resolve_row_cache_lens_dispatch_property(leads, extra):
    c = max(leads) + extra
    got = resolve_row_cache_lens(True, c, leads)
    if all(lead == 0 for lead in leads):
        assert got is None
    else:
        assert got == [c - lead for lead in leads]
    assert resolve_row_cache_lens(False, c, leads) is None


# --- §9 draft groups ------------------------------------------------------------------------------


@pytest.mark.rule("resolve_ragged_chain_starts")
def test_a_uniform_draft_group_never_reaches_the_ragged_chain_path():
    assert resolve_ragged_chain_starts([40, 40, 40]) is None
    assert resolve_ragged_chain_starts([40]) is None
    assert resolve_ragged_chain_starts([]) is None
    assert resolve_ragged_chain_starts([40, 33, 40]) == [40, 33, 40]  # the whole slice


@pytest.mark.rule("resolve_draft_leads")
def test_the_draft_leads_are_the_distance_to_the_groups_widest_row():
    assert resolve_draft_leads(True, [40, 33, 37, 40]) == [0, 7, 3, 0]
    assert resolve_draft_leads(True, [40, 40, 40]) is None
    assert resolve_draft_leads(False, [40, 33]) is None
    assert resolve_draft_leads(True, []) is None
    assert resolve_draft_leads(True, [7, 4, 6]) == [0, 3, 1]  # §9.7 / §17.3 group
    assert resolve_draft_leads(True, [11, 9]) == [0, 2]  # §16 PerSequence example
    assert resolve_draft_leads(True, [0, 2]) == [2, 0]  # 0 is a position


@pytest.mark.rule("chain_start_of", "draft_group_key")
def test_the_group_key_and_the_per_row_chain_start_are_the_same_expression():
    for c in (2, 3, 40, 4096):
        for u in range(1, 5):
            assert draft_group_key(u, c, False) == (u, chain_start_of(c, u))
            assert chain_start_of(c, u) == c + u - 2  # = L - 2 with L = C + u
            assert draft_group_key(u, c, True) == (u, 0)


@pytest.mark.rule("chain_start_of")
def test_chain_start_of_needs_a_pair_to_seed_from():
    assert chain_start_of(0, 2) == 0 and chain_start_of(1, 1) == 0 and chain_start_of(2, 0) == 0
    with pytest.raises(ValueError):
        chain_start_of(0, 1)


@pytest.mark.rule("draft_group_key")
def test_draft_group_key_keeps_u_zero_well_formed():
    """Decision (see draft_group_key): u = 0 is not refused by the key. plan_step_window
    already makes such a row not-ok before any group forms; callers (draft_groups, the port
    conformance) pass u = 0 and get the spec's expression."""
    assert draft_group_key(0, 5, False) == (0, 3) == (0, chain_start_of(5, 0))
    assert draft_group_key(0, 5, True) == (0, 0) and draft_group_key(0, 0, True) == (0, 0)
    assert draft_groups([0, 1], [5, 5], [True, True], 3, False) == {(0, 3): [0], (1, 4): [1]}
    with pytest.raises(ValueError, match="cache_len 1 \\+ u 0 < 2"):
        draft_group_key(0, 1, False)


@pytest.mark.rule("draft_groups")
def test_the_draft_group_partition_stops_collapsing_once_the_rows_carry_their_own_positions():
    mixed = [1, 2, 1, 3, 2, 1, 4, 1]
    w = 5
    shared = [40] * 8
    yes = [True] * 8
    for flag in (False, True):
        groups = draft_groups(mixed, shared, yes, w, flag)
        assert len(groups) == 4
        assert sorted(i for rows in groups.values() for i in rows) == list(range(8))
    own = [40, 33, 37, 31, 39, 35, 30, 38]
    assert len(draft_groups([1] * 8, own, yes, w, False)) == 8
    assert draft_groups([1] * 8, own, yes, w, True) == {(1, 0): list(range(8))}
    assert len(draft_groups(mixed, own, yes, w, False)) == 8
    per_row = draft_groups(mixed, own, yes, w, True)
    assert per_row == {(1, 0): [0, 2, 5, 7], (2, 0): [1, 4], (3, 0): [3], (4, 0): [6]}


@pytest.mark.rule("draft_groups")
def test_a_sequence_that_may_not_draft_is_in_no_draft_group():
    assert draft_groups([1, 1, 1], [10, 10, 10], [True, True, True], 3, False) == {
        (1, 9): [0, 1, 2]
    }
    assert draft_groups([1, 1, 1], [10, 10, 10], [True, False, True], 3, False) == {(1, 9): [0, 2]}
    assert draft_groups([1, 1, 1], [10, 10, 10], [False, False, False], 3, False) == {}
    assert draft_groups([3], [10], [True], 3, False) == {}  # u == w has no draft slot


@pytest.mark.rule("draft_groups")
def test_the_worked_examples_group_their_rows():
    # §16 cohort example: C=10, u=[1,2] -> (1,9)=[A], (2,10)=[B]
    assert draft_groups([1, 2], [10, 10], [True, True], 4, False) == {(1, 9): [0], (2, 10): [1]}
    # §16 PerSequence example: own lengths [12,10], u=[1,1] -> one group, starts [11,9]
    assert draft_groups([1, 1], [12, 10], [True, True], 4, True) == {(1, 0): [0, 1]}
    assert [chain_start_of(c, 1) for c in (12, 10)] == [11, 9]


@pytest.mark.rule("draft_groups")
def test_draft_group_keys_and_rows_are_ascending():
    groups = draft_groups([3, 1, 2, 1], [10, 10, 10, 10], [True] * 4, 4, True)
    assert list(groups) == [(1, 0), (2, 0), (3, 0)]
    assert groups[(1, 0)] == [1, 3]


@pytest.mark.rule("draft_group_key", "draft_groups")
@given(rows=st.one_of(drafting_rows(max_rows=256, max_len=5000), drafting_rows(max_len=60)),
       per_row=st.booleans())
def test_draft_groups_partition_the_drafting_rows_by_their_key(rows, per_row):
    """Membership is brute force (u < w and may draft); per-row keys give at most
    `depth + 1 = w` groups at any batch size (B up to 256), scalar keys one chain start per
    group (short lengths, so that rows share starts)."""
    u, lens, may, w = rows
    groups = draft_groups(u, lens, may, w, per_row)
    members = sorted(i for members in groups.values() for i in members)
    assert members == [i for i in range(len(u)) if u[i] < w and may[i]]
    if per_row:
        assert len(groups) <= w
    for (key_u, key_c), members in groups.items():
        assert members == sorted(members) and {u[i] for i in members} == {key_u}
        starts = {0} if per_row else {lens[i] + u[i] - 2 for i in members}
        assert starts == {key_c}


# --- §10.1 / masks §12 ---------------------------------------------------------------------------


@pytest.mark.rule("draft_step_end_column")
def test_the_draft_step_end_column_is_the_batch_maximum_and_refuses_every_other_layout():
    assert draft_step_end_column([7], 1, 7) == 7
    assert draft_step_end_column([7], 4, 7) == 7
    assert draft_step_end_column([7, 4, 6], 3, 7) == 7
    assert draft_step_end_column([4, 7, 6], 3, 7) == 7  # the maximum, not row 0
    assert draft_step_end_column([0], 0, 0) == 0
    with pytest.raises(DispatchRefusal) as e:
        draft_step_end_column([7], 1, 6)
    msg = str(e.value)
    assert "desync" in msg and "6" in msg and "7" in msg and "left-aligned" in msg
    with pytest.raises(DispatchRefusal, match="desync") as e:
        draft_step_end_column([7, 4, 6], 3, 6)
    with pytest.raises(DispatchRefusal, match="desync"):
        draft_step_end_column([7, 4, 6], 3, 4)  # min is refused too
    with pytest.raises(DispatchRefusal, match="desync"):
        draft_step_end_column([7, 9], 2, 7)
    with pytest.raises(DispatchRefusal, match=r"2 absolute position\(s\) for a batch of 3"):
        draft_step_end_column([7, 4], 3, 7)
    with pytest.raises(DispatchRefusal, match=r"4 absolute position\(s\) for a batch of 3"):
        draft_step_end_column([7, 7, 7, 7], 3, 7)
    with pytest.raises(DispatchRefusal, match="given no absolute position at all"):
        draft_step_end_column([], 1, 0)
    # masks §22 smoke test: a stale start of 137 on an empty cache -> "desync"
    with pytest.raises(DispatchRefusal, match="desync"):
        draft_step_end_column([137], 1, 0)


@pytest.mark.rule("ragged_row_q0")
def test_ragged_row_q0_is_opt_in():
    assert ragged_row_q0([10, 8, 5], False) is None
    assert ragged_row_q0([10, 8, 5], True) == [10, 8, 5]
    # a uniform vector passes through; attention's resolve_ragged_rows filters it back to None
    assert ragged_row_q0([9, 9], True) == [9, 9]
    assert resolve_ragged_rows(ragged_row_q0([9, 9], True), 9, 2) is None


# --- §14: every resolver returns the scalar form for a uniform batch -----------------------------


@pytest.mark.rule(
    "uniform_seqlen_offset",
    "§22 dispatch tests: each predicate tested directly",
    "resolve_capture_offsets",
)
@given(lengths=uniform_lengths(min_rows=1, max_rows=16, min_len=2, max_len=500))
def test_every_resolver_returns_the_scalar_form_for_a_uniform_batch(lengths):
    b, v = len(lengths), lengths[0]
    cap = resolve_capture_offsets(lengths)
    assert cap.values == (v,) and all(cap.row(r) == v for r in range(b + 2))
    assert resolve_ragged_chain_starts(lengths) is None
    assert resolve_draft_leads(True, lengths) is None
    assert resolve_row_cache_lens(True, v, [0] * b) is None
    assert resolve_ragged_rows(lengths, v, b) is None
    assert uniform_seqlen_offset(lengths) == v
    assert draft_step_end_column(lengths, b, v) == v
    assert len(draft_groups([1] * b, lengths, [True] * b, 4, False)) == 1


@pytest.mark.rule(
    "uniform_seqlen_offset",
    "resolve_capture_offsets",
    "resolve_ragged_chain_starts",
    "resolve_draft_leads",
)
@given(lengths=ragged_lengths(min_rows=2, max_rows=16, min_len=2, max_len=500, force_ragged=True))
def test_every_resolver_returns_the_per_row_form_for_a_ragged_batch(lengths):
    b, top = len(lengths), max(lengths)
    cap = resolve_capture_offsets(lengths)
    assert cap.values == tuple(lengths) and [cap.row(r) for r in range(b)] == lengths
    assert cap.row(b) is None
    assert resolve_ragged_chain_starts(lengths) == lengths
    leads = [top - n for n in lengths]
    assert resolve_draft_leads(True, lengths) == leads
    assert resolve_draft_leads(False, lengths) is None
    assert resolve_row_cache_lens(True, top, leads) == lengths
    assert resolve_ragged_rows(lengths, top, b) == lengths
    assert uniform_seqlen_offset(lengths) is None
    assert draft_step_end_column(lengths, b, top) == top


# --- malformed input and the zero boundaries -----------------------------------------------------

MALFORMED = [
    ("resolve_ragged_rows q0", lambda: resolve_ragged_rows(None, -1, 2),
     "q0 -1 and b 2 must be >= 0"),
    ("resolve_ragged_rows b", lambda: resolve_ragged_rows(None, 3, -1),
     "q0 3 and b -1 must be >= 0"),
    ("resolve_ragged_rows row", lambda: resolve_ragged_rows([3, -1], 3, 2),
     "row positions [3, -1] must be >= 0"),
    ("resolve_ragged_rows row first", lambda: resolve_ragged_rows([-1, 5], 5, 2),
     "row positions [-1, 5] must be >= 0"),
    ("resolve_draft_leads start", lambda: resolve_draft_leads(False, [2, -1]),
     "chain starts [2, -1] must be >= 0"),
    ("resolve_draft_leads start on", lambda: resolve_draft_leads(True, [-3, 2]),
     "chain starts [-3, 2] must be >= 0"),
    ("CaptureOffsets empty", lambda: CaptureOffsets([]),
     "capture offsets [] must hold at least one offset (resolve_capture_offsets maps none to [0])"),
    ("CaptureOffsets negative", lambda: CaptureOffsets([1, -2]),
     "capture offsets [1, -2] must be >= 0"),
    ("CaptureOffsets.row negative", lambda: CaptureOffsets([4]).row(-1), "row -1 must be >= 0"),
    ("resolve_row_offsets shared", lambda: resolve_row_offsets([3], -1),
     "shared offset -1 must be >= 0"),
    ("resolve_row_offsets per row", lambda: resolve_row_offsets([1, None, -2], 0),
     "per-row offsets [1, None, -2] must be >= 0"),
    ("resolve_row_cache_lens cache_len", lambda: resolve_row_cache_lens(True, -1, [0]),
     "cache_len -1 must be >= 0"),
    ("resolve_row_cache_lens lead", lambda: resolve_row_cache_lens(True, 5, [0, -1]),
     "lead_pad [0, -1] must be >= 0"),
    ("chain_start_of cache_len", lambda: chain_start_of(-1, 3),
     "cache_len -1 and u 3 must be >= 0"),
    ("chain_start_of u", lambda: chain_start_of(3, -1), "cache_len 3 and u -1 must be >= 0"),
    ("chain_start_of no pair", lambda: chain_start_of(1, 0),
     "cache_len 1 + u 0 < 2 has no chain start"),
    ("draft_group_key u", lambda: draft_group_key(-1, 5, True), "u -1 must be >= 0"),
    ("draft_groups cache_lens", lambda: draft_groups([1, 2], [5], [True, True], 3, True),
     "uncached (2), cache_lens (1) and may_draft (2) must have one entry per row"),
    ("draft_groups may_draft", lambda: draft_groups([1, 2], [5, 6], [True], 3, True),
     "uncached (2), cache_lens (2) and may_draft (1) must have one entry per row"),
    ("draft_groups w", lambda: draft_groups([1], [5], [True], 0, True), "window w 0 must be >= 1"),
    ("draft_step_end_column b", lambda: draft_step_end_column([3], -1, 3),
     "b -1 and cached 3 must be >= 0"),
    ("draft_step_end_column cached", lambda: draft_step_end_column([3], 1, -1),
     "b 1 and cached -1 must be >= 0"),
]


@pytest.mark.rule("malformed input and zero boundaries of the dispatch and step rules",
                  "resolve_ragged_rows", "resolve_draft_leads", "CaptureOffsets::row",
                  "resolve_row_offsets")
@malformed_cases(MALFORMED)
def test_malformed_input_is_a_value_error_naming_the_offending_values(call, message):
    assert_refused(ValueError, call, message)


@pytest.mark.rule("malformed input and zero boundaries of the dispatch and step rules")
def test_the_zero_boundaries_are_well_formed():
    # b == 0 and q0 == 0 are legal (an empty batch has no ragged rows)
    assert resolve_ragged_rows(None, 0, 0) is None
    assert resolve_ragged_rows([], 4, 0) is None
    assert resolve_ragged_rows([0, 2], 2, 2) == [0, 2]
    assert resolve_ragged_rows([0, 5], 5, 2) == [0, 5]
    assert CaptureOffsets([0]).row(0) == 0
    assert resolve_row_cache_lens(True, 0, [0]) is None
    assert resolve_row_offsets([0, 5], 0) == [0, 5] and resolve_row_offsets([None, 0], 3) == [3, 0]


# --- the row rules on arrays (the step plan calls them on the batch's NumPy rows) ------------


@pytest.mark.rule("resolve_row_cache_lens", "ragged_row_q0")
def test_the_row_length_rules_give_arrays_for_arrays_and_lists_for_lists():
    leads = np.array([0, 7, 0, 3])
    got = resolve_row_cache_lens(True, 40, leads)
    assert isinstance(got, np.ndarray) and got.tolist() == [40, 33, 40, 37]
    listed = resolve_row_cache_lens(True, 40, [0, 7, 0, 3])
    assert type(listed) is list and listed == [40, 33, 40, 37]
    assert resolve_row_cache_lens(True, 40, np.zeros(3, dtype=np.int64)) is None
    with pytest.raises(DispatchRefusal, match=re.escape("row 1's lead pad 41 is wider")):
        resolve_row_cache_lens(True, 40, np.array([0, 41, 50]))
    with pytest.raises(ValueError, match=re.escape("lead_pad [0, -1] must be >= 0")):
        resolve_row_cache_lens(True, 40, np.array([0, -1]))
    q0 = ragged_row_q0(np.array([12, 10]), True)
    assert isinstance(q0, np.ndarray) and q0.dtype == np.int64 and q0.tolist() == [12, 10]
    assert type(ragged_row_q0((12, 10), True)) is list
    assert ragged_row_q0(np.array([1]), False) is None


@pytest.mark.rule("chain_start_of", "draft_group_key", "draft_groups")
def test_the_draft_rules_give_arrays_for_arrays_with_the_scalar_values():
    """C §9.1 on rows: chain starts `C + u - 2` and keys per row, ints for ints; a malformed
    row is refused with its own values (the first in row order)."""
    c, u = np.array([12, 10, 9]), np.array([1, 1, 2])
    starts = chain_start_of(c, u)
    assert isinstance(starts, np.ndarray) and starts.tolist() == [11, 9, 9]
    assert type(chain_start_of(12, 1)) is int and chain_start_of(12, 1) == 11
    ku, ks = draft_group_key(u, c, True)
    assert ku is u and ks.tolist() == [0, 0, 0]
    assert draft_group_key(u, c, False)[1].tolist() == [11, 9, 9]
    key = draft_group_key(1, 12, True)
    assert key == (1, 0) and type(key[1]) is int
    with pytest.raises(ValueError, match=re.escape("cache_len 0 + u 1 < 2 has no chain start")):
        chain_start_of(np.array([5, 0, 1]), np.array([1, 1, 0]))
    with pytest.raises(ValueError, match=re.escape("cache_len -2 and u 1 must be >= 0")):
        chain_start_of(np.array([5, -2]), np.array([1, 1]))
    with pytest.raises(ValueError, match=re.escape("u -1 must be >= 0")):
        draft_group_key(np.array([1, -1]), c[:2], True)
    may = np.array([True, True, True])
    assert draft_groups(u, c, may, 4, True) == {(1, 0): [0, 1], (2, 0): [2]}
    assert draft_groups(u, c, may, 4, False) == {(1, 9): [1], (1, 11): [0], (2, 9): [2]}
    assert draft_groups(u, c, np.array([False, True, False]), 4, False) == {(1, 9): [1]}
    assert draft_groups(u, c, may, 2, True) == {(1, 0): [0, 1]}  # u == w has no draft slot
