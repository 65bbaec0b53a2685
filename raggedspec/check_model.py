"""`raggedspec check-model`: Hugging Face transformers causal LMs (or a user's model
factory) on generated speculative-decoding steps over ragged, left-padded batches.

Each architecture, attention implementation and dtype given is one subject: a tiny model
with random seeded weights, built from a config (nothing is downloaded). Hypothesis draws
cases (`check_model_cases.cases`): ragged prompts, per-row verify widths, a few steps with
per-row accept counts, a sliding window shorter or longer than the padding, 1, 2 or 4 KV
heads of 4 query heads, and one of four ways of handling rejected drafts. A case passes
when every row's logits equal those of the row run alone, unpadded; the positions and masks
the model received equal the reference's; nothing is NaN or inf; and after each rollback
every row's cache holds its own keys (`check_model_run`). The first failing case is shrunk
and its difference named by the rule it breaks (`check_model_explain`). Derandomized: the
same cases every run.

Exit 0 every subject agrees; 1 a mismatch (report on stdout), or an exception raised by the
user's factory (a PluginError: the command line prints its traceback and "raised by your
factory"); 2 bad usage, or transformers missing (the message names
`pip install 'raggedspec[models]'`).
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass

FAMILY_NAMES = ("crop", "mask", "refeed", "shift")
"""As `check_model_cases.FAMILIES` (repeated so that building the parser imports nothing)."""
WINDOWS = ("any", "none", "some")
DTYPE_NAMES = ("float32", "float64")
DEFAULT_EXAMPLES = 20
SHRINK_CALLS = 150
"""Cases tried while shrinking a failure before the smallest one so far is reported."""


class ModelUsageError(ValueError):
    """Bad usage of check-model (exit 2): the message names the flag and what is allowed."""


@dataclass
class CheckResult:
    passed: bool
    examples: int
    report: str
    max_diff: float
    note: str = ""


class _Abort(BaseException):
    """Leaves Hypothesis at once (a factory error, or the shrink budget spent)."""


# ----------------------------------------------------------------------------- check


def _settings(examples: int):
    from hypothesis import HealthCheck, Phase, Verbosity, settings

    return settings(max_examples=examples, derandomize=True, database=None, deadline=None,
                    suppress_health_check=list(HealthCheck), verbosity=Verbosity.quiet,
                    phases=[Phase.explicit, Phase.generate, Phase.shrink],
                    report_multiple_bugs=False, print_blob=False)


def check(subject, examples: int = DEFAULT_EXAMPLES, families: tuple[str, ...] = FAMILY_NAMES,
          windows: str = "any", progress=None, shrink_calls: int = SHRINK_CALLS,
          min_window: int = 1) -> CheckResult:
    """Run `examples` cases through the subject: a fixed ragged case (`first_case`), then
    derandomized generated ones (all `examples` when the fixed case failed, to find one to
    shrink); on a failure the smallest failing case found within `shrink_calls` further
    cases is reported. A factory's exception propagates as PluginError."""
    from hypothesis import given

    from raggedspec.check_model_cases import cases, first_case
    from raggedspec.check_model_run import run_case
    from raggedspec.reference.plugins import PluginError

    note = ""
    subject.vocab()  # builds one model first: Unsupported / PluginError before any case
    if windows != "none" and not subject.takes_window():
        note = "no sliding window: the architecture has none"
        if windows == "some":
            return CheckResult(True, 0, f"not run: {note}", 0.0, note)
        windows = "none"
    state = dict(ran=0, after=0, reports=[], diff=0.0, error=None)

    fixed = run_case(subject, first_case(families[0], windows, subject.kv_heads(), min_window))
    state["diff"] = fixed.max_diff
    if progress is not None:
        progress(1)
    generated = examples if fixed.report is not None else examples - 1

    @_settings(max(generated, 1))
    @given(case=cases(families, windows, subject.kv_heads(), min_window))
    def prop(case) -> None:
        state["ran"] += 1
        if state["reports"]:
            state["after"] += 1
            if state["after"] > shrink_calls:
                raise _Abort
        elif progress is not None:
            progress(min(state["ran"] + 1, examples))  # the fixed case counts as the first
        try:
            outcome = run_case(subject, case)
        except PluginError as exc:
            state["error"] = exc
            raise _Abort from exc
        state["diff"] = max(state["diff"], outcome.max_diff)
        if outcome.report is not None:
            state["reports"].append(outcome.report)
            raise AssertionError(outcome.report)

    try:
        if generated:
            prop()
    except _Abort:
        if state["error"] is not None:
            raise state["error"] from None
    except AssertionError:
        pass
    ran = state["ran"] + 1
    if state["reports"]:
        return CheckResult(False, ran, state["reports"][-1], state["diff"], note)
    if fixed.report is not None:
        return CheckResult(False, ran, f"{fixed.report}\n(the fixed first case, not shrunk: no "
                                       f"generated case failed)", state["diff"], note)
    return CheckResult(True, ran, f"pass: {ran} cases agree", state["diff"], note)


# ----------------------------------------------------------------------------- command


def _listed(text: str, flag: str, allowed, what: str) -> list[str]:
    values = [v.strip() for v in text.split(",") if v.strip()]
    if not values:
        raise ModelUsageError(f"{flag} {text!r}: give one or more {what}, comma-separated")
    for v in values:
        if allowed is not None and v not in allowed:
            raise ModelUsageError(f"{flag} {v!r}: not one of {', '.join(sorted(allowed))}")
    return values


def architectures() -> list[str]:
    """The causal-LM architectures the installed transformers ships."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def implementations() -> list[str]:
    """eager and every attention implementation the installed transformers registers."""
    from transformers import AttentionInterface

    return ["eager"] + sorted(AttentionInterface._global_mapping)


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "check-model",
        help="run generated ragged speculative-decoding steps through Hugging Face "
             "transformers models (or your own model factory) and compare each row with "
             "the row run alone",
        description="Each --arch x --impl x --dtype is built tiny with random seeded weights "
                    "(nothing is downloaded) and checked on generated cases; the first "
                    "failure is shrunk and named by the rule it breaks (docs/models.md). "
                    "Needs pip install 'raggedspec[models]'.")
    p.add_argument("--arch", default="llama",
                   help="architectures (comma-separated transformers model types, e.g. "
                        "llama,mistral,qwen2,gemma2) or one module:factory returning a model "
                        "(default llama)")
    p.add_argument("--impl", default="eager,sdpa",
                   help="attention implementations, comma-separated (default eager,sdpa; "
                        "flex_attention also runs on a CPU in float32)")
    p.add_argument("--dtype", default="float32,float64",
                   help="dtypes, comma-separated: float32, float64 (default both)")
    p.add_argument("--examples", type=int, default=DEFAULT_EXAMPLES,
                   help=f"generated cases per subject and family, >= 1 (default "
                        f"{DEFAULT_EXAMPLES})")
    p.add_argument("--family", default=",".join(FAMILY_NAMES),
                   help="ways of handling rejected drafts, comma-separated: crop, mask, refeed, "
                        "shift (default all)")
    p.add_argument("--window", choices=WINDOWS, default="any",
                   help="sliding windows: any (drawn or not), none, some (every case has one)")
    p.add_argument("--min-window", type=int, default=1,
                   help="the smallest sliding window drawn, >= 1 (default 1)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress on stderr")
    return p


def subjects(args) -> list:
    """The subjects of the command line; ModelUsageError naming a bad flag value."""
    from raggedspec.check_model_models import Subject, import_transformers

    try:
        import_transformers()
    except ImportError as exc:
        raise ModelUsageError(str(exc)) from None
    for flag, value in (("--examples", args.examples), ("--min-window", args.min_window)):
        if value < 1:
            raise ModelUsageError(f"{flag} {value} must be >= 1")
    factory = ":" in args.arch
    archs = [args.arch] if factory else _listed(args.arch, "--arch", architectures(),
                                                "architectures")
    impls = _listed(args.impl, "--impl", implementations(), "implementations")
    dtypes = _listed(args.dtype, "--dtype", DTYPE_NAMES, "dtypes")
    _listed(args.family, "--family", FAMILY_NAMES, "families")
    out = []
    for arch in archs:
        for impl in impls:
            for dtype in dtypes:
                try:
                    out.append(Subject(arch, impl, dtype))
                except ValueError as exc:
                    raise ModelUsageError(str(exc)) from None
    return out


def run(args) -> int:
    """The command: 0 every subject agrees, 1 a mismatch, 2 bad usage (ModelUsageError); a
    factory's exception propagates as PluginError (the command line's exit 1)."""
    from raggedspec.check_model_models import Unsupported
    from raggedspec.progress import Progress, progress_mode

    todo = subjects(args)  # a factory module raising on import: PluginError, exit 1
    families = tuple(_listed(args.family, "--family", FAMILY_NAMES, "families"))
    failed, runs = 0, [(s, f) for s in todo for f in families]
    for n, (subject, family) in enumerate(runs, start=1):
        name = f"{subject.name} / {family}"
        bar = Progress(f"check-model {name} ({n}/{len(runs)})", progress_mode(args.quiet))
        started = time.monotonic()
        try:
            result = check(subject, args.examples, (family,), args.window,
                           lambda done, b=bar: b(done, args.examples),
                           min_window=args.min_window)
        except Unsupported as exc:
            raise ModelUsageError(str(exc)) from None
        finally:
            bar.close(note="a case failed; the smallest failing case found is below")
        seconds = time.monotonic() - started
        note = f"; {result.note}" if result.note else ""
        if result.passed:
            print(f"{name}: {result.report} (max logit difference {result.max_diff:.3g}{note}; "
                  f"{seconds:.1f} s)")
            continue
        failed += 1
        print(f"{name}: MISMATCH, first failing case after shrinking ({result.examples} cases "
              f"run{note}):\n{result.report}")
    sys.stdout.flush()
    return 1 if failed else 0
