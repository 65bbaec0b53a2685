"""The paged-KV layout (`raggedspec.gpu.paged`, cache-and-draft.md §3, §4.4, §4.5): the page
store and the block-table batch, one rule at a time on small explicit cases, each expected
value read off the module's docstrings. The store: page 0 is the zero page nobody writes,
pages are allocated in order to their owner, the store grows to at least twice its pages (the
bytes it copies counted under "grow"), a write counts the bytes it stores in the store's
dtype. A batch: its view is the zero lead, then the logical columns from `start` on through
the table, grown in whole pages; an append writes at each row's end, copying a page it does
not own first (one writer per page); advance, prepend and stack change offsets only, so a
strip, a rollback, a commit and alignment under the backend move no K/V bytes (counted on
the store's one write method), which the benchmark's paged counts report.
test_paged_backend.py runs the backend's slots and the whole layout against the reference.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from raggedspec.bench.report import paged_cells
from raggedspec.gpu.backend import TorchBackend
from raggedspec.gpu.cache import RaggedKv
from raggedspec.gpu.paged import PagedRaggedKv, PageStore, stack_rows
from raggedspec.gpu.paged_backend import PagedBackend, PagedKv
from raggedspec.gpu.testing import DEVICE
from raggedspec.paged_moves import count_paged_moves
from raggedspec.reference.cache import NormalCache


def _store(page=4, heads=1, dim=2, v_dim=3, dtype=torch.float64) -> PageStore:
    return PageStore(heads, dim, v_dim, page, dtype, DEVICE)


def _cols(n: int, first: float, heads=1, dim=2, v_dim=3) -> tuple[torch.Tensor, torch.Tensor]:
    """One row of `n` columns: K column j holds first + j everywhere, V its negation
    (widened to v_dim), so every column is told apart and none is zero."""
    vals = first + torch.arange(n, dtype=torch.float64, device=DEVICE)
    k = vals[None, None, :, None].expand(1, heads, n, dim).clone()
    v = -vals[None, None, :, None].expand(1, heads, n, v_dim).clone()
    return k, v


def _row(kv: PagedRaggedKv, i: int) -> list[float]:
    """Row i's view of K over its length (head 0, dim 0)."""
    return kv.k[i, 0, : int(kv.host_lens()[i]), 0].tolist()


def _fill(kv: PagedRaggedKv, per_row: list[list[float]]) -> None:
    for i, first in enumerate(per_row):
        if first:
            k, v = _cols(len(first), first[0])
            kv.append(k, v, rows=[i])


@pytest.mark.rule("paged KV store and block table, one rule per case")
def test_a_new_store_holds_four_zero_pages_with_page_0_reserved():
    s = PageStore(2, 3, 5, 4, torch.float32, DEVICE)
    assert tuple(s.k.shape) == (4, 2, 4, 3) and tuple(s.v.shape) == (4, 2, 4, 5)
    assert s.k.dtype == s.v.dtype == torch.float32 and s.dtype == torch.float32
    assert s.k.device.type == s.v.device.type == DEVICE.type and s.device == DEVICE
    assert not s.k.any() and not s.v.any()
    assert s.page_size == 4 and s.used == 1 and s.owner.tolist() == [-1] * 4
    assert s.moved == {"write": 0, "grow": 0}
    wide = PageStore(1, 2, 2, 1, torch.float64, DEVICE)
    assert wide.k.dtype == wide.v.dtype == torch.float64


@pytest.mark.rule("paged KV store and block table, one rule per case")
def test_page_size_is_at_least_one():
    assert PageStore(1, 2, 2, 1, torch.float64, DEVICE).page_size == 1
    for bad in (0, -3):
        with pytest.raises(ValueError) as info:
            PageStore(1, 2, 2, bad, torch.float64, DEVICE)
        assert str(info.value) == f"page_size {bad} must be >= 1"


@pytest.mark.rule("paged KV store and block table, one rule per case")
def test_pages_are_allocated_in_order_to_their_owner():
    s = _store()
    assert s.alloc(2, 7).tolist() == [1, 2] and s.used == 3
    assert s.alloc(1, 9).tolist() == [3] and s.used == 4
    assert s.owner.tolist() == [-1, 7, 7, 9]
    assert s.alloc(0, 5).tolist() == [] and s.used == 4
    assert s.k.shape[0] == 4 and s.moved["grow"] == 0  # four pages held four: no growth


@pytest.mark.rule("paged KV store and block table, one rule per case")
def test_the_store_grows_to_at_least_twice_its_pages_and_counts_the_copy():
    """A growth copies the used pages (K and V bytes into "grow") into a store of
    max(needed, 2 n) pages; the new pages are zero and unowned."""
    s = _store()  # 4 pages of [1, 4, 2] K and [1, 4, 3] V, float64
    s.alloc(3, 1)
    s.alloc(1, 1)  # needs 5 > 4 pages: grows to 8
    page_bytes = 4 * (2 + 3) * 8
    assert s.k.shape[0] == s.v.shape[0] == 8 and s.owner.tolist() == [-1, 1, 1, 1, 1, -1, -1, -1]
    assert s.moved["grow"] == 4 * page_bytes and s.used == 5
    s.alloc(12, 2)  # needs 17 > 16 = 2 * 8: grows to 17 exactly
    assert s.k.shape[0] == 17 and len(s.owner) == 17 and s.owner[5:].tolist() == [2] * 12
    assert s.moved["grow"] == (4 + 5) * page_bytes
    assert not s.k.any() and not s.v.any()


@pytest.mark.rule("paged KV store and block table, one rule per case")
def test_reserve_makes_room_for_count_more_pages_now():
    s = _store()
    s.alloc(2, 1)  # 3 of 4 pages used
    s.reserve(3)  # room for 6: grows now, copying the 3 used pages
    grown, k = s.moved["grow"], s.k
    assert s.k.shape[0] == 8 and grown == 3 * 4 * (2 + 3) * 8
    s.alloc(3, 1)
    assert s.k is k and s.moved["grow"] == grown  # the three pages needed no growth
    s.reserve(2)  # 6 used + 2 = 8 held: nothing to do
    assert s.k is k and s.moved["grow"] == grown


@pytest.mark.rule("paged KV store and block table, one rule per case")
def test_a_write_stores_columns_in_the_store_dtype_and_counts_their_bytes():
    s = _store(dtype=torch.float32)
    pages = s.alloc(2, 1)
    k = torch.tensor([[[1.5, 2.5]], [[3.5, 4.5]]], dtype=torch.float64, device=DEVICE)
    v = torch.tensor([[[1.0, 2.0, 3.0]], [[4.0, 5.0, 6.0]]], dtype=torch.float64, device=DEVICE)
    s.write(np.array([pages[1], pages[0]]), np.array([3, 0]), k, v)
    assert s.moved["write"] == 2 * (2 + 3) * 4  # two columns of K and V, float32
    assert s.k.dtype == torch.float32
    assert s.k[pages[1], 0, 3].tolist() == [1.5, 2.5] and s.k[pages[0], 0, 0].tolist() == [3.5, 4.5]
    assert s.v[pages[1], 0, 3].tolist() == [1.0, 2.0, 3.0]
    rk, rv = s.read(np.array([[pages[0], pages[1]]]), np.array([[0, 3]]))
    assert tuple(rk.shape) == (1, 2, 1, 2) and tuple(rv.shape) == (1, 2, 1, 3)
    assert rk[0, :, 0].tolist() == [[3.5, 4.5], [1.5, 2.5]]
    assert rv[0, 1, 0].tolist() == [1.0, 2.0, 3.0]
    with pytest.raises(ValueError) as info:
        s.write(np.array([pages[0], 0]), np.array([1, 1]), k, v)
    assert str(info.value) == "a write into the zero page"
    assert not s.k[0].any() and s.moved["write"] == 2 * (2 + 3) * 4


@pytest.mark.rule("paged KV store and block table, one rule per case")
def test_an_empty_batch_has_no_pages_and_zero_width():
    s = _store()
    kv = PagedRaggedKv.empty(s, 3, 64)
    assert kv.table.shape == (3, 0) and kv.table.dtype == np.int64
    assert kv.start.tolist() == kv.zlead.tolist() == [0, 0, 0]
    assert kv.lens.tolist() == [0, 0, 0] and kv.host_lens().tolist() == [0, 0, 0]
    assert kv.width == kv.capacity == 0 and kv.batch == 3 and kv.max_seq_len == 64
    assert tuple(kv.k.shape) == (3, 1, 0, 2) and tuple(kv.v.shape) == (3, 1, 0, 3)
    assert kv.lens.device.type == DEVICE.type


@pytest.mark.rule("paged KV store and block table, one rule per case")
def test_the_view_grows_in_whole_pages_and_lengths_stay_within_it():
    kv = PagedRaggedKv.empty(_store(page=4), 2, 64)
    kv.reserve(5)
    assert kv.width == 8
    kv.reserve(8)
    kv.reserve(2)
    assert kv.width == 8
    kv.reserve(9)
    assert kv.width == 12
    kv.lens = [12, 0]
    with pytest.raises(ValueError) as info:
        kv.lens = [13, 0]
    assert str(info.value) == "lens [13, 0] must lie in [0, capacity 12]"
    with pytest.raises(ValueError) as info:
        kv.lens = [1, 1, 1]
    assert str(info.value) == "3 lengths for 2 rows"


@pytest.mark.rule("paged KV store and block table, one rule per case")
def test_an_append_writes_each_row_at_its_end_through_fresh_pages():
    """Row 0 gets 5 columns and row 1 2 (page size 2): pages 1-3 for row 0, page 4 for
    row 1, in order; a second append of 2 columns per row continues each row's own run."""
    s = _store(page=2)
    kv = PagedRaggedKv.empty(s, 2, 64)
    _fill(kv, [[10.0] * 5, [20.0] * 2])
    assert kv.host_lens().tolist() == [5, 2] and kv.width == 6
    assert kv.table.tolist() == [[1, 2, 3], [4, 0, 0]]
    assert s.owner[1:5].tolist() == [kv.id] * 4
    k = torch.stack([_cols(2, 15.0)[0][0], _cols(2, 22.0)[0][0]])
    v = torch.stack([_cols(2, 15.0)[1][0], _cols(2, 22.0)[1][0]])
    kv.append(k, v)
    assert _row(kv, 0) == [10.0, 11.0, 12.0, 13.0, 14.0, 15.0, 16.0]
    assert _row(kv, 1) == [20.0, 21.0, 22.0, 23.0]
    assert kv.v[1, 0, :4, 2].tolist() == [-20.0, -21.0, -22.0, -23.0]
    assert kv.lens.tolist() == [7, 4] and kv.width == 8
    assert kv.table.tolist() == [[1, 2, 3, 5], [4, 6, 0, 0]]
    assert s.moved["write"] == (5 + 2 + 2 + 2) * (2 + 3) * 8


@pytest.mark.rule("paged KV store and block table, one rule per case")
def test_an_append_of_nothing_changes_nothing_and_a_bad_shape_is_refused():
    s = _store(page=2)
    kv = PagedRaggedKv.empty(s, 2, 64)
    _fill(kv, [[1.0] * 3, [5.0]])
    view = kv.k
    k0, v0 = (x.expand(2, 1, 0, x.shape[3]) for x in _cols(0, 0.0))
    kv.append(k0, v0)
    kv.append(k0[:0], v0[:0], rows=[])
    assert kv.k is view and kv.host_lens().tolist() == [3, 1] and s.used == 4
    k, v = _cols(2, 7.0)
    with pytest.raises(ValueError) as info:
        kv.append(k, v)  # one row of columns for a batch of two
    assert str(info.value) == "append of k [1, 1, 2, 2] to 2 rows"
    with pytest.raises(ValueError) as info:
        kv.append(k, v[:, :, :1], rows=[0])
    assert str(info.value) == "append of k [1, 1, 2, 2] to 1 rows"
    kv.append(k, v, rows=torch.tensor([1]))
    assert _row(kv, 1) == [5.0, 7.0, 8.0] and _row(kv, 0) == [1.0, 2.0, 3.0]


@pytest.mark.rule("paged KV store and block table, one rule per case")
def test_an_append_into_a_shared_page_copies_its_live_prefix_first():
    """A clone shares every page and both batches take new ids: the clone's append into
    its half-full last page (offsets 0-1 live) copies those 2 columns to a fresh page
    before writing; the original still reads its own columns."""
    s = _store(page=4)
    a = PagedRaggedKv.empty(s, 1, 64)
    _fill(a, [[1.0] * 6])
    old_id = a.id
    b = a.clone()
    assert a.id != old_id and b.id != a.id and b.id != old_id
    assert b.table.tolist() == a.table.tolist() == [[1, 2]]
    writes = s.moved["write"]
    k, v = _cols(1, 9.0)
    b.append(k, v)
    assert b.table.tolist() == [[1, 3]] and s.owner[3] == b.id
    assert s.moved["write"] - writes == (2 + 1) * (2 + 3) * 8  # 2 copied + 1 new column
    assert _row(b, 0) == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 9.0]
    assert _row(a, 0) == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
    a.append(*_cols(1, 8.0))  # the original owns nothing either now: it copies too
    assert a.table.tolist() == [[1, 4]] and _row(a, 0)[-2:] == [6.0, 8.0]
    writes = s.moved["write"]
    b.append(*_cols(1, 10.0))  # page 3 is b's own now: no copy
    assert b.table.tolist() == [[1, 3]] and s.moved["write"] - writes == (2 + 3) * 8


@pytest.mark.rule("paged KV store and block table, one rule per case")
def test_advance_drops_the_zero_lead_first_then_moves_start():
    s = _store(page=2)
    kv = PagedRaggedKv.empty(s, 2, 64)
    _fill(kv, [[1.0] * 5, [1.0] * 3])
    kv.prepend_zeros(np.array([2, 0]))
    assert kv.zlead.tolist() == [2, 0] and kv.host_lens().tolist() == [7, 3]
    assert _row(kv, 0) == [0.0, 0.0, 1.0, 2.0, 3.0, 4.0, 5.0] and kv.width == 8
    writes = s.moved["write"]
    kv.advance(np.array([3, 1]))  # row 0: both zeros, then one column; row 1: one column
    assert kv.zlead.tolist() == [0, 0] and kv.start.tolist() == [1, 1]
    assert kv.host_lens().tolist() == [4, 2] and kv.lens.tolist() == [4, 2]
    assert _row(kv, 0) == [2.0, 3.0, 4.0, 5.0] and _row(kv, 1) == [2.0, 3.0]
    kv.advance([0, 1])
    assert kv.start.tolist() == [1, 2] and _row(kv, 1) == [3.0]
    assert s.moved["write"] == writes  # offsets only


@pytest.mark.rule("paged KV store and block table, one rule per case")
def test_prepend_zeros_grows_the_lead_and_the_view():
    s = _store(page=4)
    kv = PagedRaggedKv.empty(s, 2, 64)
    _fill(kv, [[1.0] * 3, [4.0] * 2])
    kv.prepend_zeros([1, 3])
    assert kv.zlead.tolist() == [1, 3] and kv.host_lens().tolist() == [4, 5]
    assert kv.width == 8 and kv.lens.tolist() == [4, 5]
    assert _row(kv, 0) == [0.0, 1.0, 2.0, 3.0] and _row(kv, 1) == [0.0, 0.0, 0.0, 4.0, 5.0]
    kv.prepend_zeros(np.array([0, 0]))
    assert kv.zlead.tolist() == [1, 3] and kv.width == 8


@pytest.mark.rule("paged KV store and block table, one rule per case")
def test_an_append_past_a_zero_lead_longer_than_the_row_shrinks_the_lead_to_it():
    """A zero lead past the row's length is slack: the append's columns follow the row's
    live length, its lead cut down to it first."""
    s = _store(page=2)
    kv = PagedRaggedKv.empty(s, 1, 64)
    _fill(kv, [[1.0] * 2])
    kv.prepend_zeros([3])  # view: 0 0 0 1 2
    kv.lens = [2]  # rolled back into the lead: the two live columns are zeros
    kv.append(*_cols(2, 7.0))
    assert kv.zlead.tolist() == [2] and _row(kv, 0) == [0.0, 0.0, 7.0, 8.0]


@pytest.mark.rule("paged KV store and block table, one rule per case")
def test_stacked_rows_keep_their_views_and_take_over_the_owned_pages():
    s = _store(page=2)
    a = PagedRaggedKv.empty(s, 2, 64)
    _fill(a, [[1.0] * 3, [10.0] * 5])
    a.prepend_zeros([2, 0])  # row 0: 0 0 1 2 3
    other = PagedRaggedKv.empty(s, 1, 64)
    _fill(other, [[20.0] * 1])
    shared = other.clone()  # owns nothing: its row's page stays with nobody
    out = stack_rows([(a, 1, 2), (a, 0, 1), (a, 0, 3), (shared, 0, 0)],
                     np.array([3, 4, 2, 1]), 64)
    assert out.zlead.tolist() == [0, 1, 0, 0] and out.start.tolist() == [2, 0, 1, 0]
    assert out.width == 6 and out.batch == 4 and out.max_seq_len == 64
    assert _row(out, 0) == [12.0, 13.0, 14.0] and _row(out, 1) == [0.0, 1.0, 2.0, 3.0]
    assert _row(out, 2) == [2.0, 3.0] and _row(out, 3) == [20.0]
    owned = [int(p) for p in a.table.reshape(-1) if p]
    assert s.owner[owned].tolist() == [out.id] * len(owned)
    assert s.owner[int(other.table[0, 0])] not in (out.id, shared.id)
    wide = stack_rows([(a, 0, 0)], np.array([7]), 64)  # a length past every source width
    assert wide.width == 8
    with pytest.raises(ValueError) as info:
        stack_rows([(a, 0, 0), (PagedRaggedKv.empty(_store(), 1, 64), 0, 0)], np.array([1, 0]),
                   64)
    assert str(info.value) == "rows from 2 page stores cannot be stacked"


@pytest.mark.rule("paged KV store and block table, one rule per case")
def test_a_store_and_its_batches_live_on_the_store_device():
    """Placement (torch's meta device runs on any machine): the pages and the device
    lengths sit where the store was made, and a write indexes them there."""
    s = PageStore(1, 2, 3, 2, torch.float32, "meta")
    assert s.k.device.type == s.v.device.type == "meta"
    kv = PagedRaggedKv.empty(s, 2, 64)
    kv.append(torch.zeros((2, 1, 1, 2), device="meta"), torch.zeros((2, 1, 1, 3), device="meta"))
    assert kv.lens.device.type == "meta" and kv.host_lens().tolist() == [1, 1]


@pytest.mark.rule("paged KV store and block table, one rule per case")
def test_a_batch_keeps_its_tables_and_offsets_as_host_int64():
    """Tables, starts and zero leads given as int32, or offsets computed in uint64, stay
    host int64 (uint64 against int64 would turn them into float64 in NumPy)."""
    s = _store(page=2)
    _fill(PagedRaggedKv.empty(s, 1, 64), [[1.0] * 3])  # pages 1 and 2 hold 1 2 | 3
    i32 = np.int32
    kv = PagedRaggedKv(s, np.array([[1, 2]], i32), np.array([0], i32), np.array([1], i32),
                       [4], 4, 64)
    assert kv.table.dtype == kv.start.dtype == kv.zlead.dtype == np.int64
    assert _row(kv, 0) == [0.0, 1.0, 2.0, 3.0]
    kv.prepend_zeros(np.array([1], np.uint64))
    kv.advance(np.array([3], np.uint64))  # both zeros, then one column
    assert kv.zlead.dtype == kv.start.dtype == np.int64
    assert kv.zlead.tolist() == [0] and kv.start.tolist() == [1] and _row(kv, 0) == [2.0, 3.0]


@pytest.mark.rule("paged KV store and block table, one rule per case")
def test_reserving_what_the_view_already_holds_keeps_it():
    """A width given off the page grid (6 columns of pages of 4) is already "at least 6
    wide": reserving 6 or fewer changes neither the width nor the cached view."""
    s = _store(page=4)
    _fill(PagedRaggedKv.empty(s, 1, 64), [[1.0] * 5])
    kv = PagedRaggedKv(s, [[1, 2]], [0], [0], [5], 6, 64)
    view = kv.k
    kv.reserve(6)
    kv.reserve(1)
    assert kv.width == 6 and kv.k is view
    kv.reserve(7)
    assert kv.width == 8 and kv.k is not view


@pytest.mark.rule("paged KV store and block table, one rule per case")
def test_pages_of_one_column_read_zero_leads_and_empty_slots_as_zeros():
    s = _store(page=1)
    kv = PagedRaggedKv.empty(s, 2, 64)
    _fill(kv, [[3.0] * 2, [7.0] * 1])
    kv.prepend_zeros([2, 0])
    assert _row(kv, 0) == [0.0, 0.0, 3.0, 4.0] and _row(kv, 1) == [7.0]
    assert kv.k[1, 0, 1:, 0].tolist() == [0.0, 0.0, 0.0]  # past row 1's table: the zero page


@pytest.mark.rule("paged KV store and block table, one rule per case")
def test_an_append_to_given_rows_takes_a_scalar_or_a_device_tensor():
    s = _store(page=2)
    kv = PagedRaggedKv.empty(s, 2, 64)
    _fill(kv, [[1.0] * 2, [5.0] * 1])
    kv.append(*_cols(1, 6.0), rows=1)
    kv.append(*_cols(1, 3.0), rows=torch.tensor([0], device=DEVICE))
    assert _row(kv, 0) == [1.0, 2.0, 3.0] and _row(kv, 1) == [5.0, 6.0]


@pytest.mark.rule("paged KV store and block table, one rule per case")
def test_an_append_into_an_owned_page_writes_in_place():
    """Page 1 belongs to the batch that filled it: the next column lands there, no copy,
    no fresh page."""
    s = _store(page=4)
    kv = PagedRaggedKv.empty(s, 1, 64)
    _fill(kv, [[1.0] * 1])
    kv.append(*_cols(1, 2.0))
    assert kv.table.tolist() == [[1]] and s.used == 2 and _row(kv, 0) == [1.0, 2.0]
    assert s.moved["write"] == 2 * (2 + 3) * 8


@pytest.mark.rule("paged KV store and block table, one rule per case")
def test_a_shared_first_page_is_copied_and_a_page_boundary_copies_nothing():
    """The clone's append into shared page 1 (2 live columns) copies them first; rolled
    back to a page boundary, an append into the shared page after it copies no column
    (its live prefix there is empty)."""
    s = _store(page=4)
    a = PagedRaggedKv.empty(s, 1, 64)
    _fill(a, [[1.0] * 2])
    b = a.clone()
    b.append(*_cols(1, 9.0))
    assert b.table.tolist() == [[2]] and _row(b, 0) == [1.0, 2.0, 9.0]
    c = PagedRaggedKv.empty(s, 1, 64)
    _fill(c, [[1.0] * 6])  # pages 3 | 4
    d = c.clone()
    d.lens = [4]
    writes = s.moved["write"]
    d.append(*_cols(1, 8.0))
    assert d.table.tolist() == [[3, 5]] and _row(d, 0) == [1.0, 2.0, 3.0, 4.0, 8.0]
    assert s.moved["write"] - writes == (2 + 3) * 8  # the new column only


@pytest.mark.rule("paged KV store and block table, one rule per case")
def test_logical_columns_no_page_holds_are_not_copied():
    """A row whose start is 3 but holds no page: its append allocates the first page and
    writes only its new column (the three columns below read as the zero page)."""
    s = _store(page=4)
    kv = PagedRaggedKv(s, np.zeros((1, 0), np.int64), [3], [0], [0], 4, 64)
    kv.append(*_cols(1, 5.0))
    assert kv.table.tolist() == [[1]] and s.moved["write"] == (2 + 3) * 8
    assert _row(kv, 0) == [5.0]


@pytest.mark.rule("paged KV store and block table, one rule per case")
def test_an_append_follows_a_shrunk_zero_lead_within_the_row_pages():
    """After the lead shrinks to the row's length the append's logical columns start at 0:
    the row's one page takes them, no page is added."""
    s = _store(page=2)
    kv = PagedRaggedKv.empty(s, 1, 64)
    _fill(kv, [[1.0] * 2])
    kv.prepend_zeros([3])
    kv.lens = [2]
    kv.append(*_cols(2, 7.0))
    assert kv.table.tolist() == [[1]] and s.used == 2


@pytest.mark.rule("paged KV store and block table, one rule per case")
def test_an_append_before_the_first_logical_column_is_refused():
    s = _store(page=2)
    kv = PagedRaggedKv(s, [[1]], [-2], [0], [1], 2, 64)
    with pytest.raises(ValueError) as info:
        kv.append(*_cols(1, 1.0))
    assert str(info.value) == "row 0: append at logical column -1"


@pytest.mark.rule("paged KV store and block table, one rule per case")
def test_zeros_prepended_within_the_width_show_in_the_cached_view():
    s = _store(page=4)
    kv = PagedRaggedKv.empty(s, 1, 64)
    _fill(kv, [[1.0] * 2])
    assert _row(kv, 0) == [1.0, 2.0]
    kv.prepend_zeros([1])
    assert kv.width == 4 and _row(kv, 0) == [0.0, 1.0, 2.0]
    with pytest.raises(ValueError) as info:
        stack_rows([(kv, 0, 0)], np.zeros(0, np.int64), 64)
    assert str(info.value) == "0 lengths for 1 rows"


# --- under the backend: table updates move no K/V, one writer per page ---------------------


def _kv(rng: np.random.Generator, n: int, d: int) -> tuple[np.ndarray, np.ndarray]:
    """Small integers (exact in every dtype), never zero so a dead column shows."""
    return (rng.integers(1, 50, size=(1, 1, n, d)).astype(np.float64),
            -rng.integers(1, 50, size=(1, 1, n, d)).astype(np.float64))


def _counted(monkeypatch) -> dict:
    """Count every call of the page store's write method and the bytes it writes."""
    seen = {"calls": 0, "bytes": 0}
    real = PageStore.write

    def write(self, pages, offs, k, v):
        seen["calls"] += 1
        seen["bytes"] += k.to(self.dtype).nbytes + v.to(self.dtype).nbytes
        return real(self, pages, offs, k, v)

    monkeypatch.setattr(PageStore, "write", write)
    return seen


@pytest.mark.rule("paged KV: strip, rollback, commit and alignment are table updates")
def test_strips_rollbacks_commits_and_alignment_move_no_kv_bytes(monkeypatch):
    """Only appends write: clone-in with pending leads (a strip), front alignment, the
    forward's zero baking, rollback, clone-out, commit and a dead-prefix strip leave the
    write counter and the stores' contents as they were."""
    seen = _counted(monkeypatch)
    rng = np.random.default_rng(7)
    be = PagedBackend(page_size=3)
    seqs = [NormalCache([be.kv_from_arrays(*_kv(rng, n, 2), 4096)]) for n in (7, 2, 5)]
    built = dict(seen)
    assert built["bytes"] == (7 + 2 + 5) * 2 * 2 * 8  # K and V, 2 columns of float64 each
    ci = be.clone_in(seqs, [2, 0, 1], False, True)
    slot = ci.batched.slots[0]
    store = slot.kv.store
    snapshot = (store.k.clone(), store.v.clone())
    assert seen == built, "clone-in (strip of pending leads + alignment) wrote K/V"
    be.kv_append(slot, *[x.reshape(3, 1, 2, 2) for x in _kv(rng, 6, 2)])
    appended = dict(seen)
    assert appended["bytes"] >= 3 * 2 * 2 * 2 * 8, "the append's new columns were not written"
    store = slot.kv.store
    snapshot = (store.k.clone(), store.v.clone())
    grown = store.moved["grow"]
    slot.bake(np.zeros(3, dtype=np.int64))
    be.truncate_by(ci.batched, 1)
    rows = be.clone_out(ci.batched, 3)
    for i, c in enumerate(rows):
        if i:
            be.commit(c, ci.lead_pad[i], 4, 4)
        else:
            be.strip_dead_prefix(c.slots[0], ci.lead_pad[i])
    again = be.clone_in(rows, [0, 0, 0], False, True)
    be.kv_set_len(again.batched.slots[0], 2)
    assert seen == appended, f"a table update wrote K/V: {seen} after {appended}"
    assert store.moved["grow"] == grown
    assert torch.equal(store.k, snapshot[0]) and torch.equal(store.v, snapshot[1])


@pytest.mark.rule("paged KV: strip, rollback, commit and alignment are table updates")
def test_the_dense_layout_would_have_moved_bytes_for_the_same_strip():
    """Non-degeneracy of the counter's scenario: in the in-place layout the same strip that
    cuts into a row's own run is a gather (the paged one is a table offset)."""
    rng = np.random.default_rng(3)
    dense = TorchBackend().kv_from_arrays(*_kv(rng, 6, 2), 4096)
    before = dense.kv.k
    dense.drop_front(2)
    assert dense.kv.k is not before
    paged = PagedBackend(page_size=4).kv_from_arrays(*_kv(rng, 6, 2), 4096)
    pages = paged.kv.table.copy()
    paged.drop_front(2)
    assert np.array_equal(paged.kv.table, pages) and paged.kv.start.tolist() == [2]


@pytest.mark.rule("paged KV: one writer per page")
def test_a_shared_page_is_copied_before_a_write():
    """A clone shares pages; a write into a page it does not own copies the page's live
    prefix into a fresh page, so the original's columns stay as they were."""
    rng = np.random.default_rng(1)
    be = PagedBackend(page_size=4)
    k, v = _kv(rng, 5, 2)
    a = be.kv_from_arrays(k, v, 4096)
    b = a.clone()
    b.set_len(3)
    be.kv_append(b, *_kv(rng, 2, 2))
    got = be.materialize(a)["kv"][0]
    assert np.array_equal(got[0], k) and np.array_equal(got[1], v)
    assert a.kv.table[0, 0] != b.kv.table[0, 1] and b.kv.table[0, 0] != a.kv.table[0, 0]


@pytest.mark.rule("paged KV: one writer per page")
def test_a_dense_first_batch_is_adopted_into_pages():
    """The forward's empty first batch (a dense `RaggedKv`) becomes pages on assignment."""
    be = PagedBackend(page_size=2)
    slot = PagedKv(4096, be.pool)
    k = torch.arange(2 * 1 * 4 * 2, dtype=torch.float64).reshape(2, 1, 4, 2)
    slot.kv = RaggedKv(k, -k, [3, 1], 4096)
    assert slot.kv.host_lens().tolist() == [3, 1]
    assert torch.equal(slot.kv.k[0, :, :3], k[0, :, :3])
    assert torch.equal(slot.kv.v[1, :, :1], -k[1, :, :1])


@pytest.mark.rule("paged KV bytes per step, benchmark")
@pytest.mark.parametrize("lens,w", [([4096, 4090, 4033], 3), ([17, 1], 1), ([15, 16, 31, 32], 5)])
def test_the_paged_bytes_are_counted_on_the_paged_layout(lens, w):
    """The benchmark's paged counts: the step's append writes exactly its new columns' K and
    V (the batch a clone-in built owns its rows' pages: no copy), the rollback and the
    strip nothing. Expected values from the shapes, not from the counter."""
    got = count_paged_moves(lens, w, 2, 8, torch.bfloat16, "cpu", page_size=16)
    assert got["paged_append_bytes"] == 2 * len(lens) * w * 2 * 8 * 2
    assert got["paged_cow_bytes"] == 0
    assert got["paged_strip_bytes"] == 0 and got["paged_rollback_bytes"] == 0


@pytest.mark.rule("paged KV bytes per step, benchmark")
def test_the_benchmark_report_shows_the_paged_bytes():
    """The data-movement row's paged cells, and a dash for a result without them."""
    row = {"paged_append_bytes": 3072, "paged_cow_bytes": 1024, "paged_rollback_bytes": 0,
           "paged_strip_bytes": 0}
    assert paged_cells(row) == "3.0 (1.0) | 0 / 0"
    assert paged_cells({"w": 3}) == "- | -"
