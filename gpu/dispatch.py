"""Dispatch predicates on length vectors (port of `reference.dispatch`).

Each predicate picks the scalar (uniform) or per-row (ragged) path and, like the reference,
returns `None` for a uniform batch; the decision is a host branch reading one reduction.
The vectorized draft-group partition, the input conventions and what is not ported:
docs/conformance.md, section "gpu/dispatch.py".
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from raggedspec.gpu._common import as_list, flags_like, lengths, lengths_like
from raggedspec.reference.errors import DispatchRefusal, require


def resolve_ragged_rows(rows, q0: int, b: int) -> torch.Tensor | None:
    """Port of `reference.dispatch.resolve_ragged_rows`; `rows` a vector, tensor or None.

    (1) None or every row == q0 (empty, and a uniform vector of the wrong length, included)
    -> None; (2) `len != b` refused ("per-row query positions for a batch of"); (3) a row
    `> q0` refused ("AHEAD of the batch"); (4) `max != q0` refused ("no row sits at the
    batch's shared end column"); (5) else the rows as int64.
    """
    require(q0 >= 0 and b >= 0, f"q0 {q0} and b {b} must be >= 0")
    if rows is None:
        return None
    rows = lengths(rows, name="rows")
    require(not bool((rows < 0).any()), f"row positions {as_list(rows)} must be >= 0")
    if bool((rows == q0).all()):
        return None
    if rows.numel() != b:
        raise DispatchRefusal(f"{rows.numel()} per-row query positions for a batch of {b}")
    ahead = rows > q0
    if bool(ahead.any()):
        first = int(rows[ahead.nonzero()[0, 0]])
        raise DispatchRefusal(f"row position {first} is AHEAD of the batch's q0 {q0}")
    top = int(rows.max())
    if top != q0:
        raise DispatchRefusal(
            f"no row sits at the batch's shared end column {q0} (max row {top})")
    return rows


def uniform_seqlen_offset(offsets) -> int | None:
    """The one shared offset when every offset is equal; None when empty or non-uniform."""
    offsets = lengths(offsets, name="offsets")
    if offsets.numel() == 0:
        return None
    first = int(offsets[0])
    return first if bool((offsets == first).all()) else None


def resolve_row_cache_lens(enabled: bool, cache_len: int, lead_pad) -> torch.Tensor | None:
    """Port of `resolve_row_cache_lens`: `cache_len - lead_pad`, or None when `not enabled`
    or every lead is 0 (empty included). Refuses (DispatchRefusal, in this order) a lead
    wider than `cache_len` ("wider than" ... "disagree") and a batch with no zero lead
    ("every row carries a dead prefix")."""
    require(cache_len >= 0, f"cache_len {cache_len} must be >= 0")
    leads = lengths(lead_pad, name="lead_pad")
    require(not bool((leads < 0).any()), f"lead_pad {as_list(leads)} must be >= 0")
    if not enabled or not bool((leads != 0).any()):
        return None
    wide = leads > cache_len
    if bool(wide.any()):
        i = int(wide.nonzero()[0, 0])
        raise DispatchRefusal(
            f"row {i}'s lead pad {int(leads[i])} is wider than the batched cache_len {cache_len}: "
            f"lead_pad {as_list(leads)} and the cache disagree")
    if int(leads.min()) != 0:
        raise DispatchRefusal(
            f"every row carries a dead prefix (lead_pad {as_list(leads)}, cache_len {cache_len}): "
            f"no row ends at the shared end column, so this is not a left-aligned cohort")
    return cache_len - leads


def resolve_ragged_chain_starts(starts) -> torch.Tensor | None:
    """None when empty or all equal, else the starts (the per-row chain)."""
    starts = lengths(starts, name="starts")
    if starts.numel() == 0 or bool((starts == starts[0]).all()):
        return None
    return starts


def resolve_draft_leads(enabled: bool, starts) -> torch.Tensor | None:
    """`max(starts) - starts`, or None when `not enabled`, empty, or all equal to the max."""
    starts = lengths(starts, name="starts")
    require(not bool((starts < 0).any()), f"chain starts {as_list(starts)} must be >= 0")
    if not enabled or starts.numel() == 0:
        return None
    leads = starts.max() - starts
    if not bool((leads != 0).any()):
        return None
    return leads


def chain_start_of(cache_lens, u) -> torch.Tensor:
    """`C_i + u_i - 2` for every row (ValueError when any `C_i + u_i < 2`)."""
    c = lengths(cache_lens, name="cache_lens")
    u = lengths_like(u, c, "u")
    require(c.numel() == u.numel(), f"{c.numel()} cache_lens for {u.numel()} u")
    require(not bool((c < 0).any() or (u < 0).any()),
            f"cache_lens {as_list(c)} and u {as_list(u)} must be >= 0")
    s = c + u
    require(not bool((s < 2).any()),
            f"cache_len + u < 2 has no chain start: cache_lens {as_list(c)} + u {as_list(u)}")
    return s - 2


def draft_group_keys(u, cache_lens, carries_per_row: bool) -> torch.Tensor:
    """`[N, 2]` int64 keys: `(u_i, 0)` when the chain carries per-row positions, else
    `(u_i, chain_start_of(C_i, u_i))` (the vector form of `draft_group_key`)."""
    u = lengths(u, name="u")
    second = torch.zeros_like(u) if carries_per_row else chain_start_of(cache_lens, u)
    return torch.stack([u, second], dim=1)


@dataclass
class DraftGroups:
    """The partition: `keys [G, 2]` ascending (lexicographic) and `rows[g]` the ascending
    int64 row indices of group g."""

    keys: torch.Tensor
    rows: list[torch.Tensor]

    def as_dict(self) -> dict[tuple[int, int], list[int]]:
        """The reference's `{(u, s): [rows]}` form (host lists), for conformance."""
        return {
            (int(k[0]), int(k[1])): as_list(r)
            for k, r in zip(self.keys.tolist(), self.rows, strict=False)
        }


def draft_groups(uncached, cache_lens, may_draft, w: int, per_seq_advance: bool) -> DraftGroups:
    """Vectorized `draft_groups`: rows with `u_i < w` and `may_draft_i`, keyed by
    `draft_group_keys`; keys ascending, rows ascending within a group. ValueError on
    unequal lengths or `w < 1`."""
    u = lengths(uncached, name="uncached")
    c = lengths_like(cache_lens, u, "cache_lens")
    may = flags_like(may_draft, u, "may_draft")
    require(c.numel() == u.numel() and may.numel() == u.numel(),
            f"uncached ({u.numel()}), cache_lens ({c.numel()}) and may_draft ({may.numel()}) "
            f"must have one entry per row")
    require(w >= 1, f"window w {w} must be >= 1")
    idx = ((u < w) & may).nonzero().flatten()
    if idx.numel() == 0:
        return DraftGroups(u.new_zeros((0, 2)), [])
    keys = draft_group_keys(u[idx], c[idx], per_seq_advance)
    uniq, inverse, counts = torch.unique(keys, dim=0, return_inverse=True, return_counts=True)
    n = u.numel()  # > every row index, so `group * n + row` sorts by group, then by row
    rows = torch.sort(inverse * n + idx).values % n
    return DraftGroups(uniq, list(torch.split(rows, counts.tolist())))


def draft_step_end_column(start_pos, b: int, cached: int) -> int:
    """`max(start_pos)`; refuses (DispatchRefusal) an empty vector ("given no absolute
    position at all"), a length neither 1 nor b ("absolute position(s) for a batch of"),
    and `cached != max` ("MTP draft KV desync ... left-aligned")."""
    require(b >= 0 and cached >= 0, f"b {b} and cached {cached} must be >= 0")
    pos = lengths(start_pos, name="start_pos")
    if pos.numel() == 0:
        raise DispatchRefusal(
            f"the MTP draft step was given no absolute position at all (batch of {b})"
        )
    if pos.numel() != 1 and pos.numel() != b:
        raise DispatchRefusal(
            f"{pos.numel()} absolute position(s) for a batch of {b}: {as_list(pos)}"
        )
    end = int(pos.max())
    if cached != end:
        raise DispatchRefusal(
            f"MTP draft KV desync: cache holds {cached} entries but the step's rows end at "
            f"absolute position {end} (start_pos {as_list(pos)}); a ragged group must be "
            "left-aligned "
            f"so every row ends at the cache's end column"
        )
    return end


def ragged_row_q0(offsets, per_seq_kv: bool) -> torch.Tensor | None:
    """The seqlen offsets when `ARC_MTP_PER_SEQ_KV` is on, else None (uniform vectors pass
    through; `resolve_ragged_rows` filters them)."""
    return lengths(offsets, name="offsets") if per_seq_kv else None
