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
- `simulator_scenarios(max_batch, max_steps, strips)`: scenario tables over the simulator's
  whole space (advance rules, worlds, strip policies, admission, arrivals, LRU sizes,
  acceptance models, a capacity that refuses steps).
- `e2e_scenarios(heads)`: the end-to-end runs' small scenarios, their model's head layout
  drawn from `heads`.
- `running_sets(min_size, max_size)`: the scheduler's sequence records.
- `drafting_rows(max_rows, max_w, max_len)`: one step's `(u, cache_lens, may_draft, w)`.
"""

from __future__ import annotations

from hypothesis import strategies as st

from raggedspec.conformance.helpers import e2e_scenario
from raggedspec.reference.cache import CACHE_GROW_SIZE, DRAFT_CACHE_CAPACITY
from raggedspec.reference.scheduler import SeqRecord


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


# --- the step simulator's scenarios ----------------------------------------------------------

ACCEPTANCES = ("geometric:0.7", "profile:0.9,0.5,0.3", "all-accept", "all-reject",
               "heterogeneous:0.1,0.95")
"""One acceptance model of each kind that draws no file and no factory."""


def _range_pair(lo: int, hi: int, spread: int) -> st.SearchStrategy[list[int]]:
    """An inclusive `[low, high]` range: low in `[lo, hi]`, high up to `spread` above it."""
    return st.tuples(st.integers(lo, hi), st.integers(0, spread)).map(
        lambda t: [t[0], t[0] + t[1]])


def simulator_scenarios(max_batch: int = 6, max_steps: int = 16,
                        strips=("eager", "lazy", "none")) -> st.SearchStrategy[dict]:
    """Scenario tables over the simulator's whole space: batch 1..max_batch, prompts of 1..16
    tokens, every advance rule, world, strip policy (of `strips`), admission, arrival, LRU
    size, acceptance model and a capacity (`max_seq_len` 40) that refuses steps."""
    return st.fixed_dictionaries({
        "batch": st.integers(1, max_batch),
        "prompt_len": _range_pair(1, 10, 6),
        "max_new_tokens": _range_pair(1, 20, 15),
        "steps": st.integers(3, max_steps),
        "depth": st.integers(0, 4),
        "advance": st.sampled_from(["cohort", "per-sequence"]),
        "world": st.sampled_from(["W0", "WA", "WB"]),
        "strip": st.sampled_from(list(strips)),
        "admission": st.sampled_from(["grant", "grant", "refuse"]),
        "xs_per_seq": st.sampled_from([True, True, False]),
        "arrival": st.sampled_from(["all-at-once", "staggered"]),
        "max_draft_kv_seqs": st.sampled_from([None, 2, 64]),
        "acceptance": st.sampled_from(ACCEPTANCES),
        "max_seq_len": st.sampled_from([4096, 40]),
        "max_seqs": st.sampled_from([None, None, 2, 3]),
        "prefill_max_seqs": st.sampled_from([None, None, 1, 2]),
        "seed": st.integers(0, 50),
    })


@st.composite
def running_sets(draw, min_size: int = 1, max_size: int = 12):
    """Scheduler records with ids 0.. in order: 1..40 tokens, a cache length or none (0..40),
    prompt or completion, token offset 0..2, images or not."""
    raw = draw(st.lists(st.tuples(st.integers(1, 40), st.one_of(st.none(), st.integers(0, 40)),
                                  st.booleans(), st.integers(0, 2), st.booleans()),
                        min_size=min_size, max_size=max_size))
    return [SeqRecord(i, n, cache, pr, off, img) for i, (n, cache, pr, off, img) in enumerate(raw)]


def e2e_scenarios(heads: st.SearchStrategy[tuple[int, int]]) -> st.SearchStrategy[dict]:
    """End-to-end scenario tables (`helpers.e2e_scenario`): B 1..4, depth 0..3, 3..9 steps;
    cohort and granted per-sequence advance, refused per-sequence (latched cohort), the WA
    world's ragged batches under cohort, the three strip policies, staggered arrivals, an LRU
    of 1-2 draft states, Tier A (no MTP block), compressed layers of ratio 4 and 128,
    `max_seq_len` 40 and 24 (capacity refusals, poisoned draft KVs, failed steps); the model's
    `(n_heads, n_kv_heads)` drawn from `heads`."""
    return st.builds(
        e2e_scenario,
        flavour=st.sampled_from(["per-sequence granted", "cohort", "per-sequence granted",
                                 "WA ragged cohort", "per-sequence granted",
                                 "per-sequence refused"]),
        batch=st.sampled_from([3, 2, 4, 1, 2, 3]),
        plen=st.integers(1, 9),
        extra_len=st.sampled_from([0, 0, 1, 2, 3, 6]),
        new=st.integers(4, 30),
        steps=st.integers(3, 9),
        depth=st.sampled_from([3, 2, 1, 0, 3, 2]),
        strip=st.sampled_from(["eager", "lazy", "none"]),
        arrival=st.sampled_from(["all-at-once", "all-at-once", "staggered"]),
        lru=st.sampled_from([None, 1, 2]),
        acceptance=st.sampled_from(["geometric:0.7", "all-accept", "all-reject",
                                    "profile:0.9,0.5,0.3", "heterogeneous:0.1,0.95"]),
        max_seq_len=st.sampled_from([4096, 4096, 4096, 40, 24]),
        ratios=st.sampled_from([[0, 4], [0, 4], [4], [0, 128], [4, 0, 4]]),
        seed=st.integers(0, 30),
        mtp=st.sampled_from(["block", "block", "block", "heads"]),
        heads=heads,
    )


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


# --- dispatch, step arithmetic (test_dispatch.py, test_step*.py) ----------------------------


@st.composite
def drafting_rows(draw, max_rows: int = 64, max_w: int = 9, max_len: int = 60):
    """`(u, cache_lens, may_draft, w)` of one step's rows: `w` in `1..max_w`, `u_i` in
    `[1, w]` (u = w: no draft slot), lengths in `[1, max_len]`, about four rows in five allowed
    to draft. Wide batches are drawn from one seeded `random.Random`, so B = 256 stays cheap."""
    import random

    w = draw(st.integers(1, max_w))
    b = draw(st.integers(1, max_rows))
    rng = random.Random(draw(st.integers(0, 2**32)))
    u = [rng.randint(1, w) for _ in range(b)]
    lens = [rng.randint(1, max_len) for _ in range(b)]
    may = [rng.random() < 0.8 for _ in range(b)]
    return u, lens, may, w
