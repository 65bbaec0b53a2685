"""MTP step arithmetic on length vectors (port of `reference.step`).

Every rule is elementwise or one reduction over int64 tensors, one launch per rule with no
host read except `plan_step_window`'s `ok`; malformed input (ValueError) names the parameter
and its values. The cache side, what is not ported and the input conventions:
docs/conformance.md, section "gpu/step.py".
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from raggedspec.gpu._common import as_list, lengths, lengths_like, on_device_of
from raggedspec.reference.errors import require


def _sat(x: torch.Tensor) -> torch.Tensor:
    return x.clamp(min=0)


@dataclass(frozen=True)
class StepWindow:
    """`uncached` int64 `[B]`; `ok` a host bool (the step's guard branches on it)."""

    uncached: torch.Tensor
    ok: bool


def plan_step_window(cache_lens, tok_lens, w: int) -> StepWindow:
    """`uncached = sat(tok_lens - cache_lens)`; `ok` iff every row has `C_i + u_i >= 2`
    and `1 <= u_i <= w` (an empty batch is ok). ValueError on unequal or negative lengths,
    `w < 1`."""
    c = lengths(cache_lens, name="cache_lens")
    t = lengths_like(tok_lens, c, "tok_lens")
    require(c.numel() == t.numel(), f"{c.numel()} cache_lens for {t.numel()} tok_lens")
    require(w >= 1, f"window w {w} must be >= 1")
    require(not bool((c < 0).any() or (t < 0).any()),
            f"lengths must be >= 0: cache_lens {as_list(c)}, tok_lens {as_list(t)}")
    u = _sat(t - c)
    ok = bool(((c + u >= 2) & (u >= 1) & (u <= w)).all())
    return StepWindow(u, ok)


def window_verify_row(u, j) -> torch.Tensor:
    """`u - 1 + j` elementwise (broadcasting), int64: the verify row of draft slot j.
    ValueError unless every `u >= 1` and every `j >= 0`."""
    u = torch.as_tensor(u).long()
    j = torch.as_tensor(j).long()
    require(not bool((u < 1).any() or (j < 0).any()),
            f"u {u.tolist()} must be >= 1 and j {j.tolist()} >= 0")
    return u - 1 + on_device_of(j, u)


@dataclass(frozen=True)
class VerifiedBatch:
    """Verify of B rows: `accepted [B]` (how many proposals were accepted: the index of the
    first mismatch where there is one), `rejected [B]` bool (a mismatch was found), and
    `rejection_token [B]` (the target token at that index; -1 where not rejected). The
    reference's `rejection` is `(accepted[i], rejection_token[i])` where `rejected[i]`."""

    accepted: torch.Tensor
    rejected: torch.Tensor
    rejection_token: torch.Tensor

    @property
    def commit_len(self) -> torch.Tensor:
        """`accepted + rejected`: the reference's `len(accepted) + [rejection]`."""
        return self.accepted + self.rejected.long()


def verify_proposed(proposed: torch.Tensor, target: torch.Tensor, n_proposed=None,
                    n_target=None) -> VerifiedBatch:
    """Greedy verify of a batch (`reference.step.verify_proposed` per row).

    `proposed [B, P]`, `target [B, Q]` integer tensors; row i has `n_proposed[i]` (default
    P) and `n_target[i]` (default Q) meaningful entries and scans `n_i = min(n_proposed_i,
    n_target_i)` positions. First mismatch by `argmax` over the mask
    `(proposed != target) & (j < n_i)`; with none, `accepted = n_i`. No refusals;
    ValueError on bad shapes or per-row counts out of range.
    """
    require(proposed.dim() == 2 and target.dim() == 2 and proposed.shape[0] == target.shape[0],
            f"proposed {list(proposed.shape)} and target {list(target.shape)} must be [B, *]")
    b, p = proposed.shape
    q = target.shape[1]
    n_p = proposed.new_full((b,), p).long() if n_proposed is None \
        else lengths_like(n_proposed, proposed, "n_proposed")
    n_t = proposed.new_full((b,), q).long() if n_target is None \
        else lengths_like(n_target, proposed, "n_target")
    require(
        n_p.numel() == b and n_t.numel() == b,
        f"per-row counts must have {b} entries: n_proposed {as_list(n_p)}, n_target {as_list(n_t)}",
    )
    require(not bool((n_p < 0).any() or (n_p > p).any() or (n_t < 0).any() or (n_t > q).any()),
            f"per-row counts out of range: n_proposed {as_list(n_p)} (<= {p}), "
            f"n_target {as_list(n_t)} (<= {q})")
    n = torch.minimum(n_p, n_t)
    none = torch.full_like(n, -1)
    width = min(p, q)
    if width == 0:
        return VerifiedBatch(n, torch.zeros_like(n).bool(), none)
    # The first mismatch over all `width` columns is the first within row i's `n_i` scanned
    # positions iff it lies below `n_i`: no column index vector is needed.
    mismatch = proposed[:, :width] != target[:, :width]
    first = mismatch.byte().argmax(dim=1)  # the first maximal index (0 if none)
    rejected = mismatch.any(dim=1) & (first < n)
    token = target[:, :width].gather(1, first[:, None])[:, 0].long()
    return VerifiedBatch(
        torch.where(rejected, first, n), rejected, torch.where(rejected, token, none)
    )


def token_budget(max_seq_len: int, tok_lens) -> torch.Tensor:
    """`sat(max_seq_len - L_i)` per row. ValueError on a negative max_seq_len or length."""
    t = lengths(tok_lens, name="tok_lens")
    require(max_seq_len >= 0 and not bool((t < 0).any()),
            f"max_seq_len {max_seq_len} and tok_lens {as_list(t)} must be >= 0")
    return _sat(max_seq_len - t)


def budget_clamp(accepted, budget) -> torch.Tensor:
    """Per row: `sat(budget - 1)` where `accepted + 1 > budget`, else `accepted`."""
    a = lengths(accepted, name="accepted")
    bud = lengths_like(budget, a, "budget")
    require(a.numel() == bud.numel(), f"{a.numel()} accepted for {bud.numel()} budgets")
    require(not bool((a < 0).any() or (bud < 0).any()),
            f"accepted {as_list(a)} and budget {as_list(bud)} must be >= 0")
    return torch.where(a + 1 > bud, _sat(bud - 1), a)


@dataclass(frozen=True)
class CohortPlan:
    """`keep` and `n_drop` are 0-dim int64 tensors (no host read-back), `next_uncached [B]`."""

    keep: torch.Tensor
    n_drop: torch.Tensor
    next_uncached: torch.Tensor


@dataclass(frozen=True)
class PerSequencePlan:
    committed: torch.Tensor
    dropped: torch.Tensor
    next_uncached: torch.Tensor


def _step_inputs(uncached, accepted, w: int) -> tuple[torch.Tensor, torch.Tensor]:
    u = lengths(uncached, name="uncached")
    a = lengths_like(accepted, u, "accepted")
    require(u.numel() == a.numel(), f"{u.numel()} uncached for {a.numel()} accepted")
    require(w >= 1, f"window w {w} must be >= 1")
    require(not bool((u < 0).any() or (a < 0).any()),
            f"uncached {as_list(u)} and accepted {as_list(a)} must be >= 0")
    return u, a


def plan_batch_step(uncached, accepted, w: int) -> CohortPlan:
    """Cohort: `keep = min(u + a)` (0 if empty), `n_drop = sat(w - keep)`,
    `next = sat(u + a + 1 - keep)`."""
    u, a = _step_inputs(uncached, accepted, w)
    valid = u + a
    keep = valid.min() if valid.numel() else valid.new_zeros(())
    return CohortPlan(keep, _sat(w - keep), _sat(valid + 1 - keep))


def plan_per_sequence_step(uncached, accepted, w: int) -> PerSequencePlan:
    """PerSequence: `committed = min(u + a, w)`, `dropped = sat(w - committed)`, next 1."""
    u, a = _step_inputs(uncached, accepted, w)
    committed = (u + a).clamp(max=w)
    return PerSequencePlan(committed, _sat(w - committed), torch.ones_like(committed))


def n_cache_positions_to_drop(n_proposed, commit_len) -> torch.Tensor:
    """`sat(n_proposed - commit_len)` per row (the older two-forward rollback)."""
    n = lengths(n_proposed, name="n_proposed")
    c = lengths_like(commit_len, n, "commit_len")
    require(n.numel() == c.numel(), f"{n.numel()} n_proposed for {c.numel()} commit_len")
    require(not bool((n < 0).any()), f"n_proposed {as_list(n)} must be >= 0")
    return _sat(n - c)
