"""Count blocking tensor->host reads and aten ops per decode step of the torch backend's
tensor-mode simulation (B = 8, 32, 128 x cohort / per-sequence by default); prints the table
of docs/benchmarks.md "Host work per decode step". Options: see `raggedspec.host_work`."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from raggedspec.host_work import main

if __name__ == "__main__":
    raise SystemExit(main())
