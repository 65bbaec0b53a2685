"""Scheduler telemetry: the SCHED[...] counters and marker, saturating differences, the engine's
interval line and its harness regex, the per-step debug line (masks-and-scheduling.md §21).

Expected values are the spec's quoted lines and counts.
"""

from __future__ import annotations

import re

import pytest

from raggedspec.conformance.test_scheduler import LENS_64_APART, comp, state_for
from raggedspec.reference.scheduler import schedule
from raggedspec.reference.scheduler_telemetry import (
    BucketTelemetry,
    interval_line,
    parse_running_waiting,
    step_debug_line,
)

# ------------------------------------------------------------------ §21 telemetry


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
    fence = st_.telemetry.snapshot()
    schedule([comp(i, n) for i, n in enumerate(LENS_64_APART)], [], st_)
    schedule([comp(0, 10), comp(1, 10)], [], st_)
    d = st_.telemetry.since(fence)
    assert (d.calls, d.buckets, d.offered, d.chosen, d.shattered) == (2, 9, 10, 3, 1)


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


@pytest.mark.rule("per-step debug line")
def test_step_debug_line_uses_token_counts():
    assert (
        step_debug_line([], [101, 140, 300], 812.5)
        == "Prompt[] Completion[101, 140, 300] - 812.5ms"
    )


# ------------------------------------------------------------------ boundaries and refusals


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
