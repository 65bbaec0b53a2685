"""KV cache: `SingleCache`, the K/V pair `KvCache`, and the per-layer list `NormalCache`.

Spec: cache-and-draft.md §3. Tensors are `[B, H, S, D]` float64; the sequence axis is 2.
All rows of one `SingleCache` share one `current_seq_len`: that single write offset is why
ragged rows must be front-aligned before they can share a cache.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from raggedspec.reference.errors import CacheRefusal, require

CACHE_GROW_SIZE = 512
WINDOW_COMPACTION = 128
DRAFT_CACHE_CAPACITY = 16
PLAIN_CACHE_CAPACITY = 512
SEQ_DIM = 2


def window_target_first_cached(length: int, retain: int) -> int:
    """Where a windowed slot's physical column 0 should sit: `sat(len - retain)` rounded
    down to a multiple of 128. Invariant: `length - result >= retain` (never fewer than
    `retain` positions kept) and the result is 128-aligned.  `wtfc(300, 144) == 128`."""
    require(length >= 0 and retain >= 0, f"length {length} and retain {retain} must be >= 0")
    over = max(length - retain, 0)
    return over - over % WINDOW_COMPACTION


def block_capacity(capacity, needed):
    """The smallest `capacity + k * 512` (k >= 0) holding `needed` columns: `capacity` when
    they fit, else grown by whole 512-column blocks covering the shortfall. The one rounding
    of cache growth (the reference's slots, the port's buffers, the lengths mode's arrays):
    integers give an int, NumPy arrays an array (elementwise). Never refuses."""
    short = np.maximum(np.asarray(needed) - np.asarray(capacity), 0)
    grown = np.asarray(capacity) + -(-short // CACHE_GROW_SIZE) * CACHE_GROW_SIZE
    return int(grown) if grown.ndim == 0 else grown


def _above_max_seq_len(grown: int, max_seq_len: int) -> CacheRefusal:
    return CacheRefusal(f"kv-cache capacity {grown} would be above max_seq_len {max_seq_len}")


def grown_capacity(capacity: int, held: int, s: int, max_seq_len: int) -> int:
    """The capacity a slot holding `held` of `capacity` columns needs for `s` more
    (`block_capacity`): unchanged when they fit; a grown one above `max_seq_len` is refused
    (CacheRefusal "kv-cache capacity {grown} would be above max_seq_len {max}").
    Integer-only: `SingleCache.append` and the port's slots both call it."""
    grown = block_capacity(capacity, held + s)
    if grown > capacity and grown > max_seq_len:
        raise _above_max_seq_len(grown, max_seq_len)
    return grown


def chain_capacity(capacity: int, held: int, n: int, max_seq_len: int) -> int:
    """The capacity after `n` one-column appends (a draft chain's steps) to a slot holding
    `held` of `capacity` columns: each append grows by one 512-column block when full, so the
    first append whose growth passes `max_seq_len` refuses (its CacheRefusal names that
    capacity, the first block past `max(max_seq_len, capacity)`, not the last one's). Equal to
    `grown_capacity(capacity, held, n, ...)` when nothing is refused. Integer-only; `n = 0`
    returns `capacity`."""
    require(n >= 0, f"chain length {n} must be >= 0")
    grown = block_capacity(capacity, held + n)
    if grown > capacity and grown > max_seq_len:
        raise _above_max_seq_len(block_capacity(capacity, max(max_seq_len, capacity) + 1),
                                 max_seq_len)
    return grown


def set_len_refusal(length: int, first_cached: int, capacity: int) -> CacheRefusal | None:
    """The refusal `set_len(length)` raises on a slot of `capacity` physical columns whose
    column 0 holds position `first_cached`, or None: below the retained window ("below this
    slot's retained window"), past the capacity ("exceeds current capacity"). ValueError for
    a negative length. Integer-only: the reference's and the port's slots call it."""
    require(length >= 0, f"set_len length {length} must be >= 0")
    if length < first_cached:
        return CacheRefusal(
            f"set_len({length}) is below this slot's retained window (first cached "
            f"{first_cached})"
        )
    if length - first_cached > capacity:
        return CacheRefusal(
            f"set_len({length}) exceeds current capacity {capacity} (first cached {first_cached})"
        )
    return None


@dataclass
class SingleCache:
    """One K or V tensor with a shared absolute length.

    Invariant: `0 <= current_seq_len - first_cached <= capacity_seq_len`; when `data` is
    materialized its axis 2 is `capacity_seq_len` wide and columns `[0, physical)` hold the
    live run (absolute positions `first_cached ..`). `set_len` touches no tensor, so it may
    grow back into stale capacity.
    """

    max_seq_len: int
    capacity_seq_len: int = PLAIN_CACHE_CAPACITY
    current_seq_len: int = 0
    first_cached: int = 0
    retain_window: int | None = None
    data: np.ndarray | None = None

    def __post_init__(self) -> None:
        require(self.max_seq_len >= 0, f"max_seq_len {self.max_seq_len} must be >= 0")
        require(
            self.capacity_seq_len >= 0, f"capacity_seq_len {self.capacity_seq_len} must be >= 0"
        )
        require(
            0 <= self.first_cached <= self.current_seq_len,
            f"first_cached {self.first_cached} must be in [0, current_seq_len "
            f"{self.current_seq_len}]",
        )
        if self.data is not None:
            require(self.data.ndim == 4 and self.data.shape[SEQ_DIM] == self.capacity_seq_len,
                    f"data shape {self.data.shape} must be [B,H,{self.capacity_seq_len},D]")

    @property
    def physical(self) -> int:
        """Columns actually held: `current_seq_len - first_cached`."""
        return self.current_seq_len - self.first_cached

    def current_data(self) -> np.ndarray | None:
        """The live run: columns `[0, physical)` of the buffer (None while unmaterialized)."""
        if self.data is None:
            return None
        return self.data[:, :, : self.physical, :]

    def reset(self) -> None:
        """current = first_cached = 0, data dropped, capacity kept."""
        self.current_seq_len = 0
        self.first_cached = 0
        self.data = None

    def try_set_len(self, length: int) -> None:
        """Check `set_len(length)` without doing it. Refuses a length below the retained
        window ("below this slot's retained window") or past the capacity ("exceeds current
        capacity")."""
        refusal = set_len_refusal(length, self.first_cached, self.capacity_seq_len)
        if refusal is not None:
            raise refusal

    def set_len(self, length: int) -> None:
        """Move the shared length to `length` (grow or shrink); no tensor is touched."""
        self.try_set_len(length)
        self.current_seq_len = length

    def evict_before(self, target: int) -> None:
        """Windowed compaction: rebuild at width `retain + 128` holding absolute positions
        `[target, current)` at column 0, and set `first_cached = target`."""
        require(self.retain_window is not None, "evict_before needs a windowed slot")
        require(self.first_cached <= target <= self.current_seq_len,
                f"evict target {target} must be in [{self.first_cached}, {self.current_seq_len}]")
        width = self.retain_window + WINDOW_COMPACTION
        kept = self.current_seq_len - target
        if self.data is not None:
            b, h, _, d = self.data.shape
            fresh = np.zeros((b, h, width, d), dtype=self.data.dtype)
            start = target - self.first_cached
            fresh[:, :, :kept, :] = self.data[:, :, start : start + kept, :]
            self.data = fresh
        self.capacity_seq_len = width
        self.first_cached = target

    def append(self, src: np.ndarray) -> None:
        """Append `src [B,H,s,D]` at the one shared offset `physical`.

        Order: windowed eviction first; then reconcile the preallocation (a shape/dtype
        mismatch is discarded while empty, refused once non-empty: "layout changed
        mid-sequence"); then grow by whole 512-column blocks (refused above `max_seq_len`),
        copying the old buffer to column 0; then write and advance `current_seq_len`.
        """
        require(isinstance(src, np.ndarray) and src.ndim == 4,
                f"append needs a [B,H,s,D] array, got shape {getattr(src, 'shape', None)}")
        s = src.shape[SEQ_DIM]
        if self.retain_window is not None:
            target = window_target_first_cached(self.current_seq_len, self.retain_window)
            if target > self.first_cached:
                self.evict_before(target)
        if self.data is not None:
            b, h, _, d = self.data.shape
            same = (b, h, d) == (
                src.shape[0],
                src.shape[1],
                src.shape[3],
            ) and self.data.dtype == src.dtype
            if not same:
                if self.physical > 0:
                    raise CacheRefusal(
                        f"layout changed mid-sequence: buffer [{b},{h},*,{d}] {self.data.dtype} "
                        f"vs append {list(src.shape)} {src.dtype}")
                self.data = None
        if self.data is None:
            shape = (src.shape[0], src.shape[1], self.capacity_seq_len, src.shape[3])
            self.data = np.zeros(shape, dtype=src.dtype)
        grown = grown_capacity(self.capacity_seq_len, self.physical, s, self.max_seq_len)
        if grown > self.capacity_seq_len:
            b, h, _, d = self.data.shape
            bigger = np.zeros((b, h, grown, d), dtype=self.data.dtype)
            bigger[:, :, : self.capacity_seq_len, :] = self.data
            self.data = bigger
            self.capacity_seq_len = grown
        p = self.physical
        self.data[:, :, p : p + s, :] = src
        self.current_seq_len += s

    def clone(self) -> SingleCache:
        """A deep copy (the reference never aliases buffers between rows)."""
        return SingleCache(self.max_seq_len, self.capacity_seq_len, self.current_seq_len,
                           self.first_cached, self.retain_window,
                           None if self.data is None else self.data.copy())


@dataclass
class KvCache:
    """`KvCache::Normal{k, v}`: both halves appended and `set_len` together; the length
    is read from k."""

    k: SingleCache
    v: SingleCache
    kind: str = field(default="Normal", init=False)

    @staticmethod
    def new_normal(max_seq_len: int, capacity: int = PLAIN_CACHE_CAPACITY,
                   retain_window: int | None = None) -> KvCache:
        return KvCache(SingleCache(max_seq_len, capacity, retain_window=retain_window),
                       SingleCache(max_seq_len, capacity, retain_window=retain_window))

    @property
    def current_seq_len(self) -> int:
        return self.k.current_seq_len

    def supports_per_sequence_len(self, xs_per_seq: bool = False) -> bool:
        """Normal slots can always carry their own length."""
        return True

    def append(self, k: np.ndarray, v: np.ndarray) -> None:
        self.k.append(k)
        self.v.append(v)

    def try_set_len(self, length: int) -> None:
        self.k.try_set_len(length)
        self.v.try_set_len(length)

    def set_len(self, length: int) -> None:
        self.try_set_len(length)
        self.k.set_len(length)
        self.v.set_len(length)

    def reset(self) -> None:
        self.k.reset()
        self.v.reset()

    def clone(self) -> KvCache:
        return KvCache(self.k.clone(), self.v.clone())


@dataclass
class OtherSlot:
    """A slot kind the reference does not model beyond its capability: "Rotating" or
    "TurboQuant" (cannot carry a per-sequence length). Only its length is tracked."""

    kind: str
    current_seq_len: int = 0

    def supports_per_sequence_len(self, xs_per_seq: bool = False) -> bool:
        return False

    def clone(self) -> OtherSlot:
        return OtherSlot(self.kind, self.current_seq_len)


@dataclass
class NormalCache:
    """`NormalCache = Vec<KvCache>`: one slot per layer (V4: K/V slots, then XsRolling
    slots). `paged=True` models a paged cache, which every capability check refuses."""

    slots: list
    paged: bool = False

    @staticmethod
    def new_plain(n: int, max_seq_len: int) -> NormalCache:
        """`n` Normal slots of capacity 512."""
        require(n >= 0, f"layer count {n} must be >= 0")
        return NormalCache([KvCache.new_normal(max_seq_len) for _ in range(n)])

    @property
    def current_seq_len(self) -> int:
        """Layer-0 length (`current_normal_cache_len`)."""
        return self.slots[0].current_seq_len if self.slots else 0

    def clone(self) -> NormalCache:
        return NormalCache([s.clone() for s in self.slots], self.paged)
