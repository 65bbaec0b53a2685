"""The torch port's cache slots (gpu.slots) against the reference's (reference.cache,
reference.align) on the same operations: a batched K/V slot (`TorchKv`) and its row handles
(`RowKv`) go through appends (with growth and its refusal), `set_len`, front padding and
dead-prefix strips, clone-out (`rows`) and clone-in (`stack_kv`, from one or several sources,
in or out of order, after strips that cut into the rows' own runs); after every step the
refusal (class and message), `current`, `capacity` and the front-aligned K and V are the
reference's `SingleCache` ones, bit for bit. The XsRolling row handles (`RowXs`, `xs_rows`,
`stack_xs`) are compared with the reference's `split_rows` / `stack` the same way. Small
explicit cases pin the edges the random walks rarely reach (a one-column buffer, an append
after a strip, a slot of no rows, rows of buffers of different widths) and what the
reference has no counterpart for: `bake`, the slot kinds (`stack_layer`), the ValueErrors of
clone-in and which clone-ins move no K/V."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from raggedspec.conformance.helpers import assert_same_xs
from raggedspec.gpu.cache import RaggedKv
from raggedspec.gpu.slots import (
    XS,
    TorchKv,
    concat_stats,
    stack_kv,
    stack_layer,
    stack_xs,
    xs_rows,
)
from raggedspec.gpu.testing import assert_bit_exact, assert_same_refusal, outcome, to_port
from raggedspec.gpu.xs_rolling import XsRolling
from raggedspec.reference import align as ref_align
from raggedspec.reference.cache import KvCache, SingleCache
from raggedspec.reference.errors import CacheRefusal
from raggedspec.reference.xs_rolling import XsRolling as RefXs


MAX_SEQ_LEN = 560  # one growth from 16 (to 528) fits, a second (1040) is refused
CAP = 16
F64 = torch.float64


def ref_slot(cap: int = CAP) -> KvCache:
    return KvCache(SingleCache(MAX_SEQ_LEN, cap), SingleCache(MAX_SEQ_LEN, cap))


def kv_pair(max_seq_len: int, cap: int) -> tuple[KvCache, TorchKv]:
    """A reference K/V slot and a port one, both empty."""
    return KvCache(SingleCache(max_seq_len, cap), SingleCache(max_seq_len, cap)), TorchKv(
        max_seq_len, cap)


def cols(n: int, start: float = 1.0) -> np.ndarray:
    """`[1, 1, n, 2]` distinct values."""
    return np.arange(start, start + 2 * n).reshape(1, 1, n, 2)


def fill(pair, k: np.ndarray) -> None:
    """The same append of `k` (K) and `-k` (V) to a reference slot and a port slot."""
    ref, port = pair
    ref.append(k, -k)
    port.append(to_port(k), to_port(-k))

def same(port, ref: KvCache, what: str) -> None:
    """`current`, `capacity` and the front-aligned K, V of a port slot are the reference's."""
    assert port.current_seq_len == ref.k.current_seq_len, f"{what}: current"
    assert port.capacity_seq_len == ref.k.capacity_seq_len, f"{what}: capacity"
    got = port.front_aligned()
    if ref.k.data is None:
        assert got is None and not port.materialized, f"{what}: materialized"
        return
    assert port.materialized, f"{what}: materialized"
    if isinstance(port, TorchKv):  # the buffer carries the slot's max_seq_len, int64 offsets
        assert port.kv.max_seq_len == port.max_seq_len and port.lead.dtype == np.int64, what
    assert_bit_exact(got[0], ref.k.current_data(), f"{what}: K")
    assert_bit_exact(got[1], ref.v.current_data(), f"{what}: V")


OPS = st.lists(st.tuples(st.sampled_from(["append", "set_len", "front_pad", "drop_front"]),
                         st.integers(0, 20)), max_size=6)


def apply(op: str, n: int, port, ref: KvCache, rng, what: str) -> None:
    """One operation on both (the reference's slot functions; the port slot's own methods).
    `n` in [0, 20] picks the argument, mostly next to the rules' boundaries."""
    b = 1 if ref.k.data is None else ref.k.data.shape[0]
    cur, cap = ref.k.current_seq_len, ref.k.capacity_seq_len
    if op == "append":
        if not isinstance(port, TorchKv):
            return
        # 530: a growth by one block (or its refusal) of a slot holding data (a refused
        # first append leaves the reference's buffer allocated, the port's not)
        s = n % 5 if n < 15 else cap - cur if n < 18 or ref.k.data is None else 530
        k = rng.standard_normal((b, 1, s, 2))
        r, p = outcome(ref.append, k, -k), outcome(port.append, to_port(k), to_port(-k))
    elif op == "set_len":  # shrinks (growing into stale columns: contents unspecified)
        n = cap + 1 + n % 2 if n >= 18 else cur if n >= 15 else max(cur - n % 4, 0)
        r, p = outcome(ref.set_len, n), outcome(port.set_len, n)
    elif op == "front_pad":
        target = cur - 1 if n == 20 else MAX_SEQ_LEN + 1 if n == 19 else cur + n % 5
        if target < 0:
            return
        r = outcome(ref_align.front_pad_kv_cache, ref, target, False)
        p = outcome(port.front_pad, target)
        if r[0] == "ok":
            assert p[1] == r[1], f"{what}: front_pad lead"
    else:
        lead = cur + 1 if n == 20 else cur if n == 19 else n % 5
        r = outcome(ref_align.drop_dead_prefix, ref, lead)
        p = outcome(port.drop_front, lead)
    assert_same_refusal(p, r, f"{what}: {op} {n}")
    same(port, ref, f"{what}: after {op} {n}")


def chunks(ref: KvCache, b: int) -> list[KvCache]:
    """The reference's clone-out of one Normal slot into b rows."""
    return [KvCache(k, v) for k, v in zip(ref_align._chunk_single(ref.k, b),
                                          ref_align._chunk_single(ref.v, b), strict=True)]


@pytest.mark.rule("the port's per-sequence caches and clone-in")
@settings(max_examples=40, deadline=None)
@given(lens=st.lists(st.integers(0, 12), min_size=1, max_size=3), row_ops=OPS, row_ops2=OPS,
       batch_ops=OPS, seed=st.integers(0, 2**16), order=st.randoms(use_true_random=False))
def test_slots_follow_the_reference_through_clone_out_and_clone_in(
        lens, row_ops, row_ops2, batch_ops, seed, order):
    """Each row its own slot (appends, set_len, front_pad, strips), clone-out to a row handle
    (more of the same on the handle), front alignment to the longest, clone-in of the handles
    (one source per row), operations on the batch, clone-out of the batch and clone-in of its
    rows in a shuffled order interleaved with a clone's rows. Every step equals the
    reference's."""
    rng = np.random.default_rng(seed)
    refs, ports = [], []
    for i, n in enumerate(lens):
        ref, port = ref_slot(), TorchKv(MAX_SEQ_LEN, CAP)
        if n:
            k = rng.standard_normal((1, 1, n, 2))
            ref.append(k, -k)
            port.append(to_port(k), to_port(-k))
        for op, m in row_ops:
            apply(op, m, port, ref, rng, f"row {i}")
        handle = port.rows()[0]
        assert handle.lead == int(port.lead[0]) if port.materialized else handle.lead == 0
        clone, before = handle.clone(), ref.clone()
        for op, m in row_ops2:
            apply(op, m, handle, ref, rng, f"row {i} handle")
        same(clone, before, f"row {i}: a clone of the handle is not changed by the handle's ops")
        refs.append(ref)
        ports.append(handle)
    mats = [r.k.data is not None for r in refs]
    if any(mats) and not all(mats):
        with pytest.raises(ValueError, match="^cannot concatenate materialized and "
                                             "unmaterialized slots$"):
            stack_kv(ports)
        return
    target = max(r.k.current_seq_len for r in refs)
    for i, (ref, port) in enumerate(zip(refs, ports, strict=True)):
        r = outcome(ref_align.front_pad_kv_cache, ref, target, False)
        p = outcome(port.front_pad, target)
        assert_same_refusal(p, r, f"row {i}: front alignment")
        if r[0] != "ok":
            return
    batch_ref = ref_align.concat_kv(refs)
    batch = stack_kv(ports)
    same(batch, batch_ref, "clone-in")
    for op, m in batch_ops:
        apply(op, m, batch, batch_ref, rng, "batch")
    b = len(lens)
    handles = batch.rows() if batch.materialized else batch.rows() * b
    assert len(handles) == b
    pieces = chunks(batch_ref, b)
    for i, (h, piece) in enumerate(zip(handles, pieces, strict=True)):
        same(h, piece, f"clone-out row {i}")
    if not batch.materialized:
        return
    twin = batch.clone().rows()
    perm = list(range(b))
    order.shuffle(perm)
    mixed = [twin[j] if j % 2 else handles[j] for j in perm]
    same(stack_kv(mixed), ref_align.concat_kv([pieces[j] for j in perm]), "clone-in shuffled")


@pytest.mark.rule("the port's per-sequence caches and clone-in")
def test_clone_in_of_the_last_clone_outs_pieces_moves_no_kv():
    """The port's clone-out hands out row handles (host integers, no tensor); a clone-in of
    one batch's handles in order is the same buffer (no K/V copied: same storage); out of
    order the rows are gathered; a strip that cuts into the rows' own runs moves the start
    (host integer) and the clone-in gathers the runs to column 0."""
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


@pytest.mark.rule("stacking slots into one batch, port")
def test_stack_layer_refuses_mixed_kinds_and_stack_kv_its_malformed_inputs():
    kv, xs = TorchKv(64), XsRolling(2, max_seq_len=64, batch=1)
    with pytest.raises(ValueError, match=r"^layer 3 mixes slot kinds \['Normal', 'XsRolling'\]$"):
        stack_layer([kv, xs], 3, True)
    assert isinstance(stack_layer([kv, kv], 0, True), TorchKv)
    with pytest.raises(ValueError, match=r"^concat_kv needs at least one slot$"):
        stack_kv([])
    a, b = TorchKv(64, 16), TorchKv(64, 16)
    a.append(torch.ones(1, 1, 3, 2, dtype=F64), torch.ones(1, 1, 3, 2, dtype=F64))
    b.append(torch.ones(1, 1, 2, 2, dtype=F64), torch.ones(1, 1, 2, 2, dtype=F64))
    with pytest.raises(ValueError, match=r"^the port concatenates slots of one length only, "
                                         r"got \[3, 2\]$"):
        stack_kv([a, b])
    empty = stack_kv([TorchKv(64, 16, 5), TorchKv(70, 32, 5)])  # unmaterialized: metadata only
    assert (empty.max_seq_len, empty.capacity, empty.current, empty.kv) == (64, 32, 5, None)
    assert [(r.row, r.lead, r.current, r.k) for r in empty.rows()] == [(0, 0, 5, None)]


@pytest.mark.rule("slot buffers: physical growth, row shifts and baked offsets, port layout")
def test_bake_turns_alignment_offsets_into_physical_zeros():
    k = torch.arange(1.0, 1 + 2 * 8 * 2, dtype=F64).reshape(2, 1, 8, 2)
    slot = TorchKv(4096, 16, 6, RaggedKv(k, -k, [4, 6], 4096), [2, 0])
    view = slot.front_aligned()
    with pytest.raises(ValueError, match=r"^rows would need dead prefixes \[3, 0\] longer than "
                                         r"their alignment offsets \[2, 0\]$"):
        slot.bake(np.array([3, 0]))
    dead = np.array([0, 0])
    slot.bake(dead)
    dead[0] = 5  # the slot keeps its own copy
    assert slot.lead.tolist() == [0, 0] and slot.kv.host_lens().tolist() == [6, 6]
    assert slot.kv.max_seq_len == 4096
    assert not slot.kv.k[0, :, :2].any() and torch.equal(slot.kv.k[0, :, 2:6], k[0, :, :4])
    got = slot.front_aligned()
    assert torch.equal(got[0], view[0]) and torch.equal(got[1], view[1])
    before = slot.kv
    slot.bake(np.array([0, 0]))  # nothing to bake: untouched
    assert slot.kv is before


@pytest.mark.rule("slot buffers: physical growth, row shifts and baked offsets, port layout")
def test_a_slot_built_without_offsets_and_its_handles():
    slot = TorchKv(4096)
    assert (slot.capacity, slot.current, slot.lead, slot.batch) == (512, 0, None, 0)
    assert slot.supports_per_sequence_len() and not slot.materialized
    [row] = slot.rows()
    assert (row.row, row.lead, row.current, row.capacity, row.shift) == (0, 0, 0, 512, 0)
    k = torch.zeros(2, 1, 4, 2, dtype=F64)
    two = TorchKv(4096, 8, 3, RaggedKv(k, k, [3, 1], 4096), [[0], [2]])
    assert two.lead.tolist() == [0, 2] and two.own.tolist() == [3, 1] and two.batch == 2
    assert [(r.row, r.lead, r.own) for r in two.rows()] == [(0, 0, 3), (1, 2, 1)]


@pytest.mark.rule("K/V append, growth and set_len, backend")
def test_set_len_past_the_buffer_grows_it_and_a_handle_pads_its_view():
    """Front padding widens the capacity, not the buffer (the lead is an offset); a length set
    past the buffer then grows it by whole blocks (slot) or pads the view (handle): the own
    run stays at its columns, zeros after it (the reference's contents there are stale)."""
    k = torch.arange(1.0, 9.0, dtype=F64).reshape(1, 1, 4, 2)
    slot = TorchKv(4096, 16)
    slot.append(k, -k)
    assert slot.front_pad(600) == 596 and (slot.capacity, slot.kv.capacity) == (600, 16)
    handle = slot.rows()[0]
    slot.set_len(0)
    slot.set_len(600)
    assert slot.kv.capacity == 16 + 1024 and slot.kv.host_lens().tolist() == [600]
    view = slot.front_aligned()[0]
    assert view.shape == (1, 1, 600, 2) and torch.equal(view[:, :, :4], k)
    assert not view[:, :, 4:].any()
    handle.set_len(0)
    handle.set_len(600)
    got = handle.front_aligned()
    assert got[0].shape == got[1].shape == (1, 1, 600, 2)
    assert torch.equal(got[0][:, :, :4], k) and torch.equal(got[1][:, :, :4], -k)
    assert not got[0][:, :, 4:].any()
    empty = TorchKv(4096, 16)
    empty.append(torch.zeros(1, 1, 1, 2, dtype=F64), torch.zeros(1, 1, 1, 2, dtype=F64))
    row = empty.rows()[0]
    row.set_len(0)
    assert row.front_aligned()[0].shape == (1, 1, 0, 2)


@pytest.mark.rule("K/V append, growth and set_len, backend")
def test_the_first_append_allocates_the_buffer_and_later_ones_grow_it_past_its_own_width():
    """The first append allocates `max(capacity, s, 1)` columns on the appended tensors'
    device, V with its own width; a later append grows the buffer from its own width, never
    refused (the slot's capacity arithmetic decided already)."""
    meta = TorchKv(4096, 16)
    meta.append(torch.zeros(2, 1, 3, 4, device="meta"), torch.zeros(2, 1, 3, 5, device="meta"))
    assert meta.kv.k.device.type == meta.kv.v.device.type == "meta"
    assert meta.kv.k.shape == (2, 1, 16, 4) and meta.kv.v.shape == (2, 1, 16, 5)
    assert meta.lead.tolist() == [0, 0] and meta.lead.dtype == np.int64
    assert meta.kv.max_seq_len == 4096 and meta.kv.k.dtype == torch.float32
    wide = TorchKv(530, 16)
    k = torch.ones(1, 1, 20, 2, dtype=F64)
    wide.append(k, -k)  # 20 columns: capacity 528 (16 + one block), a buffer of 20
    assert (wide.capacity, wide.kv.capacity, wide.current) == (528, 20, 20)
    k = torch.ones(1, 1, 500, 2, dtype=F64)
    wide.append(k, -k)  # fits the capacity; the buffer grows to 532 (> max_seq_len: not refused)
    assert (wide.capacity, wide.kv.capacity, wide.current) == (528, 532, 520)
    tiny = TorchKv(64, 0)
    tiny.append(torch.zeros(1, 1, 0, 2, dtype=F64), torch.zeros(1, 1, 0, 2, dtype=F64))
    assert tiny.kv.capacity == 1 and tiny.current == 0
    none = TorchKv(64, 16)
    none.append(torch.zeros(0, 1, 3, 2, dtype=F64), torch.zeros(0, 1, 3, 2, dtype=F64))
    assert none.current == 3 and none.batch == 0 and none.rows() == []


# --- edges of the K/V slots ------------------------------------------------------------------


@pytest.mark.rule("slot buffers: physical growth, row shifts and baked offsets, port layout")
def test_a_strip_of_a_whole_one_column_buffer_equals_the_reference():
    """A slot of capacity 0 allocates a buffer of one column on its first one-column append
    (the capacity grows to 512); stripping that column leaves nothing, as the reference."""
    ref, port = pair = kv_pair(1024, 0)
    fill(pair, cols(1))
    assert port.kv.capacity == 1 and port.capacity == 512
    ref_align.drop_dead_prefix(ref, 1)
    port.drop_front(1)
    assert (port.current, port.capacity) == (ref.k.current_seq_len, ref.k.capacity_seq_len)
    assert (port.current, port.capacity) == (0, 511) and port.own.tolist() == [0]


@pytest.mark.rule("K/V append, growth and set_len, backend")
def test_an_append_after_a_strip_grows_the_buffer_past_max_seq_len_unrefused():
    """560 columns at most: 520 appended (capacity 528, a buffer of 520), 500 stripped
    (capacity 28), 510 appended: the capacity grows by one block to 540 <= 560 and the append
    is accepted, as the reference's; the buffer must hold 530 columns, so it grows from its
    own 520 by one block to 1032 (physical growth is never refused)."""
    ref, port = pair = kv_pair(560, 16)
    fill(pair, cols(520))
    ref_align.drop_dead_prefix(ref, 500)
    port.drop_front(500)
    fill(pair, cols(510, float(port.current)))
    assert (port.current, port.capacity, port.kv.capacity) == (530, 540, 1032)
    same(port, ref, "after strip and append")


@pytest.mark.rule("K/V append, growth and set_len, backend")
def test_a_slot_of_no_rows_sets_its_length_and_an_empty_slot_clones():
    """A batch of no rows keeps its length on the host (set_len within the capacity); a slot
    with no buffer clones to another with no buffer and the same metadata."""
    none = TorchKv(64, 16)
    none.append(torch.zeros(0, 1, 3, 2, dtype=F64), torch.zeros(0, 1, 3, 2, dtype=F64))
    none.set_len(2)
    assert (none.current, none.capacity, none.batch) == (2, 16, 0)
    none.set_len(16)
    assert none.current == 16 and none.kv.host_lens().tolist() == []
    empty = TorchKv(64, 32, 5)
    twin = empty.clone()
    assert twin is not empty and twin.kv is None and twin.lead is None
    assert (twin.max_seq_len, twin.capacity, twin.current) == (64, 32, 5)


@pytest.mark.rule("the port's per-sequence caches and clone-in")
def test_a_row_handle_refuses_front_padding_with_the_references_messages():
    """front_pad of a handle: a target shorter than its live run, past max_seq_len, or of an
    unmaterialized handle is refused (front_pad_refusal's messages), nothing changed."""
    slot = TorchKv(64, 16)
    slot.append(to_port(cols(5)), to_port(-cols(5)))
    [h] = slot.rows()
    with pytest.raises(CacheRefusal, match=r"^front_pad to 3 is shorter than the 5 live "
                                           r"positions$"):
        h.front_pad(3)
    with pytest.raises(CacheRefusal, match=r"^front_pad to 65: capacity 65 would be above "
                                           r"max_seq_len 64$"):
        h.front_pad(65)
    assert (h.current, h.lead, h.capacity) == (5, 0, 16)
    [bare] = TorchKv(64, 16).rows()
    with pytest.raises(CacheRefusal, match=r"^front_pad to 4: the slot's buffer is "
                                           r"unmaterialized \(0 live positions\)$"):
        bare.front_pad(4)
    assert (bare.current, bare.lead) == (0, 0)


@pytest.mark.rule("stacking slots into one batch, port")
def test_stack_kv_takes_batched_slots_row_by_row():
    """A materialized batched slot given whole is its rows (with a handle of another slot
    after them): the same K/V as the reference's concatenation of its pieces."""
    ref, port = pair = kv_pair(64, 16)
    fill(pair, np.arange(1.0, 1 + 2 * 3 * 2).reshape(2, 1, 3, 2))
    same(stack_kv([port]), ref, "one batched slot")
    other_ref, other = other_pair = kv_pair(64, 16)
    fill(other_pair, cols(3, 50.0))
    got = stack_kv([port] + other.rows())
    assert got.batch == 3
    same(got, ref_align.concat_kv([ref, other_ref]), "a batched slot and a handle")


@pytest.mark.rule("stacking slots into one batch, port")
def test_stack_kv_gathers_rows_of_buffers_of_different_widths():
    """Rows of equal length from a 16-column buffer and from one grown to 20 columns (20
    appended, set back to 4): stacked, in both orders, as the reference's concatenation
    (capacity of the widest, 528)."""
    narrow_ref, narrow = narrow_pair = kv_pair(600, 16)
    fill(narrow_pair, cols(4))
    wide_ref, wide = wide_pair = kv_pair(600, 16)
    fill(wide_pair, cols(20, 100.0))
    wide_ref.set_len(4)
    wide.set_len(4)
    assert (narrow.kv.capacity, wide.kv.capacity) == (16, 20)
    for parts, refs in (([narrow, wide], [narrow_ref, wide_ref]),
                        ([wide, narrow], [wide_ref, narrow_ref])):
        got = stack_kv([p.rows()[0] for p in parts])
        assert got.capacity == 528
        same(got, ref_align.concat_kv(refs), "two buffer widths")


# --- XsRolling row handles --------------------------------------------------------------------


def xs_pair(ratio, span, window, max_seq_len, batch, dim, margin=16):
    """A reference XsRolling slot and a port one of the same geometry."""
    return (RefXs(ratio, span, window, max_seq_len, batch, dim, margin),
            XsRolling(ratio, span, window, max_seq_len, batch, dim, margin))


def feed_both(pair, x: np.ndarray) -> None:
    pair[0].append_rows(x)
    pair[1].append_rows(to_port(x))


@pytest.mark.rule("the port's per-sequence caches and clone-in")
@settings(max_examples=25, deadline=None)
@given(ratio=st.sampled_from([2, 4]), span=st.integers(1, 2), extra=st.integers(0, 3),
       steps=st.lists(st.integers(1, 9), max_size=3),
       solo_steps=st.lists(st.integers(1, 9), max_size=2), cuts=st.lists(st.integers(0, 30),
       min_size=3, max_size=3), order=st.permutations([0, 1, 2]), reconcile=st.booleans(),
       whole=st.booleans(), via_layer=st.booleans(), seed=st.integers(0, 2**16))
def test_xs_row_handles_follow_the_reference(ratio, span, extra, steps, solo_steps, cuts, order,
                                             reconcile, whole, via_layer, seed):
    """A two-row batch and a one-row slot (the same appends of hidden rows on both sides),
    cloned out to handles (`xs_rows`), each rolled back (`set_len`, the reference's
    refusals), viewed as a slot (`as_slot`), and clone-in of the three in any order
    (`stack_xs`, directly or through `stack_layer`; the one-row slot passed whole or as its
    handle), with or without base reconciliation: tokens, bases, history and comp equal the
    reference's (a geometry other than the default one, the hidden width given up front)."""
    rng = np.random.default_rng(seed)
    window = span * ratio + 16 + extra
    pair, solo = (xs_pair(ratio, span, window, 64, b, 3) for b in (2, 1))
    for t in steps:
        feed_both(pair, rng.standard_normal((2, t, 3)))
    for t in solo_steps:
        feed_both(solo, rng.standard_normal((1, t, 3)))
    handles = xs_rows(pair[1]) + xs_rows(solo[1])
    refs = pair[0].split_rows() + solo[0].split_rows()
    for i, (h, r, n) in enumerate(zip(handles, refs, cuts, strict=True)):
        assert h.current_seq_len == r.current_seq_len and h.kind == r.kind == XS
        clone, before = h.clone(), r.clone()
        got, want = outcome(h.set_len, n), outcome(r.set_len, n)
        assert_same_refusal(got, want, f"row {i}: set_len {n}")
        assert_same_xs(h.as_slot(), r, f"row {i}")
        assert_same_xs(clone.as_slot(), before, f"row {i}: a clone is not changed by set_len")
        assert clone.as_slot().host_tokens().tolist() == before.tokens
    parts = [handles[j] for j in order]
    ref_parts = [refs[j] for j in order]
    if whole:  # the one-row slot as a batched slot, rolled back as its handle was
        parts[order.index(2)] = stack_xs([handles[2]])
    try:
        want = RefXs.stack(ref_parts, reconcile)
    except ValueError as exc:  # reconciling rows of different lengths
        with pytest.raises(ValueError, match=f"^{re.escape(str(exc))}$"):
            stack_xs(parts, reconcile)
        return
    got = stack_layer(parts, 0, not reconcile) if via_layer else stack_xs(parts, reconcile)
    assert_same_xs(got, want, "clone-in")


@pytest.mark.rule("the port's per-sequence caches and clone-in")
def test_xs_handles_refuse_a_negative_length_and_report_their_flag():
    meta = xs_rows(XsRolling(2, max_seq_len=64, batch=2, device="meta"))
    assert meta[1].as_slot().tokens.device.type == stack_xs(meta).tokens.device.type == "meta"
    assert stack_xs(meta).device.type == meta[0].as_slot().device.type == "meta"
    one = xs_pair(2, None, None, 64, 1, None)
    feed_both(one, np.ones((1, 5, 3)))
    alone = stack_xs(xs_rows(one[1]), reconcile_bases=True)
    assert_same_xs(alone, RefXs.stack([one[0]], True), "one row, bases reconciled")
    h = xs_rows(XsRolling(2, max_seq_len=64, batch=1))[0]
    with pytest.raises(ValueError, match=r"^set_len length -1 must be >= 0$"):
        h.set_len(-1)
    assert h.supports_per_sequence_len(True) is True
    assert h.supports_per_sequence_len() is False and h.supports_per_sequence_len(0) is False


@pytest.mark.rule("stacking slots into one batch, port")
def test_stack_xs_refuses_mixed_geometry_and_hidden_widths_and_unequal_tokens_to_reconcile():
    pa, pb = XsRolling(2, max_seq_len=64), XsRolling(2, max_seq_len=64)
    pa.append_rows(to_port(np.ones((1, 3, 3))))
    pb.append_rows(to_port(np.ones((1, 5, 2))))
    with pytest.raises(ValueError, match=r"^stack needs at least one xs slot$"):
        stack_xs([])
    with pytest.raises(ValueError, match=r"^xs slots in one layer must share ratio, span, "
                                         r"window and margin$"):
        stack_xs([pa, XsRolling(3, max_seq_len=64, batch=1)])
    with pytest.raises(ValueError, match=r"^xs slots with hidden widths \[2, 3\] cannot be "
                                         r"stacked$"):
        stack_xs([pa, pb])
    with pytest.raises(ValueError, match=r"^reconciling xs bases needs uniform tokens, got "
                                         r"\[3, 0\]$"):
        stack_xs([pa, XsRolling(2, max_seq_len=64, batch=1)], reconcile_bases=True)


@pytest.mark.rule("stacking slots into one batch, port")
def test_stack_layer_of_one_slot_and_of_xs_rows_reconciled_with_the_flag_off():
    """One slot alone is a layer of its kind. XsRolling rows of equal tokens and different
    bases (ratio 2, span 1, margin 2: 7 appended keeps base 4; 9 appended keeps 6, set back
    to 7): with the xs flag off their bases are reconciled to the largest, 6, as the
    reference's stack with reconciliation; with it on each keeps its own."""
    slot = TorchKv(64, 16)
    slot.append(to_port(cols(2)), to_port(-cols(2)))
    alone = stack_layer(slot.rows(), 0, True)
    assert isinstance(alone, TorchKv) and alone.current == 2 and alone.batch == 1
    rng = np.random.default_rng(5)
    a, b = xs_pair(2, 1, None, 64, 1, 3, 2), xs_pair(2, 1, None, 64, 1, 3, 2)
    feed_both(a, rng.standard_normal((1, 7, 3)))
    feed_both(b, rng.standard_normal((1, 9, 3)))
    b[0].set_len(7)
    b[1].set_len(7)
    assert (a[0].tokens, a[0].base, b[0].tokens, b[0].base) == ([7], [4], [7], [6])
    handles = xs_rows(a[1]) + xs_rows(b[1])
    off = stack_layer(handles, 2, False)
    assert off.host_base().tolist() == [6, 6]
    assert_same_xs(off, RefXs.stack([a[0], b[0]], True), "xs flag off")
    on = stack_layer(handles, 2, True)
    assert on.host_base().tolist() == [4, 6]
    assert_same_xs(on, RefXs.stack([a[0], b[0]], False), "xs flag on")


@pytest.mark.rule("stacking slots into one batch, port")
def test_stack_xs_of_rows_without_a_compressed_block_keeps_comp_empty():
    """A row that holds fewer tokens than the ratio (no compressed block) next to a row never
    appended to: the stacked comp is as wide as the widest live comp, 0 columns, as the
    reference's stack; the never-appended row's history is empty and its ring zeros."""
    live = xs_pair(4, None, None, 64, 1, None)
    feed_both(live, np.arange(1.0, 10.0).reshape(1, 3, 3))
    got = stack_xs(xs_rows(live[1]) + xs_rows(XsRolling(4, max_seq_len=64)))
    assert got.comp.shape == (2, 0, 3) and not got.ring[1].any()
    assert_same_xs(got, RefXs.stack([live[0], RefXs(4, max_seq_len=64)]), "no block yet")
