"""Port conformance: the rules of `gpu.cache.RaggedKv` on small explicit batches: the
constructor's shape and length checks (host integers and device tensors), `empty` and
`from_rows` placement and dtypes (checked on the meta device, where a tensor left on the CPU
shows), the append (all rows, a subset given as host integers or as a device tensor, growth
by whole 512-column blocks, the in-place write into a shared buffer), `set_len`,
`truncate_by`, `commit_per_sequence` and `set_row_len` on both length paths, the host copy of
the lengths (kept, so no device read, whenever the lengths were set from host integers), and
the split and concatenation of row sets of different capacities. Expected values follow the
class's docstrings: row i's position p at column p, `lens` its own length."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from raggedspec import host_work
from raggedspec.gpu.cache import RaggedKv, concat_rows, split_rows
from raggedspec.reference.errors import CacheRefusal

F64 = torch.float64


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
def test_an_append_that_exactly_fills_the_capacity_writes_into_the_shared_buffer():
    """A split piece is a view of the batch's buffers: an append that needs no growth writes
    there (one scatter, no new buffer)."""
    kv = kv_of([6, 1, 2], cap=8)
    piece = split_rows(kv, 3)[0]
    new = new_cols(1, 2)
    piece.append(new, -new)
    assert piece.lens.tolist() == [8] and piece.k.data_ptr() == kv.k.data_ptr()
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


# --- set_len, set_row_len, truncate_by, commit ------------------------------------------------


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


@pytest.mark.rule("truncate_cache_by, port layout")
@pytest.mark.parametrize("device_lens", [False, True], ids=["host", "device"])
@pytest.mark.parametrize("n_drop", [3, torch.tensor(3)], ids=["int", "tensor"])
def test_truncate_by_saturates_every_row_at_zero(device_lens, n_drop):
    kv = kv_of([5, 2, 3], device_lens=device_lens)
    kv.truncate_by(n_drop)
    assert kv.lens.tolist() == [2, 0, 0] and kv.host_lens().tolist() == [2, 0, 0]
    assert kv.lens.dtype == torch.int64
    if isinstance(n_drop, int) and not device_lens:
        assert reads(kv.host_lens) == 0
    with pytest.raises(ValueError, match=r"^n_drop must be a scalar, got shape \[2\]$"):
        kv.truncate_by(torch.tensor([1, 1]))


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


# --- split and concatenation ------------------------------------------------------------------


@pytest.mark.rule("split_draft_cache, concat_kv, port layout")
def test_split_rows_refuses_no_pieces_and_keeps_max_seq_len():
    kv = kv_of([3, 1], max_seq_len=100)
    with pytest.raises(ValueError, match=r"^split needs g >= 1, got 0$"):
        split_rows(kv, 0)
    assert [p.max_seq_len for p in split_rows(kv, 2)] == [100, 100]


@pytest.mark.rule("split_draft_cache, concat_kv, port layout")
def test_concat_rows_pads_every_part_to_the_widest_capacity():
    """Parts of capacities 4 and 8 (head dim 8, the wider capacity): the narrow part's rows
    get zero columns 4..7, every row keeps its data and length; max_seq_len from the first."""
    a_k, b_k = numbered(1, 4, d=8), numbered(2, 8, d=8) + 500
    a = RaggedKv(a_k, -a_k, [3], 100)
    b = RaggedKv(b_k, -b_k, [8, 2], 200)
    for parts, order in (([a, b], [0, 1, 2]), ([b, a], [1, 2, 0])):
        out = concat_rows(parts)
        assert out.k.shape == out.v.shape == (3, 1, 8, 8)
        want = torch.cat([torch.nn.functional.pad(a_k, (0, 0, 0, 4)), b_k])[order]
        assert torch.equal(out.k, want) and torch.equal(out.v, -want)
        assert out.lens.tolist() == [[3, 8, 2][i] for i in order]
        assert out.max_seq_len == parts[0].max_seq_len
    with pytest.raises(ValueError, match=r"^concat_rows needs at least one part$"):
        concat_rows([])
