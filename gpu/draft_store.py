"""The pooled draft KV: every sequence's draft KV is a row of one buffer (`DraftStore`), and
a sequence holds a `PoolKv` handle (its row index and the reference's metadata as host
integers). A draft group is then a row-index vector into one buffer: the group loop
(`gpu.draft_loop`) aligns, drafts and strips without copying KV.
"""

from __future__ import annotations

import weakref

import numpy as np
import torch

from raggedspec.gpu.cache import RaggedKv
from raggedspec.gpu.slots import KvMeta, grow_physical
from raggedspec.reference.cache import DRAFT_CACHE_CAPACITY


class DraftStore:
    """The draft KV of every sequence of one backend (per MTP KV-head count and head width) in
    ONE physical `RaggedKv` `[S, n_kv_heads, width, head_dim]` (the `gpu.draft.DraftPool`
    layout): row s is a
    sequence's draft KV, start-anchored, `kv.lens[s]` its held length. Rows are allocated by
    `alloc` (zeroed; the row count doubles when full) and returned by the handle's finalizer.
    The physical width grows by whole 512-column blocks and is never refused (refusals are the
    handles' host metadata)."""

    def __init__(self, head_dim: int, dtype: torch.dtype, device: torch.device,
                 n_kv_heads: int = 1) -> None:
        self.kv = RaggedKv.empty(
            0, n_kv_heads, head_dim, 1 << 62, DRAFT_CACHE_CAPACITY, dtype, device
        )
        self.free: list[int] = []

    def alloc(self) -> int:
        if not self.free:
            s = self.kv.batch
            grow = max(s, 8)
            pad = (0, 0, 0, 0, 0, 0, 0, grow)
            self.kv.k = torch.nn.functional.pad(self.kv.k, pad)
            self.kv.v = torch.nn.functional.pad(self.kv.v, pad)
            self.kv.lens = np.pad(self.kv.host_lens(), (0, grow))  # int64, the new rows 0
            self.free = list(range(s + grow - 1, s - 1, -1))
        idx = self.free.pop()
        self.kv.k[idx].zero_()
        self.kv.v[idx].zero_()
        self.kv.set_row_len(idx, 0)
        return idx

    def release(self, idx: int) -> None:
        self.free.append(idx)

    def reserve(self, width: int) -> None:
        """Make every row hold `width` physical columns (never refused)."""
        grow_physical(self.kv, width)


class PoolKv(KvMeta):
    """One sequence's draft KV: row `idx` of a `DraftStore`, with the reference's metadata as
    host integers (`current` = the held length = `store.kv.lens[idx]` once materialized).
    Invariant: no alignment offset (a draft row is always start-anchored)."""

    def __init__(
        self, store: DraftStore, max_seq_len: int, capacity: int = DRAFT_CACHE_CAPACITY
    ) -> None:
        super().__init__(max_seq_len, capacity, 0)
        self.store, self.idx = store, store.alloc()
        self.materialized = False
        weakref.finalize(self, store.release, self.idx)

    def set_len(self, n: int) -> None:
        """`KvCache.set_len`: refused past the capacity; the row's length only."""
        self.try_set_len(n)
        if self.materialized:
            self.store.reserve(n)
            self.store.kv.set_row_len(self.idx, n)
        self.current = n

    def front_aligned(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The reference's `current_data()` `[1, Hk, current, D]` (views of the pool row)."""
        if not self.materialized:
            return None
        kv = self.store.kv
        return kv.k[self.idx : self.idx + 1, :, : self.current], kv.v[
            self.idx : self.idx + 1, :, : self.current
        ]


__all__ = ["DraftStore", "PoolKv"]
