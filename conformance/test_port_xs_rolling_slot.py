"""The port's XsRolling slot beyond the rule comparisons of test_port_xs_rolling.py, on small
explicit cases: the plan's vectors where no block is taken (-1, the reference's None) and its
clamps at the start of the history (ratio 1 included), its malformed-input messages; the
conversions to and from the reference keeping every size field, dtype and device; the
unmaterialized slot's empty rows; `resumable_from`, `compress_blocks`' checks and precision
rule, and the slot helpers (`supports_per_sequence_len`, `reset`, `clone`, `repr`). Expected
values come from the docstrings of gpu/xs_rolling.py and reference/xs_rolling.py and the §13
formulas (masks-and-scheduling.md). Where a slot is placed is checked on torch's "meta" device,
which every machine has (lengths only: meta kernels are slow to load)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import raggedspec.gpu.xs_rolling as port
from raggedspec.reference import xs_rolling as ref

META = torch.device("meta")


# --- plan_xs_advance -----------------------------------------------------------------------


@pytest.mark.rule("plan_xs_advance, port")
def test_the_plan_marks_rows_without_a_new_block_with_minus_one():
    """`need_start`, `off`, `length` are -1 where `take == 0` (the reference's None)."""
    plan = port.plan_xs_advance([13, 0], [0, 0], 24, 2, 4, 2, 16)
    assert plan.take.tolist() == [0, 0]
    assert plan.need_start.tolist() == plan.off.tolist() == plan.length.tolist() == [-1, -1]
    assert plan.tokens_after.tolist() == [15, 2] and plan.dest.tolist() == [3, 0]


@pytest.mark.rule("plan_xs_advance, port")
def test_the_plan_clamps_at_the_start_of_the_history():
    """Tokens 0 + 8 at ratio 4, span 2: `need_start = max(0, 0 + 1 - 2) * 4 = 0`, `off = 0 +
    24 - 0`, `length = 2 * 4 - 0`; `keep_from = max(0, (max(8 - 16, 0) // 4 + 1 - 2) * 4) = 0`.
    Ratio 1, span 1, tokens 0 + 2, margin 16: `keep_from = max(0, (0 // 1 + 1 - 1) * 1) = 0`."""
    row = port.plan_xs_advance([0], [0], 24, 8, 4, 2, 16).reference_rows()[0]
    assert (row.need_start, row.off, row.length, row.take, row.base_after) == (0, 24, 8, 2, 0)
    row = port.plan_xs_advance([0], [0], 17, 2, 1, 1, 16).reference_rows()[0]
    assert (row.g_done, row.take, row.need_start, row.base_after) == (0, 2, 0, 0)


@pytest.mark.rule("plan_xs_advance, port")
def test_the_plan_refuses_malformed_input_with_its_message():
    """Negative lengths name the vector; the counts must match; every size in range (zeros
    allowed where the docstring says `>= 0`, ratio and span from 1)."""
    with pytest.raises(ValueError, match=r"^tokens must be a 1-D vector"):
        port.plan_xs_advance(np.array([[1]]), [0], 24, 2, 4, 2, 16)
    with pytest.raises(ValueError, match=r"^base must be a 1-D vector"):
        port.plan_xs_advance([1], np.array([[0]]), 24, 2, 4, 2, 16)
    with pytest.raises(ValueError) as info:
        port.plan_xs_advance([1, 2], [0], 24, 2, 4, 2, 16)
    assert str(info.value) == "2 token counts but 1 bases"
    assert port.plan_xs_advance([0], [0], 0, 0, 1, 1, 0).tokens_after.tolist() == [0]
    for window, t_new, ratio, span, margin in ((-1, 0, 4, 2, 16), (24, -1, 4, 2, 16),
                                               (24, 0, 0, 2, 16), (24, 0, 4, 0, 16),
                                               (24, 0, 4, 2, -1)):
        with pytest.raises(ValueError) as info:
            port.plan_xs_advance([0], [0], window, t_new, ratio, span, margin)
        assert str(info.value) == (f"window {window}, t_new {t_new}, ratio {ratio}, span "
                                   f"{span}, margin {margin} out of range")


# --- conversions ---------------------------------------------------------------------------


def _fed_reference(ratio=4, span=3, window=30, max_seq_len=900, batch=2, margin=5, n=14):
    r = ref.XsRolling(ratio, span, window, max_seq_len, batch, None, margin)
    r.append_rows(np.arange(batch * n * 3, dtype=np.float64).reshape(batch, n, 3))
    return r


@pytest.mark.rule("XsRolling slot construction, conversion and helpers, port")
def test_from_and_to_reference_keep_every_field():
    """Both conversions keep ratio, span, window, max_seq_len, batch, dim and margin; lengths
    are int64 (an empty batch too); floats in the asked dtype one way, float64 the other."""
    r = _fed_reference()
    p = port.XsRolling.from_reference(r, dtype=torch.float32)
    fields = ("ratio", "span", "window", "max_seq_len", "batch", "dim", "margin")
    assert [getattr(p, f) for f in fields] == [4, 3, 30, 900, 2, 3, 5]
    assert p.ring.dtype == p.comp.dtype == torch.float32
    assert p.tokens.dtype == p.base.dtype == torch.int64
    back = p.to_reference()
    assert [getattr(back, f) for f in fields] == [getattr(r, f) for f in fields]
    assert back.tail.dtype == back.comp.dtype == np.float64
    assert np.array_equal(back.tail, r.tail) and (back.tokens, back.base) == (r.tokens, r.base)
    empty = port.XsRolling.from_reference(ref.XsRolling(4, batch=0))
    assert empty.tokens.dtype == empty.base.dtype == torch.int64 and empty.batch == 0
    assert port._device_and_host([], "cpu")[1].dtype == np.int64
    assert port._device_and_host(5, "cpu")[1].tolist() == [5]


@pytest.mark.rule("XsRolling slot construction, conversion and helpers, port")
def test_from_reference_and_clone_keep_the_asked_device():
    """A converted slot's lengths are on the asked device, and a clone is on its source's."""
    p = port.XsRolling.from_reference(ref.XsRolling(4, batch=2), device=META)
    assert p.device == META and p.tokens.device == p.base.device == META
    assert port.XsRolling(4, batch=2, device=META).clone().device == META


# --- rows of an unmaterialized slot, helpers -----------------------------------------------


@pytest.mark.rule("XsRolling slot construction, conversion and helpers, port")
def test_an_unmaterialized_slot_has_empty_float64_rows():
    """Before the first append: row i's history is `tokens_i - base_i` rows of width
    `dim` (0 when unknown), its comp `tokens_i // ratio` rows; float64 zeros."""
    p = port.XsRolling(4, batch=1, dim=3)
    p.tokens, p.base = [9], [4]
    h, c = p.row_history(0), p.row_comp(0)
    assert tuple(h.shape) == (5, 3) and tuple(c.shape) == (2, 3)
    assert h.dtype == c.dtype == torch.float64 and not h.any() and not c.any()
    q = port.XsRolling(4, batch=1)
    q.tokens = [2]
    assert tuple(q.row_history(0).shape) == (2, 0) and tuple(q.row_comp(0).shape) == (0, 0)


@pytest.mark.rule("XsRolling slot construction, conversion and helpers, port")
def test_resumable_from():
    """`max(0, length // ratio + 1 - span) * ratio` elementwise, int64; negative refused."""
    got = port.resumable_from([0, 3, 8, 9, 20], 4, 2)
    assert got.dtype == torch.int64 and got.tolist() == [0, 0, 4, 4, 16]
    assert port.resumable_from(7, 1, 3).tolist() == 5
    assert port.resumable_from([], 4, 2).dtype == torch.int64
    with pytest.raises(ValueError) as info:
        port.resumable_from([3, -1], 4, 2)
    assert str(info.value) == "length [3, -1] must be >= 0"


@pytest.mark.rule("XsRolling append and compressor, port")
def test_compress_blocks_checks_and_precision():
    """`[..., T, D]` (2-D included) and a ratio >= 1, else malformed; a half dtype averages
    in float32 and comes back in its own dtype."""
    assert port.compress_blocks(torch.arange(8.0).reshape(4, 2), 2).tolist() == [[1, 2], [5, 6]]
    with pytest.raises(ValueError) as info:
        port.compress_blocks([[1.0]], 1)
    assert str(info.value) == "compress_blocks needs [..., T, D], got None"
    with pytest.raises(ValueError) as info:
        port.compress_blocks(torch.zeros(3), 1)
    assert str(info.value) == f"compress_blocks needs [..., T, D], got {torch.zeros(3).shape}"
    with pytest.raises(ValueError) as info:
        port.compress_blocks(torch.zeros(2, 2), 0)
    assert str(info.value) == "compress ratio 0 must be >= 1"
    assert port._compute_dtype(torch.bfloat16) == port._compute_dtype(torch.float16)
    assert port._compute_dtype(torch.float16) == torch.float32
    assert port._compute_dtype(torch.float64) == torch.float64
    x = torch.tensor([[1.0], [2.0 ** -8], [2.0 ** -8], [2.0 ** -8]], dtype=torch.bfloat16)
    assert port.compress_blocks(x, 4).dtype == torch.bfloat16


@pytest.mark.rule("XsRolling slot construction, conversion and helpers, port")
def test_the_slot_helpers():
    """`supports_per_sequence_len` is the xs flag; `reset` empties every row (batch kept);
    `clone` is an independent copy with every field, on the same device, host lengths kept
    host-side and device-only lengths device-only; `repr` names sizes and lengths."""
    p = port.XsRolling(4, batch=1)
    assert p.supports_per_sequence_len() is False and p.supports_per_sequence_len(True) is True
    assert p.supports_per_sequence_len(1) is True
    r = _fed_reference()
    p = port.XsRolling.from_reference(r)  # lengths on the device only
    assert repr(p) == "XsRolling(ratio=4, span=3, window=30, tokens=[14, 14], base=[0, 0])"
    c = p.clone()
    fields = ("ratio", "span", "window", "max_seq_len", "batch", "dim", "margin", "device")
    assert [getattr(c, f) for f in fields] == [getattr(p, f) for f in fields]
    assert c._tokens_h is None and c._base_h is None
    assert c.tokens.tolist() == [14, 14] and c.base.tolist() == [0, 0]
    assert torch.equal(c.ring, p.ring) and torch.equal(c.comp, p.comp)
    c.ring.zero_()
    c.comp.zero_()
    assert p.ring.any() and p.comp.any()
    c.set_len(12)
    assert p.tokens.tolist() == [14, 14]
    h = port.XsRolling(4, batch=2)
    h.tokens, h.base = np.array([5, 6]), np.array([1, 2])
    hc = h.clone()
    assert hc._tokens_h.tolist() == [5, 6] and hc._base_h.tolist() == [1, 2]
    assert hc.ring is None and hc.comp is None
    h.tokens[0] = 0
    assert hc.tokens.tolist() == [5, 6]
    p.reset()
    assert (p.tokens.tolist(), p.base.tolist(), p.ring, p.comp) == ([0, 0], [0, 0], None, None)
    assert p.host_tokens().dtype == p.host_base().dtype == np.int64


@pytest.mark.rule("XsRolling length setters, port")
def test_the_length_setters_refuse_malformed_input_with_their_messages():
    """A row-length vector of the wrong size or with a negative entry, and a negative
    uniform length, are malformed (ValueError)."""
    p = port.XsRolling.from_reference(_fed_reference())
    with pytest.raises(ValueError) as info:
        p.set_row_lens([3])
    assert str(info.value) == "1 row lengths for a batch of 2"
    with pytest.raises(ValueError) as info:
        p.set_row_lens([3, -1])
    assert str(info.value) == "row lengths [3, -1] must be >= 0"
    with pytest.raises(ValueError) as info:
        p.try_set_len(-1)
    assert str(info.value) == "set_len length -1 must be >= 0"


@pytest.mark.rule("XsRolling slot construction, conversion and helpers, port")
def test_the_constructor_defaults_and_range_checks():
    """The reference's defaults (max_seq_len 4096, `span_groups_for(ratio)`, `W = span *
    ratio + margin`, the cpu) unless given; span and window from 1, max_seq_len and batch
    from 0, else malformed with the sizes named."""
    p = port.XsRolling(4)
    assert (p.max_seq_len, p.span, p.window, p.device) == (
        4096, ref.span_groups_for(4), ref.span_groups_for(4) * 4 + 16, torch.device("cpu"))
    q = port.XsRolling(4, span_groups=3, window=40, dim=5, device=META)
    assert (q.span, q.window, q.dim, q.device) == (3, 40, 5, META)
    assert (port.XsRolling(4, 1, 1, 0, 0).window, port.XsRolling(4, 1, 1, 0, 0).batch) == (1, 0)
    for span, window, max_seq_len, batch in ((0, 8, 10, 1), (1, 0, 10, 1), (1, 8, -1, 1),
                                             (1, 8, 10, -1)):
        with pytest.raises(ValueError) as info:
            port.XsRolling(4, span, window, max_seq_len, batch)
        assert str(info.value) == (f"span {span}, window {window}, max_seq_len {max_seq_len}, "
                                   f"batch {batch} out of range")


@pytest.mark.rule("XsRolling slot construction, conversion and helpers, port")
def test_host_lengths_read_from_the_device_are_int64_vectors():
    """`host_tokens` / `host_base` of lengths held on the device only: 1-D int64 (an empty
    batch too)."""
    for batch in (0, 2):
        p = port.XsRolling.from_reference(ref.XsRolling(4, batch=batch))
        assert p._tokens_h is None and p._base_h is None
        for h in (p.host_tokens(), p.host_base()):
            assert h.dtype == np.int64 and h.shape == (batch,)


@pytest.mark.rule("XsRolling append and compressor, port")
def test_append_rows_refuses_malformed_input_with_its_message():
    """`x_new` must be a `[B, t_new, D]` tensor of the slot's batch and (once set) width."""
    p = port.XsRolling(4, batch=1)
    for bad, shape in ((np.zeros((1, 2, 3)), (1, 2, 3)), ([1.0], ()),
                       (torch.zeros(1, 3), (1, 3)), (torch.zeros(2, 2, 3), (2, 2, 3))):
        with pytest.raises(ValueError) as info:
            p.append_rows(bad)
        assert str(info.value) == f"append_rows needs [B=1, t_new, D], got {shape}"
    p.append_rows(torch.zeros(1, 2, 3, dtype=torch.float64))
    with pytest.raises(ValueError) as info:
        p.append_rows(torch.zeros(1, 2, 4, dtype=torch.float64))
    assert str(info.value) == "hidden width 4 differs from the slot's 3"


@pytest.mark.rule("XsRolling append and compressor, port")
def test_the_first_append_sets_the_width_and_later_appends_take_the_slots_dtype():
    """The first append fixes D, the buffers' dtype and an empty comp (no block yet: G = 0,
    as the reference's buffer); a later append in another float dtype is converted to the
    slot's; an empty batch appends nothing."""
    p, r = port.XsRolling(4), ref.XsRolling(4)
    p.append_rows(torch.ones(1, 2, 3, dtype=torch.float64))
    r.append_rows(np.ones((1, 2, 3)))
    assert p.dim == 3 and p.ring.dtype == p.comp.dtype == torch.float64
    assert tuple(p.comp.shape) == r.comp.shape == (1, 0, 3)
    p.append_rows(torch.full((1, 3, 3), 2.0, dtype=torch.float32))
    assert p.ring.dtype == torch.float64 and p.tokens.tolist() == [5]
    assert p.row_comp(0).tolist() == [[1.5, 1.5, 1.5]]  # (1 + 1 + 2 + 2) / 4
    e = port.XsRolling(4, batch=0)
    e.append_rows(torch.zeros(0, 5, 3))
    assert e.batch == 0 and tuple(e.ring.shape) == (0, e.window, 3) and e.current_seq_len == 0
