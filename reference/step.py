"""MTP step arithmetic: the verify window, accept/verify, the budget clamp, the two advance
rules, the rollback, and the window guards.

Spec: cache-and-draft.md §8.1, §8.3, §11, §12, §16 steps 3-4; masks-and-scheduling.md §19.
All integer arithmetic; `sat(x) = max(x, 0)` is Rust's saturating subtraction.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from raggedspec.reference.align import XS, drop_dead_prefix
from raggedspec.reference.cache import NormalCache
from raggedspec.reference.capability import KvAdvance
from raggedspec.reference.errors import CacheRefusal, StepRefusal, require
from raggedspec.reference.xs_rolling import MTP_DEPTH_CAP


def _sat(x: int) -> int:
    return max(x, 0)


def _rows(xs) -> np.ndarray:
    """Per-row integers (a sequence or an array) as one int64 array."""
    return np.asarray(xs, dtype=np.int64)


def _as_given(template, values: np.ndarray):
    """`values` in the caller's form: an array for an array argument, ints / lists otherwise."""
    if isinstance(template, np.ndarray):
        return values
    return values.tolist()


def mtp_window(depth: int) -> int:
    """`w = depth + 1`: the slots each row feeds the verify forward. `--mtp-depth` is
    0..=8; anything else is malformed."""
    require(0 <= depth <= MTP_DEPTH_CAP, f"--mtp-depth {depth} must be in 0..={MTP_DEPTH_CAP}")
    return depth + 1


def per_seq_advance(assembled_here: bool, post_op_out: bool, advance: KvAdvance) -> bool:
    """§16 step 3: the per-row step runs only on a step that assembled the batch (pre-op
    In), hands it back (post-op Out), and whose latched advance is PerSequence."""
    return assembled_here and post_op_out and advance is KvAdvance.PER_SEQUENCE


# --- §8 window --------------------------------------------------------------------------------


@dataclass(frozen=True)
class StepWindow:
    uncached: list[int]
    ok: bool


def plan_step_window(cache_lens: Sequence[int], tok_lens: Sequence[int], w: int) -> StepWindow:
    """`uncached_i = sat(tok_len_i - cache_len_i)`; `ok` iff every row has
    `cache_len_i + u_i >= 2` and `1 <= u_i <= w` (§8.1).

    Invariant: ok implies `cache_len_i < tok_len_i`, so `toks[cache_lens[i]..]` is in range.
    An empty batch is vacuously ok (unspecified; the step's gate never sends one). Refuses
    nothing: not ok is the caller's guard/defer decision. Malformed: unequal lengths,
    negative lengths, w < 1. Lists in, a list out; NumPy arrays in, an array out (one
    expression over the rows either way).
    """
    c, t = _rows(cache_lens), _rows(tok_lens)
    if c.shape != t.shape or w < 1 or min(c.min(initial=0), t.min(initial=0)) < 0:
        require(c.shape == t.shape, f"{len(cache_lens)} cache_lens for {len(tok_lens)} tok_lens")
        require(w >= 1, f"window w {w} must be >= 1")
        require(False, f"lengths must be >= 0: cache_lens {list(cache_lens)}, "
                       f"tok_lens {list(tok_lens)}")
    u = np.maximum(t - c, 0)
    ok = bool(((c + u >= 2) & (u >= 1) & (u <= w)).all())
    return StepWindow(_as_given(cache_lens, u), ok)


def window_verify_row(u: int, j: int) -> int:
    """`u - 1 + j`: the row of a `[w, vocab]` verify block holding the target's token for
    draft slot j (§8.3). `u - 1 + d` is the bonus after a full accept and `u - 1 + a` the
    row sampled for the step's one non-draft token."""
    require(u >= 1 and j >= 0, f"u {u} must be >= 1 and j {j} >= 0")
    return u - 1 + j


# --- §11 verify and budget ------------------------------------------------------------------


@dataclass(frozen=True)
class Verified:
    """`accepted` proposals, then the first mismatch `(index, target token)` if any."""

    accepted: list[int]
    rejection: tuple[int, int] | None

    @property
    def commit_len(self) -> int:
        """`len(accepted) + [rejection]`."""
        return len(self.accepted) + (self.rejection is not None)


def verify_proposed(proposed: Sequence[int], target: Sequence[int]) -> Verified:
    """Greedy lossless verify (§11.1): scan `n = min(len(proposed), len(target))` positions;
    at the first mismatch i, `accepted = proposed[:i]` and `rejection = (i, target[i])`;
    with none, `accepted = proposed[:n]` and no rejection. Refuses nothing."""
    n = min(len(proposed), len(target))
    for i in range(n):
        if proposed[i] != target[i]:
            return Verified([int(p) for p in proposed[:i]], (i, int(target[i])))
    return Verified([int(p) for p in proposed[:n]], None)


def token_budget(max_seq_len: int, tok_len):
    """`budget_i = sat(max_seq_len - L_i)`: tokens the row may still emit (§11.2, §16.5). An int
    `tok_len` gives an int; an array of rows' lengths gives the array of their budgets."""
    lens = _rows(tok_len)
    if max_seq_len < 0 or lens.min(initial=0) < 0:
        require(False, f"max_seq_len {max_seq_len}, L {tok_len} must be >= 0")
    return _as_given(tok_len, np.maximum(max_seq_len - lens, 0))


def budget_clamp(accepted: int, budget: int) -> int:
    """Applied after `verify_proposed` (§11.2): if `a + 1 > budget`, `a = sat(budget - 1)`,
    leaving room for the step's sampled token. Invariant: result <= accepted and
    result + 1 <= budget whenever budget >= 1. Ints give an int; arrays (one entry per row)
    give the array of clamped counts."""
    a, b = _rows(accepted), _rows(budget)
    if min(a.min(initial=0), b.min(initial=0)) < 0:
        require(False, f"accepted {accepted} and budget {budget} must be >= 0")
    return _as_given(accepted, np.where(a + 1 > b, np.maximum(b - 1, 0), a))


# --- §12 advance rules ------------------------------------------------------------------------


@dataclass(frozen=True)
class CohortPlan:
    keep: int
    n_drop: int
    next_uncached: list[int]


@dataclass(frozen=True)
class PerSequencePlan:
    committed: list[int]
    dropped: list[int]
    next_uncached: list[int]


def _check_step_inputs(uncached: Sequence[int], accepted: Sequence[int],
                       w: int) -> tuple[np.ndarray, np.ndarray]:
    """The rows' `u` and `a` as arrays, checked (messages built only on a failure)."""
    u, a = _rows(uncached), _rows(accepted)
    if u.shape != a.shape or w < 1 or min(u.min(initial=0), a.min(initial=0)) < 0:
        require(u.shape == a.shape, f"{len(uncached)} uncached for {len(accepted)} accepted")
        require(w >= 1, f"window w {w} must be >= 1")
        require(False, f"uncached {list(uncached)} and accepted {list(accepted)} must be >= 0")
    return u, a


def plan_batch_step(uncached: Sequence[int], accepted: Sequence[int], w: int) -> CohortPlan:
    """Cohort rule (§12.1): `keep = min_i(u_i + a_i)` (0 if empty), `n_drop = sat(w - keep)`,
    `next_uncached_i = sat(u_i + a_i + 1 - keep)`. Invariant on reachable input
    (u in [1,w], a <= w - u): keep >= 1, n_drop <= w, next in [1, w]. Lists in, lists out;
    arrays in, an array `next_uncached`."""
    u, a = _check_step_inputs(uncached, accepted, w)
    valid = u + a
    keep = int(valid.min()) if valid.size else 0
    return CohortPlan(keep, _sat(w - keep), _as_given(uncached, np.maximum(valid + 1 - keep, 0)))


def plan_per_sequence_step(
    uncached: Sequence[int], accepted: Sequence[int], w: int
) -> PerSequencePlan:
    """PerSequence rule (§12.2): `committed_i = min(u_i + a_i, w)`,
    `dropped_i = sat(w - committed_i)`, `next_uncached_i = 1`. Row i depends on row i only;
    `plan_batch_step(...).keep == min(committed)`. Lists in, lists out; arrays in, arrays out."""
    u, a = _check_step_inputs(uncached, accepted, w)
    committed = np.minimum(u + a, w)
    return PerSequencePlan(_as_given(uncached, committed),
                           _as_given(uncached, np.maximum(w - committed, 0)),
                           _as_given(uncached, np.ones_like(committed)))


def truncate_cache_by(cache, n_drop: int) -> None:
    """Cohort rollback (§12.3): for **every** slot, `set_len(sat(cur - n_drop))`.

    Anything that is not a `NormalCache` is left unchanged (arc: non-Normal -> Ok). Slots
    with a `set_len` (Normal K/V, XsRolling) use it; an `OtherSlot` (Rotating/TurboQuant,
    modelled by its length only) has its length set directly. A slot's refusal (e.g. an
    XsRolling rollback behind its retained window) becomes a StepRefusal "MTP: cache
    set_len({new}) failed rolling back {n} of {cur} positions"; slots before it stay
    truncated (as in arc, the step fails).
    """
    require(n_drop >= 0, f"n_drop {n_drop} must be >= 0")
    if not isinstance(cache, NormalCache):
        return
    for slot in cache.slots:
        cur = slot.current_seq_len
        new = _sat(cur - n_drop)
        if not hasattr(slot, "set_len"):
            slot.current_seq_len = new
            continue
        try:
            slot.set_len(new)
        except CacheRefusal as err:
            raise StepRefusal(
                f"MTP: cache set_len({new}) failed rolling back {n_drop} of {cur} positions: {err}"
            ) from err


def n_cache_positions_to_drop(n_proposed: int, verified: Verified) -> int:
    """The older two-forward rollback (masks §19): `sat(n_proposed - commit_len)`."""
    require(n_proposed >= 0, f"n_proposed {n_proposed} must be >= 0")
    return _sat(n_proposed - verified.commit_len)


def commit_per_sequence(cache, lead: int, cache_len: int, committed: int) -> None:
    """The per-sequence commit of one row after post-op Out (§12.2): for every slot of the
    row's own cache, first `drop_dead_prefix(slot, lead)`, then `set_len(cache_len +
    committed)` (its *own* length, never the padded width `C + committed`). A strip failure
    refuses "stripping the {lead}-column dead prefix failed"; a length failure refuses
    "set_len({target}) refused" (both StepRefusal)."""
    require(lead >= 0 and cache_len >= 0 and committed >= 0,
            f"lead {lead}, cache_len {cache_len}, committed {committed} must be >= 0")
    commit_row(cache, lead, cache_len + committed, cache_len + committed)


def commit_row(cache, strip_lead: int, kv_len: int, xs_len: int) -> None:
    """One row's commit under a strip policy (§5.5, §12.2): slot by slot, first
    `drop_dead_prefix(slot, strip_lead)`, then `set_len(xs_len)` on an XsRolling slot and
    `set_len(kv_len)` on any other. Eager is `(lead, own + c, own + c)`, lazy
    `(0, lead + own + c, own + c)`, none `(0, C + c, own + c)`. A strip failure refuses
    "stripping the {lead}-column dead prefix failed on slot i"; a length failure refuses
    "set_len({target}) refused on slot i" (both StepRefusal)."""
    require(strip_lead >= 0 and kv_len >= 0 and xs_len >= 0,
            f"strip_lead {strip_lead}, kv_len {kv_len}, xs_len {xs_len} must be >= 0")
    for i, slot in enumerate(cache.slots):
        target = xs_len if slot.kind == XS else kv_len
        try:
            drop_dead_prefix(slot, strip_lead)
        except CacheRefusal as err:
            raise StepRefusal(f"stripping the {strip_lead}-column dead prefix failed on slot "
                              f"{i}: {err}") from err
        try:
            slot.set_len(target)
        except CacheRefusal as err:
            raise StepRefusal(f"set_len({target}) refused on slot {i}: {err}") from err


# --- §16 step 4 ---------------------------------------------------------------------------------


def window_guard(row_cache_lens_is_some: bool, advance: KvAdvance) -> str:
    """What a step does when `plan_step_window` is not ok (§16 step 4):
    "left_aligned_guard" (refuse) when the step carries per-row lengths; else
    "follows_guard" (refuse) when the latched advance is PerSequence, since the resident
    batched cache is then `C + w` wide and a deferral would decode with a write offset and
    RoPE positions that disagree; else "defer" (clear the draft KVs, run the plain step)."""
    if row_cache_lens_is_some:
        return "left_aligned_guard"
    if advance is KvAdvance.PER_SEQUENCE:
        return "follows_guard"
    return "defer"
