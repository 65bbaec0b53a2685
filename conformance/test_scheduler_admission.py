"""Whole scheduling steps (masks-and-scheduling.md §16, §20.1): `schedule` admitting the
waiting queue next to the running set (`max_seqs`, the admitted set), urgency carried between
steps, the spec's worked examples by world, the WA prefill floor (`ARC_PREFILL_FLOOR_STEPS`) and
prefill cap (`ARC_PREFILL_MAX_SEQS`) with their once-only log lines, and
`bucket_shattering_law`, including the small sizes where its lengths `100 + (i % distinct) *
gap` and the one-token growth decide the outcome.

Expected values come from the spec's worked examples or are worked out from the rules step by
step in each test's docstring.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from raggedspec.conformance.helpers import (GRANT, LENS_64_APART, REFUSE, completion, prompt,
                                            raises_exactly, state_for)
from raggedspec.conformance.strategies import running_sets
from raggedspec.reference.scheduler import (
    COALESCE_PAYBACK_STEPS,
    DEFAULT_PREFILL_FLOOR_STEPS,
    PrefillFloor,
    ScheduleOutcome,
    SchedulerState,
    SeqRecord,
    bucket_and_waitlist_seqs_waiting,
    bucket_keys,
    bucket_shattering_law,
    prefill_admission_cap,
    prefill_starvation_floor,
    schedule,
)

CAP_LINE = "ARC prefill cap: held a waiting sequence back"


def cap_lines(logs: list[str]) -> list[str]:
    return [line for line in logs if line.startswith(CAP_LINE)]


# ---------------------------------------------------------------------------------- §20.1 one step


@pytest.mark.rule("per-step flow schedule()")
def test_an_empty_step_is_the_empty_outcome():
    st_ = state_for("W0")
    out = schedule([], [], st_)
    assert out == ScheduleOutcome(None, None, [], [], [], [], [], [], [], 0, 0, [])
    assert st_.telemetry.calls == 0


@pytest.mark.rule("per-step flow schedule()")
def test_the_outcome_carries_the_key_that_ran():
    a, b = completion(0, 11, cache_len=10), completion(1, 501, cache_len=500)
    assert schedule([a, b], [], SchedulerState(world="WB")).key == (10, False, 0, False)


@pytest.mark.rule("per-step flow schedule()")
def test_both_waiting_and_running_sorts_waiting_by_id_and_admits_up_to_max_seqs():
    st_ = state_for("W0", max_seqs=4)
    running = [completion(0, 10), completion(1, 10)]
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
    running = [completion(0, 10), completion(1, 20)]
    waiting = [prompt(2, 7), prompt(3, 9), completion(4, 30)]
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
        schedule([completion(1, 5)], [prompt(1, 5)], state_for("W0"))


@pytest.mark.rule("per-step flow schedule()")
def test_a_waitlisted_newcomer_is_admitted_once():
    """Step 1 promotes A and B (nothing runs yet); they differ in length, so the shortest
    (A) runs and B is waitlisted. Step 2: B comes back as waiting; it has been in the
    running set, so it is not a new request: nothing is promoted."""
    st_ = SchedulerState()
    first = schedule([], [prompt(0, 10), prompt(1, 30)], st_)
    assert first.promoted == [0, 1] and first.waitlisted == [1]
    second = schedule([completion(0, 11, cache_len=10)], [prompt(1, 30)], st_)
    assert second.promoted == [] and st_.admitted == {0, 1}


@pytest.mark.rule("WA prefill cap ARC_PREFILL_MAX_SEQS")
def test_a_sequence_held_by_max_seqs_stays_admitted():
    """max_seqs 1. Step 1: A and B are promoted (nothing runs: no max_seqs check), B is
    waitlisted. Step 2: A runs, B is held (1 + 1 > 1). Step 3: A has finished, B runs
    alone; it was admitted in step 1, so it is not promoted again."""
    st_ = SchedulerState(max_seqs=1)
    schedule([], [prompt(0, 10), prompt(1, 30)], st_)
    held = schedule([completion(0, 11, cache_len=10)], [prompt(1, 30)], st_)
    assert held.held == [1] and 1 in st_.admitted
    last = schedule([], [prompt(1, 30)], st_)
    assert last.promoted == [] and [s.id for s in last.running] == [1]


@pytest.mark.rule("per-step flow schedule()")
def test_urgency_accumulates_across_schedule_calls_and_is_dropped_with_the_sequence():
    """Two completions at lengths 10 and 500, nothing waiting (discrete: the shortest runs):
    B is waitlisted on each call, so its urgency is 1 then 2; once B is gone its entry is
    dropped."""
    a, b = completion(0, 11, cache_len=10), completion(1, 501, cache_len=500)
    st_ = SchedulerState()
    schedule([a, b], [], st_)
    out = schedule([a, b], [], st_)
    assert out.running == [a] and out.waitlisted == [1]
    assert st_.urgency == {0: 0, 1: 2}
    schedule([a], [], st_)
    assert st_.urgency == {0: 0}


# ----------------------------------------------------------------- §16 examples through schedule()


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
    out = schedule([completion(i, n) for i, n in enumerate(LENS_64_APART)], [], st_)
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
    running = [completion(i, 500) for i in range(8)] + [completion(8, 100)]
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
    running = [completion(i, 100) for i in range(32)] + [completion(32 + i, 102) for i in range(32)]
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
    running = [completion(0, 100)] + [completion(1 + i, 900) for i in range(3)]
    waiting: list[SeqRecord] = []
    sizes = []
    for _ in range(6):
        out = schedule(running, waiting, st_)
        sizes.append(len(out.running))
        running = [replace(s, n_tokens=s.n_tokens + 1) for s in out.running]
        waiting = out.waiting
    assert max(sizes) < 4


# ------------------------------------------------------------------------------------ §16 WA floor


@pytest.mark.rule("WA prefill floor ARC_PREFILL_FLOOR_STEPS")
def test_prefill_floor_defaults_on_and_zero_is_the_kill_switch():
    assert DEFAULT_PREFILL_FLOOR_STEPS == 4
    assert prefill_starvation_floor(None) == 4
    assert prefill_starvation_floor("0") is None
    assert prefill_starvation_floor("7") == 7
    assert prefill_starvation_floor("+3") == 3
    for garbage in ["not-a-number", "-1", " 4", "4.0", ""]:
        assert prefill_starvation_floor(garbage) == 4, garbage


def prompt_steps_won(
    world: str, floor: int | None, steps: int, flag: bool, discrete: bool = False
) -> int:
    """47 completions at 500 tokens and one prompt of 300, bucketed `steps` times."""
    st_ = state_for(world, floor=PrefillFloor(floor), ragged_decode_supported=flag)
    running = [completion(i, 500) for i in range(47)] + [prompt(47, 300)]
    won = 0
    for _ in range(steps):
        b = bucket_and_waitlist_seqs_waiting(running, discrete, st_)
        won += any(s.is_prompt for s in b.chosen)
    return won


@pytest.mark.rule("WA prefill floor ARC_PREFILL_FLOOR_STEPS")
@pytest.mark.parametrize("flag", [False, True])
def test_a_prompt_starves_behind_47_decoders_0_of_24_and_floor_4_gives_4_of_24(flag):
    assert prompt_steps_won("WA", None, 24, flag) == 0
    assert prompt_steps_won("WA", 4, 24, flag) == 4


@pytest.mark.rule("WA prefill floor ARC_PREFILL_FLOOR_STEPS")
@pytest.mark.parametrize("floor", [1, 2, 3, 4, 7])
def test_the_floor_forces_a_prompt_every_floor_plus_1_steps(floor):
    st_ = state_for("WA", floor=PrefillFloor(floor))
    running = [completion(i, 500) for i in range(47)] + [prompt(47, 300)]
    wins = [any(s.is_prompt for s in bucket_and_waitlist_seqs_waiting(running, False, st_).chosen)
            for _ in range(24)]
    assert wins == [(k + 1) % (floor + 1) == 0 for k in range(24)]


@pytest.mark.rule("WA prefill floor ARC_PREFILL_FLOOR_STEPS")
def test_the_floor_is_not_applied_when_discrete():
    st_ = state_for("WA", floor=PrefillFloor(1), ragged_decode_supported=True)
    running = [completion(i, 500) for i in range(47)] + [prompt(47, 300)]
    for _ in range(6):
        b = bucket_and_waitlist_seqs_waiting(running, True, st_)
        assert not any(s.is_prompt for s in b.chosen)
    assert st_.floor.steps_since_prompt == 0


@pytest.mark.rule("WA prefill floor ARC_PREFILL_FLOOR_STEPS")
def test_the_floor_exists_only_in_wa():
    assert prompt_steps_won("W0", 4, 24, False) == 0
    assert prompt_steps_won("WB", 4, 24, False) == 0


@pytest.mark.rule("WA prefill floor ARC_PREFILL_FLOOR_STEPS")
def test_the_floor_counter_resets_when_a_prompt_bucket_wins_on_its_own():
    f = PrefillFloor(4, steps_since_prompt=3)
    pk, dk = (10, False, 0), (0, False, 0)
    assert f.apply(pk, [pk], False) == pk and f.steps_since_prompt == 0
    f.steps_since_prompt = 4
    assert f.apply(dk, [], False) == dk and f.steps_since_prompt == 5, "no prompt bucket: count on"
    assert f.apply(dk, [(30, False, 0), (20, False, 1)], False) == (20, False, 1)
    assert f.steps_since_prompt == 0
    with pytest.raises(ValueError, match="floor 0"):
        PrefillFloor(0)


@pytest.mark.rule("WA prefill floor ARC_PREFILL_FLOOR_STEPS")
def test_the_wa_floor_counts_only_passes_with_several_buckets():
    """§16: the floor applies where a bucket is selected among several; a single bucket
    runs everything and leaves the counter alone. Three one-bucket passes keep it at 0, so
    a prompt bucket appearing next is not forced at once: the counter goes to 1."""
    st_ = SchedulerState(world="WA")
    one = [completion(0, 11, cache_len=10), completion(1, 11, cache_len=10)]
    for _ in range(3):
        assert bucket_and_waitlist_seqs_waiting(one, False, st_).n_buckets == 1
    assert st_.floor.steps_since_prompt == 0
    two = one + [prompt(2, 40)]
    got = bucket_and_waitlist_seqs_waiting(two, False, st_)
    assert got.key == (10, False, 0) and st_.floor.steps_since_prompt == 1


@pytest.mark.rule("WA transition log and once-only floor/cap lines")
def test_the_floor_logs_once_when_it_fires():
    st_ = state_for("WA", floor=PrefillFloor(1))
    running = [completion(i, 500) for i in range(47)] + [prompt(47, 300)]
    logs = []
    for _ in range(6):
        logs += bucket_and_waitlist_seqs_waiting(running, False, st_).logs
    fired = [
        line
        for line in logs
        if line.startswith("ARC prefill floor: forced a prompt bucket after 1 passes")
    ]
    assert len(fired) == 1


@pytest.mark.rule("WA transition log and once-only floor/cap lines")
def test_wa_transition_line_is_logged_only_when_buckets_or_flag_change():
    st_ = state_for("WA")
    run = [completion(0, 10), completion(1, 20)]
    l1 = bucket_and_waitlist_seqs_waiting(run, True, st_).logs
    l2 = bucket_and_waitlist_seqs_waiting(run, True, st_).logs
    st_.ragged_decode_supported = True
    l3 = bucket_and_waitlist_seqs_waiting(run, True, st_).logs
    assert l1 == ["ArcSched: decode bucketing ragged_decode=false buckets=2 seqs=2 decisions=0"]
    assert l2 == []
    assert l3 == ["ArcSched: decode bucketing ragged_decode=true buckets=1 seqs=2 decisions=2"]


# -------------------------------------------------------------------------------------- §16 WA cap


@pytest.mark.rule("WA prefill cap ARC_PREFILL_MAX_SEQS")
def test_prefill_admission_cap_parsing():
    assert prefill_admission_cap(None) is None
    assert prefill_admission_cap("0") is None
    assert prefill_admission_cap("3") == 3
    assert prefill_admission_cap("three") is None


@pytest.mark.rule(
    "WA prefill cap ARC_PREFILL_MAX_SEQS",
    "WA transition log and once-only floor/cap lines",
)
def test_wa_prefill_cap_bounds_promotions_in_queue_order_when_nothing_runs():
    st_ = state_for("WA", prefill_cap=2)
    out = schedule([], [prompt(i, 20) for i in [4, 1, 3]], st_)
    assert out.promoted == [4, 1] and out.held == [3]
    assert any(
        line.startswith("ARC prefill cap: held a waiting sequence back") for line in out.logs
    )
    out0 = schedule([], [prompt(i, 20) for i in [4, 1, 3]], state_for("W0", prefill_cap=2))
    assert out0.promoted == [4, 1, 3] and out0.held == [], "the cap is a WA rule"


@pytest.mark.rule("WA prefill cap ARC_PREFILL_MAX_SEQS")
def test_wa_prefill_cap_does_not_count_already_admitted_sequences():
    st_ = state_for("WA", prefill_cap=1)
    st_.admitted.add(5)  # id 5 was admitted on an earlier step and then waitlisted
    out = schedule([completion(0, 10)], [prompt(5, 20), prompt(3, 20), prompt(4, 20)], st_)
    assert out.promoted == [3] and out.held == [4], "the cap is reached by 3 alone"
    assert 5 in [s.id for s in out.running] + out.waitlisted, (
        "5 is not new: re-admitted past the cap"
    )


@pytest.mark.rule("WA prefill cap ARC_PREFILL_MAX_SEQS")
def test_the_wa_cap_counts_every_new_request_it_admits():
    """WA, cap 2, one sequence running: of three new waiting requests the first two are
    admitted, the third is held (2 new already), and the cap line is logged."""
    st_ = SchedulerState(world="WA", prefill_cap=2)
    out = schedule([completion(9, 11, cache_len=10)], [prompt(1, 20), prompt(2, 20), prompt(3, 20)],
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
        out = schedule([completion(0, 11, cache_len=10)], [prompt(5, 20)], other)
        assert out.held == [5] and cap_lines(out.logs) == []


# ----------------------------------------------------------------------- §16 bucket_shattering_law


@pytest.mark.rule("bucket_shattering_law")
@pytest.mark.parametrize("n,d", [(8, 8), (32, 8), (32, 32), (128, 32), (128, 128)])
def test_bucket_shattering_law(n, d):
    steps = 32
    refused = bucket_shattering_law(n, d, 64, steps, REFUSE)
    granted = bucket_shattering_law(n, d, 64, steps, GRANT)
    assert refused == ((n // d) * steps, n // d)
    assert granted == (n * steps, n), "the granted column is the negative control"


@pytest.mark.rule("bucket_shattering_law")
def test_b1_is_untouched_by_either_admission_rule():
    for a in (REFUSE, GRANT):
        assert bucket_shattering_law(1, 1, 64, 16, a) == (16, 1)


@pytest.mark.rule("bucket_shattering_law")
@pytest.mark.parametrize("n, distinct, gap, steps", [(0, 1, 0, 1), (1, 0, 0, 1), (1, 1, -1, 1),
                                                     (1, 1, 0, -1)])
def test_the_law_refuses_sizes_below_their_bounds(n, distinct, gap, steps):
    with raises_exactly(f"n {n}, distinct {distinct} must be >= 1; gap {gap}, steps {steps} >= 0"):
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
