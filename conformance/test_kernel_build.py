"""What the kernels are built and emulated with: the builds of gpu/kernels.cu for sm_90 (nvcc's
front end at the benchmark's sizes; NVRTC for every variant the launcher asks for, with no
spill and, for the tensor-core kernel, its instructions in the SASS; each skipped with the
reason where the compiler is absent), and the kernel emulator's warp-level semantics
(gpu/kernel_emulator.py) against the PTX ISA.

The tensor-core kernel is only as trustworthy on the CPU as the emulated primitives it calls,
so each is pinned here by a small test kernel built with the emulator's prelude:
- `mma.sync.m16n8k16` (bf16 in, float accumulate): fragments gathered from global memory by
  the PTX ISA's lane -> (row, column) layout, the product against a plain matmul;
- `ldmatrix` (.x4, .x2, .x4.trans): each lane's registers against the documented layout, the
  rows read at the addresses the lanes gave;
- the kernel's own operand pattern (K and Q^T, V^T and P^T through ldmatrix, then mma) on
  random tiles against a plain matmul;
- `__shfl_xor_sync` within each warp of a two-warp block;
- `cp.async`: nothing lands before its `wait_group`, `wait_group N` leaves the N newest
  groups pending, uncommitted copies are not waited for, short sources are zero-filled.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import raggedspec.gpu.cupy_kernels as ck
from raggedspec import kernel_check
from raggedspec.conformance.helpers import bf16
from raggedspec.gpu import kernel_emulator as emu

NO_GXX = pytest.mark.skipif(
    emu.compilers()["g++"] is None, reason="the kernel emulator needs g++ on the PATH"
)

SOURCE = r"""
typedef unsigned short rs_bf16;
static inline unsigned pack(unsigned short lo, unsigned short hi) {
    return (unsigned)lo | ((unsigned)hi << 16);
}

// a [16][16], b [16][8] (k x n), c and d [16][8]; fragments placed by the PTX ISA's layout
// (groupID g = lane / 4, threadID_in_group t = lane % 4), written from the lane's side
extern "C" __global__ void t_mma(const rs_bf16* a, const rs_bf16* b, const float* c, float* d) {
    const int lane = threadIdx.x, g = lane >> 2, t = lane & 3;
    unsigned af[4] = {pack(a[g * 16 + 2 * t], a[g * 16 + 2 * t + 1]),
                      pack(a[(g + 8) * 16 + 2 * t], a[(g + 8) * 16 + 2 * t + 1]),
                      pack(a[g * 16 + 2 * t + 8], a[g * 16 + 2 * t + 9]),
                      pack(a[(g + 8) * 16 + 2 * t + 8], a[(g + 8) * 16 + 2 * t + 9])};
    unsigned bf[2] = {pack(b[(2 * t) * 8 + g], b[(2 * t + 1) * 8 + g]),
                      pack(b[(2 * t + 8) * 8 + g], b[(2 * t + 9) * 8 + g])};
    float df[4] = {c[g * 8 + 2 * t], c[g * 8 + 2 * t + 1],
                   c[(g + 8) * 8 + 2 * t], c[(g + 8) * 8 + 2 * t + 1]};
    rs_mma_bf16(df, af, bf);
    d[g * 8 + 2 * t] = df[0];
    d[g * 8 + 2 * t + 1] = df[1];
    d[(g + 8) * 8 + 2 * t] = df[2];
    d[(g + 8) * 8 + 2 * t + 1] = df[3];
}

// m: 32 rows of 8 bf16; lane l names row sel[l] as its ldmatrix row address
extern "C" __global__ void t_ldmatrix(const rs_bf16* m, const int* sel, unsigned* x4, unsigned* x4t,
                                      unsigned* x2) {
    __shared__ rs_bf16 sm[32 * 8];
    const int lane = threadIdx.x;
    for (int i = 0; i < 8; ++i) sm[lane * 8 + i] = m[lane * 8 + i];
    __syncwarp();
    unsigned r4[4], r4t[4], r2[2];
    rs_ldmatrix_x4(r4, sm + sel[lane] * 8);
    rs_ldmatrix_x4_trans(r4t, sm + sel[lane] * 8);
    rs_ldmatrix_x2(r2, sm + sel[lane] * 8);
    for (int i = 0; i < 4; ++i) {
        x4[lane * 4 + i] = r4[i];
        x4t[lane * 4 + i] = r4t[i];
    }
    x2[lane * 2] = r2[0];
    x2[lane * 2 + 1] = r2[1];
}

// The verify kernel's operand pattern on one warp: S^T = K Q^T with K [16 keys][16 dims] and
// Q [8 queries][16 dims] row-major in shared memory, then O^T = V^T P^T with V [16 keys][16
// dims] (ldmatrix.trans) and P [8 queries][16 keys] (its rows as P^T's columns)
extern "C" __global__ void t_tile(const rs_bf16* k, const rs_bf16* q, const rs_bf16* v,
                                  const rs_bf16* p,
                                  float* s_out, float* o_out) {
    __shared__ rs_bf16 ks[16 * 16], qs[8 * 16], vs[16 * 16], ps[8 * 16];
    const int lane = threadIdx.x, g = lane >> 2, t = lane & 3;
    for (int i = lane; i < 256; i += 32) { ks[i] = k[i]; vs[i] = v[i]; }
    for (int i = lane; i < 128; i += 32) { qs[i] = q[i]; ps[i] = p[i]; }
    __syncwarp();
    unsigned a[4], b[2];
    float s[4] = {0.f, 0.f, 0.f, 0.f}, o[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
    rs_ldmatrix_x4(a, ks + ((lane & 7) + ((lane >> 3) & 1) * 8) * 16 + (lane >> 4) * 8);
    rs_ldmatrix_x2(b, qs + (lane & 7) * 16 + ((lane >> 3) & 1) * 8);
    rs_mma_bf16(s, a, b);
    rs_ldmatrix_x2(b, ps + (lane & 7) * 16 + ((lane >> 3) & 1) * 8);
    for (int mt = 0; mt < 1; ++mt) {
        rs_ldmatrix_x4_trans(a, vs + ((lane & 7) + (lane >> 4) * 8) * 16 + ((lane >> 3) & 1) * 8);
        rs_mma_bf16(o[mt], a, b);
    }
    for (int i = 0; i < 4; ++i) {
        s_out[(g + (i >> 1) * 8) * 8 + 2 * t + (i & 1)] = s[i];
        o_out[(g + (i >> 1) * 8) * 8 + 2 * t + (i & 1)] = o[0][i];
    }
}

extern "C" __global__ void t_shfl(const float* x, float* out, int mask) {
    out[threadIdx.x] = __shfl_xor_sync(0xffffffffu, x[threadIdx.x], mask);
}

// One thread, 64 bytes of dynamic shared memory; snaps [5][64] of it at the points below
extern "C" __global__ void t_cp_async(const unsigned char* src, unsigned char* snaps,
                                      int short_bytes) {
    RS_DYNAMIC_SMEM(sm);
    rs_cp_async16(sm, src, 16);
    rs_cp_async_commit();
    rs_cp_async16(sm + 16, src + 16, short_bytes);
    rs_cp_async_commit();
    for (int i = 0; i < 64; ++i) snaps[i] = sm[i];               // 0: nothing landed
    rs_cp_async_wait<1>();
    for (int i = 0; i < 64; ++i) snaps[64 + i] = sm[i];          // 1: the older group only
    rs_cp_async_wait<0>();
    for (int i = 0; i < 64; ++i) snaps[128 + i] = sm[i];         // 2: both
    rs_cp_async16(sm + 32, src + 32, 16);
    rs_cp_async_wait<0>();
    // 3: an uncommitted copy is not waited for
    for (int i = 0; i < 64; ++i) snaps[192 + i] = sm[i];
    rs_cp_async_commit();
    rs_cp_async_wait<0>();
    for (int i = 0; i < 64; ++i) snaps[256 + i] = sm[i];         // 4: committed, then landed
}
"""


@pytest.fixture(scope="module")
def lib():
    return emu.build("", SOURCE)


def random_bf16(rng, shape) -> tuple[np.ndarray, np.ndarray]:
    """Random bf16 bits and their exact float64 values."""
    return bf16(rng.standard_normal(shape))


@NO_GXX
@pytest.mark.rule("the emulator's warp semantics")
@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 2**32 - 1))
def test_mma_with_the_ptx_fragment_layout_is_a_matmul(lib, seed):
    rng = np.random.default_rng(seed)
    (a, av), (b, bv) = random_bf16(rng, (16, 16)), random_bf16(rng, (16, 8))
    c = rng.standard_normal((16, 8)).astype(np.float32)
    d = np.full((16, 8), np.nan, dtype=np.float32)
    emu.launch(lib, "t_mma", (1, 1, 1), 32, [a, b, c, d])
    want = av @ bv + c
    assert np.allclose(d, want, rtol=1e-5, atol=1e-5), np.argwhere(
        ~np.isclose(d, want, rtol=1e-5, atol=1e-5)
    )[:4]


@NO_GXX
@pytest.mark.rule("the emulator's warp semantics")
def test_ldmatrix_gives_each_lane_the_documented_elements_of_the_rows_it_was_given(lib):
    rng = np.random.default_rng(7)
    m = rng.integers(0, 2**16, size=(32, 8), dtype=np.uint16)
    sel = rng.permutation(32).astype(np.int32)
    x4, x4t = np.zeros((32, 4), np.uint32), np.zeros((32, 4), np.uint32)
    x2 = np.zeros((32, 2), np.uint32)
    emu.launch(lib, "t_ldmatrix", (1, 1, 1), 32, [m, sel, x4, x4t, x2])
    mats = m[sel].reshape(4, 8, 8).astype(np.uint32)  # matrix i, row r = the row lane 8i + r named
    for lane in range(32):
        r, c = lane // 4, 2 * (lane % 4)
        for i in range(4):
            assert x4[lane, i] == mats[i, r, c] | (mats[i, r, c + 1] << 16), ("x4", lane, i)
            assert x4t[lane, i] == mats[i, c, r] | (mats[i, c + 1, r] << 16), ("x4.trans", lane, i)
        for i in range(2):
            assert x2[lane, i] == mats[i, r, c] | (mats[i, r, c + 1] << 16), ("x2", lane, i)


@NO_GXX
@pytest.mark.rule("the emulator's warp semantics")
@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 2**32 - 1))
def test_the_kernels_operand_pattern_multiplies_random_tiles(lib, seed):
    rng = np.random.default_rng(seed)
    (k, kv), (q, qv), (v, vv), (p, pv) = (
        random_bf16(rng, s) for s in ((16, 16), (8, 16), (16, 16), (8, 16))
    )
    s_out, o_out = np.zeros((16, 8), np.float32), np.zeros((16, 8), np.float32)
    emu.launch(lib, "t_tile", (1, 1, 1), 32, [k, q, v, p, s_out, o_out])
    assert np.allclose(s_out, kv @ qv.T, rtol=1e-5, atol=1e-5)  # S^T [keys, queries]
    assert np.allclose(o_out, vv.T @ pv.T, rtol=1e-5, atol=1e-5)  # O^T [dims, queries]


@NO_GXX
@pytest.mark.rule("the emulator's warp semantics")
@pytest.mark.parametrize("mask", [1, 4, 8, 16, 31])
def test_shfl_xor_exchanges_within_each_warp(lib, mask):
    x = np.arange(64, dtype=np.float32) * 1.5
    out = np.zeros(64, np.float32)
    emu.launch(lib, "t_shfl", (1, 1, 1), 64, [x, out, mask])
    lanes = np.arange(64)
    assert np.array_equal(out, x[(lanes & ~31) | ((lanes % 32) ^ mask)])


@NO_GXX
@pytest.mark.rule("the emulator's warp semantics")
@pytest.mark.parametrize("short_bytes", [0, 6, 16])
def test_cp_async_lands_only_at_its_wait(lib, short_bytes):
    src = (np.arange(64) + 1).astype(np.uint8)
    snaps = np.zeros((5, 64), np.uint8)
    emu.launch(lib, "t_cp_async", (1, 1, 1), 1, [src, snaps, short_bytes], shared_bytes=64)
    poison = np.full(64, 0xFF, np.uint8)
    assert np.array_equal(snaps[0], poison)  # issued, committed, not waited: stale
    assert np.array_equal(snaps[1][:16], src[:16]) and np.array_equal(snaps[1][16:], poison[16:])
    second = np.concatenate([src[16 : 16 + short_bytes], np.zeros(16 - short_bytes, np.uint8)])
    assert np.array_equal(snaps[2][:32], np.concatenate([src[:16], second]))
    assert np.array_equal(snaps[2][32:], poison[32:])
    assert np.array_equal(snaps[3], snaps[2])  # not committed: wait_group ignores it
    assert np.array_equal(snaps[4][32:48], src[32:48]) and np.array_equal(
        snaps[4][48:], poison[48:]
    )


@NO_GXX
@pytest.mark.rule("the emulator's warp semantics")
def test_a_kernel_using_more_dynamic_shared_memory_than_launched_with_is_reported(lib):
    """t_cp_async lands 48 bytes; launched with 32 it writes past them: the launch raises
    instead of corrupting memory quietly (the host's size and the kernel's layout disagree)."""
    src = np.arange(64).astype(np.uint8)
    snaps = np.zeros((5, 64), np.uint8)
    with pytest.raises(RuntimeError, match="wrote past its 32 bytes of dynamic shared memory"):
        emu.launch(lib, "t_cp_async", (1, 1, 1), 1, [src, snaps, 16], shared_bytes=32)


# --------------------------------------------------------------------------- builds


@pytest.mark.slow
# --------------------------------------------------------------------------- NVRTC front end
@pytest.mark.rule("the kernels build for sm_90: the nvcc front end and NVRTC")
@pytest.mark.skipif(emu.compilers()["nvcc"] is None,
                    reason="nvcc is not on the PATH: the CUDA front-end check needs it")
@pytest.mark.parametrize("dtype", ["float32", "float64", "bfloat16"])
def test_the_kernels_compile_for_the_gpu_at_the_benchmark_sizes(dtype):
    """nvcc (the front end NVRTC shares) compiles every kernel to sm_90 PTX at the bench's
    sizes (G * w = 8 and 16, head dim 128, 128 threads): a g++-only construct fails here."""
    for nq in (8, 16):
        emu.nvcc_check(ck.defines(dtype, nq, 128, 128))


THOROUGH = os.environ.get("HYPOTHESIS_PROFILE") == "thorough"
NO_NVRTC = kernel_check.nvrtc_unavailable()
VARIANTS = kernel_check.launcher_variants(everything=THOROUGH)
if not THOROUGH:
    VARIANTS = [
        v
        for v in VARIANTS
        if (v[1], v[2]) in kernel_check.BENCH_TC and (v[0] == "bfloat16" or v[1:3] == (16, 128))
    ]                                  # the bench's tensor-core builds and one CUDA-core build


@pytest.mark.slow
@pytest.mark.rule("the kernels build for sm_90: the nvcc front end and NVRTC")
@pytest.mark.skipif(NO_NVRTC is not None, reason=f"NVRTC is absent: {NO_NVRTC}")
@pytest.mark.parametrize(("dtype", "nq", "d", "path"), VARIANTS)
def test_nvrtc_builds_the_variant_without_spills(dtype, nq, d, path):
    """The launcher's build for (dtype, G * w, D) compiles under NVRTC for sm_90; ptxas
    reports no spill and no stack frame for the verify kernels; the tensor-core kernel's
    registers leave two blocks an SM (<= 255, 4 warps) and its SASS holds tensor-core MMAs,
    ldmatrix and async copies and no local-memory traffic."""
    build = kernel_check.nvrtc_build(kernel_check.variant_defines(dtype, nq, d))
    res = build.resources()
    name = "rs_verify_attention_tc" if path == "tc" else "rs_verify_attention_partial"
    for kernel in (name, "rs_verify_attention_combine"):
        r = res[kernel]
        assert r.spill_stores == r.spill_loads == 0 and r.stack == 0, r
    if path != "tc":
        return
    assert res[name].registers <= 255 and ck.tc_shared_bytes(nq, d) <= ck.TC_SHARED_LIMIT
    assert (
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32" in build.ptx
        and "cp.async.cg.shared.global" in build.ptx
    )
    tool = kernel_check.cuobjdump_path()
    if tool is None:
        pytest.skip("cuobjdump is absent (the nvidia-cuda-cuobjdump wheel): SASS not inspected")
    code = kernel_check.sass_of(kernel_check.sass(build.cubin, tool), name)
    assert "HMMA.16816.F32.BF16" in code and "LDSM" in code and "LDGSTS" in code
    assert "LDL" not in code and "STL" not in code
