"""Scheduler keys, bucket selection, bucketing and urgency, and whole scheduling steps
(masks-and-scheduling.md §15, §16, §20). The WA floor, RaggedAdmission and the cache
instruction are in test_scheduler_admission.py, the telemetry in test_scheduler_telemetry.py.

Expected values come from the spec's worked examples and test-asserted numbers, or from
oracles written here independently of `reference/scheduler.py`.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from raggedspec.reference.scheduler import (
    COALESCE_PAYBACK_STEPS,
    PrefillFloor,
    RaggedAdmission,
    SchedulerState,
    SeqRecord,
    bucket_and_waitlist_seqs_waiting,
    bucket_keys,
    cache_bucket_len,
    compute_priority,
    first_populated_slot_len,
    install_admission,
    ragged_bucket_len,
    schedule,
    scheduler_key,
    select_running_bucket,
)

GRANT = RaggedAdmission.decide(None)
REFUSE = RaggedAdmission.refused()


def comp(i: int, n: int, **kw) -> SeqRecord:
    """A running completion of `n` tokens with no explicit cache (cache_bucket_len n-1),
    like arc's `seq_of_len`."""
    return SeqRecord(i, n, **kw)


def prompt(i: int, n: int, **kw) -> SeqRecord:
    return SeqRecord(i, n, is_prompt=True, **kw)


def state_for(world: str, **kw) -> SchedulerState:
    admission = kw.pop("admission", None)
    st_ = SchedulerState(world=world, **kw)
    if admission is not None:
        install_admission(st_, admission)
    return st_


# ------------------------------------------------------------------ §15 cache_bucket_len


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


# ------------------------------------------------------------------ §15 keys by world


@pytest.mark.rule("keys by world: W0 3-tuple")
def test_keys_by_world_w0_is_the_3_tuple_and_images_count_only_for_prompts():
    c = comp(0, 101, images=True, token_offset=3)
    p = prompt(1, 101, images=True, token_offset=3)
    assert scheduler_key("W0", c) == (100, False, 3)
    assert scheduler_key("W0", p) == (100, True, 3)
    # The flags of other worlds do nothing in W0.
    assert scheduler_key("W0", c, ragged_decode_supported=True, ragged_len=5) == (100, False, 3)


@pytest.mark.rule("WA key pinned to 0 while ragged_decode_supported")
def test_keys_by_world_wa_pins_completions_to_0_only_while_ragged_decode_supported():
    c, p = comp(0, 101, cache_len=70), prompt(1, 91)
    assert scheduler_key("WA", c) == (70, False, 0)
    assert scheduler_key("WA", c, ragged_decode_supported=True) == (0, False, 0)
    assert scheduler_key("WA", p, ragged_decode_supported=True) == (90, False, 0), \
        "prompts keep their exact key"


@pytest.mark.rule("WB keys, granted and refused; the refused bucket key")
def test_keys_by_world_wb_granted_and_refused():
    c1, c2, p = comp(0, 140), comp(1, 101), prompt(2, 120)
    running = [c1, c2, p]
    assert ragged_bucket_len(running, GRANT) == 100
    assert ragged_bucket_len(running, REFUSE) is None
    assert scheduler_key("WB", c1, ragged_len=100) == (100, False, 0, True)
    assert scheduler_key("WB", p, ragged_len=100) == (119, False, 0, False)
    assert scheduler_key("WB", c1) == (139, False, 0, False)


@pytest.mark.rule("keys by world: W0 3-tuple")
def test_scheduler_key_refuses_an_unknown_world():
    with pytest.raises(ValueError, match="'W9'"):
        scheduler_key("W9", comp(0, 5))
    with pytest.raises(ValueError, match="'WC'"):
        SchedulerState(world="WC")


@pytest.mark.rule("WB ragged_bucket_len")
def test_the_ragged_bucket_takes_its_members_minimum_length():
    seqs = [comp(i, n) for i, n in enumerate([140, 101, 300])]
    st_ = state_for("WB", admission=GRANT)
    keys = bucket_keys(seqs, st_)
    assert keys == [(100, False, 0, True)] * 3


@pytest.mark.rule("WB ragged_bucket_len")
def test_prompts_are_never_folded_into_the_ragged_completion_bucket():
    # Completions at cache 119/159/199; prompts shorter, equal to and longer than the key.
    seqs = [comp(i, 120 + i * 40) for i in range(3)]
    seqs += [prompt(10, 50), prompt(11, 120), prompt(12, 400)]
    assert ragged_bucket_len(seqs, GRANT) == 119, "a 49-long prompt must not pull the min down"
    keys = bucket_keys(seqs, state_for("WB", admission=GRANT))
    assert keys[0] == keys[1] == keys[2] == (119, False, 0, True)
    assert keys[4] == (119, False, 0, False) and keys[4] != keys[0], "the flag separates them"
    assert len({keys[3], keys[4], keys[5]}) == 3 and not any(k[3] for k in keys[3:])


@pytest.mark.rule("WB ragged_bucket_len")
def test_ragged_bucket_len_is_none_without_completions():
    assert ragged_bucket_len([prompt(0, 9), prompt(1, 30)], GRANT) is None


records = st.builds(
    lambda n, cache, pr, off, img: (n, cache, pr, off, img),
    st.integers(1, 40), st.one_of(st.none(), st.integers(0, 40)), st.booleans(),
    st.integers(0, 2), st.booleans())


@st.composite
def running_sets(draw, min_size=1, max_size=12):
    raw = draw(st.lists(records, min_size=min_size, max_size=max_size))
    return [SeqRecord(i, n, cache, pr, off, img) for i, (n, cache, pr, off, img) in enumerate(raw)]


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


# ------------------------------------------------------------------ §16 select_running_bucket


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
    with pytest.raises(ValueError, match="at least one bucket"):
        select_running_bucket({}, {}, True)
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


# ------------------------------------------------------------------ §16 bucketing + urgency


@pytest.mark.rule("bucket_and_waitlist_seqs_waiting and urgency")
def test_bucket_and_waitlist_with_one_bucket_runs_everything_and_resets_urgency():
    st_ = state_for("W0")
    st_.urgency = {0: 3, 1: 5}
    b = bucket_and_waitlist_seqs_waiting([comp(0, 10), comp(1, 10)], False, st_)
    assert [s.id for s in b.chosen] == [0, 1] and b.waitlisted == [] and b.n_buckets == 1
    assert st_.urgency == {0: 0, 1: 0}


@pytest.mark.rule("bucket_and_waitlist_seqs_waiting and urgency")
def test_waitlisted_sequences_gain_urgency_and_keep_their_state():
    st_ = state_for("W0")
    st_.urgency = {2: 4}
    running = [comp(0, 10), comp(1, 10), prompt(2, 50)]
    b = bucket_and_waitlist_seqs_waiting(running, True, st_)
    assert [s.id for s in b.chosen] == [0, 1]
    assert b.waitlisted == [running[2]], "waitlisted record is returned unchanged"
    assert st_.urgency == {0: 0, 1: 0, 2: 5}


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


# ------------------------------------------------------------------ §16/§20 examples through
# schedule()


@pytest.mark.rule("per-step flow schedule()")
def test_nothing_waiting_or_running_schedules_nothing():
    st_ = state_for("W0")
    out = schedule([], [], st_)
    assert out.running == [] and out.waiting == [] and out.key is None and out.offered == 0
    assert st_.telemetry.calls == 0


LENS_64_APART = [50, 114, 179, 243, 307, 371, 436, 500]


@pytest.mark.rule(
    "WA key pinned to 0 while ragged_decode_supported",
    "8@500 + 1@100 and eight lengths 64 apart, by world",
)
@pytest.mark.parametrize("world,kw,want", [
    ("W0", {}, 1),
    ("WA", {"ragged_decode_supported": False}, 1),
    ("WA", {"ragged_decode_supported": True}, 8),
    ("WB", {"admission": REFUSE}, 1),
    ("WB", {"admission": GRANT}, 8),
])
def test_eight_lengths_64_apart_split_permanently_unless_ragged(world, kw, want):
    st_ = state_for(world, max_seqs=128, **kw)
    out = schedule([comp(i, n) for i, n in enumerate(LENS_64_APART)], [], st_)
    assert len(out.completion) == want
    if want == 1:
        assert out.completion == [0], "running only is discrete: the shortest bucket runs"


@pytest.mark.rule("8@500 + 1@100 and eight lengths 64 apart, by world")
@pytest.mark.parametrize("world,kw,n_run", [
    ("W0", {}, 8),
    ("WA", {"ragged_decode_supported": True}, 9),
    ("WB", {"admission": GRANT}, 9),
])
def test_a_formed_cohort_and_a_newcomer_8_at_500_plus_1_at_100(world, kw, n_run):
    assert 8 * 400 == 3200 > COALESCE_PAYBACK_STEPS
    st_ = state_for(world, max_seqs=128, **kw)
    running = [comp(i, 500) for i in range(8)] + [comp(8, 100)]
    waiter = prompt(9, 300)  # a waiting request, so selection is non-discrete
    out = schedule(running, [waiter], st_)
    assert out.discrete is False
    assert len(out.completion) == n_run
    if world == "W0":
        assert 8 not in out.completion and 8 in out.waitlisted
    else:
        assert 8 in out.completion


@pytest.mark.rule("WA key pinned to 0 while ragged_decode_supported")
def test_prompts_keep_their_exact_length_buckets_in_wa():
    st_ = state_for("WA", ragged_decode_supported=True)
    out = schedule([], [prompt(i, n) for i, n in enumerate([37, 91, 155])], st_)
    assert out.promoted == [0, 1, 2] and len(out.prompt) == 1 and out.prompt == [0]
    assert out.discrete is True


@pytest.mark.rule("per-step flow schedule()")
def test_scheduler_runs_the_whole_admitted_batch():
    """32 at 100 tokens + 32 at 102: coalesces within a few steps and stays whole."""
    st_ = state_for("W0", max_seqs=128)
    running = [comp(i, 100) for i in range(32)] + [comp(32 + i, 102) for i in range(32)]
    waiting: list[SeqRecord] = []
    converged = None
    for step in range(16):
        out = schedule(running, waiting, st_)
        running = [replace(s, n_tokens=s.n_tokens + 1) for s in out.running]
        waiting = out.waiting
        if converged is None and len(running) == 64:
            converged = step
        if converged is not None:
            assert len(running) == 64 and waiting == [], f"split again at step {step}"
    assert converged is not None and converged <= 3


@pytest.mark.rule("per-step flow schedule()")
def test_a_split_far_beyond_the_payback_never_merges():
    """Negative control for the test above: 1 at 100 tokens vs 3 at 900, a gap far
    beyond the payback bound, never runs all four together."""
    st_ = state_for("W0", max_seqs=128)
    running = [comp(0, 100)] + [comp(1 + i, 900) for i in range(3)]
    waiting: list[SeqRecord] = []
    sizes = []
    for _ in range(6):
        out = schedule(running, waiting, st_)
        sizes.append(len(out.running))
        running = [replace(s, n_tokens=s.n_tokens + 1) for s in out.running]
        waiting = out.waiting
    assert max(sizes) < 4


@pytest.mark.rule("per-step flow schedule()")
def test_both_waiting_and_running_sorts_waiting_by_id_and_admits_up_to_max_seqs():
    st_ = state_for("W0", max_seqs=4)
    running = [comp(0, 10), comp(1, 10)]
    waiting = [prompt(7, 11), prompt(5, 11), prompt(6, 11)]
    out = schedule(running, waiting, st_)
    assert out.held == [7], "ids 5 and 6 fill running to max_seqs 4; 7 is held"
    assert out.promoted == [5, 6]
    assert out.offered == 4 and out.discrete is False and out.n_buckets == 2
    # keys 9 (ids 0, 1) and 10 (ids 5, 6): greedy is 10, but (4-2)*1 <= 2*256 coalesces to 9
    assert [s.id for s in out.running] == [0, 1]
    assert [s.id for s in out.waiting] == [7, 5, 6], "held first, then the waitlisted"


@pytest.mark.rule("per-step flow schedule()")
def test_schedule_keeps_every_sequence_exactly_once():
    st_ = state_for("WA", ragged_decode_supported=False, prefill_cap=1, max_seqs=5)
    running = [comp(0, 10), comp(1, 20)]
    waiting = [prompt(2, 7), prompt(3, 9), comp(4, 30)]
    st_.admitted.add(4)  # a previously waitlisted completion
    out = schedule(running, waiting, st_)
    ids = [s.id for s in out.running] + [s.id for s in out.waiting]
    assert sorted(ids) == [0, 1, 2, 3, 4]


@pytest.mark.rule("per-step flow schedule()")
@given(
    running=running_sets(0, 8),
    new=st.lists(st.tuples(st.integers(1, 40), st.booleans()), max_size=5),
    world=st.sampled_from(["W0", "WA", "WB"]),
    grant=st.booleans(),
    flag=st.booleans(),
    max_seqs=st.integers(1, 10),
    cap=st.sampled_from([None, 1, 2]),
)
def test_schedule_loses_and_duplicates_nothing(running, new, world, grant, flag, max_seqs, cap):
    st_ = state_for(world, admission=GRANT if grant else REFUSE, ragged_decode_supported=flag,
                    max_seqs=max_seqs, prefill_cap=cap)
    waiting = [SeqRecord(100 + j, n, images=img, is_prompt=True) for j, (n, img) in enumerate(new)]
    out = schedule(running, waiting, st_)
    ids_in = sorted(s.id for s in running + waiting)
    ids_out = [s.id for s in out.running] + [s.id for s in out.waiting]
    assert sorted(ids_out) == ids_in and len(set(ids_out)) == len(ids_out)
    assert sorted(out.completion + out.prompt) == sorted(s.id for s in out.running)
    if ids_in:
        assert out.running, "exactly one bucket runs whenever anything is schedulable"
        keys = bucket_keys(
            [s for s in running + waiting if s.id in {r.id for r in out.running}], st_
        )
        assert len(set(keys)) == 1


@pytest.mark.rule("per-step flow schedule()")
def test_schedule_refuses_duplicate_ids():
    with pytest.raises(ValueError, match="unique"):
        schedule([comp(1, 5)], [prompt(1, 5)], state_for("W0"))
