"""What a simulate or drift run will cost, estimated before it starts.

The trace is one row object per sequence per step it ran, so its size is bounded by the row-
steps a scenario can produce: a request runs at most `steps - arrival` steps, and at most
`prompt_len + max_new_tokens` of them (each step prefills or commits at least one token).
Bytes per row-step are the sizes seen for the simulator's own files (about 200 bytes a row in
JSONL, 112 in CSV, measured on a 64-row, 200-step run; `docs/benchmarks.md`), rounded up.

Memory: in lengths mode the trace is held in memory (about 250 bytes a row-step seen with
tracemalloc, its int64 row columns and bookkeeping) plus the step objects. In tensor mode
the KV caches dominate: per sequence and cached token, K and V of every attention layer (the
model's compressed layers and the MTP block), float64, times 8 for capacity growth, the
batched copy of each step and the forward's buffers. `python -m raggedspec.estimate` prints
estimate against seen for a few runs (docs/benchmarks.md). These are estimates, stated as
such; a run above `LIMIT_BYTES` is refused unless `--force` is given.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from raggedspec.reference.scenario import Scenario

LIMIT_BYTES = 2 * 1024**3  # 2 GiB: larger traces or memory need --force
JSONL_ROW_BYTES = 220
CSV_ROW_BYTES = 125
STEP_BYTES = 400  # a step object's own fields, per step, in every form
HEADER_BYTES = 4096  # the header (the resolved scenario) and the summary line
ROW_MEMORY_BYTES = 250  # a row-step held in memory (its int64 columns and bookkeeping), seen
BASE_MEMORY_BYTES = 2 * 1024**2  # the engine's own state, seen
KV_FACTOR = 8  # capacity growth, the batched per-step copy and the forward's buffers


@dataclass(frozen=True)
class Estimate:
    """Upper estimates of one run: row-steps, trace bytes (JSONL, CSV) and memory bytes."""

    row_steps: int
    jsonl_bytes: int
    csv_bytes: int
    memory_bytes: int
    mode: str

    def describe(self, csv: bool = False) -> str:
        out = (
            f"estimated trace {human(self.jsonl_bytes)} JSONL"
            + (f" + {human(self.csv_bytes)} CSV" if csv else "")
            + f" ({self.row_steps:,} row-steps), memory {human(self.memory_bytes)} "
            f"({self.mode} mode)"
        )
        return out


def human(n: float) -> str:
    """Bytes as a short text: 812 B, 3.4 MB, 1.2 GB (powers of 1024)."""
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1024 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TB"


def estimate(sc: Scenario, mode: str = "lengths") -> Estimate:
    """The estimate of a resolved `reference.scenario.Scenario` run in `mode`."""
    row_steps = 0
    kv_tokens = 0
    for r in sc.requests:
        row_steps += max(0, min(sc.steps - r.arrival, r.prompt_len + r.max_new_tokens))
        kv_tokens += min(sc.max_seq_len, r.prompt_len + r.max_new_tokens)
    steps = sc.steps
    jsonl = HEADER_BYTES + row_steps * JSONL_ROW_BYTES + steps * STEP_BYTES
    csv = HEADER_BYTES + row_steps * CSV_ROW_BYTES + steps * STEP_BYTES
    memory = BASE_MEMORY_BYTES + row_steps * ROW_MEMORY_BYTES + steps * STEP_BYTES
    if mode == "tensor":
        from raggedspec.reference.scenario import model_config

        cfg = model_config(sc)
        layers = len(cfg.compress_ratios) + 1
        per_token = 2 * layers * cfg.n_heads * cfg.head_dim * 8
        memory += kv_tokens * per_token * KV_FACTOR
    return Estimate(row_steps, jsonl, csv, memory, mode)


def over_limit(est: Estimate, csv: bool = False, limit: int | None = None) -> str | None:
    """None when the run fits; else a message naming what is over `limit` (default
    LIMIT_BYTES) and by how much."""
    limit = LIMIT_BYTES if limit is None else limit
    over = []
    trace = est.jsonl_bytes + (est.csv_bytes if csv else 0)
    if trace > limit:
        over.append(f"trace {human(trace)}")
    if est.memory_bytes > limit:
        over.append(f"memory {human(est.memory_bytes)}")
    if not over:
        return None
    return (
        f"{' and '.join(over)} estimated, above the {human(limit)} limit ({est.describe(csv)}); "
        "use fewer --steps or a smaller --batch, or --force to run it anyway"
    )


def measure(overrides: list[str], mode: str) -> dict:
    """Run one small scenario and return its estimate next to what was seen: the JSONL
    and CSV sizes written, and the peak of Python-tracked memory (tracemalloc) during the
    run. Used by `python -m raggedspec.estimate` for docs/benchmarks.md."""
    import tempfile
    import tracemalloc
    from pathlib import Path

    from raggedspec.drift import simulate
    from raggedspec.reference.scenario import load_scenario
    from raggedspec.reference.trace import write_csv, write_jsonl

    sc = load_scenario(None, overrides)
    est = estimate(sc, mode)
    tracemalloc.start()
    trace = simulate(sc, mode=mode)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    with tempfile.TemporaryDirectory() as tmp:
        write_jsonl(trace, Path(tmp) / "t.jsonl")
        write_csv(trace, Path(tmp) / "t.csv")
        jsonl, csv = (Path(tmp) / "t.jsonl").stat().st_size, (Path(tmp) / "t.csv").stat().st_size
    rows = sum(len(s["rows"]) for s in trace.steps())
    return {
        "scenario": " ".join(overrides),
        "mode": mode,
        "row_steps": rows,
        "row_steps_est": est.row_steps,
        "jsonl": jsonl,
        "jsonl_est": est.jsonl_bytes,
        "csv": csv,
        "csv_est": est.csv_bytes,
        "peak": peak,
        "memory_est": est.memory_bytes,
    }


CASES = (
    (["batch=64", "steps=200", "max_new_tokens=100000"], "lengths"),
    (["batch=512", "steps=100", "max_new_tokens=[20,400]"], "lengths"),
    (["batch=8", "steps=40", "prompt_len=64", "max_new_tokens=100"], "tensor"),
    (["batch=32", "steps=20", "prompt_len=200", "max_new_tokens=100"], "tensor"),
)


def main() -> None:
    """Print a Markdown table: estimate vs seen for CASES."""
    print(
        "| scenario | mode | row-steps seen / est. | JSONL seen / est. | CSV seen / est. | "
        "peak traced memory / est. |"
    )
    print("|---|---|---|---|---|---|")
    for overrides, mode in CASES:
        m = measure(overrides, mode)
        print(
            f"| `{m['scenario']}` | {mode} | {m['row_steps']:,} / {m['row_steps_est']:,} | "
            f"{human(m['jsonl'])} / {human(m['jsonl_est'])} | {human(m['csv'])} / "
            f"{human(m['csv_est'])} | "
            f"{human(m['peak'])} / {human(m['memory_est'])} |"
        )


if __name__ == "__main__":
    main()
