"""The named semantic mutant catalogue.

Each `Mutant` is one small change to one rule, written as an exact source substitution:
`old` must occur exactly once in `file` (the runner refuses the entry otherwise, so a
refactor makes an entry fail loudly instead of silently mutating nothing). `spec` names the
row it comes from: "PR" for the 22 mutations the source PR lists
(source/mtp-draft-chain-per-row-positions.txt), "C§18" for cache-and-draft.md §18, "M§23" for
masks-and-scheduling.md §23, or another section. `tests` are the test files (or node ids) run
against the mutant, most specific first, with `-x`: the first failing test is the one recorded.

`expect = "survive"` marks the spec's known true equivalent; every such entry must also be in
`mutation/equivalent.toml` with its justification, and the gate fails if it is ever caught
(the equivalence claim would then be wrong) as well as if any other entry survives.

Adding a rule: add its entries to its family's module (name "function: what the mutant does"), run
`python -m raggedspec.mutation.runner --catalogue-only --only "function:"` and make every entry
CAUGHT.

The entries live in one module per family (mutation/catalogue_pr.py, catalogue_draft.py,
catalogue_step.py, catalogue_masks.py, catalogue_port.py, catalogue_kernels.py); this module
is the public one: `Mutant`, `M`, the lists and `select`.
"""

from __future__ import annotations

from raggedspec.mutation import (
    catalogue_draft,
    catalogue_masks,
    catalogue_port,
    catalogue_pr,
    catalogue_step,
)
from raggedspec.mutation.catalogue_kernels import KERNEL_MUTANTS
from raggedspec.mutation.mutant import TOPIC_FILES, M, Mutant

__all__ = ["ALL", "CATALOGUE", "KERNEL_CATALOGUE", "PORT_CATALOGUE", "TOPIC_FILES", "M",
           "Mutant", "select"]

CATALOGUE: list[Mutant] = (
    catalogue_pr.ENTRIES + catalogue_draft.ENTRIES + catalogue_step.ENTRIES
    + catalogue_masks.ENTRIES
)
PORT_CATALOGUE: list[Mutant] = catalogue_port.ENTRIES
KERNEL_CATALOGUE: list[Mutant] = [M(n, f, o, w, s, *t) for n, f, o, w, s, t in KERNEL_MUTANTS]

ALL: list[Mutant] = CATALOGUE + PORT_CATALOGUE + KERNEL_CATALOGUE


def select(scope: str = "all", only: str | None = None) -> list[Mutant]:
    """Entries in `scope` ("reference", "gpu" or "all") whose name contains `only`."""
    out = [m for m in ALL if scope == "all" or m.scope == scope]
    if only:
        out = [m for m in out if only.lower() in m.name.lower()]
    return out

