"""Port conformance: the tiny model on the port's in-place KV layout (gpu.model vs
reference.model; cache-and-draft.md §6.3, §10.1; masks-and-scheduling.md §4, §11, §12).

The port model is built from the reference model's own weights (`gpu.model.TinyModel(ref)`),
so both compute the same function; the port keeps every row's KV in place (start-anchored,
own length = own RoPE offset) where the reference front-aligns the batch. What is compared,
and how (gpu/testing.py, DESIGN.md "Comparison policy"):

- logits and pre-norm hidden, float64: `assert_close64`, max|port - ref| <= 1e-12 * max|ref|.
  Both run the same float64 ops; they differ in summation order (torch vs numpy BLAS,
  torch's vectorized cos/sin vs scalar libm in the RoPE tables, the exactly-zero terms of
  the reference's masked dead-prefix columns): observed ~1e-15 relative.
- the KV after the forward: the port's cache is materialized front-aligned
  (`gpu.align.materialize_front_aligned`). Its data movement is checked bit for bit: before
  a step it equals the reference's front-aligned batch (dead-prefix zeros and every row's
  history); after the step it equals exactly (what it held before) ++ (the K each layer
  computed and appended, captured as it was handed to `RaggedKv.append`), so every value
  landed at its row's own position and nothing else moved. The computed K themselves are
  arithmetic: compared with the reference's new columns within 1e-12 in float64 (the
  dtype bound against the naive K in float32/bf16). V == K bit-exact on both sides;
  lengths exact.
- float32 / bfloat16: the FlashAttention rule, `assert_dtype_bound`: max|port - ref64| <=
  2 * max|naive - ref64| + 4 eps(dtype) * max|ref64|, where `naive_forward` below is a plain
  same-dtype implementation (each row alone, no upcasting, independent of gpu/ and of
  reference/) and ref64 the float64 reference on the same dtype-rounded weights and cache.
  `naive_forward` itself is checked against the reference in float64 (1e-12).
"""

from __future__ import annotations

import copy
import functools
import math
from unittest import mock

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import raggedspec.gpu.model as port
from raggedspec.conformance.strategies import corner_lengths
from raggedspec.gpu.align import materialize_front_aligned
from raggedspec.gpu.cache import RaggedKv
from raggedspec.gpu.rope import reset_rope_path_stats, rope_path_stats
from raggedspec.gpu.testing import (
    DEVICE,
    assert_bit_exact,
    assert_close64,
    assert_dtype_bound,
    assert_same_refusal,
    host,
    outcome,
    representable,
    to_port,
)
from raggedspec.reference.cache import KvCache, NormalCache, SingleCache
from raggedspec.reference.dispatch import MtpHiddenCapture
from raggedspec.reference.draft import extend_draft_cache
from raggedspec.reference.errors import CacheRefusal, DispatchRefusal, MaskRefusal
from raggedspec.reference.model import ModelConfig, TinyModel

MODEL = TinyModel()  # ratios (0, 4), window 16
NARROW = TinyModel(ModelConfig(compress_ratios=(4, 0, 3), sliding_window=5, seed=1))
MODELS = {"ratios_0_4": MODEL, "ratios_4_0_3": NARROW}
LOW = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])


@functools.cache
def rounded(name: str, dtype: torch.dtype) -> TinyModel:
    """A copy of MODELS[name] whose every weight is rounded to `dtype` (in place, so the
    MTP block's shared embed / lm_head / heads stay shared)."""
    m = copy.deepcopy(MODELS[name])
    for obj in [m, *m.layers, m.mtp_heads, m.mtp, m.mtp.layer]:
        for value in vars(obj).values():
            if isinstance(value, np.ndarray) and value.dtype == np.float64:
                value[...] = representable(value, dtype)
    return m


@functools.cache
def port_model(
    name: str, dtype: torch.dtype = torch.float64, rounded_weights: bool = False
) -> port.TinyModel:
    ref = rounded(name, dtype) if rounded_weights else MODELS[name]
    return port.TinyModel(ref, dtype, DEVICE)


# --- the two layouts, built here from the same per-row history ------------------------------


def history(model: TinyModel, lens: list[int], rng, dtype=torch.float64) -> list[list[np.ndarray]]:
    """`hist[layer][i]`: row i's cached K (== V) `[lens[i], head_dim]` (`[n_kv_heads, lens[i],
    head_dim]` for a model with several KV heads), representable in dtype."""
    d, hk = model.cfg.head_dim, model.cfg.n_kv_heads
    return [[representable(rng.standard_normal((n, d) if hk == 1 else (hk, n, d)), dtype)
             for n in lens] for _ in model.layers]


def ref_batched(model: TinyModel, hist) -> tuple[NormalCache, list[int]]:
    """The reference's front-aligned batch: row i's run ends at column C = max(lens), zeros in
    front (its lead), capacity 512 (the plain cache's)."""
    lens = [h.shape[-2] for h in hist[0]]
    c = max(lens)
    if c == 0:
        return model.new_cache(), [0] * len(lens)
    slots = []
    for rows in hist:
        data = np.zeros((len(lens), model.cfg.n_kv_heads, 512, model.cfg.head_dim))
        for i, h in enumerate(rows):
            data[i, :, c - h.shape[-2]: c] = h
        slots.append(KvCache(SingleCache(model.cfg.max_seq_len, 512, c, 0, None, data.copy()),
                             SingleCache(model.cfg.max_seq_len, 512, c, 0, None, data.copy())))
    return NormalCache(slots), [c - n for n in lens]


def port_cache(model: TinyModel, hist, dtype=torch.float64) -> list[RaggedKv]:
    """The port's in-place rows: row i's K at columns [0, lens[i])."""
    out = []
    for rows in hist:
        ks = [to_port(h if h.ndim == 3 else h[None], dtype) for h in rows]
        out.append(RaggedKv.from_rows(ks, [k.clone() for k in ks], model.cfg.max_seq_len))
    return out


def ref_kv(cache: NormalCache, layer: int) -> tuple[np.ndarray, np.ndarray]:
    return cache.slots[layer].k.current_data(), cache.slots[layer].v.current_data()


# --- the naive same-precision oracle ---------------------------------------------------------


def _rms(x, g, eps):
    return x / torch.sqrt((x * x).mean(dim=-1, keepdim=True) + eps) * g


def _rope(x, pos, rope_dims, theta, inverse=False):
    """Rotate the last rope_dims dims of `x [..., T, D]` (interleaved pairs) at `pos [T]`;
    cos/sin computed in float64 and rounded to x's dtype."""
    ang = np.asarray(pos, dtype=np.float64)[:, None] * np.array(
        [theta ** (-(2.0 * k) / rope_dims) for k in range(rope_dims // 2)])
    c = torch.from_numpy(np.cos(ang)).to(x.dtype)
    s = torch.from_numpy(np.sin(ang)).to(x.dtype) * (-1 if inverse else 1)
    d = x.shape[-1]
    even, odd = x[..., d - rope_dims::2], x[..., d - rope_dims + 1::2]
    rot = torch.stack([even * c - odd * s, even * s + odd * c], dim=-1).flatten(-2)
    return torch.cat([x[..., : d - rope_dims], rot], dim=-1)


def naive_forward(model: TinyModel, hist, toks: np.ndarray, dtype: torch.dtype):
    """Each row alone, plain ops in `dtype`: `(logits [B,T,V], hidden [B,T,H], new_k
    [layer][B,T,hd])`. Row i's queries sit at its own positions `n_i + t`; its keys are its
    history plus this step's; raw key kp valid iff `qp - window < kp <= qp`; compressed block
    j (mean of the row's un-rotated keys `j*r .. j*r+r-1`, rotated at `j*r`) valid iff
    `j < (qp + 1) // r`; sinks join the softmax denominator."""
    cfg = model.cfg
    w = lambda a: torch.from_numpy(np.asarray(a, dtype=np.float64)).to(dtype)  # noqa: E731
    nh, hd, rd, eps = cfg.n_heads, cfg.head_dim, cfg.rope_dims, cfg.eps
    window = max(cfg.sliding_window, 1)
    logits, hidden, new_k = [], [], [[] for _ in model.layers]
    for i in range(toks.shape[0]):
        n, t = len(hist[0][i]), toks.shape[1]
        pos = np.arange(n, n + t)
        qp = torch.from_numpy(pos)[:, None]
        x = w(model.embed)[torch.from_numpy(toks[i])]
        for li, layer in enumerate(model.layers):
            h = _rms(x, w(layer.attn_norm), eps)
            q = _rms((h @ w(layer.wq)).reshape(t, nh, hd).transpose(0, 1), w(layer.q_norm), eps)
            q = _rope(q, pos, rd, layer.theta)
            k = _rope(_rms(h @ w(layer.wkv), w(layer.kv_norm), eps), pos, rd, layer.theta)
            new_k[li].append(k)
            keys = torch.cat([w(hist[li][i]), k])
            kp = torch.arange(n + t)[None, :]
            valid = (kp <= qp) & (kp > qp - window)
            scores = q @ keys.T / math.sqrt(hd)
            vals = keys
            nb = (n + t) // layer.ratio if layer.ratio else 0
            if nb:
                raw = _rope(
                    keys[: nb * layer.ratio],
                    np.arange(nb * layer.ratio),
                    rd,
                    layer.theta,
                    inverse=True,
                )
                blocks = _rope(
                    raw.reshape(nb, layer.ratio, hd).mean(dim=1),
                    np.arange(nb) * layer.ratio,
                    rd,
                    cfg.compress_rope_theta,
                )
                scores = torch.cat([scores, q @ blocks.T / math.sqrt(hd)], dim=-1)
                valid = torch.cat(
                    [valid, torch.arange(nb)[None, :] < (qp + 1) // layer.ratio], dim=-1
                )
                vals = torch.cat([keys, blocks])
            scores = scores.masked_fill(~valid, float("-inf"))
            sink = w(layer.sinks)[:, None, None]
            m = torch.maximum(scores.amax(dim=-1, keepdim=True), sink)
            p = torch.exp(scores - m)
            o = (p @ vals) / (p.sum(dim=-1, keepdim=True) + torch.exp(sink - m))
            o = _rope(o, pos, rd, layer.theta, inverse=True)
            x = x + o.transpose(0, 1).reshape(t, nh * hd) @ w(layer.wo)
            mm = _rms(x, w(layer.mlp_norm), eps)
            x = x + (lambda z: z / (1 + torch.exp(-z)))(mm @ w(layer.w_up)) @ w(layer.w_down)
        hidden.append(x)
        logits.append(_rms(x, w(model.norm), eps) @ w(model.lm_head))
    return torch.stack(logits), torch.stack(hidden), [torch.stack(k) for k in new_k]


# --- float64: port == reference -----------------------------------------------------------------


@st.composite
def forward_case(draw):
    name = draw(st.sampled_from(sorted(MODELS)))
    lens = draw(corner_lengths(1, 6, 80, boundaries=False))
    ts = draw(st.lists(st.integers(1, 9), min_size=1, max_size=2))
    return name, lens, ts, draw(st.integers(0, 2**32 - 1))


@pytest.mark.rule("TinyModel forward on the in-place KV layout, port")
@given(case=forward_case())
def test_float64_forward_matches_the_reference(case):
    """1..6 rows of own lengths 1..80, verify windows 1..9, ratios (0, 4) and (4, 0, 3), one
    or two consecutive steps: logits and pre-norm hidden within 1e-12. The KV, materialized
    front-aligned after each step, is bit for bit (what it held before the step) ++ (the K
    each layer computed and appended this step, captured by a spy on `RaggedKv.append`),
    i.e. the data movement is exact; before the first step it is the reference's batch bit
    for bit; the computed K equals the reference's new columns within 1e-12; V == K; every
    row's length exact."""
    name, lens, ts, seed = case
    model, pm = MODELS[name], port_model(name)
    rng = np.random.default_rng(seed)
    hist = history(model, lens, rng)
    batched, leads = ref_batched(model, hist)
    cache = port_cache(model, hist)
    own = list(lens)
    before = [materialize_front_aligned(kv)[0] for kv in cache]
    for layer in range(model.n_layers):
        assert_bit_exact(
            before[layer], ref_kv(batched, layer)[0], f"layer {layer}: the batch before the step"
        )
    for t in ts:
        new = rng.integers(0, model.cfg.vocab, (len(lens), t))
        want = model.forward(new, batched, own, own, leads)
        appended: list = []
        original = RaggedKv.append

        def spy(kv, k_new, v_new, rows=None, *, log=appended, original=original):
            log.append((k_new.clone(), v_new.clone()))
            return original(kv, k_new, v_new, rows)

        with mock.patch.object(RaggedKv, "append", spy):
            got = pm.forward(to_port(new), cache, seqlen_offsets=torch.tensor(own))
        assert_close64(got.logits, want.logits, what="logits")
        assert_close64(got.hidden, want.hidden, what="pre-norm hidden")
        own = [n + t for n in own]
        assert len(appended) == model.n_layers
        for layer, (k_new, v_new) in enumerate(appended):
            assert host(cache[layer].lens).tolist() == own
            k, v = materialize_front_aligned(cache[layer])
            rk, rv = ref_kv(batched, layer)
            assert_bit_exact(v_new, k_new, "V == K appended")
            assert_bit_exact(v, k, "port V == K")
            assert np.array_equal(rv, rk)
            assert_bit_exact(
                k, torch.cat([before[layer], k_new], dim=2), f"layer {layer}: moved, not recomputed"
            )
            assert_close64(k_new, rk[:, :, -t:], what=f"layer {layer}: computed K")
        before = [materialize_front_aligned(kv)[0] for kv in cache]


@pytest.mark.rule("TinyModel forward on the in-place KV layout, port")
@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("lens,t", [([0, 0, 0], 9), ([0, 7, 13], 3), ([10, 8, 5], 2), ([33], 1)])
def test_prefills_and_a_zero_length_row_match_the_reference(name, lens, t):
    """Fresh prompts (every row at offset 0: compressed keys from scratch), a batch with an
    empty row, the repository's ragged fixture lens [10, 8, 5] with t_q 2, a single row.
    Also checks the naive oracle in float64 against the reference (1e-12)."""
    model, pm = MODELS[name], port_model(name)
    rng = np.random.default_rng(sum(lens) + t)
    hist = history(model, lens, rng)
    batched, leads = ref_batched(model, hist)
    cache = port_cache(model, hist)
    new = rng.integers(0, model.cfg.vocab, (len(lens), t))
    want = model.forward(new, batched, lens, lens, leads)
    got = pm.forward(to_port(new), cache)
    assert_close64(got.logits, want.logits, what="logits")
    assert_close64(got.hidden, want.hidden, what="hidden")
    for layer in range(model.n_layers):
        assert_close64(
            materialize_front_aligned(cache[layer])[0], ref_kv(batched, layer)[0], what="K"
        )
    naive_logits, naive_hidden, _ = naive_forward(model, hist, new, torch.float64)
    assert_close64(naive_logits, want.logits, what="naive oracle logits")
    assert_close64(naive_hidden, want.hidden, what="naive oracle hidden")


GQA_MODELS = {
    f"{h}_heads_{hk}_kv": TinyModel(ModelConfig(n_heads=h, n_kv_heads=hk, compress_ratios=ratios,
                                                sliding_window=5, seed=h))
    for h, hk, ratios in ((4, 2, (0, 4)), (8, 2, (4, 0)), (16, 2, (0, 4)), (8, 4, (4, 0, 3)))
}


@pytest.mark.rule("end to end with several KV heads")
@pytest.mark.parametrize("name", sorted(GQA_MODELS))
@pytest.mark.parametrize("lens", [[0, 0], [10, 8, 5], [3, 17]])
def test_a_gqa_forward_matches_the_reference(name, lens):
    """Several KV heads (GQA ratios 2, 4, 8; compressed layers): two steps on ragged rows,
    logits and hidden within 1e-12, every layer's K `[B, n_kv_heads, T, D]` within 1e-12 of
    the reference's front-aligned batch."""
    model = GQA_MODELS[name]
    pm = port.TinyModel(model, torch.float64, DEVICE)
    rng = np.random.default_rng(sum(lens))
    hist = history(model, lens, rng)
    batched, leads = ref_batched(model, hist)
    cache = port_cache(model, hist)
    own = list(lens)
    for t in (3, 1):
        new = rng.integers(0, model.cfg.vocab, (len(lens), t))
        want = model.forward(new, batched, own, own, leads)
        got = pm.forward(to_port(new), cache)
        assert_close64(got.logits, want.logits, what="logits")
        assert_close64(got.hidden, want.hidden, what="hidden")
        own = [n + t for n in own]
        for layer in range(model.n_layers):
            k = materialize_front_aligned(cache[layer])[0]
            assert k.shape[1] == model.cfg.n_kv_heads
            assert_close64(k, ref_kv(batched, layer)[0], what=f"layer {layer} K")


@pytest.mark.rule("forward layout checks and cache growth, port")
def test_the_empty_caches_have_the_models_kv_heads():
    """`TinyModel.new_cache` and `MtpBlock.new_draft_cache`: empty `[B, n_kv_heads, cap,
    head_dim]` buffers (capacity 512 and 16), every row at length 0."""
    for model in (MODEL, GQA_MODELS["8_heads_2_kv"]):
        pm, hk, hd = port.TinyModel(model), model.cfg.n_kv_heads, model.cfg.head_dim
        for kv in pm.new_cache(3):
            assert tuple(kv.k.shape) == tuple(kv.v.shape) == (3, hk, 512, hd)
            assert host(kv.lens).tolist() == [0, 0, 0]
        draft = pm.mtp.new_draft_cache(2)
        assert tuple(draft.k.shape) == (2, hk, 16, hd) and host(draft.lens).tolist() == [0, 0]


# --- float32 / bfloat16: the FlashAttention bound
# --------------------------------------------------


@pytest.mark.rule("TinyModel forward on the in-place KV layout, port")
@LOW
@settings(max_examples=40)
@given(case=forward_case())
def test_low_precision_forward_is_within_twice_the_naive_error(dtype, case):
    """Port in dtype vs the float64 reference on the same dtype-rounded weights and cache:
    logits, hidden and the new K within 2x the naive same-dtype error + 4 eps * scale; the
    moved history bit-exact in dtype. (Lower max_examples: each example runs three models.)"""
    name, lens, ts, seed = case
    ref64, pm = rounded(name, dtype), port_model(name, dtype, True)
    rng = np.random.default_rng(seed)
    hist = history(ref64, lens, rng, dtype)
    batched, leads = ref_batched(ref64, hist)
    cache = port_cache(ref64, hist, dtype)
    new = rng.integers(0, ref64.cfg.vocab, (len(lens), ts[0]))
    want = ref64.forward(new, batched, lens, lens, leads)
    got = pm.forward(to_port(new, device=DEVICE), cache)
    assert got.logits.dtype == dtype and cache[0].k.dtype == dtype
    naive_logits, naive_hidden, naive_k = naive_forward(ref64, hist, new, dtype)
    assert_dtype_bound(
        got.logits, naive_logits, want.logits, dtype, float(np.abs(want.logits).max()), "logits"
    )
    assert_dtype_bound(
        got.hidden, naive_hidden, want.hidden, dtype, float(np.abs(want.hidden).max()), "hidden"
    )
    c0 = max(lens)
    for layer in range(ref64.n_layers):
        k, _ = materialize_front_aligned(cache[layer])
        rk = ref_kv(batched, layer)[0]
        assert_bit_exact(k[:, :, :c0], rk[:, :, :c0], f"layer {layer}: moved history in {dtype}")
        port_new = torch.stack([k[i, 0, c0:] for i in range(len(lens))])
        assert_dtype_bound(
            port_new, naive_k[layer], rk[:, 0, c0:], dtype, float(np.abs(rk).max()), "new K"
        )


# --- dispatch, pieces and refusals ---------------------------------------------------------------


@pytest.mark.rule("uniform seqlen offsets in the model forward, port")
def test_a_uniform_batch_never_takes_the_gathered_rope_path():
    """A uniform batch builds the `[1, T]` table (no per-row gather) in every layer; a
    ragged batch the `[B, T]` one."""
    for lens, path in (([9, 9, 9], "uniform"), ([9, 4, 9], "gathered")):
        hist = history(MODEL, lens, np.random.default_rng(1))
        cache = port_cache(MODEL, hist)
        reset_rope_path_stats()
        port_model("ratios_0_4").forward(torch.tensor([[5, 6]] * 3), cache)
        other = "gathered" if path == "uniform" else "uniform"
        assert (
            rope_path_stats[path] == 3 * MODEL.n_layers and rope_path_stats[other] == 0
        )  # q, k, inverse o


@pytest.mark.rule("compressed keys per row from the row's own live run, port")
@given(lens=corner_lengths(1, 5, 60, boundaries=False), seed=st.integers(0, 2**32 - 1))
def test_compressed_keys_are_start_anchored_per_row_as_the_reference(lens, seed):
    """`DecoderLayer.compressed_keys` on the in-place rows == the reference's on the
    front-aligned batch (1e-12); blocks past a row's own count are exactly 0; None when no
    row has a complete block."""
    layer_ref = NARROW.layers[0]
    assert layer_ref.ratio == 4
    hist = history(NARROW, lens, np.random.default_rng(seed))
    batched, leads = ref_batched(NARROW, hist)
    kv = port_cache(NARROW, hist)[0]
    got = port_model("ratios_4_0_3").layers[0].compressed_keys(kv)
    want = layer_ref.compressed_keys(ref_kv(batched, 0)[0], leads)
    if want is None:
        assert got is None and max(lens) < 4
        return
    assert_close64(got, want, what="compressed keys")
    for i, n in enumerate(lens):
        assert not host(got[i, 0, n // 4:]).any()


@pytest.mark.rule("dsv4 attention on a subset of a pool's rows, port")
@given(pool=corner_lengths(2, 6, 40, boundaries=False), t_q=st.integers(1, 3), data=st.data())
def test_attention_on_pool_rows_equals_in_place_attention_on_those_rows(pool, t_q, data):
    """`dsv4_attention_rows` on a subset of a pool's rows (only their windows gathered) ==
    `dsv4_attention_in_place` on a cache holding just those rows, bit for bit, with one KV
    head or several (every KV head of a row gathered)."""
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    lens = [n + t_q for n in pool]
    rows = data.draw(
        st.lists(st.integers(0, len(lens) - 1), min_size=1, max_size=len(lens), unique=True)
    )
    hk = data.draw(st.sampled_from([1, 2, 4]))
    kv = RaggedKv.from_rows([to_port(rng.standard_normal((hk, n, 8))) for n in lens],
                            [to_port(rng.standard_normal((hk, n, 8))) for n in lens], 4096)
    sub = RaggedKv(kv.k[rows], kv.v[rows], kv.lens[rows], 4096)
    q = to_port(rng.standard_normal((len(rows), 2 * hk, t_q, 8)))
    sinks = to_port(rng.standard_normal(2 * hk))
    window = data.draw(st.sampled_from([1, 3, 16]))
    got = port.dsv4_attention_rows(q, kv, torch.tensor(rows), None, 0, window, sinks)
    want = port.dsv4_attention_in_place(q, sub, None, 0, window, sinks)
    assert_bit_exact(got, want, "pool rows")


@pytest.mark.rule("dsv4 attention on a subset of a pool's rows, port")
def test_attention_on_pool_rows_refuses_a_row_shorter_than_its_queries():
    kv = RaggedKv(
        torch.zeros((3, 1, 8, 4), dtype=torch.float64),
        torch.zeros((3, 1, 8, 4), dtype=torch.float64),
        torch.tensor([5, 1, 7]),
        4096,
    )
    with pytest.raises(MaskRefusal, match="2 query rows against only 1 keys"):
        port.dsv4_attention_rows(
            torch.zeros((2, 1, 2, 4), dtype=torch.float64), kv, torch.tensor([2, 1]), None, 0, 4
        )


@pytest.mark.rule("forward layout checks and cache growth, port")
def test_forward_refuses_inconsistent_layouts_and_tokens():
    hist = history(MODEL, [6, 4], np.random.default_rng(2))
    pm = port_model("ratios_0_4")
    cache = port_cache(MODEL, hist)
    with pytest.raises(ValueError, match="row 1: seqlen offset 6 disagrees with the layout"):
        pm.forward(torch.tensor([[3], [4]]), cache, seqlen_offsets=[6])
    with pytest.raises(ValueError, match="seqlen offsets for a batch of"):
        pm.forward(torch.tensor([[3], [4]]), cache, seqlen_offsets=[6, 4, 4])
    with pytest.raises(ValueError, match="tokens must be in"):
        pm.forward(torch.tensor([[3], [64]]), cache)
    cache[1].lens = torch.tensor([6, 5])
    with pytest.raises(ValueError, match="disagrees with a batch of 2"):
        pm.forward(torch.tensor([[3], [4]]), cache)


@pytest.mark.rule("forward layout checks and cache growth, port")
def test_growth_past_max_seq_len_is_refused_by_both_with_the_same_message():
    """Rows at 510 and 300 feeding 5 tokens into a 512-column cache with max_seq_len 512:
    the append's growth to 1024 is refused by both (CacheRefusal, same message)."""
    small = TinyModel(ModelConfig(max_seq_len=512))
    hist = history(small, [510, 300], np.random.default_rng(3))
    batched, leads = ref_batched(small, hist)
    new = np.ones((2, 5), dtype=np.int64)
    r = outcome(small.forward, new, batched, [510, 300], [510, 300], leads)
    p = outcome(port.TinyModel(small).forward, to_port(new), port_cache(small, hist))
    assert r[0] == "refused" and r[1] is CacheRefusal
    assert_same_refusal(p, r, "growth")


@pytest.mark.rule("MtpHiddenCapture of the pre-norm hidden, port")
def test_forward_captures_the_pre_norm_hidden_at_every_rows_own_offset():
    cap = MtpHiddenCapture()
    cap.arm()
    cache = port_cache(MODEL, history(MODEL, [6, 4], np.random.default_rng(4)))
    f = port_model("ratios_0_4").forward(torch.tensor([[3, 1], [4, 1]]), cache, capture=cap)
    offsets, hidden = cap.take()
    assert offsets.values == (6, 4)
    assert_bit_exact(hidden, f.hidden, "captured hidden")
    assert not torch.equal(
        port.rms_norm(f.hidden, port_model("ratios_0_4").norm, MODEL.cfg.eps), f.hidden
    )


# --- the MTP block
# -----------------------------------------------------------------------------------


def ref_draft_cache(n: int, rng) -> tuple[KvCache, np.ndarray, np.ndarray]:
    h, nxt = rng.standard_normal((n, MODEL.cfg.hidden)), rng.integers(0, MODEL.cfg.vocab, n)
    cache = MODEL.mtp.new_draft_cache()
    extend_draft_cache(MODEL.mtp, cache, h, nxt, 0)
    return cache, h, nxt


@pytest.mark.rule("MTP block fuse / logits / forward_tokens_rows, port")
def test_fuse_and_logits_match_the_reference():
    rng = np.random.default_rng(5)
    h, toks = rng.standard_normal((3, 2, 32)), rng.integers(0, 64, (3, 2))
    block = port_model("ratios_0_4").mtp
    assert_close64(
        block.fuse(to_port(h), torch.from_numpy(toks)), MODEL.mtp.fuse(h, toks), what="fuse"
    )
    assert_close64(block.logits(to_port(h)), MODEL.mtp.logits(h), what="mtp logits")
    with pytest.raises(ValueError, match="disagree"):
        block.fuse(to_port(h), torch.from_numpy(toks[:, :1]))


@pytest.mark.rule("MTP block fuse / logits / forward_tokens_rows, port")
@given(held=st.integers(1, 20), start=st.integers(0, 22), g=st.integers(1, 3), t=st.integers(1, 3),
       seed=st.integers(0, 2**32 - 1))
def test_the_mtp_step_matches_the_reference_including_the_desync_refusal(held, start, g, t, seed):
    """`forward_tokens` on G rows holding `held` entries at `start`: refused by both
    ("desync", same message) unless `start == held`; else the same hidden (1e-12) and the
    same new draft-KV entries (1e-12), the history untouched (bit-exact)."""
    rng = np.random.default_rng(seed)
    caches = [ref_draft_cache(held, rng)[0] for _ in range(g)]
    batched = KvCache.new_normal(4096, 16)
    batched.k.data = np.concatenate([c.k.data for c in caches])
    batched.v.data = np.concatenate([c.v.data for c in caches])
    for half, src in ((batched.k, caches[0].k), (batched.v, caches[0].v)):
        half.capacity_seq_len, half.current_seq_len = src.capacity_seq_len, src.current_seq_len
    kv = RaggedKv.from_rows([to_port(c.k.current_data()[0]) for c in caches],
                            [to_port(c.v.current_data()[0]) for c in caches], 4096)
    fused = MODEL.mtp.fuse(rng.standard_normal((g, t, 32)), rng.integers(0, 64, (g, t)))
    r = outcome(MODEL.mtp.forward_tokens, fused, start, batched)
    p = outcome(port_model("ratios_0_4").mtp.forward_tokens, to_port(fused), start, kv)
    if assert_same_refusal(p, r, "mtp step"):
        assert_close64(p[1], r[1], what="mtp hidden")
        k, _ = materialize_front_aligned(kv)
        assert_bit_exact(k[:, :, :held], batched.k.current_data()[:, :, :held], "draft history")
        assert_close64(k[:, :, held:], batched.k.current_data()[:, :, held:], what="new draft K")
    else:
        assert r[1] is DispatchRefusal and "desync" in r[2]


@pytest.mark.rule("MTP block fuse / logits / forward_tokens_rows, port")
def test_the_mtp_step_refuses_what_the_reference_refuses_and_a_per_row_desync():
    rng = np.random.default_rng(6)
    block = port_model("ratios_0_4").mtp
    kv = RaggedKv.from_rows([to_port(rng.standard_normal((1, n, 16))) for n in (7, 4)],
                            [to_port(rng.standard_normal((1, n, 16))) for n in (7, 4)], 4096)
    fused = to_port(rng.standard_normal((2, 1, 32)))
    with pytest.raises(DispatchRefusal, match="3 absolute position"):
        block.forward_step_rows(fused, [7, 4, 4], kv)
    with pytest.raises(DispatchRefusal, match="given no absolute position at all"):
        block.forward_step_rows(fused, [], kv)
    with pytest.raises(
        DispatchRefusal,
        match="cache holds 7 entries but the step's rows end at absolute position 6",
    ):
        block.forward_step_rows(fused, [6, 4], kv)
    # port only: the max agrees but a row's own length is not its start
    with pytest.raises(
        DispatchRefusal,
        match="draft row 1 holds 4 entries but its step starts at absolute position 3",
    ):
        block.forward_step_rows(fused, [7, 3], kv)
    with pytest.raises(
        DispatchRefusal,
        match="draft row 1 holds 4 entries but its step starts at absolute position 7",
    ):
        block.forward_step(fused, 7, kv)
    assert kv.lens.tolist() == [7, 4]  # refused before anything was appended
    block.forward_step_rows(fused, [7, 4], kv)
    assert kv.lens.tolist() == [8, 5]
