"""Run `gpu/kernels.cu` on the CPU: the same source compiled by g++ under a CUDA-subset prelude.

Why: CuPy needs a GPU, and most machines that build and test raggedspec have none. The
kernels use only blockIdx / threadIdx / blockDim / gridDim, `__shared__` arrays and
`__syncthreads()`, so a block can be executed exactly as CUDA defines it: `blockDim.x` real
threads meeting at a real barrier (`std::barrier`), `__shared__` arrays shared by them, one
block after another (the same threads run every block of a launch and meet at the barrier
between blocks, so a block never sees its predecessor's shared arrays in use). Index arithmetic, masks, the split-K online softmax and its combine are
then tested against the reference on any machine with g++ (conformance/test_cupy_kernels.py);
what only a GPU can show (NVRTC's compile, speed, the CUDA math library's last bits) is left to
the CUDA run, and the NVRTC front end is checked here too when `nvcc` is on the PATH.

    lib = build(defines)                  # a shared library, cached by content hash
    launch(lib, "rs_front_align", grid, block, args)   # args as the kernel's signature reads

Refuses (ValueError) an argument list that does not match the kernel's parameters.
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
#include <cstring>
#include <functional>
#include <thread>
#include <vector>
#define RS_EMULATE 1
#define RS_DEV static inline
#define __global__
#define __shared__ static
struct rs_dim3 { unsigned x, y, z; };
static thread_local rs_dim3 threadIdx, blockIdx;
static rs_dim3 blockDim, gridDim;
static std::barrier<>* rs_barrier = nullptr;
static inline void __syncthreads() { rs_barrier->arrive_and_wait(); }
static inline float __uint_as_float(unsigned u) { float f; std::memcpy(&f, &u, 4); return f; }
static inline float __int_as_float(int i) { float f; std::memcpy(&f, &i, 4); return f; }
static inline unsigned __float_as_uint(float f) { unsigned u; std::memcpy(&u, &f, 4); return u; }
using std::exp; using std::cos; using std::sin; using std::pow;
static void rs_run_grid(unsigned gx, unsigned gy, unsigned gz, unsigned bx, const std::function<void()>& body) {
    // bx threads for the whole launch; each runs every block in order, and the barrier at the
    // end of a block keeps the next block from touching __shared__ arrays still in use
    gridDim = {gx, gy, gz};
    blockDim = {bx, 1, 1};
    std::barrier<> bar(bx);
    rs_barrier = &bar;
    std::vector<std::thread> threads;
    for (unsigned t = 0; t < bx; ++t)
        threads.emplace_back([&, t] {
            threadIdx = {t, 0, 0};
            for (unsigned z = 0; z < gz; ++z)
                for (unsigned y = 0; y < gy; ++y)
                    for (unsigned x = 0; x < gx; ++x) {
                        blockIdx = {x, y, z};
                        body();
                        bar.arrive_and_wait();
                    }
        });
    for (auto& th : threads) th.join();
}
"""

# C parameter type -> (ctypes type, NumPy scalar type or None for a pointer)
_SCALARS = {"long long": (ctypes.c_longlong, np.int64), "double": (ctypes.c_double, np.float64),
            "float": (ctypes.c_float, np.float32), "int": (ctypes.c_int, np.int32)}


@dataclass(frozen=True)
class Param:
    ctype: str   # as written, e.g. "const RS_ELEM*", "long long"
    name: str

    @property
    def pointer(self) -> bool:
        return self.ctype.endswith("*")


def signatures(source: str) -> dict[str, list[Param]]:
    """Every `extern "C" __global__ void name(params)` of `source`: name -> parameters."""
    out = {}
    for m in re.finditer(r'extern "C" __global__ void (\w+)\(([^)]*)\)', source):
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
    require(param.ctype in _SCALARS, f"kernel parameter {param.name}: unsupported type {param.ctype!r}")
    return _SCALARS[param.ctype][1]


def bind(name: str, params: list[Param], args: list) -> list:
    """`args` checked against kernel `name`'s parameters, numbers as the NumPy scalars the
    parameter types say (arrays for pointers pass through): what both runners launch with."""
    require(len(args) == len(params), f"{name} takes {len(params)} arguments, got {len(args)}")
    return [a if p.pointer else scalar_type(p)(a) for p, a in zip(params, args)]


def compilers() -> dict[str, str | None]:
    """Paths of the tools this module and its tests use (None where absent)."""
    return {"g++": shutil.which("g++"), "nvcc": shutil.which("nvcc")}


def _cache_dir() -> Path:
    root = Path(os.environ.get("RAGGEDSPEC_KERNEL_CACHE", Path(tempfile.gettempdir()) / "raggedspec-kernels"))
    root.mkdir(parents=True, exist_ok=True)
    return root


_LOCK = threading.Lock()
_LIBS: dict[str, ctypes.CDLL] = {}


def build(defines: str, source: str | None = None) -> ctypes.CDLL:
    """Compile `defines + source` (default gpu/kernels.cu) with g++ into a cached shared
    library, with one `emu_<kernel>(gx, gy, gz, bx, params...)` entry point per kernel.
    RuntimeError (with the compiler's output) when g++ is missing or the build fails."""
    source = SOURCE_PATH.read_text() if source is None else source
    sigs = signatures(source)
    wrappers = []
    for name, params in sigs.items():
        decl = ", ".join(f"{p.ctype} {p.name}" for p in params)
        call = ", ".join(p.name for p in params)
        wrappers.append(f'extern "C" void emu_{name}(unsigned gx, unsigned gy, unsigned gz, unsigned bx, {decl}) '
                        f'{{ rs_run_grid(gx, gy, gz, bx, [&] {{ {name}({call}); }}); }}')
    text = PRELUDE + defines + "\n" + source + "\n" + "\n".join(wrappers) + "\n"
    key = hashlib.sha256(text.encode()).hexdigest()[:20]
    with _LOCK:
        if key in _LIBS:
            return _LIBS[key]
        gxx = compilers()["g++"]
        if gxx is None:
            raise RuntimeError("g++ is not on the PATH: the kernel emulator compiles gpu/kernels.cu with it")
        lib_path = _cache_dir() / f"kernels-{key}.so"
        if not lib_path.exists():
            # per-process names: two processes building the same text never share a file
            src_path = lib_path.with_suffix(f".{os.getpid()}.cpp")
            src_path.write_text(text)
            tmp = lib_path.with_suffix(f".{os.getpid()}.tmp")
            res = subprocess.run([gxx, "-std=c++20", "-O1", "-shared", "-fPIC", "-pthread",
                                  "-Wno-narrowing", "-o", str(tmp), str(src_path)],
                                 capture_output=True, text=True)
            src_path.unlink(missing_ok=True)
            if res.returncode != 0:
                raise RuntimeError(f"g++ failed on gpu/kernels.cu ({defines.strip()}):\n{res.stderr[-4000:]}")
            os.replace(tmp, lib_path)
        lib = ctypes.CDLL(str(lib_path))
        lib.rs_signatures = sigs
        for name, params in sigs.items():
            fn = getattr(lib, f"emu_{name}")
            fn.argtypes = [ctypes.c_uint] * 4 + [ctypes.c_void_p if p.pointer else _SCALARS[p.ctype][0]
                                                 for p in params]
            fn.restype = None
        _LIBS[key] = lib
        return lib


def launch(lib: ctypes.CDLL, name: str, grid: tuple[int, int, int], block: int, args: list) -> None:
    """Run kernel `name` of a `build` over `grid` blocks of `block` threads. `args` follow the
    kernel's parameters: C-contiguous NumPy arrays for pointers (written in place), numbers
    otherwise."""
    params = lib.rs_signatures[name]
    cargs = []
    for p, a in zip(params, bind(name, params, args)):
        if p.pointer:
            require(isinstance(a, np.ndarray) and a.flags.c_contiguous,
                    f"{name}: parameter {p.name} needs a C-contiguous NumPy array, got {type(a).__name__}")
            cargs.append(a.ctypes.data)
        else:
            cargs.append(a.item())
    getattr(lib, f"emu_{name}")(*grid, block, *cargs)


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
        res = subprocess.run([nvcc, "-ptx", f"-arch={arch}", "-std=c++17", "-o", str(Path(tmp) / "k.ptx"),
                              str(src)], capture_output=True, text=True)
        if res.returncode != 0:
            raise RuntimeError(f"nvcc failed on gpu/kernels.cu ({defines.strip()}):\n{res.stderr[-4000:]}")
