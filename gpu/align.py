"""Front alignment as per-row offsets (port of `reference.align`).

In the port's in-place layout (`gpu.cache.RaggedKv`) a row's KV never moves: the reference's
front-aligned batch is an index map (front-aligned column j of row i = physical column
`j - lead_i`, dead when negative), materialized by one gather only for conformance. What each
function ports and what is not ported: docs/conformance.md, section "gpu/align.py".
"""

from __future__ import annotations

import torch

from raggedspec.gpu._common import arange_like, as_list, lengths, lengths_like
from raggedspec.gpu.cache import RaggedKv, concat_rows, split_rows
from raggedspec.reference.errors import AlignRefusal, CacheRefusal, require


def front_align_leads(lens) -> tuple[int, torch.Tensor]:
    """`(T, leads)` with `T = max(lens)` (0 when empty) and `leads = T - lens`: what
    `front_align_batch` returns for K/V slots, with no buffer touched."""
    lens = lengths(lens, name="lens")
    require(not bool((lens < 0).any()), f"lens {as_list(lens)} must be >= 0")
    target = int(lens.max()) if lens.numel() else 0
    return target, target - lens


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


def strip_dead_prefix(k_front: torch.Tensor, v_front: torch.Tensor, leads, current: int,
                      max_seq_len: int) -> RaggedKv:
    """`drop_dead_prefix` of every row at once: a front-aligned batch of `current` columns
    (row i's live run `[leads[i], current)`) back to the in-place layout with
    `lens = current - leads` (one gather per buffer, the buffer width kept: row i holds
    `drop_front_single`'s columns `[leads[i], width)`, then zeros). Refused
    (CacheRefusal, as `drop_front_single`) when a lead exceeds `current` ("cannot drop a
    {lead}-column dead prefix from a slot that holds only {n}")."""
    require(k_front.dim() == 4 and v_front.dim() == 4 and k_front.shape[:3] == v_front.shape[:3],
            f"k {list(k_front.shape)} and v {list(v_front.shape)} must be [B,H,W,*]")
    leads = lengths_like(leads, k_front, name="leads")
    b, _, width, _ = k_front.shape
    require(leads.numel() == b, f"{leads.numel()} leads for a batch of {b}")
    require(not bool((leads < 0).any()), f"dead-prefix leads {as_list(leads)} must be >= 0")
    require(0 <= current <= width, f"current {current} must lie in [0, width {width}]")
    over = leads > current
    if bool(over.any()):
        i = int(over.nonzero()[0, 0])
        raise CacheRefusal(
            f"cannot drop a {int(leads[i])}-column dead prefix from a slot that holds only "
            f"{current}"
        )
    src = arange_like(width, k_front)[None, :] + leads[:, None]     # [B, W]
    inside = src < width
    cols = src.clamp(max=max(width - 1, 0))
    return RaggedKv(_gather_live(k_front, cols, inside), _gather_live(v_front, cols, inside),
                    current - leads, max_seq_len)


def front_align_draft_group(kv: RaggedKv, starts) -> RaggedKv:
    """A ragged draft group in place: the same buffers with `lens = starts` (the
    reference clones, `set_len(start)`s and front-pads each row; here the shared buffers
    stay put and `materialize_front_aligned` of the result equals the reference's tensors).
    Refused (AlignRefusal, same messages) before anything changes: "{n} cache(s) for {m}
    chain start(s)"; no rows; "chain start {s} is past the {held} position(s) draft row
    {r} holds". ValueError on a negative start. `kv` itself is not modified."""
    starts = lengths_like(starts, kv.k, name="starts")
    require(not bool((starts < 0).any()), f"chain starts {as_list(starts)} must be >= 0")
    if kv.batch != starts.numel():
        raise AlignRefusal(f"{kv.batch} cache(s) for {starts.numel()} chain start(s)")
    if kv.batch == 0:
        raise AlignRefusal("front_align_draft_group was given no rows (0 caches, 0 chain starts)")
    past = starts > kv.lens
    if bool(past.any()):
        r = int(past.nonzero()[0, 0])
        raise AlignRefusal(
            f"chain start {int(starts[r])} is past the {int(kv.lens[r])} position(s) draft row "
            f"{r} holds"
        )
    return RaggedKv(kv.k, kv.v, starts, kv.max_seq_len)


def split_draft_cache(kv: RaggedKv, g: int) -> list[RaggedKv] | None:
    """g row sets (views; each row keeps its own length, so there is no prefix to strip);
    None when the piece count is not g."""
    return split_rows(kv, g)


def concat_kv(parts: list[RaggedKv]) -> RaggedKv:
    """Stack row sets, capacity zero-padded to the widest; rows keep their own lengths."""
    return concat_rows(parts)
