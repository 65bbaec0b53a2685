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
from raggedspec.reference.scheduler import (
    COALESCE_PAYBACK_STEPS,
    PrefillFloor,
    SchedulerState,
    SeqRecord,
    schedule,
    select_running_bucket,
)
from raggedspec.reference.scheduler_telemetry import BucketTelemetry


class Mirror(ScheduleMirror):
    def __init__(self, world="W0", *, L=(), stored=(), prompt=(), urg=(), granted=False,
                 ragged=False, max_seq_len=10, max_seqs=None, cap=None, floor=None):
        self.sc = SimpleNamespace(world=world, max_seqs=max_seqs, prefill_max_seqs=cap,
                                  prefill_floor=floor)
        self.L = np.asarray(L, dtype=np.int64)
        self.stored = np.asarray(stored, dtype=np.int64)
        self.is_prompt = np.asarray(prompt, dtype=bool)
        self.urg = np.asarray(urg, dtype=np.int64)
        self.granted, self.ragged_supported = granted, ragged
        self.max, self.log2 = max_seq_len, None


def run(n):
    return np.arange(n, dtype=np.int64)


@pytest.mark.rule("lengths mode, scheduler half")
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
    # the codes are integers in every world (a float code would no longer be the encoding)
    for m in (Mirror("W0", **kw), Mirror("WB", granted=True, **kw), Mirror("WB", **kw)):
        assert m._keys(run(4)).dtype == np.int64


@pytest.mark.rule("lengths mode, scheduler half")
def test_key_tuples_carry_the_ragged_flag_only_in_wb():
    assert Mirror("WB")._key_tuple(7) == [3, False, 0, True]
    assert Mirror("WB")._key_tuple(6) == [3, False, 0, False]
    assert Mirror("W0")._key_tuple(7) == [3, False, 0]


@pytest.mark.rule("lengths mode, scheduler half")
def test_the_log2_table_holds_math_log2_and_grows_on_demand():
    m = Mirror(max_seq_len=10)
    assert m._log2(np.array([1, 8, 0, 5])).tolist() == [0.0, 3.0, 0.0, math.log2(5)]
    assert m.log2.shape[0] == 12  # max_seq_len + 2
    assert m._log2(np.array([20])).tolist() == [math.log2(20)] and m.log2.shape[0] == 21
    # a lookup up to the table's last entry reuses the table; one past it rebuilds
    table = m.log2
    assert m._log2(np.array([20, 3])).tolist() == [math.log2(20), math.log2(3)]
    assert m.log2 is table
    assert m._log2(np.array([21])).tolist() == [math.log2(21)] and m.log2 is not table
    assert Mirror(max_seq_len=10)._log2(np.zeros(0, dtype=np.int64)).tolist() == []


@pytest.mark.rule("lengths mode, scheduler half")
@pytest.mark.parametrize("new, room, cap, want", [
    ([True, False, True], 2, None, [True, True, False]),      # room 2: the first two
    ([True, False, True, True], 5, 1, [True, True, False, False]),  # one new admitted
    ([True, True, False], 5, 2, [True, True, True]),          # exactly cap new
    ([False, False], 0, None, [False, False]),                # no room
    ([False, True, False], 3, 0, [True, False, True]),        # cap 0: only re-admissions
])
def test_admission_at_its_boundaries(new, room, cap, want):
    assert admit_waiting(np.asarray(new), room, cap).tolist() == want


@pytest.mark.rule("lengths mode, scheduler half")
def test_admission_reads_integer_marks_as_booleans_and_returns_a_mask():
    """0/1 marks mean not-new/new: with cap 0 only the re-admissions (ids 0 and 2 of 3) are
    admitted, and the result is a boolean mask that selects them."""
    for new in (np.array([0, 1, 0]), [0, 1, 0]):
        got = admit_waiting(new, 5, 0)
        assert got.dtype == bool and got.tolist() == [True, False, True]
        assert np.arange(3)[got].tolist() == [0, 2]


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


@pytest.mark.rule("lengths mode, scheduler half")
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


# ----------------------------------------------------------------------------- one step


def schedule_both(m, running, waiting, *, admitted=(), floor_count=0):
    """Run the mirror's `_schedule` on `m` and `scheduler.schedule` on the same sequences
    (a prompt row has no cache; a decode row's cache is its stored length); both must
    choose the same ids and key, leave the same waiting queue and bucket count. Returns the
    mirror's (chosen ids, decoded key, n_buckets, new waiting, floor counter)."""
    n = m.L.shape[0]
    m.running, m.waiting = list(running), list(waiting)
    m.admitted = np.zeros(n, dtype=bool)
    m.admitted[list(admitted)] = True
    m.floor_count, m.sched = floor_count, BucketTelemetry()
    m.urg = np.zeros(n, dtype=np.int64)
    chosen, code, n_buckets = m._schedule()
    got = (chosen.tolist(), tuple(m._key_tuple(code)), n_buckets, m.waiting, m.floor_count)

    def rec(i):
        p = bool(m.is_prompt[i])
        return SeqRecord(i, int(m.L[i]), None if p else int(m.stored[i]), is_prompt=p)

    state = SchedulerState(world=m.sc.world, max_seqs=m.sc.max_seqs or 1 << 30,
                           prefill_cap=m.sc.prefill_max_seqs,
                           floor=PrefillFloor(m.sc.prefill_floor, floor_count),
                           admitted=set(admitted))
    out = schedule([rec(i) for i in running], [rec(i) for i in waiting], state)
    want = ([s.id for s in out.running], out.key, out.n_buckets, [s.id for s in out.waiting],
            state.floor.steps_since_prompt)
    assert got == want, (got, want)
    return got


@pytest.mark.rule("lengths mode, scheduler half")
def test_the_wa_prefill_cap_promotes_the_first_cap_waiting_in_queue_order():
    """Nothing running: WA promotes the first `prefill_max_seqs` of the queue as queued (not
    sorted by id) and holds the rest in order; the other worlds ignore the cap."""
    kw = dict(L=[5, 5, 5, 5], stored=[0, 0, 0, 0], prompt=[True] * 4, cap=2)
    got = schedule_both(Mirror("WA", **kw), [], [3, 1, 2, 0])
    assert got == ([3, 1], (4, False, 0), 1, [2, 0], 0)
    got = schedule_both(Mirror("W0", **kw), [], [3, 1, 2, 0])
    assert got == ([3, 1, 2, 0], (4, False, 0), 1, [], 0)


@pytest.mark.rule("lengths mode, scheduler half")
def test_the_wa_prefill_cap_counts_only_new_requests_next_to_running_ones():
    """Running 0; waiting 3, 2, 1 where 1 ran before (a waitlisted completion): sorted by id,
    1 is re-admitted outside the cap, 2 takes the one new place, 3 is held. All four share
    key 8 (decode rows at stored 4, prompts of 5 tokens), so the admitted ones all run."""
    m = Mirror("WA", L=[5, 5, 5, 5], stored=[4, 4, 0, 0], prompt=[False, False, True, True],
               cap=1)
    got = schedule_both(m, [0], [3, 2, 1], admitted=[0, 1])
    assert got == ([0, 1, 2], (4, False, 0), 1, [3], 0)
    assert m.admitted.tolist() == [True, True, True, False]


@pytest.mark.rule("lengths mode, scheduler half")
def test_a_step_with_nothing_to_admit_runs_the_shortest_bucket():
    """Waiting only, or running only, is a discrete step: the shortest bucket (key 4) runs
    even though the 3-member bucket at key 398 has the larger priority and is too far away
    to coalesce onto (3 * 197 > 256); the rest is waitlisted with urgency + 1."""
    prompts = Mirror("W0", L=[3, 200, 200, 200], stored=[0] * 4, prompt=[True] * 4)
    got = schedule_both(prompts, [], [0, 1, 2, 3])
    assert got == ([0], (2, False, 0), 2, [1, 2, 3], 0)
    decodes = Mirror("W0", L=[3, 200, 200, 200], stored=[2, 199, 199, 199], prompt=[False] * 4)
    got = schedule_both(decodes, [0, 1, 2, 3], [])
    assert got == ([0], (2, False, 0), 2, [1, 2, 3], 0)
    assert decodes.urg.tolist() == [0, 1, 1, 1]
    # with something waiting the step is not discrete: the greedy bucket runs
    got = schedule_both(decodes, [0, 1, 2], [3], admitted=[0, 1, 2, 3])
    assert got == ([1, 2, 3], (199, False, 0), 2, [0], 0)


@pytest.mark.rule("lengths mode, scheduler half")
def test_the_wa_floor_counts_only_multi_bucket_steps():
    """One bucket (two decode rows at stored 4, one running, one re-admitted): everything
    runs and the floor counter is left as it was (the floor applies only to a choice among
    buckets)."""
    m = Mirror("WA", L=[5, 5], stored=[4, 4], prompt=[False, False], floor=2)
    got = schedule_both(m, [0], [1], admitted=[0, 1], floor_count=1)
    assert got == ([0, 1], (4, False, 0), 1, [], 1)
