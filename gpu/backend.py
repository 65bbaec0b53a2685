"""The torch backend: `raggedspec.reference.backend.Backend` on the port (`gpu/`), on any device and in
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

import itertools
import os
import weakref

import numpy as np
import torch

from raggedspec.gpu import dispatch as gdispatch
from raggedspec.gpu import masks as gmasks
from raggedspec.gpu import step as gstep
from raggedspec.gpu._common import as_list, neg_inf_where
from raggedspec.gpu.align import materialize_front_aligned
from raggedspec.gpu.attention import dsv4_attention as g_dsv4_attention
from raggedspec.gpu.cache import RaggedKv, chunk_sizes
from raggedspec.gpu.draft import extend_draft_kv_rows, propose_chain_batched
from raggedspec.gpu.model import Forward as PortForward
from raggedspec.gpu.model import TinyModel as PortModel
from raggedspec.gpu.model import rms_norm, silu
from raggedspec.gpu.rope import apply_rope, rotate
from raggedspec.gpu.xs_rolling import XsRolling
from raggedspec.reference import model as ref_model
from raggedspec.reference.backend import Backend, CloneIn
from raggedspec.reference.dispatch import chain_start_of
from raggedspec.reference.cache import CACHE_GROW_SIZE, DRAFT_CACHE_CAPACITY, PLAIN_CACHE_CAPACITY
from raggedspec.reference.errors import AlignRefusal, CacheRefusal, Refusal, StepRefusal, require

NORMAL, XS = "Normal", "XsRolling"
DTYPES = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16}


def _grow_physical(kv: RaggedKv, needed: int) -> None:
    """Make the physical buffer hold `needed` columns (whole 512-column blocks; never
    refused: refusals are the metadata's)."""
    if needed > kv.capacity:
        pad = -(-(needed - kv.capacity) // CACHE_GROW_SIZE) * CACHE_GROW_SIZE
        kv.k = torch.nn.functional.pad(kv.k, (0, 0, 0, pad))
        kv.v = torch.nn.functional.pad(kv.v, (0, 0, 0, pad))


def _shift_rows(kv: RaggedKv, shift: torch.Tensor) -> RaggedKv:
    """Row i's physical columns moved by `shift_i` (> 0: right, zeros in front; < 0: left,
    the first `-shift_i` columns dropped); lengths `lens + shift`. One gather per buffer."""
    width = max(kv.capacity, int((kv.lens + shift).max()) if kv.batch else 0)
    _grow_physical(kv, width)
    width = kv.capacity
    src = torch.arange(width, device=kv.k.device)[None, :] - shift[:, None]       # [B, W]
    live = (src >= 0) & (src < kv.lens[:, None])
    cols = src.clamp(min=0, max=max(width - 1, 0))
    b, h, _, d = kv.k.shape
    zero = torch.zeros((), dtype=kv.k.dtype, device=kv.k.device)
    k = torch.where(live[:, None, :, None], kv.k.gather(2, cols[:, None, :, None].expand(b, h, width, d)), zero)
    dv = kv.v.shape[3]
    v = torch.where(live[:, None, :, None], kv.v.gather(2, cols[:, None, :, None].expand(b, h, width, dv)), zero)
    return RaggedKv(k, v, kv.lens + shift, kv.max_seq_len)


class TorchKv:
    """One K/V slot on the port (module docstring): `kv` (physical rows in place; None until
    the first append, like the reference's unmaterialized buffer), `lead` (int64 `[B]`
    alignment offsets), and the reference's metadata `current`, `capacity`, `max_seq_len`.
    Invariant: `lead_i + kv.lens_i == current` for every row of a materialized slot."""

    kind = NORMAL

    def __init__(self, max_seq_len: int, capacity: int = PLAIN_CACHE_CAPACITY, current: int = 0,
                 kv: RaggedKv | None = None, lead: torch.Tensor | None = None) -> None:
        self.max_seq_len, self.capacity, self.current = int(max_seq_len), int(capacity), int(current)
        self.kv = kv
        self.lead = lead

    # --- reading -----------------------------------------------------------------------------
    @property
    def materialized(self) -> bool:
        return self.kv is not None

    @property
    def current_seq_len(self) -> int:
        return self.current

    @property
    def capacity_seq_len(self) -> int:
        return self.capacity

    @property
    def batch(self) -> int:
        return 0 if self.kv is None else self.kv.batch

    def supports_per_sequence_len(self, xs_per_seq: bool = False) -> bool:
        return True

    def clone(self) -> "TorchKv":
        return TorchKv(self.max_seq_len, self.capacity, self.current,
                       None if self.kv is None else self.kv.clone(), None if self.lead is None else self.lead.clone())

    def front_aligned(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The reference's `current_data()` of K and V `[B, H, current, D]`: one gather."""
        if self.kv is None:
            return None
        return materialize_front_aligned(RaggedKv(self.kv.k, self.kv.v, self.kv.lens, self.kv.max_seq_len),
                                         self.current)

    # --- the reference's rules on this layout --------------------------------------------------
    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """`SingleCache.append` of both halves: growth by whole 512 blocks from the shared
        length, CacheRefusal "kv-cache capacity {grown} would be above max_seq_len {max}"
        before anything changes; every row's new columns land at its own offset."""
        s = k.shape[2]
        self.check_append(s)
        if self.kv is None:
            b, h, _, d = k.shape
            self.kv = RaggedKv.empty(b, h, d, self.max_seq_len, max(self.capacity, s, 1), k.dtype, k.device, v.shape[3])
            self.lead = torch.zeros(b, dtype=torch.int64, device=k.device)
        self.grow_meta(s)
        _grow_physical(self.kv, int(self.kv.lens.max()) + s if self.kv.batch else s)
        self.kv.append(k.to(self.kv.k.dtype), v.to(self.kv.v.dtype))
        self.current += s

    def check_append(self, s: int) -> int:
        """The capacity `s` more columns need (the reference's growth rule), refused above
        `max_seq_len`; nothing changes."""
        if self.current + s <= self.capacity:
            return self.capacity
        grown = self.capacity + -(-(self.current + s - self.capacity) // CACHE_GROW_SIZE) * CACHE_GROW_SIZE
        if grown > self.max_seq_len:
            raise CacheRefusal(f"kv-cache capacity {grown} would be above max_seq_len {self.max_seq_len}")
        return grown

    def grow_meta(self, s: int) -> None:
        self.capacity = self.check_append(s)

    def try_set_len(self, n: int) -> None:
        require(n >= 0, f"set_len length {n} must be >= 0")
        if n > self.capacity:
            raise CacheRefusal(f"set_len({n}) exceeds current capacity {self.capacity} (first cached 0)")

    def set_len(self, n: int) -> None:
        """`KvCache.set_len`: refused past the capacity; row i keeps `min(lead_i, n)` dead
        columns and `n - lead_i` of its own (no data moves)."""
        self.try_set_len(n)
        if self.kv is not None:
            lead = self.lead.clamp(max=n)
            _grow_physical(self.kv, int((n - lead).max()) if self.kv.batch else 0)
            self.kv.set_len(n - lead)
            self.lead = lead
        self.current = n

    def pad_refusal(self, target: int) -> CacheRefusal | None:
        live = self.current
        if target < live:
            return CacheRefusal(f"front_pad to {target} is shorter than the {live} live positions")
        if target == live:
            return None
        if self.kv is None:
            return CacheRefusal(f"front_pad to {target}: the slot's buffer is unmaterialized ({live} live positions)")
        cap = max(self.capacity, target)
        if cap > self.max_seq_len:
            return CacheRefusal(f"front_pad to {target}: capacity {cap} would be above max_seq_len {self.max_seq_len}")
        return None

    def front_pad(self, target: int) -> int:
        """`front_pad_single` of both halves: the lead grows by `target - current` (an
        offset, no data motion); capacity `max(capacity, target)`. Refusals as the reference."""
        refusal = self.pad_refusal(target)
        if refusal is not None:
            raise refusal
        lead = target - self.current
        if lead == 0:
            return 0
        self.lead = self.lead + lead
        self.capacity = max(self.capacity, target)
        self.current = target
        return lead

    def drop_refusal(self, lead: int) -> CacheRefusal | None:
        if lead == 0:
            return None
        if lead > self.current:
            return CacheRefusal(f"cannot drop a {lead}-column dead prefix from a slot that holds only {self.current}")
        if self.kv is None:
            return CacheRefusal(f"cannot drop a {lead}-column dead prefix from an unmaterialized slot "
                                f"({self.current} positions)")
        return None

    def drop_front(self, lead: int) -> None:
        """`drop_front_single` of both halves: `lead` front-aligned columns removed. Within a
        row's alignment offset only the offset shrinks; a row whose own run is cut is moved
        left by one gather. Capacity `capacity - lead`."""
        refusal = self.drop_refusal(lead)
        if refusal is not None:
            raise refusal
        if lead == 0:
            return
        cut = (lead - self.lead).clamp(min=0)
        if bool((cut > 0).any()):
            self.kv = _shift_rows(self.kv, -cut)
        self.lead = (self.lead - lead).clamp(min=0)
        self.capacity -= lead
        self.current -= lead

    def bake(self, dead: torch.Tensor) -> None:
        """Make every row's alignment offset `dead_i <= lead_i`: the `lead_i - dead_i` front
        columns become physical zeros (one gather; the reference's view is unchanged)."""
        extra = self.lead - dead
        require(not bool((extra < 0).any()), f"rows would need dead prefixes {as_list(dead)} longer than their "
                                             f"alignment offsets {as_list(self.lead)}")
        if bool((extra > 0).any()):
            self.kv = _shift_rows(self.kv, extra)
            self.lead = dead.clone()


concat_stats = {"view": 0, "copy": 0}


def _row_view(bufs: list[torch.Tensor]) -> torch.Tensor | None:
    """The rows `bufs` hold, as one tensor over the same memory, when they lie back to back in
    one storage with one geometry (what `chunk_slot` handed out at the last clone-out,
    untouched since); else None. Then stacking them moves no data: the result covers exactly
    their rows, in order."""
    first = bufs[0]
    storage = first.untyped_storage().data_ptr()
    offset = first.storage_offset()
    for t in bufs:
        if (t.untyped_storage().data_ptr() != storage or t.stride() != first.stride()
                or t.shape[1:] != first.shape[1:] or t.storage_offset() != offset):
            return None
        offset += t.shape[0] * t.stride(0)
    rows = sum(t.shape[0] for t in bufs)
    return first.as_strided((rows, *first.shape[1:]), first.stride(), first.storage_offset())


def concat_slots(parts: list[TorchKv]) -> TorchKv:
    """`concat_kv`: rows stacked on dim 0 (the physical buffers padded to the widest), the
    capacity of the widest, the length of the first (every part must share it here: the
    port has no view of a row past its own length). ValueError on mixed materialization.
    When the parts are the untouched consecutive row views of one buffer (the usual case at
    a clone-in: the last clone-out's pieces, strips and truncations being metadata only in
    this layout), the result is a view of that buffer and no K/V moves (`concat_stats`
    counts both paths)."""
    require(len(parts) > 0, "concat_kv needs at least one slot")
    first = parts[0]
    cap = max(p.capacity for p in parts)
    mat = [p.kv is not None for p in parts]
    require(all(mat) or not any(mat), "cannot concatenate materialized and unmaterialized slots")
    if not any(mat):
        return TorchKv(first.max_seq_len, cap, first.current)
    require(all(p.current == first.current for p in parts),
            f"the port concatenates slots of one length only, got {[p.current for p in parts]}")
    k_view, v_view = _row_view([p.kv.k for p in parts]), _row_view([p.kv.v for p in parts])
    if k_view is not None and v_view is not None:
        concat_stats["view"] += 1
        kv = RaggedKv(k_view, v_view, torch.cat([p.kv.lens for p in parts]), first.max_seq_len)
        return TorchKv(first.max_seq_len, cap, first.current, kv, torch.cat([p.lead for p in parts]))
    concat_stats["copy"] += 1
    width = max(p.kv.capacity for p in parts)
    ks, vs = [], []
    for p in parts:  # clone-in of per-sequence caches (one object each); a pad only where widths differ
        pad = width - p.kv.capacity
        ks.append(p.kv.k if pad == 0 else torch.nn.functional.pad(p.kv.k, (0, 0, 0, pad)))
        vs.append(p.kv.v if pad == 0 else torch.nn.functional.pad(p.kv.v, (0, 0, 0, pad)))
    kv = RaggedKv(torch.cat(ks), torch.cat(vs), torch.cat([p.kv.lens for p in parts]), first.max_seq_len)
    return TorchKv(first.max_seq_len, cap, first.current, kv, torch.cat([p.lead for p in parts]))


def chunk_slot(slot: TorchKv, g: int) -> list[TorchKv] | None:
    """`_chunk_single` of both halves: g pieces (candle chunk sizes; row views), each with the
    batched metadata; None when the piece count is not g; g metadata-only copies when
    unmaterialized."""
    if slot.kv is None:
        return [TorchKv(slot.max_seq_len, slot.capacity, slot.current) for _ in range(g)]
    sizes = chunk_sizes(slot.kv.batch, g)
    if len(sizes) != g:
        return None
    out, start = [], 0
    for s in sizes:  # clone-out: one view per piece (the protocol returns one cache per sequence)
        kv = RaggedKv(slot.kv.k[start: start + s], slot.kv.v[start: start + s], slot.kv.lens[start: start + s],
                      slot.kv.max_seq_len)
        out.append(TorchKv(slot.max_seq_len, slot.capacity, slot.current, kv, slot.lead[start: start + s]))
        start += s
    return out


# --- the pooled draft KV (one buffer for every sequence's draft KV) ------------------------------


class DraftStore:
    """The draft KV of every sequence of one backend (per MTP head width) in ONE physical
    `RaggedKv` `[S, 1, width, head_dim]` (J1's `gpu.draft.DraftPool` layout): row s is a
    sequence's draft KV, start-anchored (its position p at column p, `kv.lens[s]` its held
    length). A draft group is an int64 row-index vector into it, so the group loop
    aligns, drafts, splits and strips without copying KV, and the draft-KV extension of a
    whole batch is one masked scatter (`gpu.draft.extend_draft_kv_rows`). Rows are
    allocated by `alloc` (zeroed; the row count doubles when full, an allocation, not a
    step) and returned by the handle's finalizer. The physical width grows by whole
    512-column blocks and is never refused (refusals are the handles' host metadata)."""

    def __init__(self, head_dim: int, dtype: torch.dtype, device: torch.device) -> None:
        self.kv = RaggedKv.empty(0, 1, head_dim, 1 << 62, DRAFT_CACHE_CAPACITY, dtype, device)
        self.free: list[int] = []

    def alloc(self) -> int:
        if not self.free:
            s = self.kv.batch
            grow = max(s, 8)
            pad = (0, 0, 0, 0, 0, 0, 0, grow)
            self.kv.k = torch.nn.functional.pad(self.kv.k, pad)
            self.kv.v = torch.nn.functional.pad(self.kv.v, pad)
            self.kv.lens = torch.nn.functional.pad(self.kv.lens, (0, grow))
            self.free = list(range(s + grow - 1, s - 1, -1))
        idx = self.free.pop()
        self.kv.k[idx].zero_()
        self.kv.v[idx].zero_()
        self.kv.lens[idx] = 0
        return idx

    def release(self, idx: int) -> None:
        self.free.append(idx)

    def reserve(self, width: int) -> None:
        """Make every row hold `width` physical columns (never refused)."""
        _grow_physical(self.kv, width)


class PoolKv:
    """One sequence's draft KV: row `idx` of a `DraftStore`, with the reference's metadata as
    host integers (`current` = the held length = `store.kv.lens[idx]` once materialized,
    `capacity` (starts at 16, the reference's arithmetic), `max_seq_len`, `materialized`).
    Invariant: no alignment offset (a draft row is always start-anchored: the reference's
    group alignment is undone by its dead-prefix strip within the same group loop)."""

    kind = NORMAL

    def __init__(self, store: DraftStore, max_seq_len: int, capacity: int = DRAFT_CACHE_CAPACITY) -> None:
        self.store, self.idx = store, store.alloc()
        self.max_seq_len, self.capacity, self.current = int(max_seq_len), int(capacity), 0
        self.materialized = False
        weakref.finalize(self, store.release, self.idx)

    current_seq_len = TorchKv.current_seq_len
    capacity_seq_len = TorchKv.capacity_seq_len
    check_append = TorchKv.check_append
    grow_meta = TorchKv.grow_meta
    try_set_len = TorchKv.try_set_len

    def supports_per_sequence_len(self, xs_per_seq: bool = False) -> bool:
        return True

    def set_len(self, n: int) -> None:
        """`KvCache.set_len`: refused past the capacity; the row's length only."""
        self.try_set_len(n)
        if self.materialized:
            self.store.reserve(n)
            self.store.kv.lens[self.idx] = n
        self.current = n

    def front_aligned(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The reference's `current_data()` `[1, 1, current, D]` (views of the pool row)."""
        if not self.materialized:
            return None
        kv = self.store.kv
        return kv.k[self.idx: self.idx + 1, :, : self.current], kv.v[self.idx: self.idx + 1, :, : self.current]


# --- XsRolling batch assembly (the port's ring layout is row-local) ------------------------------


def xs_split(slot: XsRolling) -> list[XsRolling]:
    """`XsRolling.split_rows`: B one-row slots with their own tokens, base, ring and comp
    (copies, as the reference's: the batched slot may be appended again while its rows live
    on as per-sequence slots)."""
    out = []
    for i in range(slot.batch):  # clone-out: the protocol returns one slot object per sequence
        row = XsRolling(slot.ratio, slot.span, slot.window, slot.max_seq_len, 1, slot.dim, slot.margin, slot.device)
        row.tokens, row.base = slot.tokens[i: i + 1].clone(), slot.base[i: i + 1].clone()
        if slot.ring is not None:
            row.ring, row.comp = slot.ring[i: i + 1].clone(), slot.comp[i: i + 1].clone()
        out.append(row)
    return out


def xs_stack(rows: list[XsRolling], reconcile_bases: bool = False) -> XsRolling:
    """`XsRolling.stack`: rows stacked with their own tokens and base, comp zero-padded to the
    widest; `reconcile_bases` gives every row the largest base (needs uniform tokens). Same
    ValueErrors as the reference."""
    require(len(rows) > 0, "stack needs at least one xs slot")
    first = rows[0]
    for r in rows:
        require((r.ratio, r.span, r.window, r.margin) == (first.ratio, first.span, first.window, first.margin),
                "xs slots in one layer must share ratio, span, window and margin")
    out = XsRolling(first.ratio, first.span, first.window, first.max_seq_len, 0, first.dim, first.margin, first.device)
    out.tokens = torch.cat([r.tokens for r in rows])
    out.base = torch.cat([r.base for r in rows])
    dims = {r.ring.shape[2] for r in rows if r.ring is not None}
    require(len(dims) <= 1, f"xs slots with hidden widths {sorted(dims)} cannot be stacked")
    if dims:
        d = dims.pop()
        like = next(r.ring for r in rows if r.ring is not None)
        g = max(r.comp.shape[1] for r in rows if r.comp is not None)
        rings, comps = [], []
        for r in rows:  # clone-in: per-sequence slot objects into one cat
            rings.append(r.ring if r.ring is not None else like.new_zeros((r.batch, r.window, d)))
            comp = r.comp if r.comp is not None else like.new_zeros((r.batch, 0, d))
            comps.append(torch.nn.functional.pad(comp, (0, 0, 0, g - comp.shape[1])))
        out.dim, out.ring, out.comp = d, torch.cat(rings), torch.cat(comps)
    if reconcile_bases and out.batch:
        require(bool((out.tokens == out.tokens[0]).all()),
                f"reconciling xs bases needs uniform tokens, got {as_list(out.tokens)}")
        out.base = torch.full_like(out.base, int(out.base.max()))
    return out


class TorchCache:
    """The port's target cache: `slots` (a `TorchKv` per target layer, then a
    `gpu.xs_rolling.XsRolling` per compressed layer); `current_seq_len` is layer 0's."""

    paged = False

    def __init__(self, slots: list) -> None:
        self.slots = slots

    @property
    def current_seq_len(self) -> int:
        return self.slots[0].current_seq_len if self.slots else 0


# --- the reference's host bookkeeping over slot kinds, on port slots ----------------------------


def _slot_pad_refusal(slot, target: int, xs_per_seq: bool) -> CacheRefusal | None:
    if slot.kind == XS:
        if not xs_per_seq:
            return CacheRefusal(f"front_pad to {target}: an XsRolling slot cannot be front-padded while "
                                f"ARC_V4_XS_PER_SEQ is off (xs_per_seq={xs_per_seq})")
        return None
    return slot.pad_refusal(target)


def _dead_prefix_refusal(slot, lead: int) -> CacheRefusal | None:
    if slot.kind == XS or lead == 0:
        return None
    return slot.drop_refusal(lead)


def drop_dead_prefix(slot, lead: int) -> None:
    """`drop_dead_prefix`: XsRolling or lead 0 a no-op; a K/V slot `drop_front`."""
    require(lead >= 0, f"dead-prefix lead {lead} must be >= 0")
    refusal = _dead_prefix_refusal(slot, lead)
    if refusal is not None:
        raise refusal
    if slot.kind != XS and lead:
        slot.drop_front(lead)


def front_align_batch(caches: list[TorchCache], xs_per_seq: bool) -> list[int]:
    """`front_align_batch`: T over every slot (XsRolling included), checked for every slot
    before any changes ("sequence {i} slot {layer}: ..."), then every K/V slot padded (an
    offset); lead of the last K/V slot."""
    target = max((s.current_seq_len for c in caches for s in c.slots), default=0)
    for i, c in enumerate(caches):
        for layer, slot in enumerate(c.slots):
            refusal = _slot_pad_refusal(slot, target, xs_per_seq)
            if refusal is not None:
                raise CacheRefusal(f"sequence {i} slot {layer}: {refusal}")
    leads = []
    for c in caches:
        lead = 0
        for slot in c.slots:
            if slot.kind != XS:
                lead = slot.front_pad(target)
        leads.append(lead)
    return leads


def _would_align(caches: list[TorchCache], xs_per_seq: bool) -> bool:
    target = max((s.current_seq_len for c in caches for s in c.slots), default=0)
    return all(_slot_pad_refusal(s, target, xs_per_seq) is None for c in caches for s in c.slots)


def _first_mismatch(caches: list[TorchCache], xs_per_seq: bool):
    ref = caches[0].slots
    for i, c in enumerate(caches[1:], start=1):
        require(len(c.slots) == len(ref), f"sequence {i} has {len(c.slots)} slots, sequence 0 has {len(ref)}")
        for layer, slot in enumerate(c.slots):
            if xs_per_seq and (slot.kind == XS or ref[layer].kind == XS):
                continue
            if ref[layer].current_seq_len != slot.current_seq_len:
                return layer, ref[layer].current_seq_len, slot.current_seq_len, i
    return None


def _strip_pending(caches: list[TorchCache], pending: list[int]) -> None:
    require(len(pending) in (0, len(caches)), f"{len(pending)} pending leads for {len(caches)} sequences")
    for i, (c, lead) in enumerate(zip(caches, pending)):
        require(lead >= 0, f"pending lead {lead} must be >= 0")
        for layer, slot in enumerate(c.slots):
            refusal = _dead_prefix_refusal(slot, lead)
            if refusal is not None:
                raise CacheRefusal(f"sequence {i} slot {layer}: {refusal}")
    for c, lead in zip(caches, pending):
        for slot in c.slots:
            drop_dead_prefix(slot, lead)


def clone_in_cache(caches: list[TorchCache], pending: list[int], xs_per_seq: bool) -> CloneIn:
    """`clone_in_cache` (lazy policy) on port slots, the reference's order of checks."""
    require(len(caches) > 0, "clone_in_cache needs at least one sequence")
    _strip_pending(caches, pending)
    can = all(s.supports_per_sequence_len(xs_per_seq) for c in caches for s in c.slots)
    lead_pad = None
    if _first_mismatch(caches, xs_per_seq) is not None and can and _would_align(caches, xs_per_seq):
        lead_pad = front_align_batch(caches, xs_per_seq)
    mismatch = _first_mismatch(caches, xs_per_seq)
    if mismatch is not None:
        layer, expected, got, i = mismatch
        raise AlignRefusal(f"sequences in one batch must share current_seq_len: layer {layer} expected {expected} "
                           f"(sequence 0) but sequence {i} has {got}")
    slots = []
    for layer in range(len(caches[0].slots)):
        group = [c.slots[layer] for c in caches]
        kinds = {s.kind for s in group}
        require(len(kinds) == 1, f"layer {layer} mixes slot kinds {sorted(kinds)}")
        slots.append(concat_slots(group) if group[0].kind == NORMAL else xs_stack(group, not xs_per_seq))
    return CloneIn(TorchCache(slots), lead_pad, can)


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
        return TorchCache(slots)

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

    def _xs_view(self, slot: XsRolling) -> dict:
        return {"tokens": as_list(slot.tokens), "base": as_list(slot.base),
                "comp": [self.to_numpy(slot.row_comp(i)) for i in range(slot.batch)],
                "history": [self.to_numpy(slot.row_history(i)) for i in range(slot.batch)]}

    def materialize(self, obj):
        if isinstance(obj, TorchCache):
            kvs = [self._kv_view(s) for s in obj.slots if s.kind == NORMAL]
            return {"len": obj.current_seq_len, "kv": [(s["k"], s["v"]) for s in kvs],
                    "capacity": [s["capacity"] for s in kvs],
                    "xs": [self._xs_view(s) for s in obj.slots if s.kind == XS]}
        s = self._kv_view(obj)
        return {"len": s["len"], "kv": [(s["k"], s["v"])], "capacity": [s["capacity"]], "xs": []}

    # ------------------------------------------------------------------ target cache rules
    def clone_in(self, caches, pending_leads, xs_per_seq, per_sequence):
        _strip_pending(caches, pending_leads)
        leads = front_align_batch(caches, xs_per_seq) if per_sequence else None
        inner = clone_in_cache(caches, [], xs_per_seq)
        if leads is None:
            leads = inner.lead_pad if inner.lead_pad is not None else [0] * len(caches)
        return CloneIn(inner.batched, [int(x) for x in leads], inner.ragged_decode_supported)

    def clone_out(self, batched, b):
        require(b >= 1, f"clone_out_cache needs b >= 1, got {b}")
        rows = [[] for _ in range(b)]
        for layer, slot in enumerate(batched.slots):
            if slot.kind == NORMAL:
                require(slot.kv is None or slot.kv.batch == b, f"layer {layer} holds {slot.batch} rows, not {b}")
                pieces = chunk_slot(slot, b)
            else:
                require(slot.batch == b, f"xs layer {layer} holds {slot.batch} rows, not {b}")
                pieces = xs_split(slot)
            for i in range(b):  # host lists of per-sequence slot objects (no tensor work)
                rows[i].append(pieces[i])
        return [TorchCache(r) for r in rows]

    def truncate_by(self, cache, n_drop):
        require(n_drop >= 0, f"n_drop {n_drop} must be >= 0")
        for slot in cache.slots:
            cur = slot.current_seq_len
            new = max(cur - n_drop, 0)
            try:
                slot.set_len(new)
            except CacheRefusal as err:
                raise StepRefusal(
                    f"MTP: cache set_len({new}) failed rolling back {n_drop} of {cur} positions: {err}") from err

    def commit_per_sequence(self, cache, lead, own, committed):
        require(lead >= 0 and own >= 0 and committed >= 0,
                f"lead {lead}, cache_len {own}, committed {committed} must be >= 0")
        target = own + committed
        for i, slot in enumerate(cache.slots):
            try:
                drop_dead_prefix(slot, lead)
            except CacheRefusal as err:
                raise StepRefusal(f"stripping the {lead}-column dead prefix failed on slot {i}: {err}") from err
            try:
                slot.set_len(target)
            except CacheRefusal as err:
                raise StepRefusal(f"set_len({target}) refused on slot {i}: {err}") from err

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
        return front_align_batch([TorchCache([kv]) for kv in kvs], xs_per_seq=False)

    def strip_dead_prefix(self, kv, lead):
        drop_dead_prefix(kv, lead)

    def concat(self, kvs):
        return concat_slots(kvs)

    def split(self, kv, g):
        require(g >= 1, f"split_draft_cache needs g >= 1, got {g}")
        if g == 1:
            return [kv.clone()]
        return chunk_slot(kv, g)

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
        return concat_slots(rows)

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
        rows = gdispatch.resolve_ragged_rows(None if row_q0 is None else self._ints(row_q0), c, b)
        attn_dead = torch.zeros(b, dtype=torch.int64, device=self.dev) if rows is None else c - rows
        first = kvs[0]
        if first.kv is None:
            require(c == 0, f"an unmaterialized cache of length {c} cannot be decoded on")
        else:
            for slot in kvs:
                slot.bake(attn_dead)
        comp_start = self._ints(leads) - (first.lead if first.kv is not None else 0)
        require(not bool((comp_start < 0).any()), f"compressed keys from leads {leads} inside the dead prefix")
        if first.kv is None:
            for slot in kvs:
                slot.kv = RaggedKv.empty(b, 1, model.cfg.head_dim, slot.max_seq_len, slot.capacity, self.tdtype,
                                         self.dev)
                slot.lead = torch.zeros(b, dtype=torch.int64, device=self.dev)
        for slot in kvs:
            slot.grow_meta(t)
            _grow_physical(slot.kv, int(slot.kv.lens.max()) + t)
        lens = first.kv.lens
        offs_t = self._ints(offs)
        toks = torch.as_tensor(tokens, device=self.dev)
        if bool((offs_t == lens).all()) and not bool((comp_start != 0).any()):
            fwd = model.forward(toks, [s.kv for s in kvs], offs, capture)
        else:
            fwd = self._forward_general(model, toks, [s.kv for s in kvs], offs_t, comp_start)
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
            gdispatch.draft_step_end_column(self._ints(start_pos), fused.shape[0], kv.current)
            kv.grow_meta(t)
            kv.store.reserve(kv.current + t)
            kv.materialized = True
            out = model.mtp.forward_tokens_rows(fused, [int(p) for p in start_pos], kv.store.kv,
                                                self._ints([kv.idx]))
            kv.current += t
            return out
        gdispatch.draft_step_end_column(self._ints(start_pos), fused.shape[0], kv.current)  # desync first
        kv.check_append(t)
        kv.grow_meta(t)
        _grow_physical(kv.kv, int(kv.kv.lens.max()) + t)
        out = model.mtp.forward_tokens_rows(fused, [int(p) for p in start_pos], kv.kv)
        kv.current += t
        return out

    def propose_chain(self, model, seed_hidden, last_tokens, n, chain_starts, kv):
        seed = self._t(seed_hidden)
        g = seed.shape[0]
        if model.mtp is not None and kv is not None and n > 0 and g > 0:
            cap = kv.capacity
            for i in range(n):  # the reference's n one-column appends: a refusal before anything runs
                cap = TorchKv(kv.max_seq_len, cap, kv.current + i).check_append(1)
            kv.capacity = cap
            _grow_physical(kv.kv, int(kv.kv.lens.max()) + n)
        chains = propose_chain_batched(model, seed, self._ints(last_tokens), n, [int(s) for s in chain_starts],
                                       None if kv is None else kv.kv)
        if kv is not None and model.mtp is not None and n > 0 and g > 0:
            kv.current += n
        return [as_list(row) for row in chains]

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
            leads = gdispatch.resolve_draft_leads(per_seq_advance, self._ints(starts))
            aligned = leads is not None
            leads = as_list(leads) if aligned else [0] * g
            plan = self._draft_group_plan(caches, starts, aligned, n_draft, (u, _), warnings)
            if plan is None:
                continue
            entry, cap = plan
            store = caches[0].store
            idx = self._ints([c.idx for c in caches])
            store.reserve(max(max(starts), entry) + n_draft)
            before = store.kv.lens
            # the alignment is lengths only: each row its own start (ragged), or the batched
            # set_len(starts[0]) (uniform path; ragged starts there refuse "desync" in the chain)
            store.kv.lens = before.index_copy(0, idx, self._ints(starts) if aligned else self._ints([entry] * g))
            try:
                chains = propose_chain_batched(model, seed_hidden, self._ints(lasts), n_draft, self._ints(starts),
                                               store.kv, rows=idx).tolist()
            except Refusal:
                store.kv.lens = before  # the reference refused on a batched copy: the rows are untouched
                raise
            for slot, i in enumerate(members):  # host write-back: per-state metadata, no tensor
                c = caches[slot]
                c.materialized = True
                c.capacity = cap - leads[slot]      # split (batched metadata) + strip of the row's lead
                c.current = starts[slot] + n_draft  # == store.kv.lens[c.idx]
                states[i].filled = starts[slot] + 1
                drafts[i] = chains[slot]
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
            store.kv.lens = store.kv.lens.index_copy(0, self._ints(trunc_idx), self._ints(trunc_len))
        if w_rows:
            store.reserve(max(w_hi))
            width = max(w_hi) + 1
            tok = np.zeros((len(w_rows), width), dtype=np.int64)
            for r, (row, lo, hi) in enumerate(zip(w_rows, w_lo, w_hi)):  # host packing of the token lists
                tok[r, lo + 1: hi + 1] = toks[row][lo + 1: hi + 1]
            rows_t = self._ints(w_rows)
            extend_draft_kv_rows(block, store.kv, hidden[rows_t], w_off, w_lo, w_hi,
                                 torch.from_numpy(tok).to(self.dev), rows=self._ints(w_idx))

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
    def resolve_row_cache_lens(self, enabled, cache_len, lead_pad):
        out = gdispatch.resolve_row_cache_lens(enabled, cache_len, self._ints(lead_pad))
        return None if out is None else as_list(out)

    def ragged_row_q0(self, offsets, per_seq_kv):
        out = gdispatch.ragged_row_q0(self._ints(offsets), per_seq_kv)
        return None if out is None else as_list(out)

    def plan_step_window(self, cache_lens, tok_lens, w):
        sw = gstep.plan_step_window(self._ints(cache_lens), self._ints(tok_lens), w)
        return as_list(sw.uncached), sw.ok

    def token_budget(self, max_seq_len, tok_lens):
        return as_list(gstep.token_budget(max_seq_len, self._ints(tok_lens)))

    def draft_groups(self, uncached, cache_lens, may_draft, w, per_seq_advance):
        may = torch.as_tensor([bool(m) for m in may_draft], dtype=torch.bool, device=self.dev)
        return gdispatch.draft_groups(self._ints(uncached), self._ints(cache_lens), may, w, per_seq_advance).as_dict()

    def draft_group_keys(self, uncached, cache_lens, carries_per_row):
        keys = gdispatch.draft_group_keys(self._ints(uncached), self._ints(cache_lens), carries_per_row)
        return [(int(a), int(s)) for a, s in keys.tolist()]

    def chain_starts(self, cache_lens, uncached):
        return as_list(gdispatch.chain_start_of(self._ints(cache_lens), self._ints(uncached)))

    def verify_accept(self, proposed, targets):
        b = len(proposed)
        p = max((len(x) for x in proposed), default=0)
        q = max((len(x) for x in targets), default=0)
        lp = np.fromiter((len(x) for x in proposed), np.int64, b)
        lq = np.fromiter((len(y) for y in targets), np.int64, b)
        prop, targ = _pack_ragged(proposed, lp, p, -1), _pack_ragged(targets, lq, q, -2)
        out = gstep.verify_proposed(torch.from_numpy(prop).to(self.dev), torch.from_numpy(targ).to(self.dev),
                                    torch.from_numpy(lp).to(self.dev), torch.from_numpy(lq).to(self.dev))
        return as_list(out.accepted)

    def budget_clamp(self, accepted, budgets):
        return as_list(gstep.budget_clamp(self._ints(accepted), self._ints(budgets)))

    def plan_batch_step(self, uncached, accepted, w):
        plan = gstep.plan_batch_step(self._ints(uncached), self._ints(accepted), w)
        return int(plan.keep), int(plan.n_drop), as_list(plan.next_uncached)

    def plan_per_sequence_step(self, uncached, accepted, w):
        plan = gstep.plan_per_sequence_step(self._ints(uncached), self._ints(accepted), w)
        return as_list(plan.committed), as_list(plan.dropped), as_list(plan.next_uncached)


def _pack_ragged(lists, lens: np.ndarray, width: int, fill: int) -> np.ndarray:
    """Host packing of ragged integer lists into `[B, width]` (padding `fill`): one flat
    copy and one masked assignment (row-major, so each row's values land in order)."""
    out = np.full((len(lists), width), fill, dtype=np.int64)
    flat = np.fromiter(itertools.chain.from_iterable(lists), np.int64, int(lens.sum()))
    out[np.arange(width)[None, :] < lens[:, None]] = flat
    return out


def _warn(warnings, text: str) -> None:
    if warnings is not None:
        warnings.append(text)


__all__ = ["TorchBackend", "TorchKv", "TorchCache", "DraftStore", "PoolKv", "concat_slots", "chunk_slot", "xs_split",
           "xs_stack", "front_align_batch", "clone_in_cache", "drop_dead_prefix"]
