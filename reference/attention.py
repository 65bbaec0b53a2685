"""Attention: the plain additive-mask softmax oracle and DeepSeek V4's `dsv4_attention`
(spec: masks-and-scheduling.md §4, §12).

`attention` is deliberately plain (it is the oracle a GPU port is compared against):
logits `q k^T / sqrt(D) + mask`, softmax over the keys with an optional per-head sink logit
as a denominator-only column, then `@ v`. Masked columns contribute `exp(-inf) = 0` exactly,
so the contents of masked keys/values never reach the output (finite contents assumed).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from raggedspec.reference.dispatch import resolve_ragged_rows
from raggedspec.reference.errors import DispatchRefusal, MaskRefusal, require
from raggedspec.reference.masks import (
    compose_caller_mask,
    compressed_validity,
    ragged_union_mask,
    raw_keep_span,
    raw_validity,
)

dsv4_mask_stats = {"uniform": 0, "ragged": 0}
"""Which mask path `dsv4_attention` built: "uniform" (`row_q0` resolved to None, one
`[1,1,t_q,n]` mask) or "ragged" (`ragged_union_mask`). A uniform batch must never reach
"ragged" even though both paths give bit-identical outputs there."""


def reset_dsv4_mask_stats() -> None:
    """Zero both path counters."""
    for key in dsv4_mask_stats:
        dsv4_mask_stats[key] = 0


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, mask: np.ndarray | None,
              sinks: np.ndarray | None = None) -> np.ndarray:
    """Softmax attention `[B,H,t_q,Dv]` with an additive mask and optional sinks.

    `q [B,H,t_q,D]`, `k [B,Hk,t_k,D]`, `v [B,Hk,t_k,Dv]` with Hk dividing H (query head h
    reads KV head `h // (H // Hk)`); `mask` additive, broadcastable to `[B,H,t_q,t_k]`, or
    None; `sinks [H]` a per-head logit that joins the softmax denominator only (it has no
    value row). Scale `1/sqrt(D)`. The running max includes the sink (same math, stable).
    Unspecified, chosen: a query row whose every key is masked and that has no sink returns
    0 (the FlashAttention convention), never NaN. No refusals; ValueError on bad shapes.
    """
    q, k, v = (np.asarray(a, dtype=np.float64) for a in (q, k, v))
    require(q.ndim == 4 and k.ndim == 4 and v.ndim == 4,
            f"q {q.shape}, k {k.shape}, v {v.shape} must all be rank 4")
    b, h, t_q, d = q.shape
    require(k.shape[0] == b and v.shape[0] == b and k.shape[3] == d,
            f"batch/head-dim mismatch: q {q.shape}, k {k.shape}")
    require(k.shape[:3] == v.shape[:3], f"k {k.shape} and v {v.shape} must share [B,Hk,t_k]")
    hk = k.shape[1]
    require(hk >= 1 and h % hk == 0, f"KV heads {hk} must divide query heads {h}")
    if hk != h:
        k = np.repeat(k, h // hk, axis=1)
        v = np.repeat(v, h // hk, axis=1)
    logits = np.matmul(q, np.swapaxes(k, -1, -2)) * (1.0 / np.sqrt(d))
    if mask is not None:
        logits = logits + np.asarray(mask, dtype=np.float64)
    m = logits.max(axis=-1, keepdims=True) if logits.shape[-1] else np.full(
        logits.shape[:-1] + (1,), -np.inf)
    if sinks is not None:
        sinks = np.asarray(sinks, dtype=np.float64)
        require(sinks.shape == (h,), f"sinks shape {sinks.shape} must be [{h}]")
        sink = np.broadcast_to(sinks[None, :, None, None], m.shape)
        m = np.maximum(m, sink)
    m = np.where(np.isfinite(m), m, 0.0)
    p = np.exp(logits - m)
    denom = p.sum(axis=-1, keepdims=True)
    if sinks is not None:
        denom = denom + np.exp(sink - m)
    out = np.matmul(p, v)
    safe = np.where(denom > 0, denom, 1.0)
    return np.where(denom > 0, out / safe, 0.0)


@dataclass
class Dsv4AttentionConfig:
    """`cfg` of `dsv4_attention`: `compress_ratio` (0 = Standard, 4 = CSA, 128 = HCA),
    `sliding_window` (window = max(sliding_window, 1)), `raw_prefix` (raw columns already
    dropped before `k`), `row_q0` (per-row absolute position of query 0, or None).
    Not modelled: the newer `graph_positions` field (its content is unspecified)."""

    compress_ratio: int
    sliding_window: int
    raw_prefix: int = 0
    row_q0: list[int] | None = None


def is_standard_layer(compress_ratio: int) -> bool:
    """Standard (uncompressed) layer: config ratio 0 (internal ratio value 1)."""
    return compress_ratio <= 1


def absorbed_decode_eligible(t_q: int, n_kv_heads: int, has_sinks: bool,
                             no_absorbed_decode: bool = False) -> bool:
    """§4 step 9 gate (a predicate only; both kernels compute the same math here): absorbed
    MQA decode iff `t_q == 1`, one KV head, sinks present, and `ARC_V4_NO_ABSORBED_DECODE`
    unset (`no_absorbed_decode` False). Otherwise SDPA with `Some(mask)`."""
    return t_q == 1 and n_kv_heads == 1 and has_sinks and not no_absorbed_decode


def dsv4_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, compressed_kv: np.ndarray | None,
                   attention_mask: np.ndarray | None, cfg: Dsv4AttentionConfig,
                   sinks: np.ndarray | None = None) -> np.ndarray:
    """DeepSeek V4 union attention `[B,H,t_q,D]` over `[raw window keys ++ compressed keys]`.

    `q [B,H,t_q,D]` (post-RoPE); `k, v [B,Hk,t_k_given,D]`, the raw keys after this step's
    append, starting at absolute column `cfg.raw_prefix`, with `Hk` KV heads dividing H
    (query head h reads KV head `h // (H // Hk)`; V4 has Hk = 1); `compressed_kv
    [B,Hk,t_c,D]` (both key and value, per KV head; row b = absolute block b of that row)
    or None; `attention_mask` the caller's additive mask (see `compose_caller_mask`);
    `sinks [H]` or None. The masks are the same for every head.

    Steps (spec §4): a Standard layer forces `compressed_kv = None`;
    `t_k_full = raw_prefix + t_k_given`, `window = max(sliding_window, 1)`,
    `q0 = t_k_full - t_q`; `row_q0 = resolve_ragged_rows(cfg.row_q0, q0, B)`;
    `(raw_base, keep) = raw_keep_span(t_q, window, t_k_full)`, K/V narrowed to
    `[raw_base - raw_prefix, + keep)`; union validity = raw ++ compressed; uniform -> one
    `[1,1,t_q,n]` mask, ragged -> `ragged_union_mask`; fold the caller mask; attend.
    Invariants: `raw_prefix` is pure accounting (bit-identical); a uniform `row_q0` is
    bit-identical to None (it never reaches the ragged path: see `dsv4_mask_stats`); a
    front-aligned ragged batch gives each row its solo result (up to float64 summation
    order), whatever its dead prefix holds.

    Refusals: MaskRefusal when `t_q > t_k_full` ("query rows against only ... keys") or when
    `raw_base < raw_prefix` ("are NOT" held); DispatchRefusal from `resolve_ragged_rows`;
    MaskRefusal from `compose_caller_mask`. ValueError on malformed shapes.
    Not modelled: `ARC_V4_STANDARD_DENSE` (A/B-only plain SDPA for Standard layers).
    """
    q, k, v, compressed_kv = _checked_operands(q, k, v, compressed_kv, cfg)
    b, _, t_q, _ = q.shape
    t_c = 0 if compressed_kv is None else compressed_kv.shape[2]
    t_k_full, window, q0 = key_geometry(t_q, k.shape[2], cfg)
    rows = resolve_ragged_rows(cfg.row_q0, q0, b)
    raw_base, keep = raw_keep_span(t_q, window, t_k_full)
    k_raw, v_raw = held_window(k, v, raw_base, keep, cfg.raw_prefix)
    valid = np.concatenate([raw_validity(t_q, q0, raw_base, keep, window),
                            compressed_validity(t_q, q0, t_c, cfg.compress_ratio)], axis=1)
    local = _union_mask(rows, q0, valid, raw_base, keep, cfg.compress_ratio, t_c)
    mask = compose_caller_mask(local, attention_mask, t_q, t_k_full, raw_base, keep, t_c)
    if compressed_kv is not None:
        k_raw = np.concatenate([k_raw, compressed_kv], axis=2)
        v_raw = np.concatenate([v_raw, compressed_kv], axis=2)
    return attention(q, k_raw, v_raw, mask, sinks)


def _checked_operands(q, k, v, compressed_kv, cfg: Dsv4AttentionConfig):
    """`q, k, v, compressed_kv` as float64, `compressed_kv` None on a Standard layer (spec §4
    step 1: it never reads compressed keys). Refuses with ValueError: operands not rank 4, `k`
    and `v` not `[B,Hk,t_k,D]` alike, `Hk` not dividing `H`, a negative `raw_prefix` or
    `compress_ratio`, `compressed_kv` not `[B,Hk,t_c,D]`."""
    q, k, v = (np.asarray(a, dtype=np.float64) for a in (q, k, v))
    require(q.ndim == 4 and k.ndim == 4 and v.ndim == 4,
            f"q {q.shape}, k {k.shape}, v {v.shape} must all be rank 4")
    b, h, _, d = q.shape
    require(k.shape == v.shape and k.shape[0] == b and k.shape[3] == d,
            f"k {k.shape} and v {v.shape} must both be [B={b},Hk,t_k,D={d}]")
    hk = k.shape[1]
    require(hk >= 1 and h % hk == 0, f"KV heads {hk} must divide query heads {h}")
    require(cfg.raw_prefix >= 0 and cfg.compress_ratio >= 0,
            f"raw_prefix {cfg.raw_prefix} and compress_ratio {cfg.compress_ratio} must be >= 0")
    if is_standard_layer(cfg.compress_ratio) or compressed_kv is None:
        return q, k, v, None
    compressed_kv = np.asarray(compressed_kv, dtype=np.float64)
    require(compressed_kv.ndim == 4 and compressed_kv.shape[:2] == (b, hk)
            and compressed_kv.shape[3] == d,
            f"compressed_kv {compressed_kv.shape} must be [B={b},{hk},t_c,D={d}]")
    return q, k, v, compressed_kv


def key_geometry(t_q: int, t_k: int, cfg) -> tuple[int, int, int]:
    """`(t_k_full, window, q0)` of a call with `t_q` queries and `t_k` given raw keys after
    `cfg.raw_prefix` unheld ones: the full key count, the window (at least 1) and the first
    query's absolute position `t_k_full - t_q`. Refuses with MaskRefusal when `t_q >
    t_k_full` ("query rows against only ... keys"). The port calls it too."""
    t_k_full = cfg.raw_prefix + t_k
    if t_q > t_k_full:
        raise MaskRefusal(f"{t_q} query rows against only {t_k_full} keys")
    return t_k_full, max(cfg.sliding_window, 1), t_k_full - t_q


def held_window(k, v, raw_base: int, keep: int, raw_prefix: int):
    """`k, v` (`[B,H,T,D]` arrays or tensors) narrowed to the absolute columns `[raw_base,
    raw_base + keep)`; the given keys start at absolute column `raw_prefix`. Refuses with
    MaskRefusal when the window reaches columns before `raw_prefix` ("are NOT" held). The
    port calls it too."""
    rel_base = raw_base - raw_prefix
    if rel_base < 0:
        raise MaskRefusal(
            f"raw keys [{raw_base}, {raw_prefix}) reachable by the window are NOT held: "
            f"raw_prefix {raw_prefix} > raw_base {raw_base}")
    return k[:, :, rel_base: rel_base + keep], v[:, :, rel_base: rel_base + keep]


def _union_mask(rows, q0: int, valid: np.ndarray, raw_base: int, keep: int,
                compress_ratio: int, t_c: int) -> np.ndarray:
    """The additive union mask before the caller's: one `[1,1,t_q,n]` mask from `valid` when
    `rows` is None (uniform), else `ragged_union_mask`; counts the path in `dsv4_mask_stats`.
    No refusals of its own."""
    if rows is None:
        dsv4_mask_stats["uniform"] += 1
        return np.where(valid, 0.0, -np.inf)[None, None]
    dsv4_mask_stats["ragged"] += 1
    return ragged_union_mask(rows, q0, valid, raw_base, keep, compress_ratio, t_c)


def xs_history_should_reset(seqlen_offsets: Sequence[int]) -> bool:
    """Spec §12: the compressor (xs) history slot is `reset()` iff **all**
    `seqlen_offsets == 0` (a fresh prompt for every row). Unspecified, chosen: an empty
    offsets list resets (vacuous truth, as Rust's `iter().all`). No refusals."""
    return all(int(o) == 0 for o in seqlen_offsets)


def v4_paged_dispatch_precheck(bs: int) -> None:
    """Spec §12: the paged arm refuses a batch of more than one row (DispatchRefusal naming
    `bs`); returns None for `bs <= 1`."""
    require(bs >= 0, f"batch size {bs} must be >= 0")
    if bs > 1:
        raise DispatchRefusal(f"v4_paged_dispatch_precheck refuses bs={bs} > 1 on the paged arm")
