"""`RaggedKv`: the port's physical KV layout (the port of `reference.cache`'s K/V slot).

One K and one V buffer `[B, H, capacity, D]` per layer plus `lens [B]`, each row's own
length: row i keeps its KV in place, start-anchored, and nothing is ever shifted (append
scatters at `lens[i]`, rollback and commit change `lens` only, front alignment is an index
map). The layout's rules, the measured reason for it, the capacity rule and what is not
modelled: docs/conformance.md, section "gpu/cache.py".
"""

from __future__ import annotations

import numpy as np
import torch

from raggedspec.gpu._common import (
    arange_like,
    as_list,
    host_ints,
    lengths_like,
    zeros_on,
)
from raggedspec.reference.cache import (
    PLAIN_CACHE_CAPACITY,
    block_capacity,
    grown_capacity,
    set_len_refusal,
)
from raggedspec.reference.errors import require


class RaggedKv:
    """K/V buffers `[B, H, capacity, D]` (V may have its own last dim) and own lengths
    `lens [B]`. Invariant: `0 <= lens[i] <= capacity`; row i's position p at column p.

    The lengths live on the device (`lens`, what kernels index with) and, whenever they were
    set from host integers, also on the host (`host_lens()`): the step path decides growth,
    windows and refusals on the host copy, so it reads the device only when a length was
    computed there (then once, and the copy is kept). Assigning `lens` a tensor forgets the
    host copy; assigning host integers keeps them on the host, uploaded on the first read."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor, lens, max_seq_len: int) -> None:
        """Lengths given as host integers (a list or NumPy array) are checked on the host and
        copied to the device once; a device tensor is checked by reading it (a constructor's
        check, off the step path)."""
        self.k, self.v, self.max_seq_len = k, v, max_seq_len
        require(self.k.dim() == 4 and self.v.dim() == 4 and self.k.shape[:3] == self.v.shape[:3],
                f"k {list(self.k.shape)} and v {list(self.v.shape)} must be [B,H,capacity,*]")
        if not isinstance(lens, torch.Tensor):
            host = host_ints(lens)
            if host.size != self.k.shape[0]:
                raise ValueError(f"{host.size} lengths for {self.k.shape[0]} rows")
            if host.size and (host.min() < 0 or host.max() > self.capacity):
                raise ValueError(f"lens {host.tolist()} must lie in [0, capacity {self.capacity}]")
            self.lens = host
            return
        lens = lengths_like(lens, self.k, name="lens")
        require(
            lens.numel() == self.k.shape[0], f"{lens.numel()} lengths for {self.k.shape[0]} rows"
        )
        require(not bool((lens < 0).any() or (lens > self.capacity).any()),
                f"lens {as_list(lens)} must lie in [0, capacity {self.capacity}]")
        self.lens = lens

    @property
    def lens(self) -> torch.Tensor:
        """The device lengths; set from host integers, they are uploaded on the first read
        (lengths set again before any read are never uploaded)."""
        if self._dev is None:
            self._dev = torch.from_numpy(self._host.copy()).to(self.k.device)
        return self._dev

    @lens.setter
    def lens(self, value) -> None:
        if isinstance(value, torch.Tensor):
            self._dev, self._host = value, None
        else:
            self._host = np.array(value, dtype=np.int64).reshape(-1)
            self._dev = None

    def pending_upload(self) -> np.ndarray | None:
        """The host lengths while their device copy is not made yet (uploaded on the next
        read of `lens`, or given by `adopt_device_lens`); None once it exists."""
        return self._host if self._dev is None else None

    def adopt_device_lens(self, host: np.ndarray, dev: torch.Tensor) -> None:
        """`dev` (the integers `host`, already on the device: a slice of the step plan's
        upload, never written in place here) becomes the device copy when the lengths are
        known on the host, equal to `host` and not uploaded yet; otherwise nothing changes."""
        if self._dev is None and self._host is not None and np.array_equal(self._host, host):
            self._dev = dev

    def known_host_lens(self) -> np.ndarray | None:
        """The lengths as host integers when the host knows them (no device read), else None.
        The caller must not modify the array."""
        return self._host

    def host_lens(self) -> np.ndarray:
        """The lengths as host integers (read from the device once if they were computed
        there). The caller must not modify the array."""
        if self._host is None:
            self._host = host_ints(self._dev)
        return self._host

    def set_row_len(self, row: int, n: int) -> None:
        """Row `row`'s length to `n` (host and device)."""
        host = self.host_lens().copy()
        host[row] = n
        self.lens = host

    @staticmethod
    def empty(b: int, heads: int, dim: int, max_seq_len: int, capacity: int = PLAIN_CACHE_CAPACITY,
              dtype: torch.dtype = torch.float64, device: torch.device | str | None = None,
              v_dim: int | None = None) -> RaggedKv:
        """B empty rows of `capacity` zero columns (lengths known on the host: zeros)."""
        k = zeros_on((b, heads, capacity, dim), dtype, device)
        v = zeros_on((b, heads, capacity, dim if v_dim is None else v_dim), dtype, device)
        return RaggedKv(k, v, [0] * b, max_seq_len)

    @staticmethod
    def from_rows(ks: list[torch.Tensor], vs: list[torch.Tensor], max_seq_len: int,
                  capacity: int | None = None) -> RaggedKv:
        """Rows `ks[i] [H, n_i, D]` (and `vs[i]`) placed at column 0 of one buffer of width
        `capacity` (default: the smallest `512 + k*512` holding the longest row). A
        constructor (not a hot path): it loops over the rows once; the lengths are known on
        the host."""
        require(
            len(ks) == len(vs) and len(ks) > 0, "from_rows needs as many K rows as V rows, >= 1"
        )
        n = [int(k.shape[1]) for k in ks]
        if capacity is None:
            capacity = block_capacity(PLAIN_CACHE_CAPACITY, max(n))
        require(max(n) <= capacity, f"a row of {max(n)} does not fit capacity {capacity}")
        h, d, dv = ks[0].shape[0], ks[0].shape[2], vs[0].shape[2]
        kv = RaggedKv.empty(len(ks), h, d, max_seq_len, capacity, ks[0].dtype, ks[0].device, dv)
        for i, k in enumerate(ks):
            kv.k[i, :, : n[i]] = k
            kv.v[i, :, : n[i]] = vs[i]
        kv.lens = n
        return kv

    @property
    def batch(self) -> int:
        return self.k.shape[0]

    @property
    def capacity(self) -> int:
        return self.k.shape[2]

    def row(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Row i's live run `(k [H, lens[i], D], v)` (views)."""
        n = int(self.lens[i])
        return self.k[i, :, :n], self.v[i, :, :n]

    def _grow_to(self, needed: int) -> None:
        """Grow by whole 512-column blocks to hold `needed` columns; CacheRefusal ("kv-cache
        capacity ... above max_seq_len") as `SingleCache.append`."""
        if needed <= self.capacity:
            return
        pad = grown_capacity(self.capacity, 0, needed, self.max_seq_len) - self.capacity
        self.k = torch.nn.functional.pad(self.k, (0, 0, 0, pad))
        self.v = torch.nn.functional.pad(self.v, (0, 0, 0, pad))

    def append(
        self, k_new: torch.Tensor, v_new: torch.Tensor, rows: torch.Tensor | None = None,
        dev_rows: torch.Tensor | None = None,
    ) -> None:
        """Write `k_new, v_new [B', H, t, *]` at each row's own offset `lens[i]` (one scatter
        per buffer) and advance `lens` by t. `rows` (int64 `[B']`, distinct) restricts the
        append to a subset of rows (a draft group), in place in the shared buffers;
        `dev_rows`, the same rows already on the device, is read instead of an upload.
        Refusals: capacity growth above `max_seq_len` (CacheRefusal), before any write."""
        idx = arange_like(self.batch, self.k) if rows is None \
            else dev_rows if dev_rows is not None else lengths_like(rows, self.k, name="rows")
        require(k_new.dim() == 4 and v_new.dim() == 4 and k_new.shape[0] == idx.numel()
                and k_new.shape[:3] == v_new.shape[:3] and k_new.shape[1] == self.k.shape[1]
                and k_new.shape[3] == self.k.shape[3] and v_new.shape[3] == self.v.shape[3],
                f"append of k {list(k_new.shape)}, v {list(v_new.shape)} to rows {idx.numel()} of "
                f"k {list(self.k.shape)}, v {list(self.v.shape)}")
        t = k_new.shape[2]
        if t == 0 or idx.numel() == 0:
            return
        # the addressed rows on the host (None: given as a device tensor, not read here)
        host_rows = np.arange(self.batch) if rows is None else \
            None if isinstance(rows, torch.Tensor) else host_ints(rows)
        known = self._host is not None and host_rows is not None
        start = self.lens[idx]
        self._grow_to((int(self._host[host_rows].max()) if known else int(start.max())) + t)
        cols = start[:, None] + arange_like(t, self.k)[None, :]      # [B', t]
        r = idx[:, None].expand(-1, t)
        # one advanced-index write per buffer: [B', t] (row, column) pairs, all heads at once
        self.k.permute(0, 2, 1, 3)[r, cols] = k_new.to(self.k.dtype).permute(0, 2, 1, 3)
        self.v.permute(0, 2, 1, 3)[r, cols] = v_new.to(self.v.dtype).permute(0, 2, 1, 3)
        lens = self.lens.index_add(0, idx, torch.full_like(idx, t))
        if known:
            host = self._host.copy()
            host[host_rows] += t  # the rows are distinct
            self._dev, self._host = lens, host
        else:
            self.lens = lens

    def set_len(self, lens) -> None:
        """Per-row lengths (grow into slack or shrink); no tensor data is touched. Refused
        (CacheRefusal, first offending row's value named as `SingleCache.try_set_len`
        names it) past the capacity. ValueError on a wrong count or a negative length."""
        if not isinstance(lens, torch.Tensor):  # host integers: checked on the host
            host = host_ints(lens)
            if host.size != self.batch:
                raise ValueError(f"{host.size} lengths for a batch of {self.batch}")
            if (host < 0).any():
                raise ValueError(f"set_len lengths {host.tolist()} must be >= 0")
            over = np.flatnonzero(host > self.capacity)
            if over.size:
                raise set_len_refusal(int(host[over[0]]), 0, self.capacity)
            self.lens = host
            return
        lens = lengths_like(lens, self.k, name="lens")
        require(lens.numel() == self.batch, f"{lens.numel()} lengths for a batch of {self.batch}")
        require(not bool((lens < 0).any()), f"set_len lengths {as_list(lens)} must be >= 0")
        over = lens > self.capacity
        if bool(over.any()):
            raise set_len_refusal(int(lens[over.nonzero()[0, 0]]), 0, self.capacity)
        self.lens = lens

    def commit_per_sequence(self, cache_lens, committed) -> None:
        """Per-sequence commit: row i's length becomes `cache_lens[i] + committed[i]` (its
        own, never the padded width). The reference's dead-prefix strip has nothing to do
        in this layout. Refusals: those of `set_len`."""
        c = lengths_like(cache_lens, self.k, name="cache_lens")
        m = lengths_like(committed, self.k, name="committed")
        require(not bool((c < 0).any() or (m < 0).any()), "cache_lens and committed must be >= 0")
        self.set_len(c + m)

    def clone(self) -> RaggedKv:
        return RaggedKv(
            self.k.clone(),
            self.v.clone(),
            self._dev.clone() if self._host is None else self._host,
            self.max_seq_len,
        )

