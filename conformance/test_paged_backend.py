"""The paged backend (`raggedspec.gpu.paged_backend.PagedBackend`, cache-and-draft.md §3, §4.4,
§5.2): its slots one method at a time, then against the reference end to end.

One method per case: the page pool (one store per head geometry, dtype and device),
`PagedKv`'s append, clone, strip and bake as the slot protocol states them (the reference's
host arithmetic: `current`, `capacity`, `lead`), the row handles of clone-out,
`stack_paged`'s refusals, and the backend's draft-group ops on paged slots; each expected
value read off the docstrings and the reference's capacity rule (512-column blocks).

Against the reference: a per-sequence lifecycle (build, clone-in with pending leads, append,
attention, the forward's zero baking, rollback, clone-out, commit, strip) on the paged
backend, the in-place torch backend and the NumPy reference, every row's visible cache
compared after every operation and the attention read through the block table compared
with the in-place port's, page sizes 1 to 16; generated and fixed simulator scenarios on the
paged backend, and a derandomized subset of the per-method conformance run on it. The layout
itself (the store and the block table) is test_paged.py's.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from raggedspec.conformance import test_backend as per_method
from raggedspec.conformance.backends import (
    BACKEND_ENV,
    assert_same_cache,
    compare_runs,
    reference_backend,
)
from raggedspec.conformance.test_end_to_end import FIXED, run_both, scenarios
from raggedspec.gpu.attention import dsv4_attention_in_place
from raggedspec.gpu.backend import TorchBackend
from raggedspec.gpu.cache import RaggedKv
from raggedspec.gpu.paged import PagedRaggedKv
from raggedspec.gpu.paged_backend import (
    DEFAULT_PAGE_SIZE,
    PagedBackend,
    PagedKv,
    PagedRowKv,
    PagePool,
    dense,
    stack_paged,
)
from raggedspec.gpu.slots import TorchKv
from raggedspec.gpu.testing import DEVICE
from raggedspec.gpu.xs_rolling import XsRolling
from raggedspec.reference.backend import NumpyBackend
from raggedspec.reference.cache import NormalCache
from raggedspec.reference.errors import AlignRefusal, CacheRefusal


def _kv(b: int, n: int, first: float = 1.0, d: int = 2, dv: int = 3):
    """K `[b, 1, n, d]` with column j of row i holding first + 10 i + j, V its negation."""
    vals = first + 10 * torch.arange(b, dtype=torch.float64)[:, None] + torch.arange(n)[None, :]
    vals = vals.to(DEVICE)
    return (vals[:, None, :, None].expand(b, 1, n, d).clone(),
            -vals[:, None, :, None].expand(b, 1, n, dv).clone())


def _front(slot) -> list[list[float]]:
    """The slot's front-aligned K (head 0, dim 0) per row."""
    return slot.front_aligned()[0][:, 0, :, 0].tolist()


def refuses(exc, text, fn, *args):
    with pytest.raises(exc) as info:
        fn(*args)
    assert str(info.value) == text


@pytest.mark.rule("paged KV backend slots, one method per case")
def test_a_pool_keeps_one_store_per_geometry_dtype_and_device():
    refuses(ValueError, "page_size 0 must be >= 1", PagePool, 0)
    pool = PagePool(3)
    a = pool.store(1, 2, 3, torch.float64, DEVICE)
    assert pool.store(1, 2, 3, torch.float64, DEVICE) is a and a.page_size == 3
    f64, f32 = torch.float64, torch.float32
    others = [pool.store(2, 2, 3, f64, DEVICE), pool.store(1, 4, 3, f64, DEVICE),
              pool.store(1, 2, 5, f64, DEVICE), pool.store(1, 2, 3, f32, DEVICE),
              pool.store(1, 2, 3, f64, "meta")]
    assert len({id(s) for s in [a, *others]}) == 6 and len(pool.stores) == 6
    assert (others[0].k.shape[1], others[1].k.shape[3], others[2].v.shape[3]) == (2, 4, 5)
    assert others[3].dtype == torch.float32 and others[4].k.device.type == "meta"
    assert PagedBackend().pool.page_size == DEFAULT_PAGE_SIZE == 16
    assert PagedBackend(page_size=2).pool.page_size == 2 and PagedBackend().name == "paged"


@pytest.mark.rule("paged KV backend slots, one method per case")
def test_the_first_append_materializes_the_slot_in_pages():
    pool = PagePool(2)
    slot = PagedKv(4096, pool)
    assert slot.kv is None and slot.capacity == 512 and slot.current == 0 and slot.lead is None
    k, v = _kv(2, 3)
    slot.append(k, v)
    assert isinstance(slot.kv, PagedRaggedKv) and list(pool.stores.values()) == [slot.kv.store]
    assert slot.kv.store.dtype == torch.float64 and slot.kv.store.page_size == 2
    assert slot.current == 3 and slot.lead.tolist() == [0, 0] and slot.lead.dtype == np.int64
    assert _front(slot) == [[1.0, 2.0, 3.0], [11.0, 12.0, 13.0]]
    slot.append(*_kv(2, 1, 4.0))
    assert slot.current == 4 and _front(slot)[0] == [1.0, 2.0, 3.0, 4.0]
    assert slot.kv.host_lens().tolist() == [4, 4]


@pytest.mark.rule("paged KV backend slots, one method per case")
def test_an_append_grows_the_capacity_by_blocks_and_is_refused_above_max_seq_len():
    slot = PagedKv(1024, PagePool(4), capacity=4)
    slot.append(*_kv(1, 3))
    assert slot.capacity == 4
    slot.append(*_kv(1, 2))  # 5 > 4: one 512-column block
    assert slot.capacity == 516 and slot.current == 5
    small = PagedKv(6, PagePool(4), capacity=4)
    small.append(*_kv(1, 4))
    with pytest.raises(CacheRefusal) as info:
        small.append(*_kv(1, 1))
    assert str(info.value) == "kv-cache capacity 516 would be above max_seq_len 6"
    assert small.current == 4 and small.capacity == 4 and small.kv.host_lens().tolist() == [4]


@pytest.mark.rule("paged KV backend slots, one method per case")
def test_a_dense_batch_assigned_to_a_slot_is_adopted_into_the_pool():
    pool = PagePool(2)
    slot = PagedKv(4096, pool)
    k, v = _kv(3, 4)
    slot.kv = RaggedKv(k.float(), v.float(), [4, 0, 2], 64)
    got = slot.kv
    assert isinstance(got, PagedRaggedKv) and list(pool.stores.values()) == [got.store]
    assert got.store.dtype == torch.float32 and got.store.k.shape[1:] == (1, 2, 2)
    assert got.host_lens().tolist() == [4, 0, 2] and got.max_seq_len == 64
    assert got.k[0, 0, :4, 0].tolist() == [1.0, 2.0, 3.0, 4.0]
    assert got.v[2, 0, :2, 2].tolist() == [-21.0, -22.0]
    assert got.table[1].tolist() == [0, 0]  # the empty row holds no page
    paged = PagedRaggedKv.empty(pool.store(1, 2, 3, torch.float64, DEVICE), 1, 64)
    slot.kv = paged
    assert slot.kv is paged


@pytest.mark.rule("paged KV backend slots, one method per case")
def test_a_clone_keeps_the_metadata_over_independent_pages():
    pool = PagePool(2)
    slot = PagedKv(4096, pool, capacity=8)
    assert slot.clone().kv is None and slot.clone().capacity == 8
    slot.append(*_kv(1, 3))
    c = slot.clone()
    assert (c.max_seq_len, c.capacity, c.current, c.lead.tolist(), c.pool) == (4096, 8, 3, [0],
                                                                              pool)
    c.append(*_kv(1, 1, 9.0))
    assert _front(slot) == [[1.0, 2.0, 3.0]] and _front(c) == [[1.0, 2.0, 3.0, 9.0]]


@pytest.mark.rule("paged KV backend slots, one method per case")
def test_a_strip_shrinks_the_lead_first_then_advances_the_row():
    pool = PagePool(2)
    slot = PagedKv(4096, pool, capacity=8)
    slot.append(*_kv(2, 4))
    slot.lead = np.array([1, 0])  # row 0: one dead column in front of 3 own
    slot.kv.advance(np.array([1, 0]))
    slot.drop_front(0)
    assert slot.capacity == 8 and slot.current == 4 and slot.lead.tolist() == [1, 0]
    writes = slot.kv.store.moved["write"]
    slot.drop_front(2)
    assert slot.lead.tolist() == [0, 0] and slot.current == 2 and slot.capacity == 6
    assert slot.kv.host_lens().tolist() == [2, 2] and slot.kv.start.tolist() == [2, 2]
    assert _front(slot) == [[3.0, 4.0], [13.0, 14.0]] and slot.kv.store.moved["write"] == writes
    refuses(CacheRefusal, "cannot drop a 3-column dead prefix from a slot that holds only 2",
            slot.drop_front, 3)


@pytest.mark.rule("paged KV backend slots, one method per case")
def test_bake_turns_alignment_offsets_into_zero_columns():
    pool = PagePool(2)
    slot = PagedKv(4096, pool)
    slot.append(*_kv(2, 2))
    slot.lead = np.array([2, 1])
    slot.kv.advance(np.array([2, 1]))  # rows hold 0 and 1 own columns of current 2
    refuses(ValueError, "rows would need dead prefixes [3, 0] longer than their alignment "
            "offsets [2, 1]", slot.bake, np.array([3, 0]))
    slot.bake(np.array([2, 1]))
    assert slot.kv.zlead.tolist() == [0, 0] and slot.lead.tolist() == [2, 1]
    slot.bake(np.array([0, 1]))
    assert slot.kv.zlead.tolist() == [2, 0] and slot.lead.tolist() == [0, 1]
    assert slot.lead.dtype == np.int64 and slot.kv.host_lens().tolist() == [2, 1]


@pytest.mark.rule("paged KV backend slots, one method per case")
def test_row_handles_share_the_batch_pages():
    pool = PagePool(2)
    empty = PagedKv(4096, pool, capacity=8, current=3)
    (only,) = empty.rows()
    assert (only.k, only.lead, only.current, only.capacity, only.shift) == (None, 0, 3, 8, 0)
    assert only.front_aligned() is None and only.pool is pool
    slot = PagedKv(4096, pool, capacity=8)
    slot.append(*_kv(2, 3))
    slot.lead = np.array([0, 1])
    slot.kv.advance(np.array([0, 1]))
    rows = slot.rows()
    assert [r.row for r in rows] == [0, 1] and [r.lead for r in rows] == [0, 1]
    assert all(r.k is slot.kv and r.shift == 0 and r.max_seq_len == 4096 for r in rows)
    assert rows[1].own == 2 and _front(rows[1]) == [[0.0, 12.0, 13.0]]
    c = rows[1].clone()
    assert isinstance(c, PagedRowKv) and (c.k, c.row, c.lead, c.current, c.pool) == (
        slot.kv, 1, 1, 3, pool)
    assert c.capacity == 8 and c.shift == 0 and c.max_seq_len == 4096


@pytest.mark.rule("paged KV backend slots, one method per case")
def test_stacking_paged_slots_and_its_refusals():
    pool = PagePool(2)
    refuses(ValueError, "concat_kv needs at least one slot", stack_paged, [], pool)
    a, b = PagedKv(4096, pool, capacity=8), PagedKv(4096, pool, capacity=520)
    a.append(*_kv(1, 3))
    b.append(*_kv(1, 3, 5.0))
    out = stack_paged([a, b], pool)
    assert out.capacity == 520 and out.current == 3 and out.lead.tolist() == [0, 0]
    assert _front(out) == [[1.0, 2.0, 3.0], [5.0, 6.0, 7.0]] and out.pool is pool
    blank = stack_paged([PagedKv(4096, pool, capacity=8, current=2),
                         PagedKv(4096, pool, capacity=16, current=2)], pool)
    assert blank.kv is None and blank.capacity == 16 and blank.current == 2
    refuses(ValueError, "cannot concatenate materialized and unmaterialized slots", stack_paged,
            [a, PagedKv(4096, pool)], pool)
    c = PagedKv(4096, pool, capacity=8)
    c.append(*_kv(1, 2))
    refuses(ValueError, "the port concatenates slots of one length only, got [3, 2]",
            stack_paged, [a, c], pool)
    t = TorchKv(4096, 8)
    t.append(*_kv(1, 3))
    refuses(ValueError, "row 1 is not a paged slot", stack_paged, [a, t], pool)


@pytest.mark.rule("paged KV backend slots, one method per case")
def test_the_backend_makes_paged_target_slots_and_stacks_layers():
    be = PagedBackend(page_size=4)

    class Cfg:
        compress_ratios = [0, 4]

    cache = be.new_target_cache(Cfg, 4096, 2)
    normal = [s for s in cache.slots if isinstance(s, PagedKv)]
    assert len(normal) == 2 and len(cache.slots) == 3
    assert all(s.pool is be.pool and s.max_seq_len == 4096 for s in normal)
    slot = be.kv_from_arrays(np.ones((1, 1, 3, 2)), np.ones((1, 1, 3, 2)), 4096, capacity=8)
    assert isinstance(slot, PagedKv) and slot.capacity == 8 and slot.current == 3
    assert slot.kv.store.page_size == 4 and slot.kv.k.dtype == torch.float64
    both = be.concat([slot, slot.rows()[0]])
    assert isinstance(both, PagedKv) and both.kv.batch == 2
    mixed = be.concat([slot, dense(slot)])
    assert isinstance(mixed, TorchKv) and not isinstance(mixed, PagedKv) and mixed.kv.batch == 2
    refuses(ValueError, f"layer 3 mixes slot kinds {sorted({slot.kind, cache.slots[2].kind})}",
            be._stack_layer, [slot, cache.slots[2]], 3, False)


@pytest.mark.rule("paged KV backend slots, one method per case")
def test_split_gives_g_pieces_of_table_rows():
    be = PagedBackend(page_size=2)
    slot = be.kv_from_arrays(*(x.cpu().numpy() for x in _kv(3, 2)), 4096, capacity=8)
    refuses(ValueError, "split_draft_cache needs g >= 1, got 0", be.split, slot, 0)
    (one,) = be.split(slot, 1)
    assert one is not slot and _front(one) == _front(slot)
    parts = be.split(slot, 2)
    assert [p.kv.batch for p in parts] == [2, 1] and all(isinstance(p, PagedKv) for p in parts)
    assert _front(parts[1]) == [[21.0, 22.0]] and parts[0].capacity == 8
    assert be.split(slot, 4) is None
    blank = be.split(PagedKv(4096, be.pool, capacity=8, current=2), 3)
    assert len(blank) == 3 and all(p.kv is None and p.capacity == 8 and p.current == 2
                                   for p in blank)
    t = TorchKv(4096, 8)
    t.append(*_kv(2, 2))
    assert [p.kv.batch for p in be.split(t, 2)] == [1, 1]


@pytest.mark.rule("paged KV backend slots, one method per case")
def test_dense_copies_rows_and_metadata_into_an_in_place_slot():
    pool = PagePool(2)
    blank = dense(PagedKv(4096, pool, capacity=8, current=2))
    assert type(blank) is TorchKv and blank.kv is None and blank.capacity == 8
    assert blank.current == 2 and blank.max_seq_len == 4096
    slot = PagedKv(4096, pool, capacity=8)
    slot.append(*_kv(2, 3))
    d = dense(slot)
    assert type(d) is TorchKv and d.lead.tolist() == [0, 0] and d.current == 3
    assert d.capacity == 8 and d.kv.max_seq_len == 4096 and _front(d) == _front(slot)
    d.kv.k.zero_()
    assert _front(slot)[0] == [1.0, 2.0, 3.0]  # a copy, not a view of the pages


@pytest.mark.rule("paged KV backend slots, one method per case")
def test_the_draft_group_op_aligns_in_place_copies_of_paged_slots():
    """Two one-row paged slots cut to their starts (2 and 1) and front-aligned to 2: an
    in-place slot of rows [1, 2] and [0, 5]; the paged slots keep their rows."""
    be = PagedBackend(page_size=2)
    a, b = (be.kv_from_arrays(*(x.cpu().numpy() for x in _kv(1, 3, f)), 4096) for f in (1.0, 5.0))
    out = be.front_align_draft_group([a, b], [2, 1])
    assert type(out) is TorchKv and out.current == 2 and out.capacity == 2
    assert _front(out) == [[1.0, 2.0], [0.0, 5.0]]
    assert _front(a) == [[1.0, 2.0, 3.0]] and _front(b) == [[5.0, 6.0, 7.0]]


@pytest.mark.rule("paged KV backend slots, one method per case")
def test_a_strip_of_one_column_cuts_only_the_rows_it_reaches():
    """Leads [2, 0], a strip of 1: row 0 loses one of its two dead columns (its run stays),
    row 1 one own column; current and capacity go down by 1."""
    pool = PagePool(2)
    slot = PagedKv(4096, pool, capacity=8)
    slot.append(*_kv(2, 4))
    slot.lead = np.array([2, 0])
    slot.kv.advance(np.array([2, 0]))
    slot.drop_front(1)
    assert slot.lead.tolist() == [1, 0] and slot.current == 3 and slot.capacity == 7
    assert slot.kv.start.tolist() == [2, 1] and slot.kv.host_lens().tolist() == [2, 3]
    assert _front(slot) == [[0.0, 3.0, 4.0], [12.0, 13.0, 14.0]]
    assert PagePool(1).page_size == 1


@pytest.mark.rule("paged KV backend slots, one method per case")
def test_bake_keeps_the_lead_as_host_int64():
    slot = PagedKv(4096, PagePool(2))
    slot.append(*_kv(1, 2))
    slot.lead = np.array([2])
    slot.kv.advance(np.array([2]))
    slot.bake(np.array([1], np.int32))
    assert slot.lead.dtype == np.int64 and slot.lead.tolist() == [1]


@pytest.mark.rule("paged KV backend slots, one method per case")
def test_stacked_row_handles_keep_their_leads_and_stay_appendable():
    pool = PagePool(2)
    slot = PagedKv(4096, pool, capacity=8)
    slot.append(*_kv(2, 3))
    slot.lead = np.array([0, 1])
    slot.kv.advance(np.array([0, 1]))
    out = stack_paged(slot.rows(), pool)
    assert out.lead.tolist() == [0, 1] and out.kv.host_lens().tolist() == [3, 2]
    assert _front(out) == [[1.0, 2.0, 3.0], [0.0, 12.0, 13.0]]
    blank = stack_paged([PagedKv(4096, pool, current=0)] * 2, pool)
    blank.append(*_kv(2, 1))
    assert _front(blank) == [[1.0], [11.0]]
    be = PagedBackend(page_size=2)
    both = be.concat([slot, slot])
    both.append(*_kv(4, 1, 50.0))
    assert [r[-1] for r in _front(both)] == [50.0, 60.0, 70.0, 80.0]
    pieces = be.split(slot, 2)
    for piece in pieces:
        piece.append(*_kv(1, 1, 90.0))
    assert [_front(q)[0][-1] for q in pieces] == [90.0, 90.0]
    blanks = be.split(PagedKv(4096, be.pool), 2)
    blanks[0].append(*_kv(1, 1))
    assert _front(blanks[0]) == [[1.0]]


@pytest.mark.rule("paged KV backend slots, one method per case")
def test_the_backend_keeps_its_device_and_dtype_and_its_xs_slots_geometry():
    be = PagedBackend(device="meta", dtype="float32", page_size=4)
    assert be.dev.type == "meta" and be.dtype == "float32" and be.tdtype == torch.float32

    class Cfg:
        compress_ratios = [0, 1, 4]

    cache = be.new_target_cache(Cfg, 1024, 3)
    xs = [s for s in cache.slots if isinstance(s, XsRolling)]
    assert [s.ratio for s in xs] == [1, 4] and len(cache.slots) == 5
    assert all(s.max_seq_len == 1024 and len(s.tokens) == 3 and s.device.type == "meta"
               for s in xs)


@pytest.mark.rule("paged KV backend slots, one method per case")
def test_clone_in_on_paged_slots_is_the_reference_clone_in():
    """Two sequences (3 and 5 columns), pending leads [1, 0]: the lead pad, the ragged-decode
    flag and every row's front-aligned cache are the NumPy reference's."""
    ref, be = NumpyBackend(), PagedBackend(page_size=2)
    arrays = [tuple(x.cpu().numpy() for x in _kv(1, n, 10.0 * n)) for n in (3, 5)]
    mine = [NormalCache([be.kv_from_arrays(k, v, 4096)]) for k, v in arrays]
    theirs = [NormalCache([ref.kv_from_arrays(k, v, 4096)]) for k, v in arrays]
    got, want = be.clone_in(mine, [1, 0], False, True), ref.clone_in(theirs, [1, 0], False, True)
    assert got.lead_pad == list(want.lead_pad) and all(type(x) is int for x in got.lead_pad)
    assert got.ragged_decode_supported == want.ragged_decode_supported
    slot = got.batched.slots[0]
    assert isinstance(slot, PagedKv) and slot.current == want.batched.slots[0].current_seq_len
    k_want = ref.materialize(want.batched)["kv"][0][0]
    assert np.array_equal(slot.front_aligned()[0].cpu().numpy(), k_want)

    (single,) = [NormalCache([be.kv_from_arrays(*arrays[0], 4096)])]
    one = be.clone_in([single], [0], False, True)
    assert one.batched.slots[0].kv.batch == 1 and one.batched.slots[0].pool is be.pool
    assert slot.pool is be.pool


@pytest.mark.rule("paged KV backend slots, one method per case")
@pytest.mark.parametrize("xs_per_seq", [False, True])
def test_clone_in_stacks_xs_slots_as_the_reference_does(xs_per_seq):
    """Caches with a compressed layer (ratio 4: two K/V slots and an XsRolling slot), one
    slot holding 3 columns: clone-in (not per sequence) with shared or per-sequence xs state
    gives the reference's lead pad, ragged-decode flag and caches, xs included."""
    ref, be = NumpyBackend(), PagedBackend(page_size=2)

    class Cfg:
        compress_ratios = [0, 4]

    mine, theirs = ([b.new_target_cache(Cfg, 4096, 1) for _ in range(2)] for b in (be, ref))
    for n, (c, r) in enumerate(zip(mine, theirs, strict=True)):
        k = np.full((1, 1, 3, 2), n + 1.0)
        be.kv_append(c.slots[0], k, k)
        ref.kv_append(r.slots[0], k, k)
    got = be.clone_in(mine, [0, 0], xs_per_seq, False)
    want = ref.clone_in(theirs, [0, 0], xs_per_seq, False)
    assert got.lead_pad == list(want.lead_pad)
    assert got.ragged_decode_supported == want.ragged_decode_supported
    assert_same_cache(be.materialize(got.batched), ref.materialize(want.batched), "float64",
                      "clone-in with xs slots")
    # per sequence, the front alignment runs first and refuses the unmaterialized slot 1
    text = ("sequence 0 slot 1: front_pad to 3: the slot's buffer is unmaterialized (0 live "
            "positions)")
    for b_, caches in ((be, mine), (ref, theirs)):
        with pytest.raises(CacheRefusal) as info:
            b_.clone_in(caches, [0, 0], xs_per_seq, True)
        assert str(info.value) == text


@pytest.mark.rule("paged KV backend slots, one method per case")
def test_concat_takes_in_place_row_handles_beside_paged_slots():
    be = PagedBackend(page_size=2)
    paged = be.kv_from_arrays(*(x.cpu().numpy() for x in _kv(1, 3)), 4096)
    t = TorchKv(4096, 8)
    t.append(*_kv(1, 3, 5.0))
    out = be.concat([paged, t.rows()[0]])
    assert type(out) is TorchKv and _front(out) == [[1.0, 2.0, 3.0], [5.0, 6.0, 7.0]]
    both = be.concat([paged, paged])
    assert both.pool is be.pool and all(q.pool is be.pool for q in be.split(both, 2))


@pytest.mark.rule("paged KV backend slots, one method per case")
def test_clone_in_reconciles_shared_xs_bases_and_keeps_per_sequence_ones():
    """Two sequences whose xs slots saw 8 tokens with bases 0 and 4: a batch with shared xs
    state gives every row the largest base (uniform tokens), a per-sequence one keeps each
    row's own."""
    be = PagedBackend(page_size=2)

    class Cfg:
        compress_ratios = [0, 4]

    for xs_per_seq, bases in ((False, [4, 4]), (True, [0, 4])):
        caches = [be.new_target_cache(Cfg, 4096, 1) for _ in range(2)]
        for n, c in enumerate(caches):
            be.kv_append(c.slots[0], *(np.full((1, 1, 3, 2), n + 1.0),) * 2)
            c.slots[2].tokens, c.slots[2].base = np.array([8]), np.array([4 * n])
        xs = be.clone_in(caches, [0, 0], xs_per_seq, False).batched.slots[2]
        assert xs.base.tolist() == bases and xs.tokens.tolist() == [8, 8]


@pytest.mark.rule("paged KV backend slots, one method per case")
def test_a_draft_group_with_a_non_normal_row_is_the_reference_refusal():
    be = PagedBackend(page_size=2)
    paged = be.kv_from_arrays(np.ones((1, 1, 3, 2)), np.ones((1, 1, 3, 2)), 4096)
    xs = XsRolling(4, max_seq_len=4096, batch=1)
    refuses(AlignRefusal, "draft row 1 is a XsRolling slot, not Normal",
            be.front_align_draft_group, [paged, xs], [2, 2])


@pytest.mark.rule("paged KV backend slots, one method per case")
def test_a_slot_puts_its_pages_on_the_device_of_its_first_append():
    """Placement (torch's meta device runs on any machine): the store the first append asks
    the pool for sits where the appended columns are."""
    pool = PagePool(2)
    slot = PagedKv(4096, pool)
    slot.append(torch.zeros((1, 1, 1, 2), device="meta"), torch.zeros((1, 1, 1, 3), device="meta"))
    assert slot.kv.store.k.device.type == "meta" and slot.kv.lens.device.type == "meta"


# --- against the reference ---------------------------------------------------------------

REF = reference_backend()
DENSE = TorchBackend()
PAGE_SIZES = [1, 2, 3, 4, 5, 16]


def _small_ints(rng: np.random.Generator, n: int, d: int) -> tuple[np.ndarray, np.ndarray]:
    """Small integers (exact in every dtype), never zero so a dead column shows."""
    return (rng.integers(1, 50, size=(1, 1, n, d)).astype(np.float64),
            -rng.integers(1, 50, size=(1, 1, n, d)).astype(np.float64))


VIEW = PagedBackend()


def _same(paged, ref, what: str) -> None:
    assert_same_cache(VIEW.materialize(paged), REF.materialize(ref), "float64", what)


def _attention_matches(pslot: PagedKv, dslot, rng: np.random.Generator, window: int) -> None:
    """The port's in-place attention read through the block table equals it on the in-place
    layout holding the same rows (the in-place port is itself pinned to the reference)."""
    own = pslot.kv.host_lens()
    assert np.array_equal(own, dslot.kv.host_lens()), (own, dslot.kv.host_lens())
    t_q = int(rng.integers(1, max(int(own.min()), 1) + 1))
    if own.min() < 1:
        return
    d = pslot.kv.k.shape[3]
    q = torch.from_numpy(rng.standard_normal((len(own), 2, t_q, d)))
    got = dsv4_attention_in_place(q, pslot.kv, None, 0, window)
    want = dsv4_attention_in_place(q, dslot.kv, None, 0, window)
    assert torch.allclose(got, want, rtol=1e-12, atol=1e-12), (got - want).abs().max()


@pytest.mark.slow
@pytest.mark.rule("paged KV: every row's view through its block table")
@settings(deadline=None)
@given(lens=st.lists(st.integers(1, 12), min_size=1, max_size=4), d=st.sampled_from([2, 3]),
       page=st.sampled_from(PAGE_SIZES), seed=st.integers(0, 10_000), data=st.data())
def test_every_operation_on_pages_leaves_the_reference_view(lens, d, page, seed, data):
    """After every operation of per-sequence steps, each row's visible cache (front-aligned
    K and V, length, capacity) on the paged backend is the reference's, bit for bit, and
    attention read through the block table is the in-place port's."""
    rng = np.random.default_rng(seed)
    be = PagedBackend(page_size=page)
    rows = [_small_ints(rng, n, d) for n in lens]
    port = [NormalCache([be.kv_from_arrays(k, v, 4096)]) for k, v in rows]
    dense = [NormalCache([DENSE.kv_from_arrays(k, v, 4096)]) for k, v in rows]
    ref = [NormalCache([REF.kv_from_arrays(k, v, 4096)]) for k, v in rows]
    for i, (p, r) in enumerate(zip(port, ref, strict=True)):
        _same(p, r, f"row {i} built")
    for step in range(data.draw(st.integers(1, 3), label="steps")):
        held = [c.current_seq_len for c in ref]
        pending = [data.draw(st.integers(0, min(2, h)), label="pending lead") for h in held]
        pci = be.clone_in(port, pending, False, True)
        dci = DENSE.clone_in(dense, pending, False, True)
        rci = REF.clone_in(ref, pending, False, True)
        assert pci.lead_pad == rci.lead_pad == dci.lead_pad
        pb, db, rb = pci.batched, dci.batched, rci.batched
        _same(pb, rb, f"step {step} cloned in")
        t = data.draw(st.integers(1, 4), label="append")
        k, v = _small_ints(rng, t * len(lens), d)
        k, v = k.reshape(len(lens), 1, t, d), v.reshape(len(lens), 1, t, d)
        for be_, c in ((be, pb), (DENSE, db), (REF, rb)):
            be_.kv_append(c.slots[0], k, v)
        _same(pb, rb, f"step {step} appended")
        if data.draw(st.booleans(), label="bake"):  # the forward's zero columns in front
            lead = pb.slots[0].lead
            dead = np.array([data.draw(st.integers(0, int(x)), label="dead") for x in lead],
                            np.int64)
            pb.slots[0].bake(dead)
            db.slots[0].bake(dead)
            _same(pb, rb, f"step {step} baked")
        _attention_matches(pb.slots[0], db.slots[0], rng, data.draw(st.sampled_from([1, 3, 128])))
        if data.draw(st.booleans(), label="cohort rollback"):
            n_drop = data.draw(st.integers(0, t), label="n_drop")
            for be_, c in ((be, pb), (DENSE, db), (REF, rb)):
                be_.truncate_by(c, n_drop)
            _same(pb, rb, f"step {step} rolled back by {n_drop}")
            _attention_matches(pb.slots[0], db.slots[0], rng, 3)
        b = len(lens)
        port, dense, ref = be.clone_out(pb, b), DENSE.clone_out(db, b), REF.clone_out(rb, b)
        for i in range(len(lens)):
            _same(port[i], ref[i], f"step {step} row {i} cloned out")
            lead, own = rci.lead_pad[i], held[i] - pending[i]
            room = max(0, ref[i].current_seq_len - lead - own)
            committed = data.draw(st.integers(0, room), label="committed")
            if data.draw(st.booleans(), label="commit"):
                for be_, c in ((be, port[i]), (DENSE, dense[i]), (REF, ref[i])):
                    be_.commit(c, lead, own + committed, own + committed)
                _same(port[i], ref[i], f"step {step} row {i} committed {committed}")
            elif lead:
                for be_, c in ((be, port[i]), (DENSE, dense[i]), (REF, ref[i])):
                    be_.strip_dead_prefix(c.slots[0], lead)
                _same(port[i], ref[i], f"step {step} row {i} stripped {lead}")


@pytest.mark.rule("paged KV: every row's view through its block table")
@settings(max_examples=4, deadline=None)
@given(data=scenarios, page=st.sampled_from([1, 3, 16]))
def test_generated_scenarios_match_the_reference_on_pages(data, page):
    """The end-to-end property on the paged backend (a short derandomized subset; the full
    file runs with `RAGGEDSPEC_BACKEND=paged`)."""
    port, ref, be = run_both(data, port=PagedBackend(page_size=page))
    counts = compare_runs(port, ref, be.dtype)
    assert counts["forwards"] >= 1 or not any(s["phase"] != "idle" for s in ref.steps())


@pytest.mark.rule("paged KV: every row's view through its block table")
@pytest.mark.parametrize("case", [0, 3, 8])
def test_fixed_scenarios_match_the_reference_on_pages(case):
    port, ref, be = run_both(FIXED[case], port=PagedBackend(page_size=3))
    counts = compare_runs(port, ref, be.dtype)
    assert counts["forwards"] >= 3 and counts["tensors"] > 20


@pytest.mark.rule("paged KV: every row's view through its block table")
@pytest.mark.parametrize("name", ["test_append_growth_and_set_len_match_the_reference",
                                  "test_front_align_concat_split_and_strip_match_the_reference",
                                  "test_a_ragged_verify_step_matches_the_reference"])
def test_per_method_conformance_on_pages(name, monkeypatch):
    """A subset of `test_backend.py` with the paged backend under test."""
    monkeypatch.setenv(BACKEND_ENV, "paged")
    assert per_method.port().name == "paged"
    getattr(per_method, name)()
