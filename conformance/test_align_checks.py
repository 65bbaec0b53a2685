"""Front pad / strip and batch assembly at their edges (cache-and-draft.md §4, §5, §9.6-§9.8):
the malformed-input messages, the integer refusal rules at their boundaries, a port's K/V slot
going through the shared checks, unmaterialized and non-Normal slots through clone_out and the
draft split, what is carried over as is (dtype, retain window, paged, the first member's
metadata), and the checks of both halves of a slot made before either changes.

Expected values come from the rules' stated messages and from slots built here; lengths and
contents are read back off the slots, never recomputed with the module's formulas."""

import numpy as np
import pytest

from raggedspec.conformance.test_align import draft_slot, k_row, kv_slot, seq, xs_slot
from raggedspec.reference.align import (
    _chunk_sizes,
    clone_in_cache,
    clone_in_cache_reporting_lead,
    clone_out_cache,
    concat_kv,
    draft_caches_batchable,
    draft_group_target,
    drop_dead_prefix,
    drop_front_refusal,
    drop_front_single,
    first_mismatched_cache_len,
    front_align_batch,
    front_align_draft_group,
    front_pad_kv_cache,
    front_pad_refusal,
    front_pad_single,
    split_draft_cache,
)
from raggedspec.reference.cache import KvCache, NormalCache, OtherSlot, SingleCache
from raggedspec.reference.errors import AlignRefusal, CacheRefusal
from raggedspec.reference.xs_rolling import XsRolling


def bare_kv(live, cap=16, max_seq_len=4096, first_cached=0, retain=None):
    """A Normal slot whose two halves are unmaterialized (no buffer yet)."""
    return KvCache(SingleCache(max_seq_len, cap, live, first_cached, retain),
                   SingleCache(max_seq_len, cap, live, first_cached, retain))


def meta(sc):
    return (sc.max_seq_len, sc.capacity_seq_len, sc.current_seq_len, sc.first_cached,
            sc.retain_window)


class PortSlot:
    """A port's K/V slot: kind Normal, its own layout; it records what the shared checks
    and moves ask of it."""

    kind = "Normal"

    def __init__(self, live, refusal=None):
        self.current_seq_len = live
        self.refusal = refusal
        self.calls = []

    def pad_refusal(self, target):
        self.calls.append(("pad_refusal", target))
        return self.refusal

    def front_pad(self, target):
        self.calls.append(("front_pad", target))
        return target - self.current_seq_len

    def drop_refusal(self, lead):
        self.calls.append(("drop_refusal", lead))
        return self.refusal

    def drop_front(self, lead):
        self.calls.append(("drop_front", lead))


# --- malformed input: ValueError with the stated message -----------------------------------

@pytest.mark.rule("front_pad_single")
def test_negative_targets_and_leads_are_malformed_input():
    with pytest.raises(ValueError, match=r"^front_pad target -1 must be >= 0$"):
        front_pad_single(kv_slot(3, 1).k, -1)
    with pytest.raises(ValueError, match=r"^front_pad target -2 must be >= 0$"):
        front_pad_kv_cache(kv_slot(3, 1), -2, False)
    with pytest.raises(ValueError, match=r"^dead-prefix lead -1 must be >= 0$"):
        drop_front_single(kv_slot(3, 1).k, -1)
    with pytest.raises(ValueError, match=r"^dead-prefix lead -3 must be >= 0$"):
        drop_dead_prefix(kv_slot(3, 1), -3)


@pytest.mark.rule("front_pad_kv_cache")
def test_a_slot_whose_halves_disagree_is_malformed_input():
    kv = kv_slot(4, 1)
    kv.v.current_seq_len = 2
    with pytest.raises(ValueError, match=r"^K length 4 and V length 2 disagree$"):
        front_pad_kv_cache(kv, 6, False)


@pytest.mark.rule("clone_in_cache")
def test_empty_and_mismatched_batches_are_malformed_input():
    with pytest.raises(ValueError, match=r"^clone_in_cache needs at least one sequence$"):
        clone_in_cache([], [], False)
    with pytest.raises(ValueError, match=r"^concat_kv needs at least one slot$"):
        concat_kv([])
    with pytest.raises(ValueError, match=r"^1 pending leads for 2 sequences$"):
        clone_in_cache([seq([4]), seq([4])], [1], False)
    with pytest.raises(ValueError, match=r"^pending lead -1 must be >= 0$"):
        clone_in_cache([seq([4]), seq([4])], [0, -1], False)
    with pytest.raises(ValueError, match=r"^sequence 1 has 1 slots, sequence 0 has 2$"):
        first_mismatched_cache_len([seq([4, 4]), seq([4])], False)
    with pytest.raises(ValueError, match=r"^layer 0 mixes slot kinds \['Normal', 'XsRolling'\]$"):
        clone_in_cache([NormalCache([kv_slot(4, 1)]), NormalCache([xs_slot(4)])], [], True)


@pytest.mark.rule("batch concatenation")
def test_concatenation_refusals_name_the_mismatch():
    with pytest.raises(ValueError,
                       match=r"^cannot concatenate materialized and unmaterialized slots$"):
        concat_kv([draft_slot(4, 16, 1), bare_kv(4)])
    wide = draft_slot(4, 16, 2)
    wide.k.data = np.zeros((1, 1, 16, 2))
    with pytest.raises(ValueError, match=r"^cannot concatenate buffers of \[H, D, dtype\] "):
        concat_kv([draft_slot(4, 16, 1), wide])


@pytest.mark.rule("clone_out_cache")
def test_clone_out_and_split_count_check_messages():
    batched = concat_kv([draft_slot(4, 16, 1), draft_slot(4, 16, 2)])
    with pytest.raises(ValueError, match=r"^layer 0 holds 2 rows, not 3$"):
        clone_out_cache(NormalCache([batched]), 3)
    with pytest.raises(ValueError, match=r"^clone_out_cache needs b >= 1, got 0$"):
        clone_out_cache(NormalCache([batched]), 0)
    xs = XsRolling.stack([xs_slot(4), xs_slot(6)])
    with pytest.raises(ValueError, match=r"^xs layer 0 holds 2 rows, not 3$"):
        clone_out_cache(NormalCache([xs]), 3)
    with pytest.raises(ValueError, match=r"^split_draft_cache needs g >= 1, got 0$"):
        split_draft_cache(batched, 0)


@pytest.mark.rule("front_align_draft_group")
def test_draft_group_checks_messages_and_zero_starts():
    with pytest.raises(ValueError, match=r"^chain starts \[3, -1\] must be >= 0$"):
        draft_group_target(["Normal", "Normal"], [True, True], [5, 5], [3, -1])
    assert draft_group_target(["Normal", "Normal"], [True, True], [5, 5], [0, 0]) == 0
    with pytest.raises(AlignRefusal, match=r"^front_align_draft_group was given no rows "
                                           r"\(0 caches, 0 chain starts\)$"):
        front_align_draft_group([], [])


@pytest.mark.rule("front_align_draft_group")
def test_the_integer_checks_take_one_entry_per_member():
    with pytest.raises(ValueError):
        draft_caches_batchable(["Normal", "Normal"], [True], [(4, 16), (4, 16)])
    with pytest.raises(ValueError):
        draft_caches_batchable(["Normal", "Normal"], [True, True], [(4, 16)])
    with pytest.raises(ValueError):
        draft_group_target(["Normal", "Normal"], [True], [5, 5], [3, 3])
    with pytest.raises(ValueError):
        draft_group_target(["Normal", "Normal"], [True, True], [5], [3, 3])


# --- the integer refusal rules at their boundaries -----------------------------------------

@pytest.mark.rule("front_pad_single")
def test_a_slot_that_evicted_even_one_position_is_windowed():
    assert str(front_pad_refusal(3, 5, True, 1, 16, 4096)) == (
        "front_pad to 5: a windowed slot (first cached 1) cannot be front-padded")
    assert front_pad_refusal(3, 5, True, 0, 16, 4096) is None
    assert str(drop_front_refusal(2, 10, True, 16, 1)) == (
        "cannot drop a 2-column dead prefix from a windowed slot (first cached 1)")
    assert drop_front_refusal(2, 10, True, 16, 0) is None


@pytest.mark.rule("drop_front_single")
def test_drop_front_refusal_messages():
    assert str(drop_front_refusal(2, 4, False, 0, 0)) == (
        "cannot drop a 2-column dead prefix from an unmaterialized slot (4 positions)")
    assert str(drop_front_refusal(5, 4, True, 16, 0)) == (
        "cannot drop a 5-column dead prefix from a slot that holds only 4")
    assert str(drop_front_refusal(1, 4, True, 3, 0)) == (
        "cannot drop a 1-column dead prefix: buffer width 3 < current 4")


# --- both halves are checked before either changes -------------------------------------------

@pytest.mark.rule("front_pad_kv_cache")
def test_a_v_half_that_cannot_be_padded_leaves_the_k_half_untouched():
    kv = kv_slot(4, 100)
    kv.v.max_seq_len = 5  # K may grow to 6, V may not
    k_buf = kv.k.data
    with pytest.raises(CacheRefusal, match="above max_seq_len 5"):
        front_pad_kv_cache(kv, 6, False)
    assert kv.k.data is k_buf and kv.k.current_seq_len == 4


@pytest.mark.rule("drop_dead_prefix")
def test_a_v_half_that_cannot_be_stripped_leaves_the_k_half_untouched():
    kv = kv_slot(4, 100)
    front_pad_kv_cache(kv, 6, False)
    kv.v.data = None  # V lost its buffer: the strip must refuse before K moves
    k_buf = kv.k.data
    with pytest.raises(CacheRefusal, match="unmaterialized"):
        drop_dead_prefix(kv, 2)
    assert kv.k.data is k_buf and kv.k.current_seq_len == 6


# --- a port's K/V slot goes through the same checks --------------------------------------

@pytest.mark.rule("drop_dead_prefix")
def test_a_port_slot_is_asked_with_the_target_and_the_lead():
    slot = PortSlot(4)
    assert front_pad_kv_cache(slot, 7, False) == 3
    drop_dead_prefix(slot, 3)
    assert slot.calls == [("pad_refusal", 7), ("front_pad", 7), ("drop_refusal", 3),
                          ("drop_front", 3)]
    refusing = PortSlot(4, CacheRefusal("no room"))
    with pytest.raises(CacheRefusal, match="no room"):
        front_pad_kv_cache(refusing, 7, False)
    with pytest.raises(CacheRefusal, match="no room"):
        drop_dead_prefix(refusing, 2)
    assert refusing.calls == [("pad_refusal", 7), ("drop_refusal", 2)]


@pytest.mark.rule("clone_in_cache")
def test_clone_in_cache_hands_every_layer_to_the_given_stack_layer():
    seen = []

    def stack(slots, layer, xs_per_seq):
        seen.append(([s.current_seq_len for s in slots], layer, xs_per_seq))
        return slots[0]

    clone_in_cache([seq([5, 6]), seq([5, 6])], [], True, stack_layer=stack)
    assert seen == [([5, 5], 0, True), ([6, 6], 1, True)]
    seen.clear()
    out = clone_in_cache_reporting_lead([seq([5, 6]), seq([3, 4])], [], False, True, stack)
    # T = 6, the widest slot of any sequence; sequence 1's lead is its last slot's, 6 - 4
    assert seen == [([6, 6], 0, False), ([6, 6], 1, False)] and out.lead_pad == [0, 2]


# --- leads, capability and refusals of the two In policies ---------------------------------

@pytest.mark.rule("front_align_batch")
def test_a_sequence_without_a_kv_slot_has_lead_zero():
    assert front_align_batch([NormalCache([xs_slot(12)]), NormalCache([xs_slot(10)])],
                             True) == [0, 0]
    assert front_align_batch([NormalCache([]), NormalCache([])], False) == [0, 0]
    assert front_align_batch([], False) == []


@pytest.mark.rule("first_mismatched_cache_len")
def test_xs_slots_are_skipped_in_any_layer_where_either_side_is_xs():
    a = NormalCache([xs_slot(9), kv_slot(8, 1)])
    b = NormalCache([xs_slot(7), kv_slot(6, 2)])
    assert first_mismatched_cache_len([a, b], True) == (1, 8, 6, 1)
    assert first_mismatched_cache_len([NormalCache([kv_slot(8, 1)]),
                                       NormalCache([xs_slot(6)])], True) is None


@pytest.mark.rule("clone_in_cache_reporting_lead")
def test_the_eager_policy_keeps_the_xs_flag_for_alignment_and_assembly():
    a = NormalCache([kv_slot(12, 100), xs_slot(12)])
    b = NormalCache([kv_slot(10, 500), xs_slot(10)])
    out = clone_in_cache_reporting_lead([a, b], [], True, per_sequence=True)
    assert out.lead_pad == [0, 2] and out.ragged_decode_supported is True
    assert out.batched.slots[1].tokens == [12, 10]


@pytest.mark.rule("clone_in_cache_reporting_lead")
def test_without_per_sequence_the_lazy_alignment_leads_are_reported():
    a, b = seq([12], mark=100), seq([10], mark=500)
    out = clone_in_cache_reporting_lead([a, b], [], False, per_sequence=False)
    assert out.lead_pad == [0, 2] and out.ragged_decode_supported is True
    assert k_row(out.batched.slots[0], 12) == list(range(100, 112))
    rot = [NormalCache([kv_slot(12, 1), OtherSlot("Rotating", 12)]),
           NormalCache([kv_slot(10, 1), OtherSlot("Rotating", 10)])]
    with pytest.raises(AlignRefusal, match="sequences in one batch must share current_seq_len"):
        clone_in_cache_reporting_lead(rot, [], True, per_sequence=False)
    uni = [NormalCache([kv_slot(4, 1), OtherSlot("Rotating", 4)]) for _ in range(2)]
    out = clone_in_cache_reporting_lead(uni, [], True, per_sequence=False)
    assert out.lead_pad == [0, 0] and out.ragged_decode_supported is False


@pytest.mark.rule("clone_in_cache")
def test_with_the_flag_off_xs_bases_are_reconciled_on_assembly():
    a = XsRolling(4, window=32)
    a.append_rows(np.arange(40, dtype=np.float64).reshape(1, 40, 1))
    a.set_len(30)
    b = XsRolling(4, window=32)
    b.append_rows(np.arange(30, dtype=np.float64).reshape(1, 30, 1))
    assert a.tokens == b.tokens == [30] and a.base != b.base
    bases = [a.base[0], b.base[0]]
    off = clone_in_cache([NormalCache([a.clone()]), NormalCache([b.clone()])], [], False)
    assert off.batched.slots[0].base == [max(bases)] * 2
    on = clone_in_cache([NormalCache([a]), NormalCache([b])], [], True)
    assert on.batched.slots[0].base == bases


# --- what assembly and the splits carry over -----------------------------------------------

@pytest.mark.rule("clone_in_cache")
def test_other_kinds_are_kept_as_a_length_record_through_in_and_out():
    one = clone_in_cache([NormalCache([kv_slot(4, 1), OtherSlot("TurboQuant", 4)])], [], True)
    rec = one.batched.slots[1]
    assert (rec.kind, rec.current_seq_len) == ("TurboQuant", 4)
    rows = clone_out_cache(one.batched, 1)
    assert len(rows) == 1 and k_row(rows[0].slots[0]) == [1, 2, 3, 4]
    two = clone_in_cache([NormalCache([OtherSlot("Rotating", 7)]) for _ in range(2)], [], True)
    rows = clone_out_cache(two.batched, 2)
    for r in rows:
        assert (r.slots[0].kind, r.slots[0].current_seq_len) == ("Rotating", 7)
    assert rows[0].slots[0] is not rows[1].slots[0]


@pytest.mark.rule("clone_in_cache")
def test_paged_is_carried_through_in_and_out():
    caches = [NormalCache([kv_slot(4, 1)], paged=True), NormalCache([kv_slot(4, 2)], paged=True)]
    out = clone_in_cache(caches, [], False)
    assert out.batched.paged is True
    assert [r.paged for r in clone_out_cache(out.batched, 2)] == [True, True]


@pytest.mark.rule("clone_out_cache")
def test_unmaterialized_slots_split_into_metadata_copies():
    batched = concat_kv([bare_kv(6, 16, 900, 2, 8), bare_kv(6, 16, 900, 2, 8)])
    assert batched.k.data is None and batched.v.data is None
    assert meta(batched.k) == (900, 16, 6, 2, 8)
    for rows in (clone_out_cache(NormalCache([batched]), 2), split_draft_cache(batched, 2)):
        assert len(rows) == 2
        for r in rows:
            slot = r.slots[0] if isinstance(r, NormalCache) else r
            for half in (slot.k, slot.v):
                assert half.data is None and meta(half) == (900, 16, 6, 2, 8)


@pytest.mark.rule("clone_out_cache")
def test_dtype_and_retain_window_are_carried_over():
    def f32(live, cap, mark, retain):
        k = (np.arange(cap, dtype=np.float32) + mark).reshape(1, 1, cap, 1)
        return KvCache(SingleCache(4096, cap, live, 0, retain, k.copy()),
                       SingleCache(4096, cap, live, 0, retain, k + 1000))

    out = concat_kv([f32(4, 16, 1, 8), f32(4, 32, 2, 8)])
    assert out.k.data.dtype == np.float32 and out.v.data.dtype == np.float32
    assert out.k.retain_window == 8 and out.k.data.shape == (2, 1, 32, 1)
    assert [r.k.retain_window for r in split_draft_cache(out, 2)] == [8, 8]
    assert [r.slots[0].v.retain_window for r in clone_out_cache(NormalCache([out]), 2)] == [8, 8]
    sc = f32(4, 16, 1, None).k
    front_pad_single(sc, 6)
    assert sc.data.dtype == np.float32 and list(sc.data[0, 0, :6, 0]) == [0, 0, 1, 2, 3, 4]


@pytest.mark.rule("split_draft_cache and the draft strip")
def test_split_draft_cache_chunks_more_rows_than_pieces_by_candle_sizes():
    assert _chunk_sizes(2, 3) == [1, 1]
    assert _chunk_sizes(5, 2) == [3, 2]
    assert _chunk_sizes(7, 3) == [3, 2, 2]
    batched = concat_kv([draft_slot(4, 8, 100 * m) for m in range(5)])
    rows = split_draft_cache(batched, 2)
    assert [r.k.data.shape[0] for r in rows] == [3, 2]
    assert [list(r.k.data[j, 0, :4, 0]) for r in rows for j in range(r.k.data.shape[0])] == [
        [100 * m + i for i in range(4)] for m in range(5)]


@pytest.mark.rule("split_draft_cache and the draft strip")
def test_split_draft_cache_gives_none_when_only_one_half_has_too_few_rows():
    batched = concat_kv([draft_slot(4, 8, 1), draft_slot(4, 8, 2)])
    batched.v.data = batched.v.data[:1]
    assert split_draft_cache(batched, 2) is None


@pytest.mark.rule("front_align_draft_group")
def test_a_draft_row_with_one_half_unmaterialized_is_refused():
    half = draft_slot(9, 16, 200)
    half.v.data = None
    with pytest.raises(AlignRefusal, match=r"^draft row 1's buffer is unmaterialized$"):
        front_align_draft_group([draft_slot(9, 16, 100), half], [7, 4])
