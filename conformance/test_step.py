"""MTP step arithmetic: window planning, verify rows, verify/accept, the budget clamp and the
cohort and per-sequence advance rules (cache-and-draft.md §8, §11, §12, §17;
masks-and-scheduling.md §19). Rollback, the per-sequence commit and the window guards are in
test_step_commit.py.

The simulation fixture mirrors §17.1 `sim_propose_and_verify`: a deterministic target oracle
(the next token is a function of the context's last token and length), a draft oracle that
agrees with it at a seeded per-stream rate, a verify block whose row r has seen the window's
first r + 1 tokens, and emission `accepted ++ [row u-1+a]`.
"""

import functools
import itertools
import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from raggedspec.reference.capability import KvAdvance
from raggedspec.reference.step import (
    CohortPlan,
    PerSequencePlan,
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

VOCAB = 97

# --- §17.1 simulation fixture
# -----------------------------------------------------------------------


def target_next(s: int, last: int, n: int) -> int:
    """The target's greedy next token after a context of length n ending in `last`."""
    return (last * 31 + n * 17 + s * 7 + 3) % VOCAB


def agrees(s: int, n: int, rate: float) -> bool:
    """Seeded per-(stream, position) draft/target agreement at `rate` (tuple-of-int hashing
    is deterministic in CPython)."""
    return (hash((s, n, 0x5EED)) % 10_000) < rate * 10_000


def draft_next(s: int, last: int, n: int, rate: float) -> int:
    t = target_next(s, last, n)
    return t if agrees(s, n, rate) else (t + 1) % VOCAB


def sim_propose_and_verify(s, toks, u, w, rate, verify_row=window_verify_row):
    """One row of one verify step: returns (drafted d, accepted a, emitted tokens)."""
    L = len(toks)
    c = L - u
    d = w - u
    drafts = []
    last = toks[-1]
    for j in range(d):
        last = draft_next(s, last, L + j, rate)
        drafts.append(last)
    window = toks[c:] + drafts
    rows = [target_next(s, window[r], c + r + 1) for r in range(w)]
    targets = [rows[verify_row(u, j)] for j in range(d)]
    a = len(verify_proposed(drafts, targets).accepted)
    return d, a, drafts[:a] + [rows[verify_row(u, a)]]


def stream_rate(s: int) -> float:
    return 0.5 + 0.45 * ((s * 37) % 10) / 10


def run(streams, w, rule, steps, plan=plan_batch_step):
    """Run a batch of stream ids under "cohort" or "per_sequence"; returns the per-step
    histories of u, d, a and emitted counts, and the final token lists."""
    toks = {s: [1 + s % 50, 11 + s % 7] for s in streams}
    u = {s: 1 for s in streams}
    hist = {"u": [], "d": [], "a": [], "emitted": 0}
    for _ in range(steps):
        us = [u[s] for s in streams]
        hist["u"].append(us)
        if min(us) < 1:
            break
        outs = [sim_propose_and_verify(s, toks[s], u[s], w, stream_rate(s)) for s in streams]
        hist["d"].append([o[0] for o in outs])
        hist["a"].append([o[1] for o in outs])
        accepted = [o[1] for o in outs]
        if rule == "cohort":
            nxt = plan(us, accepted, w).next_uncached
        else:
            nxt = plan_per_sequence_step(us, accepted, w).next_uncached
        for s, o, n in zip(streams, outs, nxt, strict=False):
            before = len(toks[s])
            toks[s].extend(o[2])
            assert len(toks[s]) == before + o[1] + 1  # grows by the emitted count
            hist["emitted"] += len(o[2])
            u[s] = n
    return hist, toks


@functools.cache
def b128_runs():
    streams = list(range(128))
    cohort = run(streams, 4, "cohort", 200)
    per_seq = run(streams, 4, "per_sequence", 200)
    solo = [run([s], 4, "cohort", 200) for s in streams]
    return cohort, per_seq, solo


# --- flags / small rules
# ---------------------------------------------------------------------------


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


# --- §8.1 window
# ----------------------------------------------------------------------------------------


@pytest.mark.rule("plan_step_window")
def test_plan_step_window_examples():
    got = plan_step_window([40, 33, 37], [41, 34, 38], 4)
    assert got.uncached == [1, 1, 1] and got.ok
    got = plan_step_window([40, 40, 40], [41, 34, 38], 4)
    assert got.uncached == [1, 0, 0] and not got.ok
    assert not plan_step_window([12, 12], [13, 9], 4).ok


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
            if got.ok:
                # toks[c:] is non-empty
                assert all(c < t for c, t in zip(cache_lens, toks, strict=False))
    assert True in verdicts and False in verdicts
    assert not plan_step_window([12, 12], [13, 9], 4).ok


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
    assert got.uncached == [max(t - c, 0) for c, t in zip(cache, toks, strict=False)]
    brute = all(
        c + max(t - c, 0) >= 2 and 1 <= t - c <= w for c, t in zip(cache, toks, strict=False)
    )
    assert got.ok == brute
    if got.ok:
        assert all(c < t for c, t in zip(cache, toks, strict=False))


# --- §8.3 verify rows
# -------------------------------------------------------------------------------------


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


# --- §11 verify and budget
# -----------------------------------------------------------------------------------


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


@pytest.mark.rule("n_cache_positions_to_drop")
def test_cache_truncation_rejection_off_by_one_pinned():
    assert n_cache_positions_to_drop(2, verify_proposed([1, 2], [9, 2])) == 1
    assert n_cache_positions_to_drop(2, verify_proposed([1, 2], [1, 9])) == 0
    assert n_cache_positions_to_drop(2, verify_proposed([1, 2], [1, 2])) == 0
    assert n_cache_positions_to_drop(3, verify_proposed([1, 2, 3], [1, 2])) == 1


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


@pytest.mark.rule("budget clamp")
def test_budget_clamp_leaves_room_for_the_sampled_token():
    assert budget_clamp(3, 10) == 3
    assert budget_clamp(3, 4) == 3
    assert budget_clamp(3, 3) == 2
    assert budget_clamp(3, 1) == 0
    assert budget_clamp(3, 0) == 0
    assert budget_clamp(0, 0) == 0
    assert token_budget(100, 98) == 2 and token_budget(100, 120) == 0


@pytest.mark.rule("budget clamp")
@given(a=st.integers(0, 9), budget=st.integers(0, 12))
def test_budget_clamp_property(a, budget):
    got = budget_clamp(a, budget)
    assert got <= a
    if budget >= 1:
        assert got + 1 <= budget
    if a + 1 <= budget:
        assert got == a
    else:
        assert got == max(budget - 1, 0)


# --- §12 advance rules
# --------------------------------------------------------------------------------------


@pytest.mark.rule("plan_batch_step")
def test_plan_batch_step_keeps_only_what_every_sequence_can_prove():
    plan = plan_batch_step([1, 1, 2], [3, 0, 1], 4)
    assert (plan.keep, plan.n_drop, plan.next_uncached) == (1, 3, [4, 1, 3])
    empty = plan_batch_step([], [], 4)
    assert (empty.keep, empty.n_drop, empty.next_uncached) == (0, 4, [])


@pytest.mark.rule("plan_per_sequence_step")
def test_both_plans_agree_on_what_each_sequence_can_vouch_for():
    per_seq = plan_per_sequence_step([1, 2, 1, 4], [3, 1, 0, 0], 5)
    assert per_seq.committed == [4, 3, 1, 4]
    assert plan_batch_step([1, 2, 1, 4], [3, 1, 0, 0], 5).keep == 1 == min(per_seq.committed)


@pytest.mark.rule("plan_per_sequence_step")
def test_per_sequence_plan_ignores_every_other_sequence():
    u, a, w = [1, 1, 2, 3, 5, 1, 4], [0, 4, 3, 2, 0, 1, 0], 5
    plan = plan_per_sequence_step(u, a, w)
    assert plan == PerSequencePlan([1, 5, 5, 5, 5, 2, 4], [4, 0, 0, 0, 0, 3, 1], [1] * 7)
    for i in range(len(u)):
        solo = plan_per_sequence_step([u[i]], [a[i]], w)
        assert (solo.committed[0], solo.dropped[0], solo.next_uncached[0]) == (
            plan.committed[i], plan.dropped[i], plan.next_uncached[i])
    cohort = plan_batch_step(u, a, w)
    assert cohort.keep == 1 and max(cohort.next_uncached) > 1


@pytest.mark.rule("plan_per_sequence_step")
def test_per_sequence_committed_is_capped_at_the_window():
    plan = plan_per_sequence_step([3], [4], 5)
    assert plan.committed == [5] and plan.dropped == [0]


@pytest.mark.rule("plan_batch_step")
def test_batched_window_invariant_closes_at_every_depth_and_accept_pattern():
    cases = 0
    for depth in range(1, 9):
        w = depth + 1
        pairs = [(u, a) for u in range(1, w + 1) for a in range(0, w - u + 1)]
        for triple in itertools.combinations_with_replacement(pairs, 3):
            us = [p[0] for p in triple]
            accs = [p[1] for p in triple]
            plan = plan_batch_step(us, accs, w)
            keep = min(u + a for u, a in triple)
            assert plan.keep == keep >= 1
            assert plan.n_drop == w - keep <= w
            assert plan.next_uncached == [u + a + 1 - keep for u, a in triple]
            assert all(1 <= n <= w for n in plan.next_uncached)
            cases += 1
    assert cases > 5000


@pytest.mark.rule("plan_batch_step")
@given(data=st.data())
def test_cohort_keep_is_the_minimum_per_sequence_commit(data):
    w = data.draw(st.integers(1, 9))
    b = data.draw(st.integers(1, 32))
    rng = random.Random(data.draw(st.integers(0, 2**32)))
    u = [rng.randint(1, w) for _ in range(b)]
    a = [rng.randint(0, w - x) for x in u]
    assert plan_batch_step(u, a, w).keep == min(plan_per_sequence_step(u, a, w).committed)


@pytest.mark.rule("plan_per_sequence_step")
@given(data=st.data())
def test_per_sequence_row_depends_only_on_its_own_row(data):
    w = data.draw(st.integers(1, 9))
    b = data.draw(st.integers(2, 16))
    rng = random.Random(data.draw(st.integers(0, 2**32)))
    u = [rng.randint(1, w) for _ in range(b)]
    a = [rng.randint(0, w - x) for x in u]
    perm = rng.sample(range(b), b)
    keep_rows = rng.sample(range(b), rng.randint(1, b))
    full = plan_per_sequence_step(u, a, w)
    permuted = plan_per_sequence_step([u[i] for i in perm], [a[i] for i in perm], w)
    subset = plan_per_sequence_step([u[i] for i in keep_rows], [a[i] for i in keep_rows], w)
    for pos, i in enumerate(perm):
        assert (permuted.committed[pos], permuted.dropped[pos], permuted.next_uncached[pos]) == (
            full.committed[i], full.dropped[i], full.next_uncached[i])
    for pos, i in enumerate(keep_rows):
        assert (subset.committed[pos], subset.dropped[pos]) == (full.committed[i], full.dropped[i])
    for i in range(b):
        assert full.committed[i] == min(u[i] + a[i], w)
        assert full.dropped[i] == w - full.committed[i]
        assert full.next_uncached[i] == 1


# --- §12 advance rules, simulated (§17.2)
# ------------------------------------------------------------------


@pytest.mark.rule("plan_per_sequence_step")
def test_the_two_advance_rules_are_identical_at_batch_one():
    for depth in range(1, 9):
        w = depth + 1
        for s in (3, 11):
            cohort, ctoks = run([s], w, "cohort", 40)
            per_seq, ptoks = run([s], w, "per_sequence", 40)
            assert cohort["u"] == per_seq["u"] and all(u == [1] for u in cohort["u"])
            assert ctoks == ptoks and cohort["emitted"] == per_seq["emitted"] > 40


@pytest.mark.rule("plan_batch_step")
def test_per_sequence_advance_never_lets_a_tail_ratchet_at_b128():
    (cohort, _), (per_seq, _), _ = b128_runs()
    assert all(u == 1 for step in per_seq["u"] for u in step)
    assert min(d for step in per_seq["d"] for d in step) == 3
    saturated = sum(u == 4 for step in cohort["u"] for u in step)
    assert saturated > 0
    for us, ds in zip(cohort["u"], cohort["d"], strict=False):
        assert sum(u == 4 for u in us) == sum(d == 0 for d in ds)


@pytest.mark.rule("plan_per_sequence_step")
def test_per_sequence_advance_is_token_identical_to_the_b1_reference():
    streams = list(range(128))
    _, batched = run(streams, 4, "per_sequence", 60)
    for s in streams:
        _, solo = run([s], 4, "per_sequence", 60)
        assert batched[s] == solo[s]


@pytest.mark.rule("plan_per_sequence_step")
def test_tok_per_step_at_b128_is_bounded_by_the_cohort_rule_and_freed_by_the_per_sequence_rule():
    (cohort, _), (per_seq, _), solo = b128_runs()
    steps, n = 200, 128
    tps_cohort = cohort["emitted"] / (steps * n)
    tps_per_seq = per_seq["emitted"] / (steps * n)
    tps_solo = sum(h["emitted"] for h, _ in solo) / (steps * n)
    assert tps_per_seq > 1.10 * tps_cohort
    assert abs(tps_per_seq - tps_solo) < 1e-9
    assert tps_cohort < tps_solo


@pytest.mark.rule("plan_per_sequence_step")
def test_batched_ragged_accept_is_token_identical_to_the_b1_reference():
    compared = 0
    saw_ragged = saw_wide_tail = False
    for depth in range(1, 5):
        w = depth + 1
        streams = [2, 5, 8, 13]
        hist, batched = run(streams, w, "cohort", 12)
        for step in hist["a"]:
            saw_ragged |= len(set(step)) > 1
        saw_wide_tail |= any(u > 1 for step in hist["u"] for u in step)
        for s in streams:
            solo_hist, solo = run([s], w, "cohort", 40)
            assert all(u == [1] for u in solo_hist["u"])
            common = min(len(batched[s]), len(solo[s]))
            assert batched[s][:common] == solo[s][:common]
            compared += common
    assert saw_ragged and saw_wide_tail and compared >= 50


@pytest.mark.rule("plan_batch_step")
def test_batched_rollback_mutation_max_instead_of_min_is_caught():
    def keep_max(u, a, w):
        valid = [x + y for x, y in zip(u, a, strict=False)]
        keep = max(valid)
        return CohortPlan(keep, max(w - keep, 0), [max(v + 1 - keep, 0) for v in valid])

    streams = [1, 4, 7, 9]
    good, good_toks = run(streams, 4, "cohort", 12)
    bad, bad_toks = run(streams, 4, "cohort", 12, plan=keep_max)
    assert all(1 <= u <= 4 for step in good["u"] for u in step)
    assert any(u == 0 for step in bad["u"] for u in step)
    assert good["u"] != bad["u"]


@pytest.mark.rule("speculative_mtp_v4_propose_verify_loop_is_consistent")
def test_speculative_mtp_v4_propose_verify_loop_is_consistent():
    w, toks, u = 5, [3, 8], 1
    accepted = proposed = 0
    for _ in range(8):
        d, a, emitted = sim_propose_and_verify(21, toks, u, w, rate=0.5)
        before = len(toks)
        toks = toks + emitted
        assert len(toks) == before + a + 1
        accepted, proposed = accepted + a, proposed + d
        u = plan_batch_step([u], [a], w).next_uncached[0]
        assert u == 1
    assert proposed == 32 and 0.0 <= accepted / proposed <= 1.0


# --- the rules on arrays (the lengths mode calls them on the batch's NumPy rows) -------------


@pytest.mark.rule("the step rules on NumPy rows")
def test_the_step_rules_give_arrays_for_arrays_with_the_values_of_the_spec_examples():
    import numpy as np

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
    import numpy as np

    empty = np.zeros(0, dtype=np.int64)
    win = plan_step_window(empty, empty, 4)
    assert win.ok and win.uncached.tolist() == []
    assert token_budget(20, empty).tolist() == []
    assert budget_clamp(empty, empty).tolist() == []
    assert plan_batch_step(empty, empty, 4).keep == 0
    assert plan_per_sequence_step(empty, empty, 4).committed.tolist() == []


@pytest.mark.rule("malformed input and zero boundaries of the dispatch and step rules")
def test_a_negative_length_at_window_1_is_refused_for_the_length_not_the_window():
    with pytest.raises(ValueError, match="lengths must be >= 0"):
        plan_step_window([-1], [2], 1)
    with pytest.raises(ValueError, match=r"uncached \[-1\] and accepted \[0\] must be >= 0"):
        plan_batch_step([-1], [0], 1)
    with pytest.raises(ValueError, match=r"uncached \[1\] and accepted \[-2\] must be >= 0"):
        plan_per_sequence_step([1], [-2], 1)
