"""XsRolling: the compressor history of a compressed layer with per-row lengths
(masks-and-scheduling.md §13, cache-and-draft.md §12.3, §17.2
`mtp_verify_rollback_restores_the_compressor_rows_exactly`).

Every test runs one body over both implementations (`over_xs`: the reference's end-anchored
tail and the port's ring buffer, through the rows each reports), each asserting the values
the rule states. Oracles: `scratch_blocks` (a per-block Python loop over the committed hidden
rows, independent of any reshape) and hand-worked values of the §13 formulas. What only one
representation has, and the port compared with the reference where a value is computed, is
test_xs_layouts.py's; the host-side rules the slots call (the plan, the compressor, the
rollback refusal) test_xs_plan.py's."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from raggedspec.conformance.helpers import over_xs, scratch_blocks, xs_fed, xs_filled, xs_state
from raggedspec.gpu.testing import host
from raggedspec.reference.errors import CacheRefusal
from raggedspec.reference.xs_rolling import XS_TAIL_MARGIN_TOKENS, span_groups_for

D = 3
RATIOS = [2, 3, 4, 8, 128]


def assert_row_matches(xs, i, h):
    """Row i's compressed rows equal the from-scratch compression of its committed rows `h`,
    and its retained history `[base, tokens)` equals `h[base:]`."""
    tokens, base, history, comp = xs_state(xs)
    assert tokens[i] == len(h)
    np.testing.assert_allclose(comp[i], scratch_blocks(h, xs.ratio), rtol=0, atol=1e-12)
    assert np.array_equal(history[i], h[base[i]:])


def ones(impl, *shape):
    return impl.x(np.ones(shape))


# --- construction ------------------------------------------------------------------------------

@pytest.mark.rule("XsRolling", "XsRolling slot construction and read-back, port")
@over_xs
def test_the_slot_kind_sizes_and_defaults(impl):
    xs = impl.new(4, 2, 64, 2048)
    assert (xs.kind, xs.ratio, xs.span, xs.window, xs.max_seq_len) == ("XsRolling", 4, 2, 64, 2048)
    d = impl.new(4)
    assert (d.max_seq_len, d.span, d.window, d.margin) == (4096, span_groups_for(4),
                                                           span_groups_for(4) * 4 + 16, 16)
    q = impl.new(4, span_groups=3, window=40, dim=5)
    assert (q.span, q.window, q.dim) == (3, 40, 5)
    assert impl.new(4, window=1).window == 1
    assert impl.new(4, window=8, max_seq_len=0).max_seq_len == 0
    assert (impl.new(4, 1, 1, 0, 0).window, impl.new(4, 1, 1, 0, 0).batch) == (1, 0)
    for span, window, max_seq_len, batch in ((0, 8, 10, 1), (1, 0, 10, 1), (1, 8, -1, 1),
                                             (1, 8, 10, -1)):
        with pytest.raises(ValueError) as info:
            impl.new(4, span, window, max_seq_len, batch)
        assert str(info.value) == (f"span {span}, window {window}, max_seq_len {max_seq_len}, "
                                   f"batch {batch} out of range")


@pytest.mark.rule("XsRolling", "XsRolling slot construction and read-back, port")
@over_xs
def test_a_slot_without_buffers_reports_empty_float64_rows_of_its_width(impl):
    """Before the first append row i's history is `tokens_i - base_i` rows of width `dim` (0
    when unknown) and its comp `tokens_i // ratio` rows: float64 zeros."""
    assert impl.new(4, window=8, dim=D).dim == D
    for dim, width in ((D, D), (None, 0)):
        xs = impl.new(4, window=8, dim=dim)
        assert xs_state(xs)[2][0].shape == xs_state(xs)[3][0].shape == (0, width)
    xs = impl.new(4, batch=1, dim=3)
    xs.tokens, xs.base = [9], [4]
    h, c = xs.row_history(0), xs.row_comp(0)
    assert tuple(h.shape) == (5, 3) and tuple(c.shape) == (2, 3)
    assert h.dtype == c.dtype and host(h).dtype == np.float64 and not h.any() and not c.any()
    q = impl.new(4, batch=1)
    q.tokens = [2]
    assert tuple(q.row_history(0).shape) == (2, 0) and tuple(q.row_comp(0).shape) == (0, 0)


# --- retention and the rollback margin ---------------------------------------------------------

@pytest.mark.rule("XS_TAIL_MARGIN_TOKENS and span_groups")
@over_xs
@pytest.mark.parametrize("ratio,prefill,base", [
    (4, 13, 0), (4, 20, 0), (4, 61, 40),           # keep_from(61) = (45//4 + 1 - 2)*4 = 40
    (128, 130, 0), (128, 250, 128), (128, 255, 128), (128, 256, 128), (128, 383, 256),
])
def test_retention_keeps_the_margin_behind_the_newest_token(impl, ratio, prefill, base):
    xs = impl.new(ratio)
    xs.append_rows(ones(impl, 1, prefill, D))
    assert xs_state(xs)[1] == [base]
    xs.try_set_len(prefill - min(XS_TAIL_MARGIN_TOKENS, prefill))  # the margin is retained


@pytest.mark.rule("XS_TAIL_MARGIN_TOKENS and span_groups")
@over_xs
@given(st.sampled_from(RATIOS), st.lists(st.integers(0, 40), min_size=1, max_size=12))
def test_a_rollback_within_the_margin_is_never_refused(impl, ratio, sizes):
    xs = impl.new(ratio)
    for s in sizes:
        xs.append_rows(ones(impl, 1, s, 1))
        [tok], [base] = xs_state(xs)[:2]
        assert base <= tok <= base + xs.window
        for back in range(0, min(XS_TAIL_MARGIN_TOKENS, tok) + 1):
            xs.try_set_len(tok - back)


@pytest.mark.rule("XsRolling", "XsRolling append and compressor, port")
@over_xs
def test_the_slot_retains_by_its_own_margin(impl):
    """Margin 8, ratio 4, span 2, 40 tokens: base = (max(40 - 8, 0) // 4 + 1 - 2) * 4 = 28.
    Ratio 2, span 1, margin 2 (window 4): 7 tokens keep history from
    `((7 - 2) // 2 + 1 - 1) * 2 = 4`, 3 more from `((10 - 2) // 2) * 2 = 8`; the default
    margin (16) would keep everything and not fit the window of 4."""
    assert xs_state(xs_fed(impl, 40, window=40, margin=8))[1] == [28]
    rng = np.random.default_rng(3)
    xs, fed_rows = impl.new(2, 1, None, 64, 2, 3, 2), np.zeros((2, 0, 3))
    assert (xs.window, xs.margin) == (4, 2)
    for t, base in ((7, 4), (3, 8)):
        x = rng.standard_normal((2, t, 3))
        xs.append_rows(impl.x(x))
        fed_rows = np.concatenate([fed_rows, x], axis=1)
        assert xs_state(xs)[1] == [base, base]
        for i in range(2):
            assert_row_matches(xs, i, fed_rows[i])


# --- the length setters --------------------------------------------------------------------

@pytest.mark.rule("XsRolling length setters", "XsRolling length setters, port",
                  "XsRolling rollback refusal, one rule for both layouts")
@over_xs
def test_try_set_len_refusals(impl):
    xs = xs_filled(impl, 4, 61)  # base 40
    with pytest.raises(CacheRefusal, match="past the 61 tokens"):
        xs.try_set_len(62)
    with pytest.raises(CacheRefusal, match="behind base 40"):
        xs.try_set_len(39)
    with pytest.raises(CacheRefusal, match="resume point 36, behind base 40"):
        xs.try_set_len(43)  # 43 >= base, but block 10 needs token 36
    xs.try_set_len(44)
    ragged = impl.stack([xs_filled(impl, 4, 13), xs_filled(impl, 4, 15)])
    with pytest.raises(CacheRefusal, match=r"^xs set_len\(12\) refused: non-uniform rows with "
                                           r"tokens \[13, 15\]$"):
        ragged.try_set_len(12)
    with pytest.raises(CacheRefusal, match="non-uniform"):
        ragged.set_len(12)
    assert xs_state(xs)[0] == [61] and xs_state(ragged)[0] == [13, 15]
    xs.set_len(44)
    assert_row_matches(xs, 0, np.arange(44 * D, dtype=np.float64).reshape(44, D))


@pytest.mark.rule("XsRolling length setters", "XsRolling length setters, port")
@over_xs
def test_set_row_lens_refusals_change_nothing(impl):
    xs = impl.stack([xs_filled(impl, 4, 61), xs_filled(impl, 4, 20)])
    before = xs_state(xs)
    for lens, pattern in (
        ([62, 20], "past the 61"),
        ([39, 20], "behind base 40"),
        ([43, 20], "behind base 40"),
        ([61, 21], "past the 20"),
    ):
        with pytest.raises(CacheRefusal, match=pattern):
            xs.set_row_lens(lens)
        after = xs_state(xs)
        assert after[:2] == before[:2]
        assert all(np.array_equal(a, b) for a, b in zip(after[2], before[2], strict=True))
    xs.set_row_lens([45, 4])
    assert xs_state(xs)[:2] == ([45, 4], [40, 0]) and xs.current_seq_len == 45


@pytest.mark.rule("XsRolling length setters", "XsRolling length setters, port",
                  "XsRolling rollback refusal, one rule for both layouts")
@over_xs
def test_the_last_two_checks_on_hand_set_bases(impl):
    """States no append reaches (bases are multiples of the ratio; tokens <= base + W), to
    pin the two last checks: a resume point one token behind base 37, and a length past
    base 30 + W 24. Refused, nothing changed."""
    for hand_base, length, message in (
        (37, 43, "xs row 0: set length 43 needs resume point 36, behind base 37 (compressor "
                 "history gap)"),
        (30, 55, "xs row 0: base 30 + window 24 < length 55"),
    ):
        xs = xs_filled(impl, 4, 61)
        xs.base = [hand_base]
        with pytest.raises(CacheRefusal) as e:
            xs.set_row_lens([length])
        assert str(e.value) == message and xs_state(xs)[0] == [61]


@pytest.mark.rule("XsRolling length setters")
@over_xs
def test_the_margin_is_measured_from_the_newest_token_not_per_rollback(impl):
    xs = impl.new(2)  # span 1, W 18
    xs.append_rows(ones(impl, 1, 18, D))
    assert xs_state(xs)[1] == [2]  # keep_from = ((18 - 16)//2 + 1 - 1)*2
    xs.set_len(5)          # 13 back: inside the margin
    xs.append_rows(ones(impl, 1, 0, D))
    with pytest.raises(CacheRefusal, match="behind base 2"):
        xs.set_len(1)      # 17 back from the newest token reached: past the margin


@pytest.mark.rule("XsRolling length setters", "XsRolling length setters, port")
@over_xs
def test_a_rollback_past_a_row_names_the_row(impl):
    xs = impl.stack([xs_fed(impl, 8), xs_fed(impl, 6)])
    with pytest.raises(CacheRefusal) as e:
        xs.set_row_lens([8, 7])
    assert str(e.value) == "xs row 1: set length 7 is past the 6 tokens seen"
    xs.set_row_lens([8, 5])
    assert xs.current_seq_len == 8 and xs_state(xs)[0] == [8, 5]


# --- appends ---------------------------------------------------------------------------------

@pytest.mark.rule("XsRolling", "XsRolling append and compressor, port")
@over_xs
def test_an_append_may_reach_max_seq_len_and_the_next_is_refused(impl):
    """`max_seq_len` 8: 8 tokens are accepted; one more would hold 9, refused naming the row
    and nothing changed."""
    xs = xs_fed(impl, 8, max_seq_len=8)
    before = xs_state(xs)
    assert before[0] == [8]
    with pytest.raises(CacheRefusal) as e:
        xs.append_rows(ones(impl, 1, 1, D))
    assert str(e.value) == "xs row 0 would hold 9 tokens, above max_seq_len 8"
    assert_row_matches(xs, 0, before[2][0])
    big = impl.new(4, max_seq_len=16)
    big.append_rows(ones(impl, 1, 12, D))
    with pytest.raises(CacheRefusal, match="^xs row 0 would hold 17 tokens, above max_seq_len 16"):
        big.append_rows(ones(impl, 1, 5, D))
    assert xs_state(big)[0] == [12]


@pytest.mark.rule("XsRolling", "XsRolling append and compressor, port")
@over_xs
def test_append_refusal_leaves_the_slot_unchanged(impl):
    xs = xs_filled(impl, 4, 61)
    xs.base = [60]  # a base past the history block 15 needs (token 56)
    before = xs_state(xs)
    with pytest.raises(CacheRefusal, match="^compressor history gap: row 0 needs token 56"):
        xs.append_rows(ones(impl, 1, 3, D))
    after = xs_state(xs)
    assert after[:2] == before[:2] and np.array_equal(after[3][0], before[3][0])


@pytest.mark.rule("XsRolling", "XsRolling append and compressor, port")
@over_xs
def test_comp_holds_exactly_the_completed_blocks(impl):
    assert tuple(xs_fed(impl, 3, window=32).comp.shape) == (1, 0, D)
    assert tuple(xs_fed(impl, 9, window=32).comp.shape) == (1, 2, D)
    empty = impl.new(4, window=32, batch=0)
    empty.append_rows(impl.x(np.zeros((0, 5, D))))
    assert xs_state(empty)[0] == [] and tuple(empty.comp.shape) == (0, 0, D)
    assert empty.current_seq_len == 0


@pytest.mark.rule("XsRolling", "XsRolling append and compressor, port")
@over_xs
def test_malformed_appends_setters_and_stacks_are_refused_with_their_messages(impl):
    xs = impl.new(4, window=32, batch=2)
    xs.append_rows(impl.x(np.zeros((2, 4, D))))
    cases = [
        (lambda: xs.append_rows(impl.x(np.zeros((1, 4, D)))),
         "append_rows needs [B=2, t_new, D], got (1, 4, 3)"),
        (lambda: xs.append_rows(impl.x(np.zeros((2, 4)))),
         "append_rows needs [B=2, t_new, D], got (2, 4)"),
        (lambda: xs.append_rows(impl.x(np.zeros((2, 1, D + 1)))),
         "hidden width 4 differs from the slot's 3"),
        (lambda: xs.set_row_lens([4]), "1 row lengths for a batch of 2"),
        (lambda: xs.set_row_lens([4, -1]), "row lengths [4, -1] must be >= 0"),
        (lambda: xs.try_set_len(-1), "set_len length -1 must be >= 0"),
        (lambda: impl.stack([]), "stack needs at least one xs slot"),
        (lambda: impl.stack([impl.new(4, window=32), impl.new(8, window=32)]),
         "xs slots in one layer must share ratio, span, window and margin"),
    ]
    for call, message in cases:
        with pytest.raises(ValueError) as e:
            call()
        assert str(e.value) == message
    assert xs_state(xs)[0] == [4, 4]


# --- batch assembly --------------------------------------------------------------------------

@pytest.mark.rule("XsRolling", "stacking slots into one batch, port")
@over_xs
def test_split_and_stack_round_trip_with_per_row_tokens_and_base(impl):
    rng = np.random.default_rng(3)
    hs = [rng.standard_normal((n, D)) for n in (13, 61, 0)]
    rows = []
    for h in hs:
        xs = impl.new(4)
        if len(h):
            xs.append_rows(impl.x(h[None]))
        rows.append(xs)
    batched = impl.stack(rows)
    assert xs_state(batched)[:2] == ([13, 61, 0], [0, 40, 0])
    assert tuple(batched.comp.shape) == (3, 15, D)  # padded at the end to the widest
    assert not host(batched.comp)[0, 3:].any() and not host(batched.comp)[2].any()
    for i, h in enumerate(hs):
        assert_row_matches(batched, i, h)
    for row, h in zip(impl.split(batched), hs, strict=True):
        assert row.batch == 1
        assert_row_matches(row, 0, h)


@pytest.mark.rule("XsRolling", "stacking slots into one batch, port")
@over_xs
def test_stack_with_the_flag_off_reconciles_the_bases(impl):
    a, b = xs_filled(impl, 4, 61), xs_filled(impl, 4, 61)
    b.base = [28]
    out = impl.stack([a, b], reconcile_bases=True)
    assert xs_state(out)[1] == [40, 40]
    assert_row_matches(out, 1, np.arange(61 * D, dtype=np.float64).reshape(61, D))
    with pytest.raises(ValueError, match=r"^reconciling xs bases needs uniform tokens, got "
                                         r"\[13, 15\]$"):
        impl.stack([xs_filled(impl, 4, 13), xs_filled(impl, 4, 15)], reconcile_bases=True)
    none = impl.stack([impl.new(4, window=32), impl.new(4, window=32)], reconcile_bases=True)
    assert xs_state(none)[:2] == ([0, 0], [0, 0]) and none.comp is None


@pytest.mark.rule("XsRolling", "stacking slots into one batch, port")
@over_xs
def test_stack_refuses_rows_of_different_hidden_widths(impl):
    a, b = impl.new(4, window=32), impl.new(4, window=32)
    a.append_rows(impl.x(np.zeros((1, 4, 2))))
    b.append_rows(impl.x(np.zeros((1, 4, 3))))
    with pytest.raises(ValueError,
                       match=r"^xs slots with hidden widths \[2, 3\] cannot be stacked$"):
        impl.stack([a, b])


# --- §17.2 mtp_verify_rollback_restores_the_compressor_rows_exactly ----------------------------

SHAPES = [(1, 1), (2, 1), (2, 2), (3, 2), (4, 1), (5, 5), (6, 3), (8, 2), (9, 9)]  # (w, commit)
SPEC_PREFILLS = [(4, [13, 15, 16, 20, 61]), (128, [130, 250, 255, 256, 383])]


@pytest.mark.rule("compressor", "mtp_verify_rollback_restores_the_compressor_rows_exactly, port")
@over_xs
@pytest.mark.parametrize("ratio,prefills", SPEC_PREFILLS)
def test_mtp_verify_rollback_restores_the_compressor_rows_exactly(impl, ratio, prefills):
    """The spec's numbers: prefill committed - 1, then 1, then a verify window of w (commit
    of them true, the rest junk), every slot (two K/V, the xs) `set_len` back by
    `w - commit` (truncate_cache_by), then onward decode: the compressed rows equal the
    from-scratch compression of the committed rows; some speculative block was compressed
    and had to be rewritten."""
    rng = np.random.default_rng(ratio)
    crossed = 0
    for committed in prefills:
        for w, commit in SHAPES:
            truth = rng.standard_normal((committed + commit + 9, D))
            kv = [impl.kv(4096), impl.kv(4096)]
            xs = impl.new(ratio)

            def feed(rows, xs=xs, kv=kv):
                xs.append_rows(impl.x(rows[None]))
                for _, append in kv:
                    append(rows[None, None])

            feed(truth[: committed - 1])
            feed(truth[committed - 1: committed])
            feed(np.concatenate([truth[committed: committed + commit],
                                 rng.standard_normal((w - commit, D)) + 50]))
            before = xs.current_seq_len // ratio
            crossed += before > (committed + commit) // ratio
            for slot in [s for s, _ in kv] + [xs]:  # truncate_cache_by(w - commit)
                slot.set_len(max(slot.current_seq_len - (w - commit), 0))
            assert [s.current_seq_len for s, _ in kv] + [xs.current_seq_len] == [
                committed + commit] * 3
            assert_row_matches(xs, 0, truth[: committed + commit])
            feed(truth[committed + commit:])  # onward decode over the rolled-back rows
            assert_row_matches(xs, 0, truth)
            assert before <= xs.current_seq_len // ratio
    assert crossed > 0


@pytest.mark.rule("compressor", "mtp_verify_rollback_restores_the_compressor_rows_exactly, port")
@over_xs
@pytest.mark.parametrize("ratio,prefills", SPEC_PREFILLS)
def test_a_ragged_xs_batch_rolls_each_row_back_to_its_own_commit(impl, ratio, prefills):
    """The five prefills as one ragged batch: a verify window of w for every row, a per-row
    commit (`set_row_lens`), onward decode; each row equals its from-scratch compression."""
    rng = np.random.default_rng(7 + ratio)
    for w, _ in SHAPES:
        truths = [rng.standard_normal((p + 2 * w, D)) for p in prefills]
        rows = []
        for p, h in zip(prefills, truths, strict=True):
            solo = impl.new(ratio)
            solo.append_rows(impl.x(h[None, :p]))
            rows.append(solo)
        xs = impl.stack(rows)
        commits = [1 + (i * 3 + w) % w for i in range(len(prefills))]
        block = np.stack([np.concatenate([h[p: p + c], rng.standard_normal((w - c, D)) - 40])
                          for p, h, c in zip(prefills, truths, commits, strict=True)])
        xs.append_rows(impl.x(block))
        xs.set_row_lens([p + c for p, c in zip(prefills, commits, strict=True)])
        assert xs.current_seq_len == max(p + c for p, c in zip(prefills, commits, strict=True))
        for i, (p, c, h) in enumerate(zip(prefills, commits, truths, strict=True)):
            assert_row_matches(xs, i, h[: p + c])
        xs.append_rows(impl.x(np.stack([h[p + c: p + c + w] for p, c, h
                                        in zip(prefills, commits, truths, strict=True)])))
        for i, (p, c, h) in enumerate(zip(prefills, commits, truths, strict=True)):
            assert_row_matches(xs, i, h[: p + c + w])


@st.composite
def ragged_feeds(draw):
    """`(ratio, prefills split in two parts, rounds of (t_new, per-row drops within the
    margin), seed)`: the drops never reach behind any row's newest-minus-margin."""
    ratio = draw(st.sampled_from(RATIOS))
    b = draw(st.integers(1, 4))
    prefills = draw(st.lists(st.integers(0, 300), min_size=b, max_size=b))
    cuts = [draw(st.integers(0, p)) for p in prefills]
    rounds = draw(st.lists(st.tuples(st.integers(0, 12), st.lists(
        st.integers(0, XS_TAIL_MARGIN_TOKENS), min_size=b, max_size=b)), min_size=1, max_size=6))
    return ratio, prefills, cuts, rounds, draw(st.integers(0, 2**32 - 1))


@pytest.mark.rule("XsRolling", "XsRolling append and compressor, port")
@over_xs
@given(case=ragged_feeds())
def test_random_ragged_feeds_and_rollbacks_match_a_from_scratch_compression(impl, case):
    ratio, prefills, cuts, rounds, seed = case
    rng = np.random.default_rng(seed)
    history = [rng.standard_normal((p, 2)) for p in prefills]
    rows = []
    for h, cut in zip(history, cuts, strict=True):
        solo = impl.new(ratio)
        for part in (h[:cut], h[cut:]):
            solo.append_rows(impl.x(part[None]))
        rows.append(solo)
    xs = impl.stack(rows)
    floor = [p - XS_TAIL_MARGIN_TOKENS for p in prefills]
    for t_new, drops in rounds:
        x = rng.standard_normal((len(prefills), t_new, 2))
        xs.append_rows(impl.x(x))
        fed_rows = [np.concatenate([h, x[i]]) for i, h in enumerate(history)]
        floor = [max(fl, len(f) - XS_TAIL_MARGIN_TOKENS) for fl, f in zip(floor, fed_rows,
                                                                         strict=True)]
        drops = [min(d, len(f) - max(fl, 0)) for d, f, fl in zip(drops, fed_rows, floor,
                                                                 strict=True)]
        xs.set_row_lens([len(f) - d for f, d in zip(fed_rows, drops, strict=True)])
        history = [f[: len(f) - d] for f, d in zip(fed_rows, drops, strict=True)]
        assert xs.current_seq_len // ratio == max(len(h) for h in history) // ratio
        tokens, base = xs_state(xs)[:2]
        for i, h in enumerate(history):
            assert_row_matches(xs, i, h)
            assert base[i] <= tokens[i] <= base[i] + xs.window


@pytest.mark.rule("XsRolling append and compressor, port")
@pytest.mark.parametrize("change", ["none", "rollback", "other count"])
def test_a_port_append_uses_staged_indices_only_for_the_lengths_they_were_computed_for(change):
    """`append_indices` / `stage` (the verify forward's one transfer) leave the append as it
    is: staged for this append, the slot ends as one that uploads its own; staged before a
    rollback, or for another token count, the append computes its own and ends the same."""
    import torch

    from raggedspec.gpu.xs_rolling import XsRolling

    rng = np.random.default_rng(5)
    first, nxt = rng.standard_normal((2, 7, 3)), rng.standard_normal((2, 3, 3))

    def slot(stage: bool):
        xs = XsRolling(2, 1, None, 64, 2, 3, 2)
        xs.append_rows(torch.from_numpy(first))
        if stage:
            idx = xs.append_indices(2 if change == "other count" else 3)
            xs.stage(2 if change == "other count" else 3,
                     [None if v is None else torch.from_numpy(v) for v in idx])
        if change == "rollback":
            xs.set_row_lens([5, 6])
        xs.append_rows(torch.from_numpy(nxt))
        return xs_state(xs)

    staged, plain = slot(True), slot(False)
    assert staged[:2] == plain[:2]
    for got, want in zip(staged[2] + staged[3], plain[2] + plain[3], strict=True):
        assert np.array_equal(got, want)
