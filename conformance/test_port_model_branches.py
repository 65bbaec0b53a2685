"""Port conformance: the branches of gpu.model that the model forward does not take or that
only differ in what they hand on. The pooled attention over a compressed layer (query rows
naming rows of a shared buffer, with their start-anchored compressed keys) against the
reference's `dsv4_attention` of each row alone, float64 within 1e-12; its Standard layers,
which ignore compressed keys; the compressed keys joining in the cache's dtype; the float32
computation of `rms_norm` and `silu` for the half dtypes, on inputs where computing in the
half dtype gives other bits; the RoPE tables a layer reads (their size, their dtype, the
offsets it is given); the compressed keys of a cache with no rows and of tables sized
exactly to their width; a Tier A model's missing block; and the row a seqlen-offset
refusal names."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

import raggedspec.gpu.model as port
from raggedspec.gpu.cache import RaggedKv
from raggedspec.gpu.rope import apply_rope
from raggedspec.gpu.testing import DEVICE, assert_bit_exact, assert_close64, host, to_port
from raggedspec.reference.attention import Dsv4AttentionConfig, dsv4_attention
from raggedspec.reference.cache import KvCache, SingleCache
from raggedspec.reference.model import ModelConfig, TinyModel

F64 = torch.float64
MODEL = TinyModel()  # ratios (0, 4), window 16, rope_dims 8, head_dim 16, one KV head
NARROW = TinyModel(ModelConfig(compress_ratios=(4, 0, 3), sliding_window=5, seed=1))


def exact(msg: str) -> str:
    return f"^{re.escape(msg)}$"


def pool(lens, hk, d, rng, dtype=F64) -> tuple[RaggedKv, list[np.ndarray], list[np.ndarray]]:
    """A shared buffer whose row i holds `lens[i]` random K and V entries (V independent of
    K, so a value read from the wrong column shows), and those rows as host arrays."""
    ks = [rng.standard_normal((hk, n, d)) for n in lens]
    vs = [rng.standard_normal((hk, n, d)) for n in lens]
    kv = RaggedKv.from_rows([to_port(k, dtype) for k in ks], [to_port(v, dtype) for v in vs],
                            4096)
    return kv, ks, vs


def each_row_alone(q, ks, vs, rows, comp, ratio, window, sinks) -> np.ndarray:
    """The reference's `dsv4_attention` of every query row on its pool row alone: the row's
    own run as the whole key history, its own compressed keys, the same sinks."""
    out = []
    for g, r in enumerate(rows):
        c = None if comp is None else comp[g: g + 1]
        out.append(dsv4_attention(q[g: g + 1], ks[r][None], vs[r][None], c, None,
                                  Dsv4AttentionConfig(ratio, window), sinks=sinks))
    return np.concatenate(out, axis=0)


# (pool lengths, rows, t_q, window, ratio, KV heads, t_c, sinks): every case has a row with
# exactly t_q keys, rows whose compressed validity differs, t_c unequal to the window's
# width and to the head dim, and blocks both valid and masked
COMPRESSED_CASES = [
    ([9, 14, 2, 23, 6], [3, 0, 2, 1], 2, 3, 4, 1, 5, True),
    ([9, 14, 2, 23, 6], [1, 4], 1, 1, 4, 2, 6, False),
    ([17, 3, 11, 30], [0, 3, 1, 2], 3, 5, 3, 1, 10, True),
    ([40, 8, 25], [2, 1, 0], 2, 16, 4, 2, 3, True),
]


@pytest.mark.rule("dsv4 attention on a subset of a pool's rows, port")
@pytest.mark.parametrize("lens,rows,t_q,window,ratio,hk,t_c,with_sinks", COMPRESSED_CASES)
def test_pooled_attention_over_a_compressed_layer_is_each_rows_reference_attention_alone(
        lens, rows, t_q, window, ratio, hk, t_c, with_sinks):
    """`dsv4_attention_rows` with compressed keys: query row g (on pool row rows[g]) attends
    its own raw window and its own blocks b < floor((qp + 1) / ratio), exactly as the
    reference's `dsv4_attention` of that row alone (float64, 1e-12)."""
    rng = np.random.default_rng(sum(lens) + t_q * 7 + ratio)
    d, h = 8, 2 * hk
    kv, ks, vs = pool(lens, hk, d, rng)
    q = rng.standard_normal((len(rows), h, t_q, d))
    comp = rng.standard_normal((len(rows), hk, t_c, d))
    sinks = rng.standard_normal(h) if with_sinks else None
    got = port.dsv4_attention_rows(to_port(q), kv, torch.tensor(rows), to_port(comp), ratio,
                                   window, None if sinks is None else to_port(sinks))
    want = each_row_alone(q, ks, vs, rows, comp, ratio, window, sinks)
    assert got.dtype == F64
    assert_close64(got, want, what="pooled compressed attention")
    # the compressed keys count: without them the same rows give other values
    plain = each_row_alone(q, ks, vs, rows, None, ratio, window, sinks)
    assert np.abs(plain - want).max() > 1e-6


@pytest.mark.rule("dsv4 attention on a subset of a pool's rows, port")
def test_a_row_with_exactly_t_q_keys_is_attended_not_refused():
    rng = np.random.default_rng(5)
    kv, ks, vs = pool([3, 7], 1, 4, rng)
    q = rng.standard_normal((2, 1, 3, 4))
    got = port.dsv4_attention_rows(to_port(q), kv, [0, 1], None, 0, 4)
    assert_close64(got, each_row_alone(q, ks, vs, [0, 1], None, 0, 4, None), what="t_q keys")


@pytest.mark.rule("dsv4 attention on a subset of a pool's rows, port")
@pytest.mark.parametrize("ratio", [0, 1])
def test_pooled_attention_on_a_standard_layer_ignores_compressed_keys(ratio):
    """A Standard layer (config ratio 0, internal ratio 1) never reads compressed keys: the
    same bits with or without them, the reference's attention without them."""
    rng = np.random.default_rng(11 + ratio)
    kv, ks, vs = pool([9, 5, 12], 1, 8, rng)
    rows = [2, 0]
    q = rng.standard_normal((2, 2, 2, 8))
    sinks = rng.standard_normal(2)
    comp = to_port(rng.standard_normal((2, 1, 3, 8)))
    with_comp = port.dsv4_attention_rows(to_port(q), kv, rows, comp, ratio, 3, to_port(sinks))
    without = port.dsv4_attention_rows(to_port(q), kv, rows, None, ratio, 3, to_port(sinks))
    assert_bit_exact(with_comp, without, "standard layer")
    assert_close64(without, each_row_alone(q, ks, vs, rows, None, ratio, 3, sinks))


@pytest.mark.rule("dsv4 attention on a subset of a pool's rows, port")
def test_pooled_attention_over_a_compressed_layer_without_compressed_keys_is_raw_only():
    """A compressed layer before any row has a complete block gets no compressed keys
    (None): the raw window alone, as the reference's."""
    rng = np.random.default_rng(13)
    kv, ks, vs = pool([3, 2, 3], 1, 8, rng)
    q = rng.standard_normal((2, 2, 2, 8))
    got = port.dsv4_attention_rows(to_port(q), kv, [2, 1], None, 4, 16)
    assert_close64(got, each_row_alone(q, ks, vs, [2, 1], None, 4, 16, None))


@pytest.mark.rule("dsv4 attention on a subset of a pool's rows, port")
@pytest.mark.parametrize("comp_dtype", [torch.float32, torch.float64])
def test_pooled_compressed_keys_join_the_raw_keys_in_the_caches_dtype(comp_dtype):
    """Compressed keys given in another dtype than a bfloat16 cache join the raw keys and
    values rounded to bfloat16: the same bits as passing them rounded."""
    rng = np.random.default_rng(17)
    kv, _, _ = pool([9, 14, 6], 1, 8, rng, torch.bfloat16)
    rows = torch.tensor([1, 0, 2])
    q = to_port(rng.standard_normal((3, 2, 2, 8)), torch.bfloat16)
    sinks = to_port(rng.standard_normal(2), torch.bfloat16)
    comp = to_port(rng.standard_normal((3, 1, 3, 8)), comp_dtype)
    assert not torch.equal(comp.to(torch.bfloat16).to(comp_dtype), comp)  # rounding shows
    got = port.dsv4_attention_rows(q, kv, rows, comp, 4, 3, sinks)
    rounded = port.dsv4_attention_rows(q, kv, rows, comp.to(torch.bfloat16), 4, 3, sinks)
    assert got.dtype == torch.bfloat16
    assert_bit_exact(got, rounded, "compressed keys in the cache's dtype")


# --- rms_norm and silu in float32 for the half dtypes ----------------------------------------


def half_inputs(dtype):
    rng = np.random.default_rng(19)
    x = torch.from_numpy(rng.standard_normal((16, 32)) * 3.0).to(dtype)
    gain = torch.from_numpy(1.0 + 0.1 * rng.standard_normal(32)).to(dtype)
    return x, gain


@pytest.mark.rule("the port model's weights, devices and dtypes, port")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_rms_norm_of_a_half_input_is_the_float32_computation_rounded_once(dtype):
    x, gain = half_inputs(dtype)
    xf, gf = x.float(), gain.float()
    want = (xf / torch.sqrt((xf * xf).mean(dim=-1, keepdim=True) + 1e-6) * gf).to(dtype)
    in_half = x / torch.sqrt((x * x).mean(dim=-1, keepdim=True) + 1e-6) * gain
    assert not torch.equal(in_half, want)  # the case tells the two precisions apart
    got = port.rms_norm(x, gain, 1e-6)
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


@pytest.mark.rule("the port model's weights, devices and dtypes, port")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_silu_of_a_half_input_is_the_float32_computation_rounded_once(dtype):
    x, _ = half_inputs(dtype)
    xf = x.float()
    want = (xf / (1.0 + torch.exp(-xf))).to(dtype)
    assert not torch.equal(x / (1.0 + torch.exp(-x)), want)  # the case tells them apart
    got = port.silu(x)
    assert got.dtype == dtype and torch.equal(got, want)


# --- RoPE tables ------------------------------------------------------------------------------


@pytest.mark.rule("the port model's weights, devices and dtypes, port")
def test_a_rope_table_is_the_first_doubling_of_the_initial_size_that_covers_the_need():
    ropes = port.RopeTables(8, F64, "cpu", n_positions=4)
    assert ropes.get(1.0, 4).n_positions == 4 and ropes.get(2.0, 8).n_positions == 8
    assert ropes.get(3.0, 5).n_positions == 8
    one = port.RopeTables(8, F64, "cpu", n_positions=1)
    assert one.get(1.0, 1).n_positions == 1 and one.get(2.0, 3).n_positions == 4


@pytest.mark.rule("the port model's weights, devices and dtypes, port")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_rope_tables_are_in_the_models_dtype(dtype):
    direct = port.RopeTables(8, dtype, "cpu").get(10.0, 3)
    pm = port.TinyModel(MODEL, dtype)
    assert pm.ropes.dtype == dtype
    for table in (direct, pm.ropes.get(MODEL.layers[0].theta, 5)):
        assert table.cos.dtype == table.sin.dtype == dtype
        assert table.cos.device.type == table.sin.device.type == "cpu"


def one_row_slot(model, k: np.ndarray) -> KvCache:
    """A reference slot holding one row's K (== V) `[n_kv, n, hd]` from column 0."""
    cfg = model.cfg
    data = np.zeros((1, cfg.n_kv_heads, 512, cfg.head_dim))
    data[0, :, : k.shape[1]] = k
    return KvCache(SingleCache(cfg.max_seq_len, 512, k.shape[1], 0, None, data.copy()),
                   SingleCache(cfg.max_seq_len, 512, k.shape[1], 0, None, data.copy()))


def small_table_layer(ref_layer) -> port.DecoderLayer:
    """A port layer whose RoPE tables start at 4 positions, so a table too small shows."""
    return port.DecoderLayer(ref_layer, port.RopeTables(MODEL.cfg.rope_dims, F64, DEVICE, 4),
                             F64, DEVICE)


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

    def spy(x, offsets, rope_dims, theta, inverse=False, table=None):
        seen.append((inverse, table))
        return apply_rope(x, offsets, rope_dims, theta, inverse=inverse, table=table)

    layer.rope = spy
    hist = [rng.standard_normal((1, n, 16)) for n in (5, 3)]
    kv = RaggedKv.from_rows([to_port(h) for h in hist], [to_port(h) for h in hist], 4096)
    layer.forward(to_port(rng.standard_normal((2, 2, 32))), kv)
    table = layer.ropes.tables[layer.theta]
    assert [inv for inv, _ in seen] == [False, False, True]
    assert all(t is table for _, t in seen) and table.n_positions == 8  # 5 + 2 positions


# --- compressed keys --------------------------------------------------------------------------


@pytest.mark.rule("compressed keys per row from the row's own live run, port")
def test_the_compressed_keys_of_a_cache_without_rows_are_none():
    layer = port.TinyModel(MODEL).layers[1]
    assert layer.ratio == 4
    assert layer.compressed_keys(RaggedKv.empty(0, 1, 16, 4096, 8, F64, DEVICE)) is None


@pytest.mark.rule("compressed keys per row from the row's own live run, port")
def test_compressed_keys_read_tables_sized_exactly_to_their_width():
    """Tables holding exactly the `t_c * ratio` positions the compressed keys read are
    enough; the keys are the reference's, row by row (1e-12), zero past a row's blocks."""
    rng = np.random.default_rng(37)
    ref_layer = NARROW.layers[0]
    assert ref_layer.ratio == 4
    lens = [8, 5]
    hist = [rng.standard_normal((1, n, 16)) for n in lens]
    kv = RaggedKv.from_rows([to_port(h) for h in hist], [to_port(h) for h in hist], 4096)
    layer = port.DecoderLayer(ref_layer, port.RopeTables(NARROW.cfg.rope_dims, F64, DEVICE, 4),
                              F64, DEVICE)
    got = layer.compressed_keys(kv)
    assert layer.ropes.tables[layer.theta].n_positions == 8
    for i, h in enumerate(hist):
        n = lens[i] // 4
        assert_close64(got[i: i + 1, :, :n], ref_layer.compressed_keys(h[None], [0]))
        assert not host(got[i, :, n:]).any()


# --- the model ---------------------------------------------------------------------------------


@pytest.mark.rule("the port model's weights, devices and dtypes, port")
def test_a_tier_a_model_has_the_mtp_heads_and_no_block():
    ref = TinyModel(ModelConfig(mtp="heads"))
    pm = port.TinyModel(ref)
    assert pm.mtp is None
    assert torch.equal(pm.mtp_heads.h_proj, torch.from_numpy(ref.mtp_heads.h_proj))
    assert torch.equal(pm.mtp_heads.e_proj, torch.from_numpy(ref.mtp_heads.e_proj))


@pytest.mark.rule("forward layout checks and cache growth, port")
def test_a_seqlen_offset_refusal_names_the_rows_own_offset():
    pm = port.TinyModel(MODEL)
    rng = np.random.default_rng(41)
    cache = []
    for _ in range(2):
        ks = [to_port(rng.standard_normal((1, n, 16))) for n in (6, 4)]
        cache.append(RaggedKv.from_rows(ks, [k.clone() for k in ks], 4096))
    with pytest.raises(ValueError, match=exact(
            "row 1: seqlen offset 5 disagrees with the layout (own length 4)")):
        pm.forward(torch.tensor([[3], [4]]), cache, seqlen_offsets=[6, 5])
