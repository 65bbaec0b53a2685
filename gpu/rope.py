"""RoPE by one gathered cos/sin table (port of `reference.rope`).

One kernel shape for every batch: positions `[B or 1, T]` index one precomputed float64
cos/sin table, and the reference's three branches collapse into this one; the dispatch
predicate stays observable (`rope_path_stats`). Detail: docs/conformance.md, section
"gpu/rope.py".
"""

from __future__ import annotations

import torch

from raggedspec.gpu._common import arange_like, float64_on, host_ints, ints_on, lengths_like
from raggedspec.reference.dispatch import uniform_seqlen_offset
from raggedspec.reference.errors import require

rope_path_stats = {"uniform": 0, "gathered": 0}
"""Which table shape `apply_rope` built: "uniform" (`[1, T]`, one offset) or "gathered"."""


def reset_rope_path_stats() -> None:
    for key in rope_path_stats:
        rope_path_stats[key] = 0


def _inv_freq(rope_dims: int, theta: float, device) -> torch.Tensor:
    return float64_on([float(theta) ** (-(2.0 * k) / rope_dims) for k in range(rope_dims // 2)],
                      device)


def rope_cos_sin(positions, rope_dims: int, theta: float, dtype: torch.dtype = torch.float64,
                 device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`(cos, sin)`, each `[*positions.shape, rope_dims // 2]` in `dtype` (computed in
    float64). ValueError on an odd or non-positive `rope_dims`, `theta <= 0`, a negative
    position."""
    require(rope_dims >= 2 and rope_dims % 2 == 0, f"rope_dims {rope_dims} must be even and >= 2")
    require(theta > 0, f"theta {theta} must be > 0")
    positions = ints_on(positions, device)
    require(
        positions.numel() == 0 or int(positions.min()) >= 0,
        f"positions must be >= 0, got min {int(positions.min()) if positions.numel() else None}",
    )
    # int64 * float64 is float64, exact for every position below 2**53
    angle = positions[..., None] * _inv_freq(rope_dims, theta, positions.device)
    return torch.cos(angle).to(dtype), torch.sin(angle).to(dtype)


class RopeTable:
    """A precomputed cos/sin table for positions `[0, n_positions)`; `lookup(positions)`
    is one gather per table. Positions past the table are malformed (ValueError)."""

    def __init__(
        self,
        rope_dims: int,
        theta: float,
        n_positions: int,
        dtype: torch.dtype = torch.float64,
        device: torch.device | str | None = None,
    ) -> None:
        require(n_positions >= 0, f"n_positions {n_positions} must be >= 0")
        self.rope_dims, self.theta, self.n_positions = rope_dims, theta, n_positions
        self.cos, self.sin = rope_cos_sin(
            torch.arange(n_positions, device=device), rope_dims, theta, dtype
        )

    def lookup(
        self, positions: torch.Tensor, top: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`(cos, sin)` at `positions` (any shape), each `[*shape, rope_dims/2]`. `top`, the
        largest position when the caller knows it on the host, spares the device read of the
        range check."""
        if top is None and positions.numel():
            top = int(positions.max())
        if top is not None and top >= self.n_positions:
            raise ValueError(f"position {top} is past the table's {self.n_positions} positions")
        flat = positions.reshape(-1)
        shape = positions.shape + (self.rope_dims // 2,)
        return (self.cos.index_select(0, flat).reshape(shape),
                self.sin.index_select(0, flat).reshape(shape))


def _check_x(x: torch.Tensor, rope_dims: int) -> None:
    require(x.dim() == 4, f"x must be [B,H,T,D], got shape {list(x.shape)}")
    require(rope_dims >= 2 and rope_dims % 2 == 0 and rope_dims <= x.shape[3],
            f"rope_dims {rope_dims} must be even, >= 2 and <= head dim {x.shape[3]}")


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rope_dims: int,
           inverse: bool = False) -> torch.Tensor:
    """Rotate the last `rope_dims` dims of `x [..., T, D]` as interleaved pairs; `cos`/`sin`
    broadcast to `[..., T, rope_dims/2]` (cast to `x.dtype`)."""
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    if inverse:
        sin = -sin
    d = x.shape[-1]
    tail = x[..., d - rope_dims:].unflatten(-1, (rope_dims // 2, 2))
    even, odd = tail[..., 0], tail[..., 1]
    rot = torch.stack([even * cos - odd * sin, even * sin + odd * cos], dim=-1).flatten(-2)
    return torch.cat([x[..., : d - rope_dims], rot], dim=-1)


def apply_rope(x: torch.Tensor, offsets, rope_dims: int, theta: float, inverse: bool = False,
               table: RopeTable | None = None, dev_offsets: torch.Tensor | None = None
               ) -> torch.Tensor:
    """Rotate `x [B,H,T,D]`: row i, token t at `offsets[i] + t` (`offsets` of length 1 or
    B). One positions table `[1 or B, T]`, one gather of cos/sin (from `table` when given,
    else computed for exactly these positions), one broadcast rotation. The dispatch is a
    host branch: the offsets are host integers (a device vector is read once) and the
    reference's `uniform_seqlen_offset` picks the `[1, T]` table for a uniform vector. Only
    a ragged vector is needed on the device: `dev_offsets` (the same values, already there,
    e.g. the step plan's) when given, else one upload.
    ValueError for a wrong `offsets` length, a negative offset, a bad `rope_dims`."""
    _check_x(x, rope_dims)
    b, _, t, _ = x.shape
    host = host_ints(offsets)
    require(host.size in (1, b), f"{host.size} offsets for a batch of {b} (need 1 or B)")
    require(host.min(initial=0) >= 0, f"offsets {host.tolist()} must be >= 0")
    shared = uniform_seqlen_offset(host.tolist())
    if shared is not None:
        rope_path_stats["uniform"] += 1
        positions = (shared + arange_like(t, x))[None, :]
    else:
        rope_path_stats["gathered"] += 1
        if dev_offsets is None or dev_offsets.numel() != host.size:
            dev_offsets = lengths_like(offsets, x, name="offsets")
        positions = dev_offsets[:, None] + arange_like(t, x)[None, :]
    if table is not None:
        top = int(host.max()) + t - 1 if host.size and t else None
        cos, sin = table.lookup(positions, top)
    else:  # float64 on the positions' device; `rotate` casts to x.dtype
        cos, sin = rope_cos_sin(positions, rope_dims, theta)
    return rotate(x, cos[:, None], sin[:, None], rope_dims, inverse)
