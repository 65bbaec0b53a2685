"""Port conformance: the torch port's cache slots (gpu.slots) at the edges the random
walks of test_port_slots.py rarely reach, each a small explicit case against the rule or the
reference: a row run that fills its buffer to the last column (and a one-column buffer) moved
by `shift_rows`; an append whose slot capacity fits after a strip narrowed it while the
physical buffer must grow past `max_seq_len` (never refused: the capacity arithmetic
decided); the length setter and clone of a slot of no rows or no buffer; a row handle's front
padding refused with the reference's messages; clone-in of whole batched slots and of rows
from buffers of different widths; the slot kinds of one layer (one slot alone, XsRolling
bases reconciled with the xs flag off); and an xs clone-in whose live rows hold no compressed
block yet next to a row never appended to."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from raggedspec.gpu.slots import TorchKv, shift_rows, stack_kv, stack_layer, stack_xs, xs_rows
from raggedspec.gpu.testing import assert_bit_exact, to_port
from raggedspec.gpu.xs_rolling import XsRolling
from raggedspec.reference import align as ref_align
from raggedspec.reference.cache import KvCache, SingleCache
from raggedspec.reference.errors import CacheRefusal
from raggedspec.reference.xs_rolling import XsRolling as RefXs

F64 = torch.float64


def ref_slot(max_seq_len: int, cap: int) -> KvCache:
    return KvCache(SingleCache(max_seq_len, cap), SingleCache(max_seq_len, cap))


def same(port, ref: KvCache, what: str) -> None:
    """`current`, `capacity` and the front-aligned K, V of a port slot are the reference's."""
    assert port.current_seq_len == ref.k.current_seq_len, f"{what}: current"
    assert port.capacity_seq_len == ref.k.capacity_seq_len, f"{what}: capacity"
    got = port.front_aligned()
    assert got is not None and ref.k.data is not None, f"{what}: materialized"
    assert_bit_exact(got[0], ref.k.current_data(), f"{what}: K")
    assert_bit_exact(got[1], ref.v.current_data(), f"{what}: V")


def same_xs(port: XsRolling, ref: RefXs, what: str) -> None:
    got = port.to_reference()
    assert (got.tokens, got.base) == (ref.tokens, ref.base), f"{what}: tokens, base"
    assert (got.tail is None) == (ref.tail is None) and got.dim == ref.dim, f"{what}: dim"
    if ref.tail is not None:
        assert_bit_exact(got.tail, ref.tail, f"{what}: tail")
        assert_bit_exact(got.comp, ref.comp, f"{what}: comp")


def cols(n: int, start: float = 1.0) -> np.ndarray:
    """`[1, 1, n, 2]` distinct values."""
    return np.arange(start, start + 2 * n).reshape(1, 1, n, 2)


# --- shift_rows at the last column ------------------------------------------------------------


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


@pytest.mark.rule("slot buffers: physical growth, row shifts and baked offsets, port layout")
def test_a_strip_of_a_whole_one_column_buffer_equals_the_reference():
    """A slot of capacity 0 allocates a buffer of one column on its first one-column append
    (the capacity grows to 512); stripping that column leaves nothing, as the reference."""
    ref, port = ref_slot(1024, 0), TorchKv(1024, 0)
    ref.append(cols(1), -cols(1))
    port.append(to_port(cols(1)), to_port(-cols(1)))
    assert port.kv.capacity == 1 and port.capacity == 512
    ref_align.drop_dead_prefix(ref, 1)
    port.drop_front(1)
    assert (port.current, port.capacity) == (ref.k.current_seq_len, ref.k.capacity_seq_len)
    assert (port.current, port.capacity) == (0, 511) and port.own.tolist() == [0]


# --- appends, set_len and clone at the edges ---------------------------------------------------


@pytest.mark.rule("K/V append, growth and set_len, backend")
def test_an_append_after_a_strip_grows_the_buffer_past_max_seq_len_unrefused():
    """560 columns at most: 520 appended (capacity 528, a buffer of 520), 500 stripped
    (capacity 28), 510 appended: the capacity grows by one block to 540 <= 560 and the append
    is accepted, as the reference's; the buffer must hold 530 columns, so it grows from its
    own 520 by one block to 1032 (physical growth is never refused)."""
    ref, port = ref_slot(560, 16), TorchKv(560, 16)
    for step in (520, None, 510):
        if step is None:
            ref_align.drop_dead_prefix(ref, 500)
            port.drop_front(500)
            continue
        k = cols(step, float(port.current))
        ref.append(k, -k)
        port.append(to_port(k), to_port(-k))
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


# --- clone-in -------------------------------------------------------------------------------------


@pytest.mark.rule("stacking slots into one batch, port")
def test_stack_kv_takes_batched_slots_row_by_row():
    """A materialized batched slot given whole is its rows (with a handle of another slot
    after them): the same K/V as the reference's concatenation of its pieces."""
    k = np.arange(1.0, 1 + 2 * 3 * 2).reshape(2, 1, 3, 2)
    ref, port = ref_slot(64, 16), TorchKv(64, 16)
    ref.append(k, -k)
    port.append(to_port(k), to_port(-k))
    same(stack_kv([port]), ref, "one batched slot")
    other_ref, other = ref_slot(64, 16), TorchKv(64, 16)
    other_ref.append(cols(3, 50.0), -cols(3, 50.0))
    other.append(to_port(cols(3, 50.0)), to_port(-cols(3, 50.0)))
    got = stack_kv([port] + other.rows())
    assert got.batch == 3
    same(got, ref_align.concat_kv([ref, other_ref]), "a batched slot and a handle")


@pytest.mark.rule("stacking slots into one batch, port")
def test_stack_kv_gathers_rows_of_buffers_of_different_widths():
    """Rows of equal length from a 16-column buffer and from one grown to 20 columns (20
    appended, set back to 4): stacked, in both orders, as the reference's concatenation
    (capacity of the widest, 528)."""
    narrow_ref, narrow = ref_slot(600, 16), TorchKv(600, 16)
    narrow_ref.append(cols(4), -cols(4))
    narrow.append(to_port(cols(4)), to_port(-cols(4)))
    wide_ref, wide = ref_slot(600, 16), TorchKv(600, 16)
    wide_ref.append(cols(20, 100.0), -cols(20, 100.0))
    wide.append(to_port(cols(20, 100.0)), to_port(-cols(20, 100.0)))
    wide_ref.set_len(4)
    wide.set_len(4)
    assert (narrow.kv.capacity, wide.kv.capacity) == (16, 20)
    for parts, refs in (([narrow, wide], [narrow_ref, wide_ref]),
                        ([wide, narrow], [wide_ref, narrow_ref])):
        got = stack_kv([p.rows()[0] for p in parts])
        assert got.capacity == 528
        same(got, ref_align.concat_kv(refs), "two buffer widths")


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
    a, b = RefXs(2, 1, None, 64, 1, 3, 2), RefXs(2, 1, None, 64, 1, 3, 2)
    a.append_rows(rng.standard_normal((1, 7, 3)))
    b.append_rows(rng.standard_normal((1, 9, 3)))
    b.set_len(7)
    assert (a.tokens, a.base, b.tokens, b.base) == ([7], [4], [7], [6])
    handles = xs_rows(XsRolling.from_reference(a)) + xs_rows(XsRolling.from_reference(b))
    off = stack_layer(handles, 2, False)
    assert off.host_base().tolist() == [6, 6]
    same_xs(off, RefXs.stack([a, b], True), "xs flag off")
    on = stack_layer(handles, 2, True)
    assert on.host_base().tolist() == [4, 6]
    same_xs(on, RefXs.stack([a, b], False), "xs flag on")


@pytest.mark.rule("stacking slots into one batch, port")
def test_stack_xs_of_rows_without_a_compressed_block_keeps_comp_empty():
    """A row that holds fewer tokens than the ratio (no compressed block) next to a row never
    appended to: the stacked comp is as wide as the widest live comp, 0 columns, as the
    reference's stack; the never-appended row's tail is zeros."""
    live, never = RefXs(4, max_seq_len=64), RefXs(4, max_seq_len=64)
    live.append_rows(np.arange(1.0, 10.0).reshape(1, 3, 3))
    parts = xs_rows(XsRolling.from_reference(live)) + xs_rows(XsRolling(4, max_seq_len=64))
    got = stack_xs(parts)
    assert got.comp.shape == (2, 0, 3) and not got.ring[1].any()
    same_xs(got, RefXs.stack([live, never]), "no block yet")
