"""Cohort rollback, the per-sequence commit and the window guards (cache-and-draft.md §12.2,
§12.3, §16 step 4).

Expected values come from the spec's worked examples; lengths are read back off the slots.
"""

import numpy as np
import pytest

from raggedspec.reference.cache import KvCache, NormalCache, OtherSlot, SingleCache
from raggedspec.reference.capability import KvAdvance
from raggedspec.reference.dispatch import resolve_row_cache_lens
from raggedspec.reference.errors import StepRefusal
from raggedspec.reference.step import (
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

# --- §12.3 rollback
# ---------------------------------------------------------------------------------------------


def filled_kv(n: int) -> KvCache:
    kv = KvCache.new_normal(4096)
    kv.append(
        np.arange(n, dtype=float).reshape(1, 1, n, 1), np.arange(n, dtype=float).reshape(1, 1, n, 1)
    )
    return kv


def filled_xs(n: int) -> XsRolling:
    slot = XsRolling(4)
    slot.append_rows(np.ones((1, n, 2)))
    return slot


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
    # Older two-forward shape (masks §19, docs/notes/mtp-hang-triage.md): tokens 100, cache 99.
    # A +1 forward feeds the last committed token; a +d forward feeds the proposals the
    # verify needs (d = n_proposed - 1, the last proposal is never fed); then drop
    # n_proposed - commit_len. Interpretation of the unverified row; the shapes are those
    # of cache_truncation_rejection_off_by_one_pinned.
    for proposed, target in (
        ([1, 2], [9, 2]),
        ([1, 2], [1, 9]),
        ([1, 2], [1, 2]),
        ([1, 2, 3], [1, 2]),
    ):
        tokens = 100
        cache = NormalCache([filled_kv(99), filled_kv(99)])
        for width in (1, len(proposed) - 1):
            for slot in cache.slots:
                block = np.zeros((1, 1, width, 1))
                slot.append(block, block)
        v = verify_proposed(proposed, target)
        tokens_after = tokens + v.commit_len
        truncate_cache_by(cache, n_cache_positions_to_drop(len(proposed), v))
        assert [s.current_seq_len for s in cache.slots] == [tokens_after - 1] * 2


# --- §12.2 per-sequence commit
# ------------------------------------------------------------------------------------


def padded_row(lead: int, live: list[float], width: int) -> KvCache:
    """A row as `clone_out_cache` hands it back: lead zeros, then the row's own values,
    at the batched width."""
    k = np.zeros((1, 1, 512, 1))
    k[0, 0, lead:lead + len(live), 0] = live
    kv = KvCache(
        SingleCache(4096, 512, width, data=k.copy()), SingleCache(4096, 512, width, data=k + 1000)
    )
    return kv


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
    b_xs = filled_xs(10 + w)
    b_row = NormalCache([padded_row(2, list(range(200, 214)), width), b_xs])
    commit_per_sequence(a_row, lead_pad[0], cache_lens[0], plan.committed[0])
    commit_per_sequence(b_row, lead_pad[1], cache_lens[1], plan.committed[1])
    assert a_row.slots[0].current_seq_len == 15 and a_row.slots[0].v.current_seq_len == 15
    assert b_row.slots[0].current_seq_len == 11 and b_row.slots[1].current_seq_len == 11
    # read back from the tensor: B's live run starts at column 0 (the dead prefix is gone)
    assert b_row.slots[0].k.current_data()[0, 0, :, 0].tolist() == list(range(200, 211))
    assert b_row.slots[0].v.current_data()[0, 0, 0, 0] == 1200.0
    assert a_row.slots[0].k.current_data()[0, 0, :, 0].tolist() == list(range(100, 115))


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


# --- §16 step 4 guards
# -----------------------------------------------------------------------------------------------


@pytest.mark.rule("left-aligned / follows guard")
def test_window_guard_chooses_left_aligned_then_follows_then_defer():
    assert window_guard(True, KvAdvance.COHORT) == "left_aligned_guard"
    assert window_guard(True, KvAdvance.PER_SEQUENCE) == "left_aligned_guard"
    assert window_guard(False, KvAdvance.PER_SEQUENCE) == "follows_guard"
    assert window_guard(False, KvAdvance.COHORT) == "defer"


@pytest.mark.rule("left-aligned / follows guard")
def test_a_stale_batched_width_after_a_per_sequence_step_hits_the_follows_guard():
    # After a PerSequence step the resident batched cache stays C + w wide (no rollback).
    # A following step that did not assemble the batch has an all-zero lead_pad, so the
    # left-aligned guard cannot see it; the follows guard refuses instead of deferring.
    w, c = 4, 12
    stale = c + w
    own_tok_lens = [15 + 1, 11 + 1]
    row_lens = resolve_row_cache_lens(False, stale, [0, 0])
    assert row_lens is None
    win = plan_step_window([stale] * 2, own_tok_lens, w)
    assert not win.ok
    assert window_guard(row_lens is not None, KvAdvance.PER_SEQUENCE) == "follows_guard"
    assert window_guard(row_lens is not None, KvAdvance.COHORT) == "defer"


# --- the rows' integer type
# ---------------------------------------------------------------------------------------------


@pytest.mark.rule("the step rules on NumPy rows")
def test_the_step_rules_compute_int32_rows_as_int64():
    """Per-row integers are computed as int64 whatever width the caller's arrays have: the
    results of int32 rows are int64 arrays, and a budget past int32's range is exact."""
    from raggedspec.reference.step import budget_clamp, token_budget

    i32 = np.array
    win = plan_step_window(i32([10, 8], dtype=np.int32), i32([12, 9], dtype=np.int32), 4)
    assert win.uncached.dtype == np.int64 and win.uncached.tolist() == [2, 1]
    budget = token_budget(20, i32([12, 25], dtype=np.int32))
    assert budget.dtype == np.int64 and budget.tolist() == [8, 0]
    clamped = budget_clamp(i32([3, 3], dtype=np.int32), i32([8, 3], dtype=np.int32))
    assert clamped.dtype == np.int64 and clamped.tolist() == [3, 2]
    u, a = i32([2, 1], dtype=np.int32), i32([1, 3], dtype=np.int32)
    assert plan_batch_step(u, a, 4).next_uncached.dtype == np.int64
    per = plan_per_sequence_step(u, a, 4)
    assert [x.dtype for x in (per.committed, per.dropped, per.next_uncached)] == [np.int64] * 3
    # 2**31 + 5 does not fit int32; as int64, the budget of a 5-token row is 2**31.
    assert token_budget(2**31 + 5, i32([5], dtype=np.int32)).tolist() == [2**31]
