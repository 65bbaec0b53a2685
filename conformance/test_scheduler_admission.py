"""The WA prefill floor and cap, the bucket-shattering law, RaggedAdmission and the engine's
cache instruction (masks-and-scheduling.md §16-§18, §20).

Expected values come from the spec's worked examples or from oracles written here
independently of `reference/scheduler.py`.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from raggedspec.conformance.test_scheduler import GRANT, REFUSE, comp, prompt, state_for
from raggedspec.reference.errors import CapabilityRefusal, SchedulerRefusal
from raggedspec.reference.scheduler import (
    DEFAULT_PREFILL_FLOOR_STEPS,
    IN,
    NOTHING,
    OUT,
    CacheOp,
    PrefillFloor,
    RaggedAdmission,
    bucket_and_waitlist_seqs_waiting,
    bucket_shattering_law,
    check_admission_agrees,
    engine_cache_instruction,
    install_admission,
    issues_cache_in,
    plan_engine_iteration,
    prefill_admission_cap,
    prefill_starvation_floor,
    schedule,
)

# ------------------------------------------------------------------ §16 WA floor and cap


@pytest.mark.rule("WA prefill floor ARC_PREFILL_FLOOR_STEPS")
def test_prefill_floor_defaults_on_and_zero_is_the_kill_switch():
    assert DEFAULT_PREFILL_FLOOR_STEPS == 4
    assert prefill_starvation_floor(None) == 4
    assert prefill_starvation_floor("0") is None
    assert prefill_starvation_floor("7") == 7
    assert prefill_starvation_floor("+3") == 3
    for garbage in ["not-a-number", "-1", " 4", "4.0", ""]:
        assert prefill_starvation_floor(garbage) == 4, garbage


@pytest.mark.rule("WA prefill cap ARC_PREFILL_MAX_SEQS")
def test_prefill_admission_cap_parsing():
    assert prefill_admission_cap(None) is None
    assert prefill_admission_cap("0") is None
    assert prefill_admission_cap("3") == 3
    assert prefill_admission_cap("three") is None


def prompt_steps_won(
    world: str, floor: int | None, steps: int, flag: bool, discrete: bool = False
) -> int:
    """47 completions at 500 tokens and one prompt of 300, bucketed `steps` times."""
    st_ = state_for(world, floor=PrefillFloor(floor), ragged_decode_supported=flag)
    running = [comp(i, 500) for i in range(47)] + [prompt(47, 300)]
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
    running = [comp(i, 500) for i in range(47)] + [prompt(47, 300)]
    wins = [any(s.is_prompt for s in bucket_and_waitlist_seqs_waiting(running, False, st_).chosen)
            for _ in range(24)]
    assert wins == [(k + 1) % (floor + 1) == 0 for k in range(24)]


@pytest.mark.rule("WA prefill floor ARC_PREFILL_FLOOR_STEPS")
def test_the_floor_is_not_applied_when_discrete():
    st_ = state_for("WA", floor=PrefillFloor(1), ragged_decode_supported=True)
    running = [comp(i, 500) for i in range(47)] + [prompt(47, 300)]
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


@pytest.mark.rule("WA transition log and once-only floor/cap lines")
def test_the_floor_logs_once_when_it_fires():
    st_ = state_for("WA", floor=PrefillFloor(1))
    running = [comp(i, 500) for i in range(47)] + [prompt(47, 300)]
    logs = []
    for _ in range(6):
        logs += bucket_and_waitlist_seqs_waiting(running, False, st_).logs
    fired = [
        line
        for line in logs
        if line.startswith("ARC prefill floor: forced a prompt bucket after 1 passes")
    ]
    assert len(fired) == 1


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
    out = schedule([comp(0, 10)], [prompt(5, 20), prompt(3, 20), prompt(4, 20)], st_)
    assert out.promoted == [3] and out.held == [4], "the cap is reached by 3 alone"
    assert 5 in [s.id for s in out.running] + out.waitlisted, (
        "5 is not new: re-admitted past the cap"
    )


@pytest.mark.rule("WA transition log and once-only floor/cap lines")
def test_wa_transition_line_is_logged_only_when_buckets_or_flag_change():
    st_ = state_for("WA")
    run = [comp(0, 10), comp(1, 20)]
    l1 = bucket_and_waitlist_seqs_waiting(run, True, st_).logs
    l2 = bucket_and_waitlist_seqs_waiting(run, True, st_).logs
    st_.ragged_decode_supported = True
    l3 = bucket_and_waitlist_seqs_waiting(run, True, st_).logs
    assert l1 == ["ArcSched: decode bucketing ragged_decode=false buckets=2 seqs=2 decisions=0"]
    assert l2 == []
    assert l3 == ["ArcSched: decode bucketing ragged_decode=true buckets=1 seqs=2 decisions=2"]


# ------------------------------------------------------------------ §16 bucket_shattering_law


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


# ------------------------------------------------------------------ §17 RaggedAdmission


@pytest.mark.rule("RaggedAdmission")
def test_ragged_admission_default_is_refused_without_a_reason():
    assert RaggedAdmission() == RaggedAdmission.refused()
    a = RaggedAdmission.refused()
    assert not a.granted and a.refusal is None
    assert a.buckets_by_cache_length() and not a.assembles_every_step()


@pytest.mark.rule("RaggedAdmission")
def test_ragged_admission_decide_grants_or_keeps_why():
    g = RaggedAdmission.decide(None)
    assert g.granted and g.refusal is None
    assert not g.buckets_by_cache_length() and g.assembles_every_step()
    r = RaggedAdmission.decide("cache slot 3 is a `Rotating`")
    assert not r.granted and r.refusal == "cache slot 3 is a `Rotating`"
    assert r.buckets_by_cache_length() and not r.assembles_every_step()
    e = RaggedAdmission.decide(CapabilityRefusal("select_running_bucket runs one bucket"))
    assert e.refusal == "select_running_bucket runs one bucket"


@pytest.mark.rule("§22 dispatch tests: each predicate tested directly", "issues_cache_in")
def test_issues_cache_in_truth_table():
    for no_kv in (False, True):
        for changed in (False, True):
            assert issues_cache_in(no_kv, changed, False) == (not no_kv and changed)
            assert issues_cache_in(no_kv, changed, True) == (not no_kv)
    assert issues_cache_in(False, False, True), "a granted stable cohort still assembles"
    assert not issues_cache_in(True, True, True), "no_kv still wins"


@pytest.mark.rule("a grant must reach both scheduler and engine")
def test_a_grant_reaches_both_the_scheduler_and_the_engine():
    st_ = state_for("WB")
    line = install_admission(st_, GRANT)
    assert line.startswith("Ragged batch admission is ON: ")
    assert st_.admission.granted and st_.engine_admission.granted
    check_admission_agrees(st_)
    # end to end: ragged cohort forms one bucket AND is re-assembled on a stable step
    running = [comp(0, 50), comp(1, 80)]
    for step in range(3):
        out = schedule(running, [], st_)
        assert len(out.completion) == 2
        plan = plan_engine_iteration(st_, out)
        assert plan[0].pre_op == IN, f"step {step}: a granted run assembles every step"
        running = [replace(s, n_tokens=s.n_tokens + 1) for s in out.running]
    assert install_admission(state_for("WB"), REFUSE) is None


@pytest.mark.rule("a grant must reach both scheduler and engine")
def test_a_grant_that_reached_only_the_scheduler_is_refused():
    st_ = state_for("WB")
    st_.admission = GRANT
    with pytest.raises(
        SchedulerRefusal,
        match="a grant must reach both.*scheduler granted=True.*engine granted=False",
    ):
        check_admission_agrees(st_)
    out = schedule([comp(0, 50), comp(1, 80)], [], st_)
    with pytest.raises(SchedulerRefusal, match="a grant must reach both"):
        plan_engine_iteration(st_, out)


# ------------------------------------------------------------------ §18 engine cache instruction


@pytest.mark.rule("engine cache instruction pre_op / post_op")
@pytest.mark.parametrize("world", ["W0", "WA"])
def test_completion_pre_op_w0_wa_is_in_only_on_membership_change(world):
    assert engine_cache_instruction(world, "completion", [1, 2], [1, 2], False) == (NOTHING, OUT)
    assert engine_cache_instruction(world, "completion", [1, 2], [2, 1], False) == (IN, OUT)
    assert engine_cache_instruction(world, "completion", [1, 2], [1], False) == (IN, OUT)
    assert engine_cache_instruction(world, "completion", [1, 2], [1, 2], False, granted=True) == (
        NOTHING,
        OUT,
    ), "the grant is a WB rule"
    assert engine_cache_instruction(world, "completion", [1, 2], [1], True) == (
        NOTHING,
        CacheOp("Reset"),
    )


@pytest.mark.rule("engine cache instruction pre_op / post_op")
def test_completion_pre_op_wb_follows_issues_cache_in():
    for no_kv in (False, True):
        for last in ([1, 2], [3]):
            for granted in (False, True):
                pre, post = engine_cache_instruction(
                    "WB", "completion", [1, 2], last, no_kv, granted
                )
                changed = last != [1, 2]
                assert (pre == IN) == ((not no_kv) and (changed or granted))
                assert pre in (IN, NOTHING)
                assert post == (CacheOp("Reset", False, False) if no_kv else OUT)


@pytest.mark.rule("engine cache instruction pre_op / post_op")
def test_prompt_pre_op_is_in_at_a_nonzero_offset_else_reset_with_preallocated_cache():
    reset = CacheOp("Reset", load_preallocated_cache=True, reset_non_granular=False)
    for world in ("W0", "WA", "WB"):
        assert engine_cache_instruction(world, "prompt", [4], [], False, first_token_offset=0) == (
            reset,
            OUT,
        )
        assert engine_cache_instruction(world, "prompt", [4], [], False, first_token_offset=16) == (
            IN,
            OUT,
        )
        assert engine_cache_instruction(world, "prompt", [4], [], True)[1] == CacheOp("Reset")


@pytest.mark.rule("engine cache instruction pre_op / post_op")
def test_cache_op_and_batch_kind_refuse_malformed_values():
    with pytest.raises(ValueError, match="'Flush'"):
        CacheOp("Flush")
    with pytest.raises(ValueError, match="only Reset"):
        CacheOp("In", load_preallocated_cache=True)
    with pytest.raises(ValueError, match="'decode'"):
        engine_cache_instruction("W0", "decode", [1], [], False)


@pytest.mark.rule("last_completion_ids bookkeeping")
def test_last_completion_ids_bookkeeping_across_an_iteration():
    st_ = state_for("W0")
    cohort = [comp(0, 30), comp(1, 30)]
    out = schedule(cohort, [], st_)
    assert [b.pre_op for b in plan_engine_iteration(st_, out)] == [IN]
    assert st_.last_completion_ids == [0, 1]
    out = schedule(cohort, [], st_)
    assert [b.pre_op for b in plan_engine_iteration(st_, out)] == [NOTHING], (
        "a stable cohort reuses the cache"
    )
    # A completion and a fresh prompt sharing the W0 key run in one iteration:
    # completions first, then the prompt, after which the next decode must take In.
    mixed = [comp(0, 30), comp(1, 30)]
    out = schedule(mixed, [prompt(2, 30)], st_)
    plan = plan_engine_iteration(st_, out)
    assert [b.kind for b in plan] == ["completion", "prompt"]
    assert plan[0].pre_op == NOTHING and plan[1].pre_op == CacheOp(
        "Reset", load_preallocated_cache=True
    )
    assert st_.last_completion_ids == []
    out = schedule(mixed, [], st_)
    assert plan_engine_iteration(st_, out)[0].pre_op == IN
