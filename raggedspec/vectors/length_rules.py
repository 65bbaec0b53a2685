"""The length rules as the vectors call them (`LengthRules`): host integers in, host integers
out, each one of the reference's rule functions over the rows. They are host rules of the step
plan (`reference.plan`), so no backend implements them; the vectors' adapters call these
whatever backend they are given.
"""

from __future__ import annotations

from raggedspec.reference import dispatch, step


class LengthRules:
    """The length rules as the vectors call them: host integers in, host integers out, each
    the reference's rule function over the rows (lists and tuples, as the case files store
    them). The step plan (`reference.plan`) calls the same functions; no backend does."""

    def resolve_row_cache_lens(self, enabled, cache_len, lead_pad):
        return dispatch.resolve_row_cache_lens(enabled, cache_len, lead_pad)

    def ragged_row_q0(self, offsets, per_seq_kv):
        return dispatch.ragged_row_q0(offsets, per_seq_kv)

    def plan_step_window(self, cache_lens, tok_lens, w):
        sw = step.plan_step_window(cache_lens, tok_lens, w)
        return list(sw.uncached), sw.ok

    def token_budget(self, max_seq_len, tok_lens):
        return [step.token_budget(max_seq_len, n) for n in tok_lens]

    def draft_groups(self, uncached, cache_lens, may_draft, w, per_seq_advance):
        return dispatch.draft_groups(uncached, cache_lens, may_draft, w, per_seq_advance)

    def draft_group_keys(self, uncached, cache_lens, carries_per_row):
        return [dispatch.draft_group_key(u, c, carries_per_row)
                for u, c in zip(uncached, cache_lens, strict=False)]

    def chain_starts(self, cache_lens, uncached):
        return [dispatch.chain_start_of(c, u) for c, u in zip(cache_lens, uncached, strict=False)]

    def verify_accept(self, proposed, targets):
        return [len(step.verify_proposed(p, t).accepted)
                for p, t in zip(proposed, targets, strict=False)]

    def budget_clamp(self, accepted, budgets):
        return [step.budget_clamp(a, b) for a, b in zip(accepted, budgets, strict=False)]

    def plan_batch_step(self, uncached, accepted, w):
        plan = step.plan_batch_step(uncached, accepted, w)
        return plan.keep, plan.n_drop, list(plan.next_uncached)

    def plan_per_sequence_step(self, uncached, accepted, w):
        plan = step.plan_per_sequence_step(uncached, accepted, w)
        return list(plan.committed), list(plan.dropped), list(plan.next_uncached)


RULES = LengthRules()
