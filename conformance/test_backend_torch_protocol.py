"""The torch backend's (`gpu/backend.py`) construction, cache-rule and draft adapters against
the NumPy reference backend on small explicit cases, each on a backend built inside the test
(a fresh backend has no draft store yet): a device with an index, floats in the backend's
dtype (K/V slots, model, both union-mask paths), the draft store per KV-head count and width,
the target cache's slots for a ratio-1 layer and a small `max_seq_len`, `set_lens` per slot
kind, `to_numpy` copying host arrays, `clone_in` under per-sequence advance, `clone_out` and
`split` of unmaterialized and mismatched caches, `front_align` and `front_align_draft_group`
refusing what the reference refuses, `dsv4_attention` without sinks, and the draft group
loop and priming passing the caller's flag and warning list through. Refusal texts are
compared word for word; floats under conformance/backends.py's policy."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from raggedspec.conformance.backends import assert_close, assert_exact, assert_same_cache
from raggedspec.gpu.backend import TorchBackend
from raggedspec.reference.attention import Dsv4AttentionConfig
from raggedspec.reference.backend import NumpyBackend
from raggedspec.reference.dispatch import MtpHiddenCapture
from raggedspec.reference.draft import PRIME_MISALIGNED, WARNINGS, DraftKv
from raggedspec.reference.errors import Refusal
from raggedspec.reference.model import ModelConfig

REF = NumpyBackend()
CFG = ModelConfig()


def outcome(fn, *args):
    """`("ok", value)` or `(class name, message)` of a refusal or malformed input."""
    try:
        return ("ok", fn(*args))
    except (Refusal, ValueError) as exc:
        return (type(exc).__name__, str(exc))


def refusal(fn, *args):
    out = outcome(fn, *args)
    assert out[0] != "ok", f"expected a refusal, got {out[1]!r}"
    return out


def pair(cfg=CFG, dtype="float64"):
    """A fresh port backend and its model, and the reference's."""
    be = TorchBackend("cpu", dtype)
    return (be, be.build_model(cfg)), (REF, REF.build_model(cfg))


def prompt(be, model, cfg, n, batch=1):
    """A target cache after a prompt forward of `n` tokens per row, compressor history fed."""
    cache = be.new_target_cache(cfg, cfg.max_seq_len, batch)
    toks = (np.arange(batch * n).reshape(batch, n) * 5 + 1) % cfg.vocab
    fwd = be.forward(model, toks, cache, [0], None, None)
    be.xs_append(cache, fwd.hidden)
    return cache


# --- construction -----------------------------------------------------------------------------


@pytest.mark.rule("backend protocol: every tensor-side op is one method")
def test_a_cpu_device_with_an_index_is_accepted():
    """The CUDA device-count check applies to CUDA devices only: "cpu:5" is a cpu device."""
    be = TorchBackend("cpu:5")
    assert (be.device, be.dev) == ("cpu:5", torch.device("cpu:5"))


@pytest.mark.rule("backend protocol: every tensor-side op is one method")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_slots_model_and_masks_hold_floats_in_the_backend_dtype(dtype):
    """`_t` and the model: floats in the backend dtype (a K/V slot's buffers round its input;
    the forward's logits in that dtype, within its policy of the reference); both union-mask
    paths in that dtype too, their 0/-inf values the reference's bit for bit."""
    (be, pm), (_, rm) = pair(dtype=dtype)
    k = np.full((1, 1, 2, 4), 0.1)
    slot = be.kv_from_arrays(k, k + 0.2, 64)
    tdtype = getattr(torch, dtype)
    assert slot.kv.k.dtype == slot.kv.v.dtype == tdtype
    got = be.materialize(slot)["kv"][0][0]
    want = torch.tensor(k).to(tdtype).to(torch.float64).numpy()
    assert_exact(got, want, "K rounded to the backend dtype")
    toks = np.array([[3, 1, 4, 1, 5]])
    fwd = be.forward(pm, toks, be.new_target_cache(CFG, 64, 1), [0], None, None)
    ref = REF.forward(rm, toks, REF.new_target_cache(CFG, 64, 1), [0], None, None)
    assert fwd.logits.dtype == fwd.hidden.dtype == tdtype
    assert_close(be.to_numpy(fwd.logits), ref.logits, dtype, "logits")
    for row_q0 in (None, [4, 2]):
        mask = be.union_mask(2, 6, row_q0, 3, 4, 1)
        assert mask.dtype == tdtype, row_q0
        assert_exact(be.to_numpy(mask), REF.union_mask(2, 6, row_q0, 3, 4, 1), f"mask {row_q0}")


@pytest.mark.rule("dead-prefix union mask, backend")
def test_the_uniform_union_mask_of_a_float64_backend_is_float64():
    """The default dtype: the uniform mask too is float64, not torch's default float32."""
    mask = TorchBackend("cpu").union_mask(2, 5, None, 4, 0, 0)
    assert mask.dtype == torch.float64
    assert_exact(TorchBackend("cpu").to_numpy(mask), REF.union_mask(2, 5, None, 4, 0, 0), "mask")


@pytest.mark.rule("backend protocol: every tensor-side op is one method")
def test_a_fresh_backend_keeps_one_draft_store_per_kv_heads_and_width():
    """`new_draft_cache`: a row of the backend's `DraftStore` for the model's (n_kv_heads,
    head_dim), `[rows, n_kv_heads, width, head_dim]` in the backend dtype, shared by every
    draft KV of that geometry; another geometry gets its own store; the fresh row is the
    reference's empty draft KV (length 0, capacity 16); no block, no draft KV."""
    be = TorchBackend("cpu")
    gqa = ModelConfig(n_heads=4, n_kv_heads=2, head_dim=8, rope_dims=4)
    m = be.build_model(gqa)
    a, b = be.new_draft_cache(m), be.new_draft_cache(m)
    assert a.store is b.store and a.idx != b.idx
    shape = a.store.kv.k.shape
    assert (shape[1], shape[3]) == (2, 8) and a.store.kv.k.dtype == torch.float64
    c = be.new_draft_cache(be.build_model(CFG))
    assert c.store is not a.store
    assert (c.store.kv.k.shape[1], c.store.kv.k.shape[3]) == (1, 16)
    for kv in (a, c):
        assert be.materialize(kv) == {"len": 0, "kv": [(None, None)], "capacity": [16],
                                      "xs": []}
    assert be.new_draft_cache(be.build_model(ModelConfig(mtp="heads"))) is None


@pytest.mark.rule("backend protocol: every tensor-side op is one method")
def test_the_target_cache_has_the_references_slots():
    """One K/V slot per layer, then one XsRolling per compressed layer (ratio 1 included),
    each with the cache's `max_seq_len` and row count: the reference's kinds and views, and
    its refusal of a history past `max_seq_len`."""
    cfg = ModelConfig(compress_ratios=(0, 1, 4))
    be = TorchBackend("cpu")
    p, r = be.new_target_cache(cfg, 4, 2), REF.new_target_cache(cfg, 4, 2)
    assert [s.kind for s in p.slots] == [s.kind for s in r.slots]
    assert len(p.slots) == 5
    assert_same_cache(be.materialize(p), REF.materialize(r), "float64", "empty cache")
    hidden = np.random.default_rng(0).standard_normal((2, 5, cfg.hidden))
    assert refusal(be.xs_append, p, torch.from_numpy(hidden)) == refusal(
        REF.xs_append, r, hidden) == (
        "CacheRefusal", "xs row 0 would hold 5 tokens, above max_seq_len 4")


@pytest.mark.rule("backend protocol: every tensor-side op is one method")
def test_to_numpy_copies_a_host_array():
    """A host array comes back as a new array (writing it leaves the input alone)."""
    be = TorchBackend("cpu")
    a = np.arange(4.0)
    out = be.to_numpy(a)
    assert not np.shares_memory(out, a)
    out[0] = 9.0
    assert a[0] == 0.0
    assert_exact(be.to_numpy([1, 2]), np.array([1, 2]), "list")


# --- target cache rules -----------------------------------------------------------------------


@pytest.mark.rule("one verify step through the target-cache rules, backend")
def test_set_lens_sets_kv_slots_and_xs_slots_to_their_own_lengths():
    """`set_lens(cache, kv_len, xs_len)`: every K/V slot to kv_len, every XsRolling to
    xs_len, as the reference."""
    views = []
    for be, model in pair():
        cache = prompt(be, model, CFG, 9)
        be.set_lens(cache, 7, 8)
        views.append(be.materialize(cache))
    assert [views[0]["len"], views[0]["xs"][0]["tokens"]] == [7, [8]]
    assert_same_cache(*views, "float64", "after set_lens")


@pytest.mark.rule("the port's per-sequence caches and clone-in")
def test_clone_in_under_per_sequence_advance_aligns_eagerly():
    """Per-sequence advance front-aligns before the lazy clone-in: a ragged batch with an
    XsRolling slot and the xs flag off is refused by the alignment (CacheRefusal), not by the
    uniformity check the lazy path would reach."""
    outs = []
    for be, model in pair():
        caches = [prompt(be, model, CFG, n) for n in (3, 5)]
        caches = [be.clone_out(c, 1)[0] for c in caches]
        outs.append(refusal(be.clone_in, caches, [], False, True))
    assert outs[0] == outs[1] and outs[0][0] == "CacheRefusal"


@pytest.mark.rule("the port's per-sequence caches and clone-in")
def test_clone_out_refuses_a_bad_row_count_as_the_reference():
    """b >= 1; a materialized K/V layer or an XsRolling layer with another row count than b
    is named; an unmaterialized cache gives b empty row caches."""
    (be, pm), (_, rm) = pair()
    for b in (0, -1):
        c = be.new_target_cache(CFG, 64, 1)
        assert refusal(be.clone_out, c, b) == ("ValueError",
                                              f"clone_out_cache needs b >= 1, got {b}")
    p, r = prompt(be, pm, CFG, 3, batch=2), prompt(REF, rm, CFG, 3, batch=2)
    assert refusal(be.clone_out, p, 3) == refusal(REF.clone_out, r, 3) == (
        "ValueError", "layer 0 holds 2 rows, not 3")
    p, r = be.new_target_cache(CFG, 64, 2), REF.new_target_cache(CFG, 64, 2)
    assert refusal(be.clone_out, p, 3) == refusal(REF.clone_out, r, 3) == (
        "ValueError", "xs layer 2 holds 2 rows, not 3")
    got, want = be.clone_out(p, 2), REF.clone_out(r, 2)
    assert len(got) == len(want) == 2
    for i, (a, w) in enumerate(zip(got, want, strict=True)):
        assert_same_cache(be.materialize(a), REF.materialize(w), "float64", f"row {i}")


# --- one K/V slot -----------------------------------------------------------------------------


@pytest.mark.rule("front alignment, concatenation, split and dead-prefix strip, backend")
def test_split_of_an_unmaterialized_slot_gives_g_copies_of_its_metadata():
    """`split_draft_cache`: g >= 1 (refused word for word); an unmaterialized slot gives g
    unmaterialized pieces with its length and capacity."""
    be = TorchBackend("cpu")
    views = []
    for b in (be, REF):
        kv = b.new_target_cache(CFG, 64, 1).slots[0]
        assert refusal(b.split, kv, 0) == ("ValueError", "split_draft_cache needs g >= 1, got 0")
        b.kv_set_len(kv, 3)
        views.append([b.materialize(piece) for piece in b.split(kv, 3)])
    assert len(views[0]) == 3
    for p, r in zip(*views, strict=True):
        assert p == r == {"len": 3, "kv": [(None, None)], "capacity": [512], "xs": []}


@pytest.mark.rule("front alignment, concatenation, split and dead-prefix strip, backend")
def test_front_align_refuses_an_xs_slot_with_the_xs_flag_off():
    """`front_align` is `front_align_batch` with the xs flag off: an XsRolling slot is
    refused as the reference refuses it."""
    be = TorchBackend("cpu")
    p = be.new_target_cache(CFG, 64, 1).slots[2]
    r = REF.new_target_cache(CFG, 64, 1).slots[2]
    assert refusal(be.front_align, [p]) == refusal(REF.front_align, [r]) == (
        "CacheRefusal", "sequence 0 slot 0: front_pad to 0: an XsRolling slot cannot be "
        "front-padded while ARC_V4_XS_PER_SEQ is off (xs_per_seq=False)")


@pytest.mark.rule("front_align_draft_group, backend")
def test_front_align_draft_group_refuses_non_normal_and_unmaterialized_rows():
    """C §9.7: a row that is not a Normal slot, or whose buffer is unmaterialized, is
    refused (AlignRefusal) before any work, the row named."""
    be = TorchBackend("cpu")
    p, r = be.new_target_cache(CFG, 64, 1), REF.new_target_cache(CFG, 64, 1)
    assert refusal(be.front_align_draft_group, [p.slots[2]], [0]) == refusal(
        REF.front_align_draft_group, [r.slots[2]], [0]) == (
        "AlignRefusal", "draft row 0 is a XsRolling slot, not Normal")
    assert refusal(be.front_align_draft_group, [p.slots[0]], [0]) == refusal(
        REF.front_align_draft_group, [r.slots[0]], [0]) == (
        "AlignRefusal", "draft row 0's buffer is unmaterialized")


# --- attention --------------------------------------------------------------------------------


@pytest.mark.rule("dsv4_attention, backend")
def test_dsv4_attention_without_sinks_matches_the_reference():
    """`sinks=None`: attention without sink logits, as the reference."""
    be = TorchBackend("cpu")
    rng = np.random.default_rng(5)
    q, k = rng.standard_normal((1, 2, 2, 8)), rng.standard_normal((1, 1, 5, 8))
    cfg = Dsv4AttentionConfig(0, 4)
    got = be.dsv4_attention(q, k, k, None, cfg)
    assert_close(be.to_numpy(got), REF.dsv4_attention(q, k, k, None, cfg), "float64", "output")
    got = be.dsv4_attention(q, k, k, None, cfg, None)
    assert_close(be.to_numpy(got), REF.dsv4_attention(q, k, k, None, cfg, None), "float64",
                 "explicit None")


# --- draft orchestration ----------------------------------------------------------------------


def states_for(be, model, cfg, plan):
    """Per row `(C, primed)`: toks of C + 1 tokens and a primed or fresh draft state."""
    states, toks = [], []
    for row, (c, primed) in enumerate(plan):
        t = [(7 * row + 3 * j + 1) % cfg.vocab for j in range(c + 1)]
        state = DraftKv(cache=be.new_draft_cache(model))
        if primed:
            cap = MtpHiddenCapture()
            cap.arm()
            cache = be.new_target_cache(cfg, cfg.max_seq_len, 1)
            be.forward(model, np.array([t[:-1]]), cache, [0], None, None, cap)
            be.prime_draft_kv([state], cap.take(), [t], 1, model, [])
        states.append(state)
        toks.append(t)
    return states, toks


def draft_both(plan, w, per_seq, cfg=CFG, seed=False):
    """The same batch drafted on a fresh port backend and the reference: per backend the
    drafts, the warnings and the states (`seed`: seeds set by hand, no block to prime)."""
    out = []
    for be, model in pair(cfg):
        states, toks = states_for(be, model, cfg, plan)
        if seed:
            rng = np.random.default_rng(4)
            for (c, _), state in zip(plan, states, strict=True):
                h = rng.standard_normal(cfg.hidden)
                state.filled, state.seed = c, (c - 1, be._t(h) if be is not REF else h)
        lens = [c for c, _ in plan]
        groups = REF.draft_groups([1] * len(plan), lens, [True] * len(plan), w, per_seq)
        warnings: list = []
        drafts = be.draft_chain(model, groups, states, toks, lens, [9] * len(plan), w, per_seq,
                                warnings)
        out.append((drafts, warnings, states))
    (pd, pw, ps), (rd, rw, rs) = out
    assert_exact(pw, rw, "warnings")
    assert_exact(pd, rd, "drafts")
    for i, (a, r) in enumerate(zip(ps, rs, strict=True)):
        assert (a.filled, a.poisoned) == (r.filled, r.poisoned), f"row {i}"
    return pd, pw


@pytest.mark.rule("prompt priming, the draft group loop and the MTP step, backend")
def test_draft_chain_aligns_a_ragged_group_under_per_sequence_advance():
    """C §9.5: with per-sequence advance a group of rows at C = 3 and 5 is front-aligned and
    each row drafts w - u = 2 tokens, as the reference; without it the rows are not
    aligned."""
    drafts, warnings = draft_both([(3, True), (5, True)], 3, True)
    assert [len(d) for d in drafts] == [2, 2] and warnings == []


@pytest.mark.rule("prompt priming, the draft group loop and the MTP step, backend")
def test_draft_chain_warns_into_the_callers_list():
    """C §9.3: a group whose only row has no seed warns "no row" into the caller's list (the
    key of a row at C = 3 with u = 1 and scalar keys: `(u, C + u - 2)` = (1, 2))."""
    drafts, warnings = draft_both([(3, False)], 3, False)
    assert drafts == [[]] and warnings == [WARNINGS["no row"].format(key=(1, 2))]


@pytest.mark.rule("prompt priming, the draft group loop and the MTP step, backend")
def test_draft_chain_of_a_heads_only_model_runs_the_backends_chain():
    """Tier A (no block, no draft KV): each group's chain is this backend's
    `propose_chain` from the heads alone, as the reference's."""
    drafts, warnings = draft_both([(3, True), (5, True)], 3, False, ModelConfig(mtp="heads"),
                                  seed=True)
    assert [len(d) for d in drafts] == [2, 2] and warnings == []


@pytest.mark.rule("prompt priming, the draft group loop and the MTP step, backend")
def test_priming_warns_the_prefix_cache_text_into_the_callers_list():
    """C §7.4: a capture that does not start at the draft KV's end poisons the row and warns
    with the priming text (not the extension's)."""
    (be, pm), (_, rm) = pair()
    for b, model in ((be, pm), (REF, rm)):
        state, warnings = DraftKv(cache=b.new_draft_cache(model)), []
        cap = MtpHiddenCapture()
        cap.arm()
        cap.store(2, np.random.default_rng(2).standard_normal((1, 2, CFG.hidden)))
        b.prime_draft_kv([state], cap.take(), [[1, 2, 3, 4]], 1, model, warnings)
        assert state.poisoned and warnings == [f"row 0: {PRIME_MISALIGNED}; draft KV poisoned"]
