"""The backend protocol: every tensor-side operation the step simulator uses, one method each;
and `NumpyBackend`, the reference (each method is the `reference/` function of that rule).

The simulator owns the control flow, a backend the tensors; every length or decision a
backend returns is a host integer, so two backends can be compared step by step. A backend
is picked with `load_backend("numpy" | "torch" | "package.module:factory", device, dtype)`.
Object kinds, argument conventions and refusals: docs/conformance.md, section
"reference/backend.py".
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence

import numpy as np

from raggedspec.reference import align, dispatch, draft, masks, rope, step
from raggedspec.reference.attention import Dsv4AttentionConfig, dsv4_attention
from raggedspec.reference.cache import KvCache, NormalCache, PLAIN_CACHE_CAPACITY, SingleCache
from raggedspec.reference.errors import require
from raggedspec.reference.model import Forward, TinyModel
from raggedspec.reference.plugins import (
    Plugin,
    PluginError,
    PluginSpecError,
    cwd_first,
    load_object,
)
from raggedspec.reference.protocol import PROTOCOL, PROTOCOL_METHODS, CloneIn  # noqa: F401 (re-exported)
from raggedspec.reference.xs_rolling import XsRolling

BACKENDS = ("numpy", "torch")
DTYPES = ("float64", "float32", "bfloat16")
DEVICES = ("cpu", "cuda")




class Backend:
    """The protocol. Every method raises `NotImplementedError` naming itself until a backend
    overrides it. Attributes: `name`, `device` ("cpu", "cuda", ...), `dtype` (the float dtype
    of the backend's tensors: "float64", "float32" or "bfloat16")."""

    name = "abstract"
    device = "cpu"
    dtype = "float64"

    def _missing(self, method: str):
        raise NotImplementedError(f"backend {self.name!r} does not implement {method}")

    # ------------------------------------------------------------------ construction, read-back
    def build_model(self, cfg):
        """The tiny model for `cfg` (`reference.model.ModelConfig`), same weights as the
        reference's `TinyModel(cfg)`. Plan fields: none (once per run)."""
        self._missing("build_model")

    def new_target_cache(self, cfg, max_seq_len: int, batch: int):
        """An empty target cache of `batch` rows: one K/V slot per layer of `cfg` (capacity
        512), then one XsRolling slot per compressed layer.
        Plan fields: none (a prompt step's cache)."""
        self._missing("new_target_cache")

    def new_draft_cache(self, model):
        """An empty draft KV (capacity 16) for `model`'s MTP block; None without a block.
        Plan fields: none."""
        self._missing("new_draft_cache")

    def upload_plan(self, plan):
        """The step plan (`reference.plan.StepPlan`) in the backend's form, once per decode
        step, before the verify forward; what it returns is handed to `forward` as `plan`.
        Plan fields: a port reads whichever it keeps on the device (the reference keeps the
        host plan as is)."""
        self._missing("upload_plan")

    def cache_len(self, cache) -> int:
        """The `current_seq_len` of a target cache (layer 0, dead prefix included) or of one
        K/V slot. Plan fields: none (the plan's `width` is read from it)."""
        self._missing("cache_len")

    def to_numpy(self, x) -> np.ndarray:
        """A backend tensor as a host array (floats as float64). Plan fields: none (read-back)."""
        self._missing("to_numpy")

    def materialize(self, obj) -> dict:
        """The reference's view of a target cache or a K/V slot, as host arrays:
        `{"len", "kv": [(k, v) per K/V slot, front-aligned current data], "xs": [{"tokens",
        "base", "comp": [per row], "history": [per row]} per XsRolling slot]}` for a target
        cache, `{"len", "kv": [(k, v)]}` for a K/V slot. Plan fields: none (read-back)."""
        self._missing("materialize")

    # ------------------------------------------------------------------ target cache rules
    def clone_in(
        self, caches: list, pending_leads: list[int], xs_per_seq: bool, per_sequence: bool
    ) -> CloneIn:
        """`clone_in_cache_reporting_lead` (C §5.4): strip pending leads, front-align under
        PerSequence (the leads are returned: a port may keep them as offsets), stack.
        Plan fields: none; it produces the leads the plan reads (`lead`)."""
        self._missing("clone_in")

    def clone_out(self, batched, b: int) -> list:
        """`clone_out_cache` (C §5.3): b per-sequence caches, each with the batched length.
        Plan fields: none (`b` is the plan's batch)."""
        self._missing("clone_out")

    def truncate_by(self, cache, n_drop: int) -> None:
        """`truncate_cache_by` (C §12.3): every slot `sat(len - n_drop)`; StepRefusal.
        Plan fields: `CommitPlan.n_drop`."""
        self._missing("truncate_by")

    def commit(self, cache, strip_lead: int, kv_len: int, xs_len: int) -> None:
        """The per-sequence commit of one row's own cache after Out (C §12.2) under the strip
        policy (C §5.5; `step.commit_row`): slot by slot, drop a `strip_lead`-column dead
        prefix, then `set_len(kv_len)` on a K/V slot, `set_len(xs_len)` on an XsRolling
        slot; StepRefusal naming the slot. Plan fields (`CommitPlan`, row r): `strip_lead`,
        `kv_len`, `xs_len`."""
        self._missing("commit")

    def xs_append(self, cache, hidden) -> None:
        """Feed `hidden [B,T,H]` to every XsRolling slot (`append_rows`); CacheRefusal.
        Plan fields: none (the forward's hidden)."""
        self._missing("xs_append")

    # ------------------------------------------------------------------ one K/V slot
    def kv_from_arrays(
        self, k: np.ndarray, v: np.ndarray, max_seq_len: int, capacity: int = PLAIN_CACHE_CAPACITY
    ):
        """A K/V slot holding `k, v [B,H,n,D]` at the shared length n (capacity grown by 512
        blocks as appending them would). Plan fields: none."""
        self._missing("kv_from_arrays")

    def kv_append(self, kv, k: np.ndarray, v: np.ndarray) -> None:
        """`SingleCache.append` of both halves at the shared length (C §3); CacheRefusal.
        Plan fields: none."""
        self._missing("kv_append")

    def kv_set_len(self, kv, n: int) -> None:
        """`KvCache.set_len` (C §3); CacheRefusal past the capacity. Plan fields: none."""
        self._missing("kv_set_len")

    def front_align(self, kvs: list) -> list[int]:
        """`front_align_batch` of one-slot sequences (C §4.5): every row padded to
        `max(len)` in place; the leads (a port: offsets, no data motion). Plan fields: none."""
        self._missing("front_align")

    def strip_dead_prefix(self, kv, lead: int) -> None:
        """`drop_dead_prefix` (C §4.4); CacheRefusal. Plan fields: none."""
        self._missing("strip_dead_prefix")

    def concat(self, kvs: list):
        """`concat_kv` (C §5.2 step 5): rows stacked, capacity of the widest. Plan fields: none."""
        self._missing("concat")

    def split(self, kv, g: int) -> list | None:
        """`split_draft_cache` (C §9.8): g pieces with the batched length, None if not g.
        Plan fields: none (g from the plan's groups)."""
        self._missing("split")

    def front_align_draft_group(self, kvs: list, starts: list[int]):
        """`front_align_draft_group` (C §9.7); AlignRefusal / CacheRefusal.
        Plan fields: `chain_start` of the group's rows."""
        self._missing("front_align_draft_group")

    # ------------------------------------------------------------------ masks, positions, attention
    def rope_positions(self, offsets: Sequence[int], b: int, t: int) -> np.ndarray:
        """RoPE positions `[B, T]`: row i, token j at `offsets[i] + j` (`offsets` of length
        1 or B), as host int64. Plan fields: `offsets`."""
        self._missing("rope_positions")

    def apply_rope(
        self, x, offsets: Sequence[int], rope_dims: int, theta: float, inverse: bool = False
    ):
        """`apply_rope` (M §11) on a backend tensor `x [B,H,T,D]`. Plan fields: `offsets`."""
        self._missing("apply_rope")

    def union_mask(self, t_q: int, t_k_full: int, row_q0, window: int, ratio: int, t_c: int):
        """The additive mask `dsv4_attention` builds (M §4 steps 5-7, §5) for queries at
        `q0 = t_k_full - t_q`: `[1,1,t_q,keep+t_c]` on the uniform path, `[B,1,t_q,keep+t_c]`
        from `ragged_union_mask` when `row_q0` is ragged; DispatchRefusal as
        `resolve_ragged_rows`. Plan fields: `row_q0` (and `width` + the window as `t_k_full`)."""
        self._missing("union_mask")

    def dsv4_attention(self, q, k, v, compressed_kv, cfg: Dsv4AttentionConfig, sinks=None):
        """`dsv4_attention` (M §4) on backend tensors (no caller mask). Plan fields: none."""
        self._missing("dsv4_attention")

    # ------------------------------------------------------------------ model and draft
    def forward(
        self,
        model,
        tokens: np.ndarray,
        cache,
        offsets: Sequence[int],
        row_q0,
        lead_pad,
        capture=None,
        plan=None,
    ) -> Forward:
        """The target forward (`TinyModel.forward`): `tokens [B,T]` appended to the batched
        `cache`; `Forward(logits, hidden)` as backend tensors; the pre-norm hidden stored in
        `capture` (a `reference.dispatch.MtpHiddenCapture`). Refusals of the append and of
        `dsv4_attention`. Plan fields: `offsets`, `row_q0`, `fwd_lead` (also given as host
        lists; `plan` is `upload_plan`'s result on a verify step, None on a prompt or a
        deferral step)."""
        self._missing("forward")

    def mtp_step(self, model, fused, start_pos: Sequence[int], kv):
        """One MTP decoder step `forward_tokens_rows` (C §10.1) on `fused [G,T,H]` over the
        draft K/V slot `kv`; the pre-norm hidden. DispatchRefusal ("desync").
        Plan fields: `chain_start` (as `start_pos`)."""
        self._missing("mtp_step")

    def propose_chain(
        self, model, seed_hidden, last_tokens, n: int, chain_starts: Sequence[int], kv
    ) -> list[list[int]]:
        """`propose_chain_batched` (C §10.2): n greedy tokens per row, one batched MTP step
        each (per-row positions for a ragged group).
        Plan fields: `chain_start` of the group's rows."""
        self._missing("propose_chain")

    def draft_chain(
        self,
        model,
        groups: dict,
        states: list,
        toks: list,
        cache_lens: list[int],
        budgets: list[int],
        w: int,
        per_seq_advance: bool,
        warnings: list | None = None,
    ) -> list[list[int]]:
        """`group_drafting_loop` (C §9.3): one batched chain per draft group, written back.
        Plan fields: `groups`, `cache_lens`, `budgets`, `per_seq`."""
        self._missing("draft_chain")

    def extend_draft_kvs(
        self, states: list, capture, toks: list, batch: int, model, warnings: list | None = None
    ) -> None:
        """`extend_draft_kvs` (C §7.2, §16 step 10).
        Plan fields: none (the forward's capture holds the offsets)."""
        self._missing("extend_draft_kvs")

    def prime_draft_kv(
        self, states: list, capture, toks: list, batch: int, model, warnings: list | None = None
    ) -> None:
        """`prime_draft_kv` (C §7.4). Plan fields: none (a prompt step)."""
        self._missing("prime_draft_kv")


def missing_methods(backend) -> list[str]:
    """The protocol methods `backend` does not implement: left to the abstract base (not
    overridden), or absent from its type (an object that is not a `Backend`)."""
    return [m for m in PROTOCOL_METHODS
            if getattr(type(backend), m, None) in (None, getattr(Backend, m))]


# ----------------------------------------------------------------------------- the reference


def _slot_view(slot) -> dict:
    """One slot as the conformance suite compares it."""
    if isinstance(slot, XsRolling):
        return {"tokens": list(slot.tokens), "base": list(slot.base),
                "comp": [slot.row_comp(i) for i in range(slot.batch)],
                "history": [slot.row_history(i) for i in range(slot.batch)]}
    k, v = slot.k.current_data(), slot.v.current_data()
    return {"k": None if k is None else k.copy(), "v": None if v is None else v.copy(),
            "len": slot.current_seq_len, "capacity": slot.k.capacity_seq_len}


class NumpyBackend(Backend):
    """The reference backend: every method is the `reference/` function of its rule, in
    float64 NumPy on the host. `device` must be "cpu" and `dtype` "float64"."""

    name = "numpy"

    def __init__(self, device: str = "cpu", dtype: str = "float64") -> None:
        require(device == "cpu", f"the numpy backend runs on the cpu only, not {device!r}")
        require(dtype == "float64", f"the numpy backend is float64 only, not {dtype!r}")
        self.device, self.dtype = device, dtype

    # construction, read-back
    def build_model(self, cfg):
        return TinyModel(cfg)

    def new_target_cache(self, cfg, max_seq_len, batch):
        slots = [KvCache.new_normal(max_seq_len) for _ in cfg.compress_ratios]
        slots += [
            XsRolling(r, max_seq_len=max_seq_len, batch=batch) for r in cfg.compress_ratios if r > 0
        ]
        return NormalCache(slots)

    def new_draft_cache(self, model):
        return None if model.mtp is None else model.mtp.new_draft_cache()

    def upload_plan(self, plan):
        return plan

    def cache_len(self, cache):
        return cache.current_seq_len

    def to_numpy(self, x):
        return np.array(x, copy=True)

    def materialize(self, obj):
        if isinstance(obj, NormalCache):
            views = [_slot_view(s) for s in obj.slots]
            return {"len": obj.current_seq_len,
                    "kv": [(s["k"], s["v"]) for s in views if "k" in s],
                    "capacity": [s["capacity"] for s in views if "k" in s],
                    "xs": [s for s in views if "tokens" in s]}
        s = _slot_view(obj)
        return {"len": s["len"], "kv": [(s["k"], s["v"])], "capacity": [s["capacity"]], "xs": []}

    # target cache rules
    def clone_in(self, caches, pending_leads, xs_per_seq, per_sequence):
        ci = align.clone_in_cache_reporting_lead(caches, pending_leads, xs_per_seq, per_sequence)
        return CloneIn(ci.batched, [int(x) for x in ci.lead_pad], ci.ragged_decode_supported)

    def clone_out(self, batched, b):
        return align.clone_out_cache(batched, b)

    def truncate_by(self, cache, n_drop):
        step.truncate_cache_by(cache, n_drop)

    def commit(self, cache, strip_lead, kv_len, xs_len):
        step.commit_row(cache, strip_lead, kv_len, xs_len)

    def xs_append(self, cache, hidden):
        for slot in cache.slots:
            if isinstance(slot, XsRolling):
                slot.append_rows(hidden)

    # one K/V slot
    def kv_from_arrays(self, k, v, max_seq_len, capacity=PLAIN_CACHE_CAPACITY):
        kv = KvCache(SingleCache(max_seq_len, capacity), SingleCache(max_seq_len, capacity))
        kv.append(np.asarray(k, dtype=np.float64), np.asarray(v, dtype=np.float64))
        return kv

    def kv_append(self, kv, k, v):
        kv.append(np.asarray(k, dtype=np.float64), np.asarray(v, dtype=np.float64))

    def kv_set_len(self, kv, n):
        kv.set_len(n)

    def front_align(self, kvs):
        return align.front_align_batch([NormalCache([kv]) for kv in kvs], xs_per_seq=False)

    def strip_dead_prefix(self, kv, lead):
        align.drop_dead_prefix(kv, lead)

    def concat(self, kvs):
        return align.concat_kv(kvs)

    def split(self, kv, g):
        return align.split_draft_cache(kv, g)

    def front_align_draft_group(self, kvs, starts):
        return align.front_align_draft_group(kvs, starts)

    # masks, positions, attention
    def rope_positions(self, offsets, b, t):
        off = np.asarray([int(o) for o in offsets], dtype=np.int64)
        require(off.size in (1, b), f"{off.size} offsets for a batch of {b}")
        return np.broadcast_to(off[:, None] + np.arange(t, dtype=np.int64)[None, :], (b, t)).copy()

    def apply_rope(self, x, offsets, rope_dims, theta, inverse=False):
        return rope.apply_rope(x, offsets, rope_dims, theta, inverse=inverse)

    def union_mask(self, t_q, t_k_full, row_q0, window, ratio, t_c):
        # dsv4_attention's steps 3-7 with raw_prefix 0 and no caller mask
        q0 = t_k_full - t_q
        b = 1 if row_q0 is None else len(row_q0)
        rows = dispatch.resolve_ragged_rows(row_q0, q0, b)
        raw_base, keep = masks.raw_keep_span(t_q, window, t_k_full)
        valid = np.concatenate([masks.raw_validity(t_q, q0, raw_base, keep, window),
                                masks.compressed_validity(t_q, q0, t_c, ratio)], axis=1)
        if rows is None:
            return np.where(valid, 0.0, -np.inf)[None, None]
        return masks.ragged_union_mask(rows, q0, valid, raw_base, keep, ratio, t_c)

    def dsv4_attention(self, q, k, v, compressed_kv, cfg, sinks=None):
        return dsv4_attention(q, k, v, compressed_kv, None, cfg, sinks=sinks)

    # model and draft
    def forward(self, model, tokens, cache, offsets, row_q0, lead_pad, capture=None, plan=None):
        return model.forward(tokens, cache, offsets, row_q0, lead_pad, capture)

    def mtp_step(self, model, fused, start_pos, kv):
        return model.mtp.forward_tokens_rows(fused, start_pos, kv)

    def propose_chain(self, model, seed_hidden, last_tokens, n, chain_starts, kv):
        return draft.propose_chain_batched(model, seed_hidden, last_tokens, n, chain_starts, kv)

    def draft_chain(
        self, model, groups, states, toks, cache_lens, budgets, w, per_seq_advance, warnings=None
    ):
        return draft.group_drafting_loop(
            model, groups, states, toks, cache_lens, budgets, w, per_seq_advance, warnings
        )

    def extend_draft_kvs(self, states, capture, toks, batch, model, warnings=None):
        draft.extend_draft_kvs(states, capture, toks, batch, model, warnings)

    def prime_draft_kv(self, states, capture, toks, batch, model, warnings=None):
        draft.prime_draft_kv(states, capture, toks, batch, model, warnings)


# ----------------------------------------------------------------------------- selection


# Named backends, as `module:factory` strings: the reference never imports the port's
# packages itself (the import arrow runs gpu -> reference only).
NAMED_BACKENDS = {
    "torch": "raggedspec.gpu.backend:TorchBackend",
    "cupy": "raggedspec.gpu.cupy_backend:CupyBackend",
    "paged": "raggedspec.gpu.paged_backend:PagedBackend",
}


def load_backend(spec=None, device: str | None = None, dtype: str | None = None) -> Backend:
    """A backend from its name: None or "numpy" -> `NumpyBackend`; a name in `NAMED_BACKENDS`
    ("torch" -> `raggedspec.gpu.backend:TorchBackend`, "cupy" ->
    `raggedspec.gpu.cupy_backend:CupyBackend`, CUDA
    only: ValueError with the reason elsewhere) or a "package.module:factory" string ->
    `factory(device=, dtype=)` (a class or a function), imported with the working folder
    first on sys.path (`reference.plugins`; an exception inside it is a PluginError). A
    `Backend` instance is returned as is. ValueError (naming the spec) for an unknown name,
    a module or attribute that does not exist, or a factory that does not return a Backend;
    the backends' own ValueErrors for an unsupported device or dtype (e.g. "cuda" without CUDA)."""
    if isinstance(spec, Backend):
        return spec
    kwargs = {}
    if device is not None:
        kwargs["device"] = device
    if dtype is not None:
        kwargs["dtype"] = dtype
    if spec is None or spec == "numpy":
        return NumpyBackend(**kwargs)
    named = NAMED_BACKENDS.get(spec) if isinstance(spec, str) else None
    if named is None and (not isinstance(spec, str) or ":" not in spec):
        raise ValueError(f"unknown backend {spec!r}: expected numpy, {', '.join(NAMED_BACKENDS)} "
                         f"or package.module:factory")
    backend = _named_backend(spec, named, kwargs) if named else _user_backend(spec, kwargs)
    if not isinstance(backend, Backend):
        raise ValueError(f"backend {spec!r}: {(named or spec).partition(':')[2]} returned "
                         f"{type(backend).__name__}, not a raggedspec.reference.backend.Backend")
    return backend


def _named_backend(spec: str, named: str, kwargs: dict):
    """One of raggedspec's own backends (`NAMED_BACKENDS`); ValueError when its package
    does not import (torch, the gpu package)."""
    mod_name, _, attr = named.partition(":")
    try:
        factory = getattr(importlib.import_module(mod_name), attr)
    except ImportError as exc:
        extra = "cupy" if spec == "cupy" else "torch"
        raise ValueError(f"backend {spec!r} needs torch and the gpu package: {exc} (pip install "
                         f"'raggedspec[{extra}]')") from exc
    return factory(**kwargs)


def _user_backend(spec: str, kwargs: dict):
    """The user's `module:factory` called with `kwargs`: ValueError when the name does not
    resolve; PluginError (with the factory's exception as cause) when the factory raises."""
    try:
        factory = load_object(spec, "backend")
    except PluginSpecError as exc:
        raise ValueError(f"backend {spec!r}: {exc}") from None
    try:
        with cwd_first():
            return factory(**kwargs)
    except Exception as exc:  # the user's factory raised: its failure, with its traceback
        raise PluginError(Plugin("backend", spec), " when called") from exc
