"""The masker's rules (masks-and-scheduling.md §7-§10): the SDPA window, the graph-decode
length mask, `PastKvLenCache`, the left-padded causal mask, the causal and sliding-window
entry points with their ragged branches, and the bias / flash-placeholder predicates. Only the
reference states them: no path of the port builds these masks (its attention is dsv4's union
mask, test_masks.py), and the integer predicates are the reference's own functions there.

Expected values come from the spec's examples or from triple-loop oracles written here, never
from the code under test. Masks are exact (0 / -inf), so every comparison is bit-exact.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from raggedspec.conformance.helpers import assert_refused, keep_bits
from raggedspec.conformance.strategies import lead_pads
from raggedspec.reference.cache import KvCache, NormalCache
from raggedspec.reference.errors import MaskRefusal
from raggedspec.reference.masks import (
    RaggedKvLens,
    check_flash_placeholder_mask,
    graph_mode_length_mask,
    make_causal_mask_matrix,
    make_left_padded_causal_mask,
    make_sliding_window_causal_mask_matrix,
    mask_must_be_applied_as_bias,
    past_kv_len,
    require_graph_length_mask,
    sdpa_sliding_window,
)


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



@pytest.mark.rule("ragged sliding-window masker policy", "sdpa_sliding_window",
                  "graph_mode_length_mask", "make_left_padded_causal_mask",
                  "make_causal_mask_matrix")
def test_malformed_sizes_are_refused_with_the_stated_messages():
    cases = [
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
        assert_refused(ValueError, call, message)


@pytest.mark.rule("ragged sliding-window masker policy")
def test_zero_sizes_are_not_malformed():
    assert sdpa_sliding_window(0, 0) == 0
    assert graph_mode_length_mask([0], 0).shape == (1, 1, 1, 0)
    assert make_left_padded_causal_mask(0, 0, 0, []).shape == (0, 1, 0, 0)
    assert make_causal_mask_matrix(0, 0, 0, None, None).shape == (0, 0)
    assert make_sliding_window_causal_mask_matrix(0, 0, 0, None, None, 1).shape == (0, 0)
