"""The step plan (reference/plan.py): one decode step's integer decisions, made once for both
engines. Expected values are worked from the rules by hand (cache-and-draft §5.5, §8, §9.1,
§11.2, §12, §16 step 4); that both engines follow the plan is test_lengths.py's trace
equality."""

import numpy as np
import pytest

from raggedspec.reference.capability import KvAdvance
from raggedspec.reference.plan import defer_offsets, plan_commit, plan_step

PER_SEQ = KvAdvance.PER_SEQUENCE
COHORT = KvAdvance.COHORT


def per_seq_pair(**kw):
    """Width 12, leads [0, 2], 13 and 11 tokens: own lengths [12, 10], one uncached token each."""
    args = dict(per_seq=True, advance=PER_SEQ, w=4, max_seq_len=100, per_seq_kv=True,
                may_draft=[True, True])
    return plan_step(12, [0, 2], [13, 11], **{**args, **kw})


@pytest.mark.rule("the step plan, made once for both engines")
def test_a_per_row_step_plans_each_rows_own_length_offset_and_chain_start():
    p = per_seq_pair()
    assert p.ok and p.ragged and p.refusal is None and p.guard is None
    assert p.cache_lens.tolist() == [12, 10] and p.u.tolist() == [1, 1]
    assert p.offsets.tolist() == [12, 10] and p.row_q0.tolist() == [12, 10]
    assert p.fwd_lead.tolist() == [0, 2] and p.budgets.tolist() == [87, 89]
    # per-row keys drop the chain start: one group (u 1), chains at L - 2 = [11, 9]
    assert p.groups == {(1, 0): [0, 1]} and p.chain_start.tolist() == [11, 9]
    assert p.group_key.tolist() == [[1, 0], [1, 0]]


@pytest.mark.rule("the step plan, made once for both engines")
def test_row_q0_is_absent_without_per_seq_kv_and_nothing_is_grouped_without_mtp():
    p = per_seq_pair(per_seq_kv=False, may_draft=None)
    assert p.row_q0 is None and p.groups == {} and p.chain_start is None


@pytest.mark.rule("the step plan, made once for both engines")
def test_a_cohort_step_shares_the_width_and_keys_groups_by_chain_start():
    p = plan_step(10, [0, 0, 0], [11, 12, 11], per_seq=False, advance=COHORT, w=4,
                  max_seq_len=100, per_seq_kv=False, may_draft=[True, True, False])
    assert p.ok and not p.ragged and p.fwd_lead is None
    assert p.cache_lens.tolist() == [10, 10, 10] and p.offsets.tolist() == [10]
    assert p.u.tolist() == [1, 2, 1]
    assert p.groups == {(1, 9): [0], (2, 10): [1]}  # row 2 may not draft
    assert p.group_key.tolist() == [[1, 9], [2, 10], [-1, -1]]


@pytest.mark.rule("the step plan, made once for both engines")
@pytest.mark.parametrize("advance, guard, refused", [
    (COHORT, "defer", None), (PER_SEQ, "follows_guard", "follows guard")])
def test_a_window_that_is_not_ok_defers_or_refuses_by_the_latched_advance(advance, guard,
                                                                            refused):
    """Width 10 and 16 tokens: u = 6 > w = 4."""
    p = plan_step(10, [0], [16], per_seq=False, advance=advance, w=4, max_seq_len=100,
                  per_seq_kv=False, may_draft=[True])
    assert not p.ok and p.guard == guard and p.groups == {}
    assert (p.refusal and p.refusal[0]) == refused


@pytest.mark.rule("the step plan, made once for both engines")
def test_a_ragged_window_that_is_not_ok_is_the_left_aligned_guard():
    p = plan_step(12, [0, 2], [13, 16], per_seq=True, advance=PER_SEQ, w=4, max_seq_len=100,
                  per_seq_kv=True, may_draft=[True, True])
    assert p.guard == "left_aligned_guard" and p.refusal[0] == "left-aligned guard"
    assert "[12, 10]" in p.refusal[1] and "[13, 16]" in p.refusal[1]


@pytest.mark.rule("the step plan, made once for both engines")
def test_the_deferral_feeds_each_row_at_its_own_length():
    p = plan_step(12, [0, 3], [20, 20], per_seq=False, advance=COHORT, w=4, max_seq_len=100,
                  per_seq_kv=True)
    assert defer_offsets(p).tolist() == [12, 9]


def cohort_near_the_cap():
    """Width 16, 17 and 18 tokens, max_seq_len 20: budgets [3, 2], u [1, 2]."""
    return plan_step(16, [0, 0], [17, 18], per_seq=False, advance=COHORT, w=4, max_seq_len=20,
                     per_seq_kv=False, may_draft=[True, True])


@pytest.mark.rule("the step plan, made once for both engines")
def test_each_row_is_clamped_by_its_own_budget_and_the_cohort_drops_past_the_shortest():
    p = cohort_near_the_cap()
    assert p.budgets.tolist() == [3, 2]
    c = plan_commit(p, [3, 2], [40, 40], 4, "eager")
    # a + 1 > budget -> budget - 1: [2, 1]; each commits a + 1; keep = min(u + a) = 3 of 4
    assert c.accepted.tolist() == [2, 1] and c.committed.tolist() == [3, 2]
    assert (c.n_drop, c.width_after) == (1, 19) and c.strip_lead is None


@pytest.mark.rule("the step plan, made once for both engines")
def test_a_request_with_only_its_accepted_tokens_left_gets_no_bonus():
    c = plan_commit(cohort_near_the_cap(), [2, 1], [2, 1], 4, "eager")
    assert c.committed.tolist() == [2, 1]


@pytest.mark.rule("strip policy eager / lazy / none")
@pytest.mark.parametrize("strip, strip_lead, kv_len, pending", [
    ("eager", [0, 2], [16, 14], [0, 0]),
    ("lazy", [0, 0], [16, 16], [0, 2]),
    ("none", [0, 0], [16, 16], [0, 0]),
])
def test_the_per_row_commit_follows_the_strip_policy(strip, strip_lead, kv_len, pending):
    """All three drafts accepted: each row advances by w = 4 from its own length [12, 10]."""
    c = plan_commit(per_seq_pair(), [3, 3], [40, 40], 4, strip)
    assert c.advance.tolist() == [4, 4] and c.n_drop == 0 and c.width_after == 16
    assert c.xs_len.tolist() == [16, 14]
    assert (c.strip_lead.tolist(), c.kv_len.tolist(), c.pending.tolist()) == (
        strip_lead, kv_len, pending)
    assert np.array_equal(c.committed, [4, 4])


@pytest.mark.rule("backend protocol: every tensor-side op is one method")
def test_the_torch_port_uploads_the_plans_rows_as_they_are():
    """`upload_plan`: every per-row field of the plan on the device with the host values;
    the fields the plan lacks stay None."""
    pytest.importorskip("torch")
    from raggedspec.gpu.backend import TorchBackend

    p = per_seq_pair()
    dev = TorchBackend("cpu").upload_plan(p)
    assert dev.host is p
    for name in ("lead", "cache_lens", "tok_lens", "u", "budgets", "offsets", "row_q0",
                 "chain_start"):
        assert getattr(dev, name).tolist() == getattr(p, name).tolist(), name
    bare = TorchBackend("cpu").upload_plan(per_seq_pair(per_seq_kv=False, may_draft=None))
    assert bare.row_q0 is None and bare.chain_start is None and bare.u.tolist() == [1, 1]
