"""`raggedspec check-kernel`: every built-in adapter passes on the CPU, kernels with a known
wrong rule fail with that rule named (a mis-aligned causal diagonal by where its offset comes
from), a kernel just past the documented tolerance fails, the default run reaches every
length, head count, window and page size the docs name, every kind of finding exits 1, the
run is derandomized and counted on stderr, FlashInfer's argument names are accepted, a
module in the working folder is found, and bad usage exits 2 with the argument named. The
adapters below with a wrong rule are written the way the bug is written in real engines
(torch's `is_causal=True` is top-left aligned; a dropped `cache_leftpad`; a KV head chosen
by `h % Hk`; a page table read one entry late)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from raggedspec import kernel_adapters as A
from raggedspec.kernel_cases import Case, check, run_case
from raggedspec.cli import main

BUILT_IN = [
    ("varlen", A.sdpa_varlen, 20),
    ("kvcache", A.sdpa_kvcache, 20),
    ("paged", A.sdpa_paged, 20),
    ("padded", A.sdpa_padded, 25),
    ("varlen", A.port_in_place_varlen, 20),
    ("varlen", A.flex_varlen, 4),
]


@pytest.mark.slow
@pytest.mark.rule("raggedspec check-kernel")
@pytest.mark.parametrize("layout, fn, n", BUILT_IN, ids=[f"{f.__name__}" for _, f, _ in BUILT_IN])
def test_built_in_adapter_passes(layout, fn, n):
    result = check(fn, layout, "float32", examples=n)
    assert result.passed, result.report
    assert result.examples == n


@pytest.mark.rule("raggedspec check-kernel")
@pytest.mark.parametrize("dtype", ["float64", "bfloat16"])
def test_built_in_adapter_passes_other_dtypes(dtype):
    result = check(A.sdpa_padded, "padded", dtype, examples=15)
    assert result.passed, result.report


# ----------------------------------------------------------------------------- wrong kernels


def torch_is_causal_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           softmax_scale=None, causal=False, window_size=(-1, -1)):
    """Per row, SDPA with `is_causal=True`: torch aligns that mask top-left."""
    out = torch.zeros_like(q)
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for b in range(len(cq) - 1):
        if cq[b + 1] > cq[b]:
            qq = q[cq[b] : cq[b + 1]].transpose(0, 1)
            kk = k[ck[b] : ck[b + 1]].transpose(0, 1)
            vv = v[ck[b] : ck[b + 1]].transpose(0, 1)
            out[cq[b] : cq[b + 1]] = F.scaled_dot_product_attention(
                qq, kk, vv, is_causal=True, scale=softmax_scale, enable_gqa=True
            ).transpose(0, 1)
    return out


def leftpad_dropped_kvcache(*args, cache_leftpad=None, **kw):
    """sdpa_kvcache with `cache_leftpad` dropped: the dead prefix read as keys."""
    return A.sdpa_kvcache(*args, cache_leftpad=None, **kw)


def modulo_heads_padded(
    q, k, v, attention_mask, position_ids, sliding_window=None, softmax_scale=None
):
    heads = torch.arange(q.shape[1]) % k.shape[1]
    return A.sdpa_padded(
        q, k[:, heads], v[:, heads], attention_mask, position_ids, sliding_window, softmax_scale
    )


def page_late_paged(q, k_pages, v_pages, qo_indptr, kv_indptr, kv_indices, *rest, **kw):
    """sdpa_paged reading each row's page list one entry late."""
    late = torch.cat([kv_indices[1:], kv_indices[:1]])
    return A.sdpa_paged(q, k_pages, v_pages, qo_indptr, kv_indptr, late, *rest, **kw)


def window_from_last_query_padded(q, k, v, attention_mask, position_ids, sliding_window=None,
                                  softmax_scale=None):
    """The window start computed once per row, from its last query (the decode habit)."""
    key_pos = attention_mask.long().cumsum(dim=1) - 1
    qp, kp = position_ids[:, :, None], key_pos[:, None, :]
    ok = attention_mask[:, None, :] & (kp <= qp) & (qp >= 0)
    if sliding_window is not None:
        ok &= kp > position_ids[:, -1:, None] - sliding_window
    heads = torch.arange(q.shape[1]) // (q.shape[1] // k.shape[1])
    out = F.scaled_dot_product_attention(q, k[:, heads], v[:, heads], attn_mask=ok[:, None],
                                         scale=softmax_scale)
    return torch.where(ok.any(dim=2)[:, None, :, None], out, torch.zeros_like(out))


def window_ignored_varlen(*args, window_size=(-1, -1), **kw):
    return A.sdpa_varlen(*args, window_size=(-1, 0), **kw)


def window_one_wider_varlen(*args, window_size=(-1, -1), **kw):
    left = window_size[0] + 1 if window_size[0] >= 0 else -1
    return A.sdpa_varlen(*args, window_size=(left, 0), **kw)


def not_causal_varlen(*args, causal=False, window_size=(-1, -1), **kw):
    return A.sdpa_varlen(*args, causal=False, window_size=(window_size[0], -1), **kw)


@pytest.mark.rule("raggedspec check-kernel")
@pytest.mark.parametrize(
    "layout, fn, words",
    [
        ("varlen", not_causal_varlen, "not causal"),
        ("padded", window_from_last_query_padded, "the window starts from the row's last query"),
        ("varlen", torch_is_causal_varlen, "causal aligned top-left"),
        ("padded", modulo_heads_padded, "query head h reads KV head h % Hk"),
    ],
)
def test_wrong_rule_is_named(layout, fn, words):
    result = check(fn, layout, "float32", examples=100)
    assert not result.passed
    named = [line for line in result.report.splitlines()
             if line.startswith("rule that differs:") or line.startswith("  (on this case")]
    assert any(words in line for line in named), result.report
    assert "row " in result.report and "q_lens" in result.report


NO_WINDOW = "row 0, query 0 (position 3): attends keys 0, 1 (2 keys), which its window of 2"
ONE_WIDER = "row 0, query 0 (position 3): attends key 1, which its window of 2 excludes (keys 2..3)"
DEAD = "row 1, query 0 (position 1): attends dead columns 0, 1, 2 (the row's lead is 3"


@pytest.mark.rule("raggedspec check-kernel")
@pytest.mark.parametrize("layout, fn, window, words, expect_keys", [
    ("varlen", window_ignored_varlen, 2, "no sliding window", NO_WINDOW),
    ("varlen", window_one_wider_varlen, 2, "the window keeps one key too many", ONE_WIDER),
    ("kvcache", leftpad_dropped_kvcache, None, "the dead prefix is attended", DEAD),
])
def test_wrong_rule_named_on_a_fixed_case(layout, fn, window, words, expect_keys):
    """Rows of 2 and 1 queries over 5 and 2 keys (row 0's queries at positions 3 and 4, row
    1's at 1, row 1's lead 3): the words name the first query where the rule shows and the
    keys it wrongly attends (with a window of 2, dead columns are outside every window)."""
    case = Case((2, 1), (5, 2), window, 1, 2, 16, None, 7)
    report = run_case(fn, layout, case, "float32", "cpu")
    assert report is not None and f"rule that differs: {words}" in report, report
    assert expect_keys in report, report


@pytest.mark.rule("raggedspec check-kernel")
def test_page_table_read_late_is_caught():
    result = check(page_late_paged, "paged", "float32", examples=100)
    assert not result.passed and "kv_indices = " in result.report, result.report
    late = "page table: each kv_indices entry is read one entry late"
    assert late in result.report, result.report
    assert "its page 0 is page id" in result.report


@pytest.mark.rule("raggedspec check-kernel")
def test_same_examples_every_run():
    first = check(torch_is_causal_varlen, "varlen", "float32", examples=50)
    second = check(torch_is_causal_varlen, "varlen", "float32", examples=50)
    assert (first.examples, first.report) == (second.examples, second.report)


@pytest.mark.rule("raggedspec check-kernel")
@pytest.mark.parametrize("fn, words", [
    (lambda q, *args, **kw: None, "the function returned a NoneType, not a tensor"),
    (lambda q, *args, **kw: q[None], "the output does not have the varlen layout's shape"),
])
def test_output_of_the_wrong_kind_is_a_mismatch(fn, words):
    result = check(fn, "varlen", "float32", examples=5)
    assert not result.passed and words in result.report, result.report


@pytest.mark.rule("raggedspec check-kernel")
def test_kernel_that_raises_is_a_mismatch():
    def refuses_empty_rows(q, k, v, cu_seqlens_q, *rest, **kw):
        if bool((cu_seqlens_q[1:] == cu_seqlens_q[:-1]).any()):
            raise RuntimeError("empty row")
        return A.sdpa_varlen(q, k, v, cu_seqlens_q, *rest, **kw)

    result = check(refuses_empty_rows, "varlen", "float32", examples=100)
    assert not result.passed, result.report
    assert "raised by your kernel function: RuntimeError: empty row" in result.report
    assert "in refuses_empty_rows" in result.report  # its traceback, from its own frame


@pytest.mark.rule("raggedspec check-kernel")
def test_the_adapter_of_docs_kernels_md_passes():
    """The adapter example of docs/kernels.md, run as written."""
    text = (Path(__file__).resolve().parent.parent / "docs" / "kernels.md").read_text()
    section = text.split("## Writing an adapter", 1)[1]
    code = section.split("```python", 1)[1].split("```", 1)[0]
    namespace: dict = {}
    exec(compile(code, "docs/kernels.md", "exec"), namespace)
    result = check(namespace["adapter"], "padded", "float32", examples=25)
    assert result.passed, result.report


@pytest.mark.rule("raggedspec check-kernel")
def test_the_command_names_the_layouts_and_dtypes_it_runs():
    """The parser's lists (kept free of torch imports) are those of the layouts and cases."""
    from raggedspec.gpu.layouts import LAYOUTS
    from raggedspec import check_kernel
    from raggedspec.kernel_cases import DTYPES

    assert check_kernel.LAYOUTS == LAYOUTS
    assert set(check_kernel.DTYPE_NAMES) == set(DTYPES)


@pytest.mark.rule("raggedspec check-kernel")
def test_sinks_in_the_padded_layout():
    """With sinks drawn, the built-in padded adapter passes, and one that drops them fails
    with that named."""
    result = check(A.sdpa_padded, "padded", "float32", examples=20, sinks=True)
    assert result.passed, result.report

    def drops_sinks(*args, sinks=None, **kw):
        return A.sdpa_padded(*args, **kw)

    result = check(drops_sinks, "padded", "float32", examples=50, sinks=True)
    assert not result.passed
    assert "rule that differs: the attention sinks are dropped" in result.report, result.report


# ----------------------------------------------------------------------------- the command


@pytest.mark.rule("raggedspec check-kernel")
def test_command_pass_and_mismatch_exit_codes(capsys):
    assert (
        main(
            [
                "check-kernel",
                "--layout",
                "padded",
                "raggedspec.kernel_adapters:sdpa_padded",
                "--examples",
                "5",
            ]
        )
        == 0
    )
    assert "pass: 5 generated padded batches" in capsys.readouterr().out
    assert (
        main(
            [
                "check-kernel",
                "--layout",
                "varlen",
                "raggedspec.conformance.test_check_kernel:torch_is_causal_varlen",
                "--examples",
                "30",
            ]
        )
        == 1
    )
    out = capsys.readouterr().out
    assert "MISMATCH in the varlen layout" in out and "cu_seqlens_q = [" in out


@pytest.mark.rule("raggedspec check-kernel")
@pytest.mark.parametrize(
    "argv, words",
    [
        (
            ["--layout", "blocked", "raggedspec.kernel_adapters:sdpa_varlen"],
            "invalid choice: 'blocked'",
        ),
        (
            ["--layout", "varlen", "no_such_pkg.attn:varlen"],
            "cannot import 'no_such_pkg.attn'",
        ),
        (
            ["--layout", "varlen", "raggedspec.kernel_adapters:no_such_fn"],
            "has no attribute 'no_such_fn'",
        ),
        (["--layout", "varlen", "math:pi"], "math.pi is not callable (it is a float"),
        (["--layout", "varlen", "sdpa_varlen"], "must be written module:function"),
        (["--layout", "varlen", "torch:sdpa"], "run it with --layout padded, not varlen"),
        (
            ["--layout", "paged", "raggedspec.kernel_adapters:sdpa_varlen"],
            "unexpected keyword argument 'page_size'",
        ),
        (["--layout", "kvcache", "raggedspec.kernel_adapters:sdpa_padded"], "cache_seqlens"),
        (
            ["--layout", "varlen", "raggedspec.kernel_adapters:sdpa_varlen", "--examples", "0"],
            "--examples 0",
        ),
        (
            ["--layout", "varlen", "raggedspec.kernel_adapters:sdpa_varlen", "--examples",
             "10000000"],
            "--examples 10000000: must be an integer in 1..1000000",
        ),
        (
            ["--layout", "varlen", "raggedspec.kernel_adapters:sdpa_varlen", "--head-dim",
             str(2**70)],
            f"--head-dim {2**70}: must be an integer in 1..1024",
        ),
        (
            ["--layout", "varlen", "raggedspec.kernel_adapters:sdpa_varlen", "--page-size", "4"],
            "--page-size 4: the varlen layout has no pages",
        ),
        (
            ["--layout", "varlen", "raggedspec.kernel_adapters:sdpa_varlen", "--sinks"],
            "the varlen layout has no argument for sinks",
        ),
        (
            [
                "--layout",
                "padded",
                "raggedspec.conformance.test_check_kernel:modulo_heads_padded",
                "--sinks",
            ],
            "unexpected keyword argument 'sinks'",
        ),
    ],
)
def test_command_bad_usage(argv, words, capsys):
    assert main(["check-kernel", *argv]) == 2
    assert words in capsys.readouterr().err


@pytest.mark.rule("raggedspec check-kernel")
@pytest.mark.skipif(
    not torch.cuda.is_available() or importlib.util.find_spec("flash_attn") is None,
    reason="flash-attn needs CUDA and the flash_attn package",
)
@pytest.mark.parametrize(
    "layout, fn", [("varlen", A.flash_attn_varlen), ("kvcache", A.flash_attn_kvcache)]
)
def test_flash_attn(layout, fn):
    result = check(fn, layout, "bfloat16", "cuda", examples=50, head_dim=64, page_size=256)
    assert result.passed, result.report


@pytest.mark.rule("raggedspec check-kernel")
@pytest.mark.skipif(
    not torch.cuda.is_available() or importlib.util.find_spec("flashinfer") is None,
    reason="FlashInfer needs CUDA and the flashinfer package",
)
@pytest.mark.parametrize("fn, cap", [(A.flashinfer_prefill, None), (A.flashinfer_decode, 1)])
def test_flashinfer(fn, cap):
    result = check(fn, "paged", "bfloat16", "cuda", examples=50, head_dim=64, max_query_len=cap)
    assert result.passed, result.report


# ------------------------------------------------------------------ tolerances are tight
# The documented bound (docs/conformance.md): float64 1e-12 * max|ref|, else 16 eps(dtype) *
# max|ref|. A kernel only slightly wrong, just past that bound, must fail; one well inside it
# must pass.

EPS32 = 2.0**-23


def scaled_varlen(rel: float):
    """sdpa_varlen with its output scaled by (1 + rel): an error of rel * |out|."""
    def fn(*args, **kw):
        return A.sdpa_varlen(*args, **kw) * (1.0 + rel)
    return fn


def bf16_inside_varlen(q, k, v, *rest, **kw):
    """float32 in, float32 out, but computed in bfloat16 (a kernel's silent downcast)."""
    out = A.sdpa_varlen(q.to(torch.bfloat16), k.to(torch.bfloat16), v.to(torch.bfloat16),
                        *rest, **kw)
    return out.to(q.dtype)


@pytest.mark.rule("raggedspec check-kernel")
@pytest.mark.parametrize("dtype, rel, passes", [
    ("float64", 4e-12, False), ("float64", 2.5e-13, True),
    ("float32", 2 * 16 * EPS32, False), ("float32", 4 * EPS32, True),
])
def test_a_kernel_just_past_the_documented_bound_fails_and_one_inside_passes(dtype, rel, passes):
    result = check(scaled_varlen(rel), "varlen", dtype, examples=15)
    assert result.passed is passes, result.report
    if not passes:
        assert "max error" in result.report and "bound" in result.report


@pytest.mark.rule("raggedspec check-kernel")
def test_float32_inputs_computed_in_bfloat16_are_caught():
    result = check(bf16_inside_varlen, "varlen", "float32", examples=20)
    assert not result.passed, result.report


# ------------------------------------------------- the generator reaches what the docs name


def drawn(layout: str, monkeypatch, **kw) -> list[Case]:
    """The cases `check` runs at its default example count (the kernel never called)."""
    import raggedspec.kernel_cases as kc

    seen: list[Case] = []
    monkeypatch.setattr(kc, "run_case", lambda fn, lay, case, dtype, dev: seen.append(case))
    result = kc.check(None, layout, **kw)
    assert result.passed and result.examples == len(seen) == 100
    return seen


@pytest.mark.rule("raggedspec check-kernel")
@pytest.mark.parametrize("layout", ["varlen", "kvcache", "paged", "padded"])
def test_the_default_run_reaches_every_length_head_count_window_and_page_size(layout,
                                                                             monkeypatch):
    """docs/kernels.md "What it checks": query lengths 0..8 (accepted + 1, depth up to 7, and
    rows not verifying), 1..6 rows, 1 or 2 KV heads with 1..8 query heads each, windows none,
    1, 2 and wide ones up to 64, caches short, far apart and past 256; page sizes 1, 2, 4,
    16 (kvcache: dense too) with lengths on a page boundary, one before and one after."""
    cases = drawn(layout, monkeypatch)
    assert {q for c in cases for q in c.q_lens} == set(range(9))
    assert {len(c.q_lens) for c in cases} == set(range(1, 7))
    assert {c.kv_heads for c in cases} == {1, 2}
    assert {c.group for c in cases} == set(range(1, 9))
    windows = {c.window for c in cases}
    assert {None, 1, 2} <= windows and any(w is not None and 9 <= w <= 64 for w in windows)
    assert any(max(c.kv_lens) > 256 for c in cases)
    assert any(min(c.kv_lens) <= 2 and max(c.kv_lens) >= 200 for c in cases)
    sizes = {c.page_size for c in cases}
    if layout in ("varlen", "padded"):
        assert sizes == {None}
        return
    assert sizes == ({1, 2, 4, 16} | ({None} if layout == "kvcache" else set()))
    edges = {k % c.page_size for c in cases if c.page_size and c.page_size > 2
             for k in c.kv_lens if k >= c.page_size}
    assert {0, 1} <= edges and any(c.page_size - 1 in {k % c.page_size for k in c.kv_lens}
                                   for c in cases if c.page_size and c.page_size > 2)


@pytest.mark.rule("raggedspec check-kernel")
def test_sinks_are_drawn_in_some_batches_and_not_others(monkeypatch):
    cases = drawn("padded", monkeypatch, sinks=True)
    assert {c.sinks for c in cases} == {True, False}


# --------------------------------------------------- a mis-aligned causal diagonal, named


def offset_varlen(offset_of):
    """A varlen kernel that puts row b's query j at position `offset_of(lens, b, max_k) + j`
    (lens: every row's (q_len, kv_len)), its window moving with it."""
    def fn(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale=None,
           causal=False, window_size=(-1, -1)):
        out = torch.zeros_like(q)
        cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
        lens = [(cq[b + 1] - cq[b], ck[b + 1] - ck[b]) for b in range(len(cq) - 1)]
        for b, (ql, kl) in enumerate(lens):
            if ql:
                i = torch.arange(ql)[:, None] + offset_of(lens, b, max_seqlen_k)
                j = torch.arange(kl)[None, :]
                ok = (j <= i) & ((j > i - window_size[0] - 1) if window_size[0] >= 0 else True)
                out[cq[b]:cq[b + 1]] = A._attend(q[cq[b]:cq[b + 1]], k[ck[b]:ck[b + 1]],
                                                v[ck[b]:ck[b + 1]], ok, softmax_scale)
        return out
    return fn


row0_offset_varlen = offset_varlen(lambda lens, b, mk: next(k - q for q, k in lens if q))
widest_offset_varlen = offset_varlen(lambda lens, b, mk: mk - lens[b][0])
next_row_offset_varlen = offset_varlen(
    lambda lens, b, mk: lens[(b + 1) % len(lens)][1] - lens[(b + 1) % len(lens)][0])


@pytest.mark.rule("raggedspec check-kernel")
@pytest.mark.parametrize("fn, case, words", [
    (row0_offset_varlen, Case((1, 3), (3, 10), None, 1, 1, 16, None, 5),
     ["the causal diagonal: each row's offset is taken from row 0's offset kv_len - q_len = 2",
      "row 1 (10 keys, 3 queries): its queries sit at positions from 2 on, where its own "
      "lengths put them from 7 on"]),
    (widest_offset_varlen, Case((2, 1), (5, 20), 2, 1, 1, 16, None, 5),
     ["each row's offset is taken from the batch's widest row: max kv_len - the row's own q_len",
      "query 0 then attends no key, so its output is 0"]),
    (next_row_offset_varlen, Case((1, 2, 1), (4, 9, 6), None, 1, 1, 16, None, 5),
     ["rule that differs: the causal diagonal of row 1 is at offset 5, which is row 2's",
      "not its own kv_len - q_len = 7"]),
])
def test_a_misaligned_causal_diagonal_is_named_by_the_rule_it_breaks(fn, case, words):
    """A causal offset taken from another row, from the batch's widest row, or from a
    neighbour (found by fitting the row's offset): the report names where it comes from and
    the rule (bottom-right per row, from its own lengths), not only the symptom."""
    report = run_case(fn, "varlen", case, "float32", "cpu")
    assert report is not None
    for w in words + ["the rule: causal alignment is bottom-right per row"]:
        assert w in report, report


@pytest.mark.slow
@pytest.mark.rule("raggedspec check-kernel")
def test_a_search_names_the_offset_taken_from_another_row():
    result = check(row0_offset_varlen, "varlen", "float32", examples=100)
    assert not result.passed
    assert "row 0's offset kv_len - q_len" in result.report, result.report


# ------------------------------------------------------------- every finding sets the verdict


def no_tensor_varlen(q, *args, **kw):
    return None


def wrong_shape_varlen(q, *args, **kw):
    return q[None]


def not_finite_varlen(*args, **kw):
    return A.sdpa_varlen(*args, **kw) * float("nan")


def raises_varlen(*args, **kw):
    raise RuntimeError("unsupported head dim")


@pytest.mark.rule("raggedspec check-kernel")
@pytest.mark.parametrize("fn, words", [
    ("torch_is_causal_varlen", "rule that differs: causal aligned top-left"),
    ("raises_varlen", "raised by your kernel function: RuntimeError: unsupported head dim"),
    ("no_tensor_varlen", "returned a NoneType, not a tensor"),
    ("wrong_shape_varlen", "does not have the varlen layout's shape"),
    ("not_finite_varlen", "the output is not finite"),
    ("scaled_by_3e_6_varlen", "max error"),
])
def test_every_kind_of_finding_exits_1(fn, words, capsys):
    rc = main(["check-kernel", "--layout", "varlen",
               f"raggedspec.conformance.test_check_kernel:{fn}", "--examples", "10", "-q"])
    out = capsys.readouterr().out
    assert rc == 1 and "MISMATCH" in out and words in out, out


scaled_by_3e_6_varlen = scaled_varlen(3e-6)  # ~25 eps(float32): past the 16 eps bound


# ------------------------------------------------------------------- the command's manners


def flashinfer_named_paged(q, k_pages, v_pages, qo_indptr, *, paged_kv_indptr, paged_kv_indices,
                           paged_kv_last_page_len, page_size=16, causal=True, window_left=-1,
                           sm_scale=None):
    """FlashInfer's own argument names for the page table, keyword-only."""
    return A.sdpa_paged(q, k_pages, v_pages, qo_indptr, paged_kv_indptr, paged_kv_indices,
                        paged_kv_last_page_len, page_size, causal, window_left, sm_scale)


@pytest.mark.rule("raggedspec check-kernel")
def test_the_paged_layout_accepts_flashinfers_argument_names(capsys):
    rc = main(["check-kernel", "--layout", "paged",
               "raggedspec.conformance.test_check_kernel:flashinfer_named_paged",
               "--examples", "10", "-q"])
    assert rc == 0, capsys.readouterr().out


@pytest.mark.rule("raggedspec check-kernel")
def test_the_command_counts_its_cases_and_is_silent_with_quiet(capsys):
    argv = ["check-kernel", "--layout", "varlen", "raggedspec.kernel_adapters:sdpa_varlen",
            "--examples", "8"]
    assert main(argv) == 0
    err = capsys.readouterr().err  # not a terminal: plain lines, the last one complete
    assert "check-kernel varlen" in err and "8/8" in err and "\r" not in err
    assert main(argv + ["-q"]) == 0
    assert capsys.readouterr().err == ""
    assert main(["check-kernel", "--layout", "varlen",
                 "raggedspec.conformance.test_check_kernel:torch_is_causal_varlen",
                 "--examples", "30"]) == 1
    err = capsys.readouterr().err
    assert "a mismatch at case" in err and "shrinking" in err


@pytest.mark.slow
@pytest.mark.rule("raggedspec check-kernel")
def test_a_kernel_module_in_the_working_folder_is_found_by_the_console_script(tmp_path):
    from raggedspec.conformance.helpers import console_script

    work = tmp_path / "work"
    work.mkdir()
    (work / "myattn.py").write_text("from raggedspec.kernel_adapters import sdpa_varlen as good\n"
                                    "def bad(*a, **k):\n    raise ValueError('no such layout')\n")
    run = console_script(tmp_path)
    done = run("check-kernel", "--layout", "varlen", "myattn:good", "--examples", "5", cwd=work)
    assert done.returncode == 0 and "pass: 5 generated" in done.stdout, done.stderr
    done = run("check-kernel", "--layout", "varlen", "myattn:bad", "--examples", "5", cwd=work)
    assert done.returncode == 1 and "raised by your kernel function" in done.stdout
    assert "internal error" not in done.stderr


# ---------------------------------------------------- queries that see no live key (padding)


def sdpa_padded_nan_pads(q, k, v, attention_mask, position_ids, sliding_window=None,
                         softmax_scale=None, sinks=None):
    """Padded SDPA as engines often write it: every live query right, but a padding query
    (it sees no key) left as SDPA gives it, the softmax of nothing: NaN."""
    out = A.sdpa_padded(q, k, v, attention_mask, position_ids, sliding_window, softmax_scale,
                        sinks)
    pad = (position_ids < 0)[:, None, :, None].expand_as(out)  # the layout's padding queries
    return out.masked_fill(pad, float("nan"))


@pytest.mark.rule("raggedspec check-kernel")
def test_a_padding_query_left_nan_fails_though_every_live_query_is_right():
    """The generated padded batches carry padding query slots (rows with fewer queries than
    the widest, rows not verifying); a kernel whose padding rows are NaN gets every live query
    right and still fails, named by the rule: at the next layer that NaN is a value a masked
    key still multiplies by 0."""
    result = check(sdpa_padded_nan_pads, "padded", "float32", examples=20)
    assert not result.passed
    assert "a query that sees no live key must give a finite output (0)" in result.report
    assert "a padding query's slot" in result.report and "0 x NaN = NaN" in result.report
    assert check(A.sdpa_padded, "padded", "float32", examples=20).passed  # the same, zeroed


@pytest.mark.rule("raggedspec check-kernel")
def test_a_padding_query_is_a_row_of_zeros_for_the_port_and_the_reference():
    """On a case whose rows have 0, 1 and 3 queries (two rows carry padding slots), the port's
    in-place adapter and the padded SDPA adapter give finite outputs everywhere, zeros in the
    padding slots."""
    case = Case((0, 1, 3), (5, 9, 12), None, 1, 2, 16, None, 3)
    assert run_case(A.port_in_place_varlen, "varlen", case, "float64", "cpu") is None
    assert run_case(A.sdpa_padded, "padded", case, "float64", "cpu") is None
    assert "a padding query's slot" in run_case(sdpa_padded_nan_pads, "padded", case, "float64",
                                                "cpu")
