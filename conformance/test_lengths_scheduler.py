"""The lengths engine's scheduler half (`reference.lengths_scheduler`) rule by rule, on
hand-built states, against `reference.scheduler`'s own rules.

`test_lengths.py` checks whole runs against the tensor mode; here each case sets the arrays
one rule reads: the integer key encoding (`2 * len + ragged_flag`) per world, the key tuple
it stands for, the log2 table, the vectorized admission at its boundaries, and bucket
selection (cache-and-draft §16: discrete -> min; greedy == min -> min; coalesce onto min iff
`(total - n_min) * gap <= n_min * COALESCE_PAYBACK_STEPS`), compared with
`scheduler.select_running_bucket` on the same buckets.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest

from raggedspec.reference.lengths_scheduler import ScheduleMirror, admit_waiting
from raggedspec.reference.scheduler import COALESCE_PAYBACK_STEPS, select_running_bucket


class Mirror(ScheduleMirror):
    def __init__(self, world="W0", *, L=(), stored=(), prompt=(), urg=(), granted=False,
                 ragged=False, max_seq_len=10):
        self.sc = SimpleNamespace(world=world)
        self.L = np.asarray(L, dtype=np.int64)
        self.stored = np.asarray(stored, dtype=np.int64)
        self.is_prompt = np.asarray(prompt, dtype=bool)
        self.urg = np.asarray(urg, dtype=np.int64)
        self.granted, self.ragged_supported = granted, ragged
        self.max, self.log2 = max_seq_len, None


def run(n):
    return np.arange(n, dtype=np.int64)


def test_keys_encode_each_worlds_key():
    """Prompt rows key on L - 1 (0 for an empty prompt), decode rows on their stored length;
    WA with ragged batches supported keys every decode row on 0; granted WB keys every decode
    row on the shortest stored length with the ragged flag set."""
    kw = dict(L=[5, 0, 9, 9], stored=[0, 0, 7, 3], prompt=[True, True, False, False])
    assert Mirror("W0", **kw)._keys(run(4)).tolist() == [8, 0, 14, 6]
    assert Mirror("WA", ragged=True, **kw)._keys(run(4)).tolist() == [8, 0, 0, 0]
    assert Mirror("WA", **kw)._keys(run(4)).tolist() == [8, 0, 14, 6]
    assert Mirror("WB", granted=True, **kw)._keys(run(4)).tolist() == [8, 0, 7, 7]
    assert Mirror("WB", **kw)._keys(run(4)).tolist() == [8, 0, 14, 6]
    prompts_only = dict(L=[5], stored=[0], prompt=[True])
    assert Mirror("WB", granted=True, **prompts_only)._keys(run(1)).tolist() == [8]


def test_key_tuples_carry_the_ragged_flag_only_in_wb():
    assert Mirror("WB")._key_tuple(7) == [3, False, 0, True]
    assert Mirror("WB")._key_tuple(6) == [3, False, 0, False]
    assert Mirror("W0")._key_tuple(7) == [3, False, 0]


def test_the_log2_table_holds_math_log2_and_grows_on_demand():
    m = Mirror(max_seq_len=10)
    assert m._log2(np.array([1, 8, 0, 5])).tolist() == [0.0, 3.0, 0.0, math.log2(5)]
    assert m.log2.shape[0] == 12  # max_seq_len + 2
    assert m._log2(np.array([20])).tolist() == [math.log2(20)] and m.log2.shape[0] == 21
    assert Mirror(max_seq_len=10)._log2(np.zeros(0, dtype=np.int64)).tolist() == []


@pytest.mark.parametrize("new, room, cap, want", [
    ([True, False, True], 2, None, [True, True, False]),      # room 2: the first two
    ([True, False, True, True], 5, 1, [True, True, False, False]),  # one new admitted
    ([True, True, False], 5, 2, [True, True, True]),          # exactly cap new
    ([False, False], 0, None, [False, False]),                # no room
    ([False, True, False], 3, 0, [True, False, True]),        # cap 0: only re-admissions
])
def test_admission_at_its_boundaries(new, room, cap, want):
    assert admit_waiting(np.asarray(new), room, cap).tolist() == want


def select_both(lens_flags_members, discrete=False, world="WB"):
    """Buckets `(len, flag) -> [(urg, L), ...]`: the mirror's choice (decoded) and the
    reference's on the same buckets and priorities."""
    codes, urg, L = [], [], []
    for (ln, flag), members in lens_flags_members.items():
        for u, n in members:
            codes.append(2 * ln + flag)
            urg.append(u)
            L.append(n)
    m = Mirror(world, L=L, urg=urg, max_seq_len=600)
    uniq, inv = np.unique(np.asarray(codes), return_inverse=True)
    got = divmod(m._select(uniq, inv, run(len(codes)), discrete), 2)
    buckets = {(ln, False, 0, bool(f)): ms for (ln, f), ms in lens_flags_members.items()}
    prio = {(ln, False, 0, bool(f)): sum(u + math.log2(n) for u, n in ms)
            for (ln, f), ms in lens_flags_members.items()}
    want = select_running_bucket(buckets, prio, discrete)
    assert got == (want[0], int(want[3])), (got, want)
    return got


def test_bucket_selection_coalesces_onto_min_within_the_payback():
    # greedy is the 3-member bucket; gap 2 costs 3 * 2 <= 1 * 256: run min
    assert select_both({(4, 0): [(0, 5)], (6, 0): [(0, 5)] * 3}) == (4, 0)
    # gap 196: 3 * 196 > 256: greedy
    assert select_both({(4, 0): [(0, 5)], (200, 0): [(0, 5)] * 3}) == (200, 0)
    # exactly the payback (1 * 256 <= 1 * 256): min; one more column: greedy
    gap = COALESCE_PAYBACK_STEPS
    assert select_both({(4, 0): [(0, 5)], (4 + gap, 0): [(0, 300)]}) == (4, 0)
    assert select_both({(4, 0): [(0, 5)], (5 + gap, 0): [(0, 300)]}) == (5 + gap, 0)
    # no longer key with min's flag: greedy
    assert select_both({(4, 1): [(0, 5)], (6, 0): [(0, 5)] * 3}) == (6, 0)
    # discrete, and greedy == min (a priority tie goes to the smallest key): min
    assert select_both({(4, 0): [(0, 5)], (200, 0): [(0, 5)] * 3}, discrete=True) == (4, 0)
    assert select_both({(4, 0): [(1, 8)], (200, 0): [(0, 8), (0, 2)]}) == (4, 0)
    # urgency counts: an urgent min row outweighs a longer bucket
    assert select_both({(4, 0): [(9, 5)], (200, 0): [(0, 5)] * 2}) == (4, 0)
