"""Draft-group alignment: batch_draft_caches, front_align_draft_group, split_draft_cache and
the draft dead prefix (cache-and-draft.md §9.6-§9.8, §17.3), with their integer host halves
(`draft_caches_batchable`, `draft_group_target`) and what the split carries over
(unmaterialized slots, dtype, retain window). The port's draft groups are rows of its pooled
draft KV, aligned by `gpu.draft_loop` with these integer halves (tested with the draft loop).

Expected values come from the spec's worked examples or from oracles written here (a copy of
each row's slot taken before alignment, plain Python lists of column values).
"""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from raggedspec.conformance.helpers import draft_slot, k_row
from raggedspec.reference.align import (
    _chunk_sizes,
    batch_draft_caches,
    clone_out_cache,
    concat_kv,
    draft_caches_batchable,
    draft_group_target,
    drop_dead_prefix,
    front_align_draft_group,
    split_draft_cache,
)
from raggedspec.reference.cache import KvCache, NormalCache, OtherSlot, SingleCache
from raggedspec.reference.dispatch import resolve_draft_leads
from raggedspec.reference.errors import AlignRefusal, CacheRefusal

# --- §9.6 batch_draft_caches ----------------------------------------------------------------

@pytest.mark.rule("batch concatenation", "batch_draft_caches")
def test_batch_draft_caches_concatenates_a_uniform_group():
    slots = [draft_slot(6, 16, m) for m in (100, 200, 300)]
    out = batch_draft_caches(slots)
    assert out.current_seq_len == 6 and out.k.capacity_seq_len == 16
    assert out.k.data.shape == (3, 1, 16, 1)
    assert [list(out.k.data[r, 0, :6, 0]) for r in range(3)] == [
        list(range(m, m + 6)) for m in (100, 200, 300)
    ]
    assert list(out.v.data[2, 0, :2, 0]) == [1300, 1301]


@pytest.mark.rule("batch_draft_caches")
def test_batch_draft_caches_refusals_return_none():
    assert batch_draft_caches([]) is None
    assert batch_draft_caches([draft_slot(6, 16, 1), draft_slot(7, 16, 2)]) is None  # length
    assert (
        batch_draft_caches([draft_slot(6, 16, 1), draft_slot(6, 528, 2)]) is None
    )  # capacity history
    assert batch_draft_caches([draft_slot(6, 16, 1), OtherSlot("Rotating", 6)]) is None       # kind
    assert batch_draft_caches([OtherSlot("Rotating", 6), draft_slot(6, 16, 1)]) is None
    bare = KvCache(SingleCache(4096, 16, 6), SingleCache(4096, 16, 6))
    assert batch_draft_caches([draft_slot(6, 16, 1), bare]) is None  # unmaterialized
    wide = draft_slot(6, 16, 2)
    wide.k.data = np.zeros((1, 1, 16, 2))
    assert batch_draft_caches([draft_slot(6, 16, 1), wide]) is None  # concat fails


@pytest.mark.rule("batch_draft_caches")
def test_batch_draft_caches_one_member_is_a_plain_clone_and_metadata_is_the_first():
    one = draft_slot(6, 16, 100)
    out = batch_draft_caches([one])
    assert (
        out is not one and out.k.data is not one.k.data and np.array_equal(out.k.data, one.k.data)
    )
    a, b = draft_slot(6, 16, 1), draft_slot(6, 16, 2)
    b.k.max_seq_len = b.v.max_seq_len = 8192
    assert batch_draft_caches([a, b]).k.max_seq_len == 4096


# --- §9.7 front_align_draft_group ------------------------------------------------------------

@pytest.mark.rule("front_align_draft_group")
def test_a_ragged_draft_group_is_left_aligned_where_the_old_path_refused_it():
    slots = [draft_slot(9, 32, m) for m in (100, 200, 300)]
    assert batch_draft_caches(slots) is not None  # equal live/capacity: Some before alignment
    out = front_align_draft_group(slots, [7, 4, 6])
    assert out.current_seq_len == 7 and out.k.capacity_seq_len == 7 and out.v.current_seq_len == 7
    assert out.k.data.shape == (3, 1, 7, 1) and out.k.data.size == 21
    assert list(out.k.data[0, 0, :, 0]) == list(range(100, 107))
    assert list(out.k.data[1, 0, :, 0]) == [0, 0, 0, 200, 201, 202, 203]
    assert list(out.k.data[2, 0, :, 0]) == [0] + list(range(300, 306))
    assert list(out.v.data[1, 0, :, 0]) == [0, 0, 0, 1200, 1201, 1202, 1203]
    assert [s.current_seq_len for s in slots] == [9, 9, 9]  # inputs untouched


@pytest.mark.rule("front_align_draft_group")
def test_front_align_draft_group_refuses_a_mismatched_or_over_long_group():
    slots = [draft_slot(9, 32, 100), draft_slot(9, 32, 200)]
    with pytest.raises(AlignRefusal, match=r"2 cache\(s\) for 1 chain start"):
        front_align_draft_group(slots, [7])
    with pytest.raises(AlignRefusal, match="chain start 20") as e:
        front_align_draft_group(slots, [7, 20])  # 20 <= capacity 32: set_len alone would allow it
    assert "9" in str(e.value)
    with pytest.raises(AlignRefusal):
        front_align_draft_group([], [])
    with pytest.raises(AlignRefusal, match="Rotating"):
        front_align_draft_group([slots[0], OtherSlot("Rotating", 9)], [7, 4])
    with pytest.raises(AlignRefusal, match="unmaterialized"):
        front_align_draft_group(
            [slots[0], KvCache(SingleCache(4096, 16, 9), SingleCache(4096, 16, 9))], [7, 4]
        )


@pytest.mark.rule("front_align_draft_group")
def test_front_align_draft_group_pad_refusal_propagates():
    a = draft_slot(9, 16, 100)
    b = draft_slot(9, 16, 200)
    b.k.max_seq_len = b.v.max_seq_len = 8  # padding row b to width 9 needs capacity 16 > 8
    with pytest.raises(CacheRefusal, match="above max_seq_len"):
        front_align_draft_group([a, b], [9, 4])


# --- §9.8 split_draft_cache ------------------------------------------------------------------

@pytest.mark.rule("split_draft_cache and the draft strip")
def test_split_draft_cache_chunks_on_dim_0_with_the_batched_metadata():
    batched = front_align_draft_group([draft_slot(9, 32, m) for m in (100, 200, 300)], [7, 4, 6])
    rows = split_draft_cache(batched, 3)
    assert [r.current_seq_len for r in rows] == [7, 7, 7]
    assert [r.k.capacity_seq_len for r in rows] == [7, 7, 7]
    assert k_row(rows[1]) == [0, 0, 0, 200, 201, 202, 203]
    assert list(rows[2].v.data[0, 0, :, 0]) == [0] + list(range(1300, 1306))
    one = split_draft_cache(batched, 1)
    assert len(one) == 1 and one[0] is not batched and np.array_equal(one[0].k.data, batched.k.data)
    assert split_draft_cache(concat_kv([draft_slot(4, 16, 1), draft_slot(4, 16, 2)]), 3) is None
    with pytest.raises(ValueError, match=r"^split_draft_cache needs g >= 1, got 0$"):
        split_draft_cache(batched, 0)


@pytest.mark.rule("split_draft_cache and the draft strip")
def test_a_uniform_draft_group_round_trips_through_the_batched_cache_unchanged():
    slots = [draft_slot(6, 16, m) for m in (100, 200, 300)]
    starts = [s.current_seq_len for s in slots]
    assert len(set(starts)) == 1  # resolve_draft_leads -> None: the uniform path
    batched = batch_draft_caches(slots)
    batched.set_len(starts[0])
    rows = split_draft_cache(batched, 3)
    for row, orig in zip(rows, slots, strict=False):
        k, v = row.k.data, row.v.data
        drop_dead_prefix(row, 0)
        assert row.k.data is k and row.v.data is v  # structurally untouched
        assert row.current_seq_len == 6
        assert (
            row.k.data.tobytes() == orig.k.data.tobytes()
            and row.v.data.tobytes() == orig.v.data.tobytes()
        )


# --- §17.3 the draft dead prefix does not survive ----------------------------------------------

def run_draft_group_loop(steps, strip, n_draft=3, advance=(3, 1, 2)):
    """Mirror of the group loop (§9.3) on real tensors: lengths and contents are read back off
    the slots, never recomputed."""
    slots = [draft_slot(7, 512, 100), draft_slot(4, 512, 200), draft_slot(6, 512, 300)]
    history = {}
    for k in range(1, steps + 1):
        starts = [s.current_seq_len for s in slots]                    # 1. starts = current lengths
        leads = resolve_draft_leads(True, starts)
        if leads is None:  # 2. align, then the chain block
            batched = batch_draft_caches(slots)
            batched.set_len(starts[0])
        else:
            batched = front_align_draft_group(slots, starts)
        block = np.zeros((3, 1, n_draft, 1))
        batched.append(block, block)
        rows = split_draft_cache(batched, 3)                            # 3. split, strip
        for slot_i, row in enumerate(rows):
            if strip:
                drop_dead_prefix(row, leads[slot_i] if leads else 0)
            live = row.current_seq_len                                  # 4. read back, then set_len
            row.set_len(live - n_draft + advance[slot_i])
        slots = rows
        history[k] = ([s.current_seq_len for s in slots], slots[1].k.data[0, 0, 0, 0])
    return history


@pytest.mark.rule("split_draft_cache and the draft strip")
def test_the_draft_dead_prefix_does_not_survive_into_the_per_sequence_caches():
    stripped = run_draft_group_loop(12, strip=True)
    assert stripped[1] == ([10, 5, 8], 200.0)
    assert stripped[6][0] == [25, 10, 18]
    assert stripped[12][0] == [43, 16, 30]
    for k in (1, 6, 12):
        assert stripped[k][0] == [7 + 3 * k, 4 + k, 6 + 2 * k]
        assert stripped[k][1] == 200.0
    control = run_draft_group_loop(12, strip=False)  # negative control: the strip removed
    for k in (1, 6, 12):
        lens, head = control[k]
        assert lens != stripped[k][0]
        assert head != 200.0
        assert sum(lens) > sum(stripped[k][0])
        assert lens == [7 + 3 * k, 5 + 3 * k, 6 + 3 * k]  # every row at the fastest row's rate
        assert max(lens) - min(lens) == 2


@pytest.mark.rule("split_draft_cache and the draft strip")
@given(st.data())
def test_the_draft_strip_keeps_every_row_on_its_own_length_and_content(data):
    n_rows = data.draw(st.integers(1, 8))
    starts = data.draw(st.lists(st.integers(1, 64), min_size=n_rows, max_size=n_rows))
    n_draft = data.draw(st.integers(1, 8))
    adv = data.draw(st.lists(st.integers(0, n_draft), min_size=n_rows, max_size=n_rows))
    spec_tail = data.draw(st.lists(st.integers(0, 9), min_size=n_rows, max_size=n_rows))
    caps = data.draw(st.lists(st.sampled_from([16, 40, 100]), min_size=n_rows, max_size=n_rows))
    steps = data.draw(st.integers(1, 4))
    # row r: live = start + a speculative tail the alignment must drop; capacity >= live
    slots = [
        draft_slot(s + t, max(c, s + t), 10_000 * (r + 1))
        for r, (s, t, c) in enumerate(zip(starts, spec_tail, caps, strict=False))
    ]
    originals = [s.clone() for s in slots]
    expect_k = [list(o.k.data[0, 0, :s, 0]) for o, s in zip(originals, starts, strict=False)]
    expect_v = [list(o.v.data[0, 0, :s, 0]) for o, s in zip(originals, starts, strict=False)]
    chain_starts = list(starts)
    for k in range(1, steps + 1):
        top = max(chain_starts)
        leads = [top - s for s in chain_starts]
        batched = front_align_draft_group(slots, chain_starts)
        assert batched.current_seq_len == top
        for j in range(n_draft):  # the chain: one column per step, row r marked
            col = np.array(
                [-(1000 * k + 100 * r + j) for r in range(n_rows)], dtype=np.float64
            ).reshape(n_rows, 1, 1, 1)
            batched.append(col, col - 0.5)
        rows = split_draft_cache(batched, n_rows)
        for r, row in enumerate(rows):
            drop_dead_prefix(row, leads[r])
            assert row.current_seq_len == chain_starts[r] + n_draft
            row.set_len(row.current_seq_len - n_draft + adv[r])
            chain = [-(1000 * k + 100 * r + j) for j in range(n_draft)][: adv[r]]
            expect_k[r] += chain
            expect_v[r] += [c - 0.5 for c in chain]
        slots = rows
        chain_starts = [s.current_seq_len for s in slots]
        assert chain_starts == [s + a * k for s, a in zip(starts, adv, strict=False)]
        for r, s in enumerate(slots):
            assert list(s.k.data[0, 0, : s.current_seq_len, 0]) == expect_k[r]
            assert list(s.v.data[0, 0, : s.current_seq_len, 0]) == expect_v[r]


@pytest.mark.rule("batch_draft_caches")
@pytest.mark.parametrize("kinds, mats, shapes, want", [
    ([], [], [], False),
    (["Rotating"], [False], [(0, 0)], True),  # one member always batches (a plain clone)
    (["Normal"] * 2, [True, True], [(7, 16), (7, 16)], True),
    (["Normal"] * 2, [True, False], [(7, 16), (7, 16)], False),
    (["Normal"] * 2, [True, True], [(7, 16), (6, 16)], False),
    (["Normal"] * 2, [True, True], [(7, 16), (7, 528)], False),
    (["Normal", "Rotating"], [True, True], [(7, 16), (7, 16)], False),
])
def test_draft_caches_batchable_by_hand(kinds, mats, shapes, want):
    """§9.6's host half: more than one member batches only all Normal, materialized and of
    one (current, capacity); the values are from the spec's list, not from the code."""
    assert draft_caches_batchable(kinds, mats, shapes) is want


# --- the integer halves and what the split carries over -----------------------------------


def bare_kv(live, cap=16, max_seq_len=4096, first_cached=0, retain=None):
    """A Normal slot whose two halves are unmaterialized (no buffer yet)."""
    return KvCache(SingleCache(max_seq_len, cap, live, first_cached, retain),
                   SingleCache(max_seq_len, cap, live, first_cached, retain))


def meta(sc):
    return (sc.max_seq_len, sc.capacity_seq_len, sc.current_seq_len, sc.first_cached,
            sc.retain_window)


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


@pytest.mark.rule("front_align_draft_group")
def test_a_draft_row_with_one_half_unmaterialized_is_refused():
    half = draft_slot(9, 16, 200)
    half.v.data = None
    with pytest.raises(AlignRefusal, match=r"^draft row 1's buffer is unmaterialized$"):
        front_align_draft_group([draft_slot(9, 16, 100), half], [7, 4])


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
