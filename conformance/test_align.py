"""Front pad / strip and batch assembly (cache-and-draft.md §4, §5; masks-and-scheduling.md
§14). Draft-group alignment (§9.6-§9.8, §17.3) is in test_align_draft.py.

Expected values come from the spec's worked examples or from oracles written here (a copy of
each row's slot taken before alignment, plain Python lists of column values). Lengths are read
back off the slots and content out of the tensors, never recomputed from the code's formulas."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from raggedspec.reference.align import (
    CloneIn,
    batch_can_be_ragged,
    clone_in_cache,
    clone_in_cache_reporting_lead,
    clone_out_cache,
    drop_dead_prefix,
    drop_front_single,
    ensure_uniform_batch_cache_lens,
    first_mismatched_cache_len,
    front_align_batch,
    front_align_would_succeed,
    front_pad_kv_cache,
    front_pad_single,
)
from raggedspec.reference.cache import KvCache, NormalCache, OtherSlot, SingleCache
from raggedspec.reference.errors import AlignRefusal, CacheRefusal
from raggedspec.reference.xs_rolling import XsRolling

# --- fixtures -------------------------------------------------------------------------------


def draft_slot(live, cap, mark):
    """§17.1: a Normal slot, K [1,1,cap,1] holding mark+i, V holding mark+1000+i, max 4096."""
    k = np.arange(cap, dtype=np.float64).reshape(1, 1, cap, 1) + mark
    return KvCache(SingleCache(4096, cap, live, 0, None, k.copy()),
                   SingleCache(4096, cap, live, 0, None, k + 1000))


def kv_slot(length, mark, extra=0, max_seq_len=4096, h=1, d=1):
    """A Normal slot built by appending `length + extra` columns (column j holds mark + j in
    K, mark + 0.5 + j in V) and setting the length back to `length` (stale columns beyond)."""
    kv = KvCache.new_normal(max_seq_len)
    n = length + extra
    k = np.broadcast_to(
        np.arange(n, dtype=np.float64)[None, None, :, None] + mark, (1, h, n, d)
    ).copy()
    kv.append(k, k + 0.5)
    kv.set_len(length)
    return kv


def seq(lengths, mark=0, **kw):
    """A NormalCache with one Normal slot per entry of `lengths`."""
    return NormalCache([kv_slot(n, mark + 10_000 * layer, **kw) for layer, n in enumerate(lengths)])


def k_row(slot, n=None):
    """Column values of row 0, head 0, feature 0 of K, the first n (default current) columns."""
    n = slot.current_seq_len if n is None else n
    return list(slot.k.data[0, 0, :n, 0])


def xs_slot(tokens):
    xs = XsRolling(4, window=32)
    if tokens:
        xs.append_rows(np.arange(tokens, dtype=np.float64).reshape(1, tokens, 1))
    return xs


# --- §4.1 front_pad_single -----------------------------------------------------------------

@pytest.mark.rule("front_pad_single")
def test_front_pad_single_moves_the_live_run_to_the_end_with_zeros_in_front():
    sc = kv_slot(10, 100, extra=5).k
    lead = front_pad_single(sc, 12)
    assert lead == 2
    assert (sc.current_seq_len, sc.capacity_seq_len) == (12, 512)
    assert list(sc.data[0, 0, :12, 0]) == [0, 0] + list(range(100, 110))
    assert not sc.data[:, :, 12:].any()  # the stale columns are not carried


@pytest.mark.rule("front_pad_single")
def test_front_pad_single_lead_zero_touches_no_buffer():
    sc = kv_slot(10, 100, extra=5).k
    buf = sc.data
    assert front_pad_single(sc, 10) == 0
    assert sc.data is buf and sc.capacity_seq_len == 512 and sc.current_seq_len == 10
    empty = SingleCache(4096, 16)
    assert front_pad_single(empty, 0) == 0 and empty.data is None  # lead 0 before the buffer check


@pytest.mark.rule("front_pad_single")
def test_front_pad_single_refuses_a_target_shorter_than_live():
    sc = kv_slot(10, 100).k
    with pytest.raises(CacheRefusal, match="front_pad to 5 is shorter than the 10 live positions"):
        front_pad_single(sc, 5)


@pytest.mark.rule("front_pad_single")
def test_front_pad_single_refuses_an_unmaterialized_buffer():
    with pytest.raises(CacheRefusal, match="unmaterialized"):
        front_pad_single(SingleCache(4096, 16, current_seq_len=3), 5)


@pytest.mark.rule("front_pad_single")
def test_front_pad_single_refuses_a_capacity_above_max_seq_len():
    sc = kv_slot(10, 100, max_seq_len=600).k
    with pytest.raises(CacheRefusal, match="above max_seq_len") as e:
        front_pad_single(sc, 601)
    assert "601" in str(e.value) and "600" in str(e.value)
    assert sc.current_seq_len == 10 and sc.capacity_seq_len == 512
    assert front_pad_single(sc, 600) == 590 and sc.capacity_seq_len == 600


@pytest.mark.rule("front_pad_single")
def test_front_pad_single_keeps_a_capacity_wider_than_the_target():
    sc = kv_slot(10, 100, extra=600).k
    assert sc.capacity_seq_len == 1024
    front_pad_single(sc, 12)
    assert sc.capacity_seq_len == 1024 and sc.data.shape[2] == 1024


@pytest.mark.rule("front_pad_single")
def test_front_pad_single_refuses_a_windowed_slot_that_evicted_its_front():
    sc = SingleCache(4096, 512, retain_window=8)
    sc.append(np.zeros((1, 1, 140, 1)))
    sc.append(np.zeros((1, 1, 1, 1)))
    assert sc.first_cached == 128
    with pytest.raises(CacheRefusal, match="windowed"):
        front_pad_single(sc, 150)


# --- §4.2 front_pad_kv_cache ---------------------------------------------------------------

@pytest.mark.rule("front_pad_kv_cache")
def test_front_pad_kv_cache_pads_both_halves():
    kv = kv_slot(4, 100)
    assert front_pad_kv_cache(kv, 7, xs_per_seq=False) == 3
    assert k_row(kv) == [0, 0, 0, 100, 101, 102, 103]
    assert list(kv.v.data[0, 0, :7, 0]) == [0, 0, 0, 100.5, 101.5, 102.5, 103.5]
    assert kv.v.current_seq_len == 7


@pytest.mark.rule("front_pad_kv_cache")
def test_front_pad_kv_cache_on_an_xs_slot_is_refused_with_the_flag_off_and_a_no_op_with_it_on():
    xs = xs_slot(13)
    with pytest.raises(CacheRefusal, match="XsRolling") as e:
        front_pad_kv_cache(xs, 20, xs_per_seq=False)
    assert "ARC_V4_XS_PER_SEQ" in str(e.value)
    tail, comp = xs.tail, xs.comp
    assert front_pad_kv_cache(xs, 20, xs_per_seq=True) == 0
    assert xs.tokens == [13] and xs.base == [0] and xs.tail is tail and xs.comp is comp


@pytest.mark.rule("front_pad_kv_cache")
@pytest.mark.parametrize("kind", ["Rotating", "TurboQuant"])
def test_front_pad_kv_cache_refuses_other_slot_kinds(kind):
    with pytest.raises(CacheRefusal, match=kind):
        front_pad_kv_cache(OtherSlot(kind, 3), 5, xs_per_seq=True)


# --- §4.3 / §4.4 strip -----------------------------------------------------------------------

@pytest.mark.rule("drop_front_single")
def test_drop_front_single_narrows_to_width_minus_lead():
    sc = kv_slot(10, 100).k
    front_pad_single(sc, 12)
    drop_front_single(sc, 2)
    assert (sc.current_seq_len, sc.capacity_seq_len, sc.data.shape[2]) == (
        10,
        510,
        510,
    )  # width - lead, not current - lead
    assert list(sc.data[0, 0, :10, 0]) == list(range(100, 110))


@pytest.mark.rule("drop_front_single")
def test_drop_front_single_lead_zero_is_a_no_op():
    sc = kv_slot(10, 100).k
    buf = sc.data
    drop_front_single(sc, 0)
    assert sc.data is buf and (sc.current_seq_len, sc.capacity_seq_len) == (10, 512)


@pytest.mark.rule("drop_front_single")
def test_drop_front_single_refusals():
    sc = kv_slot(12, 100).k
    with pytest.raises(
        CacheRefusal, match="cannot drop a 13-column dead prefix from a slot that holds only 12"
    ):
        drop_front_single(sc, 13)
    assert sc.current_seq_len == 12 and sc.capacity_seq_len == 512
    with pytest.raises(CacheRefusal, match="unmaterialized"):
        drop_front_single(SingleCache(4096, 16, current_seq_len=4), 2)
    narrow = SingleCache(4096, 4, 4, 0, None, np.zeros((1, 1, 4, 1)))
    narrow.data = np.zeros((1, 1, 3, 1))  # a buffer narrower than current
    with pytest.raises(CacheRefusal, match="buffer width 3"):
        drop_front_single(narrow, 1)


@pytest.mark.rule("drop_dead_prefix")
def test_drop_dead_prefix_strips_both_halves():
    kv = kv_slot(4, 100)
    front_pad_kv_cache(kv, 7, False)
    drop_dead_prefix(kv, 3)
    assert (kv.k.current_seq_len, kv.v.current_seq_len) == (4, 4)
    assert k_row(kv) == [100, 101, 102, 103]
    assert list(kv.v.data[0, 0, :4, 0]) == [100.5, 101.5, 102.5, 103.5]


@pytest.mark.rule("drop_dead_prefix")
def test_drop_dead_prefix_is_a_no_op_for_xs_slots_and_lead_zero():
    xs = xs_slot(13)
    tail = xs.tail
    drop_dead_prefix(xs, 5)
    assert xs.tokens == [13] and xs.tail is tail
    kv = kv_slot(4, 100)
    k, v = kv.k.data, kv.v.data
    drop_dead_prefix(kv, 0)
    assert kv.k.data is k and kv.v.data is v and kv.current_seq_len == 4


@pytest.mark.rule("drop_dead_prefix")
def test_drop_dead_prefix_refuses_other_kinds_and_over_long_leads():
    with pytest.raises(CacheRefusal, match="Rotating"):
        drop_dead_prefix(OtherSlot("Rotating", 4), 1)
    kv = kv_slot(4, 100)
    with pytest.raises(
        CacheRefusal, match="cannot drop a 5-column dead prefix from a slot that holds only 4"
    ):
        drop_dead_prefix(kv, 5)
    assert kv.k.current_seq_len == 4 and kv.v.current_seq_len == 4


# --- §4.5 front_align_batch -----------------------------------------------------------------

@pytest.mark.rule("front_align_batch")
def test_front_align_batch_example_lives_12_and_10():
    a, b = seq([12, 12], mark=100), seq([10, 10], mark=500)
    assert front_align_batch([a, b], xs_per_seq=False) == [0, 2]
    for slot in b.slots:
        assert slot.current_seq_len == 12
    assert k_row(b.slots[0]) == [0, 0] + list(range(500, 510))
    assert k_row(a.slots[1]) == list(range(10_100, 10_112))


@pytest.mark.rule("front_align_batch")
def test_front_align_batch_reads_the_lead_from_the_last_non_xs_slot():
    a = NormalCache([kv_slot(12, 100), kv_slot(12, 200), xs_slot(12)])
    b = NormalCache([kv_slot(10, 300), kv_slot(10, 400), xs_slot(10)])
    assert front_align_batch([a, b], xs_per_seq=True) == [0, 2]
    assert b.slots[2].tokens == [10]  # the xs slot carries its own length


@pytest.mark.rule("front_align_batch")
def test_front_align_batch_target_counts_every_slot_including_xs():
    # T = max over all slots of all sequences: sequence 0's xs history is the widest.
    a = NormalCache([kv_slot(10, 100), xs_slot(12)])
    b = NormalCache([kv_slot(8, 300), xs_slot(8)])
    assert front_align_batch([a, b], xs_per_seq=True) == [2, 4]
    assert a.slots[0].current_seq_len == 12 and b.slots[0].current_seq_len == 12


@pytest.mark.rule("front_align_batch")
def test_front_align_batch_refusal_leaves_the_batch_untouched():
    a, b = seq([12, 12], mark=100), seq([5, 5], mark=500)
    c = seq([10, 10], mark=900, max_seq_len=11)
    bufs = [(s.k.data, s.v.data, s.current_seq_len) for x in (a, b, c) for s in x.slots]
    assert not front_align_would_succeed([a, b, c], False)
    with pytest.raises(CacheRefusal, match="above max_seq_len") as e:
        front_align_batch([a, b, c], False)
    assert "sequence 2" in str(e.value)
    assert bufs == [(s.k.data, s.v.data, s.current_seq_len) for x in (a, b, c) for s in x.slots]


@pytest.mark.rule("front_align_would_succeed")
def test_front_align_would_succeed_is_a_non_mutating_check():
    a, b = seq([12], mark=100), seq([10], mark=500)
    buf = b.slots[0].k.data
    assert front_align_would_succeed([a, b], False)
    assert b.slots[0].k.data is buf and b.slots[0].current_seq_len == 10
    assert not front_align_would_succeed(
        [a, NormalCache([kv_slot(10, 1), OtherSlot("Rotating", 10)])], True
    )
    assert not front_align_would_succeed([NormalCache([kv_slot(12, 1), xs_slot(12)]),
                                          NormalCache([kv_slot(10, 1), xs_slot(10)])], False)
    assert front_align_would_succeed([NormalCache([kv_slot(12, 1), xs_slot(12)]),
                                      NormalCache([kv_slot(10, 1), xs_slot(10)])], True)


@st.composite
def normal_batches(draw, uniform=False):
    n_rows = draw(st.integers(1, 6))
    n_layers = draw(st.integers(1, 3))
    if uniform:
        lens = [draw(st.integers(0, 1100))] * n_rows
    else:
        lens = draw(st.lists(st.integers(0, 1100), min_size=n_rows, max_size=n_rows))
    extras = draw(st.lists(st.sampled_from([0, 0, 3, 200, 600]), min_size=n_rows, max_size=n_rows))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    caches = []
    for n, extra in zip(lens, extras, strict=False):
        slots = []
        for _ in range(n_layers):
            kv = KvCache.new_normal(4096)
            k = rng.standard_normal((1, 2, n + extra, 3))
            kv.append(k, rng.standard_normal(k.shape))
            kv.set_len(n)
            slots.append(kv)
        caches.append(NormalCache(slots))
    return caches, lens


@pytest.mark.rule("front_align_batch")
@given(normal_batches())
def test_front_align_batch_ends_every_row_at_t_and_the_strip_undoes_it(batch):
    caches, lens = batch
    before = [c.clone() for c in caches]
    target = max(lens)
    leads = front_align_batch(caches, xs_per_seq=False)
    assert leads == [target - n for n in lens]
    for c, orig, n, lead in zip(caches, before, lens, leads, strict=False):
        for slot, o in zip(c.slots, orig.slots, strict=False):
            for half, oh in ((slot.k, o.k), (slot.v, o.v)):
                assert half.current_seq_len == target
                assert np.array_equal(half.data[:, :, lead:target], oh.data[:, :, :n])  # bit-exact
                assert not half.data[:, :, :lead].any()  # dead prefix zero
                if lead > 0:
                    assert half.capacity_seq_len == max(oh.capacity_seq_len, target)
    for c, lead in zip(caches, leads, strict=False):
        for slot in c.slots:
            drop_dead_prefix(slot, lead)
    for c, orig, n in zip(caches, before, lens, strict=False):
        for slot, o in zip(c.slots, orig.slots, strict=False):
            for half, oh in ((slot.k, o.k), (slot.v, o.v)):
                assert half.current_seq_len == n
                assert np.array_equal(half.data[:, :, :n], oh.data[:, :, :n])


@pytest.mark.rule("front_align_batch")
@given(normal_batches(uniform=True))
def test_front_align_batch_leaves_a_uniform_batch_structurally_untouched(batch):
    caches, lens = batch
    bufs = [(h, h.data, h.capacity_seq_len) for c in caches for s in c.slots for h in (s.k, s.v)]
    assert front_align_batch(caches, xs_per_seq=False) == [0] * len(caches)
    for h, data, cap in bufs:
        assert h.data is data and h.capacity_seq_len == cap and h.current_seq_len == lens[0]


# --- §5.1 / §14 uniformity and capability ---------------------------------------------------

@pytest.mark.rule("first_mismatched_cache_len")
def test_first_mismatched_cache_len_names_layer_expected_got_and_sequence():
    assert first_mismatched_cache_len([seq([5, 5]), seq([5, 5]), seq([5, 7])], False) == (
        1,
        5,
        7,
        2,
    )
    assert first_mismatched_cache_len([seq([5, 5]), seq([5, 5])], False) is None
    assert first_mismatched_cache_len([seq([5])], False) is None
    assert first_mismatched_cache_len([], False) is None
    # sequences in order, layers within each: sequence 1's layer 1 before sequence 2's layer 0
    assert first_mismatched_cache_len([seq([5, 5]), seq([5, 6]), seq([4, 5])], False) == (
        1,
        5,
        6,
        1,
    )


@pytest.mark.rule("first_mismatched_cache_len")
def test_first_mismatched_cache_len_skips_xs_slots_only_with_the_flag_on():
    a = NormalCache([kv_slot(8, 1), xs_slot(9)])
    b = NormalCache([kv_slot(8, 2), xs_slot(7)])
    assert first_mismatched_cache_len([a, b], True) is None
    assert first_mismatched_cache_len([a, b], False) == (1, 9, 7, 1)


@pytest.mark.rule("ensure_uniform_batch_cache_lens")
def test_ensure_uniform_batch_cache_lens_refuses_naming_the_values():
    ensure_uniform_batch_cache_lens([seq([5, 5]), seq([5, 5])], False)
    with pytest.raises(
        AlignRefusal, match="sequences in one batch must share current_seq_len"
    ) as e:
        ensure_uniform_batch_cache_lens([seq([5, 5]), seq([5, 5]), seq([5, 7])], False)
    msg = str(e.value)
    assert "layer 1" in msg and "5" in msg and "7" in msg and "sequence 2" in msg


@pytest.mark.rule("batch_can_be_ragged / ragged_decode_supported")
def test_batch_can_be_ragged_requires_every_slot_to_carry_its_own_length():
    assert batch_can_be_ragged([seq([5, 5]), seq([7, 7])], False)
    for kind in ("Rotating", "TurboQuant"):
        assert not batch_can_be_ragged(
            [seq([5]), NormalCache([kv_slot(5, 1), OtherSlot(kind, 5)])], True
        )
    v4 = [NormalCache([kv_slot(5, 1), xs_slot(5)]), NormalCache([kv_slot(3, 1), xs_slot(3)])]
    assert not batch_can_be_ragged(v4, False)
    assert batch_can_be_ragged(v4, True)


# --- §5.2-§5.5 clone_in / clone_out ---------------------------------------------------------

@pytest.mark.rule("clone_in_cache")
def test_clone_in_cache_front_aligns_a_ragged_batch_and_publishes_the_leads():
    a, b = seq([12, 12], mark=100), seq([10, 10], mark=500)
    out = clone_in_cache([a, b], [], xs_per_seq=False)
    assert isinstance(out, CloneIn)
    assert out.lead_pad == [0, 2] and out.ragged_decode_supported
    layer0 = out.batched.slots[0]
    assert layer0.current_seq_len == 12 and layer0.k.data.shape[0] == 2
    assert list(layer0.k.data[1, 0, :12, 0]) == [0, 0] + list(range(500, 510))
    assert list(layer0.k.data[0, 0, :12, 0]) == list(range(100, 112))


@pytest.mark.rule("clone_in_cache")
def test_clone_in_cache_publishes_none_for_a_uniform_batch():
    out = clone_in_cache([seq([9, 9]), seq([9, 9])], [0, 0], xs_per_seq=False)
    assert out.lead_pad is None and out.ragged_decode_supported
    assert out.batched.current_seq_len == 9


@pytest.mark.rule("ensure_uniform_batch_cache_lens", "clone_in_cache")
def test_clone_in_cache_refuses_a_ragged_batch_that_cannot_be_ragged():
    a = NormalCache([kv_slot(12, 1), OtherSlot("Rotating", 12)])
    b = NormalCache([kv_slot(10, 2), OtherSlot("Rotating", 10)])
    buf = b.slots[0].k.data
    with pytest.raises(
        AlignRefusal, match="sequences in one batch must share current_seq_len"
    ) as e:
        clone_in_cache([a, b], [], xs_per_seq=True)
    assert "12" in str(e.value) and "10" in str(e.value)
    assert b.slots[0].k.data is buf and b.slots[0].current_seq_len == 10  # not aligned


@pytest.mark.rule("batch_can_be_ragged / ragged_decode_supported")
def test_clone_in_cache_publishes_the_capability_for_a_uniform_batch():
    rot = [NormalCache([kv_slot(4, 1), OtherSlot("Rotating", 4)]) for _ in range(2)]
    assert clone_in_cache(rot, [], True).ragged_decode_supported is False
    v4 = [NormalCache([kv_slot(4, 1), xs_slot(4)]) for _ in range(2)]
    assert clone_in_cache([c.clone() for c in v4], [], False).ragged_decode_supported is False
    assert clone_in_cache(v4, [], True).ragged_decode_supported is True


@pytest.mark.rule("front_align_would_succeed", "clone_in_cache")
def test_clone_in_cache_checks_would_succeed_before_touching_anything():
    a, b = seq([12], mark=1), seq([5], mark=2)
    c = seq([10], mark=3, max_seq_len=11)
    bufs = [(s.k.data, s.current_seq_len) for x in (a, b, c) for s in x.slots]
    with pytest.raises(AlignRefusal, match="sequences in one batch must share current_seq_len"):
        clone_in_cache([a, b, c], [], xs_per_seq=False)
    assert bufs == [(s.k.data, s.current_seq_len) for x in (a, b, c) for s in x.slots]


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


@pytest.mark.rule("clone_in_cache")
def test_clone_in_cache_takes_the_batched_length_from_the_first_sequence_with_xs_rows_ragged():
    a = NormalCache([kv_slot(9, 1), xs_slot(9)])
    b = NormalCache([kv_slot(9, 2), xs_slot(6)])
    out = clone_in_cache([a, b], [], xs_per_seq=True)
    assert out.lead_pad is None  # the K/V slots agree; xs rows carry their own
    assert out.batched.slots[0].current_seq_len == 9
    assert out.batched.slots[1].tokens == [9, 6]


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
    with pytest.raises(ValueError):
        clone_out_cache(out.batched, 3)


@pytest.mark.rule("clone_in_cache_reporting_lead")
def test_clone_in_cache_reporting_lead_aligns_only_under_per_sequence():
    a, b = seq([12, 12], mark=100), seq([10, 10], mark=500)
    out = clone_in_cache_reporting_lead([a, b], [], False, per_sequence=True)
    assert out.lead_pad == [0, 2]
    assert list(out.batched.slots[0].k.data[1, 0, :12, 0]) == [0, 0] + list(range(500, 510))
    out = clone_in_cache_reporting_lead([seq([7]), seq([7])], [], False, per_sequence=False)
    assert out.lead_pad == [0, 0]
    uni = [seq([7, 7]), seq([7, 7])]
    bufs = [s.k.data for c in uni for s in c.slots]
    out = clone_in_cache_reporting_lead(uni, [], False, per_sequence=True)
    assert out.lead_pad == [0, 0] and bufs == [s.k.data for c in uni for s in c.slots]
    rot = [NormalCache([kv_slot(12, 1), OtherSlot("Rotating", 12)]),
           NormalCache([kv_slot(10, 1), OtherSlot("Rotating", 10)])]
    with pytest.raises(CacheRefusal, match="Rotating"):
        clone_in_cache_reporting_lead(rot, [], True, per_sequence=True)


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
        assert [r.current_seq_len for r in rows] == [max(lens) + 1] * len(rows)  # the batched width
        expected = [
            [list(o.slots[layer].k.data[0, 0, :n, 0]) + [appended[layer][i]] for layer in range(2)]
            for i, (o, n) in enumerate(zip(originals, lens, strict=False))
        ]
        if policy == "eager":  # strip right after Out
            for r, pad in zip(rows, lead, strict=False):
                for slot in r.slots:
                    drop_dead_prefix(slot, pad)
            for i, r in enumerate(rows):
                assert r.current_seq_len == lens[i] + 1
                assert [k_row(slot) for slot in r.slots] == expected[i]
        elif policy == "lazy":  # the next In strips the pending leads, then re-aligns
            again = clone_in_cache(rows, lead, False)
            assert again.lead_pad == (
                lead if ragged else None
            )  # the spread is kept, not compounded
            for i in range(len(rows)):
                for layer, slot in enumerate(again.batched.slots):
                    assert list(slot.k.data[i, 0, lead[i] : max(lens) + 1, 0]) == expected[i][layer]
        else:  # negative control: record the padded width as each row's own
            again = clone_in_cache(rows, [], False)
            assert again.lead_pad is None and again.batched.current_seq_len == max(lens) + 1
            if ragged:
                assert any(list(rows[i].slots[0].k.data[0, 0, : lens[i] + 1, 0]) != expected[i][0]
                           for i in range(len(rows)))
