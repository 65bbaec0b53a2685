"""The target forward and the MTP step through the backend protocol (`forward`, `mtp_step`,
with `clone_in`, `commit` and the K/V slot methods around them) on the torch backend against
the NumPy reference backend, on the explicit cases the per-method properties of
test_backend.py do not reach: every malformed-input refusal of the forward with the reference's
text, decided before the cache changes; the port's own refusals; tokens read as int64; the
port's general forward (RoPE offsets or compressed-key starts that are not the rows' own
lengths: a ragged cohort without per-row masks, per-row query positions without a dead prefix)
and when it is taken; compressed keys before any complete block, at the last physical column
and past the RoPE table built so far; a buffer that is not whole blocks wide; `mtp_step` on a
K/V slot and on a draft KV. Policy (conformance/backends.py): integers, lengths and texts
exact, float64 within 1e-12.
"""

from __future__ import annotations

import numpy as np
import pytest

from raggedspec.conformance.backends import assert_close, assert_exact, assert_same_cache
from raggedspec.conformance.helpers import built_model, prompt_cache
from raggedspec.gpu.backend import TorchBackend
from raggedspec.gpu.testing import DEVICE
from raggedspec.reference.backend import NumpyBackend
from raggedspec.reference.cache import NormalCache
from raggedspec.reference.dispatch import MtpHiddenCapture
from raggedspec.reference.errors import AlignRefusal, CacheRefusal, DispatchRefusal, Refusal
from raggedspec.reference.model import ModelConfig

REF = NumpyBackend()
PORT = TorchBackend(str(DEVICE), "float64")
BOTH = (PORT, REF)
CFG = ModelConfig(compress_ratios=(0, 4))
model_of = built_model


def own(be, cfg, n):
    """A one-row cache of an n-token prompt (ids `0..n-1` mod vocab), XsRolling fed."""
    return prompt_cache(be, model_of(be, cfg), np.arange(n) % cfg.vocab)


def batch(be, cfg, b, n):
    """A batched target cache of b rows after one uniform n-token prompt."""
    cache = be.new_target_cache(cfg, cfg.max_seq_len, b)
    toks = (np.arange(b * n).reshape(b, n) * 3) % cfg.vocab
    be.xs_append(cache, be.forward(model_of(be, cfg), toks, cache, [0], None, None).hidden)
    return cache


def refused_with(exc, fn, *args):
    """`fn(*args)` raises `exc`; its message."""
    with pytest.raises(exc) as info:
        fn(*args)
    return str(info.value)


# --- clone-in and commit around a step ------------------------------------------------------------


@pytest.mark.rule("one verify step through the target-cache rules, backend",
                  "the port's per-sequence caches and clone-in")
@pytest.mark.parametrize("be", BOTH, ids=["torch", "numpy"])
def test_clone_in_aligns_first_under_per_sequence(be):
    """C §5.4: under PerSequence the front alignment runs before the clone-in and its
    refusal propagates (an XsRolling slot with the xs flag off: CacheRefusal, whatever the
    pending leads); the cohort path refuses the ragged batch in the clone-in instead
    (AlignRefusal); with the flag on the rows are aligned, leads [2, 0]."""
    cfg = ModelConfig()
    want = refused_with(CacheRefusal, REF.clone_in, [own(REF, cfg, 3), own(REF, cfg, 5)],
                        [0, 0], False, True)
    assert want.startswith("sequence 0 slot 2: front_pad to 5: an XsRolling slot cannot be "
                           "front-padded")
    for pending in ([0, 0], []):
        assert refused_with(CacheRefusal, be.clone_in, [own(be, cfg, 3), own(be, cfg, 5)],
                            pending, False, True) == want
    assert "must share current_seq_len" in refused_with(
        AlignRefusal, be.clone_in, [own(be, cfg, 3), own(be, cfg, 5)], [0, 0], False, False)
    ci = be.clone_in([own(be, cfg, 3), own(be, cfg, 5)], [0, 0], True, True)
    assert ci.lead_pad == [2, 0] and be.cache_len(ci.batched) == 5


@pytest.mark.rule("K/V append, growth and set_len, backend",
                  "one verify step through the target-cache rules, backend")
@pytest.mark.parametrize("kv_len, xs_len", [(7, 6), (7, 8)])
def test_commit_sets_kv_and_xs_slots_to_their_own_lengths(kv_len, xs_len):
    """C §5.5: a commit with no strip sets every K/V slot `set_len(kv_len)`, every XsRolling
    slot `set_len(xs_len)`, on both backends alike."""
    views = []
    for be in BOTH:
        cache = own(be, ModelConfig(), 9)
        be.commit(cache, 0, kv_len, xs_len)
        views.append(be.materialize(cache))
    assert views[1]["len"] == kv_len and [k.shape[2] for k, _ in views[1]["kv"]] == [kv_len] * 2
    assert [x["tokens"] for x in views[1]["xs"]] == [[xs_len]]
    assert_same_cache(*views, "float64", "after the commit")


# --- the forward: malformed input -----------------------------------------------------------------


@pytest.mark.rule("the target forward on the in-place layout, backend, port")
@pytest.mark.parametrize("tokens,offsets,leads,message", [
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
    (np.full((2, 1), CFG.vocab), [5], None,
     f"tokens must be in [0, {CFG.vocab}), got [{CFG.vocab}, {CFG.vocab}]"),
    (np.array([[3], [-1]]), [5], None, f"tokens must be in [0, {CFG.vocab}), got [-1, 3]"),
])
def test_a_malformed_forward_is_refused_with_the_references_message(tokens, offsets, leads,
                                                                     message):
    """M §4, §11: a token array that is not [B,T] with B, T >= 1, an offset or lead count
    that is neither 1 nor B, a row whose offset is not its own position `C - lead_i` (the
    first such row named, its offset the shared one or its own) and a token outside the
    vocabulary: ValueError with the reference's text, word for word, on a uniform batch of
    two rows holding 5 tokens; the K/V slots keep their lengths and contents."""
    for be in BOTH:
        cache = batch(be, CFG, 2, 5)
        before = be.materialize(cache)
        assert refused_with(ValueError, be.forward, model_of(be, CFG), tokens, cache, offsets,
                            None, leads) == message, be.name
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
        assert refused_with(ValueError, be.forward, model_of(be, cfg), [[1]], cache, [0], None,
                            None) == "cache has 1 slots for 2 layers"


@pytest.mark.rule("one verify step through the target-cache rules, backend")
@pytest.mark.parametrize("bad", [64, -1])
@pytest.mark.parametrize("ragged", [False, True])
def test_a_token_outside_the_vocabulary_is_refused_before_any_slot_changes(bad, ragged):
    """The reference's first refusal after the shape (`tokens must be in [0, vocab)`), on the
    port's fast path (a uniform batch) and its general one (a ragged batch with its leads):
    the same text, and every slot keeps its length, capacity and contents."""
    lens = (3, 7) if ragged else (5, 5)
    for be in BOTH:
        ci = be.clone_in([own(be, CFG, n) for n in lens], [0] * len(lens), True, True)
        c = be.cache_len(ci.batched)
        before = be.materialize(ci.batched)
        lo, hi = min(1, bad), max(1, bad)
        assert refused_with(ValueError, be.forward, model_of(be, CFG), np.array([[1], [bad]]),
                            ci.batched, [c - lead for lead in ci.lead_pad], None,
                            ci.lead_pad) == f"tokens must be in [0, {CFG.vocab}), got [{lo}, {hi}]"
        after = be.materialize(ci.batched)
        assert (after["len"], after["capacity"]) == (before["len"], before["capacity"])
        for (k0, v0), (k1, v1) in zip(before["kv"], after["kv"], strict=True):
            assert_close(k1, k0, "float64", "K after the refusal")
            assert_close(v1, v0, "float64", "V after the refusal")


@pytest.mark.rule("the target forward on the in-place layout, backend, port")
def test_the_port_refuses_to_decode_on_an_unmaterialized_cache_of_nonzero_length():
    """A K/V slot set to length 3 before anything was appended holds no rows the port could
    place; its forward refuses (ValueError naming the length) and the slots stay
    unmaterialized. (The reference decodes it as three zero columns.)"""
    cfg = ModelConfig(compress_ratios=(0, 0))
    cache = PORT.new_target_cache(cfg, 64, 2)
    for slot in cache.slots:
        PORT.kv_set_len(slot, 3)
    assert refused_with(ValueError, PORT.forward, model_of(PORT, cfg), np.zeros((2, 1), int),
                        cache, [3], None, None) == (
        "an unmaterialized cache of length 3 cannot be decoded on")
    assert PORT.materialize(cache)["kv"] == [(None, None), (None, None)]


@pytest.mark.rule("the target forward on the in-place layout, backend, port")
def test_the_port_refuses_a_dead_prefix_longer_than_a_rows_alignment_offset():
    """Per-row query positions that would make a row of a uniform batch (alignment offsets
    all 0, a fresh batch's int64 zeros) treat one of its own columns as dead: the port's
    layout cannot express it, ValueError naming both vectors as integers."""
    cfg = ModelConfig(compress_ratios=(0,))
    cache = batch(PORT, cfg, 2, 4)
    assert refused_with(ValueError, PORT.forward, model_of(PORT, cfg), np.zeros((2, 1), int),
                        cache, [4], [4, 3], None) == (
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
        fwd = be.forward(model, tokens, batch(be, CFG, 2, 3), [3], None, None)
        ints = be.forward(model, [[3, 17], [5, 1]], batch(be, CFG, 2, 3), [3], None, None)
        got[be.name] = be.to_numpy(fwd.logits)
        assert_exact(got[be.name], be.to_numpy(ints.logits), f"{be.name}: logits")
    assert_close(got["torch"], got["numpy"], "float64", "logits")


# --- the port's general forward -------------------------------------------------------------------


def ragged_step(be, model, cfg, lens, t, row_masks, capture=None):
    """Clone-in of one-row caches of `lens` tokens (front-aligned, lead_pad reported), then a
    t-token forward: with per-row query positions and no dead prefix given (`row_masks`), or
    with the dead prefix given and no per-row query positions. Hidden, logits and the batch."""
    ci = be.clone_in([prompt_cache(be, model, np.arange(n) % cfg.vocab) for n in lens],
                     [0] * len(lens), True, True)
    c = be.cache_len(ci.batched)
    assert any(ci.lead_pad), "the batch must be ragged"
    tokens = (np.arange(len(lens) * t).reshape(len(lens), t) * 5 + 2) % cfg.vocab
    if row_masks:
        fwd = be.forward(model, tokens, ci.batched, [c], [c - x for x in ci.lead_pad], None,
                         capture)
    else:
        fwd = be.forward(model, tokens, ci.batched, [c - x for x in ci.lead_pad], None,
                         ci.lead_pad, capture)
    be.xs_append(ci.batched, fwd.hidden)
    return be.to_numpy(fwd.hidden), be.to_numpy(fwd.logits), be.materialize(ci.batched)


def same_step(cfg, lens, t, row_masks, fresh_models=False):
    """`ragged_step` on both backends: hidden, logits and the batched cache alike."""
    out = []
    for be in BOTH:
        model = be.build_model(cfg) if fresh_models else model_of(be, cfg)
        out.append(ragged_step(be, model, cfg, lens, t, row_masks))
    (ph, pl, pc), (rh, rl, rc) = out
    assert_close(ph, rh, "float64", "hidden")
    assert_close(pl, rl, "float64", "logits")
    assert_same_cache(pc, rc, "float64", "batched cache after the forward")


@pytest.mark.rule("one verify step through the target-cache rules, backend")
@pytest.mark.parametrize("ratios", [(0,), (0, 4), (4,), (0, 2)])
@pytest.mark.parametrize("lens,t", [((3, 7), 1), ((9, 2, 6), 2), ((12, 4), 3)])
def test_row_positions_without_a_dead_prefix_decode_as_the_reference(ratios, lens, t):
    """Per-row query positions (`row_q0`) but no dead prefix (`lead_pad = None`): every row's
    live run starts at column 0 of the shared cache (RoPE at the shared offset C) while
    `row_q0` masks each row's dead prefix out of the attention, and a compressed layer
    compresses each row from column 0, the zero dead columns included. The port keeps the
    dead prefix as an offset and reads those columns as zeros: the same hidden, logits and
    cache, with and without compressed layers."""
    same_step(ModelConfig(compress_ratios=ratios), lens, t, True)


@pytest.mark.rule("one verify step through the target-cache rules, backend")
@pytest.mark.parametrize("ratios", [(0, 4), (4,), (0, 2)])
@pytest.mark.parametrize("lens,t", [((3, 5), 2), ((9, 2, 6), 1), ((12, 4), 3)])
def test_a_ragged_cohort_with_per_row_offsets_but_no_row_masks_matches_the_reference(ratios,
                                                                                     lens, t):
    """C §5.4, M §4, §11: a front-aligned ragged batch decoded with RoPE at each row's own
    length and the dead prefix given (`lead_pad`) but no per-row query positions: hidden,
    logits, the MTP capture and the batched cache after the XsRolling feed as the
    reference's."""
    cfg = ModelConfig(compress_ratios=ratios)
    out = []
    for be in BOTH:
        cap = MtpHiddenCapture()
        cap.arm()
        hidden, logits, cache = ragged_step(be, model_of(be, cfg), cfg, lens, t, False, cap)
        offsets, captured = cap.take()
        out.append((hidden, logits, cache, [offsets.row(i) for i in range(len(lens))],
                    be.to_numpy(captured)))
    (ph, pl, pc, po, pcap), (rh, rl, rc, ro, rcap) = out
    assert_close(ph, rh, "float64", "hidden")
    assert_close(pl, rl, "float64", "logits")
    assert_exact(po, ro, "capture offsets")
    assert_close(pcap, rcap, "float64", "captured hidden")
    assert_same_cache(pc, rc, "float64", "batched cache after the forward")


@pytest.mark.rule("the target forward on the in-place layout, backend, port")
@pytest.mark.parametrize("row_masks", [False, True])
@pytest.mark.parametrize("lens", [(2, 1), (3, 1, 2)])
def test_a_ragged_step_before_any_complete_block_matches_the_reference(lens, row_masks):
    """M §13: a ragged batch decoded through a ratio-4 layer while no row's live run holds a
    complete block yet (at most 3 columns after the step): no compressed keys at all, the
    raw window alone, as the reference; with the dead prefix given or with row positions."""
    same_step(CFG, lens, 1, row_masks)


@pytest.mark.rule("the target forward on the in-place layout, backend, port")
def test_a_live_run_ending_at_the_last_physical_column_compresses_it():
    """M §13: the longest row holds 511 tokens and the step's one more fills its 512-column
    buffer exactly, so its last complete block ends at the last physical column; the shorter
    row's compressed window reaches past the buffer. Hidden, logits and cache as the
    reference's."""
    same_step(CFG, (511, 200), 1, False)


@pytest.mark.rule("the target forward on the in-place layout, backend, port")
def test_a_step_past_the_rope_table_built_so_far_matches_the_reference():
    """M §11: a fresh model's RoPE table covers the positions its prompts used (1023 here);
    a general-path step of two tokens whose last position is 1024 rotates there too (the
    table grows to cover `offset + t`), as the reference."""
    same_step(ModelConfig(compress_ratios=(4,), max_seq_len=2048), (1023, 3), 2, False, True)


@pytest.mark.rule("one verify step through the target-cache rules, backend")
def test_the_plain_layout_is_every_offset_at_its_own_length_and_no_compressed_shift():
    plain = TorchBackend._plain_layout
    own_lens = np.array([5, 3])
    assert plain(np.array([5, 3]), own_lens, np.array([0, 0])) is True
    assert plain(np.array([5, 5]), own_lens, np.array([0, 0])) is False  # a shared offset
    assert plain(np.array([5, 3]), own_lens, np.array([0, -2])) is False  # keys before its own


@pytest.mark.rule("one verify step through the target-cache rules, backend")
def test_the_forward_takes_the_general_path_exactly_where_the_layout_is_not_plain(monkeypatch):
    """A uniform batch runs the port model's own forward; per-row query positions without a
    dead prefix (RoPE at the shared offset, compressed keys from column 0) run the general
    layers, and every RoPE of a compressed layer there (q, k and the output, at the layer's
    theta) reads the one table its model keeps for that theta, grown to cover offset + T;
    each path gives the reference's hidden (tests above), so only the route tells them
    apart."""
    calls = []
    general = TorchBackend._forward_general

    def counting(self, *args):
        calls.append(args[3].tolist())
        return general(self, *args)

    monkeypatch.setattr(TorchBackend, "_forward_general", counting)
    model = PORT.build_model(CFG)
    ci = PORT.clone_in([own(PORT, CFG, 5), own(PORT, CFG, 5)], [0, 0], True, True)
    PORT.forward(model, np.array([[1], [2]]), ci.batched, [5], None, None)
    assert calls == []
    seen = []
    for layer in [lay for lay in model.layers if lay.ratio]:
        def spy(x, offs, dims, theta, *args, _layer=layer, _rope=layer.rope, **kw):
            seen.append((theta == _layer.theta, kw.get("table")))
            return _rope(x, offs, dims, theta, *args, **kw)

        layer.rope = spy
    ci = PORT.clone_in([own(PORT, CFG, 3), own(PORT, CFG, 7)], [0, 0], True, True)
    c = PORT.cache_len(ci.batched)
    PORT.forward(model, np.array([[1], [2]]), ci.batched, [c], [c - x for x in ci.lead_pad],
                 None)
    assert calls == [[c]]  # the shared offset, as the step gave it
    compressed = [lay for lay in model.layers if lay.ratio]
    table = compressed[0].ropes.tables[compressed[0].theta]
    assert len(seen) == 3 * len(compressed) > 0
    assert all(ok and t is table for ok, t in seen) and table.n_positions >= c + 1


# --- a buffer not whole blocks wide; the MTP step -------------------------------------------------


MTP = ModelConfig()


def unaligned(be, cfg):
    """A K/V slot of max_seq_len 1030 given 600 columns at once: capacity 1024 (512 + one
    block), the port's buffer exactly 600 wide."""
    k = np.random.default_rng(3).standard_normal((1, cfg.n_kv_heads, 600, cfg.head_dim))
    return be.kv_from_arrays(k, k, 1030, 512)


@pytest.mark.rule("the target forward on the in-place layout, backend, port",
                  "the MTP step on a K/V slot and on a draft KV, backend, port")
@pytest.mark.parametrize("step", ["forward", "mtp_step"])
def test_a_step_on_a_buffer_that_is_not_whole_blocks_wide_matches_the_reference(step):
    """C §3, §10.1: a slot holding 600 of 1024 columns takes one more token (a target forward
    through a one-layer model, or an MTP step) without growing (its capacity is the
    reference's 1024, never 600 + 512 = 1112 > 1030): hidden and slot as the reference's."""
    cfg = ModelConfig(compress_ratios=(0,), max_seq_len=1030) if step == "forward" else \
        ModelConfig(max_seq_len=1030)
    fused = np.random.default_rng(4).standard_normal((1, 1, cfg.hidden))
    out = []
    for be in BOTH:
        kv = unaligned(be, cfg)
        if step == "forward":
            hidden = be.forward(model_of(be, cfg), [[9]], NormalCache([kv]), [600], None,
                                None).hidden
        else:
            hidden = be.mtp_step(model_of(be, cfg), fused, [600], kv)
        out.append((be.to_numpy(hidden), be.materialize(kv)))
    assert_close(out[0][0], out[1][0], "float64", "hidden")
    assert_same_cache(out[0][1], out[1][1], "float64", "slot after the step")
    assert out[0][1]["capacity"] == [1024]


def slots(be, lens, capacity=16, max_seq_len=4096):
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
        assert_exact(PORT.cache_len(kvs["torch"]), n, "slot length")
        assert_same_cache(PORT.materialize(kvs["torch"]), REF.materialize(kvs["numpy"]),
                          "float64", f"slot after the {t}-token step")


@pytest.mark.rule("the MTP step on a K/V slot and on a draft KV, backend, port")
def test_an_mtp_step_on_a_front_aligned_ragged_group_matches_the_reference():
    """C §9.3, §10.1: rows of 5 and 3 entries front-aligned to 5 (`front_align_draft_group`)
    take one step at their own positions [5, 3]: hidden and slot as the reference's."""
    out = []
    fused = np.random.default_rng(2).standard_normal((2, 1, MTP.hidden))
    for be in BOTH:
        kv = be.front_align_draft_group(slots(be, (5, 3)), [5, 3])
        out.append((be.to_numpy(be.mtp_step(model_of(be, MTP), fused, [5, 3], kv)),
                    be.materialize(kv)))
    assert_close(out[0][0], out[1][0], "float64", "hidden")
    assert_same_cache(out[0][1], out[1][1], "float64", "slot after the step")


@pytest.mark.rule("the MTP step on a K/V slot and on a draft KV, backend, port")
@pytest.mark.parametrize("lens,t,pos,exc,message", [
    ((3, 3), 1, [4], DispatchRefusal,
     "MTP draft KV desync: cache holds 3 entries but the step's rows end at absolute "
     "position 4 (start_pos [4]); a ragged group must be left-aligned so every row ends "
     "at the cache's end column"),
    ((3, 3), 1, [3, 3, 3], DispatchRefusal, "3 absolute position(s) for a batch of 2: [3, 3, 3]"),
    ((3, 3), 1, [], DispatchRefusal,
     "the MTP draft step was given no absolute position at all (batch of 2)"),
    ((16,), 1, [16], CacheRefusal, "kv-cache capacity 528 would be above max_seq_len 20"),
])
def test_a_refused_mtp_step_on_a_kv_slot_leaves_it_as_it_was(lens, t, pos, exc, message):
    """C §10.1, §3: a step whose positions do not end at the slot's length, a position count
    neither 1 nor G, no position at all, or a step the slot cannot grow for (16 of 16 held,
    max_seq_len 20): the reference's refusal, word for word, and the slot unchanged."""
    for be in BOTH:
        rows = slots(be, lens, 16, 20)
        kv = rows[0] if len(rows) == 1 else be.concat(rows)
        before = be.materialize(kv)
        fused = np.ones((len(lens), t, MTP.hidden))
        assert refused_with(exc, be.mtp_step, model_of(be, MTP), fused, pos, kv) == message
        assert_same_cache(be.materialize(kv), before, "float64", f"{be.name}: slot after")


@pytest.mark.rule("the MTP step on a K/V slot and on a draft KV, backend, port")
def test_a_draft_kv_refuses_more_positions_than_rows_before_it_changes():
    """C §10.1 on a sequence's draft KV (the port: its pool row): a one-row step of two tokens
    given two positions is one position per ROW too many: the reference's DispatchRefusal,
    and the draft KV stays empty and unmaterialized."""
    fused = np.ones((1, 2, MTP.hidden))
    for be in BOTH:
        kv = be.new_draft_cache(model_of(be, MTP))
        assert refused_with(Refusal, be.mtp_step, model_of(be, MTP), fused, [0, 0], kv) == (
            "2 absolute position(s) for a batch of 1: [0, 0]")
        view = be.materialize(kv)
        assert (view["len"], view["kv"], view["capacity"]) == (0, [(None, None)], [16]), be.name
