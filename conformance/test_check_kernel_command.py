"""`raggedspec check-kernel`'s command as its docs promise (docs/kernels.md): each flag reaches
the check it names (a kernel that needs it passes with it and fails without), the defaults
its help states are those the check receives, the usage refusals name their argument (a
function without module or name, an unusable device, a signature the layout cannot call), a
kernel module raising on import is blamed on the user, the ranges a refusal names are
accepted at both ends, and the help is the one the docs show. The checking itself:
test_check_kernel.py."""

from __future__ import annotations

import inspect
import sys

import pytest

from raggedspec import kernel_adapters as A
from raggedspec.cli import main
from raggedspec.conformance.helpers import run_cli

# ------------------------------------------------- each flag reaches the check it names

ME = "raggedspec.conformance.test_check_kernel_command"


def decode_only_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, **kw):
    """A decode kernel: one query per row at most (`--max-query-len 1`)."""
    if max_seqlen_q > 1:
        raise ValueError(f"decode only: {max_seqlen_q} queries in a row")
    return A.sdpa_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, **kw)


def pages_of_4_paged(q, k_pages, v_pages, *rest, page_size=None, **kw):
    """A kernel built for one page size (`--page-size 4`)."""
    if page_size != 4 or k_pages.shape[1] != 4:
        raise ValueError(f"built for pages of 4, not {page_size}")
    return A.sdpa_paged(q, k_pages, v_pages, *rest, page_size=page_size, **kw)


def paged_only_kvcache(*args, block_table=None, **kw):
    """A kvcache kernel that reads its cache through a page table only."""
    if block_table is None:
        raise ValueError("no block_table: this kernel reads paged caches only")
    return A.sdpa_kvcache(*args, block_table=block_table, **kw)


def drops_sinks_padded(*args, sinks=None, **kw):
    return A.sdpa_padded(*args, **kw)


@pytest.mark.rule("raggedspec check-kernel")
@pytest.mark.parametrize("argv, code, words", [
    (["--layout", "varlen", f"{ME}:decode_only_varlen", "--max-query-len", "1"], 0, "pass"),
    (["--layout", "varlen", f"{ME}:decode_only_varlen"], 1, "decode only"),
    (["--layout", "paged", f"{ME}:pages_of_4_paged", "--page-size", "4"], 0, "pass"),
    (["--layout", "paged", f"{ME}:pages_of_4_paged"], 1, "built for pages of 4"),
    (["--layout", "kvcache", f"{ME}:paged_only_kvcache", "--page-size", "4"], 0, "pass"),
    (["--layout", "kvcache", f"{ME}:paged_only_kvcache"], 1, "reads paged caches only"),
    (["--layout", "padded", f"{ME}:drops_sinks_padded", "--sinks"], 1,
     "rule that differs: the attention sinks are dropped"),
    (["--layout", "padded", f"{ME}:drops_sinks_padded"], 0, "pass"),
])
def test_each_flag_reaches_the_check(argv, code, words, capsys):
    """`--max-query-len`, `--page-size` (kvcache then always paged) and `--sinks` shape the
    generated batches: a kernel that needs them passes with them and fails without."""
    rc = main(["check-kernel", *argv, "--examples", "12", "-q"])
    out = capsys.readouterr().out
    assert rc == code and words in out, out


@pytest.mark.rule("raggedspec check-kernel")
@pytest.mark.parametrize("spec", [":sdpa_varlen", "raggedspec.kernel_adapters:",
                                  ":raggedspec.kernel_adapters:sdpa_varlen"])
def test_a_function_without_both_module_and_name_is_bad_usage(spec, capsys):
    assert main(["check-kernel", "--layout", "varlen", spec]) == 2
    err = capsys.readouterr().err
    assert f"function {spec!r} must be written module:function" in err


@pytest.mark.rule("raggedspec check-kernel")
@pytest.mark.parametrize("device", ["bogus", "meta"])
def test_a_device_that_cannot_hold_the_batches_is_bad_usage(device, capsys):
    """`meta` makes tensors but holds no values to compare: refused like an unknown name."""
    argv = ["check-kernel", "--layout", "varlen", "raggedspec.kernel_adapters:sdpa_varlen"]
    assert main([*argv, "--device", device, "-q"]) == 2
    assert f"--device {device!r} is not usable here: " in capsys.readouterr().err


@pytest.mark.rule("raggedspec check-kernel")
def test_a_cuda_only_target_names_the_device_it_was_given(capsys):
    argv = ["check-kernel", "--layout", "padded", "torch:sdpa-cudnn", "--device", "cpu:0"]
    assert main(argv) == 2
    assert "CUDA only, not on --device cpu:0" in capsys.readouterr().err


@pytest.mark.rule("raggedspec check-kernel")
def test_a_signature_refusal_names_the_function_and_the_layouts_keywords(capsys):
    spec = "raggedspec.kernel_adapters:sdpa_varlen"
    assert main(["check-kernel", "--layout", "paged", spec]) == 2
    err = capsys.readouterr().err
    assert f"function {spec!r} cannot be called with the paged layout's arguments (" in err
    keywords = err.split(" keywords ", 1)[1].split("): ", 1)[0].split(", ")
    paged_names = inspect.signature(A.sdpa_paged).parameters  # the built-in paged adapter's
    assert len(keywords) > 1 and set(keywords) <= set(paged_names), err


@pytest.mark.rule("raggedspec check-kernel")
def test_a_kernel_module_that_raises_on_import_is_blamed_exit_1(tmp_path, monkeypatch, capsys):
    (tmp_path / "raising_kernel_mod.py").write_text("raise RuntimeError('no GPU here')\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.delitem(sys.modules, "raising_kernel_mod", raising=False)
    assert main(["check-kernel", "--layout", "varlen", "raising_kernel_mod:attn"]) == 1
    err = capsys.readouterr().err
    assert "raised by your kernel function 'raising_kernel_mod:attn' while importing" in err


@pytest.mark.rule("raggedspec check-kernel")
@pytest.mark.parametrize("flag", ["--examples", "--max-query-len"])
def test_the_range_a_refusal_names_is_the_range_accepted(flag, capsys):
    """Both ends of the range the message states are accepted, one past either end refused."""
    argv = ["check-kernel", "--layout", "varlen", "raggedspec.kernel_adapters:sdpa_varlen", "-q"]
    assert main([*argv, flag, "0"]) == 2
    low, high = map(int, capsys.readouterr().err.split("integer in ")[1].split()[0].split(".."))
    assert main([*argv, flag, str(high + 1)]) == 2
    assert f"{flag} {high + 1}: must be an integer in {low}..{high}" in capsys.readouterr().err
    ends = (low,) if flag == "--examples" else (low, high)  # --examples' high: a million cases
    for value in ends:
        extra = [] if flag == "--examples" else ["--examples", "2"]
        assert main([*argv, flag, str(value), *extra]) == 0, capsys.readouterr()


@pytest.mark.rule("raggedspec check-kernel")
def test_the_defaults_the_help_states_are_those_the_check_receives(monkeypatch):
    """Each `(default X)` of a flag's help is what the check gets without the flag; no page
    size is fixed, no query length capped, no sinks drawn."""
    import argparse
    import types

    from raggedspec import cli, kernel_cases

    seen = {}

    def recording_check(fn, layout, dtype, device, examples, page_size, head_dim,
                        max_query_len, sinks, progress=None):
        seen.update(dtype=dtype, device=device, examples=examples, page_size=page_size,
                    head_dim=head_dim, max_query_len=max_query_len, sinks=sinks)
        return types.SimpleNamespace(passed=True, examples=examples, report="pass")

    monkeypatch.setattr(kernel_cases, "check", recording_check)
    code, out, _ = run_cli("check-kernel", "--layout", "varlen",
                           "raggedspec.kernel_adapters:sdpa_varlen")
    sub = next(a for a in cli.build_parser("check-kernel")._actions
               if isinstance(a, argparse._SubParsersAction)).choices["check-kernel"]
    stated = {a.dest: a.help.split("(default ")[1].split(")")[0]
              for a in sub._actions if a.help and "(default " in a.help}
    assert set(stated) == {"dtype", "device", "examples", "head_dim"}
    assert code == 0 and {k: str(seen[k]) for k in stated} == stated
    assert (seen["page_size"], seen["max_query_len"], seen["sinks"]) == (None, None, False)
    assert out.rstrip().endswith(f"({stated['dtype']}, {stated['device']})")


@pytest.mark.rule("raggedspec check-kernel")
def test_the_progress_counts_cases(capsys):
    argv = ["check-kernel", "--layout", "varlen",
            "raggedspec.conformance.test_check_kernel:torch_is_causal_varlen", "--examples", "30"]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert "case/s" in err and "case tried" in err and "step" not in err, err
