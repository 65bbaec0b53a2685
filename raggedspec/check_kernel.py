"""`raggedspec check-kernel`: a user's attention kernel, in the layout it speaks, against the
reference on generated speculative-decoding verify batches.

Each example is a ragged verify batch (`gpu.layouts.VerifyBatch`): per-row query lengths
from accept counts (0 accepted, all accepted, rows not verifying at all), cache lengths near
and far apart, past 256 (where bfloat16 stops holding integers), on page boundaries, windows
at their edges, 1 to 8 query heads per KV head. Dead cells (padding, unused page slots) hold
finite values far from the data, so a kernel that reads them is seen. The batch goes through
the user's function in the chosen layout; its output is compared, on the live query slots,
with the reference: per row, `reference.masks.raw_validity` (causal plus window) and
`reference.attention.attention` in float64 on the exact values the kernel received, under
the tolerance of docs/conformance.md (float64 `1e-12 * max|ref|`, lower precisions
`16 eps(dtype) * max|ref|`). Hypothesis is derandomized: the same examples every run.

On a mismatch the first failing case is shrunk and explained: the checker recomputes the
output under single changed rules (top-left causal alignment, the window started from the
last or first query, no window, a window one key off, dead columns attended, the GQA head
`h % Hk`) and names the one the kernel's output matches, or else probes which single key
added to or removed from the reference's key set explains the first wrong query. Exit 0
pass, 1 mismatch, 2 bad usage.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
from collections.abc import Callable

LAYOUTS = ("varlen", "kvcache", "paged", "padded")
"""As `gpu.layouts.LAYOUTS` (repeated so that building the parser imports no torch)."""
DTYPE_NAMES = ("bfloat16", "float16", "float32", "float64")


class KernelUsageError(ValueError):
    """Bad usage of check-kernel (exit 2): the message names the argument."""


# ----------------------------------------------------------------------------- command


def load_function(spec: str) -> Callable:
    """`pkg.mod:fn` -> the callable; KernelUsageError naming what is missing."""
    mod_name, sep, attr = spec.partition(":")
    if not sep or not mod_name or not attr:
        raise KernelUsageError(
            f"function {spec!r} must be written module:function (e.g. mypkg.attn:varlen)"
        )
    try:
        obj = importlib.import_module(mod_name)
    except Exception as exc:
        raise KernelUsageError(
            f"function {spec!r}: cannot import module {mod_name!r}: {type(exc).__name__}: {exc}"
        ) from exc
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise KernelUsageError(
                f"function {spec!r}: module {mod_name!r} has no attribute {attr!r}"
            )
        obj = getattr(obj, part)
    if not callable(obj):
        raise KernelUsageError(f"function {spec!r} is a {type(obj).__name__}, not callable")
    return obj


def check_signature(fn: Callable, spec: str, layout: str, page_size: int | None,
                    sinks: bool = False) -> None:
    """KernelUsageError (naming the argument) unless `fn` accepts the layout's call (with
    `sinks=` too when `sinks`)."""
    import torch

    from raggedspec.gpu.layouts import to_layout
    from raggedspec.kernel_cases import Case, build_batch

    case = Case((1,), (2,), None, 1, 1, 8, page_size or (1 if layout == "paged" else None), 0,
                sinks)
    args, kwargs = to_layout(build_batch(case, torch.float64, "cpu"), layout, case.page_size).call()
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return  # a builtin without a signature: its first call will tell
    try:
        sig.bind(*args, **kwargs)
    except TypeError as exc:
        names = list(kwargs)
        raise KernelUsageError(
            f"function {spec!r} cannot be called with the {layout} layout's arguments "
            f"({len(args)} positional, keywords {', '.join(names)}): {exc}"
        ) from exc


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "check-kernel",
        help="check an attention kernel in a standard layout against "
        "the reference on generated speculative-decoding batches",
    )
    p.add_argument("function", help="the kernel or its adapter, module:function; or a built-in "
                                    "torch target in the padded layout: torch:sdpa, "
                                    "torch:sdpa-math, torch:sdpa-flash, torch:sdpa-efficient, "
                                    "torch:sdpa-cudnn (CUDA), torch:flex")
    p.add_argument(
        "--layout", required=True, choices=LAYOUTS, help="the layout the function speaks"
    )
    p.add_argument("--dtype", default="float32", choices=DTYPE_NAMES)
    p.add_argument("--device", default="cpu", help="torch device of the tensors (default cpu)")
    p.add_argument(
        "--examples", type=int, default=100, help="generated batches, >= 1 (default 100)"
    )
    p.add_argument(
        "--page-size",
        type=int,
        default=None,
        help="fix the page size (paged; kvcache then always paged); default: drawn from "
        "1, 2, 4, 16 (kvcache: dense or paged)",
    )
    p.add_argument("--head-dim", type=int, default=16, help="head dimension D, >= 1 (default 16)")
    p.add_argument(
        "--max-query-len",
        type=int,
        default=None,
        help="cap each row's query length (1 for a decode-only kernel)",
    )
    p.add_argument(
        "--sinks",
        action="store_true",
        help="also draw per-head attention sinks, passed as sinks= (padded layout only)",
    )
    return p


def run(args) -> int:
    """The command: 0 pass, 1 mismatch (report on stdout), 2 bad usage (KernelUsageError)."""
    for name, value, low in (
        ("--examples", args.examples, 1),
        ("--head-dim", args.head_dim, 1),
        ("--page-size", args.page_size, 1),
        ("--max-query-len", args.max_query_len, 1),
    ):
        if value is not None and value < low:
            raise KernelUsageError(f"{name} {value} must be >= {low}")
    if args.page_size is not None and args.layout not in ("kvcache", "paged"):
        raise KernelUsageError(
            f"--page-size {args.page_size}: the {args.layout} layout has no pages")
    if args.sinks and args.layout != "padded":
        raise KernelUsageError(f"--sinks: the {args.layout} layout has no argument for sinks "
                               f"(only padded carries them)")
    import torch

    from raggedspec.kernel_cases import check

    try:
        torch.empty(0, device=args.device)
    except (RuntimeError, ValueError) as exc:
        raise KernelUsageError(f"--device {args.device!r} is not usable here: {exc}") from exc
    from raggedspec.kernel_adapters import torch_target

    try:
        fn = (torch_target(args.function, args.layout, args.device)
              or load_function(args.function))
    except ValueError as exc:
        raise KernelUsageError(str(exc)) from exc
    check_signature(fn, args.function, args.layout, args.page_size, args.sinks)
    result = check(
        fn,
        args.layout,
        args.dtype,
        args.device,
        args.examples,
        args.page_size,
        args.head_dim,
        args.max_query_len,
        args.sinks,
    )
    if result.passed:
        print(f"{args.function}: {result.report} ({args.dtype}, {args.device})")
        return 0
    print(
        f"{args.function}: MISMATCH in the {args.layout} layout ({args.dtype}, {args.device}), "
        f"first failing case after shrinking ({result.examples} cases run):\n{result.report}"
    )
    return 1
