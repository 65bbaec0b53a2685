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
    assert mtp_window(0) == 1 and mtp_window(8) == 9
    assert window_verify_row(1, 0) == 0
    assert token_budget(0, 0) == 0 and budget_clamp(0, 0) == 0
    assert plan_step_window([0], [2], 2).ok
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


