"""Helpers shared by the conformance tests (one module, so no test file copies another's).

Hypothesis strategies live in `conformance/strategies.py`; the backend under test and the
comparison policy in `conformance/backends.py`; everything else two or more test files need is
here, in one section per topic.
"""

from __future__ import annotations


# --- KV cache, alignment and batch assembly, XsRolling, paged KV, kernels ----------------------

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from raggedspec.gpu.slots import stack_xs, xs_rows  # noqa: E402
from raggedspec.gpu.testing import assert_bit_exact, assert_close64, host, to_port  # noqa: E402
from raggedspec.gpu.xs_rolling import XsRolling as PortXs  # noqa: E402
from raggedspec.reference.xs_rolling import XsRolling as RefXs  # noqa: E402


def xs_state(slot) -> tuple[list[int], list[int], list[np.ndarray], list[np.ndarray]]:
    """`(tokens, base, history, comp)` of a reference or port XsRolling slot, read through
    the rows it reports (`row_history`, `row_comp`) as float64 host arrays."""
    tokens, base = host(slot.tokens).tolist(), host(slot.base).tolist()
    rows = range(len(tokens))
    return (tokens, base, [host(slot.row_history(i)) for i in rows],
            [host(slot.row_comp(i)) for i in rows])


def assert_same_xs(port, ref, what: str = "") -> None:
    """A port XsRolling slot holds the reference's state: tokens, base and width equal, each
    row's retained history bit for bit, its compressed rows within 1e-12 (float64 means)."""
    p, r = xs_state(port), xs_state(ref)
    assert p[:2] == r[:2], f"{what}: tokens, base {p[:2]} != {r[:2]}"
    assert port.dim == ref.dim, f"{what}: width {port.dim} != {ref.dim}"
    for i, (ph, rh, pc, rc) in enumerate(zip(p[2], r[2], p[3], r[3], strict=True)):
        assert_bit_exact(ph, rh, f"{what}: row {i} history")
        assert_close64(pc, rc, what=f"{what}: row {i} comp")


def scratch_blocks(h: np.ndarray, ratio: int) -> np.ndarray:
    """From-scratch compression of hidden rows `h [T, D]`: block g = the mean of rows
    `[g*ratio, (g+1)*ratio)`, by loop (an oracle independent of any reshape)."""
    out = [sum(h[g * ratio + j] for j in range(ratio)) / ratio for g in range(len(h) // ratio)]
    return np.array(out).reshape(len(out), h.shape[1]) if out else np.zeros((0, h.shape[1]))


def xs_filled(impl, ratio, n, **kw):
    """A one-row XsRolling slot of `impl` fed `n` distinct hidden rows of width 3 (token t
    holds `3t, 3t + 1, 3t + 2`)."""
    xs = impl.new(ratio, **kw)
    xs.append_rows(impl.x(np.arange(n * 3, dtype=np.float64).reshape(1, n, 3)))
    return xs


def xs_fed(impl, n, ratio=4, **kw):
    """A one-row XsRolling slot of `impl` fed tokens 1..n of width 3 (token t holds
    `t + 0.25 * feature`)."""
    xs = impl.new(ratio, **kw)
    if n:
        xs.append_rows(impl.x((np.arange(1, n + 1)[:, None] + 0.25 * np.arange(3))[None]))
    return xs


class XsImpl:
    """One implementation of the XsRolling slot, so one test body runs over both: `new` builds
    a slot (the classes share their constructor), `x` turns a float64 host array into what its
    `append_rows` takes, `stack` and `split` are its batch assembly (the reference's
    `XsRolling.stack` / `split_rows`; the port's `gpu.slots.stack_xs` / `xs_rows`), `kv` a K/V
    slot of the same implementation for rollbacks that move every slot together."""

    def __init__(self, name: str, cls, x, stack, split, kv) -> None:
        self.name, self.new, self.x = name, cls, x
        self.stack, self.split, self.kv = stack, split, kv

    def __repr__(self) -> str:
        return self.name


def _ref_kv(max_seq_len: int):
    from raggedspec.reference.cache import KvCache

    slot = KvCache.new_normal(max_seq_len)
    return slot, lambda block: slot.append(block, block)


def _port_kv(max_seq_len: int):
    from raggedspec.gpu.slots import TorchKv

    slot = TorchKv(max_seq_len)
    return slot, lambda block: slot.append(to_port(block), to_port(block))


XS_IMPLS = (
    XsImpl("reference", RefXs, np.asarray, RefXs.stack, lambda s: s.split_rows(), _ref_kv),
    XsImpl("port", PortXs, to_port, stack_xs, lambda s: [stack_xs([h]) for h in xs_rows(s)],
           _port_kv),
)
over_xs = pytest.mark.parametrize("impl", XS_IMPLS, ids=repr)
"""Run a test body once per XsRolling implementation (its argument `impl`)."""


def bf16_values(bits: np.ndarray) -> np.ndarray:
    """bfloat16 bits (uint16/int16, how the kernels take and give bfloat16) as float32."""
    return (np.asarray(bits).view(np.uint16).astype(np.uint32) << 16).view(np.float32)


def bf16(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """`x` rounded to bfloat16: `(bits for a kernel, the same values in float64)`."""
    from raggedspec.gpu.cupy_kernels import bf16_bits

    bits = bf16_bits(x)
    return bits, bf16_values(bits).astype(np.float64)



def _ref_kv_slot(length: int, mark: float, extra: int, max_seq_len: int, h: int, d: int):
    from raggedspec.reference.cache import KvCache

    slot = KvCache.new_normal(max_seq_len)
    slot.append(*_marked(length + extra, mark, h, d))
    slot.set_len(length)
    return slot


def _port_kv_slot(length: int, mark: float, extra: int, max_seq_len: int, h: int, d: int):
    from raggedspec.gpu.slots import TorchKv

    slot = TorchKv(max_seq_len)
    slot.append(*(to_port(x) for x in _marked(length + extra, mark, h, d)))
    slot.set_len(length)
    return slot


def _marked(n: int, mark: float, h: int, d: int) -> tuple[np.ndarray, np.ndarray]:
    """K `[1, h, n, d]` whose column j holds `mark + j`, and V holding `mark + 0.5 + j`."""
    k = np.broadcast_to(np.arange(n, dtype=np.float64)[None, None, :, None] + mark, (1, h, n, d))
    return k.copy(), k + 0.5


def _xs_slot(cls, x):
    def make(tokens: int):
        xs = cls(4, window=32)
        if tokens:
            xs.append_rows(x(np.arange(tokens, dtype=np.float64).reshape(1, tokens, 1)))
        return xs
    return make


class KvImpl:
    """One implementation of the K/V slot under the alignment rules (`reference.align` runs on
    both), so one test body runs over both: `slot(length, mark, extra=0, max_seq_len=4096,
    h=1, d=1)` appends `length + extra` columns (column j holds `mark + j` in K, `mark + 0.5 +
    j` in V) and sets the length back to `length` (stale columns beyond); `xs(tokens)` an
    XsRolling slot (ratio 4, window 32) fed `tokens` rows; `k` / `v` a slot's front-aligned
    K / V `[B, H, current, D]` on the host; `held` what the slot holds (equal when nothing
    moved); `stack_layer` its clone-in assembly (None: the reference's own); `empty(max_seq_len,
    capacity)` an empty slot and `put(slot, k, v)` an append of host arrays."""

    def __init__(self, name: str, slot, xs, k, v, held, stack_layer, empty, put) -> None:
        self.name, self.make, self.xs, self.k, self.v = name, slot, xs, k, v
        self.held, self.stack_layer, self.empty, self.put = held, stack_layer, empty, put

    def slot(self, length: int, mark: float, extra: int = 0, max_seq_len: int = 4096,
             h: int = 1, d: int = 1):
        return self.make(length, mark, extra, max_seq_len, h, d)

    def __repr__(self) -> str:
        return self.name


def _ref_empty(max_seq_len: int, capacity: int):
    from raggedspec.reference.cache import KvCache

    return KvCache.new_normal(max_seq_len, capacity)


def _port_empty(max_seq_len: int, capacity: int):
    from raggedspec.gpu.slots import TorchKv

    return TorchKv(max_seq_len, capacity)


def _port_front(i: int):
    return lambda slot: host(slot.front_aligned()[i])


def _port_stack_layer(slots, layer, xs_per_seq):
    from raggedspec.gpu.slots import stack_layer

    return stack_layer(slots, layer, xs_per_seq)


KV_IMPLS = (
    KvImpl("reference", _ref_kv_slot, _xs_slot(RefXs, np.asarray),
           lambda s: s.k.current_data(), lambda s: s.v.current_data(),
           lambda s: (s.k.data, s.v.data, s.current_seq_len, s.k.capacity_seq_len), None,
           lambda m, c: _ref_empty(m, c), lambda s, k, v: s.append(k, v)),
    KvImpl("port", _port_kv_slot, _xs_slot(PortXs, to_port), _port_front(0), _port_front(1),
           lambda s: (s.kv, None if s.lead is None else s.lead.tolist(), s.current, s.capacity),
           _port_stack_layer, lambda m, c: _port_empty(m, c),
           lambda s, k, v: s.append(to_port(k), to_port(v))),
)
over_kv = pytest.mark.parametrize("impl", KV_IMPLS, ids=repr)
"""Run a test body once per K/V slot implementation (its argument `impl`)."""

REF_KV = KV_IMPLS[0]


def seq(lengths, mark: float = 0, impl: KvImpl = REF_KV, **kw):
    """A NormalCache of one K/V slot per entry of `lengths` (`impl.slot`, marked
    `mark + 10_000 * layer`)."""
    from raggedspec.reference.cache import NormalCache

    return NormalCache([impl.slot(n, mark + 10_000 * layer, **kw)
                        for layer, n in enumerate(lengths)])


def k_row(slot, n: int | None = None) -> list[float]:
    """A reference K/V slot's K buffer, row 0, head 0, feature 0: the first `n` (default
    current) columns."""
    n = slot.current_seq_len if n is None else n
    return list(slot.k.data[0, 0, :n, 0])


def draft_slot(live: int, cap: int, mark: float):
    """§17.1: a reference Normal slot, K `[1,1,cap,1]` holding `mark + i`, V `mark + 1000 +
    i`, `live` positions, max_seq_len 4096."""
    from raggedspec.reference.cache import KvCache, SingleCache

    k = np.arange(cap, dtype=np.float64).reshape(1, 1, cap, 1) + mark
    return KvCache(SingleCache(4096, cap, live, 0, None, k.copy()),
                   SingleCache(4096, cap, live, 0, None, k + 1000))


def _kernel_modes() -> list:
    from raggedspec.gpu import kernel_emulator
    from raggedspec.gpu.cupy_kernels import cupy_unavailable

    why = cupy_unavailable()
    return [
        pytest.param("emulate", marks=pytest.mark.skipif(
            kernel_emulator.compilers()["g++"] is None,
            reason="the kernel emulator needs g++ on the PATH")),
        pytest.param("cupy", marks=pytest.mark.skipif(
            why is not None, reason=f"CuPy needs a CUDA GPU: {why}")),
    ]


KERNEL_MODES = _kernel_modes()
"""The kernels' two runners: `emulate` (g++, every machine with it) and `cupy` (a CUDA GPU);
each skipped, with the reason, where it cannot run."""
_RUNNERS: dict = {}


def kernels(mode: str):
    """One `gpu.cupy_kernels.Kernels(mode)` per session (its builds are cached with it)."""
    from raggedspec.gpu.cupy_kernels import Kernels

    if mode not in _RUNNERS:
        _RUNNERS[mode] = Kernels(mode)
    return _RUNNERS[mode]


def to_kern(kern, a):
    """A host array as the runner's array (a CuPy array, or NumPy under the emulator)."""
    return kern.xp.asarray(np.ascontiguousarray(a))


def from_kern(kern, a) -> np.ndarray:
    return a.get() if kern.mode == "cupy" else np.asarray(a)
