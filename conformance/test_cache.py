"""The KV cache: SingleCache / KvCache / NormalCache, the 512-column growth and the windowed
store (cache-and-draft.md §3).

The growth and `set_len` rules of one K/V slot run one body over the reference's `KvCache`
and the port's `TorchKv` (`over_kv`: the same appends, the same capacities, refusals and
front-aligned contents); the rest is the reference's own (windowed eviction, layout changes,
the halves of a `KvCache`, `NormalCache`). The port's in-place buffer is test_ragged_kv.py's,
its slots test_slots.py's. Expected values come from the spec's examples or from brute-force
oracles written here (a dict of absolute position -> last written value, and the spec's
growth formula worked by hand)."""

import numpy as np
import pytest
from hypothesis import assume, example, given
from hypothesis import strategies as st

from raggedspec.conformance.helpers import over_kv
from raggedspec.reference.cache import (
    CACHE_GROW_SIZE,
    WINDOW_COMPACTION,
    KvCache,
    NormalCache,
    OtherSlot,
    SingleCache,
    block_capacity,
    chain_capacity,
    grown_capacity,
    window_target_first_cached,
)
from raggedspec.reference.errors import CacheRefusal, require


def cols(values, d=1):
    """A [1, 1, n, d] block whose column j holds values[j] (in every feature)."""
    v = np.asarray(values, dtype=np.float64)
    return np.repeat(v[None, None, :, None], d, axis=3)


def live_values(sc):
    return list(sc.current_data()[0, 0, :, 0])


# --- §3 examples -------------------------------------------------------------------------

@pytest.mark.rule("SingleCache::append")
def test_capacity_16_current_16_append_1_grows_to_528():
    sc = SingleCache(max_seq_len=4096, capacity_seq_len=16)
    sc.append(cols(range(16)))
    assert (sc.capacity_seq_len, sc.current_seq_len) == (16, 16)
    sc.append(cols([99]))
    assert sc.capacity_seq_len == 528
    assert sc.data.shape[2] == 528
    assert live_values(sc) == list(range(16)) + [99]  # old buffer copied to column 0


@pytest.mark.rule("window_target_first_cached")
def test_window_target_first_cached_example():
    assert window_target_first_cached(300, 144) == 128


@pytest.mark.rule("window_target_first_cached")
@pytest.mark.parametrize(
    "length,retain,expected",
    [
        (0, 144, 0),
        (143, 144, 0),
        (271, 144, 0),
        (272, 144, 128),
        (400, 8, 384),
        (136, 8, 128),
        (135, 8, 0),
    ],
)
def test_window_target_first_cached_by_hand(length, retain, expected):
    # over = sat(len - retain); result = over - over % 128, worked by hand.
    assert window_target_first_cached(length, retain) == expected


@pytest.mark.rule("window_target_first_cached")
@given(st.integers(0, 5000), st.integers(0, 700))
def test_window_target_keeps_at_least_retain_and_is_128_aligned(length, retain):
    got = window_target_first_cached(length, retain)
    # brute force: the largest multiple of 128 not above sat(len - retain)
    oracle = max(m for m in range(0, max(length - retain, 0) + 1, WINDOW_COMPACTION))
    assert got == oracle
    assert got % 128 == 0 and length - got >= min(length, retain)


# --- try_set_len / set_len ----------------------------------------------------------------

@pytest.mark.rule("SingleCache", "K/V append, growth and set_len, backend")
@over_kv
def test_try_set_len_refuses_past_the_capacity(impl):
    kv = impl.empty(4096, 16)
    impl.put(kv, cols(range(5)), cols(range(5)))
    with pytest.raises(CacheRefusal) as e:
        kv.try_set_len(17)
    assert str(e.value) == "set_len(17) exceeds current capacity 16 (first cached 0)"
    with pytest.raises(CacheRefusal, match="exceeds current capacity"):
        kv.set_len(17)
    assert impl.held(kv)[2:] == (5, 16)
    kv.try_set_len(16)  # exactly the capacity is fine
    kv.set_len(16)
    assert impl.held(kv)[2:] == (16, 16)


@pytest.mark.rule("SingleCache")
def test_try_set_len_refuses_below_the_retained_window():
    sc = windowed_filled(retain=8, n=300)
    assert sc.first_cached == 256
    with pytest.raises(CacheRefusal, match="below this slot's retained window") as e:
        sc.set_len(255)
    assert "255" in str(e.value) and "256" in str(e.value)
    assert sc.current_seq_len == 300
    sc.set_len(256)  # the base itself is fine
    assert sc.physical == 0


@pytest.mark.rule("SingleCache", "K/V append, growth and set_len, backend")
@over_kv
def test_set_len_grows_back_into_stale_capacity(impl):
    kv = impl.empty(4096, 16)
    impl.put(kv, cols(range(100, 110)), cols(range(100, 110)))
    kv.set_len(4)
    assert impl.k(kv)[0, 0, :, 0].tolist() == [100, 101, 102, 103]
    kv.set_len(10)  # touches no tensor: the stale columns come back
    assert impl.k(kv)[0, 0, :, 0].tolist() == list(range(100, 110))
    kv.set_len(16)  # up to the capacity, zeros never written
    assert impl.k(kv)[0, 0, :, 0].tolist() == list(range(100, 110)) + [0] * 6


@pytest.mark.rule("SingleCache")
def test_set_len_touches_no_tensor():
    sc = SingleCache(max_seq_len=4096, capacity_seq_len=16)
    sc.append(cols(range(100, 110)))
    buf = sc.data
    sc.set_len(4)
    sc.set_len(10)
    assert sc.data is buf and live_values(sc) == list(range(100, 110))


@pytest.mark.rule("SingleCache")
def test_reset_keeps_capacity_and_drops_data():
    sc = SingleCache(max_seq_len=4096, capacity_seq_len=16)
    sc.append(cols(range(20)))
    sc.reset()
    assert (sc.current_seq_len, sc.first_cached, sc.data, sc.capacity_seq_len) == (0, 0, None, 528)


# --- append: preallocation, layout, growth --------------------------------------------------

@pytest.mark.rule("SingleCache::append")
def test_preallocation_is_reused_while_the_layout_matches():
    sc = SingleCache(max_seq_len=4096, capacity_seq_len=16)
    sc.append(cols(range(3), d=2))
    buf = sc.data
    sc.set_len(0)
    sc.append(cols([7], d=2))
    assert sc.data is buf
    assert live_values(sc) == [7]


@pytest.mark.rule("SingleCache::append")
def test_preallocation_is_rebuilt_while_empty_when_the_layout_changes():
    sc = SingleCache(max_seq_len=4096, capacity_seq_len=16)
    sc.append(cols(range(3), d=2))
    sc.set_len(0)
    sc.append(cols([7], d=3))
    assert sc.data.shape == (1, 1, 16, 3)
    assert live_values(sc) == [7]
    sc.set_len(0)
    sc.append(cols([8], d=3).astype(np.float32))
    assert sc.data.dtype == np.float32


@pytest.mark.rule("SingleCache::append")
@pytest.mark.parametrize(
    "other", [cols([1], d=3), cols([1], d=2).astype(np.float32), np.zeros((2, 1, 1, 2))]
)
def test_a_layout_change_mid_sequence_is_refused(other):
    sc = SingleCache(max_seq_len=4096, capacity_seq_len=16)
    sc.append(cols(range(3), d=2))
    with pytest.raises(CacheRefusal, match="layout changed mid-sequence"):
        sc.append(other)
    assert sc.current_seq_len == 3 and sc.data.shape == (1, 1, 16, 2)


@pytest.mark.rule("SingleCache::append", "K/V append, growth and set_len, backend")
@over_kv
@pytest.mark.parametrize("cap,first,second,expected", [
    (512, 512, 1, 1024),    # shortfall 1 -> one block
    (512, 0, 1100, 1536),   # shortfall 588 -> two blocks, not 1100
    (16, 10, 7, 528),       # shortfall 1
    (16, 16, 1, 528),       # §3: capacity 16, current 16, append 1
    (16, 0, 529, 1040),     # shortfall 513 -> two blocks
])
def test_append_grows_by_whole_512_blocks(impl, cap, first, second, expected):
    kv = impl.empty(4096, cap)
    impl.put(kv, cols(range(first)), cols(range(first)))
    impl.put(kv, cols(range(1000, 1000 + second)), cols(range(second)))
    assert impl.held(kv)[2:] == (first + second, expected)
    assert expected == cap + -(-(first + second - cap) // CACHE_GROW_SIZE) * 512
    assert impl.k(kv)[0, 0, :, 0].tolist() == list(range(first)) + list(range(1000, 1000 + second))


@pytest.mark.rule("SingleCache::append", "K/V append, growth and set_len, backend")
@over_kv
def test_growth_above_max_seq_len_is_refused(impl):
    kv = impl.empty(1000, 512)
    impl.put(kv, cols(range(500)), cols(range(500)))
    with pytest.raises(CacheRefusal) as e:
        impl.put(kv, cols(range(13)), cols(range(13)))
    assert str(e.value) == "kv-cache capacity 1024 would be above max_seq_len 1000"
    assert impl.held(kv)[2:] == (500, 512)
    assert impl.k(kv)[0, 0, :, 0].tolist() == list(range(500))


@pytest.mark.rule("SingleCache::append")
def test_block_capacity_rounds_every_shortfall_up_to_whole_blocks():
    """The one rounding: `capacity + k * 512`, the least k >= 0 that holds `needed`; ints
    give ints, arrays arrays (elementwise), and it never refuses."""
    assert [block_capacity(512, n) for n in (0, 512, 513, 1024, 1025)] == [
        512, 512, 1024, 1024, 1536]
    assert [block_capacity(16, n) for n in (16, 17, 528, 529)] == [16, 528, 528, 1040]
    assert block_capacity(0, 1) == 512 and type(block_capacity(16, 17)) is int
    got = block_capacity(np.array([16, 512, 0]), np.array([17, 100, 1025]))
    assert got.tolist() == [528, 512, 1536]
    assert block_capacity(512, np.array([1, 513])).tolist() == [512, 1024]


# --- windowed store (retain 8) ------------------------------------------------------------

def windowed_filled(retain, n):
    sc = SingleCache(max_seq_len=100_000, capacity_seq_len=512, retain_window=retain)
    for p in range(n):
        sc.append(cols([p]))
    return sc


@pytest.mark.rule("SingleCache::append")
def test_windowed_store_retain_8_keeps_the_right_tail_and_base():
    retain = 8
    sc = SingleCache(max_seq_len=100_000, capacity_seq_len=512, retain_window=retain)
    expected_base = 0
    narrowed = 0
    for p in range(700):
        before = sc.current_seq_len
        sc.append(cols([p]))
        # the spec's order: eviction target from the length BEFORE this write
        over = max(before - retain, 0)
        target = over - over % 128
        if target > expected_base:
            expected_base = target
            narrowed += 1
            assert sc.capacity_seq_len == retain + 128
        assert sc.first_cached == expected_base
        assert sc.current_seq_len == p + 1
        assert sc.physical >= min(sc.current_seq_len, retain)  # never fewer than retain rows
        assert live_values(sc) == list(
            range(sc.first_cached, p + 1)
        )  # written at physical, not current
    assert narrowed >= 4 and sc.first_cached > 0  # the fixture crossed the threshold (D12)


@pytest.mark.rule("SingleCache::append")
def test_windowed_store_evicts_before_a_large_write():
    sc = windowed_filled(retain=8, n=140)
    assert sc.first_cached == 128
    sc.append(cols(range(140, 440)))  # 300 at once: evict (to wtfc(140,8)=128), then grow
    assert sc.first_cached == 128
    assert live_values(sc) == list(range(128, 440))
    assert sc.capacity_seq_len == 136 + 512


@pytest.mark.rule("SingleCache::append")
@given(st.lists(st.integers(0, 60), min_size=1, max_size=25), st.integers(1, 40))
def test_windowed_store_matches_a_brute_force_window(sizes, retain):
    sc = SingleCache(max_seq_len=100_000, capacity_seq_len=16, retain_window=retain)
    base, n = 0, 0
    for s in sizes:
        over = max(n - retain, 0)
        base = max(base, over - over % 128)
        sc.append(cols(range(n, n + s)))
        n += s
        assert sc.first_cached == base
        assert live_values(sc) == list(range(base, n))
        assert sc.physical >= min(n, retain)


# --- brute-force oracle for plain slots --------------------------------------------------

ops = st.lists(st.one_of(
    st.tuples(st.just("append"), st.integers(0, 700)),
    st.tuples(st.just("set_len"), st.integers(0, 1600)),
    st.tuples(st.just("reset"), st.just(0)),
), min_size=1, max_size=12)


@pytest.mark.rule("SingleCache")
@given(ops, st.sampled_from([16, 512]))
def test_plain_slot_matches_a_brute_force_oracle(program, cap0):
    sc = SingleCache(max_seq_len=2048, capacity_seq_len=cap0)
    written: dict[int, float] = {}
    cap, cur, counter = cap0, 0, 0
    for op, arg in program:
        if op == "append":
            vals = list(range(counter, counter + arg))
            counter += arg
            need = cur + arg
            grown = cap if need <= cap else cap + -(-(need - cap) // 512) * 512
            if grown > 2048:
                with pytest.raises(CacheRefusal, match="above max_seq_len"):
                    sc.append(cols(vals))
                continue
            sc.append(cols(vals))
            cap = grown
            for j, v in enumerate(vals):
                written[cur + j] = v
            cur += arg
        elif op == "set_len":
            if arg > cap:
                with pytest.raises(CacheRefusal, match="exceeds current capacity"):
                    sc.set_len(arg)
                continue
            sc.set_len(arg)
            cur = arg
        else:
            sc.reset()
            cur, written = 0, {}
        assert (sc.current_seq_len, sc.capacity_seq_len) == (cur, cap)
        if sc.data is not None:
            assert live_values(sc) == [written.get(p, 0) for p in range(cur)]


# --- KvCache / NormalCache -----------------------------------------------------------------

@pytest.mark.rule("KvCache / NormalCache::new_plain")
def test_kv_cache_appends_and_sets_both_halves_and_reads_k():
    kv = KvCache.new_normal(4096, capacity=16)
    kv.append(cols(range(5)), cols(range(100, 105)))
    assert kv.current_seq_len == 5 == kv.v.current_seq_len
    kv.set_len(3)
    assert (kv.k.current_seq_len, kv.v.current_seq_len) == (3, 3)
    with pytest.raises(CacheRefusal, match="exceeds current capacity"):
        kv.set_len(17)
    assert (kv.k.current_seq_len, kv.v.current_seq_len) == (3, 3)
    kv.k.current_seq_len = 7  # length is read from k
    assert kv.current_seq_len == 7
    assert kv.supports_per_sequence_len(False) and kv.kind == "Normal"


@pytest.mark.rule("KvCache / NormalCache::new_plain")
def test_kv_cache_set_len_is_all_or_nothing():
    kv = KvCache.new_normal(4096, capacity=16)
    kv.append(cols(range(5)), cols(range(5)))
    kv.v.capacity_seq_len = 4  # only v would refuse
    with pytest.raises(CacheRefusal):
        kv.set_len(5)
    assert kv.k.current_seq_len == 5


@pytest.mark.rule("KvCache / NormalCache::new_plain")
def test_new_plain_builds_n_normal_slots_of_capacity_512():
    nc = NormalCache.new_plain(3, 4096)
    assert len(nc.slots) == 3
    assert all(s.kind == "Normal" and s.k.capacity_seq_len == 512 and s.v.capacity_seq_len == 512
               and s.k.max_seq_len == 4096 for s in nc.slots)
    nc.slots[0].append(cols(range(4)), cols(range(4)))
    assert nc.current_seq_len == 4  # layer 0's length
    assert NormalCache.new_plain(0, 10).current_seq_len == 0


@pytest.mark.rule("KvCache / NormalCache::new_plain")
def test_clone_is_deep():
    nc = NormalCache.new_plain(1, 4096)
    nc.slots[0].append(cols(range(4)), cols(range(4)))
    cp = nc.clone()
    cp.slots[0].k.data[0, 0, 0, 0] = 77
    cp.slots[0].set_len(1)
    assert nc.slots[0].k.data[0, 0, 0, 0] == 0 and nc.current_seq_len == 4


def _append_columns_one_by_one(capacity: int, held: int, n: int, max_seq_len: int):
    """What a draft chain does: `n` one-column appends to a real slot; (capacity, None) or
    (None, the refusal's message)."""
    sc = SingleCache(max_seq_len, capacity)
    if held:
        sc.append(np.zeros((1, 1, held, 2)))
    try:
        for _ in range(n):
            sc.append(np.zeros((1, 1, 1, 2)))
    except CacheRefusal as exc:
        return None, str(exc)
    return sc.capacity_seq_len, None


@pytest.mark.rule("SingleCache::append")
@given(capacity=st.sampled_from([16, 512, 528, 1040]), held=st.integers(0, 1100),
       n=st.integers(0, 1100), max_seq_len=st.integers(0, 2600))
@example(capacity=16, held=16, n=600, max_seq_len=600)  # refused at the second block
@example(capacity=16, held=10, n=6, max_seq_len=16)  # fills exactly, no growth
@example(capacity=16, held=10, n=7, max_seq_len=527)  # one column past: 528 > 527
@example(capacity=512, held=0, n=1100, max_seq_len=1024)  # the refusal names 1536, not 2048
@example(capacity=16, held=12, n=5, max_seq_len=12)  # max_seq_len below the first 16 columns
def test_chain_capacity_equals_n_one_column_appends(capacity, held, n, max_seq_len):
    """`chain_capacity` (the port's one-call capacity arithmetic for a chain) gives the
    capacity, or the refusal message, that `n` one-column `SingleCache.append`s give."""
    start = grown_capacity(capacity, 0, held, 10**9)  # the capacity once `held` is written
    assume(start == capacity or start <= max_seq_len)  # else no slot holds `held` columns
    want = _append_columns_one_by_one(capacity, held, n, max_seq_len)
    try:
        got = chain_capacity(start, held, n, max_seq_len), None
    except CacheRefusal as exc:
        got = None, str(exc)
    assert got == want


# --- malformed input: a plain ValueError whose message names the bad values ---------------

@pytest.mark.rule("SingleCache::append", "window_target_first_cached")
def test_malformed_cache_input_is_a_value_error_carrying_the_message_given():
    assert require(True, "unused") is None
    with pytest.raises(ValueError) as caught:
        require(False, "length 3 must be even")
    assert str(caught.value) == "length 3 must be even" and type(caught.value) is ValueError
    with pytest.raises(ValueError, match="^length -1 and retain 8 must be >= 0$"):
        window_target_first_cached(-1, 8)
    with pytest.raises(ValueError, match="^chain length -2 must be >= 0$"):
        chain_capacity(512, 0, -2, 4096)


# --- refusals by message, one condition broken per case ---------------------------------------


def _refused(message, fn, *args, **kwargs):
    import re

    with pytest.raises(ValueError, match="^" + re.escape(message) + "$"):
        fn(*args, **kwargs)


@pytest.mark.rule("SingleCache")
def test_each_malformed_slot_is_refused_with_its_own_message():
    from raggedspec.reference.cache import set_len_refusal

    _refused("set_len length -1 must be >= 0", set_len_refusal, -1, 0, 8)
    _refused("layer count -1 must be >= 0", NormalCache.new_plain, -1, 64)
    _refused("max_seq_len -1 must be >= 0", SingleCache, -1)
    _refused("capacity_seq_len -1 must be >= 0", SingleCache, 64, -1)
    assert SingleCache(64, 0).capacity_seq_len == 0  # capacity 0 is well formed
    _refused("first_cached 3 must be in [0, current_seq_len 2]", SingleCache, 64, 16, 2, 3)
    _refused("data shape (1, 1, 8, 1) must be [B,H,16,D]", SingleCache, 64, 16,
             data=np.zeros((1, 1, 8, 1)))
    _refused("data shape (1, 1, 16) must be [B,H,16,D]", SingleCache, 64, 16,
             data=np.zeros((1, 1, 16)))  # axis 2 is 16 wide, but rank 3
    sc = SingleCache(64, 16)
    _refused("append needs a [B,H,s,D] array, got shape (1, 1, 2)", sc.append, np.zeros((1, 1, 2)))
    _refused("append needs a [B,H,s,D] array, got shape None", sc.append, [[[[1.0]]]])
    _refused("evict_before needs a windowed slot", sc.evict_before, 0)


@pytest.mark.rule("SingleCache::append")
def test_evict_before_takes_both_ends_of_its_range_and_refuses_outside_it():
    def slot():
        sc = SingleCache(4096, 512, retain_window=8)
        sc.append(cols(range(3)))
        return sc

    _refused("evict target 4 must be in [0, 3]", slot().evict_before, 4)
    for target in (0, 3):
        sc = slot()
        sc.evict_before(target)
        assert (sc.first_cached, sc.capacity_seq_len, sc.physical) == (target, 136, 3 - target)


# --- boundaries, layouts and dtypes -------------------------------------------------------------


@pytest.mark.rule("SingleCache::append")
def test_chain_capacity_keeps_a_capacity_the_chain_exactly_fills():
    # held + n == capacity: nothing grows, whatever max_seq_len says
    assert chain_capacity(1024, 1000, 24, 100) == 1024 == grown_capacity(1024, 1000, 24, 100)


@pytest.mark.rule("SingleCache::append")
def test_a_windowed_slot_keeps_its_capacity_until_a_position_leaves_the_window():
    sc = SingleCache(4096, 512, retain_window=8)
    sc.append(cols(range(10)))  # window_target_first_cached(0, 8) == 0: nothing to evict
    assert (sc.first_cached, sc.capacity_seq_len) == (0, 512)


@pytest.mark.rule("SingleCache::append")
def test_a_layout_change_after_one_column_is_refused():
    sc = SingleCache(4096, 16)
    sc.append(cols([1.0]))
    with pytest.raises(CacheRefusal, match="layout changed mid-sequence"):
        sc.append(cols([2.0], d=2))


@pytest.mark.rule("SingleCache::append")
def test_the_buffer_is_batch_by_heads_as_the_first_append_says():
    sc = SingleCache(4096, 16)
    src = np.arange(2 * 3 * 4 * 5, dtype=np.float64).reshape(2, 3, 4, 5)
    sc.append(src)
    assert sc.data.shape == (2, 3, 16, 5) and np.array_equal(sc.current_data(), src)


@pytest.mark.rule("SingleCache::append")
def test_growth_and_eviction_keep_the_appended_dtype():
    grown = SingleCache(4096, 16)
    grown.append(np.ones((1, 1, 16, 1), dtype=np.float32))
    grown.append(np.ones((1, 1, 1, 1), dtype=np.float32))  # grows to 528
    assert grown.capacity_seq_len == 528 and grown.data.dtype == np.float32
    windowed = SingleCache(4096, 136, retain_window=8)
    windowed.append(np.ones((1, 1, 136, 1), dtype=np.float32))
    windowed.append(np.ones((1, 1, 1, 1), dtype=np.float32))  # evicts before 128
    assert windowed.first_cached == 128 and windowed.data.dtype == np.float32


@pytest.mark.rule("KvCache / NormalCache::new_plain")
def test_new_normal_and_clone_carry_capacity_window_and_paging():
    kv = KvCache.new_normal(4096, capacity=16, retain_window=8)
    for half in (kv.k, kv.v):
        assert (half.capacity_seq_len, half.retain_window) == (16, 8)
    copy = kv.k.clone()
    assert (copy.capacity_seq_len, copy.retain_window) == (16, 8)
    paged = NormalCache([KvCache.new_normal(64)], paged=True)
    assert paged.clone().paged is True


# --- what the slots carry: reset, unmodelled kinds ----------------------------------------------

@pytest.mark.rule("KvCache / NormalCache::new_plain")
def test_a_reset_slot_is_empty_and_keeps_its_capacity():
    kv = KvCache.new_normal(4096)
    kv.append(np.ones((1, 1, 600, 2)), np.ones((1, 1, 600, 2)))
    assert kv.k.capacity_seq_len == 1024
    kv.reset()
    for half in (kv.k, kv.v):
        assert (half.current_seq_len, half.first_cached, half.data) == (0, 0, None)
        assert half.capacity_seq_len == 1024


@pytest.mark.rule("KvCache / NormalCache::new_plain")
def test_a_cache_with_an_unmodelled_slot_clones_it_independently():
    cache = NormalCache([KvCache.new_normal(64), OtherSlot("Rotating", 7)])
    copy = cache.clone()
    assert copy.slots[1] == OtherSlot("Rotating", 7) and copy.slots[1] is not cache.slots[1]
    copy.slots[1].current_seq_len = 9
    assert cache.slots[1].current_seq_len == 7
    assert not copy.slots[1].supports_per_sequence_len()
