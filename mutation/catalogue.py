"""The named semantic mutant catalogue.

Each `Mutant` is one small change to one rule as an exact source substitution (`old` must
occur exactly once in `file`), with the spec row it comes from and the tests run against it;
`expect = "survive"` marks a documented equivalent (also in `mutation/equivalent.toml`).
Fields, the gate and how to add a rule's entries: docs/mutation.md, section
"mutation/catalogue.py".

The entries live in one module per family (catalogue_pr.py, catalogue_draft.py,
catalogue_step.py, catalogue_masks.py, catalogue_port.py, catalogue_kernels.py,
catalogue_paged.py, catalogue_survivors.py, catalogue_survivors_port.py,
catalogue_survivors_sim.py, catalogue_survivors_lengths.py); this module
is the public one: `Mutant`, `M`, the lists and `select`.
"""

from __future__ import annotations

from raggedspec.mutation import (
    catalogue_draft,
    catalogue_masks,
    catalogue_port,
    catalogue_pr,
    catalogue_step,
    catalogue_survivors,
    catalogue_survivors_lengths,
    catalogue_survivors_port,
    catalogue_survivors_sim,
)
from raggedspec.mutation.catalogue_kernels import KERNEL_MUTANTS
from raggedspec.mutation.catalogue_paged import PAGED_MUTANTS
from raggedspec.mutation.mutant import TOPIC_FILES, M, Mutant

__all__ = ["ALL", "CATALOGUE", "KERNEL_CATALOGUE", "PORT_CATALOGUE", "TOPIC_FILES", "M",
           "Mutant", "select"]

CATALOGUE: list[Mutant] = (
    catalogue_pr.ENTRIES + catalogue_draft.ENTRIES + catalogue_step.ENTRIES
    + catalogue_masks.ENTRIES + catalogue_survivors.REFERENCE_ENTRIES
    + catalogue_survivors_sim.ENTRIES + catalogue_survivors_lengths.ENTRIES
)
PORT_CATALOGUE: list[Mutant] = (
    catalogue_port.ENTRIES + catalogue_survivors.PORT_ENTRIES + catalogue_survivors_port.ENTRIES
)
KERNEL_CATALOGUE: list[Mutant] = [M(n, f, o, w, s, *t) for n, f, o, w, s, t in KERNEL_MUTANTS]
from raggedspec.mutation.catalogue_boundaries import BOUNDARY_MUTANTS  # noqa: E402
KERNEL_CATALOGUE += [M(n, f, o, w, s, *t) for n, f, o, w, s, t in BOUNDARY_MUTANTS]

KERNEL_CATALOGUE += [M(n, f, o, w, s, *t) for n, f, o, w, s, t in PAGED_MUTANTS]

ALL: list[Mutant] = CATALOGUE + PORT_CATALOGUE + KERNEL_CATALOGUE


def select(scope: str = "all", only: str | None = None) -> list[Mutant]:
    """Entries in `scope` ("reference", "gpu" or "all") whose name contains `only`."""
    out = [m for m in ALL if scope == "all" or m.scope == scope]
    if only:
        out = [m for m in out if only.lower() in m.name.lower()]
    return out

