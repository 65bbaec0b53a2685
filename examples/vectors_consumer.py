"""Run raggedspec test vectors against any implementation, through a function table.

Standalone (numpy and safetensors only, nothing from raggedspec): the table maps
`"<family>/<function>"` to a callable from one case's inputs to its outputs, or raising the
refusal's class. `python examples/vectors_consumer.py DIR --table package.module:attr`
exits 0 when every case passed, 1 otherwise, 2 on bad usage. The table's contract, the
comparison rules, refusal matching (`--messages`), `--skip-policy` and `--require-all`:
docs/vectors.md, section "examples/vectors_consumer.py".
"""

from __future__ import annotations

import argparse
import importlib
import json
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file

FORMAT, SCHEMA_VERSIONS = "raggedspec-vectors", {2}
DTYPES = ("F64", "F32", "BF16")  # the dtype the implementation computes in (safetensors codes)
MESSAGES = ("exact", "values", "class")


@dataclass
class Report:
    """What a run found: cases passed, failures `(case folder, problem)`, functions missing,
    and what `skip_policy` left uncompared `(case folder, what)`."""

    passed: int = 0
    failed: list[tuple[str, str]] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.failed


def load_case(folder: Path) -> tuple[dict, dict]:
    """`(case.json, inputs)` of one case folder: the JSON inputs plus its input tensors."""
    case = json.loads((folder / "case.json").read_text(encoding="utf-8"))
    inputs = dict(case["inputs"])
    if case["tensor_inputs"]:
        inputs.update(load_file(str(folder / "inputs.safetensors")))
    return case, inputs


def _json(x):
    """A returned value in JSON form (NumPy scalars and arrays, tuples -> plain values)."""
    if isinstance(x, np.ndarray):
        return _json(x.tolist())
    if isinstance(x, np.generic):
        return x.item()
    if isinstance(x, (list, tuple)):
        return [_json(v) for v in x]
    if isinstance(x, dict):
        return {str(k): _json(v) for k, v in x.items()}
    if hasattr(x, "tolist"):  # a tensor of another array library
        return _json(x.tolist())
    return x


def rounded(want: np.ndarray, dtype: str) -> np.ndarray:
    """`want` (float64) rounded to nearest-even in `dtype`, back as float64: what an exact
    copy of a float64 input looks like in an implementation computing in `dtype`."""
    if dtype == "F64" or want.dtype.kind != "f":
        return want
    if dtype == "F32":
        return want.astype(np.float32).astype(np.float64)
    mant, exp = np.frexp(want)  # bfloat16: 8 significant bits
    return np.ldexp(np.rint(mant * 256.0) / 256.0, exp)


def _close(got: np.ndarray, want: np.ndarray, tol: dict) -> str | None:
    inf_got, inf_want = np.isinf(got), np.isinf(want)
    if not np.array_equal(inf_got, inf_want) or not np.array_equal(got[inf_got], want[inf_want]):
        return "infinite elements differ"
    if np.isnan(got).any():
        return "NaN in the output"
    fin = ~inf_want
    err = np.abs(got[fin] - want[fin])
    bound = tol["atol"] + tol["rtol"] * np.abs(want[fin])
    if (err > bound).any():
        return (
            f"max |got - want| {err.max():.3e} above atol {tol['atol']} "
            f"+ rtol {tol['rtol']} * |want|"
        )
    return None


def compare(
    case: dict, want_tensors: dict, got: dict, dtype: str = "F64", skip: frozenset = frozenset()
) -> list[str]:
    """Problems of `got` (a callable's returned outputs) against one case's expectation; the
    outputs named in `skip` are not compared."""
    problems = []
    for key, want in case["outputs"].items():
        if key in skip:
            continue
        if key not in got:
            problems.append(f"output {key!r} missing")
        elif json.dumps(_json(got[key]), sort_keys=True) != json.dumps(want, sort_keys=True):
            problems.append(f"output {key!r}: got {_json(got[key])!r}, want {want!r}")
    for key, meta in case["tensor_outputs"].items():
        if key in skip:
            continue
        if key not in got or got[key] is None:
            problems.append(f"tensor output {key!r} missing")
            continue
        g = np.asarray(_json(got[key]) if not isinstance(got[key], np.ndarray) else got[key])
        w = want_tensors[key]
        if list(g.shape) != list(w.shape):
            problems.append(f"tensor output {key!r}: shape {list(g.shape)}, want {list(w.shape)}")
        elif meta["compare"] == "exact":
            if not np.array_equal(
                g.astype(w.dtype) if g.dtype != w.dtype else g, rounded(w, dtype)
            ):
                problems.append(f"tensor output {key!r}: not equal element for element")
        else:
            why = _close(g.astype(np.float64), w.astype(np.float64), case["tolerance"][dtype])
            if why:
                problems.append(f"tensor output {key!r}: {why}")
    return problems


def names_values(message: str, values: list) -> bool:
    """True when `message` names every value: an integer as a whole number (not a digit of a
    longer number or word), a string as a substring."""
    for v in values:
        if isinstance(v, str):
            if v not in message:
                return False
        elif not re.search(rf"(?<![\w.]){re.escape(str(v))}(?![\w]|\.\d)", message):
            return False
    return True


def refusal_problems(exc: Exception, want: dict, messages: str) -> list[str]:
    """Problems of a raised exception against the expected `raises`: the class must be
    `want["class"]`; for a refusal, `messages` "exact" also compares the message, "values"
    requires the message to name every one of `want["values"]`, "class" nothing more."""
    got = f"{type(exc).__name__}: {exc}"
    if type(exc).__name__ != want["class"]:
        return [f"raised {got}; want {want['class']}: {want['message']}"]
    if want["kind"] != "refusal" or messages == "class":
        return []
    if messages == "exact" and str(exc) != want["message"]:
        return [f"{want['class']} message {str(exc)!r}, want {want['message']!r}"]
    if messages == "values" and not names_values(str(exc), want["values"]):
        return [f"{want['class']} message {str(exc)!r} does not name all of {want['values']}"]
    return []


def run_case(
    folder: Path,
    fn: Callable[[dict], dict],
    dtype: str = "F64",
    messages: str = "values",
    skip_policy: bool = False,
) -> tuple[list[str], list[str]]:
    """`(problems, skipped)` of one case run through `fn`: no problem means it passed;
    `skipped` names what `skip_policy` left uncompared (the case's `policy` entries)."""
    case, inputs = load_case(folder)
    skip = frozenset(case["policy"]) if skip_policy else frozenset()
    if "raises" in skip:
        return [], ["the whole case (its refusal follows from engine policy)"]
    try:
        got = fn(inputs)
    except Exception as exc:  # noqa: BLE001 - every exception is a candidate refusal
        if case["raises"] is None:
            return [f"raised {type(exc).__name__}: {exc}"], []
        return refusal_problems(exc, case["raises"], messages), []
    if case["raises"] is not None:
        want = case["raises"]
        return [f"returned {_json(got)!r}; want {want['class']}: {want['message']}"], []
    want_tensors = load_file(str(folder / "outputs.safetensors")) if case["tensor_outputs"] else {}
    return compare(case, want_tensors, got, dtype, skip), sorted(skip)


def run_vectors(
    root: Path,
    table: dict[str, Callable[[dict], dict]],
    dtype: str = "F64",
    messages: str = "values",
    skip_policy: bool = False,
) -> Report:
    """Run every case (the manifest's `case_names`) of every manifest function the table
    has; missing functions are listed, and with `skip_policy` what was left uncompared."""
    root = Path(root)
    manifest = json.loads((root / "manifest.json").read_text(encoding="utf-8"))
    if manifest.get("format") != FORMAT or manifest.get("schema_version") not in SCHEMA_VERSIONS:
        raise ValueError(
            f"{root / 'manifest.json'}: format {manifest.get('format')!r} schema_version "
            f"{manifest.get('schema_version')!r}; this consumer reads {FORMAT!r} "
            f"versions {sorted(SCHEMA_VERSIONS)}"
        )
    report = Report()
    for entry in manifest["functions"]:
        key = f"{entry['family']}/{entry['function']}"
        if key not in table:
            report.missing.append(key)
            continue
        for name in entry["case_names"]:
            folder, where = root / key / name, f"{key}/{name}"
            if not (folder / "case.json").is_file():
                report.failed.append((where, "the manifest lists it but it has no case.json"))
                continue
            problems, skipped = run_case(folder, table[key], dtype, messages, skip_policy)
            report.failed.extend((where, p) for p in problems)
            report.skipped.extend((where, s) for s in skipped)
            report.passed += not problems
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("vectors", type=Path, help="the vectors folder (with manifest.json)")
    parser.add_argument(
        "--table", required=True, help="package.module:attr, the table or a function returning it"
    )
    parser.add_argument(
        "--dtype", default="F64", choices=DTYPES, help="the dtype your code computes in"
    )
    parser.add_argument(
        "--messages",
        default="values",
        choices=MESSAGES,
        help="refusal matching: the class and the values the message names (default), the "
        "class and the exact message, or the class only",
    )
    parser.add_argument(
        "--skip-policy",
        action="store_true",
        help="leave uncompared the outputs (and refusals) set by the source engine's "
        "allocation policy, e.g. buffer capacities; they are counted, never hidden",
    )
    parser.add_argument(
        "--require-all", action="store_true", help="a missing function fails the run"
    )
    args = parser.parse_args(argv)
    if not (args.vectors / "manifest.json").is_file():
        print(
            f"vectors_consumer: error: {args.vectors}/manifest.json does not exist", file=sys.stderr
        )
        return 2
    mod_name, _, attr = args.table.partition(":")
    try:
        table = getattr(importlib.import_module(mod_name), attr)
    except (ImportError, AttributeError) as exc:
        print(f"vectors_consumer: error: --table {args.table!r}: {exc}", file=sys.stderr)
        return 2
    try:
        report = run_vectors(
            args.vectors,
            table() if callable(table) else table,
            args.dtype,
            args.messages,
            args.skip_policy,
        )
    except ValueError as exc:
        print(f"vectors_consumer: error: {exc}", file=sys.stderr)
        return 2
    for where, problem in report.failed:
        print(f"FAIL {where}: {problem}")
    print(
        f"{report.passed} passed, {len(report.failed)} failed, "
        f"{len(report.missing)} functions missing"
        + (f": {', '.join(report.missing)}" if report.missing else "")
    )
    if report.skipped:
        print(f"policy left uncompared in {len(report.skipped)} places (--skip-policy)")
    return 0 if report.ok and (not args.require_all or not report.missing) else 1


if __name__ == "__main__":
    sys.exit(main())
