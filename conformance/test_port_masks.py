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


@pytest.mark.rule("raw_keep_span, port", "dsv4 raw / compressed validity, port")
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


@pytest.mark.rule("graph_mode_length_mask, port")
@dtypes
@given(positions=st.lists(st.integers(0, 40), min_size=1, max_size=6), cap=st.integers(0, 32))
def test_graph_mode_length_mask_matches_the_reference(dtype, positions, cap):
    assert_bit_exact(port.graph_mode_length_mask(vec(positions), cap, dtype),
                     ref.graph_mode_length_mask(positions, cap))


@pytest.mark.rule("make_left_padded_causal_mask, port")
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


@pytest.mark.rule("make_causal_mask_matrix, sliding-window masker, port")
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


@pytest.mark.rule("sdpa_sliding_window, mask_must_be_applied_as_bias, port")
@given(ratio=st.integers(0, 200), w=st.integers(0, 200),
       dims=st.one_of(st.none(), st.lists(st.integers(1, 4), max_size=5)))
def test_mask_predicates_match_the_reference(ratio, w, dims):
    assert port.sdpa_sliding_window(ratio, w) == ref.sdpa_sliding_window(ratio, w)
    assert port.mask_must_be_applied_as_bias(dims) == ref.mask_must_be_applied_as_bias(dims)


@pytest.mark.rule("graph_mode_length_mask, port")
def test_unset_graph_length_mask_is_refused_by_both():
    p, r = (
        outcome(port.require_graph_length_mask, None),
        outcome(ref.require_graph_length_mask, None),
    )
    assert p[0] == "refused"
    assert_same_refusal(p, r)


# Refusal texts, boundaries, result dtypes and devices. Each refusal breaks exactly one
# condition and names the values given; the expected text is stated from the inputs.


def refuses(exc, text, fn, *args, **kwargs):
    with pytest.raises(exc) as info:
        fn(*args, **kwargs)
    assert str(info.value) == text


@pytest.mark.rule("raw_keep_span, port", "sdpa_sliding_window, mask_must_be_applied_as_bias, port")
def test_keep_span_and_predicate_refusals_name_the_values():
    refuses(ValueError, "t_q -1 and t_k_full 5 must be >= 0", port.raw_keep_span, -1, 1, 5)
    refuses(ValueError, "t_q 1 and t_k_full -1 must be >= 0", port.raw_keep_span, 1, 1, -1)
    refuses(ValueError, "window 0 must be >= 1 (dsv4 passes max(sliding_window, 1))",
            port.raw_keep_span, 1, 0, 5)
    refuses(ValueError, "ratio -1 and window 3 must be >= 0", port.sdpa_sliding_window, -1, 3)
    refuses(ValueError, "ratio 1 and window -1 must be >= 0", port.sdpa_sliding_window, 1, -1)
    # ratio 0 and 1 are the standard layouts (window kept); 2 is the first compressed one
    assert [port.sdpa_sliding_window(r, 5) for r in (0, 1, 2)] == [5, 5, None]


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


@pytest.mark.rule("graph_mode_length_mask, port")
@dtypes
def test_length_mask_refusals_and_dtypes(dtype):
    refuses(ValueError, "positions must be a 1-D vector, got shape [1, 1]",
            port.graph_mode_length_mask, torch.tensor([[0]]), 2, dtype)
    refuses(ValueError, "cap -1 and positions [0] must be >= 0",
            port.graph_mode_length_mask, vec([0]), -1, dtype)
    refuses(ValueError, "cap 2 and positions [1, -1] must be >= 0",
            port.graph_mode_length_mask, vec([1, -1]), 2, dtype)
    assert port.graph_mode_length_mask(vec([0, 1]), 2, dtype).dtype == dtype
    assert port.graph_mode_length_mask(vec([0, 1]), 2).dtype == torch.float64


@pytest.mark.rule("make_left_padded_causal_mask, port")
@dtypes
def test_left_padded_causal_mask_refusals_dtypes_and_device(dtype):
    msg = "b {}, t_q {}, past {} must be >= 0"
    f = port.make_left_padded_causal_mask
    refuses(ValueError, msg.format(-1, 1, 2), f, -1, 1, 2, vec([]), dtype)
    refuses(ValueError, msg.format(1, -1, 2), f, 1, -1, 2, vec([1]), dtype)
    refuses(ValueError, msg.format(1, 1, -1), f, 1, 1, -1, vec([0]), dtype)
    refuses(ValueError, "live must be a 1-D vector, got shape [1, 1]",
            f, 1, 1, 2, torch.tensor([[1]]), dtype)
    refuses(ValueError, "live lengths [1, -1] must be >= 0", f, 2, 1, 2, vec([1, -1]), dtype)
    assert f(2, 1, 2, vec([1, 2]), dtype).dtype == dtype
    assert f(2, 1, 2, vec([1, 2])).dtype == torch.float64
    got = f(2, 1, 2, vec([1, 2]), dtype, device="meta")  # live checked here, mask built there
    assert (got.device.type, got.dtype, tuple(got.shape)) == ("meta", dtype, (2, 1, 1, 3))


MASKERS = (
    (port.make_causal_mask_matrix, ()),
    (port.make_sliding_window_causal_mask_matrix, (4,)),
)


@pytest.mark.rule("make_causal_mask_matrix, sliding-window masker, port")
@pytest.mark.parametrize("masker,extra", MASKERS, ids=lambda m: getattr(m, "__name__", ""))
def test_masker_refusals_and_zero_boundaries(masker, extra):
    msg = "b {}, t_q {}, past {} must be >= 0"
    for b, t_q, past in ((-1, 2, 3), (2, -1, 3), (2, 2, -1)):
        refuses(ValueError, msg.format(b, t_q, past), masker, b, t_q, past, None, None, *extra)
    policy = ("channel",) if extra else ()
    refuses(ValueError, "per_seq_kv_lens must be a 1-D vector, got shape [1, 2]",
            masker, 2, 2, 3, torch.tensor([[1, 2]]), None, *extra, *policy)
    refuses(ValueError, "channel_lead must be a 1-D vector, got shape [1, 2]",
            masker, 2, 2, 3, None, torch.tensor([[1, 2]]), *extra, *policy)
    # b == 0 and t_q == 0 are well formed: an empty batch, a forward with no query
    assert tuple(masker(0, 2, 3, None, None, *extra).shape) == (2, 5)
    assert tuple(masker(2, 0, 3, None, None, *extra).shape) == (0, 3)


@pytest.mark.rule("make_causal_mask_matrix, sliding-window masker, port")
@pytest.mark.parametrize("masker,extra", MASKERS, ids=lambda m: getattr(m, "__name__", ""))
@dtypes
def test_masker_defaults_dtypes_and_device(masker, extra, dtype):
    """Defaults: no flash (a full [t_q, past + t_q] mask, not the [1, 1] placeholder), no
    ragged policy for the sliding masker (a channel lead is ignored), float64."""
    plain = masker(2, 2, 3, None, None, *extra)
    assert (tuple(plain.shape), plain.dtype) == ((2, 5), torch.float64)
    assert masker(2, 2, 3, None, None, *extra, dtype=dtype).dtype == dtype
    flash = masker(2, 2, 3, None, None, *extra, flash_on_cuda=True, dtype=dtype)
    assert (tuple(flash.shape), flash.dtype) == ((1, 1), dtype)
    assert masker(2, 2, 3, None, None, *extra, flash_on_cuda=True).dtype == torch.float64
    for flash_on_cuda in (False, True):
        got = masker(2, 2, 3, None, None, *extra, flash_on_cuda=flash_on_cuda, device="meta",
                     dtype=dtype)
        assert (got.device.type, got.dtype) == ("meta", dtype)
    # the ragged path (per-seq lens; a channel lead under the "channel" policy)
    policy = ("channel",) if extra else ()
    for per_seq, lead in ((vec([3, 1]), None), (None, vec([0, 2]))):
        got = masker(2, 2, 3, per_seq, lead, *extra, *policy, dtype=dtype)
        assert (tuple(got.shape), got.dtype) == ((2, 1, 2, 5), dtype)
        got = masker(2, 2, 3, per_seq, lead, *extra, *policy)
        assert got.dtype == torch.float64
    got = port.make_causal_mask_matrix(2, 2, 3, vec([3, 1]), None, device="meta", dtype=dtype)
    assert (got.device.type, got.dtype) == ("meta", dtype)
    if extra:  # the default policy is "none": a channel lead builds no ragged mask
        assert tuple(masker(2, 2, 3, None, vec([0, 2]), *extra).shape) == (2, 5)


@pytest.mark.rule("make_causal_mask_matrix, sliding-window masker, port")
def test_channel_lead_boundaries():
    """A channel lead is a ragged source iff it has one entry per row, some lead > 0 and
    none > past: all-zero leads are not (t_q 1 -> no mask); a lead == past is (live 0)."""
    for masker, extra in MASKERS:
        policy = ("channel",) if extra else ()
        assert masker(2, 1, 3, None, vec([0, 0]), *extra, *policy) is None
        got = masker(2, 1, 3, None, vec([3, 0]), *extra, *policy)
        keep = (got[:, 0, 0] == 0).int().tolist()
        assert keep == [[0, 0, 0, 1], [1, 1, 1, 1]]  # row 0 has live 0: only its own column
        assert masker(2, 1, 3, None, vec([4, 0]), *extra, *policy) is None  # lead > past


@pytest.mark.rule("make_causal_mask_matrix, sliding-window masker, port")
def test_sliding_masker_refuses_an_unknown_policy_and_a_zero_window():
    f = port.make_sliding_window_causal_mask_matrix
    refuses(ValueError, "sliding_window_ragged 'rows' must be one of ('none', 'channel')",
            f, 2, 2, 3, None, None, 4, "rows")
    refuses(ValueError, "window 0 must be >= 1", f, 2, 2, 3, None, None, 0)
    assert tuple(f(2, 2, 3, None, None, 1).shape) == (2, 5)  # window 1: the diagonal only
