"""Port conformance: masks (gpu.masks vs reference.masks). Masks hold only 0 and -inf,
exact in every float dtype, so every comparison is bit-exact, in float64, float32 and
bfloat16 alike. Refusals: same class and message."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import raggedspec.gpu.masks as port
import raggedspec.reference.masks as ref
from raggedspec.conformance.strategies import corner_lengths, lead_pads
from raggedspec.gpu.testing import (
    DEVICE,
    FLOAT_DTYPES,
    assert_bit_exact,
    assert_same_refusal,
    outcome,
    to_port,
)

dtypes = pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=lambda d: str(d).split(".")[-1])


def vec(xs):
    return torch.tensor(list(xs), dtype=torch.int64, device=DEVICE)


@pytest.mark.rule("dsv4 raw / compressed validity, port")
@given(
    t_q=st.integers(0, 9),
    q0=st.integers(0, 60),
    base=st.integers(0, 60),
    keep=st.integers(0, 20),
    window=st.integers(1, 20),
    t_c=st.integers(0, 12),
    ratio=st.sampled_from([1, 2, 4, 8, 128]),
)
def test_validity_matches_the_reference(t_q, q0, base, keep, window, t_c, ratio):
    assert_bit_exact(port.raw_validity(t_q, q0, base, keep, window, device=DEVICE),
                     ref.raw_validity(t_q, q0, base, keep, window), "raw_validity")
    assert_bit_exact(port.compressed_validity(t_q, q0, t_c, ratio, device=DEVICE),
                     ref.compressed_validity(t_q, q0, t_c, ratio), "compressed_validity")


@pytest.mark.rule("dsv4 raw / compressed validity, port")
@given(
    rows=corner_lengths(1, 6, 60, boundaries=False),
    t_q=st.integers(1, 6),
    t_c=st.integers(0, 10),
    ratio=st.sampled_from([1, 4, 8]),
)
def test_vector_validity_is_the_per_row_reference_stacked(rows, t_q, t_c, ratio):
    """The vectorized forms (one `[B]` vector of query positions) equal the reference's
    scalar rule evaluated row by row."""
    got = port.compressed_validity(t_q, vec(rows), t_c, ratio)
    assert_bit_exact(got, np.stack([ref.compressed_validity(t_q, r, t_c, ratio) for r in rows]))
    got_raw = port.raw_validity(t_q, vec(rows), vec([max(r - 3, 0) for r in rows]), 7, 4)
    assert_bit_exact(
        got_raw, np.stack([ref.raw_validity(t_q, r, max(r - 3, 0), 7, 4) for r in rows])
    )


@pytest.mark.rule("ragged_union_mask, port")
@dtypes
@given(leads=lead_pads(1, 6, 20), extra=st.integers(0, 40), t_q=st.integers(1, 5),
       window=st.integers(1, 30), ratio=st.sampled_from([0, 4, 8, 128]), data=st.data())
def test_ragged_union_mask_matches_the_reference(dtype, leads, extra, t_q, window, ratio, data):
    q0 = max(leads) + extra
    rows = [q0 - lead for lead in leads]
    t_k_full = q0 + t_q
    raw_base, keep = ref.raw_keep_span(t_q, window, t_k_full)
    t_c = data.draw(st.integers(0, t_k_full // ratio + 2)) if ratio > 1 else 0
    valid = np.concatenate([ref.raw_validity(t_q, q0, raw_base, keep, window),
                            ref.compressed_validity(t_q, q0, t_c, max(ratio, 1))], axis=1)
    got = port.ragged_union_mask(
        vec(rows), q0, to_port(valid), raw_base, keep, max(ratio, 1), t_c, dtype
    )
    assert got.dtype == dtype
    assert_bit_exact(
        got, ref.ragged_union_mask(rows, q0, valid, raw_base, keep, max(ratio, 1), t_c)
    )


@pytest.mark.rule("ragged_union_mask, port")
def test_ragged_union_mask_kills_the_dead_prefix_in_the_worked_example():
    """Rows 6, 4, 2 at q0 = 6 (leads 0, 2, 4), t_q 1, window 8: row i keeps columns
    `[lead_i, 6]` only (independent oracle: the spec's left-aligned picture)."""
    valid = np.ones((1, 7), dtype=bool)
    got = port.ragged_union_mask(vec([6, 4, 2]), 6, to_port(valid), 0, 7, 1, 0)
    keep = (got[:, 0, 0] == 0).cpu().numpy().astype(int)
    assert keep.tolist() == [[1] * 7, [0, 0] + [1] * 5, [0] * 4 + [1] * 3]


@pytest.mark.rule("compose_caller_mask, port")
@dtypes
@given(data=st.data())
def test_compose_caller_mask_matches_the_reference_including_refusals(dtype, data):
    t_q = data.draw(st.integers(1, 4))
    t_k_full = data.draw(st.integers(t_q, 20))
    t_c = data.draw(st.integers(0, 4))
    raw_base = data.draw(st.integers(0, t_k_full - 1))
    t_k = t_k_full - raw_base
    b = data.draw(st.integers(1, 3))
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    local = np.where(rng.random((b, 1, t_q, t_k + t_c)) < 0.7, 0.0, -np.inf)
    rank = data.draw(st.sampled_from([None, 1, 2, 3, 4, "placeholder"]))
    width = data.draw(st.sampled_from([t_k_full, t_k_full + t_c, t_k_full + t_c + 1]))
    q_axis = data.draw(st.sampled_from([t_q, 1, t_q + 1]))
    if rank is None:
        caller = None
    elif rank == "placeholder":
        caller = np.zeros((1, 1))
    else:
        shape = {1: (width,), 2: (q_axis, width), 3: (1, q_axis, width), 4: (b, 1, q_axis, width)}[
            rank
        ]
        caller = np.where(rng.random(shape) < 0.8, 0.0, -np.inf)
    p = outcome(
        port.compose_caller_mask,
        to_port(local, dtype),
        None if caller is None else to_port(caller, dtype),
        t_q,
        t_k_full,
        raw_base,
        t_k,
        t_c,
    )
    r = outcome(ref.compose_caller_mask, local, caller, t_q, t_k_full, raw_base, t_k, t_c)
    if assert_same_refusal(p, r, "compose_caller_mask"):
        assert p[1].dtype == dtype
        assert_bit_exact(p[1], r[1])



# Refusal texts, boundaries, result dtypes and devices. Each refusal breaks exactly one
# condition and names the values given; the expected text is stated from the inputs.


def refuses(exc, text, fn, *args, **kwargs):
    with pytest.raises(exc) as info:
        fn(*args, **kwargs)
    assert str(info.value) == text



@pytest.mark.rule("dsv4 raw / compressed validity, port")
def test_validity_refusals_name_the_values():
    msg = "t_q {}, keep {} must be >= 0 and window {} >= 1"
    refuses(ValueError, msg.format(-1, 1, 1), port.raw_validity, -1, 0, 0, 1, 1)
    refuses(ValueError, msg.format(1, -1, 1), port.raw_validity, 1, 0, 0, -1, 1)
    refuses(ValueError, msg.format(1, 1, 0), port.raw_validity, 1, 0, 0, 1, 0)
    for q0, base in ((-1, 0), (0, -1), (vec([2, -1]), vec([0, 0]))):
        refuses(ValueError, "q0 and raw_base must be >= 0", port.raw_validity, 1, q0, base, 1, 1)
    msg = "t_q {}, q0 {}, t_c {} must be >= 0"
    refuses(ValueError, msg.format(-1, [0], 2), port.compressed_validity, -1, 0, 2, 1)
    refuses(ValueError, msg.format(1, [0], -1), port.compressed_validity, 1, 0, -1, 1)
    refuses(ValueError, msg.format(1, [3, -1], 2), port.compressed_validity, 1, [3, -1], 2, 1)
    refuses(ValueError, msg.format(1, [3, -1], 2), port.compressed_validity, 1, vec([3, -1]), 2, 1)
    refuses(ValueError, "compress ratio 0 must be >= 1 when there are 2 compressed keys",
            port.compressed_validity, 1, 0, 2, 0)
    assert port.compressed_validity(1, 0, 0, 0).shape == (1, 0)  # no compressed key: no ratio


@pytest.mark.rule("dsv4 raw / compressed validity, port")
def test_validity_is_built_on_the_requested_device():
    """The `device` argument is honoured (the meta device runs on any machine): q0 and
    raw_base are checked where they are, the result is built on `device`."""
    for q0, base in ((3, 1), (vec([3, 5]), vec([1, 2])), ([3, 5], [1, 2])):
        got = port.raw_validity(2, q0, base, 3, 2, device="meta")
        assert (got.device.type, got.dtype) == ("meta", torch.bool)
    for q0, t_c in ((3, 2), (vec([3, 5]), 2), (3, 0)):
        got = port.compressed_validity(2, q0, t_c, 2, device="meta")
        assert (got.device.type, got.dtype) == ("meta", torch.bool)


@pytest.mark.rule("ragged_union_mask, port")
def test_ragged_union_mask_refusals_name_the_values():
    ok = to_port(np.ones((1, 7), dtype=bool))
    refuses(ValueError, "valid shape [1, 4, 2] must be [t_q, t_k + t_c = 4]",
            port.ragged_union_mask, vec([6]), 6, to_port(np.ones((1, 4, 2), dtype=bool)),
            0, 3, 1, 1)
    refuses(ValueError, "valid shape [1, 7] must be [t_q, t_k + t_c = 6]",
            port.ragged_union_mask, vec([6]), 6, ok, 0, 4, 1, 2)
    refuses(ValueError, "rows must be a 1-D vector, got shape [1, 2]",
            port.ragged_union_mask, torch.tensor([[6, 4]]), 6, ok, 0, 7, 1, 0)
    refuses(ValueError, "ragged_union_mask needs at least one row",
            port.ragged_union_mask, vec([]), 6, ok, 0, 7, 1, 0)
    for rows in ([7, 6], [6, -1], [5, 4]):
        refuses(ValueError,
                f"rows {rows} must lie in [0, q0=6] with max == q0 (resolve_ragged_rows first)",
                port.ragged_union_mask, vec(rows), 6, ok, 0, 7, 1, 0)
    msg = "raw_base {}, t_k {}, t_c {} must be >= 0"
    refuses(ValueError, msg.format(-1, 7, 0), port.ragged_union_mask, vec([6]), 6, ok, -1, 7, 1, 0)
    refuses(ValueError, msg.format(0, 8, -1), port.ragged_union_mask, vec([6]), 6, ok, 0, 8, 1, -1)
    refuses(ValueError, msg.format(0, -1, 8), port.ragged_union_mask, vec([6]), 6, ok, 0, -1, 1, 8)
    # t_k == 0 is well formed: only compressed keys (q0 0, ratio 1: block 0 valid, block 1 not)
    got = port.ragged_union_mask(vec([0]), 0, to_port(np.ones((1, 2), dtype=bool)), 0, 0, 1, 2)
    assert got.tolist() == [[[[0.0, float("-inf")]]]]


@pytest.mark.rule("compose_caller_mask, port")
def test_compose_caller_mask_refuses_a_raw_slice_past_the_key_axis():
    local = to_port(np.zeros((1, 1, 1, 3)))
    refuses(ValueError, "raw slice [2, 5) exceeds key axis 4",
            port.compose_caller_mask, local, to_port(np.zeros((1, 4))), 1, 4, 2, 3, 0)



