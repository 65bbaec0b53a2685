"""Tests added because mutation testing showed weak spots (docs/mutation.md).

mutmut's first full run over reference/dispatch.py and reference/step.py left survivors that
were not equivalent: malformed-input checks whose message could be dropped or whose
conjunction could become a disjunction (every existing test violated all parts at once or
matched no text), a boundary (b == 0, cache_len == 0, committed == 0) that no test accepted,
a `continue` that could become `break` because no test put a length-only slot before a
Normal one, and an initial `armed` flag no test read. Each case below names the values, as
the house rules require of every malformed-input message.
"""

from __future__ import annotations

import re

import numpy as np
import pytest

from raggedspec.reference.cache import KvCache, NormalCache, OtherSlot
from raggedspec.reference.dispatch import (
    CaptureOffsets,
    MtpHiddenCapture,
    chain_start_of,
    draft_group_key,
    draft_groups,
    draft_step_end_column,
    resolve_draft_leads,
    resolve_ragged_rows,
    resolve_row_cache_lens,
    resolve_row_offsets,
)
from raggedspec.reference.step import (
    Verified,
    budget_clamp,
    commit_per_sequence,
    mtp_window,
    n_cache_positions_to_drop,
    plan_batch_step,
    plan_per_sequence_step,
    plan_step_window,
    token_budget,
    truncate_cache_by,
    window_verify_row,
)


def kv(n: int) -> KvCache:
    cache = KvCache.new_normal(4096)
    x = np.arange(n, dtype=float).reshape(1, 1, n, 1)
    cache.append(x, x.copy())
    return cache


# Each case violates exactly ONE condition of a `require`, so an `and` turned into `or`
# lets it through, and the message must name the offending values.
MALFORMED = [
    (
        "resolve_ragged_rows q0",
        lambda: resolve_ragged_rows(None, -1, 2),
        "q0 -1 and b 2 must be >= 0",
    ),
    (
        "resolve_ragged_rows b",
        lambda: resolve_ragged_rows(None, 3, -1),
        "q0 3 and b -1 must be >= 0",
    ),
    (
        "resolve_ragged_rows row",
        lambda: resolve_ragged_rows([3, -1], 3, 2),
        "row positions [3, -1] must be >= 0",
    ),
    (
        "resolve_draft_leads start",
        lambda: resolve_draft_leads(False, [2, -1]),
        "chain starts [2, -1] must be >= 0",
    ),
    (
        "CaptureOffsets empty",
        lambda: CaptureOffsets([]),
        "capture offsets [] must hold at least one offset",
    ),
    (
        "resolve_row_offsets shared",
        lambda: resolve_row_offsets([3], -1),
        "shared offset -1 must be >= 0",
    ),
    (
        "resolve_row_offsets per row",
        lambda: resolve_row_offsets([1, None, -2], 0),
        "per-row offsets [1, None, -2] must be >= 0",
    ),
    (
        "CaptureOffsets negative",
        lambda: CaptureOffsets([1, -2]),
        "capture offsets [1, -2] must be >= 0",
    ),
    ("CaptureOffsets.row negative", lambda: CaptureOffsets([4]).row(-1), "row -1 must be >= 0"),
    (
        "resolve_row_cache_lens cache_len",
        lambda: resolve_row_cache_lens(True, -1, [0]),
        "cache_len -1 must be >= 0",
    ),
    (
        "resolve_row_cache_lens lead",
        lambda: resolve_row_cache_lens(True, 5, [0, -1]),
        "lead_pad [0, -1] must be >= 0",
    ),
    (
        "chain_start_of cache_len",
        lambda: chain_start_of(-1, 3),
        "cache_len -1 and u 3 must be >= 0",
    ),
    ("chain_start_of u", lambda: chain_start_of(3, -1), "cache_len 3 and u -1 must be >= 0"),
    (
        "chain_start_of no pair",
        lambda: chain_start_of(1, 0),
        "cache_len 1 + u 0 < 2 has no chain start",
    ),
    ("draft_group_key u", lambda: draft_group_key(-1, 5, True), "u -1 must be >= 0"),
    (
        "draft_groups cache_lens",
        lambda: draft_groups([1, 2], [5], [True, True], 3, True),
        "uncached (2), cache_lens (1) and may_draft (2) must have one entry per row",
    ),
    (
        "draft_groups may_draft",
        lambda: draft_groups([1, 2], [5, 6], [True], 3, True),
        "uncached (2), cache_lens (2) and may_draft (1) must have one entry per row",
    ),
    ("draft_groups w", lambda: draft_groups([1], [5], [True], 0, True), "window w 0 must be >= 1"),
    (
        "draft_step_end_column b",
        lambda: draft_step_end_column([3], -1, 3),
        "b -1 and cached 3 must be >= 0",
    ),
    (
        "draft_step_end_column cached",
        lambda: draft_step_end_column([3], 1, -1),
        "b 1 and cached -1 must be >= 0",
    ),
    ("mtp_window above", lambda: mtp_window(9), "--mtp-depth 9 must be in 0..=8"),
    ("mtp_window below", lambda: mtp_window(-1), "--mtp-depth -1 must be in 0..=8"),
    (
        "plan_step_window lengths",
        lambda: plan_step_window([1, 2], [3], 2),
        "2 cache_lens for 1 tok_lens",
    ),
    ("plan_step_window w", lambda: plan_step_window([1], [3], 0), "window w 0 must be >= 1"),
    (
        "plan_step_window cache_lens",
        lambda: plan_step_window([-1], [3], 2),
        "lengths must be >= 0: cache_lens [-1], tok_lens [3]",
    ),
    (
        "plan_step_window tok_lens",
        lambda: plan_step_window([1], [-3], 2),
        "lengths must be >= 0: cache_lens [1], tok_lens [-3]",
    ),
    ("window_verify_row u", lambda: window_verify_row(0, 1), "u 0 must be >= 1 and j 1 >= 0"),
    ("window_verify_row j", lambda: window_verify_row(1, -1), "u 1 must be >= 1 and j -1 >= 0"),
    ("token_budget max_seq_len", lambda: token_budget(-1, 3), "max_seq_len -1, L 3 must be >= 0"),
    ("token_budget L", lambda: token_budget(3, -1), "max_seq_len 3, L -1 must be >= 0"),
    ("budget_clamp accepted", lambda: budget_clamp(-1, 3), "accepted -1 and budget 3 must be >= 0"),
    ("budget_clamp budget", lambda: budget_clamp(3, -1), "accepted 3 and budget -1 must be >= 0"),
    (
        "plan_batch_step lengths",
        lambda: plan_batch_step([1, 1], [0], 3),
        "2 uncached for 1 accepted",
    ),
    ("plan_batch_step w", lambda: plan_batch_step([1], [0], 0), "window w 0 must be >= 1"),
    (
        "plan_batch_step uncached",
        lambda: plan_batch_step([-1], [0], 3),
        "uncached [-1] and accepted [0] must be >= 0",
    ),
    (
        "plan_per_sequence_step accepted",
        lambda: plan_per_sequence_step([1], [-2], 3),
        "uncached [1] and accepted [-2] must be >= 0",
    ),
    (
        "truncate_cache_by n_drop",
        lambda: truncate_cache_by(NormalCache([kv(4)]), -1),
        "n_drop -1 must be >= 0",
    ),
    (
        "n_cache_positions_to_drop",
        lambda: n_cache_positions_to_drop(-1, None),
        "n_proposed -1 must be >= 0",
    ),
    (
        "commit_per_sequence lead",
        lambda: commit_per_sequence(NormalCache([kv(5)]), -1, 3, 2),
        "lead -1, cache_len 3, committed 2 must be >= 0",
    ),
    (
        "commit_per_sequence cache_len",
        lambda: commit_per_sequence(NormalCache([kv(5)]), 0, -3, 2),
        "lead 0, cache_len -3, committed 2 must be >= 0",
    ),
    (
        "commit_per_sequence committed",
        lambda: commit_per_sequence(NormalCache([kv(5)]), 0, 3, -2),
        "lead 0, cache_len 3, committed -2 must be >= 0",
    ),
]


@pytest.mark.rule("malformed input and zero boundaries of the dispatch and step rules")
@pytest.mark.parametrize(
    "call, message", [(c, m) for _, c, m in MALFORMED], ids=[n for n, _, _ in MALFORMED]
)
def test_malformed_input_is_a_value_error_naming_the_offending_values(call, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        call()


@pytest.mark.rule("malformed input and zero boundaries of the dispatch and step rules")
def test_the_zero_boundaries_are_well_formed():
    # b == 0 and q0 == 0 are legal (an empty batch has no ragged rows)
    assert resolve_ragged_rows(None, 0, 0) is None
    assert resolve_ragged_rows([], 4, 0) is None
    assert CaptureOffsets([0]).row(0) == 0
    assert resolve_row_cache_lens(True, 0, [0]) is None
    assert chain_start_of(0, 2) == 0 and chain_start_of(2, 0) == 0
    assert draft_group_key(0, 0, True) == (0, 0)
    assert draft_step_end_column([0], 0, 0) == 0
    assert mtp_window(0) == 1 and mtp_window(8) == 9
    assert window_verify_row(1, 0) == 0
    assert token_budget(0, 0) == 0 and budget_clamp(0, 0) == 0
    assert plan_step_window([0], [2], 2).ok
    assert resolve_ragged_rows([0, 2], 2, 2) == [0, 2]
    assert resolve_draft_leads(True, [0, 2]) == [2, 0]
    assert resolve_row_offsets([0, 5], 0) == [0, 5] and resolve_row_offsets([None, 0], 3) == [3, 0]
    # u == 0 and a == 0 are well-formed inputs of both advance rules (plan_step_window is
    # what keeps u >= 1 on a real step)
    assert plan_per_sequence_step([0, 2], [0, 1], 3).committed == [0, 3]
    assert plan_batch_step([0, 2], [0, 1], 3).keep == 0
    assert n_cache_positions_to_drop(0, Verified([], None)) == 0
    # a row with no committed KV of its own, and a commit of nothing, are well-formed
    cache = NormalCache([kv(3)])
    commit_per_sequence(cache, 3, 0, 0)
    assert cache.slots[0].current_seq_len == 0
    cache = NormalCache([kv(6)])
    commit_per_sequence(cache, 2, 4, 0)
    assert cache.slots[0].current_seq_len == 4


@pytest.mark.rule("truncate_cache_by")
def test_truncate_cache_by_rolls_back_the_slots_after_a_length_only_slot():
    # the length-only (Rotating/TurboQuant) slot sits BETWEEN Normal slots: skipping it must
    # not end the loop
    cache = NormalCache([kv(20), OtherSlot("Rotating", 20), kv(20)])
    truncate_cache_by(cache, 3)
    assert [s.current_seq_len for s in cache.slots] == [17, 17, 17]
    assert cache.slots[2].v.current_seq_len == 17


@pytest.mark.rule("MtpHiddenCapture")
def test_a_fresh_hidden_capture_is_disarmed_and_empty():
    cap = MtpHiddenCapture()
    assert cap.armed is False
    assert cap.take() is None
    cap.store(3, np.zeros((1, 2, 4)))
    assert cap.take() is None
