"""Dispatch resolvers: each decides between the scalar (uniform, pre-change) path and the
per-row (ragged) path, and for a uniform batch returns the *scalar representation* itself,
not a vector of equal values. Two paths that agree bit-for-bit can only be told apart by
testing these predicates directly (spec: cache-and-draft.md §6, §8.2, §9, §10.1, §14;
masks-and-scheduling.md §2, §11).
"""

from __future__ import annotations

from collections.abc import Sequence

from reference.errors import DispatchRefusal, require


def resolve_ragged_rows(rows: Sequence[int] | None, q0: int, b: int) -> list[int] | None:
    """Per-row query positions for dsv4 attention, or None for the scalar path.

    Order matters: (1) None, or every row equal to `q0` (empty included, and a uniform
    vector of the wrong length too) -> None; (2) `len(rows) != b` -> refused ("per-row query
    positions for a batch of"); (3) a row `> q0` -> refused ("AHEAD of the batch");
    (4) `max(rows) != q0` -> refused ("no row sits at the batch's shared end column");
    (5) else the rows.
    """
    require(q0 >= 0 and b >= 0, f"q0 {q0} and b {b} must be >= 0")
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
