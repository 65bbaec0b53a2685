"""Hypothesis strategies for ragged batches, shared by the conformance suite.

Conventions: a *length* is a row's live length (tokens in its own cache); a batch is
front-aligned (left-padded) to `max(lengths)`, so row i's *lead* (dead prefix) is
`max(lengths) - lengths[i]` and at least one lead is 0.

- `ragged_lengths(min_rows, max_rows, min_len, max_len, force_ragged=False)`: per-row live
  lengths, independent draws (uniform batches included unless `force_ragged`).
- `uniform_lengths(min_rows, max_rows, min_len, max_len)`: every row the same length.
- `lead_pads(min_rows, max_rows, max_lead)`: front-alignment leads, some lead 0.
- `leads_of(lengths)`: the leads a front alignment of `lengths` gives (a plain function).
"""

from __future__ import annotations

from hypothesis import strategies as st


def leads_of(lengths: list[int]) -> list[int]:
    """Front-alignment leads: `max(lengths) - lengths[i]` (empty -> empty)."""
    top = max(lengths, default=0)
    return [top - n for n in lengths]


@st.composite
def ragged_lengths(draw, min_rows: int = 1, max_rows: int = 6, min_len: int = 1,
                   max_len: int = 80, force_ragged: bool = False) -> list[int]:
    """Per-row live lengths in `[min_len, max_len]`, `min_rows..max_rows` rows. With
    `force_ragged` at least two rows differ (needs `max_rows >= 2`, `min_len < max_len`)."""
    if force_ragged:
        if max_rows < 2 or min_len >= max_len:
            raise ValueError(f"force_ragged needs max_rows >= 2 (got {max_rows}) and "
                             f"min_len < max_len (got {min_len}, {max_len})")
        min_rows = max(min_rows, 2)
    n = draw(st.integers(min_rows, max_rows))
    lengths = draw(st.lists(st.integers(min_len, max_len), min_size=n, max_size=n))
    if force_ragged and len(set(lengths)) == 1:
        i = draw(st.integers(0, n - 1))
        lengths[i] = min_len if lengths[i] != min_len else max_len
    return lengths


@st.composite
def uniform_lengths(draw, min_rows: int = 1, max_rows: int = 6, min_len: int = 1,
                    max_len: int = 80) -> list[int]:
    """A uniform batch: `min_rows..max_rows` rows of one length in `[min_len, max_len]`."""
    n = draw(st.integers(min_rows, max_rows))
    return [draw(st.integers(min_len, max_len))] * n


@st.composite
def lead_pads(draw, min_rows: int = 1, max_rows: int = 6, max_lead: int = 16) -> list[int]:
    """Leads of a front-aligned batch: each in `[0, max_lead]`, at least one exactly 0."""
    n = draw(st.integers(min_rows, max_rows))
    leads = draw(st.lists(st.integers(0, max_lead), min_size=n, max_size=n))
    if leads and min(leads) > 0:
        leads[draw(st.integers(0, n - 1))] = 0
    return leads
