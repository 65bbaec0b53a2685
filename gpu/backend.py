"""The torch backend: `reference.backend.Backend` on the port (`gpu/`), on any device and in
float64, float32 or bfloat16.

Every tensor-side method runs the port: masks by broadcast (`gpu.masks`), RoPE by gathered
tables (`gpu.rope`), attention in place (`gpu.attention`, `gpu.model.dsv4_attention_rows`),
the model forward and the MTP chain (`gpu.model`, `gpu.draft`), the compressor history
(`gpu.xs_rolling`), length-vector arithmetic (`gpu.dispatch`, `gpu.step`). Nothing falls
back to NumPy: the reference is used only for the model's weights (`build_model` converts
the reference `TinyModel`'s seeded weights once) and for host-side records
(`reference.draft.DraftKv`, `reference.dispatch.MtpHiddenCapture`).

Physical layout (the port's, not the reference's): a K/V slot (`TorchKv`) keeps its rows
**in place**, start-anchored, in one `gpu.cache.RaggedKv` (row i's own tokens at physical
columns `[0, lens_i)`), plus a per-row *alignment offset* `lead_i`. The reference's
front-aligned view of row i is `lead_i` dead (zero) columns, then its own run, so the slot's
shared length is `current = lead_i + lens_i` for every row. Front alignment, the pending
lead of the lazy strip, and the dead-prefix strip change `lead` only (no data motion);
`materialize` builds the reference's front-aligned tensors by one gather, for conformance.
Data moves only where the reference's semantics make dead columns *live* (a forward that
treats a row's dead prefix as keys, or a strip that cuts into a row's own run): the row is
then physically front-padded ("baked") by one gather.

Host metadata: each slot also carries the reference's allocation arithmetic as host
integers (`capacity`: start 512, or 16 for a draft KV; grown by whole 512-column blocks;
refused above `max_seq_len`; `max(capacity, T)` on a front pad; `capacity - lead` after a
strip; the batched value after a split; `T` after a draft-group alignment) and whether the
slot was ever written (`materialized`). Refusals are decided on that metadata, before any
tensor is touched, with the reference's classes and messages; the physical buffers grow on
their own (by 512-column blocks, never refused) and are never narrowed.

Draft KV: every sequence's draft KV is a row of ONE pooled buffer (`DraftStore`, the
`gpu.draft.DraftPool` layout); the simulator's `DraftKvMap` holds a `PoolKv` handle per
sequence (its row index and the reference's metadata as host integers). A draft group is a
row-index vector: alignment, split and dead-prefix strip are host metadata plus one
`index_copy` of the rows' lengths, the chain is one batched MTP step per chain step, and
the extension of a whole batch is one fuse + key projection and one masked scatter
(`gpu.draft.extend_draft_kv_rows`). The capacity arithmetic and refusals stay the
reference's, on the host integers, decided before any tensor changes.

Loops that remain touch per-sequence host records, not tensors on the step's hot path:
the group loop's membership and write-back (flags, seed positions, `filled`, warnings in
row order), the extension's checks 7-13 (host integers), the packing of the simulator's
per-sequence token lists, and the clone-in / clone-out of per-sequence target caches (the
protocol hands the simulator one cache per sequence: `concat_slots`, `chunk_slot`,
`xs_split`, `xs_stack` build or take apart those B objects; each tensor is one `cat` or a
view). Loops over layers (slots) or chain steps are not loops over rows.
"""

from __future__ import annotations

import os

import numpy as np
import torch

from gpu import dispatch as gdispatch
from gpu import masks as gmasks
from gpu._common import as_list, neg_inf_where
from gpu.attention import dsv4_attention as g_dsv4_attention
from gpu.cache import RaggedKv
from gpu.draft import extend_draft_kv_rows, propose_chain_batched
from gpu.model import Forward as PortForward
from gpu.model import TinyModel as PortModel
from gpu.model import rms_norm, silu
from gpu.rope import apply_rope, rotate
from gpu.slots import (NORMAL, XS, DraftStore, KvMeta, PoolKv, RowXs, TorchKv, grow_physical, stack_kv,
                       stack_layer, xs_rows)
from gpu.xs_rolling import XsRolling
from reference import align, dispatch, step
from reference import model as ref_model
from reference.backend import Backend, CloneIn
from reference.cache import DRAFT_CACHE_CAPACITY, PLAIN_CACHE_CAPACITY, NormalCache
from reference.dispatch import chain_start_of
from reference.errors import AlignRefusal, CacheRefusal, Refusal, StepRefusal, require

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
        return t.to(self.dev)

    def _ints(self, xs) -> torch.Tensor:
        return torch.as_tensor([int(x) for x in xs], dtype=torch.int64, device=self.dev)

    # ------------------------------------------------------------------ construction, read-back
    def build_model(self, cfg):
        return PortModel(ref_model.TinyModel(cfg), self.tdtype, self.dev)

    def new_target_cache(self, cfg, max_seq_len, batch):
        slots = [TorchKv(max_seq_len) for _ in cfg.compress_ratios]
        slots += [XsRolling(r, max_seq_len=max_seq_len, batch=batch, device=self.dev)
                  for r in cfg.compress_ratios if r > 0]
        return NormalCache(slots)

    def new_draft_cache(self, model):
        """A `PoolKv` row of this backend's `DraftStore` for the model's head width."""
        if model.mtp is None:
            return None
        stores = self.__dict__.setdefault("_draft_stores", {})
        hd = model.cfg.head_dim
        if hd not in stores:
            stores[hd] = DraftStore(hd, self.tdtype, self.dev)
        return PoolKv(stores[hd], model.cfg.max_seq_len, DRAFT_CACHE_CAPACITY)

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
        return {"k": None if fa is None else self.to_numpy(fa[0]), "v": None if fa is None else self.to_numpy(fa[1]),
                "len": slot.current, "capacity": slot.capacity}

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
        ci = align.clone_in_cache_reporting_lead(caches, pending_leads, xs_per_seq, per_sequence, stack_layer)
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
                pieces = slot.rows() if slot.kv is not None else [slot.rows()[0].clone() for _ in range(b)]
            else:
                if slot.batch != b:
                    raise ValueError(f"xs layer {layer} holds {slot.batch} rows, not {b}")
                pieces = xs_rows(slot)
            for i in range(b):
                rows[i].append(pieces[i])
        return [NormalCache(r) for r in rows]

    def truncate_by(self, cache, n_drop):
        step.truncate_cache_by(cache, n_drop)

    def commit_per_sequence(self, cache, lead, own, committed):
        step.commit_per_sequence(cache, lead, own, committed)

    def set_lens(self, cache, kv_len, xs_len):
        for slot in cache.slots:
            slot.set_len(xs_len if slot.kind == XS else kv_len)

    def xs_append(self, cache, hidden):
        for slot in cache.slots:
            if slot.kind == XS:
                slot.append_rows(hidden)

    # ------------------------------------------------------------------ one K/V slot
    def kv_from_arrays(self, k, v, max_seq_len, capacity=PLAIN_CACHE_CAPACITY):
        slot = TorchKv(max_seq_len, capacity)
        slot.append(self._t(k), self._t(v))
        return slot

    def kv_append(self, kv, k, v):
        kv.append(self._t(k), self._t(v))

    def kv_set_len(self, kv, n):
        kv.set_len(n)

    def kv_len(self, kv):
        return kv.current

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
        require(all(s >= 0 for s in starts), f"chain starts {starts} must be >= 0")
        if len(kvs) != len(starts):
            raise AlignRefusal(f"{len(kvs)} cache(s) for {len(starts)} chain start(s)")
        if not kvs:
            raise AlignRefusal("front_align_draft_group was given no rows (0 caches, 0 chain starts)")
        for r, (c, s) in enumerate(zip(kvs, starts)):
            if c.kind != NORMAL:
                raise AlignRefusal(f"draft row {r} is a {c.kind} slot, not Normal")
            if c.kv is None:
                raise AlignRefusal(f"draft row {r}'s buffer is unmaterialized")
            if s > c.current:
                raise AlignRefusal(f"chain start {s} is past the {c.current} position(s) draft row {r} holds")
        target = max(starts)
        rows = []
        for c, s in zip(kvs, starts):
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
        pos = (off[:, None] + torch.arange(t, device=self.dev)[None, :]).expand(b, t)
        return self.to_numpy(pos)

    def apply_rope(self, x, offsets, rope_dims, theta, inverse=False):
        return apply_rope(self._t(x), offsets, rope_dims, theta, inverse=inverse)

    def union_mask(self, t_q, t_k_full, row_q0, window, ratio, t_c):
        q0 = t_k_full - t_q
        b = 1 if row_q0 is None else len(row_q0)
        rows = gdispatch.resolve_ragged_rows(None if row_q0 is None else self._ints(row_q0), q0, b)
        raw_base, keep = gmasks.raw_keep_span(t_q, window, t_k_full)
        valid = torch.cat([gmasks.raw_validity(t_q, q0, raw_base, keep, window, device=self.dev),
                           gmasks.compressed_validity(t_q, q0, t_c, ratio, device=self.dev)], dim=1)
        if rows is None:
            return neg_inf_where(valid, self.tdtype)[None, None]
        return self._ragged_union_mask(rows.to(self.dev), q0, valid, raw_base, keep, window, ratio, t_c)

    def _ragged_union_mask(self, rows, q0, valid, raw_base, keep, window, ratio, t_c):
        """The ragged half of `union_mask` (rows through `resolve_ragged_rows`, the shared
        validity built): what a backend with its own mask kernel replaces."""
        return gmasks.ragged_union_mask(rows, q0, valid, raw_base, keep, ratio, t_c, self.tdtype)

    def dsv4_attention(self, q, k, v, compressed_kv, cfg, sinks=None):
        comp = None if compressed_kv is None else self._t(compressed_kv)
        return g_dsv4_attention(self._t(q), self._t(k), self._t(v), comp, None, cfg,
                                None if sinks is None else self._t(sinks))

    # ------------------------------------------------------------------ model
    def forward(self, model, tokens, cache, offsets, row_q0, lead_pad, capture=None):
        """`TinyModel.forward` on the in-place layout. The reference's arguments say which
        front-aligned columns each row treats as dead: for the attention `C - row_q0_i` on
        the ragged path (0 on the scalar path), for the compressed keys `lead_pad_i`. Rows
        whose alignment offset is longer are baked first (their extra dead columns become
        physical zeros), so the port's per-row window is the reference's. Then the port
        model (`gpu.model.TinyModel.forward`, positions = own lengths); when the RoPE
        offsets or the compressed-key start differ from the own lengths (a ragged batch
        decoded without per-row masks), the same layers run with those (`_forward_general`)."""
        tokens = np.asarray(tokens, dtype=np.int64)
        require(tokens.ndim == 2 and tokens.size > 0, f"tokens {tokens.shape} must be [B,T], B, T >= 1")
        b, t = tokens.shape
        n = model.n_layers
        require(len(cache.slots) >= n, f"cache has {len(cache.slots)} slots for {n} layers")
        offs = [int(o) for o in offsets]
        require(len(offs) in (1, b), f"{len(offs)} seqlen offsets for a batch of {b}")
        leads = [0] * b if lead_pad is None else [int(x) for x in lead_pad]
        require(len(leads) == b, f"{len(leads)} leads for a batch of {b}")
        c = cache.current_seq_len
        bad = np.flatnonzero(np.broadcast_to(np.asarray(offs, dtype=np.int64), (b,)) != c - np.asarray(leads, np.int64))
        if bad.size:  # one vector comparison of the host integers; the first offending row named
            i = int(bad[0])
            off = offs[i if len(offs) == b else 0]
            require(False, f"row {i}: seqlen offset {off} disagrees with the layout (cache {c}, lead {leads[i]})")
        kvs = cache.slots[:n]
        for slot in kvs:  # the reference's first append refuses before anything changes
            slot.check_append(t)
        rows = dispatch.resolve_ragged_rows(row_q0, c, b)
        attn_dead = np.zeros(b, dtype=np.int64) if rows is None else c - np.asarray(rows, dtype=np.int64)
        first = kvs[0]
        if first.kv is None:
            require(c == 0, f"an unmaterialized cache of length {c} cannot be decoded on")
        else:
            for slot in kvs:
                slot.bake(attn_dead)
        lead_np = np.asarray(leads, dtype=np.int64)
        comp_start = lead_np - (first.lead if first.kv is not None else 0)
        if (comp_start < 0).any():
            raise ValueError(f"compressed keys from leads {leads} inside the dead prefix")
        if first.kv is None:
            for slot in kvs:
                slot.kv = RaggedKv.empty(b, 1, model.cfg.head_dim, slot.max_seq_len, slot.capacity, self.tdtype,
                                         self.dev)
                slot.lead = np.zeros(b, dtype=np.int64)
        for slot in kvs:
            slot.grow_meta(t)
            grow_physical(slot.kv, int(slot.own.max()) + t)
        own = first.own
        toks = torch.as_tensor(tokens, device=self.dev)
        if (np.broadcast_to(np.asarray(offs, dtype=np.int64), (b,)) == own).all() and not comp_start.any():
            fwd = model.forward(toks, [s.kv for s in kvs], offs, capture)
        else:
            fwd = self._forward_general(model, toks, [s.kv for s in kvs], self._ints(offs),
                                        torch.from_numpy(comp_start).to(self.dev))
            if capture is not None:
                capture.store_rows(offs, fwd.hidden.clone())
        for slot in kvs:
            slot.current += t
        return fwd

    def _forward_general(self, model, tokens, kvs, offsets, comp_start):
        """The port layers with RoPE at `offsets` (not the own lengths) and each compressed
        layer's keys from physical column `comp_start_i` of its row."""
        x = model.embed[tokens]
        for layer, kv in zip(model.layers, kvs):
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
        rotated at `j * ratio`, blocks past a row's own count zeroed)."""
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
            dev = kv.k.device
            cols = (start[:, None] + torch.arange(width, device=dev)[None, :]).clamp(max=kv.capacity - 1)
            raw = kv.k.gather(2, cols[:, None, :, None].expand(b, 1, width, hd))
            cos, sin = layer.ropes.get(layer.theta, width).lookup(torch.arange(width, device=dev))
            raw = rotate(raw, cos, sin, cfg.rope_dims, inverse=True)
            blocks = raw.unflatten(2, (t_c, r)).mean(dim=3)
            cos, sin = layer.ropes.get(cfg.compress_rope_theta, width).lookup(torch.arange(t_c, device=dev) * r)
            blocks = rotate(blocks, cos, sin, cfg.rope_dims)
            live = (torch.arange(t_c, device=dev)[None, :] < live_n[:, None])[:, None, :, None]
            comp = torch.where(live, blocks, torch.zeros((), dtype=blocks.dtype, device=dev))
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
            cap = kv.capacity
            for i in range(n):  # chain steps, not rows
                cap = KvMeta(kv.max_seq_len, cap, kv.current + i).check_append(1)
            kv.capacity = cap
        if isinstance(kv, PoolKv):
            if run:
                kv.store.reserve(kv.current + n)
                kv.materialized = True
            chains = propose_chain_batched(model, seed, self._ints(last_tokens), n, [int(s) for s in chain_starts],
                                           kv.store.kv, rows=self._ints([kv.idx] * g))
        else:
            if run:
                grow_physical(kv.kv, int(kv.own.max()) + n)
            chains = propose_chain_batched(model, seed, self._ints(last_tokens), n, [int(s) for s in chain_starts],
                                           None if kv is None else kv.kv)
        if run:
            kv.current += n
        return [[int(x) for x in row] for row in chains.tolist()]

    # ------------------------------------------------------------------ draft orchestration
    def draft_chain(self, model, groups, states, toks, cache_lens, budgets, w, per_seq_advance, warnings=None):
        """`group_drafting_loop` (same membership, warnings, refusals and order) on the pooled
        draft KV: a group is the row-index vector of its members' `PoolKv` rows. The
        reference's batch / front-align / set_len / split / strip become host metadata
        (the same capacity arithmetic and refusals, decided before any tensor changes) plus
        one `index_copy` of the rows' lengths to their chain starts; the chain is one
        `propose_chain_batched` on the pool rows (one batched MTP step per chain step)."""
        b = len(states)
        require(len(toks) == b and len(cache_lens) == b and len(budgets) == b,
                f"states ({b}), toks ({len(toks)}), cache_lens ({len(cache_lens)}) and budgets "
                f"({len(budgets)}) must have one entry per row")
        block = model.mtp
        drafts: list[list[int]] = [[] for _ in range(b)]
        warned_empty = False
        pending = []  # (members, chain tokens on the device) per drafted group
        for (u, _), rows in groups.items():  # groups: at most w of them (one per uncached count)
            n_draft = w - u
            members, seeds, lasts, starts = [], [], [], []
            for i in rows:  # host membership: per-state metadata (flags, seed positions), no tensor
                state = states[i]
                if budgets[i] == 0 or state is None or state.poisoned or state.seed is None:
                    continue
                start = chain_start_of(int(cache_lens[i]), u)
                if state.seed[0] != start or state.filled < start:
                    continue
                members.append(i)
                seeds.append(state.seed[1])
                lasts.append(int(toks[i][-1]))
                starts.append(start)
            if not members:
                if block is not None and not warned_empty:
                    _warn(warnings, f"draft group {(u, _)}: no row can draft (no seed at its chain start)")
                    warned_empty = True
                continue
            seed_hidden = torch.stack(seeds)  # [G, H]: the seeds are per-sequence host records
            g = len(members)
            if block is None:
                chains = self.propose_chain(model, seed_hidden, lasts, n_draft, starts, None)
                for slot, i in enumerate(members):
                    drafts[i] = chains[slot]
                continue
            caches = [states[i].cache for i in members]
            if any(c is None for c in caches):
                _warn(warnings, f"draft group {(u, _)}: a member has no draft KV cache; group skipped")
                continue
            require(all(isinstance(c, PoolKv) and c.store is caches[0].store for c in caches),
                    "draft KV caches must be rows of one DraftStore (the backend's new_draft_cache)")
            leads = dispatch.resolve_draft_leads(per_seq_advance, starts)
            aligned = leads is not None
            leads = leads if aligned else [0] * g
            plan = self._draft_group_plan(caches, starts, aligned, n_draft, (u, _), warnings)
            if plan is None:
                continue
            entry, cap = plan
            store = caches[0].store
            idx = np.fromiter((c.idx for c in caches), np.int64, g)
            store.reserve(max(max(starts), entry) + n_draft)
            before = store.kv.host_lens()
            # the alignment is lengths only: each row its own start (ragged), or the batched
            # set_len(starts[0]) (uniform path; ragged starts there refuse "desync" in the chain)
            aligned_lens = before.copy()
            aligned_lens[idx] = starts if aligned else entry
            store.kv.lens = aligned_lens
            try:
                chains = propose_chain_batched(model, seed_hidden, lasts, n_draft, starts, store.kv, rows=idx)
            except Refusal:
                store.kv.lens = before  # the reference refused on a batched copy: the rows are untouched
                raise
            for slot, i in enumerate(members):  # host write-back: per-state metadata, no tensor
                c = caches[slot]
                c.materialized = True
                c.capacity = cap - leads[slot]      # split (batched metadata) + strip of the row's lead
                c.current = starts[slot] + n_draft  # == store.kv.lens[c.idx]
                states[i].filled = starts[slot] + 1
            pending.append((members, chains))
        if pending:  # every group's chain tokens in one device read
            flat = torch.cat([c.reshape(-1) for _, c in pending]).tolist()
            at = 0
            for members, c in pending:
                n = c.shape[1]
                for i in members:
                    drafts[i] = flat[at: at + n]
                    at += n
        return drafts

    @staticmethod
    def _draft_group_plan(caches, starts, aligned, n, key, warnings):
        """The reference's group alignment on host metadata: the batched slot's length on
        entry to the chain and its capacity after it, or None (warned) when the reference
        skips the group. Uniform (no leads): `batch_draft_caches` (one member always; more
        need equal (length, capacity) and materialized buffers) then `set_len(starts[0])`.
        Ragged: `front_align_draft_group`'s AlignRefusals, length and capacity `T =
        max(starts)`. Then the chain's n one-column appends (`check_append`, CacheRefusal
        propagates, as the reference's `propose_chain`)."""
        if not aligned:
            first = caches[0]
            if len(caches) > 1 and any(not c.materialized or (c.current, c.capacity) != (first.current, first.capacity)
                                       for c in caches):
                _warn(warnings, f"draft group {key}: draft caches cannot be batched; group skipped")
                return None
            if starts[0] > first.capacity:
                _warn(warnings, f"draft group {key}: set_len({starts[0]}) refused (set_len({starts[0]}) exceeds "
                                f"current capacity {first.capacity} (first cached 0)); group skipped")
                return None
            entry, cap = starts[0], first.capacity
        else:
            refusal = None
            for r, (c, s) in enumerate(zip(caches, starts)):  # first refusing row, host integers
                if not c.materialized:
                    refusal = f"draft row {r}'s buffer is unmaterialized"
                elif s > c.current:
                    refusal = f"chain start {s} is past the {c.current} position(s) draft row {r} holds"
                if refusal is not None:
                    _warn(warnings, f"draft group {key}: front-alignment refused ({refusal}); group skipped")
                    return None
            entry = cap = max(starts)
        for i in range(n):  # the reference's n one-column appends (chain steps, not rows)
            cap = TorchKv(caches[0].max_seq_len, cap, entry + i).check_append(1)
        return entry, cap

    def extend_draft_kvs(self, states, capture, toks, batch, model, warnings=None,
                         why="capture misaligned with the draft KV"):
        """`extend_draft_kv_row` for every row: checks 1-13 and the metadata (capacity,
        refusals, filled, poisoning, warnings in row order) on host integers, then the
        tensor side for the whole batch at once: one gather of the new seeds, one
        `index_copy` of the truncated lengths, and one `gpu.draft.extend_draft_kv_rows`
        (one fuse + key projection, one masked scatter into the pool rows; the MTP layer's
        K is token-local, so the reference's discarded attention output is not computed)."""
        block = None if capture is None else model.mtp
        hidden = offsets = None
        batch_fail = None  # a capture-wide outcome: an exception (every row poisoned) or False
        if block is not None:
            offsets, hidden = capture
            hidden = self._t(hidden)
            if hidden.dim() == 2:
                hidden = hidden[None]
            if hidden.dim() != 3:
                batch_fail = StepRefusal(f"captured hidden has rank {hidden.dim()} (shape {list(hidden.shape)}); "
                                         f"expected [B,T,H] or [T,H]")
            elif hidden.shape[0] != batch or not offsets.describes(batch):
                batch_fail = False
        seed_rows, seed_cols, seed_states = [], [], []
        trunc_idx, trunc_len = [], []
        w_rows, w_idx, w_off, w_lo, w_hi = [], [], [], [], []
        store = None
        for row in range(batch):  # host: per-state integer checks and metadata, no tensor touched
            state = states[row]
            if state is None:
                continue
            ok, err = True, None
            if state.poisoned:
                ok = False
            elif block is None:
                ok = True
            elif isinstance(batch_fail, Exception):
                err = batch_fail
            else:
                if batch_fail is False:
                    ok = False
                else:
                    try:
                        ok = self._extend_plan(state, offsets, toks[row], row, hidden.shape[1], seed_rows, seed_cols,
                                               seed_states, trunc_idx, trunc_len, w_rows, w_idx, w_off, w_lo, w_hi)
                    except Refusal as exc:
                        err = exc
                    if isinstance(state.cache, PoolKv):
                        store = state.cache.store
            if err is not None:
                state.poisoned = True
                _warn(warnings, f"row {row}: draft KV extension failed ({err}); draft KV poisoned")
            elif not ok:
                state.poisoned = True
                _warn(warnings, f"row {row}: {why}; draft KV poisoned")
        if seed_rows:  # the new seeds: one gather
            got = hidden[self._ints(seed_rows), self._ints(seed_cols)]
            for j, (state, p) in enumerate(seed_states):  # host records: views of the one gather
                state.seed = (p, got[j])
        if trunc_idx:  # the reference's set_len(filled): lengths only
            held = store.kv.host_lens().copy()
            held[np.asarray(trunc_idx, dtype=np.int64)] = trunc_len
            store.kv.lens = held
        if w_rows:
            store.reserve(max(w_hi))
            width = max(w_hi) + 1
            tok = np.zeros((len(w_rows), width), dtype=np.int64)
            for r, (row, lo, hi) in enumerate(zip(w_rows, w_lo, w_hi)):  # host packing of the token lists
                tok[r, lo + 1: hi + 1] = toks[row][lo + 1: hi + 1]
            rows_t = self._ints(w_rows)
            extend_draft_kv_rows(block, store.kv, hidden[rows_t], w_off, w_lo, w_hi, tok, rows=w_idx)

    @staticmethod
    def _extend_plan(state, offsets, toks, row, t, seed_rows, seed_cols, seed_states, trunc_idx, trunc_len,
                     w_rows, w_idx, w_off, w_lo, w_hi) -> bool:
        """`extend_draft_kv_row`'s checks 7-13 for one row on host integers: False where the
        reference returns False; a CacheRefusal as the reference's; otherwise the row's
        metadata updated and its tensor work queued (seed, truncation, write)."""
        off = offsets.row(row)
        if off is None or off > state.filled:
            return False
        big_l = len(toks)
        if big_l >= 2:
            p = big_l - 2
            if off <= p < off + t:
                seed_rows.append(row)
                seed_cols.append(p - off)
                seed_states.append((state, p))
        lo = max(state.filled, off)
        hi = min(off + t, max(big_l - 1, 0))
        if hi <= lo:
            return True
        cache = state.cache
        if cache is None:
            state.filled = hi
            return True
        try:
            cache.try_set_len(state.filled)
        except Refusal as exc:
            raise CacheRefusal(f"MTP draft KV truncate to {state.filled} failed: {exc}") from exc
        cache.current = state.filled  # lo == filled == current: forward_tokens' desync check holds
        if cache.materialized:
            trunc_idx.append(cache.idx)
            trunc_len.append(state.filled)
        cache.check_append(hi - lo)
        cache.materialized = True
        cache.grow_meta(hi - lo)
        cache.current = hi
        state.filled = hi
        w_rows.append(row)
        w_idx.append(cache.idx)
        w_off.append(off)
        w_lo.append(lo)
        w_hi.append(hi)
        return True

    def prime_draft_kv(self, states, capture, toks, batch, model, warnings=None):
        self.extend_draft_kvs(states, capture, toks, batch, model, warnings,
                              why="prefix-cache hit / chunked prefill: the prompt capture does not start at the "
                                  "draft KV's end")

    # ------------------------------------------------------------------ length vectors
    # Host integers in, host integers out: the reference's rule functions themselves (the
    # lengths are host integers once per step; `gpu.step` / `gpu.dispatch` hold the same
    # rules on device vectors, for a kernel that consumes them there).
    def resolve_row_cache_lens(self, enabled, cache_len, lead_pad):
        return dispatch.resolve_row_cache_lens(enabled, cache_len, lead_pad)

    def ragged_row_q0(self, offsets, per_seq_kv):
        return dispatch.ragged_row_q0(offsets, per_seq_kv)

    def plan_step_window(self, cache_lens, tok_lens, w):
        sw = step.plan_step_window(cache_lens, tok_lens, w)
        return list(sw.uncached), sw.ok

    def token_budget(self, max_seq_len, tok_lens):
        return [step.token_budget(max_seq_len, n) for n in tok_lens]

    def draft_groups(self, uncached, cache_lens, may_draft, w, per_seq_advance):
        return dispatch.draft_groups(uncached, cache_lens, may_draft, w, per_seq_advance)

    def draft_group_keys(self, uncached, cache_lens, carries_per_row):
        return [dispatch.draft_group_key(u, c, carries_per_row) for u, c in zip(uncached, cache_lens)]

    def chain_starts(self, cache_lens, uncached):
        return [dispatch.chain_start_of(c, u) for c, u in zip(cache_lens, uncached)]

    def verify_accept(self, proposed, targets):
        return [len(step.verify_proposed(p, t).accepted) for p, t in zip(proposed, targets)]

    def budget_clamp(self, accepted, budgets):
        return [step.budget_clamp(a, b) for a, b in zip(accepted, budgets)]

    def plan_batch_step(self, uncached, accepted, w):
        plan = step.plan_batch_step(uncached, accepted, w)
        return plan.keep, plan.n_drop, list(plan.next_uncached)

    def plan_per_sequence_step(self, uncached, accepted, w):
        plan = step.plan_per_sequence_step(uncached, accepted, w)
        return list(plan.committed), list(plan.dropped), list(plan.next_uncached)


def _warn(warnings, text: str) -> None:
    if warnings is not None:
        warnings.append(text)


__all__ = ["TorchBackend", "DTYPES"]
