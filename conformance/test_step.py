"""MTP step arithmetic, part one: the flags, the verify window, the verify rows, verify/accept
and the budget clamp (cache-and-draft.md §2, §8, §11, §16 step 3; masks-and-scheduling.md §19),
the rules on NumPy rows (as the lengths mode calls them), and the step arithmetic the port's
backend runs (the reference's functions, one test body over both backends). The advance rules,
the rollback, the per-sequence commit and the window guards are in test_step_advance.py.

The §17.1 simulation fixture (`conformance/helpers.py`) mirrors `sim_propose_and_verify`: a
deterministic target oracle, a draft oracle agreeing at a seeded rate, a verify block whose row
r has seen the window's first r + 1 tokens. Malformed input is a ValueError whose message names
the values, one condition broken per case.
"""

import itertools

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from raggedspec.conformance.helpers import (
    assert_refused,
    malformed_cases,
    sim_propose_and_verify,
    target_next,
)
from raggedspec.reference.capability import KvAdvance
from raggedspec.reference.step import (
    Verified,
    budget_clamp,
    mtp_window,
    n_cache_positions_to_drop,
    per_seq_advance,
    plan_batch_step,
    plan_per_sequence_step,
    plan_step_window,
    token_budget,
    verify_proposed,
    window_verify_row,
)
from raggedspec.reference.xs_rolling import MTP_DEPTH_CAP, XS_TAIL_MARGIN_TOKENS
from raggedspec.vectors.length_fns import RULES


# --- flags / small rules ------------------------------------------------------------------------


@pytest.mark.rule("--mtp-depth / window()")
def test_the_window_is_depth_plus_one_for_depth_zero_to_eight():
    assert [mtp_window(d) for d in range(9)] == list(range(1, 10))
    for bad in (-1, 9):
        with pytest.raises(ValueError):
            mtp_window(bad)


@pytest.mark.rule("depth cap <= XS_TAIL_MARGIN_TOKENS")
def test_mtp_depth_cap_stays_within_the_retained_rollback_margin():
    assert MTP_DEPTH_CAP == 8
    assert MTP_DEPTH_CAP <= XS_TAIL_MARGIN_TOKENS == 16


@pytest.mark.rule("per_seq_advance")
def test_per_seq_advance_needs_in_out_and_per_sequence():
    for assembled, out, adv in itertools.product((False, True), (False, True), KvAdvance):
        expected = assembled and out and adv is KvAdvance.PER_SEQUENCE
        assert per_seq_advance(assembled, out, adv) == expected


# --- §8.1 window --------------------------------------------------------------------------------


@pytest.mark.rule("plan_step_window")
def test_plan_step_window_examples():
    got = plan_step_window([40, 33, 37], [41, 34, 38], 4)
    assert got.uncached == [1, 1, 1] and got.ok
    got = plan_step_window([40, 40, 40], [41, 34, 38], 4)
    assert got.uncached == [1, 0, 0] and not got.ok
    assert not plan_step_window([12, 12], [13, 9], 4).ok
    assert plan_step_window([0], [2], 2).ok  # a row with no KV yet: c + u = 2 seeds a chain


@pytest.mark.rule("plan_step_window")
def test_per_row_lengths_are_what_keep_a_ragged_cohorts_tails_inside_the_window():
    own = [40, 33, 37]
    toks = [c + 1 for c in own]
    shared = plan_step_window([max(own)] * 3, toks, 4)
    assert shared.uncached == [1, 0, 0] and not shared.ok
    per_row = plan_step_window(own, toks, 4)
    assert per_row.uncached == [1, 1, 1] and per_row.ok


@pytest.mark.rule("plan_step_window")
def test_the_window_invariant_is_what_keeps_the_verify_slice_in_range():
    verdicts = []
    for cache_lens in ([10, 10, 10], [10, 7, 9], [3, 3, 3]):
        for extra in (0, 1, 2, 4, 5):
            toks = [c + extra for c in cache_lens]
            got = plan_step_window(cache_lens, toks, 4)
            verdicts.append(got.ok)
            if got.ok:  # toks[c:] is non-empty
                assert all(c < t for c, t in zip(cache_lens, toks, strict=True))
    assert True in verdicts and False in verdicts


@pytest.mark.rule("plan_step_window")
def test_the_window_invariant_is_unchanged_for_a_uniform_batch():
    w = 4
    for c in (0, 1, 2, 9):
        for tails in ([1, 1], [1, 4], [0, 1], [5, 1]):
            got = plan_step_window([c, c], [c + t for t in tails], w)
            legacy = c + min(tails) >= 2 and all(1 <= t <= w for t in tails)
            assert got.ok == legacy, (c, tails)
            assert got.uncached == tails


@pytest.mark.rule("plan_step_window")
@given(data=st.data())
def test_plan_step_window_ok_implies_the_cache_is_behind_the_tokens(data):
    b = data.draw(st.integers(1, 8))
    w = data.draw(st.integers(1, 9))
    cache = data.draw(st.lists(st.integers(0, 40), min_size=b, max_size=b))
    toks = data.draw(st.lists(st.integers(0, 50), min_size=b, max_size=b))
    got = plan_step_window(cache, toks, w)
    pairs = list(zip(cache, toks, strict=True))
    assert got.uncached == [max(t - c, 0) for c, t in pairs]
    assert got.ok == all(c + max(t - c, 0) >= 2 and 1 <= t - c <= w for c, t in pairs)
    if got.ok:
        assert all(c < t for c, t in pairs)


# --- §8.3 verify rows ---------------------------------------------------------------------------


@pytest.mark.rule("window_verify_row")
def test_window_verify_row_is_u_minus_one_plus_j():
    assert window_verify_row(1, 0) == 0
    assert window_verify_row(2, 0) == 1
    assert window_verify_row(3, 2) == 4
    with pytest.raises(ValueError):
        window_verify_row(0, 0)


@pytest.mark.rule("window_verify_row")
def test_window_verify_row_off_by_one_destroys_acceptance():
    w, toks = 4, [1, 11]
    d, a, emitted = sim_propose_and_verify(0, toks, 1, w, rate=1.0)
    assert (d, a, len(emitted)) == (3, 3, 4)
    # the emitted tokens are the target's own greedy continuation
    expect, last = [], toks[-1]
    for n in range(2, 6):
        last = target_next(0, last, n)
        expect.append(last)
    assert emitted == expect
    for shifted in (lambda u, j: u + j, lambda u, j: max(u - 2 + j, 0)):
        _, a_bad, _ = sim_propose_and_verify(0, toks, 1, w, rate=1.0, verify_row=shifted)
        assert a_bad < 3


@pytest.mark.rule("window_verify_row")
def test_the_sampled_token_is_row_u_minus_one_plus_a():
    # a partial accept: the non-draft token is the target's correction at position L + a
    for s in range(40):
        toks = [5, 9, 13]
        d, a, emitted = sim_propose_and_verify(s, toks, 2, 5, rate=0.5)
        if a < d:
            last = toks[-1] if a == 0 else emitted[a - 1]
            assert emitted[a] == target_next(s, last, len(toks) + a)
            break
    else:
        pytest.fail("no partial accept in 40 streams: degenerate fixture")


# --- §11 verify and budget ----------------------------------------------------------------------


@pytest.mark.rule("verify_proposed")
def test_verify_proposed_lossless_contract():
    v = verify_proposed([10, 20, 30], [10, 20, 99])
    assert (v.accepted, v.rejection, v.commit_len) == ([10, 20], (2, 99), 3)


@pytest.mark.rule("verify_proposed")
def test_verify_proposed_all_accepted():
    v = verify_proposed([1, 2, 3], [1, 2, 3, 4])
    assert (v.accepted, v.rejection, v.commit_len) == ([1, 2, 3], None, 3)
    v = verify_proposed([1, 2, 3], [1, 2])
    assert (v.accepted, v.rejection, v.commit_len) == ([1, 2], None, 2)


@pytest.mark.rule("verify_proposed")
def test_verify_proposed_immediate_rejection():
    v = verify_proposed([10, 20], [99, 20])
    assert (v.accepted, v.rejection, v.commit_len) == ([], (0, 99), 1)


@pytest.mark.rule("verify_proposed")
def test_speculative_mtp_v4_verify_accepts_at_least_40pct():
    proposed = list(range(32))
    target = [i if i < 16 else i + 1000 for i in range(32)]
    v = verify_proposed(proposed, target)
    assert len(v.accepted) == 16 and v.rejection == (16, 1016) and v.commit_len == 17


@pytest.mark.rule("verify_proposed")
@given(
    proposed=st.lists(st.integers(0, 3), max_size=10),
    target=st.lists(st.integers(0, 3), max_size=10),
)
def test_verify_proposed_matches_a_brute_force_oracle(proposed, target):
    n = min(len(proposed), len(target))
    k = max(i for i in range(n + 1) if proposed[:i] == target[:i])
    v = verify_proposed(proposed, target)
    assert v.accepted == proposed[:k]
    assert v.rejection == ((k, target[k]) if k < n else None)
    assert v.commit_len == k + (k < n)


@pytest.mark.rule("n_cache_positions_to_drop")
def test_cache_truncation_rejection_off_by_one_pinned():
    assert n_cache_positions_to_drop(2, verify_proposed([1, 2], [9, 2])) == 1
    assert n_cache_positions_to_drop(2, verify_proposed([1, 2], [1, 9])) == 0
    assert n_cache_positions_to_drop(2, verify_proposed([1, 2], [1, 2])) == 0
    assert n_cache_positions_to_drop(3, verify_proposed([1, 2, 3], [1, 2])) == 1
    assert n_cache_positions_to_drop(0, Verified([], None)) == 0


@pytest.mark.rule("budget clamp")
def test_budget_clamp_leaves_room_for_the_sampled_token():
    assert budget_clamp(3, 10) == 3
    assert budget_clamp(3, 4) == 3
    assert budget_clamp(3, 3) == 2
    assert budget_clamp(3, 1) == 0
    assert budget_clamp(3, 0) == 0
    assert budget_clamp(0, 0) == 0
    assert token_budget(100, 98) == 2 and token_budget(100, 120) == 0
    assert token_budget(0, 0) == 0


@pytest.mark.rule("budget clamp")
@given(a=st.integers(0, 9), budget=st.integers(0, 12))
def test_budget_clamp_property(a, budget):
    got = budget_clamp(a, budget)
    assert got <= a
    if budget >= 1:
        assert got + 1 <= budget
    assert got == (a if a + 1 <= budget else max(budget - 1, 0))


# --- the step arithmetic as the vectors call it ------------------------------------------------


@pytest.mark.rule("the step plan, made once for both engines")
def test_the_step_arithmetic_of_the_spec_examples_through_the_vectors_adapters():
    """The length rules the step plan calls, through the vectors' row adapters
    (`LengthRules`): the spec's values; the budget clamp is per row (rows of different `u`
    have different budgets)."""
    be = RULES
    assert be.plan_step_window([40, 33, 37], [41, 34, 38], 4) == ([1, 1, 1], True)
    assert be.plan_step_window([40, 40, 40], [41, 34, 38], 4) == ([1, 0, 0], False)
    assert be.token_budget(100, [98, 120, 100]) == [2, 0, 0]
    assert be.verify_accept([[10, 20, 30], [10, 20], [1, 2, 3]],
                            [[10, 20, 99], [99, 20], [1, 2, 3, 4]]) == [2, 0, 3]
    assert be.budget_clamp([3, 3, 3, 3, 0], [10, 3, 1, 0, 0]) == [3, 2, 0, 0, 0]
    assert be.plan_batch_step([1, 1, 2], [3, 0, 1], 4) == (1, 3, [4, 1, 3])
    assert be.plan_per_sequence_step([1, 2, 1, 4], [3, 1, 0, 0], 5) == (
        [4, 3, 1, 4], [1, 2, 4, 1], [1, 1, 1, 1])


@pytest.mark.rule("the step plan, made once for both engines")
def test_the_row_vector_adapters_read_rows_pairwise():
    """The per-row adapters pair the rows of their two vectors (zip, not strict): a longer
    vector's extra rows are not read. Values: C §11.1 first mismatch, §11.2 clamp
    (`a + 1 > budget -> budget - 1`), C §1 chain start `C + u - 2`."""
    assert RULES.verify_accept([[1, 2], [3]], [[1, 2]]) == [2]
    assert RULES.budget_clamp([3, 3], [2]) == [1]
    assert RULES.chain_starts([5, 6], [1]) == [4]
    assert RULES.draft_group_keys([1, 2], [5], False) == [(1, 4)]


# --- the rules on arrays (the lengths mode calls them on the batch's NumPy rows) ---------------


@pytest.mark.rule("the step rules on NumPy rows")
def test_the_step_rules_give_arrays_for_arrays_with_the_values_of_the_spec_examples():
    arr = np.array
    win = plan_step_window(arr([10, 8]), arr([12, 9]), 4)  # u = 2, 1
    assert isinstance(win.uncached, np.ndarray) and win.uncached.tolist() == [2, 1] and win.ok
    budget = token_budget(20, arr([12, 20, 25]))
    assert isinstance(budget, np.ndarray) and budget.tolist() == [8, 0, 0]
    clamped = budget_clamp(arr([3, 3, 0]), arr([8, 3, 0]))
    assert isinstance(clamped, np.ndarray) and clamped.tolist() == [3, 2, 0]
    cohort = plan_batch_step(arr([2, 1]), arr([1, 3]), 4)  # u + a = 3, 4: keep 3
    assert (cohort.keep, cohort.n_drop) == (3, 1)
    assert isinstance(cohort.next_uncached, np.ndarray) and cohort.next_uncached.tolist() == [1, 2]
    per = plan_per_sequence_step(arr([2, 1]), arr([1, 3]), 4)
    for got, want in ((per.committed, [3, 4]), (per.dropped, [1, 0]), (per.next_uncached, [1, 1])):
        assert isinstance(got, np.ndarray) and got.tolist() == want


@pytest.mark.rule("the step rules on NumPy rows")
def test_the_step_rules_take_an_empty_batch_of_arrays():
    empty = np.zeros(0, dtype=np.int64)
    win = plan_step_window(empty, empty, 4)
    assert win.ok and win.uncached.tolist() == []
    assert token_budget(20, empty).tolist() == []
    assert budget_clamp(empty, empty).tolist() == []
    assert plan_batch_step(empty, empty, 4).keep == 0
    assert plan_per_sequence_step(empty, empty, 4).committed.tolist() == []


@pytest.mark.rule("the step rules on NumPy rows")
def test_the_step_rules_compute_int32_rows_as_int64():
    """Per-row integers are computed as int64 whatever width the caller's arrays have: the
    results of int32 rows are int64 arrays, and a budget past int32's range is exact."""
    def i32(xs):
        return np.array(xs, dtype=np.int32)

    win = plan_step_window(i32([10, 8]), i32([12, 9]), 4)
    assert win.uncached.dtype == np.int64 and win.uncached.tolist() == [2, 1]
    budget = token_budget(20, i32([12, 25]))
    assert budget.dtype == np.int64 and budget.tolist() == [8, 0]
    clamped = budget_clamp(i32([3, 3]), i32([8, 3]))
    assert clamped.dtype == np.int64 and clamped.tolist() == [3, 2]
    u, a = i32([2, 1]), i32([1, 3])
    assert plan_batch_step(u, a, 4).next_uncached.dtype == np.int64
    per = plan_per_sequence_step(u, a, 4)
    assert [x.dtype for x in (per.committed, per.dropped, per.next_uncached)] == [np.int64] * 3
    # 2**31 + 5 does not fit int32; as int64, the budget of a 5-token row is 2**31.
    assert token_budget(2**31 + 5, i32([5])).tolist() == [2**31]


# --- malformed input and the zero boundaries ----------------------------------------------------

MALFORMED = [
    ("mtp_window above", lambda: mtp_window(9), "--mtp-depth 9 must be in 0..=8"),
    ("mtp_window below", lambda: mtp_window(-1), "--mtp-depth -1 must be in 0..=8"),
    ("plan_step_window lengths", lambda: plan_step_window([1, 2], [3], 2),
     "2 cache_lens for 1 tok_lens"),
    ("plan_step_window w", lambda: plan_step_window([1], [3], 0), "window w 0 must be >= 1"),
    ("plan_step_window cache_lens", lambda: plan_step_window([-1], [3], 2),
     "lengths must be >= 0: cache_lens [-1], tok_lens [3]"),
    ("plan_step_window tok_lens", lambda: plan_step_window([1], [-3], 2),
     "lengths must be >= 0: cache_lens [1], tok_lens [-3]"),
    ("plan_step_window length at w 1", lambda: plan_step_window([-1], [2], 1),
     "lengths must be >= 0: cache_lens [-1], tok_lens [2]"),
    ("window_verify_row u", lambda: window_verify_row(0, 1), "u 0 must be >= 1 and j 1 >= 0"),
    ("window_verify_row j", lambda: window_verify_row(1, -1), "u 1 must be >= 1 and j -1 >= 0"),
    ("token_budget max_seq_len", lambda: token_budget(-1, 3), "max_seq_len -1, L 3 must be >= 0"),
    ("token_budget L", lambda: token_budget(3, -1), "max_seq_len 3, L -1 must be >= 0"),
    ("budget_clamp accepted", lambda: budget_clamp(-1, 3), "accepted -1 and budget 3 must be >= 0"),
    ("budget_clamp budget", lambda: budget_clamp(3, -1), "accepted 3 and budget -1 must be >= 0"),
    ("plan_batch_step lengths", lambda: plan_batch_step([1, 1], [0], 3),
     "2 uncached for 1 accepted"),
    ("plan_batch_step w", lambda: plan_batch_step([1], [0], 0), "window w 0 must be >= 1"),
    ("plan_batch_step uncached", lambda: plan_batch_step([-1], [0], 3),
     "uncached [-1] and accepted [0] must be >= 0"),
    ("plan_batch_step uncached at w 1", lambda: plan_batch_step([-1], [0], 1),
     "uncached [-1] and accepted [0] must be >= 0"),
    ("plan_per_sequence_step accepted", lambda: plan_per_sequence_step([1], [-2], 3),
     "uncached [1] and accepted [-2] must be >= 0"),
    ("plan_per_sequence_step accepted at w 1", lambda: plan_per_sequence_step([1], [-2], 1),
     "uncached [1] and accepted [-2] must be >= 0"),
    ("n_cache_positions_to_drop", lambda: n_cache_positions_to_drop(-1, None),
     "n_proposed -1 must be >= 0"),
]


@pytest.mark.rule("malformed input and zero boundaries of the dispatch and step rules")
@malformed_cases(MALFORMED)
def test_malformed_input_is_a_value_error_naming_the_offending_values(call, message):
    """A negative length at w 1 is refused for the length, not the window."""
    assert_refused(ValueError, call, message)


@pytest.mark.rule("malformed input and zero boundaries of the dispatch and step rules")
def test_the_zero_boundaries_are_well_formed():
    assert mtp_window(0) == 1 and mtp_window(8) == 9
    assert window_verify_row(1, 0) == 0
    # u == 0 and a == 0 are well-formed inputs of both advance rules (plan_step_window is
    # what keeps u >= 1 on a real step)
    assert plan_per_sequence_step([0, 2], [0, 1], 3).committed == [0, 3]
    assert plan_batch_step([0, 2], [0, 1], 3).keep == 0
