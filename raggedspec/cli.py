"""The `raggedspec` command line.

    raggedspec simulate [SCENARIO] [--batch B ...] [--out trace.jsonl] [--csv [trace.csv]]
    raggedspec drift [--scenario FILE | --trace FILE ...] [--out DIR]

Exit codes: 0 ok; 2 bad usage or bad configuration (the message names the key or value and
the allowed range); 1 a refusal raised by a rule of the spec (reference.errors.Refusal).

Each subcommand is one entry of COMMANDS: a function that adds its parser and a function
that runs it. Later subcommands (conformance, mutation, bench) are added the same way.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

from raggedspec import __version__

EXIT_OK, EXIT_REFUSED, EXIT_USAGE = 0, 1, 2


class UsageError(Exception):
    """Bad usage or bad configuration: exit 2 with this message."""


# ----------------------------------------------------------------------------- progress


class ProgressBar:
    """A plain-text bar on stderr, redrawn in place: `label [#####.....] 45/200`.

    Off (does nothing) when `enabled` is false; the CLI enables it only when stderr is a
    TTY and --quiet is not given. Call it with (done, total); it redraws at most every
    0.1 s and on completion, and `close()` ends the line. A run that ends before `total`
    (every request finished or failed early) does not leave a half-drawn bar: `close()`
    fills it and says where it ended (`note`, by default "ended at step N of at most T")."""

    def __init__(self, label: str, enabled: bool, stream=None, width: int = 28):
        self.label, self.enabled, self.width = label, enabled, width
        self.stream = stream if stream is not None else sys.stderr
        self._last = 0.0
        self._drawn = False
        self._done = self._total = 0

    def __call__(self, done: int, total: int) -> None:
        if not self.enabled or total <= 0:
            return
        self._done, self._total = done, total
        now = time.monotonic()
        if done < total and now - self._last < 0.1:
            return
        self._last = now
        filled = self.width * min(done, total) // total
        bar = "#" * filled + "." * (self.width - filled)
        self.stream.write(f"\r{self.label} [{bar}] {done}/{total}")
        self.stream.flush()
        self._drawn = True

    def close(self, note: str | None = None) -> None:
        """End the bar's line. If the last progress was short of the total, first redraw it
        full with `note` (default: "ended at step DONE of at most TOTAL")."""
        if self._drawn:
            if self._done < self._total:
                note = note or f"ended at step {self._done} of at most {self._total}"
                self.stream.write(f"\r{self.label} [{'#' * self.width}] {note}")
            self.stream.write("\n")
            self.stream.flush()
            self._drawn = False


def progress_factory(args) -> Callable[[str], ProgressBar]:
    """label -> a ProgressBar that draws only on a TTY and without --quiet."""
    enabled = not args.quiet and sys.stderr.isatty()
    return lambda label: ProgressBar(label, enabled)


# ------------------------------------------------------------------- common scenario flags

# (flag, scenario key, argparse keywords). These are the common fields; any other key is set
# with --set KEY=VALUE or in a scenario file (docs/simulator.md lists every key and its range).
SCENARIO_FLAGS = [
    ("--batch", "batch", dict(type=int, help="number of requests (generated), B >= 1")),
    ("--arrival", "arrival", dict(help="arrival of the generated requests: all-at-once | staggered "
                                       "(request i at step i * stagger; --set stagger=N)")),
    ("--max-seq-len", "max_seq_len", dict(type=int, help="the model's max_seq_len, >= 2 (the token budget "
                                                         "and cache capacity limit)")),
    ("--depth", "depth", dict(type=int, help="MTP draft depth, 0..8 (window w = depth + 1)")),
    ("--advance", "advance", dict(help="advance rule: cohort | per-sequence (per-sequence is "
                                       "granted only with --xs-per-seq and --admission grant)")),
    ("--world", "world", dict(help="admission world: W0 | WA | WB")),
    ("--admission", "admission", dict(help="ragged admission, capability check 4: refuse | grant")),
    ("--strip", "strip", dict(help="dead-prefix strip: eager | lazy | none (none: the negative control)")),
    ("--xs-per-seq", "xs_per_seq", dict(action=argparse.BooleanOptionalAction, default=None,
                                        help="ARC_V4_XS_PER_SEQ: XsRolling slots carry their own length "
                                             "(--no-xs-per-seq turns it off over a scenario file)")),
    ("--acceptance", "acceptance", dict(help="acceptance model: geometric:0.7, profile:0.74,0.54,0.41, "
                                             "heterogeneous:0.2,0.9, all-accept, all-reject, file:PATH, "
                                             "oracle:module:callable")),
    ("--seed", "seed", dict(type=int, help="seed (acceptance, generated lengths, model), >= 0")),
    ("--steps", "steps", dict(type=int, help="engine steps to simulate at most, >= 1")),
]


def add_scenario_flags(parser: argparse.ArgumentParser, title: str, exclude=()) -> None:
    group = parser.add_argument_group(title)
    for flag, key, kw in SCENARIO_FLAGS:
        if key not in exclude:
            kw = {"metavar": key.upper()} | kw if "action" not in kw else kw
            group.add_argument(flag, dest=f"sc_{key}", **kw)
    group.add_argument("--set", dest="sc_set", action="append", default=[], metavar="KEY=VALUE",
                       help="any other scenario key (value parsed as JSON, else a string; "
                            "dotted keys reach into tables), e.g. --set max_new_tokens=[100,300] "
                            "--set model.vocab=32; repeatable")


def scenario_overrides(args) -> list[str]:
    """The scenario keys given as flags, as load_scenario's "key=value" overrides (flag
    values JSON-encoded; --set entries verbatim, after the flags)."""
    out = []
    for _flag, key, _kw in SCENARIO_FLAGS:
        value = getattr(args, f"sc_{key}", None)
        if value is not None:
            out.append(f"{key}={json.dumps(value)}")
    return out + list(getattr(args, "sc_set", []))


def add_quiet(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-q", "--quiet", action="store_true",
                        help="no progress bar (it is also off when stderr is not a terminal)")


# ------------------------------------------------------------------------------ simulate


def add_simulate(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "simulate", help="run one scenario and write its trace",
        description="Run the step simulator on a scenario (a TOML or JSON file, and/or the "
                    "flags below), write the trace (schema v1, docs/trace.md) and print the "
                    "spec's MTP[agg] and SCHED[agg] marker lines.")
    p.add_argument("scenario", nargs="?", type=Path, help="scenario file (.toml or .json)")
    add_scenario_flags(p, "scenario fields (override the scenario file)")
    p.add_argument("--mode", choices=("lengths", "tensor"), default="lengths",
                   help="lengths: integer lengths only, fast (default); tensor: the full "
                        "reference with KV tensors and the tiny model (same integer trace)")
    p.add_argument("--backend", default=None, metavar="NAME",
                   help="tensor mode: numpy (default), torch, cupy (CUDA only), or package.module:factory")
    p.add_argument("--device", default=None, help="tensor mode with --backend torch: cpu (default) or cuda")
    p.add_argument("--dtype", default=None, choices=("float64", "float32", "bfloat16"),
                   help="tensor mode with --backend torch: float64 (default), float32, bfloat16")
    p.add_argument("--out", type=Path, default=Path("trace.jsonl"),
                   help="JSONL trace to write (default: trace.jsonl)")
    p.add_argument("--csv", nargs="?", type=Path, const=True, default=None, metavar="PATH",
                   help="also write the CSV form (default path: --out with .csv; put the scenario "
                        "file before a bare --csv)")
    add_quiet(p)
    return p


def run_simulate(args) -> int:
    from raggedspec.reference.drift import simulate
    from raggedspec.reference.trace import write_csv, write_jsonl

    if args.scenario is not None and not args.scenario.is_file():
        raise UsageError(f"scenario file {args.scenario} does not exist")
    backend = None
    if args.backend is not None or args.device is not None or args.dtype is not None:
        if args.mode != "tensor":
            raise UsageError("--backend, --device and --dtype need --mode tensor (lengths mode has no tensors)")
        from raggedspec.reference.backend import load_backend
        try:
            backend = load_backend(args.backend, args.device, args.dtype)
        except ValueError as exc:
            raise UsageError(str(exc)) from exc
    bar = progress_factory(args)(f"simulate ({args.mode})")
    try:
        trace = simulate(args.scenario, scenario_overrides(args), mode=args.mode, progress=bar,
                         backend=backend)
        # shown only when the run stopped before --steps: every request had finished or failed
        bar.close(f"ended at step {len(trace)} of at most {trace.header['scenario']['steps']}: "
                  "no request left to run")
    finally:
        bar.close()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_jsonl(trace, args.out)
    written = [args.out]
    if args.csv is not None:
        csv_path = args.out.with_suffix(".csv") if args.csv is True else args.csv
        csv_path.parent.mkdir(parents=True, exist_ok=True)
        write_csv(trace, csv_path)
        written.append(csv_path)
    for line in trace.markers():
        print(line)
    print("wrote " + ", ".join(str(p) for p in written), file=sys.stderr)
    summary = trace.summary or {}
    if summary.get("refusal"):
        print(f"raggedspec simulate: warning: {summary['refusal']}", file=sys.stderr)
    failed = [(s["step"], s["error"]) for s in trace.steps() if s.get("error")]
    if failed:
        step, msg = failed[0]
        print(f"raggedspec simulate: refused: {len(failed)} step(s) failed their requests; the "
              f"first, at step {step}: {msg}", file=sys.stderr)
        return EXIT_REFUSED
    return EXIT_OK


# --------------------------------------------------------------------------------- drift


def add_drift(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "drift", help="plot length drift (PNG, SVG) and write summary.json",
        description="Length-drift diagnostics. From a scenario (default: the built-in one) "
                    "it simulates three runs - cohort advance, per-sequence advance with the "
                    "dead-prefix strip, and per-sequence without it (the negative control) - "
                    "plus a tok_per_step sweep over the batch size. From --trace files (schema "
                    "v1, JSONL or CSV, e.g. written by your own engine) it plots those traces "
                    "side by side; only step, rows[].seq and rows[].own_len are required.")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--scenario", type=Path, help="scenario file (.toml or .json)")
    src.add_argument("--trace", type=Path, action="append",
                     help="trace file (JSONL or .csv); repeat to compare several traces")
    p.add_argument("--label", action="append",
                   help="panel title for each --trace, in order (default: the file name)")
    add_scenario_flags(p, "scenario fields (override the scenario; each run sets its own advance, "
                          "strip, admission = grant and xs_per_seq = true)",
                       exclude=("advance", "strip", "admission", "xs_per_seq"))
    p.add_argument("--batches", default="1,2,4,8,16,32,64,128",
                   help="batch sizes of the tok_per_step sweep (comma-separated; default "
                        "1,2,4,...,128); 'none' skips the sweep")
    p.add_argument("--out", type=Path, default=Path("out/drift"),
                   help="output folder (default: out/drift)")
    add_quiet(p)
    return p


def parse_batches(text: str) -> list[int]:
    if text.strip().lower() == "none":
        return []
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UsageError(f"--batches {text!r}: expected comma-separated integers >= 1") from None
    if not values or min(values) < 1:
        raise UsageError(f"--batches {text!r}: every batch size must be >= 1")
    return values


def run_drift(args) -> int:
    from raggedspec.reference import drift

    if args.trace:
        if args.label and len(args.label) != len(args.trace):
            raise UsageError(f"{len(args.label)} --label for {len(args.trace)} --trace")
        if scenario_overrides(args):
            raise UsageError("scenario flags (--batch, ...) apply to --scenario runs, not to --trace")
        labels = args.label or [None] * len(args.trace)
        runs = [drift.read_trace_file(t, lab) for t, lab in zip(args.trace, labels)]
        summary = drift.write_report(runs, args.out)
    else:
        if args.scenario is not None and not args.scenario.is_file():
            raise UsageError(f"scenario file {args.scenario} does not exist")
        summary = drift.drift_from_scenario(
            args.scenario, args.out, overrides=scenario_overrides(args),
            batches=parse_batches(args.batches), progress=progress_factory(args))
    for run in summary["runs"]:
        tps = run["tok_per_step"]
        ended = (f" (refused at step {run['refused_at_step']}: over its {run['measured_steps']} measured steps "
                 "only)") if run.get("ended_by_refusal") else ""
        print(f"{run['label']}: max_spread={run['max_spread']} "
              f"mean_padding_fraction={run['mean_padding_fraction']} "
              f"tok_per_step={'n/a' if tps is None else f'{tps:.4f}'}{ended}")
        for msg in run["missing"]:
            print(f"  not plotted: {msg}", file=sys.stderr)
    print(f"wrote {len(summary['files'])} files to {args.out}", file=sys.stderr)
    return EXIT_OK


# ------------------------------------------------------------------------------- parser

# name -> (add its parser, run it). Later: "conformance", "mutation", "bench".
def add_conformance(sub) -> argparse.ArgumentParser:
    from raggedspec.conformance.runner import add_parser
    return add_parser(sub)


def run_conformance(args) -> int:
    from raggedspec.conformance.runner import run
    return run(args)


def add_mutation(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "mutation", add_help=False, prefix_chars="\0",
        help="mutation testing: the named catalogue and mutmut (arguments go to raggedspec.mutation.runner; "
             "`raggedspec mutation --help` lists them)")
    p.add_argument("runner_args", nargs=argparse.REMAINDER)
    return p


def run_mutation(args) -> int:
    from raggedspec.mutation.runner import main as mutation_main
    return mutation_main(args.runner_args)


def add_bench(sub) -> argparse.ArgumentParser:
    from raggedspec.gpu.bench import add_parser  # stdlib-only import; torch loads when it runs
    return add_parser(sub)


def run_bench(args) -> int:
    from raggedspec.gpu.bench import run
    return run(args)


COMMANDS: dict[str, tuple[Callable, Callable]] = {
    "simulate": (add_simulate, run_simulate),
    "drift": (add_drift, run_drift),
    "conformance": (add_conformance, run_conformance),
    "bench": (add_bench, run_bench),
    "mutation": (add_mutation, run_mutation),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="raggedspec",
        description="Executable specification of batched speculative decoding with ragged "
                    "per-sequence KV advance: simulate a scenario, plot length drift.",
        epilog="Exit codes: 0 ok; 1 a rule refused (the message names it; simulate also exits 1 "
               "when a step of the run failed its requests, after writing the trace); 2 bad usage "
               "or bad configuration (the message names the key and its allowed range).")
    parser.add_argument("--version", action="version", version=f"raggedspec {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for add, run in COMMANDS.values():
        add(sub).set_defaults(run=run)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; returns the exit code (the console script exits with it)."""
    from raggedspec.reference.drift import TraceFormatError
    from raggedspec.reference.errors import Refusal
    from raggedspec.reference.scenario import ScenarioError

    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, --version (0) and usage errors (2)
        return int(exc.code or 0)
    try:
        return args.run(args)
    except Refusal as exc:
        print(f"raggedspec: refused ({type(exc).__name__}): {exc}", file=sys.stderr)
        return EXIT_REFUSED
    except (UsageError, TraceFormatError, ScenarioError) as exc:
        print(f"raggedspec {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
