"""The matrix run behind docs/third-party.md: `raggedspec check-model` over architectures x
attention implementations x dtypes x rollback families x with / without a sliding window,
one JSON line per cell, and the markdown table made from those lines.

    python -m raggedspec.check_model_matrix run OUT.jsonl [--shard K/N] [--named-only]
        [--others ARCHS.json] [--others-only]
    python -m raggedspec.check_model_matrix table OUT.jsonl [MORE.jsonl ...]

`plan()` lists the cells: the named architectures (`NAMED`) in eager and sdpa in float32
and float64, every family, without and (where the architecture has one) with a window, and
a window of 1 once; flex_attention in float32 on one crop cell of llama and of mistral (it
compiles per shape, a minute a case on a CPU); every other architecture the installed
transformers builds with a rotary embedding and a KV cache, in sdpa float64, every family,
windows drawn. A cell that exists already in OUT is not run again (a run resumes).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from raggedspec.check_model import FAMILY_NAMES, check
from raggedspec.check_model_models import NAMED, NoWindow, Subject, Unsupported

NAMED_EXAMPLES, OTHER_EXAMPLES, FLEX_EXAMPLES = 6, 1, 1
SHRINK = {"flex_attention": 0}
"""Shrink budget per implementation (flex_attention recompiles per shape: seconds a case)."""
EAGER_ONLY = {"gemma2"}
"""Named architectures transformers builds with eager attention only."""
MIN_WINDOW = 2
"""Windows drawn from 2: a window of 1 is its own cell (`window1`)."""


def run_cell(arch: str, impl: str, dtype: str, family: str, windows: str,
             examples: int) -> dict:
    """One cell: `result` agrees / fails / not built / n/a, the largest logit difference,
    the rule named (the report's "rule that differs" line or its last line) and the report."""
    started = time.monotonic()
    cell = dict(arch=arch, impl=impl, dtype=dtype, family=family, windows=windows,
                examples=examples)
    try:
        subject = Subject(arch, impl, dtype)
        min_window = 1 if windows == "window1" else MIN_WINDOW
        result = check(subject, examples, (family,), "some" if windows == "window1" else windows,
                       shrink_calls=SHRINK.get(impl, 40), min_window=min_window)
    except (Unsupported, NoWindow) as exc:
        return cell | dict(result="not built", rule=str(exc)[:300], max_diff=None, report="",
                           seconds=round(time.monotonic() - started, 1))
    if windows == "window1":
        cell["windows"] = "window 1"
    outcome = "n/a" if result.examples == 0 else "agrees" if result.passed else "fails"
    return cell | dict(result=outcome, max_diff=result.max_diff, rule=rule_of(result.report),
                       report="" if result.passed else result.report, ran=result.examples,
                       seconds=round(time.monotonic() - started, 1))


def rule_of(report: str) -> str:
    """The line of a report that names what differs: its "rule that differs" line, else the
    line saying the model raised or which logits differ, else its last line."""
    lines = report.splitlines()
    for start in ("rule that differs:", "the model raised", "the rollback raised", "row "):
        found = [ln for ln in lines if ln.startswith(start)]
        if found:
            return found[0]
    return lines[-1] if lines else ""


def _has_window(arch: str) -> bool:
    try:
        return Subject(arch, "eager", "float32").takes_window()
    except (Unsupported, ValueError):
        return False


MAX_PARAMS, MAX_BYTES = 3_000_000, 6 * 2**30
"""An architecture bigger than this at the tiny size is left out, and so is one whose build
needs more address space (one builds a multi-GB embedding whatever the config)."""


def other_architectures() -> list[str]:
    """Architectures beyond `NAMED` that build tiny (at most `MAX_PARAMS` parameters, within
    `MAX_BYTES` of address space), have a rotary embedding and run a cached step in sdpa
    float32."""
    import resource

    import torch

    from raggedspec.check_model import architectures
    from raggedspec.check_model_models import build_tiny

    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (MAX_BYTES, hard))
    out = []
    try:
        for arch in architectures():
            if arch in NAMED:
                continue
            try:
                model = build_tiny(arch, "sdpa", "float32", 2, None)
                if sum(p.numel() for p in model.parameters()) > MAX_PARAMS or not any(
                        "Rotary" in type(m).__name__ for m in model.modules()):
                    continue
                with torch.no_grad():
                    model(input_ids=torch.tensor([[3, 4, 5]]), use_cache=True)
            except Exception:  # noqa: BLE001 (not buildable here: not in the matrix)
                continue
            out.append(arch)
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
    return out


def others_from(path: Path | None) -> list[str]:
    """`other_architectures()`, read from `path` when it exists, else found and written there
    (finding them builds every architecture: minutes)."""
    if path is not None and path.exists():
        return json.loads(path.read_text())
    found = other_architectures()
    if path is not None:
        path.write_text(json.dumps(found))
    return found


def plan(named_only: bool = False, others: Path | None = None,
         others_only: bool = False) -> list[tuple]:
    """Every cell `(arch, impl, dtype, family, windows, examples)` in run order."""
    cells = []
    for arch in () if others_only else NAMED:
        windows = ["none", "some"] if _has_window(arch) else ["none"]
        subjects = [("eager", "float32"), ("eager", "float64"), ("sdpa", "float32"),
                    ("sdpa", "float64")]
        for impl, dtype in subjects:
            for family in FAMILY_NAMES:
                cells += [(arch, impl, dtype, family, w, NAMED_EXAMPLES) for w in windows]
        if "some" in windows:
            impl = "eager" if arch in EAGER_ONLY else "sdpa"
            cells += [(arch, impl, "float64", family, "window1", NAMED_EXAMPLES)
                      for family in ("crop", "mask")]
        if arch in ("llama", "mistral"):
            cells.append((arch, "flex_attention", "float32", "crop", windows[-1], FLEX_EXAMPLES))
    if not named_only:
        for arch in others_from(others):
            cells += [(arch, "sdpa", "float64", family, "any", OTHER_EXAMPLES)
                      for family in FAMILY_NAMES]
    return cells


def _done(path: Path) -> set:
    if not path.exists():
        return set()
    keys = set()
    for line in path.read_text().splitlines():
        c = json.loads(line)
        keys.add((c["arch"], c["impl"], c["dtype"], c["family"], c.get("key", c["windows"])))
    return keys


def run(out: Path, shard: tuple[int, int], named_only: bool, others: Path | None,
        others_only: bool = False) -> None:
    """Run this shard's cells not yet in `out`, appending one JSON line each."""
    done = _done(out)
    cells = [c for n, c in enumerate(plan(named_only, others, others_only))
             if n % shard[1] == shard[0]]
    for n, cell in enumerate(cells, start=1):
        if cell[:5] in done:
            continue
        result = run_cell(*cell) | dict(key=cell[4])
        with out.open("a") as f:
            f.write(json.dumps(result) + "\n")
        print(f"[{n}/{len(cells)}] {' '.join(map(str, cell[:5]))}: {result['result']} "
              f"{result['seconds']} s", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------- the table


def _short(cell: dict) -> str:
    if cell["result"] == "agrees":
        return f"agrees ({cell['max_diff']:.1g})"
    if cell["result"] != "fails":
        return cell["result"]
    rule = rule_of(cell["report"]).removeprefix("rule that differs: ")
    for key, word in (("finite", "NaN"), ("counted in cache columns", "window in columns"),
                      ("CppCompileError", "raises (compile)"), ("raised", "raises"),
                      ("float32 precision", "float32 precision"), ("logits differ", "logits"),
                      ("rollback", "rollback"), ("positions", "positions")):
        if key in rule:
            return f"fails: {word}"
    return f"fails: {rule[:40]}"


def _order(key: tuple) -> tuple:
    arch, impl, dtype, windows = key
    named = NAMED.index(arch) if arch in NAMED else len(NAMED)
    win = {"none": 0, "any": 0, "some": 1}.get(windows, 2)
    return (named, arch, win, ("eager", "sdpa", "flex_attention").index(impl), dtype)


def table(cells: list[dict]) -> str:
    """Markdown: one row per architecture, implementation, dtype and window setting; one
    column per family."""
    rows: dict = {}
    for c in cells:
        key = (c["arch"], c["impl"], c["dtype"], c["windows"])
        rows.setdefault(key, {})[c["family"]] = _short(c)
    head = "| architecture | implementation | dtype | window | " + " | ".join(FAMILY_NAMES) + " |"
    lines = [head, "|" + "---|" * (4 + len(FAMILY_NAMES))]
    for (arch, impl, dtype, windows), fams in sorted(rows.items(), key=lambda kv: _order(kv[0])):
        shown = {"none": "none", "some": "yes", "any": "drawn", "window1": "window 1"}.get(
            windows, windows)
        lines.append(f"| {arch} | {impl} | {dtype} | {shown} | "
                     + " | ".join(fams.get(f, "") for f in FAMILY_NAMES) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m raggedspec.check_model_matrix")
    sub = p.add_subparsers(dest="what", required=True)
    r = sub.add_parser("run")
    r.add_argument("out", type=Path)
    r.add_argument("--shard", default="0/1")
    r.add_argument("--named-only", action="store_true")
    r.add_argument("--others-only", action="store_true")
    r.add_argument("--others", type=Path, default=None,
                   help="JSON list of the other architectures (found and written if missing)")
    t = sub.add_parser("table")
    t.add_argument("files", type=Path, nargs="+")
    args = p.parse_args(argv)
    if args.what == "run":
        k, n = (int(x) for x in args.shard.split("/"))
        run(args.out, (k, n), args.named_only, args.others, args.others_only)
        return 0
    cells = [json.loads(line) for f in args.files for line in f.read_text().splitlines()]
    print(table(cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
