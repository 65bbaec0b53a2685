"""The paged-KV backend: `gpu.backend.TorchBackend` with its target K/V slots in pages.

Each K/V slot keeps its rows in a `gpu.paged.PagedRaggedKv` over one `gpu.paged.PageStore`
per head geometry (shared by every slot this backend makes), with the slot protocol of
`gpu.slots.TorchKv` (`PagedKv` is one): the reference's host rules (clone-in order, strip
and pending leads, first mismatch, commit, capacity arithmetic and refusals) run unchanged
through the inherited methods and `reference.align`. What differs is what the layout does
for them: rollback and commit set lengths; the dead-prefix strip advances a row's table
offset; front alignment is the slot's lead; clone-out hands out row handles over the same
pages and clone-in copies table rows. Only appends write K/V (`PageStore.write`).

The draft KV (the MTP head's pooled buffer) stays the in-place `gpu.draft_store.DraftStore`
of the torch backend, and so do the draft-group ops of the per-op protocol (`split`,
`front_align_draft_group`), which return in-place slots. docs/kernels.md "Paged KV".
"""

from __future__ import annotations

import numpy as np
import torch

from raggedspec.gpu.align import materialize_front_aligned
from raggedspec.gpu.backend import TorchBackend
from raggedspec.gpu.cache import RaggedKv
from raggedspec.gpu.paged import PagedRaggedKv, PageStore, stack_rows
from raggedspec.gpu.slots import NORMAL, RowKv, TorchKv, stack_xs
from raggedspec.gpu.xs_rolling import XsRolling
from raggedspec.reference import align
from raggedspec.reference.backend import CloneIn
from raggedspec.reference.cache import PLAIN_CACHE_CAPACITY, NormalCache
from raggedspec.reference.errors import require

DEFAULT_PAGE_SIZE = 16


class PagePool:
    """The page stores of one backend, one per `(H, D, Dv, dtype, device)`."""

    def __init__(self, page_size: int) -> None:
        require(int(page_size) >= 1, f"page_size {page_size} must be >= 1")
        self.page_size, self.stores = int(page_size), {}

    def store(self, heads: int, dim: int, v_dim: int, dtype: torch.dtype, device) -> PageStore:
        key = (heads, dim, v_dim, dtype, str(device))
        if key not in self.stores:
            self.stores[key] = PageStore(heads, dim, v_dim, self.page_size, dtype, device)
        return self.stores[key]


class PagedKv(TorchKv):
    """A batched K/V slot over pages: `TorchKv`'s metadata and refusals, `kv` a
    `PagedRaggedKv`. Assigning a dense `RaggedKv` (the forward's empty first batch) adopts
    it: its live columns are written into pages. Invariant: `lead_i + kv.lens_i == current`."""

    def __init__(self, max_seq_len: int, pool: PagePool, capacity: int = PLAIN_CACHE_CAPACITY,
                 current: int = 0, kv: PagedRaggedKv | None = None, lead=None) -> None:
        self.pool = pool
        super().__init__(max_seq_len, capacity, current, kv, lead)

    @property
    def kv(self) -> PagedRaggedKv | None:
        return self._kv

    @kv.setter
    def kv(self, value) -> None:
        if isinstance(value, RaggedKv):
            store = self.pool.store(value.k.shape[1], value.k.shape[3], value.v.shape[3],
                                    value.k.dtype, value.k.device)
            paged = PagedRaggedKv.empty(store, value.batch, value.max_seq_len)
            own = value.host_lens()
            for i in np.flatnonzero(own).tolist():  # a constructor's copy, off the step path
                n = int(own[i])
                paged.append(value.k[i: i + 1, :, :n], value.v[i: i + 1, :, :n], rows=[i])
            value = paged
        self._kv = value

    def clone(self) -> PagedKv:
        return PagedKv(self.max_seq_len, self.pool, self.capacity, self.current,
                       None if self.kv is None else self.kv.clone(), self.lead)

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """`SingleCache.append`: the reference's growth and refusal first, then every row's
        new columns written into its pages at its own offset."""
        s = k.shape[2]
        self.check_append(s)
        if self.kv is None:
            store = self.pool.store(k.shape[1], k.shape[3], v.shape[3], k.dtype, k.device)
            self.kv = PagedRaggedKv.empty(store, k.shape[0], self.max_seq_len)
            self.lead = np.zeros(k.shape[0], dtype=np.int64)
        self.grow_meta(s)
        self.kv.append(k, v)
        self.current += s

    def drop_front(self, lead: int) -> None:
        """`drop_front_single`: within a row's offset only the offset shrinks; a row whose
        own run is cut has its table offset advanced (no bytes move)."""
        refusal = self.drop_refusal(lead)
        if refusal is not None:
            raise refusal
        if lead == 0:
            return
        cut = np.maximum(lead - self.lead, 0)
        if cut.any():
            self.kv.advance(cut)
        self.lead = np.maximum(self.lead - lead, 0)
        self.capacity -= lead
        self.current -= lead

    def bake(self, dead: np.ndarray) -> None:
        """Every row's alignment offset down to `dead_i`: the `lead_i - dead_i` columns
        become the row's zero lead (no bytes move)."""
        extra = self.lead - dead
        if (extra < 0).any():
            raise ValueError(f"rows would need dead prefixes {dead.tolist()} longer than their "
                             f"alignment offsets {self.lead.tolist()}")
        if extra.any():
            self.kv.prepend_zeros(extra)
            self.lead = np.asarray(dead, dtype=np.int64).copy()

    def rows(self) -> list[PagedRowKv]:
        """One handle per row over the same pages (host integers only)."""
        b = self.kv.batch if self.kv is not None else 1
        lead = self.lead if self.lead is not None else np.zeros(b, dtype=np.int64)
        return [PagedRowKv(self.max_seq_len, self.capacity, self.current, self.kv, i,
                           int(lead[i]), 0, self.pool) for i in range(b)]


class PagedRowKv(RowKv):
    """One sequence's K/V slot: row `row` of the batch `kv` (a `PagedRaggedKv`, or None),
    with `RowKv`'s lead and shift (own column j at view column `shift + j`)."""

    def __init__(self, max_seq_len: int, capacity: int, current: int, kv, row: int, lead: int,
                 shift: int, pool: PagePool) -> None:
        super().__init__(max_seq_len, capacity, current, kv, kv, row, lead, shift)
        self.pool = pool

    def clone(self) -> PagedRowKv:
        return PagedRowKv(self.max_seq_len, self.capacity, self.current, self.k, self.row,
                          self.lead, self.shift, self.pool)

    def front_aligned(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The reference's `current_data()` `[1, H, current, D]` (conformance)."""
        if self.k is None:
            return None
        one = stack_rows([(self.k, self.row, self.shift)], np.array([self.own]), self.max_seq_len)
        return materialize_front_aligned(one, self.current)


def stack_paged(parts: list, pool: PagePool) -> PagedKv:
    """`concat_kv` of paged handles (or batched slots, row by row): table rows stacked, the
    capacity of the widest, the length of the first. ValueError on mixed materialization,
    unequal lengths or a slot of another layout."""
    rows = [r for p in parts for r in (p.rows() if isinstance(p, TorchKv) else [p])]
    require(len(rows) > 0, "concat_kv needs at least one slot")
    bad = [i for i, r in enumerate(rows) if r.materialized and not isinstance(r, PagedRowKv)]
    if bad:
        raise ValueError(f"row {bad[0]} is not a paged slot")
    first = rows[0]
    cap = max(r.capacity for r in rows)
    mat = [r.materialized for r in rows]
    require(all(mat) or not any(mat), "cannot concatenate materialized and unmaterialized slots")
    if not any(mat):
        return PagedKv(first.max_seq_len, pool, cap, first.current)
    if any(r.current != first.current for r in rows):
        raise ValueError(
            f"the port concatenates slots of one length only, got {[r.current for r in rows]}")
    lead = np.fromiter((r.lead for r in rows), np.int64, len(rows))
    kv = stack_rows([(r.k, r.row, r.shift) for r in rows], first.current - lead, first.max_seq_len)
    return PagedKv(first.max_seq_len, pool, cap, first.current, kv, lead)


class PagedBackend(TorchBackend):
    """`TorchBackend` with paged target K/V slots of `page_size` columns per page (module
    docstring); device and dtype as `TorchBackend`'s."""

    name = "paged"

    def __init__(self, device: str | None = None, dtype: str = "float64",
                 page_size: int = DEFAULT_PAGE_SIZE) -> None:
        super().__init__(device, dtype)
        self.pool = PagePool(page_size)

    def new_target_cache(self, cfg, max_seq_len, batch):
        slots = [PagedKv(max_seq_len, self.pool) for _ in cfg.compress_ratios]
        slots += [XsRolling(r, max_seq_len=max_seq_len, batch=batch, device=self.dev)
                  for r in cfg.compress_ratios if r > 0]
        return NormalCache(slots)

    def _stack_layer(self, slots: list, layer: int, xs_per_seq: bool):
        kinds = {s.kind for s in slots}
        require(len(kinds) == 1, f"layer {layer} mixes slot kinds {sorted(kinds)}")
        if slots[0].kind == NORMAL:
            return stack_paged(slots, self.pool)
        return stack_xs(slots, not xs_per_seq)

    def clone_in(self, caches, pending_leads, xs_per_seq, per_sequence):
        """The reference's clone-in on paged slots; the batch's tables are the handles'."""
        ci = align.clone_in_cache_reporting_lead(caches, pending_leads, xs_per_seq, per_sequence,
                                                 self._stack_layer)
        return CloneIn(ci.batched, [int(x) for x in ci.lead_pad], ci.ragged_decode_supported)

    def kv_from_arrays(self, k, v, max_seq_len, capacity=PLAIN_CACHE_CAPACITY):
        slot = PagedKv(max_seq_len, self.pool, capacity)
        slot.append(self._t(k), self._t(v))
        return slot

    def concat(self, kvs):
        if all(isinstance(k, PagedKv | PagedRowKv) for k in kvs):
            return stack_paged(kvs, self.pool)
        return super().concat([dense(k) if isinstance(k, PagedKv) else k for k in kvs])

    def split(self, kv, g):
        """`split_draft_cache` on a paged slot: g pieces of table rows (the reference's
        chunk sizes); None when the piece count is not g."""
        if not isinstance(kv, PagedKv):
            return super().split(kv, g)
        require(g >= 1, f"split_draft_cache needs g >= 1, got {g}")
        if g == 1:
            return [kv.clone()]
        if kv.kv is None:
            return [PagedKv(kv.max_seq_len, self.pool, kv.capacity, kv.current) for _ in range(g)]
        rows = kv.rows()
        sizes = align._chunk_sizes(len(rows), g)
        if len(sizes) != g:
            return None
        starts = np.cumsum([0, *sizes])
        bounds = zip(starts[:-1], starts[1:], strict=True)
        return [stack_paged(rows[a:b], self.pool) for a, b in bounds]

    def front_align_draft_group(self, kvs, starts):
        """The draft-group op on in-place copies of the slots (a draft op: the paged layout
        is the target cache's)."""
        return super().front_align_draft_group([dense(k) if isinstance(k, PagedKv) else k
                                                for k in kvs], starts)


def dense(slot: PagedKv) -> TorchKv:
    """An in-place `TorchKv` with the slot's rows and metadata (one gather of the views)."""
    kv = slot.kv
    if kv is None:
        return TorchKv(slot.max_seq_len, slot.capacity, slot.current)
    own = RaggedKv(kv.k.clone(), kv.v.clone(), kv.host_lens().copy(), slot.max_seq_len)
    return TorchKv(slot.max_seq_len, slot.capacity, slot.current, own, slot.lead)


__all__ = [
    "DEFAULT_PAGE_SIZE", "PagePool", "PagedBackend", "PagedKv", "PagedRowKv", "dense",
    "stack_paged",
]
