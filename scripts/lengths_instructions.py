"""Instructions executed by the lengths-only simulator, two trees side by side.

A load-independent comparison for a shared machine: each tree's lengths benchmark
(`bench.lengths.bench`, B rows, prompt 64, depth 3, profile 0.74/0.54/0.41) runs under
valgrind's callgrind at two step counts, and the difference of the two totals (startup and
imports cancel) gives the instructions per 1,000 decode steps of each advance rule. Prints one
Markdown row per tree and rule: its tok_per_step (which must agree across trees), the
instructions, and the ratio to the first tree. Needs valgrind; each run takes about 50x its
native time (about 1-2 minutes at B = 1024 x 1,300 steps).

    python scripts/lengths_instructions.py BEFORE_TREE AFTER_TREE [--batch 1024] \
        [--steps 300 1300]

A tree is a checkout whose `raggedspec` imports resolve inside it (the repository root of a
clone, or a worktree with `raggedspec/<package>` links to its top-level packages).
"""

from __future__ import annotations

import argparse
import ast
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

DRIVER = (
    "import sys\n"
    "try:\n"
    "    from raggedspec.bench.lengths import bench\n"
    "except ImportError:  # a tree from before the benchmark moved beside the tools\n"
    "    from raggedspec.reference.lengths import bench\n"
    "print(bench(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])['summary'])\n"
)


def instructions(tree: Path, batch: int, steps: int, advance: str, work: Path) -> tuple[int, str]:
    """callgrind's instruction total for one run of `tree`'s bench, and the run's summary."""
    driver = work / "drive.py"
    driver.write_text(DRIVER)
    out = work / f"{tree.name}.{advance}.{steps}.cg"
    env = dict(os.environ, PYTHONPATH=str(tree))
    p = subprocess.run(
        ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", sys.executable,
         str(driver), str(batch), str(steps), advance],
        cwd=tree, env=env, capture_output=True, text=True, check=False,
    )
    m = re.search(r"Collected : (\d+)", p.stderr)
    if p.returncode != 0 or m is None:
        raise SystemExit(f"valgrind failed for {tree} ({advance}, {steps}):\n{p.stderr[-2000:]}")
    return int(m.group(1)), p.stdout.strip()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trees", nargs="+", type=Path, help="trees to compare; the first is the base")
    ap.add_argument("--batch", type=int, default=1024)
    ap.add_argument("--steps", type=int, nargs=2, default=[300, 1300], metavar=("LOW", "HIGH"))
    args = ap.parse_args(argv)
    if shutil.which("valgrind") is None:
        print("valgrind is not on the PATH", file=sys.stderr)
        return 2
    low, high = sorted(args.steps)
    print("| tree | advance rule | tok_per_step | instructions per 1,000 steps | ratio |")
    print("|---|---|---:|---:|---:|")
    with tempfile.TemporaryDirectory() as tmp:
        base: dict[str, float] = {}
        for advance in ("per-sequence", "cohort"):
            for tree in args.trees:
                a, _ = instructions(tree.resolve(), args.batch, low, advance, Path(tmp))
                b, summary_b = instructions(tree.resolve(), args.batch, high, advance, Path(tmp))
                per_1000 = (b - a) * 1000 / (high - low)
                base.setdefault(advance, per_1000)
                tps = ast.literal_eval(summary_b)["tok_per_step"]
                print(f"| {tree} | {advance} | {tps:.4f} | {per_1000 / 1e9:.3f} G | "
                      f"{per_1000 / base[advance]:.3f}x |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
