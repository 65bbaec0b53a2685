"""XsRolling (masks-and-scheduling.md §13): what only one implementation's layout has, and the
port compared with the reference where a value is computed. The reference keeps an
end-anchored tail with zeros behind base and in front of a rollback, clones deeply, resets,
reports its capability and describes itself; the port keeps a ring buffer on its device,
the lengths also on the host, converts appends to the slot's dtype and refuses what is not a
tensor of its batch. Compared with the reference: refusals (class and message) and state on
random ragged states, and the low-precision history (bit for bit) and means (within the
FlashAttention rule's bound). The rules both implementations share are test_xs_rolling.py's."""

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from raggedspec.conformance.helpers import XS_IMPLS, assert_same_xs, xs_fed, xs_filled
from raggedspec.gpu import xs_rolling as port_xs
from raggedspec.gpu.slots import stack_xs
from raggedspec.gpu.testing import DEVICE, assert_bit_exact, assert_dtype_bound
from raggedspec.gpu.testing import assert_same_refusal, host, outcome, representable, to_port
from raggedspec.gpu.xs_rolling import XsRolling as PortXs
from raggedspec.reference.xs_rolling import XS_TAIL_MARGIN_TOKENS, XsRolling

D = 3
RATIOS = [2, 3, 4, 8, 128]
REF = XS_IMPLS[0]


# --- the port compared with the reference ------------------------------------------------------

@pytest.mark.slow
@pytest.mark.rule("XsRolling append and compressor, port", "XsRolling length setters, port",
                  "XsRolling rollback refusal, one rule for both layouts")
@given(data=st.data())
def test_the_ports_refusals_on_random_states_are_the_references(data):
    """Ragged batches of 1..4 rows built by the same appends on both, then 1..6 rounds of an
    append of 0..12 rows and a per-row rollback, sometimes past what the history allows
    (past the tokens seen, behind base, resume point behind base), and uniform `set_len`
    attempts on ragged rows ("non-uniform"): refused by both or neither, same class and
    message, the same state after every call."""
    ratio = data.draw(st.sampled_from(RATIOS))
    b = data.draw(st.integers(1, 4))
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    solos = []
    for n in data.draw(st.lists(st.integers(0, 300), min_size=b, max_size=b)):
        pair = [XsRolling(ratio), PortXs(ratio, device=DEVICE)]
        h, cut = rng.standard_normal((n, 2)), data.draw(st.integers(0, n))
        for part in (h[:cut], h[cut:]):
            pair[0].append_rows(part[None])
            pair[1].append_rows(to_port(part[None]))
        solos.append(pair)
    r, p = XsRolling.stack([s for s, _ in solos]), stack_xs([s for _, s in solos])

    def both(op, *args):
        got = outcome(getattr(p, op), *[to_port(a) if isinstance(a, np.ndarray) else a
                                         for a in args])
        assert_same_refusal(got, outcome(getattr(r, op), *args), op)
        assert_same_xs(p, r, op)

    for _ in range(data.draw(st.integers(1, 6))):
        both("append_rows", rng.standard_normal((b, data.draw(st.integers(0, 12)), 2)))
        lens = [max(0, t - data.draw(st.integers(0, XS_TAIL_MARGIN_TOKENS + 2 * ratio)))
                for t in r.tokens]
        if data.draw(st.integers(0, 5)) == 0:
            i = data.draw(st.integers(0, b - 1))
            lens[i] = r.tokens[i] + 1
        both("set_row_lens", lens)
        if data.draw(st.booleans()):
            both("set_len", max(0, r.current_seq_len - data.draw(st.integers(0, 20))))


@pytest.mark.rule("XsRolling append and compressor, port")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@given(ratio=st.sampled_from(RATIOS), sizes=st.lists(st.integers(0, 40), min_size=1, max_size=6),
       seed=st.integers(0, 2**32 - 1))
def test_low_precision_history_is_bit_exact_and_comp_within_the_naive_bound(dtype, ratio, sizes,
                                                                             seed):
    """Feeds of dtype-representable rows: the history (moved) equals the float64 reference
    bit for bit; each compressed row is within 2x the naive same-dtype mean's error
    (sequential sum over the block in dtype, then / ratio) + 4 eps * max|x|."""
    rng = np.random.default_rng(seed)
    r, p = XsRolling(ratio), PortXs(ratio, device=DEVICE)
    fed_rows = np.zeros((0, D))
    for n in sizes:
        x = representable(rng.standard_normal((1, n, D)), dtype)
        r.append_rows(x)
        p.append_rows(to_port(x, dtype))
        fed_rows = np.concatenate([fed_rows, x[0]])
    assert p.ring.dtype == p.comp.dtype == dtype and host(p.tokens).tolist() == r.tokens
    assert_bit_exact(p.row_history(0), r.row_history(0), "history")
    g = r.tokens[0] // ratio
    naive = torch.zeros((g, D), dtype=dtype)
    rows = to_port(fed_rows, dtype).cpu()
    for j in range(g):
        acc = rows[j * ratio]
        for k in range(1, ratio):
            acc = acc + rows[j * ratio + k]
        naive[j] = acc / ratio
    scale = float(np.abs(fed_rows).max()) if fed_rows.size else 1.0
    assert_dtype_bound(p.row_comp(0), naive, r.row_comp(0), dtype, scale, "comp")


# --- the port alone: device, host lengths, dtypes, input checks ------------------------------

META = torch.device("meta")


@pytest.mark.rule("XsRolling slot construction and read-back, port")
def test_the_port_slot_lives_on_its_device_and_keeps_host_lengths():
    """The device defaults to the cpu; lengths set as host integers stay on the host too,
    lengths computed on the device are read back once as 1-D int64 vectors (an empty batch
    too); a half dtype averages in float32."""
    assert PortXs(4).device == torch.device("cpu")
    q = PortXs(4, batch=2, device=META)
    assert q.device == META and q.tokens.device == q.base.device == META
    for batch in (0, 2):
        p = PortXs(4, batch=batch)
        p.tokens, p.base = torch.zeros(batch, dtype=torch.int64), torch.zeros(batch,
                                                                               dtype=torch.int64)
        assert p._tokens_h is None and p._base_h is None
        for h in (p.host_tokens(), p.host_base()):
            assert h.dtype == np.int64 and h.shape == (batch,)
        assert p.tokens.dtype == p.base.dtype == torch.int64
    assert port_xs._device_and_host([], "cpu")[1].dtype == np.int64
    assert port_xs._device_and_host(5, "cpu")[1].tolist() == [5]
    assert port_xs._compute_dtype(torch.bfloat16) == port_xs._compute_dtype(torch.float16)
    assert port_xs._compute_dtype(torch.float16) == torch.float32
    assert port_xs._compute_dtype(torch.float64) == torch.float64


@pytest.mark.rule("XsRolling append and compressor, port")
def test_the_port_refuses_an_append_that_is_not_a_tensor_of_its_batch():
    p = PortXs(4, batch=1)
    for bad, shape in ((np.zeros((1, 2, 3)), (1, 2, 3)), ([1.0], ()),
                       (torch.zeros(1, 3), (1, 3)), (torch.zeros(2, 2, 3), (2, 2, 3))):
        with pytest.raises(ValueError) as info:
            p.append_rows(bad)
        assert str(info.value) == f"append_rows needs [B=1, t_new, D], got {shape}"


@pytest.mark.rule("XsRolling append and compressor, port")
def test_the_ports_first_append_sets_the_width_and_later_appends_take_the_slots_dtype():
    """The first append fixes D, the buffers' dtype and an empty comp (no block yet: G = 0);
    a later append in another float dtype is converted to the slot's; a slot of no rows
    allocates a ring `[0, W, D]` and no compressed column."""
    p = PortXs(4)
    p.append_rows(torch.ones(1, 2, 3, dtype=torch.float64))
    assert p.dim == 3 and p.ring.dtype == p.comp.dtype == torch.float64
    assert tuple(p.comp.shape) == (1, 0, 3)
    p.append_rows(torch.full((1, 3, 3), 2.0, dtype=torch.float32))
    assert p.ring.dtype == torch.float64 and p.tokens.tolist() == [5]
    assert p.row_comp(0).tolist() == [[1.5, 1.5, 1.5]]  # (1 + 1 + 2 + 2) / 4
    e = PortXs(4, max_seq_len=64, batch=0)
    e.append_rows(torch.zeros(0, 8, 3))
    assert tuple(e.ring.shape) == (0, e.window, 3) and tuple(e.comp.shape) == (0, 0, 3)


# --- the reference alone: its tail, clone, reset, capability, description ----------------------

@pytest.mark.rule("XsRolling")
def test_the_reference_tail_holds_zeros_behind_base_and_in_front_of_a_rollback():
    # W 23, ratio 4, span 2, margin 16, 42 tokens: base = (26 // 4 - 1) * 4 = 20; the tail
    # holds tokens 19 .. 41, so exactly column 0 (token 19) lies behind base
    xs = xs_fed(REF, 42, window=23)
    assert xs.base == [20]
    assert not xs.tail[0, 0].any() and xs.tail[0, 1:].all()
    assert np.array_equal(xs.row_history(0)[:, 0], np.arange(21, 43))
    xs = xs_fed(REF, 12, window=32)
    xs.set_row_lens([10])
    assert not xs.tail[0, :22].any()  # 20 unused columns, then the 2 rolled back
    assert np.array_equal(xs.tail[0, 22:, 0], np.arange(1, 11))
    a, b = xs_filled(REF, 4, 61), xs_filled(REF, 4, 61)
    b.base = [28]
    out = XsRolling.stack([a, b], reconcile_bases=True)
    assert not out.tail[1, : out.window - 21].any()
    for row in out.split_rows():  # nothing kept behind base
        assert not row.tail[0, : row.window - (row.tokens[0] - row.base[0])].any()


@pytest.mark.rule("XsRolling")
def test_the_reference_slot_clones_deeply_resets_and_reports_its_capability():
    xs = XsRolling(4, 2, 64, 2048)
    assert not xs.supports_per_sequence_len(False) and xs.supports_per_sequence_len(True)
    assert XsRolling(4).supports_per_sequence_len() is False
    xs.append_rows(np.ones((1, 9, D)))
    cp = xs.clone()
    cp.append_rows(np.ones((1, 3, D)))
    cp.tail[0, -1] = 5
    assert xs.tokens == [9] and xs.tail[0, -1, 0] == 1
    xs = xs_fed(REF, 12, window=32)
    c = xs.clone()
    xs.set_row_lens([10])
    assert c.tokens == [12] and np.array_equal(c.row_history(0)[:, 0], np.arange(1, 13))
    xs = xs_filled(REF, 4, 30)
    xs.reset()
    assert (xs.tokens, xs.base, xs.tail, xs.comp, xs.current_seq_len) == ([0], [0], None, None, 0)
    batch = XsRolling.stack([xs_filled(REF, 4, n) for n in (13, 15, 16, 20, 61)])
    assert batch.current_seq_len == 61 and batch.comp_seq_len == 61 // 4
    batch.set_row_lens([13, 15, 16, 20, 50])
    assert batch.current_seq_len == 50 and batch.comp_seq_len == 12
    text = repr(XsRolling(4, max_seq_len=64, batch=2))
    assert text.startswith("XsRolling(ratio=4, span=")
    assert "tokens=[0, 0]" in text and "base=[0, 0]" in text  # one entry per row


@pytest.mark.rule("XsRolling")
def test_the_reference_split_keeps_every_setting_and_its_dtype():
    xs = XsRolling(4, span_groups=1, window=13, max_seq_len=100, batch=3, dim=D, margin=8)
    for row in xs.split_rows():  # no buffers yet
        assert (row.ratio, row.span, row.window, row.max_seq_len, row.margin, row.dim) == (
            4, 1, 13, 100, 8, D)
    xs.append_rows(np.ones((3, 9, D)))
    for row in xs.split_rows():
        assert (row.span, row.window, row.margin, row.dim, row.batch) == (1, 13, 8, D, 1)
        assert row.tail.shape == (1, 13, D) and row.comp.shape == (1, 2, D)
    a = XsRolling(4, window=32)
    a.append_rows(np.ones((1, 5, D), dtype=np.float32))
    a.append_rows(np.ones((1, 4, D), dtype=np.float32))  # grows comp from 1 to 2 blocks
    assert a.tail.dtype == np.float32 and a.comp.dtype == np.float32 and a.comp.shape[1] == 2
    out = XsRolling.stack([XsRolling(4, window=32), a])  # the first row has no buffers yet
    assert out.dim == D and out.tail.dtype == np.float32 and out.comp.dtype == np.float32
    assert out.tail.shape == (2, 32, D) and not out.tail[0].any() and not out.comp[0].any()
    with pytest.raises(ValueError, match=r"^append_rows needs \[B=1, t_new, D\], got None$"):
        a.append_rows([[[0.0]]])
