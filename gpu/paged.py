"""The paged-KV layout of the port: K and V in fixed-size pages, one block table per row.

A `PageStore` holds every page of one geometry (`[pages, H, page_size, D]` for K, the same
for V); page 0 is a zero page nothing writes. A `PagedRaggedKv` is a batch of rows over one
store, with the interface of `gpu.cache.RaggedKv` (`k`, `v`, `lens`, `host_lens`, `append`,
`capacity`, `batch`), so the port's attention and model run on it unchanged. Row i's view is
`zlead_i` zero columns, then its logical columns from `start_i` on, where logical column c
lives in page `table[i, c // P]` at offset `c % P`. Every table, start, zero-lead and length
is a host integer.

Only `PageStore.write` writes K/V bytes, and only an append calls it. Rollback and commit
(`set_len`) change the lengths; a dead-prefix strip advances `start` (a table offset); a
front alignment grows the slot's lead (an offset); zeros a forward needs in front of a row
(`bake`) grow `zlead`; clone-out and clone-in copy table rows. Pages are shared between a
batch, its row handles and the batches stacked from them. Every page has one owner, the
only batch that writes into it in place: the batch that allocated it, until a clone-in
stacks the row into a new batch, which takes over the row's pages (as a per-sequence engine
hands a sequence's blocks to the step's batch). An append that lands in a page another
batch owns first copies that page's live prefix into a fresh page (copy on write, counted
as an append); a `clone` owns nothing, so the original and the clone each copy.
Pages are never freed. The attention reads a row through its table by one gather of the
view (`k`, `v`, cached until the next change). docs/kernels.md "Paged KV" has the detail.
"""

from __future__ import annotations

import itertools

import numpy as np
import torch

from raggedspec.gpu._common import on_device_of, zeros_on
from raggedspec.reference.errors import require

_IDS = itertools.count(1)


class PageStore:
    """Pages of K `[N, H, P, D]` and V `[N, H, P, Dv]`, `owner[N]` (the id of the batch that
    may write a page; -1 for the zero page 0). `moved` counts the K/V bytes written
    (`write`: appends and copies on write) and copied by growing the store (`grow`).
    Invariant: page 0 stays zero; only `write` and `_grow` touch the tensors."""

    def __init__(self, heads: int, dim: int, v_dim: int, page_size: int, dtype: torch.dtype,
                 device: torch.device | str | None) -> None:
        require(page_size >= 1, f"page_size {page_size} must be >= 1")
        self.page_size, self.dtype, self.device = int(page_size), dtype, device
        self.k = zeros_on((4, heads, page_size, dim), dtype, device)
        self.v = zeros_on((4, heads, page_size, v_dim), dtype, device)
        self.owner = np.full(4, -1, dtype=np.int64)
        self.used = 1
        self.moved = {"write": 0, "grow": 0}

    def _grow(self, needed: int) -> None:
        """Room for `needed` pages: a store of n < needed pages grows to max(needed, 2 n)
        (at least doubling: amortized copies), the used pages' bytes counted as "grow"."""
        n = self.k.shape[0]
        if needed <= n:
            return
        new = max(needed, 2 * n)
        self.moved["grow"] += self.k[: self.used].nbytes + self.v[: self.used].nbytes
        self.k = torch.cat([self.k, self.k.new_zeros((new - n, *self.k.shape[1:]))])
        self.v = torch.cat([self.v, self.v.new_zeros((new - n, *self.v.shape[1:]))])
        self.owner = np.concatenate([self.owner, np.full(new - n, -1, dtype=np.int64)])

    def reserve(self, count: int) -> None:
        """Room for `count` more pages (a growth now rather than inside a later append)."""
        self._grow(self.used + count)

    def alloc(self, count: int, owner: int) -> np.ndarray:
        """`count` fresh pages owned by `owner` (their contents are stale: only columns a
        write filled are ever read unmasked)."""
        self._grow(self.used + count)
        pages = np.arange(self.used, self.used + count, dtype=np.int64)
        self.owner[pages] = owner
        self.used += count
        return pages

    def write(self, pages: np.ndarray, offs: np.ndarray, k: torch.Tensor, v: torch.Tensor) -> None:
        """Columns `k[m] [H, D]` (and `v[m]`) into page `pages[m]` at offset `offs[m]`: the
        only K/V write. Refused (ValueError) into the zero page."""
        require(not (pages == 0).any(), "a write into the zero page")
        p = on_device_of(torch.from_numpy(pages), self.k)
        o = on_device_of(torch.from_numpy(offs), self.k)
        self.k.permute(0, 2, 1, 3)[p, o] = k.to(self.dtype)
        self.v.permute(0, 2, 1, 3)[p, o] = v.to(self.dtype)
        self.moved["write"] += k.to(self.dtype).nbytes + v.to(self.dtype).nbytes

    def read(self, pages: np.ndarray, offs: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """Columns at `(pages, offs)` (any shape S) as `(k [*S, H, D], v [*S, H, Dv])`."""
        p = on_device_of(torch.from_numpy(pages), self.k)
        o = on_device_of(torch.from_numpy(offs), self.k)
        return self.k.permute(0, 2, 1, 3)[p, o], self.v.permute(0, 2, 1, 3)[p, o]


class PagedRaggedKv:
    """B rows over a `PageStore` (module docstring): `table [B, W]`, `start [B]`, `zlead [B]`
    and the rows' view lengths, all host int64; `width` the view's column count (grown in
    whole pages, never refused: refusals are the slot's metadata). Invariant: row i's view
    column j < lens_i is zero for j < zlead_i, else logical column `start_i + j - zlead_i`."""

    def __init__(self, store: PageStore, table, start, zlead, lens, width: int,
                 max_seq_len: int) -> None:
        self.store, self.max_seq_len = store, int(max_seq_len)
        self.table = np.asarray(table, dtype=np.int64).reshape(len(start), -1).copy()
        self.start = np.asarray(start, dtype=np.int64).copy()
        self.zlead = np.asarray(zlead, dtype=np.int64).copy()
        self.width = int(width)
        self.id = next(_IDS)
        self._view = None
        self.lens = lens

    @staticmethod
    def empty(store: PageStore, b: int, max_seq_len: int) -> PagedRaggedKv:
        """B empty rows (no pages)."""
        z = [0] * b
        return PagedRaggedKv(store, np.zeros((b, 0)), z, z, z, 0, max_seq_len)

    # --- the RaggedKv interface the port's model and attention use
    @property
    def lens(self) -> torch.Tensor:
        return self._lens

    @lens.setter
    def lens(self, value) -> None:
        if isinstance(value, torch.Tensor):
            value = value.tolist()
        host = np.array(value, dtype=np.int64).reshape(-1)
        require(host.size == self.batch, f"{host.size} lengths for {self.batch} rows")
        require(not host.size or (host.min() >= 0 and host.max() <= self.capacity),
                f"lens {host.tolist()} must lie in [0, capacity {self.capacity}]")
        self._host = host
        self._lens = on_device_of(torch.from_numpy(host.copy()), self.store.k)

    def host_lens(self) -> np.ndarray:
        return self._host

    @property
    def batch(self) -> int:
        return self.start.shape[0]

    @property
    def capacity(self) -> int:
        return self.width

    def reserve(self, needed: int) -> None:
        """The view at least `needed` columns wide (whole pages; no bytes move)."""
        p = self.store.page_size
        if needed > self.width:
            self.width = -(-needed // p) * p
            self._view = None

    def _locate(self, rows: np.ndarray, cols: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(page, offset) of view columns `cols [R, C]` of `rows [R]`; the zero page where
        the column is a zero lead or past the table."""
        p = self.store.page_size
        logical = self.start[rows][:, None] + cols - self.zlead[rows][:, None]
        slot = logical // p
        inside = (cols >= self.zlead[rows][:, None]) & (slot < self.table.shape[1]) & (logical >= 0)
        tab = self.table[rows]
        if tab.shape[1] == 0:
            page = np.zeros(cols.shape, dtype=np.int64)
        else:
            page = np.where(inside, np.take_along_axis(tab, np.where(inside, slot, 0), axis=1), 0)
        return page, np.where(inside, logical % p, 0).astype(np.int64)

    def _gather_view(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._view is None:
            rows = np.arange(self.batch)
            cols = np.broadcast_to(np.arange(self.width), (self.batch, self.width))
            page, off = self._locate(rows, cols)
            k, v = self.store.read(page, off)               # [B, W, H, D]
            self._view = (k.permute(0, 2, 1, 3), v.permute(0, 2, 1, 3))
        return self._view

    @property
    def k(self) -> torch.Tensor:
        """The rows' views `[B, H, width, D]`, read through the block table (one gather)."""
        return self._gather_view()[0]

    @property
    def v(self) -> torch.Tensor:
        return self._gather_view()[1]

    def append(self, k_new: torch.Tensor, v_new: torch.Tensor, rows=None, dev_rows=None) -> None:
        """Write `k_new, v_new [B', H, t, *]` at each row's view column `lens_i` and advance
        the lengths by t: pages allocated as needed; a page this batch does not own gets a
        copy of its live prefix first. `rows` (host ints, distinct) restricts it to rows
        (`dev_rows`, the same on the device, is not needed: the pages are chosen on the host)."""
        idx = np.arange(self.batch) if rows is None else np.asarray(
            rows.tolist() if isinstance(rows, torch.Tensor) else rows, dtype=np.int64).ravel()
        require(k_new.dim() == 4 and k_new.shape[0] == idx.size
                and k_new.shape[:3] == v_new.shape[:3],
                f"append of k {list(k_new.shape)} to {idx.size} rows")
        t = k_new.shape[2]
        if t == 0 or idx.size == 0:
            return
        self._make_writable(idx, t)
        cols = self._host[idx][:, None] + np.arange(t)[None, :]
        page, off = self._locate(idx, cols)
        self.store.write(page.ravel(), off.ravel(),
                         k_new.permute(0, 2, 1, 3).reshape(-1, *k_new.shape[1:2], k_new.shape[3]),
                         v_new.permute(0, 2, 1, 3).reshape(-1, *v_new.shape[1:2], v_new.shape[3]))
        host = self._host.copy()
        host[idx] += t
        self.reserve(int(host.max()))
        self.lens = host
        self._view = None

    def _make_writable(self, idx: np.ndarray, t: int) -> None:
        """Every page rows `idx` write `t` columns into is owned by this batch: a row whose
        fresh pages past the table; a shared page is replaced by a copy of its prefix. A
        zero lead past a row's length is slack and shrinks to it first."""
        p, store = self.store.page_size, self.store
        self.zlead[idx] = np.minimum(self.zlead[idx], self._host[idx])  # slack past lens
        for i in idx.tolist():
            n = int(self._host[i])
            # logical columns this row writes: [start + n - zlead, + t)
            lo = int(self.start[i] + n - self.zlead[i])
            hi = lo + t
            if lo < 0:  # the write lands inside the zero lead: never (appends go past lens)
                raise ValueError(f"row {i}: append at logical column {lo}")
            need = -(-hi // p)
            if need > self.table.shape[1]:
                self.table = np.concatenate(
                    [self.table, np.zeros((self.batch, need - self.table.shape[1]), np.int64)],
                    axis=1)
            for s in range(lo // p, need):
                page = int(self.table[i, s])
                if page != 0 and store.owner[page] == self.id:
                    continue
                fresh = int(store.alloc(1, self.id)[0])
                keep = max(0, min(lo - s * p, p))  # the live prefix of this page
                if page != 0 and keep:
                    k, v = store.read(np.full(keep, page), np.arange(keep))
                    store.write(np.full(keep, fresh), np.arange(keep), k.clone(), v.clone())
                self.table[i, s] = fresh

    def clone(self) -> PagedRaggedKv:
        """The same pages; both this batch and the clone take new ids, so neither owns a
        shared page and each copies before writing into one (a clone is independent)."""
        self.id = next(_IDS)
        return PagedRaggedKv(self.store, self.table, self.start, self.zlead, self._host,
                             self.width, self.max_seq_len)

    # --- the table updates that replace the dense layout's data moves
    def advance(self, cut: np.ndarray) -> None:
        """Drop the first `cut_i` view columns of every row (zero lead first, then `start`
        moves on): a table offset, no bytes move."""
        cut = np.asarray(cut, dtype=np.int64)
        from_zeros = np.minimum(cut, self.zlead)
        self.zlead = self.zlead - from_zeros
        self.start = self.start + (cut - from_zeros)
        self._view = None
        self.lens = self._host - cut

    def prepend_zeros(self, extra: np.ndarray) -> None:
        """`extra_i` zero columns in front of row i (the zero lead grows; no bytes move)."""
        extra = np.asarray(extra, dtype=np.int64)
        self.zlead = self.zlead + extra
        self._view = None
        host = self._host + extra
        self.reserve(int(host.max()))  # a batch has at least one row
        self.lens = host


def stack_rows(parts: list[tuple[PagedRaggedKv, int, int]], lens: np.ndarray,
               max_seq_len: int) -> PagedRaggedKv:
    """A batch whose row r is row `parts[r][1]` of `parts[r][0]` with its first
    `parts[r][2]` view columns dropped, of length `lens[r]`: table rows copied (no K/V bytes
    move); the pages a source batch owned in those rows pass to the new batch. ValueError
    when the rows come from different stores."""
    stores = {id(kv.store) for kv, _, _ in parts}
    require(len(stores) == 1, f"rows from {len(stores)} page stores cannot be stacked")
    store = parts[0][0].store
    w = max(kv.table.shape[1] for kv, _, _ in parts)
    table = np.zeros((len(parts), w), dtype=np.int64)
    start = np.zeros(len(parts), dtype=np.int64)
    zlead = np.zeros(len(parts), dtype=np.int64)
    for r, (kv, row, shift) in enumerate(parts):
        table[r, : kv.table.shape[1]] = kv.table[row]
        z = int(kv.zlead[row])
        zlead[r] = max(z - shift, 0)
        start[r] = kv.start[row] + max(shift - z, 0)
    p = store.page_size
    width = max([kv.width for kv, _, _ in parts] + [int(n) for n in lens])
    out = PagedRaggedKv(store, table, start, zlead, lens, -(-width // p) * p, max_seq_len)
    for kv, row, _ in parts:  # the new batch takes over the rows' pages
        pages = kv.table[row][kv.table[row] != 0]
        store.owner[pages[store.owner[pages] == kv.id]] = out.id
    return out


__all__ = ["PageStore", "PagedRaggedKv", "stack_rows"]
