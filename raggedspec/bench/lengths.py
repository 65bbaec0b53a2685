"""The lengths-only simulator's benchmark: a B-row, many-step run timed wall and CPU.

`bench` runs `reference.lengths.run` on a scenario whose every request is long enough to run
all the steps (per-sequence advance granted in WB, or cohort advance) and returns the seconds
with the run's summary; `python -m raggedspec.bench.lengths --bench` times B = 1024 x 10,000
steps under both advance rules (docs/benchmarks.md). A timing tool beside the rules, not one.
"""

from __future__ import annotations

import argparse
import sys
import time

from raggedspec.reference.lengths import run
from raggedspec.reference.scenario import load_scenario


def bench(batch: int = 1024, steps: int = 10_000, advance: str = "per-sequence") -> dict:
    """Time a B-row, `steps`-step lengths-only run (every request long enough to run all
    steps); returns the timing and the run's summary."""
    data = {
        "batch": batch,
        "prompt_len": 64,
        "max_new_tokens": 10 * steps,
        "steps": steps,
        "depth": 3,
        "max_seq_len": 1 << 20,
        "acceptance": "profile:0.74,0.54,0.41",
        "max_draft_kv_seqs": None,
        "advance": advance,
    }
    if advance == "per-sequence":
        data.update(world="WB", admission="grant", xs_per_seq=True)
    sc = load_scenario(data)
    t0, c0 = time.perf_counter(), time.process_time()
    trace = run(sc)
    elapsed, cpu = time.perf_counter() - t0, time.process_time() - c0
    return {
        "batch": batch,
        "steps": steps,
        "advance": advance,
        "seconds": round(elapsed, 3),
        "cpu_seconds": round(cpu, 3),
        "summary": {
            k: trace.summary[k] for k in ("steps", "committed", "tok_per_step", "max_spread")
        },
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m raggedspec.bench.lengths", description=__doc__.splitlines()[0]
    )
    p.add_argument(
        "--bench", action="store_true", help="time B=1024 x 10,000 steps (both advance rules)"
    )
    p.add_argument("--batch", type=int, default=1024)
    p.add_argument("--steps", type=int, default=10_000)
    args = p.parse_args(argv)
    if not args.bench:
        p.print_help()
        return 2
    for adv in ("per-sequence", "cohort"):
        print(bench(args.batch, args.steps, adv), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
