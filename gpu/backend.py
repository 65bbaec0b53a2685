"""The torch backend: `raggedspec.reference.backend.Backend` on the port (`gpu/`), on any device and
in
float64, float32 or bfloat16.

A thin adapter: each protocol method is one call. The host-side rules (clone-in order,
pending-lead strip, front alignment, first mismatch, per-sequence commit, cohort truncation,
length vectors, draft-group membership and the capacity arithmetic) are the reference's
functions, run on host integers or on the port's slots (`gpu.slots`, which implement the slot
protocol `reference.align` uses); the tensor side is the port's: masks by broadcast
(`gpu.masks`), RoPE by gathered tables (`gpu.rope`), attention in place (`gpu.attention`,
`gpu.model.dsv4_attention_rows`), the model forward and the MTP chain (`gpu.model`,
`gpu.draft`), the compressor history (`gpu.xs_rolling`). The reference is used for the model's
weights (`build_model` converts the reference `TinyModel`'s seeded weights once) and for host
records (`reference.draft.DraftKv`, `reference.dispatch.MtpHiddenCapture`).

Layout and host work (docs/benchmarks.md "Host work per decode step"): a batched K/V slot keeps
its rows in place with per-row alignment offsets as host integers; per-sequence caches are row
handles (host integers, no tensors), so clone-out and the per-sequence commit launch nothing
and the clone-in gathers once per source buffer; lengths known on the host are decided on the
host (`gpu.cache.RaggedKv.host_lens`, `gpu.xs_rolling.XsRolling.host_tokens`), so the device is
read for what the algorithm produces there (the chain's tokens, once per step). Every sequence's
draft KV is a row of ONE pooled buffer (`gpu.draft_store.DraftStore`); a draft group is a row-index
vector, its alignment the rows' lengths, its chain one batched MTP step per chain step, and the
draft-KV extension of a whole batch one masked scatter (`gpu.draft.extend_draft_kv_rows`).
"""

from __future__ import annotations

import os

import numpy as np
import torch

from raggedspec.gpu import masks as gmasks
from raggedspec.gpu._common import (
    arange_like,
    as_list,
    ints_on,
    neg_inf_where,
    to_device,
    upload_ints,
)
from raggedspec.gpu.attention import dsv4_attention as g_dsv4_attention
from raggedspec.gpu.cache import RaggedKv
from raggedspec.gpu.draft import propose_chain_batched
from raggedspec.gpu.draft_loop import draft_group_loop, extend_draft_kvs
from raggedspec.gpu.draft_store import DraftStore, PoolKv
from raggedspec.gpu.model import Forward as PortForward
from raggedspec.gpu.model import TinyModel as PortModel
from raggedspec.gpu.model import rms_norm, silu
from raggedspec.gpu.plan import upload
from raggedspec.gpu.rope import apply_rope, rotate
from raggedspec.gpu.slots import (
    NORMAL,
    XS,
    RowXs,
    TorchKv,
    grow_physical,
    stack_kv,
    stack_layer,
    xs_rows,
)
from raggedspec.gpu.xs_rolling import XsRolling
from raggedspec.reference import align, dispatch, step
from raggedspec.reference import masks as ref_masks
from raggedspec.reference import model as ref_model
from raggedspec.reference.backend import Backend, CloneIn
from raggedspec.reference.cache import (
    DRAFT_CACHE_CAPACITY,
    PLAIN_CACHE_CAPACITY,
    NormalCache,
    chain_capacity,
)
from raggedspec.reference.draft import PRIME_MISALIGNED
from raggedspec.reference.errors import require

DTYPES = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16}


# --- the backend ----------------------------------------------------------------------------------


class TorchBackend(Backend):
    """`Backend` on the torch port. `device` ("cpu", "cuda", "cuda:1", ...; default the
    `RAGGEDSPEC_DEVICE` environment variable, else "cpu") and `dtype` ("float64", "float32",
    "bfloat16"). ValueError when the device is unavailable (e.g. "cuda" without CUDA) or the
    dtype unknown."""

    name = "torch"

    def __init__(self, device: str | None = None, dtype: str = "float64") -> None:
        device = device or os.environ.get("RAGGEDSPEC_DEVICE", "cpu")
        require(dtype in DTYPES, f"dtype {dtype!r} must be one of {sorted(DTYPES)}")
        try:
            dev = torch.device(device)
        except RuntimeError as exc:
            raise ValueError(f"unknown torch device {device!r}: {exc}") from exc
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device {device!r} requested but CUDA is not available to torch "
                             f"{torch.__version__} on this machine")
        if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"device {device!r}: only {torch.cuda.device_count()} CUDA device(s)")
        self.device, self.dtype = str(dev), dtype
        self.dev, self.tdtype = dev, DTYPES[dtype]

    # ------------------------------------------------------------------ helpers
    def _t(self, a) -> torch.Tensor:
        """A host array (or tensor) as a backend tensor (floats in the backend dtype)."""
        if isinstance(a, torch.Tensor):
            t = a
        else:
            t = torch.from_numpy(np.ascontiguousarray(np.asarray(a)))
        if t.is_floating_point():
            t = t.to(self.tdtype)
        return to_device(t, self.dev)

    def _floats(self, a) -> torch.Tensor:
        """A host array (or tensor) of K or V values as a backend tensor in the backend dtype,
        integers included (the reference holds every slot in float64)."""
        return self._t(a).to(self.tdtype)

    def _ints(self, xs) -> torch.Tensor:
        return ints_on([int(x) for x in xs], self.dev)

    # ------------------------------------------------------------------ construction, read-back
    def build_model(self, cfg):
        return PortModel(ref_model.TinyModel(cfg), self.tdtype, self.dev)

    def new_target_cache(self, cfg, max_seq_len, batch):
        slots = [TorchKv(max_seq_len) for _ in cfg.compress_ratios]
        slots += [XsRolling(r, max_seq_len=max_seq_len, batch=batch, device=self.dev)
                  for r in cfg.compress_ratios if r > 0]
        return NormalCache(slots)

    def new_draft_cache(self, model):
        """A `PoolKv` row of this backend's `DraftStore` for the model's KV heads and width."""
        if model.mtp is None:
            return None
        stores = self.__dict__.setdefault("_draft_stores", {})
        hd = (model.cfg.n_kv_heads, model.cfg.head_dim)
        if hd not in stores:
            stores[hd] = DraftStore(hd[1], self.tdtype, self.dev, hd[0])
        return PoolKv(stores[hd], model.cfg.max_seq_len, DRAFT_CACHE_CAPACITY)

    def upload_plan(self, plan):
        return upload(plan, self.dev)

    def cache_len(self, cache):
        return cache.current_seq_len

    def to_numpy(self, x):
        if isinstance(x, torch.Tensor):
            x = x.detach().cpu()
            if x.is_floating_point():
                x = x.to(torch.float64)
            return x.numpy().copy()
        return np.array(x, copy=True)

    def _front_aligned(self, slot):
        """A K/V slot's front-aligned `(k, v)` for `materialize` (None when unmaterialized):
        what a backend with its own alignment kernel replaces."""
        return slot.front_aligned()

    def _kv_view(self, slot: TorchKv) -> dict:
        fa = self._front_aligned(slot)
        return {
            "k": None if fa is None else self.to_numpy(fa[0]),
            "v": None if fa is None else self.to_numpy(fa[1]),
            "len": slot.current,
            "capacity": slot.capacity,
        }

    def _xs_view(self, slot) -> dict:
        if isinstance(slot, RowXs):
            slot = slot.as_slot()
        return {"tokens": as_list(slot.tokens), "base": as_list(slot.base),
                "comp": [self.to_numpy(slot.row_comp(i)) for i in range(slot.batch)],
                "history": [self.to_numpy(slot.row_history(i)) for i in range(slot.batch)]}

    def materialize(self, obj):
        if isinstance(obj, NormalCache):
            kvs = [self._kv_view(s) for s in obj.slots if s.kind == NORMAL]
            return {"len": obj.current_seq_len, "kv": [(s["k"], s["v"]) for s in kvs],
                    "capacity": [s["capacity"] for s in kvs],
                    "xs": [self._xs_view(s) for s in obj.slots if s.kind == XS]}
        s = self._kv_view(obj)
        return {"len": s["len"], "kv": [(s["k"], s["v"])], "capacity": [s["capacity"]], "xs": []}

    # ------------------------------------------------------------------ target cache rules
    def clone_in(self, caches, pending_leads, xs_per_seq, per_sequence):
        """The reference's clone-in (every check and its order) on the port's slots; the
        batch is assembled by `gpu.slots.stack_layer` (one gather per source buffer, none
        when the handles are one batch's rows in order)."""
        ci = align.clone_in_cache_reporting_lead(
            caches, pending_leads, xs_per_seq, per_sequence, stack_layer
        )
        return CloneIn(ci.batched, [int(x) for x in ci.lead_pad], ci.ragged_decode_supported)

    def clone_out(self, batched, b):
        """`clone_out_cache`: b per-sequence caches of row handles (host integers; no tensor
        op; one read of the rows' tokens and bases per XsRolling slot)."""
        require(b >= 1, f"clone_out_cache needs b >= 1, got {b}")
        rows = [[] for _ in range(b)]
        for layer, slot in enumerate(batched.slots):
            if slot.kind == NORMAL:
                if slot.kv is not None and slot.kv.batch != b:
                    raise ValueError(f"layer {layer} holds {slot.batch} rows, not {b}")
                pieces = (
                    slot.rows()
                    if slot.kv is not None
                    else [slot.rows()[0].clone() for _ in range(b)]
                )
            else:
                if slot.batch != b:
                    raise ValueError(f"xs layer {layer} holds {slot.batch} rows, not {b}")
                pieces = xs_rows(slot)
            for i in range(b):
                rows[i].append(pieces[i])
        return [NormalCache(r) for r in rows]

    def truncate_by(self, cache, n_drop):
        step.truncate_cache_by(cache, n_drop)

    def commit(self, cache, strip_lead, kv_len, xs_len):
        step.commit_row(cache, strip_lead, kv_len, xs_len)

    def xs_append(self, cache, hidden):
        for slot in cache.slots:
            if slot.kind == XS:
                slot.append_rows(hidden)

    # ------------------------------------------------------------------ one K/V slot
    def kv_from_arrays(self, k, v, max_seq_len, capacity=PLAIN_CACHE_CAPACITY):
        slot = TorchKv(max_seq_len, capacity)
        slot.append(self._floats(k), self._floats(v))
        return slot

    def kv_append(self, kv, k, v):
        kv.append(self._floats(k), self._floats(v))

    def kv_set_len(self, kv, n):
        kv.set_len(n)

    def front_align(self, kvs):
        return align.front_align_batch([NormalCache([kv]) for kv in kvs], xs_per_seq=False)

    def strip_dead_prefix(self, kv, lead):
        align.drop_dead_prefix(kv, lead)

    def concat(self, kvs):
        return stack_kv(kvs)

    def split(self, kv, g):
        """`split_draft_cache`: g pieces (the reference's chunk sizes) with the batched
        metadata; None when the piece count is not g."""
        require(g >= 1, f"split_draft_cache needs g >= 1, got {g}")
        if g == 1:
            return [kv.clone()]
        if kv.kv is None:
            return [TorchKv(kv.max_seq_len, kv.capacity, kv.current) for _ in range(g)]
        rows = kv.rows()
        sizes = align._chunk_sizes(len(rows), g)
        if len(sizes) != g:
            return None
        out, start = [], 0
        for n in sizes:
            out.append(stack_kv(rows[start: start + n]))
            start += n
        return out

    def front_align_draft_group(self, kvs, starts):
        """The protocol's op on `TorchKv` slots, for the per-op conformance (the group loop
        aligns pool rows by index instead, `draft_chain`). Each row cloned, cut to its start,
        padded to `T = max(starts)` (an offset) and its capacity narrowed to T; stacked. The
        reference's AlignRefusals, before any work."""
        starts = [int(s) for s in starts]
        target = align.draft_group_target(  # the values of a non-Normal row are never read
            [c.kind for c in kvs], [c.kind != NORMAL or c.kv is not None for c in kvs],
            [c.current if c.kind == NORMAL else 0 for c in kvs], starts)
        rows = []
        for c, s in zip(kvs, starts, strict=False):
            row = c.clone()
            row.set_len(s)
            row.front_pad(target)
            row.capacity = target
            rows.append(row)
        return stack_kv(rows)

    # ------------------------------------------------------------------ masks, positions, attention
    def rope_positions(self, offsets, b, t):
        off = self._ints(offsets)
        require(off.numel() in (1, b), f"{off.numel()} offsets for a batch of {b}")
        pos = (off[:, None] + arange_like(t, off)[None, :]).expand(b, t)
        return self.to_numpy(pos)

    def apply_rope(self, x, offsets, rope_dims, theta, inverse=False):
        return apply_rope(self._t(x), offsets, rope_dims, theta, inverse=inverse)

    def union_mask(self, t_q, t_k_full, row_q0, window, ratio, t_c):
        q0 = t_k_full - t_q
        b = 1 if row_q0 is None else len(row_q0)
        rows = dispatch.resolve_ragged_rows(None if row_q0 is None else as_list(row_q0), q0, b)
        raw_base, keep = ref_masks.raw_keep_span(t_q, window, t_k_full)
        valid = torch.cat([gmasks.raw_validity(t_q, q0, raw_base, keep, window, device=self.dev),
                           gmasks.compressed_validity(t_q, q0, t_c, ratio, device=self.dev)], dim=1)
        if rows is None:
            return neg_inf_where(valid, self.tdtype)[None, None]
        return self._ragged_union_mask(
            self._ints(rows), q0, valid, raw_base, keep, window, ratio, t_c
        )

    def _ragged_union_mask(self, rows, q0, valid, raw_base, keep, window, ratio, t_c):
        """The ragged half of `union_mask` (rows through `resolve_ragged_rows`, the shared
        validity built): what a backend with its own mask kernel replaces."""
        return gmasks.ragged_union_mask(rows, q0, valid, raw_base, keep, ratio, t_c, self.tdtype)

    def dsv4_attention(self, q, k, v, compressed_kv, cfg, sinks=None):
        comp = None if compressed_kv is None else self._t(compressed_kv)
        return g_dsv4_attention(self._t(q), self._t(k), self._t(v), comp, None, cfg,
                                None if sinks is None else self._t(sinks))

    # ------------------------------------------------------------------ model
    def forward(self, model, tokens, cache, offsets, row_q0, lead_pad, capture=None, plan=None):
        """`TinyModel.forward` on the in-place layout. The reference's arguments say which
        front-aligned columns each row treats as dead: for the attention `C - row_q0_i` on
        the ragged path (0 on the scalar path), for the compressed keys `lead_pad_i`. Rows
        whose alignment offset is longer are baked first (their extra dead columns become
        physical zeros), so the port's per-row window is the reference's. Then the port
        model (`gpu.model.TinyModel.forward`, positions = own lengths); when the RoPE
        offsets or the compressed-key start differ from the own lengths (a ragged batch
        decoded without per-row masks), the same layers run with those (`_forward_general`).
        Refusals, before any slot changes and in the reference's order: the tokens' shape and
        vocabulary range, the slot count, the offset and lead counts, a row's layout. With a
        `plan` (`gpu.plan.DevicePlan`) the general path reads its device `offsets` instead of
        uploading them."""
        tokens, offs, offs_np, lead_np = self._check_forward(model, tokens, cache, offsets,
                                                             lead_pad)
        b, t = tokens.shape
        kvs = cache.slots[:model.n_layers]
        for slot in kvs:  # the reference's first append refuses before anything changes
            slot.check_append(t)
        c = cache.current_seq_len
        rows = dispatch.resolve_ragged_rows(row_q0, c, b)
        comp_start = self._prepare_slots(model, kvs, c, rows, lead_np, b, t)
        own = kvs[0].own
        for slot in kvs if plan is not None else ():  # the plan's lengths: no upload
            adopt = getattr(slot.kv, "adopt_device_lens", None)
            if adopt is not None:
                adopt(plan.host.cache_lens, plan.cache_lens)
        dev_tokens = None if plan is None else self._upload_step_ints(model, cache, tokens)
        if self._plain_layout(offs_np, own, comp_start):
            fwd = model.forward(tokens, [s.kv for s in kvs], offs, capture,
                                device_offsets=None if plan is None else plan.offsets,
                                device_tokens=dev_tokens)
        else:
            dev_offs = plan.offsets if plan is not None else self._ints(offs)
            fwd = self._forward_general(model, ints_on(tokens, self.dev) if dev_tokens is None
                                        else dev_tokens, [s.kv for s in kvs], dev_offs,
                                        to_device(torch.from_numpy(comp_start), self.dev))
            if capture is not None:
                capture.store_rows(offs, fwd.hidden.clone())
        for slot in kvs:
            slot.current += t
        return fwd

    def _upload_step_ints(self, model, cache, tokens: np.ndarray) -> torch.Tensor:
        """The verify tokens `[B,T]` on the device, in one transfer with the index vectors of
        every XsRolling slot's coming append (`XsRolling.append_indices`, staged on the slot
        for `xs_append`). Refuses nothing."""
        xs = [s for s in cache.slots if s.kind == XS]
        staged = [(s, s.append_indices(tokens.shape[1])) for s in xs]
        staged = [(s, idx) for s, idx in staged if idx is not None]
        dev_tok, *dev = upload_ints(model.embed, tokens.reshape(-1),
                                    *(v for _, idx in staged for v in idx))
        for k, (slot, idx) in enumerate(staged):
            slot.stage(tokens.shape[1], dev[k * len(idx):(k + 1) * len(idx)])
        return dev_tok.view(tokens.shape)

    def _check_forward(self, model, tokens, cache, offsets, lead_pad):
        """`forward`'s refusals, in the reference's order (tokens, vocabulary, slots, offset
        and lead counts, each row's layout); the tokens and offsets as host arrays."""
        tokens = np.asarray(tokens, dtype=np.int64)
        require(
            tokens.ndim == 2 and tokens.size > 0, f"tokens {tokens.shape} must be [B,T], B, T >= 1"
        )
        vocab = model.cfg.vocab  # refused before anything changes, on every path
        require(tokens.min() >= 0 and tokens.max() < vocab,
                f"tokens must be in [0, {vocab}), got [{tokens.min()}, {tokens.max()}]")
        b, t = tokens.shape
        n = model.n_layers
        require(len(cache.slots) >= n, f"cache has {len(cache.slots)} slots for {n} layers")
        offs = [int(o) for o in offsets]
        require(len(offs) in (1, b), f"{len(offs)} seqlen offsets for a batch of {b}")
        leads = [0] * b if lead_pad is None else [int(x) for x in lead_pad]
        require(len(leads) == b, f"{len(leads)} leads for a batch of {b}")
        c = cache.current_seq_len
        offs_np = np.broadcast_to(np.asarray(offs, dtype=np.int64), (b,))  # host ints, once
        lead_np = np.asarray(leads, dtype=np.int64)
        bad = np.flatnonzero(offs_np != c - lead_np)
        if bad.size:  # one vector comparison of the host integers; the first offending row named
            i = int(bad[0])
            off = offs[i if len(offs) == b else 0]
            require(
                False,
                f"row {i}: seqlen offset {off} disagrees with the layout (cache {c}, lead "
                f"{leads[i]})",
            )
        return tokens, offs, offs_np, lead_np

    def _prepare_slots(self, model, kvs, c, rows, lead_np, b, t) -> np.ndarray:
        """Bake each row's extra attention-dead columns (`C - row_q0_i`), materialize an
        empty cache, grow every slot for t more columns; the compressed keys' start column
        per row (host ints)."""
        attn_dead = (
            np.zeros(b, dtype=np.int64) if rows is None else c - np.asarray(rows, dtype=np.int64)
        )
        first = kvs[0]
        if first.kv is None:
            require(c == 0, f"an unmaterialized cache of length {c} cannot be decoded on")
        else:
            for slot in kvs:
                slot.bake(attn_dead)
        comp_start = lead_np - (first.lead if first.kv is not None else 0)
        if first.kv is None:
            for slot in kvs:
                slot.kv = RaggedKv.empty(
                    b, model.cfg.n_kv_heads, model.cfg.head_dim, slot.max_seq_len, slot.capacity,
                    self.tdtype, self.dev,
                )
                slot.lead = np.zeros(b, dtype=np.int64)
        for slot in kvs:
            slot.grow_meta(t)
            grow_physical(slot.kv, int(slot.own.max()) + t)
        return comp_start

    @staticmethod
    def _plain_layout(offsets: np.ndarray, own: np.ndarray, comp_start: np.ndarray) -> bool:
        """Whether the port model's own forward computes this step: every row's RoPE offset
        is its own length and its compressed keys start at its own first column. Otherwise
        `_forward_general` (the same layers at the given offsets and starts); both give the
        reference's result where this holds, the general one where it does not."""
        return bool((offsets == own).all() and not comp_start.any())

    def _forward_general(self, model, tokens, kvs, offsets, comp_start):
        """The port layers with RoPE at `offsets` (not the own lengths) and each compressed
        layer's keys from physical column `comp_start_i` of its row."""
        x = model.embed[tokens]
        for layer, kv in zip(model.layers, kvs, strict=False):
            if not layer.ratio:
                x = layer.forward(x, kv, offsets=offsets)
            else:
                x = self._compressed_layer(layer, x, kv, offsets, comp_start)
        return PortForward(model.logits(x), x)

    @staticmethod
    def _compressed_layer(layer, x, kv, offs, start):
        """`gpu.model.DecoderLayer.forward` of a compressed layer whose rows' live runs start
        at physical `start_i` (not 0): the compressed keys are rebuilt from
        `[start_i, lens_i)` (un-rotated at positions 0.., averaged per complete block,
        rotated at `j * ratio`, blocks past a row's own count zeroed). A negative `start_i`
        (no `lead_pad` on a batch whose rows have dead prefixes) reads the columns before the
        row's own as zeros, the reference's dead columns."""
        cfg = layer.cfg
        b, t, _ = x.shape
        nh, hd, eps = cfg.n_heads, cfg.head_dim, cfg.eps
        table = layer.ropes.get(layer.theta, int(offs.max()) + t)
        h = rms_norm(x, layer.attn_norm, eps)
        q = rms_norm((h @ layer.wq).reshape(b, t, nh, hd).transpose(1, 2), layer.q_norm, eps)
        q = layer.rope(q, offs, cfg.rope_dims, layer.theta, table=table)
        k = layer.rope(layer.key(x), offs, cfg.rope_dims, layer.theta, table=table)
        kv.append(k, k)
        r = layer.ratio
        live_n = torch.div(kv.lens - start, r, rounding_mode="floor")
        t_c = int(live_n.max()) if live_n.numel() else 0
        comp = None
        if t_c > 0:
            width = t_c * r
            cols = start[:, None] + arange_like(width, kv.k)[None, :]
            idx = cols.clamp(min=0, max=kv.capacity - 1)[:, None, :, None]
            raw = kv.k.gather(2, idx.expand(b, kv.k.shape[1], width, hd))
            raw = torch.where((cols >= 0)[:, None, :, None], raw, raw.new_zeros(()))
            cos, sin = layer.ropes.get(layer.theta, width).lookup(arange_like(width, kv.k))
            raw = rotate(raw, cos, sin, cfg.rope_dims, inverse=True)
            blocks = raw.unflatten(2, (t_c, r)).mean(dim=3)
            cos, sin = layer.ropes.get(cfg.compress_rope_theta, width).lookup(
                arange_like(t_c, kv.k) * r
            )
            blocks = rotate(blocks, cos, sin, cfg.rope_dims)
            live = (arange_like(t_c, kv.k)[None, :] < live_n[:, None])[:, None, :, None]
            comp = torch.where(live, blocks, blocks.new_zeros(()))
        o = layer.attend(q, kv, None, comp, r, cfg.sliding_window, layer.sinks)
        o = layer.rope(o, offs, cfg.rope_dims, layer.theta, inverse=True, table=table)
        x = x + o.transpose(1, 2).reshape(b, t, nh * hd) @ layer.wo
        m = rms_norm(x, layer.mlp_norm, eps)
        return x + silu(m @ layer.w_up) @ layer.w_down

    def mtp_step(self, model, fused, start_pos, kv):
        fused = self._t(fused)
        t = fused.shape[1]
        if isinstance(kv, PoolKv):  # a sequence's draft KV: its pool row
            dispatch.draft_step_end_column(list(start_pos), fused.shape[0], kv.current)
            kv.grow_meta(t)
            kv.store.reserve(kv.current + t)
            kv.materialized = True
            out = model.mtp.forward_tokens_rows(fused, [int(p) for p in start_pos], kv.store.kv,
                                                self._ints([kv.idx]))
            kv.current += t
            return out
        dispatch.draft_step_end_column(list(start_pos), fused.shape[0], kv.current)  # desync first
        kv.check_append(t)
        kv.grow_meta(t)
        grow_physical(kv.kv, int(kv.own.max()) + t)
        out = model.mtp.forward_tokens_rows(fused, [int(p) for p in start_pos], kv.kv)
        kv.current += t
        return out

    def propose_chain(self, model, seed_hidden, last_tokens, n, chain_starts, kv):
        """`propose_chain_batched` on a K/V slot or on a draft KV of this backend (its pool
        row): the reference's n one-column appends checked first (CacheRefusal before
        anything runs), then `gpu.draft.propose_chain_batched`; one read of the chains."""
        seed = self._t(seed_hidden)
        g = seed.shape[0]
        run = model.mtp is not None and kv is not None and n > 0 and g > 0
        if run:
            kv.capacity = chain_capacity(kv.capacity, kv.current, n, kv.max_seq_len)
        if isinstance(kv, PoolKv):
            if run:
                kv.store.reserve(kv.current + n)
                kv.materialized = True
            chains = propose_chain_batched(
                model,
                seed,
                self._ints(last_tokens),
                n,
                [int(s) for s in chain_starts],
                kv.store.kv,
                rows=self._ints([kv.idx] * g),
            )
        else:
            if run:
                grow_physical(kv.kv, int(kv.own.max()) + n)
            chains = propose_chain_batched(
                model,
                seed,
                self._ints(last_tokens),
                n,
                [int(s) for s in chain_starts],
                None if kv is None else kv.kv,
            )
        if run:
            kv.current += n
        return [[int(x) for x in row] for row in chains.tolist()]

    # ------------------------------------------------------------------ draft orchestration
    def draft_chain(
        self, model, groups, states, toks, cache_lens, budgets, w, per_seq_advance, warnings=None
    ):
        return draft_group_loop(
            self, model, groups, states, toks, cache_lens, budgets, w, per_seq_advance, warnings
        )

    def extend_draft_kvs(self, states, capture, toks, batch, model, warnings=None):
        extend_draft_kvs(self, states, capture, toks, batch, model, warnings)

    def prime_draft_kv(self, states, capture, toks, batch, model, warnings=None):
        extend_draft_kvs(self, states, capture, toks, batch, model, warnings, why=PRIME_MISALIGNED)


__all__ = ["DTYPES", "TorchBackend"]
