"""Scheduler keys, bucket selection, bucketing and urgency (masks-and-scheduling.md §15, §16):
`cache_bucket_len` and the first populated slot, `compute_priority`, the key of each world (W0's
3-tuple, WA's pinned 0, WB's ragged bucket), `select_running_bucket` with the coalescing payback
(against an independent oracle too), and one bucketing pass with its urgency bookkeeping. Whole
`schedule` steps, the WA floor and cap and the shattering law are in
test_scheduler_admission.py; ragged admission, the engine's cache instruction and the telemetry
in test_scheduler_engine.py.

Expected values come from the spec's worked examples and test-asserted numbers, or from
oracles written here independently of `reference/scheduler.py`.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from raggedspec.conformance.helpers import (GRANT, REFUSE, completion, prompt, raises_exactly,
                                            state_for)
from raggedspec.conformance.strategies import running_sets
from raggedspec.reference.scheduler import (
    COALESCE_PAYBACK_STEPS,
    Bucketing,
    PrefillFloor,
    RaggedAdmission,
    SchedulerState,
    SeqRecord,
    bucket_and_waitlist_seqs_waiting,
    bucket_keys,
    cache_bucket_len,
    compute_priority,
    first_populated_slot_len,
    ragged_bucket_len,
    scheduler_key,
    select_running_bucket,
)


# ---------------------------------------------------------------------------- §15 cache_bucket_len


@pytest.mark.rule("cache_bucket_len")
def test_cache_bucket_len_of_a_fresh_101_token_sequence_is_100():
    assert cache_bucket_len(None, 101) == 100


@pytest.mark.rule("cache_bucket_len")
def test_cache_bucket_len_reads_the_own_cache_not_the_token_count():
    # An MTP row whose cache length differs from len()-1: the cache wins.
    assert cache_bucket_len(37, 101) == 37
    assert cache_bucket_len(0, 50) == 0, "a populated slot of length 0 is still populated"


@pytest.mark.rule("cache_bucket_len")
def test_cache_bucket_len_saturates_and_refuses_negative_input():
    assert cache_bucket_len(None, 0) == 0
    with pytest.raises(ValueError, match="-1"):
        cache_bucket_len(-1, 5)
    with pytest.raises(ValueError, match="-3"):
        cache_bucket_len(None, -3)


@pytest.mark.rule("cache_bucket_len reads the first populated slot")
def test_first_populated_slot_len_reads_slot_0_first():
    assert first_populated_slot_len([12, 40, 7]) == 12
    assert first_populated_slot_len([None, 40, 7]) == 40
    assert first_populated_slot_len([None, None]) is None
    assert first_populated_slot_len([]) is None


@pytest.mark.rule("cache_bucket_len reads the first populated slot")
def test_first_populated_slot_len_accepts_0_and_refuses_a_negative_length():
    assert first_populated_slot_len([None, 0, 7]) == 0
    with raises_exactly("slot length -1 must be >= 0"):
        first_populated_slot_len([None, -1])


@pytest.mark.rule("compute_priority")
def test_compute_priority_is_urgency_plus_log2_of_the_token_count():
    assert compute_priority(0, 8) == 3.0
    assert compute_priority(2, 1024) == 12.0
    assert compute_priority(5, 1) == 5.0
    assert compute_priority(1, 500) == pytest.approx(1 + math.log2(500), abs=0)
    with pytest.raises(ValueError, match="n_tokens 0"):
        compute_priority(0, 0)
    with pytest.raises(ValueError, match="urgency -1"):
        compute_priority(-1, 4)


@pytest.mark.rule("WA key pinned to 0 while ragged_decode_supported")
def test_the_records_and_the_state_refuse_with_the_documented_texts():
    with raises_exactly("sequence id -1 must be >= 0"):
        SeqRecord(-1, 5)
    with raises_exactly("sequence 3: n_tokens 0 must be >= 1"):
        SeqRecord(3, 0)
    with raises_exactly("sequence 3: cache_len -1 must be None or >= 0"):
        SeqRecord(3, 5, cache_len=-1)
    with raises_exactly("sequence 3: token_offset -1 must be >= 0"):
        SeqRecord(3, 5, token_offset=-1)
    with raises_exactly("steps_since_prompt -1 must be >= 0"):
        PrefillFloor(4, -1)
    with raises_exactly("max_seqs 0 must be >= 1"):
        SchedulerState(max_seqs=0)
    with raises_exactly("prefill_cap 0 must be None or >= 1"):
        SchedulerState(prefill_cap=0)


# ------------------------------------------------------------------------------- §15 keys by world


@pytest.mark.rule("keys by world: W0 3-tuple")
def test_keys_by_world_w0_is_the_3_tuple_and_images_count_only_for_prompts():
    c = completion(0, 101, images=True, token_offset=3)
    p = prompt(1, 101, images=True, token_offset=3)
    assert scheduler_key("W0", c) == (100, False, 3)
    assert scheduler_key("W0", p) == (100, True, 3)
    # The flags of other worlds do nothing in W0.
    assert scheduler_key("W0", c, ragged_decode_supported=True, ragged_len=5) == (100, False, 3)


@pytest.mark.rule("WA key pinned to 0 while ragged_decode_supported")
def test_keys_by_world_wa_pins_completions_to_0_only_while_ragged_decode_supported():
    c, p = completion(0, 101, cache_len=70), prompt(1, 91)
    assert scheduler_key("WA", c) == (70, False, 0)
    assert scheduler_key("WA", c, ragged_decode_supported=True) == (0, False, 0)
    assert scheduler_key("WA", p, ragged_decode_supported=True) == (90, False, 0), \
        "prompts keep their exact key"


@pytest.mark.rule("WB keys, granted and refused; the refused bucket key")
def test_keys_by_world_wb_granted_and_refused():
    c1, c2, p = completion(0, 140), completion(1, 101), prompt(2, 120)
    running = [c1, c2, p]
    assert ragged_bucket_len(running, GRANT) == 100
    assert ragged_bucket_len(running, REFUSE) is None
    assert scheduler_key("WB", c1, ragged_len=100) == (100, False, 0, True)
    assert scheduler_key("WB", p, ragged_len=100) == (119, False, 0, False)
    assert scheduler_key("WB", c1) == (139, False, 0, False)


@pytest.mark.rule("keys by world: W0 3-tuple")
def test_scheduler_key_refuses_an_unknown_world():
    with pytest.raises(ValueError, match="'W9'"):
        scheduler_key("W9", completion(0, 5))
    with pytest.raises(ValueError, match="'WC'"):
        SchedulerState(world="WC")


@pytest.mark.rule("WB ragged_bucket_len")
def test_the_ragged_bucket_takes_its_members_minimum_length():
    seqs = [completion(i, n) for i, n in enumerate([140, 101, 300])]
    st_ = state_for("WB", admission=GRANT)
    keys = bucket_keys(seqs, st_)
    assert keys == [(100, False, 0, True)] * 3


@pytest.mark.rule("WB ragged_bucket_len")
def test_prompts_are_never_folded_into_the_ragged_completion_bucket():
    # Completions at cache 119/159/199; prompts shorter, equal to and longer than the key.
    seqs = [completion(i, 120 + i * 40) for i in range(3)]
    seqs += [prompt(10, 50), prompt(11, 120), prompt(12, 400)]
    assert ragged_bucket_len(seqs, GRANT) == 119, "a 49-long prompt must not pull the min down"
    keys = bucket_keys(seqs, state_for("WB", admission=GRANT))
    assert keys[0] == keys[1] == keys[2] == (119, False, 0, True)
    assert keys[4] == (119, False, 0, False) and keys[4] != keys[0], "the flag separates them"
    assert len({keys[3], keys[4], keys[5]}) == 3 and not any(k[3] for k in keys[3:])


@pytest.mark.rule("WB ragged_bucket_len")
def test_ragged_bucket_len_is_none_without_completions():
    assert ragged_bucket_len([prompt(0, 9), prompt(1, 30)], GRANT) is None


@pytest.mark.rule(
    "§22 dispatch tests: each predicate tested directly",
    "WB keys, granted and refused; the refused bucket key",
)
@given(running=running_sets())
def test_wb_refused_key_is_the_w0_key_plus_false(running):
    """§22 dispatch test: structurally, a refused WB run builds the W0 partition."""
    w0 = bucket_keys(running, state_for("W0"))
    wb = bucket_keys(running, state_for("WB", admission=RaggedAdmission.decide("no")))
    assert wb == [k + (False,) for k in w0]
    for s, k in zip(running, w0, strict=False):
        assert k == (
            cache_bucket_len(s.cache_len, s.n_tokens),
            s.images and s.is_prompt,
            s.token_offset,
        )


@pytest.mark.rule("WB keys, granted and refused; the refused bucket key")
@given(running=running_sets())
def test_wb_granted_every_completion_shares_one_key_whatever_the_lengths(running):
    """Lengths never split the completions; only the offset (part of every key) can.
    With the offsets equal (the live case: arc's token_offset reads 0) it is one key."""
    keys = bucket_keys(running, state_for("WB", admission=GRANT))
    comps = [(s, k) for s, k in zip(running, keys, strict=False) if not s.is_prompt]
    if comps:
        low = min(
            s.cache_len if s.cache_len is not None else max(s.n_tokens - 1, 0) for s, _ in comps
        )
        assert {k for _, k in comps} == {(low, False, s.token_offset, True) for s, _ in comps}
        same_offset = [replace(s, token_offset=0) for s in running]
        keys0 = bucket_keys(same_offset, state_for("WB", admission=GRANT))
        assert len({k for s, k in zip(same_offset, keys0, strict=False) if not s.is_prompt}) == 1
    assert all(not k[3] for s, k in zip(running, keys, strict=False) if s.is_prompt)


# ----------------------------------------------------------------------- §16 select_running_bucket


def _prio(n: int, tokens: int, urgency: int = 0) -> float:
    return n * (urgency + math.log2(tokens))


@pytest.mark.rule("select_running_bucket and COALESCE_PAYBACK_STEPS = 256")
def test_select_running_bucket_coalesces_32_at_101_with_32_at_102():
    short, long_ = (101, False, 0), (102, False, 0)
    buckets = {short: list(range(32)), long_: list(range(32, 64))}
    pr = {short: _prio(32, 101), long_: _prio(32, 102, urgency=1)}
    assert pr[long_] > pr[short], "precondition: greedy picks the longer bucket"
    assert 32 * 1 <= 32 * 256
    assert select_running_bucket(buckets, pr, False) == short


@pytest.mark.rule("select_running_bucket and COALESCE_PAYBACK_STEPS = 256")
def test_select_running_bucket_keeps_the_cohort_1_at_21_vs_63_at_500():
    new, cohort = (21, False, 0), (500, False, 0)
    buckets = {new: [0], cohort: list(range(1, 64))}
    pr = {new: _prio(1, 21), cohort: _prio(63, 500)}
    assert 63 * 479 == 30177 > COALESCE_PAYBACK_STEPS
    assert select_running_bucket(buckets, pr, False) == cohort


@pytest.mark.rule("select_running_bucket and COALESCE_PAYBACK_STEPS = 256")
def test_select_running_bucket_refuses_to_coalesce_eight_lengths_64_apart():
    keys = [(100 + 64 * j, False, 0) for j in range(8)]
    buckets = {k: [j] for j, k in enumerate(keys)}
    pr = {k: _prio(1, k[0] + 1, urgency=1 if j else 0) for j, k in enumerate(keys)}
    greedy = max(pr, key=pr.get)
    assert greedy != keys[0] and 7 * 64 == 448 > COALESCE_PAYBACK_STEPS
    assert select_running_bucket(buckets, pr, False) == greedy


@pytest.mark.rule("select_running_bucket and COALESCE_PAYBACK_STEPS = 256")
def test_select_running_bucket_discrete_is_min_length():
    short, long_ = (101, False, 0), (500, False, 0)
    buckets = {long_: list(range(63)), short: [99]}
    assert select_running_bucket(buckets, {}, True) == short


@pytest.mark.rule("select_running_bucket and COALESCE_PAYBACK_STEPS = 256")
def test_select_running_bucket_coalesces_at_exactly_the_payback_bound():
    """(total - n_min) * gap <= n_min * 256 with equality -> min; one more token -> greedy."""
    assert COALESCE_PAYBACK_STEPS == 256
    for gap, want_min in [(256, True), (257, False), (255, True)]:
        lo, hi = (10, False, 0), (10 + gap, False, 0)
        buckets = {lo: [0], hi: [1]}
        pr = {lo: 1.0, hi: 2.0}
        assert ((2 - 1) * gap <= 1 * 256) is want_min
        assert select_running_bucket(buckets, pr, False) == (lo if want_min else hi)


@pytest.mark.rule("select_running_bucket and COALESCE_PAYBACK_STEPS = 256")
def test_select_running_bucket_coalesce_uses_the_nearest_longer_bucket():
    lo, near, far = (100, False, 0), (101, False, 0), (5000, False, 0)
    buckets = {lo: [0], near: [1], far: [2]}
    pr = {lo: 1.0, near: 2.0, far: 3.0}
    # nearest gap 1: (3-1)*1 = 2 <= 256 -> min. The farthest would give 2*4900 > 256.
    assert select_running_bucket(buckets, pr, False) == lo


@pytest.mark.rule("select_running_bucket and COALESCE_PAYBACK_STEPS = 256")
@pytest.mark.parametrize("other", [(101, True, 0), (101, False, 1)], ids=["imgs", "offset"])
def test_the_coalescing_target_must_agree_on_imgs_and_offset(other):
    lo = (100, False, 0)
    buckets = {lo: list(range(32)), other: list(range(32, 64))}
    pr = {lo: 1.0, other: 2.0}
    # A mergeable neighbour one token away would be taken: (64-32)*1 <= 32*256.
    assert select_running_bucket(buckets, pr, False) == other


@pytest.mark.rule("select_running_bucket and COALESCE_PAYBACK_STEPS = 256")
def test_the_coalescence_override_never_targets_across_the_ragged_flag():
    ragged, pk = (119, False, 0, True), (120, False, 0, False)
    buckets = {ragged: list(range(32)), pk: list(range(32, 64))}
    pr = {ragged: _prio(32, 120), pk: _prio(32, 121, urgency=1)}
    assert pr[pk] > pr[ragged]
    assert select_running_bucket(buckets, pr, False) == pk
    # negative control: the same arithmetic with the flag equal does coalesce
    same = (120, False, 0, True)
    assert select_running_bucket({ragged: buckets[ragged], same: buckets[pk]},
                                 {ragged: pr[ragged], same: pr[pk]}, False) == ragged


@pytest.mark.rule("select_running_bucket and COALESCE_PAYBACK_STEPS = 256")
def test_select_running_bucket_breaks_ties_by_the_smallest_key():
    a, b = (5, False, 0), (5, True, 0)
    assert select_running_bucket({b: [0], a: [1]}, {}, True) == a
    # b and c tie on the top priority -> the smaller key b; a (the min) has no neighbour
    # with its imgs/offset above it, so greedy stands.
    c = (900, False, 1)
    assert select_running_bucket({a: [0], b: [1], c: [2]}, {a: 0.0, b: 7.0, c: 7.0}, False) == b


@pytest.mark.rule("select_running_bucket and COALESCE_PAYBACK_STEPS = 256")
def test_select_running_bucket_refuses_malformed_input():
    with raises_exactly("select_running_bucket needs at least one bucket"):
        select_running_bucket({}, {}, True)
    with raises_exactly("every bucket must have a member"):
        select_running_bucket({(5, False, 0): [completion(0, 6)], (9, False, 0): []}, {}, True)
    with pytest.raises(ValueError, match="priorities keys"):
        select_running_bucket({(1, False, 0): [0], (2, False, 0): [1]}, {(1, False, 0): 1.0}, False)


def oracle_select(buckets, priorities, discrete):
    """Independent restatement of §16: sort-based, no shared helpers."""
    ordered = sorted(buckets)  # by len first; ties by the rest
    mn = ordered[0]
    if discrete:
        return mn
    ranked = sorted(priorities, key=lambda k: (-priorities[k], k))
    greedy = ranked[0]
    if greedy == mn:
        return mn
    cands = sorted(
        k[0]
        for k in ordered
        if k[0] > mn[0] and all(x == y for x, y in zip(k[1:], mn[1:], strict=False))
    )
    if not cands:
        return greedy
    n_min, total = len(buckets[mn]), sum(len(v) for v in buckets.values())
    if (total - n_min) * (cands[0] - mn[0]) <= n_min * 256:
        return mn
    return greedy


@pytest.mark.rule("select_running_bucket and COALESCE_PAYBACK_STEPS = 256")
@given(data=st.data())
def test_select_running_bucket_matches_an_independent_oracle(data):
    keys = data.draw(
        st.lists(
            st.tuples(st.integers(0, 600), st.booleans(), st.integers(0, 1), st.booleans()),
            min_size=1,
            max_size=6,
            unique=True,
        )
    )
    buckets = {k: list(range(data.draw(st.integers(1, 70)))) for k in keys}
    priorities = {k: float(data.draw(st.integers(0, 50))) for k in keys}
    discrete = data.draw(st.booleans())
    assert select_running_bucket(buckets, priorities, discrete) == oracle_select(
        buckets, priorities, discrete
    )


# ----------------------------------------------------------------------- §16 bucketing and urgency


@pytest.mark.rule("bucket_and_waitlist_seqs_waiting and urgency")
def test_bucket_and_waitlist_with_one_bucket_runs_everything_and_resets_urgency():
    st_ = state_for("W0")
    st_.urgency = {0: 3, 1: 5}
    b = bucket_and_waitlist_seqs_waiting([completion(0, 10), completion(1, 10)], False, st_)
    assert [s.id for s in b.chosen] == [0, 1] and b.waitlisted == [] and b.n_buckets == 1
    assert st_.urgency == {0: 0, 1: 0}


@pytest.mark.rule("bucket_and_waitlist_seqs_waiting and urgency")
def test_waitlisted_sequences_gain_urgency_and_keep_their_state():
    st_ = state_for("W0")
    st_.urgency = {2: 4}
    running = [completion(0, 10), completion(1, 10), prompt(2, 50)]
    b = bucket_and_waitlist_seqs_waiting(running, True, st_)
    assert [s.id for s in b.chosen] == [0, 1]
    assert b.waitlisted == [running[2]], "waitlisted record is returned unchanged"
    assert st_.urgency == {0: 0, 1: 0, 2: 5}


@pytest.mark.rule("bucket_and_waitlist_seqs_waiting and urgency")
def test_urgency_is_read_by_the_greedy_choice_and_absent_ids_have_none():
    """A at len 10 (11 tokens) and B at len 500 (501 tokens), not discrete; gap 490 is far
    beyond the payback (1 * 490 > 1 * 256), so the greedy bucket runs. Without urgency B
    wins (log2 501 = 8.97 > log2 11 = 3.46). With urgency 6 for A (none for B, so 0):
    6 + 3.46 = 9.46 > 8.97, A is greedy == min and runs."""
    a, b = completion(0, 11, cache_len=10), completion(1, 501, cache_len=500)
    assert 6 + math.log2(11) > math.log2(501) > math.log2(11)
    plain = SchedulerState()
    assert bucket_and_waitlist_seqs_waiting([a, b], False, plain).chosen == [b]
    urgent = SchedulerState(urgency={0: 6})
    got = bucket_and_waitlist_seqs_waiting([a, b], False, urgent)
    assert got.chosen == [a] and got.waitlisted == [b]
    assert urgent.urgency == {0: 0, 1: 1}


@pytest.mark.rule("keys by world: W0 3-tuple")
def test_bucketing_nothing_gives_no_key():
    assert bucket_and_waitlist_seqs_waiting([], False, SchedulerState()) == Bucketing(
        None, [], [], 0, []
    )


@pytest.mark.rule("keys by world: W0 3-tuple", "bucket_and_waitlist_seqs_waiting and urgency")
@given(
    running=running_sets(),
    world=st.sampled_from(["W0", "WA", "WB"]),
    flag=st.booleans(),
    grant=st.booleans(),
    discrete=st.booleans(),
    urg=st.lists(st.integers(0, 5), min_size=12, max_size=12),
    floor=st.sampled_from([None, 1, 4]),
    counter=st.integers(0, 5),
)
def test_bucketing_properties_in_every_world(
    running, world, flag, grant, discrete, urg, floor, counter
):
    """Exactly one bucket runs (all of it); every running sequence is chosen or waitlisted,
    once; chosen urgency -> 0, waitlisted +1."""
    st_ = state_for(world, ragged_decode_supported=flag, admission=GRANT if grant else REFUSE,
                    floor=PrefillFloor(floor, counter))
    st_.urgency = {s.id: urg[s.id] for s in running}
    before = dict(st_.urgency)
    keys = dict(zip((s.id for s in running), bucket_keys(running, st_), strict=False))
    b = bucket_and_waitlist_seqs_waiting(running, discrete, st_)
    chosen_ids = [s.id for s in b.chosen]
    wait_ids = [s.id for s in b.waitlisted]
    assert sorted(chosen_ids + wait_ids) == sorted(s.id for s in running)
    assert chosen_ids, "a non-empty running set always runs something"
    assert {keys[i] for i in chosen_ids} == {b.key}
    assert all(keys[i] != b.key for i in wait_ids)
    assert b.n_buckets == len(set(keys.values()))
    assert all(st_.urgency[i] == 0 for i in chosen_ids)
    assert all(st_.urgency[i] == before[i] + 1 for i in wait_ids)
    if world == "W0":
        distinct = {
            (cache_bucket_len(s.cache_len, s.n_tokens), s.images and s.is_prompt, s.token_offset)
            for s in running
        }
        assert b.n_buckets == len(distinct)
        if discrete:
            assert b.key[0] == min(k[0] for k in distinct)
