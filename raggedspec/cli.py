"""The `raggedspec` command line: `simulate`, `drift`, `conformance`, `bench`, `mutation` and
the other subcommands, each one entry of COMMANDS (its one-line help, a function that adds its
parser and a function that runs it).

Start-up is lazy: `raggedspec --help` builds only the list of commands, and a command builds
only its own parser and imports only its own modules. Exit codes (`raggedspec.exits`): 0 ok;
1 a rule refused, a check failed, or the user's plug-in raised (its traceback is printed);
2 bad input or a missing optional package, named in one line; 3 an internal error (traceback
saved to a file); 4 a first-run kernel check failed (preflight). Outputs are written
atomically. Detail: docs/simulator.md, section "raggedspec/cli.py".
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from raggedspec import __version__
from raggedspec.exits import (  # noqa: F401 (re-exported: the CLI's codes)
    EXIT_CODES,
    EXIT_CODES_SENTENCE,
    EXIT_FAILED,
    EXIT_INTERNAL,
    EXIT_OK,
    EXIT_REFUSED,
    EXIT_USAGE,
    UsageError,
    missing_extra,
    report_plugin_failure,
)

if TYPE_CHECKING:
    from raggedspec.progress import Progress
    from raggedspec.reference.scenario import Scenario


# ----------------------------------------------------------------------------- progress


def progress_factory(args) -> Callable[[str], Progress]:
    """label -> a tqdm Progress: a bar on a terminal, a line every few seconds when stderr
    is not a terminal, nothing with --quiet."""
    from raggedspec.progress import Progress, progress_mode

    mode = progress_mode(args.quiet)
    return lambda label: Progress(label, mode)


# ------------------------------------------------------------------- common scenario flags

# (flag, scenario key, argparse keywords). These are the common fields; any other key is set
# with --set KEY=VALUE or in a scenario file (docs/simulator.md lists every key and its range).
SCENARIO_FLAGS = [
    ("--batch", "batch", dict(type=int, help="number of requests (generated), B >= 1")),
    ("--arrival", "arrival", dict(help="arrival of the generated requests: all-at-once | staggered "
                                       "(request i at step i * stagger; --set stagger=N)")),
    ("--max-seq-len", "max_seq_len", dict(type=int, help="the model's max_seq_len, 2..2147483647 "
                                                         "(the token budget and cache capacity "
                                                         "limit)")),
    ("--depth", "depth", dict(type=int, help="MTP draft depth, 0..8 (window w = depth + 1)")),
    ("--advance", "advance", dict(help="advance rule: cohort | per-sequence (per-sequence is "
                                       "granted only with --xs-per-seq and --admission grant)")),
    ("--world", "world", dict(help="admission world: W0 | WA | WB")),
    ("--admission", "admission", dict(help="ragged admission, capability check 4: refuse | grant")),
    ("--strip", "strip", dict(help="dead-prefix strip: eager | lazy | none (none: the negative "
                                   "control)")),
    ("--xs-per-seq", "xs_per_seq", dict(action=argparse.BooleanOptionalAction, default=None,
                                        help="ARC_V4_XS_PER_SEQ: XsRolling slots carry their own "
                                             "length (--no-xs-per-seq turns it off over a "
                                             "scenario file)")),
    ("--acceptance", "acceptance", dict(help="acceptance model: geometric:0.7, "
                                             "profile:0.74,0.54,0.41, heterogeneous:0.2,0.9, "
                                             "all-accept, all-reject, file:PATH, "
                                             "oracle:module:callable")),
    ("--seed", "seed", dict(type=int, help="seed (acceptance, generated lengths, model), "
                                           "0..2**64-1")),
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


def example_names() -> list[str]:
    """The scenarios shipped in the package (`raggedspec.examples`), by file stem."""
    import importlib.resources

    files = importlib.resources.files("raggedspec.examples").iterdir()
    return sorted(f.name.rsplit(".", 1)[0] for f in files if f.name.endswith((".toml", ".json")))


def example_path(name: str) -> Path:
    """The file of the shipped scenario `name` (a real path: the package is on disk)."""
    import importlib.resources

    for f in importlib.resources.files("raggedspec.examples").iterdir():
        if f.name in (f"{name}.toml", f"{name}.json"):
            return Path(str(f))
    raise UsageError(
        f"--example {name!r}: no such scenario (shipped: {', '.join(example_names())})"
    )


def add_simulate(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "simulate", help="run one scenario and write its trace",
        description="Run the step simulator on a scenario (a TOML or JSON file, and/or the "
                    "flags below), write the trace (schema v1, docs/trace.md) and print the "
                    "spec's MTP[agg] and SCHED[agg] marker lines.")
    p.add_argument("scenario", nargs="?", type=Path, help="scenario file (.toml or .json)")
    p.add_argument("--example", choices=example_names(), default=None,
                   help="a scenario shipped with raggedspec instead of a file")
    add_scenario_flags(p, "scenario fields (override the scenario file)")
    p.add_argument("--mode", choices=("lengths", "tensor"), default="lengths",
                   help="lengths: integer lengths only, fast (default); tensor: the full "
                        "reference with KV tensors and the tiny model (same integer trace)")
    p.add_argument("--backend", default=None, metavar="NAME",
                   help="tensor mode: numpy (default), torch, cupy (CUDA only), or "
                        "package.module:factory")
    p.add_argument("--device", default=None,
                   help="tensor mode with --backend torch: cpu (default) or cuda")
    p.add_argument("--dtype", default=None, choices=("float64", "float32", "bfloat16"),
                   help="tensor mode with --backend torch: float64 (default), float32, bfloat16")
    p.add_argument("--out", type=Path, default=Path("trace.jsonl"),
                   help="JSONL trace to write (default: trace.jsonl)")
    p.add_argument("--csv", nargs="?", type=Path, const=True, default=None, metavar="PATH",
                   help="also write the CSV form (default path: --out with .csv; put the scenario "
                        "file before a bare --csv)")
    add_force(p)
    add_quiet(p)
    return p


def add_force(parser: argparse.ArgumentParser) -> None:
    from raggedspec import estimate as budget

    parser.add_argument("--force", action="store_true",
                        help="run even when the estimated trace or memory is above the "
                             f"{budget.human(budget.LIMIT_BYTES)} limit (the estimate is printed "
                             "first)")


def check_budget(sc: Scenario, mode: str, csv: bool, force: bool, command: str) -> None:
    """Print the run's estimate on stderr; UsageError when it is over the limit and not
    --force (nothing has been written yet)."""
    from raggedspec.estimate import estimate, over_limit

    est = estimate(sc, mode)
    over = over_limit(est, csv)
    if over and not force:
        raise UsageError(f"refusing to start: {over}")
    forced = " (over the limit: --force)" if over else ""
    print(f"raggedspec {command}: {est.describe(csv)}{forced}", file=sys.stderr)


def run_simulate(args) -> int:
    from raggedspec.drift import simulate
    from raggedspec.output_paths import writable_file
    from raggedspec.outputs import staged
    from raggedspec.reference.scenario import load_scenario
    from raggedspec.reference.trace import write_csv, write_jsonl

    if args.example is not None:
        if args.scenario is not None:
            raise UsageError("give a scenario file or --example, not both")
        args.scenario = example_path(args.example)
    if args.scenario is not None and not args.scenario.is_file():
        raise UsageError(f"scenario file {args.scenario} does not exist")
    out = writable_file(args.out, "--out")
    csv_path = None
    if args.csv is not None:
        csv_path = args.out.with_suffix(".csv") if args.csv is True else args.csv
        csv_path = writable_file(csv_path, "--csv")
        if csv_path.resolve() == out.resolve():
            raise UsageError(f"--csv {csv_path}: the same file as --out")
    backend = None
    if args.backend is not None or args.device is not None or args.dtype is not None:
        if args.mode != "tensor":
            raise UsageError("--backend, --device and --dtype need --mode tensor (lengths mode "
                             "has no tensors)")
        from raggedspec.reference.backend import load_backend
        try:
            backend = load_backend(args.backend, args.device, args.dtype)
        except ValueError as exc:
            raise UsageError(str(exc)) from exc
    sc = load_scenario(args.scenario, scenario_overrides(args))
    check_budget(sc, args.mode, csv_path is not None, args.force, "simulate")
    bar = progress_factory(args)(f"simulate ({args.mode})")
    try:
        trace = simulate(sc, mode=args.mode, progress=bar, backend=backend)
        # shown only when the run stopped before --steps: every request had finished or failed
        bar.close(f"ended at step {len(trace)} of at most {trace.header['scenario']['steps']}: "
                  "no request left to run")
    finally:
        bar.close()
    with staged() as stage:
        write_jsonl(trace, stage[out])
        if csv_path is not None:
            write_csv(trace, stage[csv_path])
    written = [out] + ([csv_path] if csv_path is not None else [])
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
                   help="output folder (default: out/drift); figures of an earlier run that "
                        "this run does not draw are removed from it")
    add_force(p)
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


def check_drift_budget(args: argparse.Namespace, batches: list[int]) -> None:
    """UsageError before any work when the memory estimated for drift's three runs (held
    together) and its largest sweep run is above the limit, unless --force."""
    from raggedspec import drift
    from raggedspec import estimate as budget
    from raggedspec.reference.scenario import load_scenario

    source = drift.DEFAULT_SCENARIO if args.scenario is None else args.scenario
    base = drift.override_list(scenario_overrides(args))
    estimate, human = budget.estimate, budget.human
    memory = sum(estimate(load_scenario(source, base + drift.override_list(extra))).memory_bytes
                 for _label, extra in drift.DRIFT_RUNS)
    if batches and "requests" not in load_scenario(source, base).to_dict():
        memory += estimate(load_scenario(source, base + [f"batch={max(batches)}"])).memory_bytes
    if memory > budget.LIMIT_BYTES and not args.force:
        raise UsageError(f"refusing to start: memory {human(memory)} estimated for the three runs "
                         f"and the largest sweep run, above the {human(budget.LIMIT_BYTES)} limit; "
                         "use fewer --steps or a smaller --batch or --batches, or --force")


def run_drift(args) -> int:
    from raggedspec import drift
    from raggedspec.output_paths import writable_dir

    out = writable_dir(args.out, "--out")
    if args.trace:
        if args.label and len(args.label) != len(args.trace):
            raise UsageError(f"--label given {len(args.label)} times for {len(args.trace)} "
                             "--trace files; give one per --trace, in order")
        if scenario_overrides(args):
            raise UsageError("scenario flags (--batch, ...) apply to --scenario runs, not to "
                             "--trace")
        labels = args.label or [None] * len(args.trace)
        runs = [drift.read_trace_file(t, lab)
                for t, lab in zip(args.trace, labels, strict=True)]
        summary = drift.write_report(runs, out)
    else:
        if args.label:
            raise UsageError(f"--label {args.label[0]!r}: labels name --trace panels, and no "
                             "--trace is given")
        if args.scenario is not None and not args.scenario.is_file():
            raise UsageError(f"scenario file {args.scenario} does not exist")
        batches = parse_batches(args.batches)
        check_drift_budget(args, batches)
        summary = drift.drift_from_scenario(
            args.scenario, out, overrides=scenario_overrides(args),
            batches=batches, progress=progress_factory(args))
    for run in summary["runs"]:
        tps = run["tok_per_step"]
        ended = (f" (refused at step {run['refused_at_step']}: over its {run['measured_steps']} "
                 "measured steps only)") if run.get("ended_by_refusal") else ""
        print(f"{run['label']}: max_spread={run['max_spread']} "
              f"mean_padding_fraction={run['mean_padding_fraction']} "
              f"tok_per_step={'n/a' if tps is None else f'{tps:.4f}'}{ended}")
        for msg in run["missing"]:
            print(f"  not plotted: {msg}", file=sys.stderr)
    for name in summary.get("removed_stale", []):
        print(f"removed {out / name}: a figure of an earlier run that this run does not draw",
              file=sys.stderr)
    print(f"wrote {len(summary['files'])} files to {out}", file=sys.stderr)
    return EXIT_OK


# ------------------------------------------------------------------------------- parser

def add_conformance(sub) -> argparse.ArgumentParser:
    from raggedspec.conformance.runner import add_parser
    return add_parser(sub)


def run_conformance(args) -> int:
    from raggedspec.conformance.runner import run
    return run(args)


def add_mutation(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "mutation",
        add_help=False,
        prefix_chars="\0",
        help="mutation testing: the named catalogue and mutmut (arguments go to "
        "raggedspec.mutation.runner; `raggedspec mutation --help` lists them)",
    )
    p.add_argument("runner_args", nargs=argparse.REMAINDER)
    return p


def run_mutation(args) -> int:
    from raggedspec.mutation.runner import main as mutation_main
    try:
        return mutation_main(args.runner_args)
    except SystemExit as exc:  # its own argparse: --help (0) or bad usage (2)
        return int(exc.code or 0) if not isinstance(exc.code, str) else EXIT_USAGE


def add_check_kernel(sub) -> argparse.ArgumentParser:
    from raggedspec.check_kernel import add_parser
    return add_parser(sub)


def run_check_kernel(args) -> int:
    from raggedspec.check_kernel import KernelUsageError, run
    try:
        return run(args)
    except KernelUsageError as exc:
        raise UsageError(str(exc)) from exc


def add_check_model(sub) -> argparse.ArgumentParser:
    from raggedspec.check_model import add_parser  # stdlib only; transformers loads when it runs
    return add_parser(sub)


def run_check_model(args) -> int:
    from raggedspec.check_model import ModelUsageError, run
    try:
        return run(args)
    except ModelUsageError as exc:
        raise UsageError(str(exc)) from exc


def add_bench(sub) -> argparse.ArgumentParser:
    from raggedspec.bench.runner import add_parser  # stdlib-only import; torch loads when it runs
    return add_parser(sub)


def run_bench(args) -> int:
    from raggedspec.bench.runner import run
    return run(args)


def add_preflight(sub) -> argparse.ArgumentParser:
    from raggedspec.preflight import add_arguments

    p = sub.add_parser(
        "preflight", help="first-run checks of the kernels: compile, stream, dtypes, timing"
    )
    add_arguments(p)
    return p


def run_preflight(args) -> int:
    from raggedspec.preflight import run
    return run(args)


def add_check_trace(sub) -> argparse.ArgumentParser:
    from raggedspec.check_trace import add_parser
    return add_parser(sub)


def run_check_trace(args) -> int:
    from raggedspec.check_trace import run
    try:
        return run(args)
    except ValueError as exc:  # a malformed trace (every problem named) or bad usage
        raise UsageError(str(exc)) from None


def add_vectors(sub) -> argparse.ArgumentParser:
    from raggedspec import vectors
    return vectors.add_parser(sub)


def run_vectors(args) -> int:
    from raggedspec import vectors
    return vectors.run(args)


@dataclass(frozen=True)
class Command:
    """A subcommand: its line in `raggedspec --help`, the function that adds its parser
    (importing its module only then), the function that runs it, and the extra of
    pyproject.toml that installs the packages it needs beyond the base install."""

    help: str
    add: Callable
    run: Callable
    extra: str | None = None
    passthrough: bool = False  # options it does not know go to the tool (pytest_args)


COMMANDS: dict[str, Command] = {
    "simulate": Command("run one scenario and write its trace", add_simulate, run_simulate,
                        "torch"),
    "drift": Command("plot length drift (PNG, SVG) and write summary.json", add_drift, run_drift),
    "conformance": Command("run the conformance suite against a backend; print a per-rule "
                           "table", add_conformance, run_conformance, "conformance",
                           passthrough=True),
    "bench": Command("benchmark ragged verify attention against the live-KV bound",
                     add_bench, run_bench, "torch"),
    "mutation": Command("mutation testing: the named catalogue and mutmut (`raggedspec mutation "
                        "--help` lists its options)", add_mutation, run_mutation, "mutation"),
    "preflight": Command("first-run checks of the kernels: compile, stream, dtypes, timing",
                         add_preflight, run_preflight, "cupy"),
    "check-trace": Command("check a trace (e.g. your engine's) against the spec's rules",
                           add_check_trace, run_check_trace),
    "check-kernel": Command("check an attention kernel in a standard layout against the "
                            "reference on generated speculative-decoding batches",
                            add_check_kernel, run_check_kernel, "check-kernel"),
    "check-model": Command("run generated ragged speculative-decoding steps through Hugging "
                            "Face transformers models (or your model factory), each row "
                            "against the row run alone", add_check_model, run_check_model,
                            "models"),
    "vectors": Command("write language-neutral test vectors (case.json + safetensors)",
                       add_vectors, run_vectors, "vectors"),
}


def command_of(argv: list[str]) -> str | None:
    """The subcommand `argv` names (its first word that is not an option), or None."""
    return next((a for a in argv if not a.startswith("-")), None)


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser: every command listed with its help line, and only `command`'s own
    parser built (the others are stubs that import nothing)."""
    parser = argparse.ArgumentParser(
        prog="raggedspec",
        description="Executable specification of batched speculative decoding with ragged "
                    "per-sequence KV advance: simulate a scenario, plot length drift, check "
                    "your engine's traces and kernels, run the conformance suite on your port.",
        epilog=EXIT_CODES_SENTENCE)
    parser.add_argument("--version", action="version", version=f"raggedspec {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, cmd in COMMANDS.items():
        if name != command:
            sub.add_parser(name, help=cmd.help)
            continue
        p = cmd.add(sub)
        p.set_defaults(run=cmd.run)
        if p.epilog is None:
            p.epilog = EXIT_CODES_SENTENCE
    return parser


def input_errors() -> tuple[type[Exception], ...]:
    """The exception classes that mean bad input (exit 2, one line, no traceback)."""
    from raggedspec.outputs import OutputPathError
    from raggedspec.reference.errors import ScenarioError

    errors = [UsageError, ScenarioError, OutputPathError]
    if "raggedspec.drift" in sys.modules:
        errors.append(sys.modules["raggedspec.drift"].TraceFormatError)
    return tuple(errors)


def report_internal_error(command: str, exc: BaseException) -> Path | None:
    """Save the traceback of a bug to a file in the temp folder; return its path (None when
    even that cannot be written)."""
    import tempfile
    import traceback

    text = "".join(traceback.format_exception(exc))
    try:
        fd, name = tempfile.mkstemp(prefix=f"raggedspec-{command}-internal-error-", suffix=".txt")
        with os.fdopen(fd, "w") as f:
            f.write(f"raggedspec {__version__}, command: {' '.join(sys.argv)}\n\n{text}")
        return Path(name)
    except OSError:
        return None


def run_command(args: argparse.Namespace) -> int:
    """Run the parsed command, turning each kind of failure into its exit code and message."""
    from raggedspec.reference.errors import Refusal

    try:
        return args.run(args)
    except Refusal as exc:
        print(f"raggedspec: refused ({type(exc).__name__}): {exc}", file=sys.stderr)
        return EXIT_REFUSED
    except input_errors() as exc:
        print(f"raggedspec {args.command}: error: {usage_message(args, exc)}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print(f"raggedspec {args.command}: interrupted; no output file was changed",
              file=sys.stderr)
        return 130
    except Exception as exc:  # noqa: BLE001 - the plug-in's failure, a missing extra, or a bug
        return unexpected(args.command, exc)


def usage_message(args: argparse.Namespace, exc: Exception) -> str:
    """The one-line message of a bad-input error, naming the scenario file it came from."""
    msg = str(exc)
    scenario = getattr(args, "scenario", None)
    from_file = type(exc).__name__ == "ScenarioError" and scenario is not None
    if from_file and str(scenario) not in msg:
        msg = f"{scenario} (or a flag over it): {msg}"
    return msg


def unexpected(command: str, exc: Exception) -> int:
    """An exception no command handled: the user's plug-in failing (exit 1, its traceback),
    an optional package missing (exit 2, the pip line), else a bug in raggedspec (exit 3,
    the traceback saved to a file)."""
    if report_plugin_failure(command, exc):
        return EXIT_FAILED
    line = missing_extra(COMMANDS[command].extra, exc)
    if line is not None:
        print(f"raggedspec {command}: error: this command needs the package {exc.name!r}, "
              f"which is not installed: {line}", file=sys.stderr)
        return EXIT_USAGE
    saved = report_internal_error(command, exc)
    where = f"the traceback is saved to {saved}" if saved else "the traceback could not be saved"
    print(f"raggedspec {command}: internal error (a bug in raggedspec, not in your "
          f"input): {type(exc).__name__}: {str(exc)[:200]}; {where}; please report it",
          file=sys.stderr)
    return EXIT_INTERNAL


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; returns the exit code (the console script exits with it)."""
    argv = sys.argv[1:] if argv is None else [str(a) for a in argv]
    command = command_of(argv)
    parser = build_parser(command)
    try:
        if command in COMMANDS and COMMANDS[command].passthrough:
            args, rest = parser.parse_known_args(argv)
            args.pytest_args = rest
        else:
            args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, --version (0) and usage errors (2)
        return int(exc.code or 0)
    return run_command(args)


if __name__ == "__main__":
    sys.exit(main())
