"""Front alignment as per-row offsets: the reference's front-aligned batch of an in-place one.

In the port's in-place layout (`gpu.cache.RaggedKv`) a row's KV never moves: the reference's
front-aligned batch is an index map (front-aligned column j of row i = physical column
`j - lead_i`, dead when negative), materialized by one gather where a caller needs the
reference's tensors (the slots' `front_aligned` read-back, the benchmark's front-align copy).
The alignment rules themselves run on the port's slots through `reference.align`
(docs/conformance.md, section "gpu/align.py").
"""

from __future__ import annotations

import torch

from raggedspec.gpu._common import arange_like
from raggedspec.gpu.cache import RaggedKv
from raggedspec.reference.errors import require


def front_aligned_index(lens: torch.Tensor, target: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`(cols [B, T], live [B, T])`: front-aligned column j of row i reads physical column
    `cols[i, j] = j - (T - lens[i])` (clamped to 0 where dead) and is live iff that is >= 0."""
    j = arange_like(target, lens)
    src = j[None, :] - (target - lens)[:, None]
    live = src >= 0
    return src.clamp(min=0), live


def materialize_front_aligned(
    kv: RaggedKv, target: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference's front-aligned `(k, v)`, each `[B, H, T, D]`: row i's live run at
    columns `[T - lens[i], T)`, zeros in front (`T = max(lens)` by default). One gather per
    buffer. ValueError when `target < max(lens)`."""
    top = int(kv.lens.max()) if kv.batch else 0
    target = top if target is None else int(target)
    require(target >= top, f"target {target} is shorter than the longest row {top}")
    cols, live = front_aligned_index(kv.lens, target)
    return _gather_live(kv.k, cols, live), _gather_live(kv.v, cols, live)


def _gather_live(buf: torch.Tensor, cols: torch.Tensor, live: torch.Tensor) -> torch.Tensor:
    """`out[b, h, j] = buf[b, h, cols[b, j]]` where `live[b, j]`, else 0: one gather. Dead
    columns are zeroed by `where` (not a multiply), so inf/nan slack never leaks in."""
    b, h, _, d = buf.shape
    out = buf.gather(2, cols[:, None, :, None].expand(b, h, cols.shape[1], d))
    return torch.where(live[:, None, :, None], out, buf.new_zeros(()))

