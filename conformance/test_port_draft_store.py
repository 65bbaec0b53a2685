"""Port conformance: the pooled draft KV (`gpu.draft_store`) on stores built by each test.

`test_backend.py` drives the store through the backend under test, which is built once per
process and keeps its stores, so a store's construction, its first growth and its row
recycling happen once per run, not once per test. Here every test builds its own store and
checks, from the docstrings' contract: rows handed out lowest index first, the row count
doubling when full (from 8), a recycled row zeroed with length 0, a handle's row returned to
the store when the handle dies, and the handle's host metadata (length 0, capacity
`DRAFT_CACHE_CAPACITY`, unmaterialized until the draft loop writes it).
"""

from __future__ import annotations

import gc

import pytest
import torch

import raggedspec.gpu.draft_store as draft_store
from raggedspec.gpu.cache import RaggedKv
from raggedspec.gpu.draft_store import DraftStore, PoolKv
from raggedspec.reference.cache import DRAFT_CACHE_CAPACITY
from raggedspec.reference.errors import CacheRefusal


@pytest.mark.rule("the pooled draft KV: rows and handles, port")
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16], ids=["float64", "bfloat16"])
def test_a_fresh_store_holds_no_rows_in_the_given_dtype_and_head_width(dtype):
    store = DraftStore(3, dtype, "cpu")
    for buf in (store.kv.k, store.kv.v):
        assert list(buf.shape) == [0, 1, DRAFT_CACHE_CAPACITY, 3] and buf.dtype == dtype
    assert store.kv.lens.tolist() == [] and store.free == []


@pytest.mark.rule("the pooled draft KV: rows and handles, port")
def test_the_store_allocates_on_the_device_it_is_given(monkeypatch):
    """A CPU run has one device, so the device a store's buffers are created on is read from
    the allocation itself."""
    seen = []

    class Spy(RaggedKv):
        @staticmethod
        def empty(*args, **kwargs):
            seen.append(args[6] if len(args) > 6 else kwargs.get("device"))
            return RaggedKv.empty(*args, **kwargs)

    monkeypatch.setattr(draft_store, "RaggedKv", Spy)
    dev = torch.device("cpu")
    DraftStore(3, torch.float64, dev)
    assert seen == [dev]


@pytest.mark.rule("the pooled draft KV: rows and handles, port")
def test_rows_are_handed_out_lowest_first_and_the_row_count_doubles_from_8():
    store = DraftStore(2, torch.float64, "cpu")
    assert [store.alloc() for _ in range(8)] == list(range(8))
    assert store.kv.batch == 8 and store.free == []
    assert store.alloc() == 8 and store.kv.batch == 16
    assert [store.alloc() for _ in range(7)] == list(range(9, 16)) and store.kv.batch == 16
    assert store.alloc() == 16 and store.kv.batch == 32
    for buf in (store.kv.k, store.kv.v):
        assert list(buf.shape) == [32, 1, DRAFT_CACHE_CAPACITY, 2]
    assert store.kv.host_lens().tolist() == [0] * 32


@pytest.mark.rule("the pooled draft KV: rows and handles, port")
def test_a_recycled_row_is_zeroed_with_length_0_and_the_other_rows_keep_theirs():
    store = DraftStore(2, torch.float64, "cpu")
    a, b = store.alloc(), store.alloc()
    store.kv.k[a].fill_(7.0)
    store.kv.v[a].fill_(8.0)
    store.kv.k[b].fill_(9.0)
    store.kv.set_row_len(a, 3)
    store.kv.set_row_len(b, 5)
    store.release(a)
    assert store.alloc() == a  # the last row released is the next handed out
    assert bool((store.kv.k[a] == 0).all()) and bool((store.kv.v[a] == 0).all())
    assert store.kv.host_lens()[[a, b]].tolist() == [0, 5]
    assert bool((store.kv.k[b] == 9.0).all())


@pytest.mark.rule("the pooled draft KV: rows and handles, port")
def test_a_store_row_grows_past_any_sequence_length_without_refusal():
    """The store's own width is never refused (refusals are the handles' metadata): a row
    appended far past the draft capacity grows by whole 512-column blocks."""
    store = DraftStore(2, torch.float64, "cpu")
    r = store.alloc()
    store.kv.append(torch.ones(1, 1, 5000, 2, dtype=torch.float64),
                    torch.ones(1, 1, 5000, 2, dtype=torch.float64), rows=[r])
    assert int(store.kv.lens[r]) == 5000 and store.kv.capacity == DRAFT_CACHE_CAPACITY + 10 * 512
    store.reserve(6000)
    assert store.kv.capacity == DRAFT_CACHE_CAPACITY + 12 * 512


@pytest.mark.rule("the pooled draft KV: rows and handles, port")
def test_a_handle_starts_empty_and_unmaterialized_and_returns_its_row_when_it_dies():
    store = DraftStore(2, torch.float64, "cpu")
    h = PoolKv(store, 4096)
    assert (h.current, h.current_seq_len, h.capacity_seq_len, h.max_seq_len) == (
        0, 0, DRAFT_CACHE_CAPACITY, 4096)
    assert h.materialized is False and h.front_aligned() is None
    idx = h.idx
    assert idx not in store.free
    del h
    gc.collect()
    assert idx in store.free


@pytest.mark.rule("the pooled draft KV: rows and handles, port")
def test_set_len_of_a_materialized_handle_sets_only_its_own_row():
    store = DraftStore(2, torch.float64, "cpu")
    h, other = PoolKv(store, 4096), PoolKv(store, 4096)
    store.kv.set_row_len(other.idx, 2)
    h.set_len(5)  # unmaterialized: the metadata only
    assert h.current == 5 and int(store.kv.lens[h.idx]) == 0
    h.materialized = True
    h.set_len(9)
    assert h.current == 9
    assert store.kv.host_lens()[[h.idx, other.idx]].tolist() == [9, 2]
    k, v = h.front_aligned()
    assert list(k.shape) == [1, 1, 9, 2] == list(v.shape)
    with pytest.raises(CacheRefusal):
        h.set_len(DRAFT_CACHE_CAPACITY + 1)
