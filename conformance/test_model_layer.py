"""The tiny model's own rules, one piece at a time (reference/model.py; docs/simulator.md,
section "reference/model.py"): the config's bounds and refusal texts, the documented weight
draws and the shape of every norm gain and sink, SiLU, one decoder layer (Standard and
compressed) against an oracle written here from the layer's documented steps, the MTP block's
input checks, its per-row positions and masks on a ragged group, and the target forward's
refusals. Models are built inside each test, so a change to how a model is built reaches the
test that reads it. Tolerance as in test_model.py: `1e-12 * max(1, max|x|)` absolute where
the two sides sum in a different order; bit equality where they run the same operations.
"""

from __future__ import annotations

import re

import numpy as np
import pytest

from raggedspec.reference.attention import Dsv4AttentionConfig, dsv4_attention
from raggedspec.reference.cache import KvCache, NormalCache, SingleCache
from raggedspec.reference.model import (
    ModelConfig,
    TinyModel,
    _gain,
    _proj,
    silu,
)


def close(a: np.ndarray, b: np.ndarray, rel: float = 1e-12) -> bool:
    return bool(np.all(np.abs(a - b) <= rel * max(1.0, float(np.max(np.abs(b))))))


def rms(x: np.ndarray, gain: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt((x ** 2).mean(axis=-1, keepdims=True) + eps) * gain


def rope(x: np.ndarray, positions, rope_dims: int, theta: float, inverse: bool = False):
    """Rotate the last `rope_dims` dims of `x [..., T, D]` as interleaved pairs, token t at
    `positions[t]` (the conjugate rotation when `inverse`)."""
    out = x.copy()
    d0 = x.shape[-1] - rope_dims
    sign = -1.0 if inverse else 1.0
    for t, pos in enumerate(positions):
        for k in range(rope_dims // 2):
            ang = pos * theta ** (-(2.0 * k) / rope_dims)
            c, s = np.cos(ang), sign * np.sin(ang)
            a, b = x[..., t, d0 + 2 * k], x[..., t, d0 + 2 * k + 1]
            out[..., t, d0 + 2 * k] = a * c - b * s
            out[..., t, d0 + 2 * k + 1] = a * s + b * c
    return out


def refused(message: str):
    """pytest.raises for a ValueError whose text is exactly `message`."""
    return pytest.raises(ValueError, match="^" + re.escape(message) + "$")


# --- ModelConfig ---------------------------------------------------------------------------

SMALLEST = dict(vocab=1, hidden=1, n_heads=1, head_dim=2, rope_dims=2, compress_ratios=(0,),
                sliding_window=1, max_seq_len=1, mlp_mult=1)


@pytest.mark.rule("tiny seeded V4-like model: ModelConfig, seeded weights")
def test_the_smallest_config_every_bound_allows_is_accepted():
    """Every bound is inclusive: vocab, hidden, n_heads, sliding_window, max_seq_len,
    mlp_mult at 1, head_dim and rope_dims at 2 (rope_dims == head_dim), one ratio 0."""
    cfg = ModelConfig(**SMALLEST)
    assert (cfg.vocab, cfg.head_dim, cfg.rope_dims, cfg.compress_ratios) == (1, 2, 2, (0,))
    assert ModelConfig(head_dim=8, rope_dims=8).rope_dims == 8


@pytest.mark.rule("tiny seeded V4-like model: ModelConfig, seeded weights")
@pytest.mark.parametrize("field, value", [("vocab", 0), ("hidden", 0), ("n_heads", 0),
                                          ("head_dim", 1)])
def test_the_config_refuses_a_size_below_its_bound(field, value):
    """Each size alone at one below its bound, every other field at the smallest allowed."""
    kw = dict(SMALLEST, **{field: value})
    with refused(f"vocab {kw['vocab']}, hidden {kw['hidden']}, n_heads {kw['n_heads']}, "
                 f"head_dim {kw['head_dim']} must be positive (head_dim >= 2)"):
        ModelConfig(**kw)


@pytest.mark.rule("tiny seeded V4-like model: ModelConfig, seeded weights")
@pytest.mark.parametrize("rope_dims, head_dim", [(0, 16), (1, 16), (3, 16), (18, 16)])
def test_the_config_refuses_rope_dims_odd_below_2_or_above_head_dim(rope_dims, head_dim):
    with refused(f"rope_dims {rope_dims} must be even, >= 2 and <= head_dim {head_dim}"):
        ModelConfig(rope_dims=rope_dims, head_dim=head_dim)


@pytest.mark.rule("tiny seeded V4-like model: ModelConfig, seeded weights")
@pytest.mark.parametrize("ratios", [(), (0, -1), (-4,)])
def test_the_config_refuses_no_ratio_or_a_negative_one(ratios):
    with refused(f"compress_ratios {ratios} must be a non-empty tuple of ratios >= 0"):
        ModelConfig(compress_ratios=ratios)


@pytest.mark.rule("tiny seeded V4-like model: ModelConfig, seeded weights")
@pytest.mark.parametrize("field", ["sliding_window", "max_seq_len", "mlp_mult"])
def test_the_config_refuses_a_window_length_or_mlp_multiple_below_1(field):
    vals = {**dict(sliding_window=16, max_seq_len=4096, mlp_mult=2), field: 0}
    with refused(f"sliding_window {vals['sliding_window']}, max_seq_len {vals['max_seq_len']} "
                 f"and mlp_mult {vals['mlp_mult']} must be >= 1"):
        ModelConfig(**{field: 0})


# --- weights -------------------------------------------------------------------------------


@pytest.mark.rule("tiny seeded V4-like model: ModelConfig, seeded weights")
def test_the_weight_draws_are_the_documented_ones():
    """A gain is `1 + 0.1 * z` and a projection `z / sqrt(fan_in)`, z the next standard
    normals of the generator (so equal seeds give equal weights)."""
    g = _gain(np.random.default_rng(5), 7)
    assert np.array_equal(g, 1.0 + 0.1 * np.random.default_rng(5).standard_normal(7))
    p = _proj(np.random.default_rng(6), 9, 4)
    assert np.array_equal(p, np.random.default_rng(6).standard_normal((9, 4)) / np.sqrt(9))


@pytest.mark.rule("tiny seeded V4-like model: ModelConfig, seeded weights")
def test_every_norm_gain_is_per_dimension_and_every_layer_has_a_per_head_sink():
    """RMSNorm gains over the hidden size (attention and MLP norms, the final norm, the MTP
    block's hnorm/enorm/norm_out), per-head gains over head_dim (q and KV norms), one sink
    logit per query head; drawn, so not all equal."""
    cfg = ModelConfig(hidden=12, n_heads=3, head_dim=6, rope_dims=4, seed=2)
    model = TinyModel(cfg)
    layers = list(model.layers) + [model.mtp.layer]
    hidden_gains = [model.norm, model.mtp.hnorm, model.mtp.enorm, model.mtp.norm_out]
    for layer in layers:
        hidden_gains += [layer.attn_norm, layer.mlp_norm]
        for g in (layer.q_norm, layer.kv_norm):
            assert g.shape == (6,) and np.unique(g).size == 6
        assert layer.sinks.shape == (3,) and np.unique(layer.sinks).size == 3
    for g in hidden_gains:
        assert g.shape == (12,) and np.unique(g).size == 12


@pytest.mark.rule("tiny seeded V4-like model: ModelConfig, seeded weights")
def test_silu_is_x_times_its_sigmoid():
    x = np.array([-30.0, -3.0, -0.5, 0.0, 0.25, 2.0, 30.0])
    assert close(silu(x), x * 0.5 * (1.0 + np.tanh(x / 2.0)))


# --- one decoder layer ---------------------------------------------------------------------


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


# --- the MTP block -------------------------------------------------------------------------


@pytest.mark.rule("MTP decode kit: fuse and logits")
def test_fuse_checks_shapes_and_token_range_with_the_documented_texts():
    model = TinyModel(ModelConfig(seed=3))
    block, rng = model.mtp, np.random.default_rng(3)
    with refused("hidden (1, 31) and tokens (1,) disagree (hidden 32)"):
        block.fuse(rng.standard_normal((1, 31)), [1])
    with refused("hidden (2, 32) and tokens (3,) disagree (hidden 32)"):
        block.fuse(rng.standard_normal((2, 32)), [1, 2, 3])
    for bad in ([64], [-1], [3, 64], [-1, 3]):
        with refused("tokens must be in [0, 64)"):
            block.fuse(rng.standard_normal((len(bad), 32)), bad)
    assert block.fuse(np.zeros((0, 32)), np.zeros(0, dtype=np.int64)).shape == (0, 32)
    assert block.fuse(rng.standard_normal((1, 32)), [63]).shape == (1, 32)


@pytest.mark.rule("MTP decode kit: fuse and logits")
def test_the_mtp_block_computes_in_float64_and_reads_token_ids_as_integers():
    """Inputs are converted before use: a float32 hidden / fused gives exactly the result of
    its float64 values, integral float token ids the embeddings of those ids."""
    model = TinyModel(ModelConfig(seed=3))
    block, rng = model.mtp, np.random.default_rng(4)
    h32 = rng.standard_normal((2, 32)).astype(np.float32)
    want = block.fuse(h32.astype(np.float64), [5, 9])
    assert np.array_equal(block.fuse(h32, [5, 9]), want)
    assert np.array_equal(block.fuse(h32.astype(np.float64), np.array([5.0, 9.0])), want)
    f32 = rng.standard_normal((1, 3, 32)).astype(np.float32)
    a = block.forward_tokens_rows(f32, [0], block.new_draft_cache())
    b = block.forward_tokens_rows(f32.astype(np.float64), [0], block.new_draft_cache())
    assert a.dtype == np.float64 and np.array_equal(a, b)


@pytest.mark.rule("MTP decode kit: fuse and logits")
def test_the_mtp_step_refuses_a_fused_input_of_the_wrong_shape():
    model = TinyModel(ModelConfig(seed=3))
    block = model.mtp
    for shape in ((1, 32), (1, 1, 31)):
        with refused(f"fused {shape} must be [G,T,32]"):
            block.forward_tokens_rows(np.zeros(shape), [0], block.new_draft_cache())


@pytest.mark.rule("forward_tokens_rows and its wrappers")
def test_a_ragged_mtp_group_gives_each_row_its_own_result():
    """§10.1: rows at [7, 5] on a left-aligned 2-row draft cache (row 1's 5 entries end at
    the shared end column 7, 2 dead columns before them): each row's step equals that row
    stepped alone on its own cache, whatever the dead columns hold; a group whose rows
    share one position needs no dead columns and passes its 2 positions for 2 rows."""
    model = TinyModel(ModelConfig(seed=5))
    block, rng = model.mtp, np.random.default_rng(6)
    hd = model.cfg.head_dim
    fa, fb = rng.standard_normal((1, 7, 32)), rng.standard_normal((1, 5, 32))
    own_a, own_b = block.new_draft_cache(), block.new_draft_cache()
    block.forward_tokens(fa, 0, own_a)
    block.forward_tokens(fb, 0, own_b)

    def shared(half: str) -> SingleCache:
        data = np.full((2, 1, 16, hd), 3.0)  # dead columns hold junk, never attended
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


# --- the target forward --------------------------------------------------------------------


@pytest.mark.rule("target forward: K/V at the shared offset, the pre-norm hidden")
def test_the_target_forward_refuses_malformed_input_with_the_documented_texts():
    model = TinyModel(ModelConfig(seed=6))
    with refused("tokens (3,) must be [B,T], B, T >= 1"):
        model.forward(np.array([1, 2, 3]), model.new_cache(), [0])
    with refused("tokens (1, 0) must be [B,T], B, T >= 1"):
        model.forward(np.zeros((1, 0), dtype=np.int64), model.new_cache(), [0])
    with refused("tokens must be in [0, 64), got [1, 64]"):
        model.forward(np.array([[1, 64]]), model.new_cache(), [0])
    with refused("tokens must be in [0, 64), got [-1, 3]"):
        model.forward(np.array([[-1, 3]]), model.new_cache(), [0])
    with refused("cache has 1 slots for 2 layers"):
        model.forward(np.array([[1, 2]]), NormalCache.new_plain(1, 4096), [0])
    with refused("1 leads for a batch of 2"):
        model.forward(np.array([[1], [2]]), model.new_cache(), [0], lead_pad=[0])
    assert model.forward(np.array([[0, 63]]), model.new_cache(), [0]).logits.shape == (1, 2, 64)


@pytest.mark.rule("target forward: K/V at the shared offset, the pre-norm hidden")
def test_the_target_forward_ignores_extra_slots_and_reads_integral_float_ids():
    """Layer i uses slot i; a slot beyond the last layer is left untouched. Token ids are
    read as int64."""
    model = TinyModel(ModelConfig(seed=6))
    toks = np.array([[4, 8, 15, 16]])
    want = model.forward(toks, model.new_cache(), [0])
    extra = NormalCache.new_plain(3, 4096)
    got = model.forward(toks.astype(np.float64), extra, [0])
    assert np.array_equal(got.hidden, want.hidden) and np.array_equal(got.logits, want.logits)
    assert [s.current_seq_len for s in extra.slots] == [4, 4, 0]
