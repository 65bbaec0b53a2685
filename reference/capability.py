"""Flags, capability predicates and the per-sequence KV-advance latch.

Spec: cache-and-draft.md §2 (flags), §9.2 (`seq_may_draft`), §13 (capability predicates and
the refusal chain). Environment values are passed in as strings (None = unset), so the
parsers are pure functions; the latch is an object the pipeline owns.

Every capability check takes a `NormalCache` (reference/cache.py) whose slots may be
`KvCache` (Normal), `OtherSlot` ("Rotating" / "TurboQuant") or an XsRolling slot
(reference/xs_rolling.py); a slot is asked `supports_per_sequence_len(xs_per_seq)` and read
for `.kind`. A check returns None or raises `CapabilityRefusal`.
"""

from __future__ import annotations

from enum import Enum

from raggedspec.reference.errors import CapabilityRefusal, require

# --- §2 flags ------------------------------------------------------------------------------

GREEDY_TEMPERATURE = 1e-7
ISQ_SUB_INT8_FLOOR = {
    "AFQ2": "AFQ8",
    "AFQ3": "AFQ8",
    "AFQ4": "AFQ8",
    "AFQ6": "AFQ8",
    "HQQ4": "HQQ8",
}
ISQ_BITS = {
    "Q4_0": 4, "Q4_1": 4, "Q5_0": 5, "Q5_1": 5, "Q8_0": 8, "Q8_1": 8,
    "Q2K": 2, "Q3K": 3, "Q4K": 4, "Q5K": 5, "Q6K": 6, "Q8K": 8,
    "HQQ4": 4, "HQQ8": 8, "AFQ2": 2, "AFQ3": 3, "AFQ4": 4, "AFQ6": 6, "AFQ8": 8,
    "F8E4M3": 8, "Qtip2b": 2, "Qtip3b": 3, "Qtip4b": 4,
}
KV_WINDOW_MARGIN = 16


def per_sequence_kv_requested(value: str | None) -> bool:
    """`ARC_MTP_PER_SEQ_KV`: requested iff exactly "1", or "true" in any letter case. No
    trimming ("yes", " 1" are not requests)."""
    return value is not None and (value == "1" or value.lower() == "true")


def xs_per_sequence_enabled(value: str | None) -> bool:
    """`ARC_V4_XS_PER_SEQ`: on iff exactly "1", "true" or "TRUE" (not "True": the flag is
    deliberately not case-insensitive)."""
    return value in ("1", "true", "TRUE")


def acceptance_logging_enabled(value: str | None) -> bool:
    """`ARC_MTP_LOG_ACCEPTANCE`: on by default (unset included); off only when the value,
    after trimming whitespace, is exactly "0", "false", "off" or "no". Unspecified: letter
    case; this reference is case-sensitive ("FALSE" leaves logging on)."""
    return value is None or value.strip() not in ("0", "false", "off", "no")


def fp8_kv_enabled(value: str | None) -> bool:
    """`ARC_V4_FP8_KV`: FP8 K storage only for the exact value "1"."""
    return value == "1"


def kv_window_retain(window: int) -> int:
    """`ARC_V4_KV_WINDOW`: a windowed target KV retains `max(window, 1) + 16` positions."""
    require(window >= 0, f"sliding window {window} must be >= 0")
    return max(window, 1) + KV_WINDOW_MARGIN


def mtp_tail_isq(isq: str | None, allow_sub_int8: bool) -> str | None:
    """The ISQ type of the MTP tail (`ARC_MTP_ALLOW_SUB_INT8`). Unless sub-int8 is allowed,
    a type below 8 bits is floored: AFQ2/3/4/6 -> AFQ8, HQQ4 -> HQQ8, every other -> Q8_0;
    8-bit and wider types and None are unchanged. An unknown type name is malformed."""
    if isq is None or allow_sub_int8:
        return isq
    require(isq in ISQ_BITS, f"unknown ISQ type {isq!r}")
    if ISQ_BITS[isq] >= 8:
        return isq
    return ISQ_SUB_INT8_FLOOR.get(isq, "Q8_0")


# --- §9.2 -----------------------------------------------------------------------------------


def seq_may_draft(temperature: float | None, frequency_penalty: float | None,
                  presence_penalty: float | None, repetition_penalty: float | None,
                  dry: bool = False, custom_processor: bool = False) -> bool:
    """True iff the sampler is a plain argmax over raw logits (§9.2): no temperature (None,
    or one below 1e-7, which folds to greedy); no frequency / presence / repetition penalty
    (None or the identity values 0, 0, 1.0); no DRY; no custom logits processor.
    A drafting row's accepted drafts are exactly what its own sampler would emit."""
    greedy = temperature is None or temperature < GREEDY_TEMPERATURE
    no_penalty = (frequency_penalty in (None, 0.0) and presence_penalty in (None, 0.0)
                  and repetition_penalty in (None, 1.0))
    return greedy and no_penalty and not dry and not custom_processor


# --- §13 capability predicates ----------------------------------------------------------------


class KvAdvance(Enum):
    """How the batched cache advances after a verify: to the batch minimum (COHORT) or per row."""

    COHORT = "Cohort"
    PER_SEQUENCE = "PerSequence"


def _refuse_paged(cache, what: str) -> None:
    if cache.paged:
        raise CapabilityRefusal(f"a paged KV cache cannot {what}")


def cache_supports_per_sequence_advance(cache, xs_per_seq: bool) -> None:
    """Every slot can carry its own length (§13). Refuses a paged cache, then the first slot
    whose `supports_per_sequence_len(xs_per_seq)` is false: Normal always can; XsRolling
    only with `ARC_V4_XS_PER_SEQ`; Rotating and TurboQuant never ("cache slot {i} is a
    `{kind}` ...")."""
    _refuse_paged(cache, "carry a per-sequence length")
    for i, slot in enumerate(cache.slots):
        if not slot.supports_per_sequence_len(xs_per_seq):
            hint = " (ARC_V4_XS_PER_SEQ is off)" if slot.kind == "XsRolling" else ""
            raise CapabilityRefusal(
                f"cache slot {i} is a `{slot.kind}`, which cannot carry its own per-sequence "
                f"length{hint}")


def model_masks_ragged_batches(cache) -> None:
    """The model masks a left-aligned batch's dead prefix (§13): refuses a paged cache; Ok
    iff some slot is XsRolling (the V4 target, whose attention takes `row_q0`)."""
    _refuse_paged(cache, "be masked per row")
    if not any(slot.kind == "XsRolling" for slot in cache.slots):
        kinds = sorted({slot.kind for slot in cache.slots})
        raise CapabilityRefusal(
            f"only the V4 target (a cache with XsRolling slots) masks a left-aligned batch's "
            f"dead prefix per row; this cache holds {kinds} slots, so its zero columns would "
            f"get softmax weight")


def draft_chain_carries_per_sequence_positions(cache) -> None:
    """The MTP draft chain runs at per-row positions (§13). Today the same test as
    `model_masks_ragged_batches` (the MTP block is a V4 layer masked by the same `row_q0`),
    kept separate so a second architecture fails a test instead of inheriting it."""
    _refuse_paged(cache, "carry per-row draft positions")
    if not any(slot.kind == "XsRolling" for slot in cache.slots):
        raise CapabilityRefusal(
            "the MTP draft chain left-aligns a ragged draft group and needs the model to mask "
            "each row's draft dead prefix; only the V4 target's MTP block does")


def batch_admission_admits_ragged_cohorts(admission: str) -> None:
    """Whether the layer that admits a batch lets rows of different lengths share it (§13).
    "refuse" (arc's behaviour, the default policy) raises; "grant" (the simulator's policy
    in which PerSequence is reachable) returns None; any other value is malformed."""
    require(
        admission in ("refuse", "grant"), f"admission {admission!r} must be 'refuse' or 'grant'"
    )
    if admission == "refuse":
        raise CapabilityRefusal(
            "batch admission assumes one batch has one length: the scheduler partitions the "
            "running set by cache_bucket_len and select_running_bucket runs one bucket per "
            "step, and the engine issues CacheInstruction::In only when the completion list "
            "changes; the first ragged commit would shatter the cohort")


def per_sequence_refusal(cache, xs_per_seq: bool, admission: str) -> CapabilityRefusal | None:
    """The first refusal in the order support -> mask -> draft chain -> admission, or None
    when PerSequence may be granted (§13). With admission "refuse" it is never None."""
    checks = (
        lambda: cache_supports_per_sequence_advance(cache, xs_per_seq),
        lambda: model_masks_ragged_batches(cache),
        lambda: draft_chain_carries_per_sequence_positions(cache),
        lambda: batch_admission_admits_ragged_cohorts(admission),
    )
    for check in checks:
        try:
            check()
        except CapabilityRefusal as refusal:
            return refusal
    return None


class KvAdvanceLatch:
    """`kv_advance()`: decided once per pipeline, on the first call, then latched (§13).

    Not requested -> COHORT; requested and not refused -> PER_SEQUENCE (an info line);
    refused -> COHORT with a warning containing "cannot honour it" and the refusal's reason.
    Later calls return the latched decision whatever cache they are given. `messages` holds
    the emitted log lines; `refusal` the refusal text (None unless refused).
    """

    def __init__(self, requested: bool, xs_per_seq: bool, admission: str = "refuse") -> None:
        self.requested = requested
        self.xs_per_seq = xs_per_seq
        self.admission = admission
        self.decision: KvAdvance | None = None
        self.refusal: str | None = None
        self.messages: list[str] = []

    def kv_advance(self, cache) -> KvAdvance:
        if self.decision is not None:
            return self.decision
        if not self.requested:
            self.decision = KvAdvance.COHORT
            return self.decision
        refusal = per_sequence_refusal(cache, self.xs_per_seq, self.admission)
        if refusal is None:
            self.decision = KvAdvance.PER_SEQUENCE
            self.messages.append("INFO ARC_MTP_PER_SEQ_KV: MTP KV advance is PerSequence")
        else:
            self.decision = KvAdvance.COHORT
            self.refusal = str(refusal)
            self.messages.append(
                f"WARN ARC_MTP_PER_SEQ_KV requests per-sequence KV advance, but this pipeline "
                f"cannot honour it: {refusal}; using the cohort rule")
        return self.decision
