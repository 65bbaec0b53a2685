"""`raggedspec check-kernel`: every built-in adapter passes on the CPU, kernels with a known
wrong rule fail with that rule named, the run is derandomized, and bad usage exits 2 with
the argument named. The adapters below with a wrong rule are written the way the bug is
written in real engines (torch's `is_causal=True` is top-left aligned; a dropped
`cache_leftpad`; a KV head chosen by `h % Hk`; a page table read one entry late)."""

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


def torch_is_causal_varlen(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
):
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


def leftpad_dropped_kvcache(
    q,
    k_cache,
    v_cache,
    cache_seqlens=None,
    cache_leftpad=None,
    block_table=None,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
):
    return A.sdpa_kvcache(
        q,
        k_cache,
        v_cache,
        cache_seqlens=cache_seqlens,
        cache_leftpad=None,
        block_table=block_table,
        softmax_scale=softmax_scale,
        causal=causal,
        window_size=window_size,
    )


def modulo_heads_padded(
    q, k, v, attention_mask, position_ids, sliding_window=None, softmax_scale=None
):
    heads = torch.arange(q.shape[1]) % k.shape[1]
    return A.sdpa_padded(
        q, k[:, heads], v[:, heads], attention_mask, position_ids, sliding_window, softmax_scale
    )


def page_late_paged(
    q,
    k_pages,
    v_pages,
    qo_indptr,
    kv_indptr,
    kv_indices,
    kv_last_page_len,
    page_size=16,
    causal=True,
    window_left=-1,
    sm_scale=None,
):
    late = torch.cat([kv_indices[1:], kv_indices[:1]])
    return A.sdpa_paged(
        q,
        k_pages,
        v_pages,
        qo_indptr,
        kv_indptr,
        late,
        kv_last_page_len,
        page_size,
        causal,
        window_left,
        sm_scale,
    )


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
    assert not result.passed and "raised RuntimeError: empty row" in result.report


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
            "cannot import module 'no_such_pkg.attn'",
        ),
        (
            ["--layout", "varlen", "raggedspec.kernel_adapters:no_such_fn"],
            "has no attribute 'no_such_fn'",
        ),
        (["--layout", "varlen", "math:pi"], "is a float, not callable"),
        (["--layout", "varlen", "sdpa_varlen"], "must be written module:function"),
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
