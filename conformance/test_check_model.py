"""`raggedspec check-model`: a correct tiny model passes in each attention implementation;
models with a planted bug of each class are caught and the rule is named (positions counted
from the padded start, a mask that forgets the dead prefix, a sliding window counted in
cache columns instead of positions, a batch-wide rollback where a row-wise one is needed);
the plan of a case follows the reference's step rules; exit codes and usage as the other
checkers. The planted models are transformers' Llama with one thing changed, written the way
the bug is written in real model code. Skipped only when transformers is not installed."""

from __future__ import annotations

import contextlib
import io
import sys
import textwrap

import numpy as np
import pytest
import torch

pytest.importorskip("transformers", reason="check-model needs transformers: "
                                           "pip install 'raggedspec[models]'")

from transformers import LlamaForCausalLM  # noqa: E402

from raggedspec.check_model import check  # noqa: E402
from raggedspec.check_model_cases import Case, expected_keep, plan_steps  # noqa: E402
from raggedspec.check_model_models import SEED, Subject, tiny_config  # noqa: E402
from raggedspec.check_model_run import run_case  # noqa: E402
from raggedspec.cli import main  # noqa: E402
from raggedspec.reference.masks import make_left_padded_causal_mask  # noqa: E402

pytestmark = pytest.mark.rule("raggedspec check-model")


def _llama(cls, attn_implementation="sdpa", num_key_value_heads=2, **extra):
    torch.manual_seed(SEED)
    model = cls(tiny_config("llama", num_key_value_heads, None), **extra)
    model.config._attn_implementation = attn_implementation
    return model


# ----------------------------------------------------------------------------- planted bugs


class PaddedStartPositions(LlamaForCausalLM):
    """Drops the position_ids it is given: transformers then counts positions from the
    cache's first column, the padded start."""

    def forward(self, *args, position_ids=None, **kwargs):
        return super().forward(*args, **kwargs)


class DeadPrefixVisible(LlamaForCausalLM):
    """Drops the attention mask: the dead prefix and padding are attended."""

    def forward(self, *args, attention_mask=None, **kwargs):
        return super().forward(*args, **kwargs)


class OwnWindow(LlamaForCausalLM):
    """A sliding window of its own, built as a 4-D mask from the 2-D attention mask: by
    positions (each live column's running count), or, planted, by cache columns."""

    by_columns = False

    def __init__(self, config, window=None):
        super().__init__(config)
        self.window = window
        for layer in self.model.layers:
            layer.self_attn.sliding_window = window  # what the checker reads

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, **kwargs):
        if self.window is not None:
            attention_mask = self._windowed(attention_mask, position_ids, input_ids.shape[1])
        return super().forward(input_ids=input_ids, attention_mask=attention_mask,
                               position_ids=position_ids, **kwargs)

    def _windowed(self, mask, position_ids, t):
        if mask is None:  # the row run alone
            mask = torch.ones(1, t, dtype=torch.long)
            position_ids = torch.arange(t)[None]
        live = mask.bool()[:, None, :]
        width = mask.shape[1]
        if self.by_columns:
            key = torch.arange(width)[None, None, :]
            query = (width - t + torch.arange(t))[None, :, None]
        else:
            key = (mask.long().cumsum(-1) - 1)[:, None, :]
            query = position_ids[:, :, None]
        keep = live & (key <= query) & (key > query - self.window)
        keep |= ~keep.any(-1, keepdim=True)  # padding queries: any key, never NaN
        return keep[:, None]


class ColumnWindow(OwnWindow):
    by_columns = True


def _relay(cache, mask, drops):
    """Every layer re-laid: row i keeps its live columns but the last drops[i],
    front-aligned."""
    kept = [torch.nonzero(mask[i]).flatten()[: int(mask[i].sum()) - d]
            for i, d in enumerate(drops)]
    width = max(len(k) for k in kept)
    for layer in cache.layers:
        for name in ("keys", "values"):
            x = getattr(layer, name)
            out = x.new_zeros(x.shape[0], x.shape[1], width, x.shape[3])
            for i, cols in enumerate(kept):
                out[i, :, width - len(cols):] = x[i, :, cols]
            setattr(layer, name, out)


class RowRollback(LlamaForCausalLM):
    """Rolls its own cache back, row by row (the hook the checker calls)."""

    def rollback_rows(self, cache, dropped, attention_mask):
        _relay(cache, attention_mask, dropped)


class BatchRollback(LlamaForCausalLM):
    """Rolls every row back by the largest count (one shared length, as a cache with a
    single `current_length` does)."""

    def rollback_rows(self, cache, dropped, attention_mask):
        _relay(cache, attention_mask, [max(dropped)] * len(dropped))


def factory(cls):
    def make(attn_implementation="sdpa", num_key_value_heads=2, sliding_window=None):
        extra = {"window": sliding_window} if issubclass(cls, OwnWindow) else {}
        return _llama(cls, attn_implementation, num_key_value_heads, **extra)
    return make


def _run(cls, family, windows="none", examples=8, impl="sdpa", dtype="float64"):
    subject = Subject(cls.__name__, impl, dtype, factory=factory(cls))
    return check(subject, examples, (family,), windows, shrink_calls=10)


# ----------------------------------------------------------------------------- tests


@pytest.mark.parametrize("impl, dtype", [("sdpa", "float64"), ("eager", "float32")])
def test_a_correct_model_passes_in_each_implementation(impl, dtype):
    for family in ("crop", "mask", "refeed", "shift"):
        seen = []
        result = check(Subject("llama", impl, dtype), 3, (family,), progress=seen.append)
        assert result.passed, result.report
        assert result.examples == 3 and result.max_diff < (1e-12 if dtype == "float64" else 1e-4)
        assert seen == [1, 2, 3]  # the progress reaches the count: the fixed case is the first


SLOW = pytest.mark.slow


@pytest.mark.parametrize("cls, family, windows, rule", [
    (PaddedStartPositions, "crop", "none", "positions counted from the padded start"),
    (DeadPrefixVisible, "crop", "none", "the dead prefix and padding are attended"),
    pytest.param(ColumnWindow, "mask", "some", "the sliding window is counted in cache columns",
                 marks=SLOW),
    pytest.param(BatchRollback, "shift", "none",
                 "a batch-wide rollback where a row-wise one is needed", marks=SLOW),
], ids=["positions", "dead-prefix", "window-in-columns", "batch-rollback"])
def test_each_planted_bug_is_caught_and_named(cls, family, windows, rule):
    result = _run(cls, family, windows)
    assert not result.passed
    assert f"rule that differs: {rule}" in result.report, result.report
    assert "row " in result.report and "prompts [" in result.report


@pytest.mark.parametrize("cls, family, windows", [
    pytest.param(OwnWindow, "mask", "some", marks=SLOW),
    pytest.param(OwnWindow, "refeed", "some", marks=SLOW),
    (RowRollback, "shift", "none"),
], ids=["window-by-positions-mask", "window-by-positions-refeed", "row-rollback"])
def test_the_correct_counterparts_of_the_planted_bugs_pass(cls, family, windows):
    result = _run(cls, family, windows)
    assert result.passed, result.report


def test_the_named_positions_are_those_of_the_fixed_case():
    """Rows of prompts 4 and 2: the prefill feeds row 1 (lead 2) its position 0, counted from
    the padded start it is 2."""
    subject = Subject("p", "sdpa", "float64", factory=factory(PaddedStartPositions))
    report = run_case(subject, Case((4, 2), 1, ((0, 0),), "crop", None, 2, 5)).report
    assert "row 1 (lead 2): positions [2], the reference's [0] (row_q0 0)" in report, report


def test_a_whole_row_shift_is_seen_though_the_logits_agree():
    """Positions counted from the padded start shift a front-aligned row as a whole: RoPE
    hides it from the logits, so only the positions check can see it."""
    subject = Subject("p", "sdpa", "float64", factory=factory(PaddedStartPositions))
    case = Case((4, 2), 1, ((0, 0),), "crop", None, 2, 5)
    plan = plan_steps(case, 96)
    model = subject.model(2, None)
    ids = torch.as_tensor(plan.steps[0].ids)
    mask = torch.as_tensor(plan.steps[0].attention_mask())
    with torch.no_grad():
        batch = model(input_ids=ids, attention_mask=mask).logits[1, -1]
        alone = model(input_ids=torch.tensor([plan.solo_tokens[0][1]])).logits[0, -1]
    assert torch.allclose(batch, alone, atol=1e-12)
    assert "positions counted from the padded start" in run_case(subject, case).report


def test_the_expected_mask_of_a_front_aligned_step_is_the_left_padded_causal_mask():
    """With no hole and no window a verify step's key sets are masks §9.2's left-padded
    causal mask over the cached columns."""
    case = Case((6, 3, 1), 2, ((1, 0, 2), (0, 2, 1)), "crop", None, 2, 3)
    for step in plan_steps(case, 96).steps[1:]:
        past = len(step.cols[0]) - step.width
        live = [sum(p is not None for p in row[:past]) for row in step.cols]
        ref = make_left_padded_causal_mask(len(live), step.width, past, live)[:, 0] == 0
        for i, row in enumerate(step.cols):
            keep = expected_keep(row, step.slot_pos[i], None)
            slots = [j for j, p in enumerate(step.slot_pos[i]) if p is not None]
            assert (keep[slots] == ref[i][slots]).all()


@pytest.mark.parametrize("family", ["crop", "mask", "refeed", "shift"])
def test_the_plan_keeps_each_rows_positions_its_own(family):
    """Every layout lists each row's positions 0..L-1 in order, once; every fed query sits
    at the row's cached length plus its index (the reference's row_q0)."""
    case = Case((5, 2, 3), 2, ((2, 0, 1), (0, 2, 1), (1, 1, 0)), family, None, 2, 7)
    plan = plan_steps(case, 96)
    for step, solo in zip(plan.steps, plan.solo_tokens, strict=True):
        for i, row in enumerate(step.cols):
            held = [p for p in row if p is not None]
            assert held == list(range(len(held)))
            fed = [p for p in step.slot_pos[i] if p is not None]
            assert fed == list(range(held[-1] - len(fed) + 1, held[-1] + 1))
            assert len(solo[i]) == held[-1] + 1
        for row in step.cols_after:
            held = [p for p in row if p is not None]
            assert held == list(range(len(held)))


def test_the_cohort_crop_follows_the_reference_plan():
    """cache-and-draft §12.1's example shape: accepts [1, 0, 1] at w 3 keep 1 column of
    the step for every row and drop 2."""
    plan = plan_steps(Case((4, 4, 4), 2, ((1, 0, 1),), "crop", None, 2, 1), 96)
    assert plan.steps[-1].crop == 2


def test_same_cases_every_run():
    first = _run(DeadPrefixVisible, "crop", examples=4)
    second = _run(DeadPrefixVisible, "crop", examples=4)
    assert (first.examples, first.report) == (second.examples, second.report)


# ----------------------------------------------------------------------------- command


def _cli(args, monkeypatch=None):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["check-model", "-q", *args])
    return code, out.getvalue(), err.getvalue()


PLUGIN = """
import torch
from transformers import LlamaForCausalLM
from raggedspec.check_model_models import tiny_config


class Model(LlamaForCausalLM):
    def forward(self, *args, position_ids=None, **kwargs):
        return super().forward(*args, **kwargs)


def buggy(attn_implementation):
    torch.manual_seed(0)
    model = Model(tiny_config("llama", 2, None))
    model.config._attn_implementation = attn_implementation
    return model


def broken():
    raise RuntimeError("no weights here")
"""


def test_command_exit_codes_pass_and_mismatch(tmp_path, monkeypatch):
    code, out, _ = _cli(["--arch", "llama", "--impl", "sdpa", "--dtype", "float64",
                         "--examples", "2", "--family", "crop"])
    assert code == 0 and "llama / sdpa / float64 / crop: pass: 2 cases agree" in out
    (tmp_path / "my_models.py").write_text(textwrap.dedent(PLUGIN))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    code, out, _ = _cli(["--arch", "my_models:buggy", "--impl", "sdpa", "--dtype", "float64",
                         "--examples", "3", "--family", "crop"])
    assert code == 1 and "MISMATCH" in out and "positions counted from the padded start" in out


def test_an_exception_in_the_factory_is_the_factorys(tmp_path, monkeypatch):
    (tmp_path / "my_models.py").write_text(textwrap.dedent(PLUGIN))
    monkeypatch.chdir(tmp_path)
    code, out, err = _cli(["--arch", "my_models:broken", "--examples", "2"])
    assert code == 1, (out, err)
    assert "raised by your factory 'my_models:broken'" in err and "no weights here" in err
    assert "Traceback" in err and "internal error" not in out + err


@pytest.mark.parametrize("args, words", [
    (["--arch", "no_such_arch"], "--arch 'no_such_arch': not one of"),
    (["--impl", "fast"], "--impl 'fast': not one of"),
    (["--dtype", "bfloat16"], "--dtype 'bfloat16': not one of float32, float64"),
    (["--examples", "0"], "--examples 0 must be >= 1"),
    (["--family", "drop"], "--family 'drop': not one of crop, mask, refeed, shift"),
    (["--arch", "no_such_module:f"], "cannot import 'no_such_module'"),
    (["--arch", "gemma2", "--impl", "sdpa", "--dtype", "float32"], "transformers does not build"),
])
def test_bad_usage_exits_2_naming_the_flag(args, words):
    code, out, err = _cli(args)
    assert code == 2 and words in err, (out, err)


def test_without_transformers_the_command_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)
    code, _out, err = _cli(["--examples", "1"])
    assert code == 2 and "pip install 'raggedspec[models]'" in err


def test_the_parser_is_built_without_importing_transformers(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)
    code, out, _err = _cli(["--help"])
    assert code == 0 and "--family" in out


# ----------------------------------------------------------------------------- the matrix


@pytest.mark.slow
def test_the_matrix_of_the_named_architectures():
    """A few cases per cell of the findings page: sdpa float64 agrees without a window,
    deepseek_v3 only to float32 precision (its router); mistral's masked-in-place rollback
    with a window breaks the window rule; eager float64 gives NaN in padding that reaches
    the cache."""
    from raggedspec.check_model_matrix import run_cell

    for arch in ("llama", "qwen3", "phi3"):
        cell = run_cell(arch, "sdpa", "float64", "crop", "none", 4)
        assert cell["result"] == "agrees" and cell["max_diff"] < 1e-12, cell
    cell = run_cell("deepseek_v3", "sdpa", "float64", "crop", "none", 1)
    assert cell["result"] == "fails" and "within float32 precision" in cell["rule"], cell
    cell = run_cell("mistral", "sdpa", "float64", "mask", "some", 10)
    assert "counted in cache columns" in cell["rule"], cell
    cell = run_cell("llama", "eager", "float64", "refeed", "none", 6)
    assert "finite outputs" in cell["rule"], cell
    assert np.isfinite(cell["max_diff"])


# ----------------------------------------------------------------------------- torch targets


@pytest.mark.parametrize("name", ["torch:sdpa", "torch:sdpa-math", "torch:sdpa-flash"])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_torch_attention_is_a_built_in_check_kernel_target(name, dtype):
    from raggedspec.kernel_adapters import torch_target
    from raggedspec.kernel_cases import check as check_kernel

    result = check_kernel(torch_target(name, "padded"), "padded", dtype, examples=15)
    assert result.passed and result.examples == 15, result.report


def test_a_torch_target_with_a_wrong_rule_is_caught():
    """The same call with torch's `is_causal=True` instead of the mask (top-left aligned)."""
    from raggedspec.kernel_adapters import torch_target
    from raggedspec.kernel_cases import check as check_kernel

    sdpa = torch_target("torch:sdpa", "padded")

    def top_left(q, k, v, attention_mask, position_ids, sliding_window=None,
                 softmax_scale=None, sinks=None):
        out = sdpa(q, k, v, attention_mask, position_ids, sliding_window, softmax_scale)
        if q.shape[2] > 1:
            out = torch.nn.functional.scaled_dot_product_attention(
                q, k, v, is_causal=True, scale=softmax_scale, enable_gqa=True)
        return out

    result = check_kernel(top_left, "padded", "float64", examples=60)
    assert not result.passed and "causal aligned top-left" in result.report, result.report


@pytest.mark.parametrize("args, code, words", [
    (["--layout", "padded", "torch:sdpa", "--examples", "3"], 0, "torch:sdpa: pass: 3"),
    (["--layout", "varlen", "torch:sdpa"], 2, "torch:sdpa speaks the padded layout"),
    (["--layout", "padded", "torch:sdpa-efficient"], 2, "on CUDA only, not on --device cpu"),
])
def test_torch_targets_on_the_command_line(args, code, words):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        got = main(["check-kernel", *args])
    assert got == code and words in out.getvalue() + err.getvalue(), (out.getvalue(),
                                                                     err.getvalue())


@pytest.mark.slow
def test_torch_flex_compiled_target_passes_compiling_each_batch_afresh():
    """torch.compile(flex_attention) on a CPU, compiled afresh for each batch's sizes (a
    recompile for new sizes fails to build there: docs/third-party.md), agrees with the
    reference; the same cases twice give the same result."""
    from raggedspec.kernel_adapters import torch_target
    from raggedspec.kernel_cases import check as check_kernel

    flex = torch_target("torch:flex", "padded")
    first = check_kernel(flex, "padded", "float32", examples=2)
    again = check_kernel(flex, "padded", "float32", examples=2)
    assert first.passed, first.report
    assert (first.examples, first.report) == (again.examples, again.report)
