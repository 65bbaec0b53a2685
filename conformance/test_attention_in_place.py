"""The port's attention over its in-place KV layout (`gpu.attention.dsv4_attention_in_place`,
masks-and-scheduling.md §4, cache-and-draft.md §4.5) against the reference on the front-aligned
batch, and the dtypes of what joins the port's union attention (the mask in the compute dtype,
compressed keys rounded to the KV dtype). Only the port has this layout: the reference's rule is
`dsv4_attention` of the materialized front-aligned batch (test_attention_dsv4.py).

Tolerance: float64 within 1e-12 relative to the output's max magnitude (summation order); the
dtype checks are bit-exact (the same computation given the same rounded operands).
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from raggedspec.conformance.strategies import compress_ratios, corner_lengths
from raggedspec.reference import attention as ref

torch = pytest.importorskip("torch", reason="the port needs torch: pip install 'raggedspec[torch]'")

from raggedspec.gpu import attention as port  # noqa: E402 (after the torch check)
from raggedspec.gpu.cache import RaggedKv  # noqa: E402
from raggedspec.gpu.testing import DEVICE, assert_close64, to_port  # noqa: E402


def opt(a, dtype=None):
    return None if a is None else to_port(a, dtype)


@pytest.mark.rule("dsv4 attention over the in-place layout, port")
@given(own=corner_lengths(1, 5, 300, boundaries=False), t_q=st.integers(1, 3),
       ratio=compress_ratios(), window=st.sampled_from([1, 4, 16, 128]),
       with_sinks=st.booleans(), seed=st.integers(0, 2**32 - 1),
       heads=st.sampled_from([(2, 1), (2, 1), (4, 2), (8, 2), (16, 2), (8, 4)]))
def test_in_place_attention_equals_the_reference_on_the_front_aligned_batch(
        own, t_q, ratio, window, with_sinks, seed, heads):
    """The port's layout never front-aligns: rows sit at column 0 with their own lengths.
    Its attention (per-row window gather, per-row masks) equals the reference's
    `dsv4_attention` of the front-aligned batch with `row_q0 = own - t_q`, with one KV head
    or several (`(H, Hk)` in `heads`: GQA ratios 2, 4, 8; compressed keys per KV head)."""
    rng = np.random.default_rng(seed)
    own = [n + t_q for n in own]
    b, n_max = len(own), max(own)
    h, hk = heads
    cap = n_max + 7
    k_place = rng.normal(size=(b, hk, cap, 8)) * 5  # slack columns hold noise: never read
    v_place = rng.normal(size=(b, hk, cap, 8)) * 5
    k_front, v_front = np.zeros((b, hk, n_max, 8)), np.zeros((b, hk, n_max, 8))
    for i, n in enumerate(own):
        k_front[i, :, n_max - n:] = k_place[i, :, :n]
        v_front[i, :, n_max - n:] = v_place[i, :, :n]
    t_c = n_max // ratio if ratio > 1 else 0
    comp = rng.normal(size=(b, hk, t_c, 8)) if t_c else None
    q = rng.normal(size=(b, h, t_q, 8))
    sinks = rng.normal(size=h) if with_sinks else None
    kv = RaggedKv(to_port(k_place), to_port(v_place), torch.tensor(own), max_seq_len=4096)
    got = port.dsv4_attention_in_place(to_port(q), kv, opt(comp), ratio, window, opt(sinks))
    cfg = ref.Dsv4AttentionConfig(ratio, window, 0, [n - t_q for n in own])
    want = ref.dsv4_attention(q, k_front, v_front, comp, None, cfg, sinks)
    assert_close64(got, want, what="dsv4_attention_in_place")


@pytest.mark.rule("dsv4_attention, port", "dsv4 attention over the in-place layout, port")
def test_in_place_attention_never_reads_a_key_before_the_window():
    """One query per row, window 3: row i attends exactly its last 3 keys (`qp - 3 < kp <=
    qp`, qp = lens[i] - 1). Every other column, older keys and the slack past the row's
    end alike, holds NaN: the output is the plain attention over the 3 window keys."""
    rng = np.random.default_rng(12)
    lens, window, cap = [10, 6], 3, 12
    k, v = np.full((2, 1, cap, 4), np.nan), np.full((2, 1, cap, 4), np.nan)
    q = rng.standard_normal((2, 2, 1, 4))
    sinks = rng.standard_normal(2)
    want = []
    for i, n in enumerate(lens):
        k[i, :, n - window: n] = rng.standard_normal((1, window, 4))
        v[i, :, n - window: n] = rng.standard_normal((1, window, 4))
        want.append(ref.attention(q[i: i + 1], k[i: i + 1, :, n - window: n],
                                  v[i: i + 1, :, n - window: n], None, sinks))
    kv = RaggedKv(to_port(k), to_port(v), lens, max_seq_len=4096)
    got = port.dsv4_attention_in_place(to_port(q), kv, None, 0, window, to_port(sinks))
    assert_close64(got, np.concatenate(want), what="window keys only")
    assert torch.isfinite(got).all()


@pytest.mark.rule("dsv4 attention over the in-place layout, port")
def test_in_place_refusals_and_the_row_with_exactly_t_q_keys():
    kv = RaggedKv(torch.zeros((2, 1, 8, 4), dtype=torch.float64),
                  torch.zeros((2, 1, 8, 4), dtype=torch.float64), torch.tensor([5, 1]), 4096)
    with pytest.raises(port.MaskRefusal, match="^2 query rows against only 1 keys$"):
        port.dsv4_attention_in_place(torch.zeros((2, 1, 2, 4), dtype=torch.float64), kv, None, 0,
                                     4)
    kv = RaggedKv.empty(2, 1, 4, 64, 16, torch.float64)
    kv.lens = [2, 3]
    msg = "q {} against kv {}: need [B,H,t_q,D] and [B,Hk,cap,D] with Hk dividing H"
    for shape in ((2, 2, 2), (3, 2, 2, 4), (2, 2, 2, 8)):
        with pytest.raises(ValueError) as e:
            port.dsv4_attention_in_place(torch.zeros(shape, dtype=torch.float64), kv, None, 0, 4)
        assert str(e.value) == msg.format(list(shape), [2, 1, 16, 4])
    kv2 = RaggedKv.empty(2, 2, 4, 64, 16, torch.float64)
    with pytest.raises(ValueError) as e:
        port.dsv4_attention_in_place(torch.zeros((2, 3, 2, 4), dtype=torch.float64), kv2, None,
                                     0, 4)
    assert str(e.value) == msg.format([2, 3, 2, 4], [2, 2, 16, 4])
    out = port.dsv4_attention_in_place(torch.zeros((2, 1, 2, 4), dtype=torch.float64), kv, None,
                                       0, 4)  # row 0 holds exactly t_q = 2 keys
    assert tuple(out.shape) == (2, 1, 2, 4)


# ----------------------------------------------------------------------------- dtypes


@pytest.mark.rule("dsv4_attention, port")
@pytest.mark.parametrize("dtype, compute", [("float16", "float32"), ("bfloat16", "float32"),
                                            ("float32", "float32"), ("float64", "float64")])
def test_the_union_mask_reaches_attention_in_the_compute_dtype(monkeypatch, dtype, compute):
    """Half-precision queries compute in float32, float32 and float64 in their own dtype: the
    0 / -inf union mask handed to `attention` is built in that dtype on the uniform path, the
    ragged path and the in-place layout."""
    dtype, compute = getattr(torch, dtype), getattr(torch, compute)
    seen = []
    inner = port.attention

    def spy(q, k, v, mask, sinks=None):
        seen.append(mask.dtype)
        return inner(q, k, v, mask, sinks)

    monkeypatch.setattr(port, "attention", spy)
    q = torch.zeros((2, 2, 1, 4), dtype=dtype, device=DEVICE)
    k = torch.zeros((2, 1, 5, 4), dtype=dtype, device=DEVICE)
    for rows in (None, [4, 2]):
        port.dsv4_attention(q, k, k, None, None, port.Dsv4AttentionConfig(0, 3, row_q0=rows))
    port.dsv4_attention_in_place(q, RaggedKv(k, k.clone(), [5, 3], max_seq_len=4096), None, 0, 3)
    assert seen == [compute] * 3


@pytest.mark.rule("dsv4_attention, port")
def test_compressed_keys_join_in_the_kv_dtype():
    """Compressed keys of another dtype enter rounded to the raw keys' and values' dtype,
    exactly as if given in it: float32 ones beside bfloat16 keys; float64 ones beside bfloat16
    keys and values under float64 queries (the output keeps the rounding visible), in
    `dsv4_attention` and in the in-place layout."""
    rng = np.random.default_rng(8)
    q = torch.from_numpy(rng.standard_normal((1, 2, 1, 4))).to(torch.bfloat16)
    k = torch.from_numpy(rng.standard_normal((1, 1, 8, 4))).to(torch.bfloat16)
    comp = torch.from_numpy(rng.standard_normal((1, 1, 2, 4))).float()
    cfg = port.Dsv4AttentionConfig(compress_ratio=4, sliding_window=8)
    want = port.dsv4_attention(q, k, k, comp.to(torch.bfloat16), None, cfg)
    assert torch.equal(port.dsv4_attention(q, k, k, comp, None, cfg), want)
    rng = np.random.default_rng(9)
    q = to_port(rng.standard_normal((2, 2, 1, 4)))
    k = to_port(rng.standard_normal((2, 1, 8, 4)), torch.bfloat16)
    v = to_port(rng.standard_normal((2, 1, 8, 4)), torch.bfloat16)
    comp = to_port(rng.standard_normal((2, 1, 2, 4)))
    rounded = comp.to(torch.bfloat16)
    assert not torch.equal(rounded.double(), comp)  # the rounding is there to be seen
    want = port.dsv4_attention(q, k, v, rounded, None, cfg)
    assert torch.equal(port.dsv4_attention(q, k, v, comp, None, cfg), want)
    kv = RaggedKv(k, v, [8, 8], max_seq_len=4096)
    assert torch.equal(port.dsv4_attention_in_place(q, kv, comp, 4, 8),
                       port.dsv4_attention_in_place(q, kv, rounded, 4, 8))
