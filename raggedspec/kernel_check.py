"""Compile every build of gpu/kernels.cu the launcher can ask for with NVRTC, and state what
ptxas made of each kernel: registers, static shared memory, stack, spills; plus the dynamic
shared memory the launcher gives the tensor-core kernel and the instructions its SASS holds.

`python -m raggedspec.kernel_check [--all]`: no GPU needed; a missing tool is a reason,
never a pass. Exit 0 no spills, 1 a spill or failure, 2 NVRTC absent. Detail:
docs/conformance.md, section "raggedspec/kernel_check.py".
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from raggedspec.gpu import cupy_kernels as ck
from raggedspec.gpu import kernel_emulator as emu

ARCH = "sm_90"
BENCH_TC = ((8, 128), (16, 128))  # G * w = 4 * 2 and 4 * 4 at head dim 128 (raggedspec/bench)


@dataclass(frozen=True)
class Resources:
    kernel: str
    registers: int
    shared: int  # static shared memory, bytes
    stack: int  # stack frame, bytes
    spill_stores: int
    spill_loads: int


@dataclass(frozen=True)
class Build:
    defines: str
    cubin: bytes
    ptx: str
    log: str

    def resources(self) -> dict[str, Resources]:
        return parse_ptxas(self.log)


def nvrtc_unavailable() -> str | None:
    """Why NVRTC cannot compile here (the wheels missing), or None."""
    try:
        from cuda.bindings import nvrtc  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - any import failure means "no NVRTC here"
        return (
            f"cuda.bindings.nvrtc is not importable ({type(exc).__name__}: {exc}); "
            "pip install 'raggedspec[nvrtc]'"
        )
    return None


def cuobjdump_path() -> str | None:
    """cuobjdump on the PATH, else the one the `nvidia-cuda-cuobjdump` wheel carries, else None."""
    found = shutil.which("cuobjdump")
    if found:
        return found
    try:
        import nvidia
    except ImportError:
        return None
    for root in nvidia.__path__:
        for cand in sorted(Path(root).glob("*/bin/cuobjdump")):
            return str(cand)
    return None


def _check(result, what: str) -> None:
    if int(result[0]) != 0:
        raise RuntimeError(f"NVRTC {what} failed: {result[0]}")


def nvrtc_build(defines: str, arch: str = ARCH) -> Build:
    """`defines + gpu/kernels.cu` through NVRTC for `arch` (the launcher's `-std=c++17`), with
    ptxas's verbose report. RuntimeError with NVRTC's log when the compile fails."""
    from cuda.bindings import nvrtc

    src = (defines + "\n" + emu.SOURCE_PATH.read_text()).encode()
    err, prog = nvrtc.nvrtcCreateProgram(src, b"kernels.cu", 0, [], [])
    _check((err,), "create")
    try:
        opts = [f"--gpu-architecture={arch}".encode(), b"-std=c++17", b"--ptxas-options=-v"]
        (res,) = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
        err, n = nvrtc.nvrtcGetProgramLogSize(prog)
        log = b" " * n
        nvrtc.nvrtcGetProgramLog(prog, log)
        log_text = log.decode(errors="replace").rstrip("\x00 ")
        if int(res) != 0:
            raise RuntimeError(
                f"NVRTC failed on gpu/kernels.cu ({' '.join(defines.split())}):\n{log_text[-4000:]}"
            )
        err, n = nvrtc.nvrtcGetCUBINSize(prog)
        cubin = b" " * n
        _check(nvrtc.nvrtcGetCUBIN(prog, cubin), "cubin")
        err, n = nvrtc.nvrtcGetPTXSize(prog)
        ptx = b" " * n
        _check(nvrtc.nvrtcGetPTX(prog, ptx), "ptx")
        return Build(defines, cubin, ptx.decode(errors="replace").rstrip("\x00"), log_text)
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


_ENTRY = re.compile(r"Compiling entry function '(\w+)'")
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"Used (\d+) registers(?:.*?(\d+) bytes smem)?")


def parse_ptxas(log: str) -> dict[str, Resources]:
    """ptxas's `-v` report, kernel by kernel. ValueError when an entry lacks its lines."""
    out, name, frame = {}, None, None
    for line in log.splitlines():
        if m := _ENTRY.search(line):
            name, frame = m.group(1), None
        elif name and (m := _FRAME.search(line)):
            frame = tuple(int(x) for x in m.groups())
        elif name and (m := _USED.search(line)):
            if frame is None:
                raise ValueError(f"ptxas report: {name} has no stack/spill line")
            out[name] = Resources(name, int(m.group(1)), int(m.group(2) or 0), *frame)
            name = None
    return out


def sass(cubin: bytes, tool: str) -> str:
    """The cubin's SASS by `cuobjdump -sass`, with the nvdisasm beside it (the wheels put both
    in one folder). RuntimeError with its output on failure."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "k.cubin"
        path.write_bytes(cubin)
        env = dict(os.environ, PATH=f"{Path(tool).parent}{os.pathsep}{os.environ.get('PATH', '')}")
        res = subprocess.run(
            [tool, "-sass", str(path)], capture_output=True, text=True, check=False, env=env
        )
    if res.returncode != 0:
        raise RuntimeError(f"cuobjdump failed: {res.stderr[-2000:]}")
    return res.stdout


def sass_of(listing: str, kernel: str) -> str:
    """The part of a cuobjdump listing that is `kernel`'s code."""
    parts = re.split(r"\n\s*Function : ", listing)
    for part in parts[1:]:
        if part.split("\n", 1)[0].strip() == kernel:
            return part
    raise ValueError(f"no function {kernel} in the SASS listing")


def launcher_variants(everything: bool = False) -> list[tuple[str, int, int, str]]:
    """(dtype, nq, head dim, path) of the builds the launcher asks for: the bench's sizes on
    every dtype, and for the tensor-core kernel the largest padded query count each head dim
    takes (its most registers); `everything` adds every padded count of every head dim."""
    kern = ck.Kernels.__new__(ck.Kernels)
    kern.tc_warps, kern.tc_stages = ck.TC_WARPS, ck.TC_STAGES
    kern.tc_capable, kern.tc_shared_limit, kern.sm_shared = True, ck.TC_SHARED_LIMIT, ck.SM_SHARED
    out = [(dt, nq, d, "simt") for dt in ("float32", "float64") for nq, d in BENCH_TC]
    out += [("bfloat16", nq, d, "tc") for nq, d in BENCH_TC]
    for d in ck.TC_HEAD_DIMS:
        counts = [nq for nq in range(8, ck.MAX_QUERIES + 1, 8) if kern.tc_fits(nq, d, "bfloat16")]
        picks = counts if everything else counts[-1:]
        out += [("bfloat16", nq, d, "tc") for nq in picks if ("bfloat16", nq, d, "tc") not in out]
    return out


def variant_defines(dtype: str, nq: int, d: int) -> str:
    """The #defines the launcher compiles for that call (cupy mode: 128 CUDA-core threads)."""
    return ck.defines(dtype, nq, d, 128, ck.TC_WARPS, ck.TC_STAGES)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m raggedspec.kernel_check", description=__doc__.split("\n")[0]
    )
    ap.add_argument("--all", action="store_true", help="every padded query count of every head dim")
    args = ap.parse_args(argv)
    why = nvrtc_unavailable()
    if why:
        print(f"kernel_check: {why}", file=sys.stderr)
        return 2
    tool = cuobjdump_path()
    bad = 0
    print(
        "| dtype | G*w | D | kernel | registers | static smem B | dynamic smem B | stack B "
        "| spills | SASS |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for dtype, nq, d, path in launcher_variants(args.all):
        name = "rs_verify_attention_tc" if path == "tc" else "rs_verify_attention_partial"
        try:
            build = nvrtc_build(variant_defines(dtype, nq, d))
        except RuntimeError as exc:
            print(f"| {dtype} | {nq} | {d} | {name} | compile failed: {exc} |")
            bad += 1
            continue
        r = build.resources()[name]
        dyn = ck.tc_shared_bytes(nq, d) if path == "tc" else 0
        ops = "-"
        if tool and path == "tc":
            code = sass_of(sass(build.cubin, tool), name)
            ops = " ".join(
                f"{op}:{len(re.findall(op, code))}"
                for op in ("HMMA", "LDSM", "LDGSTS", "LDL", "STL")
            )
        spills = r.spill_stores + r.spill_loads
        bad += spills > 0
        print(
            f"| {dtype} | {nq} | {d} | {name} | {r.registers} | {r.shared} | {dyn} | {r.stack} "
            f"| {spills} | {ops} |"
        )
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
