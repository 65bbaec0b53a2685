"""The generated cases of `raggedspec check-model` and their plan: which tokens each row feeds
at each step, where every cache column's key sits in its row, and what the model must use.

A `Case` is a few speculative-decoding steps over a left-padded batch: per-row prompt lengths
(the prefill is each prompt but its last token, front-aligned, so rows start with dead
prefixes), a draft depth `d` (verify width `w = d + 1`), per step and row an accept count, a
sliding window (none, shorter or longer than the widest dead prefix), the KV head count and
one of four ways of handling rejected drafts (`FAMILIES`). `plan_steps` turns a case into the
steps an engine runs, with no model: the tokens each row feeds, the column -> position map of
the batched cache after each step's rollback, the positions the queries must have (the
reference's `ragged_row_q0`), and each row's committed tokens, so the row can be run alone.
The accept counts go through the reference's `plan_batch_step` (cohort) and
`plan_per_sequence_step` (per row); the key set of a query is the reference's `raw_validity`
over the row's own positions (`expected_keep`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from hypothesis import strategies as st

from raggedspec.reference.dispatch import ragged_row_q0
from raggedspec.reference.masks import raw_validity
from raggedspec.reference.step import plan_batch_step, plan_per_sequence_step

FAMILIES = {
    "crop": "the batch cache cropped by w - min(committed), the rows ahead re-feed what it "
            "dropped (the cohort rule, cache-and-draft §12.1)",
    "mask": "rejected drafts left in the cache and masked out in place (attention mask 0), "
            "positions continue per row (§12.2 without a batched rollback)",
    "refeed": "the draft columns cropped after every verify, accepted drafts re-fed with the "
              "next step, shorter rows padded inside the step (pad queries mid-sequence)",
    "shift": "each row rolled back by its own rejected count and the rows front-aligned "
             "again (§12.2 strip, then §4.5 front alignment)",
}
"""Rollback family -> what the engine does with the rejected drafts."""
PAD = 0
"""The token fed in padding slots."""


@dataclass(frozen=True)
class Case:
    """One generated run before its tokens are drawn from `seed`: `accepted[s][i]` is row i's
    accept count at verify step s (clamped to the row's draft slots)."""

    prompts: tuple[int, ...]
    depth: int
    accepted: tuple[tuple[int, ...], ...]
    family: str
    window: int | None
    kv_heads: int
    seed: int

    def describe(self) -> str:
        return (f"prompts {list(self.prompts)}, depth {self.depth} (w {self.depth + 1}), "
                f"accepted per step {[list(a) for a in self.accepted]}, family {self.family}, "
                f"window {self.window}, KV heads {self.kv_heads}, seed {self.seed}")


@dataclass
class Step:
    """One forward of the batch: `ids [B, t]` (PAD in padding slots); `cols[i]` the position
    of every cache column of row i during the forward (None: dead prefix, padding or a
    masked rejected draft); `slot_pos[i]` the position of each of its t query slots (None:
    padding). After the forward the rollback: `crop` columns off the end of every row, or
    per-row `drop` counts with front re-alignment; `cols_after` is the layout it leaves."""

    kind: str
    ids: np.ndarray
    cols: list[list[int | None]]
    slot_pos: list[list[int | None]]
    crop: int = 0
    drop: list[int] | None = None
    cols_after: list[list[int | None]] = field(default_factory=list)

    @property
    def width(self) -> int:
        return self.ids.shape[1]

    def attention_mask(self) -> np.ndarray:
        """`int64 [B, columns]`: 1 on a column holding a key of the row, else 0."""
        return np.array([[p is not None for p in row] for row in self.cols], dtype=np.int64)

    def position_ids(self) -> np.ndarray:
        """`int64 [B, t]`: each live slot's position (the reference's row q0 plus its index),
        0 in padding slots."""
        return np.array([[0 if p is None else p for p in row] for row in self.slot_pos],
                        dtype=np.int64)


@dataclass
class Plan:
    """The steps of a case and, per step, each row's whole token sequence up to the end of
    that step's feed (what the row run alone consumes)."""

    steps: list[Step]
    solo_tokens: list[list[list[int]]]


# ----------------------------------------------------------------------------- strategy


@st.composite
def cases(draw, families: tuple[str, ...] = tuple(FAMILIES), windows: str = "any",
          kv_heads: tuple[int, ...] = (1, 2, 4), min_window: int = 1) -> Case:
    """1-4 rows with prompts of 1-12 tokens, depth 1-3, 1-3 verify steps with accept counts
    0..depth per row, a family from `families`, a window by `windows` ("none", "some",
    "any"): when drawn, at least `min_window` and shorter than or equal to the widest dead
    prefix, or longer; and the KV head count from `kv_heads` (of 4 query heads)."""
    depth = draw(st.integers(1, 3))
    steps = draw(st.integers(1, 3))
    per_step = st.lists(st.integers(0, depth), min_size=steps, max_size=steps)
    rows = draw(st.lists(st.tuples(st.integers(1, 12), per_step), min_size=1, max_size=4))
    prompts = tuple(p for p, _ in rows)
    accepted = tuple(tuple(acc[s] for _, acc in rows) for s in range(steps))
    family = draw(st.sampled_from(families))
    lead = max(prompts) - min(prompts)
    windowed = windows == "some" or (windows == "any" and draw(st.booleans()))
    window = None
    if windowed:
        short = st.integers(min_window, max(min_window, lead))
        longer = st.integers(max(min_window, lead + 1), max(min_window, lead + 1) + 2 * depth + 6)
        window = draw(st.one_of(short, longer))
    heads = draw(st.sampled_from(kv_heads))
    seed = draw(st.integers(0, 2**16 - 1))
    return Case(prompts, depth, accepted, family, window, heads, seed)


def first_case(family: str, windows: str, kv_heads: tuple[int, ...], min_window: int) -> Case:
    """The case every run tries first: three rows of prompts 5, 2 and 3 (leads 0, 3, 2),
    depth 2, three steps whose accepts differ per row, a window of 3 (at least
    `min_window`) unless `windows` is "none", the middle KV head count."""
    window = None if windows == "none" else max(3, min_window)
    return Case((5, 2, 3), 2, ((2, 0, 1), (0, 2, 1), (1, 1, 0)), family, window,
                kv_heads[len(kv_heads) // 2], 7)


# ----------------------------------------------------------------------------- plan


def _tokens(rng: np.random.Generator, n: int, vocab: int) -> list[int]:
    """`n` token ids, none of them PAD."""
    return [int(x) for x in rng.integers(PAD + 1, vocab, size=n)]


def prefill_step(prompts: list[list[int]]) -> Step | None:
    """Every prompt but its last token, front-aligned (row i's lead is the widest prefill
    minus its own); None when every prompt is one token (nothing to prefill)."""
    width = max(len(p) for p in prompts) - 1
    if width == 0:
        return None
    cols, ids = [], np.full((len(prompts), width), PAD, dtype=np.int64)
    for i, p in enumerate(prompts):
        lead = width - (len(p) - 1)
        cols.append([None] * lead + list(range(len(p) - 1)))
        ids[i, lead:] = p[:-1]
    return Step("prefill", ids, cols, [list(c) for c in cols], cols_after=[list(c) for c in cols])


def _feed(family: str, uncached: list[int], depth: int) -> list[int]:
    """Tokens each row feeds at a verify step: w for crop / mask / shift (crop: its uncached
    then drafts up to w), its uncached plus `depth` drafts for refeed."""
    if family == "crop":
        return [depth + 1] * len(uncached)
    return [u + depth for u in uncached]


def verify_step(family: str, cols: list[list[int | None]], lengths: list[int],
                uncached: list[int], depth: int, toks: list[list[int]],
                drafts: list[list[int]]) -> Step:
    """The verify forward: row i feeds `toks[i][L_i : L_i + u_i]` then its drafts, at
    positions `q0_i + j` with `q0_i` the reference's `ragged_row_q0` (the row's own cached
    length), left-padded to the widest feed (only refeed pads)."""
    n_fed = _feed(family, uncached, depth)
    width = max(n_fed)
    q0 = ragged_row_q0(lengths, per_seq_kv=True)
    ids = np.full((len(cols), width), PAD, dtype=np.int64)
    new_cols, slot_pos = [], []
    for i, (n, start) in enumerate(zip(n_fed, q0, strict=True)):
        fed = toks[i][lengths[i]: lengths[i] + uncached[i]] + drafts[i]
        pos = [None] * (width - n) + [start + j for j in range(n)]
        ids[i, width - n:] = fed[:n]
        slot_pos.append(pos)
        new_cols.append(cols[i] + pos)
    return Step("verify", ids, new_cols, slot_pos)


def realign(cols: list[list[int | None]], drop: list[int]) -> list[list[int | None]]:
    """Each row's live positions after dropping its last `drop[i]` keys, front-aligned to the
    longest (cache-and-draft §4.5: lead = T - live, dead columns in front)."""
    live = [[p for p in row if p is not None] for row in cols]
    kept = [row[: len(row) - k] for row, k in zip(live, drop, strict=True)]
    width = max(len(r) for r in kept)
    return [[None] * (width - len(r)) + r for r in kept]


def rollback(step: Step, family: str, uncached: list[int], accepted: list[int],
             depth: int) -> tuple[list[int], list[int]]:
    """Set the step's rollback and `cols_after` for `family`; return `(committed into the
    cache per row, next step's uncached per row)` by the reference's step plans."""
    w = depth + 1
    if family == "crop":
        plan = plan_batch_step(uncached, accepted, w)
        step.crop = plan.n_drop
        step.cols_after = [row[: len(row) - plan.n_drop] for row in step.cols]
        return [plan.keep] * len(uncached), plan.next_uncached
    if family == "refeed":
        step.crop = depth
        step.cols_after = [row[: len(row) - depth] for row in step.cols]
        return list(uncached), [a + 1 for a in accepted]
    plan = plan_per_sequence_step(uncached, accepted, w)
    if family == "mask":
        step.cols_after = [row[: len(row) - k] + [None] * k
                           for row, k in zip(step.cols, plan.dropped, strict=True)]
    else:
        step.drop = list(plan.dropped)
        step.cols_after = realign(step.cols, plan.dropped)
    return plan.committed, plan.next_uncached


def plan_steps(case: Case, vocab: int) -> Plan:
    """The case's forwards in order (prefill, then one verify per accept row), with each
    row's whole token sequence up to the end of each forward's feed. Per row the committed
    tokens always number its cached length plus its uncached count; after a verify a row
    commits its accepted drafts and one sampled token."""
    rng = np.random.default_rng(case.seed)
    toks = [_tokens(rng, n, vocab) for n in case.prompts]
    steps, solo = [], []
    first = prefill_step(toks)
    if first is not None:
        steps.append(first)
        solo.append([t[:-1] for t in toks])
    cols = first.cols_after if first is not None else [[] for _ in toks]
    lengths = [n - 1 for n in case.prompts]
    uncached = [1] * len(toks)
    for accepted in case.accepted:
        n_fed = _feed(case.family, uncached, case.depth)
        drafts = [_tokens(rng, n - u, vocab) for n, u in zip(n_fed, uncached, strict=True)]
        step = verify_step(case.family, cols, lengths, uncached, case.depth, toks, drafts)
        solo.append([t + d for t, d in zip(toks, drafts, strict=True)])
        acc = [min(a, len(d)) for a, d in zip(accepted, drafts, strict=True)]
        committed, next_uncached = rollback(step, case.family, uncached, acc, case.depth)
        toks = [t + d[:a] + _tokens(rng, 1, vocab) for t, d, a in zip(toks, drafts, acc,
                                                                     strict=True)]
        lengths = [ln + c for ln, c in zip(lengths, committed, strict=True)]
        uncached, cols = next_uncached, step.cols_after
        steps.append(step)
    return Plan(steps, solo)


# ----------------------------------------------------------------------------- the rules


def expected_keep(cols: list[int | None], positions: list[int | None],
                  window: int | None) -> np.ndarray:
    """`bool [t, columns]`: the keys each query slot of a row must see. A live slot at
    position `qp` sees column c iff c holds a key of the row at `kp` with the reference's
    `raw_validity` (kp <= qp and kp > qp - window, positions of the row run alone); dead,
    padding and masked columns never. Padding slots see nothing."""
    live = [p for p in cols if p is not None]
    out = np.zeros((len(positions), len(cols)), dtype=bool)
    if not live:
        return out
    span = max(max(live), max((p for p in positions if p is not None), default=0)) + 1
    for j, qp in enumerate(positions):
        if qp is None:
            continue
        valid = raw_validity(1, qp, 0, span, window if window is not None else span)[0]
        out[j] = [p is not None and bool(valid[p]) for p in cols]
    return out


def leads(cols: list[list[int | None]]) -> list[int]:
    """Each row's dead prefix: the columns before its first key."""
    return [next((c for c, p in enumerate(row) if p is not None), len(row)) for row in cols]
