"""The tiny seeded model and the MTP block (cache-and-draft.md §6.3, §10.1, §17.2;
masks-and-scheduling.md §4, §5, §11, §12).

Tolerances (float64 throughout): "the same as that row alone" is asserted to
`1e-12 * max(1, max|x|)` absolute. Both sides run the same float64 operations on the same
values; the only difference is that the batched row's softmax and `p @ v` also sum exactly
zero terms for its masked dead-prefix / missing-block columns, which can change BLAS
summation blocking (observed differences ~1e-16). Negative controls must differ by far more
(> 1e-8 in the property, > 1e-3 on the fixed fixture). Where nothing but masked columns can
differ (perturbing the dead prefix, a uniform `row_q0` vs None) the results are bit-identical.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, note
from hypothesis import strategies as st

from raggedspec.reference.attention import dsv4_mask_stats, reset_dsv4_mask_stats
from raggedspec.reference.cache import KvCache, NormalCache, SingleCache
from raggedspec.reference.dispatch import MtpHiddenCapture
from raggedspec.reference.errors import Refusal
from raggedspec.reference.model import (
    DecoderLayer,
    ModelConfig,
    TinyModel,
    extend_draft_cache,
)
from raggedspec.reference.rope import reset_rope_cohort_stats, rope_cohort_stats

MODEL = TinyModel()
NARROW = TinyModel(ModelConfig(compress_ratios=(4, 0, 3), sliding_window=5, seed=1))
EPS = ModelConfig().eps


# --- independent helpers -------------------------------------------------------------------


def close(a: np.ndarray, b: np.ndarray, rel: float = 1e-12) -> bool:
    """|a - b| <= rel * max(1, max|b|) elementwise (the file's documented tolerance)."""
    return bool(np.all(np.abs(a - b) <= rel * max(1.0, float(np.max(np.abs(b))))))


def my_rms(x, gain):
    return x / np.sqrt((x ** 2).mean(axis=-1, keepdims=True) + EPS) * gain


def my_rope(vec: np.ndarray, pos: int, rope_dims: int, theta: float) -> np.ndarray:
    """Rotate the last rope_dims dims of one vector as interleaved pairs at position pos."""
    out = vec.copy()
    d0 = vec.shape[-1] - rope_dims
    for k in range(rope_dims // 2):
        ang = pos * theta ** (-(2.0 * k) / rope_dims)
        a, b = vec[d0 + 2 * k], vec[d0 + 2 * k + 1]
        out[d0 + 2 * k] = a * np.cos(ang) - b * np.sin(ang)
        out[d0 + 2 * k + 1] = a * np.sin(ang) + b * np.cos(ang)
    return out


def prefill_alone(model: TinyModel, tokens: list[int]) -> NormalCache:
    """A row's own cache holding its context, prefilled alone at offset 0."""
    cache = model.new_cache()
    if tokens:
        model.forward(np.array([tokens]), cache, [0])
    return cache


def front_aligned(model: TinyModel, caches: list[NormalCache]) -> tuple[NormalCache, list[int]]:
    """Test-side batch assembly (independent of reference.align): each row's live run is
    shifted to end at the widest row's length, zeros in front, rows concatenated."""
    target = max(c.current_seq_len for c in caches)
    leads = [target - c.current_seq_len for c in caches]
    d = model.cfg.head_dim
    slots = []
    for layer in range(model.n_layers):
        halves = []
        for half in ("k", "v"):
            rows = []
            for c, lead in zip(caches, leads, strict=False):
                live = getattr(c.slots[layer], half).current_data()
                live = np.zeros((1, 1, 0, d)) if live is None else live
                rows.append(np.concatenate([np.zeros((1, 1, lead, d)), live], axis=2))
            data = np.concatenate(rows, axis=0)
            halves.append(SingleCache(model.cfg.max_seq_len, target, target, 0, None,
                                      data.copy() if target else None))
        slots.append(KvCache(*halves))
    return NormalCache(slots), leads


def raw_base_of(t_q: int, window: int, t_k_full: int) -> int:
    return t_k_full - min(t_q + window - 1, t_k_full)


# --- §17.2 the decode kit's shapes
# -----------------------------------------------------------------


@pytest.mark.rule("MTP decode kit: fuse and logits")
def test_mtp_decode_kit_step_shape():
    model = TinyModel(ModelConfig(hidden=16, vocab=32))
    block = model.mtp
    rng = np.random.default_rng(3)
    fused = block.fuse(rng.standard_normal((1, 16)), [5])
    assert fused.shape == (1, 16)
    assert block.logits(fused).shape == (1, 32)
    hidden = block.forward_step(fused[:, None, :], 0, block.new_draft_cache())
    assert hidden.shape == (1, 1, 16)
    assert block.logits(hidden[:, 0]).shape == (1, 32)


# --- weights and the target forward -----------------------------------------------------------


@pytest.mark.rule("tiny seeded V4-like model: ModelConfig, seeded weights")
def test_weights_are_seeded():
    a, b, c = TinyModel(), TinyModel(), TinyModel(ModelConfig(seed=7))
    assert np.array_equal(a.embed, b.embed) and np.array_equal(
        a.mtp.heads.h_proj, b.mtp.heads.h_proj
    )
    assert not np.array_equal(a.embed, c.embed)
    toks = np.array([[3, 1, 4, 1, 5]])
    fa, fb = a.forward(toks, a.new_cache(), [0]), b.forward(toks, b.new_cache(), [0])
    assert np.array_equal(fa.logits, fb.logits)
    assert TinyModel(ModelConfig(mtp="heads")).mtp is None


@pytest.mark.rule("tiny seeded V4-like model: ModelConfig, seeded weights")
def test_config_refuses_inconsistent_sizes():
    with pytest.raises(ValueError, match="rope_dims"):
        ModelConfig(rope_dims=3)
    with pytest.raises(ValueError, match="mtp"):
        ModelConfig(mtp="tier-c")
    for n_heads, n_kv in ((4, 3), (2, 0), (2, 4)):
        with pytest.raises(ValueError, match=f"n_kv_heads {n_kv} must be >= 1 and divide "
                                             f"n_heads {n_heads}"):
            ModelConfig(n_heads=n_heads, n_kv_heads=n_kv)


GQA = TinyModel(ModelConfig(n_heads=8, n_kv_heads=2, compress_ratios=(0, 4), seed=3))


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
    h = my_rms(x, layer.attn_norm)
    for j in range(2):
        assert close(keys[:, j], my_rms(h @ layer.wkv[:, j * hd:(j + 1) * hd], layer.kv_norm))
    comp = layer.compressed_keys(keys, [0, 3])
    assert comp.shape == (2, 2, 2, hd)
    for j in range(2):
        assert np.array_equal(comp[:, j:j + 1], layer.compressed_keys(keys[:, j:j + 1], [0, 3]))
    cache = GQA.new_cache()
    GQA.forward(np.array([[1, 2, 3, 4, 5]]), cache, [0])
    assert [s.k.current_data().shape for s in cache.slots] == [(1, 2, 5, hd)] * 2


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


@pytest.mark.rule("target forward: K/V at the shared offset, the pre-norm hidden")
def test_forward_appends_every_layer_and_returns_the_pre_norm_hidden():
    cache = MODEL.new_cache()
    f1 = MODEL.forward(np.array([[1, 2, 3, 4, 5, 6]]), cache, [0])
    assert [s.current_seq_len for s in cache.slots] == [6, 6]
    f2 = MODEL.forward(np.array([[7, 8]]), cache, [6])
    assert [s.current_seq_len for s in cache.slots] == [8, 8]
    assert f2.logits.shape == (1, 2, 64) and f2.hidden.shape == (1, 2, 32)
    # logits are lm_head(final_norm(hidden)): the returned hidden is pre-norm
    assert close(f2.logits, my_rms(f2.hidden, MODEL.norm) @ MODEL.lm_head)
    assert not close(f2.hidden, my_rms(f2.hidden, MODEL.norm), rel=1e-3)
    # decoding the same tokens in one prefill gives the same hidden (causality, positions)
    f_all = MODEL.forward(np.array([[1, 2, 3, 4, 5, 6, 7, 8]]), MODEL.new_cache(), [0])
    assert close(f_all.hidden[:, 6:], f2.hidden) and close(f_all.hidden[:, :6], f1.hidden)


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
    batched, leads = front_aligned(
        MODEL, [prefill_alone(MODEL, [1] * 6), prefill_alone(MODEL, [2] * 4)]
    )
    MODEL.forward(np.array([[3], [4]]), batched, [6, 4], [6, 4], leads, capture=cap)
    offsets, hidden = cap.take()
    assert offsets.values == (6, 4) and hidden.shape == (2, 1, 32)


@pytest.mark.rule("target forward: K/V at the shared offset, the pre-norm hidden")
def test_forward_refuses_offsets_that_disagree_with_the_layout():
    batched, leads = front_aligned(
        MODEL, [prefill_alone(MODEL, [1] * 6), prefill_alone(MODEL, [2] * 4)]
    )
    with pytest.raises(ValueError, match="disagrees with the layout"):
        MODEL.forward(np.array([[3], [4]]), batched, [6], [6, 4], leads)
    with pytest.raises(ValueError, match="seqlen offsets for a batch of"):
        MODEL.forward(np.array([[3], [4]]), batched, [6, 4, 4], None, leads)


# --- ragged batch == each row alone ------------------------------------------------------------


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


@pytest.mark.rule(
    "ragged target batch == each row alone",
    "compressed keys are start-anchored per row",
)
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
    c = max(lens)
    base = raw_base_of(t, model.cfg.sliding_window, c + t)
    exposed = [i for i in range(b) if leads[i] > base]
    note(f"leads {leads}, raw_base {base}, exposed rows {exposed}")
    if exposed:
        fn = model.forward(new, control, lens, None, leads)
        for i in exposed:
            assert np.max(np.abs(fn.logits[i] - alone[i].logits[0])) > 1e-8, (
                f"row {i} unchanged without row_q0"
            )


@pytest.mark.rule("ragged target batch == each row alone")
def test_the_repository_ragged_fixture():
    """masks §5: lens [10, 8, 5], t_q 2, CSA, leads [0, 2, 5]: (a) each row alone, (b) with
    row_q0 None the shorter rows differ, (c) perturbing the dead prefix changes nothing
    (exactly), (d) the fixture is non-degenerate."""
    lens, t = [10, 8, 5], 2
    fb, alone, batched, own, leads, control, new = run_ragged_case(MODEL, lens, t, seed=11)
    # (d) non-degenerate: every lead is inside the raw window, per-row compressed thresholds differ
    assert leads == [0, 2, 5]
    assert raw_base_of(t, MODEL.cfg.sliding_window, 12) == 0
    assert [(n + 1) // 4 for n in lens] == [2, 2, 1]
    # (a)
    for i in range(3):
        assert close(fb.logits[i], alone[i].logits[0]) and close(fb.hidden[i], alone[i].hidden[0])
    # (b)
    fn = MODEL.forward(new, control.clone(), lens, None, leads)
    assert np.max(np.abs(fn.logits[0] - fb.logits[0])) == 0.0  # the widest row has no dead prefix
    for i in (1, 2):
        assert np.max(np.abs(fn.logits[i] - fb.logits[i])) > 1e-3
    # (c) garbage in the dead prefix: exactly the same result
    noisy = control.clone()
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
    assert np.array_equal(f_vec.logits, f_none.logits) and np.array_equal(
        f_vec.hidden, f_none.hidden
    )
    # and a ragged batch does reach it, once per layer
    batched, leads = front_aligned(MODEL, [own[0], prefill_alone(MODEL, [1] * 4)])
    reset_dsv4_mask_stats()
    MODEL.forward(new[:2], batched, [9, 4], [9, 4], leads)
    assert dsv4_mask_stats == {"uniform": 0, "ragged": MODEL.n_layers}


@pytest.mark.rule("compressed keys are start-anchored per row")
def test_compressed_keys_are_start_anchored_per_row():
    """Block j of row i is the mean of the row's own un-rotated keys j*r .. j*r+r-1, rotated
    at j*r with compress_rope_theta; a shorter row's missing blocks are zeros."""
    layer: DecoderLayer = MODEL.layers[1]
    assert layer.ratio == 4
    cfg = MODEL.cfg
    rng = np.random.default_rng(5)
    lens, width = [11, 6], 11
    raw = [rng.standard_normal((n, cfg.head_dim)) for n in lens]
    keys = np.zeros((2, 1, width, cfg.head_dim))
    for i, n in enumerate(lens):  # cache holds keys rotated at the row's own positions
        keys[i, 0, width - n :] = [
            my_rope(raw[i][p], p, cfg.rope_dims, layer.theta) for p in range(n)
        ]
    comp = layer.compressed_keys(keys, [0, 5])
    assert comp.shape == (2, 1, 2, cfg.head_dim)
    for i, n in enumerate(lens):
        for j in range(n // 4):
            want = my_rope(
                raw[i][4 * j : 4 * j + 4].mean(axis=0),
                4 * j,
                cfg.rope_dims,
                cfg.compress_rope_theta,
            )
            assert close(comp[i, 0, j], want)
    assert np.array_equal(comp[1, 0, 1], np.zeros(cfg.head_dim))
    assert layer.compressed_keys(keys[:, :, :3], [0, 0]) is None  # no complete block anywhere


# --- the MTP block -----------------------------------------------------------------------------


@pytest.mark.rule("draft KV created by MtpBlock::new_draft_cache")
def test_new_draft_cache_is_an_empty_capacity_16_slot():
    c = MODEL.mtp.new_draft_cache()
    assert (c.kind, c.current_seq_len, c.k.capacity_seq_len, c.k.max_seq_len) == (
        "Normal",
        0,
        16,
        4096,
    )


@pytest.mark.rule("forward_tokens_rows and its wrappers")
def test_the_mtp_step_refuses_a_desynced_draft_cache():
    block = MODEL.mtp
    cache = block.new_draft_cache()
    rng = np.random.default_rng(0)
    extend_draft_cache(block, cache, rng.standard_normal((7, 32)), list(range(7)), 0)
    fused = block.fuse(rng.standard_normal((1, 1, 32)), [[1]])
    with pytest.raises(Refusal) as err:
        block.forward_step(fused, 6, cache)
    assert "desync" in str(err.value) and "6" in str(err.value) and "7" in str(err.value)
    with pytest.raises(Refusal, match="2 absolute position"):
        block.forward_step_rows(np.repeat(fused, 3, axis=0), [7, 4], cache)
    assert cache.current_seq_len == 7  # refused before anything was appended
    block.forward_step(fused, 7, cache)
    assert cache.current_seq_len == 8


@pytest.mark.rule("draft-KV slot invariant: slot k holds (h_k, tok_{k+1}) at absolute k")
def test_draft_kv_slot_k_is_the_mtp_state_of_its_pair_at_position_k():
    """Independent oracle: slot k's K = RoPE_k(kv_norm(attn_norm(fused) @ wkv)) with
    fused = h_proj(hnorm(h_k)) + e_proj(enorm(embed(tok_{k+1}))), RoPE at absolute k."""
    block, cfg = MODEL.mtp, MODEL.cfg
    layer = block.layer
    rng = np.random.default_rng(9)
    h = rng.standard_normal((6, 32))
    nxt = rng.integers(0, 64, 6)
    cache = block.new_draft_cache()
    extend_draft_cache(block, cache, h[:4], nxt[:4], 0)
    extend_draft_cache(block, cache, h[4:], nxt[4:], 4)
    assert cache.current_seq_len == 6
    for k in range(6):
        fused = (
            my_rms(h[k], block.hnorm) @ block.heads.h_proj
            + my_rms(MODEL.embed[nxt[k]], block.enorm) @ block.heads.e_proj
        )
        kv = my_rms(my_rms(fused, layer.attn_norm) @ layer.wkv, layer.kv_norm)
        want = my_rope(kv, k, cfg.rope_dims, cfg.rope_theta)
        assert close(cache.k.data[0, 0, k], want) and close(cache.v.data[0, 0, k], want)


@pytest.mark.rule("RoPE positions per row in the model")
def test_rope_positions_are_the_rows_own():
    """masks §11: rows at [10, 7] feeding 3 tokens rotate at [10, 11, 12] and [7, 8, 9],
    although the new tokens of both rows sit in cache columns 10..12. Layer 0's input is the
    embedding, so its cached K has an independent oracle."""
    own = [prefill_alone(MODEL, [1] * 10), prefill_alone(MODEL, [2] * 7)]
    batched, leads = front_aligned(MODEL, own)
    new = np.array([[1, 2, 3], [4, 5, 6]])
    MODEL.forward(new, batched, [10, 7], [10, 7], leads)
    layer0, cfg = MODEL.layers[0], MODEL.cfg
    k = batched.slots[0].k.current_data()
    assert k.shape[2] == 13
    for i, start in enumerate([10, 7]):
        for r in range(3):
            kv = my_rms(
                my_rms(MODEL.embed[new[i, r]], layer0.attn_norm) @ layer0.wkv, layer0.kv_norm
            )
            assert close(k[i, 0, 10 + r], my_rope(kv, start + r, cfg.rope_dims, cfg.rope_theta))
            assert (
                not close(
                    k[i, 0, 10 + r], my_rope(kv, 10 + r, cfg.rope_dims, cfg.rope_theta), rel=1e-6
                )
                or start == 10
            )
