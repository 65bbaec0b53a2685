"""XsRolling at its edges (masks-and-scheduling.md §13, cache-and-draft.md §12.3): the
malformed-input messages and the smallest sizes they admit, the retention and window rules at
their equality boundaries, zeros behind base and in front of a rolled-back tail, the fields a
split or a stack carries over (span, window, margin, dim, dtype), and the batch of zero rows.

Expected values come from the §13 formulas worked by hand in the comments (`base' = keep_from`,
`resumable_from`, `base + W < len`) and from the docstrings' stated messages."""

import numpy as np
import pytest

from raggedspec.reference.errors import CacheRefusal
from raggedspec.reference.xs_rolling import (
    XsRolling,
    compress_blocks,
    plan_xs_advance,
    resumable_from,
    rollback_refusal,
    span_groups_for,
)

D = 3


def fed(n, ratio=4, d=D, dtype=np.float64, **kw):
    """A one-row slot fed tokens 1..n (token t holds t + 0.25 * feature)."""
    xs = XsRolling(ratio, **kw)
    x = (np.arange(1, n + 1)[:, None] + 0.25 * np.arange(d)[None, :]).astype(dtype)
    if n:
        xs.append_rows(x[None])
    return xs


# --- malformed input: ValueError with the stated message -------------------------------------

@pytest.mark.rule("XsRolling")
def test_malformed_input_is_refused_with_the_stated_messages():
    xs = XsRolling(4, window=32, batch=2)
    xs.append_rows(np.zeros((2, 4, D)))
    other = XsRolling(8, window=32)
    cases = [
        (lambda: span_groups_for(0), "compress ratio 0 must be >= 1"),
        (lambda: compress_blocks(np.zeros(4), 2), "compress_blocks needs [..., T, D], got (4,)"),
        (lambda: compress_blocks([[1.0]], 2), "compress_blocks needs [..., T, D], got None"),
        (lambda: compress_blocks(np.zeros((4, 1)), 0), "compress ratio 0 must be >= 1"),
        (lambda: resumable_from(-1, 4, 2), "length -1 must be >= 0"),
        (lambda: plan_xs_advance([4, 4], [0], 32, 1, 4, 2), "2 token counts but 1 bases"),
        (lambda: plan_xs_advance([4], [0], -1, 1, 4, 2),
         "window -1, t_new 1, ratio 4, span 2, margin 16 out of range"),
        (lambda: plan_xs_advance([4], [0], 32, -1, 4, 2),
         "window 32, t_new -1, ratio 4, span 2, margin 16 out of range"),
        (lambda: plan_xs_advance([4], [0], 32, 1, 0, 2),
         "window 32, t_new 1, ratio 0, span 2, margin 16 out of range"),
        (lambda: plan_xs_advance([4], [0], 32, 1, 4, 0),
         "window 32, t_new 1, ratio 4, span 0, margin 16 out of range"),
        (lambda: plan_xs_advance([4], [0], 32, 1, 4, 2, -1),
         "window 32, t_new 1, ratio 4, span 2, margin -1 out of range"),
        (lambda: plan_xs_advance([4, 4], [0, 5], 32, 1, 4, 2),
         "row 1: base 5 must be in [0, tokens 4]"),
        (lambda: plan_xs_advance([4], [-1], 32, 1, 4, 2),
         "row 0: base -1 must be in [0, tokens 4]"),
        (lambda: XsRolling(4, span_groups=0, window=8),
         "span 0, window 8, max_seq_len 4096, batch 1 out of range"),
        (lambda: XsRolling(4, window=0),
         "span 2, window 0, max_seq_len 4096, batch 1 out of range"),
        (lambda: XsRolling(4, window=8, max_seq_len=-1),
         "span 2, window 8, max_seq_len -1, batch 1 out of range"),
        (lambda: XsRolling(4, window=8, batch=-1),
         "span 2, window 8, max_seq_len 4096, batch -1 out of range"),
        (lambda: xs.append_rows(np.zeros((1, 4, D))),
         "append_rows needs [B=2, t_new, D], got (1, 4, 3)"),
        (lambda: xs.append_rows(np.zeros((2, 4))), "append_rows needs [B=2, t_new, D], got (2, 4)"),
        (lambda: xs.append_rows([[[0.0]]]), "append_rows needs [B=2, t_new, D], got None"),
        (lambda: xs.append_rows(np.zeros((2, 1, D + 1))),
         "hidden width 4 differs from the slot's 3"),
        (lambda: xs.set_row_lens([4]), "1 row lengths for a batch of 2"),
        (lambda: xs.set_row_lens([4, -1]), "row lengths [4, -1] must be >= 0"),
        (lambda: xs.try_set_len(-1), "set_len length -1 must be >= 0"),
        (lambda: XsRolling.stack([]), "stack needs at least one xs slot"),
        (lambda: XsRolling.stack([XsRolling(4, window=32), other]),
         "xs slots in one layer must share ratio, span, window and margin"),
    ]
    for call, message in cases:
        with pytest.raises(ValueError) as e:
            call()
        assert str(e.value) == message


@pytest.mark.rule("XsRolling")
def test_stack_refusals_name_the_mismatch():
    a, b = XsRolling(4, window=32), XsRolling(4, window=32)
    a.append_rows(np.zeros((1, 4, 2)))
    b.append_rows(np.zeros((1, 4, 3)))
    with pytest.raises(ValueError,
                       match=r"^xs slots with hidden widths \[2, 3\] cannot be stacked$"):
        XsRolling.stack([a, b])
    c = XsRolling(4, window=32)
    c.append_rows(np.zeros((1, 5, 2)))
    with pytest.raises(ValueError,
                       match=r"^reconciling xs bases needs uniform tokens, got \[4, 5\]$"):
        XsRolling.stack([a, c], reconcile_bases=True)


# --- the smallest sizes are admitted --------------------------------------------------------

@pytest.mark.rule("XsRolling")
def test_the_smallest_sizes_are_not_malformed():
    x = np.arange(6, dtype=np.float64).reshape(3, 2)
    assert np.array_equal(compress_blocks(x, 1), x)  # ratio 1: every token is its own block
    plan = plan_xs_advance([0], [0], 0, 0, 1, 1, 0)  # window 0, ratio 1, margin 0, nothing new
    assert [(r.tokens_after, r.take, r.base_after) for r in plan.rows] == [(0, 0, 0)]
    assert XsRolling(4, window=1).window == 1
    assert XsRolling(4, window=8, max_seq_len=0).max_seq_len == 0
    assert resumable_from(0, 4, 2) == 0  # max(0, 0 + 1 - 2) * 4


# --- the rules at their equality boundaries -------------------------------------------------

@pytest.mark.rule("plan_xs_advance")
def test_retention_and_the_window_at_their_boundaries():
    # ratio 1, span 1, margin 16: keep_from = max(0, (max(5 - 16, 0) // 1 + 1 - 1) * 1) = 0
    assert plan_xs_advance([0], [0], 32, 5, 1, 1, 16).rows[0].base_after == 0
    # W 4, ratio 4, span 1, margin 16: tok' 4, keep_from 0: a run of exactly W fits
    assert plan_xs_advance([0], [0], 4, 4, 4, 1, 16).rows[0].base_after == 0
    # W 7, ratio 4, span 1, margin 8: tok' 12, keep_from = (4 // 4 + 1 - 1) * 4 = 4: run 8 > 7
    with pytest.raises(CacheRefusal) as e:
        plan_xs_advance([0], [0], 7, 12, 4, 1, 8)
    assert str(e.value) == "row 0's run of 8 tokens (base 4 .. 12) does not fit the window of 7"


@pytest.mark.rule("XsRolling length setters")
def test_rollback_refusal_at_the_window_edge():
    # length 8: resume max(0, 2 + 1 - 1) * 4 = 8 >= base 0; base + W = 8 is not < 8
    assert rollback_refusal(0, 8, 10, 0, 4, 1, 8) is None
    assert str(rollback_refusal(0, 9, 10, 0, 4, 1, 8)) == "xs row 0: base 0 + window 8 < length 9"
    xs = XsRolling.stack([fed(8), fed(6)])
    with pytest.raises(CacheRefusal) as e:
        xs.set_row_lens([8, 7])
    assert str(e.value) == "xs row 1: set length 7 is past the 6 tokens seen"


@pytest.mark.rule("XsRolling")
def test_appends_up_to_max_seq_len_and_the_refusal_names_the_row():
    xs = fed(8, max_seq_len=8)
    assert xs.tokens == [8]
    with pytest.raises(CacheRefusal) as e:
        xs.append_rows(np.zeros((1, 1, D)))
    assert str(e.value) == "xs row 0 would hold 9 tokens, above max_seq_len 8"


@pytest.mark.rule("XsRolling")
def test_the_slot_retains_by_its_own_margin():
    # margin 8, ratio 4, span 2, 40 tokens: base = (max(40 - 8, 0) // 4 + 1 - 2) * 4 = 28
    assert fed(40, window=40, margin=8).base == [28]


# --- zeros behind base and in front of a rolled-back tail ----------------------------------

@pytest.mark.rule("XsRolling")
def test_the_tail_holds_zeros_behind_base():
    # W 23, ratio 4, span 2, margin 16, 42 tokens: base = (26 // 4 - 1) * 4 = 20; the tail
    # holds tokens 19 .. 41, so exactly column 0 (token 19) lies behind base
    xs = fed(42, window=23)
    assert xs.base == [20]
    assert not xs.tail[0, 0].any() and xs.tail[0, 1:].all()
    assert np.array_equal(xs.row_history(0)[:, 0], np.arange(21, 43))


@pytest.mark.rule("XsRolling length setters")
def test_a_rollback_shifts_the_tail_right_with_zeros_in_front():
    xs = fed(12, window=32)
    xs.set_row_lens([10])
    assert not xs.tail[0, :22].any()  # 20 unused columns, then the 2 rolled back
    assert np.array_equal(xs.tail[0, 22:, 0], np.arange(1, 11))


@pytest.mark.rule("XsRolling")
def test_clone_is_deep():
    xs = fed(12, window=32)
    c = xs.clone()
    xs.set_row_lens([10])
    assert c.tokens == [12] and np.array_equal(c.row_history(0)[:, 0], np.arange(1, 13))


# --- the fields a split or a stack carries over --------------------------------------------

@pytest.mark.rule("XsRolling")
def test_split_rows_keep_every_setting_and_one_row_each():
    xs = XsRolling(4, span_groups=1, window=13, max_seq_len=100, batch=3, dim=D, margin=8)
    for row in xs.split_rows():  # no buffers yet
        assert (row.ratio, row.span, row.window, row.max_seq_len, row.margin, row.dim) == (
            4, 1, 13, 100, 8, D)
    xs.append_rows(np.ones((3, 9, D)))
    assert xs.dim == D
    for row in xs.split_rows():
        assert (row.span, row.window, row.margin, row.dim, row.batch) == (1, 13, 8, D, 1)
        assert row.tail.shape == (1, 13, D) and row.comp.shape == (1, 2, D)


@pytest.mark.rule("XsRolling")
def test_a_slot_without_buffers_reports_empty_rows_of_its_width():
    assert XsRolling(4, window=8, dim=D).dim == D
    assert XsRolling(4, window=8, dim=D).row_comp(0).shape == (0, D)
    assert XsRolling(4, window=8, dim=D).row_history(0).shape == (0, D)
    assert XsRolling(4, window=8).row_comp(0).shape == (0, 0)
    assert XsRolling(4, window=8).row_history(0).shape == (0, 0)
    assert XsRolling(4).supports_per_sequence_len() is False


@pytest.mark.rule("XsRolling")
def test_float32_rows_stay_float32_through_appends_and_stacks():
    a = fed(5, window=32, dtype=np.float32)
    a.append_rows(np.ones((1, 4, D), dtype=np.float32))  # grows comp from 1 to 2 blocks
    assert a.tail.dtype == np.float32 and a.comp.dtype == np.float32 and a.comp.shape[1] == 2
    out = XsRolling.stack([XsRolling(4, window=32), a])  # the first row has no buffers yet
    assert out.dim == D and out.tail.dtype == np.float32 and out.comp.dtype == np.float32
    assert out.tail.shape == (2, 32, D) and not out.tail[0].any() and not out.comp[0].any()


@pytest.mark.rule("XsRolling")
def test_comp_holds_exactly_the_completed_blocks():
    assert fed(3, window=32).comp.shape == (1, 0, D)
    assert fed(9, window=32).comp.shape == (1, 2, D)


@pytest.mark.rule("XsRolling")
def test_reconciling_slots_without_buffers_and_a_batch_of_zero_rows():
    out = XsRolling.stack([XsRolling(4, window=32), XsRolling(4, window=32)],
                          reconcile_bases=True)
    assert out.tokens == [0, 0] and out.base == [0, 0] and out.tail is None
    empty = XsRolling(4, window=32, batch=0)
    empty.append_rows(np.zeros((0, 5, D)))
    assert empty.tokens == [] and empty.comp.shape == (0, 0, D)
