"""Run `gpu/kernels.cu` on the CPU: the same source compiled by g++ under a CUDA-subset prelude.

A block runs as CUDA defines it (`blockDim.x` real threads at a real barrier, shared arrays,
warp-level `__shfl_xor_sync`, `ldmatrix`, `mma.sync`, `cp.async` as the PTX ISA states
them), so the kernels are tested against the reference on any machine with g++.
`build(defines)` gives a cached shared library, `launch(lib, name, grid, block, args)` runs
a kernel; an argument list that does not match the kernel's parameters is refused
(ValueError). Detail: docs/conformance.md, section "gpu/kernel_emulator.py".
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from raggedspec.reference.errors import require

SOURCE_PATH = Path(__file__).with_name("kernels.cu")

PRELUDE = r"""
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <deque>
#include <functional>
#include <memory>
#include <thread>
#include <vector>
#define RS_EMULATE 1
#define RS_DEV static inline
#define __global__
#define __shared__ static
#define __launch_bounds__(...)
struct rs_dim3 { unsigned x, y, z; };
static thread_local rs_dim3 threadIdx, blockIdx;
static rs_dim3 blockDim, gridDim;
static std::barrier<>* rs_barrier = nullptr;
static inline void __syncthreads() { rs_barrier->arrive_and_wait(); }
static inline float __uint_as_float(unsigned u) { float f; std::memcpy(&f, &u, 4); return f; }
static inline float __int_as_float(int i) { float f; std::memcpy(&f, &i, 4); return f; }
static inline unsigned __float_as_uint(float f) { unsigned u; std::memcpy(&u, &f, 4); return u; }
using std::exp; using std::cos; using std::sin; using std::pow; using std::exp2; using std::fmax;

// ---- dynamic shared memory: one buffer per launch, poisoned (0xFF: bf16/float NaN) before
// every block, so a read of a byte no copy has landed in yet is loud
static unsigned char* rs_dynamic_smem = nullptr;
static bool rs_overrun_flag = false;
extern "C" int rs_overrun() { return rs_overrun_flag ? 1 : 0; }
static size_t rs_dynamic_bytes = 0;
#define RS_DYNAMIC_SMEM(name) unsigned char* name = rs_dynamic_smem

// ---- warps: lanes 32 * i .. 32 * i + 31 of a block, each warp with its own barrier and one
// exchange slot per lane; every warp-collective operation is write slot, barrier, read the
// slots the operation's layout names, barrier
struct rs_warp_t {
    std::unique_ptr<std::barrier<>> bar;
    alignas(16) unsigned char slot[32][64];
};
static std::vector<rs_warp_t> rs_warps;
static thread_local unsigned rs_lane = 0, rs_warp_id = 0;
static inline rs_warp_t& rs_my_warp() { return rs_warps[rs_warp_id]; }
static inline void __syncwarp(unsigned = 0xffffffffu) { rs_my_warp().bar->arrive_and_wait(); }
template <class T> static inline T __shfl_xor_sync(unsigned, T v, int lane_mask) {
    static_assert(sizeof(T) <= 64, "shuffle of a value wider than a slot");
    rs_warp_t& w = rs_my_warp();
    std::memcpy(w.slot[rs_lane], &v, sizeof(T));
    __syncwarp();
    T out;
    std::memcpy(&out, w.slot[(rs_lane ^ (unsigned)lane_mask) & 31u], sizeof(T));
    __syncwarp();
    return out;
}
static inline unsigned short rs_half(unsigned word, unsigned hi) {
    return (unsigned short)(hi ? word >> 16 : word & 0xFFFFu);
}
static inline float rs_bf16_value(unsigned short h) { return __uint_as_float(((unsigned)h) << 16); }

// ldmatrix.sync.aligned.m8n8.x{1,2,4}[.trans].shared.b16 (PTX ISA): lanes 8i .. 8i + 7 give
// the row addresses of matrix i; lane l receives, in register i, matrix i's row l / 4, elements
// 2 (l % 4) and 2 (l % 4) + 1 (low half first); .trans: column l / 4, rows 2 (l % 4), +1
template <int X, bool TRANS> static inline void rs_ldmatrix(unsigned* r, const void* row_addr) {
    rs_warp_t& w = rs_my_warp();
    std::memcpy(w.slot[rs_lane], &row_addr, sizeof(void*));
    __syncwarp();
    for (int i = 0; i < X; ++i) {
        const unsigned short* rows[8];
        for (int j = 0; j < 8; ++j) std::memcpy(&rows[j], w.slot[8 * i + j], sizeof(void*));
        unsigned lo, hi;
        if (!TRANS) {
            lo = rows[rs_lane / 4][2 * (rs_lane % 4)];
            hi = rows[rs_lane / 4][2 * (rs_lane % 4) + 1];
        } else {
            lo = rows[2 * (rs_lane % 4)][rs_lane / 4];
            hi = rows[2 * (rs_lane % 4) + 1][rs_lane / 4];
        }
        r[i] = lo | (hi << 16);
    }
    __syncwarp();
}
static inline void rs_ldmatrix_x4(unsigned (&r)[4], const void* p) { rs_ldmatrix<4, false>(r, p); }
static inline void rs_ldmatrix_x4_trans(unsigned (&r)[4], const void* p) {
    rs_ldmatrix<4, true>(r, p);
}
static inline void rs_ldmatrix_x2(unsigned (&r)[2], const void* p) { rs_ldmatrix<2, false>(r, p); }

// mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32, d = a b + d (PTX ISA fragment layouts,
// groupID g = lane / 4, t = lane % 4):
//   A 16x16: a[0] (g, 2t..2t+1), a[1] (g+8, 2t..), a[2] (g, 2t+8..), a[3] (g+8, 2t+8..)
//   B 16x8:  b[0] (k 2t..2t+1, n g), b[1] (k 2t+8.., n g)
//   C 16x8:  d[0], d[1] (g, 2t), (g, 2t+1); d[2], d[3] (g+8, 2t), (g+8, 2t+1)
// Products of bf16 are exact in float; the sum runs in float in k order.
static inline float rs_mma_a(const unsigned char (*slot)[64], int row, int col) {
    const unsigned* a = (const unsigned*)slot[(row % 8) * 4 + (col % 8) / 2];
    return rs_bf16_value(rs_half(a[(row >= 8) + 2 * (col >= 8)], col & 1));
}
static inline float rs_mma_b(const unsigned char (*slot)[64], int k, int n) {
    const unsigned* b = (const unsigned*)(slot[n * 4 + (k % 8) / 2] + 16);
    return rs_bf16_value(rs_half(b[k >= 8], k & 1));
}
static inline void rs_mma_bf16(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2]) {
    rs_warp_t& w = rs_my_warp();
    std::memcpy(w.slot[rs_lane], a, 16);
    std::memcpy(w.slot[rs_lane] + 16, b, 8);
    __syncwarp();
    const int g = rs_lane / 4, t = rs_lane % 4;
    float out[4];
    for (int i = 0; i < 4; ++i) {
        const int row = g + 8 * (i >= 2), col = 2 * t + (i & 1);
        float acc = d[i];
        for (int kk = 0; kk < 16; ++kk)
            acc += rs_mma_a(w.slot, row, kk) * rs_mma_b(w.slot, kk, col);
        out[i] = acc;
    }
    __syncwarp();
    for (int i = 0; i < 4; ++i) d[i] = out[i];
}

// cp.async.cg.shared.global [dst], [src], 16, src_bytes: a deferred copy. It joins this
// thread's open group; cp.async.commit_group closes the group; cp.async.wait_group N lands
// the oldest committed groups until at most N are pending. Nothing lands before its wait
// (a missing or short wait reads the poisoned or previous bytes); bytes past src_bytes are
// zero-filled and their source is never read; copies still pending when a block ends are
// dropped.
struct rs_copy { void* dst; const void* src; unsigned bytes, src_bytes; };
static thread_local std::vector<rs_copy> rs_open_group;
static thread_local std::deque<std::vector<rs_copy>> rs_groups;
static inline void rs_cp_async16(void* dst, const void* src, unsigned src_bytes) {
    rs_open_group.push_back({dst, src, 16u, src_bytes > 16u ? 16u : src_bytes});
}
static inline void rs_cp_async_commit() {
    rs_groups.push_back(std::move(rs_open_group));
    rs_open_group.clear();
}
template <int N> static inline void rs_cp_async_wait() {
    while (rs_groups.size() > (size_t)N) {
        for (const rs_copy& c : rs_groups.front()) {
            if (c.src_bytes) std::memcpy(c.dst, c.src, c.src_bytes);
            std::memset((unsigned char*)c.dst + c.src_bytes, 0, c.bytes - c.src_bytes);
        }
        rs_groups.pop_front();
    }
}

static void rs_run_grid(unsigned gx, unsigned gy, unsigned gz, unsigned bx, size_t smem_bytes,
                        const std::function<void()>& body) {
    // bx threads for the whole launch; each runs every block in order, and the barrier at the
    // end of a block keeps the next block from touching __shared__ arrays still in use
    gridDim = {gx, gy, gz};
    blockDim = {bx, 1, 1};
    std::barrier<> bar(bx);
    rs_barrier = &bar;
    // the launch's bytes, then 256 KiB of guard bytes (more than any block may opt in to): a
    // kernel that uses more than it was given (the host's size and the kernel's layout
    // disagreeing) is reported by rs_overrun() instead of corrupting the process
    std::vector<unsigned char> dyn(smem_bytes + (256u << 10), 0xFF);
    rs_dynamic_smem = dyn.data();
    rs_dynamic_bytes = smem_bytes;
    rs_warps.clear();
    rs_warps.resize((bx + 31) / 32);
    for (unsigned i = 0; i < rs_warps.size(); ++i) {
        const unsigned lanes = (i + 1) * 32 <= bx ? 32u : bx - 32u * i;
        rs_warps[i].bar = std::make_unique<std::barrier<>>(lanes);
    }
    std::vector<std::thread> threads;
    for (unsigned t = 0; t < bx; ++t)
        threads.emplace_back([&, t] {
            threadIdx = {t, 0, 0};
            rs_lane = t % 32;
            rs_warp_id = t / 32;
            for (unsigned z = 0; z < gz; ++z)
                for (unsigned y = 0; y < gy; ++y)
                    for (unsigned x = 0; x < gx; ++x) {
                        blockIdx = {x, y, z};
                        if (t == 0) std::memset(rs_dynamic_smem, 0xFF, smem_bytes);
                        bar.arrive_and_wait();
                        body();
                        rs_open_group.clear();
                        rs_groups.clear();
                        bar.arrive_and_wait();
                    }
        });
    for (auto& th : threads) th.join();
    rs_overrun_flag = false;
    for (size_t i = smem_bytes; i < dyn.size(); ++i) rs_overrun_flag |= dyn[i] != 0xFF;
}
"""

# C parameter type -> (ctypes type, NumPy scalar type or None for a pointer)
_SCALARS = {
    "long long": (ctypes.c_longlong, np.int64),
    "double": (ctypes.c_double, np.float64),
    "float": (ctypes.c_float, np.float32),
    "int": (ctypes.c_int, np.int32),
}


@dataclass(frozen=True)
class Param:
    ctype: str  # as written, e.g. "const RS_ELEM*", "long long"
    name: str

    @property
    def pointer(self) -> bool:
        return self.ctype.endswith("*")


def signatures(source: str) -> dict[str, list[Param]]:
    """Every `extern "C" __global__ void name(params)` of `source`: name -> parameters."""
    out = {}
    for m in re.finditer(
        r'extern "C" __global__ void (?:__launch_bounds__\([\w, ]+\) )?(\w+)\(([^)]*)\)', source
    ):
        params = []
        for raw in m.group(2).split(","):
            words = " ".join(raw.split())
            ctype, name = words.rsplit(" ", 1)
            if name.startswith("*"):
                ctype, name = ctype + "*", name[1:]
            params.append(Param(ctype, name))
        out[m.group(1)] = params
    return out


def scalar_type(param: Param):
    """The NumPy scalar type a CuPy launch must pass for a non-pointer parameter."""
    require(
        param.ctype in _SCALARS, f"kernel parameter {param.name}: unsupported type {param.ctype!r}"
    )
    return _SCALARS[param.ctype][1]


def bind(name: str, params: list[Param], args: list) -> list:
    """`args` checked against kernel `name`'s parameters, numbers as the NumPy scalars the
    parameter types say (arrays for pointers pass through): what both runners launch with."""
    require(len(args) == len(params), f"{name} takes {len(params)} arguments, got {len(args)}")
    return [a if p.pointer else scalar_type(p)(a) for p, a in zip(params, args, strict=True)]


def compilers() -> dict[str, str | None]:
    """Paths of the tools this module and its tests use (None where absent)."""
    return {"g++": shutil.which("g++"), "nvcc": shutil.which("nvcc")}


def _cache_dir() -> Path:
    root = Path(
        os.environ.get(
            "RAGGEDSPEC_KERNEL_CACHE", Path(tempfile.gettempdir()) / "raggedspec-kernels"
        )
    )
    root.mkdir(parents=True, exist_ok=True)
    return root


_LOCK = threading.Lock()
_LIBS: dict[str, ctypes.CDLL] = {}


def build(defines: str, source: str | None = None) -> ctypes.CDLL:
    """Compile `defines + source` (default gpu/kernels.cu) with g++ into a cached shared
    library, with one `emu_<kernel>(gx, gy, gz, bx, smem, params...)` entry point per kernel
    (smem: the dynamic shared memory of the launch).
    RuntimeError (with the compiler's output) when g++ is missing or the build fails."""
    source = SOURCE_PATH.read_text() if source is None else source
    sigs = signatures(source)
    text = PRELUDE + defines + "\n" + source + "\n" + "\n".join(entry_points(sigs)) + "\n"
    key = hashlib.sha256(text.encode()).hexdigest()[:20]
    with _LOCK:
        if key in _LIBS:
            return _LIBS[key]
        gxx = compilers()["g++"]
        if gxx is None:
            raise RuntimeError(
                "g++ is not on the PATH: the kernel emulator compiles gpu/kernels.cu with it"
            )
        lib_path = _cache_dir() / f"kernels-{key}.so"
        if not lib_path.exists():
            compile_library(gxx, text, lib_path, defines)
        lib = ctypes.CDLL(str(lib_path))
        lib.rs_signatures = sigs
        for name, params in sigs.items():
            fn = getattr(lib, f"emu_{name}")
            fn.argtypes = (
                [ctypes.c_uint] * 4
                + [ctypes.c_size_t]
                + [ctypes.c_void_p if p.pointer else _SCALARS[p.ctype][0] for p in params]
            )
            fn.restype = None
        _LIBS[key] = lib
        return lib


def entry_points(sigs: dict) -> list[str]:
    """One C++ `emu_<kernel>(gx, gy, gz, bx, smem, params...)` wrapper per kernel of `sigs`,
    running the kernel over the whole grid (`rs_run_grid`). No refusals."""
    wrappers = []
    for name, params in sigs.items():
        decl = ", ".join(f"{p.ctype} {p.name}" for p in params)
        call = ", ".join(p.name for p in params)
        wrappers.append(
            f'extern "C" void emu_{name}(unsigned gx, unsigned gy, unsigned gz, unsigned bx, '
            f"size_t smem, {decl}) "
            f"{{ rs_run_grid(gx, gy, gz, bx, smem, [&] {{ {name}({call}); }}); }}"
        )
    return wrappers


def compile_library(gxx: str, text: str, lib_path: Path, defines: str) -> None:
    """Compile the C++ `text` with `gxx` into the shared library `lib_path`, atomically: the
    source and the output carry the process id until the finished library is renamed into
    place, so two processes building the same text never share a file. Refuses with
    RuntimeError (the compiler's output, the build's `defines` named) when g++ fails."""
    src_path = lib_path.with_suffix(f".{os.getpid()}.cpp")
    src_path.write_text(text)
    tmp = lib_path.with_suffix(f".{os.getpid()}.tmp")
    res = subprocess.run(
        [
            gxx,
            "-std=c++20",
            "-O1",
            "-shared",
            "-fPIC",
            "-pthread",
            "-Wno-narrowing",
            "-o",
            str(tmp),
            str(src_path),
        ],
        capture_output=True,
        text=True,
    )
    src_path.unlink(missing_ok=True)
    if res.returncode != 0:
        raise RuntimeError(
            f"g++ failed on gpu/kernels.cu ({defines.strip()}):\n{res.stderr[-4000:]}"
        )
    os.replace(tmp, lib_path)


def launch(
    lib: ctypes.CDLL,
    name: str,
    grid: tuple[int, int, int],
    block: int,
    args: list,
    shared_bytes: int = 0,
) -> None:
    """Run kernel `name` of a `build` over `grid` blocks of `block` threads with
    `shared_bytes` of dynamic shared memory. `args` follow the kernel's parameters:
    C-contiguous NumPy arrays for pointers (written in place), numbers otherwise."""
    params = lib.rs_signatures[name]
    cargs = []
    for p, a in zip(params, bind(name, params, args), strict=True):
        if p.pointer:
            require(
                isinstance(a, np.ndarray) and a.flags.c_contiguous,
                f"{name}: parameter {p.name} needs a C-contiguous NumPy array, "
                f"got {type(a).__name__}",
            )
            cargs.append(a.ctypes.data)
        else:
            cargs.append(a.item())
    require(shared_bytes >= 0, f"{name}: dynamic shared memory {shared_bytes} must be >= 0")
    getattr(lib, f"emu_{name}")(*grid, block, shared_bytes, *cargs)
    if lib.rs_overrun():
        raise RuntimeError(f"{name} wrote past its {shared_bytes} bytes of dynamic shared memory")


def nvcc_check(defines: str, arch: str = "sm_90") -> None:
    """Compile `defines + gpu/kernels.cu` to PTX with nvcc (the CUDA front end NVRTC shares):
    catches what g++ cannot, e.g. a host-only function in device code. RuntimeError with
    nvcc's output on failure."""
    nvcc = compilers()["nvcc"]
    if nvcc is None:
        raise RuntimeError("nvcc is not on the PATH")
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "kernels.cu"
        src.write_text(defines + "\n" + SOURCE_PATH.read_text())
        res = subprocess.run(
            [nvcc, "-ptx", f"-arch={arch}", "-std=c++17", "-o", str(Path(tmp) / "k.ptx"), str(src)],
            capture_output=True,
            text=True,
        )
        if res.returncode != 0:
            raise RuntimeError(
                f"nvcc failed on gpu/kernels.cu ({defines.strip()}):\n{res.stderr[-4000:]}"
            )
