"""RoPE positions and dispatch (masks-and-scheduling.md §11), on the reference and the port
(`gpu.rope`): the position rules through one test body (`impl`), then each implementation's own
dispatch (the reference's three branches and `rope_cohort_stats`; the port's gathered table and
`rope_path_stats`), the port's tables and its low-precision bound.

The oracle rotates one pair at a time as a complex multiply, `(a + ib) * e^{i pos f_k}`, with
numpy's complex exponential: an independent computation, so it agrees with either
implementation to rounding only (1e-12 absolute on O(1) inputs: float64 transcendental and
multiply rounding). Branch-vs-branch and batch-vs-row comparisons are bit-exact. The port
against the reference: float64 within 1e-12 relative to the tensor's max magnitude (its cos/sin
come from a vectorized `torch.cos` where the reference calls scalar libm, an ulp apart at
most); float32 / bfloat16 within `2 |naive - ref64| + 4 eps(dtype) max|x|`, `naive` the plain
same-precision implementation written here (angles and cos/sin in float32, cast to the dtype,
rotation in the dtype).
"""

from __future__ import annotations

import re

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from raggedspec.conformance.helpers import assert_refused, each_implementation, rope_rules
from raggedspec.conformance.strategies import corner_lengths, ragged_lengths, uniform_lengths
from raggedspec.reference.rope import (
    apply_rope,
    apply_rope_at_positions,
    compressed_key_positions,
    reset_rope_cohort_stats,
    rope_batched,
    rope_cohort_stats,
    rope_cos_sin,
    rope_gathered,
    rope_per_row,
)

THETA = 10000.0
ORACLE_TOL = 1e-12


def rotate_oracle(vec: np.ndarray, pos: int, rope_dims: int, theta: float,
                  inverse: bool = False) -> np.ndarray:
    """Rotate one head vector at `pos`: the last `rope_dims` dims as interleaved pairs."""
    out = vec.astype(np.float64).copy()
    lead = vec.shape[0] - rope_dims
    for k in range(rope_dims // 2):
        angle = pos * theta ** (-2.0 * k / rope_dims)
        z = complex(vec[lead + 2 * k], vec[lead + 2 * k + 1]) * np.exp(
            (-1j if inverse else 1j) * angle)
        out[lead + 2 * k], out[lead + 2 * k + 1] = z.real, z.imag
    return out


def assert_positions(out: np.ndarray, x: np.ndarray, positions: list[list[int]], rope_dims: int,
                     theta: float = THETA, inverse: bool = False) -> None:
    """Row i, token t of `out` is `x` rotated at `positions[i][t]` (every head)."""
    for i, row in enumerate(positions):
        for t, pos in enumerate(row):
            for h in range(x.shape[1]):
                want = rotate_oracle(x[i, h, t], pos, rope_dims, theta, inverse)
                np.testing.assert_allclose(out[i, h, t], want, rtol=0, atol=ORACLE_TOL)


def rand(shape, seed=0):
    return np.random.default_rng(seed).normal(size=shape)


@st.composite
def rows_to_rotate(draw):
    """`(x, offsets, rope_dims)`: ragged offsets 0..80, one per row, x `[B, H, T, D]` float64
    from a seeded rng, rope_dims a part or all of D."""
    offsets = draw(ragged_lengths(1, 6, 0, 80))
    t, heads = draw(st.integers(1, 9)), draw(st.integers(1, 3))
    dim, rope_dims = draw(st.sampled_from([(4, 4), (8, 4), (8, 8), (12, 6)]))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    return rng.normal(size=(len(offsets), heads, t, dim)), offsets, rope_dims


# ----------------------------------------------------------------------------- positions


@each_implementation
@pytest.mark.rule("DeepSeekV2RotaryEmbedding positions",
                  "DeepSeekV2RotaryEmbedding positions, port")
def test_the_spec_examples_rotate_each_row_at_its_own_positions(impl):
    rope = rope_rules(impl).apply_rope
    x = rand((3, 2, 1, 8))  # decode, offsets 6, 4, 2
    out = rope(x, [6, 4, 2], 4, THETA)
    assert_positions(out, x, [[6], [4], [2]], 4)
    # all three new tokens sit in cache column 6, yet row 1 is not rotated at 6
    assert not np.allclose(out[1], rope(x[1:2], [6], 4, THETA)[0])
    x = rand((1, 2, 5, 6), seed=1)  # a prefill at offset 0 rotates at 0..4
    out = rope(x, [0], 6, THETA)
    assert_positions(out, x, [[0, 1, 2, 3, 4]], 6)
    assert np.array_equal(out[:, :, 0], x[:, :, 0])  # position 0 is the identity, exactly
    x = rand((2, 1, 3, 8), seed=2)  # an MTP verify, rows 10 and 7, w = 3
    assert_positions(rope(x, [10, 7], 8, THETA), x, [[10, 11, 12], [7, 8, 9]], 8)


@each_implementation
@pytest.mark.rule("DeepSeekV2RotaryEmbedding positions",
                  "DeepSeekV2RotaryEmbedding positions, port")
def test_only_the_last_rope_dims_rotate_and_one_offset_serves_every_row(impl):
    rope = rope_rules(impl).apply_rope
    x = rand((2, 3, 4, 10), seed=3)
    out = rope(x, [5, 9], 4, THETA)
    assert np.array_equal(out[..., :6], x[..., :6])
    assert not np.allclose(out[..., 6:], x[..., 6:])
    x = rand((3, 1, 2, 4), seed=4)
    assert np.array_equal(rope(x, [7], 4, THETA), rope(x, [7, 7, 7], 4, THETA))
    assert_positions(rope(x, [7], 4, THETA), x, [[7, 8]] * 3, 4)


@each_implementation
@pytest.mark.rule("DeepSeekV2RotaryEmbedding positions",
                  "DeepSeekV2RotaryEmbedding positions, port")
def test_the_smallest_legal_values_are_accepted(impl):
    # rope_dims 2 (one pair), theta 1 and 0.5 (any theta > 0), no positions at all
    rules = rope_rules(impl)
    x = rand((2, 1, 3, 4), seed=6)
    assert_positions(rules.apply_rope(x, [4, 1], 2, THETA), x, [[4, 5, 6], [1, 2, 3]], 2)
    for theta in (1.0, 0.5):
        assert_positions(rules.apply_rope(x, [2], 4, theta), x, [[2, 3, 4]] * 2, 4, theta=theta)
    cos, sin = rules.rope_cos_sin(np.array([], dtype=np.int64), 4, THETA)
    assert cos.shape == sin.shape == (0, 2)
    cos, sin = rules.rope_cos_sin(np.array([0, 3]), 2, 0.5)  # pair 0 turns by the position
    np.testing.assert_allclose(cos[:, 0], np.cos([0.0, 3.0]), rtol=0, atol=1e-15)
    np.testing.assert_allclose(sin[:, 0], np.sin([0.0, 3.0]), rtol=0, atol=1e-15)


@each_implementation
@pytest.mark.rule("DeepSeekV2RotaryEmbedding positions",
                  "DeepSeekV2RotaryEmbedding positions, port")
def test_rope_cos_sin_shape_and_values(impl):
    cos, sin = rope_rules(impl).rope_cos_sin(np.array([0, 3]), 4, THETA)
    assert cos.shape == sin.shape == (2, 2)
    assert np.array_equal(cos[0], [1.0, 1.0]) and np.array_equal(sin[0], [0.0, 0.0])
    np.testing.assert_allclose(cos[1], np.cos([3.0, 3.0 * THETA ** -0.5]), rtol=0, atol=1e-15)


@each_implementation
@pytest.mark.rule("DeepSeekV2RotaryEmbedding positions",
                  "DeepSeekV2RotaryEmbedding positions, port")
@given(batch=rows_to_rotate())
def test_per_row_rope_equals_each_row_alone(impl, batch):
    x, offsets, rope_dims = batch
    rope = rope_rules(impl).apply_rope
    out = rope(x, offsets, rope_dims, THETA)
    for i, off in enumerate(offsets):
        assert np.array_equal(out[i: i + 1], rope(x[i: i + 1], [off], rope_dims, THETA))


@each_implementation
@pytest.mark.rule("RoPE inverse tail", "DeepSeekV2RotaryEmbedding positions, port")
@given(batch=rows_to_rotate())
def test_inverse_after_forward_is_the_identity(impl, batch):
    x, offsets, rope_dims = batch
    rope = rope_rules(impl).apply_rope
    fwd = rope(x, offsets, rope_dims, THETA)
    back = rope(fwd, offsets, rope_dims, THETA, inverse=True)
    np.testing.assert_allclose(back, x, rtol=0, atol=1e-12)  # rotation rounding only
    if max(offsets) > 0:
        assert not np.allclose(fwd, x)  # non-degeneracy: something rotated
    assert_positions(rope(x, offsets, rope_dims, THETA, inverse=True)[:, :1, :1], x[:, :1, :1],
                     [[o] for o in offsets], rope_dims, inverse=True)


# ----------------------------------------------------------------------------- refusals


@each_implementation
@pytest.mark.rule("DeepSeekV2RotaryEmbedding positions",
                  "DeepSeekV2RotaryEmbedding positions, port")
def test_each_malformed_input_is_refused_by_its_own_message(impl):
    rules = rope_rules(impl)
    x = rand((2, 1, 4, 8))  # B=2, H=1, T=4, D=8: every size differs from the offsets' count 3
    cases = [
        (lambda: rules.apply_rope(x, [1, 2, 3], 4, THETA),
         "3 offsets for a batch of 2 (need 1 or B)"),
        (lambda: rules.apply_rope(x, [], 4, THETA), "0 offsets for a batch of 2 (need 1 or B)"),
        (lambda: rules.apply_rope(x, [3, -1], 4, THETA), "offsets [3, -1] must be >= 0"),
        (lambda: rules.apply_rope(x, [1], 5, THETA),
         "rope_dims 5 must be even, >= 2 and <= head dim 8"),
        (lambda: rules.apply_rope(x, [1], 0, THETA),
         "rope_dims 0 must be even, >= 2 and <= head dim 8"),
        (lambda: rules.apply_rope(x, [1], 10, THETA),
         "rope_dims 10 must be even, >= 2 and <= head dim 8"),
        (lambda: rules.rope_cos_sin(np.array([1]), 3, THETA), "rope_dims 3 must be even and >= 2"),
        (lambda: rules.rope_cos_sin(np.array([1]), 0, THETA), "rope_dims 0 must be even and >= 2"),
        (lambda: rules.rope_cos_sin(np.array([1]), 4, 0), "theta 0 must be > 0"),
        (lambda: rules.rope_cos_sin(np.array([5, -3, 2]), 4, THETA),
         "positions must be >= 0, got min -3"),
        (lambda: rules.rope_cos_sin(np.array([-3]), 4, THETA),  # a single position is checked
         "positions must be >= 0, got min -3"),
    ]
    for call, message in cases:
        assert_refused(ValueError, call, message)


# ----------------------------------------------------------------------------- the reference


@pytest.mark.rule("DeepSeekV2RotaryEmbedding dispatch and rope_cohort_stats")
@given(batch=rows_to_rotate(), inverse=st.booleans())
def test_the_references_branches_agree_bit_for_bit(batch, inverse):
    x, offsets, rope_dims = batch
    per_row = rope_per_row(x, offsets, rope_dims, THETA, inverse)
    assert np.array_equal(rope_gathered(x, offsets, rope_dims, THETA, inverse), per_row)
    if len(set(offsets)) == 1:
        assert np.array_equal(rope_batched(x, offsets[0], rope_dims, THETA, inverse), per_row)
    for cohort in (False, True):
        assert np.array_equal(apply_rope(x, offsets, rope_dims, THETA, inverse, cohort), per_row)


@pytest.mark.rule("DeepSeekV2RotaryEmbedding dispatch and rope_cohort_stats")
@given(offsets=st.one_of(uniform_lengths(1, 6, 0, 80), ragged_lengths(1, 6, 0, 80)),
       cohort=st.booleans(), inverse=st.booleans())
def test_the_dispatch_takes_the_batched_branch_exactly_when_offsets_are_uniform(
        offsets, cohort, inverse):
    x = rand((len(offsets), 1, 2, 4))
    reset_rope_cohort_stats()
    apply_rope(x, offsets, 4, THETA, inverse=inverse, rope_cohort=cohort)
    uniform = len(set(offsets)) == 1  # the oracle predicate, written here
    assert rope_cohort_stats == {
        "uniform": int(uniform),
        "cohort": int(not uniform and cohort),
        "per_sequence": int(not uniform and not cohort),
    }


@pytest.mark.rule("DeepSeekV2RotaryEmbedding dispatch and rope_cohort_stats")
def test_every_call_counts_and_a_uniform_vector_longer_than_one_is_batched():
    reset_rope_cohort_stats()
    apply_rope(rand((4, 1, 1, 4)), [9, 9, 9, 9], 4, THETA)  # the old `len() == 1` dispatch
    assert rope_cohort_stats == {"uniform": 1, "cohort": 0, "per_sequence": 0}  # looped it
    reset_rope_cohort_stats()
    x = rand((2, 1, 1, 4))
    for _ in range(3):  # the counters accumulate until reset
        apply_rope(x, [1, 2], 4, THETA)
        apply_rope(x, [1, 2], 4, THETA, rope_cohort=True)
        apply_rope(x, [4], 4, THETA)
    assert rope_cohort_stats == {"uniform": 3, "cohort": 3, "per_sequence": 3}


@pytest.mark.rule("DeepSeekV2RotaryEmbedding dispatch and rope_cohort_stats")
def test_the_references_integer_and_float32_inputs_rotate_in_float64():
    xi = np.arange(2 * 1 * 2 * 4).reshape(2, 1, 2, 4) - 5  # integers: the rotation is not
    for x in (xi, rand((2, 1, 2, 4), seed=7).astype(np.float32)):
        want = x.astype(np.float64)
        for out in (apply_rope(x, [3, 8], 4, THETA), rope_gathered(x, [3, 8], 4, THETA),
                    rope_batched(x, 3, 4, THETA)[:1]):
            assert out.dtype == np.float64
            assert_positions(out, want, [[3, 4], [8, 9]][: out.shape[0]], 4)


@pytest.mark.rule("DeepSeekV2RotaryEmbedding dispatch and rope_cohort_stats", "RoPE inverse tail",
                  "RoPE compressed keys at j*ratio")
def test_each_reference_branch_rotates_forward_unless_asked_for_the_inverse():
    x = rand((2, 1, 2, 4), seed=8)
    for out in (rope_batched(x, 5, 4, THETA), rope_gathered(x, [5, 5], 4, THETA),
                rope_per_row(x, [5, 5], 4, THETA), apply_rope_at_positions(x, [5, 6], 4, THETA)):
        assert_positions(out, x, [[5, 6]] * 2, 4)
    back = apply_rope_at_positions(x, [5, 6], 4, THETA, inverse=True)
    assert_positions(back, x, [[5, 6]] * 2, 4, inverse=True)


@pytest.mark.rule("DeepSeekV2RotaryEmbedding positions")
def test_the_references_branches_and_shapes_refuse_by_their_own_messages():
    x = rand((2, 1, 4, 8))
    with pytest.raises(ValueError, match=re.escape("x must be [B,H,T,D], got shape (4, 8)")):
        apply_rope(np.zeros((4, 8)), [0], 4, THETA)
    for branch in (rope_gathered, rope_per_row):
        with pytest.raises(ValueError, match="^3 offsets for a batch of 2$"):
            branch(x, [1, 2, 3], 4, THETA)


@pytest.mark.rule("RoPE compressed keys at j*ratio")
def test_compressed_keys_rotate_at_block_starts_independent_of_the_row():
    assert compressed_key_positions(3, 4) == [0, 4, 8]
    assert compressed_key_positions(2, 128) == [0, 128]
    assert compressed_key_positions(0, 4) == [] and compressed_key_positions(3, 1) == [0, 1, 2]
    x = rand((2, 1, 3, 8), seed=5)
    out = apply_rope_at_positions(x, compressed_key_positions(3, 4), 8, 160000.0)
    assert_positions(out, x, [[0, 4, 8], [0, 4, 8]], 8, theta=160000.0)
    with pytest.raises(ValueError, match="2 positions for 3 tokens"):
        apply_rope_at_positions(x, [0, 4], 4, THETA)
    with pytest.raises(ValueError, match=re.escape("t_c -1 must be >= 0 and ratio 4 >= 1")):
        compressed_key_positions(-1, 4)
    with pytest.raises(ValueError, match=re.escape("t_c 2 must be >= 0 and ratio 0 >= 1")):
        compressed_key_positions(2, 0)
    # 2**63 has no int64 position; float(2**63 + 1) would silently round
    with pytest.raises((OverflowError, ValueError)):
        apply_rope_at_positions(rand((1, 1, 1, 4)), [2**63 + 1], 4, THETA)


# ----------------------------------------------------------------------------- the port


@st.composite
def rope_case(draw, max_offset: int = 1100):
    """`(x, offsets, rope_dims)`: x `[B,H,T,D]` float64 from a seeded rng, offsets of length 1
    or B (uniform, ragged, at the 512 boundaries), rope_dims even <= D."""
    offsets = draw(st.one_of(corner_lengths(1, 4, max_offset), uniform_lengths(1, 4, 0, max_offset),
                             st.lists(st.integers(0, max_offset), min_size=1, max_size=1)))
    b = len(offsets) if len(offsets) > 1 else draw(st.integers(1, 3))
    h, t = draw(st.integers(1, 2)), draw(st.integers(1, 5))
    d = draw(st.sampled_from([2, 4, 6, 8]))
    rope_dims = draw(st.sampled_from([r for r in (2, 4, 6, 8) if r <= d]))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    return rng.normal(size=(b, h, t, d)), offsets, rope_dims


@pytest.mark.rule("DeepSeekV2RotaryEmbedding positions, port")
@given(positions=st.lists(st.integers(0, 5000), max_size=12),
       rope_dims=st.sampled_from([2, 4, 8, 64]), theta=st.sampled_from([10000.0, 160000.0, 3.0]))
def test_the_ports_cos_sin_tables_match_the_reference(positions, rope_dims, theta):
    from raggedspec.gpu.testing import assert_close64

    cos, sin = rope_rules("port").rope_cos_sin(positions, rope_dims, theta)
    want_cos, want_sin = rope_cos_sin(np.asarray(positions, dtype=np.int64), rope_dims, theta)
    assert_close64(cos, want_cos, what="cos")
    assert_close64(sin, want_sin, what="sin")


@pytest.mark.rule("DeepSeekV2RotaryEmbedding positions, port")
@given(case=rope_case(), inverse=st.booleans(), use_table=st.booleans())
def test_the_ports_float64_rope_matches_the_reference(case, inverse, use_table):
    """Offsets on the device (read once) or a precomputed table: the reference's rotation."""
    pytest.importorskip("torch")
    import torch

    from raggedspec.gpu import rope as port
    from raggedspec.gpu.testing import DEVICE, assert_bit_exact, assert_close64, to_port

    x, offsets, rope_dims = case
    table = port.RopeTable(rope_dims, THETA, max(offsets) + x.shape[2], device=DEVICE) \
        if use_table else None
    got = port.apply_rope(to_port(x), torch.tensor(offsets, device=DEVICE), rope_dims, THETA,
                          inverse, table)
    assert_close64(got, apply_rope(x, offsets, rope_dims, THETA, inverse), what="apply_rope")
    # the leading (non-rotated) dims are moved, not computed: bit-exact
    assert_bit_exact(got[..., : x.shape[3] - rope_dims], x[..., : x.shape[3] - rope_dims])


def naive_rope(x, offsets: list[int], rope_dims: int, theta: float):
    """Plain same-precision RoPE: positions and angles in float32, cos/sin cast to x.dtype,
    every row rotated with its own positions, arithmetic in x.dtype."""
    import torch

    b, _, t, d = x.shape
    inv = torch.tensor([theta ** (-(2.0 * k) / rope_dims) for k in range(rope_dims // 2)],
                       dtype=torch.float32, device=x.device)
    out = x.clone()
    for i in range(b):
        off = offsets[i] if len(offsets) == b else offsets[0]
        ang = (off + torch.arange(t, device=x.device, dtype=torch.float32))[:, None] * inv
        c, s = torch.cos(ang).to(x.dtype), torch.sin(ang).to(x.dtype)
        ev, od = x[i, :, :, d - rope_dims::2], x[i, :, :, d - rope_dims + 1::2]
        out[i, :, :, d - rope_dims::2] = ev * c - od * s
        out[i, :, :, d - rope_dims + 1::2] = ev * s + od * c
    return out


@pytest.mark.rule("DeepSeekV2RotaryEmbedding positions, port")
@given(case=rope_case(), low=st.sampled_from(["float32", "bfloat16"]))
def test_the_ports_low_precision_rope_is_within_twice_the_naive_error(case, low):
    pytest.importorskip("torch")
    import torch

    from raggedspec.gpu import rope as port
    from raggedspec.gpu.testing import DEVICE, assert_dtype_bound, representable, to_port

    dtype = getattr(torch, low)
    x, offsets, rope_dims = case
    x = representable(x, dtype)
    got = port.apply_rope(to_port(x, dtype), torch.tensor(offsets, device=DEVICE), rope_dims,
                          THETA)
    assert got.dtype == dtype
    naive = naive_rope(to_port(x, dtype), offsets, rope_dims, THETA)
    want = apply_rope(x, offsets, rope_dims, THETA)
    assert_dtype_bound(got, naive, want, dtype, float(np.abs(x).max()), "apply_rope")


@pytest.mark.rule("uniform_seqlen_offset on the RoPE path, port")
@given(lens=uniform_lengths(1, 5, 0, 1100), ragged=corner_lengths(2, 5, 1100))
def test_a_uniform_batch_never_takes_the_ports_gathered_path(lens, ragged):
    """The port's dispatch: a uniform offset vector (host or device) builds the `[1, T]` table,
    bit-identical to the gathered one, so only the counter can tell; every call counts."""
    pytest.importorskip("torch")
    import torch

    from raggedspec.gpu import rope as port
    from raggedspec.gpu.testing import DEVICE, assert_bit_exact

    x = torch.ones((len(lens), 1, 2, 4), dtype=torch.float64, device=DEVICE)
    port.reset_rope_path_stats()
    wide = port.apply_rope(x, torch.tensor(lens, device=DEVICE), 4, THETA)
    port.apply_rope(x, lens, 4, THETA)
    assert port.rope_path_stats == {"uniform": 2, "gathered": 0}
    y = torch.ones((len(ragged), 1, 2, 4), dtype=torch.float64, device=DEVICE)
    port.apply_rope(y, torch.tensor(ragged, device=DEVICE), 4, THETA)
    port.apply_rope(y, ragged, 4, THETA)
    assert port.rope_path_stats["gathered"] == (0 if len(set(ragged)) == 1 else 2)
    table = port.RopeTable(4, THETA, lens[0] + 2, device=DEVICE)
    c, s = table.lookup(torch.tensor(lens, device=DEVICE)[:, None] + torch.arange(2, device=DEVICE))
    assert_bit_exact(port.rotate(x, c[:, None], s[:, None], 4), wide)


PORT_MALFORMED = [
    ("x 3-D", lambda p, t: p.apply_rope(t.ones(1, 2, 4), [0], 2, THETA),
     "x must be [B,H,T,D], got shape [1, 2, 4]"),
    ("offsets 2-D", lambda p, t: p.apply_rope(t.ones(2, 1, 2, 4), t.tensor([[0], [1]]), 2, THETA),
     "offsets must be a 1-D vector, got shape [2, 1]"),
    ("device offset negative", lambda p, t: p.apply_rope(t.ones(2, 1, 2, 4), t.tensor([-1, 2]), 2,
                                                         THETA),
     "offsets [-1, 2] must be >= 0"),
    ("table size negative", lambda p, t: p.RopeTable(2, THETA, -1), "n_positions -1 must be >= 0"),
    ("table past", lambda p, t: p.RopeTable(2, THETA, 5).lookup(t.tensor([1, 5])),
     "position 5 is past the table's 5 positions"),
]


@pytest.mark.rule("DeepSeekV2RotaryEmbedding positions, port")
@pytest.mark.parametrize("call, message", [c[1:] for c in PORT_MALFORMED],
                         ids=[c[0] for c in PORT_MALFORMED])
def test_each_malformed_port_input_is_a_value_error_with_its_message(call, message):
    torch = pytest.importorskip("torch")
    from raggedspec.gpu import rope as port

    assert_refused(ValueError, lambda: call(port, torch), message)


@pytest.mark.rule("DeepSeekV2RotaryEmbedding positions, port")
def test_a_port_table_holds_exactly_its_positions():
    """Host offsets [2, 4], T = 2: the largest position is 5, so a 6-position table serves
    the batch (equal to the computed rotation) and a 5-position table refuses it; a table may
    hold no positions at all."""
    torch = pytest.importorskip("torch")
    from raggedspec.gpu import rope as port
    from raggedspec.gpu.testing import assert_bit_exact

    x = torch.arange(16, dtype=torch.float64).reshape(2, 1, 2, 4)
    want = port.apply_rope(x, [2, 4], 4, THETA)
    assert_bit_exact(port.apply_rope(x, [2, 4], 4, THETA, table=port.RopeTable(4, THETA, 6)), want)
    with pytest.raises(ValueError) as err:
        port.apply_rope(x, [2, 4], 4, THETA, table=port.RopeTable(4, THETA, 5))
    assert str(err.value) == "position 5 is past the table's 5 positions"
    empty = port.RopeTable(4, THETA, 0)
    assert list(empty.cos.shape) == [0, 2]
    c, s = empty.lookup(torch.zeros(0, dtype=torch.int64))
    assert list(c.shape) == [0, 2] == list(s.shape)


@pytest.mark.rule("DeepSeekV2RotaryEmbedding positions, port")
@pytest.mark.parametrize("low", ["float32", "bfloat16"])
def test_the_ports_tables_are_in_their_dtype_and_every_rotation_in_the_input_dtype(low):
    torch = pytest.importorskip("torch")
    from raggedspec.gpu import rope as port

    dtype = getattr(torch, low)
    cos, sin = port.rope_cos_sin([0, 7], 4, THETA, dtype)
    assert cos.dtype == sin.dtype == dtype
    table = port.RopeTable(4, THETA, 8, dtype)
    assert table.cos.dtype == table.sin.dtype == dtype
    x = torch.ones((2, 1, 2, 4), dtype=dtype)
    assert port.apply_rope(x, [1, 3], 4, THETA).dtype == dtype
    assert port.apply_rope(x, [1, 3], 4, THETA, table=port.RopeTable(4, THETA, 8)).dtype == dtype
    assert port.rotate(x, *port.rope_cos_sin([[0, 1]], 4, THETA), 4).dtype == dtype


@pytest.mark.slow
@pytest.mark.rule("DeepSeekV2RotaryEmbedding positions, port")
def test_the_ports_tables_are_made_on_the_requested_device():
    """The meta device exists on every machine: what a function builds for `device="meta"`
    must be there (a CPU run cannot tell a dropped device argument otherwise). Slow only
    because the first meta-device op of a process loads torch's meta kernels (about 2 s)."""
    pytest.importorskip("torch")
    from raggedspec.gpu import rope as port

    cos, sin = port.rope_cos_sin([], 4, THETA, device="meta")
    assert cos.device.type == sin.device.type == "meta"
    table = port.RopeTable(4, THETA, 0, device="meta")
    assert table.cos.device.type == table.sin.device.type == "meta"
