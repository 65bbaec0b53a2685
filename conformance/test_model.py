"""The tiny seeded model (cache-and-draft.md §1, §6.3; masks-and-scheduling.md §4, §5, §11, §12;
docs/simulator.md, "reference/model.py"): the config's bounds and refusal texts, the documented
weight draws, the target forward (every slot grows, the pre-norm hidden, what a capture stores,
malformed input), a ragged front-aligned batch giving each row what it gives alone, the uniform
`row_q0` path and each row's own RoPE positions; and the torch port's model built from the same
weights (`gpu.model`): its weights, devices and dtypes, its RoPE tables, and its forward's
layout checks and refusals. test_model_forward.py compares the port's forward arithmetic with
the reference; test_model_layers.py the layers, the attention over pool rows and the MTP block.

Tolerance (float64): "the same as that row alone" to `1e-12 * max(1, max|x|)` (`helpers.close`:
the batched row's softmax also sums exactly-zero terms of its masked dead prefix); negative
controls differ by far more (> 1e-8 in the property, > 1e-3 on the fixed fixture); where only
masked columns differ the results are bit-identical.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from hypothesis import given, note
from hypothesis import strategies as st

import raggedspec.gpu.model as port
from raggedspec.conformance.helpers import close, front_aligned_batch, in_place_cache, kv_history
from raggedspec.conformance.helpers import rms, rope_at
from raggedspec.gpu.cache import RaggedKv
from raggedspec.gpu.testing import DEVICE, assert_bit_exact, assert_same_refusal, outcome, to_port
from raggedspec.reference.attention import dsv4_mask_stats, reset_dsv4_mask_stats
from raggedspec.reference.cache import KvCache, NormalCache, SingleCache
from raggedspec.reference.dispatch import MtpHiddenCapture
from raggedspec.reference.errors import CacheRefusal
from raggedspec.reference.model import ModelConfig, TinyModel, _gain, _proj, silu
from raggedspec.reference.rope import reset_rope_cohort_stats, rope_cohort_stats

MODEL = TinyModel()  # vocab 64, hidden 32, heads 2 x 16, one KV head, ratios (0, 4), window 16
NARROW = TinyModel(ModelConfig(compress_ratios=(4, 0, 3), sliding_window=5, seed=1))
GQA = TinyModel(ModelConfig(n_heads=8, n_kv_heads=2, compress_ratios=(0, 4), seed=3))
F64 = torch.float64


def refused(message: str):
    """pytest.raises for a ValueError whose text is exactly `message`."""
    return pytest.raises(ValueError, match="^" + re.escape(message) + "$")


# --- ModelConfig --------------------------------------------------------------------------------

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


@pytest.mark.rule("tiny seeded V4-like model: ModelConfig, seeded weights")
def test_the_config_refuses_an_unknown_mtp_kind_and_kv_heads_that_do_not_divide_the_heads():
    with refused("mtp 'tier-c' must be 'block' or 'heads'"):
        ModelConfig(mtp="tier-c")
    for n_heads, n_kv in ((4, 3), (2, 0), (2, 4)):
        with refused(f"n_kv_heads {n_kv} must be >= 1 and divide n_heads {n_heads}"):
            ModelConfig(n_heads=n_heads, n_kv_heads=n_kv)


# --- weights ------------------------------------------------------------------------------------


@pytest.mark.rule("tiny seeded V4-like model: ModelConfig, seeded weights")
def test_weights_are_seeded():
    a, b, c = TinyModel(), TinyModel(), TinyModel(ModelConfig(seed=7))
    assert np.array_equal(a.embed, b.embed)
    assert np.array_equal(a.mtp.heads.h_proj, b.mtp.heads.h_proj)
    assert not np.array_equal(a.embed, c.embed)
    toks = np.array([[3, 1, 4, 1, 5]])
    fa, fb = a.forward(toks, a.new_cache(), [0]), b.forward(toks, b.new_cache(), [0])
    assert np.array_equal(fa.logits, fb.logits)
    assert TinyModel(ModelConfig(mtp="heads")).mtp is None


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
    model = TinyModel(ModelConfig(hidden=12, n_heads=3, head_dim=6, rope_dims=4, seed=2))
    hidden_gains = [model.norm, model.mtp.hnorm, model.mtp.enorm, model.mtp.norm_out]
    for layer in [*model.layers, model.mtp.layer]:
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


@pytest.mark.rule("tiny seeded V4-like model: ModelConfig, seeded weights")
def test_several_kv_heads_each_have_their_own_projection_norm_and_compressed_keys():
    """`n_kv_heads = 2`: KV head j is `kv_norm(rms(attn_norm(x)) @ wkv[:, j*hd:(j+1)*hd])`
    (its own slice of `wkv`, the shared per-head gain), the caches hold `[B, 2, T, hd]`, and
    the compressed keys of head j are those of head j alone (bit for bit)."""
    hd = GQA.cfg.head_dim
    x = np.random.default_rng(0).standard_normal((2, 9, GQA.cfg.hidden))
    layer = GQA.layers[1]
    keys = layer.key(x)
    assert keys.shape == (2, 2, 9, hd) and layer.wkv.shape == (GQA.cfg.hidden, 2 * hd)
    h = rms(x, layer.attn_norm)
    for j in range(2):
        assert close(keys[:, j], rms(h @ layer.wkv[:, j * hd:(j + 1) * hd], layer.kv_norm))
    comp = layer.compressed_keys(keys, [0, 3])
    assert comp.shape == (2, 2, 2, hd)
    for j in range(2):
        assert np.array_equal(comp[:, j:j + 1], layer.compressed_keys(keys[:, j:j + 1], [0, 3]))
    cache = GQA.new_cache()
    GQA.forward(np.array([[1, 2, 3, 4, 5]]), cache, [0])
    assert [s.k.current_data().shape for s in cache.slots] == [(1, 2, 5, hd)] * 2


def port_weights(pm: port.TinyModel) -> list[torch.Tensor]:
    out = [pm.embed, pm.norm, pm.lm_head, pm.mtp_heads.h_proj, pm.mtp_heads.e_proj,
           pm.mtp.hnorm, pm.mtp.enorm, pm.mtp.norm_out]
    return out + [getattr(lay, n) for lay in [*pm.layers, pm.mtp.layer] for n in lay.WEIGHTS]


def ref_weights(m: TinyModel) -> list[np.ndarray]:
    out = [m.embed, m.norm, m.lm_head, m.mtp_heads.h_proj, m.mtp_heads.e_proj, m.mtp.hnorm,
           m.mtp.enorm, m.mtp.norm_out]
    return out + [getattr(lay, n) for lay in [*m.layers, m.mtp.layer]
                  for n in port.DecoderLayer.WEIGHTS]


@pytest.mark.rule("the port model's weights, devices and dtypes, port")
def test_the_port_computes_with_the_references_own_weights():
    pm = port.TinyModel(MODEL)
    for got, want in zip(port_weights(pm), ref_weights(MODEL), strict=True):
        assert got.dtype == F64 and torch.equal(got, torch.from_numpy(want))


@pytest.mark.rule("the port model's weights, devices and dtypes, port")
def test_every_weight_and_table_is_on_the_models_device_in_its_dtype():
    pm = port.TinyModel(MODEL, torch.float16, "meta")
    assert pm.device == torch.device("meta") and pm.dtype == torch.float16
    assert all(w.device.type == "meta" and w.dtype == torch.float16 for w in port_weights(pm))
    for got, want in zip(port_weights(pm), ref_weights(MODEL), strict=True):
        assert got.shape == want.shape
    assert pm.mtp.embed is pm.embed and pm.mtp.lm_head is pm.lm_head
    assert pm.n_layers == 2 and pm.layers[1].ratio == 4
    assert pm.layers[0].theta == MODEL.layers[0].theta
    plain = port.TinyModel(MODEL)
    assert plain.device == torch.device("cpu") and plain.embed.dtype == F64


@pytest.mark.rule("the port model's weights, devices and dtypes, port")
def test_a_tier_a_model_has_the_mtp_heads_and_no_block():
    ref = TinyModel(ModelConfig(mtp="heads"))
    pm = port.TinyModel(ref)
    assert pm.mtp is None
    assert torch.equal(pm.mtp_heads.h_proj, torch.from_numpy(ref.mtp_heads.h_proj))
    assert torch.equal(pm.mtp_heads.e_proj, torch.from_numpy(ref.mtp_heads.e_proj))


@pytest.mark.rule("the port model's weights, devices and dtypes, port")
def test_rope_tables_grow_by_doubling_and_are_kept_per_theta():
    """A table is the first doubling of the initial size that covers the need; one per
    theta, kept; in the tables' dtype on their device (the model's own ones too)."""
    ropes = port.RopeTables(8, F64, "cpu", n_positions=4)
    a = ropes.get(10.0, 3)
    assert a.n_positions == 4 and ropes.get(10.0, 4) is a
    b = ropes.get(10.0, 9)
    assert b.n_positions == 16 and ropes.get(10.0, 16) is b and ropes.tables[10.0] is b
    c = ropes.get(20.0, 1)
    assert c.n_positions == 4 and ropes.get(10.0, 2) is b
    assert ropes.get(2.0, 8).n_positions == 8 and ropes.get(3.0, 5).n_positions == 8
    assert port.RopeTables(8, F64, "cpu").get(10.0, 1025).n_positions == 2048
    one = port.RopeTables(8, F64, "cpu", n_positions=1)
    assert one.get(1.0, 1).n_positions == 1 and one.get(2.0, 3).n_positions == 4
    assert b.cos.dtype == F64 and c.cos.device.type == "cpu"
    for dtype in (torch.float32, torch.bfloat16):
        pm = port.TinyModel(MODEL, dtype)
        assert pm.ropes.dtype == dtype
        for table in (port.RopeTables(8, dtype, "cpu").get(10.0, 3),
                      pm.ropes.get(MODEL.layers[0].theta, 5)):
            assert table.cos.dtype == table.sin.dtype == dtype
            assert table.cos.device.type == table.sin.device.type == "cpu"


# --- the target forward on the reference --------------------------------------------------------


def prefill_alone(model: TinyModel, tokens: list[int]) -> NormalCache:
    """A row's own cache holding its context, prefilled alone at offset 0."""
    cache = model.new_cache()
    if tokens:
        model.forward(np.array([tokens]), cache, [0])
    return cache


def front_aligned(model: TinyModel, caches: list[NormalCache]) -> tuple[NormalCache, list[int]]:
    """Test-side batch assembly (independent of reference.align): each row's live run shifted
    to end at the widest row's length, zeros in front, rows concatenated."""
    target = max(c.current_seq_len for c in caches)
    leads = [target - c.current_seq_len for c in caches]
    d = model.cfg.head_dim
    slots = []
    for layer in range(model.n_layers):
        halves = []
        for half in ("k", "v"):
            rows = []
            for c, lead in zip(caches, leads, strict=True):
                live = getattr(c.slots[layer], half).current_data()
                live = np.zeros((1, 1, 0, d)) if live is None else live
                rows.append(np.concatenate([np.zeros((1, 1, lead, d)), live], axis=2))
            data = np.concatenate(rows, axis=0)
            halves.append(SingleCache(model.cfg.max_seq_len, target, target, 0, None,
                                      data.copy() if target else None))
        slots.append(KvCache(*halves))
    return NormalCache(slots), leads


@pytest.mark.rule("target forward: K/V at the shared offset, the pre-norm hidden")
def test_forward_appends_every_layer_and_returns_the_pre_norm_hidden():
    cache = MODEL.new_cache()
    f1 = MODEL.forward(np.array([[1, 2, 3, 4, 5, 6]]), cache, [0])
    assert [s.current_seq_len for s in cache.slots] == [6, 6]
    f2 = MODEL.forward(np.array([[7, 8]]), cache, [6])
    assert [s.current_seq_len for s in cache.slots] == [8, 8]
    assert f2.logits.shape == (1, 2, 64) and f2.hidden.shape == (1, 2, 32)
    # logits are lm_head(final_norm(hidden)): the returned hidden is pre-norm
    assert close(f2.logits, rms(f2.hidden, MODEL.norm) @ MODEL.lm_head)
    assert not close(f2.hidden, rms(f2.hidden, MODEL.norm), rel=1e-3)
    # decoding the same tokens in one prefill gives the same hidden (causality, positions)
    f_all = MODEL.forward(np.array([[1, 2, 3, 4, 5, 6, 7, 8]]), MODEL.new_cache(), [0])
    assert close(f_all.hidden[:, 6:], f2.hidden) and close(f_all.hidden[:, :6], f1.hidden)


@pytest.mark.rule("tiny seeded V4-like model: ModelConfig, seeded weights")
def test_a_gqa_prefill_equals_its_incremental_decode():
    """Causality and positions with several KV heads: decoding tokens one step at a time
    gives the hidden states of one prefill of all of them (1e-12)."""
    tokens = np.array([[5, 1, 7, 2, 9, 3, 4, 8, 6]])
    whole = GQA.forward(tokens, GQA.new_cache(), [0])
    cache = GQA.new_cache()
    first = GQA.forward(tokens[:, :6], cache, [0])
    rest = [GQA.forward(tokens[:, t:t + 1], cache, [t]).hidden for t in range(6, 9)]
    assert close(whole.hidden[:, :6], first.hidden)
    assert close(whole.hidden[:, 6:], np.concatenate(rest, axis=1))


@pytest.mark.rule("What V4 captures: store_rows(seqlen_offsets, xs) of MtpHiddenCapture")
def test_forward_captures_the_pre_norm_hidden_of_every_position():
    cap = MtpHiddenCapture()
    MODEL.forward(np.array([[1, 2, 3]]), MODEL.new_cache(), [0], capture=cap)
    assert cap.take() is None  # disarmed: nothing stored
    cap.arm()
    cache = MODEL.new_cache()
    MODEL.forward(np.array([[1, 2, 3]]), cache, [0], capture=cap)
    f = MODEL.forward(np.array([[4, 5]]), cache, [3], capture=cap)
    offsets, hidden = cap.take()
    assert offsets.row(0) == 3 and offsets.values == (3,)
    assert np.array_equal(hidden, f.hidden) and hidden.shape == (1, 2, 32)
    # a ragged batch stores every row's own offset
    batched, leads = front_aligned(MODEL, [prefill_alone(MODEL, [1] * 6),
                                           prefill_alone(MODEL, [2] * 4)])
    MODEL.forward(np.array([[3], [4]]), batched, [6, 4], [6, 4], leads, capture=cap)
    offsets, hidden = cap.take()
    assert offsets.values == (6, 4) and hidden.shape == (2, 1, 32)


@pytest.mark.rule("target forward: K/V at the shared offset, the pre-norm hidden")
def test_the_target_forward_refuses_malformed_input_with_the_documented_texts():
    model = TinyModel(ModelConfig(seed=6))
    batched, leads = front_aligned(MODEL, [prefill_alone(MODEL, [1] * 6),
                                           prefill_alone(MODEL, [2] * 4)])
    with pytest.raises(ValueError, match="disagrees with the layout"):
        MODEL.forward(np.array([[3], [4]]), batched, [6], [6, 4], leads)
    with pytest.raises(ValueError, match="seqlen offsets for a batch of"):
        MODEL.forward(np.array([[3], [4]]), batched, [6, 4, 4], None, leads)
    for toks, text in ((np.array([1, 2, 3]), "tokens (3,) must be [B,T], B, T >= 1"),
                       (np.zeros((1, 0), dtype=np.int64), "tokens (1, 0) must be [B,T], B, T >= 1"),
                       (np.array([[1, 64]]), "tokens must be in [0, 64), got [1, 64]"),
                       (np.array([[-1, 3]]), "tokens must be in [0, 64), got [-1, 3]")):
        with refused(text):
            model.forward(toks, model.new_cache(), [0])
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


# --- a ragged batch is each row alone -------------------------------------------------------------


def run_ragged_case(model: TinyModel, lens: list[int], t: int, seed: int):
    rng = np.random.default_rng(seed)
    v = model.cfg.vocab
    ctx = [rng.integers(0, v, n).tolist() for n in lens]
    new = rng.integers(0, v, (len(lens), t))
    own = [prefill_alone(model, c) for c in ctx]
    batched, leads = front_aligned(model, own)
    control = batched.clone()
    fb = model.forward(new, batched, lens, lens, leads)
    alone = [model.forward(new[i: i + 1], own[i], [lens[i]]) for i in range(len(lens))]
    return fb, alone, batched, own, leads, control, new


def raw_base_of(t_q: int, window: int, t_k_full: int) -> int:
    return t_k_full - min(t_q + window - 1, t_k_full)


@pytest.mark.slow
@pytest.mark.rule("ragged target batch == each row alone",
                  "compressed keys are start-anchored per row")
@given(st.data())
def test_a_ragged_batch_is_each_row_run_alone(data):
    model = data.draw(st.sampled_from([MODEL, NARROW]), label="model")
    b = data.draw(st.integers(1, 4), label="B")
    lens = data.draw(st.lists(st.integers(0, 24), min_size=b, max_size=b), label="lens")
    t = data.draw(st.integers(1, 3), label="t_q")
    seed = data.draw(st.integers(0, 2 ** 31), label="seed")
    fb, alone, batched, own, leads, control, new = run_ragged_case(model, lens, t, seed)
    for i in range(b):
        assert close(fb.logits[i], alone[i].logits[0]), f"row {i} logits"
        assert close(fb.hidden[i], alone[i].hidden[0]), f"row {i} hidden"
        for layer in range(model.n_layers):  # the row's live run is its own cache
            live = batched.slots[layer].k.current_data()[i:i + 1, :, leads[i]:]
            assert close(live, own[i].slots[layer].k.current_data())
    # negative control: without row_q0 a row whose dead prefix the window reaches differs
    base = raw_base_of(t, model.cfg.sliding_window, max(lens) + t)
    exposed = [i for i in range(b) if leads[i] > base]
    note(f"leads {leads}, raw_base {base}, exposed rows {exposed}")
    if exposed:
        fn = model.forward(new, control, lens, None, leads)
        for i in exposed:
            assert np.max(np.abs(fn.logits[i] - alone[i].logits[0])) > 1e-8, f"row {i} unchanged"


@pytest.mark.rule("ragged target batch == each row alone")
def test_the_repository_ragged_fixture():
    """masks §5: lens [10, 8, 5], t_q 2, CSA, leads [0, 2, 5]: (a) each row alone, (b) with
    row_q0 None the shorter rows differ, (c) perturbing the dead prefix changes nothing
    (exactly), (d) the fixture is non-degenerate."""
    lens, t = [10, 8, 5], 2
    fb, alone, batched, own, leads, control, new = run_ragged_case(MODEL, lens, t, seed=11)
    # (d) every lead is inside the raw window, per-row compressed thresholds differ
    assert leads == [0, 2, 5]
    assert raw_base_of(t, MODEL.cfg.sliding_window, 12) == 0
    assert [(n + 1) // 4 for n in lens] == [2, 2, 1]
    for i in range(3):  # (a)
        assert close(fb.logits[i], alone[i].logits[0]) and close(fb.hidden[i], alone[i].hidden[0])
    fn = MODEL.forward(new, control.clone(), lens, None, leads)  # (b)
    assert np.max(np.abs(fn.logits[0] - fb.logits[0])) == 0.0  # the widest row: no dead prefix
    for i in (1, 2):
        assert np.max(np.abs(fn.logits[i] - fb.logits[i])) > 1e-3
    noisy = control.clone()  # (c) garbage in the dead prefix: exactly the same result
    for slot in noisy.slots:
        for half in (slot.k, slot.v):
            half.data[1, :, :2] = 1e3
            half.data[2, :, :5] = -7.0
    fp = MODEL.forward(new, noisy, lens, lens, leads)
    assert np.array_equal(fp.logits, fb.logits) and np.array_equal(fp.hidden, fb.hidden)


@pytest.mark.rule("a uniform row_q0 is the scalar path")
def test_a_uniform_row_q0_is_bit_identical_and_never_reaches_the_ragged_mask():
    own = [prefill_alone(MODEL, [i + 1] * 9) for i in range(3)]
    batched, leads = front_aligned(MODEL, own)
    assert leads == [0, 0, 0]
    new = np.array([[5, 6], [7, 8], [9, 10]])
    reset_dsv4_mask_stats()
    reset_rope_cohort_stats()
    f_vec = MODEL.forward(new, batched.clone(), [9, 9, 9], [9, 9, 9], leads)
    assert dsv4_mask_stats["ragged"] == 0 and dsv4_mask_stats["uniform"] == MODEL.n_layers
    assert rope_cohort_stats["per_sequence"] == 0
    f_none = MODEL.forward(new, batched.clone(), [9], None, None)
    assert np.array_equal(f_vec.logits, f_none.logits)
    assert np.array_equal(f_vec.hidden, f_none.hidden)
    # and a ragged batch does reach it, once per layer
    batched, leads = front_aligned(MODEL, [own[0], prefill_alone(MODEL, [1] * 4)])
    reset_dsv4_mask_stats()
    MODEL.forward(new[:2], batched, [9, 4], [9, 4], leads)
    assert dsv4_mask_stats == {"uniform": 0, "ragged": MODEL.n_layers}


@pytest.mark.rule("RoPE positions per row in the model")
def test_rope_positions_are_the_rows_own():
    """masks §11: rows at [10, 7] feeding 3 tokens rotate at [10, 11, 12] and [7, 8, 9],
    although the new tokens of both rows sit in cache columns 10..12. Layer 0's input is the
    embedding, so its cached K has an oracle written here."""
    batched, leads = front_aligned(MODEL, [prefill_alone(MODEL, [1] * 10),
                                           prefill_alone(MODEL, [2] * 7)])
    new = np.array([[1, 2, 3], [4, 5, 6]])
    MODEL.forward(new, batched, [10, 7], [10, 7], leads)
    layer0, cfg = MODEL.layers[0], MODEL.cfg
    k = batched.slots[0].k.current_data()
    assert k.shape[2] == 13
    for i, start in enumerate([10, 7]):
        for r in range(3):
            kv = rms(rms(MODEL.embed[new[i, r]], layer0.attn_norm) @ layer0.wkv, layer0.kv_norm)
            assert close(k[i, 0, 10 + r], rope_at(kv, start + r, cfg.rope_dims, cfg.rope_theta))
            at_column = rope_at(kv, 10 + r, cfg.rope_dims, cfg.rope_theta)
            assert start == 10 or not close(k[i, 0, 10 + r], at_column, rel=1e-6)


# --- the port's forward: layout checks, growth, capture ----------------------------------------


def cache_of(lens, layers=2) -> list[RaggedKv]:
    return in_place_cache(MODEL, kv_history(MODEL, lens, np.random.default_rng(0))[:layers])


@pytest.mark.rule("forward layout checks and cache growth, port")
def test_forward_refuses_malformed_tokens_caches_and_offsets_with_their_messages():
    """Every refusal's exact text, decided before any row grows; extra caches are ignored and
    the offsets, when given, must equal the rows' own lengths (one shared or one per row)."""
    pm = port.TinyModel(MODEL)
    cache = cache_of([6, 4])
    ok = torch.tensor([[3], [4]])
    skewed = cache_of([6, 4])
    skewed[1].lens = torch.tensor([6, 5])
    for args, kw, text in (
        ((torch.tensor([3, 4]), cache), {}, "tokens (2,) must be [B,T], B, T >= 1"),
        ((torch.zeros((2, 0), dtype=torch.int64), cache), {},
         "tokens (2, 0) must be [B,T], B, T >= 1"),
        ((torch.tensor([[3], [64]]), cache), {}, "tokens must be in [0, 64), got [3, 64]"),
        ((torch.tensor([[-1], [4]]), cache), {}, "tokens must be in [0, 64), got [-1, 4]"),
        ((ok, cache[:1]), {}, "cache has 1 layers for 2 layers"),
        ((ok, [cache[0], cache_of([6, 4, 1], 1)[0]]), {},
         "layer 1's cache (3 rows, lens [6, 4, 1]) disagrees with a batch of 2 at lens [6, 4]"),
        ((torch.tensor([[3]]), cache), {},
         "layer 0's cache (2 rows, lens [6, 4]) disagrees with a batch of 1 at lens [6, 4]"),
        ((ok, skewed), {},
         "layer 1's cache (2 rows, lens [6, 5]) disagrees with a batch of 2 at lens [6, 4]"),
        ((ok, cache), {"seqlen_offsets": [6, 4, 4]}, "3 seqlen offsets for a batch of 2"),
        ((ok, cache), {"seqlen_offsets": torch.tensor([5, 4])},
         "row 0: seqlen offset 5 disagrees with the layout (own length 6)"),
        ((ok, cache), {"seqlen_offsets": [6]},
         "row 1: seqlen offset 6 disagrees with the layout (own length 4)"),
        ((ok, cache), {"seqlen_offsets": [6, 5]},
         "row 1: seqlen offset 5 disagrees with the layout (own length 4)"),
    ):
        with refused(text):
            pm.forward(*args, **kw)
    assert [kv.host_lens().tolist() for kv in cache] == [[6, 4], [6, 4]]  # refused before
    out = pm.forward(ok, cache + cache_of([1, 1], 1), seqlen_offsets=[6, 4])  # extra: ignored
    assert out.logits.shape == (2, 1, 64) and out.hidden.shape == (2, 1, 32)
    assert [kv.host_lens().tolist() for kv in cache] == [[7, 5], [7, 5]]
    uniform = cache_of([5, 5])
    pm.forward(ok, uniform, seqlen_offsets=[5])
    assert uniform[0].host_lens().tolist() == [6, 6]


@pytest.mark.rule("forward layout checks and cache growth, port")
def test_growth_past_max_seq_len_is_refused_by_both_with_the_same_message():
    """Rows at 510 and 300 feeding 5 tokens into a 512-column cache with max_seq_len 512:
    the append's growth to 1024 is refused by both (CacheRefusal, same message)."""
    small = TinyModel(ModelConfig(max_seq_len=512))
    hist = kv_history(small, [510, 300], np.random.default_rng(3))
    batched, leads = front_aligned_batch(small, hist)
    new = np.ones((2, 5), dtype=np.int64)
    r = outcome(small.forward, new, batched, [510, 300], [510, 300], leads)
    p = outcome(port.TinyModel(small).forward, to_port(new), in_place_cache(small, hist))
    assert r[0] == "refused" and r[1] is CacheRefusal
    assert_same_refusal(p, r, "growth")


@pytest.mark.rule("MtpHiddenCapture of the pre-norm hidden, port")
def test_forward_captures_the_pre_norm_hidden_at_every_rows_own_offset():
    cap = MtpHiddenCapture()
    cap.arm()
    pm = port.TinyModel(MODEL, F64, DEVICE)
    f = pm.forward(torch.tensor([[3, 1], [4, 1]]), cache_of([6, 4]), capture=cap)
    offsets, hidden = cap.take()
    assert offsets.values == (6, 4)
    assert_bit_exact(hidden, f.hidden, "captured hidden")
    assert not torch.equal(port.rms_norm(f.hidden, pm.norm, MODEL.cfg.eps), f.hidden)
