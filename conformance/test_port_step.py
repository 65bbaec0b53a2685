"""Port conformance: MTP step arithmetic on length vectors (gpu.step vs reference.step).
All integers: bit-exact. Verify is compared row by row against the reference's scalar
`verify_proposed`; the cohort / per-sequence advance against the reference plans."""

from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st

import raggedspec.gpu.step as port
import raggedspec.reference.step as ref
from raggedspec.conformance.strategies import accept_steps, verify_blocks
from raggedspec.gpu._common import as_list
from raggedspec.gpu.testing import DEVICE


def vec(xs):
    return torch.tensor(list(xs), dtype=torch.int64, device=DEVICE)


def padded(rows: list[list[int]], fill: int) -> torch.Tensor:
    width = max((len(r) for r in rows), default=0)
    return torch.tensor([r + [fill] * (width - len(r)) for r in rows], dtype=torch.int64,
                        device=DEVICE).reshape(len(rows), width)


@given(data=st.data())
def test_plan_step_window_matches_the_reference(data):
    n = data.draw(st.integers(0, 8))
    w = data.draw(st.integers(1, 9))
    cache = data.draw(
        st.lists(st.one_of(st.integers(0, 2), st.integers(0, 600)), min_size=n, max_size=n)
    )
    # mostly u in [1, w] (ok hinges on the u == w and C + u == 2 edges), sometimes anything
    step = st.integers(1, w) if data.draw(st.booleans()) else st.integers(-2, w + 2)
    toks = [max(c + data.draw(step), 0) for c in cache]
    got, want = (
        port.plan_step_window(vec(cache), vec(toks), w),
        ref.plan_step_window(cache, toks, w),
    )
    assert as_list(got.uncached) == want.uncached and got.ok is want.ok


def test_plan_step_window_spec_examples_on_the_port():
    ok = port.plan_step_window(vec([40, 33, 37]), vec([41, 34, 38]), 4)
    assert as_list(ok.uncached) == [1, 1, 1] and ok.ok
    bad = port.plan_step_window(vec([40, 40, 40]), vec([41, 34, 38]), 4)
    assert as_list(bad.uncached) == [1, 0, 0] and not bad.ok
    assert not port.plan_step_window(vec([12, 12]), vec([13, 9]), 4).ok


@given(block=verify_blocks())
def test_batched_verify_equals_the_reference_row_by_row(block):
    """One argmax over the mismatch mask for the whole batch == the reference's scan per
    row: accepted count, rejection (index, token), commit_len."""
    proposed, target = block
    got = port.verify_proposed(padded(proposed, -7), padded(target, -9),
                               vec(len(p) for p in proposed), vec(len(t) for t in target))
    for i, (p, t) in enumerate(zip(proposed, target, strict=False)):
        want = ref.verify_proposed(p, t)
        assert int(got.accepted[i]) == len(want.accepted)
        assert bool(got.rejected[i]) == (want.rejection is not None)
        if want.rejection is not None:
            assert (int(got.accepted[i]), int(got.rejection_token[i])) == want.rejection
        assert int(got.commit_len[i]) == want.commit_len


def test_batched_verify_spec_table_on_the_port():
    proposed = [[10, 20, 30], [1, 2, 3], [10, 20], [1, 2, 3]]
    target = [[10, 20, 99], [1, 2, 3, 4], [99, 20], [1, 2]]
    got = port.verify_proposed(padded(proposed, 0), padded(target, 0),
                               vec(map(len, proposed)), vec(map(len, target)))
    assert as_list(got.accepted) == [2, 3, 0, 2]
    assert got.rejected.tolist() == [True, False, True, False]
    assert as_list(got.rejection_token) == [99, -1, 99, -1]
    assert as_list(got.commit_len) == [3, 3, 1, 2]


@given(accepted=st.lists(st.integers(0, 9), min_size=0, max_size=8), data=st.data(),
       max_seq_len=st.integers(0, 64))
def test_budget_and_clamp_match_the_reference(accepted, data, max_seq_len):
    toks = data.draw(st.lists(st.integers(0, 70), min_size=len(accepted), max_size=len(accepted)))
    budgets = port.token_budget(max_seq_len, vec(toks))
    assert as_list(budgets) == [ref.token_budget(max_seq_len, t) for t in toks]
    clamped = port.budget_clamp(vec(accepted), budgets)
    assert as_list(clamped) == [
        ref.budget_clamp(a, b) for a, b in zip(accepted, as_list(budgets), strict=False)
    ]


@given(step=accept_steps())
def test_advance_plans_match_the_reference(step):
    u, a, w = step
    cohort, want_c = port.plan_batch_step(vec(u), vec(a), w), ref.plan_batch_step(u, a, w)
    assert (int(cohort.keep), int(cohort.n_drop), as_list(cohort.next_uncached)) == \
        (want_c.keep, want_c.n_drop, want_c.next_uncached)
    per, want_p = (
        port.plan_per_sequence_step(vec(u), vec(a), w),
        ref.plan_per_sequence_step(u, a, w),
    )
    assert (as_list(per.committed), as_list(per.dropped), as_list(per.next_uncached)) == \
        (want_p.committed, want_p.dropped, want_p.next_uncached)
    assert int(cohort.keep) == int(per.committed.min())


@given(u=st.lists(st.integers(0, 9), max_size=6), a=st.lists(st.integers(0, 9), max_size=6),
       w=st.integers(1, 9))
def test_advance_plans_off_the_reachable_domain_match_too(u, a, w):
    n = min(len(u), len(a))
    u, a = u[:n], a[:n]
    cohort, want = port.plan_batch_step(vec(u), vec(a), w), ref.plan_batch_step(u, a, w)
    assert (int(cohort.keep), int(cohort.n_drop), as_list(cohort.next_uncached)) == \
        (want.keep, want.n_drop, want.next_uncached)
    per, want_p = (
        port.plan_per_sequence_step(vec(u), vec(a), w),
        ref.plan_per_sequence_step(u, a, w),
    )
    assert (as_list(per.committed), as_list(per.dropped)) == (want_p.committed, want_p.dropped)


def test_advance_spec_examples_on_the_port():
    c = port.plan_batch_step(vec([1, 1, 2]), vec([3, 0, 1]), 4)
    assert (int(c.keep), int(c.n_drop), as_list(c.next_uncached)) == (1, 3, [4, 1, 3])
    p = port.plan_per_sequence_step(vec([1, 1, 2, 3, 5, 1, 4]), vec([0, 4, 3, 2, 0, 1, 0]), 5)
    assert as_list(p.committed) == [1, 5, 5, 5, 5, 2, 4]
    assert as_list(p.dropped) == [4, 0, 0, 0, 0, 3, 1]
    assert as_list(p.next_uncached) == [1] * 7


@given(block=verify_blocks(), n_proposed=st.lists(st.integers(0, 12), min_size=8, max_size=8))
def test_rollback_count_and_verify_row_match_the_reference(block, n_proposed):
    proposed, target = block
    got = port.verify_proposed(padded(proposed, -1), padded(target, -2),
                               vec(len(p) for p in proposed), vec(len(t) for t in target))
    n = n_proposed[: len(proposed)]
    drop = port.n_cache_positions_to_drop(vec(n), got.commit_len)
    assert as_list(drop) == [ref.n_cache_positions_to_drop(k, ref.verify_proposed(p, t))
                             for k, p, t in zip(n, proposed, target, strict=False)]
    us = vec(range(1, 10))
    assert as_list(port.window_verify_row(us, 2)) == [
        ref.window_verify_row(u, 2) for u in range(1, 10)
    ]
