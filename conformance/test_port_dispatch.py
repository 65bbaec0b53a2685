"""Port conformance: dispatch predicates and draft-group partition (gpu.dispatch vs
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


@given(case=row_positions())
def test_resolve_ragged_rows_matches_the_reference(case):
    rows, q0, b = case
    p = outcome(port.resolve_ragged_rows, None if rows is None else vec(rows), q0, b)
    r = outcome(ref.resolve_ragged_rows, rows, q0, b)
    if assert_same_refusal(p, r, "resolve_ragged_rows"):
        same_optional(p[1], r[1])


@given(offsets=st.one_of(uniform_lengths(0, 6, 0, 40), corner_lengths(1, 6, 40, boundaries=False)))
def test_uniform_seqlen_offset_matches_the_reference(offsets):
    assert port.uniform_seqlen_offset(vec(offsets)) == ref.uniform_seqlen_offset(offsets)


@given(
    enabled=st.booleans(),
    cache_len=st.integers(0, 40),
    leads=st.lists(st.integers(0, 45), max_size=6),
    force_zero=st.booleans(),
)
def test_resolve_row_cache_lens_matches_the_reference(enabled, cache_len, leads, force_zero):
    if force_zero and leads:
        leads[0] = 0
    p = outcome(port.resolve_row_cache_lens, enabled, cache_len, vec(leads))
    r = outcome(ref.resolve_row_cache_lens, enabled, cache_len, leads)
    if assert_same_refusal(p, r, "resolve_row_cache_lens"):
        same_optional(p[1], r[1])


def test_resolve_row_cache_lens_spec_examples_on_the_port():
    assert as_list(port.resolve_row_cache_lens(True, 40, vec([0, 7, 0, 3]))) == [40, 33, 40, 37]
    for enabled, leads in ((True, [0, 0, 0, 0]), (True, []), (False, [0, 7, 0, 3])):
        assert port.resolve_row_cache_lens(enabled, 40, vec(leads)) is None
    for leads in ([0, 12], [2, 3]):
        with pytest.raises(ref.DispatchRefusal):
            port.resolve_row_cache_lens(True, 10, vec(leads))


@given(starts=st.one_of(uniform_lengths(0, 6, 2, 60), corner_lengths(1, 6, 60, boundaries=False)),
       enabled=st.booleans())
def test_chain_start_and_draft_lead_resolvers_match_the_reference(starts, enabled):
    same_optional(
        port.resolve_ragged_chain_starts(vec(starts)), ref.resolve_ragged_chain_starts(starts)
    )
    same_optional(
        port.resolve_draft_leads(enabled, vec(starts)), ref.resolve_draft_leads(enabled, starts)
    )


@given(lens=uniform_lengths(0, 8, 0, 600), enabled=st.booleans())
def test_a_uniform_batch_never_takes_the_ragged_path_on_the_port(lens, enabled):
    """Every port predicate returns the scalar form (None / the one offset) for a uniform
    vector, however long: a mutant returning the equal-valued vector would pass every
    numeric comparison and fail here."""
    v = vec(lens)
    q0 = lens[0] if lens else 0
    assert port.resolve_ragged_rows(v, q0, len(lens)) is None
    assert port.resolve_ragged_chain_starts(v) is None
    assert port.resolve_draft_leads(enabled, v) is None
    assert port.resolve_row_cache_lens(enabled, q0, torch.zeros_like(v)) is None
    assert port.uniform_seqlen_offset(v) == (lens[0] if lens else None)


@given(data=st.data(), per_seq=st.booleans())
def test_draft_groups_match_the_reference(data, per_seq):
    depth = data.draw(st.integers(1, 8))
    w = depth + 1
    n = data.draw(st.integers(0, 12))
    u = data.draw(st.lists(st.integers(1, w), min_size=n, max_size=n))
    cache_lens = data.draw(
        st.one_of(st.just([40] * n), st.lists(st.integers(1, 600), min_size=n, max_size=n))
    )
    may = data.draw(st.lists(st.booleans(), min_size=n, max_size=n))
    got = port.draft_groups(
        vec(u), vec(cache_lens), torch.tensor(may, dtype=torch.bool, device=DEVICE), w, per_seq
    )
    want = ref.draft_groups(u, cache_lens, may, w, per_seq)
    assert got.as_dict() == want
    assert list(got.as_dict()) == list(want)  # same key order (ascending)
    if per_seq:
        assert len(want) <= w  # per-row keys: at most depth + 1 groups at any batch size


def test_draft_groups_spec_examples_on_the_port():
    u = vec([1, 2, 1, 3, 2, 1, 4, 1])
    for flag in (False, True):
        assert len(port.draft_groups(u, vec([40] * 8), [True] * 8, 5, flag).as_dict()) == 4
    lens = vec([40, 33, 37, 31, 39, 35, 30, 38])
    assert len(port.draft_groups(vec([1] * 8), lens, [True] * 8, 5, False).as_dict()) == 8
    assert port.draft_groups(vec([1] * 8), lens, [True] * 8, 5, True).as_dict() == {
        (1, 0): list(range(8))
    }


@given(data=st.data())
def test_draft_step_end_column_matches_the_reference(data):
    pos = data.draw(st.lists(st.integers(0, 30), max_size=5))
    b = data.draw(st.integers(0, 6))
    cached = data.draw(st.one_of(st.just(max(pos, default=0)), st.integers(0, 31)))
    p = outcome(port.draft_step_end_column, vec(pos), b, cached)
    r = outcome(ref.draft_step_end_column, pos, b, cached)
    if assert_same_refusal(p, r, "draft_step_end_column"):
        assert p[1] == r[1]


def test_the_port_draft_step_end_column_is_the_maximum_not_row_0():
    # conformance/test_port_dispatch.py's property draws b independently of len(start_pos), so
    # a valid ragged vector whose row 0 is not the maximum is rare: the catalogue's "row 0's
    # position instead of the maximum" survived it under the mutmut profile (moved here from
    # test_mutation_kills.py)
    from raggedspec.reference.errors import DispatchRefusal

    pos = torch.tensor([3, 7, 5], dtype=torch.int64)
    assert port.draft_step_end_column(pos, 3, 7) == 7
    with pytest.raises(DispatchRefusal, match="desync"):
        port.draft_step_end_column(pos, 3, 3)


@given(offsets=corner_lengths(1, 6, 40, boundaries=False), per_seq=st.booleans(),
       cache_lens=st.lists(st.integers(0, 50), min_size=1, max_size=6), u=st.integers(0, 9))
def test_ragged_row_q0_chain_start_and_group_keys_match_the_reference(
    offsets, per_seq, cache_lens, u
):
    same_optional(port.ragged_row_q0(vec(offsets), per_seq), ref.ragged_row_q0(offsets, per_seq))
    us = [u] * len(cache_lens)
    try:
        want = [list(ref.draft_group_key(u, c, per_seq)) for c in cache_lens]
    except ValueError:
        with pytest.raises(ValueError):
            port.draft_group_keys(vec(us), vec(cache_lens), per_seq)
        return
    assert port.draft_group_keys(vec(us), vec(cache_lens), per_seq).tolist() == want


def test_negative_positions_are_malformed_for_port_and_reference():
    """Negative row positions / chain starts are malformed input (ValueError) on both sides."""
    for port_fn, ref_fn, args in [
        (port.resolve_ragged_rows, ref.resolve_ragged_rows, ([-1, 5], 5, 2)),
        (port.resolve_draft_leads, ref.resolve_draft_leads, (True, [-3, 2])),
    ]:
        for fn in (port_fn, ref_fn):
            with pytest.raises(ValueError, match="must be >= 0"):
                fn(*args)
