"""RoPE positions (spec: masks-and-scheduling.md §11).

Only the last `rope_dims` dims of each head rotate, as interleaved pairs; row i, token t sits
at `offsets[i] + t`. Three dispatch branches (batched, gathered, per-row), bit-identical by
construction. Dispatch, bit-identity and what is not modelled: docs/simulator.md, section
"reference/rope.py".
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from raggedspec.reference.dispatch import uniform_seqlen_offset
from raggedspec.reference.errors import require

rope_cohort_stats = {"uniform": 0, "cohort": 0, "per_sequence": 0}
"""Branch counters: "uniform" (batched single offset), "cohort" (gathered table,
`ARC_ROPE_COHORT`), "per_sequence" (per-row loop). The spec's counters
`rope_cohort_stats::{cohort, per_sequence}` name the two non-uniform branches; "uniform" is
added so the batched branch is observable too."""


def reset_rope_cohort_stats() -> None:
    """Zero every branch counter."""
    for key in rope_cohort_stats:
        rope_cohort_stats[key] = 0


def _inv_freq(rope_dims: int, theta: float) -> list[float]:
    return [float(theta) ** (-(2.0 * k) / rope_dims) for k in range(rope_dims // 2)]


def rope_cos_sin(
    positions: np.ndarray, rope_dims: int, theta: float
) -> tuple[np.ndarray, np.ndarray]:
    """`(cos, sin)`, each `float64 [*positions.shape, rope_dims // 2]`: angle
    `position * theta ** (-2k / rope_dims)` for pair k. Deterministic per element (scalar
    libm), so any table holding a position holds the same bits. ValueError on an odd or
    non-positive `rope_dims`, `theta <= 0`, or a negative position."""
    require(rope_dims >= 2 and rope_dims % 2 == 0, f"rope_dims {rope_dims} must be even and >= 2")
    require(theta > 0, f"theta {theta} must be > 0")
    positions = np.asarray(positions)
    require(positions.size == 0 or int(positions.min()) >= 0,
            f"positions must be >= 0, got min {positions.min() if positions.size else None}")
    freqs = _inv_freq(rope_dims, theta)
    flat = [float(p) for p in positions.reshape(-1)]
    cos = np.array([[math.cos(p * f) for f in freqs] for p in flat], dtype=np.float64)
    sin = np.array([[math.sin(p * f) for f in freqs] for p in flat], dtype=np.float64)
    shape = positions.shape + (rope_dims // 2,)
    return cos.reshape(shape), sin.reshape(shape)


def _rotate(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, rope_dims: int,
            inverse: bool) -> np.ndarray:
    """Rotate the last `rope_dims` dims of `x [..., T, D]` pairwise; cos/sin broadcast to
    `[..., T, rope_dims/2]`."""
    if inverse:
        sin = -sin
    out = x.copy()
    tail = x[..., x.shape[-1] - rope_dims:]
    even, odd = tail[..., 0::2], tail[..., 1::2]
    rot = np.empty_like(tail)
    rot[..., 0::2] = even * cos - odd * sin
    rot[..., 1::2] = even * sin + odd * cos
    out[..., x.shape[-1] - rope_dims:] = rot
    return out


def _check_x(x: np.ndarray, rope_dims: int) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    require(x.ndim == 4, f"x must be [B,H,T,D], got shape {x.shape}")
    require(rope_dims >= 2 and rope_dims % 2 == 0 and rope_dims <= x.shape[3],
            f"rope_dims {rope_dims} must be even, >= 2 and <= head dim {x.shape[3]}")
    return x


def rope_batched(x: np.ndarray, offset: int, rope_dims: int, theta: float,
                 inverse: bool = False) -> np.ndarray:
    """Batched branch: one `[T, rope_dims/2]` table at positions `offset + t`, broadcast
    over every row (no counter; `apply_rope` counts)."""
    x = _check_x(x, rope_dims)
    cos, sin = rope_cos_sin(int(offset) + np.arange(x.shape[2]), rope_dims, theta)
    return _rotate(x, cos, sin, rope_dims, inverse)


def rope_gathered(x: np.ndarray, offsets: Sequence[int], rope_dims: int, theta: float,
                  inverse: bool = False) -> np.ndarray:
    """Gathered branch (`ARC_ROPE_COHORT=1`): one `[B, T, rope_dims/2]` table with row i at
    positions `offsets[i] + t` (offsets of length B)."""
    x = _check_x(x, rope_dims)
    table = np.asarray([int(o) for o in offsets])[:, None] + np.arange(x.shape[2])[None, :]
    require(table.shape[0] == x.shape[0], f"{table.shape[0]} offsets for a batch of {x.shape[0]}")
    cos, sin = rope_cos_sin(table, rope_dims, theta)
    return _rotate(x, cos[:, None], sin[:, None], rope_dims, inverse)


def rope_per_row(x: np.ndarray, offsets: Sequence[int], rope_dims: int, theta: float,
                 inverse: bool = False) -> np.ndarray:
    """Per-row branch: row i rotated alone with its own `offsets[i]` (offsets of length B)."""
    x = _check_x(x, rope_dims)
    require(len(offsets) == x.shape[0], f"{len(offsets)} offsets for a batch of {x.shape[0]}")
    out = np.empty_like(x)
    for i, offset in enumerate(offsets):
        out[i: i + 1] = rope_batched(x[i: i + 1], int(offset), rope_dims, theta, inverse)
    return out


def apply_rope(x: np.ndarray, offsets: Sequence[int], rope_dims: int, theta: float,
               inverse: bool = False, rope_cohort: bool = False) -> np.ndarray:
    """Rotate `x [B,H,T,D]`: row i, token t at position `offsets[i] + t` (spec §11).

    `offsets` has length 1 (shared by every row) or B. Dispatch through
    `uniform_seqlen_offset`: uniform -> `rope_batched`; else `rope_cohort` (env
    `ARC_ROPE_COHORT=1`, read by value, default off) -> `rope_gathered`; else
    `rope_per_row`. All branches are bit-identical; the counter of the branch taken is
    incremented. `inverse` applies the conjugate rotation (same positions, `-sin`), through
    the same dispatch. No refusals; ValueError for a wrong `offsets` length, negative
    offsets, or a bad `rope_dims`.
    """
    x = _check_x(x, rope_dims)
    b = x.shape[0]
    offsets = [int(o) for o in offsets]
    require(len(offsets) in (1, b), f"{len(offsets)} offsets for a batch of {b} (need 1 or B)")
    require(all(o >= 0 for o in offsets), f"offsets {offsets} must be >= 0")
    shared = uniform_seqlen_offset(offsets)
    if shared is not None:
        rope_cohort_stats["uniform"] += 1
        return rope_batched(x, shared, rope_dims, theta, inverse)
    if rope_cohort:
        rope_cohort_stats["cohort"] += 1
        return rope_gathered(x, offsets, rope_dims, theta, inverse)
    rope_cohort_stats["per_sequence"] += 1
    return rope_per_row(x, offsets, rope_dims, theta, inverse)


def apply_rope_at_positions(x: np.ndarray, positions: Sequence[int], rope_dims: int, theta: float,
                            inverse: bool = False) -> np.ndarray:
    """`forward_at_positions`: rotate `x [B,H,T,D]` with token t at `positions[t]` for every
    row (compressed keys: positions `j * ratio`, independent of the row). ValueError when
    `len(positions) != T`."""
    x = _check_x(x, rope_dims)
    positions = np.asarray([int(p) for p in positions], dtype=np.int64)
    require(positions.shape == (x.shape[2],),
            f"{positions.shape[0]} positions for {x.shape[2]} tokens")
    cos, sin = rope_cos_sin(positions, rope_dims, theta)
    return _rotate(x, cos, sin, rope_dims, inverse)


def compressed_key_positions(t_c: int, ratio: int) -> list[int]:
    """Compressed row j is RoPE'd at absolute position `j * ratio` (the start of its block)."""
    require(t_c >= 0 and ratio >= 1, f"t_c {t_c} must be >= 0 and ratio {ratio} >= 1")
    return [j * ratio for j in range(t_c)]
