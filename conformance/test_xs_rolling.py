"""XsRolling: compressor history with per-row lengths (masks-and-scheduling.md §13,
cache-and-draft.md §12.3, §17.2 `mtp_verify_rollback_restores_the_compressor_rows_exactly`).

Oracles: `scratch_blocks` (a per-block Python loop over the committed hidden rows, independent
of `compress_blocks`' reshape), and hand-worked values of the §13 formulas."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from raggedspec.reference.cache import KvCache
from raggedspec.reference.errors import CacheRefusal
from raggedspec.reference.xs_rolling import (
    MTP_DEPTH_CAP,
    XS_TAIL_MARGIN_TOKENS,
    XsRolling,
    compress_blocks,
    plan_xs_advance,
    span_groups_for,
)

D = 3


def scratch_blocks(h, ratio):
    """From-scratch compression: block g = mean of rows [g*ratio, (g+1)*ratio), by loop."""
    out = [sum(h[g * ratio + j] for j in range(ratio)) / ratio for g in range(len(h) // ratio)]
    return np.array(out).reshape(len(out), h.shape[1]) if out else np.zeros((0, h.shape[1]))


def assert_row_matches(xs, i, h):
    """Row i's compressed rows equal the from-scratch compression of its committed rows `h`,
    and its retained history `[base, tokens)` equals `h[base:]`."""
    assert xs.tokens[i] == len(h)
    np.testing.assert_allclose(xs.row_comp(i), scratch_blocks(h, xs.ratio), rtol=0, atol=1e-12)
    assert np.array_equal(xs.row_history(i), h[xs.base[i]:])


# --- compress_blocks / constants ---------------------------------------------------------------

@pytest.mark.rule("compressor")
def test_compress_blocks_is_the_mean_of_each_complete_block():
    x = np.arange(10, dtype=np.float64).reshape(1, 10, 1)
    assert compress_blocks(x, 4).tolist() == [
        [[1.5], [5.5]]
    ]  # the incomplete block 8..9 is dropped
    y = np.arange(2 * 3 * 8 * 2, dtype=np.float64).reshape(2, 3, 8, 2)
    assert compress_blocks(y, 4).shape == (2, 3, 2, 2)
    assert compress_blocks(y, 4)[1, 2, 1].tolist() == list(y[1, 2, 4:8].mean(axis=0))
    assert compress_blocks(x, 128).shape == (1, 0, 1)


@pytest.mark.rule("XS_TAIL_MARGIN_TOKENS and span_groups")
def test_span_groups_is_two_for_ratio_four_only():
    assert span_groups_for(4) == 2
    assert [span_groups_for(r) for r in (1, 2, 8, 128)] == [1, 1, 1, 1]
    assert XsRolling(4).span == 2 and XsRolling(128).span == 1


@pytest.mark.rule("XS_TAIL_MARGIN_TOKENS and span_groups")
def test_mtp_depth_cap_stays_within_the_retained_rollback_margin():
    assert MTP_DEPTH_CAP == 8 and XS_TAIL_MARGIN_TOKENS == 16
    assert MTP_DEPTH_CAP <= XS_TAIL_MARGIN_TOKENS


@pytest.mark.rule("XsRolling")
def test_xs_slot_kind_capability_and_clone():
    xs = XsRolling(4, 2, 64, 2048)
    assert (xs.kind, xs.ratio, xs.span, xs.window, xs.max_seq_len) == ("XsRolling", 4, 2, 64, 2048)
    assert not xs.supports_per_sequence_len(False) and xs.supports_per_sequence_len(True)
    xs.append_rows(np.ones((1, 9, D)))
    cp = xs.clone()
    cp.append_rows(np.ones((1, 3, D)))
    cp.tail[0, -1] = 5
    assert xs.tokens == [9] and xs.tail[0, -1, 0] == 1


# --- plan_xs_advance: hand-worked rows ---------------------------------------------------------

@pytest.mark.rule("plan_xs_advance")
def test_plan_xs_advance_ratio_4_worked_rows():
    # tok 13, base 0, W 24, t_new 5: tok' 18, blocks 3 -> 4; need_start (3+1-2)*4 = 8;
    # off = 8 + 24 - 13 = 19; len = 16 - 8 = 8; take 1 at 3; keep_from = max(0, (2//4 - 1)*4) ->
    # base' 0.
    p = plan_xs_advance([13], [0], 24, 5, 4, 2, 16).rows[0]
    assert (
        p.tokens_after,
        p.g_done,
        p.g_target,
        p.need_start,
        p.off,
        p.length,
        p.take,
        p.dest,
        p.base_after,
    ) == (18, 3, 4, 8, 19, 8, 1, 3, 0)
    # tok 61, base 40, t_new 9: tok' 70; blocks 15 -> 17; need_start 56; off 56+24-61 = 19;
    # len 68-56 = 12; take 2 at 15; keep_from = max(40, (54//4 + 1 - 2)*4 = 48) -> 48.
    p = plan_xs_advance([61], [40], 24, 9, 4, 2, 16).rows[0]
    assert (p.need_start, p.off, p.length, p.take, p.dest, p.base_after) == (56, 19, 12, 2, 15, 48)
    # no new block: tok 13 + 2 = 15 stays in block 3
    p = plan_xs_advance([13], [0], 24, 2, 4, 2, 16).rows[0]
    assert (p.take, p.need_start, p.off, p.length, p.tokens_after) == (0, None, None, None, 15)
    # the first block has nothing before it: need_start clamps at 0
    p = plan_xs_advance([0], [0], 24, 4, 4, 2, 16).rows[0]
    assert (p.need_start, p.off, p.length, p.take) == (0, 24, 4, 1)


@pytest.mark.rule("plan_xs_advance")
def test_plan_xs_advance_ratio_128_worked_row():
    # tok 250, base 128, W 144, t_new 9: tok' 259; blocks 1 -> 2; need_start 128;
    # off 128+144-250 = 22; len 256-128 = 128; take 1 at 1; keep_from = max(128, (243//128)*128) =
    # 128.
    p = plan_xs_advance([250], [128], 144, 9, 128, 1, 16).rows[0]
    assert (p.need_start, p.off, p.length, p.take, p.dest, p.base_after) == (
        128,
        22,
        128,
        1,
        1,
        128,
    )


@pytest.mark.rule("plan_xs_advance")
def test_rows_with_equal_slices_share_one_compressor_call():
    plan = plan_xs_advance([13, 13, 14, 2], [0, 0, 0, 0], 24, 5, 4, 2, 16)
    # rows 0, 1: off 19, len 8, take 1; row 2: off 18; row 3: tok' 7 completes block 0 (off 22, len
    # 4)
    assert plan.calls == {(19, 8, 1): [0, 1], (18, 8, 1): [2], (22, 4, 1): [3]}


@pytest.mark.rule("plan_xs_advance")
def test_plan_xs_advance_refuses_a_history_gap():
    with pytest.raises(CacheRefusal, match="compressor history gap") as e:
        plan_xs_advance([61], [60], 24, 3, 4, 2, 16)  # block 15 needs token 56 < base 60
    assert "56" in str(e.value) and "60" in str(e.value) and "row 0" in str(e.value)


@pytest.mark.rule("plan_xs_advance")
def test_plan_xs_advance_refuses_a_run_that_does_not_fit_the_window():
    # W 8, ratio 4: tok' 40, keep_from (24//4 - 1)*4 = 20, run 20 > 8
    with pytest.raises(CacheRefusal, match="does not fit the window") as e:
        plan_xs_advance([0], [0], 8, 40, 4, 2, 16)
    assert "20" in str(e.value) and "8" in str(e.value)


@pytest.mark.rule("XS_TAIL_MARGIN_TOKENS and span_groups")
@pytest.mark.parametrize("ratio,prefill,base", [
    (4, 13, 0), (4, 20, 0), (4, 61, 40),           # keep_from(61) = (45//4 + 1 - 2)*4 = 40
    (128, 130, 0), (128, 250, 128), (128, 255, 128), (128, 256, 128), (128, 383, 256),
])
def test_retention_keeps_the_margin_behind_the_newest_token(ratio, prefill, base):
    xs = XsRolling(ratio)
    xs.append_rows(np.ones((1, prefill, D)))
    assert xs.base == [base]
    xs.try_set_len(prefill - min(XS_TAIL_MARGIN_TOKENS, prefill))  # the margin is always retained


@pytest.mark.rule("XS_TAIL_MARGIN_TOKENS and span_groups")
@given(st.sampled_from([2, 3, 4, 8, 128]), st.lists(st.integers(0, 40), min_size=1, max_size=12))
def test_a_rollback_within_the_margin_is_never_refused(ratio, sizes):
    xs = XsRolling(ratio)
    for s in sizes:
        xs.append_rows(np.ones((1, s, 1)))
        tok = xs.tokens[0]
        assert xs.base[0] <= tok <= xs.base[0] + xs.window
        for back in range(0, min(XS_TAIL_MARGIN_TOKENS, tok) + 1):
            xs.try_set_len(tok - back)


# --- length setters ------------------------------------------------------------------------

def filled(ratio, n, batch_rows=None):
    xs = XsRolling(ratio)
    xs.append_rows(np.arange(n * D, dtype=np.float64).reshape(1, n, D))
    return xs


@pytest.mark.rule(
    "XsRolling length setters",
    "XsRolling rollback refusal, one rule for both layouts",
)
def test_try_set_len_refusals():
    xs = filled(4, 61)  # base 40
    with pytest.raises(CacheRefusal, match="past the 61 tokens"):
        xs.try_set_len(62)
    with pytest.raises(CacheRefusal, match="behind base 40"):
        xs.try_set_len(39)
    with pytest.raises(CacheRefusal, match="resume point 36, behind base 40"):
        xs.try_set_len(43)  # 43 >= base, but block 10 needs token 36
    xs.try_set_len(44)
    ragged = XsRolling.stack([filled(4, 13), filled(4, 15)], reconcile_bases=False)
    with pytest.raises(CacheRefusal, match="non-uniform") as e:
        ragged.try_set_len(12)
    assert "13" in str(e.value) and "15" in str(e.value)
    assert xs.tokens == [61] and ragged.tokens == [13, 15]


@pytest.mark.rule("XsRolling length setters")
def test_set_row_lens_refusals_change_nothing():
    a, b = filled(4, 61), filled(4, 20)
    xs = XsRolling.stack([a, b])
    tail = xs.tail.copy()
    for lens, pattern in (
        ([62, 20], "past the 61"),
        ([39, 20], "behind base 40"),
        ([43, 20], "behind base 40"),
        ([61, 21], "past the 20"),
    ):
        with pytest.raises(CacheRefusal, match=pattern):
            xs.set_row_lens(lens)
        assert xs.tokens == [61, 20] and np.array_equal(xs.tail, tail)
    with pytest.raises(ValueError):
        xs.set_row_lens([61])
    xs.set_row_lens([45, 4])
    assert xs.tokens == [45, 4] and xs.base == [40, 0] and xs.current_seq_len == 45


@pytest.mark.rule("XsRolling length setters")
def test_the_margin_is_measured_from_the_newest_token_not_per_rollback():
    xs = XsRolling(2)  # span 1, W 18
    xs.append_rows(np.ones((1, 18, D)))
    assert xs.base == [2]  # keep_from = ((18 - 16)//2 + 1 - 1)*2
    xs.set_len(5)          # 13 back: inside the margin
    xs.append_rows(np.ones((1, 0, D)))
    with pytest.raises(CacheRefusal, match="behind base 2"):
        xs.set_len(1)      # 17 back from the newest token reached: past the margin


@pytest.mark.rule("XsRolling")
def test_batched_comp_length_is_the_max_row_over_ratio():
    xs = XsRolling.stack([filled(4, n) for n in (13, 15, 16, 20, 61)])
    assert xs.current_seq_len == 61 and xs.comp_seq_len == 61 // 4
    xs.set_row_lens([13, 15, 16, 20, 50])
    assert xs.current_seq_len == 50 and xs.comp_seq_len == 12


@pytest.mark.rule("XsRolling")
def test_append_past_max_seq_len_is_refused():
    xs = XsRolling(4, max_seq_len=16)
    xs.append_rows(np.ones((1, 12, D)))
    with pytest.raises(CacheRefusal, match="above max_seq_len") as e:
        xs.append_rows(np.ones((1, 5, D)))
    assert "17" in str(e.value) and "16" in str(e.value) and xs.tokens == [12]


@pytest.mark.rule("XsRolling")
def test_append_refusal_leaves_the_slot_unchanged():
    xs = filled(4, 61)
    xs.base = [60]  # a base past the history block 15 needs
    tail, comp = xs.tail.copy(), xs.comp.copy()
    with pytest.raises(CacheRefusal, match="compressor history gap"):
        xs.append_rows(np.ones((1, 3, D)))
    assert xs.tokens == [61] and np.array_equal(xs.tail, tail) and np.array_equal(xs.comp, comp)


@pytest.mark.rule("XsRolling")
def test_reset_drops_the_history():
    xs = filled(4, 30)
    xs.reset()
    assert (xs.tokens, xs.base, xs.tail, xs.comp, xs.current_seq_len) == ([0], [0], None, None, 0)


# --- split / stack ---------------------------------------------------------------------------

@pytest.mark.rule("XsRolling")
def test_split_and_stack_round_trip_with_per_row_tokens_and_base():
    rng = np.random.default_rng(3)
    hs = [rng.standard_normal((n, D)) for n in (13, 61, 0)]
    rows = []
    for h in hs:
        xs = XsRolling(4)
        if len(h):
            xs.append_rows(h[None])
        rows.append(xs)
    batched = XsRolling.stack(rows)
    assert batched.tokens == [13, 61, 0] and batched.base == [0, 40, 0]
    assert batched.comp.shape == (3, 15, D)  # padded at the end to the widest
    assert not batched.comp[0, 3:].any() and not batched.comp[2].any()
    for i, h in enumerate(hs):
        assert_row_matches(batched, i, h)
    back = batched.split_rows()
    for row, h in zip(back, hs, strict=False):
        assert row.batch == 1
        assert_row_matches(row, 0, h)
        assert not row.tail[
            0, : row.window - (row.tokens[0] - row.base[0])
        ].any()  # nothing kept behind base


@pytest.mark.rule("XsRolling")
def test_stack_with_the_flag_off_reconciles_the_bases():
    a, b = filled(4, 61), filled(4, 61)
    b.base = [28]
    out = XsRolling.stack([a, b], reconcile_bases=True)
    assert out.base == [40, 40]
    assert not out.tail[1, : out.window - 21].any()
    with pytest.raises(ValueError):
        XsRolling.stack([filled(4, 13), filled(4, 15)], reconcile_bases=True)


# --- §17.2 mtp_verify_rollback_restores_the_compressor_rows_exactly ----------------------------

SHAPES = [
    (1, 1),
    (2, 1),
    (2, 2),
    (3, 2),
    (4, 1),
    (5, 5),
    (6, 3),
    (8, 2),
    (9, 9),
]  # (w = depth+1, commit)


@pytest.mark.rule("compressor")
@pytest.mark.parametrize(
    "ratio,prefills", [(4, [13, 15, 16, 20, 61]), (128, [130, 250, 255, 256, 383])]
)
def test_mtp_verify_rollback_restores_the_compressor_rows_exactly(ratio, prefills):
    rng = np.random.default_rng(ratio)
    crossed = 0
    for committed in prefills:
        for w, commit in SHAPES:
            truth = rng.standard_normal((committed + commit + 9, D))
            kv = [KvCache.new_normal(4096), KvCache.new_normal(4096)]
            xs = XsRolling(ratio)

            def feed(rows, xs=xs, kv=kv):
                xs.append_rows(rows[None])
                for slot in kv:
                    block = rows[None, None]
                    slot.append(block, block)

            feed(truth[: committed - 1])                       # prefill committed - 1
            feed(truth[committed - 1 : committed])  # then 1
            spec = np.concatenate(
                [truth[committed : committed + commit], rng.standard_normal((w - commit, D)) + 50]
            )
            before = xs.comp_seq_len
            feed(spec)  # a verify window of w, commit of them true
            crossed += xs.comp_seq_len > (committed + commit) // ratio
            n_drop = w - commit
            for slot in kv + [xs]:  # truncate_cache_by(n_drop), every slot
                slot.set_len(max(slot.current_seq_len - n_drop, 0))
            assert [s.current_seq_len for s in kv + [xs]] == [committed + commit] * 3
            assert_row_matches(xs, 0, truth[: committed + commit])
            feed(truth[committed + commit :])  # onward decode over the rolled-back rows
            assert_row_matches(xs, 0, truth)
            assert before <= xs.comp_seq_len
    assert crossed > 0  # some speculative block was compressed and had to be rewritten (D12)


@pytest.mark.rule("compressor")
@pytest.mark.parametrize(
    "ratio,prefills", [(4, [13, 15, 16, 20, 61]), (128, [130, 250, 255, 256, 383])]
)
def test_a_ragged_xs_batch_rolls_each_row_back_to_its_own_commit(ratio, prefills):
    rng = np.random.default_rng(7 + ratio)
    for w, _ in SHAPES:
        truths = [rng.standard_normal((p + 2 * w, D)) for p in prefills]
        rows = []
        for p, h in zip(prefills, truths, strict=False):
            solo = XsRolling(ratio)
            solo.append_rows(h[None, :p])
            rows.append(solo)
        xs = XsRolling.stack(rows)
        commits = [1 + (i * 3 + w) % w for i in range(len(prefills))]
        block = np.stack([np.concatenate([h[p : p + c], rng.standard_normal((w - c, D)) - 40])
                          for p, h, c in zip(prefills, truths, commits, strict=False)])
        xs.append_rows(block)
        # per-sequence commit
        xs.set_row_lens([p + c for p, c in zip(prefills, commits, strict=False)])
        assert (
            xs.comp_seq_len == max(p + c for p, c in zip(prefills, commits, strict=False)) // ratio
        )
        for i, (p, c, h) in enumerate(zip(prefills, commits, truths, strict=False)):
            assert_row_matches(xs, i, h[: p + c])
        # onward: every row feeds w more true rows from its own position
        nxt = np.stack(
            [h[p + c : p + c + w] for p, c, h in zip(prefills, commits, truths, strict=False)]
        )
        xs.append_rows(nxt)
        for i, (p, c, h) in enumerate(zip(prefills, commits, truths, strict=False)):
            assert_row_matches(xs, i, h[: p + c + w])


@pytest.mark.rule("XsRolling")
@given(st.data())
def test_random_ragged_feeds_and_rollbacks_match_a_from_scratch_compression(data):
    ratio = data.draw(st.sampled_from([2, 3, 4, 8, 128]))
    b = data.draw(st.integers(1, 4))
    prefills = data.draw(st.lists(st.integers(0, 300), min_size=b, max_size=b))
    seed = data.draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    history = [rng.standard_normal((p, 2)) for p in prefills]
    rows = []
    for h in history:
        solo = XsRolling(ratio)
        cut = data.draw(st.integers(0, len(h)))
        for part in (h[:cut], h[cut:]):
            solo.append_rows(part[None])
        rows.append(solo)
    xs = XsRolling.stack(rows)
    floor = [
        p - XS_TAIL_MARGIN_TOKENS for p in prefills
    ]  # no rollback behind any newest-minus-margin
    for _ in range(data.draw(st.integers(1, 6))):
        t_new = data.draw(st.integers(0, 12))
        x = rng.standard_normal((b, t_new, 2))
        xs.append_rows(x)
        fed = [np.concatenate([h, x[i]]) for i, h in enumerate(history)]
        floor = [max(fl, len(f) - XS_TAIL_MARGIN_TOKENS) for fl, f in zip(floor, fed, strict=False)]
        drops = [
            data.draw(st.integers(0, len(f) - max(fl, 0)))
            for f, fl in zip(fed, floor, strict=False)
        ]
        xs.set_row_lens([len(f) - d for f, d in zip(fed, drops, strict=False)])
        history = [f[: len(f) - d] for f, d in zip(fed, drops, strict=False)]
        assert xs.comp_seq_len == max(len(h) for h in history) // ratio
        for i, h in enumerate(history):
            assert_row_matches(xs, i, h)
            assert xs.base[i] <= xs.tokens[i] <= xs.base[i] + xs.window
