"""Port conformance: the in-place KV layout against the reference's front-aligned caches
(gpu.cache / gpu.align vs reference.cache / reference.align / reference.step).

The port never front-aligns a cache; `materialize_front_aligned` builds, by one gather,
the tensors the reference holds after `front_align_batch` + `clone_in_cache` (or
`front_align_draft_group`), and those are compared. All of this is data movement:
bit-exact, in float64, float32 and bfloat16 (the data are drawn representable in the
dtype, so the float64 reference holds exactly the values the port moves). Only the live
columns `[0, T)` are compared: capacity slack is layout, not contract.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import raggedspec.gpu.align as port
from raggedspec.conformance.strategies import corner_lengths
from raggedspec.gpu.cache import RaggedKv
from raggedspec.gpu.testing import (
    FLOAT_DTYPES,
    assert_bit_exact,
    assert_same_refusal,
    host,
    outcome,
    representable,
    to_port,
)
from raggedspec.reference import align as ref
from raggedspec.reference.cache import DRAFT_CACHE_CAPACITY, KvCache, NormalCache, SingleCache
from raggedspec.reference.errors import AlignRefusal
from raggedspec.reference.step import (
    commit_per_sequence,
    plan_batch_step as ref_plan_batch_step,
    truncate_cache_by,
)

dtypes = pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=lambda d: str(d).split(".")[-1])
H, D = 1, 2


def rows_data(rng, lens, dtype, h=H, d=D):
    """Row i: K and V `[1, h, lens[i], d]` float64 values representable in `dtype`."""
    return [
        (
            representable(rng.normal(size=(1, h, n, d)), dtype),
            representable(rng.normal(size=(1, h, n, d)), dtype),
        )
        for n in lens
    ]


def ref_caches(data, max_seq_len, capacity=None):
    """One single-slot NormalCache per row, filled by one append."""
    out = []
    for k, v in data:
        kv = (
            KvCache.new_normal(max_seq_len)
            if capacity is None
            else KvCache.new_normal(max_seq_len, capacity)
        )
        kv.append(k, v)
        out.append(NormalCache([kv]))
    return out


def port_kv(data, max_seq_len, dtype, capacity=None):
    return RaggedKv.from_rows(
        [to_port(k[0], dtype) for k, _ in data],
        [to_port(v[0], dtype) for _, v in data],
        max_seq_len,
        capacity,
    )


def live(single: SingleCache) -> np.ndarray:
    return single.data[:, :, : single.physical]


@pytest.mark.rule(
    "front_align_batch + clone_in_cache, port layout",
    "SingleCache::append, port layout",
)
@dtypes
@given(lens=corner_lengths(1, 4, 80), t=st.integers(1, 9), seed=st.integers(0, 2**32 - 1),
       big=st.booleans())
def test_materialized_batch_and_append_match_the_reference(dtype, lens, t, seed, big):
    """`front_align_batch` + `clone_in_cache` (reference) == `materialize_front_aligned` of
    the in-place rows; then this step's append (reference: at the shared column T; port:
    at each row's own offset, one scatter) leaves them equal again, and growth above
    `max_seq_len` is refused by both (same message)."""
    rng = np.random.default_rng(seed)
    max_seq_len = 4096 if big else (1024 if max(lens) <= 1024 else 1536)
    data = rows_data(rng, lens, dtype)
    caches = ref_caches(data, max_seq_len)
    clone = ref.clone_in_cache(caches, [], False)
    batched = clone.batched.slots[0]
    kv = port_kv(data, max_seq_len, dtype)
    target, leads = port.front_align_leads(kv.lens)
    assert target == batched.current_seq_len
    assert host(leads).tolist() == (clone.lead_pad or [0] * len(lens))
    k, v = port.materialize_front_aligned(kv)
    assert k.dtype == dtype
    assert_bit_exact(k, live(batched.k), "front-aligned K")
    assert_bit_exact(v, live(batched.v), "front-aligned V")

    new_k = representable(rng.normal(size=(len(lens), H, t, D)), dtype)
    new_v = representable(rng.normal(size=(len(lens), H, t, D)), dtype)
    r = outcome(batched.append, new_k, new_v)
    p = outcome(kv.append, to_port(new_k, dtype), to_port(new_v, dtype))
    if assert_same_refusal(p, r, "append"):
        assert host(kv.lens).tolist() == [n + t for n in lens]
        k, v = port.materialize_front_aligned(kv)
        assert_bit_exact(k, live(batched.k), "K after append")
        assert_bit_exact(v, live(batched.v), "V after append")


@pytest.mark.rule("per-seq commit, port layout")
@given(
    lens=corner_lengths(1, 4, 60, boundaries=False),
    steps=st.integers(1, 3),
    depth=st.integers(1, 4),
    seed=st.integers(0, 2**32 - 1),
)
def test_per_sequence_steps_match_the_reference_cycle(lens, steps, depth, seed):
    """Several per-sequence steps. Reference: `clone_in_cache_reporting_lead` (front-align),
    append the window's w columns at T, `clone_out_cache`, then per row
    `commit_per_sequence` (strip the lead, `set_len(own + committed)`). Port: append at each
    row's own offset, `commit_per_sequence` (lengths only). Every row's live run is equal
    after every step, and so is the next step's front-aligned batch."""
    rng = np.random.default_rng(seed)
    w = depth + 1
    data = rows_data(rng, lens, torch.float64)
    caches = ref_caches(data, 4096)
    kv = port_kv(data, 4096, torch.float64)
    for _ in range(steps):
        own = [c.current_seq_len for c in caches]
        clone = ref.clone_in_cache_reporting_lead(caches, [], False, per_sequence=True)
        k_front, _ = port.materialize_front_aligned(kv)
        assert_bit_exact(k_front, live(clone.batched.slots[0].k), "front-aligned K at step start")
        new_k, new_v = rng.normal(size=(len(own), H, w, D)), rng.normal(size=(len(own), H, w, D))
        clone.batched.slots[0].append(new_k, new_v)
        kv.append(to_port(new_k), to_port(new_v))
        committed = [int(rng.integers(1, w + 1)) for _ in own]
        caches = ref.clone_out_cache(clone.batched, len(own))
        for c, lead, n, m in zip(caches, clone.lead_pad, own, committed, strict=False):
            commit_per_sequence(c, lead, n, m)
        kv.commit_per_sequence(torch.tensor(own), torch.tensor(committed))
        for i, c in enumerate(caches):
            k_row, v_row = kv.row(i)
            assert_bit_exact(k_row[None], live(c.slots[0].k), f"row {i} K")
            assert_bit_exact(v_row[None], live(c.slots[0].v), f"row {i} V")


@pytest.mark.rule("truncate_cache_by, port layout")
@given(lens=corner_lengths(1, 4, 60, boundaries=False), depth=st.integers(1, 8), data=st.data(),
       seed=st.integers(0, 2**32 - 1))
def test_cohort_rollback_matches_the_reference(lens, depth, data, seed):
    """Cohort step: append w, `truncate_cache_by(n_drop)` (reference, shared length) vs
    `truncate_by(plan.n_drop)` (port, a 0-dim tensor, per-row lengths): equal front-aligned
    tensors afterwards, ragged batches included, and drops longer than a short row's own run
    (the row empties in both)."""
    rng = np.random.default_rng(seed)
    w = depth + 1
    u = data.draw(st.lists(st.integers(1, w), min_size=len(lens), max_size=len(lens)))
    a = [data.draw(st.integers(0, w - x)) for x in u]
    rows = rows_data(rng, lens, torch.float64)
    batched = ref.clone_in_cache(ref_caches(rows, 4096), [], False).batched
    kv = port_kv(rows, 4096, torch.float64)
    new_k, new_v = rng.normal(size=(len(lens), H, w, D)), rng.normal(size=(len(lens), H, w, D))
    batched.slots[0].append(new_k, new_v)
    kv.append(to_port(new_k), to_port(new_v))
    n_drop = ref_plan_batch_step(u, a, w).n_drop
    if data.draw(st.booleans()):  # off the reachable domain: a drop past short rows' own runs
        n_drop = data.draw(st.integers(0, max(lens) + w + 2))
    truncate_cache_by(batched, n_drop)
    kv.truncate_by(torch.tensor(n_drop) if data.draw(st.booleans()) else n_drop)
    k, v = port.materialize_front_aligned(kv)
    assert_bit_exact(k, live(batched.slots[0].k), "K after rollback")
    assert_bit_exact(v, live(batched.slots[0].v), "V after rollback")


@st.composite
def draft_group(draw):
    """`(held, starts)`: G draft rows holding `held_i` entries and their chain starts
    (<= held, or one past it: refused), with a count mismatch as a corner."""
    held = draw(corner_lengths(1, 5, 40, boundaries=False))
    starts = [draw(st.integers(max(h - 9, 0), h)) for h in held]
    corner = draw(st.sampled_from(["ok", "ok", "ok", "past", "count"]))
    if corner == "past":
        i = draw(st.integers(0, len(held) - 1))
        starts[i] = held[i] + draw(st.integers(1, 3))
    elif corner == "count":
        starts = starts + [starts[0]] if draw(st.booleans()) else starts[:-1]
    return held, starts


@pytest.mark.rule(
    "front_align_draft_group, port layout",
    "split_draft_cache, concat_kv, port layout",
)
@dtypes
@given(group=draft_group(), n_draft=st.integers(1, 8), seed=st.integers(0, 2**32 - 1))
def test_draft_group_alignment_and_chain_write_back_match_the_reference(
    dtype, group, n_draft, seed
):
    """`front_align_draft_group` (reference: clone, set_len, front-pad, narrow to the group
    width) == the port's group (same buffers, lengths = starts) materialized; refused by
    both or neither (same message). Then the chain's n_draft one-token steps (reference:
    append at the group's end column, `split_draft_cache`, `drop_dead_prefix(lead)`; port:
    append at each row's own offset) leave every row's draft KV equal: `start_i + n_draft`
    entries, live run at column 0."""
    held, starts = group
    rng = np.random.default_rng(seed)
    data = rows_data(rng, held, dtype)
    caches = [c.slots[0] for c in ref_caches(data, 4096, DRAFT_CACHE_CAPACITY)]
    kv = port_kv(data, 4096, dtype)
    r = outcome(ref.front_align_draft_group, caches, starts)
    p = outcome(port.front_align_draft_group, kv, torch.tensor(starts))
    if not assert_same_refusal(p, r, "front_align_draft_group"):
        return
    batched, grp = r[1], p[1]
    k, v = port.materialize_front_aligned(grp)
    assert_bit_exact(k, batched.k.data, "group K")
    assert_bit_exact(v, batched.v.data, "group V")
    g = len(starts)
    for _ in range(n_draft):
        nk = representable(rng.normal(size=(g, H, 1, D)), dtype)
        nv = representable(rng.normal(size=(g, H, 1, D)), dtype)
        batched.append(nk, nv)
        grp.append(to_port(nk, dtype), to_port(nv, dtype))
    leads = [max(starts) - s for s in starts]
    pieces = ref.split_draft_cache(batched, g)
    for i, (piece, lead) in enumerate(zip(pieces, leads, strict=False)):
        ref.drop_dead_prefix(piece, lead)
        k_row, v_row = grp.row(i)
        assert k_row.shape[1] == starts[i] + n_draft
        assert_bit_exact(k_row[None], live(piece.k), f"draft row {i} K")
        assert_bit_exact(v_row[None], live(piece.v), f"draft row {i} V")


@pytest.mark.rule("drop_dead_prefix, port layout")
@dtypes
@given(data=st.data(), seed=st.integers(0, 2**32 - 1))
def test_strip_dead_prefix_matches_drop_front_single(dtype, data, seed):
    """A front-aligned batch back to the in-place layout (one gather) == the reference's
    `drop_front_single` of each row; a lead past the held length is refused by both."""
    rng = np.random.default_rng(seed)
    b = data.draw(st.integers(1, 4))
    width = data.draw(st.integers(1, 40))
    current = data.draw(st.integers(0, width))
    leads = data.draw(st.lists(st.integers(0, current + (2 if data.draw(st.booleans()) else 0)),
                               min_size=b, max_size=b))
    front_k = representable(rng.normal(size=(b, H, width, D)), dtype)
    front_v = representable(rng.normal(size=(b, H, width, D)), dtype)
    singles = [
        (
            SingleCache(4096, width, current, 0, None, front_k[i : i + 1].copy()),
            SingleCache(4096, width, current, 0, None, front_v[i : i + 1].copy()),
        )
        for i in range(b)
    ]

    def ref_strip():
        refusal = next(
            (
                ref._drop_front_refusal(sk, lead)
                for (sk, _), lead in zip(singles, leads, strict=False)
                if ref._drop_front_refusal(sk, lead) is not None
            ),
            None,
        )
        if refusal is not None:
            raise refusal
        for (sk, sv), lead in zip(singles, leads, strict=False):
            ref.drop_front_single(sk, lead)
            ref.drop_front_single(sv, lead)

    r = outcome(ref_strip)
    p = outcome(
        port.strip_dead_prefix,
        to_port(front_k, dtype),
        to_port(front_v, dtype),
        torch.tensor(leads),
        current,
        4096,
    )
    if assert_same_refusal(p, r, "strip_dead_prefix"):
        kv = p[1]
        for i, (sk, sv) in enumerate(singles):
            k_row, v_row = kv.row(i)
            assert_bit_exact(k_row[None], live(sk), f"row {i} K")
            assert_bit_exact(v_row[None], live(sv), f"row {i} V")


@pytest.mark.rule("front_align_draft_group, port layout")
def test_draft_group_worked_example_on_the_port():
    """§9.7: three rows, each live 9 (capacity 32) marked 100/200/300, starts [7, 4, 6]:
    width 7, K rows [100..106], [0,0,0,200..203], [0,300..305] (the spec's numbers)."""
    ks = [torch.arange(9, dtype=torch.float64).reshape(1, 9, 1) + m for m in (100, 200, 300)]
    kv = RaggedKv.from_rows(ks, [k + 1000 for k in ks], 4096, capacity=32)
    k, _ = port.materialize_front_aligned(port.front_align_draft_group(kv, [7, 4, 6]))
    assert k[:, 0, :, 0].tolist() == [[100, 101, 102, 103, 104, 105, 106],
                                      [0, 0, 0, 200, 201, 202, 203],
                                      [0, 300, 301, 302, 303, 304, 305]]
    assert kv.lens.tolist() == [9, 9, 9]  # the rows themselves are untouched


# --- boundaries, malformed input and the row-set helpers, stated from the inputs ----------


def marked(b, width):
    """`[b, 1, width, 1]` float64 with row i, column c = 100 * (i + 1) + c: no zero anywhere,
    so a zero in a result is a column nothing was read into."""
    vals = (torch.arange(b, dtype=torch.float64)[:, None] + 1) * 100 + torch.arange(width)
    return vals[:, None, :, None].clone()


@pytest.mark.rule("front_align_batch + clone_in_cache, port layout")
def test_front_align_leads_at_zero_and_empty():
    """A zero-length row is legal (its lead is the whole target); an empty batch has target 0."""
    target, leads = port.front_align_leads([0, 3])
    assert (target, leads.tolist(), leads.dtype) == (3, [3, 0], torch.int64)
    assert port.front_align_leads(torch.tensor([0]))[0] == 0
    target, leads = port.front_align_leads([])
    assert (target, leads.tolist()) == (0, [])


@pytest.mark.rule("front_align_batch + clone_in_cache, port layout")
def test_materialize_pads_to_an_explicit_target_and_handles_no_rows():
    """Rows [100, 101] and [200] (capacity 4) front-aligned to 3 columns: [0, 100, 101] and
    [0, 0, 200]; with no rows the batch is 0 columns wide."""
    kv = RaggedKv(marked(2, 4), marked(2, 4) + 0.5, [2, 1], 4096)
    k, v = port.materialize_front_aligned(kv, target=3)
    assert k[:, 0, :, 0].tolist() == [[0, 100, 101], [0, 0, 200]]
    assert v[:, 0, :, 0].tolist() == [[0, 100.5, 101.5], [0, 0, 200.5]]
    empty = RaggedKv.empty(0, 1, 1, 4096, 4)
    k, v = port.materialize_front_aligned(empty)
    assert list(k.shape) == [0, 1, 0, 1] and list(v.shape) == [0, 1, 0, 1]


@pytest.mark.rule("drop_dead_prefix, port layout")
def test_strip_dead_prefix_shifts_each_row_and_zero_fills_the_kept_width():
    """Width 4, current 4, leads [1, 0]: row 0 keeps columns [1, 4) then one zero column
    (nothing lies past the buffer), row 1 is unchanged; lens [3, 4]; max_seq_len carried."""
    kv = port.strip_dead_prefix(marked(2, 4), marked(2, 4) + 0.5, [1, 0], 4, 777)
    assert kv.k[:, 0, :, 0].tolist() == [[101, 102, 103, 0], [200, 201, 202, 203]]
    assert kv.v[:, 0, :, 0].tolist() == [[101.5, 102.5, 103.5, 0], [200.5, 201.5, 202.5, 203.5]]
    assert kv.lens.tolist() == [3, 4] and kv.max_seq_len == 777


@pytest.mark.rule("front_align_draft_group, port layout")
def test_front_align_draft_group_keeps_the_buffers_and_max_seq_len():
    kv = RaggedKv(marked(2, 4), marked(2, 4), [3, 4], 777)
    grp = port.front_align_draft_group(kv, [0, 2])
    assert grp.k is kv.k and grp.v is kv.v
    assert grp.lens.tolist() == [0, 2] and grp.max_seq_len == 777


@pytest.mark.rule("split_draft_cache, concat_kv, port layout")
def test_split_draft_cache_and_concat_kv_keep_each_rows_length():
    """Four rows split in 2 are rows {0, 1} and {2, 3} with their own lengths; two rows cannot
    make 3 pieces (None); concatenating a capacity-2 and a capacity-4 set zero-pads the first."""
    kv = RaggedKv(marked(4, 4), marked(4, 4), [1, 2, 3, 4], 777)
    a, b = port.split_draft_cache(kv, 2)
    assert (a.lens.tolist(), b.lens.tolist()) == ([1, 2], [3, 4])
    assert a.k[:, 0, 0, 0].tolist() == [100, 200] and b.k[:, 0, 0, 0].tolist() == [300, 400]
    assert a.max_seq_len == b.max_seq_len == 777
    assert port.split_draft_cache(RaggedKv(marked(2, 4), marked(2, 4), [1, 2], 777), 3) is None
    narrow = RaggedKv(marked(1, 2), marked(1, 2), [2], 555)
    both = port.concat_kv([narrow, RaggedKv(marked(1, 4), marked(1, 4), [3], 777)])
    assert both.k[:, 0, :, 0].tolist() == [[100, 101, 0, 0], [100, 101, 102, 103]]
    assert both.lens.tolist() == [2, 3] and both.max_seq_len == 555


def _kv2():
    return RaggedKv(marked(2, 4), marked(2, 4), [3, 1], 4096)


def _strip(leads, current=4, k=None, v=None):
    k = marked(2, 4) if k is None else k
    return port.strip_dead_prefix(k, marked(2, 4) if v is None else v, leads, current, 9)


def _t(xs):
    return torch.tensor(xs)


# (case id, call, exact message): each case breaks exactly one condition
MALFORMED = [
    ("leads negative", lambda: port.front_align_leads([-1, 2]), "lens [-1, 2] must be >= 0"),
    ("leads 2-D", lambda: port.front_align_leads(_t([[1, 2], [3, 4]])),
     "lens must be a 1-D vector, got shape [2, 2]"),
    ("target short", lambda: port.materialize_front_aligned(_kv2(), target=2),
     "target 2 is shorter than the longest row 3"),
    ("group start negative", lambda: port.front_align_draft_group(_kv2(), [-1, 1]),
     "chain starts [-1, 1] must be >= 0"),
    ("group starts 2-D", lambda: port.front_align_draft_group(_kv2(), _t([[1], [1]])),
     "starts must be a 1-D vector, got shape [2, 1]"),
    ("strip v 3-D", lambda: _strip([0, 0], v=marked(2, 4)[:, 0]),
     "k [2, 1, 4, 1] and v [2, 4, 1] must be [B,H,W,*]"),
    ("strip k 3-D", lambda: _strip([0, 0], k=marked(2, 4)[:, 0]),
     "k [2, 4, 1] and v [2, 1, 4, 1] must be [B,H,W,*]"),
    ("strip widths", lambda: _strip([0, 0], 3, v=marked(2, 3)),
     "k [2, 1, 4, 1] and v [2, 1, 3, 1] must be [B,H,W,*]"),
    ("strip leads 2-D", lambda: _strip(_t([[0], [0]])),
     "leads must be a 1-D vector, got shape [2, 1]"),
    ("strip leads count", lambda: _strip([0, 0, 0]), "3 leads for a batch of 2"),
    ("strip lead negative", lambda: _strip([-1, 0]), "dead-prefix leads [-1, 0] must be >= 0"),
    ("strip current high", lambda: _strip([0, 0], 5), "current 5 must lie in [0, width 4]"),
    ("strip current negative", lambda: _strip([0, 0], -1), "current -1 must lie in [0, width 4]"),
]


@pytest.mark.rule(
    "front_align_batch + clone_in_cache, port layout",
    "drop_dead_prefix, port layout",
    "front_align_draft_group, port layout",
)
@pytest.mark.parametrize("call, message", [c[1:] for c in MALFORMED], ids=[c[0] for c in MALFORMED])
def test_each_malformed_alignment_input_is_a_value_error_with_its_message(call, message):
    with pytest.raises(ValueError) as err:
        call()
    assert str(err.value) == message


@pytest.mark.rule("front_align_draft_group, port layout")
def test_an_empty_draft_group_is_refused_by_name():
    empty = RaggedKv.empty(0, 1, 1, 4096, 4)
    with pytest.raises(AlignRefusal) as err:
        port.front_align_draft_group(empty, [])
    assert str(err.value) == "front_align_draft_group was given no rows (0 caches, 0 chain starts)"
