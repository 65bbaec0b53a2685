"""Port conformance: attention and dsv4_attention (gpu.attention vs reference.attention),
and the port's in-place-layout attention against the reference on the front-aligned batch.

Tolerances (gpu.testing): float64 port vs float64 reference within 1e-12 relative to the
output's max magnitude (matmul/softmax summation order differs between torch and NumPy;
masked columns contribute exact zeros in both). float32 / bfloat16: `|port - ref64| <=
2 |naive - ref64| + 4 eps(dtype) max|v|` with `naive` the plain same-dtype attention
written here (logits, softmax with the sink column and `@ v`, all in the dtype); `ref64`
is the reference on the same dtype-rounded inputs. Masks are exact. Refusals: raised by
both or neither, same class and message."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import assume, given
from hypothesis import strategies as st

import raggedspec.gpu.attention as port
import raggedspec.reference.attention as ref
from raggedspec.conformance.strategies import corner_lengths, compress_ratios
from raggedspec.gpu.cache import RaggedKv
from raggedspec.gpu.testing import (
    DEVICE,
    assert_close64,
    assert_dtype_bound,
    assert_same_refusal,
    outcome,
    representable,
    to_port,
)

LOW = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])


def naive_attention(q, k, v, mask, sinks):
    """Plain same-dtype attention: everything in q.dtype, the sink as an extra logit column
    dropped after the softmax, GQA by repeat_interleave."""
    h, hk = q.shape[1], k.shape[1]
    k, v = k.repeat_interleave(h // hk, 1), v.repeat_interleave(h // hk, 1)
    logits = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if mask is not None:
        logits = logits + mask.to(q.dtype)
    if sinks is not None:
        col = sinks.to(q.dtype)[None, :, None, None].expand(*logits.shape[:-1], 1)
        logits = torch.cat([logits, col], dim=-1)
    p = torch.softmax(logits, dim=-1)
    if sinks is not None:
        p = p[..., :-1]
    return p @ v


@st.composite
def attention_case(draw, all_masked_rows: bool = True):
    b, hk, group = draw(st.integers(1, 3)), draw(st.integers(1, 2)), draw(st.integers(1, 3))
    t_q, t_k = draw(st.integers(1, 5)), draw(st.integers(0, 40))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    h = hk * group
    q, k, v = (
        rng.normal(size=(b, h, t_q, 8)),
        rng.normal(size=(b, hk, t_k, 8)),
        rng.normal(size=(b, hk, t_k, 6)),
    )
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


def opt(a, dtype=None):
    return None if a is None else to_port(a, dtype)


@pytest.mark.rule("attention with sinks, port")
@given(case=attention_case())
def test_float64_attention_matches_the_reference(case):
    q, k, v, mask, sinks = case
    got = port.attention(to_port(q), to_port(k), to_port(v), opt(mask), opt(sinks))
    want = ref.attention(q, k, v, mask, sinks)
    assert_close64(got, want, what="attention")
    assert torch.isfinite(got).all()  # all-masked rows without a sink give 0, never NaN


@pytest.mark.rule("attention with sinks, port")
@LOW
@given(case=attention_case(all_masked_rows=False))
def test_low_precision_attention_is_within_twice_the_naive_error(dtype, case):
    q, k, v, mask, sinks = (None if a is None else representable(a, dtype) for a in case)
    got = port.attention(
        to_port(q, dtype), to_port(k, dtype), to_port(v, dtype), opt(mask, dtype), opt(sinks, dtype)
    )
    assert got.dtype == dtype
    naive = naive_attention(
        to_port(q, dtype), to_port(k, dtype), to_port(v, dtype), opt(mask, dtype), opt(sinks, dtype)
    )
    want = ref.attention(q, k, v, mask, sinks)
    scale = float(np.abs(v).max()) if v.size else 1.0
    assert_dtype_bound(got, naive, want, dtype, scale, "attention")


# ----------------------------------------------------------------------------- dsv4


@st.composite
def dsv4_case(draw):
    """A front-aligned dsv4 batch built here (independently of the port's layout code):
    rows of own length `n_i` (this step's `t_q` tokens included) ending at the shared
    column `N = max n_i`, zero dead prefix, start-anchored compressed keys per row (blocks
    past a row's own count are noise: the mask must kill them). Plus a config, a caller
    mask, sinks, and variants reaching each refusal."""
    ratio = draw(compress_ratios())
    t_q = draw(st.integers(1, 4))
    max_len = 300 if ratio == 128 else 60
    own = [n + t_q for n in draw(corner_lengths(1, 4, max_len, boundaries=False))]
    b, n_max = len(own), max(own)
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    k = np.zeros((b, 1, n_max, 8))
    v = np.zeros((b, 1, n_max, 8))
    for i, n in enumerate(own):
        k[i, 0, n_max - n:] = rng.normal(size=(n, 8))
        v[i, 0, n_max - n:] = rng.normal(size=(n, 8))
    comp = None
    if ratio > 1 and n_max // ratio > 0:
        comp = rng.normal(size=(b, 1, n_max // ratio + draw(st.integers(0, 1)), 8)) * 3
    h = draw(st.sampled_from([1, 2, 4]))
    q = rng.normal(size=(b, h, t_q, 8))
    window = draw(st.sampled_from([0, 1, 3, 8, 128]))
    row_q0 = draw(st.sampled_from(["own", "own", "none", "uniform", "bad"]))
    rows = {"own": [n - t_q for n in own], "none": None, "uniform": [n_max - t_q] * b,
            "bad": [n - t_q + 1 for n in own]}[row_q0]
    raw_prefix = draw(st.sampled_from([0, 0, 0, 1, 5]))
    if raw_prefix:  # the first raw_prefix columns are "already dropped"
        k, v = k[:, :, raw_prefix:], v[:, :, raw_prefix:]
    q_extra = draw(st.sampled_from([0, 0, 0, n_max + 1]))  # more queries than keys: refused
    if q_extra:
        q = rng.normal(size=(b, h, n_max + 1, 8))
    caller = None
    if draw(st.booleans()):
        t_c = 0 if comp is None or ratio <= 1 else comp.shape[2]
        width = draw(st.sampled_from([n_max, n_max + t_c, n_max + 2]))
        caller = np.where(rng.random((q.shape[2], width)) < 0.9, 0.0, -np.inf)
    sinks = rng.normal(size=h) if draw(st.booleans()) else None
    cfg = ref.Dsv4AttentionConfig(ratio, window, raw_prefix, rows)
    return q, k, v, comp, caller, cfg, sinks


def port_cfg(cfg):
    rows = None if cfg.row_q0 is None else torch.tensor(cfg.row_q0, device=DEVICE)
    return port.Dsv4AttentionConfig(cfg.compress_ratio, cfg.sliding_window, cfg.raw_prefix, rows)


@pytest.mark.rule("dsv4_attention, port")
@given(case=dsv4_case())
def test_float64_dsv4_attention_matches_the_reference_including_refusals(case):
    q, k, v, comp, caller, cfg, sinks = case
    p = outcome(port.dsv4_attention, to_port(q), to_port(k), to_port(v), opt(comp), opt(caller),
                port_cfg(cfg), opt(sinks))
    r = outcome(ref.dsv4_attention, q, k, v, comp, caller, cfg, sinks)
    if assert_same_refusal(p, r, "dsv4_attention"):
        assert_close64(p[1], r[1], what="dsv4_attention")


def naive_dsv4(q, k, v, comp, cfg, sinks):
    """Same-dtype dsv4: the reference's (exact) masks and narrowing, the naive attention."""
    t_q = q.shape[2]
    t_k_full = cfg.raw_prefix + k.shape[2]
    window = max(cfg.sliding_window, 1)
    q0 = t_k_full - t_q
    base, keep = ref.raw_keep_span(t_q, window, t_k_full)
    t_c = 0 if comp is None or cfg.compress_ratio <= 1 else comp.shape[2]
    valid = np.concatenate([ref.raw_validity(t_q, q0, base, keep, window),
                            ref.compressed_validity(t_q, q0, t_c, cfg.compress_ratio)], axis=1)
    rows = ref.resolve_ragged_rows(cfg.row_q0, q0, q.shape[0])
    mask = np.where(valid, 0.0, -np.inf)[None, None] if rows is None else \
        ref.ragged_union_mask(rows, q0, valid, base, keep, cfg.compress_ratio, t_c)
    rel = base - cfg.raw_prefix
    kk, vv = k[:, :, rel: rel + keep], v[:, :, rel: rel + keep]
    if t_c:
        kk, vv = torch.cat([kk, comp], 2), torch.cat([vv, comp], 2)
    return naive_attention(q, kk, vv, torch.from_numpy(mask).to(q.device), sinks)


@pytest.mark.rule("dsv4_attention, port")
@LOW
@given(case=dsv4_case())
def test_low_precision_dsv4_attention_is_within_twice_the_naive_error(dtype, case):
    q, k, v, comp, caller, cfg, sinks = (x if x is None or isinstance(x, ref.Dsv4AttentionConfig)
                                         else representable(x, dtype) for x in case)
    r = outcome(ref.dsv4_attention, q, k, v, comp, None, cfg, sinks)
    p = outcome(
        port.dsv4_attention,
        to_port(q, dtype),
        to_port(k, dtype),
        to_port(v, dtype),
        opt(comp, dtype),
        None,
        port_cfg(cfg),
        opt(sinks, dtype),
    )
    if assert_same_refusal(p, r, "dsv4_attention"):
        naive = naive_dsv4(
            to_port(q, dtype),
            to_port(k, dtype),
            to_port(v, dtype),
            opt(comp, dtype),
            cfg,
            opt(sinks, dtype),
        )
        scale = max(
            float(np.abs(v).max()), 0.0 if comp is None else float(np.abs(comp).max()), 1e-30
        )
        assert_dtype_bound(p[1], naive, r[1], dtype, scale, "dsv4_attention")


@pytest.mark.rule("dsv4 uniform path never ragged, port")
@given(case=dsv4_case())
def test_a_uniform_row_q0_never_takes_the_ragged_mask_path(case):
    q, k, v, comp, _caller, cfg, sinks = case
    cfg.raw_prefix = 0
    assume(k.shape[2] >= 1)  # a forward needs at least one key column for its query rows
    if q.shape[2] > k.shape[2]:
        q = q[:, :, : k.shape[2]]
    t_k_full = k.shape[2]
    uniform = ref.Dsv4AttentionConfig(
        cfg.compress_ratio, cfg.sliding_window, 0, [t_k_full - q.shape[2]] * q.shape[0]
    )
    port.reset_dsv4_mask_stats()
    port.dsv4_attention(
        to_port(q), to_port(k), to_port(v), opt(comp), None, port_cfg(uniform), opt(sinks)
    )
    assert port.dsv4_mask_stats == {"uniform": 1, "ragged": 0}


@pytest.mark.rule("dsv4_attention, port")
def test_dsv4_refusal_messages_name_the_values():
    q, k = (
        torch.zeros((1, 1, 5, 4), dtype=torch.float64),
        torch.zeros((1, 1, 3, 4), dtype=torch.float64),
    )
    with pytest.raises(port.MaskRefusal, match="5 query rows against only 3 keys"):
        port.dsv4_attention(q, k, k, None, None, port.Dsv4AttentionConfig(0, 4))
    q1 = torch.zeros((1, 1, 1, 4), dtype=torch.float64)
    with pytest.raises(port.MaskRefusal, match="NOT held: raw_prefix 9 > raw_base 8"):
        port.dsv4_attention(q1, k, k, None, None, port.Dsv4AttentionConfig(0, 4, raw_prefix=9))


# ----------------------------------------------------------------------------- in place


@pytest.mark.rule("dsv4 attention over the in-place layout, port")
@given(
    own=corner_lengths(1, 5, 300, boundaries=False),
    t_q=st.integers(1, 3),
    ratio=compress_ratios(),
    window=st.sampled_from([1, 4, 16, 128]),
    with_sinks=st.booleans(),
    seed=st.integers(0, 2**32 - 1),
    heads=st.sampled_from([(2, 1), (2, 1), (4, 2), (8, 2), (16, 2), (8, 4)]),
)
def test_in_place_attention_equals_the_reference_on_the_front_aligned_batch(
    own, t_q, ratio, window, with_sinks, seed, heads
):
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


@pytest.mark.rule("dsv4 attention over the in-place layout, port")
def test_in_place_attention_refuses_a_row_shorter_than_its_queries():
    kv = RaggedKv(
        torch.zeros((2, 1, 8, 4), dtype=torch.float64),
        torch.zeros((2, 1, 8, 4), dtype=torch.float64),
        torch.tensor([5, 1]),
        4096,
    )
    with pytest.raises(port.MaskRefusal, match="2 query rows against only 1 keys"):
        port.dsv4_attention_in_place(torch.zeros((2, 1, 2, 4), dtype=torch.float64), kv, None, 0, 4)


# The compute dtype and the device: a mask or sinks given in another float dtype are
# converted to the query's compute dtype (masks hold 0 / -inf, exact in every dtype; sinks
# are given exactly representable in float32), and dsv4_attention builds its masks on the
# queries' device (torch's meta device runs on any machine).


@pytest.mark.rule("attention with sinks, port")
def test_mask_and_sinks_are_taken_in_the_compute_dtype():
    rng = np.random.default_rng(11)
    q = torch.from_numpy(rng.standard_normal((2, 2, 3, 4))).float()
    k = torch.from_numpy(rng.standard_normal((2, 1, 5, 4))).float()
    v = torch.from_numpy(rng.standard_normal((2, 1, 5, 4))).float()
    mask = torch.from_numpy(np.where(rng.random((2, 1, 3, 5)) < 0.7, 0.0, -np.inf))
    sinks = torch.tensor([0.5, -1.25])
    want = port.attention(q, k, v, mask.float(), sinks.float())
    got = port.attention(q, k, v, mask, sinks.double())
    assert got.dtype == torch.float32 and torch.equal(got, want)
    empty = port.attention(q, k[:, :, :0], v[:, :, :0], None, sinks.double())
    assert empty.dtype == torch.float32 and torch.equal(empty, torch.zeros_like(empty))
    assert torch.equal(port.attention(q, k[:, :, :0], v[:, :, :0], None), torch.zeros_like(q))


@pytest.mark.rule("dsv4_attention, port")
def test_dsv4_attention_builds_its_masks_on_the_queries_device():
    q, k = torch.zeros((1, 2, 3, 4), device="meta"), torch.zeros((1, 1, 5, 4), device="meta")
    cfg = port.Dsv4AttentionConfig(compress_ratio=4, sliding_window=3)
    for comp in (torch.zeros((1, 1, 2, 4), device="meta"), None):
        out = port.dsv4_attention(q, k, k.clone(), comp, None, cfg)
        assert (out.device.type, tuple(out.shape)) == ("meta", (1, 2, 3, 4))


def refuses(text, fn, *args):
    with pytest.raises(ValueError) as info:
        fn(*args)
    assert str(info.value) == text


@pytest.mark.rule("attention with sinks, port")
def test_attention_refusals_break_one_condition_each():
    z = torch.zeros
    q, k = z((2, 4, 3, 8)), z((2, 2, 5, 8))
    refuses("q [4, 3, 8], k [2, 2, 5, 8], v [2, 2, 5, 8] must all be rank 4",
            port.attention, q[0], k, k, None)
    refuses("q [2, 4, 3, 8], k [2, 5, 8], v [2, 2, 5, 8] must all be rank 4",
            port.attention, q, k[0], k, None)
    refuses("q [2, 4, 3, 8], k [2, 2, 5, 8], v [2, 5, 8] must all be rank 4",
            port.attention, q, k, k[0], None)
    msg = "batch/head-dim mismatch: q [2, 4, 3, 8], k {}"
    refuses(msg.format([1, 2, 5, 8]), port.attention, q, k[:1], k, None)
    refuses(msg.format([2, 2, 5, 8]), port.attention, q, k, k[:1], None)
    refuses(msg.format([2, 2, 5, 4]), port.attention, q, k[..., :4], k, None)
    refuses("k [2, 2, 5, 8] and v [2, 2, 4, 8] must share [B,Hk,t_k]",
            port.attention, q, k, k[:, :, :4], None)
    refuses("KV heads 3 must divide query heads 4", port.attention, q, z((2, 3, 5, 8)),
            z((2, 3, 5, 8)), None)
    refuses("KV heads 0 must divide query heads 4", port.attention, q, z((2, 0, 5, 8)),
            z((2, 0, 5, 8)), None)
    refuses("sinks shape [3] must be [4]", port.attention, q, k, k, None, z(3))


@pytest.mark.rule("attention with sinks, port")
def test_attention_takes_each_rows_own_maximum():
    """A finite additive mask of -5000 on every key of one query row shifts that row's
    logits only: its softmax is unchanged (a max over all rows would underflow it to 0)."""
    rng = np.random.default_rng(4)
    q, k, v = (torch.from_numpy(rng.standard_normal(s)) for s in
               ((1, 1, 2, 4), (1, 1, 5, 4), (1, 1, 5, 4)))
    shift = torch.zeros((1, 1, 2, 5))
    shift[0, 0, 1] = -5000.0
    got, want = port.attention(q, k, v, shift.double()), port.attention(q, k, v, None)
    assert torch.allclose(got, want, rtol=1e-9, atol=0)


@pytest.mark.rule("dsv4_attention, port")
def test_standard_layers_are_the_ratios_0_and_1():
    assert [port.is_standard_layer(r) for r in (0, 1, 2, 4)] == [True, True, False, False]


@pytest.mark.rule("dsv4_attention, port")
def test_dsv4_attention_refusals_break_one_condition_each():
    z = torch.zeros
    q, k = z((2, 4, 3, 8)), z((2, 2, 5, 8))
    cfg = port.Dsv4AttentionConfig(compress_ratio=4, sliding_window=3)
    f = port.dsv4_attention
    for args, rank in (((q[0], k, k), "q [4, 3, 8], k [2, 2, 5, 8], v [2, 2, 5, 8]"),
                       ((q, k[0], k), "q [2, 4, 3, 8], k [2, 5, 8], v [2, 2, 5, 8]"),
                       ((q, k, k[0]), "q [2, 4, 3, 8], k [2, 2, 5, 8], v [2, 5, 8]")):
        refuses(f"{rank} must all be rank 4", f, *args, None, None, cfg)
    msg = "k {} and v {} must both be [B=2,Hk,t_k,D=8]"
    refuses(msg.format([2, 2, 5, 8], [2, 2, 4, 8]), f, q, k, k[:, :, :4], None, None, cfg)
    refuses(msg.format([1, 2, 5, 8], [1, 2, 5, 8]), f, q, k[:1], k[:1], None, None, cfg)
    refuses(msg.format([2, 2, 5, 4], [2, 2, 5, 4]), f, q, k[..., :4], k[..., :4], None, None,
            cfg)
    refuses("KV heads 3 must divide query heads 4", f, q, z((2, 3, 5, 8)), z((2, 3, 5, 8)),
            None, None, cfg)
    for prefix, ratio in ((-1, 4), (0, -1)):
        refuses(f"raw_prefix {prefix} and compress_ratio {ratio} must be >= 0", f, q, k, k, None,
                None, port.Dsv4AttentionConfig(ratio, 3, prefix))
    msg = "compressed_kv {} must be [B=2,2,t_c,D=8]"
    for comp in (z((2, 2, 3)), z((1, 2, 3, 8)), z((2, 1, 3, 8)), z((2, 2, 3, 4))):
        refuses(msg.format(list(comp.shape)), f, q, k, k, comp, None, cfg)


@pytest.mark.rule("dsv4 uniform path never ragged, port")
def test_dsv4_attention_counts_each_mask_path():
    q, k = torch.zeros((2, 2, 1, 4)), torch.zeros((2, 1, 5, 4))
    cfg = port.Dsv4AttentionConfig(compress_ratio=0, sliding_window=3)
    port.reset_dsv4_mask_stats()
    for _ in range(2):
        port.dsv4_attention(q, k, k, None, None, cfg)
        port.dsv4_attention(q, k, k, None, None,
                            port.Dsv4AttentionConfig(0, 3, row_q0=[4, 2]))
    assert port.dsv4_mask_stats == {"uniform": 2, "ragged": 2}


@pytest.mark.rule("dsv4_attention, port")
def test_compressed_keys_are_rounded_to_the_raw_keys_dtype():
    """bfloat16 raw keys with float32 compressed keys: the compressed keys enter as
    bfloat16, exactly as if they had been given in bfloat16."""
    rng = np.random.default_rng(8)
    q = torch.from_numpy(rng.standard_normal((1, 2, 1, 4))).to(torch.bfloat16)
    k = torch.from_numpy(rng.standard_normal((1, 1, 8, 4))).to(torch.bfloat16)
    comp = torch.from_numpy(rng.standard_normal((1, 1, 2, 4))).float()
    cfg = port.Dsv4AttentionConfig(compress_ratio=4, sliding_window=8)
    want = port.dsv4_attention(q, k, k, comp.to(torch.bfloat16), None, cfg)
    assert torch.equal(port.dsv4_attention(q, k, k, comp, None, cfg), want)


@pytest.mark.rule("attention with sinks, port")
def test_low_precision_attention_computes_in_float32():
    """bfloat16 and float16 inputs are computed in float32 and rounded once at the end: the
    result is the float32 computation of the same (exactly widened) inputs, rounded."""
    rng = np.random.default_rng(6)
    for dt in (torch.bfloat16, torch.float16):
        q, k, v = (torch.from_numpy(rng.standard_normal(s)).to(dt) for s in
                   ((1, 2, 3, 8), (1, 1, 6, 8), (1, 1, 6, 8)))
        want = port.attention(q.float(), k.float(), v.float(), None).to(dt)
        assert torch.equal(port.attention(q, k, v, None), want)


@pytest.mark.rule("dsv4 attention over the in-place layout, port")
def test_in_place_refusals_and_the_row_with_exactly_t_q_keys():
    kv = RaggedKv.empty(2, 1, 4, 64, 16, torch.float64)
    kv.lens = [2, 3]
    msg = ("q {} against kv [2, 1, 16, 4]: need [B,H,t_q,D] and [B,Hk,cap,D] with Hk dividing "
           "H")
    for shape in ((2, 2, 2), (3, 2, 2, 4), (2, 2, 2, 8)):
        refuses(msg.format(list(shape)), port.dsv4_attention_in_place,
                torch.zeros(shape, dtype=torch.float64), kv, None, 0, 4)
    kv1 = RaggedKv.empty(2, 2, 4, 64, 16, torch.float64)
    refuses("q [2, 3, 2, 4] against kv [2, 2, 16, 4]: need [B,H,t_q,D] and [B,Hk,cap,D] with "
            "Hk dividing H", port.dsv4_attention_in_place,
            torch.zeros((2, 3, 2, 4), dtype=torch.float64), kv1, None, 0, 4)
    out = port.dsv4_attention_in_place(torch.zeros((2, 1, 2, 4), dtype=torch.float64), kv, None,
                                       0, 4)  # row 0 holds exactly t_q = 2 keys
    assert tuple(out.shape) == (2, 1, 2, 4)
    z = torch.zeros
    refuses("KV heads 0 must divide query heads 4", port.dsv4_attention, z((2, 4, 3, 8)),
            z((2, 0, 5, 8)), z((2, 0, 5, 8)), None, None,
            port.Dsv4AttentionConfig(compress_ratio=4, sliding_window=3))


# Dtypes of what joins the union: the masks are built in the compute dtype (a float64
# caller mask keeps its float64 values), and the compressed keys and values join the raw
# ones in the KV dtype even when the queries compute in a wider one.


@pytest.mark.rule("dsv4_attention, port")
def test_a_float64_caller_mask_keeps_its_float64_values_on_both_mask_paths():
    """Zero queries make the logits the caller mask itself: one query over two keys with
    biases (-0.3, 0.1) weighs v0 = 1 and v1 = -1 by e^-0.3 and e^0.1. Row 1 of the ragged
    batch starts one column later (row_q0 0 of q0 1), so it reads key 1 alone: -1."""
    e0, e1 = math.exp(-0.3), math.exp(0.1)
    mixed = (e0 - e1) / (e0 + e1)
    z = torch.zeros((2, 1, 1, 1), dtype=torch.float64, device=DEVICE)
    k = torch.zeros((2, 1, 2, 1), dtype=torch.float64, device=DEVICE)
    v = torch.tensor([1.0, -1.0], dtype=torch.float64, device=DEVICE).reshape(1, 1, 2, 1)
    v = v.expand(2, 1, 2, 1).contiguous()
    caller = torch.tensor([[-0.3, 0.1]], dtype=torch.float64, device=DEVICE)
    for rows, want in ((None, [mixed, mixed]), ([1, 0], [mixed, -1.0])):
        cfg = port.Dsv4AttentionConfig(compress_ratio=0, sliding_window=8, row_q0=rows)
        got = port.dsv4_attention(z, k, v, None, caller, cfg).reshape(-1).tolist()
        assert got == pytest.approx(want, rel=1e-15, abs=1e-15), rows


@pytest.mark.rule("dsv4_attention, port")
@pytest.mark.parametrize("dtype, compute", [(torch.float16, torch.float32),
                                            (torch.bfloat16, torch.float32),
                                            (torch.float32, torch.float32),
                                            (torch.float64, torch.float64)],
                         ids=["float16", "bfloat16", "float32", "float64"])
def test_the_union_mask_reaches_attention_in_the_compute_dtype(monkeypatch, dtype, compute):
    """Half-precision queries compute in float32, float32 and float64 in their own dtype:
    the 0 / -inf union mask handed to `attention` is built in that dtype on the uniform
    path, the ragged path and the in-place layout."""
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
    kv = RaggedKv(k, k.clone(), [5, 3], max_seq_len=4096)
    port.dsv4_attention_in_place(q, kv, None, 0, 3)
    assert seen == [compute] * 3


@pytest.mark.rule("dsv4_attention, port")
def test_compressed_keys_join_in_the_kv_dtype_under_float64_queries():
    """float64 queries over bfloat16 raw keys and values (distinct) with float64 compressed
    keys: the compressed keys and values enter rounded to bfloat16, exactly as if given in
    bfloat16, in dsv4_attention and in the in-place layout; the float64 output keeps the
    rounding visible."""
    rng = np.random.default_rng(9)
    q = to_port(rng.standard_normal((2, 2, 1, 4)))
    k = to_port(rng.standard_normal((2, 1, 8, 4)), torch.bfloat16)
    v = to_port(rng.standard_normal((2, 1, 8, 4)), torch.bfloat16)
    comp = to_port(rng.standard_normal((2, 1, 2, 4)))
    rounded = comp.to(torch.bfloat16)
    assert not torch.equal(rounded.double(), comp)  # the rounding is there to be seen
    cfg = port.Dsv4AttentionConfig(compress_ratio=4, sliding_window=8)
    want = port.dsv4_attention(q, k, v, rounded, None, cfg)
    assert torch.equal(port.dsv4_attention(q, k, v, comp, None, cfg), want)
    kv = RaggedKv(k, v, [8, 8], max_seq_len=4096)
    want = port.dsv4_attention_in_place(q, kv, rounded, 4, 8)
    assert torch.equal(port.dsv4_attention_in_place(q, kv, comp, 4, 8), want)


@pytest.mark.rule("dsv4_attention, port")
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
