"""Mask rules (masks-and-scheduling.md §3, §5-§10). Expected values come from the spec's
worked examples or from brute-force loops written here, never from the code under test.
Masks are exact (0 / -inf), so every comparison is bit-exact."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from raggedspec.conformance.strategies import lead_pads, leads_of, ragged_lengths
from raggedspec.reference.cache import KvCache, NormalCache
from raggedspec.reference.errors import MaskRefusal
from raggedspec.reference.masks import (
    RaggedKvLens,
    check_flash_placeholder_mask,
    compose_caller_mask,
    compressed_validity,
    graph_mode_length_mask,
    make_causal_mask_matrix,
    make_left_padded_causal_mask,
    make_sliding_window_causal_mask_matrix,
    mask_must_be_applied_as_bias,
    past_kv_len,
    ragged_union_mask,
    raw_keep_span,
    raw_validity,
    require_graph_length_mask,
    sdpa_sliding_window,
)

NEG = -np.inf


def keep_bits(mask: np.ndarray) -> np.ndarray:
    """Additive mask -> 1 (keep) / 0 (kill), asserting it holds only 0 and -inf."""
    assert np.all((mask == 0.0) | (mask == NEG)), "an additive mask holds only 0 and -inf"
    return (mask == 0.0).astype(int)


# ----------------------------------------------------------------------------- §3


@pytest.mark.rule("raw_keep_span")
def test_raw_keep_span_pinned_values():
    assert raw_keep_span(1, 128, 2048) == (1920, 128)
    assert raw_keep_span(2048, 128, 2048) == (0, 2048)
    assert raw_keep_span(1, 8, 64) == (56, 8)
    assert raw_keep_span(1, 4, 7) == (3, 4)  # the smallest well-formed forward: keep = window


@pytest.mark.rule("raw_keep_span")
def test_raw_keep_span_equals_the_brute_force_reachable_set():
    narrowed = 0
    for window in (1, 2, 4, 8, 128):
        for t_k_full in (1, 3, 8, 129, 256, 2048):
            for t_q in (1, 2, 7, 64):
                q0 = t_k_full - t_q
                reachable = set()
                for r in range(t_q):
                    qp = q0 + r
                    lo = max(0, qp - window + 1)
                    reachable.update(range(lo, min(qp, t_k_full - 1) + 1))
                base, keep = raw_keep_span(t_q, window, t_k_full)
                assert base + keep == t_k_full
                assert reachable == set(range(base, t_k_full)), (window, t_k_full, t_q)
                narrowed += base > 0
    assert narrowed > 0  # non-degeneracy: at least one case drops keys


@pytest.mark.rule("raw_keep_span")
def test_raw_keep_span_rejects_malformed_input():
    with pytest.raises(ValueError, match="window 0"):
        raw_keep_span(1, 0, 8)
    with pytest.raises(ValueError, match="t_q -1"):
        raw_keep_span(-1, 4, 8)


# ----------------------------------------------------------------------------- §4 steps 5-6


@pytest.mark.rule("dsv4 raw validity", "dsv4 compressed validity")
@given(t_q=st.integers(1, 9), extra=st.integers(0, 40), window=st.integers(1, 20),
       t_c=st.integers(0, 12), ratio=st.sampled_from([1, 2, 4, 8]))
def test_raw_and_compressed_validity_match_the_position_rules(t_q, extra, window, t_c, ratio):
    t_k_full = t_q + extra
    q0 = t_k_full - t_q
    base, keep = raw_keep_span(t_q, window, t_k_full)
    raw = raw_validity(t_q, q0, base, keep, window)
    comp = compressed_validity(t_q, q0, t_c, ratio)
    assert raw.shape == (t_q, keep) and comp.shape == (t_q, t_c)
    for r in range(t_q):
        qp = q0 + r
        for c in range(keep):
            kp = base + c
            assert raw[r, c] == (kp <= qp and kp > qp - window)
        assert raw[r, qp - base]  # the diagonal is always valid
        for b in range(t_c):
            # complete at or before the query: the block's last token (b+1)*ratio-1 <= qp
            assert comp[r, b] == ((b + 1) * ratio - 1 <= qp)


# ----------------------------------------------------------------------------- §5


@pytest.mark.rule("dsv4 compressed validity", "ragged_union_mask")
def test_csa_worked_example_rows_6_4_2():
    rows, t_q, t_k_full, q0, window, ratio, t_c = [6, 4, 2], 1, 7, 6, 4, 4, 1
    base, keep = raw_keep_span(t_q, window, t_k_full)
    assert (base, keep) == (3, 4)
    assert leads_of(rows) == [0, 2, 4]
    valid = np.concatenate([raw_validity(t_q, q0, base, keep, window),
                            compressed_validity(t_q, q0, t_c, ratio)], axis=1)
    assert valid.tolist() == [[True, True, True, True, True]]  # shared raw keeps 3..6
    mask = ragged_union_mask(rows, q0, valid, base, keep, ratio, t_c)
    assert mask.shape == (3, 1, 1, 5)
    expected = [[1, 1, 1, 1, 1],
                [1, 1, 1, 1, 1],
                [0, 1, 1, 1, 0]]
    assert keep_bits(mask[:, 0, 0, :]).tolist() == expected
    # negative control: the batch-wide threshold floor(7/4) = 1 would keep comp 0 for row 2
    assert compressed_validity(1, q0, 1, ratio)[0, 0]
    assert [(r + 1) // ratio for r in rows] == [1, 1, 0]


@pytest.mark.rule("ragged_union_mask")
@given(lengths=ragged_lengths(1, 6, 1, 40), t_q=st.integers(1, 9), window=st.integers(1, 48),
       ratio=st.sampled_from([1, 2, 4, 8, 16]), extra_c=st.integers(0, 3))
def test_ragged_union_mask_equals_the_per_row_position_oracle(lengths, t_q, window, ratio,
                                                              extra_c):
    rows = list(lengths)
    q0 = max(rows)
    t_k_full = q0 + t_q
    t_c = t_k_full // ratio + extra_c
    base, keep = raw_keep_span(t_q, window, t_k_full)
    valid = np.concatenate([raw_validity(t_q, q0, base, keep, window),
                            compressed_validity(t_q, q0, t_c, ratio)], axis=1)
    got = keep_bits(ragged_union_mask(rows, q0, valid, base, keep, ratio, t_c))
    for i, row in enumerate(rows):
        lead = q0 - row
        for r in range(t_q):
            qp_own = row + r  # the row's own position of query r
            for c in range(keep):
                kp = base + c
                own = kp - lead  # the key's position in the row's own sequence
                want = own >= 0 and own <= qp_own and own > qp_own - window
                assert got[i, 0, r, c] == want, (i, r, c)
            for b in range(t_c):
                assert got[i, 0, r, keep + b] == ((b + 1) * ratio <= qp_own + 1), (i, r, b)
            assert got[i, 0, r, :keep].any()  # no row is fully masked


@pytest.mark.rule("ragged_union_mask")
def test_ragged_union_mask_rejects_rows_that_skipped_the_resolver():
    valid = np.ones((1, 4), dtype=bool)
    with pytest.raises(ValueError, match="max == q0"):
        ragged_union_mask([5, 4], 6, valid, 3, 4, 4, 0)
    with pytest.raises(ValueError, match="t_k \\+ t_c"):
        ragged_union_mask([6, 4], 6, valid, 3, 3, 4, 0)


# ----------------------------------------------------------------------------- §6


def _local(t_q, n):
    return np.zeros((1, 1, t_q, n))


@pytest.mark.rule("compose_caller_mask")
def test_compose_caller_mask_ignores_the_flash_placeholder():
    local = np.where(np.eye(2, 5, dtype=bool), 0.0, NEG)[None, None]
    for placeholder in (np.zeros((1, 1)), np.full((1, 1, 1, 1), NEG)):
        out = compose_caller_mask(local, placeholder, 2, 9, 4, 4, 1)
        assert np.array_equal(out, local)
    assert compose_caller_mask(local, None, 2, 9, 4, 4, 1) is local


@pytest.mark.rule("compose_caller_mask")
def test_compose_caller_mask_slices_raw_columns_and_pads_compressed_with_zero():
    t_q, t_k_full, raw_base, t_k, t_c = 2, 9, 4, 5, 2
    caller = np.zeros((t_q, t_k_full))
    caller[0, 3] = NEG  # before raw_base: sliced away
    caller[1, 6] = NEG  # raw column 6 -> union column 2
    out = compose_caller_mask(_local(t_q, t_k + t_c), caller, t_q, t_k_full, raw_base, t_k, t_c)
    assert out.shape == (1, 1, t_q, t_k + t_c)
    want = np.ones((t_q, t_k + t_c), dtype=int)
    want[1, 2] = 0
    assert keep_bits(out[0, 0]).tolist() == want.tolist()  # compressed columns padded with 0


@pytest.mark.rule("compose_caller_mask")
def test_compose_caller_mask_keeps_the_callers_compressed_columns_and_minus_inf_wins():
    t_q, t_k_full, raw_base, t_k, t_c = 1, 6, 2, 4, 2
    caller = np.zeros((2, 1, t_q, t_k_full + t_c))
    caller[1, 0, 0, t_k_full + 1] = NEG  # row 1 kills compressed column 1
    local = np.zeros((2, 1, t_q, t_k + t_c))
    local[0, 0, 0, 0] = NEG
    out = compose_caller_mask(local, caller, t_q, t_k_full, raw_base, t_k, t_c)
    assert keep_bits(out[:, 0, 0]).tolist() == [[0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 0]]


@pytest.mark.rule("compose_caller_mask")
def test_compose_caller_mask_refusals():
    local = _local(2, 6)
    with pytest.raises(MaskRefusal, match="must be rank 2.*or rank 4.*rank 3"):
        compose_caller_mask(local, np.zeros((1, 2, 8)), 2, 8, 4, 4, 2)
    with pytest.raises(MaskRefusal, match="query axis 3"):
        compose_caller_mask(local, np.zeros((3, 8)), 2, 8, 4, 4, 2)
    with pytest.raises(MaskRefusal, match="attention_mask key axis 7"):
        compose_caller_mask(local, np.zeros((2, 7)), 2, 8, 4, 4, 2)
    # a query axis of 1 broadcasts
    out = compose_caller_mask(local, np.zeros((1, 10)), 2, 8, 4, 4, 2)
    assert out.shape == (1, 1, 2, 6)


# ----------------------------------------------------------------------------- §7, §8


@pytest.mark.rule("sdpa_sliding_window")
def test_sdpa_sliding_window_only_for_standard_layers():
    assert sdpa_sliding_window(0, 128) == 128
    assert sdpa_sliding_window(1, 128) == 128
    assert sdpa_sliding_window(4, 128) is None
    assert sdpa_sliding_window(128, 128) is None


@pytest.mark.rule("graph_mode_length_mask")
def test_graph_mode_length_mask_example():
    mask = graph_mode_length_mask([2, 5], 8)
    assert mask.shape == (2, 1, 1, 8)
    assert keep_bits(mask[:, 0, 0]).tolist() == [[1, 1, 1, 0, 0, 0, 0, 0],
                                                 [1, 1, 1, 1, 1, 1, 0, 0]]


@pytest.mark.rule("graph_mode_length_mask")
def test_graph_decode_refuses_an_unset_length_mask():
    with pytest.raises(MaskRefusal, match="graph-decode arm.*unset"):
        require_graph_length_mask(None)
    mask = graph_mode_length_mask([0], 4)
    assert require_graph_length_mask(mask) is mask


# ----------------------------------------------------------------------------- §9.1


@pytest.mark.rule("PastKvLenCache")
def test_past_kv_len_per_implementor():
    assert past_kv_len(RaggedKvLens(9, [9, 4, 6])) == (9, [9, 4, 6])
    slots = [KvCache.new_normal(64), KvCache.new_normal(64)]
    slots[0].append(np.zeros((1, 1, 5, 2)), np.zeros((1, 1, 5, 2)))
    slots[1].append(np.zeros((1, 1, 3, 2)), np.zeros((1, 1, 3, 2)))
    assert past_kv_len(slots) == (5, None)  # slot 0's current_seq_len
    assert past_kv_len(NormalCache(slots)) == (5, None)
    assert past_kv_len([7, 7, 7]) == (7, None)
    assert past_kv_len([7, 4, 7]) == (0, None)  # non-uniform offsets: past 0, not max/first
    assert past_kv_len(None) == (0, None)  # NotACache


# ----------------------------------------------------------------------------- §9.2


def left_padded_host(b, t_q, past, live):
    """`make_left_padded_causal_mask_host`: the triple-loop test oracle (1 = keep)."""
    out = np.zeros((b, 1, t_q, past + t_q), dtype=int)
    for row in range(b):
        lead = past - live[row]
        for i in range(t_q):
            for j in range(past + t_q):
                out[row, 0, i, j] = int(lead <= j <= past + i)
    return out


@pytest.mark.rule("make_left_padded_causal_mask")
def test_make_left_padded_causal_mask_example():
    mask = make_left_padded_causal_mask(2, 2, 6, [6, 2])
    assert mask.shape == (2, 1, 2, 8)
    assert keep_bits(mask[:, 0]).tolist() == [
        [[1, 1, 1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1, 1, 1]],
        [[0, 0, 0, 0, 1, 1, 1, 0], [0, 0, 0, 0, 1, 1, 1, 1]],
    ]


@pytest.mark.rule("make_left_padded_causal_mask")
def test_make_left_padded_causal_mask_refusals():
    with pytest.raises(MaskRefusal, match="2 live lengths for a batch of 3"):
        make_left_padded_causal_mask(3, 1, 6, [6, 2])
    with pytest.raises(MaskRefusal, match="live length 7 exceeds the padded width 6"):
        make_left_padded_causal_mask(2, 1, 6, [6, 7])


@pytest.mark.rule("make_left_padded_causal_mask")
@given(live_lead=lead_pads(1, 5, 12), t_q=st.integers(1, 6), extra=st.integers(0, 6))
def test_make_left_padded_causal_mask_equals_the_host_triple_loop(live_lead, t_q, extra):
    past = max(live_lead) + extra
    live = [past - lead for lead in live_lead]
    got = keep_bits(make_left_padded_causal_mask(len(live), t_q, past, live))
    assert np.array_equal(got, left_padded_host(len(live), t_q, past, live))


@pytest.mark.rule("make_left_padded_causal_mask")
def test_fully_live_rows_reproduce_the_ordinary_causal_mask():
    padded = make_left_padded_causal_mask(3, 4, 5, [5, 5, 5])
    causal = make_causal_mask_matrix(3, 4, 5, None, None)
    assert causal.shape == (4, 9)
    assert np.array_equal(padded, np.broadcast_to(causal, padded.shape))


# ----------------------------------------------------------------------------- §9.3


@pytest.mark.rule("make_causal_mask_matrix")
def test_make_causal_mask_matrix_channel_example():
    mask = make_causal_mask_matrix(2, 1, 5, None, [0, 4])
    assert mask.shape == (2, 1, 1, 6)
    assert keep_bits(mask[:, 0, 0]).tolist() == [[1, 1, 1, 1, 1, 1], [0, 0, 0, 0, 1, 1]]


@pytest.mark.rule("make_causal_mask_matrix")
def test_an_all_zero_lead_keeps_the_uniform_fast_path():
    assert make_causal_mask_matrix(2, 1, 5, None, [0, 0]) is None
    plain = make_causal_mask_matrix(2, 3, 5, None, None)
    assert np.array_equal(make_causal_mask_matrix(2, 3, 5, None, [0, 0]), plain)
    assert plain.ndim == 2  # not the [B,1,..] ragged shape


@pytest.mark.rule("make_causal_mask_matrix")
def test_per_seq_kv_lens_come_first_even_at_decode():
    mask = make_causal_mask_matrix(2, 1, 6, [6, 2], [0, 5])  # cache beats the channel
    assert keep_bits(mask[:, 0, 0]).tolist() == [[1] * 7, [0, 0, 0, 0, 1, 1, 1]]
    with pytest.raises(MaskRefusal, match="exceeds the padded width"):
        make_causal_mask_matrix(2, 1, 6, [6, 9], None)


@pytest.mark.rule("make_causal_mask_matrix")
def test_the_channel_is_skipped_when_it_does_not_fit():
    # lead longer than past (underflow) and a lead vector of the wrong length are skipped
    assert make_causal_mask_matrix(2, 1, 5, None, [0, 7]) is None
    assert make_causal_mask_matrix(2, 1, 5, None, [4]) is None
    assert make_causal_mask_matrix(2, 2, 5, None, [0, 7]).shape == (2, 7)


@pytest.mark.rule("make_causal_mask_matrix")
def test_flash_on_cuda_gets_the_placeholder_and_prefill_gets_rank_2_causal():
    ph = make_causal_mask_matrix(2, 3, 4, None, None, flash_on_cuda=True)
    assert ph.shape == (1, 1) and ph[0, 0] == 0.0
    # the ragged branch still wins under flash
    assert make_causal_mask_matrix(2, 3, 4, None, [0, 2], flash_on_cuda=True).shape == (2, 1, 3, 7)
    causal = keep_bits(make_causal_mask_matrix(1, 3, 2, None, None))
    assert causal.tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]


# ----------------------------------------------------------------------------- §9.4


def sliding_ragged_oracle(t_q, past, live, window):
    out = np.zeros((len(live), 1, t_q, past + t_q), dtype=int)
    for row, n in enumerate(live):
        lead = past - n
        for i in range(t_q):
            last = past + i
            for j in range(past + t_q):
                out[row, 0, i, j] = int(lead <= j and last - window < j <= last)
    return out


@pytest.mark.rule("ragged sliding-window masker policy")
def test_sliding_window_policy_none_has_no_ragged_branch():
    assert make_sliding_window_causal_mask_matrix(2, 1, 5, None, [0, 4], 3) is None
    mask = make_sliding_window_causal_mask_matrix(2, 2, 5, [5, 1], [0, 4], 3)
    assert mask.ndim == 2  # per-seq lens and channel ignored
    assert keep_bits(mask).tolist() == [[0, 0, 0, 1, 1, 1, 0], [0, 0, 0, 0, 1, 1, 1]]


@pytest.mark.rule("ragged sliding-window masker policy")
@given(leads=lead_pads(1, 4, 8), t_q=st.integers(1, 5), extra=st.integers(0, 5),
       window=st.integers(1, 12))
def test_sliding_window_policy_channel_applies_the_window_on_top_of_the_dead_prefix(
        leads, t_q, extra, window):
    past = max(leads) + extra
    live = [past - lead for lead in leads]
    got = make_sliding_window_causal_mask_matrix(len(leads), t_q, past, None, leads, window,
                                                 sliding_window_ragged="channel")
    if any(lead > 0 for lead in leads):
        assert np.array_equal(keep_bits(got), sliding_ragged_oracle(t_q, past, live, window))
        # the channel is wired into both entry points
        assert make_causal_mask_matrix(len(leads), t_q, past, None, leads).shape == got.shape
    else:
        assert got is None if t_q == 1 else got.ndim == 2


@pytest.mark.rule("ragged sliding-window masker policy")
def test_sliding_window_policy_is_validated():
    with pytest.raises(ValueError, match="sliding_window_ragged"):
        make_sliding_window_causal_mask_matrix(1, 2, 3, None, None, 4, sliding_window_ragged="x")


# ----------------------------------------------------------------------------- §10


@pytest.mark.rule("mask_must_be_applied_as_bias")
def test_mask_must_be_applied_as_bias_is_rank_at_least_3():
    assert mask_must_be_applied_as_bias(None) is False
    assert mask_must_be_applied_as_bias([4, 9]) is False  # rank 2 stays on flash
    assert mask_must_be_applied_as_bias([1, 4, 9]) is True  # rank 3 too, not only rank 4
    assert mask_must_be_applied_as_bias([2, 1, 1, 9]) is True
    assert mask_must_be_applied_as_bias([1, 1, 4, 9]) is True  # not the old dims[0] > 1 form


@pytest.mark.rule("flash placeholder on a fallback")
def test_a_placeholder_on_a_non_flash_fallback_is_refused():
    with pytest.raises(MaskRefusal, match=r"\[1, 1\].*seq_len 5.*non-causal"):
        check_flash_placeholder_mask([1, 1], 5, flash_build=True, runs_flash=False)
    assert check_flash_placeholder_mask([1, 1], 1, True, False) is None  # decode: fine
    assert check_flash_placeholder_mask([1, 1], 5, True, True) is None  # flash is causal
    assert check_flash_placeholder_mask([1, 1], 5, False, False) is None
    assert check_flash_placeholder_mask([5, 7], 5, True, False) is None


# ----------------------------------------------------------------------------- malformed input


@pytest.mark.rule("ragged sliding-window masker policy")
def test_malformed_sizes_are_refused_with_the_stated_messages():
    cases = [
        (lambda: raw_keep_span(-1, 4, 9), "t_q -1 and t_k_full 9 must be >= 0"),
        (lambda: raw_keep_span(2, 4, -1), "t_q 2 and t_k_full -1 must be >= 0"),
        (lambda: raw_keep_span(0, 4, 9),
         "t_q 0 must be >= 1: a forward with no query row reaches no key"),
        (lambda: raw_keep_span(2, 0, 9),
         "window 0 must be >= 1 (dsv4 passes max(sliding_window, 1))"),
        (lambda: raw_validity(-1, 0, 0, 3, 2), "t_q -1, q0 0, raw_base 0, keep 3 must be >= 0"),
        (lambda: raw_validity(1, -1, 0, 3, 2), "t_q 1, q0 -1, raw_base 0, keep 3 must be >= 0"),
        (lambda: raw_validity(1, 0, -1, 3, 2), "t_q 1, q0 0, raw_base -1, keep 3 must be >= 0"),
        (lambda: raw_validity(1, 0, 0, -1, 2), "t_q 1, q0 0, raw_base 0, keep -1 must be >= 0"),
        (lambda: raw_validity(1, 0, 0, 3, 0), "window 0 must be >= 1"),
        (lambda: compressed_validity(-1, 0, 2, 4), "t_q -1, q0 0, t_c 2 must be >= 0"),
        (lambda: compressed_validity(1, -1, 2, 4), "t_q 1, q0 -1, t_c 2 must be >= 0"),
        (lambda: compressed_validity(1, 0, -1, 4), "t_q 1, q0 0, t_c -1 must be >= 0"),
        (lambda: compressed_validity(1, 0, 2, 0),
         "compress ratio 0 must be >= 1 when there are 2 compressed keys"),
        (lambda: sdpa_sliding_window(-1, 8), "ratio -1 and window 8 must be >= 0"),
        (lambda: sdpa_sliding_window(0, -1), "ratio 0 and window -1 must be >= 0"),
        (lambda: graph_mode_length_mask([1], -1), "cap -1 and positions [1] must be >= 0"),
        (lambda: graph_mode_length_mask([1, -2], 4), "cap 4 and positions [1, -2] must be >= 0"),
        (lambda: make_left_padded_causal_mask(-1, 1, 4, []), "b -1, t_q 1, past 4 must be >= 0"),
        (lambda: make_left_padded_causal_mask(1, -1, 4, [4]), "b 1, t_q -1, past 4 must be >= 0"),
        (lambda: make_left_padded_causal_mask(1, 1, -1, [0]), "b 1, t_q 1, past -1 must be >= 0"),
        (lambda: make_left_padded_causal_mask(2, 1, 4, [4, -1]),
         "live lengths [4, -1] must be >= 0"),
        (lambda: make_causal_mask_matrix(-1, 2, 4, None, None), "b -1, t_q 2, past 4 must be >= 0"),
        (lambda: make_causal_mask_matrix(1, -1, 4, None, None), "b 1, t_q -1, past 4 must be >= 0"),
        (lambda: make_causal_mask_matrix(1, 2, -1, None, None), "b 1, t_q 2, past -1 must be >= 0"),
        (lambda: make_sliding_window_causal_mask_matrix(1, 2, 4, None, None, 0),
         "window 0 must be >= 1"),
        (lambda: make_sliding_window_causal_mask_matrix(-1, 2, 4, None, None, 3),
         "b -1, t_q 2, past 4 must be >= 0"),
        (lambda: make_sliding_window_causal_mask_matrix(1, -1, 4, None, None, 3),
         "b 1, t_q -1, past 4 must be >= 0"),
        (lambda: make_sliding_window_causal_mask_matrix(1, 2, -1, None, None, 3),
         "b 1, t_q 2, past -1 must be >= 0"),
        (lambda: make_sliding_window_causal_mask_matrix(1, 2, 4, None, None, 3, "x"),
         "sliding_window_ragged 'x' must be one of ('none', 'channel')"),
    ]
    for call, message in cases:
        with pytest.raises(ValueError) as e:
            call()
        assert str(e.value) == message


@pytest.mark.rule("ragged sliding-window masker policy")
def test_zero_sizes_are_not_malformed():
    assert raw_keep_span(1, 1, 0) == (0, 0)
    assert raw_validity(0, 0, 0, 0, 1).shape == (0, 0)
    assert compressed_validity(0, 0, 0, 0).shape == (0, 0)
    assert sdpa_sliding_window(0, 0) == 0
    assert graph_mode_length_mask([0], 0).shape == (1, 1, 1, 0)
    assert make_left_padded_causal_mask(0, 0, 0, []).shape == (0, 1, 0, 0)
    assert make_causal_mask_matrix(0, 0, 0, None, None).shape == (0, 0)
    assert make_sliding_window_causal_mask_matrix(0, 0, 0, None, None, 1).shape == (0, 0)


@pytest.mark.rule("ragged_union_mask")
def test_shape_check_messages_name_the_widths():
    local = _local(2, 6)
    with pytest.raises(MaskRefusal) as e:
        compose_caller_mask(local, np.zeros((2, 7)), 2, 8, 4, 4, 2)
    assert str(e.value) == "attention_mask key axis 7 is neither t_k_full 8 nor t_k_full + t_c 10"
    with pytest.raises(ValueError) as e:  # raw columns [6, 10) reach past a key axis of 8
        compose_caller_mask(local, np.zeros((2, 8)), 2, 8, 6, 4, 2)
    assert str(e.value) == "raw slice [6, 10) exceeds key axis 8"
    valid = np.ones((1, 4), dtype=bool)
    cases = [
        (lambda: ragged_union_mask([], 0, valid, 0, 4, 4, 0),
         "ragged_union_mask needs at least one row"),
        (lambda: ragged_union_mask([3], 3, valid, 0, 3, 4, 2),
         "valid shape (1, 4) must be [t_q, t_k + t_c = 5]"),
        (lambda: ragged_union_mask([3], 3, valid, -1, 4, 4, 0),
         "raw_base -1, t_k 4, t_c 0 must be >= 0"),
        (lambda: ragged_union_mask([3], 3, valid, 0, -1, 4, 5),
         "raw_base 0, t_k -1, t_c 5 must be >= 0"),
        (lambda: ragged_union_mask([3], 3, valid, 0, 5, 4, -1),
         "raw_base 0, t_k 5, t_c -1 must be >= 0"),
    ]
    for call, message in cases:
        with pytest.raises(ValueError) as e:
            call()
        assert str(e.value) == message


@pytest.mark.rule("ragged_union_mask")
def test_ragged_union_mask_edges_a_row_at_zero_no_raw_keys_and_numeric_validity():
    # a row at position 0 (lead q0) is a resolved row; its diagonal stays live
    mask = ragged_union_mask([0, 3], 3, np.ones((1, 4), dtype=bool), 0, 4, 4, 0)
    assert keep_bits(mask[:, 0, 0]).tolist() == [[0, 0, 0, 1], [1, 1, 1, 1]]
    # no raw keys: only the compressed half (block 0 complete for the row at 3: 4 <= 3 + 1)
    comp_only = ragged_union_mask([3], 3, np.ones((1, 1), dtype=bool), 0, 0, 4, 1)
    assert keep_bits(comp_only[:, 0, 0]).tolist() == [[1]]
    # validity given as 0/1 numbers reads as booleans
    valid = np.array([[1, 0, 1, 1]])
    want = ragged_union_mask([2, 3], 3, valid.astype(bool), 0, 4, 4, 0)
    for numeric in (valid, valid.astype(np.float64)):
        assert np.array_equal(ragged_union_mask([2, 3], 3, numeric, 0, 4, 4, 0), want)


@pytest.mark.rule("dsv4 compressed validity")
def test_validity_and_masks_keep_their_stated_dtypes():
    assert compressed_validity(2, 0, 0, 4).dtype == bool
    assert compressed_validity(2, 0, 3, 4).dtype == bool
    local = np.zeros((1, 1, 2, 6), dtype=np.float32)
    for width in (8, 10):  # the raw slice alone, and with the caller's compressed columns
        out = compose_caller_mask(local, np.zeros((2, width), dtype=np.float32), 2, 8, 4, 4, 2)
        assert out.dtype == np.float64


@pytest.mark.rule("ragged sliding-window masker policy")
def test_the_sliding_window_entry_point_under_flash_and_with_per_seq_lens():
    ph = make_sliding_window_causal_mask_matrix(2, 3, 4, None, None, 2, flash_on_cuda=True)
    assert ph.shape == (1, 1) and ph.dtype == np.float64 and ph[0, 0] == 0.0
    # "channel" reads the cache's own per-seq lens first, as §9.3 step 1
    mask = make_sliding_window_causal_mask_matrix(2, 1, 4, [4, 2], None, 3,
                                                  sliding_window_ragged="channel")
    assert mask.shape == (2, 1, 1, 5)
    assert keep_bits(mask[:, 0, 0]).tolist() == [[0, 0, 1, 1, 1], [0, 0, 1, 1, 1]]
    mask = make_sliding_window_causal_mask_matrix(2, 1, 4, [4, 1], None, 3,
                                                  sliding_window_ragged="channel")
    assert keep_bits(mask[:, 0, 0]).tolist() == [[0, 0, 1, 1, 1], [0, 0, 0, 1, 1]]


@pytest.mark.rule("PastKvLenCache")
def test_past_kv_len_of_empty_and_single_sources():
    assert past_kv_len(NormalCache([])) == (0, None)
    assert past_kv_len([]) == (0, None)
    assert past_kv_len([7]) == (7, None)
    slot = KvCache.new_normal(64)
    slot.append(np.zeros((1, 1, 3, 2)), np.zeros((1, 1, 3, 2)))
    assert past_kv_len([slot]) == (3, None)


@pytest.mark.rule("flash placeholder on a fallback")
def test_small_routing_predicates_at_their_boundaries():
    assert sdpa_sliding_window(2, 128) is None  # ratio 2 is compressed, only 0 and 1 are Standard
    with pytest.raises(MaskRefusal) as e:
        check_flash_placeholder_mask([1, 1], 2, flash_build=True, runs_flash=False)
    assert "seq_len 2" in str(e.value)
    with pytest.raises(MaskRefusal) as e:
        require_graph_length_mask(None)
    assert str(e.value) == "the graph-decode arm refuses to run: its length mask is unset (None)"
