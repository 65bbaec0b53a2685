"""The torch port's cache slots: a batched K/V slot, per-sequence row handles, the XsRolling
row handle, the pooled draft KV, and the assembly of handles into a batch.

A batched K/V slot (`TorchKv`) keeps its rows in place, start-anchored, in one
`gpu.cache.RaggedKv`, plus each row's alignment offset `lead_i` as a host integer: the
reference's front-aligned view of row i is `lead_i` dead columns, then its own run, so
`current = lead_i + own_i` for every row. The per-sequence caches the protocol hands out are
*row handles* (`RowKv`, `RowXs`): a row index into the batched buffers they came from plus the
reference's metadata as host integers. Clone-out, the dead-prefix strip, front alignment,
`set_len` and the per-sequence commit touch only those integers (no tensor op, no device
read); data moves once per clone-in (`stack_layer`), where the rows of one batch are gathered
with one `index_select` per source buffer, or not at all when the handles are the untouched
rows of one batch in order (`concat_stats` counts both). Every rule of the bookkeeping
(strip and alignment order, refusals, capacity arithmetic) is the reference's: the slots
implement the small protocol `reference.align` uses (`kind`, `current_seq_len`,
`pad_refusal`, `front_pad`, `drop_refusal`, `drop_front`, `set_len`,
`supports_per_sequence_len`); docs/conformance.md lists it.

Invariant of a handle: its buffers are those of the batch at clone-out; the batch writes only
past every row's own length, so a handle's own columns are never rewritten (the XsRolling
ring is replaced, not written in place, by an append).
"""

from __future__ import annotations

import numpy as np
import torch

from raggedspec.gpu._common import host_ints
from raggedspec.gpu.align import materialize_front_aligned
from raggedspec.gpu.cache import RaggedKv
from raggedspec.gpu.xs_rolling import XsRolling
from raggedspec.reference.align import drop_front_refusal, front_pad_refusal
from raggedspec.reference.cache import (
    PLAIN_CACHE_CAPACITY,
    block_capacity,
    grown_capacity,
    set_len_refusal,
)
from raggedspec.reference.errors import CacheRefusal, require
from raggedspec.reference.xs_rolling import rollback_refusal

NORMAL, XS = "Normal", "XsRolling"
concat_stats = {"view": 0, "copy": 0}


def grow_physical(kv: RaggedKv, needed: int) -> None:
    """Make the physical buffer hold `needed` columns (whole 512-column blocks; never
    refused: refusals are the metadata's)."""
    if needed > kv.capacity and hasattr(kv, "reserve"):  # a paged layout widens its view
        kv.reserve(needed)
    elif needed > kv.capacity:
        pad = block_capacity(kv.capacity, needed) - kv.capacity
        kv.k = torch.nn.functional.pad(kv.k, (0, 0, 0, pad))
        kv.v = torch.nn.functional.pad(kv.v, (0, 0, 0, pad))


def shift_rows(
    k: torch.Tensor, v: torch.Tensor, own: np.ndarray, shift: np.ndarray, max_seq_len: int
) -> RaggedKv:
    """Row i's own run (`own_i` columns from physical 0) moved by `shift_i` (> 0: right, zeros
    in front; < 0: left, the first `-shift_i` columns dropped): one gather per buffer; the
    host lengths `own + shift`."""
    after = own + shift
    # whole blocks past the buffer when a moved run ends past it (none when it fits)
    pad = block_capacity(k.shape[2], int(after.max(initial=0))) - k.shape[2]
    if pad:
        k = torch.nn.functional.pad(k, (0, 0, 0, pad))
        v = torch.nn.functional.pad(v, (0, 0, 0, pad))
    width = k.shape[2]
    dev = k.device
    sh = torch.from_numpy(shift.astype(np.int64)).to(dev)
    n = torch.from_numpy(own.astype(np.int64)).to(dev)
    src = torch.arange(width, device=dev)[None, :] - sh[:, None]  # [B, W]
    live = ((src >= 0) & (src < n[:, None]))[:, None, :, None]
    cols = src.clamp(min=0, max=max(width - 1, 0))[:, None, :, None]
    b, h, _, d = k.shape
    zero = torch.zeros((), dtype=k.dtype, device=dev)
    k2 = torch.where(live, k.gather(2, cols.expand(b, h, width, d)), zero)
    v2 = torch.where(live, v.gather(2, cols.expand(b, h, width, v.shape[3])), zero)
    return RaggedKv(k2, v2, after, max_seq_len)


class KvMeta:
    """The reference's allocation arithmetic of one K/V slot on host integers: `current`,
    `capacity` (start 512, or 16 for a draft KV; grown by whole 512-column blocks from the
    shared length, refused above `max_seq_len`), `max_seq_len`; and the refusals of
    `set_len`, `front_pad` and the dead-prefix strip, decided before anything changes."""

    kind = NORMAL
    materialized: bool

    def __init__(self, max_seq_len: int, capacity: int, current: int) -> None:
        self.max_seq_len, self.capacity, self.current = (
            int(max_seq_len),
            int(capacity),
            int(current),
        )

    @property
    def current_seq_len(self) -> int:
        return self.current

    @property
    def capacity_seq_len(self) -> int:
        return self.capacity

    def supports_per_sequence_len(self, xs_per_seq: bool = False) -> bool:
        return True

    def check_append(self, s: int) -> int:
        """The capacity `s` more columns need (`reference.cache.grown_capacity`, its
        CacheRefusal above `max_seq_len`); nothing changes."""
        return grown_capacity(self.capacity, self.current, s, self.max_seq_len)

    def grow_meta(self, s: int) -> None:
        self.capacity = self.check_append(s)

    def try_set_len(self, n: int) -> None:
        refusal = set_len_refusal(n, 0, self.capacity)
        if refusal is not None:
            raise refusal

    def pad_refusal(self, target: int) -> CacheRefusal | None:
        return front_pad_refusal(self.current, target, self.materialized, 0, self.capacity,
                                 self.max_seq_len)

    def drop_refusal(self, lead: int) -> CacheRefusal | None:
        return drop_front_refusal(lead, self.current, self.materialized, self.capacity, 0)


class TorchKv(KvMeta):
    """A batched K/V slot (module docstring): `kv` (rows in place; None until the first
    append, like the reference's unmaterialized buffer), `lead` (host int64 `[B]`).
    Invariant: `lead_i + kv.lens_i == current` for every row of a materialized slot, so the
    rows' own lengths are known on the host (`own`)."""

    def __init__(
        self,
        max_seq_len: int,
        capacity: int = PLAIN_CACHE_CAPACITY,
        current: int = 0,
        kv: RaggedKv | None = None,
        lead=None,
    ) -> None:
        super().__init__(max_seq_len, capacity, current)
        self.kv = kv
        self.lead = None if lead is None else host_ints(lead).copy()

    @property
    def materialized(self) -> bool:
        return self.kv is not None

    @property
    def batch(self) -> int:
        return 0 if self.kv is None else self.kv.batch

    @property
    def own(self) -> np.ndarray:
        """Every row's own length (host)."""
        return self.current - self.lead

    def clone(self) -> TorchKv:
        return TorchKv(
            self.max_seq_len,
            self.capacity,
            self.current,
            None if self.kv is None else self.kv.clone(),
            self.lead,
        )

    def front_aligned(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The reference's `current_data()` of K and V `[B, H, current, D]`: one gather."""
        if self.kv is None:
            return None
        return materialize_front_aligned(self.kv, self.current)

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """`SingleCache.append` of both halves: the reference's growth and refusal before
        anything changes; every row's new columns land at its own offset."""
        s = k.shape[2]
        self.check_append(s)
        if self.kv is None:
            b, h, _, d = k.shape
            self.kv = RaggedKv.empty(
                b, h, d, self.max_seq_len, max(self.capacity, s, 1), k.dtype, k.device, v.shape[3]
            )
            self.lead = np.zeros(b, dtype=np.int64)
        self.grow_meta(s)
        grow_physical(self.kv, int(self.own.max()) + s if self.kv.batch else s)
        self.kv.append(k, v)  # converted to the buffers' dtype there
        self.current += s

    def set_len(self, n: int) -> None:
        """`KvCache.set_len`: refused past the capacity; row i keeps `min(lead_i, n)` dead
        columns and `n - lead_i` of its own (no data moves; one host->device length copy)."""
        self.try_set_len(n)
        if self.kv is not None:
            lead = np.minimum(self.lead, n)
            own = n - lead
            grow_physical(self.kv, int(own.max()) if own.size else 0)
            self.kv.lens = own
            self.lead = lead
        self.current = n

    def front_pad(self, target: int) -> int:
        """`front_pad_single` of both halves: the lead grows by `target - current` (an offset,
        no data motion); capacity `max(capacity, target)`."""
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

    def drop_front(self, lead: int) -> None:
        """`drop_front_single` of both halves: within a row's offset only the offset shrinks;
        rows whose own run is cut move left (one gather for all). Capacity `capacity - lead`."""
        refusal = self.drop_refusal(lead)
        if refusal is not None:
            raise refusal
        if lead == 0:
            return
        cut = np.maximum(lead - self.lead, 0)
        if cut.any():
            self.kv = shift_rows(self.kv.k, self.kv.v, self.own, -cut, self.max_seq_len)
        self.lead = np.maximum(self.lead - lead, 0)
        self.capacity -= lead
        self.current -= lead

    def bake(self, dead: np.ndarray) -> None:
        """Make every row's alignment offset `dead_i <= lead_i`: the `lead_i - dead_i` front
        columns become physical zeros (one gather; the reference's view is unchanged)."""
        extra = self.lead - dead
        if (extra < 0).any():
            raise ValueError(
                f"rows would need dead prefixes {dead.tolist()} longer than their alignment "
                f"offsets {self.lead.tolist()}"
            )
        if extra.any():
            self.kv = shift_rows(self.kv.k, self.kv.v, self.own, extra, self.max_seq_len)
            self.lead = host_ints(dead).copy()

    def rows(self) -> list[RowKv]:
        """The slot as one handle per row (clone-out: host integers only)."""
        b = self.kv.batch if self.kv is not None else 1
        lead = self.lead if self.lead is not None else np.zeros(b, dtype=np.int64)
        k, v = (None, None) if self.kv is None else (self.kv.k, self.kv.v)
        return [
            RowKv(self.max_seq_len, self.capacity, self.current, k, v, i, int(lead[i]), 0)
            for i in range(b)
        ]


class RowKv(KvMeta):
    """One sequence's K/V slot: row `row` of the buffers `k, v` (shared with the batch it was
    cloned out of; None when unmaterialized), its `lead` and the `shift` its own run sits at
    (a strip that cuts into the run moves the start, not the data), as host integers.
    Invariant: `lead + own == current`; own column j at physical column `shift + j`."""

    def __init__(
        self, max_seq_len: int, capacity: int, current: int, k, v, row: int, lead: int, shift: int
    ) -> None:
        super().__init__(max_seq_len, capacity, current)
        self.k, self.v, self.row, self.lead, self.shift = k, v, row, lead, shift

    @property
    def materialized(self) -> bool:
        return self.k is not None

    @property
    def own(self) -> int:
        return self.current - self.lead

    def clone(self) -> RowKv:
        return RowKv(
            self.max_seq_len,
            self.capacity,
            self.current,
            self.k,
            self.v,
            self.row,
            self.lead,
            self.shift,
        )

    def set_len(self, n: int) -> None:
        """`KvCache.set_len`: refused past the capacity; keeps `min(lead, n)` dead columns."""
        self.try_set_len(n)
        self.lead = min(self.lead, n)
        self.current = n

    def front_pad(self, target: int) -> int:
        refusal = self.pad_refusal(target)
        if refusal is not None:
            raise refusal
        lead = target - self.current
        self.lead += lead
        if lead:
            self.capacity = max(self.capacity, target)
        self.current = target
        return lead

    def drop_front(self, lead: int) -> None:
        refusal = self.drop_refusal(lead)
        if refusal is not None:
            raise refusal
        if lead == 0:
            return
        self.shift += max(lead - self.lead, 0)
        self.lead = max(self.lead - lead, 0)
        self.capacity -= lead
        self.current -= lead

    def front_aligned(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The reference's `current_data()` `[1, H, current, D]` (one gather; conformance)."""
        if self.k is None:
            return None
        own = self.own
        k = self.k[self.row, :, self.shift : self.shift + own]
        v = self.v[self.row, :, self.shift : self.shift + own]
        fill = (0, 0, 0, own - k.shape[1])  # own columns past the buffer: zeros
        kv = RaggedKv.from_rows([torch.nn.functional.pad(k, fill)],
                                [torch.nn.functional.pad(v, fill)], self.max_seq_len)
        return materialize_front_aligned(kv, self.current)


class RowXs:
    """One sequence's XsRolling slot: row `row` of the batch's `ring` and `comp` (None before
    the first append) and the row's `tokens` and `base` as host integers; the batch's
    geometry (`ratio`, `span`, `window`, `margin`, `max_seq_len`, `dim`, `device`)."""

    kind = XS

    def __init__(self, geometry: XsRolling, ring, comp, row: int, tokens: int, base: int) -> None:
        self.geometry, self.ring, self.comp, self.row = geometry, ring, comp, row
        self.tokens, self.base = tokens, base

    @property
    def current_seq_len(self) -> int:
        return self.tokens

    def supports_per_sequence_len(self, xs_per_seq: bool = False) -> bool:
        return bool(xs_per_seq)

    def clone(self) -> RowXs:
        return RowXs(self.geometry, self.ring, self.comp, self.row, self.tokens, self.base)

    def try_set_len(self, length: int) -> None:
        require(length >= 0, f"set_len length {length} must be >= 0")
        g = self.geometry
        refusal = rollback_refusal(0, length, self.tokens, self.base, g.ratio, g.span, g.window)
        if refusal is not None:
            raise refusal

    def set_len(self, length: int) -> None:
        """A one-row slot's rollback (the reference's refusals, then `tokens = length`)."""
        self.try_set_len(length)
        self.tokens = int(length)

    def as_slot(self) -> XsRolling:
        """This row as a one-row port `XsRolling` (conformance views)."""
        g = self.geometry
        out = XsRolling(g.ratio, g.span, g.window, g.max_seq_len, 1, g.dim, g.margin, g.device)
        out.tokens, out.base = [self.tokens], [self.base]  # host integers: a host copy kept
        if self.ring is not None:
            out.ring, out.comp = (
                self.ring[self.row : self.row + 1],
                self.comp[self.row : self.row + 1],
            )
        return out


def xs_rows(slot: XsRolling) -> list[RowXs]:
    """`XsRolling.split_rows` as handles (the rows' tokens and bases from the slot's host
    copies; read from the device only when they were computed there)."""
    tokens, base = slot.host_tokens().tolist(), slot.host_base().tolist()
    return [RowXs(slot, slot.ring, slot.comp, i, int(t), int(base[i]))
            for i, t in enumerate(tokens)]


# --- clone-in: handles back into one batch -------------------------------------------------------


def _source_rows(parts: list) -> tuple[list, list[np.ndarray], list[np.ndarray]]:
    """The distinct source buffers of `parts` (by identity, first appearance first), and for
    each the positions in `parts` and the source rows (host)."""
    sources, pos, rows, where = [], [], [], {}
    for p, part in enumerate(parts):
        key = id(part.k if isinstance(part, RowKv) else part.ring)
        if key not in where:
            where[key] = len(sources)
            sources.append(part)
            pos.append([])
            rows.append([])
        pos[where[key]].append(p)
        rows[where[key]].append(part.row)
    return (
        sources,
        [np.asarray(x, dtype=np.int64) for x in pos],
        [np.asarray(x, dtype=np.int64) for x in rows],
    )


def _gather(
    buffers: list[torch.Tensor], pos: list[np.ndarray], rows: list[np.ndarray], n: int, seq_dim: int
) -> torch.Tensor:
    """Rows `rows[s]` of `buffers[s]` placed at `pos[s]` of an n-row batch (each buffer padded
    to the widest along `seq_dim`): one `index_select` per source, one `cat`, and one
    permutation when the sources interleave."""
    width = max(b.shape[seq_dim] for b in buffers)
    dev = buffers[0].device
    pieces = []
    for buf, r in zip(buffers, rows, strict=True):
        if buf.shape[seq_dim] < width:
            pad = [0, 0] * (buf.dim() - 1 - seq_dim) + [0, width - buf.shape[seq_dim]]
            buf = torch.nn.functional.pad(buf, pad)
        whole = r.size == buf.shape[0] and (r == np.arange(r.size)).all()
        pieces.append(buf if whole else buf.index_select(0, torch.from_numpy(r).to(dev)))
    out = pieces[0] if len(pieces) == 1 else torch.cat(pieces)
    order = np.concatenate(pos)
    if not (order == np.arange(n)).all():
        out = out.index_select(0, torch.from_numpy(np.argsort(order)).to(dev))
    return out


def stack_kv(parts: list) -> TorchKv:
    """`concat_kv` of handles (or batched slots, taken row by row): the rows stacked, the
    capacity of the widest, the length of the first (after the reference's alignment they
    share it). ValueError on mixed materialization or unequal lengths."""
    rows = [r for p in parts for r in (p.rows() if isinstance(p, TorchKv) else [p])]
    require(len(rows) > 0, "concat_kv needs at least one slot")
    first = rows[0]
    cap = max(r.capacity for r in rows)
    mat = [r.materialized for r in rows]
    require(all(mat) or not any(mat), "cannot concatenate materialized and unmaterialized slots")
    if not any(mat):
        return TorchKv(first.max_seq_len, cap, first.current)
    if any(r.current != first.current for r in rows):
        raise ValueError(
            f"the port concatenates slots of one length only, got {[r.current for r in rows]}"
        )
    lead = np.fromiter((r.lead for r in rows), np.int64, len(rows))
    shift = np.fromiter((r.shift for r in rows), np.int64, len(rows))
    own = first.current - lead
    sources, pos, idx = _source_rows(rows)
    n = len(rows)
    if len(sources) == 1 and (idx[0] == np.arange(n)).all() and sources[0].k.shape[0] == n:
        concat_stats["view"] += 1
        k, v = sources[0].k, sources[0].v
    else:
        concat_stats["copy"] += 1
        k = _gather([s.k for s in sources], pos, idx, n, 2)
        v = _gather([s.v for s in sources], pos, idx, n, 2)
    if shift.any():
        kv = shift_rows(k, v, own + shift, -shift, first.max_seq_len)
    else:
        kv = RaggedKv(k, v, np.zeros(n, dtype=np.int64), first.max_seq_len)
        grow_physical(kv, int(own.max()))
        kv.lens = own
    return TorchKv(first.max_seq_len, cap, first.current, kv, lead)


def stack_xs(parts: list, reconcile_bases: bool = False) -> XsRolling:
    """`XsRolling.stack` of handles (or batched slots, row by row): own tokens and bases,
    comp zero-padded to the widest; `reconcile_bases` gives every row the largest base (needs
    uniform tokens). The reference's ValueErrors."""
    rows = [r for p in parts for r in (xs_rows(p) if isinstance(p, XsRolling) else [p])]
    require(len(rows) > 0, "stack needs at least one xs slot")
    g0 = rows[0].geometry
    for r in rows:
        g = r.geometry
        require(
            (g.ratio, g.span, g.window, g.margin) == (g0.ratio, g0.span, g0.window, g0.margin),
            "xs slots in one layer must share ratio, span, window and margin",
        )
    tokens = host_ints([r.tokens for r in rows])
    base = host_ints([r.base for r in rows])
    if reconcile_bases:
        if (tokens != tokens[0]).any():
            raise ValueError(f"reconciling xs bases needs uniform tokens, got {tokens.tolist()}")
        base = np.full_like(base, base.max())
    out = XsRolling(g0.ratio, g0.span, g0.window, g0.max_seq_len, 0, g0.dim, g0.margin, g0.device)
    out.tokens, out.base = tokens, base  # host integers: the slot keeps a host copy
    live = [r for r in rows if r.ring is not None]
    dims = {r.ring.shape[2] for r in live}
    require(len(dims) <= 1, f"xs slots with hidden widths {sorted(dims)} cannot be stacked")
    if live:
        like = live[0]
        for i, r in enumerate(rows):  # a row never appended to: a zero row, as the reference's
            if r.ring is None:
                rows[i] = r.clone()
                rows[i].ring = like.ring.new_zeros((1, *like.ring.shape[1:]))
                rows[i].comp = like.comp.new_zeros((1, 0, like.comp.shape[2]))
                rows[i].row = 0
        sources, pos, idx = _source_rows(rows)
        n = len(rows)
        out.ring = _gather([s.ring for s in sources], pos, idx, n, 1)
        out.comp = _gather([s.comp for s in sources], pos, idx, n, 1)
        out.dim = dims.pop()
    return out


def stack_layer(slots: list, layer: int, xs_per_seq: bool):
    """`reference.align`'s step (5) on port slots: one batched slot per layer."""
    kinds = {s.kind for s in slots}
    require(len(kinds) == 1, f"layer {layer} mixes slot kinds {sorted(kinds)}")
    return stack_kv(slots) if slots[0].kind == NORMAL else stack_xs(slots, not xs_per_seq)


__all__ = [
    "NORMAL",
    "XS",
    "KvMeta",
    "RowKv",
    "RowXs",
    "TorchKv",
    "concat_stats",
    "grow_physical",
    "shift_rows",
    "stack_kv",
    "stack_layer",
    "stack_xs",
    "xs_rows",
]
