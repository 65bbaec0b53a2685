"""Acceptance accounting and the MTP marker (cache-and-draft.md §15, §17.2; masks §21).

`step_of(p, a)` is the §17.1 fixture: a step that proposed p drafts and accepted a, in the
older verify shape (`committed = 1 + a + [a < p]`, `reached = min(a + 1, p)`); it is built
through `from_verify` and checked against those formulas independently below.
"""

import re

import pytest

from raggedspec.reference.accounting import (
    LOG_EVERY,
    POSITION_CAP,
    AcceptanceTelemetry,
    MtpAcceptance,
    from_fused_verify,
    from_verify,
    skipped_step,
)
from raggedspec.reference.step import verify_proposed

ffv = from_fused_verify


def step_of(p: int, a: int) -> MtpAcceptance:
    proposed = list(range(p))
    target = proposed[:a] + [-1] * (p - a)
    return from_verify(p, verify_proposed(proposed, target))


def total_of(steps) -> MtpAcceptance:
    acc = MtpAcceptance()
    for s in steps:
        acc.add(s)
    return acc


def field(marker: str, key: str) -> str:
    m = re.search(rf"(?:^|\s){key}=(\S+)", marker)
    assert m, f"{key}= missing from {marker!r}"
    return m.group(1)


# --- per-step constructors -----------------------------------------------------------------------


@pytest.mark.rule("from_verify")
def test_step_of_matches_its_formulas():
    for p in range(0, 12):
        for a in range(0, p + 1):
            s = step_of(p, a)
            reached = min(a + 1, p)
            assert s.committed == 1 + a + (a < p)
            assert s.reached_at == [1 if j < min(reached, 8) else 0 for j in range(8)]
            assert s.accepted_at == [1 if j < min(a, 8) else 0 for j in range(8)]
            assert (s.accepted, s.proposed, s.steps, s.drafted_steps) == (a, p, 1, int(p > 0))
            assert s.pos_over_cap == int(p > 8)


@pytest.mark.rule("from_fused_verify")
def test_from_fused_verify_caps_reached_at_the_drafts():
    s = ffv(2, 2)
    assert s.reached_at[:3] == [1, 1, 0] and s.accepted_at[:3] == [1, 1, 0]
    assert (s.committed, s.accepted, s.proposed, s.steps, s.drafted_steps) == (3, 2, 2, 1, 1)
    s = ffv(3, 1)
    assert s.reached_at[:3] == [1, 1, 0] and s.accepted_at[:3] == [1, 0, 0] and s.committed == 2
    s = ffv(3, 0)
    assert s.reached_at[:3] == [1, 0, 0] and s.committed == 1
    s = ffv(9, 9)
    assert s.pos_over_cap == 1 and sum(s.reached_at) == 8 and sum(s.accepted_at) == 8
    assert ffv(8, 8).pos_over_cap == 0
    for bad in ((1, 2), (-1, 0), (2, -1)):
        with pytest.raises(ValueError):
            ffv(*bad)


@pytest.mark.rule("from_fused_verify")
def test_a_non_drafting_sequence_accounts_as_plain_decode():
    s = ffv(0, 0)
    assert s.drafted_steps == 0 and s.committed == 1 and s.steps == 1
    assert s.rate() is None and s.tokens_per_step() == 1.0
    assert s == skipped_step()
    assert s.reached_at == [0] * 8


# --- counters and ratios
# -------------------------------------------------------------------------------


@pytest.mark.rule("MtpAcceptance ratios")
def test_acceptance_counters_increment():
    acc = MtpAcceptance()
    acc.accumulate(step_of(2, 1))
    acc.accumulate(step_of(2, 2))
    assert (acc.accepted, acc.proposed, acc.steps, acc.drafted_steps, acc.committed) == (
        3,
        4,
        2,
        2,
        6,
    )
    assert acc.reached_at[:2] == [2, 2] and acc.accepted_at[:2] == [2, 1]
    acc.reset()
    assert acc == MtpAcceptance()


@pytest.mark.rule("MtpAcceptance ratios")
def test_acceptance_rate_moves_to_one_on_all_accept_and_zero_on_all_reject():
    all_accept = total_of(step_of(3, 3) for _ in range(40))
    assert all_accept.rate() == 1.0 and all_accept.tokens_per_step() == 4.0
    all_reject = total_of(step_of(3, 0) for _ in range(40))
    assert all_reject.rate() == 0.0 and all_reject.tokens_per_step() == 2.0
    mixed = total_of(step_of(3, i % 4) for i in range(40))
    counted = sum(i % 4 for i in range(40)) / (3 * 40)
    assert 0.0 < mixed.rate() < 1.0 and mixed.rate() == counted


@pytest.mark.rule("MtpAcceptance ratios")
def test_per_position_acceptance_separates_profiles_the_aggregate_cannot():
    flat = total_of(step_of(3, 1) for _ in range(100))
    alternating = total_of(step_of(3, 2 if i % 2 == 0 else 0) for i in range(100))
    for acc in (flat, alternating):
        assert (acc.accepted, acc.proposed, acc.committed) == (100, 300, 300)
        assert acc.rate() == pytest.approx(1 / 3) and acc.tokens_per_step() == 3.0
        assert sum(acc.accepted_at) == acc.accepted
        assert acc.reached_at[0] == acc.drafted_steps
        assert all(acc.reached_at[j] <= acc.accepted_at[j - 1] for j in range(1, 8))
    assert flat.accepted_at[:3] == [100, 0, 0] and flat.reached_at[:3] == [100, 100, 0]
    assert flat.per_position_rates() == [1.0, 0.0]
    assert alternating.accepted_at[:3] == [50, 50, 0] and alternating.reached_at[:3] == [
        100,
        50,
        50,
    ]
    assert alternating.per_position_rates() == [0.5, 1.0, 0.0]


@pytest.mark.rule("MTP[...] marker and report lines")
def test_per_position_acceptance_is_on_the_marker_and_the_report():
    acc = total_of(ffv(3, a) for a in (3, 2, 1, 0))
    assert acc.accepted_at[:3] == [3, 2, 1] and acc.reached_at[:3] == [4, 3, 2]
    marker = acc.marker("agg")
    for part in ("drafted_steps=4", "accepted_pos=3,2,1", "reached_pos=4,3,2",
                 "p_pos=0.7500,0.6667,0.5000", "pos_over_cap=0"):
        assert part in marker, part
    report = acc.report_lines()
    for line in ("pos 0: p=0.7500 (3/4)", "pos 1: p=0.6667 (2/3)", "pos 2: p=0.5000 (1/2)"):
        assert any(line in r for r in report), line
    idle = MtpAcceptance()
    assert idle.tracked_extent() == 0 and idle.per_position_rates() == []
    assert not any("pos 0" in r for r in idle.report_lines())
    assert "p_pos=n/a" in idle.marker("agg")


@pytest.mark.rule("MtpAcceptance ratios")
def test_positions_beyond_the_cap_are_flagged_not_hidden():
    acc = step_of(10, 10)
    assert acc.accepted == 10 and acc.pos_over_cap == 1
    assert acc.tracked_extent() == POSITION_CAP == 8 and sum(acc.accepted_at) == 8
    report = acc.report_lines()
    assert any("WARN" in line for line in report)
    assert "pos_over_cap=1" in acc.marker("agg")
    assert not any("WARN" in line for line in step_of(8, 8).report_lines())


@pytest.mark.rule("MtpAcceptance ratios")
def test_skipped_draft_steps_count_as_steps_and_pull_the_multiplier_to_one():
    acc = total_of(skipped_step() for _ in range(10))
    assert acc.rate() is None and acc.tokens_per_step() == 1.0
    assert "accept_rate=n/a" in acc.marker("agg")
    for _ in range(10):
        acc.add(step_of(2, 2))
    assert acc.steps == 20 and acc.drafted_steps == 10
    assert acc.rate() == 1.0 and acc.tokens_per_step() == 2.0


# --- accumulate / the log period
# --------------------------------------------------------------------------


@pytest.mark.rule("accumulate")
def test_acceptance_report_fires_once_per_log_period():
    acc = MtpAcceptance()
    fired = [acc.accumulate(step_of(2, 1)) for _ in range(32)]
    assert fired[:31] == [False] * 31 and fired[31] is True
    assert LOG_EVERY == 64
    acc = MtpAcceptance()
    fires = sum(acc.accumulate(step_of(3, 2)) for _ in range(300))
    assert (acc.accepted, acc.proposed) == (600, 900) and fires == 14
    acc = MtpAcceptance()
    assert acc.accumulate(step_of(1000, 500)) is True  # straddles 15 multiples, fires once
    assert acc.accumulate(MtpAcceptance()) is False
    assert acc.accumulate(skipped_step()) is False
    acc = MtpAcceptance(proposed=63)
    assert acc.accumulate(step_of(2, 0)) is True  # 63 -> 65 straddles 64 without landing on it
    acc = MtpAcceptance()
    assert not any(acc.accumulate(step_of(2, 1), every=0) for _ in range(100))


# --- report text
# --------------------------------------------------------------------------------------------


@pytest.mark.rule("MTP[...] marker and report lines")
def test_acceptance_report_states_the_counted_ratio():
    assert MtpAcceptance().report_lines()[0] == "MTP acceptance rate: 0 proposals so far"
    acc = total_of([step_of(2, 2)] * 26 + [step_of(2, 1)] * 39)
    report = acc.report_lines()
    assert "70.0% (91/130 accepted)" in report[0]
    assert report[0] == "MTP acceptance rate: 70.0% (91/130 accepted)"
    marker = acc.marker("agg")
    for part in ("accept_rate=0.7000", "steps=65", "committed=195", "tok_per_step=3.0000"):
        assert part in marker.split() or f" {part}" in marker, part


@pytest.mark.rule("MTP[...] marker and report lines")
def test_the_marker_carries_every_field_in_order():
    acc = total_of([ffv(2, 1), ffv(2, 2)])
    marker = acc.marker("req=7")
    keys = re.findall(r"(\w+)=", marker.split("] ", 1)[1])
    assert marker.startswith("MTP[req=7] ")
    assert keys == ["accept_rate", "accepted", "proposed", "steps", "drafted_steps", "committed",
                    "tok_per_step", "batch_steps", "mean_batch", "tok_per_batch_step", "p_pos",
                    "accepted_pos", "reached_pos", "pos_over_cap"]
    assert field(marker, "accept_rate") == "0.7500"
    assert field(marker, "mean_batch") == "n/a" and field(marker, "tok_per_batch_step") == "n/a"


@pytest.mark.rule("AcceptanceTelemetry record path and log gate")
def test_acceptance_logger_fires_from_the_record_path_only_when_gated_on():
    tel = AcceptanceTelemetry(logging_enabled=True)
    for _ in range(32):
        tel.record_step(1, step_of(2, 1))
    assert sum("MTP acceptance rate" in line for line in tel.lines) == 1
    assert sum(line.startswith("MTP[agg]") for line in tel.lines) == 1
    assert any("50.0% (32/64 accepted)" in line for line in tel.lines)
    off = AcceptanceTelemetry(logging_enabled=False)
    for _ in range(32):
        off.record_step(1, step_of(2, 1))
    assert off.lines == []
    assert (off.total.accepted, off.total.proposed) == (32, 64)
    manual = off.log()
    assert any("MTP acceptance rate" in line for line in manual) and off.lines == manual


@pytest.mark.rule("AcceptanceTelemetry record path and log gate")
def test_record_step_keeps_per_request_counters_and_flushes_them():
    tel = AcceptanceTelemetry()
    tel.record_step(1, ffv(2, 2))
    tel.record_step(2, ffv(2, 0))
    tel.record_step(1, ffv(2, 1))
    assert tel.by_request[1].accepted == 3 and tel.by_request[2].accepted == 0
    assert tel.total.accepted == 3 and tel.total.steps == 3
    assert tel.marker("req=1").startswith("MTP[req=1] accept_rate=0.7500")
    assert tel.flush_request(1) == [tel.lines[-1]] and "MTP[req=1]" in tel.lines[-1]
    assert 1 not in tel.by_request


@pytest.mark.rule("record_batch")
def test_batched_acceptance_is_reported_per_batch_size():
    tel = AcceptanceTelemetry()
    tel.record_batch(4, [ffv(2, 2)] * 4)
    tel.record_batch(2, [ffv(2, 0)] * 2)
    assert sorted(tel.by_batch) == [2, 4]
    b2, b4 = tel.by_batch[2], tel.by_batch[4]
    assert b2.rate() == 0.0 and b2.tokens_per_step() == 1.0 and b2.tokens_per_batch_step() == 2.0
    assert b4.rate() == 1.0 and b4.tokens_per_step() == 3.0 and b4.tokens_per_batch_step() == 12.0
    assert b4.mean_batch() == 4.0
    marker = tel.marker("b=4")
    assert marker.startswith("MTP[b=4] ") and "batch_steps=1" in marker.split()
    assert "tok_per_batch_step=12.0000" in marker and "mean_batch=4.0000" in marker
    # only batch_steps reaches the global counters from record_batch
    assert tel.total.batch_steps == 2 and tel.total.steps == 0 and tel.total.committed == 0
    with pytest.raises(ValueError):
        tel.record_batch(3, [ffv(1, 1)])


# --- refusals, boundaries and defaults ------------------------------------------------------


@pytest.mark.rule("from_fused_verify", "MTP[...] marker and report lines")
def test_malformed_counts_and_scopes_are_named():
    # three accepted of two proposed, through both step shapes
    for build in (lambda: ffv(2, 3),
                  lambda: from_verify(2, verify_proposed([0, 1, 2], [0, 1, 2]))):
        with pytest.raises(ValueError, match=re.escape("accepted 3 must be in [0, proposed 2]")):
            build()
    with pytest.raises(ValueError, match="^every -1 must be >= 0$"):
        MtpAcceptance().accumulate(ffv(1, 0), every=-1)
    t = AcceptanceTelemetry(logging_enabled=False)
    t.record_step(5, ffv(2, 1))
    for scope in ("x=1", "req=x", "req"):
        with pytest.raises(ValueError, match=re.escape(
                f"scope {scope!r} must be agg, req=<id> or b=<n>")):
            t.marker(scope)
    with pytest.raises(ValueError, match="^no acceptance counters for req=9$"):
        t.marker("req=9")
    with pytest.raises(ValueError, match=re.escape("record_batch(3) given 2 per-sequence stats")):
        t.record_batch(3, [ffv(1, 0), ffv(1, 1)])


@pytest.mark.rule("from_fused_verify")
def test_one_draft_reaches_position_zero():
    s = ffv(1, 0)  # proposed one draft, rejected it: position 0 was reached, not accepted
    assert (s.reached_at[0], s.accepted_at[0], s.drafted_steps, s.committed) == (1, 0, 1, 1)


@pytest.mark.rule("accumulate")
def test_a_log_period_of_one_fires_on_every_proposing_step():
    acc = MtpAcceptance()
    assert acc.accumulate(ffv(1, 0), every=1) and acc.accumulate(ffv(2, 2), every=1)
    assert not acc.accumulate(skipped_step(), every=1)  # p == 0 never fires


@pytest.mark.rule("AcceptanceTelemetry record path and log gate")
def test_the_telemetrys_own_period_decides_when_the_report_fires():
    t = AcceptanceTelemetry(logging_enabled=True, every=4)  # far below LOG_EVERY
    assert not t.record_step(0, ffv(3, 1))
    assert t.record_step(1, ffv(1, 1))  # 4 proposals: one period
    assert t.lines and t.lines[-1].startswith("MTP[agg] ")


@pytest.mark.rule("MtpAcceptance ratios")
def test_every_counter_adds_including_batch_steps_and_positions_over_the_cap():
    acc = MtpAcceptance(batch_steps=2, pos_over_cap=1)
    acc.add(MtpAcceptance(batch_steps=3, pos_over_cap=4))
    assert (acc.batch_steps, acc.pos_over_cap) == (5, 5)
    # counters built with fewer tracked positions add over the positions both track
    short = MtpAcceptance(accepted_at=[1, 2], reached_at=[3, 4])
    short.add(ffv(3, 2))
    assert (short.accepted_at, short.reached_at) == ([2, 3], [4, 5])


@pytest.mark.rule("record_batch")
def test_the_default_scope_is_agg_and_batch_steps_accumulate_per_size():
    t = AcceptanceTelemetry(logging_enabled=False)
    t.record_step(0, ffv(2, 1))
    assert t.marker().startswith("MTP[agg] ") and t.report_lines()[-1].startswith("MTP[agg] ")
    assert ffv(2, 1).report_lines()[-1].startswith("MTP[agg] ")
    for _ in range(2):
        t.record_batch(2, [ffv(1, 0), ffv(1, 1)])
    assert t.by_batch[2].batch_steps == 2 and t.total.batch_steps == 2


@pytest.mark.rule("AcceptanceTelemetry record path and log gate")
def test_flushing_an_unknown_request_emits_nothing():
    for on in (True, False):
        t = AcceptanceTelemetry(logging_enabled=on)
        assert t.flush_request(42) == [] and t.lines == []
