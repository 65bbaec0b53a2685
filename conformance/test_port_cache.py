"""Port conformance: `RaggedKv` operations with a reference counterpart outside alignment
(gpu.cache vs reference.cache / reference.align): growth and set_len refusals, split and
concatenation of row sets, and the in-place append to a subset of rows (a draft group
inside a shared buffer). Data movement and integers: bit-exact."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from raggedspec.conformance.strategies import GROWTH_BOUNDARIES, corner_lengths
from raggedspec.gpu.align import materialize_front_aligned
from raggedspec.gpu.cache import RaggedKv, chunk_sizes, concat_rows, split_rows
from raggedspec.gpu.testing import DEVICE, assert_bit_exact, assert_same_refusal, outcome, to_port
from raggedspec.reference import align as ref_align
from raggedspec.reference.cache import KvCache, SingleCache
from raggedspec.reference.errors import CacheRefusal


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


@pytest.mark.rule("split_draft_cache, concat_kv, port layout")
@given(lens=corner_lengths(1, 7, 30, boundaries=False), g=st.integers(1, 9))
def test_split_rows_uses_the_reference_chunking(lens, g):
    """Candle chunk sizes (as `split_draft_cache`): pieces of consecutive rows, None when
    the piece count is not g; each row keeps its own length and data."""
    kv, ks, _ = filled(lens)
    pieces = split_rows(kv, g)
    ref_sizes = ref_align._chunk_sizes(len(lens), g)
    assert chunk_sizes(len(lens), g) == ref_sizes
    if len(ref_sizes) != g:
        assert pieces is None
        return
    assert [p.batch for p in pieces] == ref_sizes
    flat = [(p, j) for p in pieces for j in range(p.batch)]
    for i, (p, j) in enumerate(flat):
        assert_bit_exact(p.row(j)[0], ks[i], f"row {i}")
    back = concat_rows(pieces)
    assert back.lens.tolist() == lens
    assert_bit_exact(materialize_front_aligned(back)[0], materialize_front_aligned(kv)[0])


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


@pytest.mark.rule("the port's per-sequence caches and clone-in")
def test_clone_in_of_the_last_clone_outs_pieces_moves_no_kv():
    """The port's clone-out hands out row handles (host integers, no tensor); a clone-in of
    one batch's handles in order is the same buffer (no K/V copied: same storage); out of
    order the rows are gathered; a strip that cuts into the rows' own runs moves the start
    (host integer) and the clone-in gathers the runs to column 0."""
    import torch

    from raggedspec.gpu.cache import RaggedKv
    from raggedspec.gpu.slots import TorchKv, concat_stats, stack_kv

    k = torch.arange(3 * 1 * 8 * 2, dtype=torch.float64).reshape(3, 1, 8, 2)
    slot = TorchKv(4096, 8, 5, RaggedKv(k, -k, [5, 5, 5], 4096), [0, 0, 0])
    pieces = slot.rows()
    assert [(p.row, p.lead, p.own, p.current) for p in pieces] == [
        (0, 0, 5, 5),
        (1, 0, 5, 5),
        (2, 0, 5, 5),
    ]
    before = dict(concat_stats)
    again = stack_kv(pieces)
    assert concat_stats["view"] == before["view"] + 1 and concat_stats["copy"] == before["copy"]
    assert (
        again.kv.k.data_ptr() == k.data_ptr()
        and torch.equal(again.kv.k, k)
        and torch.equal(again.kv.v, -k)
    )
    assert again.kv.lens.tolist() == [5, 5, 5] and again.current == 5
    swapped = stack_kv([pieces[1], pieces[0], pieces[2]])  # out of order: a gather, rows swapped
    assert concat_stats["copy"] == before["copy"] + 1
    assert torch.equal(swapped.kv.k, k[[1, 0, 2]]) and swapped.kv.k.data_ptr() != k.data_ptr()
    for p in pieces:
        p.drop_front(2)                                            # cuts every row's own run
    assert [(p.shift, p.own, p.current, p.capacity) for p in pieces] == [(2, 3, 3, 6)] * 3
    moved = stack_kv(pieces)  # one gather moves every run
    assert moved.kv.k.data_ptr() != k.data_ptr() and torch.equal(
        k, torch.arange(48.0).reshape(3, 1, 8, 2)
    )
    assert torch.equal(moved.kv.k[:, :, :3], k[:, :, 2:5]) and moved.kv.lens.tolist() == [3, 3, 3]
