"""Front padding, the dead-prefix strip and batch front alignment (cache-and-draft.md §4;
masks-and-scheduling.md §14). Batch assembly (§5) is test_align_clone.py's; draft-group
alignment (§9.6-§9.8) test_align_draft.py's.

The slot-level rules (`front_pad_kv_cache`, `drop_dead_prefix`, `front_align_batch`) are the
reference's functions, and the port's K/V slots go through them with their own layout (a lead
is a host offset there), so those tests run one body over both (`over_kv`), reading each slot
back as its front-aligned K and V. Expected values come from the spec's worked examples or
from oracles written here (a copy of each row's slot taken before alignment, plain Python
lists of column values); lengths are read back off the slots, never recomputed with the
module's formulas."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from raggedspec.conformance.helpers import REF_KV, over_kv, seq
from raggedspec.reference.align import (
    drop_dead_prefix,
    drop_front_refusal,
    drop_front_single,
    front_align_batch,
    front_align_would_succeed,
    front_pad_kv_cache,
    front_pad_refusal,
    front_pad_single,
)
from raggedspec.reference.cache import KvCache, NormalCache, OtherSlot, SingleCache
from raggedspec.reference.errors import CacheRefusal

kv_slot, xs_slot = REF_KV.slot, REF_KV.xs


def front_k(impl, slot) -> list[float]:
    """Row 0, head 0, feature 0 of a slot's front-aligned K (all `current` columns)."""
    return impl.k(slot)[0, 0, :, 0].tolist()


def front_v(impl, slot) -> list[float]:
    return impl.v(slot)[0, 0, :, 0].tolist()


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
def test_front_pad_single_refusals():
    sc = kv_slot(10, 100).k
    with pytest.raises(CacheRefusal, match="front_pad to 5 is shorter than the 10 live positions"):
        front_pad_single(sc, 5)
    with pytest.raises(CacheRefusal, match="unmaterialized"):
        front_pad_single(SingleCache(4096, 16, current_seq_len=3), 5)
    windowed = SingleCache(4096, 512, retain_window=8)
    windowed.append(np.zeros((1, 1, 140, 1)))
    windowed.append(np.zeros((1, 1, 1, 1)))
    assert windowed.first_cached == 128
    with pytest.raises(CacheRefusal, match="windowed"):
        front_pad_single(windowed, 150)


@pytest.mark.rule("front_pad_single")
def test_front_pad_single_refuses_a_capacity_above_max_seq_len():
    sc = kv_slot(10, 100, max_seq_len=600).k
    with pytest.raises(CacheRefusal, match="above max_seq_len") as e:
        front_pad_single(sc, 601)
    assert "601" in str(e.value) and "600" in str(e.value)
    assert sc.current_seq_len == 10 and sc.capacity_seq_len == 512
    assert front_pad_single(sc, 600) == 590 and sc.capacity_seq_len == 600


@pytest.mark.rule("front_pad_single")
def test_front_pad_single_keeps_a_capacity_wider_than_the_target_and_the_dtype():
    sc = kv_slot(10, 100, extra=600).k
    assert sc.capacity_seq_len == 1024
    front_pad_single(sc, 12)
    assert sc.capacity_seq_len == 1024 and sc.data.shape[2] == 1024
    k = (np.arange(16, dtype=np.float32) + 1).reshape(1, 1, 16, 1)
    f32 = SingleCache(4096, 16, 4, 0, None, k)
    front_pad_single(f32, 6)
    assert f32.data.dtype == np.float32 and list(f32.data[0, 0, :6, 0]) == [0, 0, 1, 2, 3, 4]


@pytest.mark.rule("front_pad_single")
def test_the_integer_refusals_at_their_boundaries():
    """A slot that evicted even one position is windowed; the strip's own messages."""
    assert str(front_pad_refusal(3, 5, True, 1, 16, 4096)) == (
        "front_pad to 5: a windowed slot (first cached 1) cannot be front-padded")
    assert front_pad_refusal(3, 5, True, 0, 16, 4096) is None
    assert str(drop_front_refusal(2, 10, True, 16, 1)) == (
        "cannot drop a 2-column dead prefix from a windowed slot (first cached 1)")
    assert drop_front_refusal(2, 10, True, 16, 0) is None
    assert str(drop_front_refusal(2, 4, False, 0, 0)) == (
        "cannot drop a 2-column dead prefix from an unmaterialized slot (4 positions)")
    assert str(drop_front_refusal(5, 4, True, 16, 0)) == (
        "cannot drop a 5-column dead prefix from a slot that holds only 4")
    assert str(drop_front_refusal(1, 4, True, 3, 0)) == (
        "cannot drop a 1-column dead prefix: buffer width 3 < current 4")


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


# --- §4.2 front_pad_kv_cache ---------------------------------------------------------------

@pytest.mark.rule("front_pad_kv_cache", "front alignment, concatenation, split and dead-prefix "
                                        "strip, backend")
@over_kv
def test_front_pad_kv_cache_pads_both_halves(impl):
    kv = impl.slot(4, 100)
    assert front_pad_kv_cache(kv, 7, xs_per_seq=False) == 3
    assert kv.current_seq_len == 7
    assert front_k(impl, kv) == [0, 0, 0, 100, 101, 102, 103]
    assert front_v(impl, kv) == [0, 0, 0, 100.5, 101.5, 102.5, 103.5]


@pytest.mark.rule("front_pad_kv_cache")
@over_kv
def test_front_pad_kv_cache_on_an_xs_slot_is_refused_with_the_flag_off_and_a_no_op_with_it_on(
        impl):
    xs = impl.xs(13)
    with pytest.raises(CacheRefusal, match="XsRolling") as e:
        front_pad_kv_cache(xs, 20, xs_per_seq=False)
    assert "ARC_V4_XS_PER_SEQ" in str(e.value)
    comp = xs.comp
    assert front_pad_kv_cache(xs, 20, xs_per_seq=True) == 0
    assert xs.current_seq_len == 13 and xs.comp is comp


@pytest.mark.rule("front_pad_kv_cache")
@pytest.mark.parametrize("kind", ["Rotating", "TurboQuant"])
def test_front_pad_kv_cache_refuses_other_slot_kinds(kind):
    with pytest.raises(CacheRefusal, match=kind):
        front_pad_kv_cache(OtherSlot(kind, 3), 5, xs_per_seq=True)


@pytest.mark.rule("front_pad_kv_cache")
def test_a_slot_whose_halves_disagree_is_malformed_input():
    kv = kv_slot(4, 1)
    kv.v.current_seq_len = 2
    with pytest.raises(ValueError, match=r"^K length 4 and V length 2 disagree$"):
        front_pad_kv_cache(kv, 6, False)


@pytest.mark.rule("front_pad_kv_cache")
def test_a_v_half_that_cannot_be_padded_leaves_the_k_half_untouched():
    kv = kv_slot(4, 100)
    kv.v.max_seq_len = 5  # K may grow to 6, V may not
    k_buf = kv.k.data
    with pytest.raises(CacheRefusal, match="above max_seq_len 5"):
        front_pad_kv_cache(kv, 6, False)
    assert kv.k.data is k_buf and kv.k.current_seq_len == 4


# --- §4.3 / §4.4 strip -----------------------------------------------------------------------

@pytest.mark.rule("drop_front_single")
def test_drop_front_single_narrows_to_width_minus_lead():
    sc = kv_slot(10, 100).k
    front_pad_single(sc, 12)
    drop_front_single(sc, 2)
    # width - lead, not current - lead
    assert (sc.current_seq_len, sc.capacity_seq_len, sc.data.shape[2]) == (10, 510, 510)
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


@pytest.mark.rule("drop_dead_prefix", "front alignment, concatenation, split and dead-prefix "
                                      "strip, backend")
@over_kv
def test_drop_dead_prefix_strips_both_halves(impl):
    kv = impl.slot(4, 100)
    front_pad_kv_cache(kv, 7, False)
    drop_dead_prefix(kv, 3)
    assert impl.held(kv)[2:] == (4, 509)  # current, capacity (width - lead)
    assert front_k(impl, kv) == [100, 101, 102, 103]
    assert front_v(impl, kv) == [100.5, 101.5, 102.5, 103.5]


@pytest.mark.rule("drop_dead_prefix")
@over_kv
def test_drop_dead_prefix_is_a_no_op_for_xs_slots_and_lead_zero(impl):
    xs = impl.xs(13)
    comp = xs.comp
    drop_dead_prefix(xs, 5)
    assert xs.current_seq_len == 13 and xs.comp is comp
    kv = impl.slot(4, 100)
    held = impl.held(kv)
    drop_dead_prefix(kv, 0)
    assert impl.held(kv) == held


@pytest.mark.rule("drop_dead_prefix")
@over_kv
def test_drop_dead_prefix_refuses_other_kinds_and_over_long_leads(impl):
    with pytest.raises(CacheRefusal, match="Rotating"):
        drop_dead_prefix(OtherSlot("Rotating", 4), 1)
    kv = impl.slot(4, 100)
    held = impl.held(kv)
    with pytest.raises(
        CacheRefusal, match="^cannot drop a 5-column dead prefix from a slot that holds only 4$"
    ):
        drop_dead_prefix(kv, 5)
    assert impl.held(kv) == held


@pytest.mark.rule("drop_dead_prefix")
def test_a_v_half_that_cannot_be_stripped_leaves_the_k_half_untouched():
    kv = kv_slot(4, 100)
    front_pad_kv_cache(kv, 6, False)
    kv.v.data = None  # V lost its buffer: the strip must refuse before K moves
    k_buf = kv.k.data
    with pytest.raises(CacheRefusal, match="unmaterialized"):
        drop_dead_prefix(kv, 2)
    assert kv.k.data is k_buf and kv.k.current_seq_len == 6


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


# --- §4.5 front_align_batch -----------------------------------------------------------------

@pytest.mark.rule("front_align_batch")
@over_kv
def test_front_align_batch_example_lives_12_and_10(impl):
    a, b = seq([12, 12], mark=100, impl=impl), seq([10, 10], mark=500, impl=impl)
    assert front_align_batch([a, b], xs_per_seq=False) == [0, 2]
    for slot in b.slots:
        assert slot.current_seq_len == 12
    assert front_k(impl, b.slots[0]) == [0, 0] + list(range(500, 510))
    assert front_k(impl, a.slots[1]) == list(range(10_100, 10_112))


@pytest.mark.rule("front_align_batch")
@over_kv
def test_front_align_batch_reads_the_lead_from_the_last_non_xs_slot(impl):
    a = NormalCache([impl.slot(12, 100), impl.slot(12, 200), impl.xs(12)])
    b = NormalCache([impl.slot(10, 300), impl.slot(10, 400), impl.xs(10)])
    assert front_align_batch([a, b], xs_per_seq=True) == [0, 2]
    assert b.slots[2].current_seq_len == 10  # the xs slot carries its own length


@pytest.mark.rule("front_align_batch")
@over_kv
def test_front_align_batch_target_counts_every_slot_including_xs(impl):
    # T = max over all slots of all sequences: sequence 0's xs history is the widest.
    a = NormalCache([impl.slot(10, 100), impl.xs(12)])
    b = NormalCache([impl.slot(8, 300), impl.xs(8)])
    assert front_align_batch([a, b], xs_per_seq=True) == [2, 4]
    assert a.slots[0].current_seq_len == 12 and b.slots[0].current_seq_len == 12


@pytest.mark.rule("front_align_batch")
@over_kv
def test_front_align_batch_refusal_leaves_the_batch_untouched(impl):
    a, b = seq([12, 12], mark=100, impl=impl), seq([5, 5], mark=500, impl=impl)
    c = seq([10, 10], mark=900, impl=impl, max_seq_len=11)
    held = [impl.held(s) for x in (a, b, c) for s in x.slots]
    assert not front_align_would_succeed([a, b, c], False)
    with pytest.raises(CacheRefusal, match="above max_seq_len") as e:
        front_align_batch([a, b, c], False)
    assert "sequence 2" in str(e.value)
    assert held == [impl.held(s) for x in (a, b, c) for s in x.slots]


@pytest.mark.rule("front_align_batch")
def test_a_sequence_without_a_kv_slot_has_lead_zero():
    assert front_align_batch([NormalCache([xs_slot(12)]), NormalCache([xs_slot(10)])],
                             True) == [0, 0]
    assert front_align_batch([NormalCache([]), NormalCache([])], False) == [0, 0]
    assert front_align_batch([], False) == []


@pytest.mark.rule("front_align_would_succeed")
@over_kv
def test_front_align_would_succeed_is_a_non_mutating_check(impl):
    a, b = seq([12], mark=100, impl=impl), seq([10], mark=500, impl=impl)
    held = impl.held(b.slots[0])
    assert front_align_would_succeed([a, b], False)
    assert impl.held(b.slots[0]) == held
    assert not front_align_would_succeed(
        [a, NormalCache([impl.slot(10, 1), OtherSlot("Rotating", 10)])], True
    )
    v4 = [NormalCache([impl.slot(12, 1), impl.xs(12)]), NormalCache([impl.slot(10, 1),
                                                                    impl.xs(10)])]
    assert not front_align_would_succeed(v4, False)
    assert front_align_would_succeed(v4, True)


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
    for n, extra in zip(lens, extras, strict=True):
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
    for c, orig, n, lead in zip(caches, before, lens, leads, strict=True):
        for slot, o in zip(c.slots, orig.slots, strict=True):
            for half, oh in ((slot.k, o.k), (slot.v, o.v)):
                assert half.current_seq_len == target
                assert np.array_equal(half.data[:, :, lead:target], oh.data[:, :, :n])  # bit-exact
                assert not half.data[:, :, :lead].any()  # dead prefix zero
                if lead > 0:
                    assert half.capacity_seq_len == max(oh.capacity_seq_len, target)
    for c, lead in zip(caches, leads, strict=True):
        for slot in c.slots:
            drop_dead_prefix(slot, lead)
    for c, orig, n in zip(caches, before, lens, strict=True):
        for slot, o in zip(c.slots, orig.slots, strict=True):
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

