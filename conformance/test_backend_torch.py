"""The torch backend (`gpu/backend.py`) against the NumPy reference backend on the paths the
per-method properties of test_backend.py do not take, on small explicit cases: its
constructor's device and dtype resolution and refusals; a ragged cohort decoded with per-row
RoPE offsets but no per-row masks (the port's general forward, compressed keys rebuilt from
each row's live run); `propose_chain` on a draft KV (a pool row) and on a plain K/V slot, with
the empty and heads-only cases; `extend_draft_kvs` after priming, and its warning; the
per-row adapters on vectors of unequal length. The comparison policy is test_backend.py's
(conformance/backends.py): integers and lengths exact, float64 within 1e-12."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from raggedspec.conformance.backends import assert_close, assert_exact, assert_same_cache
from raggedspec.gpu.backend import DTYPES, TorchBackend
from raggedspec.reference.backend import NumpyBackend
from raggedspec.reference.dispatch import MtpHiddenCapture
from raggedspec.reference.draft import EXTEND_MISALIGNED, DraftKv
from raggedspec.reference.model import ModelConfig

REF = NumpyBackend()
PORT = TorchBackend(dtype="float64")  # the device from RAGGEDSPEC_DEVICE, else the cpu
_MODELS: dict = {}


def models(cfg):
    """(port model, reference model) of `cfg`, built once."""
    if cfg not in _MODELS:
        _MODELS[cfg] = (PORT.build_model(cfg), REF.build_model(cfg))
    return _MODELS[cfg]


# --- construction ---------------------------------------------------------------------------


@pytest.mark.rule("backend protocol: every tensor-side op is one method")
def test_the_constructor_resolves_device_and_dtype(monkeypatch):
    """Device: the argument, else `RAGGEDSPEC_DEVICE`, else "cpu"; dtype float64 by default;
    an unknown dtype or device, or CUDA where torch has none, is malformed (ValueError)."""
    monkeypatch.delenv("RAGGEDSPEC_DEVICE", raising=False)
    be = TorchBackend()
    assert (be.name, be.device, be.dtype, be.dev, be.tdtype) == (
        "torch", "cpu", "float64", torch.device("cpu"), torch.float64)
    be = TorchBackend("cpu", "bfloat16")
    assert (be.device, be.dtype, be.tdtype) == ("cpu", "bfloat16", torch.bfloat16)
    monkeypatch.setenv("RAGGEDSPEC_DEVICE", "meta")
    assert TorchBackend().device == "meta" and TorchBackend("cpu").device == "cpu"
    with pytest.raises(ValueError) as info:
        TorchBackend("cpu", "float16")
    assert str(info.value) == f"dtype 'float16' must be one of {sorted(DTYPES)}"
    with pytest.raises(ValueError, match=r"^unknown torch device 'nope': "):
        TorchBackend("nope")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError) as info:
            TorchBackend("cuda")
        assert str(info.value) == (f"device 'cuda' requested but CUDA is not available to torch "
                                   f"{torch.__version__} on this machine")
    else:
        n = torch.cuda.device_count()
        with pytest.raises(ValueError) as info:
            TorchBackend(f"cuda:{n}")
        assert str(info.value) == f"device 'cuda:{n}': only {n} CUDA device(s)"
        assert TorchBackend(f"cuda:{n - 1}").device == f"cuda:{n - 1}"


# --- the general forward --------------------------------------------------------------------


def _prompt(be, model, cfg, n):
    cache = be.new_target_cache(cfg, cfg.max_seq_len, 1)
    fwd = be.forward(model, np.arange(n)[None] % cfg.vocab, cache, [0], None, None)
    be.xs_append(cache, fwd.hidden)
    return be.clone_out(cache, 1)[0]


@pytest.mark.rule("one verify step through the target-cache rules, backend")
@pytest.mark.parametrize("ratios", [(0, 4), (4,), (0, 2)])
@pytest.mark.parametrize("lens,t", [((3, 5), 2), ((9, 2, 6), 1), ((12, 4), 3)])
def test_a_ragged_cohort_with_per_row_offsets_but_no_row_masks_matches_the_reference(
    ratios, lens, t
):
    """C §5.4, M §4, §11: a front-aligned ragged batch decoded with RoPE at each row's own
    length and the dead prefix given (`lead_pad`) but no per-row query positions: hidden,
    logits, the MTP capture and the batched cache after the XsRolling feed as the
    reference's."""
    cfg = ModelConfig(compress_ratios=ratios)
    pm, rm = models(cfg)
    out = []
    for be, model in ((PORT, pm), (REF, rm)):
        ci = be.clone_in([_prompt(be, model, cfg, n) for n in lens], [0] * len(lens), True, True)
        c = be.cache_len(ci.batched)
        offsets = [c - x for x in ci.lead_pad]
        cap = MtpHiddenCapture()
        cap.arm()
        tokens = (np.arange(len(lens) * t).reshape(len(lens), t) * 7) % cfg.vocab
        fwd = be.forward(model, tokens, ci.batched, offsets, None, ci.lead_pad, cap)
        be.xs_append(ci.batched, fwd.hidden)
        out.append((fwd, cap.take(), be.materialize(ci.batched), ci.lead_pad))
    (pf, pcap, pcache, plead), (rf, rcap, rcache, rlead) = out
    assert_exact(plead, rlead, "leads")
    assert any(rlead), "the batch must be ragged"
    assert_close(PORT.to_numpy(pf.hidden), rf.hidden, "float64", "hidden")
    assert_close(PORT.to_numpy(pf.logits), rf.logits, "float64", "logits")
    assert_exact([pcap[0].row(i) for i in range(len(lens))],
                 [rcap[0].row(i) for i in range(len(lens))], "capture offsets")
    assert_close(PORT.to_numpy(pcap[1]), np.asarray(rcap[1]), "float64", "captured hidden")
    assert_same_cache(pcache, rcache, "float64", "batched cache after the forward")


# --- the chain -------------------------------------------------------------------------------


def _same_kv(p, r, what):
    assert_same_cache(PORT.materialize(p), REF.materialize(r), "float64", what)


@pytest.mark.rule("propose_chain on the backend's draft cache, port")
@pytest.mark.parametrize("n", [0, 1, 3, 20])
def test_propose_chain_on_a_draft_kv_matches_the_reference(n):
    """C §10.2 on a sequence's draft KV (the port: its pool row): n greedy tokens, the KV one
    entry longer per step, capacity and contents as the reference's (past its 16 columns
    too); an empty group drafts nothing and leaves the KV as it was."""
    cfg = ModelConfig()
    pm, rm = models(cfg)
    seed = np.random.default_rng(n).standard_normal((1, cfg.hidden))
    pk, rk = PORT.new_draft_cache(pm), REF.new_draft_cache(rm)
    got = PORT.propose_chain(pm, seed, [7], n, [0], pk)
    want = REF.propose_chain(rm, seed, [7], n, [0], rk)
    assert_exact(got, want, "chains")
    assert_exact(PORT.kv_len(pk), REF.kv_len(rk), "draft KV length")
    _same_kv(pk, rk, "draft KV")
    empty = np.zeros((0, cfg.hidden))
    assert PORT.propose_chain(pm, empty, [], n, [], pk) == [] == REF.propose_chain(
        rm, empty, [], n, [], rk)
    assert_exact(PORT.kv_len(pk), REF.kv_len(rk), "draft KV length after an empty group")


@pytest.mark.rule("propose_chain on the backend's draft cache, port")
@pytest.mark.parametrize("n", [1, 2, 20])
def test_propose_chain_on_a_kv_slot_matches_the_reference(n):
    """C §10.2, §3 on a plain K/V slot of two rows holding 14 entries (capacity 16): the
    chains, the grown capacity (a chain past 16 columns takes a 512 block) and the slot."""
    cfg = ModelConfig()
    pm, rm = models(cfg)
    rng = np.random.default_rng(n)
    k = rng.integers(-4, 5, (2, 1, 14, cfg.head_dim)).astype(np.float64)
    pk, rk = PORT.kv_from_arrays(k, k, 4096, 16), REF.kv_from_arrays(k, k, 4096, 16)
    seed = rng.standard_normal((2, cfg.hidden))
    got = PORT.propose_chain(pm, seed, [3, 9], n, [14, 14], pk)
    want = REF.propose_chain(rm, seed, [3, 9], n, [14, 14], rk)
    assert_exact(got, want, "chains")
    assert_exact(PORT.kv_len(pk), 14 + n, "slot length")
    _same_kv(pk, rk, "slot after the chain")


@pytest.mark.rule("propose_chain on the backend's draft cache, port")
def test_propose_chain_without_a_block_matches_the_reference():
    """Tier A (heads only, no draft KV): the chain from the heads alone."""
    cfg = ModelConfig(mtp="heads")
    pm, rm = models(cfg)
    seed = np.random.default_rng(5).standard_normal((2, cfg.hidden))
    assert_exact(PORT.propose_chain(pm, seed, [1, 2], 3, [4, 6], None),
                 REF.propose_chain(rm, seed, [1, 2], 3, [4, 6], None), "heads-only chains")


# --- the extension ---------------------------------------------------------------------------


def _primed(be, model, cfg, toks):
    cap = MtpHiddenCapture()
    cap.arm()
    cache = be.new_target_cache(cfg, cfg.max_seq_len, 1)
    be.forward(model, np.array([toks[:-1]]), cache, [0], None, None, cap)
    state = DraftKv(cache=be.new_draft_cache(model))
    be.prime_draft_kv([state], cap.take(), [toks], 1, model, [])
    return state


@pytest.mark.rule("extend_draft_kv_row tensor side, port")
def test_extend_draft_kvs_matches_the_reference():
    """C §7.2 through the protocol: after priming, a 2-token capture at the draft KV's end
    extends it as the reference does (filled, seed, draft KV); a capture that does not start
    there poisons the row with the extension's warning."""
    cfg = ModelConfig()
    pm, rm = models(cfg)
    toks = [5, 1, 8, 3, 2]
    hidden = np.random.default_rng(7).standard_normal((1, 2, cfg.hidden))
    states = []
    for be, model in ((PORT, pm), (REF, rm)):
        state = _primed(be, model, cfg, toks)
        cap = MtpHiddenCapture()
        cap.arm()
        cap.store(state.filled, hidden)
        warnings: list = []
        be.extend_draft_kvs([state], cap.take(), [toks + [6, 4]], 1, model, warnings)
        assert warnings == []
        states.append(state)
    p, r = states
    assert_exact((p.filled, p.poisoned, p.seed[0]), (r.filled, r.poisoned, r.seed[0]), "state")
    assert_close(PORT.to_numpy(p.seed[1]), r.seed[1], "float64", "seed hidden")
    _same_kv(p.cache, r.cache, "draft KV")
    for be, model in ((PORT, pm), (REF, rm)):
        state = DraftKv(cache=be.new_draft_cache(model))
        cap = MtpHiddenCapture()
        cap.arm()
        cap.store(3, hidden)
        warnings = []
        be.extend_draft_kvs([state], cap.take(), [toks], 1, model, warnings)
        assert state.poisoned and warnings == [f"row 0: {EXTEND_MISALIGNED}; draft KV poisoned"]


# --- length vectors --------------------------------------------------------------------------


@pytest.mark.rule("verify's first mismatch and the budget clamp, backend")
def test_the_row_vector_adapters_read_rows_pairwise_as_the_reference():
    """The per-row adapters pair their two vectors' rows (zip, not strict) as the
    reference's: a longer vector's extra rows are not read."""
    for be in (PORT, REF):
        assert be.verify_accept([[1, 2], [3]], [[1, 2]]) == [2]
        assert be.budget_clamp([3, 3], [2]) == [1]
        assert be.chain_starts([5, 6], [1]) == [4]
        assert be.draft_group_keys([1, 2], [5], False) == REF.draft_group_keys([1], [5], False)


@pytest.mark.rule("RoPE positions and rotation, backend")
def test_rope_positions_refuse_a_wrong_offset_count():
    """Offsets of length 1 or B only, with the reference's message."""
    with pytest.raises(ValueError) as info:
        PORT.rope_positions([1, 2], 3, 2)
    assert str(info.value) == "2 offsets for a batch of 3"
    assert PORT.rope_positions([5, 2], 2, 2).tolist() == [[5, 6], [2, 3]]


@pytest.mark.rule("RoPE positions and rotation, backend")
def test_apply_rope_rotates_forward_by_default():
    """`apply_rope(..., inverse=False)` by default: the reference's forward rotation."""
    x = np.random.default_rng(0).standard_normal((1, 1, 3, 8))
    assert_close(PORT.to_numpy(PORT.apply_rope(x, [4], 4, 10000.0)),
                 REF.apply_rope(x, [4], 4, 10000.0, inverse=False), "float64", "rope")


@pytest.mark.rule("backend protocol: every tensor-side op is one method")
def test_a_target_cache_is_built_on_the_backends_device():
    """The XsRolling slots of a new target cache live on the backend's device (here torch's
    "meta" device, which every machine has)."""
    be = TorchBackend("meta")
    cache = be.new_target_cache(ModelConfig(compress_ratios=(0, 4, 128)), 4096, 2)
    xs = [s for s in cache.slots if s.kind == "XsRolling"]
    assert len(xs) == 2 and {s.device for s in xs} == {torch.device("meta")}
