"""The torch port's target forward on its in-place KV layout against the reference's forward on
the front-aligned batch (gpu.model vs reference.model; cache-and-draft.md §6.3; masks §4, §11,
§12). The port model is built from the reference model's own weights, so both compute the same
function; the port keeps every row's KV in place (start-anchored, own length = own RoPE offset).

- float64: logits and pre-norm hidden within 1e-12 (`assert_close64`; the two differ in
  summation order, observed ~1e-15). The KV after a step, materialized front-aligned
  (`gpu.align.materialize_front_aligned`), is bit for bit what it held before ++ the K each
  layer computed and appended (captured as it was handed to `RaggedKv.append`): every value
  landed at its row's own position and nothing else moved; the computed K within 1e-12 of the
  reference's new columns; V == K; lengths exact.
- float32 / bfloat16: the FlashAttention rule, `assert_dtype_bound`: max|port - ref64| <=
  2 * max|naive - ref64| + 4 eps(dtype) * max|ref64|, `naive_forward` below a plain
  same-dtype implementation (each row alone, no upcasting, independent of gpu/ and of
  reference/; itself checked against the reference in float64) and ref64 the float64
  reference on the same dtype-rounded weights and cache. So is `rms_norm` / `silu`'s float32
  computation for the half dtypes, bit for bit.
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

import raggedspec.gpu.model as port
from raggedspec.conformance.helpers import close, front_aligned_batch, in_place_cache, kv_history
from raggedspec.conformance.strategies import forward_cases
from raggedspec.gpu.align import materialize_front_aligned
from raggedspec.gpu.cache import RaggedKv
from raggedspec.gpu.rope import apply_rope, reset_rope_path_stats, rope_path_stats
from raggedspec.gpu.testing import DEVICE, assert_bit_exact, assert_close64, assert_dtype_bound
from raggedspec.gpu.testing import host, representable, to_port
from raggedspec.reference.align import clone_in_cache, clone_out_cache
from raggedspec.reference.cache import KvCache, SingleCache
from raggedspec.reference.model import ModelConfig, TinyModel

MODELS = {"ratios_0_4": TinyModel(),
          "ratios_4_0_3": TinyModel(ModelConfig(compress_ratios=(4, 0, 3), sliding_window=5,
                                                seed=1))}
MODEL = MODELS["ratios_0_4"]
F64 = torch.float64
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
def port_model(name: str, dtype: torch.dtype = F64, rounded_weights: bool = False):
    return port.TinyModel(rounded(name, dtype) if rounded_weights else MODELS[name], dtype, DEVICE)


def ref_kv(cache, layer: int):
    return cache.slots[layer].k.current_data(), cache.slots[layer].v.current_data()


# --- the naive same-precision oracle --------------------------------------------------------------


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
                r = layer.ratio
                raw = _rope(keys[: nb * r], np.arange(nb * r), rd, layer.theta, inverse=True)
                blocks = _rope(raw.reshape(nb, r, hd).mean(dim=1), np.arange(nb) * r, rd,
                               cfg.compress_rope_theta)
                scores = torch.cat([scores, q @ blocks.T / math.sqrt(hd)], dim=-1)
                valid = torch.cat([valid, torch.arange(nb)[None, :] < (qp + 1) // r], dim=-1)
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


# --- float64: port == reference -------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.rule("TinyModel forward on the in-place KV layout, port")
@given(case=forward_cases(tuple(MODELS)))
def test_float64_forward_matches_the_reference(case):
    """1..6 rows of own lengths 1..80, verify windows 1..9, ratios (0, 4) and (4, 0, 3), one
    or two consecutive steps: logits and pre-norm hidden within 1e-12; before the first step
    the port's KV is the reference's batch bit for bit; after each step it is what it held
    before ++ the K each layer appended (a spy on `RaggedKv.append`), that K within 1e-12 of
    the reference's new columns; V == K; every row's length exact."""
    name, lens, steps, seed = case
    model, pm = MODELS[name], port_model(name)
    rng = np.random.default_rng(seed)
    hist = kv_history(model, lens, rng)
    batched, leads = front_aligned_batch(model, hist)
    cache = in_place_cache(model, hist)
    own = list(lens)
    before = [materialize_front_aligned(kv)[0] for kv in cache]
    for layer in range(model.n_layers):
        assert_bit_exact(before[layer], ref_kv(batched, layer)[0], f"layer {layer}: the batch")
    for t in steps:
        new = rng.integers(0, model.cfg.vocab, (len(lens), t))
        want = model.forward(new, batched, own, own, leads)
        appended: list = []
        original = RaggedKv.append

        def spy(kv, k_new, v_new, rows=None, *, log=appended, original=original, **kw):
            log.append((k_new.clone(), v_new.clone()))
            return original(kv, k_new, v_new, rows, **kw)

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
            assert_bit_exact(k, torch.cat([before[layer], k_new], dim=2), f"layer {layer}: moved")
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
    hist = kv_history(model, lens, rng)
    batched, leads = front_aligned_batch(model, hist)
    cache = in_place_cache(model, hist)
    new = rng.integers(0, model.cfg.vocab, (len(lens), t))
    want = model.forward(new, batched, lens, lens, leads)
    got = pm.forward(to_port(new), cache)
    assert_close64(got.logits, want.logits, what="logits")
    assert_close64(got.hidden, want.hidden, what="hidden")
    for layer in range(model.n_layers):
        assert_close64(materialize_front_aligned(cache[layer])[0], ref_kv(batched, layer)[0],
                       what="K")
    naive_logits, naive_hidden, _ = naive_forward(model, hist, new, F64)
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
    pm = port.TinyModel(model, F64, DEVICE)
    rng = np.random.default_rng(sum(lens))
    hist = kv_history(model, lens, rng)
    batched, leads = front_aligned_batch(model, hist)
    cache = in_place_cache(model, hist)
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


@pytest.mark.rule("uniform seqlen offsets in the model forward, port")
def test_a_uniform_batch_never_takes_the_gathered_rope_path():
    """A uniform batch builds the `[1, T]` table (no per-row gather) in every layer; a ragged
    batch the `[B, T]` one (three rotations a layer: q, k, the inverse of o)."""
    for lens, path in (([9, 9, 9], "uniform"), ([9, 4, 9], "gathered")):
        cache = in_place_cache(MODEL, kv_history(MODEL, lens, np.random.default_rng(1)))
        reset_rope_path_stats()
        port_model("ratios_0_4").forward(torch.tensor([[5, 6]] * 3), cache)
        other = "gathered" if path == "uniform" else "uniform"
        assert rope_path_stats[path] == 3 * MODEL.n_layers and rope_path_stats[other] == 0


def one_row_slot(model, k: np.ndarray) -> KvCache:
    """A reference slot holding one row's K (== V) `[n_kv, n, hd]` from column 0."""
    cfg = model.cfg
    data = np.zeros((1, cfg.n_kv_heads, 512, cfg.head_dim))
    data[0, :, : k.shape[1]] = k
    return KvCache(SingleCache(cfg.max_seq_len, 512, k.shape[1], 0, None, data.copy()),
                   SingleCache(cfg.max_seq_len, 512, k.shape[1], 0, None, data.copy()))


def small_table_layer(ref_layer) -> port.DecoderLayer:
    """A port layer whose RoPE tables start at 4 positions, so a table too small shows."""
    return port.DecoderLayer(ref_layer, port.RopeTables(MODEL.cfg.rope_dims, F64, DEVICE, 4), F64,
                             DEVICE)


@pytest.mark.rule("TinyModel forward on the in-place KV layout, port")
@pytest.mark.parametrize("offsets", [[9, 4], torch.tensor([9, 4]), [6], 6])
def test_a_layer_rotates_at_the_offsets_it_is_given_as_the_reference_layer(offsets):
    """`DecoderLayer.forward(..., offsets)`: row r's queries and keys at `offsets[r] + t`
    (one shared offset for a length-1 vector or a plain int), whatever form the offsets
    take, as the reference layer on that row alone; the tables it reads hold every such
    position."""
    rng = np.random.default_rng(29)
    ref_layer = MODEL.layers[0]
    lens, t = [5, 3], 2
    hist = [rng.standard_normal((1, n, 16)) for n in lens]
    x = rng.standard_normal((2, t, 32))
    flat = offsets.tolist() if isinstance(offsets, torch.Tensor) else offsets
    offs = [int(o) for o in np.broadcast_to(np.asarray(flat).reshape(-1), (2,))]
    want = [ref_layer.forward(x[i: i + 1], one_row_slot(MODEL, hist[i]), [offs[i]], None, None)
            for i in range(2)]
    kv = RaggedKv.from_rows([to_port(h) for h in hist], [to_port(h) for h in hist], 4096)
    layer = small_table_layer(ref_layer)
    got = layer.forward(to_port(x), kv, offsets=offsets)
    assert_close64(got, np.concatenate(want, axis=0), what="layer at given offsets")
    assert kv.host_lens().tolist() == [7, 5]
    assert layer.ropes.tables[layer.theta].n_positions >= max(offs) + t


@pytest.mark.rule("TinyModel forward on the in-place KV layout, port")
def test_every_rope_of_a_layer_reads_the_shared_table_of_its_theta():
    """The query, key and inverse output rotations are each one gather from the model's
    shared table of the layer's theta, sized for the rows' offsets + T."""
    rng = np.random.default_rng(31)
    layer = small_table_layer(MODEL.layers[0])
    seen = []

    def spy(x, offsets, rope_dims, theta, inverse=False, table=None, dev_offsets=None):
        seen.append((inverse, table))
        return apply_rope(x, offsets, rope_dims, theta, inverse=inverse, table=table,
                          dev_offsets=dev_offsets)

    layer.rope = spy
    hist = [rng.standard_normal((1, n, 16)) for n in (5, 3)]
    kv = RaggedKv.from_rows([to_port(h) for h in hist], [to_port(h) for h in hist], 4096)
    layer.forward(to_port(rng.standard_normal((2, 2, 32))), kv)
    table = layer.ropes.tables[layer.theta]
    assert [inv for inv, _ in seen] == [False, False, True]
    assert all(t is table for _, t in seen) and table.n_positions == 8  # 5 + 2 positions


# --- float32 / bfloat16 ---------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.rule("TinyModel forward on the in-place KV layout, port")
@LOW
@settings(max_examples=40)
@given(case=forward_cases(tuple(MODELS)))
def test_low_precision_forward_is_within_twice_the_naive_error(dtype, case):
    """Port in dtype vs the float64 reference on the same dtype-rounded weights and cache:
    logits, hidden and the new K within 2x the naive same-dtype error + 4 eps * scale; the
    moved history bit-exact in dtype. (Fewer examples: each runs three models.)"""
    name, lens, steps, seed = case
    ref64, pm = rounded(name, dtype), port_model(name, dtype, True)
    rng = np.random.default_rng(seed)
    hist = kv_history(ref64, lens, rng, dtype)
    batched, leads = front_aligned_batch(ref64, hist)
    cache = in_place_cache(ref64, hist, dtype)
    new = rng.integers(0, ref64.cfg.vocab, (len(lens), steps[0]))
    want = ref64.forward(new, batched, lens, lens, leads)
    got = pm.forward(to_port(new, device=DEVICE), cache)
    assert got.logits.dtype == dtype and cache[0].k.dtype == dtype
    naive_logits, naive_hidden, naive_k = naive_forward(ref64, hist, new, dtype)
    for out, naive, ref, what in ((got.logits, naive_logits, want.logits, "logits"),
                                  (got.hidden, naive_hidden, want.hidden, "hidden")):
        assert_dtype_bound(out, naive, ref, dtype, float(np.abs(ref).max()), what)
    c0 = max(lens)
    for layer in range(ref64.n_layers):
        k, _ = materialize_front_aligned(cache[layer])
        rk = ref_kv(batched, layer)[0]
        assert_bit_exact(k[:, :, :c0], rk[:, :, :c0], f"layer {layer}: moved history in {dtype}")
        port_new = torch.stack([k[i, 0, c0:] for i in range(len(lens))])
        assert_dtype_bound(port_new, naive_k[layer], rk[:, 0, c0:], dtype,
                           float(np.abs(rk).max()), "new K")


def half_inputs(dtype):
    rng = np.random.default_rng(19)
    x = torch.from_numpy(rng.standard_normal((16, 32)) * 3.0).to(dtype)
    gain = torch.from_numpy(1.0 + 0.1 * rng.standard_normal(32)).to(dtype)
    return x, gain


@pytest.mark.rule("the port model's weights, devices and dtypes, port")
def test_rms_norm_and_silu_compute_their_own_formulas_in_the_compute_dtype():
    """float32 for the half dtypes, the input's dtype otherwise; `rms_norm` is
    `x / sqrt(mean(x^2) + eps) * gain`, `silu` is `x / (1 + exp(-x))`, each returned in the
    input's dtype."""
    assert port.compute_dtype(torch.bfloat16) == port.compute_dtype(torch.float16) == torch.float32
    assert port.compute_dtype(F64) == F64 and port.compute_dtype(torch.float32) == torch.float32
    x = torch.tensor([[1.0, 3.0]], dtype=F64)
    got = port.rms_norm(x, torch.tensor([2.0, 1.0], dtype=F64), 0.0)
    assert torch.allclose(got, x / np.sqrt(5.0) * torch.tensor([2.0, 1.0], dtype=F64))
    assert port.rms_norm(x.bfloat16(), torch.ones(2), 0.0).dtype == torch.bfloat16
    y = torch.tensor([0.0, 2.0], dtype=F64)
    assert torch.allclose(port.silu(y), y / (1 + torch.exp(-y)))
    assert port.silu(y.bfloat16()).dtype == torch.bfloat16


@pytest.mark.rule("the port model's weights, devices and dtypes, port")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_rms_norm_and_silu_of_a_half_input_are_the_float32_computation_rounded_once(dtype):
    """On inputs where computing in the half dtype gives other bits: the float32 result,
    rounded once."""
    x, gain = half_inputs(dtype)
    xf, gf = x.float(), gain.float()
    want = (xf / torch.sqrt((xf * xf).mean(dim=-1, keepdim=True) + 1e-6) * gf).to(dtype)
    assert not torch.equal(x / torch.sqrt((x * x).mean(dim=-1, keepdim=True) + 1e-6) * gain, want)
    got = port.rms_norm(x, gain, 1e-6)
    assert got.dtype == dtype and torch.equal(got, want)
    want = (xf / (1.0 + torch.exp(-xf))).to(dtype)
    assert not torch.equal(x / (1.0 + torch.exp(-x)), want)  # the case tells them apart
    got = port.silu(x)
    assert got.dtype == dtype and torch.equal(got, want)


@pytest.mark.rule("the port model's weights, devices and dtypes, port")
def test_rms_norm_computes_with_its_gain_in_the_inputs_compute_dtype():
    """A float64 gain on a float32 input is taken in float32: the float32 computation, not
    a float64 product rounded at the end."""
    rng = np.random.default_rng(23)
    x = torch.from_numpy(rng.standard_normal((16, 32))).float()
    gain = torch.from_numpy(1.0 + 0.1 * rng.standard_normal(32))
    norm = x / torch.sqrt((x * x).mean(dim=-1, keepdim=True) + 1e-6)
    want = norm * gain.float()
    assert not torch.equal((norm * gain).float(), want)  # the case tells them apart
    got = port.rms_norm(x, gain, 1e-6)
    assert got.dtype == torch.float32 and torch.equal(got, want)


# --- masks §22 smoke checks (synthetic_load_smoke.rs fixture: ratios [0,4,128], window 128) ----


SMOKE = TinyModel(ModelConfig(compress_ratios=(0, 4, 128), sliding_window=128, seed=3))
PREFILL_T, DECODE_STEPS = 130, 6


def prefill(tokens: np.ndarray):
    cache = SMOKE.new_cache()
    fw = SMOKE.forward(tokens, cache, [0])
    return cache, fw


def decode(cache, first: np.ndarray, offsets: list[int], row_q0=None, lead_pad=None):
    """DECODE_STEPS greedy steps from `first [B]`; returns the per-step logits `[steps, B, V]`."""
    toks, out, offsets = first.reshape(-1, 1), [], list(offsets)
    for _ in range(DECODE_STEPS):
        fw = SMOKE.forward(toks, cache, offsets, row_q0, lead_pad)
        out.append(fw.logits[:, -1])
        toks = fw.logits[:, -1].argmax(axis=-1).reshape(-1, 1)
        offsets = [o + 1 for o in offsets]
        row_q0 = None if row_q0 is None else list(offsets)
    return np.stack(out)


@pytest.mark.rule("synthetic_load_smoke.rs: batch-mate swap and 2-chain runs equal solo runs")
def test_a_batch_mate_swap_is_bit_identical():
    rng = np.random.default_rng(5)
    a, b, c = (rng.integers(0, SMOKE.cfg.vocab, PREFILL_T) for _ in range(3))
    runs = []
    for mate in (b, c):
        cache, fw = prefill(np.stack([a, mate]))
        runs.append(decode(cache, fw.logits[:, -1].argmax(axis=-1), [PREFILL_T]))
    assert np.max(np.abs(runs[0][:, 0] - runs[1][:, 0])) == 0.0  # row A: exactly 0.0
    assert np.max(np.abs(runs[0][:, 1] - runs[1][:, 1])) > 20 * 1e-12  # teeth: the mates differ


@pytest.mark.rule("synthetic_load_smoke.rs: batch-mate swap and 2-chain runs equal solo runs")
def test_a_two_chain_batch_lockstep_and_shrink_equals_solo_runs():
    rng = np.random.default_rng(6)
    rows = rng.integers(0, SMOKE.cfg.vocab, (2, PREFILL_T))
    solo = []
    for i in range(2):
        cache, fw = prefill(rows[i:i + 1])
        solo.append(decode(cache, fw.logits[:, -1].argmax(axis=-1), [PREFILL_T])[:, 0])
    cache, fw = prefill(rows)
    lock = decode(cache, fw.logits[:, -1].argmax(axis=-1), [PREFILL_T])
    for i in range(2):
        assert close(lock[:, i], solo[i])
    # shrink: the batch splits and row 0 continues alone from its own cache
    alone = clone_out_cache(cache, 2)[0]
    nxt = int(lock[-1, 0].argmax())
    cont = decode(alone, np.array([nxt]), [PREFILL_T + DECODE_STEPS])[:, 0]
    ref_cache, fw = prefill(rows[0:1])
    full = decode(ref_cache, fw.logits[:, -1].argmax(axis=-1), [PREFILL_T])
    more = decode(ref_cache, np.array([int(full[-1, 0].argmax())]), [PREFILL_T + DECODE_STEPS])[
        :, 0
    ]
    assert close(cont, more)


@pytest.mark.rule("synthetic_load_smoke.rs: batch-mate swap and 2-chain runs equal solo runs")
def test_a_merged_ragged_batch_130_97_61_equals_solo_runs():
    """Rows prefilled alone at lens [130, 97, 61], merged by clone_in_cache (front-aligned),
    decoded together with row_q0 = their own positions: each row equals its solo run; with
    row_q0 None the rows whose dead prefix the window reaches differ (teeth > 20 x tol)."""
    lens = [130, 97, 61]
    rng = np.random.default_rng(7)
    ctx = [rng.integers(0, SMOKE.cfg.vocab, n) for n in lens]
    own, firsts = [], []
    for row in ctx:
        cache, fw = prefill(row[None])
        own.append(cache)
        firsts.append(int(fw.logits[0, -1].argmax()))
    solo = [decode(own[i].clone(), np.array([firsts[i]]), [lens[i]])[:, 0] for i in range(3)]
    controls = [c.clone() for c in own]
    merged = clone_in_cache(own, [], False)
    assert merged.lead_pad == [0, 33, 69]
    got = decode(merged.batched, np.array(firsts), lens, list(lens), merged.lead_pad)
    for i in range(3):
        assert close(got[:, i], solo[i]), f"row {i}"
    unmasked = clone_in_cache(controls, [], False)
    bad = decode(unmasked.batched, np.array(firsts), lens, None, unmasked.lead_pad)
    for i in (1, 2):
        assert np.max(np.abs(bad[0, i] - solo[i][0])) > 20 * 1e-12 * max(
            1.0, float(np.max(np.abs(solo[i][0])))
        )
