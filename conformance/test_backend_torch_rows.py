"""The torch backend's forward on a ragged batch given per-row query positions (`row_q0`) but
no dead prefix (`lead_pad = None`), against the reference backend.

That call says every row's live run starts at column 0 of the shared cache (so RoPE takes the
shared offset C) while `row_q0` still masks each row's dead prefix out of the attention. The
reference computes it as written: the raw keys' dead columns are masked, and a compressed layer
compresses each row from column 0, the zero dead columns included. The torch backend keeps a
row's dead prefix as an offset, not as stored zeros, so its compressed keys read those columns
as zeros: the same keys, hence the same hidden, logits and cache, with and without compressed
layers and at several compression ratios.
"""

import numpy as np
import pytest

from raggedspec.conformance.backends import assert_close, assert_same_cache
from raggedspec.gpu.backend import TorchBackend
from raggedspec.reference.backend import NumpyBackend
from raggedspec.reference.model import ModelConfig

REF = NumpyBackend()
PORT = TorchBackend(dtype="float64")


def _prompt(be, model, cfg, n):
    """A one-row cache holding an n-token prompt run through the backend's model."""
    cache = be.new_target_cache(cfg, 4096, 1)
    fwd = be.forward(model, np.arange(n)[None] % cfg.vocab, cache, [0], None, None)
    be.xs_append(cache, fwd.hidden)
    return cache


@pytest.mark.rule("one verify step through the target-cache rules, backend")
@pytest.mark.parametrize("ratios", [(0,), (0, 4), (4,), (0, 2)])
@pytest.mark.parametrize("lens,t", [((3, 7), 1), ((9, 2, 6), 2), ((12, 4), 3)])
def test_row_positions_without_a_dead_prefix_decode_as_the_reference(ratios, lens, t):
    cfg = ModelConfig(compress_ratios=ratios)
    out = []
    for be in (PORT, REF):
        model = be.build_model(cfg)
        ci = be.clone_in([_prompt(be, model, cfg, n) for n in lens], [0] * len(lens), True, True)
        c = be.cache_len(ci.batched)
        assert any(ci.lead_pad), "the batch must be ragged"
        row_q0 = [c - lead for lead in ci.lead_pad]
        tokens = (np.arange(len(lens) * t).reshape(len(lens), t) * 5) % cfg.vocab
        fwd = be.forward(model, tokens, ci.batched, [c], row_q0, None)
        out.append((be.to_numpy(fwd.hidden), be.to_numpy(fwd.logits), be.materialize(ci.batched)))
    (ph, pl, pc), (rh, rl, rc) = out
    assert_close(ph, rh, "float64", "hidden")
    assert_close(pl, rl, "float64", "logits")
    assert_same_cache(pc, rc, "float64", "batched cache after the forward")


@pytest.mark.rule("one verify step through the target-cache rules, backend")
@pytest.mark.parametrize("bad", [64, -1])
@pytest.mark.parametrize("ragged", [False, True])
def test_a_token_outside_the_vocabulary_is_refused_before_any_slot_changes(bad, ragged):
    """The reference's first refusal after the shape (`tokens must be in [0, vocab)`), on the
    port's fast path (a uniform batch) and its general one (a ragged batch with its leads):
    the same text, and every slot keeps its length, capacity and contents."""
    cfg = ModelConfig(compress_ratios=(0, 4))
    lens = (3, 7) if ragged else (5, 5)
    for be in (PORT, REF):
        model = be.build_model(cfg)
        ci = be.clone_in([_prompt(be, model, cfg, n) for n in lens], [0] * len(lens), True, True)
        c = be.cache_len(ci.batched)
        before = be.materialize(ci.batched)
        with pytest.raises(ValueError) as got:
            be.forward(model, np.array([[1], [bad]]), ci.batched,
                       [c - lead for lead in ci.lead_pad], None, ci.lead_pad)
        lo, hi = min(1, bad), max(1, bad)
        assert str(got.value) == f"tokens must be in [0, {cfg.vocab}), got [{lo}, {hi}]"
        after = be.materialize(ci.batched)
        assert (after["len"], after["capacity"]) == (before["len"], before["capacity"])
        for (k0, v0), (k1, v1) in zip(before["kv"], after["kv"], strict=True):
            assert_close(k1, k0, "float64", "K after the refusal")
            assert_close(v1, v0, "float64", "V after the refusal")


@pytest.mark.rule("one verify step through the target-cache rules, backend")
def test_a_chain_on_a_kv_slot_near_max_seq_len_grows_it_as_the_reference():
    """C §10.2, §3: a plain K/V slot of two rows holding 600 entries in a capacity of 1024
    (max_seq_len 1030) drafts 2 tokens as the reference does; the chain's buffer growth is the
    rows' need plus the chain, and the capacity, length and contents after it are the
    reference's."""
    cfg = ModelConfig()
    rng = np.random.default_rng(7)
    k = rng.integers(-4, 5, (2, cfg.n_kv_heads, 600, cfg.head_dim)).astype(np.float64)
    seed = rng.standard_normal((2, cfg.hidden))
    out = []
    for be in (PORT, REF):
        model = be.build_model(cfg)
        kv = be.kv_from_arrays(k, k, 1030)
        out.append((be.propose_chain(model, seed, [3, 9], 2, [600, 600], kv),
                    be.kv_len(kv), be.materialize(kv)))
    (pc, pn, pm), (rc, rn, rm) = out
    assert pc == rc and pn == rn == 602
    assert_same_cache(pm, rm, "float64", "the slot after the chain")


@pytest.mark.rule("one verify step through the target-cache rules, backend")
def test_the_plain_layout_is_every_offset_at_its_own_length_and_no_compressed_shift():
    plain = TorchBackend._plain_layout
    own = np.array([5, 3])
    assert plain(np.array([5, 3]), own, np.array([0, 0])) is True
    assert plain(np.array([5, 5]), own, np.array([0, 0])) is False  # a shared offset
    assert plain(np.array([5, 3]), own, np.array([0, -2])) is False  # keys before its own


def _ragged_without_leads(be, model, cfg, lens=(3, 7)):
    ci = be.clone_in([_prompt(be, model, cfg, n) for n in lens], [0] * len(lens), True, True)
    c = be.cache_len(ci.batched)
    return ci, c, [c - lead for lead in ci.lead_pad]


@pytest.mark.rule("one verify step through the target-cache rules, backend")
def test_the_forward_takes_the_general_path_exactly_where_the_layout_is_not_plain(monkeypatch):
    """A uniform batch runs the port model's own forward; per-row query positions without a
    dead prefix (RoPE at the shared offset, compressed keys from column 0) run the general
    layers; each gives the reference's hidden (test above), so only the route tells them
    apart."""
    calls = []
    general = TorchBackend._forward_general

    def counting(self, *args):
        calls.append(args[3].tolist())
        return general(self, *args)

    monkeypatch.setattr(TorchBackend, "_forward_general", counting)
    cfg = ModelConfig(compress_ratios=(0, 4))
    model = PORT.build_model(cfg)
    ci, c, _ = _ragged_without_leads(PORT, model, cfg, (5, 5))
    PORT.forward(model, np.array([[1], [2]]), ci.batched, [c], None, None)
    assert calls == []
    ci, c, row_q0 = _ragged_without_leads(PORT, model, cfg)
    PORT.forward(model, np.array([[1], [2]]), ci.batched, [c], row_q0, None)
    assert calls == [[c]]  # the shared offset, as the step gave it


@pytest.mark.rule("one verify step through the target-cache rules, backend")
def test_every_rope_of_a_compressed_layer_on_the_general_path_reads_its_shared_table():
    """The general path's compressed layer rotates q, k and the output with the layer's theta
    through the one table its model keeps for that theta, grown to cover offset + T."""
    cfg = ModelConfig(compress_ratios=(0, 4))
    model = PORT.build_model(cfg)
    ci, c, row_q0 = _ragged_without_leads(PORT, model, cfg)
    seen = []
    for layer in model.layers:
        if layer.ratio:
            rope = layer.rope

            def spy(x, offs, dims, theta, *args, _layer=layer, _rope=rope, **kw):
                seen.append((theta == _layer.theta, kw.get("table")))
                return _rope(x, offs, dims, theta, *args, **kw)

            layer.rope = spy
    PORT.forward(model, np.array([[1], [2]]), ci.batched, [c], row_q0, None)
    compressed = [layer for layer in model.layers if layer.ratio]
    assert len(seen) == 3 * len(compressed) > 0
    for ok, table in seen:
        table_of_theta = compressed[0].ropes.tables[compressed[0].theta]
        assert ok and table is table_of_theta and table.n_positions >= c + 1
