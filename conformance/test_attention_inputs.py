"""Attention's input contract (masks-and-scheduling.md §4, §12): which malformed shape is
refused with which message, float64 arithmetic whatever the inputs' dtype, the zero-key and
large-logit edges of the softmax, the path counters, the Standard-layer boundary and the
paged arm's batch-size check.

Expected messages are stated from the inputs' shapes; expected values from the softmax
definition (`exp(l_j) / sum exp(l)`, the sink a denominator-only column).
"""

from __future__ import annotations

import math
import re

import numpy as np
import pytest

from raggedspec.reference.attention import (
    Dsv4AttentionConfig,
    attention,
    dsv4_attention,
    dsv4_mask_stats,
    is_standard_layer,
    reset_dsv4_mask_stats,
    v4_paged_dispatch_precheck,
)


def z(*shape):
    return np.zeros(shape)


def refused(fn, message, *args):
    with pytest.raises(ValueError, match="^" + re.escape(message) + "$"):
        fn(*args)


# --- malformed shapes: one condition broken per case -------------------------------------


@pytest.mark.rule("attention with sinks")
def test_attention_refuses_each_malformed_shape_with_its_own_message():
    q, kv = z(1, 1, 1, 1), z(1, 1, 2, 1)
    refused(attention, "q (1, 1, 1), k (1, 1, 2, 1), v (1, 1, 2, 1) must all be rank 4",
            z(1, 1, 1), kv, kv, None)
    refused(attention, "q (1, 1, 1, 1), k (1, 1, 2), v (1, 1, 2, 1) must all be rank 4",
            q, z(1, 1, 2), kv, None)
    refused(attention, "q (1, 1, 1, 1), k (1, 1, 2, 1), v (1, 1, 2) must all be rank 4",
            q, kv, z(1, 1, 2), None)
    # only the head dim differs
    refused(attention, "batch/head-dim mismatch: q (1, 1, 1, 2), k (1, 1, 2, 3)",
            z(1, 1, 1, 2), z(1, 1, 2, 3), z(1, 1, 2, 3), None)
    # only v's batch differs
    refused(attention, "batch/head-dim mismatch: q (2, 1, 1, 1), k (2, 1, 2, 1)",
            z(2, 1, 1, 1), z(2, 1, 2, 1), z(1, 1, 2, 1), None)
    # only k's batch differs
    refused(attention, "batch/head-dim mismatch: q (2, 1, 1, 1), k (1, 1, 2, 1)",
            z(2, 1, 1, 1), z(1, 1, 2, 1), z(2, 1, 2, 1), None)
    refused(attention, "k (1, 1, 3, 1) and v (1, 1, 2, 1) must share [B,Hk,t_k]",
            q, z(1, 1, 3, 1), kv, None)
    refused(attention, "KV heads 2 must divide query heads 3",
            z(1, 3, 1, 1), z(1, 2, 2, 1), z(1, 2, 2, 1), None)
    refused(attention, "sinks shape (2,) must be [1]", q, kv, kv, None, np.zeros(2))


@pytest.mark.rule("dsv4_attention refusals")
def test_dsv4_attention_refuses_each_malformed_input_with_its_own_message():
    cfg = Dsv4AttentionConfig(0, 4)
    q, kv = z(1, 1, 1, 1), z(1, 1, 2, 1)
    refused(dsv4_attention, "q (1, 1, 1), k (1, 1, 2, 1), v (1, 1, 2, 1) must all be rank 4",
            z(1, 1, 1), kv, kv, None, None, cfg)
    refused(dsv4_attention, "q (1, 1, 1, 1), k (1, 1, 2), v (1, 1, 2, 1) must all be rank 4",
            q, z(1, 1, 2), kv, None, None, cfg)
    refused(dsv4_attention, "q (1, 1, 1, 1), k (1, 1, 2, 1), v (1, 1, 2) must all be rank 4",
            q, kv, z(1, 1, 2), None, None, cfg)
    # only k and v differ (batch and head dim agree with q)
    refused(dsv4_attention, "k (1, 1, 3, 1) and v (1, 1, 2, 1) must both be [B=1,Hk,t_k,D=1]",
            q, z(1, 1, 3, 1), kv, None, None, cfg)
    # only the batch differs
    refused(dsv4_attention, "k (1, 1, 2, 1) and v (1, 1, 2, 1) must both be [B=2,Hk,t_k,D=1]",
            z(2, 1, 1, 1), kv, kv, None, None, cfg)
    # only the head dim differs
    refused(dsv4_attention, "k (1, 1, 2, 3) and v (1, 1, 2, 3) must both be [B=1,Hk,t_k,D=2]",
            z(1, 1, 1, 2), z(1, 1, 2, 3), z(1, 1, 2, 3), None, None, cfg)
    refused(dsv4_attention, "KV heads 2 must divide query heads 3",
            z(1, 3, 1, 1), z(1, 2, 2, 1), z(1, 2, 2, 1), None, None, cfg)
    # the head check comes before the key-count refusal: 3 queries against 2 keys
    with pytest.raises(ValueError, match="^KV heads 2 must divide query heads 3$"):
        dsv4_attention(z(1, 3, 3, 1), z(1, 2, 2, 1), z(1, 2, 2, 1), None, None, cfg)
    refused(dsv4_attention, "raw_prefix -1 and compress_ratio 0 must be >= 0",
            q, kv, kv, None, None, Dsv4AttentionConfig(0, 4, raw_prefix=-1))
    refused(dsv4_attention, "raw_prefix 0 and compress_ratio -4 must be >= 0",
            q, kv, kv, None, None, Dsv4AttentionConfig(-4, 4))


# --- float64 whatever the inputs' dtype ------------------------------------------------------


@pytest.mark.rule("attention with sinks")
def test_attention_computes_float32_inputs_in_float64():
    rng = np.random.default_rng(3)
    q, k, v = (rng.normal(size=s) for s in ((1, 2, 3, 4), (1, 1, 5, 4), (1, 1, 5, 2)))
    q32, k32, v32 = (a.astype(np.float32) for a in (q, k, v))
    want = attention(*(a.astype(np.float64) for a in (q32, k32, v32)), None)
    got = attention(q32, k32, v32, None)
    assert got.dtype == np.float64 and np.array_equal(got, want)


@pytest.mark.rule("attention with sinks")
def test_a_mask_and_sinks_given_as_object_arrays_of_floats_are_read_as_float64():
    rng = np.random.default_rng(5)
    q, k, v = (rng.normal(size=s) for s in ((1, 2, 2, 3), (1, 2, 4, 3), (1, 2, 4, 1)))
    mask = np.array([[0.0, 0.0, -np.inf, 0.0], [0.0, -np.inf, 0.0, 0.0]])
    sinks = np.array([0.5, -1.0])
    want = attention(q, k, v, mask, sinks)
    got = attention(q, k, v, mask.astype(object), sinks.astype(object))
    assert got.dtype == np.float64 and np.array_equal(got, want)


# --- softmax edges ----------------------------------------------------------------------------


@pytest.mark.rule("attention with sinks")
def test_no_keys_gives_zeros_with_and_without_sinks():
    q, k, v = z(2, 3, 4, 2), z(2, 3, 0, 2), z(2, 3, 0, 5)
    for sinks in (None, np.array([0.0, 1.0, -2.0])):
        out = attention(q, k, v, None, sinks)
        assert out.shape == (2, 3, 4, 5) and np.array_equal(out, np.zeros((2, 3, 4, 5)))


@pytest.mark.rule("attention with sinks")
def test_large_logits_do_not_overflow():
    # logits q.k / sqrt(1) = 1600 and 1560: exp overflows unless the row max is subtracted
    q = np.full((1, 1, 1, 1), 40.0)
    k = np.array([40.0, 39.0]).reshape(1, 1, 2, 1)
    v = np.array([1.0, 2.0]).reshape(1, 1, 2, 1)
    e = math.exp(-40.0)
    out = attention(q, k, v, None)
    assert np.isclose(out[0, 0, 0, 0], (1.0 + 2.0 * e) / (1.0 + e), rtol=1e-15, atol=0)
    sunk = attention(q, k, v, None, np.array([1600.0]))  # a sink as large as the top logit
    assert np.isclose(sunk[0, 0, 0, 0], (1.0 + 2.0 * e) / (2.0 + e), rtol=1e-15, atol=0)


@pytest.mark.rule("attention with sinks")
def test_a_fully_masked_row_is_zero_without_an_invalid_division():
    q, k, v = z(1, 1, 2, 1), np.ones((1, 1, 2, 1)), np.ones((1, 1, 2, 1))
    mask = np.array([[0.0, 0.0], [-np.inf, -np.inf]])  # query row 1 sees no key
    with np.errstate(all="raise"):
        out = attention(q, k, v, mask)
    assert out[0, 0, :, 0].tolist() == [1.0, 0.0]


@pytest.mark.rule("attention with sinks")
def test_a_fully_masked_row_is_zero_whatever_its_values_hold():
    # masked columns weigh exactly 0, and a row with no visible key returns 0, never NaN,
    # even when the masked values are not finite (0 * inf and 0 * NaN are NaN)
    q, k = z(1, 1, 1, 1), np.ones((1, 1, 2, 1))
    v = np.array([np.nan, np.inf]).reshape(1, 1, 2, 1)
    out = attention(q, k, v, np.array([[-np.inf, -np.inf]]))
    assert out.tolist() == [[[[0.0]]]]


# --- path counters, the Standard-layer boundary, the paged arm ----------------------------


@pytest.mark.rule("dsv4_attention uniform row_q0")
def test_the_ragged_path_counts_every_call():
    q, k = z(3, 1, 1, 1), np.ones((3, 1, 7, 1))
    cfg = Dsv4AttentionConfig(4, 4, row_q0=[6, 4, 2])  # q0 = 7 - 1 = 6: row 0 at the end
    reset_dsv4_mask_stats()
    dsv4_attention(q, k, k, None, None, cfg)
    dsv4_attention(q, k, k, None, None, cfg)
    assert dsv4_mask_stats == {"uniform": 0, "ragged": 2}


@pytest.mark.rule("dsv4_attention Standard layer forces compressed_kv None")
def test_a_standard_layer_is_config_ratio_0_or_internal_ratio_1_only():
    assert [is_standard_layer(r) for r in (0, 1, 2, 4, 128)] == [True, True, False, False, False]


@pytest.mark.rule("v4_paged_dispatch_precheck")
def test_the_paged_arm_takes_an_empty_batch_and_refuses_a_negative_one():
    assert v4_paged_dispatch_precheck(0) is None
    refused(v4_paged_dispatch_precheck, "batch size -1 must be >= 0", -1)


@pytest.mark.rule("dsv4_attention Standard layer forces compressed_kv None")
def test_a_standard_layer_ignores_compressed_keys_of_any_shape():
    q, kv = np.ones((1, 1, 1, 1)), np.ones((1, 1, 2, 1))
    plain = dsv4_attention(q, kv, kv, None, None, Dsv4AttentionConfig(1, 4))
    with pytest.raises(ValueError):  # a ratio-2 layer reads (and checks) them
        dsv4_attention(q, kv, kv, z(3), None, Dsv4AttentionConfig(2, 4))
    assert np.array_equal(dsv4_attention(q, kv, kv, z(3), None, Dsv4AttentionConfig(1, 4)),
                          plain)
