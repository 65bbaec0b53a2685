"""The tiny model's pieces (cache-and-draft.md §10.1, §17.2; masks-and-scheduling.md §4, §5, §12;
docs/simulator.md, "reference/model.py"): one decoder layer against an oracle written here from
its documented steps, the start-anchored compressed keys of every row (the reference on the
front-aligned batch and the torch port on its in-place rows, one body), the port's attention
over some rows of a shared buffer (`gpu.model.dsv4_attention_rows`) against the reference's
attention of each row alone, and the MTP block (`fuse`, `logits`, `forward_tokens_rows` and its
wrappers) on both.

Tolerance: float64 within `1e-12 * max(1, max|x|)` (`helpers.close`) or `assert_close64`
where the two sides sum in another order; bit equality where they run the same operations.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import raggedspec.gpu.model as port
from raggedspec.conformance.helpers import close, front_aligned_batch, in_place_cache, kv_history
from raggedspec.conformance.helpers import draft_history, rms, rope, rope_at
from raggedspec.conformance.strategies import corner_lengths
from raggedspec.gpu.align import materialize_front_aligned
from raggedspec.gpu.cache import RaggedKv
from raggedspec.gpu.testing import DEVICE, assert_bit_exact, assert_close64, assert_same_refusal
from raggedspec.gpu.testing import host, outcome, to_port
from raggedspec.reference.attention import Dsv4AttentionConfig, dsv4_attention
from raggedspec.reference.cache import KvCache, SingleCache
from raggedspec.reference.errors import DispatchRefusal, MaskRefusal, Refusal
from raggedspec.reference.model import ModelConfig, TinyModel

MODEL = TinyModel()  # vocab 64, hidden 32, heads 2 x 16, one KV head, ratios (0, 4), window 16
NARROW = TinyModel(ModelConfig(compress_ratios=(4, 0, 3), sliding_window=5, seed=1))
PORT = port.TinyModel(MODEL, torch.float64, DEVICE)
F64 = torch.float64


def refused(message: str):
    """pytest.raises for a ValueError whose text is exactly `message`."""
    return pytest.raises(ValueError, match="^" + re.escape(message) + "$")


# --- one decoder layer ----------------------------------------------------------------------------


def layer_oracle(layer, x: np.ndarray) -> np.ndarray:
    """The documented steps of `DecoderLayer.forward` for one row prefilled alone at
    positions 0..T-1 into an empty slot: pre-norm, per-head q / KV norms, RoPE at the
    layer's theta (compress_rope_theta for a compressed layer, rope_theta otherwise), one
    compressed key per complete block (mean of the un-rotated keys, rotated at the block's
    start with compress_rope_theta), dsv4_attention with the layer's sinks, the inverse RoPE,
    the output projection and residual, then the SiLU MLP and its residual."""
    cfg = layer.cfg
    eps, nh, hd, t = cfg.eps, cfg.n_heads, cfg.head_dim, x.shape[1]
    theta = cfg.compress_rope_theta if layer.ratio else cfg.rope_theta
    pos = list(range(t))
    h = rms(x, layer.attn_norm, eps)
    q = rms((h @ layer.wq).reshape(1, t, nh, hd).transpose(0, 2, 1, 3), layer.q_norm, eps)
    q = rope(q, pos, cfg.rope_dims, theta)
    kv = rms((h @ layer.wkv).reshape(1, t, 1, hd).transpose(0, 2, 1, 3), layer.kv_norm, eps)
    keys = rope(kv, pos, cfg.rope_dims, theta)
    comp = None
    if layer.ratio:
        n = t // layer.ratio
        blocks = kv[:, :, : n * layer.ratio].reshape(1, 1, n, layer.ratio, hd).mean(axis=3)
        comp = rope(blocks, [j * layer.ratio for j in range(n)], cfg.rope_dims,
                    cfg.compress_rope_theta)
    acfg = Dsv4AttentionConfig(layer.ratio, cfg.sliding_window, 0, None)
    o = dsv4_attention(q, keys, keys, comp, None, acfg, sinks=layer.sinks)
    o = rope(o, pos, cfg.rope_dims, theta, inverse=True)
    x = x + o.transpose(0, 2, 1, 3).reshape(1, t, nh * hd) @ layer.wo
    m = rms(x, layer.mlp_norm, eps)
    return x + (lambda z: z / (1.0 + np.exp(-z)))(m @ layer.w_up) @ layer.w_down


@pytest.mark.rule("target forward: K/V at the shared offset, the pre-norm hidden")
@pytest.mark.parametrize("ratio", [0, 4])
def test_a_layer_forward_is_its_documented_steps(ratio):
    """A 10-token prefill through a window of 3: the last queries read compressed blocks
    their window no longer covers, so the compressed keys, the sinks, the RoPE theta and
    the inverse RoPE all reach the output."""
    model = TinyModel(ModelConfig(compress_ratios=(ratio,), sliding_window=3, seed=4))
    layer = model.layers[0]
    x = np.random.default_rng(1).standard_normal((1, 10, model.cfg.hidden))
    slot = KvCache.new_normal(model.cfg.max_seq_len)
    got = layer.forward(x, slot, [0], None, [0])
    want = layer_oracle(layer, x)
    assert got.shape == want.shape and close(got, want)
    assert slot.current_seq_len == 10


@pytest.mark.rule("compressed keys are start-anchored per row")
def test_a_compressed_layer_refuses_missing_leads_and_a_windowed_slot():
    model = TinyModel(ModelConfig(compress_ratios=(4,), seed=4))
    layer, hd = model.layers[0], model.cfg.head_dim
    x = np.random.default_rng(2).standard_normal((2, 1, model.cfg.hidden))
    with refused("a compressed layer needs 2 leads, got None"):
        layer.forward(x, KvCache.new_normal(4096), [0], None, None)
    with refused("a compressed layer needs 2 leads, got [0]"):
        layer.forward(x, KvCache.new_normal(4096), [0], None, [0])

    def windowed() -> SingleCache:  # positions 1..2 held, position 0 already dropped
        return SingleCache(4096, 512, 3, 1, None, np.zeros((2, 1, 512, hd)))

    with refused("a compressed layer needs the whole history (first_cached 1)"):
        layer.forward(x, KvCache(windowed(), windowed()), [3], None, [0, 0])


# --- compressed keys ------------------------------------------------------------------------------


@pytest.mark.rule("compressed keys are start-anchored per row",
                  "compressed keys per row from the row's own live run, port")
@pytest.mark.parametrize("impl", ["numpy", "torch"])
def test_compressed_keys_are_start_anchored_per_row(impl):
    """Block j of row i is the mean of the row's own un-rotated keys j*r .. j*r+r-1, rotated
    at j*r with compress_rope_theta; a shorter row's missing blocks are zeros; no complete
    block anywhere gives None. Rows of 11 and 6 keys: the reference front-aligned (leads 0
    and 5), the port in place."""
    layer, cfg = MODEL.layers[1], MODEL.cfg
    assert layer.ratio == 4
    rng = np.random.default_rng(5)
    lens = [11, 6]
    raw = [rng.standard_normal((n, cfg.head_dim)) for n in lens]
    own = [rope(r[None], range(len(r)), cfg.rope_dims, layer.theta)[0] for r in raw]
    if impl == "numpy":
        keys = np.zeros((2, 1, 11, cfg.head_dim))
        for i, n in enumerate(lens):  # each row's keys rotated at its own positions
            keys[i, 0, 11 - n:] = own[i]
        comp = layer.compressed_keys(keys, [0, 5])
        empty = layer.compressed_keys(keys[:, :, :3], [0, 0])
    else:
        kv = RaggedKv.from_rows([to_port(k[None]) for k in own], [to_port(k[None]) for k in own],
                                4096)
        comp = host(PORT.layers[1].compressed_keys(kv))
        short = RaggedKv.from_rows([to_port(k[None, :3]) for k in own],
                                   [to_port(k[None, :3]) for k in own], 4096)
        empty = PORT.layers[1].compressed_keys(short)
    assert comp.shape == (2, 1, 2, cfg.head_dim) and empty is None
    for i, n in enumerate(lens):
        for j in range(n // 4):
            want = rope_at(raw[i][4 * j: 4 * j + 4].mean(axis=0), 4 * j, cfg.rope_dims,
                           cfg.compress_rope_theta)
            assert close(comp[i, 0, j], want)
    assert np.array_equal(comp[1, 0, 1], np.zeros(cfg.head_dim))


@pytest.mark.rule("compressed keys per row from the row's own live run, port")
@given(lens=corner_lengths(1, 5, 60, boundaries=False), seed=st.integers(0, 2**32 - 1))
def test_compressed_keys_are_start_anchored_per_row_as_the_reference(lens, seed):
    """`DecoderLayer.compressed_keys` on the in-place rows == the reference's on the
    front-aligned batch (1e-12); blocks past a row's own count are exactly 0; None when no
    row has a complete block."""
    hist = kv_history(NARROW, lens, np.random.default_rng(seed))
    batched, leads = front_aligned_batch(NARROW, hist)
    got = port.TinyModel(NARROW).layers[0].compressed_keys(in_place_cache(NARROW, hist)[0])
    want = NARROW.layers[0].compressed_keys(batched.slots[0].k.current_data(), leads)
    if want is None:
        assert got is None and max(lens) < 4
        return
    assert_close64(got, want, what="compressed keys")
    for i, n in enumerate(lens):
        assert not host(got[i, 0, n // 4:]).any()


@pytest.mark.rule("compressed keys per row from the row's own live run, port")
def test_compressed_keys_of_no_rows_and_from_tables_sized_exactly_to_their_width():
    """A cache without rows has none; tables holding exactly the `t_c * ratio` positions the
    keys read suffice: the reference's keys row by row (1e-12), zero past a row's blocks."""
    assert PORT.layers[1].compressed_keys(RaggedKv.empty(0, 1, 16, 4096, 8, F64, DEVICE)) is None
    rng = np.random.default_rng(37)
    ref_layer = NARROW.layers[0]
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


@pytest.mark.rule("compressed keys per row from the row's own live run, port")
def test_a_compressed_layer_refuses_a_row_subset():
    cache = in_place_cache(MODEL, kv_history(MODEL, [4, 6], np.random.default_rng(0)))[0]
    x = torch.zeros((1, 1, 32), dtype=F64)
    with refused("a compressed layer runs on every row of its cache (rows must be None)"):
        PORT.layers[1].forward(x, cache, rows=torch.tensor([1]))
    assert cache.host_lens().tolist() == [4, 6]  # refused before anything was appended
    out = PORT.layers[0].forward(x, cache, rows=torch.tensor([1]))
    assert out.shape == (1, 1, 32) and cache.host_lens().tolist() == [4, 7]


# --- attention over some rows of a shared buffer --------------------------------------------------


def pool(lens, hk, d, rng, dtype=F64):
    """A shared buffer whose row i holds `lens[i]` random K and V entries (V independent of
    K, so a value read from the wrong column shows), and those rows as host arrays."""
    ks = [rng.standard_normal((hk, n, d)) for n in lens]
    vs = [rng.standard_normal((hk, n, d)) for n in lens]
    kv = RaggedKv.from_rows([to_port(k, dtype) for k in ks], [to_port(v, dtype) for v in vs],
                            4096)
    return kv, ks, vs


def each_row_alone(q, ks, vs, rows, comp, ratio, window, sinks) -> np.ndarray:
    """The reference's `dsv4_attention` of every query row on its pool row alone."""
    out = []
    for g, r in enumerate(rows):
        c = None if comp is None else comp[g: g + 1]
        out.append(dsv4_attention(q[g: g + 1], ks[r][None], vs[r][None], c, None,
                                  Dsv4AttentionConfig(ratio, window), sinks=sinks))
    return np.concatenate(out, axis=0)


@pytest.mark.rule("dsv4 attention on a subset of a pool's rows, port")
@given(lens=corner_lengths(2, 6, 40, boundaries=False), t_q=st.integers(1, 3), data=st.data())
def test_attention_on_pool_rows_equals_in_place_attention_on_those_rows(lens, t_q, data):
    """`dsv4_attention_rows` on a subset of a pool's rows (only their windows gathered) ==
    `dsv4_attention_in_place` on a cache holding just those rows, bit for bit, with one KV
    head or several (every KV head of a row gathered)."""
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    lens = [n + t_q for n in lens]
    rows = data.draw(st.lists(st.integers(0, len(lens) - 1), min_size=1, max_size=len(lens),
                              unique=True))
    hk = data.draw(st.sampled_from([1, 2, 4]))
    kv, _, _ = pool(lens, hk, 8, rng)
    sub = RaggedKv(kv.k[rows], kv.v[rows], kv.lens[rows], 4096)
    q = to_port(rng.standard_normal((len(rows), 2 * hk, t_q, 8)))
    sinks = to_port(rng.standard_normal(2 * hk))
    window = data.draw(st.sampled_from([1, 3, 16]))
    got = port.dsv4_attention_rows(q, kv, torch.tensor(rows), None, 0, window, sinks)
    assert_bit_exact(got, port.dsv4_attention_in_place(q, sub, None, 0, window, sinks), "rows")


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
    reference's `dsv4_attention` of that row alone (float64, 1e-12); without the compressed
    keys the same rows give other values."""
    rng = np.random.default_rng(sum(lens) + t_q * 7 + ratio)
    kv, ks, vs = pool(lens, hk, 8, rng)
    q = rng.standard_normal((len(rows), 2 * hk, t_q, 8))
    comp = rng.standard_normal((len(rows), hk, t_c, 8))
    sinks = rng.standard_normal(2 * hk) if with_sinks else None
    got = port.dsv4_attention_rows(to_port(q), kv, torch.tensor(rows), to_port(comp), ratio,
                                   window, None if sinks is None else to_port(sinks))
    want = each_row_alone(q, ks, vs, rows, comp, ratio, window, sinks)
    assert got.dtype == F64
    assert_close64(got, want, what="pooled compressed attention")
    assert np.abs(each_row_alone(q, ks, vs, rows, None, ratio, window, sinks) - want).max() > 1e-6


@pytest.mark.rule("dsv4 attention on a subset of a pool's rows, port")
def test_pooled_attention_reads_rows_of_exactly_t_q_keys_and_raw_keys_alone_without_blocks():
    """A row holding exactly t_q keys is attended, not refused; a compressed layer before any
    row has a complete block (no compressed keys) attends the raw window alone; both the
    reference's attention of each row alone."""
    rng = np.random.default_rng(5)
    kv, ks, vs = pool([3, 7], 1, 4, rng)
    q = rng.standard_normal((2, 1, 3, 4))
    got = port.dsv4_attention_rows(to_port(q), kv, [0, 1], None, 0, 4)
    assert_close64(got, each_row_alone(q, ks, vs, [0, 1], None, 0, 4, None), what="t_q keys")
    kv, ks, vs = pool([3, 2, 3], 1, 8, np.random.default_rng(13))
    q = np.random.default_rng(13).standard_normal((2, 2, 2, 8))
    got = port.dsv4_attention_rows(to_port(q), kv, [2, 1], None, 4, 16)
    assert_close64(got, each_row_alone(q, ks, vs, [2, 1], None, 4, 16, None), what="raw only")


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


@pytest.mark.rule("dsv4 attention on a subset of a pool's rows, port")
def test_pooled_attention_refuses_short_rows_and_shapes_that_disagree():
    kv = RaggedKv(torch.zeros((3, 1, 8, 4), dtype=F64), torch.zeros((3, 1, 8, 4), dtype=F64),
                  torch.tensor([5, 1, 7]), 4096)
    with pytest.raises(MaskRefusal, match="2 query rows against only 1 keys"):
        port.dsv4_attention_rows(torch.zeros((2, 1, 2, 4), dtype=F64), kv, torch.tensor([2, 1]),
                                 None, 0, 4)
    kv = in_place_cache(MODEL, kv_history(MODEL, [5, 3, 7], np.random.default_rng(0)))[0]
    rows = torch.tensor([2, 0])
    msg = ("q [{}] for rows 2 of kv [3, 1, 512, 16]: need [G,H,t_q,D], [B,Hk,cap,D] with Hk "
           "dividing H")
    for shape in ((3, 2, 1, 16), (2, 2, 1, 8), (2, 2, 16)):
        with refused(msg.format(", ".join(map(str, shape)))):
            port.dsv4_attention_rows(torch.zeros(shape, dtype=F64), kv, rows, None, 0, 4)
    q = torch.zeros((2, 2, 2, 16), dtype=F64)
    with refused("rows must be a 1-D vector, got shape [1, 2]"):
        port.dsv4_attention_rows(q, kv, torch.tensor([[2, 0]]), None, 0, 4)
    assert port.dsv4_attention_rows(q, kv, [2, 0], None, 0, 4).shape == (2, 2, 2, 16)


# --- the MTP block --------------------------------------------------------------------------------


@pytest.mark.rule("MTP decode kit: fuse and logits")
def test_mtp_decode_kit_step_shape():
    model = TinyModel(ModelConfig(hidden=16, vocab=32))
    block = model.mtp
    fused = block.fuse(np.random.default_rng(3).standard_normal((1, 16)), [5])
    assert fused.shape == (1, 16) and block.logits(fused).shape == (1, 32)
    hidden = block.forward_step(fused[:, None, :], 0, block.new_draft_cache())
    assert hidden.shape == (1, 1, 16) and block.logits(hidden[:, 0]).shape == (1, 32)


@pytest.mark.rule("draft KV created by MtpBlock::new_draft_cache")
def test_new_draft_cache_is_an_empty_capacity_16_slot():
    c = MODEL.mtp.new_draft_cache()
    assert (c.kind, c.current_seq_len, c.k.capacity_seq_len, c.k.max_seq_len) == (
        "Normal", 0, 16, 4096)


@pytest.mark.rule("MTP decode kit: fuse and logits")
def test_fuse_checks_shapes_and_token_range_with_the_documented_texts():
    block, rng = TinyModel(ModelConfig(seed=3)).mtp, np.random.default_rng(3)
    with refused("hidden (1, 31) and tokens (1,) disagree (hidden 32)"):
        block.fuse(rng.standard_normal((1, 31)), [1])
    with refused("hidden (2, 32) and tokens (3,) disagree (hidden 32)"):
        block.fuse(rng.standard_normal((2, 32)), [1, 2, 3])
    for bad in ([64], [-1], [3, 64], [-1, 3]):
        with refused("tokens must be in [0, 64)"):
            block.fuse(rng.standard_normal((len(bad), 32)), bad)
    assert block.fuse(np.zeros((0, 32)), np.zeros(0, dtype=np.int64)).shape == (0, 32)
    assert block.fuse(rng.standard_normal((1, 32)), [63]).shape == (1, 32)
    for shape in ((1, 32), (1, 1, 31)):
        with refused(f"fused {shape} must be [G,T,32]"):
            block.forward_tokens_rows(np.zeros(shape), [0], block.new_draft_cache())


@pytest.mark.rule("MTP decode kit: fuse and logits")
def test_the_mtp_block_computes_in_float64_and_reads_token_ids_as_integers():
    """Inputs are converted before use: a float32 hidden / fused gives exactly the result of
    its float64 values, integral float token ids the embeddings of those ids."""
    block, rng = TinyModel(ModelConfig(seed=3)).mtp, np.random.default_rng(4)
    h32 = rng.standard_normal((2, 32)).astype(np.float32)
    want = block.fuse(h32.astype(np.float64), [5, 9])
    assert np.array_equal(block.fuse(h32, [5, 9]), want)
    assert np.array_equal(block.fuse(h32.astype(np.float64), np.array([5.0, 9.0])), want)
    f32 = rng.standard_normal((1, 3, 32)).astype(np.float32)
    a = block.forward_tokens_rows(f32, [0], block.new_draft_cache())
    b = block.forward_tokens_rows(f32.astype(np.float64), [0], block.new_draft_cache())
    assert a.dtype == np.float64 and np.array_equal(a, b)


@pytest.mark.rule("forward_tokens_rows and its wrappers")
def test_the_mtp_step_refuses_a_desynced_draft_cache():
    block = MODEL.mtp
    cache = draft_history(MODEL, 7, 0)
    fused = block.fuse(np.random.default_rng(0).standard_normal((1, 1, 32)), [[1]])
    with pytest.raises(Refusal) as err:
        block.forward_step(fused, 6, cache)
    assert "desync" in str(err.value) and "6" in str(err.value) and "7" in str(err.value)
    with pytest.raises(Refusal, match="2 absolute position"):
        block.forward_step_rows(np.repeat(fused, 3, axis=0), [7, 4], cache)
    assert cache.current_seq_len == 7  # refused before anything was appended
    block.forward_step(fused, 7, cache)
    assert cache.current_seq_len == 8


@pytest.mark.rule("forward_tokens_rows and its wrappers")
def test_a_ragged_mtp_group_gives_each_row_its_own_result():
    """§10.1: rows at [7, 5] on a left-aligned 2-row draft cache (row 1's 5 entries end at
    the shared end column 7, 2 dead columns before them): each row's step equals that row
    stepped alone on its own cache, whatever the dead columns hold; a group whose rows share
    one position needs no dead columns and passes its 2 positions for 2 rows."""
    model = TinyModel(ModelConfig(seed=5))
    block, rng = model.mtp, np.random.default_rng(6)
    fa, fb = rng.standard_normal((1, 7, 32)), rng.standard_normal((1, 5, 32))
    own_a, own_b = block.new_draft_cache(), block.new_draft_cache()
    block.forward_tokens(fa, 0, own_a)
    block.forward_tokens(fb, 0, own_b)

    def shared(half: str) -> SingleCache:
        data = np.full((2, 1, 16, model.cfg.head_dim), 3.0)  # dead columns hold junk
        data[0, :, :7] = getattr(own_a, half).current_data()[0]
        data[1, :, 2:7] = getattr(own_b, half).current_data()[0]
        return SingleCache(4096, 16, 7, 0, None, data)

    group = KvCache(shared("k"), shared("v"))
    step = rng.standard_normal((2, 1, 32))
    got = block.forward_step_rows(step, [7, 5], group)
    assert got.shape == (2, 1, 32) and group.current_seq_len == 8
    alone_a = block.forward_step(step[:1], 7, own_a)
    alone_b = block.forward_step(step[1:], 5, own_b)
    assert close(got[:1], alone_a) and close(got[1:], alone_b)
    uniform = block.new_draft_cache()
    block.forward_tokens(np.concatenate([fa, fa]), 0, uniform)
    out = block.forward_step_rows(np.concatenate([step[:1], step[:1]]), [7, 7], uniform)
    assert out.shape == (2, 1, 32) and np.array_equal(out[0], out[1])
    assert close(out[:1], alone_a)


@pytest.mark.rule("MTP block fuse / logits / forward_tokens_rows, port")
def test_the_ports_fuse_and_logits_match_the_reference():
    rng = np.random.default_rng(5)
    h, toks = rng.standard_normal((3, 2, 32)), rng.integers(0, 64, (3, 2))
    assert_close64(PORT.mtp.fuse(to_port(h), torch.from_numpy(toks)), MODEL.mtp.fuse(h, toks),
                   what="fuse")
    assert_close64(PORT.mtp.logits(to_port(h)), MODEL.mtp.logits(h), what="mtp logits")


@pytest.mark.rule("MTP block fuse / logits / forward_tokens_rows, port")
@given(held=st.integers(1, 20), start=st.integers(0, 22), g=st.integers(1, 3), t=st.integers(1, 3),
       seed=st.integers(0, 2**32 - 1))
def test_the_mtp_step_matches_the_reference_including_the_desync_refusal(held, start, g, t, seed):
    """`forward_tokens` on G rows holding `held` entries at `start`: refused by both
    ("desync", same message) unless `start == held`; else the same hidden (1e-12) and the
    same new draft-KV entries (1e-12), the history untouched (bit-exact)."""
    rng = np.random.default_rng(seed)
    caches = [draft_history(MODEL, held, int(rng.integers(1 << 30))) for _ in range(g)]
    batched = KvCache.new_normal(4096, 16)
    batched.k.data = np.concatenate([c.k.data for c in caches])
    batched.v.data = np.concatenate([c.v.data for c in caches])
    for half, src in ((batched.k, caches[0].k), (batched.v, caches[0].v)):
        half.capacity_seq_len, half.current_seq_len = src.capacity_seq_len, src.current_seq_len
    kv = RaggedKv.from_rows([to_port(c.k.current_data()[0]) for c in caches],
                            [to_port(c.v.current_data()[0]) for c in caches], 4096)
    fused = MODEL.mtp.fuse(rng.standard_normal((g, t, 32)), rng.integers(0, 64, (g, t)))
    r = outcome(MODEL.mtp.forward_tokens, fused, start, batched)
    p = outcome(PORT.mtp.forward_tokens, to_port(fused), start, kv)
    if assert_same_refusal(p, r, "mtp step"):
        assert_close64(p[1], r[1], what="mtp hidden")
        k, _ = materialize_front_aligned(kv)
        assert_bit_exact(k[:, :, :held], batched.k.current_data()[:, :, :held], "draft history")
        assert_close64(k[:, :, held:], batched.k.current_data()[:, :, held:], what="new draft K")
    else:
        assert r[1] is DispatchRefusal and "desync" in r[2]


@pytest.mark.rule("MTP block fuse / logits / forward_tokens_rows, port")
def test_the_ports_mtp_step_refuses_what_the_reference_refuses_and_a_per_row_desync():
    """The reference's refusals (a position count neither 1 nor G, no position, the cache's
    end not the step's) with their texts; port only, a row whose own length is not its own
    start; all before anything is appended."""
    rng = np.random.default_rng(6)
    kv = RaggedKv.from_rows([to_port(rng.standard_normal((1, n, 16))) for n in (7, 4)],
                            [to_port(rng.standard_normal((1, n, 16))) for n in (7, 4)], 4096)
    fused = to_port(rng.standard_normal((2, 1, 32)))
    for call, text in (
        (lambda: PORT.mtp.forward_step_rows(fused, [7, 4, 4], kv), "3 absolute position"),
        (lambda: PORT.mtp.forward_step_rows(fused, [], kv), "given no absolute position at all"),
        (lambda: PORT.mtp.forward_step_rows(fused, [6, 4], kv),
         "cache holds 7 entries but the step's rows end at absolute position 6"),
        (lambda: PORT.mtp.forward_step_rows(fused, [7, 3], kv),
         "draft row 1 holds 4 entries but its step starts at absolute position 3"),
        (lambda: PORT.mtp.forward_step(fused, 7, kv),
         "draft row 1 holds 4 entries but its step starts at absolute position 7"),
    ):
        with pytest.raises(DispatchRefusal, match=re.escape(text)):
            call()
    assert kv.lens.tolist() == [7, 4]
    PORT.mtp.forward_step_rows(fused, [7, 4], kv)
    assert kv.lens.tolist() == [8, 5]


@pytest.mark.rule("MTP block fuse / logits / forward_tokens_rows, port")
def test_the_ports_mtp_step_refuses_malformed_input_and_steps_rows_of_a_pool():
    """A fused input of the wrong shape and a row count that is not the step's are refused
    with their texts; a step on some rows of a pool (in any order) or on rows holding nothing
    at position 0 grows exactly those rows by one."""
    kv = in_place_cache(MODEL, kv_history(MODEL, [3, 2, 5], np.random.default_rng(0)))[0]
    fused = torch.zeros((2, 1, 32), dtype=F64)
    for bad, rows, text in ((torch.zeros((2, 32), dtype=F64), None,
                             "fused (2, 32) must be [G,T,32]"),
                            (torch.zeros((2, 1, 16), dtype=F64), None,
                             "fused (2, 1, 16) must be [G,T,32]"),
                            (fused, None, "3 draft rows for a step of 2"),
                            (fused, [0], "1 draft rows for a step of 2")):
        with refused(text):
            PORT.mtp.forward_step_rows(bad, [3, 2], kv, rows=rows)
    out = PORT.mtp.forward_step_rows(fused, torch.tensor([5, 3]), kv, rows=torch.tensor([2, 0]))
    assert out.shape == (2, 1, 32) and kv.host_lens().tolist() == [4, 2, 6]
    PORT.mtp.forward_step(fused[:1], 2, kv, rows=[1])
    assert kv.host_lens().tolist() == [4, 3, 6]
    fresh = RaggedKv.empty(2, 1, 16, 4096, 16, F64, DEVICE)
    PORT.mtp.forward_step(fused, 0, fresh)
    assert fresh.host_lens().tolist() == [1, 1]
