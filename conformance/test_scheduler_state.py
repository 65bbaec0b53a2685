"""The scheduler's cross-step bookkeeping and the engine's instructions in the cases the
worked examples leave open (reference/scheduler.py; masks-and-scheduling.md §15-§18, §20):
urgency carried between `schedule` calls and read by the greedy choice, the admitted set
(who counts as a new request), the WA cap's counting and its log-once line, the WA floor
counting multi-bucket passes only, the empty step, the cache ops' kinds and defaults, a plan
without a KV cache, the refusal texts, and `bucket_shattering_law` at small sizes where its
lengths `100 + (i % distinct) * gap` and the one-token growth decide the outcome. Expected
values are worked out here from the rules, step by step, in each test's docstring.
"""

from __future__ import annotations

import math
import re

import pytest

from raggedspec.reference.scheduler import (
    IN,
    NOTHING,
    OUT,
    Bucketing,
    CacheOp,
    EngineBatch,
    PrefillFloor,
    RaggedAdmission,
    ScheduleOutcome,
    SchedulerState,
    SeqRecord,
    bucket_and_waitlist_seqs_waiting,
    bucket_shattering_law,
    engine_cache_instruction,
    first_populated_slot_len,
    install_admission,
    plan_engine_iteration,
    schedule,
    select_running_bucket,
)

REFUSE = RaggedAdmission.refused()
CAP_LINE = "ARC prefill cap: held a waiting sequence back"


def refused(message: str):
    return pytest.raises(ValueError, match="^" + re.escape(message) + "$")


def comp(i: int, n: int, **kw) -> SeqRecord:
    return SeqRecord(i, n, **kw)


def prompt(i: int, n: int, **kw) -> SeqRecord:
    return SeqRecord(i, n, is_prompt=True, **kw)


def cap_lines(logs: list[str]) -> list[str]:
    return [line for line in logs if line.startswith(CAP_LINE)]


# --- §15 small rules -----------------------------------------------------------------------


@pytest.mark.rule("cache_bucket_len reads the first populated slot")
def test_first_populated_slot_len_accepts_0_and_refuses_a_negative_length():
    assert first_populated_slot_len([None, 0, 7]) == 0
    with refused("slot length -1 must be >= 0"):
        first_populated_slot_len([None, -1])


@pytest.mark.rule("RaggedAdmission")
def test_a_refusing_decision_is_the_refused_state_with_its_reason():
    assert RaggedAdmission.decide("paged cache") == RaggedAdmission(False, "paged cache")
    assert RaggedAdmission.decide("paged cache").assembles_every_step() is False


@pytest.mark.rule("WA key pinned to 0 while ragged_decode_supported")
def test_the_records_and_the_state_refuse_with_the_documented_texts():
    with refused("sequence id -1 must be >= 0"):
        SeqRecord(-1, 5)
    with refused("sequence 3: n_tokens 0 must be >= 1"):
        SeqRecord(3, 0)
    with refused("sequence 3: cache_len -1 must be None or >= 0"):
        SeqRecord(3, 5, cache_len=-1)
    with refused("sequence 3: token_offset -1 must be >= 0"):
        SeqRecord(3, 5, token_offset=-1)
    with refused("steps_since_prompt -1 must be >= 0"):
        PrefillFloor(4, -1)
    with refused("max_seqs 0 must be >= 1"):
        SchedulerState(max_seqs=0)
    with refused("prefill_cap 0 must be None or >= 1"):
        SchedulerState(prefill_cap=0)


@pytest.mark.rule("select_running_bucket and COALESCE_PAYBACK_STEPS = 256")
def test_select_running_bucket_refuses_no_bucket_and_an_empty_one():
    with refused("select_running_bucket needs at least one bucket"):
        select_running_bucket({}, {}, True)
    with refused("every bucket must have a member"):
        select_running_bucket({(5, False, 0): [comp(0, 6)], (9, False, 0): []}, {}, True)


@pytest.mark.rule("a grant must reach both scheduler and engine")
def test_a_grant_logs_the_admission_line_and_a_refusal_logs_nothing():
    st_ = SchedulerState(world="WB")
    assert install_admission(st_, RaggedAdmission.decide(None)) == (
        "Ragged batch admission is ON: completions share one bucket and the batch is "
        "re-assembled every step"
    )
    assert install_admission(st_, REFUSE) is None


# --- §16 urgency and the greedy choice ------------------------------------------------------


@pytest.mark.rule("bucket_and_waitlist_seqs_waiting and urgency")
def test_urgency_is_read_by_the_greedy_choice_and_absent_ids_have_none():
    """A at len 10 (11 tokens) and B at len 500 (501 tokens), not discrete; gap 490 is far
    beyond the payback (1 * 490 > 1 * 256), so the greedy bucket runs. Without urgency B
    wins (log2 501 = 8.97 > log2 11 = 3.46). With urgency 6 for A (none for B, so 0):
    6 + 3.46 = 9.46 > 8.97, A is greedy == min and runs."""
    a, b = comp(0, 11, cache_len=10), comp(1, 501, cache_len=500)
    assert 6 + math.log2(11) > math.log2(501) > math.log2(11)
    plain = SchedulerState()
    assert bucket_and_waitlist_seqs_waiting([a, b], False, plain).chosen == [b]
    urgent = SchedulerState(urgency={0: 6})
    got = bucket_and_waitlist_seqs_waiting([a, b], False, urgent)
    assert got.chosen == [a] and got.waitlisted == [b]
    assert urgent.urgency == {0: 0, 1: 1}


@pytest.mark.rule("per-step flow schedule()")
def test_urgency_accumulates_across_schedule_calls_and_is_dropped_with_the_sequence():
    """Two completions at lengths 10 and 500, nothing waiting (discrete: the shortest runs):
    B is waitlisted on each call, so its urgency is 1 then 2; once B is gone its entry is
    dropped."""
    a, b = comp(0, 11, cache_len=10), comp(1, 501, cache_len=500)
    st_ = SchedulerState()
    schedule([a, b], [], st_)
    out = schedule([a, b], [], st_)
    assert out.running == [a] and out.waitlisted == [1]
    assert st_.urgency == {0: 0, 1: 2}
    schedule([a], [], st_)
    assert st_.urgency == {0: 0}


@pytest.mark.rule("keys by world: W0 3-tuple")
def test_bucketing_nothing_gives_no_key():
    assert bucket_and_waitlist_seqs_waiting([], False, SchedulerState()) == Bucketing(
        None, [], [], 0, []
    )


@pytest.mark.rule("WA prefill floor ARC_PREFILL_FLOOR_STEPS")
def test_the_wa_floor_counts_only_passes_with_several_buckets():
    """§16: the floor applies where a bucket is selected among several; a single bucket
    runs everything and leaves the counter alone. Three one-bucket passes keep it at 0, so
    a prompt bucket appearing next is not forced at once: the counter goes to 1."""
    st_ = SchedulerState(world="WA")
    one = [comp(0, 11, cache_len=10), comp(1, 11, cache_len=10)]
    for _ in range(3):
        assert bucket_and_waitlist_seqs_waiting(one, False, st_).n_buckets == 1
    assert st_.floor.steps_since_prompt == 0
    two = one + [prompt(2, 40)]
    got = bucket_and_waitlist_seqs_waiting(two, False, st_)
    assert got.key == (10, False, 0) and st_.floor.steps_since_prompt == 1


# --- §20.1 whole steps ---------------------------------------------------------------------


@pytest.mark.rule("per-step flow schedule()")
def test_an_empty_step_is_the_empty_outcome():
    assert schedule([], [], SchedulerState()) == ScheduleOutcome(
        None, None, [], [], [], [], [], [], [], 0, 0, []
    )


@pytest.mark.rule("per-step flow schedule()")
def test_the_outcome_carries_the_key_that_ran():
    a, b = comp(0, 11, cache_len=10), comp(1, 501, cache_len=500)
    assert schedule([a, b], [], SchedulerState(world="WB")).key == (10, False, 0, False)


@pytest.mark.rule("per-step flow schedule()")
def test_a_waitlisted_newcomer_is_admitted_once():
    """Step 1 promotes A and B (nothing runs yet); they differ in length, so the shortest
    (A) runs and B is waitlisted. Step 2: B comes back as waiting; it has been in the
    running set, so it is not a new request: nothing is promoted."""
    st_ = SchedulerState()
    first = schedule([], [prompt(0, 10), prompt(1, 30)], st_)
    assert first.promoted == [0, 1] and first.waitlisted == [1]
    second = schedule([comp(0, 11, cache_len=10)], [prompt(1, 30)], st_)
    assert second.promoted == [] and st_.admitted == {0, 1}


@pytest.mark.rule("WA prefill cap ARC_PREFILL_MAX_SEQS")
def test_a_sequence_held_by_max_seqs_stays_admitted():
    """max_seqs 1. Step 1: A and B are promoted (nothing runs: no max_seqs check), B is
    waitlisted. Step 2: A runs, B is held (1 + 1 > 1). Step 3: A has finished, B runs
    alone; it was admitted in step 1, so it is not promoted again."""
    st_ = SchedulerState(max_seqs=1)
    schedule([], [prompt(0, 10), prompt(1, 30)], st_)
    held = schedule([comp(0, 11, cache_len=10)], [prompt(1, 30)], st_)
    assert held.held == [1] and 1 in st_.admitted
    last = schedule([], [prompt(1, 30)], st_)
    assert last.promoted == [] and [s.id for s in last.running] == [1]


@pytest.mark.rule("WA prefill cap ARC_PREFILL_MAX_SEQS")
def test_the_wa_cap_counts_every_new_request_it_admits():
    """WA, cap 2, one sequence running: of three new waiting requests the first two are
    admitted, the third is held (2 new already), and the cap line is logged."""
    st_ = SchedulerState(world="WA", prefill_cap=2)
    out = schedule([comp(9, 11, cache_len=10)], [prompt(1, 20), prompt(2, 20), prompt(3, 20)],
                   st_)
    assert out.promoted == [1, 2] and out.held == [3]
    assert len(cap_lines(out.logs)) == 1


@pytest.mark.rule("WA transition log and once-only floor/cap lines")
def test_the_cap_line_is_logged_once_and_only_when_the_wa_cap_holds_a_new_request():
    """WA, cap 1: a step that holds nothing logs nothing; the first step that holds a new
    request logs the line, a later one does not. W0 and WA without a cap never log it, even
    when max_seqs holds a new request back."""
    st_ = SchedulerState(world="WA", prefill_cap=1)
    assert cap_lines(schedule([], [prompt(0, 20)], st_).logs) == []
    assert cap_lines(schedule([], [prompt(1, 20), prompt(2, 20)], st_).logs) == [
        f"{CAP_LINE} at 1 admitted this iteration (ARC_PREFILL_MAX_SEQS); logged once"
    ]
    assert cap_lines(schedule([], [prompt(3, 20), prompt(4, 20)], st_).logs) == []
    for world in ("W0", "WA"):
        other = SchedulerState(world=world, max_seqs=1)
        out = schedule([comp(0, 11, cache_len=10)], [prompt(5, 20)], other)
        assert out.held == [5] and cap_lines(out.logs) == []


# --- §18 cache instruction -----------------------------------------------------------------


@pytest.mark.rule("engine cache instruction pre_op / post_op")
def test_every_cache_op_kind_constructs():
    assert [CacheOp(k).kind for k in ("In", "Nothing", "Out", "Reset")] == [
        "In", "Nothing", "Out", "Reset"
    ]
    assert (CacheOp("Nothing"), CacheOp("Out"), CacheOp("In")) == (NOTHING, OUT, IN)


@pytest.mark.rule("engine cache instruction pre_op / post_op")
def test_the_instruction_defaults_are_refused_admission_and_offset_0():
    """WB without `granted` is refused admission: an unchanged cohort issues Nothing. A
    prompt without `first_token_offset` is at offset 0: Reset with the preallocated cache."""
    assert engine_cache_instruction("WB", "completion", [1, 2], [1, 2], False) == (NOTHING, OUT)
    assert engine_cache_instruction("W0", "prompt", [3], [], False) == (
        CacheOp("Reset", load_preallocated_cache=True), OUT
    )
    with refused("world 'W9' must be one of ('W0', 'WA', 'WB')"):
        engine_cache_instruction("W9", "completion", [1], [1], False)


@pytest.mark.rule("engine cache instruction pre_op / post_op")
def test_ids_compare_by_value_whatever_the_sequence_type():
    """The compare is of the id lists as sequences: the same ids in a tuple and a list are
    unchanged (Nothing); a different order is a change (In)."""
    assert engine_cache_instruction("W0", "completion", (1, 2), [1, 2], False)[0] == NOTHING
    assert engine_cache_instruction("WA", "completion", [1, 2], (1, 2), False)[0] == NOTHING
    assert engine_cache_instruction("W0", "completion", (2, 1), [1, 2], False)[0] == IN


@pytest.mark.rule("engine cache instruction pre_op / post_op")
def test_a_plan_without_a_kv_cache_resets_after_both_forwards():
    """no_kv_cache: the completion forward issues Nothing before (no cache to bring in) and
    Reset{False, False} after; the prompt forward at offset 5 issues In, then Reset."""
    st_ = SchedulerState()
    running = [comp(1, 11, cache_len=10), comp(2, 11, cache_len=10),
               prompt(3, 40, token_offset=5)]
    outcome = ScheduleOutcome((10, False, 0), False, running, [], [1, 2], [3], [], [], [], 1, 3,
                              [])
    plan = plan_engine_iteration(st_, outcome, no_kv_cache=True)
    assert plan == [EngineBatch("completion", [1, 2], NOTHING, CacheOp("Reset")),
                    EngineBatch("prompt", [3], IN, CacheOp("Reset"))]
    with_kv = plan_engine_iteration(SchedulerState(), outcome)
    assert with_kv == [EngineBatch("completion", [1, 2], IN, OUT),
                       EngineBatch("prompt", [3], IN, OUT)]


# --- §16 bucket_shattering_law ---------------------------------------------------------------


@pytest.mark.rule("bucket_shattering_law")
@pytest.mark.parametrize("n, distinct, gap, steps", [(0, 1, 0, 1), (1, 0, 0, 1), (1, 1, -1, 1),
                                                     (1, 1, 0, -1)])
def test_the_law_refuses_sizes_below_their_bounds(n, distinct, gap, steps):
    with refused(f"n {n}, distinct {distinct} must be >= 1; gap {gap}, steps {steps} >= 0"):
        bucket_shattering_law(n, distinct, gap, steps, REFUSE)


@pytest.mark.rule("bucket_shattering_law")
def test_the_law_at_gap_0_and_at_0_steps():
    """Gap 0: every sequence has 100 tokens, one bucket, all 4 run each of 3 steps. No
    step: nothing ran."""
    assert bucket_shattering_law(4, 2, 0, 3, REFUSE) == (12, 4)
    assert bucket_shattering_law(2, 1, 0, 0, REFUSE) == (0, 0)


@pytest.mark.rule("bucket_shattering_law")
def test_the_law_grows_each_chosen_sequence_by_one_token():
    """n 2, distinct 2, gap 2, refused: 100 and 102 tokens (lens 99, 101). Step 1 nothing
    waits (discrete): 99 runs, grows to 101 tokens (len 100). Step 2: B waits, urgency 1,
    so greedy is B (1 + log2 102 > log2 101), but the next length is 1 above min:
    1 * 1 <= 1 * 256 coalesces to min, A runs again (102 tokens, len 101). Step 3: both at
    len 101, one bucket, 2 run: (1 + 1 + 2, 2)."""
    assert 1 + math.log2(102) > math.log2(101)
    assert bucket_shattering_law(2, 2, 2, 3, REFUSE) == (4, 2)


@pytest.mark.rule("bucket_shattering_law")
def test_the_law_starts_at_100_tokens():
    """n 3, distinct 2, gap 5050, refused: ids 0 and 2 have 100 tokens, id 1 has 5150.
    Step 1 (discrete): the pair runs (2) and grows to 101 tokens. Step 2: the pair's
    priority 2 * log2(101) = 13.32 is below B's 1 + log2(5150) = 13.33, so B is greedy;
    the gap 5050 - 1 is far beyond the payback (1 * 5049 > 2 * 256): B runs (1)."""
    assert 2 * math.log2(101) < 1 + math.log2(5150)
    assert 1 * 5049 > 2 * 256
    assert bucket_shattering_law(3, 2, 5050, 2, REFUSE) == (3, 1)
