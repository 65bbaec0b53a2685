"""Dispatch predicates on length vectors (port of `reference.dispatch`).

The two predicates the port's tensor code calls on vectors it may hold on the device (the
attention's per-row query positions, RoPE's offsets). Each picks the scalar (uniform) or
per-row (ragged) path and, like the reference, returns `None` for a uniform batch. Every other
dispatch rule runs on host integers once per step: the port calls `reference.dispatch`
itself (docs/conformance.md, section "gpu/dispatch.py").
"""

from __future__ import annotations


import torch

from raggedspec.gpu._common import as_list, lengths
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


















