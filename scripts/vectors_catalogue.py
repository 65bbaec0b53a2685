"""Which mutants of the reference catalogue do the test vectors catch?

`python scripts/vectors_catalogue.py [--only TEXT]` (from the repository root) writes the
default vectors from the unmutated tree, then applies each reference-scope entry of
mutation/catalogue.py (its name containing TEXT, if given) in a private copy of the tree and
runs examples/vectors_consumer.py there against the mutated reference. It prints one line per
entry (the vector functions that fail, or "not caught") and a summary line. It changes
nothing in the checkout; the copies live under the system temp folder and are removed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

RUN = """
import json, sys
sys.path.insert(0, "examples")
import vectors_consumer
from raggedspec.vectors.port import reference_table
report = vectors_consumer.run_vectors(sys.argv[1], reference_table())
print(json.dumps(sorted({"/".join(w.split("/")[:2]) for w, _ in report.failed})))
"""


def sweep(only: str | None = None) -> dict[str, list[str]]:
    """{entry name: the vector functions its mutant fails} for the reference catalogue."""
    sys.path.insert(0, str(ROOT))
    from raggedspec.mutation.catalogue import CATALOGUE
    from raggedspec.mutation.runner import mutated_source

    entries = [m for m in CATALOGUE if m.scope == "reference" and (not only or only in m.name)]
    base = Path(tempfile.mkdtemp(prefix="raggedspec-vectors-catalogue-"))
    try:
        vectors = base / "vectors"
        subprocess.run(
            [sys.executable, "-m", "raggedspec", "vectors", "--out", str(vectors)],
            cwd=ROOT,
            check=True,
            capture_output=True,
        )
        tree = base / "tree"
        for part in ("reference", "gpu", "raggedspec", "examples", "mutation"):
            shutil.copytree(ROOT / part, tree / part, ignore=shutil.ignore_patterns("__pycache__"),
                        symlinks=True)
        env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1", CUDA_VISIBLE_DEVICES="")
        env.pop("PYTHONPATH", None)
        results = {}
        for m in entries:
            target, original = tree / m.file, (ROOT / m.file).read_text()
            target.write_text(mutated_source(m, original))
            try:
                run = subprocess.run(
                    [sys.executable, "-c", RUN, str(vectors)],
                    cwd=tree,
                    env=env,
                    capture_output=True,
                    text=True,
                    timeout=300,
                    check=False,
                )
            finally:
                target.write_text(original)
            if run.returncode != 0:
                results[m.name] = [f"error: {run.stderr.strip().splitlines()[-1]}"]
            else:
                results[m.name] = json.loads(run.stdout.strip().splitlines()[-1])
        return results
    finally:
        shutil.rmtree(base, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", help="entries whose name contains this text")
    args = parser.parse_args(argv)
    results = sweep(args.only)
    for name, failed in results.items():
        print(f"{name}: {', '.join(failed) if failed else 'not caught'}")
    caught = sum(1 for f in results.values() if f)
    print(
        f"{caught} of {len(results)} reference catalogue entries fail at least one vector function"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
