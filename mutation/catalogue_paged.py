"""Catalogue entries for the paged-KV layout (gpu/paged.py).

Each entry plants a page-table bug of the kind a paged engine meets on rollback and
strip: an offset not advanced, a page offset off by one, a handle's shift ignored on
clone-in, a shared page written without a copy (`conformance/test_paged.py`'s lifecycle
property, every row's visible cache against the reference after every operation, or its
copy-on-write test must fail), and a clone-in batch that does not take over its rows'
pages (the step's append then copies tail pages: the byte count must fail). Rows are
`(name, file, old, new, spec, tests)`, as in `catalogue_kernels.py`.
"""

from __future__ import annotations

PAGED = "gpu/paged.py"
LIFECYCLE = (
    "conformance/test_paged.py::test_every_operation_on_pages_leaves_the_reference_view",
    "conformance/test_paged.py::test_a_shared_page_is_copied_before_a_write",
)

PAGED_MUTANTS: list[tuple[str, str, str, str, str, tuple[str, ...]]] = [
    ("paged advance: a strip does not move the table offset", PAGED,
     "self.start = self.start + (cut - from_zeros)", "self.start = self.start",
     "kernels: paged strip", LIFECYCLE),
    ("paged _locate: the page offset one column late", PAGED,
     "np.where(inside, logical % p, 0)", "np.where(inside, (logical + 1) % p, 0)",
     "kernels: page arithmetic", LIFECYCLE),
    ("paged stack_rows: a handle's shift ignored on clone-in", PAGED,
     "start[r] = kv.start[row] + max(shift - z, 0)", "start[r] = kv.start[row]",
     "kernels: paged clone-in", LIFECYCLE),
    ("paged _make_writable: a shared page written in place (no copy on write)", PAGED,
     "if page != 0 and store.owner[page] == self.id:", "if page != 0:",
     "kernels: copy on write", LIFECYCLE),
    ("paged stack_rows: a clone-in batch does not take over its rows' pages", PAGED,
     "store.owner[pages[store.owner[pages] == kv.id]] = out.id", "pass",
     "kernels: paged clone-in",
     ("conformance/test_paged.py::test_the_paged_bytes_are_counted_on_the_paged_layout",)),
]
