"""Ragged admission, the engine's cache instruction and the scheduler's telemetry
(masks-and-scheduling.md §17, §18, §20.1 steps 3-5, §21): `RaggedAdmission`, `issues_cache_in`,
a grant reaching both the scheduler and the engine, `engine_cache_instruction` for completion
and prompt batches in every world, `plan_engine_iteration` and its `last_completion_ids`
bookkeeping, the cache ops' kinds and defaults, the `SCHED[...]` counters and marker, saturating
differences, the engine's interval line with its harness regex and the per-step debug line.

Expected values are the spec's quoted lines and counts, or oracles written here independently
of `reference/scheduler.py`.
"""

from __future__ import annotations

import re
from dataclasses import replace

import pytest

from raggedspec.conformance.helpers import (GRANT, LENS_64_APART, REFUSE, completion, prompt,
                                            raises_exactly, state_for)
from raggedspec.reference.errors import CapabilityRefusal, SchedulerRefusal
from raggedspec.reference.scheduler import (
    IN,
    NOTHING,
    OUT,
    CacheOp,
    EngineBatch,
    RaggedAdmission,
    ScheduleOutcome,
    SchedulerState,
    check_admission_agrees,
    engine_cache_instruction,
    install_admission,
    issues_cache_in,
    plan_engine_iteration,
    schedule,
)
from raggedspec.reference.scheduler_telemetry import (
    BucketTelemetry,
    interval_line,
    parse_running_waiting,
    step_debug_line,
)


# ----------------------------------------------------------------------------- §17 RaggedAdmission


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


@pytest.mark.rule("RaggedAdmission")
def test_a_refusing_decision_is_the_refused_state_with_its_reason():
    assert RaggedAdmission.decide("paged cache") == RaggedAdmission(False, "paged cache")
    assert RaggedAdmission.decide("paged cache").assembles_every_step() is False


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
    running = [completion(0, 50), completion(1, 80)]
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
    out = schedule([completion(0, 50), completion(1, 80)], [], st_)
    with pytest.raises(SchedulerRefusal, match="a grant must reach both"):
        plan_engine_iteration(st_, out)


@pytest.mark.rule("a grant must reach both scheduler and engine")
def test_a_grant_logs_the_admission_line_and_a_refusal_logs_nothing():
    st_ = SchedulerState(world="WB")
    assert install_admission(st_, RaggedAdmission.decide(None)) == (
        "Ragged batch admission is ON: completions share one bucket and the batch is "
        "re-assembled every step"
    )
    assert install_admission(st_, REFUSE) is None


# -------------------------------------------------------------------- §18 engine cache instruction


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
    with raises_exactly("world 'W9' must be one of ('W0', 'WA', 'WB')"):
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
    running = [completion(1, 11, cache_len=10), completion(2, 11, cache_len=10),
               prompt(3, 40, token_offset=5)]
    outcome = ScheduleOutcome((10, False, 0), False, running, [], [1, 2], [3], [], [], [], 1, 3,
                              [])
    plan = plan_engine_iteration(st_, outcome, no_kv_cache=True)
    assert plan == [EngineBatch("completion", [1, 2], NOTHING, CacheOp("Reset")),
                    EngineBatch("prompt", [3], IN, CacheOp("Reset"))]
    with_kv = plan_engine_iteration(SchedulerState(), outcome)
    assert with_kv == [EngineBatch("completion", [1, 2], IN, OUT),
                       EngineBatch("prompt", [3], IN, OUT)]


@pytest.mark.rule("last_completion_ids bookkeeping")
def test_last_completion_ids_bookkeeping_across_an_iteration():
    st_ = state_for("W0")
    cohort = [completion(0, 30), completion(1, 30)]
    out = schedule(cohort, [], st_)
    assert [b.pre_op for b in plan_engine_iteration(st_, out)] == [IN]
    assert st_.last_completion_ids == [0, 1]
    out = schedule(cohort, [], st_)
    assert [b.pre_op for b in plan_engine_iteration(st_, out)] == [NOTHING], (
        "a stable cohort reuses the cache"
    )
    # A completion and a fresh prompt sharing the W0 key run in one iteration:
    # completions first, then the prompt, after which the next decode must take In.
    mixed = [completion(0, 30), completion(1, 30)]
    out = schedule(mixed, [prompt(2, 30)], st_)
    plan = plan_engine_iteration(st_, out)
    assert [b.kind for b in plan] == ["completion", "prompt"]
    assert plan[0].pre_op == NOTHING and plan[1].pre_op == CacheOp(
        "Reset", load_preallocated_cache=True
    )
    assert st_.last_completion_ids == []
    out = schedule(mixed, [], st_)
    assert plan_engine_iteration(st_, out)[0].pre_op == IN


# ----------------------------------------------------------------------------------- §21 telemetry


SHATTERED_MARKER = ("SCHED[agg] calls=3 buckets=120 offered=384 chosen=9 shattered=3 "
                    "buckets_per_step=40.0000 running_bucket_size=3.0000 offered_per_step=128.0000 "
                    "preempted_per_step=125.0000 shattered_frac=1.0000")


@pytest.mark.rule("SCHED[...] marker")
def test_a_shattered_batch_reports_the_width_that_actually_ran():
    t = BucketTelemetry()
    for _ in range(3):
        t.record_bucketing(40, 128, 3)
    m = t.marker("agg")
    for part in ["buckets_per_step=40.0000", "running_bucket_size=3.0000",
                 "preempted_per_step=125.0000", "shattered_frac=1.0000"]:
        assert part in m
    assert m == SHATTERED_MARKER
    assert t.sched_bucket_marker() == SHATTERED_MARKER


@pytest.mark.rule("SCHED[...] marker", "record_bucketing")
def test_an_intact_batch_reports_one_bucket_and_no_preemption():
    t = BucketTelemetry()
    for _ in range(10):
        t.record_bucketing(1, 128, 128)
    assert (
        t.buckets_per_step(),
        t.running_bucket_size(),
        t.preempted_per_step(),
        t.shattered_frac(),
    ) == (1.0, 128.0, 0.0, 0.0)
    assert t.shattered == 0, "one bucket is not shattered"


@pytest.mark.rule("record_bucketing")
def test_record_bucketing_ignores_offered_zero():
    t = BucketTelemetry()
    t.record_bucketing(0, 0, 0)
    t.record_bucketing(3, 0, 0)
    assert t == BucketTelemetry()


@pytest.mark.rule("SCHED[...] marker")
def test_no_scheduling_reports_nothing_rather_than_zero():
    t = BucketTelemetry()
    assert t.buckets_per_step() is None and t.running_bucket_size() is None
    assert t.sched_bucket_marker() is None
    assert t.marker("agg") == ("SCHED[agg] calls=0 buckets=0 offered=0 chosen=0 shattered=0 "
                               "buckets_per_step=n/a running_bucket_size=n/a offered_per_step=n/a "
                               "preempted_per_step=n/a shattered_frac=n/a")


@pytest.mark.rule("SCHED[...] marker", "record_bucketing")
def test_one_call_already_has_rates_and_a_marker_and_two_buckets_shatter():
    t = BucketTelemetry()
    t.record_bucketing(2, 10, 6)  # one call, two buckets: shattered
    assert (t.buckets_per_step(), t.running_bucket_size(), t.preempted_per_step(),
            t.shattered_frac()) == (2.0, 6.0, 4.0, 1.0)
    assert t.sched_bucket_marker() == (
        "SCHED[agg] calls=1 buckets=2 offered=10 chosen=6 shattered=1 buckets_per_step=2.0000 "
        "running_bucket_size=6.0000 offered_per_step=10.0000 preempted_per_step=4.0000 "
        "shattered_frac=1.0000")


@pytest.mark.rule("saturating since")
def test_differencing_saturates_rather_than_wrapping():
    early = BucketTelemetry(100, 200, 1000, 500, 50)
    late = BucketTelemetry(150, 260, 1600, 900, 60)
    d = late.since(early)
    assert (d.calls, d.buckets, d.offered, d.chosen, d.shattered) == (50, 60, 600, 400, 10)
    assert d.running_bucket_size() == 8.0
    assert early.since(late) == BucketTelemetry()


@pytest.mark.rule("record_bucketing")
def test_schedule_records_one_bucketing_per_step_into_the_telemetry():
    st_ = state_for("W0")
    fence = replace(st_.telemetry)  # a copy of the counters before the two steps
    schedule([completion(i, n) for i, n in enumerate(LENS_64_APART)], [], st_)
    schedule([completion(0, 10), completion(1, 10)], [], st_)
    d = st_.telemetry.since(fence)
    assert (d.calls, d.buckets, d.offered, d.chosen, d.shattered) == (2, 9, 10, 3, 1)


@pytest.mark.rule("record_bucketing", "engine interval line and harness regex")
def test_each_negative_count_is_refused_by_name():
    for counts in ((-1, 4, 2), (1, -4, 2), (1, 4, -2)):
        with pytest.raises(ValueError, match=re.escape(f"counts {counts} must be >= 0")):
            BucketTelemetry().record_bucketing(*counts)
    good = dict(tokens=10, new_seqs=2, prefix_hits=1, running=3, waiting=4)
    for name in good:
        with pytest.raises(ValueError, match="^counts must be >= 0$"):
            interval_line(interval_s=1.0, **dict(good, **{name: -1}))
    for bad in (0, 0.0, -2.0):
        with pytest.raises(ValueError, match=f"^interval_s {bad} must be > 0$"):
            interval_line(interval_s=bad, **good)


@pytest.mark.rule("engine interval line and harness regex")
def test_engine_interval_line_format_and_the_harness_regex():
    line = interval_line(
        tokens=1000, interval_s=5.0, new_seqs=8, prefix_hits=2, running=47, waiting=48
    )
    assert line == "Throughput (T/s) 200.00, Prefix cache hitrate 25.00%, 47 running, 48 waiting"
    assert parse_running_waiting(line) == (47, 48)
    enc = interval_line(10, 5.0, 1, 0, 3, 0, encoder=(1, 3), sampler="SAMPLER ON CPU SLOW PATH: 2")
    assert enc == (
        "Throughput (T/s) 2.00, Prefix cache hitrate 0.00%, Encoder cache hitrate 25.00%, "
        "3 running, 0 waiting, SAMPLER ON CPU SLOW PATH: 2"
    )
    assert parse_running_waiting(enc) == (3, 0)
    assert interval_line(0, 5.0, 8, 0, 1, 1) is None and interval_line(10, 5.0, 0, 0, 1, 1) is None
    assert parse_running_waiting("no counts here") is None


@pytest.mark.rule("engine interval line and harness regex")
def test_a_sub_second_interval_and_each_encoder_edge_format():
    # 10 tokens in 0.5 s is 20 T/s; 1 hit of 2 new sequences is 50 %
    assert interval_line(10, 0.5, 2, 1, 3, 4) == (
        "Throughput (T/s) 20.00, Prefix cache hitrate 50.00%, 3 running, 4 waiting")
    # no encoder traffic: no encoder part (not a division by zero)
    assert interval_line(10, 0.5, 2, 1, 3, 4, encoder=(0, 0)) == (
        "Throughput (T/s) 20.00, Prefix cache hitrate 50.00%, 3 running, 4 waiting")
    # one hit, no miss: 100 %; three hits of four: 75 %
    for encoder, rate in (((1, 0), "100.00"), ((3, 1), "75.00")):
        assert interval_line(10, 0.5, 2, 1, 3, 4, encoder=encoder) == (
            f"Throughput (T/s) 20.00, Prefix cache hitrate 50.00%, Encoder cache hitrate "
            f"{rate}%, 3 running, 4 waiting")


@pytest.mark.rule("per-step debug line")
def test_step_debug_line_uses_token_counts():
    assert (
        step_debug_line([], [101, 140, 300], 812.5)
        == "Prompt[] Completion[101, 140, 300] - 812.5ms"
    )
