"""Port conformance: the dispatch predicates the port's tensor code calls (gpu.dispatch vs
reference.dispatch). Integers and refusals: bit-exact, same class, same message. The
"uniform batch never takes the ragged path" property is tested on the port's predicates
directly (both paths would agree numerically, so only the predicate can tell)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import raggedspec.gpu.dispatch as port
import raggedspec.reference.dispatch as ref
from raggedspec.conformance.strategies import corner_lengths, lead_pads, uniform_lengths
from raggedspec.gpu._common import as_list
from raggedspec.gpu.testing import DEVICE, assert_same_refusal, outcome


def vec(xs):
    return torch.tensor(list(xs), dtype=torch.int64, device=DEVICE)


def same_optional(port_value, ref_value):
    """None vs None, else the port's int64 vector equals the reference list."""
    if ref_value is None:
        assert port_value is None, f"port {port_value} where the reference took the scalar path"
    else:
        assert port_value is not None and port_value.dtype == torch.int64
        assert as_list(port_value) == ref_value


@st.composite
def row_positions(draw):
    """`(rows, q0, b)` for resolve_ragged_rows: valid ragged rows, uniform rows, and each
    refusal (wrong length, a row ahead, nobody at q0)."""
    leads = draw(lead_pads(1, 6, 12))
    q0 = draw(st.integers(max(leads), 60))
    rows = [q0 - lead for lead in leads]
    b = len(rows)
    kind = draw(
        st.sampled_from(
            ["valid", "none", "wrong_len", "ahead", "nobody_at_q0", "uniform_wrong_len"]
        )
    )
    if kind == "none":
        rows = None
    elif kind == "wrong_len":
        b = b + draw(st.integers(1, 2))
    elif kind == "ahead":
        rows[draw(st.integers(0, len(rows) - 1))] = q0 + draw(st.integers(1, 5))
    elif kind == "nobody_at_q0" and q0 > 0:
        rows = [min(r, q0 - 1) for r in rows]
    elif kind == "uniform_wrong_len":
        rows, b = [q0] * len(rows), len(rows) + 1
    return rows, q0, b


@pytest.mark.rule("resolve_ragged_rows, port")
@given(case=row_positions())
def test_resolve_ragged_rows_matches_the_reference(case):
    rows, q0, b = case
    p = outcome(port.resolve_ragged_rows, None if rows is None else vec(rows), q0, b)
    r = outcome(ref.resolve_ragged_rows, rows, q0, b)
    if assert_same_refusal(p, r, "resolve_ragged_rows"):
        same_optional(p[1], r[1])


@pytest.mark.rule("uniform_seqlen_offset on the RoPE path, port")
@given(offsets=st.one_of(uniform_lengths(0, 6, 0, 40), corner_lengths(1, 6, 40, boundaries=False)))
def test_uniform_seqlen_offset_matches_the_reference(offsets):
    assert port.uniform_seqlen_offset(vec(offsets)) == ref.uniform_seqlen_offset(offsets)


@pytest.mark.rule("resolve_ragged_rows, port")
@given(lens=uniform_lengths(0, 8, 0, 600))
def test_a_uniform_batch_never_takes_the_ragged_path_on_the_port(lens):
    """Every port predicate returns the scalar form (None / the one offset) for a uniform
    vector, however long: a mutant returning the equal-valued vector would pass every
    numeric comparison and fail here."""
    v = vec(lens)
    q0 = lens[0] if lens else 0
    assert port.resolve_ragged_rows(v, q0, len(lens)) is None
    assert port.uniform_seqlen_offset(v) == (lens[0] if lens else None)


@pytest.mark.rule("resolve_ragged_rows, port")
def test_negative_positions_are_malformed_for_port_and_reference():
    """Negative row positions are malformed input (ValueError) on both sides."""
    for port_fn, ref_fn, args in [
        (port.resolve_ragged_rows, ref.resolve_ragged_rows, ([-1, 5], 5, 2)),
    ]:
        for fn in (port_fn, ref_fn):
            with pytest.raises(ValueError, match="must be >= 0"):
                fn(*args)
