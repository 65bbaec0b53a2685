"""Masks: the dsv4 raw/compressed validity rules, the ragged union mask, the caller-mask
fold, the masker's left-padded causal masks, and the small mask-routing predicates.

Spec: masks-and-scheduling.md §3, §5, §6, §7, §8, §9, §10. Every mask is *additive*
float64: keep = 0.0, kill = -inf. Validity helpers return booleans. "Ragged" always means
front-aligned (left-padded): row i's live run ends at the batch's shared end column, and its
first `lead_i` columns are a dead prefix that must be killed (a zero K row is not masked:
logit 0 still takes softmax weight).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from raggedspec.reference.errors import MaskRefusal, require

NEG_INF = -np.inf


def _additive(keep: np.ndarray) -> np.ndarray:
    """Booleans -> additive float64 (True -> 0.0, False -> -inf)."""
    return np.where(keep, 0.0, NEG_INF)


# --------------------------------------------------------------------------- §3


def raw_keep_span(t_q: int, window: int, t_k_full: int) -> tuple[int, int]:
    """`(base, keep)` of the raw keys any query of this step can reach (spec §3).

    `keep = min(t_q + window - 1, t_k_full)`, `base = t_k_full - keep`. Invariant: with the
    queries at the last `t_q` absolute positions (`q0 = t_k_full - t_q`) and validity
    `kp <= qp and kp > qp - window`, the reachable keys are exactly `[base, t_k_full)`, so
    dropping every key before `base` is exact. No refusals; malformed input (negative
    `t_q`/`t_k_full`, `window < 1`, and `t_q == 0`: with no query row nothing is reachable,
    yet the formula would keep `window - 1` keys) raises ValueError.
    """
    require(t_q >= 0 and t_k_full >= 0, f"t_q {t_q} and t_k_full {t_k_full} must be >= 0")
    require(t_q >= 1, f"t_q {t_q} must be >= 1: a forward with no query row reaches no key")
    require(window >= 1, f"window {window} must be >= 1 (dsv4 passes max(sliding_window, 1))")
    keep = min(t_q + window - 1, t_k_full)
    return t_k_full - keep, keep


def raw_validity(t_q: int, q0: int, raw_base: int, keep: int, window: int) -> np.ndarray:
    """Shared raw validity `bool [t_q, keep]` (spec §4 step 5).

    Query r sits at `qp = q0 + r`; column c is the key at absolute `kp = raw_base + c`.
    Valid iff `kp <= qp and kp > qp - window`: causal plus a sliding window of exactly
    `window` keys, the diagonal always included. No refusals; ValueError on negative sizes
    or `window < 1`.
    """
    require(t_q >= 0 and q0 >= 0 and raw_base >= 0 and keep >= 0,
            f"t_q {t_q}, q0 {q0}, raw_base {raw_base}, keep {keep} must be >= 0")
    require(window >= 1, f"window {window} must be >= 1")
    qp = q0 + np.arange(t_q)[:, None]
    kp = raw_base + np.arange(keep)[None, :]
    return (kp <= qp) & (kp > qp - window)


def compressed_validity(t_q: int, q0: int, t_c: int, ratio: int) -> np.ndarray:
    """Shared compressed validity `bool [t_q, t_c]` (spec §4 step 6).

    Compressed column b is absolute block b (tokens `[b*ratio, (b+1)*ratio)`). Valid iff
    `b < floor((qp + 1) / ratio)` with `qp = q0 + r`: the block is complete at or before the
    query. No refusals; ValueError on negative sizes, or `ratio < 1` with `t_c > 0`.
    """
    require(t_q >= 0 and q0 >= 0 and t_c >= 0, f"t_q {t_q}, q0 {q0}, t_c {t_c} must be >= 0")
    if t_c == 0:
        return np.zeros((t_q, 0), dtype=bool)
    require(ratio >= 1, f"compress ratio {ratio} must be >= 1 when there are {t_c} compressed keys")
    threshold = (q0 + np.arange(t_q) + 1) // ratio
    return np.arange(t_c)[None, :] < threshold[:, None]


# --------------------------------------------------------------------------- §5


def ragged_union_mask(rows: Sequence[int], q0: int, valid: np.ndarray, raw_base: int, t_k: int,
                      ratio: int, t_c: int) -> np.ndarray:
    """Per-row additive union mask `float64 [B, 1, t_q, t_k + t_c]` (spec §5).

    Precondition: `rows` passed `resolve_ragged_rows` (every `rows[i] <= q0`, max == q0);
    a violation is malformed input (ValueError), not a refusal. With `lead_i = q0 - rows[i]`:
    - raw half: the shared `valid[:, :t_k]` AND the key's absolute column
      `raw_base + c >= lead_i` (kills row i's dead prefix);
    - compressed half (start-anchored: column b is block b of every row): rebuilt from the
      row's own position, valid iff `b < floor((rows[i] + r + 1) / ratio)` (the batch value
      `q0` would be too permissive for shorter rows).
    Invariant: row i's diagonal column `q0 + r >= lead_i` stays valid, so no row is empty.
    """
    rows = [int(r) for r in rows]
    require(len(rows) >= 1, "ragged_union_mask needs at least one row")
    require(all(0 <= r <= q0 for r in rows) and max(rows) == q0,
            f"rows {rows} must lie in [0, q0={q0}] with max == q0 (resolve_ragged_rows first)")
    valid = np.asarray(valid, dtype=bool)
    require(valid.ndim == 2 and valid.shape[1] == t_k + t_c,
            f"valid shape {valid.shape} must be [t_q, t_k + t_c = {t_k + t_c}]")
    require(raw_base >= 0 and t_k >= 0 and t_c >= 0,
            f"raw_base {raw_base}, t_k {t_k}, t_c {t_c} must be >= 0")
    t_q = valid.shape[0]
    kp = raw_base + np.arange(t_k)
    out = np.empty((len(rows), 1, t_q, t_k + t_c), dtype=np.float64)
    for i, row in enumerate(rows):
        lead = q0 - row
        raw = valid[:, :t_k] & (kp >= lead)[None, :]
        comp = compressed_validity(t_q, row, t_c, ratio)
        out[i, 0] = _additive(np.concatenate([raw, comp], axis=1))
    return out


# --------------------------------------------------------------------------- §6


def compose_caller_mask(local: np.ndarray, caller: np.ndarray | None, t_q: int, t_k_full: int,
                        raw_base: int, t_k: int, t_c: int) -> np.ndarray:
    """Fold the caller's additive mask into dsv4's local union mask (spec §6).

    1. `caller` None, or one element (the `[1,1]` flash placeholder) -> `local` unchanged.
    2. Rank 2 `[q, k]` -> `[1,1,q,k]`; rank 4 as is; other ranks refused (MaskRefusal,
       "must be rank 2 ... or rank 4").
    3. Query axis must be `t_q` or 1, else refused ("attention_mask query axis").
    4. Key axis `t_k_full + t_c` -> raw columns `[raw_base, raw_base + t_k)` plus the caller's
       compressed columns; `t_k_full` -> the same raw slice, compressed columns padded with
       0 (no opinion); anything else refused ("attention_mask key axis"). When `t_c == 0`
       both readings coincide.
    5. Broadcast sum with `local` (-inf wins).
    """
    if caller is None:
        return local
    caller = np.asarray(caller, dtype=np.float64)
    if caller.size == 1:
        return local
    if caller.ndim == 2:
        caller = caller[None, None]
    elif caller.ndim != 4:
        raise MaskRefusal(
            f"attention_mask must be rank 2 [t_q, keys] or rank 4 [B, H, t_q, keys]; "
            f"got rank {caller.ndim} shape {list(caller.shape)}")
    if caller.shape[2] not in (t_q, 1):
        raise MaskRefusal(
            f"attention_mask query axis {caller.shape[2]} is neither t_q {t_q} nor 1 "
            f"(shape {list(caller.shape)})")
    width = caller.shape[3]
    raw = caller[..., raw_base: raw_base + t_k]
    if width == t_k_full + t_c:
        comp = caller[..., t_k_full:]
    elif width == t_k_full:
        comp = np.zeros(caller.shape[:3] + (t_c,), dtype=np.float64)
    else:
        raise MaskRefusal(
            f"attention_mask key axis {width} is neither t_k_full {t_k_full} nor "
            f"t_k_full + t_c {t_k_full + t_c}")
    require(
        raw.shape[3] == t_k, f"raw slice [{raw_base}, {raw_base + t_k}) exceeds key axis {width}"
    )
    return local + np.concatenate([raw, comp], axis=3)


# --------------------------------------------------------------------------- §7, §8


def sdpa_sliding_window(ratio: int, w: int) -> int | None:
    """The relative window handed to SDPA (spec §7): Standard -> `w`; CSA/HCA -> None (a
    relative window over the union axis would delete compressed keys). Standard means a
    compress ratio of 0 (the config value) or 1 (its internal value). No refusals."""
    require(ratio >= 0 and w >= 0, f"ratio {ratio} and window {w} must be >= 0")
    return w if ratio <= 1 else None


def graph_mode_length_mask(positions: Sequence[int], cap: int) -> np.ndarray:
    """`float64 [B,1,1,cap]` for the graph-decode arm (spec §8): slot s of row b is 0 where
    `s <= positions[b]`, -inf after. A position >= cap keeps the whole window. No refusals
    (the arm's refusal of an unset mask is `require_graph_length_mask`)."""
    positions = [int(p) for p in positions]
    require(cap >= 0 and all(p >= 0 for p in positions),
            f"cap {cap} and positions {positions} must be >= 0")
    slots = np.arange(cap)[None, :]
    keep = slots <= np.asarray(positions, dtype=np.int64).reshape(-1, 1)
    return _additive(keep)[:, None, None, :]


def require_graph_length_mask(mask: np.ndarray | None) -> np.ndarray:
    """The graph-decode arm reads a fixed `cap = sliding_window` window and refuses to run
    when its length mask is unset (spec §8): MaskRefusal ("graph-decode arm", "unset")."""
    if mask is None:
        raise MaskRefusal("the graph-decode arm refuses to run: its length mask is unset (None)")
    return mask


# --------------------------------------------------------------------------- §9.1


@dataclass(frozen=True)
class RaggedKvLens:
    """`RaggedKvLens{padded_len, live}`: past = padded_len, per-seq lens = live."""

    padded_len: int
    live: list[int]


def past_kv_len(source) -> tuple[int, list[int] | None]:
    """`PastKvLenCache` (spec §9.1): `(get_past_kv_len(), per_seq_kv_lens())` of a source.

    - `RaggedKvLens` -> `(padded_len, live)`;
    - a `NormalCache` or a list of KV slots (`Vec<KvCache>`) -> (slot 0's `current_seq_len`,
      None);
    - a sequence of ints (`&[usize]`, seqlen_offsets) -> (the value if all are equal,
      **else 0**, None);
    - None (`NotACache`) -> (0, None).
    Unspecified, chosen: an empty slot list or an empty offsets slice reports past 0.
    """
    if source is None:
        return 0, None
    if isinstance(source, RaggedKvLens):
        return int(source.padded_len), [int(x) for x in source.live]
    slots = getattr(source, "slots", None)
    if slots is not None:
        return (slots[0].current_seq_len if slots else 0), None
    items = list(source)
    if not items:
        return 0, None
    if hasattr(items[0], "current_seq_len"):
        return items[0].current_seq_len, None
    offsets = [int(x) for x in items]
    return (offsets[0] if all(o == offsets[0] for o in offsets) else 0), None


# --------------------------------------------------------------------------- §9.2


def make_left_padded_causal_mask(b: int, t_q: int, past: int, live: Sequence[int]) -> np.ndarray:
    """Left-padded causal mask `float64 [B,1,t_q,past+t_q]` (spec §9.2).

    `lead_b = past - live_b`; query i of row b keeps column j iff `lead_b <= j <= past + i`.
    A fully live row reproduces the ordinary causal mask. Refusals (MaskRefusal):
    `len(live) != b` ("live lengths for a batch of"); any `live_b > past` ("exceeds the
    padded width"). Built vectorized, like the device build; the host triple loop lives in
    the test as the oracle.
    """
    require(b >= 0 and t_q >= 0 and past >= 0, f"b {b}, t_q {t_q}, past {past} must be >= 0")
    live = [int(x) for x in live]
    require(all(x >= 0 for x in live), f"live lengths {live} must be >= 0")
    if len(live) != b:
        raise MaskRefusal(f"{len(live)} live lengths for a batch of {b}")
    over = [(i, x) for i, x in enumerate(live) if x > past]
    if over:
        i, x = over[0]
        raise MaskRefusal(f"row {i} live length {x} exceeds the padded width {past}")
    lead = past - np.asarray(live, dtype=np.int64).reshape(b, 1, 1)
    j = np.arange(past + t_q)[None, None, :]
    last = past + np.arange(t_q)[None, :, None]
    return _additive((j >= lead) & (j <= last))[:, None]


# --------------------------------------------------------------------------- §9.3, §9.4


def _ragged_live(b: int, past: int, per_seq_kv_lens: Sequence[int] | None,
                 channel_lead: Sequence[int] | None) -> list[int] | None:
    """The masker's ragged source (spec §9.3 steps 1-2): the cache's own per-seq lens;
    else the channel's lead when `len == b` and some lead > 0 (live = past - lead), skipped
    when any subtraction would underflow; else None."""
    if per_seq_kv_lens is not None:
        return [int(x) for x in per_seq_kv_lens]
    if channel_lead is not None:
        lead = [int(x) for x in channel_lead]
        if len(lead) == b and any(x > 0 for x in lead) and all(x <= past for x in lead):
            return [past - x for x in lead]
    return None


def make_causal_mask_matrix(b: int, t_q: int, past: int, per_seq_kv_lens: Sequence[int] | None,
                            channel_lead: Sequence[int] | None,
                            flash_on_cuda: bool = False) -> np.ndarray | None:
    """The masker's causal entry point (spec §9.3), in this order:

    1. the cache reports `per_seq_kv_lens` -> left-padded mask (before any early return);
    2. the channel `ragged_lead_pad()` is `Some(lead)` with `len == b` and some lead > 0 ->
       `live = past - lead` (skipped if any subtraction underflows) -> left-padded mask,
       even at `t_q == 1`;
    3. `t_q == 1` -> None (an all-zero lead lands here: a uniform cohort keeps the fast path);
    4. flash-attn on CUDA -> the `[1,1]` zeros placeholder;
    5. rank-2 causal `[t_q, past + t_q]`, keep iff `j <= i + past`.
    Refusals: those of `make_left_padded_causal_mask` in branches 1-2.
    """
    require(b >= 0 and t_q >= 0 and past >= 0, f"b {b}, t_q {t_q}, past {past} must be >= 0")
    live = _ragged_live(b, past, per_seq_kv_lens, channel_lead)
    if live is not None:
        return make_left_padded_causal_mask(b, t_q, past, live)
    if t_q == 1:
        return None
    if flash_on_cuda:
        return np.zeros((1, 1), dtype=np.float64)
    j = np.arange(past + t_q)[None, :]
    i = np.arange(t_q)[:, None]
    return _additive(j <= i + past)


SLIDING_WINDOW_RAGGED_POLICIES = ("none", "channel")


def make_sliding_window_causal_mask_matrix(b: int, t_q: int, past: int,
                                           per_seq_kv_lens: Sequence[int] | None,
                                           channel_lead: Sequence[int] | None, window: int,
                                           sliding_window_ragged: str = "none",
                                           flash_on_cuda: bool = False) -> np.ndarray | None:
    """The masker's sliding-window entry point, with the §9.4 policy
    `sliding_window_ragged in {"none", "channel"}` (default "none", the code described).

    - "none": no ragged branch at all (per-seq lens and channel ignored).
    - "channel" (the wave64-CP description): the same ragged source as §9.3 steps 1-2; a
      ragged batch gets `[B,1,t_q,past+t_q]` keeping column j of query i, row b iff
      `lead_b <= j` and `last - window < j <= last` (`last = past + i`), even at t_q == 1.
    Then, as in §9.3: `t_q == 1` -> None; flash on CUDA -> `[1,1]` placeholder; else rank 2
    keeping `last - window < j <= last`. Unspecified, chosen: the non-ragged window uses the
    same exactly-`window`-keys convention as dsv4's raw validity (§4 step 5).
    Refusals: those of `make_left_padded_causal_mask` on the ragged branch; an unknown
    policy is malformed input (ValueError).
    """
    require(sliding_window_ragged in SLIDING_WINDOW_RAGGED_POLICIES,
            f"sliding_window_ragged {sliding_window_ragged!r} must be one of "
            f"{SLIDING_WINDOW_RAGGED_POLICIES}")
    require(window >= 1, f"window {window} must be >= 1")
    require(b >= 0 and t_q >= 0 and past >= 0, f"b {b}, t_q {t_q}, past {past} must be >= 0")
    j = np.arange(past + t_q)
    last = past + np.arange(t_q)[:, None]
    in_window = (j[None, :] <= last) & (j[None, :] > last - window)
    if sliding_window_ragged == "channel":
        live = _ragged_live(b, past, per_seq_kv_lens, channel_lead)
        if live is not None:
            dead = make_left_padded_causal_mask(b, t_q, past, live)  # refusals + lead rule
            return dead + _additive(in_window)[None, None]
    if t_q == 1:
        return None
    if flash_on_cuda:
        return np.zeros((1, 1), dtype=np.float64)
    return _additive(in_window)


# --------------------------------------------------------------------------- §10


def mask_must_be_applied_as_bias(dims: Sequence[int] | None) -> bool:
    """True iff a mask exists and has rank >= 3 (spec §10): such a mask cannot go to CUDA
    flash, which takes no mask argument. Rank-2 masks stay on flash. No refusals."""
    return dims is not None and len(dims) >= 3


def check_flash_placeholder_mask(dims: Sequence[int] | None, seq_len: int, flash_build: bool,
                                 runs_flash: bool) -> None:
    """Spec §10: a `[1,1]` (one-element) placeholder mask with `seq_len > 1`, reaching a
    non-flash fallback under a flash build, is refused (MaskRefusal, "non-causal"): the
    fallback would read it as "no mask". Returns None otherwise."""
    placeholder = dims is not None and int(np.prod(dims)) == 1 and len(dims) == 2
    if placeholder and seq_len > 1 and flash_build and not runs_flash:
        raise MaskRefusal(
            f"a {list(dims)} flash placeholder mask with seq_len {seq_len} on a non-flash "
            f"fallback under a flash build would be non-causal")
