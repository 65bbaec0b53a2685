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
added to or removed from the reference's key set explains the first wrong query. A
mis-aligned causal diagonal is named by where its offset comes from (another row's, the
batch's widest row's, or a fitted offset). Progress: a count of the cases on stderr. Exit 0
pass, 1 mismatch (an exception raised by the function included, with its traceback), 2 bad
usage or a missing package (`pip install 'raggedspec[check-kernel]'`).
"""

from __future__ import annotations

import argparse
import inspect
from collections.abc import Callable

LAYOUTS = ("varlen", "kvcache", "paged", "padded")
"""As `gpu.layouts.LAYOUTS` (repeated so that building the parser imports no torch)."""
DTYPE_NAMES = ("bfloat16", "float16", "float32", "float64")
LIMITS = {"--examples": (1, 1_000_000), "--head-dim": (1, 1024), "--page-size": (1, 65536),
          "--max-query-len": (1, 2**31 - 1)}
"""The integer flags' ranges (a larger value is refused, never reduced)."""


class KernelUsageError(ValueError):
    """Bad usage of check-kernel (exit 2): the message names the argument."""


# ----------------------------------------------------------------------------- command


def load_function(spec: str) -> Callable:
    """`pkg.mod:fn` -> the callable, imported with the working folder first on sys.path
    (`reference.plugins`); KernelUsageError naming what is missing, PluginError when
    importing the module raises."""
    from raggedspec.reference.plugins import PluginSpecError, load_object

    mod_name, sep, attr = spec.partition(":")
    if not sep or not mod_name or not attr:
        raise KernelUsageError(
            f"function {spec!r} must be written module:function (e.g. mypkg.attn:varlen)"
        )
    try:
        return load_object(spec, "kernel function")
    except PluginSpecError as exc:
        raise KernelUsageError(f"function {spec!r}: {exc}") from None


def check_signature(fn: Callable, spec: str, layout: str, sinks: bool) -> None:
    """KernelUsageError (naming the argument) unless `fn` accepts the layout's call (with
    `sinks=` too when `sinks`). The probe is one small batch: a layout's argument names do
    not depend on its sizes (a kvcache call passes `block_table=` dense or paged)."""
    import torch

    from raggedspec.gpu.layouts import to_layout
    from raggedspec.kernel_cases import Case, build_batch, layout_call

    case = Case((1,), (2,), None, 1, 1, 8, 1, 0,  # pragma: no mutate (sizes: same arg names)
                sinks=sinks)
    batch = build_batch(case, torch.float64, "cpu")  # pragma: no mutate (values never read)
    args, kwargs = layout_call(fn, to_layout(batch, layout, case.page_size))
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
    p.add_argument("--dtype", default="float32", choices=DTYPE_NAMES,
                   help="dtype of the tensors your function receives (default float32); the "
                        "tolerance is 16 eps(dtype) * max|ref|, 1e-12 * max|ref| for float64")
    p.add_argument("--device", default="cpu", help="torch device of the tensors (default cpu)")
    p.add_argument(
        "--examples", type=int, default=100,
        help=f"generated batches, 1..{LIMITS['--examples'][1]} (default 100)"
    )
    p.add_argument(
        "--page-size",
        type=int,
        help="fix the page size (paged; kvcache then always paged), "
        f"1..{LIMITS['--page-size'][1]}; default: drawn from 1, 2, 4, 16 (kvcache: dense or "
        "paged)",
    )
    p.add_argument("--head-dim", type=int, default=16,
                   help=f"head dimension D, 1..{LIMITS['--head-dim'][1]} (default 16)")
    p.add_argument(
        "--max-query-len",
        type=int,
        help="cap each row's query length, >= 1 (1 for a decode-only kernel)",
    )
    p.add_argument(
        "--sinks",
        action="store_true",
        help="also draw per-head attention sinks, passed as sinks= (padded layout only)",
    )
    p.add_argument("-q", "--quiet", action="store_true",
                   help="no progress count on stderr (a bar on a terminal, else a line every "
                        "few seconds)")
    return p


def check_arguments(args) -> None:
    """KernelUsageError naming the flag, the value and what is allowed, for an integer out of
    its range or a flag the layout cannot carry."""
    for name, (low, high) in LIMITS.items():
        value = getattr(args, name[2:].replace("-", "_"))
        if value is not None and not low <= value <= high:
            raise KernelUsageError(f"{name} {value}: must be an integer in {low}..{high}")
    if args.page_size is not None and args.layout not in ("kvcache", "paged"):
        raise KernelUsageError(
            f"--page-size {args.page_size}: the {args.layout} layout has no pages")
    if args.sinks and args.layout != "padded":
        raise KernelUsageError(f"--sinks: the {args.layout} layout has no argument for sinks "
                               f"(only padded carries them)")


def run(args) -> int:
    """The command: 0 pass, 1 mismatch (report on stdout), 2 bad usage (KernelUsageError)."""
    check_arguments(args)
    import torch

    from raggedspec.kernel_cases import check
    from raggedspec.progress import Progress, progress_mode

    try:  # a tensor made there and read back (a meta device holds no data to compare)
        torch.zeros((), device=args.device).cpu()
    except (RuntimeError, ValueError) as exc:
        raise KernelUsageError(f"--device {args.device!r} is not usable here: {exc}") from exc
    from raggedspec.kernel_adapters import torch_target

    try:
        fn = (torch_target(args.function, args.layout, args.device)
              or load_function(args.function))
    except ValueError as exc:
        raise KernelUsageError(str(exc)) from exc
    check_signature(fn, args.function, args.layout, args.sinks)
    mode = progress_mode(args.quiet)
    result = check(fn, args.layout, args.dtype,
                   args.device,  # pragma: no mutate (one CPU device cannot tell placement apart)
                   args.examples, args.page_size, args.head_dim, args.max_query_len, args.sinks,
                   progress=lambda label, unit: Progress(label, mode, unit=unit))
    if result.passed:
        print(f"{args.function}: {result.report} ({args.dtype}, {args.device})")
        return 0
    print(
        f"{args.function}: MISMATCH in the {args.layout} layout ({args.dtype}, {args.device}), "
        f"first failing case after shrinking ({result.examples} cases run):\n{result.report}"
    )
    return 1
