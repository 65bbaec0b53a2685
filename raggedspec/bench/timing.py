"""Timing for `raggedspec bench`: the `Timer` (CUDA events with an L2 flush, or
`time.perf_counter` on the CPU), the copy-bandwidth bound, the machine a result was
measured on, and the result file (JSON, written atomically). torch is imported inside the
functions."""

from __future__ import annotations

import importlib
import importlib.util
import json
import math
import os
import platform
import statistics
import time
from pathlib import Path

SCHEMA = "raggedspec-bench/1"
FLUSH_BYTES = 256 << 20     # L2 flush between timed repeats on CUDA (H200 L2: 60 MB)


class Timer:
    """Median milliseconds of `fn()`: CUDA events (warm-up, L2 flush before each repeat) or
    `time.perf_counter` on the CPU."""

    def __init__(self, device, warmup: int, reps: int) -> None:
        import torch
        self.device, self.warmup, self.reps = device, warmup, reps
        self.cuda = device.type == "cuda"
        self.flush = (
            torch.empty(FLUSH_BYTES, dtype=torch.uint8, device=device) if self.cuda else None
        )

    def __call__(self, fn, reps: int | None = None, warmup: int | None = None) -> float:
        import torch
        reps = self.reps if reps is None else reps
        for _ in range(self.warmup if warmup is None else warmup):
            fn()
        times = []
        if self.cuda:
            torch.cuda.synchronize(self.device)
            pairs = []
            for _ in range(reps):
                self.flush.zero_()
                start, end = (
                    torch.cuda.Event(enable_timing=True),
                    torch.cuda.Event(enable_timing=True),
                )
                start.record()
                fn()
                end.record()
                pairs.append((start, end))
            torch.cuda.synchronize(self.device)
            times = [s.elapsed_time(e) for s, e in pairs]
        else:
            for _ in range(reps):
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)

    def per_call(self, fn, calls: int = 10, batches: int = 5) -> float:
        """Median milliseconds per call of `fn()` issued `calls` times back to back between one
        pair of CUDA events, over `batches` batches (one warm-up batch; the L2 flushed before
        each). While the device works on one call the host queues the next, so the host's cost
        of issuing a call hides behind the device's: this is the device time of what `fn`
        launches. On the CPU: `time.perf_counter` around each batch."""
        import torch
        for _ in range(calls):
            fn()
        times = []
        for _ in range(batches):
            if self.cuda:
                self.flush.zero_()
                start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
                start.record()
                for _ in range(calls):
                    fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) / calls)
            else:
                t0 = time.perf_counter()
                for _ in range(calls):
                    fn()
                times.append((time.perf_counter() - t0) * 1e3 / calls)
        return statistics.median(times)


def copy_bandwidth(device, mib: int, timer: Timer) -> dict:
    """A large device-to-device copy: bytes read + written over the median time, GB/s."""
    import torch
    n = mib << 20
    src = torch.randint(0, 256, (n,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = timer(lambda: dst.copy_(src), reps=max(5, min(timer.reps, 20)), warmup=2)
    return {"bytes": 2 * n, "ms": ms, "GBps": 2 * n / (ms * 1e-3) / 1e9}


def machine_info(device) -> dict:
    import torch

    info = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
        "cpu": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
    }
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        info.update(
            gpu=p.name,
            sm_count=p.multi_processor_count,
            gpu_mem_gib=round(p.total_memory / 2**30, 1),
            cuda=torch.version.cuda,
            capability=f"{p.major}.{p.minor}",
        )
    try:
        info["cupy"] = importlib.import_module("cupy").__version__
    except Exception:  # noqa: BLE001
        info["cupy"] = None
    return info


def write_json(result: dict, path: Path) -> None:
    from raggedspec.outputs import write_text_atomic

    write_text_atomic(path, json.dumps(result, indent=1, default=_json_default))


def _json_default(x):
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    if isinstance(x, Path):
        return str(x)
    return str(x)
