"""The port's in-place KV buffer `gpu.cache.RaggedKv` (cache-and-draft.md §3): one K and one V
buffer `[B, H, capacity, D]` and each row's own length, row i's position p at column p.

Small explicit batches pin the class's docstrings: the constructor's shape and length checks
(host integers and device tensors), `empty` and `from_rows` placement and dtypes (checked on
the meta device, where a tensor left on the CPU shows), the append (all rows, a subset given
as host integers or as a device tensor, growth by whole 512-column blocks, the in-place write
into a shared buffer), `set_len`, `commit_per_sequence` and `set_row_len` on both length
paths, and the host copy of the lengths (kept, so no device read, whenever the lengths were
set from host integers). Against the reference: the same appends grow and refuse as a
`SingleCache`'s, the same lengths are refused by `set_len`, and the reference's front-aligned
batch (`clone_in_cache`, then appends and per-sequence commits over several steps) is what
`gpu.align.materialize_front_aligned` gathers from the rows in place, bit for bit in
float64, float32 and bfloat16. The buffer helpers of the slots (`grow_physical`,
`shift_rows`) close the file."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from raggedspec import host_work
from raggedspec.conformance.strategies import GROWTH_BOUNDARIES, corner_lengths
from raggedspec.gpu.align import materialize_front_aligned
from raggedspec.gpu.cache import RaggedKv
from raggedspec.gpu.slots import grow_physical, shift_rows
from raggedspec.gpu.testing import (
    DEVICE,
    FLOAT_DTYPES,
    assert_bit_exact,
    assert_same_refusal,
    host,
    outcome,
    representable,
    to_port,
)
from raggedspec.reference import align as ref_align
from raggedspec.reference.cache import KvCache, NormalCache, SingleCache
from raggedspec.reference.errors import CacheRefusal
from raggedspec.reference.step import commit_per_sequence

F64 = torch.float64
H, D = 1, 2
dtypes = pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=lambda d: str(d).split(".")[-1])

def reads(fn) -> int:
    """The blocking device->host reads `fn()` makes (raggedspec.host_work's counter)."""
    counter = host_work._Counter()
    with host_work._wrapped_reads(counter), counter:
        counter.on = True
        fn()
        counter.on = False
    return sum(counter.reads.values())


def numbered(b: int, cap: int, d: int = 2, heads: int = 1) -> torch.Tensor:
    """`[b, heads, cap, d]` whose every cell is distinct (value = its flat index + 1)."""
    return torch.arange(1, b * heads * cap * d + 1, dtype=F64).reshape(b, heads, cap, d)


def kv_of(lens, cap: int = 8, d: int = 2, max_seq_len: int = 4096, device_lens=False):
    k = numbered(len(lens), cap, d)
    given = torch.tensor(lens) if device_lens else list(lens)
    return RaggedKv(k, -k, given, max_seq_len)


# --- constructor ------------------------------------------------------------------------------


@pytest.mark.rule("RaggedKv construction, lengths and copies, port layout")
def test_the_constructor_refuses_buffers_that_are_not_b_h_capacity():
    k = torch.zeros(2, 1, 4, 2)
    with pytest.raises(ValueError, match=r"^k \[2, 1, 4, 2\] and v \[2, 1, 4\] must be "
                                         r"\[B,H,capacity,\*\]$"):
        RaggedKv(k, torch.zeros(2, 1, 4), [0, 0], 64)
    with pytest.raises(ValueError, match=r"^k \[2, 1, 4, 2\] and v \[2, 1, 5, 2\] must be"):
        RaggedKv(k, torch.zeros(2, 1, 5, 2), [0, 0], 64)
    assert RaggedKv(k, torch.zeros(2, 1, 4, 3), [0, 0], 64).v.shape == (2, 1, 4, 3)


@pytest.mark.rule("RaggedKv construction, lengths and copies, port layout")
@pytest.mark.parametrize("device_lens", [False, True], ids=["host", "device"])
def test_the_constructor_checks_count_and_range_of_the_lengths(device_lens):
    k = torch.zeros(2, 3, 4, 2)  # 2 rows, 3 heads: the count is of rows
    make = (lambda x: torch.tensor(x)) if device_lens else list
    with pytest.raises(ValueError, match=r"^3 lengths for 2 rows$"):
        RaggedKv(k, k, make([0, 0, 0]), 64)
    for bad in ([-1, 0], [0, 5]):
        msg = re.escape(f"lens {bad} must lie in [0, capacity 4]")
        with pytest.raises(ValueError, match=f"^{msg}$"):
            RaggedKv(k, k, make(bad), 64)
    kv = RaggedKv(k, k, make([4, 0]), 64)  # the capacity itself is a length
    assert kv.lens.tolist() == [4, 0] and kv.host_lens().tolist() == [4, 0]
    if device_lens:
        with pytest.raises(ValueError, match=r"^lens must be a 1-D vector, got shape \[1, 2\]$"):
            RaggedKv(k, k, torch.tensor([[0, 0]]), 64)


@pytest.mark.rule("RaggedKv construction, lengths and copies, port layout")
def test_lengths_from_host_integers_are_kept_on_the_host_and_a_device_vector_is_read_once():
    host = kv_of([3, 1])
    assert reads(host.host_lens) == 0 and host.host_lens().tolist() == [3, 1]
    dev = kv_of([3, 1], device_lens=True)
    assert reads(dev.host_lens) == 1
    assert reads(dev.host_lens) == 0  # the copy is kept
    got = dev.host_lens()
    assert got.tolist() == [3, 1] and got.dtype == np.int64
    none = RaggedKv(torch.zeros(0, 1, 4, 2), torch.zeros(0, 1, 4, 2), torch.zeros(0, dtype=int), 8)
    assert none.host_lens().dtype == np.int64 and none.host_lens().size == 0


# --- empty, from_rows, clone -------------------------------------------------------------------


@pytest.mark.rule("RaggedKv construction, lengths and copies, port layout")
def test_empty_places_both_buffers_and_the_lengths_on_the_device_asked_for():
    kv = RaggedKv.empty(2, 3, 4, 64, capacity=16, device="meta", v_dim=5)
    assert kv.k.device.type == kv.v.device.type == kv.lens.device.type == "meta"
    assert kv.k.shape == (2, 3, 16, 4) and kv.v.shape == (2, 3, 16, 5)
    assert kv.k.dtype == kv.v.dtype == F64 and kv.max_seq_len == 64
    assert kv.host_lens().tolist() == [0, 0] and kv.lens.dtype == torch.int64
    same = RaggedKv.empty(1, 1, 4, 64, capacity=8, dtype=torch.bfloat16)
    assert same.v.shape == (1, 1, 8, 4) and same.v.dtype == same.k.dtype == torch.bfloat16


@pytest.mark.rule("RaggedKv construction, lengths and copies, port layout")
def test_from_rows_refuses_unequal_or_empty_row_lists_and_a_row_past_the_capacity():
    k = torch.zeros(1, 3, 2)
    for ks, vs in (([], []), ([k, k], [k])):
        with pytest.raises(ValueError,
                           match=r"^from_rows needs as many K rows as V rows, >= 1$"):
            RaggedKv.from_rows(ks, vs, 64)
    with pytest.raises(ValueError, match=r"^a row of 3 does not fit capacity 2$"):
        RaggedKv.from_rows([k], [k], 64, capacity=2)


@pytest.mark.rule("RaggedKv construction, lengths and copies, port layout")
def test_from_rows_keeps_the_devices_dtype_and_vs_own_width():
    ks = [torch.zeros(2, n, 3, device="meta", dtype=torch.float32) for n in (4, 1)]
    vs = [torch.zeros(2, n, 5, device="meta", dtype=torch.float32) for n in (4, 1)]
    kv = RaggedKv.from_rows(ks, vs, 64, capacity=8)
    assert kv.k.device.type == kv.v.device.type == kv.lens.device.type == "meta"
    assert kv.k.shape == (2, 2, 8, 3) and kv.v.shape == (2, 2, 8, 5)
    assert kv.k.dtype == torch.float32 and kv.lens.dtype == torch.int64
    assert kv.host_lens().tolist() == [4, 1] and reads(kv.host_lens) == 0


@pytest.mark.rule("RaggedKv construction, lengths and copies, port layout")
def test_clone_keeps_max_seq_len_and_the_host_copy():
    kv = kv_of([3, 1], max_seq_len=100)
    c = kv.clone()
    assert c.max_seq_len == 100 and reads(c.host_lens) == 0 and c.host_lens().tolist() == [3, 1]
    assert c.k.data_ptr() != kv.k.data_ptr() and torch.equal(c.k, kv.k)
    dev = kv_of([3, 1], device_lens=True).clone()
    assert dev.lens.tolist() == [3, 1] and dev.host_lens().tolist() == [3, 1]


# --- append ------------------------------------------------------------------------------------


def new_cols(b: int, t: int, d: int = 2, base: float = 1000.0) -> torch.Tensor:
    return base + torch.arange(b * t * d, dtype=F64).reshape(b, 1, t, d)


@pytest.mark.rule("SingleCache::append, port layout")
@pytest.mark.parametrize("how", ["host", "device", "host lens, device rows"])
def test_an_append_to_a_row_subset_writes_at_each_rows_own_offset(how):
    """Rows [2, 0] of lens [3, 1, 0] get 2 columns each at their own offsets; row 1 and every
    other column keep their values; `lens` and the host copy agree."""
    kv = kv_of([3, 1, 0], device_lens=how == "device")
    before = kv.k.clone()
    rows = [2, 0] if how == "host" else torch.tensor([2, 0])
    new = new_cols(2, 2)
    n_reads = reads(lambda: kv.append(new, -new, rows=rows))
    assert n_reads == 0 if how == "host" else n_reads > 0  # growth decided on the host copy
    assert reads(kv.host_lens) == (0 if how == "host" else 1)
    assert kv.lens.tolist() == [5, 1, 2] and kv.host_lens().tolist() == [5, 1, 2]
    want = before.clone()
    want[2, :, 0:2], want[0, :, 3:5] = new[0], new[1]
    assert torch.equal(kv.k, want) and torch.equal(kv.v[:, :, :5], -want[:, :, :5])


@pytest.mark.rule("SingleCache::append, port layout")
@pytest.mark.parametrize("device_lens", [False, True], ids=["host", "device"])
def test_an_append_to_every_row_advances_every_length(device_lens):
    kv = kv_of([3, 1], device_lens=device_lens)
    new = new_cols(2, 3)
    kv.append(new.float(), (-new).float())  # converted to the buffers' dtype
    assert reads(kv.host_lens) == (1 if device_lens else 0)
    assert kv.lens.tolist() == [6, 4] and kv.host_lens().tolist() == [6, 4]
    assert torch.equal(kv.k[0, :, 3:6], new[0]) and torch.equal(kv.v[1, :, 1:4], -new[1])


@pytest.mark.rule("SingleCache::append, port layout")
def test_growth_is_decided_by_the_addressed_rows_only():
    """Row 0 holds 510 of 512 columns; appending 4 columns to row 1 alone needs no growth."""
    kv = RaggedKv.empty(2, 1, 2, 4096)
    kv.set_len([510, 0])
    kv.append(new_cols(1, 4), new_cols(1, 4), rows=[1])
    assert kv.capacity == 512 and kv.host_lens().tolist() == [510, 4]


@pytest.mark.rule("SingleCache::append, port layout")
@pytest.mark.parametrize("device_lens", [False, True], ids=["host", "device"])
def test_growth_to_a_block_boundary_keeps_both_buffers_aligned(device_lens):
    """500 + 524 = 1024 columns: one more 512-column block, K and V grown alike, every old
    column and the new ones where they belong, zeros past them."""
    k = numbered(1, 512)
    kv = RaggedKv(k, -k, torch.tensor([500]) if device_lens else [500], 4096)
    new = new_cols(1, 524)
    kv.append(new, -new)
    assert kv.capacity == 1024 and kv.k.shape == kv.v.shape == (1, 1, 1024, 2)
    assert torch.equal(kv.k[:, :, :500], k[:, :, :500]) and torch.equal(kv.k[:, :, 500:], new)
    assert torch.equal(kv.v, -kv.k)



@pytest.mark.rule("SingleCache::append, port layout")
def test_an_append_that_needs_no_growth_writes_into_the_same_buffer():
    """An append that exactly fills the capacity writes in place (one scatter, no new
    buffer): the addressed row's new columns land in the buffer the rows already share."""
    kv = kv_of([6, 1, 2], cap=8)
    buf = kv.k.data_ptr()
    new = new_cols(1, 2)
    kv.append(new, -new, rows=[0])
    assert kv.lens.tolist() == [8, 1, 2] and kv.k.data_ptr() == buf
    assert torch.equal(kv.k[0, :, 6:8], new[0]) and torch.equal(kv.v[0, :, 6:8], -new[0])


@pytest.mark.rule("SingleCache::append, port layout")
def test_an_append_of_nothing_changes_nothing():
    kv = kv_of([3, 1])
    before = kv.k.clone()
    kv.append(torch.zeros(0, 1, 2, 2, dtype=F64), torch.zeros(0, 1, 2, 2, dtype=F64), rows=[])
    kv.append(torch.zeros(0, 1, 2, 2, dtype=F64), torch.zeros(0, 1, 2, 2, dtype=F64),
              rows=torch.zeros(0, dtype=torch.int64))
    kv.append(torch.zeros(2, 1, 0, 2, dtype=F64), torch.zeros(2, 1, 0, 2, dtype=F64))
    assert kv.host_lens().tolist() == [3, 1] and torch.equal(kv.k, before)


def z(*shape) -> torch.Tensor:
    return torch.zeros(shape, dtype=F64)


@pytest.mark.rule("SingleCache::append, port layout")
@pytest.mark.parametrize("k_new, v_new, rows", [
    (z(2, 1, 1, 3), z(2, 1, 1, 2), None),        # K's last dim
    (z(2, 1, 1, 2), z(2, 1, 1, 3), None),        # V's last dim
    (z(2, 2, 1, 2), z(2, 2, 1, 2), None),        # heads
    (z(2, 1, 1, 2), z(2, 1, 2, 2), None),        # K and V of different widths
    (z(2, 1, 1, 2), z(2, 1, 1, 2), [0]),         # rows
    (z(2, 1, 1, 2), z(2, 1, 1, 2, 1), None),     # V not rank 4
    (z(2, 1, 1, 2, 1), z(2, 1, 1, 2), None),     # K not rank 4
])
def test_an_append_of_the_wrong_shape_is_refused_before_any_write(k_new, v_new, rows):
    kv = kv_of([3, 1])
    n = 2 if rows is None else 1
    msg = (f"append of k {list(k_new.shape)}, v {list(v_new.shape)} to rows {n} of "
           "k [2, 1, 8, 2], v [2, 1, 8, 2]")
    with pytest.raises(ValueError, match=f"^{re.escape(msg)}$"):
        kv.append(k_new, v_new, rows=rows)
    assert kv.host_lens().tolist() == [3, 1]


@pytest.mark.rule("SingleCache::append, port layout")
def test_rows_must_be_a_vector():
    kv = kv_of([3, 1])
    with pytest.raises(ValueError, match=r"^rows must be a 1-D vector, got shape \[1, 2\]$"):
        kv.append(z(2, 1, 1, 2), z(2, 1, 1, 2), rows=torch.tensor([[0, 1]]))


# --- set_len, set_row_len, commit ---------------------------------------------------------


@pytest.mark.rule("per-seq commit, port layout")
@pytest.mark.parametrize("as_tensor", [False, True], ids=["host", "device"])
def test_set_len_grows_into_slack_and_shrinks_and_refuses_the_rules_cases(as_tensor):
    kv = kv_of([3, 1])
    make = (lambda x: torch.tensor(x)) if as_tensor else list
    with pytest.raises(ValueError, match=r"^3 lengths for a batch of 2$"):
        kv.set_len(make([0, 0, 0]))
    with pytest.raises(ValueError, match=r"^set_len lengths \[-1, 0\] must be >= 0$"):
        kv.set_len(make([-1, 0]))
    with pytest.raises(ValueError, match=r"^set_len lengths \[0, -2\] must be >= 0$"):
        kv.set_len(make([0, -2]))
    with pytest.raises(CacheRefusal,
                       match=r"^set_len\(10\) exceeds current capacity 8 \(first cached 0\)$"):
        kv.set_len(make([3, 10]))
    with pytest.raises(CacheRefusal, match=r"^set_len\(9\) exceeds current capacity 8"):
        kv.set_len(make([9, 10]))  # the first offending row is named
    assert kv.host_lens().tolist() == [3, 1]
    kv.set_len(make([8, 0]))  # the capacity itself, and an empty row
    assert reads(kv.host_lens) == (1 if as_tensor else 0)
    assert kv.lens.tolist() == [8, 0] and kv.host_lens().tolist() == [8, 0]
    if as_tensor:
        with pytest.raises(ValueError, match=r"^lens must be a 1-D vector, got shape \[1, 2\]$"):
            kv.set_len(torch.tensor([[0, 0]]))


@pytest.mark.rule("RaggedKv construction, lengths and copies, port layout")
def test_set_row_len_changes_one_row_on_host_and_device():
    kv = kv_of([3, 1, 2])
    kv.set_row_len(1, 7)
    assert kv.lens.tolist() == [3, 7, 2] and kv.host_lens().tolist() == [3, 7, 2]


@pytest.mark.rule("per-seq commit, port layout")
def test_commit_per_sequence_sets_each_rows_own_length():
    kv = kv_of([3, 1])
    kv.commit_per_sequence([0, 1], [3, 0])
    assert kv.lens.tolist() == [3, 1] and kv.host_lens().tolist() == [3, 1]
    kv.commit_per_sequence([2, 1], [3, 0])
    assert kv.lens.tolist() == [5, 1] and kv.host_lens().tolist() == [5, 1]
    for c, m in (([-1, 1], [1, 1]), ([1, 1], [1, -1])):
        with pytest.raises(ValueError, match=r"^cache_lens and committed must be >= 0$"):
            kv.commit_per_sequence(c, m)
    with pytest.raises(ValueError, match=r"^cache_lens must be a 1-D vector, got shape \[1, 2\]"):
        kv.commit_per_sequence(torch.tensor([[1, 1]]), [1, 1])
    with pytest.raises(ValueError, match=r"^committed must be a 1-D vector, got shape \[1, 2\]"):
        kv.commit_per_sequence([1, 1], torch.tensor([[1, 1]]))
    with pytest.raises(CacheRefusal, match=r"^set_len\(9\) exceeds current capacity 8"):
        kv.commit_per_sequence([5, 1], [4, 0])
    assert kv.host_lens().tolist() == [5, 1]



# --- against the reference ---------------------------------------------------------------


def filled(lens, seed=0, max_seq_len=4096, capacity=None):
    rng = np.random.default_rng(seed)
    ks = [to_port(rng.normal(size=(1, n, 2))) for n in lens]
    vs = [to_port(rng.normal(size=(1, n, 2))) for n in lens]
    return RaggedKv.from_rows(ks, vs, max_seq_len, capacity), ks, vs


@pytest.mark.rule("SingleCache::append, port layout")
@given(top=st.sampled_from(GROWTH_BOUNDARIES + (100, 1500)), t=st.integers(1, 600),
       max_seq_len=st.sampled_from([1024, 1536, 2048, 1100]))
def test_growth_refusal_matches_single_cache_append(top, t, max_seq_len):
    """The same append to a reference SingleCache holding `top` columns and to a port batch
    whose longest row holds `top`: refused by both or neither, same message, same capacity."""
    if -(-top // 512) * 512 > max_seq_len:  # the fill itself must fit
        max_seq_len = 2048
    sc = SingleCache(max_seq_len)
    sc.append(np.zeros((1, 1, top, 2)))
    kv, _, _ = filled([top, max(top // 3, 1)], max_seq_len=max_seq_len)
    assert kv.capacity == sc.capacity_seq_len
    r = outcome(sc.append, np.ones((1, 1, t, 2)))
    p = outcome(kv.append, torch.ones((2, 1, t, 2), dtype=torch.float64, device=DEVICE),
                torch.ones((2, 1, t, 2), dtype=torch.float64, device=DEVICE))
    if assert_same_refusal(p, r, "append growth"):
        assert kv.capacity == sc.capacity_seq_len


@pytest.mark.rule("SingleCache::append, port layout")
def test_growth_refusal_example():
    kv, _, _ = filled([1023, 5], max_seq_len=1024)
    with pytest.raises(
        CacheRefusal, match="kv-cache capacity 1536 would be above max_seq_len 1024"
    ):
        kv.append(
            torch.zeros((2, 1, 2, 2), dtype=torch.float64),
            torch.zeros((2, 1, 2, 2), dtype=torch.float64),
        )
    assert kv.lens.tolist() == [1023, 5]  # refused before any write


@pytest.mark.rule("per-seq commit, port layout")
@given(lens=corner_lengths(1, 4, 600), new=st.lists(st.integers(0, 1100), min_size=4, max_size=4))
def test_set_len_refusal_matches_the_reference(lens, new):
    kv, _, _ = filled(lens)
    new = new[: len(lens)]
    refs = [
        KvCache(SingleCache(4096, kv.capacity, n), SingleCache(4096, kv.capacity, n)) for n in lens
    ]
    r = outcome(lambda: [c.try_set_len(n) for c, n in zip(refs, new, strict=False)])
    p = outcome(kv.set_len, torch.tensor(new))
    if assert_same_refusal(p, r, "set_len"):
        assert kv.lens.tolist() == new


@pytest.mark.rule("SingleCache::append, port layout")
@given(
    lens=corner_lengths(2, 6, 40, boundaries=False), data=st.data(), seed=st.integers(0, 2**32 - 1)
)
def test_append_to_a_row_subset_writes_only_those_rows(lens, data, seed):
    """A draft group inside a shared buffer: appending to rows `idx` writes their own next
    columns and leaves every other row (data and length) untouched."""
    kv, _, _ = filled(lens, seed)
    before = kv.clone()
    idx = sorted(data.draw(st.sets(st.integers(0, len(lens) - 1), min_size=1)))
    t = data.draw(st.integers(1, 4))
    new = to_port(np.random.default_rng(seed).normal(size=(len(idx), 1, t, 2)))
    kv.append(new, new + 1, rows=torch.tensor(idx))
    for i, n in enumerate(lens):
        k_row, v_row = kv.row(i)
        if i in idx:
            j = idx.index(i)
            assert int(kv.lens[i]) == n + t
            assert_bit_exact(k_row[:, :n], before.row(i)[0])
            assert_bit_exact(k_row[:, n:], new[j])
            assert_bit_exact(v_row[:, n:], new[j] + 1)
        else:
            assert int(kv.lens[i]) == n
            assert_bit_exact(kv.k[i], before.k[i])


def rows_data(rng, lens, dtype, h=H, d=D):
    """Row i: K and V `[1, h, lens[i], d]` float64 values representable in `dtype`."""
    return [
        (
            representable(rng.normal(size=(1, h, n, d)), dtype),
            representable(rng.normal(size=(1, h, n, d)), dtype),
        )
        for n in lens
    ]


def ref_caches(data, max_seq_len, capacity=None):
    """One single-slot NormalCache per row, filled by one append."""
    out = []
    for k, v in data:
        kv = (
            KvCache.new_normal(max_seq_len)
            if capacity is None
            else KvCache.new_normal(max_seq_len, capacity)
        )
        kv.append(k, v)
        out.append(NormalCache([kv]))
    return out


def port_kv(data, max_seq_len, dtype, capacity=None):
    return RaggedKv.from_rows(
        [to_port(k[0], dtype) for k, _ in data],
        [to_port(v[0], dtype) for _, v in data],
        max_seq_len,
        capacity,
    )


def live(single: SingleCache) -> np.ndarray:
    return single.data[:, :, : single.physical]


@pytest.mark.rule(
    "front_align_batch + clone_in_cache, port layout",
    "SingleCache::append, port layout",
)
@dtypes
@given(lens=corner_lengths(1, 4, 80), t=st.integers(1, 9), seed=st.integers(0, 2**32 - 1),
       big=st.booleans())
def test_materialized_batch_and_append_match_the_reference(dtype, lens, t, seed, big):
    """`front_align_batch` + `clone_in_cache` (reference) == `materialize_front_aligned` of
    the in-place rows; then this step's append (reference: at the shared column T; port:
    at each row's own offset, one scatter) leaves them equal again, and growth above
    `max_seq_len` is refused by both (same message)."""
    rng = np.random.default_rng(seed)
    max_seq_len = 4096 if big else (1024 if max(lens) <= 1024 else 1536)
    data = rows_data(rng, lens, dtype)
    caches = ref_caches(data, max_seq_len)
    clone = ref_align.clone_in_cache(caches, [], False)
    batched = clone.batched.slots[0]
    kv = port_kv(data, max_seq_len, dtype)
    assert int(kv.lens.max()) == batched.current_seq_len
    k, v = materialize_front_aligned(kv)
    assert k.dtype == dtype
    assert_bit_exact(k, live(batched.k), "front-aligned K")
    assert_bit_exact(v, live(batched.v), "front-aligned V")

    new_k = representable(rng.normal(size=(len(lens), H, t, D)), dtype)
    new_v = representable(rng.normal(size=(len(lens), H, t, D)), dtype)
    r = outcome(batched.append, new_k, new_v)
    p = outcome(kv.append, to_port(new_k, dtype), to_port(new_v, dtype))
    if assert_same_refusal(p, r, "append"):
        assert host(kv.lens).tolist() == [n + t for n in lens]
        k, v = materialize_front_aligned(kv)
        assert_bit_exact(k, live(batched.k), "K after append")
        assert_bit_exact(v, live(batched.v), "V after append")


@pytest.mark.rule("per-seq commit, port layout")
@given(
    lens=corner_lengths(1, 4, 60, boundaries=False),
    steps=st.integers(1, 3),
    depth=st.integers(1, 4),
    seed=st.integers(0, 2**32 - 1),
)
def test_per_sequence_steps_match_the_reference_cycle(lens, steps, depth, seed):
    """Several per-sequence steps. Reference: `clone_in_cache_reporting_lead` (front-align),
    append the window's w columns at T, `clone_out_cache`, then per row
    `commit_per_sequence` (strip the lead, `set_len(own + committed)`). Port: append at each
    row's own offset, `commit_per_sequence` (lengths only). Every row's live run is equal
    after every step, and so is the next step's front-aligned batch."""
    rng = np.random.default_rng(seed)
    w = depth + 1
    data = rows_data(rng, lens, torch.float64)
    caches = ref_caches(data, 4096)
    kv = port_kv(data, 4096, torch.float64)
    for _ in range(steps):
        own = [c.current_seq_len for c in caches]
        clone = ref_align.clone_in_cache_reporting_lead(caches, [], False, per_sequence=True)
        k_front, _ = materialize_front_aligned(kv)
        assert_bit_exact(k_front, live(clone.batched.slots[0].k), "front-aligned K at step start")
        new_k, new_v = rng.normal(size=(len(own), H, w, D)), rng.normal(size=(len(own), H, w, D))
        clone.batched.slots[0].append(new_k, new_v)
        kv.append(to_port(new_k), to_port(new_v))
        committed = [int(rng.integers(1, w + 1)) for _ in own]
        caches = ref_align.clone_out_cache(clone.batched, len(own))
        for c, lead, n, m in zip(caches, clone.lead_pad, own, committed, strict=False):
            commit_per_sequence(c, lead, n, m)
        kv.commit_per_sequence(torch.tensor(own), torch.tensor(committed))
        for i, c in enumerate(caches):
            k_row, v_row = kv.row(i)
            assert_bit_exact(k_row[None], live(c.slots[0].k), f"row {i} K")
            assert_bit_exact(v_row[None], live(c.slots[0].v), f"row {i} V")


def marked(b, width):
    """`[b, 1, width, 1]` float64 with row i, column c = 100 * (i + 1) + c: no zero anywhere,
    so a zero in a result is a column nothing was read into."""
    vals = (torch.arange(b, dtype=torch.float64)[:, None] + 1) * 100 + torch.arange(width)
    return vals[:, None, :, None].clone()


@pytest.mark.rule("front_align_batch + clone_in_cache, port layout")
def test_materialize_pads_to_an_explicit_target_and_handles_no_rows():
    """Rows [100, 101] and [200] (capacity 4) front-aligned to 3 columns: [0, 100, 101] and
    [0, 0, 200]; with no rows the batch is 0 columns wide."""
    kv = RaggedKv(marked(2, 4), marked(2, 4) + 0.5, [2, 1], 4096)
    k, v = materialize_front_aligned(kv, target=3)
    assert k[:, 0, :, 0].tolist() == [[0, 100, 101], [0, 0, 200]]
    assert v[:, 0, :, 0].tolist() == [[0, 100.5, 101.5], [0, 0, 200.5]]
    empty = RaggedKv.empty(0, 1, 1, 4096, 4)
    k, v = materialize_front_aligned(empty)
    assert list(k.shape) == [0, 1, 0, 1] and list(v.shape) == [0, 1, 0, 1]
    with pytest.raises(ValueError, match=r"^target 2 is shorter than the longest row 3$"):
        materialize_front_aligned(RaggedKv(marked(2, 4), marked(2, 4), [3, 1], 4096), target=2)


# --- the slots' buffer helpers --------------------------------------------------------------


@pytest.mark.rule("slot buffers: physical growth, row shifts and baked offsets, port layout")
def test_grow_physical_pads_whole_blocks_or_widens_a_paged_view():
    k = torch.arange(1.0, 17.0, dtype=F64).reshape(1, 1, 8, 2)
    kv = RaggedKv(k, -k, [8], 4096)
    grow_physical(kv, 8)
    assert kv.k is k  # fits: untouched
    grow_physical(kv, 9)
    assert kv.capacity == 520 and kv.k.shape == kv.v.shape == (1, 1, 520, 2)
    assert torch.equal(kv.k[:, :, :8], k) and torch.equal(kv.v[:, :, :8], -k)
    assert not kv.k[:, :, 8:].any() and not kv.v[:, :, 8:].any()
    grow_physical(kv, 520 + 513)
    assert kv.capacity == 520 + 1024

    class Paged:
        capacity = 8
        asked: list = []

        def reserve(self, n):
            self.asked.append(n)

    paged = Paged()
    grow_physical(paged, 8)
    grow_physical(paged, 30)
    assert paged.asked == [30]


@pytest.mark.rule("slot buffers: physical growth, row shifts and baked offsets, port layout")
def test_shift_rows_moves_each_own_run_and_zero_fills():
    """Row 0 (3 own columns) moved right by 2, row 1 (4) left by 1, row 2 (0) kept: zeros in
    front and past every run; the host lengths `own + shift`; a width past the buffer grows
    by whole blocks."""
    k = torch.arange(1.0, 1 + 3 * 6 * 2, dtype=F64).reshape(3, 1, 6, 2)
    out = shift_rows(k, -k, np.array([3, 4, 0]), np.array([2, -1, 0]), 77)
    want = torch.zeros_like(k)
    want[0, :, 2:5], want[1, :, 0:3] = k[0, :, 0:3], k[1, :, 1:4]
    assert torch.equal(out.k, want) and torch.equal(out.v, -want) and out.k.dtype == F64
    assert out.host_lens().tolist() == [5, 3, 0] and out.max_seq_len == 77
    wide = shift_rows(k, -k, np.array([6, 1, 0]), np.array([1, 0, 0]), 77)
    assert wide.capacity == 6 + 512 and torch.equal(wide.k[0, :, 1:7], k[0])
    assert wide.host_lens().tolist() == [7, 1, 0] and not wide.k[0, :, 7:].any()
    assert not wide.k[0, :, 0].any() and torch.equal(wide.v[1, :, :1], -k[1, :, :1])


@pytest.mark.rule("slot buffers: physical growth, row shifts and baked offsets, port layout")
def test_shift_rows_reads_a_run_that_fills_the_buffer_up_to_its_last_column():
    """A run as wide as the buffer moved left by 1 keeps its columns 1.. at 0.., the last
    column read too, a zero after it; a one-column buffer whose only column is cut holds
    nothing (a left move never reads past the buffer)."""
    k = torch.arange(1.0, 9.0, dtype=F64).reshape(1, 1, 4, 2)
    out = shift_rows(k, -k, np.array([4]), np.array([-1]), 64)
    want = torch.zeros_like(k)
    want[0, :, 0:3] = k[0, :, 1:4]
    assert torch.equal(out.k, want) and torch.equal(out.v, -want)
    assert out.host_lens().tolist() == [3]
    one = torch.ones(1, 1, 1, 2, dtype=F64)
    cut = shift_rows(one, -one, np.array([1]), np.array([-1]), 64)
    assert cut.k.shape == (1, 1, 1, 2) and not cut.k.any() and not cut.v.any()
    assert cut.host_lens().tolist() == [0]
