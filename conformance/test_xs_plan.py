"""The compressor history's host-side rules (masks-and-scheduling.md §13, cache-and-draft.md
§12.3): the compressor, `span_groups` and the rollback margin, the advance plan
`plan_xs_advance`, and the rollback refusal with its resume point. These run on host integers
only; the reference's and the port's XsRolling slots both call them (test_xs_rolling.py runs
the slots).

Expected values are the §13 formulas worked by hand in the comments (`need_start`, `off`,
`length`, `keep_from`, `base' = min(keep_from, tok')`, `resumable_from`, `base + W < len`) and
the docstrings' stated messages."""

import numpy as np
import pytest

from raggedspec.reference.errors import CacheRefusal
from raggedspec.reference.xs_rolling import (
    MTP_DEPTH_CAP,
    XS_TAIL_MARGIN_TOKENS,
    XsRolling,
    compress_blocks,
    plan_xs_advance,
    resumable_from,
    rollback_refusal,
    span_groups_for,
)


def _fields(p, names: str) -> tuple:
    return tuple(getattr(p, n) for n in names.split())


# --- the compressor and the constants --------------------------------------------------------

@pytest.mark.rule("compressor")
def test_compress_blocks_is_the_mean_of_each_complete_block():
    x = np.arange(10, dtype=np.float64).reshape(1, 10, 1)
    assert compress_blocks(x, 4).tolist() == [[[1.5], [5.5]]]  # the incomplete 8..9 dropped
    y = np.arange(2 * 3 * 8 * 2, dtype=np.float64).reshape(2, 3, 8, 2)
    assert compress_blocks(y, 4).shape == (2, 3, 2, 2)
    assert compress_blocks(y, 4)[1, 2, 1].tolist() == list(y[1, 2, 4:8].mean(axis=0))
    assert compress_blocks(x, 128).shape == (1, 0, 1)
    z = np.arange(6, dtype=np.float64).reshape(3, 2)
    assert np.array_equal(compress_blocks(z, 1), z)  # ratio 1: every token is its own block


@pytest.mark.rule("XS_TAIL_MARGIN_TOKENS and span_groups")
def test_span_groups_is_two_for_ratio_four_only():
    assert span_groups_for(4) == 2
    assert [span_groups_for(r) for r in (1, 2, 8, 128)] == [1, 1, 1, 1]
    assert XsRolling(4).span == 2 and XsRolling(128).span == 1


@pytest.mark.rule("XS_TAIL_MARGIN_TOKENS and span_groups")
def test_mtp_depth_cap_stays_within_the_retained_rollback_margin():
    assert MTP_DEPTH_CAP == 8 and XS_TAIL_MARGIN_TOKENS == 16
    assert MTP_DEPTH_CAP <= XS_TAIL_MARGIN_TOKENS


# --- plan_xs_advance: hand-worked rows ---------------------------------------------------------

PLAN = "tokens_after g_done g_target need_start off length take dest base_after"


@pytest.mark.rule("plan_xs_advance")
def test_plan_xs_advance_ratio_4_worked_rows():
    # tok 13, base 0, W 24, t_new 5: tok' 18, blocks 3 -> 4; need_start (3+1-2)*4 = 8;
    # off = 8 + 24 - 13 = 19; len = 16 - 8 = 8; take 1 at 3; keep_from = max(0, (2//4 - 1)*4)
    # -> base' 0.
    p = plan_xs_advance([13], [0], 24, 5, 4, 2, 16).rows[0]
    assert _fields(p, PLAN) == (18, 3, 4, 8, 19, 8, 1, 3, 0)
    # tok 61, base 40, t_new 9: tok' 70; blocks 15 -> 17; need_start 56; off 56+24-61 = 19;
    # len 68-56 = 12; take 2 at 15; keep_from = max(40, (54//4 + 1 - 2)*4 = 48) -> 48.
    p = plan_xs_advance([61], [40], 24, 9, 4, 2, 16).rows[0]
    assert _fields(p, "need_start off length take dest base_after") == (56, 19, 12, 2, 15, 48)
    # no new block: tok 13 + 2 = 15 stays in block 3 (tok 0 + 2 in block 0)
    plan = plan_xs_advance([13, 0], [0, 0], 24, 2, 4, 2, 16).rows
    assert [_fields(p, "take need_start off length tokens_after dest") for p in plan] == [
        (0, None, None, None, 15, 3), (0, None, None, None, 2, 0)]
    # the first blocks have nothing before them: need_start clamps at 0; 8 tokens complete
    # blocks 0 and 1 (off 0 + 24 - 0, length 2 * 4 - 0); keep_from = max(0, (0//4 - 1)*4) = 0
    p = plan_xs_advance([0], [0], 24, 8, 4, 2, 16).rows[0]
    assert _fields(p, "need_start off length take base_after") == (0, 24, 8, 2, 0)
    p = plan_xs_advance([0], [0], 24, 4, 4, 2, 16).rows[0]
    assert _fields(p, "need_start off length take") == (0, 24, 4, 1)


@pytest.mark.rule("plan_xs_advance")
def test_plan_xs_advance_ratio_128_and_ratio_1_worked_rows():
    # tok 250, base 128, W 144, t_new 9: tok' 259; blocks 1 -> 2; need_start 128;
    # off 128+144-250 = 22; len 256-128 = 128; take 1 at 1; keep_from = max(128,
    # (243//128)*128) = 128.
    p = plan_xs_advance([250], [128], 144, 9, 128, 1, 16).rows[0]
    assert _fields(p, "need_start off length take dest base_after") == (128, 22, 128, 1, 1, 128)
    # ratio 1, span 1, tok 0 + 2, margin 16: blocks 0 -> 2, need_start max(0, 0 + 1 - 1) = 0,
    # keep_from = max(0, (0 // 1 + 1 - 1) * 1) = 0
    p = plan_xs_advance([0], [0], 17, 2, 1, 1, 16).rows[0]
    assert _fields(p, "g_done take need_start base_after") == (0, 2, 0, 0)


@pytest.mark.rule("plan_xs_advance")
def test_rows_with_equal_slices_share_one_compressor_call():
    plan = plan_xs_advance([13, 13, 14, 2], [0, 0, 0, 0], 24, 5, 4, 2, 16)
    # rows 0, 1: off 19, len 8, take 1; row 2: off 18; row 3: tok' 7 completes block 0 (off
    # 22, len 4)
    assert plan.calls == {(19, 8, 1): [0, 1], (18, 8, 1): [2], (22, 4, 1): [3]}


@pytest.mark.rule("plan_xs_advance")
def test_plan_xs_advance_refuses_a_history_gap():
    with pytest.raises(CacheRefusal, match="compressor history gap") as e:
        plan_xs_advance([61], [60], 24, 3, 4, 2, 16)  # block 15 needs token 56 < base 60
    assert "56" in str(e.value) and "60" in str(e.value) and "row 0" in str(e.value)
    with pytest.raises(CacheRefusal, match="compressor history gap: row 1 needs token 56 .* base"
                                           " 60"):
        plan_xs_advance([13, 61], [0, 60], 24, 3, 4, 2, 16)  # the offending row is named


@pytest.mark.rule("plan_xs_advance")
def test_plan_xs_advance_refuses_a_run_that_does_not_fit_the_window():
    # W 8, ratio 4: tok' 40, keep_from (24//4 - 1)*4 = 20, run 20 > 8
    with pytest.raises(CacheRefusal, match="run of 20 tokens .* does not fit the window of 8"):
        plan_xs_advance([0], [0], 8, 40, 4, 2, 16)


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
    # window 0, ratio 1, margin 0, nothing new: the smallest sizes are well formed
    plan = plan_xs_advance([0], [0], 0, 0, 1, 1, 0)
    assert [(r.tokens_after, r.take, r.base_after) for r in plan.rows] == [(0, 0, 0)]


# --- the rollback refusal and its resume point ----------------------------------------------

@pytest.mark.rule("XsRolling length setters", "XsRolling rollback refusal, one rule for both "
                                              "layouts")
def test_rollback_refusal_checks_in_order_and_at_the_window_edge():
    # length 8: resume max(0, 2 + 1 - 1) * 4 = 8 >= base 0; base + W = 8 is not < 8
    assert rollback_refusal(0, 8, 10, 0, 4, 1, 8) is None
    assert str(rollback_refusal(0, 9, 10, 0, 4, 1, 8)) == "xs row 0: base 0 + window 8 < length 9"
    assert str(rollback_refusal(3, 11, 10, 0, 4, 1, 8)) == (
        "xs row 3: set length 11 is past the 10 tokens seen")  # past the tokens before the rest
    assert str(rollback_refusal(0, 3, 10, 4, 4, 1, 8)) == (
        "xs row 0: set length 3 is behind base 4 (history starts at 4)")
    # length 9, span 2: resume (9 // 4 + 1 - 2) * 4 = 4 < base 8
    assert str(rollback_refusal(1, 9, 10, 8, 4, 2, 64)) == (
        "xs row 1: set length 9 needs resume point 4, behind base 8 (compressor history gap)")


@pytest.mark.rule("XsRolling length setters")
def test_resumable_from_is_the_first_token_the_next_block_needs():
    # max(0, length // ratio + 1 - span) * ratio
    assert [resumable_from(n, 4, 2) for n in (0, 3, 8, 9, 20)] == [0, 0, 4, 4, 16]
    assert resumable_from(7, 1, 3) == 5 and resumable_from(0, 4, 2) == 0
    with pytest.raises(ValueError, match=r"^length -1 must be >= 0$"):
        resumable_from(-1, 4, 2)


# --- malformed input: ValueError with the stated message -------------------------------------

MALFORMED = [
    (lambda: span_groups_for(0), "compress ratio 0 must be >= 1"),
    (lambda: compress_blocks(np.zeros(4), 2), "compress_blocks needs [..., T, D], got (4,)"),
    (lambda: compress_blocks([[1.0]], 2), "compress_blocks needs [..., T, D], got None"),
    (lambda: compress_blocks(np.zeros((4, 1)), 0), "compress ratio 0 must be >= 1"),
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
    (lambda: plan_xs_advance([4], [-1], 32, 1, 4, 2), "row 0: base -1 must be in [0, tokens 4]"),
]


@pytest.mark.rule("compressor", "plan_xs_advance")
@pytest.mark.parametrize("call, message", MALFORMED, ids=[m for _, m in MALFORMED])
def test_malformed_input_is_refused_with_the_stated_message(call, message):
    with pytest.raises(ValueError) as e:
        call()
    assert str(e.value) == message
