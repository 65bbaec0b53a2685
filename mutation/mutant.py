"""One catalogue entry (`Mutant`), the `M` shorthand that builds it, and the file names
entries refer to (rule sources and the conformance tests run against each mutant).

An entry names a test file; `TOPIC_FILES` expands the first file of a topic split over
several files into the whole family, in order.
"""

from __future__ import annotations

from dataclasses import dataclass, field



@dataclass(frozen=True)
class Mutant:
    name: str
    file: str
    old: str
    new: str
    spec: str
    tests: tuple[str, ...]
    expect: str = "caught"  # or "survive" (a documented true equivalent)
    subs: tuple[tuple[str, str], ...] = field(default=())  # extra (old, new) pairs, same file

    @property
    def scope(self) -> str:
        return "gpu" if self.file.startswith("gpu/") else "reference"

    def substitutions(self) -> tuple[tuple[str, str], ...]:
        return ((self.old, self.new),) + tuple(self.subs)



_C = "conformance/"
DISP, DRAFT, ALIGN, STEP = (
    _C + "test_dispatch.py",
    _C + "test_draft.py",
    _C + "test_align.py",
    _C + "test_step.py",
)
CAP, MASKS, ATTN, ROPE = (
    _C + "test_capability.py",
    _C + "test_masks.py",
    _C + "test_attention.py",
    _C + "test_rope.py",
)
ACC, SCHED, CACHE = _C + "test_accounting.py", _C + "test_scheduler.py", _C + "test_cache.py"
KILLS, SPEC_GAPS = _C + "test_mutation_kills.py", _C + "test_spec_gaps.py"
P_DISP = _C + "test_port_dispatch.py"
# Test files split by topic: an entry naming the first file runs the whole family, in order.
TOPIC_FILES = {
    ALIGN: (ALIGN, _C + "test_align_draft.py"),
    DRAFT: (DRAFT, _C + "test_draft_loop.py"),
    STEP: (STEP, _C + "test_step_commit.py"),
    SCHED: (SCHED, _C + "test_scheduler_admission.py", _C + "test_scheduler_telemetry.py"),
}

R_DISP, R_STEP, R_CAP, R_ALIGN = (
    "reference/dispatch.py",
    "reference/step.py",
    "reference/capability.py",
    "reference/align.py",
)
R_DRAFT, R_MASKS, R_ROPE, R_ACC = (
    "reference/draft.py",
    "reference/masks.py",
    "reference/rope.py",
    "reference/accounting.py",
)
R_SCHED = "reference/scheduler.py"
G_DISP, G_MASKS, G_ROPE = "gpu/dispatch.py", "gpu/masks.py", "gpu/rope.py"
G_KERN, P_KERN = "gpu/kernels.cu", _C + "test_cupy_kernels.py"
G_EMU, P_TC, P_WARP = "gpu/kernel_emulator.py", _C + "test_tc_kernel.py", _C + "test_kernel_warp.py"
P_MASKS, P_ROPE = _C + "test_port_masks.py", _C + "test_port_rope.py"


def M(
    name: str,
    file: str,
    old: str,
    new: str,
    spec: str,
    *tests: str,
    expect: str = "caught",
    subs: tuple[tuple[str, str], ...] = (),
) -> Mutant:
    """A `Mutant` whose tests are `tests` with each topic's first file expanded to its family
    (`TOPIC_FILES`), in the order given; every other argument is stored as passed."""
    files = tuple(f for t in tests for f in TOPIC_FILES.get(t, (t,)))
    return Mutant(name, file, old, new, spec, files, expect, tuple(subs))
