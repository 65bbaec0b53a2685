"""Sink softmax attention (masks-and-scheduling.md §1, §4 step 9): `attention` on the reference
and the port (`gpu.attention.attention`) through one test body (`impl`), then each side's own
input contract and the port's low-precision bound. dsv4's union attention is in
test_attention_dsv4.py, the port's in-place layout in test_attention_in_place.py.

Oracles: `conformance/helpers.py` (`attention_oracle`, a plain per-query loop over the kept
keys with the sink as a denominator-only term; it shares no code with either implementation).
Tolerances (float64): 1e-12, relative and absolute, against the oracle (the same (logit,
value) pairs in another summation order); the port against the reference within 1e-12
relative to the output's max magnitude. float32 / bfloat16 on the port: `|port - ref64| <=
2 |naive - ref64| + 4 eps(dtype) max|v|`, `naive` the plain same-dtype attention written here,
`ref64` the reference on the same dtype-rounded inputs. Expected messages are stated from the
inputs' shapes (the reference names tuples, the port lists).
"""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from raggedspec.conformance.helpers import (
    assert_refused,
    attention_oracle,
    attention_rules,
    each_implementation,
    naive_attention,
)
from raggedspec.reference.attention import attention

TOL = 1e-12


def rand(*shapes, seed=0):
    rng = np.random.default_rng(seed)
    return tuple(rng.normal(size=s) for s in shapes)


# ----------------------------------------------------------------------------- both


@each_implementation
@pytest.mark.rule("attention with sinks", "attention with sinks, port")
@given(b=st.integers(1, 3), hk=st.integers(1, 2), group=st.integers(1, 2),
       t_q=st.integers(1, 5), t_k=st.integers(1, 12), with_sinks=st.booleans(),
       seed=st.integers(0, 2**32 - 1))
def test_attention_equals_the_loop_oracle(impl, b, hk, group, t_q, t_k, with_sinks, seed):
    rng = np.random.default_rng(seed)
    h = hk * group
    q = rng.normal(size=(b, h, t_q, 4))
    k = rng.normal(size=(b, hk, t_k, 4))
    v = rng.normal(size=(b, hk, t_k, 3))
    keep = rng.random((b, h, t_q, t_k)) < 0.7
    keep[..., 0] = True  # at least one kept key per query
    sinks = rng.normal(size=h) if with_sinks else None
    got = attention_rules(impl).attention(q, k, v, np.where(keep, 0.0, -np.inf), sinks)
    np.testing.assert_allclose(got, attention_oracle(q, k, v, keep, sinks), rtol=TOL, atol=TOL)


@each_implementation
@pytest.mark.rule("attention with sinks", "attention with sinks, port")
def test_the_sink_is_a_denominator_only_column(impl):
    attend = attention_rules(impl).attention
    q, k, v = rand((1, 2, 3, 4), (1, 1, 5, 4), (1, 1, 5, 4), seed=7)
    plain = attend(q, k, v, None)
    # a -inf sink is no sink at all, bit for bit
    assert np.array_equal(attend(q, k, v, None, np.full(2, -np.inf)), plain)
    # a finite sink only rescales: out = plain * Z / (Z + e^sink)
    sinks = np.array([0.5, -1.0])
    z = np.exp((q @ np.swapaxes(k, -1, -2)) / 2.0).sum(-1, keepdims=True)
    want = plain * z / (z + np.exp(sinks)[None, :, None, None])
    np.testing.assert_allclose(attend(q, k, v, None, sinks), want, rtol=TOL, atol=TOL)
    # a dominant sink takes (almost) all the weight, and adds no value row
    assert np.abs(attend(q, k, v, None, np.full(2, 60.0))).max() < 1e-20


@each_implementation
@pytest.mark.rule("attention with sinks", "attention with sinks, port")
def test_masked_keys_never_reach_the_output_and_never_make_nan(impl):
    attend = attention_rules(impl).attention
    q, k, v = rand((2, 2, 3, 4), (2, 1, 6, 4), (2, 1, 6, 4), seed=8)
    mask = np.zeros((2, 1, 3, 6))
    mask[..., :2] = -np.inf
    base = attend(q, k, v, mask)
    k2, v2 = k.copy(), v.copy()
    k2[:, :, :2] = rand((2, 1, 2, 4), seed=9)[0] * 50
    v2[:, :, :2] = rand((2, 1, 2, 4), seed=10)[0] * 50
    assert np.array_equal(attend(q, k2, v2, mask), base)
    # unspecified, chosen: a query with every key masked and no sink returns 0, not NaN
    dead = np.full((1, 1, 3, 6), -np.inf)
    for sinks in (None, np.zeros(2)):
        assert np.array_equal(attend(q, k, v, dead, sinks), np.zeros((2, 2, 3, 4)))


@each_implementation
@pytest.mark.rule("attention with sinks", "attention with sinks, port")
def test_a_fully_masked_row_is_zero_whatever_its_values_hold(impl):
    # masked columns weigh exactly 0, and a row with no visible key returns 0, never NaN,
    # even when the masked values are not finite (0 * inf and 0 * NaN are NaN)
    attend = attention_rules(impl).attention
    q, k = np.zeros((1, 1, 2, 1)), np.ones((1, 1, 2, 1))
    v = np.array([np.nan, np.inf]).reshape(1, 1, 2, 1)
    out = attend(q, k, v, np.array([[-np.inf, -np.inf], [-np.inf, -np.inf]]))
    assert out.tolist() == [[[[0.0], [0.0]]]]
    ones = np.ones((1, 1, 2, 1))  # query row 1 sees no key, row 0 both
    out = attend(q, k, ones, np.array([[0.0, 0.0], [-np.inf, -np.inf]]))
    assert out[0, 0, :, 0].tolist() == [1.0, 0.0]


@each_implementation
@pytest.mark.rule("attention with sinks", "attention with sinks, port")
def test_no_keys_give_zeros_and_large_logits_do_not_overflow(impl):
    attend = attention_rules(impl).attention
    q, k, v = np.zeros((2, 3, 4, 2)), np.zeros((2, 3, 0, 2)), np.zeros((2, 3, 0, 5))
    for sinks in (None, np.array([0.0, 1.0, -2.0])):
        out = attend(q, k, v, None, sinks)
        assert out.shape == (2, 3, 4, 5) and np.array_equal(out, np.zeros((2, 3, 4, 5)))
    # logits q.k / sqrt(1) = 1600 and 1560: exp overflows unless the row max is subtracted
    q = np.full((1, 1, 1, 1), 40.0)
    k = np.array([40.0, 39.0]).reshape(1, 1, 2, 1)
    v = np.array([1.0, 2.0]).reshape(1, 1, 2, 1)
    e = math.exp(-40.0)
    assert np.isclose(attend(q, k, v, None)[0, 0, 0, 0], (1.0 + 2.0 * e) / (1.0 + e),
                      rtol=1e-15, atol=0)
    sunk = attend(q, k, v, None, np.array([1600.0]))  # a sink as large as the top logit
    assert np.isclose(sunk[0, 0, 0, 0], (1.0 + 2.0 * e) / (2.0 + e), rtol=1e-15, atol=0)


@each_implementation
@pytest.mark.rule("attention with sinks", "attention with sinks, port")
def test_attention_takes_each_rows_own_maximum(impl):
    """A finite additive mask of -5000 on every key of one query row shifts that row's logits
    only: its softmax is unchanged (a max over all rows would underflow it to 0)."""
    attend = attention_rules(impl).attention
    q, k, v = rand((1, 1, 2, 4), (1, 1, 5, 4), (1, 1, 5, 4), seed=4)
    shift = np.zeros((1, 1, 2, 5))
    shift[0, 0, 1] = -5000.0
    np.testing.assert_allclose(attend(q, k, v, shift), attend(q, k, v, None), rtol=1e-9, atol=0)


# ----------------------------------------------------------------------------- the reference


def refused(fn, message, *args):
    with pytest.raises(ValueError, match="^" + re.escape(message) + "$"):
        fn(*args)


@pytest.mark.rule("attention with sinks")
def test_the_reference_refuses_each_malformed_shape_with_its_own_message():
    z = np.zeros
    q, kv = z((1, 1, 1, 1)), z((1, 1, 2, 1))
    refused(attention, "q (1, 1, 1), k (1, 1, 2, 1), v (1, 1, 2, 1) must all be rank 4",
            z((1, 1, 1)), kv, kv, None)
    refused(attention, "q (1, 1, 1, 1), k (1, 1, 2), v (1, 1, 2, 1) must all be rank 4",
            q, z((1, 1, 2)), kv, None)
    refused(attention, "q (1, 1, 1, 1), k (1, 1, 2, 1), v (1, 1, 2) must all be rank 4",
            q, kv, z((1, 1, 2)), None)
    # only the head dim differs; only v's batch; only k's batch
    refused(attention, "batch/head-dim mismatch: q (1, 1, 1, 2), k (1, 1, 2, 3)",
            z((1, 1, 1, 2)), z((1, 1, 2, 3)), z((1, 1, 2, 3)), None)
    refused(attention, "batch/head-dim mismatch: q (2, 1, 1, 1), k (2, 1, 2, 1)",
            z((2, 1, 1, 1)), z((2, 1, 2, 1)), z((1, 1, 2, 1)), None)
    refused(attention, "batch/head-dim mismatch: q (2, 1, 1, 1), k (1, 1, 2, 1)",
            z((2, 1, 1, 1)), z((1, 1, 2, 1)), z((2, 1, 2, 1)), None)
    refused(attention, "k (1, 1, 3, 1) and v (1, 1, 2, 1) must share [B,Hk,t_k]",
            q, z((1, 1, 3, 1)), kv, None)
    refused(attention, "KV heads 2 must divide query heads 3",
            z((1, 3, 1, 1)), z((1, 2, 2, 1)), z((1, 2, 2, 1)), None)
    refused(attention, "sinks shape (2,) must be [1]", q, kv, kv, None, np.zeros(2))


@pytest.mark.rule("attention with sinks")
def test_the_reference_computes_float32_and_object_inputs_in_float64():
    q, k, v = rand((1, 2, 3, 4), (1, 1, 5, 4), (1, 1, 5, 2), seed=3)
    q32, k32, v32 = (a.astype(np.float32) for a in (q, k, v))
    want = attention(*(a.astype(np.float64) for a in (q32, k32, v32)), None)
    got = attention(q32, k32, v32, None)
    assert got.dtype == np.float64 and np.array_equal(got, want)
    q, k, v = rand((1, 2, 2, 3), (1, 2, 4, 3), (1, 2, 4, 1), seed=5)
    mask = np.array([[0.0, 0.0, -np.inf, 0.0], [0.0, -np.inf, 0.0, 0.0]])
    sinks = np.array([0.5, -1.0])
    got = attention(q, k, v, mask.astype(object), sinks.astype(object))
    assert got.dtype == np.float64 and np.array_equal(got, attention(q, k, v, mask, sinks))


@pytest.mark.rule("attention with sinks")
def test_the_references_fully_masked_row_makes_no_invalid_division():
    q, k, v = np.zeros((1, 1, 2, 1)), np.ones((1, 1, 2, 1)), np.ones((1, 1, 2, 1))
    with np.errstate(all="raise"):
        out = attention(q, k, v, np.array([[0.0, 0.0], [-np.inf, -np.inf]]))
    assert out[0, 0, :, 0].tolist() == [1.0, 0.0]


# ----------------------------------------------------------------------------- the port


@st.composite
def attention_case(draw, all_masked_rows: bool = True):
    """`(q, k, v, mask, sinks)`: GQA layouts, 0..40 keys, a random keep mask or none (rows
    with no kept key allowed unless `all_masked_rows` is off), sinks or none."""
    b, hk, group = draw(st.integers(1, 3)), draw(st.integers(1, 2)), draw(st.integers(1, 3))
    t_q, t_k = draw(st.integers(1, 5)), draw(st.integers(0, 40))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    h = hk * group
    q, k, v = (rng.normal(size=s) for s in ((b, h, t_q, 8), (b, hk, t_k, 8), (b, hk, t_k, 6)))
    mask = None
    if draw(st.booleans()) and t_k:
        keep = rng.random((b, 1, t_q, t_k)) < draw(st.sampled_from([0.3, 0.8, 1.0]))
        if not all_masked_rows:
            keep[..., 0] = True
        mask = np.where(keep, 0.0, -np.inf)
    sinks = rng.normal(size=h) * 2 if draw(st.booleans()) else None
    if not all_masked_rows and t_k == 0 and sinks is None:
        sinks = np.zeros(h)
    return q, k, v, mask, sinks


@pytest.mark.rule("attention with sinks, port")
@given(case=attention_case())
def test_the_ports_float64_attention_matches_the_reference(case):
    from raggedspec.gpu.testing import assert_close64

    got = attention_rules("port").attention(*case)
    assert_close64(got, attention(*case), what="attention")
    assert np.isfinite(got).all()  # all-masked rows without a sink give 0, never NaN


@pytest.mark.rule("attention with sinks, port")
@given(case=attention_case(all_masked_rows=False), low=st.sampled_from(["float32", "bfloat16"]))
def test_the_ports_low_precision_attention_is_within_twice_the_naive_error(case, low):
    torch = pytest.importorskip("torch")
    from raggedspec.gpu import attention as port
    from raggedspec.gpu.testing import assert_dtype_bound, representable, to_port

    dtype = getattr(torch, low)
    q, k, v, mask, sinks = (None if a is None else representable(a, dtype) for a in case)
    args = [None if a is None else to_port(a, dtype) for a in (q, k, v, mask, sinks)]
    got = port.attention(*args)
    assert got.dtype == dtype
    scale = float(np.abs(v).max()) if v.size else 1.0
    assert_dtype_bound(got, naive_attention(*args), attention(q, k, v, mask, sinks), dtype,
                       scale, "attention")


@pytest.mark.rule("attention with sinks, port")
def test_the_port_takes_mask_and_sinks_in_the_compute_dtype_and_half_precision_in_float32():
    """A mask or sinks in another float dtype are converted to the query's compute dtype
    (masks hold 0 / -inf; the sinks are exact in float32); bfloat16 and float16 inputs are
    computed in float32 and rounded once at the end."""
    torch = pytest.importorskip("torch")
    from raggedspec.gpu import attention as port

    rng = np.random.default_rng(11)
    q, k, v = (torch.from_numpy(rng.standard_normal(s)).float()
               for s in ((2, 2, 3, 4), (2, 1, 5, 4), (2, 1, 5, 4)))
    mask = torch.from_numpy(np.where(rng.random((2, 1, 3, 5)) < 0.7, 0.0, -np.inf))
    sinks = torch.tensor([0.5, -1.25])
    want = port.attention(q, k, v, mask.float(), sinks.float())
    got = port.attention(q, k, v, mask, sinks.double())
    assert got.dtype == torch.float32 and torch.equal(got, want)
    empty = port.attention(q, k[:, :, :0], v[:, :, :0], None, sinks.double())
    assert empty.dtype == torch.float32 and torch.equal(empty, torch.zeros_like(empty))
    assert torch.equal(port.attention(q, k[:, :, :0], v[:, :, :0], None), torch.zeros_like(q))
    for dt in (torch.bfloat16, torch.float16):
        q, k, v = (torch.from_numpy(rng.standard_normal(s)).to(dt)
                   for s in ((1, 2, 3, 8), (1, 1, 6, 8), (1, 1, 6, 8)))
        want = port.attention(q.float(), k.float(), v.float(), None).to(dt)
        assert torch.equal(port.attention(q, k, v, None), want)


@pytest.mark.rule("attention with sinks, port")
def test_the_port_refuses_each_malformed_shape_with_its_own_message():
    torch = pytest.importorskip("torch")
    from raggedspec.gpu import attention as port

    z = torch.zeros
    q, k = z((2, 4, 3, 8)), z((2, 2, 5, 8))
    cases = [
        ((q[0], k, k, None), "q [4, 3, 8], k [2, 2, 5, 8], v [2, 2, 5, 8] must all be rank 4"),
        ((q, k[0], k, None), "q [2, 4, 3, 8], k [2, 5, 8], v [2, 2, 5, 8] must all be rank 4"),
        ((q, k, k[0], None), "q [2, 4, 3, 8], k [2, 2, 5, 8], v [2, 5, 8] must all be rank 4"),
        ((q, k[:1], k, None), "batch/head-dim mismatch: q [2, 4, 3, 8], k [1, 2, 5, 8]"),
        ((q, k, k[:1], None), "batch/head-dim mismatch: q [2, 4, 3, 8], k [2, 2, 5, 8]"),
        ((q, k[..., :4], k, None), "batch/head-dim mismatch: q [2, 4, 3, 8], k [2, 2, 5, 4]"),
        ((q, k, k[:, :, :4], None), "k [2, 2, 5, 8] and v [2, 2, 4, 8] must share [B,Hk,t_k]"),
        ((q, z((2, 3, 5, 8)), z((2, 3, 5, 8)), None), "KV heads 3 must divide query heads 4"),
        ((q, z((2, 0, 5, 8)), z((2, 0, 5, 8)), None), "KV heads 0 must divide query heads 4"),
        ((q, k, k, None, z(3)), "sinks shape [3] must be [4]"),
    ]
    for args, message in cases:
        assert_refused(ValueError, lambda a=args: port.attention(*a), message)
