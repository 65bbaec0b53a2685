"""The lengths engine's two halves rule by rule, on hand-built states: the draft half
(`reference.lengths_draft.DraftMirror`) and the scheduler half
(`reference.lengths_scheduler.ScheduleMirror`, `admit_waiting`).

test_lengths.py checks the whole engine against the tensor mode on scenarios; there a boundary
that no scenario reaches (a seed position one past the capture, a growth to exactly
`max_seq_len`, a refused group followed by another group) or a counter the trace does not carry
(`stalls`) passes unseen. Each case here sets the arrays one rule reads and states the result
from the rule itself: cache-and-draft §7.2 `extend_draft_kv_row`, §9.3 the group loop, the
draft-KV map's checkout / checkin with LRU eviction; masks-and-scheduling §15, §16, §20.1 the
integer key encoding (`2 * len + ragged_flag`) per world, the key tuple it stands for, the log2
table, the vectorized admission (against the sequential loop it replaces), bucket selection and
whole steps compared with `reference.scheduler` on the same sequences.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from raggedspec.reference.cache import DRAFT_CACHE_CAPACITY
from raggedspec.reference.lengths_draft import (
    STALL_INELIGIBLE,
    STALL_RAGGED,
    STALL_UNIFORM,
    DraftMirror,
)
from raggedspec.reference.lengths_scheduler import ScheduleMirror, admit_waiting
from raggedspec.reference.plan import StepPlan, plan_drafts
from raggedspec.reference.policy import NCOL
from raggedspec.reference.scheduler import (
    COALESCE_PAYBACK_STEPS,
    PrefillFloor,
    SchedulerState,
    SeqRecord,
    schedule,
    select_running_bucket,
)
from raggedspec.reference.scheduler_telemetry import BucketTelemetry
from raggedspec.reference.trace import COL


# ---------------------------------------------------------------------------------- the draft half


class Engine(DraftMirror):
    """The state DraftMirror reads, for n sequences (every array indexed by sequence id)."""

    def __init__(self, n, *, w=3, max_seq_len=4096, cap=None, **arrays):
        self.d_cur = np.zeros(n, dtype=np.int64)
        self.d_cap = np.full(n, DRAFT_CACHE_CAPACITY, dtype=np.int64)
        self.d_filled = np.zeros(n, dtype=np.int64)
        self.d_seed = np.full(n, -1, dtype=np.int64)
        self.d_pois = np.zeros(n, dtype=bool)
        self.d_in = np.zeros(n, dtype=bool)
        self.d_stamp = np.zeros(n, dtype=np.int64)
        self.L = np.zeros(n, dtype=np.int64)
        self.may = np.ones(n, dtype=bool)
        self.clock, self.w, self.max, self.tier_a = 0, w, max_seq_len, False
        self.sc = SimpleNamespace(max_draft_kv_seqs=cap)
        self.stalls = {STALL_UNIFORM: 5, STALL_RAGGED: 5, STALL_INELIGIBLE: 5}
        for k, v in arrays.items():
            setattr(self, k, np.asarray(v, dtype=getattr(self, k).dtype))


def ids(*xs):
    return np.asarray(xs, dtype=np.int64)


@pytest.mark.rule("lengths mode, draft half")
def test_checkout_gives_a_missing_entry_a_fresh_state_and_takes_every_entry_out():
    e = Engine(3, d_in=[True, False, True], d_cur=[4, 9, 7], d_cap=[528, 528, 528],
               d_filled=[3, 9, 6], d_seed=[2, 8, 5], d_pois=[False, True, True])
    e._checkout(ids(0, 1))
    assert e.d_cur.tolist() == [4, 0, 7] and e.d_filled.tolist() == [3, 0, 6]
    assert e.d_cap.tolist() == [528, DRAFT_CACHE_CAPACITY, 528]
    assert e.d_seed.tolist() == [2, -1, 5] and e.d_pois.tolist() == [False, False, True]
    assert e.d_in.tolist() == [False, False, True]


@pytest.mark.rule("lengths mode, draft half")
def test_checkin_stamps_in_row_order_and_evicts_the_oldest_beyond_the_cap():
    e = Engine(4, cap=3, d_in=[False, True, False, False], d_stamp=[0, 4, 0, 0])
    e.clock = 10
    e._checkin(ids(2, 0))
    assert e.d_stamp[[2, 0]].tolist() == [11, 12] and e.clock == 12
    assert e.d_in.tolist() == [True, True, True, False]  # 3 present == the cap: none evicted
    e._checkin(ids(3))
    assert e.d_stamp[3] == 13 and e.clock == 13
    assert e.d_in.tolist() == [True, False, True, True]  # 4 > 3: the oldest (stamp 4) goes


def extend_case():
    """Rows (L, filled, off, cur, cap, seed, poisoned), t = 3, one rule each."""
    rows = [
        (5, 2, 2, 2, 16, -1, False),   # 0: seed p = 3 in [2, 5), write [2, 4)
        (5, 2, 2, 2, 16, -1, True),    # 1: poisoned: no seed, stays poisoned
        (7, 2, 2, 2, 16, 1, False),    # 2: p = 5 == off + t: the old seed stays; write [2, 5)
        (1, 0, 0, 0, 16, -1, False),   # 3: L = 1: hi = 0, nothing written
        (5, 3, 1, 7, 16, -1, False),   # 4: hi = min(4, 4) = 4 > lo = 3: write one column
        (5, 4, 1, 7, 16, -1, False),   # 5: lo = hi = 4: nothing written, cur kept
        (30, 20, 20, 9, 16, -1, False),  # 6: filled 20 > cap 16: set_len refused, poisoned
        (5, 2, 3, 2, 16, -1, False),   # 7: off 3 > filled 2: not contiguous, poisoned
    ]
    cols = list(zip(*rows, strict=True))
    e = Engine(len(rows), L=cols[0], d_filled=cols[1], d_cur=cols[3], d_cap=cols[4],
               d_seed=cols[5], d_pois=cols[6])
    return e, np.asarray(cols[2], dtype=np.int64)


@pytest.mark.rule("lengths mode, draft half")
def test_extend_follows_each_check_of_extend_draft_kv_row():
    e, off = extend_case()
    e._extend(np.arange(len(off)), off, 3)
    assert e.d_seed.tolist() == [3, -1, 1, -1, 3, 3, -1, -1]
    assert e.d_filled.tolist() == [4, 2, 5, 0, 4, 4, 20, 2]
    assert e.d_cur.tolist() == [4, 2, 5, 0, 4, 7, 9, 2]
    assert e.d_cap.tolist() == [16] * 8
    assert e.d_pois.tolist() == [False, True, False, False, False, False, True, True]


@pytest.mark.rule("lengths mode, draft half")
def test_extend_grows_to_exactly_max_seq_len_and_poisons_past_it():
    """filled 16 of capacity 16, one more column: the capacity becomes 16 + 512 = 528,
    allowed when max_seq_len is 528, refused (poisoned, nothing written) at 527."""
    for top, ok in ((528, True), (527, False)):
        e = Engine(1, max_seq_len=top, L=[18], d_filled=[16], d_cur=[16])
        e._extend(ids(0), ids(16), 1)
        assert (e.d_cap[0], e.d_filled[0], e.d_pois[0]) == ((528, 17, False) if ok else
                                                            (16, 16, True))
        assert e.d_cur[0] == (17 if ok else 16)  # set_len(filled) before the refusal


@pytest.mark.rule("lengths mode, draft half")
def test_tier_a_extends_nothing():
    e, off = extend_case()
    e.tier_a = True
    before = (e.d_seed.copy(), e.d_filled.copy(), e.d_pois.copy())
    e._extend(np.arange(len(off)), off, 3)
    assert [a.tolist() for a in before] == [e.d_seed.tolist(), e.d_filled.tolist(),
                                           e.d_pois.tolist()]


def draft(e, u, cache_lens, budget, psa):
    n = len(u)
    drafts, rows, res = np.zeros(n, dtype=np.int64), np.zeros((n, NCOL), dtype=np.int64), {}
    c, u = np.asarray(cache_lens, dtype=np.int64), np.asarray(u, dtype=np.int64)
    plan = StepPlan(int(c.max()), c.max() - c, psa, False, c, c + u, u, True,
                    np.asarray(budget, dtype=np.int64), c, None, None)
    plan_drafts(plan, e.may[:n].tolist(), e.w)
    ok = e._draft(np.arange(n), plan, drafts, rows, res)
    return ok, drafts, rows, res


def eligible(n, start, **kw):
    """n rows whose seed and filled sit at `start` (a list), cur = start + 1."""
    start = list(start)
    return Engine(n, d_seed=start, d_filled=start, d_cur=[s + 1 for s in start], **kw)


@pytest.mark.rule("lengths mode, draft half")
def test_an_ineligible_row_is_counted_and_drafts_nothing():
    """u = 1, cache_len 9: chain start 8. Row 0 has budget 0; row 1 a seed at 7, not 8;
    row 2 budget 1, filled == start: it drafts w - u = 2."""
    e = eligible(3, [8, 8, 8])
    e.d_seed[1] = 7
    ok, drafts, rows, res = draft(e, [1, 1, 1], [9, 9, 9], [0, 5, 1], False)
    assert ok and drafts.tolist() == [0, 0, 2] and res["groups"] == 1
    assert e.stalls[STALL_INELIGIBLE] == 5 + 2
    assert rows[2, COL["chain_start"]] == 8 and rows[2, COL["group_u"]] == 1


@pytest.mark.rule("lengths mode, draft half")
def test_a_uniform_chain_grows_its_capacity_only_when_full():
    """Chain start 15 in capacity 16: one draft fits (cur 16, cap 16); from 16, two drafts
    need one 512-column block (cur 18, cap 528); with max_seq_len 100 that block is refused
    and the chain fails the step."""
    e = eligible(1, [15], w=2)
    assert draft(e, [1], [16], [5], False)[0]
    assert (e.d_cur[0], e.d_cap[0], e.d_filled[0]) == (16, 16, 16)
    e = eligible(1, [16], w=3)
    assert draft(e, [1], [17], [5], False)[0]
    assert (e.d_cur[0], e.d_cap[0], e.d_filled[0]) == (18, 528, 17)
    e = eligible(1, [16], w=3, max_seq_len=528)
    assert draft(e, [1], [17], [5], False)[0] and e.d_cap[0] == 528
    e = eligible(1, [16], w=3, max_seq_len=100)
    assert not draft(e, [1], [17], [5], False)[0]


@pytest.mark.rule("lengths mode, draft half")
def test_a_refused_uniform_group_is_counted_and_the_next_group_still_drafts():
    """Group u = 1 (rows 0, 1: lengths 9 and 10 differ, not batchable) is refused; group
    u = 2 (row 2) drafts. A lone row whose start equals its capacity is batchable."""
    e = eligible(3, [8, 8, 16], w=3, d_cap=[16, 16, 16])
    e.d_cur[:] = [9, 10, 17]
    ok, drafts, _, _ = draft(e, [1, 1, 2], [9, 9, 16], [5, 5, 5], False)
    assert ok and drafts.tolist() == [0, 0, 1] and e.stalls[STALL_UNIFORM] == 5 + 2
    e = eligible(3, [8, 8, 16], w=3)
    e.d_cap[:2] = [4, 4]  # start 8 past capacity 4: refused
    e.d_cur[:2] = [4, 4]
    ok, drafts, _, _ = draft(e, [1, 1, 2], [9, 9, 16], [5, 5, 5], False)
    assert ok and drafts.tolist() == [0, 0, 1] and e.stalls[STALL_UNIFORM] == 5 + 2


@pytest.mark.rule("lengths mode, draft half")
def test_a_ragged_group_drafts_front_aligned_and_strips_each_rows_lead():
    """Per-sequence advance, chain starts 5 and 3 (top 5, leads 0 and 2): the front-aligned
    batch is 5 wide; two drafts grow it to 5 + 512 = 517 and end at 7, so row 0 holds 7 of
    517 and row 1 5 of 515; filled is start + 1."""
    e = eligible(2, [5, 3], w=3)
    ok, drafts, rows, _ = draft(e, [1, 1], [6, 4], [5, 5], True)
    assert ok and drafts.tolist() == [2, 2]
    assert e.d_cur.tolist() == [7, 5] and e.d_cap.tolist() == [517, 515]
    assert e.d_filled.tolist() == [6, 4]
    assert rows[:, COL["chain_start"]].tolist() == [5, 3]
    assert rows[:, COL["group_start"]].tolist() == [0, 0]


@pytest.mark.rule("lengths mode, draft half")
def test_a_ragged_group_is_refused_by_its_rows_not_by_the_widest_alone():
    """Refused (counted, then the next group drafts) when a start is past its row's held
    length, or when a row with a lead would be padded above max_seq_len; a lead-0 row's
    own capacity does not count."""
    e = eligible(3, [5, 3, 16], w=3)
    e.d_cur[1] = 2  # start 3 past the 2 held
    ok, drafts, _, _ = draft(e, [1, 1, 2], [6, 4, 16], [5, 5, 5], True)
    assert ok and drafts.tolist() == [0, 0, 1] and e.stalls[STALL_RAGGED] == 5 + 2
    e = eligible(2, [5, 3], w=3, max_seq_len=600)
    e.d_cap[:] = [700, 16]  # row 0 (lead 0) over 600 is not padded; row 1 pads to 16
    ok, drafts, _, _ = draft(e, [1, 1], [6, 4], [5, 5], True)
    assert ok and drafts.tolist() == [2, 2] and e.stalls[STALL_RAGGED] == 5
    e = eligible(2, [5, 3], w=3, max_seq_len=600)
    e.d_cap[:] = [16, 601]  # row 1 (lead 2) padded to 601 > 600: refused
    ok, drafts, _, _ = draft(e, [1, 1], [6, 4], [5, 5], True)
    assert ok and drafts.tolist() == [0, 0] and e.stalls[STALL_RAGGED] == 5 + 2
    e = eligible(2, [5, 3], w=3, max_seq_len=600)
    e.d_cap[:] = [16, 600]  # exactly max_seq_len: allowed
    assert draft(e, [1, 1], [6, 4], [5, 5], True)[1].tolist() == [2, 2]


@pytest.mark.rule("lengths mode, draft half")
def test_a_step_with_no_candidate_row_drafts_nothing_and_does_not_fail():
    """u == w (nothing left to draft) or may-not-draft rows: no group, the step goes on."""
    e = eligible(2, [8, 8], w=3, may=[True, False])
    ok, drafts, _, res = draft(e, [3, 1], [9, 9], [5, 5], False)
    assert ok and drafts.tolist() == [0, 0] and res == {}


@pytest.mark.rule("lengths mode, draft half")
def test_the_growth_check_runs_only_when_the_chain_outgrows_its_capacity():
    """max_seq_len 12 with the draft KV's initial capacity 16: a chain from 10 to 16 fits
    the 16 columns it has, so it is never checked against max_seq_len; one more column
    needs a block and is refused."""
    e = eligible(1, [10], w=7, max_seq_len=12)
    assert draft(e, [1], [11], [5], False)[0]
    assert (e.d_cur[0], e.d_cap[0]) == (16, 16)
    e = eligible(1, [10], w=8, max_seq_len=12)
    assert not draft(e, [1], [11], [5], False)[0]


@pytest.mark.rule("lengths mode, draft half")
def test_a_ragged_group_at_its_boundaries():
    """A start equal to its row's held length is not past it (drafts); a row with lead 1 is
    padded like any other lead (capacity 601 > max_seq_len 600: refused)."""
    e = eligible(2, [5, 3], w=3)
    e.d_cur[1] = 3
    assert draft(e, [1, 1], [6, 4], [5, 5], True)[1].tolist() == [2, 2]
    e = eligible(2, [5, 4], w=3, max_seq_len=600)
    e.d_cap[:] = [16, 601]
    ok, drafts, _, _ = draft(e, [1, 1], [6, 5], [5, 5], True)
    assert ok and drafts.tolist() == [0, 0] and e.stalls[STALL_RAGGED] == 5 + 2


# ------------------------------------------------------------------------------ the scheduler half


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


def sequential_admission(new, room, cap):
    """The loop `scheduler.schedule` runs over the sorted waiting queue (the oracle)."""
    taken, n_new, n_run = [], 0, 0
    for is_new in new:
        capped = is_new and cap is not None and n_new >= cap
        if n_run + 1 <= room and not capped:
            taken.append(True)
            n_run += 1
            n_new += is_new
        else:
            taken.append(False)
    return taken


@pytest.mark.rule("lengths mode, scheduler half")
@given(
    new=st.lists(st.booleans(), max_size=40),
    room=st.integers(-3, 45),
    cap=st.none() | st.integers(1, 10),
)
def test_the_vectorized_admission_equals_the_sequential_rule(new, room, cap):
    got = admit_waiting(np.array(new, dtype=bool), room, cap)
    assert got.tolist() == sequential_admission(new, room, cap)


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
