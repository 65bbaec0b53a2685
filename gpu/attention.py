"""Sink softmax attention and DeepSeek V4's `dsv4_attention` (port of `reference.attention`).

`attention` is the batched dense form an engine runs when it needs an arbitrary additive
mask: logits `q k^T / sqrt(D) + mask`, a softmax whose denominator also holds a per-head
sink logit (no value row), then `@ v`. Grouped KV heads are expanded by a broadcast view.
Half-precision inputs (bfloat16, float16) are computed in float32 and cast back (the
accumulate-in-float32 convention of fused kernels); float32 and float64 run in their own
dtype. A query row with every key masked and no sink returns 0, never NaN (as the reference).

`dsv4_attention` follows the reference step for step (same refusals and messages, same
`dsv4_mask_stats` observability): the integer rules (`resolve_ragged_rows`, `raw_keep_span`)
are the reference's own, run on host integers (a device `row_q0` is read once); the union
mask is built by broadcast comparison (`gpu.masks`), on the uniform path a single
`[1,1,t_q,n]` mask, on the ragged path `ragged_union_mask` from the per-row query positions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from raggedspec.gpu._common import arange_like, as_list, lengths, neg_inf_where
from raggedspec.gpu.masks import (
    compose_caller_mask,
    compressed_validity,
    ragged_union_mask,
    raw_validity,
)
from raggedspec.reference.attention import held_window, key_geometry
from raggedspec.reference.dispatch import resolve_ragged_rows
from raggedspec.reference.errors import MaskRefusal, require  # noqa: F401 (MaskRefusal re-exported)
from raggedspec.reference.masks import raw_keep_span

dsv4_mask_stats = {"uniform": 0, "ragged": 0}
"""Which mask path `dsv4_attention` built (a uniform batch must never reach "ragged")."""


def reset_dsv4_mask_stats() -> None:
    for key in dsv4_mask_stats:
        dsv4_mask_stats[key] = 0


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
              sinks: torch.Tensor | None = None) -> torch.Tensor:
    """`[B,H,t_q,Dv]` in `q.dtype`: softmax(`q k^T / sqrt(D) + mask`) with the per-head
    `sinks [H]` as a denominator-only column, `@ v`. `k, v [B,Hk,t_k,*]` with Hk dividing H
    (query head h reads KV head `h // (H // Hk)`); `mask` additive, broadcastable to
    `[B,H,t_q,t_k]`, or None. ValueError on bad shapes."""
    require(q.dim() == 4 and k.dim() == 4 and v.dim() == 4,
            f"q {list(q.shape)}, k {list(k.shape)}, v {list(v.shape)} must all be rank 4")
    b, h, t_q, d = q.shape
    require(k.shape[0] == b and v.shape[0] == b and k.shape[3] == d,
            f"batch/head-dim mismatch: q {list(q.shape)}, k {list(k.shape)}")
    require(
        k.shape[:3] == v.shape[:3], f"k {list(k.shape)} and v {list(v.shape)} must share [B,Hk,t_k]"
    )
    hk = k.shape[1]
    require(hk >= 1 and h % hk == 0, f"KV heads {hk} must divide query heads {h}")
    out_dtype, cd = q.dtype, _compute_dtype(q.dtype)
    qc = q.to(cd).unflatten(1, (hk, h // hk))              # [B, Hk, G, t_q, D]
    kc, vc = k.to(cd)[:, :, None], v.to(cd)[:, :, None]     # [B, Hk, 1, t_k, *]
    logits = (qc @ kc.transpose(-1, -2)).flatten(1, 2) * (1.0 / math.sqrt(d))
    if mask is not None:
        logits = logits + mask.to(logits)  # the compute dtype, on the logits' device
    if logits.shape[-1]:
        m = logits.amax(dim=-1, keepdim=True)
    else:
        m = logits.new_full(logits.shape[:-1] + (1,), float("-inf"))
    if sinks is not None:
        require(sinks.shape == (h,), f"sinks shape {list(sinks.shape)} must be [{h}]")
        sink = sinks.to(logits)[None, :, None, None]
        m = torch.maximum(m, sink)
    m = torch.where(torch.isfinite(m), m, m.new_zeros(()))
    p = torch.exp(logits - m)
    denom = p.sum(dim=-1, keepdim=True)
    if sinks is not None:
        denom = denom + torch.exp(sink - m)
    out = (p.unflatten(1, (hk, h // hk)) @ vc).flatten(1, 2)
    positive = denom > 0
    out = torch.where(positive, out / torch.where(positive, denom, torch.ones_like(denom)),
                      out.new_zeros(()))
    return out.to(out_dtype)


@dataclass
class Dsv4AttentionConfig:
    """As `reference.attention.Dsv4AttentionConfig`; `row_q0` may be a list or an int64
    tensor."""

    compress_ratio: int
    sliding_window: int
    raw_prefix: int = 0
    row_q0: object = None


def is_standard_layer(compress_ratio: int) -> bool:
    return compress_ratio <= 1


def dsv4_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   compressed_kv: torch.Tensor | None, attention_mask: torch.Tensor | None, cfg,
                   sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Union attention `[B,H,t_q,D]` over `[raw window keys ++ compressed keys]`, the
    reference's steps and refusals: Standard layers drop `compressed_kv`;
    `t_k_full = raw_prefix + t_k_given`, `window = max(sliding_window, 1)`,
    `q0 = t_k_full - t_q` (MaskRefusal "query rows against only" when negative);
    `row_q0` through `resolve_ragged_rows` (DispatchRefusal); `raw_keep_span` and the
    narrowing (MaskRefusal "are NOT" held when `raw_base < raw_prefix`); validity by
    broadcast; uniform -> one `[1,1,t_q,n]` mask, ragged -> `ragged_union_mask`; caller
    mask folded (its MaskRefusals); `attention`. Masks are built in the compute dtype.
    `k, v [B,Hk,t_k,D]` and `compressed_kv [B,Hk,t_c,D]` with Hk dividing H (query head h
    reads KV head `h // (H // Hk)`, as the reference); `compressed_kv` joins the raw keys
    and values rounded to their dtypes (k's, v's). `cfg` is a `Dsv4AttentionConfig` of
    this module or of the reference."""
    compressed_kv = _checked_operands(q, k, v, compressed_kv, cfg)
    b, _, t_q, _ = q.shape
    t_c = 0 if compressed_kv is None else compressed_kv.shape[2]
    t_k_full, window, q0 = key_geometry(t_q, k.shape[2], cfg)
    given = None if cfg.row_q0 is None else as_list(lengths(cfg.row_q0, name="row_q0"))
    rows = resolve_ragged_rows(given, q0, b)  # the reference's rule, on host integers
    raw_base, keep = raw_keep_span(t_q, window, t_k_full)
    k_raw, v_raw = held_window(k, v, raw_base, keep, cfg.raw_prefix)
    dev, cd = q.device, _compute_dtype(q.dtype)
    valid = torch.cat([raw_validity(t_q, q0, raw_base, keep, window, device=dev),
                       compressed_validity(t_q, q0, t_c, cfg.compress_ratio, device=dev)], dim=1)
    local = _union_mask(rows, q0, valid, raw_base, keep, cfg.compress_ratio, t_c, cd)
    mask = compose_caller_mask(local, attention_mask, t_q, t_k_full, raw_base, keep, t_c)
    if compressed_kv is not None:
        k_raw = torch.cat([k_raw, compressed_kv.to(k.dtype)], dim=2)
        v_raw = torch.cat([v_raw, compressed_kv.to(v.dtype)], dim=2)
    return attention(q, k_raw, v_raw, mask, sinks)


def _checked_operands(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      compressed_kv: torch.Tensor | None, cfg) -> torch.Tensor | None:
    """`compressed_kv`, or None on a Standard layer (it never reads compressed keys), the
    reference's `_checked_operands` on tensors. Refuses with ValueError: operands not rank 4,
    `k` and `v` not `[B,Hk,t_k,D]` alike, `Hk` not dividing `H`, a negative `raw_prefix` or
    `compress_ratio`, `compressed_kv` not `[B,Hk,t_c,D]`."""
    require(q.dim() == 4 and k.dim() == 4 and v.dim() == 4,
            f"q {list(q.shape)}, k {list(k.shape)}, v {list(v.shape)} must all be rank 4")
    b, h, _, d = q.shape
    require(k.shape == v.shape and k.shape[0] == b and k.shape[3] == d,
            f"k {list(k.shape)} and v {list(v.shape)} must both be [B={b},Hk,t_k,D={d}]")
    hk = k.shape[1]
    require(hk >= 1 and h % hk == 0, f"KV heads {hk} must divide query heads {h}")
    require(cfg.raw_prefix >= 0 and cfg.compress_ratio >= 0,
            f"raw_prefix {cfg.raw_prefix} and compress_ratio {cfg.compress_ratio} must be >= 0")
    if is_standard_layer(cfg.compress_ratio) or compressed_kv is None:
        return None
    require(compressed_kv.dim() == 4 and tuple(compressed_kv.shape[:2]) == (b, hk)
            and compressed_kv.shape[3] == d,
            f"compressed_kv {list(compressed_kv.shape)} must be [B={b},{hk},t_c,D={d}]")
    return compressed_kv


def _union_mask(rows, q0: int, valid: torch.Tensor, raw_base: int, keep: int,
                compress_ratio: int, t_c: int, cd: torch.dtype) -> torch.Tensor:
    """The additive union mask before the caller's, in the compute dtype `cd`: one
    `[1,1,t_q,n]` mask from `valid` when `rows` is None (uniform), else `ragged_union_mask`;
    counts the path in `dsv4_mask_stats`. No refusals of its own."""
    if rows is None:
        dsv4_mask_stats["uniform"] += 1
        return neg_inf_where(valid, cd)[None, None]
    dsv4_mask_stats["ragged"] += 1
    return ragged_union_mask(rows, q0, valid, raw_base, keep, compress_ratio, t_c, cd)


def dsv4_attention_in_place(
    q: torch.Tensor,
    kv,
    compressed_kv: torch.Tensor | None,
    compress_ratio: int,
    sliding_window: int,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """`dsv4_attention` over the port's in-place layout (`gpu.cache.RaggedKv [B,Hk,cap,D]`,
    Hk KV heads dividing H: query head h reads KV head `h // (H // Hk)`; V4 has Hk = 1),
    with no front-aligned copy: the raw window is one per-row gather, the masks per-row
    offsets (the same for every head).

    `q [B,H,t_q,D]` this step's queries; `kv` after this step's append, so row i's queries
    sit at its own positions `lens[i] - t_q + r`; `compressed_kv [B,Hk,t_c,D]` start-anchored
    (row i's block b at index b) or None. Per row: `keep = min(t_q + window - 1, max(lens))`
    raw columns ending at its own end (`base_i = lens[i] - keep`; columns below 0 are dead),
    valid iff `qp - window < kp <= qp`; compressed block b valid iff
    `b < floor((qp + 1) / ratio)`. Equals the reference's `dsv4_attention` of the
    materialized front-aligned batch with `row_q0 = lens - t_q` (up to float summation
    order). Refusal: MaskRefusal "query rows against only" for a row shorter than `t_q`.
    The mask is built in the compute dtype; `compressed_kv` joins the raw keys and values
    rounded to the cache's dtype. Not modelled here: `raw_prefix` (windowed eviction) and a
    caller mask. ValueError on shapes that disagree, including Hk not dividing H."""
    require(
        q.dim() == 4
        and q.shape[1] % kv.k.shape[1] == 0
        and q.shape[0] == kv.batch
        and q.shape[3] == kv.k.shape[3],
        f"q {list(q.shape)} against kv {list(kv.k.shape)}: need [B,H,t_q,D] and [B,Hk,cap,D] "
        "with Hk dividing H",
    )
    b, _, t_q, d = q.shape
    hk = kv.k.shape[1]
    cd = _compute_dtype(q.dtype)
    lens = kv.lens
    host = kv.host_lens()  # decided on the host copy of the lengths: no device read
    short = np.flatnonzero(host < t_q)
    if short.size:
        raise MaskRefusal(f"{t_q} query rows against only {int(host[short[0]])} keys")
    window = max(sliding_window, 1)
    top = int(host.max())
    keep = min(t_q + window - 1, top)
    cols = (lens - keep)[:, None] + arange_like(keep, lens)[None, :]                # [B, keep]
    index = cols.clamp(min=0)[:, None, :, None].expand(b, hk, keep, d)
    k_raw, v_raw = kv.k.gather(2, index), kv.v.gather(2, index)
    q0 = lens - t_q
    qp = q0[:, None] + arange_like(t_q, lens)[None, :]                               # [B, t_q]
    kp = cols[:, None, :]
    raw = (kp >= 0) & (kp <= qp[:, :, None]) & (kp > qp[:, :, None] - window)
    if is_standard_layer(compress_ratio) or compressed_kv is None:
        valid, k_all, v_all = raw, k_raw, v_raw
    else:
        comp = compressed_validity(t_q, host - t_q, compressed_kv.shape[2], compress_ratio,
                                   dev_q0=q0)
        valid = torch.cat([raw, comp], dim=2)
        k_all = torch.cat([k_raw, compressed_kv.to(k_raw.dtype)], dim=2)
        v_all = torch.cat([v_raw, compressed_kv.to(v_raw.dtype)], dim=2)
    return attention(q, k_all, v_all, neg_inf_where(valid, cd)[:, None], sinks)
