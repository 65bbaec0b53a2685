"""`raggedspec bench`: arguments, the checked-then-timed run of every case, and the entry
points; the timing and the result file live in bench/timing.py, the end-to-end simulator run
(`--e2e`) in bench/e2e.py.

    python -m raggedspec.bench [--smoke] [--device cuda] [--dtype bfloat16] [--out out/bench] ...
    python -m raggedspec.bench --replot out/bench/bench.json   # table and plot again from the JSON

Every strategy is checked against the float64 reference before it is timed (a strategy that
disagrees is WRONG and not timed); finished cases go to `bench.partial.json` after every
case, so a run cut short keeps what it measured; `bench.json` is written when the run ends. The
method (timing, the L2 flush, the copy-bandwidth bound) is
described in docs/bench.md. torch is imported inside the functions, so `raggedspec --help`
does not pay for it.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
from pathlib import Path

from raggedspec.bench.e2e import e2e_settings, run_e2e
from raggedspec.bench.report import (
    render_e2e,
    render_markdown,
    write_reports,
    wrong_strategies,
)
from raggedspec.bench.strategies import (
    HEADLINE,
    NEGATIVE_CONTROLS,
    STRATEGIES,
    TOLERANCE,
    Case,
    Strategy,
    make_lens,
    make_strategies,
    reference_attention,
    rel_err,
)
from raggedspec.bench.timing import SCHEMA, Timer, copy_bandwidth, machine_info, write_json

FULL = dict(device="cuda", dtype="bfloat16", batches=[1, 32, 128], lengths=[2048, 4096],
            spreads=[0, 64, 1024], windows=[2, 4], kv_heads=8, q_heads=32, head_dim=128,
            warmup=3, reps=20, copy_mib=2048)
SMOKE = dict(device="cpu", dtype="float32", batches=[1, 5], lengths=[40, 72],
             spreads=[0, 24], windows=[2, 4], kv_heads=2, q_heads=4, head_dim=16,
             warmup=1, reps=3, copy_mib=32)


# ----------------------------------------------------------------------------- arguments


def _ints(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated integers") from None
    if not values or min(values) < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: expected integers >= 0")
    return values


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--smoke",
        action="store_true",
        help="CPU smoke: tiny sizes, float32, a few repeats, seconds; checks every strategy "
        "that can run on the CPU; no performance claims",
    )
    p.add_argument(
        "--device", default=None, help="cpu | cuda | cuda:N (default cuda; cpu with --smoke)"
    )
    p.add_argument("--dtype", default=None, choices=sorted(TOLERANCE),
                   help="KV/query dtype (default bfloat16; float32 with --smoke)")
    p.add_argument("--batches", type=_ints, default=None, help="batch sizes (default 1,32,128)")
    p.add_argument(
        "--lengths", type=_ints, default=None, help="longest row's length L (default 2048,4096)"
    )
    p.add_argument(
        "--spreads", type=_ints, default=None, help="L - shortest row (default 0,64,1024)"
    )
    p.add_argument(
        "--windows", type=_ints, default=None, help="verify window w = depth + 1 (default 2,4)"
    )
    p.add_argument("--kv-heads", type=int, default=None, help="KV heads (default 8)")
    p.add_argument(
        "--q-heads",
        type=int,
        default=None,
        help="query heads, a multiple of --kv-heads (default 32)",
    )
    p.add_argument("--head-dim", type=int, default=None, help="head dim (default 128)")
    p.add_argument("--warmup", type=int, default=None, help="warm-up calls per timing (default 3)")
    p.add_argument(
        "--reps", type=int, default=None, help="timed repeats, median reported (default 20)"
    )
    p.add_argument(
        "--copy-mib", type=int, default=None, help="size of the bandwidth copy (default 2048 MiB)"
    )
    p.add_argument(
        "--strategies",
        default="all",
        help="comma-separated subset of "
        + ", ".join(list(STRATEGIES) + list(NEGATIVE_CONTROLS))
        + " (default all = every strategy, no negative control)",
    )
    p.add_argument("--flex-compile", choices=("auto", "on", "off"), default="auto",
                   help="torch.compile flex_attention: auto = on CUDA only (default)")
    p.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help="start no new case after this many seconds (the rest are listed as not run)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of lengths and data (default 0)")
    p.add_argument(
        "--out", type=Path, default=Path("out/bench"), help="output folder (default out/bench)"
    )
    p.add_argument(
        "--replot",
        type=Path,
        default=None,
        metavar="JSON",
        help="only rewrite bench.md and bench.png beside JSON from it (e.g. after a cut-short run)",
    )
    p.add_argument(
        "--e2e",
        action="store_true",
        help="instead of the attention table: end-to-end step time of the tensor-mode simulator "
        "on the torch backend, cohort vs per-sequence advance (writes e2e.json, e2e.md)",
    )
    p.add_argument(
        "--e2e-batch",
        type=int,
        default=None,
        help="--e2e: requests B (default 128; 8 with --smoke)",
    )
    p.add_argument("--e2e-prompt", type=int, default=None,
                   help="--e2e: prompt length of every request (default 1024; 32 with --smoke)")
    p.add_argument(
        "--e2e-steps",
        type=int,
        default=None,
        help="--e2e: engine steps per run (default 24; 6 with --smoke)",
    )
    p.add_argument(
        "--e2e-backend",
        default="torch",
        help="--e2e: the simulator's backend: torch (default), cupy (the kernels; CUDA only), or "
        "package.module:factory",
    )
    p.add_argument(
        "-q", "--quiet", action="store_true", help="no per-case progress lines on stderr"
    )


def add_parser(sub) -> argparse.ArgumentParser:
    """The `bench` subcommand for `raggedspec.cli` (a COMMANDS entry: `(add_parser, run)`)."""
    p = sub.add_parser(
        "bench",
        help="ragged verify attention: strategies vs the live-KV bound (table, JSON, plot)",
        description="Ragged verify attention over a front-aligned batch: per-row loop, padded "
        "SDPA, flex_attention, cohort truncation (lossy), the torch port, the in-place layout "
        "with SDPA and the CuPy kernel side by side; each checked against a float64 "
        "reference first (WRONG ones are not timed), then timed against the live-KV bound "
        "(live K+V bytes / copy bandwidth measured in the same run). Writes bench.json, "
        "bench.md and bench.png under --out. --smoke: tiny CPU run, no claims.",
    )
    add_arguments(p)
    return p


def settings_from(args) -> dict:
    base = dict(SMOKE if args.smoke else FULL)
    for key in (
        "device",
        "dtype",
        "batches",
        "lengths",
        "spreads",
        "windows",
        "kv_heads",
        "q_heads",
        "head_dim",
        "warmup",
        "reps",
        "copy_mib",
    ):
        value = getattr(args, key)
        if value is not None:
            base[key] = value
    names = (
        list(STRATEGIES)
        if args.strategies == "all"
        else [s.strip() for s in args.strategies.split(",") if s.strip()]
    )
    unknown = [s for s in names if s not in STRATEGIES and s not in NEGATIVE_CONTROLS]
    if unknown or not names:
        raise ValueError(f"--strategies: unknown {unknown or names}; allowed: "
                         + ", ".join(list(STRATEGIES) + list(NEGATIVE_CONTROLS)))
    hk, h = base["kv_heads"], base["q_heads"]
    if hk < 1 or h < hk or h % hk:
        raise ValueError(f"--q-heads {h} must be a positive multiple of --kv-heads {hk}")
    if min(base["windows"]) < 1 or min(base["batches"]) < 1 or base["head_dim"] < 1:
        raise ValueError("windows, batches and head dim must be >= 1")
    for L in base["lengths"]:
        for s in base["spreads"]:
            if L - s < max(base["windows"]):
                raise ValueError(
                    f"L {L} - spread {s} is shorter than the window {max(base['windows'])}"
                )
    if base["reps"] < 1 or base["warmup"] < 0:
        raise ValueError("--reps must be >= 1 and --warmup >= 0")
    base.update(
        strategies=names,
        smoke=bool(args.smoke),
        seed=args.seed,
        flex_compile=args.flex_compile,
        budget_s=args.budget_s,
    )
    return base


# ----------------------------------------------------------------------------- one case


def tolerance(dtype_name: str) -> float:
    return TOLERANCE[dtype_name]


def check_strategy(s: Strategy, case: Case, ref, ref_keep, tol: float) -> dict:
    """Prepare, run once, compare. Returns {status: ok|lossy|WRONG|error, err, [err_full], ctx}."""
    try:
        ctx = s.prepare(case)
        out = s.run(case, ctx)
    except Exception as exc:  # noqa: BLE001 - reported, never hidden
        return {"status": "error", "error": f"{type(exc).__name__}: {str(exc)[:300]}"}
    if s.lossy:
        target = ref_keep if ref_keep is not None else ref
        err = rel_err(out, target)
        res = {"err": err, "err_full": rel_err(out, ref)}
        res["status"] = "WRONG" if not err <= tol else ("lossy" if ref_keep is not None else "ok")
    else:
        err = rel_err(out, ref)
        res = {"err": err, "status": "ok" if err <= tol else "WRONG"}
    res["_ctx"] = ctx
    return res


def run_case(
    cfg: dict,
    strategies: list[Strategy],
    reasons: dict,
    timer: Timer,
    w: int,
    b: int,
    L: int,
    spread: int,
    precheck_failed: dict,
    log,
) -> dict:
    import torch

    from raggedspec.gpu.align import materialize_front_aligned
    from raggedspec.paged_moves import count_paged_moves

    device, dtype = torch.device(cfg["device"]), getattr(torch, cfg["dtype"])
    lens = make_lens(b, L, spread, w, cfg["seed"])
    row = {
        "w": w,
        "B": b,
        "L": L,
        "spread": spread,
        "lens": lens,
        "min_len": min(lens),
        "mean_len": sum(lens) / b,
    }
    case = Case(w, lens, cfg["kv_heads"], cfg["q_heads"], cfg["head_dim"], dtype, device,
                seed=hash((cfg["seed"], w, b, L, spread)) & 0x7FFFFFFF)
    es, hk, d = case.elsize(), case.hk, case.d
    row["live_kv_bytes"] = case.live_kv_bytes()
    # front-alignment by copy: the gather reads B*T columns and writes B*T columns, K and V
    row["align_bytes"] = 2 * 2 * b * case.T * hk * d * es
    row["align_ms"] = timer(
        lambda: materialize_front_aligned(case.kv), reps=max(3, timer.reps // 2)
    )
    # the port's per-step append (new tokens' K/V written at each row's own offset) and the
    # per-sequence commit / strip (lens only, no data): written bytes
    row["append_bytes"] = 2 * b * w * hk * d * es
    row["strip_bytes"] = 0
    row.update(count_paged_moves(lens, w, hk, d, dtype, device))  # the paged port, counted
    ref = reference_attention(case)
    ref_keep = reference_attention(case, keep=min(lens)) if min(lens) < max(lens) else None
    tol = tolerance(cfg["dtype"])
    row["strategies"] = {}
    for s in strategies:
        if s.name in reasons:
            row["strategies"][s.name] = {"status": "not run", "reason": reasons[s.name]}
            continue
        if s.name in precheck_failed:
            row["strategies"][s.name] = {
                "status": "WRONG",
                "reason": "failed the precheck: " + precheck_failed[s.name],
            }
            continue
        res = check_strategy(s, case, ref, ref_keep, tol)
        ctx = res.pop("_ctx", None)
        if res["status"] in ("ok", "lossy"):
            try:
                res.update(time_strategy(s, case, ctx, timer))
            except Exception as exc:  # noqa: BLE001
                res = {
                    "status": "error",
                    "error": f"timing: {type(exc).__name__}: {str(exc)[:300]}",
                }
        row["strategies"][s.name] = res

    def append_commit():      # after the strategies: it overwrites w slack columns per row
        case.kv.append(case.new_k, case.new_v)
        case.kv.commit_per_sequence(case.lens_t, torch.zeros_like(case.lens_t))

    row["append_ms"] = timer(append_commit, reps=max(3, timer.reps // 2))
    log(f"w={w} B={b} L={L} spread={spread}: " + ", ".join(
        f"{n}={r.get('ms', float('nan')):.3f}ms" if "ms" in r else f"{n}={r['status']}"
        for n, r in row["strategies"].items()))
    return row


def time_strategy(s: Strategy, case: Case, ctx, timer: Timer) -> dict:
    """`ms` (one call, L2 flushed, median) and `mask_ms` (its prepare); for a strategy with a
    `kernel_only` replay also `kernel_ms` (the device work alone, calls back to back) and
    `wrapper_ms` (`ms - kernel_ms`: what the call costs beyond its kernels)."""
    res = {"ms": timer(lambda: s.run(case, ctx))}
    res["mask_ms"] = timer(lambda: s.prepare(case), reps=max(3, timer.reps // 4), warmup=1)
    replay = s.kernel_only(case, ctx)
    if replay is not None:
        if timer.cuda:
            res["kernel_ms"] = timer.per_call(replay, calls=10, batches=max(3, timer.reps // 4))
        else:  # the g++ emulator: the replay is checked to run, its time means nothing
            res["kernel_ms"] = timer.per_call(replay, calls=1, batches=1)
        res["wrapper_ms"] = res["ms"] - res["kernel_ms"]
    return res


def precheck(cfg: dict, strategies: list[Strategy], reasons: dict) -> tuple[dict, list]:
    """Every available strategy on a small ragged batch (B=6, L=48, spread=24, each window), in the
    run's dtype and device: `{name: why}` for those that fail, and the checks' rows."""
    import torch

    device, dtype = torch.device(cfg["device"]), getattr(torch, cfg["dtype"])
    failed, rows = {}, []
    for w in cfg["windows"]:
        lens = make_lens(6, 48, 24, w, cfg["seed"] + 1)
        case = Case(
            w,
            lens,
            cfg["kv_heads"],
            cfg["q_heads"],
            cfg["head_dim"],
            dtype,
            device,
            seed=cfg["seed"] + 7,
        )
        ref = reference_attention(case)
        ref_keep = reference_attention(case, keep=min(lens))
        for s in strategies:
            if s.name in reasons:
                continue
            res = check_strategy(s, case, ref, ref_keep, tolerance(cfg["dtype"]))
            res.pop("_ctx", None)
            rows.append({"w": w, "lens": lens, "strategy": s.name, **res})
            if res["status"] not in ("ok", "lossy") and s.name not in failed:
                failed[s.name] = f"w={w} lens={lens}: {res['status']} " + (
                    f"err {res['err']:.3g} > tol {tolerance(cfg['dtype']):g}"
                    if "err" in res
                    else res.get("error", "")
                )
    return failed, rows


# ----------------------------------------------------------------------------- the run
def case_order(cfg: dict) -> list[tuple[int, int, int, int]]:
    """(w, B, L, spread) for the whole grid, the headline case (B=128, L=4096, spread 64,
    every w) first, then whole plot panels (every B of one (w, L, spread)), the longest L and the
    headline spread first, so a run cut short by its budget still has the cases that matter."""
    spreads = sorted(cfg["spreads"], key=lambda s: (s != HEADLINE["spread"], -s))
    grid = [
        (w, b, L, s)
        for L in sorted(cfg["lengths"], reverse=True)
        for s in spreads
        for w in cfg["windows"]
        for b in sorted(cfg["batches"], reverse=True)
    ]
    head = [
        c for c in grid if (c[1], c[2], c[3]) == (HEADLINE["b"], HEADLINE["L"], HEADLINE["spread"])
    ]
    return head + [c for c in grid if c not in head]


def _counted(log, count: str, msg: str) -> None:
    """A per-case progress line, with the case's count ("[3/24] ...")."""
    log(f"{count} {msg}")


def run_bench(cfg: dict, out_dir: Path, log=None) -> dict:
    """The whole run; writes bench.json after every case and bench.md / bench.png at the end.
    Returns the result dict."""
    import torch

    log = log or (lambda msg: None)
    device = torch.device(cfg["device"])
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            "--device cuda but torch.cuda.is_available() is False (use --smoke or --device cpu)"
        )
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    out_dir.mkdir(parents=True, exist_ok=True)
    t_start = time.monotonic()
    timer = Timer(device, cfg["warmup"], cfg["reps"])
    strategies = make_strategies(cfg["strategies"], cfg["flex_compile"])
    reasons = {}
    for s in strategies:
        why = s.unavailable(device)
        if why:
            reasons[s.name] = why
    result = {
        "schema": SCHEMA,
        "smoke": cfg["smoke"],
        "timer": "CUDA events, median, L2 flushed"
        if device.type == "cuda"
        else "time.perf_counter (SMOKE)",
        "settings": {k: v for k, v in cfg.items() if k != "strategies"},
        "strategies": cfg["strategies"],
        "labels": {s.name: STRATEGIES.get(s.name) or NEGATIVE_CONTROLS[s.name] for s in strategies},
        "machine": machine_info(device),
        "tolerance": tolerance(cfg["dtype"]),
        "not_run": reasons,
        "rows": [],
        "cases_not_run": [],
        "complete": False,
    }
    log(f"machine: {result['machine']}")
    result["copy_bandwidth"] = [copy_bandwidth(device, cfg["copy_mib"], timer)]
    log(f"copy bandwidth: {result['copy_bandwidth'][0]['GBps']:.1f} GB/s")
    failed, pre_rows = precheck(cfg, strategies, reasons)
    result["precheck"] = {"failed": failed, "rows": pre_rows}
    for name, why in failed.items():
        log(f"precheck: {name} WRONG: {why}")
    notes = {}
    # cases as they finish go to bench.partial.json, so a run cut short keeps what it measured
    # and an earlier run's bench.json is replaced only by a finished one
    path, partial = out_dir / "bench.json", out_dir / "bench.partial.json"
    order = case_order(cfg)
    for i, (w, b, L, spread) in enumerate(order):
        case_log = functools.partial(_counted, log, f"[{i + 1}/{len(order)}]")
        if cfg.get("budget_s") is not None and time.monotonic() - t_start > cfg["budget_s"]:
            result["cases_not_run"].append(
                {"w": w, "B": b, "L": L, "spread": spread, "reason": "time budget"}
            )
            continue
        try:
            row = run_case(cfg, strategies, reasons, timer, w, b, L, spread, failed, case_log)
        except Exception as exc:  # noqa: BLE001 - e.g. out of memory: the case is reported, the run goes on
            row = {
                "w": w,
                "B": b,
                "L": L,
                "spread": spread,
                "error": f"{type(exc).__name__}: {str(exc)[:300]}",
            }
            case_log(f"w={w} B={b} L={L} spread={spread}: case failed: {row['error']}")
        if device.type == "cuda":       # the case's tensors died with run_case
            torch.cuda.empty_cache()
        result["rows"].append(row)
        for s in strategies:
            if s.note:
                notes[s.name] = s.note
        result["notes"] = notes
        write_json(result, partial)
    result["copy_bandwidth"].append(copy_bandwidth(device, cfg["copy_mib"], timer))
    result["elapsed_s"] = time.monotonic() - t_start
    result["complete"] = True
    write_json(result, path)
    partial.unlink(missing_ok=True)
    write_reports(result, out_dir)
    return result

# ----------------------------------------------------------------------------- entry points


def read_result(path: Path) -> dict:
    """A bench.json or e2e.json written by this module; ValueError (naming what is wrong)
    for a missing, unreadable or malformed file."""
    if not path.is_file():
        raise ValueError("no such file")
    try:
        result = json.loads(path.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"not a JSON file written by raggedspec bench ({exc})") from None
    if not isinstance(result, dict) or not str(result.get("schema", "")).startswith(SCHEMA):
        raise ValueError(f"not a bench result: field `schema` must start with {SCHEMA!r}")
    key = "runs" if str(result["schema"]).endswith("/e2e") else "rows"
    if not isinstance(result.get(key), list):
        raise ValueError(f"field `{key}` must be a list")
    return result


def run(args) -> int:
    """Run from parsed arguments (the CLI's `run`): 0 ok; 1 a strategy came out WRONG (negative
    controls excepted); 2 bad usage."""
    from raggedspec.outputs import OutputPathError, check_output_dir, write_text_atomic

    if args.replot is not None:
        try:
            result = read_result(args.replot)
        except ValueError as exc:
            print(f"raggedspec bench: error: --replot {args.replot}: {exc}", file=sys.stderr)
            return 2
        if str(result.get("schema", "")).endswith("/e2e"):
            write_text_atomic(args.replot.parent / "e2e.md", render_e2e(result))
            print(render_e2e(result))
            return 0
        written = write_reports(result, args.replot.parent)
        print(render_markdown(result))
        print("wrote " + ", ".join(str(p) for p in written), file=sys.stderr)
        return 0
    try:
        check_output_dir(args.out, "--out")
    except OutputPathError as exc:
        print(f"raggedspec bench: error: {exc}", file=sys.stderr)
        return 2
    log = (
        (lambda msg: None) if args.quiet else (lambda msg: print(msg, file=sys.stderr, flush=True))
    )
    if args.e2e:
        try:
            cfg = e2e_settings(args)
            result = run_e2e(cfg, args.out, log)
        except ValueError as exc:
            print(f"raggedspec bench: error: {exc}", file=sys.stderr)
            return 2
        print(render_e2e(result))
        print(f"wrote {args.out}/e2e.json, e2e.md", file=sys.stderr)
        return 1 if any("error" in r for r in result["runs"]) else 0
    try:
        cfg = settings_from(args)
    except ValueError as exc:
        print(f"raggedspec bench: error: {exc}", file=sys.stderr)
        return 2
    if cfg["smoke"]:
        import torch
        torch.set_num_threads(int(os.environ.get("RAGGEDSPEC_TORCH_THREADS", "1")))
    try:
        result = run_bench(cfg, args.out, log)
    except ValueError as exc:
        print(f"raggedspec bench: error: {exc}", file=sys.stderr)
        return 2
    print(render_markdown(result))
    print(
        f"wrote {args.out}/bench.json, bench.md, bench.png in {result['elapsed_s']:.1f} s",
        file=sys.stderr,
    )
    bad = wrong_strategies(result)
    if bad:
        print(
            f"raggedspec bench: WRONG: {', '.join(bad)} disagree with the reference",
            file=sys.stderr,
        )
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m raggedspec.bench",
        description=__doc__.split("\n\n")[0],
        epilog="Exit codes: 0 ok; 1 a strategy came out WRONG; 2 bad input.",
    )
    add_arguments(p)
    try:
        args = p.parse_args(argv)
    except SystemExit as exc:
        return int(exc.code or 0)
    return run(args)


if __name__ == "__main__":
    sys.exit(main())

