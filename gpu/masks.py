"""Masks by broadcast comparison (port of `reference.masks`).

Every mask is one comparison of broadcast index vectors, built on the device in one go:
no per-row loop. Validity helpers return bool tensors; masks are additive in the requested
float `dtype` (keep 0, kill -inf; both exact in every dtype, so masks are bit-exact across
dtypes and against the reference). Per-row quantities (`rows`, `live`, `positions`) are
int64 vectors; the vectorized forms take a vector wherever the reference takes one
integer per row.

Not ported (host-only, no tensor side): `past_kv_len` / `RaggedKvLens` (cache
introspection), `check_flash_placeholder_mask` (a shape check); `sdpa_sliding_window`,
`mask_must_be_applied_as_bias` and `raw_keep_span` are scalar rules, re-stated here so
the port module is complete.
"""

from __future__ import annotations

import torch

from raggedspec.gpu._common import (
    arange_like,
    arange_on,
    as_list,
    as_tensor_like,
    ints_on,
    lengths,
    neg_inf_where,
    on_device_of,
    to_device,
    zeros_on,
)
from raggedspec.reference.errors import MaskRefusal, require


def raw_keep_span(t_q: int, window: int, t_k_full: int) -> tuple[int, int]:
    """`keep = min(t_q + window - 1, t_k_full)`, `base = t_k_full - keep` (scalar rule)."""
    require(t_q >= 0 and t_k_full >= 0, f"t_q {t_q} and t_k_full {t_k_full} must be >= 0")
    require(t_q >= 1, f"t_q {t_q} must be >= 1: a forward with no query row reaches no key")
    require(window >= 1, f"window {window} must be >= 1 (dsv4 passes max(sliding_window, 1))")
    keep = min(t_q + window - 1, t_k_full)
    return t_k_full - keep, keep


def raw_validity(t_q: int, q0, raw_base, keep: int, window: int,
                 device: torch.device | str | None = None) -> torch.Tensor:
    """`bool [t_q, keep]` (or `[B, t_q, keep]` when `q0`/`raw_base` are `[B]` vectors):
    key `kp = raw_base + c` valid for query `qp = q0 + r` iff `qp - window < kp <= qp`."""
    require(t_q >= 0 and keep >= 0 and window >= 1,
            f"t_q {t_q}, keep {keep} must be >= 0 and window {window} >= 1")
    q0, raw_base = ints_on(q0), ints_on(raw_base)  # checked where they are, then moved
    require(not bool((q0 < 0).any() or (raw_base < 0).any()), "q0 and raw_base must be >= 0")
    q0 = to_device(q0, device)
    raw_base = on_device_of(raw_base, q0)
    qp = q0[..., None, None] + arange_like(t_q, q0)[:, None]
    kp = raw_base[..., None, None] + arange_like(keep, q0)[None, :]
    return (kp <= qp) & (kp > qp - window)


def compressed_validity(t_q: int, q0, t_c: int, ratio: int,
                        device: torch.device | str | None = None) -> torch.Tensor:
    """`bool [t_q, t_c]` (or `[B, t_q, t_c]` for a `[B]` vector `q0`): block b valid iff
    `b < floor((q0 + r + 1) / ratio)`. ValueError on `ratio < 1` with `t_c > 0`."""
    q0 = ints_on(q0)  # checked where it is (a host value on the CPU), then moved
    negative = bool((q0 < 0).any())
    if t_q < 0 or t_c < 0 or negative:
        raise ValueError(f"t_q {t_q}, q0 {as_list(q0.reshape(-1))}, t_c {t_c} must be >= 0")
    q0 = to_device(q0, device)
    if t_c == 0:
        return zeros_on(q0.shape + (t_q, 0), torch.bool, q0.device)
    require(ratio >= 1, f"compress ratio {ratio} must be >= 1 when there are {t_c} compressed keys")
    threshold = torch.div(q0[..., None] + arange_like(t_q, q0) + 1, ratio, rounding_mode="floor")
    return arange_like(t_c, q0) < threshold[..., None]


def ragged_union_mask(rows, q0: int, valid: torch.Tensor, raw_base: int, t_k: int, ratio: int,
                      t_c: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Additive `[B, 1, t_q, t_k + t_c]` from the rows' query positions, in one broadcast.

    Raw half: shared `valid[:, :t_k]` AND `raw_base + c >= lead_i` with `lead_i = q0 -
    rows[i]` (the dead prefix dies). Compressed half: rebuilt from each row's own position
    (`compressed_validity` with the `[B]` vector `rows`). Precondition (ValueError): rows in
    `[0, q0]` with max == q0 (what `resolve_ragged_rows` returns)."""
    require(valid.dim() == 2 and valid.shape[1] == t_k + t_c,
            f"valid shape {list(valid.shape)} must be [t_q, t_k + t_c = {t_k + t_c}]")
    rows = on_device_of(lengths(rows, name="rows"), valid)
    require(rows.numel() >= 1, "ragged_union_mask needs at least one row")
    require(
        not bool((rows < 0).any() or (rows > q0).any()) and int(rows.max()) == q0,
        f"rows {as_list(rows)} must lie in [0, q0={q0}] with max == q0 (resolve_ragged_rows first)",
    )
    require(raw_base >= 0 and t_k >= 0 and t_c >= 0,
            f"raw_base {raw_base}, t_k {t_k}, t_c {t_c} must be >= 0")
    t_q = valid.shape[0]
    lead = q0 - rows
    kp = raw_base + arange_like(t_k, valid)
    raw = valid[None, :, :t_k].bool() & (kp[None, None, :] >= lead[:, None, None])
    comp = compressed_validity(t_q, rows, t_c, ratio)
    return neg_inf_where(torch.cat([raw, comp], dim=2), dtype)[:, None]


def compose_caller_mask(local: torch.Tensor, caller: torch.Tensor | None, t_q: int, t_k_full: int,
                        raw_base: int, t_k: int, t_c: int) -> torch.Tensor:
    """Fold the caller's additive mask into the local union mask (reference
    `compose_caller_mask`, same refusals): None or one element -> `local`; rank 2 ->
    `[1,1,q,k]`, rank 4 kept, else MaskRefusal ("must be rank 2 ... or rank 4"); query axis
    `t_q` or 1 ("attention_mask query axis"); key axis `t_k_full + t_c` (raw slice plus the
    caller's compressed columns) or `t_k_full` (raw slice, compressed columns 0), else
    MaskRefusal ("attention_mask key axis"); then a broadcast sum."""
    if caller is None:
        return local
    caller = as_tensor_like(caller, local)
    if caller.numel() == 1:
        return local
    if caller.dim() == 2:
        caller = caller[None, None]
    elif caller.dim() != 4:
        raise MaskRefusal(
            f"attention_mask must be rank 2 [t_q, keys] or rank 4 [B, H, t_q, keys]; "
            f"got rank {caller.dim()} shape {list(caller.shape)}")
    if caller.shape[2] not in (t_q, 1):
        raise MaskRefusal(
            f"attention_mask query axis {caller.shape[2]} is neither t_q {t_q} nor 1 "
            f"(shape {list(caller.shape)})")
    width = caller.shape[3]
    raw = caller[..., raw_base: raw_base + t_k]
    if width == t_k_full + t_c:
        comp = caller[..., t_k_full:]
    elif width == t_k_full:
        comp = caller.new_zeros(caller.shape[:3] + (t_c,))
    else:
        raise MaskRefusal(
            f"attention_mask key axis {width} is neither t_k_full {t_k_full} nor "
            f"t_k_full + t_c {t_k_full + t_c}")
    require(
        raw.shape[3] == t_k, f"raw slice [{raw_base}, {raw_base + t_k}) exceeds key axis {width}"
    )
    return local + torch.cat([raw, comp], dim=3)


def sdpa_sliding_window(ratio: int, w: int) -> int | None:
    """Standard (ratio 0 or 1) -> `w`; CSA/HCA -> None."""
    require(ratio >= 0 and w >= 0, f"ratio {ratio} and window {w} must be >= 0")
    return w if ratio <= 1 else None


def graph_mode_length_mask(positions, cap: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Additive `[B,1,1,cap]`: slot s of row b kept iff `s <= positions[b]`."""
    positions = lengths(positions, name="positions")
    require(cap >= 0 and not bool((positions < 0).any()),
            f"cap {cap} and positions {as_list(positions)} must be >= 0")
    keep = arange_like(cap, positions)[None, :] <= positions[:, None]
    return neg_inf_where(keep, dtype)[:, None, None, :]


def require_graph_length_mask(mask: torch.Tensor | None) -> torch.Tensor:
    """MaskRefusal ("graph-decode arm", "unset") when the length mask is None."""
    if mask is None:
        raise MaskRefusal("the graph-decode arm refuses to run: its length mask is unset (None)")
    return mask


def make_left_padded_causal_mask(b: int, t_q: int, past: int, live,
                                 dtype: torch.dtype = torch.float64,
                                 device: torch.device | str | None = None) -> torch.Tensor:
    """Additive `[B,1,t_q,past+t_q]`: query i of row b keeps column j iff
    `past - live_b <= j <= past + i`. MaskRefusal: `len(live) != b` ("live lengths for a
    batch of"), any `live_b > past` ("exceeds the padded width", first such row named).
    `live` is checked where it is; the mask is built on `device` (None: where `live` is)."""
    require(b >= 0 and t_q >= 0 and past >= 0, f"b {b}, t_q {t_q}, past {past} must be >= 0")
    live = lengths(live, name="live")
    require(not bool((live < 0).any()), f"live lengths {as_list(live)} must be >= 0")
    if live.numel() != b:
        raise MaskRefusal(f"{live.numel()} live lengths for a batch of {b}")
    over = live > past
    if bool(over.any()):
        i = int(over.nonzero()[0, 0])
        raise MaskRefusal(f"row {i} live length {int(live[i])} exceeds the padded width {past}")
    live = to_device(live, device)
    lead = (past - live)[:, None, None]
    j = arange_like(past + t_q, live)[None, None, :]
    last = past + arange_like(t_q, live)[None, :, None]
    return neg_inf_where((j >= lead) & (j <= last), dtype)[:, None]


def _ragged_live(b: int, past: int, per_seq_kv_lens, channel_lead) -> torch.Tensor | None:
    """The masker's ragged source: the cache's per-seq lens; else `past - lead` when the
    channel lead has `len == b`, some lead > 0 and none > past; else None."""
    if per_seq_kv_lens is not None:
        return lengths(per_seq_kv_lens, name="per_seq_kv_lens")
    if channel_lead is not None:
        lead = lengths(channel_lead, name="channel_lead")
        if lead.numel() == b and bool((lead > 0).any()) and not bool((lead > past).any()):
            return past - lead
    return None


def make_causal_mask_matrix(b: int, t_q: int, past: int, per_seq_kv_lens, channel_lead,
                            flash_on_cuda: bool = False, device: torch.device | str | None = None,
                            dtype: torch.dtype = torch.float64) -> torch.Tensor | None:
    """The masker's causal entry point, same order as the reference: (1) per-seq lens ->
    left-padded; (2) channel lead (len b, some > 0, no underflow) -> left-padded; (3)
    `t_q == 1` -> None; (4) flash on CUDA -> `[1,1]` zeros; (5) rank-2 causal."""
    require(b >= 0 and t_q >= 0 and past >= 0, f"b {b}, t_q {t_q}, past {past} must be >= 0")
    live = _ragged_live(b, past, per_seq_kv_lens, channel_lead)
    if live is not None:
        return make_left_padded_causal_mask(b, t_q, past, live, dtype, device)
    if t_q == 1:
        return None
    if flash_on_cuda:
        return zeros_on((1, 1), dtype, device)
    j = arange_on(past + t_q, device)[None, :]
    i = arange_on(t_q, device)[:, None]
    return neg_inf_where(j <= i + past, dtype)


SLIDING_WINDOW_RAGGED_POLICIES = ("none", "channel")


def make_sliding_window_causal_mask_matrix(
    b: int,
    t_q: int,
    past: int,
    per_seq_kv_lens,
    channel_lead,
    window: int,
    sliding_window_ragged: str = "none",
    flash_on_cuda: bool = False,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float64,
) -> torch.Tensor | None:
    """The sliding-window masker with the reference's policy switch ("none" | "channel");
    same branches, refusals and window convention (`last - window < j <= last`)."""
    require(sliding_window_ragged in SLIDING_WINDOW_RAGGED_POLICIES,
            f"sliding_window_ragged {sliding_window_ragged!r} must be one of "
            f"{SLIDING_WINDOW_RAGGED_POLICIES}")
    require(window >= 1, f"window {window} must be >= 1")
    require(b >= 0 and t_q >= 0 and past >= 0, f"b {b}, t_q {t_q}, past {past} must be >= 0")
    j = arange_on(past + t_q, device)
    last = past + arange_on(t_q, device)[:, None]
    in_window = (j[None, :] <= last) & (j[None, :] > last - window)
    if sliding_window_ragged == "channel":
        live = _ragged_live(b, past, per_seq_kv_lens, channel_lead)
        if live is not None:
            dead = make_left_padded_causal_mask(b, t_q, past, on_device_of(live, j), dtype)
            return dead + neg_inf_where(in_window, dtype)[None, None]
    if t_q == 1:
        return None
    if flash_on_cuda:
        return zeros_on((1, 1), dtype, device)
    return neg_inf_where(in_window, dtype)


def mask_must_be_applied_as_bias(dims) -> bool:
    """True iff a mask exists and has rank >= 3."""
    return dims is not None and len(dims) >= 3
