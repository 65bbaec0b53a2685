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
    if t_q == 0:  # malformed for both: no query row reaches any key
        for keep_span in (port.raw_keep_span, ref.raw_keep_span):
            with pytest.raises(ValueError, match="t_q 0 must be >= 1"):
                keep_span(t_q, window, q0)
    else:
        assert port.raw_keep_span(t_q, window, q0) == ref.raw_keep_span(t_q, window, q0)


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


def test_ragged_union_mask_kills_the_dead_prefix_in_the_worked_example():
    """Rows 6, 4, 2 at q0 = 6 (leads 0, 2, 4), t_q 1, window 8: row i keeps columns
    `[lead_i, 6]` only (independent oracle: the spec's left-aligned picture)."""
    valid = np.ones((1, 7), dtype=bool)
    got = port.ragged_union_mask(vec([6, 4, 2]), 6, to_port(valid), 0, 7, 1, 0)
    keep = (got[:, 0, 0] == 0).cpu().numpy().astype(int)
    assert keep.tolist() == [[1] * 7, [0, 0] + [1] * 5, [0] * 4 + [1] * 3]


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


@dtypes
@given(positions=st.lists(st.integers(0, 40), min_size=1, max_size=6), cap=st.integers(0, 32))
def test_graph_mode_length_mask_matches_the_reference(dtype, positions, cap):
    assert_bit_exact(port.graph_mode_length_mask(vec(positions), cap, dtype),
                     ref.graph_mode_length_mask(positions, cap))


@dtypes
@given(data=st.data())
def test_left_padded_causal_mask_matches_the_reference_including_refusals(dtype, data):
    b = data.draw(st.integers(0, 5))
    past = data.draw(st.integers(0, 30))
    t_q = data.draw(st.integers(0, 4))
    n = data.draw(st.sampled_from([b, b, b, b + 1, max(b - 1, 0)]))
    live = data.draw(st.lists(st.integers(0, past + 2), min_size=n, max_size=n))
    p = outcome(port.make_left_padded_causal_mask, b, t_q, past, vec(live), dtype)
    r = outcome(ref.make_left_padded_causal_mask, b, t_q, past, live)
    if assert_same_refusal(p, r, "make_left_padded_causal_mask"):
        assert_bit_exact(p[1], r[1])


@given(data=st.data())
def test_masker_entry_points_match_the_reference(data):
    b = data.draw(st.integers(1, 4))
    past = data.draw(st.integers(0, 20))
    t_q = data.draw(st.integers(1, 3))
    per_seq = data.draw(
        st.one_of(st.none(), st.lists(st.integers(0, past + 1), min_size=b, max_size=b))
    )
    lead = data.draw(
        st.one_of(st.none(), st.lists(st.integers(0, past + 1), min_size=1, max_size=b + 1))
    )
    flash = data.draw(st.booleans())
    window = data.draw(st.integers(1, 8))
    policy = data.draw(st.sampled_from(port.SLIDING_WINDOW_RAGGED_POLICIES))

    def as_vec(x):
        return None if x is None else vec(x)

    for pf, rf, extra in ((port.make_causal_mask_matrix, ref.make_causal_mask_matrix, ()),
                          (port.make_sliding_window_causal_mask_matrix,
                           ref.make_sliding_window_causal_mask_matrix, (window, policy))):
        p = outcome(
            pf,
            b,
            t_q,
            past,
            as_vec(per_seq),
            as_vec(lead),
            *extra,
            flash_on_cuda=flash,
            device=DEVICE,
        )
        r = outcome(rf, b, t_q, past, per_seq, lead, *extra, flash_on_cuda=flash)
        if assert_same_refusal(p, r, pf.__name__):
            if r[1] is None:
                assert p[1] is None, (
                    f"{pf.__name__}: port built a mask where the reference returned None"
                )
            else:
                assert_bit_exact(p[1], r[1], pf.__name__)


@given(ratio=st.integers(0, 200), w=st.integers(0, 200),
       dims=st.one_of(st.none(), st.lists(st.integers(1, 4), max_size=5)))
def test_mask_predicates_match_the_reference(ratio, w, dims):
    assert port.sdpa_sliding_window(ratio, w) == ref.sdpa_sliding_window(ratio, w)
    assert port.mask_must_be_applied_as_bias(dims) == ref.mask_must_be_applied_as_bias(dims)


def test_unset_graph_length_mask_is_refused_by_both():
    p, r = (
        outcome(port.require_graph_length_mask, None),
        outcome(ref.require_graph_length_mask, None),
    )
    assert p[0] == "refused"
    assert_same_refusal(p, r)
