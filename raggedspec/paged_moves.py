"""Counted K/V bytes the paged port moves in one decode step, for the benchmark's data
movement table.

`count_paged_moves` runs one step of the paged layout (`gpu.paged`) the way the per-sequence
loop runs it: a batch assembled from row handles (a clone-in: table rows, it owns no page),
the step's append of `w` columns per row, a rollback of one column and a dead-prefix strip
of one column, and reads the page store's counters (`PageStore.moved`) around each. The
rows hold `lens_i % page_size + page_size` columns: what a step moves depends on where each
row's end falls inside its page (an append into a tail page the batch does not own copies
that page's live prefix first), not on the length, so these rows move the bytes the
full-length rows would.
"""

from __future__ import annotations

import numpy as np
import torch

from raggedspec.gpu.paged import PagedRaggedKv, PageStore, stack_rows

DEFAULT_PAGE_SIZE = 16


def count_paged_moves(lens: list[int], w: int, hk: int, d: int, dtype: torch.dtype,
                      device, page_size: int = DEFAULT_PAGE_SIZE) -> dict:
    """`{"paged_append_bytes", "paged_cow_bytes", "paged_strip_bytes",
    "paged_rollback_bytes", "page_size"}` counted for one step of rows of lengths `lens`
    (module docstring); `paged_cow_bytes` is the part of the append that copies shared
    tail pages. ValueError on an empty batch or `w < 1`."""
    if not lens or w < 1:
        raise ValueError(f"count_paged_moves needs rows and w >= 1, got {len(lens)} rows, w={w}")
    b, p = len(lens), int(page_size)
    held = np.asarray([n % p + p for n in lens], dtype=np.int64)
    store = PageStore(hk, d, d, p, dtype, device)
    built = PagedRaggedKv.empty(store, b, 1 << 30)
    top = int(held.max())
    built.append(torch.ones((b, hk, top, d), dtype=dtype, device=device),
                 torch.ones((b, hk, top, d), dtype=dtype, device=device))
    built.lens = held
    batch = stack_rows([(built, i, 0) for i in range(b)], held, 1 << 30)
    store.reserve(2 * b * (-(-w // p) + 1))      # room: the step's counts hold no growth

    def moved() -> int:
        return store.moved["write"] + store.moved["grow"]

    before = moved()
    new = torch.ones((b, hk, w, d), dtype=dtype, device=device)
    batch.append(new, new)
    append = moved() - before
    before = moved()
    batch.lens = batch.host_lens() - 1           # rollback of one column
    rollback = moved() - before
    before = moved()
    batch.advance(np.ones(b, dtype=np.int64))    # strip of a one-column dead prefix
    strip = moved() - before
    fresh = 2 * b * w * hk * d * new.element_size()
    return {"paged_append_bytes": append, "paged_cow_bytes": append - fresh,
            "paged_strip_bytes": strip, "paged_rollback_bytes": rollback, "page_size": p}


def table(batches=(8, 32, 128), windows=(2, 4), L: int = 4096, spread: int = 64, hk: int = 8,
          d: int = 128, dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> str:
    """A markdown table of `count_paged_moves` over the benchmark's case shapes (its
    `make_lens`), beside the in-place port's append bytes (`2 * B * w * Hk * D * es`)."""
    from raggedspec.bench.strategies import make_lens

    es = torch.empty((), dtype=dtype).element_size()
    out = ["| w | B | L | spread | in-place append KiB | paged append KiB (copy on write KiB) | "
           "paged rollback bytes | paged strip bytes |", "|---|---|---|---|---|---|---|---|"]
    for w in windows:
        for b in batches:
            got = count_paged_moves(make_lens(b, L, spread, w, seed), w, hk, d, dtype, "cpu")
            out.append(f"| {w} | {b} | {L} | {spread} | {2 * b * w * hk * d * es / 2**10:.1f} | "
                       f"{got['paged_append_bytes'] / 2**10:.1f} "
                       f"({got['paged_cow_bytes'] / 2**10:.1f}) | "
                       f"{got['paged_rollback_bytes']} | {got['paged_strip_bytes']} |")
    return "\n".join(out)


if __name__ == "__main__":
    print(table())


__all__ = ["DEFAULT_PAGE_SIZE", "count_paged_moves", "table"]
