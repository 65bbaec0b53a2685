"""Comparison helpers for reference-vs-port conformance (in the spirit of
`cupy.testing.numpy_cupy_allclose`): one policy, stated once (DESIGN.md "Comparison
policy"), used by every port test (`conformance/test_port_*.py`, and the topic files whose
test bodies run on both implementations).

- `assert_bit_exact`: data movement, integers, masks, positions: equal shapes, equal values
  bit for bit (-inf == -inf), compared in float64/int64 on the host.
- `assert_close64`: float64 arithmetic: `max|port - ref| <= rtol * max|ref|` (default
  rtol 1e-12: float64 rounding, summation order and libm-vs-vectorized transcendental
  differences are ~1e-16 relative per op; 1e-12 leaves room for a few thousand ops and
  still fails on any real defect, which is O(1e-3) or larger). Exact zeros must stay zero.
- `assert_dtype_bound`: float32 / bfloat16 ports: `max|port - ref64| <= 2 * max|naive -
  ref64| + floor`, the FlashAttention test rule, where `naive` is a plain same-precision
  implementation written in the test and `ref64` the float64 reference evaluated on the
  same (dtype-rounded) inputs. The floor is the noise of one final rounding at the output
  scale: `4 * eps(dtype) * scale`, `scale` a bound on the output magnitude given by the
  test (e.g. `max|v|` for attention, `max|x|` for RoPE), so a port that differs from a
  lucky naive run by a few ulps still passes and any real defect fails.
- `outcome`: run a call and return `("ok", value)` or `("refused", class, message)` so a
  test can require "refused by both or neither (same class, same message)".
"""

from __future__ import annotations

import os

import numpy as np
import torch

from raggedspec.gpu._common import env_device
from raggedspec.reference.errors import Refusal

DEVICE = env_device()

# Conformance tensors are tiny: intra-op parallelism only adds OpenMP spin-waits, which on a
# loaded 2-core box made one small attention call take ~60 ms instead of ~0.5 ms. One
# thread unless RAGGEDSPEC_TORCH_THREADS says otherwise.
torch.set_num_threads(int(os.environ.get("RAGGEDSPEC_TORCH_THREADS", "1")))
FLOAT_DTYPES = (torch.float64, torch.float32, torch.bfloat16)


def host(x) -> np.ndarray:
    """A tensor or array as a float64/int64 host array (bool kept)."""
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu()
        if x.is_floating_point():
            x = x.to(torch.float64)
        return x.numpy()
    return np.asarray(x)


def to_port(
    a, dtype: torch.dtype | None = None, device: torch.device | None = None
) -> torch.Tensor:
    """A NumPy array on the port's device (float arrays cast to `dtype`, default float64)."""
    a = np.asarray(a)
    t = torch.from_numpy(np.ascontiguousarray(a))
    if t.is_floating_point():
        t = t.to(dtype or torch.float64)
    return t.to(device or DEVICE)


def representable(a: np.ndarray, dtype: torch.dtype) -> np.ndarray:
    """`a` rounded to `dtype` and back to float64: inputs both sides can hold exactly."""
    return torch.from_numpy(np.asarray(a, dtype=np.float64)).to(dtype).to(torch.float64).numpy()


def assert_bit_exact(port, ref, what: str = "") -> None:
    p, r = host(port), host(ref)
    assert p.shape == r.shape, f"{what}: shape {p.shape} != reference {r.shape}"
    assert np.array_equal(p, r), (
        f"{what}: port differs from reference at {np.argwhere(p != r)[:5].tolist()}"
    )


def assert_close64(port, ref, rtol: float = 1e-12, what: str = "") -> None:
    p, r = host(port), host(ref)
    assert p.shape == r.shape, f"{what}: shape {p.shape} != reference {r.shape}"
    assert np.isfinite(p).all() == np.isfinite(r).all(), f"{what}: non-finite values differ"
    scale = float(np.abs(r).max()) if r.size else 0.0
    err = float(np.abs(p - r).max()) if r.size else 0.0
    assert err <= rtol * scale, f"{what}: max error {err:.3e} > {rtol:g} * scale {scale:.3e}"


def dtype_floor(dtype: torch.dtype, scale: float) -> float:
    return 4.0 * torch.finfo(dtype).eps * scale


def assert_dtype_bound(
    port, naive, ref64, dtype: torch.dtype, scale: float, what: str = ""
) -> None:
    p, n, r = host(port), host(naive), host(ref64)
    assert p.shape == r.shape == n.shape, f"{what}: shapes {p.shape}, {n.shape}, {r.shape}"
    if not r.size:
        return
    port_err = float(np.abs(p - r).max())
    naive_err = float(np.abs(n - r).max())
    bound = 2.0 * naive_err + dtype_floor(dtype, scale)
    assert port_err <= bound, (f"{what}: {dtype} port error {port_err:.3e} > 2 * naive error "
                               f"{naive_err:.3e} + floor {dtype_floor(dtype, scale):.3e}")


def outcome(fn, *args, **kwargs):
    """`("ok", value)` or `("refused", class, message)`; other exceptions propagate."""
    try:
        return ("ok", fn(*args, **kwargs))
    except Refusal as exc:
        return ("refused", type(exc), str(exc))


def assert_same_refusal(port_out, ref_out, what: str = "") -> bool:
    """Both refused (same class, same message) or neither; returns True when neither."""
    assert port_out[0] == ref_out[0], f"{what}: port {port_out[:3]} but reference {ref_out[:3]}"
    if port_out[0] == "refused":
        assert port_out[1] is ref_out[1], f"{what}: {port_out[1].__name__} != {ref_out[1].__name__}"
        assert port_out[2] == ref_out[2], f"{what}: message {port_out[2]!r} != {ref_out[2]!r}"
        return False
    return True
