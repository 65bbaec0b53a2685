"""The backend protocol itself (reference/backend.py, DESIGN "Shape") and the two backends' own
contract, on small explicit cases: the abstract `Backend` refuses every protocol method naming
it, `missing_methods` names what a subclass leaves to the base, `load_backend` resolves every
kind of spec and refuses the rest with the messages its docstring states, the NumPy backend is
cpu and float64 only, the torch backend resolves its device and dtype; then construction,
read-back and the per-row adapters run through one body on both backends (the values the
protocol's docstrings and docs/conformance.md state), the torch backend's own choices (floats
in its dtype, one draft store per KV geometry), its cache-rule refusals word for word as the
reference's, and the port's dispatch predicates' malformed input. test_backend.py compares
the backend under test with the reference method by method on generated inputs.
"""

from __future__ import annotations

import inspect

import numpy as np
import pytest
import torch

from raggedspec.conformance.backends import assert_close, assert_exact, assert_same_cache
from raggedspec.gpu.backend import DTYPES, TorchBackend
from raggedspec.reference.attention import Dsv4AttentionConfig
from raggedspec.reference.backend import NAMED_BACKENDS, PROTOCOL_METHODS, Backend, NumpyBackend
from raggedspec.reference.backend import load_backend, missing_methods
from raggedspec.reference.errors import Refusal
from raggedspec.reference.model import ModelConfig

REF = NumpyBackend()
CFG = ModelConfig()  # compress ratios (0, 4), an MTP block
BOTH = pytest.mark.parametrize("be", [REF, TorchBackend("cpu")], ids=["numpy", "torch"])


def refusal(fn, *args):
    """`(class name, message)` of the refusal or malformed-input error `fn(*args)` raises."""
    with pytest.raises((Refusal, ValueError)) as info:
        fn(*args)
    return type(info.value).__name__, str(info.value)


# --- the abstract base, load_backend, the two constructors ----------------------------------------


@pytest.mark.rule("backend protocol: every tensor-side op is one method",
                  "every protocol method is called by the suite")
@pytest.mark.parametrize("method", PROTOCOL_METHODS)
def test_every_method_of_the_abstract_base_raises_naming_itself(method):
    """`Backend`'s methods (the protocol's documentation) raise NotImplementedError naming the
    backend and the method, whatever arguments they get, for the base and a bare subclass."""

    class Bare(Backend):
        name = "bare"

    for be in (Backend(), Bare()):
        params = inspect.signature(getattr(be, method)).parameters.values()
        args = [None for p in params if p.default is inspect.Parameter.empty]
        with pytest.raises(NotImplementedError) as info:
            getattr(be, method)(*args)
        assert str(info.value) == f"backend '{be.name}' does not implement {method}"


@pytest.mark.rule("backend protocol: every tensor-side op is one method")
def test_missing_methods_names_what_a_subclass_leaves_to_the_base():
    """Every protocol method of a bare subclass is missing, in the table's order; an override
    is not; both backends override every one; an object that is not a Backend implements
    none of them."""

    class Bare(Backend):
        pass

    class One(Backend):
        def cache_len(self, cache):
            return 0

    assert missing_methods(Bare()) == list(PROTOCOL_METHODS)
    assert missing_methods(One()) == [m for m in PROTOCOL_METHODS if m != "cache_len"]
    assert missing_methods(NumpyBackend()) == missing_methods(TorchBackend("cpu")) == []
    assert missing_methods(object()) == list(PROTOCOL_METHODS)
    assert 20 <= len(PROTOCOL_METHODS) <= 30


@pytest.mark.rule("backend protocol: every tensor-side op is one method")
def test_the_numpy_backend_is_cpu_and_float64_only():
    """`device` must be "cpu" and `dtype` "float64" (the defaults); anything else is malformed."""
    be = NumpyBackend()
    assert (be.name, be.device, be.dtype) == ("numpy", "cpu", "float64")
    assert (NumpyBackend("cpu", "float64").device, NumpyBackend("cpu", "float64").dtype) == (
        "cpu", "float64")
    assert refusal(NumpyBackend, "cuda") == (
        "ValueError", "the numpy backend runs on the cpu only, not 'cuda'")
    assert refusal(NumpyBackend, "cpu", "float32") == (
        "ValueError", "the numpy backend is float64 only, not 'float32'")


@pytest.mark.rule("backend protocol: every tensor-side op is one method")
def test_load_backend_resolves_none_numpy_an_instance_and_device_dtype():
    """None and "numpy" give a NumpyBackend; device and dtype reach the factory when given;
    a Backend instance comes back as is."""
    for spec in (None, "numpy"):
        for args in ((), ("cpu", "float64")):
            be = load_backend(spec, *args)
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
    assert type(load_backend("raggedspec.reference.backend:NumpyBackend", "cpu",
                             "float64")) is NumpyBackend
    assert type(load_backend("raggedspec.reference.backend:NumpyBackend")) is NumpyBackend
    torch_be = load_backend("torch", "cpu", "float64")
    assert type(torch_be).__name__ == "TorchBackend" and torch_be.name == "torch"
    assert (torch_be.device, torch_be.dtype) == ("cpu", "float64")


@pytest.mark.rule("backend protocol: every tensor-side op is one method")
def test_load_backend_refuses_unknown_specs_with_their_reasons(monkeypatch):
    """ValueError naming the spec for an unknown name (or a non-string, even an unhashable
    one), a module that does not import (a named backend: "needs torch and the gpu
    package"), a missing attribute, and a factory that does not return a Backend."""
    names = ", ".join(NAMED_BACKENDS)
    for spec in ("nope", 3, ["numpy"]):  # a non-string is never looked up by name
        assert refusal(load_backend, spec) == (
            "ValueError", f"unknown backend {spec!r}: expected numpy, {names} or "
                          "package.module:factory")
    with pytest.raises(ValueError, match=r"^backend 'no_such_pkg_x:f': cannot import "
                                         r"'no_such_pkg_x' \(.*no_such_pkg_x"):
        load_backend("no_such_pkg_x:f")
    monkeypatch.setitem(NAMED_BACKENDS, "ghost", "no_such_pkg_x:Factory")
    with pytest.raises(ValueError, match=r"^backend 'ghost' needs torch and the gpu package: "
                                         r".*no_such_pkg_x"):
        load_backend("ghost")
    for attr in ("NoSuchFactory", "NumpyBackend:x"):  # the module is before the first ':'
        spec = f"raggedspec.reference.backend:{attr}"
        assert refusal(load_backend, spec)[1] == (
            f"backend {spec!r}: module 'raggedspec.reference.backend' has no attribute {attr!r}")
    assert refusal(load_backend, "builtins:dict", "cpu")[1] == (
        "backend 'builtins:dict': dict returned dict, not a raggedspec.reference.backend.Backend")


@pytest.mark.rule("backend protocol: every tensor-side op is one method")
def test_the_torch_constructor_resolves_device_and_dtype(monkeypatch):
    """Device: the argument, else `RAGGEDSPEC_DEVICE`, else "cpu" (a cpu device may carry an
    index: the CUDA device-count check is for CUDA only); dtype float64 by default; an
    unknown dtype or device, or CUDA where torch has none, is malformed (ValueError)."""
    monkeypatch.delenv("RAGGEDSPEC_DEVICE", raising=False)
    be = TorchBackend()
    assert (be.name, be.device, be.dtype, be.dev, be.tdtype) == (
        "torch", "cpu", "float64", torch.device("cpu"), torch.float64)
    be = TorchBackend("cpu", "bfloat16")
    assert (be.device, be.dtype, be.tdtype) == ("cpu", "bfloat16", torch.bfloat16)
    be = TorchBackend("cpu:5")
    assert (be.device, be.dev) == ("cpu:5", torch.device("cpu:5"))
    monkeypatch.setenv("RAGGEDSPEC_DEVICE", "meta")
    assert TorchBackend().device == "meta" and TorchBackend("cpu").device == "cpu"
    assert refusal(TorchBackend, "cpu", "float16") == (
        "ValueError", f"dtype 'float16' must be one of {sorted(DTYPES)}")
    with pytest.raises(ValueError, match=r"^unknown torch device 'nope': "):
        TorchBackend("nope")
    if not torch.cuda.is_available():
        assert refusal(TorchBackend, "cuda")[1] == (
            f"device 'cuda' requested but CUDA is not available to torch {torch.__version__} "
            "on this machine")
    else:
        n = torch.cuda.device_count()
        assert refusal(TorchBackend, f"cuda:{n}")[1] == (
            f"device 'cuda:{n}': only {n} CUDA device(s)")
        assert TorchBackend(f"cuda:{n - 1}").device == f"cuda:{n - 1}"


# --- construction and read-back, both backends ----------------------------------------------------


@pytest.mark.rule("backend protocol: every tensor-side op is one method")
@BOTH
def test_build_model_and_new_target_cache_follow_the_config(be):
    """`build_model(cfg)` is the model of `cfg`; a target cache holds one K/V slot per layer,
    then one XsRolling slot (with the cache's max_seq_len and batch) per compressed layer,
    ratio 1 included; both backends' caches read back alike, empty, and refuse a history past
    `max_seq_len` with the same text."""
    cfg = ModelConfig(compress_ratios=(4, 0, 1), max_seq_len=600, mtp="heads")
    assert be.build_model(cfg).cfg == cfg
    cache = be.new_target_cache(cfg, 600, 3)
    assert [s.kind for s in cache.slots] == ["Normal"] * 3 + ["XsRolling"] * 2
    assert [(x.ratio, x.max_seq_len, x.batch) for x in cache.slots[3:]] == [(4, 600, 3),
                                                                            (1, 600, 3)]
    small = ModelConfig(compress_ratios=(0, 1, 4))
    p, r = be.new_target_cache(small, 4, 2), REF.new_target_cache(small, 4, 2)
    assert_same_cache(be.materialize(p), REF.materialize(r), "float64", "empty cache")
    hidden = np.random.default_rng(0).standard_normal((2, 5, small.hidden))
    mine = hidden if be is REF else torch.from_numpy(hidden)  # a backend tensor, as a forward's
    assert refusal(be.xs_append, p, mine) == refusal(REF.xs_append, r, hidden) == (
        "CacheRefusal", "xs row 0 would hold 5 tokens, above max_seq_len 4")


@pytest.mark.rule("backend protocol: every tensor-side op is one method")
def test_a_target_cache_is_built_on_the_backends_device():
    """The XsRolling slots of a new target cache live on the backend's device (here torch's
    "meta" device, which every machine has)."""
    be = TorchBackend("meta")
    cache = be.new_target_cache(ModelConfig(compress_ratios=(0, 4, 128)), 4096, 2)
    xs = [s for s in cache.slots if s.kind == "XsRolling"]
    assert len(xs) == 2 and {s.device for s in xs} == {torch.device("meta")}


@pytest.mark.rule("backend protocol: every tensor-side op is one method")
@BOTH
def test_to_numpy_returns_a_copy(be):
    """`to_numpy` gives a host array the caller may keep: a copy, not a view."""
    x = np.arange(4.0)
    out = be.to_numpy(x)
    assert out is not x and not np.shares_memory(out, x) and out.tolist() == [0.0, 1.0, 2.0, 3.0]
    x[0] = 9.0
    assert out[0] == 0.0
    out[1] = 7.0
    assert x[1] == 1.0
    assert_exact(be.to_numpy([1, 2]), np.array([1, 2]), "list")


@pytest.mark.rule("backend protocol: every tensor-side op is one method")
@BOTH
def test_materialize_reads_unmaterialized_slots_as_none_halves(be):
    """A fresh target cache (ratios 4 and 0, batch 2): two K/V slots of length 0 and
    capacity 512, each `(None, None)`, and one XsRolling slot of two empty rows; a fresh
    draft KV read alone: `(None, None)` at capacity 16. A slot built from K and V reads back
    their values as host copies: writing them leaves the slot as it was."""
    cfg = ModelConfig(compress_ratios=(4, 0), max_seq_len=600)
    view = be.materialize(be.new_target_cache(cfg, 600, 2))
    assert view["len"] == 0 and view["kv"] == [(None, None), (None, None)]
    assert view["capacity"] == [512, 512]
    [xs] = view["xs"]
    assert (xs["tokens"], xs["base"]) == ([0, 0], [0, 0])
    draft = be.new_draft_cache(be.build_model(ModelConfig()))
    assert be.materialize(draft) == {"len": 0, "kv": [(None, None)], "capacity": [16], "xs": []}
    assert be.new_draft_cache(be.build_model(ModelConfig(mtp="heads"))) is None
    k = np.arange(6.0).reshape(1, 1, 3, 2)
    slot = be.kv_from_arrays(k, -k, 4096, 16)
    (kk, vv), = be.materialize(slot)["kv"]
    assert kk.tolist() == k.tolist() and vv.tolist() == (-k).tolist()
    kk[...] = 7.0
    vv[...] = 7.0
    (again_k, again_v), = be.materialize(slot)["kv"]
    assert again_k.tolist() == k.tolist() and again_v.tolist() == (-k).tolist()


@pytest.mark.rule("K/V append, growth and set_len, backend")
@BOTH
def test_kv_slots_hold_float64_at_the_asked_capacity(be):
    """A K/V slot built from (or appended with) integer arrays holds float64 K and V, both
    halves at the asked capacity."""
    k = np.arange(8, dtype=np.int64).reshape(1, 1, 2, 4)
    kv = be.kv_from_arrays(k, k + 1, 4096, 16)
    be.kv_append(kv, k, k + 1)
    view = be.materialize(kv)
    assert view["capacity"] == [16] and view["len"] == 4
    (kk, vv), = view["kv"]
    assert kk.dtype == vv.dtype == np.float64
    assert kk[0, 0, :, 0].tolist() == [0.0, 4.0, 0.0, 4.0]
    assert vv[0, 0, :, 0].tolist() == [1.0, 5.0, 1.0, 5.0]


@pytest.mark.rule("RoPE positions and rotation, backend")
@BOTH
def test_rope_positions_are_int64_and_refuse_a_wrong_offset_count(be):
    """M §11: `[B, T]` host int64 (an empty batch too); offsets of length 1 or B only."""
    pos = be.rope_positions([], 0, 3)
    assert pos.shape == (0, 3) and pos.dtype == np.int64
    assert be.rope_positions([5, 2], 2, 2).tolist() == [[5, 6], [2, 3]]
    assert refusal(be.rope_positions, [1, 2], 3, 2) == ("ValueError",
                                                        "2 offsets for a batch of 3")


@pytest.mark.rule("RoPE positions and rotation, backend")
@BOTH
def test_apply_rope_rotates_forward_by_default(be):
    """`apply_rope(..., inverse=False)` by default: the reference's forward rotation, which
    the inverse undoes."""
    x = np.random.default_rng(0).standard_normal((1, 1, 3, 8))
    fwd = be.to_numpy(be.apply_rope(x, [4], 4, 10000.0))
    assert_close(fwd, REF.apply_rope(x, [4], 4, 10000.0, inverse=False), "float64", "rope")
    assert np.allclose(be.to_numpy(be.apply_rope(fwd, [4], 4, 10000.0, inverse=True)), x,
                       atol=1e-12)
    assert not np.allclose(fwd, x)


# --- the torch backend's own choices and refusals -------------------------------------------------


@pytest.mark.rule("backend protocol: every tensor-side op is one method")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_slots_model_and_masks_hold_floats_in_the_backend_dtype(dtype):
    """Floats in the backend dtype (a K/V slot's buffers round its input; the forward's
    logits in that dtype, within its policy of the reference); both union-mask paths in that
    dtype too, their 0/-inf values the reference's bit for bit."""
    be = TorchBackend("cpu", dtype)
    k = np.full((1, 1, 2, 4), 0.1)
    slot = be.kv_from_arrays(k, k + 0.2, 64)
    tdtype = getattr(torch, dtype)
    assert slot.kv.k.dtype == slot.kv.v.dtype == tdtype
    want = torch.tensor(k).to(tdtype).to(torch.float64).numpy()
    assert_exact(be.materialize(slot)["kv"][0][0], want, "K rounded to the backend dtype")
    toks = np.array([[3, 1, 4, 1, 5]])
    fwd = be.forward(be.build_model(CFG), toks, be.new_target_cache(CFG, 64, 1), [0], None, None)
    ref = REF.forward(REF.build_model(CFG), toks, REF.new_target_cache(CFG, 64, 1), [0], None,
                      None)
    assert fwd.logits.dtype == fwd.hidden.dtype == tdtype
    assert_close(be.to_numpy(fwd.logits), ref.logits, dtype, "logits")
    for row_q0 in (None, [4, 2]):
        mask = be.union_mask(2, 6, row_q0, 3, 4, 1)
        assert mask.dtype == tdtype, row_q0
        assert_exact(be.to_numpy(mask), REF.union_mask(2, 6, row_q0, 3, 4, 1), f"mask {row_q0}")


@pytest.mark.rule("dead-prefix union mask, backend")
def test_the_uniform_union_mask_of_a_float64_backend_is_float64():
    """The default dtype: the uniform mask too is float64, not torch's default float32."""
    be = TorchBackend("cpu")
    mask = be.union_mask(2, 5, None, 4, 0, 0)
    assert mask.dtype == torch.float64
    assert_exact(be.to_numpy(mask), REF.union_mask(2, 5, None, 4, 0, 0), "mask")


@pytest.mark.rule("backend protocol: every tensor-side op is one method")
def test_a_fresh_backend_keeps_one_draft_store_per_kv_heads_and_width():
    """`new_draft_cache`: a row of the backend's `DraftStore` for the model's (n_kv_heads,
    head_dim), `[rows, n_kv_heads, width, head_dim]` in the backend dtype, shared by every
    draft KV of that geometry; another geometry gets its own store."""
    be = TorchBackend("cpu")
    m = be.build_model(ModelConfig(n_heads=4, n_kv_heads=2, head_dim=8, rope_dims=4))
    a, b = be.new_draft_cache(m), be.new_draft_cache(m)
    assert a.store is b.store and a.idx != b.idx
    shape = a.store.kv.k.shape
    assert (shape[1], shape[3]) == (2, 8) and a.store.kv.k.dtype == torch.float64
    c = be.new_draft_cache(be.build_model(CFG))
    assert c.store is not a.store and (c.store.kv.k.shape[1], c.store.kv.k.shape[3]) == (1, 16)
    assert be.materialize(a) == {"len": 0, "kv": [(None, None)], "capacity": [16], "xs": []}


def prompt(be, model, n, batch=1):
    """A target cache after a prompt forward of `n` tokens per row, compressor history fed."""
    cache = be.new_target_cache(CFG, CFG.max_seq_len, batch)
    toks = (np.arange(batch * n).reshape(batch, n) * 5 + 1) % CFG.vocab
    be.xs_append(cache, be.forward(model, toks, cache, [0], None, None).hidden)
    return cache


@pytest.mark.rule("the port's per-sequence caches and clone-in")
def test_clone_out_refuses_a_bad_row_count_as_the_reference():
    """b >= 1; a materialized K/V layer or an XsRolling layer with another row count than b
    is named; an unmaterialized cache gives b empty row caches."""
    be = TorchBackend("cpu")
    pm, rm = be.build_model(CFG), REF.build_model(CFG)
    for b in (0, -1):
        assert refusal(be.clone_out, be.new_target_cache(CFG, 64, 1), b) == (
            "ValueError", f"clone_out_cache needs b >= 1, got {b}")
    p, r = prompt(be, pm, 3, batch=2), prompt(REF, rm, 3, batch=2)
    assert refusal(be.clone_out, p, 3) == refusal(REF.clone_out, r, 3) == (
        "ValueError", "layer 0 holds 2 rows, not 3")
    p, r = be.new_target_cache(CFG, 64, 2), REF.new_target_cache(CFG, 64, 2)
    assert refusal(be.clone_out, p, 3) == refusal(REF.clone_out, r, 3) == (
        "ValueError", "xs layer 2 holds 2 rows, not 3")
    got, want = be.clone_out(p, 2), REF.clone_out(r, 2)
    assert len(got) == len(want) == 2
    for i, (a, w) in enumerate(zip(got, want, strict=True)):
        assert_same_cache(be.materialize(a), REF.materialize(w), "float64", f"row {i}")


@pytest.mark.rule("front alignment, concatenation, split and dead-prefix strip, backend")
@BOTH
def test_split_of_an_unmaterialized_slot_gives_g_copies_of_its_metadata(be):
    """`split_draft_cache`: g >= 1 (refused word for word); an unmaterialized slot gives g
    unmaterialized pieces with its length and capacity."""
    kv = be.new_target_cache(CFG, 64, 1).slots[0]
    assert refusal(be.split, kv, 0) == ("ValueError", "split_draft_cache needs g >= 1, got 0")
    be.kv_set_len(kv, 3)
    pieces = [be.materialize(piece) for piece in be.split(kv, 3)]
    assert pieces == [{"len": 3, "kv": [(None, None)], "capacity": [512], "xs": []}] * 3


@pytest.mark.rule("front alignment, concatenation, split and dead-prefix strip, backend")
@BOTH
def test_front_align_refuses_an_xs_slot_with_the_xs_flag_off(be):
    """`front_align` is `front_align_batch` with the xs flag off: an XsRolling slot is
    refused, word for word."""
    assert refusal(be.front_align, [be.new_target_cache(CFG, 64, 1).slots[2]]) == (
        "CacheRefusal", "sequence 0 slot 0: front_pad to 0: an XsRolling slot cannot be "
        "front-padded while ARC_V4_XS_PER_SEQ is off (xs_per_seq=False)")


@pytest.mark.rule("front_align_draft_group, backend")
@BOTH
def test_front_align_draft_group_refuses_non_normal_and_unmaterialized_rows(be):
    """C §9.7: a row that is not a Normal slot, or whose buffer is unmaterialized, is
    refused (AlignRefusal) before any work, the row named."""
    cache = be.new_target_cache(CFG, 64, 1)
    assert refusal(be.front_align_draft_group, [cache.slots[2]], [0]) == (
        "AlignRefusal", "draft row 0 is a XsRolling slot, not Normal")
    assert refusal(be.front_align_draft_group, [cache.slots[0]], [0]) == (
        "AlignRefusal", "draft row 0's buffer is unmaterialized")


@pytest.mark.rule("dsv4_attention, backend")
def test_dsv4_attention_without_sinks_matches_the_reference():
    """`sinks=None`: attention without sink logits, as the reference, by default too."""
    be = TorchBackend("cpu")
    rng = np.random.default_rng(5)
    q, k = rng.standard_normal((1, 2, 2, 8)), rng.standard_normal((1, 1, 5, 8))
    cfg = Dsv4AttentionConfig(0, 4)
    want = REF.dsv4_attention(q, k, k, None, cfg)
    assert_close(be.to_numpy(be.dsv4_attention(q, k, k, None, cfg)), want, "float64", "output")
    assert_close(be.to_numpy(be.dsv4_attention(q, k, k, None, cfg, None)),
                 REF.dsv4_attention(q, k, k, None, cfg, None), "float64", "explicit None")
