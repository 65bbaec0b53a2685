"""Hypothesis strategies for ragged batches, shared by the conformance suite.

Conventions: a *length* is a row's live length (tokens in its own cache); a batch is
front-aligned (left-padded) to `max(lengths)`, so row i's *lead* (dead prefix) is
`max(lengths) - lengths[i]` and at least one lead is 0.

- `ragged_lengths(min_rows, max_rows, min_len, max_len, force_ragged=False)`: per-row live
  lengths, independent draws (uniform batches included unless `force_ragged`).
- `uniform_lengths(min_rows, max_rows, min_len, max_len)`: every row the same length.
- `lead_pads(min_rows, max_rows, max_lead)`: front-alignment leads, some lead 0.
- `leads_of(lengths)`: the leads a front alignment of `lengths` gives (a plain function).
- `around(points, lo)`: each point, one below and one above (the integer boundaries).
- `allocation_lengths(lo, hi)`: lengths at the allocation boundaries (the draft cache's first
  16 columns, every 512-column block up to `hi`) or anywhere in `[lo, hi]`.
- `bf16_inexact_positions(lo, hi)`: positions bfloat16 cannot hold exactly (odd, > 256).
- `kv_head_layouts(kv_heads, ratios, max_heads)`: a model's `(n_heads, n_kv_heads)`, MQA
  (one KV head) or GQA (several, each serving `ratio` query heads).
"""

from __future__ import annotations

from hypothesis import strategies as st

from raggedspec.reference.cache import CACHE_GROW_SIZE, DRAFT_CACHE_CAPACITY


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


# --- corners for the port's conformance (appended by the torch-port tests) -------------------

GROWTH_BOUNDARIES = (511, 512, 513, 1023, 1024, 1025)
"""Lengths on either side of the 512-column cache growth steps."""


@st.composite
def corner_lengths(draw, min_rows: int = 1, max_rows: int = 6, max_len: int = 80,
                   boundaries: bool = True) -> list[int]:
    """Per-row live lengths reaching the corners: a uniform batch, a single row, one row far
    behind the rest, or independent draws; with `boundaries`, lengths may sit at the
    512-column growth steps (`GROWTH_BOUNDARIES`). Lengths are >= 1."""
    n = draw(st.integers(min_rows, max_rows))
    value = st.integers(1, max_len)
    if boundaries:
        value = st.one_of(value, st.sampled_from(GROWTH_BOUNDARIES))
    shape = draw(st.sampled_from(["independent", "uniform", "one_behind"]))
    if shape == "uniform":
        return [draw(value)] * n
    lens = draw(st.lists(value, min_size=n, max_size=n))
    if shape == "one_behind" and n >= 2:
        top = max(lens)
        lens = [top] * n
        lens[draw(st.integers(0, n - 1))] = draw(st.integers(1, max(1, top // 8)))
    return lens


@st.composite
def accept_steps(draw, min_rows: int = 1, max_rows: int = 8, max_depth: int = 8):
    """`(uncached, accepted, w)` on the reachable domain (`u_i in [1, w]`,
    `a_i in [0, w - u_i]`, `w = depth + 1`, depth 1..max_depth), with the all-rejected and
    all-accepted steps as explicit corners."""
    depth = draw(st.integers(1, max_depth))
    w = depth + 1
    n = draw(st.integers(min_rows, max_rows))
    u = draw(st.lists(st.integers(1, w), min_size=n, max_size=n))
    corner = draw(st.sampled_from(["any", "all_rejected", "all_accepted"]))
    if corner == "all_rejected":
        a = [0] * n
    elif corner == "all_accepted":
        a = [w - x for x in u]
    else:
        a = [draw(st.integers(0, w - x)) for x in u]
    return u, a, w


@st.composite
def verify_blocks(draw, min_rows: int = 1, max_rows: int = 8, max_width: int = 9, vocab: int = 4):
    """`(proposed, target)`: per-row token lists over a small vocabulary (so matches are
    common), lengths 0..max_width each, drawn independently (proposed longer, shorter or
    equal), with all-match rows as a corner."""
    n = draw(st.integers(min_rows, max_rows))
    proposed, target = [], []
    for _ in range(n):
        p = draw(st.lists(st.integers(0, vocab - 1), max_size=max_width))
        if draw(st.booleans()):
            t = p[: draw(st.integers(0, len(p)))] + draw(
                st.lists(st.integers(0, vocab - 1), max_size=2)
            )
        else:
            t = draw(st.lists(st.integers(0, vocab - 1), max_size=max_width))
        proposed.append(p)
        target.append(t)
    return proposed, target


def compress_ratios():
    """The V4 layer kinds: 0 (Standard), 4 (CSA), 128 (HCA)."""
    return st.sampled_from([0, 4, 128])


# --- allocation boundaries and low-precision positions ---------------------------------------


def around(points, lo: int = 0) -> st.SearchStrategy[int]:
    """Each of `points`, one below and one above (values below `lo` dropped), sorted."""
    values = sorted({p + d for p in points for d in (-1, 0, 1) if p + d >= lo})
    if not values:
        raise ValueError(f"no boundary of {list(points)} is >= {lo}")
    return st.sampled_from(values)


def allocation_points(hi: int) -> list[int]:
    """The allocation boundaries up to `hi`: the draft cache's first `DRAFT_CACHE_CAPACITY`
    columns and every `CACHE_GROW_SIZE`-column block."""
    return [DRAFT_CACHE_CAPACITY] + list(range(CACHE_GROW_SIZE, hi + 1, CACHE_GROW_SIZE))


def allocation_lengths(lo: int = 1, hi: int = 1600) -> st.SearchStrategy[int]:
    """A length at an allocation boundary (at, one below, one above) or anywhere in
    `[lo, hi]`; the boundaries come first so that shrinking lands on them."""
    edges = around(allocation_points(hi), lo).filter(lambda n: n <= hi)
    return st.one_of(edges, st.integers(lo, hi))


def bf16_inexact_positions(lo: int = 257, hi: int = 4000) -> st.SearchStrategy[int]:
    """A position in `[lo, hi]` that bfloat16 (8 significant bits) cannot represent: odd and
    above 256. A port that rounds positions to its dtype moves these."""
    lo = max(lo, 257)
    odd = st.integers(lo // 2, (hi - 1) // 2).map(lambda k: 2 * k + 1)
    return odd.filter(lambda p: lo <= p <= hi)


# --- attention head layouts ------------------------------------------------------------------

GQA_RATIOS = (2, 4, 8)
"""Query heads per KV head that the end-to-end GQA runs reach explicitly."""


def kv_head_layouts(
    kv_heads=(1, 2, 4), ratios=(2, 1, 4, 8), max_heads: int = 16
) -> st.SearchStrategy[tuple[int, int]]:
    """`(n_heads, n_kv_heads)`: `n_kv_heads` drawn from `kv_heads`, each KV head serving
    `ratio` query heads (`n_heads = ratio * n_kv_heads`, at most `max_heads`). Shrinks toward
    the first of each (by default the tiny model's own layout: 2 query heads, one KV head).
    Every layout is a valid `ModelConfig` (`n_kv_heads` divides `n_heads`)."""
    if not any(k * r <= max_heads for k in kv_heads for r in ratios):
        raise ValueError(f"no layout of kv_heads {kv_heads} and ratios {ratios} has at most "
                         f"{max_heads} query heads")
    pairs = st.tuples(st.sampled_from(kv_heads), st.sampled_from(ratios))
    return pairs.map(lambda p: (p[0] * p[1], p[0])).filter(lambda p: p[0] <= max_heads)


# --- draft KV, draft chain and the model's forward ------------------------------------------


@st.composite
def chain_groups(draw):
    """A draft group of G rows for the port's chain on pool rows: `(starts, tails, others,
    order, n, seed)`: chain starts (independent, uniform, or one row far behind), each row's
    speculative tail past its start, 0..3 other sequences' lengths in the pool, the shuffled
    pool row of every sequence, a chain length 1..8 (depth up to 8) and a seed."""
    g = draw(st.integers(1, 6))
    shape = draw(st.sampled_from(["independent", "uniform", "one_behind"]))
    if shape == "uniform":
        starts = [draw(st.integers(1, 30))] * g
    else:
        starts = draw(st.lists(st.integers(1, 30), min_size=g, max_size=g))
        if shape == "one_behind" and g >= 2:
            starts = [30] * g
            starts[draw(st.integers(0, g - 1))] = draw(st.integers(1, 4))
    tails = draw(st.lists(st.integers(0, 3), min_size=g, max_size=g))
    others = draw(st.lists(st.integers(0, 30), max_size=3))
    order = draw(st.permutations(list(range(g + len(others)))))
    return starts, tails, others, order, draw(st.integers(1, 8)), draw(st.integers(0, 2**32 - 1))


@st.composite
def write_back_groups(draw):
    """A draft group for the group loop: `(starts, tails, n, per_seq, seed)`: 1..4 chain
    starts (uniform half the time, and always without per-sequence advance: its scalar group
    keys give a group one chain start, C §9.1), held tails past them (negative: a start past
    the held rows), a chain length 1..4, the per-sequence flag and a seed."""
    g = draw(st.integers(1, 4))
    starts = draw(st.lists(st.integers(1, 14), min_size=g, max_size=g))
    uniform = draw(st.booleans())
    tails = draw(st.lists(st.integers(-2, 3), min_size=g, max_size=g))
    n, per_seq = draw(st.integers(1, 4)), draw(st.booleans())
    if uniform or not per_seq:
        starts = [starts[0]] * g
    return starts, tails, n, per_seq, draw(st.integers(0, 2**32 - 1))


@st.composite
def extension_batches(draw):
    """R rows to extend from one capture: `(T, rows, order, seed)`, each row `(filled, tail,
    off, L)`: filled 0..20 with a held tail past it, its own capture offset (some past
    `filled`: misaligned), L committed tokens around the capture's end (some with nothing to
    write); `order` places the rows (and one other sequence) in a pool."""
    r = draw(st.integers(1, 6))
    t = draw(st.integers(1, 9))
    rows = []
    for _ in range(r):
        filled = draw(st.integers(0, 20))
        tail = draw(st.integers(0, 3))
        off = draw(st.integers(0, filled + draw(st.sampled_from([0, 0, 0, 2]))))
        rows.append((filled, tail, off, draw(st.integers(0, off + t + 2))))
    order = draw(st.permutations(list(range(r + 1))))
    return t, rows, order, draw(st.integers(0, 2**32 - 1))


@st.composite
def forward_cases(draw, names: tuple[str, ...]):
    """A target forward of the port: `(model name, lens, steps, seed)`: one of `names`, 1..6
    rows of own lengths 1..80 (`corner_lengths`), one or two consecutive steps of 1..9 tokens."""
    lens = draw(corner_lengths(1, 6, 80, boundaries=False))
    steps = draw(st.lists(st.integers(1, 9), min_size=1, max_size=2))
    return draw(st.sampled_from(sorted(names))), lens, steps, draw(st.integers(0, 2**32 - 1))
