"""Port conformance: the MTP draft chain and the draft KV's tensor side (gpu.draft vs
reference.draft; cache-and-draft.md §7.2, §9.3, §9.7, §9.8, §10.2, §17.2).

The port keeps every sequence's draft KV in one pool (`RaggedKv`, a row per sequence, own
lengths) and addresses a draft group by row indices; the reference batches the group by
front-aligning copies, then splits and strips them. What is compared:

- token ids (chains, the argmax of every step): equal;
- each step's pre-norm hidden (`trace`): `assert_close64`, 1e-12 relative (float64; same
  ops, different summation order, ~1e-15 observed);
- the draft KV after the chain: the port's pool rows against the reference's row caches
  after `split_draft_cache` + `drop_dead_prefix`: held lengths exact (`start + n`);
  positions `[0, start)` (the history, moved input) bit-exact; positions `[start,
  start + n)` (computed by each side) within 1e-12; V == K; every pool row outside the
  group untouched (bit-exact, lengths exact);
- the write-back: `filled = start + 1` and held `start + n` equal the reference group
  loop's;
- `extend_draft_kv_rows` (a batch of rows whose `(lo, hi)` differ, one call) against
  `extend_draft_kv_row` run row by row: filled, seed position and seed vector (moved:
  bit-exact) equal; the draft KV as above (history bit-exact, written pairs 1e-12).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import raggedspec.gpu.draft as port
import raggedspec.gpu.model as port_model_mod
from raggedspec.gpu.cache import RaggedKv
from raggedspec.gpu.rope import reset_rope_path_stats, rope_path_stats
from raggedspec.gpu.testing import (
    DEVICE,
    assert_bit_exact,
    assert_close64,
    assert_same_refusal,
    host,
    outcome,
    to_port,
)
from raggedspec.reference import draft as ref
from raggedspec.reference.align import drop_dead_prefix, front_align_draft_group, split_draft_cache
from raggedspec.reference.cache import KvCache
from raggedspec.reference.dispatch import CaptureOffsets
from raggedspec.reference.errors import CacheRefusal, DispatchRefusal, StepRefusal
from raggedspec.reference.model import ModelConfig, TinyModel

MODEL = TinyModel()
TIER_A = TinyModel(ModelConfig(mtp="heads"))
PORT = port_model_mod.TinyModel(MODEL, torch.float64, DEVICE)
PORT_A = port_model_mod.TinyModel(TIER_A, torch.float64, DEVICE)
H, V, HD = MODEL.cfg.hidden, MODEL.cfg.vocab, MODEL.cfg.head_dim


def ref_draft_cache(k: np.ndarray) -> KvCache:
    """A reference draft cache (capacity 16, growing by 512) holding `k [n, hd]` as K and V."""
    cache = MODEL.mtp.new_draft_cache()
    if len(k):
        cache.append(k[None, None], k[None, None].copy())
    return cache


def pool_of(ks: list[np.ndarray]) -> RaggedKv:
    """The port pool: row s holds `ks[s]` at columns [0, n_s) (capacity 16 + 512 blocks)."""
    cap = (
        16
        if max(len(k) for k in ks) <= 16
        else 16 + 512 * (-(-(max(len(k) for k in ks) - 16) // 512))
    )
    return RaggedKv.from_rows(
        [to_port(k[None]) for k in ks], [to_port(k[None]) for k in ks], 4096, cap
    )


def align_rows(pool: RaggedKv, rows, starts) -> None:
    """The group alignment the backend's loop does on the pool: the rows' lengths become their
    chain starts (host integers; the data stays put)."""
    held = pool.host_lens().copy()
    held[np.asarray(rows, dtype=np.int64)] = starts
    pool.lens = held


def held_k(cache: KvCache) -> np.ndarray:
    """The held K `[n, hd]` (an unmaterialized cache holds none)."""
    data = cache.k.current_data()
    return np.zeros((0, HD)) if data is None else data[0, 0]


@st.composite
def chain_group(draw):
    """A draft group of G rows (chain starts, speculative tails past them), chain length
    1..8 (depth up to 8), placed at shuffled rows of a pool with 0..3 other sequences."""
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


@pytest.mark.rule("propose_chain_batched, port", "uniform draft group takes the scalar chain, port")
@given(case=chain_group())
def test_the_chain_on_pool_rows_matches_the_reference_group(case):
    """Reference: `front_align_draft_group`, `propose_chain_batched`, `split_draft_cache`,
    `drop_dead_prefix`. Port: the rows' lengths set to their starts (the backend's group alignment)
    + `propose_chain_batched` on the pool rows.
    Same tokens, same hidden per step (1e-12), same draft caches (history bit-exact, the n
    new entries 1e-12), the other pool rows untouched; the branch taken is the scalar one
    iff the starts are uniform (`draft_chain_stats`)."""
    starts, tails, others, order, n, seed = case
    g = len(starts)
    rng = np.random.default_rng(seed)
    group_k = [rng.standard_normal((s + t, HD)) for s, t in zip(starts, tails, strict=False)]
    other_k = [rng.standard_normal((m, HD)) for m in others]
    seeds, lasts = rng.standard_normal((g, H)), rng.integers(0, V, g)

    caches = [ref_draft_cache(k) for k in group_k]
    batched = front_align_draft_group(caches, starts)
    ref_trace: list = []
    chains = ref.propose_chain_batched(MODEL, seeds, lasts, n, starts, batched, ref_trace)
    pieces = split_draft_cache(batched, g)
    for piece, s in zip(pieces, starts, strict=False):
        drop_dead_prefix(piece, max(starts) - s)

    slots = [None] * len(order)
    for j, k in enumerate(group_k + other_k):
        slots[order[j]] = k
    rows = torch.tensor(order[:g])
    pool = pool_of(slots)
    before = pool.clone()
    align_rows(pool, rows, starts)
    port.reset_draft_chain_stats()
    port_trace: list = []
    got = port.propose_chain_batched(
        PORT,
        to_port(seeds),
        torch.from_numpy(lasts),
        n,
        torch.tensor(starts),
        pool,
        port_trace,
        rows,
    )

    assert host(got).tolist() == chains
    ragged = len(set(starts)) > 1
    assert port.draft_chain_stats == {"scalar": 0 if ragged else n, "per_row": n if ragged else 0}
    for step in range(n):
        assert_close64(port_trace[step], ref_trace[step], what=f"step {step} hidden")
    for r, (s, piece) in enumerate(zip(starts, pieces, strict=False)):
        slot = int(rows[r])
        k_row, v_row = pool.row(slot)
        assert k_row.shape[1] == s + n == piece.current_seq_len
        assert_bit_exact(v_row, k_row, "V == K")
        assert_bit_exact(k_row[0, :s], held_k(piece)[:s], f"row {r}: history")
        assert_close64(k_row[0, s:], held_k(piece)[s:], what=f"row {r}: drafted entries")
    for j in range(g, len(order)):
        slot = order[j]
        assert int(pool.lens[slot]) == others[j - g]
        m = others[j - g]
        assert_bit_exact(pool.k[slot, :, :m], before.k[slot, :, :m], "another sequence's draft KV")


@pytest.mark.rule("uniform draft group takes the scalar chain, port")
def test_a_uniform_group_takes_the_scalar_step_and_a_ragged_group_per_row_positions(monkeypatch):
    """The branch itself, as the reference's test observes it (spies on the block's two
    steps, the chain counter, RoPE's table shape): starts [7, 7, 7] -> `forward_step` at
    7, 8, 9 and no gathered RoPE table; [7, 4, 6] -> `forward_step_rows` at [7,4,6], [8,5,7],
    [9,6,8], and every row holds its own start + 3 afterwards (the reference: the batched
    cache is 10 wide)."""
    calls: dict[str, list] = {"scalar": [], "rows": []}
    cls = port_model_mod.MtpBlock
    orig_step, orig_rows = cls.forward_step, cls.forward_step_rows
    monkeypatch.setattr(cls, "forward_step", lambda self, f, pos, c, rows=None: (
        calls["scalar"].append(int(pos)), orig_step(self, f, pos, c, rows))[1])
    monkeypatch.setattr(cls, "forward_step_rows", lambda self, f, pos, c, rows=None: (
        calls["rows"].append(host(pos).tolist()), orig_rows(self, f, pos, c, rows))[1])
    rng = np.random.default_rng(0)
    for starts in ([7, 7, 7], [7, 4, 6]):
        calls["scalar"].clear(), calls["rows"].clear()
        pool = pool_of([rng.standard_normal((9, HD)) for _ in range(3)])
        align_rows(pool, torch.arange(3), starts)
        port.reset_draft_chain_stats()
        reset_rope_path_stats()
        port.propose_chain_batched(
            PORT, torch.ones((3, H), dtype=torch.float64), [1, 2, 3], 3, starts, pool
        )
        if starts == [7, 7, 7]:
            assert calls == {"scalar": [7, 8, 9], "rows": []}
            assert (
                port.draft_chain_stats == {"scalar": 3, "per_row": 0}
                and rope_path_stats["gathered"] == 0
            )
        else:
            assert calls == {"scalar": [], "rows": [[7, 4, 6], [8, 5, 7], [9, 6, 8]]}
            assert (
                port.draft_chain_stats == {"scalar": 0, "per_row": 3}
                and rope_path_stats["uniform"] == 0
            )
        assert pool.lens.tolist() == [s + 3 for s in starts]


@pytest.mark.rule("propose_chain_batched, port")
def test_chain_refusals_and_empty_cases_match_the_reference():
    rng = np.random.default_rng(1)
    ks = [rng.standard_normal((9, HD)) for _ in range(2)]
    seeds = rng.standard_normal((2, H))
    cases = [  # (starts, cache given, aligned)
        ([7], True, False),         # count mismatch: StepRefusal
        ([7, 7], False, False),     # a block without a draft KV: StepRefusal
        ([7, 7], True, False),      # not aligned: held 9, max start 7 -> "desync"
        ([8, 5], True, True),       # fine
    ]
    for starts, with_cache, aligned in cases:
        caches = [ref_draft_cache(k) for k in ks]
        ref_cache = (
            (front_align_draft_group(caches, starts) if aligned else caches[0])
            if with_cache
            else None
        )
        if with_cache and not aligned and len(starts) == 2:
            ref_cache = KvCache.new_normal(4096, 16)
            ref_cache.append(np.stack([k[None] for k in ks]), np.stack([k[None] for k in ks]))
        pool = pool_of(ks) if with_cache else None
        if aligned:
            align_rows(pool, torch.arange(2), starts)
        r = outcome(ref.propose_chain_batched, MODEL, seeds, [1, 2], 3, starts, ref_cache)
        p = outcome(port.propose_chain_batched, PORT, to_port(seeds), [1, 2], 3, starts, pool)
        if assert_same_refusal(p, r, f"chain {starts}"):
            assert host(p[1]).tolist() == r[1]
        else:
            assert r[1] in (StepRefusal, DispatchRefusal)
    empty = torch.zeros((0, H), dtype=torch.float64)
    assert (
        host(port.propose_chain_batched(PORT, to_port(seeds), [1, 2], 0, [7], None)).tolist()
        == ref.propose_chain_batched(MODEL, seeds, [1, 2], 0, [7], None)
        == [[], []]
    )
    assert port.propose_chain_batched(PORT, empty, [], 3, [], None).shape[0] == 0 == \
        len(ref.propose_chain_batched(MODEL, np.zeros((0, H)), [], 3, [], None))


@pytest.mark.rule("propose_chain_batched, port")
def test_a_tier_a_chain_matches_the_reference_without_any_cache():
    rng = np.random.default_rng(2)
    seeds, lasts = rng.standard_normal((3, H)), rng.integers(0, V, 3)
    ref_trace, port_trace = [], []
    want = ref.propose_chain_batched(TIER_A, seeds, lasts, 4, [5, 9, 2], None, ref_trace)
    got = port.propose_chain_batched(
        PORT_A, to_port(seeds), torch.from_numpy(lasts), 4, [5, 9, 2], None, port_trace
    )
    assert host(got).tolist() == want
    for a, b in zip(port_trace, ref_trace, strict=False):
        assert_close64(a, b, what="tier A hidden")


def pool_state(be, k: np.ndarray, filled: int, seed) -> ref.DraftKv:
    """A draft state whose KV is a row of the backend's own pool holding `k [n, hd]` (the
    capacity the reference's draft cache of `k` has)."""
    cache = be.new_draft_cache(PORT)
    n = len(k)
    if n:
        cache.store.reserve(n)
        cache.store.kv.k[cache.idx, 0, :n] = to_port(k)
        cache.store.kv.v[cache.idx, 0, :n] = to_port(k)
        cache.store.kv.set_row_len(cache.idx, n)
        cache.current, cache.materialized = n, True
        cache.capacity = ref_draft_cache(k).k.capacity_seq_len
    return ref.DraftKv(cache=cache, filled=filled, seed=seed)


@st.composite
def write_back_group(draw):
    g = draw(st.integers(1, 4))
    starts = draw(st.lists(st.integers(1, 14), min_size=g, max_size=g))
    if draw(st.booleans()):
        starts = [starts[0]] * g
    tails = draw(
        st.lists(st.integers(-2, 3), min_size=g, max_size=g)
    )  # < 0: a start past the held rows
    return (
        starts,
        tails,
        draw(st.integers(1, 4)),
        draw(st.booleans()),
        draw(st.integers(0, 2**32 - 1)),
    )


@pytest.mark.rule("draft group loop on the pool, port")
@given(case=write_back_group())
def test_the_backend_group_loop_on_pool_rows_is_the_reference_group_loop(case):
    """The group loop the torch backend runs (`TorchBackend.draft_chain` on rows of its
    draft-KV pool) against `group_drafting_loop` (u = 1, w = n + 1, seeds at the chain
    starts): the same drafts and warnings (a uniform group whose members hold different
    lengths is skipped by both; a start past a row's held entries refuses the alignment);
    `filled = start + 1`; each draft KV's length and capacity exact, its history bit-exact,
    its drafted entries within 1e-12."""
    from raggedspec.gpu.backend import TorchBackend

    starts, tails, n, per_seq, seed = case
    g = len(starts)
    rng = np.random.default_rng(seed)
    ks = [rng.standard_normal((max(s + t, 1), HD)) for s, t in zip(starts, tails, strict=False)]
    seeds, lasts = rng.standard_normal((g, H)), rng.integers(0, V, g)
    toks = [[0] * s + [int(lasts[r])] for r, s in enumerate(starts)]
    args = ({(1, 0): list(range(g))}, None, toks, [s + 1 for s in starts], [99] * g, n + 1, per_seq)
    r_states = [ref.DraftKv(cache=ref_draft_cache(k), filled=s, seed=(s, seeds[r]))
                for r, (k, s) in enumerate(zip(ks, starts, strict=False))]
    r_warn: list[str] = []
    r_out = outcome(ref.group_drafting_loop, MODEL, args[0], r_states, *args[2:], r_warn)
    be = TorchBackend(str(DEVICE), "float64")
    p_states = [
        pool_state(be, k, s, (s, to_port(seeds[r])))
        for r, (k, s) in enumerate(zip(ks, starts, strict=False))
    ]
    p_warn: list[str] = []
    p_out = outcome(be.draft_chain, PORT, args[0], p_states, *args[2:], p_warn)
    if not assert_same_refusal(p_out, r_out, "group loop"):
        return
    assert p_out[1] == r_out[1] and p_warn == r_warn
    for r, (p_st, r_st) in enumerate(zip(p_states, r_states, strict=False)):
        assert (p_st.filled, p_st.poisoned) == (r_st.filled, r_st.poisoned)
        view = be.materialize(p_st.cache)
        held = held_k(r_st.cache)
        assert (view["len"], view["capacity"]) == (
            r_st.cache.current_seq_len,
            [r_st.cache.k.capacity_seq_len],
        )
        k_row = view["kv"][0][0][0, 0]
        s = min(starts[r], len(held))
        assert_bit_exact(k_row[:s], held[:s], f"row {r}: history")
        assert_close64(k_row[s:], held[s:], what=f"row {r}: drafted entries")


@pytest.mark.rule("propose_chain on the backend's draft cache, port")
@given(n1=st.integers(0, 3), n2=st.integers(1, 3), seed=st.integers(0, 2**32 - 1))
def test_the_backend_propose_chain_runs_on_its_own_draft_cache(n1, n2, seed):
    """`TorchBackend.propose_chain` on the backend's `new_draft_cache` (a pool row), twice in
    a row (the second chain starts where the first ended), against the reference's
    `propose_chain_batched` on its own draft cache: the same tokens, lengths and capacities,
    the draft KV within 1e-12."""
    from raggedspec.gpu.backend import TorchBackend

    rng = np.random.default_rng(seed)
    be = TorchBackend(str(DEVICE), "float64")
    p_cache, r_cache = be.new_draft_cache(PORT), MODEL.mtp.new_draft_cache()
    start = 0
    for n in (n1, n2):
        seed_h, last = rng.standard_normal((1, H)), int(rng.integers(0, V))
        r_chain = ref.propose_chain_batched(MODEL, seed_h, [last], n, [start], r_cache)
        p_chain = be.propose_chain(PORT, to_port(seed_h), [last], n, [start], p_cache)
        assert p_chain == [list(map(int, c)) for c in r_chain]
        start += n
        view = be.materialize(p_cache)
        assert (view["len"], view["capacity"]) == (
            r_cache.current_seq_len,
            [r_cache.k.capacity_seq_len],
        )
        if start:
            assert_close64(view["kv"][0][0][0, 0], held_k(r_cache), what="draft KV")


# --- extend_draft_kv_row, tensor side ------------------------------------------------------------


@st.composite
def extension_batch(draw):
    """R rows: filled 0..20 with a held tail past it, a capture of width T (shared) at each
    row's own offset (some past `filled`: misaligned), L committed tokens around the
    capture's end (some with nothing to write)."""
    r = draw(st.integers(1, 6))
    t = draw(st.integers(1, 9))
    rows = []
    for _ in range(r):
        filled = draw(st.integers(0, 20))
        tail = draw(st.integers(0, 3))
        off = draw(st.integers(0, filled + draw(st.sampled_from([0, 0, 0, 2]))))
        big_l = draw(st.integers(0, off + t + 2))
        rows.append((filled, tail, off, big_l))
    order = draw(st.permutations(list(range(r + 1))))
    return t, rows, order, draw(st.integers(0, 2**32 - 1))


@pytest.mark.rule("extend_draft_kv_row tensor side, port")
@given(case=extension_batch())
def test_extend_draft_kv_rows_is_extend_draft_kv_row_for_every_row_at_once(case):
    """Reference: `extend_draft_kv_row` row by row. Port: one `extend_draft_kv_rows` call for
    all rows (their (lo, hi) differ: masked scatter) at shuffled pool rows, the reference's
    misaligned rows left out. Same filled and held lengths; draft KV history bit-exact,
    written pairs 1e-12; the extra pool row untouched."""
    t, spec, order, seed = case
    r_n = len(spec)
    rng = np.random.default_rng(seed)
    ks = [rng.standard_normal((f + tail, HD)) for f, tail, _, _ in spec]
    hidden = rng.standard_normal((r_n, t, H))
    toks = [rng.integers(0, V, big_l).tolist() for *_, big_l in spec]
    offs = [off for _, _, off, _ in spec]
    capture = (CaptureOffsets(offs), hidden)
    states = [
        ref.DraftKv(cache=ref_draft_cache(k), filled=f)
        for k, (f, *_rest) in zip(ks, spec, strict=False)
    ]
    verdicts = [
        ref.extend_draft_kv_row(st_, capture, toks[i], i, r_n, MODEL)
        for i, st_ in enumerate(states)
    ]

    # the plan the backend derives per row (host integers): write [lo, hi) where the reference
    # found the capture contiguous
    big_l = [len(x) for x in toks]
    lo = [max(f, off) for (f, *_), off in zip(spec, offs, strict=False)]
    hi = [min(off + t, max(n - 1, 0)) for off, n in zip(offs, big_l, strict=False)]
    write = [bool(v) and h > lo_ for v, lo_, h in zip(verdicts, lo, hi, strict=False)]
    slots = [None] * (r_n + 1)
    for j, k in enumerate(ks + [rng.standard_normal((5, HD))]):
        slots[order[j]] = k
    pool = pool_of(slots)
    before = pool.clone()
    rows = torch.tensor(order[:r_n])
    tokens = np.zeros((r_n, max(1, max(big_l))), dtype=np.int64)
    for i, x in enumerate(toks):
        tokens[i, : len(x)] = x
    port.extend_draft_kv_rows(PORT.mtp, pool, to_port(hidden), offs, lo, hi, tokens, rows, write)
    for i, st_ in enumerate(states):
        if write[i]:
            assert hi[i] == st_.filled
        k_row, v_row = pool.row(int(rows[i]))
        assert k_row.shape[1] == st_.cache.current_seq_len
        assert_bit_exact(v_row, k_row, "V == K")
        lo_i = lo[i] if write[i] else k_row.shape[1]
        assert_bit_exact(k_row[0, :lo_i], held_k(st_.cache)[:lo_i], f"row {i}: history")
        assert_close64(k_row[0, lo_i:], held_k(st_.cache)[lo_i:], what=f"row {i}: written pairs")
    extra = order[r_n]
    assert int(pool.lens[extra]) == 5 and torch.equal(pool.k[extra, :, :5], before.k[extra, :, :5])


@pytest.mark.rule("extend_draft_kv_row tensor side, port")
def test_extend_draft_kv_rows_writes_nothing_past_hi_and_refuses_a_truncate_past_capacity():
    rng = np.random.default_rng(3)
    pool = pool_of([rng.standard_normal((4, HD)), rng.standard_normal((2, HD))])
    before = pool.clone()
    hidden = to_port(rng.standard_normal((2, 6, H)))
    tokens = torch.arange(16).reshape(2, 8) % V
    # row 0 writes 1 pair at 4, row 1 writes 4 pairs at 2: one call, a masked scatter
    port.extend_draft_kv_rows(
        PORT.mtp,
        pool,
        hidden,
        torch.tensor([4, 2]),
        torch.tensor([4, 2]),
        torch.tensor([5, 6]),
        tokens,
    )
    assert pool.lens.tolist() == [5, 6]
    assert torch.equal(pool.k[0, :, 5:], before.k[0, :, 5:]) and torch.equal(
        pool.k[1, :, 6:], before.k[1, :, 6:]
    )
    with pytest.raises(CacheRefusal, match="MTP draft KV truncate to 17 failed"):
        port.extend_draft_kv_rows(
            PORT.mtp,
            pool,
            hidden,
            torch.tensor([17, 0]),
            torch.tensor([17, 0]),
            torch.tensor([18, 0]),
            torch.zeros((2, 20), dtype=torch.int64),
        )
    assert pool.lens.tolist() == [5, 6]
