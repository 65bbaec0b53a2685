"""Port conformance: malformed input to the dispatch and step ports.

A demanding user gets a ValueError whose message names the bad parameter and its values.
Each case below breaks exactly one condition (so a check that joins its conditions with the
wrong `and`/`or` lets one case through), and the message must carry every listed fragment.
Cases at the boundary of a condition must pass. Result dtypes are a contract too: lengths and
counts are int64, flags are bool, whatever integer dtype the caller's vectors use.
"""

from __future__ import annotations

import pytest
import torch

import raggedspec.gpu.dispatch as dispatch
import raggedspec.gpu.step as step
from raggedspec.gpu.testing import DEVICE


def vec(xs, dtype=torch.int64):
    return torch.tensor(list(xs), dtype=dtype, device=DEVICE)


def grid(rows, dtype=torch.int64):
    return torch.tensor(rows, dtype=dtype, device=DEVICE)


TWO_D = [[1, 2], [3, 4]]

# (function, valid keyword arguments, the length-vector parameters to break one at a time)
VECTOR_PARAMS = [
    (dispatch.resolve_ragged_rows, dict(rows=[3, 2], q0=3, b=2), ["rows"]),
    (dispatch.uniform_seqlen_offset, dict(offsets=[3, 3]), ["offsets"]),
    (
        dispatch.resolve_row_cache_lens,
        dict(enabled=True, cache_len=5, lead_pad=[0, 1]),
        ["lead_pad"],
    ),
    (dispatch.resolve_ragged_chain_starts, dict(starts=[3, 2]), ["starts"]),
    (dispatch.resolve_draft_leads, dict(enabled=True, starts=[3, 2]), ["starts"]),
    (dispatch.chain_start_of, dict(cache_lens=[3, 2], u=[1, 1]), ["cache_lens", "u"]),
    (dispatch.draft_group_keys, dict(u=[1, 1], cache_lens=[3, 2], carries_per_row=False), ["u"]),
    (
        dispatch.draft_groups,
        dict(
            uncached=[1, 1], cache_lens=[3, 2], may_draft=[True, True], w=4, per_seq_advance=False
        ),
        ["uncached", "cache_lens", "may_draft"],
    ),
    (dispatch.draft_step_end_column, dict(start_pos=[3, 2], b=2, cached=3), ["start_pos"]),
    (dispatch.ragged_row_q0, dict(offsets=[3, 2], per_seq_kv=True), ["offsets"]),
    (
        step.plan_step_window,
        dict(cache_lens=[3, 2], tok_lens=[4, 3], w=4),
        ["cache_lens", "tok_lens"],
    ),
    (
        step.verify_proposed,
        dict(proposed=TWO_D, target=TWO_D, n_proposed=[2, 2], n_target=[2, 2]),
        ["n_proposed", "n_target"],
    ),
    (step.token_budget, dict(max_seq_len=9, tok_lens=[3, 2]), ["tok_lens"]),
    (step.budget_clamp, dict(accepted=[1, 2], budget=[3, 3]), ["accepted", "budget"]),
    (step.plan_batch_step, dict(uncached=[1, 1], accepted=[1, 2], w=4), ["uncached", "accepted"]),
    (
        step.plan_per_sequence_step,
        dict(uncached=[1, 1], accepted=[1, 2], w=4),
        ["uncached", "accepted"],
    ),
    (
        step.n_cache_positions_to_drop,
        dict(n_proposed=[3, 3], commit_len=[1, 2]),
        ["n_proposed", "commit_len"],
    ),
]


def _tensors(kwargs):
    """Vectors as the device's int64 tensors (flags as bool), grids as [B, *] tensors."""
    out = {}
    for k, v in kwargs.items():
        if isinstance(v, list) and v and isinstance(v[0], list):
            out[k] = grid(v)
        elif isinstance(v, list):
            out[k] = vec(v, torch.bool if isinstance(v[0], bool) else torch.int64)
        else:
            out[k] = v
    return out


@pytest.mark.parametrize(
    "fn, kwargs, params", VECTOR_PARAMS, ids=[f.__name__ for f, _, _ in VECTOR_PARAMS]
)
def test_every_length_vector_must_be_one_dimensional_and_the_error_names_it(fn, kwargs, params):
    fn(**_tensors(kwargs))  # the valid call passes, so only the broken parameter can refuse
    for name in params:
        bad = dict(
            kwargs,
            **{name: [[bool(x) for x in r] for r in TWO_D] if name == "may_draft" else TWO_D},
        )
        with pytest.raises(ValueError) as err:
            fn(**_tensors(bad))
        assert str(err.value).startswith(f"{name} must be a 1-D vector, got shape [2, 2]"), str(
            err.value
        )


# (case id, call, fragments the message must carry)
REFUSALS = [
    (
        "ragged_rows q0",
        lambda: dispatch.resolve_ragged_rows(None, -1, 2),
        ["q0 -1", "b 2", "must be >= 0"],
    ),
    (
        "ragged_rows b",
        lambda: dispatch.resolve_ragged_rows(None, 3, -1),
        ["q0 3", "b -1", "must be >= 0"],
    ),
    (
        "ragged_rows row",
        lambda: dispatch.resolve_ragged_rows(vec([-1, 3]), 3, 2),
        ["row positions [-1, 3]", "must be >= 0"],
    ),
    (
        "row_cache_lens cache_len",
        lambda: dispatch.resolve_row_cache_lens(True, -1, vec([0, 0])),
        ["cache_len -1", "must be >= 0"],
    ),
    (
        "row_cache_lens lead",
        lambda: dispatch.resolve_row_cache_lens(True, 5, vec([0, -1])),
        ["lead_pad [0, -1]", "must be >= 0"],
    ),
    (
        "draft_leads start",
        lambda: dispatch.resolve_draft_leads(True, vec([-3, 2])),
        ["chain starts [-3, 2]", "must be >= 0"],
    ),
    (
        "chain_start cache_len",
        lambda: dispatch.chain_start_of(vec([-1, 3]), vec([1, 1])),
        ["cache_lens [-1, 3]", "u [1, 1]", "must be >= 0"],
    ),
    (
        "chain_start u",
        lambda: dispatch.chain_start_of(vec([3, 3]), vec([1, -1])),
        ["cache_lens [3, 3]", "u [1, -1]", "must be >= 0"],
    ),
    (
        "chain_start below 2",
        lambda: dispatch.chain_start_of(vec([1, 3]), vec([0, 1])),
        ["< 2 has no chain start", "cache_lens [1, 3]", "u [0, 1]"],
    ),
    (
        "chain_start widths",
        lambda: dispatch.chain_start_of(vec([3]), vec([1, 1])),
        ["1 cache_lens for 2 u"],
    ),
    (
        "draft_groups cache_lens width",
        lambda: dispatch.draft_groups(vec([1, 1]), vec([3]), [True, True], 4, False),
        ["uncached (2), cache_lens (1) and may_draft (2)", "one entry per row"],
    ),
    (
        "draft_groups may_draft width",
        lambda: dispatch.draft_groups(vec([1, 1]), vec([3, 3]), [True], 4, False),
        ["uncached (2), cache_lens (2) and may_draft (1)", "one entry per row"],
    ),
    (
        "draft_groups w",
        lambda: dispatch.draft_groups(vec([1]), vec([3]), [True], 0, False),
        ["window w 0 must be >= 1"],
    ),
    (
        "end_column b",
        lambda: dispatch.draft_step_end_column(vec([3]), -1, 3),
        ["b -1", "cached 3", "must be >= 0"],
    ),
    (
        "end_column cached",
        lambda: dispatch.draft_step_end_column(vec([3]), 1, -1),
        ["b 1", "cached -1", "must be >= 0"],
    ),
    (
        "step_window widths",
        lambda: step.plan_step_window(vec([3]), vec([4, 4]), 4),
        ["1 cache_lens for 2 tok_lens"],
    ),
    (
        "step_window w",
        lambda: step.plan_step_window(vec([3]), vec([4]), 0),
        ["window w 0 must be >= 1"],
    ),
    (
        "step_window cache_len",
        lambda: step.plan_step_window(vec([-1, 2]), vec([3, 3]), 4),
        ["must be >= 0", "cache_lens [-1, 2]", "tok_lens [3, 3]"],
    ),
    (
        "step_window tok_len",
        lambda: step.plan_step_window(vec([1, 2]), vec([3, -3]), 4),
        ["must be >= 0", "cache_lens [1, 2]", "tok_lens [3, -3]"],
    ),
    ("verify_row u", lambda: step.window_verify_row(0, 0), ["u 0 must be >= 1", "j 0 >= 0"]),
    (
        "verify_row j",
        lambda: step.window_verify_row(vec([1, 2]), vec([0, -1])),
        ["u [1, 2] must be >= 1", "j [0, -1] >= 0"],
    ),
    (
        "verify 1-D proposed",
        lambda: step.verify_proposed(vec([1, 2, 3]), grid([[1, 2, 3]])),
        ["proposed [3] and target [1, 3] must be [B, *]"],
    ),
    (
        "verify 1-D target",
        lambda: step.verify_proposed(grid([[1, 2, 3]]), vec([1, 2, 3])),
        ["proposed [1, 3] and target [3] must be [B, *]"],
    ),
    (
        "verify batch",
        lambda: step.verify_proposed(grid([[1], [2]]), grid([[1]])),
        ["proposed [2, 1] and target [1, 1] must be [B, *]"],
    ),
    (
        "verify n_proposed width",
        lambda: step.verify_proposed(grid([[1], [2]]), grid([[1], [2]]), vec([1]), vec([1, 1])),
        ["must have 2 entries", "n_proposed [1]", "n_target [1, 1]"],
    ),
    (
        "verify n_target width",
        lambda: step.verify_proposed(grid([[1], [2]]), grid([[1], [2]]), vec([1, 1]), vec([1])),
        ["must have 2 entries", "n_proposed [1, 1]", "n_target [1]"],
    ),
    (
        "verify n_proposed < 0",
        lambda: step.verify_proposed(grid([[1, 2]]), grid([[1, 2, 3]]), vec([-1]), vec([3])),
        ["out of range", "n_proposed [-1] (<= 2)", "n_target [3] (<= 3)"],
    ),
    (
        "verify n_proposed > P",
        lambda: step.verify_proposed(grid([[1, 2]]), grid([[1, 2, 3]]), vec([3]), vec([3])),
        ["out of range", "n_proposed [3] (<= 2)", "n_target [3] (<= 3)"],
    ),
    (
        "verify n_target < 0",
        lambda: step.verify_proposed(grid([[1, 2]]), grid([[1, 2, 3]]), vec([2]), vec([-1])),
        ["out of range", "n_proposed [2] (<= 2)", "n_target [-1] (<= 3)"],
    ),
    (
        "verify n_target > Q",
        lambda: step.verify_proposed(grid([[1, 2]]), grid([[1, 2, 3]]), vec([2]), vec([4])),
        ["out of range", "n_proposed [2] (<= 2)", "n_target [4] (<= 3)"],
    ),
    (
        "budget max_seq_len",
        lambda: step.token_budget(-1, vec([3])),
        ["max_seq_len -1", "tok_lens [3]", "must be >= 0"],
    ),
    (
        "budget tok_len",
        lambda: step.token_budget(9, vec([-1])),
        ["max_seq_len 9", "tok_lens [-1]", "must be >= 0"],
    ),
    (
        "clamp widths",
        lambda: step.budget_clamp(vec([1, 2]), vec([3])),
        ["2 accepted for 1 budgets"],
    ),
    (
        "clamp accepted",
        lambda: step.budget_clamp(vec([-1]), vec([3])),
        ["accepted [-1]", "budget [3]", "must be >= 0"],
    ),
    (
        "clamp budget",
        lambda: step.budget_clamp(vec([1]), vec([-3])),
        ["accepted [1]", "budget [-3]", "must be >= 0"],
    ),
    (
        "cohort widths",
        lambda: step.plan_batch_step(vec([1, 1]), vec([1]), 4),
        ["2 uncached for 1 accepted"],
    ),
    ("cohort w", lambda: step.plan_batch_step(vec([1]), vec([1]), 0), ["window w 0 must be >= 1"]),
    (
        "cohort uncached",
        lambda: step.plan_batch_step(vec([-1]), vec([1]), 4),
        ["uncached [-1]", "accepted [1]", "must be >= 0"],
    ),
    (
        "per_seq accepted",
        lambda: step.plan_per_sequence_step(vec([1]), vec([-1]), 4),
        ["uncached [1]", "accepted [-1]", "must be >= 0"],
    ),
    (
        "drop widths",
        lambda: step.n_cache_positions_to_drop(vec([3, 3]), vec([1])),
        ["2 n_proposed for 1 commit_len"],
    ),
    (
        "drop n_proposed",
        lambda: step.n_cache_positions_to_drop(vec([-1]), vec([1])),
        ["n_proposed [-1]", "must be >= 0"],
    ),
]


@pytest.mark.parametrize("call, fragments", [c[1:] for c in REFUSALS], ids=[c[0] for c in REFUSALS])
def test_each_malformed_input_is_refused_alone_and_named(call, fragments):
    with pytest.raises(ValueError) as err:
        call()
    for fragment in fragments:
        assert fragment in str(err.value), f"{fragment!r} not in {str(err.value)!r}"


def test_inputs_on_the_boundary_of_each_check_pass():
    """The smallest valid value of every checked quantity is accepted (a `<` that became
    `<=` refuses it)."""
    assert int(step.window_verify_row(1, 0)) == 0
    assert step.window_verify_row(vec([1, 3]), vec([0, 2])).tolist() == [0, 4]
    assert dispatch.chain_start_of(vec([0, 2, 1]), vec([2, 0, 1])).tolist() == [0, 0, 0]
    assert dispatch.resolve_ragged_rows(None, 0, 0) is None
    assert dispatch.draft_step_end_column(vec([0]), 0, 0) == 0
    assert dispatch.resolve_row_cache_lens(True, 0, vec([0])) is None
    assert step.token_budget(0, vec([0])).tolist() == [0]
    got = step.verify_proposed(grid([[1, 2]]), grid([[1, 2, 3]]), vec([2]), vec([3]))
    assert got.accepted.tolist() == [2] and got.rejected.tolist() == [False]
    got = step.verify_proposed(grid([[1, 2]]), grid([[1, 9, 3]]), vec([0]), vec([0]))
    assert got.accepted.tolist() == [0] and got.rejected.tolist() == [False]
    assert step.plan_batch_step(vec([0]), vec([0]), 1).n_drop.tolist() == 1
    assert dispatch.draft_groups(vec([0]), vec([2]), [True], 1, False).as_dict() == {(0, 0): [0]}


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_verify_results_are_int64_and_bool_whatever_the_token_dtype(dtype):
    proposed = grid([[5, 6, 7], [5, 6, 7]], dtype)
    target = grid([[5, 9, 7, 1], [5, 6, 7, 8]], dtype)
    for got in (step.verify_proposed(proposed, target),  # default counts: P and Q
                step.verify_proposed(proposed, target, vec([3, 3]), vec([4, 4]))):
        assert got.accepted.dtype == torch.int64 and got.accepted.tolist() == [1, 3]
        assert got.rejected.dtype == torch.bool and got.rejected.tolist() == [True, False]
        assert got.rejection_token.dtype == torch.int64 and got.rejection_token.tolist() == [9, -1]
        assert got.commit_len.dtype == torch.int64 and got.commit_len.tolist() == [2, 3]
    empty = step.verify_proposed(grid([[], []], dtype).reshape(2, 0), target)
    assert empty.accepted.dtype == torch.int64 and empty.accepted.tolist() == [0, 0]
    assert empty.rejected.dtype == torch.bool and empty.rejected.tolist() == [False, False]
    assert empty.rejection_token.dtype == torch.int64 and empty.rejection_token.tolist() == [-1, -1]
    assert empty.commit_len.tolist() == [0, 0]


def test_verify_row_is_int64_whatever_the_input_dtype():
    got = step.window_verify_row(vec([1, 4], torch.int32), vec([2, 0], torch.int32))
    assert got.dtype == torch.int64 and got.tolist() == [2, 3]
    got = step.window_verify_row(vec([2], torch.int32), 1)
    assert got.dtype == torch.int64 and got.tolist() == [2]


def test_empty_partitions_and_plans_keep_their_shape_and_dtype():
    none = dispatch.draft_groups(vec([5, 6]), vec([3, 3]), [True, True], 4, False)
    assert none.keys.dtype == torch.int64 and tuple(none.keys.shape) == (0, 2) and none.rows == []
    also_none = dispatch.draft_groups(vec([1, 1]), vec([3, 3]), [False, False], 4, False)
    assert tuple(also_none.keys.shape) == (0, 2)
    plan = step.plan_batch_step(vec([]), vec([]), 3)
    assert plan.keep.dtype == torch.int64 and plan.keep.dim() == 0 and int(plan.keep) == 0
    assert int(plan.n_drop) == 3 and plan.next_uncached.tolist() == []


def test_draft_group_rows_are_ascending_within_a_group_at_scale():
    """Rows of one group stay ascending even when the partition sorts thousands of rows
    (CUDA's sort is not stable; the port must not rely on stability)."""
    n = 5000
    u = torch.arange(n, device=DEVICE) % 3 + 1
    c = torch.full((n,), 10, dtype=torch.int64, device=DEVICE)
    groups = dispatch.draft_groups(u, c, torch.ones(n, dtype=torch.bool, device=DEVICE), 4, True)
    assert groups.keys.tolist() == [[1, 0], [2, 0], [3, 0]]
    for g, rows in enumerate(groups.rows):
        assert rows.dtype == torch.int64
        assert rows.tolist() == list(range(g, n, 3))
