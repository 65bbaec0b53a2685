"""Dispatch resolvers: each decides between the scalar (uniform, pre-change) path and the
per-row (ragged) path, and for a uniform batch returns the *scalar representation* itself,
not a vector of equal values. Two paths that agree bit-for-bit can only be told apart by
testing these predicates directly (spec: cache-and-draft.md §6, §8.2, §9, §10.1, §14;
masks-and-scheduling.md §2, §11).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from raggedspec.reference.errors import DispatchRefusal, require


def resolve_ragged_rows(rows: Sequence[int] | None, q0: int, b: int) -> list[int] | None:
    """Per-row query positions for dsv4 attention, or None for the scalar path.

    Order matters: (1) None, or every row equal to `q0` (empty included, and a uniform
    vector of the wrong length too) -> None; (2) `len(rows) != b` -> refused ("per-row query
    positions for a batch of"); (3) a row `> q0` -> refused ("AHEAD of the batch");
    (4) `max(rows) != q0` -> refused ("no row sits at the batch's shared end column");
    (5) else the rows. Malformed (ValueError, before any refusal): a negative q0, b or row
    position (absolute positions are usize upstream).
    """
    require(q0 >= 0 and b >= 0, f"q0 {q0} and b {b} must be >= 0")
    if rows is not None:
        given = [int(r) for r in rows]
        require(all(r >= 0 for r in given), f"row positions {given} must be >= 0")
    if rows is None or all(r == q0 for r in rows):
        return None
    rows = [int(r) for r in rows]
    if len(rows) != b:
        raise DispatchRefusal(f"{len(rows)} per-row query positions for a batch of {b}")
    ahead = [r for r in rows if r > q0]
    if ahead:
        raise DispatchRefusal(f"row position {ahead[0]} is AHEAD of the batch's q0 {q0}")
    if max(rows) != q0:
        raise DispatchRefusal(
            f"no row sits at the batch's shared end column {q0} (max row {max(rows)})")
    return rows


def uniform_seqlen_offset(offsets: Sequence[int]) -> int | None:
    """RoPE dispatch: the one shared offset when every offset is equal, None when empty or
    non-uniform (None selects the per-row / gathered path)."""
    if len(offsets) == 0:
        return None
    first = int(offsets[0])
    return first if all(int(o) == first for o in offsets) else None


def resolve_row_offsets(per_seq: Sequence[int | None], shared: int) -> list[int] | None:
    """The per-row absolute start offsets of a prompt-style forward, or None for the shared
    (scalar) offset (masks §1 `seqlen_offsets`, §22 dispatch tests; cache-and-draft §1, §16:
    the fused MTP verify of a left-aligned ragged cohort sets each row's own start with
    `set_prefill_toks_at(window, cache_lens[i])` and a shared offset of 0).

    Semantics (the spec names the function but gives no body; chosen = arc's
    `inputs_processor.rs::resolve_row_offsets` verbatim): `per_seq[i]` is row i's own
    offset or None. None ("the batch shares one offset": the scalar path, pre-change code
    verbatim) iff no row carries its own offset, the empty batch included. Otherwise
    `[per_seq[i] if given else shared]`: a row without its own offset keeps the batch's
    `shared`, not 0.

    Uniform -> scalar form: a batch in which no row carries an override always returns
    None. A vector of *overrides* that happen to be equal is deliberately NOT collapsed:
    the scalar path reads `shared` (0 on the per-row verify route), not the common value,
    so a collapse would put every row at `shared`. Invariant: the result, when not None,
    has one entry per row. Refuses nothing; ValueError on a negative `shared` or a negative
    per-row offset (usize upstream).
    """
    require(shared >= 0, f"shared offset {shared} must be >= 0")
    vals = [None if o is None else int(o) for o in per_seq]
    require(all(o is None or o >= 0 for o in vals), f"per-row offsets {vals} must be >= 0")
    if all(o is None for o in vals):
        return None
    return [shared if o is None else o for o in vals]


# --- §6 hidden-state capture -------------------------------------------------------------


@dataclass(frozen=True)
class CaptureOffsets:
    """Absolute position of column 0 of a captured `[B,T,hidden]` block: one shared element,
    or one per row (cache-and-draft.md §6.1).

    Invariant: a one-element vector describes *every* row (and every batch width); a longer
    one describes exactly its own width. Malformed (ValueError): an empty vector (nothing
    builds one: `resolve_capture_offsets` maps no offsets to `[0]`, and a store always
    passes at least one) and a negative offset.
    """

    values: tuple[int, ...]

    def __init__(self, values: Sequence[int]) -> None:
        vals = tuple(int(v) for v in values)
        require(len(vals) >= 1, f"capture offsets {list(vals)} must hold at least one offset "
                                f"(resolve_capture_offsets maps none to [0])")
        require(all(v >= 0 for v in vals), f"capture offsets {list(vals)} must be >= 0")
        object.__setattr__(self, "values", vals)

    def row(self, r: int) -> int | None:
        """Row r's offset: `values[0]` for any r when there is one element (r >= B
        included); otherwise `values[r]`, None when out of range."""
        require(r >= 0, f"row {r} must be >= 0")
        if len(self.values) == 1:
            return self.values[0]
        return self.values[r] if r < len(self.values) else None

    def describes(self, b: int) -> bool:
        """True iff the vector covers a batch of b rows: length 1 or exactly b."""
        return len(self.values) == 1 or len(self.values) == b


def resolve_capture_offsets(offsets: Sequence[int]) -> CaptureOffsets:
    """The capture's offsets in their scalar form whenever possible (§6.2): empty -> `[0]`;
    every element equal to the first -> `[first]`; otherwise the vector verbatim. A uniform
    batch therefore never builds the per-row vector, and `row(r)` is the old
    `first().unwrap_or(0)`. Refuses nothing."""
    vals = [int(o) for o in offsets]
    if not vals:
        return CaptureOffsets([0])
    if all(v == vals[0] for v in vals):
        return CaptureOffsets([vals[0]])
    return CaptureOffsets(vals)


class MtpHiddenCapture:
    """The target's pre-norm hidden-state capture slot (§6.3).

    Invariant: nothing is stored while disarmed; a store *overwrites* the slot with
    `(resolve_capture_offsets(offsets), h)`; `take` returns the slot and leaves it empty.
    `arm()` models `mtp_decode_kit()` handing out the kit. Refuses nothing.
    """

    def __init__(self) -> None:
        self.armed = False
        self._slot: tuple[CaptureOffsets, object] | None = None

    def arm(self) -> None:
        self.armed = True

    def store(self, start: int, h) -> None:
        """`store_rows([start], h)`."""
        self.store_rows([start], h)

    def store_rows(self, offsets: Sequence[int], h) -> None:
        """No-op while disarmed; else overwrite the slot."""
        if self.armed:
            self._slot = (resolve_capture_offsets(offsets), h)

    def take(self) -> tuple[CaptureOffsets, object] | None:
        """The slot's content (None when empty); the slot is cleared."""
        slot, self._slot = self._slot, None
        return slot

    def clear(self) -> None:
        self._slot = None


# --- §8.2 per-row cache lengths -----------------------------------------------------------


def resolve_row_cache_lens(enabled: bool, cache_len: int, lead_pad):
    """Each row's own committed-KV length `C - lead_i`, or None for the scalar dispatch
    (cache-and-draft.md §8.2).

    None when `not enabled` or every lead is 0 (empty counts as all-zero). Refuses (in this
    order) a lead wider than C ("wider than" ... "disagree") and a batch in which no lead is
    0 ("every row carries a dead prefix", nobody at the "shared end column"): a left-aligned
    cohort always has its widest row at column C. A list of leads gives a list; an array
    gives an array (one expression over the rows).
    """
    require(cache_len >= 0, f"cache_len {cache_len} must be >= 0")
    leads = _rows(lead_pad)
    if (leads < 0).any():
        raise ValueError(f"lead_pad {leads.tolist()} must be >= 0")
    if not enabled or not leads.any():
        return None
    wide = np.flatnonzero(leads > cache_len)
    if wide.size:
        i = int(wide[0])
        raise DispatchRefusal(
            f"row {i}'s lead pad {int(leads[i])} is wider than the batched cache_len "
            f"{cache_len}: lead_pad {leads.tolist()} and the cache disagree")
    if leads.min() != 0:
        raise DispatchRefusal(
            f"every row carries a dead prefix (lead_pad {leads.tolist()}, cache_len "
            f"{cache_len}): no row ends at the shared end column, so this is not a "
            f"left-aligned cohort")
    lens = cache_len - leads
    return lens if isinstance(lead_pad, np.ndarray) else lens.tolist()


# --- §9 draft groups -----------------------------------------------------------------------


def resolve_ragged_chain_starts(starts: Sequence[int]) -> list[int] | None:
    """The per-row chain starts of a draft group, or None for the scalar chain (§9.4):
    None when empty or all equal, else the whole slice. Refuses nothing."""
    vals = [int(s) for s in starts]
    if not vals or all(v == vals[0] for v in vals):
        return None
    return vals


def resolve_draft_leads(enabled: bool, starts: Sequence[int]) -> list[int] | None:
    """Draft-group left-alignment leads `max(starts) - start_i`, or None for the uniform
    `batch_draft_caches` path (§9.5).

    None when `not enabled` (the same `per_seq_advance` that gates `ragged_row_q0`, the only
    thing that masks these zero columns), when empty, or when every start equals the max.
    Refuses nothing; ValueError on a negative chain start (absolute positions are usize
    upstream), checked before the gate so it does not depend on the flag.
    """
    vals = [int(s) for s in starts]
    require(all(v >= 0 for v in vals), f"chain starts {vals} must be >= 0")
    if not enabled or not vals:
        return None
    top = max(vals)
    if all(v == top for v in vals):
        return None
    return [top - v for v in vals]


def _rows(values) -> np.ndarray:
    """Per-row integers (a sequence, an array or one int) as int64."""
    return np.asarray(values, dtype=np.int64)  # pragma: no mutate (dtype None: the same ints)


def _first(mask: np.ndarray) -> int:
    """The index of the first true entry of `mask` (any shape, read flat)."""
    return int(np.flatnonzero(mask)[0])


def _at(values: np.ndarray, i: int) -> int:
    """Entry i of `values` (any shape, read flat) as an int."""
    return int(values.ravel()[i])


def chain_start_of(cache_len, u):
    """`C_i + u - 2 = L - 2`: the absolute position of the pair `(h_{L-2}, tok_{L-1})` whose
    target hidden seeds the chain (§1, §9.1). Malformed (ValueError) when `C_i + u < 2`,
    which `plan_step_window` already excludes. Ints give an int; arrays (one entry per row)
    give the rows' starts as an array, a malformed row refused with its own values."""
    c, n = _rows(cache_len), _rows(u)
    negative = (c < 0) | (n < 0)
    if negative.any():
        i = _first(negative)
        raise ValueError(f"cache_len {_at(c, i)} and u {_at(n, i)} must be >= 0")
    short = c + n < 2
    if short.any():
        i = _first(short)
        raise ValueError(f"cache_len {_at(c, i)} + u {_at(n, i)} < 2 has no chain start")
    start = c + n - 2
    return start if isinstance(cache_len, np.ndarray) else int(start)


def draft_group_key(u, cache_len, carries_per_row: bool):
    """`(u, 0)` when the chain carries per-row positions, else `(u, chain_start_of(C_i, u))`
    (§9.1). The flag is load-bearing: the scalar chain runs at one start, so dropping the
    start from the scalar key would silently starve rows whose seed sits elsewhere.

    u = 0 is well-formed here (chosen, stated): `plan_step_window` already makes a u = 0 row
    not-ok before any group is formed, and the key's expression is defined for it (`(0, 0)`
    per-row, `(0, chain_start_of(C_i, 0))` scalar, itself ValueError when `C_i < 2`).
    Callers rely on that: `draft_groups` keys every row with u < w, and the port
    conformance and zero-boundary tests call the key with u = 0. ValueError on u < 0.
    Ints give a pair of ints; arrays (one entry per row) a pair of arrays."""
    if carries_per_row:
        n = _rows(u)
        negative = n < 0
        if negative.any():
            raise ValueError(f"u {_at(n, _first(negative))} must be >= 0")
        return (u, np.zeros_like(n) if isinstance(u, np.ndarray) else 0)
    return (u, chain_start_of(cache_len, u))


def draft_groups(uncached: Sequence[int], cache_lens: Sequence[int], may_draft: Sequence[bool],
                 w: int, per_seq_advance: bool) -> dict[tuple[int, int], list[int]]:
    """Partition the drafting rows into batched chain groups (§9.1).

    Row i is included iff `u_i < w` and `may_draft[i]`, keyed by
    `draft_group_key(u_i, cache_lens[i], per_seq_advance)`. Keys ascending, rows ascending.
    Invariant: per-row keys give at most `w` (= depth + 1) groups at any batch size; scalar
    keys put only rows with one chain start in a group. Malformed: unequal lengths. Lists or
    arrays in; the keys are keyed on the included rows at once (one expression).
    """
    n = len(uncached)
    require(len(cache_lens) == n and len(may_draft) == n,
            f"uncached ({n}), cache_lens ({len(cache_lens)}) and may_draft ({len(may_draft)}) "
            f"must have one entry per row")
    require(w >= 1, f"window w {w} must be >= 1")
    u = _rows(uncached)
    rows = np.flatnonzero((u < w) & (_rows(may_draft) != 0))
    if rows.size == 0:
        return {}
    lens = _rows(cache_lens)
    key_u, key_s = draft_group_key(u[rows], lens[rows], per_seq_advance)
    order = np.lexsort((rows, key_s, key_u))
    key_u, key_s, rows = key_u[order], key_s[order], rows[order]
    cut = np.flatnonzero((key_u[1:] != key_u[:-1]) | (key_s[1:] != key_s[:-1])) + 1
    starts = np.concatenate(([0], cut))
    parts = np.split(rows, cut)
    return {(int(key_u[i]), int(key_s[i])): parts[j].tolist()
            for j, i in enumerate(starts.tolist())}


# --- §10.1 / masks §12 -----------------------------------------------------------------------


def draft_step_end_column(start_pos: Sequence[int], b: int, cached: int) -> int:
    """The one shared end column of an MTP draft step: `max(start_pos)` (§10.1).

    Refuses (DispatchRefusal): an empty vector ("given no absolute position at all"); a
    length neither 1 nor b ("{n} absolute position(s) for a batch of {b}"); a draft cache
    whose length is not `max(start_pos)` ("MTP draft KV desync ... left-aligned").
    """
    require(b >= 0 and cached >= 0, f"b {b} and cached {cached} must be >= 0")
    pos = [int(p) for p in start_pos]
    if not pos:
        raise DispatchRefusal(
            f"the MTP draft step was given no absolute position at all (batch of {b})"
        )
    if len(pos) != 1 and len(pos) != b:
        raise DispatchRefusal(f"{len(pos)} absolute position(s) for a batch of {b}: {pos}")
    end = max(pos)
    if cached != end:
        raise DispatchRefusal(
            f"MTP draft KV desync: cache holds {cached} entries but the step's rows end at "
            f"absolute position {end} (start_pos {pos}); a ragged group must be left-aligned "
            f"so every row ends at the cache's end column")
    return end


def ragged_row_q0(offsets, per_seq_kv: bool):
    """`Dsv4AttentionConfig::row_q0`: the seqlen offsets when `ARC_MTP_PER_SEQ_KV` is on
    (latched; `per_seq_kv`), else None (masks §12). A uniform vector is passed through here;
    `resolve_ragged_rows` filters it back to None. Refuses nothing. A list gives a list of
    ints; an array gives an int64 array."""
    if not per_seq_kv:
        return None
    if isinstance(offsets, np.ndarray):
        return offsets.astype(np.int64)
    return [int(o) for o in offsets]
