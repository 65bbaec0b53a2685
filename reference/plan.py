"""The step plan: every integer decision of one decode step, made once from the batch's host
state, for both engines.

`plan_step` runs before the verify forward (window, budgets, per-row leads and offsets,
`row_q0`, draft groups and their keys, chain starts, the step's refusal); `plan_commit` after
it (accepted counts clamped by the budget, committed tokens, the advance rule's drop or
per-row commit lengths, the strip policy's per-row commit). Each field is the result of the
one `reference/` function of its rule (`step`, `dispatch`); nothing here restates a rule.
The lengths engine (`reference.lengths`) is these two functions run step after step; the
tensor engine (`reference.simulator`) calls the same two and hands the plan's tensor work
to a backend (`Backend.upload_plan` gives the port the plan's arrays once per step).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from raggedspec.reference import dispatch, step
from raggedspec.reference.capability import KvAdvance
from raggedspec.reference.errors import DispatchRefusal
from raggedspec.reference.policy import ERR_GUARD_LEFT, GUARD_ERRORS, guard_error

STRIPS = ("eager", "lazy", "none")


def _i64(values) -> np.ndarray:
    return np.asarray(values, dtype=np.int64)


@dataclass
class StepPlan:
    """One decode step's integer decisions (B rows; int64 arrays of length B unless noted).

    `width` the batched cache's width C; `lead` each row's front-alignment lead; `per_seq`
    whether the per-row advance runs (§16 step 3); `ragged` whether the step carries per-row
    lengths (§8.2); `cache_lens` each row's committed KV length (C - lead when ragged, else
    C); `tok_lens` its token count L; `u` its uncached tail; `ok` the window check (§8.1);
    `budgets` `sat(max_seq_len - L)`; `offsets` the verify forward's write offsets (per row
    when ragged, else one entry C); `row_q0` the attention's per-row query offsets (None
    when `per_seq_kv` is off); `fwd_lead` the leads the forward reads (None unless ragged);
    `groups` the draft groups (key -> rows, keys ascending, empty without MTP);
    `group_key` [B, 2] each row's group key (-1 outside every group); `chain_start` each
    row's draft chain start (§9.1; -1 when the window is not ok); `guard` None when ok, else
    `window_guard`'s answer; `refusal` `(kind, detail)` when the plan fails the step.
    """

    width: int
    lead: np.ndarray
    per_seq: bool
    ragged: bool
    cache_lens: np.ndarray
    tok_lens: np.ndarray
    u: np.ndarray
    ok: bool
    budgets: np.ndarray
    offsets: np.ndarray
    row_q0: np.ndarray | None
    fwd_lead: np.ndarray | None
    groups: dict = field(default_factory=dict)
    group_key: np.ndarray | None = None
    chain_start: np.ndarray | None = None
    guard: str | None = None
    refusal: tuple[str, str] | None = None

    @property
    def batch(self) -> int:
        return int(self.lead.shape[0])


@dataclass
class CommitPlan:
    """After verify: `accepted` the verified counts clamped by the budget (§11.2);
    `committed` the tokens each row appends (its accepted drafts, then the bonus or
    correction while the request and the budget leave room); `n_drop` the cohort rollback
    (§12.1; 0 under the per-row rule); `width_after` the batched width handed back;
    `advance` each row's per-row commit count (§12.2; zeros under the cohort rule); and the
    strip policy's per-row commit (§5.5): `strip_lead` dead columns dropped, `kv_len` /
    `xs_len` the K/V and XsRolling slots' lengths, `pending` the lead left for the next
    clone_in. The strip fields are None under the cohort rule."""

    accepted: np.ndarray
    committed: np.ndarray
    n_drop: int
    width_after: int
    advance: np.ndarray
    strip_lead: np.ndarray | None = None
    kv_len: np.ndarray | None = None
    xs_len: np.ndarray | None = None
    pending: np.ndarray | None = None


def _row_lens(per_seq: bool, width: int, lead: np.ndarray):
    """`resolve_row_cache_lens` and its refusal, as (lens or None, refusal or None)."""
    try:
        return dispatch.resolve_row_cache_lens(per_seq, width, lead), None
    except DispatchRefusal as exc:
        return None, (ERR_GUARD_LEFT, str(exc))


def plan_drafts(plan: StepPlan, may_draft, w: int) -> None:
    """Fill `plan`'s draft groups, each row's group key and chain start (§9.1; `may_draft`
    each row's permission). Needs an ok window (every row `cache_len + u >= 2`)."""
    plan.chain_start = dispatch.chain_start_of(plan.cache_lens, plan.u)
    plan.groups = dispatch.draft_groups(plan.u, plan.cache_lens, np.asarray(may_draft), w,
                                        plan.per_seq)
    plan.group_key = np.full((plan.batch, 2), -1, dtype=np.int64)
    for key, rows in plan.groups.items():
        plan.group_key[rows] = key


def plan_step(width: int, lead, tok_lens, *, per_seq: bool, advance: KvAdvance, w: int,
              max_seq_len: int, per_seq_kv: bool, may_draft=None) -> StepPlan:
    """Plan one decode step of a batch `width` (C) wide whose rows carry `lead` and hold
    `tok_lens` tokens. `per_seq` is `per_seq_advance(...)` of the step; `may_draft` the
    rows' draft permission (None: no MTP, no groups). Invariant: `ok` implies every row's
    `cache_lens + u == tok_lens` and `1 <= u <= w`. Refusals are returned, never raised:
    `refusal` is the left-aligned guard when the leads disagree with C (§8.2), or the
    window guard's error (§16 step 4); `guard == "defer"` asks for the plain deferral step."""
    lead, toks = _i64(lead), _i64(tok_lens)
    lens, refusal = _row_lens(per_seq, width, lead)
    ragged = lens is not None
    cache_lens = lens if ragged else np.full(lead.shape[0], width, dtype=np.int64)
    window = step.plan_step_window(cache_lens, toks, w)
    offsets = cache_lens if ragged else _i64([width])
    plan = StepPlan(width, lead, per_seq, ragged, cache_lens, toks, window.uncached, window.ok,
                    step.token_budget(max_seq_len, toks), offsets,
                    dispatch.ragged_row_q0(offsets, per_seq_kv), lead if ragged else None)
    if refusal is not None:
        plan.refusal = refusal
    elif not plan.ok:
        plan.guard = step.window_guard(ragged, advance)
        if plan.guard in GUARD_ERRORS:
            plan.refusal = (GUARD_ERRORS[plan.guard], guard_error(
                plan.guard, cache_lens.tolist(), toks.tolist(), w))
    elif may_draft is not None:
        plan_drafts(plan, may_draft, w)
    return plan


def defer_offsets(plan: StepPlan) -> np.ndarray:
    """The deferral step's write offsets (§16 step 4): each row's own length `C - lead`."""
    return plan.width - plan.lead


def _strip(plan: StepPlan, advance: np.ndarray, strip: str):
    """The strip policy's per-row commit (§5.5): (strip_lead, kv_len, xs_len, pending)."""
    own = plan.cache_lens
    xs_len = own + advance
    zeros = np.zeros_like(own)
    if strip == "eager":
        return plan.lead, xs_len, xs_len, zeros
    if strip == "lazy":
        return zeros, plan.lead + xs_len, xs_len, plan.lead
    return zeros, plan.width + advance, xs_len, zeros


def plan_commit(plan: StepPlan, verified, remaining, w: int, strip: str) -> CommitPlan:
    """Plan the commit of a verified step: `verified` each row's accepted draft count (before
    the budget), `remaining` the tokens each request may still emit, `strip` one of
    `STRIPS`. Invariant: `committed <= accepted + 1` and `accepted + 1 <= budget` wherever
    the budget is >= 1. Refuses nothing (the rules' ValueErrors on malformed input)."""
    acc = step.budget_clamp(_i64(verified), plan.budgets)
    rem = _i64(remaining)
    committed = np.minimum(acc, rem) + ((rem > acc) & (plan.budgets > acc))
    if not plan.per_seq:
        n_drop = step.plan_batch_step(plan.u, acc, w).n_drop
        return CommitPlan(acc, committed, n_drop, plan.width + w - n_drop, np.zeros_like(acc))
    advance = step.plan_per_sequence_step(plan.u, acc, w).committed
    out = CommitPlan(acc, committed, 0, plan.width + w, advance)
    out.strip_lead, out.kv_len, out.xs_len, out.pending = _strip(plan, advance, strip)
    return out
