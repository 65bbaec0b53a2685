"""The generated verify batches of `raggedspec check-kernel` and the comparison of one
kernel output with the reference.

`cases(layout, ...)` draws a `Case` (per-row query and cache lengths, window, head counts,
page size, value seed); `build_batch` gives its tensors; `run_case` sends the batch through
the user's function in the layout and compares the live query slots with the reference
(`raggedspec.kernel_explain.attention_under`) under the tolerance of docs/conformance.md;
`check` runs the derandomized Hypothesis search and then eight fixed batches
(`explicit_cases`, what every run must reach), and returns the smallest failing case's report. See
`raggedspec.check_kernel` for the command and docs/kernels.md for the cases.
"""

from __future__ import annotations

import inspect
import traceback
from collections.abc import Callable
from dataclasses import dataclass, fields

import numpy as np
import torch
from hypothesis import HealthCheck, Phase, Verbosity, given, settings
from hypothesis import strategies as st

from raggedspec.gpu.layouts import Paged, VerifyBatch, to_layout
from raggedspec.kernel_explain import as_float64, attention_under, explain, live_slots

DTYPES = {
    "float64": torch.float64,
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
EPS = {"float64": 2.0**-52, "float32": 2.0**-23, "bfloat16": 2.0**-7, "float16": 2.0**-10}
FLOAT64_RTOL, LOW_PRECISION_K = 1e-12, 16.0
DEAD_K, DEAD_V = 3.0, 8.0
"""Offsets of the values in dead key columns: a kernel reading them is visibly wrong."""


def tolerance(dtype: str, scale: float) -> float:
    """docs/conformance.md: float64 `1e-12 * scale`, else `16 eps(dtype) * scale`."""
    return (FLOAT64_RTOL if dtype == "float64" else LOW_PRECISION_K * EPS[dtype]) * scale


# ----------------------------------------------------------------------------- cases


@dataclass(frozen=True)
class Case:
    """One generated verify batch, before its values are drawn from `seed`."""

    q_lens: tuple[int, ...]
    kv_lens: tuple[int, ...]
    window: int | None
    kv_heads: int
    group: int
    head_dim: int
    page_size: int | None
    seed: int
    sinks: bool = False


@st.composite
def cases(
    draw,
    layout: str,
    page_size: int | None = None,
    head_dim: int = 16,
    max_query_len: int | None = None,
    sinks: bool = False,
) -> Case:
    """Verify batches: depth 1..7, 1..6 rows, q_len = accepted + 1 (0 and all accepted as
    corners) or 0 for a row not verifying, at least one row with a query; cache history by
    shape (short, far apart, past 256, on a page boundary); window None, 1, 2, near the
    depth, or up to 64; Hk in {1, 2} with 1..8 query heads each. `max_query_len` caps q_len
    (1 for a decode-only kernel). "kvcache" draws dense or paged; "paged" always pages.
    With `sinks` (the padded layout only) a batch has per-head sinks or none."""
    depth = draw(st.integers(1, 7))
    cap = depth + 1 if max_query_len is None else max(1, min(depth + 1, max_query_len))
    n = draw(st.integers(1, 6))
    corner = draw(st.sampled_from(["any", "all_rejected", "all_accepted"]))
    if corner == "all_rejected":
        accepted = [0] * n
    elif corner == "all_accepted":
        accepted = [depth] * n
    else:
        accepted = draw(st.lists(st.integers(0, depth), min_size=n, max_size=n))
    q_lens = [min(a + 1, cap) for a in accepted]
    idle = draw(st.lists(st.booleans(), min_size=n, max_size=n))
    if not all(idle):
        q_lens = [0 if e else ql for e, ql in zip(idle, q_lens, strict=True)]
    if layout == "paged" or (layout == "kvcache" and page_size is None and draw(st.booleans())):
        ps = page_size or draw(st.sampled_from([1, 2, 4, 16]))
    else:
        ps = page_size if layout == "kvcache" else None
    shape = draw(st.sampled_from(["short", "far_apart", "past_bf16", "page_edge"]))
    history = []
    for i, ql in enumerate(q_lens):
        if shape == "far_apart":
            h = draw(st.integers(0, 2)) if i == 0 else draw(st.integers(200, 300))
        elif shape == "past_bf16":
            h = draw(st.integers(250, 300))
        elif shape == "page_edge":
            edge = draw(st.integers(0, 4)) * (ps or 16) + draw(st.sampled_from([-1, 0, 1]))
            h = max(0, edge - ql)
        else:
            h = draw(st.integers(0, 24))
        history.append(h)
    kv_lens = [h + ql for h, ql in zip(history, q_lens, strict=True)]
    window = draw(
        st.one_of(
            st.none(), st.sampled_from([1, 2, depth, depth + 1, depth + 2]), st.integers(1, 64)
        )
    )
    kv_heads = draw(st.sampled_from([1, 2]))
    group = draw(st.integers(1, 8))
    seed = draw(st.integers(0, 2**16 - 1))
    has_sinks = sinks and draw(st.booleans())
    return Case(tuple(q_lens), tuple(kv_lens), window, kv_heads, group, head_dim, ps, seed,
                has_sinks)


PAGE_SIZES = (1, 2, 4, 16)


def explicit_cases(layout: str, page_size: int | None = None, head_dim: int = 16,
                   max_query_len: int | None = None, sinks: bool = False) -> list[Case]:
    """Eight fixed batches run after the generated ones, so that every query length 1..8
    (as capped), GQA ratio 1..8, both KV head counts, every page size, the window edges
    (1, 2, depth, depth + 1, depth + 2, 64, none) and each cache shape (short, past 256, on a
    page boundary, one before and one after it) are reached whatever the draw. Case k
    (1..8): rows of `min(k, cap)`, 0 and 1 queries."""
    cap = 8 if max_query_len is None else max(1, min(8, max_query_len))
    out = []
    for k in range(1, 9):
        q = min(k, cap)
        if layout == "paged":
            ps = page_size or PAGE_SIZES[k % 4]
        elif layout == "kvcache":
            ps = page_size or (None if k % 2 else PAGE_SIZES[(k // 2) % 4])
        else:
            ps = None
        edge = 3 * (ps or 16) + (k % 3) - 1  # a page boundary, one before, one after
        kv = [(q + 5, 3, 4), (q + 260, 257, 300), (max(edge, q), edge, max(edge, 1)),
              (q, 0, 1)][k % 4]
        window = [None, 1, 2, max(q - 1, 1), q, q + 1, 64, None][k - 1]
        out.append(Case((q, 0, min(1, cap)), kv, window, 1 if k <= 4 else 2, k, head_dim, ps,
                        k, sinks and k % 2 == 0))
    return out


def build_batch(case: Case, dtype: torch.dtype, device: str) -> VerifyBatch:
    """The case's tensors: N(0, 1) values rounded to `dtype` (so the float64 reference sees
    exactly what the kernel sees); dead key columns `DEAD_K + N(0,1)`, values `DEAD_V + N`;
    sinks `N(0, 1) + 1` per query head when the case has them."""
    g = torch.Generator().manual_seed(case.seed)
    b, hk, d = len(case.q_lens), case.kv_heads, case.head_dim
    t_q, t = max(case.q_lens), max(case.kv_lens)
    q = torch.randn((b, hk * case.group, t_q, d), generator=g, dtype=torch.float64)
    k = torch.randn((b, hk, t, d), generator=g, dtype=torch.float64)
    v = torch.randn((b, hk, t, d), generator=g, dtype=torch.float64)
    for i, n in enumerate(case.kv_lens):
        k[i, :, : t - n] += DEAD_K
        v[i, :, : t - n] += DEAD_V
    sinks = torch.randn(hk * case.group, generator=g, dtype=torch.float64) + 1.0
    q, k, v, sinks = (x.to(dtype).to(device) for x in (q, k, v, sinks))
    return VerifyBatch(q, k, v, list(case.q_lens), list(case.kv_lens), case.window,
                       sinks if case.sinks else None)


# ----------------------------------------------------------------------------- running


def short_list(values: list, limit: int = 16) -> str:
    """`values` in full up to `limit` entries, else the first `limit` and the count."""
    if len(values) <= limit:
        return str(values)
    return f"[{', '.join(map(str, values[:limit]))}, ... ({len(values)} values)]"


def _show(x) -> str:
    if isinstance(x, torch.Tensor):
        if x.is_floating_point():
            return f"{str(x.dtype).removeprefix('torch.')} {list(x.shape)}"
        if x.dim() == 2:
            return "[" + ", ".join(short_list(r) for r in x.tolist()) + "]"
        return short_list(x.tolist())
    return repr(x)


def show_layout(obj) -> str:
    """The layout's fields, integer arrays in full, float tensors as dtype and shape."""
    return "\n".join(f"  {f.name} = {_show(getattr(obj, f.name))}" for f in fields(obj))


FLASHINFER_NAMES = ("paged_kv_indptr", "paged_kv_indices", "paged_kv_last_page_len")
"""FlashInfer's names of the paged layout's `kv_indptr`, `kv_indices`, `kv_last_page_len`."""


def layout_call(fn: Callable, arrays) -> tuple[tuple, dict]:
    """`fn`'s call of the layout: `arrays.call()`, except that a paged-layout function
    whose signature names FlashInfer's `paged_kv_indptr`, `paged_kv_indices`,
    `paged_kv_last_page_len` is given those three by those names."""
    args, kwargs = arrays.call()
    if not isinstance(arrays, Paged):
        return args, kwargs
    try:
        names = set(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return args, kwargs
    if not names & set(FLASHINFER_NAMES):
        return args, kwargs
    return args[:4], {**kwargs, **dict(zip(FLASHINFER_NAMES, args[4:7], strict=True))}


def raised_report(exc: Exception) -> str:
    """A kernel's exception in a report: the words and its traceback from the kernel's own
    frame on (the last 20 lines)."""
    own = exc.with_traceback(exc.__traceback__.tb_next)  # raised: a traceback from run_case on
    lines = "".join(traceback.format_exception(own)).rstrip().splitlines()
    return (f"raised by your kernel function: {type(exc).__name__}: {exc}\n  "
            + "\n  ".join(lines[-20:]))


def run_case(fn: Callable, layout: str, case: Case, dtype: str, device: str) -> str | None:
    """None if `fn` matches the reference on this case, else the failure report."""
    batch = build_batch(case, DTYPES[dtype], device)
    arrays = to_layout(batch, layout, case.page_size, seed=case.seed)
    args, kwargs = layout_call(fn, arrays)
    head = (
        f"q_lens {list(case.q_lens)}, kv_lens {list(case.kv_lens)}, window {case.window}, "
        f"Hq {case.kv_heads * case.group}, Hk {case.kv_heads}, D {case.head_dim}"
        + (f", page_size {case.page_size}" if case.page_size else "")
        + f"\n{show_layout(arrays)}"
    )
    try:
        out = fn(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001 (a kernel failing on a batch is a finding)
        return f"{head}\n{raised_report(exc)}"
    if isinstance(out, tuple) and out:
        out = out[0]  # (out, lse) and the like
    if not isinstance(out, torch.Tensor):
        return f"{head}\nthe function returned a {type(out).__name__}, not a tensor"
    try:
        got = as_float64(arrays.output_to_batch(out))
    except ValueError as exc:
        return f"{head}\nthe output does not have the {layout} layout's shape: {exc}"
    ref = attention_under(batch)
    live = live_slots(batch)
    bound = tolerance(dtype, float(np.where(live, np.abs(ref), 0.0).max()))
    err = np.where(live, np.abs(got - ref), 0.0)
    if np.isfinite(np.where(live, got, 0.0)).all() and err.max() <= bound:
        return None if bool(torch.isfinite(out).all()) else f"{head}\n{pad_report(out, layout)}"
    return (
        f"{head}\nmax error {float(np.nan_to_num(err, nan=np.inf).max()):.3g}, bound {bound:.3g}\n"
        + explain(batch, got, ref, bound, arrays)
    )


def pad_report(out: torch.Tensor, layout: str) -> str:
    """Why a non-finite value in the kernel's output fails although every live query is right:
    it lies in a padding query's slot (a query that sees no live key: a row's padding, or a
    row not verifying), and at the next layer that output is read as a key's value, where a
    masked NaN still poisons every live row (its weight 0 times NaN is NaN)."""
    at = [int(x) for x in torch.nonzero(~torch.isfinite(out))[0]]
    return (f"rule that differs: a query that sees no live key must give a finite output (0)\n"
            f"  the output ({layout} layout, shape {list(out.shape)}) is {out[tuple(at)].item()} "
            f"at {at}, a padding query's slot (every live query matches the reference); the "
            f"next layer reads it as a value, and a masked NaN still poisons every live row "
            f"(0 x NaN = NaN)")


@dataclass
class CheckResult:
    passed: bool
    examples: int
    report: str


class _Mismatch(AssertionError):
    pass


def _fixed_cases(fn: Callable, layout: str, fixed: list[Case], dtype: str, device: str,
                 meter: _Meter) -> str | None:
    """Run the fixed cases after the search; the first failure's report (not shrunk: a
    generated case that fails is found and shrunk first), else None."""
    for case in fixed:
        meter.case()
        report = run_case(fn, layout, case, dtype, device)
        if report is not None:
            return f"(a fixed case, not shrunk)\n{report}"
    return None


class _Meter:
    """check()'s progress: the generated cases against `examples`, then, after the first
    mismatch, the shrinking search's count (no total). Silent without a factory."""

    def __init__(self, progress: Callable | None, layout: str, examples: int) -> None:
        self.make, self.examples, self.ran, self.first = progress, examples, 0, None
        self.bar = None if progress is None else progress(f"check-kernel {layout}", "case")

    def case(self) -> None:
        self.ran += 1
        if self.bar is None:
            return
        if self.first is None:
            self.bar(min(self.ran, self.examples), self.examples)
        else:
            self.bar(self.ran - self.first, None)

    def mismatch(self) -> None:
        """The first failing case: end the count there and start the shrinking one."""
        if self.first is not None:
            return
        self.first = self.ran
        if self.bar is not None:
            self.bar.close(f"a mismatch at case {self.ran}; shrinking it to the smallest "
                           "failing case")
            self.bar = self.make("shrinking", "case tried")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def check(
    fn: Callable,
    layout: str,
    dtype: str = "float32",
    device: str = "cpu",
    examples: int = 100,
    page_size: int | None = None,
    head_dim: int = 16,
    max_query_len: int | None = None,
    sinks: bool = False,
    progress: Callable | None = None,
) -> CheckResult:
    """Run `examples` derandomized cases of `layout` through `fn`; on a failure Hypothesis
    shrinks it and the report is that of the smallest failing case. `progress(label, unit)`
    gives a `raggedspec.progress.Progress` for the count of cases (none: silent)."""
    meter, reports = _Meter(progress, layout, examples), []
    fixed = explicit_cases(layout, page_size, head_dim, max_query_len, sinks)[: examples // 4]

    @settings(
        max_examples=max(1, examples - len(fixed)),
        derandomize=True,
        database=None,
        deadline=None,
        suppress_health_check=list(HealthCheck),
        verbosity=Verbosity.quiet,
        phases=[Phase.explicit, Phase.generate, Phase.shrink],
        report_multiple_bugs=False,
        print_blob=False,
    )
    @given(case=cases(layout, page_size, head_dim, max_query_len, sinks))
    def prop(case: Case) -> None:
        meter.case()
        report = run_case(fn, layout, case, dtype, device)
        if report is not None:
            meter.mismatch()
            reports.append(report)
            raise _Mismatch(report)

    try:
        prop()
        report = _fixed_cases(fn, layout, fixed, dtype, device, meter)
    except _Mismatch:
        report = reports[-1]
    finally:
        meter.close()
    if report is not None:
        return CheckResult(False, meter.ran, report)
    return CheckResult(
        True, meter.ran, f"pass: {meter.ran} generated {layout} batches match the reference"
    )
