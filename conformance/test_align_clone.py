"""Batch assembly (cache-and-draft.md §5; masks-and-scheduling.md §14): the uniformity checks
and the ragged capability, `clone_in_cache` (strip pending -> capability -> align -> ensure
uniform -> stack), `clone_out_cache`, `clone_in_cache_reporting_lead` and the eager / lazy
strip policies.

The checks and `clone_in_cache*` are the reference's functions; the port runs them on its own
slots with its own layer assembly (`gpu.slots.stack_layer`), so those tests run one body over
both (`over_kv`), reading the batched K/V back front-aligned. `clone_out_cache` and the
reference's own concatenation are the reference's alone (the port's clone-out hands out row
handles: test_slots.py). Expected values come from the spec's worked examples or from oracles
written here; lengths are read back off the slots."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from raggedspec.conformance.helpers import REF_KV, draft_slot, k_row, over_kv, seq
from raggedspec.reference.align import (
    CloneIn,
    batch_can_be_ragged,
    clone_in_cache,
    clone_in_cache_reporting_lead,
    clone_out_cache,
    concat_kv,
    drop_dead_prefix,
    ensure_uniform_batch_cache_lens,
    first_mismatched_cache_len,
    front_pad_kv_cache,
)
from raggedspec.reference.cache import KvCache, NormalCache, OtherSlot, SingleCache
from raggedspec.reference.errors import AlignRefusal, CacheRefusal
from raggedspec.reference.xs_rolling import XsRolling

kv_slot, xs_slot = REF_KV.slot, REF_KV.xs


def batched_k(impl, slot, row: int) -> list[float]:
    """Row `row`, head 0, feature 0 of a batched slot's front-aligned K."""
    return impl.k(slot)[row, 0, :, 0].tolist()


# --- §5.1 / §14 uniformity and capability ---------------------------------------------------

@pytest.mark.rule("first_mismatched_cache_len")
@over_kv
def test_first_mismatched_cache_len_names_layer_expected_got_and_sequence(impl):
    def s(*lens):
        return seq(list(lens), impl=impl)

    assert first_mismatched_cache_len([s(5, 5), s(5, 5), s(5, 7)], False) == (1, 5, 7, 2)
    assert first_mismatched_cache_len([s(5, 5), s(5, 5)], False) is None
    assert first_mismatched_cache_len([s(5)], False) is None
    assert first_mismatched_cache_len([], False) is None
    # sequences in order, layers within each: sequence 1's layer 1 before sequence 2's layer 0
    assert first_mismatched_cache_len([s(5, 5), s(5, 6), s(4, 5)], False) == (1, 5, 6, 1)
    with pytest.raises(ValueError, match=r"^sequence 1 has 1 slots, sequence 0 has 2$"):
        first_mismatched_cache_len([s(4, 4), s(4)], False)


@pytest.mark.rule("first_mismatched_cache_len")
@over_kv
def test_first_mismatched_cache_len_skips_xs_slots_only_with_the_flag_on(impl):
    a = NormalCache([impl.slot(8, 1), impl.xs(9)])
    b = NormalCache([impl.slot(8, 2), impl.xs(7)])
    assert first_mismatched_cache_len([a, b], True) is None
    assert first_mismatched_cache_len([a, b], False) == (1, 9, 7, 1)
    # skipped in any layer where either side is xs
    a = NormalCache([impl.xs(9), impl.slot(8, 1)])
    b = NormalCache([impl.xs(7), impl.slot(6, 2)])
    assert first_mismatched_cache_len([a, b], True) == (1, 8, 6, 1)
    assert first_mismatched_cache_len([NormalCache([impl.slot(8, 1)]),
                                       NormalCache([impl.xs(6)])], True) is None


@pytest.mark.rule("ensure_uniform_batch_cache_lens")
@over_kv
def test_ensure_uniform_batch_cache_lens_refuses_naming_the_values(impl):
    ensure_uniform_batch_cache_lens([seq([5, 5], impl=impl), seq([5, 5], impl=impl)], False)
    with pytest.raises(AlignRefusal) as e:
        ensure_uniform_batch_cache_lens([seq([5, 5], impl=impl), seq([5, 5], impl=impl),
                                         seq([5, 7], impl=impl)], False)
    assert str(e.value) == ("sequences in one batch must share current_seq_len: layer 1 "
                            "expected 5 (sequence 0) but sequence 2 has 7")


@pytest.mark.rule("batch_can_be_ragged / ragged_decode_supported")
@over_kv
def test_batch_can_be_ragged_requires_every_slot_to_carry_its_own_length(impl):
    assert batch_can_be_ragged([seq([5, 5], impl=impl), seq([7, 7], impl=impl)], False)
    for kind in ("Rotating", "TurboQuant"):
        assert not batch_can_be_ragged(
            [seq([5], impl=impl), NormalCache([impl.slot(5, 1), OtherSlot(kind, 5)])], True
        )
    v4 = [NormalCache([impl.slot(5, 1), impl.xs(5)]), NormalCache([impl.slot(3, 1),
                                                                  impl.xs(3)])]
    assert not batch_can_be_ragged(v4, False)
    assert batch_can_be_ragged(v4, True)


# --- §5.2-§5.5 clone_in -----------------------------------------------------------------------

@pytest.mark.rule("clone_in_cache", "the port's per-sequence caches and clone-in")
@over_kv
def test_clone_in_cache_front_aligns_a_ragged_batch_and_publishes_the_leads(impl):
    a, b = seq([12, 12], mark=100, impl=impl), seq([10, 10], mark=500, impl=impl)
    out = clone_in_cache([a, b], [], False, impl.stack_layer)
    assert isinstance(out, CloneIn)
    assert out.lead_pad == [0, 2] and out.ragged_decode_supported
    layer0 = out.batched.slots[0]
    assert layer0.current_seq_len == 12 and impl.k(layer0).shape[0] == 2
    assert batched_k(impl, layer0, 1) == [0, 0] + list(range(500, 510))
    assert batched_k(impl, layer0, 0) == list(range(100, 112))


@pytest.mark.rule("clone_in_cache")
@over_kv
def test_clone_in_cache_publishes_none_for_a_uniform_batch(impl):
    out = clone_in_cache([seq([9, 9], impl=impl), seq([9, 9], impl=impl)], [0, 0], False,
                         impl.stack_layer)
    assert out.lead_pad is None and out.ragged_decode_supported
    assert out.batched.current_seq_len == 9


@pytest.mark.rule("ensure_uniform_batch_cache_lens", "clone_in_cache")
@over_kv
def test_clone_in_cache_refuses_a_ragged_batch_that_cannot_be_ragged(impl):
    a = NormalCache([impl.slot(12, 1), OtherSlot("Rotating", 12)])
    b = NormalCache([impl.slot(10, 2), OtherSlot("Rotating", 10)])
    held = impl.held(b.slots[0])
    with pytest.raises(
        AlignRefusal, match="sequences in one batch must share current_seq_len"
    ) as e:
        clone_in_cache([a, b], [], True, impl.stack_layer)
    assert "12" in str(e.value) and "10" in str(e.value)
    assert impl.held(b.slots[0]) == held  # not aligned


@pytest.mark.rule("front_align_would_succeed", "clone_in_cache")
@over_kv
def test_clone_in_cache_checks_would_succeed_before_touching_anything(impl):
    a, b = seq([12], mark=1, impl=impl), seq([5], mark=2, impl=impl)
    c = seq([10], mark=3, impl=impl, max_seq_len=11)
    held = [impl.held(s) for x in (a, b, c) for s in x.slots]
    with pytest.raises(AlignRefusal, match="sequences in one batch must share current_seq_len"):
        clone_in_cache([a, b, c], [], False, impl.stack_layer)
    assert held == [impl.held(s) for x in (a, b, c) for s in x.slots]


@pytest.mark.rule("clone_in_cache")
@over_kv
def test_clone_in_cache_takes_the_batched_length_from_the_first_sequence_with_xs_rows_ragged(
        impl):
    a = NormalCache([impl.slot(9, 1), impl.xs(9)])
    b = NormalCache([impl.slot(9, 2), impl.xs(6)])
    out = clone_in_cache([a, b], [], True, impl.stack_layer)
    assert out.lead_pad is None  # the K/V slots agree; xs rows carry their own
    assert out.batched.slots[0].current_seq_len == 9
    assert out.batched.slots[1].current_seq_len == 9
    assert [int(t) for t in out.batched.slots[1].tokens] == [9, 6]


@pytest.mark.rule("clone_in_cache_reporting_lead")
@over_kv
def test_the_eager_policy_keeps_the_xs_flag_for_alignment_and_assembly(impl):
    a = NormalCache([impl.slot(12, 100), impl.xs(12)])
    b = NormalCache([impl.slot(10, 500), impl.xs(10)])
    out = clone_in_cache_reporting_lead([a, b], [], True, True, impl.stack_layer)
    assert out.lead_pad == [0, 2] and out.ragged_decode_supported is True
    assert [int(t) for t in out.batched.slots[1].tokens] == [12, 10]
    assert batched_k(impl, out.batched.slots[0], 1) == [0, 0] + list(range(500, 510))


@pytest.mark.rule("clone_in_cache_reporting_lead")
@over_kv
def test_clone_in_cache_reporting_lead_aligns_only_under_per_sequence(impl):
    a, b = seq([12, 12], mark=100, impl=impl), seq([10, 10], mark=500, impl=impl)
    out = clone_in_cache_reporting_lead([a, b], [], False, True, impl.stack_layer)
    assert out.lead_pad == [0, 2]
    assert batched_k(impl, out.batched.slots[0], 1) == [0, 0] + list(range(500, 510))
    out = clone_in_cache_reporting_lead([seq([7], impl=impl), seq([7], impl=impl)], [], False,
                                        False, impl.stack_layer)
    assert out.lead_pad == [0, 0]
    uni = [seq([7, 7], impl=impl), seq([7, 7], impl=impl)]
    held = [impl.held(s) for c in uni for s in c.slots]
    out = clone_in_cache_reporting_lead(uni, [], False, True, impl.stack_layer)
    assert out.lead_pad == [0, 0] and held == [impl.held(s) for c in uni for s in c.slots]
    rot = [NormalCache([impl.slot(12, 1), OtherSlot("Rotating", 12)]),
           NormalCache([impl.slot(10, 1), OtherSlot("Rotating", 10)])]
    with pytest.raises(CacheRefusal, match="Rotating"):
        clone_in_cache_reporting_lead(rot, [], True, True, impl.stack_layer)


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


@pytest.mark.rule("batch_can_be_ragged / ragged_decode_supported")
def test_clone_in_cache_publishes_the_capability_for_a_uniform_batch():
    rot = [NormalCache([kv_slot(4, 1), OtherSlot("Rotating", 4)]) for _ in range(2)]
    assert clone_in_cache(rot, [], True).ragged_decode_supported is False
    v4 = [NormalCache([kv_slot(4, 1), xs_slot(4)]) for _ in range(2)]
    assert clone_in_cache([c.clone() for c in v4], [], False).ragged_decode_supported is False
    assert clone_in_cache(v4, [], True).ragged_decode_supported is True


@pytest.mark.rule("clone_in_cache")
def test_empty_and_mismatched_batches_are_malformed_input():
    with pytest.raises(ValueError, match=r"^clone_in_cache needs at least one sequence$"):
        clone_in_cache([], [], False)
    with pytest.raises(ValueError, match=r"^1 pending leads for 2 sequences$"):
        clone_in_cache([seq([4]), seq([4])], [1], False)
    with pytest.raises(ValueError, match=r"^pending lead -1 must be >= 0$"):
        clone_in_cache([seq([4]), seq([4])], [0, -1], False)
    with pytest.raises(ValueError, match=r"^layer 0 mixes slot kinds \['Normal', 'XsRolling'\]$"):
        clone_in_cache([NormalCache([kv_slot(4, 1)]), NormalCache([xs_slot(4)])], [], True)


@pytest.mark.rule("batch concatenation", "clone_in_cache")
def test_clone_in_cache_pads_the_capacity_slack_to_the_batch_max():
    a = seq([10], mark=100, extra=600)   # capacity 1024, stale columns 10..610
    b = seq([10], mark=500)              # capacity 512
    out = clone_in_cache([a, b], [], False)
    k = out.batched.slots[0].k
    assert k.capacity_seq_len == 1024 and k.data.shape == (2, 1, 1024, 1)
    assert np.array_equal(k.data[0], a.slots[0].k.data[0])
    assert np.array_equal(k.data[1, :, :512], b.slots[0].k.data[0]) and not k.data[1, :, 512:].any()
    assert out.batched.current_seq_len == 10


@pytest.mark.rule("batch concatenation")
def test_concatenation_refusals_name_the_mismatch():
    with pytest.raises(ValueError, match=r"^concat_kv needs at least one slot$"):
        concat_kv([])
    bare = KvCache(SingleCache(4096, 16, 4), SingleCache(4096, 16, 4))
    with pytest.raises(ValueError,
                       match=r"^cannot concatenate materialized and unmaterialized slots$"):
        concat_kv([draft_slot(4, 16, 1), bare])
    wide = draft_slot(4, 16, 2)
    wide.k.data = np.zeros((1, 1, 16, 2))
    with pytest.raises(ValueError, match=r"^cannot concatenate buffers of \[H, D, dtype\] "):
        concat_kv([draft_slot(4, 16, 1), wide])


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


@pytest.mark.rule("clone_in_cache")
def test_other_kinds_and_paging_are_carried_through_in_and_out():
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
    caches = [NormalCache([kv_slot(4, 1)], paged=True), NormalCache([kv_slot(4, 2)], paged=True)]
    out = clone_in_cache(caches, [], False)
    assert out.batched.paged is True
    assert [r.paged for r in clone_out_cache(out.batched, 2)] == [True, True]


# --- clone_out and the pending strip ----------------------------------------------------------

@pytest.mark.rule("clone_in_cache", "clone_out_cache")
def test_clone_in_cache_strips_pending_leads_first():
    a, b = seq([12, 12], mark=100), seq([10, 10], mark=500)
    first = clone_in_cache([a, b], [], False)
    rows = clone_out_cache(first.batched, 2)
    assert [r.current_seq_len for r in rows] == [12, 12]  # the batched length, dead prefix included
    again = clone_in_cache(rows, first.lead_pad, False)
    assert again.lead_pad == [0, 2]
    assert [r.current_seq_len for r in rows] == [12, 12]
    rows2 = clone_out_cache(again.batched, 2)
    clone_in_cache([rows2[1]], [2], False)  # strip alone
    assert rows2[1].current_seq_len == 10 and k_row(rows2[1].slots[0]) == list(range(500, 510))


@pytest.mark.rule("clone_in_cache")
def test_clone_in_cache_refuses_a_pending_strip_before_stripping_anything():
    a = seq([12, 12], mark=100)
    front_pad_kv_cache(a.slots[0], 14, False)
    front_pad_kv_cache(a.slots[1], 14, False)
    b = NormalCache([kv_slot(14, 1), OtherSlot("Rotating", 14)])
    with pytest.raises(CacheRefusal, match="sequence 1 slot 1") as e:
        clone_in_cache([a, b], [2, 2], False)
    assert "Rotating" in str(e.value)
    assert a.slots[0].current_seq_len == 14 and b.slots[0].current_seq_len == 14  # nothing stripped


@pytest.mark.rule("clone_out_cache")
def test_clone_out_cache_gives_each_row_the_batched_length_and_capacity():
    a = NormalCache([kv_slot(12, 100), xs_slot(12)])
    b = NormalCache([kv_slot(10, 500), xs_slot(10)])
    out = clone_in_cache([a, b], [], xs_per_seq=True)
    rows = clone_out_cache(out.batched, 2)
    for r in rows:
        assert r.slots[0].current_seq_len == 12 and r.slots[0].k.capacity_seq_len == 512
        assert r.slots[0].k.data.shape == (1, 1, 512, 1)
    assert k_row(rows[1].slots[0]) == [0, 0] + list(range(500, 510))
    assert [r.slots[1].tokens for r in rows] == [[12], [10]]  # xs rows keep their own
    with pytest.raises(ValueError, match=r"^layer 0 holds 2 rows, not 3$"):
        clone_out_cache(out.batched, 3)


@pytest.mark.rule("clone_out_cache")
def test_clone_out_count_check_messages():
    batched = concat_kv([draft_slot(4, 16, 1), draft_slot(4, 16, 2)])
    with pytest.raises(ValueError, match=r"^clone_out_cache needs b >= 1, got 0$"):
        clone_out_cache(NormalCache([batched]), 0)
    xs = XsRolling.stack([xs_slot(4), xs_slot(6)])
    with pytest.raises(ValueError, match=r"^xs layer 0 holds 2 rows, not 3$"):
        clone_out_cache(NormalCache([xs]), 3)


def one_decode_step(batched, rng):
    """Append one column to every slot of a batched cache (a plain decode step)."""
    cols = []
    for slot in batched.slots:
        b = slot.k.data.shape[0]
        new = rng.standard_normal((b, 1, 1, 1))
        slot.append(new, new + 0.25)
        cols.append(new[:, 0, 0, 0])
    return cols


@pytest.mark.rule("strip policy eager vs lazy")
@given(st.lists(st.integers(1, 40), min_size=2, max_size=5), st.integers(0, 2**32 - 1))
def test_eager_and_lazy_strip_policies_give_every_row_its_own_length(lens, seed):
    """§5.5: under either policy a row's recorded length is its own; recording the padded
    width instead (no strip) re-converges every row onto the batch width."""
    originals = [seq([n, n], mark=1000 * i) for i, n in enumerate(lens)]
    ragged = len(set(lens)) > 1
    for policy in ("lazy", "eager", "no_strip"):
        caches = [c.clone() for c in originals]
        out = clone_in_cache(caches, [], False)
        lead = out.lead_pad or [0] * len(caches)
        appended = one_decode_step(out.batched, np.random.default_rng(seed))
        rows = clone_out_cache(out.batched, len(caches))
        assert [r.current_seq_len for r in rows] == [max(lens) + 1] * len(rows)  # the batch width
        expected = [
            [list(o.slots[layer].k.data[0, 0, :n, 0]) + [appended[layer][i]] for layer in range(2)]
            for i, (o, n) in enumerate(zip(originals, lens, strict=True))
        ]
        if policy == "eager":  # strip right after Out
            for r, pad in zip(rows, lead, strict=True):
                for slot in r.slots:
                    drop_dead_prefix(slot, pad)
            for i, r in enumerate(rows):
                assert r.current_seq_len == lens[i] + 1
                assert [k_row(slot) for slot in r.slots] == expected[i]
        elif policy == "lazy":  # the next In strips the pending leads, then re-aligns
            again = clone_in_cache(rows, lead, False)
            assert again.lead_pad == (lead if ragged else None)  # the spread kept, not compounded
            for i in range(len(rows)):
                for layer, slot in enumerate(again.batched.slots):
                    assert list(slot.k.data[i, 0, lead[i]: max(lens) + 1, 0]) == expected[i][layer]
        else:  # negative control: record the padded width as each row's own
            again = clone_in_cache(rows, [], False)
            assert again.lead_pad is None and again.batched.current_seq_len == max(lens) + 1
            if ragged:
                assert any(list(rows[i].slots[0].k.data[0, 0, : lens[i] + 1, 0]) != expected[i][0]
                           for i in range(len(rows)))
