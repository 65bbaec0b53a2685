"""Masks by broadcast comparison (port of `reference.masks`): the ones the port's attention
builds (the dsv4 raw and compressed validity, the ragged union mask, the caller-mask fold).

Every mask is one comparison of broadcast index vectors, built on the device in one go:
no per-row loop. Validity helpers return bool tensors; masks are additive in the requested
float `dtype` (keep 0, kill -inf; both exact in every dtype, so masks are bit-exact across
dtypes and against the reference). Per-row query positions are int64 vectors; the
vectorized forms take a vector wherever the reference takes one integer per row.

Not ported: the integer rules (`raw_keep_span`, `sdpa_sliding_window`,
`mask_must_be_applied_as_bias`, `check_flash_placeholder_mask`, `past_kv_len`), which the port
calls from the reference, and the masker's causal masks (§8-§9: graph-mode length mask,
left-padded and sliding-window causal masks), which no path of the port builds (its attention
is dsv4's union mask).
"""

from __future__ import annotations

import numpy as np
import torch

from raggedspec.gpu._common import (
    arange_like,
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
                        device: torch.device | str | None = None,
                        dev_q0: torch.Tensor | None = None) -> torch.Tensor:
    """`bool [t_q, t_c]` (or `[B, t_q, t_c]` for a `[B]` vector `q0`): block b valid iff
    `b < floor((q0 + r + 1) / ratio)`. `dev_q0`: the host `q0`'s values already on the device
    (checked on the host, read instead of an upload; `device` None then). ValueError on
    `ratio < 1` with `t_c > 0`."""
    host = None if isinstance(q0, torch.Tensor) else np.asarray(q0, dtype=np.int64)
    q0 = ints_on(q0) if dev_q0 is None else dev_q0  # checked where it is, then moved
    negative = bool((host < 0).any()) if host is not None else bool((q0 < 0).any())
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
