"""The torch backend's `forward` and `mtp_step` (`gpu/backend.py`) against the NumPy reference
backend on small explicit cases the per-method properties do not reach: every malformed-input
refusal of the forward with the reference's text, decided before the cache changes (the first
offending row named, with one shared offset or one per row); tokens read as int64; the general
forward's compressed keys when no row has a complete block yet, when a row's live run ends at
the last physical column, and when a row's first query reaches past the RoPE table built so
far; a forward and an MTP step on a K/V slot whose buffer is not a whole number of blocks wide;
and `mtp_step` on a plain K/V slot (uniform and front-aligned ragged groups, its refusals, the
slot left as it was) and its position-count refusal on a draft KV. The comparison policy is
test_backend.py's (conformance/backends.py): integers and lengths exact, float64 within 1e-12.
"""

from __future__ import annotations

import numpy as np
import pytest

from raggedspec.conformance.backends import assert_close, assert_exact, assert_same_cache
from raggedspec.gpu.backend import TorchBackend
from raggedspec.reference.backend import NumpyBackend
from raggedspec.reference.cache import NormalCache
from raggedspec.reference.errors import CacheRefusal, DispatchRefusal
from raggedspec.reference.model import ModelConfig

REF = NumpyBackend()
PORT = TorchBackend(dtype="float64")
BOTH = (PORT, REF)
_MODELS: dict = {}


def model_of(be, cfg):
    """The backend's model of `cfg`, built once per backend."""
    key = (be.name, cfg)
    if key not in _MODELS:
        _MODELS[key] = be.build_model(cfg)
    return _MODELS[key]


def _prompt(be, model, cfg, n):
    """A one-row target cache after an n-token prompt (ids `0..n-1` mod vocab), XsRolling fed."""
    cache = be.new_target_cache(cfg, cfg.max_seq_len, 1)
    fwd = be.forward(model, np.arange(n)[None] % cfg.vocab, cache, [0], None, None)
    be.xs_append(cache, fwd.hidden)
    return be.clone_out(cache, 1)[0]


def _batch(be, model, cfg, b, n):
    """A batched target cache of b rows after one uniform n-token prompt."""
    cache = be.new_target_cache(cfg, cfg.max_seq_len, b)
    fwd = be.forward(model, (np.arange(b * n).reshape(b, n) * 3) % cfg.vocab, cache, [0], None,
                     None)
    be.xs_append(cache, fwd.hidden)
    return cache


def _refusal(exc, fn, *args):
    """`fn(*args)` raises `exc`; its message."""
    with pytest.raises(exc) as info:
        fn(*args)
    return str(info.value)


# --- forward: malformed input ------------------------------------------------------------------


CFG = ModelConfig(compress_ratios=(0, 4))


@pytest.mark.rule("the target forward on the in-place layout, backend, port")
@pytest.mark.parametrize(
    "tokens,offsets,leads,message",
    [
        (np.zeros(3, np.int64), [0], None, "tokens (3,) must be [B,T], B, T >= 1"),
        (np.zeros((2, 0), np.int64), [0], None, "tokens (2, 0) must be [B,T], B, T >= 1"),
        (np.zeros((2, 1), np.int64), [5, 5, 5], None, "3 seqlen offsets for a batch of 2"),
        (np.zeros((2, 1), np.int64), [5], [0], "1 leads for a batch of 2"),
        # one shared offset: row 1 is the first whose own position C - lead is not it
        (np.zeros((2, 1), np.int64), [5], [0, 2],
         "row 1: seqlen offset 5 disagrees with the layout (cache 5, lead 2)"),
        # one offset per row: only row 1 disagrees, then both (row 0 named)
        (np.zeros((2, 1), np.int64), [5, 4], None,
         "row 1: seqlen offset 4 disagrees with the layout (cache 5, lead 0)"),
        (np.zeros((2, 1), np.int64), [3, 4], [1, 0],
         "row 0: seqlen offset 3 disagrees with the layout (cache 5, lead 1)"),
        (np.zeros((2, 1), np.int64), [4, 4], [0, 1],
         "row 0: seqlen offset 4 disagrees with the layout (cache 5, lead 0)"),
        (np.full((2, 1), CFG.vocab), [5], None, f"tokens must be in [0, {CFG.vocab}), got "
                                               f"[{CFG.vocab}, {CFG.vocab}]"),
        (np.array([[3], [-1]]), [5], None, f"tokens must be in [0, {CFG.vocab}), got [-1, 3]"),
    ],
)
def test_a_malformed_forward_is_refused_with_the_references_message(
    tokens, offsets, leads, message
):
    """M §4, §11: a token array that is not [B,T] with B, T >= 1, an offset or lead count
    that is neither 1 nor B, a row whose offset is not its own position `C - lead_i` (the
    first such row named, its offset the shared one or its own) and a token outside the
    vocabulary: ValueError with the reference's text, word for word, on a uniform batch of
    two rows holding 5 tokens; the K/V slots keep their lengths and contents."""
    for be in BOTH:
        model = model_of(be, CFG)
        cache = _batch(be, model, CFG, 2, 5)
        before = be.materialize(cache)
        assert _refusal(ValueError, be.forward, model, tokens, cache, offsets, None,
                        leads) == message, be.name
        after = be.materialize(cache)
        assert_exact(after["len"], before["len"], f"{be.name}: length after the refusal")
        for (k0, _), (k1, _) in zip(before["kv"], after["kv"], strict=True):
            assert_exact(k1, k0, f"{be.name}: K after the refusal")


@pytest.mark.rule("the target forward on the in-place layout, backend, port")
def test_a_forward_on_too_few_slots_is_refused_with_the_references_message():
    """A cache with fewer slots than the model has layers: ValueError naming both counts."""
    cfg = ModelConfig(compress_ratios=(0, 0))
    for be in BOTH:
        cache = NormalCache(be.new_target_cache(cfg, 64, 1).slots[:1])
        assert _refusal(ValueError, be.forward, model_of(be, cfg), [[1]], cache, [0], None,
                        None) == "cache has 1 slots for 2 layers"


@pytest.mark.rule("the target forward on the in-place layout, backend, port")
def test_the_port_refuses_to_decode_on_an_unmaterialized_cache_of_nonzero_length():
    """A K/V slot set to length 3 before anything was appended holds no rows the port could
    place; its forward refuses (ValueError naming the length) and the slots stay unmaterialized.
    (The reference decodes it as three zero columns.)"""
    cfg = ModelConfig(compress_ratios=(0, 0))
    cache = PORT.new_target_cache(cfg, 64, 2)
    for slot in cache.slots:
        PORT.kv_set_len(slot, 3)
    assert _refusal(ValueError, PORT.forward, model_of(PORT, cfg), np.zeros((2, 1), int),
                    cache, [3], None, None) == (
        "an unmaterialized cache of length 3 cannot be decoded on")
    assert PORT.materialize(cache)["kv"] == [(None, None), (None, None)]


@pytest.mark.rule("the target forward on the in-place layout, backend, port")
def test_the_port_refuses_a_dead_prefix_longer_than_a_rows_alignment_offset():
    """Per-row query positions that would make a row of a uniform batch (alignment offsets
    all 0, a fresh batch's int64 zeros) treat one of its own columns as dead: the port's
    layout cannot express it, ValueError naming both vectors as integers."""
    cfg = ModelConfig(compress_ratios=(0,))
    model = model_of(PORT, cfg)
    cache = _batch(PORT, model, cfg, 2, 4)
    assert _refusal(ValueError, PORT.forward, model, np.zeros((2, 1), int), cache, [4],
                    [4, 3], None) == (
        "rows would need dead prefixes [0, 1] longer than their alignment offsets [0, 0]")


@pytest.mark.rule("the target forward on the in-place layout, backend, port")
@pytest.mark.parametrize("tokens", [[[3.0, 17.0], [5.0, 1.0]], [["3", "17"], ["5", "1"]]])
def test_tokens_are_read_as_int64_ids(tokens):
    """M §4: the forward reads `tokens` as int64 ids (the reference's `np.asarray(tokens,
    dtype=np.int64)`): float ids and decimal strings decode as the integer ids, the same
    logits as the integer array gives, on both backends."""
    got = {}
    for be in BOTH:
        model = model_of(be, CFG)
        fwd = be.forward(model, tokens, _batch(be, model, CFG, 2, 3), [3], None, None)
        ints = be.forward(model, [[3, 17], [5, 1]], _batch(be, model, CFG, 2, 3), [3], None,
                          None)
        got[be.name] = be.to_numpy(fwd.logits)
        assert_exact(got[be.name], be.to_numpy(ints.logits), f"{be.name}: logits")
    assert_close(got["torch"], got["numpy"], "float64", "logits")


# --- forward: the general path's compressed keys -----------------------------------------------


def _ragged_step(be, model, cfg, lens, t, row_masks):
    """Clone-in of one-row caches of `lens` tokens (front-aligned, lead_pad reported), then a
    t-token forward: with per-row query positions and no dead prefix given (`row_masks`), or
    with the dead prefix given and no per-row query positions. Hidden, logits and the batch."""
    ci = be.clone_in([_prompt(be, model, cfg, n) for n in lens], [0] * len(lens), True, True)
    c = be.cache_len(ci.batched)
    assert any(ci.lead_pad), "the batch must be ragged"
    tokens = (np.arange(len(lens) * t).reshape(len(lens), t) * 5 + 2) % cfg.vocab
    if row_masks:
        fwd = be.forward(model, tokens, ci.batched, [c], [c - x for x in ci.lead_pad], None)
    else:
        fwd = be.forward(model, tokens, ci.batched, [c - x for x in ci.lead_pad], None,
                         ci.lead_pad)
    return be.to_numpy(fwd.hidden), be.to_numpy(fwd.logits), be.materialize(ci.batched)


def _same_step(cfg, lens, t, row_masks, models=None):
    out = []
    for be in BOTH:
        model = model_of(be, cfg) if models is None else models[be.name]
        out.append(_ragged_step(be, model, cfg, lens, t, row_masks))
    (ph, pl, pc), (rh, rl, rc) = out
    assert_close(ph, rh, "float64", "hidden")
    assert_close(pl, rl, "float64", "logits")
    assert_same_cache(pc, rc, "float64", "batched cache after the forward")


@pytest.mark.rule("the target forward on the in-place layout, backend, port")
@pytest.mark.parametrize("row_masks", [False, True])
@pytest.mark.parametrize("lens", [(2, 1), (3, 1, 2)])
def test_a_ragged_step_before_any_complete_block_matches_the_reference(lens, row_masks):
    """M §13: a ragged batch decoded through a ratio-4 layer while no row's live run holds a
    complete block yet (at most 3 columns after the step): no compressed keys at all, the
    raw window alone, as the reference; with the dead prefix given or with row positions."""
    _same_step(ModelConfig(compress_ratios=(0, 4)), lens, 1, row_masks)


@pytest.mark.rule("the target forward on the in-place layout, backend, port")
def test_a_live_run_ending_at_the_last_physical_column_compresses_it():
    """M §13: the longest row holds 511 tokens and the step's one more fills its 512-column
    buffer exactly, so its last complete block ends at the last physical column; the shorter
    row's compressed window reaches past the buffer (those columns are no block of its own).
    Hidden, logits and cache as the reference's."""
    _same_step(ModelConfig(compress_ratios=(0, 4)), (511, 200), 1, False)


@pytest.mark.rule("the target forward on the in-place layout, backend, port")
def test_a_step_past_the_rope_table_built_so_far_matches_the_reference():
    """M §11: a fresh model's RoPE table covers the positions its prompts used (1023 here);
    a general-path step of two tokens whose last position is 1024 rotates there too (the
    table grows to cover `offset + t`), as the reference."""
    cfg = ModelConfig(compress_ratios=(4,), max_seq_len=2048)
    _same_step(cfg, (1023, 3), 2, False, {be.name: be.build_model(cfg) for be in BOTH})


# --- an unaligned buffer ------------------------------------------------------------------------


def _unaligned(be, cfg):
    """A K/V slot of max_seq_len 1030 given 600 columns at once: capacity 1024 (512 + one
    block), the port's buffer exactly 600 wide."""
    k = np.random.default_rng(3).standard_normal((1, cfg.n_kv_heads, 600, cfg.head_dim))
    return be.kv_from_arrays(k, k, 1030, 512)


@pytest.mark.rule("the target forward on the in-place layout, backend, port")
def test_a_forward_on_a_buffer_that_is_not_whole_blocks_wide_matches_the_reference():
    """C §3: a slot holding 600 of 1024 columns takes one more token without growing (its
    capacity is the reference's 1024, never 600 + 512 = 1112 > 1030): hidden and slot as the
    reference's."""
    cfg = ModelConfig(compress_ratios=(0,), max_seq_len=1030)
    out = []
    for be in BOTH:
        cache = NormalCache([_unaligned(be, cfg)])
        fwd = be.forward(model_of(be, cfg), [[9]], cache, [600], None, None)
        out.append((be.to_numpy(fwd.hidden), be.materialize(cache)))
    assert_close(out[0][0], out[1][0], "float64", "hidden")
    assert_same_cache(out[0][1], out[1][1], "float64", "slot after the forward")
    assert out[0][1]["capacity"] == [1024]


@pytest.mark.rule("the MTP step on a K/V slot and on a draft KV, backend, port")
def test_an_mtp_step_on_a_buffer_that_is_not_whole_blocks_wide_matches_the_reference():
    """C §3, §10.1: the same slot as a draft K/V slot takes one MTP step without growing past
    its capacity 1024: hidden and slot as the reference's."""
    cfg = ModelConfig(max_seq_len=1030)
    fused = np.random.default_rng(4).standard_normal((1, 1, cfg.hidden))
    out = []
    for be in BOTH:
        kv = _unaligned(be, cfg)
        out.append((be.to_numpy(be.mtp_step(model_of(be, cfg), fused, [600], kv)),
                    be.materialize(kv)))
    assert_close(out[0][0], out[1][0], "float64", "hidden")
    assert_same_cache(out[0][1], out[1][1], "float64", "slot after the step")


# --- mtp_step on a K/V slot ---------------------------------------------------------------------


MTP = ModelConfig()


def _slots(be, lens, capacity=16, max_seq_len=4096):
    """Single-row K/V slots of `lens` columns (small integers, exact in every dtype)."""
    rng = np.random.default_rng(sum(lens))
    out = []
    for n in lens:
        k = rng.integers(-4, 5, (1, MTP.n_kv_heads, n, MTP.head_dim)).astype(np.float64)
        out.append(be.kv_from_arrays(k, k, max_seq_len, capacity))
    return out


@pytest.mark.rule("the MTP step on a K/V slot and on a draft KV, backend, port")
def test_mtp_steps_on_a_uniform_kv_slot_match_the_reference():
    """C §10.1 on a two-row K/V slot holding 3 entries: a one-token step of both rows (one
    position per row), then a two-token step at the one shared position 4: each step's
    pre-norm hidden and the slot after it (length 4, then 6) as the reference's."""
    k = np.random.default_rng(1).integers(-4, 5, (2, 1, 3, MTP.head_dim)).astype(np.float64)
    kvs = {be.name: be.kv_from_arrays(k, k, 4096, 16) for be in BOTH}
    for t, pos, n in ((1, [3, 3], 4), (2, [4], 6)):
        fused = np.random.default_rng(t).standard_normal((2, t, MTP.hidden))
        got = {be.name: be.to_numpy(be.mtp_step(model_of(be, MTP), fused, pos, kvs[be.name]))
               for be in BOTH}
        assert_close(got["torch"], got["numpy"], "float64", f"hidden of the {t}-token step")
        assert_exact(PORT.kv_len(kvs["torch"]), n, "slot length")
        assert_same_cache(PORT.materialize(kvs["torch"]), REF.materialize(kvs["numpy"]),
                          "float64", f"slot after the {t}-token step")


@pytest.mark.rule("the MTP step on a K/V slot and on a draft KV, backend, port")
def test_an_mtp_step_on_a_front_aligned_ragged_group_matches_the_reference():
    """C §9.3, §10.1: rows of 5 and 3 entries front-aligned to 5 (`front_align_draft_group`)
    take one step at their own positions [5, 3]: hidden and slot as the reference's."""
    out = []
    fused = np.random.default_rng(2).standard_normal((2, 1, MTP.hidden))
    for be in BOTH:
        kv = be.front_align_draft_group(_slots(be, (5, 3)), [5, 3])
        out.append((be.to_numpy(be.mtp_step(model_of(be, MTP), fused, [5, 3], kv)),
                    be.materialize(kv)))
    assert_close(out[0][0], out[1][0], "float64", "hidden")
    assert_same_cache(out[0][1], out[1][1], "float64", "slot after the step")


@pytest.mark.rule("the MTP step on a K/V slot and on a draft KV, backend, port")
@pytest.mark.parametrize(
    "lens,t,pos,exc,message",
    [
        ((3, 3), 1, [4], DispatchRefusal,
         "MTP draft KV desync: cache holds 3 entries but the step's rows end at absolute "
         "position 4 (start_pos [4]); a ragged group must be left-aligned so every row ends "
         "at the cache's end column"),
        ((3, 3), 1, [3, 3, 3], DispatchRefusal,
         "3 absolute position(s) for a batch of 2: [3, 3, 3]"),
        ((3, 3), 1, [], DispatchRefusal,
         "the MTP draft step was given no absolute position at all (batch of 2)"),
        ((16,), 1, [16], CacheRefusal, "kv-cache capacity 528 would be above max_seq_len 20"),
    ],
)
def test_a_refused_mtp_step_on_a_kv_slot_leaves_it_as_it_was(lens, t, pos, exc, message):
    """C §10.1, §3: a step whose positions do not end at the slot's length, a position count
    neither 1 nor G, no position at all, or a step the slot cannot grow for (16 of 16 held,
    max_seq_len 20): the reference's refusal, word for word, and the slot unchanged."""
    for be in BOTH:
        rows = _slots(be, lens, 16, 20)
        kv = rows[0] if len(rows) == 1 else be.concat(rows)
        before = be.materialize(kv)
        fused = np.ones((len(lens), t, MTP.hidden))
        assert _refusal(exc, be.mtp_step, model_of(be, MTP), fused, pos, kv) == message
        assert_same_cache(be.materialize(kv), before, "float64", f"{be.name}: slot after")


@pytest.mark.rule("the MTP step on a K/V slot and on a draft KV, backend, port")
def test_a_draft_kv_refuses_more_positions_than_rows_before_it_changes():
    """C §10.1 on a sequence's draft KV (the port: its pool row): a one-row step of two tokens
    given two positions is one position per ROW too many: the reference's DispatchRefusal,
    and the draft KV stays empty and unmaterialized."""
    fused = np.ones((1, 2, MTP.hidden))
    for be in BOTH:
        kv = be.new_draft_cache(model_of(be, MTP))
        assert _refusal(DispatchRefusal, be.mtp_step, model_of(be, MTP), fused, [0, 0],
                        kv) == "2 absolute position(s) for a batch of 1: [0, 0]"
        view = be.materialize(kv)
        assert (view["len"], view["kv"], view["capacity"]) == (0, [(None, None)], [16]), be.name
