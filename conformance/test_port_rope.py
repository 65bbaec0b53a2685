"""Port conformance: RoPE (gpu.rope vs reference.rope).

Tolerances: positions are integers (bit-exact). float64 rotations: 1e-12 relative to the
tensor's max magnitude (`gpu.testing.assert_close64`): the port's cos/sin come from a
vectorized float64 `torch.cos` where the reference calls scalar libm, which may differ by
an ulp; the rotation is then ~3 float64 ops. float32 / bfloat16: the DESIGN.md rule
`|port - ref64| <= 2 |naive - ref64| + 4 eps(dtype) max|x|`, where `naive` (written here)
is the plain same-precision implementation: angles and cos/sin in float32 (the common
engine recipe), cast to the dtype, rotation in the dtype."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import raggedspec.gpu.rope as port
import raggedspec.reference.rope as ref
from raggedspec.conformance.strategies import corner_lengths, uniform_lengths
from raggedspec.gpu.testing import (
    DEVICE,
    assert_bit_exact,
    assert_close64,
    assert_dtype_bound,
    representable,
    to_port,
)

THETA = 10000.0


@st.composite
def rope_case(draw, max_offset: int = 1100):
    """`(x, offsets, rope_dims)`: x `[B,H,T,D]` float64 from a seeded rng, offsets of
    length 1 or B (uniform, ragged, at the 512 boundaries), rope_dims even <= D."""
    offsets = draw(st.one_of(corner_lengths(1, 4, max_offset), uniform_lengths(1, 4, 0, max_offset),
                             st.lists(st.integers(0, max_offset), min_size=1, max_size=1)))
    b = len(offsets) if len(offsets) > 1 else draw(st.integers(1, 3))
    h, t = draw(st.integers(1, 2)), draw(st.integers(1, 5))
    d = draw(st.sampled_from([2, 4, 6, 8]))
    rope_dims = draw(st.sampled_from([r for r in (2, 4, 6, 8) if r <= d]))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    return rng.normal(size=(b, h, t, d)), offsets, rope_dims


@pytest.mark.rule("DeepSeekV2RotaryEmbedding positions, port")
@given(
    positions=st.lists(st.integers(0, 5000), max_size=12),
    rope_dims=st.sampled_from([2, 4, 8, 64]),
    theta=st.sampled_from([10000.0, 160000.0, 3.0]),
)
def test_cos_sin_tables_match_the_reference(positions, rope_dims, theta):
    cos, sin = port.rope_cos_sin(
        torch.tensor(positions, dtype=torch.int64, device=DEVICE), rope_dims, theta
    )
    want_cos, want_sin = ref.rope_cos_sin(np.asarray(positions, dtype=np.int64), rope_dims, theta)
    assert_close64(cos, want_cos, what="cos")
    assert_close64(sin, want_sin, what="sin")


@pytest.mark.rule("DeepSeekV2RotaryEmbedding positions, port")
@pytest.mark.parametrize("use_table", [False, True])
@given(case=rope_case(), inverse=st.booleans())
def test_float64_rope_matches_the_reference(use_table, case, inverse):
    x, offsets, rope_dims = case
    table = (
        port.RopeTable(rope_dims, THETA, max(offsets) + x.shape[2], device=DEVICE)
        if use_table
        else None
    )
    got = port.apply_rope(
        to_port(x), torch.tensor(offsets, device=DEVICE), rope_dims, THETA, inverse, table
    )
    assert_close64(got, ref.apply_rope(x, offsets, rope_dims, THETA, inverse), what="apply_rope")
    # the leading (non-rotated) dims are moved, not computed: bit-exact
    assert_bit_exact(got[..., : x.shape[3] - rope_dims], x[..., : x.shape[3] - rope_dims])


def naive_rope(x: torch.Tensor, offsets: list[int], rope_dims: int, theta: float) -> torch.Tensor:
    """Plain same-precision RoPE: positions and angles in float32, cos/sin cast to x.dtype,
    every row rotated with its own positions, arithmetic in x.dtype."""
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
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@given(case=rope_case())
def test_low_precision_rope_is_within_twice_the_naive_error(dtype, case):
    x, offsets, rope_dims = case
    x = representable(x, dtype)
    got = port.apply_rope(to_port(x, dtype), torch.tensor(offsets, device=DEVICE), rope_dims, THETA)
    assert got.dtype == dtype
    naive = naive_rope(to_port(x, dtype), offsets, rope_dims, THETA)
    want = ref.apply_rope(x, offsets, rope_dims, THETA)
    assert_dtype_bound(got, naive, want, dtype, float(np.abs(x).max()), "apply_rope")


@pytest.mark.rule("DeepSeekV2RotaryEmbedding positions, port")
@given(case=rope_case())
def test_inverse_undoes_the_rotation(case):
    x, offsets, rope_dims = case
    t = to_port(x)
    back = port.apply_rope(
        port.apply_rope(t, offsets, rope_dims, THETA), offsets, rope_dims, THETA, inverse=True
    )
    assert_close64(back, x, what="inverse(rope(x))")


@pytest.mark.rule("uniform_seqlen_offset on the RoPE path, port")
@given(lens=uniform_lengths(1, 5, 0, 1100), ragged=corner_lengths(2, 5, 1100))
def test_a_uniform_batch_never_takes_the_gathered_path(lens, ragged):
    """The port's dispatch predicate: a uniform offset vector builds the `[1, T]` table
    (bit-identical to the gathered one, so only the counter can tell)."""
    x = torch.ones((len(lens), 1, 2, 4), dtype=torch.float64, device=DEVICE)
    port.reset_rope_path_stats()
    port.apply_rope(x, torch.tensor(lens, device=DEVICE), 4, THETA)
    assert port.rope_path_stats == {"uniform": 1, "gathered": 0}
    y = torch.ones((len(ragged), 1, 2, 4), dtype=torch.float64, device=DEVICE)
    port.apply_rope(y, torch.tensor(ragged, device=DEVICE), 4, THETA)
    assert port.rope_path_stats["gathered"] == (0 if len(set(ragged)) == 1 else 1)
    # and the two shapes agree bit for bit on a uniform batch
    wide = port.apply_rope(x, torch.tensor(lens, device=DEVICE), 4, THETA)
    table = port.RopeTable(4, THETA, lens[0] + 2, device=DEVICE)
    pos = torch.tensor(lens, device=DEVICE)[:, None] + torch.arange(2, device=DEVICE)
    c, s = table.lookup(pos)
    assert_bit_exact(port.rotate(x, c[:, None], s[:, None], 4), wide)



@pytest.mark.rule("DeepSeekV2RotaryEmbedding positions, port")
def test_bad_offsets_are_malformed_for_both():
    x = np.zeros((3, 1, 2, 4))
    for offsets in ([1, 2], [-1]):
        with pytest.raises(ValueError):
            ref.apply_rope(x, offsets, 4, THETA)
        with pytest.raises(ValueError):
            port.apply_rope(to_port(x), offsets, 4, THETA)


# --- boundaries, malformed input, dtypes and devices, stated from the inputs --------------


def _x(b=2, t=2, d=4, dtype=torch.float64):
    return torch.ones((b, 1, t, d), dtype=dtype, device=DEVICE)


# (case id, call, exact message): each case breaks exactly one condition
MALFORMED = [
    ("x 3-D", lambda: port.apply_rope(torch.ones(1, 2, 4), [0], 2, THETA),
     "x must be [B,H,T,D], got shape [1, 2, 4]"),
    ("rope_dims odd", lambda: port.apply_rope(_x(), [0], 3, THETA),
     "rope_dims 3 must be even, >= 2 and <= head dim 4"),
    ("rope_dims 0", lambda: port.apply_rope(_x(), [0], 0, THETA),
     "rope_dims 0 must be even, >= 2 and <= head dim 4"),
    ("rope_dims wide", lambda: port.apply_rope(_x(), [0], 6, THETA),
     "rope_dims 6 must be even, >= 2 and <= head dim 4"),
    ("offsets 2-D", lambda: port.apply_rope(_x(), torch.tensor([[0], [1]]), 2, THETA),
     "offsets must be a 1-D vector, got shape [2, 1]"),
    ("offsets count", lambda: port.apply_rope(_x(), [0, 1, 2], 2, THETA),
     "3 offsets for a batch of 2 (need 1 or B)"),
    ("host offset negative", lambda: port.apply_rope(_x(), [-1, 2], 2, THETA),
     "offsets [-1, 2] must be >= 0"),
    ("device offset negative", lambda: port.apply_rope(_x(), torch.tensor([-1, 2]), 2, THETA),
     "offsets [-1, 2] must be >= 0"),
    ("cos_sin rope_dims odd", lambda: port.rope_cos_sin([0], 3, THETA),
     "rope_dims 3 must be even and >= 2"),
    ("cos_sin rope_dims 0", lambda: port.rope_cos_sin([0], 0, THETA),
     "rope_dims 0 must be even and >= 2"),
    ("theta 0", lambda: port.rope_cos_sin([0], 2, 0), "theta 0 must be > 0"),
    ("position negative", lambda: port.rope_cos_sin([4, -3], 2, THETA),
     "positions must be >= 0, got min -3"),
    ("table size negative", lambda: port.RopeTable(2, THETA, -1), "n_positions -1 must be >= 0"),
    ("table past", lambda: port.RopeTable(2, THETA, 5).lookup(torch.tensor([1, 5])),
     "position 5 is past the table's 5 positions"),
]


@pytest.mark.rule("DeepSeekV2RotaryEmbedding positions, port")
@pytest.mark.parametrize("call, message", [c[1:] for c in MALFORMED], ids=[c[0] for c in MALFORMED])
def test_each_malformed_rope_input_is_a_value_error_with_its_message(call, message):
    with pytest.raises(ValueError) as err:
        call()
    assert str(err.value) == message


@pytest.mark.rule("DeepSeekV2RotaryEmbedding positions, port")
def test_the_boundary_values_are_accepted():
    """theta may lie in (0, 1]; a table may hold no positions; rope_dims 2 rotates pair 0 by
    the position itself (theta ** 0 = 1), so cos/sin are cos(p), sin(p)."""
    cos, sin = port.rope_cos_sin([0, 3], 2, 0.5)
    assert torch.allclose(cos[:, 0], torch.cos(torch.tensor([0.0, 3.0], dtype=torch.float64)))
    assert torch.allclose(sin[:, 0], torch.sin(torch.tensor([0.0, 3.0], dtype=torch.float64)))
    empty = port.RopeTable(4, THETA, 0)
    assert list(empty.cos.shape) == [0, 2]
    c, s = empty.lookup(torch.zeros(0, dtype=torch.int64))
    assert list(c.shape) == [0, 2] == list(s.shape)


@pytest.mark.rule("DeepSeekV2RotaryEmbedding positions, port")
def test_a_table_holds_exactly_its_positions_on_the_host_offset_path():
    """Host offsets [2, 4], T = 2: the largest position is 5, so a 6-position table serves
    the batch (equal to the computed rotation) and a 5-position table refuses it."""
    x = torch.arange(16, dtype=torch.float64).reshape(2, 1, 2, 4)
    want = port.apply_rope(x, [2, 4], 4, THETA)
    assert_bit_exact(port.apply_rope(x, [2, 4], 4, THETA, table=port.RopeTable(4, THETA, 6)),
                     want)
    with pytest.raises(ValueError) as err:
        port.apply_rope(x, [2, 4], 4, THETA, table=port.RopeTable(4, THETA, 5))
    assert str(err.value) == "position 5 is past the table's 5 positions"


@pytest.mark.rule("DeepSeekV2RotaryEmbedding positions, port")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_tables_are_in_their_dtype_and_every_rotation_in_the_input_dtype(dtype):
    cos, sin = port.rope_cos_sin([0, 7], 4, THETA, dtype)
    assert cos.dtype == sin.dtype == dtype
    table = port.RopeTable(4, THETA, 8, dtype)
    assert table.cos.dtype == table.sin.dtype == dtype
    x = _x(2, 2, 4, dtype)
    assert port.apply_rope(x, [1, 3], 4, THETA).dtype == dtype
    assert port.apply_rope(x, [1, 3], 4, THETA, table=port.RopeTable(4, THETA, 8)).dtype == dtype
    assert port.rotate(x, *port.rope_cos_sin([[0, 1]], 4, THETA), 4).dtype == dtype


@pytest.mark.rule("DeepSeekV2RotaryEmbedding positions, port")
def test_tables_and_positions_are_made_on_the_requested_device():
    """The meta device exists on every machine: what a function builds for `device="meta"`
    must be there (a CPU run cannot tell a dropped device argument otherwise)."""
    cos, sin = port.rope_cos_sin([], 4, THETA, device="meta")
    assert cos.device.type == sin.device.type == "meta"
    table = port.RopeTable(4, THETA, 0, device="meta")
    assert table.cos.device.type == table.sin.device.type == "meta"


@pytest.mark.rule("uniform_seqlen_offset on the RoPE path, port")
def test_host_offsets_pick_the_table_shape_and_count_every_call():
    x = _x(2)
    port.reset_rope_path_stats()
    port.apply_rope(x, [5, 5], 2, THETA)
    port.apply_rope(x, [5, 5], 2, THETA)
    assert port.rope_path_stats == {"uniform": 2, "gathered": 0}
    ragged = port.apply_rope(torch.arange(16, dtype=torch.float64).reshape(2, 1, 2, 4),
                             [5, 6], 4, THETA)
    port.apply_rope(x, [5, 6], 2, THETA)
    assert port.rope_path_stats == {"uniform": 2, "gathered": 2}
    want = ref.apply_rope(np.arange(16, dtype=np.float64).reshape(2, 1, 2, 4), [5, 6], 4, THETA)
    assert_close64(ragged, want, what="ragged host offsets")


