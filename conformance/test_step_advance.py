"""MTP step arithmetic, part two: the cohort and per-sequence advance rules, simulated over
many steps and batch sizes, the cohort rollback, the per-sequence commit, the window guards
and the propose/verify loop (cache-and-draft.md §12, §16, §17; masks-and-scheduling.md §19).
The window, verify and budget rules are in test_step.py.

Expected values come from the spec's worked examples, brute-force sums written here, or the
§17.1 simulation fixture (`conformance/helpers.py`); lengths are read back off the slots.
"""

import functools
import itertools

import numpy as np
import pytest
from hypothesis import given

from raggedspec.conformance.helpers import (
    assert_refused,
    malformed_cases,
    run_streams,
    sim_propose_and_verify,
)
from raggedspec.conformance.strategies import accept_steps
from raggedspec.reference.accounting import MtpAcceptance, from_verify
from raggedspec.reference.cache import KvCache, NormalCache, OtherSlot, SingleCache
from raggedspec.reference.capability import KvAdvance
from raggedspec.reference.dispatch import resolve_row_cache_lens
from raggedspec.reference.draft import propose_chain
from raggedspec.reference.errors import StepRefusal
from raggedspec.reference.model import ModelConfig, TinyModel
from raggedspec.reference.step import (
    CohortPlan,
    PerSequencePlan,
    commit_per_sequence,
    n_cache_positions_to_drop,
    plan_batch_step,
    plan_per_sequence_step,
    plan_step_window,
    truncate_cache_by,
    verify_proposed,
    window_guard,
)
from raggedspec.reference.xs_rolling import XsRolling


@functools.cache
def b128_runs():
    streams = list(range(128))
    cohort = run_streams(streams, 4, "cohort", 200)
    per_seq = run_streams(streams, 4, "per_sequence", 200)
    solo = [run_streams([s], 4, "cohort", 200) for s in streams]
    return cohort, per_seq, solo


def filled_kv(n: int) -> KvCache:
    kv = KvCache.new_normal(4096)
    x = np.arange(n, dtype=float).reshape(1, 1, n, 1)
    kv.append(x, x.copy())
    return kv


def filled_xs(n: int) -> XsRolling:
    slot = XsRolling(4)
    slot.append_rows(np.ones((1, n, 2)))
    return slot


# --- §12 advance rules --------------------------------------------------------------------------


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


@pytest.mark.rule("plan_batch_step", "plan_per_sequence_step")
@given(step=accept_steps(max_rows=32))
def test_each_row_depends_only_on_its_own_row_and_the_cohort_keeps_the_minimum(step):
    """Per-sequence: row i's plan equals the plan of row i alone (any permutation, any
    subset of rows gives the same rows); the cohort keep is the minimum per-sequence commit."""
    u, a, w = step
    full = plan_per_sequence_step(u, a, w)
    assert plan_batch_step(u, a, w).keep == min(full.committed)
    for i in range(len(u)):
        assert full.committed[i] == min(u[i] + a[i], w)
        assert full.dropped[i] == w - full.committed[i]
        assert full.next_uncached[i] == 1
    back = plan_per_sequence_step(u[::-1], a[::-1], w)
    assert (back.committed, back.dropped) == (full.committed[::-1], full.dropped[::-1])
    odd = plan_per_sequence_step(u[1::2], a[1::2], w)
    assert (odd.committed, odd.dropped) == (full.committed[1::2], full.dropped[1::2])


# --- §12 advance rules, simulated (§17.2) -------------------------------------------------------


@pytest.mark.rule("plan_per_sequence_step")
def test_the_two_advance_rules_are_identical_at_batch_one():
    for depth in range(1, 9):
        w = depth + 1
        for s in (3, 11):
            cohort, ctoks = run_streams([s], w, "cohort", 40)
            per_seq, ptoks = run_streams([s], w, "per_sequence", 40)
            assert cohort["u"] == per_seq["u"] and all(u == [1] for u in cohort["u"])
            assert ctoks == ptoks and cohort["emitted"] == per_seq["emitted"] > 40


@pytest.mark.slow
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
    _, batched = run_streams(streams, 4, "per_sequence", 60)
    for s in streams:
        _, solo = run_streams([s], 4, "per_sequence", 60)
        assert batched[s] == solo[s]


@pytest.mark.slow
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
        hist, batched = run_streams(streams, w, "cohort", 12)
        saw_ragged |= any(len(set(step)) > 1 for step in hist["a"])
        saw_wide_tail |= any(u > 1 for step in hist["u"] for u in step)
        for s in streams:
            solo_hist, solo = run_streams([s], w, "cohort", 40)
            assert all(u == [1] for u in solo_hist["u"])
            common = min(len(batched[s]), len(solo[s]))
            assert batched[s][:common] == solo[s][:common]
            compared += common
    assert saw_ragged and saw_wide_tail and compared >= 50


@pytest.mark.rule("plan_batch_step")
def test_batched_rollback_mutation_max_instead_of_min_is_caught():
    def keep_max(u, a, w):
        valid = [x + y for x, y in zip(u, a, strict=True)]
        keep = max(valid)
        return CohortPlan(keep, max(w - keep, 0), [max(v + 1 - keep, 0) for v in valid])

    streams = [1, 4, 7, 9]
    good, _ = run_streams(streams, 4, "cohort", 12)
    bad, _ = run_streams(streams, 4, "cohort", 12, plan=keep_max)
    assert all(1 <= u <= 4 for step in good["u"] for u in step)
    assert any(u == 0 for step in bad["u"] for u in step)
    assert good["u"] != bad["u"]


@pytest.mark.rule("speculative_mtp_v4_propose_verify_loop_is_consistent")
def test_speculative_mtp_v4_propose_verify_loop_is_consistent():
    """depth 4, 8 cycles, a mock verifier agreeing on even positions only: every chain has
    `depth` tokens, nothing accepted is dropped, and the counted rate is in [0.25, 1]."""
    vocab, depth = 16, 4
    model = TinyModel(ModelConfig(hidden=4, vocab=vocab, mtp="heads"))
    prev_hidden, prev_tok = np.zeros(4), 1
    total = MtpAcceptance()
    for _cycle in range(8):
        proposed = propose_chain(model, prev_hidden, prev_tok, depth, depth, 0, None)
        assert len(proposed) == depth and all(0 <= t < vocab for t in proposed)
        target = [t if i % 2 == 0 else (t + 7) % vocab for i, t in enumerate(proposed)]
        res = verify_proposed(proposed, target)
        assert res.accepted == proposed[:len(res.accepted)]
        assert res.commit_len == len(res.accepted) + (res.rejection is not None)
        total.add(from_verify(depth, res))
        prev_tok = res.accepted[-1] if res.accepted else res.rejection[1]
        prev_hidden = model.embed[prev_tok]
    assert total.proposed == 32 and total.steps == 8
    assert 0.25 <= total.rate() <= 1.0
    assert total.accepted == 8  # the first odd slot always disagrees: one accept per cycle


@pytest.mark.rule("speculative_mtp_v4_propose_verify_loop_is_consistent")
def test_the_propose_verify_loop_on_the_simulation_fixture_grows_by_what_it_emits():
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


# --- §12.3 rollback -----------------------------------------------------------------------------


@pytest.mark.rule("truncate_cache_by")
def test_truncate_cache_by_rolls_back_every_slot():
    cache = NormalCache([filled_kv(20), filled_kv(20), filled_xs(20), OtherSlot("Rotating", 20)])
    truncate_cache_by(cache, 3)
    assert [s.current_seq_len for s in cache.slots] == [17, 17, 17, 17]
    assert cache.slots[1].v.current_seq_len == 17
    truncate_cache_by(cache, 0)
    assert [s.current_seq_len for s in cache.slots] == [17, 17, 17, 17]
    small = NormalCache([filled_kv(2), filled_kv(5)])
    truncate_cache_by(small, 4)  # saturating
    assert [s.current_seq_len for s in small.slots] == [0, 1]
    # a length-only (Rotating/TurboQuant) slot BETWEEN Normal slots: skipping it does not end
    # the loop
    mixed = NormalCache([filled_kv(20), OtherSlot("Rotating", 20), filled_kv(20)])
    truncate_cache_by(mixed, 3)
    assert [s.current_seq_len for s in mixed.slots] == [17, 17, 17]
    assert mixed.slots[2].v.current_seq_len == 17


@pytest.mark.rule("truncate_cache_by")
def test_truncate_cache_by_leaves_a_non_normal_cache_alone():
    other = OtherSlot("TurboQuant", 9)
    truncate_cache_by(other, 4)
    assert other.current_seq_len == 9


@pytest.mark.rule("depth cap <= XS_TAIL_MARGIN_TOKENS", "truncate_cache_by")
def test_truncate_cache_by_refuses_a_rollback_a_slot_refuses():
    windowed = KvCache(SingleCache(4096, 272, 300, 128, 144), SingleCache(4096, 272, 300, 128, 144))
    with pytest.raises(StepRefusal) as e:
        truncate_cache_by(NormalCache([windowed]), 200)
    assert "MTP: cache set_len(100) failed rolling back 200 of 300 positions" in str(e.value)
    xs = filled_xs(100)
    assert xs.base[0] > 60
    with pytest.raises(
        StepRefusal, match=r"MTP: cache set_len\(60\) failed rolling back 40 of 100"
    ):
        truncate_cache_by(NormalCache([filled_kv(100), xs]), 40)
    ok = NormalCache([filled_kv(100), filled_xs(100)])
    truncate_cache_by(ok, 8)  # depth cap 8 <= margin 16: always inside the retained window
    assert [s.current_seq_len for s in ok.slots] == [92, 92]


@pytest.mark.rule("truncate_cache_by", "n_cache_positions_to_drop")
def test_cache_truncation_restores_decode_invariant():
    # Older two-forward shape (masks §19): tokens 100, cache 99. A +1 forward feeds the last
    # committed token; a +d forward feeds the proposals the verify needs (d = n_proposed - 1,
    # the last proposal is never fed); then drop n_proposed - commit_len. Interpretation of the
    # unverified row; the shapes are those of cache_truncation_rejection_off_by_one_pinned.
    for proposed, target in (([1, 2], [9, 2]), ([1, 2], [1, 9]), ([1, 2], [1, 2]),
                             ([1, 2, 3], [1, 2])):
        tokens = 100
        cache = NormalCache([filled_kv(99), filled_kv(99)])
        for width in (1, len(proposed) - 1):
            for slot in cache.slots:
                block = np.zeros((1, 1, width, 1))
                slot.append(block, block)
        v = verify_proposed(proposed, target)
        truncate_cache_by(cache, n_cache_positions_to_drop(len(proposed), v))
        assert [s.current_seq_len for s in cache.slots] == [tokens + v.commit_len - 1] * 2


# --- §12.2 per-sequence commit, §16 worked examples ---------------------------------------------


def padded_row(lead: int, live: list[float], width: int) -> KvCache:
    """A row as `clone_out_cache` hands it back: lead zeros, then the row's own values, at the
    batched width."""
    k = np.zeros((1, 1, 512, 1))
    k[0, 0, lead:lead + len(live), 0] = live
    return KvCache(SingleCache(4096, 512, width, data=k.copy()),
                   SingleCache(4096, 512, width, data=k + 1000))


@pytest.mark.rule("per-seq commit")
def test_the_per_sequence_worked_example_of_one_step():
    # §16 PerSequence example: own KV A 12, B 10; w = 4; A accepts 2, B accepts 0.
    w, c = 4, 12
    lead_pad = [0, 2]
    cache_lens = resolve_row_cache_lens(True, c, lead_pad)
    assert cache_lens == [12, 10]
    win = plan_step_window(cache_lens, [13, 11], w)
    assert win.ok and win.uncached == [1, 1]
    plan = plan_per_sequence_step(win.uncached, [2, 0], w)
    assert plan.committed == [3, 1]
    width = c + w  # after Out every row is 16 wide
    a_row = NormalCache([padded_row(0, list(range(100, 116)), width)])
    b_row = NormalCache([padded_row(2, list(range(200, 214)), width), filled_xs(10 + w)])
    commit_per_sequence(a_row, lead_pad[0], cache_lens[0], plan.committed[0])
    commit_per_sequence(b_row, lead_pad[1], cache_lens[1], plan.committed[1])
    assert a_row.slots[0].current_seq_len == 15 and a_row.slots[0].v.current_seq_len == 15
    assert b_row.slots[0].current_seq_len == 11 and b_row.slots[1].current_seq_len == 11
    # read back from the tensor: B's live run starts at column 0 (the dead prefix is gone)
    assert b_row.slots[0].k.current_data()[0, 0, :, 0].tolist() == list(range(200, 211))
    assert b_row.slots[0].v.current_data()[0, 0, 0, 0] == 1200.0
    assert a_row.slots[0].k.current_data()[0, 0, :, 0].tolist() == list(range(100, 115))


@pytest.mark.rule("per-seq commit",
                  "malformed input and zero boundaries of the dispatch and step rules")
def test_the_per_sequence_commit_of_nothing_and_of_a_row_with_no_kv_is_well_formed():
    cache = NormalCache([filled_kv(3)])
    commit_per_sequence(cache, 3, 0, 0)  # the whole row is dead prefix: no KV of its own
    assert cache.slots[0].current_seq_len == 0
    cache = NormalCache([filled_kv(6)])
    commit_per_sequence(cache, 2, 4, 0)  # a commit of nothing keeps the row's own length
    assert cache.slots[0].current_seq_len == 4


@pytest.mark.rule("per-seq commit")
def test_the_per_sequence_commit_refuses_by_name():
    with pytest.raises(StepRefusal, match="stripping the 2-column dead prefix failed"):
        commit_per_sequence(NormalCache([OtherSlot("Rotating", 16)]), 2, 10, 1)
    with pytest.raises(StepRefusal, match=r"set_len\(600\) refused"):
        commit_per_sequence(NormalCache([padded_row(0, [1.0] * 16, 16)]), 0, 590, 10)


@pytest.mark.rule("plan_batch_step")
def test_the_cohort_worked_example_of_one_step():
    # §16 cohort example: w = 4, C = 10; A: L 11 (u 1) drafts 3, accepts 3; B: L 12 (u 2)
    # drafts 2, accepts 0.
    w, c = 4, 10
    win = plan_step_window([c, c], [11, 12], w)
    assert win.ok and win.uncached == [1, 2]
    plan = plan_batch_step(win.uncached, [3, 0], w)
    assert (plan.keep, plan.n_drop) == (2, 2)
    cache = NormalCache([filled_kv(c + w)])
    truncate_cache_by(cache, plan.n_drop)
    assert cache.current_seq_len == 12
    new_lens = [11 + 3 + 1, 12 + 0 + 1]
    assert new_lens == [15, 13]
    assert plan.next_uncached == [n - cache.current_seq_len for n in new_lens] == [3, 1]


# --- §16 step 4 guards --------------------------------------------------------------------------


@pytest.mark.rule("left-aligned / follows guard")
def test_window_guard_chooses_left_aligned_then_follows_then_defer():
    assert window_guard(True, KvAdvance.COHORT) == "left_aligned_guard"
    assert window_guard(True, KvAdvance.PER_SEQUENCE) == "left_aligned_guard"
    assert window_guard(False, KvAdvance.PER_SEQUENCE) == "follows_guard"
    assert window_guard(False, KvAdvance.COHORT) == "defer"


@pytest.mark.rule("left-aligned / follows guard")
def test_a_stale_batched_width_after_a_per_sequence_step_hits_the_follows_guard():
    # After a PerSequence step the resident batched cache stays C + w wide (no rollback). A
    # following step that did not assemble the batch has an all-zero lead_pad, so the
    # left-aligned guard cannot see it; the follows guard refuses instead of deferring.
    w, c = 4, 12
    stale = c + w
    row_lens = resolve_row_cache_lens(False, stale, [0, 0])
    assert row_lens is None
    assert not plan_step_window([stale] * 2, [15 + 1, 11 + 1], w).ok
    assert window_guard(row_lens is not None, KvAdvance.PER_SEQUENCE) == "follows_guard"
    assert window_guard(row_lens is not None, KvAdvance.COHORT) == "defer"


# --- malformed input ----------------------------------------------------------------------------

MALFORMED = [
    ("truncate_cache_by n_drop", lambda: truncate_cache_by(NormalCache([filled_kv(4)]), -1),
     "n_drop -1 must be >= 0"),
    ("commit_per_sequence lead", lambda: commit_per_sequence(NormalCache([filled_kv(5)]), -1, 3, 2),
     "lead -1, cache_len 3, committed 2 must be >= 0"),
    ("commit_per_sequence cache_len",
     lambda: commit_per_sequence(NormalCache([filled_kv(5)]), 0, -3, 2),
     "lead 0, cache_len -3, committed 2 must be >= 0"),
    ("commit_per_sequence committed",
     lambda: commit_per_sequence(NormalCache([filled_kv(5)]), 0, 3, -2),
     "lead 0, cache_len 3, committed -2 must be >= 0"),
]


@pytest.mark.rule("malformed input and zero boundaries of the dispatch and step rules")
@malformed_cases(MALFORMED)
def test_malformed_rollback_and_commit_input_names_the_values(call, message):
    assert_refused(ValueError, call, message)
