"""The tensor-core verify kernel (`rs_verify_attention_tc` in gpu/kernels.cu) against the
reference, every rule, on Hypothesis-generated ragged batches (its builds are
test_kernel_build.py's).

- Runners: the g++ emulator (warps, mma fragments, deferred cp.async: gpu/kernel_emulator.py)
  everywhere, CuPy where there is a GPU.
- Oracle: `reference.attention.dsv4_attention` in float64 on the bf16 values the kernel is
  given, per KV head, on the front-aligned batch (each query row's own KV row). Tolerance:
  P is rounded to bf16 before P V and the output once more, each a relative 2^-9, against
  the largest live value: `2^-6 * max|v|` (a wrong mask, a stale stage or a wrong fragment
  is off by O(max|v|); a read slack column by 1e6).
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import raggedspec.gpu.cupy_kernels as ck
import raggedspec.reference.attention as ratt
from raggedspec.conformance.helpers import (
    KERNEL_MODES,
    bf16,
    bf16_values,
    from_kern,
    kernels,
    to_kern,
)
from raggedspec.gpu import kernel_emulator

SOME = settings(max_examples=max(5, settings.default.max_examples // 40), deadline=None)
THOROUGH = os.environ.get("HYPOTHESIS_PROFILE") == "thorough"


@pytest.fixture(params=KERNEL_MODES, scope="module")
def kern(request) -> ck.Kernels:
    return kernels(request.param)


def reference(q, k_place, v_place, comp, own, picked, t_q, ratio, window, sinks) -> np.ndarray:
    """dsv4_attention per KV head on the front-aligned batch of the picked KV rows."""
    g_rows, h = q.shape[0], q.shape[1]
    hk, d = k_place.shape[1], k_place.shape[3]
    group = h // hk
    lens = [own[i] for i in picked]
    top = max(lens)
    out = np.empty(q.shape)
    cfg = ratt.Dsv4AttentionConfig(ratio, window, 0, [n - t_q for n in lens])
    for j in range(hk):
        kf, vf = np.zeros((g_rows, 1, top, d)), np.zeros((g_rows, 1, top, d))
        for g, i in enumerate(picked):
            kf[g, 0, top - own[i] :], vf[g, 0, top - own[i] :] = (
                k_place[i, j, : own[i]],
                v_place[i, j, : own[i]],
            )
        sub = None if comp is None else comp[picked][:, j : j + 1, : top // ratio]
        heads = slice(j * group, (j + 1) * group)
        out[:, heads] = ratt.dsv4_attention(
            q[:, heads], kf, vf, sub, None, cfg, None if sinks is None else sinks[heads]
        )
    return out


@st.composite
def tc_cases(draw):
    if THOROUGH:  # every combination (each a build of its own)
        t_q, (hk, group) = (
            draw(st.integers(1, 4)),
            draw(st.sampled_from([(1, 1), (1, 4), (2, 2), (2, 4), (1, 3)])),
        )
        d = draw(st.sampled_from([16, 32, 64]))
    else:  # a few builds: the default suite stays short
        t_q, hk, group = draw(
            st.sampled_from([(1, 1, 1), (2, 1, 4), (3, 2, 2), (4, 2, 4), (1, 1, 3)])
        )
        d = draw(st.sampled_from([16, 32]))
    own = [n + t_q for n in draw(st.lists(st.integers(0, 170), min_size=1, max_size=3))]
    ratio = draw(st.sampled_from([0, 4, 16]))
    window = draw(st.sampled_from([1, 4, 63, 64, 100, 4096]))
    return dict(t_q=t_q, hk=hk, group=group, d=d, own=own, ratio=ratio, window=window,
                sinks=draw(st.booleans()), subset=draw(st.booleans()),
                n_split=draw(st.sampled_from([None, 1, 2, 3])), seed=draw(st.integers(0, 2**16)))


def run_case(kern, c: dict, warps: int | None = None, stages: int | None = None):
    """(got, want, max|v|) for one case through `Kernels.dsv4_attention_rows` forced onto the
    tensor-core path."""
    rng = np.random.default_rng(c["seed"])
    own, t_q, hk, d, ratio = c["own"], c["t_q"], c["hk"], c["d"], c["ratio"]
    b, h = len(own), hk * c["group"]
    cap = max(own) + 5
    k_bits, k_place = bf16(rng.normal(size=(b, hk, cap, d)) * 2)
    v_bits, v_place = bf16(rng.normal(size=(b, hk, cap, d)) * 2)
    for i, n in enumerate(own):  # slack: loud if ever read
        k_bits[i, :, n:], v_bits[i, :, n:] = (
            ck.bf16_bits(np.full((1,), 40.0)),
            ck.bf16_bits(np.full((1,), 1e6)),
        )
    t_c = max(own) // ratio if ratio > 1 else 0
    c_bits, comp = bf16(rng.normal(size=(b, hk, t_c, d))) if t_c else (None, None)
    rows = (
        [int(r) for r in rng.permutation(b)[: int(rng.integers(1, b + 1))]]
        if c["subset"] and ratio <= 1
        else None
    )
    picked = list(range(b)) if rows is None else rows
    q_bits, q = bf16(rng.normal(size=(len(picked), h, t_q, d)))
    s_bits, sinks = bf16(rng.normal(size=h)) if c["sinks"] else (None, None)
    want = reference(q, k_place, v_place, comp, own, picked, t_q, ratio, c["window"], sinks)
    saved = kern.tc_warps, kern.tc_stages
    kern.tc_warps, kern.tc_stages = warps or saved[0], stages or saved[1]
    try:
        out = kern.dsv4_attention_rows(
            to_kern(kern, q_bits),
            to_kern(kern, k_bits),
            to_kern(kern, v_bits),
            own,
            rows,
            None if c_bits is None else to_kern(kern, c_bits),
            ratio,
            c["window"],
            None if s_bits is None else to_kern(kern, s_bits),
            n_split=c["n_split"],
            path="tc",
        )
    finally:
        kern.tc_warps, kern.tc_stages = saved
    got = bf16_values(from_kern(kern, out)).astype(np.float64)
    live = max(np.abs(v_place[i, :, :n]).max() for i, n in enumerate(own))
    if comp is not None:
        live = max(live, np.abs(comp).max())
    return got, want, live


@pytest.mark.slow
@pytest.mark.rule("ragged verify attention kernel, tensor cores")
@SOME
@given(case=tc_cases())
def test_the_tensor_core_kernel_equals_the_reference_on_ragged_batches(kern, case):
    """Causal verify window, sliding window, compressed blocks, sinks, GQA, query rows naming
    KV rows, several splits and pipeline stages; slack columns never read."""
    got, want, live = run_case(kern, case)
    assert np.isfinite(got).all(), case
    assert np.max(np.abs(got - want)) <= 2.0**-6 * live, (case, float(np.max(np.abs(got - want))))


@pytest.mark.slow
@pytest.mark.rule("ragged verify attention kernel, tensor cores")
@pytest.mark.parametrize(("warps", "stages"), [(1, 2), (2, 4)])
def test_every_warp_count_and_pipeline_depth_gives_the_same_rules(kern, warps, stages):
    """A row of 260 keys (five 64-key stages, a partial last one), a window that cuts inside
    the second stage, compressed blocks and sinks, on builds other than the default 4 warps x
    3 stages (which every other test here runs)."""
    case = dict(t_q=3, hk=2, group=2, d=32, own=[260, 70], ratio=4, window=100, sinks=True,
                subset=False, n_split=1, seed=11)
    got, want, live = run_case(kern, case, warps, stages)
    assert np.max(np.abs(got - want)) <= 2.0**-6 * live


@pytest.mark.slow
@pytest.mark.rule("ragged verify attention kernel, tensor cores")
def test_the_largest_query_block_runs_on_tensor_cores(kern):
    """64 queries per KV head (GQA 16 x w = 4) at head dim 16: the warps' accumulators outgrow
    the K/V stages they reuse, so the shared-memory region grows (a build the others share)."""
    case = dict(t_q=4, hk=1, group=16, d=16, own=[70, 20], ratio=0, window=4096, sinks=False,
                subset=False, n_split=None, seed=3)
    assert kern.tc_fits(64, 16, "bfloat16")
    got, want, live = run_case(kern, case)
    assert np.max(np.abs(got - want)) <= 2.0**-6 * live


@pytest.mark.rule("ragged verify attention kernel, tensor cores")
def test_the_bench_shape_takes_the_tensor_core_path_and_matches(kern, monkeypatch):
    """G * w = 8 queries of head dim 128 (the bench's w = 2 at GQA 4) route to tensor cores by
    default (the launch names it) and equal the reference over two 64-key stages."""
    names = []
    real = ck.Kernels._launch
    monkeypatch.setattr(
        ck.Kernels,
        "_launch",
        lambda self, name, *a, **k: (names.append(name), real(self, name, *a, **k))[1],
    )
    rng = np.random.default_rng(4)
    own, w, d = [130, 40], 2, 128
    q_bits, q = bf16(rng.normal(size=(2, 4, w, d)))
    k_bits, k = bf16(rng.normal(size=(2, 1, 136, d)))
    v_bits, v = bf16(rng.normal(size=(2, 1, 136, d)))
    out = kern.verify_attention(*(to_kern(kern, a) for a in (q_bits, k_bits, v_bits)), own)
    assert names == ["rs_verify_attention_tc", "rs_verify_attention_combine"]
    want = reference(q, k, v, None, own, [0, 1], w, 0, 136 + w, None)
    got = bf16_values(from_kern(kern, out)).astype(np.float64)
    assert np.max(np.abs(got - want)) <= 2.0**-6 * np.abs(v).max()


class DeviceInts(np.ndarray):
    """Integers that may not be read on the host: any comparison, reduction, truth value or
    conversion raises (what a device array costs: a device->host copy and a sync)."""

    def _read(self, *a, **k):
        raise AssertionError("a device->host read of lens/rows")

    __bool__ = __int__ = __index__ = __float__ = __iter__ = _read
    __lt__ = __le__ = __gt__ = __ge__ = __eq__ = __ne__ = _read
    tolist = item = any = all = max = min = __getitem__ = _read


@pytest.mark.slow
@pytest.mark.rule("ragged verify attention kernel, tensor cores")
def test_device_lengths_are_never_read_back_and_bad_ones_give_nan_rows():
    """Lengths and rows as device arrays: the wrapper reads neither (only their sizes), and a
    row the host could not check (shorter than w) comes back NaN while the others are right."""
    if kernel_emulator.compilers()["g++"] is None:
        pytest.skip("the kernel emulator needs g++ on the PATH")
    kern = ck.Kernels("emulate")
    host = kern._host_ints
    kern._host_ints = lambda x: None if isinstance(x, DeviceInts) else host(x)
    rng = np.random.default_rng(2)
    w, d = 2, 16
    q_bits, q = bf16(rng.normal(size=(3, 2, w, d)))
    k_bits, k = bf16(rng.normal(size=(3, 1, 90, d)))
    v_bits, v = bf16(rng.normal(size=(3, 1, 90, d)))
    lens = np.array([90, 1, 33], dtype=np.int64).view(DeviceInts)
    rows = np.arange(3, dtype=np.int64).view(DeviceInts)
    got = bf16_values(kern.verify_attention(q_bits, k_bits, v_bits, lens, rows=rows)).astype(
        np.float64
    )
    assert np.isnan(got[1]).all()
    for i, n in ((0, 90), (2, 33)):
        want = reference(
            q[i : i + 1], k[i : i + 1], v[i : i + 1], None, [n], [0], w, 0, 90 + w, None
        )
        assert np.max(np.abs(got[i] - want[0])) <= 2.0**-6 * np.abs(v).max()


@pytest.mark.rule("ragged verify attention kernel, tensor cores")
def test_the_split_count_fills_whole_waves_from_host_sizes():
    kern = ck.Kernels.__new__(ck.Kernels)
    kern.sm_count = 132
    assert kern.n_split(128, 8, 4096, 64, per_sm=2) == 1  # 1024 blocks: 3.9 waves of 264, 97% full
    assert kern.n_split(16, 8, 4096, 64, per_sm=2) == 2  # 256 of 264
    assert (
        kern.n_split(1, 8, 4096, 64, per_sm=2) == 32
    )  # 256 of 264; 33 would be 100%, 32 is enough
    assert kern.n_split(1, 8, 200, 64, per_sm=2) == 4  # never more splits than tiles
    assert kern.n_split(3, 1, 64, 64) == 1
