"""Flags, `seq_may_draft`, the capability predicates, the refusal chain and the kv_advance
latch (cache-and-draft.md §2, §9.2, §13)."""

import pytest

from raggedspec.reference.cache import KvCache, NormalCache, OtherSlot
from raggedspec.reference.capability import (
    ISQ_BITS,
    KvAdvance,
    KvAdvanceLatch,
    acceptance_logging_enabled,
    batch_admission_admits_ragged_cohorts,
    cache_supports_per_sequence_advance,
    draft_chain_carries_per_sequence_positions,
    fp8_kv_enabled,
    kv_window_retain,
    model_masks_ragged_batches,
    mtp_tail_isq,
    per_sequence_kv_requested,
    per_sequence_refusal,
    seq_may_draft,
    xs_per_sequence_enabled,
)
from raggedspec.reference.errors import CapabilityRefusal
from raggedspec.reference.xs_rolling import XsRolling


def normal():
    return KvCache.new_normal(4096)


def xs():
    return XsRolling(4, 2, 64, 2048)


def v4_cache():
    """The V4 target shape: K/V slots, then the XsRolling slots."""
    return NormalCache([normal(), normal(), xs(), XsRolling(128)])


def plain_cache():
    return NormalCache.new_plain(3, 4096)


def lone_xs_cache():
    return NormalCache([xs()])


def refusal_text(check, *args):
    with pytest.raises(CapabilityRefusal) as e:
        check(*args)
    return str(e.value)


# --- §2 flags ---------------------------------------------------------------------------------


@pytest.mark.rule("per_sequence_kv_requested / ARC_MTP_PER_SEQ_KV")
def test_per_sequence_kv_is_requested_by_one_or_true_in_any_case():
    for on in ("1", "true", "TRUE", "True", "tRuE"):
        assert per_sequence_kv_requested(on), on
    for off in (None, "", "0", "yes", "on", "false", " 1", "1 ", "true ", "2"):
        assert not per_sequence_kv_requested(off), off


@pytest.mark.rule("ARC_V4_XS_PER_SEQ / xs_per_sequence_enabled")
def test_the_xs_flag_is_exactly_one_true_or_upper_true():
    for on in ("1", "true", "TRUE"):
        assert xs_per_sequence_enabled(on), on
    for off in (None, "", "0", "True", "tRUE", "yes", " 1", "on"):
        assert not xs_per_sequence_enabled(off), off


@pytest.mark.rule("ARC_MTP_LOG_ACCEPTANCE")
def test_acceptance_logging_is_on_unless_explicitly_disabled():
    for on in (None, "1", "true", "on", "yes", " 1 "):
        assert acceptance_logging_enabled(on), on
    for off in ("0", "false", "off", "no", " 0 "):
        assert not acceptance_logging_enabled(off), off


@pytest.mark.rule("ARC_V4_FP8_KV")
def test_fp8_kv_needs_the_exact_one():
    assert fp8_kv_enabled("1")
    for off in (None, "true", "01", " 1", "TRUE"):
        assert not fp8_kv_enabled(off)


@pytest.mark.rule("ARC_V4_KV_WINDOW retain")
def test_the_kv_window_retains_the_window_plus_a_margin_of_sixteen():
    assert kv_window_retain(128) == 144
    assert kv_window_retain(1) == 17
    assert kv_window_retain(0) == 17  # max(window, 1)


@pytest.mark.rule("ARC_MTP_ALLOW_SUB_INT8 / mtp_tail_is_floored_at_int8")
def test_mtp_tail_is_floored_at_int8():
    sub = [name for name, bits in ISQ_BITS.items() if bits < 8]
    assert len(sub) >= 10
    for name in sub:
        floored = mtp_tail_isq(name, allow_sub_int8=False)
        assert ISQ_BITS[floored] >= 8, (name, floored)
        assert mtp_tail_isq(name, allow_sub_int8=True) == name
    for name in ("Q8_0", "Q8_1", "Q8K", "HQQ8", "AFQ8", "F8E4M3"):
        assert mtp_tail_isq(name, allow_sub_int8=False) == name
    assert mtp_tail_isq(None, allow_sub_int8=False) is None
    assert mtp_tail_isq("AFQ2", False) == "AFQ8"
    assert mtp_tail_isq("AFQ3", False) == "AFQ8"
    assert mtp_tail_isq("AFQ4", False) == "AFQ8"
    assert mtp_tail_isq("AFQ6", False) == "AFQ8"
    assert mtp_tail_isq("HQQ4", False) == "HQQ8"
    assert mtp_tail_isq("Qtip2b", False) == "Q8_0"
    assert mtp_tail_isq("Q4K", False) == "Q8_0"
    with pytest.raises(ValueError):
        mtp_tail_isq("Q7_7", False)


# --- §9.2 -----------------------------------------------------------------------------------------


@pytest.mark.rule("seq_may_draft")
def test_a_temperature_request_does_not_take_the_mtp_path():
    assert seq_may_draft(None, None, None, None)
    assert seq_may_draft(0.0, None, None, None)
    for t in (0.1, 0.7, 1.0, 2.0):
        assert not seq_may_draft(t, None, None, None), t
    assert seq_may_draft(1e-9, None, None, None)
    assert not seq_may_draft(None, 0.5, None, None)
    assert not seq_may_draft(None, None, 0.5, None)
    assert not seq_may_draft(None, None, None, 1.1)
    assert seq_may_draft(None, 0.0, 0.0, 1.0)
    assert not seq_may_draft(None, None, None, None, dry=True)
    assert not seq_may_draft(None, None, None, None, custom_processor=True)


# --- §13 capability predicates
# -----------------------------------------------------------------------


@pytest.mark.rule("cache_supports_per_sequence_advance")
def test_the_capability_probe_names_the_slot_that_cannot_carry_its_own_length():
    assert cache_supports_per_sequence_advance(plain_cache(), False) is None
    cache = NormalCache([normal(), xs()])
    msg = refusal_text(cache_supports_per_sequence_advance, cache, False)
    assert "slot 1" in msg and "XsRolling" in msg and "`XsRolling`" in msg
    assert cache_supports_per_sequence_advance(cache, True) is None  # the xs flag is honoured
    for kind in ("Rotating", "TurboQuant"):
        cache = NormalCache([normal(), normal(), OtherSlot(kind)])
        for flag in (False, True):
            msg = refusal_text(cache_supports_per_sequence_advance, cache, flag)
            assert f"cache slot 2 is a `{kind}`" in msg
    # the FIRST incapable slot is named
    msg = refusal_text(
        cache_supports_per_sequence_advance, NormalCache([OtherSlot("Rotating"), xs()]), False
    )
    assert "slot 0" in msg and "Rotating" in msg
    assert "paged" in refusal_text(
        cache_supports_per_sequence_advance, NormalCache([normal()], paged=True), True
    )


@pytest.mark.rule("model_masks_ragged_batches")
def test_the_mask_capability_passes_for_v4_and_still_refuses_for_everyone_else():
    assert model_masks_ragged_batches(v4_cache()) is None
    msg = refusal_text(model_masks_ragged_batches, plain_cache())
    assert "XsRolling" in msg and "dead" in msg
    refusal_text(model_masks_ragged_batches, NormalCache([normal(), xs()], paged=True))


@pytest.mark.rule("draft_chain_carries_per_sequence_positions")
def test_the_draft_chain_capability_passes_for_v4_and_still_refuses_for_everyone_else():
    assert draft_chain_carries_per_sequence_positions(v4_cache()) is None
    msg = refusal_text(draft_chain_carries_per_sequence_positions, plain_cache())
    assert "left-aligns" in msg and "draft" in msg
    refusal_text(
        draft_chain_carries_per_sequence_positions, NormalCache([normal(), xs()], paged=True)
    )


@pytest.mark.rule("draft_chain_carries_per_sequence_positions")
def test_the_draft_chain_check_is_implied_by_the_mask_check_today():
    shapes = [v4_cache(), plain_cache(), lone_xs_cache(), NormalCache([normal(), xs()], paged=True),
              NormalCache([OtherSlot("Rotating")])]
    outcomes = []
    for cache in shapes:
        def ok(check, cache=cache):
            try:
                check(cache)
                return True
            except CapabilityRefusal:
                return False
        outcomes.append(ok(model_masks_ragged_batches))
        assert ok(model_masks_ragged_batches) == ok(draft_chain_carries_per_sequence_positions)
    assert True in outcomes and False in outcomes  # non-degenerate: both verdicts occur


@pytest.mark.rule("batch_admission_admits_ragged_cohorts")
def test_batch_admission_refuses_and_names_the_scheduler():
    msg = refusal_text(batch_admission_admits_ragged_cohorts, "refuse")
    for word in ("cache_bucket_len", "bucket", "select_running_bucket", "CacheInstruction::In"):
        assert word in msg
    assert batch_admission_admits_ragged_cohorts("grant") is None
    with pytest.raises(ValueError):
        batch_admission_admits_ragged_cohorts("maybe")


@pytest.mark.rule("per_sequence_refusal")
def test_a_fully_capable_v4_cache_is_still_refused_and_now_names_the_scheduler():
    cache = v4_cache()
    assert cache_supports_per_sequence_advance(cache, True) is None
    assert model_masks_ragged_batches(cache) is None
    assert draft_chain_carries_per_sequence_positions(cache) is None
    refusal = per_sequence_refusal(cache, True, "refuse")
    assert refusal is not None
    msg = str(refusal)
    assert "cache_bucket_len" in msg and "bucket" in msg
    for banned in ("XsRolling", "window_ok", "cache_len =", "forward_step", "MtpHiddenCapture"):
        assert banned not in msg, banned


@pytest.mark.rule("per_sequence_refusal")
def test_per_sequence_refusal_reports_the_first_failure_in_order():
    # support first: an xs slot without the flag, on an otherwise V4 cache
    assert "slot 2" in str(per_sequence_refusal(v4_cache(), False, "refuse"))
    # support before mask: a Rotating slot on a non-V4 cache names the slot
    rot = NormalCache([normal(), OtherSlot("Rotating")])
    assert "cache slot 1 is a `Rotating`" in str(per_sequence_refusal(rot, True, "grant"))
    # mask before draft chain and admission: a plain (all-Normal) cache
    msg = str(per_sequence_refusal(plain_cache(), True, "refuse"))
    assert "dead" in msg and "cache_bucket_len" not in msg
    # admission last
    assert "select_running_bucket" in str(per_sequence_refusal(v4_cache(), True, "refuse"))
    # granted admission and a capable V4 cache: no refusal
    assert per_sequence_refusal(v4_cache(), True, "grant") is None
    assert per_sequence_refusal(lone_xs_cache(), True, "grant") is None
    assert isinstance(per_sequence_refusal(plain_cache(), True, "grant"), CapabilityRefusal)


@pytest.mark.rule("per_sequence_refusal")
def test_a_plain_cache_is_refused_by_the_mask_check_not_the_draft_chain_check():
    # dropping the mask check from per_sequence_refusal left the (identical) draft-chain check
    # to refuse, under a different name; "dead" appears in both messages, so name the check
    msg = str(per_sequence_refusal(NormalCache.new_plain(3, 4096), True, "refuse"))
    assert "masks a left-aligned batch's dead prefix per row" in msg
    assert "MTP draft chain" not in msg


# --- §13 kv_advance latch
# --------------------------------------------------------------------------


@pytest.mark.rule("kv_advance latch")
def test_kv_advance_not_requested_is_cohort():
    latch = KvAdvanceLatch(requested=False, xs_per_seq=True, admission="grant")
    assert latch.kv_advance(v4_cache()) is KvAdvance.COHORT
    assert latch.refusal is None and latch.messages == []


@pytest.mark.rule("kv_advance latch")
def test_kv_advance_refused_falls_back_to_cohort_and_says_it_cannot_honour_it():
    latch = KvAdvanceLatch(requested=True, xs_per_seq=True, admission="refuse")
    assert latch.kv_advance(v4_cache()) is KvAdvance.COHORT
    assert len(latch.messages) == 1
    warning = latch.messages[0]
    assert "cannot honour it" in warning
    assert "cache_bucket_len" in warning and "CacheInstruction::In" in warning
    for banned in ("XsRolling", "ragged mask", "cache_len =", "forward_step", "window_ok"):
        assert banned not in warning, banned
    assert latch.refusal in warning


@pytest.mark.rule("kv_advance latch")
def test_kv_advance_grants_per_sequence_only_when_every_check_passes():
    latch = KvAdvanceLatch(requested=True, xs_per_seq=True, admission="grant")
    assert latch.kv_advance(v4_cache()) is KvAdvance.PER_SEQUENCE
    assert latch.refusal is None and len(latch.messages) == 1 and "PerSequence" in latch.messages[0]
    # the flag alone does not grant it
    for cache, xs_flag in ((plain_cache(), True), (v4_cache(), False)):
        latch = KvAdvanceLatch(requested=True, xs_per_seq=xs_flag, admission="grant")
        assert latch.kv_advance(cache) is KvAdvance.COHORT
        assert "cannot honour it" in latch.messages[0]


@pytest.mark.rule("kv_advance latch")
def test_kv_advance_is_latched_once():
    latch = KvAdvanceLatch(requested=True, xs_per_seq=True, admission="grant")
    assert latch.kv_advance(v4_cache()) is KvAdvance.PER_SEQUENCE
    assert latch.kv_advance(plain_cache()) is KvAdvance.PER_SEQUENCE
    assert len(latch.messages) == 1
    latch = KvAdvanceLatch(requested=True, xs_per_seq=True, admission="grant")
    assert latch.kv_advance(plain_cache()) is KvAdvance.COHORT
    assert latch.kv_advance(v4_cache()) is KvAdvance.COHORT
    assert len(latch.messages) == 1


# --- each refusal's exact text, each boundary ----------------------------------------------

ADMISSION_REFUSAL = (
    "batch admission assumes one batch has one length: the scheduler partitions the running "
    "set by cache_bucket_len and select_running_bucket runs one bucket per step, and the engine "
    "issues CacheInstruction::In only when the completion list changes; the first ragged commit "
    "would shatter the cohort")
DRAFT_CHAIN_REFUSAL = (
    "the MTP draft chain left-aligns a ragged draft group and needs the model to mask each "
    "row's draft dead prefix; only the V4 target's MTP block does")


@pytest.mark.rule(
    "cache_supports_per_sequence_advance",
    "model_masks_ragged_batches",
    "draft_chain_carries_per_sequence_positions",
    "batch_admission_admits_ragged_cohorts",
)
def test_each_capability_refusal_reads_exactly_as_its_rule_states_it():
    assert refusal_text(batch_admission_admits_ragged_cohorts, "refuse") == ADMISSION_REFUSAL
    assert refusal_text(draft_chain_carries_per_sequence_positions,
                        plain_cache()) == DRAFT_CHAIN_REFUSAL
    # the slot, its kind, and the flag hint only where the flag would help (XsRolling)
    assert refusal_text(cache_supports_per_sequence_advance, NormalCache([normal(), xs()]),
                        False) == ("cache slot 1 is a `XsRolling`, which cannot carry its own "
                                   "per-sequence length (ARC_V4_XS_PER_SEQ is off)")
    assert refusal_text(cache_supports_per_sequence_advance,
                        NormalCache([normal(), OtherSlot("Rotating")]), True) == (
        "cache slot 1 is a `Rotating`, which cannot carry its own per-sequence length")
    # the kinds the cache holds, sorted
    msg = refusal_text(model_masks_ragged_batches, NormalCache([OtherSlot("Rotating"), normal()]))
    assert "this cache holds ['Normal', 'Rotating'] slots" in msg


@pytest.mark.rule(
    "cache_supports_per_sequence_advance",
    "model_masks_ragged_batches",
    "draft_chain_carries_per_sequence_positions",
)
def test_a_paged_cache_is_refused_by_each_check_for_what_it_cannot_do():
    paged = NormalCache([normal(), xs()], paged=True)
    for check, args, what in (
            (cache_supports_per_sequence_advance, (True,), "carry a per-sequence length"),
            (model_masks_ragged_batches, (), "be masked per row"),
            (draft_chain_carries_per_sequence_positions, (), "carry per-row draft positions")):
        assert refusal_text(check, paged, *args) == f"a paged KV cache cannot {what}"


@pytest.mark.rule(
    "ARC_V4_KV_WINDOW retain",
    "ARC_MTP_ALLOW_SUB_INT8 / mtp_tail_is_floored_at_int8",
    "batch_admission_admits_ragged_cohorts",
)
def test_malformed_flag_values_are_named():
    with pytest.raises(ValueError, match="^admission 'maybe' must be 'refuse' or 'grant'$"):
        batch_admission_admits_ragged_cohorts("maybe")
    with pytest.raises(ValueError, match="^sliding window -1 must be >= 0$"):
        kv_window_retain(-1)
    with pytest.raises(ValueError, match="^unknown ISQ type 'Q7_7'$"):
        mtp_tail_isq("Q7_7", False)


@pytest.mark.rule("seq_may_draft")
def test_a_temperature_of_exactly_1e_7_is_not_greedy():
    # only a temperature strictly below 1e-7 folds to greedy
    assert not seq_may_draft(1e-7, None, None, None)


@pytest.mark.rule("kv_advance latch")
def test_the_latch_defaults_to_the_refusing_admission_and_logs_the_grant():
    latch = KvAdvanceLatch(requested=True, xs_per_seq=True)  # admission left at its default
    assert latch.kv_advance(v4_cache()) is KvAdvance.COHORT
    assert latch.refusal == ADMISSION_REFUSAL
    latch = KvAdvanceLatch(requested=True, xs_per_seq=True, admission="grant")
    latch.kv_advance(v4_cache())
    assert latch.messages == ["INFO ARC_MTP_PER_SEQ_KV: MTP KV advance is PerSequence"]
