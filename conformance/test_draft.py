"""Draft KV and the draft chain (cache-and-draft.md §7, §10.2, §17.2, §18). The group drafting
loop (§9.3, §16) is in test_draft_loop.py.

Tolerance: a row drafted inside a ragged group must give the same per-step hidden as that
row drafted alone to `1e-12 * max(1, max|x|)` (float64; the batched softmax additionally sums
exactly-zero terms for the masked dead prefix, which may change summation blocking, ~1e-16),
and exactly the same tokens.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from raggedspec.reference.align import drop_dead_prefix, front_align_draft_group, split_draft_cache
from raggedspec.reference.attention import dsv4_mask_stats, reset_dsv4_mask_stats
from raggedspec.reference.cache import KvCache
from raggedspec.reference.dispatch import CaptureOffsets, MtpHiddenCapture, resolve_capture_offsets
from raggedspec.reference.draft import (
    MAX_DRAFT_KV_SEQS,
    DraftKv,
    DraftKvMap,
    argmax_token,
    extend_draft_cache,
    extend_draft_kv_row,
    extend_draft_kvs,
    group_drafting_loop,
    prime_draft_kv,
    propose_chain,
    propose_chain_batched,
)
from raggedspec.reference.errors import CacheRefusal, Refusal, StepRefusal
from raggedspec.reference.model import MtpBlock, ModelConfig, TinyModel

MODEL = TinyModel()
TIER_A = TinyModel(ModelConfig(mtp="heads"))
H, V = MODEL.cfg.hidden, MODEL.cfg.vocab
EPS = MODEL.cfg.eps


def close(a, b, rel: float = 1e-12) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    return bool(np.all(np.abs(a - b) <= rel * max(1.0, float(np.max(np.abs(b))))))


def my_rms(x, gain):
    return x / np.sqrt((x ** 2).mean(axis=-1, keepdims=True) + EPS) * gain


def my_rope(vec, pos, rope_dims, theta):
    out = vec.copy()
    d0 = vec.shape[-1] - rope_dims
    for k in range(rope_dims // 2):
        ang = pos * theta ** (-(2.0 * k) / rope_dims)
        a, b = vec[d0 + 2 * k], vec[d0 + 2 * k + 1]
        out[d0 + 2 * k] = a * np.cos(ang) - b * np.sin(ang)
        out[d0 + 2 * k + 1] = a * np.sin(ang) + b * np.cos(ang)
    return out


def oracle_slot_k(h: np.ndarray, tok: int, pos: int) -> np.ndarray:
    """Independent oracle of draft-KV slot `pos` holding the pair (h, tok): the MTP layer's
    K is token-local (no attention): RoPE_pos(kv_norm(attn_norm(fused) @ wkv))."""
    block = MODEL.mtp
    layer = block.layer
    fused = (
        my_rms(h, block.hnorm) @ block.heads.h_proj
        + my_rms(MODEL.embed[tok], block.enorm) @ block.heads.e_proj
    )
    kv = my_rms(my_rms(fused, layer.attn_norm) @ layer.wkv, layer.kv_norm)
    return my_rope(kv, pos, MODEL.cfg.rope_dims, MODEL.cfg.rope_theta)


def history(n: int, seed: int, model: TinyModel = MODEL) -> KvCache:
    """A draft cache holding n slots written from random pairs."""
    rng = np.random.default_rng(seed)
    cache = model.mtp.new_draft_cache()
    extend_draft_cache(model.mtp, cache, rng.standard_normal((n, model.cfg.hidden)),
                       rng.integers(0, model.cfg.vocab, n), 0)
    return cache


def state_with(n_held: int, filled: int, seed_pos: int | None, seed: int) -> DraftKv:
    rng = np.random.default_rng(1000 + seed)
    st_ = DraftKv(cache=history(n_held, seed), filled=filled)
    if seed_pos is not None:
        st_.seed = (seed_pos, rng.standard_normal(H))
    return st_


# --- §17.2 argmax and propose_chain ---------------------------------------------------------------


@pytest.mark.rule("argmax_token_picks_max")
def test_argmax_token_picks_max():
    assert argmax_token(np.array([0.1, 0.9, 0.2, 0.5])) == 1


@pytest.mark.rule("propose_chain single-sequence")
def test_propose_chain_returns_depth_tokens():
    small = TinyModel(ModelConfig(hidden=4, vocab=8))
    cache = small.mtp.new_draft_cache()
    chain = propose_chain(small, np.ones(4), 3, depth=3, max_tokens=16, start=0, cache=cache)
    assert len(chain) == 3 and all(0 <= t < 8 for t in chain)
    assert cache.current_seq_len == 3


@pytest.mark.rule("propose_chain single-sequence")
@pytest.mark.parametrize("depth, max_tokens, n", [(5, 2, 2), (4, 4, 4), (8, 0, 0), (0, 8, 0)])
def test_propose_chain_respects_max_tokens_cap(depth, max_tokens, n):
    cache = MODEL.mtp.new_draft_cache()
    chain = propose_chain(MODEL, np.ones(H), 1, depth, max_tokens, 0, cache)
    assert len(chain) == n and cache.current_seq_len == n


@pytest.mark.rule("propose_chain single-sequence", "synthetic_load_smoke.rs MTP checks")
def test_propose_chain_refuses_a_block_without_a_draft_kv():
    with pytest.raises(StepRefusal, match="draft KV"):
        propose_chain(MODEL, np.ones(H), 1, 3, 16, 0, None)
    with pytest.raises(StepRefusal, match="draft KV"):
        propose_chain(MODEL, np.ones(H), 1, 0, 16, 0, None)  # whatever n
    with pytest.raises(StepRefusal, match="draft KV"):
        propose_chain_batched(MODEL, np.ones((2, H)), [1, 2], 2, [0, 0], None)


@pytest.mark.rule("extend_draft_cache", "synthetic_load_smoke.rs MTP checks")
def test_smoke_a_prefill_of_five_context_positions_then_two_drafts():
    """masks §22 smoke: prefill of 5 context positions -> cache 5, two drafts -> 7."""
    rng = np.random.default_rng(4)
    cache = MODEL.mtp.new_draft_cache()
    assert (
        extend_draft_cache(MODEL.mtp, cache, rng.standard_normal((5, H)), [1, 2, 3, 4, 5], 0) == 5
    )
    assert cache.current_seq_len == 5
    assert len(propose_chain(MODEL, rng.standard_normal(H), 5, 2, 16, 5, cache)) == 2
    assert cache.current_seq_len == 7


@pytest.mark.rule("propose_chain single-sequence", "synthetic_load_smoke.rs MTP checks")
def test_smoke_a_stale_start_on_an_empty_cache_is_a_desync():
    with pytest.raises(Refusal) as err:
        propose_chain(MODEL, np.ones(H), 1, 2, 16, 137, MODEL.mtp.new_draft_cache())
    assert "desync" in str(err.value) and "137" in str(err.value)


@pytest.mark.rule("propose_chain_batched: scalar vs per-row positions")
def test_propose_chain_batched_empty_cases_and_refusals():
    cache = history(4, 0)
    assert propose_chain_batched(MODEL, np.ones((3, H)), [1, 2, 3], 0, [4, 4, 4], cache) == [
        [],
        [],
        [],
    ]
    assert propose_chain_batched(MODEL, np.ones((0, H)), [], 3, [], cache) == []
    assert cache.current_seq_len == 4  # nothing ran
    with pytest.raises(StepRefusal, match="1 chain start\\(s\\) for a draft group of 2"):
        propose_chain_batched(MODEL, np.ones((2, H)), [1, 2], 2, [4], cache)


@pytest.mark.rule("the chain feeds the pre-norm hidden forward")
def test_the_chain_feeds_the_pre_norm_hidden_and_the_drafted_token_forward():
    """Oracle loop from the block's primitives: step i runs at start + i on
    fuse(prev, tok); prev := the pre-norm hidden, tok := argmax lm_head(norm_out(hidden))."""
    block = MODEL.mtp
    rng = np.random.default_rng(8)
    seed_h, last = rng.standard_normal((2, H)), [3, 9]
    trace: list = []
    c1 = front_align_draft_group([history(6, 1), history(6, 2)], [6, 6])
    c2 = front_align_draft_group([history(6, 1), history(6, 2)], [6, 6])
    chains = propose_chain_batched(MODEL, seed_h, last, 4, [6, 6], c1, trace)
    prev, toks, want, hs = seed_h, np.array(last), [[], []], []
    for i in range(4):
        hidden = block.forward_step(block.fuse(prev[:, None], toks[:, None]), 6 + i, c2)[:, 0]
        toks = np.array([int(np.argmax(r)) for r in block.logits(hidden)])
        for r in range(2):
            want[r].append(int(toks[r]))
        hs.append(hidden)
        prev = hidden
    assert chains == want
    assert all(np.array_equal(a, b) for a, b in zip(trace, hs, strict=False))
    assert c1.current_seq_len == 10 and np.array_equal(c1.k.current_data(), c2.k.current_data())


@pytest.mark.rule("Tier A chain")
def test_a_tier_a_chain_uses_no_position_and_no_cache():
    rng = np.random.default_rng(2)
    seed_h = rng.standard_normal((2, H))
    chains = propose_chain_batched(TIER_A, seed_h, [1, 2], 3, [100, 5], None)
    heads = TIER_A.mtp_heads
    prev, toks, want = seed_h, np.array([1, 2]), [[], []]
    for _ in range(3):
        fused = prev @ heads.h_proj + TIER_A.embed[toks] @ heads.e_proj
        toks = np.argmax(fused @ TIER_A.lm_head, axis=1)
        for r in range(2):
            want[r].append(int(toks[r]))
        prev = fused
    assert chains == want
    assert propose_chain(TIER_A, seed_h[0], 1, 3, 16, 999, None) == want[0]


# --- the chain's dispatch: uniform vs per-row
# ------------------------------------------------------


class StepSpy:
    def __init__(self, monkeypatch):
        self.scalar: list[int] = []
        self.rows: list[list[int]] = []
        self.entry_len: list[int] = []
        spy = self
        orig_step, orig_rows = MtpBlock.forward_step, MtpBlock.forward_step_rows

        def forward_step(block, fused, pos, cache):
            spy.scalar.append(pos)
            return orig_step(block, fused, pos, cache)

        def forward_step_rows(block, fused, positions, cache):
            spy.rows.append(list(positions))
            return orig_rows(block, fused, positions, cache)

        monkeypatch.setattr(MtpBlock, "forward_step", forward_step)
        monkeypatch.setattr(MtpBlock, "forward_step_rows", forward_step_rows)


@pytest.mark.rule("propose_chain_batched: scalar vs per-row positions")
def test_a_uniform_draft_group_never_reaches_the_ragged_chain_path(monkeypatch):
    spy = StepSpy(monkeypatch)
    caches = [history(9, s) for s in range(3)]
    batched = front_align_draft_group(caches, [7, 7, 7])
    reset_dsv4_mask_stats()
    propose_chain_batched(MODEL, np.ones((3, H)), [1, 2, 3], 3, [7, 7, 7], batched)
    assert spy.scalar == [7, 8, 9] and spy.rows == []
    assert dsv4_mask_stats["ragged"] == 0


@pytest.mark.rule(
    "forward_tokens_rows and its wrappers",
    "propose_chain_batched: scalar vs per-row positions",
)
def test_a_ragged_draft_group_runs_every_step_at_each_rows_own_position(monkeypatch):
    spy = StepSpy(monkeypatch)
    caches = [history(9, s) for s in range(3)]
    batched = front_align_draft_group(caches, [7, 4, 6])
    reset_dsv4_mask_stats()
    propose_chain_batched(MODEL, np.ones((3, H)), [1, 2, 3], 3, [7, 4, 6], batched)
    assert spy.scalar == [] and spy.rows == [[7, 4, 6], [8, 5, 7], [9, 6, 8]]
    assert dsv4_mask_stats["ragged"] == 3
    assert batched.current_seq_len == 10  # max(starts) + n


@pytest.mark.rule(
    "forward_tokens_rows and its wrappers",
    "propose_chain_batched: scalar vs per-row positions",
    "group loop: write-back with split and strip, then record drafts",
)
@given(st.data())
def test_a_ragged_draft_group_drafts_each_row_as_if_alone(data):
    g = data.draw(st.integers(1, 4), label="G")
    starts = data.draw(st.lists(st.integers(1, 14), min_size=g, max_size=g), label="starts")
    tails = data.draw(
        st.lists(st.integers(0, 3), min_size=g, max_size=g), label="speculative tails"
    )
    n = data.draw(st.integers(1, 4), label="n")
    seed = data.draw(st.integers(0, 2 ** 31), label="seed")
    rng = np.random.default_rng(seed)
    seeds, lasts = rng.standard_normal((g, H)), rng.integers(0, V, g)
    caches = [history(s + t, seed + r) for r, (s, t) in enumerate(zip(starts, tails, strict=False))]
    batched = front_align_draft_group(caches, starts)
    trace: list = []
    chains = propose_chain_batched(MODEL, seeds, lasts, n, starts, batched, trace)
    leads = [max(starts) - s for s in starts]
    pieces = split_draft_cache(batched, g)
    for r in range(g):
        alone_cache = caches[r].clone()
        alone_cache.set_len(starts[r])
        alone_trace: list = []
        alone = propose_chain_batched(
            MODEL, seeds[r : r + 1], lasts[r : r + 1], n, [starts[r]], alone_cache, alone_trace
        )
        assert chains[r] == alone[0]
        for step in range(n):
            assert close(trace[step][r], alone_trace[step][0]), f"row {r} step {step}"
        drop_dead_prefix(pieces[r], leads[r])
        assert pieces[r].current_seq_len == starts[r] + n
        assert close(pieces[r].k.current_data(), alone_cache.k.current_data())
    # the same group through the group loop (u = 1, w = n + 1, own KV = start + 1)
    states = [
        DraftKv(cache=c, filled=s, seed=(s, seeds[r]))
        for r, (c, s) in enumerate(zip(caches, starts, strict=False))
    ]
    toks = [[0] * s + [int(lasts[r])] for r, s in enumerate(starts)]
    warnings: list[str] = []
    drafts = group_drafting_loop(
        MODEL,
        {(1, 0): list(range(g))},
        states,
        toks,
        [s + 1 for s in starts],
        [99] * g,
        n + 1,
        True,
        warnings,
    )
    unbatchable = (
        g > 1
        and len(set(starts)) == 1
        and len({(c.current_seq_len, c.k.capacity_seq_len) for c in caches}) > 1
    )
    if unbatchable:  # a uniform group takes batch_draft_caches, which refuses unequal histories
        assert (
            drafts == [[]] * g
            and len(warnings) == 1
            and all(st_.filled == s for st_, s in zip(states, starts, strict=False))
        )
    else:
        assert drafts == chains and warnings == []
        assert [st_.filled for st_ in states] == [s + 1 for s in starts]
        assert [st_.cache.current_seq_len for st_ in states] == [s + n for s in starts]


# --- §7.1 the map
# ------------------------------------------------------------------------------------


@pytest.mark.rule("DraftKv and the map: checkout, LRU checkin, drop, clear")
def test_checkout_creates_a_fresh_state_with_an_empty_draft_cache():
    m = DraftKvMap(MODEL.mtp)
    s = m.checkout_draft_kv("a")
    assert (s.filled, s.poisoned, s.seed) == (0, False, None)
    assert s.cache.current_seq_len == 0 and s.cache.k.capacity_seq_len == 16
    assert DraftKvMap(None).checkout_draft_kv("a").cache is None  # Tier A


@pytest.mark.rule("DraftKv and the map: checkout, LRU checkin, drop, clear")
def test_checkout_removes_an_existing_entry_and_checkin_reinserts_it():
    m = DraftKvMap(MODEL.mtp)
    s = m.checkout_draft_kv("a")
    s.filled = 5
    m.checkin("a", s)
    assert len(m.entries) == 1
    again = m.checkout_draft_kv("a")
    assert again is s and again.filled == 5 and len(m.entries) == 0


@pytest.mark.rule("DraftKv and the map: checkout, LRU checkin, drop, clear")
def test_checkin_evicts_the_least_recently_used_beyond_64():
    assert MAX_DRAFT_KV_SEQS == 64
    m = DraftKvMap(MODEL.mtp)
    for i in range(64):
        m.checkin(i, DraftKv(cache=None))
    m.checkin(0, m.entries[0])  # re-stamped in place: 0 is now the most recent, 1 the oldest
    m.checkin(64, DraftKv(cache=None))
    assert len(m.entries) == 64 and 1 not in m.entries and 0 in m.entries and 64 in m.entries
    stamps = [m.entries[k].last_used for k in (2, 0, 64)]
    assert stamps == sorted(stamps)


@pytest.mark.rule("DraftKv and the map: checkout, LRU checkin, drop, clear")
def test_drop_removes_and_flushes_and_clear_empties_the_whole_map():
    m = DraftKvMap(MODEL.mtp)
    for i in range(3):
        m.checkin(i, m.checkout_draft_kv(i))
    flushed = []
    assert m.drop_draft_kv(1, flush=flushed.append) is not None
    assert flushed == [1] and sorted(m.entries) == [0, 2]
    m.clear_draft_kv()
    assert m.entries == {}


# --- §7.2 extend_draft_kv_row
# ----------------------------------------------------------------------


@pytest.mark.rule(
    "draft-KV slot invariant: slot k holds (h_k, tok_{k+1}) at absolute k",
    "§7.3 worked example (cohort, w=4)",
)
def test_the_cohort_worked_example():
    """§7.3: row 1, C=10, u=2, 2 proposed, 1 accepted, L 12 -> 14; filled = 11 -> 13,
    seed (12, h[1,2]), slots 11 and 12 written from hidden rows 1..3 with toks[12..14]."""
    rng = np.random.default_rng(73)
    state = DraftKv(cache=history(12, 5), filled=11)  # last chain left 10 + 2 entries
    before = state.cache.k.current_data().copy()
    toks = rng.integers(0, V, 14).tolist()
    hidden = rng.standard_normal((2, 4, H))
    capture = (resolve_capture_offsets([10, 10]), hidden)
    assert extend_draft_kv_row(state, capture, toks, 1, 2, MODEL) is True
    assert state.filled == 13 and state.cache.current_seq_len == 13
    assert state.seed[0] == 12 and np.array_equal(state.seed[1], hidden[1, 2])
    k = state.cache.k.current_data()
    assert np.array_equal(k[:, :, :11], before[:, :, :11])  # committed slots untouched
    for slot, j in ((11, 1), (12, 2)):
        assert close(k[0, 0, slot], oracle_slot_k(hidden[1, j], toks[slot + 1], slot))
    # next step (another row pinned keep = 1): C' = 11, u' = 3 -> chain start 12 = the seed
    assert state.seed[0] == 11 + 3 - 2 and state.filled >= 12


@pytest.mark.rule(
    "extend_draft_kv_row checks 1-13 in order",
    "extend after the verify forward; Ok(false) / Err poison",
)
def test_per_row_capture_offsets_extend_each_row_from_its_own_offset():
    """§16 PerSequence draft side: filled [12, 10], capture offsets [12, 10], hidden [2,4,H];
    A commits 3 (L 13 -> 16), B commits 1 (L 11 -> 12) -> filled [15, 11], seeds at 14, 10."""
    rng = np.random.default_rng(16)
    a, b = DraftKv(cache=history(14, 1), filled=12), DraftKv(cache=history(12, 2), filled=10)
    toks = [rng.integers(0, V, 16).tolist(), rng.integers(0, V, 12).tolist()]
    hidden = rng.standard_normal((2, 4, H))
    capture = (resolve_capture_offsets([12, 10]), hidden)
    extend_draft_kvs([a, b], capture, toks, 2, MODEL)
    assert (a.filled, b.filled) == (15, 11) and not a.poisoned and not b.poisoned
    assert a.seed[0] == 14 and np.array_equal(a.seed[1], hidden[0, 2])
    assert b.seed[0] == 10 and np.array_equal(b.seed[1], hidden[1, 0])
    assert close(a.cache.k.data[0, 0, 12], oracle_slot_k(hidden[0, 0], toks[0][13], 12))
    assert close(a.cache.k.data[0, 0, 14], oracle_slot_k(hidden[0, 2], toks[0][15], 14))
    assert close(b.cache.k.data[0, 0, 10], oracle_slot_k(hidden[1, 0], toks[1][11], 10))


class NoRowOffsets:
    """An offsets object that describes the batch but has no value for the row (check 7)."""

    def describes(self, b):
        return True

    def row(self, r):
        return None


def fresh(filled=4, poisoned=False):
    return DraftKv(cache=history(filled, 3), filled=filled, poisoned=poisoned)


def cap(offsets, shape):
    return (CaptureOffsets(offsets), np.zeros(shape))


@pytest.mark.rule("extend_draft_kv_row checks 1-13 in order")
@pytest.mark.parametrize("case, state, capture, row, batch, model, result", [
    ("1 poisoned", fresh(poisoned=True), cap([4], (1, 2, H)), 0, 1, MODEL, False),
    ("1 before 2", fresh(poisoned=True), None, 0, 1, MODEL, False),
    ("2 no capture", fresh(), None, 0, 1, MODEL, True),
    ("3 Tier A", fresh(), cap([4], (1, 2, H)), 0, 1, TIER_A, True),
    ("3 before 4", fresh(), cap([4], (1, 1, 2, H)), 0, 1, TIER_A, True),
    ("5 dim0 != batch", fresh(), cap([4], (2, 2, H)), 0, 3, MODEL, False),
    ("5 row >= batch", fresh(), cap([4], (2, 2, H)), 2, 2, MODEL, False),
    ("6 does not describe", fresh(), cap([4, 4, 4], (2, 2, H)), 0, 2, MODEL, False),
    ("7 row None", fresh(), (NoRowOffsets(), np.zeros((2, 2, H))), 0, 2, MODEL, False),
    ("8 off > filled", fresh(filled=4), cap([5], (1, 2, H)), 0, 1, MODEL, False),
])
def test_every_early_return_of_extend_draft_kv_row(case, state, capture, row, batch, model, result):
    before = (state.filled, state.seed, state.cache.current_seq_len)
    assert extend_draft_kv_row(state, capture, list(range(9)), row, batch, model) is result, case
    assert (
        state.filled,
        state.seed,
        state.cache.current_seq_len,
    ) == before  # nothing written or seeded


@pytest.mark.rule("extend_draft_kv_row checks 1-13 in order")
def test_a_capture_of_any_other_rank_is_an_error():
    with pytest.raises(StepRefusal, match="rank 4"):
        extend_draft_kv_row(fresh(), cap([4], (1, 1, 2, H)), list(range(9)), 0, 1, MODEL)
    with pytest.raises(StepRefusal, match="rank 1"):
        extend_draft_kv_row(fresh(), cap([4], (H,)), list(range(9)), 0, 1, MODEL)


@pytest.mark.rule("extend_draft_kv_row checks 1-13 in order")
def test_a_rank_2_capture_is_a_batch_of_one():
    rng = np.random.default_rng(0)
    state, hidden = fresh(filled=4), rng.standard_normal((3, H))
    toks = list(range(8))  # L = 8: writes pairs 4, 5, 6; seed at 6
    assert extend_draft_kv_row(state, (CaptureOffsets([4]), hidden), toks, 0, 1, MODEL) is True
    assert state.filled == 7 and state.seed[0] == 6 and np.array_equal(state.seed[1], hidden[2])
    assert extend_draft_kv_row(fresh(), (CaptureOffsets([4]), hidden), toks, 0, 2, MODEL) is False


@pytest.mark.rule("extend_draft_kv_row checks 1-13 in order")
def test_nothing_to_write_keeps_filled_but_may_move_the_seed():
    rng = np.random.default_rng(1)
    state, hidden = fresh(filled=6), rng.standard_normal((1, 3, H))
    # off 3, T 3: positions 3..5 all below filled 6; L = 7 -> p = 5 in [3, 6)
    assert (
        extend_draft_kv_row(state, (CaptureOffsets([3]), hidden), list(range(7)), 0, 1, MODEL)
        is True
    )
    assert state.filled == 6 and state.cache.current_seq_len == 6
    assert state.seed[0] == 5 and np.array_equal(state.seed[1], hidden[0, 2])
    # a seed outside the captured block keeps the old seed
    old = state.seed
    assert (
        extend_draft_kv_row(state, (CaptureOffsets([3]), hidden), list(range(12)), 0, 1, MODEL)
        is True
    )
    assert state.seed is old


@pytest.mark.rule("extend_draft_kv_row checks 1-13 in order")
def test_hi_never_exceeds_l_minus_1():
    """Only pairs (h_i, tok_{i+1}) with i <= L-2 are written: a capture reaching L never
    writes position L-1 (its next token is not committed)."""
    rng = np.random.default_rng(2)
    state, hidden = fresh(filled=4), rng.standard_normal((1, 4, H))
    assert (
        extend_draft_kv_row(state, (CaptureOffsets([4]), hidden), list(range(8)), 0, 1, MODEL)
        is True
    )
    assert state.filled == 7 and state.cache.current_seq_len == 7


@pytest.mark.rule("extend_draft_kv_row checks 1-13 in order")
def test_a_failed_truncate_is_an_error_naming_filled():
    state = DraftKv(cache=history(12, 0), filled=20)  # capacity 16: set_len(20) is refused
    with pytest.raises(CacheRefusal, match="MTP draft KV truncate to 20 failed"):
        extend_draft_kv_row(state, cap([20], (1, 3, H)), list(range(25)), 0, 1, MODEL)


@pytest.mark.rule("extend_draft_cache")
def test_extend_draft_cache_without_a_block_or_tokens():
    cache = history(5, 0)
    assert extend_draft_cache(None, cache, np.zeros((2, H)), [1, 2], 5) == 5
    assert extend_draft_cache(MODEL.mtp, cache, np.zeros((0, H)), [], 9) == 9
    assert cache.current_seq_len == 5
    with pytest.raises(Refusal, match="desync"):
        extend_draft_cache(MODEL.mtp, cache, np.zeros((1, H)), [1], 4)


@pytest.mark.rule("extend_draft_kv_row checks 1-13 in order")
def test_a_block_state_without_a_cache_only_advances_filled():
    """Check 11, the (unreachable in practice) cache-less branch: filled = hi, nothing run."""
    state = DraftKv(cache=None, filled=2)
    assert (
        extend_draft_kv_row(
            state, (CaptureOffsets([2]), np.ones((1, 3, H))), list(range(9)), 0, 1, MODEL
        )
        is True
    )
    assert state.filled == 5 and state.seed is None  # p = 7 is outside [2, 5)


@pytest.mark.rule("Tier A chain")
def test_a_seeded_tier_a_group_drafts_without_any_cache():
    """Unspecified, chosen: without a block the loop runs the heads-only chain and writes
    nothing back (Tier A never gets a seed from the capture, so only a hand-seeded state
    reaches this)."""
    s = DraftKv(cache=None, filled=11, seed=(11, np.ones(H)))
    drafts = group_drafting_loop(
        TIER_A, {(1, 11): [0]}, [s], [list(range(13))], [12], [9], 4, False
    )
    assert (
        drafts == [propose_chain(TIER_A, np.ones(H), 12, 3, 99, 11, None)] and len(drafts[0]) == 3
    )
    assert s.filled == 11 and s.cache is None


@pytest.mark.rule("extend_draft_kv_row checks 1-13 in order")
def test_a_tier_a_row_never_gets_a_seed():
    state = DraftKv(cache=None)
    hidden = np.ones((1, 5, H))
    assert (
        extend_draft_kv_row(state, (CaptureOffsets([0]), hidden), list(range(6)), 0, 1, TIER_A)
        is True
    )
    assert state.seed is None and state.filled == 0


# --- §7.4 prompt priming
# ------------------------------------------------------------------------------


@pytest.mark.rule("prompt-time priming")
def test_prompt_priming_fills_l_minus_1_and_seeds_l_minus_2():
    rng = np.random.default_rng(74)
    prompts = rng.integers(0, V, (2, 7))
    capture = MtpHiddenCapture()
    capture.arm()
    cache = MODEL.new_cache()
    fwd = MODEL.forward(prompts, cache, [0], capture=capture)
    sampled = [int(np.argmax(fwd.logits[i, -1])) for i in range(2)]
    toks = [prompts[i].tolist() + [sampled[i]] for i in range(2)]  # L = 8 each
    m = DraftKvMap(MODEL.mtp)
    states = [m.checkout_draft_kv(i) for i in range(2)]
    warnings: list[str] = []
    prime_draft_kv(states, capture.take(), toks, 2, MODEL, warnings)
    assert warnings == []
    for i, s in enumerate(states):
        assert s.filled == 7 and s.cache.current_seq_len == 7
        assert s.seed[0] == 6 and np.array_equal(s.seed[1], fwd.hidden[i, 6])
        assert close(s.cache.k.data[0, 0, 3], oracle_slot_k(fwd.hidden[i, 3], toks[i][4], 3))
    # the next decode step (C = 7, u = 1) can draft: its chain start is the seed
    drafts = group_drafting_loop(
        MODEL, {(1, 6): [0, 1]}, states, toks, [7, 7], [100, 100], 4, False
    )
    assert [len(d) for d in drafts] == [3, 3]
    assert [s.filled for s in states] == [7, 7] and [s.cache.current_seq_len for s in states] == [
        9,
        9,
    ]


@pytest.mark.rule("prompt-time priming")
def test_a_prefix_cache_hit_poisons_the_sequence_for_good():
    state = DraftKvMap(MODEL.mtp).checkout_draft_kv("p")
    warnings: list[str] = []
    prime_draft_kv(
        [state],
        (resolve_capture_offsets([5]), np.zeros((1, 3, H))),
        list(range(9)),
        1,
        MODEL,
        warnings,
    )
    assert state.poisoned and state.filled == 0 and state.seed is None
    assert len(warnings) == 1 and "prefix-cache hit / chunked prefill" in warnings[0]
    assert (
        extend_draft_kv_row(
            state, (resolve_capture_offsets([0]), np.zeros((1, 3, H))), list(range(4)), 0, 1, MODEL
        )
        is False
    )


@pytest.mark.rule("extend after the verify forward; Ok(false) / Err poison")
def test_an_extension_error_poisons_only_that_row():
    good, bad = fresh(filled=4), DraftKv(cache=history(12, 0), filled=20)
    warnings: list[str] = []
    hidden = np.zeros((2, 3, H))
    extend_draft_kvs(
        [good, bad],
        (CaptureOffsets([4, 20]), hidden),
        [list(range(9)), list(range(25))],
        2,
        MODEL,
        warnings,
    )
    assert bad.poisoned and not good.poisoned and good.filled == 7
    assert len(warnings) == 1 and "row 1" in warnings[0] and "truncate to 20" in warnings[0]
