"""RoPE positions and dispatch (masks-and-scheduling.md §11).

The oracle rotates one pair at a time as a complex multiply, `(a + ib) * e^{i pos f_k}`, with
numpy's complex exponential: an independent computation, so it agrees with the reference to
rounding only (tolerance 1e-12 absolute on O(1) inputs: float64 transcendental and
multiply rounding). Branch-vs-branch and batch-vs-row comparisons are bit-exact."""

from __future__ import annotations

import re

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from raggedspec.conformance.strategies import ragged_lengths, uniform_lengths
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
                     theta: float = THETA) -> None:
    """Row i, token t of `out` is `x` rotated at `positions[i][t]` (every head)."""
    for i, row in enumerate(positions):
        for t, pos in enumerate(row):
            for h in range(x.shape[1]):
                want = rotate_oracle(x[i, h, t], pos, rope_dims, theta)
                np.testing.assert_allclose(out[i, h, t], want, rtol=0, atol=ORACLE_TOL)


def rand(shape, seed=0):
    return np.random.default_rng(seed).normal(size=shape)


# ----------------------------------------------------------------------------- examples


@pytest.mark.rule("DeepSeekV2RotaryEmbedding positions")
def test_decode_offsets_6_4_2_rotate_at_6_4_2():
    x = rand((3, 2, 1, 8))
    out = apply_rope(x, [6, 4, 2], 4, THETA)
    assert_positions(out, x, [[6], [4], [2]], 4)
    # all three new tokens sit in cache column 6, yet row 1 is not rotated at 6
    assert not np.allclose(out[1], apply_rope(x[1:2], [6], 4, THETA)[0])


@pytest.mark.rule("DeepSeekV2RotaryEmbedding positions")
def test_prefill_at_offset_0_rotates_0_to_4():
    x = rand((1, 2, 5, 6), seed=1)
    out = apply_rope(x, [0], 6, THETA)
    assert_positions(out, x, [[0, 1, 2, 3, 4]], 6)
    assert np.array_equal(out[:, :, 0], x[:, :, 0])  # position 0 is the identity, exactly


@pytest.mark.rule("DeepSeekV2RotaryEmbedding positions")
def test_mtp_verify_rows_10_and_7_with_w3():
    x = rand((2, 1, 3, 8), seed=2)
    out = apply_rope(x, [10, 7], 8, THETA)
    assert_positions(out, x, [[10, 11, 12], [7, 8, 9]], 8)


@pytest.mark.rule("DeepSeekV2RotaryEmbedding positions")
def test_only_the_last_rope_dims_rotate():
    x = rand((2, 3, 4, 10), seed=3)
    out = apply_rope(x, [5, 9], 4, THETA)
    assert np.array_equal(out[..., :6], x[..., :6])
    assert not np.allclose(out[..., 6:], x[..., 6:])


@pytest.mark.rule("DeepSeekV2RotaryEmbedding positions")
def test_one_offset_is_shared_by_every_row():
    x = rand((3, 1, 2, 4), seed=4)
    assert np.array_equal(apply_rope(x, [7], 4, THETA), apply_rope(x, [7, 7, 7], 4, THETA))
    assert_positions(apply_rope(x, [7], 4, THETA), x, [[7, 8]] * 3, 4)


@pytest.mark.rule("RoPE compressed keys at j*ratio")
def test_compressed_keys_rotate_at_block_starts_independent_of_the_row():
    assert compressed_key_positions(3, 4) == [0, 4, 8]
    assert compressed_key_positions(2, 128) == [0, 128]
    assert compressed_key_positions(0, 4) == []
    x = rand((2, 1, 3, 8), seed=5)
    out = apply_rope_at_positions(x, compressed_key_positions(3, 4), 8, 160000.0)
    assert_positions(out, x, [[0, 4, 8], [0, 4, 8]], 8, theta=160000.0)


@pytest.mark.rule("DeepSeekV2RotaryEmbedding positions")
def test_rope_cos_sin_shape_and_values():
    cos, sin = rope_cos_sin(np.array([0, 3]), 4, THETA)
    assert cos.shape == sin.shape == (2, 2)
    assert np.array_equal(cos[0], [1.0, 1.0]) and np.array_equal(sin[0], [0.0, 0.0])
    np.testing.assert_allclose(cos[1], np.cos([3.0, 3.0 * THETA ** -0.5]), rtol=0, atol=1e-15)


@pytest.mark.rule("DeepSeekV2RotaryEmbedding positions")
def test_malformed_rope_inputs_are_rejected():
    x = rand((2, 1, 3, 8))
    with pytest.raises(ValueError, match="3 offsets for a batch of 2"):
        apply_rope(x, [1, 2, 3], 4, THETA)
    with pytest.raises(ValueError, match="rope_dims 5"):
        apply_rope(x, [1], 5, THETA)
    with pytest.raises(ValueError, match="rope_dims 10"):
        apply_rope(x, [1], 10, THETA)
    with pytest.raises(ValueError, match="2 positions for 3 tokens"):
        apply_rope_at_positions(x, [0, 4], 4, THETA)


# ----------------------------------------------------------------------------- properties


def _x(lengths, t, heads, dim, seed):
    return np.random.default_rng(seed).normal(size=(len(lengths), heads, t, dim))


rope_shape = dict(t=st.integers(1, 9), heads=st.integers(1, 3),
                  dims=st.sampled_from([(4, 4), (8, 4), (8, 8), (12, 6)]),
                  seed=st.integers(0, 2**32 - 1))


@pytest.mark.rule("DeepSeekV2RotaryEmbedding positions")
@given(offsets=ragged_lengths(1, 6, 0, 80), **rope_shape)
def test_per_row_rope_equals_each_row_alone(offsets, t, heads, dims, seed):
    dim, rope_dims = dims
    x = _x(offsets, t, heads, dim, seed)
    out = apply_rope(x, offsets, rope_dims, THETA)
    for i, off in enumerate(offsets):
        assert np.array_equal(out[i: i + 1], apply_rope(x[i: i + 1], [off], rope_dims, THETA))


@pytest.mark.rule("RoPE inverse tail")
@given(offsets=ragged_lengths(1, 6, 0, 80), cohort=st.booleans(), **rope_shape)
def test_inverse_after_forward_is_the_identity(offsets, cohort, t, heads, dims, seed):
    dim, rope_dims = dims
    x = _x(offsets, t, heads, dim, seed)
    fwd = apply_rope(x, offsets, rope_dims, THETA, rope_cohort=cohort)
    back = apply_rope(fwd, offsets, rope_dims, THETA, inverse=True, rope_cohort=cohort)
    np.testing.assert_allclose(back, x, rtol=0, atol=1e-12)  # rotation rounding only
    if max(offsets) > 0:
        assert not np.allclose(fwd, x)  # non-degeneracy: something rotated


@pytest.mark.rule("DeepSeekV2RotaryEmbedding dispatch and rope_cohort_stats")
@given(offsets=ragged_lengths(1, 6, 0, 80), inverse=st.booleans(), **rope_shape)
def test_the_rope_branches_agree_bit_for_bit(offsets, inverse, t, heads, dims, seed):
    dim, rope_dims = dims
    x = _x(offsets, t, heads, dim, seed)
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
    x = _x(offsets, 2, 1, 4, 0)
    reset_rope_cohort_stats()
    apply_rope(x, offsets, 4, THETA, inverse=inverse, rope_cohort=cohort)
    uniform = len(set(offsets)) == 1  # the oracle predicate, written here
    assert rope_cohort_stats == {
        "uniform": int(uniform),
        "cohort": int(not uniform and cohort),
        "per_sequence": int(not uniform and not cohort),
    }


@pytest.mark.rule("DeepSeekV2RotaryEmbedding dispatch and rope_cohort_stats")
def test_a_uniform_vector_longer_than_one_takes_the_batched_branch():
    # the old `len() == 1` dispatch would send this down the per-row loop
    reset_rope_cohort_stats()
    apply_rope(rand((4, 1, 1, 4)), [9, 9, 9, 9], 4, THETA)
    assert rope_cohort_stats == {"uniform": 1, "cohort": 0, "per_sequence": 0}


# ----------------------------------------------------------------------------- refusals, boundaries


@pytest.mark.rule("DeepSeekV2RotaryEmbedding positions", "RoPE compressed keys at j*ratio")
def test_each_malformed_input_is_refused_by_its_own_message():
    x = rand((2, 1, 4, 8))  # B=2, H=1, T=4, D=8: every size differs from the offsets' count 3
    with pytest.raises(ValueError, match=re.escape("x must be [B,H,T,D], got shape (4, 8)")):
        apply_rope(np.zeros((4, 8)), [0], 4, THETA)
    with pytest.raises(ValueError, match=re.escape("offsets [3, -1] must be >= 0")):
        apply_rope(x, [3, -1], 4, THETA)
    for branch in (rope_gathered, rope_per_row):
        with pytest.raises(ValueError, match="^3 offsets for a batch of 2$"):
            branch(x, [1, 2, 3], 4, THETA)
    with pytest.raises(ValueError, match="^rope_dims 3 must be even and >= 2$"):
        rope_cos_sin(np.array([1]), 3, THETA)
    with pytest.raises(ValueError, match="^rope_dims 0 must be even and >= 2$"):
        rope_cos_sin(np.array([1]), 0, THETA)
    with pytest.raises(ValueError, match="^theta 0 must be > 0$"):
        rope_cos_sin(np.array([1]), 4, 0)
    with pytest.raises(ValueError, match="^positions must be >= 0, got min -3$"):
        rope_cos_sin(np.array([5, -3, 2]), 4, THETA)
    with pytest.raises(ValueError, match="^positions must be >= 0, got min -3$"):
        rope_cos_sin(np.array([-3]), 4, THETA)  # a single position is checked too
    with pytest.raises(ValueError, match=re.escape("t_c -1 must be >= 0 and ratio 4 >= 1")):
        compressed_key_positions(-1, 4)
    with pytest.raises(ValueError, match=re.escape("t_c 2 must be >= 0 and ratio 0 >= 1")):
        compressed_key_positions(2, 0)


@pytest.mark.rule("DeepSeekV2RotaryEmbedding positions", "RoPE compressed keys at j*ratio")
def test_the_smallest_legal_values_are_accepted():
    # rope_dims 2 (one pair), theta 1 and 0.5 (any theta > 0), ratio 1, no positions at all
    x = rand((2, 1, 3, 4), seed=6)
    assert_positions(apply_rope(x, [4, 1], 2, THETA), x, [[4, 5, 6], [1, 2, 3]], 2)
    for theta in (1.0, 0.5):
        assert_positions(apply_rope(x, [2], 4, theta), x, [[2, 3, 4]] * 2, 4, theta=theta)
    assert compressed_key_positions(3, 1) == [0, 1, 2]
    cos, sin = rope_cos_sin(np.array([], dtype=np.int64), 4, THETA)
    assert cos.shape == sin.shape == (0, 2)


@pytest.mark.rule("RoPE compressed keys at j*ratio")
def test_a_position_beyond_int64_is_refused_not_rotated_at_a_rounded_angle():
    # 2**63 has no int64 position; float(2**63 + 1) would silently round
    with pytest.raises((OverflowError, ValueError)):
        apply_rope_at_positions(rand((1, 1, 1, 4)), [2**63 + 1], 4, THETA)


@pytest.mark.rule("DeepSeekV2RotaryEmbedding dispatch and rope_cohort_stats")
def test_integer_and_float32_inputs_rotate_in_float64():
    xi = np.arange(2 * 1 * 2 * 4).reshape(2, 1, 2, 4) - 5  # integers: the rotation is not
    for x in (xi, rand((2, 1, 2, 4), seed=7).astype(np.float32)):
        want = x.astype(np.float64)
        for out in (apply_rope(x, [3, 8], 4, THETA), rope_gathered(x, [3, 8], 4, THETA),
                    rope_batched(x, 3, 4, THETA)[:1]):
            assert out.dtype == np.float64
            assert_positions(out, want, [[3, 4], [8, 9]][: out.shape[0]], 4)


@pytest.mark.rule("DeepSeekV2RotaryEmbedding dispatch and rope_cohort_stats", "RoPE inverse tail")
def test_each_branch_rotates_forward_unless_asked_for_the_inverse():
    x = rand((2, 1, 2, 4), seed=8)
    for out in (rope_batched(x, 5, 4, THETA), rope_gathered(x, [5, 5], 4, THETA),
                rope_per_row(x, [5, 5], 4, THETA),
                apply_rope_at_positions(x, [5, 6], 4, THETA)):
        assert_positions(out, x, [[5, 6]] * 2, 4)
    back = apply_rope_at_positions(x, [5, 6], 4, THETA, inverse=True)
    for i in range(2):
        for t, pos in enumerate((5, 6)):
            want = rotate_oracle(x[i, 0, t], pos, 4, THETA, inverse=True)
            np.testing.assert_allclose(back[i, 0, t], want, rtol=0, atol=ORACLE_TOL)


@pytest.mark.rule("DeepSeekV2RotaryEmbedding dispatch and rope_cohort_stats")
def test_ragged_offsets_take_the_per_row_branch_unless_the_cohort_flag_is_set():
    reset_rope_cohort_stats()
    x = rand((2, 1, 1, 4))
    for _ in range(3):  # every call counts: the counters accumulate until reset
        apply_rope(x, [1, 2], 4, THETA)
        apply_rope(x, [1, 2], 4, THETA, rope_cohort=True)
        apply_rope(x, [4], 4, THETA)
    assert rope_cohort_stats == {"uniform": 3, "cohort": 3, "per_sequence": 3}
