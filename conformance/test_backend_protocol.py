"""The backend protocol itself and the reference backend's own contract, on small explicit
cases: the abstract `Backend` refuses every protocol method naming it, `missing_methods` names
what a subclass leaves to the base, `NumpyBackend` accepts only the cpu and float64,
`load_backend` resolves every kind of spec (None, "numpy", a named backend, a
"package.module:factory" string, an instance) and refuses the rest with the messages its
docstring states, and the reference backend's adapters pass every argument through (row
vectors of unequal length are malformed, the draft loops' warnings reach the caller's list,
the K/V slots hold float64 at the asked capacity). Expected values come from the protocol's
docstrings and docs/conformance.md ("reference/backend.py"); test_backend.py compares a port
against this reference method by method."""

from __future__ import annotations

import inspect

import numpy as np
import pytest

from raggedspec.reference import draft as rdraft
from raggedspec.reference.backend import (
    NAMED_BACKENDS,
    PROTOCOL_METHODS,
    Backend,
    NumpyBackend,
    load_backend,
    missing_methods,
)
from raggedspec.reference.dispatch import MtpHiddenCapture
from raggedspec.reference.draft import EXTEND_MISALIGNED, PRIME_MISALIGNED, DraftKv
from raggedspec.reference.errors import AlignRefusal, CacheRefusal
from raggedspec.reference.model import ModelConfig

# ----------------------------------------------------------------------------- the abstract base


@pytest.mark.rule("backend protocol: every tensor-side op is one method")
@pytest.mark.parametrize("method", PROTOCOL_METHODS)
def test_every_method_of_the_abstract_base_raises_naming_itself(method):
    """`Backend`'s methods raise NotImplementedError naming the backend and the method."""
    params = inspect.signature(getattr(Backend, method)).parameters.values()
    args = [None for p in params if p.name != "self" and p.default is inspect.Parameter.empty]
    with pytest.raises(NotImplementedError) as info:
        getattr(Backend(), method)(*args)
    assert str(info.value) == f"backend 'abstract' does not implement {method}"


@pytest.mark.rule("backend protocol: every tensor-side op is one method")
def test_missing_methods_names_what_a_subclass_leaves_to_the_base():
    """Every protocol method of a bare subclass is missing, in the table's order; an override
    is not; the reference backend overrides every one; an object that is not a Backend
    implements none of them."""

    class Bare(Backend):
        pass

    class One(Backend):
        def cache_len(self, cache):
            return 0

    assert missing_methods(Bare()) == list(PROTOCOL_METHODS)
    assert missing_methods(One()) == [m for m in PROTOCOL_METHODS if m != "cache_len"]
    assert missing_methods(NumpyBackend()) == []
    assert missing_methods(object()) == list(PROTOCOL_METHODS)  # not a Backend: implements none


# ----------------------------------------------------------------------------- load_backend


@pytest.mark.rule("backend protocol: every tensor-side op is one method")
def test_the_numpy_backend_is_cpu_and_float64_only():
    """`device` must be "cpu" and `dtype` "float64" (the defaults); anything else is malformed."""
    be = NumpyBackend()
    assert (be.name, be.device, be.dtype) == ("numpy", "cpu", "float64")
    assert (NumpyBackend("cpu", "float64").device, NumpyBackend("cpu", "float64").dtype) == (
        "cpu", "float64")
    with pytest.raises(ValueError) as info:
        NumpyBackend("cuda")
    assert str(info.value) == "the numpy backend runs on the cpu only, not 'cuda'"
    with pytest.raises(ValueError) as info:
        NumpyBackend("cpu", "float32")
    assert str(info.value) == "the numpy backend is float64 only, not 'float32'"


@pytest.mark.rule("backend protocol: every tensor-side op is one method")
def test_load_backend_resolves_none_numpy_an_instance_and_device_dtype():
    """None and "numpy" give a NumpyBackend; device and dtype reach the factory when given;
    a Backend instance comes back as is."""
    for spec in (None, "numpy"):
        be = load_backend(spec)
        assert type(be) is NumpyBackend and (be.device, be.dtype) == ("cpu", "float64")
        be = load_backend(spec, "cpu", "float64")
        assert type(be) is NumpyBackend and (be.device, be.dtype) == ("cpu", "float64")
    with pytest.raises(ValueError, match=r"^the numpy backend runs on the cpu only, not 'cuda'$"):
        load_backend("numpy", "cuda")
    with pytest.raises(ValueError, match=r"^the numpy backend is float64 only, not 'float32'$"):
        load_backend("numpy", dtype="float32")
    mine = NumpyBackend()
    assert load_backend(mine) is mine


@pytest.mark.rule("backend protocol: every tensor-side op is one method")
def test_load_backend_imports_a_factory_by_name():
    """"package.module:factory" imports the module and calls `factory(device=, dtype=)`; a
    named backend ("torch") resolves through `NAMED_BACKENDS`."""
    be = load_backend("raggedspec.reference.backend:NumpyBackend", "cpu", "float64")
    assert type(be) is NumpyBackend
    assert type(load_backend("raggedspec.reference.backend:NumpyBackend")) is NumpyBackend
    torch_be = load_backend("torch", "cpu", "float64")
    assert type(torch_be).__name__ == "TorchBackend" and torch_be.name == "torch"
    assert (torch_be.device, torch_be.dtype) == ("cpu", "float64")


@pytest.mark.rule("backend protocol: every tensor-side op is one method")
def test_load_backend_refuses_unknown_specs_with_their_reasons(monkeypatch):
    """ValueError naming the spec for an unknown name (or a non-string, even an unhashable
    one), a module that does
    not import (a named backend: "needs torch and the gpu package"), a missing attribute, and
    a factory that does not return a Backend."""
    names = ", ".join(NAMED_BACKENDS)
    for spec in ("nope", 3, ["numpy"]):  # a non-string is never looked up by name
        with pytest.raises(ValueError) as info:
            load_backend(spec)
        assert str(info.value) == (
            f"unknown backend {spec!r}: expected numpy, {names} or package.module:factory")
    with pytest.raises(ValueError, match=r"^backend 'no_such_pkg_x:f': cannot import "
                                         r"'no_such_pkg_x' \(.*no_such_pkg_x"):
        load_backend("no_such_pkg_x:f")
    monkeypatch.setitem(NAMED_BACKENDS, "ghost", "no_such_pkg_x:Factory")
    with pytest.raises(ValueError, match=r"^backend 'ghost' needs torch and the gpu package: "
                                         r".*no_such_pkg_x"):
        load_backend("ghost")
    spec = "raggedspec.reference.backend:NoSuchFactory"
    with pytest.raises(ValueError) as info:
        load_backend(spec)
    assert str(info.value) == (f"backend {spec!r}: module 'raggedspec.reference.backend' has no "
                               f"attribute 'NoSuchFactory'")
    spec = "raggedspec.reference.backend:NumpyBackend:x"  # the module is before the first ':'
    with pytest.raises(ValueError) as info:
        load_backend(spec)
    assert str(info.value) == (f"backend {spec!r}: module 'raggedspec.reference.backend' has no "
                               f"attribute 'NumpyBackend:x'")
    with pytest.raises(ValueError) as info:
        load_backend("builtins:dict", "cpu")
    assert str(info.value) == ("backend 'builtins:dict': dict returned dict, not a "
                               "raggedspec.reference.backend.Backend")


# ----------------------------------------------------------------------------- adapters

REF = NumpyBackend()
CFG = ModelConfig()  # compress ratios (0, 4), an MTP block
_MODEL: list = []


def model():
    """The reference model of `CFG`, built once."""
    if not _MODEL:
        _MODEL.append(REF.build_model(CFG))
    return _MODEL[0]


def prompt_cache(n: int):
    """One sequence's own target cache after a prompt forward of n tokens (B = 1)."""
    cache = REF.new_target_cache(CFG, CFG.max_seq_len, 1)
    fwd = REF.forward(model(), np.arange(n)[None] % CFG.vocab, cache, [0], None, None)
    REF.xs_append(cache, fwd.hidden)
    return REF.clone_out(cache, 1)[0]


@pytest.mark.rule("backend protocol: every tensor-side op is one method")
def test_build_model_and_new_target_cache_follow_the_config():
    """`build_model(cfg)` is the reference's `TinyModel(cfg)`; a target cache holds one K/V
    slot per layer, then one XsRolling slot (with the cache's max_seq_len and batch) per
    compressed layer, ratio 1 included."""
    cfg = ModelConfig(compress_ratios=(4, 0, 1), max_seq_len=600, mtp="heads")
    assert REF.build_model(cfg).cfg == cfg
    cache = REF.new_target_cache(cfg, 600, 3)
    kinds = [type(s).__name__ for s in cache.slots]
    assert kinds == ["KvCache"] * 3 + ["XsRolling"] * 2
    xs = cache.slots[3:]
    assert [(x.ratio, x.max_seq_len, x.batch) for x in xs] == [(4, 600, 3), (1, 600, 3)]


@pytest.mark.rule("backend protocol: every tensor-side op is one method")
def test_to_numpy_returns_a_copy():
    """`to_numpy` gives a host array the caller may keep: a copy, not a view."""
    x = np.arange(4.0)
    out = REF.to_numpy(x)
    assert out is not x and out.tolist() == [0.0, 1.0, 2.0, 3.0]
    x[0] = 9.0
    assert out[0] == 0.0


@pytest.mark.rule("one verify step through the target-cache rules, backend")
def test_clone_in_aligns_first_under_per_sequence():
    """C §5.4: under PerSequence the front alignment runs before the clone-in and its
    refusal propagates (an XsRolling slot with the xs flag off); the cohort path refuses the
    ragged batch in the clone-in instead (AlignRefusal)."""
    with pytest.raises(CacheRefusal, match="an XsRolling slot cannot be front-padded"):
        REF.clone_in([prompt_cache(3), prompt_cache(5)], [0, 0], False, True)
    with pytest.raises(AlignRefusal, match="must share current_seq_len"):
        REF.clone_in([prompt_cache(3), prompt_cache(5)], [0, 0], False, False)
    ci = REF.clone_in([prompt_cache(3), prompt_cache(5)], [0, 0], True, True)
    assert ci.lead_pad == [2, 0] and REF.cache_len(ci.batched) == 5


@pytest.mark.rule("K/V append, growth and set_len, backend")
def test_set_lens_sets_kv_and_xs_slots_to_their_own_lengths():
    """C §5.5: every K/V slot `set_len(kv_len)`, every XsRolling slot `set_len(xs_len)`."""
    cache = prompt_cache(8)
    REF.set_lens(cache, 7, 6)
    view = REF.materialize(cache)
    assert [k.shape[2] for k, _ in view["kv"]] == [7, 7]
    assert [x["tokens"] for x in view["xs"]] == [[6]]


@pytest.mark.rule("K/V append, growth and set_len, backend")
def test_kv_slots_hold_float64_at_the_asked_capacity():
    """A K/V slot built from (or appended with) integer arrays holds float64 K and V, both
    halves at the asked capacity."""
    k = np.arange(8, dtype=np.int64).reshape(1, 1, 2, 4)
    kv = REF.kv_from_arrays(k, k + 1, 4096, 16)
    assert (kv.k.capacity_seq_len, kv.v.capacity_seq_len) == (16, 16)
    REF.kv_append(kv, k, k + 1)
    view = REF.materialize(kv)
    (kk, vv), = view["kv"]
    assert kk.dtype == vv.dtype == np.float64
    assert kk[0, 0, :, 0].tolist() == [0.0, 4.0, 0.0, 4.0]
    assert vv[0, 0, :, 0].tolist() == [1.0, 5.0, 1.0, 5.0]


@pytest.mark.rule("RoPE positions and rotation, backend")
def test_rope_positions_are_int64_and_refuse_a_wrong_offset_count():
    """M §11: `[B, T]` host int64 (an empty batch too); offsets of length 1 or B only."""
    pos = REF.rope_positions([], 0, 3)
    assert pos.shape == (0, 3) and pos.dtype == np.int64
    assert REF.rope_positions([5, 2], 2, 2).tolist() == [[5, 6], [2, 3]]
    with pytest.raises(ValueError) as info:
        REF.rope_positions([1, 2], 3, 2)
    assert str(info.value) == "2 offsets for a batch of 3"


@pytest.mark.rule("RoPE positions and rotation, backend")
def test_apply_rope_rotates_forward_by_default():
    """`apply_rope(..., inverse=False)`: the default is the forward rotation, and the inverse
    undoes it."""
    x = np.random.default_rng(0).standard_normal((1, 1, 3, 8))
    fwd = REF.apply_rope(x, [4], 4, 10000.0)
    assert np.allclose(REF.apply_rope(fwd, [4], 4, 10000.0, inverse=True), x, atol=1e-12)
    assert not np.allclose(fwd, x)
    assert np.allclose(REF.apply_rope(x, [4], 4, 10000.0, inverse=False), fwd, atol=0)


@pytest.mark.rule("verify's first mismatch and the budget clamp, backend")
def test_the_row_vector_adapters_read_rows_pairwise():
    """The per-row adapters pair the rows of their two vectors (zip, not strict): a longer
    vector's extra rows are not read. Values: C §11.1 first mismatch, §11.2 clamp
    (`a + 1 > budget -> budget - 1`), C §1 chain start `C + u - 2`."""
    assert REF.verify_accept([[1, 2], [3]], [[1, 2]]) == [2]
    assert REF.budget_clamp([3, 3], [2]) == [1]
    assert REF.chain_starts([5, 6], [1]) == [4]
    assert REF.draft_group_keys([1, 2], [5], False) == REF.draft_group_keys([1], [5], False)
    assert len(REF.draft_group_keys([1, 2], [5], False)) == 1


# ----------------------------------------------------------------------------- draft adapters


def primed(lens):
    """Draft states primed by prompt forwards of `lens` tokens each (`toks` = prompt + the
    sampled token): C §7.4 gives `filled = L - 1` and the seed at `L - 2`."""
    rng = np.random.default_rng(1)
    states, toks = [], []
    for n in lens:
        t = [int(x) for x in rng.integers(0, CFG.vocab, n + 1)]
        cap = MtpHiddenCapture()
        cap.arm()
        cache = REF.new_target_cache(CFG, CFG.max_seq_len, 1)
        REF.forward(model(), np.array([t[:-1]]), cache, [0], None, None, cap)
        state = DraftKv(cache=REF.new_draft_cache(model()))
        warnings: list = []
        REF.prime_draft_kv([state], cap.take(), [t], 1, model(), warnings)
        assert warnings == [] and state.filled == n and state.seed[0] == n - 1
        states.append(state)
        toks.append(t)
    return states, toks


def misaligned_capture(off: int, t: int = 2):
    """A capture whose only row starts at `off` (a fresh state has filled 0)."""
    cap = MtpHiddenCapture()
    cap.arm()
    cap.store(off, np.random.default_rng(2).standard_normal((1, t, CFG.hidden)))
    return cap.take()


@pytest.mark.rule("prompt priming, the draft group loop and the MTP step, backend")
def test_priming_and_extension_warn_into_the_callers_list():
    """C §7.2 / §7.4: a capture that does not start at the draft KV's end poisons the row and
    warns, priming with the prefix-cache text, the step's extension with its own."""
    state, warnings = DraftKv(cache=REF.new_draft_cache(model())), []
    REF.prime_draft_kv([state], misaligned_capture(2), [[1, 2, 3, 4]], 1, model(), warnings)
    assert state.poisoned and warnings == [f"row 0: {PRIME_MISALIGNED}; draft KV poisoned"]
    state, warnings = DraftKv(cache=REF.new_draft_cache(model())), []
    REF.extend_draft_kvs([state], misaligned_capture(2), [[1, 2, 3, 4]], 1, model(), warnings)
    assert state.poisoned and warnings == [f"row 0: {EXTEND_MISALIGNED}; draft KV poisoned"]


@pytest.mark.rule("prompt priming, the draft group loop and the MTP step, backend")
def test_extend_draft_kvs_writes_the_committed_pairs():
    """C §7.2: after a decode step of t = 2 tokens at offset `filled`, committing both, the
    draft KV holds `L - 1` entries and the seed moves to `L - 2`."""
    (state,), (toks,) = primed([4])
    cap = misaligned_capture(state.filled, 2)  # aligned: the capture starts at filled
    toks = toks + [5, 6]
    warnings: list = []
    REF.extend_draft_kvs([state], cap, [toks], 1, model(), warnings)
    assert warnings == [] and not state.poisoned
    assert state.filled == len(toks) - 1 == REF.kv_len(state.cache)
    assert state.seed[0] == len(toks) - 2


@pytest.mark.rule("prompt priming, the draft group loop and the MTP step, backend")
def test_propose_chain_is_the_reference_chain():
    """C §10.2 through the protocol: n greedy tokens from one seed, the draft KV one entry
    longer per step; the same chain as `propose_chain_batched` on the same inputs."""
    seed = np.random.default_rng(3).standard_normal((1, CFG.hidden))
    kv, twin = REF.new_draft_cache(model()), REF.new_draft_cache(model())
    got = REF.propose_chain(model(), seed, [7], 3, [0], kv)
    assert got == rdraft.propose_chain_batched(model(), seed, [7], 3, [0], twin)
    assert len(got[0]) == 3 and REF.kv_len(kv) == 3


@pytest.mark.rule("prompt priming, the draft group loop and the MTP step, backend")
def test_draft_chain_drafts_a_ragged_group_and_warns_into_the_callers_list():
    """C §9.3: under per-sequence advance a group of rows at different lengths is
    front-aligned and drafts `w - u` tokens per row (no warning); a group with no seeded row
    warns "no row" into the caller's list."""
    states, toks = primed([3, 5])
    cache_lens, w = [3, 5], 3
    groups = REF.draft_groups([1, 1], cache_lens, [True, True], w, True)
    assert len(groups) == 1
    warnings: list = []
    drafts = REF.draft_chain(model(), groups, states, toks, cache_lens, [9, 9], w, True, warnings)
    assert warnings == [] and [len(d) for d in drafts] == [2, 2]
    assert [s.filled for s in states] == cache_lens  # chain start + 1 = C + u - 1
    fresh = [DraftKv(cache=REF.new_draft_cache(model()))]
    groups = REF.draft_groups([1], [3], [True], w, False)
    (key,) = groups
    warnings = []
    assert REF.draft_chain(model(), groups, fresh, [[1, 2, 3, 4]], [3], [9], w, False,
                           warnings) == [[]]
    assert warnings == [rdraft.WARNINGS["no row"].format(key=key)]
