"""`raggedspec preflight`: the first-run checks of the hand-written kernels, in seconds, before
any long GPU job spends its window on them.

`raggedspec preflight [--mode auto|cupy|emulate] [--out preflight.json] [--env-only]` runs
`compile:<variant>`, `elementwise:<dtype>`, `side_stream`, `reference:<dtype>` and `timing` in
that order, each `ok`, `failed` or `skipped` with the reason, and stops at the first failed
check (the rest are listed as not run). Every variant is compiled once, by its `compile:`
check; the later checks launch those builds again. The JSON is rewritten before each check
(naming the one running, so a run killed at a time limit says where it was) and after it.
Exit 0 when none failed, 4 when one did, 2 for bad usage. The checks, the modes and the JSON:
docs/conformance.md, section "raggedspec/preflight.py".
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

EXIT_OK, EXIT_USAGE, EXIT_PREFLIGHT_FAILED = 0, 2, 4
SCHEMA = "raggedspec-preflight/1"

# Every kernel variant the launcher is asked for by the benchmark and the end-to-end model:
# (dtype, query heads per KV head G, verify window w, head dim d). One module per variant.
# The benchmark: 32 query heads over 8 KV heads (G = 4), head dim 128, w = 2 and 4, bf16;
# the end-to-end model: 8 heads of 128 over one KV head (G = 8), w = depth + 1 = 4, float32.
KERNEL_VARIANTS = {
    "gpu": [(dt, 4, w, 128) for dt in ("bfloat16", "float32", "float64") for w in (2, 4)]
    + [("float32", 8, 4, 128), ("bfloat16", 8, 4, 128)],
    # the CPU smoke sizes of the benchmark (2 KV heads, 4 query heads, head dim 16)
    "smoke": [(dt, 2, w, 16) for dt in ("bfloat16", "float32", "float64") for w in (2, 4)],
}
# One small ragged batch: a full row, a short one, a middle one, one exactly w long. Its
# (G, w, d) is among KERNEL_VARIANTS of the same sizes, so it launches a build already made.
REFERENCE_CASES = {
    "gpu": {"hk": 2, "g": 4, "w": 2, "d": 128, "cap": 300, "lens": (300, 17, 200, 2), "seed": 9},
    "smoke": {"hk": 2, "g": 2, "w": 2, "d": 16, "cap": 300, "lens": (300, 17, 200, 2), "seed": 9},
}
# The headline shape of the benchmark (B = 128, L = 4096, spread 64) and its smoke stand-in.
TIMING_CASE = {
    "gpu": {"b": 128, "hk": 8, "g": 4, "w": 2, "d": 128, "L": 4096, "spread": 64, "calls": 10},
    "smoke": {"b": 4, "hk": 2, "g": 2, "w": 2, "d": 16, "L": 64, "spread": 24, "calls": 3},
}
TOLERANCE = {"float64": 1e-12, "float32": 1e-4, "bfloat16": 1e-2}  # ||out - ref|| / ||ref||
SLACK = 16.0


class CheckSkipped(Exception):
    """A check that cannot run here; its message is the reason (recorded, not a failure)."""


# ----------------------------------------------------------------------------- the machine


def environment() -> dict:
    """What the run ran on: Python, torch (and its CUDA), the GPU, driver and clocks
    (`nvidia-smi`), CuPy with its CUDA runtime, driver and NVRTC versions. Never raises: a
    missing piece is recorded as the reason it is missing."""
    env: dict = {"python": platform.python_version(), "platform": platform.platform()}
    try:
        import torch

        env["torch"] = torch.__version__
        env["torch_cuda"] = torch.version.cuda
        env["cuda_available"] = torch.cuda.is_available()
        if env["cuda_available"]:
            p = torch.cuda.get_device_properties(0)
            env["gpu"] = p.name
            env["capability"] = f"{p.major}.{p.minor}"
            env["sm_count"] = p.multi_processor_count
            env["gpu_mem_gib"] = round(p.total_memory / 2**30, 1)
    except Exception as exc:  # noqa: BLE001 - recorded, not raised
        env["torch"] = f"not importable: {type(exc).__name__}: {exc}"
    smi = shutil.which("nvidia-smi")
    if smi:
        query = (
            "name,driver_version,pstate,clocks.sm,clocks.max.sm,clocks.mem,clocks.max.mem,"
            "power.draw,power.limit,temperature.gpu,persistence_mode,clocks_throttle_reasons.active"
        )
        try:
            # the throttle field has another name on some drivers: without it on a refusal
            for fields in (query, query.rsplit(",", 1)[0]):
                res = subprocess.run(
                    [smi, f"--query-gpu={fields}", "--format=csv"],
                    check=False,
                    capture_output=True,
                    text=True,
                    timeout=15,
                )
                env["nvidia_smi"] = (res.stdout or res.stderr).strip()
                if res.returncode == 0:
                    break
        except (OSError, subprocess.SubprocessError) as exc:
            env["nvidia_smi"] = f"failed: {type(exc).__name__}: {exc}"
    else:
        env["nvidia_smi"] = "not on the PATH"
    try:
        import cupy

        env["cupy"] = cupy.__version__
        try:
            env["cupy_cuda_runtime"] = cupy.cuda.runtime.runtimeGetVersion()
            env["cupy_cuda_driver"] = cupy.cuda.runtime.driverGetVersion()
        except Exception as exc:  # noqa: BLE001
            env["cupy_cuda_runtime"] = f"unavailable: {type(exc).__name__}: {exc}"
        try:
            from cupy_backends.cuda.libs import nvrtc

            env["nvrtc"] = ".".join(str(x) for x in nvrtc.getVersion())
        except Exception as exc:  # noqa: BLE001
            env["nvrtc"] = f"unavailable: {type(exc).__name__}: {exc}"
    except Exception as exc:  # noqa: BLE001
        env["cupy"] = f"not importable: {type(exc).__name__}: {exc}"
    env["g++"] = shutil.which("g++")
    env["nvcc"] = shutil.which("nvcc")
    return env


def pick_mode(requested: str) -> tuple[str, str | None]:
    """`(mode, why not cupy)`: `cupy` where CuPy has a device and torch has CUDA, else
    `emulate` with the reason. ValueError when `cupy` is asked for and cannot run, or
    `emulate` without g++."""
    from raggedspec.gpu import cupy_kernels as ck
    from raggedspec.gpu import kernel_emulator

    why = ck.cupy_unavailable()
    if why is None:
        import torch

        if not torch.cuda.is_available():
            why = "torch.cuda.is_available() is False (a CPU build of torch)"
    if requested == "cupy" and why:
        raise ValueError(f"--mode cupy: {why}")
    if requested == "cupy" or (requested == "auto" and why is None):
        return "cupy", None
    if kernel_emulator.compilers()["g++"] is None:
        raise ValueError("--mode emulate needs g++ on the PATH (the kernel emulator)")
    return "emulate", why


# ----------------------------------------------------------------------------- inputs


def ragged_inputs(b: int, hk: int, g: int, w: int, d: int, cap: int, lens, seed: int):
    """float64 NumPy `q [B, G*Hk, w, D]`, in-place `k, v [B, Hk, cap, D]`: every column at or
    past `lens[i]` holds loud values (16x the live scale in K, 1e6 in V), so a kernel that
    reads one is far off."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((b, hk * g, w, d))
    k, v = rng.standard_normal((b, hk, cap, d)), rng.standard_normal((b, hk, cap, d))
    for i, n in enumerate(lens):
        k[i, :, n:] = SLACK * rng.standard_normal(k[i, :, n:].shape)
        v[i, :, n:] = 1e6
    return q, k, v


def reference_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, lens) -> np.ndarray:
    """float64 verify attention row by row through `reference.attention.attention` on each
    row's live run only: query r of row i (at `n - w + r`) sees keys `p <= n - w + r`, query
    head h reads KV head `h // G`."""
    from raggedspec.reference.attention import attention

    b, h, w, d = q.shape
    g = h // k.shape[1]
    out = np.empty((b, h, w, d))
    for i, n in enumerate(lens):
        mask = np.where(np.arange(n)[None, :] <= (n - w + np.arange(w))[:, None], 0.0, -np.inf)
        kk, vv = (
            np.repeat(k[i : i + 1, :, :n], g, axis=1),
            np.repeat(v[i : i + 1, :, :n], g, axis=1),
        )
        out[i] = attention(q[i : i + 1], kk, vv, mask[None, None])[0]
    return out


def rel_err(got: np.ndarray, want: np.ndarray) -> float:
    """`||got - want|| / ||want||` in float64; inf when `got` holds a NaN or an inf."""
    got = np.asarray(got, dtype=np.float64)
    if not np.isfinite(got).all():
        return math.inf
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-300))


def _torch_inputs(arrays, dtype: str, device: str):
    import torch

    tdt = getattr(torch, dtype)
    return [torch.from_numpy(a).to(device=device, dtype=tdt) for a in arrays]


def _entry_point(mode: str):
    """The torch-facing kernel entry point of `mode` (looked up at call time)."""
    from raggedspec.gpu import cupy_kernels as ck

    return ck.ragged_verify_attention if mode == "cupy" else ck.ragged_verify_attention_emulated


def _sync(mode: str) -> None:
    if mode == "cupy":
        import torch

        torch.cuda.synchronize()


# ----------------------------------------------------------------------------- the checks


def check_compile(mode: str, variant: tuple[str, int, int, int]) -> str:
    """Build and launch one variant `(dtype, G, w, d)` of the verify kernel (one row of w + 1
    keys, one KV head); returns a detail line. Raises whatever the compiler or the launch
    raised (CuPy's CompileException carries NVRTC's log)."""
    dtype, g, w, d = variant
    kern = _kernels(mode)
    q, k, v = ragged_inputs(1, 1, g, w, d, w + 1, [w + 1], seed=1)
    arrays = [_kernel_array(kern, a, dtype) for a in (q, k, v)]
    out = kern.verify_attention(*arrays, [w + 1])
    _sync(mode)
    return f"verify kernel: {g * w} queries per KV head, head dim {d}; out {list(out.shape)}"


def check_elementwise(mode: str, dtype: str) -> str:
    """Front-align, strip, RoPE (and the union mask in float32/float64) once in `dtype`."""
    kern = _kernels(mode)
    _, k, v = ragged_inputs(2, 1, 1, 1, 4, 5, [5, 2], seed=2)
    ka, va = _kernel_array(kern, k, dtype), _kernel_array(kern, v, dtype)
    ko, vo = kern.front_align(ka, va, [5, 2])
    kern.strip_dead_prefix(ko, vo, [0, 3], 5)
    kern.rope(ka, [0, 3], 4, 10000.0)
    if dtype != "bfloat16":
        kern.ragged_union_mask([3, 1], 3, 2, 0, 5, 0, 1, 4, dtype=dtype)
    _sync(mode)
    return "front_align, strip_dead_prefix, rope" + (
        "" if dtype == "bfloat16" else ", ragged_union_mask"
    )


def check_side_stream(mode: str) -> str:
    """On a fresh non-default torch stream: K/V allocated as zeros, a ~10 ms device spin, then
    the real K/V copied in (still pending), then the kernel; it must see the copied data.
    AssertionError when it read the zeros; CheckSkipped under the emulator (no CUDA stream).
    The detail says whether the stream was still busy when the call returned: a wrapper that
    waits on the device inside the call drains it first, and then a launch on the wrong stream
    would read the right data too."""
    if mode != "cupy":
        raise CheckSkipped("needs a CUDA stream: not run under the emulator (mode emulate)")
    import torch

    c = REFERENCE_CASES["gpu"]
    q, k, v = ragged_inputs(
        len(c["lens"]), c["hk"], c["g"], c["w"], c["d"], c["cap"], c["lens"], c["seed"]
    )
    want = reference_attention(q, k, v, c["lens"])
    tq, tk, tv = _torch_inputs((q, k, v), "float64", "cuda")
    lens = torch.tensor(c["lens"], dtype=torch.int64, device="cuda")
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        assert torch.cuda.current_stream() == side and side != torch.cuda.default_stream()
        k0, v0 = torch.zeros_like(tk), torch.zeros_like(tv)
        torch.cuda._sleep(20_000_000)  # ~10-20 ms of device spin on `side`
        k0.copy_(tk)
        v0.copy_(tv)
        out = _entry_point(mode)(tq, k0, v0, lens)
        pending = not side.query()
    torch.cuda.synchronize()
    err = rel_err(out.cpu().numpy(), want)
    assert err <= TOLERANCE["float64"], (
        f"the kernel did not read the pending write on torch's current stream: rel err {err:.3g}"
    )
    if pending:
        return f"rel err {err:.2g}; the stream was still busy when the call returned"
    return (
        f"rel err {err:.2g}; but the stream had drained before the call returned (the wrapper "
        "waits on the device), so this run could not tell a launch on another stream"
    )


def check_reference(mode: str, dtype: str) -> str:
    """The torch entry point on the mode's reference case in `dtype` against the float64
    reference on the same dtype-rounded inputs: `||out - ref|| / ||ref|| <= TOLERANCE[dtype]`."""
    import torch

    c = REFERENCE_CASES["gpu" if mode == "cupy" else "smoke"]
    device = "cuda" if mode == "cupy" else "cpu"
    q, k, v = ragged_inputs(
        len(c["lens"]), c["hk"], c["g"], c["w"], c["d"], c["cap"], c["lens"], c["seed"]
    )
    tq, tk, tv = _torch_inputs((q, k, v), dtype, device)
    rounded = [t.to(torch.float64).cpu().numpy() for t in (tq, tk, tv)]
    want = reference_attention(*rounded, c["lens"])
    lens = torch.tensor(c["lens"], dtype=torch.int64, device=device)
    out = _entry_point(mode)(tq, tk, tv, lens)
    _sync(mode)
    assert out.dtype == tq.dtype and tuple(out.shape) == tuple(tq.shape), (
        f"out {out.dtype} {list(out.shape)} for q {tq.dtype} {list(tq.shape)}"
    )
    err = rel_err(out.to(torch.float64).cpu().numpy(), want)
    assert err <= TOLERANCE[dtype], (
        f"rel err {err:.3g} > {TOLERANCE[dtype]:g} (lens {list(c['lens'])})"
    )
    return f"rel err {err:.2g} <= {TOLERANCE[dtype]:g}"


def check_timing(mode: str) -> dict:
    """Per call at the timing shape: the kernels' own time (CUDA: the profiler's kernel
    durations, else CUDA events around back-to-back `Kernels.verify_attention` calls on
    prepared arrays) against the wall time of the torch entry point (synchronized at the
    end). Emulated: `perf_counter` both, SMOKE."""
    import torch

    from raggedspec.gpu import cupy_kernels as ck

    t = TIMING_CASE["gpu" if mode == "cupy" else "smoke"]
    device, dtype = ("cuda", "bfloat16") if mode == "cupy" else ("cpu", "float32")
    tdt = getattr(torch, dtype)
    gen = torch.Generator(device=device).manual_seed(0)
    b, hk, h, w, d, L = t["b"], t["hk"], t["hk"] * t["g"], t["w"], t["d"], t["L"]
    lens_list = [L - (i * 7919) % (t["spread"] + 1) for i in range(b)]
    q = torch.randn((b, h, w, d), generator=gen, device=device, dtype=tdt)
    k = torch.randn((b, hk, L, d), generator=gen, device=device, dtype=tdt)
    v = torch.randn((b, hk, L, d), generator=gen, device=device, dtype=tdt)
    lens = torch.tensor(lens_list, dtype=torch.int64, device=device)
    kern = _kernels(mode)
    arrays = [ck.kernel_array(x, mode) for x in (q, k, v)] + [ck.kernel_array(lens, mode)]
    entry = _entry_point(mode)
    calls = t["calls"]
    for _ in range(2):
        kern.verify_attention(*arrays)
        entry(q, k, v, lens)
    _sync(mode)
    result = {"shape": dict(t, dtype=dtype), "calls": calls}
    t0 = time.perf_counter()
    for _ in range(calls):
        entry(q, k, v, lens)
    _sync(mode)
    result["wrapper_wall_ms"] = (time.perf_counter() - t0) * 1e3 / calls
    if mode == "cupy":
        result.update(_cuda_kernel_ms(kern, arrays, calls))
    else:
        t0 = time.perf_counter()
        for _ in range(calls):
            kern.verify_attention(*arrays)
        result["kernel_ms"] = (time.perf_counter() - t0) * 1e3 / calls
        result["kernel_ms_how"] = "perf_counter around Kernels.verify_attention (emulated, SMOKE)"
    result["wrapper_over_kernel"] = result["wrapper_wall_ms"] / max(result["kernel_ms"], 1e-9)
    return result


def _cuda_kernel_ms(kern, arrays, calls: int) -> dict:
    """Kernel time per call: the sum of the `rs_*` kernels' durations in torch's profiler
    (CUPTI sees CuPy's launches too); CUDA events around the calls where it saw none."""
    import cupy

    try:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(calls):
                kern.verify_attention(*arrays)
            cupy.cuda.Device().synchronize()
        us = sum(e.device_time_total for e in prof.key_averages() if "rs_" in e.key)
        names = sorted({e.key for e in prof.key_averages() if "rs_" in e.key})
        if us > 0:
            return {
                "kernel_ms": us / 1e3 / calls,
                "kernel_ms_how": f"torch.profiler kernel durations: {names}",
            }
    except Exception as exc:  # noqa: BLE001 - fall back to events
        why = f"{type(exc).__name__}: {exc}"
    else:
        why = "the profiler saw no rs_* kernel"
    start, end = cupy.cuda.Event(), cupy.cuda.Event()
    start.record()
    for _ in range(calls):
        kern.verify_attention(*arrays)
    end.record()
    end.synchronize()
    return {
        "kernel_ms": cupy.cuda.get_elapsed_time(start, end) / calls,
        "kernel_ms_how": f"CUDA events around back-to-back calls (includes host gaps; {why})",
    }


def _kernels(mode: str):
    """The one `Kernels(mode)` of this process: the instance the torch entry points launch
    through (cupy_kernels keeps it per mode), so a variant the compile checks built is the
    build every later check launches, never compiled twice."""
    from raggedspec.gpu import cupy_kernels as ck

    if mode not in ck._KERNELS:
        ck._KERNELS[mode] = ck.Kernels(mode)
    return ck._KERNELS[mode]


def _kernel_array(kern, a: np.ndarray, dtype: str):
    """A float64 NumPy array as a kernel array of `dtype` (bf16 as its bits) on kern's side."""
    from raggedspec.gpu import cupy_kernels as ck

    host = ck.bf16_bits(a) if dtype == "bfloat16" else np.ascontiguousarray(a, dtype=dtype)
    return kern.xp.asarray(host)


# ----------------------------------------------------------------------------- the run


def check_plan(mode: str) -> list[tuple[str, object]]:
    """`(name, thunk)` for every check of `mode`, in order."""
    variants = KERNEL_VARIANTS["gpu" if mode == "cupy" else "smoke"]
    plan: list[tuple[str, object]] = []
    for dt, g, w, d in variants:
        plan.append(
            (f"compile:{dt}:G{g}:w{w}:d{d}", lambda v=(dt, g, w, d): check_compile(mode, v))
        )
    for dt in ("float64", "float32", "bfloat16"):
        plan.append((f"elementwise:{dt}", lambda dt=dt: check_elementwise(mode, dt)))
    plan.append(("side_stream", lambda: check_side_stream(mode)))
    for dt in ("float64", "float32", "bfloat16"):
        plan.append((f"reference:{dt}", lambda dt=dt: check_reference(mode, dt)))
    plan.append(("timing", lambda: check_timing(mode)))
    return plan


def run_checks(mode: str, why_not_cupy: str | None, out: Path | None, log=print) -> dict:
    """Run `check_plan(mode)` in order and stop at the first failed check: a check raising
    CheckSkipped is `skipped` with its reason, any other exception `failed` with its type and
    message, and every check after a failed one is listed under `not_run`. The JSON at `out`
    is rewritten before each check (`running`: its name) and after it. Returns the result
    dict (`failed`: the failed check's name, or empty)."""
    result = {
        "schema": SCHEMA,
        "mode": mode,
        "environment": environment(),
        "checks": [],
        "failed": [],
        "not_run": [],
        "running": None,
    }
    if why_not_cupy:
        result["cupy_skipped"] = (
            f"the CuPy checks are not run here: {why_not_cupy}; the emulator runs them"
        )
        log(f"preflight: {result['cupy_skipped']}")
    plan = check_plan(mode)
    for i, (name, thunk) in enumerate(plan):
        result["running"] = name
        _save(result, out)
        row = run_check(name, thunk)
        result["checks"].append(row)
        result["running"] = None
        log(f"preflight {name}: {row['status'].upper()} ({row['seconds']:.2f} s) {row['detail']}")
        if row["status"] == "failed":
            result["failed"].append(name)
            result["not_run"] = [later for later, _ in plan[i + 1 :]]
            break
    _save(result, out)
    return result


def run_check(name: str, thunk) -> dict:
    """One check's row: `ok` with the thunk's detail, `skipped` (CheckSkipped: its reason) or
    `failed` (any other exception: its type and message), and the seconds it took."""
    t0 = time.perf_counter()
    try:
        status, detail = "ok", thunk()
    except CheckSkipped as why:
        status, detail = "skipped", str(why)
    except Exception as exc:  # noqa: BLE001 - a failed check is recorded, then the run stops
        status, detail = "failed", f"{type(exc).__name__}: {str(exc)[:2000]}"
    return {
        "check": name,
        "status": status,
        "seconds": round(time.perf_counter() - t0, 3),
        "detail": detail,
    }


def _save(result: dict, out: Path | None) -> None:
    if out is not None:
        _write_json(result, out)


def _write_json(result: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(result, indent=1, default=str))
    tmp.replace(path)


def render_markdown(result: dict) -> str:
    """The checks as a table (check, status, seconds, detail)."""
    lines = [
        f"Preflight ({result['mode']}): "
        + (
            "FAILED: " + ", ".join(result["failed"])
            + f"; not run after it: {', '.join(result['not_run']) or 'none'}"
            if result["failed"]
            else "every check passed or was skipped with its reason"
        ),
        "",
        "| check | status | s | detail |",
        "|---|---|---|---|",
    ]
    for row in result["checks"]:
        detail = (
            row["detail"]
            if isinstance(row["detail"], str)
            else json.dumps(row["detail"], default=str)
        )
        lines.append(
            f"| {row['check']} | {row['status']} | {row['seconds']} | "
            f"{detail.replace('|', '/')[:300]} |"
        )
    return "\n".join(lines) + "\n"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--mode",
        choices=("auto", "cupy", "emulate"),
        default="auto",
        help="cupy (a CUDA GPU), emulate (g++ on the CPU), auto: cupy where it can run (default)",
    )
    p.add_argument(
        "--out", type=Path, default=None, help="write the JSON here (rewritten after each check)"
    )
    p.add_argument("--env-only", action="store_true", help="print the environment as JSON and stop")


def run(args) -> int:
    """The CLI's `run`: 0 every check passed (or was skipped with its reason); 4 one failed
    (the run stopped there); 2 bad usage."""
    if args.out is not None and args.out.exists() and args.out.is_dir():
        print(
            f"raggedspec preflight: error: --out {args.out} is a folder, not a JSON file",
            file=sys.stderr,
        )
        return EXIT_USAGE
    if args.env_only:
        env = environment()
        print(json.dumps(env, indent=1, default=str))
        if args.out is not None:
            _write_json({"schema": SCHEMA, "environment": env}, args.out)
        return EXIT_OK
    try:
        mode, why = pick_mode(args.mode)
    except ValueError as exc:
        print(f"raggedspec preflight: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    result = run_checks(mode, why, args.out, log=lambda msg: print(msg, flush=True))
    print(render_markdown(result))
    if result["failed"]:
        print(
            f"raggedspec preflight: FAILED check(s): {', '.join(result['failed'])}", file=sys.stderr
        )
        return EXIT_PREFLIGHT_FAILED
    return EXIT_OK


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m raggedspec.preflight", description=__doc__.split("\n\n")[0]
    )
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
